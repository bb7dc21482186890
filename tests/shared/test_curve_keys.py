"""`kvserve curve-keys` and the key files each side needs: written once with safe modes, and every missing,
unreadable or malformed file is one start-up error naming it, exit code 2, before any model loads."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
import zmq.auth

from shared.curve_keys import load_executor_keys, load_gateway_keys
from tests.processes import run_kvserve

KEY_FILES = ["executor.key", "executor.key_secret", "gateway.key", "gateway.key_secret"]


def kvserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVSERVE_CPU_KERNELS": "0"}
    env.pop("KVSERVE_CURVE_KEYS", None)
    return run_kvserve(*args, env=env, timeout=timeout)


def test_curve_keys_writes_both_pairs_secrets_private_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "keys"
    made = kvserve("curve-keys", "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in out.iterdir()) == KEY_FILES
    for name in KEY_FILES:
        mode = stat.S_IMODE((out / name).stat().st_mode)
        assert mode == (0o600 if name.endswith("_secret") else 0o644), (name, oct(mode))
    # zmq's own reader takes them, and each secret file holds the pair of its public file
    for name in ("executor", "gateway"):
        public, secret = zmq.auth.load_certificate(out / f"{name}.key_secret")
        assert (
            zmq.auth.load_certificate(out / f"{name}.key")[0] == public and zmq.curve_public(secret) == public
        )
    assert load_executor_keys(out).peers == (zmq.auth.load_certificate(out / "gateway.key")[0],)
    assert load_gateway_keys(out).peers == (zmq.auth.load_certificate(out / "executor.key")[0],)

    before = {name: (out / name).read_bytes() for name in KEY_FILES}
    again = kvserve("curve-keys", "--out", str(out))
    assert again.returncode == 2 and "--force" in again.stderr and "executor.key" in again.stderr
    assert {name: (out / name).read_bytes() for name in KEY_FILES} == before
    forced = kvserve("curve-keys", "--out", str(out), "--force")
    assert forced.returncode == 0 and (out / "executor.key").read_bytes() != before["executor.key"]


def test_if_missing_makes_keys_once_and_then_keeps_them_as_an_init_step_needs(tmp_path):
    out = tmp_path / "keys"
    assert kvserve("curve-keys", "--out", str(out), "--if-missing").returncode == 0
    made = {name: (out / name).read_bytes() for name in KEY_FILES}
    kept = kvserve("curve-keys", "--out", str(out), "--if-missing")
    assert kept.returncode == 0 and "kept" in kept.stderr
    assert {name: (out / name).read_bytes() for name in KEY_FILES} == made
    (out / "gateway.key_secret").write_text("not a certificate\n")  # broken, not missing: said, not replaced
    broken = kvserve("curve-keys", "--out", str(out), "--if-missing")
    assert broken.returncode == 2 and "gateway.key_secret" in broken.stderr
    (out / "gateway.key_secret").unlink()  # one missing of four: refused like a plain run, nothing replaced
    partial = kvserve("curve-keys", "--out", str(out), "--if-missing")
    assert partial.returncode == 2 and (out / "executor.key").read_bytes() == made["executor.key"]


def test_executor_authorizes_every_other_public_key_in_its_directory(tmp_path):
    kvserve("curve-keys", "--out", str(tmp_path))
    public, _ = zmq.auth.create_certificates(tmp_path, "second-gateway")
    peers = load_executor_keys(tmp_path).peers
    assert len(peers) == 2 and zmq.auth.load_certificate(public)[0] in peers
    assert zmq.auth.load_certificate(tmp_path / "executor.key")[0] not in peers


def _broken(tmp_path, how: str, name: str):
    keys = tmp_path / "keys"
    assert kvserve("curve-keys", "--out", str(keys)).returncode == 0
    path = keys / name
    if how == "missing":
        path.unlink()
    elif how == "malformed":
        path.write_text('curve\n    public-key = "not a key"\n    secret-key = "nor this"\n')
    elif how == "unreadable":  # what root cannot read either, whatever the mode
        path.unlink()
        path.mkdir()
    elif how == "not a certificate":
        path.write_text("hello\n")
    elif how == "of another pair":  # a secret file whose public line was edited to another key
        other, _ = zmq.curve_keypair()
        text = path.read_text().splitlines()
        path.write_text(
            "\n".join(f'    public-key = "{other.decode()}"' if "public-key" in t else t for t in text)
        )
    return keys, path


FILES_OF = [
    ("executor", "executor.key_secret"),
    ("executor", "gateway.key"),
    ("gateway", "gateway.key_secret"),
    ("gateway", "executor.key"),
]
BREAKAGES = ["missing", "unreadable", "malformed", "not a certificate", "of another pair"]


@pytest.mark.parametrize(
    "command, name, how",
    [
        (command, name, how)
        for command, name in FILES_OF
        for how in BREAKAGES
        if how != "of another pair" or name.endswith("_secret")  # a public file alone has no pair
    ],
)
def test_a_bad_key_file_is_one_start_up_error_naming_it_exit_2(tmp_path, command, name, how):
    keys, path = _broken(tmp_path, how, name)
    args = {
        "executor": ["executor", "--executor-id", "x", "--bind", "tcp://127.0.0.1:1"],
        "gateway": ["gateway"],
    }[command]
    # Redis is never reached: the keys are checked first
    done = kvserve(*args, "--redis-url", "redis://127.0.0.1:1", "--curve-keys", str(keys))
    assert done.returncode == 2, done.stderr
    assert str(path) in done.stderr and "--curve-keys" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_up_checks_given_keys_before_starting_anything(tmp_path, tiny_models):
    keys, path = _broken(tmp_path, "missing", "gateway.key_secret")
    done = kvserve(
        "up", "--model", tiny_models["llama"], "--curve-keys", str(keys), "--redis-url", "redis://127.0.0.1:1"
    )
    assert done.returncode == 2 and str(path) in done.stderr and "Traceback" not in done.stderr, done.stderr

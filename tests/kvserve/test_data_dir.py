"""The data directory of `kvserve up`'s store: where it is, and that it and its password are this user's alone."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvserve.data_dir import DataDirError, data_dir_path, open_data_dir


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_flag_wins_then_kvserve_home_then_xdg_then_local_share(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    both = {"KVSERVE_HOME": "/k", "XDG_DATA_HOME": "/x"}
    assert data_dir_path("/flag", both) == Path("/flag")
    assert data_dir_path(None, both) == Path("/k")
    assert data_dir_path(None, {"XDG_DATA_HOME": "/x", "KVSERVE_HOME": ""}) == Path("/x/kvserve")
    assert data_dir_path(None, {}) == tmp_path / "home" / ".local" / "share" / "kvserve"
    assert data_dir_path("~/d", {}) == tmp_path / "home" / "d"


def test_a_new_data_directory_is_0700_and_its_password_0600_made_once(tmp_path):
    data = open_data_dir(tmp_path / "parent" / "kvserve")
    assert mode(data.path) == 0o700 and mode(data.redis_dir) == 0o700
    password = data.password()
    assert len(password) >= 32 and mode(data.password_file) == 0o600
    assert open_data_dir(data.path).password() == password  # kept, not made again


def test_a_data_directory_other_users_may_enter_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(DataDirError, match=f"mode 755 lets other users in; `chmod 700 {shared}`"):
        open_data_dir(shared)
    (tmp_path / "file").write_text("")
    with pytest.raises(DataDirError, match="not a directory"):
        open_data_dir(tmp_path / "file")

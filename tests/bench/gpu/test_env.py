"""bench/gpu/env.py: a module that does not import is named with its traceback, and the stage fails for it."""

from __future__ import annotations

import json

from bench.gpu import env


def test_a_module_that_does_not_import_is_named_with_its_traceback():
    failures = env.import_failures(("json", "bench.no_such_module"))
    assert list(failures) == ["bench.no_such_module"]
    assert "ModuleNotFoundError: No module named 'bench.no_such_module'" in failures["bench.no_such_module"]


def test_report_and_exit_status(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(env, "MODULES", ("json", "bench.no_such_module"))
    monkeypatch.setattr(env, "import_failures", lambda: {"bench.no_such_module": "Traceback ..."})
    out = tmp_path / "env.json"
    assert env.main(["--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert set(report["versions"]) == {"python", "torch", "triton", "transformers", "pytest-timeout"}
    assert report["import_failures"] == {"bench.no_such_module": "Traceback ..."}
    assert "error: bench.no_such_module does not import" in capsys.readouterr().err

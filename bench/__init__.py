"""Benchmarks, fault drills and the GPU session. Here: `kvserve bench` (load.py, with metrics.py, prompts.py,
stream.py and server_metrics.py, which the others reuse) and the quantization benchmarks; beside them offline/,
serving/, faults/, tenancy/ and gpu/. Each runs as `python -m bench.<group>.<name>` from the repository root."""

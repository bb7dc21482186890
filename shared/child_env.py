"""The environment a child process starts with: what it needs to run, never all of its parent's.

A parent's environment may hold what no child needs: the Redis URL with its password, another service's token.
`kvserve up`'s executors get what an engine reads (Python, its native libraries and threads, accelerators,
compilers, model caches, tracing, kvserve's own settings) and then the Redis URL, explicitly; its embedded Redis
and the executor's grammar compile process, which runs clients' grammars, get only what runs Python.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# what starts Python and the native libraries it loads, and sets how many threads they run
_PYTHON_NAMES = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH"}
    | {"LD_PRELOAD", "CONDA_PREFIX", "GLIBC_TUNABLES"}
)
_PYTHON_PREFIXES = ("LC_", "PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "MALLOC_")
# what an engine adds: accelerators, kernel compilers, model caches and downloads, tracing, kvserve's settings
_ENGINE_NAMES = frozenset(
    {"CC", "CXX", "CFLAGS", "CXXFLAGS", "LDFLAGS", "CPATH", "LIBRARY_PATH", "MAX_JOBS", "ATEN_CPU_CAPABILITY"}
    | {"SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"}
    | {"HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"}
)
_ENGINE_PREFIXES = (
    *("CUDA_", "NVIDIA_", "CUBLAS", "CUDNN_", "NCCL_", "TORCH", "PYTORCH_", "TRITON_", "HIP_", "ROCM_"),
    *("DNNL_", "ONEDNN_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "XDG_", "OTEL_", "KVSERVE_"),
)
# kvserve's secrets: whoever needs one is handed it by name
_SECRETS = frozenset({"KVSERVE_REDIS_URL", "KVSERVE_REDIS_PASSWORD", "KVSERVE_GRAFANA_PASSWORD"})


def python_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What runs Python (and a server binary) here: its path, locale, home, virtual environment, thread settings."""
    return _kept(environ, _PYTHON_NAMES, _PYTHON_PREFIXES)


def engine_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What an executor or a model pull reads, kvserve's secrets left out."""
    return _kept(environ, _PYTHON_NAMES | _ENGINE_NAMES, _PYTHON_PREFIXES + _ENGINE_PREFIXES)


def _kept(environ: Mapping[str, str], names: frozenset[str], prefixes: tuple[str, ...]) -> dict[str, str]:
    return {
        name: value
        for name, value in environ.items()
        if name not in _SECRETS and (name in names or name.startswith(prefixes))
    }

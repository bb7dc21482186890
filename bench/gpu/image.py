"""The GPU machine's Python packages, and a way to run anything here as if only those were installed.

A GPU session runs under that machine's image (the device tool's KINDS.md, read on 2026-11-17), which holds
torch, triton and transformers but none of, say, xgrammar, redis or pyzmq, and nothing can be installed there.
Whatever the session imports must therefore import with the image's packages alone. `site DIR` writes a
sitecustomize.py that makes every installed distribution the image lacks unimportable; with DIR first on
PYTHONPATH, a command (and every Python process it starts) meets the ImportError the GPU machine would give:

    python -m bench.gpu.image site /tmp/gpu-site
    PYTHONPATH=/tmp/gpu-site bash bench/gpu/session.sh --dry-run
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from pathlib import Path

# the image's distributions, as KINDS.md lists them
_LISTED = """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
    multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
    nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
    patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
    py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
    scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
    shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
    tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
    uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
IMAGE_PACKAGES = frozenset(_LISTED.split())
# the versions that matter to the engine, as seen there (KINDS.md's pip list)
IMAGE_VERSIONS = {"python": "3.12.3", "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0"}

PROJECT = "kvserve"  # its own packages travel with the call

_SITECUSTOMIZE = '''"""Written by bench/gpu/image.py: what the GPU image lacks cannot be imported or found here, and its
distributions are not listed (pytest, for one, loads the plugins their entry points name)."""
import importlib.abc
import importlib.metadata
import importlib.util
import re
import sys

_MISSING_MODULES = frozenset({modules!r})
_MISSING_DISTRIBUTIONS = frozenset({distributions!r})


class _NotInTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _MISSING_MODULES:
            raise ModuleNotFoundError(f"No module named {{name!r}} (the GPU image has no such package)", name=name)
        return None


_listed = importlib.metadata.distributions


def _distributions(**kwargs):
    for dist in _listed(**kwargs):
        if re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower() not in _MISSING_DISTRIBUTIONS:
            yield dist


_find_spec = importlib.util.find_spec


def _probe(name, package=None):
    """A probe for a missing package finds nothing, as it would there (libraries probe before they import)."""
    if importlib.util.resolve_name(name, package).partition(".")[0] in _MISSING_MODULES:
        return None
    return _find_spec(name, package)


sys.meta_path.insert(0, _NotInTheImage())
importlib.metadata.distributions = _distributions
importlib.util.find_spec = _probe
'''


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: importlib.metadata.Distribution) -> set[str]:
    """What dist needs installed, extras left out."""
    from packaging.requirements import Requirement

    needed = set()
    for line in dist.requires or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            needed.add(_normalise(requirement.name))
    return needed


def missing_distributions() -> list[str]:
    """The distributions installed here that the image lacks (this project's own aside). What an image package
    needs in the version installed here counts as the image's: there, its own version has what it needs."""
    installed = {_normalise(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    present, todo = set(), [_normalise(name) for name in IMAGE_PACKAGES]
    while todo:
        name = todo.pop()
        if name in present or name not in installed:
            continue
        present.add(name)
        todo += _requirements(installed[name])
    return sorted(set(installed) - present - {PROJECT})


def missing_modules() -> list[str]:
    """The top-level modules only those distributions provide."""
    missing = set(missing_distributions())
    return sorted(
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if all(_normalise(d) in missing for d in dists)
    )


def write_site(dest: Path) -> Path:
    """dest with a sitecustomize.py blocking missing_modules() and hiding missing_distributions(); put dest
    first on PYTHONPATH."""
    dest.mkdir(parents=True, exist_ok=True)
    text = _SITECUSTOMIZE.format(modules=missing_modules(), distributions=missing_distributions())
    (dest / "sitecustomize.py").write_text(text)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("missing", help="the installed distributions and modules the image lacks")
    sub.add_parser("site", help="write the blocking sitecustomize.py").add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    if args.command == "missing":
        print("distributions:", " ".join(missing_distributions()))
        print("modules:", " ".join(missing_modules()))
    else:
        print(write_site(args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())

# kvserve: two images from one file. `gateway` holds the base install only (no torch: a small image for the
# stateless gateways, and `kvserve keys`); `executor` adds the engine's libraries (the `executor` extra) and a
# C++ compiler. compose.yaml picks the target and the command of each service; compose.cpu.yaml builds the
# executor for machines without a GPU (TORCH_INDEX_URL below).

# the project's source, copied once for both targets
FROM python:3.11-slim AS source
WORKDIR /app
COPY pyproject.toml README.md ./
COPY executor executor
COPY gateway gateway
COPY kvkernels kvkernels
COPY shared shared
COPY bench bench
COPY kvserve kvserve

FROM python:3.11-slim AS gateway
WORKDIR /app
COPY --from=source /app /app
RUN pip install --no-cache-dir .
# models are pulled and converted into this volume once (compose's `model` service); the gateway reads tokenizers
ENV KVSERVE_CACHE_DIR=/models
VOLUME /models
ENTRYPOINT []
CMD ["kvserve", "--help"]

FROM python:3.11-slim AS executor
# a C++ compiler builds the CPU kernels (kvkernels/csrc) when the engine starts; curl-free health checks use python
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# PyPI's Linux torch wheel carries CUDA: that image serves GPUs and CPUs. Built with
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu, torch is the CPU wheel, without CUDA's
# gigabytes of libraries; the extra below then keeps it, as it satisfies the same range. Installed before the
# source is copied, so a code change rebuilds only the last layers
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch>=2.5,<=2.14.1"
COPY --from=source /app /app
RUN pip install --no-cache-dir ".[executor]"
ENV KVSERVE_CACHE_DIR=/models
VOLUME /models
ENTRYPOINT []
CMD ["kvserve", "--help"]

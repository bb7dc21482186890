# kvserve: one image for the gateway and the executors (compose.yaml picks the command).
FROM python:3.11-slim

# a C++ compiler builds the CPU decode-attention kernel on first use; curl-free health checks use python
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# PyPI's Linux torch wheel carries CUDA: the same image serves GPUs and CPUs
RUN pip install --no-cache-dir "torch>=2.5,<=2.14.1"
COPY pyproject.toml README.md ./
COPY executor executor
COPY gateway gateway
COPY kernels kernels
COPY shared shared
COPY bench bench
RUN pip install --no-cache-dir .

# models are pulled and converted into this volume once (compose's `model` service)
ENV KVSERVE_CACHE_DIR=/models
VOLUME /models
ENTRYPOINT []
CMD ["kvserve", "--help"]

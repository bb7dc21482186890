#!/usr/bin/env bash
# Everything a GPU session checks, as one command sized for one device call (at most about 9 minutes):
# bench/gpu_check.py (kernels against their twins, decode-attention bandwidth, end-to-end tokens/s), then the
# tests that have CUDA cases. The default model cannot travel to the GPU machine (its GGUF is over the 64 MiB a
# call carries), so the end-to-end model is bench/gpu_model.py's stand-in: its config and tokenizer, random
# weights. Prepare it here once, then run this there:
#
#   python -m bench.gpu_model pack .gpu/model          # here; .gpu/ is git-ignored, so it must be carried
#   run(command="bash bench/gpu_session.sh", carry=[".gpu"], timeout_s=600)
#
# What it measured lands in $OUT: gpu.txt (device and versions), gpu_check.json and .log, gpu_report.md (the
# README's tables: bench/gpu_report.py), pytest.log.
set -u
out=${OUT:-/tmp/gpu-session}
python=${PYTHON:-python3}
mkdir -p "$out"
# the model cache the stand-in goes into; no C++ CPU kernel build (a minute the GPU would idle through)
export PYTHONUNBUFFERED=1 KVSERVE_CACHE_DIR=${KVSERVE_CACHE_DIR:-/tmp/kvserve-cache} KVSERVE_CPU_KERNELS=0
started=$SECONDS

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $python -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)'
} >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

$python -m bench.gpu_model build .gpu/model "$KVSERVE_CACHE_DIR/models/SmolLM2-135M-Instruct" || exit 2
echo "model ready at $((SECONDS - started)) s"

# gpu_check stops starting end-to-end runs after its budget; the timeout is the backstop
timeout "${CHECK_TIMEOUT_S:-400}" $python -m bench.gpu_check --budget-s "${CHECK_BUDGET_S:-300}" \
    --out "$out/gpu_check.json" 2>&1 | tee "$out/gpu_check.log"
echo "gpu_check ended at $((SECONDS - started)) s"
$python -m bench.gpu_report "$out/gpu_check.json" >"$out/gpu_report.md" && cat "$out/gpu_report.md"

timeout "${TEST_TIMEOUT_S:-120}" $python -m pytest -q -p no:cacheprovider \
    tests/kernels/test_triton_attention.py tests/kernels/test_triton_norm_rope.py \
    tests/executor/test_cuda_graphs.py tests/executor/test_attention_backend.py tests/bench/test_gpu_check.py \
    2>&1 | tee "$out/pytest.log" | tail -40
echo "tests ended at $((SECONDS - started)) s"

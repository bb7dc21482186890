#!/usr/bin/env bash
# Everything a GPU session checks, as one device call of about 5 minutes (the first H200 sessions ran 260-267 s
# before the kv_tiers stage, and took ~30 s to start; a second call still fits the 15 minutes a task is lent).
# Seven stages, each its own process under its own timeout, each leaving its result in $OUT as it ends, so a stage
# that fails, hangs or faults the GPU loses nothing before it and stops nothing after it:
#
#   env      device, versions, and whether every module the later stages import imports   env.json
#   model    the stand-in model (below); where it fails, e2e and kv_tiers are skipped and figures times no engine
#   kernels  each Triton kernel against its torch twin; the fp8 layer (check.py --section kernels)  kernels.json
#   tests    the test files with CUDA cases, with a per-test timeout                        tests.xml (JUnit)
#   e2e      greedy tokens of each backend, float32 (judged) and bf16; the engine sized by GPU memory
#            profiling, with and without fp8                                                e2e.json
#   figures  decode attention as a share of HBM bandwidth; output tok/s at 1/64/256 requests, graphs on and
#            off, fp8; output tok/s of 16 requests over 8 LoRA adapters against base only   figures.json
#   kv_tiers the KV host tier's copies each way (GB/s), and TTFT of a revisited 8k-token prompt loaded from it
#            against recompute (bench/gpu/kv_tiers.py); a section of figures.json, as a call brings back 8 files
# plus session.log (every stage's output), summary.txt (one line, rewritten as each stage ends) and gpu_report.md
# (bench/gpu/report.py: the README's markdown). That is 8 files, all a device call brings back.
#
# The default model cannot travel to the GPU machine (its GGUF is over the 64 MiB a call carries), so the model
# served is bench/gpu/model.py's stand-in: its config and tokenizer, random weights. Prepare it here once, then
# run this there:
#
#   python -m bench.gpu.model pack .gpu/model          # here; .gpu/ is git-ignored, so it must be carried
#   run(command="bash bench/gpu/session.sh", carry=[".gpu"], timeout_s=600)
#   python -m bench.gpu.report FILES_AT                # here, if the run ended before its own gpu_report.md
#
# bash bench/gpu/session.sh --dry-run: the same stages on a CPU machine, in about a minute: Triton's interpreter,
# toy sizes, a 2-layer stand-in packed from the default model, the test files collected but not run (the suite
# runs them), the profiled engine reported as needing CUDA. tests/bench/gpu/test_session.py runs it.
#
# SESSION_BUDGET_S (default 510: 420 before the kv_tiers stage's 90) bounds the stages together; PYTHON (default
# python3) runs every Python step. The exit status is 0 when every stage is ok.
set -u
cd "$(dirname "$0")/../.." || exit 2 # the repository root: python -m bench.* and the test paths are relative to it
dry_run=0
if [[ ${1:-} == --dry-run ]]; then
    dry_run=1
fi
out=${OUT:-/tmp/gpu-session}
python=${PYTHON:-python3}
budget_s=${SESSION_BUDGET_S:-510}
mkdir -p "$out"
log=$out/session.log
: >"$log"
# no C++ CPU kernel build (a minute the GPU would idle through)
export PYTHONUNBUFFERED=1 KVSERVE_CPU_KERNELS=0
started=$SECONDS
tests=(
    tests/kernels/test_triton_attention.py
    tests/kernels/test_triton_norm_rope.py
    tests/kernels/test_triton_lora.py
    tests/executor/test_cuda_graphs.py
    tests/executor/test_attention_backend.py
    tests/executor/lora/test_lora_triton.py
    tests/bench/gpu/test_check.py
    tests/bench/gpu/test_kernel_checks.py
    tests/executor/test_quantization.py::test_fp8_scaled_matmul_on_hopper_matches_the_dequantized_product
)
if ((dry_run)); then
    export TRITON_INTERPRET=1
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    packed=$work/packed
    model=$work/model
    layers=(--num-layers 2)
    check=(--device cpu --toy)
    tiers=(--device cpu --tokens 256 --blocks 16)
    collect=(--collect-only)
else
    # where the default model is looked for, so the tests that serve it find the stand-in
    export KVSERVE_CACHE_DIR=${KVSERVE_CACHE_DIR:-/tmp/kvserve-cache}
    packed=.gpu/model
    model=$KVSERVE_CACHE_DIR/models/SmolLM2-135M-Instruct
    layers=()
    check=()
    tiers=()
    collect=()
fi

verdicts=()
status=0 # the script's: 1 once a stage is anything but ok
record() {  # record STAGE VERDICT: into the summary line, which is rewritten at once
    verdicts+=("$1 $2")
    [[ $2 == ok* ]] || status=1
    local line
    line=$(printf '%s, ' "${verdicts[@]}")
    echo "stages: ${line%, }" >"$out/summary.txt"
    echo "== $1: $2, at $((SECONDS - started)) s" | tee -a "$log"
}

allot() {  # allot SECONDS: as many of them as the session's budget has left
    local left=$((budget_s - (SECONDS - started)))
    echo $((left < $1 ? left : $1))
}

stage() {  # stage NAME LIMIT_S COMMAND...: COMMAND under its own timeout, its output into the log
    local name=$1 limit=$2 rc verdict note from
    shift 2
    if ((limit < 20)); then
        record "$name" "skipped (no time left)"
        return 1
    fi
    echo "== $name: up to $limit s, from $((SECONDS - started)) s" | tee -a "$log"
    from=$(($(wc -l <"$log") + 1))
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    rm -f "$out"/*.partial # a JSON rewrite the timeout cut short; the whole file before it stands
    case $rc in
        0) verdict=ok ;;
        124 | 137) verdict=TIMEOUT ;;
        *) verdict=FAILED ;;
    esac
    # pytest stopped by its own session timeout
    if tail -n +"$from" "$log" | grep -q "session-timeout: .* exceeded"; then
        verdict=TIMEOUT
    fi
    note=$(timeout 30 "$python" -m bench.gpu.report --note "$name" "$out" 2>/dev/null)
    if [[ $verdict != ok ]]; then
        tail -n +"$from" "$log" | tail -n 15
    fi
    record "$name" "$verdict${note:+ ($note)}"
    [[ $verdict == ok ]]
}

if ((dry_run)); then # what a GPU session's caller does here beforehand
    "$python" -m bench.gpu.model pack "$packed" >>"$log" 2>&1
fi

stage env "$(allot 60)" "$python" -m bench.gpu.env --out "$out/env.json"
model_ok=0
stage model "$(allot 90)" "$python" -m bench.gpu.model build "$packed" "$model" "${layers[@]}" && model_ok=1

stage kernels "$(allot 90)" "$python" -m bench.gpu.check --section kernels "${check[@]}" --out "$out/kernels.json"

# pytest ends itself in time to write its JUnit file: it starts no test once its session timeout has passed, and
# the per-test timeout bounds the one running then. Where pytest-timeout is missing (env says so) or older than
# 2.3 (no session timeout), what it lacks is left out rather than fail pytest's arguments.
limit=$(allot 180) # the first GPU session's 120 ran 43 of the 85 tests
per_test_s=45
timeouts=()
case $("$python" -c 'import importlib.metadata as m; print(m.version("pytest-timeout"))' 2>/dev/null) in
    "") ;;
    1.* | 2.[0-2] | 2.[0-2].*) timeouts=(--timeout "$per_test_s") ;;
    *) timeouts=(--timeout "$per_test_s" --session-timeout $((limit > per_test_s + 25 ? limit - per_test_s - 15 : 10))) ;;
esac
# the tests' default model is the stand-in: that machine cannot fetch the default model's package
test_model=()
if ((model_ok && !dry_run)); then
    test_model=(env KVSERVE_TEST_MODEL="$model")
fi
stage tests "$limit" "${test_model[@]}" "$python" -m pytest -p no:cacheprovider -v -rfE --continue-on-collection-errors \
    "${timeouts[@]}" --junitxml "$out/tests.xml" "${collect[@]}" "${tests[@]}"

# the engine stages start no engine that would not be up 20 s before their timeout
limit=$(allot 130)
if ((model_ok)); then
    stage e2e "$limit" "$python" -m bench.gpu.check --section e2e "${check[@]}" --model "$model" \
        --budget-s $((limit - 20)) --out "$out/e2e.json"
else
    record e2e "skipped (no model)"
fi

limit=$(allot 180) # four engines: three backends', then the adapters' with its two timed batches
if ((model_ok)); then
    serve=(--model "$model")
else
    serve=(--no-model)
fi
stage figures "$limit" "$python" -m bench.gpu.check --section figures "${check[@]}" "${serve[@]}" \
    --budget-s $((limit - 20)) --out "$out/figures.json"

# after figures, whose check.py rewrites figures.json whole; the stage's own clock leaves 15 s to close its engine
limit=$(allot 90)
if ((model_ok)); then
    stage kv_tiers "$limit" "$python" -m bench.gpu.kv_tiers "${tiers[@]}" --model "$model" \
        --budget-s $((limit - 15)) --out "$out/figures.json"
else
    record kv_tiers "skipped (no model)"
fi

"$python" -m bench.gpu.report "$out" >"$out/gpu_report.md" 2>>"$log" && cat "$out/gpu_report.md"
echo "session: $((SECONDS - started)) s"
cat "$out/summary.txt"
exit $status

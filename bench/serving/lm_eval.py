"""lm-evaluation-harness against kvserve and against HF transformers on the same weights: one loglikelihood task the
repository ships (bench/serving/lm_eval_task, local data), accuracies side by side, and how far the scores differ.

    python -m bench.serving.lm_eval [--peers DIR] [--limit N] [--port 8000] [--concurrency 4] [--out bench/results/lm_eval]

lm-eval lives in a virtual environment of its own, DIR/lm-eval (default $KVSERVE_PEERS, else
~/.cache/kvserve-peers), never in the project's; it is installed there when missing. kvserve runs as `kvserve up`
(default model) and is asked through lm-eval's `local-completions` model, i.e. `/v1/completions` with
`echo: true, logprobs: 1, max_tokens: 1` per choice; the reference is lm-eval's `hf` model, float32 on CPU.
summary.json holds both runs' acc and acc_norm, and over every (question, choice) the largest difference of the
two loglikelihoods and the questions whose chosen answer differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.serving.guidellm import MODEL_NAME, ensure_venv, kvserve_env, model_dir, stop, wait_ready

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = Path(__file__).resolve().parent / "lm_eval_task"
TASK = "kvserve_mc"
LM_EVAL = "lm-eval[hf,api]==0.4.13"  # api: local-completions needs tenacity, aiohttp


def run_lm_eval(bin_dir: Path, model: str, model_args: str, out: Path, limit: int | None) -> dict:
    """One lm-eval run, from the task's folder (its data file is relative), offline; its results and samples."""
    command = [str(bin_dir / "lm-eval"), "run", "--model", model, "--model_args", model_args, "--tasks", TASK,
               "--include_path", str(TASK_DIR), "--batch_size", "1", "--device", "cpu",
               "--output_path", str(out), "--log_samples"]  # fmt: skip
    if limit:
        command += ["--limit", str(limit)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    print("running:", " ".join(command), flush=True)
    subprocess.run(command, cwd=TASK_DIR, env=env, check=True)
    results = json.loads(max(out.rglob("results_*.json")).read_text())
    samples = [
        json.loads(line) for line in max(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()
    ]
    metrics = results["results"][TASK]
    return {
        "acc": metrics["acc,none"],
        "acc_stderr": metrics.get("acc_stderr,none"),
        "acc_norm": metrics["acc_norm,none"],
        "loglikelihoods": {s["doc_id"]: [r[0] for r in s["filtered_resps"]] for s in samples},
    }


def compare(kvserve: dict, hf: dict) -> dict:
    """Largest |loglikelihood difference| over every choice, and the questions whose argmax differs."""
    diffs, flipped = [], []
    for doc_id, theirs in hf["loglikelihoods"].items():
        ours = kvserve["loglikelihoods"][doc_id]
        diffs += [abs(float(a) - float(b)) for a, b in zip(ours, theirs, strict=True)]
        if ours.index(max(ours)) != theirs.index(max(theirs)):
            flipped.append(doc_id)
    return {"max_abs_loglikelihood_diff": max(diffs), "choices": len(diffs), "argmax_differs": flipped}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    default_peers = os.environ.get("KVSERVE_PEERS", str(Path.home() / ".cache" / "kvserve-peers"))
    parser.add_argument("--peers", type=Path, default=Path(default_peers))
    parser.add_argument("--limit", type=int, default=None, help="only the first N questions")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--concurrency", type=int, default=4, help="lm-eval's num_concurrent requests")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "lm_eval")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bin_dir = ensure_venv(args.peers, "lm-eval", [LM_EVAL])
    model = model_dir()
    url = f"http://127.0.0.1:{args.port}"
    # niceness 0: on a shared machine the executor's default of 10 below the gateway starves it behind others
    command = [sys.executable, "-m", "kvserve.cli", "up", "--port", str(args.port), "--log-format", "text",
               "--executor-niceness", "0", "--shutdown-grace-period", "1"]  # fmt: skip
    log = (args.out / "kvserve.log").open("w")
    process = subprocess.Popen(
        command, cwd=REPO, env=kvserve_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_ready(url, process)
        served = (
            f"model={MODEL_NAME},base_url={url}/v1/completions,tokenizer={model},tokenizer_backend=huggingface,"
            f"num_concurrent={args.concurrency}"
        )
        kvserve = run_lm_eval(bin_dir, "local-completions", served, args.out / "kvserve", args.limit)
    finally:
        stop(process)
        log.close()
    hf = run_lm_eval(bin_dir, "hf", f"pretrained={model},dtype=float32", args.out / "hf", args.limit)
    summary = {
        "task": TASK,
        "kvserve": {k: v for k, v in kvserve.items() if k != "loglikelihoods"},
        "hf": {k: v for k, v in hf.items() if k != "loglikelihoods"},
        **compare(kvserve, hf),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

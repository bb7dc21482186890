"""The KV host tier on the GPU, session.sh's kv_tiers stage: what its copies move each way, and how soon a long
prefix the pool lost comes back from it (issue 48, item 7).

- bandwidth: blocks of the engine's pool to pinned host slots as the offloader moves them (BlockCopies.gather,
  then HostTier.write) and back (BlockCopies.write from the slots), beside one contiguous copy of as many bytes
  between device memory and pinned memory each way: the link's ceiling;
- revisit: time to first token of a prompt (8k tokens, or the model's context if shorter) whose blocks the pool
  evicted and the host tier kept, against a fresh prompt of the same length computed, in a pool that holds two
  such prompts (a load may pin at most half of it) and a host tier that holds every trial's. The revisit must find
  its whole prefix cached, the loaded blocks byte for byte as first computed, and its greedy tokens the first
  visit's (judged in float32 alone: in bf16 the stand-in's random weights give near ties every few tokens).

The results are a section, "kv_tiers", of the JSON file --out names, rewritten after each trial beside what the
file holds: a device call brings back 8 files, and session.sh leaves 8, so this stage's results join
figures.json. --device cuda without a CUDA device writes the section as skipped and exits 0.

python -m bench.gpu.kv_tiers --model DIR [--device cuda|cpu] [--tokens 8192] [--blocks 512] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu.e2e import NEAR_TIE_NATS, parting_margin
from bench.gpu.report import problems

SECTION = "kv_tiers"
OUTPUT_TOKENS = 8  # greedy tokens each request generates, compared between first visit and revisit
POOL_MARGIN_BLOCKS = 4  # beyond two prompts' blocks: the warm-up's
SETTLE_TIMEOUT_S = 30.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the model to serve")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--tokens", type=int, default=8192, help="prompt length (capped by the model's context)"
    )
    parser.add_argument("--blocks", type=int, default=512, help="blocks each bandwidth copy moves")
    parser.add_argument("--iters", type=int, default=5, help="timed copies of each kind (the median counts)")
    parser.add_argument("--trials", type=int, default=3, help="revisits timed (the median counts)")
    parser.add_argument("--budget-s", type=float, default=75, help="start no trial after this")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file this stage's section joins")
    return parser.parse_args(argv)


class SectionFile:
    """This stage's section of a JSON file that may hold others' (figures.json), written whole each time: a
    process killed mid-stage keeps what it had measured, and never leaves half a file."""

    def __init__(self, path: Path | None, section: dict) -> None:
        self.path, self.section = path, section
        self.error: dict | None = None
        self.write()

    def fail(self, error: Exception) -> None:
        self.error = {"error": repr(error), "traceback": traceback.format_exc()}
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        try:
            report = json.loads(self.path.read_text())
        except (OSError, ValueError):
            report = {}  # none yet, or the figures stage's was cut short: this stage's section stands alone
        report[SECTION] = self.section
        errors = {key: value for key, value in report.get("errors", {}).items() if key != SECTION}
        report["errors"] = errors | ({SECTION: self.error} if self.error else {})
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(partial, self.path)


def median_seconds(fn: Callable[[], object], iters: int, sync: Callable[[], None]) -> float:
    fn()  # the first call pays for allocations and the copy stream's start
    sync()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bandwidth(tiers, num_blocks: int, iters: int) -> list[dict]:
    """GB/s each way, through the engine's own tier copies (tiers: its KVTiers) and as one contiguous copy; the
    pool's blocks and the host tier's first slots are overwritten (before the engine caches anything)."""
    copies, host = tiers.copies, tiers.host
    kv_cache = copies.kv_cache
    pinned = kv_cache.is_cuda
    ids = random.Random(0).sample(range(kv_cache.shape[2]), num_blocks)  # a pool's blocks are scattered
    elements = num_blocks * kv_cache[:, :, 0].numel()
    device_flat = torch.zeros(elements, dtype=kv_cache.dtype, device=kv_cache.device)
    host_flat = torch.zeros(elements, dtype=kv_cache.dtype, pin_memory=pinned)
    sync = torch.cuda.synchronize if pinned else (lambda: None)

    def offload() -> None:  # as KVTiers._write_down
        for slot, payload in enumerate(copies.gather(ids)):
            host.write(slot, payload)

    def load() -> None:  # as KVTiers._load_up
        for slot, block_id in enumerate(ids):
            copies.write(block_id, host.read(slot))
        copies.done()

    runs = [
        ("device to host", "offloader: BlockCopies.gather + HostTier.write", offload),
        ("device to host", "BlockCopies.gather alone", lambda: copies.gather(ids)),
        ("device to host", "one contiguous copy", lambda: host_flat.copy_(device_flat, non_blocking=pinned)),
        ("host to device", "loads: BlockCopies.write", load),
        ("host to device", "one contiguous copy", lambda: device_flat.copy_(host_flat, non_blocking=pinned)),
    ]
    num_bytes = num_blocks * copies.block_bytes
    rows = []
    for direction, path, fn in runs:
        seconds = median_seconds(fn, iters, sync)
        rows.append(
            {
                "direction": direction,
                "path": path,
                "ms": round(seconds * 1e3, 3),
                "gbps": round(num_bytes / seconds / 1e9, 2),
            }
        )
    return rows


def timed_request(llm, prompt: list[int], params) -> tuple[float, object]:
    """Seconds to the request's first token, and its finished output (the engine runs nothing else)."""
    started = time.perf_counter()
    request_id = llm.add_request(prompt, params)
    first_token_s = None
    while True:
        for out in llm.step():
            if out.request_id != request_id:
                continue
            if first_token_s is None and out.outputs[0].token_ids:
                first_token_s = time.perf_counter() - started
            if out.finished:
                return first_token_s, out


def settle(llm) -> None:
    """Until every block the pool caches has reached the host tier (the service settles copies while idle)."""
    engine = llm.engine
    deadline = time.perf_counter() + SETTLE_TIMEOUT_S
    while True:
        engine.poll_tiers()
        if set(engine.kv.pool.cached_hashes()) <= set(engine.tier_hashes().get("host", ())):
            return
        if time.perf_counter() > deadline:
            raise TimeoutError(f"the host tier's copies did not settle in {SETTLE_TIMEOUT_S:.0f} s")
        time.sleep(0.001)


def block_snapshot(llm, prompt: list[int]) -> tuple[list[bytes], torch.Tensor]:
    """The prompt's cacheable blocks the pool holds now: their hashes and a copy of their bytes."""
    from shared.block_hash import hash_blocks, max_cached_blocks
    from shared.tenant import ANONYMOUS_TENANT

    engine, block_size = llm.engine, llm.engine.kv.block_size
    hashes = hash_blocks(prompt, block_size, ANONYMOUS_TENANT.cache_salt)
    held = [h for h in hashes[: max_cached_blocks(len(prompt), block_size)] if engine.kv.pool.lookup(h)]
    kv_cache = engine.runner.kv_cache
    ids = torch.tensor([engine.kv.pool.lookup(h).block_id for h in held], device=kv_cache.device)
    return held, kv_cache.movedim(2, 0)[ids]


def identical_blocks(llm, hashes: list[bytes], snapshot: torch.Tensor) -> tuple[int, int]:
    """Of the snapshot's blocks the pool holds now: how many hold the same bytes, of how many."""
    pool, kv_cache = llm.engine.kv.pool, llm.engine.runner.kv_cache
    found = [(i, pool.lookup(h)) for i, h in enumerate(hashes) if pool.lookup(h) is not None]
    same = sum(torch.equal(snapshot[i], kv_cache[:, :, block.block_id]) for i, block in found)
    return same, len(found)


def revisit_trial(llm, prompts: list[list[int]], params, judged: bool) -> dict:
    """prompts: the one revisited, two that evict it from the pool, and a fresh one (the recompute)."""
    first, evictors, fresh = prompts[0], prompts[1:3], prompts[3]
    first_s, first_out = timed_request(llm, first, params)
    settle(llm)
    hashes, snapshot = block_snapshot(llm, first)
    for prompt in evictors:
        timed_request(llm, prompt, params)
        settle(llm)
    recompute_s, _ = timed_request(llm, fresh, params)
    settle(llm)
    host_before = llm.stats().kv_cached_tokens_host
    revisit_s, out = timed_request(llm, first, params)
    from_host = llm.stats().kv_cached_tokens_host - host_before
    same, compared = identical_blocks(llm, hashes, snapshot)
    margin = parting_margin(first_out.outputs[0], out.outputs[0])
    tokens_ok = margin is None or not judged or margin <= NEAR_TIE_NATS
    settle(llm)
    return {
        "first_visit_ttft_ms": round(first_s * 1e3, 2),
        "recompute_ttft_ms": round(recompute_s * 1e3, 2),
        "revisit_ttft_ms": round(revisit_s * 1e3, 2),
        "revisit_cached_tokens": out.num_cached_tokens,
        "revisit_cached_tokens_host": from_host,
        "blocks_identical": same,
        "blocks_compared": compared,
        "tokens": "same" if margin is None else f"parted at a {margin:.3g}-nat margin",
        "tokens_ok": tokens_ok,
    }


def start_engine(args: argparse.Namespace):
    """The engine, its pool two prompts' blocks (a load may pin at most half of it) and its host tier every
    trial's; and what was sized, for the section."""
    from transformers import AutoConfig

    from executor import LLM
    from shared.defaults import DEFAULT_BLOCK_SIZE

    config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    # the engine's dtype rule: bfloat16 on CUDA, float32 elsewhere; a block holds K and V of every layer
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    block_bytes = config.num_hidden_layers * 2 * DEFAULT_BLOCK_SIZE * kv_heads * head_dim * dtype.itemsize
    tokens = min(args.tokens, config.max_position_embeddings - OUTPUT_TOKENS)
    per_prompt = -(-(tokens + OUTPUT_TOKENS) // DEFAULT_BLOCK_SIZE)
    pool_blocks = max(2 * per_prompt + POOL_MARGIN_BLOCKS, args.blocks)
    host_blocks = (4 * args.trials + 1) * per_prompt + POOL_MARGIN_BLOCKS
    llm = LLM(
        args.model,
        device=args.device,
        kv_cache_memory=pool_blocks * block_bytes,
        kv_offload_memory=host_blocks * block_bytes,
        max_model_len=tokens + OUTPUT_TOKENS,
        max_num_seqs=4,  # requests come one at a time: no graphs captured for larger batches
    )
    if llm.engine.kv_tiers.block_bytes != block_bytes:  # the sizing above must be the engine's own
        raise RuntimeError(f"a block is {llm.engine.kv_tiers.block_bytes} bytes, not {block_bytes}")
    sizes = {
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "block_bytes": block_bytes,
        "prompt_tokens": tokens,
        "pool_blocks": llm.engine.kv.pool.num_blocks,
        "host_blocks": host_blocks,
    }
    return llm, sizes


def measure(args: argparse.Namespace, section: SectionFile, deadline: float) -> None:
    """The bandwidth on the engine's pool before it caches anything, then the trials, while the deadline lasts."""
    from executor import SamplingParams
    from shared.block_hash import max_cached_blocks

    llm, sizes = start_engine(args)
    info = section.section
    info |= sizes
    num_blocks = min(args.blocks, sizes["pool_blocks"])
    rows = bandwidth(llm.engine.kv_tiers, num_blocks, args.iters)
    info["bandwidth"] = {"blocks": num_blocks, "rows": rows}
    section.write()
    judged = sizes["dtype"] == "float32"
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    rng, vocab, block_size = random.Random(0), llm.engine.vocab_size, llm.engine.kv.block_size
    warm = [rng.randrange(vocab) for _ in range(2 * block_size + 1)]
    for _ in range(2):  # the kernels' first compiles, then a prefill past a cached prefix
        llm.generate([warm], params)
    settle(llm)
    tokens = sizes["prompt_tokens"]
    info["revisit"] = result = {
        "prompt_tokens": tokens,
        "expected_cached_tokens": max_cached_blocks(tokens, block_size) * block_size,
        "tokens_judged": judged,
        "trials": [],
    }
    for _ in range(args.trials):
        if time.perf_counter() > deadline:
            result["skipped_trials"] = "time budget spent"
            break
        prompts = [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(4)]
        trials = result["trials"]
        trials.append(revisit_trial(llm, prompts, params, judged))
        recompute = statistics.median(t["recompute_ttft_ms"] for t in trials)
        revisit_ms = statistics.median(t["revisit_ttft_ms"] for t in trials)
        result |= {
            "recompute_ttft_ms": recompute,
            "revisit_ttft_ms": revisit_ms,
            "revisit_over_recompute": round(revisit_ms / recompute, 3),
        }
        section.write()
    llm.engine.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.device == "cuda" and not torch.cuda.is_available():
        reason = "no CUDA device (torch.cuda.is_available() is False)"
        SectionFile(args.out, {"skipped": reason})
        print(f"kv_tiers: skipped: {reason}")
        return 0
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    section = SectionFile(args.out, {"device": name, "torch": torch.__version__})
    try:
        measure(args, section, started + args.budget_s)
    except Exception as error:
        traceback.print_exc()
        section.fail(error)
    section.section["seconds"] = round(time.perf_counter() - started, 1)
    section.write()
    report = {SECTION: section.section, "errors": {SECTION: section.error} if section.error else {}}
    print(json.dumps(report, indent=2))
    found = problems(report)
    for problem in found:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

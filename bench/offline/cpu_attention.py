"""Paged attention on the CPU, the C++ kernels against the batched torch path (SDPA), on the steps chunked prefill
makes: fresh prompts, a chunk after cached context, and decodes beside a chunk.

    python -m bench.offline.cpu_attention [--layers 30] [--rounds 5] [--threads 2]

SmolLM2-135M's attention shape (9 query heads sharing 3 kv heads of 64), float32, 16-token blocks scattered over
a pool; each figure is the best of --rounds of one call per layer over --layers layers, both paths in the same
process, one after the other.
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch

from kvkernels import torch_paged
from kvkernels.cpu_extension import cpu_kernels

BLOCK = 16
HEADS, KV_HEADS, DIM = 9, 3, 64

# name -> (query tokens per sequence, context per sequence after the step)
CASES = {
    "two fresh 256-token prompts": ([256, 256], [256, 256]),
    "a 512-token chunk after 512 cached": ([512], [1024]),
    "one fresh 1,024-token prompt": ([1024], [1024]),
    "32 decodes (~350 positions) + a 448-token chunk": ([1] * 32 + [448], [350] * 32 + [448]),
    "32 decodes (~350 positions) alone": ([1] * 32, [350] * 32),
}


def batch(q_lens: list[int], seq_lens: list[int], layers: int, seed: int = 0):
    """Per layer its own pool of scattered blocks (so that no layer finds another's in the caches)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(blocks) * 2
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=g)[: sum(blocks)].to(torch.int32)
    for row, (start, n) in enumerate(
        zip(torch.tensor([0, *blocks]).cumsum(0).tolist(), blocks, strict=False)
    ):
        table[row, :n] = perm[start : start + n]
    caches = [
        (
            torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=g),
            torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=g),
        )
        for _ in range(layers)
    ]
    query = torch.randn(sum(q_lens), HEADS, DIM, generator=g)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, caches, table, torch.tensor(seq_lens, dtype=torch.int32), starts


def time_layers(args, rounds: int) -> float:
    """Best of rounds, in ms, of paged_attention once per layer."""
    query, caches, table, seq_lens, starts = args
    best = float("inf")
    for _ in range(rounds + 1):  # the first round warms up
        start = time.perf_counter()
        for key_cache, value_cache in caches:
            torch_paged.paged_attention(query, key_cache, value_cache, table, seq_lens, starts, DIM**-0.5)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_kernels() is None:
        raise SystemExit("the C++ CPU kernels could not be built here: nothing to compare")
    print(f"| step ({args.layers} layers) | C++ kernels | torch path (SDPA) | speed-up |")
    print("|---|---|---|---|")
    for name, (q_lens, seq_lens) in CASES.items():
        case = batch(q_lens, seq_lens, args.layers)
        kernel = time_layers(case, args.rounds)
        with mock.patch.object(torch_paged, "cpu_kernels", lambda: None):
            torch_path = time_layers(case, args.rounds)
        print(f"| {name} | {kernel:.1f} ms | {torch_path:.1f} ms | {torch_path / kernel:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

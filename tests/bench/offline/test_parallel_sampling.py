"""bench/offline/parallel_sampling.py on a tiny model: the figures it reports are the engine's and add up."""

from __future__ import annotations

from bench.offline.parallel_sampling import ideal_blocks, run_case
from executor import LLM


def test_one_group_peaks_at_one_prompt_plus_its_outputs_and_separate_requests_above(tiny_models):
    llm = LLM(tiny_models["llama"], kv_cache_memory="4MiB", enable_prefix_caching=False, max_model_len=512)
    prompt = list(range(100, 200))  # 6 full blocks and 4 tokens
    assert ideal_blocks(len(prompt), 4, 8) == 6 + 4 * 1
    grouped = run_case(llm, prompt, 4, 8, grouped=True)
    assert grouped["peak_kv_blocks"] == 10 and grouped["output_tokens"] == 32
    separate = run_case(llm, prompt, 4, 8, grouped=False)
    assert separate["peak_kv_blocks"] == 4 * 7 and separate["output_tokens"] == 32

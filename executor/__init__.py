"""The executor: engine (scheduler, block pool, model runner, sampler), model loading, offline LLM API."""

from executor.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # the offline API pulls in transformers; load it only when asked for, not for every submodule import
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from executor import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'executor' has no attribute {name!r}")

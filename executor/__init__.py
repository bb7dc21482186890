"""The executor: engine (scheduler, block pool, model runner, sampler), model loading, offline LLM API."""

from shared.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "resolve_model",
    "ATTENTION_BACKENDS",
]


def __getattr__(name: str):
    # the offline API pulls in transformers; load it only when asked for, not for every submodule import
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from executor import llm

        return getattr(llm, name)
    if (
        name == "resolve_model"
    ):  # a model name, .gguf file or directory -> a ready directory (pulled, converted)
        from executor.model_files import resolve_model

        return resolve_model
    if name == "ATTENTION_BACKENDS":  # the --attention-backend choices
        from executor.engine_config import ATTENTION_BACKENDS

        return ATTENTION_BACKENDS
    raise AttributeError(f"module 'executor' has no attribute {name!r}")

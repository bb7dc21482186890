"""The executor: engine (scheduler, block pool, model runner, sampler), model loading, offline LLM API."""

from shared.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "resolve_model",
    "default_gguf",
    "weight_bytes",
    "ATTENTION_BACKENDS",
    "QUANTIZATIONS",
]


def __getattr__(name: str):
    # the offline API pulls in transformers; load it only when asked for, not for every submodule import
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from executor import llm

        return getattr(llm, name)
    if (
        name == "resolve_model"
    ):  # a model name, .gguf file or directory -> a ready directory (pulled, converted)
        from executor.models.model_files import resolve_model

        return resolve_model
    if name == "default_gguf":  # the default model's GGUF file (fetched once into the cache)
        from executor.models.model_files import default_gguf

        return default_gguf
    if name == "weight_bytes":  # a built model's weights as served (quantized ones at their own size)
        from executor.kv.sizing import weight_bytes

        return weight_bytes
    if name == "ATTENTION_BACKENDS":  # the --attention-backend choices
        from executor.engine_config import ATTENTION_BACKENDS

        return ATTENTION_BACKENDS
    if name == "QUANTIZATIONS":  # the --quantization choices
        from executor.engine_config import QUANTIZATIONS

        return QUANTIZATIONS
    raise AttributeError(f"module 'executor' has no attribute {name!r}")

"""LoRA adapters' names as both sides check them: a name becomes a Prometheus label, a usage counter's name and a
field of the wire, so it is short and plain. And how many adapters may be loaded at run time (the Redis registry,
shared.redis_keys.LORA_ADAPTERS) at most."""

from __future__ import annotations

import re

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
MAX_RUNTIME_ADAPTERS = 256


def is_adapter_name(name: object) -> bool:
    return isinstance(name, str) and ADAPTER_NAME.fullmatch(name) is not None


def check_adapter_name(name: object, field: str = "lora_name") -> str:
    """The name, or a ValueError naming the field and what a name may hold."""
    if not is_adapter_name(name):
        raise ValueError(
            f"{field}: {name!r} must be 1-128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"
        )
    return name

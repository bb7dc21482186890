"""Defaults that gateway and executor must agree on."""

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_BLOCK_SIZE = 16

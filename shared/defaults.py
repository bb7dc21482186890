"""Defaults that gateway and executor must agree on."""

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_BLOCK_SIZE = 16
SHUTDOWN_GRACE_PERIOD_S = 30.0  # what SIGTERM gives requests in flight, gateway and executor alike

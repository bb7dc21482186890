"""Structured outputs: grammars and token masks, compiled in a worker process, in tenants' turns."""

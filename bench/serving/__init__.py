"""Benchmarks against a running stack: GuideLLM beside vLLM, lm-evaluation-harness beside HF, a Responses API
conversation, routing policies and the soak (with an OTLP sink for tracing's cost)."""

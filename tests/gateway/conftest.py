"""The gateway tests' shared fixtures: the default model's tokenizer, and the serving stacks that the read-only
HTTP tests share (each started on first use, stopped after the package's last test).

A test on a shared stack only sends requests and reads answers: it kills, stops, drains or restarts nothing and
needs no flags of its own (those start a stack of their own: tests.stacks.serving_stack). What it asserts of
shared state it measures as a change over its own requests, with prompts (and, on the keyed stack, tenants) of its
own, so another module's cached prefixes, limits or counters never decide it."""

from __future__ import annotations

import pytest

from tests.processes import free_port


@pytest.fixture(scope="session")
def tokenizer(default_model):
    from gateway.prompt.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model)


@pytest.fixture(scope="package")
def open_stack(tiny_models, tmp_path_factory):
    """Redis, two executors and two gateways on the tiny llama, without API keys."""
    from tests.stacks import serving_stack

    logs = tmp_path_factory.mktemp("open-stack")
    with serving_stack(tiny_models["llama"], logs, executors=2, gateways=2) as stack:
        yield stack


@pytest.fixture(scope="package")
def otlp_receiver():
    from tests.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="package")
def keyed_stack(tiny_models, tmp_path_factory, otlp_receiver):
    """Redis, one executor and two gateways on the tiny llama, both gateways with --require-api-key and the first
    with --metrics-port; every process exports its spans to otlp_receiver. Tenants: each module's own."""
    from tests.stacks import serving_stack

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with serving_stack(
        tiny_models["llama"],
        tmp_path_factory.mktemp("keyed-stack"),
        gateways=[("--metrics-port", str(free_port())), ()],
        gateway_flags=("--require-api-key",),
        env=env,
        tenants=("bootstrap",),  # a gateway that requires keys does not start before one exists
    ) as stack:
        yield stack


@pytest.fixture(scope="package")
def default_model_stack(default_model, tmp_path_factory):
    """The default model, for what a random one cannot show (objects that parse, calls the model writes): one
    executor, a gateway with --tool-call-parser none and a default one (hermes, which its template implies)."""
    from tests.stacks import serving_stack

    with serving_stack(
        default_model,
        tmp_path_factory.mktemp("default-model-stack"),
        executor_flags=("--kv-cache-memory", "256MiB"),
        gateways=[("--tool-call-parser", "none"), ()],
    ) as stack:
        yield stack

"""The default model's tokenizer, loaded once: the gateway's tests run on the real vocabulary and template."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(default_model):
    from gateway.prompt.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model)

"""bench/quantized_models.py's variant names, which both quantization benchmarks take: VARIANT or
VARIANT:ACTIVATIONS."""

from __future__ import annotations

import argparse

import pytest

from bench.quantized_models import split_variant, variant_list


def test_a_variant_may_name_the_activations_its_quantized_weights_multiply() -> None:
    assert split_variant("q4_1") == ("q4_1", None)
    assert split_variant("q4_1:int16") == ("q4_1", "int16")
    assert variant_list("float32,q8_0:float32,,q4_1:int16") == ["float32", "q8_0:float32", "q4_1:int16"]


def test_an_unknown_variant_is_named() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="unknown variant 'q4_2:int16'"):
        variant_list("q4_1,q4_2:int16")

"""What the quantization benchmarks serve: the default model as float32 (--quantization none), int8 (int8, quantized
at load time), and its GGUF files served as they are (auto): the default package's own (Q4_1 matrices, a Q8_0
embedding) and a Q8_0 copy of it, written once into kvserve's cache.

The Q8_0 copy keeps every metadata field and tensor of the default file and requantizes each quantized tensor
from its float32 values with gguf.quants (bit-exact with llama.cpp's own Q8_0). Those float32 values are the Q4_1
file's, dequantized: the default package ships no higher precision, so the copy measures Q8_0's own cost on top
of the same weights, not Q8_0 against the original checkpoint.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import gguf
from gguf.quants import dequantize, quantize

from executor import default_gguf
from shared.model_paths import cache_dir


def requantized(source: Path, dest: Path, qtype: gguf.GGMLQuantizationType, file_type: int) -> Path:
    """dest: source with its quantized tensors requantized to qtype (F32/F16 tensors as they are); written
    beside dest and renamed into place, so it is whole or absent."""
    if dest.is_file():
        return dest
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    partial = dest.with_name(f".{dest.name}.partial")
    writer = gguf.GGUFWriter(partial, arch)
    for field in reader.fields.values():
        # the writer adds these itself (as gguf's own gguf_new_metadata script does)
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = file_type if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    for tensor in reader.tensors:
        if tensor.tensor_type in float_types:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        else:
            blocks = quantize(dequantize(tensor.data, tensor.tensor_type), qtype)
            writer.add_tensor(tensor.name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, dest)
    return dest


def default_q8_0() -> Path:
    """The default model as Q8_0, made once in kvserve's cache."""
    source = default_gguf()
    dest = cache_dir() / "gguf" / source.name.replace(".Q4_1.", ".Q8_0.")
    return requantized(source, dest, gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)


# the GGUF files by the name the benchmarks give them
GGUF_FILES = {"q4_1": default_gguf, "q8_0": default_q8_0}
# kvserve's variants: name -> (the GGUF file made for it, None for the default model's; --quantization)
VARIANTS = {
    "float32": (None, "none"),
    "int8": (None, "int8"),
    "q8_0": (default_q8_0, "auto"),
    "q4_1": (None, "auto"),
}


def split_variant(name: str) -> tuple[str, str | None]:
    """VARIANT or VARIANT:ACTIVATIONS (--quantized-activations for its quantized weights, e.g. q4_1:int16) -> the
    variant and the activations asked for (None: the engine's default)."""
    base, _, activations = name.partition(":")
    return base, activations or None


def variant_list(text: str) -> list[str]:
    """--variants: comma-separated VARIANT or VARIANT:ACTIVATIONS; an unknown variant is an argparse error."""
    names = [name for name in text.split(",") if name]
    if unknown := [name for name in names if split_variant(name)[0] not in VARIANTS]:
        raise argparse.ArgumentTypeError(
            f"unknown variant {unknown[0]!r} ({', '.join(VARIANTS)}, each optionally :ACTIVATIONS)"
        )
    return names


def variant_model(name: str) -> tuple[str, str]:
    """(the model to serve: a model directory, as `kvserve model pull` prints it; --quantization) for a
    variant; the Q8_0 file is made (and converted) the first time."""
    from executor import resolve_model

    gguf_file, quantization = VARIANTS[name]
    return str(resolve_model(None if gguf_file is None else str(gguf_file()))), quantization

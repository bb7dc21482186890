"""--quantization: a float checkpoint's linear layers (the LM head included) quantized at load time.

int8: symmetric integers with a float32 scale per output row (or per group of inputs), kvkernels/quantized.py's
QuantizedLinear; on the CPU its GEMM reads the integers and converts them in registers, a quarter of float32's bytes
(kvkernels/csrc/quantized_gemm_cpu.cpp). fp8: e4m3 with a scale per output row; on Hopper GPUs torch's scaled matmul
multiplies it with the activations quantized per token as they come (w8a8), elsewhere it is dequantized in the
forward (an emulation: the memory saved, not the time). auto leaves the weights as the checkpoint has them (float
stays float; a GGUF's quantized blocks stay quantized).

An embedding table tied to the LM head looks its rows up in the quantized head rather than keeping a float copy.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvkernels.quantized import QuantizedLinear, quantize_int8

log = logging.getLogger("kvserve.kernels")

FP8_MAX = 448.0  # the largest finite float8 e4m3fn


def _check(model: nn.Module, method: str, group_size: int | None) -> None:
    """A ValueError naming the flag where method cannot serve this model (the choices themselves are
    EngineConfig's to check)."""
    if method not in ("auto", "none", "int8", "fp8"):
        raise ValueError(f"--quantization: unknown method {method!r}")
    if method == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"--quantization fp8: torch {torch.__version__} has no float8_e4m3fn")
    if method == "int8" and group_size is not None:
        misfits = sorted(
            {
                m.in_features
                for m in model.modules()
                if isinstance(m, nn.Linear) and m.in_features % group_size
            }
        )
        if misfits:
            raise ValueError(
                f"--quantization-group-size {group_size} does not divide the inputs of every linear layer "
                f"({', '.join(map(str, misfits))})"
            )


def fp8_matmul_available(device: torch.device) -> bool:
    """torch._scaled_mm with per-row scales: CUDA devices of compute capability 9.0 (Hopper) and later."""
    return (
        device.type == "cuda"
        and hasattr(torch, "_scaled_mm")
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


class Fp8Linear(nn.Module):
    """y = x W^T + b with W as float8 e4m3 and a float32 scale per output row."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1) / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        # plain attributes: a quantized layout has no place in a state_dict
        self.weight_fp8 = (weight / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        self.scale = scale
        self.bias = None if linear.bias is None else linear.bias.detach()
        # _scaled_mm wants dimensions in multiples of 16 and a column-major second operand
        self._scaled = fp8_matmul_available(weight.device) and self.in_features % 16 == 0
        self._scaled &= self.out_features % 16 == 0

    @property
    def nbytes(self) -> int:
        return self.weight_fp8.numel() + 4 * self.scale.numel()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight_fp8.float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._scaled and x.dtype == torch.bfloat16:
            return self._scaled_forward(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.dequantize(x.dtype), bias)

    def _scaled_forward(self, x: torch.Tensor) -> torch.Tensor:
        """w8a8: each row of x quantized with its own scale, then one scaled matmul in float32 accumulation."""
        rows = x.reshape(-1, self.in_features)
        x_scale = (rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_(min=1e-12)
        x_fp8 = (rows.float() / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(
            x_fp8,
            self.weight_fp8.t(),
            scale_a=x_scale,
            scale_b=self.scale[None, :],
            bias=None if self.bias is None else self.bias.to(torch.bfloat16),
            out_dtype=torch.bfloat16,
        )
        return y.view(*x.shape[:-1], self.out_features)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ids of W, as an embedding table tied to this layer looks them up."""
        # gathered as bytes: indexing kernels for float8 itself are not on every device in every torch
        rows = self.weight_fp8.view(torch.uint8)[ids].view(torch.float8_e4m3fn)
        return (rows.float() * self.scale[ids].unsqueeze(-1)).to(dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"scaled_mm={self._scaled}"
        )


class TiedEmbedding(nn.Module):
    """An embedding table whose rows are those of a quantized LM head's weight (tied embeddings)."""

    def __init__(self, head: QuantizedLinear | Fp8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.head, self.dtype = head, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed(ids, self.dtype)


def quantize_linears(model: nn.Module, method: str, group_size: int | None = None) -> int:
    """Swap every nn.Linear inside model for its quantized form under method (auto and none: nothing), and an
    embedding that shares a swapped layer's weight for a TiedEmbedding; returns how many layers were swapped."""
    _check(model, method, group_size)
    if method in ("auto", "none"):
        return 0
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    quantized_of: dict[int, nn.Module] = {}  # id of a float weight -> the layer that now serves it
    for parent, name, child in swaps:
        if method == "int8":
            layer = QuantizedLinear(quantize_int8(child.weight, group_size), child.bias)
        else:
            layer = Fp8Linear(child)
        quantized_of[id(child.weight)] = layer
        setattr(parent, name, layer)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Embedding) and id(child.weight) in quantized_of:
                head = quantized_of[id(child.weight)]
                setattr(parent, name, TiedEmbedding(head, child.weight.dtype))
    log.info("quantized %d linear layers to %s", len(swaps), method)
    return len(swaps)

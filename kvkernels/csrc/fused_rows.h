// fused_cpu.cpp's operations on one row of raw floats, for the kernels that call them without tensors (the
// decoder stack's team, decoder_stack_cpu.cpp). The arithmetic is torch's, as there.
#pragma once

#include <cstdint>

namespace fused {

// whether rms_norm_row sums a row of H in torch's order here (else torch's own operations must)
bool norm_in_torch_order(int64_t H);
// out = rms_norm(s) * w over one row of H; only where norm_in_torch_order(H)
void rms_norm_row(const float* s, const float* w, int64_t H, float eps, float* out);
// out = (s * inv) * w over one row of H
void scale_row(const float* s, const float* w, int64_t H, float inv, float* out);
// s = a + b over n floats (s may be a or b)
void add(const float* a, const float* b, int64_t n, float* s);
// x[0:h], x[h:2h] <- x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2 (rotate-half, as HF writes it)
void rotate_head(float* x, const float* c, const float* sn, int64_t half);
// out = silu(g) * u over I floats, silu(x) = x / (1 + exp(-x)) as torch computes it
void silu_and_mul_row(const float* g, const float* u, int64_t I, float* out);

}  // namespace fused

// The small per-layer operations of a decoder on the CPU, each one pass over its rows: the residual add fused
// with RMSNorm, rotary embedding in place, the KV cache write, and SiLU(gate) * up. Eagerly, torch spends more
// time dispatching these (~35 operations a layer) than computing them at decode batch sizes.
//
// The arithmetic is torch's own, operation for operation (at::vec's Vectorized<float>, whose exp is the Sleef
// function torch's kernels call, and the build turns off fused multiply-add contraction), so results match the
// torch path bit for bit.
#include "cpu_vec.h"
#include "fused_rows.h"
#include "torch_row_sum.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <tuple>

namespace fused {

using Vec = at::vec::Vectorized<float>;

// torch splits one row's sum over threads from 32768 elements: another order
bool norm_in_torch_order(int64_t H) { return H < 32768 && torch_order::sum_lanes() > 0; }

void scale_row(const float* s, const float* w, int64_t H, float inv, float* out) {
  const Vec vinv(inv);
  int64_t i = 0;
  for (; i + Vec::size() <= H; i += Vec::size()) ((Vec::loadu(s + i) * vinv) * Vec::loadu(w + i)).store(out + i);
  for (; i < H; ++i) out[i] = (s[i] * inv) * w[i];
}

void rms_norm_row(const float* s, const float* w, int64_t H, float eps, float* out) {
  const int64_t lanes = torch_order::sum_lanes();
  const float mean = torch_order::sum_of_squares(s, H, H < lanes ? 1 : lanes) / static_cast<float>(H);
  scale_row(s, w, H, 1.f / std::sqrt(mean + eps), out);
}

void add(const float* a, const float* b, int64_t n, float* s) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(a + i) + Vec::loadu(b + i)).store(s + i);
  for (; i < n; ++i) s[i] = a[i] + b[i];
}

void rotate_head(float* x, const float* c, const float* sn, int64_t half) {
  int64_t i = 0;
  for (; i + Vec::size() <= half; i += Vec::size()) {
    const Vec x1 = Vec::loadu(x + i), x2 = Vec::loadu(x + half + i);
    const Vec lo = x1 * Vec::loadu(c + i) - x2 * Vec::loadu(sn + i);
    const Vec hi = x2 * Vec::loadu(c + half + i) + x1 * Vec::loadu(sn + half + i);
    lo.store(x + i);
    hi.store(x + half + i);
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    x[i] = x1 * c[i] - x2 * sn[i];
    x[half + i] = x2 * c[half + i] + x1 * sn[half + i];
  }
}

void silu_and_mul_row(const float* g, const float* u, int64_t I, float* out) {
  const Vec one(1.f);
  int64_t i = 0;
  for (; i + Vec::size() <= I; i += Vec::size()) {
    const Vec gv = Vec::loadu(g + i);
    ((gv / (one + gv.neg().exp())) * Vec::loadu(u + i)).store(out + i);
  }
  for (; i < I; ++i) out[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
}

}  // namespace fused

namespace {

using Vec = at::vec::Vectorized<float>;

// rows a thread takes at least: a decode batch's few rows are not worth waking a second thread for
inline int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elements)); }

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, what, ": float32 only");
  TORCH_CHECK(t.device().is_cpu(), what, ": CPU tensors only");
}

// out = rms_norm(s) * weight for rows of s: torch's x * rsqrt(mean(x^2) + eps), then * weight (its rsqrt is
// 1 / sqrt, each correctly rounded). The mean of squares is summed in torch's order (torch_row_sum.h); where that
// order is unknown here, by torch's own pow and mean.
void rms_norm_rows(const at::Tensor& summed, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t H = summed.size(-1), rows = H ? summed.numel() / H : 0;
  const float* s = summed.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::Tensor variance;
  if (!fused::norm_in_torch_order(H)) variance = summed.pow(2).mean(-1, true).contiguous();
  const float* var = variance.defined() ? variance.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (var == nullptr)
        fused::rms_norm_row(s + r * H, w, H, feps, o + r * H);
      else
        fused::scale_row(s + r * H, w, H, 1.f / std::sqrt(var[r] + feps), o + r * H);
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight, const char* what) {
  check_rows(x, what);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), what, ": contiguous tensors only");
  TORCH_CHECK(weight.scalar_type() == at::kFloat, what, ": float32 only");
  TORCH_CHECK(weight.numel() == x.size(-1), what, ": weight has ", weight.numel(), " entries for rows of ",
              x.size(-1));
}

}  // namespace

// rms_norm(x) * weight over the last dimension, as torch's rms_norm
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight, "rms_norm");
  auto out = at::empty_like(x);
  rms_norm_rows(x, weight, eps, out);
  return out;
}

// (rms_norm(x + residual) * weight, x + residual) over the last dimension
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_norm(x, weight, "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual differ in shape");
  TORCH_CHECK(residual.is_contiguous() && residual.scalar_type() == at::kFloat,
              "add_rms_norm: residual must be contiguous float32");
  const int64_t n = x.numel();
  auto summed = at::empty_like(x);
  auto out = at::empty_like(x);
  const float* a = x.data_ptr<float>();
  const float* b = residual.data_ptr<float>();
  float* s = summed.data_ptr<float>();
  at::parallel_for(0, n, 32768,
                   [&](int64_t begin, int64_t end) { fused::add(a + begin, b + begin, end - begin, s + begin); });
  rms_norm_rows(summed, weight, eps, out);
  return {out, summed};
}

namespace {

void check_heads(const at::Tensor& t, const char* what) {
  check_rows(t, what);
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2),
              what, ": [tokens, heads, head_dim] with each token's heads contiguous");
}

}  // namespace

// query [T, Hq, D] and key [T, Hkv, D] rotated in place; cos, sin [T, D] (each half repeated)
void rotary_embedding_(at::Tensor query, at::Tensor key, const at::Tensor& cos, const at::Tensor& sin) {
  check_heads(query, "rotary_embedding");
  check_heads(key, "rotary_embedding");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "rotary_embedding: cos and sin must be contiguous float32");
  const int64_t T = query.size(0), Hq = query.size(1), Hkv = key.size(1), D = query.size(2);
  TORCH_CHECK(key.size(0) == T && key.size(2) == D && cos.size(0) == T && cos.size(1) == D,
              "rotary_embedding: shapes disagree");
  TORCH_CHECK(D % 2 == 0, "rotary_embedding: odd head_dim");
  float* q = query.data_ptr<float>();
  float* k = key.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const int64_t qs = query.stride(0), ks = key.stride(0);
  at::parallel_for(0, T, grain((Hq + Hkv) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < Hq; ++h) fused::rotate_head(q + t * qs + h * D, c + t * D, sn + t * D, D / 2);
      for (int64_t h = 0; h < Hkv; ++h) fused::rotate_head(k + t * ks + h * D, c + t * D, sn + t * D, D / 2);
    }
  });
}

// key, value [T, Hkv, D] into key_cache, value_cache [N, B, Hkv, D] at slot_mapping [T] (block * B + offset);
// a slot of -1 (padding) writes nothing
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping) {
  check_heads(key, "reshape_and_cache");
  check_heads(value, "reshape_and_cache");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "reshape_and_cache: contiguous caches only");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "reshape_and_cache: slot_mapping must be contiguous int64");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  TORCH_CHECK(key_cache.size(2) * key_cache.size(3) == row && value.size(0) == T,
              "reshape_and_cache: shapes disagree");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "reshape_and_cache: slot ", slots[t], " is outside the cache");
  }
  const int64_t ks = key.stride(0), vs = value.stride(0);
  at::parallel_for(0, T, grain(2 * row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      std::memcpy(kc + slots[t] * row, k + t * ks, row * sizeof(float));
      std::memcpy(vc + slots[t] * row, v + t * vs, row * sizeof(float));
    }
  });
}

// [T, 2I] (gate, then up) -> [T, I]: silu(gate) * up, silu(x) = x / (1 + exp(-x)) as torch computes it
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: [tokens, 2 * intermediate] with contiguous rows");
  const int64_t T = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  auto out = at::empty({T, I}, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = in + t * xs;
      fused::silu_and_mul_row(g, g + I, I, o + t * I);
    }
  });
  return out;
}

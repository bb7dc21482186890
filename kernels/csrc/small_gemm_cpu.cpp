// y = x W^T (+ b) for the few rows of a decode step, float32 on the CPU.
//
// At decode batch sizes a weight matrix is read once per step and every element takes part in only a few
// dozen multiply-adds, so the GEMM must stream the weights from memory at full speed while the arithmetic keeps
// up. oneDNN's general GEMM reached about half of the machine's multiply-add rate at 16 rows (its fixed cost per
// call, packing the activations and walking its blocking for large matrices, is paid on every one of the ~120
// GEMMs of a step). Here the weight is packed once, at load time, into panels of 16 output columns whose K rows
// lie one after another, so that a panel streams in one sequential read; a register-blocked kernel then keeps
// 6 rows x 16 columns of the output in 12 vector registers while the panel's rows pass by (the 6x16 shape of
// BLIS's Haswell kernel: two vector loads and six broadcasts feed twelve fused multiply-adds). The rows of x
// beyond the first six reuse the panel from cache.
//
// Threads take panels from a shared counter (dynamic_parallel.h), not fixed halves.
#include "cpu_vec.h"
#include "dynamic_parallel.h"

#include <ATen/ATen.h>
#include <algorithm>
#include <cmath>

namespace {

constexpr int64_t kCols = 16;  // output columns a panel holds (two vectors)
constexpr int kRows = 6;       // output rows the kernel holds in registers

// y[r, 0:cols] = x[r, :] . panel (+ bias) for MR rows; the panel is [K, 16], zero-padded past the matrix.
// Twelve named accumulators, not an array: GCC kept an array of them on the stack, storing every one on every k.
template <int MR>
inline void kernel(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* y,
                   int64_t ldy, int64_t cols) {
#if defined(CPU_CAPABILITY_AVX2)
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0,
         b4 = a0, a5 = a0, b5 = a0;
  const float *x0 = x, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx, *x4 = x3 + ldx, *x5 = x4 + ldx;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 lo = _mm256_loadu_ps(panel + k * kCols), hi = _mm256_loadu_ps(panel + k * kCols + 8);
#define KVSERVE_ROW(r)                                   \
  if (MR > r) {                                          \
    const __m256 v = _mm256_broadcast_ss(x##r + k);      \
    a##r = _mm256_fmadd_ps(v, lo, a##r);                 \
    b##r = _mm256_fmadd_ps(v, hi, b##r);                 \
  }
    KVSERVE_ROW(0) KVSERVE_ROW(1) KVSERVE_ROW(2) KVSERVE_ROW(3) KVSERVE_ROW(4) KVSERVE_ROW(5)
#undef KVSERVE_ROW
  }
  float padded[kCols] = {0.f};
  if (bias != nullptr) std::copy(bias, bias + cols, padded);
  const __m256 c0 = _mm256_loadu_ps(padded), c1 = _mm256_loadu_ps(padded + 8);
  const __m256 rows[kRows][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}, {a4, b4}, {a5, b5}};
  for (int r = 0; r < MR; ++r) {
    float tmp[kCols];
    float* out = cols == kCols ? y + r * ldy : tmp;
    _mm256_storeu_ps(out, _mm256_add_ps(rows[r][0], c0));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(rows[r][1], c1));
    if (cols != kCols) std::copy(tmp, tmp + cols, y + r * ldy);
  }
#else
  for (int r = 0; r < MR; ++r) {
    float acc[kCols] = {0.f};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < kCols; ++j) acc[j] = std::fma(x[r * ldx + k], panel[k * kCols + j], acc[j]);
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = acc[j] + (bias != nullptr ? bias[j] : 0.f);
  }
#endif
}

using Kernel = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t);
constexpr Kernel kKernels[kRows + 1] = {nullptr,   &kernel<1>, &kernel<2>, &kernel<3>,
                                        &kernel<4>, &kernel<5>, &kernel<6>};

}  // namespace

// weight [N, K] -> panels [ceil(N / 16), K, 16]: column j of panel p is output p * 16 + j (zeros past N)
at::Tensor pack_gemm_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_gemm_weight: a float32 [out_features, in_features] CPU matrix");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kCols - 1) / kCols;
  auto padded = at::zeros({panels * kCols, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kCols, K}).transpose(1, 2).contiguous();
}

// x [M, K] (rows contiguous), packed from pack_gemm_weight for N outputs, bias [N] or undefined -> [M, N]
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "small_gemm: x [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "small_gemm: packed weight [panels, K, 16] for x's K");
  TORCH_CHECK(packed.size(0) * kCols >= N && packed.size(0) * kCols < N + kCols, "small_gemm: N does not fit");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), panels = packed.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "small_gemm: bias [N] float32");
    b = bias->data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto run_panel = [&](int64_t p) {
    const int64_t col = p * kCols, cols = std::min(kCols, N - col);
    const float* panel = wp + p * K * kCols;
    for (int64_t r = 0; r < M; r += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, M - r);
      kKernels[rows](xp + r * ldx, ldx, panel, K, b == nullptr ? nullptr : b + col, yp + r * N + col, N, cols);
    }
  };
  parallel_dynamic(panels, [] { return 0; }, [&](int64_t p, int) { run_panel(p); });
  return y;
}

// The register-blocked panel kernel that small_gemm and prefill_attention share: y[r, 0:cols] = x[r, :] . panel
// (+ bias) for up to 6 rows, where a panel is [K, 16] floats, one row of K after another (zero-padded past the
// matrix). It keeps 6 rows x 16 columns of the output in 12 vector registers while the panel's rows pass by (the
// 6x16 shape of BLIS's Haswell kernel: two vector loads and six broadcasts feed twelve fused multiply-adds).
// It can also ask for another panel's lines into L2 as it goes, one every few rows of K (small_gemm fetches the
// next panel while the row blocks pass over this one).
#pragma once
#include "cpu_vec.h"
#include "prefetch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace panel_gemm {

constexpr int64_t kCols = 16;  // output columns a panel holds (two vectors)
constexpr int kRows = 6;       // output rows the kernel holds in registers

#if defined(CPU_CAPABILITY_AVX2)
// y[r, 0:cols] = rows[r] (+ bias) for the first MR of the rows a kernel held in registers
template <int MR>
inline void store_rows(const __m256 (&rows)[kRows][2], const float* bias, float* y, int64_t ldy, int64_t cols) {
  float padded[kCols] = {0.f};
  if (bias != nullptr) std::copy(bias, bias + cols, padded);
  const __m256 c0 = _mm256_loadu_ps(padded), c1 = _mm256_loadu_ps(padded + 8);
  for (int r = 0; r < MR; ++r) {
    float tmp[kCols];
    float* out = cols == kCols ? y + r * ldy : tmp;
    _mm256_storeu_ps(out, _mm256_add_ps(rows[r][0], c0));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(rows[r][1], c1));
    if (cols != kCols) std::copy(tmp, tmp + cols, y + r * ldy);
  }
}
#endif
// y[r, 0:cols] = x[r, :] . panel (+ bias) for MR rows; the panel is [K, 16], zero-padded past the matrix.
// With fetch, the line at fetch, then at each 16 floats on, towards L2 every fetch_every rows of the panel.
// Twelve named accumulators, not an array: GCC kept an array of them on the stack, storing every one on every k.
template <int MR>
inline void kernel(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* y,
                   int64_t ldy, int64_t cols, const float* fetch, int64_t fetch_every) {
#if defined(CPU_CAPABILITY_AVX2)
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0,
         b4 = a0, a5 = a0, b5 = a0;
  const float *x0 = x, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx, *x4 = x3 + ldx, *x5 = x4 + ldx;
  const int64_t step = fetch == nullptr ? K : fetch_every;
  for (int64_t k0 = 0; k0 < K; k0 += step) {
    if (fetch != nullptr) {
      prefetch_l2(fetch);
      fetch += kCols;
    }
    for (int64_t k = k0, end = std::min(K, k0 + step); k < end; ++k) {
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
  }
  const __m256 rows[kRows][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}, {a4, b4}, {a5, b5}};
  store_rows<MR>(rows, bias, y, ldy, cols);
#else
  for (int r = 0; r < MR; ++r) {
    float acc[kCols] = {0.f};
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < kCols; ++j) acc[j] = std::fma(x[r * ldx + k], panel[k * kCols + j], acc[j]);
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = acc[j] + (bias != nullptr ? bias[j] : 0.f);
  }
#endif
}

// kKernels[rows](x, ldx, panel, K, bias, y, ldy, cols, fetch, fetch_every) for 1 <= rows <= kRows
using Kernel = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                        const float*, int64_t);
constexpr Kernel kKernels[kRows + 1] = {nullptr,   &kernel<1>, &kernel<2>, &kernel<3>,
                                        &kernel<4>, &kernel<5>, &kernel<6>};

}  // namespace panel_gemm

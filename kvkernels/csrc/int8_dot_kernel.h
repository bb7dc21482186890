// Quantized weights times activations quantized to int8, with AVX-512's integer dot products (VNNI) where the CPU
// has them: quantized_gemm_cpu.cpp's path for weights whose groups are whole blocks of 32 inputs.
//
// Converting integer weights to floats in registers costs about ten vector instructions per 16 weights, so at a
// few rows the float path is bound by instructions, not by memory: 12-13 weights a nanosecond on one thread here,
// where the memory delivers the bytes of twice that. llama.cpp's CPU path quantizes the activations instead and
// multiplies integers; so does this one: each row's activations in blocks of 32 become int8 with a float scale
// (the largest magnitude to 127, rounded to nearest even), and one VPDPBUSD multiplies 64 unsigned weight bytes by
// 64 signed activation bytes, adding groups of four into 16 int32 lanes, one per output column of the panel. The
// integer sums of a block are scaled to floats once per block, the weights' scales and offsets once per group.
// The default model's 120 layer GEMMs (Q4_1), two threads, against the float path: 3.9 ms against 6.1 at one
// row (20 GB/s of weights, near this machine's 27 GB/s of reads), 17.9 against 31.7 at 16 rows, 470 against 712
// at 512. The cost is the activations' rounding: +0.0025 bits per byte of a held text on the default model.
//
// That rounding is noise of about 1% of each GEMM's input (a step of 1/127 of the block's largest magnitude), in
// every layer and projection alike (issue 47): it changes near-tie greedy answers, 30 of 48 held-out questions'
// on the default model, the README's "What is the capital of France?" among them ("L'Étoile, la Marseillaise").
// Two planes (int16 activations) remove it: a block's rounding error, x - q * scale, is at most half a step and
// becomes a second int8 in steps of scale / 254, so the two hold each activation to about 16 bits; the default
// model then gives the dequantized model's 48 answers and 1.0477 bits per byte (int8: 1.0502). The second plane
// runs its own VPDPBUSD over the same permuted weight bytes into an accumulator of its own: the weights are read
// once, a row's integer work doubles.
//
// The panels stay the float path's layout (quantized_gemm_cpu.cpp): a VPDPBUSD needs the four inputs k..k+3 of
// one column side by side, and one byte permute (VBMI) turns four rows of K (or eight of 4 bits, from both of their
// nibbles) into that order in registers.
//
// Per block of 32 inputs, a weight is sum(w_q * x_q) * x_scale, and per group
//   y += w_scale * sum_blocks(that) + w_offset' * sum_blocks(x_scale * sum(x_q)),
// where w_offset' = offset - zero_point * w_scale (the 8-bit weights are made unsigned by adding 128: their zero
// point is 128).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#include "prefetch.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define KVSERVE_INT8_DOT 1
#include <immintrin.h>

namespace int8_dot {

constexpr int64_t kBlock = 32;  // activations a scale
constexpr int64_t kCols = 16;   // output columns a panel holds
constexpr int kRows = 6;        // rows a kernel call holds in registers
// bytes ahead of its reads that the kernel asks L2 for. A thread's panels are contiguous streams, but the
// hardware prefetchers start over at each one and the 4-bit path computes a while per line: measured in one
// process, alternating over the default model's 120 layer GEMMs at one row, 4096 bytes ahead made Q4_1 1.17-1.22x
// and Q8_0 1.05-1.13x faster (1024 ahead: 1.01x and 1.03x; 8192: 1.10x and 1.12x; 16384: 1.03x and 1.07x; into
// L1 instead, Q8_0 0.91-0.94x).
constexpr int64_t kPrefetchBytes = 4096;

constexpr float kResidualSteps = 254.f;  // the second plane's steps to one of the first's

// A row's activations as int8 in blocks of 32: values [K], scales [K / 32] and the block's sum as the planes hold
// it [K / 32]; with two planes also residual [K] and residual_scales [K / 32] (else null).
struct Rows {
  const int8_t* values;
  const float* scales;
  const float* sums;
  int64_t K;
  const int8_t* residual;
  const float* residual_scales;
};

// one block's 32 floats (two halves of 16) rounded to nearest even at inverse and stored as bytes, which
// saturate; the sum of the integers
inline int32_t round_to_bytes(__m512 lo, __m512 hi, float inverse, int8_t* out, __m512i& q_lo, __m512i& q_hi) {
  const __m512 inv = _mm512_set1_ps(inverse);
  q_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
  q_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(q_lo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(q_hi));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
}

// x[r, :] -> int8 blocks of 32, for one row; with residual, the second plane too: each block's rounding error
// x - q * scale in steps of scale / 254 (the error is at most half a step, so the second integers fit a byte)
inline void quantize_row(const float* x, int64_t K, int8_t* values, float* scales, float* sums,
                         int8_t* residual = nullptr, float* residual_scales = nullptr) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float scale = amax / 127.f, inverse = amax > 0.f ? 127.f / amax : 0.f;
    __m512i q_lo, q_hi;
    const int32_t sum = round_to_bytes(lo, hi, inverse, values + b * kBlock, q_lo, q_hi);
    scales[b] = scale;
    sums[b] = scale * static_cast<float>(sum);
    if (residual == nullptr) continue;
    const __m512 s = _mm512_set1_ps(scale);
    const __m512 e_lo = _mm512_sub_ps(lo, _mm512_mul_ps(_mm512_cvtepi32_ps(q_lo), s));
    const __m512 e_hi = _mm512_sub_ps(hi, _mm512_mul_ps(_mm512_cvtepi32_ps(q_hi), s));
    const float step = scale / kResidualSteps;
    const int32_t rest = round_to_bytes(e_lo, e_hi, inverse * kResidualSteps, residual + b * kBlock, q_lo, q_hi);
    residual_scales[b] = step;
    sums[b] += step * static_cast<float>(rest);
  }
}

// a panel group's 16 scales or offsets: float32, or float16 where the weights' own were (GGUF's blocks)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// byte permutes into VPDPBUSD's order: lane c of the result holds column c's inputs k..k+3
inline __m512i transpose_8bit() {  // four rows of 16 bytes: byte 4c + i <- row i, column c
  alignas(64) int8_t idx[64];
  for (int c = 0; c < 16; ++c)
    for (int i = 0; i < 4; ++i) idx[4 * c + i] = static_cast<int8_t>(16 * i + c);
  return _mm512_load_si512(idx);
}
// eight rows of 8 bytes, split into low nibbles (columns 0..7, bytes 0..63) and high ones (columns 8..15, bytes
// 64..127 of the two-table permute): byte 4c + i <- row first + i, column c
inline __m512i transpose_4bit(int first) {
  alignas(64) int8_t idx[64];
  for (int c = 0; c < 16; ++c)
    for (int i = 0; i < 4; ++i) idx[4 * c + i] = static_cast<int8_t>((c < 8 ? 0 : 64) + 8 * (first + i) + c % 8);
  return _mm512_load_si512(idx);
}

// A panel's weights in VPDPBUSD's order (unsigned bytes, lane c holding column c's inputs k..k+3), one step of a
// kernel's inner loop at a time, with the next bytes asked of L2 as they go
struct PanelBytes {
  const __m512i t8 = transpose_8bit(), t4a = transpose_4bit(0), t4b = transpose_4bit(4);
  const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));

  // 8 bits: rows k..k+3, made unsigned by adding 128
  __m512i rows8(const int8_t* q, int64_t k) const {
    prefetch_l2(q + k * kCols + kPrefetchBytes);
    return _mm512_xor_si512(_mm512_permutexvar_epi8(t8, _mm512_loadu_si512(q + k * kCols)), flip);
  }
  // 4 bits: rows k..k+3 (w0) and k+4..k+7 (w1)
  void rows4(const int8_t* q, int64_t k, __m512i& w0, __m512i& w1) const {
    prefetch_l2(q + k * (kCols / 2) + kPrefetchBytes);
    const __m512i raw = _mm512_loadu_si512(q + k * (kCols / 2));
    const __m512i lo = _mm512_and_si512(raw, nibble);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    w0 = _mm512_permutex2var_epi8(lo, t4a, hi);
    w1 = _mm512_permutex2var_epi8(lo, t4b, hi);
  }
};

// a group's c = -zero_point * s + offset, the factor of sum(x_q) * x_scale
template <typename S>
inline __m512 group_offset(const __m512 s, const S* offsets, int64_t g, float zp) {
  __m512 c = _mm512_mul_ps(_mm512_set1_ps(-zp), s);
  if (offsets != nullptr) c = _mm512_add_ps(c, load16(offsets + g * kCols));
  return c;
}

// the bias of a panel's cols columns (zeros past them and where there is none)
inline __m512 panel_bias(const float* bias, int64_t cols) {
  alignas(64) float padded[kCols] = {0.f};
  for (int64_t j = 0; j < cols && bias != nullptr; ++j) padded[j] = bias[j];
  return _mm512_load_ps(padded);
}

inline __mmask16 panel_mask(int64_t cols) { return static_cast<__mmask16>((1u << cols) - 1u); }

// kernel's arithmetic where a group is one block of 32 inputs (GGUF's Q8_0, Q4_0, Q4_1), with each row's values in
// named registers (KVSERVE_ROWS): in the general kernel, arrays of a row block's sums across the blocks of a group
// made GCC store every accumulator to the stack at every step of the inner loop, which held 6 rows to about a
// third of VPDPBUSD's rate (one thread, weights in L2: 1.0-1.1 G instructions a second)
#define KVSERVE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
template <int MR, int BITS, int PLANES, typename S>
void kernel_block_groups(const Rows* x, const int8_t* q, const S* scales, const S* offsets, float zp,
                         const float* bias, float* y, int64_t ldy, int64_t cols) {
  const int64_t K = x[0].K;
#define KVSERVE_ROW_STATE(r)                                                              \
  __m512 out##r = _mm512_setzero_ps();                                                    \
  const int8_t* xv##r = MR > r ? x[MR > r ? r : 0].values : nullptr;                      \
  const float* xs##r = MR > r ? x[MR > r ? r : 0].scales : nullptr;                       \
  const float* xm##r = MR > r ? x[MR > r ? r : 0].sums : nullptr;                         \
  const int8_t* xe##r = PLANES == 2 && MR > r ? x[MR > r ? r : 0].residual : nullptr;     \
  const float* xt##r = PLANES == 2 && MR > r ? x[MR > r ? r : 0].residual_scales : nullptr;
  KVSERVE_ROWS(KVSERVE_ROW_STATE)
#undef KVSERVE_ROW_STATE
  const PanelBytes bytes;
  for (int64_t b = 0; b < K / kBlock; ++b) {
#define KVSERVE_ROW_ZERO(r) __m512i acc##r = _mm512_setzero_si512(), err##r = _mm512_setzero_si512();
    KVSERVE_ROWS(KVSERVE_ROW_ZERO)
#undef KVSERVE_ROW_ZERO
    const int64_t k0 = b * kBlock;
    // a row's four activations at k against w, into acc (and the second plane's into err)
#define KVSERVE_DOT(r, w, k)                                                                                   \
  acc##r = _mm512_dpbusd_epi32(acc##r, w, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xv##r + (k)))); \
  if constexpr (PLANES == 2)                                                                                   \
    err##r = _mm512_dpbusd_epi32(err##r, w, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xe##r + (k))));
    if constexpr (BITS == 8) {
      for (int64_t k = k0; k < k0 + kBlock; k += 4) {
        const __m512i w = bytes.rows8(q, k);
#define KVSERVE_ROW_DOT(r) \
  if constexpr (MR > r) {  \
    KVSERVE_DOT(r, w, k)   \
  }
        KVSERVE_ROWS(KVSERVE_ROW_DOT)
#undef KVSERVE_ROW_DOT
      }
    } else {
      for (int64_t k = k0; k < k0 + kBlock; k += 8) {
        __m512i w0, w1;
        bytes.rows4(q, k, w0, w1);
#define KVSERVE_ROW_DOT(r)   \
  if constexpr (MR > r) {    \
    KVSERVE_DOT(r, w0, k)    \
    KVSERVE_DOT(r, w1, k + 4) \
  }
        KVSERVE_ROWS(KVSERVE_ROW_DOT)
#undef KVSERVE_ROW_DOT
      }
    }
#undef KVSERVE_DOT
    // the general kernel's operations in its order: dots = x_scale * sum (+ the second plane's), then
    // out += c * xsum + s * dots
    const __m512 s = load16(scales + b * kCols), c = group_offset(s, offsets, b, zp);
#define KVSERVE_ROW_OUT(r)                                                                                 \
  if constexpr (MR > r) {                                                                                  \
    __m512 dots = _mm512_fmadd_ps(_mm512_set1_ps(xs##r[b]), _mm512_cvtepi32_ps(acc##r), _mm512_setzero_ps()); \
    if constexpr (PLANES == 2)                                                                             \
      dots = _mm512_fmadd_ps(_mm512_set1_ps(xt##r[b]), _mm512_cvtepi32_ps(err##r), dots);                  \
    out##r = _mm512_fmadd_ps(c, _mm512_set1_ps(0.f + xm##r[b]), _mm512_fmadd_ps(s, dots, out##r));               \
  }
    KVSERVE_ROWS(KVSERVE_ROW_OUT)
#undef KVSERVE_ROW_OUT
  }
  const __m512 add = panel_bias(bias, cols);
  const __mmask16 mask = panel_mask(cols);
#define KVSERVE_ROW_STORE(r) \
  if constexpr (MR > r) _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_add_ps(out##r, add));
  KVSERVE_ROWS(KVSERVE_ROW_STORE)
#undef KVSERVE_ROW_STORE
}
#undef KVSERVE_ROWS

// y[r, 0:cols] = x[r, :] . W (+ bias) for MR rows over one panel: q its K rows of 16 bytes (BITS 8, signed) or 8
// (BITS 4, unsigned nibbles, zero_point 0 or 8); scales, offsets (or null): [K / G, 16] of S (float or c10::Half);
// G a multiple of 32. PLANES 2: the rows hold their activations' second plane (Rows::residual).
template <int MR, int BITS, int PLANES, typename S>
void kernel(const Rows* x, const int8_t* q, const S* scales, const S* offsets, int64_t G, float zero_point,
            const float* bias, float* y, int64_t ldy, int64_t cols) {
  const int64_t K = x[0].K, blocks_per_group = G / kBlock;
  const float zp = BITS == 8 ? 128.f : zero_point;
  if (MR > 1 && blocks_per_group == 1)
    return kernel_block_groups<MR, BITS, PLANES, S>(x, q, scales, offsets, zp, bias, y, ldy, cols);
  __m512 out[MR];
  for (int r = 0; r < MR; ++r) out[r] = _mm512_setzero_ps();
  const PanelBytes bytes;
  for (int64_t g = 0, b = 0; b < K / kBlock; ++g) {
    __m512 dots[MR];  // sum over the group's blocks of x_scale * sum(w_q * x_q), over both planes
    float xsum[MR];   // sum over them of the blocks' sums
    for (int r = 0; r < MR; ++r) dots[r] = _mm512_setzero_ps(), xsum[r] = 0.f;
    for (const int64_t end = b + blocks_per_group; b < end; ++b) {
      __m512i acc[MR], err[MR];
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_si512(), err[r] = _mm512_setzero_si512();
      const int64_t k0 = b * kBlock;
      if constexpr (BITS == 8) {
        for (int64_t k = k0; k < k0 + kBlock; k += 4) {
          const __m512i w = bytes.rows8(q, k);
          for (int r = 0; r < MR; ++r) {
            acc[r] = _mm512_dpbusd_epi32(
                acc[r], w, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x[r].values + k)));
            if constexpr (PLANES == 2)
              err[r] = _mm512_dpbusd_epi32(
                  err[r], w, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x[r].residual + k)));
          }
        }
      } else {
        for (int64_t k = k0; k < k0 + kBlock; k += 8) {
          __m512i w0, w1;
          bytes.rows4(q, k, w0, w1);
          for (int r = 0; r < MR; ++r) {
            const int8_t* xv = x[r].values + k;
            acc[r] = _mm512_dpbusd_epi32(acc[r], w0, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xv)));
            acc[r] = _mm512_dpbusd_epi32(acc[r], w1, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xv + 4)));
            if constexpr (PLANES == 2) {
              const int8_t* xe = x[r].residual + k;
              err[r] = _mm512_dpbusd_epi32(err[r], w0, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xe)));
              err[r] = _mm512_dpbusd_epi32(err[r], w1, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xe + 4)));
            }
          }
        }
      }
      for (int r = 0; r < MR; ++r) {
        dots[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r].scales[b]), _mm512_cvtepi32_ps(acc[r]), dots[r]);
        if constexpr (PLANES == 2)
          dots[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r].residual_scales[b]), _mm512_cvtepi32_ps(err[r]), dots[r]);
        xsum[r] += x[r].sums[b];
      }
    }
    const __m512 s = load16(scales + g * kCols), c = group_offset(s, offsets, g, zp);
    for (int r = 0; r < MR; ++r)
      out[r] = _mm512_fmadd_ps(c, _mm512_set1_ps(xsum[r]), _mm512_fmadd_ps(s, dots[r], out[r]));
  }
  const __m512 add = panel_bias(bias, cols);
  const __mmask16 mask = panel_mask(cols);
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_add_ps(out[r], add));
}

template <typename S>
using Kernel = void (*)(const Rows*, const int8_t*, const S*, const S*, int64_t, float, const float*, float*, int64_t,
                        int64_t);
// kKernels<BITS, PLANES, S>[rows] for 1 <= rows <= kRows
template <int BITS, int PLANES, typename S>
constexpr Kernel<S> kKernels[kRows + 1] = {
    nullptr,                         &kernel<1, BITS, PLANES, S>, &kernel<2, BITS, PLANES, S>,
    &kernel<3, BITS, PLANES, S>, &kernel<4, BITS, PLANES, S>, &kernel<5, BITS, PLANES, S>,
    &kernel<6, BITS, PLANES, S>};

}  // namespace int8_dot
#endif

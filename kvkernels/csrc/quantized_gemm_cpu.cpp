// y = x W^T (+ b) with W held as 8- or 4-bit integers and a float scale (and offset) per group of G inputs of each
// output row (kvkernels/quantized.py's QuantizedWeight); x and y float32, on the CPU.
//
// A decode step at one stream reads every weight once and does two flops with each: it is bound by the bytes of the
// weights, so int8 reads a quarter of float32's and 4 bits an eighth. The layout is small_gemm_cpu.cpp's, in
// integers: panels of 16 output columns whose K rows lie one after another ([panels, K, 16] int8; 4 bits: 8 bytes a
// row of K, column j in the low nibble of byte j and column j + 8 in its high nibble), and the scales and offsets
// beside them as [panels, K / G, 16] float32, or float16 where they are float16 values (GGUF's: Q4_1 then reads 20
// bytes a block of 32 weights as its file holds them, not 24). The kernel converts each row of 16 integers to floats
// in registers, makes them weights with one multiply-add by the group's scale and offset (once per k, shared by the
// 6 rows of the register block), and then runs panel_kernel.h's 6 x 16 block of multiply-adds. Signed 4-bit values
// are stored plus 8 (zero_point) and the kernel subtracts 8 scales per group in registers, so Q4_0 costs no offsets
// in memory.
//
// Past 6 rows, converting again for every row block cost 10-15% over float32 at 16-64 rows (the conversion is
// about half a block's instructions). So the first row block also writes the floats it made to a buffer of the
// thread's ([K, 16], in L2), and the float32 panel kernel passes the other blocks over that: a weight is converted
// once per call at any batch size. Measured on the default model's shapes, one thread, CPU time a step of all its
// GEMMs: 1 row 12 ms against float32's 31 (int8; 4 bits with a scale per 32: 12), 6 rows 27 against 58, 16 rows
// 77 against 77, 64 rows 230 against 239.
//
// Threads take panels from a shared counter (dynamic_parallel.h) as the float32 kernel does; with int8 activations at
// one block of rows, each its own range of them (stealing_parallel.h).
//
// With activation_planes 1 (int8) the activations are quantized to int8 in blocks of 32 and multiplied as integers
// (int8_dot_kernel.h, AVX-512 VNNI), at every row count: a row's result then does not depend on the rows beside it.
// With 2 (int16) each block's rounding error is a second int8 plane, multiplied beside the first; 0 is float32.
#include "cpu_vec.h"
#include "dynamic_parallel.h"
#include "int8_dot_kernel.h"
#include "quantized_gemm_cpu.h"
#include "panel_kernel.h"
#include "stealing_parallel.h"

#include <ATen/ATen.h>
#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

using panel_gemm::kCols;
using panel_gemm::kRows;

template <int BITS>
constexpr int64_t kRowBytes = BITS == 8 ? kCols : kCols / 2;  // bytes of one row of K in a panel

inline float scale_at(const float* p, int64_t j) { return p[j]; }
inline float scale_at(const c10::Half* p, int64_t j) { return static_cast<float>(p[j]); }

#if defined(CPU_CAPABILITY_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int64_t j = 0; j < 8; ++j) f[j] = scale_at(p, j);
  return _mm256_load_ps(f);
#endif
}
#endif

// One group's scale and offset for the panel's 16 columns, from float32 or float16 (S); a zero point subtracts
// zero_point scales.
struct Group {
#if defined(CPU_CAPABILITY_AVX2)
  __m256 s_lo, s_hi, m_lo, m_hi;
  template <typename S>
  Group(const S* scales, const S* offsets, float zero_point) {
    const __m256 zero = _mm256_set1_ps(-zero_point);
    s_lo = load8(scales), s_hi = load8(scales + 8);
    m_lo = _mm256_mul_ps(zero, s_lo), m_hi = _mm256_mul_ps(zero, s_hi);
    if (offsets != nullptr) {
      m_lo = _mm256_add_ps(m_lo, load8(offsets));
      m_hi = _mm256_add_ps(m_hi, load8(offsets + 8));
    }
  }
  // the 16 weights of one row of K: integers to floats in registers, then one multiply-add each half
  template <int BITS>
  void weights(const int8_t* row, __m256& lo, __m256& hi) const {
    __m256i i_lo, i_hi;
    if constexpr (BITS == 8) {
      i_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row)));
      i_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8)));
    } else {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row)));
      i_lo = _mm256_and_si256(bytes, _mm256_set1_epi32(0xF));
      i_hi = _mm256_srli_epi32(bytes, 4);
    }
    lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i_lo), s_lo, m_lo);
    hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i_hi), s_hi, m_hi);
  }
#else
  float s[kCols], m[kCols];
  template <typename S>
  Group(const S* scales, const S* offsets, float zero_point) {
    for (int64_t j = 0; j < kCols; ++j) {
      s[j] = scale_at(scales, j);
      m[j] = -zero_point * s[j] + (offsets != nullptr ? scale_at(offsets, j) : 0.f);
    }
  }
  template <int BITS>
  void weights(const int8_t* row, float* w) const {
    for (int64_t j = 0; j < kCols; ++j) {
      const int v = BITS == 8 ? row[j] : (j < 8 ? static_cast<uint8_t>(row[j]) & 0xF : static_cast<uint8_t>(row[j - 8]) >> 4);
      w[j] = std::fma(static_cast<float>(v), s[j], m[j]);
    }
  }
#endif
};

// y[r, 0:cols] = x[r, :] . W for MR rows over one panel of W: q its K rows of 16 (BITS 8) or 8 bytes (BITS 4);
// scales, offsets (or null): [K / G, 16] of S (float or c10::Half); bias null or [cols]. The weights become floats
// in registers, once per row of K for all MR rows, as they stream by; with store, they are also written there
// ([K, 16]) for the row blocks that follow.
template <int MR, int BITS, typename S>
void kernel(const float* x, int64_t ldx, const int8_t* q, const S* scales, const S* offsets, int64_t K,
            int64_t G, float zero_point, const float* bias, float* y, int64_t ldy, int64_t cols, float* store) {
#if defined(CPU_CAPABILITY_AVX2)
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0,
         b4 = a0, a5 = a0, b5 = a0;
  const float *x0 = x, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx, *x4 = x3 + ldx, *x5 = x4 + ldx;
  for (int64_t g = 0, k = 0; k < K; ++g) {
    const Group group(scales + g * kCols, offsets == nullptr ? nullptr : offsets + g * kCols, zero_point);
    for (const int64_t end = k + G; k < end; ++k) {
      __m256 lo, hi;
      group.weights<BITS>(q + k * kRowBytes<BITS>, lo, hi);
      if (store != nullptr) {
        _mm256_storeu_ps(store + k * kCols, lo);
        _mm256_storeu_ps(store + k * kCols + 8, hi);
      }
#define KVSERVE_ROW(r)                              \
  if (MR > r) {                                     \
    const __m256 v = _mm256_broadcast_ss(x##r + k); \
    a##r = _mm256_fmadd_ps(v, lo, a##r);            \
    b##r = _mm256_fmadd_ps(v, hi, b##r);            \
  }
      KVSERVE_ROW(0) KVSERVE_ROW(1) KVSERVE_ROW(2) KVSERVE_ROW(3) KVSERVE_ROW(4) KVSERVE_ROW(5)
#undef KVSERVE_ROW
    }
  }
  const __m256 rows[kRows][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}, {a4, b4}, {a5, b5}};
  panel_gemm::store_rows<MR>(rows, bias, y, ldy, cols);
#else
  float acc[kRows][kCols] = {};
  for (int64_t g = 0, k = 0; k < K; ++g) {
    const Group group(scales + g * kCols, offsets == nullptr ? nullptr : offsets + g * kCols, zero_point);
    for (const int64_t end = k + G; k < end; ++k) {
      float own[kCols];
      float* w = store != nullptr ? store + k * kCols : own;
      group.weights<BITS>(q + k * kRowBytes<BITS>, w);
      for (int r = 0; r < MR; ++r)
        for (int64_t j = 0; j < kCols; ++j) acc[r][j] = std::fma(x[r * ldx + k], w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int64_t j = 0; j < cols; ++j) y[r * ldy + j] = acc[r][j] + (bias != nullptr ? bias[j] : 0.f);
#endif
}

template <typename S>
using Kernel = void (*)(const float*, int64_t, const int8_t*, const S*, const S*, int64_t, int64_t, float,
                        const float*, float*, int64_t, int64_t, float*);
// kIntKernels<BITS, S>[rows] for 1 <= rows <= kRows
template <int BITS, typename S>
constexpr Kernel<S> kIntKernels[kRows + 1] = {nullptr,            &kernel<1, BITS, S>, &kernel<2, BITS, S>,
                                              &kernel<3, BITS, S>, &kernel<4, BITS, S>, &kernel<5, BITS, S>,
                                              &kernel<6, BITS, S>};

// [N, C] -> [ceil(N / 16), C, 16]: column j of panel p is row p * 16 + j of t (zeros past N)
at::Tensor to_panels(const at::Tensor& t) {
  const int64_t N = t.size(0), C = t.size(1), panels = (N + kCols - 1) / kCols;
  auto padded = at::zeros({panels * kCols, C}, t.options());
  padded.narrow(0, 0, N).copy_(t);
  return padded.view({panels, kCols, C}).transpose(1, 2).contiguous();
}

#if defined(KVSERVE_INT8_DOT)
// bytes of weights a thread claims at a time at one block of rows
constexpr int64_t kStealBytes = 32768;

// quantized_gemm with int8 activations, on torch's threads
void int8_dot_gemm(const Int8DotWeights& w, const Int8Rows& x, float* y) {
  auto panels = [&](int64_t begin, int64_t end) { w.run(x, y, begin, end); };
  if (x.M <= int8_dot::kRows) {
    // Within one block of rows a GEMM streams its weights: each thread reads its own range of panels as one
    // stream, in chunks of about kStealBytes that the other takes from the back once its range is done
    // (stealing_parallel.h). Against runs of a quarter of the panels from a shared counter, over the default
    // model's 120 layer GEMMs at one row (one process, alternating): Q4_1 1.10x faster, Q8_0 the same alone and
    // 1.07-1.08x faster beside two processes taking about a fifth of a core in bursts, as a gateway and a load
    // client do.
    parallel_stealing(w.panels(), w.chunk(), panels);
    return;
  }
  // Past one block a panel is arithmetic enough that runs from a shared counter balance the threads well
  const int64_t count = w.panels(), run = std::clamp<int64_t>(count / (8 * at::get_num_threads()), 1, 16);
  parallel_dynamic((count + run - 1) / run, [] { return 0; },
                   [&](int64_t item, int) { panels(item * run, std::min(count, (item + 1) * run)); });
}
#endif

// quantized_gemm with float32 activations: the weights become floats in registers
template <typename S>
void float_gemm(const at::Tensor& x, const int8_t* qp, const S* sp, const S* m, int64_t N, int64_t G, int64_t bits,
                int64_t zero_point, const float* b, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  const int64_t groups = K / G, row_bytes = bits == 8 ? kCols : kCols / 2, panels = (N + kCols - 1) / kCols;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Kernel<S>* kernels = bits == 8 ? kIntKernels<8, S> : kIntKernels<4, S>;
  const auto zp = static_cast<float>(zero_point);
  // the first row block converts the weights in registers as they stream by; with more rows it also keeps them
  // as floats in a buffer of the thread's, which stays in cache while the float32 kernel passes the other blocks
  // over it: the conversion is paid once a weight at any batch size
  auto run_panel = [&](int64_t p, std::vector<float>& weights) {
    const int64_t col = p * kCols, cols = std::min(kCols, N - col);
    const float* bias_p = b == nullptr ? nullptr : b + col;
    const int64_t first = std::min<int64_t>(kRows, M);
    kernels[first](xp, ldx, qp + p * K * row_bytes, sp + p * groups * kCols,
                   m == nullptr ? nullptr : m + p * groups * kCols, K, G, zp, bias_p, yp + col, N, cols,
                   M > kRows ? weights.data() : nullptr);
    for (int64_t r = kRows; r < M; r += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, M - r);
      panel_gemm::kKernels[rows](xp + r * ldx, ldx, weights.data(), K, bias_p, yp + r * N + col, N, cols, nullptr,
                                 0);
    }
  };
  // a work item is a run of panels: one integer panel of a decode row takes well under a microsecond, about what
  // taking it from the shared counter costs when two threads contend for it
  const int64_t run = std::clamp<int64_t>(panels / (8 * at::get_num_threads()), 1, 16);
  parallel_dynamic((panels + run - 1) / run, [&] { return std::vector<float>(M <= kRows ? 0 : K * kCols); },
                   [&](int64_t item, std::vector<float>& weights) {
                     for (int64_t p = item * run, end = std::min(panels, p + run); p < end; ++p) run_panel(p, weights);
                   });
}

}  // namespace

// whether quantized_gemm can take activation_planes 1 and 2 on this CPU
bool int8_dot_available() {
#if defined(KVSERVE_INT8_DOT)
  return true;
#else
  return false;
#endif
}

// values int8 [N, K] (bits 4: each in zero_point - 8 .. zero_point + 7 stored as value + zero_point in 0..15),
// scales and offsets (or undefined) float32 [N, K / G] -> (values [panels, K, 16] int8, or [panels, K, 8] two
// nibbles a byte; scales [panels, K / G, 16]; offsets likewise or undefined)
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_quantized_weight(const at::Tensor& values, const at::Tensor& scales,
                                                                     const c10::optional<at::Tensor>& offsets,
                                                                     int64_t bits, int64_t zero_point) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kChar && values.device().is_cpu(),
              "pack_quantized_weight: int8 [out_features, in_features] CPU values");
  TORCH_CHECK(bits == 8 || bits == 4, "pack_quantized_weight: bits 8 or 4");
  TORCH_CHECK(bits == 4 || zero_point == 0, "pack_quantized_weight: a zero point is for 4 bits");
  const int64_t N = values.size(0), K = values.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) > 0 && K % scales.size(1) == 0 &&
                  scales.scalar_type() == at::kFloat,
              "pack_quantized_weight: float32 scales [N, K / group_size]");
  at::Tensor packed_offsets;
  if (offsets.has_value() && offsets->defined()) {
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->scalar_type() == at::kFloat,
                "pack_quantized_weight: offsets shaped as the scales");
    packed_offsets = to_panels(offsets->contiguous());
  }
  at::Tensor packed = to_panels(values.contiguous());
  if (bits == 4) {
    auto u = packed.to(at::kInt) + zero_point;
    TORCH_CHECK(u.min().item<int>() >= 0 && u.max().item<int>() <= 15,
                "pack_quantized_weight: 4-bit values plus the zero point must lie in 0..15");
    packed = (u.narrow(2, 0, 8) + u.narrow(2, 8, 8) * 16).to(at::kByte).view(at::kChar).contiguous();
  }
  return {packed, to_panels(scales.contiguous()), packed_offsets};
}

namespace {

// quantized_gemm's weight operands for inputs of K, checked
struct Operands {
  int64_t K, N, G, bits, zero_point;
  const int8_t* q;
  const void* scales;
  const void* offsets;  // null where there are none
  bool half;            // scales and offsets float16, else float32
  const float* bias;    // null where there is none
};

Operands checked(int64_t K, const at::Tensor& values, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& offsets, int64_t N, int64_t bits, int64_t zero_point, const c10::optional<at::Tensor>& bias,
                 int64_t activation_planes) {
  TORCH_CHECK(bits == 8 || bits == 4, "quantized_gemm: bits 8 or 4");
  const int64_t row_bytes = bits == 8 ? kCols : kCols / 2;
  TORCH_CHECK(values.dim() == 3 && values.size(1) == K && values.size(2) == row_bytes && values.is_contiguous() &&
                  values.scalar_type() == at::kChar,
              "quantized_gemm: packed values [panels, K, ", row_bytes, "] int8 for x's K");
  const int64_t panels = values.size(0);
  TORCH_CHECK(panels * kCols >= N && panels * kCols < N + kCols, "quantized_gemm: N does not fit");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == panels && scales.size(2) == kCols && scales.size(1) > 0 &&
                  K % scales.size(1) == 0 && scales.is_contiguous() &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf),
              "quantized_gemm: packed scales [panels, K / group_size, 16] float32 or float16");
  const int64_t G = K / scales.size(1);
  const bool offsets_given = offsets.has_value() && offsets->defined();
  if (offsets_given) {
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->is_contiguous() &&
                    offsets->scalar_type() == scales.scalar_type(),
                "quantized_gemm: packed offsets shaped and typed as the scales");
  }
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "quantized_gemm: bias [N] float32");
    b = bias->data_ptr<float>();
  }
  TORCH_CHECK(activation_planes >= 0 && activation_planes <= 2,
              "quantized_gemm: activation_planes 0 (float32), 1 (int8) or 2 (int16)");
  if (activation_planes > 0) {
    TORCH_CHECK(int8_dot_available(), "quantized_gemm: int8 activations need AVX-512 VNNI and VBMI");
    TORCH_CHECK(K % 32 == 0 && G % 32 == 0, "quantized_gemm: int8 activations need groups of whole blocks of 32");
  }
  return {K, N, G, bits, zero_point, values.data_ptr<int8_t>(), scales.data_ptr(),
          offsets_given ? offsets->data_ptr() : nullptr, scales.scalar_type() == at::kHalf, b};
}

}  // namespace

#if defined(KVSERVE_INT8_DOT)
void Int8Rows::quantize(const float* x, int64_t rows, int64_t k, int64_t ldx, int64_t plane_count) {
  TORCH_CHECK(plane_count == 1 || plane_count == 2, "int8 activations: 1 or 2 planes");
  M = rows, K = k, planes = plane_count;
  const int64_t blocks = K / int8_dot::kBlock;
  values.resize(M * K);
  scales.resize(M * blocks);
  sums.resize(M * blocks);
  residual.resize(planes == 2 ? M * K : 0);
  residual_scales.resize(planes == 2 ? M * blocks : 0);
  each.resize(M);
  auto row_residual = [&](int64_t r) { return planes == 2 ? residual.data() + r * K : nullptr; };
  auto row_residual_scales = [&](int64_t r) { return planes == 2 ? residual_scales.data() + r * blocks : nullptr; };
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      int8_dot::quantize_row(x + r * ldx, K, values.data() + r * K, scales.data() + r * blocks,
                             sums.data() + r * blocks, row_residual(r), row_residual_scales(r));
  });
  for (int64_t r = 0; r < M; ++r)
    each[r] = {values.data() + r * K, scales.data() + r * blocks, sums.data() + r * blocks, K,
               row_residual(r),       row_residual_scales(r)};
}

Int8DotWeights::Int8DotWeights(int64_t K, const at::Tensor& values, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& offsets, int64_t N, int64_t bits, int64_t zero_point,
                               const c10::optional<at::Tensor>& bias) {
  const Operands op = checked(K, values, scales, offsets, N, bits, zero_point, bias, 1);
  K_ = op.K, N_ = op.N, G_ = op.G, bits_ = op.bits, zero_point_ = op.zero_point;
  q_ = op.q, scales_ = op.scales, offsets_ = op.offsets, half_ = op.half, bias_ = op.bias;
}

int64_t Int8DotWeights::panels() const { return (N_ + kCols - 1) / kCols; }

int64_t Int8DotWeights::chunk() const {
  return std::max<int64_t>(1, kStealBytes / (K_ * (bits_ == 8 ? kCols : kCols / 2)));
}

template <int PLANES, typename S>
void Int8DotWeights::run_panels(const Int8Rows& x, float* y, int64_t ldy, int64_t begin, int64_t end) const {
  const int64_t groups = K_ / G_, row_bytes = bits_ == 8 ? kCols : kCols / 2, M = x.M;
  const auto* sp = static_cast<const S*>(scales_);
  const auto* m = static_cast<const S*>(offsets_);
  const int8_dot::Kernel<S>* kernels =
      bits_ == 8 ? int8_dot::kKernels<8, PLANES, S> : int8_dot::kKernels<4, PLANES, S>;
  const auto zp = static_cast<float>(zero_point_);
  for (int64_t p = begin; p < end; ++p) {
    const int64_t col = p * kCols, cols = std::min(kCols, N_ - col);
    for (int64_t r = 0; r < M; r += int8_dot::kRows) {
      const int64_t count = std::min<int64_t>(int8_dot::kRows, M - r);
      kernels[count](x.each.data() + r, q_ + p * K_ * row_bytes, sp + p * groups * kCols,
                     m == nullptr ? nullptr : m + p * groups * kCols, G_, zp,
                     bias_ == nullptr ? nullptr : bias_ + col, y + r * ldy + (p - begin) * kCols, ldy, cols);
    }
  }
}

void Int8DotWeights::run(const Int8Rows& x, float* y, int64_t ldy, int64_t begin, int64_t end) const {
  if (x.planes == 2) {
    if (half_)
      run_panels<2, c10::Half>(x, y, ldy, begin, end);
    else
      run_panels<2, float>(x, y, ldy, begin, end);
  } else if (half_) {
    run_panels<1, c10::Half>(x, y, ldy, begin, end);
  } else {
    run_panels<1, float>(x, y, ldy, begin, end);
  }
}
#endif

// x [M, K] (rows contiguous) times pack_quantized_weight's panels for N outputs, bias [N] or undefined -> [M, N]
at::Tensor quantized_gemm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& offsets, int64_t N, int64_t bits, int64_t zero_point,
                          const c10::optional<at::Tensor>& bias, int64_t activation_planes) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "quantized_gemm: x [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1);
#if defined(KVSERVE_INT8_DOT)
  if (activation_planes == 1 || activation_planes == 2) {
    const Int8DotWeights weights(K, values, scales, offsets, N, bits, zero_point, bias);
    auto y = at::empty({M, N}, x.options());
    if (M == 0) return y;
    Int8Rows rows;
    rows.quantize(x.data_ptr<float>(), M, K, x.stride(0), activation_planes);
    int8_dot_gemm(weights, rows, y.data_ptr<float>());
    return y;
  }
#endif
  const Operands op = checked(K, values, scales, offsets, N, bits, zero_point, bias, activation_planes);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  if (op.half) {
    float_gemm(x, op.q, static_cast<const c10::Half*>(op.scales), static_cast<const c10::Half*>(op.offsets), N,
               op.G, bits, zero_point, op.bias, y);
  } else {
    float_gemm(x, op.q, static_cast<const float*>(op.scales), static_cast<const float*>(op.offsets), N, op.G, bits,
               zero_point, op.bias, y);
  }
  return y;
}

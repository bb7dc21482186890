// quantized_gemm's int8-activation path as parts any thread may run (quantized_gemm_cpu.cpp): quantized_gemm runs
// them on torch's threads, the decoder stack's team on its own (decoder_stack_cpu.cpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

#include "int8_dot_kernel.h"

#if defined(KVSERVE_INT8_DOT)
// rows of activations quantized to int8 in blocks of 32, in one plane (int8) or two (int16: the second holds each
// block's rounding error, int8_dot_kernel.h), kept for reuse: a quantize call of no more rows and inputs than the
// last allocates nothing
struct Int8Rows {
  // x [rows, k], rows ldx floats apart; planes 1 or 2
  void quantize(const float* x, int64_t rows, int64_t k, int64_t ldx, int64_t planes);

  int64_t M = 0, K = 0, planes = 1;
  std::vector<int8_t> values, residual;
  std::vector<float> scales, sums, residual_scales;
  std::vector<int8_dot::Rows> each;
};

// a linear layer's packed quantized weights (pack_quantized_weight's), checked once for inputs of K
class Int8DotWeights {
 public:
  Int8DotWeights(int64_t K, const at::Tensor& values, const at::Tensor& scales,
                 const c10::optional<at::Tensor>& offsets, int64_t N, int64_t bits, int64_t zero_point,
                 const c10::optional<at::Tensor>& bias);
  int64_t panels() const;
  int64_t chunk() const;  // panels a thread claims at a time within one block of rows
  int64_t in_features() const { return K_; }
  int64_t out_features() const { return N_; }
  // y [x.M, N]'s columns of panels [begin, end); from any thread, each panel once
  void run(const Int8Rows& x, float* y, int64_t begin, int64_t end) const {
    run(x, y + begin * int8_dot::kCols, N_, begin, end);
  }
  // the same columns into y [x.M, ldy] from its column 0 (a thread's own buffer)
  void run(const Int8Rows& x, float* y, int64_t ldy, int64_t begin, int64_t end) const;

 private:
  template <int PLANES, typename S>
  void run_panels(const Int8Rows& x, float* y, int64_t ldy, int64_t begin, int64_t end) const;

  int64_t K_ = 0, N_ = 0, G_ = 0, bits_ = 8, zero_point_ = 0;
  const int8_t* q_ = nullptr;
  const void* scales_ = nullptr;
  const void* offsets_ = nullptr;
  bool half_ = false;
  const float* bias_ = nullptr;
};
#endif

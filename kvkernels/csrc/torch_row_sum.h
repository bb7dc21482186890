// The mean of squares of a row, summed in the order torch's CPU sum reduces a contiguous row, so that RMSNorm here
// equals torch's (and HF's) bit for bit without dispatching three torch operations a norm: at one decode row,
// pow, mean and their tensors took ~5 us of ~6.7 for the whole add_rms_norm, 61 times a token.
//
// torch (aten/src/ATen/native/cpu/SumKernel.cpp, vectorized_inner_sum) reads the row as vectors of its
// Vectorized<float>, 8 lanes (its sum is registered with REGISTER_DISPATCH, which leaves AVX-512 machines on the
// AVX2 kernel; DEFAULT's vectors are 32 bytes too), four vectors side by side
// (row_sum's ilp_factor), and adds those groups of four in a cascade of levels of 2^p groups (multi_row_sum,
// p = max(4, ceil(log2(groups)) / 4)); the vectors past the last whole group go into the first accumulator, the
// four accumulators are added in order, and a scalar starting at 0 takes the elements past the last whole vector
// and then the lanes in order. mean is that sum divided by the count. The same float additions in the same order
// give the same bits: tests/kernels/test_layer_ops.py compares against torch over row lengths that reach every
// branch.
#pragma once

#include <algorithm>
#include <cstdint>

namespace torch_order {

constexpr int64_t kMaxLanes = 16;

// lanes of the Vectorized<float> that torch's CPU sum runs with; 0 where this file does not know torch's order
// (not x86), and the caller uses torch's own operations
inline int64_t sum_lanes() {
#if defined(__x86_64__)
  return 8;
#else
  return 0;
#endif
}

inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// sum(x[i] * x[i]) over i < n, in torch's order for `lanes` lanes (at most kMaxLanes; 1: its scalar path)
inline float sum_of_squares(const float* x, int64_t n, int64_t lanes) {
  constexpr int64_t kIlp = 4, kLevels = 4;
  const int64_t vectors = n / lanes, groups = vectors / kIlp;
  const int64_t power = std::max<int64_t>(4, ceil_log2(groups) / kLevels), step = int64_t{1} << power;
  const int64_t mask = step - 1;
  float acc[kLevels][kIlp][kMaxLanes] = {};
  auto add_group = [&](int64_t g) {
    for (int64_t k = 0; k < kIlp; ++k) {
      const float* v = x + (g * kIlp + k) * lanes;
      for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += v[l] * v[l];
    }
  };
  int64_t g = 0;
  while (g + step <= groups) {
    for (int64_t j = 0; j < step; ++j, ++g) add_group(g);
    for (int64_t level = 1; level < kLevels; ++level) {
      for (int64_t k = 0; k < kIlp; ++k)
        for (int64_t l = 0; l < lanes; ++l) acc[level][k][l] += acc[level - 1][k][l], acc[level - 1][k][l] = 0.f;
      if ((g & (mask << (level * power))) != 0) break;
    }
  }
  for (; g < groups; ++g) add_group(g);
  for (int64_t level = 1; level < kLevels; ++level)
    for (int64_t k = 0; k < kIlp; ++k)
      for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += acc[level][k][l];
  for (int64_t v = groups * kIlp; v < vectors; ++v)
    for (int64_t l = 0; l < lanes; ++l) acc[0][0][l] += x[v * lanes + l] * x[v * lanes + l];
  for (int64_t k = 1; k < kIlp; ++k)
    for (int64_t l = 0; l < lanes; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0.f;
  for (int64_t i = vectors * lanes; i < n; ++i) total += x[i] * x[i];
  for (int64_t l = 0; l < lanes; ++l) total += acc[0][0][l];
  return total;
}

}  // namespace torch_order

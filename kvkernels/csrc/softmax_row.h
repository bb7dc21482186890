// One row of attention scores at a time, on at::vec's vectors: its maximum, and exp(score - max) in place.
// Shared by the decode and prefill attention kernels.
#pragma once
#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

using Vec = at::vec::Vectorized<float>;

// the largest of n scores, eight lanes at a time: std::max_element keeps its running maximum in memory, a
// store-to-load round trip per score (an eighth of the kernel's time)
inline float max_of(const float* row, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  if (n >= 8) {
    Vec vmx = Vec::loadu(row);
    for (j = 8; j + 8 <= n; j += 8) vmx = at::vec::maximum(vmx, Vec::loadu(row + j));
    mx = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, vmx);
  }
  for (; j < n; ++j) mx = std::max(mx, row[j]);
  return mx;
}

// exp(row - m) in place; returns the sum (the caller divides once at the end)
inline float exp_minus(float* row, int64_t n, float m) {
  const Vec vm(m);
  Vec total(0.f);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const Vec e = (Vec::loadu(row + j) - vm).exp();
    e.store(row + j);
    total = total + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, total);
  for (; j < n; ++j) sum += (row[j] = std::exp(row[j] - m));
  return sum;
}

// exp(row - max(row)) in place; returns the sum
inline float exp_shifted(float* row, int64_t n) { return exp_minus(row, n, max_of(row, n)); }

}  // namespace

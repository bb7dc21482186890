// LoRA's low-rank update of a step's rows, grouped by adapter (lora_cpu.cpp), float32 on the CPU.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

// One adapter's share of one projection: A [a_rows, inputs] (every targeted part's A, stacked), and per targeted
// part its output columns [start, end), its B scaled and transposed [rank, end - start] and the first row of its A.
struct LoRAPartView {
  int64_t start, end, row, rank;
  const float* bt;
};
struct LoRAView {
  int64_t a_rows, inputs;
  const float* a;
  std::vector<LoRAPartView> parts;
};
// rows [first, last) of a step that run under the adapter whose share is lora
struct LoRARows {
  int64_t first, last;
  const LoRAView* lora;
};

// out[rows, part's columns] += (x[rows] A^T)[:, part's rows of A] B^T for each group and part, where x [T, K] and
// out [T, N] have contiguous rows. Every element is summed in one order whatever the rows beside it, so a row's
// update has the same bits in any batch.
void lora_add(const at::Tensor& x, at::Tensor& out, const std::vector<LoRARows>& groups);

// the Python bindings' form: per group (first row, last + 1, A, [(first column, last + 1, B^T scaled, first row of
// its A)]), tensors float32 and contiguous
using LoRAPartArgs = std::tuple<int64_t, int64_t, at::Tensor, int64_t>;
using LoRAGroupWeights = std::tuple<int64_t, int64_t, at::Tensor, std::vector<LoRAPartArgs>>;
LoRAView lora_view(const at::Tensor& a, const std::vector<LoRAPartArgs>& parts);
void lora_add_(const at::Tensor& x, at::Tensor out, const std::vector<LoRAGroupWeights>& groups);

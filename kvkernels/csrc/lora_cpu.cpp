// LoRA's update of a step's rows, every adapter's group of rows in one call: a shrink (the rows times the stacked
// A) then an expand per targeted part (into the part's output columns), as Punica's SGMV does on GPUs.
//
// With 16 decodes over 8 adapters, one ATen matmul per group and part (two dozen a layer, a few rows each) cost a
// quarter of the step's time: each paid its dispatch and MKL's thread start for a few thousand multiply-adds.
// Here the whole projection's work is split into small items taken from a shared counter (dynamic_parallel.h),
// two parallel regions a projection. Each element is summed in one order, whatever the rows beside it: the
// shrink's dot products in vector lanes over K, the lanes added in turn, then K's tail; the expand's over the
// rank in turn. The Python model and the decoder stack call this same code, so a row's bits do not depend on
// which of them ran its step or on what else the batch held.
#include "lora_cpu.h"

#include "cpu_vec.h"
#include "dynamic_parallel.h"

#include <algorithm>
#include <cmath>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
constexpr int kRowBlock = 4;           // rows an item holds (the kernels' M)
constexpr int64_t kShrinkOutputs = 16;  // rows of A an item of the shrink dots against
constexpr int64_t kExpandColumns = 64;  // output columns an item of the expand adds to

// s[i, j] = x[i, :] . a[j, :] for M rows and N rows of A
template <int M, int N>
void shrink_block(const float* x, int64_t ldx, const float* a, int64_t K, float* s, int64_t lds) {
  Vec acc[M][N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) acc[i][j] = Vec(0.f);
  int64_t k = 0;
  for (; k + kW <= K; k += kW) {
    Vec av[N];
    for (int j = 0; j < N; ++j) av[j] = Vec::loadu(a + j * K + k);
    for (int i = 0; i < M; ++i) {
      const Vec xv = Vec::loadu(x + i * ldx + k);
      for (int j = 0; j < N; ++j) acc[i][j] = at::vec::fmadd(xv, av[j], acc[i][j]);
    }
  }
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      float lanes[kW];
      acc[i][j].store(lanes);
      float sum = 0.f;
      for (int64_t l = 0; l < kW; ++l) sum += lanes[l];
      for (int64_t t = k; t < K; ++t) sum = std::fma(x[i * ldx + t], a[j * K + t], sum);
      s[i * lds + j] = sum;
    }
  }
}

template <int M>
void shrink_rows(const float* x, int64_t ldx, const float* a, int64_t K, float* s, int64_t lds, int64_t n) {
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) shrink_block<M, 2>(x, ldx, a + j * K, K, s + j, lds);
  if (j < n) shrink_block<M, 1>(x, ldx, a + j * K, K, s + j, lds);
}

// out[i, c] += sum over k of s[i, k] bt[k, c], k in turn, for M rows and the columns [0, cols) of bt's
template <int M>
void expand_block(const float* s, int64_t lds, const float* bt, int64_t ldb, int64_t rank, float* out, int64_t ldo,
                  int64_t cols) {
  int64_t c = 0;
  for (; c + 2 * kW <= cols; c += 2 * kW) {
    Vec acc[M][2];
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = Vec(0.f);
    for (int64_t k = 0; k < rank; ++k) {
      const Vec b0 = Vec::loadu(bt + k * ldb + c), b1 = Vec::loadu(bt + k * ldb + c + kW);
      for (int i = 0; i < M; ++i) {
        const Vec sv(s[i * lds + k]);
        acc[i][0] = at::vec::fmadd(sv, b0, acc[i][0]);
        acc[i][1] = at::vec::fmadd(sv, b1, acc[i][1]);
      }
    }
    for (int i = 0; i < M; ++i) {
      float* o = out + i * ldo + c;
      (Vec::loadu(o) + acc[i][0]).store(o);
      (Vec::loadu(o + kW) + acc[i][1]).store(o + kW);
    }
  }
  for (; c < cols; ++c) {
    for (int i = 0; i < M; ++i) {
      float sum = 0.f;
      for (int64_t k = 0; k < rank; ++k) sum = std::fma(s[i * lds + k], bt[k * ldb + c], sum);
      out[i * ldo + c] += sum;
    }
  }
}

template <typename Fn>
void by_rows(int m, Fn fn) {
  switch (m) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    default: return fn(std::integral_constant<int, 4>{});
  }
}

struct Item {
  int64_t group, part, row, rows, first, count;  // part: the expand's; first, count: A's rows or the columns
};

}  // namespace

void lora_add(const at::Tensor& x, at::Tensor& out, const std::vector<LoRARows>& groups) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.device().is_cpu(),
              "lora_add: x [T, K] float32 on the CPU, rows contiguous");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 && out.size(0) == x.size(0),
              "lora_add: out [T, N] float32 with x's rows, rows contiguous");
  const int64_t T = x.size(0), K = x.size(1), N = out.size(1), ldx = x.stride(0), ldo = out.stride(0);
  std::vector<int64_t> offsets(groups.size() + 1, 0);  // of each group's shrunk rows
  std::vector<Item> shrinks, expands;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& [first, last, lora] = groups[g];
    TORCH_CHECK(0 <= first && first <= last && last <= T, "lora_add: rows [", first, ", ", last, ") of ", T);
    TORCH_CHECK(lora->inputs == K, "lora_add: A of ", lora->inputs, " inputs for x's ", K);
    offsets[g + 1] = offsets[g] + (last - first) * lora->a_rows;
    for (int64_t r = first; r < last; r += kRowBlock) {
      const int64_t rows = std::min<int64_t>(kRowBlock, last - r);
      for (int64_t j = 0; j < lora->a_rows; j += kShrinkOutputs)
        shrinks.push_back({int64_t(g), 0, r, rows, j, std::min(kShrinkOutputs, lora->a_rows - j)});
      for (size_t p = 0; p < lora->parts.size(); ++p) {
        const auto& part = lora->parts[p];
        TORCH_CHECK(0 <= part.start && part.start <= part.end && part.end <= N && 0 <= part.row &&
                        part.row + part.rank <= lora->a_rows,
                    "lora_add: a part of columns [", part.start, ", ", part.end, ") and A's rows from ", part.row,
                    " does not fit ", N, " columns and ", lora->a_rows, " rows");
        for (int64_t c = part.start; c < part.end; c += kExpandColumns)
          expands.push_back({int64_t(g), int64_t(p), r, rows, c, std::min(kExpandColumns, part.end - c)});
      }
    }
  }
  if (shrinks.empty()) return;
  auto shrunk = at::empty({offsets.back()}, x.options());
  float* sp = shrunk.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_dynamic(int64_t(shrinks.size()), [] { return 0; }, [&](int64_t n, int) {
    const Item& item = shrinks[n];
    const auto& [first, last, lora] = groups[item.group];
    float* s = sp + offsets[item.group] + (item.row - first) * lora->a_rows + item.first;
    by_rows(int(item.rows), [&](auto m) {
      shrink_rows<decltype(m)::value>(xp + item.row * ldx, ldx, lora->a + item.first * K, K, s, lora->a_rows,
                                      item.count);
    });
  });
  parallel_dynamic(int64_t(expands.size()), [] { return 0; }, [&](int64_t n, int) {
    const Item& item = expands[n];
    const auto& [first, last, lora] = groups[item.group];
    const auto& part = lora->parts[item.part];
    const float* s = sp + offsets[item.group] + (item.row - first) * lora->a_rows + part.row;
    const int64_t ldb = part.end - part.start;
    by_rows(int(item.rows), [&](auto m) {
      expand_block<decltype(m)::value>(s, lora->a_rows, part.bt + (item.first - part.start), ldb, part.rank,
                                       op + item.row * ldo + item.first, ldo, item.count);
    });
  });
}

LoRAView lora_view(const at::Tensor& a, const std::vector<LoRAPartArgs>& parts) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kFloat && a.is_contiguous() && a.device().is_cpu(),
              "lora: A [parts x rank, inputs] float32, contiguous, on the CPU");
  LoRAView view{a.size(0), a.size(1), a.data_ptr<float>(), {}};
  for (const auto& [start, end, bt, row] : parts) {
    TORCH_CHECK(bt.dim() == 2 && bt.scalar_type() == at::kFloat && bt.is_contiguous() && bt.device().is_cpu() &&
                    bt.size(1) == end - start,
                "lora: B^T [rank, ", end - start, "] float32, contiguous, on the CPU for columns [", start, ", ",
                end, ")");
    view.parts.push_back({start, end, row, bt.size(0), bt.data_ptr<float>()});
  }
  return view;
}

void lora_add_(const at::Tensor& x, at::Tensor out, const std::vector<LoRAGroupWeights>& groups) {
  std::vector<LoRAView> views;
  views.reserve(groups.size());  // the rows below point into it
  std::vector<LoRARows> rows;
  for (const auto& [first, last, a, parts] : groups) {
    views.push_back(lora_view(a, parts));
    rows.push_back({first, last, &views.back()});
  }
  lora_add(x, out, rows);
}

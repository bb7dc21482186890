// Decode attention straight from the paged KV cache on the CPU: one query token per sequence reads its keys
// and values block by block, where they lie, instead of gathering them into a padded copy first. Work items
// are (sequence, kv head) pairs; each handles the query heads that share that kv head (GQA).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int kLanes = 16;  // split sums so the compiler can keep them in vector registers

inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float* y, float alpha, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

// query [S, Hq, D]; key_cache, value_cache [N, B, Hkv, D]; block_table [S, M] int32; seq_lens [S] int32.
torch::Tensor decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                               torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32, "decode_attention: float32 only");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "decode_attention: contiguous tensors only");
  auto table = block_table.to(torch::kInt32).contiguous();
  auto lens = seq_lens.to(torch::kInt32).contiguous();
  const int64_t S = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t B = key_cache.size(1), Hkv = key_cache.size(2), M = table.size(1);
  const int64_t group = Hq / Hkv;
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* k = key_cache.data_ptr<float>();
  const float* v = value_cache.data_ptr<float>();
  const int32_t* tbl = table.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, S * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / Hkv, h = w % Hkv, n = len[s];
      scores.assign(group * n, 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = static_cast<int64_t>(tbl[s * M + j / B]) * B + j % B;
        const float* kj = k + (slot * Hkv + h) * D;
        for (int64_t g = 0; g < group; ++g)
          scores[g * n + j] = dot(q + (s * Hq + h * group + g) * D, kj, D) * fscale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * n;
        const float mx = *std::max_element(row, row + n);
        float total = 0.f;
        for (int64_t j = 0; j < n; ++j) total += (row[j] = std::exp(row[j] - mx));
        const float inv = 1.f / total;
        for (int64_t j = 0; j < n; ++j) row[j] *= inv;
        float* og = o + (s * Hq + h * group + g) * D;
        std::fill(og, og + D, 0.f);
      }
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = static_cast<int64_t>(tbl[s * M + j / B]) * B + j % B;
        const float* vj = v + (slot * Hkv + h) * D;
        for (int64_t g = 0; g < group; ++g) axpy(o + (s * Hq + h * group + g) * D, scores[g * n + j], vj, D);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (float32, CPU)");
}

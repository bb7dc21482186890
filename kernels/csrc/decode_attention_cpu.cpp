// Decode attention straight from the paged KV cache on the CPU: one query token per sequence reads its keys
// and values block by block, where they lie, instead of gathering them into a padded copy first. Work items
// are (sequence, kv head) pairs; each handles the query heads that share that kv head (GQA).
//
// For head sizes that are a multiple of 8 the inner loops run on 8-float vectors (GCC/Clang vector
// extensions, lowered to AVX2 or whatever -march=native offers), and each query head's output stays in
// registers while the values stream past: accumulating into memory cost three memory operations per
// multiply-add and made the kernel load/store bound.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

inline float hsum(v8f v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// q . k for a head of D = 8 * kVec floats
template <int kVec>
inline float dot_vec(const float* q, const float* k) {
  v8f acc = {0.f};
  for (int i = 0; i < kVec; ++i) acc += load8(q + 8 * i) * load8(k + 8 * i);
  return hsum(acc);
}

inline float dot_any(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// softmax over n scores in place
inline void softmax(float* row, int64_t n) {
  const float mx = *std::max_element(row, row + n);
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) total += (row[j] = std::exp(row[j] - mx));
  const float inv = 1.f / total;
  for (int64_t j = 0; j < n; ++j) row[j] *= inv;
}

struct Item {
  const float* q;                 // the group's first query head, [group, D]
  float* o;                       // its output, [group, D]
  const std::vector<const float*>* keys;    // key row of each context position
  const std::vector<const float*>* values;  // value row of each context position
  int64_t n, group, dim;
  float scale;
};

// one (sequence, kv head): scores for every query head of the group, softmax, then the weighted values
template <int kVec>
void attend_vec(const Item& it, std::vector<float>& scores) {
  const int64_t n = it.n;
  scores.resize(it.group * n);
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = (*it.keys)[j];
    for (int64_t g = 0; g < it.group; ++g)
      scores[g * n + j] = dot_vec<kVec>(it.q + g * 8 * kVec, kj) * it.scale;
  }
  for (int64_t g = 0; g < it.group; ++g) {
    float* p = scores.data() + g * n;
    softmax(p, n);
    v8f acc[kVec];
    for (int i = 0; i < kVec; ++i) acc[i] = v8f{0.f};
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = (*it.values)[j];
      const float w = p[j];
      for (int i = 0; i < kVec; ++i) acc[i] += w * load8(vj + 8 * i);
    }
    for (int i = 0; i < kVec; ++i) store8(it.o + g * 8 * kVec + 8 * i, acc[i]);
  }
}

void attend_any(const Item& it, std::vector<float>& scores) {
  const int64_t n = it.n, d = it.dim;
  scores.resize(it.group * n);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t g = 0; g < it.group; ++g)
      scores[g * n + j] = dot_any(it.q + g * d, (*it.keys)[j], d) * it.scale;
  for (int64_t g = 0; g < it.group; ++g) {
    float* p = scores.data() + g * n;
    softmax(p, n);
    float* og = it.o + g * d;
    std::fill(og, og + d, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = (*it.values)[j];
      for (int64_t i = 0; i < d; ++i) og[i] += p[j] * vj[i];
    }
  }
}

}  // namespace

// query [S, Hq, D]; key_cache, value_cache [N, B, Hkv, D]; block_table [S, M] int32; seq_lens [S] int32.
at::Tensor decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                               at::Tensor block_table, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat, "decode_attention: float32 only");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "decode_attention: contiguous caches only");
  // a query may be rows of a larger tensor (the q part of a fused qkv projection): each token's heads contiguous
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "decode_attention: query [S, Hq, D] with each token's heads contiguous");
  auto table = block_table.to(at::kInt).contiguous();
  auto lens = seq_lens.to(at::kInt).contiguous();
  const int64_t S = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t B = key_cache.size(1), Hkv = key_cache.size(2), M = table.size(1);
  const int64_t group = Hq / Hkv;
  auto out = at::empty({S, Hq, D}, query.options());
  const int64_t qs = query.stride(0);
  const float* q = query.data_ptr<float>();
  const float* k = key_cache.data_ptr<float>();
  const float* v = value_cache.data_ptr<float>();
  const int32_t* tbl = table.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, S * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> keys, values;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / Hkv, h = w % Hkv, n = len[s];
      keys.resize(n);
      values.resize(n);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t row = (static_cast<int64_t>(tbl[s * M + j / B]) * B + j % B) * Hkv + h;
        keys[j] = k + row * D;
        values[j] = v + row * D;
      }
      const Item item{q + s * qs + h * group * D, o + (s * Hq + h * group) * D, &keys, &values, n, group, D,
                      fscale};
      if (D == 64)
        attend_vec<8>(item, scores);
      else if (D == 128)
        attend_vec<16>(item, scores);
      else if (D == 32)
        attend_vec<4>(item, scores);
      else
        attend_any(item, scores);
    }
  });
  return out;
}

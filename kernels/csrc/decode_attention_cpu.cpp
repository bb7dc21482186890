// Decode attention straight from the paged KV cache on the CPU: one query token per sequence reads its keys
// and values block by block, where they lie, instead of gathering them into a padded copy first. A work item
// is a sequence (or, with fewer sequences than threads to share them, one of its kv heads) and handles the
// query heads that share its kv heads (GQA).
//
// For head sizes that are a multiple of 8 the loops run on at::vec's 8-float vectors with explicit fused
// multiply-adds (the build turns off contraction for the other kernels' sake): scores for eight positions at a
// time, each position's dot product in its own accumulator and the eight summed across in one transpose
// (a horizontal sum per position cost more than the dot product), exponentials vectorized (Sleef, as torch),
// and each query head's output kept in registers while the values stream past (accumulating into memory cost
// three memory operations per multiply-add).
#include "cpu_vec.h"
#include "dynamic_parallel.h"
#include "softmax_row.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

static_assert(Vec::size() == 8, "the vector path assumes 8-float vectors");

// lane p of the result = the sum of the lanes of v[p]
inline Vec sum_across8(const Vec* v) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  // ab holds (0, 1, 2, 3) per 128-bit half, cd (4, 5, 6, 7): add the halves
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
#else
  float out[8];
  for (int p = 0; p < 8; ++p) out[p] = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, v[p]);
  return Vec::loadu(out);
#endif
}

// q . k for a head of D = 8 * kVec floats
template <int kVec>
inline float dot_vec(const float* q, const float* k) {
  Vec acc(0.f);
  for (int i = 0; i < kVec; ++i) acc = at::vec::fmadd(Vec::loadu(q + 8 * i), Vec::loadu(k + 8 * i), acc);
  return at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, acc);
}

inline float dot_any(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// softmax over n scores in place
inline void softmax(float* row, int64_t n) {
  const float mx = max_of(row, n);
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) total += (row[j] = std::exp(row[j] - mx));
  const float inv = 1.f / total;
  for (int64_t j = 0; j < n; ++j) row[j] *= inv;
}

struct Item {
  const float* q;                 // the first query head of the item's first kv head, [heads * group, D]
  float* o;                       // its output, [heads * group, D]
  const std::vector<const float*>* keys;    // the first kv head's key row at each context position
  const std::vector<const float*>* values;  // the first kv head's value row at each context position
  int64_t n, heads, group, dim;  // heads: kv heads in the item, each row dim floats after the one before
  float scale;
};

// positions taken together: scores for 8 at a time (one transpose), values for a block's worth at a time
constexpr int64_t kValueChunk = 16;
// how far ahead (in positions) keys and values are fetched: a block of the cache lies anywhere, so the hardware
// prefetcher, which follows addresses, stalls at each block's first rows
constexpr int64_t kAhead = 16;

// bring positions [from, to)'s rows of `floats` floats (the item's heads) towards the core
inline void prefetch_rows(const std::vector<const float*>& rows, int64_t from, int64_t to, int64_t floats) {
  to = std::min<int64_t>(to, static_cast<int64_t>(rows.size()));
  for (int64_t j = from; j < to; ++j)
    for (int64_t f = 0; f < floats; f += 16) __builtin_prefetch(rows[j] + f, 0, 3);
}
// one sequence's kv heads [h0, h0 + heads): scores for every query head, softmax, then the weighted values.
// Positions are the outer loops and heads the inner ones, so each position's keys and values (every head of
// the item, adjacent in the cache) are read from memory once; heads one by one read them three times.
template <int kVec>
void attend_vec(const Item& it, std::vector<float>& scores) {
  const int64_t n = it.n, rows = it.heads * it.group, D = 8 * kVec;
  const auto& keys = *it.keys;
  const auto& values = *it.values;
  scores.resize(rows * n);
  int64_t j = 0;
  prefetch_rows(keys, 0, kAhead, it.heads * D);
  for (; j + 8 <= n; j += 8) {
    prefetch_rows(keys, j + kAhead, j + kAhead + 8, it.heads * D);
    for (int64_t h = 0; h < it.heads; ++h) {
      for (int64_t g = 0; g < it.group; ++g) {
        const int64_t r = h * it.group + g;
        const float* qr = it.q + r * D;
        const float* kp[8];
        for (int p = 0; p < 8; ++p) kp[p] = keys[j + p] + h * D;
        // the eight positions' sums side by side: eight independent chains of multiply-adds, not one
        Vec acc[8];
        for (int p = 0; p < 8; ++p) acc[p] = Vec(0.f);
        for (int i = 0; i < kVec; ++i) {
          const Vec qi = Vec::loadu(qr + 8 * i);
          for (int p = 0; p < 8; ++p) acc[p] = at::vec::fmadd(qi, Vec::loadu(kp[p] + 8 * i), acc[p]);
        }
        (sum_across8(acc) * Vec(it.scale)).store(scores.data() + r * n + j);
      }
    }
  }
  for (; j < n; ++j)
    for (int64_t r = 0; r < rows; ++r)
      scores[r * n + j] = dot_vec<kVec>(it.q + r * D, keys[j] + (r / it.group) * D) * it.scale;
  std::vector<float> inv(rows);
  for (int64_t r = 0; r < rows; ++r) inv[r] = 1.f / exp_shifted(scores.data() + r * n, n);
  std::fill(it.o, it.o + rows * D, 0.f);
  prefetch_rows(values, 0, kAhead, it.heads * D);
  for (int64_t j0 = 0; j0 < n; j0 += kValueChunk) {
    const int64_t j1 = std::min(n, j0 + kValueChunk);
    prefetch_rows(values, j0 + kAhead, j1 + kAhead, it.heads * D);
    for (int64_t r = 0; r < rows; ++r) {
      const float* p = scores.data() + r * n;
      const int64_t offset = (r / it.group) * D;
      Vec acc[kVec];
      for (int i = 0; i < kVec; ++i) acc[i] = Vec(0.f);
      for (int64_t jj = j0; jj < j1; ++jj) {
        const float* vj = values[jj] + offset;
        const Vec w(p[jj]);
        for (int i = 0; i < kVec; ++i) acc[i] = at::vec::fmadd(w, Vec::loadu(vj + 8 * i), acc[i]);
      }
      float* orow = it.o + r * D;
      for (int i = 0; i < kVec; ++i) (Vec::loadu(orow + 8 * i) + acc[i]).store(orow + 8 * i);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* orow = it.o + r * D;
    for (int i = 0; i < kVec; ++i) (Vec::loadu(orow + 8 * i) * Vec(inv[r])).store(orow + 8 * i);
  }
}

void attend_any(const Item& it, std::vector<float>& scores) {
  const int64_t n = it.n, d = it.dim, rows = it.heads * it.group;
  scores.resize(rows * n);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t r = 0; r < rows; ++r)
      scores[r * n + j] = dot_any(it.q + r * d, (*it.keys)[j] + (r / it.group) * d, d) * it.scale;
  for (int64_t r = 0; r < rows; ++r) {
    float* p = scores.data() + r * n;
    softmax(p, n);
    float* orow = it.o + r * d;
    std::fill(orow, orow + d, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = (*it.values)[j] + (r / it.group) * d;
      for (int64_t i = 0; i < d; ++i) orow[i] += p[j] * vj[i];
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

  // a sequence's kv heads together where there are sequences enough for every thread; else one a work item
  const int64_t per_item = S >= 2 * at::get_num_threads() ? Hkv : 1;
  struct Scratch {
    std::vector<float> scores;
    std::vector<const float*> keys, values;
  };
  parallel_dynamic(S * (Hkv / per_item), [] { return Scratch{}; }, [&](int64_t w, Scratch& scratch) {
    auto& keys = scratch.keys;
    auto& values = scratch.values;
    const int64_t s = w / (Hkv / per_item), h = (w % (Hkv / per_item)) * per_item, n = len[s];
    keys.resize(n);
    values.resize(n);
    // block by block: a division per position (j / B, j % B) cost as much as its dot product
    for (int64_t j0 = 0; j0 < n; j0 += B) {
      const int64_t first = (static_cast<int64_t>(tbl[s * M + j0 / B]) * B * Hkv + h) * D;
      for (int64_t j = j0, end = std::min(n, j0 + B); j < end; ++j) {
        keys[j] = k + first + (j - j0) * Hkv * D;
        values[j] = v + first + (j - j0) * Hkv * D;
      }
    }
    const Item item{q + s * qs + h * group * D, o + (s * Hq + h * group) * D, &keys, &values, n, per_item, group,
                    D, fscale};
    if (D == 64)
      attend_vec<8>(item, scratch.scores);
    else if (D == 128)
      attend_vec<16>(item, scratch.scores);
    else if (D == 32)
      attend_vec<4>(item, scratch.scores);
    else
      attend_any(item, scratch.scores);
  });
  return out;
}

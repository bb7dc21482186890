// Decode attention straight from the paged KV cache on the CPU: one query token per sequence reads its keys
// and values block by block, where they lie, instead of gathering them into a padded copy first. A work item
// is a sequence (or, with fewer sequences than threads to share them, one of its kv heads) and handles the
// query heads that share its kv heads (GQA).
//
// The cache is far larger than any CPU cache and each block is read once a step, so the kernel is bound by
// how fast blocks come from memory. It takes one block at a time, keys and values together, with the softmax
// kept running across blocks (its maximum and sum per query head, the output rescaled when the maximum
// grows), and as it starts on a block asks for all of the next one's keys and values, into L2. The kernel
// before it made two passes (keys of every position, then values), fetching a few positions ahead into L1:
// 32 sequences x 350 positions, 30 layers, took 53-55 ms against 38-42 ms now; fetching from the first block
// on or two blocks ahead was slower (43-49 ms).
//
// For head sizes that are a multiple of 8 the loops run on at::vec's 8-float vectors with explicit fused
// multiply-adds (the build turns off contraction for the other kernels' sake): each key vector is loaded
// once for up to three query heads of its group, exponentials are vectorized (Sleef, as torch), and each
// query head's output stays in registers while a block's values stream past.
#include "cpu_vec.h"
#include "dynamic_parallel.h"
#include "softmax_row.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

static_assert(Vec::size() == 8, "the vector path assumes 8-float vectors");

constexpr int kQueryTile = 3;  // query heads scored together against each key vector

// one sequence's kv heads [h0, h0 + heads) and the query heads that share them
struct Item {
  const float* q;          // the first query head, [heads * group, dim]
  float* o;                // its output, [heads * group, dim]
  const float* k;          // the key cache at the first kv head: position j of block id b at k + (b * B + j) * stride
  const float* v;          // the value cache, likewise
  const int32_t* blocks;   // the sequence's block ids
  int64_t n, B, stride;    // context length, block size, floats from one position to the next (Hkv * dim)
  int64_t heads, group, dim;
  float scale;
};

// the 64-byte line at p, towards L2. GCC 12 at -O3 deleted a loop nest of __builtin_prefetch calls whole (it
// has no effect the compiler must keep), so on x86 it is an instruction the compiler may not drop.
inline void prefetch_l2(const float* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// block b's keys and values of the item's heads, towards L2
inline void prefetch_block(const Item& it, int64_t b) {
  const int64_t first = static_cast<int64_t>(it.blocks[b]) * it.B * it.stride, floats = it.heads * it.dim;
  for (int64_t p = 0; p < it.B; ++p)
    for (int64_t f = 0; f < floats; f += 16) {
      prefetch_l2(it.k + first + p * it.stride + f);
      prefetch_l2(it.v + first + p * it.stride + f);
    }
}

// out[t * out_stride] = q_t . key for the T query heads q, q + D, ... (D = 8 * kVec)
template <int kVec, int T>
inline void score_tile(const float* q, const float* key, float* out, int64_t out_stride) {
  Vec acc[T];
  for (int t = 0; t < T; ++t) acc[t] = Vec(0.f);
  for (int i = 0; i < kVec; ++i) {
    const Vec k = Vec::loadu(key + 8 * i);
    for (int t = 0; t < T; ++t) acc[t] = at::vec::fmadd(Vec::loadu(q + t * 8 * kVec + 8 * i), k, acc[t]);
  }
  for (int t = 0; t < T; ++t)
    out[t * out_stride] = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, acc[t]);
}

// rows' running softmax after a block's scores row[0:len): the maximum so far, exp(score - maximum) in
// place, the sum so far; the output (dim floats) is rescaled when the maximum grows
inline void softmax_step(float* row, int64_t len, float& mx, float& sum, float* out, int64_t dim) {
  const float block_max = max_of(row, len);
  if (block_max > mx) {
    if (sum > 0.f) {
      const float factor = std::exp(mx - block_max);
      sum *= factor;
      for (int64_t d = 0; d < dim; ++d) out[d] *= factor;
    }
    mx = block_max;
  }
  sum += exp_minus(row, len, mx);
}

template <int kVec>
void attend_vec(const Item& it, std::vector<float>& scratch) {
  constexpr int64_t D = 8 * kVec;
  const int64_t rows = it.heads * it.group, B = it.B, blocks = (it.n + B - 1) / B;
  scratch.resize(rows * (B + 2));
  float* scores = scratch.data();  // [rows, B]: the block's
  float* mx = scores + rows * B;
  float* sum = mx + rows;
  std::fill(mx, mx + rows, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + rows, 0.f);
  std::fill(it.o, it.o + rows * D, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    if (b + 1 < blocks) prefetch_block(it, b + 1);
    const int64_t len = std::min(B, it.n - b * B), first = static_cast<int64_t>(it.blocks[b]) * B * it.stride;
    const float* kb = it.k + first;
    const float* vb = it.v + first;
    for (int64_t p = 0; p < len; ++p)
      for (int64_t h = 0; h < it.heads; ++h) {
        const float* key = kb + p * it.stride + h * D;
        for (int64_t g = 0; g < it.group; g += kQueryTile) {
          const int64_t r = h * it.group + g;
          const float* q = it.q + r * D;
          float* out = scores + r * B + p;
          switch (std::min<int64_t>(kQueryTile, it.group - g)) {
            case 1: score_tile<kVec, 1>(q, key, out, B); break;
            case 2: score_tile<kVec, 2>(q, key, out, B); break;
            default: score_tile<kVec, 3>(q, key, out, B); break;
          }
        }
      }
    for (int64_t r = 0; r < rows; ++r) {
      float* row = scores + r * B;
      for (int64_t p = 0; p < len; ++p) row[p] *= it.scale;
      softmax_step(row, len, mx[r], sum[r], it.o + r * D, D);
      const int64_t offset = (r / it.group) * D;
      float* orow = it.o + r * D;
      Vec acc[kVec];
      for (int i = 0; i < kVec; ++i) acc[i] = Vec::loadu(orow + 8 * i);
      for (int64_t p = 0; p < len; ++p) {
        const float* value = vb + p * it.stride + offset;
        const Vec w(row[p]);
        for (int i = 0; i < kVec; ++i) acc[i] = at::vec::fmadd(w, Vec::loadu(value + 8 * i), acc[i]);
      }
      for (int i = 0; i < kVec; ++i) acc[i].store(orow + 8 * i);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* orow = it.o + r * D;
    const Vec inv(1.f / sum[r]);
    for (int i = 0; i < kVec; ++i) (Vec::loadu(orow + 8 * i) * inv).store(orow + 8 * i);
  }
}

// any head size, one position at a time
void attend_any(const Item& it, std::vector<float>& scratch) {
  const int64_t n = it.n, d = it.dim, rows = it.heads * it.group;
  scratch.resize(n);
  float* p = scratch.data();
  auto row_at = [&](const float* cache, int64_t j) {
    return cache + (static_cast<int64_t>(it.blocks[j / it.B]) * it.B + j % it.B) * it.stride;
  };
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t offset = (r / it.group) * d;
    const float* qr = it.q + r * d;
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = row_at(it.k, j) + offset;
      float dot = 0.f;
      for (int64_t i = 0; i < d; ++i) dot += qr[i] * kj[i];
      p[j] = dot * it.scale;
    }
    const float inv = 1.f / exp_minus(p, n, max_of(p, n));
    float* orow = it.o + r * d;
    std::fill(orow, orow + d, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = row_at(it.v, j) + offset;
      for (int64_t i = 0; i < d; ++i) orow[i] += p[j] * vj[i];
    }
    for (int64_t i = 0; i < d; ++i) orow[i] *= inv;
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
  const int64_t per_item = S >= 2 * at::get_num_threads() ? Hkv : 1, items_per_seq = Hkv / per_item;
  parallel_dynamic(S * items_per_seq, [] { return std::vector<float>(); }, [&](int64_t w, std::vector<float>& scratch) {
    const int64_t s = w / items_per_seq, h = (w % items_per_seq) * per_item;
    const Item item{q + s * qs + h * group * D, o + (s * Hq + h * group) * D, k + h * D, v + h * D, tbl + s * M,
                    len[s], B, Hkv * D, per_item, group, D, fscale};
    if (D == 64)
      attend_vec<8>(item, scratch);
    else if (D == 128)
      attend_vec<16>(item, scratch);
    else if (D == 32)
      attend_vec<4>(item, scratch);
    else
      attend_any(item, scratch);
  });
  return out;
}

// Decode attention straight from the paged KV cache on the CPU: one query token per sequence reads its keys
// and values block by block, where they lie, instead of gathering them into a padded copy first. A work item
// is a sequence (or, with fewer sequences than threads to share them, one of its kv heads) and handles the
// query heads that share its kv heads (GQA). A context of more than kPartTokens positions is cut into parts, work
// items of their own whose softmaxes finish() merges, at places that depend on its length alone (parts_of).
//
// The cache is far larger than any CPU cache and each block is read once a step, so the kernel is bound by
// how fast blocks come from memory. It takes one block at a time, keys and values together, with the softmax
// kept running across blocks (its maximum and sum per query head, the output rescaled when the maximum
// grows), and while it works on a block asks for the next one's keys and values, into L2, a share of them
// before each query head: spread out, the fetches overlap the arithmetic instead of stalling it in one burst
// at the block's start (32 sequences x 350 positions, 30 layers: 32 ms, where a loop that only reads the same
// blocks takes 19-22 ms).
//
// For head sizes that are a multiple of 8 the loops run on at::vec's 8-float vectors with explicit fused
// multiply-adds (the build turns off contraction for the other kernels' sake). A query head is scored against
// eight keys at once, eight running sums whose lanes are added across in one shuffle tree (a horizontal sum
// per key took a third of the arithmetic); exponentials are vectorized (Sleef, as torch), and each query
// head's output stays in registers while a block's values stream past.
#include "cpu_vec.h"
#include "decode_attention_cpu.h"
#include "dynamic_parallel.h"
#include "prefetch.h"
#include "softmax_row.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

static_assert(Vec::size() == 8, "the vector path assumes 8-float vectors");

// one sequence's kv heads [h0, h0 + heads) and the query heads that share them
struct Item {
  const float* q;          // the first query head, [heads * group, dim]
  const float* k;          // the key cache at the first kv head: position j of block id b at k + (b * B + j) * stride
  const float* v;          // the value cache, likewise
  const int32_t* blocks;   // the sequence's block ids
  int64_t n, B, stride;    // context length, block size, floats from one position to the next (Hkv * dim)
  int64_t heads, group, dim;
  float scale;
};

// block b's keys and values of the item's heads, towards L2
inline void prefetch_block(const Item& it, int64_t b) {
  const int64_t first = static_cast<int64_t>(it.blocks[b]) * it.B * it.stride, floats = it.heads * it.dim;
  for (int64_t p = 0; p < it.B; ++p)
    for (int64_t f = 0; f < floats; f += 16) {
      prefetch_l2(it.k + first + p * it.stride + f);
      prefetch_l2(it.v + first + p * it.stride + f);
    }
}

// the scores of query q (D = 8 * kVec floats, already scaled) against 8 keys from key, stride apart
template <int kVec>
inline Vec score8(const float* q, const float* key, int64_t stride) {
#if defined(CPU_CAPABILITY_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const float *k0 = key, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride, *k4 = k3 + stride,
              *k5 = k4 + stride, *k6 = k5 + stride, *k7 = k6 + stride;
  for (int i = 0; i < 8 * kVec; i += 8) {
    const __m256 qi = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k0 + i), a0);
    a1 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k1 + i), a1);
    a2 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k2 + i), a2);
    a3 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k3 + i), a3);
    a4 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k4 + i), a4);
    a5 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k5 + i), a5);
    a6 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k6 + i), a6);
    a7 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k7 + i), a7);
  }
  const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  alignas(32) float s[8];
  for (int p = 0; p < 8; ++p) {
    Vec acc(0.f);
    for (int i = 0; i < kVec; ++i) acc = at::vec::fmadd(Vec::loadu(q + 8 * i), Vec::loadu(key + p * stride + 8 * i), acc);
    s[p] = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, acc);
  }
  return Vec::loadu(s);
#endif
}

// The item's output so far, unnormalized, into the front of scratch ([rows, dim]), then each query head's running
// maximum and sum ([rows] each): store() turns them into the output or a part's for finish. Nothing else is
// written, so a thread that runs an item another already ran (decoder_stack_team.cpp) changes nothing shared.
template <int kVec>
void attend_vec(const Item& it, std::vector<float>& scratch) {
  constexpr int64_t D = 8 * kVec;
  const int64_t rows = it.heads * it.group, B = it.B, blocks = (it.n + B - 1) / B;
  const int64_t Bp = (B + 7) / 8 * 8;  // a block's scores, padded to whole vectors (-inf past its positions)
  scratch.resize(rows * (Bp + 2 * D + 2));
  float* acc_out = scratch.data();  // [rows, D]: the output so far
  float* mx = acc_out + rows * D;
  float* sum = mx + rows;
  float* scores = sum + rows;        // [rows, Bp]: the block's
  float* qs = scores + rows * Bp;    // [rows, D]: the queries, scaled
  for (int64_t j = 0; j < rows * D; ++j) qs[j] = it.q[j] * it.scale;
  std::fill(mx, mx + rows, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + rows, 0.f);
  std::fill(acc_out, acc_out + rows * D, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t len = std::min(B, it.n - b * B), first = static_cast<int64_t>(it.blocks[b]) * B * it.stride;
    const float* kb = it.k + first;
    const float* vb = it.v + first;
    // the next block: the item's keys and values of a block are one range each where the item has all kv heads,
    // and a share of its cache lines is asked for before each query head; else all of them now
    const float* kn = b + 1 < blocks ? it.k + static_cast<int64_t>(it.blocks[b + 1]) * B * it.stride : nullptr;
    const float* vn = kn == nullptr ? nullptr : it.v + (kn - it.k);
    const bool spread = it.heads * D == it.stride;
    const int64_t lines = (B * it.stride + 15) / 16;
    if (kn != nullptr && !spread) prefetch_block(it, b + 1);
    for (int64_t r = 0; r < rows; ++r) {
      if (kn != nullptr && spread)
        for (int64_t l = r * lines / rows; l < (r + 1) * lines / rows; ++l) {
          prefetch_l2(kn + 16 * l);
          prefetch_l2(vn + 16 * l);
        }
      const int64_t offset = (r / it.group) * D;
      float* row = scores + r * Bp;
      // whole groups of 8 positions; those past len lie in the block too (read, then masked) unless it ends first
      for (int64_t p = 0; p < len; p += 8) {
        if (p + 8 <= B) {
          score8<kVec>(qs + r * D, kb + p * it.stride + offset, it.stride).store(row + p);
        } else {
          for (int64_t j = p; j < len; ++j) {
            const float* key = kb + j * it.stride + offset;
            Vec acc(0.f);
            for (int i = 0; i < kVec; ++i) acc = at::vec::fmadd(Vec::loadu(qs + r * D + 8 * i), Vec::loadu(key + 8 * i), acc);
            row[j] = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, acc);
          }
        }
        if (p + 8 > len) std::fill(row + len, row + p + 8, -std::numeric_limits<float>::infinity());
      }
      const int64_t lenp = (len + 7) / 8 * 8;
      const float block_max = max_of(row, lenp);
      float* orow = acc_out + r * D;
      Vec acc[kVec];
      for (int i = 0; i < kVec; ++i) acc[i] = Vec::loadu(orow + 8 * i);
      if (block_max > mx[r]) {
        if (sum[r] > 0.f) {
          const float factor = std::exp(mx[r] - block_max);
          sum[r] *= factor;
          const Vec f(factor);
          for (int i = 0; i < kVec; ++i) acc[i] = acc[i] * f;
        }
        mx[r] = block_max;
      }
      sum[r] += exp_minus(row, lenp, mx[r]);
      for (int64_t p = 0; p < len; ++p) {
        const float* value = vb + p * it.stride + offset;
        const Vec w(row[p]);
        for (int i = 0; i < kVec; ++i) acc[i] = at::vec::fmadd(w, Vec::loadu(value + 8 * i), acc[i]);
      }
      for (int i = 0; i < kVec; ++i) acc[i].store(orow + 8 * i);
    }
  }
}

// any head size, one position at a time: the output, normalized, into the front of scratch ([rows, dim])
void attend_any(const Item& it, std::vector<float>& scratch) {
  const int64_t n = it.n, d = it.dim, rows = it.heads * it.group;
  scratch.resize(rows * d + n + d);
  float* out = scratch.data();
  float* p = out + rows * d;
  float* orow = p + n;
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
    std::fill(orow, orow + d, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = row_at(it.v, j) + offset;
      for (int64_t i = 0; i < d; ++i) orow[i] += p[j] * vj[i];
    }
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = orow[i] * inv;
  }
}

}  // namespace

DecodeAttention::DecodeAttention(int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t B, const int32_t* table,
                                 int64_t table_stride, const int32_t* lens, double scale, int threads)
    : table_(table), lens_(lens), table_stride_(table_stride), scale_(static_cast<float>(scale)), S_(S), Hq_(Hq),
      D_(D), B_(B), Hkv_(Hkv), group_(Hq / Hkv), vectorized_(D == 32 || D == 64 || D == 128) {
  // a sequence's kv heads together where there are sequences enough for every thread; else one a work item
  per_item_ = S_ >= 2 * threads ? Hkv_ : 1;
  for (int64_t s = 0; s < S_; ++s) most_parts_ = std::max(most_parts_, parts_of(s));
  for (int64_t part = 0; part < most_parts_; ++part)
    for (int64_t u = 0; u < units(); ++u)
      if (part < parts_of(u / (Hkv_ / per_item_))) items_.push_back({u, part});
  if (most_parts_ > 1) {
    partial_out_.resize(units() * most_parts_ * rows() * D_);
    partial_stats_.resize(units() * most_parts_ * rows() * 2);
  }
}

// Parts of at most kPartTokens positions, by the context's length alone: never by the thread count, whose change
// (the CPU thread governor's) would move the cut and so the merge's rounding, nor by the batch beside it. A power
// of two of them, so that one stream's 3 kv heads make an even number of work items: at 257-512 positions the
// two halves a cut by two threads made. At most kMaxParts, so that the merge stays a few parts a head. Only the
// vectorized head sizes keep the running maximum and sum a merge needs.
int64_t DecodeAttention::parts_of(int64_t s) const {
  if (!vectorized_) return 1;
  const int64_t blocks = (lens_[s] + B_ - 1) / B_, part_blocks = std::max<int64_t>(1, kPartTokens / B_);
  int64_t parts = 1;
  while (parts < kMaxParts && parts * part_blocks < blocks) parts *= 2;
  return std::max<int64_t>(1, std::min(parts, blocks));  // each part a block at least
}

void DecodeAttention::set(const float* query, int64_t query_stride, const float* key_cache, const float* value_cache,
                          float* out) {
  q_ = query, q_stride_ = query_stride, k_ = key_cache, v_ = value_cache, out_ = out;
}

void DecodeAttention::compute(int64_t w, std::vector<float>& scratch) const {
  const Work work = items_[w];
  const int64_t items_per_seq = Hkv_ / per_item_;
  const int64_t s = work.unit / items_per_seq, h = (work.unit % items_per_seq) * per_item_;
  const int32_t* blocks = table_ + s * table_stride_;
  const int64_t n = lens_[s], parts = parts_of(s);
  Item item{q_ + s * q_stride_ + h * group_ * D_, k_ + h * D_, v_ + h * D_, blocks, n, B_, Hkv_ * D_,
            per_item_, group_, D_, scale_};
  if (parts > 1) {  // whole blocks [first, last) of the context's
    const int64_t total = (n + B_ - 1) / B_, first = total * work.part / parts, last = total * (work.part + 1) / parts;
    item.blocks = blocks + first;
    item.n = std::min(n, last * B_) - first * B_;
  }
  if (D_ == 64)
    attend_vec<8>(item, scratch);
  else if (D_ == 128)
    attend_vec<16>(item, scratch);
  else if (D_ == 32)
    attend_vec<4>(item, scratch);
  else
    attend_any(item, scratch);
}

void DecodeAttention::store(int64_t w, const std::vector<float>& scratch) {
  const Work work = items_[w];
  const int64_t rows = this->rows(), s = work.unit / (Hkv_ / per_item_);
  const float* acc = scratch.data();
  // units and their rows lie in out's order: [S, Hkv / per_item, rows]
  float* o = out_ + work.unit * rows * D_;
  if (!vectorized_) {
    std::copy(acc, acc + rows * D_, o);
    return;
  }
  const float* mx = acc + rows * D_;
  const float* sum = mx + rows;
  if (parts_of(s) == 1) {
    for (int64_t r = 0; r < rows; ++r) {
      const Vec inv(1.f / sum[r]);
      for (int64_t i = 0; i < D_; i += 8) (Vec::loadu(acc + r * D_ + i) * inv).store(o + r * D_ + i);
    }
    return;
  }
  const int64_t slot = work.unit * most_parts_ + work.part;
  std::copy(acc, acc + rows * D_, partial_out_.data() + slot * rows * D_);
  float* stats = partial_stats_.data() + slot * rows * 2;
  for (int64_t r = 0; r < rows; ++r) stats[2 * r] = mx[r], stats[2 * r + 1] = sum[r];
}

void DecodeAttention::finish() {
  if (most_parts_ == 1) return;
  for (int64_t u = 0; u < units(); ++u) finish_unit(u);
}

void DecodeAttention::finish_unit(int64_t u) {
  // each query head of a cut context: its parts' outputs weighed by exp(part max - overall max), over their sums
  // likewise, in the parts' order
  const int64_t parts = parts_of(u / (Hkv_ / per_item_)), rows = this->rows();
  if (parts == 1) return;  // stored whole
  for (int64_t r = 0; r < rows; ++r) {
    auto stats = [&](int64_t p) { return partial_stats_.data() + ((u * most_parts_ + p) * rows + r) * 2; };
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, stats(p)[0]);
    float sum = 0.f;
    float* orow = out_ + (u * rows + r) * D_;
    std::fill(orow, orow + D_, 0.f);
    for (int64_t p = 0; p < parts; ++p) {
      const float* st = stats(p);
      if (st[1] == 0.f) continue;  // a part whose scores were all -inf
      const float weight = std::exp(st[0] - mx);
      sum += st[1] * weight;
      const float* po = partial_out_.data() + ((u * most_parts_ + p) * rows + r) * D_;
      for (int64_t i = 0; i < D_; ++i) orow[i] += weight * po[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < D_; ++i) orow[i] *= inv;
  }
}

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
  auto out = at::empty({S, Hq, D}, query.options());
  DecodeAttention attention(S, Hq, key_cache.size(2), D, key_cache.size(1), table.data_ptr<int32_t>(), table.size(1),
                            lens.data_ptr<int32_t>(), scale, at::get_num_threads());
  attention.set(query.data_ptr<float>(), query.stride(0), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                out.data_ptr<float>());
  parallel_dynamic(attention.items(), [] { return std::vector<float>(); },
                   [&](int64_t w, std::vector<float>& scratch) { attention.run(w, scratch); });
  // many sequences' merges share the threads; one stream's few are not worth waking them again
  if (attention.units() >= 4 * at::get_num_threads() && attention.items() > attention.units())
    parallel_dynamic(attention.units(), [] { return 0; }, [&](int64_t u, int) { attention.finish_unit(u); });
  else
    attention.finish();
  return out;
}

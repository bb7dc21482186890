// Attention for the prefill chunks of a step on the CPU, straight from the paged KV cache: every query token of
// a chunk attends to its sequence's context up to and including itself (what comes before the chunk, already
// cached, then the chunk's own tokens, causally).
//
// torch's flash attention for CPU (SDPA) reaches about a third of its arithmetic's rate here: its blocks of 32
// queries x 64 dimensions are too small for the BLAS calls it makes, and the context must first be gathered out
// of the cache into a copy. Here both products are the
// register-blocked panel kernel small_gemm uses (panel_kernel.h):
//   1. each (sequence, kv head)'s context is packed once: keys transposed into panels of 16 positions ([D, 16]
//      each, so that scores come out 6 query rows x 16 positions at a time), values into panels of 16
//      dimensions ([context, 16] each);
//   2. a work item is (sequence, kv head, a tile of the chunk's positions) and handles the query heads that
//      share the kv head. For 6 query rows at a time it computes their scores against the positions the last
//      of them sees, turns them into exp(score - max) with the later positions zeroed, multiplies by the values
//      and divides by the sums. Work items go out latest tile first (the most context), from a shared counter.
#include "dynamic_parallel.h"
#include "panel_kernel.h"
#include "softmax_row.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

using panel_gemm::kCols;
using panel_gemm::kKernels;
using panel_gemm::kRows;

namespace {

// chunk positions a work item takes: large enough that the work item's share of packing stays small
constexpr int64_t kTile = 96;

struct Chunk {
  int64_t seq, start, q_len, context;  // batch row, first query token, tokens in the chunk, context after it
};

}  // namespace

// out, query [T, Hq, D] (each token's heads contiguous); key_cache, value_cache [N, B, Hkv, D]; block_table
// [S, M] int32; seq_lens [S] int32 (context after this step); query_start_loc [S + 1] int32. Writes the rows
// of out that belong to sequences with two or more query tokens; the others are left as they are.
void prefill_attention_(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                        const at::Tensor& query_start_loc, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  key_cache.scalar_type() == at::kFloat && value_cache.scalar_type() == at::kFloat,
              "prefill_attention_: float32 only");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "prefill_attention_: contiguous caches only");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "prefill_attention_: query [T, Hq, D] with each token's heads contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), "prefill_attention_: out [T, Hq, D] contiguous");
  TORCH_CHECK(scale > 0, "prefill_attention_: scale must be positive");
  auto table = block_table.to(at::kInt).contiguous();
  auto lens = seq_lens.to(at::kInt).contiguous();
  auto starts = query_start_loc.to(at::kInt).contiguous();
  const int64_t S = table.size(0), M = table.size(1), Hq = query.size(1), D = query.size(2);
  const int64_t B = key_cache.size(1), Hkv = key_cache.size(2), group = Hq / Hkv;
  TORCH_CHECK(lens.numel() == S && starts.numel() == S + 1, "prefill_attention_: one length and start per row");
  TORCH_CHECK(Hq % Hkv == 0 && key_cache.size(3) == D, "prefill_attention_: query and cache heads do not fit");
  const int32_t* tbl = table.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  const int32_t* st = starts.data_ptr<int32_t>();

  std::vector<Chunk> chunks;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = st[s + 1] - st[s];
    if (q_len < 2) continue;
    TORCH_CHECK(len[s] >= q_len && (len[s] + B - 1) / B <= M, "prefill_attention_: row ", s,
                "'s context does not hold its chunk or its block table is too short");
    chunks.push_back({s, st[s], q_len, len[s]});
  }
  if (chunks.empty()) return;

  // 1. the packed context of each (chunk, kv head)
  const int64_t dim_panels = (D + kCols - 1) / kCols;
  std::vector<int64_t> offset(chunks.size() + 1, 0);  // floats before a chunk's packed keys (all its heads)
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int64_t padded = (chunks[c].context + kCols - 1) / kCols * kCols;
    offset[c + 1] = offset[c] + Hkv * padded * (D + dim_panels * kCols);
  }
  auto packed = at::empty({offset.back()}, query.options());
  float* pk = packed.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  parallel_dynamic(static_cast<int64_t>(chunks.size()) * Hkv, [] { return 0; }, [&](int64_t w, int) {
    const Chunk& ch = chunks[w / Hkv];
    const int64_t h = w % Hkv, n = ch.context, padded = (n + kCols - 1) / kCols * kCols;
    float* keys_t = pk + offset[w / Hkv] + h * padded * (D + dim_panels * kCols);  // [padded / 16, D, 16]
    float* vals = keys_t + padded * D;                                              // [dim_panels, padded, 16]
    for (int64_t j = 0; j < padded; ++j) {
      float* kt = keys_t + (j / kCols) * D * kCols + j % kCols;
      float* vp = vals + j * kCols;
      if (j >= n) {  // padding keys: their scores are computed with the rest, then never read
        for (int64_t d = 0; d < D; ++d) kt[d * kCols] = 0.f;
        continue;
      }
      const int64_t row = (static_cast<int64_t>(tbl[ch.seq * M + j / B]) * B + j % B) * Hkv + h;
      const float* k = kc + row * D;
      const float* v = vc + row * D;
      for (int64_t d = 0; d < D; ++d) kt[d * kCols] = k[d];
      for (int64_t p = 0; p < dim_panels; ++p) {
        const int64_t cols = std::min(kCols, D - p * kCols);
        std::copy(v + p * kCols, v + p * kCols + cols, vp + p * padded * kCols);
        std::fill(vp + p * padded * kCols + cols, vp + p * padded * kCols + kCols, 0.f);
      }
    }
  });

  // 2. (chunk, kv head, tile) work items, the latest tiles (the most context) first
  struct Item {
    int64_t chunk, head, from, to;
  };
  std::vector<Item> items;
  for (size_t c = 0; c < chunks.size(); ++c)
    for (int64_t from = 0; from < chunks[c].q_len; from += kTile)
      for (int64_t h = 0; h < Hkv; ++h)
        items.push_back({static_cast<int64_t>(c), h, from, std::min(chunks[c].q_len, from + kTile)});
  auto seen_by_last = [&](const Item& it) { return chunks[it.chunk].context - chunks[it.chunk].q_len + it.to; };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Item& a, const Item& b) { return seen_by_last(a) > seen_by_last(b); });
  const int64_t qs = query.stride(0), os = Hq * D;
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  parallel_dynamic(static_cast<int64_t>(items.size()), [] { return std::vector<float>(); },
                   [&](int64_t w, std::vector<float>& scores) {
    const Item& it = items[w];
    const Chunk& ch = chunks[it.chunk];
    const int64_t padded = (ch.context + kCols - 1) / kCols * kCols, before = ch.context - ch.q_len;
    const float* keys_t = pk + offset[it.chunk] + it.head * padded * (D + dim_panels * kCols);
    const float* vals = keys_t + padded * D;
    scores.resize(kRows * padded);
    float* sc = scores.data();
    for (int64_t g = 0; g < group; ++g) {
      const int64_t head = it.head * group + g;
      for (int64_t r0 = it.from; r0 < it.to; r0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, it.to - r0);
        const int64_t seen = before + r0 + rows;  // positions the last of the rows attends to
        const int64_t seen_padded = (seen + kCols - 1) / kCols * kCols;
        const float* qr = q + (ch.start + r0) * qs + head * D;
        for (int64_t p = 0; p < seen_padded / kCols; ++p)
          kKernels[rows](qr, qs, keys_t + p * D * kCols, D, nullptr, sc + p * kCols, padded, kCols, nullptr, 0);
        float inv[kRows];
        for (int64_t r = 0; r < rows; ++r) {
          float* row = sc + r * padded;
          const int64_t n = before + r0 + r + 1;
          for (int64_t j = 0; j < n; ++j) row[j] *= fscale;
          inv[r] = 1.f / exp_shifted(row, n);
          std::fill(row + n, row + seen, 0.f);
        }
        float* orow = o + (ch.start + r0) * os + head * D;
        for (int64_t p = 0; p < dim_panels; ++p)
          kKernels[rows](sc, padded, vals + p * padded * kCols, seen, nullptr, orow + p * kCols, os,
                         std::min(kCols, D - p * kCols), nullptr, 0);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t d = 0; d < D; ++d) orow[r * os + d] *= inv[r];
      }
    }
  });
}

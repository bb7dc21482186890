// Decode attention as work items (decode_attention_cpu.cpp): decode_attention() runs them on torch's threads;
// the decoder stack's team on its own (decoder_stack_cpu.cpp), one layer after another with the same cut.
#pragma once

#include <cstdint>
#include <vector>

class DecodeAttention {
 public:
  // S sequences of Hq query heads sharing Hkv kv heads of D floats, the caches' blocks of B positions; the block
  // table [S, table_stride] and context lengths [S] (int32) outlive this. threads only groups a sequence's kv
  // heads into work items or not, which changes no result: where a context is cut into parts depends on its
  // length alone, so the same step gives the same bits on any number of threads.
  DecodeAttention(int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t B, const int32_t* table,
                  int64_t table_stride, const int32_t* lens, double scale, int threads);
  // one layer's operands: query [S, Hq, D], rows query_stride floats apart; key and value caches [N, B, Hkv, D]
  // (contiguous); out [S, Hq, D] contiguous
  void set(const float* query, int64_t query_stride, const float* key_cache, const float* value_cache, float* out);
  int64_t items() const { return static_cast<int64_t>(items_.size()); }
  // item w into scratch, the thread's own, from any thread and any number of times: it writes nothing else
  void compute(int64_t w, std::vector<float>& scratch) const;
  // item w's result, as compute left it in scratch, into out (or its part's place for finish): once an item
  void store(int64_t w, const std::vector<float>& scratch);
  void run(int64_t w, std::vector<float>& scratch) {
    compute(w, scratch);
    store(w, scratch);
  }
  // after every item was stored: the parts of each cut context merged into out, in the parts' order
  void finish();
  // finish for one unit (a sequence's kv heads of one work item), from any thread, each once
  void finish_unit(int64_t u);
  int64_t units() const { return S_ * (Hkv_ / per_item_); }

 private:
  // A context is cut into parts of at most kPartTokens positions (whole blocks; up to kMaxParts, then longer):
  // one stream's few kv heads then make work for every thread, and the merge stays a few parts a head.
  static constexpr int64_t kPartTokens = 256, kMaxParts = 8;
  struct Work {
    int64_t unit, part;  // unit: a sequence's kv heads [h, h + per_item), sequence-major
  };
  int64_t parts_of(int64_t s) const;
  int64_t rows() const { return per_item_ * group_; }
  const int32_t* table_;
  const int32_t* lens_;
  int64_t table_stride_;
  float scale_;
  int64_t S_, Hq_, D_, B_, Hkv_, group_, per_item_ = 1, most_parts_ = 1;
  bool vectorized_;
  std::vector<Work> items_;  // parts in order: every unit's first part, then every second part, ...
  const float* q_ = nullptr;
  int64_t q_stride_ = 0;
  const float* k_ = nullptr;
  const float* v_ = nullptr;
  float* out_ = nullptr;
  // the parts' unnormalized outputs, and (max, sum) per row, [unit, part] each
  std::vector<float> partial_out_, partial_stats_;
};

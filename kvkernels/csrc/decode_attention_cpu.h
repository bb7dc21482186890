// Decode attention as work items (decode_attention_cpu.cpp): decode_attention() runs them on torch's threads;
// the decoder stack's team on its own (decoder_stack_cpu.cpp), one layer after another with the same cut.
#pragma once

#include <cstdint>
#include <vector>

class DecodeAttention {
 public:
  // S sequences of Hq query heads sharing Hkv kv heads of D floats, the caches' blocks of B positions; the block
  // table [S, table_stride] and context lengths [S] (int32) outlive this; work items cut for this many threads
  DecodeAttention(int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t B, const int32_t* table,
                  int64_t table_stride, const int32_t* lens, double scale, int threads);
  // one layer's operands: query [S, Hq, D], rows query_stride floats apart; key and value caches [N, B, Hkv, D]
  // (contiguous); out [S, Hq, D] contiguous
  void set(const float* query, int64_t query_stride, const float* key_cache, const float* value_cache, float* out);
  int64_t items() const { return S_ * (Hkv_ / per_item_) * parts_; }
  // item w, from any thread, each once; scratch is the thread's own
  void run(int64_t w, std::vector<float>& scratch);
  // after every item ran: the parts of a cut context merged into out
  void finish();

 private:
  static constexpr int64_t kMinPartBlocks = 2;  // blocks of context a part holds at least
  const int32_t* table_;
  const int32_t* lens_;
  int64_t table_stride_;
  float scale_;
  int64_t S_, Hq_, D_, B_, Hkv_, group_, per_item_ = 1, parts_ = 1;
  const float* q_ = nullptr;
  int64_t q_stride_ = 0;
  const float* k_ = nullptr;
  const float* v_ = nullptr;
  float* out_ = nullptr;
  // the parts' unnormalized outputs, and (max, sum) per row, each item its own
  std::vector<float> partial_out_, partial_stats_;
};

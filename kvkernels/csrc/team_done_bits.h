// Which pieces of a phase of the decoder team's (decoder_stack_team.cpp) are done, and which thread keeps each: any
// thread may compute a piece, into a buffer of its own, and only the first to take it writes it where others read.
// Plain atomics, no ATen: tests/kernels/test_team_done_bits.py runs it under ThreadSanitizer.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

// one bit a panel (or work item) of a phase, set once it is done; and one set by the thread that keeps it
class DoneBits {
 public:
  void reset(int64_t n) {
    n_ = n;
    const int64_t words = (n + 63) / 64;
    if (words > capacity_) {
      done_.reset(new std::atomic<uint64_t>[words]);
      taken_.reset(new std::atomic<uint64_t>[words]);
      capacity_ = words;
    }
    for (int64_t w = 0; w < words; ++w) {
      done_[w].store(0, std::memory_order_relaxed);
      taken_[w].store(0, std::memory_order_relaxed);
    }
  }
  // keep(from, to) for each run of [begin, end) that no thread took before this one, then those marked done
  template <typename Keep>
  void take(int64_t begin, int64_t end, Keep&& keep) {
    while (begin < end) {
      const int64_t w = begin / 64, stop = std::min(end, (w + 1) * 64);
      const uint64_t wanted = mask(begin - w * 64, stop - w * 64);
      const uint64_t won = wanted & ~taken_[w].fetch_or(wanted, std::memory_order_acq_rel);
      for (uint64_t rest = won; rest != 0;) {  // runs of set bits
        const int from = __builtin_ctzll(rest);
        const uint64_t shifted = ~(rest >> from);
        const int length = shifted == 0 ? 64 - from : __builtin_ctzll(shifted);
        keep(w * 64 + from, w * 64 + from + length);
        rest &= ~mask(from, from + length);
      }
      if (won != 0) done_[w].fetch_or(won, std::memory_order_release);
      begin = stop;
    }
  }
  bool all() const {
    for (int64_t w = 0; w * 64 < n_; ++w)
      if (done_[w].load(std::memory_order_acquire) != mask(0, std::min<int64_t>(64, n_ - w * 64))) return false;
    return true;
  }
  // the first run of bits no thread took, [begin, end); false where every bit is taken
  bool untaken(int64_t& begin, int64_t& end) const {
    begin = 0;
    while (begin < n_ && taken(begin)) ++begin;
    end = begin;
    while (end < n_ && !taken(end)) ++end;
    return begin < n_;
  }

 private:
  static uint64_t mask(int64_t from, int64_t to) {  // bits [from, to) of a word
    return (to - from == 64 ? ~uint64_t{0} : ((uint64_t{1} << (to - from)) - 1)) << from;
  }
  bool taken(int64_t i) const { return (taken_[i / 64].load(std::memory_order_acquire) >> (i % 64)) & 1; }

  std::unique_ptr<std::atomic<uint64_t>[]> done_, taken_;
  int64_t capacity_ = 0, n_ = 0;
};

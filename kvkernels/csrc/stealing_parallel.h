// Work items in one contiguous range per thread, each thread taking its own from the front and, once its range is
// empty, the other threads' from the back, a chunk at a time, on OpenMP's threads (torch's own pool).
//
// A decode step's GEMM at one row streams its weights from memory. dynamic_parallel.h's shared counter hands each
// thread runs of panels in turn, and every run starts a stream the hardware prefetchers must find again; a thread
// preempted by another process (the gateway, a load client) also holds its whole run while its partner waits at
// the end. Here each thread reads one stream from the start of its range to where the ranges meet, and a thread
// preempted in the middle of its range keeps only the chunk it was in: the other takes the rest from the back.
#pragma once
#include <ATen/Parallel.h>
#include <omp.h>

#include "region_error.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace stealing {

// [front, back) of one thread's range, packed in one word so that the owner (from the front) and a thief (from
// the back) claim with one compare-and-swap each, and on its own cache line
struct alignas(64) Range {
  std::atomic<uint64_t> bounds{0};
  static uint64_t pack(uint32_t front, uint32_t back) { return (static_cast<uint64_t>(back) << 32) | front; }
  static uint32_t front(uint64_t b) { return static_cast<uint32_t>(b); }
  static uint32_t back(uint64_t b) { return static_cast<uint32_t>(b >> 32); }

  // up to chunk items from the front (owner) or the back (thief) into [begin, end); false when empty
  bool claim(int64_t chunk, bool from_front, int64_t& begin, int64_t& end) {
    uint64_t b = bounds.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t f = front(b), k = back(b);
      if (f >= k) return false;
      const uint32_t take = static_cast<uint32_t>(std::min<int64_t>(chunk, k - f));
      const uint64_t next = from_front ? pack(f + take, k) : pack(f, k - take);
      if (bounds.compare_exchange_weak(b, next, std::memory_order_relaxed)) {
        begin = from_front ? f : k - take;
        end = from_front ? f + take : k;
        return true;
      }
    }
  }
};

// ranges[0..threads) as equal shares of [0, n)
inline void split(Range* ranges, int threads, int64_t n) {
  for (int t = 0; t < threads; ++t)
    ranges[t].bounds.store(
        Range::pack(static_cast<uint32_t>(n * t / threads), static_cast<uint32_t>(n * (t + 1) / threads)),
        std::memory_order_relaxed);
}

// thread self's part: fn(begin, end) over its own range from the front, then what is left of the others' from
// their backs
template <typename Fn>
void work(Range* ranges, int threads, int self, int64_t chunk, Fn& fn) {
  int64_t begin, end;
  while (ranges[self].claim(chunk, true, begin, end)) fn(begin, end);
  for (int other = (self + 1) % threads; other != self; other = (other + 1) % threads)
    while (ranges[other].claim(chunk, false, begin, end)) fn(begin, end);
}

}  // namespace stealing

// fn(begin, end) over [0, n) in chunks of at most chunk items: each thread's own range in order from its front,
// then what is left of the others' from their backs. n must fit in 32 bits.
template <typename Fn>
void parallel_stealing(int64_t n, int64_t chunk, Fn fn) {
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk));
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  std::vector<stealing::Range> ranges(threads);
  stealing::split(ranges.data(), threads, n);
  RegionError error;
  auto unless_failed = [&](int64_t begin, int64_t end) {
    if (!error.failed()) fn(begin, end);
  };
#pragma omp parallel num_threads(threads)
  try {
    stealing::work(ranges.data(), threads, omp_get_thread_num(), chunk, unless_failed);
  } catch (...) {
    error.capture();
  }
  error.rethrow();
}

// Work items handed out one at a time from a shared counter, on OpenMP's threads (torch's own pool).
//
// at::parallel_for splits a range into one fixed part per thread. On a machine whose cores the executor shares
// with the gateway, Redis and load clients, one of the threads is often preempted for a few milliseconds, and
// then the whole operation waits for its part at the end. Taking items from a counter, the running thread does
// the preempted one's share instead.
#pragma once
#include <ATen/Parallel.h>
#include <omp.h>

#include "region_error.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

// fn(item) for each item in [0, n); make_state() once per thread, passed to each of its fn calls
template <typename MakeState, typename Fn>
void parallel_dynamic(int64_t n, MakeState make_state, Fn fn) {
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), n));
  if (threads <= 1 || at::in_parallel_region()) {
    auto state = make_state();
    for (int64_t i = 0; i < n; ++i) fn(i, state);
    return;
  }
  std::atomic<int64_t> next{0};
  RegionError error;
#pragma omp parallel num_threads(threads)
  try {
    auto state = make_state();
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n && !error.failed();
         i = next.fetch_add(1, std::memory_order_relaxed))
      fn(i, state);
  } catch (...) {
    error.capture();
  }
  error.rethrow();
}

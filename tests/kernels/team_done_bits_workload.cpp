// A small team workload on kvkernels/csrc/team_done_bits.h, the decoder team's protocol (decoder_stack_team.cpp)
// on std::threads, for ThreadSanitizer (tests/kernels/test_team_done_bits.py): phases in order, each piece of a
// phase reading the phase before's output; the last thread stalls between computing a piece and keeping it, and
// the others, after a short wait, do what no thread took and go on. Exit 0 when the output is the serial one.
// With the argument "late-writes" every thread writes what it computed, as the team did before each piece had a
// keeper: the late thread's write then races with the next phase's reads, which ThreadSanitizer must report.
#include "team_done_bits.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int kThreads = 4, kPhases = 30, kPieces = 80;

// a few microseconds of arithmetic on a value of the phase before
double piece(const std::vector<double>& before, int p, int i) {
  double x = before[(i * 7) % kPieces];
  for (int k = 0; k < 2000; ++k) x = x * 0.999 + (i + p) * 0.001;
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  const bool late_writes = argc > 1 && std::strcmp(argv[1], "late-writes") == 0;
  std::vector<std::vector<double>> out(kPhases + 1, std::vector<double>(kPieces));
  for (int i = 0; i < kPieces; ++i) out[0][i] = i;
  std::vector<DoneBits> done(kPhases + 1);
  std::vector<std::atomic<int>> next(kPhases + 1);
  for (int p = 1; p <= kPhases; ++p) {
    done[p].reset(kPieces);
    next[p].store(0);
  }
  std::atomic<int> completed{0};  // phases complete; phase 0 is the input
  auto complete = [&](int p) {
    int now = completed.load();
    while (now < p && !completed.compare_exchange_weak(now, p)) {
    }
  };
  std::atomic<int> started{0};
  auto worker = [&](int self) {
    started.fetch_add(1);
    while (started.load() < kThreads) std::this_thread::yield();  // all in the first phase
    int computed = 0;
    auto attempt = [&](int p, int i) {
      const double value = piece(out[p - 1], p, i);
      if (self == kThreads - 1 && ++computed % 5 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));
      if (late_writes) {
        out[p][i] = value;
        done[p].take(i, i + 1, [](int64_t, int64_t) {});
      } else {
        done[p].take(i, i + 1, [&](int64_t, int64_t) { out[p][i] = value; });
      }
    };
    for (int p = 1; p <= kPhases;) {
      if (completed.load(std::memory_order_acquire) >= p) {  // the others finished it: skip to where they are
        p = completed.load(std::memory_order_acquire) + 1;
        continue;
      }
      while (completed.load(std::memory_order_acquire) < p - 1) std::this_thread::yield();
      for (int i = next[p].fetch_add(1); i < kPieces; i = next[p].fetch_add(1)) attempt(p, i);
      const auto start = std::chrono::steady_clock::now();
      while (!done[p].all() && completed.load(std::memory_order_acquire) < p) {
        int64_t begin, end;
        if (std::chrono::steady_clock::now() - start > std::chrono::microseconds(20) && done[p].untaken(begin, end))
          attempt(p, static_cast<int>(begin));
        else
          std::this_thread::yield();
      }
      complete(p);
      ++p;
    }
  };
  std::vector<std::thread> team;
  for (int t = 0; t < kThreads; ++t) team.emplace_back(worker, t);
  for (auto& thread : team) thread.join();
  for (int p = 1; p <= kPhases; ++p)
    for (int i = 0; i < kPieces; ++i)
      if (out[p][i] != piece(out[p - 1], p, i)) {
        std::printf("phase %d piece %d: %g, not %g\n", p, i, out[p][i], piece(out[p - 1], p, i));
        return 1;
      }
  return 0;
}

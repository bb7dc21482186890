// The first exception thrown on any thread of an OpenMP parallel region, kept to be raised after the region: one
// that leaves the region's block ends the process (std::terminate), where the caller should get an error.
#pragma once

#include <atomic>
#include <exception>

class RegionError {
 public:
  // in a catch block, on any thread of the region: the first one's exception is kept
  void capture() {
    if (!failed_.exchange(true, std::memory_order_acq_rel)) error_ = std::current_exception();
  }
  // whether a thread failed: the others stop taking work
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // after the region, on the thread that started it
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;  // written once, by the thread that set failed_; read after the region's join
};

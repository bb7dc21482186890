// Software prefetch that the compiler keeps: GCC 12 at -O3 may delete a loop nest of __builtin_prefetch calls whole
// (it has no effect the compiler must keep), so on x86 it is an asm instruction the compiler may not drop.
#pragma once

// the 64-byte line at p, towards L2
inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// at::vec's Vectorized<float> built for this CPU's instruction set (the extension is compiled with
// -march=native): AVX2 with FMA where the compiler targets them, else the portable default.
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

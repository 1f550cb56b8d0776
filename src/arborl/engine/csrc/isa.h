// Which instruction set arborl's CPU kernels run (arborl.engine.cpu_kernels): chosen once, at first
// use, from what this CPU reports (cpuid), and forcible to any lower path it has (the tests compare
// every path with the reference). The paths of a kernel compute each output as the same chain of
// operations, so a lower path is a reference for a higher one.
#pragma once

#include <atomic>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ARBORL_X86 1
#define ARBORL_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define ARBORL_TARGET_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")))
#define ARBORL_TARGET_AVX512BF16 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define ARBORL_TARGET_AVX512VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#endif

namespace arborl {

// ordered: a CPU that has a level has every level below it
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };
inline const char* const kIsaNames[] = {"scalar", "avx2", "avx512f", "avx512_bf16"};

inline int cpu_isa() {
#ifdef ARBORL_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return kAvx512Bf16;
  if (avx512) return kAvx512;
  if (avx2) return kAvx2;
#endif
  return kScalar;
}

// AVX512-VNNI's int8 dot products (vpdpbusd), beside the chain above: a CPU may have them with or
// without AVX512-BF16; the int8 row kernel takes them on the AVX-512 paths where the CPU has them
inline bool cpu_has_vnni() {
#ifdef ARBORL_X86
  __builtin_cpu_init();
  return cpu_isa() >= kAvx512 && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// the path the kernels take now (one per process, shared by every kernel of the library)
inline std::atomic<int>& isa_state() {
  static std::atomic<int> state{cpu_isa()};
  return state;
}

inline int isa() { return isa_state().load(std::memory_order_relaxed); }

}  // namespace arborl

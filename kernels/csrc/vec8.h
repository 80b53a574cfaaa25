// 8-lane fp32 vectors for the package's CPU kernels (GCC/Clang vector extensions: AVX2 ymm with
// -march=native), shared so every kernel reads, reduces and prefetches the same way.
// `kernels/cpu_build.py` hashes this header into every kernel's build key.
#pragma once

#include <cstdint>

namespace chariot_vec8 {

constexpr int64_t kLanes = 8;
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef float vf_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t vi_unaligned __attribute__((vector_size(32), aligned(4), may_alias));

inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline vi load(const int32_t* p) { return *reinterpret_cast<const vi_unaligned*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf_unaligned*>(p) = v; }
inline vf splat(float x) { return vf{x, x, x, x, x, x, x, x}; }  // one vbroadcastss (`vf{} + x` adds a 0 first)
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }

// The sum of v's lanes (by value: an accumulator passed by address is kept in memory by GCC).
inline float lane_sum(vf v) {
  const vf h = v + __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3});
  const vf q = h + __builtin_shuffle(h, vi{2, 3, 0, 1, 6, 7, 4, 5});
  return q[0] + q[1];
}

// out[i] = the sum of v[i]'s lanes, for 8 vectors at once (a transpose-and-add tree).
inline vf lane_sums(const vf v[8]) {
  const vi even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
  const vi lo = {0, 1, 8, 9, 4, 5, 12, 13}, hi = {2, 3, 10, 11, 6, 7, 14, 15};
  const vi first = {0, 1, 2, 3, 8, 9, 10, 11}, second = {4, 5, 6, 7, 12, 13, 14, 15};
  vf t[4], u[2];
  for (int i = 0; i < 4; ++i) t[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], even) + __builtin_shuffle(v[2 * i], v[2 * i + 1], odd);
  for (int i = 0; i < 2; ++i) u[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], lo) + __builtin_shuffle(t[2 * i], t[2 * i + 1], hi);
  return __builtin_shuffle(u[0], u[1], first) + __builtin_shuffle(u[0], u[1], second);
}

// Starts loading the cache line at p. Inline asm on x86-64: GCC 12's dead-code elimination deletes
// loops of __builtin_prefetch (checked in the assembly), which left them with no effect.
inline void prefetch(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

// The same with the address in a register. The "m" operand above tells GCC that the asm reads
// memory, and in the skinny linear kernel's k loop GCC then stored all twelve vector accumulators
// to the stack on every step (a third of the FMA rate). The attention kernel keeps `prefetch`: with
// this form its decodes ran 0.93x as fast on an AVX-512 EPYC (docs/img/cpu_attention_prefetch_avx512.json).
inline void prefetch_from_register(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 (%0)" : : "r"(p));
#else
  __builtin_prefetch(p);
#endif
}

// The same into L2 (prefetcht1). A request into L1 holds one of the core's few line-fill buffers
// until its line arrives, and a stream of them leaves the core's own loads waiting for one; requests
// into L2 do not. The skinny linear kernel's weight stream ran 1.1-1.6x faster with them on a Zen 4
// EPYC (docs/kernels.md), as the attention kernel's decode rows had before (`prefetch_row`).
inline void prefetch_l2_from_register(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 (%0)" : : "r"(p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

}  // namespace chariot_vec8

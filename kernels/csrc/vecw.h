// The machine's widest fp32 vector for the CPU kernels' one-token attention path: 16 lanes (zmm,
// 32 registers) where the compiler targets AVX-512, else 8 (ymm). `vec8.h` stays the 8-lane type the
// register-blocked kernels are tuned for. Define CHARIOT_VECTOR_256 to build the 8-lane form on an
// AVX-512 machine (the tests do, so both forms are checked wherever they run).
// `kernels/cpu_build.py` hashes this header into every kernel's build key.
#pragma once

#include <cstdint>

#include "vec8.h"

namespace chariot_vecw {

#if defined(__AVX512F__) && !defined(CHARIOT_VECTOR_256)
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif

typedef float vw __attribute__((vector_size(4 * kW)));
typedef int32_t viw __attribute__((vector_size(4 * kW)));
typedef float vw_unaligned __attribute__((vector_size(4 * kW), aligned(4), may_alias));

inline vw load(const float* p) { return *reinterpret_cast<const vw_unaligned*>(p); }
inline void store(float* p, vw v) { *reinterpret_cast<vw_unaligned*>(p) = v; }
inline vw splat(float x) { return __builtin_shuffle(vw{x}, viw{}); }  // lane 0 everywhere: one broadcast
inline vw vmax(vw a, vw b) { return a > b ? a : b; }
inline viw lane_index() {
  viw v;
  for (int i = 0; i < kW; ++i) v[i] = i;
  return v;
}

// Lanes i and (i + shift) mod kW combined with `op`: after shifts g, 2g, ..., kW/2 every lane holds
// op over the lanes congruent to it mod g.
template <typename Op>
inline vw fold_congruent(vw v, int g, Op op) {
  const viw lanes = lane_index();
  for (int shift = g; shift < kW; shift *= 2) v = op(v, __builtin_shuffle(v, (lanes + shift) & (kW - 1)));
  return v;
}

// out[i] = the sum of v[i]'s lanes, for kW vectors at once: vec8.h's transpose-and-add tree, with
// one more level at 16 lanes. Level b pairs vectors x, y whose lanes hold partial sums in runs of b
// and halves their count: lo takes x's even runs and y's after them, hi the odd runs.
inline vw lane_sums(const vw v[kW]) {
#if defined(__AVX512F__) && !defined(CHARIOT_VECTOR_256)
  const viw lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const viw lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const viw lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const viw lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  vw a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo1) + __builtin_shuffle(v[2 * i], v[2 * i + 1], lo1 + 1);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2) + __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2 + 2);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo4) + __builtin_shuffle(b[2 * i], b[2 * i + 1], lo4 + 4);
  return __builtin_shuffle(c[0], c[1], lo8) + __builtin_shuffle(c[0], c[1], lo8 + 8);
#else
  return chariot_vec8::lane_sums(v);  // the same type as vec8.h's at 8 lanes
#endif
}

}  // namespace chariot_vecw

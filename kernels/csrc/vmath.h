// Vectorised math shared by the CPU kernels, for any GCC vector type of fp32 lanes.
// `kernels/cpu_build.py` hashes this header into every kernel's build key.
#pragma once

namespace chariot_vmath {

// 2^x, exactly 0 for x < -126 (so -inf gives 0); about 2e-7 relative error (Cephes exp2f). For any
// fp32 vector type V (int32 lanes VI).
template <typename V, typename VI>
inline V exp2_of(V x) {
  const V lo = V{} - 127.f, hi = V{} + 127.f;
  const V above = x > lo ? x : lo;
  const V clamped = above < hi ? above : hi;
  const V magic = V{} + 12582912.f;  // 1.5 · 2^23: adding then subtracting it rounds to an integer
  const V whole = (clamped + magic) - magic;
  const V f = clamped - whole;  // in [-0.5, 0.5]
  V p = V{} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const VI bits = (VI)p + (__builtin_convertvector(whole, VI) << 23);  // scale by 2^whole in the exponent
  return x < V{} - 126.f ? V{} : (V)bits;
}


}  // namespace chariot_vmath

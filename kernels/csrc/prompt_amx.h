// Prompt chunks' attention on AMX tiles (bf16 query and cache), reading K and V out of the paged cache.
// Included by paged_attention.cpp, which checks the inputs and registers the op.
//
// Why: a prompt chunk's attention is two GEMMs per (query tile, key step); on the tile unit they cost
// little next to the online softmax, which runs on AVX-512. PyTorch's flash attention (the route the
// chunks took before) needs the context gathered out of the cache and, for a chunk with context, a
// materialised causal mask, and ran at about 1.6-1.9x this path's time (docs/kernels.md).
//
// A work item is (sequence, 32 query tokens, KV head). It first packs the K and V of every key step
// it reads (64 keys, all in one cache block: block_size % 64 == 0) for the tile unit:
//   K as the B operand of S = Q·Kᵀ: [32 dims as 16 pairs][16 keys] tiles (a 16×16 transpose of
//     32-bit pairs);
//   V as the B operand of O += P·V: [16 key pairs][16 dims] tiles (two keys' rows interleaved), rows
//     of keys past the item's last position zeroed, so cache garbage never reaches O.
// Then each query head of the GQA group (32 rows: two row tiles of 16 tokens) runs through the steps
// with its Q, O and softmax state staying in L1; per step (`head_step`): S on the tiles, the online
// softmax on AVX-512 (log2 units, fp32; keys after a row's position get P = 0 by a masked move, never
// by multiplying a score), P rounded to bf16, P·V on the tiles into fresh accumulators, added to O
// (fp32, in memory) after O is rescaled where a row's max moved. The max P is taken against moves
// only when a row's max outgrows it by 2^8 (`kRescaleSlack`), so rescaling is rare.
// Causality bounds the key steps: an item reads keys up to its last token's position (< seq_len).
#pragma once

#include "amx_tiles.h"
#ifdef CHARIOT_AMX
#define CHARIOT_PROMPT_AMX 1
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>


namespace chariot_prompt_amx {

struct Problem {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  uint16_t* out;
  const int32_t* query_start;
  const int32_t* seq_lens;
  const int32_t* tables;
  int64_t width, heads, kv_heads, dim, block;
  int64_t q_tok, q_head, o_tok, o_head;  // strides, in elements
  int64_t k_blk, k_slot, k_head, v_blk, v_slot, v_head;
  float scale_log2;  // softmax scale × log2(e): scores go straight to exp2
  int64_t group() const { return heads / kv_heads; }
};

constexpr int64_t kRows = 16;    // query tokens per row tile (the tile unit's rows)
constexpr int64_t kTokens = 32;  // query tokens per work item
constexpr int64_t kKeys = 64;    // keys per step: four 16-key score tiles


// Whether this build and shape can run here: the tiles compiled in and granted by Linux, head_dim a
// multiple of 32 (at most 256) and whole key steps per cache block.
inline bool supports(int64_t dim, int64_t block) {
#ifdef CHARIOT_PROMPT_AMX
  return dim % 32 == 0 && dim <= 256 && block % kKeys == 0 && chariot_amx::tiles_permitted();
#else
  (void)dim, (void)block;
  return false;
#endif
}

#ifdef CHARIOT_PROMPT_AMX

struct Item {
  int32_t seq, kv_head, tok0;
  int64_t keys;  // keys it reads: its cost
};

struct Scratch {
  std::vector<uint16_t> q, kp, vp, p;
  std::vector<float> s, o, pv, m, l, alpha;
  Scratch(int64_t group, int64_t dim)
      : q(group * kTokens * dim), p(kTokens * kKeys),
        s(kTokens * kKeys), o(group * kTokens * dim), pv(kTokens * dim), m(group * kTokens), l(group * kTokens * 16), alpha(kTokens) {}
};

// K of keys [k0, k0 + 64) of one head as B tiles of S = Q·Kᵀ: tile (d-step, key group) at
// kp + (ds·4 + g)·512, row r = dims (32·ds + 2r, +1) of the group's 16 keys.
inline void pack_k(const Problem& P, const int32_t* table, int64_t head, int64_t k0, uint16_t* kp) {
  const int64_t block = table[k0 / P.block];
  const uint16_t* base = P.k + block * P.k_blk + (k0 % P.block) * P.k_slot + head * P.k_head;
  for (int64_t g = 0; g < 4; ++g)
    for (int64_t ds = 0; ds < P.dim / 32; ++ds)
      chariot_amx::pack_b_tile(base + g * 16 * P.k_slot + ds * 32, P.k_slot, kp + (ds * 4 + g) * 512);
}

// V of keys [k0, k0 + 64) as B tiles of O += P·V: tile (key step ks of 32, dim group dg of 16) at
// vp + (ks·(dim/16) + dg)·512, row r = keys (32·ks + 2r, +1) interleaved dim by dim. Keys at or past
// `visible` (relative to k0) are zeros.
inline void pack_v(const Problem& P, const int32_t* table, int64_t head, int64_t k0, int64_t visible, uint16_t* vp) {
  const int64_t block = table[k0 / P.block];
  const uint16_t* base = P.v + block * P.v_blk + (k0 % P.block) * P.v_slot + head * P.v_head;
  const int64_t groups = P.dim / 16;
  for (int64_t key = 0; key < kKeys; key += 2) {
    const int64_t ks = key / 32, r = (key % 32) / 2;
    const uint16_t* a = base + key * P.v_slot;
    const uint16_t* b = a + P.v_slot;
    for (int64_t dg = 0; dg < groups; ++dg) {
      __m512i lo = key < visible ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + dg * 16)))
                                 : _mm512_setzero_si512();
      __m512i hi = key + 1 < visible ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(b + dg * 16)))
                                     : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + (ks * groups + dg) * 512 + r * 32, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

constexpr float kRescaleSlack = 8.f;
// How far (log2 units) a row's max may rise above the max its P is taken against before O and the sum
// are rescaled: P stays at most 2^8, exact enough in bf16 and fp32, and after the first key steps a
// row's max rarely moves that far, so O is rarely touched outside the tiles (a vector pass over O
// right before the tiles load it stalled the tile unit).

// 2^x for x <= 8 (more than 2e-7 relative error nowhere, 0 below 2^-127 before the scaling's
// rounding): a degree-5 polynomial on the fraction, the exponent applied by VSCALEFPS.
inline __m512 exp2_small(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // in [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The online softmax over one key step for the item's 32 rows of one head: S (scratch s, 32 × 64
// fp32) to P (bf16), each row's max and running sum (a vector of partial sums, reduced at the end)
// updated, and the factor its O must be scaled by left in `alpha`. Keys past a row's position get
// P = 0 (a masked move; their scores are never used). Returns whether any row's O needs scaling.
inline bool softmax_step(const Problem& P, Scratch& sc, float* m, float* lsum, int64_t pos0, int64_t k0) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  bool rescale = false;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 scale = _mm512_set1_ps(P.scale_log2), neg_inf = _mm512_set1_ps(kNegInf);
  for (int64_t r = 0; r < kTokens; ++r) {
    const int64_t pos = pos0 + r;  // keys k0 + j with k0 + j <= pos are visible
    const bool diagonal = k0 + kKeys - 1 > pos;
    __m512 x[4];
    __mmask16 visible[4];
    for (int j = 0; j < 4; ++j) {
      x[j] = _mm512_mul_ps(_mm512_loadu_ps(sc.s.data() + r * kKeys + 16 * j), scale);
      visible[j] = diagonal ? _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(k0 + 16 * j))),
                                                      _mm512_set1_epi32(int32_t(pos)))
                            : __mmask16(0xffff);
    }
    float use = m[r], a = 1.f;
    const __m512 bound = _mm512_set1_ps(use + kRescaleSlack);
    __mmask16 over = 0;
    for (int j = 0; j < 4; ++j) over |= _mm512_mask_cmp_ps_mask(visible[j], x[j], bound, _CMP_GT_OQ);
    if (use == kNegInf || over) {  // the row's first visible keys, or its max outgrew `use`: find it
      __m512 mx = neg_inf;
      for (int j = 0; j < 4; ++j) mx = _mm512_mask_max_ps(mx, visible[j], mx, x[j]);
      const float m_new = _mm512_reduce_max_ps(mx);
      uint16_t* prow = sc.p.data() + r * kKeys;
      if (m_new == kNegInf) {  // nothing visible yet: P is zero, nothing else changes
        std::memset(prow, 0, kKeys * sizeof(uint16_t));
        sc.alpha[r] = 1.f;
        continue;
      }
      if (use != kNegInf) {  // O and the sum hold earlier keys: scale them to the new max
        a = std::exp2(use - m_new);
        rescale = true;
      }
      use = m_new;
    }
    const __m512 u = _mm512_set1_ps(use);
    __m512 p[4];
    for (int j = 0; j < 4; ++j) p[j] = _mm512_maskz_mov_ps(visible[j], exp2_small(_mm512_sub_ps(x[j], u)));
    uint16_t* prow = sc.p.data() + r * kKeys;
    _mm512_storeu_si512(prow, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    _mm512_storeu_si512(prow + 32, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3]));
    float* lr = lsum + r * 16;
    _mm512_storeu_ps(lr, _mm512_fmadd_ps(_mm512_loadu_ps(lr), _mm512_set1_ps(a), sum));
    m[r] = use;
    sc.alpha[r] = a;
  }
  return rescale;
}

// One key step for the item's 32 rows of one head (two row tiles): S on the tiles, the softmax, O
// rescaled, O += P·V on the tiles. Tiles: 0-3 accumulators (2 row tiles × 2 column tiles), 4-5 the
// row tiles' A operands, 6-7 two B operands, so each load feeds two products and no product waits
// for a tile another is still reading.
inline void head_step(const Problem& P, Scratch& sc, const uint16_t* kpack, const uint16_t* vpack, const uint16_t* q, float* o, float* m, float* l,
                      int64_t pos0, int64_t k0) {
  float* s = sc.s.data();
  const int64_t qld = P.dim * 2;
  for (int64_t kh = 0; kh < 2; ++kh) {  // keys [32·kh, 32·kh + 32) of the step
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ds = 0; ds < P.dim / 32; ++ds) {
      chariot_amx::product_2x2(q + ds * 32, q + kRows * P.dim + ds * 32, qld, kpack + (ds * 4 + 2 * kh) * 512);
    }
    _tile_stored(0, s + 32 * kh, kKeys * 4);
    _tile_stored(1, s + 32 * kh + 16, kKeys * 4);
    _tile_stored(2, s + kRows * kKeys + 32 * kh, kKeys * 4);
    _tile_stored(3, s + kRows * kKeys + 32 * kh + 16, kKeys * 4);
  }
  const bool rescale = softmax_step(P, sc, m, l, pos0, k0);
  // O += P·V: the products land in fresh tiles, stored to `pv`, and are added to O (scaled first
  // where a row's max moved) on AVX-512; O itself never goes through the tiles.
  const int64_t groups = P.dim / 16;
  const uint16_t* pp = sc.p.data();
  float* pv = sc.pv.data();
  const int64_t ld = P.dim * 4;
  for (int64_t d0 = 0; d0 < P.dim; d0 += 32) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ks = 0; ks < 2; ++ks) {
      chariot_amx::product_2x2(pp + ks * 32, pp + kRows * kKeys + ks * 32, kKeys * 2,
                               vpack + (ks * groups + d0 / 16) * 512);
    }
    _tile_stored(0, pv + d0, ld);
    _tile_stored(1, pv + d0 + 16, ld);
    _tile_stored(2, pv + kRows * P.dim + d0, ld);
    _tile_stored(3, pv + kRows * P.dim + d0 + 16, ld);
  }
  for (int64_t r = 0; r < kTokens; ++r) {
    float* row = o + r * P.dim;
    const float* add = pv + r * P.dim;
    if (rescale && sc.alpha[r] != 1.f) {
      const __m512 a = _mm512_set1_ps(sc.alpha[r]);
      for (int64_t d = 0; d < P.dim; d += 16)
        _mm512_storeu_ps(row + d, _mm512_fmadd_ps(_mm512_loadu_ps(row + d), a, _mm512_loadu_ps(add + d)));
    } else {
      for (int64_t d = 0; d < P.dim; d += 16)
        _mm512_storeu_ps(row + d, _mm512_add_ps(_mm512_loadu_ps(row + d), _mm512_loadu_ps(add + d)));
    }
  }
}

inline void attend(const Problem& P, const Item& w, Scratch& sc) {
  const int64_t G = P.group(), tiles = 2 * G;
  const int64_t start = P.query_start[w.seq], qlen = P.query_start[w.seq + 1] - start;
  const int64_t ctx = P.seq_lens[w.seq] - qlen;
  const int64_t ntok = std::min<int64_t>(kTokens, qlen - w.tok0);
  const int32_t* table = P.tables + w.seq * P.width;
  // Q rows of each row tile (zero past the chunk), O zeroed, running max -inf, sums 0.
  std::fill(sc.q.begin(), sc.q.end(), uint16_t(0));
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t head = w.kv_head * G + t / 2;
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t tok = w.tok0 + (t % 2) * kRows + r;
      if (tok - w.tok0 < ntok)
        std::memcpy(sc.q.data() + (t * kRows + r) * P.dim, P.q + (start + tok) * P.q_tok + head * P.q_head,
                    P.dim * sizeof(uint16_t));
    }
  }
  std::fill(sc.o.begin(), sc.o.end(), 0.f);
  std::fill(sc.m.begin(), sc.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(sc.l.begin(), sc.l.end(), 0.f);
  const int64_t last = ctx + w.tok0 + ntok - 1;  // the item's last position: keys up to it are read
  // K and V of every step packed first (at most max_model_len keys: a few hundred KB, in L2), then
  // each query head runs through all steps, its Q, O and softmax state staying in L1.
  const int64_t steps = last / kKeys + 1, k_size = P.dim / 32 * 4 * 512, v_size = 2 * (P.dim / 16) * 512;
  if (static_cast<int64_t>(sc.kp.size()) < steps * k_size) sc.kp.resize(steps * k_size);
  if (static_cast<int64_t>(sc.vp.size()) < steps * v_size) sc.vp.resize(steps * v_size);
  for (int64_t i = 0; i < steps; ++i) {
    pack_k(P, table, w.kv_head, i * kKeys, sc.kp.data() + i * k_size);
    pack_v(P, table, w.kv_head, i * kKeys, std::min<int64_t>(kKeys, last + 1 - i * kKeys), sc.vp.data() + i * v_size);
  }
  for (int64_t g = 0; g < G; ++g) {
    const int64_t row0 = g * kTokens;
    for (int64_t i = 0; i < steps; ++i)
      head_step(P, sc, sc.kp.data() + i * k_size, sc.vp.data() + i * v_size, sc.q.data() + row0 * P.dim,
                sc.o.data() + row0 * P.dim, sc.m.data() + row0, sc.l.data() + row0 * 16, ctx + w.tok0, i * kKeys);
  }
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t head = w.kv_head * G + t / 2;
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t tok = w.tok0 + (t % 2) * kRows + r;
      if (tok - w.tok0 >= ntok) break;
      const float inv = 1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(sc.l.data() + (t * kRows + r) * 16));
      const float* orow = sc.o.data() + (t * kRows + r) * P.dim;
      uint16_t* dst = P.out + (start + tok) * P.o_tok + head * P.o_head;
      for (int64_t d = 0; d < P.dim; d += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(orow + d), _mm512_set1_ps(inv));
        _mm256_storeu_si256((__m256i*)(dst + d), (__m256i)_mm512_cvtneps_pbh(x));
      }
    }
  }
}

// Attention of the prompt chunks of sequences [first_seq, num_seqs), on torch's threads.
inline void run(const Problem& P, int64_t first_seq, int64_t num_seqs) {
  TORCH_CHECK(chariot_amx::tiles_permitted(), "the kernel could not get the AMX tile state from Linux (arch_prctl)");
  std::vector<Item> items;
  for (int64_t s = first_seq; s < num_seqs; ++s) {
    const int64_t qlen = P.query_start[s + 1] - P.query_start[s], ctx = P.seq_lens[s] - qlen;
    for (int64_t t0 = 0; t0 < qlen; t0 += kTokens)
      for (int64_t h = 0; h < P.kv_heads; ++h)
        items.push_back({int32_t(s), int32_t(h), int32_t(t0), ctx + std::min<int64_t>(t0 + kTokens, qlen)});
  }
  if (items.empty()) return;
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.keys > b.keys; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(std::max(1, at::get_num_threads()), items.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    chariot_amx::Tiles tiles;
    Scratch sc(P.group(), P.dim);
    for (int64_t i = next.fetch_add(1); i < static_cast<int64_t>(items.size()); i = next.fetch_add(1))
      attend(P, items[i], sc);
  });
}
#endif  // CHARIOT_PROMPT_AMX

}  // namespace chariot_prompt_amx

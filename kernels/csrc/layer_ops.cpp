// The element-wise parts of a decoder layer on the CPU, each one pass over memory.
//
// In eager PyTorch these are several passes each: SiLU reads the gate and writes a temporary that
// the multiply reads again; RMSNorm writes its normalised rows and then scales them by the weight;
// and `write_kv`'s `index_put_` by (block, slot) runs single-threaded through the generic indexing
// machinery. On a CPU prefill they cost more than a compiled graph spends on the same work
// (docs/kernels.md has the profile and the gain).
//
//   silu_and_mul(gate_up, out):   out[t][i] = silu(gate_up[t][i]) · gate_up[t][I + i]
//   rms_norm(x, weight, eps, out): out[t] = x[t] / sqrt(mean(x[t]²) + eps) · weight   (sum in fp32)
//   add_rms_norm(x, residual, weight, eps, out): x += residual, then out = rms_norm(x) (one pass)
//   write_kv(key, value, k_cache, v_cache, slots): each token's K/V rows into its cache slot
//   rope(q, k, cos, sin):          q and k rotated in place by each token's angles (HF `rotate_half`)
//
// SiLU·mul and RMSNorm take float32 or bfloat16 rows (computed in fp32, rounded where eager PyTorch
// rounds); write_kv copies rows of any dtype. Rows are shared out over torch's thread pool
// (at::parallel_for); each row is one vectorised pass.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vecw.h"
#include "vmath.h"

#ifndef CHARIOT_OPS_NAMESPACE
#define CHARIOT_OPS_NAMESPACE chariot_cpu_layer_ops
#endif

namespace {

namespace W = chariot_vecw;
using W::kW;
using W::vw;
constexpr float kLog2e = 1.4426950408889634f;

inline vw silu(vw g) {
  const vw e = chariot_vmath::exp2_of<vw, W::viw>(g * -kLog2e);  // exp(-g); 0 for g > 88, 2^127 cap below
  return g / (1.f + e);
}

// Loads and stores of a row's elements as fp32 lanes, and `round`: a value rounded to the storage
// type and back, so a kernel rounds where eager PyTorch would (an op's bf16 result is one rounding
// of its fp32 value: round to nearest even, NaN kept NaN). For fp32 all three are plain.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  static vw load(const float* p) { return W::load(p); }
  static void store(float* p, vw v) { W::store(p, v); }
  static vw round(vw v) { return v; }
  static float get(float x) { return x; }
  static float put(float x) { return x; }
};

template <>
struct Lanes<c10::BFloat16> {
  typedef uint16_t vh __attribute__((vector_size(2 * kW), aligned(2), may_alias));
  typedef uint32_t vu __attribute__((vector_size(4 * kW)));
  static vw load(const c10::BFloat16* p) {
    const vu wide = __builtin_convertvector(*reinterpret_cast<const vh*>(p), vu);
    return (vw)(wide << 16);
  }
  static vu rounded_bits(vw v) {  // the bf16 bits of v in the high half of each lane
    const vu bits = (vu)v;
    const vu even = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    const vu nan = vu{} + 0x7FC00000u;
    return v != v ? nan : even;
  }
  static void store(c10::BFloat16* p, vw v) {
    *reinterpret_cast<vh*>(p) = __builtin_convertvector(rounded_bits(v) >> 16, vh);
  }
  static vw round(vw v) { return (vw)rounded_bits(v); }
  static float get(c10::BFloat16 x) { return static_cast<float>(x); }
  static c10::BFloat16 put(float x) { return c10::BFloat16(x); }
};

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16), name,
              " must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with unit stride along its last dimension");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* name_a, const char* name_b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), name_b, " must have ", name_a, "'s dtype (", a.scalar_type(),
              "), got ", b.scalar_type());
}

// out = silu(gate) · up, rounded as eager PyTorch's `F.silu(gate).mul_(up)` rounds (silu first).
template <typename T>
void silu_and_mul_rows(const at::Tensor& gate_up, const at::Tensor& out) {
  using L = Lanes<T>;
  const int64_t rows = gate_up.size(0), width = out.size(1);
  const T* src = gate_up.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t ld_in = gate_up.stride(0), ld_out = out.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = src + t * ld_in;
      const T* u = g + width;
      T* o = dst + t * ld_out;
      int64_t i = 0;
      for (; i + kW <= width; i += kW) L::store(o + i, L::round(silu(L::load(g + i))) * L::load(u + i));
      for (; i < width; ++i) {
        const float x = L::get(g[i]);
        o[i] = L::put(L::get(L::put(x / (1.f + std::exp(-x)))) * L::get(u[i]));  // silu rounded to T first
      }
    }
  });
}

void silu_and_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  check_same_dtype(gate_up, out, "gate_up", "out");
  TORCH_CHECK(gate_up.size(1) == 2 * out.size(1) && out.size(0) == gate_up.size(0),
              "out must be [rows, gate_up.size(1) / 2], got ", out.sizes(), " for gate_up ", gate_up.sizes());
  if (gate_up.scalar_type() == at::kFloat)
    silu_and_mul_rows<float>(gate_up, out);
  else
    silu_and_mul_rows<c10::BFloat16>(gate_up, out);
}

// One row: o = round(r · inv_rms) · w, normalised in fp32, rounded to T, then scaled (Hugging Face's order).
template <typename T>
inline void rms_norm_row(const T* r, const T* w, T* o, int64_t width, float epsilon) {
  using L = Lanes<T>;
  vw acc = {};
  int64_t i = 0;
  for (; i + kW <= width; i += kW) {
    const vw v = L::load(r + i);
    acc += v * v;
  }
  float sum = 0.f;
  for (int lane = 0; lane < kW; ++lane) sum += acc[lane];
  for (; i < width; ++i) sum += L::get(r[i]) * L::get(r[i]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + epsilon);
  const vw scale = W::splat(inv);
  for (i = 0; i + kW <= width; i += kW) L::store(o + i, L::round(L::load(r + i) * scale) * L::load(w + i));
  for (; i < width; ++i) o[i] = L::put(L::get(L::put(L::get(r[i]) * inv)) * L::get(w[i]));
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, float epsilon, const at::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* src = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t ld_in = x.stride(0), ld_out = out.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row(src + t * ld_in, w, dst + t * ld_out, width, epsilon);
  });
}

// x += residual, rounded to T as eager `add_` rounds, then out = the row's RMSNorm of the sum: one
// pass over the residual stream where `add_` and `rms_norm` make two, the same bits as both.
template <typename T>
void add_rms_norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, float epsilon,
                       const at::Tensor& out) {
  using L = Lanes<T>;
  const int64_t rows = x.size(0), width = x.size(1);
  T* sum = x.data_ptr<T>();
  const T* res = residual.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t ld_x = x.stride(0), ld_res = residual.stride(0), ld_out = out.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* r = sum + t * ld_x;
      const T* a = res + t * ld_res;
      int64_t i = 0;
      for (; i + kW <= width; i += kW) L::store(r + i, L::load(r + i) + L::load(a + i));
      for (; i < width; ++i) r[i] = L::put(L::get(r[i]) + L::get(a[i]));
      rms_norm_row(r, w, dst + t * ld_out, width, epsilon);  // the row is still in L1
    }
  });
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out) {
  check_rows(x, "x");
  check_rows(out, "out");
  check_same_dtype(x, out, "x", "out");
  check_same_dtype(x, weight, "x", "weight");
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be a contiguous CPU tensor of ", x.size(1), " elements");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must be shaped like x");
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows<float>(x, weight, static_cast<float>(eps), out);
  else
    rms_norm_rows<c10::BFloat16>(x, weight, static_cast<float>(eps), out);
}

void add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                  const at::Tensor& out) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_rows(out, "out");
  check_same_dtype(x, residual, "x", "residual");
  check_same_dtype(x, out, "x", "out");
  check_same_dtype(x, weight, "x", "weight");
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be a contiguous CPU tensor of ", x.size(1), " elements");
  TORCH_CHECK(residual.sizes() == x.sizes() && out.sizes() == x.sizes(), "residual and out must be shaped like x");
  TORCH_CHECK(!out.is_same(x) && !out.is_same(residual), "out must be a tensor of its own");
  if (x.scalar_type() == at::kFloat)
    add_rms_norm_rows<float>(x, residual, weight, static_cast<float>(eps), out);
  else
    add_rms_norm_rows<c10::BFloat16>(x, residual, weight, static_cast<float>(eps), out);
}

// One head's row x [D] rotated in place by its token's cos, sin [D] (half = D / 2), rounded as eager
// PyTorch's `x·cos + rotate_half(x)·sin` rounds: each product, then the sum. No multiply-add is
// fused (fp-contract off), so fp32 matches PyTorch bit for bit too.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_row(T* x, const T* cos, const T* sin, int64_t half) {
  using L = Lanes<T>;
  int64_t i = 0;
  for (; i + kW <= half; i += kW) {
    const vw a = L::load(x + i), b = L::load(x + half + i);
    const vw lo = L::round(a * L::load(cos + i)) - L::round(b * L::load(sin + i));
    const vw hi = L::round(b * L::load(cos + half + i)) + L::round(a * L::load(sin + half + i));
    L::store(x + i, lo), L::store(x + half + i, hi);
  }
  for (; i < half; ++i) {
    const float a = L::get(x[i]), b = L::get(x[half + i]);
    const auto r = [](float v) { return L::get(L::put(v)); };
    const float lo = r(a * L::get(cos[i])) - r(b * L::get(sin[i]));
    const float hi = r(b * L::get(cos[half + i])) + r(a * L::get(sin[half + i]));
    x[i] = L::put(lo), x[half + i] = L::put(hi);
  }
}

template <typename T>
void rope_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = q.size(0), half = q.size(2) / 2;
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  const int64_t heads = q.size(1) + k.size(1), grain = std::max<int64_t>(1, 256 / heads);  // rows per task
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (const at::Tensor* x : {&q, &k}) {
        T* base = x->data_ptr<T>() + t * x->stride(0);
        for (int64_t h = 0; h < x->size(1); ++h)
          rope_row(base + h * x->stride(1), c + t * cos.stride(0), s + t * sin.stride(0), half);
      }
  });
}

void rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* x : {&q, &k})
    TORCH_CHECK(x->device().is_cpu() && x->dim() == 3 && x->stride(2) == 1 && x->size(0) == q.size(0) &&
                    x->size(2) == q.size(2) && x->size(2) % 2 == 0,
                "q and k must be CPU tensors [tokens, heads, head_dim] of one token count and an even head_dim, "
                "unit stride along head_dim");
  for (const at::Tensor* t : {&cos, &sin}) {
    check_rows(*t, "cos and sin");
    TORCH_CHECK(t->size(0) == q.size(0) && t->size(1) == q.size(2), "cos and sin must be [tokens, head_dim] = [",
                q.size(0), ", ", q.size(2), "], got ", t->sizes());
  }
  check_same_dtype(q, k, "q", "k");
  check_same_dtype(q, cos, "q", "cos");
  check_same_dtype(q, sin, "q", "sin");
  if (q.scalar_type() == at::kFloat)
    rope_rows<float>(q, k, cos, sin);
  else
    rope_rows<c10::BFloat16>(q, k, cos, sin);
}

template <typename index_t>
void copy_rows(const at::Tensor& src, const at::Tensor& cache, const index_t* slots, int64_t tokens) {
  const int64_t heads = src.size(1), row_bytes = src.size(2) * src.element_size();
  const int64_t block_size = cache.size(1), capacity = cache.size(0) * block_size;
  const char* base = static_cast<const char*>(src.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  const int64_t es = src.element_size();
  const int64_t s_tok = src.stride(0) * es, s_head = src.stride(1) * es;
  const int64_t c_block = cache.stride(0) * es, c_slot = cache.stride(1) * es, c_head = cache.stride(2) * es;
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, "slot_mapping[", t, "] = ", static_cast<int64_t>(slots[t]),
                " is outside the cache's ", capacity, " slots");
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      char* row = dst + (slot / block_size) * c_block + (slot % block_size) * c_slot;
      for (int64_t h = 0; h < heads; ++h) std::memcpy(row + h * c_head, base + t * s_tok + h * s_head, row_bytes);
    }
  });
}

void check_kv(const at::Tensor& src, const at::Tensor& cache, const char* name, const char* cache_name) {
  TORCH_CHECK(src.device().is_cpu() && cache.device().is_cpu(), name, " and ", cache_name, " must be CPU tensors");
  TORCH_CHECK(src.dim() == 3 && src.stride(2) == 1, name, " must be [tokens, kv_heads, head_dim] with unit stride");
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1 && cache.size(2) == src.size(1) && cache.size(3) == src.size(2),
              cache_name, " must be [blocks, block_size, kv_heads, head_dim] matching ", name, ", got ", cache.sizes());
  TORCH_CHECK(src.scalar_type() == cache.scalar_type(), name, " must have ", cache_name, "'s dtype");
}

void write_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  check_kv(key, k_cache, "key", "k_cache");
  check_kv(value, v_cache, "value", "v_cache");
  const int64_t tokens = key.size(0);
  TORCH_CHECK(value.size(0) == tokens && slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                  slot_mapping.is_contiguous() && slot_mapping.device().is_cpu(),
              "slot_mapping must be a contiguous CPU tensor of one slot per token (", tokens, ")");
  if (slot_mapping.scalar_type() == at::kLong) {
    copy_rows(key, k_cache, slot_mapping.data_ptr<int64_t>(), tokens);
    copy_rows(value, v_cache, slot_mapping.data_ptr<int64_t>(), tokens);
  } else {
    TORCH_CHECK(slot_mapping.scalar_type() == at::kInt, "slot_mapping must be int64 or int32");
    copy_rows(key, k_cache, slot_mapping.data_ptr<int32_t>(), tokens);
    copy_rows(value, v_cache, slot_mapping.data_ptr<int32_t>(), tokens);
  }
}

}  // namespace

TORCH_LIBRARY(CHARIOT_OPS_NAMESPACE, m) {
  m.def("silu_and_mul(Tensor gate_up, Tensor(a!) out) -> ()", &silu_and_mul);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()", &rms_norm);
  m.def("add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps, Tensor(b!) out) -> ()", &add_rms_norm);
  m.def("rope(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()", &rope);
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
        &write_kv);
}

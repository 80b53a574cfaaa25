// Paged varlen attention on the CPU that reads K/V blocks in place through the block table.
//
// One call covers a whole iteration (decodes and prefill chunks): work items are
// (sequence, query tile, KV head) and run in parallel; each keeps the query rows of its tile for
// all query heads of its GQA group, so every K/V row it loads serves the whole group. Softmax is
// online (flash style) with fp32 accumulation; positions at or past a sequence's length, and
// positions after a query's own (causality), are never read.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kTileQ = 16;

struct WorkItem {
  int64_t seq;
  int64_t q_begin;  // first query row of the tile, relative to the sequence's first new token
  int64_t q_end;
};

template <typename T>
inline float as_float(const T* p) { return static_cast<float>(*p); }

template <typename scalar_t>
struct Problem {
  const scalar_t* q; const scalar_t* k; const scalar_t* v; scalar_t* out;
  const int32_t* query_start; const int32_t* seq_lens; const int32_t* tables;
  int64_t table_stride, heads, kv_heads, dim, block_size;
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;
  int64_t c_stride_b, c_stride_s, c_stride_h;
  float scale;
};

template <typename scalar_t>
void attend(const Problem<scalar_t>& P, const WorkItem& w, int64_t kvh,
            std::vector<float>& qf, std::vector<float>& acc, std::vector<float>& scores,
            std::vector<float>& blocks) {
  const int64_t group = P.heads / P.kv_heads, D = P.dim, bs = P.block_size;
  const int64_t start = P.query_start[w.seq];
  const int64_t qlen = P.query_start[w.seq + 1] - start;
  const int64_t ctx_before = P.seq_lens[w.seq] - qlen;
  const int64_t rows = (w.q_end - w.q_begin) * group;
  qf.assign(rows * D, 0.f); acc.assign(rows * D, 0.f); scores.assign(rows * bs, 0.f);
  blocks.resize(2 * D * bs);
  std::vector<float> m(rows, -std::numeric_limits<float>::infinity()), l(rows, 0.f);
  std::vector<int64_t> pos(rows);
  for (int64_t i = w.q_begin; i < w.q_end; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (i - w.q_begin) * group + g;
      pos[r] = ctx_before + i;
      const scalar_t* src = P.q + (start + i) * P.q_stride_t + (kvh * group + g) * P.q_stride_h;
      for (int64_t d = 0; d < D; ++d) qf[r * D + d] = as_float(src + d) * P.scale;
    }
  }
  const int64_t last_key = ctx_before + w.q_end - 1;
  const int32_t* table = P.tables + w.seq * P.table_stride;
  float* kt = blocks.data();           // this block's keys, transposed: [D][bs]
  float* vb = blocks.data() + D * bs;  // this block's values: [bs][D]
  for (int64_t b0 = 0; b0 <= last_key; b0 += bs) {
    const int64_t n = std::min(bs, last_key + 1 - b0);
    const int64_t base = static_cast<int64_t>(table[b0 / bs]) * P.c_stride_b + kvh * P.c_stride_h;
    for (int64_t t = 0; t < n; ++t) {  // one load (and conversion) per K/V row, for the whole group
      const scalar_t* key = P.k + base + t * P.c_stride_s;
      const scalar_t* val = P.v + base + t * P.c_stride_s;
      for (int64_t d = 0; d < D; ++d) {
        kt[d * bs + t] = as_float(key + d);
        vb[t * D + d] = as_float(val + d);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(n, pos[r] - b0 + 1);  // causal: keys after the query are not read
      if (visible <= 0) continue;
      float* sr = scores.data() + r * bs;
      const float* qr = qf.data() + r * D;
      std::fill(sr, sr + bs, 0.f);
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qr[d];
        const float* kd = kt + d * bs;
#pragma omp simd
        for (int64_t t = 0; t < bs; ++t) sr[t] += qd * kd[t];
      }
      float block_max = sr[0];
      for (int64_t t = 1; t < visible; ++t) block_max = std::max(block_max, sr[t]);
      const float new_m = std::max(m[r], block_max);
      const float factor = std::exp(m[r] - new_m);  // exp(-inf) = 0 on the first block
      float* ar = acc.data() + r * D;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < visible; ++t) { sr[t] = expf(sr[t] - new_m); sum += sr[t]; }
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ar[d] *= factor;
      for (int64_t t = 0; t < visible; ++t) {
        const float p = sr[t];
        const float* vt = vb + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] += p * vt[d];
      }
      l[r] = l[r] * factor + sum;
      m[r] = new_m;
    }
  }
  for (int64_t i = w.q_begin; i < w.q_end; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = (i - w.q_begin) * group + g;
      scalar_t* dst = P.out + (start + i) * P.o_stride_t + (kvh * group + g) * P.o_stride_h;
      const float inv = 1.f / l[r];
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[r * D + d] * inv);
    }
  }
}

std::vector<WorkItem> work_items(const int32_t* query_start, int64_t num_seqs) {
  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = query_start[s + 1] - query_start[s];
    for (int64_t b = 0; b < qlen; b += kTileQ) items.push_back({s, b, std::min(qlen, b + kTileQ)});
  }
  return items;
}

template <typename scalar_t>
void run(const Problem<scalar_t>& P, int64_t num_seqs) {
  const std::vector<WorkItem> items = work_items(P.query_start, num_seqs);
  const int64_t total = static_cast<int64_t>(items.size()) * P.kv_heads;
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores, blocks;
    for (int64_t idx = begin; idx < end; ++idx) {
      attend(P, items[idx / P.kv_heads], idx % P.kv_heads, qf, acc, scores, blocks);
    }
  });
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens,
                              torch::Tensor block_tables, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4, "query [T, H, D] and cache [blocks, block, KVH, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(), "K/V caches differ");
  TORCH_CHECK(query.stride(2) == 1 && k_cache.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type(), "cache and query dtypes differ");
  auto qsl = query_start_loc.to(torch::kInt32).contiguous();
  auto lens = seq_lens.to(torch::kInt32).contiguous();
  auto tables = block_tables.to(torch::kInt32).contiguous();
  auto out = torch::empty_like(query);
  const int64_t num_seqs = lens.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    Problem<scalar_t> P{query.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), qsl.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                        tables.data_ptr<int32_t>(), tables.size(1), query.size(1), k_cache.size(2),
                        query.size(2), k_cache.size(1), query.stride(0), query.stride(1), out.stride(0),
                        out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                        static_cast<float>(scale)};
    run(P, num_seqs);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged varlen attention reading K/V blocks in place");
}

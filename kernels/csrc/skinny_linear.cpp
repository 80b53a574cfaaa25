// y = x Wᵀ (+ b) for a few rows of x on the CPU, reading the weight W [N, K] in its plain row-major layout.
//
// Decode iterations multiply a handful of rows (one per running sequence) by every weight matrix,
// so they are bound by streaming the weights from memory, not by FLOPs. oneDNN reaches the memory
// bandwidth for one row but not for 2–16 (docs/BENCHMARKS.md, "CPU linear layers"). This kernel is
// written for that range: each thread streams its own output rows of W exactly once, four at a time,
// and computes them against every row of x while they are in L1/L2 (x itself stays in L2).
// Dot products run along K in 8-lane vectors (K contiguous in both operands, so no packing and no
// second copy of the weights); the 8-lane partial sums are reduced once per output at the end.
// More than three rows of x take several passes over a block of W, and only the first pass reads
// memory; so every pass requests a share of the *next* block's cache lines as it goes (`Lines`),
// which keeps the memory busy through the passes that compute from cache. Without it 4–16 rows ran
// at a fraction of the bandwidth one row reaches (the passes and the stream took turns).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "vec8.h"

#ifndef CHARIOT_OPS_NAMESPACE
#define CHARIOT_OPS_NAMESPACE chariot_cpu_linear
#endif

namespace {

using namespace chariot_vec8;

// The cache lines of the next block of W, requested `per_step` at a time from inside the k loops.
struct Lines {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
};

// y[m][n] = Σ_k x[m][k] · w[n][k] (+ bias[n]) for MB rows of x and NB rows of w; K is a multiple of 8.
// The accumulators stay in registers only while nothing takes their address: reducing them through
// an array (`lane_sums`) made GCC keep all MB × NB vectors on the stack and store them on every
// step of k, which capped the kernel at a third of the FMA rate.
template <int MB, int NB>
inline void block(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y, int64_t ldy,
                  Lines& ahead) {
  vf c[MB][NB] = {};
  const char* next = ahead.next;
  for (int64_t k = 0; k < K; k += kLanes) {
    for (int64_t i = 0; i < ahead.per_step && next < ahead.end; ++i, next += 64) prefetch_from_register(next);
    vf b[NB];
    for (int n = 0; n < NB; ++n) b[n] = load(w + n * K + k);
    for (int m = 0; m < MB; ++m) {
      const vf a = load(x + m * ldx + k);
      for (int n = 0; n < NB; ++n) c[m][n] += a * b[n];
    }
  }
  ahead.next = next;
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) y[m * ldy + n] = lane_sum(c[m][n]) + (bias ? bias[n] : 0.f);
}

// Every row of x against NB rows of w: blocks of 3 rows of x (12 accumulators), then the rest;
// meanwhile the `next_rows` rows of W after these are requested from memory, spread over every pass.
template <int NB>
inline void all_rows(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* y, int64_t N,
                     int64_t next_rows) {
  const int64_t passes = (M + 2) / 3, steps = passes * (K / kLanes), lines = next_rows * K * 4 / 64;
  Lines ahead{reinterpret_cast<const char*>(w + NB * K), reinterpret_cast<const char*>(w + (NB + next_rows) * K),
              (lines + steps - 1) / std::max<int64_t>(steps, 1)};
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) block<3, NB>(x + m * K, K, w, K, bias, y + m * N, N, ahead);
  if (M - m == 2) block<2, NB>(x + m * K, K, w, K, bias, y + m * N, N, ahead);
  if (M - m == 1) block<1, NB>(x + m * K, K, w, K, bias, y + m * N, N, ahead);
}

void skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                   const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu(), "skinny_linear runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "skinny_linear needs float32 tensors");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(),
              "x [M, K], weight [N, K] and out [M, N] must be contiguous matrices");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K && K % kLanes == 0, "weight must be [N, ", K, "] with K a multiple of 8");
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must be [", M, ", ", N, "]");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias must be [N] float32");
    b = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  constexpr int64_t NB = 4;
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      all_rows<NB>(xp, M, K, wp + i * NB * K, b ? b + i * NB : nullptr, yp + i * NB, N, i + 1 < end ? NB : 0);
  });
  for (int64_t n = blocks * NB; n < N; ++n) all_rows<1>(xp, M, K, wp + n * K, b ? b + n : nullptr, yp + n, N, 0);
}

}  // namespace

TORCH_LIBRARY(CHARIOT_OPS_NAMESPACE, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()", &skinny_linear);
}

// y = x Wᵀ (+ b) in float32 on the CPU, on a weight packed into panels, for any number of rows.
//
// Decode steps of 8-32 sequences multiply that many rows by every weight. The skinny kernel
// (skinny_linear.cpp) reduces along K inside 8-lane registers and reads each block of W once per
// pass of 3 rows; from about 12 rows it runs at half the FMA rate of an AVX2 core and well under
// the memory's (docs/kernels.md). Here the outputs are in the vector lanes instead:
// W is packed once into panels of 16 outputs, [N/16][K][16], so one step of k loads two vectors of
// W (16 outputs) and multiplies them by up to six rows of x, each broadcast from memory: 12 FMAs
// into 12 accumulators per two loads of W and six broadcasts, and no reduction across lanes. Each
// thread takes a contiguous range of panels, so W is one sequential stream per thread; the panel
// two ahead is requested into L2 a line at a time, spread over all the passes of the current one,
// so the passes compute from L2 while memory streams (`streamed`). Input rows are packed per call
// into groups of six, [K][6], so a pass's broadcasts read adjacent values.
//
// Prefill chunks (hundreds of rows) are bound by the FMAs instead, and take the classic blocked
// order (`blocked`): 256 steps of one panel (16 KiB, held in L1) against every group of a block of
// 96 rows (held in L2), the partial sums added up in y, whose lines are requested at the start of
// each tile so they arrive while the FMAs run (without those requests the order falls back to
// about oneDNN's rate; docs/kernels.md has the measurements).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "vec8.h"

#ifndef CHARIOT_OPS_NAMESPACE
#define CHARIOT_OPS_NAMESPACE chariot_cpu_panel_linear
#endif

namespace {

using namespace chariot_vec8;

constexpr int64_t kPanel = 16;  // outputs per panel: two 8-lane vectors
constexpr int kRowsPerPass = 6;  // 12 accumulators + 2 W vectors + 1 broadcast: 15 of AVX2's 16 registers
constexpr int64_t kAhead = 2;    // how many panels ahead the passes request into L2
constexpr int64_t kStreamRows = 64;  // up to this many rows `streamed`, more `blocked`
constexpr int64_t kDepth = 256;  // steps of k per block in `blocked`: a panel's block is 16 KiB, held in L1
constexpr int64_t kGroupsPerBlock = 16;  // row groups per block in `blocked`: 96 rows x 256 x 4 B = 96 KiB, in L2
constexpr int64_t kUnitPanels = 8;  // panels per unit of work at most (`for_each_unit`)
constexpr int64_t kUnitsPerThread = 4;  // units per thread at least, where there are enough panels

// The next panel's cache lines, requested into L2 one per `every` steps of k over all the passes of
// the panel before it, so the memory stays busy while the passes compute from cache.
struct Ahead {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t every = 1;
};

// Rows [0, MR) of one group of x (packed [K][6], from step k0) times depth steps of one panel (from
// the same step), into y[m][0..cols): the product (+ bias) on the first block of depth, added to y on
// the later ones. With kStream, the next panels are requested into L2 along the way (`Ahead`).
template <int MR, bool kStream>
inline void tile(const float* a, const float* b, int64_t depth, const float* bias, bool first, float* y,
                 int64_t ldy, int64_t cols, Ahead* ahead) {
  vf lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = vf{};
  for (int m = 0; m < MR; ++m) prefetch_from_register(y + m * ldy);  // y's lines arrive while the FMAs run
  const char* next = kStream ? ahead->next : nullptr;
  int64_t countdown = kStream ? ahead->every : 0;
  for (int64_t k = 0; k < depth; ++k) {
    if (kStream && --countdown == 0) {
      countdown = ahead->every;
      if (next < ahead->end) prefetch_l2_from_register(next);
      next += 64;
    }
    const vf b0 = load(b + k * kPanel), b1 = load(b + k * kPanel + 8);
    const float* ak = a + k * kRowsPerPass;
    for (int m = 0; m < MR; ++m) {
      const vf am = splat(ak[m]);
      lo[m] += am * b0;
      hi[m] += am * b1;
    }
  }
  if (kStream) ahead->next = next;
  const vf bias_lo = first && bias ? load(bias) : vf{}, bias_hi = first && bias ? load(bias + 8) : vf{};
  for (int m = 0; m < MR; ++m) {
    float* row = y + m * ldy;
    if (cols == kPanel) {
      store(row, lo[m] + (first ? bias_lo : load(row)));
      store(row + 8, hi[m] + (first ? bias_hi : load(row + 8)));
    } else {  // the last panel of an N that is not a multiple of 16
      float part[kPanel];
      store(part, lo[m] + bias_lo);
      store(part + 8, hi[m] + bias_hi);
      for (int64_t j = 0; j < cols; ++j) row[j] = first ? part[j] : row[j] + part[j];
    }
  }
}

// One group of `rows` (1-6) rows: `tile` for that many accumulators.
template <bool kStream>
inline void group(int64_t rows, const float* a, const float* b, int64_t depth, const float* bias, bool first,
                  float* y, int64_t ldy, int64_t cols, Ahead* ahead) {
  switch (rows) {
    case 6: return tile<6, kStream>(a, b, depth, bias, first, y, ldy, cols, ahead);
    case 5: return tile<5, kStream>(a, b, depth, bias, first, y, ldy, cols, ahead);
    case 4: return tile<4, kStream>(a, b, depth, bias, first, y, ldy, cols, ahead);
    case 3: return tile<3, kStream>(a, b, depth, bias, first, y, ldy, cols, ahead);
    case 2: return tile<2, kStream>(a, b, depth, bias, first, y, ldy, cols, ahead);
    case 1: return tile<1, kStream>(a, b, depth, bias, first, y, ldy, cols, ahead);
    default: return;
  }
}

inline int64_t rows_of(int64_t g, int64_t M) { return std::min<int64_t>(kRowsPerPass, M - g * kRowsPerPass); }

// Up to kStreamRows rows (decode steps), bound by reading W: panel by panel, each panel's whole
// depth meets every group of rows, so W streams once per call with the next panels requested ahead.
void streamed(const float* xpack, int64_t M, int64_t K, const float* wp, const float* bias, float* y, int64_t N,
              int64_t begin, int64_t end) {
  const int64_t groups = (M + kRowsPerPass - 1) / kRowsPerPass, panel_floats = K * kPanel;
  Ahead ahead{reinterpret_cast<const char*>(wp + std::min(begin + kAhead, end) * panel_floats),
              reinterpret_cast<const char*>(wp + end * panel_floats), std::max<int64_t>(1, groups)};
  for (int64_t p = begin; p < end; ++p)
    for (int64_t g = 0; g < groups; ++g)
      group<true>(rows_of(g, M), xpack + g * kRowsPerPass * K, wp + p * panel_floats, K,
                  bias ? bias + p * kPanel : nullptr, true, y + g * kRowsPerPass * N + p * kPanel, N,
                  std::min(kPanel, N - p * kPanel), &ahead);
}

// More rows (prefill chunks), bound by the FMAs: the classic blocked order. Over blocks of depth,
// then blocks of row groups (held in L2), each panel's depth block (held in L1) meets every group
// of the row block.
void blocked(const float* xpack, int64_t M, int64_t K, const float* wp, const float* bias, float* y, int64_t N,
             int64_t begin, int64_t end) {
  const int64_t groups = (M + kRowsPerPass - 1) / kRowsPerPass;
  const int64_t blocks = (K + kDepth - 1) / kDepth, depth_step = (K + blocks - 1) / blocks;
  for (int64_t k0 = 0; k0 < K; k0 += depth_step) {
    const int64_t depth = std::min(depth_step, K - k0);
    for (int64_t g0 = 0; g0 < groups; g0 += kGroupsPerBlock) {
      for (int64_t p = begin; p < end; ++p) {
        const float* b = wp + (p * K + k0) * kPanel;
        for (int64_t g = g0; g < std::min(groups, g0 + kGroupsPerBlock); ++g)
          group<false>(rows_of(g, M), xpack + (g * K + k0) * kRowsPerPass, b, depth,
                       bias ? bias + p * kPanel : nullptr, k0 == 0, y + g * kRowsPerPass * N + p * kPanel, N,
                       std::min(kPanel, N - p * kPanel), nullptr);
      }
    }
  }
}

// Runs f(begin, end) over every range of panels, handed out a unit at a time from a shared counter
// rather than split in one range per thread: when the OS or the hypervisor takes a thread off its core
// (the server's other processes, a neighbour's vCPU), the other threads take the rest of the work
// instead of waiting for it at the end of the call. A unit is at most kUnitPanels panels and there are
// at least kUnitsPerThread per thread. For prefill chunks (`blocked`) only: in the streamed order
// (few rows, bound by reading W) each unit would restart the stream of requests ahead, which costs
// more than the balance gains (docs/kernels.md has the paired measurements).
template <class F>
void for_each_unit(int64_t panels, F&& f) {
  const int64_t threads = at::get_num_threads();
  const int64_t unit = std::clamp<int64_t>(panels / (kUnitsPerThread * threads), 1, kUnitPanels);
  const int64_t units = (panels + unit - 1) / unit;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, units), 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1))
      f(u * unit, std::min(panels, (u + 1) * unit));
  });
}

// x [M, K] -> groups of six rows, each [K][6] (a group's k-th values adjacent, so one pass's
// broadcasts read one cache line per 2.7 steps of k instead of six rows 4 KiB apart).
void pack_rows(const float* x, int64_t M, int64_t K, float* out) {
  const int64_t groups = (M + kRowsPerPass - 1) / kRowsPerPass;
  at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin * kRowsPerPass; g < end * kRowsPerPass; g += kRowsPerPass) {
      const int64_t rows = std::min<int64_t>(kRowsPerPass, M - g);
      float* dst = out + g * K;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t r = 0; r < rows; ++r) dst[k * kRowsPerPass + r] = x[(g + r) * K + k];
    }
  });
}

// weight [N, K] -> out [ceil(N/16), K, 16] (zeroed by the caller, so the outputs past N stay zero).
void pack_panels(const at::Tensor& weight, const at::Tensor& out) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous(), "pack_panels needs a contiguous float32 [N, K] weight on the CPU");
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3 && out.size(0) == panels &&
                  out.size(1) == K && out.size(2) == kPanel, "out must be float32 [", panels, ", ", K, ", 16]");
  const float* src = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + j] = src[(p * kPanel + j) * K + k];
  });
}

void panel_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                  const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && out.device().is_cpu(), "panel_linear runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "panel_linear needs float32 tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous(),
              "x [M, K] and out [M, N] must be contiguous matrices");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel,
              "panels must be pack_panels' [ceil(N/16), K, 16]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(panels.size(1) == K && panels.size(0) == (N + kPanel - 1) / kPanel && out.size(0) == M,
              "panels [", panels.size(0), ", ", panels.size(1), ", 16] do not fit x [", M, ", ", K, "] and out [",
              out.size(0), ", ", N, "]");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {  // padded to whole panels, so the last panel loads whole vectors
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == panels.size(0) * kPanel,
                "bias must be float32 [", panels.size(0) * kPanel, "] (N padded to whole panels of 16)");
    b = bias->data_ptr<float>();
  }
  const float* wp = panels.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  std::vector<float> xpack(((M + kRowsPerPass - 1) / kRowsPerPass) * kRowsPerPass * K);
  pack_rows(x.data_ptr<float>(), M, K, xpack.data());
  const float* xp = xpack.data();
  if (M > kStreamRows)
    for_each_unit(panels.size(0), [&](int64_t begin, int64_t end) { blocked(xp, M, K, wp, b, yp, N, begin, end); });
  else  // one range per thread: each thread's stream of W and its requests ahead run unbroken
    at::parallel_for(0, panels.size(0), 4, [&](int64_t begin, int64_t end) { streamed(xp, M, K, wp, b, yp, N, begin, end); });
}

}  // namespace

TORCH_LIBRARY(CHARIOT_OPS_NAMESPACE, m) {
  m.def("pack_panels(Tensor weight, Tensor(a!) out) -> ()", &pack_panels);
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, Tensor(a!) out) -> ()", &panel_linear);
}

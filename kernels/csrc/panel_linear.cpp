// y = x Wᵀ (+ b) in float32 for a few dozen rows of x on the CPU, on a weight packed into panels.
//
// Decode steps of 8-32 sequences multiply that many rows by every weight. The skinny kernel
// (skinny_linear.cpp) reduces along K inside 8-lane registers and reads each block of W once per
// pass of 3 rows; from about 12 rows it runs at half the FMA rate of an AVX2 core and well under
// the memory's (docs/BENCHMARKS.md, session 15). Here the outputs are in the vector lanes instead:
// W is packed once into panels of 16 outputs, [N/16][K][16], so one step of k loads two vectors of
// W (16 outputs) and multiplies them by up to six rows of x, each broadcast from memory: 12 FMAs
// into 12 accumulators per two loads of W and six broadcasts, and no reduction across lanes. Each
// thread takes a contiguous range of panels, so W is one sequential stream per thread; the panel
// two ahead is requested into L2 a line at a time, spread over all the passes of the current one,
// so the passes compute from L2 while memory streams. Input rows are packed per call into groups
// of six, [K][6], so a pass's broadcasts read adjacent values.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
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

// The next panel's cache lines, requested into L2 one per `every` steps of k over all the passes of
// the panel before it, so the memory stays busy while the passes compute from cache.
struct Ahead {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t every = 1;
};

// Rows [0, MR) of x, packed [K][kRowsPerPass], against one panel:
// y[m][0..cols) = Σ_k x[k][m] · panel[k][·] (+ bias).
template <int MR>
inline void pass(const float* xpack, const float* panel, int64_t K, const float* bias, float* y, int64_t ldy,
                 int64_t cols, Ahead& ahead) {
  vf lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) lo[m] = hi[m] = vf{};
  const char* next = ahead.next;
  int64_t countdown = ahead.every;
  for (int64_t k = 0; k < K; ++k) {
    if (--countdown == 0) {
      countdown = ahead.every;
      if (next < ahead.end) prefetch_l2_from_register(next);
      next += 64;
    }
    const vf b0 = load(panel + k * kPanel), b1 = load(panel + k * kPanel + 8);
    const float* a = xpack + k * kRowsPerPass;
    for (int m = 0; m < MR; ++m) {
      const vf am = splat(a[m]);
      lo[m] += am * b0;
      hi[m] += am * b1;
    }
  }
  ahead.next = next;
  const vf bias_lo = bias ? load(bias) : vf{}, bias_hi = bias ? load(bias + 8) : vf{};
  for (int m = 0; m < MR; ++m) {
    float* row = y + m * ldy;
    if (cols == kPanel) {
      store(row, lo[m] + bias_lo);
      store(row + 8, hi[m] + bias_hi);
    } else {  // the last panel of an N that is not a multiple of 16
      float tmp[kPanel];
      store(tmp, lo[m] + bias_lo);
      store(tmp + 8, hi[m] + bias_hi);
      std::copy(tmp, tmp + cols, row);
    }
  }
}

// Every row of x (packed by `pack_rows`) against one panel, in passes of six rows and then the rest.
inline void all_rows(const float* xpack, int64_t M, int64_t K, const float* panel, const float* bias, float* y,
                     int64_t N, int64_t cols, Ahead& ahead) {
  int64_t m = 0;
  for (; m + kRowsPerPass <= M; m += kRowsPerPass)
    pass<kRowsPerPass>(xpack + m * K, panel, K, bias, y + m * N, N, cols, ahead);
  const float* rest = xpack + m * K;
  float* out = y + m * N;
  switch (M - m) {
    case 5: return pass<5>(rest, panel, K, bias, out, N, cols, ahead);
    case 4: return pass<4>(rest, panel, K, bias, out, N, cols, ahead);
    case 3: return pass<3>(rest, panel, K, bias, out, N, cols, ahead);
    case 2: return pass<2>(rest, panel, K, bias, out, N, cols, ahead);
    case 1: return pass<1>(rest, panel, K, bias, out, N, cols, ahead);
    default: return;
  }
}

// x [M, K] -> groups of six rows, each [K][6] (a group's k-th values adjacent, so one pass's
// broadcasts read one cache line per 2.7 steps of k instead of six rows 4 KiB apart).
void pack_rows(const float* x, int64_t M, int64_t K, float* out) {
  for (int64_t g = 0; g < M; g += kRowsPerPass) {
    const int64_t rows = std::min<int64_t>(kRowsPerPass, M - g);
    float* dst = out + g * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < rows; ++r) dst[k * kRowsPerPass + r] = x[(g + r) * K + k];
  }
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
  const int64_t count = panels.size(0), panel_floats = K * kPanel;
  const int64_t steps = ((M + kRowsPerPass - 1) / kRowsPerPass) * K;  // k steps over all passes of one panel
  at::parallel_for(0, count, 4, [&](int64_t begin, int64_t end) {
    const char* first = reinterpret_cast<const char*>(wp + std::min(begin + kAhead, end) * panel_floats);
    Ahead ahead{first, reinterpret_cast<const char*>(wp + end * panel_floats), std::max<int64_t>(1, steps / K)};
    for (int64_t p = begin; p < end; ++p)
      all_rows(xpack.data(), M, K, wp + p * panel_floats, b ? b + p * kPanel : nullptr, yp + p * kPanel, N,
               std::min(kPanel, N - p * kPanel), ahead);
  });
}

}  // namespace

TORCH_LIBRARY(CHARIOT_OPS_NAMESPACE, m) {
  m.def("pack_panels(Tensor weight, Tensor(a!) out) -> ()", &pack_panels);
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, Tensor(a!) out) -> ()", &panel_linear);
}

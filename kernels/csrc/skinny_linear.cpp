// y = x Wᵀ (+ b) for a few rows of x on the CPU, reading the weight W [N, K] in its plain row-major layout.
//
// Decode iterations multiply a handful of rows (one per running sequence) by every weight matrix,
// so they are bound by streaming the weights from memory, not by FLOPs. oneDNN reaches the memory
// bandwidth for one row but not for 2–16 (docs/kernels.md, "CPU linear kernel"). This kernel is
// written for that range: each thread streams its own output rows of W exactly once, four at a time,
// and computes them against every row of x while they are in L1/L2 (x itself stays in L2). The
// stream is requested ahead into L2, not L1 (`prefetch_l2_from_register`).
// Dot products run along K in 8-lane fp32 vectors, or for bf16 on AVX512-BF16 dot products, 32
// values per step (K contiguous in both operands, so no packing and no second copy of the weights);
// the partial sums are reduced once per output at the end.
// More than a pass's rows of x take several passes over a block of W, and only the first pass reads
// memory; so every pass requests a share of a later block's cache lines as it goes (`Lines`),
// which keeps the memory busy through the passes that compute from cache. Without it 4–16 rows ran
// at a fraction of the bandwidth one row reaches (the passes and the stream took turns).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(CHARIOT_VECTOR_256)
#include <immintrin.h>
#define CHARIOT_BF16_ROWS 1
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "linear_amx.h"
#include "vec8.h"

#ifndef CHARIOT_OPS_NAMESPACE
#define CHARIOT_OPS_NAMESPACE chariot_cpu_linear
#endif

namespace {

using namespace chariot_vec8;

// The cache lines of a later block of W (kAhead blocks on), requested into L2 `per_step` at a time
// from inside the k loops. Two blocks ahead ran 1.0-1.1x as fast as one (fp32 and bf16, 1-16 rows).
constexpr int64_t kAhead = 2;
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
    for (int64_t i = 0; i < ahead.per_step && next < ahead.end; ++i, next += 64) prefetch_l2_from_register(next);
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
// meanwhile `next_rows` rows of W a block further on are requested from memory, spread over every pass.
template <int NB>
inline void all_rows(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* y, int64_t N,
                     int64_t next_rows) {
  const int64_t passes = (M + 2) / 3, steps = passes * (K / kLanes), lines = next_rows * K * 4 / 64;
  Lines ahead{reinterpret_cast<const char*>(w + kAhead * NB * K),
              reinterpret_cast<const char*>(w + (kAhead * NB + next_rows) * K),
              (lines + steps - 1) / std::max<int64_t>(steps, 1)};
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) block<3, NB>(x + m * K, K, w, K, bias, y + m * N, N, ahead);
  if (M - m == 2) block<2, NB>(x + m * K, K, w, K, bias, y + m * N, N, ahead);
  if (M - m == 1) block<1, NB>(x + m * K, K, w, K, bias, y + m * N, N, ahead);
}

// bf16: the same blocking on AVX512-BF16 dot products, 32 values of K (one cache line of a weight
// row) per step, six rows of x per pass (24 zmm accumulators, 10 loads per 24 dot products; four
// rows ran 12-32 rows 1.10-1.30x slower, as the passes past the first compute from cache); sums in
// fp32, rounded to bf16 once per output, as oneDNN's bf16 GEMM does.
#ifdef CHARIOT_BF16_ROWS
namespace bf16 {

constexpr int64_t kStep = 32;
constexpr int kRowsPerPass = 6;
using c10::BFloat16;

template <int MB, int NB>
inline void block(const BFloat16* x, int64_t ldx, const BFloat16* w, int64_t K, const BFloat16* bias, BFloat16* y,
                  int64_t ldy, Lines& ahead) {
  __m512 c[MB][NB];
  for (auto& row : c)
    for (auto& v : row) v = _mm512_setzero_ps();
  const char* next = ahead.next;
  for (int64_t k = 0; k < K; k += kStep) {
    for (int64_t i = 0; i < ahead.per_step && next < ahead.end; ++i, next += 64) prefetch_l2_from_register(next);
    __m512i b[NB];
    for (int n = 0; n < NB; ++n) b[n] = _mm512_loadu_si512(w + n * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m512i a = _mm512_loadu_si512(x + m * ldx + k);
      for (int n = 0; n < NB; ++n) c[m][n] = _mm512_dpbf16_ps(c[m][n], (__m512bh)a, (__m512bh)b[n]);
    }
  }
  ahead.next = next;
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n)
      y[m * ldy + n] = BFloat16(_mm512_reduce_add_ps(c[m][n]) + (bias ? static_cast<float>(bias[n]) : 0.f));
}

template <int NB>
inline void all_rows(const BFloat16* x, int64_t M, int64_t K, const BFloat16* w, const BFloat16* bias, BFloat16* y,
                     int64_t N, int64_t next_rows) {
  const int64_t passes = (M + kRowsPerPass - 1) / kRowsPerPass, steps = passes * (K / kStep);
  const int64_t lines = next_rows * K * 2 / 64;
  Lines ahead{reinterpret_cast<const char*>(w + kAhead * NB * K),
              reinterpret_cast<const char*>(w + (kAhead * NB + next_rows) * K),
              (lines + steps - 1) / std::max<int64_t>(steps, 1)};
  int64_t m = 0;
  for (; m + kRowsPerPass <= M; m += kRowsPerPass) block<kRowsPerPass, NB>(x + m * K, K, w, K, bias, y + m * N, N, ahead);
  switch (M - m) {
    case 5: block<5, NB>(x + m * K, K, w, K, bias, y + m * N, N, ahead); break;
    case 4: block<4, NB>(x + m * K, K, w, K, bias, y + m * N, N, ahead); break;
    case 3: block<3, NB>(x + m * K, K, w, K, bias, y + m * N, N, ahead); break;
    case 2: block<2, NB>(x + m * K, K, w, K, bias, y + m * N, N, ahead); break;
    case 1: block<1, NB>(x + m * K, K, w, K, bias, y + m * N, N, ahead); break;
    default: break;
  }
}

}  // namespace bf16
#endif

// Whether this build multiplies bf16 rows (on AVX512-BF16 dot products; the CPU it was built for has them).
bool bf16_rows() {
#ifdef CHARIOT_BF16_ROWS
  return true;
#else
  return false;
#endif
}

// rows_of(NB, n, next): output columns [n, n + NB) for every row of x, in blocks of 4 shared out over
// torch's threads (`next`: rows of W after them the same thread goes on to), then the last few one by one.
template <typename F>
void over_blocks(int64_t N, F&& rows_of) {
  constexpr int64_t NB = 4;  // 8 was no faster for bf16 (1.00-1.07x either way at 1-16 rows)
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) rows_of(std::integral_constant<int, NB>{}, i * NB, i + kAhead < end ? NB : 0);
  });
  for (int64_t n = blocks * NB; n < N; ++n) rows_of(std::integral_constant<int, 1>{}, n, 0);
}

template <typename T>
const T* bias_data(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == c10::CppTypeToScalarType<T>::value && bias->is_contiguous() && bias->numel() == N,
              "bias must be [N] of the weight's dtype");
  return bias->data_ptr<T>();
}

void skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                   const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu(), "skinny_linear runs on the CPU");
  const bool half = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || (half && bf16_rows())) && weight.scalar_type() == x.scalar_type() &&
                  out.scalar_type() == x.scalar_type(),
              "skinny_linear needs float32 tensors", bf16_rows() ? " or bfloat16 ones" : "");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(),
              "x [M, K], weight [N, K] and out [M, N] must be contiguous matrices");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), multiple = half ? 32 : kLanes;
  TORCH_CHECK(weight.size(1) == K && K % multiple == 0, "weight must be [N, ", K, "] with K a multiple of ", multiple);
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "out must be [", M, ", ", N, "]");
#ifdef CHARIOT_BF16_ROWS
  if (half) {
    using c10::BFloat16;
    const BFloat16 *xp = x.data_ptr<BFloat16>(), *wp = weight.data_ptr<BFloat16>(), *b = bias_data<BFloat16>(bias, N);
    BFloat16* yp = out.data_ptr<BFloat16>();
    return over_blocks(N, [&](auto nb, int64_t n, int64_t next) {
      bf16::all_rows<decltype(nb)::value>(xp, M, K, wp + n * K, b ? b + n : nullptr, yp + n, N, next);
    });
  }
#endif
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>(), *b = bias_data<float>(bias, N);
  float* yp = out.data_ptr<float>();
  over_blocks(N, [&](auto nb, int64_t n, int64_t next) {
    all_rows<decltype(nb)::value>(xp, M, K, wp + n * K, b ? b + n : nullptr, yp + n, N, next);
  });
}

// Whether this build and machine run bf16 rows on AMX tiles for W [n, k] (`linear_amx.h`).
bool amx_rows(int64_t n, int64_t k) { return chariot_linear_amx::supports(n, k); }

void check_amx(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(), name,
              " must be a contiguous bfloat16 CPU tensor");
}

// The weight [N, K] packed for `amx_linear` (a tensor of N·K bf16 values in the tiles' order).
at::Tensor amx_pack(const at::Tensor& weight) {
  check_amx(weight, "weight");
  TORCH_CHECK(weight.dim() == 2 && amx_rows(weight.size(0), weight.size(1)),
              "amx_pack needs a build and CPU with AMX tiles and weight [N, K] with N and K multiples of 32, got ",
              weight.sizes());
  at::Tensor packed = weight.new_empty({weight.numel()});
#ifdef CHARIOT_AMX
  chariot_linear_amx::pack(static_cast<const uint16_t*>(weight.data_ptr()), weight.size(0), weight.size(1),
                           static_cast<uint16_t*>(packed.data_ptr()));
#endif
  return packed;
}

// out [M, N] = x [M, K] Wᵀ + bias for M <= 32, W as `amx_pack` returned it.
void amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                const at::Tensor& out) {
  check_amx(x, "x");
  check_amx(packed, "packed");
  check_amx(out, "out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0), "x [M, K] and out [M, N] disagree on M");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(M <= chariot_linear_amx::kMaxRows, "amx_linear takes at most ", chariot_linear_amx::kMaxRows,
              " rows, got ", M);
  TORCH_CHECK(packed.numel() == N * K && amx_rows(N, K), "packed must hold a [", N, ", ", K,
              "] weight from amx_pack on a machine with AMX tiles");
  const c10::BFloat16* b = bias_data<c10::BFloat16>(bias, N);
#ifdef CHARIOT_AMX
  if (M > 0)
    chariot_linear_amx::linear(static_cast<const uint16_t*>(x.data_ptr()), M, K,
                               static_cast<const uint16_t*>(packed.data_ptr()), N,
                               reinterpret_cast<const uint16_t*>(b), static_cast<uint16_t*>(out.data_ptr()));
#else
  (void)b;
#endif
}

}  // namespace

TORCH_LIBRARY(CHARIOT_OPS_NAMESPACE, m) {
  m.def("amx_rows(int n, int k) -> bool", &amx_rows);
  m.def("amx_pack(Tensor weight) -> Tensor", &amx_pack);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()", &amx_linear);
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out) -> ()", &skinny_linear);
  m.def("bf16_rows() -> bool", &bf16_rows);
}

// A prefill chunk's linear layers on AMX tiles, to see whether a plain tile GEMM beats oneDNN's at
// 64-512 rows (bench/experiments/amx_prefill_gemm.py builds and drives it). Not part of the product.
//
// `many`: y = x Wᵀ for any number of bf16 rows, W packed as `linear_amx.h` packs it for decode rows.
// x's whole 32-row blocks are first copied into tile order ([block][32-value step][2][16 × 32], so a
// tile load reads 1 KiB contiguously instead of 16 rows K apart); each thread then takes a range of
// 32-column panels and, for each chunk of rows that fits in about 1 MiB, runs every 32-row block
// against each panel in turn, so the panel is read from memory once per chunk and from cache after.
// Products are 2 × 2 tiles (two A, two B, four fp32 accumulators), the most eight tiles hold.
// `tile_peak`: the rate one thread's tile unit multiplies at, its operands held in tiles or reloaded
// from L1 before every four products.
#include <torch/extension.h>

#include "linear_amx.h"

#include <chrono>
#include <vector>

namespace {

// A block's 32 × 32 fp32 sums as bf16 into y's columns of panel j.
void write_rows(const float* c, int64_t j, int64_t n, uint16_t* y) {
  for (int64_t r = 0; r < 32; ++r)
    _mm512_storeu_si512(y + r * n + 32 * j,
                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(c + r * 32 + 16), _mm512_load_ps(c + r * 32)));
}

void block32(const uint16_t* a, int64_t steps, const uint16_t* w, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) chariot_amx::product_2x2(a + s * 1024, a + s * 1024 + 512, 64, w + s * 1024);
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
}

at::Tensor many(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: contiguous bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1), steps = k / 32, full = m / 32 * 32;
  TORCH_CHECK(chariot_linear_amx::supports(n, k) && packed.numel() == n * k, "packed: a [", n, ", ", k,
              "] weight from pack() on a CPU with AMX tiles");
  auto y = at::empty({m, n}, x.options());
  const auto* xs = static_cast<const uint16_t*>(x.data_ptr());
  const auto* w = static_cast<const uint16_t*>(packed.data_ptr());
  auto* ys = static_cast<uint16_t*>(y.data_ptr());
  std::vector<uint16_t> a(static_cast<size_t>(full * k));
  at::parallel_for(0, full / 32, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t r = 0; r < 32; ++r)
          std::memcpy(a.data() + (b * steps + s) * 1024 + r * 32, xs + (32 * b + r) * k + 32 * s, 64);
  });
  const int64_t chunk = std::max<int64_t>(32, (int64_t{1} << 20) / (k * 2) / 32 * 32);
  at::parallel_for(0, n / 32, 1, [&](int64_t begin, int64_t end) {
    chariot_amx::Tiles tiles(16, 16);
    alignas(64) float c[32 * 32];
    for (int64_t r0 = 0; r0 < full; r0 += chunk)
      for (int64_t j = begin; j < end; ++j)
        for (int64_t r = r0; r < std::min(full, r0 + chunk); r += 32) {
          block32(a.data() + r * k, steps, w + j * steps * 1024, c);
          write_rows(c, j, n, ys + r * n);
        }
  });
  if (m > full)  // the rows past the last whole block (< 32): the product's decode kernel
    chariot_linear_amx::linear(xs + full * k, m - full, k, w, n, nullptr, ys + full * n);
  return y;
}

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 &&
                  chariot_linear_amx::supports(weight.size(0), weight.size(1)),
              "weight: contiguous bf16 [N, K], N and K multiples of 32, on a CPU with AMX tiles");
  auto out = at::empty({weight.numel()}, weight.options());
  chariot_linear_amx::pack(static_cast<const uint16_t*>(weight.data_ptr()), weight.size(0), weight.size(1),
                           static_cast<uint16_t*>(out.data_ptr()));
  return out;
}

double tile_peak(int64_t products, bool reload) {
  TORCH_CHECK(chariot_amx::tiles_permitted(), "Linux did not grant the AMX tile state");
  chariot_amx::Tiles tiles(16, 16);
  alignas(64) static thread_local uint16_t ops[4 * 512];
  for (auto& v : ops) v = 0x3f80;  // 1.0
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ops, 64);
  _tile_loadd(5, ops + 512, 64);
  _tile_loadd(6, ops + 1024, 64);
  _tile_loadd(7, ops + 1536, 64);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < products; i += 4) {
    if (reload) {
      chariot_amx::product_2x2(ops, ops + 512, 64, ops + 1024);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[16 * 16];
  _tile_stored(0, c, 64);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return products * 16.0 * 16 * 32 * 2 / s / 1e9 + 0.0 * c[0];  // GFLOP/s
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack);
  m.def("many", &many, py::call_guard<py::gil_scoped_release>());
  m.def("tile_peak", &tile_peak, py::call_guard<py::gil_scoped_release>());
}

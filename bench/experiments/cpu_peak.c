// The machine's ceilings for the `100m` preset's work, for docs/BENCHMARKS.md's bounds on the peer
// ratio: the fp32 FMA rate (VFMADD on ymm, which AVX2 and AVX-512 machines both run, and on zmm
// where the CPU has AVX-512: a core with two 512-bit FMA units runs twice the ymm rate), the bf16
// dot-product rate where the CPU has AVX512-BF16 (VDPBF16PS on zmm), each with 12 independent
// accumulators per thread so nothing waits on a result, and the rate one pass reads memory at
// (256 MiB, past every cache, 4 KiB pages and then 2 MiB ones). Not part of the package; build and
// run it with gcc from the repository root:
//   mkdir -p build && gcc -O2 -march=native -fopenmp bench/experiments/cpu_peak.c -o build/cpu_peak && build/cpu_peak
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

static double fma_rate(void) {
  const long per_thread = 200000000 / 12;
  double t0 = omp_get_wtime();
  float out = 0;
#pragma omp parallel reduction(+ : out)
  {
    volatile float seed[12] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};  // distinct: no accumulator is folded away
    __m256 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(seed[i]);
    const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-3f);
    for (long i = 0; i < per_thread; ++i)
#pragma GCC unroll 12
      for (int j = 0; j < 12; ++j) a[j] = _mm256_fmadd_ps(a[j], x, y);
    __m256 s = a[0];
    for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    for (int i = 0; i < 8; ++i) out += lanes[i];
  }
  const double t = omp_get_wtime() - t0;
  if (out < 0) printf("%g\n", out);
  return (double)per_thread * 12 * omp_get_max_threads() * 16 / t / 1e9;  // 8 lanes x 2 FLOP per FMA
}

#ifdef __AVX512F__
static double fma512_rate(void) {
  const long per_thread = 100000000 / 12;
  double t0 = omp_get_wtime();
  float out = 0;
#pragma omp parallel reduction(+ : out)
  {
    volatile float seed[12] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
    __m512 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(seed[i]);
    const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-3f);
    for (long i = 0; i < per_thread; ++i)
#pragma GCC unroll 12
      for (int j = 0; j < 12; ++j) a[j] = _mm512_fmadd_ps(a[j], x, y);
    __m512 s = a[0];
    for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
    out += _mm512_reduce_add_ps(s);
  }
  const double t = omp_get_wtime() - t0;
  if (out < 0) printf("%g\n", out);
  return (double)per_thread * 12 * omp_get_max_threads() * 32 / t / 1e9;  // 16 lanes x 2 FLOP per FMA
}
#endif

#ifdef __AVX512BF16__
static double dot_rate(void) {
  const long per_thread = 100000000 / 12;
  double t0 = omp_get_wtime();
  float out = 0;
#pragma omp parallel reduction(+ : out)
  {
    volatile float seed[12] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};  // distinct: no accumulator is folded away
    __m512 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(seed[i]);
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3c00);
    for (long i = 0; i < per_thread; ++i)
#pragma GCC unroll 12
      for (int j = 0; j < 12; ++j) a[j] = _mm512_dpbf16_ps(a[j], x, y);
    __m512 s = a[0];
    for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
    out += _mm512_reduce_add_ps(s);
  }
  const double t = omp_get_wtime() - t0;
  if (out < 0) printf("%g\n", out);
  return (double)per_thread * 12 * omp_get_max_threads() * 64 / t / 1e9;  // 64 FLOP per instruction
}

#endif

static double read_rate(int huge) {
  const size_t n = 256UL << 20;
  char* buf = aligned_alloc(2UL << 20, n);
  if (huge) madvise(buf, n, MADV_HUGEPAGE);
  for (size_t i = 0; i < n; i += 64) ((float*)(buf + i))[0] = (float)i;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    double t0 = omp_get_wtime();
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
      __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for
      for (size_t i = 0; i < n; i += 128) {
        s0 = _mm256_add_ps(s0, _mm256_load_ps((const float*)(buf + i)));
        s1 = _mm256_add_ps(s1, _mm256_load_ps((const float*)(buf + i + 32)));
        s2 = _mm256_add_ps(s2, _mm256_load_ps((const float*)(buf + i + 64)));
        s3 = _mm256_add_ps(s3, _mm256_load_ps((const float*)(buf + i + 96)));
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
      for (int i = 0; i < 8; ++i) total += lanes[i];
    }
    const double rate = n / (omp_get_wtime() - t0) / 1e9;
    if (total < 0) printf("%g\n", total);
    if (rate > best) best = rate;
  }
  free(buf);
  return best;
}

int main(void) {
  printf("threads %d (the first pass of each rate also warms the cores up)\n", omp_get_max_threads());
  for (int i = 0; i < 5; ++i) printf("fp32 FMA: %.0f GFLOP/s\n", fma_rate());
#ifdef __AVX512F__
  for (int i = 0; i < 5; ++i) printf("fp32 FMA on zmm: %.0f GFLOP/s\n", fma512_rate());
#endif
#ifdef __AVX512BF16__
  for (int i = 0; i < 5; ++i) printf("bf16 dot products: %.0f GFLOP/s\n", dot_rate());
#else
  printf("bf16 dot products: this CPU has no AVX512-BF16\n");
#endif
  printf("read, 4 KiB pages: %.1f GB/s (best of 5)\n", read_rate(0));
  printf("read, 2 MiB pages: %.1f GB/s (best of 5)\n", read_rate(1));
  return 0;
}

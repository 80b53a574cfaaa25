// The machine's ceilings for the `100m` preset's work: the bf16 dot-product rate (VDPBF16PS, zmm,
// 12 independent accumulators per thread, so nothing waits on a result) and the rate one pass reads
// memory at (256 MiB, past every cache, 4 KiB pages and then 2 MiB ones). Ad hoc, for
// docs/BENCHMARKS.md's bound on the peer ratio; needs gcc and a CPU with AVX512-BF16:
//   gcc -O2 -march=native -fopenmp docs/img/profile/bf16_peak.c -o /tmp/bf16_peak && /tmp/bf16_peak
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

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
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for
      for (size_t i = 0; i < n; i += 256) {
        s0 = _mm512_add_ps(s0, _mm512_load_ps(buf + i));
        s1 = _mm512_add_ps(s1, _mm512_load_ps(buf + i + 64));
        s2 = _mm512_add_ps(s2, _mm512_load_ps(buf + i + 128));
        s3 = _mm512_add_ps(s3, _mm512_load_ps(buf + i + 192));
      }
      total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    }
    const double rate = n / (omp_get_wtime() - t0) / 1e9;
    if (total < 0) printf("%g\n", total);
    if (rate > best) best = rate;
  }
  free(buf);
  return best;
}

int main(void) {
  printf("threads %d (the first dot-product pass also warms the cores up)\n", omp_get_max_threads());
  for (int i = 0; i < 5; ++i) printf("bf16 dot products: %.0f GFLOP/s\n", dot_rate());
  printf("read, 4 KiB pages: %.1f GB/s (best of 5)\n", read_rate(0));
  printf("read, 2 MiB pages: %.1f GB/s (best of 5)\n", read_rate(1));
  return 0;
}

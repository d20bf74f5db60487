/* matvec_avx512.c - the element formats' AVX-512 kernels (cpu_compute_internal.h): F32 and F16
 * with AVX-512F (F16 widened by vcvtph2ps), BF16 with AVX512-BF16's vdpbf16ps, which adds the
 * two exact bf16 products of each float32 lane to it. Built for any x86-64: the code is compiled
 * per function (target attributes), and the front runs it only where the CPU has the extensions.
 *
 * Rows go four at a time (each x register serves four rows; four independent sums hide the
 * latency of the multiply-adds), the rest one at a time. A lane of the accumulator sums every
 * 16th column (F32, F16) or every 32nd pair (BF16); the lanes are added at the end as
 * _mm512_reduce_add_ps does. The last columns are read with masked loads, so nothing past
 * column c1 of a row is touched. */
#include "services/gpu-runner/cpu-compute/cpu_compute_internal.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TARGET_F __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define INLINE static inline __attribute__((always_inline))
/* The loops over the rows of a step and the parts of a block run a constant number of times:
 * unrolled, their accumulators stay in registers. */
#define UNROLL _Pragma("GCC unroll 8")

TARGET_F INLINE void f32_rows(const struct cpu_vec *x, const uint8_t *w, uint64_t rb, float *y, const int R)
{
	const uint32_t n = x->n, nf = n & ~15u;
	__m512 acc[4];
	UNROLL
	for (int k = 0; k < R; k++)
		acc[k] = _mm512_setzero_ps();
	for (uint32_t c = 0; c < nf; c += 16) {
		const __m512 xv = _mm512_load_ps(x->f + c);
		UNROLL
		for (int k = 0; k < R; k++) {
			const uint8_t *p = w + k * rb + 4 * (size_t)c;
			cc_prefetch_on(p, 4 * (size_t)c, 4 * (size_t)n, (size_t)R * rb);
			acc[k] = _mm512_fmadd_ps(_mm512_loadu_ps(p), xv, acc[k]);
		}
	}
	if (nf < n) {
		const __mmask16 m = (__mmask16)((1u << (n - nf)) - 1);
		const __m512 xv = _mm512_load_ps(x->f + nf);
		UNROLL
		for (int k = 0; k < R; k++)
			acc[k] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + k * rb + 4 * (size_t)nf), xv, acc[k]);
	}
	UNROLL
	for (int k = 0; k < R; k++)
		y[k] = _mm512_reduce_add_ps(acc[k]);
}

TARGET_F INLINE void f16_rows(const struct cpu_vec *x, const uint8_t *w, uint64_t rb, float *y, const int R)
{
	const uint32_t n = x->n, nf = n & ~15u;
	__m512 acc[4];
	UNROLL
	for (int k = 0; k < R; k++)
		acc[k] = _mm512_setzero_ps();
	for (uint32_t c = 0; c < nf; c += 16) {
		const __m512 xv = _mm512_load_ps(x->f + c);
		UNROLL
		for (int k = 0; k < R; k++) {
			const uint8_t *p = w + k * rb + 2 * (size_t)c;
			cc_prefetch_on(p, 2 * (size_t)c, 2 * (size_t)n, (size_t)R * rb);
			const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
			acc[k] = _mm512_fmadd_ps(wv, xv, acc[k]);
		}
	}
	if (nf < n) {
		const __mmask16 m = (__mmask16)((1u << (n - nf)) - 1);
		const __m512 xv = _mm512_load_ps(x->f + nf);
		UNROLL
		for (int k = 0; k < R; k++) {
			const __m512 wv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, w + k * rb + 2 * (size_t)nf));
			acc[k] = _mm512_fmadd_ps(wv, xv, acc[k]);
		}
	}
	UNROLL
	for (int k = 0; k < R; k++)
		y[k] = _mm512_reduce_add_ps(acc[k]);
}

TARGET_BF16 INLINE void bf16_rows(const struct cpu_vec *x, const uint8_t *w, uint64_t rb, float *y, const int R)
{
	const uint32_t n = x->n, nf = n & ~31u;
	__m512 acc[4];
	UNROLL
	for (int k = 0; k < R; k++)
		acc[k] = _mm512_setzero_ps();
	for (uint32_t c = 0; c < nf; c += 32) {
		const __m512bh xv = (__m512bh)_mm512_load_si512(x->bf + c);
		UNROLL
		for (int k = 0; k < R; k++) {
			const uint8_t *p = w + k * rb + 2 * (size_t)c;
			cc_prefetch_on(p, 2 * (size_t)c, 2 * (size_t)n, (size_t)R * rb);
			acc[k] = _mm512_dpbf16_ps(acc[k], (__m512bh)_mm512_loadu_si512(p), xv);
		}
	}
	if (nf < n) {
		const __mmask32 m = (__mmask32)((1u << (n - nf)) - 1);
		const __m512bh xv = (__m512bh)_mm512_load_si512(x->bf + nf);
		UNROLL
		for (int k = 0; k < R; k++) {
			const __m512i wv = _mm512_maskz_loadu_epi16(m, w + k * rb + 2 * (size_t)nf);
			acc[k] = _mm512_dpbf16_ps(acc[k], (__m512bh)wv, xv);
		}
	}
	UNROLL
	for (int k = 0; k < R; k++)
		y[k] = _mm512_reduce_add_ps(acc[k]);
}

TARGET_F void cc_avx512_f32(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y)
{
	uint32_t r = 0;
	for (; r + 4 <= rows; r += 4)
		f32_rows(x, w + r * row_bytes, row_bytes, y + r, 4);
	for (; r < rows; r++)
		f32_rows(x, w + r * row_bytes, row_bytes, y + r, 1);
}

TARGET_F void cc_avx512_f16(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y)
{
	uint32_t r = 0;
	for (; r + 4 <= rows; r += 4)
		f16_rows(x, w + r * row_bytes, row_bytes, y + r, 4);
	for (; r < rows; r++)
		f16_rows(x, w + r * row_bytes, row_bytes, y + r, 1);
}

TARGET_BF16 void cc_avx512_bf16(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y)
{
	uint32_t r = 0;
	for (; r + 4 <= rows; r += 4)
		bf16_rows(x, w + r * row_bytes, row_bytes, y + r, 4);
	for (; r < rows; r++)
		bf16_rows(x, w + r * row_bytes, row_bytes, y + r, 1);
}

#endif

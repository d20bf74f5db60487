/* vec_avx512.c - the preparation of x (vec.c) with AVX-512F, where the CPU has it: the same bits
 * as vec.c's plain loops, 16 values a step. x86-64 only; compiled per function (target
 * attributes) like the kernels. */
#include "services/gpu-runner/cpu-compute/cpu_compute_internal.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))

/* q, d and the two 16-value sums of each of ngroups groups of 32, as vec.c's quantize_group: the
 * float32 division and reciprocal are the same scalar operations; x * (1 / d) is clamped to
 * +-127 in float32 (NaN stays NaN through max and min with the NaN second), rounded half to
 * even by vcvtps2dq (the default rounding mode, as rintf), and NaN made 0. */
TARGET void cc_avx512_quantize(const float *x, uint32_t ngroups, int8_t *q, float *d, int32_t *sum16)
{
	const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
	for (uint32_t g = 0; g < ngroups; g++) {
		const __m512 a = _mm512_loadu_ps(x + 32 * (size_t)g), b = _mm512_loadu_ps(x + 32 * (size_t)g + 16);
		/* vmaxps returns its second operand when either is NaN: NaN values of x are skipped */
		__m512 m = _mm512_max_ps(_mm512_abs_ps(a), _mm512_setzero_ps());
		m = _mm512_max_ps(_mm512_abs_ps(b), m);
		const float amax = _mm512_reduce_max_ps(m);
		const float dg = amax / 127.0f;
		const __m512 id = _mm512_set1_ps(dg > 0.0f ? 1.0f / dg : 0.0f);
		__m512 ta = _mm512_mul_ps(a, id), tb = _mm512_mul_ps(b, id);
		ta = _mm512_min_ps(hi, _mm512_max_ps(lo, ta));
		tb = _mm512_min_ps(hi, _mm512_max_ps(lo, tb));
		const __m512i ia =
			_mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(ta, ta, _CMP_ORD_Q), _mm512_cvtps_epi32(ta));
		const __m512i ib =
			_mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(tb, tb, _CMP_ORD_Q), _mm512_cvtps_epi32(tb));
		_mm_storeu_si128((__m128i *)(q + 32 * (size_t)g), _mm512_cvtepi32_epi8(ia));
		_mm_storeu_si128((__m128i *)(q + 32 * (size_t)g + 16), _mm512_cvtepi32_epi8(ib));
		d[g] = dg;
		sum16[2 * g] = _mm512_reduce_add_epi32(ia);
		sum16[2 * g + 1] = _mm512_reduce_add_epi32(ib);
	}
}

/* n values to bf16 as f32_to_bf16 (dtype.h): round to nearest even, NaN kept a quiet NaN. */
TARGET void cc_avx512_to_bf16(const float *x, uint32_t n, uint16_t *out)
{
	const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
	uint32_t i = 0;
	for (; i + 16 <= n; i += 16) {
		const __m512 v = _mm512_loadu_ps(x + i);
		const __m512i u = _mm512_castps_si512(v);
		const __m512i up = _mm512_srli_epi32(u, 16);
		__m512i r =
			_mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(up, one)), 16);
		r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(up, quiet));
		_mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(r));
	}
	for (; i < n; i++)
		out[i] = f32_to_bf16(x[i]);
}

#endif

/* matvec_vnni.c - the block formats' AVX512-VNNI kernels (cpu_compute_internal.h). Built for any
 * x86-64 (target attributes per function); the front runs them only where the CPU has AVX-512
 * F/BW/VL, VNNI and F16C.
 *
 * vpdpbusd multiplies unsigned bytes by signed bytes and adds each 4 products to an int32 lane.
 * x is the signed side (its int8 codes, cpu_compute.h), the weights the unsigned one: the codes
 * of Q4_0 (0..15), Q4_K (0..15), Q5_K (0..31) and Q6_K (0..63) are unsigned as stored, Q8_0's are
 * made so by adding 128 (xor 0x80). The offset a format's code carries (Q4_0: 8, Q6_K: 32, Q8_0
 * the 128 added) is taken off by starting each lane's sum at the offset times minus the sum of
 * x's codes over the group or run (the vector's init, made once per product in vec.c), so the
 * int32 lanes hold exact sums of (weight value) x (x code). Q4_K and Q5_K have no offset: their
 * mins are dmin m_j s_x per sub-block (s_x = d_x sum q, also from vec.c).
 *
 * Weights are unpacked into one register of 64 codes in the order of the values, so x is read
 * as stored: Q4_K / Q5_K a run of 32 qs bytes broadcast to both halves and shifted by 0 and 4
 * bits (low nibbles: values 0..31 of the 64, high: 32..63); Q6_K its 64 ql bytes (low nibbles,
 * then high) with qh's two bits per value shifted into bits 4 and 5; Q8_0 and Q4_0 two blocks a
 * register. Each int32 lane (4 values) is converted to float32 and multiplied by its scale
 * (d_w sc d_x, spread over the lanes of its group by a permute) into a float32 accumulator; the
 * accumulator's lanes are added at the end of the row. Rows go four at a time, sharing the
 * loads of x; the rest one at a time. */
#include "services/gpu-runner/cpu-compute/cpu_compute_internal.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include "common/quant.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
#define INLINE static inline __attribute__((always_inline))
/* The loops over the rows of a step and the parts of a block run a constant number of times:
 * unrolled, their accumulators stay in registers. */
#define UNROLL _Pragma("GCC unroll 8")

/* The float32 scales of two 32-value blocks a and b of a row: d_a d_x[a] on lanes 0..7 and
 * d_b d_x[b] on lanes 8..15 (b's half 0 when there is no block b). */
TARGET INLINE __m512 pair_scales(uint16_t da, uint16_t db, const float *dx)
{
	const __m128 dw = _mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)da | (uint32_t)db << 16)));
	const __m128 s = _mm_mul_ps(dw, _mm_castpd_ps(_mm_load_sd((const double *)dx)));
	const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
	return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(s));
}

/* The sum of a register's 8 lanes, pairwise. */
TARGET INLINE float hsum8(__m256 v)
{
	__m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
	s = _mm_add_ps(s, _mm_movehl_ps(s, s));
	s = _mm_add_ss(s, _mm_movehdup_ps(s));
	return _mm_cvtss_f32(s);
}

/* ---- Q8_0: two blocks of 34 bytes per register ---- */

/* Blocks b and b + 1 of the rows (two == 0: block b only, the last of an odd count). */
TARGET INLINE void q8_0_pair(const struct cpu_vec *x, const uint8_t *w, uint64_t rb, uint32_t b, __m512 *acc,
			     const int R, const int two)
{
	const __m512i xv = _mm512_load_si512(x->q + 32 * (size_t)b);
	const __m512i iv = _mm512_load_si512(x->init + 8 * (size_t)b);
	const __m512i flip = _mm512_set1_epi8((char)0x80);
	UNROLL
	for (int k = 0; k < R; k++) {
		const uint8_t *blk = w + k * rb + (size_t)b * 34;
		const size_t off = (size_t)b * 34, len = (size_t)(x->n / QK8_0) * 34, next = (size_t)R * rb;
		cc_prefetch_on(blk, off, len, next);
		cc_prefetch_on(blk + 64, off + 64, len, next);
		const __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 2));
		const __m256i hi = two ? _mm256_loadu_si256((const __m256i *)(blk + 36)) : _mm256_set1_epi8((char)0x80);
		const __m512i wv = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), flip);
		const __m512i p = _mm512_dpbusd_epi32(iv, wv, xv);
		const __m512 s = pair_scales(cc_u16(blk), two ? cc_u16(blk + 34) : 0, x->d + b);
		acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[k]);
	}
}

TARGET INLINE void q8_0_rows(const struct cpu_vec *x, const uint8_t *w, uint64_t rb, float *y, const int R)
{
	const uint32_t nb = x->n / QK8_0;
	__m512 acc[4];
	UNROLL
	for (int k = 0; k < R; k++)
		acc[k] = _mm512_setzero_ps();
	uint32_t b = 0;
	for (; b + 2 <= nb; b += 2)
		q8_0_pair(x, w, rb, b, acc, R, 1);
	if (b < nb)
		q8_0_pair(x, w, rb, b, acc, R, 0);
	UNROLL
	for (int k = 0; k < R; k++)
		y[k] = _mm512_reduce_add_ps(acc[k]);
}

/* ---- Q4_0: two blocks of 18 bytes per register ---- */

TARGET INLINE void q4_0_pair(const struct cpu_vec *x, const uint8_t *w, uint64_t rb, uint32_t b, __m512 *acc,
			     const int R, const int two)
{
	const __m512i xv = _mm512_load_si512(x->q + 32 * (size_t)b);
	const __m512i iv = _mm512_load_si512(x->init + 8 * (size_t)b);
	/* qwords of [a's 16 bytes, b's 16 bytes] as a a b b, then low nibbles of the first of each
	 * pair and high nibbles of the second: values 0..31 of a, then of b */
	const __m512i spread = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);
	const __m512i shift = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
	const __m512i low4 = _mm512_set1_epi8(0x0F);
	UNROLL
	for (int k = 0; k < R; k++) {
		const uint8_t *blk = w + k * rb + (size_t)b * 18;
		const size_t off = (size_t)b * 18, len = (size_t)(x->n / QK4_0) * 18, next = (size_t)R * rb;
		cc_prefetch_on(blk, off, len, next);
		const __m128i qa = _mm_loadu_si128((const __m128i *)(blk + 2));
		const __m128i qb = two ? _mm_loadu_si128((const __m128i *)(blk + 20)) : _mm_setzero_si128();
		const __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1);
		__m512i wv = _mm512_permutexvar_epi64(spread, _mm512_castsi256_si512(ab));
		wv = _mm512_and_si512(_mm512_srlv_epi64(wv, shift), low4);
		const __m512i p = _mm512_dpbusd_epi32(iv, wv, xv);
		const __m512 s = pair_scales(cc_u16(blk), two ? cc_u16(blk + 18) : 0, x->d + b);
		acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[k]);
	}
}

TARGET INLINE void q4_0_rows(const struct cpu_vec *x, const uint8_t *w, uint64_t rb, float *y, const int R)
{
	const uint32_t nb = x->n / QK4_0;
	__m512 acc[4];
	UNROLL
	for (int k = 0; k < R; k++)
		acc[k] = _mm512_setzero_ps();
	uint32_t b = 0;
	for (; b + 2 <= nb; b += 2)
		q4_0_pair(x, w, rb, b, acc, R, 1);
	if (b < nb)
		q4_0_pair(x, w, rb, b, acc, R, 0);
	UNROLL
	for (int k = 0; k < R; k++)
		y[k] = _mm512_reduce_add_ps(acc[k]);
}

/* ---- Q4_K and Q5_K: 256 values, 8 sub-blocks of 32 (one group of x each) ---- */

/* Rows of Q4_K (hq == 0) or Q5_K (hq == 1) blocks of bsize bytes: qs at qs_off, Q5_K's qh at
 * qh_off. acc gathers d sc_j d_x q.x per lane, macc dmin m_j s_x per sub-block. */
TARGET INLINE void k4_rows(const struct cpu_vec *x, const uint8_t *w, uint64_t rb, float *y, const int R, const int hq,
			   const size_t bsize, const size_t qs_off, const size_t qh_off)
{
	const uint32_t nb = x->n / QK_K;
	const __m512i nib_shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
	const __m512i low4 = _mm512_set1_epi8(0x0F);
	const __m512i five = _mm512_set1_epi8(16);
	__m512 acc[4];
	__m256 macc[4];
	UNROLL
	for (int k = 0; k < R; k++) {
		acc[k] = _mm512_setzero_ps();
		macc[k] = _mm256_setzero_ps();
	}
	for (uint32_t b = 0; b < nb; b++) {
		const __m256 dx = _mm256_load_ps(x->d + 8 * (size_t)b);
		const __m256 sx = _mm256_load_ps(x->s + 8 * (size_t)b);
		const int8_t *xq = x->q + (size_t)b * QK_K;
		UNROLL
		for (int k = 0; k < R; k++) {
			const uint8_t *blk = w + k * rb + (size_t)b * bsize;
			const size_t off = (size_t)b * bsize, len = (size_t)nb * bsize, next = (size_t)R * rb;
			cc_prefetch_on(blk, off, len, next);
			cc_prefetch_on(blk + 64, off + 64, len, next);
			if (bsize > 128)
				cc_prefetch_on(blk + 128, off + 128, len, next);
			const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)cc_u32(blk))); /* d, dmin */
			uint64_t sc, m;
			cc_k4_scales(blk + 4, &sc, &m);
			const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)));
			const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m)));
			const __m256 coef8 = _mm256_mul_ps(_mm256_mul_ps(scf, dx), _mm256_broadcastss_ps(dd));
			const __m256 dmin = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dd), _mm256_set1_epi32(1));
			macc[k] = _mm256_fmadd_ps(_mm256_mul_ps(mf, dmin), sx, macc[k]);
			const __m512 coef = _mm512_castps256_ps512(coef8);
			__m512i qhb = _mm512_setzero_si512();
			if (hq)
				qhb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + qh_off)));
			UNROLL
			for (int j = 0; j < 4; j++) {
				const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + qs_off + 32 * j));
				__m512i wv =
					_mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(q), nib_shift), low4);
				if (hq) {
					/* the fifth bit: qh bit 2j for values 0..31 of the 64, 2j + 1 for 32..63 */
					const __m512i bit =
						_mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * j))),
								   _mm256_set1_epi8((char)(2 << (2 * j))), 1);
					wv = _mm512_mask_add_epi8(wv, _mm512_test_epi8_mask(qhb, bit), wv, five);
				}
				const __m512i p =
					_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_load_si512(xq + 64 * j));
				const __m512i idx = _mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
								     2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j,
								     2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j);
				acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(idx, coef),
							 acc[k]);
			}
		}
	}
	UNROLL
	for (int k = 0; k < R; k++)
		y[k] = _mm512_reduce_add_ps(acc[k]) - hsum8(macc[k]);
}

/* ---- Q6_K: 256 values, 16 runs of 16 with int8 scales ---- */

TARGET INLINE void q6_k_rows(const struct cpu_vec *x, const uint8_t *w, uint64_t rb, float *y, const int R)
{
	const uint32_t nb = x->n / QK_K;
	const __m512i low4 = _mm512_set1_epi8(0x0F);
	const __m512i hi2 = _mm512_set1_epi8(0x30);
	/* qh bits (2p, 2p + 1) of part p to bits 4, 5: parts 0, 1 (register 0) shift left by 4 and 2,
	 * parts 2, 3 (register 1) right by 0 and 2 */
	const __m512i shl = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4);
	const __m512i shr = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
	const __m512i pair = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
	__m512 acc[4];
	UNROLL
	for (int k = 0; k < R; k++)
		acc[k] = _mm512_setzero_ps();
	for (uint32_t b = 0; b < nb; b++) {
		/* d_x of each run (a group is two runs) */
		const __m512 dx =
			_mm512_permutexvar_ps(pair, _mm512_castps256_ps512(_mm256_load_ps(x->d + 8 * (size_t)b)));
		const int8_t *xq = x->q + (size_t)b * QK_K;
		const int32_t *xi = x->init + (size_t)b * (QK_K / 4);
		UNROLL
		for (int k = 0; k < R; k++) {
			const uint8_t *blk = w + k * rb + (size_t)b * sizeof(struct block_q6_K);
			const size_t off = (size_t)b * sizeof(struct block_q6_K),
				     len = (size_t)nb * sizeof(struct block_q6_K), next = (size_t)R * rb;
			UNROLL
			for (int l = 0; l < 4; l++)
				cc_prefetch_on(blk + 64 * l, off + 64 * l, len, next);
			const float d = _cvtsh_ss(cc_u16(blk + offsetof(struct block_q6_K, d)));
			const __m128i sc8 =
				_mm_loadu_si128((const __m128i *)(blk + offsetof(struct block_q6_K, scales)));
			const __m512 coef = _mm512_mul_ps(
				_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)), dx), _mm512_set1_ps(d));
			UNROLL
			for (int h = 0; h < 2; h++) {
				const __m512i ql = _mm512_loadu_si512(blk + offsetof(struct block_q6_K, ql) + 64 * h);
				const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
					(const __m256i *)(blk + offsetof(struct block_q6_K, qh) + 32 * h)));
				UNROLL
				for (int part = 0; part < 2; part++) {
					const int ch = 2 * h + part; /* values 64 ch .. of the block, runs 4 ch .. */
					__m512i lo, hb;
					if (part == 0) {
						lo = _mm512_and_si512(ql, low4);
						hb = _mm512_and_si512(_mm512_sllv_epi64(qh, shl), hi2);
					} else {
						lo = _mm512_and_si512(_mm512_srli_epi16(ql, 4), low4);
						hb = _mm512_and_si512(_mm512_srlv_epi64(qh, shr), hi2);
					}
					const __m512i wv = _mm512_or_si512(lo, hb);
					const __m512i p = _mm512_dpbusd_epi32(_mm512_load_si512(xi + 16 * ch), wv,
									      _mm512_load_si512(xq + 64 * ch));
					const __m512i idx = _mm512_set_epi32(
						4 * ch + 3, 4 * ch + 3, 4 * ch + 3, 4 * ch + 3, 4 * ch + 2, 4 * ch + 2,
						4 * ch + 2, 4 * ch + 2, 4 * ch + 1, 4 * ch + 1, 4 * ch + 1, 4 * ch + 1,
						4 * ch, 4 * ch, 4 * ch, 4 * ch);
					acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
								 _mm512_permutexvar_ps(idx, coef), acc[k]);
				}
			}
		}
	}
	UNROLL
	for (int k = 0; k < R; k++)
		y[k] = _mm512_reduce_add_ps(acc[k]);
}

/* Four rows at a time, then one. */
#define ROWS_ENTRY(name, call)                                                                                         \
	TARGET void name(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y)       \
	{                                                                                                              \
		uint32_t r = 0;                                                                                        \
		for (; r + 4 <= rows; r += 4) {                                                                        \
			const uint8_t *wr = w + r * row_bytes;                                                         \
			float *yr = y + r;                                                                             \
			const int R = 4;                                                                               \
			call;                                                                                          \
		}                                                                                                      \
		for (; r < rows; r++) {                                                                                \
			const uint8_t *wr = w + r * row_bytes;                                                         \
			float *yr = y + r;                                                                             \
			const int R = 1;                                                                               \
			call;                                                                                          \
		}                                                                                                      \
	}

ROWS_ENTRY(cc_vnni_q8_0, q8_0_rows(x, wr, row_bytes, yr, R))
ROWS_ENTRY(cc_vnni_q4_0, q4_0_rows(x, wr, row_bytes, yr, R))
ROWS_ENTRY(cc_vnni_q4_k,
	   k4_rows(x, wr, row_bytes, yr, R, 0, sizeof(struct block_q4_K), offsetof(struct block_q4_K, qs), 0))
ROWS_ENTRY(cc_vnni_q5_k, k4_rows(x, wr, row_bytes, yr, R, 1, sizeof(struct block_q5_K), offsetof(struct block_q5_K, qs),
				 offsetof(struct block_q5_K, qh)))
ROWS_ENTRY(cc_vnni_q6_k, q6_k_rows(x, wr, row_bytes, yr, R))

#endif

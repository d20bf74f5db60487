/* quantize.c - float32 into the GGUF block formats (quant_quantize, quant.h).
 *
 * What each format gets:
 *   Q8_0  d = amax / 127, stored as f16; each value rounded against the stored d.
 *   Q4_0  the scale of each block of 32 (levels -8..7) from 19 candidates around amax / 8,
 *         refitted once by least squares, stored as f16; the values rounded against it.
 *   Q4_K, Q5_K  each sub-block of 32 gets an affine fit x ~ a * l - m (m >= 0): a grid of
 *         candidate step sizes, each assignment refitted by weighted least squares, the best
 *         refitted twice more. The 8 scales and 8 mins are then coded in 6 bits against the
 *         super-block's f16 d and dmin, each sub-block tries the neighbouring 6-bit codes, and
 *         the values are rounded against exactly what the decoder will compute.
 *   Q6_K  each sub-block of 16 gets a symmetric scale (levels -32..31) from 19 candidates and a
 *         refit, the 16 scales are coded as int8 against the f16 d, and the values rounded
 *         against the coded scales.
 * The fits weight the error as ggml's reference quantizers do (ggml-quants.c's
 * quantize_row_*_ref): av + |x| for the K formats with mins (av the sub-block's RMS), x^2 for
 * the symmetric ones, favouring a block's large values. On Gaussian data the error is at or a
 * little below theirs (tests/unit/common/test_quant.c has the numbers).
 *
 * Speed: each candidate is scored from running sums in one pass over its values (the error
 * needs no second pass, and candidates compare without a division); the passes run four lanes
 * at a time. This file is built without contraction into FMA (common/CMakeLists.txt), so the
 * output is the same bytes whatever the machine or optimisation level.
 *
 * Inputs are untrusted floats: a block whose values are not all finite, or reach 1e8 in
 * magnitude (past what any of these formats can hold), is quantized from a copy clipped to
 * +-1e8 with NaN read as 0, and stored scales saturate at the largest finite half, so no block
 * ever decodes to NaN or infinity. */
#include "common/quant.h"

#include <math.h>
#include <string.h>

/* Inputs are clipped to this magnitude (Q8_0's largest value is 127 * 65504, about 8.3e6). */
#define QZ_CLIP 1e8f
/* Adding and subtracting 1.5 * 2^23 rounds a float of magnitude below 2^22 to an integer
 * (to nearest, ties to even) without leaving the float pipeline. */
#define QZ_MAGIC 12582912.0f

static inline float qz_round(float v)
{
	return (v + QZ_MAGIC) - QZ_MAGIC;
}

static inline float qz_clamp(float v, float lo, float hi)
{
	v = v < lo ? lo : v;
	return v > hi ? hi : v;
}

/* The hot loops work on four floats at a time through GCC's vector extension (clang has it
 * too): plain loops left to the auto-vectorizer kept their accumulators in memory or not, by
 * optimisation level, at up to twice the time. Each lane is IEEE float arithmetic in source
 * order, so the results are the bytes a scalar loop with four accumulators would give. */
typedef float qz_v4 __attribute__((vector_size(16)));
typedef int32_t qz_m4 __attribute__((vector_size(16)));

static inline qz_v4 qz_ld(const float *p)
{
	qz_v4 v;
	memcpy(&v, p, sizeof(v));
	return v;
}

static inline qz_v4 qz_set(float f)
{
	return (qz_v4){f, f, f, f};
}

/* Lanes of a where m is set, of b elsewhere. */
static inline qz_v4 qz_sel(qz_m4 m, qz_v4 a, qz_v4 b)
{
	return (qz_v4)((m & (qz_m4)a) | (~m & (qz_m4)b));
}

static inline qz_v4 qz_vclamp(qz_v4 v, qz_v4 lo, qz_v4 hi)
{
	v = qz_sel(v < lo, lo, v);
	return qz_sel(v > hi, hi, v);
}

static inline qz_v4 qz_vround(qz_v4 v)
{
	return (v + qz_set(QZ_MAGIC)) - qz_set(QZ_MAGIC);
}

static inline qz_v4 qz_vabs(qz_v4 v)
{
	return (qz_v4)((qz_m4)v & (qz_m4){0x7fffffff, 0x7fffffff, 0x7fffffff, 0x7fffffff});
}

/* The sum of the four lanes, in a fixed order. */
static inline float qz_hsum(qz_v4 a)
{
	return (a[0] + a[2]) + (a[1] + a[3]);
}

/* A scale as f16, saturated at the largest finite half so that no block stores infinity. */
static uint16_t qz_f16(float f)
{
	return f32_to_f16(qz_clamp(f, -65504.0f, 65504.0f));
}

/* Is every value of x[0..n) (n a multiple of 4) finite and within QZ_CLIP? */
static int qz_tame(const float *x, int n)
{
	qz_v4 amax = qz_set(0), nan = qz_set(0);
	for (int i = 0; i < n; i += 4) {
		const qz_v4 v = qz_ld(x + i), a = qz_vabs(v);
		amax = qz_sel(a > amax, a, amax);
		nan += v * qz_set(0); /* a NaN never wins the maximum: it shows here */
	}
	int ok = 1;
	for (int k = 0; k < 4; k++)
		ok &= amax[k] <= QZ_CLIP && nan[k] == 0;
	return ok;
}

/* x, or a clipped copy of it in buf when some value is not tame. */
static const float *qz_input(const float *x, float *buf, int n)
{
	if (qz_tame(x, n))
		return x;
	for (int i = 0; i < n; i++)
		buf[i] = x[i] == x[i] ? qz_clamp(x[i], -QZ_CLIP, QZ_CLIP) : 0.0f;
	return buf;
}

/* ---- Q8_0 ---------------------------------------------------------------------------------- */

static void qz_q8_0(const float *src, struct block_q8_0 *y)
{
	float buf[QK8_0];
	const float *x = qz_input(src, buf, QK8_0);
	float amax = 0;
	for (int i = 0; i < QK8_0; i++)
		amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
	y->d = qz_f16(amax / 127.0f);
	const float d = f16_to_f32(y->d);
	const float id = d > 0 ? 1.0f / d : 0.0f;
	for (int i = 0; i < QK8_0; i++)
		y->qs[i] = (int8_t)qz_round(qz_clamp(x[i] * id, -127.0f, 127.0f));
}

/* ---- symmetric scales (Q4_0, Q6_K) ---------------------------------------------------------- */

/* The scale s minimising sum w (x - s * l)^2 over integer l in [-nmax, nmax - 1], w = x^2, for n
 * values (a multiple of 4): 19 step sizes around the one that puts the value of largest
 * magnitude on level -nmax (the end with the most room), then a least-squares refit of the
 * best. Returns 0 for a block of zeros. */
static float qz_fit_symmetric(const float *x, int n, float nmax)
{
	float vmax = 0, amax = 0;
	for (int i = 0; i < n; i++) {
		if (fabsf(x[i]) > amax) {
			amax = fabsf(x[i]);
			vmax = x[i];
		}
	}
	if (amax < 1e-30f)
		return 0.0f;
	float best_s = -vmax / nmax;
	double best = -1; /* (sum w x l)^2 / sum w l^2 of the best: what it takes off sum w x^2 */
	const qz_v4 lo = qz_set(-nmax), hi = qz_set(nmax - 1);
	for (int is = -9; is <= 10; is++) {
		const float iscale = is <= 9 ? -(nmax + 0.1f * is) / vmax : 1.0f / best_s; /* 10: the refit */
		const qz_v4 vi = qz_set(iscale);
		qz_v4 slx = qz_set(0), sl2 = qz_set(0);
		for (int i = 0; i < n; i += 4) {
			const qz_v4 v = qz_ld(x + i);
			const qz_v4 l = qz_vround(qz_vclamp(v * vi, lo, hi));
			const qz_v4 wl = v * v * l;
			slx += wl * v;
			sl2 += wl * l;
		}
		const double lx = qz_hsum(slx), l2 = qz_hsum(sl2);
		if (l2 > 0 && lx * lx > best * l2) {
			best = lx * lx / l2;
			best_s = (float)(lx / l2);
		}
	}
	return best_s;
}

static void qz_q4_0(const float *src, struct block_q4_0 *y)
{
	float buf[QK4_0];
	const float *x = qz_input(src, buf, QK4_0);
	y->d = qz_f16(qz_fit_symmetric(x, QK4_0, 8.0f));
	const float d = f16_to_f32(y->d);
	const float id = d != 0 ? 1.0f / d : 0.0f;
	/* value j < 16 in the low nibble of qs[j], value j + 16 in the high one */
	for (int j = 0; j < QK4_0 / 2; j++) {
		const int l0 = (int)qz_round(qz_clamp(x[j] * id, -8.0f, 7.0f)) + 8;
		const int l1 = (int)qz_round(qz_clamp(x[j + QK4_0 / 2] * id, -8.0f, 7.0f)) + 8;
		y->qs[j] = (uint8_t)(l0 | (l1 << 4));
	}
}

static void qz_q6_k(const float *src, struct block_q6_K *y)
{
	float buf[QK_K];
	const float *x = qz_input(src, buf, QK_K);
	float scale[QK_K / 16];
	float smax = 0, samax = 0;
	for (int j = 0; j < QK_K / 16; j++) {
		scale[j] = qz_fit_symmetric(x + 16 * j, 16, 32.0f);
		if (fabsf(scale[j]) > samax) {
			samax = fabsf(scale[j]);
			smax = scale[j];
		}
	}
	memset(y, 0, sizeof(*y));
	/* the largest scale codes as -128, the end of int8 with the most room (a block of zeros
	 * keeps d = +0, not -0) */
	y->d = samax > 0 ? qz_f16(smax / -128.0f) : 0;
	const float d = f16_to_f32(y->d);
	uint8_t L[QK_K]; /* level + 32, 0..63 */
	memset(L, 32, sizeof(L));
	for (int j = 0; j < QK_K / 16 && d != 0; j++) {
		y->scales[j] = (int8_t)qz_round(qz_clamp(scale[j] / d, -128.0f, 127.0f));
		const float ds = d * y->scales[j];
		const float ids = ds != 0 ? 1.0f / ds : 0.0f;
		for (int i = 0; i < 16; i++)
			L[16 * j + i] = (uint8_t)(qz_round(qz_clamp(x[16 * j + i] * ids, -32.0f, 31.0f)) + 32);
	}
	/* per 128 values (quant.c's dq_q6_k): ql[l] holds the low nibbles of values l and l + 64,
	 * ql[l + 32] those of l + 32 and l + 96, qh[l] the high two bits of l, l + 32, l + 64, l + 96 */
	for (int h = 0; h < 2; h++) {
		const uint8_t *q = L + 128 * h;
		uint8_t *ql = y->ql + 64 * h, *qh = y->qh + 32 * h;
		for (int l = 0; l < 32; l++) {
			const int q1 = q[l], q2 = q[l + 32], q3 = q[l + 64], q4 = q[l + 96];
			ql[l] = (uint8_t)((q1 & 0xF) | ((q3 & 0xF) << 4));
			ql[l + 32] = (uint8_t)((q2 & 0xF) | ((q4 & 0xF) << 4));
			qh[l] = (uint8_t)((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
		}
	}
}

/* ---- scales and mins (Q4_K, Q5_K) ------------------------------------------------------------ */

/* Weighted sums over one sub-block of 32 values x with weights w, for a fit x ~ a * l + b. */
struct qz_sums {
	double w, x, xx; /* sum w, sum w x, sum w x^2: the sub-block's own */
	double l, ll, lx; /* sum w l, sum w l^2, sum w l x: of one assignment of levels l */
};

/* The sums of the levels l = round(clamp((x - off) * is, 0, nmax)). */
static void qz_assign(const float *x, const float *w, float off, float is, float nmax, struct qz_sums *s)
{
	const qz_v4 vo = qz_set(off), vi = qz_set(is), zero = qz_set(0), top = qz_set(nmax);
	qz_v4 al = zero, all = zero, alx = zero;
	for (int i = 0; i < 32; i += 4) {
		const qz_v4 v = qz_ld(x + i);
		const qz_v4 l = qz_vround(qz_vclamp((v - vo) * vi, zero, top));
		const qz_v4 wl = qz_ld(w + i) * l;
		al += wl;
		all += wl * l;
		alx += wl * v;
	}
	s->l = qz_hsum(al);
	s->ll = qz_hsum(all);
	s->lx = qz_hsum(alx);
}

/* How much the least-squares a and b (b <= 0) for the sums' levels take off sum w x^2 (the
 * error they leave is s->xx less this), as num / den with den > 0, so that the search compares
 * candidates without a division; num = -inf when the levels cannot carry a fit. a and b
 * themselves come from qz_lsq_fit, for the winner only. */
static void qz_lsq_gain(const struct qz_sums *s, double *num, double *den)
{
	const double D = s->w * s->ll - s->l * s->l;
	if (!(D > 0)) {
		*num = -INFINITY;
		*den = 1;
	} else if (s->ll * s->x - s->l * s->lx > 0) { /* b would be positive: fit a alone */
		*num = s->lx * s->lx;
		*den = s->ll;
	} else {
		*num = s->w * s->lx * s->lx - 2 * s->x * s->l * s->lx + s->ll * s->x * s->x;
		*den = D;
	}
}

static void qz_lsq_fit(const struct qz_sums *s, float *a, float *b)
{
	const double D = s->w * s->ll - s->l * s->l;
	const double off = (s->ll * s->x - s->l * s->lx) / D;
	if (off > 0) {
		*a = (float)(s->lx / s->ll);
		*b = 0;
	} else {
		*a = (float)((s->w * s->lx - s->x * s->l) / D);
		*b = (float)off;
	}
}

/* Fits x ~ a * l + b over one sub-block of 32 (l in 0..nmax, b <= 0), weighted by w, and
 * returns a (b goes to *off): nstep + 1 step sizes from (nmax + rmin) / range up by rdelta,
 * each assignment refitted by least squares, then two refits of the best. */
static float qz_fit_affine(const float *x, const float *w, float nmax, float rmin, float rdelta, int nstep, float *off)
{
	qz_v4 vlo = qz_set(0), vhi = qz_set(x[0]), aw = qz_set(0), ax = aw, axx = aw;
	for (int i = 0; i < 32; i += 4) {
		const qz_v4 v = qz_ld(x + i), wv = qz_ld(w + i);
		vlo = qz_sel(v < vlo, v, vlo); /* from 0: the offset is never positive */
		vhi = qz_sel(v > vhi, v, vhi);
		aw += wv;
		ax += wv * v;
		axx += wv * v * v;
	}
	float lo = vlo[0], hi = vhi[0];
	for (int k = 1; k < 4; k++) {
		lo = vlo[k] < lo ? vlo[k] : lo;
		hi = vhi[k] > hi ? vhi[k] : hi;
	}
	const float range = hi - lo;
	if (!(range > 1e-30f)) {
		*off = lo; /* a constant block (or too small to scale): every value is lo */
		return 0.0f;
	}
	struct qz_sums s = {.w = qz_hsum(aw), .x = qz_hsum(ax), .xx = qz_hsum(axx)};
	/* the plain min/max fit first, scored as it stands */
	float best_a = range / nmax, best_b = lo;
	qz_assign(x, w, lo, nmax / range, nmax, &s);
	const double a = best_a, b = best_b;
	double best = -(a * a * s.ll + 2 * a * b * s.l + b * b * s.w - 2 * a * s.lx - 2 * b * s.x);
	for (int is = 0; is <= nstep + 2; is++) {
		if (is <= nstep) {
			qz_assign(x, w, lo, (nmax + rmin + rdelta * is) / range, nmax, &s);
		} else { /* the two refits */
			if (!(best_a > 0))
				break;
			qz_assign(x, w, best_b, 1.0f / best_a, nmax, &s);
		}
		double num, den;
		qz_lsq_gain(&s, &num, &den);
		if (num > best * den) {
			best = num / den;
			qz_lsq_fit(&s, &best_a, &best_b);
		}
	}
	*off = best_b;
	return best_a;
}

/* The weighted squared error of one sub-block decoded as D * l - M, each value on its nearest
 * level. */
static float qz_coded_err(const float *x, const float *w, float D, float M, float nmax)
{
	const qz_v4 vD = qz_set(D), vM = qz_set(M), iD = qz_set(D > 0 ? 1.0f / D : 0.0f), zero = qz_set(0),
		    top = qz_set(nmax);
	qz_v4 acc = zero;
	for (int i = 0; i < 32; i += 4) {
		const qz_v4 v = qz_ld(x + i);
		const qz_v4 l = qz_vround(qz_vclamp((v + vM) * iD, zero, top));
		const qz_v4 e = vD * l - vM - v;
		acc += qz_ld(w + i) * e * e;
	}
	return qz_hsum(acc);
}

/* Quantizes one super-block of 256 into levels L (0..nmax), 6-bit scales and mins packed as
 * quant_scale_min_k4 reads them, and the f16 d and dmin. */
static void qz_k_scales(const float *x, float nmax, float rmin, float rdelta, int nstep, uint8_t *L, uint8_t *packed,
			uint16_t *d16, uint16_t *dmin16)
{
	float w[32 * 8], scale[8], mn[8];
	float smax = 0, mmax = 0;
	for (int j = 0; j < 8; j++) {
		const float *xs = x + 32 * j;
		float *ws = w + 32 * j;
		qz_v4 ss = qz_set(0);
		for (int i = 0; i < 32; i += 4) {
			const qz_v4 v = qz_ld(xs + i);
			ss += v * v;
		}
		/* ggml's weights: the sub-block's RMS plus the value's magnitude */
		const qz_v4 av = qz_set(sqrtf(qz_hsum(ss) / 32));
		for (int i = 0; i < 32; i += 4) {
			const qz_v4 wv = av + qz_vabs(qz_ld(xs + i));
			memcpy(ws + i, &wv, sizeof(wv));
		}
		float off;
		scale[j] = qz_fit_affine(xs, ws, nmax, rmin, rdelta, nstep, &off);
		mn[j] = -off;
		smax = scale[j] > smax ? scale[j] : smax;
		mmax = mn[j] > mmax ? mn[j] : mmax;
	}
	*d16 = qz_f16(smax / 63.0f);
	*dmin16 = qz_f16(mmax / 63.0f);
	const float d = f16_to_f32(*d16), dmin = f16_to_f32(*dmin16);
	uint8_t ls[8], lm[8];
	for (int j = 0; j < 8; j++) {
		const float *xs = x + 32 * j, *ws = w + 32 * j;
		const int s0 = d > 0 ? (int)qz_round(qz_clamp(scale[j] / d, 0.0f, 63.0f)) : 0;
		const int m0 = dmin > 0 ? (int)qz_round(qz_clamp(mn[j] / dmin, 0.0f, 63.0f)) : 0;
		/* the 6-bit codes nearest the fit and their neighbours: keep the pair that decodes best */
		float best = qz_coded_err(xs, ws, d * s0, dmin * m0, nmax);
		ls[j] = (uint8_t)s0;
		lm[j] = (uint8_t)m0;
		for (int ds = -1; ds <= 1; ds++)
			for (int dm = -1; dm <= 1; dm++) {
				const int sc = s0 + ds, m = m0 + dm;
				if ((ds == 0 && dm == 0) || sc < 0 || sc > 63 || m < 0 || m > 63)
					continue;
				const float err = qz_coded_err(xs, ws, d * sc, dmin * m, nmax);
				if (err < best) {
					best = err;
					ls[j] = (uint8_t)sc;
					lm[j] = (uint8_t)m;
				}
			}
		/* the levels against exactly what the decoder computes */
		const float D = d * ls[j], M = dmin * lm[j];
		const float iD = D > 0 ? 1.0f / D : 0.0f;
		for (int i = 0; i < 32; i++)
			L[32 * j + i] = (uint8_t)qz_round(qz_clamp((xs[i] + M) * iD, 0.0f, nmax));
	}
	/* the inverse of quant_scale_min_k4: bytes 0-3 hold scale j (6 bits) and the top 2 bits of
	 * scale j + 4, bytes 4-7 the same for the mins, bytes 8-11 the low nibbles of scale and min
	 * j + 4 */
	for (int j = 0; j < 4; j++) {
		packed[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
		packed[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
		packed[j + 8] = (uint8_t)((ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4));
	}
}

static void qz_q4_k(const float *src, struct block_q4_K *y)
{
	float buf[QK_K];
	const float *x = qz_input(src, buf, QK_K);
	uint8_t L[QK_K];
	qz_k_scales(x, 15.0f, -1.0f, 0.1f, 20, L, y->scales, &y->d, &y->dmin);
	/* per 64 values, 32 bytes: the first 32 values in the low nibbles, the next in the high */
	for (int j = 0; j < QK_K / 64; j++)
		for (int l = 0; l < 32; l++)
			y->qs[32 * j + l] = (uint8_t)(L[64 * j + l] | (L[64 * j + l + 32] << 4));
}

static void qz_q5_k(const float *src, struct block_q5_K *y)
{
	float buf[QK_K];
	const float *x = qz_input(src, buf, QK_K);
	uint8_t L[QK_K];
	qz_k_scales(x, 31.0f, -0.5f, 0.1f, 15, L, y->scales, &y->d, &y->dmin);
	/* the low four bits as Q4_K; the fifth bit of value 64 j + l is bit 2 j of qh[l], that of
	 * value 64 j + 32 + l bit 2 j + 1 */
	memset(y->qh, 0, sizeof(y->qh));
	for (int j = 0; j < QK_K / 64; j++)
		for (int l = 0; l < 32; l++) {
			const int l1 = L[64 * j + l], l2 = L[64 * j + l + 32];
			y->qs[32 * j + l] = (uint8_t)((l1 & 0xF) | ((l2 & 0xF) << 4));
			y->qh[l] |= (uint8_t)(((l1 >> 4) << (2 * j)) | ((l2 >> 4) << (2 * j + 1)));
		}
}

/* ---- the entry point ------------------------------------------------------------------------- */

#define QZ_BLOCKS(type, fn)                                                                   \
	do {                                                                                  \
		const size_t be = dtype_block_elems(t);                                       \
		for (size_t b = 0; b < n / be; b++) {                                         \
			type blk;                                                             \
			fn(src + b * be, &blk);                                               \
			memcpy((char *)dst + b * sizeof(type), &blk, sizeof(type));           \
		}                                                                             \
	} while (0)

void quant_quantize(enum dtype t, const float *src, void *dst, size_t n)
{
	switch (t) {
	case DT_F32:
		memcpy(dst, src, n * sizeof(float));
		break;
	case DT_F16:
	case DT_BF16: {
		uint8_t *out = dst;
		for (size_t i = 0; i < n; i++) {
			const uint16_t h = t == DT_F16 ? f32_to_f16(src[i]) : f32_to_bf16(src[i]);
			memcpy(out + 2 * i, &h, 2);
		}
		break;
	}
	case DT_Q8_0:
		QZ_BLOCKS(struct block_q8_0, qz_q8_0);
		break;
	case DT_Q4_0:
		QZ_BLOCKS(struct block_q4_0, qz_q4_0);
		break;
	case DT_Q4_K:
		QZ_BLOCKS(struct block_q4_K, qz_q4_k);
		break;
	case DT_Q5_K:
		QZ_BLOCKS(struct block_q5_K, qz_q5_k);
		break;
	case DT_Q6_K:
		QZ_BLOCKS(struct block_q6_K, qz_q6_k);
		break;
	default:
		break;
	}
}

/* vec.c - x prepared for the CPU products (cpu_compute.h): float32 for F32/F16 weights, bf16 for
 * BF16, int8 groups for the block formats, laid out as cpu_compute_internal.h's struct cpu_vec
 * says. The conversions run in plain C here or with AVX-512F (vec_avx512.c) to the same bits, so a
 * vector serves the SIMD and the plain kernels alike. */
#include "services/gpu-runner/cpu-compute/cpu_compute_internal.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "common/util.h"

static size_t align_up(size_t v)
{
	return (v + CC_ALIGN - 1) / CC_ALIGN * CC_ALIGN;
}

/* Bytes the arrays of a vector of npad values take for format t (each array CC_ALIGN-aligned). */
static size_t vec_bytes(enum dtype t, uint32_t npad)
{
	if (t == DT_F32 || t == DT_F16)
		return align_up((size_t)npad * 4);
	if (t == DT_BF16)
		return align_up((size_t)npad * 2);
	/* q, d, s, init, sum16 */
	return align_up(npad) + 2 * align_up((size_t)npad / CC_GROUP * 4) + align_up((size_t)npad) +
	       align_up((size_t)npad / 4);
}

static int vec_reserve(struct cpu_vec *v, size_t bytes, char *err, size_t errlen)
{
	if (bytes <= v->cap)
		return 0;
	void *p = aligned_alloc(CC_ALIGN, align_up(bytes));
	if (!p)
		return errorf(err, errlen, -ENOMEM, "cpu vector: cannot allocate %zu bytes", bytes);
	free(v->buf);
	v->buf = p;
	v->cap = align_up(bytes);
	return 0;
}

int cpu_vec_create(uint32_t max_n, struct cpu_vec **out, char *err, size_t errlen)
{
	*out = NULL;
	struct cpu_vec *v = calloc(1, sizeof(*v));
	if (!v)
		return errorf(err, errlen, -ENOMEM, "cpu vector: out of memory");
	if (max_n > CC_MAX_N) {
		free(v);
		return errorf(err, errlen, -EINVAL, "cpu vector: room for %u values asked (at most %u)", max_n,
			      CC_MAX_N);
	}
	if (max_n) {
		uint64_t npad = ((uint64_t)max_n + CC_PAD - 1) / CC_PAD * CC_PAD;
		size_t need = vec_bytes(DT_F32, (uint32_t)npad);
		size_t nq = vec_bytes(DT_Q8_0, (uint32_t)npad);
		int rc = vec_reserve(v, need > nq ? need : nq, err, errlen);
		if (rc) {
			free(v);
			return rc;
		}
	}
	*out = v;
	return 0;
}

void cpu_vec_destroy(struct cpu_vec **v)
{
	if (!v || !*v)
		return;
	free((*v)->buf);
	free(*v);
	*v = NULL;
}

uint32_t cpu_vec_len(const struct cpu_vec *v)
{
	return v->ready ? v->n : 0;
}

float cpu_vec_value(const struct cpu_vec *v, uint32_t i)
{
	if (!v->ready || i >= v->n)
		return 0.0f;
	if (v->f)
		return v->f[i];
	if (v->bf)
		return bf16_to_f32(v->bf[i]);
	return (float)v->q[i] * v->d[i / CC_GROUP];
}

/* Groups of 32 values into int8 as the GPU's dq_stage: d = amax / 127 and q = rint(x * (1 / d))
 * in float32 (IEEE division and reciprocal, round half to even), clamped to +-127; NaN gives 0
 * (fmaxf skips it in amax). Writes q, d and the sums of q over each half (sum16). */
static void quantize_groups(const float *x, uint32_t ngroups, int8_t *q, float *d, int32_t *sum16)
{
	for (uint32_t g = 0; g < ngroups; g++, x += CC_GROUP, q += CC_GROUP) {
		float amax = 0.0f;
		for (int i = 0; i < CC_GROUP; i++)
			amax = fmaxf(amax, fabsf(x[i]));
		const float dg = amax / 127.0f;
		const float id = dg > 0.0f ? 1.0f / dg : 0.0f;
		int32_t sum[2] = {0, 0};
		for (int i = 0; i < CC_GROUP; i++) {
			float t = rintf(x[i] * id);
			int v = t != t ? 0 : t > 127.0f ? 127 : t < -127.0f ? -127 : (int)t;
			q[i] = (int8_t)v;
			sum[i / 16] += v;
		}
		d[g] = dg;
		sum16[2 * g] = sum[0];
		sum16[2 * g + 1] = sum[1];
	}
}

/* The int8 form: codes, scales, run sums, the K formats' d * sum q and the vpdpbusd start of the
 * formats whose weight codes carry an offset (cpu_compute_internal.h, init). */
static void prepare_int8(struct cpu_vec *v, const float *x)
{
	const uint32_t n = v->n, npad = v->npad, ng = n / CC_GROUP;
	uint8_t *p = v->buf;
	v->q = (int8_t *)p;
	p += align_up(npad);
	v->d = (float *)p;
	p += align_up((size_t)npad / CC_GROUP * 4);
	v->s = (float *)p;
	p += align_up((size_t)npad / CC_GROUP * 4);
	v->init = (int32_t *)p;
	p += align_up(npad);
	v->sum16 = (int32_t *)p;
	memset(v->q + n, 0, npad - n);
	memset(v->init, 0, npad);
	for (uint32_t g = ng; g < npad / CC_GROUP; g++) {
		v->d[g] = 0.0f;
		v->s[g] = 0.0f;
		v->sum16[2 * g] = v->sum16[2 * g + 1] = 0;
	}
#if defined(__x86_64__)
	if (cpu_compute_isa() & CPU_ISA_AVX512F)
		cc_avx512_quantize(x, ng, v->q, v->d, v->sum16);
	else
#endif
		quantize_groups(x, ng, v->q, v->d, v->sum16);
	for (uint32_t g = 0; g < ng; g++) {
		const int32_t s0 = v->sum16[2 * g], s1 = v->sum16[2 * g + 1];
		v->s[g] = v->d[g] * (float)(s0 + s1);
		if (v->wfmt == DT_Q8_0 || v->wfmt == DT_Q4_0) {
			v->init[8 * g] = -(v->wfmt == DT_Q8_0 ? 128 : 8) * (s0 + s1);
		} else if (v->wfmt == DT_Q6_K) {
			v->init[8 * g] = -32 * s0;
			v->init[8 * g + 4] = -32 * s1;
		}
	}
}

int cpu_vec_prepare(struct cpu_vec *v, enum dtype wfmt, const float *x, uint32_t n, char *err, size_t errlen)
{
	v->ready = 0;
	v->f = NULL;
	v->bf = NULL;
	v->q = NULL;
	v->d = v->s = NULL;
	v->init = v->sum16 = NULL;
	if ((unsigned)wfmt >= DT_COUNT)
		return errorf(err, errlen, -EINVAL, "cpu vector: unknown weight format %u", (unsigned)wfmt);
	const uint32_t blk = dtype_block_elems(wfmt);
	if (n > CC_MAX_N)
		return errorf(err, errlen, -EINVAL, "cpu vector: %u values (at most %u)", n, CC_MAX_N);
	if (n == 0 || n % blk)
		return errorf(err, errlen, -EINVAL,
			      "cpu vector: %u values for %s weights (need a positive multiple of %u)", n,
			      dtype_name(wfmt), blk);
	const uint64_t npad = ((uint64_t)n + CC_PAD - 1) / CC_PAD * CC_PAD;
	int rc = vec_reserve(v, vec_bytes(wfmt, (uint32_t)npad), err, errlen);
	if (rc)
		return rc;
	v->wfmt = wfmt;
	v->n = n;
	v->npad = (uint32_t)npad;
	if (wfmt == DT_F32 || wfmt == DT_F16) {
		v->f = v->buf;
		memcpy(v->f, x, (size_t)n * 4);
		memset(v->f + n, 0, (size_t)(npad - n) * 4);
	} else if (wfmt == DT_BF16) {
		v->bf = v->buf;
#if defined(__x86_64__)
		if (cpu_compute_isa() & CPU_ISA_AVX512F)
			cc_avx512_to_bf16(x, n, v->bf);
		else
#endif
			for (uint32_t i = 0; i < n; i++)
				v->bf[i] = f32_to_bf16(x[i]);
		memset(v->bf + n, 0, (size_t)(npad - n) * 2);
	} else {
		prepare_int8(v, x);
	}
	v->ready = 1;
	return 0;
}

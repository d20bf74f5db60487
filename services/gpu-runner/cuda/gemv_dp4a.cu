/* gemv_dp4a.cu - the one-token products with x quantized to int8 (their kernels:
 * gemv_dp4a.cuh): which products take that path (dq_takes, qgemv_fuses_x), their grids (blocks of
 * one row group or wide blocks, dq_sm_kernel through shared memory where rows are 16-byte aligned,
 * else dq_kernel), and one launch for a product whose parts come in two formats (dq_mix_kernel).
 * gemv_quant.cu's qgemv_launch sends one-token products here. */
#include "services/gpu-runner/cuda/gemv_quant.cuh"
#include "services/gpu-runner/cuda/gemv_dp4a.cuh"

#include <string.h>

/* Lets kernel k take `bytes` of dynamic shared memory beyond the default. */
template <typename... P> static cudaError_t allow_smem(void (*k)(P...), uint32_t bytes)
{
	return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

/* Format F's kernels in each mode M: dq_sm_kernel's blocks may take what a block can opt in to
 * beside its static shared memory (wide blocks: x and the stages of up to DQ_WIDE_MAX row groups'
 * warps; launch_dq_k checks each launch's), dq_kernel's QG_SMEM_MAX. The first error, or success. */
template <int F, int... M> static cudaError_t allow_dq_modes(uint32_t max_bytes)
{
	cudaError_t e = cudaSuccess;
	((e = e != cudaSuccess ? e : allow_smem(dq_sm_kernel<F, M>, max_bytes)), ...);
	((e = e != cudaSuccess ? e : allow_smem(dq_sm_kernel<F, M | GEMV_WHOLE_BIT>, max_bytes)), ...);
	((e = e != cudaSuccess ? e : allow_smem(dq_kernel<F, M>, QG_SMEM_MAX)), ...);
	return e;
}

template <int F> static cudaError_t allow_dq(uint32_t max_bytes)
{
	return allow_dq_modes<F, GEMV_STORE, GEMV_ADD, GEMV_SWIGLU, GEMV_STORE | GEMV_MATS_BIT,
			      GEMV_SWIGLU | GEMV_MATS_BIT>(max_bytes);
}

/* The integer path's kernels' shared memory (gemv_quant.cu's qgemv_init calls it). */
cudaError_t dq_init(uint32_t dq_smem_max)
{
	cudaError_t e;
	if ((e = allow_dq<DT_Q8_0>(dq_smem_max)) || (e = allow_dq<DT_Q4_K>(dq_smem_max)) ||
	    (e = allow_dq<DT_Q6_K>(dq_smem_max)) || (e = allow_smem(dq_mix_kernel<DT_Q4_K, DT_Q6_K, false>, dq_smem_max)) ||
	    (e = allow_smem(dq_mix_kernel<DT_Q4_K, DT_Q8_0, false>, dq_smem_max)) ||
	    (e = allow_smem(dq_mix_kernel<DT_Q4_K, DT_Q6_K, true>, dq_smem_max)) ||
	    (e = allow_smem(dq_mix_kernel<DT_Q4_K, DT_Q8_0, true>, dq_smem_max)))
		return e;
	return cudaSuccess;
}

/* The grid of a launch that `cap` blocks fill at once: a block a row group up to it; with several
 * matrices, an equal run of blocks each (a.m.blocks), together about cap. */
static unsigned dq_grid(qgemv_args &a, uint32_t cap)
{
	if (!a.m.n)
		return a.groups < cap ? a.groups : cap;
	uint32_t per = cap / a.m.n;
	per = per < 1 ? 1 : per > a.groups ? a.groups : per;
	a.m.blocks = per;
	return per * a.m.n;
}

/* Could dq_sm_kernel take these args (rows and tensors 16-byte aligned, so cp.async copies them)? */
static bool dq_sm_aligned(const qgemv_args &a)
{
	bool ok = a.row_bytes % 16 == 0;
	for (uint32_t i = 0; i < 3 && ok; i++)
		ok = (uintptr_t)a.w[i] % 16 == 0;
	for (uint32_t j = 0; j < a.m.n && ok; j++)
		ok = (uintptr_t)a.m.w[j] % 16 == 0 && (uintptr_t)a.m.w2[j] % 16 == 0;
	return ok;
}

/* Does a take the walk of rows of whole steps (dq_sm_rows_whole): every row nb blocks, a multiple
 * of a step's, and the backend's choice (BACKEND_FUSE_ANY_ITEMS walks any rows the general way)? */
template <int F> static bool dq_whole(const struct backend_dev *be, const qgemv_args &a)
{
	return be->whole_dq && a.nb % qg<F>::BPS == 0;
}

/* The shared-memory kernel of MODE (GEMV_WHOLE_BIT or not) in blocks of one row group or wide. */
template <int F, int MODE> static void launch_dq_sm(struct backend_dev *be, qgemv_args &a, size_t ssm, cudaStream_t s)
{
	const void *fn = (const void *)dq_sm_kernel<F, MODE>;
	const uint32_t per_sm = qg_resident_blocks(be, fn, ssm);
	be->whole_launches += (MODE & GEMV_WHOLE_BIT) != 0;
	unsigned grid = dq_grid(a, (uint32_t)be->sm_count * per_sm);
	/* Wide blocks: the row-group blocks a multiprocessor would hold side by side, as one block
	 * (V of them) that stages x once for all, where one such block fits. V is the grid over
	 * the multiprocessors, rounded up (at most what one holds, and DQ_WIDE_MAX): the busiest
	 * multiprocessor holds as many row groups as before, though a grid a little over a
	 * multiple of the multiprocessors leaves some of them idle (140 row groups on 132: 70 at
	 * work, two each). Not for q/k/v (be->dq_narrow): the attention's blocks, launched
	 * before these end, find room sooner beside blocks of one row group. */
	uint32_t v = (grid + be->sm_count - 1) / be->sm_count;
	v = v > per_sm ? per_sm : v > DQ_WIDE_MAX ? DQ_WIDE_MAX : v;
	if (!(MODE & GEMV_MATS_BIT) && be->wide_dq && !be->dq_narrow && v > 1) {
		const size_t wsm = dq_sm_smem(F, a.in, v * QG_WARPS);
		if (wsm <= be->dq_smem_max && qg_resident_blocks(be, fn, wsm, v * QG_THREADS) >= 1) {
			a.vb_apart = be->rows_apart;
			launch_k(be->pdl, dq_sm_kernel<F, MODE>, (grid + v - 1) / v, v * QG_THREADS, wsm, s, a);
			be->wide_launches++;
			be->apart_launches += be->rows_apart;
			return;
		}
	}
	launch_k(be->pdl, dq_sm_kernel<F, MODE>, grid, QG_THREADS, ssm, s, a);
}

template <int F, int MODE> static void launch_dq_k(struct backend_dev *be, const qgemv_args &ga, cudaStream_t s)
{
	qgemv_args a = ga;
	const size_t ssm = dq_sm_smem(F, a.in, QG_WARPS);
	if (be->dq_sm && ssm <= DQ_SM_SMEM_MAX && ssm <= be->dq_smem_max && dq_sm_aligned(a)) {
		if (dq_whole<F>(be, a))
			launch_dq_sm<F, MODE | GEMV_WHOLE_BIT>(be, a, ssm, s);
		else
			launch_dq_sm<F, MODE>(be, a, ssm, s);
		return;
	}
	const size_t smem = dq_smem(a.in);
	const void *fn = (const void *)dq_kernel<F, MODE>;
	const unsigned grid = dq_grid(a, (uint32_t)be->sm_count * qg_resident_blocks(be, fn, smem));
	launch_k(be->pdl, dq_kernel<F, MODE>, grid, QG_THREADS, smem, s, a);
}

template <int F> static void launch_dq(struct backend_dev *be, const qgemv_args &a, int mode, cudaStream_t s)
{
	if (a.m.n)
		mode == GEMV_SWIGLU ? launch_dq_k<F, GEMV_SWIGLU | GEMV_MATS_BIT>(be, a, s)
				    : launch_dq_k<F, GEMV_STORE | GEMV_MATS_BIT>(be, a, s);
	else if (mode == GEMV_SWIGLU)
		launch_dq_k<F, GEMV_SWIGLU>(be, a, s);
	else if (mode == GEMV_ADD)
		launch_dq_k<F, GEMV_ADD>(be, a, s);
	else
		launch_dq_k<F, GEMV_STORE>(be, a, s);
}

/* Does the product take the integer path: one token, the backend's choice, a format it has, x
 * staged whole in shared memory and 16-byte aligned? */
bool dq_takes(const struct backend_dev *be, uint32_t fmt, const qgemv_args &a)
{
	bool x_ok = (uintptr_t)a.x % 16 == 0;
	for (uint32_t j = 0; j < a.m.n; j++)
		x_ok = x_ok && (uintptr_t)a.m.x[j] % 16 == 0;
	return be->qgemv_dp4a && a.n == 1 && (fmt == DT_Q4_K || fmt == DT_Q6_K || fmt == DT_Q8_0) &&
	       dq_smem(a.in) <= QG_SMEM_MAX && x_ok;
}

bool qgemv_integer(const struct backend_dev *be, uint32_t fmt, uint32_t in, const void *x)
{
	qgemv_args a;
	memset(&a, 0, sizeof(a));
	a.n = 1;
	a.in = in;
	a.x = (const __nv_bfloat16 *)x;
	return dq_takes(be, fmt, a);
}

bool qgemv_fuses_x(const struct backend_dev *be, uint32_t in, const struct mm_part *parts, uint32_t np)
{
	if (!be->fuse_x || !be->qgemv_dp4a || in % 8 || dq_smem(in) > QG_SMEM_MAX)
		return false;
	for (uint32_t i = 0; i < np; i++) {
		const uint32_t f = parts[i].format;
		if ((f != DT_Q4_K && f != DT_Q6_K && f != DT_Q8_0) || !qgemv_fits(be, f, in, 1, parts + i, 1))
			return false;
	}
	return true;
}

/* The row-group blocks of a launch of two formats (`blocks` of them fill the GPU at once) shared
 * between a's row groups and b's: where both fit, one each; else the split whose busiest warp reads
 * the fewest bytes (its rows times the bytes of a row), the more blocks to a among equals. Tried by
 * a's row groups a block (ka: a then takes ceil(a.groups / ka) blocks), fewest first, until a's
 * share alone costs more than the best. */
static void dq_mix_split(qgemv_args &a, qgemv_args &b, uint32_t blocks)
{
	a.vb0 = 0;
	if (a.groups + b.groups <= blocks || blocks < 2) {
		a.vbn = a.groups;
		b.vbn = b.groups;
	} else {
		uint64_t best = UINT64_MAX;
		b.vbn = blocks - blocks / 2;
		for (uint32_t ka = 1; ka <= a.groups && (uint64_t)ka * a.row_bytes < best; ka++) {
			const uint32_t na = (a.groups + ka - 1) / ka;
			if (na >= blocks)
				continue;
			const uint32_t nb = blocks - na;
			const uint64_t cb = (uint64_t)((b.groups + nb - 1) / nb) * b.row_bytes;
			const uint64_t c = (uint64_t)ka * a.row_bytes > cb ? (uint64_t)ka * a.row_bytes : cb;
			if (c < best) {
				best = c;
				b.vbn = nb > b.groups ? b.groups : nb;
			}
		}
		/* a takes the blocks b leaves (so fewer of its blocks take ka row groups). */
		a.vbn = blocks - b.vbn < a.groups ? blocks - b.vbn : a.groups;
	}
	b.vb0 = a.vbn;
}

/* The launch of two formats, a's and b's launch fields filled: false, launching nothing, where a
 * block of one row group's shared memory is more than a block may take. */
template <int F2, bool W> static bool launch_mix_k(struct backend_dev *be, qgemv_args &a, qgemv_args &b, cudaStream_t s)
{
	const void *fn = (const void *)dq_mix_kernel<DT_Q4_K, F2, W>;
	const uint32_t ring = dq_mix_ring<DT_Q4_K, F2>::V;
	const size_t x = dq_smem_f<DT_Q4_K>(a.in), narrow = x + (size_t)QG_WARPS * ring;
	if (narrow > DQ_SM_SMEM_MAX || narrow > be->dq_smem_max)
		return false;
	a.tr = ktrace_next(be, "product (two formats)");
	const uint32_t per_sm = qg_resident_blocks(be, fn, narrow);
	dq_mix_split(a, b, (uint32_t)be->sm_count * per_sm);
	const uint32_t vblocks = a.vbn + b.vbn;
	/* Wide blocks as launch_dq_k makes them: V row-group blocks a block, the grid one wave. */
	uint32_t v = (vblocks + be->sm_count - 1) / be->sm_count;
	v = v > per_sm ? per_sm : v > DQ_WIDE_MAX ? DQ_WIDE_MAX : v;
	for (; v >= 1; v--) {
		const size_t smem = x + (size_t)v * QG_WARPS * ring;
		const uint32_t grid = (vblocks + v - 1) / v;
		if (v == 1 || (be->wide_dq && !be->dq_narrow && smem <= be->dq_smem_max &&
			       grid <= (uint32_t)be->sm_count * qg_resident_blocks(be, fn, smem, v * QG_THREADS))) {
			if (v > 1)
				be->wide_launches++;
			launch_k(be->pdl, dq_mix_kernel<DT_Q4_K, F2, W>, grid, v * QG_THREADS, smem, s, a, b);
			be->mix_launches++;
			be->whole_launches += W;
			return true;
		}
	}
	return false; /* no block fits (qg_resident_blocks gives at least 1 for a narrow one): the caller
		       * launches each format apart */
}

bool qgemv_launch_mix(struct backend_dev *be, const struct mm_part *p1, uint32_t n1, const struct mm_part *p2,
		      uint32_t n2, const void *x, const struct xsrc *src, uint32_t in, uint32_t ldc)
{
	if (p2[0].format == DT_Q4_K) { /* a is the Q4_K run, whose x layout serves both */
		const struct mm_part *tp = p1;
		p1 = p2;
		p2 = tp;
		const uint32_t tn = n1;
		n1 = n2;
		n2 = tn;
	}
	const uint32_t f2 = p2[0].format;
	if (!be->mix_dq || !be->dq_sm || p1[0].format != DT_Q4_K || (f2 != DT_Q6_K && f2 != DT_Q8_0) ||
	    !qgemv_fits(be, DT_Q4_K, in, 1, p1, n1) || !qgemv_fits(be, f2, in, 1, p2, n2))
		return false;
	qgemv_args g[2];
	const struct mm_part *pp[2] = {p1, p2};
	const uint32_t np[2] = {n1, n2}, fmt[2] = {DT_Q4_K, f2};
	for (uint32_t k = 0; k < 2; k++) {
		qgemv_args &a = g[k];
		qgemv_args_of(a, pp[k], np[k], x, src, in, 1, ldc);
		qg_fill(fmt[k], a);
		if (!dq_takes(be, fmt[k], a) || !dq_sm_aligned(a))
			return false;
	}
	/* Rows of whole steps in both formats: the walk of dq_sm_rows_whole. */
	const bool whole = dq_whole<DT_Q4_K>(be, g[0]) &&
			   (f2 == DT_Q6_K ? dq_whole<DT_Q6_K>(be, g[1]) : dq_whole<DT_Q8_0>(be, g[1]));
	if (f2 == DT_Q6_K)
		return whole ? launch_mix_k<DT_Q6_K, true>(be, g[0], g[1], be->stream)
			     : launch_mix_k<DT_Q6_K, false>(be, g[0], g[1], be->stream);
	return whole ? launch_mix_k<DT_Q8_0, true>(be, g[0], g[1], be->stream)
		     : launch_mix_k<DT_Q8_0, false>(be, g[0], g[1], be->stream);
}

/* A product that dq_takes, launched in its format (a's launch fields filled by qg_fill). */
void dq_launch(struct backend_dev *be, uint32_t fmt, const qgemv_args &a, int mode, cudaStream_t s)
{
	if (fmt == DT_Q4_K)
		launch_dq<DT_Q4_K>(be, a, mode, s);
	else if (fmt == DT_Q6_K)
		launch_dq<DT_Q6_K>(be, a, mode, s);
	else
		launch_dq<DT_Q8_0>(be, a, mode, s);
}

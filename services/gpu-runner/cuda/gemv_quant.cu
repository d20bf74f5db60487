/* gemv_quant.cu - products of a few tokens (decode: n <= QGEMV_MAX_TOKENS) with block-quantized
 * weights read as they are stored (GGUF's Q8_0, Q4_0, Q4_K, Q5_K, Q6_K): out[t][o] (+)= W[o] . x[t],
 * or SiLU(gate) * up for one token. The weights cross the memory bus once, as quantized bytes.
 * This file holds the path with x as float32 (qgemv_kernel) and the launch of every product:
 * one token goes to the integer path where it takes it (gemv_dp4a.cu), the rest here. The lanes'
 * geometry, the quants' unpacking and a warp's walk over its rows are gemv_quant.cuh's.
 *
 * x in shared memory. The bf16 inputs (n, in) are widened to float32 into shared memory in the
 * order lanes read them: piece c (4 values) of lane L at float4 index L * PPL + (c ^ (L & 7)), so
 * the 8 lanes of a 128-bit access phase hit 8 different bank groups. Inputs wider than the
 * shared memory of a block (QG_SMEM_MAX) are staged a tile of steps at a time. */
#include "services/gpu-runner/cuda/gemv_quant.cuh"

#include <assert.h>
#include <string.h>

/* ---- the kernel ------------------------------------------------------------------------- */

/* Stages tile `tile` (ts steps) of x into shared memory: pieces (NT, ts, 32 lanes, PPL) as float4
 * in the lanes' order, then the lanes' group sums (NT, ts, 32). Tokens >= n and values >= in are
 * zeros. Called by every thread of the block; ends with a barrier. */
template <int F, int NT>
static __device__ void qg_stage(float4 *xs, float4 *xsum, const qgemv_args &a, uint32_t tile, uint32_t ts)
{
	typedef qg<F> T;
	const uint32_t per_step = T::S / 4, per_tok = ts * per_step, v0 = tile * ts * T::S;
	for (uint32_t i = threadIdx.x; i < NT * per_tok; i += blockDim.x) {
		const uint32_t t = i / per_tok, k = i % per_tok, sl = k / per_step, p = (k % per_step) * 4;
		const uint32_t pos = v0 + sl * T::S + p;
		uint32_t L, c;
		T::piece(p, L, c);
		float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
		if (t < a.n && pos < a.in) {
			const uint2 raw = *(const uint2 *)(a.x + (size_t)t * a.in + pos); /* 4 bf16 */
			v.x = __uint_as_float(raw.x << 16);
			v.y = __uint_as_float(raw.x & 0xFFFF0000u);
			v.z = __uint_as_float(raw.y << 16);
			v.w = __uint_as_float(raw.y & 0xFFFF0000u);
		}
		xs[((t * ts + sl) * 32 + L) * T::PPL + (c ^ (L & 7))] = v;
	}
	__syncthreads();
	for (uint32_t i = threadIdx.x; i < NT * ts * 32; i += blockDim.x) {
		const uint32_t lx = i & 7;
		const float4 *px = xs + (size_t)i * T::PPL;
		float g[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
		for (uint32_t c = 0; c < T::PPL; c++) {
			const float4 v = px[c ^ lx];
			g[c >> 2] += (v.x + v.y) + (v.z + v.w);
		}
		xsum[i] = make_float4(g[0], g[1], g[2], g[3]);
	}
	__syncthreads();
}

/* Adds a lane's share of item k (its step staged as tile step sl) to acc (up's items to acc2). */
template <int F, int NT, int MODE>
static __device__ __forceinline__ void qg_dot(const qgemv_args &a, uint32_t k, uint32_t sl, uint32_t lane,
					      const typename qg<F>::data &d, const float4 *xs, const float4 *xsum,
					      uint32_t xstride, uint32_t mstride, float *acc, float *acc2)
{
	typedef qg<F> T;
	const uint32_t s = GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? k >> 1 : k;
	const uint32_t b = s * T::BPS + lane / T::LPB;
	if (b < a.nb) {
		const float4 *x0 = xs + ((size_t)sl * 32 + lane) * T::PPL, *m0 = xsum + sl * 32 + lane;
		T::template dot<NT>(d, lane % T::LPB, x0, xstride, m0, mstride, lane & 7,
				    GEMV_MODE_OF(MODE) == GEMV_SWIGLU && (k & 1) ? acc2 : acc);
	}
}

/* Buffers of item bytes a warp holds when x is staged whole: the loads of D - 1 items are in
 * flight while one item's arithmetic runs. Decode (one token) takes three: a row of 4096 values is
 * two items, so two buffers left one item (1152 bytes of Q4_K per warp) in flight, too few to
 * cover the memory latency at the occupancy the registers allow; the third buffer costs 5 to 20
 * registers (the format's item bytes). More tokens take two (their accumulators need the
 * registers). */
template <int NT> struct qg_depth {
	static constexpr int D = NT == 1 ? 3 : 2;
};

/* One stage of a warp's stream when x is staged whole: loads the item at cursor ld into nd (and
 * moves ld on), then computes the item at cursor at from cd, finishing its row after its last
 * item, and moves on. False when no item follows. Called with the buffers in turn, so the loads
 * of the next items are in flight while one item's arithmetic runs, across rows too. */
template <int F, int NT, int MODE>
static __device__ __forceinline__ bool qg_stream(const qgemv_args &a, qg_cursor<MODE> &at, qg_cursor<MODE> &ld,
						 uint32_t wid, uint32_t lane, const typename qg<F>::data &cd,
						 typename qg<F>::data &nd, const float4 *xs, const float4 *xsum,
						 uint32_t xstride, uint32_t mstride, float *acc, float *acc2)
{
	if (ld.live) {
		qg_load<F, MODE>(a, ld.r, ld.k, lane, nd);
		ld.next(a, wid);
	}
	const uint32_t k = at.k;
	qg_dot<F, NT, MODE>(a, k, GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? k >> 1 : k, lane, cd, xs, xsum, xstride, mstride, acc, acc2);
	if (k + 1 == qg_items<MODE>(a))
		qg_finish<NT, MODE>(a, at.r.p, at.r.o, lane, acc, acc2);
	at.next(a, wid);
	return at.live;
}

template <int F, int NT, int MODE> __global__ void __launch_bounds__(QG_THREADS) qgemv_kernel(const qgemv_args a)
{
	typedef qg<F> T;
	typedef typename T::data D;
	extern __shared__ float4 qg_smem[];
	const uint32_t wid = threadIdx.x / 32, lane = threadIdx.x % 32;
	const uint32_t ts = a.tile_steps, ntiles = (a.steps + ts - 1) / ts;
	const uint32_t xstride = ts * 32 * T::PPL, mstride = ts * 32; /* float4 per token */
	float4 *xs = qg_smem, *xsum = qg_smem + NT * xstride;
	float acc[NT], acc2[NT];
#pragma unroll
	for (int t = 0; t < NT; t++)
		acc[t] = acc2[t] = 0.0f;
	qg_row<MODE> cur;
	bool live = cur.at(a, qg_first_group<MODE>(a), wid);
	grid_launch_next();
	if (live) {
		/* The first row's bytes start coming while x is staged. */
		prefetch_l2(cur.row, a.row_bytes, lane);
		if (GEMV_MODE_OF(MODE) == GEMV_SWIGLU)
			prefetch_l2(cur.row2, a.row_bytes, lane);
	}

	if (ntiles == 1) {
		/* x staged once serves every row the block takes: each warp streams its items, the
		 * first ones loaded into registers before x is staged. */
		qg_cursor<MODE> at = {cur, 0, live}, ld = at;
		D d0, d1, d2;
		if (ld.live) {
			qg_load<F, MODE>(a, ld.r, ld.k, lane, d0);
			ld.next(a, wid);
		}
		if (qg_depth<NT>::D == 3 && ld.live) {
			qg_load<F, MODE>(a, ld.r, ld.k, lane, d1);
			ld.next(a, wid);
		}
		grid_wait();
		qg_stage<F, NT>(xs, xsum, a, 0, ts);
		if (!live)
			return; /* no barrier follows */
		if (qg_depth<NT>::D == 3) {
			while (qg_stream<F, NT, MODE>(a, at, ld, wid, lane, d0, d2, xs, xsum, xstride, mstride, acc, acc2) &&
			       qg_stream<F, NT, MODE>(a, at, ld, wid, lane, d1, d0, xs, xsum, xstride, mstride, acc, acc2) &&
			       qg_stream<F, NT, MODE>(a, at, ld, wid, lane, d2, d1, xs, xsum, xstride, mstride, acc, acc2))
				;
		} else {
			while (qg_stream<F, NT, MODE>(a, at, ld, wid, lane, d0, d1, xs, xsum, xstride, mstride, acc, acc2) &&
			       qg_stream<F, NT, MODE>(a, at, ld, wid, lane, d1, d0, xs, xsum, xstride, mstride, acc, acc2))
				;
		}
		return;
	}

	/* x wider than a block's shared memory: row group by row group, tile by tile (every warp
	 * of the block takes part in each staging, rows or not). */
	grid_wait();
	for (uint32_t rg = blockIdx.x; rg < a.groups; rg += gridDim.x) {
		live = cur.at(a, rg, wid);
		for (uint32_t tile = 0; tile < ntiles; tile++) {
			__syncthreads(); /* every warp is done with the tile staged before */
			qg_stage<F, NT>(xs, xsum, a, tile, ts);
			if (!live)
				continue;
			const uint32_t s0 = tile * ts, cnt = min(ts, a.steps - s0);
			const uint32_t per = GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? 2 : 1; /* items per step */
			for (uint32_t k = s0 * per; k < (s0 + cnt) * per; k++) {
				D d0;
				qg_load<F, MODE>(a, cur, k, lane, d0);
				qg_dot<F, NT, MODE>(a, k, k / per - s0, lane, d0, xs, xsum, xstride, mstride, acc, acc2);
			}
		}
		if (live)
			qg_finish<NT, MODE>(a, cur.p, cur.o, lane, acc, acc2);
	}
}

/* ---- launchers ---------------------------------------------------------------------------- */

static uint32_t ppl_of(uint32_t fmt)
{
	return fmt == DT_Q8_0 ? qg<DT_Q8_0>::PPL : fmt == DT_Q4_0 ? qg<DT_Q4_0>::PPL : qg<DT_Q4_K>::PPL;
}

static uint32_t step_values(uint32_t fmt)
{
	return fmt == DT_Q8_0 ? qg<DT_Q8_0>::S : fmt == DT_Q4_0 ? qg<DT_Q4_0>::S : qg<DT_Q4_K>::S;
}

static_assert(qg<DT_Q5_K>::PPL == qg<DT_Q4_K>::PPL && qg<DT_Q6_K>::PPL == qg<DT_Q4_K>::PPL &&
		      qg<DT_Q5_K>::S == qg<DT_Q4_K>::S && qg<DT_Q6_K>::S == qg<DT_Q4_K>::S,
	      "the K formats share one lane geometry");

/* Shared memory of one step of one token: its pieces and the lanes' group sums. */
static size_t step_smem(uint32_t fmt)
{
	return (size_t)32 * 16 * (ppl_of(fmt) + 1);
}

template <int F, int NT, int MODE> static cudaError_t allow(void)
{
	return cudaFuncSetAttribute(qgemv_kernel<F, NT, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				    (int)QG_SMEM_MAX);
}

template <int F> static cudaError_t allow_f(void)
{
	cudaError_t e;
	if ((e = allow<F, 1, GEMV_STORE>()) || (e = allow<F, 2, GEMV_STORE>()) || (e = allow<F, 4, GEMV_STORE>()) ||
	    (e = allow<F, 8, GEMV_STORE>()) || (e = allow<F, 1, GEMV_ADD>()) || (e = allow<F, 2, GEMV_ADD>()) ||
	    (e = allow<F, 4, GEMV_ADD>()) || (e = allow<F, 8, GEMV_ADD>()) || (e = allow<F, 1, GEMV_SWIGLU>()))
		return e;
	return cudaSuccess;
}

cudaError_t qgemv_init(uint32_t dq_smem_max)
{
	cudaError_t e;
	if ((e = allow_f<DT_Q8_0>()) || (e = allow_f<DT_Q4_0>()) || (e = allow_f<DT_Q4_K>()) ||
	    (e = allow_f<DT_Q5_K>()) || (e = allow_f<DT_Q6_K>()))
		return e;
	return dq_init(dq_smem_max);
}

/* Blocks of kernel fn with smem bytes that fit a multiprocessor at once (the occupancy
 * calculator's answer, remembered per backend: a handful of (kernel, size) pairs per model). The
 * grid is that many per multiprocessor, so no block waits for a second wave: each walks an equal
 * share of the row groups. */
uint32_t qg_resident_blocks(struct backend_dev *be, const void *fn, size_t smem, uint32_t threads)
{
	for (uint32_t i = 0; i < be->qg_occ_n; i++)
		if (be->qg_occ[i].fn == fn && be->qg_occ[i].smem == smem && be->qg_occ[i].threads == threads)
			return be->qg_occ[i].blocks;
	int nb = 0;
	if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, (int)threads, smem) != cudaSuccess || nb < 1) {
		cudaGetLastError(); /* not sticky: the launch reports what is wrong */
		nb = threads == QG_THREADS ? 1 : 0;
	}
	uint32_t i = be->qg_occ_n < QG_OCC_CACHE ? be->qg_occ_n++ : (uint32_t)((uintptr_t)fn / 64 % QG_OCC_CACHE);
	be->qg_occ[i].fn = fn;
	be->qg_occ[i].smem = smem;
	be->qg_occ[i].threads = threads;
	be->qg_occ[i].blocks = (uint32_t)nb;
	return (uint32_t)nb;
}

template <int F, int NT, int MODE>
static void launch_k(struct backend_dev *be, const qgemv_args &a, size_t smem, cudaStream_t s)
{
	const void *fn = (const void *)qgemv_kernel<F, NT, MODE>;
	const uint32_t cap = (uint32_t)be->sm_count * qg_resident_blocks(be, fn, smem);
	const unsigned grid = a.groups < cap ? a.groups : cap;
	launch_k(be->pdl, qgemv_kernel<F, NT, MODE>, grid, QG_THREADS, smem, s, a);
}

template <int F, int NT>
static void launch_nt(struct backend_dev *be, const qgemv_args &a, int mode, size_t smem, cudaStream_t s)
{
	if (mode == GEMV_STORE)
		launch_k<F, NT, GEMV_STORE>(be, a, smem, s);
	else
		launch_k<F, NT, GEMV_ADD>(be, a, smem, s);
}

template <int F>
static void launch_f(struct backend_dev *be, const qgemv_args &a, int mode, uint32_t nt, size_t smem, cudaStream_t s)
{
	if (mode == GEMV_SWIGLU)
		launch_k<F, 1, GEMV_SWIGLU>(be, a, smem, s);
	else if (nt == 1)
		launch_nt<F, 1>(be, a, mode, smem, s);
	else if (nt == 2)
		launch_nt<F, 2>(be, a, mode, smem, s);
	else if (nt == 4)
		launch_nt<F, 4>(be, a, mode, smem, s);
	else
		launch_nt<F, 8>(be, a, mode, smem, s);
}

bool qgemv_fits(const struct backend_dev *be, uint32_t fmt, uint32_t in, uint32_t n, const struct mm_part *parts,
		uint32_t np)
{
	if (!be->gemv_rows || !be->qgemv_ok || n == 0 || n > QGEMV_MAX_TOKENS ||
	    in % dtype_block_elems((enum dtype)fmt))
		return false;
	/* Q4_K and Q5_K are read with 16-byte loads; the others need their 2-byte scales aligned. */
	uintptr_t align = fmt == DT_Q4_K || fmt == DT_Q5_K ? 16 : 2;
	for (uint32_t i = 0; i < np; i++)
		if ((uintptr_t)parts[i].w % align)
			return false;
	return true;
}

void qgemv_args_of(qgemv_args &g, const struct mm_part *parts, uint32_t np, const void *x, const struct xsrc *src,
		   uint32_t in, uint32_t n, uint32_t ldc)
{
	memset(&g, 0, sizeof(g));
	for (uint32_t i = 0; i < np; i++) {
		g.w[i] = (const uint8_t *)parts[i].w;
		g.out[i] = parts[i].out;
		g.rows[i] = parts[i].rows;
		g.total += parts[i].rows;
	}
	g.row_bytes = parts[0].row_bytes;
	g.in = in;
	g.n = n;
	g.ldc = ldc;
	g.x = (const __nv_bfloat16 *)x;
	if (src)
		g.src = *src;
}

/* The launch fields of a product's args in format fmt (tile_steps: x staged whole, as the integer
 * path stages it; the float path sets its own). */
void qg_fill(uint32_t fmt, qgemv_args &a)
{
	a.nb = a.in / dtype_block_elems((enum dtype)fmt);
	a.steps = (a.in + step_values(fmt) - 1) / step_values(fmt);
	a.groups = (a.total + QG_WARPS - 1) / QG_WARPS;
	a.tile_steps = a.steps;
}

void qgemv_launch(struct backend_dev *be, uint32_t fmt, qgemv_args &a, int mode, cudaStream_t s)
{
	assert(a.n >= 1 && a.n <= QG_MAX_NT && (mode != GEMV_SWIGLU || a.n == 1));
	a.tr = ktrace_next(be, GEMV_MODE_OF(mode) == GEMV_SWIGLU ? "product (SwiGLU)"
			   : GEMV_MODE_OF(mode) == GEMV_ADD  ? "product (added)"
							     : "product");
	const uint32_t nt = a.n == 1 ? 1 : a.n == 2 ? 2 : a.n <= 4 ? 4 : 8;
	qg_fill(fmt, a);
	assert((a.src.kind == XSRC_ACT && !a.m.n) || dq_takes(be, fmt, a));
	assert(!a.m.n || (a.m.n <= GEMV_MATS && a.src.kind == XSRC_ACT && mode != GEMV_ADD));
	if (dq_takes(be, fmt, a)) {
		dq_launch(be, fmt, a, mode, s);
		return;
	}
	uint32_t ts = (uint32_t)(QG_SMEM_MAX / (nt * step_smem(fmt)));
	a.tile_steps = ts < 1 ? 1 : ts > a.steps ? a.steps : ts;
	const size_t smem = nt * a.tile_steps * step_smem(fmt);
	switch (fmt) {
	case DT_Q8_0:
		launch_f<DT_Q8_0>(be, a, mode, nt, smem, s);
		break;
	case DT_Q4_0:
		launch_f<DT_Q4_0>(be, a, mode, nt, smem, s);
		break;
	case DT_Q4_K:
		launch_f<DT_Q4_K>(be, a, mode, nt, smem, s);
		break;
	case DT_Q5_K:
		launch_f<DT_Q5_K>(be, a, mode, nt, smem, s);
		break;
	default:
		launch_f<DT_Q6_K>(be, a, mode, nt, smem, s);
		break;
	}
}

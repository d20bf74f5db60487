/* gemv.cu - the matrix-vector kernel of decode steps (one token, BF16 or F16 weights): each warp
 * streams one weight row (or two) with 16-byte loads, several in flight, and the kernel fuses
 * what follows the product (the residual add of o_proj and down_proj; SiLU(gate) * up, written
 * in the weight dtype). On an H100 one row per warp was the fastest. Several matrices of one shape
 * (a layer's experts, gemv_args.m) go in one launch, a run of blocks each. */
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cuda/device.cuh"

static __device__ __forceinline__ void dot8(float &acc, const uint4 &w, const uint4 &x, __nv_bfloat16)
{
	const __nv_bfloat162 *wp = reinterpret_cast<const __nv_bfloat162 *>(&w);
	const __nv_bfloat162 *xp = reinterpret_cast<const __nv_bfloat162 *>(&x);
#pragma unroll
	for (int k = 0; k < 4; k++) {
		float2 a = to_f32x2(wp[k]), b = to_f32x2(xp[k]);
		acc = fmaf(a.x, b.x, acc);
		acc = fmaf(a.y, b.y, acc);
	}
}

static __device__ __forceinline__ void dot8(float &acc, const uint4 &w, const uint4 &x, __half)
{
	const __half2 *wp = reinterpret_cast<const __half2 *>(&w);
	const __half2 *xp = reinterpret_cast<const __half2 *>(&x);
#pragma unroll
	for (int k = 0; k < 4; k++) {
		float2 a = to_f32x2(wp[k]), b = to_f32x2(xp[k]);
		acc = fmaf(a.x, b.x, acc);
		acc = fmaf(a.y, b.y, acc);
	}
}

/* Each warp computes R output rows: lanes stride the rows in 16-byte chunks, GEMV_UNROLL loads
 * per row in flight (weights are read once per token: streaming loads; x stays in L1 and is
 * shared by the R rows). The sums run in the same order for any R. */
template <typename T, int MODE, int R, bool M>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_kernel(const gemv_args a)
{
	/* Several matrices (M, a kernel of its own so that the others' code is what it was): this
	 * block's matrix j and its place among that one's blocks. */
	const uint32_t j = M ? blockIdx.x / a.m.blocks : 0;
	const uint32_t warp = (M ? blockIdx.x - j * a.m.blocks : blockIdx.x) * GEMV_WARPS + threadIdx.x / 32,
		       lane = threadIdx.x % 32;
	const uint32_t row0 = warp * R;
	grid_launch_next();
	if (row0 >= a.total)
		return;
	if (M && a.m.wd)
		grid_wait(); /* the kernel before chose the matrices */
	const uint32_t in8 = a.in8;
	const uint4 *wr[R], *ur[R];
	float *dst[R];
	uint32_t orow[R];
	bool live[R];
#pragma unroll
	for (int r = 0; r < R; r++) {
		live[r] = row0 + r < a.total;
		uint32_t p = 0, o = live[r] ? row0 + r : row0;
		if (MODE != GEMV_SWIGLU)
			while (p < 2 && o >= a.rows[p])
				o -= a.rows[p++];
		/* Branches, not a.w[p]: a run-time index into the parameters would copy them to
		 * local memory. */
		const void *wp = M ? mats_w(a.m, j) : p == 0 ? a.w[0] : p == 1 ? a.w[1] : a.w[2];
		wr[r] = (const uint4 *)wp + (size_t)o * in8;
		ur[r] = MODE == GEMV_SWIGLU ? (const uint4 *)(M ? mats_up(a.m, j) : a.w[1]) + (size_t)o * in8 : wr[r];
		dst[r] = M ? pick_mat(a.m.out, j) : p == 0 ? a.out[0] : p == 1 ? a.out[1] : a.out[2];
		orow[r] = o;
	}
	/* The first bytes of the rows come into L2 while the kernel before finishes. */
#pragma unroll
	for (int r = 0; r < R; r++) {
		asm volatile("prefetch.global.L2 [%0];" ::"l"(wr[r] + lane * 4));
		if (MODE == GEMV_SWIGLU)
			asm volatile("prefetch.global.L2 [%0];" ::"l"(ur[r] + lane * 4));
	}
	grid_wait();
	const uint4 *x = (const uint4 *)(M ? pick_mat(a.m.x, j) : a.x);
	float s[R][2], u[R][2];
#pragma unroll
	for (int r = 0; r < R; r++)
		s[r][0] = s[r][1] = u[r][0] = u[r][1] = 0.0f;
	uint32_t c = lane;
	for (; c + 32 * (GEMV_UNROLL - 1) < in8; c += 32 * GEMV_UNROLL) {
		uint4 xv[GEMV_UNROLL], wv[R][GEMV_UNROLL], uv[R][GEMV_UNROLL];
#pragma unroll
		for (int r = 0; r < R; r++)
#pragma unroll
			for (int i = 0; i < GEMV_UNROLL; i++) {
				wv[r][i] = __ldcs(wr[r] + c + 32 * i);
				uv[r][i] = MODE == GEMV_SWIGLU ? __ldcs(ur[r] + c + 32 * i) : wv[r][i];
			}
#pragma unroll
		for (int i = 0; i < GEMV_UNROLL; i++)
			xv[i] = __ldg(x + c + 32 * i);
#pragma unroll
		for (int r = 0; r < R; r++)
#pragma unroll
			for (int i = 0; i < GEMV_UNROLL; i++) {
				dot8(s[r][i % 2], wv[r][i], xv[i], T());
				if (MODE == GEMV_SWIGLU)
					dot8(u[r][i % 2], uv[r][i], xv[i], T());
			}
	}
	for (; c < in8; c += 32) {
		uint4 xv = __ldg(x + c);
#pragma unroll
		for (int r = 0; r < R; r++) {
			dot8(s[r][0], __ldcs(wr[r] + c), xv, T());
			if (MODE == GEMV_SWIGLU)
				dot8(u[r][0], __ldcs(ur[r] + c), xv, T());
		}
	}
#pragma unroll
	for (int r = 0; r < R; r++) {
		float sr = warp_sum(s[r][0] + s[r][1]);
		float su = MODE == GEMV_SWIGLU ? warp_sum(u[r][0] + u[r][1]) : 0.0f;
		if (lane == 0 && live[r]) {
			if (MODE == GEMV_STORE)
				dst[r][orow[r]] = sr;
			else if (MODE == GEMV_ADD)
				a.out[0][orow[r]] = __fadd_rn(a.out[0][orow[r]], sr);
			else
				((T *)(M ? pick_mat(a.m.act, j) : a.act))[orow[r]] = from_f32<T>(silu_mul(sr, su));
		}
	}
}

template <typename T, int R> static void gemv_launch_r(const gemv_args &ga, int mode, bool pdl, cudaStream_t s)
{
	gemv_args g = ga;
	uint32_t blocks = (g.total + GEMV_WARPS * R - 1) / (GEMV_WARPS * R);
	if (g.m.n) {
		g.m.blocks = blocks;
		blocks *= g.m.n;
		if (mode == GEMV_SWIGLU)
			launch_k(pdl, gemv_kernel<T, GEMV_SWIGLU, R, true>, blocks, GEMV_WARPS * 32, 0, s, g);
		else
			launch_k(pdl, gemv_kernel<T, GEMV_STORE, R, true>, blocks, GEMV_WARPS * 32, 0, s, g);
		return;
	}
	if (mode == GEMV_STORE)
		launch_k(pdl, gemv_kernel<T, GEMV_STORE, R, false>, blocks, GEMV_WARPS * 32, 0, s, g);
	else if (mode == GEMV_ADD)
		launch_k(pdl, gemv_kernel<T, GEMV_ADD, R, false>, blocks, GEMV_WARPS * 32, 0, s, g);
	else
		launch_k(pdl, gemv_kernel<T, GEMV_SWIGLU, R, false>, blocks, GEMV_WARPS * 32, 0, s, g);
}

void gemv_launch(uint32_t wt, int rows_per_warp, const gemv_args &g, int mode, bool pdl, cudaStream_t s)
{
	if (wt == DT_BF16)
		rows_per_warp == 2 ? gemv_launch_r<__nv_bfloat16, 2>(g, mode, pdl, s)
				   : gemv_launch_r<__nv_bfloat16, 1>(g, mode, pdl, s);
	else
		rows_per_warp == 2 ? gemv_launch_r<__half, 2>(g, mode, pdl, s) : gemv_launch_r<__half, 1>(g, mode, pdl, s);
}

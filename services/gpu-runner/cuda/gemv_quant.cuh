/* gemv_quant.cuh - what the two paths of the quantized products share (gemv_quant.cu: a few
 * tokens, x as float32; gemv_dp4a.cu with the kernels of gemv_dp4a.cuh: one token, x as int8):
 * per block format, the lanes' geometry, the bytes a lane loads and its dot product against float
 * x (qg<F>); a warp's walk over its rows and items (qg_row, qg_cursor, qg_items, qg_load) and the
 * end of a row (qg_finish); and the host's helpers of both launchers.
 *
 * Work. A block of QG_WARPS warps computes one output row per warp (row group = QG_WARPS rows)
 * and walks row groups grid-stride (the grid is what fits the GPU at once), so x, staged once,
 * serves every group a block takes (the integer path through shared memory may run V such blocks
 * as one block of V row groups, gemv_dp4a.cuh's wide blocks, x staged once for all of them). A
 * warp walks its row in steps of S values: per step each lane takes 32 (Q8_0, Q4_0: one block
 * per lane) or 64 values (K formats: a quarter of a 256-value block per lane, four lanes a
 * block), loads its block bytes (16-byte loads for Q4_K / Q5_K, whose blocks are 16-byte
 * multiples; aligned words shifted into place for the 2-byte aligned Q8_0, Q4_0 and Q6_K), unpacks quants with bit operations and accumulates in float32;
 * a warp-shuffle sum ends the row. The (row, step) items of a warp form one stream, the next
 * item's loads issued before the current one's arithmetic, across rows too (SwiGLU's items
 * alternate gate and up); the first row's bytes are prefetched into L2 while x is staged.
 *
 * Quants to floats. A quant q of b bits is written into the top mantissa bits of 1.0f with one
 * byte permute: f = 1 + q / 2^b exactly. Then sum q x = 2^b (sum f x - sum x), and the sums of x
 * over each lane's 16-value groups are computed once per block when x is staged, so a value
 * costs a permute and a fused multiply-add (Q8_0's signed 8-bit quants use 2^23 + u exactly and
 * one subtraction). The float32 sums lose a few of their 24 bits to that difference, far below
 * the BF16 rounding of x (2^-9). */
#ifndef GPU_RUNNER_CUDA_GEMV_QUANT_CUH
#define GPU_RUNNER_CUDA_GEMV_QUANT_CUH
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cuda/device.cuh"
#include "services/gpu-runner/cuda/quant.cuh"

#define QG_THREADS (QG_WARPS * 32)

static __device__ __forceinline__ float perm_f(uint32_t p, uint32_t sel)
{
	return __uint_as_float(__byte_perm(p, 0x3F000000u, sel));
}

/* The four floats 1 + q / 2^b of a word whose bytes are 0x80 | q << (7 - b). */
static __device__ __forceinline__ float4 unit_floats(uint32_t p)
{
	return make_float4(perm_f(p, 0x7054), perm_f(p, 0x7154), perm_f(p, 0x7254), perm_f(p, 0x7354));
}

static __device__ __forceinline__ float dot4(float4 f, float4 x, float s)
{
	s = fmaf(f.x, x.x, s);
	s = fmaf(f.y, x.y, s);
	s = fmaf(f.z, x.z, s);
	return fmaf(f.w, x.w, s);
}

/* ---- per format: lane geometry, the bytes a lane loads, its dot product ------------------
 *
 * LPB lanes share a block, BPS blocks make a step of S values, a lane holds PPL pieces of 4
 * values per step; piece(p) maps value p of a step (a multiple of 4) to its lane and piece.
 * dot() adds a lane's share of one block to acc[t] for NT tokens: xl is the lane's pieces of
 * token 0 (token t at t * xstride), xm its group sums (float4: pieces 0-3, 4-7, 8-11, 12-15; token
 * t at t * mstride), lx = L & 7 (the swizzle). */

template <int F> struct qg;

template <> struct qg<DT_Q8_0> {
	static constexpr uint32_t BB = 34, LPB = 1, BPS = 32, PPL = 8, S = 1024;
	struct data {
		uint32_t q[8];
		float d;
	};
	static __device__ __forceinline__ void piece(uint32_t p, uint32_t &L, uint32_t &c)
	{
		L = p >> 5;
		c = (p & 31) >> 2;
	}
	static __device__ __forceinline__ void load(const uint8_t *b, uint32_t, data &v)
	{
		ld_words<8>(b + 2, v.q);
		v.d = ld_f16(b);
	}
	template <int NT>
	static __device__ __forceinline__ void dot(const data &v, uint32_t, const float4 *xl, uint32_t xstride,
						   const float4 *, uint32_t, uint32_t lx, float *acc)
	{
		float s[NT];
#pragma unroll
		for (int t = 0; t < NT; t++)
			s[t] = 0.0f;
#pragma unroll
		for (uint32_t c = 0; c < 8; c++) {
			/* u = q + 128 in each byte; 0x4B0000uu is 2^23 + u exactly. */
			const uint32_t u = v.q[c] ^ 0x80808080u;
			const float off = 8388736.0f; /* 2^23 + 128 */
			float4 f;
			f.x = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540)) - off;
			f.y = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7541)) - off;
			f.z = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7542)) - off;
			f.w = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7543)) - off;
#pragma unroll
			for (int t = 0; t < NT; t++)
				s[t] = dot4(f, xl[t * xstride + (c ^ lx)], s[t]);
		}
#pragma unroll
		for (int t = 0; t < NT; t++)
			acc[t] = fmaf(v.d, s[t], acc[t]);
	}
};

template <> struct qg<DT_Q4_0> {
	static constexpr uint32_t BB = 18, LPB = 1, BPS = 32, PPL = 8, S = 1024;
	struct data {
		uint32_t q[4];
		float d;
	};
	static __device__ __forceinline__ void piece(uint32_t p, uint32_t &L, uint32_t &c)
	{
		L = p >> 5;
		c = (p & 31) >> 2;
	}
	static __device__ __forceinline__ void load(const uint8_t *b, uint32_t, data &v)
	{
		ld_words<4>(b + 2, v.q);
		v.d = ld_f16(b);
	}
	/* Pieces 0-3: low nibbles of words 0-3 (values 0..15), pieces 4-7: high nibbles (16..31).
	 * sum (q - 8) x = 16 (sum f x - X) - 8 X. */
	template <int NT>
	static __device__ __forceinline__ void dot(const data &v, uint32_t, const float4 *xl, uint32_t xstride,
						   const float4 *xm, uint32_t mstride, uint32_t lx, float *acc)
	{
		float s[NT];
#pragma unroll
		for (int t = 0; t < NT; t++)
			s[t] = 0.0f;
#pragma unroll
		for (uint32_t c = 0; c < 8; c++) {
			const uint32_t w = v.q[c & 3];
			const uint32_t p = ((c < 4 ? w << 3 : w >> 1) & 0x78787878u) | 0x80808080u;
			const float4 f = unit_floats(p);
#pragma unroll
			for (int t = 0; t < NT; t++)
				s[t] = dot4(f, xl[t * xstride + (c ^ lx)], s[t]);
		}
#pragma unroll
		for (int t = 0; t < NT; t++) {
			const float4 m = xm[t * mstride];
			const float X = m.x + m.y;
			acc[t] = fmaf(v.d, fmaf(16.0f, s[t], -24.0f * X), acc[t]);
		}
	}
};

/* Scales and mins of sub-blocks 2g and 2g + 1 of a Q4_K / Q5_K block, from header words h[1..3]
 * (scales[12]), all four bytes of a kind at once (quant_scale_min_k4 per byte). */
static __device__ __forceinline__ void k4_scales(const uint32_t *h, uint32_t g, uint32_t &sc0, uint32_t &m0,
						  uint32_t &sc1, uint32_t &m1)
{
	/* Both forms, then a select: the lanes of a block differ in g, so a branch would run both. */
	const uint32_t lo_sc = h[1] & 0x3F3F3F3Fu, lo_m = h[2] & 0x3F3F3F3Fu;
	const uint32_t hi_sc = (h[3] & 0x0F0F0F0Fu) | ((h[1] >> 2) & 0x30303030u);
	const uint32_t hi_m = ((h[3] >> 4) & 0x0F0F0F0Fu) | ((h[2] >> 2) & 0x30303030u);
	const uint32_t scw = g < 2 ? lo_sc : hi_sc, mw = g < 2 ? lo_m : hi_m;
	const uint32_t sh = 16 * (g & 1);
	sc0 = (scw >> sh) & 0xFF;
	sc1 = (scw >> (sh + 8)) & 0xFF;
	m0 = (mw >> sh) & 0xFF;
	m1 = (mw >> (sh + 8)) & 0xFF;
}

/* Lane g of a block takes values [64 g, 64 g + 64): qs bytes [32 g, 32 g + 32), low nibbles
 * (sub-block 2g, pieces 0-7) and high nibbles (sub-block 2g + 1, pieces 8-15). */
template <> struct qg<DT_Q4_K> {
	static constexpr uint32_t BB = 144, LPB = 4, BPS = 8, PPL = 16, S = 2048;
	struct data {
		uint32_t h[4];
		uint32_t q[8];
	};
	static __device__ __forceinline__ void piece(uint32_t p, uint32_t &L, uint32_t &c)
	{
		L = 4 * (p >> 8) + ((p >> 6) & 3);
		c = (p & 63) >> 2;
	}
	static __device__ __forceinline__ void load(const uint8_t *b, uint32_t g, data &v)
	{
		ld16(b, v.h);
		ld16(b + 16 + 32 * g, v.q);
		ld16(b + 32 + 32 * g, v.q + 4);
	}
	template <int NT>
	static __device__ __forceinline__ void dot(const data &v, uint32_t g, const float4 *xl, uint32_t xstride,
						   const float4 *xm, uint32_t mstride, uint32_t lx, float *acc)
	{
		float lo[NT], hi[NT];
#pragma unroll
		for (int t = 0; t < NT; t++)
			lo[t] = hi[t] = 0.0f;
#pragma unroll
		for (uint32_t c = 0; c < 8; c++) {
			const float4 fl = unit_floats(((v.q[c] << 3) & 0x78787878u) | 0x80808080u);
			const float4 fh = unit_floats(((v.q[c] >> 1) & 0x78787878u) | 0x80808080u);
#pragma unroll
			for (int t = 0; t < NT; t++) {
				lo[t] = dot4(fl, xl[t * xstride + (c ^ lx)], lo[t]);
				hi[t] = dot4(fh, xl[t * xstride + ((c + 8) ^ lx)], hi[t]);
			}
		}
		uint32_t sc0, m0, sc1, m1;
		k4_scales(v.h, g, sc0, m0, sc1, m1);
		const float d = f16_bits(v.h[0]), dmin = f16_bits(v.h[0] >> 16);
		const float a0 = 16.0f * d * (float)sc0, b0 = dmin * (float)m0;
		const float a1 = 16.0f * d * (float)sc1, b1 = dmin * (float)m1;
#pragma unroll
		for (int t = 0; t < NT; t++) {
			const float4 m = xm[t * mstride];
			const float xlo = m.x + m.y, xhi = m.z + m.w;
			float y = fmaf(a0, lo[t] - xlo, -b0 * xlo);
			y = fmaf(a1, hi[t] - xhi, fmaf(-b1, xhi, y));
			acc[t] += y;
		}
	}
};

/* As Q4_K, the fifth bit of value l of sub-block 2g (2g + 1) being bit 2g (2g + 1) of qh[l]. */
template <> struct qg<DT_Q5_K> {
	static constexpr uint32_t BB = 176, LPB = 4, BPS = 8, PPL = 16, S = 2048;
	struct data {
		uint32_t h[4];
		uint32_t qh[8];
		uint32_t q[8];
	};
	static __device__ __forceinline__ void piece(uint32_t p, uint32_t &L, uint32_t &c)
	{
		L = 4 * (p >> 8) + ((p >> 6) & 3);
		c = (p & 63) >> 2;
	}
	static __device__ __forceinline__ void load(const uint8_t *b, uint32_t g, data &v)
	{
		ld16(b, v.h);
		ld16(b + 16, v.qh);
		ld16(b + 32, v.qh + 4);
		ld16(b + 48 + 32 * g, v.q);
		ld16(b + 64 + 32 * g, v.q + 4);
	}
	template <int NT>
	static __device__ __forceinline__ void dot(const data &v, uint32_t g, const float4 *xl, uint32_t xstride,
						   const float4 *xm, uint32_t mstride, uint32_t lx, float *acc)
	{
		float lo[NT], hi[NT];
#pragma unroll
		for (int t = 0; t < NT; t++)
			lo[t] = hi[t] = 0.0f;
		const uint32_t s0 = 2 * g, s1 = 2 * g + 1;
#pragma unroll
		for (uint32_t c = 0; c < 8; c++) {
			const uint32_t w = v.q[c], hw = v.qh[c];
			const uint32_t pl = ((w << 2) & 0x3C3C3C3Cu) | (((hw >> s0) & 0x01010101u) << 6) | 0x80808080u;
			const uint32_t ph = ((w >> 2) & 0x3C3C3C3Cu) | (((hw >> s1) & 0x01010101u) << 6) | 0x80808080u;
			const float4 fl = unit_floats(pl), fh = unit_floats(ph);
#pragma unroll
			for (int t = 0; t < NT; t++) {
				lo[t] = dot4(fl, xl[t * xstride + (c ^ lx)], lo[t]);
				hi[t] = dot4(fh, xl[t * xstride + ((c + 8) ^ lx)], hi[t]);
			}
		}
		uint32_t sc0, m0, sc1, m1;
		k4_scales(v.h, g, sc0, m0, sc1, m1);
		const float d = f16_bits(v.h[0]), dmin = f16_bits(v.h[0] >> 16);
		const float a0 = 32.0f * d * (float)sc0, b0 = dmin * (float)m0;
		const float a1 = 32.0f * d * (float)sc1, b1 = dmin * (float)m1;
#pragma unroll
		for (int t = 0; t < NT; t++) {
			const float4 m = xm[t * mstride];
			const float xlo = m.x + m.y, xhi = m.z + m.w;
			float y = fmaf(a0, lo[t] - xlo, -b0 * xlo);
			y = fmaf(a1, hi[t] - xhi, fmaf(-b1, xhi, y));
			acc[t] += y;
		}
	}
};

/* Lane j of a block: half nh = j / 2, l0 = 16 (j % 2); run r (pieces 4r..4r+3) holds values
 * 128 nh + 32 r + l0 + 0..15 with scale scales[8 nh + 2 r + j % 2]: ql bytes l0.. of the half
 * (runs 0, 2: low, high nibbles), ql bytes 32 + l0.. (runs 1, 3), qh bytes l0.. (2 bits per run). */
template <> struct qg<DT_Q6_K> {
	static constexpr uint32_t BB = 210, LPB = 4, BPS = 8, PPL = 16, S = 2048;
	struct data {
		uint32_t a[4], b[4], h[4], sw[2];
		float d;
	};
	static __device__ __forceinline__ void piece(uint32_t p, uint32_t &L, uint32_t &c)
	{
		const uint32_t q = p & 255;
		L = 4 * (p >> 8) + 2 * (q >> 7) + ((q >> 4) & 1);
		c = 4 * ((q >> 5) & 3) + ((q >> 2) & 3);
	}
	static __device__ __forceinline__ void load(const uint8_t *blk, uint32_t j, data &v)
	{
		const uint32_t nh = j >> 1, l0 = 16 * (j & 1);
		ld_words<4>(blk + 64 * nh + l0, v.a);
		ld_words<4>(blk + 64 * nh + 32 + l0, v.b);
		ld_words<4>(blk + 128 + 32 * nh + l0, v.h);
		ld_words<2>(blk + 192 + 8 * nh, v.sw);
		v.d = ld_f16(blk + 208);
	}
	/* Byte 0x80 | q << 1 of the 6-bit quant q = 4 bits of ql | 2 bits of qh << 4. */
	static __device__ __forceinline__ uint32_t prep(uint32_t r, uint32_t a, uint32_t b, uint32_t h)
	{
		switch (r) {
		case 0:
			return ((a << 1) & 0x1E1E1E1Eu) | ((h << 5) & 0x60606060u) | 0x80808080u;
		case 1:
			return ((b << 1) & 0x1E1E1E1Eu) | ((h << 3) & 0x60606060u) | 0x80808080u;
		case 2:
			return ((a >> 3) & 0x1E1E1E1Eu) | ((h << 1) & 0x60606060u) | 0x80808080u;
		default:
			return ((b >> 3) & 0x1E1E1E1Eu) | ((h >> 1) & 0x60606060u) | 0x80808080u;
		}
	}
	/* sum (q - 32) x = 64 (sum f x - X) - 32 X per run. */
	template <int NT>
	static __device__ __forceinline__ void dot(const data &v, uint32_t j, const float4 *xl, uint32_t xstride,
						   const float4 *xm, uint32_t mstride, uint32_t lx, float *acc)
	{
		float s[4][NT];
#pragma unroll
		for (int r = 0; r < 4; r++)
#pragma unroll
			for (int t = 0; t < NT; t++)
				s[r][t] = 0.0f;
#pragma unroll
		for (uint32_t r = 0; r < 4; r++)
#pragma unroll
			for (uint32_t k = 0; k < 4; k++) {
				const float4 f = unit_floats(prep(r, v.a[k], v.b[k], v.h[k]));
				const uint32_t c = 4 * r + k;
#pragma unroll
				for (int t = 0; t < NT; t++)
					s[r][t] = dot4(f, xl[t * xstride + (c ^ lx)], s[r][t]);
			}
		const uint32_t hj = j & 1;
		float dr[4];
#pragma unroll
		for (uint32_t r = 0; r < 4; r++) {
			const uint32_t i = hj + 2 * r;
			dr[r] = v.d * (float)(int8_t)((v.sw[i >> 2] >> (8 * (i & 3))) & 0xFF);
		}
#pragma unroll
		for (int t = 0; t < NT; t++) {
			const float4 m = xm[t * mstride];
			float y = dr[0] * fmaf(64.0f, s[0][t], -96.0f * m.x);
			y = fmaf(dr[1], fmaf(64.0f, s[1][t], -96.0f * m.y), y);
			y = fmaf(dr[2], fmaf(64.0f, s[2][t], -96.0f * m.z), y);
			y = fmaf(dr[3], fmaf(64.0f, s[3][t], -96.0f * m.w), y);
			acc[t] += y;
		}
	}
};

/* ---- a warp's rows --------------------------------------------------------------------- */

static __device__ __forceinline__ void prefetch_l2(const uint8_t *p, uint64_t bytes, uint32_t lane)
{
	for (uint64_t off = (uint64_t)lane * 128; off < bytes && off < 64 * 128; off += 32 * 128)
		asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
}

/* Several matrices (MODE & GEMV_MATS_BIT): the one block b computes, b / a.m.blocks. */
static __device__ __forceinline__ uint32_t qg_mat(const qgemv_args &a)
{
	return blockIdx.x / a.m.blocks;
}

/* The row-group block of the thread. A block of several row-group blocks (dq_sm_kernel's wide
 * blocks: blockDim.x a multiple of QG_THREADS, never with several matrices) is that many blocks of
 * QG_WARPS warps, the warps of the j-th taking row-group block blockIdx.x * V + j's row groups: a
 * grid of V times its blocks. With a.vb_apart the j-th is j * gridDim.x + blockIdx.x instead: the
 * row-group blocks that walk one row group more than the others (the first ones, where the row
 * groups are not a multiple of them) then fall one or two to a block, not all of a block's to the
 * first blocks (gate/up of an 8B: 1792 row groups on 132 blocks of 3, 15 to a block against 12 side
 * by side, 14 against 13 apart). Which warp computes a row changes, not how: the same sums. */
static __device__ __forceinline__ uint32_t qg_vblock(const qgemv_args &a)
{
	const uint32_t j = threadIdx.x / QG_THREADS;
	return a.vb_apart ? j * gridDim.x + blockIdx.x : blockIdx.x * (blockDim.x / QG_THREADS) + j;
}

/* The block's first row group, and the step to its next (of its own matrix with several; of its
 * format's parts in a launch of two formats, where a.vbn row-group blocks from a.vb0 walk a's: none
 * past them). */
template <int MODE> static __device__ __forceinline__ uint32_t qg_first_group(const qgemv_args &a)
{
	if (MODE & GEMV_MIX_BIT) {
		const uint32_t v = qg_vblock(a) - a.vb0;
		return v < a.vbn ? v : UINT32_MAX;
	}
	return (MODE & GEMV_MATS_BIT) ? blockIdx.x % a.m.blocks : qg_vblock(a);
}

template <int MODE> static __device__ __forceinline__ uint32_t qg_group_step(const qgemv_args &a)
{
	return (MODE & GEMV_MIX_BIT)	? a.vbn
	       : (MODE & GEMV_MATS_BIT) ? a.m.blocks
					: gridDim.x * (blockDim.x / QG_THREADS);
}

/* The row a warp computes in row group rg: part p, row o of it, its bytes (row2: up's row of
 * SwiGLU). False past the last row. */
template <int MODE> struct qg_row {
	uint32_t rg, p, o;
	const uint8_t *row, *row2;

	__device__ __forceinline__ bool at(const qgemv_args &a, uint32_t group, uint32_t wid)
	{
		rg = group;
		const uint32_t r = group * QG_WARPS + wid;
		if (group >= a.groups || r >= a.total)
			return false;
		p = 0;
		o = r;
		if (MODE & GEMV_MATS_BIT) {
			const uint32_t j = qg_mat(a);
			row = (const uint8_t *)mats_w(a.m, j) + (size_t)o * a.row_bytes;
			row2 = GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? (const uint8_t *)mats_up(a.m, j) + (size_t)o * a.row_bytes : row;
			return true;
		}
		if (GEMV_MODE_OF(MODE) != GEMV_SWIGLU)
			while (p < 2 && o >= a.rows[p])
				o -= a.rows[p++];
		/* Branches, not a.w[p]: a run-time index into the parameters would copy them to
		 * local memory. */
		const uint8_t *wp = p == 0 ? a.w[0] : p == 1 ? a.w[1] : a.w[2];
		row = wp + (size_t)o * a.row_bytes;
		row2 = GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? a.w[1] + (size_t)o * a.row_bytes : row;
		return true;
	}
};

/* Lane 0 writes the row's results (the warp's sums of acc): store, residual add or SwiGLU. */
template <int NT, int MODE>
static __device__ __forceinline__ void qg_finish(const qgemv_args &a, uint32_t p, uint32_t o, uint32_t lane,
						 float *acc, float *acc2)
{
#pragma unroll
	for (int t = 0; t < NT; t++) {
		const float y = warp_sum(acc[t]);
		const float u = GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? warp_sum(acc2[t]) : 0.0f;
		acc[t] = acc2[t] = 0.0f;
		if (lane == 0 && (uint32_t)t < a.n) {
			float *dst = (MODE & GEMV_MATS_BIT) ? pick_mat(a.m.out, qg_mat(a))
				     : p == 0		    ? a.out[0]
				     : p == 1		    ? a.out[1]
							    : a.out[2];
			if (GEMV_MODE_OF(MODE) == GEMV_STORE)
				dst[(size_t)t * a.ldc + o] = y;
			else if (GEMV_MODE_OF(MODE) == GEMV_ADD)
				a.out[0][(size_t)t * a.ldc + o] = __fadd_rn(a.out[0][(size_t)t * a.ldc + o], y);
			else
				((MODE & GEMV_MATS_BIT) ? (__nv_bfloat16 *)pick_mat(a.m.act, qg_mat(a)) : a.act)[o] =
					__float2bfloat16_rn(silu_mul(y, u));
		}
	}
}

/* Items of a row: its steps, and for SwiGLU gate's and up's steps in turn (item k is step k / 2 of
 * gate for even k, of up for odd k), so a warp holds the bytes of two items, not four. */
template <int MODE> static __device__ __forceinline__ uint32_t qg_items(const qgemv_args &a)
{
	return GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? 2 * a.steps : a.steps;
}

/* The block bytes a lane reads for item k of a row. */
template <int F, int MODE>
static __device__ __forceinline__ void qg_load(const qgemv_args &a, const qg_row<MODE> &w, uint32_t k, uint32_t lane,
					       typename qg<F>::data &d)
{
	typedef qg<F> T;
	const uint32_t s = GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? k >> 1 : k;
	const uint32_t b = s * T::BPS + lane / T::LPB;
	const uint8_t *row = GEMV_MODE_OF(MODE) == GEMV_SWIGLU && (k & 1) ? w.row2 : w.row;
	if (b < a.nb)
		T::load(row + (size_t)b * T::BB, lane % T::LPB, d);
}

/* A place in a warp's stream of (row, item) pairs: the row, its item k; live until the rows end. */
template <int MODE> struct qg_cursor {
	qg_row<MODE> r;
	uint32_t k;
	bool live;

	__device__ __forceinline__ void next(const qgemv_args &a, uint32_t wid)
	{
		if (++k == qg_items<MODE>(a)) {
			k = 0;
			live = r.at(a, r.rg + qg_group_step<MODE>(a), wid);
		}
	}
};

/* ---- the host's helpers of both launchers --------------------------------------------------- */

/* Blocks of kernel fn, `threads` threads and smem bytes, resident on a multiprocessor at once
 * (gemv_quant.cu). */
uint32_t qg_resident_blocks(struct backend_dev *be, const void *fn, size_t smem, uint32_t threads = QG_THREADS);
/* The launch fields of a product's args in format fmt (gemv_quant.cu). */
void qg_fill(uint32_t fmt, qgemv_args &a);

/* The integer path (gemv_dp4a.cu): its kernels' shared memory, whether it takes a product, and
 * the product's launch. */
cudaError_t dq_init(uint32_t dq_smem_max);
bool dq_takes(const struct backend_dev *be, uint32_t fmt, const qgemv_args &a);
void dq_launch(struct backend_dev *be, uint32_t fmt, const qgemv_args &a, int mode, cudaStream_t s);

#endif

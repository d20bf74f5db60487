/* gemv_quant.cu - products of a few tokens (decode: n <= QGEMV_MAX_TOKENS) with block-quantized
 * weights read as they are stored (GGUF's Q8_0, Q4_0, Q4_K, Q5_K, Q6_K): out[t][o] (+)= W[o] . x[t],
 * or SiLU(gate) * up for one token. The weights cross the memory bus once, as quantized bytes.
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
 * the BF16 rounding of x (2^-9).
 *
 * x in shared memory. The bf16 inputs (n, in) are widened to float32 into shared memory in the
 * order lanes read them: piece c (4 values) of lane L at float4 index L * PPL + (c ^ (L & 7)), so
 * the 8 lanes of a 128-bit access phase hit 8 different bank groups. Inputs wider than the
 * shared memory of a block (QG_SMEM_MAX) are staged a tile of steps at a time. */
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cuda/device.cuh"
#include "services/gpu-runner/cuda/quant.cuh"

#include <assert.h>
#include <string.h>

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
 * grid of V times its blocks. */
static __device__ __forceinline__ uint32_t qg_vblock(void)
{
	return blockIdx.x * (blockDim.x / QG_THREADS) + threadIdx.x / QG_THREADS;
}

/* The block's first row group, and the step to its next (of its own matrix with several; of its
 * format's parts in a launch of two formats, where a.vbn row-group blocks from a.vb0 walk a's: none
 * past them). */
template <int MODE> static __device__ __forceinline__ uint32_t qg_first_group(const qgemv_args &a)
{
	if (MODE & GEMV_MIX_BIT) {
		const uint32_t v = qg_vblock() - a.vb0;
		return v < a.vbn ? v : UINT32_MAX;
	}
	return (MODE & GEMV_MATS_BIT) ? blockIdx.x % a.m.blocks : qg_vblock();
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

#include "services/gpu-runner/cuda/gemv_dp4a.cuh"

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

/* dq_sm_kernel's blocks may take what a block can opt in to beside its static shared memory (wide
 * blocks: x and the stages of up to DQ_WIDE_MAX row groups' warps); launch_dq_k checks each
 * launch's. */
template <int F> static cudaError_t allow_dq(uint32_t max_bytes)
{
	cudaError_t e;
	if ((e = cudaFuncSetAttribute(dq_sm_kernel<F, GEMV_STORE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				      (int)max_bytes)) ||
	    (e = cudaFuncSetAttribute(dq_sm_kernel<F, GEMV_ADD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				      (int)max_bytes)) ||
	    (e = cudaFuncSetAttribute(dq_sm_kernel<F, GEMV_SWIGLU>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				      (int)max_bytes)) ||
	    (e = cudaFuncSetAttribute(dq_sm_kernel<F, GEMV_STORE | GEMV_MATS_BIT>,
				      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)max_bytes)) ||
	    (e = cudaFuncSetAttribute(dq_sm_kernel<F, GEMV_SWIGLU | GEMV_MATS_BIT>,
				      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)max_bytes)))
		return e;
	if ((e = cudaFuncSetAttribute(dq_kernel<F, GEMV_STORE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				      (int)QG_SMEM_MAX)) ||
	    (e = cudaFuncSetAttribute(dq_kernel<F, GEMV_ADD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				      (int)QG_SMEM_MAX)) ||
	    (e = cudaFuncSetAttribute(dq_kernel<F, GEMV_SWIGLU>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				      (int)QG_SMEM_MAX)) ||
	    (e = cudaFuncSetAttribute(dq_kernel<F, GEMV_STORE | GEMV_MATS_BIT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				      (int)QG_SMEM_MAX)) ||
	    (e = cudaFuncSetAttribute(dq_kernel<F, GEMV_SWIGLU | GEMV_MATS_BIT>,
				      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)QG_SMEM_MAX)))
		return e;
	return cudaSuccess;
}

cudaError_t qgemv_init(uint32_t dq_smem_max)
{
	cudaError_t e;
	if ((e = allow_f<DT_Q8_0>()) || (e = allow_f<DT_Q4_0>()) || (e = allow_f<DT_Q4_K>()) ||
	    (e = allow_f<DT_Q5_K>()) || (e = allow_f<DT_Q6_K>()) || (e = allow_dq<DT_Q8_0>(dq_smem_max)) ||
	    (e = allow_dq<DT_Q4_K>(dq_smem_max)) || (e = allow_dq<DT_Q6_K>(dq_smem_max)) ||
	    (e = cudaFuncSetAttribute(dq_mix_kernel<DT_Q4_K, DT_Q6_K>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				      (int)dq_smem_max)) ||
	    (e = cudaFuncSetAttribute(dq_mix_kernel<DT_Q4_K, DT_Q8_0>, cudaFuncAttributeMaxDynamicSharedMemorySize,
				      (int)dq_smem_max)))
		return e;
	return cudaSuccess;
}

/* Blocks of kernel fn with smem bytes that fit a multiprocessor at once (the occupancy
 * calculator's answer, remembered per backend: a handful of (kernel, size) pairs per model). The
 * grid is that many per multiprocessor, so no block waits for a second wave: each walks an equal
 * share of the row groups. */
static uint32_t resident_blocks(struct backend_dev *be, const void *fn, size_t smem, uint32_t threads = QG_THREADS)
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
	const uint32_t cap = (uint32_t)be->sm_count * resident_blocks(be, fn, smem);
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

template <int F, int MODE> static void launch_dq_k(struct backend_dev *be, const qgemv_args &ga, cudaStream_t s)
{
	qgemv_args a = ga;
	const size_t ssm = dq_sm_smem(F, a.in, QG_WARPS);
	if (be->dq_sm && ssm <= DQ_SM_SMEM_MAX && ssm <= be->dq_smem_max && dq_sm_aligned(a)) {
		const void *fn = (const void *)dq_sm_kernel<F, MODE>;
		const uint32_t per_sm = resident_blocks(be, fn, ssm);
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
			if (wsm <= be->dq_smem_max && resident_blocks(be, fn, wsm, v * QG_THREADS) >= 1) {
				launch_k(be->pdl, dq_sm_kernel<F, MODE>, (grid + v - 1) / v, v * QG_THREADS, wsm, s, a);
				be->wide_launches++;
				return;
			}
		}
		launch_k(be->pdl, dq_sm_kernel<F, MODE>, grid, QG_THREADS, ssm, s, a);
		return;
	}
	const size_t smem = dq_smem(a.in);
	const void *fn = (const void *)dq_kernel<F, MODE>;
	const unsigned grid = dq_grid(a, (uint32_t)be->sm_count * resident_blocks(be, fn, smem));
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
static bool dq_takes(const struct backend_dev *be, uint32_t fmt, const qgemv_args &a)
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
static void dq_fill(uint32_t fmt, qgemv_args &a)
{
	a.nb = a.in / dtype_block_elems((enum dtype)fmt);
	a.steps = (a.in + step_values(fmt) - 1) / step_values(fmt);
	a.groups = (a.total + QG_WARPS - 1) / QG_WARPS;
	a.tile_steps = a.steps;
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
		a.vbn = blocks / 2;
		b.vbn = blocks - a.vbn;
		for (uint32_t ka = 1; ka <= a.groups && (uint64_t)ka * a.row_bytes < best; ka++) {
			const uint32_t na = (a.groups + ka - 1) / ka;
			if (na >= blocks)
				continue;
			const uint32_t nb = blocks - na;
			const uint64_t cb = (uint64_t)((b.groups + nb - 1) / nb) * b.row_bytes;
			const uint64_t c = (uint64_t)ka * a.row_bytes > cb ? (uint64_t)ka * a.row_bytes : cb;
			if (c < best) {
				best = c;
				a.vbn = na;
				b.vbn = nb > b.groups ? b.groups : nb;
			}
		}
		/* Blocks b leaves over go to a (fewer of its blocks take ka row groups). */
		a.vbn = blocks - b.vbn < a.groups ? blocks - b.vbn : a.groups;
	}
	b.vb0 = a.vbn;
}

template <int F2> static void launch_mix_k(struct backend_dev *be, qgemv_args &a, qgemv_args &b, cudaStream_t s)
{
	const void *fn = (const void *)dq_mix_kernel<DT_Q4_K, F2>;
	const uint32_t ring = dq_mix_ring<DT_Q4_K, F2>::V;
	const size_t x = dq_smem_f<DT_Q4_K>(a.in);
	const uint32_t per_sm = resident_blocks(be, fn, x + (size_t)QG_WARPS * ring);
	dq_mix_split(a, b, (uint32_t)be->sm_count * per_sm);
	const uint32_t vblocks = a.vbn + b.vbn;
	/* Wide blocks as launch_dq_k makes them: V row-group blocks a block, the grid one wave. */
	uint32_t v = (vblocks + be->sm_count - 1) / be->sm_count;
	v = v > per_sm ? per_sm : v > DQ_WIDE_MAX ? DQ_WIDE_MAX : v;
	for (; v >= 1; v--) {
		const size_t smem = x + (size_t)v * QG_WARPS * ring;
		const uint32_t grid = (vblocks + v - 1) / v;
		if (v == 1 || (be->wide_dq && !be->dq_narrow && smem <= be->dq_smem_max &&
			       grid <= (uint32_t)be->sm_count * resident_blocks(be, fn, smem, v * QG_THREADS))) {
			if (v > 1)
				be->wide_launches++;
			launch_k(be->pdl, dq_mix_kernel<DT_Q4_K, F2>, grid, v * QG_THREADS, smem, s, a, b);
			be->mix_launches++;
			return;
		}
	}
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
		dq_fill(fmt[k], a);
		if (!dq_takes(be, fmt[k], a) || !dq_sm_aligned(a))
			return false;
	}
	const size_t smem = dq_smem_f<DT_Q4_K>(in) + (size_t)QG_WARPS * (f2 == DT_Q6_K ? dq_mix_ring<DT_Q4_K, DT_Q6_K>::V
										  : dq_mix_ring<DT_Q4_K, DT_Q8_0>::V);
	if (smem > DQ_SM_SMEM_MAX || smem > be->dq_smem_max)
		return false;
	g[0].tr = ktrace_next(be, "product (two formats)");
	if (f2 == DT_Q6_K)
		launch_mix_k<DT_Q6_K>(be, g[0], g[1], be->stream);
	else
		launch_mix_k<DT_Q8_0>(be, g[0], g[1], be->stream);
	return true;
}

void qgemv_launch(struct backend_dev *be, uint32_t fmt, qgemv_args &a, int mode, cudaStream_t s)
{
	assert(a.n >= 1 && a.n <= QG_MAX_NT && (mode != GEMV_SWIGLU || a.n == 1));
	a.tr = ktrace_next(be, GEMV_MODE_OF(mode) == GEMV_SWIGLU ? "product (SwiGLU)"
			   : GEMV_MODE_OF(mode) == GEMV_ADD  ? "product (added)"
							     : "product");
	const uint32_t nt = a.n == 1 ? 1 : a.n == 2 ? 2 : a.n <= 4 ? 4 : 8;
	dq_fill(fmt, a);
	assert((a.src.kind == XSRC_ACT && !a.m.n) || dq_takes(be, fmt, a));
	assert(!a.m.n || (a.m.n <= GEMV_MATS && a.src.kind == XSRC_ACT && mode != GEMV_ADD));
	if (dq_takes(be, fmt, a)) {
		if (fmt == DT_Q4_K)
			launch_dq<DT_Q4_K>(be, a, mode, s);
		else if (fmt == DT_Q6_K)
			launch_dq<DT_Q6_K>(be, a, mode, s);
		else
			launch_dq<DT_Q8_0>(be, a, mode, s);
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

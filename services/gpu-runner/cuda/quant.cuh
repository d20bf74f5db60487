/* quant.cuh - device helpers for GGUF's block formats (common/quant.h has the layouts): reads of
 * block bytes at the alignment a format gives, and the exact dequantization of a thread's share
 * of a block, in the C dequantizers' order of float32 operations (no fused multiply-add), so a
 * dequantized value is the same bits on the device as quant_dequantize gives on the host.
 *
 * Alignment. Blocks of Q4_K (144 bytes) and Q5_K (176) are multiples of 16 bytes, so every
 * 16-byte field of theirs is 16-byte aligned when the tensor is. Q8_0 (34), Q4_0 (18) and Q6_K
 * (210) are only 2-byte aligned within a row: their fields are read as aligned 32-bit words and
 * shifted into place (ld_words), which never touches a word holding no byte of the field. */
#ifndef GPU_RUNNER_CUDA_QUANT_CUH
#define GPU_RUNNER_CUDA_QUANT_CUH
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/dtype.h"

/* NW little-endian words of the bytes [p, p + 4 * NW), p of any alignment: aligned words are
 * loaded (the last one is the word holding byte p + 4 * NW - 1, so nothing past the field is
 * read) and funnel-shifted into place. SHARED: p is in shared memory (plain loads), else global
 * memory (read-only loads). */
template <int NW, bool SHARED = false>
static __device__ __forceinline__ void ld_words(const uint8_t *p, uint32_t (&w)[NW])
{
	const uintptr_t a = (uintptr_t)p;
	const uint32_t *q = (const uint32_t *)(a & ~(uintptr_t)3);
	const uint32_t sh = (uint32_t)(a & 3) * 8;
	const uint32_t *last = (const uint32_t *)((a + 4 * NW - 1) & ~(uintptr_t)3);
	uint32_t r[NW + 1];
#pragma unroll
	for (int i = 0; i < NW; i++)
		r[i] = SHARED ? q[i] : __ldg(q + i);
	r[NW] = SHARED ? *last : __ldg(last);
#pragma unroll
	for (int i = 0; i < NW; i++)
		w[i] = __funnelshift_r(r[i], r[i + 1], sh);
}

/* 16 bytes at a 16-byte aligned p, read once (weights are streamed). */
static __device__ __forceinline__ void ld16(const uint8_t *p, uint32_t *w)
{
	uint4 v = __ldcs((const uint4 *)p);
	w[0] = v.x;
	w[1] = v.y;
	w[2] = v.z;
	w[3] = v.w;
}

/* NW words at p: 16-byte loads where the caller knows p is 16-byte aligned (A16), else words. */
template <int NW, bool A16> static __device__ __forceinline__ void ld_field(const uint8_t *p, uint32_t (&w)[NW])
{
	if (A16 && NW % 4 == 0) {
#pragma unroll
		for (int i = 0; i < NW; i += 4)
			ld16(p + 4 * i, &w[i]);
	} else {
		ld_words<NW>(p, w);
	}
}

/* The IEEE half at p (2-byte aligned) as float32 (exact). */
static __device__ __forceinline__ float ld_f16(const uint8_t *p)
{
	return __half2float(__ushort_as_half(__ldg((const unsigned short *)p)));
}

static __device__ __forceinline__ float f16_bits(uint32_t h)
{
	return __half2float(__ushort_as_half((unsigned short)(h & 0xFFFFu)));
}

static __device__ __forceinline__ uint32_t byte_of(const uint32_t *w, uint32_t i)
{
	return (w[i >> 2] >> (8 * (i & 3))) & 0xFFu;
}

/* Scale and min j (0..7) of a Q4_K / Q5_K block from its 12 packed bytes as words s[0..2]
 * (quant_scale_min_k4). */
static __device__ __forceinline__ void scale_min_k4(const uint32_t *s, uint32_t j, uint32_t &sc, uint32_t &m)
{
	if (j < 4) {
		sc = byte_of(s, j) & 63;
		m = byte_of(s, j + 4) & 63;
	} else {
		sc = (byte_of(s, j + 4) & 0xF) | ((byte_of(s, j - 4) >> 6) << 4);
		m = (byte_of(s, j + 4) >> 4) | ((byte_of(s, j) >> 6) << 4);
	}
}

/* ---- exact dequantization of a unit: 32 values (Q8_0, Q4_0: a whole block) or 64 values
 * (the K formats: unit j of 4 covers values [64 j, 64 j + 64) of the block) ---------------- */

template <int F> struct dq_unit;

template <> struct dq_unit<DT_Q8_0> {
	static constexpr uint32_t BLOCK_BYTES = 34, BLOCK_ELEMS = 32, UNITS = 1, VALUES = 32;
	template <bool A16> static __device__ __forceinline__ void run(const uint8_t *b, uint32_t, float *y)
	{
		uint32_t q[8];
		ld_words<8>(b + 2, q);
		const float d = ld_f16(b);
#pragma unroll
		for (int i = 0; i < 32; i++)
			y[i] = __fmul_rn((float)(int8_t)byte_of(q, i), d);
	}
};

template <> struct dq_unit<DT_Q4_0> {
	static constexpr uint32_t BLOCK_BYTES = 18, BLOCK_ELEMS = 32, UNITS = 1, VALUES = 32;
	template <bool A16> static __device__ __forceinline__ void run(const uint8_t *b, uint32_t, float *y)
	{
		uint32_t q[4];
		ld_words<4>(b + 2, q);
		const float d = ld_f16(b);
#pragma unroll
		for (int i = 0; i < 16; i++) {
			const uint32_t v = byte_of(q, i);
			y[i] = __fmul_rn((float)((int)(v & 0xF) - 8), d);
			y[i + 16] = __fmul_rn((float)((int)(v >> 4) - 8), d);
		}
	}
};

template <> struct dq_unit<DT_Q4_K> {
	static constexpr uint32_t BLOCK_BYTES = 144, BLOCK_ELEMS = 256, UNITS = 4, VALUES = 64;
	/* Unit j: qs bytes [32 j, 32 j + 32): low nibbles are sub-block 2j, high ones 2j + 1. */
	template <bool A16> static __device__ __forceinline__ void run(const uint8_t *b, uint32_t j, float *y)
	{
		uint32_t h[4], q[8];
		ld_field<4, A16>(b, h);
		ld_field<8, A16>(b + 16 + 32 * j, q);
		const float d = f16_bits(h[0]), dmin = f16_bits(h[0] >> 16);
		uint32_t sc, m;
		scale_min_k4(h + 1, 2 * j, sc, m);
		const float d1 = __fmul_rn(d, (float)sc), m1 = __fmul_rn(dmin, (float)m);
		scale_min_k4(h + 1, 2 * j + 1, sc, m);
		const float d2 = __fmul_rn(d, (float)sc), m2 = __fmul_rn(dmin, (float)m);
#pragma unroll
		for (int l = 0; l < 32; l++) {
			const uint32_t v = byte_of(q, l);
			y[l] = __fsub_rn(__fmul_rn(d1, (float)(v & 0xF)), m1);
			y[l + 32] = __fsub_rn(__fmul_rn(d2, (float)(v >> 4)), m2);
		}
	}
};

template <> struct dq_unit<DT_Q5_K> {
	static constexpr uint32_t BLOCK_BYTES = 176, BLOCK_ELEMS = 256, UNITS = 4, VALUES = 64;
	/* Unit j: qs bytes [32 j, 32 j + 32); the fifth bits are bits 2j and 2j + 1 of qh[0..31]. */
	template <bool A16> static __device__ __forceinline__ void run(const uint8_t *b, uint32_t j, float *y)
	{
		uint32_t h[4], qh[8], q[8];
		ld_field<4, A16>(b, h);
		ld_field<8, A16>(b + 16, qh);
		ld_field<8, A16>(b + 48 + 32 * j, q);
		const float d = f16_bits(h[0]), dmin = f16_bits(h[0] >> 16);
		uint32_t sc, m;
		scale_min_k4(h + 1, 2 * j, sc, m);
		const float d1 = __fmul_rn(d, (float)sc), m1 = __fmul_rn(dmin, (float)m);
		scale_min_k4(h + 1, 2 * j + 1, sc, m);
		const float d2 = __fmul_rn(d, (float)sc), m2 = __fmul_rn(dmin, (float)m);
		const uint32_t u1 = 1u << (2 * j), u2 = 2u << (2 * j);
#pragma unroll
		for (int l = 0; l < 32; l++) {
			const uint32_t v = byte_of(q, l), hb = byte_of(qh, l);
			y[l] = __fsub_rn(__fmul_rn(d1, (float)((v & 0xF) + (hb & u1 ? 16 : 0))), m1);
			y[l + 32] = __fsub_rn(__fmul_rn(d2, (float)((v >> 4) + (hb & u2 ? 16 : 0))), m2);
		}
	}
};

template <> struct dq_unit<DT_Q6_K> {
	static constexpr uint32_t BLOCK_BYTES = 210, BLOCK_ELEMS = 256, UNITS = 4, VALUES = 64;
	/* Unit j: half nh = j / 2 of the block (ql[64 nh ..], qh[32 nh ..], scales[8 nh ..]); k = j % 2
	 * picks the low nibbles (values 128 nh + 0..63) or the high ones (128 nh + 64..127). */
	template <bool A16> static __device__ __forceinline__ void run(const uint8_t *b, uint32_t j, float *y)
	{
		const uint32_t nh = j >> 1, k = j & 1;
		uint32_t ql[16], qh[8], sw[2];
		ld_words<16>(b + 64 * nh, ql);
		ld_words<8>(b + 128 + 32 * nh, qh);
		ld_words<2>(b + 192 + 8 * nh, sw);
		const float d = ld_f16(b + 208);
#pragma unroll
		for (int l = 0; l < 32; l++) {
			const uint32_t is = l / 16 + 4 * k, sh = 4 * k;
			const uint32_t a = byte_of(ql, l), c = byte_of(ql, l + 32), h = byte_of(qh, l);
			const int q1 = (int)(((a >> sh) & 0xF) | (((h >> (4 * k)) & 3) << 4)) - 32;
			const int q2 = (int)(((c >> sh) & 0xF) | (((h >> (4 * k + 2)) & 3) << 4)) - 32;
			const float s1 = (float)(int8_t)byte_of(sw, is), s2 = (float)(int8_t)byte_of(sw, is + 2);
			y[l] = __fmul_rn(__fmul_rn(d, s1), (float)q1);
			y[l + 32] = __fmul_rn(__fmul_rn(d, s2), (float)q2);
		}
	}
};

#endif

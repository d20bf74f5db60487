/* quant.c - dequantization of the GGUF block formats (quant.h). Each loop follows ggml's
 * dequantize_row_* in its order of float32 operations; this file is compiled with
 * -ffp-contract=off so that no compiler fuses a multiply and a subtract into one rounding. */
#include "common/quant.h"

#include <string.h>

static void dq_q8_0(const struct block_q8_0 *x, float *y, size_t nb)
{
	for (size_t i = 0; i < nb; i++) {
		const float d = f16_to_f32(x[i].d);
		for (int j = 0; j < QK8_0; j++)
			y[i * QK8_0 + j] = (float)x[i].qs[j] * d;
	}
}

static void dq_q4_0(const struct block_q4_0 *x, float *y, size_t nb)
{
	for (size_t i = 0; i < nb; i++) {
		const float d = f16_to_f32(x[i].d);
		for (int j = 0; j < QK4_0 / 2; j++) {
			const int x0 = (x[i].qs[j] & 0x0F) - 8;
			const int x1 = (x[i].qs[j] >> 4) - 8;
			y[i * QK4_0 + j] = (float)x0 * d;
			y[i * QK4_0 + j + QK4_0 / 2] = (float)x1 * d;
		}
	}
}

static void dq_q4_k(const struct block_q4_K *x, float *y, size_t nb)
{
	for (size_t i = 0; i < nb; i++) {
		const uint8_t *q = x[i].qs;
		const float d = f16_to_f32(x[i].d);
		const float min = f16_to_f32(x[i].dmin);
		int is = 0;
		uint8_t sc, m;
		for (int j = 0; j < QK_K; j += 64) {
			quant_scale_min_k4(is + 0, x[i].scales, &sc, &m);
			const float d1 = d * sc, m1 = min * m;
			quant_scale_min_k4(is + 1, x[i].scales, &sc, &m);
			const float d2 = d * sc, m2 = min * m;
			for (int l = 0; l < 32; ++l)
				*y++ = d1 * (q[l] & 0xF) - m1;
			for (int l = 0; l < 32; ++l)
				*y++ = d2 * (q[l] >> 4) - m2;
			q += 32;
			is += 2;
		}
	}
}

static void dq_q5_k(const struct block_q5_K *x, float *y, size_t nb)
{
	for (size_t i = 0; i < nb; i++) {
		const uint8_t *ql = x[i].qs;
		const uint8_t *qh = x[i].qh;
		const float d = f16_to_f32(x[i].d);
		const float min = f16_to_f32(x[i].dmin);
		int is = 0;
		uint8_t sc, m;
		uint8_t u1 = 1, u2 = 2;
		for (int j = 0; j < QK_K; j += 64) {
			quant_scale_min_k4(is + 0, x[i].scales, &sc, &m);
			const float d1 = d * sc, m1 = min * m;
			quant_scale_min_k4(is + 1, x[i].scales, &sc, &m);
			const float d2 = d * sc, m2 = min * m;
			for (int l = 0; l < 32; ++l)
				*y++ = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
			for (int l = 0; l < 32; ++l)
				*y++ = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
			ql += 32;
			is += 2;
			u1 = (uint8_t)(u1 << 2);
			u2 = (uint8_t)(u2 << 2);
		}
	}
}

static void dq_q6_k(const struct block_q6_K *x, float *y, size_t nb)
{
	for (size_t i = 0; i < nb; i++) {
		const float d = f16_to_f32(x[i].d);
		const uint8_t *ql = x[i].ql;
		const uint8_t *qh = x[i].qh;
		const int8_t *sc = x[i].scales;
		for (int n = 0; n < QK_K; n += 128) {
			for (int l = 0; l < 32; ++l) {
				const int is = l / 16;
				const int8_t q1 = (int8_t)((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
				const int8_t q2 = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
				const int8_t q3 = (int8_t)((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
				const int8_t q4 = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
				y[l + 0] = d * sc[is + 0] * q1;
				y[l + 32] = d * sc[is + 2] * q2;
				y[l + 64] = d * sc[is + 4] * q3;
				y[l + 96] = d * sc[is + 6] * q4;
			}
			y += 128;
			ql += 64;
			qh += 32;
			sc += 8;
		}
	}
}

/* The block structs are read through a copy when src is not aligned for them (a tensor of a
 * GGUF file starts at a 32-byte boundary, but a caller may pass any row). */
#define DQ_BLOCKS(type, fn)                                                            \
	do {                                                                           \
		size_t nb = n / dtype_block_elems(t);                                  \
		if (((uintptr_t)src % _Alignof(type)) == 0) {                          \
			fn((const type *)src, dst, nb);                                \
		} else {                                                               \
			for (size_t b = 0; b < nb; b++) {                              \
				type blk;                                              \
				memcpy(&blk, (const char *)src + b * sizeof(type), sizeof(type)); \
				fn(&blk, dst + b * dtype_block_elems(t), 1);            \
			}                                                              \
		}                                                                      \
	} while (0)

void quant_dequantize(enum dtype t, const void *src, float *dst, size_t n)
{
	switch (t) {
	case DT_Q8_0:
		DQ_BLOCKS(struct block_q8_0, dq_q8_0);
		break;
	case DT_Q4_0:
		DQ_BLOCKS(struct block_q4_0, dq_q4_0);
		break;
	case DT_Q4_K:
		DQ_BLOCKS(struct block_q4_K, dq_q4_k);
		break;
	case DT_Q5_K:
		DQ_BLOCKS(struct block_q5_K, dq_q5_k);
		break;
	case DT_Q6_K:
		DQ_BLOCKS(struct block_q6_K, dq_q6_k);
		break;
	default:
		dtype_to_f32(t, src, dst, n);
		break;
	}
}

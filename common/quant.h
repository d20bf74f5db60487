/* quant.h - the block formats of GGUF files: their layouts, byte for byte as ggml stores them,
 * the dequantizers that turn blocks into float32 exactly as the format defines (quant.c), and
 * the quantizers that make blocks from float32 (quantize.c).
 *
 * A block holds dtype_block_elems(t) values (32 for Q8_0 and Q4_0, 256 for the K formats) in
 * dtype_block_bytes(t) bytes. Scales are IEEE half precision. The dequantizers compute in
 * float32 in ggml's order of operations (quant.c is built without contraction into FMA), so the
 * results are the same bits as the reference implementations (llama.cpp's ggml-quants.c and the
 * numpy dequantizers of its gguf-py package), which tests/unit/common/test_quant.c checks.
 *
 *   float row[4096];
 *   quant_dequantize(DT_Q4_K, blocks, row, 4096);   // 16 blocks of 144 bytes
 *   quant_quantize(DT_Q4_K, row, blocks, 4096);     // and back
 */
#ifndef PIPELINE_QUANT_H
#define PIPELINE_QUANT_H
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#ifdef __cplusplus
extern "C" {
#endif

#define QK8_0 32 /* values per Q8_0 block */
#define QK4_0 32 /* values per Q4_0 block */
#define QK_K 256 /* values per K block */
#define K_SCALE_SIZE 12

/* y = d * q */
struct block_q8_0 {
	uint16_t d; /* f16 */
	int8_t qs[QK8_0];
};

/* y = d * (q - 8); value j < 16 is the low nibble of qs[j], value j + 16 the high one */
struct block_q4_0 {
	uint16_t d; /* f16 */
	uint8_t qs[QK4_0 / 2];
};

/* 8 sub-blocks of 32 values, each with a 6-bit scale and a 6-bit min packed into scales[12]:
 * y = d * sc * q - dmin * m, q a nibble of qs (64 values per 32 bytes: low nibbles first) */
struct block_q4_K {
	uint16_t d;    /* f16, super-block scale of the scales */
	uint16_t dmin; /* f16, super-block scale of the mins */
	uint8_t scales[K_SCALE_SIZE];
	uint8_t qs[QK_K / 2];
};

/* as Q4_K, with the fifth bit of each value in qh */
struct block_q5_K {
	uint16_t d;
	uint16_t dmin;
	uint8_t scales[K_SCALE_SIZE];
	uint8_t qh[QK_K / 8];
	uint8_t qs[QK_K / 2];
};

/* 16 sub-blocks of 16 values with int8 scales: y = d * sc * (q - 32), q 6 bits (4 in ql, 2 in qh) */
struct block_q6_K {
	uint8_t ql[QK_K / 2];
	uint8_t qh[QK_K / 4];
	int8_t scales[QK_K / 16];
	uint16_t d; /* f16 */
};

_Static_assert(sizeof(struct block_q8_0) == 34, "Q8_0 block is 34 bytes");
_Static_assert(sizeof(struct block_q4_0) == 18, "Q4_0 block is 18 bytes");
_Static_assert(sizeof(struct block_q4_K) == 144, "Q4_K block is 144 bytes");
_Static_assert(sizeof(struct block_q5_K) == 176, "Q5_K block is 176 bytes");
_Static_assert(sizeof(struct block_q6_K) == 210, "Q6_K block is 210 bytes");

/* Scale j (0..7) and min j of a Q4_K/Q5_K block's packed scales[12] (ggml's get_scale_min_k4). */
static inline void quant_scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m)
{
	if (j < 4) {
		*sc = q[j] & 63;
		*m = q[j + 4] & 63;
	} else {
		*sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
		*m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
	}
}

/* Dequantizes n values (a multiple of dtype_block_elems(t)) of format t, blocks at src (any
 * alignment), into dst. Element formats widen as dtype_to_f32 does. */
void quant_dequantize(enum dtype t, const void *src, float *dst, size_t n);

/* Quantizes n float32 values at src (n a multiple of dtype_block_elems(t)) into format t at dst
 * (dtype_row_bytes(t, n) bytes, any alignment, not overlapping src). F32 copies; F16 and BF16
 * round to nearest even (f32_to_f16, f32_to_bf16: F16 gives infinity from 65520 on, as IEEE
 * conversion does). The
 * block formats search each block's scales for a small error, weighted toward its large values
 * as llama.cpp's reference quantizers are (quantize.c says how, per format). A block decodes to
 * finite values whatever the input: values past +-1e8 are clipped and NaN is read as 0. The
 * result depends only on the input (the same bytes on every machine). Thread-safe; no
 * allocation. */
void quant_quantize(enum dtype t, const float *src, void *dst, size_t n);

#ifdef __cplusplus
}
#endif
#endif

/* dtype.h - the weight formats a checkpoint may store, and conversions to float32.
 *
 * Element formats (F32, F16, BF16) store each value on its own; block formats (GGUF's Q8_0,
 * Q4_0, Q4_K, Q5_K, Q6_K) store a fixed number of values together with their scales, byte for
 * byte as ggml lays them out (common/quant.h has the layouts, the dequantizers and the
 * quantizers). A row of a matrix holds whole blocks, so sizes go through dtype_row_bytes.
 *
 * Conversions are exact (bf16 and fp16 widen to float32 without rounding); the narrowing
 * conversions round to nearest even, as PyTorch does. */
#ifndef PIPELINE_DTYPE_H
#define PIPELINE_DTYPE_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#ifdef __cplusplus
extern "C" {
#endif

enum dtype {
	DT_F32 = 0,
	DT_F16 = 1,
	DT_BF16 = 2,
	DT_Q8_0 = 3, /* 32 values: f16 scale, 32 x int8 (34 bytes) */
	DT_Q4_0 = 4, /* 32 values: f16 scale, 32 x 4 bits, offset 8 (18 bytes) */
	DT_Q4_K = 5, /* 256 values: f16 d, dmin, 8 x 6-bit scales and mins, 256 x 4 bits (144 bytes) */
	DT_Q5_K = 6, /* 256 values: as Q4_K plus a fifth bit per value (176 bytes) */
	DT_Q6_K = 7, /* 256 values: 16 x int8 scales, 256 x 6 bits, f16 d (210 bytes) */
	DT_COUNT = 8,
	DT_ELEMENT_COUNT = 3, /* formats below this store element by element */
};

/* Is t stored element by element (F32, F16, BF16)? */
static inline int dtype_is_element(enum dtype t)
{
	return (unsigned)t < DT_ELEMENT_COUNT;
}

/* Bytes per element of an element format; 0 for a block format (use dtype_row_bytes). */
static inline size_t dtype_size(enum dtype t)
{
	return t == DT_F32 ? 4 : dtype_is_element(t) ? 2 : 0;
}

/* Elements per block: the unit a format stores (1 for F32, F16 and BF16; Q8_0 and Q4_0 store 32
 * values together, the K formats 256). A row holds whole blocks. */
static inline uint32_t dtype_block_elems(enum dtype t)
{
	switch (t) {
	case DT_Q8_0:
	case DT_Q4_0:
		return 32;
	case DT_Q4_K:
	case DT_Q5_K:
	case DT_Q6_K:
		return 256;
	default:
		return 1;
	}
}

/* Bytes of one block. */
static inline size_t dtype_block_bytes(enum dtype t)
{
	switch (t) {
	case DT_Q8_0:
		return 34;
	case DT_Q4_0:
		return 18;
	case DT_Q4_K:
		return 144;
	case DT_Q5_K:
		return 176;
	case DT_Q6_K:
		return 210;
	default:
		return dtype_size(t);
	}
}

/* Bytes of n elements stored in format t (n a multiple of dtype_block_elems). Use this, not
 * n * dtype_size, for rows and tensors: it stays right for block formats. */
static inline uint64_t dtype_row_bytes(enum dtype t, uint64_t n)
{
	return n / dtype_block_elems(t) * dtype_block_bytes(t);
}

/* "F32", "F16", "BF16" (the safetensors spelling), "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K" (ggml's). */
const char *dtype_name(enum dtype t);
/* Parses a safetensors dtype string (element formats only). Returns 0 or -ENOTSUP for a type we do not compute in
 * (I8, F64, F8_E4M3, ...), -EINVAL for unknown text. */
int dtype_parse(const char *text, enum dtype *out);

static inline float bf16_to_f32(uint16_t h)
{
	uint32_t u = (uint32_t)h << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static inline uint16_t f32_to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it a quiet NaN */
		return (uint16_t)((u >> 16) | 0x40);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (uint16_t)(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

/* Widens n elements of type t at src to float32 at dst. For a block format src is the first
 * block and n a multiple of dtype_block_elems (quant_dequantize, common/quant.h). */
void dtype_to_f32(enum dtype t, const void *src, float *dst, size_t n);
/* Reads element i of an element format at src as float32. */
static inline float dtype_get_f32(enum dtype t, const void *src, size_t i)
{
	if (t == DT_BF16)
		return bf16_to_f32(((const uint16_t *)src)[i]);
	if (t == DT_F16)
		return f16_to_f32(((const uint16_t *)src)[i]);
	return ((const float *)src)[i];
}

#ifdef __cplusplus
}
#endif
#endif

/* dtype.h - the element types a checkpoint may store, and conversions to float32.
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
	DT_COUNT = 3,
};

/* Bytes per element of a format stored element by element (every format today). */
static inline size_t dtype_size(enum dtype t)
{
	return t == DT_F32 ? 4 : 2;
}

/* Elements per block: the unit a format stores (1 for F32, F16 and BF16; block-quantized
 * formats store 32 or 256 elements together). A row holds whole blocks. */
static inline uint32_t dtype_block_elems(enum dtype t)
{
	(void)t;
	return 1;
}

/* Bytes of one block. */
static inline size_t dtype_block_bytes(enum dtype t)
{
	return dtype_size(t);
}

/* Bytes of n elements stored in format t (n a multiple of dtype_block_elems). Use this, not
 * n * dtype_size, for rows and tensors: it stays right for block formats. */
static inline uint64_t dtype_row_bytes(enum dtype t, uint64_t n)
{
	return n / dtype_block_elems(t) * dtype_block_bytes(t);
}

/* "F32", "F16", "BF16" (the safetensors spelling). */
const char *dtype_name(enum dtype t);
/* Parses a safetensors dtype string. Returns 0 or -ENOTSUP for a type we do not compute in
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

/* Widens n elements of type t at src to float32 at dst. */
void dtype_to_f32(enum dtype t, const void *src, float *dst, size_t n);
/* Reads element i of type t at src as float32. */
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

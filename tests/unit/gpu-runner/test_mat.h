/* test_mat.h - a weight matrix of any format for the CPU products' tests (test_cpu_matvec,
 * test_cpu_matmul): random values quantized with common/quant.c, as stored and dequantized.
 * Include after check.h, common/quant.h and runner_test_util.h (rng_normal). */
#ifndef TESTS_UNIT_GPU_RUNNER_TEST_MAT_H
#define TESTS_UNIT_GPU_RUNNER_TEST_MAT_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"

/* A weight matrix as stored (w: rows row_bytes apart, at an address misalign bytes past an
 * allocation) and dequantized (deq: rows x cols float32). */
struct mat {
	enum dtype t;
	uint32_t rows, cols;
	uint64_t row_bytes;
	uint8_t *buf;
	const uint8_t *w;
	float *deq;
};

static inline struct mat make_mat(enum dtype t, uint32_t rows, uint32_t cols, uint32_t extra, uint32_t misalign)
{
	struct mat m = {.t = t, .rows = rows, .cols = cols, .row_bytes = dtype_row_bytes(t, cols) + extra};
	m.buf = malloc(rows * m.row_bytes + misalign + 1);
	m.deq = malloc((size_t)rows * cols * sizeof(float));
	float *src = malloc((size_t)cols * sizeof(float));
	void *aligned = malloc(m.row_bytes); /* dtype_to_f32 reads element formats aligned */
	ck_assert(m.buf && m.deq && src && aligned);
	memset(m.buf, 0xA5, rows * m.row_bytes + misalign + 1);
	m.w = m.buf + misalign;
	for (uint32_t r = 0; r < rows; r++) {
		const double scale = 0.02 * (1 + r % 3);
		for (uint32_t c = 0; c < cols; c++)
			src[c] = (float)(scale * rng_normal());
		quant_quantize(t, src, m.buf + misalign + r * m.row_bytes, cols);
		memcpy(aligned, m.w + r * m.row_bytes, m.row_bytes);
		quant_dequantize(t, aligned, m.deq + (size_t)r * cols, cols);
	}
	free(aligned);
	free(src);
	return m;
}

static inline void free_mat(struct mat *m)
{
	free(m->buf);
	free(m->deq);
}

#endif

/* test_cuda_quant.c - the CUDA backend with GGUF block-quantized weights (Q8_0, Q4_0, Q4_K, Q5_K,
 * Q6_K) against the C reference (LABELS gpu).
 *
 * Weights are random valid blocks built here: random bytes for quants and scales, f16 scales
 * sized so values stay within a chosen amplitude. The reference dequantizes them with
 * quant_dequantize (common/quant.h) and sums in double.
 *
 *  - products (cuda_test.h's hook, the backend's own dispatch): decode (1, 3, 5, 8 tokens: the
 *    fused GEMV; 12 and 16: two passes of it), prefill (20, 37, 300 tokens: dequantization to
 *    BF16 and cuBLAS in row chunks), the
 *    GEMV switched off (BACKEND_GEMV_CUBLAS), odd row counts, widths of 256 k (96 for the 32-value
 *    formats), a width that takes several tiles of staged x, a tensor 2 bytes off alignment.
 *    Against the exact product (float32 x): relative L2 <= 1e-2, because the backend rounds x to
 *    BF16 (2^-9 relative per value) and the prefill path rounds the dequantized weights to BF16
 *    too: two independent 2^-9 roundings per term give ~3e-3 on a dot product. Against a reference
 *    that rounds the same way (x to BF16; for the dequantizing path the weights too): <= 1e-4,
 *    only float32 summation being left (SwiGLU: <= 4e-3, its output is BF16).
 *  - the same one-token products on a backend with the integer path (BACKEND_GEMV_DP4A): x is
 *    quantized to int8 per 32 values (up to 0.4% of a group's largest value per value), still
 *    within 1e-2 of the exact product, and within 1e-4 of a reference that quantizes x the same
 *    way and takes the exact weights; the formats without the path, and 3 tokens, keep the float
 *    GEMV's bounds. The forward passes run with it too (logits within 2e-2).
 *  - a forward pass of a tiny model with mixed formats as a Q4_K_M file mixes them (Q4_K with a
 *    Q6_K wv and down_proj, a BF16 matrix in a chain, gate and up in different formats), both
 *    RoPE layouts, head_dim 64 and 128, tied embeddings: logits within 2e-2 (as BF16 weights) of
 *    the C reference; and ROPE_ADJACENT on wq/wk rows permuted as GGUF stores them equals
 *    ROPE_HALVES on the original rows (1e-3), on both backends.
 *  - decode attention with the keys of earlier steps loaded before the wait for the kernel before
 *    (the default) and after it (BACKEND_FUSE_LATE_KV): the same logits, bit for bit; with one
 *    warp a query (BACKEND_FUSE_ONE_KEY_WARP, not two): within the forward bound of the C
 *    reference and TOL_PERMUTED of the default (q.k summed in another order).
 *  - one-token integer products in wide blocks (several row groups a block, x staged once) and in
 *    blocks of one row group (BACKEND_FUSE_NARROW_DQ), on a model whose products have more row
 *    groups than the GPU has multiprocessors: the same logits, bit for bit.
 *  - a one-token product of parts in two formats (layer 0's q/k in Q4_K, v in Q6_K) in one launch
 *    and in a launch a format (BACKEND_FUSE_APART_DQ), in blocks of one row group and wide ones
 *    (BACKEND_FUSE_WIDE_QKV): the same logits, bit for bit, and one such launch a decode step.
 *  - bench-kernels' hook that leaves kernels out of one-token steps: the attention left out changes
 *    the logits, nothing left out gives them back bit for bit.
 *  - embedding rows of every format: the residual stream equals the float32 dequantized rows,
 *    bit for bit.
 *  - the front's refusals: block formats for norm vectors, rows not of whole blocks, chains whose
 *    activation dtypes differ.
 *
 * PIPELINE_TEST_VERBOSE=1 prints every error measured. Without a GPU the program exits 77
 * (ctest: skipped); CUDA is touched only in the forked children. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "common/dtype.h"
#include "common/model.h"
#include "common/quant.h"
#include "services/gpu-runner/backend.h"
#include "tests/unit/gpu-runner/cuda_test_util.h"
#include "tests/unit/gpu-runner/runner_test_util.h"
#include "services/gpu-runner/cuda/cuda_test.h"

#define TOL_EXACT 1e-2	 /* against float32 x and exact weights */
#define TOL_SAME 1e-4	 /* against a reference rounding as the backend does */
#define TOL_SWIGLU 4e-3	 /* SwiGLU's BF16 output against a reference rounding as the backend does */
#define TOL_FORWARD 2e-2 /* logits of a forward pass, BF16 activations and KV */
#define TOL_FUSED 1e-3	 /* the same pass with and without the fused kernels (backend_fuse) */
/* ROPE_ADJACENT on permuted rows against ROPE_HALVES. The C reference gives the same logits to
 * the bit. The CUDA backend sums q.k over a head in another order when the rows are permuted, and
 * a 1e-7 change can flip the BF16 rounding of an activation (2^-9 relative): over this small
 * model that measures 2.3e-3 (H100). Ignoring the layout moves the logits by 0.6. */
#define TOL_PERMUTED 1e-2
#define MAX_ALLOCS 256
#define MAX_CTX 64

static const enum dtype FORMATS[] = {DT_Q8_0, DT_Q4_0, DT_Q4_K, DT_Q5_K, DT_Q6_K};
#define N_FORMATS (sizeof(FORMATS) / sizeof(FORMATS[0]))

static void report(const char *what, double err)
{
	if (test_verbose())
		fprintf(stderr, "test_cuda_quant: %-70s relative L2 error %.3e\n", what, err);
}

/* cuda_test_util.h's rel_l2 over products of any size, refusing a reference of zeros. */
static double rel_l2_values(const float *a, const float *ref, size_t n)
{
	double num = 0, den = 0;
	for (size_t i = 0; i < n; i++) {
		ck_assert_msg(isfinite(a[i]), "value %zu is %g", i, (double)a[i]);
		num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
		den += (double)ref[i] * ref[i];
	}
	ck_assert_msg(den > 0, "the reference is all zeros");
	return sqrt(num / den);
}

/* ---- random blocks -------------------------------------------------------------------------- */

static void put_f16(uint8_t *p, double v)
{
	uint16_t h = f32_to_f16((float)v);
	memcpy(p, &h, 2); /* little-endian, as GGUF */
}

/* rows x cols values in block format f: random quants and packed scales, the f16 scales sized
 * so values stay within about +-amp (|d * sc * q| at most amp, mins up to amp / 2). */
static void *quant_matrix(enum dtype f, uint32_t rows, uint32_t cols, double amp)
{
	ck_assert_msg(cols % dtype_block_elems(f) == 0, "%u columns are not whole %s blocks", cols, dtype_name(f));
	size_t nb = (size_t)rows * cols / dtype_block_elems(f), bb = dtype_block_bytes(f);
	uint8_t *p = malloc(nb * bb);
	ck_assert_ptr_nonnull(p);
	for (size_t i = 0; i < nb * bb; i++)
		p[i] = (uint8_t)(rng_next() >> 56);
	for (size_t b = 0; b < nb; b++) {
		uint8_t *k = p + b * bb;
		double u = 0.5 + 0.5 * rng_uniform(), s = (rng_next() & 1) ? 1.0 : -1.0;
		switch (f) {
		case DT_Q8_0: /* d * q, q int8 */
			put_f16(k, s * u * amp / 127);
			break;
		case DT_Q4_0: /* d * (q - 8) */
			put_f16(k, s * u * amp / 8);
			break;
		case DT_Q4_K: /* d * sc * q - dmin * m: sc, m < 64, q < 16 */
			put_f16(k, u * amp / (63.0 * 15));
			put_f16(k + 2, (0.5 + 0.5 * rng_uniform()) * amp / 126);
			break;
		case DT_Q5_K: /* q < 32 */
			put_f16(k, u * amp / (63.0 * 31));
			put_f16(k + 2, (0.5 + 0.5 * rng_uniform()) * amp / 126);
			break;
		case DT_Q6_K: /* d * sc * (q - 32): sc int8, q < 64 */
			put_f16(k + 208, s * u * amp / (128.0 * 32));
			break;
		default:
			ck_abort_msg("not a block format: %s", dtype_name(f));
		}
	}
	return p;
}

/* Values of n elements of element format f: mean + amp * N(0, 1). */
static void *element_matrix(enum dtype f, size_t n, double mean, double amp)
{
	void *p = malloc(n * dtype_size(f));
	ck_assert_ptr_nonnull(p);
	for (size_t i = 0; i < n; i++) {
		float v = (float)(mean + amp * rng_normal());
		if (f == DT_F32)
			((float *)p)[i] = v;
		else if (f == DT_BF16)
			((uint16_t *)p)[i] = f32_to_bf16(v);
		else
			((uint16_t *)p)[i] = f32_to_f16(v);
	}
	return p;
}

static float round_bf16(float v)
{
	return bf16_to_f32(f32_to_bf16(v));
}

/* ---- (a) products through the backend's dispatch ------------------------------------------- */

/* A backend whose dequantization scratch (the largest matrix of a layer: 512 x 256) is much
 * smaller than the products below, so prefill goes through many row chunks. */
static struct model_config small_cfg(void)
{
	struct model_config c = {
		.arch = ARCH_LLAMA, .n_layers = 2, .dim = 256, .n_heads = 4, .n_kv_heads = 2, .head_dim = 64,
		.ffn_dim = 512, .vocab_size = 512, .max_position = 4096, .rms_eps = 1e-5f, .rope_theta = 10000.0f,
		.rope_scaling = ROPE_SCALING_NONE, .bos_id = -1,
	};
	return c;
}

/* enum backend_fuse of the backends open_backend makes. */
static uint32_t open_fuse = BACKEND_FUSE_DEFAULT;

static struct backend *open_backend(const char *name, const struct model_config *c, uint32_t max_chunk,
				    uint32_t gemv)
{
	struct backend_params p = {.max_chunk = max_chunk, .block_tokens = 16, .n_kv_blocks = 2 * (MAX_CTX / 16 + 1),
				   .kv_dtype = strcmp(name, "cpu") ? DT_BF16 : DT_F32, .threads = 1, .gemv = gemv,
				   .fuse = open_fuse};
	struct backend *be = NULL;
	char err[400] = "";
	int rc = backend_create(name, c, &p, &be, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s create: %d %s", name, rc, err);
	return be;
}

/* A quantized matrix with its host dequantization (float32, and rounded to BF16), and a device
 * copy `off` bytes past an aligned start. */
struct qmat {
	enum dtype f;
	uint32_t rows, cols;
	uint8_t *host;
	float *wf, *wb;	   /* (rows, cols) dequantized; rounded to bf16 */
	void *dev_alloc;
	const void *dev;
};

static void qmat_new(struct qmat *m, enum dtype f, uint32_t rows, uint32_t cols, size_t off, uint64_t seed)
{
	rng_state = seed;
	m->f = f;
	m->rows = rows;
	m->cols = cols;
	m->host = quant_matrix(f, rows, cols, 1.0);
	size_t n = (size_t)rows * cols, bytes = rows * dtype_row_bytes(f, cols);
	m->wf = malloc(n * sizeof(float));
	m->wb = malloc(n * sizeof(float));
	ck_assert(m->wf && m->wb);
	quant_dequantize(f, m->host, m->wf, n);
	for (size_t i = 0; i < n; i++)
		m->wb[i] = round_bf16(m->wf[i]);
	CUDA_OK(cudaMalloc(&m->dev_alloc, bytes + 256));
	m->dev = (const char *)m->dev_alloc + off;
	CUDA_OK(cudaMemcpy((char *)m->dev_alloc + off, m->host, bytes, cudaMemcpyHostToDevice));
	CUDA_OK(cudaDeviceSynchronize()); /* the DMA of a pageable copy may land after it returns */
}

static void qmat_free(struct qmat *m)
{
	CUDA_OK(cudaFree(m->dev_alloc));
	free(m->host);
	free(m->wf);
	free(m->wb);
	memset(m, 0, sizeof(*m));
}

/* out (n, rows) = x (n, cols) . W^T in double from w (rows, cols) */
static void ref_product(const float *w, uint32_t rows, uint32_t cols, const float *x, uint32_t n, float *out)
{
	for (uint32_t t = 0; t < n; t++)
		for (uint32_t o = 0; o < rows; o++) {
			const float *wr = w + (size_t)o * cols, *xr = x + (size_t)t * cols;
			double s = 0;
			for (uint32_t i = 0; i < cols; i++)
				s += (double)wr[i] * xr[i];
			out[(size_t)t * rows + o] = (float)s;
		}
}

enum path {
	PATH_GEMV = 0,	  /* the fused quantized GEMV */
	PATH_DEQUANT = 1, /* dequantization to BF16, cuBLAS */
	PATH_DP4A = 2,	  /* the fused GEMV with x quantized to int8 (BACKEND_GEMV_DP4A, one token) */
};

static const char *path_name(enum path p)
{
	return p == PATH_GEMV ? "gemv" : p == PATH_DP4A ? "gemv, int8 x" : "dequant+cublas";
}

/* x (n rows of cols, cols a multiple of 32) as the integer path reads it: per 32 values,
 * d = amax / 127, q = rint(x * (1 / d)) (half to even) clamped to +-127, read back as q d. */
static void quantize_x_q8(const float *x, size_t count, float *out)
{
	for (size_t g = 0; g < count; g += 32) {
		float amax = 0.0f;
		for (size_t i = g; i < g + 32; i++)
			amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
		const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
		for (size_t i = g; i < g + 32; i++) {
			float q = rintf(x[i] * id);
			q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
			out[i] = (float)((double)q * d);
		}
	}
}

/* One product of m with n random tokens on be, expected to take `path`; checks both bounds. */
static void check_product(struct backend *be, const struct qmat *m, uint32_t n, enum cuda_test_mode mode,
			  enum path path, const char *what)
{
	size_t nx = (size_t)n * m->cols, no = (size_t)n * m->rows;
	float *x = malloc(nx * sizeof(float)), *xb = malloc(nx * sizeof(float));
	float *got = malloc(no * sizeof(float)), *exact = malloc(no * sizeof(float)), *same = malloc(no * sizeof(float));
	float *addend = malloc(no * sizeof(float));
	ck_assert(x && xb && got && exact && same && addend);
	rng_state = 1000 + n + m->rows;
	for (size_t i = 0; i < nx; i++) {
		x[i] = (float)rng_normal();
		xb[i] = round_bf16(x[i]);
	}
	for (size_t i = 0; i < no; i++)
		addend[i] = got[i] = (float)rng_normal();
	struct cuda_test_product t = {.format = m->f, .w = {m->dev, m->dev}, .rows = m->rows, .cols = m->cols, .n = n,
				      .mode = mode, .x = x, .out = got};
	char err[400] = "";
	int rc = cuda_test_matmul(be, &t, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s: %d %s", what, rc, err);
	/* The exact product, and the one rounded as the path rounds. */
	ref_product(m->wf, m->rows, m->cols, x, n, exact);
	if (path == PATH_DP4A) {
		/* The exact weights against x as the integer path quantizes it. */
		float *xq = malloc(nx * sizeof(float));
		ck_assert(xq && m->cols % 32 == 0);
		quantize_x_q8(xb, nx, xq);
		ref_product(m->wf, m->rows, m->cols, xq, n, same);
		free(xq);
	} else {
		ref_product(path == PATH_GEMV ? m->wf : m->wb, m->rows, m->cols, xb, n, same);
	}
	double tol_same = TOL_SAME;
	if (mode == CUDA_TEST_ADD) {
		for (size_t i = 0; i < no; i++) {
			exact[i] += addend[i];
			same[i] += addend[i];
		}
	} else if (mode == CUDA_TEST_SWIGLU) {
		/* gate and up are the same matrix here: silu(y) * y, in float32 as the reference's
		 * cpu_silu_mul, then BF16. */
		for (size_t i = 0; i < no; i++) {
			float e = exact[i], s = same[i];
			exact[i] = (float)((double)e / (1.0 + exp(-(double)e))) * e;
			same[i] = round_bf16((float)((double)s / (1.0 + exp(-(double)s))) * s);
		}
		tol_same = TOL_SWIGLU;
	}
	double e1 = rel_l2_values(got, exact, no), e2 = rel_l2_values(got, same, no);
	char line[200];
	snprintf(line, sizeof(line), "%s: exact", what);
	report(line, e1);
	snprintf(line, sizeof(line), "%s: as rounded (%s)", what, path_name(path));
	report(line, e2);
	ck_assert_msg(e1 <= TOL_EXACT, "%s: relative L2 error %.3e against the exact product (bound %g)", what, e1,
		      TOL_EXACT);
	ck_assert_msg(e2 <= tol_same,
		      "%s: relative L2 error %.3e against the reference rounded as the %s path rounds (bound %g): "
		      "wrong values, or the product took the other path", what, e2,
		      path_name(path), tol_same);
	free(x);
	free(xb);
	free(got);
	free(exact);
	free(same);
	free(addend);
}

/* Every shape of one format on the default backend (GEMV up to 16 tokens) and on one with the
 * GEMV off. */
static void check_format(enum dtype f)
{
	struct model_config c = small_cfg();
	struct backend *be = open_backend("cuda", &c, 16, BACKEND_GEMV_ROWS1);
	struct backend *bc = open_backend("cuda", &c, 16, BACKEND_GEMV_CUBLAS);
	bool small_blocks = dtype_block_elems(f) == 32;
	uint32_t narrow = small_blocks ? 96 : 256;
	char what[160];
	struct qmat m;

	/* Decode widths: narrow (fewer blocks than a warp step), 9 K blocks (a partial step),
	 * 20480 (more than one tile of staged x for one token). */
	const uint32_t widths[] = {narrow, 2304, 20480};
	for (size_t i = 0; i < 3; i++) {
		qmat_new(&m, f, 1003, widths[i], 0, 11 + i);
		static const uint32_t ns[] = {1, 3, 5, 8, 12, 16};
		for (size_t k = 0; k < 6; k++) {
			if (widths[i] == 20480 && ns[k] > 3)
				continue;
			snprintf(what, sizeof(what), "%s 1003 x %u, %u tokens", dtype_name(f), widths[i], ns[k]);
			check_product(be, &m, ns[k], CUDA_TEST_STORE, PATH_GEMV, what);
		}
		snprintf(what, sizeof(what), "%s 1003 x %u, 1 token, gemv off", dtype_name(f), widths[i]);
		check_product(bc, &m, 1, CUDA_TEST_STORE, PATH_DEQUANT, what);
		qmat_free(&m);
	}
	/* Residual add and SwiGLU (fused for one token, gate/up then SiLU for three). */
	qmat_new(&m, f, 4100, 2304, 0, 21);
	snprintf(what, sizeof(what), "%s 4100 x 2304, 1 token, add", dtype_name(f));
	check_product(be, &m, 1, CUDA_TEST_ADD, PATH_GEMV, what);
	snprintf(what, sizeof(what), "%s 4100 x 2304, 3 tokens, add", dtype_name(f));
	check_product(be, &m, 3, CUDA_TEST_ADD, PATH_GEMV, what);
	snprintf(what, sizeof(what), "%s 4100 x 2304, 1 token, swiglu", dtype_name(f));
	check_product(be, &m, 1, CUDA_TEST_SWIGLU, PATH_GEMV, what);
	snprintf(what, sizeof(what), "%s 4100 x 2304, 3 tokens, swiglu", dtype_name(f));
	check_product(be, &m, 3, CUDA_TEST_SWIGLU, PATH_GEMV, what);
	/* Prefill: 37 tokens on 4100 rows, 300 tokens on 1003 rows, in chunks of the scratch. */
	snprintf(what, sizeof(what), "%s 4100 x 2304, 37 tokens", dtype_name(f));
	check_product(be, &m, 37, CUDA_TEST_STORE, PATH_DEQUANT, what);
	snprintf(what, sizeof(what), "%s 4100 x 2304, 37 tokens, add", dtype_name(f));
	check_product(be, &m, 37, CUDA_TEST_ADD, PATH_DEQUANT, what);
	snprintf(what, sizeof(what), "%s 4100 x 2304, 9 tokens, swiglu (two passes)", dtype_name(f));
	check_product(be, &m, 9, CUDA_TEST_SWIGLU, PATH_GEMV, what);
	snprintf(what, sizeof(what), "%s 4100 x 2304, 20 tokens, swiglu", dtype_name(f));
	check_product(be, &m, 20, CUDA_TEST_SWIGLU, PATH_DEQUANT, what);
	snprintf(what, sizeof(what), "%s 4100 x 2304, 11 tokens, add (two passes)", dtype_name(f));
	check_product(be, &m, 11, CUDA_TEST_ADD, PATH_GEMV, what);
	qmat_free(&m);
	qmat_new(&m, f, 1003, narrow, 0, 22);
	snprintf(what, sizeof(what), "%s 1003 x %u, 300 tokens", dtype_name(f), narrow);
	check_product(be, &m, 300, CUDA_TEST_STORE, PATH_DEQUANT, what);
	qmat_free(&m);
	qmat_new(&m, f, 1003, 2304, 0, 23);
	snprintf(what, sizeof(what), "%s 1003 x 2304, 300 tokens", dtype_name(f));
	check_product(be, &m, 300, CUDA_TEST_STORE, PATH_DEQUANT, what);
	qmat_free(&m);
	/* A tensor 2 bytes past alignment: Q8_0, Q4_0, Q6_K keep the GEMV (their blocks are 2-byte
	 * aligned anyway), Q4_K and Q5_K (16-byte loads) dequantize. */
	qmat_new(&m, f, 1003, 2304, 2, 24);
	bool a16 = f == DT_Q4_K || f == DT_Q5_K;
	snprintf(what, sizeof(what), "%s 1003 x 2304 at +2 bytes, 1 token", dtype_name(f));
	check_product(be, &m, 1, CUDA_TEST_STORE, a16 ? PATH_DEQUANT : PATH_GEMV, what);
	qmat_free(&m);

	backend_destroy(&be);
	backend_destroy(&bc);
}

/* One-token products on a backend with the integer path (gemv: BACKEND_GEMV_DP4A, the weights
 * through shared memory where rows are 16-byte aligned, or BACKEND_GEMV_DP4A_REGS): Q4_K, Q6_K
 * and Q8_0 take it, the other formats and more tokens keep the float GEMV. */
static void check_format_dp4a_with(enum dtype f, uint32_t gemv)
{
	struct model_config c = small_cfg();
	struct backend *bd = open_backend("cuda", &c, 16, gemv);
	const bool dp = f == DT_Q4_K || f == DT_Q6_K || f == DT_Q8_0;
	const enum path one = dp ? PATH_DP4A : PATH_GEMV;
	uint32_t narrow = dtype_block_elems(f) == 32 ? 96 : 256;
	char what[160];
	struct qmat m;

	const uint32_t widths[] = {narrow, 2304, 20480};
	for (size_t i = 0; i < 3; i++) {
		qmat_new(&m, f, 1003, widths[i], 0, 31 + i);
		snprintf(what, sizeof(what), "%s 1003 x %u, 1 token, dp4a", dtype_name(f), widths[i]);
		check_product(bd, &m, 1, CUDA_TEST_STORE, one, what);
		snprintf(what, sizeof(what), "%s 1003 x %u, 3 tokens, dp4a backend", dtype_name(f), widths[i]);
		check_product(bd, &m, 3, CUDA_TEST_STORE, PATH_GEMV, what);
		qmat_free(&m);
	}
	/* 4100 rows: more row groups than a GPU has multiprocessors, so wide blocks (several row
	 * groups a block) where the shared-memory path takes the rows (16-byte aligned: Q4_K's and
	 * Q8_0's here, not Q6_K's 1890 bytes; not with BACKEND_GEMV_DP4A_REGS). */
	qmat_new(&m, f, 4100, 2304, 0, 41);
	snprintf(what, sizeof(what), "%s 4100 x 2304, 1 token, dp4a", dtype_name(f));
	check_product(bd, &m, 1, CUDA_TEST_STORE, one, what);
	snprintf(what, sizeof(what), "%s 4100 x 2304, 1 token, add, dp4a", dtype_name(f));
	check_product(bd, &m, 1, CUDA_TEST_ADD, one, what);
	snprintf(what, sizeof(what), "%s 4100 x 2304, 1 token, swiglu, dp4a", dtype_name(f));
	check_product(bd, &m, 1, CUDA_TEST_SWIGLU, one, what);
	snprintf(what, sizeof(what), "%s 4100 x 2304, 3 tokens, swiglu, dp4a backend", dtype_name(f));
	check_product(bd, &m, 3, CUDA_TEST_SWIGLU, PATH_GEMV, what);
	qmat_free(&m);
	/* 2 bytes past alignment: Q8_0 and Q6_K keep the integer path, Q4_K dequantizes. */
	qmat_new(&m, f, 1003, 2304, 2, 42);
	bool a16 = f == DT_Q4_K || f == DT_Q5_K;
	snprintf(what, sizeof(what), "%s 1003 x 2304 at +2 bytes, 1 token, dp4a", dtype_name(f));
	check_product(bd, &m, 1, CUDA_TEST_STORE, a16 ? PATH_DEQUANT : one, what);
	qmat_free(&m);
	backend_destroy(&bd);
}

START_TEST(test_products_dp4a)
{
	check_format_dp4a_with(FORMATS[_i], BACKEND_GEMV_DP4A);
	check_format_dp4a_with(FORMATS[_i], BACKEND_GEMV_DP4A_REGS);
}
END_TEST

START_TEST(test_products)
{
	check_format(FORMATS[_i]);
}
END_TEST

/* ---- (b) forward passes with mixed formats --------------------------------------------------- */

/* The formats of one layer's matrices, by role. */
struct layer_fmt {
	enum dtype norm, wq, wk, wv, wo, gate, up, down;
};

/* Layer 0 as a Q4_K_M file has it; layer 1 with every other format, a BF16 wk in the chain and
 * gate / up in different formats. */
static const struct layer_fmt LAYERS[2] = {
	{DT_F32, DT_Q4_K, DT_Q4_K, DT_Q6_K, DT_Q4_K, DT_Q4_K, DT_Q4_K, DT_Q6_K},
	{DT_BF16, DT_Q5_K, DT_BF16, DT_Q4_0, DT_Q8_0, DT_Q8_0, DT_Q5_K, DT_Q4_0},
};

struct qmodel {
	struct model_config cfg;
	struct group_weights embed_w, h_head, d_head;
	struct group_weights h_attn[2], h_ffn[2], d_attn[2], d_ffn[2];
	void *allocs[MAX_ALLOCS];
	uint32_t n_allocs;
	void *dallocs[MAX_ALLOCS];
	uint32_t n_dallocs;
};

static void *keep(struct qmodel *m, void *p)
{
	ck_assert_ptr_nonnull(p);
	ck_assert_uint_lt(m->n_allocs, MAX_ALLOCS);
	m->allocs[m->n_allocs++] = p;
	return p;
}

/* Role r of the model in format f: values (mean + amp * noise for vectors, blocks of amplitude
 * amp for block formats) on the host into h, a device copy into d (d NULL: host only). perm_hd
 * > 0 permutes the rows of each head of perm_hd rows as GGUF stores wq and wk (row 2i of a head
 * is row i of the original, row 2i + 1 is row i + perm_hd / 2): the values are drawn first, so
 * a permuted model holds the same rows as the unpermuted one of the same seed. */
static void add_tensor(struct qmodel *m, struct group_weights *h, struct group_weights *d, enum tensor_role r,
		       enum dtype f, double mean, double amp, uint32_t perm_hd)
{
	uint32_t ndim;
	uint64_t shape[2];
	ck_assert_int_eq(model_expected_shape(&m->cfg, r, &ndim, shape), 0);
	uint32_t rows = ndim == 1 ? 1 : (uint32_t)shape[0], cols = (uint32_t)(ndim == 1 ? shape[0] : shape[1]);
	size_t rb = dtype_row_bytes(f, cols), bytes = rows * rb;
	void *data = keep(m, dtype_is_element(f) ? element_matrix(f, (size_t)rows * cols, mean, amp)
						 : quant_matrix(f, rows, cols, amp));
	if (perm_hd) {
		char *tmp = malloc(bytes);
		ck_assert_ptr_nonnull(tmp);
		memcpy(tmp, data, bytes);
		uint32_t half = perm_hd / 2;
		for (uint32_t row = 0; row < rows; row++) {
			uint32_t head = row / perm_hd, i = row % perm_hd;
			uint32_t src = head * perm_hd + (i % 2 ? i / 2 + half : i / 2);
			memcpy((char *)data + (size_t)row * rb, tmp + (size_t)src * rb, rb);
		}
		free(tmp);
	}
	weight_tensor_set(&h->t[r], PLACE_HOST, data, f, rows, cols);
	if (d) {
		void *dv = NULL;
		CUDA_OK(cudaMalloc(&dv, bytes));
		CUDA_OK(cudaMemcpy(dv, data, bytes, cudaMemcpyHostToDevice));
		CUDA_OK(cudaDeviceSynchronize()); /* the DMA of a pageable copy may land after it returns */
		ck_assert_uint_lt(m->n_dallocs, MAX_ALLOCS);
		m->dallocs[m->n_dallocs++] = dv;
		weight_tensor_set(&d->t[r], PLACE_DEVICE, dv, f, rows, cols);
	}
}

/* A model of two layers (LAYERS), embed_f for the table (with tied embeddings also lm_head),
 * head_f for an untied lm_head. permute: wq and wk rows as GGUF stores them. */
static struct qmodel *qmodel_new(const struct model_config *c, enum dtype embed_f, enum dtype head_f, bool permute,
				 uint64_t seed)
{
	struct qmodel *m = calloc(1, sizeof(*m));
	ck_assert_ptr_nonnull(m);
	m->cfg = *c;
	ck_assert_uint_eq(c->n_layers, 2);
	rng_state = seed;
	uint32_t hd = permute ? c->head_dim : 0;
	add_tensor(m, &m->embed_w, NULL, ROLE_EMBED, embed_f, 0, 0.06, 0);
	for (uint32_t l = 0; l < 2; l++) {
		const struct layer_fmt *lf = &LAYERS[l];
		struct group_weights *ha = &m->h_attn[l], *da = &m->d_attn[l], *hf = &m->h_ffn[l], *df = &m->d_ffn[l];
		add_tensor(m, ha, da, ROLE_ATTN_NORM, lf->norm, 1.0, 0.1, 0);
		/* Larger q and k: attention that is not near uniform, so RoPE matters. */
		add_tensor(m, ha, da, ROLE_WQ, lf->wq, 0, 0.1, hd);
		add_tensor(m, ha, da, ROLE_WK, lf->wk, 0, 0.1, hd);
		add_tensor(m, ha, da, ROLE_WV, lf->wv, 0, 0.06, 0);
		add_tensor(m, ha, da, ROLE_WO, lf->wo, 0, 0.06, 0);
		add_tensor(m, hf, df, ROLE_FFN_NORM, lf->norm, 1.0, 0.1, 0);
		add_tensor(m, hf, df, ROLE_W_GATE, lf->gate, 0, 0.06, 0);
		add_tensor(m, hf, df, ROLE_W_UP, lf->up, 0, 0.06, 0);
		add_tensor(m, hf, df, ROLE_W_DOWN, lf->down, 0, 0.06, 0);
	}
	add_tensor(m, &m->h_head, &m->d_head, ROLE_FINAL_NORM, DT_F32, 1.0, 0.1, 0);
	if (c->tie_embeddings) {
		/* lm_head is the embedding table: host for the reference, a device copy for CUDA. */
		const struct weight_tensor *e = &m->embed_w.t[ROLE_EMBED];
		m->h_head.t[ROLE_LM_HEAD] = *e;
		size_t bytes = (size_t)e->rows * e->row_bytes;
		void *dv = NULL;
		CUDA_OK(cudaMalloc(&dv, bytes));
		CUDA_OK(cudaMemcpy(dv, e->data[PLACE_HOST], bytes, cudaMemcpyHostToDevice));
		CUDA_OK(cudaDeviceSynchronize()); /* the DMA of a pageable copy may land after it returns */
		m->dallocs[m->n_dallocs++] = dv;
		weight_tensor_set(&m->d_head.t[ROLE_LM_HEAD], PLACE_DEVICE, dv, (enum dtype)e->format, e->rows, e->cols);
	} else {
		add_tensor(m, &m->h_head, &m->d_head, ROLE_LM_HEAD, head_f, 0, 0.06, 0);
	}
	return m;
}

static void qmodel_free(struct qmodel **mp)
{
	struct qmodel *m = *mp;
	for (uint32_t i = 0; i < m->n_allocs; i++)
		free(m->allocs[i]);
	for (uint32_t i = 0; i < m->n_dallocs; i++)
		CUDA_OK(cudaFree(m->dallocs[i]));
	free(m);
	*mp = NULL;
}

#define CHECK_RC(be, expr)                                                                         \
	do {                                                                                       \
		int rc_ = (expr);                                                                  \
		ck_assert_msg(rc_ == 0, "%s: %s: %d %s", backend_name(be), #expr, rc_, backend_error(be)); \
	} while (0)

/* One forward step of tok[0..n) at positions pos.. as the engine runs it (KV block of layer l,
 * position p: l * blocks_per_layer + p / 16); logits of the last token (none: logits NULL, the step
 * ends without the host waiting for it). */
static void step(struct backend *be, const struct qmodel *m, bool device, const int32_t *tok, uint32_t n, uint32_t pos,
		 float *logits)
{
	uint32_t bpl = MAX_CTX / 16 + 1, posv[MAX_CTX], seq[MAX_CTX], dst_block[MAX_CTX], dst_row[MAX_CTX];
	struct kv_span spans[MAX_CTX / 16 + 1];
	ck_assert_uint_le(pos + n, MAX_CTX);
	for (uint32_t i = 0; i < n; i++) {
		posv[i] = pos + i;
		seq[i] = 0;
	}
	struct backend_batch b = {.n = n, .tokens = tok, .pos = posv, .seq = seq};
	CHECK_RC(be, backend_embed(be, &m->embed_w, &b));
	for (uint32_t l = 0; l < 2; l++) {
		for (uint32_t i = 0; i < n; i++) {
			dst_block[i] = l * bpl + (pos + i) / 16;
			dst_row[i] = (pos + i) % 16;
		}
		const struct group_weights *aw = device ? &m->d_attn[l] : &m->h_attn[l];
		const struct group_weights *fw = device ? &m->d_ffn[l] : &m->h_ffn[l];
		CHECK_RC(be, backend_attn_begin(be, aw, l, dst_block, dst_row));
		uint32_t end = pos + n, ns = 0;
		for (uint32_t k = 0; k * 16 < end; k++)
			spans[ns++] = (struct kv_span){.block = l * bpl + k, .pos0 = k * 16,
						       .n_tokens = end - k * 16 < 16 ? end - k * 16 : 16};
		CHECK_RC(be, backend_attn_blocks(be, spans, ns));
		CHECK_RC(be, backend_attn_end(be, aw));
		CHECK_RC(be, backend_ffn(be, fw));
	}
	if (logits)
		CHECK_RC(be, backend_logits(be, device ? &m->d_head : &m->h_head, logits));
}

#define PROMPT 37  /* chunks of 24 (dequantize + cuBLAS) and 13 (two GEMV passes: 8 and 5 tokens) */
#define CHUNK 24
#define DECODE 4   /* one token at a time (the GEMV, SwiGLU fused where gate and up agree) */
#define STEPS (PROMPT + DECODE)
#define RUNS (2 + DECODE) /* forward steps of the schedule */

/* cuda_test_early_kv_launches and cuda_test_two_warp_launches of the last cuda backend
 * run_schedule ran. */
static int64_t last_early_kv, last_two_warp, last_wide, last_mix, last_whole, last_apart;

/* The logits of every step of the schedule on backend `name` (cuda: device weights). */
static float *run_schedule(const char *name, const struct qmodel *m, uint32_t gemv)
{
	uint32_t vocab = m->cfg.vocab_size;
	struct backend *be = open_backend(name, &m->cfg, CHUNK, gemv);
	int32_t tok[STEPS];
	rng_state = 77;
	for (uint32_t i = 0; i < STEPS; i++)
		tok[i] = (int32_t)(rng_next() % vocab);
	float *out = malloc((size_t)STEPS * vocab * sizeof(float));
	ck_assert_ptr_nonnull(out);
	uint32_t k = 0;
	for (uint32_t i = 0; i < STEPS; k++) {
		uint32_t n = i < PROMPT ? (PROMPT - i < CHUNK ? PROMPT - i : CHUNK) : 1;
		step(be, m, strcmp(name, "cpu") != 0, tok + i, n, i, out + (size_t)k * vocab);
		i += n;
	}
	ck_assert_uint_eq(k, RUNS);
	if (strcmp(name, "cpu") != 0) {
		char err[200] = "";
		last_early_kv = cuda_test_early_kv_launches(be, err, sizeof(err));
		ck_assert_msg(last_early_kv >= 0, "%s", err);
		last_two_warp = cuda_test_two_warp_launches(be, err, sizeof(err));
		ck_assert_msg(last_two_warp >= 0, "%s", err);
		last_wide = cuda_test_wide_launches(be, err, sizeof(err));
		ck_assert_msg(last_wide >= 0, "%s", err);
		last_mix = cuda_test_mix_launches(be, err, sizeof(err));
		ck_assert_msg(last_mix >= 0, "%s", err);
		last_whole = cuda_test_whole_launches(be, err, sizeof(err));
		ck_assert_msg(last_whole >= 0, "%s", err);
		last_apart = cuda_test_apart_launches(be, err, sizeof(err));
		ck_assert_msg(last_apart >= 0, "%s", err);
	}
	backend_destroy(&be);
	return out;
}

/* Largest relative L2 error over the steps of two runs. */
static double worst_step(const float *a, const float *ref, uint32_t vocab)
{
	double worst = 0;
	for (uint32_t k = 0; k < RUNS; k++) {
		double e = rel_l2_values(a + (size_t)k * vocab, ref + (size_t)k * vocab, vocab);
		worst = e > worst ? e : worst;
	}
	return worst;
}

static void check_forward(uint32_t head_dim, uint32_t layout, bool tied, const char *what)
{
	struct model_config c = small_cfg();
	c.head_dim = head_dim;
	c.rope_layout = layout;
	c.tie_embeddings = tied;
	struct qmodel *m = qmodel_new(&c, tied ? DT_Q8_0 : DT_Q4_K, DT_Q6_K, false, 4242 + head_dim);
	float *want = run_schedule("cpu", m, BACKEND_GEMV_DEFAULT), *got = run_schedule("cuda", m, BACKEND_GEMV_ROWS1);
	double e = worst_step(got, want, c.vocab_size);
	char line[200];
	snprintf(line, sizeof(line), "forward, %s", what);
	report(line, e);
	ck_assert_msg(e <= TOL_FORWARD, "forward pass, %s: relative L2 error %.3e of the logits against the C "
		      "reference (bound %g)", what, e, TOL_FORWARD);
	/* The same with one-token products on the integer path (x as int8). */
	float *got_dp = run_schedule("cuda", m, BACKEND_GEMV_DP4A);
	const int64_t early = last_early_kv, two_warp = last_two_warp;
	e = worst_step(got_dp, want, c.vocab_size);
	snprintf(line, sizeof(line), "forward, %s, dp4a", what);
	report(line, e);
	ck_assert_msg(e <= TOL_FORWARD, "forward pass, %s, dp4a: relative L2 error %.3e of the logits against the C "
		      "reference (bound %g)", what, e, TOL_FORWARD);
	/* Every kernel alone (no programmatic dependent launch; RMSNorm and the attention output by
	 * kernels of their own): the same values up to the order of the norm's double sum. */
	open_fuse = BACKEND_FUSE_NONE;
	float *got_plain = run_schedule("cuda", m, BACKEND_GEMV_DP4A);
	open_fuse = BACKEND_FUSE_DEFAULT;
	e = worst_step(got_dp, got_plain, c.vocab_size);
	snprintf(line, sizeof(line), "forward, %s, dp4a fused vs unfused", what);
	report(line, e);
	ck_assert_msg(e <= TOL_FUSED, "forward pass, %s, dp4a: fused kernels differ from unfused ones by %.3e (bound "
		      "%g)", what, e, TOL_FUSED);
	/* Decode attention loading the keys of earlier steps after the wait, not before it: the same
	 * keys in the same order, so the same bits. */
	open_fuse = BACKEND_FUSE_LATE_KV;
	float *got_late = run_schedule("cuda", m, BACKEND_GEMV_DP4A);
	open_fuse = BACKEND_FUSE_DEFAULT;
	/* Every step after the first (each ends with its logits) loads early: 2 layers of 5 steps. */
	ck_assert_msg(early == 2 * (RUNS - 1) && last_early_kv == 0, "forward pass, %s: %lld attention launches "
		      "loaded keys before the wait by default (want %d), %lld with BACKEND_FUSE_LATE_KV (want 0)",
		      what, (long long)early, 2 * (RUNS - 1), (long long)last_early_kv);
	ck_assert_msg(memcmp(got_late, got_dp, (size_t)RUNS * c.vocab_size * sizeof(float)) == 0,
		      "forward pass, %s, dp4a: keys loaded before the wait give other logits than after it "
		      "(relative L2 %.3e)", what, worst_step(got_late, got_dp, c.vocab_size));
	/* One warp a query in the decode attention (a tile's keys all scored by one warp, not half
	 * each by two whose states merge): another float32 order, the same bounds against the C
	 * reference. */
	open_fuse = BACKEND_FUSE_ONE_KEY_WARP;
	float *got_one = run_schedule("cuda", m, BACKEND_GEMV_DP4A);
	open_fuse = BACKEND_FUSE_DEFAULT;
	/* Two warps a query in every decode layer by default (the prompt's chunks have 16 queries a
	 * block: one warp each), none with BACKEND_FUSE_ONE_KEY_WARP. */
	ck_assert_msg(two_warp == 2 * DECODE && last_two_warp == 0, "forward pass, %s: %lld attention launches "
		      "with two warps a query by default (want %d), %lld with BACKEND_FUSE_ONE_KEY_WARP (want 0)",
		      what, (long long)two_warp, 2 * DECODE, (long long)last_two_warp);
	e = worst_step(got_one, want, c.vocab_size);
	snprintf(line, sizeof(line), "forward, %s, dp4a, one attention warp a query", what);
	report(line, e);
	ck_assert_msg(e <= TOL_FORWARD, "forward pass, %s, dp4a, one attention warp a query: relative L2 error %.3e "
		      "of the logits against the C reference (bound %g)", what, e, TOL_FORWARD);
	e = worst_step(got_one, got_dp, c.vocab_size);
	snprintf(line, sizeof(line), "forward, %s, dp4a, one against two attention warps a query", what);
	report(line, e);
	ck_assert_msg(e <= TOL_PERMUTED, "forward pass, %s, dp4a: one attention warp a query differs from two by "
		      "%.3e (bound %g)", what, e, TOL_PERMUTED);
	free(got_one);
	free(got_late);
	free(got_plain);
	free(got_dp);
	free(want);
	free(got);
	qmodel_free(&m);
}

START_TEST(test_forward_halves)
{
	check_forward(64, ROPE_HALVES, false, "head_dim 64, rope halves");
	check_forward(128, ROPE_HALVES, false, "head_dim 128, rope halves");
	check_forward(64, ROPE_HALVES, true, "head_dim 64, rope halves, tied Q8_0 embeddings");
}
END_TEST

START_TEST(test_forward_adjacent)
{
	check_forward(64, ROPE_ADJACENT, false, "head_dim 64, rope adjacent");
	check_forward(128, ROPE_ADJACENT, false, "head_dim 128, rope adjacent");
	check_forward(128, ROPE_ADJACENT, true, "head_dim 128, rope adjacent, tied Q8_0 embeddings");
}
END_TEST

/* A model wide enough that its products have more row groups than a GPU has multiprocessors. */
static struct model_config wide_cfg(void)
{
	struct model_config c = small_cfg();
	c.dim = 2048;
	c.n_heads = 16;
	c.n_kv_heads = 4;
	c.head_dim = 128;
	c.ffn_dim = 5632;
	return c;
}

/* The logits of model c (seed: its weights) by default and with fuse: the default makes at least want
 * launches of the kind *launches counts (kind), fuse none, and the logits are the same bit for bit. */
static void check_same_bits(const struct model_config *c, uint64_t seed, uint32_t fuse, const char *fuse_name,
			    const int64_t *launches, int64_t want, const char *kind)
{
	struct qmodel *m = qmodel_new(c, DT_Q4_K, DT_Q6_K, false, seed);
	float *by_default = run_schedule("cuda", m, BACKEND_GEMV_DP4A);
	const int64_t n = *launches;
	open_fuse = fuse;
	float *other = run_schedule("cuda", m, BACKEND_GEMV_DP4A);
	open_fuse = BACKEND_FUSE_DEFAULT;
	ck_assert_msg(n >= want && *launches == 0, "%lld %s by default (want at least %lld), %lld with %s (want 0)",
		      (long long)n, kind, (long long)want, (long long)*launches, fuse_name);
	ck_assert_msg(memcmp(by_default, other, (size_t)RUNS * c->vocab_size * sizeof(float)) == 0,
		      "%s gives other logits than the default, %s (relative L2 %.3e)", fuse_name, kind,
		      worst_step(other, by_default, c->vocab_size));
	free(by_default);
	free(other);
	qmodel_free(&m);
}

/* One-token integer products in wide blocks (several row groups a block, x staged once for all of
 * them; where the grid fills every multiprocessor) and in blocks of one row group each
 * (BACKEND_FUSE_NARROW_DQ): every row summed by one warp in the same order from the same int8 x,
 * so the same logits bit for bit. The model is wide enough that its products have more row
 * groups than a GPU has multiprocessors: layer 0's gate/up (5632 rows), x the RMSNorm's, and
 * o_proj (2048), x the attention output; layer 1's wo (2048), x the attention output, and gate
 * (5632, apart from up), x the RMSNorm kernel's output as it stands. (q/k/v run in blocks of one row
 * group either way; layer 0's down's rows are not 16-byte aligned, layer 1's other formats have no
 * integer path.) Up to five wide launches a one-token step (the products named above); at least
 * two asked. */
START_TEST(test_wide_blocks)
{
	const struct model_config c = wide_cfg();
	check_same_bits(&c, 77, BACKEND_FUSE_NARROW_DQ, "BACKEND_FUSE_NARROW_DQ", &last_wide, 2 * DECODE,
			"integer products in wide blocks");
}
END_TEST

/* Wide blocks whose row-group blocks are the grid's width apart (BACKEND_FUSE_ROWS_APART, a trial):
 * the same rows, each summed by one warp in the same order, on other warps, so the same logits bit
 * for bit; every wide launch apart with it, none by default. (Same logits are also what a kernel
 * that ignored the flag gives: this checks that no row is lost or doubled; bench-kernels --ab-fuse
 * 8 --trace shows the mapping in the blocks' row groups and times.) */
START_TEST(test_rows_apart)
{
	const struct model_config c = wide_cfg();
	struct qmodel *m = qmodel_new(&c, DT_Q4_K, DT_Q6_K, false, 29);
	float *by_default = run_schedule("cuda", m, BACKEND_GEMV_DP4A);
	const int64_t wide = last_wide;
	ck_assert_msg(last_apart == 0, "%lld launches apart by default", (long long)last_apart);
	open_fuse = BACKEND_FUSE_ROWS_APART;
	float *apart = run_schedule("cuda", m, BACKEND_GEMV_DP4A);
	open_fuse = BACKEND_FUSE_DEFAULT;
	ck_assert_msg(wide >= 2 * DECODE && last_apart == last_wide && last_wide == wide,
		      "%lld wide launches by default, %lld with BACKEND_FUSE_ROWS_APART, %lld of them apart (want all, "
		      "at least %d)", (long long)wide, (long long)last_wide, (long long)last_apart, 2 * DECODE);
	ck_assert_msg(memcmp(by_default, apart, (size_t)RUNS * c.vocab_size * sizeof(float)) == 0,
		      "row groups apart give other logits than side by side (relative L2 %.3e)",
		      worst_step(apart, by_default, c.vocab_size));
	free(by_default);
	free(apart);
	qmodel_free(&m);
}
END_TEST

/* One-token integer products whose rows are whole steps (2048 and 6144 values) walked as such
 * (dq_sm_rows_whole, the default) and with the general walk (BACKEND_FUSE_ANY_ITEMS): the same
 * items in the same order with the same arithmetic, so the same logits bit for bit. Layer 0's q/k/v
 * (Q4_K and Q6_K in one launch), o_proj, gate/up (SwiGLU) and down (Q6_K, added) of every
 * one-token step take the whole walk by default (layer 1's Q8_0 gate/up too), none otherwise. */
START_TEST(test_whole_steps)
{
	struct model_config c = wide_cfg();
	c.ffn_dim = 6144;
	check_same_bits(&c, 53, BACKEND_FUSE_ANY_ITEMS, "BACKEND_FUSE_ANY_ITEMS", &last_whole, 4 * DECODE,
			"launches walking whole steps");
}
END_TEST

/* Layer 0's q/k (Q4_K) and v (Q6_K) as one launch (the default: blocks of one row group, as q/k/v
 * take), as one launch in wide blocks (BACKEND_FUSE_WIDE_QKV) and as a launch a format
 * (BACKEND_FUSE_APART_DQ): each row summed by one warp in the same order from the same int8 x (the
 * Q6_K rows read it in Q4_K's layout), so the same logits bit for bit; one launch of two formats a
 * decode step (layer 1's q/k/v are in three formats), none apart, and the wide one wide. The wide
 * model's, whose Q6_K rows are 16-byte aligned (the small one's 210-byte rows take a launch each). */
START_TEST(test_two_formats)
{
	const struct model_config c = wide_cfg();
	struct qmodel *m = qmodel_new(&c, DT_Q4_K, DT_Q6_K, false, 91);
	const uint32_t fuse[3] = {BACKEND_FUSE_DEFAULT, BACKEND_FUSE_WIDE_QKV, BACKEND_FUSE_APART_DQ};
	const int64_t want[3] = {DECODE, DECODE, 0};
	const char *name[3] = {"one launch", "one launch in wide blocks", "a launch a format"};
	float *got[3];
	int64_t wide[3];
	for (int i = 0; i < 3; i++) {
		open_fuse = fuse[i];
		got[i] = run_schedule("cuda", m, BACKEND_GEMV_DP4A);
		open_fuse = BACKEND_FUSE_DEFAULT;
		wide[i] = last_wide;
		ck_assert_msg(last_mix == want[i], "%s: %lld launches of two formats (want %lld)", name[i],
			      (long long)last_mix, (long long)want[i]);
	}
	ck_assert_msg(wide[1] - wide[0] == DECODE, "q/k/v in wide blocks: %lld wide launches, %lld by default (want "
		      "%d more)", (long long)wide[1], (long long)wide[0], DECODE);
	for (int i = 1; i < 3; i++)
		ck_assert_msg(memcmp(got[0], got[i], (size_t)RUNS * c.vocab_size * sizeof(float)) == 0,
			      "q/k and v: %s gives other logits than %s (relative L2 %.3e)", name[i], name[0],
			      worst_step(got[i], got[0], c.vocab_size));
	for (int i = 0; i < 3; i++)
		free(got[i]);
	qmodel_free(&m);
}
END_TEST

/* The keys of earlier steps load before the attention's wait only where the host has waited for
 * the stream since the step that wrote them: the steps after one that ended without its logits load
 * none early, the step after one that ended with them loads early in both layers. */
START_TEST(test_early_keys_after_a_wait)
{
	struct model_config c = small_cfg();
	struct qmodel *m = qmodel_new(&c, DT_Q4_K, DT_Q6_K, false, 11);
	struct backend *be = open_backend("cuda", &c, CHUNK, BACKEND_GEMV_DEFAULT);
	char err[200] = "";
	int32_t tok[PROMPT + 2];
	rng_state = 9;
	for (uint32_t i = 0; i < PROMPT + 2; i++)
		tok[i] = (int32_t)(rng_next() % c.vocab_size);
	float *logits = malloc((size_t)c.vocab_size * sizeof(float));
	ck_assert_ptr_nonnull(logits);
	step(be, m, true, tok, CHUNK, 0, NULL);
	step(be, m, true, tok + CHUNK, PROMPT - CHUNK, CHUNK, NULL);
	ck_assert_int_eq(cuda_test_early_kv_launches(be, err, sizeof(err)), 0);
	step(be, m, true, tok + PROMPT, 1, PROMPT, logits); /* after a step the host did not wait for */
	ck_assert_int_eq(cuda_test_early_kv_launches(be, err, sizeof(err)), 0);
	step(be, m, true, tok + PROMPT + 1, 1, PROMPT + 1, logits); /* after one it waited for */
	ck_assert_int_eq(cuda_test_early_kv_launches(be, err, sizeof(err)), 2);
	free(logits);
	backend_destroy(&be);
	qmodel_free(&m);
}
END_TEST

/* bench-kernels --without's hook: a one-token step with the attention left out runs (RoPE left out
 * with it) and gives other logits; with nothing left out again, the step's logits are those of the
 * same step before, bit for bit; a part that does not exist is refused. */
START_TEST(test_leave_out)
{
	struct model_config c = small_cfg();
	struct qmodel *m = qmodel_new(&c, DT_Q4_K, DT_Q6_K, false, 7);
	struct backend *be = open_backend("cuda", &c, CHUNK, BACKEND_GEMV_DEFAULT);
	const uint32_t vocab = c.vocab_size;
	char err[200] = "";
	ck_assert_int_eq(cuda_test_leave_out(be, 2 * CUDA_TEST_DOWN, err, sizeof(err)), -EINVAL);
	int32_t tok[PROMPT + 1];
	rng_state = 5;
	for (uint32_t i = 0; i <= PROMPT; i++)
		tok[i] = (int32_t)(rng_next() % vocab);
	float *got = malloc(3 * (size_t)vocab * sizeof(float));
	ck_assert_ptr_nonnull(got);
	for (uint32_t i = 0; i < PROMPT; i += CHUNK)
		step(be, m, true, tok + i, PROMPT - i < CHUNK ? PROMPT - i : CHUNK, i, got);
	step(be, m, true, tok + PROMPT, 1, PROMPT, got);
	ck_assert_int_eq(cuda_test_leave_out(be, CUDA_TEST_ATTN, err, sizeof(err)), 0);
	step(be, m, true, tok + PROMPT, 1, PROMPT, got + vocab);
	ck_assert_int_eq(cuda_test_leave_out(be, 0, err, sizeof(err)), 0);
	step(be, m, true, tok + PROMPT, 1, PROMPT, got + 2 * (size_t)vocab);
	ck_assert_msg(rel_l2_values(got + vocab, got, vocab) > 1e-3,
		      "the attention left out gives the logits of the whole step (relative L2 %.3e)",
		      rel_l2_values(got + vocab, got, vocab));
	ck_assert_msg(memcmp(got + 2 * (size_t)vocab, got, (size_t)vocab * sizeof(float)) == 0,
		      "nothing left out again: the logits differ from the same step's before (relative L2 %.3e)",
		      rel_l2_values(got + 2 * (size_t)vocab, got, vocab));
	free(got);
	backend_destroy(&be);
	qmodel_free(&m);
}
END_TEST

/* GGUF's wq/wk rows with ROPE_ADJACENT compute what the original rows compute with ROPE_HALVES
 * (model.h): on each backend, the two give the same logits, and the layouts differ when the rows
 * are not permuted (so the check can tell a layout that is ignored). */
START_TEST(test_adjacent_is_permuted_halves)
{
	static const char *const names[2] = {"cpu", "cuda"};
	for (int b = 0; b < 2; b++) {
		for (uint32_t hd = 64; hd <= 128; hd += 64) {
			struct model_config c = small_cfg();
			c.head_dim = hd;
			struct qmodel *orig = qmodel_new(&c, DT_Q4_K, DT_Q6_K, false, 99 + hd);
			struct qmodel *perm = qmodel_new(&c, DT_Q4_K, DT_Q6_K, true, 99 + hd);
			perm->cfg.rope_layout = ROPE_ADJACENT;
			float *halves = run_schedule(names[b], orig, BACKEND_GEMV_ROWS1);
			float *adjacent = run_schedule(names[b], perm, BACKEND_GEMV_ROWS1);
			double e = worst_step(adjacent, halves, c.vocab_size);
			orig->cfg.rope_layout = ROPE_ADJACENT;
			float *wrong = run_schedule(names[b], orig, BACKEND_GEMV_ROWS1);
			double d = worst_step(wrong, halves, c.vocab_size);
			char line[200];
			snprintf(line, sizeof(line), "%s, head_dim %u: adjacent on permuted rows vs halves", names[b], hd);
			report(line, e);
			snprintf(line, sizeof(line), "%s, head_dim %u: adjacent vs halves on the same rows", names[b], hd);
			report(line, d);
			ck_assert_msg(e <= TOL_PERMUTED, "%s backend, head_dim %u: ROPE_ADJACENT on GGUF-permuted wq/wk "
				      "differs from ROPE_HALVES on the original rows by %.3e (bound %g)", names[b], hd,
				      e, TOL_PERMUTED);
			ck_assert_msg(d > 5 * TOL_PERMUTED, "%s backend, head_dim %u: the two layouts give logits only "
				      "%.3e apart on the same rows: this test cannot tell them apart", names[b], hd, d);
			free(halves);
			free(adjacent);
			free(wrong);
			qmodel_free(&orig);
			qmodel_free(&perm);
		}
	}
}
END_TEST

/* ---- (c) embedding rows ---------------------------------------------------------------------- */

START_TEST(test_embedding_exact)
{
	struct model_config c = small_cfg();
	static const int32_t tok[7] = {0, 5, 511, 17, 5, 256, 3};
	for (size_t fi = 0; fi < N_FORMATS; fi++) {
		enum dtype f = FORMATS[fi];
		rng_state = 300 + fi;
		void *table = quant_matrix(f, c.vocab_size, c.dim, 1.0);
		struct group_weights w;
		memset(&w, 0, sizeof(w));
		weight_tensor_set(&w.t[ROLE_EMBED], PLACE_HOST, table, f, c.vocab_size, c.dim);
		struct backend *be = open_backend("cuda", &c, 16, BACKEND_GEMV_ROWS1);
		uint32_t pos[7], seq[7];
		for (uint32_t i = 0; i < 7; i++) {
			pos[i] = i;
			seq[i] = 0;
		}
		struct backend_batch b = {.n = 7, .tokens = tok, .pos = pos, .seq = seq};
		CHECK_RC(be, backend_embed(be, &w, &b));
		float got[7 * 256], want[7 * 256];
		char err[400] = "";
		int rc = cuda_test_residual(be, got, 7, err, sizeof(err));
		ck_assert_msg(rc == 0, "%s", err);
		size_t rb = dtype_row_bytes(f, c.dim);
		for (uint32_t i = 0; i < 7; i++)
			quant_dequantize(f, (const char *)table + (size_t)tok[i] * rb, want + i * c.dim, c.dim);
		for (uint32_t i = 0; i < 7 * c.dim; i++)
			ck_assert_msg(memcmp(&got[i], &want[i], 4) == 0,
				      "%s embedding: token %d value %u is %.9g on the device, %.9g dequantized on the host",
				      dtype_name(f), tok[i / c.dim], i % c.dim, (double)got[i], (double)want[i]);
		backend_destroy(&be);
		free(table);
	}
}
END_TEST

/* ---- the front's refusals -------------------------------------------------------------------- */

START_TEST(test_refusals)
{
	struct model_config c = small_cfg();
	struct qmodel *m = qmodel_new(&c, DT_Q4_K, DT_Q6_K, false, 5);
	struct backend *be = open_backend("cuda", &c, 16, BACKEND_GEMV_ROWS1);
	int32_t tok[1] = {3};
	uint32_t pos[1] = {0}, seq[1] = {0}, blk = 0, row = 0;
	struct backend_batch b = {.n = 1, .tokens = tok, .pos = pos, .seq = seq};
	CHECK_RC(be, backend_embed(be, &m->embed_w, &b));

	/* A norm vector in a block format. */
	struct group_weights w = m->d_attn[0];
	w.t[ROLE_ATTN_NORM].format = DT_Q8_0;
	w.t[ROLE_ATTN_NORM].row_bytes = dtype_row_bytes(DT_Q8_0, c.dim);
	ck_assert_int_eq(backend_attn_begin(be, &w, 0, &blk, &row), -EINVAL);
	ck_assert_msg(strstr(backend_error(be), "norm weights must be F32, F16 or BF16"), "message: %s",
		      backend_error(be));
	/* A chain whose activation dtypes differ: F16 beside block formats (BF16 activations). */
	w = m->d_attn[0];
	w.t[ROLE_WK].format = DT_F16;
	w.t[ROLE_WK].row_bytes = dtype_row_bytes(DT_F16, c.dim);
	ck_assert_int_eq(backend_attn_begin(be, &w, 0, &blk, &row), -ENOTSUP);
	ck_assert_msg(strstr(backend_error(be), "mixed matrix dtypes"), "message: %s", backend_error(be));
	/* BF16 beside block formats is one activation dtype: layer 1 of LAYERS runs (test_forward). */
	backend_destroy(&be);
	qmodel_free(&m);

	/* Rows that are not whole blocks: a model 96 wide with a Q4_K matrix. */
	c.dim = 96;
	c.n_heads = 2;
	c.n_kv_heads = 1;
	c.head_dim = 48;
	be = open_backend("cuda", &c, 16, BACKEND_GEMV_ROWS1);
	struct qmodel *mm = calloc(1, sizeof(*mm));
	ck_assert_ptr_nonnull(mm);
	mm->cfg = c;
	add_tensor(mm, &mm->embed_w, NULL, ROLE_EMBED, DT_Q8_0, 0, 0.06, 0);
	add_tensor(mm, &mm->h_attn[0], &mm->d_attn[0], ROLE_ATTN_NORM, DT_F32, 1.0, 0.1, 0);
	add_tensor(mm, &mm->h_attn[0], &mm->d_attn[0], ROLE_WQ, DT_Q8_0, 0, 0.06, 0);
	add_tensor(mm, &mm->h_attn[0], &mm->d_attn[0], ROLE_WK, DT_Q8_0, 0, 0.06, 0);
	add_tensor(mm, &mm->h_attn[0], &mm->d_attn[0], ROLE_WV, DT_Q8_0, 0, 0.06, 0);
	add_tensor(mm, &mm->h_attn[0], &mm->d_attn[0], ROLE_WO, DT_Q8_0, 0, 0.06, 0);
	CHECK_RC(be, backend_embed(be, &mm->embed_w, &b));
	w = mm->d_attn[0];
	w.t[ROLE_WQ].format = DT_Q4_K;
	w.t[ROLE_WQ].row_bytes = dtype_row_bytes(DT_Q4_K, c.dim);
	ck_assert_int_eq(backend_attn_begin(be, &w, 0, &blk, &row), -EINVAL);
	ck_assert_msg(strstr(backend_error(be), "not whole Q4_K blocks"), "message: %s", backend_error(be));
	/* Q8_0 takes 96 (three blocks): the layer runs. */
	CHECK_RC(be, backend_attn_begin(be, &mm->d_attn[0], 0, &blk, &row));
	backend_destroy(&be);
	qmodel_free(&mm);
}
END_TEST

static Suite *quant_suite(void)
{
	Suite *s = suite_create("cuda_quant");
	TCase *tc = tcase_create("products");
	tcase_set_timeout(tc, 300);
	tcase_add_loop_test(tc, test_products, 0, (int)N_FORMATS);
	tcase_add_loop_test(tc, test_products_dp4a, 0, (int)N_FORMATS);
	suite_add_tcase(s, tc);

	tc = tcase_create("forward");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_forward_halves);
	tcase_add_test(tc, test_forward_adjacent);
	tcase_add_test(tc, test_adjacent_is_permuted_halves);
	tcase_add_test(tc, test_leave_out);
	tcase_add_test(tc, test_early_keys_after_a_wait);
	tcase_add_test(tc, test_wide_blocks);
	tcase_add_test(tc, test_two_formats);
	tcase_add_test(tc, test_whole_steps);
	tcase_add_test(tc, test_rows_apart);
	suite_add_tcase(s, tc);

	tc = tcase_create("embedding");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_embedding_exact);
	suite_add_tcase(s, tc);

	tc = tcase_create("errors");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_refusals);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return gpu_suite_main("test_cuda_quant", quant_suite);
}

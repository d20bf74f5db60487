/* matmul.cu - matrix products of the CUDA backend. Weights are row-major (out, in): y = W x. In
 * cuBLAS's column-major terms Y^T (out x n) = op(A) B with A = W seen as (in x out), op =
 * transpose, B = X^T (in x n). One token (decode) goes through the GEMV kernel (gemv.cu)
 * instead where it applies (BF16/F16 weights, backend_params.gemv not BACKEND_GEMV_CUBLAS).
 * The products accumulate in float32 (CUBLAS_COMPUTE_32F; _PEDANTIC for F32 weights, so no
 * TF32) and write float32.
 *
 * Block-quantized weights (GGUF) take BF16 activations. Up to QGEMV_MAX_TOKENS tokens read the
 * blocks in place (gemv_quant.cu); more tokens (prefill) dequantize a chunk of rows into the BF16
 * scratch (dequant.cu) and multiply it with cuBLAS on the tensor cores, chunk after chunk, so the
 * scratch stays the size of a layer's largest matrix while lm_head passes through it too. */
#include "services/gpu-runner/cuda/cuda_internal.h"

#include <assert.h>
#include <string.h>

static cudaDataType_t cuda_type(uint32_t dt)
{
	return dt == DT_BF16 ? CUDA_R_16BF : dt == DT_F16 ? CUDA_R_16F : CUDA_R_32F;
}

bool gemv_fits(const struct backend_dev *be, uint32_t wt, uint32_t in, const struct mm_part *parts, uint32_t np)
{
	if (!be->gemv_rows || wt == DT_F32 || in % 8)
		return false;
	for (uint32_t i = 0; i < np; i++)
		if ((uintptr_t)parts[i].w % 16)
			return false;
	return true;
}

int gemm(struct backend_dev *be, uint32_t wt, const struct mm_part *pt, const void *x, uint32_t in, uint32_t n,
		uint32_t ldc, bool add, const char *what)
{
	const float alpha = 1.0f, beta = add ? 1.0f : 0.0f;
	cublasComputeType_t ct = wt == DT_F32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
	cublasStatus_t st = cublasGemmEx(be->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)pt->rows, (int)n, (int)in, &alpha,
					 pt->w, cuda_type(wt), (int)in, x, cuda_type(wt), (int)in, &beta, pt->out,
					 CUDA_R_32F, (int)ldc, ct, CUBLAS_GEMM_DEFAULT);
	if (st != CUBLAS_STATUS_SUCCESS)
		return cuda_failf(be, -EIO, "cuda backend: cublasGemmEx (%s: %u x %u, %u tokens) failed: %s", what, pt->rows,
			    in, n, cublasGetStatusString(st));
	return 0;
}

/* Parts in element format wt (== the activation dtype). */
static int matmul_element(struct backend_dev *be, uint32_t wt, const void *x, uint32_t in, uint32_t n,
			  const struct mm_part *parts, uint32_t np, uint32_t ldc, bool add, const char *what)
{
	if (n == 1 && gemv_fits(be, wt, in, parts, np)) {
		gemv_args g;
		memset(&g, 0, sizeof(g));
		for (uint32_t i = 0; i < np; i++) {
			g.w[i] = parts[i].w;
			g.out[i] = parts[i].out;
			g.rows[i] = parts[i].rows;
			g.total += parts[i].rows;
		}
		g.in8 = in / 8;
		g.x = x;
		gemv_launch(wt, be->gemv_rows, g, add ? GEMV_ADD : GEMV_STORE, be->pdl, be->stream);
		LAUNCHED(be, "gemv_kernel");
		return 0;
	}
	for (uint32_t i = 0; i < np; i++) {
		int rc = gemm(be, wt, &parts[i], x, in, n, ldc, add, what);
		if (rc)
			return rc;
	}
	return 0;
}

/* Parts in block format fmt, x in BF16 (or from src: one token, the integer path). */
static int matmul_quant(struct backend_dev *be, uint32_t fmt, const void *x, const struct xsrc *src, uint32_t in,
			uint32_t n, const struct mm_part *parts, uint32_t np, uint32_t ldc, bool add, const char *what)
{
	if (qgemv_fits(be, fmt, in, n, parts, np)) {
		/* Passes of up to QG_MAX_NT tokens, each reading the weights once. */
		for (uint32_t t0 = 0; t0 < n; t0 += QG_MAX_NT) {
			qgemv_args g;
			qgemv_args_of(g, parts, np, (const __nv_bfloat16 *)x + (size_t)t0 * in, src, in,
				      n - t0 < QG_MAX_NT ? n - t0 : QG_MAX_NT, ldc);
			for (uint32_t i = 0; i < np; i++)
				g.out[i] += (size_t)t0 * ldc;
			qgemv_launch(be, fmt, g, add ? GEMV_ADD : GEMV_STORE, be->stream);
			LAUNCHED(be, "qgemv_kernel");
		}
		return 0;
	}
	assert(!src);
	/* Rows dequantized into the scratch a chunk at a time, each chunk one GEMM. */
	uint32_t chunk = be->qscratch_elems / in < UINT32_MAX ? (uint32_t)(be->qscratch_elems / in) : UINT32_MAX;
	if (chunk >= 64)
		chunk &= ~63u; /* chunks of whole tiles, outputs aligned */
	if (chunk == 0)
		return cuda_failf(be, -ENOTSUP, "cuda backend: %s: rows of %u values do not fit the dequantization "
				  "scratch of %zu values", what, in, be->qscratch_elems);
	/* Parts whose outputs follow each other (gate and up, q/k/v) and fit the scratch together: each
	 * dequantized after the one before, one GEMM over all their rows (a launch each saved: a
	 * small expert's products are mostly their launches). */
	uint64_t all = 0;
	bool joined = np > 1;
	for (uint32_t i = 0; joined && i < np; i++) {
		joined = parts[i].out == parts[0].out + all;
		all += parts[i].rows;
	}
	if (joined && all <= chunk) {
		uint64_t r0 = 0;
		for (uint32_t i = 0; i < np; r0 += parts[i++].rows) {
			dequant_launch(fmt, parts[i].w, parts[i].row_bytes, parts[i].rows, in,
				       (__nv_bfloat16 *)be->qscratch + r0 * in, DT_BF16, be->stream);
			LAUNCHED(be, "dequant_kernel");
		}
		struct mm_part sub = {be->qscratch, (uint32_t)all, parts[0].out, DT_BF16, (uint64_t)in * 2};
		return gemm(be, DT_BF16, &sub, x, in, n, ldc, add, what);
	}
	for (uint32_t i = 0; i < np; i++) {
		const struct mm_part *pt = &parts[i];
		for (uint64_t r0 = 0; r0 < pt->rows; r0 += chunk) {
			uint32_t nr = pt->rows - r0 < chunk ? (uint32_t)(pt->rows - r0) : chunk;
			dequant_launch(fmt, (const char *)pt->w + (uint64_t)r0 * pt->row_bytes, pt->row_bytes, nr, in,
				       be->qscratch, DT_BF16, be->stream);
			LAUNCHED(be, "dequant_kernel");
			struct mm_part sub = {be->qscratch, nr, pt->out + r0, DT_BF16, (uint64_t)in * 2};
			int rc = gemm(be, DT_BF16, &sub, x, in, n, ldc, add, what);
			if (rc)
				return rc;
		}
	}
	return 0;
}

int matmul(struct backend_dev *be, uint32_t at, const void *x, const struct xsrc *src, uint32_t in, uint32_t n,
	   const struct mm_part *parts, uint32_t np, uint32_t ldc, bool add, const char *what)
{
	assert(np >= 1 && np <= 3 && (!add || np == 1));
	assert(!src || src->kind == XSRC_ACT || (n == 1 && qgemv_fuses_x(be, in, parts, np)));
	if (src && src->kind == XSRC_ACT)
		src = NULL;
	/* Runs of parts in one format go together (q/k/v of a Q4_K_M layer: Q4_K, Q4_K, Q6_K); one
	 * token's two runs in two block formats in one launch where the integer path takes them. */
	uint32_t r1 = 1;
	while (r1 < np && parts[r1].format == parts[0].format)
		r1++;
	bool two = r1 < np && n == 1 && !add; /* qgemv_launch_mix checks the two formats */
	for (uint32_t i = r1 + 1; two && i < np; i++)
		two = parts[i].format == parts[r1].format;
	if (two && qgemv_launch_mix(be, parts, r1, parts + r1, np - r1, x, src, in, ldc)) {
		assert(act_dtype(parts[0].format) == at && act_dtype(parts[r1].format) == at);
		LAUNCHED(be, "qgemv_kernel (two formats)");
		return 0;
	}
	for (uint32_t i = 0; i < np;) {
		uint32_t j = i + 1;
		while (j < np && parts[j].format == parts[i].format)
			j++;
		uint32_t f = parts[i].format;
		assert(act_dtype(f) == at);
		int rc = dtype_is_element((enum dtype)f)
				 ? matmul_element(be, f, x, in, n, parts + i, j - i, ldc, add, what)
				 : matmul_quant(be, f, x, src, in, n, parts + i, j - i, ldc, add, what);
		if (rc)
			return rc;
		i = j;
	}
	return 0;
}

int swiglu_product(struct backend_dev *be, uint32_t at, const struct mm_part gu[2], const void *x,
		   const struct xsrc *src, uint32_t in, uint32_t n, void *act, const char *what)
{
	const uint32_t f = gu[0].format, rows = gu[0].rows;
	assert(!src || src->kind == XSRC_ACT || (n == 1 && gu[1].format == f && qgemv_fuses_x(be, in, gu, 2)));
	assert(gu[1].rows == rows && gu[1].out == gu[0].out + rows);
	/* SiLU(gate) * up fused into the GEMV where gate and up share a format. */
	const bool same = gu[1].format == f;
	if (same && n == 1 && !dtype_is_element((enum dtype)f) && qgemv_fits(be, f, in, n, gu, 2)) {
		qgemv_args g;
		memset(&g, 0, sizeof(g));
		g.w[0] = (const uint8_t *)gu[0].w;
		g.w[1] = (const uint8_t *)gu[1].w;
		g.rows[0] = g.rows[1] = rows;
		g.total = rows;
		g.row_bytes = gu[0].row_bytes;
		g.in = in;
		g.n = 1;
		g.x = (const __nv_bfloat16 *)x;
		g.act = (__nv_bfloat16 *)act;
		if (src)
			g.src = *src;
		qgemv_launch(be, f, g, GEMV_SWIGLU, be->stream);
		LAUNCHED(be, "qgemv_kernel (gate/up)");
		return 0;
	}
	if (same && n == 1 && dtype_is_element((enum dtype)f) && gemv_fits(be, f, in, gu, 2)) {
		gemv_args g;
		memset(&g, 0, sizeof(g));
		g.w[0] = gu[0].w;
		g.w[1] = gu[1].w;
		g.total = rows;
		g.in8 = in / 8;
		g.x = x;
		g.act = act;
		gemv_launch(f, be->gemv_rows, g, GEMV_SWIGLU, be->pdl, be->stream);
		LAUNCHED(be, "gemv_kernel (gate/up)");
		return 0;
	}
	int rc = matmul(be, at, x, NULL, in, n, gu, 2, 2 * rows, false, what);
	if (rc)
		return rc;
	silu_mul_launch(at, gu[0].out, rows, (size_t)n * rows, act, be->stream);
	LAUNCHED(be, "silu_mul_kernel");
	return 0;
}

/* ---- a layer's experts, several in one launch (moe.cu) ------------------------------------ */

/* Does the one-token product of p (rows of `in` values) on x go through a kernel that takes
 * several matrices? */
static bool batch_part_fits(const struct backend_dev *be, const struct mm_part *p, uint32_t in, const void *x)
{
	if ((uintptr_t)x % 16)
		return false;
	if (dtype_is_element((enum dtype)p->format))
		return gemv_fits(be, p->format, in, p, 1) && p->row_bytes == (uint64_t)in * dtype_size((enum dtype)p->format);
	return qgemv_fits(be, p->format, in, 1, p, 1) && qgemv_integer(be, p->format, in, x);
}

bool expert_batch_fits(const struct backend_dev *be, const struct mm_expert *e, uint32_t dim, uint32_t F,
		       const void *x)
{
	const uint32_t f = e->gate.format, at = act_dtype(f);
	return e->up.format == f && e->up.row_bytes == e->gate.row_bytes && act_dtype(e->down.format) == at &&
	       e->gate.rows == F && e->up.rows == F && e->down.rows == dim && batch_part_fits(be, &e->gate, dim, x) &&
	       batch_part_fits(be, &e->up, dim, x) && batch_part_fits(be, &e->down, F, e->act);
}

bool expert_batch_joins(const struct mm_expert *a, const struct mm_expert *b)
{
	return a->gate.format == b->gate.format && a->down.format == b->down.format &&
	       a->gate.row_bytes == b->gate.row_bytes && a->down.row_bytes == b->down.row_bytes &&
	       a->gate.rows == b->gate.rows && a->down.rows == b->down.rows;
}

/* One product over the matrices in m (rows of `in` values each, in format fmt): SwiGLU (gate/up)
 * or STORE (down). */
static void batch_launch(struct backend_dev *be, uint32_t fmt, const struct gemv_mats *m, uint32_t rows,
			 uint32_t in, uint64_t row_bytes, int mode)
{
	if (dtype_is_element((enum dtype)fmt)) {
		gemv_args g;
		memset(&g, 0, sizeof(g));
		g.m = *m;
		g.rows[0] = rows;
		g.total = rows;
		g.in8 = in / 8;
		gemv_launch(fmt, be->gemv_rows, g, mode, be->pdl, be->stream);
		return;
	}
	qgemv_args g;
	memset(&g, 0, sizeof(g));
	g.m = *m;
	g.rows[0] = g.rows[1] = rows;
	g.total = rows;
	g.row_bytes = row_bytes;
	g.in = in;
	g.n = 1;
	g.ldc = rows;
	g.x = (const __nv_bfloat16 *)m->x[0];
	qgemv_launch(be, fmt, g, mode, be->stream);
}

int experts_batch(struct backend_dev *be, const struct mm_expert *e, uint32_t n, const void *x, uint32_t dim,
		  uint32_t F, const void *const *gu_wd, const void *const *down_wd)
{
	assert(n >= 1 && n <= GEMV_MATS);
	struct gemv_mats gu, down;
	memset(&gu, 0, sizeof(gu));
	memset(&down, 0, sizeof(down));
	gu.n = down.n = n;
	gu.wd = gu_wd;
	down.wd = down_wd;
	for (uint32_t j = 0; j < n; j++) {
		if (!gu_wd) {
			gu.w[j] = e[j].gate.w;
			gu.w2[j] = e[j].up.w;
			down.w[j] = e[j].down.w;
		}
		gu.x[j] = x;
		gu.act[j] = e[j].act;
		down.x[j] = e[j].act;
		down.out[j] = e[j].down.out;
	}
	batch_launch(be, e[0].gate.format, &gu, F, dim, e[0].gate.row_bytes, GEMV_SWIGLU);
	LAUNCHED(be, "experts' gate/up (one launch)");
	batch_launch(be, e[0].down.format, &down, dim, F, e[0].down.row_bytes, GEMV_STORE);
	LAUNCHED(be, "experts' down_proj (one launch)");
	return 0;
}

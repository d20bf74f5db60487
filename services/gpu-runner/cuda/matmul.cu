/* matmul.cu - matrix products of the CUDA backend. Weights are row-major (out, in): y = W x. In
 * cuBLAS's column-major terms Y^T (out x n) = op(A) B with A = W seen as (in x out), op =
 * transpose, B = X^T (in x n). One token (decode) goes through the GEMV kernel (gemv.cu)
 * instead where it applies (BF16/F16 weights, backend_params.gemv not BACKEND_GEMV_CUBLAS).
 * The products accumulate in float32 (CUBLAS_COMPUTE_32F; _PEDANTIC for F32 weights, so no
 * TF32) and write float32. */
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

int matmul(struct backend_dev *be, uint32_t wt, const void *x, uint32_t in, uint32_t n, const struct mm_part *parts,
		  uint32_t np, uint32_t ldc, bool add, const char *what)
{
	assert(np >= 1 && np <= 3 && (!add || np == 1));
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
		gemv_launch(wt, be->gemv_rows, g, add ? GEMV_ADD : GEMV_STORE, be->stream);
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

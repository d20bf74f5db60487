/* norm_rope.cu - the CUDA backend's element-wise kernels: embedding rows widened into the
 * residual stream, RMSNorm into the matrix input dtype, RoPE with the K and V rows written into
 * the arena, SiLU(gate) * up for the cuBLAS path, and a partial result added into the residual
 * stream. Numerics as the C reference rounds (backend_cuda.cu's header says how). */
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cuda/device.cuh"

/* Embedding rows (already gathered, in the table's dtype) to the float32 residual stream. */
template <typename TI> __global__ void embed_kernel(const TI *raw, float *x, size_t count)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x)
		x[i] = to_f32(raw[i]);
}

/* x[i] += y[i] (a partial result into the residual stream). */
__global__ void add_kernel(float *x, const float *y, size_t count)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x)
		x[i] += y[i];
}

void add_launch(float *x, const float *y, size_t count, cudaStream_t s)
{
	add_kernel<<<grid_for(count, 256), 256, 0, s>>>(x, y, count);
}

/* One block per token: out = w * (x * rsqrt(mean(x^2) + eps)) as transformers' LlamaRMSNorm in
 * float32, the mean taken in double as the reference does; out in dtype TO (a matrix's input, or
 * the experts' float32 rows), and where host is set (float32 rows only) the same rows there too
 * (mapped host memory). */
template <typename TO>
__global__ void __launch_bounds__(1024) rmsnorm_kernel(const float *x, const void *w, uint32_t wt, uint32_t dim,
							float eps, TO *out, float *host)
{
	__shared__ double part[32];
	const float *xr = x + (size_t)blockIdx.x * dim;
	TO *orow = out + (size_t)blockIdx.x * dim;
	float *hrow = host ? host + (size_t)blockIdx.x * dim : NULL;
	grid_launch_next();
	grid_wait();
	double ss = 0;
	for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
		ss += (double)xr[i] * xr[i];
	for (int o = 16; o > 0; o >>= 1)
		ss += __shfl_xor_sync(0xffffffffu, ss, o);
	if (threadIdx.x % 32 == 0)
		part[threadIdx.x / 32] = ss;
	__syncthreads();
	/* Every warp folds the warps' sums by shuffles (not a serial loop in each thread). */
	const uint32_t lane = threadIdx.x % 32;
	double tot = lane < blockDim.x / 32 ? part[lane] : 0.0;
	for (int o = 16; o > 0; o >>= 1)
		tot += __shfl_xor_sync(0xffffffffu, tot, o);
	float var = (float)(tot / dim);
	float r = 1.0f / sqrtf(var + eps); /* IEEE division and square root (no fast math) */
	for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x) {
		const float v = __fmul_rn(load_any(w, wt, i), __fmul_rn(xr[i], r));
		orow[i] = from_f32<TO>(v);
		if (hrow)
			hrow[i] = v;
	}
}
/* Grid (n, slices): RoPE on q (in place) and k, k and v into their arena row, and the token's
 * attention accumulators reset; the slices of a token split its work (each computes the token's
 * angles). cos and sin of the float32 angle in double, rounded
 * to float32, and rotate_half with unfused float32 products, as the reference. Pair j (rotated
 * by inv_freq[j]) is dimensions (j, j + hd/2) of a head, or (2j, 2j + 1) with a.adjacent
 * (ROPE_ADJACENT: GGUF's row order of wq and wk). */
template <typename KT> __global__ void __launch_bounds__(256) rope_kernel(const __grid_constant__ rope_args a)
{
	__shared__ float cs[MAX_HEAD_DIM / 2], sn[MAX_HEAD_DIM / 2];
	const uint32_t t = blockIdx.x, hd = a.head_dim, half = hd / 2;
	const uint32_t kv_dim = a.n_kv_heads * hd;
	const uint32_t *dst = !a.pos && a.n <= ROPE_INLINE_TOKENS ? a.dst_in : a.dst;
	ktrace_mark(a.tr, 0);
	grid_launch_next();
	if (a.pos)
		grid_wait(); /* the positions come with the copy before the kernel */
	const uint32_t pos = a.pos ? a.pos[t] : a.pos0 + t;
	for (uint32_t j = threadIdx.x; j < half; j += blockDim.x) {
		float angle = __fmul_rn(__uint2float_rn(pos), a.inv_freq[j]);
		double s, c;
		sincos((double)angle, &s, &c);
		cs[j] = (float)c;
		sn[j] = (float)s;
	}
	__syncthreads();
	grid_wait();
	ktrace_mark(a.tr, 1);
	float *q = a.qkv + (size_t)t * a.ld, *k = q + (size_t)a.n_heads * hd, *v = k + kv_dim;
	/* The two dimensions of pair j within a head. */
	const uint32_t step1 = a.adjacent ? 2 : 1, off2 = a.adjacent ? 1 : half;
	const uint32_t i0 = blockIdx.y * blockDim.x + threadIdx.x, stride = gridDim.y * blockDim.x;
	for (uint32_t i = i0; i < a.n_heads * half; i += stride) {
		uint32_t h = i / half, j = i % half, d1 = j * step1, d2 = d1 + off2;
		float *qh = q + (size_t)h * hd;
		float x1 = qh[d1], x2 = qh[d2];
		qh[d1] = __fsub_rn(__fmul_rn(x1, cs[j]), __fmul_rn(x2, sn[j]));
		qh[d2] = __fadd_rn(__fmul_rn(x2, cs[j]), __fmul_rn(x1, sn[j]));
	}
	KT *kd = (KT *)a.arena + dst[t] * a.block_elems + (size_t)dst[a.n + t] * kv_dim;
	KT *vd = kd + (size_t)a.block_tokens * kv_dim;
	for (uint32_t i = i0; i < a.n_kv_heads * half; i += stride) {
		uint32_t h = i / half, j = i % half, d1 = j * step1, d2 = d1 + off2;
		const float *kh = k + (size_t)h * hd;
		float x1 = kh[d1], x2 = kh[d2];
		kd[h * hd + d1] = from_f32<KT>(__fsub_rn(__fmul_rn(x1, cs[j]), __fmul_rn(x2, sn[j])));
		kd[h * hd + d2] = from_f32<KT>(__fadd_rn(__fmul_rn(x2, cs[j]), __fmul_rn(x1, sn[j])));
	}
	for (uint32_t i = i0; i < kv_dim; i += stride)
		vd[i] = from_f32<KT>(v[i]);
	size_t p0 = (size_t)t * a.n_heads;
	for (uint32_t i = i0; i < a.n_heads; i += stride) {
		a.m[p0 + i] = -INFINITY;
		a.l[p0 + i] = 0.0f;
	}
	for (uint32_t i = i0; i < a.n_heads * hd; i += stride)
		a.acc[p0 * hd + i] = 0.0f;
	ktrace_end(a.tr);
}

/* SiLU(gate) * up from the float32 products of the cuBLAS path ((n, 2 * ffn): gate, then up). */
template <typename TO> __global__ void silu_mul_kernel(const float *gu, uint32_t ffn, size_t count, TO *out)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
		size_t t = i / ffn, o = i % ffn;
		const float *row = gu + t * 2 * ffn;
		out[i] = from_f32<TO>(silu_mul(row[o], row[ffn + o]));
	}
}
/* ---- launchers ---------------------------------------------------------------------------- */

void embed_launch(uint32_t dt, const void *raw, float *x, size_t count, cudaStream_t s)
{
	unsigned grid = grid_for(count, 256);
	if (dt == DT_BF16)
		embed_kernel<__nv_bfloat16><<<grid, 256, 0, s>>>((const __nv_bfloat16 *)raw, x, count);
	else if (dt == DT_F16)
		embed_kernel<__half><<<grid, 256, 0, s>>>((const __half *)raw, x, count);
	else
		embed_kernel<float><<<grid, 256, 0, s>>>((const float *)raw, x, count);
}

void rope_launch(uint32_t kv_dtype, const rope_args &a, bool pdl, cudaStream_t s)
{
	/* Few tokens (decode): 8 blocks of 256 threads per token, not one block for all of it. */
	const unsigned threads = small_grid(a.n) ? 256 : 128;
	const dim3 grid(a.n, small_grid(a.n) ? 8 : 1);
	if (kv_dtype == DT_BF16)
		launch_k(pdl, rope_kernel<__nv_bfloat16>, grid, threads, 0, s, a);
	else
		launch_k(pdl, rope_kernel<float>, grid, threads, 0, s, a);
}

void silu_mul_launch(uint32_t ot, const float *gu, uint32_t ffn, size_t count, void *out, cudaStream_t s)
{
	unsigned grid = grid_for(count, 256);
	if (ot == DT_BF16)
		silu_mul_kernel<__nv_bfloat16><<<grid, 256, 0, s>>>(gu, ffn, count, (__nv_bfloat16 *)out);
	else if (ot == DT_F16)
		silu_mul_kernel<__half><<<grid, 256, 0, s>>>(gu, ffn, count, (__half *)out);
	else
		silu_mul_kernel<float><<<grid, 256, 0, s>>>(gu, ffn, count, (float *)out);
}

/* RMSNorm of rows rows[0..n) of x into rows 0..n-1 of be->xa in dtype ot: a launch per row (the
 * head of a step of several sequences: a few rows). */
int rmsnorm_rows(struct backend_dev *be, const void *w, uint32_t wt, const uint32_t *rows, uint32_t n, uint32_t ot)
{
	uint32_t dim = be->cfg.dim;
	float eps = be->cfg.rms_eps;
	for (uint32_t i = 0; i < n; i++) {
		const float *x = be->x + (size_t)rows[i] * dim;
		if (ot == DT_BF16)
			launch_k(be->pdl, rmsnorm_kernel<__nv_bfloat16>, 1, 1024, 0, be->stream, x, w, wt, dim, eps,
				 (__nv_bfloat16 *)be->xa + (size_t)i * dim, (float *)NULL);
		else if (ot == DT_F16)
			launch_k(be->pdl, rmsnorm_kernel<__half>, 1, 1024, 0, be->stream, x, w, wt, dim, eps,
				 (__half *)be->xa + (size_t)i * dim, (float *)NULL);
		else
			launch_k(be->pdl, rmsnorm_kernel<float>, 1, 1024, 0, be->stream, x, w, wt, dim, eps,
				 (float *)be->xa + (size_t)i * dim, (float *)NULL);
		LAUNCHED(be, "rmsnorm_kernel (rows)");
	}
	return 0;
}

/* RMSNorm of rows [row0, row0 + rows) of x into out (from its start) in dtype ot, and into host
 * (float32 rows, mapped host memory) where set. */
static int rmsnorm_out(struct backend_dev *be, const void *w, uint32_t wt, uint32_t row0, uint32_t rows, uint32_t ot,
		       void *out, float *host)
{
	const float *x = be->x + (size_t)row0 * be->cfg.dim;
	uint32_t dim = be->cfg.dim;
	float eps = be->cfg.rms_eps;
	unsigned threads = small_grid(rows) ? 1024 : 256;
	if (ot == DT_BF16)
		launch_k(be->pdl, rmsnorm_kernel<__nv_bfloat16>, rows, threads, 0, be->stream, x, w, wt, dim, eps,
			 (__nv_bfloat16 *)out, host);
	else if (ot == DT_F16)
		launch_k(be->pdl, rmsnorm_kernel<__half>, rows, threads, 0, be->stream, x, w, wt, dim, eps, (__half *)out,
			 host);
	else
		launch_k(be->pdl, rmsnorm_kernel<float>, rows, threads, 0, be->stream, x, w, wt, dim, eps, (float *)out,
			 host);
	LAUNCHED(be, "rmsnorm_kernel");
	return 0;
}

int rmsnorm(struct backend_dev *be, const void *w, uint32_t wt, uint32_t row0, uint32_t rows, uint32_t ot)
{
	return rmsnorm_out(be, w, wt, row0, rows, ot, be->xa, NULL);
}

int rmsnorm_f32(struct backend_dev *be, const void *w, uint32_t wt, uint32_t row0, uint32_t rows, float *out,
		float *host)
{
	return rmsnorm_out(be, w, wt, row0, rows, DT_F32, out, host);
}


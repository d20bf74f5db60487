/* backend_cuda.cu - the CUDA backend ("cuda"): the forward pass of backend_ref.c on one GPU.
 *
 * Same math and the same call sequence as the C reference (backend.h), which is its oracle
 * (tests/unit/gpu-runner/test_cuda_backend.c). All compute of a forward step is queued on one
 * compute stream (stream()); the KV copies have two streams of their own: the write-behind to
 * the pool (kv_to_host_async, lowest priority) and the read-ahead from it (kv_prefetch_n), each
 * ordered against the compute stream with events. Nothing waits for the GPU on the token path
 * except where the host must see a result: logits / logits_argmax (their device-to-host copy),
 * the read-ahead's slot (kv_prefetch_wait) and the synchronous kv_to_host(_n) /
 * kv_from_host(_n).
 *
 * Precision. The residual stream, RMSNorm, RoPE, the softmax and SiLU * up are float32; the
 * normed activations become the weight dtype (BF16, F16; float32 for F32 weights) as inputs of
 * the matrix products, which accumulate in float32 and write float32 (cuBLAS with
 * CUBLAS_COMPUTE_32F; CUBLAS_COMPUTE_32F_PEDANTIC for F32 weights, so no TF32). The KV arena
 * holds K and V in BF16 (what the runner uses on a GPU) or F32 (for exact comparisons). RoPE
 * uses the reference's float32 inverse frequencies (computed on the host by the same steps)
 * and the float32 angle pos * inv_freq, with cos and sin in double as the reference takes them.
 *
 * Matrix products. Weights are row-major (out, in): y = W x. In cuBLAS's column-major terms
 * Y^T (out x n) = op(A) B with A = W seen as (in x out), op = transpose, B = X^T (in x n). One
 * token (decode) goes through a GEMV kernel of our own instead (BF16/F16 weights): each warp
 * streams one weight row with 16-byte loads, several in flight, and the kernel fuses what
 * follows the product (the residual add of o_proj and down_proj; SiLU(gate) * up, written in
 * the weight dtype). PIPELINE_CUDA_GEMV=0 in the environment sends decode through cuBLAS too,
 * =2 runs two rows per warp (for comparisons: on an H100 one row per warp was the fastest).
 *
 * Attention. attn_blocks folds the listed spans into running (max, sum, weighted V) state per
 * (token, query head), kept in device memory between calls, so spans may come in any order and
 * in pieces. A block serves queries that share one KV head (GQA) and stages the keys (K and V)
 * a tile at a time in shared memory; tiles no query of the block may see (causal mask, sliding
 * window) are skipped. Few queries (decode, small chunks): one warp per query scores 32 keys at
 * a time (one key per lane) with an online softmax on the CUDA cores (attn_kernel). Many
 * queries with a BF16 arena and head_dim 64 or 128 (prefill): 64 queries per block on the
 * tensor cores (attn_mma_kernel; PIPELINE_CUDA_ATTN=simple turns it off). With few blocks the
 * key range is split across blocks and a second kernel merges the pieces into the running
 * state.
 *
 * Host staging. Token rows of the embedding table (host memory), destination rows and spans go
 * up from a pinned ring buffer with cudaMemcpyAsync on the compute stream; each upload records
 * an event, and a region of the ring is rewritten only once the event of the copy that last
 * read it has completed (normally long done: the host waits only when it runs a full ring
 * ahead of the GPU).
 *
 * Errors detected on the device (a query that saw no keys at attn_end) cannot be returned by
 * the asynchronous op: a device flag records the first one and the next logits or
 * logits_argmax fails with its message.
 *
 * Not thread-safe: one thread drives a backend. The device is the one current at create.
 */
#include "common/protocol.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/rope.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define CUDA_ERR_MAX 400
#define ATTN_TILE 32		/* keys staged in shared memory at a time: one per lane */
#define ATTN_MAX_WARPS 16	/* queries (warps) per attention block */
#define ATTN_MAX_SPLITS 64	/* key-range splits of one attn_blocks call */
#define ATTN_BLOCKS_PER_SM 4	/* splitting the keys aims at this many blocks per multiprocessor */
#define MMA_ROWS 64		/* tensor-core attention: queries per block, 16 per warp */
#define MMA_KEYS 64		/* tensor-core attention: keys per staged tile */
#define MAX_HEAD_DIM 256	/* per-lane accumulators: 2 dims per lane per 64 */
#define GEMV_WARPS 8		/* warps per GEMV block */
#define GEMV_UNROLL 4		/* 16-byte loads in flight per row and lane */
#define GEMV_DEFAULT_ROWS 1	/* rows per warp unless PIPELINE_CUDA_GEMV says otherwise */
#define UPLOAD_EVENTS 128	/* uploads in flight in the staging ring */
#define UPLOAD_ALIGN 256
#define BLAS_WORKSPACE (32u << 20) /* what cuBLAS asks for on Hopper */

/* Where a forward step stands: the order of calls backend.h prescribes. */
enum phase {
	PHASE_IDLE = 0,	 /* no chunk embedded yet */
	PHASE_READY = 1, /* hidden state holds a chunk: attn_begin, ffn or logits may follow */
	PHASE_ATTN = 2,	 /* between attn_begin and attn_end */
};

/* What device kernels report to the host; read back with the logits. */
struct dev_status {
	int32_t token;	   /* logits_argmax's result */
	int32_t err;	   /* 1: a query saw no keys */
	uint32_t err_layer;
	uint32_t err_pos;
};

/* Pinned host memory that uploads are staged in, reused as a ring (see the header comment). */
struct upload_ring {
	char *host;	    /* pinned, cap bytes */
	size_t cap;
	size_t head;	    /* where the next region starts */
	cudaEvent_t ev[UPLOAD_EVENTS];
	size_t beg[UPLOAD_EVENTS], end[UPLOAD_EVENTS]; /* region each pending event guards */
	uint32_t first, count;			       /* pending events, oldest first */
	uint32_t n_events;			       /* events created (destroy) */
};

struct backend {
	struct model_config cfg;
	struct backend_params p;
	char err[CUDA_ERR_MAX];

	int device;
	int sm_count;
	cudaStream_t stream;
	cudaStream_t kv_h2d;	/* the KV read-ahead's copies (kv_prefetch_n), made on first use */
	cudaEvent_t kv_order;	/* recorded on stream: what the read-ahead's copies wait for */
	cudaEvent_t kv_done[2];	/* recorded on kv_h2d per slot */
	cudaStream_t kv_d2h;	/* the KV write-behind's copies (kv_to_host_async), lowest priority, made on first use */
	cudaEvent_t kv_d2h_order; /* recorded on stream: what the write-behind's copies wait for */
	int32_t *kv_d2h_ev;	/* per arena block: the interprocess event after its last write-behind copy that
				 * the compute stream has not been made to wait for, or -1 */
	uint64_t *kv_d2h_seq;	/* per arena block: that copy's batch number (the latest one covers the rest) */
	uint64_t kv_d2h_batches;
	cublasHandle_t blas;
	void *blas_ws;		/* cuBLAS workspace, BLAS_WORKSPACE bytes */
	int gemv_rows;		/* decode through the GEMV kernel with this many rows per warp (0: cuBLAS) */
	bool attn_mma;		/* prefill attention on tensor cores where it applies */

	uint32_t q_dim;		/* n_heads * head_dim */
	uint32_t kv_dim;	/* n_kv_heads * head_dim */
	uint32_t qkv_ld;	/* q_dim + 2 * kv_dim: a token's row of qkv */
	uint32_t max_in;	/* widest matrix input: max(dim, q_dim, ffn_dim) */
	size_t kv_esize;	/* bytes of one K or V element */
	size_t block_elems;	/* elements of one arena block: K then V, (block_tokens, n_kv_heads, head_dim) each */
	size_t attn_smem_max;	/* dynamic shared memory of the largest attention block */
	float scale;		/* 1 / sqrt(head_dim) */

	/* Device memory. */
	void *arena;		/* (n_kv_blocks, block_elems) in kv_dtype */
	float *inv_freq;	/* (head_dim / 2) RoPE inverse frequencies, scaling applied */
	float *x;		/* (max_chunk, dim) residual stream */
	void *xa;		/* (max_chunk, max_in) matrix input in the weight dtype; embed's raw rows */
	void *xb;		/* (max_chunk, ffn_dim) SiLU(gate) * up in the weight dtype */
	float *qkv;		/* (max_chunk, qkv_ld) q (RoPE'd in place), k, v */
	float *gu;		/* (max_chunk, 2 * ffn_dim) gate then up (cuBLAS path) */
	float *logits;		/* (vocab_size) */
	float *st_m, *st_l;	/* (max_chunk, n_heads) running max and sum of the softmax */
	float *st_acc;		/* (max_chunk, n_heads, head_dim) running weighted sum of V */
	float *pm, *pl, *pacc;	/* partial states of split attention: part_cap pairs (and head_dim) */
	uint32_t part_cap;	/* (split, token, head) triples the partial buffers hold */
	uint32_t *dst;		/* (2, max_chunk) destination blocks, then rows */
	void *spanbuf;		/* spans, then their key offsets (prefix sums) */
	size_t spanbuf_bytes;
	struct dev_status *status;

	struct dev_status *h_status; /* pinned */
	struct upload_ring up;

	/* The chunk in flight. */
	enum phase phase;
	uint32_t n;		/* tokens in the chunk */
	uint32_t pos0;		/* position of its first token */
	uint32_t layer;		/* layer between attn_begin and attn_end */
	uint32_t attn_wt;	/* dtype of the attention matrices of that layer */
};

__attribute__((format(printf, 3, 4))) static int fail(struct backend *be, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(be->err, sizeof(be->err), fmt, ap);
	va_end(ap);
	return rc;
}

/* A failed CUDA runtime call: -ENOMEM for allocations, -EIO for the rest. */
static int cuda_fail(struct backend *be, cudaError_t e, const char *what)
{
	int rc = e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO;
	return fail(be, rc, "cuda backend: %s failed: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

#define CUDA_TRY(be, what, call)                                  \
	do {                                                      \
		cudaError_t e_ = (call);                          \
		if (e_ != cudaSuccess)                            \
			return cuda_fail((be), e_, (what));       \
	} while (0)

/* After a kernel launch: a bad configuration shows here; faults show at the next sync. */
#define LAUNCHED(be, what) CUDA_TRY(be, "launch of " what, cudaGetLastError())

static int blas_fail(struct backend *be, cublasStatus_t st, const char *what)
{
	return fail(be, -EIO, "cuda backend: %s failed: %s", what, cublasGetStatusString(st));
}

/* ---- device helpers --------------------------------------------------------------------- */

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v)
{
	return v;
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v)
{
	return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v)
{
	return __float2half_rn(v);
}

__device__ __forceinline__ float to_f32(float v)
{
	return v;
}
__device__ __forceinline__ float to_f32(__nv_bfloat16 v)
{
	return __bfloat162float(v);
}
__device__ __forceinline__ float to_f32(__half v)
{
	return __half2float(v);
}

__device__ __forceinline__ float2 to_f32x2(__nv_bfloat162 v)
{
	return __bfloat1622float2(v);
}
__device__ __forceinline__ float2 to_f32x2(__half2 v)
{
	return __half22float2(v);
}

/* The pair type of a 16-bit element type. */
template <typename T> struct pair_of;
template <> struct pair_of<__nv_bfloat16> {
	typedef __nv_bfloat162 type;
};
template <> struct pair_of<__half> {
	typedef __half2 type;
};

/* Element i of a vector of any enum dtype (norm weights), as float32. */
__device__ __forceinline__ float load_any(const void *p, uint32_t dt, size_t i)
{
	if (dt == DT_BF16)
		return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
	if (dt == DT_F16)
		return __half2float(((const __half *)p)[i]);
	return ((const float *)p)[i];
}

__device__ __forceinline__ float warp_sum(float v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

__device__ __forceinline__ float warp_max(float v)
{
	for (int o = 16; o > 0; o >>= 1)
		v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
	return v;
}

/* silu(g) * u as the reference: silu in double rounded to float32, then the float32 product. */
__device__ __forceinline__ float silu_mul(float g, float u)
{
	float s = (float)((double)g / (1.0 + exp(-(double)g)));
	return __fmul_rn(s, u);
}

/* ---- small kernels ---------------------------------------------------------------------- */

/* Embedding rows (already gathered, in the table's dtype) to the float32 residual stream. */
template <typename TI> __global__ void embed_kernel(const TI *raw, float *x, size_t count)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x)
		x[i] = to_f32(raw[i]);
}

/* One block per token: out = w * (x * rsqrt(mean(x^2) + eps)) as transformers' LlamaRMSNorm in
 * float32, the mean taken in double as the reference does; out in the matrix input dtype. */
template <typename TO>
__global__ void __launch_bounds__(1024) rmsnorm_kernel(const float *x, const void *w, uint32_t wt, uint32_t dim,
							float eps, TO *out)
{
	__shared__ double part[32];
	const float *xr = x + (size_t)blockIdx.x * dim;
	TO *orow = out + (size_t)blockIdx.x * dim;
	double ss = 0;
	for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
		ss += (double)xr[i] * xr[i];
	for (int o = 16; o > 0; o >>= 1)
		ss += __shfl_xor_sync(0xffffffffu, ss, o);
	if (threadIdx.x % 32 == 0)
		part[threadIdx.x / 32] = ss;
	__syncthreads();
	double tot = 0;
	for (uint32_t i = 0; i < blockDim.x / 32; i++)
		tot += part[i];
	float var = (float)(tot / dim);
	float r = 1.0f / sqrtf(var + eps); /* IEEE division and square root (no fast math) */
	for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
		orow[i] = from_f32<TO>(__fmul_rn(load_any(w, wt, i), __fmul_rn(xr[i], r)));
}

struct rope_args {
	float *qkv;		/* (n, ld): q, k, v of each token */
	uint32_t ld;
	const float *inv_freq;
	const uint32_t *dst;	/* (2, n): blocks, then rows */
	void *arena;
	uint64_t block_elems;
	uint32_t block_tokens, n_heads, n_kv_heads, head_dim, pos0, n;
	float *m, *l, *acc;	/* running attention state, reset here */
};

/* One block per token: RoPE on q (in place) and k, k and v into their arena row, and the
 * token's attention accumulators reset. cos and sin of the float32 angle in double, rounded
 * to float32, and rotate_half with unfused float32 products, as the reference. */
template <typename KT> __global__ void __launch_bounds__(512) rope_kernel(const rope_args a)
{
	__shared__ float cs[MAX_HEAD_DIM / 2], sn[MAX_HEAD_DIM / 2];
	const uint32_t t = blockIdx.x, hd = a.head_dim, half = hd / 2;
	const uint32_t pos = a.pos0 + t, kv_dim = a.n_kv_heads * hd;
	for (uint32_t j = threadIdx.x; j < half; j += blockDim.x) {
		float angle = __fmul_rn(__uint2float_rn(pos), a.inv_freq[j]);
		double s, c;
		sincos((double)angle, &s, &c);
		cs[j] = (float)c;
		sn[j] = (float)s;
	}
	__syncthreads();
	float *q = a.qkv + (size_t)t * a.ld, *k = q + (size_t)a.n_heads * hd, *v = k + kv_dim;
	for (uint32_t i = threadIdx.x; i < a.n_heads * half; i += blockDim.x) {
		uint32_t h = i / half, j = i % half;
		float *qh = q + (size_t)h * hd;
		float x1 = qh[j], x2 = qh[j + half];
		qh[j] = __fsub_rn(__fmul_rn(x1, cs[j]), __fmul_rn(x2, sn[j]));
		qh[j + half] = __fadd_rn(__fmul_rn(x2, cs[j]), __fmul_rn(x1, sn[j]));
	}
	KT *kd = (KT *)a.arena + a.dst[t] * a.block_elems + (size_t)a.dst[a.n + t] * kv_dim;
	KT *vd = kd + (size_t)a.block_tokens * kv_dim;
	for (uint32_t i = threadIdx.x; i < a.n_kv_heads * half; i += blockDim.x) {
		uint32_t h = i / half, j = i % half;
		const float *kh = k + (size_t)h * hd;
		float x1 = kh[j], x2 = kh[j + half];
		kd[h * hd + j] = from_f32<KT>(__fsub_rn(__fmul_rn(x1, cs[j]), __fmul_rn(x2, sn[j])));
		kd[h * hd + j + half] = from_f32<KT>(__fadd_rn(__fmul_rn(x2, cs[j]), __fmul_rn(x1, sn[j])));
	}
	for (uint32_t i = threadIdx.x; i < kv_dim; i += blockDim.x)
		vd[i] = from_f32<KT>(v[i]);
	size_t p0 = (size_t)t * a.n_heads;
	for (uint32_t i = threadIdx.x; i < a.n_heads; i += blockDim.x) {
		a.m[p0 + i] = -INFINITY;
		a.l[p0 + i] = 0.0f;
	}
	for (uint32_t i = threadIdx.x; i < a.n_heads * hd; i += blockDim.x)
		a.acc[p0 * hd + i] = 0.0f;
}

/* attn_end: att = acc / l per (token, head), in the dtype of o_proj. A query with no weight saw
 * no keys (its own block was not visited): flagged for the host, output 0. */
template <typename TO>
__global__ void __launch_bounds__(512) attn_out_kernel(const float *l, const float *acc, uint32_t n_heads,
							uint32_t hd, TO *out, struct dev_status *st, uint32_t layer,
							uint32_t pos0)
{
	const uint32_t t = blockIdx.x;
	const size_t base = (size_t)t * n_heads * hd;
	for (uint32_t i = threadIdx.x; i < n_heads * hd; i += blockDim.x) {
		float lv = l[(size_t)t * n_heads + i / hd];
		float v = 0.0f;
		if (lv > 0.0f) {
			v = acc[base + i] / lv;
		} else if (atomicCAS(&st->err, 0, 1) == 0) {
			st->err_layer = layer;
			st->err_pos = pos0 + t;
		}
		out[base + i] = from_f32<TO>(v);
	}
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

/* The id of the largest value, lowest id on ties; NaN loses to everything. One block. */
__global__ void __launch_bounds__(1024) argmax_kernel(const float *v, uint32_t n, struct dev_status *st)
{
	__shared__ float bv[32];
	__shared__ uint32_t bi[32];
	float best = -INFINITY;
	uint32_t idx = UINT32_MAX;
	for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
		float x = v[i];
		if (idx == UINT32_MAX ? !isnan(x) : x > best) {
			best = x;
			idx = i;
		}
	}
	for (int o = 16; o > 0; o >>= 1) {
		float ob = __shfl_xor_sync(0xffffffffu, best, o);
		uint32_t oi = __shfl_xor_sync(0xffffffffu, idx, o);
		if (oi != UINT32_MAX && (idx == UINT32_MAX || ob > best || (ob == best && oi < idx))) {
			best = ob;
			idx = oi;
		}
	}
	if (threadIdx.x % 32 == 0) {
		bv[threadIdx.x / 32] = best;
		bi[threadIdx.x / 32] = idx;
	}
	__syncthreads();
	if (threadIdx.x == 0) {
		for (uint32_t w = 1; w < blockDim.x / 32; w++)
			if (bi[w] != UINT32_MAX && (idx == UINT32_MAX || bv[w] > best || (bv[w] == best && bi[w] < idx))) {
				best = bv[w];
				idx = bi[w];
			}
		st->token = idx == UINT32_MAX ? 0 : (int32_t)idx;
	}
}


/* ---- sampling (one block) ---------------------------------------------------------------- */

/* Floats to unsigned integers in the same order (for bisection over the bits). */
__device__ __forceinline__ uint32_t ord_of(float f)
{
	uint32_t u = __float_as_uint(f);
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float float_of(uint32_t o)
{
	return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

/* Block-wide sum of a double (blockDim.x == 1024). */
__device__ double block_sum(double v, double *sh)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	__syncthreads();
	if (threadIdx.x % 32 == 0)
		sh[threadIdx.x / 32] = v;
	__syncthreads();
	if (threadIdx.x < 32) {
		v = sh[threadIdx.x];
		for (int o = 16; o > 0; o >>= 1)
			v += __shfl_xor_sync(0xffffffffu, v, o);
		if (threadIdx.x == 0)
			sh[0] = v;
	}
	__syncthreads();
	double r = sh[0];
	__syncthreads();
	return r;
}

/* Logits in v (n of them) to one sampled token (semantics: backend.h, logits_sample). */
__global__ void __launch_bounds__(1024) sample_kernel(const float *v, uint32_t n, float inv_t, uint32_t top_k,
							float top_p, float min_p, double u, struct dev_status *st)
{
	__shared__ double sh[32];
	__shared__ double pre[1024];
	const uint32_t T = blockDim.x, t = threadIdx.x;
	if (t == 0)
		st->token = -1; /* set below by the one thread whose run holds the draw */
	/* max of z */
	float mx = -INFINITY;
	for (uint32_t i = t; i < n; i += T) {
		float z = v[i] * inv_t;
		if (z > mx)
			mx = z;
	}
	for (int o = 16; o > 0; o >>= 1)
		mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
	__shared__ float shm[32];
	if (t % 32 == 0)
		shm[t / 32] = mx;
	__syncthreads();
	if (t == 0) {
		for (uint32_t w = 1; w < T / 32; w++)
			shm[0] = fmaxf(shm[0], shm[w]);
	}
	__syncthreads();
	mx = shm[0];
	if (!(mx > -INFINITY)) { /* every logit is -inf or NaN */
		if (t == 0)
			st->token = 0;
		return;
	}
	/* top-k: the largest z threshold with at least k values at or above it (exact, by bits). */
	uint32_t zlo = 0; /* ord of the threshold; 0 keeps everything */
	if (top_k > 0 && top_k < n) {
		uint32_t lo = 0, hi = ord_of(mx); /* invariant: count(>= float_of(lo)) >= k */
		while (lo < hi) {
			uint32_t mid = lo + (hi - lo + 1) / 2;
			float th = float_of(mid);
			double c = 0;
			for (uint32_t i = t; i < n; i += T)
				c += v[i] * inv_t >= th ? 1.0 : 0.0;
			if (block_sum(c, sh) >= (double)top_k)
				lo = mid;
			else
				hi = mid - 1;
		}
		zlo = lo;
	}
	const float zth = zlo ? float_of(zlo) : -INFINITY;
#define WEIGHT(i) (v[(i)] * inv_t >= zth && !isnan(v[(i)]) ? expf(v[(i)] * inv_t - mx) : 0.0f)
	/* top-p: the largest weight threshold whose kept mass still reaches top_p of the total. */
	float wth = 0.0f;
	if (top_p > 0.0f && top_p < 1.0f) {
		double tot = 0;
		for (uint32_t i = t; i < n; i += T)
			tot += WEIGHT(i);
		double need = (double)top_p * block_sum(tot, sh);
		uint32_t lo = 0, hi = ord_of(1.0f); /* weights lie in [0, 1] */
		while (lo < hi) {
			uint32_t mid = lo + (hi - lo + 1) / 2;
			float th = float_of(mid);
			double m = 0;
			for (uint32_t i = t; i < n; i += T) {
				float w = WEIGHT(i);
				m += w >= th ? w : 0.0f;
			}
			if (block_sum(m, sh) >= need)
				lo = mid;
			else
				hi = mid - 1;
		}
		wth = float_of(lo);
		if (wth < 0.0f)
			wth = 0.0f;
	}
	if (min_p > 0.0f)
		wth = fmaxf(wth, fminf(min_p, 1.0f));
	/* The draw: each thread owns a contiguous run of ids; prefix sums across the block. */
	uint32_t per = (n + T - 1) / T, a = t * per, b = a + per < n ? a + per : n;
	double mine = 0;
	int32_t last = -1;
	for (uint32_t i = a; i < b; i++) {
		float w = WEIGHT(i);
		if (w > 0.0f && w >= wth) {
			mine += w;
			last = (int32_t)i;
		}
	}
	pre[t] = mine;
	__syncthreads();
	if (t == 0) {
		double run = 0;
		for (uint32_t i = 0; i < T; i++) {
			double x = pre[i];
			pre[i] = run;
			run += x;
		}
		sh[0] = run;
	}
	__syncthreads();
	double total = sh[0], target = u * total;
	if (mine > 0 && target >= pre[t] && (target < pre[t] + mine || (t == T - 1 || pre[t] + mine >= total))) {
		double run = pre[t];
		int32_t pick = last;
		for (uint32_t i = a; i < b; i++) {
			float w = WEIGHT(i);
			if (w > 0.0f && w >= wth) {
				run += w;
				if (target < run) {
					pick = (int32_t)i;
					break;
				}
			}
		}
		st->token = pick;
	}
#undef WEIGHT
}

/* ---- GEMV (one token) ------------------------------------------------------------------- */

enum gemv_mode {
	GEMV_STORE = 0,	  /* out[part][o] = y */
	GEMV_ADD = 1,	  /* out[0][o] += y (residual) */
	GEMV_SWIGLU = 2,  /* act[o] = silu(W0 x) * (W1 x), in the weight dtype */
};

struct gemv_args {
	const void *w[3];	/* (rows[p], in) row-major */
	float *out[3];
	uint32_t rows[3];
	uint32_t total;		/* rows over all parts (SWIGLU: rows of one) */
	uint32_t in8;		/* in / 8: 16-byte chunks per row */
	const void *x;		/* (in) in the weight dtype */
	void *act;		/* SWIGLU output */
};

__device__ __forceinline__ void dot8(float &acc, const uint4 &w, const uint4 &x, __nv_bfloat16)
{
	const __nv_bfloat162 *wp = reinterpret_cast<const __nv_bfloat162 *>(&w);
	const __nv_bfloat162 *xp = reinterpret_cast<const __nv_bfloat162 *>(&x);
#pragma unroll
	for (int k = 0; k < 4; k++) {
		float2 a = to_f32x2(wp[k]), b = to_f32x2(xp[k]);
		acc = fmaf(a.x, b.x, acc);
		acc = fmaf(a.y, b.y, acc);
	}
}

__device__ __forceinline__ void dot8(float &acc, const uint4 &w, const uint4 &x, __half)
{
	const __half2 *wp = reinterpret_cast<const __half2 *>(&w);
	const __half2 *xp = reinterpret_cast<const __half2 *>(&x);
#pragma unroll
	for (int k = 0; k < 4; k++) {
		float2 a = to_f32x2(wp[k]), b = to_f32x2(xp[k]);
		acc = fmaf(a.x, b.x, acc);
		acc = fmaf(a.y, b.y, acc);
	}
}

/* Each warp computes R output rows: lanes stride the rows in 16-byte chunks, GEMV_UNROLL loads
 * per row in flight (weights are read once per token: streaming loads; x stays in L1 and is
 * shared by the R rows). The sums run in the same order for any R. */
template <typename T, int MODE, int R>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_kernel(const gemv_args a)
{
	const uint32_t warp = blockIdx.x * GEMV_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
	const uint32_t row0 = warp * R;
	if (row0 >= a.total)
		return;
	const uint32_t in8 = a.in8;
	const uint4 *wr[R], *ur[R];
	float *dst[R];
	uint32_t orow[R];
	bool live[R];
#pragma unroll
	for (int r = 0; r < R; r++) {
		live[r] = row0 + r < a.total;
		uint32_t p = 0, o = live[r] ? row0 + r : row0;
		if (MODE != GEMV_SWIGLU)
			while (p < 2 && o >= a.rows[p])
				o -= a.rows[p++];
		/* Branches, not a.w[p]: a run-time index into the parameters would copy them to
		 * local memory. */
		const void *wp = p == 0 ? a.w[0] : p == 1 ? a.w[1] : a.w[2];
		wr[r] = (const uint4 *)wp + (size_t)o * in8;
		ur[r] = MODE == GEMV_SWIGLU ? (const uint4 *)a.w[1] + (size_t)o * in8 : wr[r];
		dst[r] = p == 0 ? a.out[0] : p == 1 ? a.out[1] : a.out[2];
		orow[r] = o;
	}
	const uint4 *x = (const uint4 *)a.x;
	float s[R][2], u[R][2];
#pragma unroll
	for (int r = 0; r < R; r++)
		s[r][0] = s[r][1] = u[r][0] = u[r][1] = 0.0f;
	uint32_t c = lane;
	for (; c + 32 * (GEMV_UNROLL - 1) < in8; c += 32 * GEMV_UNROLL) {
		uint4 xv[GEMV_UNROLL], wv[R][GEMV_UNROLL], uv[R][GEMV_UNROLL];
#pragma unroll
		for (int r = 0; r < R; r++)
#pragma unroll
			for (int i = 0; i < GEMV_UNROLL; i++) {
				wv[r][i] = __ldcs(wr[r] + c + 32 * i);
				uv[r][i] = MODE == GEMV_SWIGLU ? __ldcs(ur[r] + c + 32 * i) : wv[r][i];
			}
#pragma unroll
		for (int i = 0; i < GEMV_UNROLL; i++)
			xv[i] = __ldg(x + c + 32 * i);
#pragma unroll
		for (int r = 0; r < R; r++)
#pragma unroll
			for (int i = 0; i < GEMV_UNROLL; i++) {
				dot8(s[r][i % 2], wv[r][i], xv[i], T());
				if (MODE == GEMV_SWIGLU)
					dot8(u[r][i % 2], uv[r][i], xv[i], T());
			}
	}
	for (; c < in8; c += 32) {
		uint4 xv = __ldg(x + c);
#pragma unroll
		for (int r = 0; r < R; r++) {
			dot8(s[r][0], __ldcs(wr[r] + c), xv, T());
			if (MODE == GEMV_SWIGLU)
				dot8(u[r][0], __ldcs(ur[r] + c), xv, T());
		}
	}
#pragma unroll
	for (int r = 0; r < R; r++) {
		float sr = warp_sum(s[r][0] + s[r][1]);
		float su = MODE == GEMV_SWIGLU ? warp_sum(u[r][0] + u[r][1]) : 0.0f;
		if (lane == 0 && live[r]) {
			if (MODE == GEMV_STORE)
				dst[r][orow[r]] = sr;
			else if (MODE == GEMV_ADD)
				a.out[0][orow[r]] = __fadd_rn(a.out[0][orow[r]], sr);
			else
				((T *)a.act)[orow[r]] = from_f32<T>(silu_mul(sr, su));
		}
	}
}

/* ---- attention -------------------------------------------------------------------------- */

struct attn_args {
	const float *q;		/* qkv: token t's query heads at t * q_ld */
	uint32_t q_ld;
	const void *arena;
	uint64_t block_elems;
	uint32_t block_tokens, kv_dim;
	const struct kv_span *spans;
	const uint32_t *prefix;	/* (n_spans + 1) key offset of each span in the flattened key list */
	uint32_t n_spans, total_keys, keys_per_split;
	uint32_t n, pos0, n_heads, group, head_dim, window, qtiles;
	float scale;
	float *m, *l, *acc;	/* running state (token, head) */
	float *pm, *pl, *pacc;	/* partial state (split, token, head), NULL with one split */
};

/* Scores of one staged key row against the warp's query (both in shared memory). */
__device__ __forceinline__ float qk_dot(const float *q, const unsigned char *krow, uint32_t hd, __nv_bfloat16)
{
	const uint4 *k = (const uint4 *)krow;
	const float4 *qv = (const float4 *)q;
	float s0 = 0, s1 = 0;
	for (uint32_t c = 0; c < hd / 8; c++) {
		uint4 kv = k[c];
		float4 qa = qv[2 * c], qb = qv[2 * c + 1];
		const __nv_bfloat162 *kp = reinterpret_cast<const __nv_bfloat162 *>(&kv);
		float2 k0 = to_f32x2(kp[0]), k1 = to_f32x2(kp[1]), k2 = to_f32x2(kp[2]), k3 = to_f32x2(kp[3]);
		s0 = fmaf(qa.x, k0.x, s0);
		s1 = fmaf(qa.y, k0.y, s1);
		s0 = fmaf(qa.z, k1.x, s0);
		s1 = fmaf(qa.w, k1.y, s1);
		s0 = fmaf(qb.x, k2.x, s0);
		s1 = fmaf(qb.y, k2.y, s1);
		s0 = fmaf(qb.z, k3.x, s0);
		s1 = fmaf(qb.w, k3.y, s1);
	}
	return s0 + s1;
}

__device__ __forceinline__ float qk_dot(const float *q, const unsigned char *krow, uint32_t hd, float)
{
	const float4 *k = (const float4 *)krow;
	const float4 *qv = (const float4 *)q;
	float s0 = 0, s1 = 0;
	for (uint32_t c = 0; c < hd / 4; c++) {
		float4 kv = k[c], qa = qv[c];
		s0 = fmaf(qa.x, kv.x, s0);
		s1 = fmaf(qa.y, kv.y, s1);
		s0 = fmaf(qa.z, kv.z, s0);
		s1 = fmaf(qa.w, kv.w, s1);
	}
	return s0 + s1;
}

__device__ __forceinline__ float2 v_pair(const unsigned char *vrow, uint32_t d, __nv_bfloat16)
{
	return to_f32x2(*(const __nv_bfloat162 *)(vrow + d * 2));
}

__device__ __forceinline__ float2 v_pair(const unsigned char *vrow, uint32_t d, float)
{
	return *(const float2 *)(vrow + d * 4);
}

/* Bytes of dynamic shared memory of an attention block of nw warps. */
static size_t attn_smem_bytes(uint32_t hd, size_t esize, uint32_t nw)
{
	return ATTN_TILE * (sizeof(uint64_t) + sizeof(uint32_t)) + ATTN_TILE * (hd * esize + 16) +
	       ATTN_TILE * hd * esize + (size_t)nw * hd * sizeof(float);
}

/* The span holding key k: prefix[s] <= k < prefix[s + 1] (a binary search over the spans). */
static __device__ __forceinline__ uint32_t span_of_key(const attn_args &a, uint32_t k)
{
	uint32_t lo = 0, hi = a.n_spans;
	while (hi - lo > 1) {
		uint32_t mid = (lo + hi) / 2;
		if (a.prefix[mid] <= k)
			lo = mid;
		else
			hi = mid;
	}
	return lo;
}

/* grid (n_kv_heads * qtiles, splits), blockDim.x / 32 warps. Block (g, qt) serves the queries
 * (token t, head g * group + j) numbered t * group + j in [qt * warps, (qt + 1) * warps), one
 * warp each; split s covers flattened keys [s * keys_per_split, (s + 1) * keys_per_split). Lane
 * d of a warp holds dims 2d, 2d + 1 of each 64 of the accumulator. */
template <typename KT> __global__ void __launch_bounds__(ATTN_MAX_WARPS * 32) attn_kernel(const attn_args a)
{
	extern __shared__ __align__(16) unsigned char smem[];
	__shared__ uint32_t s_cursor;
	__shared__ int s_any;
	const uint32_t nw = blockDim.x / 32, w = threadIdx.x / 32, lane = threadIdx.x % 32;
	const uint32_t g = blockIdx.x / a.qtiles, qt = blockIdx.x % a.qtiles, split = blockIdx.y;
	const uint32_t hd = a.head_dim, pairs_g = a.n * a.group;
	const size_t krow_bytes = hd * sizeof(KT) + 16, vrow_bytes = hd * sizeof(KT); /* +16: no bank conflicts */

	uint64_t *koff = (uint64_t *)smem;			/* (TILE) element offset of each key's K row */
	uint32_t *kpos = (uint32_t *)(koff + ATTN_TILE);	/* (TILE) its position, UINT32_MAX: none */
	unsigned char *ks = (unsigned char *)(kpos + ATTN_TILE); /* (TILE, krow_bytes) */
	unsigned char *vs = ks + ATTN_TILE * krow_bytes;	/* (TILE, vrow_bytes) */
	float *qs = (float *)(vs + ATTN_TILE * vrow_bytes);	/* (warps, hd) */

	const uint32_t k0 = split * a.keys_per_split;
	const uint32_t k1 = min(k0 + a.keys_per_split, a.total_keys);
	/* The block's queries: for the tile skip test. */
	const uint32_t lp0 = qt * nw, lp1 = min(lp0 + nw, pairs_g);
	const uint32_t qlo = a.pos0 + lp0 / a.group, qhi = a.pos0 + (lp1 - 1) / a.group;

	const uint32_t lp = lp0 + w;
	const bool active = lp < pairs_g;
	const uint32_t t = active ? lp / a.group : 0, h = g * a.group + (active ? lp % a.group : 0);
	const uint32_t qpos = a.pos0 + t;
	const size_t pair = (size_t)t * a.n_heads + h;
	float *qw = qs + (size_t)w * hd;
	float m = -INFINITY, l = 0.0f;
	float2 acc[MAX_HEAD_DIM / 64];
#pragma unroll
	for (int j = 0; j < MAX_HEAD_DIM / 64; j++)
		acc[j] = make_float2(0.0f, 0.0f);
	if (active) {
		for (uint32_t d = lane; d < hd; d += 32)
			qw[d] = a.q[(size_t)t * a.q_ld + (size_t)h * hd + d];
		if (!a.pm) {
			m = a.m[pair];
			l = a.l[pair];
#pragma unroll
			for (int j = 0; j < MAX_HEAD_DIM / 64; j++) {
				uint32_t d = 64 * j + 2 * lane;
				if (d < hd)
					acc[j] = *(const float2 *)(a.acc + pair * hd + d);
			}
		}
	}
	if (threadIdx.x == 0)
		s_cursor = span_of_key(a, k0);
	__syncthreads();

	for (uint32_t kb = k0; kb < k1; kb += ATTN_TILE) {
		if (w == 0) {
			uint32_t key = kb + lane, pos = UINT32_MAX, s = s_cursor;
			uint64_t off = 0;
			if (key < k1) {
				while (key >= a.prefix[s + 1])
					s++;
				struct kv_span sp = a.spans[s];
				uint32_t r = key - a.prefix[s];
				pos = sp.pos0 + r;
				off = sp.block * a.block_elems + (uint64_t)r * a.kv_dim + (uint64_t)g * hd;
			}
			koff[lane] = off;
			kpos[lane] = pos;
			bool any = pos != UINT32_MAX && pos <= qhi && (a.window == 0 || (uint64_t)pos + a.window > qlo);
			unsigned ballot = __ballot_sync(0xffffffffu, any);
			uint32_t last = min(31u, k1 - 1 - kb);
			uint32_t next = __shfl_sync(0xffffffffu, s, last);
			__syncwarp();
			if (lane == 0) {
				s_any = ballot != 0;
				s_cursor = next;
			}
		}
		__syncthreads();
		const bool any = s_any;
		if (any) {
			const uint32_t vecs = (uint32_t)(vrow_bytes / 16);
			for (uint32_t i = threadIdx.x; i < ATTN_TILE * vecs; i += blockDim.x) {
				uint32_t r = i / vecs, c = i % vecs;
				if (kpos[r] == UINT32_MAX)
					continue;
				const KT *kr = (const KT *)a.arena + koff[r];
				const KT *vr = kr + (size_t)a.block_tokens * a.kv_dim;
				*(uint4 *)(ks + r * krow_bytes + c * 16) = ((const uint4 *)kr)[c];
				*(uint4 *)(vs + r * vrow_bytes + c * 16) = ((const uint4 *)vr)[c];
			}
		}
		__syncthreads();
		if (any && active) {
			uint32_t pos = kpos[lane];
			bool vis = pos <= qpos && (a.window == 0 || qpos - pos < a.window);
			float sc = -INFINITY;
			if (vis)
				sc = qk_dot(qw, ks + lane * krow_bytes, hd, KT()) * a.scale;
			float tmax = warp_max(sc);
			if (tmax != -INFINITY) {
				float mnew = fmaxf(m, tmax);
				float corr = expf(m - mnew); /* m = -inf at first: 0 */
				float pr = vis ? expf(sc - mnew) : 0.0f;
				l = l * corr + warp_sum(pr);
#pragma unroll
				for (int j = 0; j < MAX_HEAD_DIM / 64; j++) {
					acc[j].x *= corr;
					acc[j].y *= corr;
				}
				for (uint32_t r = 0; r < ATTN_TILE; r++) {
					float pj = __shfl_sync(0xffffffffu, pr, r);
					if (pj == 0.0f)
						continue;
					const unsigned char *vrow = vs + r * vrow_bytes;
#pragma unroll
					for (int j = 0; j < MAX_HEAD_DIM / 64; j++) {
						uint32_t d = 64 * j + 2 * lane;
						if (d < hd) {
							float2 v = v_pair(vrow, d, KT());
							acc[j].x = fmaf(pj, v.x, acc[j].x);
							acc[j].y = fmaf(pj, v.y, acc[j].y);
						}
					}
				}
				m = mnew;
			}
		}
		__syncthreads();
	}

	if (!active)
		return;
	float *om = a.m, *ol = a.l, *oacc = a.acc;
	size_t slot = pair;
	if (a.pm) {
		om = a.pm;
		ol = a.pl;
		oacc = a.pacc;
		slot = (size_t)split * a.n * a.n_heads + pair;
	}
	if (lane == 0) {
		om[slot] = m;
		ol[slot] = l;
	}
#pragma unroll
	for (int j = 0; j < MAX_HEAD_DIM / 64; j++) {
		uint32_t d = 64 * j + 2 * lane;
		if (d < hd)
			*(float2 *)(oacc + slot * hd + d) = acc[j];
	}
}

/* Folds the splits' partial states into the running state: one block per (token, head). */
__global__ void __launch_bounds__(64) attn_combine_kernel(float *m, float *l, float *acc, const float *pm,
							  const float *pl, const float *pacc, uint32_t pairs,
							  uint32_t splits, uint32_t hd)
{
	const uint32_t pair = blockIdx.x;
	float M = m[pair], mx = M;
	for (uint32_t s = 0; s < splits; s++)
		mx = fmaxf(mx, pm[(size_t)s * pairs + pair]);
	if (mx == -INFINITY)
		return; /* nothing seen yet, nothing new */
	float wM = M == -INFINITY ? 0.0f : expf(M - mx);
	for (uint32_t d = threadIdx.x; d < hd; d += blockDim.x) {
		float v = acc[(size_t)pair * hd + d] * wM;
		for (uint32_t s = 0; s < splits; s++) {
			float ms = pm[(size_t)s * pairs + pair];
			if (ms != -INFINITY)
				v = fmaf(pacc[((size_t)s * pairs + pair) * hd + d], expf(ms - mx), v);
		}
		acc[(size_t)pair * hd + d] = v;
	}
	__syncthreads(); /* every thread has read m[pair] before it changes */
	if (threadIdx.x == 0) {
		float L = l[pair] * wM;
		for (uint32_t s = 0; s < splits; s++) {
			float ms = pm[(size_t)s * pairs + pair];
			if (ms != -INFINITY)
				L = fmaf(pl[(size_t)s * pairs + pair], expf(ms - mx), L);
		}
		m[pair] = mx;
		l[pair] = L;
	}
}

/* ---- attention on tensor cores (prefill, BF16 KV) --------------------------------------- */

__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
		     "{%0,%1,%2,%3};\n"
		     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two floats as a bf16 pair, lo in the low half (the lower column / key of a fragment). */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
	__nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
	return *reinterpret_cast<uint32_t *>(&v);
}

/* The same online softmax as attn_kernel, with S = Q K^T and O += P V on the tensor cores
 * (mma.sync m16n8k16, bf16 in, float32 accumulate; P is rounded to bf16 for the second
 * product, as flash attention does). grid (n_kv_heads * qtiles, splits), 4 warps. Block (g, qt)
 * serves the 64 queries numbered t * group + j in [qt * 64, qt * 64 + 64) of KV head g; warp w
 * holds rows 16w .. 16w + 15 of them. Fragment layouts are PTX's for m16n8k16: lane = 4 * gid +
 * tig; an accumulator holds rows gid and gid + 8, columns 2 tig and 2 tig + 1 of its 8-wide tile. */
template <int HD> __global__ void __launch_bounds__(128) attn_mma_kernel(const attn_args a)
{
	constexpr int STRIDE = HD + 8;		/* staged row in bf16 elements: +16 bytes, no bank conflicts */
	constexpr int KSTEPS = HD / 16;		/* k-steps of S = Q K^T */
	constexpr int DTILES = HD / 8;		/* 8-wide column tiles of O */
	constexpr int STILES = MMA_KEYS / 8;	/* 8-wide column tiles of S */
	constexpr int VECS = HD / 8;		/* 16-byte vectors per K or V row */
	__shared__ __align__(16) uint16_t ks[MMA_KEYS * STRIDE];
	__shared__ __align__(16) uint16_t vs[MMA_KEYS * STRIDE];
	__shared__ uint64_t koff[MMA_KEYS];
	__shared__ uint32_t kpos[MMA_KEYS];
	__shared__ uint32_t s_cursor;
	__shared__ int s_any;

	const uint32_t w = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
	const uint32_t g = blockIdx.x / a.qtiles, qt = blockIdx.x % a.qtiles, split = blockIdx.y;
	const uint32_t pairs_g = a.n * a.group;
	const uint32_t k0 = split * a.keys_per_split;
	const uint32_t k1 = min(k0 + a.keys_per_split, a.total_keys);
	const uint32_t lp0 = qt * MMA_ROWS, lp1 = min(lp0 + MMA_ROWS, pairs_g);
	const uint32_t qlo = a.pos0 + lp0 / a.group, qhi = a.pos0 + (lp1 - 1) / a.group;

	/* This thread's two rows: 16w + gid (r = 0) and 16w + gid + 8 (r = 1). */
	bool valid[2];
	uint32_t qpos[2];
	size_t pair[2];
	uint32_t qa[KSTEPS][4];
#pragma unroll
	for (int r = 0; r < 2; r++) {
		uint32_t lp = lp0 + 16 * w + gid + 8 * r;
		valid[r] = lp < pairs_g;
		uint32_t t = valid[r] ? lp / a.group : 0, h = g * a.group + (valid[r] ? lp % a.group : 0);
		qpos[r] = a.pos0 + t;
		pair[r] = (size_t)t * a.n_heads + h;
		const float *qrow = a.q + (size_t)t * a.q_ld + (size_t)h * HD;
#pragma unroll
		for (int kk = 0; kk < KSTEPS; kk++) {
			float2 lo = make_float2(0.0f, 0.0f), hi = lo;
			if (valid[r]) {
				lo = *(const float2 *)(qrow + 16 * kk + 2 * tig);
				hi = *(const float2 *)(qrow + 16 * kk + 8 + 2 * tig);
			}
			qa[kk][r] = pack_bf16(lo.x, lo.y);	/* a0 (row gid) / a1 (row gid + 8) */
			qa[kk][2 + r] = pack_bf16(hi.x, hi.y);	/* a2 / a3: columns + 8 */
		}
	}
	float o[DTILES][4], m[2], l[2];
#pragma unroll
	for (int r = 0; r < 2; r++) {
		m[r] = -INFINITY;
		l[r] = 0.0f;
		if (!a.pm && valid[r]) {
			/* Fold into the running state: l is kept per thread and summed over the four
			 * threads of a row at the end, so one of them starts with it. */
			m[r] = a.m[pair[r]];
			l[r] = tig == 0 ? a.l[pair[r]] : 0.0f;
		}
	}
#pragma unroll
	for (int dt = 0; dt < DTILES; dt++)
#pragma unroll
		for (int r = 0; r < 2; r++) {
			float2 v = make_float2(0.0f, 0.0f);
			if (!a.pm && valid[r])
				v = *(const float2 *)(a.acc + pair[r] * HD + dt * 8 + 2 * tig);
			o[dt][2 * r] = v.x;
			o[dt][2 * r + 1] = v.y;
		}

	if (threadIdx.x == 0)
		s_cursor = span_of_key(a, k0);
	__syncthreads();

	for (uint32_t kb = k0; kb < k1; kb += MMA_KEYS) {
		if (w == 0) {
			/* Each lane places keys kb + lane and kb + 32 + lane. */
			uint32_t s = s_cursor;
			bool any = false;
#pragma unroll
			for (int i = 0; i < 2; i++) {
				uint32_t key = kb + 32 * i + lane, pos = UINT32_MAX;
				uint64_t off = 0;
				if (key < k1) {
					while (key >= a.prefix[s + 1])
						s++;
					struct kv_span sp = a.spans[s];
					uint32_t r = key - a.prefix[s];
					pos = sp.pos0 + r;
					off = sp.block * a.block_elems + (uint64_t)r * a.kv_dim + (uint64_t)g * HD;
				}
				koff[32 * i + lane] = off;
				kpos[32 * i + lane] = pos;
				any |= pos != UINT32_MAX && pos <= qhi && (a.window == 0 || (uint64_t)pos + a.window > qlo);
			}
			unsigned ballot = __ballot_sync(0xffffffffu, any);
			uint32_t last = min((uint32_t)MMA_KEYS - 1, k1 - 1 - kb);
			uint32_t next = __shfl_sync(0xffffffffu, s, last % 32);
			__syncwarp();
			if (lane == 0) {
				s_any = ballot != 0;
				s_cursor = next;
			}
		}
		__syncthreads();
		const bool any = s_any;
		if (any) {
			for (uint32_t i = threadIdx.x; i < MMA_KEYS * VECS; i += blockDim.x) {
				uint32_t r = i / VECS, c = i % VECS;
				uint4 kv = make_uint4(0, 0, 0, 0), vv = kv; /* zeros: P is 0 there, V must not be NaN */
				if (kpos[r] != UINT32_MAX) {
					const __nv_bfloat16 *kr = (const __nv_bfloat16 *)a.arena + koff[r];
					kv = ((const uint4 *)kr)[c];
					vv = ((const uint4 *)(kr + (size_t)a.block_tokens * a.kv_dim))[c];
				}
				*(uint4 *)(ks + r * STRIDE + c * 8) = kv;
				*(uint4 *)(vs + r * STRIDE + c * 8) = vv;
			}
		}
		__syncthreads();
		if (any) {
			float sc[STILES][4];
#pragma unroll
			for (int j = 0; j < STILES; j++) {
				sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
				for (int kk = 0; kk < KSTEPS; kk++) {
					/* B = K^T: column gid is key 8j + gid, rows 2 tig (+1) and + 8. */
					const uint16_t *kr = ks + (8 * j + gid) * STRIDE + 16 * kk + 2 * tig;
					mma_bf16(sc[j], qa[kk], *(const uint32_t *)kr, *(const uint32_t *)(kr + 8));
				}
			}
			float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
			for (int j = 0; j < STILES; j++)
#pragma unroll
				for (int e = 0; e < 4; e++) {
					const int r = e / 2;
					uint32_t pos = kpos[8 * j + 2 * tig + (e & 1)];
					bool vis = valid[r] && pos <= qpos[r] && (a.window == 0 || qpos[r] - pos < a.window);
					sc[j][e] = vis ? sc[j][e] * a.scale : -INFINITY;
					mx[r] = fmaxf(mx[r], sc[j][e]);
				}
			float corr[2], mref[2];
#pragma unroll
			for (int r = 0; r < 2; r++) {
				mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
				mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
				float mnew = fmaxf(m[r], mx[r]);
				/* Nothing visible to the row yet: leave it as it is. */
				corr[r] = mnew == -INFINITY ? 1.0f : expf(m[r] - mnew);
				mref[r] = mnew == -INFINITY ? 0.0f : mnew;
				m[r] = mnew;
			}
			float ls[2] = {0.0f, 0.0f};
#pragma unroll
			for (int j = 0; j < STILES; j++)
#pragma unroll
				for (int e = 0; e < 4; e++) {
					float pr = expf(sc[j][e] - mref[e / 2]);
					sc[j][e] = pr;
					ls[e / 2] += pr;
				}
#pragma unroll
			for (int r = 0; r < 2; r++)
				l[r] = l[r] * corr[r] + ls[r];
#pragma unroll
			for (int dt = 0; dt < DTILES; dt++)
#pragma unroll
				for (int e = 0; e < 4; e++)
					o[dt][e] *= corr[e / 2];
#pragma unroll
			for (int kk = 0; kk < MMA_KEYS / 16; kk++) {
				/* A = P: the S accumulators of key tiles 2kk and 2kk + 1. */
				uint32_t pa[4] = {pack_bf16(sc[2 * kk][0], sc[2 * kk][1]), pack_bf16(sc[2 * kk][2], sc[2 * kk][3]),
						  pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
						  pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
				for (int dt = 0; dt < DTILES; dt++) {
					/* B = V: column gid is dim 8dt + gid, rows keys 16kk + 2tig (+1), + 8 (+9). */
					const uint16_t *vr = vs + (16 * kk + 2 * tig) * STRIDE + 8 * dt + gid;
					uint32_t b0 = (uint32_t)vr[0] | (uint32_t)vr[STRIDE] << 16;
					uint32_t b1 = (uint32_t)vr[8 * STRIDE] | (uint32_t)vr[9 * STRIDE] << 16;
					mma_bf16(o[dt], pa, b0, b1);
				}
			}
		}
		__syncthreads();
	}

#pragma unroll
	for (int r = 0; r < 2; r++) {
		l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
		l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
	}
	float *om = a.m, *ol = a.l, *oacc = a.acc;
	size_t base = 0;
	if (a.pm) {
		om = a.pm;
		ol = a.pl;
		oacc = a.pacc;
		base = (size_t)split * a.n * a.n_heads;
	}
#pragma unroll
	for (int r = 0; r < 2; r++) {
		if (!valid[r])
			continue;
		size_t slot = base + pair[r];
		if (tig == 0) {
			om[slot] = m[r];
			ol[slot] = l[r];
		}
#pragma unroll
		for (int dt = 0; dt < DTILES; dt++)
			*(float2 *)(oacc + slot * HD + dt * 8 + 2 * tig) = make_float2(o[dt][2 * r], o[dt][2 * r + 1]);
	}
}

/* ---- host: staging ring ----------------------------------------------------------------- */

static int up_wait_oldest(struct backend *be)
{
	struct upload_ring *u = &be->up;
	assert(u->count > 0);
	cudaError_t e = cudaEventQuery(u->ev[u->first]);
	if (e == cudaErrorNotReady)
		e = cudaEventSynchronize(u->ev[u->first]);
	if (e != cudaSuccess)
		return cuda_fail(be, e, "waiting for an upload from the staging ring");
	u->first = (u->first + 1) % UPLOAD_EVENTS;
	u->count--;
	return 0;
}

/* A region of `size` bytes of the pinned ring that no pending copy reads; *off is where it
 * starts. Follow with up_commit once the copies reading it are queued. */
static int up_alloc(struct backend *be, size_t size, char **out, size_t *off)
{
	struct upload_ring *u = &be->up;
	size = (size + UPLOAD_ALIGN - 1) / UPLOAD_ALIGN * UPLOAD_ALIGN;
	if (size > u->cap) {
		/* Rare (a request larger than the ring was sized for): drain and grow. */
		while (u->count) {
			int rc = up_wait_oldest(be);
			if (rc)
				return rc;
		}
		size_t cap = size > 2 * u->cap ? size : 2 * u->cap;
		char *host = NULL;
		CUDA_TRY(be, "cudaMallocHost (staging ring)", cudaMallocHost((void **)&host, cap));
		cudaFreeHost(u->host);
		u->host = host;
		u->cap = cap;
		u->head = 0;
	}
	size_t b = u->head + size <= u->cap ? u->head : 0;
	for (;;) {
		bool clash = u->count == UPLOAD_EVENTS;
		for (uint32_t k = 0; k < u->count && !clash; k++) {
			uint32_t i = (u->first + k) % UPLOAD_EVENTS;
			clash = b < u->end[i] && u->beg[i] < b + size;
		}
		if (!clash)
			break;
		int rc = up_wait_oldest(be);
		if (rc)
			return rc;
	}
	u->head = b + size;
	*out = u->host + b;
	*off = b;
	return 0;
}

/* Marks [off, off + size) busy until the copies queued so far have run. */
static int up_commit(struct backend *be, size_t off, size_t size)
{
	struct upload_ring *u = &be->up;
	assert(u->count < UPLOAD_EVENTS);
	uint32_t i = (u->first + u->count) % UPLOAD_EVENTS;
	CUDA_TRY(be, "cudaEventRecord (staging ring)", cudaEventRecord(u->ev[i], be->stream));
	u->beg[i] = off;
	u->end[i] = off + (size + UPLOAD_ALIGN - 1) / UPLOAD_ALIGN * UPLOAD_ALIGN;
	u->count++;
	return 0;
}

/* ---- host: matrix products -------------------------------------------------------------- */

static cudaDataType_t cuda_type(uint32_t dt)
{
	return dt == DT_BF16 ? CUDA_R_16BF : dt == DT_F16 ? CUDA_R_16F : CUDA_R_32F;
}

struct mm_part {
	const void *w;	/* (rows, in) row-major, device memory */
	uint32_t rows;
	float *out;	/* (n, ldc) token-major float32 */
};

/* The GEMV kernel takes it: one token, 16-bit weights, 16-byte rows and pointers. */
static bool gemv_fits(const struct backend *be, uint32_t wt, uint32_t in, const struct mm_part *parts, uint32_t np)
{
	if (!be->gemv_rows || wt == DT_F32 || in % 8)
		return false;
	for (uint32_t i = 0; i < np; i++)
		if ((uintptr_t)parts[i].w % 16)
			return false;
	return true;
}

template <typename T, int R> static void gemv_launch_r(const gemv_args &g, int mode, cudaStream_t s)
{
	uint32_t blocks = (g.total + GEMV_WARPS * R - 1) / (GEMV_WARPS * R);
	if (mode == GEMV_STORE)
		gemv_kernel<T, GEMV_STORE, R><<<blocks, GEMV_WARPS * 32, 0, s>>>(g);
	else if (mode == GEMV_ADD)
		gemv_kernel<T, GEMV_ADD, R><<<blocks, GEMV_WARPS * 32, 0, s>>>(g);
	else
		gemv_kernel<T, GEMV_SWIGLU, R><<<blocks, GEMV_WARPS * 32, 0, s>>>(g);
}

template <typename T> static void gemv_launch(const struct backend *be, const gemv_args &g, int mode)
{
	if (be->gemv_rows == 2)
		gemv_launch_r<T, 2>(g, mode, be->stream);
	else
		gemv_launch_r<T, 1>(g, mode, be->stream);
}

static int gemm(struct backend *be, uint32_t wt, const struct mm_part *pt, const void *x, uint32_t in, uint32_t n,
		uint32_t ldc, bool add, const char *what)
{
	const float alpha = 1.0f, beta = add ? 1.0f : 0.0f;
	cublasComputeType_t ct = wt == DT_F32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
	cublasStatus_t st = cublasGemmEx(be->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)pt->rows, (int)n, (int)in, &alpha,
					 pt->w, cuda_type(wt), (int)in, x, cuda_type(wt), (int)in, &beta, pt->out,
					 CUDA_R_32F, (int)ldc, ct, CUBLAS_GEMM_DEFAULT);
	if (st != CUBLAS_STATUS_SUCCESS)
		return fail(be, -EIO, "cuda backend: cublasGemmEx (%s: %u x %u, %u tokens) failed: %s", what, pt->rows,
			    in, n, cublasGetStatusString(st));
	return 0;
}

/* out_p[t] (+)= W_p x[t] for the parts, x (n, in) in dtype wt (device memory). */
static int matmul(struct backend *be, uint32_t wt, const void *x, uint32_t in, uint32_t n, const struct mm_part *parts,
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
		if (wt == DT_BF16)
			gemv_launch<__nv_bfloat16>(be, g, add ? GEMV_ADD : GEMV_STORE);
		else
			gemv_launch<__half>(be, g, add ? GEMV_ADD : GEMV_STORE);
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

/* ---- host: launches of the small kernels ------------------------------------------------ */

/* A kernel of one block per token runs few blocks in decode: give each block more threads. */
static bool small_grid(uint32_t blocks)
{
	return blocks < 32;
}

/* RMSNorm of rows [row0, row0 + rows) of x into be->xa (from its start) in dtype ot. */
static int rmsnorm(struct backend *be, const void *w, uint32_t wt, uint32_t row0, uint32_t rows, uint32_t ot)
{
	const float *x = be->x + (size_t)row0 * be->cfg.dim;
	uint32_t dim = be->cfg.dim;
	float eps = be->cfg.rms_eps;
	unsigned threads = small_grid(rows) ? 1024 : 256;
	if (ot == DT_BF16)
		rmsnorm_kernel<__nv_bfloat16><<<rows, threads, 0, be->stream>>>(x, w, wt, dim, eps,
										(__nv_bfloat16 *)be->xa);
	else if (ot == DT_F16)
		rmsnorm_kernel<__half><<<rows, threads, 0, be->stream>>>(x, w, wt, dim, eps, (__half *)be->xa);
	else
		rmsnorm_kernel<float><<<rows, threads, 0, be->stream>>>(x, w, wt, dim, eps, (float *)be->xa);
	LAUNCHED(be, "rmsnorm_kernel");
	return 0;
}

static unsigned grid_for(size_t count, unsigned threads)
{
	size_t b = (count + threads - 1) / threads;
	return b > 4096 ? 4096 : (unsigned)(b ? b : 1);
}

/* ---- operations ------------------------------------------------------------------------- */

static int check_roles(struct backend *be, const struct group_weights *w, const enum tensor_role *roles,
		       uint32_t n, const char *what)
{
	for (uint32_t i = 0; i < n; i++) {
		enum tensor_role r = roles[i];
		if (!w->t[r])
			return fail(be, -EINVAL, "cuda backend: %s: weights have no %s tensor", what,
				    tensor_role_name(r));
		if (w->dtype[r] >= DT_COUNT)
			return fail(be, -EINVAL, "cuda backend: %s: %s tensor has unknown dtype %u", what,
				    tensor_role_name(r), w->dtype[r]);
	}
	return 0;
}

/* The matrices of one product chain share a dtype (the activations are converted once). */
static int check_same_dtype(struct backend *be, const struct group_weights *w, const enum tensor_role *roles,
			    uint32_t n, const char *what)
{
	for (uint32_t i = 1; i < n; i++)
		if (w->dtype[roles[i]] != w->dtype[roles[0]])
			return fail(be, -ENOTSUP, "cuda backend: %s: %s is %s but %s is %s: mixed matrix dtypes are "
				    "not supported", what, tensor_role_name(roles[i]),
				    dtype_name((enum dtype)w->dtype[roles[i]]), tensor_role_name(roles[0]),
				    dtype_name((enum dtype)w->dtype[roles[0]]));
	return 0;
}

static size_t cuda_kv_block_bytes(const struct model_config *cfg, const struct backend_params *p)
{
	return 2 * (size_t)p->block_tokens * cfg->n_kv_heads * cfg->head_dim * dtype_size((enum dtype)p->kv_dtype);
}

/* Synchronous for now: the copy is queued behind the compute that wrote the block and waited
 * for, so the host buffer is complete (kv_to_host) or free again (kv_from_host) on return. A
 * later change makes these asynchronous with events. */
static int cuda_kv_to_host(struct backend *be, uint32_t block, void *dst)
{
	if (block >= be->p.n_kv_blocks)
		return fail(be, -EINVAL, "cuda backend: kv_to_host: block %u is outside the arena of %u blocks", block,
			    be->p.n_kv_blocks);
	size_t bytes = be->block_elems * be->kv_esize;
	CUDA_TRY(be, "cudaMemcpyAsync (kv_to_host)",
		 cudaMemcpyAsync(dst, (char *)be->arena + block * bytes, bytes, cudaMemcpyDeviceToHost, be->stream));
	CUDA_TRY(be, "cudaStreamSynchronize (kv_to_host)", cudaStreamSynchronize(be->stream));
	return 0;
}

/* The batch of a layer's commit: every copy queued behind the compute that wrote the blocks,
 * then one wait. */
static int cuda_kv_to_host_n(struct backend *be, uint32_t n, const uint32_t *blocks, void *const *dsts)
{
	size_t bytes = be->block_elems * be->kv_esize;
	for (uint32_t i = 0; i < n; i++) {
		if (blocks[i] >= be->p.n_kv_blocks)
			return fail(be, -EINVAL, "cuda backend: kv_to_host_n: block %u is outside the arena of %u blocks",
				    blocks[i], be->p.n_kv_blocks);
		CUDA_TRY(be, "cudaMemcpyAsync (kv_to_host_n)",
			 cudaMemcpyAsync(dsts[i], (char *)be->arena + blocks[i] * bytes, bytes, cudaMemcpyDeviceToHost,
					 be->stream));
	}
	CUDA_TRY(be, "cudaStreamSynchronize (kv_to_host_n)", cudaStreamSynchronize(be->stream));
	return 0;
}

/* Interprocess events for the KV write-behind, created on first use and re-recorded
 * round-robin (ARCHITECTURE.md: re-record rather than recreate; the importer keeps them). */
#define KV_IPC_EVENTS (2 * KV_EVENTS_IN_FLIGHT)
static cudaEvent_t kv_ipc_event[KV_IPC_EVENTS];
static cudaIpcEventHandle_t kv_ipc_handle[KV_IPC_EVENTS];
static uint32_t kv_ipc_next;

/* Before the compute stream writes arena blocks (new rows, copies from the pool) or orders the
 * read-ahead behind itself: it waits for the write-behind copies still reading those blocks.
 * One wait covers them all (the copies are in order on one stream). */
static int kv_d2h_guard(struct backend *be, uint32_t n, const uint32_t *blocks)
{
	if (!be->kv_d2h_ev)
		return 0;
	uint64_t best = 0;
	int32_t ev = -1;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t b = blocks[i];
		if (b >= be->p.n_kv_blocks || be->kv_d2h_ev[b] < 0)
			continue;
		if (be->kv_d2h_seq[b] >= best) {
			best = be->kv_d2h_seq[b];
			ev = be->kv_d2h_ev[b];
		}
		be->kv_d2h_ev[b] = -1;
	}
	if (ev >= 0)
		CUDA_TRY(be, "cudaStreamWaitEvent (KV write-behind)", cudaStreamWaitEvent(be->stream, kv_ipc_event[ev], 0));
	return 0;
}

/* The write-behind: copies on a low-priority stream of their own, behind the compute that wrote
 * the blocks; the compute stream goes on, and waits for them only where it reuses one of the
 * blocks (kv_d2h_guard). The interprocess event after them goes to the kv-store. */
static int cuda_kv_to_host_async(struct backend *be, uint32_t n, const uint32_t *blocks, void *const *dsts,
				 void *event_handle)
{
	size_t bytes = be->block_elems * be->kv_esize;
	for (uint32_t i = 0; i < n; i++)
		if (blocks[i] >= be->p.n_kv_blocks)
			return fail(be, -EINVAL, "cuda backend: kv_to_host_async: block %u is outside the arena of %u blocks",
				    blocks[i], be->p.n_kv_blocks);
	if (!be->kv_d2h) {
		int least = 0, greatest = 0;
		CUDA_TRY(be, "cudaDeviceGetStreamPriorityRange", cudaDeviceGetStreamPriorityRange(&least, &greatest));
		CUDA_TRY(be, "cudaStreamCreateWithPriority (KV D2H)",
			 cudaStreamCreateWithPriority(&be->kv_d2h, cudaStreamNonBlocking, least));
		CUDA_TRY(be, "cudaEventCreateWithFlags (KV D2H order)",
			 cudaEventCreateWithFlags(&be->kv_d2h_order, cudaEventDisableTiming));
		be->kv_d2h_ev = (int32_t *)malloc(sizeof(int32_t) * be->p.n_kv_blocks);
		be->kv_d2h_seq = (uint64_t *)calloc(be->p.n_kv_blocks, sizeof(uint64_t));
		if (!be->kv_d2h_ev || !be->kv_d2h_seq)
			return fail(be, -ENOMEM, "cuda backend: out of memory for the write-behind's table");
		for (uint32_t b = 0; b < be->p.n_kv_blocks; b++)
			be->kv_d2h_ev[b] = -1;
	}
	CUDA_TRY(be, "cudaEventRecord (KV D2H order)", cudaEventRecord(be->kv_d2h_order, be->stream));
	CUDA_TRY(be, "cudaStreamWaitEvent (KV D2H)", cudaStreamWaitEvent(be->kv_d2h, be->kv_d2h_order, 0));
	for (uint32_t i = 0; i < n; i++)
		CUDA_TRY(be, "cudaMemcpyAsync (kv_to_host_async)",
			 cudaMemcpyAsync(dsts[i], (char *)be->arena + blocks[i] * bytes, bytes, cudaMemcpyDeviceToHost,
					 be->kv_d2h));
	uint32_t k = kv_ipc_next++ % KV_IPC_EVENTS;
	if (!kv_ipc_event[k]) {
		CUDA_TRY(be, "cudaEventCreateWithFlags (interprocess)",
			 cudaEventCreateWithFlags(&kv_ipc_event[k], cudaEventInterprocess | cudaEventDisableTiming));
		CUDA_TRY(be, "cudaIpcGetEventHandle", cudaIpcGetEventHandle(&kv_ipc_handle[k], kv_ipc_event[k]));
	}
	CUDA_TRY(be, "cudaEventRecord (kv write-behind)", cudaEventRecord(kv_ipc_event[k], be->kv_d2h));
	be->kv_d2h_batches++;
	for (uint32_t i = 0; i < n; i++) {
		be->kv_d2h_ev[blocks[i]] = (int32_t)k;
		be->kv_d2h_seq[blocks[i]] = be->kv_d2h_batches;
	}
	static_assert(sizeof(cudaIpcEventHandle_t) == KV_EVENT_HANDLE_BYTES, "an IPC event handle is 64 bytes");
	memcpy(event_handle, &kv_ipc_handle[k], KV_EVENT_HANDLE_BYTES);
	return 0;
}

static int cuda_pin_host(struct backend *be, void *p, size_t bytes)
{
	CUDA_TRY(be, "cudaHostRegister", cudaHostRegister(p, bytes, cudaHostRegisterDefault));
	return 0;
}

static void cuda_unpin_host(struct backend *be, void *p)
{
	cudaHostUnregister(p);
}

static int cuda_kv_from_host(struct backend *be, uint32_t block, const void *src)
{
	if (block >= be->p.n_kv_blocks)
		return fail(be, -EINVAL, "cuda backend: kv_from_host: block %u is outside the arena of %u blocks",
			    block, be->p.n_kv_blocks);
	size_t bytes = be->block_elems * be->kv_esize;
	int grc = kv_d2h_guard(be, 1, &block);
	if (grc)
		return grc;
	CUDA_TRY(be, "cudaMemcpyAsync (kv_from_host)",
		 cudaMemcpyAsync((char *)be->arena + block * bytes, src, bytes, cudaMemcpyHostToDevice, be->stream));
	CUDA_TRY(be, "cudaStreamSynchronize (kv_from_host)", cudaStreamSynchronize(be->stream));
	return 0;
}

/* A run of blocks fetched from the pool: every copy queued, then one wait (a wait per block
 * costs more than a small block's copy). */
static int cuda_kv_from_host_n(struct backend *be, uint32_t n, const uint32_t *blocks, const void *const *srcs)
{
	size_t bytes = be->block_elems * be->kv_esize;
	for (uint32_t i = 0; i < n; i++) {
		if (blocks[i] >= be->p.n_kv_blocks)
			return fail(be, -EINVAL, "cuda backend: kv_from_host_n: block %u is outside the arena of %u blocks",
				    blocks[i], be->p.n_kv_blocks);
		int grc = kv_d2h_guard(be, 1, &blocks[i]);
		if (grc)
			return grc;
		CUDA_TRY(be, "cudaMemcpyAsync (kv_from_host_n)",
			 cudaMemcpyAsync((char *)be->arena + blocks[i] * bytes, srcs[i], bytes, cudaMemcpyHostToDevice,
					 be->stream));
	}
	CUDA_TRY(be, "cudaStreamSynchronize (kv_from_host_n)", cudaStreamSynchronize(be->stream));
	return 0;
}

/* The KV read-ahead: copies on a stream of their own, so they run while the compute stream
 * attends the layer before. They start behind everything queued on the compute stream so far:
 * the attention that last read a block they overwrite, and the write-behind copy that saved it. */
static int cuda_kv_prefetch_n(struct backend *be, uint32_t n, const uint32_t *blocks, const void *const *srcs,
			      uint32_t slot)
{
	if (slot > 1)
		return fail(be, -EINVAL, "cuda backend: kv_prefetch_n: slot %u (0 or 1)", slot);
	if (!be->kv_h2d) {
		CUDA_TRY(be, "cudaStreamCreateWithFlags (KV H2D)", cudaStreamCreateWithFlags(&be->kv_h2d, cudaStreamNonBlocking));
		CUDA_TRY(be, "cudaEventCreateWithFlags (KV order)",
			 cudaEventCreateWithFlags(&be->kv_order, cudaEventDisableTiming));
		for (int i = 0; i < 2; i++)
			CUDA_TRY(be, "cudaEventCreateWithFlags (KV read-ahead)",
				 cudaEventCreateWithFlags(&be->kv_done[i], cudaEventDisableTiming));
	}
	size_t bytes = be->block_elems * be->kv_esize;
	for (uint32_t i = 0; i < n; i++)
		if (blocks[i] >= be->p.n_kv_blocks)
			return fail(be, -EINVAL, "cuda backend: kv_prefetch_n: block %u is outside the arena of %u blocks",
				    blocks[i], be->p.n_kv_blocks);
	int grc = kv_d2h_guard(be, n, blocks);
	if (grc)
		return grc;
	CUDA_TRY(be, "cudaEventRecord (KV order)", cudaEventRecord(be->kv_order, be->stream));
	CUDA_TRY(be, "cudaStreamWaitEvent (KV H2D)", cudaStreamWaitEvent(be->kv_h2d, be->kv_order, 0));
	for (uint32_t i = 0; i < n; i++)
		CUDA_TRY(be, "cudaMemcpyAsync (kv_prefetch_n)",
			 cudaMemcpyAsync((char *)be->arena + blocks[i] * bytes, srcs[i], bytes, cudaMemcpyHostToDevice,
					 be->kv_h2d));
	CUDA_TRY(be, "cudaEventRecord (KV read-ahead)", cudaEventRecord(be->kv_done[slot], be->kv_h2d));
	return 0;
}

static int cuda_kv_sync(struct backend *be)
{
	CUDA_TRY(be, "cudaStreamSynchronize (KV sync)", cudaStreamSynchronize(be->stream));
	if (be->kv_d2h)
		CUDA_TRY(be, "cudaStreamSynchronize (KV D2H)", cudaStreamSynchronize(be->kv_d2h));
	if (be->kv_h2d)
		CUDA_TRY(be, "cudaStreamSynchronize (KV H2D)", cudaStreamSynchronize(be->kv_h2d));
	return 0;
}

static int cuda_kv_prefetch_wait(struct backend *be, uint32_t slot)
{
	if (slot > 1)
		return fail(be, -EINVAL, "cuda backend: kv_prefetch_wait: slot %u (0 or 1)", slot);
	if (!be->kv_h2d)
		return 0;
	CUDA_TRY(be, "cudaEventSynchronize (KV read-ahead)", cudaEventSynchronize(be->kv_done[slot]));
	return 0;
}

static int cuda_embed(struct backend *be, const struct group_weights *w, const int32_t *tokens, uint32_t n,
		      uint32_t pos0)
{
	static const enum tensor_role roles[] = {ROLE_EMBED};
	uint32_t dim = be->cfg.dim;
	assert(be && w && (tokens || n == 0));
	int rc = check_roles(be, w, roles, 1, "embed");
	if (rc)
		return rc;
	if (n == 0 || n > be->p.max_chunk)
		return fail(be, -EINVAL, "cuda backend: embed: chunk of %u tokens (must be 1..%u, max_chunk)", n,
			    be->p.max_chunk);
	if ((uint64_t)pos0 + n > UINT32_MAX)
		return fail(be, -EINVAL, "cuda backend: embed: positions %u..%u overflow 32 bits", pos0,
			    pos0 + (n - 1));
	for (uint32_t t = 0; t < n; t++)
		if (tokens[t] < 0 || (uint32_t)tokens[t] >= be->cfg.vocab_size)
			return fail(be, -EINVAL,
				    "cuda backend: embed: token id %d at chunk index %u is outside the vocabulary (0..%u)",
				    tokens[t], t, be->cfg.vocab_size - 1);
	/* Gather the rows on the host (the table is host memory), one copy up, widen on the GPU. */
	uint32_t dt = w->dtype[ROLE_EMBED];
	size_t row = (size_t)dim * dtype_size((enum dtype)dt), bytes = row * n;
	char *h;
	size_t off;
	rc = up_alloc(be, bytes, &h, &off);
	if (rc)
		return rc;
	for (uint32_t t = 0; t < n; t++)
		memcpy(h + t * row, (const char *)w->t[ROLE_EMBED] + (size_t)tokens[t] * row, row);
	CUDA_TRY(be, "cudaMemcpyAsync (embedding rows)",
		 cudaMemcpyAsync(be->xa, h, bytes, cudaMemcpyHostToDevice, be->stream));
	rc = up_commit(be, off, bytes);
	if (rc)
		return rc;
	size_t count = (size_t)n * dim;
	unsigned grid = grid_for(count, 256);
	if (dt == DT_BF16)
		embed_kernel<__nv_bfloat16><<<grid, 256, 0, be->stream>>>((const __nv_bfloat16 *)be->xa, be->x, count);
	else if (dt == DT_F16)
		embed_kernel<__half><<<grid, 256, 0, be->stream>>>((const __half *)be->xa, be->x, count);
	else
		embed_kernel<float><<<grid, 256, 0, be->stream>>>((const float *)be->xa, be->x, count);
	LAUNCHED(be, "embed_kernel");
	be->n = n;
	be->pos0 = pos0;
	be->phase = PHASE_READY;
	return 0;
}

static int cuda_attn_begin(struct backend *be, const struct group_weights *w, uint32_t layer,
			   const uint32_t *dst_block, const uint32_t *dst_row)
{
	static const enum tensor_role roles[] = {ROLE_ATTN_NORM, ROLE_WQ, ROLE_WK, ROLE_WV, ROLE_WO};
	const struct model_config *c = &be->cfg;
	uint32_t n = be->n;
	assert(w && dst_block && dst_row);
	if (be->phase != PHASE_READY)
		return fail(be, -EINVAL, "cuda backend: attn_begin(layer %u) called %s", layer,
			    be->phase == PHASE_IDLE ? "before embed" : "before attn_end of the previous layer");
	if (layer >= c->n_layers)
		return fail(be, -EINVAL, "cuda backend: attn_begin: layer %u of a %u-layer model", layer, c->n_layers);
	int rc = check_roles(be, w, roles, 5, "attention");
	if (rc)
		return rc;
	rc = check_same_dtype(be, w, roles + 1, 4, "attention");
	if (rc)
		return rc;
	for (uint32_t t = 0; t < n; t++)
		if (dst_block[t] >= be->p.n_kv_blocks || dst_row[t] >= be->p.block_tokens)
			return fail(be, -EINVAL, "cuda backend: attn_begin(layer %u): token %u goes to block %u row %u, "
				    "outside the arena (%u blocks of %u rows)", layer, t, dst_block[t], dst_row[t],
				    be->p.n_kv_blocks, be->p.block_tokens);
	if ((rc = kv_d2h_guard(be, n, dst_block)) != 0)
		return rc;

	/* Destinations up first: (2, n) blocks then rows. */
	char *h;
	size_t off, bytes = 2 * (size_t)n * sizeof(uint32_t);
	rc = up_alloc(be, bytes, &h, &off);
	if (rc)
		return rc;
	memcpy(h, dst_block, n * sizeof(uint32_t));
	memcpy(h + n * sizeof(uint32_t), dst_row, n * sizeof(uint32_t));
	CUDA_TRY(be, "cudaMemcpyAsync (KV destinations)",
		 cudaMemcpyAsync(be->dst, h, bytes, cudaMemcpyHostToDevice, be->stream));
	rc = up_commit(be, off, bytes);
	if (rc)
		return rc;

	uint32_t wt = w->dtype[ROLE_WQ];
	rc = rmsnorm(be, w->t[ROLE_ATTN_NORM], w->dtype[ROLE_ATTN_NORM], 0, n, wt);
	if (rc)
		return rc;
	struct mm_part parts[3] = {
		{w->t[ROLE_WQ], be->q_dim, be->qkv},
		{w->t[ROLE_WK], be->kv_dim, be->qkv + be->q_dim},
		{w->t[ROLE_WV], be->kv_dim, be->qkv + be->q_dim + be->kv_dim},
	};
	rc = matmul(be, wt, be->xa, c->dim, n, parts, 3, be->qkv_ld, false, "q/k/v projections");
	if (rc)
		return rc;

	rope_args ra;
	ra.qkv = be->qkv;
	ra.ld = be->qkv_ld;
	ra.inv_freq = be->inv_freq;
	ra.dst = be->dst;
	ra.arena = be->arena;
	ra.block_elems = be->block_elems;
	ra.block_tokens = be->p.block_tokens;
	ra.n_heads = c->n_heads;
	ra.n_kv_heads = c->n_kv_heads;
	ra.head_dim = c->head_dim;
	ra.pos0 = be->pos0;
	ra.n = n;
	ra.m = be->st_m;
	ra.l = be->st_l;
	ra.acc = be->st_acc;
	unsigned threads = small_grid(n) ? 512 : 128;
	if (be->p.kv_dtype == DT_BF16)
		rope_kernel<__nv_bfloat16><<<n, threads, 0, be->stream>>>(ra);
	else
		rope_kernel<float><<<n, threads, 0, be->stream>>>(ra);
	LAUNCHED(be, "rope_kernel");
	be->layer = layer;
	be->attn_wt = wt;
	be->phase = PHASE_ATTN;
	return 0;
}

static int cuda_attn_blocks(struct backend *be, const struct kv_span *spans, uint32_t n_spans)
{
	const struct model_config *c = &be->cfg;
	assert(spans || n_spans == 0);
	if (be->phase != PHASE_ATTN)
		return fail(be, -EINVAL, "cuda backend: attn_blocks called outside attn_begin .. attn_end");
	uint64_t total = 0;
	for (uint32_t s = 0; s < n_spans; s++) {
		const struct kv_span *sp = &spans[s];
		if (sp->block >= be->p.n_kv_blocks || sp->n_tokens == 0 || sp->n_tokens > be->p.block_tokens ||
		    (uint64_t)sp->pos0 + sp->n_tokens > UINT32_MAX)
			return fail(be, -EINVAL,
				    "cuda backend: attn_blocks(layer %u): span %u (block %u, positions from %u, %u tokens) "
				    "does not fit the arena (%u blocks of %u rows)", be->layer, s, sp->block, sp->pos0,
				    sp->n_tokens, be->p.n_kv_blocks, be->p.block_tokens);
		total += sp->n_tokens;
	}
	if (n_spans == 0)
		return 0;
	if (total > UINT32_MAX - 2 * ATTN_TILE)
		return fail(be, -EINVAL, "cuda backend: attn_blocks(layer %u): %llu keys in one call, at most %u",
			    be->layer, (unsigned long long)total, UINT32_MAX - 2 * ATTN_TILE);

	/* Spans then their key offsets, one copy up; the device buffer grows in stream order. */
	size_t sbytes = ((size_t)n_spans * sizeof(struct kv_span) + 15) / 16 * 16;
	size_t bytes = sbytes + ((size_t)n_spans + 1) * sizeof(uint32_t);
	if (bytes > be->spanbuf_bytes) {
		size_t cap = bytes > 2 * be->spanbuf_bytes ? bytes : 2 * be->spanbuf_bytes;
		void *nb = NULL;
		CUDA_TRY(be, "cudaMallocAsync (span list)", cudaMallocAsync(&nb, cap, be->stream));
		CUDA_TRY(be, "cudaFreeAsync (span list)", cudaFreeAsync(be->spanbuf, be->stream));
		be->spanbuf = nb;
		be->spanbuf_bytes = cap;
	}
	char *h;
	size_t off;
	int rc = up_alloc(be, bytes, &h, &off);
	if (rc)
		return rc;
	memcpy(h, spans, (size_t)n_spans * sizeof(struct kv_span));
	uint32_t *prefix = (uint32_t *)(h + sbytes), acc = 0;
	for (uint32_t s = 0; s < n_spans; s++) {
		prefix[s] = acc;
		acc += spans[s].n_tokens;
	}
	prefix[n_spans] = acc;
	CUDA_TRY(be, "cudaMemcpyAsync (span list)",
		 cudaMemcpyAsync(be->spanbuf, h, bytes, cudaMemcpyHostToDevice, be->stream));
	rc = up_commit(be, off, bytes);
	if (rc)
		return rc;

	/* Blocks: one per (kv head, group of queries); split the keys when that leaves the GPU
	 * mostly idle (decode). Many queries per KV head (prefill) take the tensor cores. */
	uint32_t group = c->n_heads / c->n_kv_heads, pairs_g = be->n * group, hd = c->head_dim;
	bool mma = be->attn_mma && be->p.kv_dtype == DT_BF16 && (hd == 64 || hd == 128) && pairs_g >= MMA_ROWS;
	uint32_t nw = pairs_g < ATTN_MAX_WARPS ? pairs_g : ATTN_MAX_WARPS;
	uint32_t rows = mma ? MMA_ROWS : nw, tile = mma ? MMA_KEYS : ATTN_TILE;
	uint32_t qtiles = (pairs_g + rows - 1) / rows, base = c->n_kv_heads * qtiles;
	uint32_t pairs = be->n * c->n_heads, tiles = (uint32_t)((total + tile - 1) / tile);
	uint32_t splits = (ATTN_BLOCKS_PER_SM * (uint32_t)be->sm_count + base - 1) / base;
	if (splits > tiles)
		splits = tiles;
	if (splits > ATTN_MAX_SPLITS)
		splits = ATTN_MAX_SPLITS;
	if (splits > be->part_cap / pairs)
		splits = be->part_cap / pairs;
	if (splits < 1)
		splits = 1;
	uint32_t kps = (tiles + splits - 1) / splits * tile;
	splits = (uint32_t)((total + kps - 1) / kps);

	attn_args a;
	a.q = be->qkv;
	a.q_ld = be->qkv_ld;
	a.arena = be->arena;
	a.block_elems = be->block_elems;
	a.block_tokens = be->p.block_tokens;
	a.kv_dim = be->kv_dim;
	a.spans = (const struct kv_span *)be->spanbuf;
	a.prefix = (const uint32_t *)((const char *)be->spanbuf + sbytes);
	a.n_spans = n_spans;
	a.total_keys = (uint32_t)total;
	a.keys_per_split = kps;
	a.n = be->n;
	a.pos0 = be->pos0;
	a.n_heads = c->n_heads;
	a.group = group;
	a.head_dim = hd;
	a.window = c->sliding_window;
	a.qtiles = qtiles;
	a.scale = be->scale;
	a.m = be->st_m;
	a.l = be->st_l;
	a.acc = be->st_acc;
	a.pm = splits > 1 ? be->pm : NULL;
	a.pl = be->pl;
	a.pacc = be->pacc;
	dim3 grid(base, splits);
	if (mma && hd == 128) {
		attn_mma_kernel<128><<<grid, 128, 0, be->stream>>>(a);
		LAUNCHED(be, "attn_mma_kernel");
	} else if (mma) {
		attn_mma_kernel<64><<<grid, 128, 0, be->stream>>>(a);
		LAUNCHED(be, "attn_mma_kernel");
	} else {
		size_t smem = attn_smem_bytes(hd, be->kv_esize, nw);
		if (be->p.kv_dtype == DT_BF16)
			attn_kernel<__nv_bfloat16><<<grid, nw * 32, smem, be->stream>>>(a);
		else
			attn_kernel<float><<<grid, nw * 32, smem, be->stream>>>(a);
		LAUNCHED(be, "attn_kernel");
	}
	if (splits > 1) {
		attn_combine_kernel<<<pairs, 64, 0, be->stream>>>(be->st_m, be->st_l, be->st_acc, be->pm, be->pl,
								  be->pacc, pairs, splits, hd);
		LAUNCHED(be, "attn_combine_kernel");
	}
	return 0;
}

static int cuda_attn_end(struct backend *be, const struct group_weights *w)
{
	static const enum tensor_role roles[] = {ROLE_WO};
	const struct model_config *c = &be->cfg;
	if (be->phase != PHASE_ATTN)
		return fail(be, -EINVAL, "cuda backend: attn_end called without attn_begin");
	int rc = check_roles(be, w, roles, 1, "attention");
	if (rc)
		return rc;
	uint32_t wt = w->dtype[ROLE_WO];
	if (wt != be->attn_wt)
		return fail(be, -ENOTSUP, "cuda backend: attn_end: wo is %s but wq was %s: mixed matrix dtypes are not "
			    "supported", dtype_name((enum dtype)wt), dtype_name((enum dtype)be->attn_wt));
	uint32_t n = be->n;
	unsigned threads = small_grid(n) ? 512 : 128;
	if (wt == DT_BF16)
		attn_out_kernel<__nv_bfloat16><<<n, threads, 0, be->stream>>>(be->st_l, be->st_acc, c->n_heads, c->head_dim,
									   (__nv_bfloat16 *)be->xa, be->status,
									   be->layer, be->pos0);
	else if (wt == DT_F16)
		attn_out_kernel<__half><<<n, threads, 0, be->stream>>>(be->st_l, be->st_acc, c->n_heads, c->head_dim,
								    (__half *)be->xa, be->status, be->layer, be->pos0);
	else
		attn_out_kernel<float><<<n, threads, 0, be->stream>>>(be->st_l, be->st_acc, c->n_heads, c->head_dim,
								   (float *)be->xa, be->status, be->layer, be->pos0);
	LAUNCHED(be, "attn_out_kernel");
	struct mm_part part = {w->t[ROLE_WO], c->dim, be->x};
	rc = matmul(be, wt, be->xa, be->q_dim, n, &part, 1, c->dim, true, "o_proj");
	if (rc)
		return rc;
	be->phase = PHASE_READY;
	return 0;
}

static int cuda_ffn(struct backend *be, const struct group_weights *w)
{
	static const enum tensor_role roles[] = {ROLE_FFN_NORM, ROLE_W_GATE, ROLE_W_UP, ROLE_W_DOWN};
	const struct model_config *c = &be->cfg;
	uint32_t n = be->n, ffn = c->ffn_dim;
	if (be->phase != PHASE_READY)
		return fail(be, -EINVAL, "cuda backend: ffn called %s",
			    be->phase == PHASE_IDLE ? "before embed" : "between attn_begin and attn_end");
	int rc = check_roles(be, w, roles, 4, "ffn");
	if (rc)
		return rc;
	rc = check_same_dtype(be, w, roles + 1, 3, "ffn");
	if (rc)
		return rc;
	uint32_t wt = w->dtype[ROLE_W_GATE];
	rc = rmsnorm(be, w->t[ROLE_FFN_NORM], w->dtype[ROLE_FFN_NORM], 0, n, wt);
	if (rc)
		return rc;
	struct mm_part gu[2] = {{w->t[ROLE_W_GATE], ffn, be->gu}, {w->t[ROLE_W_UP], ffn, be->gu + ffn}};
	if (n == 1 && gemv_fits(be, wt, c->dim, gu, 2)) {
		gemv_args g;
		memset(&g, 0, sizeof(g));
		g.w[0] = gu[0].w;
		g.w[1] = gu[1].w;
		g.total = ffn;
		g.in8 = c->dim / 8;
		g.x = be->xa;
		g.act = be->xb;
		if (wt == DT_BF16)
			gemv_launch<__nv_bfloat16>(be, g, GEMV_SWIGLU);
		else
			gemv_launch<__half>(be, g, GEMV_SWIGLU);
		LAUNCHED(be, "gemv_kernel (gate/up)");
	} else {
		for (uint32_t i = 0; i < 2; i++) {
			rc = gemm(be, wt, &gu[i], be->xa, c->dim, n, 2 * ffn, false, i ? "up_proj" : "gate_proj");
			if (rc)
				return rc;
		}
		size_t count = (size_t)n * ffn;
		unsigned grid = grid_for(count, 256);
		if (wt == DT_BF16)
			silu_mul_kernel<__nv_bfloat16><<<grid, 256, 0, be->stream>>>(be->gu, ffn, count,
										      (__nv_bfloat16 *)be->xb);
		else if (wt == DT_F16)
			silu_mul_kernel<__half><<<grid, 256, 0, be->stream>>>(be->gu, ffn, count, (__half *)be->xb);
		else
			silu_mul_kernel<float><<<grid, 256, 0, be->stream>>>(be->gu, ffn, count, (float *)be->xb);
		LAUNCHED(be, "silu_mul_kernel");
	}
	struct mm_part down = {w->t[ROLE_W_DOWN], c->dim, be->x};
	return matmul(be, wt, be->xb, ffn, n, &down, 1, c->dim, true, "down_proj");
}

/* Final norm of the chunk's last token and lm_head into be->logits (queued, not waited for). */
static int head(struct backend *be, const struct group_weights *w, const char *what)
{
	static const enum tensor_role roles[] = {ROLE_FINAL_NORM, ROLE_LM_HEAD};
	const struct model_config *c = &be->cfg;
	if (be->phase != PHASE_READY)
		return fail(be, -EINVAL, "cuda backend: %s called %s", what,
			    be->phase == PHASE_IDLE ? "before embed" : "between attn_begin and attn_end");
	int rc = check_roles(be, w, roles, 2, "head");
	if (rc)
		return rc;
	uint32_t wt = w->dtype[ROLE_LM_HEAD];
	rc = rmsnorm(be, w->t[ROLE_FINAL_NORM], w->dtype[ROLE_FINAL_NORM], be->n - 1, 1, wt);
	if (rc)
		return rc;
	struct mm_part part = {w->t[ROLE_LM_HEAD], c->vocab_size, be->logits};
	return matmul(be, wt, be->xa, c->dim, 1, &part, 1, c->vocab_size, false, "lm_head");
}

/* After the result's copy was queued: wait for it and report what the kernels flagged. */
static int finish_step(struct backend *be, const char *what)
{
	CUDA_TRY(be, "cudaMemcpyAsync (status)",
		 cudaMemcpyAsync(be->h_status, be->status, sizeof(*be->status), cudaMemcpyDeviceToHost, be->stream));
	CUDA_TRY(be, "cudaStreamSynchronize (logits)", cudaStreamSynchronize(be->stream));
	if (be->h_status->err) {
		struct dev_status st = *be->h_status;
		CUDA_TRY(be, "cudaMemsetAsync (status)", cudaMemsetAsync(be->status, 0, sizeof(*be->status), be->stream));
		return fail(be, -EINVAL,
			    "cuda backend: %s: in layer %u the query at position %u saw no keys: the spans did not cover "
			    "its own position (found by attn_end on the GPU, reported here)", what, st.err_layer,
			    st.err_pos);
	}
	return 0;
}

static int cuda_logits(struct backend *be, const struct group_weights *w, float *out)
{
	assert(w && out);
	int rc = head(be, w, "logits");
	if (rc)
		return rc;
	CUDA_TRY(be, "cudaMemcpyAsync (logits)",
		 cudaMemcpyAsync(out, be->logits, be->cfg.vocab_size * sizeof(float), cudaMemcpyDeviceToHost,
				 be->stream));
	return finish_step(be, "logits");
}

static int cuda_logits_argmax(struct backend *be, const struct group_weights *w, int32_t *token)
{
	assert(w && token);
	int rc = head(be, w, "logits_argmax");
	if (rc)
		return rc;
	argmax_kernel<<<1, 1024, 0, be->stream>>>(be->logits, be->cfg.vocab_size, be->status);
	LAUNCHED(be, "argmax_kernel");
	rc = finish_step(be, "logits_argmax");
	if (rc)
		return rc;
	*token = be->h_status->token;
	return 0;
}

static int cuda_logits_sample(struct backend *be, const struct group_weights *w, float temperature, uint32_t top_k,
			      float top_p, float min_p, double u, int32_t *token)
{
	assert(w && token);
	if (!(temperature > 0.0f) || !(u >= 0.0 && u < 1.0))
		return fail(be, -EINVAL, "cuda backend: logits_sample needs temperature > 0 and u in [0, 1)");
	int rc = head(be, w, "logits_sample");
	if (rc)
		return rc;
	be->h_status->token = -1;
	sample_kernel<<<1, 1024, 0, be->stream>>>(be->logits, be->cfg.vocab_size, 1.0f / temperature, top_k, top_p,
						 min_p, u, be->status);
	LAUNCHED(be, "sample_kernel");
	rc = finish_step(be, "logits_sample");
	if (rc)
		return rc;
	*token = be->h_status->token;
	if (*token < 0 || (uint32_t)*token >= be->cfg.vocab_size)
		return fail(be, -EIO, "cuda backend: the sampler chose no token");
	return 0;
}

static void *cuda_stream(struct backend *be)
{
	return (void *)be->stream;
}

static const char *cuda_error(struct backend *be)
{
	return be->err;
}

/* ---- create / destroy ------------------------------------------------------------------- */

/* Waits for queued work, frees everything; NULLs *bep; safe on NULL and twice, and on a
 * partly created backend. */
static void cuda_destroy(struct backend **bep)
{
	struct backend *be = *bep;
	if (!be)
		return;
	if (be->spanbuf)
		cudaFreeAsync(be->spanbuf, be->stream); /* allocated stream-ordered */
	if (be->stream)
		cudaStreamSynchronize(be->stream);
	if (be->blas)
		cublasDestroy(be->blas);
	cudaFree(be->blas_ws);
	cudaFree(be->arena);
	cudaFree(be->inv_freq);
	cudaFree(be->x);
	cudaFree(be->xa);
	cudaFree(be->xb);
	cudaFree(be->qkv);
	cudaFree(be->gu);
	cudaFree(be->logits);
	cudaFree(be->st_m);
	cudaFree(be->st_l);
	cudaFree(be->st_acc);
	cudaFree(be->pm);
	cudaFree(be->pl);
	cudaFree(be->pacc);
	cudaFree(be->dst);
	cudaFree(be->status);
	cudaFreeHost(be->h_status);
	cudaFreeHost(be->up.host);
	for (uint32_t i = 0; i < be->up.n_events; i++)
		cudaEventDestroy(be->up.ev[i]);
	if (be->kv_d2h) {
		cudaStreamSynchronize(be->kv_d2h);
		cudaStreamDestroy(be->kv_d2h);
		cudaEventDestroy(be->kv_d2h_order);
	}
	free(be->kv_d2h_ev);
	free(be->kv_d2h_seq);
	if (be->kv_h2d) {
		cudaStreamSynchronize(be->kv_h2d);
		cudaStreamDestroy(be->kv_h2d);
		cudaEventDestroy(be->kv_order);
		cudaEventDestroy(be->kv_done[0]);
		cudaEventDestroy(be->kv_done[1]);
	}
	if (be->stream)
		cudaStreamDestroy(be->stream);
	free(be);
	*bep = NULL;
}

static int check_config(const struct model_config *c, const struct backend_params *p, char *err, size_t errlen)
{
	int rc = backend_check_config("cuda", c, p, err, errlen);
	if (rc)
		return rc;
	if (c->head_dim % 8 || c->head_dim > MAX_HEAD_DIM) {
		snprintf(err, errlen, "cuda backend: head_dim %u is not supported: the attention kernel takes multiples "
			 "of 8 up to %u", c->head_dim, MAX_HEAD_DIM);
		return -ENOTSUP;
	}
	if (!(c->rope_theta > 1.0f) || !isfinite(c->rope_theta)) {
		snprintf(err, errlen, "cuda backend: rope_theta %g is not a finite number > 1", (double)c->rope_theta);
		return -EINVAL;
	}
	if (c->rope_scaling != ROPE_SCALING_NONE) {
		if (!(c->rope_factor > 0.0f) || !isfinite(c->rope_factor)) {
			snprintf(err, errlen, "cuda backend: rope_scaling factor %g is not a finite number > 0",
				 (double)c->rope_factor);
			return -EINVAL;
		}
		if (c->rope_scaling == ROPE_SCALING_LLAMA3) {
			float low = c->rope_low_freq_factor, high = c->rope_high_freq_factor;
			if (!(low > 0.0f) || !(high > low) || !isfinite(high) || c->rope_original_max_position == 0) {
				snprintf(err, errlen,
					 "cuda backend: llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor "
					 "and original_max_position_embeddings > 0 (got low %g, high %g, original %u)",
					 (double)low, (double)high, c->rope_original_max_position);
				return -EINVAL;
			}
		} else if (c->rope_scaling != ROPE_SCALING_LINEAR) {
			snprintf(err, errlen, "cuda backend: unknown rope_scaling type %u", c->rope_scaling);
			return -EINVAL;
		}
	}
	if (p->kv_dtype != DT_BF16 && p->kv_dtype != DT_F32) {
		snprintf(err, errlen, "cuda backend: kv_dtype %s is not supported: the KV arena holds BF16 or F32",
			 p->kv_dtype < DT_COUNT ? dtype_name((enum dtype)p->kv_dtype) : "(unknown)");
		return -ENOTSUP;
	}
	return 0;
}

/* cudaMalloc of a * b elements of es bytes into *p; -ENOMEM with a message naming what. */
static int dev_alloc(struct backend *be, void **p, size_t a, size_t b, size_t es, const char *what)
{
	size_t n;
	if (__builtin_mul_overflow(a, b, &n) || __builtin_mul_overflow(n, es, &n))
		return fail(be, -ENOMEM, "cuda backend: %s: %zu x %zu elements overflow", what, a, b);
	cudaError_t e = cudaMalloc(p, n ? n : 1);
	if (e != cudaSuccess) {
		*p = NULL;
		cudaGetLastError(); /* not sticky: clear it */
		return fail(be, -ENOMEM, "cuda backend: cudaMalloc of %zu bytes for %s failed: %s", n, what,
			    cudaGetErrorString(e));
	}
	return 0;
}

static int create_device(struct backend *be)
{
	const struct model_config *c = &be->cfg;
	const struct backend_params *p = &be->p;
	CUDA_TRY(be, "cudaGetDevice", cudaGetDevice(&be->device));
	CUDA_TRY(be, "cudaDeviceGetAttribute (multiprocessors)",
		 cudaDeviceGetAttribute(&be->sm_count, cudaDevAttrMultiProcessorCount, be->device));
	/* Priority 0 is the default; non-blocking: the legacy default stream does not order
	 * against it (the weight window orders its copies with events). */
	CUDA_TRY(be, "cudaStreamCreateWithPriority",
		 cudaStreamCreateWithPriority(&be->stream, cudaStreamNonBlocking, 0));
	cublasStatus_t bs = cublasCreate(&be->blas);
	if (bs != CUBLAS_STATUS_SUCCESS) {
		be->blas = NULL;
		return blas_fail(be, bs, "cublasCreate");
	}
	if ((bs = cublasSetStream(be->blas, be->stream)) != CUBLAS_STATUS_SUCCESS)
		return blas_fail(be, bs, "cublasSetStream");
	if ((bs = cublasSetMathMode(be->blas, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS)
		return blas_fail(be, bs, "cublasSetMathMode");
	int rc = dev_alloc(be, &be->blas_ws, BLAS_WORKSPACE, 1, 1, "the cuBLAS workspace");
	if (rc)
		return rc;
	if ((bs = cublasSetWorkspace(be->blas, be->blas_ws, BLAS_WORKSPACE)) != CUBLAS_STATUS_SUCCESS)
		return blas_fail(be, bs, "cublasSetWorkspace");

	size_t mc = p->max_chunk, pairs = mc * c->n_heads;
	size_t arena_elems;
	if (__builtin_mul_overflow((size_t)p->n_kv_blocks, be->block_elems, &arena_elems))
		return fail(be, -ENOMEM, "cuda backend: a KV arena of %u blocks overflows", p->n_kv_blocks);
	if ((rc = dev_alloc(be, &be->arena, arena_elems, 1, be->kv_esize, "the KV arena")) ||
	    (rc = dev_alloc(be, (void **)&be->inv_freq, c->head_dim / 2, 1, sizeof(float), "RoPE frequencies")) ||
	    (rc = dev_alloc(be, (void **)&be->x, mc, c->dim, sizeof(float), "the residual stream")) ||
	    (rc = dev_alloc(be, &be->xa, mc, be->max_in, sizeof(float), "matrix inputs")) ||
	    (rc = dev_alloc(be, &be->xb, mc, c->ffn_dim, sizeof(float), "the SwiGLU output")) ||
	    (rc = dev_alloc(be, (void **)&be->qkv, mc, be->qkv_ld, sizeof(float), "q/k/v")) ||
	    (rc = dev_alloc(be, (void **)&be->gu, mc, 2 * (size_t)c->ffn_dim, sizeof(float), "gate/up")) ||
	    (rc = dev_alloc(be, (void **)&be->logits, c->vocab_size, 1, sizeof(float), "logits")) ||
	    (rc = dev_alloc(be, (void **)&be->st_m, pairs, 1, sizeof(float), "attention state")) ||
	    (rc = dev_alloc(be, (void **)&be->st_l, pairs, 1, sizeof(float), "attention state")) ||
	    (rc = dev_alloc(be, (void **)&be->st_acc, pairs, c->head_dim, sizeof(float), "attention state")))
		return rc;
	be->part_cap = c->n_heads * ATTN_MAX_SPLITS;
	if ((rc = dev_alloc(be, (void **)&be->pm, be->part_cap, 1, sizeof(float), "split attention")) ||
	    (rc = dev_alloc(be, (void **)&be->pl, be->part_cap, 1, sizeof(float), "split attention")) ||
	    (rc = dev_alloc(be, (void **)&be->pacc, be->part_cap, c->head_dim, sizeof(float), "split attention")) ||
	    (rc = dev_alloc(be, (void **)&be->dst, 2 * mc, 1, sizeof(uint32_t), "KV destinations")) ||
	    (rc = dev_alloc(be, (void **)&be->status, 1, 1, sizeof(struct dev_status), "the status word")))
		return rc;
	/* Stream-ordered, as its replacements when a call brings more spans (cuda_attn_blocks). */
	be->spanbuf_bytes = ((size_t)p->n_kv_blocks + 1) * (sizeof(struct kv_span) + sizeof(uint32_t)) + 16;
	CUDA_TRY(be, "cudaMallocAsync (span list)", cudaMallocAsync(&be->spanbuf, be->spanbuf_bytes, be->stream));
	CUDA_TRY(be, "cudaMemset (status)", cudaMemset(be->status, 0, sizeof(*be->status)));

	float *inv = (float *)malloc(c->head_dim / 2 * sizeof(float));
	if (!inv)
		return fail(be, -ENOMEM, "cuda backend: out of memory for RoPE frequencies");
	char why[256];
	if (rope_inv_freq(c, inv, why, sizeof(why)) != 0) {
		free(inv);
		return fail(be, -EINVAL, "cuda backend: %s", why);
	}
	cudaError_t e = cudaMemcpy(be->inv_freq, inv, c->head_dim / 2 * sizeof(float), cudaMemcpyHostToDevice);
	free(inv);
	if (e != cudaSuccess)
		return cuda_fail(be, e, "cudaMemcpy (RoPE frequencies)");

	/* Staging ring: two chunks of embedding rows at the widest dtype, plus room for the small
	 * uploads of a few steps. */
	be->up.cap = 2 * mc * c->dim * sizeof(float) + (1u << 20);
	CUDA_TRY(be, "cudaMallocHost (staging ring)", cudaMallocHost((void **)&be->up.host, be->up.cap));
	CUDA_TRY(be, "cudaMallocHost (status)", cudaMallocHost((void **)&be->h_status, sizeof(*be->h_status)));
	for (uint32_t i = 0; i < UPLOAD_EVENTS; i++) {
		CUDA_TRY(be, "cudaEventCreateWithFlags", cudaEventCreateWithFlags(&be->up.ev[i], cudaEventDisableTiming));
		be->up.n_events++;
	}

	be->attn_smem_max = attn_smem_bytes(c->head_dim, be->kv_esize, ATTN_MAX_WARPS);
	int smem_optin = 0;
	CUDA_TRY(be, "cudaDeviceGetAttribute (shared memory)",
		 cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, be->device));
	if (be->attn_smem_max > (size_t)smem_optin)
		return fail(be, -ENOTSUP, "cuda backend: attention needs %zu bytes of shared memory, the device has %d",
			    be->attn_smem_max, smem_optin);
	if (p->kv_dtype == DT_BF16)
		CUDA_TRY(be, "cudaFuncSetAttribute (attention)",
			 cudaFuncSetAttribute(attn_kernel<__nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
					      (int)be->attn_smem_max));
	else
		CUDA_TRY(be, "cudaFuncSetAttribute (attention)",
			 cudaFuncSetAttribute(attn_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize,
					      (int)be->attn_smem_max));
	return 0;
}

/* On success *out is a new backend the caller owns (cuda_destroy); on failure *out is NULL and
 * err names the problem. cfg and p are copied. Uses the current device. */
static int cuda_create(const struct model_config *cfg, const struct backend_params *p, struct backend **out,
		       char *err, size_t errlen)
{
	assert(cfg && p && out && err);
	*out = NULL;
	int rc = check_config(cfg, p, err, errlen);
	if (rc)
		return rc;
	struct backend *be = (struct backend *)calloc(1, sizeof(*be));
	if (!be) {
		snprintf(err, errlen, "cuda backend: out of memory for the backend state");
		return -ENOMEM;
	}
	be->cfg = *cfg;
	be->p = *p;
	be->q_dim = cfg->n_heads * cfg->head_dim;
	be->kv_dim = cfg->n_kv_heads * cfg->head_dim;
	be->qkv_ld = be->q_dim + 2 * be->kv_dim;
	be->max_in = cfg->dim;
	if (be->q_dim > be->max_in)
		be->max_in = be->q_dim;
	if (cfg->ffn_dim > be->max_in)
		be->max_in = cfg->ffn_dim;
	be->kv_esize = dtype_size((enum dtype)p->kv_dtype);
	be->block_elems = 2 * (size_t)p->block_tokens * be->kv_dim;
	be->scale = (float)(1.0 / sqrt((double)cfg->head_dim));
	/* Switches for comparisons (the test checks and times each path): PIPELINE_CUDA_GEMV=0
	 * sends decode through cuBLAS, =1 / =2 picks the GEMV kernel's rows per warp;
	 * PIPELINE_CUDA_ATTN=simple keeps prefill attention off the tensor cores. */
	const char *g = getenv("PIPELINE_CUDA_GEMV");
	be->gemv_rows = g && (!strcmp(g, "0") || !strcmp(g, "1") || !strcmp(g, "2")) ? atoi(g) : GEMV_DEFAULT_ROWS;
	const char *at = getenv("PIPELINE_CUDA_ATTN");
	be->attn_mma = !(at && !strcmp(at, "simple"));

	rc = create_device(be);
	if (rc) {
		snprintf(err, errlen, "%s", be->err);
		cuda_destroy(&be);
		return rc;
	}
	*out = be;
	return 0;
}

/* In the order of struct backend_ops (C++17 has no designated initializers). */
extern "C" {
extern const struct backend_ops backend_cuda_ops;
const struct backend_ops backend_cuda_ops = {
	"cuda",			/* name */
	cuda_create,		/* create */
	cuda_destroy,		/* destroy */
	cuda_kv_block_bytes,	/* kv_block_bytes */
	cuda_kv_to_host,	/* kv_to_host */
	cuda_kv_from_host,	/* kv_from_host */
	cuda_embed,		/* embed */
	cuda_attn_begin,	/* attn_begin */
	cuda_attn_blocks,	/* attn_blocks */
	cuda_attn_end,		/* attn_end */
	cuda_ffn,		/* ffn */
	cuda_logits,		/* logits */
	cuda_logits_argmax,	/* logits_argmax */
	cuda_stream,		/* stream */
	cuda_error,		/* error */
	cuda_kv_to_host_n,	/* kv_to_host_n */
	cuda_pin_host,		/* pin_host */
	cuda_unpin_host,	/* unpin_host */
	cuda_logits_sample,	/* logits_sample */
	cuda_kv_to_host_async,	/* kv_to_host_async */
	cuda_kv_from_host_n,	/* kv_from_host_n */
	cuda_kv_prefetch_n,	/* kv_prefetch_n */
	cuda_kv_prefetch_wait,	/* kv_prefetch_wait */
	cuda_kv_sync,		/* kv_sync */
};
}

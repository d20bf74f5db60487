/* moe.cu - the CUDA backend's mixture-of-experts layers and Qwen3's q/k norms.
 *
 * A mixture-of-experts layer (backend.h: moe_route, moe_expert per expert, moe_end), numerics as
 * the C reference (cpu/backend_ref.c) computes them:
 *  - route: RMSNorm (ROLE_FFN_NORM) of the chunk's rows into float32 (xn), the router logits in
 *    float32 from those rows (router_kernel; a block-format router is dequantized to float32
 *    first), into pinned host memory (a step of at most FFN_SPLIT_MAX_TOKENS tokens: the kernels
 *    write the logits and the CPU's copy of xn there themselves, mapped; a longer chunk copies them
 *    down). The host waits for them (the only wait of a layer: which experts run decides what the
 *    next calls copy and compute) and routes each token with the reference's own cpu_moe_route,
 *    so the same logits choose the same experts. The tokens of
 *    each expert (in token order, with their weights) go up in one copy; the sum is cleared.
 *  - expert e: nothing when no token chose it. Else its tokens' xn rows gathered into the
 *    expert's activation dtype, SwiGLU (swiglu_product: the GEMV kernels for one token, cuBLAS or
 *    the quantized paths for more), down_proj into float32 rows y, and sum[token] += y * weight
 *    (each product rounded to float32, then added: the reference's index_add_), experts in
 *    increasing order as the engine gives them: the sum's order is the reference's.
 *  - end: the residual stream += sum.
 *  - one token (a decode step of one sequence): the same sums in fewer launches, since the host's
 *    launches, not the GPU, bound such a step (M1R/M2R: 5.4 ms a token all resident, 0.2 ms a layer
 *    of some 50 launches). The token's row goes into the activation dtype once a layer, not once an
 *    expert; each expert's down_proj writes a row of its own (ys); and end adds them all with one
 *    kernel (combine_kernel): s = 0, s += y_j * w_j in the experts' order, x += s, the operations and
 *    order of the sum's memset, scatters and add (with no GPU expert nothing is added, where the
 *    add of a cleared sum turned a -0.0 of x into +0.0: the same value).
 *
 *  - expert e on the CPU (moe_expert_cpu: the weight window left it in host memory, a decode step
 *    with backend_params.cpu_pool): submitted to the pool at once, over its tokens' xn rows (in host
 *    memory with the logits), as an ffn_share job of the whole expert, up to MOE_CPU_JOBS_MAX experts
 *    at once on slices of the pool's threads, so the CPU computes while the engine goes on with the
 *    GPU's experts; at moe_end the jobs are collected in expert order (the weighted rows summed on
 *    the host), and the sum goes up and into the residual stream beside the GPU's.
 *  - one token, the CPU's experts waited for on the GPU (gpu_waits: backend_params.cpu_result_mapped,
 *    the stream memory operations there, k <= the jobs at once): the host does not wait at moe_end.
 *    The stream waits for each job's completion word (mapped pinned memory: cuStreamWaitValue32),
 *    and combine_kernel reads the jobs' output rows from mapped host memory and sums them first,
 *    in the order they were noted (s = 0, s += y_i * w_i, x += s: the host's collection and add),
 *    then the GPU's rows as before. The host goes on to the next layer while the CPU computes; the
 *    jobs' results are checked after the host's next wait for the stream (the next route, or the
 *    step's end: moe_check).
 *
 * Qwen3 (MODEL_QK_NORM): each head of q and k goes through its RMSNorm over head_dim (q_norm,
 * k_norm) after the projections and before RoPE (qk_norm_kernel, in place in qkv).
 */
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cuda/cpu_handoff.h"
#include "services/gpu-runner/cuda/device.cuh"
#include "common/log.h"
#include "common/util.h"
#include "services/gpu-runner/cpu-compute/ffn_share.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/cpu/kernels.h"

#include <assert.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* An expert noted for the CPU: its matrices in host memory. */
struct moe_cpu_expert {
	uint32_t expert;
	float w;	/* one token's routing weight of it (gpu_wait) */
	struct ffn_share_mat gate, up, down;
};

#define MOE_CPU_JOBS_MAX BACKEND_MOE_CPU_JOBS /* experts the pool computes at once */
#define MOE_COMBINE_MAX 32 /* experts a token chooses that combine_kernel sums in one launch */

/* combine_kernel's weights, by value: the GPU's rows' (w), and the CPU's rows in mapped host
 * memory with theirs (cpu_y, cpu_w; n_cpu of them, summed first). */
struct moe_combine_w {
	float w[MOE_COMBINE_MAX];
	const float *cpu_y[MOE_CPU_JOBS_MAX];
	float cpu_w[MOE_CPU_JOBS_MAX];
	uint32_t n_cpu;
};

/* A job's completion word and its sleepers, on a cache line of their own (in mapped pinned memory
 * where the stream waits on them). */
struct moe_word {
	uint32_t done, waiters;
	uint32_t pad[14];
};

/* One of the concurrent CPU jobs: an expert's rows in, its output out. */
struct moe_cpu_job {
	struct ffn_share *share;
	struct ffn_share_job job;
	struct task_job tj;		/* the pool's job */
	float *x, *y;			/* (FFN_SPLIT_MAX_TOKENS, dim); y in mapped pinned memory with gpu_waits */
	const float *y_dev;		/* y as the device addresses it (gpu_waits) */
	uint32_t *done, *waiters, seq;	/* the job's completion word, its sleepers (in words), the last value */
	CUdeviceptr done_dev;		/* done as the stream addresses it (gpu_waits) */
	uint64_t end_ns;		/* when it ended (job_ended; read once done shows seq) */
	uint32_t per;			/* the threads share's parts were cut for (ffn_share_threads_for) */
};

struct cuda_moe {
	uint32_t E, k, F;	/* experts, chosen per token, an expert's intermediate size */
	/* Device memory. */
	float *xn;		/* (max_chunk, dim) the normed rows in float32 */
	float *logits;		/* (max_chunk, E) router logits */
	float *router_f;	/* (E, dim) a block-format router dequantized */
	float *sum;		/* (max_chunk, dim) the layer's weighted sum of expert outputs */
	void *xg;		/* (max_chunk, dim) an expert's gathered rows in its activation dtype */
	float *gu;		/* (max_chunk, 2 F) gate then up (the unfused paths) */
	void *act;		/* (max_chunk, F) SiLU(gate) * up in the activation dtype */
	float *y;		/* (max_chunk, dim) down_proj of an expert's rows */
	float *ys;		/* (k, dim) one token: each GPU expert's down_proj row, in the order given */
	uint32_t *tok0;		/* (1) 0: one token's gather index */
	uint32_t *tok;		/* (max_chunk k) tokens of each expert, expert after expert (off[]) */
	float *tw;		/* (max_chunk k) their weights */
	/* Host memory. */
	float *h_logits;	/* (max_chunk, E) pinned, mapped */
	float *h_logits_dev;	/* h_logits as the device addresses it (NULL: not mapped, copied down) */
	uint32_t *sel;		/* (max_chunk, k) each token's experts */
	float *sel_w;		/* (max_chunk, k) and weights */
	uint32_t *off;		/* (E + 1) expert e's tokens are [off[e], off[e + 1]) of tok/tw */
	uint32_t *h_tok;	/* (max_chunk k) */
	float *h_tw;
	bool routed;		/* route ran for the chunk in flight */
	/* One token (route: n == 1, k <= MOE_COMBINE_MAX): its row in xg once, rows into ys. */
	bool one;
	bool xg_ok;		/* xg holds the token's row in dtype xg_at */
	uint32_t xg_at;
	uint32_t n_gpu;		/* experts computed into ys */
	float yw[MOE_COMBINE_MAX]; /* their routing weights */
	/* Experts on the CPU (backend_params.cpu_pool): up to n_jobs at once, each an ffn_share job of
	 * its own (scratch, rows, output) on a slice of the pool's threads. */
	struct moe_cpu_job *jobs;	/* (n_jobs) */
	uint32_t n_jobs;
	float *h_xn;			/* (FFN_SPLIT_MAX_TOKENS, dim) pinned, mapped: xn of a decode step */
	float *h_xn_dev;		/* h_xn as the device addresses it (NULL: not mapped, copied down) */
	bool xn_down;			/* h_xn holds this chunk's rows */
	float *csum;			/* (FFN_SPLIT_MAX_TOKENS, dim) the CPU's sum */
	float *csum_dev;		/* (FFN_SPLIT_MAX_TOKENS, dim) the CPU's sum, device memory */
	struct moe_cpu_expert *cpu;	/* (E) the experts noted for the CPU this layer, in order */
	uint32_t n_cpu;			/* noted (and submitted) */
	uint32_t collected;		/* of which waited for and added into csum */
	struct moe_word *words;		/* (n_jobs) the jobs' completion words: pinned, mapped with gpu_waits */
	bool gpu_waits;			/* one token's CPU experts may be waited for on the GPU (setup) */
	bool gpu_wait;			/* this layer's are (route: one token and gpu_waits) */
	uint32_t n_waited;		/* jobs of the last such layer, slots 0.., whose results moe_check reads */
	float *ybuf;			/* (n_jobs, FFN_SPLIT_MAX_TOKENS, dim) the jobs' y, mapped (gpu_waits) */
	PFN_cuStreamWaitValue32_v11070 wait32;
	uint64_t cpu_experts, cpu_ns, route_wait_ns; /* experts the CPU computed, and the host's times (all time) */
	uint64_t layer_t0, waited_t0;	/* when this layer's first CPU expert was submitted; the waited layer's */
	uint64_t layer_bytes, waited_bytes; /* the weight bytes of this layer's CPU experts; the waited layer's */
	uint64_t span_ns, span_layers;	/* layers' CPU experts, first submission to last end, summed (all time) */
	uint64_t span_bytes;		/* the weight bytes of those layers' CPU experts */
	uint32_t pool_threads;		/* the CPU pool's workers */
	uint64_t wait_ns_gone;		/* the phase waits of the jobs' shares made anew (ffn_share_stats) */
	/* The gaps between layers' CPU experts (backend_cpu_share_stats): the end of the last layer's
	 * last job (0: none, or not in this step), the return of this layer's wait for its routing and
	 * the gap to it, until the layer's first submission counts both. */
	uint64_t last_end_ns, route_t1, gap_pending_ns;
	uint64_t gap_gpu_ns, gap_host_ns, gaps;
};

/* ---- kernels ------------------------------------------------------------------------------ */

/* One warp per (token, expert): out[t][e] = sum_d xn[t][d] w[e][d] in float32. */
__global__ void router_kernel(const float *xn, const void *w, uint32_t wt, uint32_t dim, uint32_t E, uint32_t n,
			      float *out)
{
	const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
	if (warp >= n * E)
		return;
	const uint32_t t = warp / E, e = warp % E;
	const float *x = xn + (size_t)t * dim;
	float acc = 0.0f;
	for (uint32_t d = lane; d < dim; d += 32)
		acc = __fmaf_rn(x[d], load_any(w, wt, (size_t)e * dim + d), acc);
	for (int o = 16; o > 0; o >>= 1)
		acc += __shfl_xor_sync(0xffffffffu, acc, o);
	if (lane == 0)
		out[(size_t)t * E + e] = acc;
}

/* xn = the chunk's normed rows; with host (a decode step's rows for the CPU, in mapped pinned
 * memory) the same rows there too, written across the bus by the kernel: no copy queued behind it,
 * whose start the host's wait for the route would wait out. */
__global__ void xn_kernel(const float *src, float *xn, float *host, size_t count)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
		const float v = src[i];
		xn[i] = v;
		if (host)
			host[i] = v;
	}
}

/* out[i] = xn[tok[i]] in the activation dtype, for the cnt rows of one expert. */
template <typename T> __global__ void gather_kernel(const float *xn, const uint32_t *tok, uint32_t cnt, uint32_t dim,
						   T *out)
{
	size_t count = (size_t)cnt * dim;
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
		size_t r = i / dim, d = i % dim;
		out[i] = from_f32<T>(xn[(size_t)tok[r] * dim + d]);
	}
}

/* sum[tok[i]] += y[i] * w[i]: the product rounded, then added. An expert's tokens are distinct. */
__global__ void scatter_kernel(const float *y, const uint32_t *tok, const float *w, uint32_t cnt, uint32_t dim,
			       float *sum)
{
	size_t count = (size_t)cnt * dim;
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
		size_t r = i / dim, d = i % dim;
		float *dst = sum + (size_t)tok[r] * dim + d;
		*dst = __fadd_rn(*dst, __fmul_rn(y[i], w[r]));
	}
}

/* One token: x[d] += sum over j < cnt of ys[j][d] * w[j], summed from 0 in j's order, each product
 * rounded: the scatters into a cleared sum and the add, in one kernel. The CPU's rows first where
 * the stream waited for them (w.n_cpu): their sum, the same way, is added before, as the host's
 * collected sum was. */
__global__ void combine_kernel(float *x, const float *ys, uint32_t cnt, uint32_t dim, const moe_combine_w w)
{
	for (uint32_t d = blockIdx.x * blockDim.x + threadIdx.x; d < dim; d += gridDim.x * blockDim.x) {
		float v = x[d];
		if (w.n_cpu) {
			float c = 0.0f;
			for (uint32_t j = 0; j < w.n_cpu; j++)
				c = __fadd_rn(c, __fmul_rn(__ldcv(w.cpu_y[j] + d), w.cpu_w[j])); /* not cached: the
												   * CPU rewrites them */
			v = __fadd_rn(v, c);
		}
		if (cnt) {
			float s = 0.0f;
			for (uint32_t j = 0; j < cnt; j++)
				s = __fadd_rn(s, __fmul_rn(ys[(size_t)j * dim + d], w.w[j]));
			v = __fadd_rn(v, s);
		}
		x[d] = v;
	}
}

/* One block per (token, head): the head's hd values of qkv (row ld) through RMSNorm in place, as
 * rmsnorm_kernel: sum of squares in double, r = 1 / sqrt(mean + eps), w * (x * r). Heads [0, nq)
 * are q's (weights qn), the rest k's (kn). */
__global__ void __launch_bounds__(128) qk_norm_kernel(float *qkv, uint32_t ld, uint32_t hd, uint32_t nq, const void *qn,
						      uint32_t qt, const void *kn, uint32_t kt, float eps)
{
	__shared__ double part[4];
	const uint32_t t = blockIdx.x, h = blockIdx.y;
	float *v = qkv + (size_t)t * ld + (size_t)h * hd;
	const void *w = h < nq ? qn : kn;
	const uint32_t wt = h < nq ? qt : kt;
	double ss = 0;
	for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x)
		ss += (double)v[i] * v[i];
	for (int o = 16; o > 0; o >>= 1)
		ss += __shfl_xor_sync(0xffffffffu, ss, o);
	if (threadIdx.x % 32 == 0)
		part[threadIdx.x / 32] = ss;
	__syncthreads();
	double tot = 0;
	for (uint32_t i = 0; i < blockDim.x / 32; i++)
		tot += part[i];
	float var = (float)(tot / hd);
	float r = 1.0f / sqrtf(var + eps);
	__syncthreads();
	for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x)
		v[i] = __fmul_rn(load_any(w, wt, i), __fmul_rn(v[i], r));
}

/* ---- host side ---------------------------------------------------------------------------- */

static void settle_jobs(struct cuda_moe *m);

int qk_norm(struct backend_dev *be, const void *qn, uint32_t qt, const void *kn, uint32_t kt)
{
	const struct model_config *c = &be->cfg;
	dim3 grid(be->n, c->n_heads + c->n_kv_heads);
	qk_norm_kernel<<<grid, 128, 0, be->stream>>>(be->qkv, be->qkv_ld, c->head_dim, c->n_heads, qn, qt, kn, kt,
						     c->rms_eps);
	LAUNCHED(be, "qk_norm_kernel");
	return 0;
}

/* The jobs' completion words, and with gpu_waits their outputs, in pinned memory: mapped where one
 * token's CPU experts are waited for on the GPU (backend_params.cpu_result_mapped and not host
 * functions, k at most the jobs at once, the driver's stream memory operations there; else the
 * host waits at moe_end, as with --cpu-result copy). A stream that cannot wait on a word already
 * reached is refused here, not found out by a hung step. */
static int gpu_waits_setup(struct backend_dev *be, size_t rows)
{
	struct cuda_moe *m = be->moe;
	bool want = be->p.cpu_result_mapped && be->p.cpu_handoff != BACKEND_HANDOFF_HOSTFUNC && m->k <= m->n_jobs;
	char why[256] = "";
	if (want) {
		int device = 0;
		void *fn = NULL;
		if (cudaGetDevice(&device) != cudaSuccess || cpu_handoff_wait_entry(device, &fn, why, sizeof(why)) != 0)
			want = false;
		m->wait32 = (PFN_cuStreamWaitValue32_v11070)fn;
	}
	const unsigned flags = want ? cudaHostAllocMapped | cudaHostAllocPortable : cudaHostAllocDefault;
	CUDA_TRY(be, "cudaHostAlloc (the CPU experts' completion words)",
		 cudaHostAlloc((void **)&m->words, m->n_jobs * sizeof(struct moe_word), flags));
	memset(m->words, 0, m->n_jobs * sizeof(struct moe_word));
	if (want) {
		CUDA_TRY(be, "cudaHostAlloc (the CPU experts' rows)",
			 cudaHostAlloc((void **)&m->ybuf, m->n_jobs * rows * sizeof(float),
				       cudaHostAllocMapped | cudaHostAllocPortable));
		/* A wait for a value the word holds already: it must pass at once. */
		void *dw = NULL;
		CUDA_TRY(be, "cudaHostGetDevicePointer (a completion word)", cudaHostGetDevicePointer(&dw, &m->words[0].done, 0));
		CUresult r = m->wait32((CUstream)be->stream, (CUdeviceptr)(uintptr_t)dw, 0, CU_STREAM_WAIT_VALUE_EQ);
		cudaError_t e = r == CUDA_SUCCESS ? cudaStreamSynchronize(be->stream) : cudaSuccess;
		if (r != CUDA_SUCCESS || e != cudaSuccess) {
			snprintf(why, sizeof(why), "cuStreamWaitValue32 on mapped host memory: %s",
				 r != CUDA_SUCCESS ? "refused" : cudaGetErrorString(e));
			if (e != cudaSuccess)
				return cuda_fail(be, e, "the probe of a wait on a CPU expert's word");
			cudaFreeHost(m->ybuf);
			m->ybuf = NULL;
			want = false;
		}
	}
	m->gpu_waits = want;
	if (!want && be->p.cpu_result_mapped && why[0])
		log_info("cuda backend: the CPU's experts are waited for by the host: %s", why);
	return 0;
}

/* Pinned host memory of `bytes` at *host, mapped for the device at *dev where the device can (NULL
 * there else: the caller copies down instead). */
static int host_mapped(struct backend_dev *be, size_t bytes, void **host, void **dev, const char *what)
{
	*dev = NULL;
	cudaError_t e = cudaHostAlloc(host, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
	if (e != cudaSuccess)
		return cuda_fail(be, e, what);
	if (cudaHostGetDevicePointer(dev, *host, 0) != cudaSuccess) {
		(void)cudaGetLastError();
		*dev = NULL;
	}
	return 0;
}

int moe_setup(struct backend_dev *be)
{
	const struct model_config *c = &be->cfg;
	if (!c->n_experts)
		return 0;
	if (!c->n_experts_used || c->n_experts_used > c->n_experts || !c->expert_ffn_dim)
		return cuda_failf(be, -EINVAL, "cuda backend: a mixture-of-experts config needs 0 < experts used (%u) <= "
				  "experts (%u) and an expert size (%u)", c->n_experts_used, c->n_experts,
				  c->expert_ffn_dim);
	struct cuda_moe *m = (struct cuda_moe *)calloc(1, sizeof(*m));
	if (!m)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for the expert state");
	be->moe = m;
	m->E = c->n_experts;
	m->k = c->n_experts_used;
	m->F = c->expert_ffn_dim;
	size_t mc = be->p.max_chunk, dim = c->dim, wide = dim > m->F ? dim : m->F;
	int rc;
	if ((rc = dev_alloc(be, (void **)&m->xn, mc, dim, sizeof(float), "the experts' input rows")) ||
	    (rc = dev_alloc(be, (void **)&m->logits, mc, m->E, sizeof(float), "router logits")) ||
	    (rc = dev_alloc(be, (void **)&m->router_f, m->E, dim, sizeof(float), "a dequantized router")) ||
	    (rc = dev_alloc(be, (void **)&m->sum, mc, dim, sizeof(float), "the experts' sum")) ||
	    (rc = dev_alloc(be, &m->xg, mc, wide, sizeof(float), "an expert's gathered rows")) ||
	    (rc = dev_alloc(be, (void **)&m->gu, mc, 2 * (size_t)m->F, sizeof(float), "an expert's gate/up")) ||
	    (rc = dev_alloc(be, &m->act, mc, m->F, sizeof(float), "an expert's SwiGLU output")) ||
	    (rc = dev_alloc(be, (void **)&m->y, mc, dim, sizeof(float), "an expert's output rows")) ||
	    (rc = dev_alloc(be, (void **)&m->ys, m->k, dim, sizeof(float), "a token's expert rows")) ||
	    (rc = dev_alloc(be, (void **)&m->tok0, 1, 1, sizeof(uint32_t), "a token's row index")) ||
	    (rc = dev_alloc(be, (void **)&m->tok, mc, m->k, sizeof(uint32_t), "the experts' tokens")) ||
	    (rc = dev_alloc(be, (void **)&m->tw, mc, m->k, sizeof(float), "the experts' weights")))
		return rc;
	/* On the backend's stream, which does not wait for the legacy one: before any gather. */
	CUDA_TRY(be, "cudaMemsetAsync (a token's row index)", cudaMemsetAsync(m->tok0, 0, sizeof(uint32_t), be->stream));
	if ((rc = host_mapped(be, mc * m->E * sizeof(float), (void **)&m->h_logits, (void **)&m->h_logits_dev,
			      "router logits")))
		return rc;
	m->sel = (uint32_t *)malloc(mc * m->k * sizeof(uint32_t));
	m->sel_w = (float *)malloc(mc * m->k * sizeof(float));
	m->off = (uint32_t *)malloc((m->E + 1) * sizeof(uint32_t));
	m->h_tok = (uint32_t *)malloc(mc * m->k * sizeof(uint32_t));
	m->h_tw = (float *)malloc(mc * m->k * sizeof(float));
	if (!m->sel || !m->sel_w || !m->off || !m->h_tok || !m->h_tw)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for the routing tables");
	if (!be->p.cpu_pool)
		return 0;
	/* As many jobs as a token chooses experts (at most MOE_CPU_JOBS_MAX), each cut for its share of
	 * the threads: small experts split over all of them would be mostly overhead (larger ones are
	 * cut finer at their first job: ffn_share_threads_for). */
	uint32_t t = task_pool_threads(be->p.cpu_pool);
	m->n_jobs = m->k < MOE_CPU_JOBS_MAX ? m->k : MOE_CPU_JOBS_MAX;
	uint32_t per = t / m->n_jobs ? t / m->n_jobs : 1;
	if (per > FFN_SHARE_MAX_THREADS)
		per = FFN_SHARE_MAX_THREADS;
	m->pool_threads = t;
	size_t rows = (size_t)FFN_SPLIT_MAX_TOKENS * dim;
	m->jobs = (struct moe_cpu_job *)calloc(m->n_jobs, sizeof(*m->jobs));
	m->csum = (float *)malloc(rows * sizeof(float));
	m->cpu = (struct moe_cpu_expert *)calloc(m->E, sizeof(*m->cpu));
	if (!m->jobs || !m->csum || !m->cpu)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for experts on the CPU");
	if ((rc = gpu_waits_setup(be, rows)))
		return rc;
	char why[256];
	for (uint32_t j = 0; j < m->n_jobs; j++) {
		struct moe_cpu_job *cj = &m->jobs[j];
		if (ffn_share_create(c->dim, m->F, FFN_SPLIT_MAX_TOKENS, per, &cj->share, why, sizeof(why)) != 0)
			return cuda_failf(be, -ENOMEM, "cuda backend: experts on the CPU: %s", why);
		cj->per = per;
		cj->x = (float *)malloc(rows * sizeof(float));
		cj->y = m->gpu_waits ? m->ybuf + j * rows : (float *)malloc(rows * sizeof(float));
		if (!cj->x || !cj->y)
			return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for experts on the CPU");
		cj->done = &m->words[j].done;
		cj->waiters = &m->words[j].waiters;
		if (m->gpu_waits) {
			void *dy = NULL, *dw = NULL;
			CUDA_TRY(be, "cudaHostGetDevicePointer (a CPU expert's rows)", cudaHostGetDevicePointer(&dy, cj->y, 0));
			CUDA_TRY(be, "cudaHostGetDevicePointer (a CPU expert's word)",
				 cudaHostGetDevicePointer(&dw, cj->done, 0));
			cj->y_dev = (const float *)dy;
			cj->done_dev = (CUdeviceptr)(uintptr_t)dw;
		}
	}
	if ((rc = host_mapped(be, rows * sizeof(float), (void **)&m->h_xn, (void **)&m->h_xn_dev, "experts' rows for the CPU")))
		return rc;
	return dev_alloc(be, (void **)&m->csum_dev, FFN_SPLIT_MAX_TOKENS, dim, sizeof(float), "the CPU experts' sum");
}

void moe_teardown(struct backend_dev *be)
{
	struct cuda_moe *m = be->moe;
	if (!m)
		return;
	if (be->stream)
		cudaStreamSynchronize(be->stream);
	settle_jobs(m); /* the stream may not have waited for them (a failed step, a sticky error) */
	/* The task pool outlives this backend: the thread that completed the last job may still read
	 * m->waiters. */
	if (m->jobs && be->p.cpu_pool)
		task_pool_quiesce(be->p.cpu_pool);
	for (uint32_t j = 0; m->jobs && j < m->n_jobs; j++) {
		ffn_share_destroy(&m->jobs[j].share);
		free(m->jobs[j].x);
		if (!m->ybuf)
			free(m->jobs[j].y);
	}
	free(m->jobs);
	cudaFreeHost(m->ybuf);
	cudaFreeHost(m->words);
	cudaFreeHost(m->h_xn);
	free(m->csum);
	free(m->cpu);
	cudaFree(m->csum_dev);
	cudaFree(m->xn);
	cudaFree(m->logits);
	cudaFree(m->router_f);
	cudaFree(m->sum);
	cudaFree(m->xg);
	cudaFree(m->gu);
	cudaFree(m->act);
	cudaFree(m->y);
	cudaFree(m->ys);
	cudaFree(m->tok0);
	cudaFree(m->tok);
	cudaFree(m->tw);
	cudaFreeHost(m->h_logits);
	free(m->sel);
	free(m->sel_w);
	free(m->off);
	free(m->h_tok);
	free(m->h_tw);
	free(m);
	be->moe = NULL;
}

int moe_route(struct backend_dev *be, const struct group_weights *w)
{
	const struct model_config *c = &be->cfg;
	struct cuda_moe *m = be->moe;
	const uint32_t n = be->n, dim = c->dim, E = m->E, k = m->k;
	const struct weight_tensor *nw = &w->t[ROLE_FFN_NORM], *rw = &w->t[ROLE_ROUTER];
	/* The normed rows in float32: the router's input and every expert's. */
	int rc = rmsnorm(be, nw->data[PLACE_DEVICE], nw->format, 0, n, DT_F32);
	if (rc)
		return rc;
	/* A decode step's rows for experts the CPU may compute, and its logits: written into mapped host
	 * memory by the kernels where it is mapped (a copy down after each would add its own start to
	 * the host's wait below, a layer at a time). */
	m->xn_down = m->jobs && n <= FFN_SPLIT_MAX_TOKENS;
	const bool mapped = n <= FFN_SPLIT_MAX_TOKENS && m->h_logits_dev && (!m->xn_down || m->h_xn_dev);
	const size_t count = (size_t)n * dim;
	float *xn_host = mapped && m->xn_down ? m->h_xn_dev : NULL;
	xn_kernel<<<grid_for(count, 256), 256, 0, be->stream>>>((const float *)be->xa, m->xn, xn_host, count);
	LAUNCHED(be, "xn_kernel (experts' input rows)");
	const void *rmat = rw->data[PLACE_DEVICE];
	uint32_t rt = rw->format;
	if (!dtype_is_element((enum dtype)rt)) {
		dequant_launch(rt, rmat, rw->row_bytes, E, dim, m->router_f, DT_F32, be->stream);
		LAUNCHED(be, "dequant_kernel (router)");
		rmat = m->router_f;
		rt = DT_F32;
	} else if (rw->row_bytes != (uint64_t)dim * dtype_size((enum dtype)rt)) {
		return cuda_failf(be, -ENOTSUP, "cuda backend: router rows of %llu bytes are not packed (%u values)",
				  (unsigned long long)rw->row_bytes, dim);
	}
	size_t warps = (size_t)n * E;
	router_kernel<<<(unsigned)((warps + 7) / 8), 256, 0, be->stream>>>(m->xn, rmat, rt, dim, E, n,
									  mapped ? m->h_logits_dev : m->logits);
	LAUNCHED(be, "router_kernel");
	if (!mapped)
		CUDA_TRY(be, "cudaMemcpyAsync (router logits)",
			 cudaMemcpyAsync(m->h_logits, m->logits, (size_t)n * E * sizeof(float), cudaMemcpyDeviceToHost,
					 be->stream));
	m->one = n == 1 && k <= MOE_COMBINE_MAX;
	m->xg_ok = false;
	m->n_gpu = 0;
	if (!m->one)
		CUDA_TRY(be, "cudaMemsetAsync (experts' sum)",
			 cudaMemsetAsync(m->sum, 0, (size_t)n * dim * sizeof(float), be->stream));
	if (m->xn_down && !mapped)
		CUDA_TRY(be, "cudaMemcpyAsync (experts' rows for the CPU)",
			 cudaMemcpyAsync(m->h_xn, m->xn, (size_t)n * dim * sizeof(float), cudaMemcpyDeviceToHost,
					 be->stream));
	/* Which experts run decides what comes next: wait for the logits here. With the CPU's experts
	 * of the layer before waited for on the stream, this is where the host waits for them too: the
	 * stream has passed their waits when it returns (its work up to the router was queued before,
	 * none of it behind a wait of the host's). */
	uint64_t t0 = now_ns();
	CUDA_TRY(be, "waiting for the router logits", cudaStreamSynchronize(be->stream));
	m->route_wait_ns += now_ns() - t0;
	/* Jobs of a layer that failed half way are waited for: their slots and buffers are about to be
	 * reused (those the stream waited for are over already, and checked here). */
	settle_jobs(m);
	m->gpu_wait = m->gpu_waits && m->one && m->xn_down;
	m->n_cpu = 0;
	m->collected = 0;
	if ((rc = moe_check(be)))
		return rc;
	/* The gap since the layer before's CPU experts ended (moe_check has counted the last of them). */
	m->route_t1 = now_ns();
	m->gap_pending_ns = m->last_end_ns && m->route_t1 > m->last_end_ns ? m->route_t1 - m->last_end_ns : 0;
	m->last_end_ns = 0;
	bool norm = (c->flags & MODEL_NORM_TOPK) != 0;
	for (uint32_t t = 0; t < n; t++) {
		const float *lg = m->h_logits + (size_t)t * E;
		for (uint32_t e = 0; e < E; e++)
			if (!isfinite(lg[e]))
				return cuda_failf(be, -EIO, "cuda backend: router logit %u of token %u is %g", e, t,
						  (double)lg[e]);
		cpu_moe_route(lg, E, k, norm, m->sel + (size_t)t * k, m->sel_w + (size_t)t * k);
	}
	/* Each expert's tokens in token order (counting sort over the choices). */
	memset(m->off, 0, (E + 1) * sizeof(uint32_t));
	for (uint32_t i = 0; i < n * k; i++)
		m->off[m->sel[i] + 1]++;
	for (uint32_t e = 0; e < E; e++)
		m->off[e + 1] += m->off[e];
	uint32_t *fill = m->h_tok; /* scratch: the next free place of each expert, then the lists */
	uint32_t cur[1024], *next = E <= 1024 ? cur : (uint32_t *)malloc(E * sizeof(uint32_t));
	if (!next)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory routing %u experts", E);
	memcpy(next, m->off, E * sizeof(uint32_t));
	for (uint32_t t = 0; t < n; t++)
		for (uint32_t i = 0; i < k; i++) {
			uint32_t e = m->sel[(size_t)t * k + i], at = next[e]++;
			fill[at] = t;
			m->h_tw[at] = m->sel_w[(size_t)t * k + i];
		}
	if (next != cur)
		free(next);
	/* Up in one copy each (n k entries); one token gathers row 0 (tok0) and its weights go to
	 * combine_kernel by value: nothing to send. */
	if (m->one) {
		m->routed = true;
		return 0;
	}
	size_t cnt = (size_t)n * k, bytes = cnt * sizeof(uint32_t);
	char *h;
	size_t hoff;
	if ((rc = up_alloc(be, 2 * bytes, &h, &hoff)))
		return rc;
	memcpy(h, m->h_tok, bytes);
	memcpy(h + bytes, m->h_tw, bytes);
	if ((rc = up_send(be, m->tok, h, hoff, bytes, "cudaMemcpyAsync (experts' tokens)")) ||
	    (rc = up_send(be, m->tw, h + bytes, hoff + bytes, bytes, "cudaMemcpyAsync (experts' weights)")))
		return rc;
	m->routed = true;
	return 0;
}

bool moe_expert_used(struct backend_dev *be, uint32_t expert)
{
	const struct cuda_moe *m = be->moe;
	return m && m->routed && expert < m->E && m->off[expert + 1] > m->off[expert];
}

int moe_expert(struct backend_dev *be, const struct group_weights *w, uint32_t expert)
{
	const struct model_config *c = &be->cfg;
	struct cuda_moe *m = be->moe;
	if (!moe_expert_used(be, expert))
		return 0;
	const uint32_t o = m->off[expert], cnt = m->off[expert + 1] - o, dim = c->dim, F = m->F;
	const uint32_t gt = w->t[ROLE_EXPERT_GATE].format, ut = w->t[ROLE_EXPERT_UP].format,
		       dt = w->t[ROLE_EXPERT_DOWN].format, at = act_dtype(gt);
	if (act_dtype(ut) != at || act_dtype(dt) != at)
		return cuda_failf(be, -ENOTSUP, "cuda backend: expert %u: gate %s, up %s and down %s take different "
				  "activation dtypes: not supported", expert, dtype_name((enum dtype)gt),
				  dtype_name((enum dtype)ut), dtype_name((enum dtype)dt));
	unsigned blocks = grid_for((size_t)cnt * dim, 256);
	const bool one = m->one;
	if (one && m->n_gpu >= m->k)
		return cuda_failf(be, -EPROTO, "cuda backend: expert %u is the %u-th computed for a token that chose %u",
				  expert, m->n_gpu + 1, m->k);
	/* One token: its row is gathered once a layer (for the first expert, or one of another dtype). */
	if (!one || !m->xg_ok || m->xg_at != at) {
		const uint32_t *tok = one ? m->tok0 : m->tok + o;
		if (at == DT_BF16)
			gather_kernel<<<blocks, 256, 0, be->stream>>>(m->xn, tok, cnt, dim, (__nv_bfloat16 *)m->xg);
		else if (at == DT_F16)
			gather_kernel<<<blocks, 256, 0, be->stream>>>(m->xn, tok, cnt, dim, (__half *)m->xg);
		else
			gather_kernel<<<blocks, 256, 0, be->stream>>>(m->xn, tok, cnt, dim, (float *)m->xg);
		LAUNCHED(be, "gather_kernel (expert rows)");
		m->xg_ok = one;
		m->xg_at = at;
	}
	const struct weight_tensor *g = &w->t[ROLE_EXPERT_GATE], *u = &w->t[ROLE_EXPERT_UP],
				   *d = &w->t[ROLE_EXPERT_DOWN];
	struct mm_part gu[2] = {{g->data[PLACE_DEVICE], F, m->gu, gt, g->row_bytes},
				{u->data[PLACE_DEVICE], F, m->gu + F, ut, u->row_bytes}};
	int rc = swiglu_product(be, at, gu, m->xg, NULL, dim, cnt, m->act, "expert gate/up_proj");
	if (rc)
		return rc;
	float *y = one ? m->ys + (size_t)m->n_gpu * dim : m->y;
	struct mm_part down = {d->data[PLACE_DEVICE], dim, y, dt, d->row_bytes};
	if ((rc = matmul(be, at, m->act, NULL, F, cnt, &down, 1, dim, false, "expert down_proj")))
		return rc;
	if (one) {
		m->yw[m->n_gpu++] = m->h_tw[o];
		return 0;
	}
	scatter_kernel<<<blocks, 256, 0, be->stream>>>(m->y, m->tok + o, m->tw + o, cnt, dim, m->sum);
	LAUNCHED(be, "scatter_kernel (expert sum)");
	return 0;
}

void moe_stats(struct backend_dev *be, struct backend_cpu_share_stats *out)
{
	const struct cuda_moe *m = be->moe;
	if (!m)
		return;
	out->experts = m->cpu_experts;
	out->experts_ms = (double)m->cpu_ns / 1e6;
	out->route_wait_ms = (double)m->route_wait_ns / 1e6;
	out->experts_span_ms = (double)m->span_ns / 1e6;
	out->expert_layers = m->span_layers;
	out->experts_span_bytes = m->span_bytes;
	uint64_t wait = m->wait_ns_gone;
	for (uint32_t j = 0; j < m->n_jobs; j++)
		if (m->jobs[j].share) {
			struct ffn_share_stats ss;
			ffn_share_get_stats(m->jobs[j].share, &ss);
			wait += ss.wait_ns;
		}
	out->experts_phase_wait_ms = (double)wait / 1e6;
	out->experts_gap_gpu_ms = (double)m->gap_gpu_ns / 1e6;
	out->experts_gap_host_ms = (double)m->gap_host_ns / 1e6;
	out->expert_gaps = m->gaps;
}

static struct ffn_share_mat host_mat(const struct weight_tensor *t)
{
	struct ffn_share_mat mt = {t->data[PLACE_HOST], t->format, t->row_bytes};
	return mt;
}

/* The weight bytes of a matrix as the CPU reads them (its rows packed: a host row's stride may be longer). */
static uint64_t mat_bytes(const struct weight_tensor *t)
{
	return (uint64_t)t->rows * dtype_row_bytes((enum dtype)t->format, t->cols);
}

static void job_ended(struct task_job *tj)
{
	((struct moe_cpu_job *)tj->user)->end_ns = now_ns();
}

static int cpu_part(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	struct moe_cpu_job *cj = (struct moe_cpu_job *)arg;
	return ffn_share_part(cj->share, &cj->job, cj->x, cj->y, part, n_parts, err, errlen);
}

/* Waits for CPU expert i (its job in slot i % n_jobs) and adds its weighted rows into csum. Experts
 * are collected in the order they were noted: the sum's order. */
static int cpu_collect(struct backend_dev *be, uint32_t i)
{
	struct cuda_moe *m = be->moe;
	const uint32_t dim = be->cfg.dim;
	const struct moe_cpu_expert *ce = &m->cpu[i];
	struct moe_cpu_job *cj = &m->jobs[i % m->n_jobs];
	task_word_wait(cj->done, cj->waiters, cj->seq, 50, 0);
	if (cj->tj.rc)
		return cuda_failf(be, cj->tj.rc, "cuda backend: expert %u on the CPU: %s", ce->expert, cj->tj.err);
	const uint32_t o = m->off[ce->expert], cnt = m->off[ce->expert + 1] - o;
	for (uint32_t r = 0; r < cnt; r++) {
		float *dst = m->csum + (size_t)m->h_tok[o + r] * dim;
		const float *y = cj->y + (size_t)r * dim, wt = m->h_tw[o + r];
		for (uint32_t d = 0; d < dim; d++)
			dst[d] += y[d] * wt;
	}
	m->cpu_experts++;
	return 0;
}

/* Submitted at once, so the pool computes it while the engine goes on with the GPU's experts (whose
 * copies pace it); its slot's previous job is collected first. */
int moe_expert_cpu(struct backend_dev *be, const struct group_weights *w, uint32_t expert)
{
	struct cuda_moe *m = be->moe;
	if (!moe_expert_used(be, expert))
		return 0;
	if (!m->xn_down)
		return cuda_failf(be, -ENOTSUP, "cuda backend: expert %u on the CPU: a step of %u tokens (the CPU takes "
				  "experts in steps of at most %u, with a CPU pool)", expert, be->n, FFN_SPLIT_MAX_TOKENS);
	uint64_t t0 = now_ns();
	const uint32_t i = m->n_cpu, dim = be->cfg.dim;
	if (m->gpu_wait && i >= m->n_jobs) /* k <= n_jobs: one token's chosen experts all fit */
		return cuda_failf(be, -EPROTO, "cuda backend: expert %u is the CPU's %u-th for one token, which chose %u",
				  expert, i + 1, m->k);
	if (i == 0) {
		m->layer_t0 = t0;
		m->layer_bytes = 0;
		if (m->gap_pending_ns) {
			m->gap_gpu_ns += m->gap_pending_ns;
			m->gap_host_ns += t0 > m->route_t1 ? t0 - m->route_t1 : 0;
			m->gaps++;
			m->gap_pending_ns = 0;
		}
	}
	if (i == 0 && !m->gpu_wait)
		memset(m->csum, 0, (size_t)be->n * dim * sizeof(float));
	if (!m->gpu_wait && i >= m->n_jobs && m->collected <= i - m->n_jobs) {
		int rc = cpu_collect(be, i - m->n_jobs);
		m->collected = i - m->n_jobs + 1;
		if (rc)
			return rc;
	}
	struct moe_cpu_expert *ce = &m->cpu[i];
	ce->expert = expert;
	ce->gate = host_mat(&w->t[ROLE_EXPERT_GATE]);
	ce->up = host_mat(&w->t[ROLE_EXPERT_UP]);
	ce->down = host_mat(&w->t[ROLE_EXPERT_DOWN]);
	struct moe_cpu_job *cj = &m->jobs[i % m->n_jobs];
	const uint32_t o = m->off[expert], cnt = m->off[expert + 1] - o;
	ce->w = m->h_tw[o];
	for (uint32_t r = 0; r < cnt; r++)
		memcpy(cj->x + (size_t)r * dim, m->h_xn + (size_t)m->h_tok[o + r] * dim, dim * sizeof(float));
	const uint64_t bytes = mat_bytes(&w->t[ROLE_EXPERT_GATE]) + mat_bytes(&w->t[ROLE_EXPERT_UP]) +
			       mat_bytes(&w->t[ROLE_EXPERT_DOWN]);
	/* Cut finer for larger experts (ffn_share_threads_for: with the pool's threads over the k jobs,
	 * 1 of 14 on the H200 host, a bf16 expert of Qwen3-30B-A3B, 9.4 MB, went in 12 chunks of 786 KB,
	 * and a layer's last expert ran its down on 4 workers while the others had nothing left); never
	 * coarser again (a model whose layers' experts differ in format would make it anew layer after
	 * layer). The slot's last job is over: collected above, or a layer's before (the route settles
	 * them). */
	const uint32_t per = ffn_share_threads_for(bytes, m->pool_threads);
	if (per > cj->per) {
		char why[256];
		if (cj->share) {
			struct ffn_share_stats ss;
			ffn_share_get_stats(cj->share, &ss);
			m->wait_ns_gone += ss.wait_ns;
		}
		ffn_share_destroy(&cj->share);
		int rc = ffn_share_create(dim, m->F, FFN_SPLIT_MAX_TOKENS, per, &cj->share, why, sizeof(why));
		if (rc)
			return cuda_failf(be, rc, "cuda backend: expert %u on the CPU: %s", expert, why);
		cj->per = per;
	}
	ffn_share_job_init(&cj->job, &ce->gate, &ce->up, &ce->down, m->F, cnt, DT_F32);
	cj->job.taper = true; /* several at once: a phase's last chunks small */
	memset(&cj->tj, 0, sizeof(cj->tj));
	task_job_init(&cj->tj, cpu_part, cj, ffn_share_parts(cj->share), cj->done, ++cj->seq);
	cj->tj.done_waiters = cj->waiters;
	cj->tj.on_complete = job_ended;
	cj->tj.user = cj;
	task_pool_submit(be->p.cpu_pool, &cj->tj); /* -ESHUTDOWN completes the job with its error */
	m->layer_bytes += bytes;
	m->n_cpu++;
	m->cpu_ns += now_ns() - t0;
	return 0;
}

/* Every job submitted and not yet collected waited for, and those the stream waits for (kept for
 * moe_check). */
static void settle_jobs(struct cuda_moe *m)
{
	if (!m->jobs)
		return;
	for (uint32_t i = m->collected; i < m->n_cpu; i++) {
		struct moe_cpu_job *cj = &m->jobs[i % m->n_jobs];
		task_word_wait(cj->done, cj->waiters, cj->seq, 50, 0);
	}
	m->collected = m->n_cpu;
	for (uint32_t i = 0; i < m->n_waited; i++)
		task_word_wait(m->jobs[i].done, m->jobs[i].waiters, m->jobs[i].seq, 50, 0);
}

/* A failed step: its jobs are over, and their results are the failed step's. */
void moe_settle(struct backend_dev *be)
{
	struct cuda_moe *m = be->moe;
	if (!m)
		return;
	settle_jobs(m);
	m->n_waited = 0;
	m->last_end_ns = m->gap_pending_ns = 0;
}

/* A layer's CPU experts (bytes of weights), first submission (t0) to the last of jobs [i0, i1) (slots
 * i % n_jobs) to end. */
static void count_span(struct cuda_moe *m, uint64_t t0, uint32_t i0, uint32_t i1, uint64_t bytes)
{
	uint64_t end = 0;
	for (uint32_t i = i0; i < i1; i++)
		end = m->jobs[i % m->n_jobs].end_ns > end ? m->jobs[i % m->n_jobs].end_ns : end;
	if (i1 > i0 && end > t0) {
		m->span_ns += end - t0;
		m->span_layers++;
		m->last_end_ns = end;
		m->span_bytes += bytes;
	}
}

int moe_check(struct backend_dev *be)
{
	struct cuda_moe *m = be->moe;
	if (!m)
		return 0;
	int rc = 0;
	for (uint32_t i = 0; i < m->n_waited; i++) {
		struct moe_cpu_job *cj = &m->jobs[i];
		task_word_wait(cj->done, cj->waiters, cj->seq, 50, 0); /* at once where the stream has seen it */
		if (cj->tj.rc && !rc)
			rc = cuda_failf(be, cj->tj.rc, "cuda backend: expert %u on the CPU: %s", m->cpu[i].expert,
					cj->tj.err);
	}
	count_span(m, m->waited_t0, 0, m->n_waited, m->waited_bytes);
	m->n_waited = 0;
	return rc;
}

int moe_check_step(struct backend_dev *be)
{
	int rc = moe_check(be);
	if (be->moe)
		be->moe->last_end_ns = be->moe->gap_pending_ns = 0;
	return rc;
}

/* One token's CPU experts, noted this layer: the stream waits for each job's completion word, and
 * combine_kernel reads their rows from mapped host memory (cw). The host goes on. */
static int cpu_experts_waited(struct backend_dev *be, moe_combine_w *cw)
{
	struct cuda_moe *m = be->moe;
	for (uint32_t i = 0; i < m->n_cpu; i++) {
		struct moe_cpu_job *cj = &m->jobs[i];
		/* EQ, not GEQ (an unsigned compare, where seq wraps): a slot's next job is submitted only
		 * after the host's next wait for the stream has passed this one. */
		CUresult r = m->wait32((CUstream)be->stream, cj->done_dev, cj->seq, CU_STREAM_WAIT_VALUE_EQ);
		if (r != CUDA_SUCCESS)
			return cuda_failf(be, -EIO, "cuda backend: cuStreamWaitValue32 (expert %u on the CPU) failed: %d",
					  m->cpu[i].expert, (int)r);
		cw->cpu_y[i] = cj->y_dev;
		cw->cpu_w[i] = m->cpu[i].w;
	}
	cw->n_cpu = m->n_cpu;
	m->n_waited = m->n_cpu;
	m->waited_t0 = m->layer_t0;
	m->waited_bytes = m->layer_bytes;
	m->cpu_experts += m->n_cpu;
	m->n_cpu = 0;
	m->collected = 0;
	return 0;
}

/* The rest of the noted experts collected, in order; csum up. Every submitted job is waited for,
 * a failed one included (its slot and buffers are reused by the next layer). */
static int cpu_experts(struct backend_dev *be, float **sum_dev)
{
	struct cuda_moe *m = be->moe;
	uint64_t t0 = now_ns();
	int rc = 0;
	for (uint32_t i = m->collected; i < m->n_cpu; i++) {
		int r = cpu_collect(be, i);
		if (r && !rc)
			rc = r;
	}
	count_span(m, m->layer_t0, m->n_cpu > m->n_jobs ? m->n_cpu - m->n_jobs : 0, m->n_cpu, m->layer_bytes);
	m->collected = 0;
	m->cpu_ns += now_ns() - t0;
	if (rc)
		return rc;
	char *h;
	size_t off, bytes = (size_t)be->n * be->cfg.dim * sizeof(float);
	if ((rc = up_alloc(be, bytes, &h, &off)))
		return rc;
	memcpy(h, m->csum, bytes);
	if ((rc = up_send(be, m->csum_dev, h, off, bytes, "cudaMemcpyAsync (the CPU experts' sum)")))
		return rc;
	*sum_dev = m->csum_dev;
	return 0;
}

int moe_end(struct backend_dev *be)
{
	struct cuda_moe *m = be->moe;
	m->gap_pending_ns = 0; /* a layer with no CPU expert: no gap */
	size_t count = (size_t)be->n * be->cfg.dim;
	moe_combine_w cw;
	memset(&cw, 0, sizeof(cw));
	if (m->n_cpu && m->gpu_wait) {
		int rc = cpu_experts_waited(be, &cw);
		if (rc)
			return rc;
	} else if (m->n_cpu) {
		float *cs = NULL;
		int rc = cpu_experts(be, &cs);
		m->n_cpu = 0;
		if (rc)
			return rc;
		add_launch(be->x, cs, count, be->stream);
		LAUNCHED(be, "add_kernel (CPU experts' sum)");
	}
	if (m->one) {
		if (m->n_gpu || cw.n_cpu) {
			memcpy(cw.w, m->yw, sizeof(cw.w));
			combine_kernel<<<grid_for(be->cfg.dim, 256), 256, 0, be->stream>>>(be->x, m->ys, m->n_gpu,
										     be->cfg.dim, cw);
			LAUNCHED(be, "combine_kernel (experts' rows)");
		}
	} else {
		add_launch(be->x, m->sum, count, be->stream);
		LAUNCHED(be, "add_kernel (experts' sum)");
	}
	m->routed = false;
	m->one = false;
	m->n_gpu = 0;
	return 0;
}

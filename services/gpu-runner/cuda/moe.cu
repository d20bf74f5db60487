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
 *    so the same logits choose the same experts. The tokens of each expert (in token order, with
 *    their weights) go up in one copy; the sum is cleared.
 *  - expert e: nothing when no token chose it. Else its tokens' xn rows gathered into the
 *    expert's activation dtype, SwiGLU (swiglu_product: the GEMV kernels for one token, cuBLAS or
 *    the quantized paths for more), down_proj into float32 rows y, and sum[token] += y * weight
 *    (each product rounded to float32, then added: the reference's index_add_), experts in
 *    increasing order as the engine gives them: the sum's order is the reference's.
 *  - end: the residual stream += sum.
 *  - a wide chunk (more than FFN_SPLIT_MAX_TOKENS tokens: a prefill chunk, or a step of more
 *    sequences; never with --experts-apart): the same sums in fewer launches, since such a chunk's
 *    experts are mostly their launches (a 512-token prefill layer of Qwen3-30B-A3B: some 90 experts
 *    of 3-18 us kernels). Every routed row is gathered once a layer (xa, in tok's order), each
 *    expert's down_proj writes its rows into ya at their place, and end sums each token's rows in
 *    its experts' order into the residual stream (combine_rows_kernel: s = 0, s += y * w, x += s,
 *    the scatters' and the add's operations and order).
 *  - one token (a decode step of one sequence): the same sums in fewer launches, since the host's
 *    launches, not the GPU, bound such a step (M1R/M2R: 5.4 ms a token all resident, 0.2 ms a layer
 *    of some 50 launches). The token's row goes into the activation dtype once a layer, not once an
 *    expert; each expert's down_proj writes a row of its own (ys); and end adds them all with one
 *    kernel (combine_kernel): s = 0, s += y_j * w_j in the experts' order, x += s, the operations and
 *    order of the sum's memset, scatters and add (with no GPU expert nothing is added, where the
 *    add of a cleared sum turned a -0.0 of x into +0.0: the same value).
 *  - experts the weight window left in host memory go to the CPU pool (moe_cpu.cu); end adds their
 *    rows before the GPU's.
 *  - a one-token layer whose experts the GPU keeps all of is routed on the device instead, with no
 *    wait of the host (moe_device.cu: backend.h's moe_layer), to the same sums.
 *
 * Qwen3 (MODEL_QK_NORM): each head of q and k goes through its RMSNorm over head_dim (q_norm,
 * k_norm) after the projections and before RoPE (qk_norm_kernel, in place in qkv).
 */
#include "services/gpu-runner/cuda/moe_internal.h"
#include "services/gpu-runner/cuda/device.cuh"
#include "common/util.h"
#include "services/gpu-runner/cpu/kernels.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- kernels ------------------------------------------------------------------------------ */

#define ROUTER_BATCH 32 /* values of x and of a router row a lane loads before it adds any */

__global__ void router_kernel(const float *xn, const void *w, uint32_t wt, uint32_t dim, uint32_t E, uint32_t n,
			      float *out, bool early)
{
	const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
	const bool live = warp < n * E;
	const uint32_t t = live ? warp / E : 0, e = live ? warp % E : 0;
	/* ROUTER_BATCH of a lane's values loaded before any is used (one memory round trip each, not
	 * one a value); the products added in d's order as before. With early (w is the model's own
	 * matrix, which no kernel of the step writes), the first batch of weights is loaded before the
	 * wait for the kernel before, while it ends. */
	float wv[ROUTER_BATCH];
	if (early && live) {
#pragma unroll
		for (uint32_t i = 0; i < ROUTER_BATCH; i++) {
			const uint32_t d = lane + 32 * i;
			wv[i] = d < dim ? load_any(w, wt, (size_t)e * dim + d) : 0.0f;
		}
	}
	grid_launch_next();
	grid_wait(); /* xn: the kernels before's (moe_layer launches it programmatically) */
	if (!live)
		return;
	const float *x = xn + (size_t)t * dim;
	float acc = 0.0f;
	for (uint32_t d0 = lane; d0 < dim; d0 += 32 * ROUTER_BATCH) {
		float xv[ROUTER_BATCH];
		const bool have = early && d0 == lane;
#pragma unroll
		for (uint32_t i = 0; i < ROUTER_BATCH; i++) {
			const uint32_t d = d0 + 32 * i;
			xv[i] = d < dim ? x[d] : 0.0f;
			if (!have)
				wv[i] = d < dim ? load_any(w, wt, (size_t)e * dim + d) : 0.0f;
		}
#pragma unroll
		for (uint32_t i = 0; i < ROUTER_BATCH; i++)
			if (d0 + 32 * i < dim)
				acc = __fmaf_rn(xv[i], wv[i], acc);
	}
	for (int o = 16; o > 0; o >>= 1)
		acc += __shfl_xor_sync(0xffffffffu, acc, o);
	if (lane == 0)
		out[(size_t)t * E + e] = acc;
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

/* A wide chunk (cuda_moe.xa): x[t] += the sum over token t's k rows p = pos[t k + j], in j's order
 * (its experts' order), of ya[p] * tw[p], summed from 0, each product rounded: what the scatters
 * of its experts in turn into a cleared sum, then the add, computed. */
__global__ void combine_rows_kernel(float *x, const float *ya, const uint32_t *pos, const float *tw, uint32_t n,
				    uint32_t k, uint32_t dim)
{
	size_t count = (size_t)n * dim;
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
		size_t t = i / dim, d = i % dim;
		float s = 0.0f;
		for (uint32_t j = 0; j < k; j++) {
			const uint32_t p = pos[t * k + j];
			s = __fadd_rn(s, __fmul_rn(ya[(size_t)p * dim + d], tw[p]));
		}
		x[i] = __fadd_rn(x[i], s);
	}
}

/* One token: x[d] += sum over j < cnt of ys[j][d] * w[j] (w.w, or wd in device memory where a
 * kernel chose the experts), summed from 0 in j's order, each product rounded: the scatters into
 * a cleared sum and the add, in one kernel. The CPU's rows first where
 * the stream waited for them (w.n_cpu): their sum, the same way, is added before, as the host's
 * collected sum was. */
__global__ void combine_kernel(float *x, const float *ys, uint32_t cnt, uint32_t dim, const moe_combine_w w,
			       const float *wd)
{
	grid_launch_next();
	grid_wait(); /* ys and wd: the kernels before's (moe_layer launches it programmatically) */
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
				s = __fadd_rn(s, __fmul_rn(ys[(size_t)j * dim + d], wd ? wd[j] : w.w[j]));
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
	grid_launch_next();
	grid_wait(); /* qkv: the projections' (launched programmatically) */
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

int qk_norm(struct backend_dev *be, const void *qn, uint32_t qt, const void *kn, uint32_t kt)
{
	const struct model_config *c = &be->cfg;
	dim3 grid(be->n, c->n_heads + c->n_kv_heads);
	launch_k(be->pdl, qk_norm_kernel, grid, 128, 0, be->stream, be->qkv, be->qkv_ld, c->head_dim, c->n_heads, qn, qt,
		 kn, kt, c->rms_eps);
	LAUNCHED(be, "qk_norm_kernel");
	return 0;
}

/* Pinned host memory of `bytes` at *host, mapped for the device at *dev where the device can (NULL
 * there else: the caller copies down instead). */
int moe_host_mapped(struct backend_dev *be, size_t bytes, void **host, void **dev, const char *what)
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
	m->act_stride = moe_act_stride(m->F);
	int rc;
	if ((rc = dev_alloc(be, (void **)&m->xn, mc, dim, sizeof(float), "the experts' input rows")) ||
	    (rc = dev_alloc(be, (void **)&m->logits, mc, m->E, sizeof(float), "router logits")) ||
	    (rc = dev_alloc(be, (void **)&m->router_f, m->E, dim, sizeof(float), "a dequantized router")) ||
	    (rc = dev_alloc(be, (void **)&m->sum, mc, dim, sizeof(float), "the experts' sum")) ||
	    (rc = dev_alloc(be, &m->xg, mc, wide, sizeof(float), "an expert's gathered rows")) ||
	    (rc = dev_alloc(be, (void **)&m->gu, mc, 2 * (size_t)m->F, sizeof(float), "an expert's gate/up")) ||
	    (rc = dev_alloc(be, &m->act, mc > m->k ? mc : m->k, m->act_stride, 1, "the experts' SwiGLU output")) ||
	    (rc = dev_alloc(be, (void **)&m->y, mc, dim, sizeof(float), "an expert's output rows")) ||
	    (rc = dev_alloc(be, (void **)&m->ys, m->k, dim, sizeof(float), "a token's expert rows")) ||
	    (rc = dev_alloc(be, (void **)&m->tok0, 1, 1, sizeof(uint32_t), "a token's row index")) ||
	    (rc = dev_alloc(be, (void **)&m->tok, mc, m->k, sizeof(uint32_t), "the experts' tokens")) ||
	    (rc = dev_alloc(be, (void **)&m->tw, mc, m->k, sizeof(float), "the experts' weights")))
		return rc;
	/* A prefill chunk's routed rows at once, where they take at most MOE_WIDE_BYTES_MAX. */
	if (mc > FFN_SPLIT_MAX_TOKENS && 2 * mc * m->k * dim * sizeof(float) <= MOE_WIDE_BYTES_MAX) {
		m->wide_rows = (uint32_t)(mc * m->k);
		if ((rc = dev_alloc(be, &m->xa, m->wide_rows, dim, sizeof(float), "a chunk's routed rows")) ||
		    (rc = dev_alloc(be, (void **)&m->ya, m->wide_rows, dim, sizeof(float), "their experts' output rows")) ||
		    (rc = dev_alloc(be, (void **)&m->pos, m->wide_rows, 1, sizeof(uint32_t), "each token's rows")))
			return rc;
	}
	/* On the backend's stream, which does not wait for the legacy one: before any gather. */
	CUDA_TRY(be, "cudaMemsetAsync (a token's row index)", cudaMemsetAsync(m->tok0, 0, sizeof(uint32_t), be->stream));
	if ((rc = moe_host_mapped(be, mc * m->E * sizeof(float), (void **)&m->h_logits, (void **)&m->h_logits_dev,
			      "router logits")))
		return rc;
	m->sel = (uint32_t *)malloc(mc * m->k * sizeof(uint32_t));
	m->sel_w = (float *)malloc(mc * m->k * sizeof(float));
	m->off = (uint32_t *)malloc((m->E + 1) * sizeof(uint32_t));
	m->h_tok = (uint32_t *)malloc(mc * m->k * sizeof(uint32_t));
	m->h_tw = (float *)malloc(mc * m->k * sizeof(float));
	if (!m->sel || !m->sel_w || !m->off || !m->h_tok || !m->h_tw)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for the routing tables");
	for (int i = 0; i < MOE_BEGIN_EVENTS; i++)
		CUDA_TRY(be, "cudaEventCreate (a step's start)", cudaEventCreate(&m->begin_ev[i]));
	CUDA_TRY(be, "cudaEventCreate (a layer's ends)", cudaEventCreate(&m->ends_ev));
	CUDA_TRY(be, "cudaEventCreate (a layer's ends)", cudaEventCreate(&m->routed_ev));
	return moe_cpu_setup(be);
}

void moe_teardown(struct backend_dev *be)
{
	struct cuda_moe *m = be->moe;
	if (!m)
		return;
	if (be->stream)
		cudaStreamSynchronize(be->stream);
	moe_cpu_teardown(be);
	moe_dev_teardown(be);
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
	cudaFree(m->xa);
	cudaFree(m->ya);
	cudaFree(m->pos);
	cudaFreeHost(m->h_logits);
	for (int i = 0; i < MOE_BEGIN_EVENTS; i++)
		if (m->begin_ev[i])
			cudaEventDestroy(m->begin_ev[i]);
	if (m->ends_ev)
		cudaEventDestroy(m->ends_ev);
	if (m->routed_ev)
		cudaEventDestroy(m->routed_ev);
	free(m->sel);
	free(m->sel_w);
	free(m->off);
	free(m->h_tok);
	free(m->h_tw);
	free(m);
	be->moe = NULL;
}

int moe_router_matrix(struct backend_dev *be, const struct weight_tensor *rw, const void **rmat, uint32_t *rt)
{
	const uint32_t E = be->moe->E, dim = be->cfg.dim;
	*rmat = rw->data[PLACE_DEVICE];
	*rt = rw->format;
	if (!dtype_is_element((enum dtype)*rt)) {
		dequant_launch(*rt, *rmat, rw->row_bytes, E, dim, be->moe->router_f, DT_F32, be->stream);
		LAUNCHED(be, "dequant_kernel (router)");
		*rmat = be->moe->router_f;
		*rt = DT_F32;
	} else if (rw->row_bytes != (uint64_t)dim * dtype_size((enum dtype)*rt)) {
		return cuda_failf(be, -ENOTSUP, "cuda backend: router rows of %llu bytes are not packed (%u values)",
				  (unsigned long long)rw->row_bytes, dim);
	}
	return 0;
}

int moe_route(struct backend_dev *be, const struct group_weights *w)
{
	const struct model_config *c = &be->cfg;
	struct cuda_moe *m = be->moe;
	const uint32_t n = be->n, dim = c->dim, E = m->E, k = m->k;
	const struct weight_tensor *nw = &w->t[ROLE_FFN_NORM], *rw = &w->t[ROLE_ROUTER];
	const uint64_t t_in = now_ns();
	/* A step's first routing after its embedding, both steps of the CPU's experts' sizes, the step
	 * before returned (step_ret_ns) within MOE_STEP_GAP_MAX_MS: its start timed (moe_internal.h). */
	bool timed = moe_begin_timed(be, t_in, n <= FFN_SPLIT_MAX_TOKENS);
	/* A decode step's rows for experts the CPU may compute, and its logits: written into mapped host
	 * memory by the kernels where it is mapped (a copy down after each would add its own start to
	 * the host's wait below, a layer at a time). */
	m->xn_down = m->jobs && n <= FFN_SPLIT_MAX_TOKENS;
	const bool mapped = n <= FFN_SPLIT_MAX_TOKENS && m->h_logits_dev && (!m->xn_down || m->h_xn_dev);
	float *xn_host = mapped && m->xn_down ? m->h_xn_dev : NULL;
	/* The normed rows in float32 (xn: the router's input and every expert's; the CPU's copy). */
	int rc = rmsnorm_f32(be, nw->data[PLACE_DEVICE], nw->format, 0, n, m->xn, xn_host);
	if (rc)
		return rc;
	const void *rmat;
	uint32_t rt;
	if ((rc = moe_router_matrix(be, rw, &rmat, &rt)))
		return rc;
	/* A plain launch: the host route's kernels launched programmatically (this one, the token's
	 * gather, the combine) measured slower in a layer routed here (run-local, top 9 of 128 Q4_K
	 * experts: 8 layers 160.0 -> 178.8 ms for 128 tokens, medians of three; docs/design.md). */
	size_t warps = (size_t)n * E;
	router_kernel<<<(unsigned)((warps + 7) / 8), 256, 0, be->stream>>>(m->xn, rmat, rt, dim, E, n,
									  mapped ? m->h_logits_dev : m->logits, false);
	LAUNCHED(be, "router_kernel");
	if (!mapped)
		CUDA_TRY(be, "cudaMemcpyAsync (router logits)",
			 cudaMemcpyAsync(m->h_logits, m->logits, (size_t)n * E * sizeof(float), cudaMemcpyDeviceToHost,
					 be->stream));
	timed = timed && moe_time_mark(m->begin_ev[MOE_EV_ROUTED], be->stream);
	/* The router's end, where the layer before marked its GPU experts' (backend_moe_ends). */
	m->routed_marked = m->ends_marked && n == 1 && moe_time_mark(m->routed_ev, be->stream);
	m->ends_marked = false;
	m->one = n == 1 && k <= MOE_COMBINE_MAX;
	m->wide = n > FFN_SPLIT_MAX_TOKENS && (size_t)n * k <= m->wide_rows && !be->p.experts_apart;
	m->xa_ok = false;
	m->wide_done = 0;
	m->xg_ok = false;
	m->n_gpu = 0;
	m->n_held = 0;
	if (!m->one && !m->wide)
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
	const uint64_t t1 = now_ns();
	m->route_sync_ns = t1;
	m->route_wait_ns += t1 - t0;
	if (n <= FFN_SPLIT_MAX_TOKENS)
		m->route_wait_step_ns += t1 - t0;
	if (timed)
		(void)moe_begin_count(m, t_in - m->step_ret_ns, t1 - t0);
	/* Jobs of a layer that failed half way are waited for: their slots and buffers are about to be
	 * reused (those the stream waited for are over already, and checked here). */
	moe_settle_jobs(m);
	m->gpu_wait = m->gpu_waits && m->one && m->xn_down;
	m->n_cpu = 0;
	m->collected = 0;
	if ((rc = moe_check(be)))
		return rc;
	moe_cpu_routed(m); /* the gap since the layer before's CPU experts ended (moe_check counted them) */
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
	if ((rc = up_alloc(be, (m->wide ? 3 : 2) * bytes, &h, &hoff)))
		return rc;
	memcpy(h, m->h_tok, bytes);
	memcpy(h + bytes, m->h_tw, bytes);
	if (m->wide) {
		/* Each token's rows in increasing place, which is its experts' order. */
		uint32_t *pos = (uint32_t *)(h + 2 * bytes), *seen = m->sel; /* sel: read above, free now */
		memset(seen, 0, n * sizeof(uint32_t));
		for (uint32_t p = 0; p < cnt; p++) {
			const uint32_t t = m->h_tok[p];
			pos[(size_t)t * k + seen[t]++] = p;
		}
	}
	if ((rc = up_send(be, m->tok, h, hoff, bytes, "cudaMemcpyAsync (experts' tokens)")) ||
	    (rc = up_send(be, m->tw, h + bytes, hoff + bytes, bytes, "cudaMemcpyAsync (experts' weights)")) ||
	    (m->wide && (rc = up_send(be, m->pos, h + 2 * bytes, hoff + 2 * bytes, bytes,
				      "cudaMemcpyAsync (each token's expert rows)"))))
		return rc;
	m->routed = true;
	return 0;
}

/* The noted kept experts of one token, launched together. */
static int flush_held(struct backend_dev *be)
{
	struct cuda_moe *m = be->moe;
	if (!m->n_held)
		return 0;
	const uint32_t n = m->n_held;
	m->n_held = 0;
	return experts_batch(be, m->held, n, m->xg, be->cfg.dim, m->F, NULL, NULL);
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
	int rc;
	/* Split with the CPU (the window's route, a decode step): the pool takes intermediate rows
	 * [r, F) from host memory, submitted first so that it computes while the GPU's rows arrive
	 * (FFN_SPLIT_GIVEN: submitted at the route already, moe_expert_cpu_share); the GPU computes
	 * rows [0, r) below. Each side's row is weighed by the router as a whole expert's is, and the
	 * two are summed with the layer's others (moe_end). */
	if (w->split.where == FFN_SPLIT_CPU && (rc = moe_expert_cpu_share(be, &w->split, expert)))
		return rc;
	/* F: the intermediate rows this side computes (the expert's, or the GPU's share of a split one). */
	const uint32_t o = m->off[expert], cnt = m->off[expert + 1] - o, dim = c->dim,
		       F = w->t[ROLE_EXPERT_GATE].rows;
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
	/* One token: its row is gathered once a layer (for the first expert, or one of another dtype);
	 * a wide chunk every routed row at once, the same way. */
	const size_t asz = at == DT_F32 ? sizeof(float) : 2;
	const void *xin = m->xg;
	if (m->wide) {
		if (!m->xa_ok || m->xa_at != at) {
			const size_t rows = (size_t)be->n * m->k;
			const unsigned ab = grid_for(rows * dim, 256);
			if (at == DT_BF16)
				gather_kernel<<<ab, 256, 0, be->stream>>>(m->xn, m->tok, rows, dim, (__nv_bfloat16 *)m->xa);
			else if (at == DT_F16)
				gather_kernel<<<ab, 256, 0, be->stream>>>(m->xn, m->tok, rows, dim, (__half *)m->xa);
			else
				gather_kernel<<<ab, 256, 0, be->stream>>>(m->xn, m->tok, rows, dim, (float *)m->xa);
			LAUNCHED(be, "gather_kernel (a chunk's routed rows)");
			m->xa_ok = true;
			m->xa_at = at;
		}
		xin = (const char *)m->xa + (size_t)o * dim * asz;
	} else if (!one || !m->xg_ok || m->xg_at != at) {
		/* The noted experts read xg as it is. */
		if ((rc = flush_held(be)))
			return rc;
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
	/* One token: each expert its own row of act, so that noted ones keep theirs. */
	void *act = one ? (char *)m->act + (size_t)m->n_gpu * m->act_stride : m->act;
	float *y = one ? m->ys + (size_t)m->n_gpu * dim : m->wide ? m->ya + (size_t)o * dim : m->y;
	struct mm_part down = {d->data[PLACE_DEVICE], dim, y, dt, d->row_bytes};
	if (one && w->resident && !be->p.experts_apart) {
		/* Kept on the GPU to the step's end: noted, and launched with the layer's others. */
		const struct mm_expert ex = {gu[0], gu[1], down, act};
		if (expert_batch_fits(be, &ex, dim, F, m->xg)) {
			if (m->n_held && !expert_batch_joins(&m->held[0], &ex) && (rc = flush_held(be)))
				return rc;
			m->held[m->n_held++] = ex;
			m->yw[m->n_gpu++] = m->h_tw[o];
			return m->n_held == GEMV_MATS ? flush_held(be) : 0;
		}
	}
	if ((rc = swiglu_product(be, at, gu, xin, NULL, dim, cnt, act, "expert gate/up_proj")))
		return rc;
	if ((rc = matmul(be, at, act, NULL, F, cnt, &down, 1, dim, false, "expert down_proj")))
		return rc;
	if (one) {
		m->yw[m->n_gpu++] = m->h_tw[o];
		return 0;
	}
	if (m->wide) {
		m->wide_done += cnt; /* summed at moe_end */
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
	out->route_wait_ms = (double)m->route_wait_ns / 1e6;
	out->route_wait_step_ms = (double)m->route_wait_step_ns / 1e6;
	moe_cpu_stats(m, out);
}

int moe_end(struct backend_dev *be)
{
	struct cuda_moe *m = be->moe;
	size_t count = (size_t)be->n * be->cfg.dim;
	moe_combine_w cw;
	memset(&cw, 0, sizeof(cw));
	/* The kept experts first: the GPU computes them while the stream's waits for the CPU's follow. */
	int rc = flush_held(be);
	if (rc)
		return rc;
	/* The GPU's side of a token's layer with CPU experts ends here on the stream (the waits for the
	 * CPU's follow): timed against the CPU's end at the next routing (backend_moe_ends). */
	m->ends_marked = m->one && m->n_cpu && m->gpu_wait && moe_time_mark(m->ends_ev, be->stream);
	if ((rc = moe_cpu_end(be, &cw)))
		return rc;
	if (m->one) {
		if (m->n_gpu || cw.n_cpu) {
			memcpy(cw.w, m->yw, sizeof(cw.w));
			combine_kernel<<<grid_for(be->cfg.dim, 256), 256, 0, be->stream>>>(be->x, m->ys, m->n_gpu,
										     be->cfg.dim, cw, NULL);
			LAUNCHED(be, "combine_kernel (experts' rows)");
		}
	} else if (m->wide) {
		/* Every routed row computed: an expert left out would leave stale rows in ya. */
		if (m->wide_done != be->n * m->k)
			return cuda_failf(be, -EPROTO, "cuda backend: the experts computed %u of the chunk's %u routed rows",
					  m->wide_done, be->n * m->k);
		combine_rows_kernel<<<grid_for(count, 256), 256, 0, be->stream>>>(be->x, m->ya, m->pos, m->tw, be->n,
										   m->k, be->cfg.dim);
		LAUNCHED(be, "combine_rows_kernel (experts' sum)");
	} else {
		add_launch(be->x, m->sum, count, be->stream);
		LAUNCHED(be, "add_kernel (experts' sum)");
	}
	m->routed = false;
	m->wide = false;
	m->one = false;
	m->n_gpu = 0;
	return 0;
}

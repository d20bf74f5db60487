/* moe_device.cu - a mixture-of-experts layer of one token routed on the device (backend.h:
 * moe_layer_experts, moe_layer, moe_layer_chosen), for layers whose every expert stays in device
 * memory.
 *
 * moe_route (moe.cu) waits for the router's logits on the host, which then picks the experts and
 * launches their products: a wait and a restart of the stream each layer, and every launch after
 * it runs when the host gets to it. Where the weight window keeps all of a layer's experts, their
 * addresses go into a table in device memory once (moe_layer_experts), and a one-token step's
 * layer runs without the host, each kernel launched beside the one before (programmatic launches;
 * each waits for it before it reads what it wrote): RMSNorm, the router (router_kernel), then pick_kernel, which
 * routes as cpu_moe_route does (the same softmax in double, the same order of the top k, the same
 * normalised weights), writes the chosen experts' matrix addresses where the experts' two
 * launches read them (gemv_mats.wd) and the token's row in their activation dtype, then the two
 * launches (experts_batch with those) and combine_kernel with the weights it wrote. The chosen ids go
 * to mapped host memory for the engine's counts (moe_layer_chosen, after the step: the stream
 * waited for then, as the step's output has been already); a logit that is not finite is flagged
 * there and fails the step at its end (moe_dev_check), the step's first k experts chosen with
 * weights 0 meanwhile.
 *
 * The sums are the host route's: the same experts in the same order through the same kernels
 * (each expert's products are those of experts_batch, each the expert's own launch's), and
 * combine_kernel's order. */
#include "services/gpu-runner/cuda/moe_internal.h"
#include "services/gpu-runner/cuda/device.cuh"
#include "common/util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Pointers of the chosen experts' matrices (gemv_mats.wd): gate, up, then down. */
#define WSEL_GATE 0
#define WSEL_DOWN (2 * GEMV_MATS)
#define WSEL_COUNT (3 * GEMV_MATS)
#define PICK_THREADS 256
#define PICK_BATCH 8 /* values a thread of pick_kernel loads before it stores any */
#define PICK_SUM_BATCH 16 /* values of shared memory loaded before they are added */

/* One block. The router's E logits of the token: the softmax as cpu_moe_route computes it (the
 * maximum, exp(l - max) in double, their sum in double in expert order, each probability rounded
 * to float32), the top k in descending probability with equal ones in expert order (rank r of
 * expert e: the experts above it, and the equal ones before it), normalised in float32 in that
 * order where norm. Writes the chosen ones in increasing expert order (the host's route's order
 * of their products and sum): their weights (w), ids (ids, mapped host memory), matrix addresses
 * from tab (E rows of gate, up, down) into wsel, and the token's normed row xn into xg
 * in the activation dtype. A logit that is not finite sets *err (layer + 1) and bad. */
template <typename T>
__global__ void __launch_bounds__(PICK_THREADS) pick_kernel(const float *logits, uint32_t E, uint32_t k, bool norm,
							   const void *const *tab, const float *xn, uint32_t dim,
							   T *xg, const void **wsel, float *w, uint32_t *ids,
							   uint32_t *err, uint32_t layer)
{
	extern __shared__ double ex[]; /* (E) exp(l - max); after it (E floats) the logits, then p */
	float *p = (float *)(ex + E);
	__shared__ float s_wmx[PICK_THREADS / 32];
	__shared__ double s_sum;
	__shared__ uint32_t s_ids[GEMV_MATS];
	__shared__ float s_w[GEMV_MATS];
	const uint32_t t = threadIdx.x;
	grid_launch_next();
	grid_wait(); /* the logits and xn: the kernels before's */
	if (t < k) { /* the choice where a logit is not finite (no ranks then; the step fails) */
		s_ids[t] = t;
		s_w[t] = 0.0f;
	}
	/* The logits into shared memory and xn into xg: PICK_BATCH values a thread loaded before any
	 * is stored (a round trip each, not one a value); the maximum and the check of every logit
	 * by all threads at once. A maximum does not depend on the order it is taken in. */
	float mx = -INFINITY;
	bool bad = false;
	for (uint32_t e0 = t; e0 < E; e0 += PICK_BATCH * PICK_THREADS) {
		float v[PICK_BATCH];
#pragma unroll
		for (uint32_t i = 0; i < PICK_BATCH; i++)
			v[i] = e0 + i * PICK_THREADS < E ? logits[e0 + i * PICK_THREADS] : 0.0f;
#pragma unroll
		for (uint32_t i = 0; i < PICK_BATCH; i++) {
			if (e0 + i * PICK_THREADS < E) {
				p[e0 + i * PICK_THREADS] = v[i];
				bad = bad || !isfinite(v[i]);
				mx = fmaxf(mx, v[i]);
			}
		}
	}
	for (uint32_t d0 = t; d0 < dim; d0 += PICK_BATCH * PICK_THREADS) {
		float v[PICK_BATCH];
#pragma unroll
		for (uint32_t i = 0; i < PICK_BATCH; i++)
			v[i] = d0 + i * PICK_THREADS < dim ? xn[d0 + i * PICK_THREADS] : 0.0f;
#pragma unroll
		for (uint32_t i = 0; i < PICK_BATCH; i++)
			if (d0 + i * PICK_THREADS < dim)
				xg[d0 + i * PICK_THREADS] = from_f32<T>(v[i]);
	}
	mx = warp_max(mx);
	if (t % 32 == 0)
		s_wmx[t / 32] = mx;
	const bool s_bad = __syncthreads_or(bad) != 0;
	if (t == 0 && s_bad && *err == 0)
		*err = layer + 1;
	for (uint32_t i = 0; i < PICK_THREADS / 32; i++)
		mx = fmaxf(mx, s_wmx[i]);
	for (uint32_t e = t; e < E; e += blockDim.x)
		ex[e] = exp((double)p[e] - (double)mx);
	__syncthreads();
	if (t == 0) {
		/* In expert order, as the host's: one thread's chain of adds, so nothing else on it
		 * (whole batches of PICK_SUM_BATCH loads, then their adds, without bounds; the rest one
		 * by one). */
		double sum = 0;
		uint32_t e0 = 0;
		for (; e0 + PICK_SUM_BATCH <= E; e0 += PICK_SUM_BATCH) {
			double v[PICK_SUM_BATCH];
#pragma unroll
			for (uint32_t i = 0; i < PICK_SUM_BATCH; i++)
				v[i] = ex[e0 + i];
#pragma unroll
			for (uint32_t i = 0; i < PICK_SUM_BATCH; i++)
				sum += v[i];
		}
		for (; e0 < E; e0++)
			sum += ex[e0];
		s_sum = sum;
	}
	__syncthreads();
	for (uint32_t e = t; e < E; e += blockDim.x)
		p[e] = (float)(ex[e] / s_sum);
	__syncthreads();
	/* Not finite: the first k experts, weights 0 (the step fails at its end; their slots all
	 * written, with this layer's matrices). */
	for (uint32_t e = t; e < E && !s_bad; e += blockDim.x) {
		/* Its rank: the experts above it, and the equal ones before it (p[o] > pe, or p[o] == pe
		 * and o < e: p[o] >= pe below e, p[o] > pe after it). Every comparison made, none
		 * waiting on the count (a loop that stopped at k was a chain of ~14 instructions an
		 * expert, 11 us of the kernel's 12 at 128 experts). */
		const float pe = p[e];
		uint32_t r = 0;
#pragma unroll 8
		for (uint32_t o = 0; o < e; o++)
			r += p[o] >= pe;
#pragma unroll 8
		for (uint32_t o = e + 1; o < E; o++)
			r += p[o] > pe;
		if (r < k) {
			s_ids[r] = e;
			s_w[r] = pe;
		}
	}
	__syncthreads();
	if (t == 0 && norm && !s_bad) {
		float s = 0;
		for (uint32_t i = 0; i < k; i++)
			s += s_w[i];
		for (uint32_t i = 0; i < k; i++)
			s_w[i] /= s;
	}
	__syncthreads();
	if (t < k) {
		/* In increasing expert order, the order the host's route computes and sums them in. */
		const uint32_t e = s_ids[t];
		uint32_t j = 0;
		for (uint32_t i = 0; i < k; i++)
			j += s_ids[i] < e;
		w[j] = s_w[t];
		ids[j] = e;
		wsel[WSEL_GATE + j] = tab[3 * (size_t)e];
		wsel[WSEL_GATE + GEMV_MATS + j] = tab[3 * (size_t)e + 1];
		wsel[WSEL_DOWN + j] = tab[3 * (size_t)e + 2];
	}
}

/* The device's side of routing, allocated at the first table. */
struct moe_dev {
	const void **tab;	/* device: (n_layers, E, 3) gate, up, down of each expert */
	const void **wsel;	/* device: (WSEL_COUNT) the chosen experts' matrices */
	float *w;		/* device: (k) their weights */
	uint32_t *h_ids;	/* pinned, mapped: (n_layers, k) each layer's chosen experts, the last step's */
	uint32_t *h_ids_dev;
	uint32_t *h_err;	/* pinned, mapped: a layer + 1 whose logits were not finite, 0: none */
	uint32_t *h_err_dev;
	struct mm_expert *fmt;	/* (n_layers) each layer's formats and row sizes (gate.w set: a table) */
	bool *routed;		/* (n_layers) moe_layer routed it since the last check */
	bool any;		/* some layer was */
	bool synced;		/* the stream waited for since the last moe_layer */
};

static int dev_setup(struct backend_dev *be)
{
	struct cuda_moe *m = be->moe;
	if (m->dev)
		return 0;
	const uint32_t L = be->cfg.n_layers;
	struct moe_dev *d = (struct moe_dev *)calloc(1, sizeof(*d));
	if (!d)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for device routing");
	m->dev = d;
	d->fmt = (struct mm_expert *)calloc(L, sizeof(struct mm_expert));
	d->routed = (bool *)calloc(L, sizeof(bool));
	if (!d->fmt || !d->routed)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for device routing");
	int rc;
	if ((rc = dev_alloc(be, (void **)&d->tab, (size_t)L * m->E, 3, sizeof(void *), "the experts' table")) ||
	    (rc = dev_alloc(be, (void **)&d->wsel, WSEL_COUNT, 1, sizeof(void *), "the chosen experts' matrices")) ||
	    (rc = dev_alloc(be, (void **)&d->w, m->k, 1, sizeof(float), "the chosen experts' weights")) ||
	    (rc = moe_host_mapped(be, (size_t)L * m->k * sizeof(uint32_t), (void **)&d->h_ids, (void **)&d->h_ids_dev,
				  "the chosen experts")) ||
	    (rc = moe_host_mapped(be, sizeof(uint32_t), (void **)&d->h_err, (void **)&d->h_err_dev,
				  "the routing's error word")))
		return rc;
	if (!d->h_ids_dev || !d->h_err_dev)
		return cuda_failf(be, -ENOTSUP, "cuda backend: device routing needs host memory the device maps");
	*d->h_err = 0;
	CUDA_TRY(be, "cudaMemsetAsync (the chosen experts' matrices)",
		 cudaMemsetAsync(d->wsel, 0, WSEL_COUNT * sizeof(void *), be->stream));
	return 0;
}

void moe_dev_teardown(struct backend_dev *be)
{
	struct moe_dev *d = be->moe ? be->moe->dev : NULL;
	if (!d)
		return;
	cudaFree(d->tab);
	cudaFree(d->wsel);
	cudaFree(d->w);
	cudaFreeHost(d->h_ids);
	cudaFreeHost(d->h_err);
	free(d->fmt);
	free(d->routed);
	free(d);
	be->moe->dev = NULL;
}

int moe_layer_experts(struct backend_dev *be, uint32_t layer, const struct group_weights *experts)
{
	struct cuda_moe *m = be->moe;
	const struct model_config *c = &be->cfg;
	if (!m || layer >= c->n_layers)
		return cuda_failf(be, -EINVAL, "cuda backend: moe_layer_experts: layer %u of a model of %u layers%s", layer,
				  c->n_layers, m ? "" : " and no experts");
	if (!experts) { /* forgotten */
		if (m->dev)
			m->dev->fmt[layer].gate.w = NULL;
		return 0;
	}
	int rc = dev_setup(be);
	if (rc)
		return rc;
	struct moe_dev *d = m->dev;
	d->fmt[layer].gate.w = NULL;
	if (be->p.experts_apart || be->p.moe_host_route)
		return cuda_failf(be, -ENOTSUP, "cuda backend: experts routed on the host (%s)",
				  be->p.experts_apart ? "--experts-apart" : "--moe-host-route");
	static_assert(GEMV_MATS <= PICK_THREADS, "a thread of pick_kernel for each chosen expert");
	if (m->k > GEMV_MATS)
		return cuda_failf(be, -ENOTSUP, "cuda backend: %u experts a token do not go in one launch (%u at most)",
				  m->k, GEMV_MATS);
	const uint32_t dim = c->dim, F = m->F, E = m->E;
	/* pick_kernel's dynamic shared memory, beside its few static bytes, within the default 48 KiB. */
	if ((size_t)E * (sizeof(double) + sizeof(float)) > 46 * 1024)
		return cuda_failf(be, -ENOTSUP, "cuda backend: %u experts do not fit the routing kernel", E);
	const void **h = (const void **)malloc((size_t)E * 3 * sizeof(void *));
	if (!h)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for the experts' table");
	struct mm_expert first;
	memset(&first, 0, sizeof(first));
	for (uint32_t e = 0; e < E; e++) {
		const struct weight_tensor *g = &experts[e].t[ROLE_EXPERT_GATE], *u = &experts[e].t[ROLE_EXPERT_UP],
					   *dn = &experts[e].t[ROLE_EXPERT_DOWN];
		/* Any act row of the token's (moe_act_stride apart from act, 16-byte aligned) and ys. */
		const struct mm_expert ex = {{g->data[PLACE_DEVICE], F, m->ys, g->format, g->row_bytes},
					     {u->data[PLACE_DEVICE], F, m->ys, u->format, u->row_bytes},
					     {dn->data[PLACE_DEVICE], dim, m->ys, dn->format, dn->row_bytes},
					     m->act};
		bool ok = ex.gate.w && ex.up.w && ex.down.w && g->rows == F && g->cols == dim && u->rows == F &&
			  u->cols == dim && dn->rows == dim && dn->cols == F;
		/* Every matrix 16-byte aligned (what each kernel of the batch may read with) and all of
		 * one set of formats. */
		ok = ok && (uintptr_t)ex.gate.w % 16 == 0 && (uintptr_t)ex.up.w % 16 == 0 && (uintptr_t)ex.down.w % 16 == 0;
		ok = ok && expert_batch_fits(be, &ex, dim, F, m->xg) && (e == 0 || expert_batch_joins(&first, &ex));
		if (!ok) {
			free(h);
			return cuda_failf(be, -ENOTSUP, "cuda backend: expert %u of layer %u does not go in the layer's "
					  "launches (%s/%s/%s)", e, layer, dtype_name((enum dtype)g->format),
					  dtype_name((enum dtype)u->format), dtype_name((enum dtype)dn->format));
		}
		if (e == 0)
			first = ex;
		h[3 * e] = ex.gate.w;
		h[3 * e + 1] = ex.up.w;
		h[3 * e + 2] = ex.down.w;
	}
	/* Synchronous: the host array goes right after. */
	cudaError_t ce = cudaMemcpyAsync(d->tab + (size_t)layer * E * 3, h, (size_t)E * 3 * sizeof(void *),
					 cudaMemcpyHostToDevice, be->stream);
	if (ce == cudaSuccess)
		ce = cudaStreamSynchronize(be->stream);
	free(h);
	if (ce != cudaSuccess)
		return cuda_fail(be, ce, "cudaMemcpyAsync (the experts' table)");
	d->fmt[layer] = first;
	return 0;
}

int moe_layer(struct backend_dev *be, const struct group_weights *w, uint32_t layer)
{
	struct cuda_moe *m = be->moe;
	const struct model_config *c = &be->cfg;
	struct moe_dev *d = m ? m->dev : NULL;
	if (!d || layer >= c->n_layers || !d->fmt[layer].gate.w)
		return cuda_failf(be, -EINVAL, "cuda backend: moe_layer: layer %u has no experts' table", layer);
	if (be->n != 1)
		return cuda_failf(be, -EINVAL, "cuda backend: moe_layer takes one token, not %u", be->n);
	m->ends_marked = false; /* a layer between: the next routing measures no ends */
	/* The step's first routing (moe_internal.h: begin), on the device: its router timed, read at the
	 * step's end. */
	const uint64_t t_in = now_ns();
	const bool timed = moe_begin_timed(be, t_in, true);
	const uint32_t dim = c->dim, E = m->E, k = m->k, F = m->F;
	const struct weight_tensor *nw = &w->t[ROLE_FFN_NORM], *rw = &w->t[ROLE_ROUTER];
	/* The normed row in float32 (xa), the router's input and the experts'. */
	int rc = rmsnorm(be, nw->data[PLACE_DEVICE], nw->format, 0, 1, DT_F32);
	if (rc)
		return rc;
	const void *rmat;
	uint32_t rt;
	if ((rc = moe_router_matrix(be, rw, &rmat, &rt)))
		return rc;
	const float *xn = (const float *)be->xa;
	launch_k(be->pdl, router_kernel, (E + 7) / 8, 256, 0, be->stream, xn, rmat, rt, dim, E, 1u, m->logits,
		 rmat == rw->data[PLACE_DEVICE]);
	LAUNCHED(be, "router_kernel");
	if (timed && moe_time_mark(m->begin_ev[MOE_EV_ROUTED], be->stream)) {
		m->begin_dev = true;
		m->begin_dev_host_ns = t_in - m->step_ret_ns;
	}
	const struct mm_expert *f = &d->fmt[layer];
	const uint32_t at = act_dtype(f->gate.format);
	const size_t smem = (size_t)E * (sizeof(double) + sizeof(float));
	const bool norm = (c->flags & MODEL_NORM_TOPK) != 0;
	const void *const *tab = d->tab + (size_t)layer * E * 3;
	uint32_t *ids = d->h_ids_dev + (size_t)layer * k;
	const float *lg = m->logits;
	const void **wsel = d->wsel;
	float *wo = d->w;
	uint32_t *err = d->h_err_dev;
	if (at == DT_BF16)
		launch_k(be->pdl, pick_kernel<__nv_bfloat16>, 1, PICK_THREADS, smem, be->stream, lg, E, k, norm, tab, xn,
			 dim, (__nv_bfloat16 *)m->xg, wsel, wo, ids, err, layer);
	else
		launch_k(be->pdl, pick_kernel<__half>, 1, PICK_THREADS, smem, be->stream, lg, E, k, norm, tab, xn, dim,
			 (__half *)m->xg, wsel, wo, ids, err, layer);
	LAUNCHED(be, "pick_kernel (the token's experts)");
	d->routed[layer] = d->any = true; /* its flag is read at the step's end, whatever follows */
	d->synced = false;
	struct mm_expert ex[GEMV_MATS];
	for (uint32_t j = 0; j < k; j++) {
		ex[j] = *f;
		ex[j].act = (char *)m->act + (size_t)j * m->act_stride;
		ex[j].down.out = m->ys + (size_t)j * dim;
	}
	if ((rc = experts_batch(be, ex, k, m->xg, dim, F, d->wsel + WSEL_GATE, d->wsel + WSEL_DOWN)))
		return rc;
	moe_combine_w cw;
	memset(&cw, 0, sizeof(cw));
	const float *ys = m->ys, *wd = d->w;
	launch_k(be->pdl, combine_kernel, grid_for(dim, 256), 256, 0, be->stream, be->x, ys, k, dim, cw, wd);
	LAUNCHED(be, "combine_kernel (the chosen experts' rows)");
	m->dev_layers++;
	return 0;
}

int moe_layer_chosen(struct backend_dev *be, uint32_t layer, uint32_t *ids)
{
	struct moe_dev *d = be->moe ? be->moe->dev : NULL;
	if (!d || layer >= be->cfg.n_layers || !d->routed[layer])
		return cuda_failf(be, -ENODATA, "cuda backend: layer %u was not routed on the device since the last check",
				  layer);
	/* The step's end: its output was waited for already, or this waits for it (once a step). */
	if (!d->synced)
		CUDA_TRY(be, "waiting for the device's routing", cudaStreamSynchronize(be->stream));
	d->synced = true;
	memcpy(ids, d->h_ids + (size_t)layer * be->moe->k, be->moe->k * sizeof(uint32_t));
	return 0;
}

int moe_dev_check(struct backend_dev *be)
{
	struct moe_dev *d = be->moe ? be->moe->dev : NULL;
	if (!d || !d->any)
		return 0;
	d->any = false;
	memset(d->routed, 0, be->cfg.n_layers * sizeof(bool));
	if (!d->synced)
		CUDA_TRY(be, "waiting for the device's routing", cudaStreamSynchronize(be->stream));
	d->synced = true;
	const uint32_t bad = *(volatile uint32_t *)d->h_err;
	if (!bad)
		return 0;
	*(volatile uint32_t *)d->h_err = 0;
	return cuda_failf(be, -EIO, "cuda backend: a router logit of layer %u is not finite", bad - 1);
}

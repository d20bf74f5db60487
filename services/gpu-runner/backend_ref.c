/* backend_ref.c - the C reference backend ("cpu"): the Llama forward pass as Hugging Face
 * transformers' LlamaForCausalLM computes it in float32, driven through backend.h.
 *
 * Numerics. Activations, the KV arena and every value handed between steps are float32,
 * rounded where transformers rounds (after each projection, RMSNorm, RoPE, SiLU, residual
 * add). Inside a dot product the float32 products are exact in double, and the sums run in
 * double: the result is then the float32 rounding of a nearly exact value, so the error
 * against transformers is transformers' own float32 summation error and not twice that.
 * This backend is the oracle the CUDA backend is checked against, and over 80 layers of an
 * 8192-wide model a float32 running sum (error ~ sqrt(n) * 2^-24 per dot) would eat a good
 * part of the 1e-4 logits tolerance by itself. The online softmax (running max, sum and
 * accumulator) is kept in double for the same reason: contexts reach tens of thousands of keys.
 *
 * RoPE frequencies follow the order of float32 tensor operations of transformers'
 * _compute_default_rope_parameters / _compute_llama3_parameters (see rope_inv_freq), and the
 * angle is the float32 product inv_freq * pos as in LlamaRotaryEmbedding.forward, so long
 * positions rotate by the same angles as transformers. tests/unit/gpu-runner/hf_parity checks
 * this against transformers itself: inv_freq bit-identical, logits within 1e-6 relative L2
 * (positions up to 120000, llama3 and linear scaling, GQA, tied embeddings, sliding window).
 *
 * Threads: matrix products are split over output rows and attention over (token, head)
 * pairs among a persistent pool. Each output is computed by one thread with the same code in
 * the same order, so the results are bit-identical for any thread count.
 */
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/rope.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REF_MAX_THREADS 256
#define REF_ERR_MAX 320

struct backend;
/* Runs items [begin, end) of a parallel job on thread tid (0 is the caller). */
typedef void (*job_fn)(struct backend *be, const void *job, uint32_t tid, uint32_t begin, uint32_t end);

/* Where a forward step stands: the order of calls backend.h prescribes. */
enum phase {
	PHASE_IDLE = 0,	 /* no chunk embedded yet */
	PHASE_READY = 1, /* hidden state holds a chunk: attn_begin, ffn or logits may follow */
	PHASE_ATTN = 2,	 /* between attn_begin and attn_end */
};

struct backend {
	struct model_config cfg;
	struct backend_params p;
	char err[REF_ERR_MAX];

	uint32_t q_dim;	      /* n_heads * head_dim */
	uint32_t kv_dim;      /* n_kv_heads * head_dim */
	uint32_t max_in;      /* widest matrix input: max(dim, q_dim, ffn_dim) */
	size_t block_floats;  /* floats in one arena block: K then V, (block_tokens, n_kv_heads, head_dim) each */
	float *arena;	      /* (n_kv_blocks, block_floats) */
	float *inv_freq;      /* (head_dim / 2) RoPE inverse frequencies, scaling applied */

	/* The chunk in flight. */
	enum phase phase;
	uint32_t n;	      /* tokens in the chunk */
	uint32_t pos0;	      /* position of its first token */
	uint32_t layer;	      /* layer between attn_begin and attn_end */

	float *x;	      /* (max_chunk, dim) residual stream */
	float *xn;	      /* (max_chunk, dim) RMSNorm output, input of the projections */
	float *q;	      /* (max_chunk, q_dim) queries after RoPE */
	float *k, *v;	      /* (max_chunk, kv_dim) new keys (after RoPE) and values */
	float *att;	      /* (max_chunk, q_dim) normalised attention output, input of o_proj */
	double *acc;	      /* (max_chunk, n_heads, head_dim) softmax-weighted sum of V */
	double *m;	      /* (max_chunk, n_heads) running max of the scores */
	double *l;	      /* (max_chunk, n_heads) running sum of exp(score - m) */
	float *gate, *up;     /* (max_chunk, ffn_dim) */
	float *rope_cs;	      /* (head_dim / 2) cos, then (head_dim / 2) sin, of one position */
	float *rows;	      /* (threads, max_in) one weight row widened to float32, per thread */
	double *scores;	      /* (threads, block_tokens) attention scores of one span, per thread */

	/* Thread pool: threads - 1 workers; the caller is thread 0. */
	uint32_t threads;
	uint32_t n_workers;   /* workers started (joined at destroy) */
	pthread_t *workers;
	pthread_mutex_t mu;
	pthread_cond_t wake;  /* a new job (generation changed) or stop */
	pthread_cond_t done;  /* pending reached 0 */
	bool pool_init;
	uint64_t generation;
	uint32_t pending;     /* workers still running the current job */
	bool stop;
	job_fn job_fn;
	const void *job;
	uint32_t job_total;
};

__attribute__((format(printf, 3, 4))) static int fail(struct backend *be, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(be->err, sizeof(be->err), fmt, ap);
	va_end(ap);
	return rc;
}

/* ---- kernels ---------------------------------------------------------------------------- */

/* sum a[i] * b[i] in double: float products are exact in double; four partial sums in a fixed
 * order let the compiler pipeline them without changing the result from run to run. */
static double dot_f32(const float *a, const float *b, uint32_t n)
{
	double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
	uint32_t i = 0;
	for (; i + 4 <= n; i += 4) {
		s0 += (double)a[i] * b[i];
		s1 += (double)a[i + 1] * b[i + 1];
		s2 += (double)a[i + 2] * b[i + 2];
		s3 += (double)a[i + 3] * b[i + 3];
	}
	for (; i < n; i++)
		s0 += (double)a[i] * b[i];
	return (s0 + s1) + (s2 + s3);
}

/* transformers LlamaRMSNorm in float32: variance = mean(x^2); x * rsqrt(variance + eps), then
 * weight * that. The mean is taken in double and rounded; the rest rounds as torch does. */
static void rmsnorm(float *out, const float *x, const void *w, uint32_t wt, uint32_t dim, float eps)
{
	double ss = 0;
	for (uint32_t i = 0; i < dim; i++)
		ss += (double)x[i] * x[i];
	float var = (float)(ss / dim);
	float r = 1.0f / sqrtf(var + eps);
	for (uint32_t i = 0; i < dim; i++)
		out[i] = dtype_get_f32((enum dtype)wt, w, i) * (x[i] * r);
}

/* silu(g) * u as torch: silu rounded to float32, then the float32 product. */
static float silu_mul(float g, float u)
{
	float s = (float)((double)g / (1.0 + exp(-(double)g)));
	return s * u;
}

/* cos and sin of position pos for each frequency: the angle is the float32 product, as
 * transformers' freqs = inv_freq.float() @ pos.float(); cos/sin of that float angle. */
static void rope_cos_sin(const float *inv, uint32_t half, uint32_t pos, float *cs, float *sn)
{
	for (uint32_t i = 0; i < half; i++) {
		float angle = (float)pos * inv[i];
		cs[i] = (float)cos((double)angle);
		sn[i] = (float)sin((double)angle);
	}
}

/* rotate_half layout (not interleaved): the pair is (x[i], x[i + hd/2]). */
static void rope_apply(float *x, const float *cs, const float *sn, uint32_t half)
{
	for (uint32_t i = 0; i < half; i++) {
		float x1 = x[i], x2 = x[i + half];
		x[i] = x1 * cs[i] - x2 * sn[i];
		x[i + half] = x2 * cs[i] + x1 * sn[i];
	}
}

/* ---- thread pool ------------------------------------------------------------------------ */

static void job_range(uint32_t total, uint32_t threads, uint32_t tid, uint32_t *begin, uint32_t *end)
{
	*begin = (uint32_t)((uint64_t)total * tid / threads);
	*end = (uint32_t)((uint64_t)total * (tid + 1) / threads);
}

struct worker_arg {
	struct backend *be;
	uint32_t tid;
};

static void *worker_main(void *arg)
{
	struct worker_arg wa = *(struct worker_arg *)arg;
	free(arg);
	struct backend *be = wa.be;
	uint64_t seen = 0;
	pthread_mutex_lock(&be->mu);
	for (;;) {
		while (!be->stop && be->generation == seen)
			pthread_cond_wait(&be->wake, &be->mu);
		if (be->stop)
			break;
		seen = be->generation;
		job_fn fn = be->job_fn;
		const void *job = be->job;
		uint32_t begin, end;
		job_range(be->job_total, be->threads, wa.tid, &begin, &end);
		pthread_mutex_unlock(&be->mu);
		if (begin < end)
			fn(be, job, wa.tid, begin, end);
		pthread_mutex_lock(&be->mu);
		if (--be->pending == 0)
			pthread_cond_signal(&be->done);
	}
	pthread_mutex_unlock(&be->mu);
	return NULL;
}

/* Runs fn over [0, total) split in contiguous ranges, one per thread; returns when all are done. */
static void run_parallel(struct backend *be, job_fn fn, const void *job, uint32_t total)
{
	if (be->threads == 1 || total < 2) {
		fn(be, job, 0, 0, total);
		return;
	}
	pthread_mutex_lock(&be->mu);
	be->job_fn = fn;
	be->job = job;
	be->job_total = total;
	be->pending = be->threads - 1;
	be->generation++;
	pthread_cond_broadcast(&be->wake);
	pthread_mutex_unlock(&be->mu);

	uint32_t begin, end;
	job_range(total, be->threads, 0, &begin, &end);
	if (begin < end)
		fn(be, job, 0, begin, end);

	pthread_mutex_lock(&be->mu);
	while (be->pending)
		pthread_cond_wait(&be->done, &be->mu);
	pthread_mutex_unlock(&be->mu);
}

static void pool_stop(struct backend *be)
{
	if (!be->pool_init)
		return;
	pthread_mutex_lock(&be->mu);
	be->stop = true;
	pthread_cond_broadcast(&be->wake);
	pthread_mutex_unlock(&be->mu);
	for (uint32_t i = 0; i < be->n_workers; i++)
		pthread_join(be->workers[i], NULL);
	be->n_workers = 0;
	pthread_cond_destroy(&be->done);
	pthread_cond_destroy(&be->wake);
	pthread_mutex_destroy(&be->mu);
	be->pool_init = false;
}

static int pool_start(struct backend *be, char *err, size_t errlen)
{
	int rc = pthread_mutex_init(&be->mu, NULL);
	if (rc)
		goto out_msg;
	rc = pthread_cond_init(&be->wake, NULL);
	if (rc)
		goto out_mutex;
	rc = pthread_cond_init(&be->done, NULL);
	if (rc)
		goto out_wake;
	be->pool_init = true;
	if (be->threads == 1)
		return 0;
	be->workers = calloc(be->threads - 1, sizeof(*be->workers));
	if (!be->workers) {
		rc = ENOMEM;
		goto out_msg;
	}
	for (uint32_t t = 1; t < be->threads; t++) {
		struct worker_arg *wa = malloc(sizeof(*wa));
		if (!wa) {
			rc = ENOMEM;
			goto out_msg;
		}
		wa->be = be;
		wa->tid = t;
		rc = pthread_create(&be->workers[t - 1], NULL, worker_main, wa);
		if (rc) {
			free(wa);
			goto out_msg;
		}
		be->n_workers++;
	}
	return 0;

	/* pool_stop (from destroy) joins the workers already started. */
out_wake:
	pthread_cond_destroy(&be->wake);
out_mutex:
	pthread_mutex_destroy(&be->mu);
out_msg:
	snprintf(err, errlen, "cpu backend: cannot start %u threads: %s", be->threads, strerror(rc));
	return -rc;
}

/* ---- matrix products -------------------------------------------------------------------- */

/* out[t][o] = sum_i W[o][i] x[t][i] for t < n, over up to three matrices sharing the input x
 * (q/k/v, gate/up), numbered as one row space so one parallel job covers them all. */
struct mm_part {
	const void *w;	  /* (rows, in) row-major, in dtype */
	uint32_t dtype;
	uint32_t rows;
	float *out;	  /* (n, rows) */
};

struct mm_job {
	const float *x;	  /* (n, in) */
	uint32_t in;
	uint32_t n;
	bool add;	  /* out += result (residual), else out = result */
	uint32_t n_parts;
	struct mm_part part[3];
};

static void mm_rows(struct backend *be, const void *arg, uint32_t tid, uint32_t begin, uint32_t end)
{
	const struct mm_job *j = arg;
	float *buf = be->rows + (size_t)tid * be->max_in;
	uint32_t base = 0, pi = 0;
	for (uint32_t r = begin; r < end; r++) {
		while (r >= base + j->part[pi].rows)
			base += j->part[pi++].rows;
		const struct mm_part *pt = &j->part[pi];
		uint32_t o = r - base;
		const float *row;
		/* Widen the row once; every token of the chunk reuses it. */
		if (pt->dtype == DT_F32) {
			row = (const float *)pt->w + (size_t)o * j->in;
		} else {
			const char *src = (const char *)pt->w + (size_t)o * j->in * dtype_size((enum dtype)pt->dtype);
			dtype_to_f32((enum dtype)pt->dtype, src, buf, j->in);
			row = buf;
		}
		for (uint32_t t = 0; t < j->n; t++) {
			float y = (float)dot_f32(row, j->x + (size_t)t * j->in, j->in);
			float *dst = pt->out + (size_t)t * pt->rows + o;
			*dst = j->add ? *dst + y : y;
		}
	}
}

static void matmul(struct backend *be, struct mm_job *j)
{
	uint32_t total = 0;
	for (uint32_t i = 0; i < j->n_parts; i++)
		total += j->part[i].rows;
	run_parallel(be, mm_rows, j, total);
}

/* ---- attention -------------------------------------------------------------------------- */

struct attn_job {
	const struct kv_span *spans;
	uint32_t n_spans;
};

/* One item is (token t, head h): folds every span into that pair's running max m, sum l and
 * accumulator, a block at a time: scores of the span's visible keys, the new max, one rescale
 * of the old state, then the span's weighted values. */
static void attn_items(struct backend *be, const void *arg, uint32_t tid, uint32_t begin, uint32_t end)
{
	const struct attn_job *j = arg;
	const struct model_config *c = &be->cfg;
	uint32_t hd = c->head_dim, nh = c->n_heads, group = c->n_heads / c->n_kv_heads;
	uint32_t window = c->sliding_window;
	double scale = 1.0 / sqrt((double)hd);
	double *sc = be->scores + (size_t)tid * be->p.block_tokens;

	for (uint32_t item = begin; item < end; item++) {
		uint32_t t = item / nh, h = item % nh, g = h / group;
		uint32_t qpos = be->pos0 + t;
		const float *q = be->q + (size_t)t * be->q_dim + (size_t)h * hd;
		double *acc = be->acc + (size_t)item * hd;
		double *m = &be->m[item], *l = &be->l[item];
		/* Keys visible to qpos: kpos <= qpos and, with a window, qpos - kpos < window. */
		uint32_t first = window && qpos >= window ? qpos - window + 1 : 0;

		for (uint32_t s = 0; s < j->n_spans; s++) {
			const struct kv_span *sp = &j->spans[s];
			if (sp->pos0 > qpos || sp->pos0 + sp->n_tokens <= first)
				continue;
			uint32_t lo = first > sp->pos0 ? first - sp->pos0 : 0;
			uint32_t hi = qpos - sp->pos0 + 1;
			if (hi > sp->n_tokens)
				hi = sp->n_tokens;
			const float *kb = be->arena + (size_t)sp->block * be->block_floats + (size_t)g * hd;
			const float *vb = kb + (size_t)be->p.block_tokens * be->kv_dim;

			double smax = -INFINITY;
			for (uint32_t r = lo; r < hi; r++) {
				sc[r] = dot_f32(q, kb + (size_t)r * be->kv_dim, hd) * scale;
				if (sc[r] > smax)
					smax = sc[r];
			}
			double mnew = smax > *m ? smax : *m;
			if (mnew != *m) {
				/* *m = -inf on the first span: exp(-inf) = 0 clears nothing that is set. */
				double corr = exp(*m - mnew);
				*l *= corr;
				for (uint32_t d = 0; d < hd; d++)
					acc[d] *= corr;
				*m = mnew;
			}
			for (uint32_t r = lo; r < hi; r++) {
				double pr = exp(sc[r] - mnew);
				const float *vr = vb + (size_t)r * be->kv_dim;
				*l += pr;
				for (uint32_t d = 0; d < hd; d++)
					acc[d] += pr * vr[d];
			}
		}
	}
}

/* ---- operations ------------------------------------------------------------------------- */

static int check_roles(struct backend *be, const struct group_weights *w, const enum tensor_role *roles,
		       uint32_t n, const char *what)
{
	for (uint32_t i = 0; i < n; i++) {
		enum tensor_role r = roles[i];
		if (!w->t[r])
			return fail(be, -EINVAL, "cpu backend: %s: weights have no %s tensor", what,
				    tensor_role_name(r));
		if (w->dtype[r] >= DT_COUNT)
			return fail(be, -EINVAL, "cpu backend: %s: %s tensor has unknown dtype %u", what,
				    tensor_role_name(r), w->dtype[r]);
	}
	return 0;
}

static size_t ref_kv_block_bytes(const struct model_config *cfg, const struct backend_params *p)
{
	/* K and V in float32: the only kv_dtype this backend stores. */
	return 2 * (size_t)p->block_tokens * cfg->n_kv_heads * cfg->head_dim * sizeof(float);
}

static int ref_kv_to_host(struct backend *be, uint32_t block, void *dst)
{
	if (block >= be->p.n_kv_blocks)
		return fail(be, -EINVAL, "cpu backend: kv_to_host: block %u is outside the arena of %u blocks", block,
			    be->p.n_kv_blocks);
	memcpy(dst, be->arena + (size_t)block * be->block_floats, be->block_floats * sizeof(float));
	return 0;
}

static int ref_kv_from_host(struct backend *be, uint32_t block, const void *src)
{
	if (block >= be->p.n_kv_blocks)
		return fail(be, -EINVAL, "cpu backend: kv_from_host: block %u is outside the arena of %u blocks",
			    block, be->p.n_kv_blocks);
	memcpy(be->arena + (size_t)block * be->block_floats, src, be->block_floats * sizeof(float));
	return 0;
}

/* The read-ahead on the C backend: the copies happen now, so there is nothing to wait for. */
static int ref_kv_prefetch_n(struct backend *be, uint32_t n, const uint32_t *blocks, const void *const *srcs,
			     uint32_t slot)
{
	(void)slot;
	for (uint32_t i = 0; i < n; i++) {
		int rc = ref_kv_from_host(be, blocks[i], srcs[i]);
		if (rc)
			return rc;
	}
	return 0;
}

static int ref_kv_prefetch_wait(struct backend *be, uint32_t slot)
{
	(void)be;
	(void)slot;
	return 0;
}

static int ref_embed(struct backend *be, const struct group_weights *w, const int32_t *tokens, uint32_t n,
		     uint32_t pos0)
{
	static const enum tensor_role roles[] = {ROLE_EMBED};
	uint32_t dim = be->cfg.dim;
	assert(be && w && (tokens || n == 0));
	int rc = check_roles(be, w, roles, 1, "embed");
	if (rc)
		return rc;
	if (n == 0 || n > be->p.max_chunk)
		return fail(be, -EINVAL, "cpu backend: embed: chunk of %u tokens (must be 1..%u, max_chunk)", n,
			    be->p.max_chunk);
	if ((uint64_t)pos0 + n > UINT32_MAX)
		return fail(be, -EINVAL, "cpu backend: embed: positions %u..%u overflow 32 bits", pos0, pos0 + (n - 1));
	for (uint32_t t = 0; t < n; t++)
		if (tokens[t] < 0 || (uint32_t)tokens[t] >= be->cfg.vocab_size)
			return fail(be, -EINVAL,
				    "cpu backend: embed: token id %d at chunk index %u is outside the vocabulary (0..%u)",
				    tokens[t], t, be->cfg.vocab_size - 1);
	enum dtype dt = (enum dtype)w->dtype[ROLE_EMBED];
	for (uint32_t t = 0; t < n; t++) {
		const char *row = (const char *)w->t[ROLE_EMBED] + (size_t)tokens[t] * dim * dtype_size(dt);
		dtype_to_f32(dt, row, be->x + (size_t)t * dim, dim);
	}
	be->n = n;
	be->pos0 = pos0;
	be->phase = PHASE_READY;
	return 0;
}

static int ref_attn_begin(struct backend *be, const struct group_weights *w, uint32_t layer,
			  const uint32_t *dst_block, const uint32_t *dst_row)
{
	static const enum tensor_role roles[] = {ROLE_ATTN_NORM, ROLE_WQ, ROLE_WK, ROLE_WV, ROLE_WO};
	const struct model_config *c = &be->cfg;
	uint32_t n = be->n, hd = c->head_dim, half = hd / 2;
	assert(w && dst_block && dst_row);

	/* The call order is checked in release builds too: a wrong order from the engine would
	 * otherwise compute silently wrong tokens. */
	if (be->phase != PHASE_READY)
		return fail(be, -EINVAL, "cpu backend: attn_begin(layer %u) called %s", layer,
			    be->phase == PHASE_IDLE ? "before embed" : "before attn_end of the previous layer");
	if (layer >= c->n_layers)
		return fail(be, -EINVAL, "cpu backend: attn_begin: layer %u of a %u-layer model", layer, c->n_layers);
	int rc = check_roles(be, w, roles, 5, "attention");
	if (rc)
		return rc;
	for (uint32_t t = 0; t < n; t++)
		if (dst_block[t] >= be->p.n_kv_blocks || dst_row[t] >= be->p.block_tokens)
			return fail(be, -EINVAL, "cpu backend: attn_begin(layer %u): token %u goes to block %u row %u, "
				    "outside the arena (%u blocks of %u rows)", layer, t, dst_block[t], dst_row[t],
				    be->p.n_kv_blocks, be->p.block_tokens);

	for (uint32_t t = 0; t < n; t++)
		rmsnorm(be->xn + (size_t)t * c->dim, be->x + (size_t)t * c->dim, w->t[ROLE_ATTN_NORM],
			w->dtype[ROLE_ATTN_NORM], c->dim, c->rms_eps);
	struct mm_job j = {
		.x = be->xn, .in = c->dim, .n = n, .n_parts = 3,
		.part = {{w->t[ROLE_WQ], w->dtype[ROLE_WQ], be->q_dim, be->q},
			 {w->t[ROLE_WK], w->dtype[ROLE_WK], be->kv_dim, be->k},
			 {w->t[ROLE_WV], w->dtype[ROLE_WV], be->kv_dim, be->v}},
	};
	matmul(be, &j);

	float *cs = be->rope_cs, *sn = be->rope_cs + half;
	for (uint32_t t = 0; t < n; t++) {
		rope_cos_sin(be->inv_freq, half, be->pos0 + t, cs, sn);
		for (uint32_t h = 0; h < c->n_heads; h++)
			rope_apply(be->q + (size_t)t * be->q_dim + (size_t)h * hd, cs, sn, half);
		for (uint32_t h = 0; h < c->n_kv_heads; h++)
			rope_apply(be->k + (size_t)t * be->kv_dim + (size_t)h * hd, cs, sn, half);
		float *kdst = be->arena + (size_t)dst_block[t] * be->block_floats + (size_t)dst_row[t] * be->kv_dim;
		float *vdst = kdst + (size_t)be->p.block_tokens * be->kv_dim;
		memcpy(kdst, be->k + (size_t)t * be->kv_dim, be->kv_dim * sizeof(float));
		memcpy(vdst, be->v + (size_t)t * be->kv_dim, be->kv_dim * sizeof(float));
	}

	size_t pairs = (size_t)n * c->n_heads;
	for (size_t i = 0; i < pairs; i++) {
		be->m[i] = -INFINITY;
		be->l[i] = 0;
	}
	memset(be->acc, 0, pairs * hd * sizeof(double));
	be->layer = layer;
	be->phase = PHASE_ATTN;
	return 0;
}

static int ref_attn_blocks(struct backend *be, const struct kv_span *spans, uint32_t n_spans)
{
	assert(spans || n_spans == 0);
	if (be->phase != PHASE_ATTN)
		return fail(be, -EINVAL, "cpu backend: attn_blocks called outside attn_begin .. attn_end");
	for (uint32_t s = 0; s < n_spans; s++) {
		const struct kv_span *sp = &spans[s];
		if (sp->block >= be->p.n_kv_blocks || sp->n_tokens == 0 || sp->n_tokens > be->p.block_tokens ||
		    (uint64_t)sp->pos0 + sp->n_tokens > UINT32_MAX)
			return fail(be, -EINVAL,
				    "cpu backend: attn_blocks(layer %u): span %u (block %u, positions from %u, %u tokens) "
				    "does not fit the arena (%u blocks of %u rows)", be->layer, s, sp->block, sp->pos0,
				    sp->n_tokens, be->p.n_kv_blocks, be->p.block_tokens);
	}
	struct attn_job j = {.spans = spans, .n_spans = n_spans};
	run_parallel(be, attn_items, &j, be->n * be->cfg.n_heads);
	return 0;
}

static int ref_attn_end(struct backend *be, const struct group_weights *w)
{
	static const enum tensor_role roles[] = {ROLE_WO};
	const struct model_config *c = &be->cfg;
	uint32_t hd = c->head_dim;
	if (be->phase != PHASE_ATTN)
		return fail(be, -EINVAL, "cpu backend: attn_end called without attn_begin");
	int rc = check_roles(be, w, roles, 1, "attention");
	if (rc)
		return rc;
	size_t pairs = (size_t)be->n * c->n_heads;
	for (size_t i = 0; i < pairs; i++) {
		/* Every query sees at least its own key; no weight means its block was not visited. */
		if (!(be->l[i] > 0))
			return fail(be, -EINVAL,
				    "cpu backend: attn_end(layer %u): the query at position %u saw no keys: the spans did "
				    "not cover its own position", be->layer, be->pos0 + (uint32_t)(i / c->n_heads));
		double inv_l = 1.0 / be->l[i];
		/* (token, head) pair i is token i / n_heads, head i % n_heads: att is laid out the same. */
		for (uint32_t d = 0; d < hd; d++)
			be->att[i * hd + d] = (float)(be->acc[i * hd + d] * inv_l);
	}
	struct mm_job j = {
		.x = be->att, .in = be->q_dim, .n = be->n, .add = true, .n_parts = 1,
		.part = {{w->t[ROLE_WO], w->dtype[ROLE_WO], c->dim, be->x}},
	};
	matmul(be, &j);
	be->phase = PHASE_READY;
	return 0;
}

static int ref_ffn(struct backend *be, const struct group_weights *w)
{
	static const enum tensor_role roles[] = {ROLE_FFN_NORM, ROLE_W_GATE, ROLE_W_UP, ROLE_W_DOWN};
	const struct model_config *c = &be->cfg;
	uint32_t n = be->n;
	if (be->phase != PHASE_READY)
		return fail(be, -EINVAL, "cpu backend: ffn called %s",
			    be->phase == PHASE_IDLE ? "before embed" : "between attn_begin and attn_end");
	int rc = check_roles(be, w, roles, 4, "ffn");
	if (rc)
		return rc;
	for (uint32_t t = 0; t < n; t++)
		rmsnorm(be->xn + (size_t)t * c->dim, be->x + (size_t)t * c->dim, w->t[ROLE_FFN_NORM],
			w->dtype[ROLE_FFN_NORM], c->dim, c->rms_eps);
	struct mm_job j = {
		.x = be->xn, .in = c->dim, .n = n, .n_parts = 2,
		.part = {{w->t[ROLE_W_GATE], w->dtype[ROLE_W_GATE], c->ffn_dim, be->gate},
			 {w->t[ROLE_W_UP], w->dtype[ROLE_W_UP], c->ffn_dim, be->up}},
	};
	matmul(be, &j);
	size_t cnt = (size_t)n * c->ffn_dim;
	for (size_t i = 0; i < cnt; i++)
		be->gate[i] = silu_mul(be->gate[i], be->up[i]);
	struct mm_job jd = {
		.x = be->gate, .in = c->ffn_dim, .n = n, .add = true, .n_parts = 1,
		.part = {{w->t[ROLE_W_DOWN], w->dtype[ROLE_W_DOWN], c->dim, be->x}},
	};
	matmul(be, &jd);
	return 0;
}

static int ref_logits(struct backend *be, const struct group_weights *w, float *out)
{
	static const enum tensor_role roles[] = {ROLE_FINAL_NORM, ROLE_LM_HEAD};
	const struct model_config *c = &be->cfg;
	assert(w && out);
	if (be->phase != PHASE_READY)
		return fail(be, -EINVAL, "cpu backend: logits called %s",
			    be->phase == PHASE_IDLE ? "before embed" : "between attn_begin and attn_end");
	int rc = check_roles(be, w, roles, 2, "head");
	if (rc)
		return rc;
	rmsnorm(be->xn, be->x + (size_t)(be->n - 1) * c->dim, w->t[ROLE_FINAL_NORM], w->dtype[ROLE_FINAL_NORM],
		c->dim, c->rms_eps);
	struct mm_job j = {
		.x = be->xn, .in = c->dim, .n = 1, .n_parts = 1,
		.part = {{w->t[ROLE_LM_HEAD], w->dtype[ROLE_LM_HEAD], c->vocab_size, out}},
	};
	matmul(be, &j);
	return 0;
}

static const char *ref_error(struct backend *be)
{
	return be->err;
}

/* ---- create / destroy ------------------------------------------------------------------- */

/* Joins the pool and frees everything; NULLs *bep; safe on NULL and twice. */
static void ref_destroy(struct backend **bep)
{
	struct backend *be = *bep;
	if (!be)
		return;
	pool_stop(be);
	free(be->workers);
	free(be->arena);
	free(be->inv_freq);
	free(be->x);
	free(be->xn);
	free(be->q);
	free(be->k);
	free(be->v);
	free(be->att);
	free(be->acc);
	free(be->m);
	free(be->l);
	free(be->gate);
	free(be->up);
	free(be->rope_cs);
	free(be->rows);
	free(be->scores);
	free(be);
	*bep = NULL;
}

static int check_config(const struct model_config *c, const struct backend_params *p, char *err, size_t errlen)
{
	int rc = backend_check_config("cpu", c, p, err, errlen);
	if (rc)
		return rc;
	if (c->head_dim % 2) {
		snprintf(err, errlen, "cpu backend: head_dim %u is odd: RoPE rotates pairs", c->head_dim);
		return -EINVAL;
	}
	if (p->kv_dtype != DT_F32) {
		snprintf(err, errlen, "cpu backend: kv_dtype %s is not supported: the C reference keeps the KV cache "
			 "in F32 only", dtype_name((enum dtype)p->kv_dtype));
		return -ENOTSUP;
	}
	if (p->threads > REF_MAX_THREADS) {
		snprintf(err, errlen, "cpu backend: %u threads requested, at most %u", p->threads, REF_MAX_THREADS);
		return -EINVAL;
	}
	return 0;
}

/* calloc of a * b elements of size es, NULL on overflow. */
static void *alloc_array(size_t a, size_t b, size_t es)
{
	size_t n;
	if (__builtin_mul_overflow(a, b, &n))
		return NULL;
	return calloc(n ? n : 1, es);
}

/* On success *out is a new backend the caller owns (ref_destroy); on failure *out is NULL and
 * err names the problem. cfg and p are copied. */
static int ref_create(const struct model_config *cfg, const struct backend_params *p, struct backend **out,
		      char *err, size_t errlen)
{
	assert(cfg && p && out && err);
	*out = NULL;
	int rc = check_config(cfg, p, err, errlen);
	if (rc)
		return rc;
	struct backend *be = calloc(1, sizeof(*be));
	if (!be) {
		snprintf(err, errlen, "cpu backend: out of memory for the backend state");
		return -ENOMEM;
	}
	be->cfg = *cfg;
	be->p = *p;
	be->threads = p->threads ? p->threads : 1;
	be->q_dim = cfg->n_heads * cfg->head_dim;
	be->kv_dim = cfg->n_kv_heads * cfg->head_dim;
	be->max_in = cfg->dim;
	if (be->q_dim > be->max_in)
		be->max_in = be->q_dim;
	if (cfg->ffn_dim > be->max_in)
		be->max_in = cfg->ffn_dim;
	be->block_floats = 2 * (size_t)p->block_tokens * be->kv_dim;

	size_t mc = p->max_chunk, pairs = mc * cfg->n_heads;
	be->inv_freq = alloc_array(cfg->head_dim / 2, 1, sizeof(float));
	be->x = alloc_array(mc, cfg->dim, sizeof(float));
	be->xn = alloc_array(mc, cfg->dim, sizeof(float));
	be->q = alloc_array(mc, be->q_dim, sizeof(float));
	be->k = alloc_array(mc, be->kv_dim, sizeof(float));
	be->v = alloc_array(mc, be->kv_dim, sizeof(float));
	be->att = alloc_array(mc, be->q_dim, sizeof(float));
	be->acc = alloc_array(pairs, cfg->head_dim, sizeof(double));
	be->m = alloc_array(pairs, 1, sizeof(double));
	be->l = alloc_array(pairs, 1, sizeof(double));
	be->gate = alloc_array(mc, cfg->ffn_dim, sizeof(float));
	be->up = alloc_array(mc, cfg->ffn_dim, sizeof(float));
	be->rope_cs = alloc_array(cfg->head_dim, 1, sizeof(float));
	be->rows = alloc_array(be->threads, be->max_in, sizeof(float));
	be->scores = alloc_array(be->threads, p->block_tokens, sizeof(double));
	if (!be->inv_freq || !be->x || !be->xn || !be->q || !be->k || !be->v || !be->att || !be->acc || !be->m ||
	    !be->l || !be->gate || !be->up || !be->rope_cs || !be->rows || !be->scores) {
		snprintf(err, errlen, "cpu backend: out of memory for the buffers of %u-token chunks", p->max_chunk);
		rc = -ENOMEM;
		goto out_destroy;
	}
	/* The arena is not zeroed: every row is written (attn_begin, kv_from_host) before it is read. */
	size_t arena_floats;
	if (__builtin_mul_overflow((size_t)p->n_kv_blocks, be->block_floats, &arena_floats) ||
	    arena_floats > SIZE_MAX / sizeof(float) || !(be->arena = malloc(arena_floats * sizeof(float)))) {
		snprintf(err, errlen, "cpu backend: cannot allocate the KV arena of %u blocks of %zu bytes",
			 p->n_kv_blocks, be->block_floats * sizeof(float));
		rc = -ENOMEM;
		goto out_destroy;
	}
	rc = rope_inv_freq(cfg, be->inv_freq, err, errlen);
	if (rc)
		goto out_destroy;
	rc = pool_start(be, err, errlen);
	if (rc)
		goto out_destroy;
	*out = be;
	return 0;

out_destroy:
	ref_destroy(&be);
	return rc;
}

const struct backend_ops backend_ref_ops = {
	.name = "cpu",
	.create = ref_create,
	.destroy = ref_destroy,
	.kv_block_bytes = ref_kv_block_bytes,
	.kv_to_host = ref_kv_to_host,
	.kv_from_host = ref_kv_from_host,
	.kv_prefetch_n = ref_kv_prefetch_n,
	.kv_prefetch_wait = ref_kv_prefetch_wait,
	.embed = ref_embed,
	.attn_begin = ref_attn_begin,
	.attn_blocks = ref_attn_blocks,
	.attn_end = ref_attn_end,
	.ffn = ref_ffn,
	.logits = ref_logits,
	.error = ref_error,
};

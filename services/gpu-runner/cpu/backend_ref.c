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
 * Weights in a GGUF block format (Q8_0, Q4_K, ...) are dequantized row by row exactly as the
 * format defines (common/quant.h) and then used as float32 rows: the result is bit-identical to
 * running on the dequantized weights. With cfg.rope_layout ROPE_ADJACENT (GGUF's wq/wk row
 * order) RoPE rotates pairs (2i, 2i+1) instead of (i, i + head_dim/2).
 *
 * Threads: matrix products are split over output rows and attention over (token, head)
 * pairs among a persistent pool. Each output is computed by one thread with the same code in
 * the same order, so the results are bit-identical for any thread count.
 *
 * Qwen3 (MODEL_QK_NORM): each head of q and k goes through its RMSNorm (q_norm, k_norm, over head_dim)
 * after the projection and before RoPE, as Qwen3Attention does.
 *
 * Mixture-of-experts layers (Mixtral, Qwen3-MoE) follow MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock:
 * the router logits in float32, the routing of cpu_moe_route (kernels.h), each expert's SwiGLU over
 * the tokens routed to it (rounded as the dense FFN), multiplied by the token's float32 weight and
 * added into a zeroed float32 sum in increasing expert order (transformers' index_add_ over its
 * loop of experts), and the sum added into the residual stream at moe_end.
 *
 * A split FFN (backend.h, struct ffn_split) computes its first share with the code above; the
 * second too for FFN_SPLIT_BACKEND, and for FFN_SPLIT_CPU through cpu-compute (ffn_share.h, with
 * the float32 normed x as its activation: nothing rounded to BF16) on the task pool of
 * backend_params.cpu_pool, submitted before the first share is computed and waited for after,
 * then added into the residual stream: the order of the CUDA backend's additions. So CI runs the
 * split, and its CPU products are those the CUDA backend's CPU share runs.
 */
#include "services/gpu-runner/backend_impl.h"
#include "services/gpu-runner/cpu/ref_test.h"
#include "services/gpu-runner/cpu-compute/ffn_share.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/cpu/kernels.h"
#include "services/gpu-runner/cpu/pool.h"
#include "services/gpu-runner/rope.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

#define REF_MAX_THREADS 256
#define REF_ERR_MAX 320

struct backend_dev {
	struct model_config cfg;
	struct backend_params p;
	char err[REF_ERR_MAX];

	uint32_t q_dim;	      /* n_heads * head_dim */
	uint32_t kv_dim;      /* n_kv_heads * head_dim */
	uint32_t max_in;      /* widest matrix input: max(dim, q_dim, ffn_dim) */
	size_t block_floats;  /* floats in one arena block: K then V, (block_tokens, n_kv_heads, head_dim) each */
	float *arena;	      /* (n_kv_blocks, block_floats) */
	float *inv_freq;      /* (head_dim / 2) RoPE inverse frequencies, scaling applied */

	/* The batch in flight (backend.c has checked the call order). */
	uint32_t n;	      /* tokens in the chunk */
	uint32_t *pos;	      /* (max_chunk) each token's position (the batch's: runs of several sequences) */
	uint32_t layer;	      /* layer between attn_begin and attn_end */

	float *x;	      /* (max_chunk, dim) residual stream */
	float *xn;	      /* (max_chunk, dim) RMSNorm output, input of the projections */
	float *q;	      /* (max_chunk, q_dim) queries after RoPE */
	float *k, *v;	      /* (max_chunk, kv_dim) new keys (after RoPE) and values */
	float *att;	      /* (max_chunk, q_dim) normalised attention output, input of o_proj */
	double *acc;	      /* (max_chunk, n_heads, head_dim) softmax-weighted sum of V */
	double *m;	      /* (max_chunk, n_heads) running max of the scores */
	double *l;	      /* (max_chunk, n_heads) running sum of exp(score - m) */
	float *gate, *up;     /* (max_chunk, max(ffn_dim, expert_ffn_dim)) */

	/* A mixture-of-experts layer between moe_route and moe_end. */
	float *router;	      /* (max_chunk, n_experts) router logits */
	uint32_t *sel;	      /* (max_chunk, n_experts_used) each token's experts */
	float *sel_w;	      /* (max_chunk, n_experts_used) and their weights */
	float *moe_sum;	      /* (max_chunk, dim) the weighted sum of the experts' outputs */
	float *ex_x, *ex_y;   /* (max_chunk, dim) an expert's input rows (normed x of its tokens), its output */
	uint32_t *ex_tok;     /* (max_chunk) the tokens routed to the expert */
	float *ex_w;	      /* (max_chunk) and their weights */
	float *rope_cs;	      /* (head_dim / 2) cos, then (head_dim / 2) sin, of one position */
	float *rows;	      /* (threads, max_in) one weight row widened to float32, per thread */
	double *scores;	      /* (threads, block_tokens) attention scores of one span, per thread */

	uint32_t threads;      /* of the pool: the caller and threads - 1 workers */
	struct cpu_pool *pool;

	/* The CPU share of split FFNs (with backend_params.cpu_pool). */
	struct ffn_share *share;
	struct ffn_share_job share_job;
	float *share_y;	       /* (FFN_SPLIT_MAX_TOKENS, dim) the share's partial hidden vectors */
	uint32_t share_done, share_waiters, share_seq; /* the job's completion word, its sleepers, the last value */
	uint64_t share_failed;	/* CPU shares that failed */
	uint32_t share_fail_at; /* backend_ref_test_fail_cpu_share: the share_seq whose job fails; 0: none */
};

__attribute__((format(printf, 3, 4))) static int fail(struct backend_dev *be, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(be->err, sizeof(be->err), fmt, ap);
	va_end(ap);
	return rc;
}

/* ---- matrix products -------------------------------------------------------------------- */

/* out[t][o] = sum_i W[o][i] x[t][i] for t < n, over up to three matrices sharing the input x
 * (q/k/v, gate/up), numbered as one row space so one parallel job covers them all. */
struct mm_part {
	const struct weight_tensor *w; /* (rows, in), read on the host */
	float *out;	  /* (n, rows) */
};

struct mm_job {
	struct backend_dev *be;
	const float *x;	  /* (n, in) */
	uint32_t in;
	uint32_t n;
	bool add;	  /* out += result (residual), else out = result */
	uint32_t n_parts;
	struct mm_part part[3];
};

static void mm_rows(const void *arg, uint32_t tid, uint32_t begin, uint32_t end)
{
	const struct mm_job *j = arg;
	float *buf = j->be->rows + (size_t)tid * j->be->max_in;
	uint32_t base = 0, pi = 0;
	for (uint32_t r = begin; r < end; r++) {
		while (r >= base + j->part[pi].w->rows)
			base += j->part[pi++].w->rows;
		const struct mm_part *pt = &j->part[pi];
		const struct weight_tensor *w = pt->w;
		uint32_t o = r - base;
		const char *src = (const char *)w->data[PLACE_HOST] + (size_t)o * w->row_bytes;
		const float *row;
		/* Widen the row once; every token of the chunk reuses it. */
		if (w->format == DT_F32) {
			row = (const float *)src;
		} else {
			dtype_to_f32((enum dtype)w->format, src, buf, j->in);
			row = buf;
		}
		for (uint32_t t = 0; t < j->n; t++) {
			float y = (float)cpu_dot_f32(row, j->x + (size_t)t * j->in, j->in);
			float *dst = pt->out + (size_t)t * w->rows + o;
			*dst = j->add ? *dst + y : y;
		}
	}
}

static void matmul(struct backend_dev *be, struct mm_job *j)
{
	uint32_t total = 0;
	for (uint32_t i = 0; i < j->n_parts; i++)
		total += j->part[i].w->rows;
	j->be = be;
	cpu_pool_run(be->pool, mm_rows, j, total);
}

/* ---- attention -------------------------------------------------------------------------- */

struct attn_job {
	struct backend_dev *be;
	const struct kv_span *spans;
	uint32_t n_spans;
	uint32_t row0;	/* items count from this row's (the first row any span is for) */
};

/* One item is (token t, head h): folds every span into that pair's running max m, sum l and
 * accumulator, a block at a time: scores of the span's visible keys, the new max, one rescale
 * of the old state, then the span's weighted values. */
static void attn_items(const void *arg, uint32_t tid, uint32_t begin, uint32_t end)
{
	const struct attn_job *j = arg;
	struct backend_dev *be = j->be;
	const struct model_config *c = &be->cfg;
	uint32_t hd = c->head_dim, nh = c->n_heads, group = c->n_heads / c->n_kv_heads;
	uint32_t window = c->sliding_window;
	double scale = 1.0 / sqrt((double)hd);
	double *sc = be->scores + (size_t)tid * be->p.block_tokens;

	for (uint32_t it = begin; it < end; it++) {
		uint32_t item = it + j->row0 * nh;
		uint32_t t = item / nh, h = item % nh, g = h / group;
		uint32_t qpos = be->pos[t];
		const float *q = be->q + (size_t)t * be->q_dim + (size_t)h * hd;
		double *acc = be->acc + (size_t)item * hd;
		double *m = &be->m[item], *l = &be->l[item];
		/* Keys visible to qpos: kpos <= qpos and, with a window, qpos - kpos < window. */
		uint32_t first = window && qpos >= window ? qpos - window + 1 : 0;

		for (uint32_t s = 0; s < j->n_spans; s++) {
			const struct kv_span *sp = &j->spans[s];
			if (sp->n_rows && (t < sp->row0 || t - sp->row0 >= sp->n_rows))
				continue; /* another sequence's KV */
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
				sc[r] = cpu_dot_f32(q, kb + (size_t)r * be->kv_dim, hd) * scale;
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

/* backend.c has checked the call order, the ranges and that every tensor used is there. */

static size_t ref_kv_block_bytes(const struct model_config *cfg, const struct backend_params *p)
{
	/* K and V in float32: the only kv_dtype this backend stores. */
	return 2 * (size_t)p->block_tokens * cfg->n_kv_heads * cfg->head_dim * sizeof(float);
}

static int ref_kv_to_host(struct backend_dev *be, uint32_t n, const uint32_t *blocks, void *const *dsts)
{
	for (uint32_t i = 0; i < n; i++)
		memcpy(dsts[i], be->arena + (size_t)blocks[i] * be->block_floats, be->block_floats * sizeof(float));
	return 0;
}

/* Also the read-ahead on this backend (backend.c's default): the copies happen now, so there
 * is nothing to wait for. */
static int ref_kv_from_host(struct backend_dev *be, uint32_t n, const uint32_t *blocks, const void *const *srcs)
{
	for (uint32_t i = 0; i < n; i++)
		memcpy(be->arena + (size_t)blocks[i] * be->block_floats, srcs[i], be->block_floats * sizeof(float));
	return 0;
}

/* The tensor of role r, read on the host. */
static const void *host(const struct group_weights *w, enum tensor_role r)
{
	return w->t[r].data[PLACE_HOST];
}

static void rmsnorm_rows(struct backend_dev *be, const struct weight_tensor *w, uint32_t n)
{
	const struct model_config *c = &be->cfg;
	for (uint32_t t = 0; t < n; t++)
		cpu_rmsnorm(be->xn + (size_t)t * c->dim, be->x + (size_t)t * c->dim, w->data[PLACE_HOST], w->format, c->dim,
			c->rms_eps);
}

static int ref_embed(struct backend_dev *be, const struct group_weights *w, const struct backend_batch *b)
{
	uint32_t dim = be->cfg.dim;
	const struct weight_tensor *e = &w->t[ROLE_EMBED];
	for (uint32_t t = 0; t < b->n; t++) {
		const char *row = (const char *)host(w, ROLE_EMBED) + (size_t)b->tokens[t] * e->row_bytes;
		dtype_to_f32((enum dtype)e->format, row, be->x + (size_t)t * dim, dim);
	}
	be->n = b->n;
	memcpy(be->pos, b->pos, b->n * sizeof(uint32_t));
	return 0;
}

/* A stage of a split model (backend.h): the previous stage's rows as the hidden state. */
static int ref_hidden_in(struct backend_dev *be, const struct backend_batch *b, const float *x)
{
	memcpy(be->x, x, sizeof(float) * b->n * be->cfg.dim);
	be->n = b->n;
	memcpy(be->pos, b->pos, b->n * sizeof(uint32_t));
	return 0;
}

static int ref_hidden_get(struct backend_dev *be, uint32_t row0, uint32_t n, float *x)
{
	memcpy(x, be->x + (size_t)row0 * be->cfg.dim, sizeof(float) * n * be->cfg.dim);
	return 0;
}

static int ref_hidden_put(struct backend_dev *be, uint32_t row0, uint32_t n, const float *x)
{
	memcpy(be->x + (size_t)row0 * be->cfg.dim, x, sizeof(float) * n * be->cfg.dim);
	return 0;
}

static int ref_attn_begin(struct backend_dev *be, const struct group_weights *w, uint32_t layer,
			  const uint32_t *dst_block, const uint32_t *dst_row)
{
	const struct model_config *c = &be->cfg;
	uint32_t n = be->n, hd = c->head_dim, half = hd / 2;

	rmsnorm_rows(be, &w->t[ROLE_ATTN_NORM], n);
	struct mm_job j = {
		.x = be->xn, .in = c->dim, .n = n, .n_parts = 3,
		.part = {{&w->t[ROLE_WQ], be->q}, {&w->t[ROLE_WK], be->k}, {&w->t[ROLE_WV], be->v}},
	};
	matmul(be, &j);

	if (c->flags & MODEL_QK_NORM) {
		const struct weight_tensor *qn = &w->t[ROLE_Q_NORM], *kn = &w->t[ROLE_K_NORM];
		for (uint32_t t = 0; t < n; t++) {
			for (uint32_t h = 0; h < c->n_heads; h++)
				cpu_rmsnorm(be->q + (size_t)t * be->q_dim + (size_t)h * hd,
					    be->q + (size_t)t * be->q_dim + (size_t)h * hd, qn->data[PLACE_HOST], qn->format,
					    hd, c->rms_eps);
			for (uint32_t h = 0; h < c->n_kv_heads; h++)
				cpu_rmsnorm(be->k + (size_t)t * be->kv_dim + (size_t)h * hd,
					    be->k + (size_t)t * be->kv_dim + (size_t)h * hd, kn->data[PLACE_HOST], kn->format,
					    hd, c->rms_eps);
		}
	}

	float *cs = be->rope_cs, *sn = be->rope_cs + half;
	void (*rope)(float *, const float *, const float *, uint32_t) =
		c->rope_layout == ROPE_ADJACENT ? cpu_rope_apply_adjacent : cpu_rope_apply;
	for (uint32_t t = 0; t < n; t++) {
		cpu_rope_cos_sin(be->inv_freq, half, be->pos[t], cs, sn);
		for (uint32_t h = 0; h < c->n_heads; h++)
			rope(be->q + (size_t)t * be->q_dim + (size_t)h * hd, cs, sn, half);
		for (uint32_t h = 0; h < c->n_kv_heads; h++)
			rope(be->k + (size_t)t * be->kv_dim + (size_t)h * hd, cs, sn, half);
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
	return 0;
}

static int ref_attn_blocks(struct backend_dev *be, const struct kv_span *spans, uint32_t n_spans)
{
	/* The rows the spans are for (those of one sequence, when the batch holds several). */
	uint32_t r0 = be->n, r1 = 0;
	for (uint32_t s = 0; s < n_spans; s++) {
		uint32_t a = spans[s].n_rows ? spans[s].row0 : 0, b = spans[s].n_rows ? a + spans[s].n_rows : be->n;
		r0 = a < r0 ? a : r0;
		r1 = b > r1 ? b : r1;
	}
	struct attn_job j = {.be = be, .spans = spans, .n_spans = n_spans, .row0 = r0};
	cpu_pool_run(be->pool, attn_items, &j, (r1 - r0) * be->cfg.n_heads);
	return 0;
}

static int ref_attn_end(struct backend_dev *be, const struct group_weights *w)
{
	const struct model_config *c = &be->cfg;
	uint32_t hd = c->head_dim;
	size_t pairs = (size_t)be->n * c->n_heads;
	for (size_t i = 0; i < pairs; i++) {
		/* Every query sees at least its own key; no weight means its block was not visited. */
		if (!(be->l[i] > 0))
			return fail(be, -EINVAL,
				    "cpu backend: attn_end(layer %u): the query at position %u saw no keys: the spans did "
				    "not cover its own position", be->layer, be->pos[i / c->n_heads]);
		double inv_l = 1.0 / be->l[i];
		/* (token, head) pair i is token i / n_heads, head i % n_heads: att is laid out the same. */
		for (uint32_t d = 0; d < hd; d++)
			be->att[i * hd + d] = (float)(be->acc[i * hd + d] * inv_l);
	}
	struct mm_job j = {
		.x = be->att, .in = be->q_dim, .n = be->n, .add = true, .n_parts = 1,
		.part = {{&w->t[ROLE_WO], be->x}},
	};
	matmul(be, &j);
	return 0;
}

/* down(silu(gate x) * up x) of one share (or the whole FFN) added into x: gate and up hold `rows`
 * rows, down as many columns from its data pointer. */
static void ffn_share_ref(struct backend_dev *be, const struct weight_tensor *gate, const struct weight_tensor *up,
			  const struct weight_tensor *down, uint32_t rows)
{
	const struct model_config *c = &be->cfg;
	uint32_t n = be->n;
	struct mm_job j = {
		.x = be->xn, .in = c->dim, .n = n, .n_parts = 2,
		.part = {{gate, be->gate}, {up, be->up}},
	};
	matmul(be, &j);
	size_t cnt = (size_t)n * rows;
	for (size_t i = 0; i < cnt; i++)
		be->gate[i] = cpu_silu_mul(be->gate[i], be->up[i]);
	struct mm_job jd = {
		.x = be->gate, .in = rows, .n = n, .add = true, .n_parts = 1,
		.part = {{down, be->x}},
	};
	matmul(be, &jd);
}

/* A part of the CPU share's job (task_pool.h): the share computes from be->xn into be->share_y. */
static int share_part(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	struct backend_dev *be = arg;
	int rc = ffn_share_part(be->share, &be->share_job, be->xn, be->share_y, part, n_parts, err, errlen);
	if (rc == 0 && part == 0 && be->share_fail_at && be->share_seq == be->share_fail_at) {
		/* The part's work done (the others wait for nothing of it), then a failure reported. */
		snprintf(err, errlen, "an injected failure (backend_ref_test_fail_cpu_share)");
		return -EIO;
	}
	return rc;
}

static struct ffn_share_mat share_mat(const struct weight_tensor *t)
{
	return (struct ffn_share_mat){.data = t->data[PLACE_HOST], .format = t->format, .row_bytes = t->row_bytes};
}

static int ref_ffn(struct backend_dev *be, const struct group_weights *w)
{
	const struct model_config *c = &be->cfg;
	const struct ffn_split *s = &w->split;
	rmsnorm_rows(be, &w->t[ROLE_FFN_NORM], be->n);
	if (s->where == FFN_SPLIT_NONE) {
		ffn_share_ref(be, &w->t[ROLE_W_GATE], &w->t[ROLE_W_UP], &w->t[ROLE_W_DOWN], c->ffn_dim);
		return 0;
	}
	uint32_t rest = c->ffn_dim - s->r;
	struct task_job job = {0};
	if (s->where == FFN_SPLIT_CPU) {
		if (!be->share)
			return fail(be, -ENOTSUP, "cpu backend: ffn: a CPU share, but no CPU pool was given at create");
		/* The CPU's share first, so it runs while this thread computes the first share. */
		struct ffn_share_mat g = share_mat(&s->gate), u = share_mat(&s->up), d = share_mat(&s->down);
		ffn_share_job_init(&be->share_job, &g, &u, &d, rest, be->n, DT_F32);
		task_job_init(&job, share_part, be, ffn_share_parts(be->share), &be->share_done, ++be->share_seq);
		job.done_waiters = &be->share_waiters;
		task_pool_submit(be->p.cpu_pool, &job); /* -ESHUTDOWN completes the job with its error */
	}
	if (s->r)
		ffn_share_ref(be, &w->t[ROLE_W_GATE], &w->t[ROLE_W_UP], &w->t[ROLE_W_DOWN], s->r);
	if (s->where == FFN_SPLIT_BACKEND) {
		ffn_share_ref(be, &s->gate, &s->up, &s->down, rest);
		return 0;
	}
	task_word_wait(&be->share_done, &be->share_waiters, be->share_seq, 50, 0);
	if (job.rc) {
		be->share_failed++;
		return fail(be, job.rc, "cpu backend: ffn: the CPU share failed: %s", job.err);
	}
	size_t cnt = (size_t)be->n * c->dim;
	for (size_t i = 0; i < cnt; i++)
		be->x[i] += be->share_y[i];
	return 0;
}

static int ref_moe_route(struct backend_dev *be, const struct group_weights *w)
{
	const struct model_config *c = &be->cfg;
	uint32_t n = be->n, k = c->n_experts_used;
	rmsnorm_rows(be, &w->t[ROLE_FFN_NORM], n);
	struct mm_job j = {
		.x = be->xn, .in = c->dim, .n = n, .n_parts = 1,
		.part = {{&w->t[ROLE_ROUTER], be->router}},
	};
	matmul(be, &j);
	for (uint32_t t = 0; t < n; t++)
		cpu_moe_route(be->router + (size_t)t * c->n_experts, c->n_experts, k, (c->flags & MODEL_NORM_TOPK) != 0,
			      be->sel + (size_t)t * k, be->sel_w + (size_t)t * k);
	memset(be->moe_sum, 0, (size_t)n * c->dim * sizeof(float));
	return 0;
}

/* Did a token of the layer's routing choose expert? (The engine then fetches only those.) */
static bool ref_moe_expert_used(struct backend_dev *be, uint32_t expert)
{
	const uint32_t chosen = be->n * be->cfg.n_experts_used;
	for (uint32_t i = 0; i < chosen; i++)
		if (be->sel[i] == expert)
			return true;
	return false;
}

static int ref_moe_expert(struct backend_dev *be, const struct group_weights *w, uint32_t expert)
{
	const struct model_config *c = &be->cfg;
	uint32_t n = be->n, k = c->n_experts_used, cnt = 0;
	for (uint32_t t = 0; t < n; t++) {
		for (uint32_t i = 0; i < k; i++) {
			if (be->sel[(size_t)t * k + i] != expert)
				continue;
			be->ex_tok[cnt] = t;
			be->ex_w[cnt] = be->sel_w[(size_t)t * k + i];
			memcpy(be->ex_x + (size_t)cnt * c->dim, be->xn + (size_t)t * c->dim, c->dim * sizeof(float));
			cnt++;
		}
	}
	if (!cnt)
		return 0;
	uint32_t f = c->expert_ffn_dim;
	struct mm_job j = {
		.x = be->ex_x, .in = c->dim, .n = cnt, .n_parts = 2,
		.part = {{&w->t[ROLE_EXPERT_GATE], be->gate}, {&w->t[ROLE_EXPERT_UP], be->up}},
	};
	matmul(be, &j);
	size_t m = (size_t)cnt * f;
	for (size_t i = 0; i < m; i++)
		be->gate[i] = cpu_silu_mul(be->gate[i], be->up[i]);
	struct mm_job jd = {
		.x = be->gate, .in = f, .n = cnt, .n_parts = 1,
		.part = {{&w->t[ROLE_EXPERT_DOWN], be->ex_y}},
	};
	matmul(be, &jd);
	/* expert(x) * weight, rounded to float32, then added: as index_add_ of the weighted rows. */
	for (uint32_t i = 0; i < cnt; i++) {
		float *dst = be->moe_sum + (size_t)be->ex_tok[i] * c->dim;
		const float *y = be->ex_y + (size_t)i * c->dim;
		for (uint32_t d = 0; d < c->dim; d++) {
			float v = y[d] * be->ex_w[i];
			dst[d] += v;
		}
	}
	return 0;
}

static int ref_moe_end(struct backend_dev *be)
{
	size_t cnt = (size_t)be->n * be->cfg.dim;
	for (size_t i = 0; i < cnt; i++)
		be->x[i] += be->moe_sum[i];
	return 0;
}

static int ref_logits(struct backend_dev *be, const struct group_weights *w, float *out)
{
	const struct model_config *c = &be->cfg;
	const struct weight_tensor *nw = &w->t[ROLE_FINAL_NORM];
	cpu_rmsnorm(be->xn, be->x + (size_t)(be->n - 1) * c->dim, nw->data[PLACE_HOST], nw->format, c->dim, c->rms_eps);
	struct mm_job j = {
		.x = be->xn, .in = c->dim, .n = 1, .n_parts = 1,
		.part = {{&w->t[ROLE_LM_HEAD], out}},
	};
	matmul(be, &j);
	return 0;
}

/* The head of several rows (one per sequence of the batch): out is n_rows x vocab_size. */
static int ref_logits_rows(struct backend_dev *be, const struct group_weights *w, const uint32_t *rows,
			   uint32_t n_rows, float *out)
{
	const struct model_config *c = &be->cfg;
	const struct weight_tensor *nw = &w->t[ROLE_FINAL_NORM];
	for (uint32_t i = 0; i < n_rows; i++)
		cpu_rmsnorm(be->xn + (size_t)i * c->dim, be->x + (size_t)rows[i] * c->dim, nw->data[PLACE_HOST], nw->format,
			    c->dim, c->rms_eps);
	struct mm_job j = {
		.x = be->xn, .in = c->dim, .n = n_rows, .n_parts = 1,
		.part = {{&w->t[ROLE_LM_HEAD], out}},
	};
	matmul(be, &j);
	return 0;
}

static void ref_cpu_share_stats(struct backend_dev *be, struct backend_cpu_share_stats *out)
{
	if (!be->share)
		return;
	struct ffn_share_stats st;
	ffn_share_get_stats(be->share, &st);
	snprintf(out->handoff, sizeof(out->handoff), "direct");
	out->jobs = st.jobs;
	out->failed = be->share_failed;
	out->bytes = st.bytes;
	out->cpu_ms = (double)st.ns / 1e6;
	out->phase_wait_ms = (double)st.wait_ns / 1e6;
}

static const char *ref_error(struct backend_dev *be)
{
	return be->err;
}

/* ---- create / destroy ------------------------------------------------------------------- */

/* Joins the pool and frees everything; NULLs *bep; safe on NULL and twice. */
static void ref_destroy(struct backend_dev **bep)
{
	struct backend_dev *be = *bep;
	if (!be)
		return;
	cpu_pool_destroy(&be->pool);
	/* The task pool outlives this backend: the thread that completed the last CPU share may
	 * still read share_waiters, which is freed with be. */
	if (be->p.cpu_pool)
		task_pool_quiesce(be->p.cpu_pool);
	ffn_share_destroy(&be->share);
	free(be->share_y);
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
	free(be->router);
	free(be->sel);
	free(be->sel_w);
	free(be->moe_sum);
	free(be->ex_x);
	free(be->ex_y);
	free(be->ex_tok);
	free(be->ex_w);
	free(be->rope_cs);
	free(be->pos);
	free(be->rows);
	free(be->scores);
	free(be);
	*bep = NULL;
}

/* What this backend adds to backend_check_config, which the front has run. */
static int check_config(const struct model_config *c, const struct backend_params *p, char *err, size_t errlen)
{
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
static int ref_create(const struct model_config *cfg, const struct backend_params *p, struct backend_dev **out,
		      char *err, size_t errlen)
{
	assert(cfg && p && out && err);
	*out = NULL;
	int rc = check_config(cfg, p, err, errlen);
	if (rc)
		return rc;
	struct backend_dev *be = calloc(1, sizeof(*be));
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
	uint32_t ffn = cfg->ffn_dim > cfg->expert_ffn_dim ? cfg->ffn_dim : cfg->expert_ffn_dim;
	if (ffn > be->max_in)
		be->max_in = ffn;
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
	be->gate = alloc_array(mc, ffn, sizeof(float));
	be->up = alloc_array(mc, ffn, sizeof(float));
	be->rope_cs = alloc_array(cfg->head_dim, 1, sizeof(float));
	be->rows = alloc_array(be->threads, be->max_in, sizeof(float));
	be->scores = alloc_array(be->threads, p->block_tokens, sizeof(double));
	be->pos = alloc_array(mc, 1, sizeof(uint32_t));
	if (!be->pos || !be->inv_freq || !be->x || !be->xn || !be->q || !be->k || !be->v || !be->att || !be->acc || !be->m ||
	    !be->l || !be->gate || !be->up || !be->rope_cs || !be->rows || !be->scores) {
		snprintf(err, errlen, "cpu backend: out of memory for the buffers of %u-token chunks", p->max_chunk);
		rc = -ENOMEM;
		goto out_destroy;
	}
	if (cfg->n_experts) {
		be->router = alloc_array(mc, cfg->n_experts, sizeof(float));
		be->sel = alloc_array(mc, cfg->n_experts_used, sizeof(uint32_t));
		be->sel_w = alloc_array(mc, cfg->n_experts_used, sizeof(float));
		be->moe_sum = alloc_array(mc, cfg->dim, sizeof(float));
		be->ex_x = alloc_array(mc, cfg->dim, sizeof(float));
		be->ex_y = alloc_array(mc, cfg->dim, sizeof(float));
		be->ex_tok = alloc_array(mc, 1, sizeof(uint32_t));
		be->ex_w = alloc_array(mc, 1, sizeof(float));
		if (!be->router || !be->sel || !be->sel_w || !be->moe_sum || !be->ex_x || !be->ex_y || !be->ex_tok ||
		    !be->ex_w) {
			snprintf(err, errlen, "cpu backend: out of memory for the expert buffers of %u-token chunks",
				 p->max_chunk);
			rc = -ENOMEM;
			goto out_destroy;
		}
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
	char why[200];
	rc = cpu_pool_create(be->threads, &be->pool, why, sizeof(why));
	if (rc) {
		snprintf(err, errlen, "cpu backend: %s", why);
		goto out_destroy;
	}
	if (p->cpu_pool) {
		uint32_t t = task_pool_threads(p->cpu_pool);
		rc = ffn_share_create(cfg->dim, cfg->ffn_dim, FFN_SPLIT_MAX_TOKENS,
				      t < FFN_SHARE_MAX_THREADS ? t : FFN_SHARE_MAX_THREADS, &be->share, why, sizeof(why));
		if (rc == 0 && !(be->share_y = alloc_array(FFN_SPLIT_MAX_TOKENS, cfg->dim, sizeof(float))))
			rc = errorf(why, sizeof(why), -ENOMEM, "out of memory for the CPU share's output");
		if (rc) {
			snprintf(err, errlen, "cpu backend: %s", why);
			goto out_destroy;
		}
	}
	*out = be;
	return 0;

out_destroy:
	ref_destroy(&be);
	return rc;
}

static const struct backend_compute_ops ref_compute = {
	.embed = ref_embed,
	.attn_begin = ref_attn_begin,
	.attn_blocks = ref_attn_blocks,
	.attn_end = ref_attn_end,
	.ffn = ref_ffn,
	.logits = ref_logits,
	.logits_rows = ref_logits_rows,
	/* logits_argmax: the front's (logits, then argmax on the host); no logits_sample. */
	.cpu_share_stats = ref_cpu_share_stats,
	.moe_route = ref_moe_route,
	.moe_expert = ref_moe_expert,
	.moe_end = ref_moe_end,
	.moe_expert_used = ref_moe_expert_used,
	.hidden_in = ref_hidden_in,
	.hidden_get = ref_hidden_get,
	.hidden_put = ref_hidden_put,
};

static const struct backend_kv_ops ref_kv = {
	.block_bytes = ref_kv_block_bytes,
	.to_host = ref_kv_to_host,
	.from_host = ref_kv_from_host,
	/* The rest are the front's defaults: copies happen at once, nothing to wait for or pin. */
};

int backend_ref_test_fail_cpu_share(struct backend *bk, uint32_t nth, char *err, size_t errlen)
{
	if (backend_impl_of(bk) != &backend_ref_impl)
		return errorf(err, errlen, -EINVAL, "test hook: backend '%s' is not the cpu backend", backend_name(bk));
	struct backend_dev *be = backend_dev_of(bk);
	if (!be->share)
		return errorf(err, errlen, -EINVAL, "test hook: the backend has no CPU share (no backend_params.cpu_pool)");
	be->share_fail_at = nth ? be->share_seq + nth : 0;
	return 0;
}

const struct backend_impl backend_ref_impl = {
	.name = "cpu",
	.place = PLACE_HOST,
	.create = ref_create,
	.destroy = ref_destroy,
	.error = ref_error,
	.compute = &ref_compute,
	.kv = &ref_kv,
};

/* test_kernels.c - the C reference backend against a naive double-precision Llama forward.
 *
 * The test builds small random models in memory (normal weights of std 0.02, norms 1 + small
 * noise), runs them through the "cpu" backend exactly as the engine will (embed, per layer
 * attn_begin / attn_blocks / attn_end / ffn, logits; KV blocks managed here: block index =
 * layer * blocks_per_layer + position / block_tokens), and compares the logits of the last
 * position with a plain double-precision forward over the same weights (full causal attention
 * over all positions, no arena). Set PIPELINE_TEST_VERBOSE=1 to print the errors measured. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/model.h"
#include "common/quant.h"
#include "services/gpu-runner/backend.h"
#include "tests/unit/gpu-runner/runner_test_util.h"

#define TOL 1e-5 /* relative L2 error of the logits */
#define MAX_PROMPT 64

/* ---- test models -------------------------------------------------------------------------- */

struct tlayer {
	float *attn_norm, *wq, *wk, *wv, *wo; /* decoded values, the shapes of model.h */
	float *ffn_norm, *wg, *wu, *wd;
};

struct tmodel {
	struct model_config cfg;
	enum dtype wt;
	float *embed, *final_norm, *lm_head; /* lm_head == embed when tied */
	struct tlayer *layers;
	struct group_weights embed_w, head_w;
	struct group_weights *attn_w, *ffn_w; /* (n_layers) */
	void *allocs[256];
	uint32_t n_allocs;
};

static void *track(struct tmodel *m, void *p)
{
	ck_assert_ptr_nonnull(p);
	ck_assert_uint_lt(m->n_allocs, 256);
	m->allocs[m->n_allocs++] = p;
	return p;
}

/* A tensor of n values mean + std * N(0,1), stored in the model's dtype for the backend
 * (gw->t[role]) and decoded back to float for the reference, so both see the same numbers. */
static float *tensor(struct tmodel *m, size_t n, double mean, double std, struct group_weights *gw,
		     enum tensor_role role)
{
	uint32_t ndim;
	uint64_t shape[2];
	ck_assert_int_eq(model_expected_shape(&m->cfg, role, &ndim, shape), 0);
	ck_assert_uint_eq(ndim == 1 ? shape[0] : shape[0] * shape[1], n);
	/* Norm vectors stay F32 in a model of block-format matrices, as in a GGUF file. */
	enum dtype wt = ndim == 1 && !dtype_is_element(m->wt) ? DT_F32 : m->wt;
	float *val = track(m, malloc(n * sizeof(float)));
	float *raw = track(m, malloc(n * sizeof(float)));
	void *enc = track(m, malloc(dtype_row_bytes(wt, n)));
	for (size_t i = 0; i < n; i++)
		raw[i] = (float)(mean + std * rng_normal());
	quant_quantize(wt, raw, enc, n);
	dtype_to_f32(wt, enc, val, n);
	weight_tensor_set(&gw->t[role], PLACE_HOST, enc, wt, ndim == 1 ? 1 : (uint32_t)shape[0],
			  (uint32_t)(ndim == 1 ? shape[0] : shape[1]));
	return val;
}

static struct model_config base_cfg(void)
{
	struct model_config c = {
		.arch = ARCH_LLAMA, .n_layers = 2, .dim = 64, .n_heads = 4, .n_kv_heads = 2, .head_dim = 16,
		.ffn_dim = 192, .vocab_size = 512, .max_position = 4096, .rms_eps = 1e-5f, .rope_theta = 10000.0f,
		.rope_scaling = ROPE_SCALING_NONE, .bos_id = -1,
	};
	return c;
}

static struct tmodel *model_new(const struct model_config *cfg, enum dtype wt, uint64_t seed)
{
	struct tmodel *m = calloc(1, sizeof(*m));
	ck_assert_ptr_nonnull(m);
	m->cfg = *cfg;
	m->wt = wt;
	rng_state = seed;
	const struct model_config *c = &m->cfg;
	size_t qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
	m->layers = track(m, calloc(c->n_layers, sizeof(*m->layers)));
	m->attn_w = track(m, calloc(c->n_layers, sizeof(*m->attn_w)));
	m->ffn_w = track(m, calloc(c->n_layers, sizeof(*m->ffn_w)));
	m->embed = tensor(m, (size_t)c->vocab_size * c->dim, 0, 0.02, &m->embed_w, ROLE_EMBED);
	for (uint32_t l = 0; l < c->n_layers; l++) {
		struct tlayer *L = &m->layers[l];
		struct group_weights *a = &m->attn_w[l], *f = &m->ffn_w[l];
		L->attn_norm = tensor(m, c->dim, 1.0, 0.1, a, ROLE_ATTN_NORM);
		L->wq = tensor(m, qd * c->dim, 0, 0.02, a, ROLE_WQ);
		L->wk = tensor(m, kvd * c->dim, 0, 0.02, a, ROLE_WK);
		L->wv = tensor(m, kvd * c->dim, 0, 0.02, a, ROLE_WV);
		L->wo = tensor(m, (size_t)c->dim * qd, 0, 0.02, a, ROLE_WO);
		L->ffn_norm = tensor(m, c->dim, 1.0, 0.1, f, ROLE_FFN_NORM);
		L->wg = tensor(m, (size_t)c->ffn_dim * c->dim, 0, 0.02, f, ROLE_W_GATE);
		L->wu = tensor(m, (size_t)c->ffn_dim * c->dim, 0, 0.02, f, ROLE_W_UP);
		L->wd = tensor(m, (size_t)c->dim * c->ffn_dim, 0, 0.02, f, ROLE_W_DOWN);
	}
	m->final_norm = tensor(m, c->dim, 1.0, 0.1, &m->head_w, ROLE_FINAL_NORM);
	if (c->tie_embeddings) {
		/* What the engine does with tied embeddings: the head's lm_head is the embed table. */
		m->lm_head = m->embed;
		m->head_w.t[ROLE_LM_HEAD] = m->embed_w.t[ROLE_EMBED];
	} else {
		m->lm_head = tensor(m, (size_t)c->vocab_size * c->dim, 0, 0.02, &m->head_w, ROLE_LM_HEAD);
	}
	return m;
}

static void model_free(struct tmodel **mp)
{
	struct tmodel *m = *mp;
	for (uint32_t i = 0; i < m->n_allocs; i++)
		free(m->allocs[i]);
	free(m);
	*mp = NULL;
}

static void make_prompt(int32_t *tok, uint32_t n, uint32_t vocab, uint64_t seed)
{
	rng_state = seed;
	for (uint32_t i = 0; i < n; i++)
		tok[i] = (int32_t)(rng_next() % vocab);
}

/* ---- the double-precision reference ----------------------------------------------------- */

enum ref_bug {
	BUG_NONE = 0,
	BUG_ROPE_INTERLEAVED, /* rotate pairs (2i, 2i+1) instead of (i, i + hd/2): with cfg.rope_layout
			       * ROPE_ADJACENT this is not a bug but what GGUF's layout asks for */
	BUG_GQA_MODULO,	      /* query head h reads kv head h % n_kv_heads instead of h / group */
	BUG_NO_CAUSAL_MASK,   /* every query sees every key */
};

/* inv_freq by the formulas of transformers, in double. */
static void ref_inv_freq(const struct model_config *c, double *inv)
{
	uint32_t hd = c->head_dim;
	for (uint32_t i = 0; i < hd / 2; i++) {
		double f = 1.0 / pow((double)c->rope_theta, (double)(2 * i) / hd);
		if (c->rope_scaling == ROPE_SCALING_LINEAR) {
			f /= c->rope_factor;
		} else if (c->rope_scaling == ROPE_SCALING_LLAMA3) {
			double orig = c->rope_original_max_position, lo = c->rope_low_freq_factor;
			double hi = c->rope_high_freq_factor, factor = c->rope_factor;
			double wavelen = 2 * M_PI / f;
			if (wavelen < orig / hi) {
				/* high frequency: kept */
			} else if (wavelen > orig / lo) {
				f /= factor;
			} else {
				double smooth = (orig / wavelen - lo) / (hi - lo);
				f = (1 - smooth) * f / factor + smooth * f;
			}
		}
		inv[i] = f;
	}
}

static void ref_matvec(double *y, const float *w, const double *x, uint32_t rows, uint32_t cols)
{
	for (uint32_t o = 0; o < rows; o++) {
		double s = 0;
		for (uint32_t i = 0; i < cols; i++)
			s += (double)w[(size_t)o * cols + i] * x[i];
		y[o] = s;
	}
}

static void ref_rmsnorm(double *y, const double *x, const float *w, uint32_t dim, double eps)
{
	double ss = 0;
	for (uint32_t i = 0; i < dim; i++)
		ss += x[i] * x[i];
	double r = 1.0 / sqrt(ss / dim + eps);
	for (uint32_t i = 0; i < dim; i++)
		y[i] = w[i] * x[i] * r;
}

static void ref_rope(double *x, const double *inv, uint32_t hd, uint32_t pos, enum ref_bug bug)
{
	uint32_t half = hd / 2;
	for (uint32_t i = 0; i < half; i++) {
		double a = pos * inv[i], c = cos(a), s = sin(a);
		uint32_t i1 = bug == BUG_ROPE_INTERLEAVED ? 2 * i : i;
		uint32_t i2 = bug == BUG_ROPE_INTERLEAVED ? 2 * i + 1 : i + half;
		double x1 = x[i1], x2 = x[i2];
		x[i1] = x1 * c - x2 * s;
		x[i2] = x2 * c + x1 * s;
	}
}

/* Logits of the last of tokens[0..n) (positions 0..n-1), in double. */
static void ref_forward(const struct tmodel *m, const int32_t *tok, uint32_t n, enum ref_bug bug, double *logits)
{
	const struct model_config *c = &m->cfg;
	uint32_t dim = c->dim, hd = c->head_dim, nh = c->n_heads, nkv = c->n_kv_heads, ffn = c->ffn_dim;
	uint32_t qd = nh * hd, kvd = nkv * hd, group = nh / nkv;
	double *x = calloc((size_t)n * dim, sizeof(double)), *xn = calloc(dim, sizeof(double));
	double *q = calloc((size_t)n * qd, sizeof(double)), *k = calloc((size_t)n * kvd, sizeof(double));
	double *v = calloc((size_t)n * kvd, sizeof(double)), *att = calloc(qd, sizeof(double));
	double *y = calloc(dim > ffn ? dim : ffn, sizeof(double)), *g = calloc(ffn, sizeof(double));
	double *u = calloc(ffn, sizeof(double)), *sc = calloc(n, sizeof(double)), *inv = calloc(hd / 2, sizeof(double));
	ck_assert(x && xn && q && k && v && att && y && g && u && sc && inv);
	ref_inv_freq(c, inv);

	for (uint32_t t = 0; t < n; t++)
		for (uint32_t i = 0; i < dim; i++)
			x[(size_t)t * dim + i] = m->embed[(size_t)tok[t] * dim + i];
	for (uint32_t l = 0; l < c->n_layers; l++) {
		const struct tlayer *L = &m->layers[l];
		for (uint32_t t = 0; t < n; t++) {
			ref_rmsnorm(xn, x + (size_t)t * dim, L->attn_norm, dim, c->rms_eps);
			ref_matvec(q + (size_t)t * qd, L->wq, xn, qd, dim);
			ref_matvec(k + (size_t)t * kvd, L->wk, xn, kvd, dim);
			ref_matvec(v + (size_t)t * kvd, L->wv, xn, kvd, dim);
			for (uint32_t h = 0; h < nh; h++)
				ref_rope(q + (size_t)t * qd + h * hd, inv, hd, t, bug);
			for (uint32_t h = 0; h < nkv; h++)
				ref_rope(k + (size_t)t * kvd + h * hd, inv, hd, t, bug);
		}
		/* Attention needs every position's K and V of this layer first: new residuals after. */
		double *xnew = calloc((size_t)n * dim, sizeof(double));
		ck_assert_ptr_nonnull(xnew);
		for (uint32_t t = 0; t < n; t++) {
			for (uint32_t h = 0; h < nh; h++) {
				uint32_t kvh = bug == BUG_GQA_MODULO ? h % nkv : h / group;
				double mx = -INFINITY, sum = 0;
				uint32_t last = bug == BUG_NO_CAUSAL_MASK ? n - 1 : t;
				for (uint32_t j = 0; j <= last; j++) {
					bool visible = !c->sliding_window || t < j || t - j < c->sliding_window;
					double s = 0;
					for (uint32_t d = 0; d < hd; d++)
						s += q[(size_t)t * qd + h * hd + d] * k[(size_t)j * kvd + kvh * hd + d];
					sc[j] = visible ? s / sqrt((double)hd) : -INFINITY;
					if (sc[j] > mx)
						mx = sc[j];
				}
				for (uint32_t j = 0; j <= last; j++) {
					sc[j] = exp(sc[j] - mx);
					sum += sc[j];
				}
				for (uint32_t d = 0; d < hd; d++) {
					double a = 0;
					for (uint32_t j = 0; j <= last; j++)
						a += sc[j] * v[(size_t)j * kvd + kvh * hd + d];
					att[h * hd + d] = a / sum;
				}
			}
			ref_matvec(y, L->wo, att, dim, qd);
			for (uint32_t i = 0; i < dim; i++)
				xnew[(size_t)t * dim + i] = x[(size_t)t * dim + i] + y[i];
		}
		memcpy(x, xnew, (size_t)n * dim * sizeof(double));
		free(xnew);
		for (uint32_t t = 0; t < n; t++) {
			double *xt = x + (size_t)t * dim;
			ref_rmsnorm(xn, xt, L->ffn_norm, dim, c->rms_eps);
			ref_matvec(g, L->wg, xn, ffn, dim);
			ref_matvec(u, L->wu, xn, ffn, dim);
			for (uint32_t i = 0; i < ffn; i++)
				g[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
			ref_matvec(y, L->wd, g, dim, ffn);
			for (uint32_t i = 0; i < dim; i++)
				xt[i] += y[i];
		}
	}
	ref_rmsnorm(xn, x + (size_t)(n - 1) * dim, m->final_norm, dim, c->rms_eps);
	ref_matvec(logits, m->lm_head, xn, c->vocab_size, dim);
	free(x), free(xn), free(q), free(k), free(v), free(att), free(y), free(g), free(u), free(sc), free(inv);
}

/* ---- driving the backend like the engine ------------------------------------------------ */

enum span_mode {
	SPANS_IN_ORDER = 0,  /* one attn_blocks call, blocks in position order */
	SPANS_REVERSE = 1,   /* one attn_blocks call per block, last block first */
	SPANS_PIECES = 2,    /* odd blocks in one call, then even blocks in another */
};

struct runner {
	struct backend *be;
	struct backend_params p;
	uint32_t bpl; /* blocks per layer */
};

static struct backend_params default_params(void)
{
	return (struct backend_params){.max_chunk = MAX_PROMPT, .block_tokens = 16, .n_kv_blocks = 0,
				       .kv_dtype = DT_F32, .threads = 1};
}

static void runner_open(struct runner *r, const struct tmodel *m, struct backend_params p)
{
	char err[256] = "";
	r->bpl = (MAX_PROMPT + p.block_tokens - 1) / p.block_tokens;
	p.n_kv_blocks = m->cfg.n_layers * r->bpl;
	r->p = p;
	int rc = backend_create("cpu", &m->cfg, &p, &r->be, err, sizeof(err));
	ck_assert_msg(rc == 0, "create: %d %s", rc, err);
}

static void runner_close(struct runner *r)
{
	backend_destroy(&r->be);
	ck_assert_ptr_null(r->be);
	backend_destroy(&r->be); /* safe twice */
}

/* embed of tokens[0..n) at consecutive positions from pos0, one sequence (as the engine). */
static int embed(struct backend *be, const struct group_weights *w, const int32_t *tok, uint32_t n, uint32_t pos0)
{
	uint32_t pos[MAX_PROMPT + 1], seq[MAX_PROMPT + 1];
	ck_assert_uint_le(n, MAX_PROMPT + 1);
	for (uint32_t i = 0; i < n; i++) {
		pos[i] = pos0 + i;
		seq[i] = 0;
	}
	struct backend_batch b = {.n = n, .tokens = tok, .pos = pos, .seq = seq};
	return backend_embed(be, w, &b);
}

/* One arena block to and from host memory. */
static int kv_out(struct backend *be, uint32_t block, void *dst)
{
	return backend_kv_to_host(be, 1, &block, &dst);
}

static int kv_in(struct backend *be, uint32_t block, const void *src)
{
	return backend_kv_from_host(be, 1, &block, &src);
}

#define CHECK_RC(r, expr)                                                                         \
	do {                                                                                      \
		int rc_ = (expr);                                                                 \
		ck_assert_msg(rc_ == 0, "%s: %d %s", #expr, rc_, backend_error((r)->be));       \
	} while (0)

/* One forward step over tokens[0..n) at positions pos0.., as the engine runs it. */
static void runner_step(struct runner *r, const struct tmodel *m, const int32_t *tok, uint32_t n, uint32_t pos0,
			enum span_mode mode, float *logits)
{
	uint32_t bt = r->p.block_tokens, dst_block[MAX_PROMPT], dst_row[MAX_PROMPT];
	struct kv_span spans[MAX_PROMPT], part[MAX_PROMPT];
	ck_assert_uint_le(pos0 + n, MAX_PROMPT);
	CHECK_RC(r, embed(r->be, &m->embed_w, tok, n, pos0));
	for (uint32_t l = 0; l < m->cfg.n_layers; l++) {
		for (uint32_t i = 0; i < n; i++) {
			dst_block[i] = l * r->bpl + (pos0 + i) / bt;
			dst_row[i] = (pos0 + i) % bt;
		}
		CHECK_RC(r, backend_attn_begin(r->be, &m->attn_w[l], l, dst_block, dst_row));
		uint32_t end = pos0 + n, ns = 0;
		for (uint32_t b = 0; b * bt < end; b++) {
			uint32_t cnt = end - b * bt < bt ? end - b * bt : bt;
			spans[ns++] = (struct kv_span){.block = l * r->bpl + b, .pos0 = b * bt, .n_tokens = cnt};
		}
		if (mode == SPANS_IN_ORDER) {
			CHECK_RC(r, backend_attn_blocks(r->be, spans, ns));
		} else if (mode == SPANS_REVERSE) {
			for (uint32_t s = ns; s-- > 0;)
				CHECK_RC(r, backend_attn_blocks(r->be, &spans[s], 1));
		} else {
			for (uint32_t pass = 0; pass < 2; pass++) {
				uint32_t np = 0;
				for (uint32_t s = pass == 0 ? 1 : 0; s < ns; s += 2)
					part[np++] = spans[s];
				CHECK_RC(r, backend_attn_blocks(r->be, part, np));
			}
		}
		CHECK_RC(r, backend_attn_end(r->be, &m->attn_w[l]));
		CHECK_RC(r, backend_ffn(r->be, &m->ffn_w[l]));
	}
	CHECK_RC(r, backend_logits(r->be, &m->head_w, logits));
}

/* Runs tokens[0..n) in chunks of `chunk` tokens (0: one chunk); logits of the last step. */
static void run_prompt(const struct tmodel *m, struct backend_params p, const int32_t *tok, uint32_t n,
		       uint32_t chunk, enum span_mode mode, float *logits)
{
	struct runner r;
	runner_open(&r, m, p);
	if (!chunk)
		chunk = n;
	for (uint32_t pos = 0; pos < n; pos += chunk)
		runner_step(&r, m, tok + pos, pos + chunk <= n ? chunk : n - pos, pos, mode, logits);
	runner_close(&r);
}

static double rel_l2_fd(const float *a, const double *ref, uint32_t n)
{
	double num = 0, den = 0;
	for (uint32_t i = 0; i < n; i++) {
		num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
		den += ref[i] * ref[i];
	}
	return sqrt(num / den);
}

static double rel_l2_ff(const float *a, const float *b, uint32_t n)
{
	double num = 0, den = 0;
	for (uint32_t i = 0; i < n; i++) {
		num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
		den += (double)b[i] * b[i];
	}
	return sqrt(num / den);
}

static void report(const char *what, double err)
{
	if (test_verbose())
		fprintf(stderr, "test_kernels: %-34s relative L2 error %.3e\n", what, err);
}

/* Builds a model of cfg in dtype wt, runs a 37-token prompt (more than two 16-token blocks) as
 * one chunk and compares with the double reference. */
static double check_against_reference_as(const struct model_config *cfg, enum dtype wt, enum ref_bug as,
					const char *what)
{
	struct tmodel *m = model_new(cfg, wt, 1234);
	uint32_t n = 37;
	int32_t tok[MAX_PROMPT];
	make_prompt(tok, n, cfg->vocab_size, 99);
	float *got = calloc(cfg->vocab_size, sizeof(float));
	double *want = calloc(cfg->vocab_size, sizeof(double));
	ck_assert(got && want);
	run_prompt(m, default_params(), tok, n, 0, SPANS_IN_ORDER, got);
	ref_forward(m, tok, n, as, want);
	double err = rel_l2_fd(got, want, cfg->vocab_size);
	report(what, err);
	ck_assert_msg(err < TOL, "%s: relative L2 error %.3e against the double reference", what, err);
	free(got);
	free(want);
	model_free(&m);
	return err;
}

static double check_against_reference(const struct model_config *cfg, enum dtype wt, const char *what)
{
	return check_against_reference_as(cfg, wt, BUG_NONE, what);
}

/* ---- forward against the reference ------------------------------------------------------ */

START_TEST(test_gqa_f32)
{
	struct model_config c = base_cfg();
	check_against_reference(&c, DT_F32, "gqa f32");
}
END_TEST

START_TEST(test_mha)
{
	struct model_config c = base_cfg();
	c.n_kv_heads = c.n_heads;
	check_against_reference(&c, DT_F32, "mha f32");
}
END_TEST

START_TEST(test_head_dim_not_dim_over_heads)
{
	struct model_config c = base_cfg();
	c.head_dim = 32; /* q_proj (128, 64), o_proj (64, 128) */
	check_against_reference(&c, DT_F32, "head_dim 32, dim 64, 4 heads");
}
END_TEST

START_TEST(test_tied_embeddings)
{
	struct model_config c = base_cfg();
	c.tie_embeddings = 1;
	check_against_reference(&c, DT_F32, "tied embeddings");
}
END_TEST

START_TEST(test_rope_llama3)
{
	struct model_config c = base_cfg();
	/* A small original context so the 37 positions of the prompt feel all three bands: with
	 * theta 1e4 and head_dim 16 the wavelengths run 6.3 .. 2.1e4, the band edges are 64/4 = 16
	 * and 64/1 = 64. */
	c.rope_scaling = ROPE_SCALING_LLAMA3;
	c.rope_factor = 8;
	c.rope_low_freq_factor = 1;
	c.rope_high_freq_factor = 4;
	c.rope_original_max_position = 64;
	check_against_reference(&c, DT_F32, "llama3 rope scaling");
}
END_TEST

START_TEST(test_rope_linear)
{
	struct model_config c = base_cfg();
	c.rope_scaling = ROPE_SCALING_LINEAR;
	c.rope_factor = 4;
	check_against_reference(&c, DT_F32, "linear rope scaling");
}
END_TEST

START_TEST(test_rope_theta_llama3_real)
{
	struct model_config c = base_cfg();
	c.rope_theta = 500000.0f;
	c.rope_scaling = ROPE_SCALING_LLAMA3;
	c.rope_factor = 8;
	c.rope_low_freq_factor = 1;
	c.rope_high_freq_factor = 4;
	c.rope_original_max_position = 8192;
	check_against_reference(&c, DT_F32, "llama3.1 rope parameters");
}
END_TEST

START_TEST(test_bf16)
{
	struct model_config c = base_cfg();
	check_against_reference(&c, DT_BF16, "bf16 weights");
}
END_TEST

START_TEST(test_f16)
{
	struct model_config c = base_cfg();
	check_against_reference(&c, DT_F16, "f16 weights");
}
END_TEST

START_TEST(test_sliding_window)
{
	struct model_config c = base_cfg();
	c.arch = ARCH_MISTRAL;
	c.sliding_window = 8; /* the 37-token prompt sees only its last 8 keys */
	check_against_reference(&c, DT_F32, "sliding window 8");
}
END_TEST

/* Matrices in GGUF block formats: the C reference dequantizes each row exactly, so the result is
 * that of the dequantized weights (the double reference runs on those). 256 columns and more:
 * every matrix holds whole K blocks. */
START_TEST(test_block_formats)
{
	static const enum dtype types[] = {DT_Q8_0, DT_Q4_0, DT_Q4_K, DT_Q5_K, DT_Q6_K};
	struct model_config c = base_cfg();
	c.dim = 256;
	c.n_heads = 4;
	c.n_kv_heads = 2;
	c.head_dim = 64;
	c.ffn_dim = 512;
	c.n_layers = 1;
	for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
		char what[64];
		snprintf(what, sizeof(what), "%s weights", dtype_name(types[i]));
		check_against_reference(&c, types[i], what);
	}
}
END_TEST

/* GGUF's RoPE layout: pairs (2i, 2i+1). The reference's "interleaved" variant is that layout. */
START_TEST(test_rope_adjacent)
{
	struct model_config c = base_cfg();
	c.rope_layout = ROPE_ADJACENT;
	check_against_reference_as(&c, DT_F32, BUG_ROPE_INTERLEAVED, "rope layout adjacent");
}
END_TEST

/* GGUF stores the rows of wq and wk permuted (within each head, row j*2+k holds the original row
 * k*hd/2+j) and rotates adjacent pairs: the same function as the original rows with halves. */
START_TEST(test_rope_adjacent_permuted_rows_same_function)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_F32, 4321);
	uint32_t n = 37, hd = c.head_dim, dim = c.dim;
	int32_t tok[MAX_PROMPT];
	make_prompt(tok, n, c.vocab_size, 7);
	float *want = calloc(c.vocab_size, sizeof(float)), *got = calloc(c.vocab_size, sizeof(float));
	ck_assert(want && got);
	run_prompt(m, default_params(), tok, n, 0, SPANS_IN_ORDER, want);
	for (uint32_t l = 0; l < c.n_layers; l++) {
		for (int which = 0; which < 2; which++) {
			uint32_t heads = which ? c.n_kv_heads : c.n_heads;
			/* The backend's F32 bytes (the reference's copy is not used again). */
			const struct weight_tensor *t = &m->attn_w[l].t[which ? ROLE_WK : ROLE_WQ];
			float *orig = malloc((size_t)heads * hd * dim * sizeof(float));
			ck_assert_ptr_nonnull(orig);
			memcpy(orig, t->data[PLACE_HOST], (size_t)heads * hd * dim * sizeof(float));
			for (uint32_t h = 0; h < heads; h++)
				for (uint32_t j = 0; j < hd / 2; j++)
					for (uint32_t k = 0; k < 2; k++)
						memcpy((float *)t->data[PLACE_HOST] + ((size_t)h * hd + j * 2 + k) * dim,
						       orig + ((size_t)h * hd + k * (hd / 2) + j) * dim, dim * sizeof(float));
			free(orig);
		}
	}
	m->cfg.rope_layout = ROPE_ADJACENT;
	run_prompt(m, default_params(), tok, n, 0, SPANS_IN_ORDER, got);
	double err = rel_l2_ff(got, want, c.vocab_size);
	report("permuted rows, adjacent rope", err);
	ck_assert_msg(err < TOL, "permuted wq/wk with adjacent RoPE: relative L2 %.3e from the original", err);
	/* ... and the layout matters: the permuted rows with halves RoPE are another function. */
	m->cfg.rope_layout = ROPE_HALVES;
	run_prompt(m, default_params(), tok, n, 0, SPANS_IN_ORDER, got);
	err = rel_l2_ff(got, want, c.vocab_size);
	ck_assert_msg(err > 100 * TOL, "permuted rows with halves RoPE: error %.3e is not far off", err);
	free(want);
	free(got);
	model_free(&m);
}
END_TEST

/* The comparison must be able to fail: a reference with a classic bug is far off. */
START_TEST(test_reference_detects_bugs)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_F32, 1234);
	uint32_t n = 37;
	int32_t tok[MAX_PROMPT];
	make_prompt(tok, n, c.vocab_size, 99);
	float *got = calloc(c.vocab_size, sizeof(float));
	double *want = calloc(c.vocab_size, sizeof(double));
	ck_assert(got && want);
	run_prompt(m, default_params(), tok, n, 0, SPANS_IN_ORDER, got);
	static const enum ref_bug bugs[] = {BUG_ROPE_INTERLEAVED, BUG_GQA_MODULO, BUG_NO_CAUSAL_MASK};
	static const char *const names[] = {"interleaved rope", "gqa h % n_kv", "no causal mask"};
	for (uint32_t b = 0; b < 3; b++) {
		ref_forward(m, tok, n, bugs[b], want);
		double err = rel_l2_fd(got, want, c.vocab_size);
		report(names[b], err);
		ck_assert_msg(err > 100 * TOL, "%s: error %.3e is not far above the tolerance", names[b], err);
	}
	free(got);
	free(want);
	model_free(&m);
}
END_TEST

/* ---- chunking, decode and span order ---------------------------------------------------- */

START_TEST(test_chunks_and_decode_match)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_BF16, 77);
	uint32_t n = 45;
	int32_t tok[MAX_PROMPT];
	make_prompt(tok, n, c.vocab_size, 5);
	float *one = calloc(c.vocab_size, sizeof(float)), *other = calloc(c.vocab_size, sizeof(float));
	double *want = calloc(c.vocab_size, sizeof(double));
	ck_assert(one && other && want);
	run_prompt(m, default_params(), tok, n, 0, SPANS_IN_ORDER, one);
	ref_forward(m, tok, n, BUG_NONE, want);
	double err = rel_l2_fd(one, want, c.vocab_size);
	report("45 tokens, one chunk", err);
	ck_assert_msg(err < TOL, "one chunk against the reference: %.3e", err);

	static const uint32_t chunks[] = {10, 16, 7, 1};
	for (uint32_t i = 0; i < sizeof(chunks) / sizeof(chunks[0]); i++) {
		run_prompt(m, default_params(), tok, n, chunks[i], SPANS_IN_ORDER, other);
		double e = rel_l2_ff(other, one, c.vocab_size);
		char what[64];
		snprintf(what, sizeof(what), "chunks of %u vs one chunk", chunks[i]);
		report(what, e);
		ck_assert_msg(e < TOL, "%s: %.3e", what, e);
	}
	/* Decode with a backend whose chunks hold one token at most. */
	struct backend_params p = default_params();
	p.max_chunk = 1;
	run_prompt(m, p, tok, n, 1, SPANS_IN_ORDER, other);
	double e = rel_l2_ff(other, one, c.vocab_size);
	report("decode (max_chunk 1) vs one chunk", e);
	ck_assert_msg(e < TOL, "token by token: %.3e", e);
	free(one);
	free(other);
	free(want);
	model_free(&m);
}
END_TEST

START_TEST(test_span_order)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_F32, 31);
	uint32_t n = 50;
	int32_t tok[MAX_PROMPT];
	make_prompt(tok, n, c.vocab_size, 6);
	float *a = calloc(c.vocab_size, sizeof(float)), *b = calloc(c.vocab_size, sizeof(float));
	ck_assert(a && b);
	struct backend_params p = default_params();
	p.block_tokens = 8; /* 7 blocks per layer */
	for (uint32_t chunk = 0; chunk <= 9; chunk += 9) {
		run_prompt(m, p, tok, n, chunk, SPANS_IN_ORDER, a);
		run_prompt(m, p, tok, n, chunk, SPANS_REVERSE, b);
		double e1 = rel_l2_ff(b, a, c.vocab_size);
		report("spans reversed vs in order", e1);
		ck_assert_msg(e1 < TOL, "reverse order: %.3e", e1);
		run_prompt(m, p, tok, n, chunk, SPANS_PIECES, b);
		double e2 = rel_l2_ff(b, a, c.vocab_size);
		report("spans in two pieces vs in order", e2);
		ck_assert_msg(e2 < TOL, "pieces: %.3e", e2);
	}
	free(a);
	free(b);
	model_free(&m);
}
END_TEST

/* ---- threads ---------------------------------------------------------------------------- */

START_TEST(test_threads_bit_identical)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_BF16, 8);
	uint32_t n = 40;
	int32_t tok[MAX_PROMPT];
	make_prompt(tok, n, c.vocab_size, 9);
	float *l1 = calloc(c.vocab_size, sizeof(float)), *l3 = calloc(c.vocab_size, sizeof(float));
	ck_assert(l1 && l3);
	struct runner r1, r3;
	struct backend_params p = default_params();
	runner_open(&r1, m, p);
	p.threads = 3;
	runner_open(&r3, m, p);
	/* A prefill chunk, then decode steps. */
	runner_step(&r1, m, tok, 30, 0, SPANS_IN_ORDER, l1);
	runner_step(&r3, m, tok, 30, 0, SPANS_IN_ORDER, l3);
	ck_assert_int_eq(memcmp(l1, l3, c.vocab_size * sizeof(float)), 0);
	for (uint32_t pos = 30; pos < n; pos++) {
		runner_step(&r1, m, tok + pos, 1, pos, SPANS_IN_ORDER, l1);
		runner_step(&r3, m, tok + pos, 1, pos, SPANS_IN_ORDER, l3);
		ck_assert_msg(!memcmp(l1, l3, c.vocab_size * sizeof(float)), "logits differ at position %u", pos);
	}
	size_t bytes = backend_kv_block_bytes("cpu", &c, &r1.p);
	char *b1 = malloc(bytes), *b3 = malloc(bytes);
	ck_assert(b1 && b3);
	uint32_t used = (n + r1.p.block_tokens - 1) / r1.p.block_tokens;
	for (uint32_t l = 0; l < c.n_layers; l++) {
		for (uint32_t b = 0; b < used; b++) {
			CHECK_RC(&r1, kv_out(r1.be, l * r1.bpl + b, b1));
			CHECK_RC(&r3, kv_out(r3.be, l * r3.bpl + b, b3));
			/* A partly filled last block holds unwritten rows: compare the written ones. */
			uint32_t rows = n - b * r1.p.block_tokens < r1.p.block_tokens ? n - b * r1.p.block_tokens
										       : r1.p.block_tokens;
			size_t row_bytes = (size_t)c.n_kv_heads * c.head_dim * sizeof(float);
			ck_assert_int_eq(memcmp(b1, b3, rows * row_bytes), 0);		    /* K */
			ck_assert_int_eq(memcmp(b1 + bytes / 2, b3 + bytes / 2, rows * row_bytes), 0); /* V */
		}
	}
	free(b1);
	free(b3);
	runner_close(&r1);
	runner_close(&r3);
	free(l1);
	free(l3);
	model_free(&m);
}
END_TEST

/* ---- the KV arena ----------------------------------------------------------------------- */

START_TEST(test_kv_block_bytes)
{
	struct model_config c = base_cfg();
	struct backend_params p = default_params();
	ck_assert_uint_eq(backend_kv_block_bytes("cpu", &c, &p), 2u * 16 * 2 * 16 * 4);
}
END_TEST

/* Prefill on one backend, move every block through host memory into a fresh backend, decode
 * the next token on both: the KV restore path of the kv-store. */
START_TEST(test_kv_host_roundtrip)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_F32, 21);
	uint32_t n = 38;
	int32_t tok[MAX_PROMPT];
	make_prompt(tok, n, c.vocab_size, 22);
	float *la = calloc(c.vocab_size, sizeof(float)), *lb = calloc(c.vocab_size, sizeof(float));
	double *want = calloc(c.vocab_size, sizeof(double));
	ck_assert(la && lb && want);
	struct runner a, b;
	runner_open(&a, m, default_params());
	runner_open(&b, m, default_params());
	runner_step(&a, m, tok, n - 1, 0, SPANS_IN_ORDER, la);
	size_t bytes = backend_kv_block_bytes("cpu", &c, &a.p);
	char *buf = malloc(bytes);
	ck_assert_ptr_nonnull(buf);
	for (uint32_t blk = 0; blk < a.p.n_kv_blocks; blk++) {
		CHECK_RC(&a, kv_out(a.be, blk, buf));
		CHECK_RC(&b, kv_in(b.be, blk, buf));
	}
	runner_step(&a, m, tok + n - 1, 1, n - 1, SPANS_IN_ORDER, la);
	runner_step(&b, m, tok + n - 1, 1, n - 1, SPANS_IN_ORDER, lb);
	ck_assert_int_eq(memcmp(la, lb, c.vocab_size * sizeof(float)), 0);
	ref_forward(m, tok, n, BUG_NONE, want);
	double err = rel_l2_fd(lb, want, c.vocab_size);
	report("restored KV, decode", err);
	ck_assert_msg(err < TOL, "decode after restore: %.3e", err);
	ck_assert_int_eq(kv_out(a.be, a.p.n_kv_blocks, buf), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(a.be), "outside the arena"));
	ck_assert_int_eq(kv_in(b.be, b.p.n_kv_blocks, buf), -EINVAL);
	free(buf);
	runner_close(&a);
	runner_close(&b);
	free(la);
	free(lb);
	free(want);
	model_free(&m);
}
END_TEST

/* ---- errors ----------------------------------------------------------------------------- */

START_TEST(test_bad_token_rejected)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_F32, 3);
	struct runner r;
	runner_open(&r, m, default_params());
	int32_t bad[] = {1, 2, 512};
	ck_assert_int_eq(embed(r.be, &m->embed_w, bad, 3, 0), -EINVAL);
	const char *msg = backend_error(r.be);
	ck_assert_msg(strstr(msg, "token id 512") && strstr(msg, "vocabulary"), "message: %s", msg);
	int32_t neg[] = {-1};
	ck_assert_int_eq(embed(r.be, &m->embed_w, neg, 1, 0), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(r.be), "token id -1"));
	int32_t ok[] = {1};
	ck_assert_int_eq(embed(r.be, &m->embed_w, ok, 0, 0), -EINVAL);		      /* empty chunk */
	ck_assert_int_eq(embed(r.be, &m->embed_w, ok, MAX_PROMPT + 1, 0), -EINVAL); /* > max_chunk */
	runner_close(&r);
	model_free(&m);
}
END_TEST

START_TEST(test_kv_dtype_bf16_rejected)
{
	struct model_config c = base_cfg();
	struct backend_params p = default_params();
	p.n_kv_blocks = 8;
	p.kv_dtype = DT_BF16;
	struct backend *be = (struct backend *)(uintptr_t)1; /* create must set NULL on failure */
	char err[256] = "";
	int rc = backend_create("cpu", &c, &p, &be, err, sizeof(err));
	ck_assert_int_eq(rc, -ENOTSUP);
	ck_assert_ptr_null(be);
	ck_assert_msg(strstr(err, "kv_dtype BF16") != NULL, "message: %s", err);
}
END_TEST

START_TEST(test_bad_config_rejected)
{
	struct backend_params p = default_params();
	p.n_kv_blocks = 8;
	struct backend *be = NULL;
	char err[256] = "";
	struct model_config c = base_cfg();
	c.n_kv_heads = 3;
	ck_assert_int_eq(backend_create("cpu", &c, &p, &be, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "not a multiple of 3 kv heads") != NULL, "message: %s", err);
	c = base_cfg();
	c.rope_scaling = ROPE_SCALING_LLAMA3;
	c.rope_factor = 8;
	c.rope_low_freq_factor = 4;
	c.rope_high_freq_factor = 1;
	c.rope_original_max_position = 8192;
	ck_assert_int_eq(backend_create("cpu", &c, &p, &be, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "llama3 rope_scaling") != NULL, "message: %s", err);
	c = base_cfg();
	p.block_tokens = 0;
	ck_assert_int_eq(backend_create("cpu", &c, &p, &be, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_null(be);
}
END_TEST

START_TEST(test_bad_calls_rejected)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_F32, 4);
	struct runner r;
	runner_open(&r, m, default_params());
	uint32_t blk = 0, row = 0;
	struct kv_span sp = {.block = 0, .pos0 = 0, .n_tokens = 1};
	/* Out of order. */
	ck_assert_int_eq(backend_attn_begin(r.be, &m->attn_w[0], 0, &blk, &row), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(r.be), "before embed"));
	ck_assert_int_eq(backend_attn_blocks(r.be, &sp, 1), -EINVAL);
	int32_t tok[] = {7};
	CHECK_RC(&r, embed(r.be, &m->embed_w, tok, 1, 0));
	/* A destination outside the arena. */
	blk = r.p.n_kv_blocks;
	ck_assert_int_eq(backend_attn_begin(r.be, &m->attn_w[0], 0, &blk, &row), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(r.be), "outside the arena"));
	blk = 0;
	row = r.p.block_tokens;
	ck_assert_int_eq(backend_attn_begin(r.be, &m->attn_w[0], 0, &blk, &row), -EINVAL);
	row = 0;
	/* A missing tensor. */
	struct group_weights w = m->attn_w[0];
	w.t[ROLE_WK].data[PLACE_HOST] = NULL;
	ck_assert_int_eq(backend_attn_begin(r.be, &w, 0, &blk, &row), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(r.be), "no wk tensor"));
	ck_assert_int_eq(backend_attn_begin(r.be, &m->attn_w[0], c.n_layers, &blk, &row), -EINVAL);
	CHECK_RC(&r, backend_attn_begin(r.be, &m->attn_w[0], 0, &blk, &row));
	/* Bad spans, then attn_end without the query's own block. */
	struct kv_span bad = {.block = r.p.n_kv_blocks, .pos0 = 0, .n_tokens = 1};
	ck_assert_int_eq(backend_attn_blocks(r.be, &bad, 1), -EINVAL);
	bad = (struct kv_span){.block = 0, .pos0 = 0, .n_tokens = r.p.block_tokens + 1};
	ck_assert_int_eq(backend_attn_blocks(r.be, &bad, 1), -EINVAL);
	ck_assert_int_eq(backend_ffn(r.be, &m->ffn_w[0]), -EINVAL);
	ck_assert_int_eq(backend_attn_end(r.be, &m->attn_w[0]), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(r.be), "saw no keys"));
	runner_close(&r);
	model_free(&m);
}
END_TEST

/* ---- several sequences in one step --------------------------------------------------------- */

/* One sequence of a batched step: tokens tok[0..n) at positions pos0.., its KV in arena region
 * `region` (regions of n_layers * bpl blocks, as runner_step lays one sequence out). */
#define S_MAX 8 /* sequences a batched step here takes */
struct bseq {
	const int32_t *tok;
	uint32_t n, pos0, region;
};

/* One step over the sequences' runs, as an engine batching them would: every product over all the
 * rows, each sequence's spans for its own rows, the head of each sequence's last row (logits:
 * n_seqs x vocab). */
static void batch_step(struct runner *r, const struct tmodel *m, const struct bseq *sq, uint32_t n_seqs,
		       float *logits)
{
	uint32_t bt = r->p.block_tokens, dst_block[MAX_PROMPT], dst_row[MAX_PROMPT], pos[MAX_PROMPT],
		 seq[MAX_PROMPT], last[S_MAX], n = 0;
	int32_t tok[MAX_PROMPT];
	for (uint32_t s = 0; s < n_seqs; s++)
		for (uint32_t i = 0; i < sq[s].n; i++, n++) {
			tok[n] = sq[s].tok[i];
			pos[n] = sq[s].pos0 + i;
			seq[n] = 100 + s;
		}
	struct backend_batch b = {.n = n, .tokens = tok, .pos = pos, .seq = seq};
	CHECK_RC(r, backend_embed(r->be, &m->embed_w, &b));
	for (uint32_t l = 0; l < m->cfg.n_layers; l++) {
		for (uint32_t s = 0, row = 0; s < n_seqs; row += sq[s++].n)
			for (uint32_t i = 0; i < sq[s].n; i++) {
				uint32_t region = sq[s].region * m->cfg.n_layers * r->bpl;
				dst_block[row + i] = region + l * r->bpl + (sq[s].pos0 + i) / bt;
				dst_row[row + i] = (sq[s].pos0 + i) % bt;
			}
		CHECK_RC(r, backend_attn_begin(r->be, &m->attn_w[l], l, dst_block, dst_row));
		/* Even layers: a call per sequence; odd ones: every sequence's spans in one call. */
		struct kv_span spans[S_MAX * MAX_PROMPT];
		uint32_t ns = 0;
		for (uint32_t s = 0, row = 0; s < n_seqs; row += sq[s++].n) {
			uint32_t end = sq[s].pos0 + sq[s].n;
			for (uint32_t k = 0; k * bt < end; k++)
				spans[ns++] = (struct kv_span){
				    .block = sq[s].region * m->cfg.n_layers * r->bpl + l * r->bpl + k, .pos0 = k * bt,
				    .n_tokens = end - k * bt < bt ? end - k * bt : bt, .row0 = row, .n_rows = sq[s].n};
			if (l % 2 == 0) {
				CHECK_RC(r, backend_attn_blocks(r->be, spans, ns));
				ns = 0;
			}
		}
		if (ns)
			CHECK_RC(r, backend_attn_blocks(r->be, spans, ns));
		CHECK_RC(r, backend_attn_end(r->be, &m->attn_w[l]));
		CHECK_RC(r, backend_ffn(r->be, &m->ffn_w[l]));
	}
	for (uint32_t s = 0, row = 0; s < n_seqs; s++) {
		row += sq[s].n;
		last[s] = row - 1;
	}
	CHECK_RC(r, backend_logits_rows(r->be, &m->head_w, last, n_seqs, logits));
}

/* Three sequences (prompts of 20, 33 and 7 tokens) computed together, in prefill chunks and then in
 * decode steps of one token each, give exactly the logits each gives alone: what else is in a step
 * changes nothing of a sequence's numbers. */
START_TEST(test_batched_sequences)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_BF16, 41);
	enum { S = 3, STEPS = 4 };
	static const uint32_t plen[S] = {20, 33, 7};
	int32_t tok[S][MAX_PROMPT];
	for (uint32_t s = 0; s < S; s++)
		make_prompt(tok[s], plen[s] + STEPS, c.vocab_size, 90 + s);
	struct backend_params p = default_params();
	struct runner r;
	r.bpl = (MAX_PROMPT + p.block_tokens - 1) / p.block_tokens;
	p.n_kv_blocks = S * c.n_layers * r.bpl;
	r.p = p;
	char err[256] = "";
	ck_assert_msg(backend_create("cpu", &c, &p, &r.be, err, sizeof(err)) == 0, "%s", err);
	ck_assert(backend_batches_sequences(r.be));
	float *got = calloc((size_t)S * c.vocab_size, sizeof(float)), *alone = calloc(c.vocab_size, sizeof(float));
	ck_assert(got && alone);
	/* Prefill: the first 16 tokens of each together, then the rest together. */
	struct bseq b[S];
	for (uint32_t s = 0; s < S; s++)
		b[s] = (struct bseq){.tok = tok[s], .n = plen[s] < 16 ? plen[s] : 16, .pos0 = 0, .region = s};
	batch_step(&r, m, b, S, got);
	struct bseq rest[S];
	uint32_t n_rest = 0;
	for (uint32_t s = 0; s < S; s++)
		if (plen[s] > 16)
			rest[n_rest++] = (struct bseq){.tok = tok[s] + 16, .n = plen[s] - 16, .pos0 = 16, .region = s};
	batch_step(&r, m, rest, n_rest, got);
	/* Decode: one token of each a step; sequence 1 sits the second step out. */
	for (uint32_t step = 0; step < STEPS; step++) {
		struct bseq d[S];
		uint32_t nd = 0, who[S];
		for (uint32_t s = 0; s < S; s++) {
			if (step == 1 && s == 1)
				continue;
			uint32_t at = plen[s] + step - (s == 1 && step > 1 ? 1 : 0);
			who[nd] = s;
			d[nd++] = (struct bseq){.tok = tok[s] + at, .n = 1, .pos0 = at, .region = s};
		}
		batch_step(&r, m, d, nd, got);
		for (uint32_t k = 0; k < nd; k++) {
			uint32_t s = who[k];
			run_prompt(m, default_params(), tok[s], d[k].pos0 + 1, 0, SPANS_IN_ORDER, alone);
			ck_assert_msg(memcmp(got + (size_t)k * c.vocab_size, alone, c.vocab_size * sizeof(float)) == 0,
				      "decode step %u: sequence %u batched differs from alone (rel L2 %.3e)", step, s,
				      rel_l2_ff(got + (size_t)k * c.vocab_size, alone, c.vocab_size));
		}
	}

	/* Refused: a sequence in two runs, spans for rows past the step, rows of the head out of order. */
	uint32_t pos[3] = {0, 0, 1}, seq[3] = {1, 2, 1};
	int32_t t3[3] = {1, 2, 3};
	struct backend_batch bad = {.n = 3, .tokens = t3, .pos = pos, .seq = seq};
	ck_assert_int_eq(backend_embed(r.be, &m->embed_w, &bad), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(r.be), "one run"));
	seq[2] = 2;
	pos[2] = 5;
	ck_assert_int_eq(backend_embed(r.be, &m->embed_w, &bad), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(r.be), "consecutive positions"));
	pos[2] = 1;
	CHECK_RC(&r, backend_embed(r.be, &m->embed_w, &bad));
	uint32_t blk[3] = {0, 1, 1}, row[3] = {0, 0, 1};
	CHECK_RC(&r, backend_attn_begin(r.be, &m->attn_w[0], 0, blk, row));
	struct kv_span sp = {.block = 1, .pos0 = 0, .n_tokens = 2, .row0 = 1, .n_rows = 3};
	ck_assert_int_eq(backend_attn_blocks(r.be, &sp, 1), -EINVAL);
	sp = (struct kv_span){.block = 1, .pos0 = 0, .n_tokens = 2}; /* every row: two sequences' */
	ck_assert_int_eq(backend_attn_blocks(r.be, &sp, 1), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(r.be), "those of one sequence"));
	sp = (struct kv_span){.block = 1, .pos0 = 0, .n_tokens = 2, .row0 = 0, .n_rows = 2}; /* across them */
	ck_assert_int_eq(backend_attn_blocks(r.be, &sp, 1), -EINVAL);
	struct kv_span ok[2] = {{.block = 0, .pos0 = 0, .n_tokens = 1, .row0 = 0, .n_rows = 1},
				{.block = 1, .pos0 = 0, .n_tokens = 2, .row0 = 1, .n_rows = 2}};
	CHECK_RC(&r, backend_attn_blocks(r.be, ok, 2));
	CHECK_RC(&r, backend_attn_end(r.be, &m->attn_w[0]));
	uint32_t rows[2] = {2, 0};
	ck_assert_int_eq(backend_logits_rows(r.be, &m->head_w, rows, 2, got), -EINVAL);
	free(got);
	free(alone);
	runner_close(&r);
	model_free(&m);
}
END_TEST

START_TEST(test_registry)
{
	ck_assert(backend_known("cpu"));
	ck_assert(!backend_known("tpu"));
	ck_assert(!backend_known(""));
	ck_assert(!backend_known(NULL));
#ifndef PIPELINE_HAVE_CUDA
	ck_assert(!backend_known("cuda"));
#endif
	ck_assert(backend_known(backend_default_name()));
	struct model_config c = base_cfg();
	struct backend_params p = default_params();
	p.n_kv_blocks = 8;
	struct backend *be = NULL;
	char err[256] = "";
	ck_assert_int_eq(backend_create("tpu", &c, &p, &be, err, sizeof(err)), -ENOENT);
	ck_assert_ptr_null(be);
	ck_assert_msg(strstr(err, "'tpu'") != NULL, "message: %s", err);
	ck_assert_int_eq(backend_create("cpu", &c, &p, &be, err, sizeof(err)), 0);
	ck_assert_str_eq(backend_name(be), "cpu");
	ck_assert_int_eq(backend_weight_place(be), PLACE_HOST);
	ck_assert_ptr_null(backend_cuda_stream(be));
	ck_assert(!backend_samples_on_device(be));
	backend_destroy(&be);
}
END_TEST

static Suite *kernels_suite(void)
{
	Suite *s = suite_create("backend_ref");
	TCase *tc = tcase_create("forward");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_gqa_f32);
	tcase_add_test(tc, test_mha);
	tcase_add_test(tc, test_head_dim_not_dim_over_heads);
	tcase_add_test(tc, test_tied_embeddings);
	tcase_add_test(tc, test_rope_llama3);
	tcase_add_test(tc, test_rope_linear);
	tcase_add_test(tc, test_rope_theta_llama3_real);
	tcase_add_test(tc, test_bf16);
	tcase_add_test(tc, test_f16);
	tcase_add_test(tc, test_sliding_window);
	tcase_add_test(tc, test_reference_detects_bugs);
	tcase_add_test(tc, test_rope_adjacent);
	tcase_add_test(tc, test_block_formats);
	tcase_add_test(tc, test_rope_adjacent_permuted_rows_same_function);
	suite_add_tcase(s, tc);

	tc = tcase_create("chunking");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_chunks_and_decode_match);
	tcase_add_test(tc, test_span_order);
	suite_add_tcase(s, tc);

	tc = tcase_create("threads");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_threads_bit_identical);
	suite_add_tcase(s, tc);

	tc = tcase_create("kv_arena");
	tcase_add_test(tc, test_kv_block_bytes);
	tcase_add_test(tc, test_kv_host_roundtrip);
	suite_add_tcase(s, tc);

	tc = tcase_create("errors");
	tcase_add_test(tc, test_bad_token_rejected);
	tcase_add_test(tc, test_kv_dtype_bf16_rejected);
	tcase_add_test(tc, test_bad_config_rejected);
	tcase_add_test(tc, test_bad_calls_rejected);
	suite_add_tcase(s, tc);

	tc = tcase_create("batch");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_batched_sequences);
	suite_add_tcase(s, tc);

	tc = tcase_create("registry");
	tcase_add_test(tc, test_registry);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(kernels_suite());
	srunner_set_fork_status(sr, CK_FORK);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

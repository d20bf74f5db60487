/* test_moe_ref.c - Qwen3's q/k norms and the mixture-of-experts layers on the C reference backend.
 *
 *  - cpu_moe_route against routings worked out by hand (softmax, top-k, ties, renormalising).
 *  - A dense checkpoint (the tiny Llama shape, F32) against the same weights presented as a
 *    mixture of experts by a weight source of the test's own: each layer's FFN becomes the router
 *    group (its norm and a router matrix) and E experts that are all that FFN. With one expert, and
 *    with two of four experts chosen by a router of zeros (weights 1/2, exact), the logits are
 *    bit-identical to the dense model's: the routing, gather, weighted sum and residual add lose
 *    nothing. With a random router the chosen weights sum to 1 within float32 rounding, so the
 *    logits agree within 1e-5; without renormalising (Qwen3-MoE's norm_topk_prob false) they do not.
 *  - The synthetic qwen3-tiny, mixtral-tiny and qwen3-moe-tiny checkpoints: a prompt in one chunk
 *    and the same prompt a token at a time give the same last logits (within 1e-5), finite.
 *  - The q/k norms: RMSNorm makes a head's query and key independent of their scale, so scaling
 *    every q_proj and k_proj row by 8 leaves Qwen3's logits as they were (within 1e-4), while the
 *    same scaling changes a Llama model's.
 *  - The front's refusals: ffn on a mixture-of-experts model, experts out of order, moe calls on a
 *    dense model. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/manifest.h"
#include "common/util.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/weights.h"
#include "services/gpu-runner/cpu/kernels.h"
#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/kv_cache.h"
#include "tests/unit/common/test_helpers.h"
#include "tests/unit/gpu-runner/runner_test_util.h"
#include "tools/make-synthetic-model/synthetic.h"
#include "tools/run-local/memory_source.h"

#define PROMPT 12
#define CHUNK 16

START_TEST(test_route)
{
	uint32_t ids[4];
	float w[4];
	const float l[4] = {1.0f, 3.0f, 2.0f, 0.0f};
	double z = exp(1.0) + exp(3.0) + exp(2.0) + exp(0.0);
	cpu_moe_route(l, 4, 2, false, ids, w);
	ck_assert_uint_eq(ids[0], 1);
	ck_assert_uint_eq(ids[1], 2);
	ck_assert_double_eq_tol(w[0], exp(3.0) / z, 1e-7);
	ck_assert_double_eq_tol(w[1], exp(2.0) / z, 1e-7);
	cpu_moe_route(l, 4, 2, true, ids, w);
	ck_assert_double_eq_tol(w[0], exp(3.0) / (exp(3.0) + exp(2.0)), 1e-7);
	ck_assert_double_eq_tol(w[0] + w[1], 1.0, 1e-7);
	/* Ties: the lower id first. */
	const float t[5] = {0.5f, 2.0f, 0.5f, 2.0f, 2.0f};
	cpu_moe_route(t, 5, 3, true, ids, w);
	ck_assert_uint_eq(ids[0], 1);
	ck_assert_uint_eq(ids[1], 3);
	ck_assert_uint_eq(ids[2], 4);
	ck_assert_float_eq(w[0], w[2]);
	/* k == n: every expert, largest first; one expert: weight 1. */
	cpu_moe_route(l, 4, 4, false, ids, w);
	ck_assert_uint_eq(ids[0], 1);
	ck_assert_uint_eq(ids[3], 3);
	ck_assert_double_eq_tol(w[0] + w[1] + w[2] + w[3], 1.0, 1e-6);
	cpu_moe_route(l, 1, 1, true, ids, w);
	ck_assert_uint_eq(ids[0], 0);
	ck_assert_float_eq(w[0], 1.0f);
	/* A large spread: no overflow in the softmax. */
	const float big[3] = {1000.0f, -1000.0f, 999.0f};
	cpu_moe_route(big, 3, 2, false, ids, w);
	ck_assert_uint_eq(ids[0], 0);
	ck_assert_uint_eq(ids[1], 2);
	ck_assert(isfinite(w[0]) && isfinite(w[1]));
}
END_TEST

/* ---- a dense checkpoint presented as a mixture of experts -------------------------------- */

struct moe_view {
	struct weight_source base;
	struct weight_source *inner; /* the dense checkpoint */
	struct model_config cfg;     /* the dense config with experts */
	struct group_desc *groups;
	float *router;		     /* (n_experts, dim) F32 */
};

/* The dense group behind group g of the view. */
static uint32_t dense_group(const struct moe_view *v, uint32_t g)
{
	const struct group_desc *d = &v->groups[g];
	const struct model_config *dc = v->inner->cfg;
	switch (d->kind) {
	case GROUP_EMBED:
		return group_id_embed();
	case GROUP_HEAD:
		return group_id_head(dc);
	case GROUP_ATTN:
		return group_id_attn(d->layer);
	default:
		return group_id_ffn(d->layer);
	}
}

static int mv_acquire(struct weight_source *ws, uint32_t g, struct group_weights *w)
{
	struct moe_view *v = (struct moe_view *)ws;
	struct group_weights dw;
	int rc = v->inner->ops->acquire(v->inner, dense_group(v, g), &dw);
	if (rc)
		return rc;
	const struct group_desc *d = &v->groups[g];
	if (d->kind != GROUP_MOE && d->kind != GROUP_EXPERT) {
		*w = dw;
		return 0;
	}
	memset(w, 0, sizeof(*w));
	if (d->kind == GROUP_MOE) {
		w->t[ROLE_FFN_NORM] = dw.t[ROLE_FFN_NORM];
		weight_tensor_set(&w->t[ROLE_ROUTER], PLACE_HOST, v->router, DT_F32, v->cfg.n_experts, v->cfg.dim);
	} else {
		w->t[ROLE_EXPERT_GATE] = dw.t[ROLE_W_GATE];
		w->t[ROLE_EXPERT_UP] = dw.t[ROLE_W_UP];
		w->t[ROLE_EXPERT_DOWN] = dw.t[ROLE_W_DOWN];
	}
	return 0;
}

static int mv_release(struct weight_source *ws, uint32_t g)
{
	struct moe_view *v = (struct moe_view *)ws;
	return v->inner->ops->release(v->inner, dense_group(v, g));
}

static int mv_release_all(struct weight_source *ws)
{
	struct moe_view *v = (struct moe_view *)ws;
	return v->inner->ops->release_all(v->inner);
}

static const struct weight_source_ops mv_ops = {.acquire = mv_acquire, .release = mv_release,
						.release_all = mv_release_all};

/* The view of the dense source with E experts, k chosen, the router all `router` (NAN: random). */
static void view_open(struct moe_view *v, struct weight_source *inner, uint32_t E, uint32_t k, bool norm,
		      float router)
{
	memset(v, 0, sizeof(*v));
	v->inner = inner;
	v->cfg = *inner->cfg;
	v->cfg.arch = ARCH_MIXTRAL;
	v->cfg.n_experts = E;
	v->cfg.n_experts_used = k;
	v->cfg.expert_ffn_dim = v->cfg.ffn_dim;
	v->cfg.flags = norm ? MODEL_NORM_TOPK : 0;
	char err[256];
	ck_assert_msg(model_config_check(&v->cfg, err, sizeof(err)) == 0, "%s", err);
	uint32_t ng = model_n_groups(&v->cfg);
	v->groups = calloc(ng, sizeof(*v->groups));
	v->router = malloc((size_t)E * v->cfg.dim * sizeof(float));
	ck_assert(v->groups && v->router);
	for (size_t i = 0; i < (size_t)E * v->cfg.dim; i++)
		v->router[i] = isnan(router) ? (float)(0.5 * rng_normal()) : router;
	v->groups[0].kind = GROUP_EMBED;
	v->groups[ng - 1].kind = GROUP_HEAD;
	for (uint32_t l = 0; l < v->cfg.n_layers; l++) {
		v->groups[model_group_attn(&v->cfg, l)] = (struct group_desc){.kind = GROUP_ATTN, .layer = l};
		v->groups[model_group_ffn(&v->cfg, l)] = (struct group_desc){.kind = GROUP_MOE, .layer = l};
		for (uint32_t e = 0; e < E; e++)
			v->groups[model_group_expert(&v->cfg, l, e)] =
				(struct group_desc){.kind = GROUP_EXPERT, .layer = l, .expert = e};
	}
	ck_assert_msg(model_groups_check(&v->cfg, v->groups, ng, err, sizeof(err)) == 0, "%s", err);
	v->base = *inner;
	v->base.ops = &mv_ops;
	v->base.cfg = &v->cfg;
	v->base.groups = v->groups;
	v->base.n_groups = ng;
}

static void view_close(struct moe_view *v)
{
	free(v->groups);
	free(v->router);
}

/* Runs tokens[0..n) through the engine in chunks of `chunk`; the last step's logits into out.
 * Returns 0 or the failing step's code with its message in err. */
static int run(const struct model_config *c, struct weight_source *ws, const int32_t *tokens, uint32_t n,
	       uint32_t chunk, float *out, char *err, size_t errlen)
{
	uint32_t bt = 8, ctx = n + 1;
	struct backend_params bp = {.max_chunk = CHUNK, .block_tokens = bt,
				    .n_kv_blocks = (ctx / bt + 2) * c->n_layers, .kv_dtype = DT_F32, .threads = 2};
	struct backend *be = NULL;
	struct kv_cache *kv = NULL;
	struct engine *e = NULL;
	int rc = backend_create("cpu", c, &bp, &be, err, errlen);
	ck_assert_msg(rc == 0, "%s", err);
	struct kv_cache_params kp = {.n_layers = c->n_layers, .block_tokens = bt, .max_context = ctx,
				     .max_chunk = CHUNK, .n_arena = bp.n_kv_blocks};
	ck_assert_msg(kv_cache_create(&kp, be, NULL, NULL, &kv, err, errlen) == 0, "%s", err);
	ck_assert_msg(engine_create(c, be, ws, kv, CHUNK, &e, err, errlen) == 0, "%s", err);
	for (uint32_t i = 0; i < n && rc == 0;) {
		uint32_t m = n - i < chunk ? n - i : chunk;
		rc = engine_forward(e, tokens + i, m, i, out);
		if (rc)
			snprintf(err, errlen, "%s", engine_error(e));
		i += m;
	}
	engine_destroy(&e);
	kv_cache_destroy(&kv);
	backend_destroy(&be);
	return rc;
}

struct model {
	char *dir;
	struct manifest *m;
	struct memory_source *ms;
};

static void model_open(struct model *md, const char *shape, enum dtype dt)
{
	char err[512] = "";
	md->dir = th_tmpdir("/tmp");
	struct model_config cfg;
	ck_assert_int_eq(synth_shape_config(shape, &cfg, err, sizeof(err)), 0);
	struct synth_options so;
	synth_options_default(&so);
	so.seed = 21;
	so.dtype = dt;
	ck_assert_msg(synth_write(md->dir, &cfg, &so, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(manifest_load(md->dir, &md->m, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(memory_source_create(md->m, &md->ms, err, sizeof(err)) == 0, "%s", err);
}

static void model_close(struct model *md)
{
	memory_source_destroy(&md->ms);
	manifest_destroy(&md->m);
	th_rmtree(md->dir);
	free(md->dir);
}

static void prompt(int32_t *tokens, uint32_t vocab)
{
	rng_state = 9;
	for (uint32_t i = 0; i < PROMPT; i++)
		tokens[i] = (int32_t)(rng_next() % vocab);
}

START_TEST(test_dense_as_experts)
{
	struct model md;
	model_open(&md, "tiny", DT_F32);
	const struct model_config *c = &md.m->cfg;
	int32_t tokens[PROMPT];
	prompt(tokens, c->vocab_size);
	char err[768];
	float *want = malloc(c->vocab_size * sizeof(float)), *got = malloc(c->vocab_size * sizeof(float));
	ck_assert(want && got);
	struct weight_source *dense = memory_source_base(md.ms);
	ck_assert_msg(run(c, dense, tokens, PROMPT, 5, want, err, sizeof(err)) == 0, "%s", err);

	static const struct {
		uint32_t E, k;
		bool norm;
		float router; /* NAN: random */
		double tol;   /* 0: bit-identical; < 0: must differ by more than -tol */
	} cases[] = {
		{1, 1, true, NAN, 0},	   /* one expert: weight 1 */
		{4, 2, true, 0.0f, 0},	   /* ties: experts 0 and 1, weights 1/2 */
		{4, 2, true, NAN, 1e-5},   /* random routing, renormalised */
		{4, 4, false, NAN, 1e-5},  /* every expert: the probabilities sum to 1 */
		{4, 2, false, NAN, -1e-3}, /* not renormalised: the FFN scaled by p_a + p_b < 1 */
	};
	for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
		struct moe_view v;
		rng_state = 100 + i;
		view_open(&v, dense, cases[i].E, cases[i].k, cases[i].norm, cases[i].router);
		ck_assert_msg(run(&v.cfg, &v.base, tokens, PROMPT, 5, got, err, sizeof(err)) == 0, "%s", err);
		double d = rel_l2(got, want, c->vocab_size);
		if (test_verbose())
			printf("E %u k %u norm %d: rel L2 %.3g\n", cases[i].E, cases[i].k, cases[i].norm, d);
		if (cases[i].tol == 0)
			ck_assert_msg(memcmp(got, want, c->vocab_size * sizeof(float)) == 0, "case %zu: rel L2 %g, not "
				      "bit-identical", i, d);
		else if (cases[i].tol > 0)
			ck_assert_msg(d <= cases[i].tol, "case %zu: rel L2 %g", i, d);
		else
			ck_assert_msg(d > -cases[i].tol, "case %zu: rel L2 %g: the weights were renormalised", i, d);
		view_close(&v);
	}
	free(want);
	free(got);
	model_close(&md);
}
END_TEST

START_TEST(test_chunking)
{
	static const char *const shapes[] = {"qwen3-tiny", "mixtral-tiny", "qwen3-moe-tiny"};
	for (size_t s = 0; s < ARRAY_SIZE(shapes); s++) {
		struct model md;
		model_open(&md, shapes[s], DT_BF16);
		const struct model_config *c = &md.m->cfg;
		int32_t tokens[PROMPT];
		prompt(tokens, c->vocab_size);
		char err[768];
		float *a = malloc(c->vocab_size * sizeof(float)), *b = malloc(c->vocab_size * sizeof(float));
		ck_assert(a && b);
		ck_assert_msg(run(c, memory_source_base(md.ms), tokens, PROMPT, CHUNK, a, err, sizeof(err)) == 0, "%s: %s",
			      shapes[s], err);
		ck_assert_msg(run(c, memory_source_base(md.ms), tokens, PROMPT, 1, b, err, sizeof(err)) == 0, "%s: %s",
			      shapes[s], err);
		double d = rel_l2(b, a, c->vocab_size);
		if (test_verbose())
			printf("%s: chunk of %u against one token a step: rel L2 %.3g\n", shapes[s], PROMPT, d);
		ck_assert_msg(d < 1e-5, "%s: rel L2 %g", shapes[s], d);
		free(a);
		free(b);
		model_close(&md);
	}
}
END_TEST

/* ---- q/k norms: scale invariance ----------------------------------------------------------- */

struct scaled {
	struct weight_source base;
	struct weight_source *inner;
	float *wq, *wk; /* (layers, rows, dim) F32 copies of q_proj and k_proj, scaled */
};

static int sc_acquire(struct weight_source *ws, uint32_t g, struct group_weights *w)
{
	struct scaled *s = (struct scaled *)ws;
	int rc = s->inner->ops->acquire(s->inner, g, w);
	if (rc || ws->groups[g].kind != GROUP_ATTN)
		return rc;
	const struct model_config *c = ws->cfg;
	uint32_t l = ws->groups[g].layer, q = c->n_heads * c->head_dim, kv = c->n_kv_heads * c->head_dim;
	weight_tensor_set(&w->t[ROLE_WQ], PLACE_HOST, s->wq + (size_t)l * q * c->dim, DT_F32, q, c->dim);
	weight_tensor_set(&w->t[ROLE_WK], PLACE_HOST, s->wk + (size_t)l * kv * c->dim, DT_F32, kv, c->dim);
	return 0;
}

static int sc_release(struct weight_source *ws, uint32_t g)
{
	struct scaled *s = (struct scaled *)ws;
	return s->inner->ops->release(s->inner, g);
}

static int sc_release_all(struct weight_source *ws)
{
	struct scaled *s = (struct scaled *)ws;
	return s->inner->ops->release_all(s->inner);
}

static const struct weight_source_ops sc_ops = {.acquire = sc_acquire, .release = sc_release,
						.release_all = sc_release_all};

/* Copies of every layer's q_proj and k_proj (F32 checkpoints), times `by`. */
static void scaled_open(struct scaled *s, struct weight_source *inner, float by)
{
	const struct model_config *c = inner->cfg;
	uint32_t q = c->n_heads * c->head_dim, kv = c->n_kv_heads * c->head_dim;
	s->base = *inner;
	s->base.ops = &sc_ops;
	s->inner = inner;
	s->wq = malloc((size_t)c->n_layers * q * c->dim * sizeof(float));
	s->wk = malloc((size_t)c->n_layers * kv * c->dim * sizeof(float));
	ck_assert(s->wq && s->wk);
	for (uint32_t l = 0; l < c->n_layers; l++) {
		struct group_weights w;
		uint32_t g = model_group_attn(c, l);
		ck_assert_int_eq(inner->ops->acquire(inner, g, &w), 0);
		ck_assert_uint_eq(w.t[ROLE_WQ].format, DT_F32);
		const float *wq = w.t[ROLE_WQ].data[PLACE_HOST], *wk = w.t[ROLE_WK].data[PLACE_HOST];
		for (size_t i = 0; i < (size_t)q * c->dim; i++)
			s->wq[(size_t)l * q * c->dim + i] = wq[i] * by;
		for (size_t i = 0; i < (size_t)kv * c->dim; i++)
			s->wk[(size_t)l * kv * c->dim + i] = wk[i] * by;
		ck_assert_int_eq(inner->ops->release(inner, g), 0);
	}
}

START_TEST(test_qk_norm)
{
	static const char *const shapes[] = {"qwen3-tiny", "tiny"};
	for (size_t i = 0; i < ARRAY_SIZE(shapes); i++) {
		struct model md;
		model_open(&md, shapes[i], DT_F32);
		const struct model_config *c = &md.m->cfg;
		int32_t tokens[PROMPT];
		prompt(tokens, c->vocab_size);
		char err[768];
		float *a = malloc(c->vocab_size * sizeof(float)), *b = malloc(c->vocab_size * sizeof(float));
		ck_assert(a && b);
		struct scaled s;
		scaled_open(&s, memory_source_base(md.ms), 8.0f);
		ck_assert_msg(run(c, memory_source_base(md.ms), tokens, PROMPT, 4, a, err, sizeof(err)) == 0, "%s", err);
		ck_assert_msg(run(c, &s.base, tokens, PROMPT, 4, b, err, sizeof(err)) == 0, "%s", err);
		double d = rel_l2(b, a, c->vocab_size);
		if (test_verbose())
			printf("%s: q_proj, k_proj x 8: rel L2 %.3g\n", shapes[i], d);
		if (c->flags & MODEL_QK_NORM)
			ck_assert_msg(d < 1e-4, "%s: rel L2 %g", shapes[i], d);
		else
			ck_assert_msg(d > 1e-3, "%s: rel L2 %g: the scaling changed nothing", shapes[i], d);
		free(s.wq);
		free(s.wk);
		free(a);
		free(b);
		model_close(&md);
	}
}
END_TEST

START_TEST(test_front)
{
	char err[512];
	struct model_config c;
	ck_assert_int_eq(synth_shape_config("mixtral-tiny", &c, err, sizeof(err)), 0);
	struct backend_params bp = {.max_chunk = 4, .block_tokens = 8, .n_kv_blocks = 4, .kv_dtype = DT_F32};
	struct backend *be = NULL;
	ck_assert_msg(backend_create("cpu", &c, &bp, &be, err, sizeof(err)) == 0, "%s", err);
	struct group_weights w;
	memset(&w, 0, sizeof(w));
	float *buf = calloc((size_t)c.vocab_size * c.dim, sizeof(float));
	ck_assert_ptr_nonnull(buf);
	weight_tensor_set(&w.t[ROLE_EMBED], PLACE_HOST, buf, DT_F32, c.vocab_size, c.dim);
	int32_t tok = 3;
	uint32_t pos = 0, seq = 0;
	struct backend_batch b = {.n = 1, .tokens = &tok, .pos = &pos, .seq = &seq};
	ck_assert_int_eq(backend_moe_route(be, &w), -EINVAL); /* before embed */
	ck_assert_int_eq(backend_embed(be, &w, &b), 0);
	ck_assert_int_eq(backend_ffn(be, &w), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(be), "mixture-of-experts"));
	ck_assert_int_eq(backend_moe_expert(be, &w, 0), -EINVAL);
	ck_assert_int_eq(backend_moe_end(be), -EINVAL);
	/* The router group without its tensors. */
	ck_assert_int_eq(backend_moe_route(be, &w), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(be), "ffn_norm"));
	weight_tensor_set(&w.t[ROLE_FFN_NORM], PLACE_HOST, buf, DT_F32, 1, c.dim);
	ck_assert_int_eq(backend_moe_route(be, &w), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(be), "router"));
	weight_tensor_set(&w.t[ROLE_ROUTER], PLACE_HOST, buf, DT_F32, c.n_experts, c.dim);
	ck_assert_msg(backend_moe_route(be, &w) == 0, "%s", backend_error(be));
	weight_tensor_set(&w.t[ROLE_EXPERT_GATE], PLACE_HOST, buf, DT_F32, c.expert_ffn_dim, c.dim);
	weight_tensor_set(&w.t[ROLE_EXPERT_UP], PLACE_HOST, buf, DT_F32, c.expert_ffn_dim, c.dim);
	weight_tensor_set(&w.t[ROLE_EXPERT_DOWN], PLACE_HOST, buf, DT_F32, c.dim, c.expert_ffn_dim);
	ck_assert_int_eq(backend_moe_expert(be, &w, 2), 0);
	ck_assert_int_eq(backend_moe_expert(be, &w, 2), -EINVAL); /* twice */
	ck_assert_int_eq(backend_moe_expert(be, &w, 1), -EINVAL); /* backwards */
	ck_assert_int_eq(backend_moe_expert(be, &w, c.n_experts), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(be), "increasing order"));
	/* An expert split with the CPU pool (the GPU window's route): not this backend's, and the
	 * refusal takes nothing. */
	struct group_weights half = w;
	weights_split_expert(&half, c.expert_ffn_dim / 2, FFN_SPLIT_CPU);
	ck_assert_int_eq(backend_moe_expert(be, &half, 3), -ENOTSUP);
	ck_assert_ptr_nonnull(strstr(backend_error(be), "splits an expert only with the CPU pool"));
	/* Nor its CPU share handed over at the route: an expert already taken, or one below the GPU's
	 * last, is refused first; then this backend says it splits none. */
	ck_assert_int_eq(backend_moe_expert_cpu_share(be, &half.split, 2), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(be), "before the expert's own visit"));
	ck_assert_int_eq(backend_moe_expert_cpu_share(be, &half.split, 3), -ENOTSUP);
	ck_assert_ptr_nonnull(strstr(backend_error(be), "splits no experts with the CPU"));
	ck_assert_int_eq(backend_moe_expert(be, &w, 3), 0);
	ck_assert_int_eq(backend_moe_expert(be, &w, c.n_experts - 1), 0);
	/* An expert the GPU side took is not taken again on the CPU's, whose order is its own (the C
	 * backend computes none there: past the checks, it says so). */
	ck_assert_int_eq(backend_moe_expert_cpu(be, &w, 2), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(be), "each once"));
	ck_assert_int_eq(backend_moe_expert_cpu(be, &w, 1), -ENOTSUP);
	ck_assert_int_eq(backend_moe_end(be), 0);
	ck_assert_int_eq(backend_moe_expert_cpu_share(be, &half.split, c.n_experts - 1), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(be), "outside moe_route"));
	/* Routing on the device (backend_moe_layer): not this backend's, said at each call; a layer past
	 * the model's, or a step of more than one token, refused first. */
	uint32_t ids[8];
	ck_assert_int_eq(backend_moe_layer_experts(be, c.n_layers, NULL), -EINVAL);
	ck_assert_int_eq(backend_moe_layer_experts(be, 0, NULL), -ENOTSUP);
	ck_assert_ptr_nonnull(strstr(backend_error(be), "routes every layer on the host"));
	ck_assert_int_eq(backend_moe_layer(be, &w, c.n_layers), -EINVAL);
	ck_assert_int_eq(backend_moe_layer(be, &w, 0), -ENOTSUP);
	ck_assert_int_eq(backend_moe_layer_chosen(be, 0, ids), -ENODATA);
	int32_t toks[2] = {3, 4};
	uint32_t poss[2] = {1, 2}, seqs[2] = {0, 0};
	struct backend_batch b2 = {.n = 2, .tokens = toks, .pos = poss, .seq = seqs};
	ck_assert_int_eq(backend_embed(be, &w, &b2), 0);
	ck_assert_int_eq(backend_moe_layer(be, &w, 0), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(be), "one token"));
	backend_destroy(&be);

	/* A dense model takes no moe calls. */
	ck_assert_int_eq(synth_shape_config("tiny", &c, err, sizeof(err)), 0);
	ck_assert_msg(backend_create("cpu", &c, &bp, &be, err, sizeof(err)) == 0, "%s", err);
	weight_tensor_set(&w.t[ROLE_EMBED], PLACE_HOST, buf, DT_F32, c.vocab_size, c.dim);
	ck_assert_int_eq(backend_embed(be, &w, &b), 0);
	ck_assert_int_eq(backend_moe_route(be, &w), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(be), "dense"));
	ck_assert_int_eq(backend_moe_layer(be, &w, 0), -EINVAL);
	ck_assert_int_eq(backend_moe_layer_experts(be, 0, NULL), -EINVAL);
	backend_destroy(&be);
	free(buf);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("moe_ref");
	TCase *tc = tcase_create("moe");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_route);
	tcase_add_test(tc, test_dense_as_experts);
	tcase_add_test(tc, test_chunking);
	tcase_add_test(tc, test_qk_norm);
	tcase_add_test(tc, test_front);
	suite_add_tcase(s, tc);
	SRunner *sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? 1 : 0;
}

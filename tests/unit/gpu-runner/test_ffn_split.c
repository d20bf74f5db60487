/* test_ffn_split.c - an FFN computed in two shares along the intermediate dimension (backend.h,
 * struct ffn_split) on the C reference backend, against the whole FFN.
 *
 * Synthetic checkpoints (tiny in F32 and BF16, GGUF Q8_0 of tiny, and GGUF Q4_K_M of a shape with
 * 256-wide rows, whose gate and down differ in format) run a fixed token sequence through the
 * engine: a prompt in chunks, then single-token steps, the logits of every step kept. Then the same
 * sequence with the FFN of every layer split at several rows r, including r = 0 (all of it on the
 * CPU) and the last unit below ffn_dim:
 *  - the second share on the CPU task pool (FFN_SPLIT_CPU, engine_set_ffn_split, decode steps
 *    only; and every step, prefill chunks included): its products are cpu-compute's, float32 sums
 *    with x as the format takes it (F32: float32; BF16: rounded to bf16; block formats: int8 per
 *    32), so the logits agree within 1e-4 for F32 weights and 2e-2 (the bound of BF16 activations
 *    elsewhere) for the others;
 *  - the second share by the backend itself (FFN_SPLIT_BACKEND, through a weight source that
 *    splits what it hands over): the same products in another order of additions, within 1e-5.
 * Then the front's refusals, and a share job whose parts fail with their message (a failing share
 * through a whole request is test_generate's).
 * PIPELINE_TEST_VERBOSE=1 prints each error measured. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/manifest.h"
#include "common/util.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/cpu-compute/cpu_compute.h"
#include "services/gpu-runner/cpu-compute/ffn_share.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/kv_cache.h"
#include "tests/unit/common/test_helpers.h"
#include "tests/unit/gpu-runner/runner_test_util.h"
#include "tools/make-synthetic-model/synthetic.h"
#include "tools/run-local/memory_source.h"

#define PROMPT 20
#define CHUNK 8
#define DECODE 5
#define STEPS (3 + DECODE) /* chunks of 8, 8, 4, then one token at a time */
#define TOL_F32 1e-4
#define TOL_16 2e-2
#define TOL_SAME 1e-5

enum model_kind { M_F32, M_BF16, M_Q8_0, M_Q4_K_M, M_COUNT };
static const char *const kind_name[M_COUNT] = {"f32", "bf16", "gguf q8_0", "gguf q4_k_m"};

struct fixture {
	char *dir;
	struct manifest *m;
	struct memory_source *ms;
	struct task_pool *pool;
	int32_t tokens[PROMPT + DECODE];
	float *want; /* (STEPS, vocab) the whole FFN's logits */
	uint32_t unit; /* ffn_split_unit of down_proj's format */
};

static struct fixture fx;

static void open_model(enum model_kind kind)
{
	char err[512] = "";
	memset(&fx, 0, sizeof(fx));
	fx.dir = th_tmpdir("/tmp");
	struct model_config cfg;
	ck_assert_int_eq(synth_shape_config("tiny", &cfg, err, sizeof(err)), 0);
	struct synth_options so;
	synth_options_default(&so);
	so.seed = 11;
	so.dtype = kind == M_F32 ? DT_F32 : DT_BF16;
	if (kind == M_Q8_0 || kind == M_Q4_K_M) {
		so.format = SYNTH_GGUF;
		so.gguf_type = kind == M_Q8_0 ? SYNTH_GGUF_Q8_0 : SYNTH_GGUF_Q4_K_M;
		so.threads = 2;
	}
	if (kind == M_Q4_K_M) { /* rows of whole 256-value blocks: dim 256, ffn 768 */
		cfg.dim = 256;
		cfg.n_heads = 4;
		cfg.n_kv_heads = 2;
		cfg.head_dim = 64;
		cfg.ffn_dim = 768;
	}
	ck_assert_msg(synth_write(fx.dir, &cfg, &so, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(manifest_load(fx.dir, &fx.m, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(memory_source_create(fx.m, &fx.ms, err, sizeof(err)) == 0, "%s", err);
	fx.pool = pool_new(3); /* an odd count: the shares' rows do not divide evenly */
	rng_state = 5;
	for (uint32_t i = 0; i < PROMPT + DECODE; i++)
		fx.tokens[i] = (int32_t)(rng_next() % fx.m->cfg.vocab_size);
	int ti = model_find_tensor(&fx.m->cfg, fx.m->tensors, fx.m->groups, group_id_ffn(0), ROLE_W_DOWN);
	ck_assert_int_ge(ti, 0);
	fx.unit = ffn_split_unit((enum dtype)fx.m->tensors[ti].dtype);
	ck_assert_uint_eq(fx.m->cfg.ffn_dim % fx.unit, 0);
}

static void close_model(void)
{
	task_pool_destroy(&fx.pool);
	memory_source_destroy(&fx.ms);
	manifest_destroy(&fx.m);
	th_rmtree(fx.dir);
	free(fx.dir);
	free(fx.want);
}

/* ---- a weight source that splits every FFN it hands over ---------------------------------- */

struct split_source {
	struct weight_source base;
	struct weight_source *inner;
	uint32_t r, where, max_tokens;
};

static int ss_acquire(struct weight_source *ws, uint32_t g, struct group_weights *w)
{
	struct split_source *s = (struct split_source *)ws;
	int rc = s->inner->ops->acquire(s->inner, g, w);
	if (rc == 0 && ws->groups[g].kind == GROUP_FFN && ws->step_tokens <= s->max_tokens)
		weights_split_ffn(w, s->r, (enum ffn_split_where)s->where);
	return rc;
}

static int ss_release(struct weight_source *ws, uint32_t g)
{
	struct split_source *s = (struct split_source *)ws;
	return s->inner->ops->release(s->inner, g);
}

static int ss_release_all(struct weight_source *ws)
{
	struct split_source *s = (struct split_source *)ws;
	return s->inner->ops->release_all(s->inner);
}

static const struct weight_source_ops ss_ops = {.acquire = ss_acquire, .release = ss_release,
						.release_all = ss_release_all};

/* ---- running the sequence ------------------------------------------------------------------ */

struct how {
	uint32_t r;	     /* split at r (ffn_dim: not) */
	uint32_t where;	     /* enum ffn_split_where */
	uint32_t max_tokens; /* steps of at most this many tokens split */
	bool engine;	     /* split by engine_set_ffn_split (FFN_SPLIT_CPU), else by the split source */
	bool pool;	     /* give the backend the task pool */
};

/* Runs the sequence; the logits of step i go to out + i * vocab. Returns 0, or the first failing
 * step's code with its message in err. */
static int run(const struct how *h, float *out, char *err, size_t errlen)
{
	const struct model_config *c = &fx.m->cfg;
	uint32_t ctx = PROMPT + DECODE + 1, bt = 16, per_layer = ctx / bt + 2;
	struct backend_params bp = {.max_chunk = CHUNK, .block_tokens = bt, .n_kv_blocks = per_layer * c->n_layers,
				    .kv_dtype = DT_F32, .threads = 2, .cpu_pool = h->pool ? fx.pool : NULL};
	struct backend *be = NULL;
	struct kv_cache *kv = NULL;
	struct engine *e = NULL;
	struct split_source ss = {.base = *memory_source_base(fx.ms), .inner = memory_source_base(fx.ms), .r = h->r,
				  .where = h->where, .max_tokens = h->max_tokens};
	ss.base.ops = &ss_ops;
	struct weight_source *ws = h->engine || h->r >= c->ffn_dim ? memory_source_base(fx.ms) : &ss.base;
	int rc = backend_create("cpu", c, &bp, &be, err, errlen);
	ck_assert_msg(rc == 0, "%s", err);
	struct kv_cache_params kp = {.n_layers = c->n_layers, .block_tokens = bt, .max_context = ctx,
				     .max_chunk = CHUNK, .n_arena = bp.n_kv_blocks};
	ck_assert_msg(kv_cache_create(&kp, be, NULL, NULL, &kv, err, errlen) == 0, "%s", err);
	ck_assert_msg(engine_create(c, be, ws, kv, CHUNK, &e, err, errlen) == 0, "%s", err);
	if (h->engine && h->r < c->ffn_dim) {
		uint32_t *r = malloc(c->n_layers * sizeof(uint32_t));
		ck_assert_ptr_nonnull(r);
		for (uint32_t l = 0; l < c->n_layers; l++)
			r[l] = l == 0 ? h->r : c->ffn_dim - fx.unit; /* layers may differ */
		rc = engine_set_ffn_split(e, r, h->max_tokens, err, errlen);
		free(r);
		ck_assert_msg(rc == 0, "%s", err);
	}
	uint32_t step = 0;
	for (uint32_t i = 0; i < PROMPT + DECODE && rc == 0; step++) {
		uint32_t n = i < PROMPT ? (PROMPT - i < CHUNK ? PROMPT - i : CHUNK) : 1;
		rc = engine_forward(e, fx.tokens + i, n, i, out + (size_t)step * c->vocab_size);
		if (rc)
			snprintf(err, errlen, "%s", engine_error(e));
		i += n;
	}
	if (rc == 0)
		ck_assert_uint_eq(step, STEPS);
	engine_destroy(&e);
	kv_cache_destroy(&kv);
	backend_destroy(&be);
	return rc;
}

/* The worst relative L2 error of a run's steps against the whole FFN's. */
static double compare(const struct how *h, const char *what)
{
	uint32_t vocab = fx.m->cfg.vocab_size;
	char err[512] = "";
	if (!fx.want) {
		fx.want = malloc((size_t)STEPS * vocab * sizeof(float));
		ck_assert_ptr_nonnull(fx.want);
		struct how whole = {.r = fx.m->cfg.ffn_dim};
		ck_assert_msg(run(&whole, fx.want, err, sizeof(err)) == 0, "%s", err);
	}
	float *got = malloc((size_t)STEPS * vocab * sizeof(float));
	ck_assert_ptr_nonnull(got);
	ck_assert_msg(run(h, got, err, sizeof(err)) == 0, "%s: %s", what, err);
	double worst = 0;
	for (uint32_t s = 0; s < STEPS; s++) {
		double e = rel_l2(got + (size_t)s * vocab, fx.want + (size_t)s * vocab, vocab);
		worst = e > worst ? e : worst;
	}
	free(got);
	if (test_verbose())
		fprintf(stderr, "test_ffn_split: %-60s relative L2 error %.3e\n", what, worst);
	return worst;
}

/* The rows a model's FFN is split at: 0, one unit, about half, the last unit. */
static uint32_t split_rows(uint32_t *r)
{
	uint32_t ffn = fx.m->cfg.ffn_dim, u = fx.unit, n = 0;
	r[n++] = 0;
	r[n++] = u;
	if (ffn / 2 / u * u != u && ffn / 2 / u * u != 0)
		r[n++] = ffn / 2 / u * u;
	if (ffn - u != u)
		r[n++] = ffn - u;
	return n;
}

static void check_model(enum model_kind kind)
{
	open_model(kind);
	double tol = kind == M_F32 ? TOL_F32 : TOL_16;
	uint32_t r[4], nr = split_rows(r);
	char what[128];
	for (uint32_t i = 0; i < nr; i++) {
		struct how cpu_decode = {.r = r[i], .where = FFN_SPLIT_CPU, .max_tokens = 1, .engine = true, .pool = true};
		snprintf(what, sizeof(what), "%s, r %u of %u, CPU share in decode", kind_name[kind], r[i],
			 fx.m->cfg.ffn_dim);
		double e = compare(&cpu_decode, what);
		ck_assert_msg(e < tol, "%s: relative L2 error %.3e (bound %g)", what, e, tol);

		struct how cpu_all = {.r = r[i], .where = FFN_SPLIT_CPU, .max_tokens = CHUNK, .pool = true};
		snprintf(what, sizeof(what), "%s, r %u of %u, CPU share in every step", kind_name[kind], r[i],
			 fx.m->cfg.ffn_dim);
		e = compare(&cpu_all, what);
		ck_assert_msg(e < tol, "%s: relative L2 error %.3e (bound %g)", what, e, tol);

		struct how backend = {.r = r[i], .where = FFN_SPLIT_BACKEND, .max_tokens = CHUNK};
		snprintf(what, sizeof(what), "%s, r %u of %u, both shares on the backend", kind_name[kind], r[i],
			 fx.m->cfg.ffn_dim);
		e = compare(&backend, what);
		ck_assert_msg(e < TOL_SAME, "%s: relative L2 error %.3e (bound %g)", what, e, TOL_SAME);
	}
	close_model();
}

START_TEST(test_split_f32)
{
	check_model(M_F32);
}
END_TEST

START_TEST(test_split_bf16)
{
	check_model(M_BF16);
}
END_TEST

START_TEST(test_split_q8_0)
{
	check_model(M_Q8_0);
}
END_TEST

START_TEST(test_split_q4_k_m)
{
	check_model(M_Q4_K_M);
}
END_TEST

/* A share that is not the rest of the FFN, r off the unit, a CPU share without a pool or on a
 * step too long: each refused by the front with a message naming it. */
START_TEST(test_refusals)
{
	open_model(M_F32);
	const struct model_config *c = &fx.m->cfg;
	char err[512] = "";
	float *out = malloc((size_t)STEPS * c->vocab_size * sizeof(float));
	ck_assert_ptr_nonnull(out);

	struct how no_pool = {.r = fx.unit, .where = FFN_SPLIT_CPU, .max_tokens = 1};
	ck_assert_int_eq(run(&no_pool, out, err, sizeof(err)), -ENOTSUP);
	ck_assert_msg(strstr(err, "CPU pool"), "message: %s", err);

	struct how off_unit = {.r = fx.unit / 2, .where = FFN_SPLIT_BACKEND, .max_tokens = CHUNK};
	ck_assert_int_eq(run(&off_unit, out, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "multiple of"), "message: %s", err);

	struct how too_long = {.r = fx.unit, .where = FFN_SPLIT_CPU, .max_tokens = FFN_SPLIT_MAX_TOKENS + 1,
			       .pool = true};
	uint32_t *r = malloc(c->n_layers * sizeof(uint32_t));
	ck_assert_ptr_nonnull(r);
	for (uint32_t l = 0; l < c->n_layers; l++)
		r[l] = fx.unit;
	/* engine_set_ffn_split refuses what the front would. */
	struct backend_params bp = {.max_chunk = CHUNK, .block_tokens = 16, .n_kv_blocks = 64, .kv_dtype = DT_F32};
	struct backend *be = NULL;
	struct kv_cache *kv = NULL;
	struct engine *e = NULL;
	ck_assert_msg(backend_create("cpu", c, &bp, &be, err, sizeof(err)) == 0, "%s", err);
	struct kv_cache_params kp = {.n_layers = c->n_layers, .block_tokens = 16, .max_context = 64,
				     .max_chunk = CHUNK, .n_arena = 64};
	ck_assert_msg(kv_cache_create(&kp, be, NULL, NULL, &kv, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(engine_create(c, be, memory_source_base(fx.ms), kv, CHUNK, &e, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(engine_set_ffn_split(e, r, too_long.max_tokens, err, sizeof(err)), -EINVAL);
	r[1] = fx.unit + 1;
	ck_assert_int_eq(engine_set_ffn_split(e, r, 1, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "layer 1"), "message: %s", err);
	r[1] = c->ffn_dim; /* not split */
	ck_assert_int_eq(engine_set_ffn_split(e, r, 1, err, sizeof(err)), 0);
	ck_assert_int_eq(engine_set_ffn_split(e, NULL, 1, err, sizeof(err)), 0);
	engine_destroy(&e);
	kv_cache_destroy(&kv);
	backend_destroy(&be);

	/* A second share that is not the rest: rows from r + 1 (the source splits right, then this
	 * test moves it), through the backend directly. */
	struct group_weights w;
	ck_assert_int_eq(memory_source_base(fx.ms)->ops->acquire(memory_source_base(fx.ms), group_id_ffn(0), &w), 0);
	weights_split_ffn(&w, fx.unit, FFN_SPLIT_BACKEND);
	bp.cpu_pool = fx.pool;
	ck_assert_msg(backend_create("cpu", c, &bp, &be, err, sizeof(err)) == 0, "%s", err);
	struct group_weights ew;
	ck_assert_int_eq(memory_source_base(fx.ms)->ops->acquire(memory_source_base(fx.ms), group_id_embed(), &ew), 0);
	uint32_t pos[2] = {0, 1}, seq[2] = {0, 0};
	struct backend_batch b = {.n = 2, .tokens = fx.tokens, .pos = pos, .seq = seq};
	ck_assert_int_eq(backend_embed(be, &ew, &b), 0);
	struct group_weights bad = w;
	bad.split.gate.row0++;
	ck_assert_int_eq(backend_ffn(be, &bad), -EINVAL);
	ck_assert_msg(strstr(backend_error(be), "second share's"), "message: %s", backend_error(be));
	bad = w;
	bad.split.down.cols -= fx.unit;
	ck_assert_int_eq(backend_ffn(be, &bad), -EINVAL);
	bad = w;
	bad.t[ROLE_W_GATE].rows++;
	ck_assert_int_eq(backend_ffn(be, &bad), -EINVAL);
	ck_assert_msg(strstr(backend_error(be), "first share's"), "message: %s", backend_error(be));
	bad = w;
	bad.split.where = 7;
	ck_assert_int_eq(backend_ffn(be, &bad), -EINVAL);
	bad = w;
	bad.split.r = c->ffn_dim;
	ck_assert_int_eq(backend_ffn(be, &bad), -EINVAL);
	ck_assert_int_eq(backend_ffn(be, &w), 0); /* as the source made it */
	backend_destroy(&be);
	free(r);
	free(out);
	close_model();
}
END_TEST

/* A job whose parts fail: the first phase's failure is the job's error, and the second phase
 * does not wait for ever. */
START_TEST(test_share_job_failure)
{
	char err[256] = "";
	struct task_pool *pool = pool_new(2);
	struct ffn_share *fs = NULL;
	ck_assert_msg(ffn_share_create(64, 192, 4, 2, &fs, err, sizeof(err)) == 0, "%s", err);
	const uint32_t np = ffn_share_parts(fs), P = np / 2;
	ck_assert_uint_eq(np, 2 * 2 * FFN_SHARE_PARTS_PER_THREAD);
	static float w[192 * 64], x[64], y[64];
	struct ffn_share_mat m = {.data = w, .format = DT_F32, .row_bytes = 64 * sizeof(float)};
	struct ffn_share_mat down = {.data = w, .format = DT_F32, .row_bytes = 192 * sizeof(float)};
	struct ffn_share_job job;
	ffn_share_job_init(&job, &m, &m, &down, 192, 1, DT_Q8_0); /* activations cannot be Q8_0 */
	int rc = 0;
	for (uint32_t p = 0; p < np; p++) { /* in order, as the pool hands them out */
		int prc = ffn_share_part(fs, &job, x, y, p, np, err, sizeof(err));
		if (p < P)
			ck_assert_int_eq(prc, -EINVAL);
		rc = rc ? rc : prc;
	}
	ck_assert_int_eq(rc, -EINVAL);
	ck_assert_msg(strstr(err, "activations"), "message: %s", err);
	/* A job cut in other parts than ffn_share_parts says: refused by every part, none waits. */
	ffn_share_job_init(&job, &m, &m, &down, 192, 1, DT_F32);
	for (uint32_t p = 0; p < np + 2; p++)
		ck_assert_int_eq(ffn_share_part(fs, &job, x, y, p, np + 2, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "cut in"), "message: %s", err);
	ck_assert_int_eq(ffn_share_part(fs, &job, x, y, np, np, err, sizeof(err)), -EINVAL);
	/* A good job: y = down (silu(gate x) * up x) over 192 rows, against a direct computation. */
	rng_state = 3;
	for (uint32_t i = 0; i < 192 * 64; i++)
		w[i] = (float)(0.1 * rng_normal());
	for (uint32_t i = 0; i < 64; i++)
		x[i] = (float)rng_normal();
	ffn_share_job_init(&job, &m, &m, &down, 192, 1, DT_F32);
	for (uint32_t p = 0; p < np; p++)
		ck_assert_msg(ffn_share_part(fs, &job, x, y, p, np, err, sizeof(err)) == 0, "%s", err);
	for (uint32_t o = 0; o < 64; o++) {
		double acc = 0;
		for (uint32_t i = 0; i < 192; i++) {
			double g = 0;
			for (uint32_t k = 0; k < 64; k++)
				g += (double)w[i * 64 + k] * x[k];
			double h = g / (1 + exp(-g)) * g;
			acc += (double)w[o * 192 + i] * h;
		}
		ck_assert_msg(fabs(acc - y[o]) <= 1e-4 * (1 + fabs(acc)), "y[%u] = %g, want %g", o, (double)y[o], acc);
	}
	ffn_share_destroy(&fs);
	ffn_share_destroy(&fs);
	task_pool_destroy(&pool);
}
END_TEST

/* One job of several tokens against a job per token, bit for bit: a part goes through its rows in
 * blocks (ffn_share.c, BLOCK_BYTES), every token's product over a block before the next, and the
 * rows here are enough for several blocks a part in both phases; gate and up fused (both BF16) and
 * not (up in F32). The parts run in reverse order on one thread give the same bits (a part of the
 * second phase runs what is left of the first before it waits, where the old order waited for ever). */
START_TEST(test_share_tokens_in_blocks)
{
	enum { DIM = 1024, ROWS = 1024, T = 5 };
	/* Pass 1 with AMX's tiles where the CPU has them (cpu_matmul): the same promises hold. */
	const unsigned isa = cpu_compute_force_isa(_i ? CPU_ISA_ALL : CPU_ISA_ALL & ~(unsigned)CPU_ISA_AMX_BF16);
	const uint64_t tiled0 = cpu_matmul_tile_rows();
	char err[256] = "";
	struct ffn_share *fs = NULL;
	ck_assert_msg(ffn_share_create(DIM, ROWS, 8, 1, &fs, err, sizeof(err)) == 0, "%s", err);
	const uint32_t np = ffn_share_parts(fs);
	uint16_t *gate = malloc((size_t)ROWS * DIM * 2), *upb = malloc((size_t)ROWS * DIM * 2),
		 *down = malloc((size_t)DIM * ROWS * 2), *x = malloc((size_t)T * DIM * 2);
	float *upf = malloc((size_t)ROWS * DIM * 4), *y = malloc((size_t)T * DIM * 4), *y1 = malloc(DIM * 4);
	ck_assert(gate && upb && down && x && upf && y && y1);
	rng_state = 11;
	for (size_t i = 0; i < (size_t)ROWS * DIM; i++) {
		gate[i] = f32_to_bf16((float)(0.05 * rng_normal()));
		upf[i] = (float)(0.05 * rng_normal());
		upb[i] = f32_to_bf16(upf[i]);
		down[i] = f32_to_bf16((float)(0.05 * rng_normal()));
	}
	for (size_t i = 0; i < (size_t)T * DIM; i++)
		x[i] = f32_to_bf16((float)rng_normal());
	struct ffn_share_mat g = {.data = gate, .format = DT_BF16, .row_bytes = DIM * 2};
	struct ffn_share_mat d = {.data = down, .format = DT_BF16, .row_bytes = ROWS * 2};
	struct ffn_share_mat ups[2] = {{.data = upb, .format = DT_BF16, .row_bytes = DIM * 2},
				       {.data = upf, .format = DT_F32, .row_bytes = DIM * 4}};
	for (int k = 0; k < 2; k++) {
		struct ffn_share_job job;
		ffn_share_job_init(&job, &g, &ups[k], &d, ROWS, T, DT_BF16);
		for (uint32_t p = 0; p < np; p++) /* in order, as the pool hands them out */
			ck_assert_msg(ffn_share_part(fs, &job, x, y, p, np, err, sizeof(err)) == 0, "%s", err);
		/* The parts in reverse, on one thread: the first one run (of the second phase) claims and runs
		 * every chunk of the first phase, then of the second; the others find nothing left. The
		 * result does not depend on which part ran which chunk. */
		float *yr = malloc((size_t)T * DIM * 4);
		ck_assert_ptr_nonnull(yr);
		ffn_share_job_init(&job, &g, &ups[k], &d, ROWS, T, DT_BF16);
		for (uint32_t p = np; p-- > 0;)
			ck_assert_msg(ffn_share_part(fs, &job, x, yr, p, np, err, sizeof(err)) == 0, "%s", err);
		ck_assert_msg(memcmp(yr, y, (size_t)T * DIM * 4) == 0, "%s: the parts in reverse differ",
			      k ? "gate and up apart" : "gate and up fused");
		free(yr);
		for (uint32_t t = 0; t < T; t++) {
			ffn_share_job_init(&job, &g, &ups[k], &d, ROWS, 1, DT_BF16);
			for (uint32_t p = 0; p < np; p++)
				ck_assert_msg(ffn_share_part(fs, &job, x + (size_t)t * DIM, y1, p, np, err, sizeof(err)) == 0,
					      "%s", err);
			for (uint32_t o = 0; o < DIM; o++)
				ck_assert_msg(memcmp(&y[(size_t)t * DIM + o], &y1[o], 4) == 0,
					      "%s: token %u, y[%u] = %.9g in a job of %u tokens, %.9g alone",
					      k ? "gate and up apart" : "gate and up fused", t, o, (double)y[(size_t)t * DIM + o],
					      (unsigned)T, (double)y1[o]);
		}
	}
	/* the tiles ran exactly when AMX is in use */
	ck_assert_msg((cpu_matmul_tile_rows() > tiled0) == !!(isa & CPU_ISA_AMX_BF16), "tiles %s with isa %#x",
		      cpu_matmul_tile_rows() > tiled0 ? "ran" : "did not run", isa);
	if (_i)
		printf("test_share_tokens_in_blocks: BF16 FFN shares on %s\n", cpu_matmul_path(DT_BF16));
	cpu_compute_force_isa(CPU_ISA_ALL & ~(unsigned)CPU_ISA_AMX_BF16);
	free(gate);
	free(upb);
	free(down);
	free(x);
	free(upf);
	free(y);
	free(y1);
	ffn_share_destroy(&fs);
}
END_TEST

/* The same job on a pool of 4 workers, 30 times, against the job run in order on one thread: chunks
 * of the first phase run by different parts and threads, the second phase reading h they wrote,
 * give the same bits every time. */
struct pool_share {
	struct ffn_share *fs;
	struct ffn_share_job *job;
	const void *x;
	float *y;
};

/* Parts running on each thread, one inside another (task_pool_help), and how often one ran inside
 * another. */
static _Thread_local uint32_t share_depth;
static _Atomic uint32_t shares_inside;

static int pool_share_part(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	struct pool_share *ps = arg;
	if (share_depth++)
		atomic_fetch_add(&shares_inside, 1);
	int rc = ffn_share_part(ps->fs, ps->job, ps->x, ps->y, part, n_parts, err, errlen);
	share_depth--;
	return rc;
}

START_TEST(test_share_on_a_pool)
{
	enum { DIM = 512, ROWS = 768, T = 3 };
	char err[256] = "";
	struct task_pool *pool = pool_new(4);
	struct ffn_share *fs = NULL;
	ck_assert_msg(ffn_share_create(DIM, ROWS, 4, 1, &fs, err, sizeof(err)) == 0, "%s", err); /* 4 chunks a phase */
	const uint32_t np = ffn_share_parts(fs);
	uint16_t *gate = malloc((size_t)ROWS * DIM * 2), *up = malloc((size_t)ROWS * DIM * 2),
		 *down = malloc((size_t)DIM * ROWS * 2), *x = malloc((size_t)T * DIM * 2);
	float *want = malloc((size_t)T * DIM * 4), *y = malloc((size_t)T * DIM * 4);
	ck_assert(gate && up && down && x && want && y);
	rng_state = 17;
	for (size_t i = 0; i < (size_t)ROWS * DIM; i++) {
		gate[i] = f32_to_bf16((float)(0.05 * rng_normal()));
		up[i] = f32_to_bf16((float)(0.05 * rng_normal()));
		down[i] = f32_to_bf16((float)(0.05 * rng_normal()));
	}
	for (size_t i = 0; i < (size_t)T * DIM; i++)
		x[i] = f32_to_bf16((float)rng_normal());
	struct ffn_share_mat g = {.data = gate, .format = DT_BF16, .row_bytes = DIM * 2};
	struct ffn_share_mat u = {.data = up, .format = DT_BF16, .row_bytes = DIM * 2};
	struct ffn_share_mat d = {.data = down, .format = DT_BF16, .row_bytes = ROWS * 2};
	struct ffn_share_job job;
	ffn_share_job_init(&job, &g, &u, &d, ROWS, T, DT_BF16);
	for (uint32_t p = 0; p < np; p++)
		ck_assert_msg(ffn_share_part(fs, &job, x, want, p, np, err, sizeof(err)) == 0, "%s", err);
	/* The completion word and its sleepers' count outlive the jobs (a worker reads the count just
	 * after it stores the word): one of each, the jobs' values counting up. */
	uint32_t done = 0, waiters = 0;
	for (int rep = 0; rep < 30; rep++) {
		memset(y, 0xff, (size_t)T * DIM * 4);
		ffn_share_job_init(&job, &g, &u, &d, ROWS, T, DT_BF16);
		job.taper = rep % 2; /* tapered chunks: the same bits */
		struct pool_share ps = {.fs = fs, .job = &job, .x = x, .y = y};
		struct task_job tj;
		task_job_init(&tj, pool_share_part, &ps, np, &done, (uint32_t)rep + 1);
		tj.done_waiters = &waiters;
		ck_assert_int_eq(task_pool_submit(pool, &tj), 0);
		ck_assert_int_eq(task_word_wait(&done, &waiters, (uint32_t)rep + 1, 10, 0), 0);
		ck_assert_msg(tj.rc == 0, "%s", tj.err);
		ck_assert_msg(memcmp(y, want, (size_t)T * DIM * 4) == 0, "run %d on the pool differs from the one in order", rep);
	}
	free(gate);
	free(up);
	free(down);
	free(x);
	free(want);
	free(y);
	ffn_share_destroy(&fs);
	task_pool_destroy(&pool);
}
END_TEST

/* Four jobs at once on a pool of 3 workers (a layer's experts), each naming the pool, so that a
 * part waiting for its job's first phase may run the others' queued parts (task_pool_help): 30
 * layers, each job's output the bits of the same job run in order. */
START_TEST(test_shares_at_once_help)
{
	enum { DIM = 256, ROWS = 512, K = 4 };
	char err[256] = "";
	struct task_pool *pool = NULL;
	struct task_pool_config pc;
	task_pool_config_default(&pc);
	pc.threads = 3;
	pc.pin = false;
	pc.spin_us = 1000;
	ck_assert_msg(task_pool_create(&pc, &pool, err, sizeof(err)) == 0, "%s", err);
	atomic_store(&shares_inside, 0);
	uint16_t *w[K][3], *x = malloc((size_t)DIM * 2);
	float *want[K], *y[K];
	struct ffn_share *fs[K];
	struct ffn_share_mat g[K], u[K], d[K];
	ck_assert_ptr_nonnull(x);
	rng_state = 31;
	for (size_t i = 0; i < DIM; i++)
		x[i] = f32_to_bf16((float)rng_normal());
	for (int k = 0; k < K; k++) {
		for (int m = 0; m < 3; m++) {
			w[k][m] = malloc((size_t)ROWS * DIM * 2);
			ck_assert_ptr_nonnull(w[k][m]);
			for (size_t i = 0; i < (size_t)ROWS * DIM; i++)
				w[k][m][i] = f32_to_bf16((float)(0.05 * rng_normal()));
		}
		g[k] = (struct ffn_share_mat){.data = w[k][0], .format = DT_BF16, .row_bytes = DIM * 2};
		u[k] = (struct ffn_share_mat){.data = w[k][1], .format = DT_BF16, .row_bytes = DIM * 2};
		d[k] = (struct ffn_share_mat){.data = w[k][2], .format = DT_BF16, .row_bytes = ROWS * 2};
		want[k] = malloc((size_t)DIM * 4);
		y[k] = malloc((size_t)DIM * 4);
		ck_assert(want[k] && y[k]);
		fs[k] = NULL;
		ck_assert_msg(ffn_share_create(DIM, ROWS, 1, 1 + k % 2, &fs[k], err, sizeof(err)) == 0, "%s", err);
		struct ffn_share_job job;
		ffn_share_job_init(&job, &g[k], &u[k], &d[k], ROWS, 1, DT_BF16);
		const uint32_t np = ffn_share_parts(fs[k]);
		for (uint32_t p = 0; p < np; p++)
			ck_assert_msg(ffn_share_part(fs[k], &job, x, want[k], p, np, err, sizeof(err)) == 0, "%s", err);
	}
	uint32_t done[K], waiters[K];
	memset(done, 0, sizeof(done));
	memset(waiters, 0, sizeof(waiters));
	for (uint32_t rep = 1; rep <= 30; rep++) {
		struct ffn_share_job job[K];
		struct pool_share ps[K];
		struct task_job tj[K];
		for (int k = 0; k < K; k++) {
			memset(y[k], 0xff, (size_t)DIM * 4);
			ffn_share_job_init(&job[k], &g[k], &u[k], &d[k], ROWS, 1, DT_BF16);
			job[k].pool = pool;
			job[k].taper = rep % 2;
			ps[k] = (struct pool_share){.fs = fs[k], .job = &job[k], .x = x, .y = y[k]};
			task_job_init(&tj[k], pool_share_part, &ps[k], ffn_share_parts(fs[k]), &done[k], rep);
			tj[k].done_waiters = &waiters[k];
		}
		for (int k = 0; k < K; k++)
			ck_assert_int_eq(task_pool_submit(pool, &tj[k]), 0);
		for (int k = 0; k < K; k++) {
			ck_assert_int_eq(task_word_wait(&done[k], &waiters[k], rep, 10, 0), 0);
			ck_assert_msg(tj[k].rc == 0, "%s", tj[k].err);
		}
		for (int k = 0; k < K; k++)
			ck_assert_msg(memcmp(y[k], want[k], (size_t)DIM * 4) == 0, "layer %u, job %d: not the bits in order",
				      rep, k);
	}
	/* How often a part ran inside a waiting one depends on the timing (a loaded machine may run a
	 * job's phases back to back and never wait): reported, not asserted. test_task_pool's
	 * test_waiting_part_helps and test_help_from_outside make a part wait and check that it helps. */
	if (test_verbose())
		fprintf(stderr, "test_ffn_split: %u parts ran inside waiting ones in 30 layers\n",
			atomic_load(&shares_inside));
	task_pool_destroy(&pool);
	for (int k = 0; k < K; k++) {
		for (int m = 0; m < 3; m++)
			free(w[k][m]);
		free(want[k]);
		free(y[k]);
		ffn_share_destroy(&fs[k]);
	}
	free(x);
}
END_TEST

/* The threads a share is cut for (ffn_share_threads_for): chunks of about FFN_SHARE_CHUNK_BYTES,
 * 1..the pool's threads; and a job's output is the same bits however finely it is cut, in equal
 * chunks or tapered ones (ffn_share_job.taper). */
START_TEST(test_share_threads_for)
{
	const uint64_t third = 3ull * FFN_SHARE_PARTS_PER_THREAD * FFN_SHARE_CHUNK_BYTES;
	ck_assert_uint_eq(ffn_share_threads_for(0, 14), 1);
	ck_assert_uint_eq(ffn_share_threads_for(third - 1, 14), 1);
	ck_assert_uint_eq(ffn_share_threads_for(3 * third, 14), 3);
	/* a bf16 expert of Qwen3-30B-A3B: gate, up and down of 768 x 2048 */
	ck_assert_uint_eq(ffn_share_threads_for(3ull * 768 * 2048 * 2, 14), 3);
	ck_assert_uint_eq(ffn_share_threads_for(1000 * third, 14), 14);
	ck_assert_uint_eq(ffn_share_threads_for(1000000 * third, 100000), FFN_SHARE_MAX_THREADS);
	ck_assert_uint_eq(ffn_share_threads_for(3 * third, 0), 1);
	/* chunks of a size given (--cpu-expert-chunk): a Q4_K expert of the same shape, 2.65 MB, cut for
	 * one thread at 256 KiB, for three at 64 KiB, for 13 at 16 KiB (at most the pool's); 0 is the
	 * default */
	const uint64_t q4k = 3ull * 768 * 2048 / 256 * 144;
	ck_assert_uint_eq(ffn_share_threads_for_chunk(q4k, 14, FFN_SHARE_CHUNK_BYTES), 1);
	ck_assert_uint_eq(ffn_share_threads_for_chunk(q4k, 14, 64u << 10), 3);
	ck_assert_uint_eq(ffn_share_threads_for_chunk(q4k, 14, FFN_SHARE_CHUNK_MIN), 13);
	ck_assert_uint_eq(ffn_share_threads_for_chunk(q4k, 12, FFN_SHARE_CHUNK_MIN), 12);
	ck_assert_uint_eq(ffn_share_threads_for_chunk(3 * third, 14, 0), ffn_share_threads_for(3 * third, 14));

	enum { DIM = 512, ROWS = 768 };
	char err[256] = "";
	uint16_t *gate = malloc((size_t)ROWS * DIM * 2), *up = malloc((size_t)ROWS * DIM * 2),
		 *down = malloc((size_t)DIM * ROWS * 2), *x = malloc((size_t)DIM * 2);
	float *y[6];
	ck_assert(gate && up && down && x);
	rng_state = 29;
	for (size_t i = 0; i < (size_t)ROWS * DIM; i++) {
		gate[i] = f32_to_bf16((float)(0.05 * rng_normal()));
		up[i] = f32_to_bf16((float)(0.05 * rng_normal()));
		down[i] = f32_to_bf16((float)(0.05 * rng_normal()));
	}
	for (size_t i = 0; i < DIM; i++)
		x[i] = f32_to_bf16((float)rng_normal());
	struct ffn_share_mat g = {.data = gate, .format = DT_BF16, .row_bytes = DIM * 2};
	struct ffn_share_mat u = {.data = up, .format = DT_BF16, .row_bytes = DIM * 2};
	struct ffn_share_mat d = {.data = down, .format = DT_BF16, .row_bytes = ROWS * 2};
	const uint32_t threads[3] = {1, 3, 7};
	for (int c = 0; c < 6; c++) { /* each cut, equal chunks then tapered ones */
		struct ffn_share *fs = NULL;
		ck_assert_msg(ffn_share_create(DIM, ROWS, 1, threads[c % 3], &fs, err, sizeof(err)) == 0, "%s", err);
		y[c] = malloc((size_t)DIM * 4);
		ck_assert_ptr_nonnull(y[c]);
		struct ffn_share_job job;
		ffn_share_job_init(&job, &g, &u, &d, ROWS, 1, DT_BF16);
		job.taper = c >= 3;
		const uint32_t np = ffn_share_parts(fs);
		ck_assert_uint_eq(np, 2 * FFN_SHARE_PARTS_PER_THREAD * threads[c % 3]);
		for (uint32_t p = 0; p < np; p++)
			ck_assert_msg(ffn_share_part(fs, &job, x, y[c], p, np, err, sizeof(err)) == 0, "%s", err);
		ffn_share_destroy(&fs);
		if (c)
			ck_assert_msg(memcmp(y[c], y[0], (size_t)DIM * 4) == 0, "cut for %u threads%s: not the bits of one",
				      threads[c % 3], c >= 3 ? ", tapered" : "");
	}
	for (int c = 0; c < 6; c++)
		free(y[c]);
	free(gate);
	free(up);
	free(down);
	free(x);
}
END_TEST

/* A job's weights brought into the caches in its reading order (ffn_share_prefetch): every byte
 * of the share once, in pieces of any size, nothing outside it. The matrices lie in mappings whose
 * bytes outside the share (gate's and up's rows before r, down's columns before r of every row,
 * and a page after each) are PROT_NONE, so a touch of any of them kills the test. */
static uint8_t *guarded(size_t bytes)
{
	const size_t page = (size_t)sysconf(_SC_PAGESIZE);
	uint8_t *m = mmap(NULL, bytes + page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	ck_assert(m != MAP_FAILED);
	return m;
}

START_TEST(test_share_prefetch)
{
	const size_t page = (size_t)sysconf(_SC_PAGESIZE);
	if (page != 4096) {
		fprintf(stderr, "test_share_prefetch: pages of %zu bytes, the layout wants 4096: not tested\n", page);
		return;
	}
	enum { DIM = 2048, FFN = 4096, R = 2048 }; /* a gate row is a page; down's share starts a page in */
	const size_t g_row = DIM * 2, d_row = FFN * 2;
	uint8_t *gate = guarded((size_t)FFN * g_row), *up = guarded((size_t)FFN * g_row), *down = guarded((size_t)DIM * d_row);
	ck_assert_int_eq(mprotect(gate + R * g_row, (FFN - R) * g_row, PROT_READ | PROT_WRITE), 0);
	ck_assert_int_eq(mprotect(up + R * g_row, (FFN - R) * g_row, PROT_READ | PROT_WRITE), 0);
	for (size_t o = 0; o < DIM; o++)
		ck_assert_int_eq(mprotect(down + o * d_row + R * 2, (FFN - R) * 2, PROT_READ | PROT_WRITE), 0);
	struct ffn_share_mat g = {.data = gate + R * g_row, .format = DT_BF16, .row_bytes = g_row};
	struct ffn_share_mat u = {.data = up + R * g_row, .format = DT_BF16, .row_bytes = g_row};
	struct ffn_share_mat d = {.data = down + R * 2, .format = DT_BF16, .row_bytes = d_row};
	char err[256] = "";
	struct ffn_share *fs = NULL;
	ck_assert_msg(ffn_share_create(DIM, FFN, 1, 2, &fs, err, sizeof(err)) == 0, "%s", err);
	struct ffn_share_job job;
	ffn_share_job_init(&job, &g, &u, &d, FFN - R, 1, DT_BF16);
	const uint64_t total = ffn_share_job_bytes(fs, &job);
	ck_assert_uint_eq(total, (uint64_t)(FFN - R) * 2 * g_row + (uint64_t)DIM * (FFN - R) * 2);
	for (uint64_t at = 0; at < 5000; at++) /* byte by byte across gate's first row into up's */
		ck_assert_uint_eq(ffn_share_prefetch(fs, &job, at, 1), 1);
	const uint64_t pieces[] = {4097, 100003, 1u << 20, total};
	for (size_t k = 0; k < sizeof(pieces) / sizeof(pieces[0]); k++) {
		uint64_t sum = 0, at = 0, got;
		while ((got = ffn_share_prefetch(fs, &job, at, pieces[k])) > 0) {
			ck_assert_uint_le(got, pieces[k]);
			sum += got;
			at += got;
		}
		ck_assert_msg(sum == total, "pieces of %llu: %llu bytes touched of %llu", (unsigned long long)pieces[k],
			      (unsigned long long)sum, (unsigned long long)total);
	}
	ck_assert_uint_eq(ffn_share_prefetch(fs, &job, total - 10, 100), 10);
	ck_assert_uint_eq(ffn_share_prefetch(fs, &job, total, 100), 0);
	ck_assert_uint_eq(ffn_share_prefetch(fs, &job, 0, 0), 0);
	ffn_share_destroy(&fs);
	munmap(gate, (size_t)FFN * g_row + page);
	munmap(up, (size_t)FFN * g_row + page);
	munmap(down, (size_t)DIM * d_row + page);
}
END_TEST

static Suite *split_suite(void)
{
	Suite *s = suite_create("ffn_split");
	TCase *tc = tcase_create("logits");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_split_f32);
	tcase_add_test(tc, test_split_bf16);
	tcase_add_test(tc, test_split_q8_0);
	tcase_add_test(tc, test_split_q4_k_m);
	suite_add_tcase(s, tc);
	TCase *te = tcase_create("errors");
	tcase_set_timeout(te, 60);
	tcase_add_test(te, test_refusals);
	tcase_add_test(te, test_share_job_failure);
	tcase_add_loop_test(te, test_share_tokens_in_blocks, 0, 2);
	tcase_add_test(te, test_share_on_a_pool);
	tcase_add_test(te, test_shares_at_once_help);
	tcase_add_test(te, test_share_threads_for);
	tcase_add_test(te, test_share_prefetch);
	suite_add_tcase(s, te);
	return s;
}

int main(void)
{
	return th_run(split_suite());
}

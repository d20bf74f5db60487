/* test_generate.c - the generation loop (generate.c) against a KV store that goes away at the
 * worst moment: after the last token, while the request hands its KV blocks back.
 *
 * The model is the tiny synthetic checkpoint, computed by the C backend from memory
 * (tools/run-local's memory source); the KV tier behind the arena is a store in this process
 * (struct kv_remote_ops) that can die on its n-th MSG_KV_FREE and come back with its blocks
 * adopted, as the kv-store does after a kill. A request that has produced every token must
 * survive that: it waits for the store (on_kv_failure), hands the blocks to its successor and
 * succeeds; a store that does not come back fails the request with a message, and the next
 * request starts from an empty cache.
 *
 * A split FFN whose CPU share fails (a worker's error) fails its request with the share's message,
 * and the next request runs to the end.
 *
 * A resumed request (gen_params.done: the tokens a request had generated when its runner died)
 * goes on with exactly the tokens of the uninterrupted run, from index n_done, greedy and seeded,
 * with a repetition penalty or without, cut anywhere; one cut after its last token ends at once. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/manifest.h"
#include "common/util.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/cpu/ref_test.h"
#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/generate.h"
#include "services/gpu-runner/kv_cache.h"
#include "tests/unit/common/test_helpers.h"
#include "tests/unit/gpu-runner/mem_store.h"
#include "tests/unit/gpu-runner/runner_test_util.h"
#include "tools/make-synthetic-model/synthetic.h"
#include "tools/run-local/memory_source.h"

#define PROMPT 40
#define NEW 40

/* The runner's side of a lost store (requests.c's runner_kv_failure): reconnect if it died. */
static int reconnect(void *ctx, char *err, size_t errlen)
{
	struct store *s = ctx;
	if (!s->dead)
		return 0;
	if (!s->comes_back)
		return errorf(err, errlen, -ETIMEDOUT, "kv-store did not come back");
	s->dead = false; /* restarted: it adopted its pool, references and all */
	s->reconnects++;
	return 0;
}

/* ---- the model and the request ------------------------------------------------------------ */

struct fixture {
	char dir[64];
	struct manifest *m;
	struct memory_source *ms;
	struct backend *be;
	struct task_pool *pool; /* the CPU's shares of split FFNs (engine_set_ffn_split) */
	struct kv_cache *kv;
	struct engine *e;
	struct store st;
	int32_t prompt[PROMPT];
	int32_t out[NEW];
};

static struct fixture fx;

static void setup(void)
{
	char err[512] = "";
	memset(&fx, 0, sizeof(fx));
	snprintf(fx.dir, sizeof(fx.dir), "/tmp/test_generate.XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(fx.dir));
	struct model_config cfg;
	ck_assert_int_eq(synth_shape_config("tiny", &cfg, err, sizeof(err)), 0);
	struct synth_options so;
	synth_options_default(&so);
	so.dtype = DT_F32;
	ck_assert_msg(synth_write(fx.dir, &cfg, &so, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(manifest_load(fx.dir, &fx.m, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(memory_source_create(fx.m, &fx.ms, err, sizeof(err)) == 0, "%s", err);
	uint32_t ctx = PROMPT + NEW + 1, bt = 16, per_layer = ctx / bt + 2;
	struct backend_params bp = {.max_chunk = 16, .block_tokens = bt, .n_kv_blocks = per_layer * fx.m->cfg.n_layers,
				    .kv_dtype = DT_F32, .threads = 1, .cpu_pool = fx.pool = pool_new(2)};
	ck_assert_msg(backend_create("cpu", &fx.m->cfg, &bp, &fx.be, err, sizeof(err)) == 0, "%s", err);
	fx.st.block_bytes = backend_kv_block_bytes("cpu", &fx.m->cfg, &bp);
	fx.st.mem = malloc(STORE_BLOCKS * fx.st.block_bytes);
	ck_assert_ptr_nonnull(fx.st.mem);
	struct kv_cache_params kp = {.n_layers = fx.m->cfg.n_layers, .block_tokens = bt, .max_context = ctx,
				     .max_chunk = bp.max_chunk, .n_arena = bp.n_kv_blocks};
	ck_assert_msg(kv_cache_create(&kp, fx.be, &store_ops, &fx.st, &fx.kv, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(engine_create(&fx.m->cfg, fx.be, memory_source_base(fx.ms), fx.kv, bp.max_chunk, &fx.e, err,
				    sizeof(err)) == 0, "%s", err);
	for (uint32_t i = 0; i < PROMPT; i++)
		fx.prompt[i] = (int32_t)((i * 37 + 11) % 500 + 1);
}

static void teardown(void)
{
	engine_destroy(&fx.e);
	kv_cache_destroy(&fx.kv);
	backend_destroy(&fx.be);
	task_pool_destroy(&fx.pool);
	memory_source_destroy(&fx.ms);
	manifest_destroy(&fx.m);
	free(fx.st.mem);
	th_rmtree(fx.dir);
}

static enum gen_emit keep(void *ctx, uint32_t index, int32_t token)
{
	if (index < NEW)
		fx.out[index] = token;
	return GEN_CONTINUE;
}

/* A greedy request of NEW tokens; its tokens land in fx.out. */
static int request(char *err, size_t errlen)
{
	struct gen_params gp = {.max_new = NEW, .ignore_eos = true, .on_kv_failure = reconnect};
	struct gen_result res;
	memset(fx.out, 0xff, sizeof(fx.out));
	int rc = generate_run(fx.e, fx.prompt, PROMPT, PROMPT + NEW + 1, &gp, keep, &fx.st, &res, err, errlen);
	if (rc == 0)
		ck_assert_uint_eq(res.n_generated, NEW);
	return rc;
}

START_TEST(test_store_dies_while_blocks_go_back)
{
	char err[512] = "";
	int32_t want[NEW];
	ck_assert_msg(request(err, sizeof(err)) == 0, "%s", err);
	memcpy(want, fx.out, sizeof(want));
	ck_assert_uint_gt(fx.st.used, 0); /* blocks went to the store */
	ck_assert_uint_eq(refs_held(&fx.st), 0);

	/* It dies at the first hand-back of the next request and comes back: the request succeeds,
	 * and the successor gets every reference back. */
	fx.st.releases = 0;
	fx.st.die_at_release = 1;
	fx.st.comes_back = true;
	ck_assert_msg(request(err, sizeof(err)) == 0, "a request that produced every token failed: %s", err);
	ck_assert_int_eq(memcmp(fx.out, want, sizeof(want)), 0);
	ck_assert_uint_eq(fx.st.reconnects, 1);
	ck_assert_msg(refs_held(&fx.st) == 0, "%u references left in the store", refs_held(&fx.st));
}
END_TEST

START_TEST(test_store_that_stays_away_fails_the_request)
{
	char err[512] = "";
	int32_t want[NEW];
	ck_assert_msg(request(err, sizeof(err)) == 0, "%s", err);
	memcpy(want, fx.out, sizeof(want));
	fx.st.releases = 0;
	fx.st.die_at_release = 1;
	fx.st.comes_back = false;
	ck_assert_int_ne(request(err, sizeof(err)), 0);
	ck_assert_msg(strstr(err, "freeing KV blocks failed") && strstr(err, "died"), "message: %s", err);
	/* The cache forgot what the store could not be told; the next request starts afresh. */
	fx.st.dead = false;
	fx.st.die_at_release = 0;
	ck_assert_msg(request(err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(memcmp(fx.out, want, sizeof(want)), 0);
}
END_TEST

/* Every FFN split near half its rows, the rest on the task pool: a failing share fails the
 * request with its message, nothing hangs, and the next request gives the split's tokens again. */
START_TEST(test_cpu_share_failure_fails_the_request)
{
	char err[512] = "";
	const struct model_config *c = &fx.m->cfg;
	uint32_t r[64];
	ck_assert_uint_le(c->n_layers, 64);
	for (uint32_t l = 0; l < c->n_layers; l++)
		r[l] = c->ffn_dim / 2 / 64 * 64; /* a multiple of F32's unit, 64 */
	ck_assert_msg(engine_set_ffn_split(fx.e, r, 1, err, sizeof(err)) == 0, "%s", err);
	int32_t want[NEW];
	ck_assert_msg(request(err, sizeof(err)) == 0, "%s", err);
	memcpy(want, fx.out, sizeof(want));
	struct backend_cpu_share_stats cs;
	backend_get_cpu_share_stats(fx.be, &cs);
	ck_assert_uint_gt(cs.jobs, 0); /* the shares ran on the pool */

	/* The first share of the next request's third decode step (its prefill chunks of 16 tokens
	 * take the whole FFN on the backend: max_tokens 1). */
	ck_assert_msg(backend_ref_test_fail_cpu_share(fx.be, 2 * c->n_layers + 1, err, sizeof(err)) == 0, "%s", err);
	memset(err, 0, sizeof(err));
	ck_assert_int_ne(request(err, sizeof(err)), 0);
	ck_assert_msg(strstr(err, "CPU share failed") && strstr(err, "injected failure"), "message: %s", err);
	backend_get_cpu_share_stats(fx.be, &cs);
	ck_assert_uint_eq(cs.failed, 1);

	/* The next request starts afresh and gives the same tokens. */
	ck_assert_msg(request(err, sizeof(err)) == 0, "after a failed share: %s", err);
	ck_assert_int_eq(memcmp(fx.out, want, sizeof(want)), 0);
	ck_assert_int_eq(engine_set_ffn_split(fx.e, NULL, 1, err, sizeof(err)), 0);
}
END_TEST

/* A store whose pool takes one block a fetch (the others' pins fill the kv-store's pool so when a
 * step is rebuilt beside them): the fetches are asked again in smaller runs, the read-ahead stops,
 * and the request gives its tokens; it used to count as a store failure and rebuild until it gave up. */
START_TEST(test_fetches_cut_to_what_the_pool_takes)
{
	char err[512] = "";
	int32_t want[NEW];
	ck_assert_msg(request(err, sizeof(err)) == 0, "%s", err);
	memcpy(want, fx.out, sizeof(want));
	/* An arena of 6 blocks for 2 layers of 5 blocks each: blocks leave and come back every step. */
	struct kv_cache *small = NULL;
	uint32_t ctx = PROMPT + NEW + 1;
	struct kv_cache_params kp = {.n_layers = fx.m->cfg.n_layers, .block_tokens = 16, .max_context = ctx,
				     .max_chunk = 16, .n_arena = 6};
	ck_assert_msg(kv_cache_create(&kp, fx.be, &store_ops, &fx.st, &small, err, sizeof(err)) == 0, "%s", err);
	engine_set_kv(fx.e, small);
	fx.st.fetch_cap = 1;
	int rc = request(err, sizeof(err));
	struct kv_cache_stats ks;
	kv_cache_get_stats(small, &ks);
	engine_set_kv(fx.e, fx.kv);
	kv_cache_destroy(&small);
	fx.st.fetch_cap = 0;
	ck_assert_msg(rc == 0, "a request over a pool that takes one block a fetch failed: %s", err);
	ck_assert_int_eq(memcmp(fx.out, want, sizeof(want)), 0);
	ck_assert_uint_gt(fx.st.fetch_refused, 0);
	ck_assert_uint_gt(ks.fetch_cuts, 0);
	ck_assert_uint_gt(ks.fetched, 0);
	ck_assert_uint_eq(ks.recoveries, 0);
}
END_TEST

/* A request of NEW tokens with the given sampling, resumed after the first n_done of done (NULL:
 * from the start); tokens land in fx.out by index, the first index emitted in *first. */
static uint32_t first_index;
static enum gen_emit keep_first(void *ctx, uint32_t index, int32_t token)
{
	if (first_index == UINT32_MAX)
		first_index = index;
	return keep(ctx, index, token);
}

static int sampled(float temperature, uint64_t seed, float penalty, const int32_t *done, uint32_t n_done,
		   struct gen_result *res, char *err, size_t errlen)
{
	struct gen_params gp = {.max_new = NEW, .ignore_eos = true, .on_kv_failure = reconnect,
				.sampling = {.temperature = temperature, .top_p = 1.0f, .seed = seed},
				.repetition_penalty = penalty, .kv_seed = 0x5eed, .done = done, .n_done = n_done};
	memset(fx.out, 0xff, sizeof(fx.out));
	first_index = UINT32_MAX;
	return generate_run(fx.e, fx.prompt, PROMPT, PROMPT + NEW + 1, &gp, keep_first, &fx.st, res, err, errlen);
}

START_TEST(test_resume_gives_the_uninterrupted_tokens)
{
	static const struct {
		float temperature, penalty;
		uint64_t seed;
	} kinds[] = {{0, 0, 0}, {1.0f, 0, 7}, {0.8f, 1.3f, 3}, {0, 1.3f, 0}};
	char err[512] = "";
	for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
		struct gen_result res;
		int32_t want[NEW];
		ck_assert_msg(sampled(kinds[k].temperature, kinds[k].seed, kinds[k].penalty, NULL, 0, &res, err,
				      sizeof(err)) == 0, "%s", err);
		ck_assert_uint_eq(res.n_generated, NEW);
		memcpy(want, fx.out, sizeof(want));
		static const uint32_t cuts[] = {1, 5, 16, 17, NEW - 1};
		for (size_t c = 0; c < sizeof(cuts) / sizeof(cuts[0]); c++) {
			uint32_t n = cuts[c];
			ck_assert_msg(sampled(kinds[k].temperature, kinds[k].seed, kinds[k].penalty, want, n, &res, err,
					      sizeof(err)) == 0, "%s", err);
			ck_assert_uint_eq(res.n_generated, NEW);
			ck_assert_str_eq(res.reason, "length");
			ck_assert_uint_eq(first_index, n);
			for (uint32_t i = 0; i < n; i++)
				ck_assert_int_eq(fx.out[i], -1); /* nothing before the cut is sent again */
			for (uint32_t i = n; i < NEW; i++)
				ck_assert_msg(fx.out[i] == want[i], "kind %zu, cut at %u: token %u is %d, want %d", k, n,
					      i, fx.out[i], want[i]);
		}
		/* Cut after its last token: it ends at once, nothing sent. */
		ck_assert_msg(sampled(kinds[k].temperature, kinds[k].seed, kinds[k].penalty, want, NEW, &res, err,
				      sizeof(err)) == 0, "%s", err);
		ck_assert_uint_eq(res.n_generated, NEW);
		ck_assert_uint_eq(first_index, UINT32_MAX);
	}
	/* Without the skip of the sampler's draws a seeded resume would differ: the test can tell. */
	struct gen_result res;
	int32_t want[NEW], other[NEW];
	ck_assert(sampled(1.0f, 7, 0, NULL, 0, &res, err, sizeof(err)) == 0);
	memcpy(want, fx.out, sizeof(want));
	ck_assert(sampled(1.0f, 8, 0, NULL, 0, &res, err, sizeof(err)) == 0);
	memcpy(other, fx.out, sizeof(other));
	ck_assert_msg(memcmp(want, other, sizeof(want)) != 0, "two seeds gave the same tokens: sampling is not tested");
	/* More done tokens than max_new, or one outside the vocabulary: refused. */
	int32_t bad[NEW + 1];
	memcpy(bad, want, sizeof(want));
	bad[NEW] = 0;
	ck_assert_int_eq(sampled(0, 0, 0, bad, NEW + 1, &res, err, sizeof(err)), -EINVAL);
	bad[0] = -5;
	ck_assert_int_eq(sampled(0, 0, 0, bad, 3, &res, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "resumed token 0"), "message: %s", err);
}
END_TEST

static int logits_rc;
static uint32_t logits_calls;

static int logits_fail(void *ctx, uint32_t position, const float *logits, uint32_t n)
{
	(void)ctx, (void)logits, (void)n;
	ck_assert_uint_eq(position, PROMPT - 1);
	logits_calls++;
	return logits_rc;
}

/* The prompt's logits (GEN_LOGITS) to a client that went away: the request ends cancelled, no
 * token computed or sent, and it is no failure (the runner would check its peers before the next
 * request); any other failure to send them fails the request. */
START_TEST(test_client_gone_at_the_logits_cancels)
{
	char err[512] = "";
	struct gen_result res;
	struct gen_params gp = {.max_new = NEW, .ignore_eos = true, .on_kv_failure = reconnect, .on_logits = logits_fail};
	logits_rc = -ECANCELED;
	logits_calls = 0;
	memset(fx.out, 0xff, sizeof(fx.out));
	int rc = generate_run(fx.e, fx.prompt, PROMPT, PROMPT + NEW + 1, &gp, keep, &fx.st, &res, err, sizeof(err));
	ck_assert_msg(rc == 0, "%d %s", rc, err);
	ck_assert_uint_eq(logits_calls, 1);
	ck_assert_str_eq(res.reason, "cancelled");
	ck_assert_uint_eq(res.n_generated, 0);
	ck_assert_int_eq(fx.out[0], -1);
	logits_rc = -EIO;
	rc = generate_run(fx.e, fx.prompt, PROMPT, PROMPT + NEW + 1, &gp, keep, &fx.st, &res, err, sizeof(err));
	ck_assert_int_eq(rc, -EIO);
	ck_assert_msg(strstr(err, "logits"), "message: %s", err);
	/* The next request computes. */
	ck_assert_msg(request(err, sizeof(err)) == 0, "%s", err);
}
END_TEST

/* engine_step_stats: a request's decode steps (one after the first token, which the prompt's step
 * gives) and the host's time between each and the next; a pause longer than ENGINE_STEPS_APART_MS
 * before the next request is not counted as time between steps. */
START_TEST(test_decode_steps_counted)
{
	char err[512] = "";
	struct engine_step_stats a, b, c;
	engine_step_stats(fx.e, &a);
	ck_assert_uint_eq(a.steps, 0);
	ck_assert_uint_eq(a.betweens, 0);
	ck_assert_msg(request(err, sizeof(err)) == 0, "%s", err);
	engine_step_stats(fx.e, &b);
	ck_assert_uint_eq(b.steps, NEW - 1);
	ck_assert_uint_eq(b.betweens, NEW - 2);
	ck_assert(b.step_ms > 0);
	ck_assert(b.between_ms >= 0 && b.between_ms < (double)(NEW - 2) * ENGINE_STEPS_APART_MS);
	/* Each decode step's start timed part by part (the prompt's step is not one), inside the steps. */
	ck_assert_uint_eq(b.begins, NEW - 1);
	double begun = 0;
	for (int i = 0; i < ENGINE_BEGIN_PARTS; i++) {
		ck_assert(b.begin_ms[i] >= 0);
		begun += b.begin_ms[i];
	}
	ck_assert(begun > 0 && begun < b.step_ms);
	ck_assert(b.begin_ms[BEGIN_ATTEND] > 0); /* the C backend computes the attention in that call */
	const struct timespec pause = {.tv_nsec = (ENGINE_STEPS_APART_MS + 10) * 1000000L};
	nanosleep(&pause, NULL);
	ck_assert_msg(request(err, sizeof(err)) == 0, "%s", err);
	engine_step_stats(fx.e, &c);
	ck_assert_uint_eq(c.steps, 2 * (NEW - 1));
	ck_assert_uint_eq(c.betweens, 2 * (NEW - 2));
	ck_assert(c.step_ms > b.step_ms);
}
END_TEST

static Suite *generate_suite(void)
{
	Suite *s = suite_create("generate");
	TCase *tc = tcase_create("kv_store_lost");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_store_dies_while_blocks_go_back);
	tcase_add_test(tc, test_store_that_stays_away_fails_the_request);
	tcase_add_test(tc, test_fetches_cut_to_what_the_pool_takes);
	tcase_add_test(tc, test_cpu_share_failure_fails_the_request);
	suite_add_tcase(s, tc);
	tc = tcase_create("resume");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_resume_gives_the_uninterrupted_tokens);
	tcase_add_test(tc, test_decode_steps_counted);
	tcase_add_test(tc, test_client_gone_at_the_logits_cancels);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(generate_suite());
}

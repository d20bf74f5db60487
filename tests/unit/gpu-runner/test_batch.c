/* test_batch.c - several sequences in one forward step (engine_forward_batch) against each sequence
 * computed alone.
 *
 * The model is the tiny synthetic checkpoint (four layers), computed by the C backend from memory.
 * Each sequence has its own KV cache, all over one arena (struct kv_arena) small enough that their
 * blocks go to a store in this process (mem_store.h) and come back, when attended or read ahead,
 * and that one sequence takes the committed blocks of another to make room. Steps mix the
 * prefill chunks of some sequences with the decode tokens of others, and sequences join and leave
 * between steps. Every sequence's logits must be bit for bit those it gives alone: what else is in a
 * step changes nothing of a sequence's numbers. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/manifest.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/kv_cache.h"
#include "tests/unit/common/test_helpers.h"
#include "tests/unit/gpu-runner/mem_store.h"
#include "tools/make-synthetic-model/synthetic.h"
#include "tools/run-local/memory_source.h"

#define SEQS 4
#define CHUNK 16     /* the backend's and the engine's most tokens a step */
#define BT 8	     /* tokens per KV block */
#define CONTEXT 160  /* positions per sequence */
#define DECODE 6     /* decode steps of each sequence after its prompt */

static const uint32_t prompt_len[SEQS] = {90, 9, 40, 120};
static const uint32_t chunk_of[SEQS] = {16, 4, 7, 12}; /* each sequence's prefill chunk */

struct fixture {
	char dir[64];
	struct manifest *m;
	struct memory_source *ms;
	struct backend *be;
	struct engine *e;
	struct store st;
	struct kv_arena *arena; /* the backend's arena blocks, shared by the caches */
	uint64_t alone_readahead; /* blocks the read-ahead brought back in the runs alone */
	uint32_t vocab;
	int32_t tok[SEQS][CONTEXT];
	/* want[s][k]: the logits of sequence s's k-th output (its prompt's last chunk, then each
	 * decode step), computed alone. */
	float *want[SEQS][DECODE + 1];
};

static struct fixture fx;

static struct kv_cache *cache(void)
{
	char err[256] = "";
	struct kv_cache_params kp = {.n_layers = fx.m->cfg.n_layers, .block_tokens = BT, .max_context = CONTEXT,
				     .max_chunk = CHUNK, .arena = fx.arena};
	struct kv_cache *kv = NULL;
	ck_assert_msg(kv_cache_create(&kp, fx.be, &store_ops, &fx.st, &kv, err, sizeof(err)) == 0, "%s", err);
	return kv;
}

static void setup(void)
{
	char err[512] = "";
	memset(&fx, 0, sizeof(fx));
	snprintf(fx.dir, sizeof(fx.dir), "/tmp/test_batch.XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(fx.dir));
	struct model_config cfg;
	ck_assert_int_eq(synth_shape_config("tiny", &cfg, err, sizeof(err)), 0);
	cfg.n_layers = 4; /* the read-ahead takes arena blocks of the layers not attended next */
	struct synth_options so;
	synth_options_default(&so);
	so.dtype = DT_F32;
	ck_assert_msg(synth_write(fx.dir, &cfg, &so, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(manifest_load(fx.dir, &fx.m, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(memory_source_create(fx.m, &fx.ms, err, sizeof(err)) == 0, "%s", err);
	/* The fewest blocks each cache runs with, and 16 more to share: most of the KV lives in the store
	 * and comes back when attended, and a sequence computed alone has room for the read-ahead (the
	 * next layer's blocks come back while this one is attended). */
	uint32_t total = SEQS * kv_cache_min_blocks(cfg.n_layers, BT, CHUNK) + 16;
	ck_assert_int_eq(kv_arena_create(total, &fx.arena), 0);
	struct backend_params bp = {.max_chunk = CHUNK, .block_tokens = BT, .n_kv_blocks = total,
				    .kv_dtype = DT_F32, .threads = 2};
	ck_assert_msg(backend_create("cpu", &fx.m->cfg, &bp, &fx.be, err, sizeof(err)) == 0, "%s", err);
	fx.st.block_bytes = backend_kv_block_bytes("cpu", &fx.m->cfg, &bp);
	fx.st.mem = malloc(STORE_BLOCKS * fx.st.block_bytes);
	ck_assert_ptr_nonnull(fx.st.mem);
	ck_assert_msg(engine_create(&fx.m->cfg, fx.be, memory_source_base(fx.ms), NULL, CHUNK, &fx.e, err,
				    sizeof(err)) == 0, "%s", err);
	fx.vocab = fx.m->cfg.vocab_size;
	for (uint32_t s = 0; s < SEQS; s++)
		for (uint32_t i = 0; i < CONTEXT; i++)
			fx.tok[s][i] = (int32_t)((i * 37 + s * 101 + 11) % 500 + 1);
}

static void teardown(void)
{
	for (uint32_t s = 0; s < SEQS; s++)
		for (uint32_t k = 0; k <= DECODE; k++)
			free(fx.want[s][k]);
	engine_destroy(&fx.e);
	kv_arena_destroy(&fx.arena);
	backend_destroy(&fx.be);
	memory_source_destroy(&fx.ms);
	manifest_destroy(&fx.m);
	free(fx.st.mem);
	th_rmtree(fx.dir);
}

/* Sequence s's next piece of work: a prefill chunk, or one decode token; 0 tokens once done. */
struct cursor {
	uint32_t pos;	 /* positions computed */
	uint32_t outs;	 /* outputs produced */
};

static uint32_t next_piece(uint32_t s, const struct cursor *c, bool *out)
{
	uint32_t end = prompt_len[s] + DECODE;
	if (c->pos >= end)
		return 0;
	if (c->pos < prompt_len[s]) {
		uint32_t n = prompt_len[s] - c->pos < chunk_of[s] ? prompt_len[s] - c->pos : chunk_of[s];
		*out = c->pos + n == prompt_len[s];
		return n;
	}
	*out = true;
	return 1;
}

/* Each sequence alone, through the engine's one-sequence call: the logits to match. */
static void compute_alone(void)
{
	char err[256];
	for (uint32_t s = 0; s < SEQS; s++) {
		struct kv_cache *kv = cache();
		engine_set_kv(fx.e, kv);
		struct cursor c = {0};
		bool out;
		for (uint32_t n; (n = next_piece(s, &c, &out)) != 0; c.pos += n) {
			float *logits = out ? (fx.want[s][c.outs++] = malloc(fx.vocab * sizeof(float))) : NULL;
			int rc = engine_forward(fx.e, fx.tok[s] + c.pos, n, c.pos, logits);
			ck_assert_msg(rc == 0, "sequence %u alone at %u: %s", s, c.pos, engine_error(fx.e));
		}
		ck_assert_uint_eq(c.outs, DECODE + 1);
		struct kv_cache_stats ks;
		kv_cache_get_stats(kv, &ks);
		fx.alone_readahead += ks.readahead_blocks;
		ck_assert_int_eq(kv_cache_reset(kv), 0);
		kv_cache_destroy(&kv);
	}
	(void)err;
}

START_TEST(test_batched_equals_alone)
{
	compute_alone();
	struct kv_cache *kv[SEQS];
	for (uint32_t s = 0; s < SEQS; s++)
		kv[s] = cache();
	struct cursor c[SEQS] = {{0}};
	float *logits = malloc((size_t)SEQS * fx.vocab * sizeof(float));
	ck_assert_ptr_nonnull(logits);
	/* Sequence s joins at step join[s]; a step takes each joined sequence's next piece, round robin
	 * from a rotating start, while the CHUNK budget lasts. */
	static const uint32_t join[SEQS] = {0, 0, 3, 5};
	uint32_t steps = 0, batched = 0;
	struct kv_stats_sum { uint64_t fetched, committed, readahead; } sum = {0};
	for (;; steps++) {
		struct engine_seq sq[SEQS];
		uint32_t who[SEQS], n_seqs = 0, budget = CHUNK, n_out = 0;
		for (uint32_t k = 0; k < SEQS; k++) {
			uint32_t s = (k + steps) % SEQS;
			bool out;
			uint32_t n = steps >= join[s] ? next_piece(s, &c[s], &out) : 0;
			if (!n || n > budget)
				continue;
			budget -= n;
			who[n_seqs] = s;
			sq[n_seqs++] = (struct engine_seq){.kv = kv[s], .tokens = fx.tok[s] + c[s].pos, .n = n,
							   .pos0 = c[s].pos, .out = out};
		}
		if (!n_seqs) {
			bool done = true;
			for (uint32_t s = 0; s < SEQS; s++)
				done = done && c[s].pos == prompt_len[s] + DECODE;
			if (done)
				break;
			continue; /* a sequence that has not joined yet */
		}
		batched += n_seqs > 1;
		int rc = engine_forward_batch(fx.e, sq, n_seqs, logits);
		ck_assert_msg(rc == 0, "step %u: %s", steps, engine_error(fx.e));
		for (uint32_t k = 0; k < n_seqs; k++) {
			uint32_t s = who[k];
			if (sq[k].out) {
				const float *want = fx.want[s][c[s].outs++];
				ck_assert_msg(memcmp(logits + (size_t)n_out * fx.vocab, want, fx.vocab * sizeof(float)) == 0,
					      "step %u: sequence %u at position %u batched with %u others differs from alone",
					      steps, s, sq[k].pos0 + sq[k].n - 1, n_seqs - 1);
				n_out++;
			}
			c[s].pos += sq[k].n;
		}
	}
	for (uint32_t s = 0; s < SEQS; s++) {
		ck_assert_uint_eq(c[s].outs, DECODE + 1);
		struct kv_cache_stats ks;
		kv_cache_get_stats(kv[s], &ks);
		sum.fetched += ks.fetched;
		sum.committed += ks.committed;
		sum.readahead += ks.readahead_blocks;
		ck_assert_int_eq(kv_cache_reset(kv[s]), 0);
		kv_cache_destroy(&kv[s]);
	}
	/* The steps did hold several sequences, and the KV did go through the store and come back. */
	ck_assert_uint_ge(batched, 5);
	ck_assert_uint_gt(sum.committed, 0);
	ck_assert_uint_gt(sum.fetched, 0);
	ck_assert_uint_gt(sum.readahead + fx.alone_readahead, 0);
	ck_assert_uint_eq(refs_held(&fx.st), 0);
	if (getenv("PIPELINE_TEST_VERBOSE"))
		printf("%u steps, %u with several sequences; %llu blocks committed, %llu fetched back (%llu by the "
		       "read-ahead; %llu in the runs alone)\n", steps, batched, (unsigned long long)sum.committed,
		       (unsigned long long)sum.fetched, (unsigned long long)sum.readahead,
		       (unsigned long long)fx.alone_readahead);
	free(logits);
}
END_TEST

START_TEST(test_batch_refusals)
{
	struct kv_cache *a = cache(), *b = cache();
	float *logits = malloc((size_t)2 * fx.vocab * sizeof(float));
	ck_assert_ptr_nonnull(logits);
	struct engine_seq sq[2] = {{.kv = a, .tokens = fx.tok[0], .n = 4, .pos0 = 0, .out = true},
				   {.kv = a, .tokens = fx.tok[1], .n = 4, .pos0 = 0, .out = true}};
	ck_assert_int_eq(engine_forward_batch(fx.e, sq, 2, logits), -EINVAL);
	ck_assert_ptr_nonnull(strstr(engine_error(fx.e), "share one KV cache"));
	sq[1].kv = b;
	ck_assert_int_eq(engine_forward_batch(fx.e, sq, 2, NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(engine_error(fx.e), "nowhere to put them"));
	sq[1].n = CHUNK;
	ck_assert_int_eq(engine_forward_batch(fx.e, sq, 2, logits), -EINVAL);
	ck_assert_ptr_nonnull(strstr(engine_error(fx.e), "a step takes"));
	ck_assert_int_eq(engine_forward_batch(fx.e, sq, 0, logits), -EINVAL);
	sq[1].n = 4;
	ck_assert_msg(engine_forward_batch(fx.e, sq, 2, logits) == 0, "%s", engine_error(fx.e));
	ck_assert_int_eq(kv_cache_reset(a), 0);
	ck_assert_int_eq(kv_cache_reset(b), 0);
	kv_cache_destroy(&a);
	kv_cache_destroy(&b);
	free(logits);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("batch");
	TCase *tc = tcase_create("engine");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_batched_equals_alone);
	tcase_add_test(tc, test_batch_refusals);
	suite_add_tcase(s, tc);
	SRunner *sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

/* engine.h - one forward step over the model, group by group: the orchestration that is
 * the same for every backend and every weight source.
 *
 *   struct engine *e;
 *   rc = engine_create(cfg, be, weights, kv, max_chunk, &e, err, sizeof(err));
 *   rc = engine_forward(e, tokens, n, pos0, logits);   // logits: vocab floats, or NULL
 *
 * For each group it acquires the weights, computes, and releases them, so a weight source
 * that streams groups sees exactly one acquire/release pair per group per step, in visit
 * order (embed, attn 0, ffn 0, ..., head).
 */
#ifndef GPU_RUNNER_ENGINE_H
#define GPU_RUNNER_ENGINE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/kv_cache.h"
#include "services/gpu-runner/sampler.h"
#include "services/gpu-runner/weights.h"
#ifdef __cplusplus
extern "C" {
#endif

struct engine;

/* Borrows every argument; they must outlive the engine. Returns 0 or -errno with err set. */
int engine_create(const struct model_config *cfg, struct backend *be,
		  struct weight_source *weights, struct kv_cache *kv, uint32_t max_chunk, struct engine **out,
		  char *err, size_t errlen);
void engine_destroy(struct engine **e);

/* Runs tokens[0..n) at positions pos0.. through the model (n <= max_chunk). With logits
 * non-NULL, writes the last token's vocab_size logits there. Returns 0 or -errno; the
 * message is in engine_error(). */
int engine_forward(struct engine *e, const int32_t *tokens, uint32_t n, uint32_t pos0, float *logits);

/* One sequence of a batched step (engine_forward_batch): tokens[0..n) at positions pos0.., its KV in
 * its own cache (over its own range of the backend's arena, kv_cache.h); out: its last row's logits
 * are wanted (a decode step, or a prompt's last chunk). */
struct engine_seq {
	struct kv_cache *kv;
	const int32_t *tokens;
	uint32_t n, pos0;
	bool out;
};

/* Several sequences in one step: every product over all their tokens (at most max_chunk in all),
 * attention over each one's own KV. logits receives vocab_size floats for each sequence with out, in
 * the order given (NULL when none has out). A sequence's numbers do not depend on what else is in
 * the step. Needs a backend that batches sequences (backend_batches_sequences) unless n_seqs is 1,
 * and a model computed by one runner. Returns 0 or -errno; the message is in engine_error(). */
int engine_forward_batch(struct engine *e, const struct engine_seq *seqs, uint32_t n_seqs, float *logits);
/* The same, but each sequence with out gets its next token picked where the logits are
 * (backend_logits_pick_rows): picks and tokens hold one entry per such sequence, in order. Only
 * the tokens cross the bus. -ENOTSUP unless engine_picks_rows. */
int engine_forward_batch_pick(struct engine *e, const struct engine_seq *seqs, uint32_t n_seqs,
			      const struct backend_pick *picks, int32_t *tokens);
/* Can engine_forward_batch_pick run here (a backend that picks rows, a model computed by one runner)? */
bool engine_picks_rows(const struct engine *e);

/* The KV cache the one-sequence calls use (engine_forward..., restore_prefix, seq_end, kv_recover): a
 * scheduler of several sequences points the engine at one before such calls. */
void engine_set_kv(struct engine *e, struct kv_cache *kv);

/* The same, for greedy decoding: only the id of the largest logit comes back (computed on the
 * device where the backend can, so the vocabulary never crosses the bus). */
int engine_forward_greedy(struct engine *e, const int32_t *tokens, uint32_t n, uint32_t pos0, int32_t *token);

/* The same, drawing the next token where the logits are (backend.h, logits_sample) with the
 * uniform u. Returns -ENOTSUP when the backend cannot (the caller samples on the host). */
int engine_forward_sample(struct engine *e, const int32_t *tokens, uint32_t n, uint32_t pos0,
			  const struct sampler_params *sp, double u, int32_t *token);
/* Can the backend draw tokens itself? */
bool engine_samples_on_device(const struct engine *e);
/* The routing of decode steps (a token a sequence) since the engine was made: routed (n_layers,
 * n_experts) counts the steps whose routing chose each expert (a step of several sequences counts
 * an expert once if any of them chose it), steps (n_layers) the decode steps through each layer;
 * both NULL for a model without experts. The counts a plan of the experts kept resident reads. */
void engine_moe_routing(const struct engine *e, const uint32_t **routed, const uint32_t **steps);

/* Longest time between one decode step's return and the next one's start that counts as the host's
 * time between them (engine_step_stats.between_ms); longer, the steps are apart (between requests). */
#define ENGINE_STEPS_APART_MS 50
/* A decode step's start on the host, by part: from the step's call through its first layer's
 * attention to its FFN's (a router's) first call, where the host first waits on the GPU (a
 * mixture of experts) or goes on to launch the rest. */
enum engine_begin_part {
	BEGIN_EMBED = 0,  /* the embedding: its acquire, gather and release */
	BEGIN_ATTN_ACQUIRE, /* the first attention group's acquire */
	BEGIN_ATTN_LAUNCH,  /* its KV rows placed and its first kernels launched (attn_begin) */
	BEGIN_ATTEND,	    /* the attention over the KV blocks (kv_cache_attend) */
	BEGIN_ATTN_END,	    /* the output projection, the layer's KV finished */
	BEGIN_FFN_ACQUIRE,  /* the attention group's release and the FFN group's acquire */
	ENGINE_BEGIN_PARTS
};

/* Decode steps (one token a sequence) with an output since the engine was made: how many and their
 * time in the engine (from the step's start to its output in host memory: the weights' calls, the
 * launches, the waits for the device), the host's time between one's return and the next one's
 * start where they follow within ENGINE_STEPS_APART_MS (the token's pick, the request's
 * bookkeeping, its messages): what a decode token costs beyond its steps; and their starts by part. */
struct engine_step_stats {
	uint64_t steps;
	double step_ms;
	uint64_t betweens;
	double between_ms;
	uint64_t begins;		       /* decode steps whose start was timed */
	double begin_ms[ENGINE_BEGIN_PARTS]; /* summed over them */
};
/* The parts' names (stats keys). */
extern const char *const engine_begin_part_names[ENGINE_BEGIN_PARTS];
void engine_step_stats(const struct engine *e, struct engine_step_stats *out);

uint32_t engine_max_chunk(const struct engine *e);
const struct model_config *engine_config(const struct engine *e);
struct kv_cache *engine_kv(struct engine *e);
struct weight_source *engine_weights(struct engine *e);
/* Splits the FFN of every layer l with r[l] < ffn_dim (n_layers values; a multiple of
 * ffn_split_unit of its down_proj's format) at r[l] for steps of at most max_tokens tokens
 * (<= FFN_SPLIT_MAX_TOKENS), the second share on the CPU (backend.h, FFN_SPLIT_CPU), where the
 * weight source hands the group over whole; NULL r: no split (the default). Only for a backend
 * that reads weights in host memory (the C backend; with CUDA the GPU window splits). Returns 0,
 * or -EINVAL / -ENOTSUP / -ENOMEM with a message in err. */
int engine_set_ffn_split(struct engine *e, const uint32_t *r, uint32_t max_tokens, char *err, size_t errlen);

/* ---- a model whose layers are split across runners (stages/stages.h) ----
 * Each runner's engine computes the groups of its weight source's stage (weights.h, ws->stage) and
 * hands the hidden state on where its layers end; the first stage also embeds and computes the head.
 * The ops move the rows and keep the other stages in step. */
struct engine_stage_ops {
	/* The first stage: a step of n tokens at pos0 begins (out: the head follows, so the last stage sends
	 * its last row back). The other stages are told. */
	int (*begin)(void *ctx, const int32_t *tokens, uint32_t n, uint32_t pos0, bool out);
	/* A later stage, before its first layer: the previous stage's rows in (backend_hidden_in with b). */
	int (*take)(void *ctx, struct backend *be, const struct backend_batch *b);
	/* After the stage's last layer: its n rows on to the next stage (the last stage: with out, the last
	 * row back to the first). */
	int (*pass)(void *ctx, struct backend *be, uint32_t n, bool out);
	/* The first stage, with out, before the head: the last stage's row in as row n - 1, once every stage
	 * has computed the step. */
	int (*back)(void *ctx, struct backend *be, uint32_t n);
	/* The sequence, on the other stages (generate.c's KV calls): restore at most limit positions of
	 * tokens[0..n) (seed names the model's blocks), giving the fewest any stage restored; end it; drop
	 * what is held of it after the kv-store failed it. */
	int (*restore)(void *ctx, const int32_t *tokens, uint32_t n, uint32_t limit, uint64_t seed, uint32_t *restored);
	int (*end)(void *ctx);
	int (*recover)(void *ctx);
	/* The first stage's step failed here (err says why) after begin: the other stages stop waiting
	 * for its rows. May be NULL. */
	void (*abort)(void *ctx, const char *why);
	const char *(*error)(void *ctx);
};

/* Sets the ops of a split model (NULL: one runner computes every layer). Borrows both. */
void engine_set_stages(struct engine *e, const struct engine_stage_ops *ops, void *ctx);
/* A later stage's step: tokens[0..n) at positions pos0.. through its layers, the rows taken from the
 * previous stage and passed to the next (out: as engine_stage_ops.pass). Returns 0 or -errno with the
 * message in engine_error(). */
int engine_forward_stage(struct engine *e, const int32_t *tokens, uint32_t n, uint32_t pos0, bool out);

/* The KV of the sequence, on every stage (generate.c; without stages, the KV cache's own calls).
 * restore_prefix: kv_cache_restore_prefix of seq's first n_prompt positions, agreed among the stages
 * (the fewest any restored): the positions restored, or -errno with the message in engine_error().
 * seq_end: kv_cache_reset, and the stages end the sequence. kv_recover: kv_cache_recover, and the
 * stages drop theirs. */
int engine_restore_prefix(struct engine *e, const int32_t *seq, uint32_t n_prompt, uint64_t seed);
int engine_seq_end(struct engine *e);
int engine_kv_recover(struct engine *e);

/* fn(ctx) is called once per layer of every step (the runner beats its heartbeat there: a step
 * over a large model takes long). NULL: none. */
void engine_set_progress(struct engine *e, void (*fn)(void *ctx), void *ctx);
/* Experts a mixture-of-experts layer's route leaves for the CPU (weight_source.route's on_cpu):
 * given to the backend right after the route (early) or at their place in the visit (the
 * default). Their sum is the same either way. */
void engine_set_cpu_experts_early(struct engine *e, bool early);
const char *engine_error(const struct engine *e);

#ifdef __cplusplus
}
#endif
#endif

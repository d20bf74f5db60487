/* generate.h - the generation loop: prefill the prompt in chunks, then sample one token at
 * a time until a stop condition, handing each token out as soon as it exists.
 *
 * Stops: max_new tokens ("length"), a stop id — the model's end-of-sequence ids and the
 * request's own — ("stop"; the stop token is emitted, as transformers does), the context
 * full ("context"), the emit callback saying a stop string appeared ("stop_string") or that
 * the client is gone ("cancelled").
 *
 * A repetition penalty (transformers' RepetitionPenaltyLogitsProcessor) applies before
 * sampling, greedy included: the logit of every token already in the sequence (prompt and
 * generated) is divided by the penalty if positive, multiplied by it if negative.
 *
 * KV blocks are named after the sequence (kv_seed != 0): the prompt's longest prefix that the
 * kv-store holds is restored rather than computed. When the store fails a request in the middle
 * (a block failed its checksum and was dropped, the kv-store restarted), on_kv_failure lets the
 * caller reconnect, the cache is rebuilt (what the store still holds, the rest computed on the
 * same chunk grid as before) and the step runs again: the tokens are those of an undisturbed
 * run. After GEN_MAX_REBUILDS the request fails.
 */
#ifndef GPU_RUNNER_GENERATE_H
#define GPU_RUNNER_GENERATE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/sampler.h"
#ifdef __cplusplus
extern "C" {
#endif

enum gen_emit {
	GEN_CONTINUE = 0,
	GEN_CANCEL = 1,	     /* the client is gone: reason "cancelled" */
	GEN_STOP_STRING = 2, /* a stop string appeared: reason "stop_string" */
};

/* Called with each new token (index counts from 0). */
typedef enum gen_emit (*gen_emit_fn)(void *ctx, uint32_t index, int32_t token);
/* Called once with the logits of the last prompt position (vocab_size floats). -ECANCELED: the
 * client went away, and the request ends "cancelled" with no token, as GEN_CANCEL ends it; another
 * non-zero return: the request fails with that -errno. */
typedef int (*gen_logits_fn)(void *ctx, uint32_t position, const float *logits, uint32_t n);

#define GEN_MAX_REBUILDS 8

struct gen_params {
	uint32_t max_new;
	struct sampler_params sampling;
	float repetition_penalty; /* <= 0 or 1: off */
	const int32_t *stop_ids;  /* extra stop ids, may be NULL */
	uint32_t n_stop;
	bool ignore_eos;	  /* do not stop on the model's eos ids */
	gen_logits_fn on_logits;  /* may be NULL */
	void (*on_decode)(void *ctx); /* may be NULL: called once, when prefill is done */
	/* May be NULL: a request to the kv-store failed; reconnect if it restarted. Non-zero
	 * return: the request fails with that -errno (err set). */
	int (*on_kv_failure)(void *ctx, char *err, size_t errlen);
	uint64_t kv_seed;	  /* names the model and KV format in block keys; 0: no keys, no reuse */
	/* A resumed request (MSG_GENERATE's done): the n_done tokens it generated before it was cut
	 * off. Their KV is restored or computed as the first run computed it (prompt
	 * positions on the chunk grid, generated ones one at a time), the sampler skips their draws,
	 * and generation goes on from index n_done; max_new and n_generated count them. A request that
	 * had ended (max_new reached, a stop id or stop string last) ends at once with that reason. */
	const int32_t *done;
	uint32_t n_done;	  /* <= max_new: a request cut off after its last token ends at once */
	bool done_stop_string;	  /* done's text already holds a stop string: the request ends at once */
};

struct gen_result {
	uint32_t n_prompt, n_generated;
	const char *reason; /* "length", "stop", "stop_string", "context", "cancelled" */
	double prefill_ms, decode_ms;
	uint32_t n_restored; /* prompt positions restored from the kv-store, not computed */
	uint32_t n_rebuilds; /* times the KV cache was rebuilt after the kv-store failed a request */
};

/* ---- one sequence a step at a time: the state of a generation that a scheduler of several
 * sequences drives (several of them in one engine step, engine_forward_batch) ----
 *
 *   gen_seq_create(e, kv, prompt, n, max_context, &params, host_logits, emit, ctx, &g, err, len);
 *   while (!gen_seq_done(g)) {
 *       n = gen_seq_piece(g, budget, &piece);      // the tokens it computes next (0: none)
 *       ... a step that computes piece (with others); its logits if piece.out ...
 *       gen_seq_advance(g, n, logits, -1, err, len);  // sample, emit, decide what comes next
 *   }                                              // (a step failed on the KV: gen_seq_recover, retry)
 *   gen_seq_finish(&g, ok, &res, err, len);        // the KV handed back, the result
 *
 * generate_run is that loop for one sequence alone (gen_seq_step: one engine step, with the
 * device's argmax or draw where it can). The sequence's KV is in kv (the engine's single-sequence
 * calls are pointed at it, engine_set_kv, whenever the state uses them: the prefix restored at
 * create, a resume's cache, a rebuild, the end). */
struct gen_seq;

/* Checks the request, restores the prompt's cached prefix (or a resume's cache) and makes the
 * state. host_logits: every step brings the logits to the host; else greedy and plain sampling
 * take the device's argmax or draw (gen_seq_step, gen_seq_device_pick). Returns 0 with *out
 * set (maybe done already: a resume cut after its last token), or -errno with err set, *out NULL
 * when nothing was made, else a done state to finish. */
int gen_seq_create(struct engine *e, struct kv_cache *kv, const int32_t *prompt, uint32_t n_prompt,
		   uint32_t max_context, const struct gen_params *p, bool host_logits, gen_emit_fn emit, void *ctx,
		   struct gen_seq **out, char *err, size_t errlen);
/* The next piece to compute, at most max_tokens tokens (a prefill chunk on the cold run's grid,
 * cut to fit, or the one token of a decode step); its out says whether the step must give its last
 * row's logits. Returns its tokens, 0 when done (or max_tokens 0). */
uint32_t gen_seq_piece(struct gen_seq *g, uint32_t max_tokens, struct engine_seq *piece);
/* Can the token after the next piece be picked where the logits are (engine_forward_batch_pick)?
 * True for a decode step that is greedy, or a plain draw on a backend that samples, of a state made
 * without host_logits; *pick is then what to pick with (the draw's uniform is drawn ahead, so a step
 * that brings the logits to the host after all draws with the same one). */
bool gen_seq_device_pick(const struct gen_seq *g, struct backend_pick *pick);
/* The piece's n tokens were computed: logits (vocab floats, host; the sampler may change them) when
 * its out was set, or token >= 0 when the device picked the next token. Emits the next token and
 * decides whether the sequence goes on. Returns 0 or -errno with err set. */
int gen_seq_advance(struct gen_seq *g, uint32_t n, float *logits, int32_t token, char *err, size_t errlen);
/* A step with the piece failed and kv_cache_remote_failed(its kv): reconnect (on_kv_failure),
 * rebuild the KV before the piece; the piece is then computed again. Returns 0 or -errno. */
int gen_seq_recover(struct gen_seq *g, char *err, size_t errlen);
/* One engine step of the sequence alone (its next piece), as generate_run runs it. */
int gen_seq_step(struct gen_seq *g, char *err, size_t errlen);
bool gen_seq_done(const struct gen_seq *g);
/* Ends it: the KV cache reset (blocks handed back to the store; ok: a store that went away just
 * now is waited for, see generate_run), the result into *res (may be NULL), the state freed and *g
 * NULL. Returns 0 or -errno with err set when ok. */
int gen_seq_finish(struct gen_seq **g, bool ok, struct gen_result *res, char *err, size_t errlen);

/* Does token tok end a run of params p (one of the model's end-of-sequence ids, unless
 * p->ignore_eos, or one of p's stop ids)? */
bool gen_is_stop(const struct model_config *cfg, const struct gen_params *p, int32_t tok);

/* Runs one sequence from position 0. The KV cache is reset at the end (also on failure).
 * Returns 0, or -errno with a message in err (bad prompt, a failed step). */
int generate_run(struct engine *e, const int32_t *prompt, uint32_t n_prompt, uint32_t max_context,
		 const struct gen_params *p, gen_emit_fn emit, void *ctx, struct gen_result *res, char *err,
		 size_t errlen);

#ifdef __cplusplus
}
#endif
#endif

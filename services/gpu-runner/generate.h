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
/* Called once with the logits of the last prompt position (vocab_size floats). Non-zero
 * return: the request fails with that -errno. */
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

/* Runs one sequence from position 0. The KV cache is reset at the end (also on failure).
 * Returns 0, or -errno with a message in err (bad prompt, a failed step). */
int generate_run(struct engine *e, const int32_t *prompt, uint32_t n_prompt, uint32_t max_context,
		 const struct gen_params *p, gen_emit_fn emit, void *ctx, struct gen_result *res, char *err,
		 size_t errlen);

#ifdef __cplusplus
}
#endif
#endif

/* generate.h - the generation loop: prefill the prompt in chunks, then sample one token at
 * a time until a stop condition, handing each token out as soon as it exists.
 *
 * Stops: max_new tokens ("length"), a stop id — the model's end-of-sequence ids and the
 * request's own — ("stop"; the stop token is emitted, as transformers does), the context
 * full ("context"), or the emit callback asking to stop ("cancelled").
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

struct gen_params {
	uint32_t max_new;
	struct sampler_params sampling;
	const int32_t *stop_ids; /* extra stop ids, may be NULL */
	uint32_t n_stop;
	bool ignore_eos;	 /* do not stop on the model's eos ids */
};

struct gen_result {
	uint32_t n_prompt, n_generated;
	const char *reason; /* "length", "stop", "context", "cancelled" */
	double prefill_ms, decode_ms;
};

/* Called with each new token (index counts from 0). Return non-zero to stop. */
typedef int (*gen_emit_fn)(void *ctx, uint32_t index, int32_t token);

/* Runs one sequence from position 0. The KV cache is reset at the end (also on failure).
 * Returns 0, or -errno with a message in err (bad prompt, a failed step). */
int generate_run(struct engine *e, const int32_t *prompt, uint32_t n_prompt, uint32_t max_context,
		 const struct gen_params *p, gen_emit_fn emit, void *ctx, struct gen_result *res, char *err,
		 size_t errlen);

#ifdef __cplusplus
}
#endif
#endif

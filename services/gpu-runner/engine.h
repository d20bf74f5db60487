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

/* The same, for greedy decoding: only the id of the largest logit comes back (computed on the
 * device where the backend can, so the vocabulary never crosses the bus). */
int engine_forward_greedy(struct engine *e, const int32_t *tokens, uint32_t n, uint32_t pos0, int32_t *token);

/* The same, drawing the next token where the logits are (backend.h, logits_sample) with the
 * uniform u. Returns -ENOTSUP when the backend cannot (the caller samples on the host). */
int engine_forward_sample(struct engine *e, const int32_t *tokens, uint32_t n, uint32_t pos0,
			  const struct sampler_params *sp, double u, int32_t *token);
/* Can the backend draw tokens itself? */
bool engine_samples_on_device(const struct engine *e);

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

/* fn(ctx) is called once per layer of every step (the runner beats its heartbeat there: a step
 * over a large model takes long). NULL: none. */
void engine_set_progress(struct engine *e, void (*fn)(void *ctx), void *ctx);
const char *engine_error(const struct engine *e);

#ifdef __cplusplus
}
#endif
#endif

/* stages.h - a model's layers split across several runners, one per GPU: the stages.
 *
 * Rank 0 (the service "gpu-runner") embeds the tokens, computes layers [0, k1) and the head, and serves
 * MSG_GENERATE as one runner alone does; rank r (the service "gpu-runner-r") computes layers
 * [k_r, k_{r+1}) and serves only rank 0. Every runner holds the weights (weights.h, weight_stage) and
 * the KV (kv_cache.h, layer0/layer1) of its own layers, from the one ssd-loader and kv-store.
 *
 * The first runner's side, the front (this file, front.c), forms the ranks into a formation: it asks
 * each rank for its process (HELLO), lays out the link (link.h) and sends MSG_STAGE_SETUP with the
 * rank's layers (plan.h), the link, and a kv-store session all ranks share, new with every formation
 * (so a formation's KV references are dropped together when the next one starts). A rank that
 * restarted, or a link that broke, makes the front form again before the next request; a request in
 * flight then fails with a message naming the stage.
 *
 * A forward step (engine.h, engine_stage_ops): the front tells every rank (MSG_STAGE_STEP: the tokens,
 * their positions, whether the head follows), computes its layers, and passes its rows on; each rank
 * takes the rows of the one before, computes its layers and passes them on; for a step with a head, the
 * last rank sends its last row back, and the front waits for every rank's MSG_STAGE_DONE before the
 * head. A step without a head (a prefill chunk before the last) is not waited for: the next chunk
 * starts on rank 0 while rank 1 computes this one.
 * The sequence's KV calls (restore, end, recover) go to every rank as MSG_STAGE_SEQ.
 *
 * No wait may close a cycle through the kv-store, which waits on each commit's CUDA event before it
 * answers anyone else (kv_remote.h). Two rules keep it open:
 *  - a later rank holds its commits back until its step has computed (kv_remote.defer_commits): its
 *    events follow the rows of the ranks before it, whose host may be waiting for the kv-store;
 *  - rank 0 sends step c + 1 only once every rank has answered step c - 1 (STAGE_STEPS_AHEAD): its
 *    events of step c + 1 follow its send of step c, which completes once the next rank has posted
 *    the receive, and a rank posts it as the first thing of a step, so it needs no kv-store reply. 
 *
 * A later rank's side is the runner's (stage.c): it answers the three messages.
 */
#ifndef GPU_RUNNER_STAGES_STAGES_H
#define GPU_RUNNER_STAGES_STAGES_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/bus.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/stages/link.h"
#include "services/gpu-runner/stages/plan.h"
#ifdef __cplusplus
extern "C" {
#endif

#define STAGE_STEPS_AHEAD 2 /* steps a rank may have unanswered, the one just sent included */

struct stage_front;

struct stage_front_params {
	const char *instance, *run_dir;
	void *zctx;
	const char *link;	      /* "shm" or "nccl" */
	const struct stage_plan *plan; /* the ranks and their layers (copied) */
	struct backend *be;	      /* rank 0's, for the link */
	const char *backend;	      /* its name: every rank computes alike */
	uint64_t manifest_hash;
	uint32_t dim, max_chunk, block_tokens, kv_dtype, max_context;
	int timeout_ms;
	bool (*wait_hook)(void *ctx); /* every wait beats through it; true: the runner is stopping */
	void *wait_ctx;
	/* Called with a new formation's kv-store session before the ranks are told it: rank 0 says HELLO
	 * to the kv-store with it (dropping what the formation before held). Returns 0 or -errno, err set. */
	int (*kv_session)(void *ctx, uint64_t session, char *err, size_t errlen);
};

int stage_front_create(const struct stage_front_params *p, struct stage_front **out, char *err, size_t errlen);
void stage_front_destroy(struct stage_front **f);

/* Forms the ranks if they are not formed (or a rank's process changed, or the link broke), waiting up
 * to deadline_ms for them to answer. Returns 0 (formed), or -errno with err naming the stage. */
int stage_front_form(struct stage_front *f, int deadline_ms, char *err, size_t errlen);
bool stage_front_formed(const struct stage_front *f);
/* Gives the formation up (a failed request): the ranks' waits end, and the next request forms anew. */
void stage_front_break(struct stage_front *f, const char *why);
/* The backend's hidden state moved (a new backend): the link reads it from now on. */
void stage_front_set_backend(struct stage_front *f, struct backend *be);

/* The engine's ops for rank 0 (ctx: the front). */
extern const struct engine_stage_ops stage_front_ops;

/* The stats as a JSON object's members (no braces), appended to buf. */
void stage_front_stats(const struct stage_front *f, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif

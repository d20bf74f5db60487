/* weights_ring.h - the weight source over the ssd-loader's shared-memory ring.
 *
 *   struct ring_source *rs;
 *   rc = ring_source_create(loader_client, &hello_reply, timeout_ms, NULL, NULL, NULL, &rs, err, sizeof(err));
 *   struct weight_source *ws = ring_source_base(rs);   // give it to the engine
 *   if (!ring_source_owner_alive(rs)) ... the loader restarted: destroy and create again
 *   ring_source_destroy(&rs);
 *
 * At creation it maps the ring, copies and checks the loader's tables (config, tensors,
 * groups: another process wrote them, so nothing is trusted unchecked), and acquires the
 * groups it keeps for good: all of them when the loader holds the whole model, else the
 * globals (embed and head) and the groups the loader pins. Streamed groups are acquired one at a time (but a layer's chosen
 * experts, asked for together at its routing: ring_route); a release is held back and sent with
 * the next acquire, so a streamed group costs one round trip.
 *
 * The loader going away in the middle of a step (kill -9, a restart) is survived: every grant
 * records the loader (HELLO epoch, ring mapping) it came from. Before each acquire, and every
 * 100 ms while waiting for a grant, the source checks that the process that laid out the ring
 * is alive. When it is not, the grants it made are dropped without a release (its successor
 * never made them; releasing them is refused), the source says HELLO to the loader that now
 * answers (waiting up to 30 s), maps its ring, checks that it lays the model out the same way,
 * acquires the groups kept for good again and asks again for the group the step needs. The
 * bytes are the checkpoint's either way, so the step finishes with the same result.
 *
 * The gone loader's ring (unlinked, but its tmpfs pages are freed only when the last mapping
 * goes) stays mapped only while something may still read it: the caller unmaps it with
 * ring_source_trim_retired() once nothing it holds reads it any more (the runner: at the end of
 * a step on the CPU path; the GPU window: once its copies from it have completed). A retired
 * ring that a stale grant still points into is kept. Mapping hooks let a GPU window page-lock a
 * new ring when it is mapped and undo that before a retired one is unmapped.
 * ring_source_reconnected() still tells the caller to make a new source at the next request.
 */
#ifndef GPU_RUNNER_WEIGHTS_RING_H
#define GPU_RUNNER_WEIGHTS_RING_H
#include <stdbool.h>
#include <stddef.h>

#include "common/bus.h"
#include "services/gpu-runner/weights.h"
#ifdef __cplusplus
extern "C" {
#endif

struct ring_source;

/* Borrows loader (it must outlive the source). hello is the loader's HELLO reply. stage (NULL: every
 * group) says which groups it serves (weights.h; a split stage with layer0 == layer1 and not first:
 * none yet). wait_hook (may be NULL) runs between the slices of every wait for the loader, the first
 * acquire of the groups kept for good included (ring_source_set_wait_hook). Returns 0 or -errno with
 * err set. */
int ring_source_create(struct rpc_client *loader, const struct msg_hello_reply *hello, int timeout_ms,
		       const struct weight_stage *stage, bool (*wait_hook)(void *ctx), void *wait_ctx,
		       struct ring_source **out, char *err, size_t errlen);
/* Releases every grant (best effort) and unmaps. Safe on NULL; NULLs *rs. */
void ring_source_destroy(struct ring_source **rs);

struct weight_source *ring_source_base(struct ring_source *rs);
/* Serves only stage's groups from now on (weights.h; a split stage): groups kept for good outside it
 * go back to the loader, those it adds are acquired. Call between steps, with no group acquired.
 * Returns 0 or -errno with err set. */
int ring_source_set_stage(struct ring_source *rs, const struct weight_stage *stage, char *err, size_t errlen);
/* Called every 100 ms while the source waits for the loader (a grant, a loader to come back):
 * the runner beats its heartbeat there. Returning true gives the wait up (the runner is
 * stopping): the acquire fails with -ECANCELED. */
void ring_source_set_wait_hook(struct ring_source *rs, bool (*fn)(void *ctx), void *ctx);
/* on_map(ctx, base, size) runs when the source maps the ring of a loader that took over in the
 * middle of a step (before grants from it are used); on_unmap(ctx, base, size) runs right before
 * ring_source_trim_retired unmaps a retired ring. NULLs clear them. The GPU window sets them
 * (cudaHostRegister / cudaHostUnregister) and clears them when destroyed. */
void ring_source_set_mapping_hooks(struct ring_source *rs, void (*on_map)(void *ctx, void *base, size_t size),
				   void (*on_unmap)(void *ctx, void *base, size_t size), void *ctx);
/* The mapping grants come from: 0 at creation, +1 at each move to a new loader's ring. Right
 * after a successful acquire, the group's bytes lie in the mapping of this generation. */
uint32_t ring_source_generation(const struct ring_source *rs);
/* Rings of gone loaders still mapped. */
uint32_t ring_source_n_retired(const struct ring_source *rs);
/* Unmaps every retired ring that no stale grant points into (on_unmap first). The caller
 * vouches that nothing it does reads a retired ring except through grants it still holds: no
 * computation and no copy in flight from it. Returns how many were unmapped. */
uint32_t ring_source_trim_retired(struct ring_source *rs);
/* Did the source move to a new loader in the middle of a step? Destroy it and create a new one
 * when convenient (between requests): a fresh source and GPU window for the new loader. */
bool ring_source_reconnected(const struct ring_source *rs);
/* Is the process that laid out the ring still its live owner? */
bool ring_source_owner_alive(const struct ring_source *rs);
uint64_t ring_source_manifest_hash(const struct ring_source *rs);
bool ring_source_all_resident(const struct ring_source *rs);
/* Host address of the slot holding group g, which must be held (acquired). Tensors lie at
 * their slot_offset from it; the group's slot_bytes are contiguous from there. */
const void *ring_source_group_base(const struct ring_source *rs, uint32_t group);
/* How many groups of size class c the loader can hold at once beyond the ones it keeps
 * pinned: the grants a client may hold of streamed groups of that class without starving the
 * loader. UINT32_MAX when every group is resident. */
uint32_t ring_source_streaming_slots(const struct ring_source *rs, uint32_t c);
/* Expert groups acquired together at their layer's routing, ahead of the engine's acquires (all time). */
uint64_t ring_source_experts_ahead(const struct ring_source *rs);
/* Is group g held by the loader for good (pinned, or the whole model resident)? */
bool ring_source_group_pinned(const struct ring_source *rs, uint32_t g);
/* The DRAM tier's cost per token as the loader planned and measured it: bytes read from disk
 * per pass over the model (0 when everything is resident) and the disk's bandwidth (0 unknown). */
void ring_source_disk_plan(const struct ring_source *rs, uint64_t *bytes_per_token, uint64_t *bytes_per_s);
/* The whole mapping (to pin it for DMA). */
void ring_source_mapping(const struct ring_source *rs, void **base, size_t *size);
/* The tokenizer.json the loader put in the ring: *data and *len (NULL/0 when the model has none).
 * The bytes stay valid while the source lives. */
void ring_source_tokenizer(const struct ring_source *rs, const char **data, size_t *len);
/* The chat template the loader put in the ring (Jinja text, not NUL-terminated): *data and *len
 * (NULL/0 when the model has none). Valid while the source lives. */
void ring_source_chat_template(const struct ring_source *rs, const char **data, size_t *len);
/* Counts a computed token in the ring header (for inspection). */
void ring_source_count_token(struct ring_source *rs);
/* How long to wait for the loader's replies from now on (live tuning of --timeout-ms). */
void ring_source_set_timeout(struct ring_source *rs, int timeout_ms);

#ifdef __cplusplus
}
#endif
#endif

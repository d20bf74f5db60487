/* kv_cache.h - the runner's KV blocks: an arena in the backend's memory (the GPU KV tier)
 * under --kv-gpu-budget, with the kv-store pool behind it.
 *
 * Every layer's context is cut into blocks of block_tokens positions. A block the current
 * chunk writes, and any block not yet full, always sits in the arena. When a block fills up
 * it is committed to the kv-store (write-behind: copied into a pool block, then
 * MSG_KV_COMMIT), after which its arena block may be reused. Attention visits a layer's
 * blocks in position order; a block no longer in the arena is fetched back from the pool
 * (which brings it back from the spill file if it went there) before it is needed.
 * Because the visit order never changes, the result is the same whatever the budget.
 *
 * Read-ahead (where the backend has kv_prefetch_n: the CUDA backend's KV H2D stream; the C
 * backend copies at once): when a layer is attended, the blocks of the next layer (the first
 * layer after the last one: the next step's) that only the store holds are pinned in the pool
 * and their copies queued on that stream, so they move while the compute stream works through
 * this layer; the next layer waits for them, then unpins. It takes arena blocks only from other
 * layers and leaves room for what the current layer and the next chunk still need; blocks it
 * could not place come back synchronously when their layer is attended. Its blocks cannot be
 * evicted before their layer ran.
 *
 * Eviction picks the committed block whose layer is needed furthest in the future (layers
 * are visited in a cycle), so the layers about to run keep their blocks.
 *
 * Without a remote (kv_remote == NULL: the in-process oracle) nothing is committed and the
 * arena must hold the whole context; running out is an error.
 *
 * One cache holds one sequence. The sequences of a batch each have their own cache, all over one
 * shared arena (struct kv_arena): a block holds a block of one cache's sequence, and any cache may
 * take a committed block of another when it needs room (as from its own: the layer needed furthest
 * ahead first), so a sequence alone has the whole arena. Each names the rows of the step its tokens
 * are (set_rows) for its spans. The caches share the backend and the store, whose unpin_all drops
 * every cache's pins; the read-ahead leaves room for every cache's next step.
 *
 * Prefix reuse: every full block is named by a key, a hash chain over the sequence's token ids
 * up to the block's end (seeded with the model's manifest hash) and the layer; the key goes with
 * the commit. A new sequence whose prompt starts like an earlier one asks the store for those
 * keys (kv_cache_restore_prefix) and computes only what follows the longest prefix every layer
 * has: the blocks come back from whichever tier holds them, the same bytes as computed. The
 * arena is the first of those tiers: a free arena block remembers the key of the committed
 * block it last held, and a restored block found there is used in place.
 *
 *   kv_cache_set_sequence(kv, tokens, &n);                      // the sequence so far (grows)
 *   reused = kv_cache_restore_prefix(kv, n_prompt);             // positions not to compute
 *   kv_cache_prepare(kv, layer, pos0, n, dst_block, dst_row);   // before attn_begin
 *   kv_cache_attend(kv, layer, pos0 + n);                      // between attn_begin and attn_end
 *   kv_cache_finish_layer(kv, layer, pos0, pos0 + n);          // after attn_end
 *   kv_cache_reset(kv);                                        // end of a sequence
 */
#ifndef GPU_RUNNER_KV_CACHE_H
#define GPU_RUNNER_KV_CACHE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "services/gpu-runner/backend.h"
#ifdef __cplusplus
extern "C" {
#endif

/* The KV tier behind the arena: the kv-store pool. Every function returns 0 or -errno with
 * a message available through error(). Pointers are host memory of block_bytes. */
struct kv_remote_ops {
	/* n new blocks, pinned for writing: handles and where to write them. */
	int (*alloc)(void *ctx, uint32_t n, uint64_t *handles, void **ptrs);
	/* Commits n blocks whose bytes are at ptrs: in place already (event NULL), or once the CUDA
	 * IPC event whose handle (KV_EVENT_HANDLE_BYTES) is at event completes. keys[i] names
	 * block i for prefix reuse (0: unnamed). */
	int (*commit)(void *ctx, uint32_t n, const uint64_t *handles, void *const *ptrs, const uint64_t *keys,
		      const void *event);
	/* Pins n committed blocks in host memory and says where they are. */
	int (*fetch)(void *ctx, uint32_t n, const uint64_t *handles, void **ptrs);
	int (*unpin)(void *ctx, uint32_t n, const uint64_t *handles);
	int (*release)(void *ctx, uint32_t n, const uint64_t *handles); /* drops our reference */
	/* Looks up committed blocks by key: handles[i] is the block with keys[i], referenced for
	 * us, or 0 when the store has none. May be NULL (no prefix reuse). */
	int (*lookup)(void *ctx, uint32_t n, const uint64_t *keys, uint64_t *handles);
	/* Drops every pin the store holds for us. May be NULL. */
	int (*unpin_all)(void *ctx);
	/* Most blocks one alloc or fetch may ask for (the pool's size). */
	uint32_t (*max_batch)(void *ctx);
	const char *(*error)(void *ctx);
};

struct kv_cache_params {
	uint32_t n_layers;    /* the model's */
	uint32_t layer0, layer1; /* the layers whose KV the cache holds, [layer0, layer1) (a stage of a model
				  * split across runners); 0, 0: all */
	uint32_t block_tokens;
	uint32_t max_context; /* positions per sequence */
	uint32_t max_chunk;   /* most tokens one forward step writes */
	uint32_t n_arena;     /* blocks in the backend's arena (without an arena below) */
	struct kv_arena *arena; /* the arena's blocks, shared with the caches of the other sequences of a batch
				 * (kv_arena_create; borrowed: it outlives the cache); NULL: the cache's own */
	bool commits_held;    /* the remote holds commits back until the step's end (kv_remote.h,
			       * defer_commits): the read-ahead does not reach round to the next step's
			       * first layer, whose blocks this step committed only on the runner's side */
};

struct kv_cache_stats {
	uint64_t committed; /* blocks copied to the pool */
	uint64_t fetched;   /* blocks copied back from the pool */
	uint64_t evicted;   /* arena blocks reused for another block */
	uint64_t prefix_positions; /* positions restored from the store instead of computed */
	uint64_t prefix_lookups;   /* sequences that asked */
	uint64_t prefix_on_gpu;	   /* restored blocks still in the arena: no copy needed */
	uint64_t recoveries;	   /* times the KV was rebuilt after the store failed a request */
	uint64_t fetch_runs;	   /* runs of blocks fetched (one request and one wait each) */
	uint64_t fetch_ns;	   /* in those requests */
	uint64_t copy_ns;	   /* in their copies into the arena (queued and waited for) */
	uint64_t readahead_blocks;  /* of fetched: brought back by the read-ahead */
	uint64_t readahead_wait_ns; /* waiting for the read-ahead's copies */
	uint64_t fetch_cuts;	    /* fetches the store's full pool refused whole, asked again in halves */
};

struct kv_cache;
struct kv_arena;

/* A table of n_blocks arena blocks that several caches share (kv_cache_params.arena). Returns 0 or
 * -ENOMEM. Destroy it after every cache over it. */
int kv_arena_create(uint32_t n_blocks, struct kv_arena **out);
void kv_arena_destroy(struct kv_arena **a);

/* Fewest arena blocks that can run (for each cache over a shared arena): one partial block per layer, the blocks one chunk
 * writes, and one to bring blocks back through. */
uint32_t kv_cache_min_blocks(uint32_t n_layers, uint32_t block_tokens, uint32_t max_chunk);

/* Returns 0 or -errno with a message in err (-ENOSPC: n_arena below the minimum). The
 * backend be must have been created with n_kv_blocks >= p->n_arena. */
int kv_cache_create(const struct kv_cache_params *p, struct backend *be,
		    const struct kv_remote_ops *remote, void *remote_ctx, struct kv_cache **out, char *err,
		    size_t errlen);
void kv_cache_destroy(struct kv_cache **kv);

int kv_cache_prepare(struct kv_cache *kv, uint32_t layer, uint32_t pos0, uint32_t n, uint32_t *dst_block,
		     uint32_t *dst_row);
/* The rows of the step the sequence's tokens are (a batch of several sequences: its run), which
 * kv_cache_attend's spans name; n_rows 0 (the default): every row. */
void kv_cache_set_rows(struct kv_cache *kv, uint32_t row0, uint32_t n_rows);
int kv_cache_attend(struct kv_cache *kv, uint32_t layer, uint32_t pos_end);
int kv_cache_finish_layer(struct kv_cache *kv, uint32_t layer, uint32_t pos0, uint32_t pos_end);
/* The token ids of the sequence: *n of them at tokens (both may grow; read when keys are
 * needed). seed names the model (its manifest hash), so keys of two models never meet. */
void kv_cache_set_sequence(struct kv_cache *kv, const int32_t *tokens, const uint32_t *n, uint64_t seed);

/* Restores the longest prefix of the sequence's first n_prompt - 1 positions whose blocks the
 * store holds for every layer (at least one prompt position is always left to compute, for its
 * logits). Returns the positions restored (a multiple of block_tokens, 0 when none or without a
 * store that looks up), or -errno. The arena must be empty (a fresh sequence). */
int kv_cache_restore_prefix(struct kv_cache *kv, uint32_t n_prompt);

/* Drops our reference to every remote block and empties the arena. A block the store no
 * longer knows (dropped after a failed checksum) is skipped. When the store cannot be told
 * (it went away), nothing is forgotten and kv_cache_remote_failed() is true: after the caller
 * reconnected, kv_cache_recover hands the blocks back (a store that restarted adopted them);
 * kv_cache_forget_remote gives up on them. */
int kv_cache_reset(struct kv_cache *kv);
/* Whether a request to the store failed since the last reset (the error says which). */
bool kv_cache_remote_failed(const struct kv_cache *kv);
/* Whether the cache forgot the store's blocks of a sequence in the middle of its run
 * (kv_cache_forget_remote: the store lost its pool): until a reset, the sequence must be rebuilt. */
bool kv_cache_lost(const struct kv_cache *kv);
/* After such a failure (the store dropped a block that failed its checksum, or restarted and
 * the caller reconnected): drops our pins and our references, empties the arena. The caller
 * then restores the prefix the store still has and computes the rest again. */
int kv_cache_recover(struct kv_cache *kv);
/* Waits for the read-ahead's copies out of the pool and forgets their pins (the caller drops
 * them with the store's unpin_all, or the store is gone): before the pool is unmapped or
 * unregistered. Returns 0 or -errno. NULL is allowed. */
int kv_cache_quiesce(struct kv_cache *kv);
/* Forgets remote handles without freeing them (the kv-store lost its pool, or cannot be told):
 * an empty cache, as after kv_cache_reset. */
void kv_cache_forget_remote(struct kv_cache *kv);

void kv_cache_get_stats(const struct kv_cache *kv, struct kv_cache_stats *st);
/* Adds kv's counters to *sum (the caches of the requests of a batch, counted together). */
void kv_cache_add_stats(const struct kv_cache *kv, struct kv_cache_stats *sum);
/* For inspection (stats, once a second): arena blocks in use, and per layer (arrays of
 * n_layers; either may be NULL) the sequence's blocks in the arena and those held only by the
 * store. O(n_arena + n_layers * blocks per layer). */
void kv_cache_usage(const struct kv_cache *kv, uint32_t *arena_used, uint32_t *arena_per_layer,
		    uint32_t *store_per_layer);
const char *kv_cache_error(const struct kv_cache *kv);

#ifdef __cplusplus
}
#endif
#endif

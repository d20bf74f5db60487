/* kv_cache_internal.h - the KV cache's tables and the arena they share, for kv_cache.c (a
 * sequence's blocks: where each lies, the store's copies, the read-ahead) and kv_arena.c (which
 * arena block a KV block takes: the victim policy). Not for use outside those two. */
#ifndef GPU_RUNNER_KV_CACHE_INTERNAL_H
#define GPU_RUNNER_KV_CACHE_INTERNAL_H
#include <assert.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/util.h"
#include "services/gpu-runner/kv_cache.h"

#define NO_ARENA (-1)

/* Records a message in the object and returns rc. */
#define set_err(obj, rc, ...) errorf((obj)->error, sizeof((obj)->error), rc, __VA_ARGS__)
/* The same for a failed request to the store: remembered, so the caller can tell it apart. */
#define remote_err(kv, rc, ...) ((kv)->remote_failed = true, set_err(kv, rc, __VA_ARGS__))

struct kv_entry {
	int32_t arena;	   /* arena block holding it, NO_ARENA */
	uint32_t filled;   /* positions written */
	bool committed;	   /* a pool copy exists (handle valid) */
	uint64_t handle;
	uint64_t key;	   /* its prefix key once committed, 0 when unnamed */
};

struct arena_block {
	struct kv_cache *owner; /* the cache whose block it holds, NULL when free */
	int32_t layer; /* -1 when free */
	int32_t index; /* block index within the layer */
	bool busy;     /* in use by the current step: never evicted */
	bool incoming; /* a read-ahead copy lands here and the layer has not been attended: kept */
	/* The prefix key of the committed block it holds or, once free, last held: a later
	 * sequence that restores that key finds the bytes here and copies nothing. */
	uint64_t key;
};

/* One read-ahead in flight: the blocks of a layer coming back from the pool on the backend's
 * KV H2D stream, and the pins held on their pool blocks until the copies are done. */
struct kv_readahead {
	bool active;
	uint32_t layer;
	uint32_t n;
	uint64_t *handles; /* blocks_per_layer of them */
	uint32_t *blocks;  /* the arena blocks they land in */
};

/* The backend's arena blocks, shared by the caches of the sequences that run together. */
struct kv_arena {
	uint32_t n;		  /* blocks */
	uint32_t n_free;
	uint32_t clean_hint;	  /* no block below it is free and remembers no key (arena_freed) */
	uint32_t users;		  /* caches over it */
	uint32_t live;		  /* of which hold a sequence (written since their last reset) */
	struct arena_block *b;	  /* (n) */
};

struct kv_cache {
	struct kv_cache_params p;
	struct backend *be;
	const struct kv_remote_ops *remote;
	void *rctx;
	uint32_t blocks_per_layer;
	struct kv_entry *entries;   /* n_layers * blocks_per_layer */
	struct kv_arena *A;	    /* the arena it takes blocks from */
	struct arena_block *arena;  /* A->b */
	bool own_arena;		    /* A was made for it (no params.arena) */
	bool live;		    /* holds a sequence: counted in A->live */
	/* scratch for batches */
	struct kv_span *spans;
	uint32_t row0, n_rows;	    /* kv_cache_set_rows: the spans' rows */
	uint64_t *handles;
	void **ptrs;
	uint32_t *idx;
	uint32_t *arena_idx;
	uint32_t *dst; /* arena blocks of a fetched run */
	uint32_t *victims, *rank_count; /* take_arena_n's scratch */
	uint64_t *keys;
	struct kv_cache_stats stats;
	/* The sequence, for keys. */
	const int32_t *seq;
	const uint32_t *seq_n;
	uint64_t seed;
	uint64_t *chain;	/* chain[j]: hash of tokens [0, (j+1) * block_tokens), when known */
	uint32_t chain_known;	/* chain[0 .. chain_known) are computed */
	bool remote_failed;	/* a request to the store failed since the last reset */
	bool lost;		/* forgot what the store held of the sequence (forget_remote): to rebuild */
	bool readahead;		/* the backend copies on a stream of its own and there is a store */
	struct kv_readahead ra[2];
	char error[512];
};

static inline struct kv_entry *entry(struct kv_cache *kv, uint32_t layer, uint32_t index)
{
	assert(layer < kv->p.n_layers && index < kv->blocks_per_layer);
	return &kv->entries[(size_t)layer * kv->blocks_per_layer + index];
}

/* The table entry of the block an arena block holds (a->layer >= 0): its owner's. */
static inline struct kv_entry *held_entry(const struct arena_block *a)
{
	return entry(a->owner, (uint32_t)a->layer, (uint32_t)a->index);
}

/* ---- kv_arena.c ---------------------------------------------------------------------------- */

/* Block b of A became free (whatever key it remembers): the clean hint may have to come down. */
void kv_arena_freed(struct kv_arena *A, uint32_t b);
/* How much arena block a is worth giving up while `current` is computed (victim policy; -1: it
 * cannot go). */
int kv_arena_victim_rank(const struct kv_cache *kv, const struct arena_block *a, uint32_t current, uint32_t visit,
			 int32_t keep_a, int32_t keep_b);
/* Arena blocks that could take another block now, counted up to `enough`. */
uint32_t kv_arena_room(const struct kv_cache *kv, uint32_t current, uint32_t visit, int32_t keep_a, int32_t keep_b,
		       uint32_t enough);
/* Gives arena block b to (layer, index) of kv, evicting what it held. */
void kv_arena_assign(struct kv_cache *kv, uint32_t b, uint32_t layer, uint32_t index);
/* Takes arena blocks for blocks idx[0..n) of `target`, best victims first; out[i] receives the
 * block for idx[i], marked busy. 0 or -ENOSPC (nothing taken). */
int kv_arena_take_for(struct kv_cache *kv, uint32_t layer, uint32_t visit, int32_t keep_a, int32_t keep_b,
		      uint32_t target, const uint32_t *idx, uint32_t n, uint32_t *out);
/* kv_arena_take_for `layer` itself. */
int kv_arena_take(struct kv_cache *kv, uint32_t layer, uint32_t visit, const uint32_t *idx, uint32_t n,
		  uint32_t *out);
/* Hands arena block b back as free (it holds nothing valid). */
void kv_arena_drop(struct kv_cache *kv, uint32_t b);

#endif

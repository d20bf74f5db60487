/* kv_arena.c - which arena block a KV block takes (kv_cache_internal.h): the blocks of the
 * backend's arena that the caches of the sequences running together share, the victim policy
 * that picks the block to give up, and the clean hint that finds a free one without ranking the
 * whole arena. kv_cache.c keeps each sequence's tables and the store's copies. */
#include "services/gpu-runner/kv_cache_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* Block b of A became free (whatever key it remembers): the hint may have to come down. */
void kv_arena_freed(struct kv_arena *A, uint32_t b)
{
	if (b < A->clean_hint)
		A->clean_hint = b;
}

int kv_arena_create(uint32_t n_blocks, struct kv_arena **out)
{
	struct kv_arena *A = calloc(1, sizeof(*A));
	if (!A || !(A->b = calloc(n_blocks ? n_blocks : 1, sizeof(*A->b)))) {
		free(A);
		return -ENOMEM;
	}
	A->n = A->n_free = n_blocks;
	for (uint32_t i = 0; i < n_blocks; i++)
		A->b[i] = (struct arena_block){.layer = -1, .index = -1};
	*out = A;
	return 0;
}

void kv_arena_destroy(struct kv_arena **ap)
{
	if (!ap || !*ap)
		return;
	assert((*ap)->users == 0);
	free((*ap)->b);
	free(*ap);
	*ap = NULL;
}

/* How much an arena block is worth giving up while `current` is being computed and its blocks
 * below `visit` have been attended (higher: give it up sooner); -1 when it cannot go at all.
 *   free, no remembered key          n_layers + 2
 *   free, remembering a cached key   n_layers + 1
 *   committed, idle: the layer whose next use lies furthest ahead first: the current layer's
 *   blocks already attended (n_layers: next used one full cycle later), then the other layers
 *   by distance (1 .. n_layers - 1); the current layer's blocks still to attend last (0).
 * Unsaved (uncommitted), busy and incoming blocks cannot go, nor blocks of the layers keep_a and
 * keep_b (-1: none; the read-ahead keeps the layer being attended and the one it brings in). */
int kv_arena_victim_rank(const struct kv_cache *kv, const struct arena_block *a, uint32_t current, uint32_t visit,
		       int32_t keep_a, int32_t keep_b)
{
	const uint32_t L = kv->p.n_layers;
	if (a->layer < 0)
		return a->key ? (int)L + 1 : (int)L + 2;
	if (a->busy || a->incoming || a->layer == keep_a || a->layer == keep_b || !held_entry(a)->committed)
		return -1;
	/* Another sequence's block of the current layer: it may not have been attended yet (the
	 * sequences of a step attend one after another). */
	if ((uint32_t)a->layer == current)
		return a->owner == kv && (uint32_t)a->index < visit ? (int)L : 0;
	return (int)(((uint32_t)a->layer + L - current) % L);
}

/* Arena blocks that could take another block right now, counted up to `enough` (the scan stops
 * there: the callers want room for a run, not the arena's whole count). */
uint32_t kv_arena_room(const struct kv_cache *kv, uint32_t current, uint32_t visit, int32_t keep_a,
			   int32_t keep_b, uint32_t enough)
{
	uint32_t n = 0;
	for (uint32_t i = 0; i < kv->p.n_arena && n < enough; i++)
		n += kv_arena_victim_rank(kv, &kv->arena[i], current, visit, keep_a, keep_b) >= 0;
	return n;
}

/* Gives arena block b to (layer, index), evicting what it held (committed: it can come back). */
void kv_arena_assign(struct kv_cache *kv, uint32_t b, uint32_t layer, uint32_t index)
{
	struct arena_block *a = &kv->arena[b];
	if (a->layer >= 0) {
		held_entry(a)->arena = NO_ARENA;
		a->owner->stats.evicted++;
	} else {
		kv->A->n_free--;
	}
	*a = (struct arena_block){.owner = kv, .layer = (int32_t)layer, .index = (int32_t)index};
	entry(kv, layer, index)->arena = (int32_t)b;
}

/* Takes arena blocks for blocks idx[0..n) of `target`, best victims first while `layer` is
 * computed (its blocks below `visit` attended this step; keep_a, keep_b as in victim_rank), in
 * one pass over the arena; out[i] receives the block for idx[i], marked busy. Returns 0 or
 * -ENOSPC (nothing taken). */
int kv_arena_take_for(struct kv_cache *kv, uint32_t layer, uint32_t visit, int32_t keep_a, int32_t keep_b,
			  uint32_t target, const uint32_t *idx, uint32_t n, uint32_t *out)
{
	/* Free blocks remembering no key rank highest (top): when n of them lie at or after the
	 * arena's clean hint, they are the ones the two passes below take (the first n in index
	 * order), found without ranking every block of the arena. */
	if (n == 0)
		return 0;
	struct kv_arena *A = kv->A;
	uint32_t k = 0;
	for (uint32_t i = A->clean_hint; i < kv->p.n_arena && k < n; i++)
		if (kv->arena[i].layer < 0 && !kv->arena[i].key)
			kv->victims[k++] = i;
	if (k == n) {
		A->clean_hint = kv->victims[n - 1] + 1;
		for (uint32_t i = 0; i < n; i++) {
			kv_arena_assign(kv, kv->victims[i], target, idx[i]);
			kv->arena[kv->victims[i]].busy = true;
			out[i] = kv->victims[i];
		}
		return 0;
	}
	A->clean_hint = k ? kv->victims[0] : kv->p.n_arena; /* none below the first found */
	const uint32_t top = kv->p.n_layers + 2;
	uint32_t *count = kv->rank_count; /* top + 2 buckets */
	memset(count, 0, sizeof(*count) * (top + 2));
	for (uint32_t i = 0; i < kv->p.n_arena; i++) {
		int r = kv_arena_victim_rank(kv, &kv->arena[i], layer, visit, keep_a, keep_b);
		if (r >= 0)
			count[r]++;
	}
	/* Which ranks to take from: the highest until n are covered. */
	uint32_t have = 0;
	int lowest = (int)top;
	for (; lowest >= 0 && have < n; lowest--)
		have += count[lowest];
	lowest++;
	if (have < n)
		return set_err(kv, -ENOSPC,
			       "KV arena of %u blocks is exhausted: every block holds unsaved KV or is in use "
			       "(raise --kv-gpu-budget%s)",
			       kv->p.n_arena, kv->remote ? "" : ", or run with a kv-store");
	/* From the lowest rank used, only as many as still needed after the higher ranks. */
	uint32_t above = have - count[lowest], from_lowest = n - above;
	k = 0;
	for (uint32_t i = 0; i < kv->p.n_arena && k < n; i++) {
		int r = kv_arena_victim_rank(kv, &kv->arena[i], layer, visit, keep_a, keep_b);
		if (r < lowest)
			continue;
		if (r == lowest) {
			if (!from_lowest)
				continue;
			from_lowest--;
		}
		kv->victims[k++] = i;
	}
	assert(k == n);
	for (uint32_t i = 0; i < n; i++) {
		kv_arena_assign(kv, kv->victims[i], target, idx[i]);
		kv->arena[kv->victims[i]].busy = true;
		out[i] = kv->victims[i];
	}
	return 0;
}

/* take_arena_for `layer` itself. */
int kv_arena_take(struct kv_cache *kv, uint32_t layer, uint32_t visit, const uint32_t *idx, uint32_t n,
			uint32_t *out)
{
	return kv_arena_take_for(kv, layer, visit, -1, -1, layer, idx, n, out);
}

/* Hands arena block b back as free (it holds nothing valid). */
void kv_arena_drop(struct kv_cache *kv, uint32_t b)
{
	struct arena_block *a = &kv->arena[b];
	if (a->layer >= 0) {
		held_entry(a)->arena = NO_ARENA;
		kv->A->n_free++;
	}
	*a = (struct arena_block){.layer = -1, .index = -1};
	kv_arena_freed(kv->A, b);
}


/* kv_cache.c - a sequence's KV blocks (kv_cache.h): the table of where each block of each layer
 * lies (an arena block, the kv-store's pool, both), the steps' writes and attention over them, the
 * commits and fetches of the store, prefix reuse and the read-ahead. Which arena block a block
 * takes is kv_arena.c's (the victim policy); the tables both read are kv_cache_internal.h's. */
#include "services/gpu-runner/kv_cache.h"
#include "services/gpu-runner/kv_cache_internal.h"

#include "common/protocol.h"
#include "common/util.h"

#include <assert.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The backend's write-behind event is what MSG_KV_COMMIT carries to the kv-store. */
_Static_assert(BACKEND_EVENT_BYTES == KV_EVENT_HANDLE_BYTES, "a KV event handle has one size everywhere");

void kv_cache_set_rows(struct kv_cache *kv, uint32_t row0, uint32_t n_rows)
{
	kv->row0 = row0;
	kv->n_rows = n_rows;
}

uint32_t kv_cache_min_blocks(uint32_t n_layers, uint32_t block_tokens, uint32_t max_chunk)
{
	/* A chunk of n tokens starting mid-block touches ceil(n / bt) + 1 blocks. */
	return n_layers + (max_chunk + block_tokens - 1) / block_tokens + 2;
}

int kv_cache_create(const struct kv_cache_params *p, struct backend *be,
		    const struct kv_remote_ops *remote, void *remote_ctx, struct kv_cache **out, char *err,
		    size_t errlen)
{
	if (!p->n_layers || !p->block_tokens || !p->max_context || !p->max_chunk) {
		snprintf(err, errlen, "KV cache parameters must be positive");
		return -EINVAL;
	}
	uint32_t l0 = p->layer0, l1 = p->layer1 ? p->layer1 : p->n_layers;
	if (l0 >= l1 || l1 > p->n_layers) {
		snprintf(err, errlen, "KV cache layers %u..%u are not a range of the model's %u", l0, l1, p->n_layers);
		return -EINVAL;
	}
	uint32_t need = kv_cache_min_blocks(l1 - l0, p->block_tokens, p->max_chunk);
	uint32_t n_arena = p->arena ? p->arena->n : p->n_arena;
	if (remote && n_arena < need) {
		snprintf(err, errlen, "the KV arena holds %u blocks; at least %u are needed (one per layer, %u for a "
			 "chunk of %u tokens, one to fetch through)",
			 n_arena, need, need - (l1 - l0) - 1, p->max_chunk);
		return -ENOSPC;
	}
	struct kv_cache *kv = calloc(1, sizeof(*kv));
	if (!kv)
		return -ENOMEM;
	kv->p = *p;
	kv->p.layer0 = l0;
	kv->p.layer1 = l1;
	kv->be = be;
	kv->remote = remote;
	kv->rctx = remote_ctx;
	kv->blocks_per_layer = (p->max_context + p->block_tokens - 1) / p->block_tokens;
	kv->entries = calloc((size_t)p->n_layers * kv->blocks_per_layer, sizeof(*kv->entries));
	kv->A = p->arena;
	if (!kv->A) {
		if (kv_arena_create(p->n_arena, &kv->A) != 0) {
			free(kv);
			snprintf(err, errlen, "out of memory for the KV arena's table");
			return -ENOMEM;
		}
		kv->own_arena = true;
	}
	kv->A->users++;
	kv->p.n_arena = kv->A->n;
	kv->arena = kv->A->b;
	kv->spans = calloc(kv->blocks_per_layer + 1, sizeof(*kv->spans));
	kv->handles = calloc(kv->blocks_per_layer + 1, sizeof(*kv->handles));
	kv->ptrs = calloc(kv->blocks_per_layer + 1, sizeof(*kv->ptrs));
	kv->idx = calloc(kv->blocks_per_layer + 1, sizeof(*kv->idx));
	kv->arena_idx = calloc(kv->blocks_per_layer + 1, sizeof(*kv->arena_idx));
	kv->chain = calloc(kv->blocks_per_layer + 1, sizeof(*kv->chain));
	kv->dst = calloc(kv->blocks_per_layer + 1, sizeof(*kv->dst));
	kv->keys = calloc(kv->blocks_per_layer + 1, sizeof(*kv->keys));
	kv->victims = calloc(kv->blocks_per_layer + 1, sizeof(*kv->victims));
	kv->rank_count = calloc(p->n_layers + 4, sizeof(*kv->rank_count));
	for (int s = 0; s < 2; s++) {
		kv->ra[s].handles = calloc(kv->blocks_per_layer + 1, sizeof(uint64_t));
		kv->ra[s].blocks = calloc(kv->blocks_per_layer + 1, sizeof(uint32_t));
	}
	if (!kv->ra[0].handles || !kv->ra[1].handles || !kv->ra[0].blocks || !kv->ra[1].blocks ||
	    !kv->entries || !kv->spans || !kv->handles || !kv->ptrs || !kv->idx || !kv->arena_idx ||
	    !kv->chain || !kv->dst || !kv->keys || !kv->victims || !kv->rank_count) {
		kv_cache_destroy(&kv);
		snprintf(err, errlen, "out of memory for the KV tables");
		return -ENOMEM;
	}
	for (size_t i = 0; i < (size_t)p->n_layers * kv->blocks_per_layer; i++)
		kv->entries[i].arena = NO_ARENA;
	kv->readahead = remote && l1 - l0 > 1;
	*out = kv;
	return 0;
}

void kv_cache_destroy(struct kv_cache **kvp)
{
	if (!kvp || !*kvp)
		return;
	struct kv_cache *kv = *kvp;
	if (kv->A) {
		/* Its blocks go back to the arena as free (keys and all: another cache may restore them). */
		for (uint32_t i = 0; i < kv->A->n; i++)
			if (kv->A->b[i].owner == kv) {
				kv->A->b[i].owner = NULL;
				kv->A->b[i].layer = kv->A->b[i].index = -1;
				kv->A->b[i].busy = kv->A->b[i].incoming = false;
				kv->A->n_free++;
				kv_arena_freed(kv->A, i);
			}
		kv->A->users--;
		if (kv->live)
			kv->A->live--;
		if (kv->own_arena)
			kv_arena_destroy(&kv->A);
	}
	free(kv->entries);
	free(kv->spans);
	free(kv->handles);
	free(kv->ptrs);
	free(kv->idx);
	free(kv->arena_idx);
	free(kv->chain);
	free(kv->dst);
	free(kv->keys);
	free(kv->victims);
	free(kv->rank_count);
	for (int s = 0; s < 2; s++) {
		free(kv->ra[s].handles);
		free(kv->ra[s].blocks);
	}
	free(kv);
	*kvp = NULL;
}

const char *kv_cache_error(const struct kv_cache *kv)
{
	return kv->error;
}

void kv_cache_get_stats(const struct kv_cache *kv, struct kv_cache_stats *st)
{
	*st = kv->stats;
}

void kv_cache_add_stats(const struct kv_cache *kv, struct kv_cache_stats *sum)
{
	const struct kv_cache_stats *one = &kv->stats;
	sum->committed += one->committed;
	sum->fetched += one->fetched;
	sum->evicted += one->evicted;
	sum->prefix_positions += one->prefix_positions;
	sum->prefix_lookups += one->prefix_lookups;
	sum->prefix_on_gpu += one->prefix_on_gpu;
	sum->recoveries += one->recoveries;
	sum->fetch_runs += one->fetch_runs;
	sum->fetch_ns += one->fetch_ns;
	sum->copy_ns += one->copy_ns;
	sum->readahead_blocks += one->readahead_blocks;
	sum->readahead_wait_ns += one->readahead_wait_ns;
	sum->fetch_cuts += one->fetch_cuts;
}

void kv_cache_usage(const struct kv_cache *kv, uint32_t *arena_used, uint32_t *arena_per_layer,
		    uint32_t *store_per_layer)
{
	uint32_t used = 0;
	for (uint32_t i = 0; i < kv->p.n_arena; i++)
		used += kv->arena[i].owner == kv;
	*arena_used = used;
	for (uint32_t l = 0; l < kv->p.n_layers; l++) {
		uint32_t a = 0, s = 0;
		const struct kv_entry *e = &kv->entries[(size_t)l * kv->blocks_per_layer];
		for (uint32_t i = 0; i < kv->blocks_per_layer; i++) {
			a += e[i].arena != NO_ARENA;
			s += e[i].arena == NO_ARENA && e[i].committed;
		}
		if (arena_per_layer)
			arena_per_layer[l] = a;
		if (store_per_layer)
			store_per_layer[l] = s;
	}
}

/* Waits for every KV copy of the backend (kv_sync); a failure is the backend's, reported by
 * whatever runs next. */
static void kv_sync(struct kv_cache *kv)
{
	backend_kv_sync(kv->be);
}

/* The read-ahead of slot s is done: waits for its copies, then (unpin) lets the store have the
 * pool blocks back. On a failed wait the blocks hold nothing valid and leave the arena. */
static int readahead_finish(struct kv_cache *kv, int s, bool unpin)
{
	struct kv_readahead *r = &kv->ra[s];
	if (!r->active)
		return 0;
	r->active = false;
	uint64_t t0 = now_ns();
	int rc = backend_kv_prefetch_wait(kv->be, (uint32_t)s);
	kv->stats.readahead_wait_ns += now_ns() - t0;
	for (uint32_t i = 0; i < r->n; i++) {
		struct arena_block *a = &kv->arena[r->blocks[i]];
		if (a->owner != kv)
			continue;
		a->incoming = false;
		if (rc && a->layer == (int32_t)r->layer)
			kv_arena_drop(kv, r->blocks[i]);
	}
	if (rc)
		set_err(kv, rc, "copying KV blocks of layer %u into the arena failed: %s", r->layer, backend_error(kv->be));
	if (unpin && r->n) {
		int urc = kv->remote->unpin(kv->rctx, r->n, r->handles);
		if (urc && !rc)
			rc = remote_err(kv, urc, "unpinning KV blocks failed: %s", kv->remote->error(kv->rctx));
	}
	r->n = 0;
	return rc;
}

/* Starts bringing back the blocks of layer `next` that only the store holds, while `layer` is
 * attended up to pos_end: pins them in the pool, takes arena blocks for them (never the blocks
 * of `layer` or `next`), and queues the copies on the backend's KV H2D stream, so they run
 * while the compute stream works through `layer`. It leaves room for what `layer` must still
 * bring back itself and for the blocks the next chunk writes; what does not fit comes back
 * when `next` is attended, as without a read-ahead. Returns 0 or -errno. */
static int readahead_start(struct kv_cache *kv, uint32_t layer, uint32_t next, uint32_t pos_end)
{
	const uint32_t bt = kv->p.block_tokens;
	int s = !kv->ra[0].active ? 0 : !kv->ra[1].active ? 1 : -1;
	if (s < 0)
		return 0;
	uint32_t n_blocks = (pos_end + bt - 1) / bt;
	if (n_blocks > kv->blocks_per_layer)
		n_blocks = kv->blocks_per_layer;
	uint32_t missing = 0, wanted = 0;
	for (uint32_t j = 0; j < n_blocks; j++) {
		const struct kv_entry *e = entry(kv, layer, j), *f = entry(kv, next, j);
		missing += e->arena == NO_ARENA && e->committed;
		wanted += f->arena == NO_ARENA && f->committed;
	}
	if (!wanted)
		return 0;
	/* Room for this step's blocks of every cache over the arena (the sequences of a batch). */
	uint32_t reserve = missing + 2 * ((kv->p.max_chunk + bt - 1) / bt + 2) * (kv->A->live ? kv->A->live : 1);
	/* Room beyond the reserve for every wanted block at most. */
	uint32_t room = kv_arena_room(kv, layer, 0, (int32_t)layer, (int32_t)next, reserve + wanted);
	if (room <= reserve)
		return 0;
	room -= reserve;
	uint32_t cap = kv->remote->max_batch(kv->rctx);
	struct kv_readahead *r = &kv->ra[s];
	r->layer = next;
	r->n = 0;
	for (uint32_t j = 0; j < n_blocks && room;) {
		uint32_t run = 0;
		for (; j < n_blocks && run < room && run < cap; j++) {
			const struct kv_entry *f = entry(kv, next, j);
			if (f->arena == NO_ARENA && f->committed) {
				kv->idx[run] = j;
				kv->handles[run] = f->handle;
				run++;
			}
		}
		if (!run)
			break;
		uint64_t t0 = now_ns();
		int rc = kv->remote->fetch(kv->rctx, run, kv->handles, kv->ptrs);
		kv->stats.fetch_ns += now_ns() - t0;
		if (rc == -ENOSPC) /* the store's pool cannot take them now (others pin it): no read-ahead */
			break;
		if (rc)
			return remote_err(kv, rc, "fetching %u KV blocks of layer %u from the kv-store failed: %s", run, next,
					  kv->remote->error(kv->rctx));
		rc = kv_arena_take_for(kv, layer, 0, (int32_t)layer, (int32_t)next, next, kv->idx, run, kv->dst);
		if (rc == 0)
			rc = backend_kv_prefetch(kv->be, run, kv->dst, (const void *const *)kv->ptrs, (uint32_t)s);
		if (rc) {
			/* Nothing of this batch landed (or it may not have): undo it, keep what came before. */
			bool taken = entry(kv, next, kv->idx[0])->arena != NO_ARENA;
			for (uint32_t i = 0; i < run && taken; i++)
				kv_arena_drop(kv, kv->dst[i]);
			kv_sync(kv); /* copies a failed call left queued still read the pool blocks */
			kv->remote->unpin(kv->rctx, run, kv->handles);
			if (rc == -ENOSPC) /* the room was counted: cannot happen; go on without */
				break;
			return set_err(kv, rc, "copying KV blocks into the arena failed: %s", backend_error(kv->be));
		}
		for (uint32_t i = 0; i < run; i++) {
			struct arena_block *a = &kv->arena[kv->dst[i]];
			a->incoming = true;
			a->busy = false;
			a->key = entry(kv, next, kv->idx[i])->key;
			r->handles[r->n] = kv->handles[i];
			r->blocks[r->n] = kv->dst[i];
			r->n++;
		}
		r->active = true;
		room -= run;
		kv->stats.readahead_blocks += run;
		kv->stats.fetched += run;
	}
	return 0;
}

/* Before attending `layer`: read-aheads for other layers are finished (a step that stopped
 * early left them), the next layer's is started, then this layer's is waited for. */
static int readahead_step(struct kv_cache *kv, uint32_t layer, uint32_t pos_end)
{
	int rc = 0;
	for (int s = 0; s < 2 && rc == 0; s++)
		if (kv->ra[s].active && kv->ra[s].layer != layer)
			rc = readahead_finish(kv, s, true);
	if (rc == 0 && (layer + 1 < kv->p.layer1 || !kv->p.commits_held))
		rc = readahead_start(kv, layer, layer + 1 < kv->p.layer1 ? layer + 1 : kv->p.layer0, pos_end);
	for (int s = 0; s < 2; s++)
		if (kv->ra[s].active && kv->ra[s].layer == layer) {
			int frc = readahead_finish(kv, s, true);
			if (frc && !rc)
				rc = frc;
		}
	return rc;
}

/* Waits for every read-ahead; unpin: hands their pins back (else the caller drops all pins). */
static int readahead_drain(struct kv_cache *kv, bool unpin)
{
	int rc = 0;
	for (int s = 0; s < 2; s++) {
		int r = readahead_finish(kv, s, unpin);
		if (r && !rc)
			rc = r;
	}
	return rc;
}

int kv_cache_quiesce(struct kv_cache *kv)
{
	if (!kv)
		return 0;
	int rc = readahead_drain(kv, false);
	kv_sync(kv);
	return rc;
}

int kv_cache_prepare(struct kv_cache *kv, uint32_t layer, uint32_t pos0, uint32_t n, uint32_t *dst_block,
		     uint32_t *dst_row)
{
	if (n == 0 || n > kv->p.max_chunk || pos0 + n > kv->p.max_context)
		return set_err(kv, -EINVAL, "chunk of %u tokens at position %u does not fit (chunk limit %u, context %u)",
			       n, pos0, kv->p.max_chunk, kv->p.max_context);
	const uint32_t bt = kv->p.block_tokens;
	if (!kv->live) {
		kv->live = true;
		kv->A->live++;
	}
	for (uint32_t i = 0; i < n; i++) {
		uint32_t pos = pos0 + i;
		uint32_t j = pos / bt;
		struct kv_entry *e = entry(kv, layer, j);
		if (e->committed)
			return set_err(kv, -EINVAL, "layer %u block %u is already full and committed; position %u "
				       "cannot be written again", layer, j, pos);
		if (e->arena == NO_ARENA) {
			if (e->filled)
				return set_err(kv, -EIO, "layer %u block %u holds unsaved KV but left the arena", layer, j);
			uint32_t a;
			int trc = kv_arena_take(kv, layer, 0, &j, 1, &a);
			if (trc < 0)
				return trc;
		}
		kv->arena[e->arena].busy = true;
		dst_block[i] = (uint32_t)e->arena;
		dst_row[i] = pos % bt;
		if (pos % bt + 1 > e->filled)
			e->filled = pos % bt + 1;
	}
	return 0;
}

/* Ends a layer's step for this cache: the blocks it marked busy since kv_cache_prepare (the ones
 * written, those attended, those fetched back) are its own entries of that layer, below n_blocks.
 * (A pass over the whole arena instead, once a layer and sequence, cost more than the step's
 * compute: 16384 blocks of an 8B model's default arena, 16 sequences, 32 layers.) */
static void clear_busy(struct kv_cache *kv, uint32_t layer, uint32_t n_blocks)
{
	const struct kv_entry *e = &kv->entries[(size_t)layer * kv->blocks_per_layer];
	if (n_blocks > kv->blocks_per_layer)
		n_blocks = kv->blocks_per_layer;
	for (uint32_t j = 0; j < n_blocks; j++)
		if (e[j].arena != NO_ARENA)
			kv->arena[e[j].arena].busy = false;
}

static int flush_spans(struct kv_cache *kv, uint32_t *n_spans)
{
	if (!*n_spans)
		return 0;
	for (uint32_t i = 0; i < *n_spans; i++) {
		kv->spans[i].row0 = kv->row0;
		kv->spans[i].n_rows = kv->n_rows;
	}
	int rc = backend_attn_blocks(kv->be, kv->spans, *n_spans);
	if (rc)
		return set_err(kv, rc, "attention failed: %s", backend_error(kv->be));
	/* Visited blocks may now make room for the ones still to come, unless unsaved. */
	for (uint32_t i = 0; i < *n_spans; i++)
		kv->arena[kv->spans[i].block].busy = false;
	*n_spans = 0;
	return 0;
}

int kv_cache_attend(struct kv_cache *kv, uint32_t layer, uint32_t pos_end)
{
	const uint32_t bt = kv->p.block_tokens;
	uint32_t n_blocks = (pos_end + bt - 1) / bt;
	uint32_t n_spans = 0, fits = UINT32_MAX;
	int rc = 0;
	if (kv->readahead && (rc = readahead_step(kv, layer, pos_end)) != 0)
		goto out;
	for (uint32_t j = 0; j < n_blocks;) {
		struct kv_entry *e = entry(kv, layer, j);
		uint32_t len = pos_end - j * bt < bt ? pos_end - j * bt : bt;
		if (e->arena != NO_ARENA) {
			kv->arena[e->arena].busy = true;
			kv->spans[n_spans++] = (struct kv_span){.block = (uint32_t)e->arena, .pos0 = j * bt, .n_tokens = len};
			j++;
			continue;
		}
		if (!e->committed || !kv->remote) {
			rc = set_err(kv, -EIO, "layer %u block %u is neither in the arena nor in the kv-store", layer, j);
			goto out;
		}
		/* Visit what is resident so far, then bring back a run of missing blocks. */
		rc = flush_spans(kv, &n_spans);
		if (rc)
			goto out;
		uint32_t cap = kv->remote->max_batch(kv->rctx);
		if (cap > fits)
			cap = fits; /* what the store's pool took after a refusal, this call */
		uint32_t room = kv_arena_room(kv, layer, j, -1, -1, cap < n_blocks - j ? cap : n_blocks - j);
		if (room > cap)
			room = cap;
		uint32_t run = 0;
		while (j + run < n_blocks && run < room) {
			struct kv_entry *m = entry(kv, layer, j + run);
			if (m->arena != NO_ARENA || !m->committed)
				break;
			kv->handles[run] = m->handle;
			kv->idx[run] = j + run;
			run++;
		}
		if (run == 0) {
			rc = set_err(kv, -ENOSPC, "no arena block free to bring layer %u block %u back (arena %u blocks)",
				     layer, j, kv->p.n_arena);
			goto out;
		}
		uint64_t t0 = now_ns();
		rc = kv->remote->fetch(kv->rctx, run, kv->handles, kv->ptrs);
		/* The store's pool could not take the whole run at once (the blocks other caches pin, those
		 * of a step being rebuilt): fewer at a time. A refusal moves nothing. */
		while (rc == -ENOSPC && run > 1) {
			run /= 2;
			fits = run;
			kv->stats.fetch_cuts++;
			rc = kv->remote->fetch(kv->rctx, run, kv->handles, kv->ptrs);
		}
		uint64_t t1 = now_ns();
		kv->stats.fetch_ns += t1 - t0;
		if (rc) {
			remote_err(kv, rc, "fetching %u KV blocks of layer %u from the kv-store failed: %s", run, layer,
				kv->remote->error(kv->rctx));
			goto out;
		}
		/* Arena blocks for the whole run (busy, so none evicts another), then the copies. */
		rc = kv_arena_take(kv, layer, j, kv->idx, run, kv->dst);
		uint32_t taken = rc ? 0 : run;
		if (rc == 0)
			rc = backend_kv_from_host(kv->be, run, kv->dst, (const void *const *)kv->ptrs);
		if (rc) {
			/* The blocks taken hold nothing valid: forget they were here. */
			for (uint32_t r = 0; r < taken; r++) {
				entry(kv, layer, kv->idx[r])->arena = NO_ARENA;
				kv->arena[kv->dst[r]] = (struct arena_block){.layer = -1, .index = -1};
				kv->A->n_free++;
				kv_arena_freed(kv->A, kv->dst[r]);
			}
			if (rc != -ENOSPC) {
				set_err(kv, rc, "copying KV blocks into the arena failed: %s", backend_error(kv->be));
				kv_sync(kv); /* before the unpin below: copies may still read the pool */
			}
		}
		kv->stats.copy_ns += now_ns() - t1;
		kv->stats.fetch_runs++;
		for (uint32_t r = 0; r < run && rc == 0; r++) {
			uint32_t bj = kv->idx[r];
			kv->arena[kv->dst[r]].key = entry(kv, layer, bj)->key;
			uint32_t blen = pos_end - bj * bt < bt ? pos_end - bj * bt : bt;
			kv->spans[n_spans++] = (struct kv_span){.block = kv->dst[r], .pos0 = bj * bt, .n_tokens = blen};
			kv->stats.fetched++;
		}
		int urc = kv->remote->unpin(kv->rctx, run, kv->handles);
		if (rc)
			goto out;
		if (urc) {
			rc = remote_err(kv, urc, "unpinning KV blocks failed: %s", kv->remote->error(kv->rctx));
			goto out;
		}
		j += run;
	}
	rc = flush_spans(kv, &n_spans);
out:
	clear_busy(kv, layer, n_blocks);
	return rc;
}

void kv_cache_set_sequence(struct kv_cache *kv, const int32_t *tokens, const uint32_t *n, uint64_t seed)
{
	kv->seq = tokens;
	kv->seq_n = n;
	kv->seed = seed;
	kv->chain_known = 0;
}

/* The key of block j of a layer, 0 when the sequence does not cover the block (or no sequence
 * was given): FNV-1a over the chain of the previous block and this block's token ids, then the
 * layer; never 0 otherwise. */
static uint64_t block_key(struct kv_cache *kv, uint32_t layer, uint32_t j)
{
	const uint32_t bt = kv->p.block_tokens;
	if (!kv->seq || !kv->seq_n || (uint64_t)(j + 1) * bt > *kv->seq_n || j >= kv->blocks_per_layer)
		return 0;
	while (kv->chain_known <= j) {
		uint32_t b = kv->chain_known;
		uint64_t h = b ? kv->chain[b - 1] : fnv1a64(FNV64_INIT, &kv->seed, sizeof(kv->seed));
		h = fnv1a64(h, kv->seq + (size_t)b * bt, sizeof(int32_t) * bt);
		kv->chain[b] = h;
		kv->chain_known++;
	}
	uint64_t k = fnv1a64(kv->chain[j], &layer, sizeof(layer));
	return k ? k : 1;
}

/* Commits blocks idx[0..n) of a layer: pool blocks, copies, then the commit. */
static int commit_batch(struct kv_cache *kv, uint32_t layer, const uint32_t *idx, uint32_t n)
{
	int rc = kv->remote->alloc(kv->rctx, n, kv->handles, kv->ptrs);
	if (rc)
		return remote_err(kv, rc, "allocating %u KV blocks in the kv-store failed: %s", n,
			       kv->remote->error(kv->rctx));
	unsigned char event[BACKEND_EVENT_BYTES];
	for (uint32_t i = 0; i < n; i++)
		kv->arena_idx[i] = (uint32_t)entry(kv, layer, idx[i])->arena;
	/* Write-behind: where the backend records an event, nobody here waits for the copies (the
	 * kv-store does). */
	rc = backend_kv_write_behind(kv->be, n, kv->arena_idx, kv->ptrs, event);
	bool async = rc == 1;
	if (async)
		rc = 0;
	if (rc) {
		set_err(kv, rc, "copying KV blocks out of the arena failed: %s", backend_error(kv->be));
		kv_sync(kv); /* some copies may be queued: the pool blocks go back once none runs */
		kv->remote->release(kv->rctx, n, kv->handles);
		return rc;
	}
	uint64_t *keys = kv->keys;
	for (uint32_t i = 0; i < n; i++)
		keys[i] = block_key(kv, layer, idx[i]);
	rc = kv->remote->commit(kv->rctx, n, kv->handles, kv->ptrs, keys, async ? event : NULL);
	if (rc) {
		remote_err(kv, rc, "committing %u KV blocks failed: %s", n, kv->remote->error(kv->rctx));
		kv_sync(kv); /* the write-behind may still be writing those pool blocks */
		kv->remote->release(kv->rctx, n, kv->handles);
		return rc;
	}
	for (uint32_t i = 0; i < n; i++) {
		struct kv_entry *e = entry(kv, layer, idx[i]);
		e->committed = true;
		e->handle = kv->handles[i];
		e->key = keys[i];
		kv->arena[e->arena].key = keys[i];
	}
	kv->stats.committed += n;
	return 0;
}

int kv_cache_finish_layer(struct kv_cache *kv, uint32_t layer, uint32_t pos0, uint32_t pos_end)
{
	if (!kv->remote)
		return 0;
	const uint32_t bt = kv->p.block_tokens;
	uint32_t n = 0;
	for (uint32_t j = pos0 / bt; j < (pos_end + bt - 1) / bt; j++) {
		struct kv_entry *e = entry(kv, layer, j);
		if (e->filled == bt && !e->committed && e->arena != NO_ARENA)
			kv->idx[n++] = j;
	}
	uint32_t cap = kv->remote->max_batch(kv->rctx);
	for (uint32_t done = 0; done < n;) {
		uint32_t k = n - done < cap ? n - done : cap;
		int rc = commit_batch(kv, layer, kv->idx + done, k);
		if (rc)
			return rc;
		done += k;
	}
	return 0;
}

/* Empties the tables. Arena blocks keep the key of the committed block they held (forget:
 * drop those too, and those of every free block, the bytes may no longer match a key the store
 * hands out). Another cache's blocks stay as they are. */
static void clear_tables(struct kv_cache *kv, bool forget)
{
	for (uint32_t i = 0; i < kv->p.n_arena; i++) {
		struct arena_block *a = &kv->arena[i];
		if (forget && !a->owner) {
			a->key = 0; /* free, but its bytes may no longer be what its key names */
			kv_arena_freed(kv->A, i);
		}
		if (a->owner != kv)
			continue;
		bool keep = !forget && a->layer >= 0 && a->key && held_entry(a)->committed;
		*a = (struct arena_block){.layer = -1, .index = -1, .key = keep ? a->key : 0};
		kv->A->n_free++;
		kv_arena_freed(kv->A, i);
	}
	for (size_t i = 0; i < (size_t)kv->p.n_layers * kv->blocks_per_layer; i++)
		kv->entries[i] = (struct kv_entry){.arena = NO_ARENA};
	if (kv->live) {
		kv->live = false;
		kv->A->live--;
	}
}

int kv_cache_reset(struct kv_cache *kv)
{
	int rc = kv->readahead ? readahead_drain(kv, true) : 0, frc = 0;
	if (kv->remote) {
		for (uint32_t l = 0; l < kv->p.n_layers; l++) {
			uint32_t n = 0;
			for (uint32_t j = 0; j < kv->blocks_per_layer; j++) {
				struct kv_entry *e = entry(kv, l, j);
				if (e->committed)
					kv->handles[n++] = e->handle;
			}
			if (!n || kv->remote->release(kv->rctx, n, kv->handles) == 0)
				continue;
			/* All or nothing failed, most likely on a block the store dropped after a bad
			 * checksum: hand the others back one by one. */
			for (uint32_t i = 0; i < n; i++) {
				int r = kv->remote->release(kv->rctx, 1, kv->handles + i);
				if (r && r != -EINVAL && !frc)
					frc = remote_err(kv, r, "freeing KV blocks failed: %s", kv->remote->error(kv->rctx));
			}
		}
	}
	if (frc)
		return frc; /* the tables stay: kv_cache_recover hands the blocks back after a reconnect */
	clear_tables(kv, false);
	kv->chain_known = 0;
	kv->remote_failed = false;
	kv->lost = false;
	return rc;
}

bool kv_cache_remote_failed(const struct kv_cache *kv)
{
	return kv->remote_failed;
}

bool kv_cache_lost(const struct kv_cache *kv)
{
	return kv->lost;
}

int kv_cache_recover(struct kv_cache *kv)
{
	/* A failed fetch may leave blocks pinned for us, and so may a read-ahead: its copies are
	 * waited for, and unpin_all drops its pins with the rest. unpin_all drops the pins of every
	 * cache over the connection: with other sequences live on the arena, only this cache's own
	 * pins go (a failed fetch's, which it does not know, stay until it runs alone). */
	bool alone = kv->A->live <= (kv->live ? 1u : 0u);
	if (kv->readahead)
		readahead_drain(kv, !alone);
	if (alone && kv->remote && kv->remote->unpin_all) {
		int r = kv->remote->unpin_all(kv->rctx);
		if (r && r != -ENOTSUP)
			return remote_err(kv, r, "dropping our pins failed: %s", kv->remote->error(kv->rctx));
	}
	kv->stats.recoveries++;
	return kv_cache_reset(kv);
}

static int cmp_keyed(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

int kv_cache_restore_prefix(struct kv_cache *kv, uint32_t n_prompt)
{
	/* The cache's own layers: keys[j * L + i] is block j of layer l0 + i. */
	const uint32_t bt = kv->p.block_tokens, l0 = kv->p.layer0, L = kv->p.layer1 - kv->p.layer0;
	if (!kv->remote || !kv->remote->lookup || !kv->seq || n_prompt < 2)
		return 0;
	uint32_t nb = (n_prompt - 1) / bt; /* full blocks before the last prompt position */
	if (nb > kv->blocks_per_layer)
		nb = kv->blocks_per_layer;
	if (nb == 0)
		return 0;
	uint64_t *keys = malloc(sizeof(uint64_t) * nb * L), *hits = calloc((size_t)nb * L, sizeof(uint64_t));
	if (!keys || !hits) {
		free(keys);
		free(hits);
		return set_err(kv, -ENOMEM, "out of memory");
	}
	for (uint32_t j = 0; j < nb; j++)
		for (uint32_t l = 0; l < L; l++)
			keys[(size_t)j * L + l] = block_key(kv, l0 + l, j);
	kv->stats.prefix_lookups++;
	int rc = kv->remote->lookup(kv->rctx, nb * L, keys, hits);
	if (rc == -ENOTSUP) { /* a store without prefix reuse */
		rc = 0;
		goto out;
	}
	if (rc) {
		remote_err(kv, rc, "looking up cached KV blocks failed: %s", kv->remote->error(kv->rctx));
		goto out;
	}
	/* The longest prefix of blocks every layer has. */
	uint32_t use = 0;
	while (use < nb) {
		bool all = true;
		for (uint32_t l = 0; l < L && all; l++)
			all = hits[(size_t)use * L + l] != 0;
		if (!all)
			break;
		use++;
	}
	/* Free arena blocks that still hold a key's bytes, sorted by key: those restored blocks
	 * need no copy at all. */
	struct keyed { uint64_t key; uint32_t block; } *held = malloc(sizeof(*held) * (kv->p.n_arena + 1));
	uint32_t n_held = 0;
	if (!held) {
		rc = set_err(kv, -ENOMEM, "out of memory");
		goto out;
	}
	for (uint32_t i = 0; i < kv->p.n_arena; i++)
		if (kv->arena[i].layer < 0 && kv->arena[i].key)
			held[n_held++] = (struct keyed){kv->arena[i].key, i};
	qsort(held, n_held, sizeof(*held), cmp_keyed);
	for (uint32_t j = 0; j < use; j++)
		for (uint32_t l = 0; l < L; l++) {
			struct kv_entry *e = entry(kv, l0 + l, j);
			uint64_t key = keys[(size_t)j * L + l];
			*e = (struct kv_entry){.arena = NO_ARENA, .filled = bt, .committed = true,
					       .handle = hits[(size_t)j * L + l], .key = key};
			struct keyed want = {key, 0}, *f = bsearch(&want, held, n_held, sizeof(*held), cmp_keyed);
			if (f && kv->arena[f->block].layer < 0 && kv->arena[f->block].key == key) {
				kv->arena[f->block] = (struct arena_block){.owner = kv, .layer = (int32_t)(l0 + l),
									   .index = (int32_t)j, .key = key};
				e->arena = (int32_t)f->block;
				kv->A->n_free--;
				kv->stats.prefix_on_gpu++;
			}
		}
	free(held);
	/* The hits past the prefix are no use: hand their references back. */
	uint32_t extra = 0;
	for (size_t i = (size_t)use * L; i < (size_t)nb * L; i++)
		if (hits[i])
			hits[extra++] = hits[i];
	if (extra && (rc = kv->remote->release(kv->rctx, extra, hits)) != 0) {
		remote_err(kv, rc, "handing back cached KV blocks failed: %s", kv->remote->error(kv->rctx));
		goto out;
	}
	kv->stats.prefix_positions += (uint64_t)use * bt;
	rc = (int)(use * bt);
out:
	free(keys);
	free(hits);
	return rc;
}

void kv_cache_forget_remote(struct kv_cache *kv)
{
	if (kv->readahead)
		readahead_drain(kv, false);
	/* A sequence in the middle of its run lost its KV with it: it must be rebuilt. */
	kv->lost = kv->live;
	clear_tables(kv, true);
	kv->chain_known = 0;
	kv->remote_failed = false;
}

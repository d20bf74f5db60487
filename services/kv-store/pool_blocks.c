/* pool_blocks.c - the kv-store pool's bookkeeping of slots and handles: the private free lists
 * rebuilt from the shared tables, the usage counters published in the header, and a block's
 * use (LRU), whether it is cached, and its retirement with the slot it held. */
#include <errno.h>
#include <stdlib.h>

#include "services/kv-store/keymap.h"
#include "services/kv-store/pool_internal.h"

void kvs_publish_usage(struct kvstore *kv)
{
	atomic_store(&kv->h->store.slots_used, (uint64_t)(kv->h->n_slots - kv->n_free_slots - kv->n_parked_slots));
	atomic_store(&kv->h->store.spill_used,
		     (uint64_t)(kv->h->n_spill_slots - kv->n_free_spill - kv->n_parked_spill));
}

/* Rebuilds the private stacks from the shared tables (pushed from the top index down so the
 * lowest index comes out first). */
int kvs_rebuild_free_lists(struct kvstore *kv)
{
	struct kvpool_header *h = kv->h;
	uint8_t *spill_busy = calloc(h->n_spill_slots ? h->n_spill_slots : 1, 1);
	if (!spill_busy)
		return -ENOMEM;
	kv->tick = 0;
	kv->n_free_handles = 0;
	for (uint32_t i = h->n_handles; i-- > 0;) {
		struct kvpool_handle *hd = &kv->handles[i];
		if (hd->state == KVH_FREE)
			kv->free_handles[kv->n_free_handles++] = i;
		else if (hd->location == KVLOC_SPILL)
			spill_busy[hd->where] = 1;
		if (hd->state != KVH_FREE && hd->last_use > kv->tick)
			kv->tick = hd->last_use;
	}
	kv->n_free_slots = 0;
	kv->n_parked_slots = kv->n_parked_spill = 0; /* parked again at the next kvs_park() */
	for (uint32_t s = h->n_slots; s-- > 0;) {
		struct kvpool_slot *sl = &kv->slots[s];
		if (atomic_load(&sl->state) == KVSLOT_FREE)
			kv->free_slots[kv->n_free_slots++] = s;
		if (sl->last_use > kv->tick)
			kv->tick = sl->last_use;
	}
	kv->n_free_spill = 0;
	for (uint32_t j = h->n_spill_slots; j-- > 0;)
		if (!spill_busy[j])
			kv->free_spill[kv->n_free_spill++] = j;
	free(spill_busy);
	kvs_publish_usage(kv);
	return 0;
}

void kvs_slot_reset(struct kvpool_slot *sl)
{
	atomic_store(&sl->state, KVSLOT_FREE);
	atomic_store_explicit(&sl->ready, 0, memory_order_relaxed);
	sl->pins = 0;
	sl->handle_index = KV_NONE;
	sl->last_use = 0;
}

void kvs_slot_release(struct kvstore *kv, uint32_t s)
{
	kvs_slot_reset(&kv->slots[s]);
	kv->free_slots[kv->n_free_slots++] = s;
}

/* A handle back to FREE: its value goes stale (generation bump; 0 is never a live generation). */
void kvs_handle_reset(struct kvpool_handle *hd)
{
	hd->state = KVH_FREE;
	hd->location = KVLOC_NONE;
	hd->where = 0;
	hd->checksum = 0;
	hd->refs = 0;
	hd->key = 0;
	hd->last_use = 0;
	hd->generation++;
	if (hd->generation == 0)
		hd->generation = 1;
}

/* Retires a handle to the free list: its value goes stale, and its key leaves the prefix index
 * if the index named it. */
static void handle_release(struct kvstore *kv, uint32_t idx)
{
	struct kvpool_handle *hd = &kv->handles[idx];
	if (hd->key && keymap_get(kv->keys, hd->key) == idx)
		keymap_del(kv->keys, hd->key);
	kvs_handle_reset(hd);
	kv->free_handles[kv->n_free_handles++] = idx;
}

/* Is idx the block the prefix index names for its key? Only such a block can be cached. */
bool kvs_indexed(const struct kvstore *kv, uint32_t idx)
{
	const struct kvpool_handle *hd = &kv->handles[idx];
	return hd->state == KVH_COMMITTED && hd->key && keymap_get(kv->keys, hd->key) == idx;
}

/* Cached: committed, indexed, no reference. Evictable, droppable, found by LOOKUP. */
bool kvs_cached(const struct kvstore *kv, uint32_t idx)
{
	return kv->handles[idx].refs == 0 && kvs_indexed(kv, idx);
}

/* A use of block idx: most recently used in whichever tier it is. */
void kvs_touch(struct kvstore *kv, uint32_t idx)
{
	struct kvpool_handle *hd = &kv->handles[idx];
	hd->last_use = ++kv->tick;
	if (hd->location == KVLOC_POOL)
		kv->slots[hd->where].last_use = hd->last_use;
}

/* Frees block idx with the pool slot or spill slot it holds, whatever its pins and refs. */
void kvs_block_retire(struct kvstore *kv, uint32_t idx)
{
	struct kvpool_handle *hd = &kv->handles[idx];
	if (hd->location == KVLOC_POOL)
		kvs_slot_release(kv, hd->where);
	else if (hd->location == KVLOC_SPILL)
		kvs_spill_slot_free(kv, hd->where);
	handle_release(kv, idx);
}

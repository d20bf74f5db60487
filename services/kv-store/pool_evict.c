/* pool_evict.c - eviction in the kv-store pool: the least recently used evictable blocks, and
 * kvs_make_room, which spills them in one batch and, when the spill file is full, drops cached
 * blocks to make room. */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/log.h"
#include "common/util.h"
#include "services/kv-store/pool_internal.h"
#include "services/kv-store/spill.h"

int kvs_victim_cmp(const void *a, const void *b)
{
	const struct victim *x = a, *y = b;
	if (x->last_use != y->last_use)
		return x->last_use < y->last_use ? -1 : 1;
	return x->id < y->id ? -1 : x->id > y->id;
}

/* Fills v (n_slots entries) with the evictable slots, least recently used first: COMMITTED,
 * unpinned and, with exclude_stamp, not holding a block the current request names. Returns
 * how many there are. */
uint32_t kvs_collect_victims(struct kvstore *kv, uint32_t exclude_stamp, struct victim *v)
{
	uint32_t nv = 0;
	for (uint32_t s = 0; s < kv->h->n_slots; s++) {
		struct kvpool_slot *sl = &kv->slots[s];
		if (atomic_load(&sl->state) != KVSLOT_COMMITTED || sl->pins != 0)
			continue;
		if (exclude_stamp && kv->mark[sl->handle_index] == exclude_stamp)
			continue;
		v[nv++] = (struct victim){.last_use = sl->last_use, .id = s};
	}
	qsort(v, nv, sizeof(*v), kvs_victim_cmp);
	return nv;
}

int kvs_pool_full(struct kvstore *kv, uint32_t evictable, uint32_t asked, char *err, size_t errlen)
{
	if (evictable == 0 && kv->n_free_slots == 0)
		snprintf(err, errlen, "KV pool full: %u blocks, all pinned", kv->h->n_slots);
	else
		snprintf(err, errlen, "KV pool full: %u blocks, %u free and %u evictable, %u needed (the rest are "
			 "pinned or named in this request)", kv->h->n_slots, kv->n_free_slots, evictable, asked);
	return -ENOSPC;
}

/* Reorders v[0..n) so that v[0..k) are its k least recently used, in order (a quickselect,
 * then a sort of those k only: with the disk full, each ALLOC drops a few of what may be tens
 * of thousands of cached blocks). */
static void lru_first(struct victim *v, uint32_t n, uint32_t k)
{
	if (k > 0 && k < n) {
		int64_t lo = 0, hi = (int64_t)n - 1, t = (int64_t)k - 1;
		while (lo < hi) {
			struct victim p = v[lo + (hi - lo) / 2];
			int64_t i = lo, j = hi;
			while (i <= j) {
				while (kvs_victim_cmp(&v[i], &p) < 0)
					i++;
				while (kvs_victim_cmp(&v[j], &p) > 0)
					j--;
				if (i <= j) {
					struct victim x = v[i];
					v[i++] = v[j];
					v[j--] = x;
				}
			}
			if (t <= j)
				hi = j;
			else if (t >= i)
				lo = i;
			else
				break;
		}
		n = k;
	}
	qsort(v, n, sizeof(*v), kvs_victim_cmp);
}

/* Fills d (n_spill_slots entries) with the cached blocks in the spill file (handle indexes),
 * leaving out those the current request names (exclude_stamp); the `want` least recently used
 * come first, in order. Returns how many there are. */
static uint32_t collect_spilled_cached(struct kvstore *kv, uint32_t exclude_stamp, uint32_t want, struct victim *d)
{
	uint32_t n = 0;
	for (uint32_t i = 0; i < kv->h->n_handles; i++) {
		const struct kvpool_handle *hd = &kv->handles[i];
		if (hd->location != KVLOC_SPILL || !kvs_cached(kv, i))
			continue;
		if (exclude_stamp && kv->mark[i] == exclude_stamp)
			continue;
		d[n++] = (struct victim){.last_use = hd->last_use, .id = i};
	}
	lru_first(d, n, want);
	return n;
}

/* Frees a cached block to make room. */
static void drop_cached(struct kvstore *kv, uint32_t idx)
{
	const struct kvpool_handle *hd = &kv->handles[idx];
	log_debug("dropping cached KV block 0x%llx (key %016llx, %s) to make room",
		  (unsigned long long)handle_value(kv, idx), (unsigned long long)hd->key,
		  hd->location == KVLOC_SPILL ? "in the spill file" : "in the pool");
	kvs_block_retire(kv, idx);
	atomic_fetch_add(&kv->h->store.cache_drops, 1);
}

/* Frees `need` slots by spilling the least-recently-used evictable blocks (see
 * kvs_collect_victims) in one io_uring batch. When the spill file lacks free slots, cached blocks
 * make room: the least recently used in the spill file are dropped first, then (when that is
 * not enough) the least recently used cached ones among the pool's victims are dropped
 * instead of spilled. The plan is checked whole before anything changes. Returns 0; -ENOSPC
 * (not enough evictable blocks, or spill slots even after every drop; nothing changed); -EIO
 * (the drops stand, the blocks whose writes succeeded are spilled, the others stay in the
 * pool); -ENOMEM. */
int kvs_make_room(struct kvstore *kv, uint32_t need, uint32_t exclude_stamp, uint32_t asked, char *err,
		  size_t errlen)
{
	struct kvpool_header *h = kv->h;
	struct victim *v = malloc(sizeof(*v) * h->n_slots);
	struct victim *sd = NULL;
	struct spill_io *ios = malloc(sizeof(*ios) * need);
	int rc = 0;
	if (!v || !ios) {
		snprintf(err, errlen, "out of memory spilling %u blocks", need);
		rc = -ENOMEM;
		goto out_free;
	}
	uint32_t nv = kvs_collect_victims(kv, exclude_stamp, v);
	if (nv < need) {
		rc = kvs_pool_full(kv, nv, asked, err, errlen);
		goto out_free;
	}
	uint32_t lack = need > kv->n_free_spill ? need - kv->n_free_spill : 0;
	uint32_t n_sd = 0, n_pd = 0; /* cached blocks to drop from the spill file, from the pool */
	if (lack) {
		sd = malloc(sizeof(*sd) * (h->n_spill_slots ? h->n_spill_slots : 1));
		if (!sd) {
			snprintf(err, errlen, "out of memory spilling %u blocks", need);
			rc = -ENOMEM;
			goto out_free;
		}
		uint32_t avail = collect_spilled_cached(kv, exclude_stamp, lack, sd);
		n_sd = lack < avail ? lack : avail;
		n_pd = lack - n_sd;
		uint32_t nc = 0;
		for (uint32_t k = 0; k < nv && nc < n_pd; k++)
			nc += kvs_cached(kv, kv->slots[v[k].id].handle_index);
		if (nc < n_pd) {
			char a[32];
			snprintf(err, errlen, "spill file %s full: %u of %u blocks of %llu bytes in use, %u more "
				 "needed, and %u cached blocks to drop (the rest are referenced); raise "
				 "--kv-disk-budget (now %s)",
				 kv->spill_path, h->n_spill_slots - kv->n_free_spill - kv->n_parked_spill,
				 h->n_spill_slots - kv->n_parked_spill, (unsigned long long)h->block_bytes, need, n_sd + nc,
				 format_size(kv->disk_limit, a, sizeof(a)));
			rc = -ENOSPC;
			goto out_free;
		}
	}
	for (uint32_t k = 0; k < n_sd; k++)
		drop_cached(kv, sd[k].id);
	/* The pool's victims: drop the n_pd least recently used cached ones, keep the rest in
	 * order (compacted to the front of v) and spill the first need - n_pd of them. */
	uint32_t m = 0;
	for (uint32_t k = 0, dropped = 0; k < nv; k++) {
		uint32_t idx = kv->slots[v[k].id].handle_index;
		if (dropped < n_pd && kvs_cached(kv, idx)) {
			drop_cached(kv, idx);
			dropped++;
			continue;
		}
		v[m++] = v[k];
	}
	uint32_t n_sp = need - n_pd;
	assert(m >= n_sp && kv->n_free_spill >= n_sp);
	for (uint32_t k = 0; k < n_sp; k++) {
		uint32_t s = v[k].id;
		/* SPILLING before the write: a crash from here on recovers the slot as COMMITTED. */
		atomic_store(&kv->slots[s].state, KVSLOT_SPILLING);
		ios[k] = (struct spill_io){.buf = slot_data(kv, s), .slot = kv->free_spill[--kv->n_free_spill],
					   .write = true};
	}
	if (n_sp)
		rc = spill_run(kv->spill, ios, n_sp, err, errlen);
	for (uint32_t k = 0; k < n_sp; k++) {
		uint32_t s = v[k].id;
		struct kvpool_slot *sl = &kv->slots[s];
		if (ios[k].res) {
			atomic_store(&sl->state, KVSLOT_COMMITTED);
			kv->free_spill[kv->n_free_spill++] = ios[k].slot;
			continue;
		}
		/* The handle moves first, the slot frees after (kvs_slot_release's atomic store orders
		 * them): recover_tables frees a SPILLING slot whose handle points into the file. */
		uint32_t idx = sl->handle_index;
		struct kvpool_handle *hd = &kv->handles[idx];
		hd->where = ios[k].slot;
		/* Kept in this order for a crash (not for another thread): "pool" with a spill
		 * index is recovered from the SPILLING slot that names the handle. */
		atomic_signal_fence(memory_order_seq_cst);
		hd->location = KVLOC_SPILL;
		kvs_slot_release(kv, s);
		kvs_index_put(kv, ios[k].slot, idx); /* after the bytes landed */
		atomic_fetch_add(&h->store.spills, 1);
		atomic_fetch_add(&h->store.spill_bytes_written, h->block_bytes);
	}
	kvs_publish_usage(kv);
out_free:
	free(ios);
	free(sd);
	free(v);
	return rc;
}

/* pool_fetch.c - MSG_KV_FETCH in the kv-store pool: pinning what is in the pool and reading the
 * spilled blocks back in batches (their checksums checked), making room as it goes, or trading
 * one through a bounce buffer when neither tier has a free slot. */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "services/kv-store/pool_internal.h"
#include "services/kv-store/spill.h"

/* A block read back from spill slot j failed its checksum: count it, log it, drop it. */
static int checksum_failed(struct kvstore *kv, uint32_t idx, uint32_t j, uint32_t crc, char *err, size_t errlen)
{
	uint64_t hv = handle_value(kv, idx);
	log_error("checksum mismatch on KV block 0x%llx read from %s at offset %llu (CRC-32C %08x, committed as "
		  "%08x): block dropped", (unsigned long long)hv, kv->spill_path,
		  (unsigned long long)j * kv->h->block_bytes, crc, kv->handles[idx].checksum);
	atomic_fetch_add(&kv->h->store.checksum_failures, 1);
	snprintf(err, errlen, "checksum mismatch on KV block 0x%llx: dropped", (unsigned long long)hv);
	assert(kv->handles[idx].location == KVLOC_SPILL && kv->handles[idx].where == j);
	kvs_block_retire(kv, idx);
	return -EIO;
}

/* Reads the spilled blocks handles[pos[0..n)] back into free slots (n <= free slots) in one
 * batch, checks their checksums and pins them. Returns 0; -EIO (err names the first failure:
 * a block that failed its checksum is dropped, one whose read failed stays in the file);
 * -ENOMEM. The blocks that made it are in the pool, pinned, offsets filled. */
static int load_batch(struct kvstore *kv, const uint64_t *handles, const uint32_t *pos, uint32_t n,
		      uint64_t *offsets, char *err, size_t errlen)
{
	struct kvpool_header *h = kv->h;
	struct spill_io *ios = malloc(sizeof(*ios) * n);
	uint32_t *slot = malloc(sizeof(*slot) * n);
	int rc = 0;
	if (!ios || !slot) {
		snprintf(err, errlen, "out of memory reading back %u blocks", n);
		rc = -ENOMEM;
		goto out_free;
	}
	assert(n <= kv->n_free_slots);
	for (uint32_t k = 0; k < n; k++) {
		struct kvpool_handle *hd = &kv->handles[kv_handle_index(handles[pos[k]])];
		uint32_t s = kv->free_slots[--kv->n_free_slots];
		struct kvpool_slot *sl = &kv->slots[s];
		/* seq odd while the bytes are rewritten; LOADING so that a crash frees the slot. */
		atomic_fetch_add(&sl->seq, 1);
		sl->handle_index = kv_handle_index(handles[pos[k]]);
		sl->pins = 0;
		atomic_store(&sl->state, KVSLOT_LOADING);
		ios[k] = (struct spill_io){.buf = slot_data(kv, s), .slot = hd->where, .write = false};
		slot[k] = s;
	}
	char ioerr[512] = "";
	spill_run(kv->spill, ios, n, ioerr, sizeof(ioerr));
	for (uint32_t k = 0; k < n; k++) {
		uint32_t i = pos[k], s = slot[k];
		uint32_t idx = kv_handle_index(handles[i]);
		struct kvpool_handle *hd = &kv->handles[idx];
		struct kvpool_slot *sl = &kv->slots[s];
		uint32_t j = hd->where;
		if (ios[k].res) {
			/* The bytes may still be good on disk: the handle stays in the spill file. */
			if (!rc)
				snprintf(err, errlen, "%s", ioerr);
			rc = -EIO;
			kvs_slot_release(kv, s);
			atomic_fetch_add(&sl->seq, 1);
			continue;
		}
		atomic_fetch_add(&h->store.spill_bytes_read, h->block_bytes);
		uint32_t crc = crc32c(0, ios[k].buf, h->block_bytes);
		if (crc != hd->checksum) {
			if (!rc)
				checksum_failed(kv, idx, j, crc, err, errlen);
			else
				checksum_failed(kv, idx, j, crc, ioerr, sizeof(ioerr));
			rc = -EIO;
			kvs_slot_release(kv, s);
			atomic_fetch_add(&sl->seq, 1);
			continue;
		}
		/* Pinned before the handle moves, the handle before the slot turns COMMITTED:
		 * recover_tables keeps a LOADING slot whose handle points at it. */
		sl->pins = 1;
		sl->last_use = hd->last_use = ++kv->tick;
		/* Location first, then where, in this order for a crash: "pool" with the spill
		 * index is recovered from the LOADING slot that names the handle, while "spill"
		 * with a pool index would point into the wrong spill slot. */
		atomic_signal_fence(memory_order_seq_cst);
		hd->location = KVLOC_POOL;
		atomic_signal_fence(memory_order_seq_cst);
		hd->where = s;
		atomic_store(&sl->state, KVSLOT_COMMITTED);
		atomic_fetch_add(&sl->seq, 1);
		kvs_spill_slot_free(kv, j);
		offsets[i] = slot_data_offset(kv, s);
	}
out_free:
	free(ios);
	free(slot);
	return rc;
}

/* The pool has no free slot and the spill file no free slot: trades the spilled block
 * handles[pos] for the least recently used evictable block through a bounce buffer (read the
 * spilled block out, write the victim into the spill slot it left, copy the block into the
 * victim's slot). Returns 0 (the block pinned, offsets[pos] filled) or -EIO/-ENOMEM. */
static int swap_in(struct kvstore *kv, const uint64_t *handles, uint32_t pos, uint32_t stamp, uint64_t *offsets,
		   char *err, size_t errlen)
{
	struct kvpool_header *h = kv->h;
	uint32_t idx = kv_handle_index(handles[pos]);
	struct kvpool_handle *hd = &kv->handles[idx];
	uint32_t j = hd->where;
	struct victim *v = malloc(sizeof(*v) * h->n_slots);
	int rc;
	if (!kv->bounce && posix_memalign(&kv->bounce, 4096, h->block_bytes) != 0)
		kv->bounce = NULL;
	if (!v || !kv->bounce) {
		snprintf(err, errlen, "out of memory reading back block 0x%llx", (unsigned long long)handles[pos]);
		rc = -ENOMEM;
		goto out_free;
	}
	if (kvs_collect_victims(kv, stamp, v) == 0) {
		/* kvstore_fetch checked there are enough; reaching this is a bug. */
		rc = kvs_pool_full(kv, 0, 1, err, errlen);
		goto out_free;
	}
	uint32_t s = v[0].id;
	struct kvpool_slot *sl = &kv->slots[s];
	uint32_t victim_idx = sl->handle_index;
	struct kvpool_handle *victim = &kv->handles[victim_idx];

	struct spill_io io = {.buf = kv->bounce, .slot = j, .write = false};
	rc = spill_run(kv->spill, &io, 1, err, errlen);
	if (rc)
		goto out_free;
	atomic_fetch_add(&h->store.spill_bytes_read, h->block_bytes);
	uint32_t crc = crc32c(0, kv->bounce, h->block_bytes);
	if (crc != hd->checksum) {
		rc = checksum_failed(kv, idx, j, crc, err, errlen);
		goto out_free;
	}
	atomic_store(&sl->state, KVSLOT_SPILLING);
	io = (struct spill_io){.buf = slot_data(kv, s), .slot = j, .write = true};
	rc = spill_run(kv->spill, &io, 1, err, errlen);
	if (rc) {
		atomic_store(&sl->state, KVSLOT_COMMITTED);
		/* The victim's failed write may have damaged spill slot j, which still holds the block
		 * asked for; its bytes are whole in the bounce buffer, so they go back there. If that
		 * write fails too, the block's checksum tells when it is read next (never a wrong byte). */
		char werr[256];
		io = (struct spill_io){.buf = kv->bounce, .slot = j, .write = true};
		if (spill_run(kv->spill, &io, 1, werr, sizeof(werr)) == 0)
			log_warn("KV block 0x%llx: written back to its spill slot after a failed write there",
				 (unsigned long long)handles[pos]);
		else
			log_warn("KV block 0x%llx: a failed write may have damaged its spill slot, and writing it back "
				 "failed too (%s); its checksum will tell",
				 (unsigned long long)handles[pos], werr);
		goto out_free;
	}
	/* j now holds the victim. A crash between these steps loses at most the block being
	 * swapped in (its bytes live only in the bounce buffer), never a wrong byte: it gives up
	 * its spill slot first, the victim takes it, and the block claims the slot only after it
	 * has been copied in full (recover_tables keeps a LOADING slot whose handle points at it
	 * and frees one whose handle does not). */
	hd->location = KVLOC_NONE;
	atomic_thread_fence(memory_order_release);
	victim->where = j;
	atomic_signal_fence(memory_order_seq_cst); /* as in kvs_make_room */
	victim->location = KVLOC_SPILL;
	kvs_index_put(kv, j, victim_idx);
	atomic_fetch_add(&h->store.spills, 1);
	atomic_fetch_add(&h->store.spill_bytes_written, h->block_bytes);
	atomic_fetch_add(&sl->seq, 1);
	sl->handle_index = idx;
	sl->pins = 0;
	atomic_store(&sl->state, KVSLOT_LOADING);
	memcpy(slot_data(kv, s), kv->bounce, h->block_bytes);
	sl->pins = 1;
	sl->last_use = hd->last_use = ++kv->tick;
	atomic_thread_fence(memory_order_release);
	hd->where = s;
	hd->location = KVLOC_POOL;
	atomic_store(&sl->state, KVSLOT_COMMITTED);
	atomic_fetch_add(&sl->seq, 1);
	offsets[pos] = slot_data_offset(kv, s);
out_free:
	free(v);
	return rc;
}

int kvstore_fetch(struct kvstore *kv, const uint64_t *handles, uint32_t n, uint64_t *offsets, char *err,
		  size_t errlen)
{
	uint32_t stamp;
	int rc = kvs_check_handles(kv, handles, n, &stamp, err, errlen);
	if (rc)
		return rc;
	struct kvpool_header *h = kv->h;
	uint32_t n_load = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t idx = kv_handle_index(handles[i]);
		const struct kvpool_handle *hd = &kv->handles[idx];
		if (hd->state != KVH_COMMITTED) {
			snprintf(err, errlen, "handle 0x%llx is not committed: it is still being written",
				 (unsigned long long)handles[i]);
			return -EINVAL;
		}
		if (hd->refs == 0) {
			snprintf(err, errlen, "handle 0x%llx holds no reference: the block is cached (MSG_KV_LOOKUP "
				 "takes a reference)", (unsigned long long)handles[i]);
			return -EINVAL;
		}
		if (hd->location == KVLOC_SPILL)
			n_load++;
	}
	uint32_t *loads = malloc(sizeof(uint32_t) * (n_load ? n_load : 1)); /* request positions */
	struct victim *v = NULL;
	if (!loads) {
		snprintf(err, errlen, "out of memory fetching %u blocks", n);
		return -ENOMEM;
	}
	kvs_park(kv);
	if (n_load > kv->n_free_slots) {
		/* All or nothing: the room must exist before anything moves. */
		v = malloc(sizeof(*v) * h->n_slots);
		if (!v) {
			snprintf(err, errlen, "out of memory fetching %u blocks", n);
			rc = -ENOMEM;
			goto out_free;
		}
		uint32_t nv = kvs_collect_victims(kv, stamp, v);
		if (nv + kv->n_free_slots < n_load)
			kvs_unpark_slots(kv, n_load - nv - kv->n_free_slots);
		if (nv + kv->n_free_slots < n_load) {
			rc = kvs_pool_full(kv, nv, n_load, err, errlen);
			goto out_free;
		}
	}
	/* Pin what is in the pool: pinned blocks are never evicted by the loads that follow. */
	uint32_t k = 0;
	for (uint32_t i = 0; i < n; i++) {
		struct kvpool_handle *hd = &kv->handles[kv_handle_index(handles[i])];
		if (hd->location == KVLOC_SPILL) {
			loads[k++] = i;
			continue;
		}
		kv->slots[hd->where].pins++;
		kvs_touch(kv, kv_handle_index(handles[i]));
		offsets[i] = slot_data_offset(kv, hd->where);
	}
	/* Read the rest back in rounds: each spills as many victims as there are free spill
	 * slots (one batch) and reads as many blocks as there are free pool slots (one batch);
	 * the blocks read free their spill slots for the next round. With neither a free pool
	 * slot nor a free spill slot, one block is swapped in through a bounce buffer. */
	for (k = 0; k < n_load && rc == 0;) {
		if (kv->n_free_slots == 0 && kv->n_free_spill == 0) {
			rc = swap_in(kv, handles, loads[k], stamp, offsets, err, errlen);
			k++;
			continue;
		}
		if (kv->n_free_slots == 0) {
			uint32_t want = n_load - k < kv->n_free_spill ? n_load - k : kv->n_free_spill;
			rc = kvs_make_room(kv, want, stamp, n_load, err, errlen);
			if (rc)
				break;
		}
		uint32_t batch = n_load - k < kv->n_free_slots ? n_load - k : kv->n_free_slots;
		rc = load_batch(kv, handles, loads + k, batch, offsets, err, errlen);
		k += batch;
	}
	if (rc) {
		/* Nothing this request pinned stays pinned; blocks read back stay in the pool. */
		for (uint32_t i = 0; i < n; i++) {
			struct kvpool_handle *hd = &kv->handles[kv_handle_index(handles[i])];
			if (hd->state == KVH_COMMITTED && hd->generation == kv_handle_generation(handles[i]) &&
			    hd->location == KVLOC_POOL && kv->slots[hd->where].pins)
				kv->slots[hd->where].pins--;
		}
		if (rc != -ENOMEM)
			rc = -EIO;
	} else {
		atomic_fetch_add(&h->store.fetches, n);
		atomic_fetch_add(&h->store.fetches_from_disk, n_load);
	}
	kvs_publish_usage(kv);
out_free:
	free(v);
	free(loads);
	return rc;
}

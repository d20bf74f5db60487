/* pool_persist.c - the kv-store pool's persistence (--persist-dir): the spill index's records
 * kept in step with the spill file, the index loaded into a fresh pool or rewritten whole, and
 * the write-out of the cached blocks at a clean stop. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "services/kv-store/keymap.h"
#include "services/kv-store/pool_internal.h"
#include "services/kv-store/spill.h"

/* ---- the on-disk index (persistence only) ---- */

static void index_failed(struct kvstore *kv, uint32_t j, int rc)
{
	if (!kv->index_failed)
		log_warn("cannot write record %u of spill index %s: %s (further failures not logged; the index is "
			 "rewritten whole at a clean stop, and checksums guard every read)", j, kvindex_path(kv->index),
			 strerror(-rc));
	kv->index_failed = true;
}

/* Spill slot j now holds block idx, whose bytes have landed: a keyed block gets a record, and
 * a slot whose record said otherwise is cleared. */
void kvs_index_put(struct kvstore *kv, uint32_t j, uint32_t idx)
{
	if (!kv->index)
		return;
	const struct kvpool_handle *hd = &kv->handles[idx];
	int rc = 0;
	if (kvs_indexed(kv, idx)) {
		struct kvindex_record r = {.in_use = 1, .checksum = hd->checksum, .key = hd->key,
					   .last_use = hd->last_use};
		rc = kvindex_set(kv->index, j, &r);
		kv->recorded[j] = 1;
	} else if (kv->recorded[j]) {
		rc = kvindex_clear(kv->index, j);
		kv->recorded[j] = 0;
	}
	if (rc)
		index_failed(kv, j, rc);
}

/* Spill slot j goes back to the free list, its record cleared first. */
void kvs_spill_slot_free(struct kvstore *kv, uint32_t j)
{
	if (kv->index && kv->recorded[j]) {
		int rc = kvindex_clear(kv->index, j);
		if (rc)
			index_failed(kv, j, rc);
		kv->recorded[j] = 0;
	}
	kv->free_spill[kv->n_free_spill++] = j;
}

/* Rewrites the whole index from the handle table: a record for each indexed block in the
 * spill file. Returns 0 or -errno (err says why). */
int kvs_index_rewrite(struct kvstore *kv, char *err, size_t errlen)
{
	struct kvpool_header *h = kv->h;
	struct kvindex_geometry g = {.block_bytes = h->block_bytes, .manifest_hash = h->manifest_hash,
				     .n_slots = h->n_spill_slots};
	struct kvindex_record *recs = calloc(g.n_slots ? g.n_slots : 1, sizeof(*recs));
	if (!recs)
		return errorf(err, errlen, -ENOMEM, "out of memory writing spill index %s", kv->index_path);
	memset(kv->recorded, 0, g.n_slots);
	for (uint32_t i = 0; i < h->n_handles; i++) {
		const struct kvpool_handle *hd = &kv->handles[i];
		if (hd->location != KVLOC_SPILL || !kvs_indexed(kv, i))
			continue;
		recs[hd->where] = (struct kvindex_record){.in_use = 1, .checksum = hd->checksum, .key = hd->key,
							  .last_use = hd->last_use};
		kv->recorded[hd->where] = 1;
	}
	int rc = kvindex_write_all(kv->index, &g, recs, err, errlen);
	if (rc == 0)
		kv->index_failed = false;
	free(recs);
	return rc;
}

/* ---- loading the index into a fresh pool ---- */

/* A fresh pool loads the records of a matching index: each becomes a cached block in the
 * spill file (no reference, generation 1). A record past the end of the spill file is
 * skipped; of two with one key the more recently used wins. Returns how many were loaded. */
uint32_t kvs_load_cached(struct kvstore *kv, const struct kvindex_record *recs)
{
	struct kvpool_header *h = kv->h;
	uint64_t file_size = spill_file_size(kv->spill);
	uint32_t n = 0, past = 0, dup = 0;
	for (uint32_t j = 0; j < h->n_spill_slots; j++) {
		const struct kvindex_record *r = &recs[j];
		if (r->in_use != 1)
			continue;
		if (((uint64_t)j + 1) * h->block_bytes > file_size) {
			past++;
			continue;
		}
		uint32_t idx = keymap_get(kv->keys, r->key);
		if (idx != KV_NONE) {
			dup++;
			if (kv->handles[idx].last_use >= r->last_use)
				continue;
		} else {
			idx = n++;
		}
		struct kvpool_handle *hd = &kv->handles[idx];
		hd->state = KVH_COMMITTED;
		hd->location = KVLOC_SPILL;
		hd->where = j;
		hd->checksum = r->checksum;
		hd->refs = 0;
		hd->key = r->key;
		hd->last_use = r->last_use;
		keymap_put(kv->keys, r->key, idx);
	}
	log_info("spill index %s: %u cached blocks loaded from %s%s", kv->index_path, n, kv->spill_path,
		 past || dup ? " (records skipped: see below)" : "");
	if (past)
		log_warn("spill index %s: %u records name slots past the end of %s: skipped", kv->index_path, past,
			 kv->spill_path);
	if (dup)
		log_warn("spill index %s: %u records repeat another's key: the less recently used skipped",
			 kv->index_path, dup);
	return n;
}

/* Persistence: opens the index and reads it for geometry l. Returns 1 with recs filled when it
 * matches, 0 when it was discarded (and reset for l: the caller truncates the spill file), or
 * -errno (err says why). */
int kvs_index_load(struct kvstore *kv, const struct layout *l, uint64_t manifest_hash, struct kvindex_record *recs,
		   char *err, size_t errlen)
{
	int rc = kvindex_open(kv->index_path, &kv->index, err, errlen);
	if (rc)
		return rc;
	struct kvindex_geometry g = {.block_bytes = l->block_bytes, .manifest_hash = manifest_hash,
				     .n_slots = l->n_spill};
	char why[512];
	uint32_t bad = 0;
	int loaded = kvindex_load(kv->index, &g, recs, &bad, why, sizeof(why));
	if (loaded < 0) {
		/* Unreadable (EIO, a failed stat): not a mismatch. The persisted blocks stay as they are
		 * on disk for a later start, rather than being reset and their spill file truncated. */
		if (why[0])
			snprintf(err, errlen, "%s (the persisted KV blocks are left as they are)", why);
		else
			snprintf(err, errlen, "spill index %s: %s (the persisted KV blocks are left as they are)",
				 kv->index_path, strerror(-loaded));
		return loaded;
	}
	if (loaded == 1) {
		if (bad)
			log_warn("spill index %s: %u records are corrupt (checksum mismatch): their blocks are dropped",
				 kv->index_path, bad);
		return 1;
	}
	if (why[0])
		log_warn("spill index %s discarded: %s; spill file %s truncated", kv->index_path, why, kv->spill_path);
	rc = kvindex_reset(kv->index, &g, err, errlen);
	return rc ? rc : 0;
}

/* ---- persistence at a clean stop ---- */

static int victim_cmp_recent(const void *a, const void *b)
{
	return -kvs_victim_cmp(a, b);
}

/* The spill file keeps the most recently used keyed blocks it can hold, wherever they are
 * now: pool blocks among them are written into spill slots that no kept block holds, then the
 * index is rewritten whole and both files synced. The pool is about to be unlinked, so its
 * tables are changed only as far as kvs_index_rewrite reads them. */
void kvs_persist_at_stop(struct kvstore *kv)
{
	struct kvpool_header *h = kv->h;
	uint32_t n_spill = h->n_spill_slots, nc = 0, written = 0, failed = 0, kept = 0;
	struct victim *c = malloc(sizeof(*c) * h->n_handles);
	uint8_t *busy = calloc(n_spill ? n_spill : 1, 1);
	struct spill_io *ios = malloc(sizeof(*ios) * (n_spill ? n_spill : 1));
	uint32_t *who = malloc(sizeof(uint32_t) * (n_spill ? n_spill : 1));
	char err[512] = "";
	if (!c || !busy || !ios || !who) {
		log_error("out of memory persisting the KV cache: spill index %s left as it was", kv->index_path);
		goto out_free;
	}
	for (uint32_t i = 0; i < h->n_handles; i++)
		if (kvs_indexed(kv, i) &&
		    (kv->handles[i].location == KVLOC_POOL || kv->handles[i].location == KVLOC_SPILL))
			c[nc++] = (struct victim){.last_use = kv->handles[i].last_use, .id = i};
	qsort(c, nc, sizeof(*c), victim_cmp_recent);
	uint32_t keep = nc < n_spill ? nc : n_spill;
	/* Blocks beyond what the disk holds lose their place, in either tier. */
	for (uint32_t k = keep; k < nc; k++) {
		struct kvpool_handle *hd = &kv->handles[c[k].id];
		if (hd->location == KVLOC_SPILL)
			hd->location = KVLOC_NONE;
	}
	for (uint32_t k = 0; k < keep; k++) {
		const struct kvpool_handle *hd = &kv->handles[c[k].id];
		if (hd->location == KVLOC_SPILL)
			busy[hd->where] = 1;
	}
	uint32_t n_io = 0, j = 0;
	for (uint32_t k = 0; k < keep; k++) {
		const struct kvpool_handle *hd = &kv->handles[c[k].id];
		if (hd->location != KVLOC_POOL)
			continue;
		while (busy[j])
			j++;
		busy[j] = 1;
		ios[n_io] = (struct spill_io){.buf = slot_data(kv, hd->where), .slot = j, .write = true};
		who[n_io++] = c[k].id;
	}
	if (n_io && spill_run(kv->spill, ios, n_io, err, sizeof(err)) != 0)
		log_warn("persisting the KV cache: %s", err);
	for (uint32_t k = 0; k < n_io; k++) {
		struct kvpool_handle *hd = &kv->handles[who[k]];
		if (ios[k].res) {
			failed++;
			continue;
		}
		hd->location = KVLOC_SPILL;
		hd->where = ios[k].slot;
		written++;
	}
	kept = keep - failed;
	if (kvs_index_rewrite(kv, err, sizeof(err)) != 0) {
		log_error("persisting the KV cache: %s", err);
		goto out_free;
	}
	int rc = spill_sync(kv->spill);
	if (rc == 0)
		rc = kvindex_sync(kv->index);
	if (rc)
		log_warn("persisting the KV cache: cannot sync %s or %s: %s", kv->spill_path, kv->index_path,
			 strerror(-rc));
	log_info("KV cache persisted in %s: %u cached blocks (%u written from the pool now%s), %u not kept (the "
		 "disk budget holds %u)", kv->spill_path, kept, written, failed ? ", some writes failed" : "",
		 nc - keep, n_spill);
out_free:
	free(c);
	free(busy);
	free(ios);
	free(who);
}

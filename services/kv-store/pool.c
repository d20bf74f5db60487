#include "services/kv-store/pool.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "common/tunable.h"
#include "common/util.h"
#include "services/kv-store/keymap.h"
#include "services/kv-store/kvindex.h"
#include "services/kv-store/spill.h"

/* Offsets and sizes of one pool geometry. */
struct layout {
	uint64_t block_bytes;
	uint32_t n_slots, n_spill, n_handles;
	uint64_t slots_off, handles_off, data_off, total;
};

struct kvstore {
	char shm_name[SHM_NAME_MAX];
	char spill_path[512];
	char index_path[512]; /* "" without persistence */
	bool persistent;
	uint64_t dram_budget, disk_budget;
	uint32_t io_depth;
	/* Live tuning: the budgets now (at most the ones the pool was laid out for: free slots past
	 * them are parked, out of circulation) and the spill file's transfers in flight. */
	uint64_t dram_limit, disk_limit;
	uint32_t io_limit;
	bool dram_tuned, disk_tuned; /* a tune set the limit: until then the pool's own size rules */
	uint64_t enforce_after_ns; /* a spill down to the DRAM budget failed: try again after this */
	bool enforce_warned;
	/* The last gpu-runner session this process saw (session_known), carried into a pool made
	 * later (a reconfigure); session_pending: it came while no pool was live, so it is
	 * compared with the session of a pool adopted later. */
	bool session_known, session_pending;
	uint64_t session;

	/* The live pool; all NULL before configure/adopt. */
	struct shm_object *shm;
	struct kvpool_header *h;
	struct kvpool_slot *slots;
	struct kvpool_handle *handles;
	struct spill *spill;
	struct kvindex *index; /* with persistence */
	bool index_failed;     /* a record write failed (logged once; the stop rewrites the index) */
	bool adopted;
	uint64_t tick; /* LRU clock: slot.last_use values come from here */

	/* Private indexes rebuilt from the shared tables on adoption. Stacks: pop from the top. */
	uint32_t *free_slots, n_free_slots;
	uint32_t *free_spill, n_free_spill;
	uint32_t *free_handles, n_free_handles;
	uint32_t *parked_slots, n_parked_slots; /* free, but past the DRAM budget now */
	uint32_t *parked_spill, n_parked_spill; /* free, but past the disk budget now */
	/* Per handle: the stamp of the last request that named it, so one pass finds duplicates
	 * and keeps a fetch from evicting the blocks it is fetching. */
	uint32_t *mark;
	uint32_t stamp;
	void *bounce; /* one block, 4 KiB aligned, for swap_in; allocated on first use */
	struct keymap *keys; /* the prefix index: key -> the handle of the committed block with it */
	uint8_t *recorded;   /* per spill slot: its index record is in use (persistence only) */
};

/* ---- geometry ---- */

static int layout_compute(uint64_t block_bytes, uint64_t n_slots, uint64_t n_spill, struct layout *l)
{
	/* KV_NONE is reserved; keep the handle table and the private stacks of sane size. */
	if (block_bytes == 0 || block_bytes % 4096 || n_slots == 0 || n_slots + n_spill >= (1ull << 31))
		return -EINVAL;
	l->block_bytes = block_bytes;
	l->n_slots = (uint32_t)n_slots;
	l->n_spill = (uint32_t)n_spill;
	l->n_handles = (uint32_t)(n_slots + n_spill);
	l->slots_off = ALIGN_UP((uint64_t)sizeof(struct kvpool_header), (uint64_t)CACHE_LINE);
	l->handles_off = l->slots_off + (uint64_t)l->n_slots * sizeof(struct kvpool_slot);
	/* Slot data page aligned: O_DIRECT reads and writes go straight from/to it. */
	l->data_off = ALIGN_UP(l->handles_off + (uint64_t)l->n_handles * sizeof(struct kvpool_handle), 4096ull);
	uint64_t data;
	if (__builtin_mul_overflow((uint64_t)l->n_slots, block_bytes, &data) ||
	    __builtin_add_overflow(l->data_off, data, &l->total) || l->total > (1ull << 62))
		return -EINVAL;
	return 0;
}

/* Does a mapped header describe exactly the layout l? */
static bool header_matches(const struct kvpool_header *h, const struct layout *l)
{
	return h->block_bytes == l->block_bytes && h->n_slots == l->n_slots && h->n_spill_slots == l->n_spill &&
	       h->n_handles == l->n_handles && h->slots_off == l->slots_off && h->handles_off == l->handles_off &&
	       h->data_off == l->data_off && h->shm.total_size == l->total;
}

static uint64_t slot_data_offset(const struct kvstore *kv, uint32_t s)
{
	return kv->h->data_off + (uint64_t)s * kv->h->block_bytes;
}

static void *slot_data(const struct kvstore *kv, uint32_t s)
{
	return (char *)kv->h + slot_data_offset(kv, s);
}

static uint64_t handle_value(const struct kvstore *kv, uint32_t idx)
{
	return kv_handle_make(idx, kv->handles[idx].generation);
}

/* ---- create / destroy ---- */

int kvstore_create(const struct kvstore_config *cfg, struct kvstore **out)
{
	assert(cfg && cfg->shm_name && cfg->spill_path && out);
	if (cfg->io_depth == 0 || cfg->io_depth > SPILL_MAX_IO_DEPTH)
		return -EINVAL;
	struct kvstore *kv = calloc(1, sizeof(*kv));
	if (!kv)
		return -ENOMEM;
	if (str_copy(kv->shm_name, sizeof(kv->shm_name), cfg->shm_name) != 0 ||
	    str_copy(kv->spill_path, sizeof(kv->spill_path), cfg->spill_path) != 0 ||
	    (cfg->index_path && str_copy(kv->index_path, sizeof(kv->index_path), cfg->index_path) != 0)) {
		free(kv);
		return -EINVAL;
	}
	kv->persistent = cfg->index_path != NULL;
	kv->dram_budget = cfg->dram_budget;
	kv->disk_budget = cfg->disk_budget;
	kv->io_depth = cfg->io_depth;
	kv->dram_limit = cfg->dram_budget;
	kv->disk_limit = cfg->disk_budget;
	kv->io_limit = cfg->io_depth;
	*out = kv;
	return 0;
}

static void private_free(struct kvstore *kv)
{
	free(kv->free_slots);
	free(kv->free_spill);
	free(kv->free_handles);
	free(kv->mark);
	free(kv->bounce);
	free(kv->recorded);
	free(kv->parked_slots);
	free(kv->parked_spill);
	keymap_destroy(&kv->keys);
	kv->bounce = NULL;
	kv->recorded = NULL;
	kv->parked_slots = kv->parked_spill = NULL;
	kv->n_parked_slots = kv->n_parked_spill = 0;
	kv->free_slots = kv->free_spill = kv->free_handles = kv->mark = NULL;
	kv->n_free_slots = kv->n_free_spill = kv->n_free_handles = 0;
	kv->stamp = 0;
}

static int private_alloc(struct kvstore *kv, const struct layout *l)
{
	kv->free_slots = malloc(sizeof(uint32_t) * l->n_slots);
	kv->free_spill = malloc(sizeof(uint32_t) * (l->n_spill ? l->n_spill : 1));
	kv->free_handles = malloc(sizeof(uint32_t) * l->n_handles);
	kv->mark = calloc(l->n_handles, sizeof(uint32_t));
	kv->keys = keymap_create(l->n_handles);
	kv->recorded = calloc(l->n_spill ? l->n_spill : 1, 1);
	kv->parked_slots = malloc(sizeof(uint32_t) * l->n_slots);
	kv->parked_spill = malloc(sizeof(uint32_t) * (l->n_spill ? l->n_spill : 1));
	kv->n_parked_slots = kv->n_parked_spill = 0;
	if (!kv->free_slots || !kv->free_spill || !kv->free_handles || !kv->mark || !kv->keys || !kv->recorded ||
	    !kv->parked_slots || !kv->parked_spill) {
		private_free(kv);
		return -ENOMEM;
	}
	return 0;
}

/* Unmaps the pool and closes the spill file (and index); with remove, unlinks the pool and
 * deletes the spill file, unless it persists. */
static void pool_close(struct kvstore *kv, bool remove)
{
	spill_close(&kv->spill, remove && !kv->persistent);
	kvindex_close(&kv->index);
	kv->index_failed = false;
	shm_object_close(&kv->shm, remove);
	kv->h = NULL;
	kv->slots = NULL;
	kv->handles = NULL;
	kv->adopted = false;
	kv->tick = 0;
	private_free(kv);
}

/* A clean stop with no live pool still leaves nothing behind: a dead predecessor's pool that
 * was not adopted goes, with the spill file that belonged to it (unless it persists: its index
 * still describes it). A live owner's stays. */
static void remove_leftover(struct kvstore *kv)
{
	int fd = shm_open(kv->shm_name, O_RDONLY | O_CLOEXEC, 0);
	if (fd < 0)
		return;
	struct shm_header hdr;
	bool dead = pread(fd, &hdr, sizeof(hdr), 0) != (ssize_t)sizeof(hdr) || hdr.magic != SHM_MAGIC ||
		    !shm_owner_alive(&hdr);
	close(fd);
	if (!dead)
		return;
	shm_unlink(kv->shm_name);
	if (!kv->persistent)
		unlink(kv->spill_path);
}

static void persist_at_stop(struct kvstore *kv);

void kvstore_destroy(struct kvstore **kvp, bool remove)
{
	if (!kvp || !*kvp)
		return;
	struct kvstore *kv = *kvp;
	if (kv->h && remove && kv->persistent)
		persist_at_stop(kv);
	if (kv->h)
		pool_close(kv, remove);
	else if (remove)
		remove_leftover(kv);
	free(kv);
	*kvp = NULL;
}

/* ---- free lists and counters ---- */

static void publish_usage(struct kvstore *kv)
{
	atomic_store(&kv->h->store.slots_used, (uint64_t)(kv->h->n_slots - kv->n_free_slots - kv->n_parked_slots));
	atomic_store(&kv->h->store.spill_used,
		     (uint64_t)(kv->h->n_spill_slots - kv->n_free_spill - kv->n_parked_spill));
}

/* Rebuilds the private stacks from the shared tables (pushed from the top index down so the
 * lowest index comes out first). */
static int rebuild_free_lists(struct kvstore *kv)
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
	kv->n_parked_slots = kv->n_parked_spill = 0; /* parked again at the next park() */
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
	publish_usage(kv);
	return 0;
}

static void slot_reset(struct kvpool_slot *sl)
{
	atomic_store(&sl->state, KVSLOT_FREE);
	atomic_store_explicit(&sl->ready, 0, memory_order_relaxed);
	sl->pins = 0;
	sl->handle_index = KV_NONE;
	sl->last_use = 0;
}

static void slot_release(struct kvstore *kv, uint32_t s)
{
	slot_reset(&kv->slots[s]);
	kv->free_slots[kv->n_free_slots++] = s;
}

/* ---- the budgets now (live tuning) ---- */

/* Pool blocks the DRAM budget allows now (at least one), spill blocks the disk budget allows. */
static uint32_t slot_cap(const struct kvstore *kv)
{
	if (!kv->dram_tuned)
		return kv->h->n_slots;
	uint64_t b = kv->dram_limit / kv->h->block_bytes;
	if (b < 1)
		b = 1;
	return b < kv->h->n_slots ? (uint32_t)b : kv->h->n_slots;
}

static uint32_t spill_cap(const struct kvstore *kv)
{
	if (!kv->disk_tuned)
		return kv->h->n_spill_slots;
	uint64_t b = kv->disk_limit / kv->h->block_bytes;
	return b < kv->h->n_spill_slots ? (uint32_t)b : kv->h->n_spill_slots;
}

/* Free pool and spill slots past the budgets leave circulation (parked); parked ones come back
 * when a budget rose. Only free slots move: the blocks over a lowered DRAM budget are spilled by
 * kvstore_enforce_budgets. Without a tune nothing is ever parked. */
static void park(struct kvstore *kv)
{
	if (!kv->h || !(kv->dram_tuned || kv->disk_tuned))
		return;
	uint32_t want = kv->h->n_slots - slot_cap(kv);
	while (kv->n_parked_slots > want)
		kv->free_slots[kv->n_free_slots++] = kv->parked_slots[--kv->n_parked_slots];
	while (kv->n_parked_slots < want && kv->n_free_slots > 0)
		kv->parked_slots[kv->n_parked_slots++] = kv->free_slots[--kv->n_free_slots];
	want = kv->h->n_spill_slots - spill_cap(kv);
	while (kv->n_parked_spill > want)
		kv->free_spill[kv->n_free_spill++] = kv->parked_spill[--kv->n_parked_spill];
	while (kv->n_parked_spill < want && kv->n_free_spill > 0)
		kv->parked_spill[kv->n_parked_spill++] = kv->free_spill[--kv->n_free_spill];
	publish_usage(kv);
}

/* A request needs more pool slots at once than the lowered budget leaves (the runner fetches up to
 * the pool's laid-out size): lend it up to n parked slots, as the pool laid out at start would
 * have had them. The next enforcement spills back down. */
static void unpark_slots(struct kvstore *kv, uint32_t n)
{
	while (n-- > 0 && kv->n_parked_slots > 0)
		kv->free_slots[kv->n_free_slots++] = kv->parked_slots[--kv->n_parked_slots];
	publish_usage(kv);
}

/* Retires a handle: its value goes stale (generation bump; 0 is never a live generation), and
 * its key leaves the prefix index if the index named it. */
static void handle_release(struct kvstore *kv, uint32_t idx)
{
	struct kvpool_handle *hd = &kv->handles[idx];
	if (hd->key && keymap_get(kv->keys, hd->key) == idx)
		keymap_del(kv->keys, hd->key);
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
	kv->free_handles[kv->n_free_handles++] = idx;
}

/* Is idx the block the prefix index names for its key? Only such a block can be cached. */
static bool indexed(const struct kvstore *kv, uint32_t idx)
{
	const struct kvpool_handle *hd = &kv->handles[idx];
	return hd->state == KVH_COMMITTED && hd->key && keymap_get(kv->keys, hd->key) == idx;
}

/* Cached: committed, indexed, no reference. Evictable, droppable, found by LOOKUP. */
static bool cached(const struct kvstore *kv, uint32_t idx)
{
	return kv->handles[idx].refs == 0 && indexed(kv, idx);
}

/* A use of block idx: most recently used in whichever tier it is. */
static void touch(struct kvstore *kv, uint32_t idx)
{
	struct kvpool_handle *hd = &kv->handles[idx];
	hd->last_use = ++kv->tick;
	if (hd->location == KVLOC_POOL)
		kv->slots[hd->where].last_use = hd->last_use;
}

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
static void index_put(struct kvstore *kv, uint32_t j, uint32_t idx)
{
	if (!kv->index)
		return;
	const struct kvpool_handle *hd = &kv->handles[idx];
	int rc = 0;
	if (indexed(kv, idx)) {
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
static void spill_slot_free(struct kvstore *kv, uint32_t j)
{
	if (kv->index && kv->recorded[j]) {
		int rc = kvindex_clear(kv->index, j);
		if (rc)
			index_failed(kv, j, rc);
		kv->recorded[j] = 0;
	}
	kv->free_spill[kv->n_free_spill++] = j;
}

/* Frees block idx with the pool slot or spill slot it holds, whatever its pins and refs. */
static void block_retire(struct kvstore *kv, uint32_t idx)
{
	struct kvpool_handle *hd = &kv->handles[idx];
	if (hd->location == KVLOC_POOL)
		slot_release(kv, hd->where);
	else if (hd->location == KVLOC_SPILL)
		spill_slot_free(kv, hd->where);
	handle_release(kv, idx);
}

static uint32_t next_stamp(struct kvstore *kv)
{
	if (++kv->stamp == 0) {
		memset(kv->mark, 0, sizeof(uint32_t) * kv->h->n_handles);
		kv->stamp = 1;
	}
	return kv->stamp;
}

/* ---- fresh layout and adoption ---- */

static void layout_init(struct kvstore *kv, const struct layout *l, uint64_t manifest_hash)
{
	struct kvpool_header *h = kv->h;
	/* The object is new (zero-filled by ftruncate): only non-zero fields are written. */
	h->manifest_hash = manifest_hash;
	h->block_bytes = l->block_bytes;
	h->n_slots = l->n_slots;
	h->n_handles = l->n_handles;
	h->n_spill_slots = l->n_spill;
	h->slots_off = l->slots_off;
	h->handles_off = l->handles_off;
	h->data_off = l->data_off;
	h->pool_epoch = random_u64();
	kv->slots = kvpool_slots(h);
	kv->handles = kvpool_handles(h);
	for (uint32_t s = 0; s < l->n_slots; s++) {
		struct kvpool_slot *sl = &kv->slots[s];
		slot_reset(sl);
		atomic_store(&sl->seq, 0);
		sl->data_offset = l->data_off + (uint64_t)s * l->block_bytes;
	}
	for (uint32_t i = 0; i < l->n_handles; i++) {
		memset(&kv->handles[i], 0, sizeof(kv->handles[i]));
		kv->handles[i].generation = 1; /* so that the value 0 is never a live handle */
	}
}

static void drop_handle(struct kvstore *kv, uint32_t idx, const char *why)
{
	log_warn("adopted KV pool %s: dropping block 0x%llx: %s", kv->shm_name,
		 (unsigned long long)handle_value(kv, idx), why);
	struct kvpool_handle *hd = &kv->handles[idx];
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

/* Makes an adopted pool's tables consistent. The handle table is the truth (a handle names
 * where its bytes are); slots agree with it or are freed. The write orders in make_room,
 * load_batch and swap_in keep every crash point recoverable: a slot is marked SPILLING or
 * LOADING before its I/O, and the handle moves only after the I/O (and, for a load, the
 * checksum) succeeded; what cannot be recovered is dropped, never served wrong.
 * Returns 0 or -ENOMEM. */
static int recover_tables(struct kvstore *kv)
{
	struct kvpool_header *h = kv->h;
	uint64_t bb = h->block_bytes;
	uint64_t file_size = spill_file_size(kv->spill);
	uint32_t *owner = malloc(sizeof(uint32_t) * h->n_slots);
	uint32_t *named = malloc(sizeof(uint32_t) * h->n_handles); /* per handle: the one slot in use naming it */
	uint8_t *spill_busy = calloc(h->n_spill_slots ? h->n_spill_slots : 1, 1);
	int rc = 0;
	if (!owner || !named || !spill_busy) {
		rc = -ENOMEM;
		goto out_free;
	}
	for (uint32_t i = 0; i < h->n_handles; i++)
		named[i] = KV_NONE;
	for (uint32_t s = 0; s < h->n_slots; s++) {
		uint32_t i = kv->slots[s].handle_index;
		owner[s] = KV_NONE;
		if (i >= h->n_handles || atomic_load(&kv->slots[s].state) == KVSLOT_FREE)
			continue;
		named[i] = named[i] == KV_NONE ? s : KV_NONE - 1; /* two slots name it: neither counts */
	}
	uint32_t live = 0, spilled = 0, recovered = 0;
	for (uint32_t i = 0; i < h->n_handles; i++) {
		struct kvpool_handle *hd = &kv->handles[i];
		if (hd->generation == 0)
			hd->generation = 1;
		if (hd->state == KVH_FREE) {
			hd->location = KVLOC_NONE;
			continue;
		}
		if (hd->state != KVH_WRITING && hd->state != KVH_COMMITTED) {
			drop_handle(kv, i, "unknown handle state");
			continue;
		}
		if (hd->location == KVLOC_POOL) {
			/* A kill -9 between the two stores that move a handle between the pool and
			 * the spill file leaves "pool" with a spill slot's index, which may be another
			 * block's pool slot: a handle claims only the slot in use that names it (the
			 * SPILLING or LOADING one when it was moving), never one that names another. */
			if (hd->where >= h->n_slots || named[i] != hd->where) {
				uint32_t s = named[i];
				if (s >= h->n_slots) {
					drop_handle(kv, i, "no pool slot holds it");
					continue;
				}
				log_info("adopted KV pool %s: block 0x%llx was moving: it stays in pool slot %u",
					 kv->shm_name, (unsigned long long)handle_value(kv, i), s);
				hd->where = s;
			}
			if (owner[hd->where] != KV_NONE) {
				drop_handle(kv, i, "its pool slot is taken by another block");
				continue;
			}
			owner[hd->where] = i;
		} else if (hd->location == KVLOC_SPILL && hd->state == KVH_COMMITTED) {
			if (hd->where >= h->n_spill_slots || spill_busy[hd->where]) {
				drop_handle(kv, i, "its spill slot is out of range or taken by another block");
				continue;
			}
			if (((uint64_t)hd->where + 1) * bb > file_size) {
				drop_handle(kv, i, "its spill slot lies past the end of the spill file");
				continue;
			}
			spill_busy[hd->where] = 1;
			spilled++;
		} else {
			drop_handle(kv, i, "no valid location");
			continue;
		}
		live++;
	}
	for (uint32_t s = 0; s < h->n_slots; s++) {
		struct kvpool_slot *sl = &kv->slots[s];
		uint32_t st = atomic_load(&sl->state);
		uint32_t i = owner[s];
		sl->data_offset = h->data_off + (uint64_t)s * bb;
		if (atomic_load(&sl->seq) & 1)
			atomic_fetch_add(&sl->seq, 1);
		if (i == KV_NONE) {
			if (st == KVSLOT_LOADING)
				log_info("KV pool slot %u was being read back: freed, the block stays in the "
					 "spill file", s);
			if (st != KVSLOT_FREE)
				recovered++;
			slot_reset(sl);
			continue;
		}
		struct kvpool_handle *hd = &kv->handles[i];
		bool ok = sl->handle_index == i;
		if (ok && hd->state == KVH_WRITING) {
			ok = st == KVSLOT_WRITING;
		} else if (ok) {
			switch (st) {
			case KVSLOT_COMMITTED:
				break;
			case KVSLOT_SPILLING:
				/* The spill did not finish: the bytes are still here and the handle says so. */
				log_info("KV pool slot %u was being spilled: block 0x%llx stays in the pool", s,
					 (unsigned long long)handle_value(kv, i));
				atomic_store(&sl->state, KVSLOT_COMMITTED);
				recovered++;
				break;
			case KVSLOT_LOADING:
				/* The handle moved, so the bytes were read and checked; the fetch never
				 * reached the runner, so nothing pins them. */
				atomic_store(&sl->state, KVSLOT_COMMITTED);
				sl->pins = 0;
				recovered++;
				break;
			default:
				ok = false;
			}
		}
		if (!ok) {
			drop_handle(kv, i, "its pool slot does not hold it");
			slot_reset(sl);
			live--;
		}
	}
	log_info("adopted KV pool %s: %u live blocks (%u in the spill file), %u slots recovered from mid-I/O",
		 kv->shm_name, live, spilled, recovered);
out_free:
	free(owner);
	free(named);
	free(spill_busy);
	return rc;
}

/* As drop_handle, after recover_tables: the pool slot the handle held is freed too. */
static void adopt_drop(struct kvstore *kv, uint32_t idx, const char *why)
{
	struct kvpool_handle *hd = &kv->handles[idx];
	if (hd->location == KVLOC_POOL)
		slot_reset(&kv->slots[hd->where]);
	drop_handle(kv, idx, why);
}

/* After recover_tables: references agree with the states, and the prefix index is rebuilt. A
 * block being written holds its ALLOC reference; a committed block without a reference must
 * have a key (it is cached). Of two committed blocks with one key (the older one still
 * referenced when the newer committed), the index names the more recently used; the other,
 * if unreferenced, goes. */
static void adopt_refs(struct kvstore *kv)
{
	keymap_clear(kv->keys);
	for (uint32_t i = 0; i < kv->h->n_handles; i++) {
		struct kvpool_handle *hd = &kv->handles[i];
		if (hd->state == KVH_FREE)
			continue;
		if (hd->state == KVH_WRITING && hd->refs == 0) {
			adopt_drop(kv, i, "being written but holding no reference");
			continue;
		}
		if (hd->state != KVH_COMMITTED || hd->key == 0) {
			if (hd->refs == 0)
				adopt_drop(kv, i, "committed without a key or a reference");
			continue;
		}
		uint32_t o = keymap_get(kv->keys, hd->key);
		if (o == KV_NONE) {
			keymap_put(kv->keys, hd->key, i);
			continue;
		}
		uint32_t win = hd->last_use >= kv->handles[o].last_use ? i : o, lose = win == i ? o : i;
		keymap_put(kv->keys, hd->key, win);
		if (kv->handles[lose].refs == 0)
			adopt_drop(kv, lose, "another block has its key and was used later");
	}
}

/* Rewrites the whole index from the handle table: a record for each indexed block in the
 * spill file. Returns 0 or -errno (err says why). */
static int index_rewrite(struct kvstore *kv, char *err, size_t errlen)
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
		if (hd->location != KVLOC_SPILL || !indexed(kv, i))
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

static void reset_refs(struct kvstore *kv, struct kvstore_hello *out);

/* A pool went live: an adopted one compares the session of a gpu-runner that said HELLO while
 * there was no pool with its own; a new one takes the last session seen (the runner that
 * asked for a reconfigure still holds what it holds). */
static void session_on_live(struct kvstore *kv)
{
	bool pending = kv->session_pending;
	kv->session_pending = false;
	if (!kv->session_known || (kv->adopted && !pending))
		return;
	if (kv->adopted && (kv->session == 0 || kv->session != kv->h->runner_session)) {
		struct kvstore_hello r;
		reset_refs(kv, &r);
		log_info("the gpu-runner that said HELLO before the pool was adopted is a new one: freed %u blocks "
			 "(%u being written), kept %u cached, dropped %llu pins", r.freed, r.writing, r.cached,
			 (unsigned long long)r.pins);
	}
	kv->h->runner_session = kv->session;
}

/* Takes over a mapped, adopted object whose header matches l. On failure the object is
 * closed without unlinking (it stays for a later try) and no pool is live. */
static int adopt_object(struct kvstore *kv, struct shm_object **op, const struct layout *l, char *err,
			size_t errlen)
{
	kv->shm = *op;
	*op = NULL;
	kv->h = shm_object_base(kv->shm);
	kv->slots = kvpool_slots(kv->h);
	kv->handles = kvpool_handles(kv->h);
	int rc = private_alloc(kv, l);
	if (rc) {
		snprintf(err, errlen, "out of memory adopting KV pool %s", kv->shm_name);
		goto out_close;
	}
	/* Spilled handles point into the file: reopen it as it is. */
	rc = spill_open(kv->spill_path, l->block_bytes, l->n_spill ? l->n_spill : 1, kv->io_depth, SPILL_KEEP,
			&kv->spill, err, errlen);
	if (rc)
		goto out_close;
	spill_set_limit(kv->spill, kv->io_limit);
	rc = recover_tables(kv);
	if (rc == 0) {
		adopt_refs(kv);
		rc = rebuild_free_lists(kv);
	}
	if (rc) {
		snprintf(err, errlen, "out of memory adopting KV pool %s", kv->shm_name);
		goto out_close;
	}
	if (kv->persistent) {
		/* The pool is the truth: the index is made to match it (a crash between a spill and
		 * its record, say). */
		rc = kvindex_open(kv->index_path, &kv->index, err, errlen);
		if (rc == 0)
			rc = index_rewrite(kv, err, errlen);
		if (rc)
			goto out_close;
	}
	kv->adopted = true;
	session_on_live(kv);
	return 0;

out_close:
	pool_close(kv, false);
	return rc;
}

/* A fresh pool loads the records of a matching index: each becomes a cached block in the
 * spill file (no reference, generation 1). A record past the end of the spill file is
 * skipped; of two with one key the more recently used wins. Returns how many were loaded. */
static uint32_t load_cached(struct kvstore *kv, const struct kvindex_record *recs)
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
static int index_load(struct kvstore *kv, const struct layout *l, uint64_t manifest_hash, struct kvindex_record *recs,
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

/* Lays out a new object (mapped at *op, not adopted); with persistence, loads a matching index. */
static int init_object(struct kvstore *kv, struct shm_object **op, const struct layout *l, uint64_t manifest_hash,
		       char *err, size_t errlen)
{
	kv->shm = *op;
	*op = NULL;
	kv->h = shm_object_base(kv->shm);
	struct kvindex_record *recs = NULL;
	int loaded = 0;
	int rc = private_alloc(kv, l);
	if (rc == 0 && kv->persistent && !(recs = calloc(l->n_spill ? l->n_spill : 1, sizeof(*recs))))
		rc = -ENOMEM;
	if (rc) {
		snprintf(err, errlen, "out of memory creating KV pool %s", kv->shm_name);
		goto out_unlink;
	}
	if (kv->persistent) {
		loaded = index_load(kv, l, manifest_hash, recs, err, errlen);
		if (loaded < 0) {
			rc = loaded;
			goto out_unlink;
		}
	}
	rc = spill_open(kv->spill_path, l->block_bytes, l->n_spill ? l->n_spill : 1, kv->io_depth,
			loaded ? SPILL_KEEP : SPILL_TRUNCATE, &kv->spill, err, errlen);
	if (rc)
		goto out_unlink;
	spill_set_limit(kv->spill, kv->io_limit);
	layout_init(kv, l, manifest_hash);
	if (loaded)
		load_cached(kv, recs);
	rc = rebuild_free_lists(kv);
	if (rc) {
		snprintf(err, errlen, "out of memory creating KV pool %s", kv->shm_name);
		goto out_unlink;
	}
	if (loaded) {
		/* Records skipped at load leave the file. */
		rc = index_rewrite(kv, err, errlen);
		if (rc)
			goto out_unlink;
	}
	shm_object_set_ready(kv->shm);
	kv->adopted = false;
	session_on_live(kv);
	free(recs);
	return 0;

out_unlink:
	free(recs);
	pool_close(kv, true);
	return rc;
}

static int create_object(struct kvstore *kv, const struct layout *l, enum shm_leftover policy,
			 struct shm_object **o, bool *adopted, char *err, size_t errlen)
{
	int rc = shm_object_create(kv->shm_name, (size_t)l->total, SHM_KIND_KV_POOL, KVPOOL_LAYOUT_VERSION, policy,
				   o, adopted);
	if (rc == -EBUSY)
		snprintf(err, errlen, "KV pool %s is owned by a live process: stop that kv-store first or pick another "
			 "--instance", kv->shm_name);
	else if (rc)
		snprintf(err, errlen, "cannot create KV pool %s of %llu bytes: %s", kv->shm_name,
			 (unsigned long long)l->total, strerror(-rc));
	return rc;
}

int kvstore_adopt(struct kvstore *kv, char *err, size_t errlen)
{
	if (kv->h) {
		snprintf(err, errlen, "KV pool %s is already live", kv->shm_name);
		return -EALREADY;
	}
	int fd = shm_open(kv->shm_name, O_RDONLY | O_CLOEXEC, 0);
	if (fd < 0) {
		if (errno == ENOENT)
			return 0;
		int rc = -errno;
		snprintf(err, errlen, "cannot open leftover KV pool %s: %s", kv->shm_name, strerror(errno));
		return rc;
	}
	struct kvpool_header hdr;
	struct stat st;
	bool readable = fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(hdr) &&
			pread(fd, &hdr, sizeof(hdr), 0) == (ssize_t)sizeof(hdr);
	close(fd);
	if (!readable || hdr.shm.magic != SHM_MAGIC || hdr.shm.kind != SHM_KIND_KV_POOL ||
	    hdr.shm.layout_version != KVPOOL_LAYOUT_VERSION) {
		log_info("leftover %s is not a KV pool of layout %d: it is replaced at configure", kv->shm_name,
			 KVPOOL_LAYOUT_VERSION);
		return 0;
	}
	if (shm_owner_alive(&hdr.shm)) {
		snprintf(err, errlen, "KV pool %s is owned by the live process %d: stop that kv-store first or pick "
			 "another --instance", kv->shm_name, (int)hdr.shm.owner_pid);
		return -EBUSY;
	}
	struct layout l;
	if (!atomic_load(&hdr.shm.ready) || layout_compute(hdr.block_bytes, hdr.n_slots, hdr.n_spill_slots, &l) ||
	    !header_matches(&hdr, &l) || (uint64_t)st.st_size != l.total) {
		log_warn("leftover KV pool %s is incomplete or inconsistent: it is replaced at configure",
			 kv->shm_name);
		return 0;
	}
	struct shm_object *o = NULL;
	bool adopted = false;
	int rc = create_object(kv, &l, SHM_ADOPT, &o, &adopted, err, errlen);
	if (rc)
		return rc;
	if (!adopted || !header_matches(shm_object_base(o), &l)) {
		/* The leftover went or changed between the look and the map: nothing to adopt. */
		shm_object_close(&o, !adopted);
		return 0;
	}
	rc = adopt_object(kv, &o, &l, err, errlen);
	if (rc)
		return rc;
	uint64_t want_slots = kv->dram_budget / l.block_bytes, want_spill = kv->disk_budget / l.block_bytes;
	if (want_slots != l.n_slots || want_spill != l.n_spill)
		log_info("the adopted KV pool keeps its geometry (%u blocks, %u spill blocks of %llu bytes); the "
			 "budgets given (%llu and %llu blocks) apply when it is next reconfigured", l.n_slots,
			 l.n_spill, (unsigned long long)l.block_bytes, (unsigned long long)want_slots,
			 (unsigned long long)want_spill);
	return 1;
}

int kvstore_configure(struct kvstore *kv, uint64_t block_bytes, uint64_t manifest_hash, char *err, size_t errlen)
{
	char a[32], b[32];
	if (block_bytes == 0 || block_bytes % 4096) {
		snprintf(err, errlen, "block_bytes %llu is not a positive multiple of 4096",
			 (unsigned long long)block_bytes);
		return -EINVAL;
	}
	uint64_t n_slots = kv->dram_budget / block_bytes, n_spill = kv->disk_budget / block_bytes;
	if (n_slots == 0) {
		snprintf(err, errlen, "kv-dram-budget %s holds no block of %llu bytes; need at least %llu",
			 format_size(kv->dram_budget, a, sizeof(a)), (unsigned long long)block_bytes,
			 (unsigned long long)block_bytes);
		return -EINVAL;
	}
	struct layout l;
	if (layout_compute(block_bytes, n_slots, n_spill, &l)) {
		snprintf(err, errlen, "kv-dram-budget %s and kv-disk-budget %s make %llu blocks of %llu bytes: too "
			 "many (at most 2^31)", format_size(kv->dram_budget, a, sizeof(a)),
			 format_size(kv->disk_budget, b, sizeof(b)), (unsigned long long)(n_slots + n_spill),
			 (unsigned long long)block_bytes);
		return -EINVAL;
	}
	if (kv->h) {
		struct kvpool_header *h = kv->h;
		if (h->block_bytes == block_bytes && h->manifest_hash == manifest_hash)
			return 0;
		uint32_t live = 0;
		for (uint32_t i = 0; i < h->n_handles; i++) {
			const struct kvpool_handle *hd = &kv->handles[i];
			live += hd->state == KVH_WRITING || (hd->state == KVH_COMMITTED && hd->refs);
		}
		if (live) {
			snprintf(err, errlen, "the KV pool holds %u live blocks (referenced or being written) of %llu "
				 "bytes for model %016llx; free them before configuring blocks of %llu bytes for model "
				 "%016llx", live,
				 (unsigned long long)h->block_bytes, (unsigned long long)h->manifest_hash,
				 (unsigned long long)block_bytes, (unsigned long long)manifest_hash);
			return -EBUSY;
		}
		log_info("reconfiguring the KV pool: blocks of %llu bytes for model %016llx; %u cached blocks dropped",
			 (unsigned long long)block_bytes, (unsigned long long)manifest_hash,
			 h->n_handles - kv->n_free_handles);
		/* Keep the spill file: it is truncated when reopened below. */
		spill_close(&kv->spill, false);
		pool_close(kv, true);
	}
	struct shm_object *o = NULL;
	bool adopted = false;
	int rc = create_object(kv, &l, SHM_ADOPT, &o, &adopted, err, errlen);
	if (rc)
		return rc;
	if (adopted) {
		struct kvpool_header *h = shm_object_base(o);
		if (header_matches(h, &l) && h->block_bytes == block_bytes && h->manifest_hash == manifest_hash) {
			rc = adopt_object(kv, &o, &l, err, errlen);
			if (rc == 0)
				log_info("KV pool %s adopted at configure", kv->shm_name);
			return rc;
		}
		log_info("leftover KV pool %s holds blocks of another size or model: replaced", kv->shm_name);
		shm_object_close(&o, true);
		rc = create_object(kv, &l, SHM_RECLAIM, &o, &adopted, err, errlen);
		if (rc)
			return rc;
	}
	rc = init_object(kv, &o, &l, manifest_hash, err, errlen);
	if (rc)
		return rc;
	log_info("KV pool %s: %u blocks of %llu bytes in %s of shared memory, %u spill blocks", kv->shm_name,
		 l.n_slots, (unsigned long long)block_bytes, format_size(l.total, a, sizeof(a)), l.n_spill);
	return 0;
}

void kvstore_info(const struct kvstore *kv, struct kvstore_info *out)
{
	memset(out, 0, sizeof(*out));
	out->shm_name = "";
	if (!kv->h)
		return;
	out->configured = true;
	out->shm_name = kv->shm_name;
	out->shm_size = shm_object_size(kv->shm);
	out->n_slots = kv->h->n_slots;
	out->n_spill_slots = kv->h->n_spill_slots;
	out->block_bytes = kv->h->block_bytes;
	out->manifest_hash = kv->h->manifest_hash;
	out->epoch = kv->h->pool_epoch;
}

struct kvpool_header *kvstore_header(const struct kvstore *kv)
{
	return kv->h;
}

bool kvstore_adopted(const struct kvstore *kv)
{
	return kv->adopted;
}

bool kvstore_o_direct(const struct kvstore *kv)
{
	return kv->spill && spill_o_direct(kv->spill);
}

bool kvstore_persistent(const struct kvstore *kv)
{
	return kv->persistent;
}

/* ---- request validation ---- */

static int not_configured(const struct kvstore *kv, char *err, size_t errlen)
{
	snprintf(err, errlen, "the KV pool is not configured yet: send MSG_KV_CONFIGURE first");
	return -EINVAL;
}

static int check_count(uint32_t n, char *err, size_t errlen)
{
	if (n > KVSTORE_MAX_REQUEST) {
		snprintf(err, errlen, "a request names %u blocks; at most %u per request", n, KVSTORE_MAX_REQUEST);
		return -EINVAL;
	}
	return 0;
}

/* Checks that hv names a live handle not yet seen in this request (stamp). Returns its index
 * or -EINVAL with err naming the handle and what is wrong. */
static int64_t check_handle(struct kvstore *kv, uint64_t hv, uint32_t stamp, char *err, size_t errlen)
{
	uint32_t idx = kv_handle_index(hv), gen = kv_handle_generation(hv);
	if (idx >= kv->h->n_handles) {
		snprintf(err, errlen, "handle 0x%llx is invalid: index %u is past the pool's %u handles",
			 (unsigned long long)hv, idx, kv->h->n_handles);
		return -EINVAL;
	}
	const struct kvpool_handle *hd = &kv->handles[idx];
	if (hd->generation != gen) {
		snprintf(err, errlen, "handle 0x%llx is stale: generation %u, the handle is now at generation %u%s",
			 (unsigned long long)hv, gen, hd->generation,
			 hd->state == KVH_FREE ? " (the block was freed)" : "");
		return -EINVAL;
	}
	if (hd->state == KVH_FREE) {
		snprintf(err, errlen, "handle 0x%llx is not allocated", (unsigned long long)hv);
		return -EINVAL;
	}
	if (kv->mark[idx] == stamp) {
		snprintf(err, errlen, "handle 0x%llx appears twice in the request", (unsigned long long)hv);
		return -EINVAL;
	}
	kv->mark[idx] = stamp;
	return idx;
}

/* The checks every request on handles starts with: a configured pool, a count within limits,
 * and handles that are valid, allocated and each named once. stamp (may be NULL) receives the
 * request's stamp: kv->mark[index] == stamp for the handles it names. Returns 0 or -errno (err
 * says why). */
static int check_handles(struct kvstore *kv, const uint64_t *handles, uint32_t n, uint32_t *stamp, char *err,
			 size_t errlen)
{
	if (!kv->h)
		return not_configured(kv, err, errlen);
	int rc = check_count(n, err, errlen);
	if (rc)
		return rc;
	uint32_t st = next_stamp(kv);
	for (uint32_t i = 0; i < n; i++) {
		int64_t idx = check_handle(kv, handles[i], st, err, errlen);
		if (idx < 0)
			return (int)idx;
	}
	if (stamp)
		*stamp = st;
	return 0;
}

/* ---- eviction ---- */

/* An LRU candidate: a pool slot (victims) or a handle index (cached blocks in the spill file). */
struct victim {
	uint64_t last_use;
	uint32_t id;
};

static int victim_cmp(const void *a, const void *b)
{
	const struct victim *x = a, *y = b;
	if (x->last_use != y->last_use)
		return x->last_use < y->last_use ? -1 : 1;
	return x->id < y->id ? -1 : x->id > y->id;
}

/* Fills v (n_slots entries) with the evictable slots, least recently used first: COMMITTED,
 * unpinned and, with exclude_stamp, not holding a block the current request names. Returns
 * how many there are. */
static uint32_t collect_victims(struct kvstore *kv, uint32_t exclude_stamp, struct victim *v)
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
	qsort(v, nv, sizeof(*v), victim_cmp);
	return nv;
}

static int pool_full(struct kvstore *kv, uint32_t evictable, uint32_t asked, char *err, size_t errlen)
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
				while (victim_cmp(&v[i], &p) < 0)
					i++;
				while (victim_cmp(&v[j], &p) > 0)
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
	qsort(v, n, sizeof(*v), victim_cmp);
}

/* Fills d (n_spill_slots entries) with the cached blocks in the spill file (handle indexes),
 * leaving out those the current request names (exclude_stamp); the `want` least recently used
 * come first, in order. Returns how many there are. */
static uint32_t collect_spilled_cached(struct kvstore *kv, uint32_t exclude_stamp, uint32_t want, struct victim *d)
{
	uint32_t n = 0;
	for (uint32_t i = 0; i < kv->h->n_handles; i++) {
		const struct kvpool_handle *hd = &kv->handles[i];
		if (hd->location != KVLOC_SPILL || !cached(kv, i))
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
	block_retire(kv, idx);
	atomic_fetch_add(&kv->h->store.cache_drops, 1);
}

/* Frees `need` slots by spilling the least-recently-used evictable blocks (see
 * collect_victims) in one io_uring batch. When the spill file lacks free slots, cached blocks
 * make room: the least recently used in the spill file are dropped first, then (when that is
 * not enough) the least recently used cached ones among the pool's victims are dropped
 * instead of spilled. The plan is checked whole before anything changes. Returns 0; -ENOSPC
 * (not enough evictable blocks, or spill slots even after every drop; nothing changed); -EIO
 * (the drops stand, the blocks whose writes succeeded are spilled, the others stay in the
 * pool); -ENOMEM. */
static int make_room(struct kvstore *kv, uint32_t need, uint32_t exclude_stamp, uint32_t asked, char *err,
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
	uint32_t nv = collect_victims(kv, exclude_stamp, v);
	if (nv < need) {
		rc = pool_full(kv, nv, asked, err, errlen);
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
			nc += cached(kv, kv->slots[v[k].id].handle_index);
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
		if (dropped < n_pd && cached(kv, idx)) {
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
		/* The handle moves first, the slot frees after (slot_release's atomic store orders
		 * them): recover_tables frees a SPILLING slot whose handle points into the file. */
		uint32_t idx = sl->handle_index;
		struct kvpool_handle *hd = &kv->handles[idx];
		hd->where = ios[k].slot;
		/* Kept in this order for a crash (not for another thread): "pool" with a spill
		 * index is recovered from the SPILLING slot that names the handle. */
		atomic_signal_fence(memory_order_seq_cst);
		hd->location = KVLOC_SPILL;
		slot_release(kv, s);
		index_put(kv, ios[k].slot, idx); /* after the bytes landed */
		atomic_fetch_add(&h->store.spills, 1);
		atomic_fetch_add(&h->store.spill_bytes_written, h->block_bytes);
	}
	publish_usage(kv);
out_free:
	free(ios);
	free(sd);
	free(v);
	return rc;
}

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
	block_retire(kv, idx);
	return -EIO;
}

/* ---- requests ---- */

int kvstore_alloc(struct kvstore *kv, uint32_t count, uint64_t *handles, uint64_t *offsets, char *err,
		  size_t errlen)
{
	if (!kv->h)
		return not_configured(kv, err, errlen);
	struct kvpool_header *h = kv->h;
	if (count == 0) {
		snprintf(err, errlen, "ALLOC of 0 blocks: count must be at least 1");
		return -EINVAL;
	}
	int rc = check_count(count, err, errlen);
	if (rc)
		return rc;
	if (count > h->n_slots) {
		snprintf(err, errlen, "ALLOC of %u blocks exceeds the KV pool's %u blocks (raise --kv-dram-budget)",
			 count, h->n_slots);
		return -ENOSPC;
	}
	park(kv);
	if (count > kv->n_free_slots) {
		rc = make_room(kv, count - kv->n_free_slots, 0, count, err, errlen);
		if (rc == -ENOSPC && kv->n_parked_slots) {
			unpark_slots(kv, count - kv->n_free_slots);
			rc = count > kv->n_free_slots ? make_room(kv, count - kv->n_free_slots, 0, count, err, errlen) : 0;
		}
		if (rc)
			return rc;
	}
	assert(kv->n_free_slots >= count && kv->n_free_handles >= count);
	for (uint32_t i = 0; i < count; i++) {
		uint32_t s = kv->free_slots[--kv->n_free_slots];
		uint32_t idx = kv->free_handles[--kv->n_free_handles];
		struct kvpool_handle *hd = &kv->handles[idx];
		hd->state = KVH_WRITING;
		hd->location = KVLOC_POOL;
		hd->where = s;
		hd->checksum = 0;
		hd->key = 0;
		hd->refs = 1;
		struct kvpool_slot *sl = &kv->slots[s];
		atomic_store_explicit(&sl->ready, 0, memory_order_relaxed);
		sl->pins = 1;
		sl->handle_index = idx;
		touch(kv, idx);
		atomic_store(&sl->state, KVSLOT_WRITING);
		handles[i] = kv_handle_make(idx, hd->generation);
		offsets[i] = slot_data_offset(kv, s);
	}
	atomic_fetch_add(&h->store.allocs, count);
	publish_usage(kv);
	return 0;
}

int kvstore_mark_ready(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen)
{
	int rc = check_handles(kv, handles, n, NULL, err, errlen);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n; i++) {
		const struct kvpool_handle *hd = &kv->handles[kv_handle_index(handles[i])];
		if (hd->state == KVH_WRITING)
			atomic_store_explicit(&kv->slots[hd->where].ready, 1, memory_order_release);
	}
	return 0;
}

int kvstore_commit(struct kvstore *kv, const uint64_t *handles, const uint64_t *keys, uint32_t n, char *err,
		   size_t errlen)
{
	int rc = check_handles(kv, handles, n, NULL, err, errlen);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t idx = kv_handle_index(handles[i]);
		const struct kvpool_handle *hd = &kv->handles[idx];
		uint64_t key = keys ? keys[i] : 0;
		if (hd->state != KVH_WRITING && hd->key != key) {
			snprintf(err, errlen, "handle 0x%llx is already committed with key %016llx; this commit gives "
				 "key %016llx", (unsigned long long)handles[i], (unsigned long long)hd->key,
				 (unsigned long long)key);
			return -EINVAL;
		}
	}
	for (uint32_t i = 0; i < n; i++) {
		const struct kvpool_handle *hd = &kv->handles[kv_handle_index(handles[i])];
		/* Pairs with the runner's release store of ready after its copy into the slot. */
		if (hd->state == KVH_WRITING &&
		    !atomic_load_explicit(&kv->slots[hd->where].ready, memory_order_acquire)) {
			snprintf(err, errlen, "block 0x%llx not ready: its copy has not completed",
				 (unsigned long long)handles[i]);
			return -EAGAIN;
		}
	}
	uint32_t done = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t idx = kv_handle_index(handles[i]);
		struct kvpool_handle *hd = &kv->handles[idx];
		if (hd->state != KVH_WRITING)
			continue; /* resent: committed already with this key */
		struct kvpool_slot *sl = &kv->slots[hd->where];
		hd->checksum = crc32c(0, slot_data(kv, hd->where), kv->h->block_bytes);
		hd->key = keys ? keys[i] : 0;
		hd->state = KVH_COMMITTED;
		atomic_store(&sl->state, KVSLOT_COMMITTED);
		if (sl->pins)
			sl->pins--;
		atomic_store_explicit(&sl->ready, 0, memory_order_relaxed);
		touch(kv, idx);
		done++;
		if (!hd->key)
			continue;
		/* The newest block with a key is the one LOOKUP finds. The one it replaces goes now
		 * when nothing references it, else at its last FREE (it is no longer indexed). */
		uint32_t old = keymap_get(kv->keys, hd->key);
		keymap_put(kv->keys, hd->key, idx);
		if (old == KV_NONE)
			continue;
		if (kv->handles[old].refs == 0) {
			log_debug("KV block 0x%llx replaces cached block 0x%llx of key %016llx",
				  (unsigned long long)handles[i], (unsigned long long)handle_value(kv, old),
				  (unsigned long long)hd->key);
			block_retire(kv, old);
		} else if (kv->handles[old].location == KVLOC_SPILL) {
			index_put(kv, kv->handles[old].where, old); /* no longer indexed: its record goes */
		}
	}
	atomic_fetch_add(&kv->h->store.commits, done);
	publish_usage(kv);
	return 0;
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
			slot_release(kv, s);
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
			slot_release(kv, s);
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
		spill_slot_free(kv, j);
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
	if (collect_victims(kv, stamp, v) == 0) {
		/* kvstore_fetch checked there are enough; reaching this is a bug. */
		rc = pool_full(kv, 0, 1, err, errlen);
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
		log_warn("KV block 0x%llx: a failed write may have damaged its spill slot; its checksum will tell",
			 (unsigned long long)handles[pos]);
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
	atomic_signal_fence(memory_order_seq_cst); /* as in make_room */
	victim->location = KVLOC_SPILL;
	index_put(kv, j, victim_idx);
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
	int rc = check_handles(kv, handles, n, &stamp, err, errlen);
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
	park(kv);
	if (n_load > kv->n_free_slots) {
		/* All or nothing: the room must exist before anything moves. */
		v = malloc(sizeof(*v) * h->n_slots);
		if (!v) {
			snprintf(err, errlen, "out of memory fetching %u blocks", n);
			rc = -ENOMEM;
			goto out_free;
		}
		uint32_t nv = collect_victims(kv, stamp, v);
		if (nv + kv->n_free_slots < n_load)
			unpark_slots(kv, n_load - nv - kv->n_free_slots);
		if (nv + kv->n_free_slots < n_load) {
			rc = pool_full(kv, nv, n_load, err, errlen);
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
		touch(kv, kv_handle_index(handles[i]));
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
			rc = make_room(kv, want, stamp, n_load, err, errlen);
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
	publish_usage(kv);
out_free:
	free(v);
	free(loads);
	return rc;
}

int kvstore_unpin(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen)
{
	int rc = check_handles(kv, handles, n, NULL, err, errlen);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t idx = kv_handle_index(handles[i]);
		const struct kvpool_handle *hd = &kv->handles[idx];
		if (hd->state != KVH_COMMITTED) {
			snprintf(err, errlen, "handle 0x%llx is being written: commit or free it, not unpin",
				 (unsigned long long)handles[i]);
			return -EINVAL;
		}
		if (hd->location != KVLOC_POOL || kv->slots[hd->where].pins == 0) {
			snprintf(err, errlen, "handle 0x%llx is not pinned%s", (unsigned long long)handles[i],
				 hd->location == KVLOC_SPILL ? " (it sits in the spill file)" : "");
			return -EINVAL;
		}
	}
	for (uint32_t i = 0; i < n; i++)
		kv->slots[kv->handles[kv_handle_index(handles[i])].where].pins--;
	return 0;
}

int kvstore_free(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen)
{
	int rc = check_handles(kv, handles, n, NULL, err, errlen);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t idx = kv_handle_index(handles[i]);
		if (kv->handles[idx].refs == 0) {
			snprintf(err, errlen, "handle 0x%llx holds no reference to free: the block is cached",
				 (unsigned long long)handles[i]);
			return -EINVAL;
		}
	}
	for (uint32_t i = 0; i < n; i++) {
		uint32_t idx = kv_handle_index(handles[i]);
		struct kvpool_handle *hd = &kv->handles[idx];
		if (--hd->refs)
			continue;
		if (!indexed(kv, idx)) {
			block_retire(kv, idx);
			continue;
		}
		/* Cached: nobody holds it, so nobody holds a pin on it either. */
		if (hd->location == KVLOC_POOL)
			kv->slots[hd->where].pins = 0;
	}
	atomic_fetch_add(&kv->h->store.frees, n);
	publish_usage(kv);
	return 0;
}

int kvstore_lookup(struct kvstore *kv, const uint64_t *keys, uint32_t n, uint64_t *handles, char *err,
		   size_t errlen)
{
	if (!kv->h)
		return not_configured(kv, err, errlen);
	int rc = check_count(n, err, errlen);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t idx = keymap_get(kv->keys, keys[i]);
		if (idx != KV_NONE && kv->handles[idx].refs > UINT32_MAX - n) {
			snprintf(err, errlen, "block 0x%llx of key %016llx holds %u references: no more can be taken",
				 (unsigned long long)handle_value(kv, idx), (unsigned long long)keys[i],
				 kv->handles[idx].refs);
			return -EINVAL;
		}
	}
	uint64_t hits = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t idx = keymap_get(kv->keys, keys[i]);
		if (idx == KV_NONE) {
			handles[i] = 0;
			continue;
		}
		kv->handles[idx].refs++;
		touch(kv, idx);
		handles[i] = handle_value(kv, idx);
		hits++;
	}
	atomic_fetch_add(&kv->h->store.prefix_hits, hits);
	atomic_fetch_add(&kv->h->store.prefix_misses, n - hits);
	return 0;
}

uint64_t kvstore_unpin_all(struct kvstore *kv)
{
	if (!kv->h)
		return 0;
	uint64_t pins = 0;
	for (uint32_t s = 0; s < kv->h->n_slots; s++) {
		pins += kv->slots[s].pins;
		kv->slots[s].pins = 0;
	}
	return pins;
}

/* Every reference and pin goes: what a new runner does not hold. */
static void reset_refs(struct kvstore *kv, struct kvstore_hello *out)
{
	memset(out, 0, sizeof(*out));
	out->pins = kvstore_unpin_all(kv);
	for (uint32_t idx = 0; idx < kv->h->n_handles; idx++) {
		struct kvpool_handle *hd = &kv->handles[idx];
		if (hd->state == KVH_FREE)
			continue;
		hd->refs = 0;
		if (indexed(kv, idx)) {
			out->cached++;
			continue;
		}
		out->writing += hd->state == KVH_WRITING;
		out->freed++;
		block_retire(kv, idx);
	}
	publish_usage(kv);
}

void kvstore_runner_hello(struct kvstore *kv, uint64_t session, struct kvstore_hello *out)
{
	memset(out, 0, sizeof(*out));
	kv->session = session;
	kv->session_known = true;
	if (!kv->h) {
		kv->session_pending = true;
		out->pending = true;
		return;
	}
	if (session != 0 && session == kv->h->runner_session) {
		out->kept = true;
		return;
	}
	reset_refs(kv, out);
	kv->h->runner_session = session;
}

/* ---- persistence at a clean stop ---- */

static int victim_cmp_recent(const void *a, const void *b)
{
	return -victim_cmp(a, b);
}

/* The spill file keeps the most recently used keyed blocks it can hold, wherever they are
 * now: pool blocks among them are written into spill slots that no kept block holds, then the
 * index is rewritten whole and both files synced. The pool is about to be unlinked, so its
 * tables are changed only as far as index_rewrite reads them. */
static void persist_at_stop(struct kvstore *kv)
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
		if (indexed(kv, i) && (kv->handles[i].location == KVLOC_POOL || kv->handles[i].location == KVLOC_SPILL))
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
	if (index_rewrite(kv, err, sizeof(err)) != 0) {
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

/* ---- live tuning ---- */

#define ENFORCE_BATCH 256 /* blocks spilled per enforcement: the loop stays responsive */

/* Pool slots whose block cannot leave now: being written, pinned, or in the middle of I/O. */
static uint32_t unspillable_slots(const struct kvstore *kv)
{
	uint32_t n = 0;
	for (uint32_t s = 0; s < kv->h->n_slots; s++) {
		uint32_t st = atomic_load(&kv->slots[s].state);
		n += st != KVSLOT_FREE && (st != KVSLOT_COMMITTED || kv->slots[s].pins != 0);
	}
	return n;
}

static uint32_t cached_blocks(const struct kvstore *kv)
{
	uint32_t n = 0;
	for (uint32_t i = 0; i < kv->h->n_handles; i++)
		n += cached(kv, i);
	return n;
}

static uint32_t pool_used(const struct kvstore *kv)
{
	return kv->h->n_slots - kv->n_free_slots - kv->n_parked_slots;
}

void kvstore_enforce_budgets(struct kvstore *kv)
{
	if (!kv->h || !(kv->dram_tuned || kv->disk_tuned))
		return; /* nothing tuned: the pool as laid out */
	park(kv);
	uint32_t cap = slot_cap(kv), used = pool_used(kv);
	if (used <= cap) {
		if (kv->enforce_warned)
			log_info("kv-dram-budget: the pool holds %u blocks, within the budget of %u", used, cap);
		kv->enforce_warned = false;
		return;
	}
	uint64_t now = now_ns();
	if (now < kv->enforce_after_ns)
		return;
	uint32_t need = used - cap, evictable = 0;
	for (uint32_t s = 0; s < kv->h->n_slots; s++)
		evictable += atomic_load(&kv->slots[s].state) == KVSLOT_COMMITTED && kv->slots[s].pins == 0;
	if (need > evictable)
		need = evictable; /* the rest is pinned now: spilled once released */
	if (need > ENFORCE_BATCH)
		need = ENFORCE_BATCH;
	if (need == 0)
		return;
	char err[512];
	int rc = make_room(kv, need, 0, need, err, sizeof(err));
	if (rc) {
		if (!kv->enforce_warned)
			log_warn("kv-dram-budget: cannot spill the pool down to its budget of %u blocks now (%u in use): "
				 "%s; trying again every second", cap, used, err);
		kv->enforce_warned = true;
		kv->enforce_after_ns = now + 1000000000ull;
		return;
	}
	log_debug("kv-dram-budget: spilled %u blocks toward the budget of %u", need, cap);
	park(kv);
	if (pool_used(kv) <= cap)
		log_info("kv-dram-budget: spilled down to the budget: %u blocks in the pool (at most %u)", pool_used(kv),
			 cap);
}

void kvstore_dram_range(const struct kvstore *kv, uint64_t *min, uint64_t *max)
{
	*min = kv->h ? kv->h->block_bytes : 4096;
	*max = kv->h ? (uint64_t)kv->h->n_slots * kv->h->block_bytes : kv->dram_budget;
}

void kvstore_disk_range(const struct kvstore *kv, uint64_t *min, uint64_t *max)
{
	*min = 0;
	*max = kv->h ? (uint64_t)kv->h->n_spill_slots * kv->h->block_bytes : kv->disk_budget;
}

uint64_t kvstore_dram_budget(const struct kvstore *kv)
{
	return kv->dram_tuned || !kv->h ? kv->dram_limit : (uint64_t)kv->h->n_slots * kv->h->block_bytes;
}

uint64_t kvstore_disk_budget(const struct kvstore *kv)
{
	return kv->disk_tuned || !kv->h ? kv->disk_limit : (uint64_t)kv->h->n_spill_slots * kv->h->block_bytes;
}

int kvstore_set_dram_budget(struct kvstore *kv, uint64_t bytes, bool apply, char *why, size_t whylen)
{
	char a[32], b[32], c[32];
	if (kv->h) {
		uint64_t bb = kv->h->block_bytes;
		uint32_t cap = (uint32_t)(bytes / bb);
		if (cap == 0)
			return errorf(why, whylen, -ERANGE, "%s holds no KV block of %s",
				      tunable_format_bytes((int64_t)bytes, a, sizeof(a)),
				      tunable_format_bytes((int64_t)bb, b, sizeof(b)));
		uint32_t pinned = unspillable_slots(kv), used = pool_used(kv);
		if (cap < pinned)
			return errorf(why, whylen, -EBUSY,
				      "%s is below the %s the runner holds pinned or is writing in the pool (%u blocks); "
				      "try again between requests",
				      tunable_format_bytes((int64_t)bytes, a, sizeof(a)),
				      tunable_format_bytes((int64_t)(pinned * bb), b, sizeof(b)), pinned);
		uint32_t over = used > cap ? used - cap : 0, cached_n = cached_blocks(kv);
		if (over > kv->n_free_spill + cached_n)
			return errorf(why, whylen, -ENOSPC,
				      "spilling down to %s moves %u blocks to the spill file, which has room for %u (kv-disk-budget "
				      "%s) and %u cached blocks to drop",
				      tunable_format_bytes((int64_t)bytes, a, sizeof(a)), over, kv->n_free_spill,
				      tunable_format_bytes((int64_t)kvstore_disk_budget(kv), c, sizeof(c)), cached_n);
	}
	if (!apply)
		return 0;
	kv->dram_limit = bytes;
	kv->dram_tuned = true;
	kv->enforce_after_ns = 0;
	kv->enforce_warned = false;
	kvstore_enforce_budgets(kv); /* the first batch now, the rest on the next ticks */
	return 0;
}

int kvstore_set_disk_budget(struct kvstore *kv, uint64_t bytes, bool apply, char *why, size_t whylen)
{
	char a[32], b[32];
	if (kv->h) {
		uint64_t bb = kv->h->block_bytes;
		uint32_t used = kv->h->n_spill_slots - kv->n_free_spill - kv->n_parked_spill;
		if (bytes / bb < used)
			return errorf(why, whylen, -EBUSY, "%s is below the %s already in use in the spill file (%u blocks)",
				      tunable_format_bytes((int64_t)bytes, a, sizeof(a)),
				      tunable_format_bytes((int64_t)(used * bb), b, sizeof(b)), used);
	}
	if (!apply)
		return 0;
	kv->disk_limit = bytes;
	kv->disk_tuned = true;
	kv->enforce_after_ns = 0;
	park(kv);
	return 0;
}

uint32_t kvstore_io_depth(const struct kvstore *kv)
{
	return kv->io_depth;
}

uint32_t kvstore_io_limit(const struct kvstore *kv)
{
	return kv->io_limit;
}

int kvstore_set_io_limit(struct kvstore *kv, uint32_t n)
{
	if (n < 1 || n > kv->io_depth)
		return -EINVAL;
	kv->io_limit = n;
	if (kv->spill)
		spill_set_limit(kv->spill, n);
	return 0;
}

/* ---- stats ---- */

static int set_u64(json_t *o, const char *key, uint64_t v)
{
	return json_object_set_new(o, key, json_integer((json_int_t)v));
}

char *kvstore_stats_json(const struct kvstore *kv)
{
	json_t *o = json_object();
	if (!o)
		return NULL;
	struct kvpool_header *h = kv->h;
	int rc = 0;
#define STORE(field) (h ? atomic_load(&h->store.field) : 0)
	rc |= set_u64(o, "pool_blocks", h ? h->n_slots : 0);
	rc |= set_u64(o, "pool_used", STORE(slots_used));
	rc |= set_u64(o, "spill_blocks", h ? h->n_spill_slots : 0);
	rc |= set_u64(o, "spill_used", STORE(spill_used));
	rc |= set_u64(o, "block_bytes", h ? h->block_bytes : 0);
	rc |= set_u64(o, "allocs", STORE(allocs));
	rc |= set_u64(o, "commits", STORE(commits));
	rc |= set_u64(o, "frees", STORE(frees));
	rc |= set_u64(o, "fetches", STORE(fetches));
	rc |= set_u64(o, "fetches_from_disk", STORE(fetches_from_disk));
	rc |= set_u64(o, "spills", STORE(spills));
	rc |= set_u64(o, "spill_bytes_written", STORE(spill_bytes_written));
	rc |= set_u64(o, "spill_bytes_read", STORE(spill_bytes_read));
	rc |= set_u64(o, "checksum_failures", STORE(checksum_failures));
	rc |= set_u64(o, "live_handles", h ? h->n_handles - kv->n_free_handles : 0);
	rc |= set_u64(o, "prefix_hits", STORE(prefix_hits));
	rc |= set_u64(o, "prefix_misses", STORE(prefix_misses));
	rc |= set_u64(o, "cache_drops", STORE(cache_drops));
	uint64_t n_cached = 0, n_referenced = 0;
	for (uint32_t i = 0; h && i < h->n_handles; i++) {
		const struct kvpool_handle *hd = &kv->handles[i];
		n_cached += hd->state == KVH_COMMITTED && hd->refs == 0;
		n_referenced += hd->state != KVH_FREE && hd->refs > 0;
	}
	rc |= set_u64(o, "cached_blocks", n_cached);
	rc |= set_u64(o, "referenced_blocks", n_referenced);
	rc |= set_u64(o, "dram_budget", kvstore_dram_budget(kv));
	rc |= set_u64(o, "disk_budget", kvstore_disk_budget(kv));
	rc |= set_u64(o, "pool_limit_blocks", h ? slot_cap(kv) : 0);
	rc |= set_u64(o, "spill_limit_blocks", h ? spill_cap(kv) : 0);
	rc |= set_u64(o, "spill_io_depth", kv->io_limit);
	/* Pool blocks by state (for pipeline-inspect): one pass over the slot table. Spills and
	 * read-backs run inside a request, so between requests the queues read 0; an outside
	 * reader of the pool's slot table sees them in flight. */
	uint64_t by_state[KVSLOT_LOADING + 1] = {0}, pinned = 0;
	for (uint32_t s = 0; h && s < h->n_slots; s++) {
		uint32_t st = atomic_load_explicit(&kv->slots[s].state, memory_order_relaxed);
		by_state[st <= KVSLOT_LOADING ? st : KVSLOT_FREE]++;
		pinned += kv->slots[s].pins > 0;
	}
	rc |= json_object_set_new(o, "blocks_by_state",
				  json_pack("{s:I, s:I, s:I, s:I, s:I}", "free", (json_int_t)by_state[KVSLOT_FREE],
					    "writing", (json_int_t)by_state[KVSLOT_WRITING], "committed",
					    (json_int_t)by_state[KVSLOT_COMMITTED], "spilling",
					    (json_int_t)by_state[KVSLOT_SPILLING], "loading",
					    (json_int_t)by_state[KVSLOT_LOADING]));
	rc |= set_u64(o, "pinned_blocks", pinned);
	rc |= set_u64(o, "spill_queue", by_state[KVSLOT_SPILLING]);
	rc |= set_u64(o, "fetch_queue", by_state[KVSLOT_LOADING]);
#undef STORE
	rc |= json_object_set_new(o, "o_direct", json_boolean(kvstore_o_direct(kv)));
	rc |= json_object_set_new(o, "adopted", json_boolean(kv->adopted));
	rc |= json_object_set_new(o, "persistent", json_boolean(kv->persistent));
	rc |= json_object_set_new(o, "configured", json_boolean(h != NULL));
	char *text = rc ? NULL : json_dumps(o, JSON_COMPACT);
	json_decref(o);
	return text;
}

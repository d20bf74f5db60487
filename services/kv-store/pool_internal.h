/* pool_internal.h - what the parts of the kv-store's block pool share (pool.h is the public
 * interface): the kvstore struct and the helpers one part defines and another calls. Private to
 * services/kv-store/pool*.c; tests use pool.h.
 *
 *   pool.c           create/destroy, the private tables' memory, the read-only accessors
 *   pool_blocks.c    free lists and usage counters; a block's use, caching and retirement
 *   pool_layout.c    the geometry, a fresh layout, MSG_KV_CONFIGURE
 *   pool_adopt.c     adopting a dead predecessor's pool and recovering its tables
 *   pool_evict.c     LRU victims and make_room (spilling, and dropping cached blocks)
 *   pool_requests.c  request validation, ALLOC/COMMIT/UNPIN/FREE/LOOKUP, runner sessions
 *   pool_fetch.c     FETCH: reading spilled blocks back, checksums, the swap through a bounce
 *   pool_persist.c   the on-disk index (records, load, rewrite) and the write-out at a clean stop
 *   pool_tune.c      the budgets now: parked slots, enforcement, the tunables
 *   pool_stats.c     the counters as JSON
 *
 * Shared helpers carry the kvs_ prefix (the kv-store's library is linked beside others');
 * helpers used in one file stay static there. Single-threaded, as the pool is.
 */
#ifndef PIPELINE_KVSTORE_POOL_INTERNAL_H
#define PIPELINE_KVSTORE_POOL_INTERNAL_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_pool.h"
#include "common/shm.h"
#include "services/kv-store/kvindex.h"
#include "services/kv-store/pool.h"

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

/* An LRU candidate: a pool slot (victims) or a handle index (cached blocks in the spill file). */
struct victim {
	uint64_t last_use;
	uint32_t id;
};

/* ---- geometry of the live pool ---- */

static inline uint64_t slot_data_offset(const struct kvstore *kv, uint32_t s)
{
	return kv->h->data_off + (uint64_t)s * kv->h->block_bytes;
}

static inline void *slot_data(const struct kvstore *kv, uint32_t s)
{
	return (char *)kv->h + slot_data_offset(kv, s);
}

static inline uint64_t handle_value(const struct kvstore *kv, uint32_t idx)
{
	return kv_handle_make(idx, kv->handles[idx].generation);
}

/* ---- pool.c ---- */

/* Allocates the private tables for geometry l. Returns 0 or -ENOMEM (nothing left allocated). */
int kvs_private_alloc(struct kvstore *kv, const struct layout *l);
/* Unmaps the pool and closes the spill file (and index); with remove, unlinks the pool and
 * deletes the spill file, unless it persists. */
void kvs_pool_close(struct kvstore *kv, bool remove);

/* ---- pool_blocks.c ---- */

/* The pool's and the spill file's slots in use, published in the header's counters. */
void kvs_publish_usage(struct kvstore *kv);
/* Rebuilds the private free lists from the shared tables. Returns 0 or -ENOMEM. */
int kvs_rebuild_free_lists(struct kvstore *kv);
void kvs_slot_reset(struct kvpool_slot *sl);
/* Frees pool slot s to the free list. */
void kvs_slot_release(struct kvstore *kv, uint32_t s);
/* A handle's fields cleared and its generation bumped: its value goes stale. */
void kvs_handle_reset(struct kvpool_handle *hd);
/* Is idx the block the prefix index names for its key? Only such a block can be cached. */
bool kvs_indexed(const struct kvstore *kv, uint32_t idx);
/* Cached: committed, indexed, no reference. Evictable, droppable, found by LOOKUP. */
bool kvs_cached(const struct kvstore *kv, uint32_t idx);
/* A use of block idx: most recently used in whichever tier it is. */
void kvs_touch(struct kvstore *kv, uint32_t idx);
/* Frees block idx with the pool slot or spill slot it holds, whatever its pins and refs. */
void kvs_block_retire(struct kvstore *kv, uint32_t idx);

/* ---- pool_layout.c ---- */

/* The geometry of n_slots pool blocks and n_spill spill blocks of block_bytes. Returns 0 or
 * -EINVAL (not a multiple of 4096, no pool block, too many blocks, too large). */
int kvs_layout_compute(uint64_t block_bytes, uint64_t n_slots, uint64_t n_spill, struct layout *l);
/* Does a mapped header describe exactly the layout l? */
bool kvs_header_matches(const struct kvpool_header *h, const struct layout *l);
/* Creates or maps the pool's object for l (policy: adopt or reclaim a leftover). Returns 0 or
 * -errno (err says why). */
int kvs_create_object(struct kvstore *kv, const struct layout *l, enum shm_leftover policy, struct shm_object **o,
		      bool *adopted, char *err, size_t errlen);

/* ---- pool_adopt.c ---- */

/* Takes over a mapped, adopted object whose header matches l (consumes *op). Returns 0 or
 * -errno (err says why; the object is closed without unlinking and no pool is live). */
int kvs_adopt_object(struct kvstore *kv, struct shm_object **op, const struct layout *l, char *err, size_t errlen);

/* ---- pool_evict.c ---- */

/* Least recently used first (then by id). */
int kvs_victim_cmp(const void *a, const void *b);
/* Fills v (n_slots entries) with the evictable slots, least recently used first. Returns how
 * many there are. */
uint32_t kvs_collect_victims(struct kvstore *kv, uint32_t exclude_stamp, struct victim *v);
/* Writes the "KV pool full" message into err. Returns -ENOSPC. */
int kvs_pool_full(struct kvstore *kv, uint32_t evictable, uint32_t asked, char *err, size_t errlen);
/* Frees `need` pool slots by spilling (and dropping cached blocks when the spill file is full).
 * Returns 0, -ENOSPC, -EIO or -ENOMEM (err says why). */
int kvs_make_room(struct kvstore *kv, uint32_t need, uint32_t exclude_stamp, uint32_t asked, char *err,
		  size_t errlen);

/* ---- pool_requests.c ---- */

/* The checks every request on handles starts with. Returns 0 or -errno (err says why). */
int kvs_check_handles(struct kvstore *kv, const uint64_t *handles, uint32_t n, uint32_t *stamp, char *err,
		      size_t errlen);
/* A pool went live: the last runner session seen applies to it. */
void kvs_session_on_live(struct kvstore *kv);

/* ---- pool_persist.c ---- */

/* Spill slot j now holds block idx, whose bytes have landed: its index record follows. */
void kvs_index_put(struct kvstore *kv, uint32_t j, uint32_t idx);
/* Spill slot j goes back to the free list, its record cleared first. */
void kvs_spill_slot_free(struct kvstore *kv, uint32_t j);
/* Rewrites the whole index from the handle table. Returns 0 or -errno (err says why). */
int kvs_index_rewrite(struct kvstore *kv, char *err, size_t errlen);
/* Opens and reads the index for l. Returns 1 (recs filled), 0 (discarded and reset) or -errno. */
int kvs_index_load(struct kvstore *kv, const struct layout *l, uint64_t manifest_hash, struct kvindex_record *recs,
		   char *err, size_t errlen);
/* A fresh pool takes the records of a matching index as cached blocks. Returns how many. */
uint32_t kvs_load_cached(struct kvstore *kv, const struct kvindex_record *recs);
/* A clean stop with persistence: the most recent cached blocks into the spill file, the index
 * rewritten, both synced. */
void kvs_persist_at_stop(struct kvstore *kv);

/* ---- pool_tune.c ---- */

/* Pool blocks the DRAM budget allows now (at least one), spill blocks the disk budget allows. */
uint32_t kvs_slot_cap(const struct kvstore *kv);
uint32_t kvs_spill_cap(const struct kvstore *kv);
/* Free slots past the budgets leave circulation (parked); parked ones come back when a budget
 * rose. */
void kvs_park(struct kvstore *kv);
/* Lends a request up to n parked pool slots. */
void kvs_unpark_slots(struct kvstore *kv, uint32_t n);

#endif

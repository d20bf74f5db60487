/* pool.h - the kv-store's block pool: the shared-memory layout of common/kv_pool.h, the block
 * and handle state machines, references and the prefix cache, LRU spill to the spill file and
 * read-back with a checksum, and (optionally) a spill file that outlives the kv-store. No
 * sockets: main.c maps messages onto these calls, tests call them directly.
 *
 *   struct kvstore_config cfg = {.shm_name = "/llmp-1000-default-kv", .spill_path = ".../kv-spill.bin",
 *                                .dram_budget = 1ull << 30, .disk_budget = 4ull << 30, .io_depth = 32};
 *   struct kvstore *kv;
 *   rc = kvstore_create(&cfg, &kv);
 *   rc = kvstore_adopt(kv, err, sizeof(err));           // a dead predecessor's pool, if any
 *   rc = kvstore_configure(kv, 65536, manifest_hash, err, sizeof(err));
 *   rc = kvstore_alloc(kv, 2, handles, offsets, err, sizeof(err));
 *   ... the runner writes the blocks at base + offsets[i], stores slot.ready = 1 (release) ...
 *   rc = kvstore_commit(kv, handles, keys, 2, err, sizeof(err));
 *   rc = kvstore_fetch(kv, handles, 2, offsets, err, sizeof(err));   // pinned
 *   rc = kvstore_unpin(kv, handles, 2, err, sizeof(err));
 *   rc = kvstore_free(kv, handles, 2, err, sizeof(err));  // keyed blocks stay cached
 *   rc = kvstore_lookup(kv, keys, 2, handles, err, sizeof(err));  // a new reference to each hit
 *   kvstore_destroy(&kv, true);                         // unlink the pool, delete (or persist) the spill file
 *
 * Block life: ALLOC (slot WRITING, pinned once, handle WRITING in the pool, one reference) ->
 * COMMIT (slot and handle COMMITTED, checksum and key recorded, the alloc pin dropped) ->
 * possibly spilled when least recently used and unpinned (handle location SPILL, slot FREE) ->
 * FETCH (read back into a slot if spilled, checksum checked, pinned) -> UNPIN -> ... -> FREE
 * (one reference dropped). When the last reference goes, a block without a key is freed (its
 * generation bumped: the handle value goes stale); a committed block whose key is in the
 * prefix index becomes cached: no pin, no reference, still committed in whichever tier it
 * is, evictable, and found by LOOKUP, which hands out the same handle value with a new
 * reference. A cached block is freed only to make room (when the spill file is full), when a
 * newer block commits with its key, or when the pool is reconfigured.
 *
 * Every request is validated whole before anything changes: an invalid, stale or duplicated
 * handle fails the request with -EINVAL and no effect. Errors return -errno with err naming
 * the handle (hex, as on the wire) and the problem. Single-threaded.
 */
#ifndef PIPELINE_KVSTORE_POOL_H
#define PIPELINE_KVSTORE_POOL_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_pool.h"

/* Most blocks one request may name (common/kv_pool.h). */
#define KVSTORE_MAX_REQUEST KV_MAX_REQUEST_BLOCKS
/* The largest block CONFIGURE takes: one pread/pwrite moves a block to and from the spill file. */
#define KV_BLOCK_BYTES_MAX (1ull << 30)
/* /dev/shm's room left to other objects when the KV pool is cut to it: an eighth, at most this */
#define KV_SHM_MARGIN_MAX (256ull << 20)

struct kvstore_config {
	const char *shm_name;	/* "/llmp-<uid>-<instance>-kv" (shm_object_name); copied */
	const char *spill_path; /* the spill file; copied */
	const char *index_path; /* NULL, or the spill index (kvindex.h): the spill file and the index
				 * then survive a clean stop and a new pool loads them; copied */
	uint64_t dram_budget;	/* bytes of pool blocks in shared memory */
	uint64_t disk_budget;	/* bytes of spill slots on disk */
	uint32_t io_depth;	/* io_uring entries, 1..SPILL_MAX_IO_DEPTH */
};

/* What MSG_KV_POOL and HELLO report. shm_name is "" and the numbers 0 before configure. */
struct kvstore_info {
	bool configured;
	const char *shm_name; /* borrowed: valid while the kvstore lives */
	uint64_t shm_size;
	uint32_t n_slots, n_spill_slots;
	uint64_t block_bytes, manifest_hash, epoch;
};

struct kvstore;

/* Creates a kv-store with no pool yet (kvstore_adopt or kvstore_configure makes one).
 * Returns 0 and *out (owned by the caller: kvstore_destroy); -EINVAL for a config whose
 * names are too long or whose io_depth is out of range; -ENOMEM. */
int kvstore_create(const struct kvstore_config *cfg, struct kvstore **out);

/* Releases the pool. With remove (a clean stop) the shared-memory object is unlinked and the
 * spill file deleted; without (a signal, a crash) both stay for a successor to adopt. Safe on
 * NULL and twice; NULLs *kv. */
void kvstore_destroy(struct kvstore **kv, bool remove);
/* With index_path (persistence), a clean stop (remove) unlinks the pool but keeps the spill
 * file and its index: committed keyed blocks still in the pool are written to free spill
 * slots first (the most recently used win when the disk budget cannot hold all of them, over
 * spilled ones too), the index is rewritten whole, and both files are synced. */

/* Looks for a pool left by a dead kv-store of the same name and adopts it as it is (its
 * geometry comes from its header, whatever the budgets say), so handles stay valid. Slots
 * caught mid-I/O are recovered: SPILLING goes back to COMMITTED in the pool, LOADING is freed
 * with its handle left in the spill file; entries that contradict each other are dropped with
 * a warning. Returns 1 when adopted; 0 when there was nothing usable to adopt (a leftover
 * that does not fit is left for configure to reclaim); -EBUSY when a live process owns the
 * object; -EALREADY when a pool is already live; other -errno (err says why). */
int kvstore_adopt(struct kvstore *kv, char *err, size_t errlen);

/* MSG_KV_CONFIGURE. block_bytes must be a positive multiple of 4096 (-EINVAL); the DRAM
 * budget must hold at least one block (-EINVAL). A request that matches the live pool
 * (block_bytes and manifest_hash) keeps it, epoch and all. One that differs while handles
 * are in use gets -EBUSY; otherwise the pool is (re)created: a dead predecessor's object of
 * the same size, block_bytes and manifest_hash is adopted, anything else replaced, the spill
 * file truncated. Returns 0 or -errno (err says why; on failure no pool is live, unless the
 * failure is -EINVAL/-EBUSY, which leave the live pool untouched). "In use" means referenced
 * or being written: cached blocks are dropped by a reconfigure. With index_path, a new pool
 * (not an adopted one) loads the index when it matches (block_bytes, manifest_hash, spill
 * slots): each record becomes a cached block in the spill file, found by LOOKUP; an index that
 * does not match or is corrupt is discarded with a log line and the spill file truncated. */
int kvstore_configure(struct kvstore *kv, uint64_t block_bytes, uint64_t manifest_hash, char *err, size_t errlen);

void kvstore_info(const struct kvstore *kv, struct kvstore_info *out);

/* The pool's base address (NULL before configure): what the runner maps. */
struct kvpool_header *kvstore_header(const struct kvstore *kv);
bool kvstore_adopted(const struct kvstore *kv);
bool kvstore_o_direct(const struct kvstore *kv);
bool kvstore_persistent(const struct kvstore *kv);

/* MSG_KV_ALLOC: count (1..KVSTORE_MAX_REQUEST) new blocks, each in a slot that is WRITING
 * and pinned, spilling least-recently-used unpinned committed blocks to make room. Fills
 * handles[count] and offsets[count] (bytes from the pool base to each slot's data). All or
 * nothing. Each new handle holds one reference. When the spill file has too few free slots for
 * the blocks to spill, the least recently used cached blocks are dropped (freed) to make room:
 * those in the spill file first, then those in the pool; referenced blocks never are.
 * Returns 0; -EINVAL (not configured, bad count); -ENOSPC (the pool's blocks are pinned, or the
 * spill file is full of referenced blocks; nothing changed); -EIO (a spill write failed:
 * blocks already spilled or dropped by this call stay so, nothing is allocated). */
int kvstore_alloc(struct kvstore *kv, uint32_t count, uint64_t *handles, uint64_t *offsets, char *err,
		  size_t errlen);

/* MSG_KV_COMMIT: each handle WRITING with its slot's ready flag 1, or already COMMITTED with
 * the same key (a resent commit: no change at all). keys may be NULL (all 0). Records the
 * CRC-32C of the bytes and the key, drops the alloc pin, and enters a non-zero key in the
 * prefix index; a block the key named before loses it and, when unreferenced, is freed (when
 * referenced it is freed at its last FREE). Two handles with one key in a request: the later
 * wins. Returns 0; -EINVAL (a handle that is invalid, stale, duplicated, or committed with
 * another key); -EAGAIN (a block's copy has not completed: ready is 0). No effect on failure. */
int kvstore_commit(struct kvstore *kv, const uint64_t *handles, const uint64_t *keys, uint32_t n, char *err,
		   size_t errlen);

/* The copies into the slots of handles[0..n) are known complete (the kv-store waited on their
 * CUDA IPC events): stores the ready flags of those being written, as the runner does on the
 * CPU path (a committed one, named again by a resent commit, is left alone). Every handle must
 * be live. Returns 0 or -EINVAL naming the handle. */
int kvstore_mark_ready(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen);

/* MSG_KV_FETCH: each handle COMMITTED and referenced (a cached block needs a LOOKUP first);
 * pins each (reading spilled ones back into slots, which may spill others, never one this
 * request names; a fetch never drops a cached block) and fills offsets[n]. Returns 0;
 * -EINVAL; -ENOSPC; -EIO: a read-back failed or a checksum did not match (such a block is
 * dropped: its handle freed), and nothing this request pinned stays pinned. */
int kvstore_fetch(struct kvstore *kv, const uint64_t *handles, uint32_t n, uint64_t *offsets, char *err,
		  size_t errlen);

/* MSG_KV_UNPIN: drops one pin of each (COMMITTED, in the pool, pinned). Returns 0 or -EINVAL. */
int kvstore_unpin(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen);

/* MSG_KV_FREE: drops one reference of each handle (any live state, whatever its pins). At the
 * last one a block is freed with the slot or spill slot it held (its handle value goes stale),
 * unless it is committed and its key is in the prefix index: then it becomes cached (its pins
 * dropped too; same handle value). Returns 0 or -EINVAL (a handle invalid, stale, duplicated,
 * or holding no reference: cached). */
int kvstore_free(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen);

/* MSG_KV_LOOKUP: for each key, the handle of the committed block with that key in any tier,
 * with one more reference, or 0 for a miss (key 0 always misses). The same key twice takes two
 * references. A hit counts as a use (LRU). Returns 0, or -EINVAL (not configured, too many
 * keys, a reference count that would overflow) with no effect. */
int kvstore_lookup(struct kvstore *kv, const uint64_t *keys, uint32_t n, uint64_t *handles, char *err,
		   size_t errlen);

/* MSG_KV_UNPIN_ALL: every slot's pins to 0. Returns how many pins there were. */
uint64_t kvstore_unpin_all(struct kvstore *kv);

/* What a gpu-runner's HELLO did. */
struct kvstore_hello {
	bool kept;	  /* the same non-zero session as the last runner: nothing changed */
	bool pending;	  /* no pool yet: the session is compared when one is adopted or made */
	uint32_t freed;	  /* blocks freed: without a key, or not the indexed one for their key */
	uint32_t writing; /* of those, blocks still being written */
	uint32_t cached;  /* blocks kept as cached (their references dropped) */
	uint64_t pins;	  /* pins dropped */
};

/* Has a gpu-runner's HELLO with another session ended `session` (a KV request's; 0 names none,
 * and before any runner said HELLO none has ended)? Its requests are then refused, not done. */
bool kvstore_session_ended(const struct kvstore *kv, uint64_t session);
/* A HELLO from the gpu-runner with `session` (0: none). The same non-zero session as the last
 * runner (remembered in the pool's header, so a restarted kv-store knows it) keeps everything:
 * a runner reconnecting mid-request keeps its blocks. Any other drops every reference and
 * every pin: blocks being written and blocks without an indexed key are freed, keyed
 * committed blocks become cached. Before a pool exists the session is remembered and applied
 * the same way when one is adopted or made. */
void kvstore_runner_hello(struct kvstore *kv, uint64_t session, struct kvstore_hello *out);

/* Live tuning. The DRAM and disk budgets can be lowered at run time (and raised back, up to what
 * the pool and the spill file were laid out for: before configure, the budgets given at create).
 * Free slots past a budget are parked (out of circulation); blocks over a lowered DRAM budget are
 * spilled (least recently used first, at most 256 per call) by kvstore_enforce_budgets, which the
 * setter calls once and the service's tick after that. A single request that needs more pool
 * slots at once than the budget leaves still gets them (as the laid-out pool would have): they
 * are spilled back afterwards. A set checks first (apply false) and refuses: a DRAM budget below
 * the blocks pinned or being written (-EBUSY), or whose spill the spill file has no room for
 * (-ENOSPC); a disk budget below the spill slots in use (-EBUSY). Without a tune, nothing
 * changes. The io limit caps the spill file's transfers in flight (1..io_depth). */
void kvstore_dram_range(const struct kvstore *kv, uint64_t *min, uint64_t *max);
void kvstore_disk_range(const struct kvstore *kv, uint64_t *min, uint64_t *max);
uint64_t kvstore_dram_budget(const struct kvstore *kv);
uint64_t kvstore_disk_budget(const struct kvstore *kv);
int kvstore_set_dram_budget(struct kvstore *kv, uint64_t bytes, bool apply, char *why, size_t whylen);
int kvstore_set_disk_budget(struct kvstore *kv, uint64_t bytes, bool apply, char *why, size_t whylen);
void kvstore_enforce_budgets(struct kvstore *kv);
uint32_t kvstore_io_depth(const struct kvstore *kv);
uint32_t kvstore_io_limit(const struct kvstore *kv);
int kvstore_set_io_limit(struct kvstore *kv, uint32_t n);

/* The counters as a JSON object (prefix_hits, prefix_misses, cached_blocks, referenced_blocks,
 * cache_drops and persistent among them; malloc'd: the caller frees), or NULL without memory. */
char *kvstore_stats_json(const struct kvstore *kv);

#endif

/* pool.h - the kv-store's block pool: the shared-memory layout of common/kv_pool.h, the block
 * and handle state machines, LRU spill to the spill file and read-back with a checksum. No
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
 *   rc = kvstore_commit(kv, handles, NULL, 2, err, sizeof(err));
 *   rc = kvstore_fetch(kv, handles, 2, offsets, err, sizeof(err));   // pinned
 *   rc = kvstore_unpin(kv, handles, 2, err, sizeof(err));
 *   rc = kvstore_free(kv, handles, 2, err, sizeof(err));
 *   kvstore_destroy(&kv, true);                         // unlink the pool, delete the spill file
 *
 * Block life: ALLOC (slot WRITING, pinned once, handle WRITING in the pool) -> COMMIT (slot and
 * handle COMMITTED, checksum recorded, the alloc pin dropped) -> possibly spilled when least
 * recently used and unpinned (handle location SPILL, slot FREE) -> FETCH (read back into a slot
 * if spilled, checksum checked, pinned) -> UNPIN -> ... -> FREE (generation bumped: the handle
 * value goes stale).
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

/* Most blocks one request may name: keeps every MSG_KV_BLOCKS reply far below
 * PROTO_MAX_MSG_BYTES. */
#define KVSTORE_MAX_REQUEST 65536u

struct kvstore_config {
	const char *shm_name;	/* "/llmp-<uid>-<instance>-kv" (shm_object_name); copied */
	const char *spill_path; /* the spill file; copied */
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
 * failure is -EINVAL/-EBUSY, which leave the live pool untouched). */
int kvstore_configure(struct kvstore *kv, uint64_t block_bytes, uint64_t manifest_hash, char *err, size_t errlen);

void kvstore_info(const struct kvstore *kv, struct kvstore_info *out);

/* The pool's base address (NULL before configure): what the runner maps. */
struct kvpool_header *kvstore_header(const struct kvstore *kv);
bool kvstore_adopted(const struct kvstore *kv);
bool kvstore_o_direct(const struct kvstore *kv);

/* MSG_KV_ALLOC: count (1..KVSTORE_MAX_REQUEST) new blocks, each in a slot that is WRITING
 * and pinned, spilling least-recently-used unpinned committed blocks to make room. Fills
 * handles[count] and offsets[count] (bytes from the pool base to each slot's data). All or
 * nothing. Returns 0; -EINVAL (not configured, bad count); -ENOSPC (the pool's blocks are
 * pinned, or the spill file is full); -EIO (a spill write failed: blocks already spilled by
 * this call stay spilled, nothing is allocated). */
int kvstore_alloc(struct kvstore *kv, uint32_t count, uint64_t *handles, uint64_t *offsets, char *err,
		  size_t errlen);

/* MSG_KV_COMMIT: each handle WRITING and its slot's ready flag 1. keys may be NULL (all 0).
 * Records the CRC-32C of the bytes and drops the alloc pin. Returns 0; -EINVAL (a handle that
 * is invalid, stale, duplicated or not being written); -EAGAIN (a block's copy has not
 * completed: ready is 0). No effect on failure. */
int kvstore_commit(struct kvstore *kv, const uint64_t *handles, const uint64_t *keys, uint32_t n, char *err,
		   size_t errlen);

/* The copies into the slots of handles[0..n) are known complete (the kv-store waited on their
 * CUDA IPC events): stores their ready flags, as the runner does on the CPU path. Every handle
 * must be WRITING. Returns 0 or -EINVAL naming the handle. */
int kvstore_mark_ready(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen);

/* MSG_KV_FETCH: each handle COMMITTED; pins each (reading spilled ones back into slots,
 * which may spill others, never one this request names) and fills offsets[n]. Returns 0;
 * -EINVAL; -ENOSPC; -EIO: a read-back failed or a checksum did not match (such a block is
 * dropped: its handle freed), and nothing this request pinned stays pinned. */
int kvstore_fetch(struct kvstore *kv, const uint64_t *handles, uint32_t n, uint64_t *offsets, char *err,
		  size_t errlen);

/* MSG_KV_UNPIN: drops one pin of each (COMMITTED, in the pool, pinned). Returns 0 or -EINVAL. */
int kvstore_unpin(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen);

/* MSG_KV_FREE: frees each handle (any live state, whatever its pins) and the slot or spill
 * slot it held; the handle values go stale. Returns 0 or -EINVAL. */
int kvstore_free(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen);

/* Frees every live handle, pinned or not (a runner that (re)connects holds none: whatever is
 * left belongs to one that died or lost a reply). Returns how many were freed. */
uint32_t kvstore_free_all(struct kvstore *kv);

/* The counters as a JSON object (malloc'd: the caller frees), or NULL without memory. */
char *kvstore_stats_json(const struct kvstore *kv);

#endif

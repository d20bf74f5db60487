/* kv_pool.h - the DRAM tier of the KV cache: a shared-memory block pool laid out by the
 * kv-store and written/read by the gpu-runner.
 *
 *   [struct kvpool_header][kvpool_slot x n_slots][kvpool_handle x n_handles][block data...]
 *
 * A KV block holds block_tokens tokens of one layer: K then V, each
 * (block_tokens, n_kv_heads, head_dim) in the runner's KV dtype; its size is fixed per pool
 * (MSG_KV_CONFIGURE) so nothing fragments.
 *
 * Handles name logical blocks for their whole life; a handle's bytes live in a pool slot or
 * in a spill-file slot, and move between them without the handle changing. On the wire a
 * handle is (index << 32) | generation, so a stale handle is recognised. The handle and
 * slot tables live here, not in kv-store's private memory, so a restarted kv-store adopts
 * the pool (SHM_ADOPT) with nothing lost and the runner's handles stay valid.
 *
 * References and the prefix cache: each live handle counts the references the runner holds
 * (ALLOC and each MSG_KV_LOOKUP hit take one, MSG_KV_FREE drops one). A committed block with a
 * key whose last reference went stays *cached*: committed, evictable, found by MSG_KV_LOOKUP
 * until the kv-store needs its room. The counts live here so that an adopted pool keeps them.
 *
 * Completion of a write: the runner copies a block into its pool slot and then makes the
 * copy's completion known. With CUDA this is an IPC event whose handle travels in
 * MSG_KV_COMMIT; without it, the runner stores ready = 1 in the slot (release order) before
 * sending the commit, and kv-store loads it (acquire) before it checksums the bytes.
 *
 * Written by kv-store only: everything but kvpool_slot.ready and the runner counters.
 */
#ifndef PIPELINE_KV_POOL_H
#define PIPELINE_KV_POOL_H
#include <stdalign.h>
#include <stdatomic.h>
#include <stdint.h>

#include "common/shm.h"
#ifdef __cplusplus
extern "C" {
#endif

#define KVPOOL_LAYOUT_VERSION 2 /* 2: handle refs and last_use, runner_session, cache counters */
#define KV_NONE UINT32_MAX
/* Most blocks (handles or keys) one request to kv-store may name: keeps every MSG_KV_BLOCKS reply
 * far below PROTO_MAX_MSG_BYTES. A client with more sends several requests. */
#define KV_MAX_REQUEST_BLOCKS 65536u

static inline uint64_t kv_handle_make(uint32_t index, uint32_t generation)
{
	return ((uint64_t)index << 32) | generation;
}
static inline uint32_t kv_handle_index(uint64_t h)
{
	return (uint32_t)(h >> 32);
}
static inline uint32_t kv_handle_generation(uint64_t h)
{
	return (uint32_t)h;
}

enum kv_slot_state {
	KVSLOT_FREE = 0,
	KVSLOT_WRITING = 1,   /* allocated to the runner, bytes not yet committed */
	KVSLOT_COMMITTED = 2, /* bytes real, checksum recorded */
	KVSLOT_SPILLING = 3,  /* being written to the spill file */
	KVSLOT_LOADING = 4,   /* being read back from the spill file */
};

enum kv_handle_state {
	KVH_FREE = 0,
	KVH_WRITING = 1,
	KVH_COMMITTED = 2,
};

enum kv_location {
	KVLOC_NONE = 0,
	KVLOC_POOL = 1,	 /* where = pool slot index */
	KVLOC_SPILL = 2, /* where = spill-file slot index */
};

struct kvpool_slot {
	_Atomic uint32_t seq;	/* odd while kv-store rewrites the slot (spill read-back) */
	_Atomic uint32_t state; /* enum kv_slot_state */
	_Atomic uint32_t ready; /* CPU stand-in for the copy-done IPC event; written by the runner */
	uint32_t pins;		/* runner references (fetch/alloc) outstanding */
	uint32_t handle_index;	/* KV_NONE when free */
	uint32_t reserved;
	uint64_t last_use;	/* kv-store's tick at the last alloc/commit/fetch: LRU order */
	uint64_t data_offset;	/* bytes from the base */
	uint64_t reserved2[3];
};
_Static_assert(sizeof(struct kvpool_slot) == 64, "one slot per cache line");

struct kvpool_handle {
	uint32_t state;	     /* enum kv_handle_state */
	uint32_t generation; /* bumped when the handle is freed */
	uint32_t location;   /* enum kv_location */
	uint32_t where;	     /* pool slot or spill slot */
	uint32_t checksum;   /* CRC-32C of the block bytes, set at commit */
	uint32_t refs;	     /* references the runner holds; 0 while cached (committed, key != 0) */
	uint64_t key;	     /* prefix-chain key given at commit, 0 when none */
	uint64_t last_use;   /* kv-store's tick at the last alloc/commit/fetch/lookup: LRU order in any tier */
};
_Static_assert(sizeof(struct kvpool_handle) == 40, "handle table entry");

struct kvpool_header {
	struct shm_header shm;
	uint64_t manifest_hash;	/* the model whose KV the pool holds; 0 until configured */
	uint64_t block_bytes;	/* bytes per block, a multiple of 4 KiB; 0 until configured */
	uint32_t n_slots;	/* pool blocks in DRAM */
	uint32_t n_handles;	/* n_slots + spill slots */
	uint32_t n_spill_slots;
	uint32_t reserved0;
	uint64_t slots_off, handles_off, data_off; /* from the base */
	uint64_t pool_epoch;	/* new each time the pool is (re)configured */
	uint64_t runner_session; /* the session of the last gpu-runner HELLO (0: none yet, or one without) */

	/* Written by kv-store only. */
	alignas(64) struct {
		_Atomic uint64_t allocs, commits, frees;
		_Atomic uint64_t fetches;	    /* blocks handed back to the runner */
		_Atomic uint64_t fetches_from_disk; /* of those, read back from the spill file */
		_Atomic uint64_t spills;	    /* blocks written to the spill file */
		_Atomic uint64_t spill_bytes_written, spill_bytes_read;
		_Atomic uint64_t checksum_failures;
		_Atomic uint64_t slots_used, spill_used;
		_Atomic uint64_t prefix_hits, prefix_misses; /* MSG_KV_LOOKUP keys found / not found */
		_Atomic uint64_t cache_drops;		      /* cached blocks freed to make room */
	} store;
	/* Written by the runner only. */
	alignas(64) struct {
		_Atomic uint64_t blocks_written;  /* blocks the runner copied into the pool */
		_Atomic uint64_t blocks_read;	  /* blocks the runner copied back out */
	} runner;
};

static inline struct kvpool_slot *kvpool_slots(struct kvpool_header *h)
{
	return (struct kvpool_slot *)((char *)h + h->slots_off);
}
static inline struct kvpool_handle *kvpool_handles(struct kvpool_header *h)
{
	return (struct kvpool_handle *)((char *)h + h->handles_off);
}
static inline void *kvpool_slot_data(struct kvpool_header *h, uint32_t slot)
{
	return (char *)h + h->data_off + (uint64_t)slot * h->block_bytes;
}

#ifdef __cplusplus
}
#endif
#endif

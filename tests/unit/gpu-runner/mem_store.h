/* mem_store.h - a KV store in the test process (struct kv_remote_ops over malloc'd blocks), for
 * tests that run the engine with KV blocks behind its arena: handles are index + 1, blocks are never
 * reused, references and pins are counted. It can die (every request then fails as to a process
 * that died) on its n-th release, and its owner decides whether it comes back; it can refuse fetches
 * of more than fetch_cap blocks as the kv-store does when its pool is full (-ENOSPC, nothing moved). */
#ifndef TEST_MEM_STORE_H
#define TEST_MEM_STORE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "services/gpu-runner/kv_cache.h"

#define STORE_BLOCKS 512

struct store {
	size_t block_bytes;
	char *mem;			/* STORE_BLOCKS * block_bytes */
	uint32_t used;			/* blocks handed out so far (never reused) */
	uint32_t refs[STORE_BLOCKS];	/* references held for the runner */
	uint32_t pins[STORE_BLOCKS];
	bool dead;			/* every request fails as to a process that died */
	uint32_t die_at_release;	/* the n-th release kills it (0: never) */
	uint32_t releases;
	bool comes_back;		/* on_kv_failure finds it restarted (its pool adopted) */
	uint32_t fetch_cap;		/* a fetch of more blocks is refused whole, pool full (0: none) */
	uint32_t fetch_refused;
	uint32_t reconnects;
	char err[128];
};

extern const struct kv_remote_ops store_ops;

/* References the runner holds. */
uint32_t refs_held(const struct store *s);

#endif

/* keymap.h - the prefix index: a fixed-capacity hash map from a block's prefix-chain key to
 * its handle index, private to the kv-store (rebuilt from the handle table when a pool is
 * adopted, so it never needs to be in shared memory).
 *
 *   struct keymap *m = keymap_create(n_handles);   // holds up to n_handles keys
 *   keymap_put(m, key, idx);                        // insert or replace
 *   uint32_t idx = keymap_get(m, key);              // KV_NONE when absent
 *   keymap_del(m, key);
 *   keymap_destroy(&m);
 *
 * Open addressing with linear probing and backward-shift deletion (no tombstones, so lookups
 * stay short however many deletes). Key 0 means "no key" and is never stored (asserted).
 * Single-threaded.
 */
#ifndef PIPELINE_KVSTORE_KEYMAP_H
#define PIPELINE_KVSTORE_KEYMAP_H
#include <stdint.h>

struct keymap;

/* A map for up to max_entries keys (1..2^31). Returns it (owned by the caller:
 * keymap_destroy) or NULL without memory. */
struct keymap *keymap_create(uint32_t max_entries);
/* Safe on NULL and twice; NULLs *m. */
void keymap_destroy(struct keymap **m);

/* The value stored for key, or KV_NONE (common/kv_pool.h). */
uint32_t keymap_get(const struct keymap *m, uint64_t key);
/* Stores val (not KV_NONE) for key, replacing what was there. The map must not be full when
 * key is new (asserted: the caller sizes it for every handle). */
void keymap_put(struct keymap *m, uint64_t key, uint32_t val);
/* Removes key; nothing happens when it is absent. */
void keymap_del(struct keymap *m, uint64_t key);
/* Removes every key. */
void keymap_clear(struct keymap *m);
uint32_t keymap_count(const struct keymap *m);

#endif

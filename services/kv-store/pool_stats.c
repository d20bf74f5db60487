/* pool_stats.c - the kv-store pool's counters and state as one JSON object (--stats, pipectl
 * stats, pipeline-inspect). */
#include <jansson.h>

#include "services/kv-store/pool_internal.h"

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
	rc |= set_u64(o, "pool_limit_blocks", h ? kvs_slot_cap(kv) : 0);
	rc |= set_u64(o, "spill_limit_blocks", h ? kvs_spill_cap(kv) : 0);
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

/* pool_requests.c - the kv-store pool's requests but FETCH (pool_fetch.c): the checks each one
 * starts with, ALLOC, COMMIT, UNPIN, FREE and LOOKUP, and the gpu-runner's sessions (HELLO). */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "services/kv-store/keymap.h"
#include "services/kv-store/pool_internal.h"

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

static uint32_t next_stamp(struct kvstore *kv)
{
	if (++kv->stamp == 0) {
		memset(kv->mark, 0, sizeof(uint32_t) * kv->h->n_handles);
		kv->stamp = 1;
	}
	return kv->stamp;
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
int kvs_check_handles(struct kvstore *kv, const uint64_t *handles, uint32_t n, uint32_t *stamp, char *err,
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
	kvs_park(kv);
	if (count > kv->n_free_slots) {
		rc = kvs_make_room(kv, count - kv->n_free_slots, 0, count, err, errlen);
		if (rc == -ENOSPC && kv->n_parked_slots) {
			kvs_unpark_slots(kv, count - kv->n_free_slots);
			rc = count > kv->n_free_slots ? kvs_make_room(kv, count - kv->n_free_slots, 0, count, err, errlen) : 0;
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
		kvs_touch(kv, idx);
		atomic_store(&sl->state, KVSLOT_WRITING);
		handles[i] = kv_handle_make(idx, hd->generation);
		offsets[i] = slot_data_offset(kv, s);
	}
	atomic_fetch_add(&h->store.allocs, count);
	kvs_publish_usage(kv);
	return 0;
}

int kvstore_mark_ready(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen)
{
	int rc = kvs_check_handles(kv, handles, n, NULL, err, errlen);
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
	int rc = kvs_check_handles(kv, handles, n, NULL, err, errlen);
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
		kvs_touch(kv, idx);
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
			kvs_block_retire(kv, old);
		} else if (kv->handles[old].location == KVLOC_SPILL) {
			kvs_index_put(kv, kv->handles[old].where, old); /* no longer indexed: its record goes */
		}
	}
	atomic_fetch_add(&kv->h->store.commits, done);
	kvs_publish_usage(kv);
	return 0;
}

int kvstore_unpin(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen)
{
	int rc = kvs_check_handles(kv, handles, n, NULL, err, errlen);
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
	int rc = kvs_check_handles(kv, handles, n, NULL, err, errlen);
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
		if (!kvs_indexed(kv, idx)) {
			kvs_block_retire(kv, idx);
			continue;
		}
		/* Cached: nobody holds it, so nobody holds a pin on it either. */
		if (hd->location == KVLOC_POOL)
			kv->slots[hd->where].pins = 0;
	}
	atomic_fetch_add(&kv->h->store.frees, n);
	kvs_publish_usage(kv);
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
		kvs_touch(kv, idx);
		handles[i] = handle_value(kv, idx);
		hits++;
	}
	atomic_fetch_add(&kv->h->store.prefix_hits, hits);
	atomic_fetch_add(&kv->h->store.prefix_misses, n - hits);
	return 0;
}

/* ---- runner sessions ---- */

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
		if (kvs_indexed(kv, idx)) {
			out->cached++;
			continue;
		}
		out->writing += hd->state == KVH_WRITING;
		out->freed++;
		kvs_block_retire(kv, idx);
	}
	kvs_publish_usage(kv);
}

/* A pool went live: an adopted one compares the session of a gpu-runner that said HELLO while
 * there was no pool with its own; a new one takes the last session seen (the runner that
 * asked for a reconfigure still holds what it holds). */
void kvs_session_on_live(struct kvstore *kv)
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

bool kvstore_session_ended(const struct kvstore *kv, uint64_t session)
{
	return session != 0 && kv->session_known && session != kv->session;
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

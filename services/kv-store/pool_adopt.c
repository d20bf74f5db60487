/* pool_adopt.c - adopting the pool a dead kv-store left: its tables made consistent after a
 * crash at any point (slots caught mid-I/O, torn handle moves), references and the prefix index
 * rebuilt, the spill file reopened as it is. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "services/kv-store/keymap.h"
#include "services/kv-store/pool_internal.h"
#include "services/kv-store/spill.h"

static void drop_handle(struct kvstore *kv, uint32_t idx, const char *why)
{
	log_warn("adopted KV pool %s: dropping block 0x%llx: %s", kv->shm_name,
		 (unsigned long long)handle_value(kv, idx), why);
	kvs_handle_reset(&kv->handles[idx]);
}

/* Makes an adopted pool's tables consistent. The handle table is the truth (a handle names
 * where its bytes are); slots agree with it or are freed. The write orders in kvs_make_room
 * (pool_evict.c), load_batch and swap_in (pool_fetch.c) keep every crash point recoverable: a
 * slot is marked SPILLING or LOADING before its I/O, and the handle moves only after the I/O
 * (and, for a load, the checksum) succeeded; what cannot be recovered is dropped, never served
 * wrong.
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
			kvs_slot_reset(sl);
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
			kvs_slot_reset(sl);
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
		kvs_slot_reset(&kv->slots[hd->where]);
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

/* Takes over a mapped, adopted object whose header matches l. On failure the object is
 * closed without unlinking (it stays for a later try) and no pool is live. */
int kvs_adopt_object(struct kvstore *kv, struct shm_object **op, const struct layout *l, char *err, size_t errlen)
{
	kv->shm = *op;
	*op = NULL;
	kv->h = shm_object_base(kv->shm);
	kv->slots = kvpool_slots(kv->h);
	kv->handles = kvpool_handles(kv->h);
	int rc = kvs_private_alloc(kv, l);
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
		rc = kvs_rebuild_free_lists(kv);
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
			rc = kvs_index_rewrite(kv, err, errlen);
		if (rc)
			goto out_close;
	}
	kv->adopted = true;
	kvs_session_on_live(kv);
	return 0;

out_close:
	kvs_pool_close(kv, false);
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
	if (!atomic_load(&hdr.shm.ready) ||
	    kvs_layout_compute(hdr.block_bytes, hdr.n_slots, hdr.n_spill_slots, &l) ||
	    !kvs_header_matches(&hdr, &l) || (uint64_t)st.st_size != l.total) {
		log_warn("leftover KV pool %s is incomplete or inconsistent: it is replaced at configure",
			 kv->shm_name);
		return 0;
	}
	struct shm_object *o = NULL;
	bool adopted = false;
	int rc = kvs_create_object(kv, &l, SHM_ADOPT, &o, &adopted, err, errlen);
	if (rc)
		return rc;
	if (!adopted || !kvs_header_matches(shm_object_base(o), &l)) {
		/* The leftover went or changed between the look and the map: nothing to adopt. */
		shm_object_close(&o, !adopted);
		return 0;
	}
	rc = kvs_adopt_object(kv, &o, &l, err, errlen);
	if (rc)
		return rc;
	uint64_t want_slots = kv->dram_budget / l.block_bytes, want_spill = kv->disk_budget / l.block_bytes;
	if (want_slots != l.n_slots || want_spill != l.n_spill)
		log_info("the adopted KV pool keeps its geometry (%u blocks, %u spill blocks of %llu bytes) for now; "
			 "the budgets given (%llu and %llu blocks) are taken at the runner's next configure with no "
			 "block live (its cached blocks are dropped then)", l.n_slots, l.n_spill,
			 (unsigned long long)l.block_bytes, (unsigned long long)want_slots, (unsigned long long)want_spill);
	return 1;
}

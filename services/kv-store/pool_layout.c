/* pool_layout.c - the kv-store pool's geometry and a fresh layout: the offsets of one geometry,
 * a new shared-memory object laid out (with persistence, loading a matching index), and
 * MSG_KV_CONFIGURE, which keeps, adopts or replaces the pool. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "services/kv-store/pool_internal.h"
#include "services/kv-store/spill.h"

/* ---- geometry ---- */

int kvs_layout_compute(uint64_t block_bytes, uint64_t n_slots, uint64_t n_spill, struct layout *l)
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
bool kvs_header_matches(const struct kvpool_header *h, const struct layout *l)
{
	return h->block_bytes == l->block_bytes && h->n_slots == l->n_slots && h->n_spill_slots == l->n_spill &&
	       h->n_handles == l->n_handles && h->slots_off == l->slots_off && h->handles_off == l->handles_off &&
	       h->data_off == l->data_off && h->shm.total_size == l->total;
}

/* ---- fresh layout ---- */

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
		kvs_slot_reset(sl);
		atomic_store(&sl->seq, 0);
		sl->data_offset = l->data_off + (uint64_t)s * l->block_bytes;
	}
	for (uint32_t i = 0; i < l->n_handles; i++) {
		memset(&kv->handles[i], 0, sizeof(kv->handles[i]));
		kv->handles[i].generation = 1; /* so that the value 0 is never a live handle */
	}
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
	int rc = kvs_private_alloc(kv, l);
	if (rc == 0 && kv->persistent && !(recs = calloc(l->n_spill ? l->n_spill : 1, sizeof(*recs))))
		rc = -ENOMEM;
	if (rc) {
		snprintf(err, errlen, "out of memory creating KV pool %s", kv->shm_name);
		goto out_unlink;
	}
	if (kv->persistent) {
		loaded = kvs_index_load(kv, l, manifest_hash, recs, err, errlen);
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
		kvs_load_cached(kv, recs);
	rc = kvs_rebuild_free_lists(kv);
	if (rc) {
		snprintf(err, errlen, "out of memory creating KV pool %s", kv->shm_name);
		goto out_unlink;
	}
	if (loaded) {
		/* Records skipped at load leave the file. */
		rc = kvs_index_rewrite(kv, err, errlen);
		if (rc)
			goto out_unlink;
	}
	shm_object_set_ready(kv->shm);
	kv->adopted = false;
	kvs_session_on_live(kv);
	free(recs);
	return 0;

out_unlink:
	free(recs);
	kvs_pool_close(kv, true);
	return rc;
}

int kvs_create_object(struct kvstore *kv, const struct layout *l, enum shm_leftover policy, struct shm_object **o,
		      bool *adopted, char *err, size_t errlen)
{
	int rc = shm_object_create(kv->shm_name, (size_t)l->total, SHM_KIND_KV_POOL, KVPOOL_LAYOUT_VERSION, policy,
				   o, adopted);
	if (rc == -EBUSY)
		snprintf(err, errlen, "KV pool %s is owned by a live process: stop that kv-store first or pick another "
			 "--instance", kv->shm_name);
	else if (rc)
		snprintf(err, errlen, "cannot create KV pool %s of %llu bytes: %s", kv->shm_name,
			 (unsigned long long)l->total, strerror(-rc));
	/* A block's pages are made when first written: a pool larger than /dev/shm's room works until
	 * it fills past it, and then the process writing the page dies (SIGBUS). Said at the start. */
	uint64_t room = 0;
	if (rc == 0 && !(adopted && *adopted) && shm_room(&room) == 0 && l->total > room) {
		char a[32], b[32];
		log_warn("the KV pool of %s is larger than the %s free in /dev/shm: filled past that, the service "
			 "writing a block would be killed (SIGBUS); lower --kv-dram-budget, or give /dev/shm more room",
			 format_size(l->total, a, sizeof(a)), format_size(room, b, sizeof(b)));
	}
	return rc;
}

int kvstore_configure(struct kvstore *kv, uint64_t block_bytes, uint64_t manifest_hash, char *err, size_t errlen)
{
	char a[32], b[32];
	if (block_bytes == 0 || block_bytes % 4096) {
		snprintf(err, errlen, "block_bytes %llu is not a positive multiple of 4096",
			 (unsigned long long)block_bytes);
		return -EINVAL;
	}
	/* A block is read and written with one pread/pwrite, which Linux caps at 0x7ffff000 bytes,
	 * and the spill's requests carry 32-bit lengths: a larger block would fail every spill as a
	 * short transfer, which looks like a disk error. Blocks of a few MiB are what models make. */
	if (block_bytes > KV_BLOCK_BYTES_MAX) {
		snprintf(err, errlen, "block_bytes %llu is more than the %llu a KV block may hold (fewer tokens a "
			 "block: the runner's --kv-block-tokens)", (unsigned long long)block_bytes,
			 (unsigned long long)KV_BLOCK_BYTES_MAX);
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
	if (kvs_layout_compute(block_bytes, n_slots, n_spill, &l)) {
		snprintf(err, errlen, "kv-dram-budget %s and kv-disk-budget %s make %llu blocks of %llu bytes: too "
			 "many (at most 2^31)", format_size(kv->dram_budget, a, sizeof(a)),
			 format_size(kv->disk_budget, b, sizeof(b)), (unsigned long long)(n_slots + n_spill),
			 (unsigned long long)block_bytes);
		return -EINVAL;
	}
	/* A block's pages come when it is first written, and one written past /dev/shm's room kills the
	 * process that writes it (SIGBUS: the runner, or this service), so the pool is laid out no
	 * larger than the room: what is free now (the loader's ring is whole by the time the runner
	 * configures) and this pool's own pages, which go back if it is laid out anew, less a margin
	 * for other objects. Blocks past it spill to disk as past a smaller budget. */
	uint64_t room = 0, own = 0, usable = 0;
	bool capped = false;
	if (shm_room(&room) == 0 && (!kv->shm || shm_object_resident(kv->shm, &own) == 0)) {
		usable = room + own;
		usable -= usable / 8 < KV_SHM_MARGIN_MAX ? usable / 8 : KV_SHM_MARGIN_MAX;
		if (l.total > usable) {
			/* The tables shrink with the slots: a slot costs its block, its entry and its handle's;
			 * the spill's handles and the header are fixed (and a page of alignment). */
			const uint64_t fixed = ALIGN_UP((uint64_t)sizeof(struct kvpool_header), (uint64_t)CACHE_LINE) +
					       n_spill * sizeof(struct kvpool_handle) + 4096,
				       per = block_bytes + sizeof(struct kvpool_slot) + sizeof(struct kvpool_handle);
			uint64_t fit = usable > fixed ? (usable - fixed) / per : 0;
			while (fit > 0 && (kvs_layout_compute(block_bytes, fit, n_spill, &l) || l.total > usable))
				fit--;
			if (fit == 0) {
				char c[32];
				snprintf(err, errlen, "/dev/shm has %s free, no room for a KV pool of one block of %s with its "
					 "tables (those of the %llu spill blocks of kv-disk-budget take %s): give /dev/shm more "
					 "room (a container's --shm-size) or lower --kv-disk-budget",
					 format_size(room + own, a, sizeof(a)), format_size(block_bytes, b, sizeof(b)),
					 (unsigned long long)n_spill, format_size(n_spill * sizeof(struct kvpool_handle), c, sizeof(c)));
				return -ENOSPC;
			}
			capped = true;
		}
	}
	if (kv->h) {
		struct kvpool_header *h = kv->h;
		/* A pool already cut to the room that still fits it: kept (the room moves as blocks are
		 * written, and laying the pool out anew drops its cached blocks). */
		if (capped && h->block_bytes == block_bytes && h->manifest_hash == manifest_hash &&
		    h->n_spill_slots == l.n_spill && h->n_slots < n_slots && h->shm.total_size <= usable)
			return 0;
		/* The same model's blocks in a pool of the budgets' size: kept. A pool adopted at the
		 * start keeps the size it was laid out with before; budgets given since are taken here,
		 * once no block is live (else they would never be: the runner configures the same
		 * model again and again). */
		const bool same_model = h->block_bytes == block_bytes && h->manifest_hash == manifest_hash;
		if (same_model && h->n_slots == l.n_slots && h->n_spill_slots == l.n_spill)
			return 0;
		uint32_t live = 0;
		for (uint32_t i = 0; i < h->n_handles; i++) {
			const struct kvpool_handle *hd = &kv->handles[i];
			live += hd->state == KVH_WRITING || (hd->state == KVH_COMMITTED && hd->refs);
		}
		if (live && same_model) {
			log_info("the KV pool keeps %u blocks and %u spill blocks while %u of them are live; the budgets "
				 "given (%u and %u) are taken at a configure with none live", h->n_slots, h->n_spill_slots,
				 live, l.n_slots, l.n_spill);
			return 0;
		}
		if (live) {
			snprintf(err, errlen, "the KV pool holds %u live blocks (referenced or being written) of %llu "
				 "bytes for model %016llx; free them before configuring blocks of %llu bytes for model "
				 "%016llx", live,
				 (unsigned long long)h->block_bytes, (unsigned long long)h->manifest_hash,
				 (unsigned long long)block_bytes, (unsigned long long)manifest_hash);
			return -EBUSY;
		}
		if (same_model)
			log_info("laying the KV pool out anew for the budgets given: %u blocks and %u spill blocks "
				 "(it had %u and %u); %u cached blocks dropped", l.n_slots, l.n_spill, h->n_slots,
				 h->n_spill_slots, h->n_handles - kv->n_free_handles);
		else
			log_info("reconfiguring the KV pool: blocks of %llu bytes for model %016llx; %u cached blocks "
				 "dropped", (unsigned long long)block_bytes, (unsigned long long)manifest_hash,
				 h->n_handles - kv->n_free_handles);
		/* Keep the spill file: it is truncated when reopened below. */
		spill_close(&kv->spill, false);
		kvs_pool_close(kv, true);
	}
	if (capped) {
		char c[32];
		log_warn("kv-dram-budget %s makes %llu blocks, more than /dev/shm's %s free can hold (less a margin "
			 "for other objects): the KV pool has %u blocks (%s), the rest spills to disk; give "
			 "/dev/shm more room or lower --kv-dram-budget", format_size(kv->dram_budget, a, sizeof(a)),
			 (unsigned long long)n_slots, format_size(room + own, b, sizeof(b)), l.n_slots,
			 format_size(l.total, c, sizeof(c)));
	}
	struct shm_object *o = NULL;
	bool adopted = false;
	int rc = kvs_create_object(kv, &l, SHM_ADOPT, &o, &adopted, err, errlen);
	if (rc)
		return rc;
	if (adopted) {
		struct kvpool_header *h = shm_object_base(o);
		if (kvs_header_matches(h, &l) && h->block_bytes == block_bytes && h->manifest_hash == manifest_hash) {
			rc = kvs_adopt_object(kv, &o, &l, err, errlen);
			if (rc == 0)
				log_info("KV pool %s adopted at configure", kv->shm_name);
			return rc;
		}
		log_info("leftover KV pool %s holds blocks of another size or model: replaced", kv->shm_name);
		shm_object_close(&o, true);
		rc = kvs_create_object(kv, &l, SHM_RECLAIM, &o, &adopted, err, errlen);
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

#include "services/kv-store/pool.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "services/kv-store/spill.h"

/* Offsets and sizes of one pool geometry. */
struct layout {
	uint64_t block_bytes;
	uint32_t n_slots, n_spill, n_handles;
	uint64_t slots_off, handles_off, data_off, total;
};

struct kvstore {
	char shm_name[SHM_NAME_MAX];
	char spill_path[512];
	uint64_t dram_budget, disk_budget;
	uint32_t io_depth;

	/* The live pool; all NULL before configure/adopt. */
	struct shm_object *shm;
	struct kvpool_header *h;
	struct kvpool_slot *slots;
	struct kvpool_handle *handles;
	struct spill *spill;
	bool adopted;
	uint64_t tick; /* LRU clock: slot.last_use values come from here */

	/* Private indexes rebuilt from the shared tables on adoption. Stacks: pop from the top. */
	uint32_t *free_slots, n_free_slots;
	uint32_t *free_spill, n_free_spill;
	uint32_t *free_handles, n_free_handles;
	/* Per handle: the stamp of the last request that named it, so one pass finds duplicates
	 * and keeps a fetch from evicting the blocks it is fetching. */
	uint32_t *mark;
	uint32_t stamp;
	void *bounce; /* one block, 4 KiB aligned, for swap_in; allocated on first use */
};

/* ---- geometry ---- */

static int layout_compute(uint64_t block_bytes, uint64_t n_slots, uint64_t n_spill, struct layout *l)
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
static bool header_matches(const struct kvpool_header *h, const struct layout *l)
{
	return h->block_bytes == l->block_bytes && h->n_slots == l->n_slots && h->n_spill_slots == l->n_spill &&
	       h->n_handles == l->n_handles && h->slots_off == l->slots_off && h->handles_off == l->handles_off &&
	       h->data_off == l->data_off && h->shm.total_size == l->total;
}

static uint64_t slot_data_offset(const struct kvstore *kv, uint32_t s)
{
	return kv->h->data_off + (uint64_t)s * kv->h->block_bytes;
}

static void *slot_data(const struct kvstore *kv, uint32_t s)
{
	return (char *)kv->h + slot_data_offset(kv, s);
}

static uint64_t handle_value(const struct kvstore *kv, uint32_t idx)
{
	return kv_handle_make(idx, kv->handles[idx].generation);
}

/* ---- create / destroy ---- */

int kvstore_create(const struct kvstore_config *cfg, struct kvstore **out)
{
	assert(cfg && cfg->shm_name && cfg->spill_path && out);
	if (cfg->io_depth == 0 || cfg->io_depth > SPILL_MAX_IO_DEPTH)
		return -EINVAL;
	struct kvstore *kv = calloc(1, sizeof(*kv));
	if (!kv)
		return -ENOMEM;
	if (str_copy(kv->shm_name, sizeof(kv->shm_name), cfg->shm_name) != 0 ||
	    str_copy(kv->spill_path, sizeof(kv->spill_path), cfg->spill_path) != 0) {
		free(kv);
		return -EINVAL;
	}
	kv->dram_budget = cfg->dram_budget;
	kv->disk_budget = cfg->disk_budget;
	kv->io_depth = cfg->io_depth;
	*out = kv;
	return 0;
}

static void private_free(struct kvstore *kv)
{
	free(kv->free_slots);
	free(kv->free_spill);
	free(kv->free_handles);
	free(kv->mark);
	free(kv->bounce);
	kv->bounce = NULL;
	kv->free_slots = kv->free_spill = kv->free_handles = kv->mark = NULL;
	kv->n_free_slots = kv->n_free_spill = kv->n_free_handles = 0;
	kv->stamp = 0;
}

static int private_alloc(struct kvstore *kv, const struct layout *l)
{
	kv->free_slots = malloc(sizeof(uint32_t) * l->n_slots);
	kv->free_spill = malloc(sizeof(uint32_t) * (l->n_spill ? l->n_spill : 1));
	kv->free_handles = malloc(sizeof(uint32_t) * l->n_handles);
	kv->mark = calloc(l->n_handles, sizeof(uint32_t));
	if (!kv->free_slots || !kv->free_spill || !kv->free_handles || !kv->mark) {
		private_free(kv);
		return -ENOMEM;
	}
	return 0;
}

/* Unmaps the pool and closes the spill file; with remove, unlinks and deletes both. */
static void pool_close(struct kvstore *kv, bool remove)
{
	spill_close(&kv->spill, remove);
	shm_object_close(&kv->shm, remove);
	kv->h = NULL;
	kv->slots = NULL;
	kv->handles = NULL;
	kv->adopted = false;
	kv->tick = 0;
	private_free(kv);
}

/* A clean stop with no live pool still leaves nothing behind: a dead predecessor's pool that
 * was not adopted goes, with the spill file that belonged to it. A live owner's stays. */
static void remove_leftover(struct kvstore *kv)
{
	int fd = shm_open(kv->shm_name, O_RDONLY | O_CLOEXEC, 0);
	if (fd < 0)
		return;
	struct shm_header hdr;
	bool dead = pread(fd, &hdr, sizeof(hdr), 0) != (ssize_t)sizeof(hdr) || hdr.magic != SHM_MAGIC ||
		    !shm_owner_alive(&hdr);
	close(fd);
	if (!dead)
		return;
	shm_unlink(kv->shm_name);
	unlink(kv->spill_path);
}

void kvstore_destroy(struct kvstore **kvp, bool remove)
{
	if (!kvp || !*kvp)
		return;
	struct kvstore *kv = *kvp;
	if (kv->h)
		pool_close(kv, remove);
	else if (remove)
		remove_leftover(kv);
	free(kv);
	*kvp = NULL;
}

/* ---- free lists and counters ---- */

static void publish_usage(struct kvstore *kv)
{
	atomic_store(&kv->h->store.slots_used, (uint64_t)(kv->h->n_slots - kv->n_free_slots));
	atomic_store(&kv->h->store.spill_used, (uint64_t)(kv->h->n_spill_slots - kv->n_free_spill));
}

/* Rebuilds the private stacks from the shared tables (pushed from the top index down so the
 * lowest index comes out first). */
static int rebuild_free_lists(struct kvstore *kv)
{
	struct kvpool_header *h = kv->h;
	uint8_t *spill_busy = calloc(h->n_spill_slots ? h->n_spill_slots : 1, 1);
	if (!spill_busy)
		return -ENOMEM;
	kv->tick = 0;
	kv->n_free_handles = 0;
	for (uint32_t i = h->n_handles; i-- > 0;) {
		struct kvpool_handle *hd = &kv->handles[i];
		if (hd->state == KVH_FREE)
			kv->free_handles[kv->n_free_handles++] = i;
		else if (hd->location == KVLOC_SPILL)
			spill_busy[hd->where] = 1;
	}
	kv->n_free_slots = 0;
	for (uint32_t s = h->n_slots; s-- > 0;) {
		struct kvpool_slot *sl = &kv->slots[s];
		if (atomic_load(&sl->state) == KVSLOT_FREE)
			kv->free_slots[kv->n_free_slots++] = s;
		if (sl->last_use > kv->tick)
			kv->tick = sl->last_use;
	}
	kv->n_free_spill = 0;
	for (uint32_t j = h->n_spill_slots; j-- > 0;)
		if (!spill_busy[j])
			kv->free_spill[kv->n_free_spill++] = j;
	free(spill_busy);
	publish_usage(kv);
	return 0;
}

static void slot_reset(struct kvpool_slot *sl)
{
	atomic_store(&sl->state, KVSLOT_FREE);
	atomic_store_explicit(&sl->ready, 0, memory_order_relaxed);
	sl->pins = 0;
	sl->handle_index = KV_NONE;
	sl->last_use = 0;
}

static void slot_release(struct kvstore *kv, uint32_t s)
{
	slot_reset(&kv->slots[s]);
	kv->free_slots[kv->n_free_slots++] = s;
}

/* Retires a handle: its value goes stale (generation bump; 0 is never a live generation). */
static void handle_release(struct kvstore *kv, uint32_t idx)
{
	struct kvpool_handle *hd = &kv->handles[idx];
	hd->state = KVH_FREE;
	hd->location = KVLOC_NONE;
	hd->where = 0;
	hd->checksum = 0;
	hd->key = 0;
	hd->generation++;
	if (hd->generation == 0)
		hd->generation = 1;
	kv->free_handles[kv->n_free_handles++] = idx;
}

static uint32_t next_stamp(struct kvstore *kv)
{
	if (++kv->stamp == 0) {
		memset(kv->mark, 0, sizeof(uint32_t) * kv->h->n_handles);
		kv->stamp = 1;
	}
	return kv->stamp;
}

/* ---- fresh layout and adoption ---- */

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
		slot_reset(sl);
		atomic_store(&sl->seq, 0);
		sl->data_offset = l->data_off + (uint64_t)s * l->block_bytes;
	}
	for (uint32_t i = 0; i < l->n_handles; i++) {
		memset(&kv->handles[i], 0, sizeof(kv->handles[i]));
		kv->handles[i].generation = 1; /* so that the value 0 is never a live handle */
	}
}

static void drop_handle(struct kvstore *kv, uint32_t idx, const char *why)
{
	log_warn("adopted KV pool %s: dropping block 0x%llx: %s", kv->shm_name,
		 (unsigned long long)handle_value(kv, idx), why);
	struct kvpool_handle *hd = &kv->handles[idx];
	hd->state = KVH_FREE;
	hd->location = KVLOC_NONE;
	hd->where = 0;
	hd->generation++;
	if (hd->generation == 0)
		hd->generation = 1;
}

/* Makes an adopted pool's tables consistent. The handle table is the truth (a handle names
 * where its bytes are); slots agree with it or are freed. The write orders in make_room,
 * load_batch and swap_in keep every crash point recoverable: a slot is marked SPILLING or
 * LOADING before its I/O, and the handle moves only after the I/O (and, for a load, the
 * checksum) succeeded; what cannot be recovered is dropped, never served wrong.
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
			slot_reset(sl);
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
			slot_reset(sl);
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

/* Takes over a mapped, adopted object whose header matches l. On failure the object is
 * closed without unlinking (it stays for a later try) and no pool is live. */
static int adopt_object(struct kvstore *kv, struct shm_object **op, const struct layout *l, char *err,
			size_t errlen)
{
	kv->shm = *op;
	*op = NULL;
	kv->h = shm_object_base(kv->shm);
	kv->slots = kvpool_slots(kv->h);
	kv->handles = kvpool_handles(kv->h);
	int rc = private_alloc(kv, l);
	if (rc) {
		snprintf(err, errlen, "out of memory adopting KV pool %s", kv->shm_name);
		goto out_close;
	}
	/* Spilled handles point into the file: reopen it as it is. */
	rc = spill_open(kv->spill_path, l->block_bytes, l->n_spill ? l->n_spill : 1, kv->io_depth, SPILL_KEEP,
			&kv->spill, err, errlen);
	if (rc)
		goto out_close;
	rc = recover_tables(kv);
	if (rc == 0)
		rc = rebuild_free_lists(kv);
	if (rc) {
		snprintf(err, errlen, "out of memory adopting KV pool %s", kv->shm_name);
		goto out_close;
	}
	kv->adopted = true;
	return 0;

out_close:
	pool_close(kv, false);
	return rc;
}

/* Lays out a new object (mapped at *op, not adopted). */
static int init_object(struct kvstore *kv, struct shm_object **op, const struct layout *l, uint64_t manifest_hash,
		       char *err, size_t errlen)
{
	kv->shm = *op;
	*op = NULL;
	kv->h = shm_object_base(kv->shm);
	int rc = private_alloc(kv, l);
	if (rc) {
		snprintf(err, errlen, "out of memory creating KV pool %s", kv->shm_name);
		goto out_unlink;
	}
	rc = spill_open(kv->spill_path, l->block_bytes, l->n_spill ? l->n_spill : 1, kv->io_depth, SPILL_TRUNCATE,
			&kv->spill, err, errlen);
	if (rc)
		goto out_unlink;
	layout_init(kv, l, manifest_hash);
	rc = rebuild_free_lists(kv);
	if (rc) {
		snprintf(err, errlen, "out of memory creating KV pool %s", kv->shm_name);
		goto out_unlink;
	}
	shm_object_set_ready(kv->shm);
	kv->adopted = false;
	return 0;

out_unlink:
	pool_close(kv, true);
	return rc;
}

static int create_object(struct kvstore *kv, const struct layout *l, enum shm_leftover policy,
			 struct shm_object **o, bool *adopted, char *err, size_t errlen)
{
	int rc = shm_object_create(kv->shm_name, (size_t)l->total, SHM_KIND_KV_POOL, KVPOOL_LAYOUT_VERSION, policy,
				   o, adopted);
	if (rc == -EBUSY)
		snprintf(err, errlen, "KV pool %s is owned by a live process: stop that kv-store first or pick another "
			 "--instance", kv->shm_name);
	else if (rc)
		snprintf(err, errlen, "cannot create KV pool %s of %llu bytes: %s", kv->shm_name,
			 (unsigned long long)l->total, strerror(-rc));
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
	if (!atomic_load(&hdr.shm.ready) || layout_compute(hdr.block_bytes, hdr.n_slots, hdr.n_spill_slots, &l) ||
	    !header_matches(&hdr, &l) || (uint64_t)st.st_size != l.total) {
		log_warn("leftover KV pool %s is incomplete or inconsistent: it is replaced at configure",
			 kv->shm_name);
		return 0;
	}
	struct shm_object *o = NULL;
	bool adopted = false;
	int rc = create_object(kv, &l, SHM_ADOPT, &o, &adopted, err, errlen);
	if (rc)
		return rc;
	if (!adopted || !header_matches(shm_object_base(o), &l)) {
		/* The leftover went or changed between the look and the map: nothing to adopt. */
		shm_object_close(&o, !adopted);
		return 0;
	}
	rc = adopt_object(kv, &o, &l, err, errlen);
	if (rc)
		return rc;
	uint64_t want_slots = kv->dram_budget / l.block_bytes, want_spill = kv->disk_budget / l.block_bytes;
	if (want_slots != l.n_slots || want_spill != l.n_spill)
		log_info("the adopted KV pool keeps its geometry (%u blocks, %u spill blocks of %llu bytes); the "
			 "budgets given (%llu and %llu blocks) apply when it is next reconfigured", l.n_slots,
			 l.n_spill, (unsigned long long)l.block_bytes, (unsigned long long)want_slots,
			 (unsigned long long)want_spill);
	return 1;
}

int kvstore_configure(struct kvstore *kv, uint64_t block_bytes, uint64_t manifest_hash, char *err, size_t errlen)
{
	char a[32], b[32];
	if (block_bytes == 0 || block_bytes % 4096) {
		snprintf(err, errlen, "block_bytes %llu is not a positive multiple of 4096",
			 (unsigned long long)block_bytes);
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
	if (layout_compute(block_bytes, n_slots, n_spill, &l)) {
		snprintf(err, errlen, "kv-dram-budget %s and kv-disk-budget %s make %llu blocks of %llu bytes: too "
			 "many (at most 2^31)", format_size(kv->dram_budget, a, sizeof(a)),
			 format_size(kv->disk_budget, b, sizeof(b)), (unsigned long long)(n_slots + n_spill),
			 (unsigned long long)block_bytes);
		return -EINVAL;
	}
	if (kv->h) {
		struct kvpool_header *h = kv->h;
		if (h->block_bytes == block_bytes && h->manifest_hash == manifest_hash)
			return 0;
		uint32_t live = h->n_handles - kv->n_free_handles;
		if (live) {
			snprintf(err, errlen, "the KV pool holds %u live blocks of %llu bytes for model %016llx; free "
				 "them before configuring blocks of %llu bytes for model %016llx", live,
				 (unsigned long long)h->block_bytes, (unsigned long long)h->manifest_hash,
				 (unsigned long long)block_bytes, (unsigned long long)manifest_hash);
			return -EBUSY;
		}
		log_info("reconfiguring the KV pool: blocks of %llu bytes for model %016llx",
			 (unsigned long long)block_bytes, (unsigned long long)manifest_hash);
		/* Keep the spill file: it is truncated when reopened below. */
		spill_close(&kv->spill, false);
		pool_close(kv, true);
	}
	struct shm_object *o = NULL;
	bool adopted = false;
	int rc = create_object(kv, &l, SHM_ADOPT, &o, &adopted, err, errlen);
	if (rc)
		return rc;
	if (adopted) {
		struct kvpool_header *h = shm_object_base(o);
		if (header_matches(h, &l) && h->block_bytes == block_bytes && h->manifest_hash == manifest_hash) {
			rc = adopt_object(kv, &o, &l, err, errlen);
			if (rc == 0)
				log_info("KV pool %s adopted at configure", kv->shm_name);
			return rc;
		}
		log_info("leftover KV pool %s holds blocks of another size or model: replaced", kv->shm_name);
		shm_object_close(&o, true);
		rc = create_object(kv, &l, SHM_RECLAIM, &o, &adopted, err, errlen);
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

void kvstore_info(const struct kvstore *kv, struct kvstore_info *out)
{
	memset(out, 0, sizeof(*out));
	out->shm_name = "";
	if (!kv->h)
		return;
	out->configured = true;
	out->shm_name = kv->shm_name;
	out->shm_size = shm_object_size(kv->shm);
	out->n_slots = kv->h->n_slots;
	out->n_spill_slots = kv->h->n_spill_slots;
	out->block_bytes = kv->h->block_bytes;
	out->manifest_hash = kv->h->manifest_hash;
	out->epoch = kv->h->pool_epoch;
}

struct kvpool_header *kvstore_header(const struct kvstore *kv)
{
	return kv->h;
}

bool kvstore_adopted(const struct kvstore *kv)
{
	return kv->adopted;
}

bool kvstore_o_direct(const struct kvstore *kv)
{
	return kv->spill && spill_o_direct(kv->spill);
}

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

/* ---- eviction ---- */

struct victim {
	uint64_t last_use;
	uint32_t slot;
};

static int victim_cmp(const void *a, const void *b)
{
	const struct victim *x = a, *y = b;
	if (x->last_use != y->last_use)
		return x->last_use < y->last_use ? -1 : 1;
	return x->slot < y->slot ? -1 : x->slot > y->slot;
}

/* Fills v (n_slots entries) with the evictable slots, least recently used first: COMMITTED,
 * unpinned and, with exclude_stamp, not holding a block the current request names. Returns
 * how many there are. */
static uint32_t collect_victims(struct kvstore *kv, uint32_t exclude_stamp, struct victim *v)
{
	uint32_t nv = 0;
	for (uint32_t s = 0; s < kv->h->n_slots; s++) {
		struct kvpool_slot *sl = &kv->slots[s];
		if (atomic_load(&sl->state) != KVSLOT_COMMITTED || sl->pins != 0)
			continue;
		if (exclude_stamp && kv->mark[sl->handle_index] == exclude_stamp)
			continue;
		v[nv++] = (struct victim){.last_use = sl->last_use, .slot = s};
	}
	qsort(v, nv, sizeof(*v), victim_cmp);
	return nv;
}

static int pool_full(struct kvstore *kv, uint32_t evictable, uint32_t asked, char *err, size_t errlen)
{
	if (evictable == 0 && kv->n_free_slots == 0)
		snprintf(err, errlen, "KV pool full: %u blocks, all pinned", kv->h->n_slots);
	else
		snprintf(err, errlen, "KV pool full: %u blocks, %u free and %u evictable, %u needed (the rest are "
			 "pinned or named in this request)", kv->h->n_slots, kv->n_free_slots, evictable, asked);
	return -ENOSPC;
}

/* Frees `need` slots by spilling the least-recently-used evictable blocks (see
 * collect_victims) in one io_uring batch. Returns 0; -ENOSPC (not enough evictable blocks or
 * spill slots; nothing changed); -EIO (the blocks whose writes succeeded are spilled, the
 * others stay in the pool); -ENOMEM. */
static int make_room(struct kvstore *kv, uint32_t need, uint32_t exclude_stamp, uint32_t asked, char *err,
		     size_t errlen)
{
	struct kvpool_header *h = kv->h;
	struct victim *v = malloc(sizeof(*v) * h->n_slots);
	struct spill_io *ios = malloc(sizeof(*ios) * need);
	int rc;
	if (!v || !ios) {
		snprintf(err, errlen, "out of memory spilling %u blocks", need);
		rc = -ENOMEM;
		goto out_free;
	}
	uint32_t nv = collect_victims(kv, exclude_stamp, v);
	if (nv < need) {
		rc = pool_full(kv, nv, asked, err, errlen);
		goto out_free;
	}
	if (kv->n_free_spill < need) {
		char a[32];
		snprintf(err, errlen, "spill file %s full: %u of %u blocks of %llu bytes in use, %u more needed; raise "
			 "--kv-disk-budget (now %s)", kv->spill_path, h->n_spill_slots - kv->n_free_spill,
			 h->n_spill_slots, (unsigned long long)h->block_bytes, need,
			 format_size(kv->disk_budget, a, sizeof(a)));
		rc = -ENOSPC;
		goto out_free;
	}
	for (uint32_t k = 0; k < need; k++) {
		uint32_t s = v[k].slot;
		/* SPILLING before the write: a crash from here on recovers the slot as COMMITTED. */
		atomic_store(&kv->slots[s].state, KVSLOT_SPILLING);
		ios[k] = (struct spill_io){.buf = slot_data(kv, s), .slot = kv->free_spill[--kv->n_free_spill],
					   .write = true};
	}
	rc = spill_run(kv->spill, ios, need, err, errlen);
	for (uint32_t k = 0; k < need; k++) {
		uint32_t s = v[k].slot;
		struct kvpool_slot *sl = &kv->slots[s];
		if (ios[k].res) {
			atomic_store(&sl->state, KVSLOT_COMMITTED);
			kv->free_spill[kv->n_free_spill++] = ios[k].slot;
			continue;
		}
		/* The handle moves first, the slot frees after (slot_release's atomic store orders
		 * them): recover_tables frees a SPILLING slot whose handle points into the file. */
		struct kvpool_handle *hd = &kv->handles[sl->handle_index];
		hd->where = ios[k].slot;
		/* Kept in this order for a crash (not for another thread): "pool" with a spill
		 * index is recovered from the SPILLING slot that names the handle. */
		atomic_signal_fence(memory_order_seq_cst);
		hd->location = KVLOC_SPILL;
		slot_release(kv, s);
		atomic_fetch_add(&h->store.spills, 1);
		atomic_fetch_add(&h->store.spill_bytes_written, h->block_bytes);
	}
	publish_usage(kv);
out_free:
	free(ios);
	free(v);
	return rc;
}

/* A block read back from spill slot j failed its checksum: count it, log it, drop it. */
static int checksum_failed(struct kvstore *kv, uint32_t idx, uint32_t j, uint32_t crc, char *err, size_t errlen)
{
	uint64_t hv = handle_value(kv, idx);
	log_error("checksum mismatch on KV block 0x%llx read from %s at offset %llu (CRC-32C %08x, committed as "
		  "%08x): block dropped", (unsigned long long)hv, kv->spill_path,
		  (unsigned long long)j * kv->h->block_bytes, crc, kv->handles[idx].checksum);
	atomic_fetch_add(&kv->h->store.checksum_failures, 1);
	snprintf(err, errlen, "checksum mismatch on KV block 0x%llx: dropped", (unsigned long long)hv);
	handle_release(kv, idx);
	kv->free_spill[kv->n_free_spill++] = j;
	return -EIO;
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
	if (count > kv->n_free_slots) {
		rc = make_room(kv, count - kv->n_free_slots, 0, count, err, errlen);
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
		struct kvpool_slot *sl = &kv->slots[s];
		atomic_store_explicit(&sl->ready, 0, memory_order_relaxed);
		sl->pins = 1;
		sl->handle_index = idx;
		sl->last_use = ++kv->tick;
		atomic_store(&sl->state, KVSLOT_WRITING);
		handles[i] = kv_handle_make(idx, hd->generation);
		offsets[i] = slot_data_offset(kv, s);
	}
	atomic_fetch_add(&h->store.allocs, count);
	publish_usage(kv);
	return 0;
}

int kvstore_mark_ready(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen)
{
	if (!kv->h)
		return not_configured(kv, err, errlen);
	int rc = check_count(n, err, errlen);
	if (rc)
		return rc;
	uint32_t stamp = next_stamp(kv);
	for (uint32_t i = 0; i < n; i++) {
		int64_t idx = check_handle(kv, handles[i], stamp, err, errlen);
		if (idx < 0)
			return (int)idx;
		if (kv->handles[idx].state != KVH_WRITING) {
			snprintf(err, errlen, "handle 0x%llx is not being written", (unsigned long long)handles[i]);
			return -EINVAL;
		}
	}
	for (uint32_t i = 0; i < n; i++)
		atomic_store_explicit(&kv->slots[kv->handles[kv_handle_index(handles[i])].where].ready, 1,
				      memory_order_release);
	return 0;
}

int kvstore_commit(struct kvstore *kv, const uint64_t *handles, const uint64_t *keys, uint32_t n, char *err,
		   size_t errlen)
{
	if (!kv->h)
		return not_configured(kv, err, errlen);
	int rc = check_count(n, err, errlen);
	if (rc)
		return rc;
	uint32_t stamp = next_stamp(kv);
	for (uint32_t i = 0; i < n; i++) {
		int64_t idx = check_handle(kv, handles[i], stamp, err, errlen);
		if (idx < 0)
			return (int)idx;
		const struct kvpool_handle *hd = &kv->handles[idx];
		if (hd->state != KVH_WRITING) {
			snprintf(err, errlen, "handle 0x%llx is already committed", (unsigned long long)handles[i]);
			return -EINVAL;
		}
	}
	for (uint32_t i = 0; i < n; i++) {
		const struct kvpool_handle *hd = &kv->handles[kv_handle_index(handles[i])];
		/* Pairs with the runner's release store of ready after its copy into the slot. */
		if (!atomic_load_explicit(&kv->slots[hd->where].ready, memory_order_acquire)) {
			snprintf(err, errlen, "block 0x%llx not ready: its copy has not completed",
				 (unsigned long long)handles[i]);
			return -EAGAIN;
		}
	}
	for (uint32_t i = 0; i < n; i++) {
		struct kvpool_handle *hd = &kv->handles[kv_handle_index(handles[i])];
		struct kvpool_slot *sl = &kv->slots[hd->where];
		hd->checksum = crc32c(0, slot_data(kv, hd->where), kv->h->block_bytes);
		hd->key = keys ? keys[i] : 0;
		hd->state = KVH_COMMITTED;
		atomic_store(&sl->state, KVSLOT_COMMITTED);
		if (sl->pins)
			sl->pins--;
		atomic_store_explicit(&sl->ready, 0, memory_order_relaxed);
		sl->last_use = ++kv->tick;
	}
	atomic_fetch_add(&kv->h->store.commits, n);
	return 0;
}

/* Reads the spilled blocks handles[pos[0..n)] back into free slots (n <= free slots) in one
 * batch, checks their checksums and pins them. Returns 0; -EIO (err names the first failure:
 * a block that failed its checksum is dropped, one whose read failed stays in the file);
 * -ENOMEM. The blocks that made it are in the pool, pinned, offsets filled. */
static int load_batch(struct kvstore *kv, const uint64_t *handles, const uint32_t *pos, uint32_t n,
		      uint64_t *offsets, char *err, size_t errlen)
{
	struct kvpool_header *h = kv->h;
	struct spill_io *ios = malloc(sizeof(*ios) * n);
	uint32_t *slot = malloc(sizeof(*slot) * n);
	int rc = 0;
	if (!ios || !slot) {
		snprintf(err, errlen, "out of memory reading back %u blocks", n);
		rc = -ENOMEM;
		goto out_free;
	}
	assert(n <= kv->n_free_slots);
	for (uint32_t k = 0; k < n; k++) {
		struct kvpool_handle *hd = &kv->handles[kv_handle_index(handles[pos[k]])];
		uint32_t s = kv->free_slots[--kv->n_free_slots];
		struct kvpool_slot *sl = &kv->slots[s];
		/* seq odd while the bytes are rewritten; LOADING so that a crash frees the slot. */
		atomic_fetch_add(&sl->seq, 1);
		sl->handle_index = kv_handle_index(handles[pos[k]]);
		sl->pins = 0;
		atomic_store(&sl->state, KVSLOT_LOADING);
		ios[k] = (struct spill_io){.buf = slot_data(kv, s), .slot = hd->where, .write = false};
		slot[k] = s;
	}
	char ioerr[512] = "";
	spill_run(kv->spill, ios, n, ioerr, sizeof(ioerr));
	for (uint32_t k = 0; k < n; k++) {
		uint32_t i = pos[k], s = slot[k];
		uint32_t idx = kv_handle_index(handles[i]);
		struct kvpool_handle *hd = &kv->handles[idx];
		struct kvpool_slot *sl = &kv->slots[s];
		uint32_t j = hd->where;
		if (ios[k].res) {
			/* The bytes may still be good on disk: the handle stays in the spill file. */
			if (!rc)
				snprintf(err, errlen, "%s", ioerr);
			rc = -EIO;
			slot_release(kv, s);
			atomic_fetch_add(&sl->seq, 1);
			continue;
		}
		atomic_fetch_add(&h->store.spill_bytes_read, h->block_bytes);
		uint32_t crc = crc32c(0, ios[k].buf, h->block_bytes);
		if (crc != hd->checksum) {
			if (!rc)
				checksum_failed(kv, idx, j, crc, err, errlen);
			else
				checksum_failed(kv, idx, j, crc, ioerr, sizeof(ioerr));
			rc = -EIO;
			slot_release(kv, s);
			atomic_fetch_add(&sl->seq, 1);
			continue;
		}
		/* Pinned before the handle moves, the handle before the slot turns COMMITTED:
		 * recover_tables keeps a LOADING slot whose handle points at it. */
		sl->pins = 1;
		sl->last_use = ++kv->tick;
		/* Location first, then where, in this order for a crash: "pool" with the spill
		 * index is recovered from the LOADING slot that names the handle, while "spill"
		 * with a pool index would point into the wrong spill slot. */
		atomic_signal_fence(memory_order_seq_cst);
		hd->location = KVLOC_POOL;
		atomic_signal_fence(memory_order_seq_cst);
		hd->where = s;
		atomic_store(&sl->state, KVSLOT_COMMITTED);
		atomic_fetch_add(&sl->seq, 1);
		kv->free_spill[kv->n_free_spill++] = j;
		offsets[i] = slot_data_offset(kv, s);
	}
out_free:
	free(ios);
	free(slot);
	return rc;
}

/* The pool has no free slot and the spill file no free slot: trades the spilled block
 * handles[pos] for the least recently used evictable block through a bounce buffer (read the
 * spilled block out, write the victim into the spill slot it left, copy the block into the
 * victim's slot). Returns 0 (the block pinned, offsets[pos] filled) or -EIO/-ENOMEM. */
static int swap_in(struct kvstore *kv, const uint64_t *handles, uint32_t pos, uint32_t stamp, uint64_t *offsets,
		   char *err, size_t errlen)
{
	struct kvpool_header *h = kv->h;
	uint32_t idx = kv_handle_index(handles[pos]);
	struct kvpool_handle *hd = &kv->handles[idx];
	uint32_t j = hd->where;
	struct victim *v = malloc(sizeof(*v) * h->n_slots);
	int rc;
	if (!kv->bounce && posix_memalign(&kv->bounce, 4096, h->block_bytes) != 0)
		kv->bounce = NULL;
	if (!v || !kv->bounce) {
		snprintf(err, errlen, "out of memory reading back block 0x%llx", (unsigned long long)handles[pos]);
		rc = -ENOMEM;
		goto out_free;
	}
	if (collect_victims(kv, stamp, v) == 0) {
		/* kvstore_fetch checked there are enough; reaching this is a bug. */
		rc = pool_full(kv, 0, 1, err, errlen);
		goto out_free;
	}
	uint32_t s = v[0].slot;
	struct kvpool_slot *sl = &kv->slots[s];
	struct kvpool_handle *victim = &kv->handles[sl->handle_index];

	struct spill_io io = {.buf = kv->bounce, .slot = j, .write = false};
	rc = spill_run(kv->spill, &io, 1, err, errlen);
	if (rc)
		goto out_free;
	atomic_fetch_add(&h->store.spill_bytes_read, h->block_bytes);
	uint32_t crc = crc32c(0, kv->bounce, h->block_bytes);
	if (crc != hd->checksum) {
		rc = checksum_failed(kv, idx, j, crc, err, errlen);
		goto out_free;
	}
	atomic_store(&sl->state, KVSLOT_SPILLING);
	io = (struct spill_io){.buf = slot_data(kv, s), .slot = j, .write = true};
	rc = spill_run(kv->spill, &io, 1, err, errlen);
	if (rc) {
		atomic_store(&sl->state, KVSLOT_COMMITTED);
		log_warn("KV block 0x%llx: a failed write may have damaged its spill slot; its checksum will tell",
			 (unsigned long long)handles[pos]);
		goto out_free;
	}
	/* j now holds the victim. A crash between these steps loses at most the block being
	 * swapped in (its bytes live only in the bounce buffer), never a wrong byte: it gives up
	 * its spill slot first, the victim takes it, and the block claims the slot only after it
	 * has been copied in full (recover_tables keeps a LOADING slot whose handle points at it
	 * and frees one whose handle does not). */
	hd->location = KVLOC_NONE;
	atomic_thread_fence(memory_order_release);
	victim->where = j;
	atomic_signal_fence(memory_order_seq_cst); /* as in make_room */
	victim->location = KVLOC_SPILL;
	atomic_fetch_add(&h->store.spills, 1);
	atomic_fetch_add(&h->store.spill_bytes_written, h->block_bytes);
	atomic_fetch_add(&sl->seq, 1);
	sl->handle_index = idx;
	sl->pins = 0;
	atomic_store(&sl->state, KVSLOT_LOADING);
	memcpy(slot_data(kv, s), kv->bounce, h->block_bytes);
	sl->pins = 1;
	sl->last_use = ++kv->tick;
	atomic_thread_fence(memory_order_release);
	hd->where = s;
	hd->location = KVLOC_POOL;
	atomic_store(&sl->state, KVSLOT_COMMITTED);
	atomic_fetch_add(&sl->seq, 1);
	offsets[pos] = slot_data_offset(kv, s);
out_free:
	free(v);
	return rc;
}

int kvstore_fetch(struct kvstore *kv, const uint64_t *handles, uint32_t n, uint64_t *offsets, char *err,
		  size_t errlen)
{
	if (!kv->h)
		return not_configured(kv, err, errlen);
	struct kvpool_header *h = kv->h;
	int rc = check_count(n, err, errlen);
	if (rc)
		return rc;
	uint32_t stamp = next_stamp(kv);
	uint32_t n_load = 0;
	for (uint32_t i = 0; i < n; i++) {
		int64_t idx = check_handle(kv, handles[i], stamp, err, errlen);
		if (idx < 0)
			return (int)idx;
		const struct kvpool_handle *hd = &kv->handles[idx];
		if (hd->state != KVH_COMMITTED) {
			snprintf(err, errlen, "handle 0x%llx is not committed: it is still being written",
				 (unsigned long long)handles[i]);
			return -EINVAL;
		}
		if (hd->location == KVLOC_SPILL)
			n_load++;
	}
	uint32_t *loads = malloc(sizeof(uint32_t) * (n_load ? n_load : 1)); /* request positions */
	struct victim *v = NULL;
	if (!loads) {
		snprintf(err, errlen, "out of memory fetching %u blocks", n);
		return -ENOMEM;
	}
	if (n_load > kv->n_free_slots) {
		/* All or nothing: the room must exist before anything moves. */
		v = malloc(sizeof(*v) * h->n_slots);
		if (!v) {
			snprintf(err, errlen, "out of memory fetching %u blocks", n);
			rc = -ENOMEM;
			goto out_free;
		}
		uint32_t nv = collect_victims(kv, stamp, v);
		if (nv + kv->n_free_slots < n_load) {
			rc = pool_full(kv, nv, n_load, err, errlen);
			goto out_free;
		}
	}
	/* Pin what is in the pool: pinned blocks are never evicted by the loads that follow. */
	uint32_t k = 0;
	for (uint32_t i = 0; i < n; i++) {
		struct kvpool_handle *hd = &kv->handles[kv_handle_index(handles[i])];
		if (hd->location == KVLOC_SPILL) {
			loads[k++] = i;
			continue;
		}
		struct kvpool_slot *sl = &kv->slots[hd->where];
		sl->pins++;
		sl->last_use = ++kv->tick;
		offsets[i] = slot_data_offset(kv, hd->where);
	}
	/* Read the rest back in rounds: each spills as many victims as there are free spill
	 * slots (one batch) and reads as many blocks as there are free pool slots (one batch);
	 * the blocks read free their spill slots for the next round. With neither a free pool
	 * slot nor a free spill slot, one block is swapped in through a bounce buffer. */
	for (k = 0; k < n_load && rc == 0;) {
		if (kv->n_free_slots == 0 && kv->n_free_spill == 0) {
			rc = swap_in(kv, handles, loads[k], stamp, offsets, err, errlen);
			k++;
			continue;
		}
		if (kv->n_free_slots == 0) {
			uint32_t want = n_load - k < kv->n_free_spill ? n_load - k : kv->n_free_spill;
			rc = make_room(kv, want, stamp, n_load, err, errlen);
			if (rc)
				break;
		}
		uint32_t batch = n_load - k < kv->n_free_slots ? n_load - k : kv->n_free_slots;
		rc = load_batch(kv, handles, loads + k, batch, offsets, err, errlen);
		k += batch;
	}
	if (rc) {
		/* Nothing this request pinned stays pinned; blocks read back stay in the pool. */
		for (uint32_t i = 0; i < n; i++) {
			struct kvpool_handle *hd = &kv->handles[kv_handle_index(handles[i])];
			if (hd->state == KVH_COMMITTED && hd->generation == kv_handle_generation(handles[i]) &&
			    hd->location == KVLOC_POOL && kv->slots[hd->where].pins)
				kv->slots[hd->where].pins--;
		}
		if (rc != -ENOMEM)
			rc = -EIO;
	} else {
		atomic_fetch_add(&h->store.fetches, n);
		atomic_fetch_add(&h->store.fetches_from_disk, n_load);
	}
	publish_usage(kv);
out_free:
	free(v);
	free(loads);
	return rc;
}

int kvstore_unpin(struct kvstore *kv, const uint64_t *handles, uint32_t n, char *err, size_t errlen)
{
	if (!kv->h)
		return not_configured(kv, err, errlen);
	int rc = check_count(n, err, errlen);
	if (rc)
		return rc;
	uint32_t stamp = next_stamp(kv);
	for (uint32_t i = 0; i < n; i++) {
		int64_t idx = check_handle(kv, handles[i], stamp, err, errlen);
		if (idx < 0)
			return (int)idx;
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
	if (!kv->h)
		return not_configured(kv, err, errlen);
	int rc = check_count(n, err, errlen);
	if (rc)
		return rc;
	uint32_t stamp = next_stamp(kv);
	for (uint32_t i = 0; i < n; i++) {
		int64_t idx = check_handle(kv, handles[i], stamp, err, errlen);
		if (idx < 0)
			return (int)idx;
	}
	for (uint32_t i = 0; i < n; i++) {
		uint32_t idx = kv_handle_index(handles[i]);
		struct kvpool_handle *hd = &kv->handles[idx];
		if (hd->location == KVLOC_POOL)
			slot_release(kv, hd->where);
		else if (hd->location == KVLOC_SPILL)
			kv->free_spill[kv->n_free_spill++] = hd->where;
		handle_release(kv, idx);
	}
	atomic_fetch_add(&kv->h->store.frees, n);
	publish_usage(kv);
	return 0;
}

uint32_t kvstore_free_all(struct kvstore *kv)
{
	if (!kv->h)
		return 0;
	uint32_t n = 0;
	for (uint32_t idx = 0; idx < kv->h->n_handles; idx++) {
		struct kvpool_handle *hd = &kv->handles[idx];
		if (hd->state == KVH_FREE)
			continue;
		if (hd->location == KVLOC_POOL)
			slot_release(kv, hd->where);
		else if (hd->location == KVLOC_SPILL)
			kv->free_spill[kv->n_free_spill++] = hd->where;
		handle_release(kv, idx);
		n++;
	}
	atomic_fetch_add(&kv->h->store.frees, n);
	publish_usage(kv);
	return n;
}

/* ---- stats ---- */

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
#undef STORE
	rc |= json_object_set_new(o, "o_direct", json_boolean(kvstore_o_direct(kv)));
	rc |= json_object_set_new(o, "adopted", json_boolean(kv->adopted));
	rc |= json_object_set_new(o, "configured", json_boolean(h != NULL));
	char *text = rc ? NULL : json_dumps(o, JSON_COMPACT);
	json_decref(o);
	return text;
}

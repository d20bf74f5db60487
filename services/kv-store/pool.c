/* pool.c - the kv-store's block pool (pool.h): create and destroy, the memory of the private
 * tables, and the read-only accessors. The pool's other jobs live beside it, each in a file of its
 * own (pool_internal.h lists them). */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/util.h"
#include "services/kv-store/keymap.h"
#include "services/kv-store/pool_internal.h"
#include "services/kv-store/spill.h"

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
	    str_copy(kv->spill_path, sizeof(kv->spill_path), cfg->spill_path) != 0 ||
	    (cfg->index_path && str_copy(kv->index_path, sizeof(kv->index_path), cfg->index_path) != 0)) {
		free(kv);
		return -EINVAL;
	}
	kv->persistent = cfg->index_path != NULL;
	kv->dram_budget = cfg->dram_budget;
	kv->disk_budget = cfg->disk_budget;
	kv->io_depth = cfg->io_depth;
	kv->dram_limit = cfg->dram_budget;
	kv->disk_limit = cfg->disk_budget;
	kv->io_limit = cfg->io_depth;
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
	free(kv->recorded);
	free(kv->parked_slots);
	free(kv->parked_spill);
	keymap_destroy(&kv->keys);
	kv->bounce = NULL;
	kv->recorded = NULL;
	kv->parked_slots = kv->parked_spill = NULL;
	kv->n_parked_slots = kv->n_parked_spill = 0;
	kv->free_slots = kv->free_spill = kv->free_handles = kv->mark = NULL;
	kv->n_free_slots = kv->n_free_spill = kv->n_free_handles = 0;
	kv->stamp = 0;
}

int kvs_private_alloc(struct kvstore *kv, const struct layout *l)
{
	kv->free_slots = malloc(sizeof(uint32_t) * l->n_slots);
	kv->free_spill = malloc(sizeof(uint32_t) * (l->n_spill ? l->n_spill : 1));
	kv->free_handles = malloc(sizeof(uint32_t) * l->n_handles);
	kv->mark = calloc(l->n_handles, sizeof(uint32_t));
	kv->keys = keymap_create(l->n_handles);
	kv->recorded = calloc(l->n_spill ? l->n_spill : 1, 1);
	kv->parked_slots = malloc(sizeof(uint32_t) * l->n_slots);
	kv->parked_spill = malloc(sizeof(uint32_t) * (l->n_spill ? l->n_spill : 1));
	kv->n_parked_slots = kv->n_parked_spill = 0;
	if (!kv->free_slots || !kv->free_spill || !kv->free_handles || !kv->mark || !kv->keys || !kv->recorded ||
	    !kv->parked_slots || !kv->parked_spill) {
		private_free(kv);
		return -ENOMEM;
	}
	return 0;
}

/* Unmaps the pool and closes the spill file (and index); with remove, unlinks the pool and
 * deletes the spill file, unless it persists. */
void kvs_pool_close(struct kvstore *kv, bool remove)
{
	spill_close(&kv->spill, remove && !kv->persistent);
	kvindex_close(&kv->index);
	kv->index_failed = false;
	shm_object_close(&kv->shm, remove);
	kv->h = NULL;
	kv->slots = NULL;
	kv->handles = NULL;
	kv->adopted = false;
	kv->tick = 0;
	private_free(kv);
}

/* A clean stop with no live pool still leaves nothing behind: a dead predecessor's pool that
 * was not adopted goes, with the spill file that belonged to it (unless it persists: its index
 * still describes it). A live owner's stays. */
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
	if (!kv->persistent)
		unlink(kv->spill_path);
}

void kvstore_destroy(struct kvstore **kvp, bool remove)
{
	if (!kvp || !*kvp)
		return;
	struct kvstore *kv = *kvp;
	if (kv->h && remove && kv->persistent)
		kvs_persist_at_stop(kv);
	if (kv->h)
		kvs_pool_close(kv, remove);
	else if (remove)
		remove_leftover(kv);
	free(kv);
	*kvp = NULL;
}

/* ---- what the pool is ---- */

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

bool kvstore_persistent(const struct kvstore *kv)
{
	return kv->persistent;
}

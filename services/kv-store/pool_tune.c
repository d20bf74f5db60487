/* pool_tune.c - live tuning of the kv-store pool: the budgets now (free slots past them parked),
 * the spill down to a lowered DRAM budget, and the setters and getters behind the tunables. */
#include <errno.h>

#include "common/log.h"
#include "common/tunable.h"
#include "common/util.h"
#include "services/kv-store/pool_internal.h"
#include "services/kv-store/spill.h"

/* ---- the budgets now ---- */

/* Pool blocks the DRAM budget allows now (at least one), spill blocks the disk budget allows. */
uint32_t kvs_slot_cap(const struct kvstore *kv)
{
	if (!kv->dram_tuned)
		return kv->h->n_slots;
	uint64_t b = kv->dram_limit / kv->h->block_bytes;
	if (b < 1)
		b = 1;
	return b < kv->h->n_slots ? (uint32_t)b : kv->h->n_slots;
}

uint32_t kvs_spill_cap(const struct kvstore *kv)
{
	if (!kv->disk_tuned)
		return kv->h->n_spill_slots;
	uint64_t b = kv->disk_limit / kv->h->block_bytes;
	return b < kv->h->n_spill_slots ? (uint32_t)b : kv->h->n_spill_slots;
}

/* Free pool and spill slots past the budgets leave circulation (parked); parked ones come back
 * when a budget rose. Only free slots move: the blocks over a lowered DRAM budget are spilled by
 * kvstore_enforce_budgets. Without a tune nothing is ever parked. */
void kvs_park(struct kvstore *kv)
{
	if (!kv->h || !(kv->dram_tuned || kv->disk_tuned))
		return;
	uint32_t want = kv->h->n_slots - kvs_slot_cap(kv);
	while (kv->n_parked_slots > want)
		kv->free_slots[kv->n_free_slots++] = kv->parked_slots[--kv->n_parked_slots];
	while (kv->n_parked_slots < want && kv->n_free_slots > 0)
		kv->parked_slots[kv->n_parked_slots++] = kv->free_slots[--kv->n_free_slots];
	want = kv->h->n_spill_slots - kvs_spill_cap(kv);
	while (kv->n_parked_spill > want)
		kv->free_spill[kv->n_free_spill++] = kv->parked_spill[--kv->n_parked_spill];
	while (kv->n_parked_spill < want && kv->n_free_spill > 0)
		kv->parked_spill[kv->n_parked_spill++] = kv->free_spill[--kv->n_free_spill];
	kvs_publish_usage(kv);
}

/* A request needs more pool slots at once than the lowered budget leaves (the runner fetches up to
 * the pool's laid-out size): lend it up to n parked slots, as the pool laid out at start would
 * have had them. The next enforcement spills back down. */
void kvs_unpark_slots(struct kvstore *kv, uint32_t n)
{
	while (n-- > 0 && kv->n_parked_slots > 0)
		kv->free_slots[kv->n_free_slots++] = kv->parked_slots[--kv->n_parked_slots];
	kvs_publish_usage(kv);
}

/* ---- live tuning ---- */

#define ENFORCE_BATCH 256 /* blocks spilled per enforcement: the loop stays responsive */

/* Pool slots whose block cannot leave now: being written, pinned, or in the middle of I/O. */
static uint32_t unspillable_slots(const struct kvstore *kv)
{
	uint32_t n = 0;
	for (uint32_t s = 0; s < kv->h->n_slots; s++) {
		uint32_t st = atomic_load(&kv->slots[s].state);
		n += st != KVSLOT_FREE && (st != KVSLOT_COMMITTED || kv->slots[s].pins != 0);
	}
	return n;
}

static uint32_t cached_blocks(const struct kvstore *kv)
{
	uint32_t n = 0;
	for (uint32_t i = 0; i < kv->h->n_handles; i++)
		n += kvs_cached(kv, i);
	return n;
}

static uint32_t pool_used(const struct kvstore *kv)
{
	return kv->h->n_slots - kv->n_free_slots - kv->n_parked_slots;
}

void kvstore_enforce_budgets(struct kvstore *kv)
{
	if (!kv->h || !(kv->dram_tuned || kv->disk_tuned))
		return; /* nothing tuned: the pool as laid out */
	kvs_park(kv);
	uint32_t cap = kvs_slot_cap(kv), used = pool_used(kv);
	if (used <= cap) {
		if (kv->enforce_warned)
			log_info("kv-dram-budget: the pool holds %u blocks, within the budget of %u", used, cap);
		kv->enforce_warned = false;
		return;
	}
	uint64_t now = now_ns();
	if (now < kv->enforce_after_ns)
		return;
	uint32_t need = used - cap, evictable = 0;
	for (uint32_t s = 0; s < kv->h->n_slots; s++)
		evictable += atomic_load(&kv->slots[s].state) == KVSLOT_COMMITTED && kv->slots[s].pins == 0;
	if (need > evictable)
		need = evictable; /* the rest is pinned now: spilled once released */
	if (need > ENFORCE_BATCH)
		need = ENFORCE_BATCH;
	if (need == 0)
		return;
	char err[512];
	int rc = kvs_make_room(kv, need, 0, need, err, sizeof(err));
	if (rc) {
		if (!kv->enforce_warned)
			log_warn("kv-dram-budget: cannot spill the pool down to its budget of %u blocks now (%u in use): "
				 "%s; trying again every second", cap, used, err);
		kv->enforce_warned = true;
		kv->enforce_after_ns = now + 1000000000ull;
		return;
	}
	log_debug("kv-dram-budget: spilled %u blocks toward the budget of %u", need, cap);
	kvs_park(kv);
	if (pool_used(kv) <= cap)
		log_info("kv-dram-budget: spilled down to the budget: %u blocks in the pool (at most %u)", pool_used(kv),
			 cap);
}

void kvstore_dram_range(const struct kvstore *kv, uint64_t *min, uint64_t *max)
{
	*min = kv->h ? kv->h->block_bytes : 4096;
	*max = kv->h ? (uint64_t)kv->h->n_slots * kv->h->block_bytes : kv->dram_budget;
}

void kvstore_disk_range(const struct kvstore *kv, uint64_t *min, uint64_t *max)
{
	*min = 0;
	*max = kv->h ? (uint64_t)kv->h->n_spill_slots * kv->h->block_bytes : kv->disk_budget;
}

uint64_t kvstore_dram_budget(const struct kvstore *kv)
{
	return kv->dram_tuned || !kv->h ? kv->dram_limit : (uint64_t)kv->h->n_slots * kv->h->block_bytes;
}

uint64_t kvstore_disk_budget(const struct kvstore *kv)
{
	return kv->disk_tuned || !kv->h ? kv->disk_limit : (uint64_t)kv->h->n_spill_slots * kv->h->block_bytes;
}

int kvstore_set_dram_budget(struct kvstore *kv, uint64_t bytes, bool apply, char *why, size_t whylen)
{
	char a[32], b[32], c[32];
	if (kv->h) {
		uint64_t bb = kv->h->block_bytes;
		uint32_t cap = (uint32_t)(bytes / bb);
		if (cap == 0)
			return errorf(why, whylen, -ERANGE, "%s holds no KV block of %s",
				      tunable_format_bytes((int64_t)bytes, a, sizeof(a)),
				      tunable_format_bytes((int64_t)bb, b, sizeof(b)));
		uint32_t pinned = unspillable_slots(kv), used = pool_used(kv);
		if (cap < pinned)
			return errorf(why, whylen, -EBUSY,
				      "%s is below the %s the runner holds pinned or is writing in the pool (%u blocks); "
				      "try again between requests",
				      tunable_format_bytes((int64_t)bytes, a, sizeof(a)),
				      tunable_format_bytes((int64_t)(pinned * bb), b, sizeof(b)), pinned);
		uint32_t over = used > cap ? used - cap : 0, cached_n = cached_blocks(kv);
		if (over > kv->n_free_spill + cached_n)
			return errorf(why, whylen, -ENOSPC,
				      "spilling down to %s moves %u blocks to the spill file, which has room for %u (kv-disk-budget "
				      "%s) and %u cached blocks to drop",
				      tunable_format_bytes((int64_t)bytes, a, sizeof(a)), over, kv->n_free_spill,
				      tunable_format_bytes((int64_t)kvstore_disk_budget(kv), c, sizeof(c)), cached_n);
	}
	if (!apply)
		return 0;
	kv->dram_limit = bytes;
	kv->dram_tuned = true;
	kv->enforce_after_ns = 0;
	kv->enforce_warned = false;
	kvstore_enforce_budgets(kv); /* the first batch now, the rest on the next ticks */
	return 0;
}

int kvstore_set_disk_budget(struct kvstore *kv, uint64_t bytes, bool apply, char *why, size_t whylen)
{
	char a[32], b[32];
	if (kv->h) {
		uint64_t bb = kv->h->block_bytes;
		uint32_t used = kv->h->n_spill_slots - kv->n_free_spill - kv->n_parked_spill;
		if (bytes / bb < used)
			return errorf(why, whylen, -EBUSY, "%s is below the %s already in use in the spill file (%u blocks)",
				      tunable_format_bytes((int64_t)bytes, a, sizeof(a)),
				      tunable_format_bytes((int64_t)(used * bb), b, sizeof(b)), used);
	}
	if (!apply)
		return 0;
	kv->disk_limit = bytes;
	kv->disk_tuned = true;
	kv->enforce_after_ns = 0;
	kvs_park(kv);
	return 0;
}

uint32_t kvstore_io_depth(const struct kvstore *kv)
{
	return kv->io_depth;
}

uint32_t kvstore_io_limit(const struct kvstore *kv)
{
	return kv->io_limit;
}

int kvstore_set_io_limit(struct kvstore *kv, uint32_t n)
{
	if (n < 1 || n > kv->io_depth)
		return -EINVAL;
	kv->io_limit = n;
	if (kv->spill)
		spill_set_limit(kv->spill, n);
	return 0;
}

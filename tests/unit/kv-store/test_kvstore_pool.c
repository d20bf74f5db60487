/* Tests of the kv-store's pool module (services/kv-store/pool.c) through its API, with a real
 * shared-memory object and a real spill file in a scratch directory. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"
#include "services/kv-store/keymap.h"
#include "services/kv-store/kvindex.h"
#include "services/kv-store/pool.h"
#include "tests/unit/kv-store/kvtest.h"

#define BB 8192ull /* block bytes in these tests */
#define HASH 0x1234abcdull

struct fx {
	char dir[256];
	char shm[64];
	char spill[512];
	char idx[512]; /* "" without persistence */
	struct kvstore *kv;
	char err[512];
};

static struct kvstore *fx_store(struct fx *f, uint64_t dram_blocks, uint64_t disk_blocks)
{
	struct kvstore_config cfg = {.shm_name = f->shm,
				     .spill_path = f->spill,
				     .index_path = f->idx[0] ? f->idx : NULL,
				     .dram_budget = dram_blocks * BB,
				     .disk_budget = disk_blocks * BB,
				     .io_depth = 8};
	struct kvstore *kv = NULL;
	ck_assert_int_eq(kvstore_create(&cfg, &kv), 0);
	return kv;
}

/* A scratch dir under parent, a unique pool name, and a configured store. */
static void fx_open(struct fx *f, const char *parent, uint64_t dram_blocks, uint64_t disk_blocks)
{
	memset(f, 0, sizeof(*f));
	kvt_mkdtemp(parent, f->dir, sizeof(f->dir));
	kvt_shm_name(f->shm, sizeof(f->shm));
	snprintf(f->spill, sizeof(f->spill), "%s/kv-spill.bin", f->dir);
	f->kv = fx_store(f, dram_blocks, disk_blocks);
	int rc = kvstore_configure(f->kv, BB, HASH, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "configure: %s", f->err);
}

static void fx_close(struct fx *f)
{
	kvstore_destroy(&f->kv, true);
	kvstore_destroy(&f->kv, true); /* twice is safe */
	ck_assert_int_eq(access(f->spill, F_OK), -1);
	ck_assert_int_eq(shm_open(f->shm, O_RDONLY, 0), -1);
	ck_assert_int_eq(errno, ENOENT);
	rmdir(f->dir);
}

static struct kvpool_header *H(struct fx *f)
{
	return kvstore_header(f->kv);
}

static struct kvpool_handle *handle_of(struct fx *f, uint64_t hv)
{
	return &kvpool_handles(H(f))[kv_handle_index(hv)];
}

static struct kvpool_slot *slot_of(struct fx *f, uint64_t hv)
{
	struct kvpool_handle *hd = handle_of(f, hv);
	ck_assert_uint_eq(hd->location, KVLOC_POOL);
	return &kvpool_slots(H(f))[hd->where];
}

/* ALLOC one block, write seed into it, COMMIT it with key (0: none). */
static uint64_t put_keyed(struct fx *f, uint64_t seed, uint64_t key)
{
	uint64_t h, off;
	int rc = kvstore_alloc(f->kv, 1, &h, &off, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "alloc: %s", f->err);
	kvt_write_block(H(f), off, seed);
	rc = kvstore_commit(f->kv, &h, &key, 1, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "commit: %s", f->err);
	return h;
}

/* A block without a key: freed at its FREE. */
static uint64_t put_block(struct fx *f, uint64_t seed)
{
	return put_keyed(f, seed, 0);
}

/* FETCH one block, compare it with seed, UNPIN it. */
static void check_block(struct fx *f, uint64_t h, uint64_t seed)
{
	uint64_t off;
	int rc = kvstore_fetch(f->kv, &h, 1, &off, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "fetch 0x%llx: %s", (unsigned long long)h, f->err);
	ck_assert_msg(kvt_check((char *)H(f) + off, BB, seed), "block 0x%llx read back different",
		      (unsigned long long)h);
	ck_assert_int_eq(kvstore_unpin(f->kv, &h, 1, f->err, sizeof(f->err)), 0);
}

static uint64_t stat_u64(struct fx *f, const char *key)
{
	char *text = kvstore_stats_json(f->kv);
	ck_assert_ptr_nonnull(text);
	json_error_t je;
	json_t *o = json_loads(text, 0, &je);
	ck_assert_ptr_nonnull(o);
	json_t *v = json_object_get(o, key);
	ck_assert_msg(v != NULL, "stats lack %s: %s", key, text);
	uint64_t r = json_is_boolean(v) ? (uint64_t)json_is_true(v) : (uint64_t)json_integer_value(v);
	json_decref(o);
	free(text);
	return r;
}

static void expect_err(struct fx *f, int rc, int want, const char *needle)
{
	ck_assert_msg(rc == want, "rc %d, wanted %d (%s)", rc, want, f->err);
	ck_assert_msg(strstr(f->err, needle) != NULL, "error '%s' lacks '%s'", f->err, needle);
}

/* Was h freed? (Its index may already serve another block, under a new generation.) */
static bool gone(struct fx *f, uint64_t h)
{
	const struct kvpool_handle *hd = handle_of(f, h);
	return hd->state == KVH_FREE || hd->generation != kv_handle_generation(h);
}

/* LOOKUP one key: its handle (with a new reference) or 0. */
static uint64_t lookup1(struct fx *f, uint64_t key)
{
	uint64_t h = 12345;
	int rc = kvstore_lookup(f->kv, &key, 1, &h, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "lookup: %s", f->err);
	return h;
}

static void free1(struct fx *f, uint64_t h)
{
	int rc = kvstore_free(f->kv, &h, 1, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "free 0x%llx: %s", (unsigned long long)h, f->err);
}

/* n keyed blocks (seeds seed0.., keys key0..), each FREEd: cached. */
static void build_cache(struct fx *f, uint32_t n, uint64_t seed0, uint64_t key0)
{
	for (uint32_t i = 0; i < n; i++)
		free1(f, put_keyed(f, seed0 + i, key0 + i));
}

/* ---- round trip ---- */

START_TEST(test_round_trip)
{
	struct fx f;
	fx_open(&f, "/tmp", 8, 8);
	uint64_t h[3], off[3], off2[3];
	ck_assert_int_eq(kvstore_alloc(f.kv, 3, h, off, f.err, sizeof(f.err)), 0);
	for (int i = 0; i < 3; i++) {
		ck_assert_uint_eq(off[i] % 4096, 0);
		ck_assert_uint_eq(handle_of(&f, h[i])->state, KVH_WRITING);
		ck_assert_uint_eq(slot_of(&f, h[i])->pins, 1);
		ck_assert_uint_eq(atomic_load(&slot_of(&f, h[i])->state), KVSLOT_WRITING);
		kvt_write_block(H(&f), off[i], 100 + (uint64_t)i);
	}
	uint64_t keys[3] = {7, 8, 9};
	ck_assert_int_eq(kvstore_commit(f.kv, h, keys, 3, f.err, sizeof(f.err)), 0);
	for (int i = 0; i < 3; i++) {
		struct kvpool_slot *sl = slot_of(&f, h[i]);
		ck_assert_uint_eq(handle_of(&f, h[i])->state, KVH_COMMITTED);
		ck_assert_uint_eq(handle_of(&f, h[i])->key, keys[i]);
		ck_assert_uint_eq(handle_of(&f, h[i])->checksum, crc32c(0, (char *)H(&f) + off[i], BB));
		ck_assert_uint_eq(sl->pins, 0);
		ck_assert_uint_eq(atomic_load(&sl->ready), 0);
	}
	ck_assert_int_eq(kvstore_fetch(f.kv, h, 3, off2, f.err, sizeof(f.err)), 0);
	for (int i = 0; i < 3; i++) {
		ck_assert_uint_eq(off2[i], off[i]);
		ck_assert(kvt_check((char *)H(&f) + off2[i], BB, 100 + (uint64_t)i));
		ck_assert_uint_eq(slot_of(&f, h[i])->pins, 1);
	}
	ck_assert_int_eq(kvstore_unpin(f.kv, h, 3, f.err, sizeof(f.err)), 0);
	for (int i = 0; i < 3; i++)
		ck_assert_uint_eq(handle_of(&f, h[i])->refs, 1);
	ck_assert_uint_eq(stat_u64(&f, "referenced_blocks"), 3);
	ck_assert_int_eq(kvstore_free(f.kv, h, 3, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "allocs"), 3);
	ck_assert_uint_eq(stat_u64(&f, "commits"), 3);
	ck_assert_uint_eq(stat_u64(&f, "fetches"), 3);
	ck_assert_uint_eq(stat_u64(&f, "fetches_from_disk"), 0);
	ck_assert_uint_eq(stat_u64(&f, "frees"), 3);
	/* Keyed: they stay, cached. */
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 3);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 3);
	ck_assert_uint_eq(stat_u64(&f, "referenced_blocks"), 0);
	ck_assert_uint_eq(stat_u64(&f, "persistent"), 0);
	/* A block without a key goes at its FREE. */
	uint64_t u = put_block(&f, 4);
	ck_assert_int_eq(kvstore_free(f.kv, &u, 1, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(handle_of(&f, u)->state, KVH_FREE);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 3);
	ck_assert_uint_eq(stat_u64(&f, "pool_blocks"), 8);
	ck_assert_uint_eq(stat_u64(&f, "block_bytes"), BB);
	ck_assert_uint_eq(atomic_load(&H(&f)->store.slots_used), 3);
	fx_close(&f);
}
END_TEST

/* ---- validation ---- */

START_TEST(test_configure_checks)
{
	struct fx f;
	memset(&f, 0, sizeof(f));
	kvt_mkdtemp("/tmp", f.dir, sizeof(f.dir));
	kvt_shm_name(f.shm, sizeof(f.shm));
	snprintf(f.spill, sizeof(f.spill), "%s/kv-spill.bin", f.dir);
	f.kv = fx_store(&f, 4, 4);
	uint64_t h, off;
	expect_err(&f, kvstore_alloc(f.kv, 1, &h, &off, f.err, sizeof(f.err)), -EINVAL, "not configured");
	expect_err(&f, kvstore_configure(f.kv, 0, HASH, f.err, sizeof(f.err)), -EINVAL, "multiple of 4096");
	expect_err(&f, kvstore_configure(f.kv, 4096 + 512, HASH, f.err, sizeof(f.err)), -EINVAL, "multiple of 4096");
	expect_err(&f, kvstore_configure(f.kv, 8 * BB, HASH, f.err, sizeof(f.err)), -EINVAL,
		   "holds no block of 65536 bytes; need at least 65536");
	ck_assert_ptr_null(H(&f));
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	uint64_t epoch = H(&f)->pool_epoch;
	struct kvstore_info info;
	kvstore_info(f.kv, &info);
	ck_assert(info.configured);
	ck_assert_str_eq(info.shm_name, f.shm);
	ck_assert_uint_eq(info.n_slots, 4);
	ck_assert_uint_eq(info.n_spill_slots, 4);
	ck_assert_uint_eq(info.epoch, epoch);

	/* The same configuration keeps the pool; another one is refused while a block lives. */
	h = put_block(&f, 1);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(H(&f)->pool_epoch, epoch);
	expect_err(&f, kvstore_configure(f.kv, 2 * BB, HASH, f.err, sizeof(f.err)), -EBUSY, "1 live blocks");
	expect_err(&f, kvstore_configure(f.kv, BB, HASH + 1, f.err, sizeof(f.err)), -EBUSY, "free them");
	check_block(&f, h, 1);
	ck_assert_int_eq(kvstore_free(f.kv, &h, 1, f.err, sizeof(f.err)), 0);
	ck_assert_int_eq(kvstore_configure(f.kv, 2 * BB, HASH + 1, f.err, sizeof(f.err)), 0);
	ck_assert_uint_ne(H(&f)->pool_epoch, epoch);
	ck_assert_uint_eq(H(&f)->block_bytes, 2 * BB);
	ck_assert_uint_eq(H(&f)->n_slots, 2);
	ck_assert_uint_eq(H(&f)->manifest_hash, HASH + 1);
	fx_close(&f);
}
END_TEST

START_TEST(test_commit_before_ready)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 4);
	uint64_t h[2], off[2];
	ck_assert_int_eq(kvstore_alloc(f.kv, 2, h, off, f.err, sizeof(f.err)), 0);
	kvt_write_block(H(&f), off[0], 1);
	kvt_fill((char *)H(&f) + off[1], BB, 2); /* bytes there, ready not yet stored */
	char want[64];
	snprintf(want, sizeof(want), "block 0x%llx not ready: its copy has not completed", (unsigned long long)h[1]);
	expect_err(&f, kvstore_commit(f.kv, h, NULL, 2, f.err, sizeof(f.err)), -EAGAIN, want);
	/* No partial effect: the ready one is still being written. */
	ck_assert_uint_eq(handle_of(&f, h[0])->state, KVH_WRITING);
	ck_assert_uint_eq(slot_of(&f, h[0])->pins, 1);
	ck_assert_uint_eq(stat_u64(&f, "commits"), 0);
	kvt_write_block(H(&f), off[1], 2);
	ck_assert_int_eq(kvstore_commit(f.kv, h, NULL, 2, f.err, sizeof(f.err)), 0);
	check_block(&f, h[0], 1);
	check_block(&f, h[1], 2);
	fx_close(&f);
}
END_TEST

START_TEST(test_stale_and_invalid_handles)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 4);
	uint64_t h = put_block(&f, 5);
	ck_assert_int_eq(kvstore_free(f.kv, &h, 1, f.err, sizeof(f.err)), 0);
	char hex[32];
	snprintf(hex, sizeof(hex), "0x%llx", (unsigned long long)h);
	uint64_t off;
	expect_err(&f, kvstore_fetch(f.kv, &h, 1, &off, f.err, sizeof(f.err)), -EINVAL, hex);
	ck_assert_ptr_nonnull(strstr(f.err, "stale"));
	/* Double free. */
	expect_err(&f, kvstore_free(f.kv, &h, 1, f.err, sizeof(f.err)), -EINVAL, "stale");
	expect_err(&f, kvstore_unpin(f.kv, &h, 1, f.err, sizeof(f.err)), -EINVAL, hex);
	expect_err(&f, kvstore_commit(f.kv, &h, NULL, 1, f.err, sizeof(f.err)), -EINVAL, hex);
	/* The index was reused with a new generation: the old value stays stale. */
	uint64_t h2 = put_block(&f, 6);
	ck_assert_uint_eq(kv_handle_index(h2), kv_handle_index(h));
	ck_assert_uint_ne(h2, h);
	expect_err(&f, kvstore_fetch(f.kv, &h, 1, &off, f.err, sizeof(f.err)), -EINVAL, "stale");
	/* Out of range, never allocated, zero. */
	uint64_t bad = kv_handle_make(1000, 1);
	expect_err(&f, kvstore_free(f.kv, &bad, 1, f.err, sizeof(f.err)), -EINVAL, "past the pool's 8 handles");
	bad = kv_handle_make(3, 1);
	expect_err(&f, kvstore_free(f.kv, &bad, 1, f.err, sizeof(f.err)), -EINVAL, "not allocated");
	bad = 0;
	ck_assert_int_eq(kvstore_free(f.kv, &bad, 1, f.err, sizeof(f.err)), -EINVAL);
	/* State errors. */
	uint64_t k7 = 7;
	expect_err(&f, kvstore_commit(f.kv, &h2, &k7, 1, f.err, sizeof(f.err)), -EINVAL, "already committed");
	expect_err(&f, kvstore_unpin(f.kv, &h2, 1, f.err, sizeof(f.err)), -EINVAL, "not pinned");
	uint64_t w;
	ck_assert_int_eq(kvstore_alloc(f.kv, 1, &w, &off, f.err, sizeof(f.err)), 0);
	expect_err(&f, kvstore_fetch(f.kv, &w, 1, &off, f.err, sizeof(f.err)), -EINVAL, "still being written");
	expect_err(&f, kvstore_unpin(f.kv, &w, 1, f.err, sizeof(f.err)), -EINVAL, "being written");
	expect_err(&f, kvstore_alloc(f.kv, 0, &w, &off, f.err, sizeof(f.err)), -EINVAL, "at least 1");
	uint64_t big[8];
	expect_err(&f, kvstore_alloc(f.kv, 5, big, big, f.err, sizeof(f.err)), -ENOSPC, "exceeds the KV pool's 4");
	/* A block being written can be freed, pin and all. */
	ck_assert_int_eq(kvstore_free(f.kv, &w, 1, f.err, sizeof(f.err)), 0);
	check_block(&f, h2, 6);
	fx_close(&f);
}
END_TEST

START_TEST(test_all_or_nothing)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 4);
	uint64_t a = put_block(&f, 1), b = put_block(&f, 2);
	uint64_t stale = a + 1; /* same index, wrong generation */
	uint64_t req[3] = {a, b, stale}, off[3];
	/* FREE with one bad handle frees nothing. */
	expect_err(&f, kvstore_free(f.kv, req, 3, f.err, sizeof(f.err)), -EINVAL, "stale");
	ck_assert_uint_eq(handle_of(&f, a)->state, KVH_COMMITTED);
	ck_assert_uint_eq(handle_of(&f, b)->state, KVH_COMMITTED);
	ck_assert_uint_eq(stat_u64(&f, "frees"), 0);
	/* FETCH with one bad handle pins nothing. */
	expect_err(&f, kvstore_fetch(f.kv, req, 3, off, f.err, sizeof(f.err)), -EINVAL, "stale");
	ck_assert_uint_eq(slot_of(&f, a)->pins, 0);
	ck_assert_uint_eq(slot_of(&f, b)->pins, 0);
	/* A duplicate is refused, before anything changes. */
	uint64_t dup[2] = {a, a};
	expect_err(&f, kvstore_fetch(f.kv, dup, 2, off, f.err, sizeof(f.err)), -EINVAL, "appears twice");
	ck_assert_uint_eq(slot_of(&f, a)->pins, 0);
	expect_err(&f, kvstore_free(f.kv, dup, 2, f.err, sizeof(f.err)), -EINVAL, "appears twice");
	/* UNPIN: one pinned, one not -> neither changes. */
	ck_assert_int_eq(kvstore_fetch(f.kv, &a, 1, off, f.err, sizeof(f.err)), 0);
	uint64_t ab[2] = {a, b};
	expect_err(&f, kvstore_unpin(f.kv, ab, 2, f.err, sizeof(f.err)), -EINVAL, "not pinned");
	ck_assert_uint_eq(slot_of(&f, a)->pins, 1);
	/* COMMIT: one writing, one committed -> the writing one stays uncommitted. */
	uint64_t w, woff;
	ck_assert_int_eq(kvstore_alloc(f.kv, 1, &w, &woff, f.err, sizeof(f.err)), 0);
	kvt_write_block(H(&f), woff, 3);
	uint64_t wb[2] = {w, b}, wk[2] = {0, 9};
	expect_err(&f, kvstore_commit(f.kv, wb, wk, 2, f.err, sizeof(f.err)), -EINVAL, "already committed");
	ck_assert_uint_eq(handle_of(&f, w)->state, KVH_WRITING);
	ck_assert_int_eq(kvstore_commit(f.kv, &w, NULL, 1, f.err, sizeof(f.err)), 0);
	/* Freeing a pinned block works whatever the pins. */
	ck_assert_int_eq(kvstore_free(f.kv, ab, 2, f.err, sizeof(f.err)), 0);
	check_block(&f, w, 3);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 1);
	fx_close(&f);
}
END_TEST

/* ---- spill ---- */

START_TEST(test_lru_spill_order)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 12);
	uint64_t h[12];
	for (int i = 0; i < 12; i++) {
		h[i] = put_block(&f, 1000 + (uint64_t)i);
		/* After block i the pool holds the four most recent, the rest are spilled. */
		for (int j = 0; j <= i; j++)
			ck_assert_msg(handle_of(&f, h[j])->location == (j > i - 4 ? KVLOC_POOL : KVLOC_SPILL),
				      "after block %d, block %d is in the wrong place", i, j);
	}
	ck_assert_uint_eq(stat_u64(&f, "spills"), 8);
	ck_assert_uint_eq(stat_u64(&f, "spill_used"), 8);
	ck_assert_uint_eq(stat_u64(&f, "spill_bytes_written"), 8 * BB);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 4);

	/* A fetch makes a block most recent: block 8 (the oldest in the pool) survives the next
	 * spill, block 9 goes. */
	check_block(&f, h[8], 1008);
	uint64_t extra = put_block(&f, 2000);
	ck_assert_uint_eq(handle_of(&f, h[8])->location, KVLOC_POOL);
	ck_assert_uint_eq(handle_of(&f, h[9])->location, KVLOC_SPILL);
	ck_assert_uint_eq(stat_u64(&f, "spills"), 9);

	/* Every block reads back equal, spilled or not (each read-back spills another). */
	for (int i = 0; i < 12; i++)
		check_block(&f, h[i], 1000 + (uint64_t)i);
	check_block(&f, extra, 2000);
	ck_assert_uint_eq(stat_u64(&f, "fetches"), 14);
	uint64_t from_disk = stat_u64(&f, "fetches_from_disk");
	ck_assert_uint_ge(from_disk, 9);
	ck_assert_uint_eq(stat_u64(&f, "spill_bytes_read"), from_disk * BB);
	ck_assert_uint_eq(stat_u64(&f, "spills"), 9 + from_disk);
	ck_assert_uint_eq(stat_u64(&f, "checksum_failures"), 0);
	ck_assert_uint_eq(stat_u64(&f, "pool_used") + stat_u64(&f, "spill_used"), 13);

	/* A multi-block fetch of spilled blocks never evicts a block it names. */
	uint64_t four[4] = {h[0], h[1], h[2], h[3]}, off[4];
	ck_assert_int_eq(kvstore_fetch(f.kv, four, 4, off, f.err, sizeof(f.err)), 0);
	for (int i = 0; i < 4; i++) {
		ck_assert(kvt_check((char *)H(&f) + off[i], BB, 1000 + (uint64_t)i));
		ck_assert_uint_eq(slot_of(&f, four[i])->pins, 1);
	}
	ck_assert_int_eq(kvstore_unpin(f.kv, four, 4, f.err, sizeof(f.err)), 0);
	fx_close(&f);
}
END_TEST

START_TEST(test_pinned_never_evicted)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 16);
	uint64_t h[4];
	for (int i = 0; i < 4; i++)
		h[i] = put_block(&f, (uint64_t)i);
	uint64_t off;
	/* h[0] pinned, and made the least recently used of all. */
	ck_assert_int_eq(kvstore_fetch(f.kv, &h[0], 1, &off, f.err, sizeof(f.err)), 0);
	for (int i = 1; i < 4; i++)
		check_block(&f, h[i], (uint64_t)i);
	slot_of(&f, h[0])->last_use = 0;
	for (int i = 0; i < 8; i++) {
		put_block(&f, 100 + (uint64_t)i);
		ck_assert_uint_eq(handle_of(&f, h[0])->location, KVLOC_POOL);
	}
	ck_assert_uint_eq(stat_u64(&f, "spills"), 8);
	ck_assert(kvt_check((char *)H(&f) + off, BB, 0));
	ck_assert_int_eq(kvstore_unpin(f.kv, &h[0], 1, f.err, sizeof(f.err)), 0);
	put_block(&f, 200);
	ck_assert_uint_eq(handle_of(&f, h[0])->location, KVLOC_SPILL); /* unpinned: now it goes first */
	fx_close(&f);
}
END_TEST

START_TEST(test_all_pinned)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 16);
	uint64_t h[4], off[4], x;
	ck_assert_int_eq(kvstore_alloc(f.kv, 4, h, off, f.err, sizeof(f.err)), 0);
	/* Blocks being written are pinned. */
	expect_err(&f, kvstore_alloc(f.kv, 1, &x, off, f.err, sizeof(f.err)), -ENOSPC,
		   "KV pool full: 4 blocks, all pinned");
	for (int i = 0; i < 4; i++)
		kvt_write_block(H(&f), off[i], (uint64_t)i);
	ck_assert_int_eq(kvstore_commit(f.kv, h, NULL, 4, f.err, sizeof(f.err)), 0);
	ck_assert_int_eq(kvstore_fetch(f.kv, h, 4, off, f.err, sizeof(f.err)), 0);
	/* Fetched blocks are pinned too. */
	expect_err(&f, kvstore_alloc(f.kv, 1, &x, off, f.err, sizeof(f.err)), -ENOSPC, "all pinned");
	ck_assert_uint_eq(stat_u64(&f, "spills"), 0);
	ck_assert_uint_eq(stat_u64(&f, "allocs"), 4);
	/* Three unpinned: an ALLOC of 4 still does not fit, and changes nothing. */
	ck_assert_int_eq(kvstore_unpin(f.kv, h, 3, f.err, sizeof(f.err)), 0);
	uint64_t y[4];
	expect_err(&f, kvstore_alloc(f.kv, 4, y, off, f.err, sizeof(f.err)), -ENOSPC, "3 evictable");
	ck_assert_uint_eq(stat_u64(&f, "spills"), 0);
	ck_assert_int_eq(kvstore_alloc(f.kv, 3, y, off, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "spills"), 3);
	ck_assert_uint_eq(handle_of(&f, h[3])->location, KVLOC_POOL);
	fx_close(&f);
}
END_TEST

START_TEST(test_disk_full)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 2);
	uint64_t h[6];
	for (int i = 0; i < 6; i++)
		h[i] = put_block(&f, (uint64_t)i);
	ck_assert_uint_eq(stat_u64(&f, "spill_used"), 2);
	uint64_t x, off;
	expect_err(&f, kvstore_alloc(f.kv, 1, &x, &off, f.err, sizeof(f.err)), -ENOSPC, "--kv-disk-budget");
	ck_assert_ptr_nonnull(strstr(f.err, f.spill));
	ck_assert_uint_eq(stat_u64(&f, "allocs"), 6);
	ck_assert_uint_eq(stat_u64(&f, "spills"), 2);
	for (int i = 2; i < 6; i++)
		check_block(&f, h[i], (uint64_t)i);
	/* Room comes back when a block goes. */
	ck_assert_int_eq(kvstore_free(f.kv, &h[0], 1, f.err, sizeof(f.err)), 0);
	put_block(&f, 9);
	check_block(&f, h[1], 1);
	fx_close(&f);
}
END_TEST

/* ---- live tuning: the budgets lowered and raised at run time ---- */

START_TEST(test_tuned_budgets)
{
	struct fx f;
	fx_open(&f, "/tmp", 8, 16);
	uint64_t lo, hi;
	kvstore_dram_range(f.kv, &lo, &hi);
	ck_assert_uint_eq(lo, BB);
	ck_assert_uint_eq(hi, 8 * BB);
	ck_assert_uint_eq(kvstore_dram_budget(f.kv), 8 * BB);
	uint64_t h[8];
	for (int i = 0; i < 8; i++)
		h[i] = put_block(&f, 500 + (uint64_t)i);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 8);
	ck_assert_uint_eq(stat_u64(&f, "spills"), 0);
	/* Pinned blocks cannot leave: a budget below them is refused, and nothing changes. */
	uint64_t off[8];
	ck_assert_int_eq(kvstore_fetch(f.kv, h, 3, off, f.err, sizeof(f.err)), 0);
	expect_err(&f, kvstore_set_dram_budget(f.kv, 2 * BB, false, f.err, sizeof(f.err)), -EBUSY,
		   "is below the 24KiB the runner holds pinned");
	ck_assert_uint_eq(kvstore_dram_budget(f.kv), 8 * BB);
	ck_assert_int_eq(kvstore_unpin(f.kv, h, 3, f.err, sizeof(f.err)), 0);
	/* Lowered to 3 blocks: the 5 least recently used are spilled at once. */
	ck_assert_int_eq(kvstore_set_dram_budget(f.kv, 3 * BB, false, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "spills"), 0); /* a check changes nothing */
	ck_assert_int_eq(kvstore_set_dram_budget(f.kv, 3 * BB, true, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "spills"), 5);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 3);
	ck_assert_uint_eq(stat_u64(&f, "pool_limit_blocks"), 3);
	ck_assert_uint_eq(stat_u64(&f, "dram_budget"), 3 * BB);
	for (int i = 3; i < 8; i++) /* h[0..2] were fetched last: they stayed */
		ck_assert_uint_eq(handle_of(&f, h[i])->location, KVLOC_SPILL);
	/* New blocks stay within it: each spills another. */
	uint64_t x = put_block(&f, 900);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 3);
	ck_assert_uint_eq(stat_u64(&f, "spills"), 6);
	/* A fetch of more than the budget at once still works (the pool laid out holds it); the
	 * next enforcement spills back down. Every block reads back equal. */
	uint64_t five[5] = {h[3], h[4], h[5], h[6], h[7]};
	ck_assert_int_eq(kvstore_fetch(f.kv, five, 5, off, f.err, sizeof(f.err)), 0);
	for (int i = 0; i < 5; i++)
		ck_assert(kvt_check((char *)H(&f) + off[i], BB, 503 + (uint64_t)i));
	ck_assert_uint_ge(stat_u64(&f, "pool_used"), 5);
	ck_assert_int_eq(kvstore_unpin(f.kv, five, 5, f.err, sizeof(f.err)), 0);
	kvstore_enforce_budgets(f.kv);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 3);
	for (int i = 0; i < 8; i++)
		check_block(&f, h[i], 500 + (uint64_t)i);
	check_block(&f, x, 900);
	kvstore_enforce_budgets(f.kv);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 3);
	/* The disk budget: not below what the spill file holds, nor above what was laid out. */
	uint64_t spilled = stat_u64(&f, "spill_used");
	ck_assert_uint_eq(spilled, 6);
	expect_err(&f, kvstore_set_disk_budget(f.kv, 5 * BB, false, f.err, sizeof(f.err)), -EBUSY,
		   "is below the 48KiB already in use in the spill file (6 blocks)");
	kvstore_disk_range(f.kv, &lo, &hi);
	ck_assert_uint_eq(hi, 16 * BB);
	ck_assert_int_eq(kvstore_set_disk_budget(f.kv, 6 * BB, true, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "spill_limit_blocks"), 6);
	/* The spill file is full now: a DRAM budget whose spill has no room is refused. */
	expect_err(&f, kvstore_set_dram_budget(f.kv, 1 * BB, false, f.err, sizeof(f.err)), -ENOSPC,
		   "moves 2 blocks to the spill file, which has room for 0");
	/* An ALLOC that cannot spill borrows a slot past the DRAM budget rather than fail (the pool
	 * laid out holds it); the budget is reached again once the spill file has room. */
	put_block(&f, 901);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 4);
	kvstore_enforce_budgets(f.kv);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 4);
	ck_assert_int_eq(kvstore_set_disk_budget(f.kv, 16 * BB, true, f.err, sizeof(f.err)), 0);
	kvstore_enforce_budgets(f.kv);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 3);
	/* Raised back: the pool as laid out. */
	ck_assert_int_eq(kvstore_set_dram_budget(f.kv, 8 * BB, true, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "pool_limit_blocks"), 8);
	uint64_t spills = stat_u64(&f, "spills");
	for (int i = 0; i < 5; i++)
		put_block(&f, 700 + (uint64_t)i);
	ck_assert_uint_eq(stat_u64(&f, "spills"), spills); /* 3 + 5 fit the pool again */
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 8);
	/* The io limit: 1..the depth given at create. */
	ck_assert_uint_eq(kvstore_io_depth(f.kv), 8);
	ck_assert_int_eq(kvstore_set_io_limit(f.kv, 0), -EINVAL);
	ck_assert_int_eq(kvstore_set_io_limit(f.kv, 9), -EINVAL);
	ck_assert_int_eq(kvstore_set_io_limit(f.kv, 1), 0);
	put_block(&f, 800); /* spills through a depth of 1 */
	check_block(&f, h[7], 507);
	fx_close(&f);
}
END_TEST

START_TEST(test_tuned_budget_before_configure)
{
	struct fx f;
	memset(&f, 0, sizeof(f));
	kvt_mkdtemp("/tmp", f.dir, sizeof(f.dir));
	kvt_shm_name(f.shm, sizeof(f.shm));
	snprintf(f.spill, sizeof(f.spill), "%s/kv-spill.bin", f.dir);
	f.kv = fx_store(&f, 8, 8);
	uint64_t lo, hi;
	kvstore_dram_range(f.kv, &lo, &hi);
	ck_assert_uint_eq(hi, 8 * BB);
	/* No pool yet: the budget is taken as it is and applies to the pool configure lays out. */
	ck_assert_int_eq(kvstore_set_dram_budget(f.kv, 2 * BB, true, f.err, sizeof(f.err)), 0);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "pool_blocks"), 8);
	ck_assert_uint_eq(stat_u64(&f, "pool_limit_blocks"), 2);
	for (int i = 0; i < 4; i++)
		put_block(&f, (uint64_t)i);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 2);
	ck_assert_uint_eq(stat_u64(&f, "spills"), 2);
	fx_close(&f);
}
END_TEST

START_TEST(test_fetch_when_everything_is_full)
{
	/* Pool and spill file both full: a fetch of a spilled block still works, trading places
	 * with the least recently used block. */
	struct fx f;
	fx_open(&f, "/tmp", 4, 4);
	uint64_t h[8];
	for (int i = 0; i < 8; i++)
		h[i] = put_block(&f, 20 + (uint64_t)i);
	ck_assert_uint_eq(stat_u64(&f, "spill_used"), 4);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 4);
	for (int i = 0; i < 8; i++)
		check_block(&f, h[i], 20 + (uint64_t)i);
	ck_assert_uint_eq(stat_u64(&f, "fetches_from_disk"), 8);
	ck_assert_uint_eq(stat_u64(&f, "spill_used"), 4);
	/* Three spilled blocks in one request (h[0..3] were pushed out by h[4..7] coming back). */
	uint64_t three[3] = {h[0], h[2], h[1]}, off[3];
	for (int i = 0; i < 3; i++)
		ck_assert_uint_eq(handle_of(&f, three[i])->location, KVLOC_SPILL);
	ck_assert_int_eq(kvstore_fetch(f.kv, three, 3, off, f.err, sizeof(f.err)), 0);
	ck_assert(kvt_check((char *)H(&f) + off[0], BB, 20));
	ck_assert(kvt_check((char *)H(&f) + off[1], BB, 22));
	ck_assert(kvt_check((char *)H(&f) + off[2], BB, 21));
	/* Four pinned blocks cannot be served from a pool of four with one pinned already. */
	uint64_t four[4] = {h[3], h[4], h[5], h[6]}, off4[4];
	expect_err(&f, kvstore_fetch(f.kv, four, 4, off4, f.err, sizeof(f.err)), -ENOSPC, "KV pool full");
	ck_assert_int_eq(kvstore_unpin(f.kv, three, 3, f.err, sizeof(f.err)), 0);
	ck_assert_int_eq(kvstore_fetch(f.kv, four, 4, off4, f.err, sizeof(f.err)), 0);
	for (int i = 0; i < 4; i++)
		ck_assert(kvt_check((char *)H(&f) + off4[i], BB, 23 + (uint64_t)i));
	ck_assert_uint_eq(stat_u64(&f, "checksum_failures"), 0);
	ck_assert_uint_eq(stat_u64(&f, "spill_bytes_written"), stat_u64(&f, "spills") * BB);
	fx_close(&f);
}
END_TEST

/* ---- checksum ---- */

START_TEST(test_checksum_mismatch)
{
	struct fx f;
	fx_open(&f, "/tmp", 2, 8);
	uint64_t h[4];
	for (int i = 0; i < 4; i++)
		h[i] = put_block(&f, 50 + (uint64_t)i);
	ck_assert_uint_eq(handle_of(&f, h[0])->location, KVLOC_SPILL);
	ck_assert_uint_eq(handle_of(&f, h[1])->location, KVLOC_SPILL);
	/* Flip one byte of block 0 in the spill file. */
	int fd = open(f.spill, O_RDWR);
	ck_assert_int_ge(fd, 0);
	off_t at = (off_t)(handle_of(&f, h[0])->where * BB + 100);
	unsigned char c;
	ck_assert_int_eq(pread(fd, &c, 1, at), 1);
	c ^= 0x10;
	ck_assert_int_eq(pwrite(fd, &c, 1, at), 1);
	close(fd);

	/* Fetch it together with a pooled block: EIO, and the pooled block is not left pinned. */
	uint64_t req[2] = {h[3], h[0]}, off[2];
	char want[96];
	snprintf(want, sizeof(want), "checksum mismatch on KV block 0x%llx: dropped", (unsigned long long)h[0]);
	expect_err(&f, kvstore_fetch(f.kv, req, 2, off, f.err, sizeof(f.err)), -EIO, want);
	ck_assert_uint_eq(stat_u64(&f, "checksum_failures"), 1);
	ck_assert_uint_eq(slot_of(&f, h[3])->pins, 0);
	ck_assert_uint_eq(stat_u64(&f, "fetches"), 0);
	/* The handle is gone. */
	expect_err(&f, kvstore_fetch(f.kv, &h[0], 1, off, f.err, sizeof(f.err)), -EINVAL, "stale");
	ck_assert_uint_eq(stat_u64(&f, "spill_used") + stat_u64(&f, "pool_used"), 3);
	/* The pool still serves the others, spilled or not. */
	for (int i = 1; i < 4; i++)
		check_block(&f, h[i], 50 + (uint64_t)i);
	ck_assert_uint_eq(stat_u64(&f, "checksum_failures"), 1);
	fx_close(&f);
}
END_TEST

START_TEST(test_spill_file_short)
{
	/* A spill file cut short (someone truncated it): the read-back fails with EIO naming the
	 * file and offset, the handle stays, nothing is pinned. */
	struct fx f;
	fx_open(&f, "/tmp", 2, 8);
	uint64_t h[3];
	for (int i = 0; i < 3; i++)
		h[i] = put_block(&f, (uint64_t)i);
	ck_assert_uint_eq(handle_of(&f, h[0])->location, KVLOC_SPILL);
	/* A free pool slot, so the fetch spills nothing (which would write the file again). */
	ck_assert_int_eq(kvstore_free(f.kv, &h[1], 1, f.err, sizeof(f.err)), 0);
	ck_assert_int_eq(truncate(f.spill, 0), 0);
	uint64_t off;
	expect_err(&f, kvstore_fetch(f.kv, &h[0], 1, &off, f.err, sizeof(f.err)), -EIO, f.spill);
	ck_assert_ptr_nonnull(strstr(f.err, "offset"));
	ck_assert_uint_eq(handle_of(&f, h[0])->location, KVLOC_SPILL);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 1);
	ck_assert_uint_eq(slot_of(&f, h[2])->pins, 0);
	check_block(&f, h[2], 2);
	fx_close(&f);
}
END_TEST


/* ---- references and the prefix cache ---- */

START_TEST(test_refs_and_free)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 4);
	uint64_t k = put_keyed(&f, 1, 0xabc), off;
	ck_assert_uint_eq(handle_of(&f, k)->refs, 1);
	/* The last reference goes while pinned: cached, the same handle value, no pin. */
	ck_assert_int_eq(kvstore_fetch(f.kv, &k, 1, &off, f.err, sizeof(f.err)), 0);
	free1(&f, k);
	ck_assert_uint_eq(handle_of(&f, k)->state, KVH_COMMITTED);
	ck_assert_uint_eq(handle_of(&f, k)->generation, kv_handle_generation(k));
	ck_assert_uint_eq(handle_of(&f, k)->refs, 0);
	ck_assert_uint_eq(slot_of(&f, k)->pins, 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 1);
	ck_assert_uint_eq(stat_u64(&f, "referenced_blocks"), 0);
	/* Without a reference there is nothing to free, fetch or unpin. */
	char hex[32];
	snprintf(hex, sizeof(hex), "0x%llx", (unsigned long long)k);
	expect_err(&f, kvstore_free(f.kv, &k, 1, f.err, sizeof(f.err)), -EINVAL, "holds no reference");
	ck_assert_ptr_nonnull(strstr(f.err, hex));
	expect_err(&f, kvstore_fetch(f.kv, &k, 1, &off, f.err, sizeof(f.err)), -EINVAL, "holds no reference");
	expect_err(&f, kvstore_unpin(f.kv, &k, 1, f.err, sizeof(f.err)), -EINVAL, "not pinned");
	/* Each LOOKUP hit is a reference to the same handle. */
	ck_assert_uint_eq(lookup1(&f, 0xabc), k);
	ck_assert_uint_eq(lookup1(&f, 0xabc), k);
	ck_assert_uint_eq(handle_of(&f, k)->refs, 2);
	check_block(&f, k, 1);
	free1(&f, k);
	ck_assert_uint_eq(handle_of(&f, k)->refs, 1);
	ck_assert_uint_eq(stat_u64(&f, "referenced_blocks"), 1);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 0);
	free1(&f, k);
	/* All or nothing: one handle holding no reference fails the FREE, the other keeps its own. */
	uint64_t u = put_block(&f, 2);
	uint64_t both[2] = {u, k};
	expect_err(&f, kvstore_free(f.kv, both, 2, f.err, sizeof(f.err)), -EINVAL, "holds no reference");
	ck_assert_uint_eq(handle_of(&f, u)->refs, 1);
	ck_assert_uint_eq(handle_of(&f, u)->state, KVH_COMMITTED);
	/* A block being written and one without a key go at their last FREE. */
	uint64_t w;
	ck_assert_int_eq(kvstore_alloc(f.kv, 1, &w, &off, f.err, sizeof(f.err)), 0);
	free1(&f, w);
	free1(&f, u);
	ck_assert_uint_eq(handle_of(&f, w)->state, KVH_FREE);
	ck_assert_uint_eq(handle_of(&f, u)->state, KVH_FREE);
	expect_err(&f, kvstore_free(f.kv, &u, 1, f.err, sizeof(f.err)), -EINVAL, "stale");
	ck_assert_uint_eq(stat_u64(&f, "frees"), 5);
	ck_assert_uint_eq(stat_u64(&f, "live_handles"), 1);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 1);
	fx_close(&f);
}
END_TEST

START_TEST(test_lookup_across_tiers)
{
	struct fx f;
	fx_open(&f, "/tmp", 2, 8);
	uint64_t h[6];
	for (int i = 0; i < 6; i++)
		h[i] = put_keyed(&f, 10 + (uint64_t)i, 0x1000 + (uint64_t)i);
	ck_assert_int_eq(kvstore_free(f.kv, h, 6, f.err, sizeof(f.err)), 0);
	int spilled = 0;
	for (int i = 0; i < 6; i++)
		spilled += handle_of(&f, h[i])->location == KVLOC_SPILL;
	ck_assert_int_eq(spilled, 4);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 6);
	/* A miss costs nothing: no I/O, no slot. */
	uint64_t spills = stat_u64(&f, "spills"), used = stat_u64(&f, "pool_used");
	uint64_t keys[9] = {0x1000, 0x1001, 0x1002, 0x1003, 0x1004, 0x1005, 0x9999, 0, 0x1002}, got[9];
	ck_assert_int_eq(kvstore_lookup(f.kv, keys, 9, got, f.err, sizeof(f.err)), 0);
	for (int i = 0; i < 6; i++)
		ck_assert_uint_eq(got[i], h[i]);
	ck_assert_uint_eq(got[6], 0);
	ck_assert_uint_eq(got[7], 0); /* key 0 is "no key": never found */
	ck_assert_uint_eq(got[8], h[2]);
	ck_assert_uint_eq(handle_of(&f, h[2])->refs, 2);
	ck_assert_uint_eq(stat_u64(&f, "prefix_hits"), 7);
	ck_assert_uint_eq(stat_u64(&f, "prefix_misses"), 2);
	ck_assert_uint_eq(stat_u64(&f, "spills"), spills);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), used);
	ck_assert_uint_eq(stat_u64(&f, "referenced_blocks"), 6);
	/* Every hit reads back, from the pool or the spill file. */
	for (int i = 0; i < 6; i++)
		check_block(&f, h[i], 10 + (uint64_t)i);
	ck_assert_uint_ge(stat_u64(&f, "fetches_from_disk"), 4);
	ck_assert_int_eq(kvstore_free(f.kv, h, 6, f.err, sizeof(f.err)), 0);
	free1(&f, h[2]);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 6);
	ck_assert_uint_eq(stat_u64(&f, "referenced_blocks"), 0);
	/* Before configure: refused. */
	struct fx g;
	memset(&g, 0, sizeof(g));
	g.kv = fx_store(&f, 2, 2);
	expect_err(&g, kvstore_lookup(g.kv, keys, 1, got, g.err, sizeof(g.err)), -EINVAL, "not configured");
	kvstore_destroy(&g.kv, false);
	fx_close(&f);
}
END_TEST

START_TEST(test_same_key_twice)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 4);
	uint64_t a = put_keyed(&f, 1, 0x77);
	free1(&f, a);
	/* A newer block with the key: the cached older one goes. */
	uint64_t b = put_keyed(&f, 2, 0x77);
	ck_assert_uint_eq(handle_of(&f, a)->state, KVH_FREE);
	uint64_t off;
	expect_err(&f, kvstore_fetch(f.kv, &a, 1, &off, f.err, sizeof(f.err)), -EINVAL, "stale");
	ck_assert_uint_eq(lookup1(&f, 0x77), b);
	ck_assert_uint_eq(handle_of(&f, b)->refs, 2);
	/* A referenced older one stays until its last FREE, but LOOKUP finds the newer. */
	uint64_t c = put_keyed(&f, 3, 0x77);
	ck_assert_uint_eq(lookup1(&f, 0x77), c);
	check_block(&f, b, 2);
	free1(&f, b);
	free1(&f, b);
	ck_assert_uint_eq(handle_of(&f, b)->state, KVH_FREE); /* not indexed: freed, not cached */
	free1(&f, c);
	free1(&f, c);
	ck_assert_uint_eq(handle_of(&f, c)->state, KVH_COMMITTED);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 1);
	/* Two blocks with one key in one COMMIT: the later wins. */
	uint64_t d[2], doff[2], dk[2] = {0x88, 0x88};
	ck_assert_int_eq(kvstore_alloc(f.kv, 2, d, doff, f.err, sizeof(f.err)), 0);
	kvt_write_block(H(&f), doff[0], 4);
	kvt_write_block(H(&f), doff[1], 5);
	ck_assert_int_eq(kvstore_commit(f.kv, d, dk, 2, f.err, sizeof(f.err)), 0);
	uint64_t x = lookup1(&f, 0x88);
	ck_assert_uint_eq(x, d[1]);
	check_block(&f, d[1], 5);
	check_block(&f, d[0], 4);
	free1(&f, d[0]);
	ck_assert_uint_eq(handle_of(&f, d[0])->state, KVH_FREE);
	ck_assert_uint_eq(stat_u64(&f, "live_handles"), 2);
	fx_close(&f);
}
END_TEST

START_TEST(test_idempotent_commit)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 4);
	uint64_t h[2], off[2], keys[2] = {5, 6};
	ck_assert_int_eq(kvstore_alloc(f.kv, 2, h, off, f.err, sizeof(f.err)), 0);
	kvt_write_block(H(&f), off[0], 1);
	kvt_write_block(H(&f), off[1], 2);
	ck_assert_int_eq(kvstore_commit(f.kv, h, keys, 2, f.err, sizeof(f.err)), 0);
	uint32_t crc = handle_of(&f, h[0])->checksum;
	uint64_t last = handle_of(&f, h[0])->last_use;
	/* The same commit again (its reply was lost): OK, and nothing changes. */
	ck_assert_int_eq(kvstore_commit(f.kv, h, keys, 2, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "commits"), 2);
	ck_assert_uint_eq(handle_of(&f, h[0])->checksum, crc);
	ck_assert_uint_eq(handle_of(&f, h[0])->last_use, last);
	ck_assert_uint_eq(slot_of(&f, h[0])->pins, 0);
	ck_assert_uint_eq(handle_of(&f, h[0])->refs, 1);
	/* Another key for a committed block: refused, nothing changes. */
	uint64_t other[2] = {5, 7};
	expect_err(&f, kvstore_commit(f.kv, h, other, 2, f.err, sizeof(f.err)), -EINVAL, "already committed with key");
	ck_assert_uint_eq(handle_of(&f, h[1])->key, 6);
	expect_err(&f, kvstore_commit(f.kv, h, NULL, 2, f.err, sizeof(f.err)), -EINVAL, "already committed with key");
	/* A resend beside a new block: the new one commits. */
	uint64_t w, woff;
	ck_assert_int_eq(kvstore_alloc(f.kv, 1, &w, &woff, f.err, sizeof(f.err)), 0);
	kvt_write_block(H(&f), woff, 3);
	uint64_t mix[2] = {h[0], w}, mk[2] = {5, 8};
	ck_assert_int_eq(kvstore_commit(f.kv, mix, mk, 2, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(handle_of(&f, w)->state, KVH_COMMITTED);
	ck_assert_uint_eq(handle_of(&f, w)->key, 8);
	ck_assert_uint_eq(stat_u64(&f, "commits"), 3);
	/* A resend with a wrong key fails the whole request: the new block stays being written. */
	ck_assert_int_eq(kvstore_alloc(f.kv, 1, &w, &woff, f.err, sizeof(f.err)), 0);
	kvt_write_block(H(&f), woff, 4);
	uint64_t mix2[2] = {w, h[1]}, mk2[2] = {9, 5};
	expect_err(&f, kvstore_commit(f.kv, mix2, mk2, 2, f.err, sizeof(f.err)), -EINVAL, "already committed");
	ck_assert_uint_eq(handle_of(&f, w)->state, KVH_WRITING);
	ck_assert_uint_eq(slot_of(&f, w)->pins, 1);
	/* The ready flags of a resend's committed blocks are left alone (the CUDA path). */
	ck_assert_int_eq(kvstore_mark_ready(f.kv, mix2, 2, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(atomic_load(&slot_of(&f, h[1])->ready), 0);
	/* A cached block's commit resent: no change either, it stays cached. */
	free1(&f, h[0]);
	ck_assert_int_eq(kvstore_commit(f.kv, &h[0], &keys[0], 1, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(handle_of(&f, h[0])->refs, 0);
	ck_assert_uint_eq(lookup1(&f, 5), h[0]);
	/* Without keys, a block committed without one. */
	uint64_t u = put_block(&f, 9);
	ck_assert_int_eq(kvstore_commit(f.kv, &u, NULL, 1, f.err, sizeof(f.err)), 0);
	fx_close(&f);
}
END_TEST

START_TEST(test_unpin_all)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 4);
	uint64_t a = put_block(&f, 1), b = put_block(&f, 2), off, w, woff;
	ck_assert_int_eq(kvstore_fetch(f.kv, &a, 1, &off, f.err, sizeof(f.err)), 0);
	ck_assert_int_eq(kvstore_fetch(f.kv, &a, 1, &off, f.err, sizeof(f.err)), 0);
	ck_assert_int_eq(kvstore_fetch(f.kv, &b, 1, &off, f.err, sizeof(f.err)), 0);
	ck_assert_int_eq(kvstore_alloc(f.kv, 1, &w, &woff, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(kvstore_unpin_all(f.kv), 4);
	ck_assert_uint_eq(slot_of(&f, a)->pins, 0);
	ck_assert_uint_eq(slot_of(&f, b)->pins, 0);
	ck_assert_uint_eq(slot_of(&f, w)->pins, 0);
	ck_assert_uint_eq(kvstore_unpin_all(f.kv), 0);
	expect_err(&f, kvstore_unpin(f.kv, &a, 1, f.err, sizeof(f.err)), -EINVAL, "not pinned");
	/* The block being written still commits; the references are untouched. */
	kvt_write_block(H(&f), woff, 3);
	ck_assert_int_eq(kvstore_commit(f.kv, &w, NULL, 1, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(handle_of(&f, a)->refs, 1);
	/* Unpinned, the blocks can be spilled again. */
	uint64_t n[3], noff[3];
	ck_assert_int_eq(kvstore_alloc(f.kv, 3, n, noff, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "spills"), 2);
	check_block(&f, a, 1);
	check_block(&f, b, 2);
	check_block(&f, w, 3);
	fx_close(&f);
}
END_TEST

/* ---- room: dropping cached blocks ---- */

START_TEST(test_disk_full_drops_cached)
{
	/* Spill file first, then pool; least recently used first. */
	struct fx f;
	fx_open(&f, "/tmp", 4, 1);
	uint64_t k[4];
	for (int i = 0; i < 4; i++)
		k[i] = put_keyed(&f, 10 + (uint64_t)i, 0x100 + (uint64_t)i);
	ck_assert_int_eq(kvstore_free(f.kv, k, 4, f.err, sizeof(f.err)), 0);
	uint64_t r = put_block(&f, 20); /* spills k0 into the only spill slot */
	ck_assert_uint_eq(handle_of(&f, k[0])->location, KVLOC_SPILL);
	ck_assert_uint_eq(stat_u64(&f, "cache_drops"), 0);
	/* Two slots wanted, no free spill slot: k0 (spill file) and k1 (pool) go, k2 is spilled. */
	uint64_t w[2], off[2];
	ck_assert_int_eq(kvstore_alloc(f.kv, 2, w, off, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "cache_drops"), 2);
	ck_assert(gone(&f, k[0]));
	ck_assert(gone(&f, k[1]));
	ck_assert_uint_eq(handle_of(&f, k[2])->location, KVLOC_SPILL);
	ck_assert_uint_eq(handle_of(&f, k[3])->location, KVLOC_POOL);
	ck_assert_uint_eq(handle_of(&f, r)->location, KVLOC_POOL);
	ck_assert_uint_eq(lookup1(&f, 0x100), 0);
	ck_assert_uint_eq(lookup1(&f, 0x101), 0);
	ck_assert_uint_eq(lookup1(&f, 0x102), k[2]);
	ck_assert_uint_eq(lookup1(&f, 0x103), k[3]);
	ck_assert_uint_eq(stat_u64(&f, "prefix_misses"), 2);
	/* A fetch never drops: it trades places. */
	check_block(&f, k[2], 12);
	check_block(&f, k[3], 13);
	check_block(&f, r, 20);
	ck_assert_uint_eq(stat_u64(&f, "cache_drops"), 2);
	ck_assert_uint_eq(stat_u64(&f, "checksum_failures"), 0);
	fx_close(&f);
}
END_TEST

START_TEST(test_referenced_never_dropped)
{
	struct fx f;
	fx_open(&f, "/tmp", 2, 2);
	free1(&f, put_keyed(&f, 1, 0x55));
	uint64_t r[4];
	for (int i = 0; i < 3; i++)
		r[i] = put_block(&f, 10 + (uint64_t)i); /* the spill file ends holding the cached one and r0 */
	ck_assert_uint_eq(stat_u64(&f, "spill_used"), 2);
	r[3] = put_block(&f, 13); /* drops the cached one to spill r1 */
	ck_assert_uint_eq(stat_u64(&f, "cache_drops"), 1);
	ck_assert_uint_eq(lookup1(&f, 0x55), 0);
	/* Everything left is referenced: ENOSPC, and nothing changes. */
	uint64_t x, off, spills = stat_u64(&f, "spills");
	expect_err(&f, kvstore_alloc(f.kv, 1, &x, &off, f.err, sizeof(f.err)), -ENOSPC, "--kv-disk-budget");
	ck_assert_ptr_nonnull(strstr(f.err, "0 cached blocks to drop"));
	ck_assert_uint_eq(stat_u64(&f, "cache_drops"), 1);
	ck_assert_uint_eq(stat_u64(&f, "spills"), spills);
	ck_assert_uint_eq(stat_u64(&f, "allocs"), 5);
	for (int i = 0; i < 4; i++)
		check_block(&f, r[i], 10 + (uint64_t)i);
	fx_close(&f);
}
END_TEST

START_TEST(test_drops_least_recently_used)
{
	/* Many cached blocks in the spill file, two to drop: exactly the two least recently used
	 * go, whatever order the lookups left the others in. */
	struct fx f;
	fx_open(&f, "/tmp", 2, 40);
	build_cache(&f, 42, 100, 0x800); /* keys 0x800..0x827 spilled, 0x828 and 0x829 in the pool */
	ck_assert_uint_eq(stat_u64(&f, "spill_used"), 40);
	unsigned seed = 7;
	uint64_t order[40];
	for (int i = 0; i < 40; i++)
		order[i] = (uint64_t)i;
	for (int i = 39; i > 0; i--) {
		int j = rand_r(&seed) % (i + 1);
		uint64_t x = order[i];
		order[i] = order[j];
		order[j] = x;
	}
	/* Touch every spilled key but order[0] and order[1], in shuffled order. */
	for (int i = 2; i < 40; i++)
		free1(&f, lookup1(&f, 0x800 + order[i]));
	uint64_t w[2], off[2];
	ck_assert_int_eq(kvstore_alloc(f.kv, 2, w, off, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "cache_drops"), 2);
	ck_assert_uint_eq(lookup1(&f, 0x800 + order[0]), 0);
	ck_assert_uint_eq(lookup1(&f, 0x800 + order[1]), 0);
	for (int i = 2; i < 42; i++) {
		uint64_t key = 0x800 + (i < 40 ? order[i] : (uint64_t)i);
		ck_assert_msg(lookup1(&f, key) != 0, "key %llx was dropped", (unsigned long long)key);
	}
	fx_close(&f);
}
END_TEST

START_TEST(test_drop_cached_without_spill)
{
	struct fx f;
	fx_open(&f, "/tmp", 3, 0);
	build_cache(&f, 3, 30, 0x200);
	uint64_t w[2], off[2];
	ck_assert_int_eq(kvstore_alloc(f.kv, 2, w, off, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "cache_drops"), 2);
	ck_assert_uint_eq(lookup1(&f, 0x200), 0);
	ck_assert_uint_eq(lookup1(&f, 0x201), 0);
	uint64_t k = lookup1(&f, 0x202);
	ck_assert_uint_ne(k, 0);
	kvt_write_block(H(&f), off[0], 1);
	kvt_write_block(H(&f), off[1], 2);
	ck_assert_int_eq(kvstore_commit(f.kv, w, NULL, 2, f.err, sizeof(f.err)), 0);
	/* Referenced by the lookup: kept. */
	uint64_t x, xoff;
	expect_err(&f, kvstore_alloc(f.kv, 1, &x, &xoff, f.err, sizeof(f.err)), -ENOSPC, "full");
	free1(&f, k);
	ck_assert_int_eq(kvstore_alloc(f.kv, 1, &x, &xoff, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "cache_drops"), 3);
	check_block(&f, w[0], 1);
	check_block(&f, w[1], 2);
	fx_close(&f);
}
END_TEST

/* ---- sessions ---- */

START_TEST(test_sessions)
{
	struct fx f;
	fx_open(&f, "/tmp", 8, 8);
	struct kvstore_hello r;
	kvstore_runner_hello(f.kv, 0x5e55, &r);
	ck_assert(!r.kept && !r.pending);
	ck_assert_uint_eq(H(&f)->runner_session, 0x5e55);
	uint64_t u = put_block(&f, 1);
	uint64_t k = put_keyed(&f, 2, 0x10);
	uint64_t c = put_keyed(&f, 3, 0x11);
	free1(&f, c);
	uint64_t p = put_keyed(&f, 4, 0x12), off, w;
	ck_assert_int_eq(kvstore_fetch(f.kv, &p, 1, &off, f.err, sizeof(f.err)), 0);
	ck_assert_int_eq(kvstore_alloc(f.kv, 1, &w, &off, f.err, sizeof(f.err)), 0);
	/* The same runner reconnecting: nothing changes. */
	kvstore_runner_hello(f.kv, 0x5e55, &r);
	ck_assert(r.kept);
	ck_assert_uint_eq(r.freed + r.cached + r.pins, 0);
	ck_assert_uint_eq(handle_of(&f, u)->refs, 1);
	ck_assert_uint_eq(slot_of(&f, p)->pins, 1);
	ck_assert_uint_eq(handle_of(&f, w)->state, KVH_WRITING);
	/* A new runner: every reference and pin goes; keyed committed blocks stay cached. */
	kvstore_runner_hello(f.kv, 0x6e66, &r);
	ck_assert(!r.kept);
	ck_assert_uint_eq(r.freed, 2);
	ck_assert_uint_eq(r.writing, 1);
	ck_assert_uint_eq(r.cached, 3);
	ck_assert_uint_eq(r.pins, 2);
	ck_assert_uint_eq(H(&f)->runner_session, 0x6e66);
	ck_assert_uint_eq(handle_of(&f, u)->state, KVH_FREE);
	ck_assert_uint_eq(handle_of(&f, w)->state, KVH_FREE);
	ck_assert_uint_eq(handle_of(&f, k)->refs, 0);
	ck_assert_uint_eq(handle_of(&f, p)->refs, 0);
	ck_assert_uint_eq(slot_of(&f, p)->pins, 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 3);
	ck_assert_uint_eq(stat_u64(&f, "referenced_blocks"), 0);
	ck_assert_uint_eq(lookup1(&f, 0x10), k);
	check_block(&f, k, 2);
	/* Session 0 never matches: each such HELLO is a new runner. */
	kvstore_runner_hello(f.kv, 0, &r);
	ck_assert(!r.kept);
	ck_assert_uint_eq(handle_of(&f, k)->refs, 0);
	kvstore_runner_hello(f.kv, 0, &r);
	ck_assert(!r.kept);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 3);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 3);
	/* A reconfigure (cached blocks do not hold it back) keeps the runner's session. */
	kvstore_runner_hello(f.kv, 0x7e77, &r);
	ck_assert_int_eq(kvstore_configure(f.kv, 2 * BB, HASH + 1, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 0);
	ck_assert_uint_eq(H(&f)->runner_session, 0x7e77);
	kvstore_runner_hello(f.kv, 0x7e77, &r);
	ck_assert(r.kept);
	fx_close(&f);
}
END_TEST

/* ---- adoption ---- */

struct crashed {
	uint64_t h[8];
	uint64_t epoch;
	uint32_t spilling_slot, loading_slot;
	uint64_t loading_handle;
};

/* In a child: build a pool of 6 blocks holding 8 (2 spilled), free one pooled block, and, with
 * mid_io, leave one slot SPILLING and the free one LOADING as a crash mid-I/O would. Then
 * _exit() without closing anything. */
static void crash_child(struct fx *f, bool mid_io, struct crashed *out)
{
	int pfd[2];
	ck_assert_int_eq(pipe(pfd), 0);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		close(pfd[0]);
		struct crashed c = {0};
		f->kv = fx_store(f, 6, 8);
		if (kvstore_configure(f->kv, BB, HASH, f->err, sizeof(f->err)))
			_exit(3);
		for (int i = 0; i < 8; i++)
			c.h[i] = put_block(f, 300 + (uint64_t)i);
		c.epoch = H(f)->pool_epoch;
		if (kvstore_free(f->kv, &c.h[7], 1, f->err, sizeof(f->err)))
			_exit(4);
		if (mid_io) {
			struct kvpool_slot *slots = kvpool_slots(H(f));
			c.spilling_slot = handle_of(f, c.h[3])->where;
			atomic_store(&slots[c.spilling_slot].state, KVSLOT_SPILLING);
			/* The slot block 7 left free. */
			for (uint32_t s = 0; s < 6; s++)
				if (atomic_load(&slots[s].state) == KVSLOT_FREE)
					c.loading_slot = s;
			c.loading_handle = c.h[0]; /* spilled */
			atomic_store(&slots[c.loading_slot].state, KVSLOT_LOADING);
			atomic_store(&slots[c.loading_slot].seq, 1);
			slots[c.loading_slot].handle_index = kv_handle_index(c.h[0]);
		}
		if (write(pfd[1], &c, sizeof(c)) != (ssize_t)sizeof(c))
			_exit(5);
		_exit(0);
	}
	close(pfd[1]);
	ck_assert_int_eq(read(pfd[0], out, sizeof(*out)), (ssize_t)sizeof(*out));
	close(pfd[0]);
	int status;
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static void fx_names(struct fx *f)
{
	memset(f, 0, sizeof(*f));
	kvt_mkdtemp("/tmp", f->dir, sizeof(f->dir));
	kvt_shm_name(f->shm, sizeof(f->shm));
	snprintf(f->spill, sizeof(f->spill), "%s/kv-spill.bin", f->dir);
}

START_TEST(test_adopt_after_crash)
{
	struct fx f;
	fx_names(&f);
	struct crashed c;
	crash_child(&f, false, &c);
	ck_assert_int_eq(access(f.spill, F_OK), 0);
	/* A new instance with other budgets adopts the pool as it was. */
	f.kv = fx_store(&f, 3, 3);
	int rc = kvstore_adopt(f.kv, f.err, sizeof(f.err));
	ck_assert_msg(rc == 1, "adopt: %d %s", rc, f.err);
	ck_assert(kvstore_adopted(f.kv));
	ck_assert_uint_eq(stat_u64(&f, "adopted"), 1);
	ck_assert_uint_eq(H(&f)->pool_epoch, c.epoch);
	ck_assert_uint_eq(H(&f)->n_slots, 6);
	ck_assert_int_eq(atomic_load(&H(&f)->shm.owner_pid), getpid());
	ck_assert_uint_eq(stat_u64(&f, "allocs"), 8); /* the counters live in the pool */
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 5);
	ck_assert_uint_eq(stat_u64(&f, "spill_used"), 2);
	expect_err(&f, kvstore_adopt(f.kv, f.err, sizeof(f.err)), -EALREADY, "already live");
	/* The configure that follows a restart keeps it. */
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(H(&f)->pool_epoch, c.epoch);
	for (int i = 0; i < 7; i++)
		check_block(&f, c.h[i], 300 + (uint64_t)i);
	uint64_t off;
	expect_err(&f, kvstore_fetch(f.kv, &c.h[7], 1, &off, f.err, sizeof(f.err)), -EINVAL, "stale");
	/* New blocks get fresh handles beside the adopted ones. */
	uint64_t n = put_block(&f, 999);
	check_block(&f, n, 999);
	check_block(&f, c.h[0], 300);
	fx_close(&f);
}
END_TEST

START_TEST(test_adopt_recovers_mid_io)
{
	struct fx f;
	fx_names(&f);
	struct crashed c;
	crash_child(&f, true, &c);
	f.kv = fx_store(&f, 6, 8);
	ck_assert_int_eq(kvstore_adopt(f.kv, f.err, sizeof(f.err)), 1);
	struct kvpool_slot *slots = kvpool_slots(H(&f));
	/* SPILLING -> COMMITTED, the handle still in the pool. */
	ck_assert_uint_eq(atomic_load(&slots[c.spilling_slot].state), KVSLOT_COMMITTED);
	ck_assert_uint_eq(handle_of(&f, c.h[3])->location, KVLOC_POOL);
	ck_assert_uint_eq(handle_of(&f, c.h[3])->where, c.spilling_slot);
	/* LOADING -> FREE, the handle still in the spill file. */
	ck_assert_uint_eq(atomic_load(&slots[c.loading_slot].state), KVSLOT_FREE);
	ck_assert_uint_eq(atomic_load(&slots[c.loading_slot].seq) % 2, 0);
	ck_assert_uint_eq(slots[c.loading_slot].handle_index, KV_NONE);
	ck_assert_uint_eq(handle_of(&f, c.loading_handle)->location, KVLOC_SPILL);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 5);
	for (int i = 0; i < 7; i++)
		check_block(&f, c.h[i], 300 + (uint64_t)i);
	fx_close(&f);
}
END_TEST

/* Maps the pool a crashed child left (to forge what a kill -9 at another point leaves). */
static struct kvpool_header *map_leftover(struct fx *f, size_t *size)
{
	int fd = shm_open(f->shm, O_RDWR, 0);
	ck_assert_int_ge(fd, 0);
	struct stat st;
	ck_assert_int_eq(fstat(fd, &st), 0);
	void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	ck_assert_ptr_ne(p, MAP_FAILED);
	close(fd);
	*size = (size_t)st.st_size;
	return p;
}

START_TEST(test_adopt_recovers_torn_handle_moves)
{
	struct fx f;
	fx_names(&f);
	struct crashed c;
	crash_child(&f, false, &c);
	size_t size;
	struct kvpool_header *h = map_leftover(&f, &size);
	struct kvpool_handle *hd = kvpool_handles(h);
	struct kvpool_slot *slots = kvpool_slots(h);
	/* A kill -9 between the stores that move a handle leaves it saying "pool" with the index
	 * of a spill slot, which may be another block's pool slot. (1) make_room: a pooled block
	 * being spilled (its slot SPILLING), its handle naming the pool slot of a block with a
	 * higher index. */
	int lo = -1, hi = -1, sp = -1;
	for (int i = 0; i < 7; i++) {
		uint32_t idx = kv_handle_index(c.h[i]);
		if (hd[idx].location == KVLOC_POOL) {
			if (lo < 0 || idx < kv_handle_index(c.h[lo]))
				lo = i;
			if (hi < 0 || idx > kv_handle_index(c.h[hi]))
				hi = i;
		} else if (sp < 0) {
			sp = i;
		}
	}
	ck_assert(lo >= 0 && hi >= 0 && lo != hi && sp >= 0);
	struct kvpool_handle *a = &hd[kv_handle_index(c.h[lo])];
	uint32_t a_slot = a->where;
	atomic_store(&slots[a_slot].state, KVSLOT_SPILLING);
	a->where = hd[kv_handle_index(c.h[hi])].where;
	/* (2) load_batch: a spilled block read back and checked into the free slot (LOADING,
	 * seq odd), its handle already saying "pool" but still naming its spill slot, which is
	 * another block's pool slot. */
	uint32_t free_slot = UINT32_MAX;
	for (uint32_t s = 0; s < h->n_slots; s++)
		if (atomic_load(&slots[s].state) == KVSLOT_FREE)
			free_slot = s;
	ck_assert_uint_ne(free_slot, UINT32_MAX);
	struct kvpool_handle *b = &hd[kv_handle_index(c.h[sp])];
	ck_assert_uint_lt(b->where, h->n_slots);
	ck_assert_uint_ne(atomic_load(&slots[b->where].state), KVSLOT_FREE);
	atomic_store(&slots[free_slot].seq, 1);
	slots[free_slot].handle_index = kv_handle_index(c.h[sp]);
	atomic_store(&slots[free_slot].state, KVSLOT_LOADING);
	kvt_fill((char *)h + h->data_off + (uint64_t)free_slot * h->block_bytes, h->block_bytes, 300 + (uint64_t)sp);
	b->location = KVLOC_POOL;
	munmap(h, size);

	f.kv = fx_store(&f, 6, 8);
	ck_assert_int_eq(kvstore_adopt(f.kv, f.err, sizeof(f.err)), 1);
	/* The torn ones stay in the slots that name them, and no block is lost for another's
	 * torn move. */
	ck_assert_uint_eq(handle_of(&f, c.h[lo])->where, a_slot);
	ck_assert_uint_eq(atomic_load(&kvpool_slots(H(&f))[a_slot].state), KVSLOT_COMMITTED);
	ck_assert_uint_eq(handle_of(&f, c.h[sp])->where, free_slot);
	ck_assert_uint_eq(atomic_load(&kvpool_slots(H(&f))[free_slot].seq) % 2, 0);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 6);
	for (int i = 0; i < 7; i++)
		check_block(&f, c.h[i], 300 + (uint64_t)i);
	fx_close(&f);
}
END_TEST

/* In a child: a pool of 4 blocks whose runner said HELLO with session, holding a referenced
 * keyed block kk, a referenced unkeyed block u and a cached block c (key 0x22); then _exit(). */
struct sess_crash {
	uint64_t kk, u, c;
};

static void session_child(struct fx *f, uint64_t session, struct sess_crash *out)
{
	int pfd[2];
	ck_assert_int_eq(pipe(pfd), 0);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		close(pfd[0]);
		struct sess_crash c;
		struct kvstore_hello r;
		f->kv = fx_store(f, 4, 8);
		if (kvstore_configure(f->kv, BB, HASH, f->err, sizeof(f->err)))
			_exit(3);
		kvstore_runner_hello(f->kv, session, &r);
		c.kk = put_keyed(f, 1, 0x21);
		c.u = put_block(f, 2);
		c.c = put_keyed(f, 3, 0x22);
		if (kvstore_free(f->kv, &c.c, 1, f->err, sizeof(f->err)))
			_exit(4);
		if (write(pfd[1], &c, sizeof(c)) != (ssize_t)sizeof(c))
			_exit(5);
		_exit(0);
	}
	close(pfd[1]);
	ck_assert_int_eq(read(pfd[0], out, sizeof(*out)), (ssize_t)sizeof(*out));
	close(pfd[0]);
	int status;
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

START_TEST(test_session_across_adoption)
{
	struct fx f;
	struct sess_crash c;
	struct kvstore_hello r;
	fx_names(&f);
	session_child(&f, 0xaaa, &c);
	f.kv = fx_store(&f, 4, 8);
	ck_assert_int_eq(kvstore_adopt(f.kv, f.err, sizeof(f.err)), 1);
	/* References, the session and the prefix index survive the restart. */
	ck_assert_uint_eq(H(&f)->runner_session, 0xaaa);
	ck_assert_uint_eq(handle_of(&f, c.kk)->refs, 1);
	ck_assert_uint_eq(handle_of(&f, c.u)->refs, 1);
	ck_assert_uint_eq(handle_of(&f, c.c)->refs, 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 1);
	ck_assert_uint_eq(lookup1(&f, 0x22), c.c);
	ck_assert_uint_eq(lookup1(&f, 0x21), c.kk);
	free1(&f, c.c);
	free1(&f, c.kk);
	kvstore_runner_hello(f.kv, 0xaaa, &r);
	ck_assert(r.kept);
	check_block(&f, c.kk, 1);
	check_block(&f, c.u, 2);
	kvstore_runner_hello(f.kv, 0xbbb, &r);
	ck_assert(!r.kept);
	ck_assert_uint_eq(r.freed, 1);
	ck_assert_uint_eq(r.cached, 2);
	ck_assert(gone(&f, c.u));
	fx_close(&f);

	/* A HELLO before there is a pool is compared when CONFIGURE adopts one: the same session
	 * keeps the blocks ... */
	fx_names(&f);
	session_child(&f, 0xccc, &c);
	f.kv = fx_store(&f, 4, 8);
	kvstore_runner_hello(f.kv, 0xccc, &r);
	ck_assert(r.pending);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert(kvstore_adopted(f.kv));
	check_block(&f, c.u, 2);
	fx_close(&f);
	/* ... another lets them go. */
	fx_names(&f);
	session_child(&f, 0xccc, &c);
	f.kv = fx_store(&f, 4, 8);
	kvstore_runner_hello(f.kv, 0xddd, &r);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert(kvstore_adopted(f.kv));
	ck_assert_uint_eq(H(&f)->runner_session, 0xddd);
	ck_assert(gone(&f, c.u));
	ck_assert_uint_eq(handle_of(&f, c.kk)->refs, 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 2);
	fx_close(&f);
}
END_TEST

START_TEST(test_adopt_rebuilds_index_and_refs)
{
	/* An adopted table whose entries contradict the reference rules is repaired. */
	struct fx f;
	fx_names(&f);
	struct sess_crash c;
	session_child(&f, 0x1, &c);
	size_t size;
	struct kvpool_header *h = map_leftover(&f, &size);
	struct kvpool_handle *hd = kvpool_handles(h);
	/* u loses its reference (unkeyed: it goes), kk takes c's key while c stays cached (the
	 * more recently used one keeps the key, the other goes as it is unreferenced). */
	hd[kv_handle_index(c.u)].refs = 0;
	hd[kv_handle_index(c.kk)].key = 0x22;
	hd[kv_handle_index(c.kk)].last_use = hd[kv_handle_index(c.c)].last_use + 10;
	munmap(h, size);
	f.kv = fx_store(&f, 4, 8);
	ck_assert_int_eq(kvstore_adopt(f.kv, f.err, sizeof(f.err)), 1);
	ck_assert(gone(&f, c.u));
	ck_assert(gone(&f, c.c));
	ck_assert_uint_eq(lookup1(&f, 0x22), c.kk);
	ck_assert_uint_eq(lookup1(&f, 0x21), 0);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 1);
	check_block(&f, c.kk, 1);
	fx_close(&f);
}
END_TEST

START_TEST(test_adopt_at_configure)
{
	struct fx f;
	fx_names(&f);
	struct crashed c;
	crash_child(&f, false, &c);
	/* No kvstore_adopt: the configure with the same geometry and model adopts. */
	f.kv = fx_store(&f, 6, 8);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert(kvstore_adopted(f.kv));
	ck_assert_uint_eq(H(&f)->pool_epoch, c.epoch);
	for (int i = 0; i < 7; i++)
		check_block(&f, c.h[i], 300 + (uint64_t)i);
	fx_close(&f);
}
END_TEST

START_TEST(test_configure_replaces_other_model)
{
	struct fx f;
	fx_names(&f);
	struct crashed c;
	crash_child(&f, false, &c);
	/* Another model: the leftover is replaced, its handles are gone, the spill file emptied. */
	f.kv = fx_store(&f, 6, 8);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH + 1, f.err, sizeof(f.err)), 0);
	ck_assert(!kvstore_adopted(f.kv));
	ck_assert_uint_ne(H(&f)->pool_epoch, c.epoch);
	ck_assert_uint_eq(stat_u64(&f, "allocs"), 0);
	struct stat st;
	ck_assert_int_eq(stat(f.spill, &st), 0);
	ck_assert_int_eq(st.st_size, 0);
	uint64_t off;
	ck_assert_int_eq(kvstore_fetch(f.kv, &c.h[0], 1, &off, f.err, sizeof(f.err)), -EINVAL);
	fx_close(&f);
}
END_TEST

START_TEST(test_adopt_refuses_live_owner)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 4);
	uint64_t h = put_block(&f, 1);
	struct fx g = f;
	g.kv = fx_store(&g, 4, 4);
	expect_err(&g, kvstore_adopt(g.kv, g.err, sizeof(g.err)), -EBUSY, "live process");
	expect_err(&g, kvstore_configure(g.kv, BB, HASH, g.err, sizeof(g.err)), -EBUSY, f.shm);
	kvstore_destroy(&g.kv, false);
	check_block(&f, h, 1);
	fx_close(&f);
}
END_TEST

START_TEST(test_clean_stop_without_pool_removes_leftover)
{
	struct fx f;
	fx_names(&f);
	struct crashed c;
	crash_child(&f, false, &c);
	f.kv = fx_store(&f, 6, 8);
	fx_close(&f); /* destroy with remove: the dead predecessor's pool and spill file go */
}
END_TEST

/* ---- persistence ---- */

static void fx_open_persist(struct fx *f, uint64_t dram_blocks, uint64_t disk_blocks)
{
	fx_names(f);
	snprintf(f->idx, sizeof(f->idx), "%s/kv-spill.idx", f->dir);
	f->kv = fx_store(f, dram_blocks, disk_blocks);
	int rc = kvstore_configure(f->kv, BB, HASH, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "configure: %s", f->err);
	ck_assert(kvstore_persistent(f->kv));
}

/* A clean stop (the pool goes, the spill file and index stay), then a new kv-store configured
 * for hash. */
static void fx_restart(struct fx *f, uint64_t dram_blocks, uint64_t disk_blocks, uint64_t hash)
{
	kvstore_destroy(&f->kv, true);
	ck_assert_int_eq(shm_open(f->shm, O_RDONLY, 0), -1);
	ck_assert_int_eq(access(f->spill, F_OK), 0);
	ck_assert_int_eq(access(f->idx, F_OK), 0);
	f->kv = fx_store(f, dram_blocks, disk_blocks);
	int rc = kvstore_configure(f->kv, BB, hash, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "configure: %s", f->err);
	ck_assert(!kvstore_adopted(f->kv));
}

static void fx_close_persist(struct fx *f)
{
	kvstore_destroy(&f->kv, true);
	ck_assert_int_eq(shm_open(f->shm, O_RDONLY, 0), -1);
	ck_assert_int_eq(unlink(f->spill), 0);
	ck_assert_int_eq(unlink(f->idx), 0);
	rmdir(f->dir);
}

static void flip_byte(const char *path, off_t at)
{
	int fd = open(path, O_RDWR);
	ck_assert_int_ge(fd, 0);
	unsigned char c;
	ck_assert_int_eq(pread(fd, &c, 1, at), 1);
	c ^= 0x10;
	ck_assert_int_eq(pwrite(fd, &c, 1, at), 1);
	close(fd);
}

static uint64_t file_size(const char *path)
{
	struct stat st;
	ck_assert_int_eq(stat(path, &st), 0);
	return (uint64_t)st.st_size;
}

START_TEST(test_persist_round_trip)
{
	struct fx f;
	fx_open_persist(&f, 2, 8);
	uint64_t h[6];
	for (int i = 0; i < 6; i++)
		h[i] = put_keyed(&f, 40 + (uint64_t)i, 0x300 + (uint64_t)i);
	ck_assert_int_eq(kvstore_free(f.kv, h, 5, f.err, sizeof(f.err)), 0); /* h[5] stays referenced */
	put_block(&f, 99);							  /* unkeyed: not kept */
	ck_assert_uint_eq(stat_u64(&f, "persistent"), 1);
	ck_assert_uint_eq(file_size(f.idx), KVINDEX_HEADER_BYTES + 8 * KVINDEX_RECORD_BYTES);
	fx_restart(&f, 2, 8, HASH);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 6);
	ck_assert_uint_eq(stat_u64(&f, "live_handles"), 6);
	ck_assert_uint_eq(stat_u64(&f, "referenced_blocks"), 0);
	ck_assert_uint_eq(stat_u64(&f, "spill_used"), 6);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 0);
	for (int i = 0; i < 6; i++) {
		uint64_t x = lookup1(&f, 0x300 + (uint64_t)i);
		ck_assert_uint_ne(x, 0);
		check_block(&f, x, 40 + (uint64_t)i);
		free1(&f, x);
	}
	ck_assert_uint_eq(lookup1(&f, 0x999), 0);
	ck_assert_uint_eq(stat_u64(&f, "fetches_from_disk"), 6);
	ck_assert_uint_eq(stat_u64(&f, "checksum_failures"), 0);
	/* And once more: blocks now in the pool are written back at the stop. */
	fx_restart(&f, 2, 8, HASH);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 6);
	for (int i = 0; i < 6; i++) {
		uint64_t x = lookup1(&f, 0x300 + (uint64_t)i);
		check_block(&f, x, 40 + (uint64_t)i);
		free1(&f, x);
	}
	/* A kill (no clean stop, in a child) leaves the pool for adoption, with one block more;
	 * the index follows the adopted pool. */
	kvstore_destroy(&f.kv, true);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		f.kv = fx_store(&f, 2, 8);
		if (kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)))
			_exit(3);
		free1(&f, put_keyed(&f, 50, 0x310));
		_exit(0);
	}
	int status;
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	f.kv = fx_store(&f, 2, 8);
	ck_assert_int_eq(kvstore_adopt(f.kv, f.err, sizeof(f.err)), 1);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 7);
	fx_restart(&f, 2, 8, HASH);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 7);
	uint64_t x = lookup1(&f, 0x310);
	check_block(&f, x, 50);
	fx_close_persist(&f);
}
END_TEST

START_TEST(test_persist_keeps_most_recent)
{
	struct fx f;
	fx_open_persist(&f, 4, 2);
	build_cache(&f, 5, 60, 0x400); /* 0x400 in the spill file, the rest in the pool */
	ck_assert_uint_eq(stat_u64(&f, "spill_used"), 1);
	free1(&f, lookup1(&f, 0x402)); /* 0x402 the most recently used, then 0x404 */
	fx_restart(&f, 4, 2, HASH);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 2);
	uint64_t a = lookup1(&f, 0x402), b = lookup1(&f, 0x404);
	ck_assert_uint_ne(a, 0);
	ck_assert_uint_ne(b, 0);
	check_block(&f, a, 62);
	check_block(&f, b, 64);
	ck_assert_uint_eq(lookup1(&f, 0x400), 0);
	ck_assert_uint_eq(lookup1(&f, 0x401), 0);
	ck_assert_uint_eq(lookup1(&f, 0x403), 0);
	fx_close_persist(&f);
}
END_TEST

START_TEST(test_persist_flipped_byte)
{
	struct fx f;
	fx_open_persist(&f, 2, 4);
	build_cache(&f, 3, 70, 0x500);
	fx_restart(&f, 2, 4, HASH);
	uint64_t x = lookup1(&f, 0x501);
	ck_assert_uint_eq(handle_of(&f, x)->location, KVLOC_SPILL);
	flip_byte(f.spill, (off_t)(handle_of(&f, x)->where * BB + 100));
	uint64_t off;
	char want[96];
	snprintf(want, sizeof(want), "checksum mismatch on KV block 0x%llx: dropped", (unsigned long long)x);
	expect_err(&f, kvstore_fetch(f.kv, &x, 1, &off, f.err, sizeof(f.err)), -EIO, want);
	ck_assert_uint_eq(stat_u64(&f, "checksum_failures"), 1);
	ck_assert_uint_eq(stat_u64(&f, "fetches"), 0);
	ck_assert_uint_eq(lookup1(&f, 0x501), 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 2);
	for (uint64_t i = 0; i < 3; i += 2) {
		uint64_t y = lookup1(&f, 0x500 + i);
		check_block(&f, y, 70 + i);
		free1(&f, y);
	}
	/* The dropped block's record is gone too. */
	fx_restart(&f, 2, 4, HASH);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 2);
	ck_assert_uint_eq(lookup1(&f, 0x501), 0);
	fx_close_persist(&f);
}
END_TEST

/* Reads spill index record j. */
static struct kvindex_record read_record(struct fx *f, uint32_t j)
{
	struct kvindex_record r;
	int fd = open(f->idx, O_RDONLY);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(pread(fd, &r, sizeof(r), KVINDEX_HEADER_BYTES + (off_t)j * KVINDEX_RECORD_BYTES),
			 (ssize_t)sizeof(r));
	close(fd);
	return r;
}

START_TEST(test_persist_mismatch_discarded)
{
	struct fx f;
	fx_open_persist(&f, 2, 4);
	build_cache(&f, 3, 80, 0x600);
	/* Another model: discarded, the spill file truncated. */
	fx_restart(&f, 2, 4, HASH + 1);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 0);
	ck_assert_uint_eq(file_size(f.spill), 0);
	ck_assert_uint_eq(lookup1(&f, 0x600), 0);
	/* Back to the first model: nothing is left to load. */
	fx_restart(&f, 2, 4, HASH);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 0);
	/* Another disk budget (slot count). */
	build_cache(&f, 3, 80, 0x600);
	fx_restart(&f, 2, 5, HASH);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 0);
	ck_assert_uint_eq(file_size(f.spill), 0);
	/* A corrupt header. */
	build_cache(&f, 3, 80, 0x600);
	kvstore_destroy(&f.kv, true);
	flip_byte(f.idx, 17);
	f.kv = fx_store(&f, 2, 5);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 0);
	ck_assert_uint_eq(file_size(f.spill), 0);
	/* A corrupt record: only its block is lost. */
	build_cache(&f, 3, 80, 0x600);
	kvstore_destroy(&f.kv, true);
	uint32_t j = 0;
	while (read_record(&f, j).in_use != 1)
		j++;
	uint64_t lost = read_record(&f, j).key;
	flip_byte(f.idx, (off_t)(KVINDEX_HEADER_BYTES + j * KVINDEX_RECORD_BYTES + 9));
	f.kv = fx_store(&f, 2, 5);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 2);
	ck_assert_uint_eq(lookup1(&f, lost), 0);
	for (uint64_t i = 0; i < 3; i++) {
		if (0x600 + i == lost)
			continue;
		uint64_t y = lookup1(&f, 0x600 + i);
		check_block(&f, y, 80 + i);
	}
	/* Another kv-store (another pool) given the same files: refused while this one has them. */
	struct fx g = f;
	kvt_shm_name(g.shm, sizeof(g.shm));
	g.kv = fx_store(&g, 2, 5);
	expect_err(&g, kvstore_configure(g.kv, BB, HASH, g.err, sizeof(g.err)), -EBUSY, "in use by another kv-store");
	ck_assert_ptr_null(kvstore_header(g.kv));
	kvstore_destroy(&g.kv, true);
	ck_assert_uint_eq(stat_u64(&f, "referenced_blocks"), 2);
	/* Not an index at all. */
	kvstore_destroy(&f.kv, true);
	int fd = open(f.idx, O_WRONLY | O_TRUNC);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(write(fd, "hello, this is not an index file, not at all; it is just some text.", 67), 67);
	close(fd);
	f.kv = fx_store(&f, 2, 5);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 0);
	ck_assert_uint_eq(file_size(f.idx), KVINDEX_HEADER_BYTES + 5 * KVINDEX_RECORD_BYTES);
	fx_close_persist(&f);
}
END_TEST

START_TEST(test_persist_records_follow_spills)
{
	/* Records are written as blocks spill and cleared as their slots free, so a pool that
	 * dies with the machine (no adoption, no clean stop) still leaves a usable index. */
	struct fx f;
	fx_open_persist(&f, 2, 8);
	uint64_t k = put_keyed(&f, 1, 0x700);
	uint64_t u = put_block(&f, 2);
	put_block(&f, 3); /* spills k */
	put_block(&f, 4); /* spills u: unkeyed, no record */
	ck_assert_uint_eq(handle_of(&f, k)->location, KVLOC_SPILL);
	ck_assert_uint_eq(handle_of(&f, u)->location, KVLOC_SPILL);
	struct kvindex_record r = read_record(&f, handle_of(&f, k)->where);
	ck_assert_uint_eq(r.in_use, 1);
	ck_assert_uint_eq(r.key, 0x700);
	ck_assert_uint_eq(r.checksum, handle_of(&f, k)->checksum);
	ck_assert_uint_eq(read_record(&f, handle_of(&f, u)->where).in_use, 0);
	/* Read back into the pool: the record is cleared. */
	uint32_t j = handle_of(&f, k)->where;
	check_block(&f, k, 1);
	ck_assert_uint_eq(handle_of(&f, k)->location, KVLOC_POOL);
	ck_assert_uint_eq(read_record(&f, j).in_use, 0);
	/* Spilled again and then the machine "reboots": the pool is gone, the files stay. */
	free1(&f, k);
	put_block(&f, 5);
	put_block(&f, 6);
	ck_assert_uint_eq(handle_of(&f, k)->location, KVLOC_SPILL);
	/* A referenced spilled block whose key a newer block takes loses its record. */
	uint64_t old = put_keyed(&f, 7, 0x701);
	put_block(&f, 8);
	put_block(&f, 9);
	ck_assert_uint_eq(handle_of(&f, old)->location, KVLOC_SPILL);
	ck_assert_uint_eq(read_record(&f, handle_of(&f, old)->where).in_use, 1);
	put_keyed(&f, 10, 0x701);
	ck_assert_uint_eq(read_record(&f, handle_of(&f, old)->where).in_use, 0);
	check_block(&f, old, 7);
	kvstore_destroy(&f.kv, false);
	ck_assert_int_eq(shm_unlink(f.shm), 0);
	f.kv = fx_store(&f, 2, 8);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 1); /* 0x701's newer block never reached the disk */
	uint64_t x = lookup1(&f, 0x700);
	check_block(&f, x, 1);
	fx_close_persist(&f);
}
END_TEST

/* ---- the prefix index ---- */

START_TEST(test_keymap)
{
	/* Against a plain array, through inserts, replacements and deletions that wrap around. */
	enum { N = 300 };
	struct keymap *m = keymap_create(N);
	ck_assert_ptr_nonnull(m);
	uint64_t keys[N];
	uint32_t vals[N];
	bool in[N];
	for (int i = 0; i < N; i++) {
		keys[i] = (uint64_t)i * 7 + 1;
		in[i] = false;
	}
	unsigned seed = 42;
	for (int step = 0; step < 20000; step++) {
		int i = rand_r(&seed) % N;
		int op = rand_r(&seed) % 3;
		if (op < 2) {
			vals[i] = (uint32_t)rand_r(&seed) % 1000;
			keymap_put(m, keys[i], vals[i]);
			in[i] = true;
		} else {
			keymap_del(m, keys[i]);
			in[i] = false;
		}
		if (step % 97 == 0) {
			uint32_t count = 0;
			for (int k = 0; k < N; k++) {
				ck_assert_uint_eq(keymap_get(m, keys[k]), in[k] ? vals[k] : KV_NONE);
				count += in[k];
			}
			ck_assert_uint_eq(keymap_count(m), count);
		}
	}
	ck_assert_uint_eq(keymap_get(m, 0), KV_NONE);
	keymap_del(m, 0);
	keymap_clear(m);
	ck_assert_uint_eq(keymap_count(m), 0);
	ck_assert_uint_eq(keymap_get(m, keys[3]), KV_NONE);
	keymap_destroy(&m);
	keymap_destroy(&m);
}
END_TEST

/* ---- filesystems ---- */

static bool fs_takes_o_direct(const char *dir)
{
	char p[512];
	snprintf(p, sizeof(p), "%s/probe", dir);
	int fd = open(p, O_RDWR | O_CREAT | O_DIRECT, 0600);
	if (fd < 0) {
		ck_assert_int_eq(errno, EINVAL);
		return false;
	}
	close(fd);
	unlink(p);
	return true;
}

static void spill_through(const char *parent)
{
	struct fx f;
	fx_open(&f, parent, 2, 6);
	bool direct = fs_takes_o_direct(f.dir);
	ck_assert_int_eq(kvstore_o_direct(f.kv), direct);
	ck_assert_uint_eq(stat_u64(&f, "o_direct"), direct);
	uint64_t h[6];
	for (int i = 0; i < 6; i++)
		h[i] = put_block(&f, 70 + (uint64_t)i);
	ck_assert_uint_eq(stat_u64(&f, "spills"), 4);
	for (int i = 0; i < 6; i++)
		check_block(&f, h[i], 70 + (uint64_t)i);
	ck_assert_uint_ge(stat_u64(&f, "fetches_from_disk"), 4);
	fx_close(&f);
}

START_TEST(test_spill_on_tmpfs)
{
	spill_through("/dev/shm");
}
END_TEST

START_TEST(test_spill_on_tmp)
{
	spill_through("/tmp");
}
END_TEST

static Suite *pool_suite(void)
{
	Suite *s = suite_create("kvstore_pool");
	TCase *tc;
	tc = tcase_create("round_trip");
	tcase_add_unchecked_fixture(tc, NULL, kvt_sweep_all);
	tcase_add_test(tc, test_round_trip);
	suite_add_tcase(s, tc);

	tc = tcase_create("validation");
	tcase_add_unchecked_fixture(tc, NULL, kvt_sweep_all);
	tcase_add_test(tc, test_configure_checks);
	tcase_add_test(tc, test_commit_before_ready);
	tcase_add_test(tc, test_stale_and_invalid_handles);
	tcase_add_test(tc, test_all_or_nothing);
	suite_add_tcase(s, tc);

	tc = tcase_create("references");
	tcase_add_unchecked_fixture(tc, NULL, kvt_sweep_all);
	tcase_add_test(tc, test_refs_and_free);
	tcase_add_test(tc, test_lookup_across_tiers);
	tcase_add_test(tc, test_same_key_twice);
	tcase_add_test(tc, test_idempotent_commit);
	tcase_add_test(tc, test_unpin_all);
	tcase_add_test(tc, test_keymap);
	suite_add_tcase(s, tc);

	tc = tcase_create("cache_room");
	tcase_add_unchecked_fixture(tc, NULL, kvt_sweep_all);
	tcase_add_test(tc, test_disk_full_drops_cached);
	tcase_add_test(tc, test_referenced_never_dropped);
	tcase_add_test(tc, test_drop_cached_without_spill);
	tcase_add_test(tc, test_drops_least_recently_used);
	suite_add_tcase(s, tc);

	tc = tcase_create("sessions");
	tcase_add_unchecked_fixture(tc, NULL, kvt_sweep_all);
	tcase_add_test(tc, test_sessions);
	tcase_add_test(tc, test_session_across_adoption);
	tcase_add_test(tc, test_adopt_rebuilds_index_and_refs);
	suite_add_tcase(s, tc);

	tc = tcase_create("persistence");
	tcase_add_unchecked_fixture(tc, NULL, kvt_sweep_all);
	tcase_add_test(tc, test_persist_round_trip);
	tcase_add_test(tc, test_persist_keeps_most_recent);
	tcase_add_test(tc, test_persist_flipped_byte);
	tcase_add_test(tc, test_persist_mismatch_discarded);
	tcase_add_test(tc, test_persist_records_follow_spills);
	suite_add_tcase(s, tc);

	tc = tcase_create("spill");
	tcase_add_unchecked_fixture(tc, NULL, kvt_sweep_all);
	tcase_add_test(tc, test_lru_spill_order);
	tcase_add_test(tc, test_pinned_never_evicted);
	tcase_add_test(tc, test_all_pinned);
	tcase_add_test(tc, test_disk_full);
	tcase_add_test(tc, test_fetch_when_everything_is_full);
	tcase_add_test(tc, test_tuned_budgets);
	tcase_add_test(tc, test_tuned_budget_before_configure);
	suite_add_tcase(s, tc);

	tc = tcase_create("checksum");
	tcase_add_unchecked_fixture(tc, NULL, kvt_sweep_all);
	tcase_add_test(tc, test_checksum_mismatch);
	tcase_add_test(tc, test_spill_file_short);
	suite_add_tcase(s, tc);

	tc = tcase_create("adoption");
	tcase_add_unchecked_fixture(tc, NULL, kvt_sweep_all);
	tcase_add_test(tc, test_adopt_after_crash);
	tcase_add_test(tc, test_adopt_recovers_mid_io);
	tcase_add_test(tc, test_adopt_recovers_torn_handle_moves);
	tcase_add_test(tc, test_adopt_at_configure);
	tcase_add_test(tc, test_configure_replaces_other_model);
	tcase_add_test(tc, test_adopt_refuses_live_owner);
	tcase_add_test(tc, test_clean_stop_without_pool_removes_leftover);
	suite_add_tcase(s, tc);

	tc = tcase_create("filesystems");
	tcase_add_unchecked_fixture(tc, NULL, kvt_sweep_all);
	tcase_add_test(tc, test_spill_on_tmpfs);
	tcase_add_test(tc, test_spill_on_tmp);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	kvt_runner_pid = (int)getpid();
	SRunner *sr = srunner_create(pool_suite());
	srunner_set_fork_status(sr, CK_FORK);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? 1 : 0;
}

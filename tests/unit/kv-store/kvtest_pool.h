/* kvtest_pool.h - the fixture the pool tests (test_kvstore_pool_*.c) share: a kv-store over a
 * real shared-memory object and a real spill file in a scratch directory, and the few steps
 * every test takes (put a block, check it, look a key up, read a counter). The programs that
 * include it link kvstore_core. */
#ifndef PIPELINE_TESTS_KVTEST_POOL_H
#define PIPELINE_TESTS_KVTEST_POOL_H
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

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

static inline struct kvstore *fx_store(struct fx *f, uint64_t dram_blocks, uint64_t disk_blocks)
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

/* A scratch dir under parent, a unique pool name and a spill file's path; no store yet. */
static inline void fx_names(struct fx *f, const char *parent)
{
	memset(f, 0, sizeof(*f));
	kvt_mkdtemp(parent, f->dir, sizeof(f->dir));
	kvt_shm_name(f->shm, sizeof(f->shm));
	snprintf(f->spill, sizeof(f->spill), "%s/kv-spill.bin", f->dir);
}

/* fx_names, and a configured store. */
static inline void fx_open(struct fx *f, const char *parent, uint64_t dram_blocks, uint64_t disk_blocks)
{
	fx_names(f, parent);
	f->kv = fx_store(f, dram_blocks, disk_blocks);
	int rc = kvstore_configure(f->kv, BB, HASH, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "configure: %s", f->err);
}

static inline void fx_close(struct fx *f)
{
	kvstore_destroy(&f->kv, true);
	kvstore_destroy(&f->kv, true); /* twice is safe */
	ck_assert_int_eq(access(f->spill, F_OK), -1);
	ck_assert_int_eq(shm_open(f->shm, O_RDONLY, 0), -1);
	ck_assert_int_eq(errno, ENOENT);
	rmdir(f->dir);
}

static inline struct kvpool_header *H(struct fx *f)
{
	return kvstore_header(f->kv);
}

static inline struct kvpool_handle *handle_of(struct fx *f, uint64_t hv)
{
	return &kvpool_handles(H(f))[kv_handle_index(hv)];
}

static inline struct kvpool_slot *slot_of(struct fx *f, uint64_t hv)
{
	struct kvpool_handle *hd = handle_of(f, hv);
	ck_assert_uint_eq(hd->location, KVLOC_POOL);
	return &kvpool_slots(H(f))[hd->where];
}

/* ALLOC one block, write seed into it, COMMIT it with key (0: none). */
static inline uint64_t put_keyed(struct fx *f, uint64_t seed, uint64_t key)
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
static inline uint64_t put_block(struct fx *f, uint64_t seed)
{
	return put_keyed(f, seed, 0);
}

/* FETCH one block, compare it with seed, UNPIN it. */
static inline void check_block(struct fx *f, uint64_t h, uint64_t seed)
{
	uint64_t off;
	int rc = kvstore_fetch(f->kv, &h, 1, &off, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "fetch 0x%llx: %s", (unsigned long long)h, f->err);
	ck_assert_msg(kvt_check((char *)H(f) + off, BB, seed), "block 0x%llx read back different",
		      (unsigned long long)h);
	ck_assert_int_eq(kvstore_unpin(f->kv, &h, 1, f->err, sizeof(f->err)), 0);
}

static inline uint64_t stat_u64(struct fx *f, const char *key)
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

static inline void expect_err(struct fx *f, int rc, int want, const char *needle)
{
	ck_assert_msg(rc == want, "rc %d, wanted %d (%s)", rc, want, f->err);
	ck_assert_msg(strstr(f->err, needle) != NULL, "error '%s' lacks '%s'", f->err, needle);
}

/* Was h freed? (Its index may already serve another block, under a new generation.) */
static inline bool gone(struct fx *f, uint64_t h)
{
	const struct kvpool_handle *hd = handle_of(f, h);
	return hd->state == KVH_FREE || hd->generation != kv_handle_generation(h);
}

/* LOOKUP one key: its handle (with a new reference) or 0. */
static inline uint64_t lookup1(struct fx *f, uint64_t key)
{
	uint64_t h = 12345;
	int rc = kvstore_lookup(f->kv, &key, 1, &h, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "lookup: %s", f->err);
	return h;
}

static inline void free1(struct fx *f, uint64_t h)
{
	int rc = kvstore_free(f->kv, &h, 1, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "free 0x%llx: %s", (unsigned long long)h, f->err);
}

/* n keyed blocks (seeds seed0.., keys key0..), each FREEd: cached. */
static inline void build_cache(struct fx *f, uint32_t n, uint64_t seed0, uint64_t key0)
{
	for (uint32_t i = 0; i < n; i++)
		free1(f, put_keyed(f, seed0 + i, key0 + i));
}

#endif

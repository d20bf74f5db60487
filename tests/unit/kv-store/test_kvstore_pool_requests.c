/* Tests of the kv-store pool's requests (services/kv-store/pool_requests.c, pool_fetch.c) through
 * pool.h: a round trip, the checks every request makes, references and the prefix cache, and the
 * prefix index (keymap.c) against a plain array. */
#include <check.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "services/kv-store/keymap.h"
#include "tests/unit/kv-store/kvtest_pool.h"

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
	fx_names(&f, "/tmp");
	f.kv = fx_store(&f, 4, 4);
	uint64_t h, off;
	expect_err(&f, kvstore_alloc(f.kv, 1, &h, &off, f.err, sizeof(f.err)), -EINVAL, "not configured");
	expect_err(&f, kvstore_configure(f.kv, 0, HASH, f.err, sizeof(f.err)), -EINVAL, "multiple of 4096");
	expect_err(&f, kvstore_configure(f.kv, 4096 + 512, HASH, f.err, sizeof(f.err)), -EINVAL, "multiple of 4096");
	/* Larger than one pread moves (every spill would come up short): refused. */
	expect_err(&f, kvstore_configure(f.kv, 2ull << 30, HASH, f.err, sizeof(f.err)), -EINVAL, "a KV block may hold");
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

static Suite *pool_requests_suite(void)
{
	Suite *s = suite_create("kvstore_pool_requests");
	TCase *tc = kvt_tcase(s, "round_trip");
	tcase_add_test(tc, test_round_trip);

	tc = kvt_tcase(s, "validation");
	tcase_add_test(tc, test_configure_checks);
	tcase_add_test(tc, test_commit_before_ready);
	tcase_add_test(tc, test_stale_and_invalid_handles);
	tcase_add_test(tc, test_all_or_nothing);

	tc = kvt_tcase(s, "references");
	tcase_add_test(tc, test_refs_and_free);
	tcase_add_test(tc, test_lookup_across_tiers);
	tcase_add_test(tc, test_same_key_twice);
	tcase_add_test(tc, test_idempotent_commit);
	tcase_add_test(tc, test_unpin_all);
	tcase_add_test(tc, test_keymap);
	return s;
}

int main(void)
{
	return kvt_main(pool_requests_suite());
}

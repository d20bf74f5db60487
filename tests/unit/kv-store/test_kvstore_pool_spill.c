/* Tests of where the kv-store pool's blocks go when it is full (services/kv-store/pool_evict.c,
 * pool_fetch.c, pool_tune.c) through pool.h: LRU spill to a real spill file, pins, a full disk,
 * budgets tuned at run time, checksums on read-back, cached blocks dropped to make room, a spill
 * write that fails, and the spill file on tmpfs and on /tmp. liburing's io_uring_submit_and_wait
 * is wrapped (this executable's definition comes before the shared library's) so that one
 * submitted write can fail, as a disk's may. */
#include <check.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/unit/kv-store/kvtest_pool.h"

/* At the fake_fail_in-th submit from when it is set, 64 bytes at fake_damage_off of the file
 * fake_damage_fd are overwritten (what a write that fails part way may leave) and what that
 * submit carries fails (its entries' fd made -1: EBADF in their completions). */
static int fake_fail_in;
static int fake_damage_fd = -1;
static off_t fake_damage_off;

int io_uring_submit_and_wait(struct io_uring *ring, unsigned wait_nr)
{
	static int (*real)(struct io_uring *, unsigned);
	if (!real)
		*(void **)&real = dlsym(RTLD_NEXT, "io_uring_submit_and_wait");
	if (fake_fail_in > 0 && --fake_fail_in == 0) {
		unsigned char junk[64];
		memset(junk, 0xA5, sizeof(junk));
		ck_assert_int_eq(pwrite(fake_damage_fd, junk, sizeof(junk), fake_damage_off), (ssize_t)sizeof(junk));
		for (unsigned i = ring->sq.sqe_head; i != ring->sq.sqe_tail; i++)
			ring->sq.sqes[i & *ring->sq.kring_mask].fd = -1; /* kring_mask: in every liburing */
	}
	return real(ring, wait_nr);
}

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
	fx_names(&f, "/tmp");
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

/* Pool and spill file both full, so a fetch of a spilled block trades places with the least
 * recently used pooled block through a bounce buffer: read the block, write the victim into its
 * spill slot, copy the block in. The victim's write fails and damages the slot: the fetch fails,
 * the block's bytes (whole in the bounce buffer) go back into its slot, and the next fetch reads
 * them, checksum and all. */
START_TEST(test_swap_in_write_failure_keeps_the_block)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 4);
	uint64_t h[8];
	for (int i = 0; i < 8; i++)
		h[i] = put_block(&f, 60 + (uint64_t)i);
	ck_assert_uint_eq(handle_of(&f, h[0])->location, KVLOC_SPILL);
	fake_damage_fd = open(f.spill, O_RDWR);
	ck_assert_int_ge(fake_damage_fd, 0);
	fake_damage_off = (off_t)(handle_of(&f, h[0])->where * BB + 100);
	fake_fail_in = 2; /* the block's read goes through, the victim's write fails */
	uint64_t off;
	expect_err(&f, kvstore_fetch(f.kv, &h[0], 1, &off, f.err, sizeof(f.err)), -EIO, "write");
	ck_assert_int_eq(fake_fail_in, 0);
	close(fake_damage_fd);
	fake_damage_fd = -1;
	ck_assert_uint_eq(handle_of(&f, h[0])->location, KVLOC_SPILL);
	check_block(&f, h[0], 60);
	ck_assert_uint_eq(stat_u64(&f, "checksum_failures"), 0);
	for (int i = 1; i < 8; i++)
		check_block(&f, h[i], 60 + (uint64_t)i);
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

static Suite *pool_spill_suite(void)
{
	Suite *s = suite_create("kvstore_pool_spill");
	TCase *tc = kvt_tcase(s, "cache_room");
	tcase_add_test(tc, test_disk_full_drops_cached);
	tcase_add_test(tc, test_referenced_never_dropped);
	tcase_add_test(tc, test_drop_cached_without_spill);
	tcase_add_test(tc, test_drops_least_recently_used);

	tc = kvt_tcase(s, "spill");
	tcase_add_test(tc, test_lru_spill_order);
	tcase_add_test(tc, test_pinned_never_evicted);
	tcase_add_test(tc, test_all_pinned);
	tcase_add_test(tc, test_disk_full);
	tcase_add_test(tc, test_fetch_when_everything_is_full);
	tcase_add_test(tc, test_swap_in_write_failure_keeps_the_block);
	tcase_add_test(tc, test_tuned_budgets);
	tcase_add_test(tc, test_tuned_budget_before_configure);

	tc = kvt_tcase(s, "checksum");
	tcase_add_test(tc, test_checksum_mismatch);
	tcase_add_test(tc, test_spill_file_short);

	tc = kvt_tcase(s, "filesystems");
	tcase_add_test(tc, test_spill_on_tmpfs);
	tcase_add_test(tc, test_spill_on_tmp);
	return s;
}

int main(void)
{
	return kvt_main(pool_spill_suite());
}

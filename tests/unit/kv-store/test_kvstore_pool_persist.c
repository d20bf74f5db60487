/* Tests of the kv-store pool's persistence (services/kv-store/pool_persist.c, kvindex.c) through
 * pool.h: the spill file and its index outlive a clean stop and a new pool loads them; a damaged
 * or mismatched index is discarded; records follow the blocks as they spill. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "services/kv-store/kvindex.h"
#include "tests/unit/kv-store/kvtest_pool.h"

/* ---- persistence ---- */

static void fx_open_persist(struct fx *f, uint64_t dram_blocks, uint64_t disk_blocks)
{
	fx_names(f, "/tmp");
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

static Suite *pool_persist_suite(void)
{
	Suite *s = suite_create("kvstore_pool_persist");
	TCase *tc = kvt_tcase(s, "persistence");
	tcase_add_test(tc, test_persist_round_trip);
	tcase_add_test(tc, test_persist_keeps_most_recent);
	tcase_add_test(tc, test_persist_flipped_byte);
	tcase_add_test(tc, test_persist_mismatch_discarded);
	tcase_add_test(tc, test_persist_records_follow_spills);
	return s;
}

int main(void)
{
	return kvt_main(pool_persist_suite());
}

/* Tests of the spill file (services/kv-store/spill.c), opened through spill_open_with
 * (spill_internal.h) so that open(2) can be wrapped: the buffered fallback is only reached where
 * O_DIRECT is refused, which this machine's filesystems may not do. liburing's
 * io_uring_submit_and_wait is wrapped too (this executable's definition comes before the shared
 * library's), so that a submit can fail for a moment as the kernel may make it. */
#include <check.h>
#include <dlfcn.h>
#include <errno.h>
#include <liburing.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static int fake_direct_einval; /* open with O_DIRECT fails with EINVAL, as on old tmpfs */
static int fake_read_only;     /* the file opens read-only: every write fails */
static int fake_opens;
static int fake_submit_fails;	  /* the next submits that fail (with fake_submit_errno) */
static int fake_submit_errno = EAGAIN;
static int fake_submits_failed;

int io_uring_submit_and_wait(struct io_uring *ring, unsigned wait_nr)
{
	static int (*real)(struct io_uring *, unsigned);
	if (fake_submit_fails > 0) {
		fake_submit_fails--;
		fake_submits_failed++;
		return -fake_submit_errno;
	}
	if (!real)
		*(void **)&real = dlsym(RTLD_NEXT, "io_uring_submit_and_wait");
	return real(ring, wait_nr);
}

static int fake_open(const char *path, int flags, mode_t mode)
{
	fake_opens++;
	if (fake_direct_einval && (flags & O_DIRECT)) {
		errno = EINVAL;
		return -1;
	}
	if (fake_read_only) {
		int fd = open(path, flags, mode); /* create it */
		if (fd < 0)
			return fd;
		close(fd);
		return open(path, (flags & ~(O_RDWR | O_CREAT | O_TRUNC)) | O_RDONLY);
	}
	return open(path, flags, mode);
}

#include "services/kv-store/spill_internal.h"

#include "tests/unit/kv-store/kvtest.h"

#define BB 4096u

struct sfx {
	char dir[256];
	char path[512];
	struct spill *sp;
	char err[512];
	void *buf; /* n blocks, page aligned */
};

static void sfx_open(struct sfx *f, const char *parent, uint32_t slots, uint32_t depth, uint32_t nbuf)
{
	memset(f, 0, sizeof(*f));
	kvt_mkdtemp(parent, f->dir, sizeof(f->dir));
	snprintf(f->path, sizeof(f->path), "%s/spill.bin", f->dir);
	int rc = spill_open_with(fake_open, f->path, BB, slots, depth, SPILL_TRUNCATE, &f->sp, f->err, sizeof(f->err));
	ck_assert_msg(rc == 0, "spill_open: %s", f->err);
	ck_assert_int_eq(posix_memalign(&f->buf, 4096, (size_t)BB * nbuf), 0);
}

static void sfx_close(struct sfx *f)
{
	spill_close(&f->sp, true);
	spill_close(&f->sp, true);
	ck_assert_int_eq(access(f->path, F_OK), -1);
	free(f->buf);
	rmdir(f->dir);
}

static void *blk(struct sfx *f, uint32_t i)
{
	return (char *)f->buf + (size_t)i * BB;
}

/* Writes n blocks to slots slot0.., reads them back into the second half of the buffer. */
static void write_read(struct sfx *f, uint32_t n, uint32_t slot0)
{
	struct spill_io *io = calloc(n, sizeof(*io));
	for (uint32_t i = 0; i < n; i++) {
		kvt_fill(blk(f, i), BB, 40 + i);
		io[i] = (struct spill_io){.buf = blk(f, i), .slot = slot0 + i, .write = true};
	}
	ck_assert_msg(spill_run(f->sp, io, n, f->err, sizeof(f->err)) == 0, "write: %s", f->err);
	for (uint32_t i = 0; i < n; i++)
		io[i] = (struct spill_io){.buf = blk(f, n + i), .slot = slot0 + i};
	ck_assert_msg(spill_run(f->sp, io, n, f->err, sizeof(f->err)) == 0, "read: %s", f->err);
	for (uint32_t i = 0; i < n; i++) {
		ck_assert_int_eq(io[i].res, 0);
		ck_assert_msg(kvt_check(blk(f, n + i), BB, 40 + i), "block %u read back different", i);
	}
	free(io);
}

START_TEST(test_round_trip_deeper_than_ring)
{
	struct sfx f;
	sfx_open(&f, "/tmp", 64, 4, 80);
	write_read(&f, 40, 10); /* 40 transfers through a ring of 4 */
	struct stat st;
	ck_assert_int_eq(stat(f.path, &st), 0);
	ck_assert_uint_eq(st.st_size, 50ull * BB);
	ck_assert_int_eq(st.st_mode & 0777, 0600);
	ck_assert_uint_eq(spill_file_size(f.sp), 50ull * BB);
	sfx_close(&f);
}
END_TEST

START_TEST(test_buffered_fallback)
{
	fake_direct_einval = 1;
	struct sfx f;
	sfx_open(&f, "/dev/shm", 8, 8, 8);
	ck_assert(!spill_o_direct(f.sp));
	ck_assert_int_eq(fake_opens, 2); /* O_DIRECT refused, then buffered */
	write_read(&f, 4, 0);
	sfx_close(&f);
}
END_TEST

START_TEST(test_direct_where_possible)
{
	struct sfx f;
	sfx_open(&f, "/tmp", 8, 8, 8);
	char probe[600];
	snprintf(probe, sizeof(probe), "%s/probe", f.dir);
	int fd = open(probe, O_RDWR | O_CREAT | O_DIRECT, 0600);
	ck_assert_int_eq(spill_o_direct(f.sp), fd >= 0);
	if (fd >= 0) {
		close(fd);
		unlink(probe);
	}
	write_read(&f, 4, 3);
	sfx_close(&f);
}
END_TEST

START_TEST(test_keep_and_truncate)
{
	struct sfx f;
	sfx_open(&f, "/tmp", 8, 8, 8);
	write_read(&f, 2, 0);
	ck_assert_int_eq(spill_sync(f.sp), 0);
	spill_close(&f.sp, false);
	/* Reopened for an adopted pool: the bytes are still there. */
	ck_assert_int_eq(spill_open(f.path, BB, 8, 8, SPILL_KEEP, &f.sp, f.err, sizeof(f.err)), 0);
	struct spill_io io = {.buf = blk(&f, 4), .slot = 1};
	ck_assert_int_eq(spill_run(f.sp, &io, 1, f.err, sizeof(f.err)), 0);
	ck_assert(kvt_check(blk(&f, 4), BB, 41));
	spill_close(&f.sp, false);
	/* Reopened for a new pool: emptied. */
	ck_assert_int_eq(spill_open(f.path, BB, 8, 8, SPILL_TRUNCATE, &f.sp, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(spill_file_size(f.sp), 0);
	sfx_close(&f);
}
END_TEST

/* A file open in one kv-store is refused to another (the same path given to two instances): the
 * second would empty it under the first. Free again once the first has closed it. */
START_TEST(test_file_in_use_refused)
{
	struct sfx f;
	sfx_open(&f, "/tmp", 8, 8, 8);
	write_read(&f, 2, 0);
	struct spill *other = NULL;
	ck_assert_int_eq(spill_open(f.path, BB, 8, 8, SPILL_TRUNCATE, &other, f.err, sizeof(f.err)), -EBUSY);
	ck_assert_ptr_null(other);
	ck_assert_msg(strstr(f.err, "in use by another kv-store"), "%s", f.err);
	/* Nothing emptied: the first still reads its blocks. */
	struct spill_io io = {.buf = blk(&f, 4), .slot = 1};
	ck_assert_int_eq(spill_run(f.sp, &io, 1, f.err, sizeof(f.err)), 0);
	ck_assert(kvt_check(blk(&f, 4), BB, 41));
	spill_close(&f.sp, false);
	ck_assert_int_eq(spill_open(f.path, BB, 8, 8, SPILL_KEEP, &f.sp, f.err, sizeof(f.err)), 0);
	sfx_close(&f);
}
END_TEST

START_TEST(test_short_read_is_eio)
{
	struct sfx f;
	sfx_open(&f, "/tmp", 8, 8, 8);
	write_read(&f, 2, 0);
	struct spill_io io[2] = {{.buf = blk(&f, 4), .slot = 1}, {.buf = blk(&f, 5), .slot = 5}};
	int rc = spill_run(f.sp, io, 2, f.err, sizeof(f.err));
	ck_assert_int_eq(rc, -EIO);
	ck_assert_int_eq(io[0].res, 0);
	ck_assert_int_eq(io[1].res, -EIO);
	ck_assert_ptr_nonnull(strstr(f.err, f.path));
	ck_assert_ptr_nonnull(strstr(f.err, "offset 20480"));
	ck_assert_ptr_nonnull(strstr(f.err, "read"));
	sfx_close(&f);
}
END_TEST

/* A submit that fails for a moment (-EAGAIN, -EBUSY) is tried again: the transfers complete and
 * the spill file stays in use; one that keeps failing gives the ring up with a clear error. */
START_TEST(test_submit_failing_for_a_moment)
{
	static const int errs[] = {EAGAIN, EBUSY};
	for (int e = 0; e < 2; e++) {
		struct sfx f;
		sfx_open(&f, "/tmp", 16, 4, 32);
		fake_submit_errno = errs[e];
		fake_submits_failed = 0;
		fake_submit_fails = 3;
		write_read(&f, 10, 2); /* deeper than the ring: several submits, the first three fail */
		ck_assert_int_eq(fake_submits_failed, 3);
		fake_submit_fails = 5;
		write_read(&f, 6, 9);
		ck_assert_int_eq(fake_submits_failed, 8);
		sfx_close(&f);
	}
	struct sfx f;
	sfx_open(&f, "/tmp", 16, 4, 32);
	fake_submit_errno = EAGAIN;
	fake_submit_fails = 1000000;
	struct spill_io io = {.buf = blk(&f, 0), .slot = 0, .write = true};
	ck_assert_int_eq(spill_run(f.sp, &io, 1, f.err, sizeof(f.err)), -EAGAIN);
	ck_assert_ptr_nonnull(strstr(f.err, "io_uring submit"));
	fake_submit_fails = 0;
	sfx_close(&f);
}
END_TEST

START_TEST(test_failed_write_is_eio)
{
	fake_read_only = 1;
	struct sfx f;
	sfx_open(&f, "/tmp", 8, 8, 8);
	struct spill_io io[3] = {{.buf = blk(&f, 0), .slot = 0, .write = true},
				 {.buf = blk(&f, 1), .slot = 2, .write = true},
				 {.buf = blk(&f, 2), .slot = 7, .write = true}};
	ck_assert_int_eq(spill_run(f.sp, io, 3, f.err, sizeof(f.err)), -EIO);
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(io[i].res, -EBADF);
	ck_assert_ptr_nonnull(strstr(f.err, "write"));
	ck_assert_ptr_nonnull(strstr(f.err, f.path));
	sfx_close(&f);
}
END_TEST

START_TEST(test_open_errors)
{
	struct spill *sp = NULL;
	char err[512];
	char dir[256];
	kvt_mkdtemp("/tmp", dir, sizeof(dir));
	char path[600];
	snprintf(path, sizeof(path), "%s/no/such/dir/spill.bin", dir);
	ck_assert_int_eq(spill_open(path, BB, 4, 8, SPILL_TRUNCATE, &sp, err, sizeof(err)), -ENOENT);
	ck_assert_ptr_nonnull(strstr(err, path));
	ck_assert_ptr_null(sp);
	snprintf(path, sizeof(path), "%s/spill.bin", dir);
	ck_assert_int_eq(spill_open(path, BB, 4, 0, SPILL_TRUNCATE, &sp, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "io depth 0"));
	/* A symbolic link planted at the path (in a directory others may write): refused, and what it
	 * points to neither truncated nor made 0600. */
	char target[600];
	snprintf(target, sizeof(target), "%s/victim", dir);
	FILE *v = fopen(target, "w");
	ck_assert_ptr_nonnull(v);
	fputs("keep me", v);
	fclose(v);
	ck_assert_int_eq(chmod(target, 0644), 0);
	ck_assert_int_eq(symlink(target, path), 0);
	ck_assert_int_eq(spill_open(path, BB, 4, 8, SPILL_TRUNCATE, &sp, err, sizeof(err)), -ELOOP);
	ck_assert_ptr_null(sp);
	ck_assert_ptr_nonnull(strstr(err, path));
	struct stat st;
	ck_assert_int_eq(stat(target, &st), 0);
	ck_assert_int_eq(st.st_size, 7);
	ck_assert_uint_eq(st.st_mode & 0777, 0644);
	unlink(path);
	/* Not a regular file: refused. */
	ck_assert_int_eq(mkdir(path, 0700), 0);
	ck_assert_int_lt(spill_open(path, BB, 4, 8, SPILL_TRUNCATE, &sp, err, sizeof(err)), 0);
	ck_assert_ptr_null(sp);
	rmdir(path);
	unlink(target);
	rmdir(dir);
}
END_TEST

static Suite *spill_suite(void)
{
	Suite *s = suite_create("kvstore_spill");
	TCase *tc = kvt_tcase(s, "io");
	tcase_add_test(tc, test_round_trip_deeper_than_ring);
	tcase_add_test(tc, test_keep_and_truncate);
	tcase_add_test(tc, test_file_in_use_refused);

	tc = kvt_tcase(s, "open");
	tcase_add_test(tc, test_buffered_fallback);
	tcase_add_test(tc, test_direct_where_possible);
	tcase_add_test(tc, test_open_errors);

	tc = kvt_tcase(s, "errors");
	tcase_add_test(tc, test_short_read_is_eio);
	tcase_add_test(tc, test_failed_write_is_eio);
	tcase_add_test(tc, test_submit_failing_for_a_moment);
	return s;
}

int main(void)
{
	return kvt_main(spill_suite());
}

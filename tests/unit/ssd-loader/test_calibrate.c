/* test_calibrate.c - calibrate.c: the disk measured over a file, and a file shorter than its size
 * said when the measurement began (one that shrank, or a filesystem that returns less): the
 * measurement ends with what was read instead of waiting for reads never issued. fstat() is
 * replaced here (the real one through dlsym) to say a size larger than the file's. */
#include <check.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "services/ssd-loader/calibrate.h"
#include "tests/unit/common/test_helpers.h"

#define MIB (1u << 20)

static uint64_t fstat_extra; /* bytes fstat adds to a regular file's size */

int fstat(int fd, struct stat *st)
{
	static int (*real)(int, struct stat *);
	if (!real)
		*(void **)&real = dlsym(RTLD_NEXT, "fstat");
	int rc = real(fd, st);
	if (rc == 0 && S_ISREG(st->st_mode))
		st->st_size += (off_t)fstat_extra;
	return rc;
}

/* A file of `bytes` in a fresh temporary directory; its path in path. */
static void make_file(char *path, size_t len, size_t bytes)
{
	snprintf(path, len, "/tmp/llmp-test-calibrate-XXXXXX");
	int fd = mkstemp(path);
	ck_assert_int_ge(fd, 0);
	char *block = calloc(1, MIB);
	ck_assert_ptr_nonnull(block);
	for (size_t done = 0; done < bytes;) {
		size_t n = bytes - done < MIB ? bytes - done : MIB;
		ck_assert_int_eq(write(fd, block, n), (ssize_t)n);
		done += n;
	}
	free(block);
	close(fd);
}

START_TEST(test_measures_a_file)
{
	char path[64], err[256] = "";
	make_file(path, sizeof(path), 12 * MIB);
	void *buf = aligned_alloc(4096, 8 * MIB);
	ck_assert_ptr_nonnull(buf);
	double bps = 0;
	fstat_extra = 0;
	ck_assert_int_eq(calibrate_disk(path, buf, 8 * MIB, 64 * MIB, 4, &bps, err, sizeof(err)), 0);
	ck_assert(bps > 0);
	free(buf);
	unlink(path);
}
END_TEST

START_TEST(test_file_shorter_than_said)
{
	/* 8 MiB and 1000 bytes, said to be 4 MiB longer: the third read comes back short (1000 bytes),
	 * and nothing more is in flight. It hung waiting for the rest. */
	char path[64], err[256] = "";
	make_file(path, sizeof(path), 8 * MIB + 1000);
	void *buf = aligned_alloc(4096, 8 * MIB);
	ck_assert_ptr_nonnull(buf);
	double bps = 0;
	fstat_extra = 4 * MIB;
	ck_assert_int_eq(calibrate_disk(path, buf, 8 * MIB, 64 * MIB, 4, &bps, err, sizeof(err)), 0);
	ck_assert(bps > 0);
	fstat_extra = 0;
	free(buf);
	unlink(path);
}
END_TEST

static Suite *calibrate_suite(void)
{
	Suite *s = suite_create("loader_calibrate");
	TCase *tc = tcase_create("calibrate");
	tcase_set_timeout(tc, 10); /* a hang is a failure, not a stuck test */
	tcase_add_test(tc, test_measures_a_file);
	tcase_add_test(tc, test_file_shorter_than_said);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(calibrate_suite());
}

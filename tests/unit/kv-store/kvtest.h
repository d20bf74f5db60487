/* kvtest.h - helpers shared by the kv-store tests: scratch directories and shared-memory names
 * that carry the runner's pid, so that an unchecked teardown (which runs in the runner even
 * when a forked test dies half-way) removes whatever a test left behind. */
#ifndef PIPELINE_TESTS_KVTEST_H
#define PIPELINE_TESTS_KVTEST_H
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kv_pool.h"

static int kvt_runner_pid; /* set in main before the runner forks */
static int kvt_seq;

/* Deletes path and everything under it (no symlinks are followed). */
static inline void kvt_rm_rf(const char *path)
{
	struct stat st;
	if (lstat(path, &st) != 0)
		return;
	if (S_ISDIR(st.st_mode)) {
		DIR *d = opendir(path);
		if (d) {
			struct dirent *e;
			while ((e = readdir(d))) {
				if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
					continue;
				char sub[1024];
				if (snprintf(sub, sizeof(sub), "%s/%s", path, e->d_name) < (int)sizeof(sub))
					kvt_rm_rf(sub);
			}
			closedir(d);
		}
		rmdir(path);
	} else {
		unlink(path);
	}
}

/* Makes a fresh directory under parent ("/tmp" or "/dev/shm"). */
static inline void kvt_mkdtemp(const char *parent, char *buf, size_t len)
{
	snprintf(buf, len, "%s/kvt-%d-XXXXXX", parent, kvt_runner_pid);
	ck_assert_ptr_nonnull(mkdtemp(buf));
}

/* A shared-memory name unique to this test process. */
static inline void kvt_shm_name(char *buf, size_t len)
{
	snprintf(buf, len, "/kvt-%d-%d-%d", kvt_runner_pid, (int)getpid(), kvt_seq++);
}

/* Removes every entry of dir whose name starts with prefix. */
static inline void kvt_sweep(const char *dir, const char *prefix)
{
	DIR *d = opendir(dir);
	if (!d)
		return;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (strncmp(e->d_name, prefix, strlen(prefix)) != 0)
			continue;
		char p[1024];
		if (snprintf(p, sizeof(p), "%s/%s", dir, e->d_name) < (int)sizeof(p))
			kvt_rm_rf(p);
	}
	closedir(d);
}

/* Unchecked teardown: whatever this runner's tests left in /tmp and /dev/shm. */
static inline void kvt_sweep_all(void)
{
	char prefix[64];
	snprintf(prefix, sizeof(prefix), "kvt-%d-", kvt_runner_pid);
	kvt_sweep("/tmp", prefix);
	kvt_sweep("/dev/shm", prefix);
	snprintf(prefix, sizeof(prefix), "llmp-%u-kvt-%d-", (unsigned)getuid(), kvt_runner_pid);
	kvt_sweep("/dev/shm", prefix);
}

/* A tcase of s named name, with kvt_sweep_all as its unchecked teardown. */
static inline TCase *kvt_tcase(Suite *s, const char *name)
{
	TCase *tc = tcase_create(name);
	tcase_add_unchecked_fixture(tc, NULL, kvt_sweep_all);
	suite_add_tcase(s, tc);
	return tc;
}

/* The main() of a kv-store test: runs s, each test in a process of its own (a crash fails one
 * test, not the run). Returns main's exit status. */
static inline int kvt_main(Suite *s)
{
	kvt_runner_pid = (int)getpid();
	SRunner *sr = srunner_create(s);
	srunner_set_fork_status(sr, CK_FORK);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? 1 : 0;
}

/* Deterministic block contents: block `seed`, bytes [0, len). */
static inline void kvt_fill(void *p, size_t len, uint64_t seed)
{
	uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
	unsigned char *b = p;
	for (size_t i = 0; i < len; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		b[i] = (unsigned char)x;
	}
}

static inline int kvt_check(const void *p, size_t len, uint64_t seed)
{
	unsigned char *want = malloc(len);
	kvt_fill(want, len, seed);
	int same = memcmp(want, p, len) == 0;
	free(want);
	return same;
}

/* What the runner does after copying a block into its slot: ready = 1, release order. */
static inline void kvt_write_block(struct kvpool_header *h, uint64_t offset, uint64_t seed)
{
	kvt_fill((char *)h + offset, h->block_bytes, seed);
	uint32_t slot = (uint32_t)((offset - h->data_off) / h->block_bytes);
	atomic_store_explicit(&kvpool_slots(h)[slot].ready, 1, memory_order_release);
}

#endif

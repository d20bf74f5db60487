/* test_helpers.h - what the common/ unit tests share: a fresh temporary directory (and its
 * removal), capturing what a call prints on a file descriptor, the Check runner's main, and the
 * relative L2 distance the backends' tests hold logits to.
 *
 *   char *dir = th_tmpdir("/tmp");          // "/tmp/pipeline-test-XXXXXX", mode 0700
 *   ...
 *   th_rmtree(dir); free(dir);
 *
 *   struct th_capture cap;
 *   th_capture_begin(&cap, STDERR_FILENO);
 *   rc = config_parse(...);
 *   char *text = th_capture_end(&cap);     // malloc'd, NUL-terminated; free it
 *
 * Header-only on purpose: each test is one program and links only pipeline_common. */
#ifndef PIPELINE_TEST_HELPERS_H
#define PIPELINE_TEST_HELPERS_H
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Like ck_assert_msg, for hot loops: Check records a location on every passing ck_assert, which
 * costs a write per call in fork mode; this only calls into Check on failure. */
#define TH_CHECK(cond, ...)                     \
	do {                                    \
		if (!(cond))                    \
			ck_abort_msg(__VA_ARGS__); \
	} while (0)

/* Makes "<base>/pipeline-test-XXXXXX". Returns a malloc'd path; the test fails if it cannot. */
static inline char *th_tmpdir(const char *base)
{
	size_t len = strlen(base) + 32;
	char *dir = malloc(len);
	ck_assert_ptr_nonnull(dir);
	snprintf(dir, len, "%s/pipeline-test-XXXXXX", base);
	ck_assert_msg(mkdtemp(dir) != NULL, "mkdtemp %s: %s", dir, strerror(errno));
	return dir;
}

static inline int th_rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)flag;
	(void)ftw;
	remove(path);
	return 0;
}

/* Removes dir and everything under it (does not follow symbolic links). */
static inline void th_rmtree(const char *dir)
{
	if (dir)
		nftw(dir, th_rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

struct th_capture {
	int fd;	   /* the descriptor being captured */
	int saved; /* its original target */
	int rd;	   /* read end of the pipe */
};

/* Redirects fd into a pipe. What is written must fit the pipe (64 KiB): messages, not data. */
static inline void th_capture_begin(struct th_capture *c, int fd)
{
	int p[2];
	ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
	fflush(stdout);
	fflush(stderr);
	c->fd = fd;
	c->saved = dup(fd);
	ck_assert_int_ge(c->saved, 0);
	ck_assert_int_ge(dup2(p[1], fd), 0);
	close(p[1]);
	c->rd = p[0];
}

/* Restores the descriptor and returns what was written (malloc'd, NUL-terminated). */
static inline char *th_capture_end(struct th_capture *c)
{
	fflush(stdout);
	fflush(stderr);
	ck_assert_int_ge(dup2(c->saved, c->fd), 0);
	close(c->saved);
	size_t cap = 4096, n = 0;
	char *buf = malloc(cap);
	ck_assert_ptr_nonnull(buf);
	for (;;) {
		if (n + 1 == cap) {
			cap *= 2;
			buf = realloc(buf, cap);
			ck_assert_ptr_nonnull(buf);
		}
		ssize_t r = read(c->rd, buf + n, cap - n - 1);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		n += (size_t)r;
	}
	buf[n] = 0;
	close(c->rd);
	return buf;
}

/* The relative L2 distance of a from ref (n values); every value of a must be finite. */
static inline double rel_l2(const float *a, const float *ref, uint32_t n)
{
	double num = 0, den = 0;
	for (uint32_t i = 0; i < n; i++) {
		TH_CHECK(isfinite(a[i]), "logit %u is %g", i, (double)a[i]);
		num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
		den += (double)ref[i] * ref[i];
	}
	return sqrt(num / den);
}

/* Runs suite s in fork mode; the exit status is what ctest reads. */
static inline int th_run(Suite *s)
{
	SRunner *sr = srunner_create(s);
	srunner_set_fork_status(sr, CK_FORK);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

#endif

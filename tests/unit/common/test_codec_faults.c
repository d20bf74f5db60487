/* test_codec_faults.c - common/codec.c: every allocation of an encode and a decode failed in
 * turn. A program of its own: it replaces malloc and realloc. */
#include <check.h>
#include <errno.h>
#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/protocol.h"
#include "common/util.h"
#include "tests/unit/common/codec_test_util.h"
#include "tests/unit/common/test_helpers.h"

/* ---- allocation failures ---- */

#ifndef UNDER_ASAN
/* The test binary's malloc and realloc wrap glibc's so that the N-th call after arming fails
 * (SQLite-style fault injection). Check and libc call them too, so they are armed only around
 * the call under test. */
extern void *__libc_malloc(size_t n);
extern void *__libc_realloc(void *p, size_t n);
static long fail_countdown; /* 0: off; N: the N-th allocation from now fails */
static long fail_hits;

static bool should_fail(void)
{
	if (fail_countdown > 0 && --fail_countdown == 0) {
		fail_hits++;
		return true;
	}
	return false;
}

void *malloc(size_t n)
{
	if (should_fail()) {
		errno = ENOMEM;
		return NULL;
	}
	return __libc_malloc(n);
}

void *realloc(void *p, size_t n)
{
	if (should_fail()) {
		errno = ENOMEM;
		return NULL;
	}
	return __libc_realloc(p, n);
}
#endif

START_TEST(test_out_of_memory)
{
#ifdef UNDER_ASAN
	return; /* the sanitizer owns malloc; this test runs in the plain build */
#else
	/* A message with several heap copies; fail each allocation in turn: every failure is
	 * -ENOMEM, never a crash, and the first run without a failure round-trips. */
	struct arena a = {0};
	struct msg m;
	const struct tmsg *commit = NULL; /* MSG_KV_COMMIT: two arrays and bytes */
	for (int i = 0; i < contract_n; i++)
		if (contract[i].type == MSG_KV_COMMIT)
			commit = &contract[i];
	ck_assert_ptr_nonnull(commit);
	fill(&m, commit, 3, &a);
	ck_assert_uint_eq(m.type, MSG_KV_COMMIT);
	int encode_failures = 0, decode_failures = 0;
	void *buf = NULL;
	size_t len = 0;
	for (long nth = 1;; nth++) {
		fail_hits = 0;
		fail_countdown = nth;
		int rc = msg_encode(&m, &buf, &len);
		fail_countdown = 0;
		if (!fail_hits) {
			ck_assert_int_eq(rc, 0);
			break;
		}
		ck_assert_msg(rc == -ENOMEM, "allocation %ld failed: msg_encode = %d", nth, rc);
		encode_failures++;
	}
	ck_assert_int_gt(encode_failures, 0);
	for (long nth = 1;; nth++) {
		struct msg out;
		char err[256] = "";
		fail_hits = 0;
		fail_countdown = nth;
		int rc = msg_decode(buf, len, &out, err, sizeof(err));
		fail_countdown = 0;
		if (!fail_hits) {
			ck_assert_int_eq(rc, 0);
			expect_same(&m, &out, commit, 3);
			msg_free(&out);
			break;
		}
		ck_assert_msg(rc == -ENOMEM, "allocation %ld failed: msg_decode = %d (%s)", nth, rc, err);
		ck_assert_ptr_null(out.kv_commit.handles.v);
		ck_assert_ptr_null(out.kv_commit.keys.v);
		ck_assert_ptr_null(out.kv_commit.events.p);
		msg_free(&out);
		decode_failures++;
	}
	ck_assert_int_ge(decode_failures, 3); /* at least the three heap copies */
	free(buf);
	arena_free(&a);
#endif
}
END_TEST

int main(void)
{
	TCase *tc = tcase_create("faults");
	tcase_add_test(tc, test_out_of_memory);
	return codec_run(tc);
}

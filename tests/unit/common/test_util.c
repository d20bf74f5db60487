/* test_util.c - common/util.c: sizes, hashes, checksums, bounded strings, processes. */
#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util.h"
#include "tests/unit/common/test_helpers.h"

/* ---- parse_size / format_size ---- */

static void expect_size(const char *text, uint64_t want)
{
	uint64_t v = 0xdeadbeef;
	int rc = parse_size(text, &v);
	ck_assert_msg(rc == 0, "parse_size(\"%s\") = %d, want 0", text, rc);
	ck_assert_msg(v == want, "parse_size(\"%s\") = %llu, want %llu", text, (unsigned long long)v,
		      (unsigned long long)want);
}

static void expect_size_error(const char *text, int want)
{
	uint64_t v = 12345;
	int rc = parse_size(text, &v);
	ck_assert_msg(rc == want, "parse_size(\"%s\") = %d, want %d", text ? text : "(null)", rc, want);
	ck_assert_msg(v == 12345, "parse_size(\"%s\") wrote *out on failure", text ? text : "(null)");
}

START_TEST(test_parse_size_units)
{
	expect_size("6GiB", 6ull << 30);
	expect_size("512MiB", 512ull << 20);
	expect_size("1.5GB", 1500000000ull);
	expect_size("4096", 4096);
	expect_size("4k", 4096);
	expect_size("4K", 4096);
	expect_size("4KiB", 4096);
	expect_size("4kb", 4000);
	expect_size("2M", 2ull << 20);
	expect_size("3MB", 3000000ull);
	expect_size("1G", 1ull << 30);
	expect_size("2T", 2ull << 40);
	expect_size("2TiB", 2ull << 40);
	expect_size("1TB", 1000000000000ull);
	expect_size("7B", 7);
	expect_size("0", 0);
	expect_size("6 GiB", 6ull << 30);
	expect_size("0.5KiB", 512);
	expect_size("1.5", 2); /* fractions of a byte round to nearest */
	/* The largest value below 2^63 that the units can spell exactly. */
	expect_size("8388607TiB", 8388607ull << 40);
}
END_TEST

START_TEST(test_parse_size_bad)
{
	static const char *const bad[] = {"",	  "abc", "GiB",	 "-1",	  "-1GiB", "12XB", "1.5.5",
					  "nan", "inf", "4 KiB extra", "4GiBs", "1e", "K4"};
	for (size_t i = 0; i < ARRAY_SIZE(bad); i++)
		expect_size_error(bad[i], -EINVAL);
	expect_size_error(NULL, -EINVAL);
}
END_TEST

START_TEST(test_parse_size_overflow)
{
	/* 2^63 exactly and anything past it is out of range, in any spelling. */
	expect_size_error("8388608TiB", -ERANGE);
	expect_size_error("9000000TiB", -ERANGE);
	expect_size_error("1e30", -ERANGE);
	expect_size_error("18446744073709551616", -ERANGE);
	expect_size_error("1e400", -ERANGE);
	expect_size_error("1e400GiB", -ERANGE);
}
END_TEST

START_TEST(test_format_size)
{
	char buf[64];
	ck_assert_str_eq(format_size(0, buf, sizeof(buf)), "0 B");
	ck_assert_str_eq(format_size(1023, buf, sizeof(buf)), "1023 B");
	ck_assert_str_eq(format_size(1024, buf, sizeof(buf)), "1.00 KiB");
	ck_assert_str_eq(format_size(1536, buf, sizeof(buf)), "1.50 KiB");
	ck_assert_str_eq(format_size(512ull << 20, buf, sizeof(buf)), "512.00 MiB");
	ck_assert_str_eq(format_size(3ull << 29, buf, sizeof(buf)), "1.50 GiB");
	ck_assert_str_eq(format_size(2ull << 40, buf, sizeof(buf)), "2.00 TiB");
	ck_assert_str_eq(format_size(1ull << 50, buf, sizeof(buf)), "1024.00 TiB");
	/* A short buffer is cut, still NUL-terminated, and the same pointer comes back. */
	char small[5];
	ck_assert_ptr_eq(format_size(3ull << 29, small, sizeof(small)), small);
	ck_assert_str_eq(small, "1.50");
	/* What format_size writes, parse_size reads back. */
	uint64_t v;
	ck_assert_int_eq(parse_size(format_size(6ull << 30, buf, sizeof(buf)), &v), 0);
	ck_assert_uint_eq(v, 6ull << 30);
}
END_TEST

/* ---- crc32c ---- */

/* Bitwise reference: reflected polynomial 0x82f63b78. */
static uint32_t crc32c_ref(uint32_t crc, const unsigned char *p, size_t len)
{
	crc = ~crc;
	while (len--) {
		crc ^= *p++;
		for (int k = 0; k < 8; k++)
			crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
	}
	return ~crc;
}

START_TEST(test_crc32c_vectors)
{
	ck_assert_uint_eq(crc32c(0, "123456789", 9), 0xE3069283u);
	ck_assert_uint_eq(crc32c(0, "", 0), 0);
	ck_assert_uint_eq(crc32c(0, NULL, 0), 0);
	/* RFC 3720 B.4 */
	unsigned char buf[32];
	memset(buf, 0, sizeof(buf));
	ck_assert_uint_eq(crc32c(0, buf, 32), 0x8A9136AAu);
	memset(buf, 0xff, sizeof(buf));
	ck_assert_uint_eq(crc32c(0, buf, 32), 0x62A8AB43u);
	for (int i = 0; i < 32; i++)
		buf[i] = (unsigned char)i;
	ck_assert_uint_eq(crc32c(0, buf, 32), 0x46DD794Eu);
	for (int i = 0; i < 32; i++)
		buf[i] = (unsigned char)(31 - i);
	ck_assert_uint_eq(crc32c(0, buf, 32), 0x113FDB5Cu);
}
END_TEST

START_TEST(test_crc32c_incremental)
{
	enum { N = 1000 };
	unsigned char data[N];
	uint64_t x = 0x9e3779b97f4a7c15ull;
	for (int i = 0; i < N; i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		data[i] = (unsigned char)x;
	}
	uint32_t whole = crc32c(0, data, N);
	ck_assert_uint_eq(whole, crc32c_ref(0, data, N));
	/* Split at every point: the CRC continues across calls. */
	for (size_t cut = 0; cut <= N; cut++) {
		uint32_t c = crc32c(0, data, cut);
		c = crc32c(c, data + cut, N - cut);
		ck_assert_msg(c == whole, "split at %zu: %08x != %08x", cut, c, whole);
	}
	/* Three pieces of odd sizes. */
	uint32_t c = crc32c(0, data, 3);
	c = crc32c(c, data + 3, 509);
	c = crc32c(c, data + 512, N - 512);
	ck_assert_uint_eq(c, whole);
}
END_TEST

START_TEST(test_crc32c_unaligned)
{
	/* Every start offset modulo 8 and lengths around the 8-byte stride agree with the reference. */
	enum { N = 300 };
	_Alignas(16) unsigned char data[N + 16];
	for (int i = 0; i < N + 16; i++)
		data[i] = (unsigned char)(i * 131 + 7);
	for (size_t start = 0; start < 16; start++)
		for (size_t len = 0; len <= N; len++) {
			uint32_t got = crc32c(0x12345678u, data + start, len);
			uint32_t want = crc32c_ref(0x12345678u, data + start, len);
			ck_assert_msg(got == want, "start %zu len %zu: %08x != %08x", start, len, got, want);
		}
}
END_TEST

static void *crc_thread(void *arg)
{
	uintptr_t bad = 0;
	for (int i = 0; i < 1000; i++)
		bad += crc32c(0, "123456789", 9) != 0xE3069283u;
	(void)arg;
	return (void *)bad;
}

START_TEST(test_crc32c_portable_agrees)
{
	/* The table version (what a CPU without SSE4.2 runs) and crc32c agree on every length and
	 * alignment, and both give the standard check value. */
	ck_assert_uint_eq(crc32c_portable(0, "123456789", 9), 0xE3069283u);
	unsigned char buf[4096 + 16];
	uint64_t x = 0x9e3779b97f4a7c15ull;
	for (size_t i = 0; i < sizeof(buf); i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		buf[i] = (unsigned char)x;
	}
	for (size_t off = 0; off < 16; off++)
		for (size_t len = 0; len < 200; len += 7)
			ck_assert_uint_eq(crc32c(0, buf + off, len), crc32c_portable(0, buf + off, len));
	ck_assert_uint_eq(crc32c(5, buf, 4096), crc32c_portable(5, buf, 4096));
}
END_TEST

START_TEST(test_crc32c_first_use_threads)
{
	/* This forked test has never computed a CRC: eight threads race to the first use. */
	pthread_t t[8];
	for (int i = 0; i < 8; i++)
		ck_assert_int_eq(pthread_create(&t[i], NULL, crc_thread, NULL), 0);
	for (int i = 0; i < 8; i++) {
		void *bad;
		ck_assert_int_eq(pthread_join(t[i], &bad), 0);
		ck_assert_ptr_null(bad);
	}
}
END_TEST

/* ---- fnv1a64 ---- */

/* The text lands whole; another process's write of the same path in progress (its temporary
 * file) is not touched: each writer's temporary name is its own. */
START_TEST(test_write_file_atomic)
{
	char *dir = th_tmpdir("/tmp");
	char path[512], other[600], buf[64];
	snprintf(path, sizeof(path), "%s/x.pid", dir);
	snprintf(other, sizeof(other), "%s.tmp.%d", path, (int)getpid() + 1);
	FILE *f = fopen(other, "w");
	ck_assert_ptr_nonnull(f);
	fputs("theirs", f);
	fclose(f);
	ck_assert_int_eq(write_file_atomic(path, "1234\n", 5), 0);
	f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	ck_assert_ptr_nonnull(fgets(buf, sizeof(buf), f));
	fclose(f);
	ck_assert_str_eq(buf, "1234\n");
	f = fopen(other, "r");
	ck_assert_ptr_nonnull(f);
	ck_assert_ptr_nonnull(fgets(buf, sizeof(buf), f));
	fclose(f);
	ck_assert_str_eq(buf, "theirs");
	char mine[600];
	snprintf(mine, sizeof(mine), "%s.tmp.%d", path, (int)getpid());
	ck_assert_int_ne(access(mine, F_OK), 0); /* its own temporary file does not stay */
	th_rmtree(dir);
	free(dir);
}
END_TEST

START_TEST(test_fnv1a64)
{
	ck_assert_uint_eq(fnv1a64(FNV64_INIT, "", 0), 0xcbf29ce484222325ull);
	ck_assert_uint_eq(fnv1a64(FNV64_INIT, "a", 1), 0xaf63dc4c8601ec8cull);
	ck_assert_uint_eq(fnv1a64(FNV64_INIT, "foobar", 6), 0x85944171f73967e8ull);
	/* Continuing from h is the same as hashing the concatenation. */
	uint64_t h = fnv1a64(FNV64_INIT, "foo", 3);
	ck_assert_uint_eq(fnv1a64(h, "bar", 3), 0x85944171f73967e8ull);
}
END_TEST

/* ---- strings ---- */

START_TEST(test_str_copy)
{
	char buf[8];
	ck_assert_int_eq(str_copy(buf, sizeof(buf), "abc"), 0);
	ck_assert_str_eq(buf, "abc");
	ck_assert_int_eq(str_copy(buf, sizeof(buf), "1234567"), 0); /* exactly fits with its NUL */
	ck_assert_str_eq(buf, "1234567");
	memset(buf, 'x', sizeof(buf));
	ck_assert_int_eq(str_copy(buf, sizeof(buf), "12345678"), -ENAMETOOLONG);
	ck_assert_str_eq(buf, "1234567");
	ck_assert_int_eq(str_copy(buf, sizeof(buf), "a much longer string than the buffer"), -ENAMETOOLONG);
	ck_assert_str_eq(buf, "a much ");
	ck_assert_int_eq(str_copy(buf, 1, "x"), -ENAMETOOLONG);
	ck_assert_str_eq(buf, "");
	ck_assert_int_eq(str_copy(buf, sizeof(buf), ""), 0);
	ck_assert_str_eq(buf, "");
}
END_TEST

START_TEST(test_str_has_prefix)
{
	ck_assert(str_has_prefix("ipc://x", "ipc://"));
	ck_assert(str_has_prefix("abc", ""));
	ck_assert(str_has_prefix("abc", "abc"));
	ck_assert(!str_has_prefix("ab", "abc"));
	ck_assert(!str_has_prefix("xbc", "abc"));
}
END_TEST

/* ---- clocks, random, processes ---- */

START_TEST(test_clock_and_random)
{
	uint64_t a = now_ns();
	usleep(2000);
	uint64_t b = now_ns();
	ck_assert_uint_gt(b, a);
	ck_assert(now_s() > 0);
	/* 64 random values: no two the same (a collision has probability ~2^-53). */
	uint64_t v[64];
	for (int i = 0; i < 64; i++) {
		v[i] = random_u64();
		for (int j = 0; j < i; j++)
			ck_assert_uint_ne(v[i], v[j]);
	}
}
END_TEST

START_TEST(test_pid_alive)
{
	ck_assert(pid_alive(getpid()));
	ck_assert(pid_alive(1)); /* EPERM or not, init is alive */
	ck_assert(!pid_alive(0));
	ck_assert(!pid_alive(-1));
	pid_t child = fork();
	ck_assert_int_ge(child, 0);
	if (child == 0)
		_exit(0);
	int st;
	ck_assert_int_eq(waitpid(child, &st, 0), child);
	ck_assert(!pid_alive(child));
}
END_TEST

static Suite *util_suite(void)
{
	Suite *s = suite_create("util");
	TCase *tc = tcase_create("sizes");
	tcase_add_test(tc, test_parse_size_units);
	tcase_add_test(tc, test_parse_size_bad);
	tcase_add_test(tc, test_parse_size_overflow);
	tcase_add_test(tc, test_format_size);
	suite_add_tcase(s, tc);
	tc = tcase_create("crc32c");
	tcase_add_test(tc, test_crc32c_vectors);
	tcase_add_test(tc, test_crc32c_incremental);
	tcase_add_test(tc, test_crc32c_unaligned);
	tcase_add_test(tc, test_crc32c_portable_agrees);
	tcase_add_test(tc, test_crc32c_first_use_threads);
	suite_add_tcase(s, tc);
	tc = tcase_create("fnv1a64");
	tcase_add_test(tc, test_fnv1a64);
	tcase_add_test(tc, test_write_file_atomic);
	suite_add_tcase(s, tc);
	tc = tcase_create("strings");
	tcase_add_test(tc, test_str_copy);
	tcase_add_test(tc, test_str_has_prefix);
	suite_add_tcase(s, tc);
	tc = tcase_create("system");
	tcase_add_test(tc, test_clock_and_random);
	tcase_add_test(tc, test_pid_alive);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(util_suite());
}

/* test_tokenizer_alloc.c - every allocation of the tokenizer (common/tokenizer/) failing in turn:
 * loading, encoding and decoding must return -ENOMEM (or succeed) and leave nothing behind (run it
 * in the sanitizer build: LeakSanitizer fails a forked test that leaks).
 *
 * The tokenizer allocates through tok_malloc, tok_calloc and tok_realloc (tokenizer_internal.h),
 * defined weak in alloc.c: this program defines its own, routed through counters; the N-th call
 * fails, for N = 0, 1, 2, ... until a run makes no failing call. jansson and PCRE2 allocate on
 * their own and are not failed here. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/tokenizer/tokenizer_internal.h"

static long fail_at = -1; /* the call that fails, -1: none */
static long n_calls;	  /* calls since the counter was reset */
static bool failed;	  /* whether the failing call happened */

static bool fail_now(void)
{
	if (fail_at >= 0 && n_calls++ == fail_at) {
		failed = true;
		return true;
	}
	return false;
}

/* In place of alloc.c's. */
void *tok_malloc(size_t n)
{
	return fail_now() ? NULL : malloc(n);
}

void *tok_calloc(size_t n, size_t size)
{
	return fail_now() ? NULL : calloc(n, size);
}

void *tok_realloc(void *p, size_t n)
{
	return fail_now() ? NULL : realloc(p, n);
}

#define SP_LEGACY_JSON TOK_TEST_FIXTURE_DIR "/sp-legacy/tokenizer.json"
#define SP_META_JSON   TOK_TEST_FIXTURE_DIR "/sp-metaspace/tokenizer.json"

static void arm(long n)
{
	fail_at = n;
	n_calls = 0;
	failed = false;
}

/* A byte-level file with a Split regex, ignore_merges and an added token with single_word,
 * lstrip and rstrip: the paths the fixtures do not take. Written to a temporary file. */
static char tmp_dir[64], byte_level_path[96];

static void write_byte_level(void)
{
	json_t *vocab = json_object();
	unsigned next = 256;
	for (unsigned b = 0; b < 256; b++) {
		bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
		uint8_t s[8] = {0};
		tok_utf8_put(keep ? b : next++, s);
		json_object_set_new(vocab, (const char *)s, json_integer(b));
	}
	json_object_set_new(vocab, "He", json_integer(256));
	json_object_set_new(vocab, "Hello", json_integer(257));
	json_t *doc = json_pack(
		"{s:[{s:i, s:s, s:b, s:b, s:b, s:b}], s:{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s, s:b}]}, s:{s:s}, "
		"s:{s:s, s:b, s:o, s:[s]}}",
		"added_tokens", "id", 258, "content", "<x>", "special", 1, "single_word", 1, "lstrip", 1, "rstrip", 1,
		"pre_tokenizer", "type", "Sequence", "pretokenizers", "type", "Split", "pattern", "Regex",
		" ?\\p{L}+|\\s+(?!\\S)|\\s+|.", "behavior", "Isolated", "type", "ByteLevel", "use_regex", 0, "decoder",
		"type", "ByteLevel", "model", "type", "BPE", "ignore_merges", 1, "vocab", vocab, "merges", "H e");
	snprintf(tmp_dir, sizeof(tmp_dir), "/tmp/test-tokenizer-alloc-XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(tmp_dir));
	snprintf(byte_level_path, sizeof(byte_level_path), "%s/tokenizer.json", tmp_dir);
	ck_assert_int_eq(json_dump_file(doc, byte_level_path, 0), 0);
	json_decref(doc);
}

/* Loads path with the N-th allocation failing, for every N; returns a tokenizer loaded with
 * none failing. */
static struct tokenizer *load_each_failing(const char *path)
{
	char err[512];
	struct tokenizer *t = NULL;
	for (long n = 0;; n++) {
		arm(n);
		int rc = tokenizer_load(path, &t, err, sizeof(err));
		if (!failed) {
			ck_assert_msg(rc == 0, "%s: %d %s", path, rc, err);
			/* the counting works: a load allocates many times */
			ck_assert_msg(n > 10, "%s: only %ld allocations", path, n);
			arm(-1);
			return t;
		}
		ck_assert_msg(rc == -ENOMEM && t == NULL, "allocation %ld failing: %d %s", n, rc, err);
		ck_assert_msg(strstr(err, "out of memory") != NULL, "allocation %ld failing: '%s'", n, err);
	}
}

static void encode_each_failing(const struct tokenizer *t, const char *text)
{
	struct tok_ids ids = {0};
	ck_assert_int_eq(tokenizer_encode(t, "x", 1, 0, &ids), 0); /* appended to: n must survive */
	size_t n0 = ids.n;
	for (long n = 0;; n++) {
		arm(n);
		int rc = tokenizer_encode(t, text, strlen(text), 0, &ids);
		if (!failed) {
			ck_assert_int_eq(rc, 0);
			break;
		}
		ck_assert_msg(rc == -ENOMEM, "encode, allocation %ld failing: %d", n, rc);
		ck_assert_uint_eq(ids.n, n0);
	}
	arm(-1);
	/* and decoding what it made */
	for (long n = 0;; n++) {
		char *out = NULL;
		size_t len;
		arm(n);
		int rc = tokenizer_decode(t, ids.ids, ids.n, 0, &out, &len);
		if (!failed) {
			ck_assert_int_eq(rc, 0);
			free(out);
			break;
		}
		ck_assert_msg(rc == -ENOMEM && out == NULL, "decode, allocation %ld failing: %d", n, rc);
	}
	for (long n = 0;; n++) {
		arm(n);
		struct tok_decoder *d = tok_decoder_create(t, 0);
		int rc = d ? 0 : -ENOMEM;
		const char *s;
		size_t len;
		for (size_t i = 0; i < ids.n && !rc; i++)
			rc = tok_decoder_feed(d, ids.ids[i], &s, &len);
		if (!rc)
			rc = tok_decoder_flush(d, &s, &len);
		tok_decoder_destroy(&d);
		if (!failed) {
			ck_assert_int_eq(rc, 0);
			break;
		}
		ck_assert_msg(rc == -ENOMEM, "stream decode, allocation %ld failing: %d", n, rc);
	}
	arm(-1);
	tok_ids_free(&ids);
}

START_TEST(test_alloc_sentencepiece)
{
	struct tokenizer *t = load_each_failing(SP_LEGACY_JSON);
	encode_each_failing(t, "Hello world, the caf\xc3\xa9 <s>H\xc3\xbc\xff!");
	tokenizer_destroy(&t);
	t = load_each_failing(SP_META_JSON);
	encode_each_failing(t, "Hello world <s>o x");
	tokenizer_destroy(&t);
}
END_TEST

START_TEST(test_alloc_byte_level)
{
	write_byte_level();
	struct tokenizer *t = load_each_failing(byte_level_path);
	unlink(byte_level_path);
	rmdir(tmp_dir);
	encode_each_failing(t, "Hello  world <x> a<x>b \xff\xf0\x9f\xa6\x99 Hello");
	tokenizer_destroy(&t);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("tokenizer_alloc");
	TCase *tc = tcase_create("alloc");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_alloc_sentencepiece);
	tcase_add_test(tc, test_alloc_byte_level);
	suite_add_tcase(s, tc);
	SRunner *sr = srunner_create(s);
	srunner_set_fork_status(sr, CK_FORK);
	srunner_run_all(sr, CK_NORMAL);
	int failed_tests = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed_tests ? EXIT_FAILURE : EXIT_SUCCESS;
}

/* test_tokenizer_ids.c - tokenizer_ids_scan (common/tokenizer/ids.h), what the checkpoint reader
 * checks a tokenizer.json with: the same vocabulary size as the tokenizer's own load on every
 * fixture, the file accepted whatever its other parts say, and each fault of its ids refused with
 * the loader's own message. Variant files go to a mkdtemp() directory per test. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/ids.h"
#include "tests/unit/tokenizer/tokenizer_test_util.h"

/* Scans the file at path: rc, *n_ids and err as tokenizer_ids_scan. */
static int scan_file(const char *path, uint32_t *n_ids, char *err, size_t errlen)
{
	size_t len;
	char *text = read_all(path, &len);
	err[0] = 0;
	int rc = tokenizer_ids_scan(path, text, len, n_ids, err, errlen);
	free(text);
	return rc;
}

/* Writes doc (consumed) to a file of this test's directory; returns its path. */
static const char *write_doc(json_t *doc)
{
	char *text = json_dumps(doc, JSON_COMPACT | JSON_ENSURE_ASCII);
	ck_assert_ptr_nonnull(text);
	json_decref(doc);
	const char *path = write_text(text, strlen(text));
	free(text);
	return path;
}

/* The scan of path gives the vocabulary size the tokenizer's load gives. */
static void expect_same_size(const char *path)
{
	char err[512];
	uint32_t n = 0;
	int rc = scan_file(path, &n, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s: %d %s", path, rc, err);
	struct tokenizer *t = load_ok(path);
	ck_assert_uint_eq(n, tokenizer_vocab_size(t));
	tokenizer_destroy(&t);
}

/* Both the scan and the load refuse doc with -EINVAL and the same message, which holds word. */
static void expect_refused(json_t *doc, const char *word)
{
	const char *path = write_doc(doc);
	char scan_err[512], load_err[512];
	uint32_t n = 7;
	int rc = scan_file(path, &n, scan_err, sizeof(scan_err));
	ck_assert_msg(rc == -EINVAL, "scan: want -EINVAL (%s), got %d: %s", word, rc, scan_err);
	ck_assert_uint_eq(n, 7); /* untouched */
	ck_assert_msg(strstr(scan_err, word) && strstr(scan_err, path), "scan message '%s' (want '%s')", scan_err,
		      word);
	struct tokenizer *t;
	ck_assert_int_eq(tokenizer_load(path, &t, load_err, sizeof(load_err)), -EINVAL);
	ck_assert_str_eq(scan_err, load_err);
}

START_TEST(test_ids_sizes)
{
	expect_same_size(LLAMA3_JSON);
	expect_same_size(SP_LEGACY_JSON);
	expect_same_size(SP_META_JSON);
	/* added tokens past the vocab, with a gap */
	json_t *doc = json_of(SP_LEGACY_JSON);
	json_array_append_new(json_object_get(doc, "added_tokens"),
			      json_pack("{s:i, s:s, s:b}", "id", 301, "content", "<tool>", "special", 0));
	expect_same_size(write_doc(doc));
}
END_TEST

START_TEST(test_ids_other_parts)
{
	/* What the scan does not read does not matter to it: the runner's load checks it. */
	char err[512];
	uint32_t n = 0;
	json_t *doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "pre_tokenizer", json_pack("{s:s}", "type", "Whitespace"));
	json_object_set_new(json_object_get(doc, "model"), "merges", json_string("not a list"));
	ck_assert_int_eq(scan_file(write_doc(doc), &n, err, sizeof(err)), 0);
	ck_assert_uint_eq(n, 295);
	/* no added_tokens at all, or null */
	ck_assert_int_eq(tokenizer_ids_scan("x", "{\"model\": {\"vocab\": {\"a\": 4}}}", 30, &n, err, sizeof(err)), 0);
	ck_assert_uint_eq(n, 5);
	static const char with_null[] = "{\"model\": {\"vocab\": {\"a\": 0}}, \"added_tokens\": null}";
	ck_assert_int_eq(tokenizer_ids_scan("x", with_null, strlen(with_null), &n, err, sizeof(err)), 0);
	ck_assert_uint_eq(n, 1);
}
END_TEST

START_TEST(test_ids_refused)
{
	static const char *const texts[][2] = {
		{"", "not valid JSON"},
		{"{\"model\": ", "not valid JSON"},
		{"[1, 2]", "the top level must be an object, got a list"},
		{"{}", "\"model\" must be an object, got missing"},
		{"{\"model\": {\"vocab\": {\"a\": 0, \"a\": 1}}}", "duplicate"},
	};
	for (size_t i = 0; i < ARRAY_SIZE(texts); i++) {
		const char *p = write_text(texts[i][0], strlen(texts[i][0]));
		char err[512];
		uint32_t n;
		int rc = scan_file(p, &n, err, sizeof(err));
		ck_assert_msg(rc == -EINVAL && strstr(err, texts[i][1]) && strstr(err, p), "text %zu: %d '%s'", i, rc,
			      err);
	}

	json_t *doc;
#define MODEL(d) json_object_get((d), "model")
	doc = json_of(SP_LEGACY_JSON);
	json_object_del(MODEL(doc), "vocab");
	expect_refused(doc, "model.vocab must be an object (piece -> id), got missing");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(MODEL(doc), "vocab", json_object());
	expect_refused(doc, "model.vocab is empty");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(json_object_get(MODEL(doc), "vocab"), "zz", json_string("7"));
	expect_refused(doc, "vocab entry 'zz' has an id that is a string, not an integer");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(json_object_get(MODEL(doc), "vocab"), "zz", json_integer(-1));
	expect_refused(doc, "'zz' has id -1");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(json_object_get(MODEL(doc), "vocab"), "zz", json_integer(1ll << 30));
	expect_refused(doc, "outside");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "added_tokens", json_object());
	expect_refused(doc, "added_tokens must be a list, got an object");

	doc = json_of(SP_LEGACY_JSON);
	json_array_append_new(json_object_get(doc, "added_tokens"), json_integer(3));
	expect_refused(doc, "added_tokens[3] must be an object, got an integer");

	doc = json_of(SP_LEGACY_JSON);
	json_array_append_new(json_object_get(doc, "added_tokens"), json_pack("{s:i}", "id", 400));
	expect_refused(doc, "added_tokens[3].content is missing");

	doc = json_of(SP_LEGACY_JSON);
	json_array_append_new(json_object_get(doc, "added_tokens"), json_pack("{s:i, s:s}", "id", 400, "content", ""));
	expect_refused(doc, "content is empty");

	doc = json_of(SP_LEGACY_JSON);
	json_array_append_new(json_object_get(doc, "added_tokens"), json_pack("{s:s}", "content", "<x>"));
	expect_refused(doc, "added token '<x>' has an id that is missing, not an integer");

	doc = json_of(SP_LEGACY_JSON);
	json_array_append_new(json_object_get(doc, "added_tokens"),
			      json_pack("{s:i, s:s}", "id", TOK_MAX_ID + 1, "content", "<x>"));
	expect_refused(doc, "added token '<x>' has id 16777216, outside");
#undef MODEL
}
END_TEST

int main(void)
{
	Suite *s = suite_create("tokenizer_ids");
	TCase *tc = tcase_create("ids");
	tcase_add_checked_fixture(tc, tmp_setup, tmp_teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_ids_sizes);
	tcase_add_test(tc, test_ids_other_parts);
	tcase_add_test(tc, test_ids_refused);
	suite_add_tcase(s, tc);
	return th_run(s);
}

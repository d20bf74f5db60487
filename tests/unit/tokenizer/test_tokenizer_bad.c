/* test_tokenizer_bad.c - tokenizer_load on bad files: missing, not JSON, and the SentencePiece
 * fixture edited into each fault the loader refuses, each with its return code and a message
 * that names the file and the fault. The files go to a mkdtemp() directory per test. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/unit/tokenizer/tokenizer_test_util.h"

START_TEST(test_bad_files)
{
	char err[512];
	struct tokenizer *t = (struct tokenizer *)&err; /* must come back NULL */
	char path[128];

	snprintf(path, sizeof(path), "%s/missing.json", tmp_root);
	ck_assert_int_eq(tokenizer_load(path, &t, err, sizeof(err)), -ENOENT);
	ck_assert_ptr_null(t);
	ck_assert_msg(strstr(err, path) && strstr(err, "No such file"), "message: %s", err);
	/* a directory without tokenizer.json */
	ck_assert_int_eq(tokenizer_load(tmp_root, &t, err, sizeof(err)), -ENOENT);
	ck_assert_msg(strstr(err, "no tokenizer.json"), "message: %s", err);

	static const struct {
		const char *text;
		int rc;
		const char *word;
	} texts[] = {
		{"", -EINVAL, "not valid JSON"},
		{"{\"model\": ", -EINVAL, "not valid JSON"},
		{"[1, 2]", -EINVAL, "top level"},
		{"{}", -EINVAL, "\"model\""},
		{"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"a\": 1}, \"merges\": []}}", -EINVAL,
		 "duplicate"},
	};
	for (size_t i = 0; i < ARRAY_SIZE(texts); i++) {
		const char *p = write_text(texts[i].text, strlen(texts[i].text));
		int rc = tokenizer_load(p, &t, err, sizeof(err));
		ck_assert_msg(rc == texts[i].rc && strstr(err, texts[i].word) && strstr(err, p),
			      "text %zu: %d '%s'", i, rc, err);
		ck_assert_ptr_null(t);
	}

	json_t *doc;
#define MODEL(d) json_object_get((d), "model")
	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(MODEL(doc), "type", json_string("WordPiece"));
	expect_bad(doc, -ENOTSUP, "model type WordPiece is not supported");

	doc = json_of(SP_LEGACY_JSON);
	json_object_del(MODEL(doc), "vocab");
	expect_bad(doc, -EINVAL, "model.vocab");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(MODEL(doc), "vocab", json_object());
	expect_bad(doc, -EINVAL, "model.vocab is empty");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(MODEL(doc), "merges", json_string("l l"));
	expect_bad(doc, -EINVAL, "model.merges");

	doc = json_of(SP_LEGACY_JSON);
	json_array_set_new(json_object_get(MODEL(doc), "merges"), 5, json_integer(42));
	expect_bad(doc, -EINVAL, "merges entry 5 is not a pair");

	doc = json_of(SP_LEGACY_JSON);
	json_array_set_new(json_object_get(MODEL(doc), "merges"), 5, json_string("a b c"));
	expect_bad(doc, -EINVAL, "merges entry 5 is not a pair");

	doc = json_of(SP_LEGACY_JSON);
	json_array_set_new(json_object_get(MODEL(doc), "merges"), 5, json_pack("[s]", "a"));
	expect_bad(doc, -EINVAL, "merges entry 5 is not a pair");

	doc = json_of(SP_LEGACY_JSON);
	json_array_set_new(json_object_get(MODEL(doc), "merges"), 16, json_string("q z"));
	expect_bad(doc, -EINVAL, "merges entry 16 ('q' 'z'): 'q' is not in the vocab");

	doc = json_of(SP_LEGACY_JSON);
	json_array_set_new(json_object_get(MODEL(doc), "merges"), 16, json_string("d d"));
	expect_bad(doc, -EINVAL, "'dd', the merge of 'd' and 'd', is not in the vocab");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(json_object_get(MODEL(doc), "vocab"), "zz", json_integer(260));
	expect_bad(doc, -EINVAL, "vocab id 260 appears twice");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(json_object_get(MODEL(doc), "vocab"), "zz", json_integer(-1));
	expect_bad(doc, -EINVAL, "'zz' has id -1");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(json_object_get(MODEL(doc), "vocab"), "zz", json_string("7"));
	expect_bad(doc, -EINVAL, "not an integer");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(json_object_get(MODEL(doc), "vocab"), "zz", json_integer(1ll << 30));
	expect_bad(doc, -EINVAL, "outside");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(json_object_get(MODEL(doc), "vocab"), "zz", json_integer(5000000));
	expect_bad(doc, -EINVAL, "ids go up to 5000000 but there are only 299 pieces");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(MODEL(doc), "unk_token", json_string("<nope>"));
	expect_bad(doc, -EINVAL, "unk_token '<nope>' is not in the vocab");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(MODEL(doc), "dropout", json_real(0.1));
	expect_bad(doc, -ENOTSUP, "dropout");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(MODEL(doc), "byte_fallback", json_string("yes"));
	expect_bad(doc, -EINVAL, "model.byte_fallback must be a boolean");

	doc = json_of(SP_LEGACY_JSON);
	json_array_append_new(json_object_get(doc, "added_tokens"),
			      json_pack("{s:i, s:s}", "id", 1, "content", "<S>"));
	expect_bad(doc, -EINVAL, "added token id 1 appears twice");

	doc = json_of(SP_LEGACY_JSON);
	json_array_append_new(json_object_get(doc, "added_tokens"),
			      json_pack("{s:i, s:s}", "id", 400, "content", "<s>"));
	expect_bad(doc, -EINVAL, "added token '<s>'");

	doc = json_of(SP_LEGACY_JSON);
	json_array_append_new(json_object_get(doc, "added_tokens"),
			      json_pack("{s:i, s:s}", "id", 260, "content", "<x>"));
	expect_bad(doc, -EINVAL, "which the vocab gives to 'e'");

	doc = json_of(SP_LEGACY_JSON);
	json_array_append_new(json_object_get(doc, "added_tokens"), json_pack("{s:i, s:s}", "id", 400, "content", ""));
	expect_bad(doc, -EINVAL, "content is empty");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "pre_tokenizer", json_pack("{s:s}", "type", "Whitespace"));
	expect_bad(doc, -ENOTSUP, "pre_tokenizer type Whitespace is not supported");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "pre_tokenizer", json_pack("{s:s, s:{s:s}, s:s, s:b}", "type", "Split", "pattern",
							    "Regex", "(unclosed", "behavior", "Isolated", "invert", 0));
	expect_bad(doc, -EINVAL, "does not compile");

	/* \C matches one byte of a character: refused, matching on from inside a character is undefined. */
	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "pre_tokenizer", json_pack("{s:s, s:{s:s}, s:s}", "type", "Split", "pattern", "Regex",
							    "a|\\C", "behavior", "Isolated"));
	expect_bad(doc, -EINVAL, "does not compile");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "pre_tokenizer", json_pack("{s:s, s:{s:s}, s:s}", "type", "Split", "pattern", "Regex",
							    "\\s+", "behavior", "Removed"));
	expect_bad(doc, -ENOTSUP, "behavior Removed is not supported");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "pre_tokenizer",
			    json_pack("{s:s, s:[{s:s, s:b}, {s:s}]}", "type", "Sequence", "pretokenizers", "type",
				      "ByteLevel", "use_regex", 0, "type", "Metaspace"));
	expect_bad(doc, -ENOTSUP, "ByteLevel must be last");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "normalizer", json_pack("{s:s}", "type", "NFKC"));
	expect_bad(doc, -ENOTSUP, "normalizer type NFKC is not supported");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "normalizer", json_pack("{s:s, s:{s:s}, s:s}", "type", "Replace", "pattern", "Regex",
							 " +", "content", "x"));
	expect_bad(doc, -ENOTSUP, "Regex pattern is not supported");

	/* A Replace's content is a character or two in real files; a long one multiplies a text. */
	char long_content[TOK_REPLACE_MAX + 2];
	memset(long_content, 'x', sizeof(long_content) - 1);
	long_content[sizeof(long_content) - 1] = '\0';
	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "normalizer", json_pack("{s:s, s:{s:s}, s:s}", "type", "Replace", "pattern", "String",
							 " ", "content", long_content));
	expect_bad(doc, -EINVAL, "at most 64 bytes each");

	/* A decoder that makes every piece 64 times longer: refused at load, where each piece is
	 * decoded (300 pieces "a" .. "a" x 300 would take 2.9 MB for 45 KB of pieces; a larger file
	 * the same way took gigabytes). */
	char content[TOK_REPLACE_MAX + 1];
	memset(content, 'x', TOK_REPLACE_MAX);
	content[TOK_REPLACE_MAX] = '\0';
	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "decoder", json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}]}", "type", "Sequence", "decoders",
						      "type", "Replace", "pattern", "String", "a", "content", content));
	json_t *vocab = json_object_get(MODEL(doc), "vocab");
	size_t n_vocab = json_object_size(vocab);
	char piece[301];
	for (size_t k = 1; k <= 300; k++) {
		memset(piece, 'a', k);
		piece[k] = '\0';
		json_object_set_new(vocab, piece, json_integer((json_int_t)(n_vocab + k)));
	}
	expect_bad(doc, -EFBIG, "over four times as long");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "decoder", json_pack("{s:s}", "type", "WordPiece"));
	expect_bad(doc, -ENOTSUP, "decoder type WordPiece is not supported");

	doc = json_of(SP_LEGACY_JSON);
	json_array_append_new(json_object_get(json_object_get(doc, "decoder"), "decoders"),
			      json_pack("{s:s, s:s, s:i, s:i}", "type", "Strip", "content", " ", "start", 0, "stop",
					1));
	expect_bad(doc, -ENOTSUP, "stop 1 after Fuse");

	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(doc, "decoder", json_string("ByteLevel"));
	expect_bad(doc, -EINVAL, "decoder must be an object");
#undef MODEL
}
END_TEST

int main(void)
{
	Suite *s = suite_create("tokenizer_bad");
	TCase *tc = tcase_create("bad_files");
	tcase_add_checked_fixture(tc, tmp_setup, tmp_teardown);
	tcase_add_test(tc, test_bad_files);
	suite_add_tcase(s, tc);
	return th_run(s);
}

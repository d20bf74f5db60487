/* test_tokenizer_llama3.c - the tokenizer (common/tokenizer/) against the Llama 3 tokenizer.json:
 * llama.cpp's test vectors for it, vectors that Hugging Face tokenizers produced (data/hf-vectors),
 * known ids, special tokens, round trips over random text, the streaming decoder, invalid UTF-8
 * and large inputs.
 *
 * The tokenizer is loaded once per tcase in the parent (an unchecked fixture) and inherited by
 * each forked test. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/unit/tokenizer/tokenizer_test_util.h"

static struct tokenizer *llama3; /* loaded by the parent for the tcases that need it */

static void llama3_setup(void)
{
	char err[512];
	if (tokenizer_load(LLAMA3_JSON, &llama3, err, sizeof(err)) != 0) {
		fprintf(stderr, "cannot load %s: %s\n", LLAMA3_JSON, err);
		abort();
	}
}

static void llama3_teardown(void)
{
	tokenizer_destroy(&llama3);
}


START_TEST(test_llama3_vectors)
{
	size_t in_len, out_len;
	char *in = read_all(TOK_TEST_LLAMA3_DIR "/vocab.inp", &in_len);
	char *out = read_all(TOK_TEST_LLAMA3_DIR "/vocab.out", &out_len);
	/* Cases are separated by "\n__ggml_vocab_test__\n" (the newline before the marker is not
	 * part of the case; the file ends with the marker); .out holds one line per case, each id
	 * preceded by a space. The first case is "ied 4 ½ months", the third "" and the fourth " ". */
	static const char delim[] = "\n__ggml_vocab_test__\n";
	const char *p = in, *line = out;
	int cases = 0;
	for (const char *q; (q = strstr(p, delim)) != NULL; p = q + strlen(delim)) {
		const char *nl = strchr(line, '\n');
		ck_assert_msg(nl != NULL, "vocab.out has fewer lines than vocab.inp has cases (%d)", cases);
		char *want = strndup(line, (size_t)(nl - line));
		line = nl + 1;
		struct tok_ids ids = {0};
		ck_assert_int_eq(tokenizer_encode(llama3, p, (size_t)(q - p), 0, &ids), 0);
		char *got = ids_text(ids.ids, ids.n);
		ck_assert_msg(!strcmp(got, want), "case %d '%.*s': want%s, got%s", cases, (int)(q - p), p, want, got);
		/* and back */
		size_t dl;
		char *back = decode_ok(llama3, ids.ids, ids.n, 0, &dl);
		ck_assert_msg(dl == (size_t)(q - p) && !memcmp(back, p, dl), "case %d does not decode back", cases);
		free(back);
		free(got);
		free(want);
		tok_ids_free(&ids);
		cases++;
	}
	ck_assert_int_eq(cases, 46);
	ck_assert_msg(*line == 0, "vocab.out has more lines than cases");
	free(in);
	free(out);
}
END_TEST

START_TEST(test_llama3_known)
{
	ck_assert_uint_eq(tokenizer_vocab_size(llama3), 128256);
	ck_assert_int_eq(tokenizer_bos(llama3), 128000);
	ck_assert_int_eq(tokenizer_eos(llama3), 128001);
	ck_assert_int_eq(tokenizer_token_to_id(llama3, "<|eot_id|>"), 128009);
	ck_assert_int_eq(tokenizer_token_to_id(llama3, "Hello"), 9906);
	ck_assert_int_eq(tokenizer_token_to_id(llama3, "\xc4\xa0world"), 1917); /* "Ġworld" */
	ck_assert_int_eq(tokenizer_token_to_id(llama3, "no such piece, surely"), -1);
	ck_assert_int_eq(tokenizer_token_to_id(llama3, ""), -1);
	size_t len = 0;
	ck_assert_str_eq(tokenizer_id_to_piece(llama3, 9906, &len), "Hello");
	ck_assert_uint_eq(len, 5);
	ck_assert_str_eq(tokenizer_id_to_piece(llama3, 128009, NULL), "<|eot_id|>");
	ck_assert_ptr_null(tokenizer_id_to_piece(llama3, 128256, NULL));
	ck_assert(tokenizer_is_special(llama3, 128009));
	ck_assert(!tokenizer_is_special(llama3, 9906));
	ck_assert(!tokenizer_is_special(llama3, 999999));
	/* the emoji of llama.cpp's vectors, and empty input */
	EXPECT_IDS(llama3, " \xf0\x9f\xa6\x99", 0, 11410, 99, 247);
	struct tok_ids ids = {0};
	ck_assert_int_eq(tokenizer_encode(llama3, "", 0, 0, &ids), 0);
	ck_assert_uint_eq(ids.n, 0);
	ck_assert_int_eq(tokenizer_encode(llama3, NULL, 0, TOK_ADD_BOS, &ids), 0);
	ck_assert_uint_eq(ids.n, 1);
	ck_assert_uint_eq(ids.ids[0], 128000);
	/* encode appends */
	ck_assert_int_eq(tokenizer_encode(llama3, "Hello", 5, 0, &ids), 0);
	ck_assert_uint_eq(ids.n, 2);
	ck_assert_uint_eq(ids.ids[1], 9906);
	tok_ids_free(&ids);
	tok_ids_free(&ids);
	ck_assert_ptr_null(ids.ids);
}
END_TEST

START_TEST(test_llama3_hf_vectors)
{
	check_hf_vectors(llama3, TOK_TEST_FIXTURE_DIR "/hf-vectors/llama3.json");
}
END_TEST

START_TEST(test_llama3_special)
{
	/* parsed by default */
	EXPECT_IDS(llama3, "<|begin_of_text|>Hello", 0, 128000, 9906);
	EXPECT_IDS(llama3, "Hello", TOK_ADD_BOS, 128000, 9906);
	EXPECT_IDS(llama3, "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", 0, 128006, 882, 128007, 271,
		   13347, 128009);
	/* as plain text with the flag: the same ids as the text run through BPE piece by piece */
	EXPECT_IDS(llama3, "<|begin_of_text|>Hello", TOK_SPECIAL_AS_TEXT, 27, 91, 7413, 3659, 4424, 91, 29, 9906);
	EXPECT_IDS(llama3, "<|begin_of_text|>", TOK_SPECIAL_AS_TEXT | TOK_ADD_BOS, 128000, 27, 91, 7413, 3659, 4424,
		   91, 29);
	/* a near miss is text */
	struct tok_ids a = {0}, b = {0};
	ck_assert_int_eq(tokenizer_encode(llama3, "<|eot_id", 8, 0, &a), 0);
	ck_assert_int_eq(tokenizer_encode(llama3, "<|eot_id", 8, TOK_SPECIAL_AS_TEXT, &b), 0);
	ck_assert_uint_eq(a.n, b.n);
	for (size_t i = 0; i < a.n; i++) {
		ck_assert_uint_eq(a.ids[i], b.ids[i]);
		ck_assert_uint_lt(a.ids[i], 128000);
	}
	tok_ids_free(&a);
	tok_ids_free(&b);
	/* special tokens decode to their text, or to nothing with TOK_SKIP_SPECIAL */
	EXPECT_DECODE(llama3, 0, "<|begin_of_text|>Hello<|eot_id|>", 128000, 9906, 128009);
	EXPECT_DECODE(llama3, TOK_SKIP_SPECIAL, "Hello", 128000, 9906, 128009);
}
END_TEST

START_TEST(test_llama3_round_trip)
{
	/* decode(encode(x)) == x for random valid UTF-8, special-token text included (it encodes to
	 * the special token, which decodes to the same text). */
	static char buf[16 * 64 + 1];
	rng_state = 0x9E3779B97F4A7C15ull;
	for (int i = 0; i < 3000; i++) {
		size_t n = random_text(buf, 64, true);
		TH_CHECK(valid_utf8(buf, n), "the generator made invalid UTF-8");
		expect_round_trip(llama3, buf, n, 0, 0);
		expect_round_trip(llama3, buf, n, TOK_SPECIAL_AS_TEXT, 0);
	}
}
END_TEST

/* Feeds ids one at a time: each chunk must be valid UTF-8 (no character split, no U+FFFD for
 * a character that a later token completes) and the chunks together the whole decode. */
static void check_stream(const struct tokenizer *t, const uint32_t *ids, size_t n, const char *want, size_t want_len)
{
	struct tok_decoder *d = tok_decoder_create(t, 0);
	ck_assert_ptr_nonnull(d);
	char *all = malloc(want_len + 64);
	size_t got = 0;
	const char *s;
	size_t len;
	for (size_t i = 0; i < n; i++) {
		TH_CHECK(tok_decoder_feed(d, ids[i], &s, &len) == 0, "feed %u", ids[i]);
		TH_CHECK(valid_utf8(s, len), "chunk %zu (id %u) is not whole UTF-8", i, ids[i]);
		TH_CHECK(!memmem(s, len, "\xef\xbf\xbd", 3), "chunk %zu (id %u) has U+FFFD", i, ids[i]);
		TH_CHECK(got + len <= want_len, "more output than the text");
		memcpy(all + got, s, len);
		got += len;
	}
	ck_assert_int_eq(tok_decoder_flush(d, &s, &len), 0);
	ck_assert_uint_eq(len, 0);
	ck_assert_msg(got == want_len && !memcmp(all, want, got), "stream gave '%.*s', want '%.*s'", (int)got, all,
		      (int)want_len, want);
	free(all);
	tok_decoder_destroy(&d);
	tok_decoder_destroy(&d);
	ck_assert_ptr_null(d);
}

START_TEST(test_llama3_stream)
{
	/* "this is 🦙.cpp": the llama is 11410 ("Ġð" + 0x9F: a space and two of its bytes), 99 (0xA6),
	 * 247 (0x99). It must come out once, whole, with the last of its tokens. */
	static const uint32_t ids[] = {576, 374, 11410, 99, 247, 13, 11055};
	static const char *const chunks[] = {"this", " is", " ", "", "\xf0\x9f\xa6\x99", ".", "cpp"};
	struct tok_decoder *d = tok_decoder_create(llama3, 0);
	ck_assert_ptr_nonnull(d);
	const char *s;
	size_t len;
	for (size_t i = 0; i < ARRAY_SIZE(ids); i++) {
		ck_assert_int_eq(tok_decoder_feed(d, ids[i], &s, &len), 0);
		ck_assert_msg(len == strlen(chunks[i]) && !memcmp(s, chunks[i], len), "id %u: want '%s', got '%.*s'",
			      ids[i], chunks[i], (int)len, s);
	}
	/* an id outside the vocab: refused, nothing emitted, the stream goes on */
	ck_assert_int_eq(tok_decoder_feed(d, 128256, &s, &len), -EINVAL);
	ck_assert_uint_eq(len, 0);
	ck_assert_int_eq(tok_decoder_feed(d, UINT32_MAX, &s, &len), -EINVAL);
	/* an incomplete character at the end becomes one U+FFFD at the flush */
	ck_assert_int_eq(tok_decoder_feed(d, 11410, &s, &len), 0);
	ck_assert_uint_eq(len, 1);
	ck_assert_int_eq(tok_decoder_flush(d, &s, &len), 0);
	ck_assert_msg(len == 3 && !memcmp(s, "\xef\xbf\xbd", 3), "flush gave '%.*s'", (int)len, s);
	/* the flush starts afresh: a continuation byte alone is invalid at once */
	ck_assert_int_eq(tok_decoder_feed(d, 99, &s, &len), 0);
	ck_assert_msg(len == 3 && !memcmp(s, "\xef\xbf\xbd", 3), "got '%.*s'", (int)len, s);
	ck_assert_int_eq(tok_decoder_feed(d, 9906, &s, &len), 0);
	ck_assert_msg(len == 5 && !memcmp(s, "Hello", 5), "got '%.*s'", (int)len, s);
	tok_decoder_destroy(&d);

	/* TOK_DECODE_RAW: the held bytes as they are */
	d = tok_decoder_create(llama3, TOK_DECODE_RAW);
	ck_assert_int_eq(tok_decoder_feed(d, 11410, &s, &len), 0);
	ck_assert_int_eq(tok_decoder_flush(d, &s, &len), 0);
	ck_assert_msg(len == 2 && !memcmp(s, "\xf0\x9f", 2), "raw flush gave %zu bytes", len);
	tok_decoder_destroy(&d);

	/* whole-text decode of the same ids; then random text fed one id at a time */
	EXPECT_DECODE(llama3, 0, "this is \xf0\x9f\xa6\x99.cpp", 576, 374, 11410, 99, 247, 13, 11055);
	static char buf[16 * 48 + 1];
	rng_state = 42;
	for (int i = 0; i < 500; i++) {
		size_t n = random_text(buf, 48, false);
		struct tok_ids v = {0};
		ck_assert_int_eq(tokenizer_encode(llama3, buf, n, 0, &v), 0);
		check_stream(llama3, v.ids, v.n, buf, n);
		tok_ids_free(&v);
	}
}
END_TEST

START_TEST(test_llama3_invalid_utf8)
{
	/* Defined behaviour: each invalid byte is a pre-token of its own, encoded through the byte
	 * mapping; decode gives the bytes back with TOK_DECODE_RAW, U+FFFD per maximal invalid
	 * subpart otherwise. */
	static const struct {
		const char *in;
		const char *replaced;
	} cases[] = {
		{"a\xff" "b", "a\xef\xbf\xbd" "b"},
		{"\xe2\x82", "\xef\xbf\xbd"},		      /* a truncated euro sign: one subpart */
		{"\xe2\x82 x", "\xef\xbf\xbd x"},
		{"\xc0\xaf", "\xef\xbf\xbd\xef\xbf\xbd"},      /* overlong: two */
		{"\xed\xa0\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* a surrogate: three */
		{"\x80\x80 hello \xf5", "\xef\xbf\xbd\xef\xbf\xbd hello \xef\xbf\xbd"},
		{"<|eot_id|>\xff<|eot_id|>", "<|eot_id|>\xef\xbf\xbd<|eot_id|>"},
	};
	for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
		const char *in = cases[i].in;
		expect_round_trip(llama3, in, strlen(in), 0, TOK_DECODE_RAW);
		struct tok_ids ids = {0};
		ck_assert_int_eq(tokenizer_encode(llama3, in, strlen(in), 0, &ids), 0);
		size_t len;
		char *s = decode_ok(llama3, ids.ids, ids.n, 0, &len);
		ck_assert_msg(len == strlen(cases[i].replaced) && !memcmp(s, cases[i].replaced, len),
			      "case %zu decodes to '%.*s'", i, (int)len, s);
		free(s);
		tok_ids_free(&ids);
	}
	/* the byte 0xFF alone is the piece of its mapped character, "ÿ" (U+FF) */
	EXPECT_IDS(llama3, "\xff", 0, (uint32_t)tokenizer_token_to_id(llama3, "\xc3\xbf"));
	/* random bytes, valid or not */
	static char buf[256];
	rng_state = 7;
	for (int i = 0; i < 1000; i++) {
		size_t n = rnd(sizeof(buf));
		for (size_t k = 0; k < n; k++)
			buf[k] = (char)(rnd(3) ? rnd(256) : 'a' + rnd(3));
		expect_round_trip(llama3, buf, n, 0, TOK_DECODE_RAW);
	}
}
END_TEST

START_TEST(test_llama3_large)
{
	/* 200 KB of mixed text, and 200 KB that is one pre-token (no timing asserted). */
	size_t cap = 200 * 1024;
	char *big = malloc(cap + 1024);
	size_t n = 0;
	rng_state = 99;
	while (n < cap)
		n += random_text(big + n, 60, true);
	expect_round_trip(llama3, big, n, 0, 0);
	memset(big, 'a', cap);
	for (size_t i = 0; i < cap; i += 97)
		big[i] = "bcdlmnrst"[i % 9];
	expect_round_trip(llama3, big, cap, 0, 0);
	memset(big, ' ', cap);
	expect_round_trip(llama3, big, cap, 0, 0);
	free(big);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("tokenizer_llama3");
	TCase *tc = tcase_create("llama3");
	tcase_add_unchecked_fixture(tc, llama3_setup, llama3_teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_llama3_vectors);
	tcase_add_test(tc, test_llama3_hf_vectors);
	tcase_add_test(tc, test_llama3_known);
	tcase_add_test(tc, test_llama3_special);
	tcase_add_test(tc, test_llama3_round_trip);
	tcase_add_test(tc, test_llama3_stream);
	tcase_add_test(tc, test_llama3_invalid_utf8);
	tcase_add_test(tc, test_llama3_large);
	suite_add_tcase(s, tc);
	return th_run(s);
}

/* test_tokenizer_sp.c - the tokenizer (common/tokenizer/) on the SentencePiece-style fixtures
 * (data/sp-*, written by make_sp_fixtures.py, expectations worked out by hand below) and the
 * vectors Hugging Face tokenizers produced for them (data/hf-vectors), variants made by editing
 * the JSON, and a byte-level file built here. Variant files go to a mkdtemp() directory per test. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/unit/tokenizer/tokenizer_test_util.h"

/* ---- SentencePiece-style fixtures ----
 *
 * Ids (see make_sp_fixtures.py): <unk> 0, <s> 1, </s> 2, byte b is 3 + b; ▁ 259, e 260, t 261,
 * h 262, l 263, o 264, H 265, w 266, r 267, d 268, a 269, n 270, i 271, s 272, ',' 273, '!' 274,
 * é 275, c 276, f 277; merges by rank: 0 ▁+t=278, 1 h+e=279, 2 ▁t+he=280 (▁the), 3 l+l=281,
 * 4 ▁+H=282, 5 e+ll=283, 6 ▁H+ell=284, 7 ▁Hell+o=285 (▁Hello), 8 o+r=286, 9 ▁+w=287,
 * 10 ▁w+or=288, 11 ▁wor+l=289, 12 ▁worl+d=290 (▁world), 13 t+h=291, 14 o+▁=292, 15 a+n=293,
 * 16 i+n=294. */

/* The cases where the two layouts agree (text that does not start with a space or follow an
 * added token). */
static void sp_common_cases(const struct tokenizer *t)
{
	/* "▁Hello▁world": l+l (3), ▁+H (4), e+ll (5), ▁H+ell (6), ▁Hell+o (7); then o+r (8), ▁+w (9),
	 * ▁w+or (10), ▁wor+l (11), ▁worl+d (12). o+▁ (14) never gets its turn: o is taken first. */
	EXPECT_IDS(t, "Hello world", 0, 285, 290);
	EXPECT_IDS(t, "Hello world", TOK_ADD_BOS, 1, 285, 290);
	EXPECT_IDS(t, "Hello, world!", 0, 285, 273, 290, 274);
	/* "▁lll": l+l at positions 1 and 2 have the same rank; the leftmost goes first. */
	EXPECT_IDS(t, "lll", 0, 259, 281, 263);
	/* "▁the": ▁+t (0), h+e (1), ▁t+he (2). */
	EXPECT_IDS(t, "the", 0, 280);
	/* "▁athe": t+h (13) is left of h+e (1), but the lower rank goes first, leaving t alone. */
	EXPECT_IDS(t, "athe", 0, 259, 269, 261, 279);
	/* "ü" is not a piece: byte fallback to <0xC3> <0xBC>; é is a piece. */
	EXPECT_IDS(t, "H\xc3\xbc", 0, 282, 3 + 0xC3, 3 + 0xBC);
	EXPECT_IDS(t, "caf\xc3\xa9", 0, 259, 276, 269, 277, 275);
	EXPECT_IDS(t, "a\xf0\x9f\xa6\x99", 0, 259, 269, 3 + 0xF0, 3 + 0x9F, 3 + 0xA6, 3 + 0x99);
	/* "▁o▁x" (split false in both layouts): o+▁ (14) merges across the word boundary; x is a byte. */
	EXPECT_IDS(t, "o x", 0, 259, 292, 3 + 'x');
	/* an invalid byte goes through byte fallback too */
	EXPECT_IDS(t, "a\xff" "b", 0, 259, 269, 3 + 0xFF, 3 + 'b');
	/* special-token text as text: '<' and '>' are bytes */
	EXPECT_IDS(t, "<s>", TOK_SPECIAL_AS_TEXT, 259, 3 + '<', 272, 3 + '>');
	struct tok_ids ids = {0};
	ck_assert_int_eq(tokenizer_encode(t, "", 0, 0, &ids), 0);
	ck_assert_uint_eq(ids.n, 0);
	tok_ids_free(&ids);

	/* Decoding: ▁ -> space, bytes joined, one leading space stripped from the text. */
	EXPECT_DECODE(t, 0, "Hello world", 285, 290);
	EXPECT_DECODE(t, 0, "Hello, world!", 285, 273, 290, 274);
	EXPECT_DECODE(t, 0, "H\xc3\xbc", 282, 3 + 0xC3, 3 + 0xBC);
	EXPECT_DECODE(t, 0, "<s> Hello world</s>", 1, 285, 290, 2);
	EXPECT_DECODE(t, TOK_SKIP_SPECIAL, "Hello world", 1, 285, 290, 2);
	EXPECT_DECODE(t, 0, "  Hello", 259, 259, 285);
	EXPECT_DECODE(t, 0, "a\xef\xbf\xbd" "b", 259, 269, 3 + 0xFF, 3 + 'b');
	EXPECT_DECODE(t, TOK_DECODE_RAW, "a\xff" "b", 259, 269, 3 + 0xFF, 3 + 'b');
	ck_assert_int_eq(tokenizer_bos(t), 1);
	ck_assert_int_eq(tokenizer_eos(t), 2);
	ck_assert_uint_eq(tokenizer_vocab_size(t), 295);
	ck_assert_int_eq(tokenizer_token_to_id(t, "<0x0A>"), 3 + 0x0A);
	ck_assert_int_eq(tokenizer_token_to_id(t, "\xe2\x96\x81Hello"), 285);

	/* streaming: the first token's space is stripped, ü comes out with its second byte */
	static const uint32_t s_ids[] = {282, 3 + 0xC3, 3 + 0xBC, 290};
	static const char *const chunks[] = {"H", "", "\xc3\xbc", " world"};
	struct tok_decoder *d = tok_decoder_create(t, 0);
	const char *s;
	size_t len;
	for (size_t i = 0; i < ARRAY_SIZE(s_ids); i++) {
		ck_assert_int_eq(tok_decoder_feed(d, s_ids[i], &s, &len), 0);
		ck_assert_msg(len == strlen(chunks[i]) && !memcmp(s, chunks[i], len), "id %u: want '%s', got '%.*s'",
			      s_ids[i], chunks[i], (int)len, s);
	}
	ck_assert_int_eq(tok_decoder_flush(d, &s, &len), 0);
	/* after a flush the next sequence is stripped again */
	ck_assert_int_eq(tok_decoder_feed(d, 290, &s, &len), 0);
	ck_assert_msg(len == 5 && !memcmp(s, "world", 5), "got '%.*s'", (int)len, s);
	ck_assert_int_eq(tok_decoder_feed(d, 296, &s, &len), -EINVAL);
	tok_decoder_destroy(&d);
}

START_TEST(test_sp_legacy)
{
	struct tokenizer *t = load_ok(SP_LEGACY_JSON);
	sp_common_cases(t);
	/* The legacy normalizer prepends ▁ to every stretch of text, also one that starts with a
	 * space ("▁▁▁Hello") and one that follows an added token. */
	EXPECT_IDS(t, "  Hello", 0, 259, 259, 285);
	EXPECT_IDS(t, "<s>Hello</s>", 0, 1, 285, 2);
	EXPECT_IDS(t, "Hello<s>", 0, 285, 1);
	/* Round trips: whatever the text, with special-token text taken as text (a parsed <s> gains
	 * the ▁ that the normalizer adds after it); invalid bytes come back raw. */
	static char buf[16 * 40 + 1];
	rng_state = 5;
	for (int i = 0; i < 1500; i++) {
		size_t n = random_text(buf, 40, false);
		expect_round_trip(t, buf, n, TOK_SPECIAL_AS_TEXT, 0);
		if (n && i % 3 == 0)
			buf[rnd((uint32_t)n)] = (char)(0x80 + rnd(0x80));
		expect_round_trip(t, buf, n, TOK_SPECIAL_AS_TEXT, TOK_DECODE_RAW);
	}
	tokenizer_destroy(&t);
	tokenizer_destroy(&t);
}
END_TEST

START_TEST(test_sp_metaspace)
{
	struct tokenizer *t = load_ok(SP_META_JSON);
	sp_common_cases(t);
	/* prepend_scheme "first": "  Hello" already starts with ▁ after the spaces are replaced
	 * ("▁▁Hello"), and text after an added token gets no ▁: "Hello" there is H ell o. */
	EXPECT_IDS(t, "  Hello", 0, 259, 285);
	EXPECT_IDS(t, "<s>Hello</s>", 0, 1, 265, 283, 264, 2);
	EXPECT_DECODE(t, 0, "<s>Hello</s>", 1, 265, 283, 264, 2);
	/* so a leading space does not survive (as with Hugging Face), other text does */
	EXPECT_DECODE(t, 0, " Hello", 259, 285);
	static char buf[16 * 40 + 1];
	rng_state = 6;
	for (int i = 0; i < 1500; i++) {
		size_t n = random_text(buf, 40, false);
		if (n && buf[0] == ' ')
			buf[0] = 'x';
		expect_round_trip(t, buf, n, TOK_SPECIAL_AS_TEXT, 0);
		expect_round_trip(t, buf, n, 0, 0);
	}
	tokenizer_destroy(&t);
}
END_TEST

START_TEST(test_sp_hf_vectors)
{
	struct tokenizer *t = load_ok(SP_LEGACY_JSON);
	check_hf_vectors(t, TOK_TEST_FIXTURE_DIR "/hf-vectors/sp-legacy.json");
	tokenizer_destroy(&t);
	t = load_ok(SP_META_JSON);
	check_hf_vectors(t, TOK_TEST_FIXTURE_DIR "/hf-vectors/sp-metaspace.json");
	tokenizer_destroy(&t);
}
END_TEST

START_TEST(test_sp_variants)
{
	char err[512];
	struct tokenizer *t;
	/* merges as ["a", "b"] pairs, as newer files write them: the same encodings */
	json_t *doc = json_of(SP_LEGACY_JSON);
	json_t *merges = json_object_get(json_object_get(doc, "model"), "merges"), *pairs = json_array();
	for (size_t i = 0; i < json_array_size(merges); i++) {
		const char *m = json_string_value(json_array_get(merges, i)), *sp = strchr(m, ' ');
		json_array_append_new(pairs, json_pack("[s#s]", m, (int)(sp - m), sp + 1));
	}
	json_object_set_new(json_object_get(doc, "model"), "merges", pairs);
	t = load_doc_ok(doc);
	sp_common_cases(t);
	tokenizer_destroy(&t);

	/* without byte fallback unknown characters are <unk>, consecutive ones fused ... */
	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(json_object_get(doc, "model"), "byte_fallback", json_false());
	t = load_doc_ok(doc);
	EXPECT_IDS(t, "H\xc3\xbc\xf0\x9f\xa6\x99!", 0, 282, 0, 274);
	EXPECT_IDS(t, "a\xff" "b", 0, 259, 269, 0);
	tokenizer_destroy(&t);
	/* ... or not */
	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(json_object_get(doc, "model"), "byte_fallback", json_false());
	json_object_set_new(json_object_get(doc, "model"), "fuse_unk", json_false());
	t = load_doc_ok(doc);
	EXPECT_IDS(t, "H\xc3\xbc\xf0\x9f\xa6\x99!", 0, 282, 0, 0, 274);
	tokenizer_destroy(&t);
	/* and with no unk_token either, a character nothing can spell is an error, not a loss */
	doc = json_of(SP_LEGACY_JSON);
	json_object_set_new(json_object_get(doc, "model"), "byte_fallback", json_false());
	json_object_set_new(json_object_get(doc, "model"), "unk_token", json_null());
	t = load_doc_ok(doc);
	struct tok_ids ids = {0};
	ck_assert_int_eq(tokenizer_encode(t, "Hello", 5, 0, &ids), 0);
	ck_assert_uint_eq(ids.n, 1);
	ck_assert_int_eq(tokenizer_encode(t, "H\xc3\xbc", 3, 0, &ids), -EILSEQ);
	ck_assert_uint_eq(ids.n, 1); /* unchanged on failure */
	tok_ids_free(&ids);
	tokenizer_destroy(&t);

	/* Metaspace with split true: "▁o▁x" is two pre-tokens, so o+▁ cannot merge. */
	doc = json_of(SP_META_JSON);
	json_object_set_new(json_object_get(doc, "pre_tokenizer"), "split", json_true());
	t = load_doc_ok(doc);
	EXPECT_IDS(t, "o x", 0, 259, 264, 259, 3 + 'x');
	EXPECT_IDS(t, "Hello world", 0, 285, 290);
	tokenizer_destroy(&t);
	/* prepend_scheme always: text after an added token gets its ▁ as in the legacy layout */
	doc = json_of(SP_META_JSON);
	json_object_set_new(json_object_get(doc, "pre_tokenizer"), "prepend_scheme", json_string("always"));
	t = load_doc_ok(doc);
	EXPECT_IDS(t, "<s>Hello", 0, 1, 285);
	tokenizer_destroy(&t);
	/* the older add_prefix_space false: never */
	doc = json_of(SP_META_JSON);
	json_object_del(json_object_get(doc, "pre_tokenizer"), "prepend_scheme");
	json_object_set_new(json_object_get(doc, "pre_tokenizer"), "add_prefix_space", json_false());
	t = load_doc_ok(doc);
	EXPECT_IDS(t, "Hello", 0, 265, 283, 264);
	tokenizer_destroy(&t);

	/* a Metaspace decoder: the first token loses its ▁, the others' become spaces; bytes are
	 * not joined (it has no ByteFallback step) */
	doc = json_of(SP_META_JSON);
	json_object_set_new(doc, "decoder",
			    json_pack("{s:s, s:s, s:s, s:b}", "type", "Metaspace", "replacement", "\xe2\x96\x81",
				      "prepend_scheme", "first", "split", 0));
	t = load_doc_ok(doc);
	EXPECT_DECODE(t, 0, "Hello world", 285, 290);
	EXPECT_DECODE(t, 0, "Hello  world", 285, 259, 290);
	EXPECT_DECODE(t, 0, "<s> Hello", 1, 285);
	EXPECT_DECODE(t, 0, "a<0x0A>", 259, 269, 3 + 0x0A);
	tokenizer_destroy(&t);

	/* added tokens: a gap in the ids, a non-special added token (still split out with
	 * TOK_SPECIAL_AS_TEXT), rstrip and lstrip */
	doc = json_of(SP_LEGACY_JSON);
	json_t *added = json_object_get(doc, "added_tokens");
	json_array_append_new(added, json_pack("{s:i, s:s, s:b, s:b, s:b, s:b}", "id", 300, "content", "<tool>",
					       "special", 0, "lstrip", 1, "rstrip", 1, "single_word", 0));
	json_array_append_new(added, json_pack("{s:i, s:s, s:b, s:b}", "id", 301, "content", "the", "special", 1,
					       "single_word", 1));
	t = load_doc_ok(doc);
	ck_assert_uint_eq(tokenizer_vocab_size(t), 302);
	ck_assert_ptr_null(tokenizer_id_to_piece(t, 297, NULL));
	ck_assert_int_eq(tokenizer_decode(t, (const uint32_t[]){285, 297}, 2, 0, &(char *){NULL}, &(size_t){0}),
			 -EINVAL);
	EXPECT_IDS(t, "Hello  <tool>  world", 0, 285, 300, 290);
	EXPECT_IDS(t, "Hello <tool>world", TOK_SPECIAL_AS_TEXT, 285, 300, 290);
	/* single_word: "the" alone is the added token; inside "athe" it is not */
	EXPECT_IDS(t, "the", 0, 301);
	EXPECT_IDS(t, "athe", 0, 259, 269, 261, 279);
	EXPECT_IDS(t, "the", TOK_SPECIAL_AS_TEXT, 280);
	ck_assert_int_eq(tokenizer_token_to_id(t, "<tool>"), 300);
	ck_assert(!tokenizer_is_special(t, 300));
	tokenizer_destroy(&t);

	/* loading a checkpoint directory finds its tokenizer.json */
	t = load_ok(TOK_TEST_FIXTURE_DIR "/sp-legacy");
	EXPECT_IDS(t, "Hello world", 0, 285, 290);
	tokenizer_destroy(&t);
	(void)err;
}
END_TEST

/* A byte-level fixture built here: the 256 mapped bytes, "Hello", "Ġworld", and a merge o+Ġ
 * ranked first that only a missing split would let through. */
static json_t *byte_level_doc(bool use_regex)
{
	json_t *vocab = json_object();
	unsigned next = 256, id = 0;
	for (unsigned b = 0; b < 256; b++) {
		bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
		char s[8] = {0};
		put_cp(s, keep ? b : next++);
		json_object_set_new(vocab, s, json_integer(id++));
	}
	static const char *const merges[][2] = {
		{"o", "\xc4\xa0"}, {"H", "e"}, {"l", "l"}, {"He", "ll"}, {"Hell", "o"}, {"\xc4\xa0", "w"}, {"o", "r"},
		{"\xc4\xa0w", "or"}, {"\xc4\xa0wor", "l"}, {"\xc4\xa0worl", "d"},
	};
	json_t *list = json_array();
	for (size_t i = 0; i < ARRAY_SIZE(merges); i++) {
		char joined[32];
		snprintf(joined, sizeof(joined), "%s%s", merges[i][0], merges[i][1]);
		json_object_set_new(vocab, joined, json_integer(id++));
		json_array_append_new(list, json_pack("[ss]", merges[i][0], merges[i][1]));
	}
	return json_pack("{s:o, s:{s:s, s:b, s:b}, s:{s:s}, s:{s:s, s:o, s:o}}", "added_tokens", json_array(),
			 "pre_tokenizer", "type", "ByteLevel", "add_prefix_space", 0, "use_regex", use_regex, "decoder",
			 "type", "ByteLevel", "model", "type", "BPE", "vocab", vocab, "merges", list);
}

START_TEST(test_byte_level_gpt2)
{
	/* ids: bytes 0..255 by byte value, then the merges: oĠ 256, He 257, ll 258, Hell 259,
	 * Hello 260, Ġw 261, or 262, Ġwor 263, Ġworl 264, Ġworld 265 */
	struct tokenizer *t = load_doc_ok(byte_level_doc(true));
	/* GPT-2 split: "Hello" | " world"; o+Ġ never sees its pair */
	EXPECT_IDS(t, "Hello world", 0, 260, 265);
	EXPECT_DECODE(t, 0, "Hello world", 260, 265);
	expect_round_trip(t, "Hello  world\n\n\xff x", 17, 0, TOK_DECODE_RAW);
	ck_assert_int_eq(tokenizer_bos(t), -1);
	struct tok_ids ids = {0};
	ck_assert_int_eq(tokenizer_encode(t, "x", 1, TOK_ADD_BOS, &ids), -ENOENT);
	tok_ids_free(&ids);
	tokenizer_destroy(&t);
	/* Without the split the whole text is one word and o+Ġ (rank 0) goes first. */
	t = load_doc_ok(byte_level_doc(false));
	EXPECT_IDS(t, "Hello world", 0, 259, 256, 'w', 262, 'l', 'd');
	tokenizer_destroy(&t);
	/* A Split by a literal ({"String": " "}): the spaces are pre-tokens of their own. */
	json_t *doc = byte_level_doc(false);
	json_object_set_new(doc, "pre_tokenizer",
			    json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s, s:b, s:b}]}", "type", "Sequence",
				      "pretokenizers", "type", "Split", "pattern", "String", " ", "behavior", "Isolated",
				      "type", "ByteLevel", "add_prefix_space", 0, "use_regex", 0));
	t = load_doc_ok(doc);
	EXPECT_IDS(t, "Hello world", 0, 260, ' ', 'w', 262, 'l', 'd');
	tokenizer_destroy(&t);
	/* Byte fallback in a byte-level file: a byte whose mapped character (space: U+0120) is not in
	 * the vocab falls back to that character's two UTF-8 bytes, more symbols than input bytes. */
	t = load_doc_ok(json_pack("{s:{s:s}, s:{s:s, s:b, s:{s:i, s:i, s:i}, s:[]}}", "pre_tokenizer", "type",
				  "ByteLevel", "model", "type", "BPE", "byte_fallback", 1, "vocab", "a", 0, "<0xC4>", 1,
				  "<0xA0>", 2, "merges"));
	EXPECT_IDS(t, "a  a", 0, 1, 2, 0, 1, 2, 1, 2, 0);
	tokenizer_destroy(&t);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("tokenizer_sp");
	TCase *tc = tcase_create("sentencepiece");
	tcase_add_checked_fixture(tc, tmp_setup, tmp_teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_sp_legacy);
	tcase_add_test(tc, test_sp_metaspace);
	tcase_add_test(tc, test_sp_hf_vectors);
	tcase_add_test(tc, test_sp_variants);
	tcase_add_test(tc, test_byte_level_gpt2);
	suite_add_tcase(s, tc);
	return th_run(s);
}

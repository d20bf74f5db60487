/* test_tokenizer.c - common/tokenizer/ against the Llama 3 tokenizer.json and llama.cpp's test
 * vectors for it, the SentencePiece-style fixtures (data/sp-*, written by make_sp_fixtures.py,
 * expectations worked out by hand below), variants of both made by editing the JSON, round
 * trips over random text, the streaming decoder, invalid UTF-8 and bad files; and vectors that
 * Hugging Face tokenizers itself produced for all three files (data/hf-vectors).
 *
 * The Llama 3 tokenizer is loaded once per tcase in the parent (an unchecked fixture) and
 * inherited by each forked test. Variant files go to a mkdtemp() directory per test. */
#include <check.h>
#include <errno.h>
#include <ftw.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/tokenizer/tokenizer.h"
#include "common/util.h"

#ifndef TOK_TEST_LLAMA3_DIR
#error "TOK_TEST_LLAMA3_DIR must name tests/data/llama3-tokenizer"
#endif
#ifndef TOK_TEST_FIXTURE_DIR
#error "TOK_TEST_FIXTURE_DIR must name tests/unit/tokenizer/data"
#endif

#define LLAMA3_JSON	TOK_TEST_LLAMA3_DIR "/tokenizer.json"
#define SP_LEGACY_JSON	TOK_TEST_FIXTURE_DIR "/sp-legacy/tokenizer.json"
#define SP_META_JSON	TOK_TEST_FIXTURE_DIR "/sp-metaspace/tokenizer.json"

/* Like ck_assert_msg for loops: only calls into Check on failure (a passing ck_assert costs a
 * write in fork mode). */
#define CHECK(cond, ...)                            \
	do {                                        \
		if (!(cond))                        \
			ck_abort_msg(__VA_ARGS__);  \
	} while (0)

/* ---- helpers ---- */

static struct tokenizer *llama3; /* loaded by the parent for the tcases that need it */
static char tmp_root[64];	 /* per test */

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

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)flag;
	(void)ftw;
	return remove(path);
}

static void tmp_setup(void)
{
	snprintf(tmp_root, sizeof(tmp_root), "/tmp/test-tokenizer-XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(tmp_root));
}

static void tmp_teardown(void)
{
	nftw(tmp_root, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static char *read_all(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	ck_assert_msg(f != NULL, "cannot open %s: %s", path, strerror(errno));
	size_t cap = 1 << 16, n = 0;
	char *buf = malloc(cap);
	ck_assert_ptr_nonnull(buf);
	for (;;) {
		if (n + 1 >= cap) {
			cap *= 2;
			buf = realloc(buf, cap);
			ck_assert_ptr_nonnull(buf);
		}
		size_t r = fread(buf + n, 1, cap - n - 1, f);
		if (!r)
			break;
		n += r;
	}
	fclose(f);
	buf[n] = 0;
	*len = n;
	return buf;
}

static struct tokenizer *load_ok(const char *path)
{
	char err[512];
	struct tokenizer *t = NULL;
	int rc = tokenizer_load(path, &t, err, sizeof(err));
	ck_assert_msg(rc == 0, "loading %s: %d %s", path, rc, err);
	return t;
}

static json_t *json_of(const char *path)
{
	json_error_t jerr;
	json_t *j = json_load_file(path, 0, &jerr);
	ck_assert_msg(j != NULL, "%s: %s", path, jerr.text);
	return j;
}

/* Writes text to a file of this test's directory; returns its path (static, one of 8). */
static const char *write_text(const char *text, size_t len)
{
	static char paths[8][128];
	static int k;
	char *p = paths[k++ % 8];
	snprintf(p, 128, "%s/t%d.json", tmp_root, k);
	FILE *f = fopen(p, "wb");
	ck_assert_ptr_nonnull(f);
	ck_assert_uint_eq(fwrite(text, 1, len, f), len);
	ck_assert_int_eq(fclose(f), 0);
	return p;
}

/* Dumps doc (which it consumes) to a file and loads it: rc, *t, err as tokenizer_load. */
static int load_doc(json_t *doc, struct tokenizer **t, char *err, size_t errlen)
{
	char *text = json_dumps(doc, JSON_COMPACT | JSON_ENSURE_ASCII);
	ck_assert_ptr_nonnull(text);
	json_decref(doc);
	const char *path = write_text(text, strlen(text));
	free(text);
	*t = NULL;
	err[0] = 0;
	return tokenizer_load(path, t, err, errlen);
}

static struct tokenizer *load_doc_ok(json_t *doc)
{
	char err[512];
	struct tokenizer *t;
	int rc = load_doc(doc, &t, err, sizeof(err));
	ck_assert_msg(rc == 0, "loading a variant: %d %s", rc, err);
	return t;
}

/* Expects doc to fail with rc and a message holding word. */
static void expect_bad(json_t *doc, int rc_want, const char *word)
{
	char err[512];
	struct tokenizer *t;
	int rc = load_doc(doc, &t, err, sizeof(err));
	ck_assert_msg(rc == rc_want, "want %d (%s), got %d: %s", rc_want, word, rc, err);
	ck_assert_ptr_null(t);
	ck_assert_msg(strstr(err, word) != NULL, "message '%s' does not mention '%s'", err, word);
	ck_assert_msg(strstr(err, tmp_root) != NULL, "message '%s' does not name the file", err);
}

static char *ids_text(const uint32_t *ids, size_t n)
{
	size_t cap = 16 + 12 * n, len = 0;
	char *s = malloc(cap);
	ck_assert_ptr_nonnull(s);
	s[0] = 0;
	for (size_t i = 0; i < n; i++)
		len += (size_t)snprintf(s + len, cap - len, " %u", ids[i]);
	return s;
}

static void expect_ids_n(const struct tokenizer *t, const char *text, size_t len, unsigned flags,
			 const uint32_t *want, size_t n_want)
{
	struct tok_ids ids = {0};
	int rc = tokenizer_encode(t, text, len, flags, &ids);
	ck_assert_msg(rc == 0, "encode '%.*s': %d", (int)len, text, rc);
	char *got = ids_text(ids.ids, ids.n), *exp = ids_text(want, n_want);
	ck_assert_msg(!strcmp(got, exp), "encode '%.*s' (flags %u): want%s, got%s", (int)len, text, flags, exp, got);
	free(got);
	free(exp);
	tok_ids_free(&ids);
}

#define EXPECT_IDS(t, text, flags, ...)                                                     \
	do {                                                                                \
		const uint32_t want_[] = {__VA_ARGS__};                                     \
		expect_ids_n((t), (text), strlen(text), (flags), want_, ARRAY_SIZE(want_)); \
	} while (0)

/* decode(ids) as a malloc'd string, checked to succeed. */
static char *decode_ok(const struct tokenizer *t, const uint32_t *ids, size_t n, unsigned flags, size_t *len)
{
	char *out = NULL;
	size_t l = 0;
	int rc = tokenizer_decode(t, ids, n, flags, &out, &l);
	ck_assert_msg(rc == 0, "decode: %d", rc);
	ck_assert_ptr_nonnull(out);
	ck_assert_int_eq(out[l], 0);
	if (len)
		*len = l;
	return out;
}

static void expect_decode(const struct tokenizer *t, const uint32_t *ids, size_t n, unsigned flags,
			  const char *want, size_t want_len)
{
	size_t len;
	char *got = decode_ok(t, ids, n, flags, &len);
	ck_assert_msg(len == want_len && !memcmp(got, want, len), "decode (flags %u): want '%.*s', got '%.*s'",
		      flags, (int)want_len, want, (int)len, got);
	free(got);
}

#define EXPECT_DECODE(t, flags, want, ...)                                                    \
	do {                                                                                  \
		const uint32_t ids_[] = {__VA_ARGS__};                                        \
		expect_decode((t), ids_, ARRAY_SIZE(ids_), (flags), (want), sizeof(want) - 1); \
	} while (0)

/* encode then decode equals the text (flags for each side). */
static void expect_round_trip(const struct tokenizer *t, const char *text, size_t len, unsigned enc_flags,
			      unsigned dec_flags)
{
	struct tok_ids ids = {0};
	int rc = tokenizer_encode(t, text, len, enc_flags, &ids);
	CHECK(rc == 0, "encode of %zu bytes: %d", len, rc);
	size_t dl;
	char *back = decode_ok(t, ids.ids, ids.n, dec_flags, &dl);
	if (dl != len || memcmp(back, text, len)) {
		char *got = ids_text(ids.ids, ids.n);
		ck_abort_msg("round trip of '%.*s' (%zu bytes) gave '%.*s' (%zu bytes) via%s", (int)len, text, len,
			     (int)dl, back, dl, got);
	}
	free(back);
	tok_ids_free(&ids);
}

static bool valid_utf8(const char *s, size_t n)
{
	/* The checks of utf8_unit, restated independently: well-formed sequences only. */
	const unsigned char *u = (const unsigned char *)s;
	for (size_t i = 0; i < n;) {
		unsigned c = u[i], need, lo = 0x80, hi = 0xBF;
		if (c < 0x80) {
			i++;
			continue;
		}
		if (c >= 0xC2 && c <= 0xDF)
			need = 1;
		else if (c == 0xE0)
			need = 2, lo = 0xA0;
		else if (c == 0xED)
			need = 2, hi = 0x9F;
		else if (c >= 0xE1 && c <= 0xEF)
			need = 2;
		else if (c == 0xF0)
			need = 3, lo = 0x90;
		else if (c == 0xF4)
			need = 3, hi = 0x8F;
		else if (c >= 0xF1 && c <= 0xF3)
			need = 3;
		else
			return false;
		if (i + need >= n)
			return false;
		for (unsigned k = 1; k <= need; k++) {
			unsigned b = u[i + k];
			if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF))
				return false;
		}
		i += need + 1;
	}
	return true;
}

/* A deterministic generator (xorshift64*), so a failure reproduces. */
static uint64_t rng_state;

static uint32_t rnd(uint32_t n)
{
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 33) % n;
}

static size_t put_cp(char *out, uint32_t cp)
{
	unsigned char *o = (unsigned char *)out;
	if (cp < 0x80) {
		o[0] = (unsigned char)cp;
		return 1;
	}
	if (cp < 0x800) {
		o[0] = (unsigned char)(0xC0 | (cp >> 6));
		o[1] = (unsigned char)(0x80 | (cp & 0x3F));
		return 2;
	}
	if (cp < 0x10000) {
		o[0] = (unsigned char)(0xE0 | (cp >> 12));
		o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
		o[2] = (unsigned char)(0x80 | (cp & 0x3F));
		return 3;
	}
	o[0] = (unsigned char)(0xF0 | (cp >> 18));
	o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
	o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
	o[3] = (unsigned char)(0x80 | (cp & 0x3F));
	return 4;
}

/* Random valid UTF-8 of up to max_units pieces into buf (room for 16 * max_units + 1 bytes):
 * words, runs of spaces and newlines, digits, punctuation, accents, CJK, emoji, other scripts
 * with combining marks, the rarer white space, and now and then any valid code point. With
 * specials, now and then a special token's text. */
static size_t random_text(char *buf, unsigned max_units, bool specials)
{
	static const char *const words[] = {"the", "Hello", "world", "don't", "I'm", "we'LL", "a", "cpp", "x_y"};
	static const char *const punct[] = {".", ",", "!", "?", "...", "'", "\"", "(", ")", "-", "--", "#", "@"};
	static const char *const specials_text[] = {"<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>"};
	size_t n = 0;
	unsigned units = rnd(max_units + 1);
	for (unsigned u = 0; u < units; u++) {
		const char *w;
		switch (rnd(14)) {
		case 0:
		case 1:
			w = words[rnd(ARRAY_SIZE(words))];
			memcpy(buf + n, w, strlen(w));
			n += strlen(w);
			break;
		case 2:
		case 3:
			for (unsigned k = 1 + rnd(3); k; k--)
				buf[n++] = ' ';
			break;
		case 4:
			for (unsigned k = 1 + rnd(2); k; k--)
				buf[n++] = rnd(4) ? '\n' : rnd(2) ? '\t' : '\r';
			break;
		case 5:
			for (unsigned k = 1 + rnd(6); k; k--)
				buf[n++] = (char)('0' + rnd(10));
			break;
		case 6:
			w = punct[rnd(ARRAY_SIZE(punct))];
			memcpy(buf + n, w, strlen(w));
			n += strlen(w);
			break;
		case 7: {
			static const uint32_t acc[] = {0xE9, 0xFC, 0xF1, 0xE7, 0xC5, 0xDF, 0x153, 0x131};
			n += put_cp(buf + n, acc[rnd(ARRAY_SIZE(acc))]);
			break;
		}
		case 8:
			n += put_cp(buf + n, 0x4E00 + rnd(0x5200)); /* CJK */
			break;
		case 9: {
			static const uint32_t emo[] = {0x1F999, 0x1F600, 0x1F44D, 0x2764, 0x1F1FA, 0x1F3FD, 0x200D};
			n += put_cp(buf + n, emo[rnd(ARRAY_SIZE(emo))]);
			break;
		}
		case 10: {
			/* Cyrillic, Arabic, Devanagari (with a combining sign), Hangul, Greek */
			static const uint32_t base[] = {0x430, 0x627, 0x915, 0xAC00, 0x3B1};
			n += put_cp(buf + n, base[rnd(ARRAY_SIZE(base))] + rnd(20));
			if (!rnd(3))
				n += put_cp(buf + n, 0x94D);
			break;
		}
		case 11: {
			static const uint32_t ws[] = {0xA0, 0x3000, 0x85, 0x2028, 0x180E, 0x200B, 0x0B, 0x0C};
			n += put_cp(buf + n, ws[rnd(ARRAY_SIZE(ws))]);
			break;
		}
		case 12: {
			uint32_t cp = 1 + rnd(0x10FFFF);
			if (cp >= 0xD800 && cp < 0xE000)
				cp -= 0x800;
			n += put_cp(buf + n, cp);
			break;
		}
		default:
			if (specials) {
				w = specials_text[rnd(ARRAY_SIZE(specials_text))];
				memcpy(buf + n, w, strlen(w));
				n += strlen(w);
			} else {
				buf[n++] = (char)('a' + rnd(26));
			}
			break;
		}
	}
	buf[n] = 0;
	return n;
}

/* Checks t against vectors made by Hugging Face tokenizers 0.23.2 (data/hf-vectors, see
 * make_hf_vectors.js there): each text's ids, and the text those ids decode to with and without
 * skipping special tokens. */
static void check_hf_vectors(const struct tokenizer *t, const char *path)
{
	json_t *cases = json_of(path);
	ck_assert_msg(json_array_size(cases) > 100, "%s: %zu cases", path, json_array_size(cases));
	for (size_t i = 0; i < json_array_size(cases); i++) {
		const json_t *c = json_array_get(cases, i), *jids = json_object_get(c, "ids");
		const json_t *text = json_object_get(c, "text");
		size_t n = json_array_size(jids);
		uint32_t *want = malloc(sizeof(*want) * (n + 1));
		ck_assert_ptr_nonnull(want);
		for (size_t k = 0; k < n; k++)
			want[k] = (uint32_t)json_integer_value(json_array_get(jids, k));
		struct tok_ids got = {0};
		CHECK(tokenizer_encode(t, json_string_value(text), json_string_length(text), 0, &got) == 0,
		      "%s case %zu: encode failed", path, i);
		if (got.n != n || memcmp(got.ids, want, n * sizeof(*want))) {
			char *g = ids_text(got.ids, got.n), *w = ids_text(want, n);
			ck_abort_msg("%s case %zu '%s': want%s, got%s", path, i, json_string_value(text), w, g);
		}
		static const char *const keys[] = {"dec", "dec_skip"};
		for (unsigned skip = 0; skip < 2; skip++) {
			const json_t *dec = json_object_get(c, keys[skip]);
			size_t len;
			char *back = decode_ok(t, want, n, skip ? TOK_SKIP_SPECIAL : 0, &len);
			CHECK(len == json_string_length(dec) && !memcmp(back, json_string_value(dec), len),
			      "%s case %zu: %s gives '%s', want '%s'", path, i, keys[skip], back, json_string_value(dec));
			free(back);
		}
		tok_ids_free(&got);
		free(want);
	}
	json_decref(cases);
}

/* ---- Llama 3: llama.cpp's vectors ---- */

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
		CHECK(valid_utf8(buf, n), "the generator made invalid UTF-8");
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
		CHECK(tok_decoder_feed(d, ids[i], &s, &len) == 0, "feed %u", ids[i]);
		CHECK(valid_utf8(s, len), "chunk %zu (id %u) is not whole UTF-8", i, ids[i]);
		CHECK(!memmem(s, len, "\xef\xbf\xbd", 3), "chunk %zu (id %u) has U+FFFD", i, ids[i]);
		CHECK(got + len <= want_len, "more output than the text");
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

/* ---- bad files ---- */

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

static Suite *tokenizer_suite(void)
{
	Suite *s = suite_create("tokenizer");
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

	tc = tcase_create("sentencepiece");
	tcase_add_checked_fixture(tc, tmp_setup, tmp_teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_sp_legacy);
	tcase_add_test(tc, test_sp_metaspace);
	tcase_add_test(tc, test_sp_hf_vectors);
	tcase_add_test(tc, test_sp_variants);
	tcase_add_test(tc, test_byte_level_gpt2);
	suite_add_tcase(s, tc);

	tc = tcase_create("bad_files");
	tcase_add_checked_fixture(tc, tmp_setup, tmp_teardown);
	tcase_add_test(tc, test_bad_files);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(tokenizer_suite());
	srunner_set_fork_status(sr, CK_FORK);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

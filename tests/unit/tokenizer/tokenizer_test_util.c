/* tokenizer_test_util.c - what the tokenizer's test programs share (tokenizer_test_util.h). */
#include "tests/unit/tokenizer/tokenizer_test_util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

char tmp_root[64];

void tmp_setup(void)
{
	snprintf(tmp_root, sizeof(tmp_root), "/tmp/test-tokenizer-XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(tmp_root));
}

void tmp_teardown(void)
{
	th_rmtree(tmp_root);
}

char *read_all(const char *path, size_t *len)
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

struct tokenizer *load_ok(const char *path)
{
	char err[512];
	struct tokenizer *t = NULL;
	int rc = tokenizer_load(path, &t, err, sizeof(err));
	ck_assert_msg(rc == 0, "loading %s: %d %s", path, rc, err);
	return t;
}

json_t *json_of(const char *path)
{
	json_error_t jerr;
	json_t *j = json_load_file(path, 0, &jerr);
	ck_assert_msg(j != NULL, "%s: %s", path, jerr.text);
	return j;
}

/* Writes text to a file of this test's directory; returns its path (static, one of 8). */
const char *write_text(const char *text, size_t len)
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
int load_doc(json_t *doc, struct tokenizer **t, char *err, size_t errlen)
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

struct tokenizer *load_doc_ok(json_t *doc)
{
	char err[512];
	struct tokenizer *t;
	int rc = load_doc(doc, &t, err, sizeof(err));
	ck_assert_msg(rc == 0, "loading a variant: %d %s", rc, err);
	return t;
}

/* Expects doc to fail with rc and a message holding word. */
void expect_bad(json_t *doc, int rc_want, const char *word)
{
	char err[512];
	struct tokenizer *t;
	int rc = load_doc(doc, &t, err, sizeof(err));
	ck_assert_msg(rc == rc_want, "want %d (%s), got %d: %s", rc_want, word, rc, err);
	ck_assert_ptr_null(t);
	ck_assert_msg(strstr(err, word) != NULL, "message '%s' does not mention '%s'", err, word);
	ck_assert_msg(strstr(err, tmp_root) != NULL, "message '%s' does not name the file", err);
}

char *ids_text(const uint32_t *ids, size_t n)
{
	size_t cap = 16 + 12 * n, len = 0;
	char *s = malloc(cap);
	ck_assert_ptr_nonnull(s);
	s[0] = 0;
	for (size_t i = 0; i < n; i++)
		len += (size_t)snprintf(s + len, cap - len, " %u", ids[i]);
	return s;
}

void expect_ids_n(const struct tokenizer *t, const char *text, size_t len, unsigned flags, const uint32_t *want,
		  size_t n_want)
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

/* decode(ids) as a malloc'd string, checked to succeed. */
char *decode_ok(const struct tokenizer *t, const uint32_t *ids, size_t n, unsigned flags, size_t *len)
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

void expect_decode(const struct tokenizer *t, const uint32_t *ids, size_t n, unsigned flags, const char *want,
		   size_t want_len)
{
	size_t len;
	char *got = decode_ok(t, ids, n, flags, &len);
	ck_assert_msg(len == want_len && !memcmp(got, want, len), "decode (flags %u): want '%.*s', got '%.*s'",
		      flags, (int)want_len, want, (int)len, got);
	free(got);
}

/* encode then decode equals the text (flags for each side). */
void expect_round_trip(const struct tokenizer *t, const char *text, size_t len, unsigned enc_flags,
		       unsigned dec_flags)
{
	struct tok_ids ids = {0};
	int rc = tokenizer_encode(t, text, len, enc_flags, &ids);
	TH_CHECK(rc == 0, "encode of %zu bytes: %d", len, rc);
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

bool valid_utf8(const char *s, size_t n)
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
uint64_t rng_state;

uint32_t rnd(uint32_t n)
{
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 33) % n;
}

size_t put_cp(char *out, uint32_t cp)
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
size_t random_text(char *buf, unsigned max_units, bool specials)
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
void check_hf_vectors(const struct tokenizer *t, const char *path)
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
		TH_CHECK(tokenizer_encode(t, json_string_value(text), json_string_length(text), 0, &got) == 0,
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
			TH_CHECK(len == json_string_length(dec) && !memcmp(back, json_string_value(dec), len),
			      "%s case %zu: %s gives '%s', want '%s'", path, i, keys[skip], back, json_string_value(dec));
			free(back);
		}
		tok_ids_free(&got);
		free(want);
	}
	json_decref(cases);
}

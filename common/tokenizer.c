/* tokenizer.c - Hugging Face tokenizer.json (BPE): loading, encoding, streaming decoding.
 *
 * Loading copies what encoding and decoding need out of the JSON document and drops the
 * document: every piece's text and decoded bytes in one arena, an open-addressing hash from
 * piece text to id, another from an id pair to its merge (rank and result), a byte trie of the
 * added tokens, and the normalizer, pre-tokenizer and decoder as short lists of steps.
 *
 * Encoding follows the Hugging Face pipeline: added tokens are split out of the raw text; each
 * stretch of text between them is normalized, then pre-tokenized by the steps in order (each
 * step cuts or rewrites the pieces the previous one produced; recursion instead of lists, so a
 * pre-token costs no allocation), and each pre-token goes through the BPE model: the whole
 * pre-token from the vocab where ignore_merges says so, else one symbol per character (per
 * byte in byte-level files) merged pair by pair, the lowest rank first and the leftmost among
 * equal ranks, with a binary heap of candidate pairs (n log n in the pre-token's length, so a
 * megabyte without a space is no worse than a megabyte of words).
 *
 * Decoding turns each id into the bytes its piece stands for (precomputed at load) and lets
 * the stream decoder hold back an incomplete UTF-8 sequence until the next piece completes it. */
#include "common/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pcre2.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

#define MAX_STEPS     8		    /* steps of a normalizer, pre-tokenizer or decoder Sequence */
#define MAX_FILE_SIZE (1ull << 30)  /* a tokenizer.json above this is not one */
#define BL_CODEPOINTS 324	    /* the byte-level mapping uses code points below this */
#define SYM_DEAD      (-2)	    /* sym.prev of a symbol merged into its left neighbour */

/* The GPT-2 split pattern, what a ByteLevel pre-tokenizer with use_regex uses. */
static const char gpt2_pattern[] =
	"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ---- small helpers ---- */

struct buf {
	char *p;
	size_t len, cap;
};

static int buf_reserve(struct buf *b, size_t extra)
{
	if (b->len + extra <= b->cap)
		return 0;
	size_t cap = b->cap ? b->cap : 64;
	while (cap < b->len + extra) {
		if (cap > SIZE_MAX / 2)
			return -ENOMEM;
		cap *= 2;
	}
	char *p = realloc(b->p, cap);
	if (!p)
		return -ENOMEM;
	b->p = p;
	b->cap = cap;
	return 0;
}

static int buf_put(struct buf *b, const void *p, size_t n)
{
	if (!n)
		return 0;
	int rc = buf_reserve(b, n);
	if (rc)
		return rc;
	memcpy(b->p + b->len, p, n);
	b->len += n;
	return 0;
}

static void buf_free(struct buf *b)
{
	free(b->p);
	memset(b, 0, sizeof(*b));
}

static bool has_prefix(const char *s, size_t n, const char *p, size_t pn)
{
	return n >= pn && memcmp(s, p, pn) == 0;
}

enum { U8_VALID, U8_INCOMPLETE, U8_INVALID };

/* Classifies the UTF-8 unit at s (n > 0 bytes available): U8_VALID with *len its length;
 * U8_INCOMPLETE when all n bytes are a proper prefix of a well-formed sequence (*len = n);
 * U8_INVALID with *len the length of the maximal subpart (Unicode table 3-7 ranges). */
static int utf8_unit(const uint8_t *s, size_t n, size_t *len)
{
	uint8_t c = s[0], lo = 0x80, hi = 0xBF;
	size_t need;
	if (c < 0x80) {
		*len = 1;
		return U8_VALID;
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
	else {
		*len = 1;
		return U8_INVALID;
	}
	for (size_t k = 1; k <= need; k++) {
		if (k >= n) {
			*len = n;
			return U8_INCOMPLETE;
		}
		uint8_t b = s[k];
		if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) {
			*len = k;
			return U8_INVALID;
		}
	}
	*len = need + 1;
	return U8_VALID;
}

/* The code point at s, or -1 for a byte that does not start a well-formed sequence; *len is
 * the unit's length (1 for an invalid byte). */
static int32_t utf8_cp(const uint8_t *s, size_t n, size_t *len)
{
	if (utf8_unit(s, n, len) != U8_VALID) {
		*len = 1;
		return -1;
	}
	switch (*len) {
	case 1:
		return s[0];
	case 2:
		return (int32_t)(((s[0] & 0x1Fu) << 6) | (s[1] & 0x3Fu));
	case 3:
		return (int32_t)(((s[0] & 0x0Fu) << 12) | ((s[1] & 0x3Fu) << 6) | (s[2] & 0x3Fu));
	default:
		return (int32_t)(((s[0] & 0x07u) << 18) | ((s[1] & 0x3Fu) << 12) | ((s[2] & 0x3Fu) << 6) |
				 (s[3] & 0x3Fu));
	}
}

/* The code point that ends at s + pos (pos > 0), with *len its length; -1 for an invalid byte. */
static int32_t utf8_cp_before(const uint8_t *s, size_t pos, size_t *len)
{
	size_t start = pos - 1;
	while (start > 0 && pos - start < 4 && (s[start] & 0xC0) == 0x80)
		start--;
	size_t ul;
	int32_t cp = utf8_cp(s + start, pos - start, &ul);
	if (cp >= 0 && start + ul == pos) {
		*len = ul;
		return cp;
	}
	*len = 1;
	return -1;
}

static size_t utf8_put(uint32_t cp, uint8_t *out)
{
	if (cp < 0x80) {
		out[0] = (uint8_t)cp;
		return 1;
	}
	if (cp < 0x800) {
		out[0] = (uint8_t)(0xC0 | (cp >> 6));
		out[1] = (uint8_t)(0x80 | (cp & 0x3F));
		return 2;
	}
	if (cp < 0x10000) {
		out[0] = (uint8_t)(0xE0 | (cp >> 12));
		out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
		out[2] = (uint8_t)(0x80 | (cp & 0x3F));
		return 3;
	}
	out[0] = (uint8_t)(0xF0 | (cp >> 18));
	out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
	out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
	out[3] = (uint8_t)(0x80 | (cp & 0x3F));
	return 4;
}

/* Unicode White_Space, what Rust's char::is_whitespace (and so lstrip/rstrip) uses. */
static bool is_white(int32_t cp)
{
	return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
	       (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
	       cp == 0x3000;
}

/* ---- the tokenizer ---- */

enum entry_kind {
	ENTRY_HOLE = 0,	 /* no piece has this id */
	ENTRY_VOCAB = 1, /* model.vocab */
	ENTRY_ADDED = 2, /* added_tokens (possibly also in the vocab, with the same text) */
};

struct entry {
	uint32_t off, len;	   /* the piece in the arena, NUL-terminated */
	uint32_t dec_off, dec_len; /* the bytes it decodes to, in the arena */
	uint8_t kind;		   /* enum entry_kind */
	uint8_t in_vocab;	   /* in model.vocab (an added token may be too) */
	uint8_t special;	   /* an added token marked "special" */
};

struct vocab_slot {
	uint32_t hash; /* low bits of the piece's FNV-1a */
	uint32_t id1;  /* id + 1; 0 is an empty slot */
};

struct merge_slot {
	uint64_t key;  /* (left + 1) << 32 | right; 0 is an empty slot */
	uint32_t rank; /* the merge's position in model.merges */
	uint32_t id;   /* the piece left + right */
};

struct added_token {
	uint32_t id;
	bool special, lstrip, rstrip, single_word;
};

struct trie_node {
	uint32_t child;	  /* first child, 0 for none (the root is nobody's child) */
	uint32_t sibling; /* next child of the same parent, 0 for none */
	int32_t added;	  /* index into added of the token ending here, -1 for none */
	uint8_t byte;
};

enum prepend_scheme { PREPEND_NEVER = 0, PREPEND_FIRST = 1, PREPEND_ALWAYS = 2 };

enum norm_kind { NORM_PREPEND = 1, NORM_REPLACE = 2 };

struct norm_step {
	enum norm_kind kind;
	char *from; /* REPLACE: the string replaced; PREPEND: the prefix */
	size_t from_len;
	char *to; /* REPLACE: its replacement */
	size_t to_len;
};

enum pretok_kind { PRETOK_SPLIT = 1, PRETOK_METASPACE = 2, PRETOK_BYTELEVEL = 3 };

struct pretok_step {
	enum pretok_kind kind;
	pcre2_code *re;	   /* SPLIT, and BYTELEVEL with use_regex; else NULL */
	bool prefix_space; /* BYTELEVEL add_prefix_space */
	char repl[8];	   /* METASPACE replacement character, UTF-8 */
	size_t repl_len;
	enum prepend_scheme prepend; /* METASPACE */
	bool split;		     /* METASPACE: cut before each replacement character */
};

enum dec_kind { DEC_BYTELEVEL = 1, DEC_REPLACE = 2, DEC_BYTEFALLBACK = 3, DEC_STRIP = 4, DEC_METASPACE = 5 };

/* A decoder step applied to each token on its own (Hugging Face applies the steps before Fuse to
 * each token; a Strip after Fuse works on the whole text and is kept apart, see strip_*). */
struct dec_step {
	enum dec_kind kind;
	char *from, *to; /* REPLACE; METASPACE: from is the replacement character */
	size_t from_len, to_len;
	char strip[8]; /* STRIP: the character, UTF-8 */
	size_t strip_len;
	unsigned start, stop;	     /* STRIP: at most this many at the start / end */
	enum prepend_scheme prepend; /* METASPACE */
};

struct tokenizer {
	uint32_t n_ids;		/* highest id + 1 */
	struct entry *entries;	/* n_ids, by id */
	char *arena;		/* pieces and decoded bytes */
	size_t arena_len;
	struct vocab_slot *vocab; /* piece -> id over model.vocab; vocab_mask + 1 slots */
	uint32_t vocab_mask;
	struct merge_slot *merges; /* (left, right) -> merge; merge_bits of size */
	unsigned merge_bits;
	struct added_token *added; /* n_added */
	uint32_t n_added;
	struct trie_node *trie; /* node 0 is the root */
	uint32_t n_trie, cap_trie;
	uint32_t root[256]; /* the root's child for each first byte (0: none): no sibling walk per byte */

	struct norm_step norm[MAX_STEPS];
	unsigned n_norm;
	struct pretok_step pretok[MAX_STEPS];
	unsigned n_pretok;
	struct dec_step dec[MAX_STEPS];
	unsigned n_dec;
	unsigned strip_start; /* decoder Strip after Fuse: leading strip_char to drop from the text */
	char strip_char[8];
	size_t strip_len;
	bool dec_first; /* a Metaspace decoder: the first token decodes differently */

	bool byte_level;    /* the model sees byte-level-mapped text (a ByteLevel pre-tokenizer step) */
	bool byte_fallback; /* unknown characters become <0xNN> pieces */
	bool fuse_unk;	    /* consecutive unknown characters make one unk */
	bool ignore_merges; /* a pre-token that is a whole piece is that piece */
	int32_t unk_id, bos_id, eos_id; /* -1: none */
	int32_t byte_id[256];	       /* byte-level: the id of each byte's mapped character, -1 if none */
	int32_t fallback_id[256];      /* the ids of <0x00> .. <0xFF>, -1 if none */
	uint8_t bl_utf8[256][2];       /* byte-level mapping of each byte, UTF-8 */
	uint8_t bl_len[256];
	int16_t bl_byte[BL_CODEPOINTS]; /* the inverse: code point -> byte, -1 */
	pcre2_code *word_re;		/* single_word: is a character a word character */
};

/* ---- lookups ---- */

static uint32_t hash_piece(const char *s, size_t n)
{
	return (uint32_t)fnv1a64(FNV64_INIT, s, n);
}

static const char *entry_piece(const struct tokenizer *t, uint32_t id)
{
	return t->arena + t->entries[id].off;
}

/* The vocab id of the piece s[0..n), or -1. */
static int32_t vocab_find(const struct tokenizer *t, const char *s, size_t n)
{
	uint32_t h = hash_piece(s, n);
	for (uint32_t i = h & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
		const struct vocab_slot *v = &t->vocab[i];
		if (!v->id1)
			return -1;
		if (v->hash != h)
			continue;
		const struct entry *e = &t->entries[v->id1 - 1];
		if (e->len == n && memcmp(t->arena + e->off, s, n) == 0)
			return (int32_t)(v->id1 - 1);
	}
}

static uint64_t merge_key(uint32_t left, uint32_t right)
{
	return ((uint64_t)left + 1) << 32 | right;
}

static uint64_t merge_slot_of(uint64_t key, unsigned bits)
{
	return (key * 0x9E3779B97F4A7C15ull) >> (64 - bits);
}

static const struct merge_slot *merge_find(const struct tokenizer *t, uint32_t left, uint32_t right)
{
	uint64_t key = merge_key(left, right), mask = (1ull << t->merge_bits) - 1;
	for (uint64_t i = merge_slot_of(key, t->merge_bits);; i = (i + 1) & mask) {
		const struct merge_slot *m = &t->merges[i];
		if (m->key == key)
			return m;
		if (!m->key)
			return NULL;
	}
}

static uint32_t trie_child(const struct tokenizer *t, uint32_t node, uint8_t b)
{
	if (node == 0)
		return t->root[b];
	for (uint32_t c = t->trie[node].child; c; c = t->trie[c].sibling)
		if (t->trie[c].byte == b)
			return c;
	return 0;
}

/* The added token whose content is exactly s, as an index into t->added, or -1. */
static int32_t added_find(const struct tokenizer *t, const char *s, size_t n)
{
	uint32_t node = 0;
	for (size_t i = 0; i < n; i++) {
		node = trie_child(t, node, (uint8_t)s[i]);
		if (!node)
			return -1;
	}
	return n ? t->trie[node].added : -1;
}

/* ---- loading ---- */

struct loader {
	const char *name; /* the file, for messages */
	char *err;
	size_t errlen;
	struct tokenizer *t;
	struct buf arena;
};

#define LERR(L, rc, ...) errorf((L)->err, (L)->errlen, (rc), __VA_ARGS__)

static const char *json_kind(const json_t *v)
{
	if (!v)
		return "missing";
	switch (json_typeof(v)) {
	case JSON_OBJECT:
		return "an object";
	case JSON_ARRAY:
		return "a list";
	case JSON_STRING:
		return "a string";
	case JSON_INTEGER:
		return "an integer";
	case JSON_REAL:
		return "a real number";
	case JSON_TRUE:
	case JSON_FALSE:
		return "a boolean";
	case JSON_NULL:
		return "null";
	}
	return "?";
}

/* A boolean field: absent or null leaves *out (the default). */
static int get_bool(struct loader *L, const json_t *obj, const char *where, const char *key, bool *out)
{
	const json_t *v = json_object_get(obj, key);
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_boolean(v))
		return LERR(L, -EINVAL, "%s: %s.%s must be a boolean, got %s", L->name, where, key, json_kind(v));
	*out = json_is_true(v);
	return 0;
}

/* A string field; required or NULL when absent or null. */
static int get_str(struct loader *L, const json_t *obj, const char *where, const char *key, bool required,
		   const char **out, size_t *len)
{
	const json_t *v = json_object_get(obj, key);
	*out = NULL;
	if (len)
		*len = 0;
	if (!v || json_is_null(v)) {
		if (required)
			return LERR(L, -EINVAL, "%s: %s.%s is missing", L->name, where, key);
		return 0;
	}
	if (!json_is_string(v))
		return LERR(L, -EINVAL, "%s: %s.%s must be a string, got %s", L->name, where, key, json_kind(v));
	*out = json_string_value(v);
	if (len)
		*len = json_string_length(v);
	return 0;
}

/* The "type" of a step object. */
static int get_type(struct loader *L, const json_t *obj, const char *where, const char **type)
{
	if (!json_is_object(obj))
		return LERR(L, -EINVAL, "%s: %s must be an object, got %s", L->name, where, json_kind(obj));
	return get_str(L, obj, where, "type", true, type, NULL);
}

/* The string of a {"String": s} pattern; -ENOTSUP for {"Regex": ...} where only a literal does. */
static int get_string_pattern(struct loader *L, const json_t *obj, const char *where, const char **s, size_t *n)
{
	const json_t *pat = json_object_get(obj, "pattern");
	if (!json_is_object(pat))
		return LERR(L, -EINVAL, "%s: %s.pattern must be an object like {\"String\": \" \"}, got %s", L->name,
			    where, json_kind(pat));
	if (json_object_get(pat, "Regex"))
		return LERR(L, -ENOTSUP, "%s: %s with a Regex pattern is not supported (String only)", L->name,
			    where);
	int rc = get_str(L, pat, where, "String", true, s, n);
	if (rc)
		return rc;
	if (!*n)
		return LERR(L, -EINVAL, "%s: %s.pattern.String is empty", L->name, where);
	return 0;
}

static char *dup_bytes(const char *s, size_t n)
{
	char *p = malloc(n + 1);
	if (p) {
		memcpy(p, s, n);
		p[n] = 0;
	}
	return p;
}

/* One character (the replacement of Metaspace, the content of Strip) into a small buffer. */
static int get_char(struct loader *L, const json_t *obj, const char *where, const char *key, const char *def,
		    char out[8], size_t *len)
{
	const char *s;
	size_t n, ul;
	int rc = get_str(L, obj, where, key, false, &s, &n);
	if (rc)
		return rc;
	if (!s) {
		s = def;
		n = strlen(def);
	}
	if (!n || utf8_unit((const uint8_t *)s, n, &ul) != U8_VALID || ul != n)
		return LERR(L, -EINVAL, "%s: %s.%s must be one character, got \"%s\"", L->name, where, key, s);
	memcpy(out, s, n);
	*len = n;
	return 0;
}

/* Metaspace's prepend_scheme, or the add_prefix_space of older files. */
static int get_prepend(struct loader *L, const json_t *obj, const char *where, enum prepend_scheme *out)
{
	const char *scheme;
	int rc = get_str(L, obj, where, "prepend_scheme", false, &scheme, NULL);
	if (rc)
		return rc;
	if (scheme) {
		if (!strcmp(scheme, "first"))
			*out = PREPEND_FIRST;
		else if (!strcmp(scheme, "always"))
			*out = PREPEND_ALWAYS;
		else if (!strcmp(scheme, "never"))
			*out = PREPEND_NEVER;
		else
			return LERR(L, -ENOTSUP, "%s: %s.prepend_scheme \"%s\" is not supported (first, always, never)",
				    L->name, where, scheme);
		return 0;
	}
	bool add = true;
	rc = get_bool(L, obj, where, "add_prefix_space", &add);
	*out = add ? PREPEND_ALWAYS : PREPEND_NEVER;
	return rc;
}

/* Unicode White_Space as a class body. */
#define WHITE_SPACE                                                                   \
	"\\x{09}-\\x{0d}\\x{20}\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}" \
	"\\x{205f}\\x{3000}"

/* Rewrites a split pattern for PCRE2. The engines behind Hugging Face (Oniguruma) and tiktoken
 * (Rust regex) take \s as Unicode White_Space; PCRE2's \s also matches U+180E (no longer white
 * space since Unicode 6.3), so \s is spelled out: [WHITE_SPACE] outside a class, WHITE_SPACE
 * inside one, and \S outside a class as [^WHITE_SPACE] (a \S inside a class stays as it is: a
 * class cannot hold a complement; it differs only on U+180E). Returns a malloc'd pattern or NULL. */
static char *translate_pattern(const char *p, size_t n, size_t *out_len)
{
	static const char white[] = WHITE_SPACE;
	const size_t wn = sizeof(white) - 1;
	char *out = malloc(n * (wn + 3) + 1);
	if (!out)
		return NULL;
	size_t o = 0;
	bool in_class = false;
	for (size_t i = 0; i < n; i++) {
		char c = p[i];
		if (c == '\\' && i + 1 < n) {
			char d = p[++i];
			if ((d == 's' && !in_class) || (d == 'S' && !in_class)) {
				memcpy(out + o, d == 's' ? "[" : "[^", d == 's' ? 1 : 2);
				o += d == 's' ? 1 : 2;
				memcpy(out + o, white, wn);
				o += wn;
				out[o++] = ']';
			} else if (d == 's') {
				memcpy(out + o, white, wn);
				o += wn;
			} else {
				out[o++] = c;
				out[o++] = d;
			}
			continue;
		}
		if (!in_class && c == '[') {
			in_class = true;
			out[o++] = c;
			/* A ']' right after '[' or '[^' is a literal, not the end of the class. */
			if (i + 1 < n && p[i + 1] == '^')
				out[o++] = p[++i];
			if (i + 1 < n && p[i + 1] == ']')
				out[o++] = p[++i];
			continue;
		}
		if (in_class && c == '[' && i + 1 < n && p[i + 1] == ':') {
			/* [:alpha:] inside a class: copy through its ":]" */
			const char *end = NULL;
			for (size_t k = i + 2; k + 1 < n; k++)
				if (p[k] == ':' && p[k + 1] == ']') {
					end = p + k + 2;
					break;
				}
			if (end) {
				size_t len = (size_t)(end - (p + i));
				memcpy(out + o, p + i, len);
				o += len;
				i += len - 1;
				continue;
			}
		}
		if (in_class && c == ']')
			in_class = false;
		out[o++] = c;
	}
	out[o] = 0;
	*out_len = o;
	return out;
}

/* Compiles a split pattern (a regex, or a literal string) with UTF and Unicode properties,
 * and JIT where the library has it (the interpreter runs it otherwise). */
static int compile_pattern(struct loader *L, const char *where, const char *pat, size_t n, bool literal,
			   pcre2_code **out)
{
	size_t tn = n;
	char *translated = literal ? NULL : translate_pattern(pat, n, &tn);
	if (!literal && !translated)
		return LERR(L, -ENOMEM, "%s: out of memory", L->name);
	int code;
	PCRE2_SIZE off;
	/* PCRE2_LITERAL refuses PCRE2_UCP (pcre2_compile fails with "invalid option bits"); a
	 * literal has no \w or \d for it to change anyway. \C (one code unit) could end a match
	 * inside a character, and matching on from there under PCRE2_NO_UTF_CHECK is undefined. */
	uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP | PCRE2_NEVER_BACKSLASH_C);
	pcre2_code *re = pcre2_compile((PCRE2_SPTR)(literal ? pat : translated), tn, opts, &code, &off, NULL);
	free(translated);
	if (!re) {
		PCRE2_UCHAR msg[256];
		pcre2_get_error_message(code, msg, sizeof(msg));
		if (code == PCRE2_ERROR_NOMEMORY)
			return LERR(L, -ENOMEM, "%s: out of memory compiling the %s pattern", L->name, where);
		/* off counts in the translated pattern: not shown, it would point at the wrong place */
		return LERR(L, -EINVAL, "%s: the %s pattern does not compile: %s (pattern \"%.*s\")", L->name, where,
			    (const char *)msg, (int)(n > 200 ? 200 : n), pat);
	}
	(void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* best effort: without JIT pcre2_match interprets */
	*out = re;
	return 0;
}

/* ---- normalizer ---- */

static int parse_normalizer(struct loader *L, const json_t *n, const char *where)
{
	struct tokenizer *t = L->t;
	const char *type;
	if (!n || json_is_null(n))
		return 0;
	int rc = get_type(L, n, where, &type);
	if (rc)
		return rc;
	if (!strcmp(type, "Sequence")) {
		const json_t *list = json_object_get(n, "normalizers");
		if (!json_is_array(list))
			return LERR(L, -EINVAL, "%s: %s.normalizers must be a list, got %s", L->name, where,
				    json_kind(list));
		for (size_t i = 0; i < json_array_size(list); i++) {
			char w[64];
			snprintf(w, sizeof(w), "%s.normalizers[%zu]", where, i);
			rc = parse_normalizer(L, json_array_get(list, i), w);
			if (rc)
				return rc;
		}
		return 0;
	}
	if (strcmp(type, "Prepend") && strcmp(type, "Replace"))
		return LERR(L, -ENOTSUP,
			    "%s: normalizer type %s is not supported (Prepend, Replace with a String pattern, or a "
			    "Sequence of them)",
			    L->name, type);
	if (t->n_norm == MAX_STEPS)
		return LERR(L, -ENOTSUP, "%s: the normalizer has more than %d steps", L->name, MAX_STEPS);
	struct norm_step *s = &t->norm[t->n_norm];
	const char *from, *to;
	size_t from_len, to_len;
	if (!strcmp(type, "Prepend")) {
		rc = get_str(L, n, where, "prepend", true, &from, &from_len);
		if (rc)
			return rc;
		s->kind = NORM_PREPEND;
		s->from = dup_bytes(from, from_len);
		s->from_len = from_len;
		if (!s->from)
			return LERR(L, -ENOMEM, "%s: out of memory", L->name);
	} else {
		rc = get_string_pattern(L, n, where, &from, &from_len);
		if (!rc)
			rc = get_str(L, n, where, "content", true, &to, &to_len);
		if (rc)
			return rc;
		s->kind = NORM_REPLACE;
		s->from = dup_bytes(from, from_len);
		s->to = dup_bytes(to, to_len);
		s->from_len = from_len;
		s->to_len = to_len;
		if (!s->from || !s->to) {
			free(s->from);
			free(s->to);
			return LERR(L, -ENOMEM, "%s: out of memory", L->name);
		}
	}
	t->n_norm++;
	return 0;
}

/* ---- pre-tokenizer ---- */

static int parse_pretok(struct loader *L, const json_t *p, const char *where)
{
	struct tokenizer *t = L->t;
	const char *type;
	if (!p || json_is_null(p))
		return 0;
	int rc = get_type(L, p, where, &type);
	if (rc)
		return rc;
	if (!strcmp(type, "Sequence")) {
		const json_t *list = json_object_get(p, "pretokenizers");
		if (!json_is_array(list))
			return LERR(L, -EINVAL, "%s: %s.pretokenizers must be a list, got %s", L->name, where,
				    json_kind(list));
		for (size_t i = 0; i < json_array_size(list); i++) {
			char w[64];
			snprintf(w, sizeof(w), "%s.pretokenizers[%zu]", where, i);
			rc = parse_pretok(L, json_array_get(list, i), w);
			if (rc)
				return rc;
		}
		return 0;
	}
	if (strcmp(type, "Split") && strcmp(type, "ByteLevel") && strcmp(type, "Metaspace"))
		return LERR(L, -ENOTSUP,
			    "%s: pre_tokenizer type %s is not supported (Split, ByteLevel, Metaspace, or a Sequence of "
			    "them)",
			    L->name, type);
	if (t->n_pretok == MAX_STEPS)
		return LERR(L, -ENOTSUP, "%s: the pre_tokenizer has more than %d steps", L->name, MAX_STEPS);
	if (t->byte_level)
		/* The byte-level mapping is applied as the model reads each pre-token, so nothing may
		 * come after it (nothing does in real files: regexes would not see the mapped text). */
		return LERR(L, -ENOTSUP, "%s: %s comes after a ByteLevel pre_tokenizer step (ByteLevel must be last)",
			    L->name, where);
	struct pretok_step *s = &t->pretok[t->n_pretok];
	memset(s, 0, sizeof(*s));
	if (!strcmp(type, "Split")) {
		const json_t *pat = json_object_get(p, "pattern");
		const char *behavior, *text;
		size_t n;
		bool invert = false, literal;
		rc = get_str(L, p, where, "behavior", true, &behavior, NULL);
		if (!rc)
			rc = get_bool(L, p, where, "invert", &invert);
		if (rc)
			return rc;
		if (strcmp(behavior, "Isolated"))
			return LERR(L, -ENOTSUP, "%s: %s behavior %s is not supported (Isolated only)", L->name, where,
				    behavior);
		if (invert)
			return LERR(L, -ENOTSUP, "%s: %s with invert true is not supported", L->name, where);
		if (!json_is_object(pat))
			return LERR(L, -EINVAL, "%s: %s.pattern must be an object like {\"Regex\": \"...\"}, got %s",
				    L->name, where, json_kind(pat));
		literal = json_object_get(pat, "Regex") == NULL;
		rc = get_str(L, pat, where, literal ? "String" : "Regex", true, &text, &n);
		if (rc)
			return rc;
		if (!n)
			return LERR(L, -EINVAL, "%s: %s.pattern is empty", L->name, where);
		s->kind = PRETOK_SPLIT;
		rc = compile_pattern(L, "pre_tokenizer Split", text, n, literal, &s->re);
		if (rc)
			return rc;
	} else if (!strcmp(type, "ByteLevel")) {
		bool use_regex = true, prefix = true;
		rc = get_bool(L, p, where, "use_regex", &use_regex);
		if (!rc)
			rc = get_bool(L, p, where, "add_prefix_space", &prefix);
		if (rc)
			return rc;
		s->kind = PRETOK_BYTELEVEL;
		s->prefix_space = prefix;
		if (use_regex) {
			rc = compile_pattern(L, "ByteLevel (GPT-2)", gpt2_pattern, strlen(gpt2_pattern), false, &s->re);
			if (rc)
				return rc;
		}
		t->byte_level = true;
	} else {
		bool split = true;
		s->kind = PRETOK_METASPACE;
		rc = get_char(L, p, where, "replacement", "\xe2\x96\x81", s->repl, &s->repl_len);
		if (!rc)
			rc = get_prepend(L, p, where, &s->prepend);
		if (!rc)
			rc = get_bool(L, p, where, "split", &split);
		if (rc)
			return rc;
		s->split = split;
	}
	t->n_pretok++;
	return 0;
}

/* ---- decoder ---- */

static int parse_decoder(struct loader *L, const json_t *d, const char *where, bool *fused)
{
	struct tokenizer *t = L->t;
	const char *type;
	if (!d || json_is_null(d))
		return 0;
	int rc = get_type(L, d, where, &type);
	if (rc)
		return rc;
	if (!strcmp(type, "Sequence")) {
		const json_t *list = json_object_get(d, "decoders");
		if (!json_is_array(list))
			return LERR(L, -EINVAL, "%s: %s.decoders must be a list, got %s", L->name, where,
				    json_kind(list));
		for (size_t i = 0; i < json_array_size(list); i++) {
			char w[64];
			snprintf(w, sizeof(w), "%s.decoders[%zu]", where, i);
			rc = parse_decoder(L, json_array_get(list, i), w, fused);
			if (rc)
				return rc;
		}
		return 0;
	}
	if (!strcmp(type, "Fuse")) {
		/* Concatenation, which the stream does anyway; it matters for what follows (below). */
		*fused = true;
		return 0;
	}
	static const char *const known[] = {"ByteLevel", "Replace", "ByteFallback", "Strip", "Metaspace"};
	enum dec_kind kind = 0;
	for (size_t i = 0; i < ARRAY_SIZE(known); i++)
		if (!strcmp(type, known[i]))
			kind = (enum dec_kind)(i + 1);
	if (!kind)
		return LERR(L, -ENOTSUP,
			    "%s: decoder type %s is not supported (ByteLevel, Metaspace, or a Sequence of Replace, "
			    "ByteFallback, Fuse, Strip)",
			    L->name, type);
	if (t->n_dec == MAX_STEPS)
		return LERR(L, -ENOTSUP, "%s: the decoder has more than %d steps", L->name, MAX_STEPS);
	struct dec_step *s = &t->dec[t->n_dec];
	memset(s, 0, sizeof(*s));
	s->kind = kind;
	switch (kind) {
	case DEC_BYTELEVEL:
	case DEC_BYTEFALLBACK:
		if (*fused)
			return LERR(L, -ENOTSUP, "%s: %s %s after Fuse is not supported", L->name, where, type);
		break;
	case DEC_REPLACE: {
		const char *from, *to;
		size_t from_len, to_len, ul;
		rc = get_string_pattern(L, d, where, &from, &from_len);
		if (!rc)
			rc = get_str(L, d, where, "content", true, &to, &to_len);
		if (rc)
			return rc;
		/* After Fuse the replacement sees the whole text; per token is the same only when the
		 * pattern is one character (it cannot then straddle two tokens). */
		if (*fused && !(utf8_unit((const uint8_t *)from, from_len, &ul) == U8_VALID && ul == from_len))
			return LERR(L, -ENOTSUP, "%s: %s Replace of \"%s\" after Fuse is not supported", L->name,
				    where, from);
		s->from = dup_bytes(from, from_len);
		s->to = dup_bytes(to, to_len);
		s->from_len = from_len;
		s->to_len = to_len;
		if (!s->from || !s->to) {
			free(s->from);
			free(s->to);
			return LERR(L, -ENOMEM, "%s: out of memory", L->name);
		}
		break;
	}
	case DEC_STRIP: {
		json_int_t start = 0, stop = 0;
		const json_t *a = json_object_get(d, "start"), *b = json_object_get(d, "stop");
		if ((a && !json_is_integer(a)) || (b && !json_is_integer(b)))
			return LERR(L, -EINVAL, "%s: %s.start and .stop must be integers", L->name, where);
		start = a ? json_integer_value(a) : 0;
		stop = b ? json_integer_value(b) : 0;
		if (start < 0 || stop < 0 || start > 1024 || stop > 1024)
			return LERR(L, -EINVAL, "%s: %s.start and .stop must be in [0, 1024]", L->name, where);
		rc = get_char(L, d, where, "content", " ", s->strip, &s->strip_len);
		if (rc)
			return rc;
		s->start = (unsigned)start;
		s->stop = (unsigned)stop;
		if (*fused) {
			/* On the whole text: the start of a stream can be stripped as it goes; its end
			 * cannot without holding everything back. */
			if (stop)
				return LERR(L, -ENOTSUP, "%s: %s Strip with stop %lld after Fuse is not supported",
					    L->name, where, (long long)stop);
			if (t->strip_start)
				return LERR(L, -ENOTSUP, "%s: %s: a second Strip after Fuse is not supported", L->name,
					    where);
			t->strip_start = s->start;
			memcpy(t->strip_char, s->strip, s->strip_len);
			t->strip_len = s->strip_len;
			return 0;
		}
		break;
	}
	case DEC_METASPACE:
		if (*fused)
			return LERR(L, -ENOTSUP, "%s: %s Metaspace after Fuse is not supported", L->name, where);
		s->from = malloc(8);
		if (!s->from)
			return LERR(L, -ENOMEM, "%s: out of memory", L->name);
		rc = get_char(L, d, where, "replacement", "\xe2\x96\x81", s->from, &s->from_len);
		if (!rc)
			rc = get_prepend(L, d, where, &s->prepend);
		if (rc) {
			free(s->from);
			return rc;
		}
		if (s->prepend != PREPEND_NEVER)
			t->dec_first = true;
		break;
	}
	t->n_dec++;
	return 0;
}

/* Appends s[0..n) to out with each from replaced by to. */
static int replace_all_append(const char *s, size_t n, const char *from, size_t from_len, const char *to,
			      size_t to_len, struct buf *out)
{
	size_t i = 0, last = 0;
	int rc = 0;
	while (i + from_len <= n) {
		if (memcmp(s + i, from, from_len) == 0) {
			rc = buf_put(out, s + last, i - last);
			if (!rc)
				rc = buf_put(out, to, to_len);
			if (rc)
				return rc;
			i += from_len;
			last = i;
		} else {
			i++;
		}
	}
	return buf_put(out, s + last, n - last);
}

static int hex_digit(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* The bytes the vocab piece p[0..n) stands for, through the per-token decoder steps; first:
 * it is the first token of the text (Metaspace drops its replacement characters instead of
 * making them spaces). The result lands in a or b: *out points at it. */
static int decode_piece(const struct tokenizer *t, const char *p, size_t n, bool first, struct buf *a, struct buf *b,
			const char **out, size_t *out_len)
{
	const char *cur = p;
	size_t len = n;
	struct buf *dst = a;
	int rc = 0;
	for (unsigned k = 0; k < t->n_dec && !rc; k++) {
		const struct dec_step *s = &t->dec[k];
		dst->len = 0;
		switch (s->kind) {
		case DEC_BYTELEVEL: {
			/* Every character must be one of the mapping's; else the piece stays as written. */
			size_t i = 0, ul;
			rc = buf_reserve(dst, len);
			while (!rc && i < len) {
				int32_t cp = utf8_cp((const uint8_t *)cur + i, len - i, &ul);
				if (cp < 0 || cp >= BL_CODEPOINTS || t->bl_byte[cp] < 0)
					break;
				dst->p[dst->len++] = (char)t->bl_byte[cp];
				i += ul;
			}
			if (!rc && i < len) {
				dst->len = 0;
				rc = buf_put(dst, cur, len);
			}
			break;
		}
		case DEC_REPLACE:
			rc = replace_all_append(cur, len, s->from, s->from_len, s->to, s->to_len, dst);
			break;
		case DEC_BYTEFALLBACK:
			if (len == 6 && has_prefix(cur, len, "<0x", 3) && cur[5] == '>' && hex_digit(cur[3]) >= 0 &&
			    hex_digit(cur[4]) >= 0) {
				char byte = (char)(hex_digit(cur[3]) * 16 + hex_digit(cur[4]));
				rc = buf_put(dst, &byte, 1);
			} else {
				rc = buf_put(dst, cur, len);
			}
			break;
		case DEC_STRIP: {
			size_t from = 0, to = len;
			for (unsigned i = 0; i < s->start && has_prefix(cur + from, to - from, s->strip, s->strip_len);
			     i++)
				from += s->strip_len;
			for (unsigned i = 0; i < s->stop && to - from >= s->strip_len &&
					     !memcmp(cur + to - s->strip_len, s->strip, s->strip_len);
			     i++)
				to -= s->strip_len;
			rc = buf_put(dst, cur + from, to - from);
			break;
		}
		case DEC_METASPACE: {
			bool drop = first && s->prepend != PREPEND_NEVER;
			rc = replace_all_append(cur, len, s->from, s->from_len, " ", drop ? 0 : 1, dst);
			break;
		}
		}
		cur = dst->p ? dst->p : "";
		len = dst->len;
		dst = dst == a ? b : a;
	}
	*out = cur;
	*out_len = len;
	return rc;
}

/* ---- model ---- */

static int arena_add(struct loader *L, const char *s, size_t n, uint32_t *off)
{
	if (L->arena.len + n + 1 > UINT32_MAX)
		return LERR(L, -EFBIG, "%s: the pieces take more than 4 GiB", L->name);
	*off = (uint32_t)L->arena.len;
	int rc = buf_put(&L->arena, s, n);
	if (!rc)
		rc = buf_put(&L->arena, "", 1);
	if (rc)
		return LERR(L, -ENOMEM, "%s: out of memory", L->name);
	return 0;
}

/* An id field of a vocab or added_tokens entry. */
static int get_id(struct loader *L, const json_t *v, const char *what, const char *piece, uint32_t *id)
{
	if (!json_is_integer(v))
		return LERR(L, -EINVAL, "%s: %s '%s' has an id that is %s, not an integer", L->name, what, piece,
			    json_kind(v));
	json_int_t x = json_integer_value(v);
	if (x < 0 || x > TOK_MAX_ID)
		return LERR(L, -EINVAL, "%s: %s '%s' has id %lld, outside [0, %u]", L->name, what, piece,
			    (long long)x, TOK_MAX_ID);
	*id = (uint32_t)x;
	return 0;
}

static int build_vocab_hash(struct loader *L, uint32_t n_vocab)
{
	struct tokenizer *t = L->t;
	uint32_t cap = 16;
	while (cap < 2 * n_vocab)
		cap *= 2;
	t->vocab = calloc(cap, sizeof(*t->vocab));
	if (!t->vocab)
		return LERR(L, -ENOMEM, "%s: out of memory", L->name);
	t->vocab_mask = cap - 1;
	for (uint32_t id = 0; id < t->n_ids; id++) {
		const struct entry *e = &t->entries[id];
		if (!e->in_vocab)
			continue;
		uint32_t h = hash_piece(t->arena + e->off, e->len), i = h & t->vocab_mask;
		while (t->vocab[i].id1)
			i = (i + 1) & t->vocab_mask;
		t->vocab[i].hash = h;
		t->vocab[i].id1 = id + 1;
	}
	return 0;
}

/* Reads model.vocab into the entries (t->n_ids and t->entries already sized). */
static int read_vocab(struct loader *L, const json_t *vocab)
{
	struct tokenizer *t = L->t;
	const char *key;
	json_t *v;
	json_object_foreach((json_t *)vocab, key, v) {
		uint32_t id;
		int rc = get_id(L, v, "vocab entry", key, &id);
		if (rc)
			return rc;
		struct entry *e = &t->entries[id];
		if (e->kind != ENTRY_HOLE)
			return LERR(L, -EINVAL, "%s: vocab id %u appears twice ('%s' and '%s')", L->name, id,
				    L->arena.p + e->off, key);
		size_t n = strlen(key);
		if (!n)
			return LERR(L, -EINVAL, "%s: the vocab has an empty piece (id %u)", L->name, id);
		rc = arena_add(L, key, n, &e->off);
		if (rc)
			return rc;
		e->len = (uint32_t)n;
		e->kind = ENTRY_VOCAB;
		e->in_vocab = 1;
	}
	return 0;
}

static int trie_insert(struct loader *L, const char *s, size_t n, uint32_t index)
{
	struct tokenizer *t = L->t;
	uint32_t node = 0;
	for (size_t i = 0; i < n; i++) {
		uint8_t b = (uint8_t)s[i];
		uint32_t c = trie_child(t, node, b);
		if (!c) {
			if (t->n_trie == t->cap_trie) {
				uint32_t cap = t->cap_trie ? t->cap_trie * 2 : 256;
				struct trie_node *p = realloc(t->trie, cap * sizeof(*p));
				if (!p)
					return LERR(L, -ENOMEM, "%s: out of memory", L->name);
				t->trie = p;
				t->cap_trie = cap;
			}
			c = t->n_trie++;
			t->trie[c] = (struct trie_node){.child = 0, .sibling = 0, .added = -1, .byte = b};
			if (node == 0) {
				t->root[b] = c;
			} else {
				t->trie[c].sibling = t->trie[node].child;
				t->trie[node].child = c;
			}
		}
		node = c;
	}
	if (t->trie[node].added >= 0)
		return LERR(L, -EINVAL, "%s: added token '%s' appears twice (ids %u and %u)", L->name, s,
			    t->added[t->trie[node].added].id, t->added[index].id);
	t->trie[node].added = (int32_t)index;
	return 0;
}

static int read_added(struct loader *L, const json_t *list)
{
	struct tokenizer *t = L->t;
	size_t n = json_array_size(list);
	t->added = calloc(n ? n : 1, sizeof(*t->added));
	t->trie = malloc(256 * sizeof(*t->trie));
	if (!t->added || !t->trie)
		return LERR(L, -ENOMEM, "%s: out of memory", L->name);
	t->cap_trie = 256;
	t->n_trie = 1;
	t->trie[0] = (struct trie_node){.child = 0, .sibling = 0, .added = -1, .byte = 0};
	for (size_t i = 0; i < n; i++) {
		const json_t *a = json_array_get(list, i);
		char where[48];
		const char *content;
		size_t len;
		uint32_t id;
		struct added_token *at = &t->added[i];
		snprintf(where, sizeof(where), "added_tokens[%zu]", i);
		if (!json_is_object(a))
			return LERR(L, -EINVAL, "%s: %s must be an object, got %s", L->name, where, json_kind(a));
		int rc = get_str(L, a, where, "content", true, &content, &len);
		if (!rc && !len)
			rc = LERR(L, -EINVAL, "%s: %s.content is empty", L->name, where);
		if (!rc)
			rc = get_id(L, json_object_get(a, "id"), "added token", content, &id);
		if (!rc)
			rc = get_bool(L, a, where, "special", &at->special);
		if (!rc)
			rc = get_bool(L, a, where, "lstrip", &at->lstrip);
		if (!rc)
			rc = get_bool(L, a, where, "rstrip", &at->rstrip);
		if (!rc)
			rc = get_bool(L, a, where, "single_word", &at->single_word);
		if (rc)
			return rc;
		at->id = id;
		struct entry *e = &t->entries[id];
		if (e->kind == ENTRY_ADDED)
			return LERR(L, -EINVAL, "%s: added token id %u appears twice ('%s' and '%s')", L->name, id,
				    L->arena.p + e->off, content);
		if (e->in_vocab &&
		    (e->len != len || memcmp(L->arena.p + e->off, content, len) != 0))
			return LERR(L, -EINVAL, "%s: added token '%s' has id %u, which the vocab gives to '%s'",
				    L->name, content, id, L->arena.p + e->off);
		if (e->kind == ENTRY_HOLE) {
			rc = arena_add(L, content, len, &e->off);
			if (rc)
				return rc;
			e->len = (uint32_t)len;
		}
		e->kind = ENTRY_ADDED;
		e->special = at->special;
		t->n_added = (uint32_t)i + 1;
		rc = trie_insert(L, content, len, (uint32_t)i);
		if (rc)
			return rc;
	}
	return 0;
}

/* An added token's text found in the vocab under another id would decode one way and encode
 * another; checked once the vocab hash exists. */
static int check_added_vs_vocab(struct loader *L)
{
	struct tokenizer *t = L->t;
	for (uint32_t i = 0; i < t->n_added; i++) {
		const struct entry *e = &t->entries[t->added[i].id];
		int32_t v = vocab_find(t, t->arena + e->off, e->len);
		if (v >= 0 && (uint32_t)v != t->added[i].id)
			return LERR(L, -EINVAL, "%s: added token '%s' has id %u but the vocab gives it id %d", L->name,
				    t->arena + e->off, t->added[i].id, v);
	}
	return 0;
}

static int read_merges(struct loader *L, const json_t *merges)
{
	struct tokenizer *t = L->t;
	size_t n = json_array_size(merges);
	unsigned bits = 4;
	while ((1ull << bits) < n + n / 3 + 1)
		bits++;
	t->merge_bits = bits;
	t->merges = calloc(1ull << bits, sizeof(*t->merges));
	struct buf joined = {0};
	int rc = 0;
	if (!t->merges)
		return LERR(L, -ENOMEM, "%s: out of memory", L->name);
	uint64_t mask = (1ull << bits) - 1;
	for (size_t i = 0; i < n && !rc; i++) {
		const json_t *m = json_array_get(merges, i);
		const char *a = NULL, *b = NULL;
		size_t an = 0, bn = 0;
		if (json_is_string(m)) {
			/* "a b": exactly one space, as Hugging Face splits it */
			const char *s = json_string_value(m), *sp = strchr(s, ' ');
			if (sp && !strchr(sp + 1, ' ')) {
				a = s;
				an = (size_t)(sp - s);
				b = sp + 1;
				bn = strlen(b);
			}
		} else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
			   json_is_string(json_array_get(m, 1))) {
			a = json_string_value(json_array_get(m, 0));
			an = json_string_length(json_array_get(m, 0));
			b = json_string_value(json_array_get(m, 1));
			bn = json_string_length(json_array_get(m, 1));
		}
		if (!a) {
			char *text = json_dumps(m, JSON_ENCODE_ANY | JSON_COMPACT);
			rc = LERR(L, -EINVAL, "%s: merges entry %zu is not a pair (\"a b\" or [\"a\", \"b\"]): %.80s",
				  L->name, i, text ? text : "?");
			free(text);
			break;
		}
		int32_t left = vocab_find(t, a, an), right = vocab_find(t, b, bn);
		if (left < 0 || right < 0) {
			rc = LERR(L, -EINVAL, "%s: merges entry %zu ('%.*s' '%.*s'): '%.*s' is not in the vocab",
				  L->name, i, (int)an, a, (int)bn, b, left < 0 ? (int)an : (int)bn, left < 0 ? a : b);
			break;
		}
		joined.len = 0;
		if (buf_put(&joined, a, an) || buf_put(&joined, b, bn)) {
			rc = LERR(L, -ENOMEM, "%s: out of memory", L->name);
			break;
		}
		int32_t id = vocab_find(t, joined.p, joined.len);
		if (id < 0) {
			rc = LERR(L, -EINVAL,
				  "%s: merges entry %zu: '%.*s', the merge of '%.*s' and '%.*s', is not in the vocab",
				  L->name, i, (int)joined.len, joined.p, (int)an, a, (int)bn, b);
			break;
		}
		uint64_t key = merge_key((uint32_t)left, (uint32_t)right), k = merge_slot_of(key, bits);
		while (t->merges[k].key && t->merges[k].key != key)
			k = (k + 1) & mask;
		/* A pair listed twice keeps the later rank: Hugging Face builds a map from the list. */
		t->merges[k] = (struct merge_slot){.key = key, .rank = (uint32_t)i, .id = (uint32_t)id};
	}
	buf_free(&joined);
	return rc;
}

/* The post_processor's leading special token: its id, -1 when there is no TemplateProcessing,
 * -2 when there is one that puts nothing first. */
static int32_t template_bos(const struct tokenizer *t, const json_t *pp)
{
	const json_t *type = json_object_get(pp, "type");
	if (!json_is_string(type))
		return -1;
	if (!strcmp(json_string_value(type), "Sequence")) {
		const json_t *list = json_object_get(pp, "processors");
		for (size_t i = 0; i < json_array_size(list); i++) {
			int32_t id = template_bos(t, json_array_get(list, i));
			if (id != -1)
				return id;
		}
		return -1;
	}
	if (strcmp(json_string_value(type), "TemplateProcessing"))
		return -1;
	const json_t *first = json_array_get(json_object_get(pp, "single"), 0);
	const json_t *name = json_object_get(json_object_get(first, "SpecialToken"), "id");
	if (!json_is_string(name))
		return -2;
	const json_t *ids = json_object_get(json_object_get(json_object_get(pp, "special_tokens"),
							    json_string_value(name)),
					    "ids");
	const json_t *id = json_array_get(ids, 0);
	if (json_is_integer(id) && json_integer_value(id) >= 0 && json_integer_value(id) < t->n_ids &&
	    t->entries[json_integer_value(id)].kind != ENTRY_HOLE)
		return (int32_t)json_integer_value(id);
	int32_t v = tokenizer_token_to_id(t, json_string_value(name));
	return v >= 0 ? v : -2;
}

static int32_t first_existing(const struct tokenizer *t, const char *const *names, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		int32_t id = tokenizer_token_to_id(t, names[i]);
		if (id >= 0)
			return id;
	}
	return -1;
}

static void byte_level_tables(struct tokenizer *t)
{
	/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the others
	 * (controls, space, NBSP, soft hyphen) for 256, 257, ... in byte order. */
	unsigned next = 256;
	for (unsigned i = 0; i < BL_CODEPOINTS; i++)
		t->bl_byte[i] = -1;
	for (unsigned b = 0; b < 256; b++) {
		bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
		uint32_t cp = keep ? b : next++;
		t->bl_len[b] = (uint8_t)utf8_put(cp, t->bl_utf8[b]);
		t->bl_byte[cp] = (int16_t)b;
	}
	assert(next == BL_CODEPOINTS);
}

/* Reads the file into memory: jansson's own loader would hide the errno of a failed open. */
static int read_file(struct loader *L, const char *path, char **data, size_t *size)
{
	int rc = 0;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return LERR(L, -errno, "%s: cannot open: %s", path, strerror(errno));
	struct stat st;
	if (fstat(fd, &st) != 0) {
		rc = LERR(L, -errno, "%s: cannot stat: %s", path, strerror(errno));
		goto out_close;
	}
	if (!S_ISREG(st.st_mode)) {
		rc = LERR(L, -EINVAL, "%s: not a regular file", path);
		goto out_close;
	}
	if ((uint64_t)st.st_size > MAX_FILE_SIZE) {
		rc = LERR(L, -EFBIG, "%s: %lld bytes is too large for a tokenizer.json (at most 1 GiB)", path,
			  (long long)st.st_size);
		goto out_close;
	}
	size_t n = (size_t)st.st_size, got = 0;
	char *p = malloc(n + 1);
	if (!p) {
		rc = LERR(L, -ENOMEM, "%s: out of memory for %zu bytes", path, n);
		goto out_close;
	}
	while (got < n) {
		ssize_t r = read(fd, p + got, n - got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			rc = LERR(L, -errno, "%s: read failed: %s", path, strerror(errno));
			free(p);
			goto out_close;
		}
		if (r == 0)
			break;
		got += (size_t)r;
	}
	*data = p;
	*size = got;
out_close:
	close(fd);
	return rc;
}

static int load_model(struct loader *L, const json_t *root)
{
	struct tokenizer *t = L->t;
	const json_t *model = json_object_get(root, "model");
	const char *type;
	int rc;
	if (!json_is_object(model))
		return LERR(L, -EINVAL, "%s: \"model\" must be an object, got %s", L->name, json_kind(model));
	rc = get_str(L, model, "model", "type", false, &type, NULL);
	if (rc)
		return rc;
	/* Older files leave the type out; Hugging Face then recognises BPE by its merges. */
	if (!type && !json_object_get(model, "merges"))
		return LERR(L, -ENOTSUP, "%s: model has no type and no merges: only BPE is supported", L->name);
	if (type && strcmp(type, "BPE"))
		return LERR(L, -ENOTSUP, "%s: model type %s is not supported (BPE)", L->name, type);
	const json_t *dropout = json_object_get(model, "dropout");
	if (dropout && !json_is_null(dropout) && !(json_is_number(dropout) && json_number_value(dropout) == 0))
		return LERR(L, -ENOTSUP, "%s: model.dropout is not supported (it makes encoding random)", L->name);
	static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
	for (size_t i = 0; i < ARRAY_SIZE(affixes); i++) {
		const char *s;
		size_t n;
		rc = get_str(L, model, "model", affixes[i], false, &s, &n);
		if (rc)
			return rc;
		if (s && n)
			return LERR(L, -ENOTSUP, "%s: model.%s \"%s\" is not supported", L->name, affixes[i], s);
	}
	rc = get_bool(L, model, "model", "byte_fallback", &t->byte_fallback);
	if (!rc)
		rc = get_bool(L, model, "model", "fuse_unk", &t->fuse_unk);
	if (!rc)
		rc = get_bool(L, model, "model", "ignore_merges", &t->ignore_merges);
	if (rc)
		return rc;

	const json_t *vocab = json_object_get(model, "vocab"), *merges = json_object_get(model, "merges");
	const json_t *added = json_object_get(root, "added_tokens");
	if (!json_is_object(vocab))
		return LERR(L, -EINVAL, "%s: model.vocab must be an object (piece -> id), got %s", L->name,
			    json_kind(vocab));
	if (!json_object_size(vocab))
		return LERR(L, -EINVAL, "%s: model.vocab is empty", L->name);
	if (!json_is_array(merges))
		return LERR(L, -EINVAL, "%s: model.merges must be a list, got %s", L->name, json_kind(merges));
	if (added && !json_is_null(added) && !json_is_array(added))
		return LERR(L, -EINVAL, "%s: added_tokens must be a list, got %s", L->name, json_kind(added));

	/* The id range first, so that entries is one array indexed by id. */
	uint32_t max_id = 0;
	const char *key;
	json_t *v;
	json_object_foreach((json_t *)vocab, key, v) {
		uint32_t id;
		rc = get_id(L, v, "vocab entry", key, &id);
		if (rc)
			return rc;
		max_id = id > max_id ? id : max_id;
	}
	for (size_t i = 0; i < json_array_size(added); i++) {
		const json_t *a = json_array_get(added, i);
		const json_t *id = json_object_get(a, "id");
		if (json_is_integer(id) && json_integer_value(id) >= 0 && json_integer_value(id) <= TOK_MAX_ID &&
		    (uint32_t)json_integer_value(id) > max_id)
			max_id = (uint32_t)json_integer_value(id);
	}
	/* Ids are dense in real files; a few huge ids in a small file would only cost memory. */
	size_t n_pieces = json_object_size(vocab) + json_array_size(added);
	if (max_id >= 2 * n_pieces + 65536)
		return LERR(L, -EINVAL, "%s: ids go up to %u but there are only %zu pieces", L->name, max_id,
			    n_pieces);
	t->n_ids = max_id + 1;
	t->entries = calloc(t->n_ids, sizeof(*t->entries));
	if (!t->entries)
		return LERR(L, -ENOMEM, "%s: out of memory for %u ids", L->name, t->n_ids);
	rc = read_vocab(L, vocab);
	if (!rc)
		rc = read_added(L, added);
	if (rc)
		return rc;
	/* The arena is complete for pieces: lookups may use it from here on. */
	t->arena = L->arena.p;
	rc = build_vocab_hash(L, (uint32_t)json_object_size(vocab));
	if (!rc)
		rc = check_added_vs_vocab(L);
	if (!rc)
		rc = read_merges(L, merges);
	if (rc)
		return rc;

	const char *unk;
	rc = get_str(L, model, "model", "unk_token", false, &unk, NULL);
	if (rc)
		return rc;
	t->unk_id = -1;
	if (unk) {
		t->unk_id = vocab_find(t, unk, strlen(unk));
		if (t->unk_id < 0)
			return LERR(L, -EINVAL, "%s: model.unk_token '%s' is not in the vocab", L->name, unk);
	}
	for (unsigned b = 0; b < 256; b++) {
		char name[8];
		snprintf(name, sizeof(name), "<0x%02X>", b);
		t->fallback_id[b] = vocab_find(t, name, 6);
	}
	return 0;
}

/* Each entry's decoded bytes, appended to the arena (or shared with the piece when equal). */
static int precompute_decoded(struct loader *L)
{
	struct tokenizer *t = L->t;
	struct buf a = {0}, b = {0}, tmp = {0};
	int rc = 0;
	for (uint32_t id = 0; id < t->n_ids && !rc; id++) {
		struct entry *e = &t->entries[id];
		e->dec_off = e->off;
		e->dec_len = e->len;
		if (e->kind != ENTRY_VOCAB)
			continue; /* added tokens decode to their text as written; holes to nothing */
		const char *out;
		size_t n;
		if (decode_piece(t, L->arena.p + e->off, e->len, false, &a, &b, &out, &n)) {
			rc = LERR(L, -ENOMEM, "%s: out of memory", L->name);
			break;
		}
		if (n == e->len && !memcmp(out, L->arena.p + e->off, n))
			continue;
		/* out may point into the arena (no decoder steps); copy before the arena grows. */
		tmp.len = 0;
		if (buf_put(&tmp, out, n)) {
			rc = LERR(L, -ENOMEM, "%s: out of memory", L->name);
			break;
		}
		rc = arena_add(L, tmp.p ? tmp.p : "", n, &e->dec_off);
		e->dec_len = (uint32_t)n;
		t->arena = L->arena.p;
	}
	buf_free(&a);
	buf_free(&b);
	buf_free(&tmp);
	return rc;
}

int tokenizer_load(const char *path, struct tokenizer **out, char *err, size_t errlen)
{
	assert(path && out);
	struct loader L = {.name = path, .err = err, .errlen = errlen};
	char *file = NULL, *data = NULL;
	size_t size = 0;
	int rc;
	*out = NULL;

	struct stat st;
	if (stat(path, &st) != 0)
		return LERR(&L, -errno, "%s: %s", path, strerror(errno));
	if (S_ISDIR(st.st_mode)) {
		size_t n = strlen(path) + sizeof("/tokenizer.json");
		file = malloc(n);
		if (!file)
			return LERR(&L, -ENOMEM, "%s: out of memory", path);
		snprintf(file, n, "%s/tokenizer.json", path);
		if (access(file, F_OK) != 0) {
			rc = LERR(&L, -errno, "%s: no tokenizer.json in this directory (%s)", path, strerror(errno));
			goto out_file;
		}
		L.name = file;
	}
	rc = read_file(&L, L.name, &data, &size);
	if (rc)
		goto out_file;
	rc = tokenizer_load_buffer(L.name, data, size, out, err, errlen);
	free(data);
out_file:
	free(file);
	return rc;
}

int tokenizer_load_buffer(const char *name, const char *data, size_t size, struct tokenizer **out, char *err,
			  size_t errlen)
{
	assert(name && out && (data || !size));
	struct loader L = {.name = name, .err = err, .errlen = errlen};
	json_t *root = NULL;
	int rc;
	*out = NULL;
	json_error_t jerr;
	root = json_loadb(data, size, JSON_REJECT_DUPLICATES, &jerr);
	if (!root)
		return LERR(&L, -EINVAL, "%s: not valid JSON: %s (line %d, column %d)", L.name, jerr.text, jerr.line,
			    jerr.column);
	if (!json_is_object(root)) {
		rc = LERR(&L, -EINVAL, "%s: the top level must be an object, got %s", L.name, json_kind(root));
		goto out_json;
	}
	L.t = calloc(1, sizeof(*L.t));
	if (!L.t) {
		rc = LERR(&L, -ENOMEM, "%s: out of memory", L.name);
		goto out_json;
	}
	struct tokenizer *t = L.t;
	t->unk_id = t->bos_id = t->eos_id = -1;
	byte_level_tables(t);
	rc = load_model(&L, root);
	if (!rc)
		rc = parse_normalizer(&L, json_object_get(root, "normalizer"), "normalizer");
	if (!rc)
		rc = parse_pretok(&L, json_object_get(root, "pre_tokenizer"), "pre_tokenizer");
	bool fused = false;
	if (!rc)
		rc = parse_decoder(&L, json_object_get(root, "decoder"), "decoder", &fused);
	if (rc)
		goto out_tok;
	for (uint32_t i = 0; i < t->n_added; i++)
		if (t->added[i].single_word && !t->word_re) {
			/* Hugging Face tests single_word with the Rust regex crate's \w. */
			static const char word[] = "[\\p{Alphabetic}\\p{M}\\p{Pc}\\p{Nd}\\p{Join_Control}]";
			rc = compile_pattern(&L, "single_word", word, strlen(word), false, &t->word_re);
			if (rc)
				goto out_tok;
		}

	t->arena = L.arena.p;
	if (t->byte_level)
		for (unsigned b = 0; b < 256; b++)
			t->byte_id[b] = vocab_find(t, (const char *)t->bl_utf8[b], t->bl_len[b]);
	rc = precompute_decoded(&L);
	if (rc)
		goto out_tok;
	/* Nothing fails from here on: the arena passes to the tokenizer. */
	t->arena = L.arena.p;
	t->arena_len = L.arena.len;
	L.arena.p = NULL;

	int32_t bos = template_bos(t, json_object_get(root, "post_processor"));
	static const char *const bos_names[] = {"<|begin_of_text|>", "<s>", "<bos>"};
	static const char *const eos_names[] = {"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"};
	t->bos_id = bos >= 0 ? bos : bos == -1 ? first_existing(t, bos_names, ARRAY_SIZE(bos_names)) : -1;
	t->eos_id = first_existing(t, eos_names, ARRAY_SIZE(eos_names));
	*out = t;
	L.t = NULL;
	rc = 0;
out_tok:
	if (L.t) {
		L.t->arena = NULL; /* until success the arena is the loader's: freed below */
		tokenizer_destroy(&L.t);
	}
	buf_free(&L.arena);
out_json:
	json_decref(root);
	return rc;
}

void tokenizer_destroy(struct tokenizer **tp)
{
	if (!tp || !*tp)
		return;
	struct tokenizer *t = *tp;
	free(t->entries);
	free(t->arena);
	free(t->vocab);
	free(t->merges);
	free(t->added);
	free(t->trie);
	for (unsigned i = 0; i < t->n_norm; i++) {
		free(t->norm[i].from);
		free(t->norm[i].to);
	}
	for (unsigned i = 0; i < t->n_pretok; i++)
		pcre2_code_free(t->pretok[i].re);
	for (unsigned i = 0; i < t->n_dec; i++) {
		free(t->dec[i].from);
		free(t->dec[i].to);
	}
	pcre2_code_free(t->word_re);
	free(t);
	*tp = NULL;
}

/* ---- queries ---- */

uint32_t tokenizer_vocab_size(const struct tokenizer *t)
{
	return t->n_ids;
}

int32_t tokenizer_bos(const struct tokenizer *t)
{
	return t->bos_id;
}

int32_t tokenizer_eos(const struct tokenizer *t)
{
	return t->eos_id;
}

int32_t tokenizer_token_to_id(const struct tokenizer *t, const char *piece)
{
	size_t n = strlen(piece);
	int32_t a = added_find(t, piece, n);
	return a >= 0 ? (int32_t)t->added[a].id : vocab_find(t, piece, n);
}

const char *tokenizer_id_to_piece(const struct tokenizer *t, uint32_t id, size_t *len)
{
	if (id >= t->n_ids || t->entries[id].kind == ENTRY_HOLE)
		return NULL;
	if (len)
		*len = t->entries[id].len;
	return entry_piece(t, id);
}

bool tokenizer_is_special(const struct tokenizer *t, uint32_t id)
{
	return id < t->n_ids && t->entries[id].special;
}

void tok_ids_free(struct tok_ids *v)
{
	if (!v)
		return;
	free(v->ids);
	memset(v, 0, sizeof(*v));
}

static int ids_push(struct tok_ids *v, uint32_t id)
{
	if (v->n == v->cap) {
		size_t cap = v->cap ? v->cap * 2 : 64;
		uint32_t *p = realloc(v->ids, cap * sizeof(*p));
		if (!p)
			return -ENOMEM;
		v->ids = p;
		v->cap = cap;
	}
	v->ids[v->n++] = id;
	return 0;
}

/* ---- encoding ---- */

struct sym {
	uint32_t id;
	int32_t prev, next; /* neighbours, -1 at the ends; prev SYM_DEAD once merged away */
};

struct cand {
	uint32_t rank; /* of the merge of sym[pos] with its right neighbour */
	uint32_t pos;
};

/* Per-call state: encoding shares nothing mutable, so concurrent calls are safe. */
struct enc {
	const struct tokenizer *t;
	struct tok_ids *out;
	pcre2_match_data *md[MAX_STEPS]; /* for pretok[i].re, made on first use */
	pcre2_match_data *word_md;
	struct buf norm[2];	    /* normalizer steps write these in turn */
	struct buf step[MAX_STEPS]; /* pre-tokenizer step i's rewritten text */
	struct buf mapped;	    /* the byte-level mapped pre-token, for the whole-piece lookup */
	struct sym *sym;
	size_t sym_cap;
	struct cand *heap;
	size_t heap_n, heap_cap;
};

static void enc_free(struct enc *e)
{
	for (unsigned i = 0; i < MAX_STEPS; i++) {
		pcre2_match_data_free(e->md[i]);
		buf_free(&e->step[i]);
	}
	pcre2_match_data_free(e->word_md);
	buf_free(&e->norm[0]);
	buf_free(&e->norm[1]);
	buf_free(&e->mapped);
	free(e->sym);
	free(e->heap);
}

static bool cand_less(struct cand a, struct cand b)
{
	return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos);
}

static int heap_push(struct enc *e, uint32_t rank, uint32_t pos)
{
	if (e->heap_n == e->heap_cap) {
		size_t cap = e->heap_cap ? e->heap_cap * 2 : 64;
		struct cand *p = realloc(e->heap, cap * sizeof(*p));
		if (!p)
			return -ENOMEM;
		e->heap = p;
		e->heap_cap = cap;
	}
	struct cand c = {rank, pos};
	size_t i = e->heap_n++;
	while (i > 0) {
		size_t parent = (i - 1) / 2;
		if (!cand_less(c, e->heap[parent]))
			break;
		e->heap[i] = e->heap[parent];
		i = parent;
	}
	e->heap[i] = c;
	return 0;
}

static struct cand heap_pop(struct enc *e)
{
	struct cand top = e->heap[0], last = e->heap[--e->heap_n];
	size_t i = 0, n = e->heap_n;
	for (;;) {
		size_t c = 2 * i + 1;
		if (c >= n)
			break;
		if (c + 1 < n && cand_less(e->heap[c + 1], e->heap[c]))
			c++;
		if (!cand_less(e->heap[c], last))
			break;
		e->heap[i] = e->heap[c];
		i = c;
	}
	if (n)
		e->heap[i] = last;
	return top;
}

/* Pushes the merge of sym[pos] with its right neighbour, if there is one. */
static int push_pair(struct enc *e, int32_t pos)
{
	if (pos < 0 || e->sym[pos].next < 0)
		return 0;
	const struct merge_slot *m = merge_find(e->t, e->sym[pos].id, e->sym[e->sym[pos].next].id);
	return m ? heap_push(e, m->rank, (uint32_t)pos) : 0;
}

/* Runs BPE over one pre-token and appends its ids. */
static int bpe_word(struct enc *e, const uint8_t *s, size_t len)
{
	const struct tokenizer *t = e->t;
	int rc;
	if (t->ignore_merges) {
		const char *w = (const char *)s;
		size_t wl = len;
		if (t->byte_level) {
			e->mapped.len = 0;
			rc = buf_reserve(&e->mapped, 2 * len);
			if (rc)
				return rc;
			for (size_t i = 0; i < len; i++) {
				memcpy(e->mapped.p + e->mapped.len, t->bl_utf8[s[i]], t->bl_len[s[i]]);
				e->mapped.len += t->bl_len[s[i]];
			}
			w = e->mapped.p;
			wl = e->mapped.len;
		}
		int32_t id = vocab_find(t, w, wl);
		if (id >= 0)
			return ids_push(e->out, (uint32_t)id);
	}

	/* At most one symbol per byte: a byte-level byte, a character, a fallback byte, an unk;
	 * but in a byte-level file with byte fallback a byte whose mapped character is not in the
	 * vocab falls back to the bytes of that character, up to 2 (bl_len). */
	if (len > INT32_MAX)
		return -ENOMEM;
	size_t max_syms = t->byte_level && t->byte_fallback ? 2 * len : len;
	if (max_syms > INT32_MAX || max_syms > SIZE_MAX / sizeof(struct sym))
		return -ENOMEM;
	if (e->sym_cap < max_syms) {
		struct sym *p = realloc(e->sym, max_syms * sizeof(*p));
		if (!p)
			return -ENOMEM;
		e->sym = p;
		e->sym_cap = max_syms;
	}
	size_t n = 0;
	bool prev_unk = false;
	for (size_t i = 0; i < len;) {
		const uint8_t *u;
		size_t ul;
		int32_t id;
		if (t->byte_level) {
			u = t->bl_utf8[s[i]];
			ul = t->bl_len[s[i]];
			id = t->byte_id[s[i]];
			i++;
		} else {
			u = s + i;
			if (utf8_unit(u, len - i, &ul) != U8_VALID)
				ul = 1; /* an invalid byte: a unit of its own, found in no vocab */
			id = vocab_find(t, (const char *)u, ul);
			i += ul;
		}
		if (id >= 0) {
			e->sym[n++].id = (uint32_t)id;
			prev_unk = false;
			continue;
		}
		if (t->byte_fallback) {
			bool all = true;
			for (size_t k = 0; k < ul; k++)
				all = all && t->fallback_id[u[k]] >= 0;
			if (all) {
				for (size_t k = 0; k < ul; k++)
					e->sym[n++].id = (uint32_t)t->fallback_id[u[k]];
				prev_unk = false;
				continue;
			}
		}
		if (t->unk_id < 0)
			return -EILSEQ;
		if (t->fuse_unk && prev_unk)
			continue;
		e->sym[n++].id = (uint32_t)t->unk_id;
		prev_unk = true;
	}
	for (size_t k = 0; k < n; k++) {
		e->sym[k].prev = (int32_t)k - 1;
		e->sym[k].next = k + 1 < n ? (int32_t)k + 1 : -1;
	}

	/* Lowest rank first, leftmost among equals. An entry is stale when its pair changed since
	 * it was pushed; the current pair of its position is then checked against the rank. */
	e->heap_n = 0;
	for (size_t k = 0; k + 1 < n; k++) {
		rc = push_pair(e, (int32_t)k);
		if (rc)
			return rc;
	}
	while (e->heap_n) {
		struct cand c = heap_pop(e);
		struct sym *a = &e->sym[c.pos];
		if (a->prev == SYM_DEAD || a->next < 0)
			continue;
		int32_t bpos = a->next;
		const struct merge_slot *m = merge_find(t, a->id, e->sym[bpos].id);
		if (!m || m->rank != c.rank)
			continue;
		a->id = m->id;
		a->next = e->sym[bpos].next;
		if (a->next >= 0)
			e->sym[a->next].prev = (int32_t)c.pos;
		e->sym[bpos].prev = SYM_DEAD;
		rc = push_pair(e, a->prev);
		if (!rc)
			rc = push_pair(e, (int32_t)c.pos);
		if (rc)
			return rc;
	}
	/* The first symbol is never merged away: merges keep the left one. */
	for (int32_t k = n ? 0 : -1; k >= 0; k = e->sym[k].next) {
		rc = ids_push(e->out, e->sym[k].id);
		if (rc)
			return rc;
	}
	return 0;
}

static int pretok(struct enc *e, unsigned i, const char *s, size_t len, bool at_start);

static int regex_error(int rc)
{
	/* Only resource limits are expected here: the subject is valid UTF-8 by construction. */
	return rc == PCRE2_ERROR_NOMEMORY || rc == PCRE2_ERROR_HEAPLIMIT || rc == PCRE2_ERROR_MATCHLIMIT ||
			       rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_JIT_STACKLIMIT
		       ? -ENOMEM
		       : -EIO;
}

/* Isolated split of the valid UTF-8 run s[from..to) by re: matches and the gaps between them
 * are pre-tokens, passed to step i + 1. */
static int regex_run(struct enc *e, unsigned i, const pcre2_code *re, const char *s, size_t from, size_t to,
		     bool at_start)
{
	const char *sub = s + from;
	size_t n = to - from, off = 0, gap = 0;
	int rc;
	while (off < n) {
		int m = pcre2_match(re, (PCRE2_SPTR)sub, n, off, PCRE2_NO_UTF_CHECK, e->md[i], NULL);
		if (m == PCRE2_ERROR_JIT_STACKLIMIT) /* the interpreter keeps its backtracking on the heap */
			m = pcre2_match(re, (PCRE2_SPTR)sub, n, off, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, e->md[i], NULL);
		if (m == PCRE2_ERROR_NOMATCH)
			break;
		if (m < 0)
			return regex_error(m);
		const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md[i]);
		size_t ms = ov[0], me = ov[1];
		if (me <= ms) {
			/* An empty match produces no piece: go on from the next character. */
			size_t ul;
			if (ms >= n)
				break;
			utf8_unit((const uint8_t *)sub + ms, n - ms, &ul);
			off = ms + ul;
			continue;
		}
		if (ms > gap) {
			rc = pretok(e, i + 1, sub + gap, ms - gap, at_start && from + gap == 0);
			if (rc)
				return rc;
		}
		rc = pretok(e, i + 1, sub + ms, me - ms, at_start && from + ms == 0);
		if (rc)
			return rc;
		gap = off = me;
	}
	return gap < n ? pretok(e, i + 1, sub + gap, n - gap, at_start && from + gap == 0) : 0;
}

/* Splits by re, cutting the text at invalid UTF-8 first: each invalid byte is a pre-token of
 * its own (the regex engine takes only valid UTF-8). */
static int regex_split(struct enc *e, unsigned i, const pcre2_code *re, const char *s, size_t len, bool at_start)
{
	if (!e->md[i]) {
		e->md[i] = pcre2_match_data_create_from_pattern(re, NULL);
		if (!e->md[i])
			return -ENOMEM;
	}
	size_t pos = 0;
	int rc = 0;
	while (pos < len && !rc) {
		size_t run = pos, ul;
		while (run < len && utf8_unit((const uint8_t *)s + run, len - run, &ul) == U8_VALID)
			run += ul;
		if (run > pos)
			rc = regex_run(e, i, re, s, pos, run, at_start);
		if (!rc && run < len)
			rc = pretok(e, i + 1, s + run, 1, at_start && run == 0);
		pos = run + 1;
	}
	return rc;
}

/* Pre-tokenizer step i over s[0..len); past the last step, the model. at_start: s begins the
 * input (Metaspace's "first" scheme prepends only there). */
static int pretok(struct enc *e, unsigned i, const char *s, size_t len, bool at_start)
{
	const struct tokenizer *t = e->t;
	if (!len)
		return 0;
	if (i == t->n_pretok)
		return bpe_word(e, (const uint8_t *)s, len);
	const struct pretok_step *st = &t->pretok[i];
	struct buf *b = &e->step[i];
	int rc;
	switch (st->kind) {
	case PRETOK_SPLIT:
		return regex_split(e, i, st->re, s, len, at_start);
	case PRETOK_BYTELEVEL:
		if (st->prefix_space && s[0] != ' ') {
			b->len = 0;
			rc = buf_put(b, " ", 1);
			if (!rc)
				rc = buf_put(b, s, len);
			if (rc)
				return rc;
			s = b->p;
			len = b->len;
		}
		return st->re ? regex_split(e, i, st->re, s, len, at_start) : pretok(e, i + 1, s, len, at_start);
	case PRETOK_METASPACE: {
		/* Spaces become the replacement, then it is prepended unless already there. */
		bool prepend = st->prepend == PREPEND_ALWAYS || (st->prepend == PREPEND_FIRST && at_start);
		if (s[0] == ' ' || has_prefix(s, len, st->repl, st->repl_len))
			prepend = false;
		b->len = 0;
		rc = prepend ? buf_put(b, st->repl, st->repl_len) : 0;
		if (!rc)
			rc = replace_all_append(s, len, " ", 1, st->repl, st->repl_len, b);
		if (rc)
			return rc;
		if (!st->split)
			return pretok(e, i + 1, b->p, b->len, at_start);
		/* Split before each replacement character, which stays with what follows it. */
		size_t start = 0;
		for (size_t k = 1; k + st->repl_len <= b->len;) {
			if (memcmp(b->p + k, st->repl, st->repl_len) == 0) {
				rc = pretok(e, i + 1, b->p + start, k - start, at_start && start == 0);
				if (rc)
					return rc;
				start = k;
				k += st->repl_len;
			} else {
				k++;
			}
		}
		return pretok(e, i + 1, b->p + start, b->len - start, at_start && start == 0);
	}
	}
	return -EINVAL;
}

/* Normalizes and pre-tokenizes the text between added tokens. */
static int encode_text(struct enc *e, const char *s, size_t len, bool at_start)
{
	const struct tokenizer *t = e->t;
	if (!len)
		return 0;
	for (unsigned k = 0; k < t->n_norm; k++) {
		const struct norm_step *st = &t->norm[k];
		struct buf *b = &e->norm[k & 1];
		int rc;
		b->len = 0;
		if (st->kind == NORM_PREPEND) {
			rc = buf_put(b, st->from, st->from_len);
			if (!rc)
				rc = buf_put(b, s, len);
		} else {
			rc = replace_all_append(s, len, st->from, st->from_len, st->to, st->to_len, b);
		}
		if (rc)
			return rc;
		s = b->p;
		len = b->len;
	}
	return pretok(e, 0, s, len, at_start);
}

/* Is the character at s + pos (after: the one starting there; else the one ending there) a
 * word character for single_word? */
static int is_word_char(struct enc *e, const char *s, size_t len, size_t pos, bool after, bool *word)
{
	size_t ul;
	const uint8_t *u = (const uint8_t *)s;
	size_t start = pos;
	if (!after) {
		utf8_cp_before(u, pos, &ul);
		start = pos - ul;
	}
	if (!e->word_md) {
		e->word_md = pcre2_match_data_create_from_pattern(e->t->word_re, NULL);
		if (!e->word_md)
			return -ENOMEM;
	}
	size_t ul2;
	if (utf8_unit(u + start, len - start, &ul2) != U8_VALID) {
		*word = false; /* an invalid byte is not a letter */
		return 0;
	}
	int m = pcre2_match(e->t->word_re, (PCRE2_SPTR)(s + start), ul2, 0, PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK,
			    e->word_md, NULL);
	if (m < 0 && m != PCRE2_ERROR_NOMATCH)
		return regex_error(m);
	*word = m >= 0;
	return 0;
}

/* The longest added token at s + i (special ones only when specials), extended by its
 * lstrip/rstrip over whitespace (not back past seg). Returns 1 with [*ms, *me) and *id, 0 when
 * none, or -errno. */
static int added_match(struct enc *e, const char *s, size_t len, size_t i, size_t seg, bool specials, size_t *ms,
		       size_t *me, uint32_t *id)
{
	const struct tokenizer *t = e->t;
	uint32_t node = t->root[(uint8_t)s[i]];
	int32_t best = -1;
	size_t end = i, k = i;
	while (node) {
		k++;
		int32_t a = t->trie[node].added;
		if (a >= 0 && (specials || !t->added[a].special)) {
			best = a;
			end = k;
		}
		if (k >= len)
			break;
		node = trie_child(t, node, (uint8_t)s[k]);
	}
	if (best < 0)
		return 0;
	const struct added_token *at = &t->added[best];
	size_t start = i, ul;
	if (at->single_word) {
		bool before = false, after = false;
		int rc = i > 0 ? is_word_char(e, s, len, i, false, &before) : 0;
		if (!rc && end < len)
			rc = is_word_char(e, s, len, end, true, &after);
		if (rc)
			return rc;
		if (before || after)
			return 0;
	}
	while (at->lstrip && start > seg && is_white(utf8_cp_before((const uint8_t *)s, start, &ul)) &&
	       start - ul >= seg)
		start -= ul;
	while (at->rstrip && end < len && is_white(utf8_cp((const uint8_t *)s + end, len - end, &ul)))
		end += ul;
	*ms = start;
	*me = end;
	*id = at->id;
	return 1;
}

int tokenizer_encode(const struct tokenizer *t, const char *text, size_t len, unsigned flags,
		     struct tok_ids *out)
{
	assert(t && out && (text || !len));
	size_t n0 = out->n, seg = 0, i = 0;
	bool specials = !(flags & TOK_SPECIAL_AS_TEXT);
	struct enc e = {.t = t, .out = out};
	int rc = 0;
	if (flags & TOK_ADD_BOS) {
		if (t->bos_id < 0)
			return -ENOENT;
		rc = ids_push(out, (uint32_t)t->bos_id);
		if (rc)
			goto out;
	}
	while (t->n_added && i < len) {
		size_t ms = 0, me = 0;
		uint32_t id = 0;
		rc = added_match(&e, text, len, i, seg, specials, &ms, &me, &id);
		if (rc < 0)
			goto out;
		if (!rc) {
			i++;
			continue;
		}
		rc = encode_text(&e, text + seg, ms - seg, seg == 0);
		if (!rc)
			rc = ids_push(out, id);
		if (rc)
			goto out;
		seg = i = me;
	}
	rc = encode_text(&e, text + seg, len - seg, seg == 0);
out:
	enc_free(&e);
	if (rc)
		out->n = n0;
	return rc;
}

/* ---- decoding ---- */

struct tok_decoder {
	const struct tokenizer *t;
	unsigned flags;
	uint8_t held[4]; /* an incomplete UTF-8 sequence from the end of the last piece */
	size_t n_held;
	unsigned strip_left; /* leading strip characters still to drop (Strip after Fuse) */
	uint64_t n_fed;	     /* tokens decoded in this sequence (skipped ones do not count) */
	struct buf out, work, first_a, first_b;
};

static void decoder_init(struct tok_decoder *d, const struct tokenizer *t, unsigned flags)
{
	memset(d, 0, sizeof(*d));
	d->t = t;
	d->flags = flags;
	d->strip_left = t->strip_start;
}

static void decoder_free(struct tok_decoder *d)
{
	buf_free(&d->out);
	buf_free(&d->work);
	buf_free(&d->first_a);
	buf_free(&d->first_b);
}

/* Appends held + p[0..n) to d->out as UTF-8: complete sequences as they are, invalid ones as
 * U+FFFD (or raw), an incomplete tail held back unless final. */
static int emit_utf8(struct tok_decoder *d, const char *p, size_t n, bool final)
{
	struct buf *w = &d->work;
	w->len = 0;
	int rc = buf_put(w, d->held, d->n_held);
	if (!rc)
		rc = buf_put(w, p, n);
	if (!rc)
		rc = buf_reserve(&d->out, 3 * w->len);
	if (rc)
		return rc;
	d->n_held = 0;
	const uint8_t *s = (const uint8_t *)w->p;
	for (size_t i = 0, ul; i < w->len; i += ul) {
		int r = utf8_unit(s + i, w->len - i, &ul);
		if (r == U8_INCOMPLETE && !final) {
			memcpy(d->held, s + i, ul);
			d->n_held = ul;
			break;
		}
		if (r == U8_VALID || (d->flags & TOK_DECODE_RAW)) {
			memcpy(d->out.p + d->out.len, s + i, ul);
			d->out.len += ul;
		} else {
			memcpy(d->out.p + d->out.len, "\xef\xbf\xbd", 3);
			d->out.len += 3;
		}
	}
	return 0;
}

static int decoder_feed(struct tok_decoder *d, uint32_t id)
{
	const struct tokenizer *t = d->t;
	if (id >= t->n_ids || t->entries[id].kind == ENTRY_HOLE)
		return -EINVAL;
	const struct entry *en = &t->entries[id];
	if ((d->flags & TOK_SKIP_SPECIAL) && en->special)
		return 0;
	const char *p = t->arena + en->dec_off;
	size_t n = en->dec_len;
	if (t->dec_first && d->n_fed == 0 && en->kind == ENTRY_VOCAB) {
		int rc = decode_piece(t, t->arena + en->off, en->len, true, &d->first_a, &d->first_b, &p, &n);
		if (rc)
			return rc;
	}
	d->n_fed++;
	while (d->strip_left && has_prefix(p, n, t->strip_char, t->strip_len)) {
		p += t->strip_len;
		n -= t->strip_len;
		d->strip_left--;
	}
	if (n)
		d->strip_left = 0;
	return emit_utf8(d, p, n, false);
}

static int decoder_flush(struct tok_decoder *d)
{
	int rc = emit_utf8(d, NULL, 0, true);
	d->n_held = 0;
	d->n_fed = 0;
	d->strip_left = d->t->strip_start;
	return rc;
}

struct tok_decoder *tok_decoder_create(const struct tokenizer *t, unsigned flags)
{
	assert(t);
	struct tok_decoder *d = malloc(sizeof(*d));
	if (d)
		decoder_init(d, t, flags);
	return d;
}

int tok_decoder_feed(struct tok_decoder *d, uint32_t id, const char **bytes, size_t *len)
{
	assert(d && bytes && len);
	d->out.len = 0;
	int rc = decoder_feed(d, id);
	*bytes = d->out.p ? d->out.p : "";
	*len = rc ? 0 : d->out.len;
	return rc;
}

int tok_decoder_flush(struct tok_decoder *d, const char **bytes, size_t *len)
{
	assert(d && bytes && len);
	d->out.len = 0;
	int rc = decoder_flush(d);
	*bytes = d->out.p ? d->out.p : "";
	*len = rc ? 0 : d->out.len;
	return rc;
}

void tok_decoder_destroy(struct tok_decoder **dp)
{
	if (!dp || !*dp)
		return;
	decoder_free(*dp);
	free(*dp);
	*dp = NULL;
}

int tokenizer_decode(const struct tokenizer *t, const uint32_t *ids, size_t n, unsigned flags, char **out,
		     size_t *len)
{
	assert(t && out && (ids || !n));
	struct tok_decoder d;
	int rc = 0;
	decoder_init(&d, t, flags);
	*out = NULL;
	/* The decoder appends to d.out across calls here: one buffer for the whole text. */
	for (size_t i = 0; i < n && !rc; i++)
		rc = decoder_feed(&d, ids[i]);
	if (!rc)
		rc = decoder_flush(&d);
	if (!rc)
		rc = buf_put(&d.out, "", 1);
	if (!rc) {
		*out = d.out.p;
		if (len)
			*len = d.out.len - 1;
		d.out.p = NULL;
	}
	decoder_free(&d);
	return rc;
}

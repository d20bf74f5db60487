/* manifest_gguf_vocab.c - tokenizer.json text made from a GGUF file's tokenizer.ggml.* keys, in
 * the Hugging Face layout the project's tokenizer loads (common/tokenizer/tokenizer.h), so that
 * the runner gets a GGUF model's tokenizer the way it gets a checkpoint's tokenizer.json.
 *
 * tokenizer.ggml.model "gpt2" (byte-level BPE): tokens, token_type and merges. Tokens of type 3
 * (control) and 2 (unknown) become special added tokens, type 4 (user defined) added tokens (what
 * llama.cpp splits out of the text before it tokenizes), the others the vocab;
 * the merges stay in their order. The pre-tokenizer comes from tokenizer.ggml.pre: "llama-bpe"
 * (Llama 3) is the Split regex and ByteLevel of Llama 3's tokenizer.json with ignore_merges (what
 * llama.cpp does for it), "smaug-bpe" the same regex without ignore_merges, "gpt-2" ByteLevel with
 * the GPT-2 pattern. Other values have no exact equivalent here: no tokenizer, and a note.
 *
 * tokenizer.ggml.model "llama" (SentencePiece): tokens, scores and token_type become the BPE that
 * Hugging Face's converter makes of a SentencePiece model (Llama 2's tokenizer.json): every token
 * in the vocab, control and user-defined ones also added tokens; merges made from the scores (each
 * normal token split in two normal tokens at every character boundary, ranked by the token's
 * score, best first, ties by id; only normal tokens, and pieces up to 1 KiB); byte fallback when
 * there are byte tokens (<0xNN>); unk_token from tokenizer.ggml.unknown_token_id, else the first
 * token of type 2 (unknown); the legacy normalizer (Prepend "▁" unless
 * tokenizer.ggml.add_space_prefix is false, spaces to "▁") and its decoder.
 *
 * Both: a TemplateProcessing post_processor that puts the BOS token first unless
 * tokenizer.ggml.add_bos_token is false. Whatever would make a file the tokenizer refuses (an
 * empty or non-UTF-8 piece, a piece given twice, a merge of unknown pieces, ...) is caught here:
 * the model then loads without a tokenizer and the note says why. */
#include "common/manifest_internal.h"

#include <assert.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/gguf.h"
#include "common/util.h"

/* llama.cpp's token types (tokenizer.ggml.token_type). */
enum {
	TT_UNDEFINED = 0,
	TT_NORMAL = 1,
	TT_UNKNOWN = 2,
	TT_CONTROL = 3,
	TT_USER_DEFINED = 4,
	TT_UNUSED = 5,
	TT_BYTE = 6,
};

#define SP_SPACE	"\xe2\x96\x81" /* U+2581, SentencePiece's space */
#define MERGE_PIECE_MAX 1024	       /* longer pieces are never split into merges */
/* A SentencePiece vocabulary's merges: at most SP_MERGES_PER_TOKEN a token plus SP_MERGES_SLACK
 * (Llama 2's 32000 tokens make about 61000), and at most SP_MERGE_WORK bytes looked at to find them
 * (every cut of every piece: a vocabulary of long pieces made of shorter ones is quadratic in
 * them, and took minutes and gigabytes); past either, no tokenizer. */
#define SP_MERGES_PER_TOKEN 8
#define SP_MERGES_SLACK 32768
#define SP_MERGE_WORK (1ull << 31)
#define GIVE_UP		1	       /* a step's return: no tokenizer, the note says why */

/* Llama 3's split pattern, as its tokenizer.json has it. */
static const char llama3_pattern[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

struct conv {
	const struct gguf *g;
	const struct gguf_str *tok; /* n tokens */
	uint64_t n;
	const int32_t *type; /* n types, or NULL (all normal) */
	json_t *vocab, *added, *merges;
	char *note;
	size_t notelen;
	char *err;
	size_t errlen;
};

static int give_up(struct conv *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int give_up(struct conv *c, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(c->note, c->notelen, fmt, ap);
	va_end(ap);
	return GIVE_UP;
}

static int oom(struct conv *c)
{
	return errorf(c->err, c->errlen, -ENOMEM, "%s: out of memory making its tokenizer", gguf_path(c->g));
}

static int32_t type_of(const struct conv *c, uint64_t id)
{
	return c->type ? c->type[id] : TT_NORMAL;
}

static bool is_normal(int32_t t)
{
	return t == TT_NORMAL || t == TT_UNDEFINED;
}

/* Well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF) without NUL. */
static bool utf8_ok(const unsigned char *s, uint64_t n)
{
	for (uint64_t i = 0; i < n;) {
		unsigned char b = s[i];
		uint32_t len, cp, min;
		if (b == 0)
			return false;
		if (b < 0x80) {
			i++;
			continue;
		}
		if (b >= 0xc2 && b <= 0xdf)
			len = 2, cp = b & 0x1f, min = 0x80;
		else if (b >= 0xe0 && b <= 0xef)
			len = 3, cp = b & 0x0f, min = 0x800;
		else if (b >= 0xf0 && b <= 0xf4)
			len = 4, cp = b & 0x07, min = 0x10000;
		else
			return false;
		if (n - i < len)
			return false;
		for (uint32_t k = 1; k < len; k++) {
			if ((s[i + k] & 0xc0) != 0x80)
				return false;
			cp = cp << 6 | (s[i + k] & 0x3f);
		}
		if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
			return false;
		i += len;
	}
	return true;
}

/* Sets obj[key] = value (consumed), checking the key the way the tokenizer's loader will. */
static int set_new(struct conv *c, json_t *obj, const char *key, json_t *value)
{
	if (!value || json_object_set_new(obj, key, value))
		return oom(c);
	return 0;
}

/* The tokens, their types and the optional keys every model reads. */
static int read_tokens(struct conv *c)
{
	char why[200];
	int rc = gguf_get_str_array(c->g, "tokenizer.ggml.tokens", &c->tok, &c->n, why, sizeof(why));
	if (rc)
		return give_up(c, "no tokenizer: %s", why);
	if (c->n == 0)
		return give_up(c, "no tokenizer: tokenizer.ggml.tokens is empty");
	if (gguf_find_key(c->g, "tokenizer.ggml.token_type") >= 0) {
		uint64_t nt;
		rc = gguf_get_i32_array(c->g, "tokenizer.ggml.token_type", &c->type, &nt, why, sizeof(why));
		if (rc)
			return give_up(c, "no tokenizer: %s", why);
		if (nt != c->n)
			return give_up(c, "no tokenizer: tokenizer.ggml.token_type has %llu entries for %llu tokens",
				       (unsigned long long)nt, (unsigned long long)c->n);
	}
	for (uint64_t id = 0; id < c->n; id++) {
		const struct gguf_str *t = &c->tok[id];
		if (!t->len || !utf8_ok((const unsigned char *)t->s, t->len))
			return give_up(c, "no tokenizer: token %llu is %s", (unsigned long long)id,
				       t->len ? "not valid UTF-8 (or holds a NUL)" : "empty");
	}
	return 0;
}

/* A token into the vocab, unless it is there already (then: give up, the tokenizer would refuse). */
static int vocab_add(struct conv *c, uint64_t id)
{
	const char *s = c->tok[id].s;
	const json_t *prev = json_object_get(c->vocab, s);
	if (prev)
		return give_up(c, "no tokenizer: tokens %lld and %llu are the same piece \"%.40s\"",
			       json_integer_value(prev), (unsigned long long)id, s);
	return set_new(c, c->vocab, s, json_integer(id));
}

/* A control, unknown or user-defined token into added_tokens (special unless user-defined). */
static int added_add(struct conv *c, uint64_t id, json_t *seen)
{
	const char *s = c->tok[id].s;
	if (json_object_get(seen, s))
		return give_up(c, "no tokenizer: the added token \"%.40s\" appears twice (id %llu)", s,
			       (unsigned long long)id);
	int rc = set_new(c, seen, s, json_integer(id));
	if (rc)
		return rc;
	json_t *a =
	    json_pack("{s:I, s:s, s:b, s:b, s:b, s:b, s:b}", "id", (json_int_t)id, "content", s, "single_word", 0,
		      "lstrip", 0, "rstrip", 0, "normalized", 0, "special", type_of(c, id) != TT_USER_DEFINED);
	if (!a || json_array_append_new(c->added, a))
		return oom(c);
	return 0;
}

/* The vocab and added tokens; in_vocab_too: added tokens are in the vocab as well (SentencePiece). */
static int split_tokens(struct conv *c, bool in_vocab_too)
{
	json_t *seen = json_object();
	if (!seen)
		return oom(c);
	int rc = 0;
	for (uint64_t id = 0; id < c->n && !rc; id++) {
		int32_t t = type_of(c, id);
		/* What llama.cpp splits out of text before tokenizing: control, user-defined and unknown. */
		bool added = t == TT_CONTROL || t == TT_USER_DEFINED || t == TT_UNKNOWN;
		if (!added || in_vocab_too)
			rc = vocab_add(c, id);
		if (!rc && added)
			rc = added_add(c, id, seen);
	}
	/* An added token's text in the vocab under another id would encode one way and decode another. */
	const char *key;
	json_t *val;
	json_object_foreach(seen, key, val)
	{
		if (rc)
			break;
		const json_t *v = json_object_get(c->vocab, key);
		if (v && json_integer_value(v) != json_integer_value(val))
			rc = give_up(c, "no tokenizer: the added token \"%.40s\" (id %lld) is also token %lld", key,
				     json_integer_value(val), json_integer_value(v));
	}
	json_decref(seen);
	if (!rc && json_object_size(c->vocab) == 0)
		rc = give_up(c, "no tokenizer: every token is a control or user-defined one (the vocab is empty)");
	return rc;
}

/* ---- byte-level BPE ---- */

static int gpt2_merges(struct conv *c)
{
	const struct gguf_str *m;
	uint64_t n;
	char why[200], *joined = NULL;
	size_t cap = 0;
	if (gguf_get_str_array(c->g, "tokenizer.ggml.merges", &m, &n, why, sizeof(why)) != 0)
		return give_up(c, "no tokenizer: %s", why);
	int rc = 0;
	for (uint64_t i = 0; i < n && !rc; i++) {
		const char *s = m[i].s, *sp = memchr(s, ' ', m[i].len);
		size_t an = sp ? (size_t)(sp - s) : 0, bn = sp ? m[i].len - an - 1 : 0;
		if (!sp || !an || !bn || memchr(sp + 1, ' ', bn) || strlen(s) != m[i].len) {
			rc = give_up(c, "no tokenizer: merge %llu \"%.40s\" is not two pieces \"a b\"",
				     (unsigned long long)i, s);
			break;
		}
		if (an + bn + 1 > cap) {
			cap = an + bn + 64;
			char *p = realloc(joined, cap);
			if (!p) {
				rc = oom(c);
				break;
			}
			joined = p;
		}
		memcpy(joined, s, an);
		joined[an] = 0;
		bool left = json_object_get(c->vocab, joined) != NULL;
		memcpy(joined + an, sp + 1, bn);
		joined[an + bn] = 0;
		if (!left || !json_object_get(c->vocab, sp + 1) || !json_object_get(c->vocab, joined)) {
			rc = give_up(c, "no tokenizer: merge %llu \"%.40s\" names a piece that is not in the vocab",
				     (unsigned long long)i, s);
			break;
		}
		json_t *v = json_stringn(s, m[i].len);
		if (!v || json_array_append_new(c->merges, v))
			rc = oom(c);
	}
	free(joined);
	return rc;
}

static int gpt2_model(struct conv *c, json_t *root)
{
	const char *pre = NULL;
	char why[200];
	if (gguf_find_key(c->g, "tokenizer.ggml.pre") >= 0 &&
	    gguf_get_str(c->g, "tokenizer.ggml.pre", &pre, NULL, why, sizeof(why)) != 0)
		return give_up(c, "no tokenizer: %s", why);
	json_t *pt;
	bool ignore_merges = false;
	/* llama.cpp reads "llama3" and "llama-v3" as "llama-bpe". */
	bool llama3 = pre && (!strcmp(pre, "llama-bpe") || !strcmp(pre, "llama3") || !strcmp(pre, "llama-v3"));
	if (llama3 || (pre && !strcmp(pre, "smaug-bpe"))) {
		ignore_merges = llama3;
		pt = json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b, s:b}]}", "type", "Sequence",
			       "pretokenizers", "type", "Split", "pattern", "Regex", llama3_pattern, "behavior",
			       "Isolated", "invert", 0, "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1,
			       "use_regex", 0);
	} else if (pre && !strcmp(pre, "gpt-2")) {
		pt = json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1,
			       "use_regex", 1);
	} else {
		return give_up(c,
			       "no tokenizer: tokenizer.ggml.pre \"%.40s\" is not supported (supported: llama-bpe (llama3, "
			       "llama-v3), smaug-bpe, gpt-2)",
			       pre ? pre : "(none)");
	}
	int rc = set_new(c, root, "pre_tokenizer", pt);
	if (!rc)
		rc = set_new(c, root, "decoder",
			     json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 1,
				       "trim_offsets", 1, "use_regex", 1));
	if (!rc)
		rc = split_tokens(c, false);
	if (!rc)
		rc = gpt2_merges(c);
	if (!rc)
		rc = set_new(c, root, "model",
			     json_pack("{s:s, s:n, s:n, s:n, s:n, s:b, s:b, s:b, s:O, s:O}", "type", "BPE", "dropout",
				       "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", 0,
				       "byte_fallback", 0, "ignore_merges", ignore_merges, "vocab", c->vocab, "merges",
				       c->merges));
	return rc;
}

/* ---- SentencePiece ---- */

struct sp_merge {
	float score; /* the merged token's */
	uint32_t id, left, right;
};

static int cmp_merge(const void *pa, const void *pb)
{
	const struct sp_merge *a = pa, *b = pb;
	if (a->score != b->score)
		return a->score > b->score ? -1 : 1;
	if (a->id != b->id)
		return a->id < b->id ? -1 : 1;
	if (a->left != b->left)
		return a->left < b->left ? -1 : 1;
	return a->right < b->right ? -1 : a->right > b->right;
}

/* The normal token spelled by len bytes at s, or -1. */
static int64_t normal_id(struct conv *c, const char *s, size_t len, char *buf)
{
	memcpy(buf, s, len);
	buf[len] = 0;
	const json_t *v = json_object_get(c->vocab, buf);
	if (!v || !is_normal(type_of(c, (uint64_t)json_integer_value(v))))
		return -1;
	return json_integer_value(v);
}

/* Merges from the scores, as Hugging Face's SentencePiece converter makes them. */
static int sp_merges(struct conv *c, const float *score)
{
	struct sp_merge *v = NULL;
	size_t n = 0, cap = 0;
	char buf[MERGE_PIECE_MAX + 1];
	int rc = 0;
	const uint64_t most = SP_MERGES_PER_TOKEN * c->n + SP_MERGES_SLACK;
	uint64_t work = 0;
	for (uint64_t id = 0; id < c->n && !rc; id++) {
		const struct gguf_str *t = &c->tok[id];
		if (!is_normal(type_of(c, id)) || t->len > MERGE_PIECE_MAX)
			continue;
		work += (uint64_t)t->len * t->len;
		if (work > SP_MERGE_WORK) {
			rc = give_up(c, "no tokenizer: its pieces are too long to make merges of (past token %llu)",
				     (unsigned long long)id);
			break;
		}
		for (size_t cut = 1; cut < t->len && !rc; cut++) {
			if (((unsigned char)t->s[cut] & 0xc0) == 0x80)
				continue; /* inside a character */
			int64_t l = normal_id(c, t->s, cut, buf),
				r = l >= 0 ? normal_id(c, t->s + cut, t->len - cut, buf) : -1;
			if (r < 0)
				continue;
			if (n == most) {
				rc = give_up(c, "no tokenizer: its %llu tokens make more than %llu merges",
					     (unsigned long long)c->n, (unsigned long long)most);
				break;
			}
			if (n == cap) {
				cap = cap ? 2 * cap : 1024;
				struct sp_merge *p = realloc(v, cap * sizeof(*p));
				if (!p) {
					rc = oom(c);
					break;
				}
				v = p;
			}
			v[n++] = (struct sp_merge){score[id], (uint32_t)id, (uint32_t)l, (uint32_t)r};
		}
	}
	if (!rc && n) /* no merges: v is NULL, which qsort must not get */
		qsort(v, n, sizeof(*v), cmp_merge);
	for (size_t i = 0; i < n && !rc; i++) {
		json_t *pair = json_pack("[s, s]", c->tok[v[i].left].s, c->tok[v[i].right].s);
		if (!pair || json_array_append_new(c->merges, pair))
			rc = oom(c);
	}
	free(v);
	return rc;
}

static int sp_model(struct conv *c, json_t *root)
{
	const float *score;
	uint64_t ns;
	char why[200];
	if (gguf_get_f32_array(c->g, "tokenizer.ggml.scores", &score, &ns, why, sizeof(why)) != 0)
		return give_up(c, "no tokenizer: %s", why);
	if (ns != c->n)
		return give_up(c, "no tokenizer: tokenizer.ggml.scores has %llu entries for %llu tokens",
			       (unsigned long long)ns, (unsigned long long)c->n);
	bool byte_fallback = false;
	for (uint64_t id = 0; id < c->n; id++) {
		if (!isfinite(score[id]))
			return give_up(c, "no tokenizer: the score of token %llu is %g", (unsigned long long)id,
				       (double)score[id]);
		byte_fallback |= type_of(c, id) == TT_BYTE;
	}
	bool prefix = true;
	if (gguf_find_key(c->g, "tokenizer.ggml.add_space_prefix") >= 0 &&
	    gguf_get_bool(c->g, "tokenizer.ggml.add_space_prefix", &prefix, why, sizeof(why)) != 0)
		return give_up(c, "no tokenizer: %s", why);
	const char *unk = NULL;
	uint32_t unk_id;
	if (gguf_find_key(c->g, "tokenizer.ggml.unknown_token_id") >= 0) {
		if (gguf_get_u32(c->g, "tokenizer.ggml.unknown_token_id", &unk_id, why, sizeof(why)) != 0)
			return give_up(c, "no tokenizer: %s", why);
		if (unk_id >= c->n)
			return give_up(c, "no tokenizer: tokenizer.ggml.unknown_token_id %u is not a token", unk_id);
		unk = c->tok[unk_id].s;
	}
	for (uint64_t id = 0; id < c->n && !unk; id++) /* without the key: the token of type unknown */
		if (type_of(c, id) == TT_UNKNOWN)
			unk = c->tok[id].s;
	int rc = split_tokens(c, true);
	if (!rc)
		rc = sp_merges(c, score);
	json_t *replace =
	    json_pack("{s:s, s:{s:s}, s:s}", "type", "Replace", "pattern", "String", " ", "content", SP_SPACE);
	if (!rc)
		rc = set_new(c, root, "normalizer",
			     prefix ? json_pack("{s:s, s:[{s:s, s:s}, O]}", "type", "Sequence", "normalizers", "type",
						"Prepend", "prepend", SP_SPACE, replace)
				    : json_incref(replace));
	json_decref(replace);
	json_t *dec =
	    json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s}, {s:s}]}", "type", "Sequence", "decoders", "type", "Replace",
		      "pattern", "String", SP_SPACE, "content", " ", "type", "ByteFallback", "type", "Fuse");
	if (dec && prefix) { /* the space the normalizer put first goes again */
		json_t *strip =
		    json_pack("{s:s, s:s, s:i, s:i}", "type", "Strip", "content", " ", "start", 1, "stop", 0);
		if (!strip || json_array_append_new(json_object_get(dec, "decoders"), strip))
			json_decref(dec), dec = NULL;
	}
	if (!rc)
		rc = set_new(c, root, "decoder", dec);
	else
		json_decref(dec);
	if (!rc)
		rc = set_new(c, root, "model",
			     json_pack("{s:s, s:n, s:s?, s:n, s:n, s:b, s:b, s:b, s:O, s:O}", "type", "BPE", "dropout",
				       "unk_token", unk, "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
				       1, "byte_fallback", byte_fallback, "ignore_merges", 0, "vocab", c->vocab,
				       "merges", c->merges));
	return rc;
}

/* ---- the whole ---- */

/* TemplateProcessing with BOS first, or with nothing first when add_bos_token is false. */
static int post_processor(struct conv *c, json_t *root)
{
	uint32_t bos;
	bool add = true;
	char why[200];
	if (gguf_get_u32(c->g, "tokenizer.ggml.bos_token_id", &bos, why, sizeof(why)) != 0 || bos >= c->n)
		return 0; /* no BOS: tokenizer_bos() is -1 either way */
	if (gguf_find_key(c->g, "tokenizer.ggml.add_bos_token") >= 0 &&
	    gguf_get_bool(c->g, "tokenizer.ggml.add_bos_token", &add, why, sizeof(why)) != 0)
		return give_up(c, "no tokenizer: %s", why);
	const char *piece = c->tok[bos].s;
	json_t *pp;
	if (add)
		pp = json_pack("{s:s, s:[{s:{s:s, s:i}}, {s:{s:s, s:i}}], s:[{s:{s:s, s:i}}, {s:{s:s, s:i}}, "
			       "{s:{s:s, s:i}}, {s:{s:s, s:i}}], s:{s:{s:s, s:[I], s:[s]}}}",
			       "type", "TemplateProcessing", "single", "SpecialToken", "id", piece, "type_id", 0,
			       "Sequence", "id", "A", "type_id", 0, "pair", "SpecialToken", "id", piece, "type_id", 0,
			       "Sequence", "id", "A", "type_id", 0, "SpecialToken", "id", piece, "type_id", 1,
			       "Sequence", "id", "B", "type_id", 1, "special_tokens", piece, "id", piece, "ids",
			       (json_int_t)bos, "tokens", piece);
	else
		pp = json_pack("{s:s, s:[{s:{s:s, s:i}}], s:[{s:{s:s, s:i}}, {s:{s:s, s:i}}], s:{}}", "type",
			       "TemplateProcessing", "single", "Sequence", "id", "A", "type_id", 0, "pair", "Sequence",
			       "id", "A", "type_id", 0, "Sequence", "id", "B", "type_id", 1, "special_tokens");
	return set_new(c, root, "post_processor", pp);
}

static int convert(const struct gguf *g, char **json, size_t *len, char *note, size_t notelen, char *err, size_t errlen)
{
	struct conv c = {.g = g, .note = note, .notelen = notelen, .err = err, .errlen = errlen};
	const char *model;
	char why[200];
	if (gguf_find_key(g, "tokenizer.ggml.model") < 0) {
		give_up(&c, "no tokenizer in the file (no tokenizer.ggml.model)");
		return 0;
	}
	if (gguf_get_str(g, "tokenizer.ggml.model", &model, NULL, why, sizeof(why)) != 0) {
		give_up(&c, "no tokenizer: %s", why);
		return 0;
	}
	bool sp = !strcmp(model, "llama");
	if (!sp && strcmp(model, "gpt2")) {
		give_up(&c, "no tokenizer: tokenizer.ggml.model \"%.40s\" is not supported (supported: gpt2, llama)",
			model);
		return 0;
	}
	int rc = read_tokens(&c);
	if (rc)
		return rc < 0 ? rc : 0;
	json_t *root = json_pack("{s:s, s:n, s:n, s:n, s:n}", "version", "1.0", "truncation", "padding", "normalizer",
				 "pre_tokenizer");
	c.vocab = json_object();
	c.added = json_array();
	c.merges = json_array();
	if (!root || !c.vocab || !c.added || !c.merges) {
		rc = oom(&c);
		goto out;
	}
	rc = sp ? sp_model(&c, root) : gpt2_model(&c, root);
	if (!rc)
		rc = set_new(&c, root, "added_tokens", json_incref(c.added));
	if (!rc)
		rc = post_processor(&c, root);
	if (rc)
		goto out;
	*json = json_dumps(root, JSON_COMPACT);
	if (!*json) {
		rc = oom(&c);
		goto out;
	}
	*len = strlen(*json);
out:
	json_decref(root);
	json_decref(c.vocab);
	json_decref(c.added);
	json_decref(c.merges);
	return rc == GIVE_UP ? 0 : rc;
}

int mf_gguf_tokenizer_json(const struct gguf *g, char **json, size_t *len, char *note, size_t notelen, char *err,
			   size_t errlen)
{
	*json = NULL;
	*len = 0;
	note[0] = 0;
	int rc = convert(g, json, len, note, notelen, err, errlen);
	if (!rc && !*json) {
		static const char tail[] = ": the model takes token ids only";
		assert(notelen > sizeof(tail));
		size_t n = strlen(note);
		if (n + sizeof(tail) > notelen)
			n = notelen - sizeof(tail); /* cut the reason, keep the consequence */
		memcpy(note + n, tail, sizeof(tail));
	}
	return rc;
}

/* encode.c - tokenizer_encode: added tokens split out of the raw text (longest match, lstrip,
 * rstrip, single_word), the text between them normalized and pre-tokenized; the id array. */
#include "common/tokenizer/tokenizer_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

void tok_ids_free(struct tok_ids *v)
{
	if (!v)
		return;
	free(v->ids);
	memset(v, 0, sizeof(*v));
}

int tok_ids_push(struct tok_ids *v, uint32_t id)
{
	if (v->n == v->cap) {
		size_t cap = v->cap ? v->cap * 2 : 64;
		uint32_t *p = tok_realloc(v->ids, cap * sizeof(*p));
		if (!p)
			return -ENOMEM;
		v->ids = p;
		v->cap = cap;
	}
	v->ids[v->n++] = id;
	return 0;
}

static void enc_free(struct enc *e)
{
	for (unsigned i = 0; i < MAX_STEPS; i++) {
		pcre2_match_data_free(e->md[i]);
		tok_buf_free(&e->step[i]);
	}
	pcre2_match_data_free(e->word_md);
	tok_buf_free(&e->norm[0]);
	tok_buf_free(&e->norm[1]);
	tok_buf_free(&e->mapped);
	free(e->sym);
	free(e->heap);
}

/* Normalizes and pre-tokenizes the text between added tokens. */
static int encode_text(struct enc *e, const char *s, size_t len, bool at_start)
{
	if (!len)
		return 0;
	int rc = tok_normalize(e, &s, &len);
	if (rc)
		return rc;
	return tok_pretok(e, 0, s, len, at_start);
}

/* Is the character at s + pos (after: the one starting there; else the one ending there) a
 * word character for single_word? */
static int is_word_char(struct enc *e, const char *s, size_t len, size_t pos, bool after, bool *word)
{
	size_t ul;
	const uint8_t *u = (const uint8_t *)s;
	size_t start = pos;
	if (!after) {
		tok_utf8_cp_before(u, pos, &ul);
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
		return tok_regex_error(m);
	*word = m >= 0;
	return 0;
}

/* The longest added token at s + i (special ones only when specials), extended by its
 * lstrip/rstrip over whitespace (not back past seg). Returns 1 with [*ms, *me) and *id, 0 when
 * none, or -errno. */
static int added_match(struct enc *e, const char *s, size_t len, size_t i, size_t seg, bool specials,
		       const uint8_t *plain, size_t *ms, size_t *me, uint32_t *id)
{
	const struct tokenizer *t = e->t;
	uint32_t node = t->root[(uint8_t)s[i]];
	int32_t best = -1;
	size_t end = i, k = i;
	bool clean = true; /* no byte of [i, k) is marked plain */
	while (node) {
		k++;
		clean = clean && (!plain || !plain[k - 1]);
		int32_t a = t->trie[node].added;
		if (a >= 0 && (!t->added[a].special || (specials && clean))) {
			best = a;
			end = k;
		}
		if (k >= len)
			break;
		node = tok_trie_child(t, node, (uint8_t)s[k]);
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
	while (at->lstrip && start > seg && tok_is_white(tok_utf8_cp_before((const uint8_t *)s, start, &ul)) &&
	       start - ul >= seg)
		start -= ul;
	while (at->rstrip && end < len && tok_is_white(tok_utf8_cp((const uint8_t *)s + end, len - end, &ul)))
		end += ul;
	*ms = start;
	*me = end;
	*id = at->id;
	return 1;
}

int tokenizer_encode(const struct tokenizer *t, const char *text, size_t len, unsigned flags,
		     struct tok_ids *out)
{
	return tokenizer_encode_marked(t, text, len, NULL, flags, out);
}

int tokenizer_encode_marked(const struct tokenizer *t, const char *text, size_t len, const uint8_t *plain,
			    unsigned flags, struct tok_ids *out)
{
	assert(t && out && (text || !len));
	size_t n0 = out->n, seg = 0, i = 0;
	bool specials = !(flags & TOK_SPECIAL_AS_TEXT);
	struct enc e = {.t = t, .out = out};
	int rc = 0;
	if (flags & TOK_ADD_BOS) {
		if (t->bos_id < 0)
			return -ENOENT;
		rc = tok_ids_push(out, (uint32_t)t->bos_id);
		if (rc)
			goto out;
	}
	while (t->n_added && i < len) {
		size_t ms = 0, me = 0;
		uint32_t id = 0;
		rc = added_match(&e, text, len, i, seg, specials, plain, &ms, &me, &id);
		if (rc < 0)
			goto out;
		if (!rc) {
			i++;
			continue;
		}
		rc = encode_text(&e, text + seg, ms - seg, seg == 0);
		if (!rc)
			rc = tok_ids_push(out, id);
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

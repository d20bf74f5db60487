/* pretokenize.c - the pre-tokenizer: Split (a PCRE2 pattern or a literal, Isolated), ByteLevel
 * (optionally the GPT-2 pattern) and Metaspace steps parsed from the file, and run over the text
 * between added tokens, each step cutting or rewriting the pieces of the one before. */
#include "common/tokenizer/tokenizer_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- patterns and the steps ---- */

/* The GPT-2 split pattern, what a ByteLevel pre-tokenizer with use_regex uses. */
static const char gpt2_pattern[] =
	"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

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
	char *out = tok_malloc(n * (wn + 3) + 1);
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
int tok_compile_pattern(struct loader *L, const char *where, const char *pat, size_t n, bool literal,
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

static int sequence_item(struct loader *L, const json_t *p, const char *where, void *arg)
{
	(void)arg;
	return tok_parse_pretok(L, p, where);
}

int tok_parse_pretok(struct loader *L, const json_t *p, const char *where)
{
	struct tokenizer *t = L->t;
	const char *type;
	if (!p || json_is_null(p))
		return 0;
	int rc = tok_get_type(L, p, where, &type);
	if (rc)
		return rc;
	if (!strcmp(type, "Sequence"))
		return tok_parse_sequence(L, p, where, "pretokenizers", sequence_item, NULL);
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
		rc = tok_get_str(L, p, where, "behavior", true, &behavior, NULL);
		if (!rc)
			rc = tok_get_bool(L, p, where, "invert", &invert);
		if (rc)
			return rc;
		if (strcmp(behavior, "Isolated"))
			return LERR(L, -ENOTSUP, "%s: %s behavior %s is not supported (Isolated only)", L->name, where,
				    behavior);
		if (invert)
			return LERR(L, -ENOTSUP, "%s: %s with invert true is not supported", L->name, where);
		if (!json_is_object(pat))
			return LERR(L, -EINVAL, "%s: %s.pattern must be an object like {\"Regex\": \"...\"}, got %s",
				    L->name, where, tok_json_kind(pat));
		literal = json_object_get(pat, "Regex") == NULL;
		rc = tok_get_str(L, pat, where, literal ? "String" : "Regex", true, &text, &n);
		if (rc)
			return rc;
		if (!n)
			return LERR(L, -EINVAL, "%s: %s.pattern is empty", L->name, where);
		s->kind = PRETOK_SPLIT;
		rc = tok_compile_pattern(L, "pre_tokenizer Split", text, n, literal, &s->re);
		if (rc)
			return rc;
	} else if (!strcmp(type, "ByteLevel")) {
		bool use_regex = true, prefix = true;
		rc = tok_get_bool(L, p, where, "use_regex", &use_regex);
		if (!rc)
			rc = tok_get_bool(L, p, where, "add_prefix_space", &prefix);
		if (rc)
			return rc;
		s->kind = PRETOK_BYTELEVEL;
		s->prefix_space = prefix;
		if (use_regex) {
			rc = tok_compile_pattern(L, "ByteLevel (GPT-2)", gpt2_pattern, strlen(gpt2_pattern), false,
						 &s->re);
			if (rc)
				return rc;
		}
		t->byte_level = true;
	} else {
		bool split = true;
		s->kind = PRETOK_METASPACE;
		rc = tok_get_char(L, p, where, "replacement", "\xe2\x96\x81", s->repl, &s->repl_len);
		if (!rc)
			rc = tok_get_prepend(L, p, where, &s->prepend);
		if (!rc)
			rc = tok_get_bool(L, p, where, "split", &split);
		if (rc)
			return rc;
		s->split = split;
	}
	t->n_pretok++;
	return 0;
}

/* ---- running the steps ---- */

int tok_regex_error(int rc)
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
			return tok_regex_error(m);
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
			rc = tok_pretok(e, i + 1, sub + gap, ms - gap, at_start && from + gap == 0);
			if (rc)
				return rc;
		}
		rc = tok_pretok(e, i + 1, sub + ms, me - ms, at_start && from + ms == 0);
		if (rc)
			return rc;
		gap = off = me;
	}
	return gap < n ? tok_pretok(e, i + 1, sub + gap, n - gap, at_start && from + gap == 0) : 0;
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
			rc = tok_pretok(e, i + 1, s + run, 1, at_start && run == 0);
		pos = run + 1;
	}
	return rc;
}

/* Pre-tokenizer step i over s[0..len); past the last step, the model. at_start: s begins the
 * input (Metaspace's "first" scheme prepends only there). */
int tok_pretok(struct enc *e, unsigned i, const char *s, size_t len, bool at_start)
{
	const struct tokenizer *t = e->t;
	if (!len)
		return 0;
	if (i == t->n_pretok)
		return tok_bpe_word(e, (const uint8_t *)s, len);
	const struct pretok_step *st = &t->pretok[i];
	struct buf *b = &e->step[i];
	int rc;
	switch (st->kind) {
	case PRETOK_SPLIT:
		return regex_split(e, i, st->re, s, len, at_start);
	case PRETOK_BYTELEVEL:
		if (st->prefix_space && s[0] != ' ') {
			b->len = 0;
			rc = tok_buf_put(b, " ", 1);
			if (!rc)
				rc = tok_buf_put(b, s, len);
			if (rc)
				return rc;
			s = b->p;
			len = b->len;
		}
		return st->re ? regex_split(e, i, st->re, s, len, at_start) : tok_pretok(e, i + 1, s, len, at_start);
	case PRETOK_METASPACE: {
		/* Spaces become the replacement, then it is prepended unless already there. */
		bool prepend = st->prepend == PREPEND_ALWAYS || (st->prepend == PREPEND_FIRST && at_start);
		if (s[0] == ' ' || tok_has_prefix(s, len, st->repl, st->repl_len))
			prepend = false;
		b->len = 0;
		rc = prepend ? tok_buf_put(b, st->repl, st->repl_len) : 0;
		if (!rc)
			rc = tok_replace_all_append(s, len, " ", 1, st->repl, st->repl_len, b);
		if (rc)
			return rc;
		if (!st->split)
			return tok_pretok(e, i + 1, b->p, b->len, at_start);
		/* Split before each replacement character, which stays with what follows it. */
		size_t start = 0;
		for (size_t k = 1; k + st->repl_len <= b->len;) {
			if (memcmp(b->p + k, st->repl, st->repl_len) == 0) {
				rc = tok_pretok(e, i + 1, b->p + start, k - start, at_start && start == 0);
				if (rc)
					return rc;
				start = k;
				k += st->repl_len;
			} else {
				k++;
			}
		}
		return tok_pretok(e, i + 1, b->p + start, b->len - start, at_start && start == 0);
	}
	}
	return -EINVAL;
}

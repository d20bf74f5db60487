/* normalize.c - the normalizer: Prepend and Replace (a String pattern) steps, parsed from the
 * file and run over the text between added tokens before it is pre-tokenized. */
#include "common/tokenizer/tokenizer_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int sequence_item(struct loader *L, const json_t *n, const char *where, void *arg)
{
	(void)arg;
	return tok_parse_normalizer(L, n, where);
}

int tok_parse_normalizer(struct loader *L, const json_t *n, const char *where)
{
	struct tokenizer *t = L->t;
	const char *type;
	if (!n || json_is_null(n))
		return 0;
	int rc = tok_get_type(L, n, where, &type);
	if (rc)
		return rc;
	if (!strcmp(type, "Sequence"))
		return tok_parse_sequence(L, n, where, "normalizers", sequence_item, NULL);
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
		rc = tok_get_str(L, n, where, "prepend", true, &from, &from_len);
		if (rc)
			return rc;
		s->kind = NORM_PREPEND;
		s->from = tok_dup_bytes(from, from_len);
		s->from_len = from_len;
		if (!s->from)
			return LERR(L, -ENOMEM, "%s: out of memory", L->name);
	} else {
		rc = tok_get_replace(L, n, where, &from, &from_len, &to, &to_len);
		if (rc)
			return rc;
		s->kind = NORM_REPLACE;
		s->from = tok_dup_bytes(from, from_len);
		s->to = tok_dup_bytes(to, to_len);
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

int tok_normalize(struct enc *e, const char **sp, size_t *lenp)
{
	const struct tokenizer *t = e->t;
	const char *s = *sp;
	size_t len = *lenp;
	for (unsigned k = 0; k < t->n_norm; k++) {
		const struct norm_step *st = &t->norm[k];
		struct buf *b = &e->norm[k & 1];
		int rc;
		b->len = 0;
		if (st->kind == NORM_PREPEND) {
			rc = tok_buf_put(b, st->from, st->from_len);
			if (!rc)
				rc = tok_buf_put(b, s, len);
		} else {
			rc = tok_replace_all_append(s, len, st->from, st->from_len, st->to, st->to_len, b);
		}
		if (rc)
			return rc;
		s = b->p;
		len = b->len;
	}
	*sp = s;
	*lenp = len;
	return 0;
}

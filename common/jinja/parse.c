/* parse.c - template text into a tree of nodes: the text and its tags (with Jinja's whitespace
 * rules as transformers sets them: trim_blocks, lstrip_blocks), then each tag's expression by
 * recursive descent in Jinja's precedence (conditional, or, and, not, comparisons, + -, ~,
 * * / // %, **, unary, then postfix: . [] () | is). */
#include "common/jinja/jinja_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

enum tok_kind { T_END, T_NAME, T_STR, T_INT, T_FLOAT, T_OP };

struct ptok {
	enum tok_kind k;
	const char *p; /* the token's text in the source */
	size_t n;
	char *str; /* T_STR: the value (arena) */
	size_t str_n;
	int64_t i;
	double f;
};

struct parser {
	struct jinja_template *t;
	const char *s; /* the normalized source */
	size_t len, pos;
	/* the tag being parsed: [tag_pos, tag_end) */
	size_t tag_end;
	int line;
	struct ptok tok; /* the current token */
	int depth;
	int rc;
	char *err;
	size_t errlen;
};

static int fail(struct parser *ps, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(struct parser *ps, int rc, const char *fmt, ...)
{
	if (ps->rc)
		return ps->rc;
	char msg[400];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	ps->rc = errorf(ps->err, ps->errlen, rc, "chat template, line %d: %s", ps->line, msg);
	return ps->rc;
}

static void *alloc(struct parser *ps, size_t n)
{
	void *p = arena_alloc(ps->t->mem, n);
	if (!p)
		fail(ps, -ENOMEM, "out of memory");
	else
		memset(p, 0, n);
	return p;
}

static char *dup(struct parser *ps, const char *s, size_t n)
{
	char *p = alloc(ps, n + 1);
	if (p)
		memcpy(p, s, n);
	return p;
}

/* ---- expression tokens ------------------------------------------------------------------- */

static bool is_ws(char c)
{
	return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
static bool is_name0(char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
static bool is_digit(char c)
{
	return c >= '0' && c <= '9';
}

/* Reads a string literal's escapes as Python does for the common ones. */
static int read_string(struct parser *ps, const char *p, size_t n, struct ptok *t)
{
	char *o = alloc(ps, n + 1);
	if (!o)
		return ps->rc;
	size_t k = 0;
	for (size_t i = 0; i < n; i++) {
		if (p[i] != '\\' || i + 1 == n) {
			o[k++] = p[i];
			continue;
		}
		char c = p[++i];
		unsigned long cp;
		int digits = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
		switch (c) {
		case 'n': o[k++] = '\n'; break;
		case 't': o[k++] = '\t'; break;
		case 'r': o[k++] = '\r'; break;
		case '0': o[k++] = '\0'; break;
		case 'a': o[k++] = '\a'; break;
		case 'b': o[k++] = '\b'; break;
		case 'f': o[k++] = '\f'; break;
		case 'v': o[k++] = '\v'; break;
		case '\\': o[k++] = '\\'; break;
		case '\'': o[k++] = '\''; break;
		case '"': o[k++] = '"'; break;
		case '\n': break;
		case 'x':
		case 'u':
		case 'U': {
			if (i + (size_t)digits >= n)
				return fail(ps, -EINVAL, "a truncated \\%c escape in a string", c);
			char hex[9] = {0};
			memcpy(hex, p + i + 1, (size_t)digits);
			for (int d = 0; d < digits; d++)
				if (!strchr("0123456789abcdefABCDEF", hex[d]) || !hex[d])
					return fail(ps, -EINVAL, "a bad \\%c escape in a string", c);
			char *end;
			cp = strtoul(hex, &end, 16);
			if (*end || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
				return fail(ps, -EINVAL, "a bad \\%c escape in a string", c);
			i += (size_t)digits;
			/* UTF-8 of cp (no longer than the escape it replaces) */
			if (cp < 0x80) {
				o[k++] = (char)cp;
			} else if (cp < 0x800) {
				o[k++] = (char)(0xc0 | cp >> 6);
				o[k++] = (char)(0x80 | (cp & 0x3f));
			} else if (cp < 0x10000) {
				o[k++] = (char)(0xe0 | cp >> 12);
				o[k++] = (char)(0x80 | ((cp >> 6) & 0x3f));
				o[k++] = (char)(0x80 | (cp & 0x3f));
			} else {
				o[k++] = (char)(0xf0 | cp >> 18);
				o[k++] = (char)(0x80 | ((cp >> 12) & 0x3f));
				o[k++] = (char)(0x80 | ((cp >> 6) & 0x3f));
				o[k++] = (char)(0x80 | (cp & 0x3f));
			}
			break;
		}
		default: /* an unknown escape stays as written */
			o[k++] = '\\';
			o[k++] = c;
		}
	}
	t->str = o;
	t->str_n = k;
	return 0;
}

static const char *const ops[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "(", ")", "[",
				  "]", "{", "}", ",", ".", ":", "|", "=", "<", ">"};

/* The next token of the current tag into ps->tok. */
static int next(struct parser *ps)
{
	const char *s = ps->s;
	size_t i = ps->pos, e = ps->tag_end;
	while (i < e && is_ws(s[i]))
		i++;
	struct ptok *t = &ps->tok;
	memset(t, 0, sizeof(*t));
	t->p = s + i;
	if (i >= e) {
		t->k = T_END;
		ps->pos = i;
		return 0;
	}
	char c = s[i];
	if (is_name0(c)) {
		size_t j = i + 1;
		while (j < e && (is_name0(s[j]) || is_digit(s[j])))
			j++;
		t->k = T_NAME;
		t->n = j - i;
		ps->pos = j;
		return 0;
	}
	if (is_digit(c)) {
		size_t j = i;
		bool flt = false;
		while (j < e && (is_digit(s[j]) || s[j] == '_'))
			j++;
		if (j + 1 < e && s[j] == '.' && is_digit(s[j + 1])) {
			flt = true;
			j++;
			while (j < e && (is_digit(s[j]) || s[j] == '_'))
				j++;
		}
		if (j < e && (s[j] == 'e' || s[j] == 'E')) {
			size_t k = j + 1;
			if (k < e && (s[k] == '+' || s[k] == '-'))
				k++;
			if (k < e && is_digit(s[k])) {
				flt = true;
				j = k;
				while (j < e && is_digit(s[j]))
					j++;
			}
		}
		char num[64];
		size_t n = 0;
		for (size_t k = i; k < j && n + 1 < sizeof(num); k++)
			if (s[k] != '_')
				num[n++] = s[k];
		num[n] = 0;
		t->n = j - i;
		ps->pos = j;
		errno = 0;
		if (flt) {
			t->k = T_FLOAT;
			t->f = strtod(num, NULL);
		} else {
			t->k = T_INT;
			t->i = strtoll(num, NULL, 10);
			if (errno == ERANGE)
				return fail(ps, -EINVAL, "the number %s is too large", num);
		}
		return 0;
	}
	if (c == '\'' || c == '"') {
		size_t j = i + 1;
		while (j < e && s[j] != c)
			j += s[j] == '\\' ? 2 : 1;
		if (j >= e)
			return fail(ps, -EINVAL, "a string is not closed");
		t->k = T_STR;
		t->n = j + 1 - i;
		ps->pos = j + 1;
		return read_string(ps, s + i + 1, j - i - 1, t);
	}
	for (size_t k = 0; k < ARRAY_SIZE(ops); k++) {
		size_t n = strlen(ops[k]);
		if (i + n <= e && !memcmp(s + i, ops[k], n)) {
			t->k = T_OP;
			t->n = n;
			ps->pos = i + n;
			return 0;
		}
	}
	return fail(ps, -EINVAL, "unexpected character '%c'", c);
}

static bool is_op(const struct parser *ps, const char *op)
{
	return ps->tok.k == T_OP && ps->tok.n == strlen(op) && !memcmp(ps->tok.p, op, ps->tok.n);
}
static bool is_name(const struct parser *ps, const char *name)
{
	return ps->tok.k == T_NAME && ps->tok.n == strlen(name) && !memcmp(ps->tok.p, name, ps->tok.n);
}

static int expect_op(struct parser *ps, const char *op)
{
	if (!is_op(ps, op))
		return fail(ps, -EINVAL, "expected '%s', found '%.*s'", op, ps->tok.k == T_END ? 9 : (int)ps->tok.n,
			    ps->tok.k == T_END ? "the end of the tag" : ps->tok.p);
	return next(ps);
}

/* The current name token copied, then the next token. */
static const char *take_name(struct parser *ps, const char *what)
{
	if (ps->tok.k != T_NAME) {
		fail(ps, -EINVAL, "expected %s, found '%.*s'", what, ps->tok.k == T_END ? 9 : (int)ps->tok.n,
		     ps->tok.k == T_END ? "the end of the tag" : ps->tok.p);
		return NULL;
	}
	const char *n = dup(ps, ps->tok.p, ps->tok.n);
	if (!n || next(ps))
		return NULL;
	return n;
}

static struct node *mk(struct parser *ps, enum node_kind k)
{
	struct node *n = alloc(ps, sizeof(*n));
	if (n) {
		n->kind = k;
		n->line = ps->line;
	}
	return n;
}

/* A growable array of node pointers (in the template's arena). */
struct nvec {
	struct node **v;
	size_t n, cap;
};
static int nvec_push(struct parser *ps, struct nvec *v, struct node *n)
{
	if (v->n == v->cap) {
		size_t cap = v->cap ? v->cap * 2 : 8;
		struct node **nv = alloc(ps, cap * sizeof(*nv));
		if (!nv)
			return ps->rc;
		if (v->n)
			memcpy(nv, v->v, v->n * sizeof(*nv));
		v->v = nv;
		v->cap = cap;
	}
	v->v[v->n++] = n;
	return 0;
}

/* ---- expressions ---------------------------------------------------------------------------- */

static struct node *expr(struct parser *ps);
static struct node *unary(struct parser *ps, bool filters);

static bool depth_in(struct parser *ps)
{
	if (++ps->depth > JINJA_MAX_DEPTH) {
		fail(ps, -E2BIG, "expressions nested deeper than %d", JINJA_MAX_DEPTH);
		return false;
	}
	return true;
}

/* After an item of a bracketed list: a ',' (taken), or the closing one (left for the caller). */
static int item_sep(struct parser *ps, const char *close, const char *what)
{
	if (is_op(ps, ","))
		return next(ps);
	if (!is_op(ps, close))
		return fail(ps, -EINVAL, "expected ',' or '%s' in %s", close, what);
	return 0;
}

/* ( args ) after a callee, a filter or a test: positional, then name=value. */
static int call_args(struct parser *ps, struct node *n)
{
	struct nvec pos = {0}, kwv = {0};
	const char **kwn = NULL;
	size_t kwcap = 0;
	if (expect_op(ps, "("))
		return ps->rc;
	while (!is_op(ps, ")")) {
		if (ps->tok.k == T_END)
			return fail(ps, -EINVAL, "a call's arguments are not closed");
		/* name=value? look ahead without consuming */
		if (ps->tok.k == T_NAME) {
			size_t save = ps->pos;
			struct ptok st = ps->tok;
			const char *nm = dup(ps, ps->tok.p, ps->tok.n);
			if (!nm || next(ps))
				return ps->rc;
			if (is_op(ps, "=")) {
				if (next(ps))
					return ps->rc;
				struct node *v = expr(ps);
				if (!v)
					return ps->rc;
				if (kwv.n == kwcap) {
					size_t cap = kwcap ? kwcap * 2 : 4;
					const char **nk = alloc(ps, cap * sizeof(*nk));
					if (!nk)
						return ps->rc;
					if (kwv.n)
						memcpy(nk, kwn, kwv.n * sizeof(*nk));
					kwn = nk;
					kwcap = cap;
				}
				kwn[kwv.n] = nm;
				if (nvec_push(ps, &kwv, v))
					return ps->rc;
				goto sep;
			}
			ps->pos = save;
			ps->tok = st;
		}
		if (kwv.n)
			return fail(ps, -EINVAL, "a positional argument after a keyword argument");
		struct node *a = expr(ps);
		if (!a || nvec_push(ps, &pos, a))
			return ps->rc;
sep:
		if (item_sep(ps, ")", "a call's arguments"))
			return ps->rc;
	}
	if (next(ps))
		return ps->rc;
	n->args = pos.v;
	n->n_args = pos.n;
	n->kwnames = kwn;
	n->kwvals = kwv.v;
	n->n_kw = kwv.n;
	return 0;
}

static struct node *primary(struct parser *ps)
{
	struct ptok t = ps->tok;
	struct node *n = NULL;
	if (t.k == T_STR) {
		/* adjacent strings join, as in Python */
		if (!(n = mk(ps, E_LIT)))
			return NULL;
		const char *p = t.str;
		size_t len = t.str_n;
		if (next(ps))
			return NULL;
		while (ps->tok.k == T_STR) {
			char *j = alloc(ps, len + ps->tok.str_n + 1);
			if (!j)
				return NULL;
			memcpy(j, p, len);
			memcpy(j + len, ps->tok.str, ps->tok.str_n);
			p = j;
			len += ps->tok.str_n;
			if (next(ps))
				return NULL;
		}
		n->lit = jv_str(p, len, NULL);
		return n;
	}
	if (t.k == T_INT || t.k == T_FLOAT) {
		if (!(n = mk(ps, E_LIT)) || next(ps))
			return NULL;
		n->lit = t.k == T_INT ? jv_int(t.i) : jv_float(t.f);
		return n;
	}
	if (t.k == T_NAME) {
		const char *nm = take_name(ps, "a name");
		if (!nm || !(n = mk(ps, E_LIT)))
			return NULL;
		if (!strcmp(nm, "true") || !strcmp(nm, "True"))
			n->lit = jv_bool(true);
		else if (!strcmp(nm, "false") || !strcmp(nm, "False"))
			n->lit = jv_bool(false);
		else if (!strcmp(nm, "none") || !strcmp(nm, "None"))
			n->lit = jv_none();
		else {
			n->kind = E_NAME;
			n->name = nm;
		}
		return n;
	}
	if (is_op(ps, "(")) {
		if (next(ps))
			return NULL;
		if (is_op(ps, ")")) { /* the empty tuple */
			if (!(n = mk(ps, E_TUPLE)) || next(ps))
				return NULL;
			return n;
		}
		struct node *first = expr(ps);
		if (!first)
			return NULL;
		if (is_op(ps, ")")) {
			if (next(ps))
				return NULL;
			return first;
		}
		struct nvec items = {0};
		if (nvec_push(ps, &items, first))
			return NULL;
		while (is_op(ps, ",")) {
			if (next(ps))
				return NULL;
			if (is_op(ps, ")"))
				break;
			struct node *it = expr(ps);
			if (!it || nvec_push(ps, &items, it))
				return NULL;
		}
		if (expect_op(ps, ")") || !(n = mk(ps, E_TUPLE)))
			return NULL;
		n->args = items.v;
		n->n_args = items.n;
		return n;
	}
	if (is_op(ps, "[")) {
		struct nvec items = {0};
		if (next(ps))
			return NULL;
		while (!is_op(ps, "]")) {
			struct node *it = expr(ps);
			if (!it || nvec_push(ps, &items, it))
				return NULL;
			if (item_sep(ps, "]", "a list"))
				return NULL;
		}
		if (next(ps) || !(n = mk(ps, E_LIST)))
			return NULL;
		n->args = items.v;
		n->n_args = items.n;
		return n;
	}
	if (is_op(ps, "{")) {
		struct nvec keys = {0}, vals = {0};
		if (next(ps))
			return NULL;
		while (!is_op(ps, "}")) {
			struct node *k = expr(ps);
			if (!k || expect_op(ps, ":"))
				return NULL;
			struct node *v = expr(ps);
			if (!v || nvec_push(ps, &keys, k) || nvec_push(ps, &vals, v))
				return NULL;
			if (item_sep(ps, "}", "a dict"))
				return NULL;
		}
		if (next(ps) || !(n = mk(ps, E_DICT)))
			return NULL;
		n->args = keys.v;
		n->n_args = keys.n;
		n->kwvals = vals.v;
		n->n_kw = vals.n;
		return n;
	}
	if (t.k == T_END)
		fail(ps, -EINVAL, "an expression is missing");
	else
		fail(ps, -EINVAL, "unexpected '%.*s'", (int)t.n, t.p);
	return NULL;
}

/* . [] () after a primary */
static struct node *postfix(struct parser *ps, struct node *n)
{
	while (n) {
		if (is_op(ps, ".")) {
			if (next(ps))
				return NULL;
			struct node *a = mk(ps, E_ATTR);
			if (!a)
				return NULL;
			a->a = n;
			if (ps->tok.k == T_INT) { /* x.0 is x[0] */
				a->kind = E_ITEM;
				if (!(a->b = mk(ps, E_LIT)))
					return NULL;
				a->b->lit = jv_int(ps->tok.i);
				if (next(ps))
					return NULL;
			} else if (!(a->name = take_name(ps, "an attribute name"))) {
				return NULL;
			}
			n = a;
		} else if (is_op(ps, "[")) {
			if (next(ps))
				return NULL;
			struct node *parts[3] = {0};
			bool slice = false;
			for (int k = 0; k < 3; k++) {
				if (!is_op(ps, ":") && !is_op(ps, "]") && !(parts[k] = expr(ps)))
					return NULL;
				if (is_op(ps, ":") && k < 2) {
					slice = true;
					if (next(ps))
						return NULL;
					continue;
				}
				break;
			}
			if (expect_op(ps, "]"))
				return NULL;
			struct node *a = mk(ps, slice ? E_SLICE : E_ITEM);
			if (!a)
				return NULL;
			a->a = n;
			if (slice) {
				if (!(a->args = alloc(ps, 3 * sizeof(*a->args))))
					return NULL;
				memcpy(a->args, parts, sizeof(parts));
				a->n_args = 3;
			} else {
				if (!parts[0]) {
					fail(ps, -EINVAL, "an empty subscript");
					return NULL;
				}
				a->b = parts[0];
			}
			n = a;
		} else if (is_op(ps, "(")) {
			struct node *a = mk(ps, E_CALL);
			if (!a)
				return NULL;
			a->a = n;
			if (call_args(ps, a))
				return NULL;
			n = a;
		} else {
			break;
		}
	}
	return n;
}

/* Can the current token begin a test's lone argument (`is divisibleby 3`, `is sameas none`)? */
static bool starts_test_arg(const struct parser *ps)
{
	if (ps->tok.k == T_STR || ps->tok.k == T_INT || ps->tok.k == T_FLOAT || is_op(ps, "[") || is_op(ps, "{"))
		return true;
	if (ps->tok.k != T_NAME)
		return false;
	static const char *const stop[] = {"else", "or", "and", "is", "in", "not", "if"};
	for (size_t i = 0; i < ARRAY_SIZE(stop); i++)
		if (is_name(ps, stop[i]))
			return false;
	return true;
}

/* | filter and is test after a unary */
static struct node *filters(struct parser *ps, struct node *n)
{
	while (n) {
		if (is_op(ps, "|")) {
			if (next(ps))
				return NULL;
			int line = ps->line;
			const char *nm = take_name(ps, "a filter name");
			if (!nm)
				return NULL;
			struct node *f = mk(ps, E_FILTER);
			if (!f)
				return NULL;
			f->a = n;
			f->name = nm;
			f->line = line;
			if ((f->builtin = builtin_filter(nm)) < 0) {
				fail(ps, -EINVAL, "no filter named '%s'", nm);
				return NULL;
			}
			if (is_op(ps, "(") && call_args(ps, f))
				return NULL;
			n = postfix(ps, f);
		} else if (is_name(ps, "is")) {
			if (next(ps))
				return NULL;
			struct node *f = mk(ps, E_TEST);
			if (!f)
				return NULL;
			if (is_name(ps, "not")) {
				f->neg = true;
				if (next(ps))
					return NULL;
			}
			/* tests named by keywords or operators */
			const char *nm;
			if (is_name(ps, "none") || is_name(ps, "true") || is_name(ps, "false") || is_name(ps, "in")) {
				nm = take_name(ps, "a test name");
			} else if (ps->tok.k == T_OP && (is_op(ps, "==") || is_op(ps, "!=") || is_op(ps, "<") ||
							 is_op(ps, ">") || is_op(ps, "<=") || is_op(ps, ">="))) {
				nm = dup(ps, ps->tok.p, ps->tok.n);
				if (!nm || next(ps))
					return NULL;
			} else {
				nm = take_name(ps, "a test name");
			}
			if (!nm)
				return NULL;
			f->a = n;
			f->name = nm;
			if ((f->builtin = builtin_test(nm)) < 0) {
				fail(ps, -EINVAL, "no test named '%s'", nm);
				return NULL;
			}
			if (is_op(ps, "(")) {
				if (call_args(ps, f))
					return NULL;
			} else if (starts_test_arg(ps)) {
				struct node *arg = unary(ps, false);
				if (!arg || !(f->args = alloc(ps, sizeof(*f->args))))
					return NULL;
				f->args[0] = arg;
				f->n_args = 1;
			}
			n = f;
		} else {
			break;
		}
	}
	return n;
}

static struct node *unary(struct parser *ps, bool with_filters)
{
	if (!depth_in(ps))
		return NULL;
	struct node *n;
	if (is_op(ps, "-") || is_op(ps, "+")) {
		bool neg = is_op(ps, "-");
		if (next(ps))
			return NULL;
		struct node *a = unary(ps, false);
		if (!a || !(n = mk(ps, neg ? E_NEG : E_POS)))
			return NULL;
		n->a = a;
	} else {
		n = postfix(ps, primary(ps));
	}
	if (n && with_filters)
		n = filters(ps, n);
	ps->depth--;
	return n;
}

static struct node *bin(struct parser *ps, enum bin_op op, struct node *a, struct node *b)
{
	if (!a || !b)
		return NULL;
	struct node *n = mk(ps, E_BIN);
	if (n) {
		n->op = op;
		n->a = a;
		n->b = b;
	}
	return n;
}

static struct node *power(struct parser *ps)
{
	struct node *n = unary(ps, true);
	while (n && is_op(ps, "**")) {
		if (next(ps))
			return NULL;
		n = bin(ps, OP_POW, n, unary(ps, true));
	}
	return n;
}

static struct node *math2(struct parser *ps)
{
	struct node *n = power(ps);
	while (n) {
		enum bin_op op;
		if (is_op(ps, "*"))
			op = OP_MUL;
		else if (is_op(ps, "/"))
			op = OP_DIV;
		else if (is_op(ps, "//"))
			op = OP_FLOORDIV;
		else if (is_op(ps, "%"))
			op = OP_MOD;
		else
			break;
		if (next(ps))
			return NULL;
		n = bin(ps, op, n, power(ps));
	}
	return n;
}

static struct node *concat(struct parser *ps)
{
	struct node *n = math2(ps);
	while (n && is_op(ps, "~")) {
		if (next(ps))
			return NULL;
		n = bin(ps, OP_CONCAT, n, math2(ps));
	}
	return n;
}

static struct node *math1(struct parser *ps)
{
	struct node *n = concat(ps);
	while (n && (is_op(ps, "+") || is_op(ps, "-"))) {
		enum bin_op op = is_op(ps, "+") ? OP_ADD : OP_SUB;
		if (next(ps))
			return NULL;
		n = bin(ps, op, n, concat(ps));
	}
	return n;
}

static struct node *compare(struct parser *ps)
{
	struct node *n = math1(ps);
	/* a chain a < b < c is (a < b) and (b < c), b computed twice (it has no side effects) */
	struct node *chain = NULL;
	while (n) {
		enum bin_op op;
		if (is_op(ps, "=="))
			op = OP_EQ;
		else if (is_op(ps, "!="))
			op = OP_NE;
		else if (is_op(ps, "<"))
			op = OP_LT;
		else if (is_op(ps, "<="))
			op = OP_LE;
		else if (is_op(ps, ">"))
			op = OP_GT;
		else if (is_op(ps, ">="))
			op = OP_GE;
		else if (is_name(ps, "in"))
			op = OP_IN;
		else if (is_name(ps, "not")) {
			size_t save = ps->pos;
			struct ptok st = ps->tok;
			if (next(ps))
				return NULL;
			if (!is_name(ps, "in")) {
				ps->pos = save;
				ps->tok = st;
				break;
			}
			op = OP_NOTIN;
		} else
			break;
		if (next(ps))
			return NULL;
		struct node *left = chain ? chain->b : n;
		struct node *c = bin(ps, op, left, math1(ps));
		if (!c)
			return NULL;
		if (!chain) {
			n = c;
		} else {
			struct node *and = mk(ps, E_AND);
			if (!and)
				return NULL;
			and->a = n;
			and->b = c;
			n = and;
		}
		chain = c;
	}
	return n;
}

static struct node *not_expr(struct parser *ps)
{
	if (is_name(ps, "not")) {
		if (!depth_in(ps) || next(ps))
			return NULL;
		struct node *a = not_expr(ps), *n;
		ps->depth--;
		if (!a || !(n = mk(ps, E_NOT)))
			return NULL;
		n->a = a;
		return n;
	}
	return compare(ps);
}

/* operand (WORD operand)*: a left-deep chain of `and` or `or` */
static struct node *logic(struct parser *ps, const char *word, enum node_kind kind,
			  struct node *(*operand)(struct parser *ps))
{
	struct node *n = operand(ps);
	while (n && is_name(ps, word)) {
		struct node *a = mk(ps, kind);
		if (!a || next(ps))
			return NULL;
		a->a = n;
		if (!(a->b = operand(ps)))
			return NULL;
		n = a;
	}
	return n;
}

static struct node *and_expr(struct parser *ps)
{
	return logic(ps, "and", E_AND, not_expr);
}

static struct node *or_expr(struct parser *ps)
{
	return logic(ps, "or", E_OR, and_expr);
}

static struct node *expr(struct parser *ps)
{
	if (!depth_in(ps))
		return NULL;
	struct node *n = or_expr(ps);
	while (n && is_name(ps, "if")) {
		struct node *c = mk(ps, E_COND);
		if (!c || next(ps))
			return NULL;
		c->b = n;
		if (!(c->a = or_expr(ps)))
			return NULL;
		if (is_name(ps, "else")) {
			if (next(ps) || !(c->c = expr(ps)))
				return NULL;
		}
		n = c;
	}
	ps->depth--;
	return n;
}

/* ---- the template's text and tags ------------------------------------------------------------ */

/* Jinja 3 reads the source by lines (\r\n, \r or \n) and joins them with "\n"; one line break
 * at the very end is dropped (keep_trailing_newline off). */
static char *normalize(const char *src, size_t len, size_t *out_len)
{
	char *o = malloc(len + 1);
	if (!o)
		return NULL;
	size_t k = 0;
	for (size_t i = 0; i < len; i++) {
		if (src[i] == '\r') {
			o[k++] = '\n';
			if (i + 1 < len && src[i + 1] == '\n')
				i++;
		} else {
			o[k++] = src[i];
		}
	}
	if (k && o[k - 1] == '\n')
		k--;
	o[k] = 0;
	*out_len = k;
	return o;
}

/* One piece of the template: text, or a tag's inside. */
enum piece_kind { P_TEXT, P_OUT, P_STMT };
struct piece {
	enum piece_kind k;
	size_t b, e; /* [b, e) of the source: the text, or the tag's inside */
	int line;
};

struct pieces {
	struct piece *v;
	size_t n, cap;
};

static int add_piece(struct parser *ps, struct pieces *pv, enum piece_kind k, size_t b, size_t e, int line)
{
	if (k == P_TEXT && b >= e)
		return 0;
	if (pv->n == pv->cap) {
		size_t cap = pv->cap ? pv->cap * 2 : 64;
		struct piece *nv = realloc(pv->v, cap * sizeof(*nv));
		if (!nv)
			return fail(ps, -ENOMEM, "out of memory");
		pv->v = nv;
		pv->cap = cap;
	}
	pv->v[pv->n++] = (struct piece){k, b, e, line};
	return 0;
}

/* Is [b, e) a raw block's {% endraw %} tag inside? */
static bool tag_is(const char *s, size_t b, size_t e, const char *word)
{
	while (b < e && is_ws(s[b]))
		b++;
	while (e > b && is_ws(s[e - 1]))
		e--;
	return e - b == strlen(word) && !memcmp(s + b, word, e - b);
}

/* The length of the white-space character that ends at s[e] (not before lo), 0 when none. */
static size_t space_before(const char *s, size_t lo, size_t e)
{
	for (size_t n = 1; n <= 3 && n <= e - lo; n++)
		if (jinja_space_len(s, e, e - n) == n)
			return n;
	return 0;
}

/* [b, e) with Python's white space taken off its start (front) or its end. */
static size_t skip_space(const char *s, size_t b, size_t e)
{
	size_t n;
	while (b < e && (n = jinja_space_len(s, e, b)))
		b += n;
	return b;
}
static size_t trim_space(const char *s, size_t b, size_t e)
{
	size_t n;
	while (e > b && (n = space_before(s, b, e)))
		e -= n;
	return e;
}

/* lstrip_blocks: the spaces and tabs before a block tag at the start of its line go. */
static size_t lstrip_line(const char *s, size_t b, size_t e)
{
	size_t k = e;
	while (k > b && (s[k - 1] == ' ' || s[k - 1] == '\t'))
		k--;
	return k == 0 || s[k - 1] == '\n' ? k : e;
}

/* Where a tag of kind ('{', '%', '#') opened at in_b ends: the index of its closing pair, or len.
 * A closing pair inside a string literal does not end it, nor does "}}" inside brackets of the
 * expression (a dict literal's "}}"). */
static size_t tag_end(const char *s, size_t len, size_t in_b, char kind)
{
	const char *close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
	size_t k = in_b;
	if (kind == '#') {
		while (k + 1 < len && !(s[k] == '#' && s[k + 1] == '}'))
			k++;
		return k + 1 < len ? k : len;
	}
	char q = 0;
	int depth = 0;
	for (; k + 1 < len; k++) {
		char c = s[k];
		if (q) {
			if (c == '\\')
				k++;
			else if (c == q)
				q = 0;
		} else if (c == '\'' || c == '"') {
			q = c;
		} else if (depth == 0 && c == close[0] && s[k + 1] == close[1]) {
			return k;
		} else if (c == '(' || c == '[' || c == '{') {
			depth++;
		} else if ((c == ')' || c == ']' || c == '}') && depth > 0) {
			depth--;
		}
	}
	return len;
}

/* Splits the source into text and tags, applying the whitespace rules. */
static int split(struct parser *ps, struct pieces *pv)
{
	const char *s = ps->s;
	size_t len = ps->len, i = 0, text_b = 0;
	bool strip_next = false; /* the last tag ended with '-': the text after it loses its leading space */
	int line = 1;
	while (i <= len) {
		const char *open = NULL;
		size_t j = i;
		while (j + 1 < len && !(s[j] == '{' && (s[j + 1] == '{' || s[j + 1] == '%' || s[j + 1] == '#')))
			j++;
		if (j + 1 >= len)
			j = len;
		else
			open = s + j;
		/* the text [text_b, j) */
		size_t tb = strip_next ? skip_space(s, text_b, j) : text_b, te = j;
		int text_line = line;
		for (size_t k = text_b; k < j; k++)
			line += s[k] == '\n';
		if (!open) {
			if (add_piece(ps, pv, P_TEXT, tb, te, text_line))
				return ps->rc;
			break;
		}
		char kind = open[1];
		size_t in_b = j + 2;
		bool minus = in_b < len && s[in_b] == '-', plus = in_b < len && s[in_b] == '+';
		if (minus || plus)
			in_b++;
		if (minus)
			te = trim_space(s, tb, te);
		else if (kind != '{' && !plus)
			te = lstrip_line(s, tb, te);
		if (add_piece(ps, pv, P_TEXT, tb, te, text_line))
			return ps->rc;
		size_t k = tag_end(s, len, in_b, kind), in_e = k;
		if (k >= len) {
			ps->line = line;
			return fail(ps, -EINVAL, "a '{%c' tag is not closed", kind);
		}
		bool rminus = in_e > in_b && s[in_e - 1] == '-', rplus = in_e > in_b && s[in_e - 1] == '+' && kind != '{';
		if (rminus || rplus)
			in_e--;
		int tag_line = line;
		for (size_t q = j; q < k + 2; q++)
			line += s[q] == '\n';
		i = k + 2;
		strip_next = rminus;
		bool raw = kind == '%' && tag_is(s, in_b, in_e, "raw");
		/* trim_blocks: the newline after a block tag goes (not after {% raw %}, nor with +%}) */
		if (!rminus && !rplus && !raw && kind != '{' && i < len && s[i] == '\n')
			i++, line++;
		text_b = i;
		if (kind == '#')
			continue;
		if (raw) { /* everything up to {% endraw %} is text */
			if (rminus)
				i = skip_space(s, i, len);
			size_t r = i;
			for (;;) {
				while (r + 1 < len && !(s[r] == '{' && s[r + 1] == '%'))
					r++;
				if (r + 1 >= len) {
					ps->line = tag_line;
					return fail(ps, -EINVAL, "a raw block is not closed");
				}
				bool eminus = s[r + 2] == '-', eplus = s[r + 2] == '+';
				size_t q = r + 2 + (eminus || eplus);
				size_t z = q;
				while (z + 1 < len && !(s[z] == '%' && s[z + 1] == '}'))
					z++;
				bool zminus = z > q && s[z - 1] == '-', zplus = z > q && s[z - 1] == '+';
				size_t ze = zminus || zplus ? z - 1 : z;
				if (z + 1 < len && tag_is(s, q, ze, "endraw")) {
					size_t te2 = eminus ? trim_space(s, i, r) : eplus ? r : lstrip_line(s, i, r);
					if (add_piece(ps, pv, P_TEXT, i, te2, tag_line))
						return ps->rc;
					for (size_t y = i; y < z + 2; y++)
						line += s[y] == '\n';
					i = z + 2;
					strip_next = zminus;
					if (!zminus && !zplus && i < len && s[i] == '\n')
						i++, line++;
					text_b = i;
					break;
				}
				r = z;
			}
			continue;
		}
		if (add_piece(ps, pv, kind == '{' ? P_OUT : P_STMT, in_b, in_e, tag_line))
			return ps->rc;
	}
	return 0;
}

/* ---- statements -------------------------------------------------------------------------------- */

struct pcur {
	struct pieces *pv;
	size_t i;
};

/* Starts tokenizing piece p's inside. */
static int open_tag(struct parser *ps, const struct piece *p)
{
	ps->pos = p->b;
	ps->tag_end = p->e;
	ps->line = p->line;
	return next(ps);
}

static int end_of_tag(struct parser *ps)
{
	if (ps->tok.k != T_END)
		return fail(ps, -EINVAL, "unexpected '%.*s' at the end of the tag", (int)ps->tok.n, ps->tok.p);
	return 0;
}

/* Parses statements until a tag whose first word is one of ends (NULL-terminated); *which gets
 * that word's index, and the parser is left after it (its tag open for the rest). At the
 * template's end: *which -1 (an error unless ends is NULL). */
static int body(struct parser *ps, struct pcur *c, const char *const *ends, struct nvec *out, int *which);

/* Statements up to the tag `end` (which ends them and must stand alone) into *v and *n. */
static int block_until(struct parser *ps, struct pcur *c, const char *end, struct node ***v, size_t *n)
{
	const char *const ends[] = {end, NULL};
	struct nvec b = {0};
	int w;
	if (body(ps, c, ends, &b, &w) || end_of_tag(ps))
		return ps->rc ? ps->rc : -EINVAL;
	*v = b.v;
	*n = b.n;
	return 0;
}

static struct node *stmt_if(struct parser *ps, struct pcur *c)
{
	struct node *n = mk(ps, N_IF);
	if (!n || !(n->a = expr(ps)) || end_of_tag(ps))
		return NULL;
	static const char *const ends[] = {"elif", "else", "endif", NULL};
	struct nvec b = {0};
	int w;
	if (body(ps, c, ends, &b, &w))
		return NULL;
	n->body = b.v;
	n->n_body = b.n;
	if (w == 0) { /* elif: an if in the else branch (nested: it counts toward the depth) */
		if (!depth_in(ps))
			return NULL;
		struct node *e = stmt_if(ps, c);
		ps->depth--;
		if (!e || !(n->els = alloc(ps, sizeof(*n->els))))
			return NULL;
		n->els[0] = e;
		n->n_els = 1;
	} else if (w == 1) {
		if (end_of_tag(ps) || block_until(ps, c, "endif", &n->els, &n->n_els))
			return NULL;
	} else if (end_of_tag(ps)) {
		return NULL;
	}
	return n;
}

static struct node *stmt_for(struct parser *ps, struct pcur *c)
{
	struct node *n = mk(ps, N_FOR);
	if (!n || !(n->name = take_name(ps, "a loop variable")))
		return NULL;
	if (is_op(ps, ",")) {
		if (next(ps) || !(n->name2 = take_name(ps, "a second loop variable")))
			return NULL;
	}
	if (!is_name(ps, "in")) {
		fail(ps, -EINVAL, "expected 'in' in a for tag");
		return NULL;
	}
	if (next(ps))
		return NULL;
	/* the iterable is an or-expression, so that a trailing `if` is the loop's filter */
	if (!(n->a = or_expr(ps)))
		return NULL;
	if (is_name(ps, "if")) {
		if (next(ps) || !(n->b = or_expr(ps)))
			return NULL;
	}
	if (is_name(ps, "recursive")) {
		fail(ps, -EINVAL, "recursive loops are not supported");
		return NULL;
	}
	if (end_of_tag(ps))
		return NULL;
	static const char *const ends[] = {"else", "endfor", NULL};
	struct nvec b = {0};
	int w;
	if (body(ps, c, ends, &b, &w) || end_of_tag(ps))
		return NULL;
	n->body = b.v;
	n->n_body = b.n;
	if (w == 0 && block_until(ps, c, "endfor", &n->els, &n->n_els))
		return NULL;
	return n;
}

static struct node *stmt_set(struct parser *ps, struct pcur *c)
{
	struct node *n = mk(ps, N_SET);
	if (!n || !(n->name = take_name(ps, "a variable name")))
		return NULL;
	if (is_op(ps, ".")) { /* ns.attr = value */
		if (next(ps) || !(n->name2 = take_name(ps, "an attribute name")))
			return NULL;
	}
	if (!is_op(ps, "=")) {
		if (ps->tok.k != T_END || n->name2) {
			fail(ps, -EINVAL, "expected '=' in a set tag");
			return NULL;
		}
		n->kind = N_SETBLOCK;
		return block_until(ps, c, "endset", &n->body, &n->n_body) ? NULL : n;
	}
	if (next(ps) || !(n->b = expr(ps)))
		return NULL;
	if (is_op(ps, ",")) { /* set x = a, b: a tuple */
		struct nvec items = {0};
		if (nvec_push(ps, &items, n->b))
			return NULL;
		while (is_op(ps, ",")) {
			if (next(ps))
				return NULL;
			struct node *it = expr(ps);
			if (!it || nvec_push(ps, &items, it))
				return NULL;
		}
		struct node *t = mk(ps, E_TUPLE);
		if (!t)
			return NULL;
		t->args = items.v;
		t->n_args = items.n;
		n->b = t;
	}
	if (end_of_tag(ps))
		return NULL;
	return n;
}

static struct node *stmt_macro(struct parser *ps, struct pcur *c)
{
	struct node *n = mk(ps, N_MACRO);
	if (!n || !(n->name = take_name(ps, "a macro name")) || expect_op(ps, "("))
		return NULL;
	struct nvec params = {0}, defs = {0};
	while (!is_op(ps, ")")) {
		struct node *p = mk(ps, E_NAME);
		if (!p || !(p->name = take_name(ps, "a parameter name")))
			return NULL;
		struct node *d = NULL;
		if (is_op(ps, "=")) {
			if (next(ps) || !(d = expr(ps)))
				return NULL;
		} else if (defs.n && defs.v[defs.n - 1]) {
			fail(ps, -EINVAL, "a parameter without a default after one with a default");
			return NULL;
		}
		if (nvec_push(ps, &params, p) || nvec_push(ps, &defs, d))
			return NULL;
		if (item_sep(ps, ")", "a macro's parameters"))
			return NULL;
	}
	if (next(ps) || end_of_tag(ps))
		return NULL;
	n->args = params.v;
	n->n_args = params.n;
	n->kwvals = defs.v;
	n->n_kw = defs.n;
	return block_until(ps, c, "endmacro", &n->body, &n->n_body) ? NULL : n;
}

static struct node *stmt_block(struct parser *ps, struct pcur *c)
{
	struct node *n = mk(ps, N_BLOCK);
	if (!n || end_of_tag(ps))
		return NULL;
	return block_until(ps, c, "endgeneration", &n->body, &n->n_body) ? NULL : n;
}

static int body(struct parser *ps, struct pcur *c, const char *const *ends, struct nvec *out, int *which)
{
	int open_line = ps->line;
	if (++ps->depth > JINJA_MAX_DEPTH)
		return fail(ps, -E2BIG, "blocks nested deeper than %d", JINJA_MAX_DEPTH);
	*which = -1;
	while (c->i < c->pv->n) {
		const struct piece *p = &c->pv->v[c->i++];
		struct node *n = NULL;
		if (p->k == P_TEXT) {
			if (!(n = mk(ps, N_TEXT)))
				return ps->rc;
			n->line = p->line;
			n->lit = jv_str(ps->s + p->b, p->e - p->b, NULL);
		} else if (p->k == P_OUT) {
			if (open_tag(ps, p) || !(n = mk(ps, N_OUT)) || !(n->a = expr(ps)) || end_of_tag(ps))
				return ps->rc;
		} else {
			if (open_tag(ps, p))
				return ps->rc;
			if (ps->tok.k != T_NAME)
				return fail(ps, -EINVAL, "a tag must begin with its name");
			for (int k = 0; ends && ends[k]; k++)
				if (is_name(ps, ends[k])) {
					*which = k;
					ps->depth--;
					return next(ps);
				}
			char word[32];
			snprintf(word, sizeof(word), "%.*s", (int)(ps->tok.n < 31 ? ps->tok.n : 31), ps->tok.p);
			if (next(ps))
				return ps->rc;
			if (!strcmp(word, "if"))
				n = stmt_if(ps, c);
			else if (!strcmp(word, "for"))
				n = stmt_for(ps, c);
			else if (!strcmp(word, "set"))
				n = stmt_set(ps, c);
			else if (!strcmp(word, "macro"))
				n = stmt_macro(ps, c);
			else if (!strcmp(word, "generation"))
				n = stmt_block(ps, c);
			else if (!strcmp(word, "break") || !strcmp(word, "continue")) {
				if (!(n = mk(ps, word[0] == 'b' ? N_BREAK : N_CONTINUE)) || end_of_tag(ps))
					return ps->rc;
			} else {
				return fail(ps, -EINVAL, "unknown or unexpected tag '%s'", word);
			}
			if (!n)
				return ps->rc ? ps->rc : fail(ps, -EINVAL, "a tag that does not parse");
		}
		if (nvec_push(ps, out, n))
			return ps->rc;
	}
	ps->depth--;
	if (ends) {
		int last = 0;
		while (ends[last + 1])
			last++;
		ps->line = open_line;
		return fail(ps, -EINVAL, "a block is not closed: '%s' is missing", ends[last]);
	}
	return 0;
}

int jinja_parse(const char *src, size_t len, struct jinja_template **out, char *err, size_t errlen)
{
	*out = NULL;
	if (len > JINJA_MAX_SOURCE)
		return errorf(err, errlen, -E2BIG, "chat template: %zu bytes, more than the %u a template may have", len,
			      JINJA_MAX_SOURCE);
	struct jinja_template *t = calloc(1, sizeof(*t));
	struct parser ps = {.t = t, .err = err, .errlen = errlen, .line = 1};
	struct pieces pv = {0};
	if (!t || !(t->mem = arena_create((size_t)JINJA_MAX_SOURCE * 64)) ||
	    !(t->src = normalize(src ? src : "", len, &ps.len))) {
		jinja_free(&t);
		return errorf(err, errlen, -ENOMEM, "out of memory");
	}
	ps.s = t->src;
	struct pcur c = {.pv = &pv};
	struct nvec b = {0};
	int w;
	if (!split(&ps, &pv) && !body(&ps, &c, NULL, &b, &w)) {
		t->body = b.v;
		t->n_body = b.n;
	}
	free(pv.v);
	if (ps.rc) {
		jinja_free(&t);
		return ps.rc;
	}
	*out = t;
	return 0;
}

void jinja_free(struct jinja_template **t)
{
	if (!t || !*t)
		return;
	arena_destroy((*t)->mem);
	free((*t)->src);
	free(*t);
	*t = NULL;
}

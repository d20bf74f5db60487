/* builtins.c - the filters, tests, methods and global functions chat templates use (jinja.h
 * lists them), each as Jinja 3 and Python define it. */
#include "common/jinja/jinja_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "common/utf8.h"

enum filter {
	F_TRIM, F_LENGTH, F_COUNT, F_TOJSON, F_JOIN, F_LIST, F_FIRST, F_LAST, F_UPPER, F_LOWER, F_CAPITALIZE, F_TITLE,
	F_DEFAULT, F_D, F_SELECTATTR, F_REJECTATTR, F_SELECT, F_REJECT, F_MAP, F_STRING, F_INT, F_FLOAT, F_ABS,
	F_REPLACE, F_REVERSE, F_ITEMS, F_UNIQUE, F_INDENT, F_SAFE,
};
static const char *const filters[] = {
	"trim",	      "length",	    "count",  "tojson", "join",	 "list",   "first",   "last",	 "upper",   "lower",
	"capitalize", "title",	    "default", "d",	"selectattr", "rejectattr", "select", "reject", "map",
	"string",     "int",	    "float",  "abs",	"replace", "reverse", "items", "unique", "indent", "safe",
};

enum test {
	T_DEFINED, T_UNDEFINED, T_NONE, T_BOOLEAN, T_TRUE, T_FALSE, T_INTEGER, T_FLOAT, T_NUMBER, T_STRING, T_MAPPING,
	T_ITERABLE, T_SEQUENCE, T_CALLABLE, T_EQ, T_NE, T_LT, T_LE, T_GT, T_GE, T_IN, T_ODD, T_EVEN, T_DIVISIBLEBY,
	T_LOWER, T_UPPER, T_SAMEAS,
};
static const struct {
	const char *name;
	enum test t;
} tests[] = {
	{"defined", T_DEFINED},	  {"undefined", T_UNDEFINED}, {"none", T_NONE},	    {"boolean", T_BOOLEAN},
	{"true", T_TRUE},	  {"false", T_FALSE},	      {"integer", T_INTEGER}, {"float", T_FLOAT},
	{"number", T_NUMBER},	  {"string", T_STRING},	      {"mapping", T_MAPPING}, {"iterable", T_ITERABLE},
	{"sequence", T_SEQUENCE}, {"callable", T_CALLABLE},   {"equalto", T_EQ},    {"eq", T_EQ},
	{"==", T_EQ},		  {"ne", T_NE},		      {"!=", T_NE},	    {"lt", T_LT},
	{"<", T_LT},		  {"lessthan", T_LT},	      {"le", T_LE},	    {"<=", T_LE},
	{"gt", T_GT},		  {">", T_GT},		      {"greaterthan", T_GT}, {"ge", T_GE},
	{">=", T_GE},		  {"in", T_IN},		      {"odd", T_ODD},	    {"even", T_EVEN},
	{"divisibleby", T_DIVISIBLEBY}, {"lower", T_LOWER},   {"upper", T_UPPER},   {"sameas", T_SAMEAS},
};

enum function { FN_RAISE, FN_STRFTIME, FN_NAMESPACE, FN_RANGE };
static const char *const functions[] = {"raise_exception", "strftime_now", "namespace", "range"};

enum method {
	M_STRIP, M_LSTRIP, M_RSTRIP, M_STARTSWITH, M_ENDSWITH, M_SPLIT, M_UPPER, M_LOWER, M_TITLE, M_CAPITALIZE,
	M_REPLACE, M_FIND, M_JOIN, /* strings */
	M_ITEMS, M_KEYS, M_VALUES, M_GET, /* dicts */
	M_COUNT_
};
static const char *const methods[] = {"strip", "lstrip", "rstrip", "startswith", "endswith", "split",  "upper",
				      "lower", "title",	 "capitalize", "replace", "find", "join",	"items",
				      "keys",  "values", "get"};

#define METHOD_BASE 1000 /* JV_METHOD numbers: METHOD_BASE + enum method; JV_FUNC: enum function */

static int index_of(const char *const *names, size_t n, const char *name)
{
	for (size_t i = 0; i < n; i++)
		if (!strcmp(names[i], name))
			return (int)i;
	return -1;
}

int builtin_filter(const char *name)
{
	return index_of(filters, ARRAY_SIZE(filters), name);
}

int builtin_test(const char *name)
{
	for (size_t i = 0; i < ARRAY_SIZE(tests); i++)
		if (!strcmp(tests[i].name, name))
			return (int)tests[i].t;
	return -1;
}

int builtin_function(const char *name)
{
	return index_of(functions, ARRAY_SIZE(functions), name);
}

int builtin_method(const struct jv *v, const char *name)
{
	int m = index_of(methods, ARRAY_SIZE(methods), name);
	if (m < 0)
		return -1;
	if (v->t == JV_STR && m <= M_JOIN)
		return METHOD_BASE + m;
	if (v->t == JV_DICT && m >= M_ITEMS)
		return METHOD_BASE + m;
	return -1;
}

/* ---- arguments ----------------------------------------------------------------------------------- */

/* Argument i (positional) or name (keyword); NULL when not given. */
static const struct jv *arg(const struct call_args *a, size_t i, const char *name)
{
	if (i < a->n_pos)
		return &a->pos[i];
	for (size_t k = 0; name && k < a->n_kw; k++)
		if (!strcmp(a->kwnames[k], name))
			return &a->kw[k];
	return NULL;
}

/* Refuses arguments past max positional ones and keywords not in names (NULL-terminated). */
static int check_args(struct render *r, const char *what, const struct call_args *a, size_t max,
		      const char *const *names, int line)
{
	if (a->n_pos > max)
		return render_fail(r, -EINVAL, line, "%s takes at most %zu arguments, %zu given", what, max, a->n_pos);
	for (size_t k = 0; k < a->n_kw; k++) {
		bool ok = false;
		for (size_t i = 0; names && names[i]; i++)
			ok = ok || !strcmp(names[i], a->kwnames[k]);
		if (!ok)
			return render_fail(r, -EINVAL, line, "%s takes no argument '%s'", what, a->kwnames[k]);
	}
	return 0;
}

static int need_str(struct render *r, const char *what, const struct jv *v, int line)
{
	if (v->t == JV_STR)
		return 0;
	if (v->t == JV_UNDEF)
		return render_fail(r, -EINVAL, line, "'%s' is undefined", v->undef_name ? v->undef_name : "a value");
	return render_fail(r, -EINVAL, line, "%s needs a string, not %s", what, jv_type_name(v));
}

static int need_int(struct render *r, const char *what, const struct jv *v, int line, int64_t *out)
{
	if (v->t == JV_INT || v->t == JV_BOOL) {
		*out = v->t == JV_INT ? v->i : v->b;
		return 0;
	}
	return render_fail(r, -EINVAL, line, "%s needs an integer, not %s", what, jv_type_name(v));
}

static int nomem(struct render *r, int line)
{
	return render_oom(r, line);
}

/* str(v) as a string value (a string stays itself, with its marks). */
static int to_str(struct render *r, const struct jv *v, int line, struct jv *out)
{
	if (v->t == JV_STR) {
		*out = *v;
		return 0;
	}
	struct sbuf b;
	sbuf_init(&b, render_arena(r), JINJA_MAX_OUTPUT);
	jv_print(&b, v, false);
	if (b.err)
		return nomem(r, line);
	*out = sbuf_value(&b);
	return 0;
}

static struct jv list_value(struct jlist *l)
{
	return (struct jv){.t = JV_LIST, .l = l};
}

/* ---- white space and case ------------------------------------------------------------------------- */

/* The code point at s[i] (UTF-8) and its length; an invalid byte has length 1 and a value past
 * Unicode's (0x110000 + the byte), so that it is no character (no white space) but itself. */
static uint32_t cp_at(const char *s, size_t n, size_t i, size_t *len)
{
	const uint8_t *u = (const uint8_t *)s + i;
	size_t ul;
	if (utf8_unit(u, n - i, &ul) != U8_VALID || ul == 1) {
		*len = 1;
		return u[0] < 0x80 ? u[0] : 0x110000u + u[0];
	}
	uint32_t c = u[0] & (0x7f >> ul);
	for (size_t k = 1; k < ul; k++)
		c = c << 6 | (u[k] & 0x3f);
	*len = ul;
	return c;
}

/* Python's str.isspace */
static bool py_space(uint32_t c)
{
	return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
	       (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f ||
	       c == 0x3000;
}

size_t jinja_space_len(const char *s, size_t n, size_t i)
{
	size_t l;
	uint32_t c = cp_at(s, n, i, &l);
	return py_space(c) ? l : 0;
}

/* Is code point c among chars' (a string's code points)? chars NULL: white space. */
static bool strip_this(uint32_t c, const struct jstr *chars)
{
	if (!chars)
		return py_space(c);
	for (size_t i = 0, l; i < chars->n; i += l)
		if (cp_at(chars->p, chars->n, i, &l) == c)
			return true;
	return false;
}

/* The work of stripping s of chars, in render steps (each character against each of chars). */
static size_t strip_cost(const struct jstr *s, const struct jstr *chars)
{
	return s->n / 32 + (chars ? (s->n / 8 + 1) * (chars->n / 8 + 1) : 0);
}

static struct jv strip(const struct jstr *s, const struct jstr *chars, bool left, bool right)
{
	size_t b = 0, e = s->n, l;
	while (left && b < e && strip_this(cp_at(s->p, s->n, b, &l), chars))
		b += l;
	while (right && e > b) {
		size_t k = e - 1;
		while (k > b && e - k < 4 && ((unsigned char)s->p[k] & 0xc0) == 0x80)
			k--;
		size_t cl;
		uint32_t c = cp_at(s->p, s->n, k, &cl);
		if (k + cl != e) { /* not a whole character: an invalid byte at the end */
			k = e - 1;
			c = cp_at(s->p, s->n, k, &cl);
		}
		if (!strip_this(c, chars))
			break;
		e = k;
	}
	return jv_str(s->p + b, e - b, s->m ? s->m + b : NULL);
}

enum casing { C_UPPER, C_LOWER, C_CAPITALIZE, C_TITLE, C_TITLE_METHOD };

/* ASCII letters changed (the marks stay where they are). */
static int recase(struct render *r, const struct jv *v, enum casing how, int line, struct jv *out)
{
	struct jv s;
	if (to_str(r, v, line, &s))
		return -1;
	char *p = arena_alloc(render_arena(r), s.s.n + 1);
	if (!p)
		return nomem(r, line);
	bool word_start = true;
	for (size_t i = 0; i < s.s.n; i++) {
		char c = s.s.p[i];
		bool lower = c >= 'a' && c <= 'z', upper = c >= 'A' && c <= 'Z';
		bool up = how == C_UPPER || (how == C_CAPITALIZE && i == 0) ||
			  ((how == C_TITLE || how == C_TITLE_METHOD) && word_start);
		if (up && lower)
			c = (char)(c - 32);
		else if (!up && upper)
			c = (char)(c + 32);
		/* Jinja's title filter starts a word after white space, - ( { [ <; Python's str.title
		 * after any character that is not a letter (digits and ' included) */
		if (how == C_TITLE)
			word_start = c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v' || c == '-' ||
				     c == '(' || c == '{' || c == '[' || c == '<';
		else
			word_start = !(lower || upper || ((unsigned char)c >= 0x80));
		p[i] = c;
	}
	p[s.s.n] = 0;
	*out = jv_str(p, s.s.n, s.s.m);
	return 0;
}

/* ---- sequences --------------------------------------------------------------------------------- */

/* The items of v as a list: a list, a dict's keys, a string's characters; undefined is empty. */
static int items_of(struct render *r, const struct jv *v, int line, struct jlist **out)
{
	struct arena *a = render_arena(r);
	if (v->t == JV_LIST) {
		*out = v->l;
		return 0;
	}
	if (v->t == JV_UNDEF) {
		*out = jlist_new(a, 0);
	} else if (v->t == JV_DICT || v->t == JV_NS) {
		if ((*out = jlist_new(a, v->d->n)))
			memcpy((*out)->v, v->d->k, v->d->n * sizeof(struct jv));
	} else if (v->t == JV_STR) {
		if (render_step(r, v->s.n, line)) /* a value a character */
			return -1;
		size_t n = 0, l;
		for (size_t i = 0; i < v->s.n; i += l, n++)
			cp_at(v->s.p, v->s.n, i, &l);
		if ((*out = jlist_new(a, n))) {
			size_t k = 0;
			for (size_t i = 0; i < v->s.n; i += l)
				(cp_at(v->s.p, v->s.n, i, &l), (*out)->v[k++] = jv_str(v->s.p + i, l, v->s.m ? v->s.m + i : NULL));
		}
	} else {
		return render_fail(r, -EINVAL, line, "a %s is not iterable", jv_type_name(v));
	}
	return *out ? 0 : nomem(r, line);
}

/* An item's attribute for selectattr/map: a dict's key, dotted paths walked ("a.b"), a list's
 * index for a number. */
static struct jv attr_of(const struct jv *item, const struct jstr *path)
{
	struct jv cur = *item;
	size_t b = 0;
	while (b <= path->n) {
		size_t e = b;
		while (e < path->n && path->p[e] != '.')
			e++;
		const char *k = path->p + b;
		size_t kn = e - b;
		if (cur.t == JV_DICT || cur.t == JV_NS) {
			struct jv *v = jdict_get(cur.d, k, kn);
			if (!v)
				return jv_undef("an attribute");
			cur = *v;
		} else if (cur.t == JV_LIST && kn && kn < 10 && k[0] >= '0' && k[0] <= '9') {
			size_t idx = 0;
			for (size_t q = 0; q < kn; q++) {
				if (k[q] < '0' || k[q] > '9')
					return jv_undef("an attribute");
				idx = idx * 10 + (size_t)(k[q] - '0');
			}
			if (idx >= cur.l->n)
				return jv_undef("an attribute");
			cur = cur.l->v[idx];
		} else {
			return jv_undef("an attribute");
		}
		b = e + 1;
	}
	return cur;
}

/* select/reject/selectattr/rejectattr: args from `from` on are the test's name and arguments. */
static int select_items(struct render *r, const struct jv *v, const struct call_args *a, bool attr, bool keep,
			int line, struct jv *out)
{
	struct jlist *items;
	if (items_of(r, v, line, &items))
		return -1;
	size_t from = 0;
	struct jstr path = {0};
	if (attr) {
		const struct jv *p = arg(a, 0, NULL);
		if (!p || p->t != JV_STR)
			return render_fail(r, -EINVAL, line, "selectattr/rejectattr need an attribute name");
		path = p->s;
		from = 1;
	}
	int test = -1;
	const struct jv *tn = arg(a, from, NULL);
	if (tn) {
		char name[32];
		if (tn->t != JV_STR || tn->s.n >= sizeof(name))
			return render_fail(r, -EINVAL, line, "a test's name must be a string");
		memcpy(name, tn->s.p, tn->s.n);
		name[tn->s.n] = 0;
		if ((test = builtin_test(name)) < 0)
			return render_fail(r, -EINVAL, line, "no test named '%s'", name);
	}
	struct call_args targs = {.pos = a->n_pos > from + 1 ? a->pos + from + 1 : NULL,
				  .n_pos = a->n_pos > from + 1 ? a->n_pos - from - 1 : 0};
	struct jlist *o = jlist_new(render_arena(r), items->n);
	if (!o)
		return nomem(r, line);
	o->n = 0;
	for (size_t i = 0; i < items->n; i++) {
		struct jv x = attr ? attr_of(&items->v[i], &path) : items->v[i];
		bool t;
		if (test < 0)
			t = jv_truthy(&x);
		else if (builtin_call_test(r, test, &x, &targs, line, &t))
			return -1;
		if (t == keep)
			o->v[o->n++] = items->v[i];
	}
	*out = list_value(o);
	return render_step(r, items->n, line);
}

static int join(struct render *r, const struct jv *v, const struct jv *sep, const struct jv *attr, int line,
		struct jv *out)
{
	struct jlist *items;
	if (items_of(r, v, line, &items))
		return -1;
	struct sbuf b;
	sbuf_init(&b, render_arena(r), JINJA_MAX_OUTPUT);
	for (size_t i = 0; i < items->n; i++) {
		if (i && sep)
			jv_print(&b, sep, false);
		struct jv x = attr && attr->t == JV_STR ? attr_of(&items->v[i], &attr->s) : items->v[i];
		jv_print(&b, &x, false);
	}
	if (b.err)
		return nomem(r, line);
	*out = sbuf_value(&b);
	return render_step(r, items->n, line);
}

/* Python's str.split(sep, maxsplit): sep NULL splits on runs of white space. */
static int split(struct render *r, const struct jstr *s, const struct jstr *sep, int64_t maxsplit, int line,
		 struct jv *out)
{
	if (sep && !sep->n)
		return render_fail(r, -EINVAL, line, "split: empty separator");
	size_t cap = 8, n = 0;
	struct jv *v = arena_alloc(render_arena(r), cap * sizeof(*v));
	size_t i = 0, l;
	for (;;) {
		size_t b, e;
		if (!sep) {
			while (i < s->n && py_space(cp_at(s->p, s->n, i, &l)))
				i += l;
			if (i >= s->n)
				break;
			b = i;
			if (maxsplit >= 0 && (int64_t)n >= maxsplit) { /* the rest, as it is after its leading space */
				e = s->n;
				i = s->n;
			} else {
				while (i < s->n && !py_space(cp_at(s->p, s->n, i, &l)))
					i += l;
				e = i;
			}
		} else {
			b = i;
			const char *f = maxsplit >= 0 && (int64_t)n >= maxsplit ? NULL
									    : memmem(s->p + i, s->n - i, sep->p, sep->n);
			e = f ? (size_t)(f - s->p) : s->n;
			i = f ? e + sep->n : s->n + 1;
		}
		if (!v)
			return nomem(r, line);
		if (n == cap) {
			struct jv *nv = arena_alloc(render_arena(r), cap * 2 * sizeof(*nv));
			if (!nv)
				return nomem(r, line);
			memcpy(nv, v, n * sizeof(*nv));
			v = nv;
			cap *= 2;
		}
		v[n++] = jv_str(s->p + b, e - b, s->m ? s->m + b : NULL);
		if (sep && i > s->n)
			break;
	}
	struct jlist *lst = jlist_new(render_arena(r), n);
	if (!lst)
		return nomem(r, line);
	if (n)
		memcpy(lst->v, v, n * sizeof(*v));
	*out = list_value(lst);
	return render_step(r, n, line);
}

static int replace(struct render *r, const struct jstr *s, const struct jstr *old, const struct jstr *new,
		   int64_t count, int line, struct jv *out)
{
	struct sbuf b;
	sbuf_init(&b, render_arena(r), JINJA_MAX_OUTPUT);
	size_t i = 0;
	int64_t done = 0;
	if (!old->n) { /* Python inserts new between every character (and at both ends) */
		size_t l;
		for (; i <= s->n && (count < 0 || done < count); done++) {
			sbuf_add_str(&b, new);
			if (i == s->n)
				break;
			cp_at(s->p, s->n, i, &l);
			sbuf_add(&b, s->p + i, l, s->m ? s->m + i : NULL);
			i += l;
		}
		if (i < s->n)
			sbuf_add(&b, s->p + i, s->n - i, s->m ? s->m + i : NULL);
	} else {
		while (i < s->n && (count < 0 || done < count)) {
			const char *f = memmem(s->p + i, s->n - i, old->p, old->n);
			if (!f)
				break;
			size_t k = (size_t)(f - s->p);
			sbuf_add(&b, s->p + i, k - i, s->m ? s->m + i : NULL);
			sbuf_add_str(&b, new);
			i = k + old->n;
			done++;
		}
		sbuf_add(&b, s->p + i, s->n - i, s->m ? s->m + i : NULL);
	}
	if (b.err)
		return nomem(r, line);
	*out = sbuf_value(&b);
	return render_step(r, b.n / 64, line);
}

/* Jinja's indent filter: lines after the first (or every line, first=True) get width spaces,
 * blank lines too only where blank=True. */
static int indent(struct render *r, const struct jstr *s, const struct jv *width, bool first, bool blank, int line,
		  struct jv *out)
{
	struct sbuf ind, b;
	sbuf_init(&ind, render_arena(r), 4096);
	if (!width)
		sbuf_adds(&ind, "    ");
	else if (width->t == JV_STR)
		sbuf_add_str(&ind, &width->s);
	else if (width->t == JV_INT && width->i >= 0 && width->i <= 1024)
		for (int64_t i = 0; i < width->i; i++)
			sbuf_adds(&ind, " ");
	else
		return render_fail(r, -EINVAL, line, "indent: the width must be a string or an integer up to 1024");
	sbuf_init(&b, render_arena(r), JINJA_MAX_OUTPUT);
	if (first)
		sbuf_add(&b, ind.p, ind.n, NULL);
	/* Jinja: the lines of s + "\n" (so a last newline leaves an empty last line), the first as
	 * it is, each other after a newline and, unless blank it is and blank is not set, ind */
	size_t i = 0;
	bool line0 = true;
	for (;;) { /* lines end at \n, \r\n or \r (str.splitlines) and are joined by \n */
		size_t e = i;
		while (e < s->n && s->p[e] != '\n' && s->p[e] != '\r')
			e++;
		if (!line0) {
			sbuf_adds(&b, "\n");
			if (e > i || blank)
				sbuf_add(&b, ind.p, ind.n, NULL);
		}
		sbuf_add(&b, s->p + i, e - i, s->m ? s->m + i : NULL);
		line0 = false;
		if (e >= s->n)
			break;
		i = e + (s->p[e] == '\r' && e + 1 < s->n && s->p[e + 1] == '\n' ? 2 : 1);
	}
	if (b.err || ind.err)
		return nomem(r, line);
	*out = sbuf_value(&b);
	return 0;
}

/* Equal, strings compared without ASCII case (Jinja's unique is case-insensitive by default). */
static bool same_fold(const struct jv *a, const struct jv *b)
{
	if (a->t != JV_STR || b->t != JV_STR)
		return jv_equal(a, b);
	if (a->s.n != b->s.n)
		return false;
	for (size_t i = 0; i < a->s.n; i++) {
		char x = a->s.p[i], y = b->s.p[i];
		x = x >= 'A' && x <= 'Z' ? (char)(x + 32) : x;
		y = y >= 'A' && y <= 'Z' ? (char)(y + 32) : y;
		if (x != y)
			return false;
	}
	return true;
}

/* ---- filters ------------------------------------------------------------------------------------ */

int builtin_call_filter(struct render *r, int f, const struct jv *v, const struct call_args *a, int line,
			struct jv *out)
{
	struct arena *ar = render_arena(r);
	const char *name = filters[f];
	static const char *const no_kw[] = {NULL};
	struct jlist *items;
	switch ((enum filter)f) {
	case F_SAFE:
		if (check_args(r, name, a, 0, no_kw, line))
			return -1;
		*out = *v;
		return 0;
	case F_TRIM: {
		static const char *const kw[] = {"chars", NULL};
		const struct jv *chars = arg(a, 0, "chars");
		struct jv s;
		if (check_args(r, name, a, 1, kw, line) || to_str(r, v, line, &s))
			return -1;
		if (chars && chars->t != JV_STR && chars->t != JV_NONE)
			return render_fail(r, -EINVAL, line, "trim: chars must be a string");
		const struct jstr *cs = chars && chars->t == JV_STR ? &chars->s : NULL;
		if (render_step(r, strip_cost(&s.s, cs), line))
			return -1;
		*out = strip(&s.s, cs, true, true);
		return 0;
	}
	case F_LENGTH:
	case F_COUNT:
		if (check_args(r, name, a, 0, no_kw, line))
			return -1;
		if (v->t == JV_STR) { /* code points, counted without a value each */
			int64_t n = 0;
			for (size_t i = 0; i < v->s.n; i++)
				n += ((unsigned char)v->s.p[i] & 0xc0) != 0x80;
			*out = jv_int(n);
			return render_step(r, v->s.n / 256, line);
		}
		if (v->t == JV_LIST || v->t == JV_DICT || v->t == JV_UNDEF || v->t == JV_NS) {
			if (items_of(r, v, line, &items))
				return -1;
			*out = jv_int((int64_t)items->n);
			return 0;
		}
		return render_fail(r, -EINVAL, line, "a %s has no length", jv_type_name(v));
	case F_TOJSON: {
		static const char *const kw[] = {"ensure_ascii", "indent", "separators", "sort_keys", NULL};
		if (check_args(r, name, a, 4, kw, line))
			return -1;
		const struct jv *ea = arg(a, 0, "ensure_ascii"), *ind = arg(a, 1, "indent"),
				*seps = arg(a, 2, "separators"), *sk = arg(a, 3, "sort_keys");
		if (ea && jv_truthy(ea))
			return render_fail(r, -EINVAL, line, "tojson: ensure_ascii=True is not supported");
		int indent_n = -1;
		if (ind && ind->t != JV_NONE) {
			if (ind->t != JV_INT || ind->i < 0 || ind->i > 64)
				return render_fail(r, -EINVAL, line, "tojson: indent must be an integer from 0 to 64");
			indent_n = (int)ind->i;
		}
		char isep[16] = "", ksep[16] = "";
		bool have_seps = false;
		if (seps && seps->t != JV_NONE) {
			if (seps->t != JV_LIST || seps->l->n != 2 || seps->l->v[0].t != JV_STR || seps->l->v[1].t != JV_STR ||
			    seps->l->v[0].s.n >= sizeof(isep) || seps->l->v[1].s.n >= sizeof(ksep))
				return render_fail(r, -EINVAL, line, "tojson: separators must be two short strings");
			memcpy(isep, seps->l->v[0].s.p, seps->l->v[0].s.n);
			memcpy(ksep, seps->l->v[1].s.p, seps->l->v[1].s.n);
			have_seps = true;
		}
		struct sbuf b;
		char err[256];
		sbuf_init(&b, ar, JINJA_MAX_OUTPUT);
		int rc = jv_json(&b, v, indent_n, have_seps ? isep : NULL, have_seps ? ksep : NULL, sk && jv_truthy(sk), 0,
				 err, sizeof(err));
		if (rc)
			return render_fail(r, rc, line, "%s", err);
		if (b.err)
			return nomem(r, line);
		*out = sbuf_value(&b);
		return render_step(r, b.n / 64, line);
	}
	case F_JOIN: {
		static const char *const kw[] = {"d", "attribute", NULL};
		if (check_args(r, name, a, 2, kw, line))
			return -1;
		return join(r, v, arg(a, 0, "d"), arg(a, 1, "attribute"), line, out);
	}
	case F_LIST:
		if (check_args(r, name, a, 0, no_kw, line) || items_of(r, v, line, &items))
			return -1;
		*out = list_value(items);
		return 0;
	case F_FIRST:
	case F_LAST:
		if (check_args(r, name, a, 0, no_kw, line))
			return -1;
		if (v->t == JV_STR) { /* one code point, found without a value each */
			if (!v->s.n) {
				*out = jv_undef(f == F_FIRST ? "the first item" : "the last item");
				return 0;
			}
			size_t b = 0, e = v->s.n;
			if (f == F_FIRST)
				for (e = 1; e < v->s.n && ((unsigned char)v->s.p[e] & 0xc0) == 0x80; e++)
					;
			else
				for (b = v->s.n - 1; b > 0 && v->s.n - b < 4 && ((unsigned char)v->s.p[b] & 0xc0) == 0x80; b--)
					;
			*out = jv_str(v->s.p + b, e - b, v->s.m ? v->s.m + b : NULL);
			return 0;
		}
		if (items_of(r, v, line, &items))
			return -1;
		*out = !items->n ? jv_undef(f == F_FIRST ? "the first item" : "the last item")
				 : items->v[f == F_FIRST ? 0 : items->n - 1];
		return 0;
	case F_UPPER:
	case F_LOWER:
	case F_CAPITALIZE:
	case F_TITLE:
		if (check_args(r, name, a, 0, no_kw, line))
			return -1;
		return recase(r, v,
			      f == F_UPPER ? C_UPPER : f == F_LOWER ? C_LOWER : f == F_CAPITALIZE ? C_CAPITALIZE : C_TITLE,
			      line, out);
	case F_DEFAULT:
	case F_D: {
		static const char *const kw[] = {"default_value", "boolean", NULL};
		if (check_args(r, name, a, 2, kw, line))
			return -1;
		const struct jv *dv = arg(a, 0, "default_value"), *bo = arg(a, 1, "boolean");
		bool use = v->t == JV_UNDEF || (bo && jv_truthy(bo) && !jv_truthy(v));
		*out = !use ? *v : dv ? *dv : jv_str("", 0, NULL);
		return 0;
	}
	case F_SELECTATTR:
	case F_REJECTATTR:
		return select_items(r, v, a, true, f == F_SELECTATTR, line, out);
	case F_SELECT:
	case F_REJECT:
		return select_items(r, v, a, false, f == F_SELECT, line, out);
	case F_MAP: {
		static const char *const kw[] = {"attribute", "default", NULL};
		if (items_of(r, v, line, &items))
			return -1;
		const struct jv *at = arg(a, SIZE_MAX, "attribute"), *df = arg(a, SIZE_MAX, "default");
		struct jlist *o = jlist_new(ar, items->n);
		if (!o)
			return nomem(r, line);
		if (at) {
			if (check_args(r, name, a, 0, kw, line))
				return -1;
			if (at->t != JV_STR)
				return render_fail(r, -EINVAL, line, "map: attribute must be a string");
			for (size_t i = 0; i < items->n; i++) {
				o->v[i] = attr_of(&items->v[i], &at->s);
				if (o->v[i].t == JV_UNDEF && df)
					o->v[i] = *df;
			}
		} else {
			const struct jv *fn = arg(a, 0, NULL);
			char fname[32];
			int sub;
			if (!fn || fn->t != JV_STR || fn->s.n >= sizeof(fname))
				return render_fail(r, -EINVAL, line, "map needs a filter's name or attribute=");
			memcpy(fname, fn->s.p, fn->s.n);
			fname[fn->s.n] = 0;
			if ((sub = builtin_filter(fname)) < 0)
				return render_fail(r, -EINVAL, line, "no filter named '%s'", fname);
			if (sub == F_MAP || sub == F_SELECT || sub == F_REJECT || sub == F_SELECTATTR || sub == F_REJECTATTR)
				return render_fail(r, -EINVAL, line, "map cannot apply '%s' (a filter of filters)", fname);
			struct call_args sa = {.pos = a->pos + 1, .n_pos = a->n_pos - 1, .kwnames = a->kwnames,
					       .kw = a->kw, .n_kw = a->n_kw};
			for (size_t i = 0; i < items->n; i++)
				if (builtin_call_filter(r, sub, &items->v[i], &sa, line, &o->v[i]))
					return -1;
		}
		*out = list_value(o);
		return render_step(r, items->n, line);
	}
	case F_STRING:
		if (check_args(r, name, a, 0, no_kw, line))
			return -1;
		return to_str(r, v, line, out);
	case F_INT:
	case F_FLOAT: {
		static const char *const kw[] = {"default", "base", NULL};
		if (check_args(r, name, a, 2, kw, line))
			return -1;
		const struct jv *dv = arg(a, 0, "default");
		struct jv fallback = dv ? *dv : f == F_INT ? jv_int(0) : jv_float(0);
		if (v->t == JV_INT || v->t == JV_BOOL) {
			*out = f == F_INT ? jv_int(v->t == JV_INT ? v->i : v->b) : jv_float(v->t == JV_INT ? (double)v->i : v->b);
		} else if (v->t == JV_FLOAT) {
			if (f == F_INT && !(fabs(v->f) < 9.2e18))
				*out = fallback;
			else
				*out = f == F_INT ? jv_int((int64_t)v->f) : *v;
		} else if (v->t == JV_STR) {
			char buf[64];
			struct jv t = strip(&v->s, NULL, true, true);
			if (t.s.n >= sizeof(buf)) {
				*out = fallback;
				return 0;
			}
			memcpy(buf, t.s.p, t.s.n);
			buf[t.s.n] = 0;
			char *end;
			errno = 0;
			if (f == F_INT) {
				long long x = strtoll(buf, &end, 10);
				if (*end || !t.s.n || errno) { /* Jinja tries the text as a float next */
					double d = strtod(buf, &end);
					*out = *end || !t.s.n || !(fabs(d) < 9.2e18) ? fallback : jv_int((int64_t)d);
				} else {
					*out = jv_int(x);
				}
			} else {
				double d = strtod(buf, &end);
				*out = *end || !t.s.n ? fallback : jv_float(d);
			}
		} else {
			*out = fallback;
		}
		return 0;
	}
	case F_ABS:
		if (check_args(r, name, a, 0, no_kw, line))
			return -1;
		if (v->t == JV_INT && v->i != INT64_MIN)
			*out = jv_int(v->i < 0 ? -v->i : v->i);
		else if (v->t == JV_FLOAT)
			*out = jv_float(fabs(v->f));
		else if (v->t == JV_BOOL)
			*out = jv_int(v->b);
		else
			return render_fail(r, -EINVAL, line, "abs needs a number, not %s", jv_type_name(v));
		return 0;
	case F_REPLACE: {
		static const char *const kw[] = {"old", "new", "count", NULL};
		const struct jv *o = arg(a, 0, "old"), *n = arg(a, 1, "new"), *c = arg(a, 2, "count");
		struct jv s;
		int64_t count = -1;
		if (check_args(r, name, a, 3, kw, line) || to_str(r, v, line, &s))
			return -1;
		if (!o || !n || o->t != JV_STR || n->t != JV_STR)
			return render_fail(r, -EINVAL, line, "replace needs two strings");
		if (c && c->t != JV_NONE && need_int(r, "replace's count", c, line, &count))
			return -1;
		return replace(r, &s.s, &o->s, &n->s, count, line, out);
	}
	case F_REVERSE: {
		if (check_args(r, name, a, 0, no_kw, line) || items_of(r, v, line, &items))
			return -1;
		struct jlist *o = jlist_new(ar, items->n);
		if (!o)
			return nomem(r, line);
		for (size_t i = 0; i < items->n; i++)
			o->v[i] = items->v[items->n - 1 - i];
		if (v->t != JV_STR) {
			*out = list_value(o);
			return 0;
		}
		struct jv lv = list_value(o);
		return join(r, &lv, NULL, NULL, line, out);
	}
	case F_ITEMS: {
		if (check_args(r, name, a, 0, no_kw, line))
			return -1;
		if (v->t == JV_UNDEF) {
			*out = list_value(jlist_new(ar, 0));
			return out->l ? 0 : nomem(r, line);
		}
		if (v->t != JV_DICT)
			return render_fail(r, -EINVAL, line, "items needs a dict, not %s", jv_type_name(v));
		goto dict_items;
	}
	case F_UNIQUE: {
		if (check_args(r, name, a, 0, no_kw, line) || items_of(r, v, line, &items))
			return -1;
		struct jlist *o = jlist_new(ar, items->n);
		if (!o)
			return nomem(r, line);
		o->n = 0;
		for (size_t i = 0; i < items->n; i++) {
			if (render_step(r, o->n / 16 + 1, line))
				return -1;
			bool seen = false;
			for (size_t k = 0; k < o->n && !seen; k++)
				seen = same_fold(&o->v[k], &items->v[i]);
			if (!seen)
				o->v[o->n++] = items->v[i];
		}
		*out = list_value(o);
		return 0;
	}
	case F_INDENT: {
		static const char *const kw[] = {"width", "first", "blank", NULL};
		struct jv s;
		if (check_args(r, name, a, 3, kw, line) || to_str(r, v, line, &s))
			return -1;
		const struct jv *fi = arg(a, 1, "first"), *bl = arg(a, 2, "blank");
		return indent(r, &s.s, arg(a, 0, "width"), fi && jv_truthy(fi), bl && jv_truthy(bl), line, out);
	}
	}
	return render_fail(r, -EINVAL, line, "internal: filter %d", f);
dict_items: {
	struct jlist *o = jlist_new(ar, v->d->n);
	if (!o)
		return nomem(r, line);
	for (size_t i = 0; i < v->d->n; i++) {
		struct jlist *pair = jlist_new(ar, 2);
		if (!pair)
			return nomem(r, line);
		pair->tuple = true;
		pair->v[0] = v->d->k[i];
		pair->v[1] = v->d->v[i];
		o->v[i] = list_value(pair);
	}
	*out = list_value(o);
	return render_step(r, v->d->n, line);
}
}

/* ---- tests ---------------------------------------------------------------------------------------- */

int builtin_call_test(struct render *r, int t, const struct jv *v, const struct call_args *a, int line, bool *out)
{
	const struct jv *x = arg(a, 0, NULL);
	bool needs_arg = t == T_EQ || t == T_NE || t == T_LT || t == T_LE || t == T_GT || t == T_GE || t == T_IN ||
			 t == T_DIVISIBLEBY || t == T_SAMEAS;
	if (needs_arg && (!x || a->n_pos > 1))
		return render_fail(r, -EINVAL, line, "this test takes one argument");
	if (!needs_arg && a->n_pos)
		return render_fail(r, -EINVAL, line, "this test takes no argument");
	int cmp;
	int64_t k = 0;
	switch ((enum test)t) {
	case T_DEFINED:
		*out = v->t != JV_UNDEF;
		return 0;
	case T_UNDEFINED:
		*out = v->t == JV_UNDEF;
		return 0;
	case T_NONE:
		*out = v->t == JV_NONE;
		return 0;
	case T_BOOLEAN:
		*out = v->t == JV_BOOL;
		return 0;
	case T_TRUE:
		*out = v->t == JV_BOOL && v->b;
		return 0;
	case T_FALSE:
		*out = v->t == JV_BOOL && !v->b;
		return 0;
	case T_INTEGER:
		*out = v->t == JV_INT;
		return 0;
	case T_FLOAT:
		*out = v->t == JV_FLOAT;
		return 0;
	case T_NUMBER:
		*out = v->t == JV_INT || v->t == JV_FLOAT || v->t == JV_BOOL;
		return 0;
	case T_STRING:
		*out = v->t == JV_STR;
		return 0;
	case T_MAPPING:
		*out = v->t == JV_DICT;
		return 0;
	case T_ITERABLE:
		*out = v->t == JV_STR || v->t == JV_LIST || v->t == JV_DICT || v->t == JV_UNDEF;
		return 0;
	case T_SEQUENCE:
		*out = v->t == JV_STR || v->t == JV_LIST || v->t == JV_DICT;
		return 0;
	case T_CALLABLE:
		*out = v->t == JV_FUNC || v->t == JV_METHOD || v->t == JV_MACRO;
		return 0;
	case T_EQ:
		*out = jv_equal(v, x);
		return 0;
	case T_NE:
		*out = !jv_equal(v, x);
		return 0;
	case T_LT:
	case T_LE:
	case T_GT:
	case T_GE:
		if (jv_compare(v, x, &cmp))
			return render_fail(r, -EINVAL, line, "%s and %s do not compare", jv_type_name(v), jv_type_name(x));
		*out = t == T_LT ? cmp < 0 : t == T_LE ? cmp <= 0 : t == T_GT ? cmp > 0 : cmp >= 0;
		return 0;
	case T_IN:
		if (render_step(r, x->t == JV_STR ? x->s.n / 256 : x->t == JV_LIST ? x->l->n : 0, line))
			return -1;
		if (x->t == JV_STR) {
			if (need_str(r, "'in' a string", v, line))
				return -1;
			*out = !v->s.n || memmem(x->s.p, x->s.n, v->s.p, v->s.n);
		} else if (x->t == JV_LIST) {
			*out = false;
			for (size_t i = 0; i < x->l->n && !*out; i++)
				*out = jv_equal(&x->l->v[i], v);
		} else if (x->t == JV_DICT) {
			*out = v->t == JV_STR && jdict_get(x->d, v->s.p, v->s.n);
		} else {
			return render_fail(r, -EINVAL, line, "a %s cannot hold anything ('in')", jv_type_name(x));
		}
		return 0;
	case T_ODD:
	case T_EVEN:
		if (need_int(r, t == T_ODD ? "odd" : "even", v, line, &k))
			return -1;
		*out = (k % 2 != 0) == (t == T_ODD);
		return 0;
	case T_DIVISIBLEBY: {
		int64_t d = 0;
		if (need_int(r, "divisibleby", v, line, &k) || need_int(r, "divisibleby", x, line, &d))
			return -1;
		if (!d)
			return render_fail(r, -EINVAL, line, "divisibleby 0");
		*out = d == -1 || k % d == 0;
		return 0;
	}
	case T_LOWER:
	case T_UPPER: {
		if (need_str(r, t == T_LOWER ? "lower" : "upper", v, line))
			return -1;
		bool cased = false, ok = true;
		for (size_t i = 0; i < v->s.n; i++) {
			char c = v->s.p[i];
			if (c >= 'a' && c <= 'z') {
				cased = true;
				ok = ok && t == T_LOWER;
			} else if (c >= 'A' && c <= 'Z') {
				cased = true;
				ok = ok && t == T_UPPER;
			}
		}
		*out = cased && ok;
		return 0;
	}
	case T_SAMEAS:
		/* Python's `is`: the same object; numbers and strings of the same value count as the same */
		*out = v->t == x->t && (v->t == JV_NONE || v->t == JV_UNDEF || (v->t == JV_BOOL && v->b == x->b) ||
					(v->t == JV_INT && v->i == x->i) || (v->t == JV_FLOAT && v->f == x->f) ||
					(v->t == JV_STR && jv_equal(v, x)) ||
					((v->t == JV_LIST && v->l == x->l) || ((v->t == JV_DICT || v->t == JV_NS) && v->d == x->d)));
		return 0;
	}
	return render_fail(r, -EINVAL, line, "internal: test %d", t);
}

/* ---- functions and methods ----------------------------------------------------------------------- */

static int str_method(struct render *r, enum method m, const struct jv *self, const struct call_args *a, int line,
		      struct jv *out)
{
	const struct jstr *s = &self->s;
	const char *name = methods[m];
	const struct jv *x = arg(a, 0, NULL), *y = arg(a, 1, NULL);
	switch (m) {
	case M_STRIP:
	case M_LSTRIP:
	case M_RSTRIP: {
		static const char *const kw[] = {"chars", NULL};
		x = arg(a, 0, "chars");
		if (check_args(r, name, a, 1, kw, line))
			return -1;
		if (x && x->t != JV_STR && x->t != JV_NONE)
			return render_fail(r, -EINVAL, line, "%s: chars must be a string", name);
		const struct jstr *cs = x && x->t == JV_STR ? &x->s : NULL;
		if (render_step(r, strip_cost(s, cs), line))
			return -1;
		*out = strip(s, cs, m != M_RSTRIP, m != M_LSTRIP);
		return 0;
	}
	case M_STARTSWITH:
	case M_ENDSWITH: {
		if (check_args(r, name, a, 1, NULL, line) || !x)
			return x ? -1 : render_fail(r, -EINVAL, line, "%s needs an argument", name);
		const struct jv *opts = x->t == JV_LIST ? x->l->v : x;
		size_t n = x->t == JV_LIST ? x->l->n : 1;
		*out = jv_bool(false);
		for (size_t i = 0; i < n; i++) {
			if (need_str(r, name, &opts[i], line))
				return -1;
			const struct jstr *p = &opts[i].s;
			if (p->n <= s->n && !memcmp(m == M_STARTSWITH ? s->p : s->p + s->n - p->n, p->p, p->n))
				*out = jv_bool(true);
		}
		return 0;
	}
	case M_SPLIT: {
		static const char *const kw[] = {"sep", "maxsplit", NULL};
		x = arg(a, 0, "sep");
		y = arg(a, 1, "maxsplit");
		int64_t maxsplit = -1;
		if (check_args(r, name, a, 2, kw, line))
			return -1;
		if (x && x->t != JV_NONE && need_str(r, "split's separator", x, line))
			return -1;
		if (y && need_int(r, "split's maxsplit", y, line, &maxsplit))
			return -1;
		return split(r, s, x && x->t == JV_STR ? &x->s : NULL, maxsplit, line, out);
	}
	case M_UPPER:
	case M_LOWER:
	case M_TITLE:
	case M_CAPITALIZE:
		if (check_args(r, name, a, 0, NULL, line))
			return -1;
		return recase(r, self,
			      m == M_UPPER ? C_UPPER : m == M_LOWER ? C_LOWER : m == M_TITLE ? C_TITLE_METHOD : C_CAPITALIZE,
			      line, out);
	case M_REPLACE: {
		const struct jv *c = arg(a, 2, NULL);
		int64_t count = -1;
		if (check_args(r, name, a, 3, NULL, line))
			return -1;
		if (!x || !y || x->t != JV_STR || y->t != JV_STR)
			return render_fail(r, -EINVAL, line, "replace needs two strings");
		if (c && need_int(r, "replace's count", c, line, &count))
			return -1;
		return replace(r, s, &x->s, &y->s, count, line, out);
	}
	case M_FIND: {
		if (check_args(r, name, a, 1, NULL, line) || !x || need_str(r, "find", x, line))
			return x ? -1 : render_fail(r, -EINVAL, line, "find needs a string");
		const char *f = memmem(s->p, s->n, x->s.p, x->s.n);
		int64_t at = -1;
		if (f) {
			at = 0;
			for (const char *p = s->p; p < f; p++)
				at += ((unsigned char)*p & 0xc0) != 0x80;
		}
		*out = jv_int(at);
		return 0;
	}
	case M_JOIN:
		if (check_args(r, name, a, 1, NULL, line) || !x)
			return x ? -1 : render_fail(r, -EINVAL, line, "join needs a list");
		return join(r, x, self, NULL, line, out);
	default:
		return render_fail(r, -EINVAL, line, "internal: method %d", m);
	}
}

static int dict_method(struct render *r, enum method m, const struct jv *self, const struct call_args *a, int line,
		       struct jv *out)
{
	struct arena *ar = render_arena(r);
	const struct jdict *d = self->d;
	if (m == M_GET) {
		const struct jv *k = arg(a, 0, NULL), *dv = arg(a, 1, NULL);
		if (check_args(r, "get", a, 2, NULL, line) || !k)
			return k ? -1 : render_fail(r, -EINVAL, line, "get needs a key");
		const struct jv *v = k->t == JV_STR ? jdict_get(d, k->s.p, k->s.n) : NULL;
		*out = v ? *v : dv ? *dv : jv_none();
		return 0;
	}
	if (check_args(r, methods[m], a, 0, NULL, line))
		return -1;
	struct jlist *o = jlist_new(ar, d->n);
	if (!o)
		return nomem(r, line);
	for (size_t i = 0; i < d->n; i++) {
		if (m == M_KEYS) {
			o->v[i] = d->k[i];
		} else if (m == M_VALUES) {
			o->v[i] = d->v[i];
		} else {
			struct jlist *pair = jlist_new(ar, 2);
			if (!pair)
				return nomem(r, line);
			pair->tuple = true;
			pair->v[0] = d->k[i];
			pair->v[1] = d->v[i];
			o->v[i] = list_value(pair);
		}
	}
	*out = list_value(o);
	return render_step(r, d->n, line);
}

int builtin_call(struct render *r, const struct jv *fn, const struct call_args *a, int line, struct jv *out)
{
	struct arena *ar = render_arena(r);
	if (fn->t == JV_METHOD) {
		enum method m = (enum method)(fn->call.fn - METHOD_BASE);
		return fn->call.self->t == JV_STR ? str_method(r, m, fn->call.self, a, line, out)
					       : dict_method(r, m, fn->call.self, a, line, out);
	}
	switch ((enum function)fn->call.fn) {
	case FN_RAISE: {
		const struct jv *msg = arg(a, 0, NULL);
		struct jv s = jv_str("(no message)", 12, NULL);
		if (msg && to_str(r, msg, line, &s))
			return -1;
		return render_fail(r, -EBADMSG, line, "the chat template refused the chat: %.*s", (int)(s.s.n < 400 ? s.s.n : 400),
				   s.s.p);
	}
	case FN_STRFTIME: {
		const struct jv *f = arg(a, 0, NULL);
		if (check_args(r, "strftime_now", a, 1, NULL, line) || !f || need_str(r, "strftime_now", f, line))
			return f ? -1 : render_fail(r, -EINVAL, line, "strftime_now needs a format");
		char fmt[128], buf[256];
		if (f->s.n >= sizeof(fmt) || memchr(f->s.p, 0, f->s.n))
			return render_fail(r, -EINVAL, line, "strftime_now: the format is too long");
		memcpy(fmt, f->s.p, f->s.n);
		fmt[f->s.n] = 0;
		time_t now = render_now(r);
		struct tm tm;
		localtime_r(&now, &tm);
		size_t n = strftime(buf, sizeof(buf), fmt, &tm);
		if (!n && fmt[0])
			return render_fail(r, -EINVAL, line, "strftime_now: the format gives nothing or too much");
		*out = jv_str_copy(ar, buf, n, false);
		return 0;
	}
	case FN_NAMESPACE: {
		struct jdict *d = jdict_new(ar, a->n_kw + 4);
		if (!d)
			return nomem(r, line);
		const struct jv *init = arg(a, 0, NULL);
		if (a->n_pos > 1 || (init && init->t != JV_DICT))
			return render_fail(r, -EINVAL, line, "namespace takes a dict and keyword arguments");
		for (size_t i = 0; init && i < init->d->n; i++)
			if (jdict_set(ar, d, init->d->k[i], init->d->v[i]))
				return nomem(r, line);
		for (size_t i = 0; i < a->n_kw; i++)
			if (jdict_set(ar, d, jv_cstr(a->kwnames[i]), a->kw[i]))
				return nomem(r, line);
		*out = (struct jv){.t = JV_NS, .d = d};
		return 0;
	}
	case FN_RANGE: {
		int64_t v[3] = {0, 0, 1};
		if (a->n_pos < 1 || a->n_pos > 3 || a->n_kw)
			return render_fail(r, -EINVAL, line, "range takes one to three integers");
		for (size_t i = 0; i < a->n_pos; i++)
			if (need_int(r, "range", &a->pos[i], line, &v[a->n_pos == 1 ? 1 : i]))
				return -1;
		if (!v[2])
			return render_fail(r, -EINVAL, line, "range's step must not be zero");
		double count = ceil(((double)v[1] - (double)v[0]) / (double)v[2]);
		if (count < 0)
			count = 0;
		if (count > 100000)
			return render_fail(r, -E2BIG, line, "range of more than 100000 items");
		struct jlist *l = jlist_new(ar, (size_t)count);
		if (!l)
			return nomem(r, line);
		for (size_t i = 0; i < l->n; i++)
			l->v[i] = jv_int(v[0] + (int64_t)i * v[2]);
		*out = list_value(l);
		return render_step(r, l->n, line);
	}
	}
	return render_fail(r, -EINVAL, line, "internal: function %d", fn->call.fn);
}

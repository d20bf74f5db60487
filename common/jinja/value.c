/* value.c - a render's arena and its values: making them, comparing them, printing them as
 * Python prints them, and JSON (in and out) as Python's json module writes it. */
#include "common/jinja/jinja_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* ---- the arena ----------------------------------------------------------------------------- */

struct chunk {
	struct chunk *next;
	size_t used, size;
	_Alignas(16) unsigned char data[];
};

struct arena {
	struct chunk *head;
	size_t total, cap;
	bool exhausted;
};

struct arena *arena_create(size_t cap)
{
	struct arena *a = calloc(1, sizeof(*a));
	if (a)
		a->cap = cap;
	return a;
}

void arena_destroy(struct arena *a)
{
	if (!a)
		return;
	for (struct chunk *c = a->head, *n; c; c = n) {
		n = c->next;
		free(c);
	}
	free(a);
}

void *arena_alloc(struct arena *a, size_t n)
{
	n = ALIGN_UP(n ? n : 1, (size_t)16);
	struct chunk *c = a->head;
	if (!c || c->size - c->used < n) {
		size_t size = n > 32768 ? n : 32768;
		if (a->exhausted || size > a->cap - a->total) {
			a->exhausted = true;
			return NULL;
		}
		c = malloc(sizeof(*c) + size);
		if (!c) {
			a->exhausted = true;
			return NULL;
		}
		c->used = 0;
		c->size = size;
		c->next = a->head;
		a->head = c;
		a->total += size;
	}
	void *p = c->data + c->used;
	c->used += n;
	return p;
}

bool arena_exhausted(const struct arena *a)
{
	return a->exhausted;
}

/* ---- making values ------------------------------------------------------------------------- */

struct jv jv_none(void)
{
	return (struct jv){.t = JV_NONE};
}
struct jv jv_bool(bool b)
{
	return (struct jv){.t = JV_BOOL, .b = b};
}
struct jv jv_int(int64_t i)
{
	return (struct jv){.t = JV_INT, .i = i};
}
struct jv jv_float(double f)
{
	return (struct jv){.t = JV_FLOAT, .f = f};
}
struct jv jv_undef(const char *name)
{
	return (struct jv){.t = JV_UNDEF, .undef_name = name};
}
struct jv jv_str(const char *s, size_t n, const uint8_t *m)
{
	return (struct jv){.t = JV_STR, .s = {.p = s, .m = m, .n = n}};
}
struct jv jv_cstr(const char *s)
{
	return jv_str(s, strlen(s), NULL);
}

struct jv jv_str_copy(struct arena *a, const char *s, size_t n, bool data)
{
	char *p = arena_alloc(a, n + 1);
	uint8_t *m = data && n ? arena_alloc(a, n) : NULL;
	if (!p || (data && n && !m))
		return jv_str("", 0, NULL); /* the arena is exhausted: the render fails at its next check */
	memcpy(p, s, n);
	p[n] = 0;
	if (m)
		memset(m, 1, n);
	return jv_str(p, n, m);
}

struct jlist *jlist_new(struct arena *a, size_t n)
{
	struct jlist *l = arena_alloc(a, sizeof(*l));
	if (!l)
		return NULL;
	l->n = n;
	l->tuple = false;
	l->v = arena_alloc(a, (n ? n : 1) * sizeof(struct jv));
	if (!l->v)
		return NULL;
	memset(l->v, 0, (n ? n : 1) * sizeof(struct jv));
	return l;
}

struct jdict *jdict_new(struct arena *a, size_t cap)
{
	struct jdict *d = arena_alloc(a, sizeof(*d));
	if (!d)
		return NULL;
	d->n = 0;
	d->cap = cap ? cap : 4;
	d->k = arena_alloc(a, d->cap * sizeof(struct jv));
	d->v = arena_alloc(a, d->cap * sizeof(struct jv));
	return d->k && d->v ? d : NULL;
}

struct jv *jdict_get(const struct jdict *d, const char *key, size_t n)
{
	for (size_t i = 0; i < d->n; i++)
		if (d->k[i].s.n == n && !memcmp(d->k[i].s.p, key, n))
			return &d->v[i];
	return NULL;
}

int jdict_set(struct arena *a, struct jdict *d, struct jv key, struct jv v)
{
	struct jv *old = jdict_get(d, key.s.p, key.s.n);
	if (old) {
		*old = v;
		return 0;
	}
	if (d->n == d->cap) {
		size_t cap = d->cap * 2;
		struct jv *k = arena_alloc(a, cap * sizeof(*k)), *nv = arena_alloc(a, cap * sizeof(*nv));
		if (!k || !nv)
			return -ENOMEM;
		memcpy(k, d->k, d->n * sizeof(*k));
		memcpy(nv, d->v, d->n * sizeof(*nv));
		d->k = k;
		d->v = nv;
		d->cap = cap;
	}
	d->k[d->n] = key;
	d->v[d->n++] = v;
	return 0;
}

/* ---- truth, equality, order ------------------------------------------------------------------ */

bool jv_truthy(const struct jv *v)
{
	switch (v->t) {
	case JV_UNDEF:
	case JV_NONE:
		return false;
	case JV_BOOL:
		return v->b;
	case JV_INT:
		return v->i != 0;
	case JV_FLOAT:
		return v->f != 0;
	case JV_STR:
		return v->s.n != 0;
	case JV_LIST:
		return v->l->n != 0;
	case JV_DICT:
		return v->d->n != 0;
	default:
		return true;
	}
}

static bool is_num(const struct jv *v)
{
	return v->t == JV_INT || v->t == JV_FLOAT || v->t == JV_BOOL;
}
static double num_of(const struct jv *v)
{
	return v->t == JV_FLOAT ? v->f : v->t == JV_INT ? (double)v->i : (double)v->b;
}
static int64_t int_of(const struct jv *v)
{
	return v->t == JV_INT ? v->i : (int64_t)v->b;
}

static bool equal_at(const struct jv *a, const struct jv *b, int depth);

bool jv_equal(const struct jv *a, const struct jv *b)
{
	return equal_at(a, b, 0);
}

/* Values nested deeper than JINJA_MAX_DEPTH compare unequal (a template can build them; the
 * recursion must stay bounded). */
static bool equal_at(const struct jv *a, const struct jv *b, int depth)
{
	if (depth > JINJA_MAX_DEPTH)
		return false;
	if (is_num(a) && is_num(b)) {
		if (a->t != JV_FLOAT && b->t != JV_FLOAT)
			return int_of(a) == int_of(b);
		return num_of(a) == num_of(b);
	}
	if (a->t != b->t)
		return false;
	switch (a->t) {
	case JV_UNDEF:
	case JV_NONE:
		return true;
	case JV_STR:
		return a->s.n == b->s.n && !memcmp(a->s.p, b->s.p, a->s.n);
	case JV_LIST:
		if (a->l->n != b->l->n)
			return false;
		for (size_t i = 0; i < a->l->n; i++)
			if (!equal_at(&a->l->v[i], &b->l->v[i], depth + 1))
				return false;
		return true;
	case JV_DICT:
		if (a->d->n != b->d->n)
			return false;
		for (size_t i = 0; i < a->d->n; i++) {
			const struct jv *o = jdict_get(b->d, a->d->k[i].s.p, a->d->k[i].s.n);
			if (!o || !equal_at(&a->d->v[i], o, depth + 1))
				return false;
		}
		return true;
	case JV_NS:
		return a->d == b->d;
	case JV_FUNC:
	case JV_METHOD:
		return a->call.fn == b->call.fn && a->call.self == b->call.self;
	case JV_MACRO:
		return a->macro.node == b->macro.node;
	default:
		return false;
	}
}

static int compare_at(const struct jv *a, const struct jv *b, int *cmp, int depth);

int jv_compare(const struct jv *a, const struct jv *b, int *cmp)
{
	return compare_at(a, b, cmp, 0);
}

static int compare_at(const struct jv *a, const struct jv *b, int *cmp, int depth)
{
	if (depth > JINJA_MAX_DEPTH)
		return -EINVAL;
	if (is_num(a) && is_num(b)) {
		if (a->t != JV_FLOAT && b->t != JV_FLOAT)
			*cmp = int_of(a) < int_of(b) ? -1 : int_of(a) > int_of(b);
		else
			*cmp = num_of(a) < num_of(b) ? -1 : num_of(a) > num_of(b);
		return 0;
	}
	if (a->t == JV_STR && b->t == JV_STR) { /* UTF-8's byte order is the code points' order */
		size_t n = a->s.n < b->s.n ? a->s.n : b->s.n;
		int c = memcmp(a->s.p, b->s.p, n);
		*cmp = c < 0 ? -1 : c > 0 ? 1 : a->s.n < b->s.n ? -1 : a->s.n > b->s.n;
		return 0;
	}
	if (a->t == JV_LIST && b->t == JV_LIST) {
		for (size_t i = 0; i < a->l->n && i < b->l->n; i++) {
			if (equal_at(&a->l->v[i], &b->l->v[i], depth + 1))
				continue;
			return compare_at(&a->l->v[i], &b->l->v[i], cmp, depth + 1);
		}
		*cmp = a->l->n < b->l->n ? -1 : a->l->n > b->l->n;
		return 0;
	}
	return -EINVAL;
}

const char *jv_type_name(const struct jv *v)
{
	static const char *names[] = {"undefined", "NoneType", "bool",	   "int",    "float",  "str",
				      "list",	   "dict",     "Namespace", "function", "method", "macro"};
	return names[v->t];
}

/* ---- strings being built --------------------------------------------------------------------- */

void sbuf_init(struct sbuf *b, struct arena *a, size_t limit)
{
	memset(b, 0, sizeof(*b));
	b->a = a;
	b->limit = limit;
}

static bool sbuf_room(struct sbuf *b, size_t n)
{
	if (b->err)
		return false;
	if (n > b->limit - b->n) {
		b->err = -E2BIG;
		return false;
	}
	if (b->n + n <= b->cap)
		return true;
	size_t cap = b->cap ? b->cap * 2 : 64;
	while (cap < b->n + n)
		cap *= 2;
	if (!b->a) { /* on the heap (a render's output): grown in place, freed by its owner */
		char *p = realloc(b->p, cap + 1);
		if (p)
			b->p = p;
		uint8_t *m = p ? realloc(b->m, cap) : NULL;
		if (!m) {
			b->err = -ENOMEM;
			return false;
		}
		b->m = m;
		b->cap = cap;
		return true;
	}
	char *p = arena_alloc(b->a, cap + 1);
	uint8_t *m = arena_alloc(b->a, cap);
	if (!p || !m) {
		b->err = -ENOMEM;
		return false;
	}
	if (b->n) {
		memcpy(p, b->p, b->n);
		memcpy(m, b->m, b->n);
	}
	b->p = p;
	b->m = m;
	b->cap = cap;
	return true;
}

void sbuf_add(struct sbuf *b, const char *s, size_t n, const uint8_t *m)
{
	if (!n || !sbuf_room(b, n))
		return;
	memcpy(b->p + b->n, s, n);
	if (m) {
		memcpy(b->m + b->n, m, n);
		b->any_data = b->any_data || memchr(m, 1, n);
	} else {
		memset(b->m + b->n, 0, n);
	}
	b->n += n;
}

void sbuf_adds(struct sbuf *b, const char *s)
{
	sbuf_add(b, s, strlen(s), NULL);
}

void sbuf_add_str(struct sbuf *b, const struct jstr *s)
{
	sbuf_add(b, s->p, s->n, s->m);
}

struct jv sbuf_value(struct sbuf *b)
{
	if (!b->n)
		return jv_str("", 0, NULL);
	b->p[b->n] = 0;
	return jv_str(b->p, b->n, b->any_data ? b->m : NULL);
}

/* ---- printing --------------------------------------------------------------------------------- */

void float_repr(double f, char *buf, size_t len)
{
	if (isnan(f)) {
		snprintf(buf, len, "nan");
		return;
	}
	if (isinf(f)) {
		snprintf(buf, len, f < 0 ? "-inf" : "inf");
		return;
	}
	/* The shortest digits that read back as f, placed as Python's repr places them: positional
	 * for exponents in [-4, 16), else scientific with at least two exponent digits. */
	char digits[40];
	int prec;
	for (prec = 1; prec <= 17; prec++) {
		snprintf(digits, sizeof(digits), "%.*e", prec - 1, f);
		if (strtod(digits, NULL) == f)
			break;
	}
	char *e = strchr(digits, 'e');
	int exp10 = atoi(e + 1);
	*e = 0;
	char mant[24];
	size_t k = 0;
	bool neg = digits[0] == '-';
	for (const char *p = digits + neg; *p; p++)
		if (*p != '.')
			mant[k++] = *p;
	mant[k] = 0;
	while (k > 1 && mant[k - 1] == '0')
		mant[--k] = 0;
	if (exp10 < -4 || exp10 >= 16) {
		snprintf(buf, len, "%s%c%s%s%se%c%02d", neg ? "-" : "", mant[0], k > 1 ? "." : "", mant + 1, "",
			 exp10 < 0 ? '-' : '+', abs(exp10));
		return;
	}
	char out[64];
	size_t o = 0;
	if (neg)
		out[o++] = '-';
	if (exp10 < 0) {
		out[o++] = '0';
		out[o++] = '.';
		for (int i = 0; i < -exp10 - 1; i++)
			out[o++] = '0';
		for (size_t i = 0; i < k; i++)
			out[o++] = mant[i];
	} else {
		for (int i = 0; i <= exp10; i++)
			out[o++] = (size_t)i < k ? mant[i] : '0';
		out[o++] = '.';
		if ((size_t)exp10 + 1 < k)
			for (size_t i = (size_t)exp10 + 1; i < k; i++)
				out[o++] = mant[i];
		else
			out[o++] = '0';
	}
	out[o] = 0;
	snprintf(buf, len, "%s", out);
}

/* Python's repr of a string: single quotes unless it holds one and no double quote; \\, the
 * quote, \n \r \t and other control characters escaped; other characters as they are. */
static void str_repr(struct sbuf *b, const struct jstr *s)
{
	bool dq = memchr(s->p, '\'', s->n) && !memchr(s->p, '"', s->n);
	char q = dq ? '"' : '\'';
	sbuf_add(b, &q, 1, NULL);
	size_t run = 0;
	for (size_t i = 0; i < s->n; i++) {
		unsigned char c = (unsigned char)s->p[i];
		const char *esc = NULL;
		char hex[8];
		if (c == '\\')
			esc = "\\\\";
		else if (c == (unsigned char)q)
			esc = dq ? "\\\"" : "\\'";
		else if (c == '\n')
			esc = "\\n";
		else if (c == '\r')
			esc = "\\r";
		else if (c == '\t')
			esc = "\\t";
		else if (c < 0x20 || c == 0x7f) {
			snprintf(hex, sizeof(hex), "\\x%02x", c);
			esc = hex;
		}
		if (!esc)
			continue;
		sbuf_add(b, s->p + run, i - run, s->m ? s->m + run : NULL);
		sbuf_adds(b, esc);
		run = i + 1;
	}
	sbuf_add(b, s->p + run, s->n - run, s->m ? s->m + run : NULL);
	sbuf_add(b, &q, 1, NULL);
}

static void print_at(struct sbuf *b, const struct jv *v, bool repr, int depth);

void jv_print(struct sbuf *b, const struct jv *v, bool repr)
{
	print_at(b, v, repr, 0);
}

static void print_at(struct sbuf *b, const struct jv *v, bool repr, int depth)
{
	char num[64];
	if (depth > JINJA_MAX_DEPTH) { /* a value nested deeper: the output's error */
		if (!b->err)
			b->err = -E2BIG;
		return;
	}
	switch (v->t) {
	case JV_UNDEF:
		if (repr) /* inside a list or a dict, as Python prints jinja2's Undefined */
			sbuf_adds(b, "Undefined");
		return;
	case JV_NONE:
		sbuf_adds(b, "None");
		return;
	case JV_BOOL:
		sbuf_adds(b, v->b ? "True" : "False");
		return;
	case JV_INT:
		snprintf(num, sizeof(num), "%lld", (long long)v->i);
		sbuf_adds(b, num);
		return;
	case JV_FLOAT:
		float_repr(v->f, num, sizeof(num));
		sbuf_adds(b, num);
		return;
	case JV_STR:
		if (repr)
			str_repr(b, &v->s);
		else
			sbuf_add_str(b, &v->s);
		return;
	case JV_LIST:
		sbuf_adds(b, v->l->tuple ? "(" : "[");
		for (size_t i = 0; i < v->l->n && !b->err; i++) {
			if (i)
				sbuf_adds(b, ", ");
			print_at(b, &v->l->v[i], true, depth + 1);
		}
		sbuf_adds(b, !v->l->tuple ? "]" : v->l->n == 1 ? ",)" : ")");
		return;
	case JV_DICT:
		sbuf_adds(b, "{");
		for (size_t i = 0; i < v->d->n && !b->err; i++) {
			if (i)
				sbuf_adds(b, ", ");
			print_at(b, &v->d->k[i], true, depth + 1);
			sbuf_adds(b, ": ");
			print_at(b, &v->d->v[i], true, depth + 1);
		}
		sbuf_adds(b, "}");
		return;
	case JV_NS:
		sbuf_adds(b, "<Namespace>");
		return;
	case JV_FUNC:
	case JV_METHOD:
		sbuf_adds(b, "<function>");
		return;
	case JV_MACRO:
		sbuf_adds(b, "<Macro>");
		return;
	}
}

/* ---- JSON ------------------------------------------------------------------------------------- */

static void json_str(struct sbuf *b, const struct jstr *s)
{
	sbuf_adds(b, "\"");
	size_t run = 0;
	for (size_t i = 0; i < s->n; i++) {
		unsigned char c = (unsigned char)s->p[i];
		char esc[8];
		if (c == '"' || c == '\\')
			snprintf(esc, sizeof(esc), "\\%c", c);
		else if (c == '\n')
			snprintf(esc, sizeof(esc), "\\n");
		else if (c == '\r')
			snprintf(esc, sizeof(esc), "\\r");
		else if (c == '\t')
			snprintf(esc, sizeof(esc), "\\t");
		else if (c == '\b')
			snprintf(esc, sizeof(esc), "\\b");
		else if (c == '\f')
			snprintf(esc, sizeof(esc), "\\f");
		else if (c < 0x20)
			snprintf(esc, sizeof(esc), "\\u%04x", c);
		else
			continue;
		static const uint8_t data[8] = {1, 1, 1, 1, 1, 1, 1, 1}; /* an escape of a data byte is data */
		sbuf_add(b, s->p + run, i - run, s->m ? s->m + run : NULL);
		sbuf_add(b, esc, strlen(esc), s->m && s->m[i] ? data : NULL);
		run = i + 1;
	}
	sbuf_add(b, s->p + run, s->n - run, s->m ? s->m + run : NULL);
	sbuf_adds(b, "\"");
}

static void json_newline(struct sbuf *b, int indent, int level)
{
	sbuf_adds(b, "\n");
	for (int i = 0; i < indent * level && !b->err; i++)
		sbuf_adds(b, " ");
}

static int key_cmp(const void *x, const void *y)
{
	const struct jv *a = *(const struct jv *const *)x, *b = *(const struct jv *const *)y;
	int c = 0;
	jv_compare(a, b, &c);
	return c;
}

int jv_json(struct sbuf *b, const struct jv *v, int indent, const char *item_sep, const char *key_sep,
	    bool sort_keys, int depth, char *err, size_t errlen)
{
	if (depth > JINJA_MAX_DEPTH)
		return errorf(err, errlen, -E2BIG, "tojson: the value is nested deeper than %d", JINJA_MAX_DEPTH);
	const char *isep = item_sep ? item_sep : indent >= 0 ? "," : ", ";
	const char *ksep = key_sep ? key_sep : ": ";
	char num[64];
	switch (v->t) {
	case JV_NONE:
		sbuf_adds(b, "null");
		return 0;
	case JV_BOOL:
		sbuf_adds(b, v->b ? "true" : "false");
		return 0;
	case JV_INT:
		snprintf(num, sizeof(num), "%lld", (long long)v->i);
		sbuf_adds(b, num);
		return 0;
	case JV_FLOAT:
		float_repr(v->f, num, sizeof(num));
		sbuf_adds(b, !strcmp(num, "nan") ? "NaN" : !strcmp(num, "inf") ? "Infinity" : !strcmp(num, "-inf") ? "-Infinity" : num);
		return 0;
	case JV_STR:
		json_str(b, &v->s);
		return 0;
	case JV_LIST:
		if (!v->l->n) {
			sbuf_adds(b, "[]");
			return 0;
		}
		sbuf_adds(b, "[");
		for (size_t i = 0; i < v->l->n; i++) {
			if (i)
				sbuf_adds(b, isep);
			if (indent >= 0)
				json_newline(b, indent, depth + 1);
			int rc = jv_json(b, &v->l->v[i], indent, item_sep, key_sep, sort_keys, depth + 1, err, errlen);
			if (rc)
				return rc;
		}
		if (indent >= 0)
			json_newline(b, indent, depth);
		sbuf_adds(b, "]");
		return 0;
	case JV_DICT:
	case JV_NS: {
		if (!v->d->n) {
			sbuf_adds(b, "{}");
			return 0;
		}
		const struct jv **keys = arena_alloc(b->a, v->d->n * sizeof(*keys));
		if (!keys)
			return errorf(err, errlen, -ENOMEM, "out of memory");
		for (size_t i = 0; i < v->d->n; i++)
			keys[i] = &v->d->k[i];
		if (sort_keys)
			qsort(keys, v->d->n, sizeof(*keys), key_cmp);
		sbuf_adds(b, "{");
		for (size_t i = 0; i < v->d->n; i++) {
			if (i)
				sbuf_adds(b, isep);
			if (indent >= 0)
				json_newline(b, indent, depth + 1);
			json_str(b, &keys[i]->s);
			sbuf_adds(b, ksep);
			const struct jv *val = &v->d->v[keys[i] - v->d->k];
			int rc = jv_json(b, val, indent, item_sep, key_sep, sort_keys, depth + 1, err, errlen);
			if (rc)
				return rc;
		}
		if (indent >= 0)
			json_newline(b, indent, depth);
		sbuf_adds(b, "}");
		return 0;
	}
	default:
		return errorf(err, errlen, -EINVAL, "tojson: a value of type %s is not JSON serializable",
			      jv_type_name(v));
	}
}

struct jv jv_from_json(struct arena *a, const json_t *j, bool data, int depth)
{
	if (!j || depth > JINJA_MAX_DEPTH)
		return jv_none();
	switch (json_typeof(j)) {
	case JSON_STRING:
		return jv_str_copy(a, json_string_value(j), json_string_length(j), data);
	case JSON_INTEGER:
		return jv_int(json_integer_value(j));
	case JSON_REAL:
		return jv_float(json_real_value(j));
	case JSON_TRUE:
		return jv_bool(true);
	case JSON_FALSE:
		return jv_bool(false);
	case JSON_ARRAY: {
		struct jlist *l = jlist_new(a, json_array_size(j));
		if (!l)
			return jv_none();
		for (size_t i = 0; i < l->n; i++)
			l->v[i] = jv_from_json(a, json_array_get(j, i), data, depth + 1);
		return (struct jv){.t = JV_LIST, .l = l};
	}
	case JSON_OBJECT: {
		struct jdict *d = jdict_new(a, json_object_size(j));
		if (!d)
			return jv_none();
		const char *k;
		json_t *val;
		/* jansson keeps insertion order (JSON_PRESERVE_ORDER is the default since 2.8) */
		json_object_foreach((json_t *)j, k, val)
		{
			/* a JSON object's keys are unique: appended, not looked up (a lookup a key made a
			 * large object quadratic); a data object's keys are data too */
			if (d->n == d->cap)
				return jv_none();
			d->k[d->n] = jv_str_copy(a, k, strlen(k), data);
			d->v[d->n++] = jv_from_json(a, val, data, depth + 1);
		}
		return (struct jv){.t = JV_DICT, .d = d};
	}
	default:
		return jv_none();
	}
}

/* render.c - a parsed template run against its variables: statements write into the output,
 * expressions make values in the render's arena. Names live in frames (a loop iteration and a
 * macro call get their own; `if` does not), as in Jinja: a `set` inside a loop does not reach
 * past it, which is what namespace() is for. */
#include "common/jinja/jinja_internal.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

struct frame {
	struct frame *parent;
	struct jdict *vars;
};

enum flow { FLOW_NONE, FLOW_BREAK, FLOW_CONTINUE };

struct render {
	struct arena *a;
	time_t now;
	struct frame *root, *cur;
	struct sbuf *out;
	size_t steps;
	int calls; /* macro calls in progress */
	int depth; /* eval and exec frames on the C stack */
	int loops; /* loops in progress (in the current macro) */
	enum flow flow;
	int rc;
	char *err;
	size_t errlen;
};

struct arena *render_arena(struct render *r)
{
	return r->a;
}

time_t render_now(struct render *r)
{
	return r->now;
}

int render_fail(struct render *r, int rc, int line, const char *fmt, ...)
{
	if (r->rc)
		return r->rc;
	char msg[600];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (rc == -EBADMSG)
		r->rc = errorf(r->err, r->errlen, rc, "%s", msg);
	else
		r->rc = errorf(r->err, r->errlen, rc, "chat template, line %d: %s", line, msg);
	return r->rc;
}

int render_step(struct render *r, size_t n, int line)
{
	r->steps += n;
	if (r->steps > JINJA_MAX_STEPS)
		return render_fail(r, -E2BIG, line, "the template took more than %u steps", JINJA_MAX_STEPS);
	if (arena_exhausted(r->a))
		return render_fail(r, -E2BIG, line, "the template used more than %u MiB", JINJA_MAX_MEMORY >> 20);
	return 0;
}

int render_oom(struct render *r, int line)
{
	if (arena_exhausted(r->a))
		return render_fail(r, -E2BIG, line, "the template's values took more than %u MiB", JINJA_MAX_MEMORY >> 20);
	return render_fail(r, -ENOMEM, line, "out of memory");
}

static int oom(struct render *r, int line)
{
	return render_oom(r, line);
}

static struct frame *frame_new(struct render *r, struct frame *parent)
{
	struct frame *f = arena_alloc(r->a, sizeof(*f));
	if (!f || !(f->vars = jdict_new(r->a, 4)))
		return NULL;
	f->parent = parent;
	return f;
}

static int set_var(struct render *r, struct frame *f, const char *name, struct jv v, int line)
{
	if (jdict_set(r->a, f->vars, jv_cstr(name), v))
		return oom(r, line);
	return 0;
}

static struct jv lookup(struct render *r, const char *name)
{
	size_t n = strlen(name);
	for (struct frame *f = r->cur; f; f = f->parent) {
		struct jv *v = jdict_get(f->vars, name, n);
		if (v)
			return *v;
	}
	int fn = builtin_function(name);
	if (fn >= 0)
		return (struct jv){.t = JV_FUNC, .call = {.fn = fn}};
	return jv_undef(name);
}

static int undefined(struct render *r, const struct jv *v, int line)
{
	return render_fail(r, -EINVAL, line, "'%s' is undefined", v->undef_name ? v->undef_name : "a value");
}

/* ---- strings by code point ------------------------------------------------------------------ */

/* The byte offset of code point k of s (s->n when k is past the end). */
static size_t cp_offset(const struct jstr *s, size_t k)
{
	size_t i = 0;
	while (k && i < s->n) {
		i++;
		while (i < s->n && ((unsigned char)s->p[i] & 0xc0) == 0x80)
			i++;
		k--;
	}
	return i;
}

static size_t cp_count(const struct jstr *s)
{
	size_t n = 0;
	for (size_t i = 0; i < s->n; i++)
		n += ((unsigned char)s->p[i] & 0xc0) != 0x80;
	return n;
}

static struct jv substr(const struct jstr *s, size_t b, size_t e)
{
	return jv_str(s->p + b, e - b, s->m ? s->m + b : NULL);
}

/* ---- expressions ---------------------------------------------------------------------------- */

static int eval(struct render *r, const struct node *n, struct jv *out);

/* Python's index into a sequence of len items: negative from the end; -1 when outside. */
static int64_t seq_index(int64_t i, size_t len)
{
	if (i < 0)
		i += (int64_t)len;
	return i < 0 || i >= (int64_t)len ? -1 : i;
}

/* obj[key], or obj.key when attr: a dict's key (or, for attr, a method first), a list's item, a
 * string's character; a missing one is undefined. */
static int get_item(struct render *r, const struct jv *obj, const struct jv *key, bool attr, int line,
		    struct jv *out)
{
	static char what[] = "an attribute or item";
	if (obj->t == JV_UNDEF)
		return undefined(r, obj, line);
	if (key->t == JV_STR) {
		if (attr || obj->t == JV_STR || obj->t == JV_LIST) {
			char name[64];
			snprintf(name, sizeof(name), "%.*s", (int)(key->s.n < 63 ? key->s.n : 63), key->s.p);
			int m = key->s.n < 63 ? builtin_method(obj, name) : -1;
			if (m >= 0) {
				struct jv *self = arena_alloc(r->a, sizeof(*self));
				if (!self)
					return oom(r, line);
				*self = *obj;
				*out = (struct jv){.t = JV_METHOD, .call = {.fn = m, .self = self}};
				return 0;
			}
		}
		if (obj->t == JV_DICT || obj->t == JV_NS) {
			if (render_step(r, obj->d->n / 64, line))
				return r->rc;
			struct jv *v = jdict_get(obj->d, key->s.p, key->s.n);
			if (v) {
				*out = *v;
				return 0;
			}
		}
		char *name = arena_alloc(r->a, key->s.n + 1);
		if (!name)
			return oom(r, line);
		memcpy(name, key->s.p, key->s.n);
		name[key->s.n] = 0;
		*out = jv_undef(name);
		return 0;
	}
	if ((key->t == JV_INT || key->t == JV_BOOL) && (obj->t == JV_LIST || obj->t == JV_STR)) {
		int64_t i = key->t == JV_INT ? key->i : key->b;
		if (obj->t == JV_LIST) {
			int64_t k = seq_index(i, obj->l->n);
			*out = k < 0 ? jv_undef(what) : obj->l->v[k];
		} else {
			if (render_step(r, obj->s.n / 32, line)) /* walked by code point */
				return r->rc;
			int64_t k = seq_index(i, cp_count(&obj->s));
			if (k < 0) {
				*out = jv_undef(what);
			} else {
				size_t b = cp_offset(&obj->s, (size_t)k), e = cp_offset(&obj->s, (size_t)k + 1);
				*out = substr(&obj->s, b, e);
			}
		}
		return 0;
	}
	*out = jv_undef(what);
	return 0;
}

/* a[start:stop:step] on a list or a string, Python's rules; anything else gives undefined, as
 * jinja2's getitem does. */
static int slice(struct render *r, const struct jv *obj, const struct jv *parts, int line, struct jv *out)
{
	if (obj->t == JV_UNDEF)
		return undefined(r, obj, line);
	if (obj->t != JV_LIST && obj->t != JV_STR) {
		*out = jv_undef("a slice");
		return 0;
	}
	int64_t v[3];
	bool given[3];
	for (int k = 0; k < 3; k++) {
		given[k] = parts[k].t != JV_NONE && parts[k].t != JV_UNDEF;
		if (given[k] && parts[k].t != JV_INT && parts[k].t != JV_BOOL)
			return render_fail(r, -EINVAL, line, "slice indices must be integers");
		v[k] = !given[k] ? 0 : parts[k].t == JV_INT ? parts[k].i : parts[k].b;
	}
	int64_t step = given[2] ? v[2] : 1;
	if (step == 0)
		return render_fail(r, -EINVAL, line, "slice step cannot be zero");
	if (obj->t == JV_STR && render_step(r, obj->s.n / 32, line)) /* walked by code point */
		return r->rc;
	int64_t len = obj->t == JV_LIST ? (int64_t)obj->l->n : (int64_t)cp_count(&obj->s);
	/* indices clamped as Python clamps them: into [0, len] going up, [-1, len - 1] going down */
	int64_t lo = step > 0 ? 0 : -1, hi = step > 0 ? len : len - 1;
	int64_t start = !given[0] ? (step > 0 ? 0 : len - 1) : v[0] < 0 ? v[0] + len : v[0];
	int64_t stop = !given[1] ? (step > 0 ? len : -1) : v[1] < 0 ? v[1] + len : v[1];
	if (given[0] && v[0] < -len)
		start = lo;
	if (given[1] && v[1] < -len)
		stop = lo;
	start = start < lo ? lo : start > hi ? hi : start;
	stop = stop < lo ? lo : stop > hi ? hi : stop;
	/* the count without stepping (a step near 2^63 must not overflow an index) */
	uint64_t mag = step > 0 ? (uint64_t)step : (uint64_t)0 - (uint64_t)step;
	uint64_t span = step > 0 ? (stop > start ? (uint64_t)(stop - start) : 0) : (start > stop ? (uint64_t)(start - stop) : 0);
	size_t count = span ? (size_t)((span - 1) / mag + 1) : 0;
	if (render_step(r, count, line))
		return r->rc;
	if (obj->t == JV_LIST) {
		struct jlist *l = jlist_new(r->a, count);
		if (!l)
			return oom(r, line);
		for (size_t k = 0; k < count; k++)
			l->v[k] = obj->l->v[start + (step > 0 ? (int64_t)(k * mag) : -(int64_t)(k * mag))];
		*out = (struct jv){.t = JV_LIST, .l = l};
		return 0;
	}
	if (step == 1) {
		size_t b = cp_offset(&obj->s, (size_t)start), e = cp_offset(&obj->s, (size_t)(stop > start ? stop : start));
		*out = substr(&obj->s, b, e);
		return 0;
	}
	/* each code point's offset once (len + 1 of them), then the picked ones */
	size_t *at = arena_alloc(r->a, ((size_t)len + 1) * sizeof(*at));
	if (!at)
		return oom(r, line);
	for (size_t i = 0, k = 0; k <= (size_t)len; k++) {
		at[k] = i;
		if (i < obj->s.n)
			i++;
		while (i < obj->s.n && ((unsigned char)obj->s.p[i] & 0xc0) == 0x80)
			i++;
	}
	struct sbuf b;
	sbuf_init(&b, r->a, JINJA_MAX_OUTPUT);
	for (size_t k = 0; k < count; k++) {
		size_t c = (size_t)(start + (step > 0 ? (int64_t)(k * mag) : -(int64_t)(k * mag)));
		sbuf_add(&b, obj->s.p + at[c], at[c + 1] - at[c], obj->s.m ? obj->s.m + at[c] : NULL);
	}
	if (b.err)
		return oom(r, line);
	*out = sbuf_value(&b);
	return 0;
}

static bool is_number(const struct jv *v)
{
	return v->t == JV_INT || v->t == JV_FLOAT || v->t == JV_BOOL;
}
static double as_double(const struct jv *v)
{
	return v->t == JV_FLOAT ? v->f : v->t == JV_INT ? (double)v->i : (double)v->b;
}
static int64_t as_int(const struct jv *v)
{
	return v->t == JV_INT ? v->i : v->t == JV_BOOL ? (int64_t)v->b : 0;
}

static const char *op_name(enum bin_op op)
{
	static const char *names[] = {"+", "-", "*", "/", "//", "%", "**", "~", "==", "!=", "<", "<=", ">", ">=", "in", "not in"};
	return names[op];
}

static int contains(struct render *r, const struct jv *hay, const struct jv *needle, int line, bool *out)
{
	switch (hay->t) {
	case JV_UNDEF:
		*out = false;
		return 0;
	case JV_STR:
		if (needle->t != JV_STR)
			return render_fail(r, -EINVAL, line, "'in <string>' requires a string on its left, not %s",
					   jv_type_name(needle));
		*out = needle->s.n == 0 || memmem(hay->s.p, hay->s.n, needle->s.p, needle->s.n) != NULL;
		return render_step(r, hay->s.n / 256, line);
	case JV_LIST:
		*out = false;
		for (size_t i = 0; i < hay->l->n && !*out; i++)
			*out = jv_equal(&hay->l->v[i], needle);
		return render_step(r, hay->l->n, line);
	case JV_DICT:
	case JV_NS:
		*out = needle->t == JV_STR && jdict_get(hay->d, needle->s.p, needle->s.n) != NULL;
		return 0;
	default:
		return render_fail(r, -EINVAL, line, "a %s cannot hold anything ('in')", jv_type_name(hay));
	}
}

static int arith(struct render *r, enum bin_op op, const struct jv *a, const struct jv *b, int line, struct jv *out)
{
	if (a->t == JV_UNDEF || b->t == JV_UNDEF)
		return undefined(r, a->t == JV_UNDEF ? a : b, line);
	if (op == OP_ADD && a->t == JV_STR && b->t == JV_STR) {
		struct sbuf s;
		sbuf_init(&s, r->a, JINJA_MAX_OUTPUT);
		sbuf_add_str(&s, &a->s);
		sbuf_add_str(&s, &b->s);
		if (s.err)
			return s.err == -E2BIG ? render_fail(r, -E2BIG, line, "a string longer than %u bytes", JINJA_MAX_OUTPUT)
					       : oom(r, line);
		*out = sbuf_value(&s);
		return render_step(r, s.n / 64, line);
	}
	if (op == OP_ADD && a->t == JV_LIST && b->t == JV_LIST) {
		struct jlist *l = jlist_new(r->a, a->l->n + b->l->n);
		if (!l)
			return oom(r, line);
		memcpy(l->v, a->l->v, a->l->n * sizeof(*l->v));
		memcpy(l->v + a->l->n, b->l->v, b->l->n * sizeof(*l->v));
		*out = (struct jv){.t = JV_LIST, .l = l};
		return render_step(r, l->n, line);
	}
	if (op == OP_MUL && ((a->t == JV_STR && (b->t == JV_INT || b->t == JV_BOOL)) ||
			     (b->t == JV_STR && (a->t == JV_INT || a->t == JV_BOOL)))) {
		const struct jv *s = a->t == JV_STR ? a : b, *k = a->t == JV_STR ? b : a;
		int64_t times = as_int(k);
		if (times <= 0 || !s->s.n) {
			*out = jv_str("", 0, NULL);
			return 0;
		}
		struct sbuf o;
		sbuf_init(&o, r->a, JINJA_MAX_OUTPUT);
		if (times > 0 && s->s.n && (uint64_t)times > JINJA_MAX_OUTPUT / s->s.n)
			return render_fail(r, -E2BIG, line, "a string longer than %u bytes", JINJA_MAX_OUTPUT);
		for (int64_t i = 0; i < times && !o.err; i++)
			sbuf_add_str(&o, &s->s);
		if (o.err)
			return oom(r, line);
		*out = sbuf_value(&o);
		return render_step(r, o.n / 64, line);
	}
	if (!is_number(a) || !is_number(b))
		return render_fail(r, -EINVAL, line, "unsupported operand types for %s: %s and %s", op_name(op),
				   jv_type_name(a), jv_type_name(b));
	bool ints = a->t != JV_FLOAT && b->t != JV_FLOAT;
	int64_t x = as_int(a), y = as_int(b), z;
	double fx = as_double(a), fy = as_double(b);
	switch (op) {
	case OP_ADD:
	case OP_SUB:
	case OP_MUL:
		if (ints) {
			bool ovf = op == OP_ADD ? __builtin_add_overflow(x, y, &z)
				   : op == OP_SUB ? __builtin_sub_overflow(x, y, &z)
						  : __builtin_mul_overflow(x, y, &z);
			if (ovf)
				return render_fail(r, -EINVAL, line, "an integer past 64 bits");
			*out = jv_int(z);
		} else {
			*out = jv_float(op == OP_ADD ? fx + fy : op == OP_SUB ? fx - fy : fx * fy);
		}
		return 0;
	case OP_DIV:
		if (fy == 0)
			return render_fail(r, -EINVAL, line, "division by zero");
		*out = jv_float(fx / fy);
		return 0;
	case OP_FLOORDIV:
	case OP_MOD:
		if (ints ? y == 0 : fy == 0)
			return render_fail(r, -EINVAL, line, "%s by zero", op == OP_MOD ? "modulo" : "division");
		if (ints) {
			if (x == INT64_MIN && y == -1)
				return render_fail(r, -EINVAL, line, "an integer past 64 bits");
			int64_t q = x / y, m = x % y;
			if (m && ((m < 0) != (y < 0))) {
				q--;
				m += y;
			}
			*out = jv_int(op == OP_MOD ? m : q);
		} else {
			double m = fmod(fx, fy);
			if (m && ((m < 0) != (fy < 0)))
				m += fy;
			*out = jv_float(op == OP_MOD ? m : floor(fx / fy));
		}
		return 0;
	case OP_POW:
		if (ints && y >= 0) {
			int64_t acc = 1;
			if (x == 0 || x == 1)
				acc = y == 0 ? 1 : x;
			else if (x == -1)
				acc = y % 2 ? -1 : 1;
			else
				for (int64_t i = 0; i < y; i++)
					if (i >= 64 || __builtin_mul_overflow(acc, x, &acc))
						return render_fail(r, -EINVAL, line, "an integer past 64 bits");
			*out = jv_int(acc);
		} else {
			*out = jv_float(pow(fx, fy));
		}
		return 0;
	default:
		return render_fail(r, -EINVAL, line, "internal: not an arithmetic operator");
	}
}

static int binary(struct render *r, const struct node *n, struct jv *out)
{
	struct jv a, b;
	if (eval(r, n->a, &a) || eval(r, n->b, &b))
		return r->rc;
	int cmp;
	bool in = false;
	switch (n->op) {
	case OP_EQ:
	case OP_NE:
		if (render_step(r, a.t == JV_STR && b.t == JV_STR ? (a.s.n < b.s.n ? a.s.n : b.s.n) / 256
				   : a.t == JV_LIST && b.t == JV_LIST ? (a.l->n < b.l->n ? a.l->n : b.l->n)
								      : 0,
				n->line))
			return r->rc;
		*out = jv_bool(jv_equal(&a, &b) == (n->op == OP_EQ));
		return 0;
	case OP_LT:
	case OP_LE:
	case OP_GT:
	case OP_GE:
		if (a.t == JV_UNDEF || b.t == JV_UNDEF)
			return undefined(r, a.t == JV_UNDEF ? &a : &b, n->line);
		if (jv_compare(&a, &b, &cmp))
			return render_fail(r, -EINVAL, n->line, "'%s' is not supported between %s and %s", op_name(n->op),
					   jv_type_name(&a), jv_type_name(&b));
		*out = jv_bool(n->op == OP_LT ? cmp < 0 : n->op == OP_LE ? cmp <= 0 : n->op == OP_GT ? cmp > 0 : cmp >= 0);
		return 0;
	case OP_IN:
	case OP_NOTIN:
		if (contains(r, &b, &a, n->line, &in))
			return r->rc;
		*out = jv_bool(in == (n->op == OP_IN));
		return 0;
	case OP_CONCAT: {
		struct sbuf s;
		sbuf_init(&s, r->a, JINJA_MAX_OUTPUT);
		jv_print(&s, &a, false);
		jv_print(&s, &b, false);
		if (s.err)
			return oom(r, n->line);
		*out = sbuf_value(&s);
		return render_step(r, s.n / 64, n->line);
	}
	default:
		return arith(r, n->op, &a, &b, n->line, out);
	}
}

static int eval_args(struct render *r, const struct node *n, struct call_args *ca)
{
	memset(ca, 0, sizeof(*ca));
	ca->n_pos = n->n_args;
	ca->n_kw = n->n_kw;
	ca->kwnames = n->kwnames;
	if ((n->n_args && !(ca->pos = arena_alloc(r->a, n->n_args * sizeof(struct jv)))) ||
	    (n->n_kw && !(ca->kw = arena_alloc(r->a, n->n_kw * sizeof(struct jv)))))
		return oom(r, n->line);
	for (size_t i = 0; i < n->n_args; i++)
		if (eval(r, n->args[i], &ca->pos[i]))
			return r->rc;
	for (size_t i = 0; i < n->n_kw; i++)
		if (eval(r, n->kwvals[i], &ca->kw[i]))
			return r->rc;
	return 0;
}

static int exec(struct render *r, struct node *const *body, size_t n);

/* A macro sees its parameters, then the names of where it was defined (a loop's variable too). */
static int call_macro(struct render *r, const struct node *m, struct frame *macro_frame, const struct call_args *ca,
		      int line, struct jv *out)
{
	if (r->calls >= JINJA_MAX_DEPTH)
		return render_fail(r, -E2BIG, line, "macro calls nested deeper than %d", JINJA_MAX_DEPTH);
	if (ca->n_pos > m->n_args)
		return render_fail(r, -EINVAL, line, "macro '%s' takes %zu arguments, %zu given", m->name, m->n_args,
				   ca->n_pos);
	struct frame *f = frame_new(r, macro_frame ? macro_frame : r->root), *saved = r->cur;
	if (!f)
		return oom(r, line);
	r->cur = f;
	for (size_t i = 0; i < m->n_args; i++) {
		const char *p = m->args[i]->name;
		struct jv v = jv_undef(p);
		bool given = false;
		if (i < ca->n_pos) {
			v = ca->pos[i];
			given = true;
		}
		for (size_t k = 0; k < ca->n_kw; k++)
			if (!strcmp(ca->kwnames[k], p)) {
				if (given) {
					r->cur = saved;
					return render_fail(r, -EINVAL, line, "macro '%s' got '%s' twice", m->name, p);
				}
				v = ca->kw[k];
				given = true;
			}
		if (!given && m->kwvals[i] && eval(r, m->kwvals[i], &v)) {
			r->cur = saved;
			return r->rc;
		}
		if (set_var(r, f, p, v, line)) {
			r->cur = saved;
			return r->rc;
		}
	}
	for (size_t k = 0; k < ca->n_kw; k++) {
		bool known = false;
		for (size_t i = 0; i < m->n_args; i++)
			known = known || !strcmp(ca->kwnames[k], m->args[i]->name);
		if (!known) {
			r->cur = saved;
			return render_fail(r, -EINVAL, line, "macro '%s' takes no argument '%s'", m->name, ca->kwnames[k]);
		}
	}
	struct sbuf body, *saved_out = r->out;
	sbuf_init(&body, r->a, JINJA_MAX_OUTPUT);
	int saved_loops = r->loops;
	r->out = &body;
	r->loops = 0;
	r->calls++;
	int rc = exec(r, m->body, m->n_body);
	r->calls--;
	r->loops = saved_loops;
	r->out = saved_out;
	r->cur = saved;
	if (rc)
		return rc;
	if (body.err)
		return oom(r, line);
	*out = sbuf_value(&body);
	return 0;
}

static int eval_node(struct render *r, const struct node *n, struct jv *out);

/* Every evaluation and every statement list counts its C stack frame: a template's chains and
 * nesting (a + b + ... is as deep as it is long), macro calls and filters that call filters all
 * pass through here, so the stack a render takes is bounded whatever the template. */
static int eval(struct render *r, const struct node *n, struct jv *out)
{
	if (r->depth >= JINJA_MAX_EVAL_DEPTH)
		return render_fail(r, -E2BIG, n->line, "expressions and calls nested deeper than %d", JINJA_MAX_EVAL_DEPTH);
	r->depth++;
	int rc = eval_node(r, n, out);
	r->depth--;
	return rc;
}

static int eval_node(struct render *r, const struct node *n, struct jv *out)
{
	if (render_step(r, 1, n->line))
		return r->rc;
	struct jv a, b;
	struct call_args ca;
	switch (n->kind) {
	case E_LIT:
		*out = n->lit;
		return 0;
	case E_NAME:
		*out = lookup(r, n->name);
		return 0;
	case E_ATTR: {
		if (eval(r, n->a, &a))
			return r->rc;
		struct jv key = jv_cstr(n->name);
		return get_item(r, &a, &key, true, n->line, out);
	}
	case E_ITEM:
		if (eval(r, n->a, &a) || eval(r, n->b, &b))
			return r->rc;
		return get_item(r, &a, &b, false, n->line, out);
	case E_SLICE: {
		struct jv parts[3] = {jv_none(), jv_none(), jv_none()};
		if (eval(r, n->a, &a))
			return r->rc;
		for (int k = 0; k < 3; k++)
			if (n->args[k] && eval(r, n->args[k], &parts[k]))
				return r->rc;
		return slice(r, &a, parts, n->line, out);
	}
	case E_CALL:
		if (eval(r, n->a, &a) || eval_args(r, n, &ca))
			return r->rc;
		if (a.t == JV_MACRO)
			return call_macro(r, a.macro.node, a.macro.frame, &ca, n->line, out);
		if (a.t == JV_FUNC || a.t == JV_METHOD)
			return builtin_call(r, &a, &ca, n->line, out);
		if (a.t == JV_UNDEF)
			return undefined(r, &a, n->line);
		return render_fail(r, -EINVAL, n->line, "a %s cannot be called", jv_type_name(&a));
	case E_FILTER:
		if (eval(r, n->a, &a) || eval_args(r, n, &ca))
			return r->rc;
		return builtin_call_filter(r, n->builtin, &a, &ca, n->line, out);
	case E_TEST: {
		bool t;
		if (eval(r, n->a, &a) || eval_args(r, n, &ca) || builtin_call_test(r, n->builtin, &a, &ca, n->line, &t))
			return r->rc;
		*out = jv_bool(t != n->neg);
		return 0;
	}
	case E_NEG:
	case E_POS:
		if (eval(r, n->a, &a))
			return r->rc;
		if (a.t == JV_UNDEF)
			return undefined(r, &a, n->line);
		if (!is_number(&a))
			return render_fail(r, -EINVAL, n->line, "bad operand type for unary %c: %s", n->kind == E_NEG ? '-' : '+',
					   jv_type_name(&a));
		if (n->kind == E_POS)
			*out = a.t == JV_BOOL ? jv_int(a.b) : a;
		else if (a.t == JV_FLOAT)
			*out = jv_float(-a.f);
		else if (as_int(&a) == INT64_MIN)
			return render_fail(r, -EINVAL, n->line, "an integer past 64 bits");
		else
			*out = jv_int(-as_int(&a));
		return 0;
	case E_NOT:
		if (eval(r, n->a, &a))
			return r->rc;
		*out = jv_bool(!jv_truthy(&a));
		return 0;
	case E_BIN:
		return binary(r, n, out);
	case E_AND:
	case E_OR:
		if (eval(r, n->a, &a))
			return r->rc;
		if (jv_truthy(&a) == (n->kind == E_OR)) {
			*out = a;
			return 0;
		}
		return eval(r, n->b, out);
	case E_COND:
		if (eval(r, n->a, &a))
			return r->rc;
		if (jv_truthy(&a))
			return eval(r, n->b, out);
		if (n->c)
			return eval(r, n->c, out);
		*out = jv_undef("the conditional expression's else");
		return 0;
	case E_LIST:
	case E_TUPLE: {
		struct jlist *l = jlist_new(r->a, n->n_args);
		if (!l)
			return oom(r, n->line);
		l->tuple = n->kind == E_TUPLE;
		for (size_t i = 0; i < n->n_args; i++)
			if (eval(r, n->args[i], &l->v[i]))
				return r->rc;
		*out = (struct jv){.t = JV_LIST, .l = l};
		return 0;
	}
	case E_DICT: {
		struct jdict *d = jdict_new(r->a, n->n_args);
		if (!d)
			return oom(r, n->line);
		for (size_t i = 0; i < n->n_args; i++) {
			if (eval(r, n->args[i], &a) || eval(r, n->kwvals[i], &b))
				return r->rc;
			if (a.t != JV_STR)
				return render_fail(r, -EINVAL, n->line, "a dict's keys must be strings here, not %s",
						   jv_type_name(&a));
			if (jdict_set(r->a, d, a, b))
				return oom(r, n->line);
		}
		*out = (struct jv){.t = JV_DICT, .d = d};
		return 0;
	}
	default:
		return render_fail(r, -EINVAL, n->line, "internal: a statement where an expression belongs");
	}
}

/* ---- statements -------------------------------------------------------------------------------- */

/* The items a for loop walks: a list's, a dict's keys, a string's characters. */
static int iterable(struct render *r, const struct jv *v, int line, struct jlist **out)
{
	switch (v->t) {
	case JV_UNDEF:
		*out = jlist_new(r->a, 0);
		break;
	case JV_LIST:
		*out = v->l;
		break;
	case JV_DICT:
	case JV_NS:
		if ((*out = jlist_new(r->a, v->d->n)))
			memcpy((*out)->v, v->d->k, v->d->n * sizeof(struct jv));
		break;
	case JV_STR: {
		if (render_step(r, v->s.n, line)) /* a value a character */
			return r->rc;
		size_t n = cp_count(&v->s);
		if ((*out = jlist_new(r->a, n)))
			for (size_t i = 0, b = 0; i < n; i++) {
				size_t e = b + 1;
				while (e < v->s.n && ((unsigned char)v->s.p[e] & 0xc0) == 0x80)
					e++;
				(*out)->v[i] = substr(&v->s, b, e);
				b = e;
			}
		break;
	}
	default:
		return render_fail(r, -EINVAL, line, "a %s cannot be iterated", jv_type_name(v));
	}
	return *out ? 0 : oom(r, line);
}

static int bind_targets(struct render *r, const struct node *n, struct frame *f, const struct jv *item)
{
	if (!n->name2)
		return set_var(r, f, n->name, *item, n->line);
	if (item->t != JV_LIST || item->l->n != 2)
		return render_fail(r, -EINVAL, n->line, "cannot unpack a %s into '%s, %s'", jv_type_name(item), n->name,
				   n->name2);
	if (set_var(r, f, n->name, item->l->v[0], n->line))
		return r->rc;
	return set_var(r, f, n->name2, item->l->v[1], n->line);
}

static int loop_for(struct render *r, const struct node *n)
{
	struct jv it;
	struct jlist *items;
	if (eval(r, n->a, &it) || iterable(r, &it, n->line, &items))
		return r->rc;
	struct frame *outer = r->cur;
	if (n->b) { /* the loop's filter: items it keeps, before loop.* is counted */
		struct jlist *kept = jlist_new(r->a, items->n);
		if (!kept)
			return oom(r, n->line);
		kept->n = 0;
		for (size_t i = 0; i < items->n; i++) {
			struct frame *f = frame_new(r, outer);
			struct jv c;
			if (!f)
				return oom(r, n->line);
			r->cur = f;
			int rc = bind_targets(r, n, f, &items->v[i]) || eval(r, n->b, &c);
			r->cur = outer;
			if (rc)
				return r->rc;
			if (jv_truthy(&c))
				kept->v[kept->n++] = items->v[i];
		}
		items = kept;
	}
	if (!items->n) { /* the else block in a frame of its own, as the body */
		struct frame *f = frame_new(r, outer);
		if (!f)
			return oom(r, n->line);
		r->cur = f;
		int rc = exec(r, n->els, n->n_els);
		r->cur = outer;
		return rc;
	}
	/* One frame and one loop object for the whole loop, as Jinja's LoopContext: each iteration
	 * starts with no names of its own (what one iteration sets, the next does not see). */
	struct frame *f = frame_new(r, outer);
	struct jdict *loop = jdict_new(r->a, 12);
	if (!f || !loop)
		return oom(r, n->line);
	r->loops++;
	for (size_t i = 0; i < items->n; i++) {
		if (render_step(r, 1, n->line))
			return r->rc;
		f->vars->n = 0;
		size_t len = items->n;
		struct {
			const char *k;
			struct jv v;
		} fields[] = {
			{"index", jv_int((int64_t)i + 1)},
			{"index0", jv_int((int64_t)i)},
			{"revindex", jv_int((int64_t)(len - i))},
			{"revindex0", jv_int((int64_t)(len - i - 1))},
			{"first", jv_bool(i == 0)},
			{"last", jv_bool(i + 1 == len)},
			{"length", jv_int((int64_t)len)},
			{"depth", jv_int(1)},
			{"depth0", jv_int(0)},
			{"previtem", i ? items->v[i - 1] : jv_undef("loop.previtem")},
			{"nextitem", i + 1 < len ? items->v[i + 1] : jv_undef("loop.nextitem")},
		};
		for (size_t k = 0; k < ARRAY_SIZE(fields); k++)
			if (jdict_set(r->a, loop, jv_cstr(fields[k].k), fields[k].v))
				return oom(r, n->line);
		if (set_var(r, f, "loop", (struct jv){.t = JV_DICT, .d = loop}, n->line) ||
		    bind_targets(r, n, f, &items->v[i]))
			return r->rc;
		r->cur = f;
		int rc = exec(r, n->body, n->n_body);
		r->cur = outer;
		if (rc)
			return rc;
		enum flow fl = r->flow;
		r->flow = FLOW_NONE;
		if (fl == FLOW_BREAK)
			break;
	}
	r->loops--;
	return 0;
}

static int exec_list(struct render *r, struct node *const *body, size_t count);

static int exec(struct render *r, struct node *const *body, size_t count)
{
	if (r->depth >= JINJA_MAX_EVAL_DEPTH)
		return render_fail(r, -E2BIG, count ? body[0]->line : 0, "blocks and calls nested deeper than %d",
				   JINJA_MAX_EVAL_DEPTH);
	r->depth++;
	int rc = exec_list(r, body, count);
	r->depth--;
	return rc;
}

static int exec_list(struct render *r, struct node *const *body, size_t count)
{
	for (size_t i = 0; i < count && r->flow == FLOW_NONE; i++) {
		const struct node *n = body[i];
		if (render_step(r, 1, n->line))
			return r->rc;
		struct jv v;
		switch (n->kind) {
		case N_TEXT:
			sbuf_add_str(r->out, &n->lit.s);
			break;
		case N_OUT:
			if (eval(r, n->a, &v))
				return r->rc;
			jv_print(r->out, &v, false);
			break;
		case N_IF:
			if (eval(r, n->a, &v))
				return r->rc;
			if (jv_truthy(&v) ? exec(r, n->body, n->n_body) : exec(r, n->els, n->n_els))
				return r->rc;
			break;
		case N_FOR:
			if (loop_for(r, n))
				return r->rc;
			break;
		case N_SET:
			if (eval(r, n->b, &v))
				return r->rc;
			if (n->name2) {
				struct jv ns = lookup(r, n->name);
				if (ns.t != JV_NS)
					return render_fail(r, -EINVAL, n->line,
							   "cannot set '%s.%s': '%s' is a %s, not a namespace", n->name,
							   n->name2, n->name, jv_type_name(&ns));
				if (jdict_set(r->a, ns.d, jv_cstr(n->name2), v))
					return oom(r, n->line);
			} else if (set_var(r, r->cur, n->name, v, n->line)) {
				return r->rc;
			}
			break;
		case N_SETBLOCK: {
			struct sbuf b, *saved = r->out;
			sbuf_init(&b, r->a, JINJA_MAX_OUTPUT);
			r->out = &b;
			int rc = exec(r, n->body, n->n_body);
			r->out = saved;
			if (rc)
				return rc;
			if (b.err)
				return oom(r, n->line);
			if (set_var(r, r->cur, n->name, sbuf_value(&b), n->line))
				return r->rc;
			break;
		}
		case N_MACRO:
			if (set_var(r, r->cur, n->name, (struct jv){.t = JV_MACRO, .macro = {n, r->cur}}, n->line))
				return r->rc;
			break;
		case N_BREAK:
		case N_CONTINUE:
			if (!r->loops)
				return render_fail(r, -EINVAL, n->line, "'%s' outside a loop",
						   n->kind == N_BREAK ? "break" : "continue");
			r->flow = n->kind == N_BREAK ? FLOW_BREAK : FLOW_CONTINUE;
			break;
		case N_BLOCK:
			if (exec(r, n->body, n->n_body))
				return r->rc;
			break;
		default:
			return render_fail(r, -EINVAL, n->line, "internal: an expression where a statement belongs");
		}
		if (r->out->err)
			return r->out->err == -E2BIG
				       ? render_fail(r, -E2BIG, n->line, "the output passed %u bytes, or a value printed is nested "
										 "deeper than %d", JINJA_MAX_OUTPUT, JINJA_MAX_DEPTH)
				       : oom(r, n->line);
	}
	return 0;
}

static int add_vars(struct render *r, const json_t *vars, bool data)
{
	if (!vars)
		return 0;
	if (!json_is_object(vars))
		return render_fail(r, -EINVAL, 0, "the variables must be a JSON object");
	const char *k;
	json_t *v;
	json_object_foreach((json_t *)vars, k, v)
	{
		if (set_var(r, r->root, k, jv_from_json(r->a, v, data, 0), 0))
			return r->rc;
	}
	if (arena_exhausted(r->a))
		return oom(r, 0);
	return 0;
}

/* An empty output still gets its buffers (text "" and no marks). */
static bool sbuf_room_for_empty(struct sbuf *o)
{
	o->p = malloc(1);
	o->m = malloc(1);
	return o->p && o->m;
}

int jinja_render(const struct jinja_template *t, const json_t *vars, const json_t *data, time_t now,
		 struct jinja_output *out, char *err, size_t errlen)
{
	memset(out, 0, sizeof(*out));
	struct render r = {.now = now, .err = err, .errlen = errlen};
	if (!(r.a = arena_create(JINJA_MAX_MEMORY)))
		return errorf(err, errlen, -ENOMEM, "out of memory");
	struct sbuf o;
	sbuf_init(&o, NULL, JINJA_MAX_OUTPUT);
	r.out = &o;
	int rc;
	if (!(r.root = frame_new(&r, NULL))) {
		rc = oom(&r, 0);
		goto done;
	}
	r.cur = r.root;
	if ((rc = add_vars(&r, vars, false)) || (rc = add_vars(&r, data, true)) ||
	    (rc = exec(&r, t->body, t->n_body)))
		goto done;
	if (!o.p && !sbuf_room_for_empty(&o)) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto done;
	}
	o.p[o.n] = 0;
	out->text = o.p;
	out->from_data = o.m;
	out->len = o.n;
	o.p = NULL;
	o.m = NULL;
done:
	free(o.p);
	free(o.m);
	arena_destroy(r.a);
	return rc;
}

void jinja_output_free(struct jinja_output *out)
{
	free(out->text);
	free(out->from_data);
	memset(out, 0, sizeof(*out));
}

/* jinja_internal.h - what the parts of the template engine share:
 *   parse.c     the template text into a tree of nodes (jinja_parse)
 *   value.c     the arena every value of a render lives in; values: making, printing, JSON
 *   render.c    the tree run against the variables (jinja_render)
 *   builtins.c  filters, tests, methods and global functions
 * A render allocates from one arena and frees it at the end: values are never freed one by one,
 * and (as transformers' sandbox is immutable) never changed, except a namespace's attributes. */
#ifndef PIPELINE_JINJA_INTERNAL_H
#define PIPELINE_JINJA_INTERNAL_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "common/jinja/jinja.h"

/* The C stack a render may take: evaluations and statement lists nested at once (chains such as
 * a + b + c and filters of filters count one a link). */
#define JINJA_MAX_EVAL_DEPTH 400

/* ---- values ---------------------------------------------------------------------------- */

enum jv_type {
	JV_UNDEF = 0, /* an undefined name or a missing key: prints as nothing, errors when used */
	JV_NONE,
	JV_BOOL,
	JV_INT,
	JV_FLOAT,
	JV_STR,
	JV_LIST, /* lists and tuples */
	JV_DICT,
	JV_NS,	   /* a namespace(): a dict whose attributes `set` may change */
	JV_FUNC,   /* a global function (raise_exception, ...) */
	JV_METHOD, /* a string's or a dict's method, bound to it */
	JV_MACRO,
};

struct jstr {
	const char *p;	  /* n bytes (not NUL-terminated in general) */
	const uint8_t *m; /* n flags, 1 = from the data variables; NULL when none is */
	size_t n;
};

struct jv;
struct jlist {
	struct jv *v;
	size_t n;
	bool tuple; /* prints as (a, b) */
};
struct jdict {
	struct jv *k, *v; /* n keys (strings) and values, in insertion order */
	size_t n, cap;
};

struct node;
struct jv {
	enum jv_type t;
	union {
		bool b;
		int64_t i;
		double f;
		struct jstr s;
		struct jlist *l;
		struct jdict *d; /* JV_DICT and JV_NS */
		struct {
			int fn;		    /* JV_FUNC, JV_METHOD: enum in builtins.c */
			struct jv *self;    /* JV_METHOD: what it is bound to */
		} call;
		struct {
			const struct node *node;
			void *frame; /* the frame it was defined in (render.c's struct frame) */
		} macro;
	};
	const char *undef_name; /* JV_UNDEF: what was looked up, for the message when used */
};

/* The arena: every allocation of a render, freed at once; NULL once the cap is passed (the render
 * then fails with -E2BIG). */
struct arena;
struct arena *arena_create(size_t cap);
void arena_destroy(struct arena *a);
void *arena_alloc(struct arena *a, size_t n);
bool arena_exhausted(const struct arena *a);

struct jv jv_none(void);
struct jv jv_bool(bool b);
struct jv jv_int(int64_t i);
struct jv jv_float(double f);
struct jv jv_undef(const char *name);
/* A string over s (not copied: it must outlive the render) with mask m (NULL: template text). */
struct jv jv_str(const char *s, size_t n, const uint8_t *m);
struct jv jv_cstr(const char *s);
/* A string copied into the arena; data: every byte marked as data. */
struct jv jv_str_copy(struct arena *a, const char *s, size_t n, bool data);
struct jlist *jlist_new(struct arena *a, size_t n);
struct jdict *jdict_new(struct arena *a, size_t cap);
/* Sets key (copied as given) to v, replacing an equal key. Returns 0 or -ENOMEM. */
int jdict_set(struct arena *a, struct jdict *d, struct jv key, struct jv v);
/* The value of key, or NULL. */
struct jv *jdict_get(const struct jdict *d, const char *key, size_t n);

bool jv_truthy(const struct jv *v);
bool jv_equal(const struct jv *a, const struct jv *b);
/* a < b: -1, 0, 1 in *cmp; -EINVAL when the two do not compare (mixed types). */
int jv_compare(const struct jv *a, const struct jv *b, int *cmp);
const char *jv_type_name(const struct jv *v);

/* A growable string with its mask, in the arena (a NULL: on the heap, p and m the owner's to
 * free). */
struct sbuf {
	struct arena *a;
	char *p;
	uint8_t *m;
	size_t n, cap;
	bool any_data; /* some byte is marked */
	size_t limit;  /* the most bytes it may hold */
	int err;       /* -ENOMEM or -E2BIG once something did not fit; later appends do nothing */
};
void sbuf_init(struct sbuf *b, struct arena *a, size_t limit);
void sbuf_add(struct sbuf *b, const char *s, size_t n, const uint8_t *m); /* m NULL: template */
void sbuf_adds(struct sbuf *b, const char *s);
void sbuf_add_str(struct sbuf *b, const struct jstr *s);
struct jv sbuf_value(struct sbuf *b);

/* What {{ v }} prints (str(v) in Python: None, True, 1.5, ['a'], {'a': 1}); undefined prints
 * nothing. repr: the Python repr (strings quoted), as inside a list. */
void jv_print(struct sbuf *b, const struct jv *v, bool repr);
/* json.dumps(v, ensure_ascii=False, indent, separators, sort_keys) into b; indent < 0: none.
 * item_sep/key_sep NULL: Python's defaults. Returns 0 or -EINVAL (a value JSON cannot hold). */
int jv_json(struct sbuf *b, const struct jv *v, int indent, const char *item_sep, const char *key_sep,
	    bool sort_keys, int depth, char *err, size_t errlen);
/* A JSON value as a template value (strings marked as data when data). */
struct jv jv_from_json(struct arena *a, const json_t *j, bool data, int depth);
/* Python's repr of a float. */
void float_repr(double f, char *buf, size_t len);

/* ---- the tree -------------------------------------------------------------------------- */

enum node_kind {
	/* statements */
	N_TEXT,	    /* text */
	N_OUT,	    /* {{ a }} */
	N_IF,	    /* a: condition, body, els (an N_IF for elif, or a list) */
	N_FOR,	    /* name (and name2), a: iterable, b: filter or NULL, body, els */
	N_SET,	    /* name (or a: the namespace's expression and attr), b: value */
	N_SETBLOCK, /* name, body */
	N_MACRO,    /* name, params (names in args[] as N_NAME, defaults in kwvals[]), body */
	N_BREAK,
	N_CONTINUE,
	N_BLOCK, /* body (a generation block) */
	/* expressions */
	E_LIT,	   /* lit */
	E_NAME,	   /* name */
	E_ATTR,	   /* a.name */
	E_ITEM,	   /* a[b] */
	E_SLICE,   /* a[args[0]:args[1]:args[2]] (NULL where left out) */
	E_CALL,	   /* a(args, kw) */
	E_FILTER,  /* a | name(args, kw) */
	E_TEST,	   /* a is [not] name(args); neg */
	E_NEG,	   /* -a */
	E_POS,	   /* +a */
	E_NOT,	   /* not a */
	E_BIN,	   /* a op b */
	E_AND,	   /* a and b */
	E_OR,	   /* a or b */
	E_COND,	   /* b if a else c */
	E_LIST,	   /* [args] */
	E_TUPLE,   /* (args) */
	E_DICT,	   /* {args[i]: kwvals[i]} */
};

enum bin_op { OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT, OP_EQ, OP_NE, OP_LT, OP_LE,
	      OP_GT, OP_GE, OP_IN, OP_NOTIN };

struct node {
	enum node_kind kind;
	int line;
	const char *name, *name2; /* NUL-terminated, owned by the template */
	struct node *a, *b, *c;
	struct node **body, **els; /* statement lists, n_body / n_els long */
	size_t n_body, n_els;
	struct node **args;	   /* positional arguments, list items, dict keys, macro parameters */
	size_t n_args;
	const char **kwnames; /* keyword arguments: names and values (a macro's defaults, NULL where none) */
	struct node **kwvals;
	size_t n_kw;
	enum bin_op op;
	bool neg;	/* E_TEST: `is not` */
	struct jv lit;	/* E_LIT: strings point into the template */
	int builtin;	/* E_FILTER, E_TEST: the builtin's number, resolved at parse */
};

struct jinja_template {
	char *src; /* the text with its newlines made "\n" (names and strings point into copies) */
	struct node **body;
	size_t n_body;
	struct arena *mem; /* the nodes and their strings */
};

/* ---- builtins ---------------------------------------------------------------------------- */

/* A filter's or test's number by name, -1 when there is none. */
int builtin_filter(const char *name);
int builtin_test(const char *name);
/* A global function by name (raise_exception, strftime_now, namespace, range), -1 when none. */
int builtin_function(const char *name);
/* The method name of a value of v's type, or -1. */
int builtin_method(const struct jv *v, const char *name);

/* The length of the white-space character (Python's str.isspace, what \s and strip() take) at
 * s[i] of n bytes, 0 when there is none. */
size_t jinja_space_len(const char *s, size_t n, size_t i);

/* What a call gets: positional values and keyword ones. */
struct call_args {
	struct jv *pos;
	size_t n_pos;
	const char **kwnames;
	struct jv *kw;
	size_t n_kw;
};

struct render;
/* Each returns 0 with *out, or -errno with the render's message set (render_fail). */
int builtin_call_filter(struct render *r, int filter, const struct jv *v, const struct call_args *args, int line,
			struct jv *out);
int builtin_call_test(struct render *r, int test, const struct jv *v, const struct call_args *args, int line,
		      bool *out);
int builtin_call(struct render *r, const struct jv *fn, const struct call_args *args, int line, struct jv *out);

/* From render.c, for the builtins: the render's arena, its clock, its failure. */
struct arena *render_arena(struct render *r);
time_t render_now(struct render *r);
int render_fail(struct render *r, int rc, int line, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* Fails the render for memory: -E2BIG past JINJA_MAX_MEMORY, else -ENOMEM. */
int render_oom(struct render *r, int line);
/* Counts work; -E2BIG (with the message) past JINJA_MAX_STEPS. */
int render_step(struct render *r, size_t n, int line);

#endif

/* tunable.h - a service's parameters for live tuning: a registry each service fills at start,
 * read with MSG_CONFIG_GET and changed with MSG_CONFIG_SET (common/service.c answers both; a
 * client is `pipectl get|tune`, or `scripts/pipeline get|tune`).
 *
 *   static void get_depth(void *ctx, struct tunable_value *v) { v->i = ((struct app *)ctx)->depth; }
 *   static int set_depth(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t len)
 *   {
 *       struct app *a = ctx;
 *       if (v->i > a->in_use) ... return errorf(why, len, -EBUSY, "%lld is below the %u in use", ...);
 *       if (apply) a->depth = (uint32_t)v->i;
 *       return 0;
 *   }
 *   struct tunable t = {.name = "io-depth", .help = "reads in flight at most", .type = TUNABLE_INT,
 *                       .min = 1, .max = 64, .get = get_depth, .set = set_depth, .ctx = app};
 *   service_add_tunable(svc, &t);                  // or tunables_add(reg, &t)
 *   service_add_fixed(svc, "model", TUNABLE_STRING, model_dir, "checkpoint directory");
 *
 * A parameter is named after the service's flag that sets it at start. One that cannot change
 * safely while the service runs is registered fixed (no setter): GET shows it with its value,
 * marked not tunable, and SET refuses it ("fixed at start: restart SERVICE with --NAME").
 *
 * SET is all or nothing: every pair is parsed (by type: an integer, a size such as 512MiB, one
 * of the enum's values, a boolean, a string), checked against its range, and offered to its
 * setter with apply = false; only when all pass does each setter run again with apply = true
 * (which must then succeed: the state the check saw cannot change in between, the service loop
 * is single-threaded). Each key is checked against the current values of the others. A change
 * logs one info line "tune: KEY OLD -> NEW". Errors name the key: "KEY: why"; an unknown key's
 * error lists the known ones.
 *
 * Not thread-safe: the service loop owns the registry. The name, help and values strings of a
 * definition are borrowed (string literals); a fixed value's text is copied. */
#ifndef PIPELINE_TUNABLE_H
#define PIPELINE_TUNABLE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

#define TUNABLES_MAX 64		 /* parameters per service; also pairs per SET and keys per GET */
#define TUNABLE_NAME_MAX 63	 /* bytes of a name */
#define TUNABLE_VALUE_MAX 1023	 /* bytes of a value's text */

enum tunable_type {
	TUNABLE_INT = 1,    /* a decimal integer in [min, max] */
	TUNABLE_BYTES = 2,  /* a size ("512MiB", "4GiB", "4096") in [min, max] bytes */
	TUNABLE_ENUM = 3,   /* one of values[] */
	TUNABLE_STRING = 4, /* text */
	TUNABLE_BOOL = 5,   /* true/false, 1/0, yes/no, on/off */
};

struct tunable_value {
	int64_t i;     /* INT, BYTES: the number; BOOL: 0 or 1; ENUM: the index into values */
	const char *s; /* STRING: the text; ENUM: the value's name (values[i]); else NULL */
};

struct tunable {
	const char *name; /* the service's flag without "--": "kv-dram-budget" */
	const char *help; /* one line: what it is and what a change does */
	enum tunable_type type;
	int64_t min, max;	   /* INT, BYTES: the range, inclusive (unless range is set) */
	const char *const *values; /* ENUM: the allowed values, NULL-terminated */
	/* Optional: the range now, for a range that follows the service's state (a pool laid out
	 * later). Overrides min and max. */
	void (*range)(void *ctx, int64_t *min, int64_t *max);
	/* The current value. Required for a tunable parameter. For STRING and ENUM, out->s must stay
	 * valid until the next call into the service. */
	void (*get)(void *ctx, struct tunable_value *out);
	/* Checks v (parsed and within range) against the service's state and, with apply, applies it.
	 * Returns 0, or a negative errno with why (no key prefix: the registry adds it). NULL for a
	 * parameter fixed at start. */
	int (*set)(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen);
	void *ctx;
};

struct tunables;

/* A registry for service (the name goes into messages). NULL without memory. */
struct tunables *tunables_create(const char *service);
void tunables_destroy(struct tunables **t);

/* Adds a parameter (copied). Returns 0; -EEXIST for a name already there; -ENOSPC past
 * TUNABLES_MAX; -EINVAL for a definition that is not whole (no name, a name too long or not of
 * [a-z0-9-], a settable one without get, an ENUM without values, min > max). */
int tunables_add(struct tunables *t, const struct tunable *def);
/* Adds a parameter fixed at start with its value as text (copied; NULL: empty). A BYTES, INT
 * or BOOL text that parses is shown as a number; other text as is. Returns as tunables_add. */
int tunables_add_fixed(struct tunables *t, const char *name, enum tunable_type type, const char *value,
		       const char *help);

/* Parses text as a value of def's type within [min, max] (ENUM: one of values). Returns 0, or
 * -EINVAL / -ERANGE with why (no key prefix): "'12x' is not a size (examples: 512MiB, 4GiB,
 * 4096)", "0 is out of range (1..64)". out->s points into text or def->values. */
int tunable_parse(const struct tunable *def, int64_t min, int64_t max, const char *text, struct tunable_value *out,
		  char *why, size_t whylen);
/* Formats a value of def's type: sizes as exact as "512MiB", "1536KiB" or "4097" allow. Returns buf. */
char *tunable_format(const struct tunable *def, const struct tunable_value *v, char *buf, size_t len);
/* A size as exact text: "16MiB", "3GiB", "4097". Returns buf. */
char *tunable_format_bytes(int64_t bytes, char *buf, size_t len);

/* MSG_CONFIG_GET: keys is NULL/empty for every parameter, or a JSON array of names (each must
 * exist). Returns a malloc'd JSON object (name -> {value, text, type, tunable, min, max | values,
 * description}) in registration order; NULL with *rc (-EINVAL, -ENOENT, -ENOMEM) and why. */
char *tunables_get_json(struct tunables *t, const char *keys, size_t len, int *rc, char *why, size_t whylen);

/* MSG_CONFIG_SET: settings is a JSON object of name -> value (a string; numbers and booleans are
 * taken as their text). All or nothing (see above). Returns a malloc'd JSON object of the keys
 * set with their new values (as GET shows them); NULL with *rc and why ("KEY: why"): -EINVAL
 * (malformed, a bad value), -ENOENT (an unknown key), -EPERM (a fixed one), -ERANGE, or what a
 * setter returned. */
char *tunables_set_json(struct tunables *t, const char *settings, size_t len, int *rc, char *why, size_t whylen);

/* The names of the parameters, ", "-separated, tunable ones first, into buf. Returns buf. */
char *tunables_names(const struct tunables *t, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif

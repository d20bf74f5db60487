/* test_tunable.c - common/tunable.c: parsing values by type (sizes such as 512MiB, integers,
 * enums, booleans) against ranges, formatting, registration rules, GET and SET as JSON (all or
 * nothing, unknown and fixed keys, setter refusals) and the "tune:" log line. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/tunable.h"
#include "common/util.h"
#include "tests/unit/common/test_helpers.h"

/* ---- parsing and formatting ---- */

static const struct tunable t_bytes = {.name = "budget", .type = TUNABLE_BYTES, .min = 4096, .max = 1ll << 30};
static const struct tunable t_int = {.name = "depth", .type = TUNABLE_INT, .min = 1, .max = 64};
static const char *const levels[] = {"debug", "info", "warn", "error", NULL};
static const struct tunable t_enum = {.name = "level", .type = TUNABLE_ENUM, .values = levels};
static const struct tunable t_bool = {.name = "flag", .type = TUNABLE_BOOL};
static const struct tunable t_str = {.name = "path", .type = TUNABLE_STRING};

static int parse(const struct tunable *d, const char *text, struct tunable_value *v, char *why)
{
	return tunable_parse(d, d->min, d->max, text, v, why, 256);
}

START_TEST(test_parse_sizes)
{
	struct tunable_value v;
	char why[256];
	ck_assert_int_eq(parse(&t_bytes, "512MiB", &v, why), 0);
	ck_assert_int_eq(v.i, 512ll << 20);
	ck_assert_int_eq(parse(&t_bytes, "1GiB", &v, why), 0);
	ck_assert_int_eq(v.i, 1ll << 30);
	ck_assert_int_eq(parse(&t_bytes, "4096", &v, why), 0);
	ck_assert_int_eq(v.i, 4096);
	ck_assert_int_eq(parse(&t_bytes, "1.5MiB", &v, why), 0);
	ck_assert_int_eq(v.i, 3ll << 19);
	ck_assert_int_eq(parse(&t_bytes, "64kib", &v, why), 0);
	ck_assert_int_eq(v.i, 65536);
	/* not sizes */
	ck_assert_int_eq(parse(&t_bytes, "12x", &v, why), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "'12x' is not a size"));
	ck_assert_int_eq(parse(&t_bytes, "", &v, why), -EINVAL);
	ck_assert_int_eq(parse(&t_bytes, "-4KiB", &v, why), -EINVAL);
	ck_assert_int_eq(parse(&t_bytes, "abc", &v, why), -EINVAL);
	/* out of range, with the range in the message, written as sizes */
	ck_assert_int_eq(parse(&t_bytes, "1KiB", &v, why), -ERANGE);
	ck_assert_str_eq(why, "1KiB is out of range (4KiB..1GiB)");
	ck_assert_int_eq(parse(&t_bytes, "2GiB", &v, why), -ERANGE);
	ck_assert_str_eq(why, "2GiB is out of range (4KiB..1GiB)");
	ck_assert_int_eq(parse(&t_bytes, "1e30", &v, why), -ERANGE);
}
END_TEST

START_TEST(test_parse_ints_enums_bools)
{
	struct tunable_value v;
	char why[256];
	ck_assert_int_eq(parse(&t_int, "8", &v, why), 0);
	ck_assert_int_eq(v.i, 8);
	ck_assert_int_eq(parse(&t_int, "+64", &v, why), 0);
	ck_assert_int_eq(v.i, 64);
	ck_assert_int_eq(parse(&t_int, "0", &v, why), -ERANGE);
	ck_assert_str_eq(why, "0 is out of range (1..64)");
	ck_assert_int_eq(parse(&t_int, "65", &v, why), -ERANGE);
	ck_assert_int_eq(parse(&t_int, "-1", &v, why), -ERANGE);
	ck_assert_int_eq(parse(&t_int, "99999999999999999999999", &v, why), -ERANGE);
	ck_assert_int_eq(parse(&t_int, "eight", &v, why), -EINVAL);
	ck_assert_str_eq(why, "'eight' is not an integer");
	ck_assert_int_eq(parse(&t_int, "8k", &v, why), -EINVAL);
	ck_assert_int_eq(parse(&t_int, " 8", &v, why), -EINVAL);
	ck_assert_int_eq(parse(&t_int, "0x10", &v, why), -EINVAL);
	ck_assert_int_eq(parse(&t_int, "", &v, why), -EINVAL);
	ck_assert_int_eq(parse(&t_int, "-", &v, why), -EINVAL);

	ck_assert_int_eq(parse(&t_enum, "warn", &v, why), 0);
	ck_assert_int_eq(v.i, 2);
	ck_assert_str_eq(v.s, "warn");
	ck_assert_int_eq(parse(&t_enum, "DEBUG", &v, why), 0);
	ck_assert_str_eq(v.s, "debug");
	ck_assert_int_eq(parse(&t_enum, "verbose", &v, why), -EINVAL);
	ck_assert_str_eq(why, "'verbose' is not one of debug, info, warn, error");

	ck_assert_int_eq(parse(&t_bool, "on", &v, why), 0);
	ck_assert_int_eq(v.i, 1);
	ck_assert_int_eq(parse(&t_bool, "0", &v, why), 0);
	ck_assert_int_eq(v.i, 0);
	ck_assert_int_eq(parse(&t_bool, "maybe", &v, why), -EINVAL);

	ck_assert_int_eq(parse(&t_str, "/x/y", &v, why), 0);
	ck_assert_str_eq(v.s, "/x/y");
	char *long_text = malloc(TUNABLE_VALUE_MAX + 2);
	memset(long_text, 'a', TUNABLE_VALUE_MAX + 1);
	long_text[TUNABLE_VALUE_MAX + 1] = 0;
	ck_assert_int_eq(parse(&t_str, long_text, &v, why), -EINVAL);
	free(long_text);
}
END_TEST

START_TEST(test_format)
{
	char buf[64];
	ck_assert_str_eq(tunable_format_bytes(512ll << 20, buf, sizeof(buf)), "512MiB");
	ck_assert_str_eq(tunable_format_bytes(3ll << 30, buf, sizeof(buf)), "3GiB");
	ck_assert_str_eq(tunable_format_bytes(1536ll << 10, buf, sizeof(buf)), "1536KiB");
	ck_assert_str_eq(tunable_format_bytes(2ll << 40, buf, sizeof(buf)), "2TiB");
	ck_assert_str_eq(tunable_format_bytes(4097, buf, sizeof(buf)), "4097");
	ck_assert_str_eq(tunable_format_bytes(0, buf, sizeof(buf)), "0");
	ck_assert_str_eq(tunable_format_bytes(2700000000000ll, buf, sizeof(buf)), "2700GB");
	ck_assert_str_eq(tunable_format_bytes(1000000007, buf, sizeof(buf)), "1000000007");
	struct tunable_value v = {.i = 2, .s = NULL};
	ck_assert_str_eq(tunable_format(&t_enum, &v, buf, sizeof(buf)), "warn");
	v.i = 1;
	ck_assert_str_eq(tunable_format(&t_bool, &v, buf, sizeof(buf)), "true");
	v.i = 42;
	ck_assert_str_eq(tunable_format(&t_int, &v, buf, sizeof(buf)), "42");
	/* a formatted size parses back to itself */
	struct tunable_value back;
	char why[256];
	for (int64_t b = 4096; b <= (1ll << 30); b = b * 3 + 4096) {
		tunable_format_bytes(b, buf, sizeof(buf));
		ck_assert_int_eq(parse(&t_bytes, buf, &back, why), 0);
		ck_assert_int_eq(back.i, b);
	}
}
END_TEST

/* ---- the registry ---- */

struct app {
	int64_t depth, budget, in_use;
	int level;
	int sets_applied;
};

static void get_depth(void *ctx, struct tunable_value *v)
{
	v->i = ((struct app *)ctx)->depth;
}
static int set_depth(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t len)
{
	struct app *a = ctx;
	if (apply) {
		a->depth = v->i;
		a->sets_applied++;
	}
	return 0;
}
static void get_budget(void *ctx, struct tunable_value *v)
{
	v->i = ((struct app *)ctx)->budget;
}
static int set_budget(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t len)
{
	struct app *a = ctx;
	char x[32], y[32];
	if (v->i < a->in_use)
		return errorf(why, len, -EBUSY, "%s is below the %s already in use", tunable_format_bytes(v->i, x, sizeof(x)),
			      tunable_format_bytes(a->in_use, y, sizeof(y)));
	if (apply) {
		a->budget = v->i;
		a->sets_applied++;
	}
	return 0;
}
static void budget_range(void *ctx, int64_t *min, int64_t *max)
{
	*max = ((struct app *)ctx)->in_use * 100;
}
static void get_level(void *ctx, struct tunable_value *v)
{
	v->i = ((struct app *)ctx)->level;
	v->s = levels[v->i];
}
static int set_level(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t len)
{
	if (apply)
		((struct app *)ctx)->level = (int)v->i;
	return 0;
}

static struct tunables *make(struct app *a)
{
	struct tunables *t = tunables_create("test-svc");
	ck_assert_ptr_nonnull(t);
	struct tunable d = {.name = "io-depth", .help = "reads in flight", .type = TUNABLE_INT, .min = 1, .max = 64,
			    .get = get_depth, .set = set_depth, .ctx = a};
	ck_assert_int_eq(tunables_add(t, &d), 0);
	struct tunable b = {.name = "dram-budget", .help = "memory", .type = TUNABLE_BYTES, .min = 4096, .max = 0,
			    .range = budget_range, .get = get_budget, .set = set_budget, .ctx = a};
	ck_assert_int_eq(tunables_add(t, &b), 0);
	struct tunable l = {.name = "level", .help = "log", .type = TUNABLE_ENUM, .values = levels, .get = get_level,
			    .set = set_level, .ctx = a};
	ck_assert_int_eq(tunables_add(t, &l), 0);
	ck_assert_int_eq(tunables_add_fixed(t, "model", TUNABLE_STRING, "/models/x", "checkpoint"), 0);
	ck_assert_int_eq(tunables_add_fixed(t, "block-bytes", TUNABLE_BYTES, "65536", "block size"), 0);
	return t;
}

START_TEST(test_register_rules)
{
	struct app a = {.depth = 8};
	struct tunables *t = make(&a);
	struct tunable d = {.name = "io-depth", .type = TUNABLE_INT, .min = 1, .max = 2, .get = get_depth,
			    .set = set_depth, .ctx = &a};
	ck_assert_int_eq(tunables_add(t, &d), -EEXIST);
	d.name = "Bad_Name";
	ck_assert_int_eq(tunables_add(t, &d), -EINVAL);
	d.name = "no-getter";
	d.get = NULL;
	ck_assert_int_eq(tunables_add(t, &d), -EINVAL);
	d.get = get_depth;
	d.min = 5;
	d.max = 4;
	ck_assert_int_eq(tunables_add(t, &d), -EINVAL);
	struct tunable e = {.name = "enum-without-values", .type = TUNABLE_ENUM, .get = get_level, .set = set_level};
	ck_assert_int_eq(tunables_add(t, &e), -EINVAL);
	char names[256];
	ck_assert_str_eq(tunables_names(t, names, sizeof(names)), "io-depth, dram-budget, level, model, block-bytes");
	/* fill up to the limit */
	int added = 5;
	char names_fixed[TUNABLES_MAX][32]; /* a name is kept by reference: it outlives the registry */
	for (int i = 0; added < TUNABLES_MAX; i++, added++) {
		snprintf(names_fixed[i], sizeof(names_fixed[i]), "fixed-%d", i);
		ck_assert_int_eq(tunables_add_fixed(t, names_fixed[i], TUNABLE_INT, "1", ""), 0);
	}
	ck_assert_int_eq(tunables_add_fixed(t, "one-too-many", TUNABLE_INT, "1", ""), -ENOSPC);
	tunables_destroy(&t);
	ck_assert_ptr_null(t);
	tunables_destroy(&t);
}
END_TEST

static json_t *load(const char *text)
{
	json_error_t e;
	json_t *j = json_loads(text, 0, &e);
	ck_assert_msg(j != NULL, "not JSON: %s", text);
	return j;
}

START_TEST(test_get_json)
{
	struct app a = {.depth = 8, .budget = 1 << 20, .in_use = 65536, .level = 1};
	struct tunables *t = make(&a);
	int rc;
	char why[4096];
	char *text = tunables_get_json(t, NULL, 0, &rc, why, sizeof(why));
	ck_assert_ptr_nonnull(text);
	json_t *j = load(text);
	ck_assert_int_eq(json_object_size(j), 5);
	json_t *d = json_object_get(j, "io-depth");
	ck_assert_int_eq(json_integer_value(json_object_get(d, "value")), 8);
	ck_assert_str_eq(json_string_value(json_object_get(d, "type")), "int");
	ck_assert(json_is_true(json_object_get(d, "tunable")));
	ck_assert_int_eq(json_integer_value(json_object_get(d, "min")), 1);
	ck_assert_int_eq(json_integer_value(json_object_get(d, "max")), 64);
	ck_assert_str_eq(json_string_value(json_object_get(d, "range")), "1..64");
	ck_assert_str_eq(json_string_value(json_object_get(d, "description")), "reads in flight");
	json_t *b = json_object_get(j, "dram-budget");
	ck_assert_str_eq(json_string_value(json_object_get(b, "text")), "1MiB");
	ck_assert_str_eq(json_string_value(json_object_get(b, "range")), "4KiB..6400KiB"); /* the range callback */
	json_t *l = json_object_get(j, "level");
	ck_assert_str_eq(json_string_value(json_object_get(l, "value")), "info");
	ck_assert_int_eq(json_array_size(json_object_get(l, "values")), 4);
	json_t *m = json_object_get(j, "model");
	ck_assert(json_is_false(json_object_get(m, "tunable")));
	ck_assert_str_eq(json_string_value(json_object_get(m, "value")), "/models/x");
	ck_assert_ptr_null(json_object_get(m, "range"));
	json_t *bb = json_object_get(j, "block-bytes");
	ck_assert_int_eq(json_integer_value(json_object_get(bb, "value")), 65536);
	ck_assert_str_eq(json_string_value(json_object_get(bb, "text")), "64KiB");
	/* registration order */
	const char *first = NULL;
	void *it = json_object_iter(j);
	first = json_object_iter_key(it);
	ck_assert_str_eq(first, "io-depth");
	json_decref(j);
	free(text);

	/* some keys */
	const char *keys = "[\"level\", \"model\"]";
	text = tunables_get_json(t, keys, strlen(keys), &rc, why, sizeof(why));
	ck_assert_ptr_nonnull(text);
	j = load(text);
	ck_assert_int_eq(json_object_size(j), 2);
	json_decref(j);
	free(text);
	/* unknown key: the known ones listed */
	keys = "[\"level\", \"nope\"]";
	ck_assert_ptr_null(tunables_get_json(t, keys, strlen(keys), &rc, why, sizeof(why)));
	ck_assert_int_eq(rc, -ENOENT);
	ck_assert_str_eq(why, "unknown key 'nope' for test-svc; known: io-depth, dram-budget, level, model, block-bytes");
	/* malformed */
	static const char *const bad[] = {"{\"a\": 1}", "[1]", "[\"x", "\"level\"", "[null]", "[\"level\\u0000x\"]"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ck_assert_ptr_null(tunables_get_json(t, bad[i], strlen(bad[i]), &rc, why, sizeof(why)));
		ck_assert_int_eq(rc, -EINVAL);
	}
	tunables_destroy(&t);
}
END_TEST

static char *set(struct tunables *t, const char *json, int *rc, char *why)
{
	return tunables_set_json(t, json, strlen(json), rc, why, 4096);
}

START_TEST(test_set_json)
{
	struct app a = {.depth = 8, .budget = 1 << 20, .in_use = 65536, .level = 1};
	struct tunables *t = make(&a);
	int rc;
	char why[4096];
	log_set_level(LOG_INFO);
	struct th_capture cap;
	th_capture_begin(&cap, STDERR_FILENO);
	char *text = set(t, "{\"io-depth\": \"16\", \"dram-budget\": \"512KiB\"}", &rc, why);
	char *logged = th_capture_end(&cap);
	ck_assert_msg(text != NULL, "set failed: %s", why);
	ck_assert_int_eq(a.depth, 16);
	ck_assert_int_eq(a.budget, 512 << 10);
	ck_assert_ptr_nonnull(strstr(logged, "info: tune: io-depth 8 -> 16\n"));
	ck_assert_ptr_nonnull(strstr(logged, "info: tune: dram-budget 1MiB -> 512KiB\n"));
	free(logged);
	json_t *j = load(text);
	ck_assert_int_eq(json_object_size(j), 2);
	ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(j, "io-depth"), "value")), 16);
	json_decref(j);
	free(text);

	/* numbers are taken as their text; the same value again logs nothing */
	th_capture_begin(&cap, STDERR_FILENO);
	text = set(t, "{\"io-depth\": 16}", &rc, why);
	logged = th_capture_end(&cap);
	ck_assert_ptr_nonnull(text);
	ck_assert_ptr_null(strstr(logged, "tune:"));
	free(logged);
	free(text);

	/* all or nothing: a bad second key leaves the first as it was */
	int applied = a.sets_applied;
	ck_assert_ptr_null(set(t, "{\"io-depth\": \"32\", \"dram-budget\": \"12x\"}", &rc, why));
	ck_assert_int_eq(rc, -EINVAL);
	ck_assert_str_eq(why, "dram-budget: '12x' is not a size (examples: 512MiB, 4GiB, 4096)");
	ck_assert_int_eq(a.depth, 16);
	ck_assert_int_eq(a.sets_applied, applied);
	/* a setter's refusal, named by key */
	ck_assert_ptr_null(set(t, "{\"io-depth\": \"2\", \"dram-budget\": \"32KiB\"}", &rc, why));
	ck_assert_int_eq(rc, -EBUSY);
	ck_assert_str_eq(why, "dram-budget: 32KiB is below the 64KiB already in use");
	ck_assert_int_eq(a.depth, 16);
	/* out of range (a range from the callback) */
	ck_assert_ptr_null(set(t, "{\"dram-budget\": \"7MiB\"}", &rc, why));
	ck_assert_int_eq(rc, -ERANGE);
	ck_assert_str_eq(why, "dram-budget: 7MiB is out of range (4KiB..6400KiB)");
	ck_assert_ptr_null(set(t, "{\"io-depth\": \"0\"}", &rc, why));
	ck_assert_str_eq(why, "io-depth: 0 is out of range (1..64)");
	ck_assert_ptr_null(set(t, "{\"io-depth\": \"lots\"}", &rc, why));
	ck_assert_str_eq(why, "io-depth: 'lots' is not an integer");
	/* unknown and fixed keys */
	ck_assert_ptr_null(set(t, "{\"io-depth\": \"3\", \"speed\": \"9\"}", &rc, why));
	ck_assert_int_eq(rc, -ENOENT);
	ck_assert_ptr_nonnull(strstr(why, "unknown key 'speed' for test-svc; known: io-depth, dram-budget"));
	ck_assert_ptr_null(set(t, "{\"model\": \"/other\"}", &rc, why));
	ck_assert_int_eq(rc, -EPERM);
	ck_assert_str_eq(why, "model: fixed at start: restart test-svc with --model");
	ck_assert_int_eq(a.depth, 16);
	/* malformed settings */
	static const char *const bad[] = {"", "[]", "{}", "{\"io-depth\": null}", "{\"io-depth\": [1]}", "{\"io-depth",
					  "{\"io-depth\": \"4\", \"io-depth\": \"5\"}", "\"x\""};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ck_assert_ptr_null(tunables_set_json(t, bad[i], strlen(bad[i]), &rc, why, sizeof(why)));
		ck_assert_msg(rc == -EINVAL, "%s: rc %d (%s)", bad[i], rc, why);
	}
	ck_assert_int_eq(a.depth, 16);
	/* a level change to warn is logged (before it applies) */
	th_capture_begin(&cap, STDERR_FILENO);
	text = set(t, "{\"level\": \"WARN\"}", &rc, why);
	logged = th_capture_end(&cap);
	ck_assert_ptr_nonnull(text);
	ck_assert_int_eq(a.level, 2);
	ck_assert_ptr_nonnull(strstr(logged, "tune: level info -> warn"));
	free(logged);
	free(text);
	/* while the log level is warn, a change is not logged at info */
	log_set_level(LOG_WARN);
	th_capture_begin(&cap, STDERR_FILENO);
	text = set(t, "{\"io-depth\": \"5\"}", &rc, why);
	logged = th_capture_end(&cap);
	ck_assert_ptr_nonnull(text);
	ck_assert_ptr_null(strstr(logged, "tune:"));
	free(logged);
	free(text);
	log_set_level(LOG_INFO);
	tunables_destroy(&t);
}
END_TEST

static Suite *tunable_suite(void)
{
	Suite *s = suite_create("tunable");
	TCase *tc = tcase_create("parse");
	tcase_add_test(tc, test_parse_sizes);
	tcase_add_test(tc, test_parse_ints_enums_bools);
	tcase_add_test(tc, test_format);
	suite_add_tcase(s, tc);
	tc = tcase_create("registry");
	tcase_add_test(tc, test_register_rules);
	tcase_add_test(tc, test_get_json);
	tcase_add_test(tc, test_set_json);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	log_init("test-svc");
	return th_run(tunable_suite());
}

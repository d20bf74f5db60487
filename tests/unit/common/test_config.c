/* test_config.c - common/config.c: defaults, environment, flags, and the errors each one names. */
#include <check.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/config.h"
#include "common/util.h"
#include "tests/unit/common/test_helpers.h"

/* One table of every kind; each test runs in its own forked process, so setenv stays local. */
struct values {
	char *model;
	uint64_t budget;
	long depth;
	double ratio;
	bool verbose;
	bool pinned;
};

static void table(struct values *v, struct opt *opts)
{
	memset(v, 0, sizeof(*v));
	struct opt t[] = {
		{"model", OPT_STRING, &v->model, NULL, "checkpoint directory"},
		{"dram-budget", OPT_SIZE, &v->budget, "4GiB", "host memory for weights"},
		{"queue-depth", OPT_INT, &v->depth, "64", "io_uring queue depth"},
		{"ratio", OPT_DOUBLE, &v->ratio, "0.5", "a fraction"},
		{"verbose", OPT_BOOL, &v->verbose, NULL, "say more"},
		{"pinned", OPT_BOOL, &v->pinned, "1", "pin the ring"},
		{0},
	};
	memcpy(opts, t, sizeof(t));
}

#define N_OPTS 7

/* Parses argv (NULL-terminated list after the program name); captures stderr into *errtext. */
static int parse(struct values *v, char **errtext, char **positional, int *npos, ...)
{
	struct opt opts[N_OPTS];
	table(v, opts);
	char *argv[32] = {"prog"};
	int argc = 1;
	va_list ap;
	va_start(ap, npos);
	for (const char *a; (a = va_arg(ap, const char *)) != NULL;)
		argv[argc++] = (char *)a;
	va_end(ap);
	struct th_capture cap;
	th_capture_begin(&cap, STDERR_FILENO);
	int rc = config_parse("prog", "a test program", opts, argc, argv, positional, npos);
	char *text = th_capture_end(&cap);
	if (errtext)
		*errtext = text;
	else
		free(text);
	return rc;
}

static void clear_env(void)
{
	static const char *const names[] = {"PIPELINE_PROG_MODEL", "PIPELINE_PROG_DRAM_BUDGET", "PIPELINE_PROG_QUEUE_DEPTH",
					    "PIPELINE_PROG_RATIO", "PIPELINE_PROG_VERBOSE", "PIPELINE_PROG_PINNED"};
	for (size_t i = 0; i < ARRAY_SIZE(names); i++)
		unsetenv(names[i]);
}

START_TEST(test_defaults)
{
	clear_env();
	struct values v;
	char *err;
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, NULL), 0);
	ck_assert_str_eq(err, "");
	free(err);
	ck_assert_ptr_null(v.model); /* no default: left as it was */
	ck_assert_uint_eq(v.budget, 4ull << 30);
	ck_assert_int_eq(v.depth, 64);
	ck_assert_double_eq(v.ratio, 0.5);
	ck_assert(!v.verbose);
	ck_assert(v.pinned);
}
END_TEST

START_TEST(test_environment)
{
	clear_env();
	setenv("PIPELINE_PROG_MODEL", "/models/llama", 1);
	setenv("PIPELINE_PROG_DRAM_BUDGET", "512MiB", 1); /* '-' becomes '_', upper case */
	setenv("PIPELINE_PROG_QUEUE_DEPTH", "128", 1);
	setenv("PIPELINE_PROG_RATIO", "0.25", 1);
	setenv("PIPELINE_PROG_VERBOSE", "1", 1);
	setenv("PIPELINE_PROG_PINNED", "false", 1);
	struct values v;
	ck_assert_int_eq(parse(&v, NULL, NULL, NULL, NULL), 0);
	ck_assert_str_eq(v.model, "/models/llama");
	ck_assert_uint_eq(v.budget, 512ull << 20);
	ck_assert_int_eq(v.depth, 128);
	ck_assert_double_eq(v.ratio, 0.25);
	ck_assert(v.verbose);
	ck_assert(!v.pinned);
	/* An empty variable counts as unset. */
	setenv("PIPELINE_PROG_QUEUE_DEPTH", "", 1);
	ck_assert_int_eq(parse(&v, NULL, NULL, NULL, NULL), 0);
	ck_assert_int_eq(v.depth, 64);
}
END_TEST

START_TEST(test_env_names)
{
	/* Shared flags have one name for every binary; the rest carry the program's first word,
	 * so ssd-loader's --io-depth and kv-store's never read the same variable. */
	const char *instance = NULL;
	long depth = 0;
	struct opt o[] = {
		{"instance", OPT_STRING, &instance, "default", "instance"},
		{"io-depth", OPT_INT, &depth, "1", "depth"},
		{0},
	};
	char *argv[] = {"kv-store", NULL};
	setenv("PIPELINE_INSTANCE", "blue", 1);
	setenv("PIPELINE_IO_DEPTH", "7", 1);		/* no longer anyone's */
	setenv("PIPELINE_SSD_LOADER_IO_DEPTH", "9", 1); /* the loader's, not kv-store's */
	setenv("PIPELINE_KV_STORE_IO_DEPTH", "3", 1);
	ck_assert_int_eq(config_parse("kv-store something", "", o, 1, argv, NULL, NULL), 0);
	ck_assert_str_eq(instance, "blue");
	ck_assert_int_eq(depth, 3);
}
END_TEST

START_TEST(test_flag_beats_env)
{
	clear_env();
	setenv("PIPELINE_PROG_DRAM_BUDGET", "512MiB", 1);
	setenv("PIPELINE_PROG_MODEL", "/from/env", 1);
	setenv("PIPELINE_PROG_PINNED", "1", 1);
	struct values v;
	ck_assert_int_eq(parse(&v, NULL, NULL, NULL, "--dram-budget", "1GiB", "--model=/from/flag", "--pinned=0", NULL),
			 0);
	ck_assert_uint_eq(v.budget, 1ull << 30);
	ck_assert_str_eq(v.model, "/from/flag");
	ck_assert(!v.pinned);
	/* A bad environment value is reported even when a flag would override it: it is a mistake. */
	setenv("PIPELINE_PROG_QUEUE_DEPTH", "many", 1);
	char *err;
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--queue-depth", "8", NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "PIPELINE_PROG_QUEUE_DEPTH"));
	ck_assert_ptr_nonnull(strstr(err, "many"));
	free(err);
}
END_TEST

START_TEST(test_flag_forms)
{
	clear_env();
	struct values v;
	ck_assert_int_eq(parse(&v, NULL, NULL, NULL, "--queue-depth=7", "--ratio", "1e-3", "--model", "m", NULL), 0);
	ck_assert_int_eq(v.depth, 7);
	ck_assert_double_eq(v.ratio, 1e-3);
	ck_assert_str_eq(v.model, "m");
	/* An empty value with '=' is a value. */
	ck_assert_int_eq(parse(&v, NULL, NULL, NULL, "--model=", NULL), 0);
	ck_assert_str_eq(v.model, "");
	/* The last occurrence wins. */
	ck_assert_int_eq(parse(&v, NULL, NULL, NULL, "--queue-depth=1", "--queue-depth=2", NULL), 0);
	ck_assert_int_eq(v.depth, 2);
	/* A negative integer is a value, not a flag. */
	ck_assert_int_eq(parse(&v, NULL, NULL, NULL, "--queue-depth", "-3", NULL), 0);
	ck_assert_int_eq(v.depth, -3);
}
END_TEST

START_TEST(test_bools)
{
	clear_env();
	struct values v;
	ck_assert_int_eq(parse(&v, NULL, NULL, NULL, "--verbose", NULL), 0);
	ck_assert(v.verbose);
	static const char *const yes[] = {"1", "true", "yes"};
	static const char *const no[] = {"0", "false", "no"};
	for (int i = 0; i < 3; i++) {
		char flag[32];
		snprintf(flag, sizeof(flag), "--verbose=%s", yes[i]);
		ck_assert_int_eq(parse(&v, NULL, NULL, NULL, flag, NULL), 0);
		ck_assert_msg(v.verbose, "%s", flag);
		snprintf(flag, sizeof(flag), "--pinned=%s", no[i]);
		ck_assert_int_eq(parse(&v, NULL, NULL, NULL, flag, NULL), 0);
		ck_assert_msg(!v.pinned, "%s", flag);
		setenv("PIPELINE_PROG_VERBOSE", yes[i], 1);
		ck_assert_int_eq(parse(&v, NULL, NULL, NULL, NULL), 0);
		ck_assert(v.verbose);
	}
	clear_env();
	/* A bool takes no separate value: the next argument stays positional. */
	char *pos[4];
	int npos = -1;
	ck_assert_int_eq(parse(&v, NULL, pos, &npos, "--pinned", "0", NULL), 0);
	ck_assert(v.pinned);
	ck_assert_int_eq(npos, 1);
	ck_assert_str_eq(pos[0], "0");
	char *err;
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--verbose=maybe", NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "--verbose"));
	ck_assert_ptr_nonnull(strstr(err, "maybe"));
	free(err);
	setenv("PIPELINE_PROG_PINNED", "sure", 1);
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "PIPELINE_PROG_PINNED"));
	free(err);
}
END_TEST

START_TEST(test_sizes)
{
	clear_env();
	struct values v;
	ck_assert_int_eq(parse(&v, NULL, NULL, NULL, "--dram-budget=1.5GB", NULL), 0);
	ck_assert_uint_eq(v.budget, 1500000000ull);
	ck_assert_int_eq(parse(&v, NULL, NULL, NULL, "--dram-budget", "4096", NULL), 0);
	ck_assert_uint_eq(v.budget, 4096);
	char *err;
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--dram-budget", "lots", NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "--dram-budget"));
	ck_assert_ptr_nonnull(strstr(err, "'lots'"));
	free(err);
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--dram-budget=1e30", NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "--dram-budget"));
	free(err);
}
END_TEST

START_TEST(test_errors)
{
	clear_env();
	struct values v;
	char *err;
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--no-such-flag", NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "unknown flag '--no-such-flag'"));
	free(err);
	/* A prefix of a flag is not the flag. */
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--queue=3", NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "--queue=3"));
	free(err);
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--model", NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "--model needs a value"));
	free(err);
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--queue-depth", "12abc", NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "--queue-depth"));
	ck_assert_ptr_nonnull(strstr(err, "'12abc'"));
	free(err);
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--queue-depth=", NULL), -EINVAL);
	free(err);
	/* Decimal only: a leading zero is not octal, nor 0x hexadecimal. */
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--queue-depth=010", NULL), 0);
	ck_assert_int_eq(v.depth, 10);
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--queue-depth=08", NULL), 0);
	ck_assert_int_eq(v.depth, 8);
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--queue-depth=0x10", NULL), -EINVAL);
	free(err);
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--queue-depth=99999999999999999999", NULL), -EINVAL);
	free(err);
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "--ratio", "half", NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "--ratio"));
	ck_assert_ptr_nonnull(strstr(err, "'half'"));
	free(err);
	/* Without room for positional arguments, one is an error that names it. */
	ck_assert_int_eq(parse(&v, &err, NULL, NULL, "stray", NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "'stray'"));
	free(err);
}
END_TEST

START_TEST(test_help)
{
	clear_env();
	struct values v;
	struct th_capture cap;
	th_capture_begin(&cap, STDOUT_FILENO);
	/* --help wins even after other flags, and stops before a later bad one. */
	int rc = parse(&v, NULL, NULL, NULL, "--verbose", "--help", "--no-such-flag", NULL);
	char *out = th_capture_end(&cap);
	ck_assert_int_eq(rc, 1);
	ck_assert_ptr_nonnull(strstr(out, "usage: prog"));
	ck_assert_ptr_nonnull(strstr(out, "a test program"));
	ck_assert_ptr_nonnull(strstr(out, "--dram-budget SIZE"));
	ck_assert_ptr_nonnull(strstr(out, "PIPELINE_PROG_DRAM_BUDGET"));
	ck_assert_ptr_nonnull(strstr(out, "(default 4GiB)"));
	ck_assert_ptr_nonnull(strstr(out, "--help"));
	free(out);
	th_capture_begin(&cap, STDOUT_FILENO);
	rc = parse(&v, NULL, NULL, NULL, "-h", NULL);
	out = th_capture_end(&cap);
	ck_assert_int_eq(rc, 1);
	ck_assert_ptr_nonnull(strstr(out, "usage: prog"));
	free(out);
}
END_TEST

START_TEST(test_positional)
{
	clear_env();
	struct values v;
	char *pos[8];
	int npos = -1;
	ck_assert_int_eq(parse(&v, NULL, pos, &npos, "first", "--queue-depth", "3", "second", "-x", NULL), 0);
	ck_assert_int_eq(npos, 3);
	ck_assert_str_eq(pos[0], "first");
	ck_assert_str_eq(pos[1], "second");
	ck_assert_str_eq(pos[2], "-x"); /* a single dash is not a flag */
	ck_assert_int_eq(v.depth, 3);
	ck_assert_int_eq(parse(&v, NULL, pos, &npos, NULL), 0);
	ck_assert_int_eq(npos, 0);
}
END_TEST

static Suite *config_suite(void)
{
	Suite *s = suite_create("config");
	TCase *tc = tcase_create("sources");
	tcase_add_test(tc, test_defaults);
	tcase_add_test(tc, test_environment);
	tcase_add_test(tc, test_env_names);
	tcase_add_test(tc, test_flag_beats_env);
	suite_add_tcase(s, tc);
	tc = tcase_create("flags");
	tcase_add_test(tc, test_flag_forms);
	tcase_add_test(tc, test_bools);
	tcase_add_test(tc, test_sizes);
	tcase_add_test(tc, test_positional);
	suite_add_tcase(s, tc);
	tc = tcase_create("errors");
	tcase_add_test(tc, test_errors);
	tcase_add_test(tc, test_help);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(config_suite());
}

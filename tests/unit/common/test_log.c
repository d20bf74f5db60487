/* test_log.c - common/log.c: level parsing, the record format, filtering, long records. */
#include <check.h>
#include <errno.h>
#include <regex.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "tests/unit/common/test_helpers.h"

START_TEST(test_parse_level)
{
	enum log_level l = LOG_ERROR;
	ck_assert_int_eq(log_parse_level("debug", &l), 0);
	ck_assert_int_eq(l, LOG_DEBUG);
	ck_assert_int_eq(log_parse_level("INFO", &l), 0);
	ck_assert_int_eq(l, LOG_INFO);
	ck_assert_int_eq(log_parse_level("warn", &l), 0);
	ck_assert_int_eq(l, LOG_WARN);
	ck_assert_int_eq(log_parse_level("Error", &l), 0);
	ck_assert_int_eq(l, LOG_ERROR);
	ck_assert_int_eq(log_parse_level("verbose", &l), -EINVAL);
	ck_assert_int_eq(log_parse_level("", &l), -EINVAL);
	ck_assert_int_eq(l, LOG_ERROR);
}
END_TEST

START_TEST(test_record_format)
{
	unsetenv("PIPELINE_LOG_LEVEL");
	log_init("unit-test");
	struct th_capture cap;
	th_capture_begin(&cap, STDERR_FILENO);
	log_info("hello %d", 42);
	char *text = th_capture_end(&cap);
	regex_t re;
	ck_assert_int_eq(regcomp(&re,
				 "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z "
				 "unit-test\\[[0-9]+\\] info: hello 42\n$",
				 REG_EXTENDED),
			 0);
	ck_assert_msg(regexec(&re, text, 0, NULL, 0) == 0, "record '%s' does not match the format", text);
	regfree(&re);
	free(text);
}
END_TEST

START_TEST(test_levels_filter)
{
	setenv("PIPELINE_LOG_LEVEL", "warn", 1);
	log_init("unit-test");
	ck_assert_int_eq(log_get_level(), LOG_WARN);
	struct th_capture cap;
	th_capture_begin(&cap, STDERR_FILENO);
	log_debug("d");
	log_info("i");
	log_warn("w");
	log_error("e");
	char *text = th_capture_end(&cap);
	ck_assert_ptr_null(strstr(text, "debug: d"));
	ck_assert_ptr_null(strstr(text, "info: i"));
	ck_assert_ptr_nonnull(strstr(text, "warn: w\n"));
	ck_assert_ptr_nonnull(strstr(text, "error: e\n"));
	free(text);
	/* The level changes at run time. */
	log_set_level(LOG_DEBUG);
	ck_assert_int_eq(log_get_level(), LOG_DEBUG);
	th_capture_begin(&cap, STDERR_FILENO);
	log_debug("d");
	text = th_capture_end(&cap);
	ck_assert_ptr_nonnull(strstr(text, "debug: d\n"));
	free(text);
	/* A bad PIPELINE_LOG_LEVEL leaves the level as it is. */
	setenv("PIPELINE_LOG_LEVEL", "loud", 1);
	log_init("unit-test");
	ck_assert_int_eq(log_get_level(), LOG_DEBUG);
}
END_TEST

START_TEST(test_long_record)
{
	/* A record longer than the buffer is cut but still ends in one newline. */
	unsetenv("PIPELINE_LOG_LEVEL");
	log_init("a-service-name-that-is-longer-than-thirty-two-bytes");
	char *big = malloc(5000);
	memset(big, 'x', 4999);
	big[4999] = 0;
	struct th_capture cap;
	th_capture_begin(&cap, STDERR_FILENO);
	log_error("%s", big);
	char *text = th_capture_end(&cap);
	size_t n = strlen(text);
	ck_assert_uint_gt(n, 100);
	ck_assert_uint_le(n, 1024);
	ck_assert_int_eq(text[n - 1], '\n');
	ck_assert_ptr_eq(strchr(text, '\n'), text + n - 1);
	free(text);
	free(big);
}
END_TEST

static Suite *log_suite(void)
{
	Suite *s = suite_create("log");
	TCase *tc = tcase_create("levels");
	tcase_add_test(tc, test_parse_level);
	tcase_add_test(tc, test_levels_filter);
	suite_add_tcase(s, tc);
	tc = tcase_create("records");
	tcase_add_test(tc, test_record_format);
	tcase_add_test(tc, test_long_record);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(log_suite());
}

/* test_metrics.c - http-api's counters and their Prometheus text (services/http-api/metrics.c):
 * requests counted by endpoint and status (an unknown path as "other"), tokens and the other
 * counters, cumulative histogram buckets with +Inf, _sum and _count, the instance's series taken
 * from stats JSON (nested fields, booleans, milliseconds as seconds; none and up 0 without it),
 * the exposition's shape (every sample line "name{labels} value" of a metric with a TYPE), and
 * counts from several threads at once. */
#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "services/http-api/metrics.h"
#include "tests/unit/common/test_helpers.h"

static char *render(struct metrics *m, const struct metrics_gauges *g, const char *runner, const char *loader)
{
	char *text = NULL;
	size_t len = 0;
	ck_assert_int_eq(metrics_render(m, g, runner, loader, &text, &len), 0);
	ck_assert_ptr_nonnull(text);
	ck_assert_uint_eq(strlen(text), len);
	return text;
}

/* The value of the sample line "series value", or -1 when there is none. */
static double value_of(const char *text, const char *series)
{
	size_t n = strlen(series);
	for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
		if (!strncmp(p, series, n) && p[n] == ' ')
			return strtod(p + n + 1, NULL);
	}
	return -1;
}

static bool name_char(char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == ':';
}

/* Every line is a # HELP, a # TYPE, or "name{labels} value" of a metric whose TYPE came before. */
static void check_shape(const char *text)
{
	char typed[8192] = " ";
	const char *p = text;
	ck_assert_msg(*p && text[strlen(text) - 1] == '\n', "the text does not end with a newline");
	while (*p) {
		const char *end = strchr(p, '\n');
		ck_assert_ptr_nonnull(end);
		char line[512];
		size_t n = (size_t)(end - p);
		ck_assert_uint_lt(n, sizeof(line));
		memcpy(line, p, n);
		line[n] = 0;
		p = end + 1;
		char name[256], type[32];
		if (!strncmp(line, "# HELP ", 7))
			continue;
		if (!strncmp(line, "# TYPE ", 7)) {
			ck_assert_int_eq(sscanf(line + 7, "%255s %31s", name, type), 2);
			ck_assert_msg(!strcmp(type, "counter") || !strcmp(type, "gauge") || !strcmp(type, "histogram"),
				      "type %s", type);
			ck_assert_uint_lt(strlen(typed) + strlen(name) + 2, sizeof(typed));
			strcat(typed, name);
			strcat(typed, " ");
			continue;
		}
		size_t k = 0;
		while (name_char(line[k]))
			k++;
		ck_assert_msg(k > 0 && k < sizeof(name), "no metric name: '%s'", line);
		memcpy(name, line, k);
		name[k] = 0;
		const char *rest = line + k;
		if (*rest == '{') {
			const char *close = strchr(rest, '}');
			ck_assert_msg(close, "labels not closed: '%s'", line);
			rest = close + 1;
		}
		ck_assert_msg(*rest == ' ', "no space before the value: '%s'", line);
		char *vend;
		strtod(rest + 1, &vend);
		ck_assert_msg(vend != rest + 1 && *vend == 0, "not a number: '%s'", line);
		/* A histogram's series: its name less _bucket, _sum, _count. */
		char base[256], key[260];
		snprintf(base, sizeof(base), "%s", name);
		snprintf(key, sizeof(key), " %s ", base);
		if (!strstr(typed, key)) {
			static const char *const sfx[] = {"_bucket", "_sum", "_count"};
			for (size_t i = 0; i < 3; i++) {
				size_t bl = strlen(base), sl = strlen(sfx[i]);
				if (bl > sl && !strcmp(base + bl - sl, sfx[i])) {
					base[bl - sl] = 0;
					break;
				}
			}
			snprintf(key, sizeof(key), " %s ", base);
		}
		ck_assert_msg(strstr(typed, key), "no # TYPE before '%s'", line);
	}
}

START_TEST(counters)
{
	struct metrics *m = metrics_create();
	ck_assert_ptr_nonnull(m);
	metrics_request(m, "/v1/completions", 200, 0.5);
	metrics_request(m, "/v1/completions", 200, 0.02);
	metrics_request(m, "/v1/completions", 429, 0.001);
	metrics_request(m, "/v1/nothing", 404, 0.001);
	metrics_request(m, NULL, 404, 0.001);
	metrics_request(m, "/metrics", 200, 0.001);
	metrics_request(m, "/health", 700, 0.001);
	metrics_tokens(m, 5, 12);
	metrics_tokens(m, 3, 4);
	metrics_queue_rejected(m);
	metrics_cancelled(m);
	metrics_cancelled(m);
	metrics_runner_error(m);
	struct metrics_gauges g = {.queue_depth = 3, .in_flight = 1};
	char *t = render(m, &g, NULL, NULL);
	check_shape(t);
	ck_assert(value_of(t, "pipeline_http_requests_total{endpoint=\"/v1/completions\",status=\"200\"}") == 2);
	ck_assert(value_of(t, "pipeline_http_requests_total{endpoint=\"/v1/completions\",status=\"429\"}") == 1);
	ck_assert(value_of(t, "pipeline_http_requests_total{endpoint=\"other\",status=\"404\"}") == 2);
	ck_assert(value_of(t, "pipeline_http_requests_total{endpoint=\"/metrics\",status=\"200\"}") == 1);
	ck_assert(value_of(t, "pipeline_http_requests_total{endpoint=\"/health\",status=\"0\"}") == 1);
	ck_assert(value_of(t, "pipeline_http_requests_total{endpoint=\"/v1/models\",status=\"200\"}") == -1);
	ck_assert(value_of(t, "pipeline_http_prompt_tokens_total") == 8);
	ck_assert(value_of(t, "pipeline_http_generated_tokens_total") == 16);
	ck_assert(value_of(t, "pipeline_http_queue_rejected_total") == 1);
	ck_assert(value_of(t, "pipeline_http_cancelled_total") == 2);
	ck_assert(value_of(t, "pipeline_http_runner_errors_total") == 1);
	ck_assert(value_of(t, "pipeline_http_queue_depth") == 3);
	ck_assert(value_of(t, "pipeline_http_in_flight") == 1);
	ck_assert(value_of(t, "pipeline_http_runner_stats_up") == 0);
	ck_assert(value_of(t, "pipeline_http_loader_stats_up") == 0);
	ck_assert_ptr_null(strstr(t, "pipeline_http_runner_requests_total"));
	ck_assert_ptr_nonnull(strstr(t, "# TYPE pipeline_http_requests_total counter\n"));
	ck_assert_ptr_nonnull(strstr(t, "# TYPE pipeline_http_queue_depth gauge\n"));
	/* The durations: 7 requests, 0.5 s and 0.02 s and five of 0.001 s. */
	ck_assert(value_of(t, "pipeline_http_request_duration_seconds_bucket{le=\"0.005\"}") == 5);
	ck_assert(value_of(t, "pipeline_http_request_duration_seconds_bucket{le=\"0.025\"}") == 6);
	ck_assert(value_of(t, "pipeline_http_request_duration_seconds_bucket{le=\"0.25\"}") == 6);
	ck_assert(value_of(t, "pipeline_http_request_duration_seconds_bucket{le=\"0.5\"}") == 7);
	ck_assert(value_of(t, "pipeline_http_request_duration_seconds_bucket{le=\"+Inf\"}") == 7);
	ck_assert(value_of(t, "pipeline_http_request_duration_seconds_count") == 7);
	double sum = value_of(t, "pipeline_http_request_duration_seconds_sum");
	ck_assert_msg(sum > 0.5249 && sum < 0.5251, "sum %g", sum);
	/* No first token yet: the histogram is there, empty. */
	ck_assert(value_of(t, "pipeline_http_time_to_first_token_seconds_count") == 0);
	ck_assert(value_of(t, "pipeline_http_time_to_first_token_seconds_bucket{le=\"+Inf\"}") == 0);
	free(t);
	metrics_destroy(&m);
	ck_assert_ptr_null(m);
	metrics_destroy(&m);
}
END_TEST

START_TEST(first_token_histogram)
{
	struct metrics *m = metrics_create();
	metrics_first_token(m, 0.07);
	metrics_first_token(m, 0.1); /* on a bound: in it (le) */
	metrics_first_token(m, 100);
	metrics_first_token(m, -1); /* a clock that went back counts as 0 */
	char *t = render(m, NULL, NULL, NULL);
	check_shape(t);
	ck_assert(value_of(t, "pipeline_http_time_to_first_token_seconds_bucket{le=\"0.05\"}") == 1);
	ck_assert(value_of(t, "pipeline_http_time_to_first_token_seconds_bucket{le=\"0.1\"}") == 3);
	ck_assert(value_of(t, "pipeline_http_time_to_first_token_seconds_bucket{le=\"60\"}") == 3);
	ck_assert(value_of(t, "pipeline_http_time_to_first_token_seconds_bucket{le=\"+Inf\"}") == 4);
	ck_assert(value_of(t, "pipeline_http_time_to_first_token_seconds_count") == 4);
	double sum = value_of(t, "pipeline_http_time_to_first_token_seconds_sum");
	ck_assert_msg(sum > 100.169 && sum < 100.171, "sum %g", sum);
	ck_assert(value_of(t, "pipeline_http_queue_depth") == 0);
	free(t);
	metrics_destroy(&m);
}
END_TEST

START_TEST(instance_series)
{
	struct metrics *m = metrics_create();
	const char *runner = "{\"backend\": \"cpu\", \"requests\": 4, \"tokens_generated\": 77, \"prefill_ms\": 1500, "
			     "\"weights_all_resident\": true, \"gpu_window\": {\"bytes_h2d\": 123456789012, "
			     "\"resident_bytes\": 4096, \"experts_passed\": 9}, \"cpu_share\": {\"bytes\": \"x\"}}";
	const char *loader = "{\"bytes_read\": 1048576, \"all_resident\": false, \"disk_read_seconds\": 0.25}";
	char *t = render(m, NULL, runner, loader);
	check_shape(t);
	ck_assert(value_of(t, "pipeline_http_runner_stats_up") == 1);
	ck_assert(value_of(t, "pipeline_http_loader_stats_up") == 1);
	ck_assert(value_of(t, "pipeline_http_runner_requests_total") == 4);
	ck_assert(value_of(t, "pipeline_http_runner_generated_tokens_total") == 77);
	ck_assert(value_of(t, "pipeline_http_runner_prefill_seconds_total") == 1.5);
	ck_assert(value_of(t, "pipeline_http_runner_weights_all_resident") == 1);
	ck_assert_ptr_nonnull(strstr(t, "\npipeline_http_runner_gpu_window_bytes_h2d_total 123456789012\n"));
	ck_assert(value_of(t, "pipeline_http_runner_gpu_window_resident_bytes") == 4096);
	ck_assert(value_of(t, "pipeline_http_runner_gpu_window_experts_passed_total") == 9);
	ck_assert_ptr_nonnull(strstr(t, "# TYPE pipeline_http_runner_gpu_window_bytes_h2d_total counter\n"));
	ck_assert_ptr_nonnull(strstr(t, "# TYPE pipeline_http_runner_gpu_window_resident_bytes gauge\n"));
	/* Fields it did not send, or not numbers: no series. */
	ck_assert_ptr_null(strstr(t, "pipeline_http_runner_gpu_window_copies_total"));
	ck_assert_ptr_null(strstr(t, "pipeline_http_runner_cpu_share_bytes_total"));
	ck_assert_ptr_null(strstr(t, "pipeline_http_runner_failures_total"));
	ck_assert(value_of(t, "pipeline_http_loader_disk_bytes_read_total") == 1048576);
	ck_assert(value_of(t, "pipeline_http_loader_all_resident") == 0);
	ck_assert(value_of(t, "pipeline_http_loader_disk_busy_seconds_total") == 0.25);
	free(t);
	/* Text that is not a JSON object: as if none came. */
	t = render(m, NULL, "[1, 2]", "{not json");
	check_shape(t);
	ck_assert(value_of(t, "pipeline_http_runner_stats_up") == 0);
	ck_assert(value_of(t, "pipeline_http_loader_stats_up") == 0);
	ck_assert_ptr_null(strstr(t, "pipeline_http_loader_disk_bytes_read_total"));
	free(t);
	metrics_destroy(&m);
}
END_TEST

#define THREADS 4
#define PER_THREAD 20000

static void *hammer(void *arg)
{
	struct metrics *m = arg;
	for (int i = 0; i < PER_THREAD; i++) {
		metrics_request(m, "/v1/chat/completions", 200, 0.001);
		metrics_tokens(m, 1, 2);
		metrics_cancelled(m);
	}
	return NULL;
}

START_TEST(threads)
{
	struct metrics *m = metrics_create();
	pthread_t t[THREADS];
	for (int i = 0; i < THREADS; i++)
		ck_assert_int_eq(pthread_create(&t[i], NULL, hammer, m), 0);
	for (int i = 0; i < THREADS; i++)
		pthread_join(t[i], NULL);
	char *text = render(m, NULL, NULL, NULL);
	ck_assert(value_of(text, "pipeline_http_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"}") ==
		  THREADS * PER_THREAD);
	ck_assert(value_of(text, "pipeline_http_prompt_tokens_total") == THREADS * PER_THREAD);
	ck_assert(value_of(text, "pipeline_http_generated_tokens_total") == 2 * THREADS * PER_THREAD);
	ck_assert(value_of(text, "pipeline_http_cancelled_total") == THREADS * PER_THREAD);
	ck_assert(value_of(text, "pipeline_http_request_duration_seconds_count") == THREADS * PER_THREAD);
	free(text);
	metrics_destroy(&m);
}
END_TEST

static Suite *metrics_suite(void)
{
	Suite *s = suite_create("http_api_metrics");
	TCase *tc = tcase_create("metrics");
	tcase_add_test(tc, counters);
	tcase_add_test(tc, first_token_histogram);
	tcase_add_test(tc, instance_series);
	tcase_add_test(tc, threads);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(metrics_suite());
}

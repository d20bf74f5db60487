/* metrics.h - http-api's counters and their Prometheus text exposition (GET /metrics).
 *
 *   struct metrics *m = metrics_create();
 *   metrics_request(m, "/v1/completions", 200, seconds);   // every answered request
 *   metrics_tokens(m, n_prompt, n_generated);              // a generation that completed
 *   ...
 *   char *text; size_t len;
 *   metrics_render(m, &gauges, runner_json, loader_json, &text, &len);   // free(text)
 *   metrics_destroy(&m);
 *
 * Every function but metrics_destroy may be called from any thread at once (one mutex). The
 * names all begin with pipeline_http_; each metric has its # HELP and # TYPE lines. The
 * instance's series (pipeline_http_runner_*, pipeline_http_loader_*) are a fixed handful of the
 * numeric fields of gpu-runner's and ssd-loader's MSG_STATS JSON (what `pipectl stats SERVICE`
 * prints), taken as the caller fetched them at scrape time; a field the service does not report
 * (gpu_window on a build without CUDA) gives no series. */
#ifndef HTTP_API_METRICS_H
#define HTTP_API_METRICS_H
#include <stddef.h>
#include <stdint.h>

/* The Content-Type of the exposition. */
#define METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

struct metrics;

/* The gauges read at scrape time. */
struct metrics_gauges {
	long queue_depth; /* requests waiting for the runner */
	int in_flight;	  /* generations running */
	uint64_t resumes; /* requests resumed on a new runner after theirs died (a counter kept elsewhere) */
};

/* A new set of counters at zero, or NULL (out of memory). */
struct metrics *metrics_create(void);

/* Frees it. *m is NULL after; safe on NULL. */
void metrics_destroy(struct metrics **m);

/* Counts one request answered with status (100..599; others are counted as 0) on endpoint (one of
 * /health, /metrics, /v1/models, /v1/completions, /v1/chat/completions; anything else counts as
 * "other"), and its duration in seconds. */
void metrics_request(struct metrics *m, const char *endpoint, unsigned status, double seconds);

/* Adds the tokens of a generation that completed (its usage). */
void metrics_tokens(struct metrics *m, uint64_t n_prompt, uint64_t n_generated);

/* Observes a time to first token in seconds (from the request's arrival). */
void metrics_first_token(struct metrics *m, double seconds);

/* Counts a request refused for a full queue (429). */
void metrics_queue_rejected(struct metrics *m);

/* Counts a client that went away before its generation ended (it was cancelled). */
void metrics_cancelled(struct metrics *m);

/* Counts a generation that failed on the runner's side (5xx: no runner, it died, it failed). */
void metrics_runner_error(struct metrics *m);

/* Formats every metric in the text exposition format 0.0.4 into a malloc'd, NUL-terminated
 * *text of *len bytes. runner_json and loader_json: gpu-runner's and ssd-loader's stats objects,
 * or NULL when they could not be had (pipeline_http_runner_stats_up / _loader_stats_up are then 0
 * and their series left out; so too for text that is not a JSON object). Returns 0 or -ENOMEM. */
int metrics_render(struct metrics *m, const struct metrics_gauges *g, const char *runner_json, const char *loader_json,
		   char **text, size_t *len);

#endif

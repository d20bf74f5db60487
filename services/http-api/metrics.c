/* metrics.c - http-api's counters and their Prometheus text exposition (metrics.h).
 *
 * Requests are counted in a table of endpoint x status; the two histograms have fixed buckets
 * (seconds), rendered cumulative as Prometheus wants, with le="+Inf", _sum and _count. The
 * instance's series come from a fixed table of JSON fields of the services' stats. */
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "services/http-api/metrics.h"

static const char *const endpoints[] = {
	"/health", "/metrics", "/v1/models", "/v1/models/:model", "/v1/completions", "/v1/chat/completions", "other",
};
#define N_ENDPOINTS ARRAY_SIZE(endpoints)
#define N_STATUS 600

static const double ttft_bounds[] = {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
static const double duration_bounds[] = {0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
#define MAX_BUCKETS 16

struct histogram {
	const double *bounds;
	size_t n;		      /* bounds */
	uint64_t counts[MAX_BUCKETS]; /* per bucket, not cumulative; counts[n]: above the last bound */
	uint64_t count;
	double sum;
};

struct metrics {
	pthread_mutex_t lock;
	uint64_t requests[N_ENDPOINTS][N_STATUS];
	uint64_t prompt_tokens, generated_tokens, rejected, cancelled, runner_errors;
	struct histogram ttft, duration;
};

struct metrics *metrics_create(void)
{
	struct metrics *m = calloc(1, sizeof(*m));
	if (!m)
		return NULL;
	pthread_mutex_init(&m->lock, NULL);
	m->ttft.bounds = ttft_bounds;
	m->ttft.n = ARRAY_SIZE(ttft_bounds);
	m->duration.bounds = duration_bounds;
	m->duration.n = ARRAY_SIZE(duration_bounds);
	return m;
}

void metrics_destroy(struct metrics **mp)
{
	struct metrics *m = *mp;
	if (!m)
		return;
	pthread_mutex_destroy(&m->lock);
	free(m);
	*mp = NULL;
}

static void observe_locked(struct histogram *h, double v)
{
	if (!(v >= 0))
		v = 0;
	size_t i = 0;
	while (i < h->n && v > h->bounds[i])
		i++;
	h->counts[i]++;
	h->count++;
	h->sum += v;
}

void metrics_request(struct metrics *m, const char *endpoint, unsigned status, double seconds)
{
	size_t e = N_ENDPOINTS - 1;
	for (size_t i = 0; endpoint && i + 1 < N_ENDPOINTS; i++)
		if (!strcmp(endpoint, endpoints[i]))
			e = i;
	if (status < 100 || status >= N_STATUS)
		status = 0;
	pthread_mutex_lock(&m->lock);
	m->requests[e][status]++;
	observe_locked(&m->duration, seconds);
	pthread_mutex_unlock(&m->lock);
}

void metrics_tokens(struct metrics *m, uint64_t n_prompt, uint64_t n_generated)
{
	pthread_mutex_lock(&m->lock);
	m->prompt_tokens += n_prompt;
	m->generated_tokens += n_generated;
	pthread_mutex_unlock(&m->lock);
}

void metrics_first_token(struct metrics *m, double seconds)
{
	pthread_mutex_lock(&m->lock);
	observe_locked(&m->ttft, seconds);
	pthread_mutex_unlock(&m->lock);
}

static void bump(struct metrics *m, uint64_t *counter)
{
	pthread_mutex_lock(&m->lock);
	(*counter)++;
	pthread_mutex_unlock(&m->lock);
}

void metrics_queue_rejected(struct metrics *m)
{
	bump(m, &m->rejected);
}

void metrics_cancelled(struct metrics *m)
{
	bump(m, &m->cancelled);
}

void metrics_runner_error(struct metrics *m)
{
	bump(m, &m->runner_errors);
}

/* ---- the text ---- */

struct out {
	char *p;
	size_t len, cap;
	bool oom;
};

static void put(struct out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(struct out *o, const char *fmt, ...)
{
	if (o->oom)
		return;
	for (;;) {
		va_list ap;
		va_start(ap, fmt);
		int n = vsnprintf(o->p ? o->p + o->len : NULL, o->p ? o->cap - o->len : 0, fmt, ap);
		va_end(ap);
		if (n < 0) {
			o->oom = true;
			return;
		}
		if (o->p && o->len + (size_t)n < o->cap) {
			o->len += (size_t)n;
			return;
		}
		size_t cap = o->cap ? o->cap : 8192;
		while (cap <= o->len + (size_t)n)
			cap *= 2;
		char *t = realloc(o->p, cap);
		if (!t) {
			o->oom = true;
			return;
		}
		o->p = t;
		o->cap = cap;
	}
}

static void head(struct out *o, const char *name, const char *type, const char *help)
{
	put(o, "# HELP pipeline_http_%s %s\n# TYPE pipeline_http_%s %s\n", name, help, name, type);
}

static void scalar(struct out *o, const char *name, const char *type, const char *help, uint64_t v)
{
	head(o, name, type, help);
	put(o, "pipeline_http_%s %llu\n", name, (unsigned long long)v);
}

static void histogram(struct out *o, const char *name, const char *help, const struct histogram *h)
{
	head(o, name, "histogram", help);
	uint64_t cum = 0;
	for (size_t i = 0; i < h->n; i++) {
		cum += h->counts[i];
		put(o, "pipeline_http_%s_bucket{le=\"%g\"} %llu\n", name, h->bounds[i], (unsigned long long)cum);
	}
	put(o, "pipeline_http_%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)h->count);
	put(o, "pipeline_http_%s_sum %.9g\n", name, h->sum);
	put(o, "pipeline_http_%s_count %llu\n", name, (unsigned long long)h->count);
}

/* One series of the instance: a field of a service's stats (path: "a" or "a.b"). */
struct tier_field {
	const char *path, *name, *type, *help;
	double scale; /* 0: 1 */
};

static const struct tier_field runner_fields[] = {
	{"requests", "runner_requests_total", "counter", "Generations gpu-runner served.", 0},
	{"failures", "runner_failures_total", "counter", "Generations gpu-runner failed.", 0},
	{"prompt_tokens", "runner_prompt_tokens_total", "counter", "Prompt tokens gpu-runner prefilled.", 0},
	{"tokens_generated", "runner_generated_tokens_total", "counter", "Tokens gpu-runner generated.", 0},
	{"prefill_ms", "runner_prefill_seconds_total", "counter", "Seconds gpu-runner spent in prefill.", 1e-3},
	{"decode_ms", "runner_decode_seconds_total", "counter", "Seconds gpu-runner spent in decode.", 1e-3},
	{"last_decode_tok_s", "runner_last_decode_tokens_per_second", "gauge",
	 "Decode speed of gpu-runner's last generation.", 0},
	{"weight_bytes_acquired", "runner_weight_bytes_acquired_total", "counter",
	 "Weight bytes gpu-runner acquired from the loader's ring.", 0},
	{"weight_acquires", "runner_weight_acquires_total", "counter", "Weight groups gpu-runner acquired.", 0},
	{"weights_all_resident", "runner_weights_all_resident", "gauge", "1 when every weight stays resident.", 0},
	{"kv_blocks_committed", "runner_kv_blocks_committed_total", "counter", "KV blocks committed to kv-store.", 0},
	{"kv_blocks_fetched", "runner_kv_blocks_fetched_total", "counter", "KV blocks fetched from kv-store.", 0},
	{"gpu_window.resident_bytes", "runner_gpu_window_resident_bytes", "gauge",
	 "Weight bytes resident in GPU memory.", 0},
	{"gpu_window.window_bytes", "runner_gpu_window_bytes", "gauge", "GPU memory of the streaming window.", 0},
	{"gpu_window.streamed_bytes_per_token", "runner_gpu_window_streamed_bytes_per_token", "gauge",
	 "Weight bytes streamed to the GPU per decode token.", 0},
	{"gpu_window.bytes_h2d", "runner_gpu_window_bytes_h2d_total", "counter",
	 "Weight bytes copied host to device.", 0},
	{"gpu_window.copies", "runner_gpu_window_copies_total", "counter", "Weight copies host to device.", 0},
	{"gpu_window.late_copies", "runner_gpu_window_late_copies_total", "counter",
	 "Weight copies the compute waited for.", 0},
	{"gpu_window.experts_passed", "runner_gpu_window_experts_passed_total", "counter",
	 "Experts the router did not pick, not copied.", 0},
	{"cpu_share.bytes", "runner_cpu_share_bytes_total", "counter", "Weight bytes the CPU's share computed.", 0},
};

static const struct tier_field loader_fields[] = {
	{"bytes_read", "loader_disk_bytes_read_total", "counter", "Bytes ssd-loader read from disk.", 0},
	{"reads_done", "loader_disk_reads_total", "counter", "Disk reads ssd-loader completed.", 0},
	{"disk_read_seconds", "loader_disk_busy_seconds_total", "counter", "Seconds ssd-loader's disk reads were busy.",
	 0},
	{"reads_pending", "loader_disk_reads_pending", "gauge", "Disk reads in flight.", 0},
	{"disk_bytes_per_token", "loader_disk_bytes_per_token", "gauge", "Bytes a decode token reads from disk.", 0},
	{"groups_loaded", "loader_groups_loaded_total", "counter", "Weight groups ssd-loader loaded.", 0},
	{"groups_streamed", "loader_groups_streamed_total", "counter", "Weight groups streamed (not resident).", 0},
	{"grants", "loader_grants_total", "counter", "Weight groups granted to gpu-runner.", 0},
	{"waits", "loader_waits_total", "counter", "Acquires that waited for a load.", 0},
	{"ring_bytes", "loader_ring_bytes", "gauge", "Bytes of the shared weight ring.", 0},
	{"model_bytes", "loader_model_bytes", "gauge", "Bytes of the model's tensors.", 0},
	{"all_resident", "loader_all_resident", "gauge", "1 when the whole model fits the ring.", 0},
};

static json_t *field_at(json_t *root, const char *path)
{
	char key[64];
	const char *dot = strchr(path, '.');
	if (!dot)
		return json_object_get(root, path);
	size_t n = (size_t)(dot - path);
	if (n >= sizeof(key))
		return NULL;
	memcpy(key, path, n);
	key[n] = 0;
	return json_object_get(json_object_get(root, key), dot + 1);
}

static void tier(struct out *o, const char *up_name, const char *up_help, const struct tier_field *f, size_t n,
		 const char *json)
{
	json_t *root = json ? json_loads(json, 0, NULL) : NULL;
	if (root && !json_is_object(root)) {
		json_decref(root);
		root = NULL;
	}
	head(o, up_name, "gauge", up_help);
	put(o, "pipeline_http_%s %d\n", up_name, root ? 1 : 0);
	for (size_t i = 0; root && i < n; i++) {
		json_t *v = field_at(root, f[i].path);
		double scale = f[i].scale ? f[i].scale : 1;
		if (json_is_boolean(v)) {
			head(o, f[i].name, f[i].type, f[i].help);
			put(o, "pipeline_http_%s %d\n", f[i].name, json_is_true(v) ? 1 : 0);
		} else if (json_is_integer(v) && scale == 1) {
			head(o, f[i].name, f[i].type, f[i].help);
			put(o, "pipeline_http_%s %lld\n", f[i].name, (long long)json_integer_value(v));
		} else if (json_is_number(v)) {
			head(o, f[i].name, f[i].type, f[i].help);
			put(o, "pipeline_http_%s %.9g\n", f[i].name, json_number_value(v) * scale);
		}
	}
	json_decref(root);
}

int metrics_render(struct metrics *m, const struct metrics_gauges *g, const char *runner_json, const char *loader_json,
		   char **text, size_t *len)
{
	struct metrics *c = malloc(sizeof(*c));
	if (!c)
		return -ENOMEM;
	pthread_mutex_lock(&m->lock);
	memcpy(c, m, sizeof(*c));
	pthread_mutex_unlock(&m->lock);

	struct out o = {0};
	head(&o, "requests_total", "counter", "HTTP requests answered, by endpoint and status.");
	for (size_t e = 0; e < N_ENDPOINTS; e++)
		for (unsigned s = 0; s < N_STATUS; s++)
			if (c->requests[e][s])
				put(&o, "pipeline_http_requests_total{endpoint=\"%s\",status=\"%u\"} %llu\n",
				    endpoints[e], s, (unsigned long long)c->requests[e][s]);
	scalar(&o, "prompt_tokens_total", "counter", "Prompt tokens of the generations that completed.",
	       c->prompt_tokens);
	scalar(&o, "generated_tokens_total", "counter", "Tokens generated by the generations that completed.",
	       c->generated_tokens);
	head(&o, "queue_depth", "gauge", "Requests waiting for the runner.");
	put(&o, "pipeline_http_queue_depth %ld\n", g ? g->queue_depth : 0);
	head(&o, "in_flight", "gauge", "Requests the runner generates for now.");
	put(&o, "pipeline_http_in_flight %d\n", g ? g->in_flight : 0);
	scalar(&o, "queue_rejected_total", "counter", "Requests refused with 429: the queue was full.", c->rejected);
	scalar(&o, "resumes_total", "counter",
	       "Requests sent again to a new gpu-runner, with the tokens already streamed, after theirs died.",
	       g ? g->resumes : 0);
	scalar(&o, "cancelled_total", "counter", "Generations cancelled because their client went away.",
	       c->cancelled);
	scalar(&o, "runner_errors_total", "counter", "Generations that failed on the runner's side (5xx).",
	       c->runner_errors);
	histogram(&o, "time_to_first_token_seconds", "Seconds from a request's arrival to its first token.", &c->ttft);
	histogram(&o, "request_duration_seconds", "Seconds from a request's arrival to the end of its response.",
		  &c->duration);
	free(c);
	tier(&o, "runner_stats_up", "1 when gpu-runner's stats were had for this scrape.", runner_fields,
	     ARRAY_SIZE(runner_fields), runner_json);
	tier(&o, "loader_stats_up", "1 when ssd-loader's stats were had for this scrape.", loader_fields,
	     ARRAY_SIZE(loader_fields), loader_json);
	if (o.oom || !o.p) {
		free(o.p);
		return -ENOMEM;
	}
	*text = o.p;
	*len = o.len;
	return 0;
}

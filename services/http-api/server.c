/* server.c - the HTTP plumbing of http-api on libmicrohttpd (server.h).
 *
 * libmicrohttpd runs a thread per connection, so a handler may block: a generation's handler
 * waits for its job in the runner queue (runner_client.h), and a stream's reader waits for the
 * next text. A request is checked before its body is read: a length two readers could take
 * differently (Content-Length twice, or beside Transfer-Encoding: 400, the connection closed), the
 * path (404), the method (405), the bearer token (401), a Content-Length over --max-body (413); a
 * body without one that grows past the limit is dropped as it comes and answered 413 at its end.
 *
 * A streamed generation answers only once its first token is in (or it failed: then with the
 * error's status, as a request that does not stream); from there on, server-sent events
 * "data: {chunk}\n\n" and "data: [DONE]\n\n" to end. A failure after the first token becomes
 * one "data: {"error": ...}" event. A client that goes away ends the response: its job is
 * released, which cancels the generation (runner_job_release).
 *
 * GET /metrics (metrics.h) needs no key, as /health: every request is counted when libmicrohttpd
 * says it is done with it (on_completed), under the status its response was queued with, which
 * the handler's thread leaves in queued_status (libmicrohttpd runs a connection's calls on its
 * thread). The instance's stats are asked at scrape time with sockets of their own and a short
 * timeout, never through the worker's connection. */
#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

#include "common/log.h"
#include "common/util.h"
#include "services/http-api/metrics.h"
#include "services/http-api/server.h"

#define STREAM_BLOCK 4096 /* bytes libmicrohttpd asks a stream's reader for at most */
#define STATS_TIMEOUT_MS 1000 /* the longest a scrape waits for a service's stats */
#define MODEL_PATH "/v1/models/"  /* GET MODEL_PATH{model}: one model */

/* --cors-origin: the Access-Control-Allow-Origin of every answer; NULL: none. Set once, before
 * the daemon's threads start (server_start). */
static const char *cors_origin;

/* The status of the response this thread queued last (see on_request). */
static _Thread_local unsigned queued_status;
/* This thread's request ended because its client went away (client_left): libmicrohttpd's
 * "internal error" for the MHD_NO that closes it is no error (on_mhd_log). */
static _Thread_local bool closed_for_client;

struct server {
	struct server_config cfg;
	struct MHD_Daemon *d;
	uint16_t port;
	pthread_mutex_t lock;
	char model[256]; /* the model's name, once known */
	struct metrics *metrics;
};

enum route { R_NONE, R_HEALTH, R_METRICS, R_MODELS, R_MODEL, R_COMPLETIONS, R_CHAT };

/* One request: its route and body. */
struct request_state {
	enum route route;
	char *body;
	size_t len, cap;
	bool too_big;
	bool answered;	      /* a response was queued before the body was read */
	uint64_t start_ns;    /* when the request came */
	unsigned status;      /* the status its response was queued with; 0: none yet */
	const char *endpoint; /* its path for the metrics, or "other" */
	bool deferred;	      /* no body: answered at the request's last call (see on_request) */
};

/* A streamed generation, the reader callback's state. */
struct stream {
	struct server *s;
	struct runner_job *job;
	struct api_request req;
	struct api_stop_filter filter;
	char id[64], model[256];
	int64_t created;
	size_t have_len;
	uint64_t have_tokens;
	bool role_sent, finished;
	bool held;		     /* text taken in before the reader's first wait, not yet given out */
	bool limit_off;		     /* the idle limit is off: the reader waits on the model */
	struct MHD_Connection *conn; /* its connection, whose idle limit the reader turns off and on */
	char *out; /* formatted events not yet handed to libmicrohttpd */
	size_t out_len, out_pos, out_cap;
};

/* ---- replies ---- */

static enum MHD_Result queue_response(struct MHD_Connection *c, unsigned status, struct MHD_Response *r)
{
	if (cors_origin) {
		MHD_add_response_header(r, "Access-Control-Allow-Origin", cors_origin);
		if (strcmp(cors_origin, "*"))
			MHD_add_response_header(r, "Vary", "Origin");
	}
	enum MHD_Result ret = MHD_queue_response(c, status, r);
	if (ret == MHD_YES)
		queued_status = status;
	return ret;
}

/* Sends text (taken) with status; allow: an Allow header; close: the connection is closed after
 * it (its request's framing cannot be trusted). */
static enum MHD_Result send_text_as(struct MHD_Connection *c, unsigned status, const char *type, char *text,
				    const char *allow, bool close)
{
	struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
	if (!r) {
		free(text);
		return MHD_NO;
	}
	MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
	if (allow)
		MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
	if (close)
		MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
	enum MHD_Result ret = queue_response(c, status, r);
	MHD_destroy_response(r);
	return ret;
}

static enum MHD_Result send_text(struct MHD_Connection *c, unsigned status, const char *type, char *text,
				 const char *allow)
{
	return send_text_as(c, status, type, text, allow, false);
}

/* Sends o (a reference taken) as the JSON body of a reply with status. */
static enum MHD_Result send_json_as(struct MHD_Connection *c, unsigned status, json_t *o, const char *allow,
				    bool close)
{
	char *text = o ? json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
	json_decref(o);
	if (!text)
		return MHD_NO;
	size_t n = strlen(text);
	char *t = realloc(text, n + 2);
	if (!t) {
		free(text);
		return MHD_NO;
	}
	t[n] = '\n';
	t[n + 1] = 0;
	return send_text_as(c, status, "application/json", t, allow, close);
}

static enum MHD_Result send_json(struct MHD_Connection *c, unsigned status, json_t *o, const char *allow)
{
	return send_json_as(c, status, o, allow, false);
}

static const char *error_type(unsigned status)
{
	switch (status) {
	case 401:
		return "authentication_error";
	case 429:
		return "rate_limit_error";
	case 500:
	case 503:
		return "server_error";
	default:
		return "invalid_request_error";
	}
}

static const char *error_code(unsigned status)
{
	switch (status) {
	case 401:
		return "invalid_api_key";
	case 404:
		return "not_found";
	case 405:
		return "method_not_allowed";
	case 413:
		return "request_too_large";
	case 429:
		return "queue_full";
	case 503:
		return "runner_unavailable";
	default:
		return NULL;
	}
}

static enum MHD_Result send_error(struct MHD_Connection *c, unsigned status, const char *message, const char *param,
				  const char *allow)
{
	if (status >= 500)
		log_warn("HTTP %u: %s", status, message);
	else
		log_debug("HTTP %u: %s", status, message);
	return send_json(c, status, api_error_json(message, error_type(status), param, error_code(status)), allow);
}

/* ---- the model's name ---- */

/* The model's name into model (asked from the instance the first time, then kept): 0, or -1 with
 * err set when the instance cannot say. */
static int model_known(struct server *s, char *model, size_t len, char *err, size_t errlen)
{
	if (s->cfg.model_id) {
		snprintf(model, len, "%s", s->cfg.model_id);
		return 0;
	}
	pthread_mutex_lock(&s->lock);
	snprintf(model, len, "%s", s->model);
	pthread_mutex_unlock(&s->lock);
	if (*model)
		return 0;
	char name[256];
	if (runner_model_name(s->cfg.ro, name, sizeof(name), err, errlen) != 0)
		return -1;
	pthread_mutex_lock(&s->lock);
	snprintf(s->model, sizeof(s->model), "%s", name);
	pthread_mutex_unlock(&s->lock);
	snprintf(model, len, "%s", name);
	return 0;
}

/* The model's name for a reply: "unknown" (logged) when the instance cannot say. */
static void model_name(struct server *s, char *buf, size_t len)
{
	char err[256];
	if (model_known(s, buf, len, err, sizeof(err)) != 0) {
		log_warn("the model's name: %s", err);
		snprintf(buf, len, "%s", "unknown");
	}
}

/* ---- GET ---- */

static enum MHD_Result on_health(struct server *s, struct MHD_Connection *c)
{
	char err[256];
	int rc = runner_probe(s->cfg.ro, "gpu-runner", err, sizeof(err));
	bool busy = runner_in_flight(s->cfg.runner) > 0;
	/* A runner deep in a generation may not answer in time; the worker sees it go away. */
	if (rc != 0 && !(rc == -ETIMEDOUT && busy)) {
		json_t *o = json_pack("{s:s, s:s}", "status", "unavailable", "error", err);
		return send_json(c, MHD_HTTP_SERVICE_UNAVAILABLE, o, NULL);
	}
	json_t *o = json_pack("{s:s, s:b, s:I, s:I}", "status", "ok", "busy", busy, "in_flight",
			      (json_int_t)runner_in_flight(s->cfg.runner), "queued",
			      (json_int_t)runner_queue_length(s->cfg.runner));
	return send_json(c, MHD_HTTP_OK, o, NULL);
}


static enum MHD_Result on_models(struct server *s, struct MHD_Connection *c)
{
	char model[256], err[256];
	if (model_known(s, model, sizeof(model), err, sizeof(err)) != 0)
		return send_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, err, NULL, NULL);
	return send_json(c, MHD_HTTP_OK, api_models_json(model, (int64_t)time(NULL)), NULL);
}

/* GET /v1/models/{id}: the model when id is its name (an SDK's models.retrieve), else 404. */
static enum MHD_Result on_model(struct server *s, struct MHD_Connection *c, const char *url)
{
	const char *id = url + strlen(MODEL_PATH);
	size_t id_len = strlen(id);
	while (id_len > 0 && id[id_len - 1] == '/')
		id_len--;
	char model[256], err[256];
	if (model_known(s, model, sizeof(model), err, sizeof(err)) != 0)
		return send_error(c, MHD_HTTP_SERVICE_UNAVAILABLE, err, NULL, NULL);
	if (strlen(model) != id_len || strncmp(model, id, id_len)) {
		char msg[600];
		snprintf(msg, sizeof(msg), "the model '%.*s' does not exist (this server serves '%s')",
			 (int)(id_len < 256 ? id_len : 256), id, model);
		return send_error(c, MHD_HTTP_NOT_FOUND, msg, NULL, NULL);
	}
	return send_json(c, MHD_HTTP_OK, api_model_json(model, (int64_t)time(NULL)), NULL);
}

/* The instance's stats for a scrape, or NULL (logged at debug: a scrape must not flood the log). */
static char *service_stats(struct server *s, const char *service)
{
	char *json = NULL, err[256];
	long t = s->cfg.ro->hello_timeout_ms < STATS_TIMEOUT_MS ? s->cfg.ro->hello_timeout_ms : STATS_TIMEOUT_MS;
	if (runner_stats_json(s->cfg.ro, service, (int)t, &json, err, sizeof(err)) != 0)
		log_debug("/metrics: %s", err);
	return json;
}

static enum MHD_Result on_metrics(struct server *s, struct MHD_Connection *c)
{
	struct metrics_gauges g = {
		.queue_depth = runner_queue_length(s->cfg.runner),
		.in_flight = (int)runner_in_flight(s->cfg.runner),
		.resumes = runner_resumes(s->cfg.runner),
	};
	char *runner = service_stats(s, "gpu-runner"), *loader = service_stats(s, "ssd-loader");
	char *text;
	size_t len;
	int rc = metrics_render(s->metrics, &g, runner, loader, &text, &len);
	free(runner);
	free(loader);
	if (rc)
		return send_error(c, 500, "out of memory", NULL, NULL);
	return send_text(c, MHD_HTTP_OK, METRICS_CONTENT_TYPE, text, NULL);
}

/* ---- generations ---- */

static unsigned job_status(int http_status)
{
	return http_status >= 400 && http_status < 600 ? (unsigned)http_status : 500;
}

static double seconds_since(uint64_t start_ns)
{
	return (double)(now_ns() - start_ns) * 1e-9;
}

/* The end of a generation the reader saw: its counters. */
static void count_end(struct server *s, const struct runner_view *v)
{
	if (v->state == JOB_DONE)
		metrics_tokens(s->metrics, v->n_prompt, v->n_generated);
	else if (v->state == JOB_FAILED && job_status(v->http_status) >= 500)
		metrics_runner_error(s->metrics);
}

static void make_id(char *buf, size_t len, enum api_kind kind)
{
	snprintf(buf, len, "%s-%016llx", kind == API_CHAT ? "chatcmpl" : "cmpl", (unsigned long long)random_u64());
}

/* How often a request that waits (in the queue, or for the text of a whole answer or a stream's
 * first token) looks whether its client is still there. */
#define CLIENT_WATCH_MS 200

/* Has the client of c gone away? A peek at its socket: the end of the stream (it closed its side)
 * or an error. Bytes waiting (a pipelined request) and nothing yet both mean it is there. */
static bool client_gone(struct MHD_Connection *c)
{
	const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
	if (!ci)
		return false;
	char b;
	ssize_t n = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
	return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* runner_job_wait without a limit, looking at the client every CLIENT_WATCH_MS meanwhile, whether
 * news came or not (*looked_ns: when it last looked; a generation that streams its tokens to a
 * reply that is sent whole is watched as one that waits). Returns false when the client went away
 * first, the job not yet over (*v then holds nothing to free). */
static bool wait_watching(struct MHD_Connection *c, struct runner_job *j, size_t have, uint64_t tokens,
			  struct runner_view *v, uint64_t *looked_ns)
{
	while (!runner_job_wait(j, have, tokens, CLIENT_WATCH_MS, v)) {
		free(v->fresh);
		v->fresh = NULL;
		*looked_ns = now_ns();
		if (client_gone(c))
			return false;
	}
	const uint64_t now = now_ns();
	if (v->state != JOB_DONE && v->state != JOB_FAILED && now - *looked_ns >= CLIENT_WATCH_MS * 1000000ull) {
		*looked_ns = now;
		if (client_gone(c)) {
			free(v->fresh);
			v->fresh = NULL;
			return false;
		}
	}
	return true;
}

/* The client of a request that had not begun its answer went away: its job is dropped from the
 * queue or cancelled, and the connection closed. */
static enum MHD_Result client_left(struct server *s, struct runner_job *j, enum runner_job_state state)
{
	log_info("a client went away while its request %s: it is %s", state == JOB_QUEUED ? "waited in the queue"
				     : "was generating", state == JOB_QUEUED ? "dropped" : "cancelled");
	metrics_cancelled(s->metrics);
	runner_job_release(j);
	closed_for_client = true;
	return MHD_NO;
}

/* Waits for the whole generation, then answers with one JSON object. */
static enum MHD_Result answer_whole(struct server *s, struct MHD_Connection *c, struct api_request *req,
				   struct runner_job *j, uint64_t start_ns)
{
	struct api_stop_filter f = {0};
	struct runner_view v;
	size_t have = 0;
	uint64_t tokens = 0, looked = now_ns();
	bool oom = false;
	for (;;) {
		if (!wait_watching(c, j, have, tokens, &v, &looked)) {
			api_stop_filter_free(&f);
			return client_left(s, j, v.state);
		}
		if (tokens == 0 && v.n_tokens > 0)
			metrics_first_token(s->metrics, seconds_since(start_ns));
		if (v.fresh && api_stop_filter_push(&f, req, v.fresh, v.fresh_len))
			oom = true;
		free(v.fresh);
		have = v.len;
		tokens = v.n_tokens;
		if (v.state == JOB_DONE || v.state == JOB_FAILED || oom)
			break;
	}
	runner_job_release(j);
	if (!oom)
		count_end(s, &v);
	enum MHD_Result ret;
	if (oom) {
		ret = send_error(c, 500, "out of memory", NULL, NULL);
	} else if (v.state == JOB_FAILED) {
		ret = send_error(c, job_status(v.http_status), v.error, NULL, NULL);
	} else {
		size_t from;
		size_t end = api_stop_filter_release(&f, req, true, &from);
		const char *finish = f.stopped ? "stop" : api_finish_reason(v.reason);
		char id[64], model[256];
		make_id(id, sizeof(id), req->kind);
		model_name(s, model, sizeof(model));
		json_t *o = api_completion_json(req, id, model, (int64_t)time(NULL), f.text ? f.text : "", end, finish,
						v.n_prompt, v.n_generated);
		ret = send_json(c, MHD_HTTP_OK, o, NULL);
	}
	api_stop_filter_free(&f);
	return ret;
}

static int out_append(struct stream *st, const char *p, size_t n)
{
	if (st->out_len + n > st->out_cap) {
		size_t cap = st->out_cap ? st->out_cap : 1024;
		while (cap < st->out_len + n)
			cap *= 2;
		char *t = realloc(st->out, cap);
		if (!t)
			return -ENOMEM;
		st->out = t;
		st->out_cap = cap;
	}
	memcpy(st->out + st->out_len, p, n);
	st->out_len += n;
	return 0;
}

/* Appends "data: <o>\n\n" (o: a reference taken). */
static int out_event(struct stream *st, json_t *o)
{
	char *text = o ? json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
	json_decref(o);
	if (!text)
		return -ENOMEM;
	int rc = out_append(st, "data: ", 6);
	rc = rc ? rc : out_append(st, text, strlen(text));
	rc = rc ? rc : out_append(st, "\n\n", 2);
	free(text);
	return rc;
}

static void stream_end(struct stream *st, const char *finish, uint64_t n_prompt, uint64_t n_generated)
{
	out_event(st, api_chunk_json(&st->req, st->id, st->model, st->created, "", 0, finish, false));
	if (st->req.include_usage)
		out_event(st, api_usage_chunk_json(&st->req, st->id, st->model, st->created, n_prompt, n_generated));
	out_append(st, "data: [DONE]\n\n", 14);
	st->finished = true;
}

/* Formats the next events into st->out, waiting for the job as needed. */
static void stream_produce(struct stream *st)
{
	if (st->req.kind == API_CHAT && !st->role_sent) {
		st->role_sent = true;
		if (out_event(st, api_chunk_json(&st->req, st->id, st->model, st->created, "", 0, NULL, true)) == 0)
			return;
	}
	/* The first token's text, taken in by answer_stream, goes out now, not behind the second. */
	struct runner_view v;
	runner_job_wait(st->job, st->have_len, st->have_tokens, st->held ? 0 : -1, &v);
	st->held = false;
	int rc = v.fresh ? api_stop_filter_push(&st->filter, &st->req, v.fresh, v.fresh_len) : 0;
	free(v.fresh);
	st->have_len = v.len;
	st->have_tokens = v.n_tokens;
	bool ended = v.state == JOB_DONE || v.state == JOB_FAILED;
	if (ended)
		count_end(st->s, &v);
	size_t from, end = api_stop_filter_release(&st->filter, &st->req, ended, &from);
	if (end > from)
		rc = rc ? rc : out_event(st, api_chunk_json(&st->req, st->id, st->model, st->created,
							  st->filter.text + from, end - from, NULL, false));
	if (rc || v.state == JOB_FAILED) {
		const char *why = rc ? "out of memory" : v.error;
		out_event(st, api_error_json(why, error_type(job_status(v.http_status)), NULL, NULL));
		out_append(st, "data: [DONE]\n\n", 14);
		st->finished = true;
		return;
	}
	/* After a stop string nothing more is given out; the runner, which has the stop strings too,
	 * ends the generation at once and tells the counts for the usage. */
	if (v.state == JOB_DONE)
		stream_end(st, st->filter.stopped ? "stop" : api_finish_reason(v.reason), v.n_prompt, v.n_generated);
}

/* The stream's connection under its idle limit (on) or not, where it is not so already. */
static void stream_limit(struct stream *st, bool on)
{
	if (st->limit_off != on)
		return;
	MHD_set_connection_option(st->conn, MHD_CONNECTION_OPTION_TIMEOUT,
				  on ? (unsigned int)st->s->cfg.idle_timeout_s : 0u);
	st->limit_off = !on;
}

/* libmicrohttpd's reader of a stream, on its connection's thread. While it waits on the model for
 * the next text the idle limit is off (a token may take longer than the limit); while what it
 * handed out waits on the client the limit is on, so that a client that stops reading is closed
 * as any idle one once the socket's buffers are full: its generation cancelled, its place freed
 * (with the kernel's default send buffer, megabytes, that may be only after the generation's end;
 * --send-buffer bounds it). Turning the limit on from off restarts its timer (libmicrohttpd's
 * MHD_CONNECTION_OPTION_TIMEOUT). */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
	struct stream *st = cls;
	for (;;) {
		if (st->out_pos < st->out_len) {
			size_t n = st->out_len - st->out_pos;
			n = n < max ? n : max;
			memcpy(buf, st->out + st->out_pos, n);
			st->out_pos += n;
			stream_limit(st, true);
			return (ssize_t)n;
		}
		if (st->finished) {
			stream_limit(st, true); /* (on already, but where its last events could not be made) */
			return MHD_CONTENT_READER_END_OF_STREAM;
		}
		st->out_len = st->out_pos = 0;
		stream_limit(st, false);
		stream_produce(st);
	}
}

/* The response is done with (sent, or the client went away). */
static void stream_free(void *cls)
{
	struct stream *st = cls;
	if (st->job && !st->finished) {
		/* Is the generation still running (then releasing the job cancels it), or had it ended
		 * before the reader came to its end? */
		struct runner_view v;
		runner_job_wait(st->job, st->have_len, st->have_tokens, 0, &v);
		free(v.fresh);
		if (v.state == JOB_DONE || v.state == JOB_FAILED) {
			log_info("a client went away before the end of its stream (its generation had ended)");
			count_end(st->s, &v);
		} else {
			log_info("a client went away during its stream: its generation is cancelled");
			metrics_cancelled(st->s->metrics);
		}
	}
	runner_job_release(st->job);
	api_request_free(&st->req);
	api_stop_filter_free(&st->filter);
	free(st->out);
	free(st);
}

/* Waits for the first token (or the end), then answers with an event stream. */
static enum MHD_Result answer_stream(struct server *s, struct MHD_Connection *c, struct api_request *req,
				    struct runner_job *j, uint64_t start_ns)
{
	struct runner_view v;
	uint64_t looked = now_ns();
	if (!wait_watching(c, j, 0, 0, &v, &looked)) {
		api_request_free(req);
		return client_left(s, j, v.state);
	}
	if (v.n_tokens > 0)
		metrics_first_token(s->metrics, seconds_since(start_ns));
	if (v.state == JOB_FAILED) /* a stream's end is counted by its reader (stream_produce) */
		count_end(s, &v);
	if (v.state == JOB_FAILED) {
		free(v.fresh);
		runner_job_release(j);
		api_request_free(req);
		return send_error(c, job_status(v.http_status), v.error, NULL, NULL);
	}
	struct stream *st = calloc(1, sizeof(*st));
	if (!st || (v.fresh && api_stop_filter_push(&st->filter, req, v.fresh, v.fresh_len))) {
		free(v.fresh);
		free(st);
		runner_job_release(j);
		api_request_free(req);
		return send_error(c, 500, "out of memory", NULL, NULL);
	}
	free(v.fresh);
	/* Only what this wait saw was taken in: the reader goes on from there, giving it out first. */
	st->held = true;
	st->have_len = v.len;
	st->have_tokens = v.n_tokens;
	st->s = s;
	st->job = j;
	st->conn = c;
	st->req = *req;
	memset(req, 0, sizeof(*req));
	st->created = (int64_t)time(NULL);
	make_id(st->id, sizeof(st->id), st->req.kind);
	model_name(s, st->model, sizeof(st->model));
	struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, STREAM_BLOCK, stream_read, st,
								   stream_free);
	if (!r) {
		stream_free(st);
		return MHD_NO;
	}
	MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
	MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
	enum MHD_Result ret = queue_response(c, MHD_HTTP_OK, r);
	MHD_destroy_response(r);
	return ret;
}

static enum MHD_Result on_generate(struct server *s, struct MHD_Connection *c, struct request_state *rs)
{
	struct api_request req;
	struct api_problem why;
	enum api_kind kind = rs->route == R_CHAT ? API_CHAT : API_COMPLETION;
	int rc = api_parse_request(rs->body ? rs->body : "", rs->len, kind, &s->cfg.limits, &req, &why);
	if (rc == -EINVAL)
		return send_error(c, MHD_HTTP_BAD_REQUEST, why.message, why.param, NULL);
	if (rc)
		return send_error(c, 500, "out of memory", NULL, NULL);
	struct runner_params p = {
		.prompt = req.prompt,
		.chat_json = req.chat_json,
		.stops_json = req.stops_json,
		.max_new = (uint64_t)req.max_tokens,
		.temperature = req.temperature,
		.top_p = req.top_p,
		.top_k = req.top_k,
		.min_p = req.min_p,
		.repetition_penalty = req.repetition_penalty,
		.ignore_eos = req.ignore_eos,
		.seed = req.has_seed ? req.seed : random_u64() >> 1,
	};
	struct runner_job *j;
	rc = runner_submit(s->cfg.runner, &p, &j);
	if (rc) {
		api_request_free(&req);
		if (rc == -EAGAIN) {
			metrics_queue_rejected(s->metrics);
			return send_error(c, MHD_HTTP_TOO_MANY_REQUESTS,
					  "too many requests wait for the model (--max-queue): try again later", NULL,
					  NULL);
		}
		return send_error(c, rc == -ESHUTDOWN ? 503 : 500,
				  rc == -ESHUTDOWN ? "http-api is stopping" : "out of memory", NULL, NULL);
	}
	if (req.stream)
		return answer_stream(s, c, &req, j, rs->start_ns);
	enum MHD_Result ret = answer_whole(s, c, &req, j, rs->start_ns);
	api_request_free(&req);
	return ret;
}

/* ---- routing ---- */

static enum route route_of(const char *url, const char **method_wanted, const char **path)
{
	static const struct {
		const char *path, *method;
		enum route r;
	} routes[] = {
		{"/health", "GET", R_HEALTH},
		{"/metrics", "GET", R_METRICS},
		{"/v1/models", "GET", R_MODELS},
		{"/v1/completions", "POST", R_COMPLETIONS},
		{"/v1/chat/completions", "POST", R_CHAT},
	};
	size_t n = strlen(url);
	while (n > 1 && url[n - 1] == '/')
		n--;
	if (n > strlen(MODEL_PATH) && !strncmp(url, MODEL_PATH, strlen(MODEL_PATH))) {
		*method_wanted = "GET";
		*path = "/v1/models/:model";
		return R_MODEL;
	}
	for (size_t i = 0; i < ARRAY_SIZE(routes); i++) {
		if (strlen(routes[i].path) == n && !strncmp(routes[i].path, url, n)) {
			*method_wanted = routes[i].method;
			*path = routes[i].path;
			return routes[i].r;
		}
	}
	return R_NONE;
}

/* Compares the Authorization header with "Bearer <key>" in time independent of where they differ. */
static bool authorized(const struct server *s, struct MHD_Connection *c)
{
	if (!s->cfg.api_key)
		return true;
	const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
	if (!h || strncasecmp(h, "Bearer ", 7))
		return false;
	h += 7;
	while (*h == ' ')
		h++;
	size_t a = strlen(h), b = strlen(s->cfg.api_key);
	unsigned char diff = a != b;
	for (size_t i = 0; i < b; i++)
		diff |= (unsigned char)(s->cfg.api_key[i] ^ (i < a ? h[i] : 0));
	return diff == 0;
}

/* The request's framing headers, counted (count_framing): Content-Length and Transfer-Encoding,
 * a Transfer-Encoding other than chunked, a header name that is not a token. */
struct framing {
	unsigned content_length, transfer_encoding, other_coding, bad_name;
};

/* A field name is a token (RFC 9110, 5.1): no whitespace, no control or separator characters.
 * libmicrohttpd keeps "Transfer-Encoding " (a space before the colon) as a name of its own, which
 * the counts below would not see while a proxy in front might take it as the header itself. */
static bool field_name_ok(const char *k)
{
	if (!*k)
		return false;
	for (; *k; k++)
		if ((unsigned char)*k <= 0x20 || (unsigned char)*k >= 0x7f || strchr("\"(),/:;<=>?@[\\]{}", *k))
			return false;
	return true;
}

static enum MHD_Result count_framing(void *cls, enum MHD_ValueKind kind, const char *key, const char *value)
{
	(void)kind;
	struct framing *f = cls;
	if (!key)
		return MHD_YES;
	if (!field_name_ok(key))
		f->bad_name++;
	else if (!strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH))
		f->content_length++;
	else if (!strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING)) {
		f->transfer_encoding++;
		if (!value || strcasecmp(value, "chunked"))
			f->other_coding++;
	}
	return MHD_YES;
}

/* Refuses (*status, msg) a request whose body's end two readers could find in different places:
 * Content-Length more than once (libmicrohttpd takes the first, a proxy in front may take the
 * last), or beside Transfer-Encoding, or a header name that is not a token (RFC 9112, 5.1). Such a
 * request is how one request is smuggled inside another (RFC 9112, 6.3): 400, and the connection
 * closed, since where its body ends is not known. A Transfer-Encoding other than chunked (which
 * libmicrohttpd would read until the connection closes): 501, closed. */
static bool framing_refused(struct MHD_Connection *c, unsigned *status, const char **msg)
{
	struct framing f = {0, 0, 0, 0};
	MHD_get_connection_values(c, MHD_HEADER_KIND, count_framing, &f);
	if (f.bad_name) {
		*status = MHD_HTTP_BAD_REQUEST;
		*msg = "a header's name holds whitespace or a separator (no space may come before its colon)";
	} else if (f.content_length > 1 || (f.content_length && f.transfer_encoding)) {
		*status = MHD_HTTP_BAD_REQUEST;
		*msg = "the request's length is ambiguous: Content-Length more than once, or beside Transfer-Encoding";
	} else if (f.transfer_encoding > 1 || f.other_coding) {
		*status = MHD_HTTP_NOT_IMPLEMENTED;
		*msg = "Transfer-Encoding other than a single chunked is not supported";
	} else {
		return false;
	}
	return true;
}

/* 204 to a CORS preflight of an endpoint taking method wanted. */
static enum MHD_Result send_preflight(struct MHD_Connection *c, const char *wanted)
{
	struct MHD_Response *r = MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT);
	if (!r)
		return MHD_NO;
	const char *methods = strcmp(wanted, "GET") ? "POST, OPTIONS" : "GET, HEAD, OPTIONS";
	MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, methods);
	MHD_add_response_header(r, "Access-Control-Allow-Methods", methods);
	/* The headers the page's request will carry, where they are plain names (an SDK adds its own,
	 * X-Stainless-* among them, which a fixed list would make the browser refuse). */
	const char *asked = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Headers");
	size_t n = asked ? strlen(asked) : 0;
	bool plain = n > 0 && n <= 1024;
	for (size_t i = 0; plain && i < n; i++)
		plain = (asked[i] >= 'a' && asked[i] <= 'z') || (asked[i] >= 'A' && asked[i] <= 'Z') ||
			(asked[i] >= '0' && asked[i] <= '9') || asked[i] == '-' || asked[i] == '_' || asked[i] == ',' ||
			asked[i] == ' ';
	MHD_add_response_header(r, "Access-Control-Allow-Headers", plain ? asked : "Authorization, Content-Type");
	MHD_add_response_header(r, "Access-Control-Max-Age", "600");
	enum MHD_Result ret = queue_response(c, MHD_HTTP_NO_CONTENT, r);
	MHD_destroy_response(r);
	return ret;
}

static enum MHD_Result send_error_close(struct MHD_Connection *c, unsigned status, const char *message)
{
	log_debug("HTTP %u: %s (connection closed)", status, message);
	return send_json_as(c, status, api_error_json(message, error_type(status), NULL, error_code(status)), NULL,
			    true);
}

/* The first call of a request: everything that can be answered before the body. Returns true
 * when a response was queued (*ret says how). */
static bool answer_early(struct server *s, struct MHD_Connection *c, const char *url, const char *method,
			 struct request_state *rs, enum MHD_Result *ret)
{
	const char *wanted = NULL;
	rs->endpoint = "other";
	rs->route = route_of(url, &wanted, &rs->endpoint);
	char msg[768];
	unsigned bad_status;
	const char *bad_msg;
	if (framing_refused(c, &bad_status, &bad_msg)) {
		*ret = send_error_close(c, bad_status, bad_msg);
		return true;
	}
	if (rs->route == R_NONE) {
		snprintf(msg, sizeof(msg), "no endpoint %.400s (there are GET /health, GET /metrics, GET /v1/models, "
			 "GET /v1/models/{model}, POST /v1/completions and POST /v1/chat/completions)", url);
		*ret = send_error(c, MHD_HTTP_NOT_FOUND, msg, NULL, NULL);
		return true;
	}
	/* A browser's preflight of a request from another origin (--cors-origin): the methods and
	 * headers taken, no key needed (a preflight carries none). */
	if (cors_origin && !strcmp(method, "OPTIONS")) {
		*ret = send_preflight(c, wanted);
		return true;
	}
	/* HEAD where GET is taken: the same answer, its body left out (by libmicrohttpd), as a
	 * monitor's HEAD /health expects. */
	bool head_of_get = !strcmp(wanted, "GET") && !strcmp(method, "HEAD");
	if (strcmp(method, wanted) && !head_of_get) {
		const char *allow = strcmp(wanted, "GET") ? wanted : "GET, HEAD";
		snprintf(msg, sizeof(msg), "%.500s takes %s, not %.32s", url, allow, method);
		*ret = send_error(c, MHD_HTTP_METHOD_NOT_ALLOWED, msg, NULL, allow);
		return true;
	}
	if (rs->route != R_HEALTH && rs->route != R_METRICS && !authorized(s, c)) {
		*ret = send_error(c, MHD_HTTP_UNAUTHORIZED,
				  "a valid API key is needed: send the header 'Authorization: Bearer KEY'", NULL, NULL);
		return true;
	}
	if (rs->route == R_HEALTH) {
		*ret = on_health(s, c);
		return true;
	}
	if (rs->route == R_METRICS) {
		*ret = on_metrics(s, c);
		return true;
	}
	if (rs->route == R_MODELS) {
		*ret = on_models(s, c);
		return true;
	}
	if (rs->route == R_MODEL) {
		*ret = on_model(s, c, url);
		return true;
	}
	const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
	if (cl && strtoull(cl, NULL, 10) > s->cfg.max_body) {
		snprintf(msg, sizeof(msg), "the body of %.32s bytes exceeds the limit of %llu (--max-body)", cl,
			 (unsigned long long)s->cfg.max_body);
		*ret = send_error(c, 413, msg, NULL, NULL);
		return true;
	}
	return false;
}

/* answer_early, and the request marked answered with the status queued where it was. */
static bool answered_early(struct server *s, struct MHD_Connection *c, const char *url, const char *method,
			   struct request_state *rs, enum MHD_Result *ret)
{
	queued_status = 0;
	if (!answer_early(s, c, url, method, rs, ret))
		return false;
	rs->answered = true;
	rs->status = queued_status;
	return true;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
				  const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
	struct server *s = cls;
	struct request_state *rs = *con_cls;
	if (!rs) {
		rs = calloc(1, sizeof(*rs));
		if (!rs)
			return MHD_NO;
		*con_cls = rs;
		rs->start_ns = now_ns();
		/* A request without a body (no Content-Length but 0, no Transfer-Encoding, its framing
		 * sound) is answered at its last call: a response queued at the first call counts as
		 * early to libmicrohttpd, which then closes the connection, and requests pipelined
		 * behind it went unanswered. One with a body is answered now where it can be, so that
		 * a body nobody wants is not read. */
		const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
		const char *te = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING);
		unsigned bad_status;
		const char *bad_msg;
		if (!te && (!cl || !strcmp(cl, "0")) && !framing_refused(c, &bad_status, &bad_msg)) {
			rs->deferred = true;
			return MHD_YES;
		}
		enum MHD_Result ret;
		return answered_early(s, c, url, method, rs, &ret) ? ret : MHD_YES;
	}
	if (rs->deferred && !*upload_size) {
		rs->deferred = false;
		enum MHD_Result ret;
		if (answered_early(s, c, url, method, rs, &ret))
			return ret;
		/* A POST without a body: on as any other (its empty body is refused there). */
	}
	if (*upload_size) {
		size_t n = *upload_size;
		*upload_size = 0;
		if (rs->answered || rs->too_big)
			return MHD_YES;
		if (rs->len + n > s->cfg.max_body) {
			rs->too_big = true;
			free(rs->body);
			rs->body = NULL;
			rs->len = rs->cap = 0;
			return MHD_YES;
		}
		if (rs->len + n > rs->cap) {
			size_t cap = rs->cap ? rs->cap : 4096;
			while (cap < rs->len + n)
				cap *= 2;
			char *b = realloc(rs->body, cap);
			if (!b)
				return MHD_NO;
			rs->body = b;
			rs->cap = cap;
		}
		memcpy(rs->body + rs->len, upload, n);
		rs->len += n;
		return MHD_YES;
	}
	if (rs->answered)
		return MHD_YES;
	rs->answered = true;
	queued_status = 0;
	enum MHD_Result ret;
	if (rs->too_big) {
		char msg[128];
		snprintf(msg, sizeof(msg), "the body exceeds the limit of %llu bytes (--max-body)",
			 (unsigned long long)s->cfg.max_body);
		ret = send_error(c, 413, msg, NULL, NULL);
	} else {
		/* From here the connection waits on the model, not on its client: no idle timeout while
		 * the answer is made (a long prefill, a runner restarted and the request resumed). Once
		 * it is queued (whole, an error, or a stream's first events) it waits on its client,
		 * under the limit again: a client that stops reading is closed as any idle one. A
		 * stream's reader turns the limit off again while it waits for more (stream_read). */
		MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
		ret = on_generate(s, c, rs);
		MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, (unsigned int)s->cfg.idle_timeout_s);
	}
	rs->status = queued_status;
	return ret;
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe)
{
	struct server *s = cls;
	struct request_state *rs = *con_cls;
	if (!rs)
		return;
	if (rs->status)
		metrics_request(s->metrics, rs->endpoint, rs->status, seconds_since(rs->start_ns));
	free(rs->body);
	free(rs);
	*con_cls = NULL;
}

/* A new connection: its kernel send buffer as asked (--send-buffer), so that a client that stops
 * reading blocks the answer's writes after that much, not after the megabytes the kernel's own
 * grows to (and is closed by the idle limit from there). */
static void on_connection(void *cls, struct MHD_Connection *c, void **socket_ctx, enum MHD_ConnectionNotificationCode code)
{
	struct server *s = cls;
	(void)socket_ctx;
	if (code != MHD_CONNECTION_NOTIFY_STARTED || s->cfg.send_buffer <= 0)
		return;
	const union MHD_ConnectionInfo *info = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
	int size = s->cfg.send_buffer;
	if (info && setsockopt(info->connect_fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof(size)) != 0)
		log_warn("setting a connection's send buffer to %d bytes failed: %s", size, strerror(errno));
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
	char buf[512];
	vsnprintf(buf, sizeof(buf), fmt, ap);
	buf[strcspn(buf, "\n")] = 0;
	if (closed_for_client && strstr(buf, "Application reported internal error")) {
		closed_for_client = false; /* the connection of a client that went away, closed on purpose */
		log_debug("libmicrohttpd: %s", buf);
		return;
	}
	log_warn("libmicrohttpd: %s", buf);
}

int server_start(const struct server_config *cfg, struct server **out, char *err, size_t errlen)
{
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(cfg->port)};
	if (inet_pton(AF_INET, cfg->listen_addr, &sa.sin_addr) != 1)
		return errorf(err, errlen, -EINVAL, "'%s' is not an IPv4 address", cfg->listen_addr);
	struct server *s = calloc(1, sizeof(*s));
	if (!s)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	s->cfg = *cfg;
	cors_origin = cfg->cors_origin;
	s->metrics = metrics_create();
	if (!s->metrics) {
		free(s);
		return errorf(err, errlen, -ENOMEM, "out of memory");
	}
	pthread_mutex_init(&s->lock, NULL);
	s->d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
					MHD_USE_ERROR_LOG,
				cfg->port, NULL, NULL, on_request, s, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, s,
				MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa, MHD_OPTION_CONNECTION_LIMIT,
				(unsigned int)cfg->max_connections, MHD_OPTION_CONNECTION_TIMEOUT,
				(unsigned int)cfg->idle_timeout_s, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
				(unsigned int)cfg->max_per_ip, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s, MHD_OPTION_NOTIFY_CONNECTION,
				on_connection, s, MHD_OPTION_END);
	if (!s->d) {
		int e = errno ? errno : EADDRINUSE;
		pthread_mutex_destroy(&s->lock);
		metrics_destroy(&s->metrics);
		free(s);
		return errorf(err, errlen, -e, "cannot listen on %s:%u: %s", cfg->listen_addr, (unsigned)cfg->port,
			      strerror(e));
	}
	const union MHD_DaemonInfo *info = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
	s->port = info ? info->port : cfg->port;
	*out = s;
	return 0;
}

uint16_t server_port(const struct server *s)
{
	return s->port;
}

void server_stop(struct server **sp)
{
	struct server *s = *sp;
	if (!s)
		return;
	MHD_stop_daemon(s->d);
	pthread_mutex_destroy(&s->lock);
	metrics_destroy(&s->metrics);
	free(s);
	*sp = NULL;
}

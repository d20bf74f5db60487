/* runner_client.c - the job queue and the worker thread that speaks to gpu-runner
 * (runner_client.h).
 *
 * One lock guards the queue and every job; each job has a condition its reader waits on. The
 * worker holds no lock while it talks to the runner. A job's memory is shared by its reader and
 * the worker (refs): the last of the two to let go frees it.
 *
 * The runner dying during a request is noticed without waiting out the reply timeout: while no
 * reply comes, the worker looks once a second at who listens on gpu-runner.ctl; nobody, or
 * another process than at the HELLO (the supervisor started a new runner), means the request
 * was lost with the old one. The job then waits for the new runner (resume_timeout_ms) and sends
 * the request again with the token ids it has, as MSG_GENERATE's done part: the runner continues
 * the stream from there (runner_client.h). */
#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "common/bus.h"
#include "common/log.h"
#include "common/protocol.h"
#include "common/utf8.h"
#include "common/util.h"
#include "services/http-api/runner_client.h"

#define RUNNER "gpu-runner"
#define WAIT_SLICE_MS 200     /* a reply is waited for in slices, to see cancels and a dead runner */
#define LISTENER_CHECK_MS 1000

struct runner_job {
	struct runner_job *next;
	struct runner_client *rc;
	int refs;	/* the reader and the worker (or the queue) */
	bool released;	/* the reader let go: cancel */
	pthread_cond_t cond;
	/* the request (owned copies) */
	char *prompt, *chat_json, *stops_json;
	uint64_t max_new, seed, top_k;
	double temperature, top_p, min_p, repetition_penalty;
	bool ignore_eos;
	/* what came back */
	enum runner_job_state state;
	char *text;
	size_t len, cap;
	uint64_t n_tokens, n_prompt, n_generated;
	uint64_t *ids;	/* the n_tokens ids received (the worker's: the resume part) */
	size_t ids_cap;
	unsigned resumes; /* times the request was sent again after its runner died or was stopped */
	unsigned deaths;  /* ... of them after a runner that died (not one stopped: RUNNER_RESUMES_MAX) */
	char reason[32];
	int http_status;
	char error[512];
};

struct runner_client;

/* One worker: a thread with its own connection to the runner, running one job at a time. */
struct worker {
	struct runner_client *rc;
	pthread_t thread;
	bool started;
	struct rpc_client *client;
};

struct runner_client {
	struct runner_options o;
	char run_dir[256];
	struct worker *workers; /* (o.concurrency) */
	long n_workers;		/* started */
	pthread_mutex_t lock;
	pthread_cond_t work; /* the workers wait here for jobs */
	struct runner_job *head, *tail;
	long queued;	/* jobs in the queue */
	long busy;	/* workers running a job */
	uint64_t resumes; /* requests sent again to a new runner after theirs died (every job's) */
	bool stopping;
};

static void job_unref_locked(struct runner_job *j)
{
	if (--j->refs > 0)
		return;
	pthread_cond_destroy(&j->cond);
	free(j->prompt);
	free(j->chat_json);
	free(j->stops_json);
	free(j->text);
	free(j->ids);
	free(j);
}

/* Ends the job as failed (under the lock). */
static void job_fail_locked(struct runner_job *j, int status, const char *why)
{
	if (j->state == JOB_DONE || j->state == JOB_FAILED)
		return;
	j->state = JOB_FAILED;
	j->http_status = status;
	snprintf(j->error, sizeof(j->error), "%s", why);
	pthread_cond_broadcast(&j->cond);
}

static void job_fail(struct runner_client *rc, struct runner_job *j, int status, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
static void job_fail(struct runner_client *rc, struct runner_job *j, int status, const char *fmt, ...)
{
	char why[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(why, sizeof(why), fmt, ap);
	va_end(ap);
	pthread_mutex_lock(&rc->lock);
	job_fail_locked(j, status, why);
	pthread_mutex_unlock(&rc->lock);
	log_warn("request failed (HTTP %d): %s", status, why);
}

static int append_text(struct runner_job *j, const char *p, size_t n)
{
	if (!n)
		return 0;
	if (j->len + n + 1 > j->cap) {
		size_t cap = j->cap ? j->cap : 256;
		while (cap < j->len + n + 1)
			cap *= 2;
		char *t = realloc(j->text, cap);
		if (!t)
			return -ENOMEM;
		j->text = t;
		j->cap = cap;
	}
	memcpy(j->text + j->len, p, n);
	j->len += n;
	j->text[j->len] = 0;
	return 0;
}

/* The HTTP status for a MSG_ERROR of the runner: its code is a positive errno. */
static int status_of_runner_error(int64_t code)
{
	switch (code) {
	case EINVAL:
	case ERANGE:
	case E2BIG:
	case EMSGSIZE:
	case ENOTSUP:
	case EILSEQ:
		return 400;
	case EBUSY:
	case EAGAIN:
	case ENOBUFS:
	case ESHUTDOWN:
	case ECANCELED:
		return 503;
	default:
		return 500;
	}
}

static bool job_released(struct runner_client *rc, struct runner_job *j)
{
	pthread_mutex_lock(&rc->lock);
	bool r = j->released || rc->stopping;
	pthread_mutex_unlock(&rc->lock);
	return r;
}

/* Ends a job that job_released found given up: its client went away, or http-api is stopping.
 * Returns whether http-api is stopping. */
static bool job_fail_released(struct runner_client *rc, struct runner_job *j)
{
	pthread_mutex_lock(&rc->lock);
	const bool stopping = rc->stopping;
	job_fail_locked(j, 503, stopping ? "http-api is stopping" : "cancelled: the client went away");
	pthread_mutex_unlock(&rc->lock);
	return stopping;
}

/* Closes the connection (the runner cancels what it generates for it) and opens a new one. */
static void reset_connection(struct worker *w)
{
	if (w->client && rpc_client_reset(w->client) != 0)
		rpc_client_destroy(&w->client);
}

/* Who listens on the runner's socket: 0 when nobody does (or unknown), else its pid. */
static bool runner_listening(const char *path, int *pid)
{
	*pid = 0;
	return bus_unix_listener(path, pid);
}

/* Keeps a received token's id for a resume (under the lock). */
static int keep_id(struct runner_job *j, uint64_t id)
{
	if (j->n_tokens >= j->ids_cap) {
		size_t cap = j->ids_cap ? j->ids_cap * 2 : 256;
		uint64_t *t = realloc(j->ids, cap * sizeof(*t));
		if (!t)
			return -ENOMEM;
		j->ids = t;
		j->ids_cap = cap;
	}
	j->ids[j->n_tokens] = id;
	return 0;
}

/* How reading the replies ended: READ_LOST and READ_STOPPED (a runner that was stopped, which may
 * still listen for a moment: the resume waits for another one) may be resumed. */
enum read_end { READ_ENDED, READ_LOST, READ_STOPPED };

/* The runner of the job went away (how: READ_LOST or READ_STOPPED): that, where requests are
 * resumed, else the job fails. */
static enum read_end runner_gone(struct worker *w, struct runner_job *j, enum read_end how)
{
	reset_connection(w);
	if (w->rc->o.resume_timeout_ms > 0)
		return how;
	job_fail(w->rc, j, 503, "gpu-runner %s during the request (its supervisor starts it again; send the request again)",
		 how == READ_STOPPED ? "was stopped" : "went away");
	return READ_ENDED;
}

/* Reads the replies to the GENERATE corr until it ends: READ_ENDED (done or failed, the job says
 * which), or READ_LOST / READ_STOPPED when the runner went away and the request may be sent again.
 * A runner that is stopped (its supervisor's SIGTERM, pipectl stop) ends the request it runs as
 * "cancelled", or answers it with ESHUTDOWN or ECANCELED: http-api never asks for that (it cancels
 * by closing the connection, and reads no more), so it is the runner going away too, not the end
 * of the answer.
 * Every reply is checked: tokens in order, no more than max_new of them, text that is UTF-8,
 * counts that fit the request. */
static enum read_end read_replies(struct worker *w, struct runner_job *j, uint64_t corr,
				  const char *sock_path, int listener)
{
	struct runner_client *rc = w->rc;
	uint64_t last_reply = now_ns(), last_check = last_reply;
	for (;;) {
		struct msg rep;
		int r = rpc_wait(w->client, corr, &rep, WAIT_SLICE_MS);
		uint64_t now = now_ns();
		if (job_released(rc, j)) {
			msg_free(&rep);
			reset_connection(w);
			const bool stopping = job_fail_released(rc, j);
			log_info("%s: the generation is cancelled", stopping ? "stopping" : "the client went away");
			return READ_ENDED;
		}
		if (r == -ETIMEDOUT) {
			msg_free(&rep);
			if (now - last_reply >= (uint64_t)rc->o.reply_timeout_ms * 1000000ull) {
				reset_connection(w);
				job_fail(rc, j, 503, "gpu-runner sent nothing for %ld s",
					 rc->o.reply_timeout_ms / 1000);
				return READ_ENDED;
			}
			if (now - last_check >= LISTENER_CHECK_MS * 1000000ull) {
				last_check = now;
				int pid;
				bool up = runner_listening(sock_path, &pid);
				if (!up || (listener && pid && pid != listener))
					return runner_gone(w, j, READ_LOST);
			}
			continue;
		}
		if (r == -EREMOTEIO && (rep.error.code == ESHUTDOWN || rep.error.code == ECANCELED)) {
			/* A runner that is stopping: the request queued on it not run, or cut off where the
			 * stop was noticed in a wait (for weights, for the KV store). Gone, as below. */
			msg_free(&rep);
			return runner_gone(w, j, READ_STOPPED);
		}
		if (r == -EREMOTEIO) {
			job_fail(rc, j, status_of_runner_error(rep.error.code), "gpu-runner: %s",
				 rep.error.text.p ? rep.error.text.p : "(no text)");
			msg_free(&rep);
			return READ_ENDED;
		}
		if (r) {
			msg_free(&rep);
			reset_connection(w);
			job_fail(rc, j, 500, "reading gpu-runner's reply failed: %s", strerror(-r));
			return READ_ENDED;
		}
		last_reply = now;
		if (rep.type == MSG_GEN_DONE && rep.gen_done.reason.p && !strcmp(rep.gen_done.reason.p, "cancelled") &&
		    j->n_tokens < j->max_new) {
			/* (A stop that came with the last token ends nothing: the answer is whole.) */
			msg_free(&rep);
			return runner_gone(w, j, READ_STOPPED);
		}
		pthread_mutex_lock(&rc->lock);
		int fail = 0;
		if (rep.type == MSG_TOKEN) {
			if (rep.token.index != j->n_tokens)
				fail = 1;
			else if (j->n_tokens >= j->max_new)
				fail = 4;
			else if (!utf8_valid(rep.token.text.p, rep.token.text.len))
				fail = 5;
			else if (keep_id(j, rep.token.token) || append_text(j, rep.token.text.p, rep.token.text.len))
				fail = 2;
			else
				j->n_tokens++;
		} else if (rep.type == MSG_GEN_DONE) {
			if (!utf8_valid(rep.gen_done.text.p, rep.gen_done.text.len)) {
				fail = 5;
			} else if (rep.gen_done.n_generated > j->max_new || rep.gen_done.n_prompt > UINT32_MAX) {
				fail = 6;
			} else if (append_text(j, rep.gen_done.text.p, rep.gen_done.text.len)) {
				fail = 2;
			} else {
				j->n_prompt = rep.gen_done.n_prompt;
				j->n_generated = rep.gen_done.n_generated;
				const char *why = rep.gen_done.reason.p ? rep.gen_done.reason.p : "";
				if (!strcmp(why, "cancelled"))
					why = "length"; /* stopped with its last token (above): whole */
				snprintf(j->reason, sizeof(j->reason), "%s", why);
				j->state = JOB_DONE;
			}
		} else if (rep.type != MSG_LOGITS) {
			fail = 3;
		}
		if (fail == 1)
			job_fail_locked(j, 500, "gpu-runner sent a token out of order");
		else if (fail == 2)
			job_fail_locked(j, 500, "out of memory");
		else if (fail == 3)
			job_fail_locked(j, 500, "gpu-runner answered GENERATE with an unexpected message");
		else if (fail == 4)
			job_fail_locked(j, 500, "gpu-runner sent more tokens than the request's max_tokens");
		else if (fail == 5)
			job_fail_locked(j, 500, "gpu-runner sent text that is not UTF-8");
		else if (fail == 6)
			job_fail_locked(j, 500, "gpu-runner's counts do not fit the request (more generated than "
						"max_tokens, or a prompt past 2^32 tokens)");
		pthread_cond_broadcast(&j->cond);
		bool ended = j->state == JOB_DONE || j->state == JOB_FAILED;
		pthread_mutex_unlock(&rc->lock);
		uint32_t type = rep.type;
		msg_free(&rep);
		if (fail) {
			log_warn("request failed: gpu-runner's reply %s did not fit the request", msg_type_name(type));
			reset_connection(w);
		}
		if (ended)
			return READ_ENDED;
	}
}

static void set_text(struct bytes *b, const char *s)
{
	if (s) {
		b->p = (char *)s;
		b->len = (uint32_t)strlen(s);
	}
}

/* Opens the worker's connection if it has none and asks for HELLO. Returns 0, or -errno with why
 * filled and *status the HTTP status to fail with (503: no runner; 500). */
static int say_hello(struct worker *w, const char *path, int *status, char *why, size_t len)
{
	struct runner_client *rc = w->rc;
	*status = 503;
	struct stat st;
	if (stat(path, &st) != 0) {
		snprintf(why, len, "gpu-runner of the instance is not running (no socket %s)", path);
		return -ENOENT;
	}
	if (!w->client) {
		w->client = rpc_client_create(rc->o.zctx, rc->run_dir, RUNNER, "http-api");
		if (!w->client) {
			int e = errno ? errno : ENOMEM;
			*status = 500;
			snprintf(why, len, "cannot open a client of gpu-runner at %s: %s", path, strerror(e));
			return -e;
		}
	}
	struct msg hello;
	int r = rpc_hello(w->client, &hello, (int)rc->o.hello_timeout_ms);
	if (r) {
		snprintf(why, len, "gpu-runner did not answer HELLO: %s",
			 r == -EREMOTEIO && hello.error.text.p ? hello.error.text.p : strerror(-r));
		reset_connection(w);
	}
	msg_free(&hello);
	return r;
}

/* The runner went away during the job: waits up to resume_timeout_ms for the new one to answer
 * HELLO (another process than old where old is not 0: a runner that was stopped, which may still
 * answer for a moment). Returns 0 when it did, -ECANCELED when the job was released meanwhile,
 * else -ETIMEDOUT with why filled. */
static int await_runner(struct worker *w, struct runner_job *j, const char *path, int old, char *why, size_t len)
{
	struct runner_client *rc = w->rc;
	uint64_t until = now_ns() + (uint64_t)rc->o.resume_timeout_ms * 1000000ull;
	snprintf(why, len, "no answer");
	for (;;) {
		if (job_released(rc, j))
			return -ECANCELED;
		int pid, status;
		if (runner_listening(path, &pid) && (!old || !pid || pid != old) &&
		    say_hello(w, path, &status, why, len) == 0)
			return 0;
		if (now_ns() >= until)
			return -ETIMEDOUT;
		struct timespec ts = {0, WAIT_SLICE_MS * 1000000L};
		nanosleep(&ts, NULL);
	}
}

static void run_job(struct worker *w, struct runner_job *j)
{
	struct runner_client *rc = w->rc;
	char path[512], why[512];
	snprintf(path, sizeof(path), "%s/%s.ctl", rc->run_dir, RUNNER);
	int status;
	int r = say_hello(w, path, &status, why, sizeof(why));
	/* The runner answers HELLO between its steps, and a step can take seconds (a prompt's chunk, a
	 * layer streamed from disk): while it still listens, this request waits for it, as it would
	 * for the replies of a generation (--timeout), until it answers, goes away, or the client does. */
	const uint64_t until = now_ns() + (uint64_t)rc->o.reply_timeout_ms * 1000000ull;
	for (int pid; r == -ETIMEDOUT && now_ns() < until && runner_listening(path, &pid);) {
		/* job_released is also true once http-api stops; a slice between tries keeps a short
		 * --hello-timeout-ms from opening a connection a millisecond. */
		if (job_released(rc, j)) {
			(void)job_fail_released(rc, j);
			return;
		}
		struct timespec ts = {0, WAIT_SLICE_MS * 1000000L};
		nanosleep(&ts, NULL);
		r = say_hello(w, path, &status, why, sizeof(why));
	}
	if (r) {
		job_fail(rc, j, status, "%s", why);
		return;
	}
	for (;;) {
		int listener = 0;
		runner_listening(path, &listener);

		struct msg req;
		msg_init(&req, MSG_GENERATE, 0);
		req.generate.max_new = j->max_new;
		req.generate.temperature = j->temperature;
		req.generate.top_p = j->top_p;
		req.generate.top_k = j->top_k;
		req.generate.min_p = j->min_p;
		req.generate.repetition_penalty = j->repetition_penalty;
		req.generate.seed = j->seed;
		set_text(&req.generate.prompt, j->prompt);
		set_text(&req.generate.chat, j->chat_json);
		set_text(&req.generate.stop_strings, j->stops_json);
		/* A chat's messages are text: special-token text in a message's content (a user's
		 * "<|eot_id|><|start_header_id|>system...") must not end its turn and open another; only
		 * the chat format's renderer puts the turns' tokens. */
		req.generate.flags = GEN_TEXT | (j->ignore_eos ? GEN_IGNORE_EOS : 0) |
				     (j->chat_json ? GEN_SPECIAL_AS_TEXT : 0);
		/* Only the worker changes ids and n_tokens: no lock needed to read them here. */
		req.generate.done = (struct u64_array){j->ids, (uint32_t)j->n_tokens};
		uint64_t corr;
		r = rpc_send(w->client, &req, &corr);
		if (r) {
			reset_connection(w);
			job_fail(rc, j, r == -EINVAL ? 400 : 503, "cannot send GENERATE to gpu-runner: %s",
				 r == -EINVAL ? "the request exceeds the protocol's limits" : strerror(-r));
			return;
		}
		const enum read_end end = read_replies(w, j, corr, path, listener);
		if (end == READ_ENDED)
			return;
		if (end == READ_LOST && j->deaths >= RUNNER_RESUMES_MAX) {
			/* A request whose runner died this often may be what kills it: sent again, it would
			 * take the runner down until the supervisor gave up on it, and every request with it.
			 * A runner that was stopped (a restart, a stop) says nothing of the request. */
			job_fail(rc, j, 503,
				 "gpu-runner went away %u times during the request (after %llu tokens): it is not "
				 "sent again",
				 j->deaths + 1, (unsigned long long)j->n_tokens);
			return;
		}
		log_warn("gpu-runner went away during a request after %llu tokens: waiting up to %ld s for it to "
			 "be started again",
			 (unsigned long long)j->n_tokens, rc->o.resume_timeout_ms / 1000);
		r = await_runner(w, j, path, end == READ_STOPPED ? listener : 0, why, sizeof(why));
		if (r == -ECANCELED) {
			(void)job_fail_released(rc, j);
			return;
		}
		if (r) {
			job_fail(rc, j, 503,
				 "gpu-runner went away during the request and did not come back in %ld s (%s); send "
				 "the request again",
				 rc->o.resume_timeout_ms / 1000, why);
			return;
		}
		j->resumes++;
		j->deaths += end == READ_LOST;
		pthread_mutex_lock(&rc->lock);
		rc->resumes++;
		pthread_mutex_unlock(&rc->lock);
		log_info("gpu-runner is back: resuming the request after %llu tokens (resume %u)",
			 (unsigned long long)j->n_tokens, j->resumes);
	}
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	struct runner_client *rc = w->rc;
	pthread_mutex_lock(&rc->lock);
	for (;;) {
		while (!rc->head && !rc->stopping)
			pthread_cond_wait(&rc->work, &rc->lock);
		if (rc->stopping)
			break;
		struct runner_job *j = rc->head;
		rc->head = j->next;
		if (!rc->head)
			rc->tail = NULL;
		rc->queued--;
		if (j->released) {
			job_unref_locked(j);
			continue;
		}
		j->state = JOB_RUNNING;
		rc->busy++;
		pthread_cond_broadcast(&j->cond);
		pthread_mutex_unlock(&rc->lock);
		run_job(w, j);
		pthread_mutex_lock(&rc->lock);
		rc->busy--;
		job_unref_locked(j);
	}
	/* Stopping: what still waits fails (the first worker out takes the queue). */
	while (rc->head) {
		struct runner_job *j = rc->head;
		rc->head = j->next;
		job_fail_locked(j, 503, "http-api is stopping");
		job_unref_locked(j);
	}
	rc->tail = NULL;
	rc->queued = 0;
	pthread_mutex_unlock(&rc->lock);
	rpc_client_destroy(&w->client);
	return NULL;
}

int runner_client_start(const struct runner_options *o, struct runner_client **out, char *err, size_t errlen)
{
	struct runner_client *rc = calloc(1, sizeof(*rc));
	long n = o->concurrency > 0 ? o->concurrency : 1;
	if (!rc || !(rc->workers = calloc((size_t)n, sizeof(*rc->workers)))) {
		free(rc);
		return errorf(err, errlen, -ENOMEM, "out of memory");
	}
	rc->o = *o;
	rc->o.concurrency = n;
	if (str_copy(rc->run_dir, sizeof(rc->run_dir), o->run_dir) != 0) {
		free(rc->workers);
		free(rc);
		return errorf(err, errlen, -ENAMETOOLONG, "run directory path too long: %s", o->run_dir);
	}
	rc->o.run_dir = rc->run_dir;
	pthread_mutex_init(&rc->lock, NULL);
	pthread_cond_init(&rc->work, NULL);
	for (long i = 0; i < n; i++) {
		rc->workers[i].rc = rc;
		int r = pthread_create(&rc->workers[i].thread, NULL, worker_main, &rc->workers[i]);
		if (r) {
			runner_client_destroy(&rc);
			return errorf(err, errlen, -r, "cannot start the runner threads: %s", strerror(r));
		}
		rc->workers[i].started = true;
		rc->n_workers++;
	}
	*out = rc;
	return 0;
}

void runner_client_stop(struct runner_client *rc)
{
	if (!rc)
		return;
	pthread_mutex_lock(&rc->lock);
	bool joined = rc->stopping;
	rc->stopping = true;
	pthread_cond_broadcast(&rc->work);
	pthread_mutex_unlock(&rc->lock);
	if (joined)
		return;
	for (long i = 0; i < rc->n_workers; i++)
		if (rc->workers[i].started)
			pthread_join(rc->workers[i].thread, NULL);
}

void runner_client_destroy(struct runner_client **rcp)
{
	struct runner_client *rc = *rcp;
	if (!rc)
		return;
	runner_client_stop(rc);
	pthread_cond_destroy(&rc->work);
	pthread_mutex_destroy(&rc->lock);
	free(rc->workers);
	free(rc);
	*rcp = NULL;
}

static char *dup_or_null(const char *s, bool *failed)
{
	if (!s)
		return NULL;
	char *d = strdup(s);
	if (!d)
		*failed = true;
	return d;
}

int runner_submit(struct runner_client *rc, const struct runner_params *p, struct runner_job **out)
{
	struct runner_job *j = calloc(1, sizeof(*j));
	if (!j)
		return -ENOMEM;
	bool failed = false;
	j->prompt = dup_or_null(p->prompt, &failed);
	j->chat_json = dup_or_null(p->chat_json, &failed);
	j->stops_json = dup_or_null(p->stops_json, &failed);
	j->max_new = p->max_new;
	j->temperature = p->temperature;
	j->top_p = p->top_p;
	j->top_k = p->top_k;
	j->min_p = p->min_p;
	j->repetition_penalty = p->repetition_penalty;
	j->ignore_eos = p->ignore_eos;
	j->seed = p->seed;
	j->rc = rc;
	j->refs = 2;
	j->state = JOB_QUEUED;
	pthread_cond_init(&j->cond, NULL);
	int r = failed ? -ENOMEM : 0;
	pthread_mutex_lock(&rc->lock);
	if (!r && rc->stopping)
		r = -ESHUTDOWN;
	else if (!r && runner_queue_refuses(rc->queued, rc->busy, rc->n_workers, rc->o.max_queue))
		r = -EAGAIN;
	if (r) {
		j->refs = 1;
		job_unref_locked(j);
		pthread_mutex_unlock(&rc->lock);
		return r;
	}
	if (rc->tail)
		rc->tail->next = j;
	else
		rc->head = j;
	rc->tail = j;
	rc->queued++;
	pthread_cond_signal(&rc->work);
	pthread_mutex_unlock(&rc->lock);
	*out = j;
	return 0;
}

bool runner_job_wait(struct runner_job *j, size_t have_len, uint64_t have_tokens, int timeout_ms,
		     struct runner_view *v)
{
	struct runner_client *rc = j->rc;
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	if (timeout_ms > 0) {
		until.tv_sec += timeout_ms / 1000;
		until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
		if (until.tv_nsec >= 1000000000L) {
			until.tv_sec++;
			until.tv_nsec -= 1000000000L;
		}
	}
	pthread_mutex_lock(&rc->lock);
	bool changed;
	for (;;) {
		changed = j->len > have_len || j->n_tokens > have_tokens || j->state == JOB_DONE ||
			  j->state == JOB_FAILED;
		if (changed || timeout_ms == 0)
			break;
		if (timeout_ms < 0)
			pthread_cond_wait(&j->cond, &rc->lock);
		else if (pthread_cond_timedwait(&j->cond, &rc->lock, &until) == ETIMEDOUT)
			break;
	}
	memset(v, 0, sizeof(*v));
	v->state = j->state;
	v->len = j->len;
	v->n_tokens = j->n_tokens;
	v->n_prompt = j->n_prompt;
	v->n_generated = j->n_generated;
	v->http_status = j->http_status;
	snprintf(v->reason, sizeof(v->reason), "%s", j->reason);
	snprintf(v->error, sizeof(v->error), "%s", j->error);
	if (j->len > have_len) {
		v->fresh = malloc(j->len - have_len + 1);
		if (v->fresh) {
			memcpy(v->fresh, j->text + have_len, j->len - have_len);
			v->fresh[j->len - have_len] = 0;
			v->fresh_len = j->len - have_len;
		} else {
			v->state = JOB_FAILED;
			v->http_status = 500;
			snprintf(v->error, sizeof(v->error), "out of memory");
		}
	}
	pthread_mutex_unlock(&rc->lock);
	return changed;
}

void runner_job_release(struct runner_job *j)
{
	if (!j)
		return;
	struct runner_client *rc = j->rc;
	pthread_mutex_lock(&rc->lock);
	j->released = true;
	if (j->state == JOB_QUEUED) {
		/* Out of the queue now, with the queue's reference: a client that gave up waiting must
		 * not hold a place that --max-queue counts (clients that time out and come again would
		 * fill it, and every new request would get 429 until the workers reached them). */
		struct runner_job **at = &rc->head, *prev = NULL;
		while (*at && *at != j) {
			prev = *at;
			at = &(*at)->next;
		}
		if (*at == j) {
			*at = j->next;
			if (rc->tail == j)
				rc->tail = prev;
			rc->queued--;
			job_unref_locked(j);
		}
	}
	job_unref_locked(j);
	pthread_mutex_unlock(&rc->lock);
}

long runner_queue_length(struct runner_client *rc)
{
	pthread_mutex_lock(&rc->lock);
	long n = rc->queued;
	pthread_mutex_unlock(&rc->lock);
	return n;
}

uint64_t runner_resumes(struct runner_client *rc)
{
	pthread_mutex_lock(&rc->lock);
	uint64_t n = rc->resumes;
	pthread_mutex_unlock(&rc->lock);
	return n;
}

long runner_in_flight(struct runner_client *rc)
{
	pthread_mutex_lock(&rc->lock);
	long b = rc->busy;
	pthread_mutex_unlock(&rc->lock);
	return b;
}

/* A short-lived client of service (its control socket must exist) into *c; 0, or -errno with err set. */
static int open_client(const struct runner_options *o, const char *service, struct rpc_client **c, char *err,
		       size_t errlen)
{
	char path[512];
	struct stat st;
	snprintf(path, sizeof(path), "%s/%s.ctl", o->run_dir, service);
	if (stat(path, &st) != 0)
		return errorf(err, errlen, -ENOENT, "%s is not running (no socket %s)", service, path);
	*c = rpc_client_create(o->zctx, o->run_dir, service, "http-api");
	if (!*c)
		return errorf(err, errlen, -errno, "cannot open a client of %s: %s", service, strerror(errno));
	return 0;
}

int runner_probe(const struct runner_options *o, const char *service, char *err, size_t errlen)
{
	struct rpc_client *c;
	int orc = open_client(o, service, &c, err, errlen);
	if (orc)
		return orc;
	struct msg rep;
	int r = rpc_hello(c, &rep, (int)o->hello_timeout_ms);
	if (r == -ETIMEDOUT)
		errorf(err, errlen, r, "%s did not answer HELLO in %ld ms", service, o->hello_timeout_ms);
	else if (r)
		errorf(err, errlen, r, "%s: %s", service,
		       r == -EREMOTEIO && rep.error.text.p ? rep.error.text.p : strerror(-r));
	msg_free(&rep);
	rpc_client_destroy(&c);
	return r;
}

int runner_stats_json(const struct runner_options *o, const char *service, int timeout_ms, char **json, char *err,
		      size_t errlen)
{
	*json = NULL;
	struct rpc_client *c;
	int orc = open_client(o, service, &c, err, errlen);
	if (orc)
		return orc;
	struct msg req, rep;
	msg_init(&req, MSG_STATS_GET, 0);
	int r = rpc_call(c, &req, &rep, timeout_ms);
	if (r == -ETIMEDOUT) {
		errorf(err, errlen, r, "%s did not answer STATS_GET in %d ms", service, timeout_ms);
	} else if (r) {
		errorf(err, errlen, r, "%s: STATS_GET: %s", service,
		       r == -EREMOTEIO && rep.error.text.p ? rep.error.text.p : strerror(-r));
	} else if (rep.type != MSG_STATS || !rep.stats.json.p) {
		r = errorf(err, errlen, -EBADMSG, "%s answered STATS_GET with %s", service, msg_type_name(rep.type));
	} else {
		*json = malloc((size_t)rep.stats.json.len + 1);
		if (!*json) {
			r = errorf(err, errlen, -ENOMEM, "out of memory");
		} else {
			memcpy(*json, rep.stats.json.p, rep.stats.json.len);
			(*json)[rep.stats.json.len] = 0;
		}
	}
	msg_free(&rep);
	rpc_client_destroy(&c);
	return r;
}

int runner_model_name(const struct runner_options *o, char *buf, size_t len, char *err, size_t errlen)
{
	static const char loader[] = "ssd-loader", keys[] = "[\"model\"]";
	struct rpc_client *c;
	int orc = open_client(o, loader, &c, err, errlen);
	if (orc)
		return orc;
	struct msg req, rep;
	msg_init(&req, MSG_CONFIG_GET, 0);
	req.config_get.keys.p = (char *)keys;
	req.config_get.keys.len = (uint32_t)strlen(keys);
	int r = rpc_call(c, &req, &rep, (int)o->hello_timeout_ms);
	if (r) {
		errorf(err, errlen, r, "%s did not give its model: %s", loader,
		       r == -EREMOTEIO && rep.error.text.p ? rep.error.text.p : strerror(-r));
		goto out;
	}
	if (rep.type != MSG_CONFIG) {
		r = errorf(err, errlen, -EBADMSG, "%s answered CONFIG_GET with %s", loader, msg_type_name(rep.type));
		goto out;
	}
	json_t *root = json_loadb(rep.config.json.p, rep.config.json.len, 0, NULL);
	const char *model = json_string_value(json_object_get(json_object_get(root, "model"), "value"));
	if (!model || !*model) {
		r = errorf(err, errlen, -EBADMSG, "%s's parameters hold no model path", loader);
	} else {
		size_t n = strlen(model);
		while (n > 1 && model[n - 1] == '/')
			n--;
		size_t start = n;
		while (start > 0 && model[start - 1] != '/')
			start--;
		size_t name_len = n - start;
		if (name_len > 5 && !strncmp(model + n - 5, ".gguf", 5))
			name_len -= 5;
		if (name_len + 1 > len)
			name_len = len - 1;
		memcpy(buf, model + start, name_len);
		buf[name_len] = 0;
		r = 0;
	}
	json_decref(root);
out:
	msg_free(&rep);
	rpc_client_destroy(&c);
	return r;
}

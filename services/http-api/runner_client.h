/* runner_client.h - http-api's side of the ZeroMQ exchange with the instance's gpu-runner:
 * `concurrency` worker threads, each with a connection of its own, serve a queue of generation jobs,
 * a job at a time each (the runner computes them together: continuous batching); the HTTP threads
 * submit jobs and read their text as it comes.
 *
 *   struct runner_client *rc;  runner_client_start(&opts, &rc, err, sizeof(err));
 *   struct runner_job *j;
 *   rc = runner_submit(rc, &params, &j);      // -EAGAIN: the queue is full (HTTP 429)
 *   while (runner_job_wait(j, seen, ...)) ...  // text appended, then done (or an error)
 *   runner_job_release(j);                   // the HTTP side is done with it: a job still
 *                                            // running is cancelled
 *   runner_client_stop(rc); ... runner_client_destroy(&rc);
 *
 * A job sends MSG_GENERATE (prompt | chat, max_new, sampling, stop strings, GEN_TEXT) after a
 * HELLO that tells whether the runner is there, and reads MSG_TOKEN... MSG_GEN_DONE or
 * MSG_ERROR as pipectl generate does. Cancelling closes the connection: the runner then fails
 * to send the next token to it and ends the generation (its cancel).
 *
 * A runner that dies during a request does not lose it: the job keeps the token ids received so
 * far, waits (resume_timeout_ms) for the supervisor's new runner to answer HELLO, and sends the
 * request again with those ids as MSG_GENERATE's done part. The new runner continues where the
 * stream was cut off (the same tokens as an uninterrupted run, greedy or seeded), so the reader
 * sees one stream with no token twice and none missing. */
#ifndef HTTP_API_RUNNER_CLIENT_H
#define HTTP_API_RUNNER_CLIENT_H
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Times a request is sent again to a new runner after its runner died during it (the third death
 * fails it: a request that kills the runner must not take it down until the supervisor gives up).
 * A runner stopped during it (a restart, SIGTERM) does not count. */
#define RUNNER_RESUMES_MAX 2

struct runner_options {
	void *zctx;		 /* the ZeroMQ context (thread-safe; each thread opens its own sockets) */
	const char *run_dir;	 /* the instance's run directory: <run_dir>/gpu-runner.ctl */
	long concurrency;	 /* jobs sent to the runner at once, each by a worker of its own (the runner
				  * batches them: --max-batch); 0: 1 */
	long max_queue;		 /* jobs that may wait behind those running */
	long hello_timeout_ms;	 /* how long the runner may take to answer HELLO before it counts as down */
	long reply_timeout_ms;	 /* the longest silence between two replies of a generation */
	long resume_timeout_ms;	 /* how long to wait for a runner that died during a request to come back;
				  * 0: the request fails at once */
};

/* What to generate: borrowed by runner_submit, which copies it. */
struct runner_params {
	const char *prompt;	  /* text, or NULL */
	const char *chat_json;	  /* a JSON array of {"role", "content"}, or NULL; one of the two */
	const char *stops_json;	  /* a JSON array of stop strings, or NULL */
	uint64_t max_new;
	double temperature, top_p, min_p, repetition_penalty;
	uint64_t top_k, seed;
	bool ignore_eos;	  /* GEN_IGNORE_EOS */
};

/* A job's state, read by the HTTP side under runner_job_wait. */
enum runner_job_state { JOB_QUEUED, JOB_RUNNING, JOB_DONE, JOB_FAILED };

struct runner_job;

/* A snapshot of a job for its reader. */
struct runner_view {
	enum runner_job_state state;
	char *fresh;	   /* a malloc'd copy of the text after have_len (the caller frees it), or NULL */
	size_t fresh_len;  /* its bytes */
	size_t len;	   /* the bytes of text generated so far */
	uint64_t n_tokens;		/* MSG_TOKENs received */
	uint64_t n_prompt, n_generated; /* JOB_DONE: from MSG_GEN_DONE */
	char reason[32];		/* JOB_DONE: the runner's reason */
	int http_status;		/* JOB_FAILED: 400 (the runner refused the request), 503 (no runner) or 500 */
	char error[512];		/* JOB_FAILED: why */
};

struct runner_client;

/* Starts the worker thread. Returns 0 with *out set, or -errno with err filled. */
int runner_client_start(const struct runner_options *o, struct runner_client **out, char *err, size_t errlen);

/* Cancels every job and stops the worker; the jobs' readers see JOB_FAILED (503) and may still
 * release their jobs. Later submits fail with -ESHUTDOWN. Safe twice. */
void runner_client_stop(struct runner_client *rc);

/* Stops (if not yet) and frees the client, once no reader holds a job. *rc is NULL after. */
void runner_client_destroy(struct runner_client **rc);

/* Is a new job refused (429) with queued jobs waiting for a worker, busy workers running one, of
 * n_workers, and room for max_queue jobs to wait behind those running? It is when it would wait
 * (as many jobs queued as idle workers, or more) and max_queue jobs would already wait ahead of it.
 * A job queued but not yet taken by an idle worker makes no one wait while another worker is idle. */
static inline bool runner_queue_refuses(long queued, long busy, long n_workers, long max_queue)
{
	long idle = n_workers > busy ? n_workers - busy : 0;
	return queued >= idle && queued - idle >= max_queue; /* queued - idle: ahead of it, once workers take theirs */
}

/* Queues a generation. Returns 0 with *out (release it with runner_job_release), -EAGAIN when it
 * would have to wait and max_queue jobs already wait, -ESHUTDOWN when stopping, -ENOMEM. */
int runner_submit(struct runner_client *rc, const struct runner_params *p, struct runner_job **out);

/* Waits until the job has more than have_len bytes of text, more than have_tokens tokens, or has
 * ended (JOB_DONE or JOB_FAILED), or timeout_ms passes (-1: no limit); fills *v (free v->fresh).
 * Returns true when something changed, false on the timeout. */
bool runner_job_wait(struct runner_job *j, size_t have_len, uint64_t have_tokens, int timeout_ms,
		     struct runner_view *v);

/* The HTTP side is done with the job (the client went away, or all was sent): a job still
 * queued is dropped, one running is cancelled; the job is freed once the worker is done too. */
void runner_job_release(struct runner_job *j);

/* Jobs waiting in the queue (not the one running). */
long runner_queue_length(struct runner_client *rc);

/* Requests sent again to a new runner after theirs died, since the start. */
uint64_t runner_resumes(struct runner_client *rc);

/* Generations running now (at most concurrency): the runner may then be slow to answer a HELLO
 * (a long prefill), while the workers watch that it is still there. */
long runner_in_flight(struct runner_client *rc);

/* Asks service (a service of the instance, e.g. "gpu-runner") for HELLO with its own socket, from
 * any thread. Returns 0 when it answered, else -errno (-ENOENT: no socket; -ETIMEDOUT) with err
 * filled. */
int runner_probe(const struct runner_options *o, const char *service, char *err, size_t errlen);

/* The model the instance serves: the basename of ssd-loader's "model" parameter (MSG_CONFIG_GET),
 * without ".gguf". Returns 0 with buf filled, or -errno with err filled. */
int runner_model_name(const struct runner_options *o, char *buf, size_t len, char *err, size_t errlen);

/* The counters of service (e.g. "gpu-runner", "ssd-loader"): its MSG_STATS JSON, as pipectl stats
 * prints it, asked with a socket of its own so that the worker's connection is not waited for;
 * timeout_ms bounds the wait (a runner deep in a generation may not answer). Returns 0 with *json
 * (malloc'd, NUL-terminated; the caller frees it), or -errno (-ENOENT: no socket; -ETIMEDOUT;
 * -EBADMSG: another reply) with err filled. */
int runner_stats_json(const struct runner_options *o, const char *service, int timeout_ms, char **json, char *err,
		      size_t errlen);

#endif

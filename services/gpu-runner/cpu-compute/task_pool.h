/* task_pool.h - CPU worker threads pinned to cores that run jobs split into parts, fed by a
 * lock-free queue (task_queue.h); the runner's CPU share of a layer runs here, triggered from a
 * CUDA stream (cuda/cpu_handoff.h) or from any thread.
 *
 *   struct task_pool_config cfg;
 *   task_pool_config_default(&cfg);            // a worker per allowed CPU, pinned
 *   cfg.cpu_offset = 1;                        // leave the first allowed CPU to the runner's thread
 *   rc = task_pool_create(&cfg, &pool, err, sizeof(err));
 *
 *   static uint32_t done, waiters;            // may be mapped pinned memory a GPU stream polls
 *   struct task_job job;
 *   task_job_init(&job, rows_fn, &args, 16, &done, 1);   // 16 parts; completion stores 1 in done
 *   job.done_waiters = &waiters;               // so task_word_wait can sleep on done
 *   task_pool_submit(pool, &job);
 *   task_word_wait(&done, &waiters, 1, 20, 0);   // or a GPU stream waits on done
 *   if (job.rc) ... job.err says which part failed and why ...
 *   task_pool_destroy(&pool);
 *
 * A part function runs part p of n (task_part_range splits rows evenly) and returns 0 or -errno
 * with a message in err. Workers take (job, part) items from the queue in FIFO order, any worker
 * any part; the part that finishes last completes the job: it calls the job's on_complete hook,
 * then stores done_value into *done_word with release order, so everything the parts wrote (and
 * rc, err) is visible to whoever sees the value with an acquire load, or to a GPU that polls the
 * word (the release orders the earlier stores before it for every observer, and a GPU reads host
 * memory coherently). If parts failed, rc and err hold the first failure; the completion is
 * stored all the same, so nothing waiting on the word hangs. A part must not wait for another job
 * of the same pool: every worker could end up waiting. It may wait for work of its own job that
 * running parts took and finish before they wait for anything (ffn_share's phases), and run the
 * queue's parts meanwhile (task_pool_help): any part may then run inside a waiting one.
 *
 * Idle workers spin spin_us (pause instruction, retrying the queue), then sleep on a futex; a
 * submit wakes as many sleepers as it queued parts. An idle pool uses no CPU once spin_us has
 * passed. Submitting never blocks: when the queue is full, the submitter runs queued parts itself
 * until its own fit.
 *
 * Destroy stops the workers after the parts they are running; parts still queued are failed with
 * "part P of N: task pool: stopped before the part ran" and their jobs completed (the words stored), and a
 * job submitted after destroy began is failed the same way. Destroy joins every thread.
 *
 * The job is the submitter's memory: it must stay valid, and unchanged, until its done word shows
 * done_value; the pool touches neither the job nor its hook's data after that store. The words
 * are not the job's: the completing thread reads the waiter count, and may wake sleepers on the
 * word, just after its store, so done_word and done_waiters must stay valid until the pool is
 * destroyed, or until task_pool_quiesce returns after the last of their jobs was seen done.
 * Words shared with other threads or a GPU (done_word, done_waiters) are plain uint32_t accessed
 * with the compiler's __atomic builtins, so this header serves C and the C++ of nvcc alike.
 */
#ifndef GPU_RUNNER_TASK_POOL_H
#define GPU_RUNNER_TASK_POOL_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

#define TASK_POOL_MAX_THREADS 1024
#define TASK_POOL_HELP_DEPTH 1 /* parts a thread runs inside a waiting one (task_pool_help) */
#define TASK_POOL_MAX_PARTS (1u << 20) /* parts of one job */
#define TASK_ERR_MAX 256	       /* a job's message, NUL included */

/* Runs part `part` of `n_parts` of a job. Returns 0, or -errno with a message in err (errlen
 * bytes, TASK_ERR_MAX) naming what failed. A positive return is a programmer error (asserted). */
typedef int (*task_fn)(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen);

/* The idle hook (task_pool_set_idle): called by each idle worker at every turn of its spin, with
 * the argument it was set with. Returns how much it did (non-zero: counted in idle_work). It must
 * not block; it may submit jobs (which the worker then takes parts of, as any other). */
typedef uint32_t (*task_idle_fn)(void *arg);

struct task_job;
/* Called once per job by the thread that completes it, before the done word is stored: rc and
 * err are final. Must not block; the job may be reused as soon as the word is stored. */
typedef void (*task_done_fn)(struct task_job *job);

struct task_job {
	/* The submitter's (task_job_init), unchanged while the job runs. */
	task_fn fn;
	void *arg;		/* fn's first argument */
	uint32_t n_parts;	/* 0..TASK_POOL_MAX_PARTS; 0 completes at submit */
	uint32_t *done_word;	/* completion: done_value is stored here with release order */
	uint32_t done_value;
	uint32_t *done_waiters; /* NULL, or the count task_word_wait keeps of sleepers on done_word */
	task_done_fn on_complete; /* NULL, or called just before the store */
	void *user;		/* the submitter's, untouched by the pool (on_complete may use it) */
	/* Results, valid once done_word shows done_value (acquire). */
	int rc;			 /* 0, or the first failed part's -errno */
	char err[TASK_ERR_MAX];	 /* "part P of N: <its message>" */
	/* The pool's. */
	uint32_t remaining;	/* parts not finished */
	uint32_t failed;	/* set by the first failing part, which writes rc and err */
};

struct task_pool_config {
	uint32_t threads;	 /* workers, 1..TASK_POOL_MAX_THREADS; 0: one per CPU left after cpu_offset */
	const int *cpus;	 /* NULL, or n_cpus CPU numbers: worker i is pinned to cpus[i % n_cpus] */
	uint32_t n_cpus;
	uint32_t cpu_offset;	 /* with cpus NULL: skip the first cpu_offset CPUs sched_getaffinity allows
				  * (more workers than the rest wrap within the rest) */
	bool pin;		 /* pin workers (a failure to pin is logged, not fatal) */
	uint32_t spin_us;	 /* an idle worker polls this long before it sleeps; 0 sleeps at once */
	uint32_t queue_capacity; /* queued parts, a power of two; 0: 4096 */
};

struct task_pool_stats {
	uint32_t threads;
	uint32_t pinned;	   /* workers pinned to their CPU */
	uint32_t sleeping;	   /* workers asleep now */
	uint32_t queue_depth;	   /* parts queued now */
	uint32_t queue_high_water; /* most parts queued at once since create */
	uint32_t queue_capacity;
	uint64_t jobs_submitted;
	uint64_t jobs_done;	/* completed, failed ones included */
	uint64_t jobs_failed;
	uint64_t parts_run;	/* part functions called (by workers and by submitters) */
	uint64_t parts_inline;	/* of which by threads not of the pool (a submitter that found the
				 * queue full, task_pool_help elsewhere) */
	uint64_t parts_cancelled; /* failed unrun at destroy or after it began */
	uint64_t busy_ns;	/* time inside part functions, summed over threads */
	uint64_t sleeps;	/* times a worker went to sleep */
	uint64_t idle_work;	/* calls of the idle hook that did something */
};

struct task_pool;

/* Fills cfg with the defaults: threads 0, cpus NULL, cpu_offset 0, pin true, spin_us 50,
 * queue_capacity 0. */
void task_pool_config_default(struct task_pool_config *cfg);
/* Starts the workers. Returns 0 and the pool in *out (the caller owns it, task_pool_destroy),
 * or -EINVAL (threads above TASK_POOL_MAX_THREADS, a CPU number out of range, a cpu_offset that
 * leaves no CPU for threads 0, a queue capacity that is not a power of two), -ENOMEM, -errno of
 * sched_getaffinity or pthread_create; the message in err starts with "task pool: ". */
int task_pool_create(const struct task_pool_config *cfg, struct task_pool **out, char *err, size_t errlen);
/* Stops and joins the workers, fails what is still queued (see the top), frees the pool; NULLs
 * *pool; safe on NULL and twice. A part function may still submit while destroy waits for it
 * (the job fails with -ESHUTDOWN, or is cancelled with the rest of the queue); no other thread
 * may submit concurrently with destroy, and nothing may after it returned. */
void task_pool_destroy(struct task_pool **pool);
/* Workers started. */
/* Returns once no completing thread still reads or wakes a done word: after the waiter has seen
 * its last job's word, its words may be freed while the pool lives on. */
void task_pool_quiesce(struct task_pool *pool);
uint32_t task_pool_threads(const struct task_pool *pool);
/* The CPU worker i is pinned to, or -1 (pinning off, or it failed). */
int task_pool_worker_cpu(const struct task_pool *pool, uint32_t i);

/* Sets the idle hook (fn non-NULL): idle workers, while they spin (not once asleep), call fn(arg),
 * e.g. to poll for work that comes from elsewhere (a GPU stream's trigger, cuda/cpu_handoff.h).
 * Returns 0, -EBUSY where a hook is set already, -ENOMEM. With fn NULL, clears it and returns once
 * no worker is still inside it (so arg may be freed then); clearing none returns 0. A hook left set
 * is freed by destroy. One thread at a time may set or clear, never a worker of the pool nor the
 * hook itself (a clear waits for every worker's call to end, its own included). Workers dispatch
 * only while they spin: a pool whose spin_us is short calls it little. */
int task_pool_set_idle(struct task_pool *pool, task_idle_fn fn, void *arg);

/* Sets a job up: fn, arg, n_parts, the completion word and value; no waiters, no hook, user NULL. */
void task_job_init(struct task_job *job, task_fn fn, void *arg, uint32_t n_parts, uint32_t *done_word,
		   uint32_t done_value);
/* Queues the job's parts (any thread, a CUDA host function included: it makes no CUDA call and
 * never waits for a worker). Returns 0; or -ESHUTDOWN when destroy has begun, the job then
 * already completed with rc -ECANCELED. Either way the done word is (or will be) stored exactly
 * once. n_parts above TASK_POOL_MAX_PARTS, or a NULL fn or done_word, is a programmer error. */
int task_pool_submit(struct task_pool *pool, struct task_job *job);

/* Runs one queued part on the calling thread, if one is queued, destroy has not begun and the
 * thread is not already TASK_POOL_HELP_DEPTH parts deep inside others: true when it ran one, its
 * time in *ns (ns may be NULL). For a part that waits on its own job (an FFN share's second phase
 * waits for its first, ffn_share.h), so that its worker runs the other jobs' parts meanwhile rather
 * than spin. The part it runs counts as the calling worker's (a submitter's inline run elsewhere),
 * and its time is left out of the enclosing part's. The depth bound keeps the stack small, and a
 * waiting part from being buried under others that wait: a part run inside another that waits
 * spins. Once destroy has begun it runs nothing, so a part whose wait only a queued part can end
 * would hold destroy's join: wait only for what running parts finish. */
bool task_pool_help(struct task_pool *pool, uint64_t *ns);

/* Waits until (int32_t)(*word - target) >= 0 (a cyclic "reached", so words may count up through
 * wrap-around): spins spin_us, then sleeps on a futex if waiters is non-NULL (the count that the
 * completion checks to wake sleepers; it must be the job's done_waiters), else yields in a loop.
 * timeout_ns 0 waits for ever. Returns 0, or -ETIMEDOUT. */
int task_word_wait(uint32_t *word, uint32_t *waiters, uint32_t target, uint32_t spin_us, uint64_t timeout_ns);

/* Counters since create (a snapshot of counters that other threads keep moving). */
void task_pool_get_stats(const struct task_pool *pool, struct task_pool_stats *out);

/* Rows [*begin, *end) of `total` that part `part` of `n_parts` covers: contiguous, in order,
 * sizes differing by at most one. */
void task_part_range(uint32_t total, uint32_t n_parts, uint32_t part, uint32_t *begin, uint32_t *end);

#ifdef __cplusplus
}
#endif
#endif

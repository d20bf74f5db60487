/* task_pool.c - the worker pool of task_pool.h: workers that pop (job, part) items from a
 * task_queue, spin a while when it is empty, then sleep on a futex that every submit bumps.
 *
 * Sleeping without losing a wake-up: a worker announces itself in `sleeping`, reads `epoch`,
 * tries the queue once more, and only then waits on the futex for `epoch` to change. A submit
 * pushes its items, bumps `epoch`, then reads `sleeping`. All four accesses are sequentially
 * consistent, so either the submit sees the sleeper (and wakes it; if the sleeper had not begun
 * waiting, the changed epoch sends it back at once), or the sleeper's read of epoch comes after
 * the bump, which synchronises with it, and its last try of the queue finds the items. The same
 * pattern, on the done word and its waiter count, serves task_word_wait and job completion.
 *
 * A job's parts count down in `remaining` with acquire-release decrements: the decrements form
 * one release sequence, so the part that takes it to zero sees every other part's writes (their
 * outputs, and rc and err from the first failure) before it stores the completion. */
#include "services/gpu-runner/cpu-compute/task_pool.h"

#include <assert.h>
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "services/gpu-runner/cpu-compute/task_queue.h"

#define DEFAULT_QUEUE_CAPACITY 4096u
#define DEFAULT_SPIN_US 50u
#define CLOCK_EVERY 64u /* polls between two reads of the clock while spinning */

struct worker {
	alignas(CACHE_LINE) struct task_pool *pool;
	uint32_t index;
	_Atomic int cpu; /* pinned to, or -1 */
	pthread_t thread;
	_Atomic uint64_t parts;	  /* written by this worker only */
	_Atomic uint64_t busy_ns;
	_Atomic uint64_t sleeps;
	_Atomic uint32_t in_idle; /* inside the idle hook (task_pool_set_idle waits it out) */
};

/* An idle hook as task_pool_set_idle set it: swapped whole, so a worker never sees a function with
 * another hook's argument. */
struct idle_hook {
	task_idle_fn fn;
	void *arg;
};

struct task_pool {
	struct task_queue *queue;
	struct worker *workers;
	uint32_t threads; /* workers started (joined at destroy) */
	uint32_t spin_us;
	alignas(CACHE_LINE) _Atomic uint32_t epoch; /* futex word: bumped by each submit and by stop */
	_Atomic uint32_t sleeping;		    /* workers announced asleep */
	_Atomic uint32_t stopping;
	alignas(CACHE_LINE) _Atomic uint32_t high_water;
	_Atomic uint32_t pinned;
	_Atomic uint64_t jobs_submitted;
	_Atomic uint64_t jobs_done;
	_Atomic uint64_t jobs_failed;
	_Atomic uint64_t parts_inline; /* parts run by submitters (queue full) */
	_Atomic uint64_t inline_busy_ns;
	_Atomic uint64_t parts_cancelled;
	/* Completions between their word's store and their last touch of the words (task_pool_quiesce). */
	alignas(CACHE_LINE) _Atomic uint32_t completing;
	/* The idle hook, or NULL: read by spinning workers at every turn, written by task_pool_set_idle. */
	alignas(CACHE_LINE) struct idle_hook *_Atomic idle;
	alignas(CACHE_LINE) _Atomic uint64_t idle_calls; /* calls of the hook that returned non-zero */
};

/* The worker the calling thread is (NULL on other threads); the parts it is running, one inside
 * the other (task_pool_help); and the time the parts run inside the innermost took, which its own
 * time leaves out. */
static _Thread_local struct worker *tl_worker;
static _Thread_local uint32_t tl_depth;
static _Thread_local uint64_t tl_nested_ns;

/* The calling thread's pool worker where it is one of p's, else NULL (its runs count as inline). */
static inline struct worker *self_in(struct task_pool *p)
{
	return tl_worker && tl_worker->pool == p ? tl_worker : NULL;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#else
	atomic_signal_fence(memory_order_seq_cst);
#endif
}

static long futex_wait(uint32_t *addr, uint32_t val, const struct timespec *rel)
{
	return syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, val, rel, NULL, 0);
}

static void futex_wake(uint32_t *addr, int n)
{
	syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static inline bool word_reached(uint32_t v, uint32_t target)
{
	return (int32_t)(v - target) >= 0;
}

void task_part_range(uint32_t total, uint32_t n_parts, uint32_t part, uint32_t *begin, uint32_t *end)
{
	assert(n_parts > 0 && part < n_parts);
	*begin = (uint32_t)((uint64_t)total * part / n_parts);
	*end = (uint32_t)((uint64_t)total * (part + 1) / n_parts);
}

void task_job_init(struct task_job *job, task_fn fn, void *arg, uint32_t n_parts, uint32_t *done_word,
		   uint32_t done_value)
{
	memset(job, 0, sizeof(*job));
	job->fn = fn;
	job->arg = arg;
	job->n_parts = n_parts;
	job->done_word = done_word;
	job->done_value = done_value;
}

/* ---- completing parts and jobs ---- */

/* Records part's failure if it is the job's first. */
static void job_fail(struct task_job *job, uint32_t part, int rc, const char *msg)
{
	if (__atomic_exchange_n(&job->failed, 1, __ATOMIC_RELAXED) != 0)
		return;
	/* Published to the completing thread by this thread's release decrement of remaining. */
	job->rc = rc;
	snprintf(job->err, sizeof(job->err), "part %u of %u: %s", part, job->n_parts, msg[0] ? msg : strerror(-rc));
}

/* The hook, then the release store of the completion; the job is not touched after it. */
static void job_complete(struct task_pool *p, struct task_job *job)
{
	uint32_t *word = job->done_word;
	uint32_t *waiters = job->done_waiters;
	uint32_t value = job->done_value;
	bool failed = job->rc != 0;
	if (job->on_complete)
		job->on_complete(job);
	atomic_fetch_add_explicit(&p->jobs_done, 1, memory_order_relaxed);
	if (failed)
		atomic_fetch_add_explicit(&p->jobs_failed, 1, memory_order_relaxed);
	/* Counted before the store: whoever sees the value and then reads `completing` as 0 knows
	 * this thread is done with the words (task_pool_quiesce). */
	atomic_fetch_add_explicit(&p->completing, 1, memory_order_seq_cst);
	/* Release: the parts' outputs, rc and err before the value (pairs with the acquire load of
	 * whoever waits, or with a GPU's poll of the word). Sequentially consistent, with the load
	 * of the waiter count below, against task_word_wait's announce-then-recheck. */
	__atomic_store_n(word, value, __ATOMIC_SEQ_CST);
	if (waiters && __atomic_load_n(waiters, __ATOMIC_SEQ_CST) != 0)
		futex_wake(word, INT_MAX);
	atomic_fetch_sub_explicit(&p->completing, 1, memory_order_release);
}

void task_pool_quiesce(struct task_pool *p)
{
	while (atomic_load_explicit(&p->completing, memory_order_acquire) != 0)
		sched_yield();
}

static void finish_part(struct task_pool *p, struct task_job *job)
{
	if (__atomic_sub_fetch(&job->remaining, 1, __ATOMIC_ACQ_REL) == 0)
		job_complete(p, job);
}

/* Runs one part. The caller's counters move before the part is finished, so that once a job's
 * word is seen, the stats count its parts. w NULL: a submitter's inline run. A part run inside
 * another (task_pool_help) counts its own time; the enclosing one's leaves it out. */
static void run_part(struct task_pool *p, struct worker *w, struct task_item it)
{
	struct task_job *job = it.ptr;
	uint32_t part = (uint32_t)it.arg;
	char msg[TASK_ERR_MAX];
	msg[0] = '\0';
	const uint64_t outer = tl_depth ? tl_nested_ns : 0;
	tl_nested_ns = 0;
	tl_depth++;
	uint64_t t0 = now_ns();
	int rc = job->fn(job->arg, part, job->n_parts, msg, sizeof(msg));
	uint64_t dt = now_ns() - t0;
	tl_depth--;
	const uint64_t inner = tl_nested_ns;
	tl_nested_ns = outer + dt;
	dt = dt > inner ? dt - inner : 0;
	assert(rc <= 0);
	if (rc != 0)
		job_fail(job, part, rc, msg);
	if (w) {
		/* Only this worker writes its counters: plain read-modify-write, atomic for the readers. */
		atomic_store_explicit(&w->parts, atomic_load_explicit(&w->parts, memory_order_relaxed) + 1,
				      memory_order_relaxed);
		atomic_store_explicit(&w->busy_ns, atomic_load_explicit(&w->busy_ns, memory_order_relaxed) + dt,
				      memory_order_relaxed);
	} else {
		atomic_fetch_add_explicit(&p->parts_inline, 1, memory_order_relaxed);
		atomic_fetch_add_explicit(&p->inline_busy_ns, dt, memory_order_relaxed);
	}
	finish_part(p, job);
}

static void cancel_part(struct task_pool *p, struct task_job *job, uint32_t part)
{
	job_fail(job, part, -ECANCELED, "task pool: stopped before the part ran");
	atomic_fetch_add_explicit(&p->parts_cancelled, 1, memory_order_relaxed);
	finish_part(p, job);
}

/* ---- workers ---- */

/* Calls the idle hook, if one is set, announced in w->in_idle (sequentially consistent, against
 * task_pool_set_idle's exchange: either the setter sees the announcement and waits, or this load
 * sees the new hook). */
static inline void call_idle(struct task_pool *p, struct worker *w)
{
	if (!atomic_load_explicit(&p->idle, memory_order_relaxed))
		return;
	atomic_store_explicit(&w->in_idle, 1, memory_order_seq_cst);
	struct idle_hook *h = atomic_load_explicit(&p->idle, memory_order_seq_cst);
	if (h && h->fn(h->arg))
		atomic_fetch_add_explicit(&p->idle_calls, 1, memory_order_relaxed);
	atomic_store_explicit(&w->in_idle, 0, memory_order_release);
}

/* Polls the queue (and the idle hook) for spin_us; true with an item in *it, false once the time
 * is up or on stop. */
static bool idle_spin(struct task_pool *p, struct worker *w, struct task_item *it)
{
	if (p->spin_us == 0)
		return false;
	uint64_t end = now_ns() + (uint64_t)p->spin_us * 1000u;
	for (uint32_t i = 1;; i++) {
		cpu_relax();
		if (task_queue_pop(p->queue, it))
			return true;
		call_idle(p, w);
		if (i % CLOCK_EVERY == 0 &&
		    (atomic_load_explicit(&p->stopping, memory_order_relaxed) || now_ns() >= end))
			return false;
	}
}

static void pin_self(struct worker *w)
{
	int cpu = atomic_load_explicit(&w->cpu, memory_order_relaxed);
	if (cpu < 0)
		return;
	cpu_set_t set;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
	if (rc != 0) {
		log_warn("task pool: cannot pin worker %u to CPU %d (%s): it runs unpinned", w->index, cpu,
			 strerror(rc));
		atomic_store_explicit(&w->cpu, -1, memory_order_relaxed);
		return;
	}
	atomic_fetch_add_explicit(&w->pool->pinned, 1, memory_order_relaxed);
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	struct task_pool *p = w->pool;
	char name[16];
	snprintf(name, sizeof(name), "taskpool-%u", w->index);
	pthread_setname_np(pthread_self(), name);
	pin_self(w);
	tl_worker = w;

	struct task_item it;
	for (;;) {
		if (atomic_load_explicit(&p->stopping, memory_order_acquire))
			break;
		if (task_queue_pop(p->queue, &it) || idle_spin(p, w, &it)) {
			run_part(p, w, it);
			continue;
		}
		/* Announce, read the epoch, try once more, sleep until the epoch moves (see the top). */
		atomic_fetch_add_explicit(&p->sleeping, 1, memory_order_seq_cst);
		uint32_t e = atomic_load_explicit(&p->epoch, memory_order_seq_cst);
		if (atomic_load_explicit(&p->stopping, memory_order_seq_cst)) {
			atomic_fetch_sub_explicit(&p->sleeping, 1, memory_order_seq_cst);
			break;
		}
		if (task_queue_pop(p->queue, &it)) {
			atomic_fetch_sub_explicit(&p->sleeping, 1, memory_order_seq_cst);
			run_part(p, w, it);
			continue;
		}
		atomic_store_explicit(&w->sleeps, atomic_load_explicit(&w->sleeps, memory_order_relaxed) + 1,
				      memory_order_relaxed);
		futex_wait((uint32_t *)&p->epoch, e, NULL);
		atomic_fetch_sub_explicit(&p->sleeping, 1, memory_order_seq_cst);
	}
	return NULL;
}

static void wake_workers(struct task_pool *p, uint32_t n)
{
	atomic_fetch_add_explicit(&p->epoch, 1, memory_order_seq_cst);
	if (atomic_load_explicit(&p->sleeping, memory_order_seq_cst) != 0)
		futex_wake((uint32_t *)&p->epoch, n > INT_MAX ? INT_MAX : (int)n);
}

/* ---- the pool ---- */

void task_pool_config_default(struct task_pool_config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->pin = true;
	cfg->spin_us = DEFAULT_SPIN_US;
}

int task_pool_create(const struct task_pool_config *cfg, struct task_pool **out, char *err, size_t errlen)
{
	*out = NULL;
	if (cfg->threads > TASK_POOL_MAX_THREADS)
		return errorf(err, errlen, -EINVAL, "task pool: %u threads is more than %u", cfg->threads,
			      TASK_POOL_MAX_THREADS);
	if (cfg->cpus && cfg->n_cpus == 0)
		return errorf(err, errlen, -EINVAL, "task pool: an empty CPU list");
	for (uint32_t i = 0; cfg->cpus && i < cfg->n_cpus; i++)
		if (cfg->cpus[i] < 0 || cfg->cpus[i] >= CPU_SETSIZE)
			return errorf(err, errlen, -EINVAL, "task pool: CPU %d (entry %u of the list) is out of range",
				      cfg->cpus[i], i);

	cpu_set_t allowed;
	CPU_ZERO(&allowed);
	if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0)
		return errorf(err, errlen, -errno, "task pool: sched_getaffinity: %s", strerror(errno));
	int *list = malloc(sizeof(int) * CPU_SETSIZE);
	if (!list)
		return errorf(err, errlen, -ENOMEM, "task pool: out of memory");
	uint32_t n_allowed = 0;
	for (int c = 0; c < CPU_SETSIZE; c++)
		if (CPU_ISSET(c, &allowed))
			list[n_allowed++] = c;

	int rc = 0;
	struct task_pool *p = NULL;
	uint32_t threads = cfg->threads;
	if (threads == 0) {
		if (cfg->cpus) {
			threads = cfg->n_cpus;
		} else if (cfg->cpu_offset >= n_allowed) {
			rc = errorf(err, errlen, -EINVAL, "task pool: cpu offset %u leaves none of the %u CPUs allowed",
				    cfg->cpu_offset, n_allowed);
			goto out_free_list;
		} else {
			threads = n_allowed - cfg->cpu_offset;
		}
		if (threads > TASK_POOL_MAX_THREADS)
			threads = TASK_POOL_MAX_THREADS;
	}
	uint32_t capacity = cfg->queue_capacity ? cfg->queue_capacity : DEFAULT_QUEUE_CAPACITY;

	p = aligned_alloc(CACHE_LINE, ALIGN_UP(sizeof(*p), CACHE_LINE));
	if (!p) {
		rc = errorf(err, errlen, -ENOMEM, "task pool: out of memory");
		goto out_free_list;
	}
	memset(p, 0, sizeof(*p));
	p->spin_us = cfg->spin_us;
	rc = task_queue_create(capacity, &p->queue, err, errlen);
	if (rc)
		goto out_free_pool;
	p->workers = aligned_alloc(CACHE_LINE, ALIGN_UP(sizeof(struct worker) * threads, CACHE_LINE));
	if (!p->workers) {
		rc = errorf(err, errlen, -ENOMEM, "task pool: out of memory for %u workers", threads);
		goto out_destroy_queue;
	}
	memset(p->workers, 0, sizeof(struct worker) * threads);
	for (uint32_t i = 0; i < threads; i++) {
		struct worker *w = &p->workers[i];
		w->pool = p;
		w->index = i;
		int cpu = -1;
		/* More workers than CPUs after the offset: they wrap within those, never onto the first
		 * cpu_offset CPUs (the caller's own threads, which a worker there would preempt). */
		if (cfg->pin && cfg->cpus)
			cpu = cfg->cpus[i % cfg->n_cpus];
		else if (cfg->pin)
			cpu = cfg->cpu_offset < n_allowed ? list[cfg->cpu_offset + i % (n_allowed - cfg->cpu_offset)]
							  : list[i % n_allowed];
		atomic_init(&w->cpu, cpu);
	}
	for (uint32_t i = 0; i < threads; i++) {
		int e = pthread_create(&p->workers[i].thread, NULL, worker_main, &p->workers[i]);
		if (e != 0) {
			errorf(err, errlen, -e, "task pool: cannot start worker %u of %u: %s", i, threads, strerror(e));
			task_pool_destroy(&p); /* joins the i started */
			free(list);
			return -e;
		}
		p->threads = i + 1;
	}
	free(list);
	*out = p;
	return 0;

out_destroy_queue:
	task_queue_destroy(&p->queue);
out_free_pool:
	free(p);
out_free_list:
	free(list);
	return rc;
}

void task_pool_destroy(struct task_pool **pp)
{
	if (!pp || !*pp)
		return;
	struct task_pool *p = *pp;
	atomic_store_explicit(&p->stopping, 1, memory_order_seq_cst);
	wake_workers(p, INT_MAX);
	for (uint32_t i = 0; i < p->threads; i++)
		pthread_join(p->workers[i].thread, NULL);
	/* Every worker is gone: what is still queued never ran. Fail it, so its jobs complete. */
	struct task_item it;
	while (task_queue_pop(p->queue, &it))
		cancel_part(p, it.ptr, (uint32_t)it.arg);
	task_queue_destroy(&p->queue);
	free(atomic_load_explicit(&p->idle, memory_order_relaxed)); /* a hook never cleared */
	free(p->workers);
	free(p);
	*pp = NULL;
}

int task_pool_set_idle(struct task_pool *p, task_idle_fn fn, void *arg)
{
	struct idle_hook *h = NULL;
	if (fn) {
		if (atomic_load_explicit(&p->idle, memory_order_acquire))
			return -EBUSY;
		h = malloc(sizeof(*h));
		if (!h)
			return -ENOMEM;
		h->fn = fn;
		h->arg = arg;
	}
	struct idle_hook *old = atomic_exchange_explicit(&p->idle, h, memory_order_seq_cst);
	if (old) {
		/* A worker that announced itself before the exchange may still be calling it. */
		for (uint32_t i = 0; i < p->threads; i++)
			while (atomic_load_explicit(&p->workers[i].in_idle, memory_order_seq_cst))
				cpu_relax();
		free(old);
	}
	return 0;
}

uint32_t task_pool_threads(const struct task_pool *p)
{
	return p->threads;
}

int task_pool_worker_cpu(const struct task_pool *p, uint32_t i)
{
	if (i >= p->threads)
		return -1;
	return atomic_load_explicit(&((struct task_pool *)p)->workers[i].cpu, memory_order_relaxed);
}

int task_pool_submit(struct task_pool *p, struct task_job *job)
{
	assert(job && job->fn && job->done_word && job->n_parts <= TASK_POOL_MAX_PARTS);
	job->rc = 0;
	job->err[0] = '\0';
	job->failed = 0;
	/* Published to the workers by the release store of each push. */
	job->remaining = job->n_parts;
	atomic_fetch_add_explicit(&p->jobs_submitted, 1, memory_order_relaxed);
	if (atomic_load_explicit(&p->stopping, memory_order_acquire)) {
		uint32_t n = job->n_parts;
		if (n == 0) {
			job->rc = -ECANCELED;
			snprintf(job->err, sizeof(job->err), "task pool: stopped before the job ran");
			job_complete(p, job);
		}
		for (uint32_t part = 0; part < n; part++) /* the last one completes the job */
			cancel_part(p, job, part);
		return -ESHUTDOWN;
	}
	if (job->n_parts == 0) {
		job_complete(p, job);
		return 0;
	}
	/* Once its last part is queued the job may complete (and be reused) at any moment: nothing
	 * below reads it after that push. */
	uint32_t n_parts = job->n_parts;
	bool woke = false;
	for (uint32_t part = 0; part < n_parts; part++) {
		struct task_item it = {.ptr = job, .arg = part};
		while (!task_queue_push(p->queue, it)) {
			/* Full: wake everyone, and help rather than wait (this may be a worker or a CUDA
			 * callback thread, which must not block on the others). */
			if (!woke) {
				wake_workers(p, INT_MAX);
				woke = true;
			}
			struct task_item other;
			if (task_queue_pop(p->queue, &other))
				run_part(p, self_in(p), other);
			else
				cpu_relax();
		}
	}
	uint32_t depth = task_queue_depth(p->queue);
	uint32_t hw = atomic_load_explicit(&p->high_water, memory_order_relaxed);
	while (depth > hw &&
	       !atomic_compare_exchange_weak_explicit(&p->high_water, &hw, depth, memory_order_relaxed,
						      memory_order_relaxed))
		;
	wake_workers(p, n_parts);
	return 0;
}

bool task_pool_help(struct task_pool *p, uint64_t *ns)
{
	if (tl_depth > TASK_POOL_HELP_DEPTH || atomic_load_explicit(&p->stopping, memory_order_acquire))
		return false;
	struct task_item it;
	if (!task_queue_pop(p->queue, &it))
		return false;
	const uint64_t t0 = ns ? now_ns() : 0;
	run_part(p, self_in(p), it);
	if (ns)
		*ns = now_ns() - t0;
	return true;
}

int task_word_wait(uint32_t *word, uint32_t *waiters, uint32_t target, uint32_t spin_us, uint64_t timeout_ns)
{
	uint64_t start = now_ns();
	uint64_t deadline = timeout_ns && timeout_ns < UINT64_MAX - start ? start + timeout_ns : UINT64_MAX;
	uint64_t spin_end = start + (uint64_t)spin_us * 1000u;
	for (uint32_t i = 0;; i++) {
		if (word_reached(__atomic_load_n(word, __ATOMIC_ACQUIRE), target))
			return 0;
		if (i % CLOCK_EVERY == 0) {
			uint64_t t = now_ns();
			if (t >= deadline)
				return -ETIMEDOUT;
			if (t >= spin_end)
				break;
		}
		cpu_relax();
	}
	uint64_t backoff_ns = 1000;
	for (;;) {
		uint64_t t = now_ns();
		if (t >= deadline)
			return word_reached(__atomic_load_n(word, __ATOMIC_ACQUIRE), target) ? 0 : -ETIMEDOUT;
		uint64_t left = deadline - t;
		if (!waiters) {
			/* Nobody will wake us: poll with a growing nap (up to 100 us). */
			if (word_reached(__atomic_load_n(word, __ATOMIC_ACQUIRE), target))
				return 0;
			uint64_t nap = backoff_ns < left ? backoff_ns : left;
			struct timespec ts = {.tv_sec = (time_t)(nap / 1000000000u), .tv_nsec = (long)(nap % 1000000000u)};
			nanosleep(&ts, NULL);
			if (backoff_ns < 100000)
				backoff_ns *= 2;
			continue;
		}
		/* Announce, re-check, sleep while the word still holds what was read (see the top). */
		__atomic_add_fetch(waiters, 1, __ATOMIC_SEQ_CST);
		uint32_t v = __atomic_load_n(word, __ATOMIC_SEQ_CST);
		if (word_reached(v, target)) {
			__atomic_sub_fetch(waiters, 1, __ATOMIC_SEQ_CST);
			return 0;
		}
		struct timespec rel = {.tv_sec = (time_t)(left / 1000000000u), .tv_nsec = (long)(left % 1000000000u)};
		futex_wait(word, v, timeout_ns ? &rel : NULL);
		__atomic_sub_fetch(waiters, 1, __ATOMIC_SEQ_CST);
	}
}

void task_pool_get_stats(const struct task_pool *cp, struct task_pool_stats *out)
{
	struct task_pool *p = (struct task_pool *)cp; /* atomic loads of counters */
	memset(out, 0, sizeof(*out));
	out->threads = p->threads;
	out->pinned = atomic_load_explicit(&p->pinned, memory_order_relaxed);
	out->sleeping = atomic_load_explicit(&p->sleeping, memory_order_relaxed);
	out->queue_depth = task_queue_depth(p->queue);
	out->queue_high_water = atomic_load_explicit(&p->high_water, memory_order_relaxed);
	out->queue_capacity = task_queue_capacity(p->queue);
	out->jobs_submitted = atomic_load_explicit(&p->jobs_submitted, memory_order_relaxed);
	out->jobs_done = atomic_load_explicit(&p->jobs_done, memory_order_relaxed);
	out->jobs_failed = atomic_load_explicit(&p->jobs_failed, memory_order_relaxed);
	out->parts_inline = atomic_load_explicit(&p->parts_inline, memory_order_relaxed);
	out->parts_cancelled = atomic_load_explicit(&p->parts_cancelled, memory_order_relaxed);
	out->idle_work = atomic_load_explicit(&p->idle_calls, memory_order_relaxed);
	out->parts_run = out->parts_inline;
	out->busy_ns = atomic_load_explicit(&p->inline_busy_ns, memory_order_relaxed);
	for (uint32_t i = 0; i < p->threads; i++) {
		struct worker *w = &p->workers[i];
		out->parts_run += atomic_load_explicit(&w->parts, memory_order_relaxed);
		out->busy_ns += atomic_load_explicit(&w->busy_ns, memory_order_relaxed);
		out->sleeps += atomic_load_explicit(&w->sleeps, memory_order_relaxed);
	}
}

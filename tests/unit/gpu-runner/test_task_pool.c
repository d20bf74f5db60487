/* test_task_pool.c - the CPU compute pool (cpu-compute/task_pool.h):
 *  - jobs split into parts: every part runs once, every row is written, the done word gets the
 *    job's value, the counters add up; task_part_range covers rows exactly once;
 *  - several submitters at once on a small queue (full often: submitters run parts themselves);
 *  - a failing part: the job completes all the same, with the first failure's code and message;
 *  - destroy while parts run and others are queued: the running ones finish, the queued job fails
 *    with a message and its word is stored; a submit from a part during destroy fails cleanly;
 *  - idle workers go to sleep (spin 0 and spin > 0) and wake for the next job;
 *  - the idle hook: jobs only it submits, each once; a second refused; clearing waits for it;
 *  - task_word_wait: timeouts, wrap-around, waking a sleeper;
 *  - configurations it refuses, pinning to a given CPU and to one not allowed (logged, unpinned).
 * Waits are conditions with a bounded timeout (wait_until), never sleeps. */
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "tests/unit/common/test_helpers.h"

#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/util.h"

#define WAIT_NS (20ull * 1000 * 1000 * 1000) /* what a condition gets before the test fails */

static void nap_us(unsigned us)
{
	struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)us * 1000};
	nanosleep(&ts, NULL);
}

/* Waits for cond(arg) to hold, at most WAIT_NS; fails the test naming what did not happen. */
static void wait_until(bool (*cond)(void *), void *arg, const char *what)
{
	uint64_t end = now_ns() + WAIT_NS;
	while (!cond(arg)) {
		ck_assert_msg(now_ns() < end, "timed out waiting for %s", what);
		nap_us(200);
	}
}

static struct task_pool *make_pool(uint32_t threads, uint32_t spin_us, uint32_t capacity)
{
	struct task_pool_config cfg;
	task_pool_config_default(&cfg);
	cfg.threads = threads;
	cfg.spin_us = spin_us;
	cfg.queue_capacity = capacity;
	cfg.pin = false;
	char err[256];
	struct task_pool *p = NULL;
	int rc = task_pool_create(&cfg, &p, err, sizeof(err));
	ck_assert_msg(rc == 0, "task_pool_create: %d %s", rc, err);
	ck_assert_uint_eq(task_pool_threads(p), threads);
	return p;
}

/* ---- rows written by parts ---- */

struct rows_job {
	uint32_t rows;
	uint32_t *out;		   /* rows: out[i] = i * 3 + salt */
	_Atomic uint32_t *part_runs; /* n_parts */
	uint32_t salt;
	uint32_t fail_part;	   /* UINT32_MAX: none */
	uint32_t fail_part2;
	int fail_rc;
	bool fail_silent;	   /* fail with no message */
};

static int rows_fn(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	struct rows_job *j = arg;
	atomic_fetch_add(&j->part_runs[part], 1);
	if (part == j->fail_part || part == j->fail_part2) {
		if (j->fail_silent)
			return j->fail_rc;
		return errorf(err, errlen, j->fail_rc, "row block %u is bad", part);
	}
	uint32_t b, e;
	task_part_range(j->rows, n_parts, part, &b, &e);
	for (uint32_t i = b; i < e; i++)
		j->out[i] = i * 3 + j->salt;
	return 0;
}

static void rows_init(struct rows_job *j, uint32_t rows, uint32_t n_parts, uint32_t salt)
{
	memset(j, 0, sizeof(*j));
	j->rows = rows;
	j->out = calloc(rows ? rows : 1, sizeof(uint32_t));
	j->part_runs = calloc(n_parts ? n_parts : 1, sizeof(*j->part_runs));
	ck_assert(j->out && j->part_runs);
	j->salt = salt;
	j->fail_part = j->fail_part2 = UINT32_MAX;
}

static void rows_check(const struct rows_job *j, uint32_t n_parts)
{
	for (uint32_t p = 0; p < n_parts; p++)
		TH_CHECK(atomic_load(&j->part_runs[p]) == 1, "part %u ran %u times", p, atomic_load(&j->part_runs[p]));
	for (uint32_t i = 0; i < j->rows; i++)
		TH_CHECK(j->out[i] == i * 3 + j->salt, "row %u holds %u", i, j->out[i]);
}

static void rows_free(struct rows_job *j)
{
	free(j->out);
	free(j->part_runs);
}

START_TEST(test_part_range)
{
	const uint32_t totals[] = {0, 1, 7, 16, 1000, 4096, 100003};
	for (size_t t = 0; t < sizeof(totals) / sizeof(totals[0]); t++)
		for (uint32_t n = 1; n <= 40; n++) {
			uint32_t expect = 0, lo = UINT32_MAX, hi = 0;
			for (uint32_t p = 0; p < n; p++) {
				uint32_t b, e;
				task_part_range(totals[t], n, p, &b, &e);
				ck_assert_uint_eq(b, expect);
				ck_assert_uint_ge(e, b);
				lo = e - b < lo ? e - b : lo;
				hi = e - b > hi ? e - b : hi;
				expect = e;
			}
			ck_assert_uint_eq(expect, totals[t]);
			ck_assert_uint_le(hi - lo, 1);
		}
}
END_TEST

START_TEST(test_jobs_with_parts)
{
	struct task_pool *p = make_pool(3, 20, 0);
	uint32_t done = 0, waiters = 0;
	const uint32_t parts[] = {1, 2, 3, 7, 16, 64, 1000};
	uint64_t parts_total = 0;
	for (size_t k = 0; k < sizeof(parts) / sizeof(parts[0]); k++) {
		struct rows_job rj;
		rows_init(&rj, 5000 + (uint32_t)k, parts[k], (uint32_t)k);
		struct task_job job;
		task_job_init(&job, rows_fn, &rj, parts[k], &done, (uint32_t)k + 1);
		job.done_waiters = &waiters;
		ck_assert_int_eq(task_pool_submit(p, &job), 0);
		ck_assert_int_eq(task_word_wait(&done, &waiters, (uint32_t)k + 1, 10, WAIT_NS), 0);
		ck_assert_uint_eq(__atomic_load_n(&done, __ATOMIC_ACQUIRE), k + 1);
		ck_assert_int_eq(job.rc, 0);
		ck_assert_str_eq(job.err, "");
		rows_check(&rj, parts[k]);
		rows_free(&rj);
		parts_total += parts[k];
	}
	/* A job of no parts completes at submit. */
	struct task_job empty;
	task_job_init(&empty, rows_fn, NULL, 0, &done, 100);
	ck_assert_int_eq(task_pool_submit(p, &empty), 0);
	ck_assert_uint_eq(done, 100);

	struct task_pool_stats st;
	task_pool_get_stats(p, &st);
	ck_assert_uint_eq(st.threads, 3);
	ck_assert_uint_eq(st.jobs_submitted, 8);
	ck_assert_uint_eq(st.jobs_done, 8);
	ck_assert_uint_eq(st.jobs_failed, 0);
	ck_assert_uint_eq(st.parts_run, parts_total);
	ck_assert_uint_ge(st.queue_high_water, 1);
	ck_assert_uint_le(st.queue_high_water, st.queue_capacity);
	ck_assert_uint_eq(st.queue_capacity, 4096);
	ck_assert_uint_gt(st.busy_ns, 0);
	task_pool_destroy(&p);
	ck_assert_ptr_null(p);
	task_pool_destroy(&p);
}
END_TEST

/* ---- several submitters ---- */

#define SUBMITTERS 4
#define JOBS_EACH 150

struct submitter {
	struct task_pool *pool;
	uint32_t id;
	int errors;
	uint32_t *done, *waiters; /* JOBS_EACH each: they must outlive the pool */
};

static void *submitter_main(void *arg)
{
	struct submitter *s = arg;
	struct rows_job *rj = calloc(JOBS_EACH, sizeof(*rj));
	struct task_job *jobs = calloc(JOBS_EACH, sizeof(*jobs));
	uint32_t *done = s->done, *waiters = s->waiters;
	/* All submitted before any is waited for: the small queue fills up. */
	for (uint32_t k = 0; k < JOBS_EACH; k++) {
		uint32_t n_parts = 1 + (k * 7 + s->id) % 37;
		rows_init(&rj[k], 300 + k, n_parts, s->id * 1000 + k);
		task_job_init(&jobs[k], rows_fn, &rj[k], n_parts, &done[k], 7);
		jobs[k].done_waiters = &waiters[k];
		if (task_pool_submit(s->pool, &jobs[k]) != 0)
			s->errors++;
	}
	for (uint32_t k = 0; k < JOBS_EACH; k++) {
		if (task_word_wait(&done[k], &waiters[k], 7, 5, WAIT_NS) != 0 || jobs[k].rc != 0) {
			s->errors++;
			continue;
		}
		for (uint32_t p = 0; p < jobs[k].n_parts; p++)
			if (atomic_load(&rj[k].part_runs[p]) != 1)
				s->errors++;
		for (uint32_t i = 0; i < rj[k].rows; i++)
			if (rj[k].out[i] != i * 3 + rj[k].salt)
				s->errors++;
		rows_free(&rj[k]);
	}
	free(rj);
	free(jobs);
	return NULL;
}

START_TEST(test_concurrent_submitters)
{
	struct task_pool *p = make_pool(3, 0, 16);
	pthread_t th[SUBMITTERS];
	struct submitter sub[SUBMITTERS];
	for (uint32_t i = 0; i < SUBMITTERS; i++) {
		sub[i] = (struct submitter){.pool = p, .id = i};
		sub[i].done = calloc(JOBS_EACH, sizeof(uint32_t));
		sub[i].waiters = calloc(JOBS_EACH, sizeof(uint32_t));
		ck_assert(sub[i].done && sub[i].waiters);
		ck_assert_int_eq(pthread_create(&th[i], NULL, submitter_main, &sub[i]), 0);
	}
	for (uint32_t i = 0; i < SUBMITTERS; i++) {
		pthread_join(th[i], NULL);
		ck_assert_msg(sub[i].errors == 0, "submitter %u saw %d errors", i, sub[i].errors);
	}
	struct task_pool_stats st;
	task_pool_get_stats(p, &st);
	ck_assert_uint_eq(st.jobs_done, SUBMITTERS * JOBS_EACH);
	ck_assert_uint_eq(st.jobs_failed, 0);
	ck_assert_uint_le(st.queue_high_water, 16);
	ck_assert_uint_eq(st.queue_depth, 0);
	task_pool_destroy(&p);
	for (uint32_t i = 0; i < SUBMITTERS; i++) {
		free(sub[i].done);
		free(sub[i].waiters);
	}
}
END_TEST

/* ---- a part that holds its worker until the test lets go ---- */

struct gate {
	_Atomic uint32_t started;
	_Atomic uint32_t open;
	struct task_pool *pool; /* for the destroy probe */
	_Atomic int probe_rc;
	struct task_job probe;
	uint32_t probe_done;
};

/* Each part writes the CPU it runs on into ((int *)arg)[part]. */
static int where_fn(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	(void)n_parts;
	(void)err;
	(void)errlen;
	((int *)arg)[part] = sched_getcpu();
	return 0;
}

static int gate_fn(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	struct gate *g = arg;
	atomic_fetch_add(&g->started, 1);
	uint64_t end = now_ns() + WAIT_NS;
	while (!atomic_load(&g->open) && now_ns() < end)
		nap_us(100);
	return atomic_load(&g->open) ? 0 : errorf(err, errlen, -ETIMEDOUT, "the gate never opened");
}

static bool gate_started_1(void *arg)
{
	return atomic_load(&((struct gate *)arg)->started) >= 1;
}

static bool gate_started_2(void *arg)
{
	return atomic_load(&((struct gate *)arg)->started) >= 2;
}

/* Holds its worker until destroy has begun: it submits a job of no parts (which completes at
 * once) until the pool answers -ESHUTDOWN. */
static int until_destroy_fn(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	struct gate *g = arg;
	atomic_fetch_add(&g->started, 1);
	uint64_t end = now_ns() + WAIT_NS;
	for (;;) {
		if (part == 0)
			task_job_init(&g->probe, rows_fn, NULL, 0, &g->probe_done, 1);
		struct task_job local;
		uint32_t local_done = 0;
		task_job_init(&local, rows_fn, NULL, 0, &local_done, 1);
		int rc = task_pool_submit(g->pool, part == 0 ? &g->probe : &local);
		if (rc == -ESHUTDOWN) {
			if (part == 0)
				atomic_store(&g->probe_rc, rc);
			return 0;
		}
		if (now_ns() >= end)
			return errorf(err, errlen, -ETIMEDOUT, "destroy never began");
		nap_us(100);
	}
}

START_TEST(test_failing_part)
{
	struct task_pool *p = make_pool(2, 10, 0);
	uint32_t done = 0, waiters = 0;

	struct rows_job rj;
	rows_init(&rj, 800, 8, 5);
	rj.fail_part = 3;
	rj.fail_rc = -EIO;
	struct task_job job;
	task_job_init(&job, rows_fn, &rj, 8, &done, 1);
	job.done_waiters = &waiters;
	ck_assert_int_eq(task_pool_submit(p, &job), 0);
	ck_assert_int_eq(task_word_wait(&done, &waiters, 1, 10, WAIT_NS), 0);
	ck_assert_int_eq(job.rc, -EIO);
	ck_assert_str_eq(job.err, "part 3 of 8: row block 3 is bad");
	for (uint32_t k = 0; k < 8; k++) /* the other parts ran, and only once */
		ck_assert_uint_eq(atomic_load(&rj.part_runs[k]), 1);
	rows_free(&rj);

	/* Two failures: the job carries one of them, whole. */
	rows_init(&rj, 800, 8, 5);
	rj.fail_part = 2;
	rj.fail_part2 = 6;
	rj.fail_rc = -ENOMEM;
	task_job_init(&job, rows_fn, &rj, 8, &done, 2);
	job.done_waiters = &waiters;
	ck_assert_int_eq(task_pool_submit(p, &job), 0);
	ck_assert_int_eq(task_word_wait(&done, &waiters, 2, 10, WAIT_NS), 0);
	ck_assert_int_eq(job.rc, -ENOMEM);
	ck_assert_msg(strcmp(job.err, "part 2 of 8: row block 2 is bad") == 0 ||
			      strcmp(job.err, "part 6 of 8: row block 6 is bad") == 0,
		      "message: %s", job.err);
	rows_free(&rj);

	/* A failure without a message gets the code's text. */
	rows_init(&rj, 10, 1, 0);
	rj.fail_part = 0;
	rj.fail_rc = -EINVAL;
	rj.fail_silent = true;
	task_job_init(&job, rows_fn, &rj, 1, &done, 3);
	ck_assert_int_eq(task_pool_submit(p, &job), 0);
	ck_assert_int_eq(task_word_wait(&done, NULL, 3, 10, WAIT_NS), 0);
	ck_assert_int_eq(job.rc, -EINVAL);
	ck_assert_str_eq(job.err, "part 0 of 1: Invalid argument");
	rows_free(&rj);

	/* A job after failures runs cleanly (no error carried over). */
	rows_init(&rj, 100, 4, 9);
	task_job_init(&job, rows_fn, &rj, 4, &done, 4);
	ck_assert_int_eq(task_pool_submit(p, &job), 0);
	ck_assert_int_eq(task_word_wait(&done, NULL, 4, 10, WAIT_NS), 0);
	ck_assert_int_eq(job.rc, 0);
	rows_check(&rj, 4);
	rows_free(&rj);

	struct task_pool_stats st;
	task_pool_get_stats(p, &st);
	ck_assert_uint_eq(st.jobs_failed, 3);
	ck_assert_uint_eq(st.jobs_done, 4);
	task_pool_destroy(&p);
}
END_TEST

/* The hook runs before the store, with rc and err final. */
static uint32_t hook_seen_word;
static int hook_seen_rc;

static void record_hook(struct task_job *job)
{
	hook_seen_word = __atomic_load_n(job->done_word, __ATOMIC_ACQUIRE);
	hook_seen_rc = job->rc;
}

START_TEST(test_completion_hook)
{
	struct task_pool *p = make_pool(2, 0, 0);
	uint32_t done = 0;
	struct rows_job rj;
	rows_init(&rj, 64, 4, 0);
	rj.fail_part = 1;
	rj.fail_rc = -EPERM;
	struct task_job job;
	task_job_init(&job, rows_fn, &rj, 4, &done, 9);
	job.on_complete = record_hook;
	hook_seen_word = 12345;
	ck_assert_int_eq(task_pool_submit(p, &job), 0);
	ck_assert_int_eq(task_word_wait(&done, NULL, 9, 10, WAIT_NS), 0);
	ck_assert_uint_eq(hook_seen_word, 0); /* not yet stored when the hook ran */
	ck_assert_int_eq(hook_seen_rc, -EPERM);
	rows_free(&rj);
	task_pool_destroy(&p);
}
END_TEST

START_TEST(test_destroy_with_work_in_flight)
{
	struct task_pool *p = make_pool(2, 0, 0);
	struct gate g;
	memset(&g, 0, sizeof(g));
	g.pool = p;
	/* Job A occupies both workers until destroy has begun. */
	uint32_t a_done = 0, b_done = 0;
	struct task_job a, b;
	task_job_init(&a, until_destroy_fn, &g, 2, &a_done, 1);
	ck_assert_int_eq(task_pool_submit(p, &a), 0);
	wait_until(gate_started_2, &g, "both workers to start job A");
	/* Job B can only queue. */
	struct rows_job rj;
	rows_init(&rj, 100, 10, 0);
	task_job_init(&b, rows_fn, &rj, 10, &b_done, 1);
	ck_assert_int_eq(task_pool_submit(p, &b), 0);

	task_pool_destroy(&p);
	ck_assert_ptr_null(p);
	/* A ran to the end; B was failed, never dropped, its word stored. */
	ck_assert_uint_eq(a_done, 1);
	ck_assert_int_eq(a.rc, 0);
	ck_assert_uint_eq(b_done, 1);
	ck_assert_int_eq(b.rc, -ECANCELED);
	ck_assert_msg(strstr(b.err, "task pool: stopped before the part ran") != NULL, "message: %s", b.err);
	for (uint32_t k = 0; k < 10; k++)
		ck_assert_uint_eq(atomic_load(&rj.part_runs[k]), 0);
	/* The submit made from a part during destroy failed, and completed its job. */
	ck_assert_int_eq(atomic_load(&g.probe_rc), -ESHUTDOWN);
	ck_assert_uint_eq(g.probe_done, 1);
	ck_assert_int_eq(g.probe.rc, -ECANCELED);
	ck_assert_str_eq(g.probe.err, "task pool: stopped before the job ran");
	rows_free(&rj);
}
END_TEST

/* Holds a pool's one worker in a gate part until g->open. */
static void hold_worker(struct task_pool *p, struct gate *g, struct task_job *gj, uint32_t *g_done)
{
	memset(g, 0, sizeof(*g));
	task_job_init(gj, gate_fn, g, 1, g_done, 1);
	ck_assert_int_eq(task_pool_submit(p, gj), 0);
	wait_until(gate_started_1, g, "the worker to take the gate part");
}

START_TEST(test_queue_full_submitter_helps)
{
	struct task_pool *p = make_pool(1, 0, 4);
	struct gate g;
	uint32_t g_done = 0, done = 0;
	struct task_job gj, job;
	hold_worker(p, &g, &gj, &g_done);
	/* The one worker is held: 20 parts into a queue of 4 leaves 16 for the submitter. */
	struct rows_job rj;
	rows_init(&rj, 1000, 20, 1);
	task_job_init(&job, rows_fn, &rj, 20, &done, 1);
	ck_assert_int_eq(task_pool_submit(p, &job), 0);
	struct task_pool_stats st;
	task_pool_get_stats(p, &st);
	ck_assert_uint_eq(st.parts_inline, 16);
	ck_assert_uint_eq(st.queue_depth, 4);
	ck_assert_uint_eq(st.queue_high_water, 4);
	ck_assert_uint_eq(done, 0);
	atomic_store(&g.open, 1);
	ck_assert_int_eq(task_word_wait(&done, NULL, 1, 10, WAIT_NS), 0);
	ck_assert_int_eq(job.rc, 0);
	rows_check(&rj, 20);
	rows_free(&rj);
	task_pool_destroy(&p);
}
END_TEST

/* ---- a waiting part runs the queue's (task_pool_help) ---- */

/* Part 0 waits for `flag`, running queued parts meanwhile: the only worker would otherwise wait
 * for ever, part 1 (which sets it) being queued behind it. Part 1, run inside part 0, may not run
 * another part inside itself (TASK_POOL_HELP_DEPTH): it tries, then sets the flag after 20 ms. */
struct helper {
	struct task_pool *pool;
	_Atomic uint32_t flag;
	_Atomic uint32_t helped;     /* parts part 0 ran */
	_Atomic uint32_t inner_help; /* parts part 1 ran inside itself: none */
	_Atomic uint64_t ran_ns;     /* task_pool_help's time of the part it ran */
};

static int helper_fn(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	struct helper *h = arg;
	if (part == 1) {
		if (task_pool_help(h->pool, NULL))
			atomic_fetch_add(&h->inner_help, 1);
		const uint64_t t0 = now_ns();
		while (now_ns() - t0 < 20000000ull) /* 20 ms inside part 0: its own time leaves them out */
			nap_us(1000);
		atomic_store(&h->flag, 1);
		return 0;
	}
	uint64_t end = now_ns() + WAIT_NS, ran = 0;
	while (!atomic_load(&h->flag)) {
		if (task_pool_help(h->pool, &ran)) {
			atomic_fetch_add(&h->helped, 1);
			atomic_store(&h->ran_ns, ran);
		} else if (now_ns() > end) {
			return errorf(err, errlen, -ETIMEDOUT, "the flag never came");
		} else {
			sched_yield();
		}
	}
	return 0;
}

START_TEST(test_waiting_part_helps)
{
	struct task_pool *p = make_pool(1, 1000, 0);
	ck_assert(!task_pool_help(p, NULL)); /* nothing queued */
	struct helper h = {.pool = p};
	uint32_t a_done = 0, c_done = 0;
	struct task_job a, c;
	task_job_init(&a, helper_fn, &h, 2, &a_done, 1);
	struct rows_job rj;
	rows_init(&rj, 10, 1, 3);
	task_job_init(&c, rows_fn, &rj, 1, &c_done, 1); /* queued behind a's parts */
	const uint64_t t0 = now_ns();
	ck_assert_int_eq(task_pool_submit(p, &a), 0);
	ck_assert_int_eq(task_pool_submit(p, &c), 0);
	ck_assert_int_eq(task_word_wait(&a_done, NULL, 1, 10, WAIT_NS), 0);
	ck_assert_int_eq(task_word_wait(&c_done, NULL, 1, 10, WAIT_NS), 0);
	const uint64_t wall = now_ns() - t0;
	ck_assert_msg(a.rc == 0 && c.rc == 0, "%s / %s", a.err, c.err);
	ck_assert_uint_eq(atomic_load(&h.helped), 1);
	ck_assert_uint_eq(atomic_load(&h.inner_help), 0);
	ck_assert_uint_ge(atomic_load(&h.ran_ns), 20000000ull); /* task_pool_help's *ns: part 1's time */
	rows_check(&rj, 1);
	struct task_pool_stats st;
	task_pool_get_stats(p, &st);
	ck_assert_uint_eq(st.parts_run, 3);
	ck_assert_uint_eq(st.parts_inline, 0); /* the worker's, though one ran inside another */
	/* part 1's 20 ms once, not once more inside part 0's time */
	ck_assert_msg(st.busy_ns <= wall, "busy %llu ns in %llu ns of wall time: a part run inside another counted twice",
		      (unsigned long long)st.busy_ns, (unsigned long long)wall);
	ck_assert_uint_ge(st.busy_ns, 20000000ull);
	rows_free(&rj);
	task_pool_destroy(&p);
}
END_TEST

/* Another thread than the pool's runs a queued part as a submitter's inline one. */
START_TEST(test_help_from_outside)
{
	struct task_pool *p = make_pool(1, 0, 0);
	struct gate g;
	uint32_t g_done = 0, done = 0;
	struct task_job gj, job;
	hold_worker(p, &g, &gj, &g_done);
	struct rows_job rj;
	rows_init(&rj, 100, 2, 5);
	task_job_init(&job, rows_fn, &rj, 2, &done, 1);
	ck_assert_int_eq(task_pool_submit(p, &job), 0);
	ck_assert(task_pool_help(p, NULL));
	ck_assert(task_pool_help(p, NULL));
	ck_assert(!task_pool_help(p, NULL)); /* both parts ran here */
	ck_assert_uint_eq(done, 1);
	rows_check(&rj, 2);
	struct task_pool_stats st;
	task_pool_get_stats(p, &st);
	ck_assert_uint_eq(st.parts_inline, 2);
	atomic_store(&g.open, 1);
	ck_assert_int_eq(task_word_wait(&g_done, NULL, 1, 10, WAIT_NS), 0);
	rows_free(&rj);
	task_pool_destroy(&p);
}
END_TEST

/* ---- sleeping ---- */

struct sleep_check {
	struct task_pool *pool;
	uint32_t want;	     /* workers asleep */
	uint64_t min_sleeps; /* times workers went to sleep, at least */
};

static bool all_asleep(void *arg)
{
	struct sleep_check *c = arg;
	struct task_pool_stats st;
	task_pool_get_stats(c->pool, &st);
	return st.sleeping == c->want && st.sleeps >= c->min_sleeps;
}

static void idle_cycle(uint32_t spin_us)
{
	struct task_pool *p = make_pool(3, spin_us, 0);
	struct sleep_check c = {.pool = p, .want = 3};
	uint32_t done = 0, waiters = 0;
	for (uint32_t round = 1; round <= 3; round++) {
		wait_until(all_asleep, &c, "every idle worker to sleep");
		struct rows_job rj;
		rows_init(&rj, 999, 6, round);
		struct task_job job;
		task_job_init(&job, rows_fn, &rj, 6, &done, round);
		job.done_waiters = &waiters;
		ck_assert_int_eq(task_pool_submit(p, &job), 0);
		ck_assert_int_eq(task_word_wait(&done, &waiters, round, 0, WAIT_NS), 0);
		rows_check(&rj, 6);
		rows_free(&rj);
	}
	/* 3 went to sleep at start; in each round at least one of them woke to run parts and went
	 * back to sleep after. */
	c.min_sleeps = 3 + 3;
	wait_until(all_asleep, &c, "every idle worker to sleep again after the jobs");
	task_pool_destroy(&p);
}

START_TEST(test_idle_workers_sleep)
{
	idle_cycle(0);
	idle_cycle(2000);
}
END_TEST

/* ---- the idle hook ---- */

/* Work that comes from elsewhere (as a GPU's trigger does): the test raises `ready`, and whichever
 * idle worker's hook takes it first (an exchange) submits the job. */
struct idle_source {
	struct task_pool *pool;
	_Atomic uint32_t ready;
	_Atomic uint32_t taken;	   /* submits made by the hook */
	_Atomic uint32_t calls;
	uint32_t seen;		   /* calls at a point of the test */
	_Atomic uint32_t inside;   /* hooks running now */
	_Atomic uint32_t nap;	   /* the hook naps this many us while inside (the clear's wait) */
	struct task_job job;
	uint32_t done;
	struct rows_job rows;
};

static uint32_t idle_take(void *arg)
{
	struct idle_source *src = arg;
	atomic_fetch_add(&src->inside, 1);
	atomic_fetch_add(&src->calls, 1);
	uint32_t did = 0;
	if (atomic_exchange(&src->ready, 0)) {
		atomic_fetch_add(&src->taken, 1); /* before the submit: the job may be done when it returns */
		ck_assert_int_eq(task_pool_submit(src->pool, &src->job), 0);
		did = 1;
	}
	uint32_t nap = atomic_load(&src->nap);
	if (nap)
		nap_us(nap);
	atomic_fetch_sub(&src->inside, 1);
	return did;
}

static bool source_done(void *arg)
{
	struct idle_source *src = arg;
	return __atomic_load_n(&src->done, __ATOMIC_ACQUIRE) == src->job.done_value;
}

static bool source_called_again(void *arg)
{
	struct idle_source *src = arg;
	return atomic_load(&src->calls) != src->seen;
}

static bool idle_work_50(void *pool)
{
	struct task_pool_stats st;
	task_pool_get_stats(pool, &st);
	return st.idle_work >= 50;
}

/* Jobs that no thread submits but the idle workers' hook, each taken exactly once; a second hook
 * refused; clearing waits for a hook still running and stops the calls; a pool whose workers
 * sleep at once never calls it. */
START_TEST(test_idle_hook)
{
	static struct idle_source src;
	memset(&src, 0, sizeof(src));
	src.pool = make_pool(3, 2000000, 0); /* spin 2 s: idle workers poll through the test */
	ck_assert_int_eq(task_pool_set_idle(src.pool, idle_take, &src), 0);
	ck_assert_int_eq(task_pool_set_idle(src.pool, idle_take, &src), -EBUSY);
	const uint32_t rounds = 50, parts = 6;
	for (uint32_t k = 1; k <= rounds; k++) {
		rows_init(&src.rows, 1000, parts, k);
		task_job_init(&src.job, rows_fn, &src.rows, parts, &src.done, k);
		atomic_store(&src.ready, 1);
		wait_until(source_done, &src, "a job only the idle hook submits");
		ck_assert_int_eq(src.job.rc, 0);
		rows_check(&src.rows, parts);
		rows_free(&src.rows);
		ck_assert_uint_eq(atomic_load(&src.taken), k);
	}
	/* The hook's count moves after it returns, which may be after its job is done. */
	wait_until(idle_work_50, src.pool, "50 calls of the hook that did something");
	struct task_pool_stats st;
	nap_us(2000);
	task_pool_get_stats(src.pool, &st);
	ck_assert_uint_eq(st.idle_work, rounds);
	ck_assert_uint_eq(st.jobs_done, rounds);

	atomic_store(&src.nap, 3000); /* a hook inside for 3 ms at a time */
	src.seen = atomic_load(&src.calls);
	wait_until(source_called_again, &src, "the hook called again (napping inside)");
	ck_assert_int_eq(task_pool_set_idle(src.pool, NULL, NULL), 0);
	ck_assert_uint_eq(atomic_load(&src.inside), 0); /* cleared: no worker still inside */
	const uint32_t after = atomic_load(&src.calls);
	nap_us(20000);
	ck_assert_uint_eq(atomic_load(&src.calls), after);
	ck_assert_int_eq(task_pool_set_idle(src.pool, NULL, NULL), 0); /* none to clear */
	task_pool_destroy(&src.pool);

	/* Workers that sleep at once (spin 0) poll nothing; a hook left set is freed by destroy. */
	memset(&src, 0, sizeof(src));
	src.pool = make_pool(2, 0, 0);
	ck_assert_int_eq(task_pool_set_idle(src.pool, idle_take, &src), 0);
	rows_init(&src.rows, 10, 1, 1);
	task_job_init(&src.job, rows_fn, &src.rows, 1, &src.done, 1);
	ck_assert_int_eq(task_pool_submit(src.pool, &src.job), 0);
	wait_until(source_done, &src, "a job submitted to sleeping workers");
	nap_us(5000);
	ck_assert_uint_eq(atomic_load(&src.calls), 0);
	rows_free(&src.rows);
	task_pool_destroy(&src.pool);
}
END_TEST

/* ---- task_word_wait ---- */

struct submit_later {
	struct task_pool *pool;
	struct task_job *job;
	uint32_t *waiters;
	int rc;
};

/* Submits the job once a waiter sleeps on its word, so only the completion's wake can end it. */
static void *submit_when_sleeping(void *arg)
{
	struct submit_later *s = arg;
	uint64_t end = now_ns() + WAIT_NS;
	while (__atomic_load_n(s->waiters, __ATOMIC_SEQ_CST) == 0 && now_ns() < end)
		nap_us(100);
	s->rc = task_pool_submit(s->pool, s->job);
	return NULL;
}

struct store_later {
	uint32_t *word;
	uint32_t value;
};

static void *store_now(void *arg)
{
	struct store_later *s = arg;
	__atomic_store_n(s->word, s->value, __ATOMIC_RELEASE);
	return NULL;
}

static int nothing_fn(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	return 0;
}

START_TEST(test_word_wait)
{
	uint32_t word = 5, waiters = 0;
	ck_assert_int_eq(task_word_wait(&word, &waiters, 5, 0, 0), 0);
	ck_assert_int_eq(task_word_wait(&word, &waiters, 3, 0, 0), 0);
	ck_assert_int_eq(task_word_wait(&word, &waiters, 6, 50, 20 * 1000 * 1000), -ETIMEDOUT);
	ck_assert_int_eq(task_word_wait(&word, NULL, 6, 0, 20 * 1000 * 1000), -ETIMEDOUT);
	ck_assert_uint_eq(waiters, 0);
	/* Cyclic: 2 is past 0xfffffffe, and not the other way round. */
	word = 2;
	ck_assert_int_eq(task_word_wait(&word, &waiters, 0xfffffffeu, 0, 0), 0);
	word = 0xfffffffeu;
	ck_assert_int_eq(task_word_wait(&word, &waiters, 2, 0, 1000 * 1000), -ETIMEDOUT);

	/* A waiter asleep on the futex is woken by the job's completion (without the wake it would
	 * sleep until the timeout). */
	struct task_pool *p = make_pool(1, 0, 0);
	word = 0;
	struct task_job job;
	task_job_init(&job, nothing_fn, NULL, 1, &word, 1);
	job.done_waiters = &waiters;
	struct submit_later sl = {.pool = p, .job = &job, .waiters = &waiters, .rc = 1};
	pthread_t th;
	ck_assert_int_eq(pthread_create(&th, NULL, submit_when_sleeping, &sl), 0);
	ck_assert_int_eq(task_word_wait(&word, &waiters, 1, 0, WAIT_NS), 0);
	pthread_join(th, NULL);
	ck_assert_int_eq(sl.rc, 0);
	ck_assert_uint_eq(waiters, 0);
	task_pool_destroy(&p);

	/* Without a waiter count nobody wakes the waiter: it polls, and still sees the store. */
	word = 0;
	struct store_later st = {.word = &word, .value = 3};
	ck_assert_int_eq(pthread_create(&th, NULL, store_now, &st), 0);
	ck_assert_int_eq(task_word_wait(&word, NULL, 3, 0, WAIT_NS), 0);
	pthread_join(th, NULL);
}
END_TEST

/* ---- configurations ---- */

START_TEST(test_config)
{
	char err[256];
	struct task_pool *p = NULL;
	struct task_pool_config cfg;

	task_pool_config_default(&cfg);
	cfg.threads = TASK_POOL_MAX_THREADS + 1;
	ck_assert_int_eq(task_pool_create(&cfg, &p, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_null(p);
	ck_assert_msg(strstr(err, "task pool: ") == err, "message: %s", err);

	task_pool_config_default(&cfg);
	cfg.cpu_offset = CPU_SETSIZE;
	ck_assert_int_eq(task_pool_create(&cfg, &p, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "cpu offset") != NULL, "message: %s", err);

	task_pool_config_default(&cfg);
	int bad_cpu = CPU_SETSIZE + 3;
	cfg.cpus = &bad_cpu;
	cfg.n_cpus = 1;
	ck_assert_int_eq(task_pool_create(&cfg, &p, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "out of range") != NULL, "message: %s", err);

	task_pool_config_default(&cfg);
	cfg.threads = 1;
	cfg.queue_capacity = 3;
	ck_assert_int_eq(task_pool_create(&cfg, &p, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "capacity") != NULL, "message: %s", err);

	/* threads 0: one per allowed CPU after the offset. */
	cpu_set_t allowed;
	ck_assert_int_eq(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
	uint32_t n_allowed = (uint32_t)CPU_COUNT(&allowed);
	int first = -1;
	for (int cpu = 0; cpu < CPU_SETSIZE && first < 0; cpu++)
		if (CPU_ISSET(cpu, &allowed))
			first = cpu;
	/* A CPU number the machine does not have (a taskset mask alone would not refuse pinning). */
	int unallowed = sysconf(_SC_NPROCESSORS_CONF) < CPU_SETSIZE ? CPU_SETSIZE - 1 : -1;
	task_pool_config_default(&cfg);
	cfg.pin = false;
	ck_assert_int_eq(task_pool_create(&cfg, &p, err, sizeof(err)), 0);
	ck_assert_uint_eq(task_pool_threads(p), n_allowed);
	ck_assert_int_eq(task_pool_worker_cpu(p, 0), -1);
	task_pool_destroy(&p);

	/* Pinned to the CPUs given. */
	task_pool_config_default(&cfg);
	cfg.threads = 2;
	cfg.cpus = &first;
	cfg.n_cpus = 1;
	ck_assert_int_eq(task_pool_create(&cfg, &p, err, sizeof(err)), 0);
	struct sleep_check c = {.pool = p, .want = 2};
	wait_until(all_asleep, &c, "the pinned workers to start and sleep");
	ck_assert_int_eq(task_pool_worker_cpu(p, 0), first);
	ck_assert_int_eq(task_pool_worker_cpu(p, 1), first);
	struct task_pool_stats st;
	task_pool_get_stats(p, &st);
	ck_assert_uint_eq(st.pinned, 2);
	/* ... and their parts run there: each part says where it ran. */
	int ran_on[8];
	uint32_t where_done = 0, where_waiters = 0;
	struct task_job where;
	task_job_init(&where, where_fn, ran_on, 8, &where_done, 1);
	where.done_waiters = &where_waiters;
	ck_assert_int_eq(task_pool_submit(p, &where), 0);
	ck_assert_int_eq(task_word_wait(&where_done, &where_waiters, 1, 10, WAIT_NS), 0);
	ck_assert_int_eq(where.rc, 0);
	for (int i = 0; i < 8; i++)
		ck_assert_msg(ran_on[i] == first, "part %d ran on CPU %d, its worker pinned to %d", i, ran_on[i], first);
	task_pool_destroy(&p);

	/* More workers than the CPUs after the offset: they wrap within those, never onto the CPUs
	 * the offset keeps (the runner's thread, the handoff's dispatcher). */
	if (n_allowed >= 2) {
		int last = -1;
		for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
			if (CPU_ISSET(cpu, &allowed))
				last = cpu;
		task_pool_config_default(&cfg);
		cfg.threads = 3;
		cfg.cpu_offset = n_allowed - 1;
		ck_assert_int_eq(task_pool_create(&cfg, &p, err, sizeof(err)), 0);
		for (uint32_t i = 0; i < 3; i++)
			ck_assert_int_eq(task_pool_worker_cpu(p, i), last);
		task_pool_destroy(&p);
	}

	/* A CPU that cannot be had: logged, the worker runs unpinned, the pool works. */
	if (unallowed >= 0) {
		task_pool_config_default(&cfg);
		cfg.threads = 1;
		cfg.cpus = &unallowed;
		cfg.n_cpus = 1;
		ck_assert_int_eq(task_pool_create(&cfg, &p, err, sizeof(err)), 0);
		c = (struct sleep_check){.pool = p, .want = 1};
		wait_until(all_asleep, &c, "the worker to start and sleep");
		ck_assert_int_eq(task_pool_worker_cpu(p, 0), -1);
		task_pool_get_stats(p, &st);
		ck_assert_uint_eq(st.pinned, 0);
		uint32_t done = 0;
		struct rows_job rj;
		rows_init(&rj, 50, 2, 4);
		struct task_job job;
		task_job_init(&job, rows_fn, &rj, 2, &done, 1);
		ck_assert_int_eq(task_pool_submit(p, &job), 0);
		ck_assert_int_eq(task_word_wait(&done, NULL, 1, 10, WAIT_NS), 0);
		rows_check(&rj, 2);
		rows_free(&rj);
		task_pool_destroy(&p);
	}

	/* The offset skips CPUs. */
	if (n_allowed >= 2) {
		task_pool_config_default(&cfg);
		cfg.cpu_offset = 1;
		ck_assert_int_eq(task_pool_create(&cfg, &p, err, sizeof(err)), 0);
		ck_assert_uint_eq(task_pool_threads(p), n_allowed - 1);
		c = (struct sleep_check){.pool = p, .want = n_allowed - 1};
		wait_until(all_asleep, &c, "the workers to start and sleep");
		for (uint32_t i = 0; i < n_allowed - 1; i++)
			ck_assert_int_ne(task_pool_worker_cpu(p, i), first);
		task_pool_destroy(&p);
	}
}
END_TEST

int main(void)
{
	Suite *s = suite_create("task_pool");
	TCase *tc = tcase_create("jobs");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_part_range);
	tcase_add_test(tc, test_jobs_with_parts);
	tcase_add_test(tc, test_concurrent_submitters);
	tcase_add_test(tc, test_failing_part);
	tcase_add_test(tc, test_completion_hook);
	tcase_add_test(tc, test_queue_full_submitter_helps);
	tcase_add_test(tc, test_waiting_part_helps);
	tcase_add_test(tc, test_help_from_outside);
	suite_add_tcase(s, tc);
	tc = tcase_create("lifecycle");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_destroy_with_work_in_flight);
	tcase_add_test(tc, test_idle_workers_sleep);
	tcase_add_test(tc, test_idle_hook);
	tcase_add_test(tc, test_word_wait);
	tcase_add_test(tc, test_config);
	suite_add_tcase(s, tc);
	return th_run(s);
}

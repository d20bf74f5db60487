/* test_cpu_handoff.c - a CUDA stream handing work to the CPU task pool and waiting for it on the
 * GPU (cuda/cpu_handoff.h), with both mechanisms, host functions and stream memory operations
 * (LABELS gpu).
 *
 * Each step s: a kernel writes x (4096 floats, small integers), the handoff copies x down, a pool
 * job of 4 parts computes y = 2x + s on the CPU, the stream waits for it and copies y up, and a
 * kernel checks y against the formula (counting bad values per step) and adds it into an
 * accumulator. 1000 steps, queued without any host synchronisation until the end; half of them
 * with two handoffs in flight (submit s, submit s+1, wait s, wait s+1: both pinned slots in use).
 * Results must be exact: no bad value, the accumulator equal to the sum computed here.
 *
 * With a failure injected at one step: the stream still runs to the end (a hang would time the
 * test out), cpu_handoff_check reports the step's message once, every other step is exact.
 * Also: handoffs submitted and never waited for, then destroy (nothing hangs or leaks); what
 * create refuses. If this GPU cannot run memops, those cases print why and pass.
 *
 * Without a GPU the program exits 77 (ctest: skipped); CUDA is touched only in the forked tests. */
#include <check.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "common/util.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/cuda/cpu_handoff.h"
#include "tests/unit/gpu-runner/cpu_handoff_kernels.h"
#include "tests/unit/gpu-runner/cuda_test_util.h"

#define N 4096u
#define STEPS 1000u
#define PARTS 4u

struct step_arg {
	uint32_t fail_step; /* 0: none */
};

static struct step_arg g_arg;

/* y = 2x + step over the part's rows; step travels in the job's user pointer. */
static int twice_plus_step(const struct cpu_handoff_task *t, uint32_t part, uint32_t n_parts, char *err,
			   size_t errlen)
{
	uint32_t step = (uint32_t)(uintptr_t)t->user;
	if (step == g_arg.fail_step && part == 1)
		return errorf(err, errlen, -EIO, "injected failure at step %u", step);
	const float *x = t->in;
	float *y = t->out;
	uint32_t n = (uint32_t)(t->in_bytes / sizeof(float)), b, e;
	task_part_range(n, n_parts, part, &b, &e);
	for (uint32_t i = b; i < e; i++)
		y[i] = 2.0f * x[i] + (float)step;
	return 0;
}

struct rig {
	struct task_pool *pool;
	cudaStream_t stream;
	struct cpu_handoff *h;
	float *d_x[2], *d_y[2], *d_acc;
	uint32_t *d_bad;
};

/* The results come up by the kernel that reads mapped host memory (cpu_handoff_params.mapped_out),
 * and that kernel waits for the job itself (poll_out). */
static bool g_mapped, g_polled;
/* The test's thread waits for the stream by cpu_handoff_poll and cudaStreamQuery, handing the pool
 * jobs beside the dispatcher (--cpu-dispatch both). */
static bool g_poll;
/* ... and no dispatcher: every job from the test's polls (a ring the steps never wrap). */
static bool g_no_dispatcher;
static bool g_workers; /* the pool's idle workers dispatch (workers_dispatch) */
static bool g_prefetch; /* ... and read each job's "weights" ahead (prefetch_bytes) */
#define PREFETCH_CAP (1u << 20)
#define PREFETCH_DELAY_US 300u

/* The read-ahead of a test job: its argument is its step in every word (a torn copy would mix two);
 * what it was asked for is counted. */
static uint64_t g_pf_bytes, g_pf_bad;
static uint64_t count_prefetch(const void *arg, uint64_t offset, uint64_t bytes)
{
	uint32_t words[CPU_HANDOFF_PREFETCH_ARG / 4];
	memcpy(words, arg, sizeof(words));
	const uint32_t step = words[0];
	bool same = true;
	for (size_t i = 1; i < CPU_HANDOFF_PREFETCH_ARG / 4; i++)
		same = same && words[i] == step;
	if (!same || step < 1 || step > STEPS || offset + bytes > PREFETCH_CAP || bytes == 0)
		__atomic_add_fetch(&g_pf_bad, 1, __ATOMIC_RELAXED);
	__atomic_add_fetch(&g_pf_bytes, bytes, __ATOMIC_RELAXED);
	return bytes;
}

/* Returns false (and says why) when the mode cannot run here: memops on a GPU without it. */
static bool rig_open(struct rig *r, enum cpu_handoff_mode mode, uint32_t ring)
{
	char err[CPU_HANDOFF_ERR_MAX];
	memset(r, 0, sizeof(*r));
	struct task_pool_config cfg;
	task_pool_config_default(&cfg);
	cfg.threads = 4;
	cfg.pin = false;
	cfg.spin_us = g_workers ? 60000000 : 20; /* dispatching workers must not fall asleep */
	ck_assert_msg(task_pool_create(&cfg, &r->pool, err, sizeof(err)) == 0, "%s", err);
	CUDA_OK(cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking));
	struct cpu_handoff_params hp = {.mode = mode,
					.max_in_bytes = N * sizeof(float),
					.max_out_bytes = N * sizeof(float),
					.ring = ring,
					.spin_us = 20,
					.dispatcher_cpu = -1,
					.mapped_out = g_mapped,
					.poll_out = g_polled,
					.no_dispatcher = g_no_dispatcher,
					.workers_dispatch = g_workers,
					.prefetch_bytes = g_prefetch ? PREFETCH_CAP : 0};
	int rc = cpu_handoff_create(r->pool, r->stream, &hp, &r->h, err, sizeof(err));
	if (rc == -ENOTSUP && mode == CPU_HANDOFF_MEMOPS) {
		fprintf(stderr, "test_cpu_handoff: memops cannot run here, not tested: %s\n", err);
		ck_assert_ptr_null(r->h);
		ck_assert_msg(strstr(err, "cpu handoff: memops") != NULL, "message: %s", err);
		return false;
	}
	ck_assert_msg(rc == 0, "cpu_handoff_create(%s): %d %s", cpu_handoff_mode_name(mode), rc, err);
	ck_assert_int_eq(cpu_handoff_mode(r->h), mode);
	for (int k = 0; k < 2; k++) {
		CUDA_OK(cudaMalloc((void **)&r->d_x[k], N * sizeof(float)));
		CUDA_OK(cudaMalloc((void **)&r->d_y[k], N * sizeof(float)));
	}
	CUDA_OK(cudaMalloc((void **)&r->d_acc, N * sizeof(float)));
	CUDA_OK(cudaMalloc((void **)&r->d_bad, (STEPS + 2) * sizeof(uint32_t)));
	CUDA_OK(cudaMemsetAsync(r->d_acc, 0, N * sizeof(float), r->stream));
	CUDA_OK(cudaMemsetAsync(r->d_bad, 0, (STEPS + 2) * sizeof(uint32_t), r->stream));
	return true;
}

static void rig_close(struct rig *r)
{
	cpu_handoff_destroy(&r->h);
	ck_assert_ptr_null(r->h);
	cpu_handoff_destroy(&r->h);
	for (int k = 0; k < 2; k++) {
		CUDA_OK(cudaFree(r->d_x[k]));
		CUDA_OK(cudaFree(r->d_y[k]));
	}
	CUDA_OK(cudaFree(r->d_acc));
	CUDA_OK(cudaFree(r->d_bad));
	CUDA_OK(cudaStreamDestroy(r->stream));
	task_pool_destroy(&r->pool);
}

static void submit_step(struct rig *r, uint32_t step, int k, uint64_t *seq)
{
	char err[CPU_HANDOFF_ERR_MAX];
	CUDA_OK(handoff_test_fill(r->d_x[k], N, step, r->stream));
	struct cpu_handoff_job job = {.fn = twice_plus_step,
				      .user = (void *)(uintptr_t)step,
				      .n_parts = PARTS,
				      .in_bytes = N * sizeof(float),
				      .out_bytes = N * sizeof(float)};
	if (g_prefetch) {
		job.prefetch = count_prefetch;
		for (size_t i = 0; i < CPU_HANDOFF_PREFETCH_ARG / 4; i++)
			memcpy(job.prefetch_arg + 4 * i, &step, sizeof(step));
		/* The stream held a while before the input's copy and trigger: the job is published and
		 * waits for its trigger, the time the idle workers read it ahead in. */
		CUDA_OK(handoff_test_delay(PREFETCH_DELAY_US, r->stream));
	}
	int rc = cpu_handoff_submit(r->h, r->d_x[k], &job, seq, err, sizeof(err));
	ck_assert_msg(rc == 0, "submit step %u: %s", step, err);
	ck_assert_uint_eq(*seq, step);
}

static void wait_step(struct rig *r, uint32_t step, int k, uint64_t seq)
{
	char err[CPU_HANDOFF_ERR_MAX];
	int rc = cpu_handoff_wait(r->h, seq, r->d_y[k], err, sizeof(err));
	ck_assert_msg(rc == 0, "wait step %u: %s", step, err);
	CUDA_OK(handoff_test_check(r->d_y[k], N, step, r->d_bad, r->d_acc, r->stream));
}

/* The stream run dry by this thread's polls (cpu_handoff_poll): with no dispatcher nothing else
 * hands the pool its jobs, and a stream left to queue a thousand steps' work would fill the
 * driver's queue, blocking this thread in a launch that only its own poll could release. */
static void poll_dry(struct rig *r)
{
	cudaError_t e;
	while ((e = cudaStreamQuery(r->stream)) == cudaErrorNotReady)
		(void)cpu_handoff_poll(r->h);
	CUDA_OK(e);
}

/* Steps 1..STEPS: the first half one handoff at a time, the second half two in flight. Then the
 * one synchronisation, and the checks. */
static void run_steps(enum cpu_handoff_mode mode, uint32_t fail_step, uint32_t ring)
{
	struct rig r;
	if (!rig_open(&r, mode, ring))
		return;
	g_arg.fail_step = fail_step;
	uint32_t step = 1;
	for (; step <= STEPS / 2; step++) {
		uint64_t seq;
		submit_step(&r, step, 0, &seq);
		wait_step(&r, step, 0, seq);
		if (g_no_dispatcher && g_poll)
			poll_dry(&r);
	}
	for (; step + 1 <= STEPS; step += 2) {
		uint64_t s0, s1;
		submit_step(&r, step, 0, &s0);
		submit_step(&r, step + 1, 1, &s1);
		wait_step(&r, step, 0, s0);
		wait_step(&r, step + 1, 1, s1);
		if (g_no_dispatcher && g_poll)
			poll_dry(&r); /* both triggers come before the first wait: two jobs in flight */
	}
	if (g_poll)
		poll_dry(&r);
	CUDA_OK(cudaStreamSynchronize(r.stream));

	uint32_t *bad = malloc((STEPS + 2) * sizeof(uint32_t));
	float *acc = malloc(N * sizeof(float));
	ck_assert(bad && acc);
	CUDA_OK(cudaMemcpy(bad, r.d_bad, (STEPS + 2) * sizeof(uint32_t), cudaMemcpyDeviceToHost));
	CUDA_OK(cudaMemcpy(acc, r.d_acc, N * sizeof(float), cudaMemcpyDeviceToHost));
	for (uint32_t s = 1; s <= STEPS; s++)
		if (s != fail_step)
			ck_assert_msg(bad[s] == 0, "%s: step %u: %u of %u values wrong", cpu_handoff_mode_name(mode), s,
				      bad[s], N);
	if (!fail_step)
		for (uint32_t i = 0; i < N; i++) {
			double want = 0;
			for (uint32_t s = 1; s <= STEPS; s++)
				want += 2.0 * handoff_test_x(i, s) + s;
			ck_assert_msg(acc[i] == (float)want, "%s: sum of row %u is %.1f, not %.1f",
				      cpu_handoff_mode_name(mode), i, (double)acc[i], want);
		}

	char err[CPU_HANDOFF_ERR_MAX];
	int rc = cpu_handoff_check(r.h, err, sizeof(err));
	struct cpu_handoff_stats st;
	cpu_handoff_get_stats(r.h, &st);
	ck_assert_uint_eq(st.submitted, STEPS);
	ck_assert_uint_eq(st.waited, STEPS);
	ck_assert_uint_eq(st.dispatched, STEPS); /* each job handed over once, by whichever thread */
	ck_assert_uint_le(st.by_poll, g_poll ? STEPS : 0);
	ck_assert_uint_le(st.by_workers, g_workers ? STEPS : 0);
	/* Read-ahead: every call's range within the cap and its argument a step's; the stats count what
	 * the calls returned (a worker may still be inside one: at most what they counted); at most the
	 * cap a job. */
	ck_assert_uint_eq(__atomic_load_n(&g_pf_bad, __ATOMIC_RELAXED), 0);
	ck_assert_uint_le(st.prefetched, __atomic_load_n(&g_pf_bytes, __ATOMIC_RELAXED));
	ck_assert_uint_le(st.prefetched, (uint64_t)STEPS * PREFETCH_CAP);
	if (!g_prefetch)
		ck_assert_uint_eq(st.prefetched, 0);
	else /* 300 us a job for 32 claims that read nothing: all but a few jobs read all of it ahead */
		ck_assert_msg(st.prefetched >= (uint64_t)STEPS * PREFETCH_CAP / 2, "%llu bytes read ahead over %u jobs",
			      (unsigned long long)st.prefetched, STEPS);
	if (getenv("PIPELINE_TEST_VERBOSE") && g_prefetch)
		fprintf(stderr, "test_cpu_handoff: %llu bytes read ahead over %u jobs\n",
			(unsigned long long)st.prefetched, STEPS);
	if (g_no_dispatcher)
		ck_assert_uint_eq(st.by_poll + st.by_workers, STEPS);
	if (fail_step) {
		ck_assert_int_eq(rc, -EIO);
		char want[128];
		snprintf(want, sizeof(want), "cpu handoff: handoff %u: part 1 of %u: injected failure at step %u",
			 fail_step, PARTS, fail_step);
		ck_assert_str_eq(err, want);
		ck_assert_uint_eq(st.failed, 1);
		ck_assert_int_eq(cpu_handoff_check(r.h, err, sizeof(err)), 0); /* reported once */
	} else {
		ck_assert_msg(rc == 0, "check: %s", err);
		ck_assert_uint_eq(st.failed, 0);
	}
	if (getenv("PIPELINE_TEST_VERBOSE"))
		fprintf(stderr, "test_cpu_handoff: %s: %u steps, %llu submits waited for the ring, %llu jobs dispatched "
			"by the waiting thread, %llu by idle workers\n", cpu_handoff_mode_name(mode), STEPS,
			(unsigned long long)st.ring_waits, (unsigned long long)st.by_poll,
			(unsigned long long)st.by_workers);
	free(bad);
	free(acc);
	rig_close(&r); /* the idle hook cleared: no worker counts any more */
	__atomic_store_n(&g_pf_bytes, 0, __ATOMIC_RELAXED);
}

START_TEST(test_hostfunc_round_trips)
{
	run_steps(CPU_HANDOFF_HOSTFUNC, 0, 0);
}
END_TEST

START_TEST(test_memops_round_trips)
{
	run_steps(CPU_HANDOFF_MEMOPS, 0, 0);
}
END_TEST

/* The results read up from mapped host memory by a kernel (--cpu-result mapped), both mechanisms, one
 * and two handoffs in flight (slot reuse), and a failed job. */
START_TEST(test_mapped_round_trips)
{
	g_mapped = true;
	run_steps(CPU_HANDOFF_HOSTFUNC, 0, 0);
	run_steps(CPU_HANDOFF_MEMOPS, 0, 0);
	run_steps(CPU_HANDOFF_MEMOPS, STEPS / 3, 0);
	g_mapped = false;
}
END_TEST

/* The same with the kernel polling the job's completion word (--cpu-result polled): memops; hostfunc
 * (whose words are not mapped) waits as mapped does. */
START_TEST(test_polled_round_trips)
{
	g_mapped = g_polled = true;
	run_steps(CPU_HANDOFF_MEMOPS, 0, 0);
	run_steps(CPU_HANDOFF_MEMOPS, STEPS / 3, 0);
	run_steps(CPU_HANDOFF_MEMOPS, 0, 2);
	run_steps(CPU_HANDOFF_HOSTFUNC, 0, 0);
	g_mapped = g_polled = false;
}
END_TEST

/* The waiting thread dispatching beside the dispatcher (--cpu-dispatch both): every job handed over
 * once, the results right, a failure reported; hostfunc has nothing to poll. */
START_TEST(test_poll_round_trips)
{
	g_poll = true;
	run_steps(CPU_HANDOFF_MEMOPS, 0, 0);
	run_steps(CPU_HANDOFF_MEMOPS, STEPS / 3, 0);
	g_mapped = true;
	run_steps(CPU_HANDOFF_MEMOPS, 0, 0);
	g_mapped = false;
	run_steps(CPU_HANDOFF_HOSTFUNC, 0, 0);
	/* The poll alone: every job handed over by it, two in flight among them. */
	g_no_dispatcher = true;
	run_steps(CPU_HANDOFF_MEMOPS, 0, 1024);
	run_steps(CPU_HANDOFF_MEMOPS, STEPS / 3, 1024);
	g_no_dispatcher = false;
	g_poll = false;
}
END_TEST

/* The pool's idle workers dispatching beside the dispatcher (--cpu-dispatch workers), and alone:
 * every job handed over once, by them when nothing else can (the runs without a dispatcher are the
 * ones that prove the hook runs), two in flight among them; a failure reported. */
START_TEST(test_workers_round_trips)
{
	g_workers = true;
	run_steps(CPU_HANDOFF_MEMOPS, 0, 0);
	g_no_dispatcher = true;
	run_steps(CPU_HANDOFF_MEMOPS, 0, 0);
	run_steps(CPU_HANDOFF_MEMOPS, STEPS / 3, 0);
	g_mapped = true;
	run_steps(CPU_HANDOFF_MEMOPS, 0, 2);
	g_mapped = false;
	g_no_dispatcher = false;
	/* Reading each job ahead while it waits for its trigger: the results as before. */
	g_prefetch = true;
	run_steps(CPU_HANDOFF_MEMOPS, 0, 0);
	run_steps(CPU_HANDOFF_MEMOPS, STEPS / 3, 0);
	g_prefetch = false;
	g_workers = false;
}
END_TEST

/* A ring of 2: the host waits for the CPU at almost every submit. */
START_TEST(test_small_ring)
{
	run_steps(CPU_HANDOFF_HOSTFUNC, 0, 2);
	run_steps(CPU_HANDOFF_MEMOPS, 0, 2);
}
END_TEST

START_TEST(test_hostfunc_failure)
{
	run_steps(CPU_HANDOFF_HOSTFUNC, 500, 0); /* one at a time */
	run_steps(CPU_HANDOFF_HOSTFUNC, 801, 0); /* two in flight */
}
END_TEST

START_TEST(test_memops_failure)
{
	run_steps(CPU_HANDOFF_MEMOPS, 500, 0);
	run_steps(CPU_HANDOFF_MEMOPS, 801, 0);
}
END_TEST

/* Two handoffs submitted, never waited for: destroy synchronises, waits for their jobs, frees. */
static void destroy_unwaited(enum cpu_handoff_mode mode)
{
	struct rig r;
	if (!rig_open(&r, mode, 0))
		return;
	g_arg.fail_step = 0;
	uint64_t s0, s1;
	submit_step(&r, 1, 0, &s0);
	submit_step(&r, 2, 1, &s1);
	rig_close(&r);
}

START_TEST(test_destroy_unwaited)
{
	destroy_unwaited(CPU_HANDOFF_HOSTFUNC);
	destroy_unwaited(CPU_HANDOFF_MEMOPS);
	g_workers = true; /* destroy clears the idle hook before it waits for the last jobs */
	destroy_unwaited(CPU_HANDOFF_MEMOPS);
	g_workers = false;
}
END_TEST

START_TEST(test_refusals)
{
	char err[CPU_HANDOFF_ERR_MAX];
	struct task_pool *pool = NULL;
	struct task_pool_config cfg;
	task_pool_config_default(&cfg);
	cfg.threads = 1;
	cfg.pin = false;
	ck_assert_int_eq(task_pool_create(&cfg, &pool, err, sizeof(err)), 0);
	cudaStream_t stream;
	CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
	struct cpu_handoff *h = NULL;
	struct cpu_handoff_params hp = {.mode = CPU_HANDOFF_HOSTFUNC, .max_in_bytes = 64, .max_out_bytes = 64,
					.ring = 3, .dispatcher_cpu = -1};
	ck_assert_int_eq(cpu_handoff_create(pool, stream, &hp, &h, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_null(h);
	ck_assert_msg(strstr(err, "ring 3") != NULL, "message: %s", err);
	hp.ring = 0;
	hp.mode = (enum cpu_handoff_mode)7;
	ck_assert_int_eq(cpu_handoff_create(pool, stream, &hp, &h, err, sizeof(err)), -EINVAL);

	enum cpu_handoff_mode m;
	ck_assert_int_eq(cpu_handoff_parse_mode("memops", &m, err, sizeof(err)), 0);
	ck_assert_int_eq(m, CPU_HANDOFF_MEMOPS);
	ck_assert_int_eq(cpu_handoff_parse_mode("hostfunc", &m, err, sizeof(err)), 0);
	ck_assert_int_eq(m, CPU_HANDOFF_HOSTFUNC);
	ck_assert_int_eq(cpu_handoff_parse_mode("callback", &m, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "'callback'") != NULL, "message: %s", err);

	/* Whatever this GPU answers, it answers with a reason. */
	int rc = cpu_handoff_memops_supported(0, err, sizeof(err));
	ck_assert_msg(rc == 0 || ((rc == -ENOTSUP || rc == -EIO) && strstr(err, "cpu handoff: memops") != NULL),
		      "memops_supported: %d %s", rc, err);
	if (rc == 0) {
		/* The idle workers' dispatch on a pool whose idle hook is taken: refused, the first
		 * handoff's hook left alone; once that one is destroyed, the hook is free again. */
		struct cpu_handoff *h1 = NULL;
		hp.mode = CPU_HANDOFF_MEMOPS;
		hp.workers_dispatch = true;
		ck_assert_int_eq(cpu_handoff_create(pool, stream, &hp, &h1, err, sizeof(err)), 0);
		ck_assert_int_eq(cpu_handoff_create(pool, stream, &hp, &h, err, sizeof(err)), -EBUSY);
		ck_assert_ptr_null(h);
		ck_assert_str_eq(err, "cpu handoff: the pool's idle workers cannot dispatch: another hook is set");
		cpu_handoff_destroy(&h1);
		ck_assert_int_eq(cpu_handoff_create(pool, stream, &hp, &h, err, sizeof(err)), 0);
		cpu_handoff_destroy(&h);
	}
	CUDA_OK(cudaStreamDestroy(stream));
	task_pool_destroy(&pool);
}
END_TEST

static Suite *handoff_suite(void)
{
	Suite *s = suite_create("cpu_handoff");
	TCase *tc = tcase_create("round_trips");
	tcase_set_timeout(tc, 240);
	tcase_add_test(tc, test_hostfunc_round_trips);
	tcase_add_test(tc, test_memops_round_trips);
	tcase_add_test(tc, test_small_ring);
	tcase_add_test(tc, test_mapped_round_trips);
	tcase_add_test(tc, test_polled_round_trips);
	tcase_add_test(tc, test_poll_round_trips);
	tcase_add_test(tc, test_workers_round_trips);
	suite_add_tcase(s, tc);
	tc = tcase_create("failures");
	tcase_set_timeout(tc, 240);
	tcase_add_test(tc, test_hostfunc_failure);
	tcase_add_test(tc, test_memops_failure);
	tcase_add_test(tc, test_destroy_unwaited);
	tcase_add_test(tc, test_refusals);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return gpu_suite_main("test_cpu_handoff", handoff_suite);
}

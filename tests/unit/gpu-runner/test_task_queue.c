/* test_task_queue.c - the bounded MPMC queue of the CPU compute pool (cpu-compute/task_queue.h):
 *  - capacities it refuses; full and empty; FIFO order over many laps of the ring;
 *  - several producers and consumers at once on a small ring (so it is full and empty often):
 *    every item comes out exactly once (counts conserved, none lost or doubled), and each
 *    consumer sees any one producer's items in the order they were pushed.
 * TASK_QUEUE_SEED (default 1) seeds the per-thread pauses that vary the interleavings. */
#include "services/gpu-runner/cpu-compute/task_queue.h"
#include "tests/unit/common/test_helpers.h"

#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

START_TEST(test_refuses_capacities)
{
	char err[256];
	struct task_queue *q = (struct task_queue *)1;
	const uint32_t bad[] = {0, 1, 3, 6, 100, TASK_QUEUE_MAX_CAPACITY * 2};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		err[0] = '\0';
		ck_assert_int_eq(task_queue_create(bad[i], &q, err, sizeof(err)), -EINVAL);
		ck_assert_ptr_null(q);
		ck_assert_msg(strstr(err, "task queue: capacity") != NULL, "message: %s", err);
		q = (struct task_queue *)1;
	}
	ck_assert_int_eq(task_queue_create(2, &q, err, sizeof(err)), 0);
	ck_assert_uint_eq(task_queue_capacity(q), 2);
	task_queue_destroy(&q);
	ck_assert_ptr_null(q);
	task_queue_destroy(&q); /* safe twice */
}
END_TEST

START_TEST(test_full_empty_fifo)
{
	char err[256];
	struct task_queue *q = NULL;
	ck_assert_int_eq(task_queue_create(8, &q, err, sizeof(err)), 0);
	struct task_item it;
	ck_assert(!task_queue_pop(q, &it));
	ck_assert_uint_eq(task_queue_depth(q), 0);
	uint64_t next_in = 0, next_out = 0;
	/* 1000 laps of pushes and pops of varying lengths, items left over from lap to lap: the
	 * positions wrap the ring many times. */
	for (int lap = 0; lap < 1000; lap++) {
		uint32_t n = 1 + (uint32_t)(lap % 8);
		while (next_in - next_out > 8 - n) {
			ck_assert(task_queue_pop(q, &it));
			ck_assert_ptr_eq(it.ptr, &next_in);
			ck_assert_uint_eq(it.arg, next_out);
			next_out++;
		}
		for (uint32_t i = 0; i < n; i++) {
			ck_assert(task_queue_push(q, (struct task_item){.ptr = &next_in, .arg = next_in}));
			next_in++;
		}
		ck_assert_uint_eq(task_queue_depth(q), next_in - next_out);
		if (next_in - next_out == 8) {
			ck_assert(!task_queue_push(q, (struct task_item){.arg = 999999}));
			ck_assert_uint_eq(task_queue_depth(q), 8);
		}
		for (uint32_t i = 0; i < n / 2; i++) {
			ck_assert(task_queue_pop(q, &it));
			ck_assert_uint_eq(it.arg, next_out);
			next_out++;
		}
	}
	ck_assert_uint_gt(next_in, 4000);
	while (next_out < next_in) {
		ck_assert(task_queue_pop(q, &it));
		ck_assert_uint_eq(it.arg, next_out);
		next_out++;
	}
	ck_assert(!task_queue_pop(q, &it));
	ck_assert_uint_eq(task_queue_depth(q), 0);
	task_queue_destroy(&q);
}
END_TEST

#define PRODUCERS 4
#define CONSUMERS 4
#define PER_PRODUCER 50000u

struct stress {
	struct task_queue *q;
	_Atomic uint32_t *seen;	 /* PRODUCERS * PER_PRODUCER: times each item came out */
	_Atomic uint64_t popped; /* items taken, all consumers */
	_Atomic uint32_t go;
	_Atomic uint32_t order_errors;
	_Atomic uint64_t full_retries, empty_retries;
	uint64_t seed;
	uint64_t deadline_ns; /* a broken queue can lose items or wedge: give up then, and report */
};

struct thread_arg {
	struct stress *s;
	uint32_t id;
};

static uint64_t splitmix(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* A short random pause now and then, so producers and consumers drift against each other. */
static void jitter(uint64_t *rng)
{
	uint64_t r = splitmix(rng);
	if ((r & 63) == 0)
		sched_yield();
	for (uint32_t i = 0; i < (uint32_t)((r >> 8) & 15); i++)
		atomic_signal_fence(memory_order_seq_cst);
}

static void *producer(void *arg)
{
	struct thread_arg *a = arg;
	struct stress *s = a->s;
	uint64_t rng = s->seed * 1000 + a->id;
	while (!atomic_load(&s->go))
		;
	for (uint32_t i = 0; i < PER_PRODUCER; i++) {
		struct task_item it = {.ptr = s, .arg = ((uint64_t)a->id << 32) | i};
		while (!task_queue_push(s->q, it)) {
			atomic_fetch_add_explicit(&s->full_retries, 1, memory_order_relaxed);
			if (now_ns() > s->deadline_ns)
				return NULL;
			sched_yield();
		}
		jitter(&rng);
	}
	return NULL;
}

static void *consumer(void *arg)
{
	struct thread_arg *a = arg;
	struct stress *s = a->s;
	uint64_t rng = s->seed * 1000 + 100 + a->id;
	int64_t last[PRODUCERS];
	for (int p = 0; p < PRODUCERS; p++)
		last[p] = -1;
	const uint64_t total = (uint64_t)PRODUCERS * PER_PRODUCER;
	while (!atomic_load(&s->go))
		;
	while (atomic_load_explicit(&s->popped, memory_order_relaxed) < total) {
		struct task_item it;
		if (!task_queue_pop(s->q, &it)) {
			atomic_fetch_add_explicit(&s->empty_retries, 1, memory_order_relaxed);
			if (now_ns() > s->deadline_ns)
				return NULL;
			sched_yield();
			continue;
		}
		atomic_fetch_add_explicit(&s->popped, 1, memory_order_relaxed);
		uint32_t p = (uint32_t)(it.arg >> 32), i = (uint32_t)it.arg;
		if (it.ptr != s || p >= PRODUCERS || i >= PER_PRODUCER) {
			atomic_fetch_add(&s->order_errors, 1);
			continue;
		}
		atomic_fetch_add_explicit(&s->seen[(size_t)p * PER_PRODUCER + i], 1, memory_order_relaxed);
		if ((int64_t)i <= last[p])
			atomic_fetch_add(&s->order_errors, 1);
		last[p] = i;
		jitter(&rng);
	}
	return NULL;
}

static void run_stress(uint32_t capacity)
{
	char err[256];
	struct stress s;
	memset(&s, 0, sizeof(s));
	const char *seed = getenv("TASK_QUEUE_SEED");
	s.seed = seed ? strtoull(seed, NULL, 10) : 1;
	s.deadline_ns = now_ns() + 60ull * 1000 * 1000 * 1000;
	ck_assert_int_eq(task_queue_create(capacity, &s.q, err, sizeof(err)), 0);
	s.seen = calloc((size_t)PRODUCERS * PER_PRODUCER, sizeof(*s.seen));
	ck_assert_ptr_nonnull(s.seen);
	pthread_t th[PRODUCERS + CONSUMERS];
	struct thread_arg args[PRODUCERS + CONSUMERS];
	for (uint32_t i = 0; i < PRODUCERS + CONSUMERS; i++) {
		args[i] = (struct thread_arg){.s = &s, .id = i < PRODUCERS ? i : i - PRODUCERS};
		ck_assert_int_eq(pthread_create(&th[i], NULL, i < PRODUCERS ? producer : consumer, &args[i]), 0);
	}
	atomic_store(&s.go, 1);
	for (uint32_t i = 0; i < PRODUCERS + CONSUMERS; i++)
		pthread_join(th[i], NULL);

	ck_assert_msg(atomic_load(&s.popped) == (uint64_t)PRODUCERS * PER_PRODUCER,
		      "%llu items came out of %u pushed (seed %llu)", (unsigned long long)atomic_load(&s.popped),
		      PRODUCERS * PER_PRODUCER, (unsigned long long)s.seed);
	ck_assert_msg(atomic_load(&s.order_errors) == 0, "%u items out of order (seed %llu)",
		      atomic_load(&s.order_errors), (unsigned long long)s.seed);
	for (size_t k = 0; k < (size_t)PRODUCERS * PER_PRODUCER; k++)
		TH_CHECK(atomic_load(&s.seen[k]) == 1, "item %zu (producer %zu, #%zu) came out %u times", k,
			 k / PER_PRODUCER, k % PER_PRODUCER, atomic_load(&s.seen[k]));
	struct task_item it;
	ck_assert(!task_queue_pop(s.q, &it));
	ck_assert_uint_eq(task_queue_depth(s.q), 0);
	if (getenv("PIPELINE_TEST_VERBOSE"))
		fprintf(stderr, "capacity %u: %llu pushes found it full, %llu pops found it empty\n", capacity,
			(unsigned long long)atomic_load(&s.full_retries),
			(unsigned long long)atomic_load(&s.empty_retries));
	free(s.seen);
	task_queue_destroy(&s.q);
}

START_TEST(test_concurrent_small_ring)
{
	run_stress(4);
}
END_TEST

START_TEST(test_concurrent_large_ring)
{
	run_stress(1024);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("task_queue");
	TCase *tc = tcase_create("single");
	tcase_add_test(tc, test_refuses_capacities);
	tcase_add_test(tc, test_full_empty_fifo);
	suite_add_tcase(s, tc);
	tc = tcase_create("concurrent");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_concurrent_small_ring);
	tcase_add_test(tc, test_concurrent_large_ring);
	suite_add_tcase(s, tc);
	return th_run(s);
}

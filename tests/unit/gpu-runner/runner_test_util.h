/* runner_test_util.h - what the gpu-runner's backend tests share: a deterministic random number
 * generator (splitmix64; seed it by setting rng_state), PIPELINE_TEST_VERBOSE and a small CPU task
 * pool.
 * Header-only: each test is one program, with its own generator state. */
#ifndef PIPELINE_RUNNER_TEST_UTIL_H
#define PIPELINE_RUNNER_TEST_UTIL_H
#include <check.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "services/gpu-runner/cpu-compute/task_pool.h"

static uint64_t rng_state;

static inline uint64_t rng_next(void)
{
	uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform in (0, 1). */
static inline double rng_uniform(void)
{
	return ((double)(rng_next() >> 11) + 0.5) * 0x1.0p-53;
}

/* Standard normal (Box-Muller). */
static inline double rng_normal(void)
{
	return sqrt(-2.0 * log(rng_uniform())) * cos(2.0 * M_PI * rng_uniform());
}

/* PIPELINE_TEST_VERBOSE=1: print the errors measured. */
static inline bool test_verbose(void)
{
	const char *v = getenv("PIPELINE_TEST_VERBOSE");
	return v && *v == '1';
}

/* A task pool of `threads` workers, not pinned, the rest as task_pool_config_default says. */
static inline struct task_pool *pool_new(uint32_t threads)
{
	char err[256];
	struct task_pool *pool = NULL;
	struct task_pool_config pc;
	task_pool_config_default(&pc);
	pc.threads = threads;
	pc.pin = false;
	ck_assert_msg(task_pool_create(&pc, &pool, err, sizeof(err)) == 0, "%s", err);
	return pool;
}

#endif

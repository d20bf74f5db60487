/* cuda_test_util.h - what the CUDA backend's tests share: a checked CUDA runtime call inside a
 * Check test, a GPU probe that leaves this process's CUDA uninitialised (Check forks the tests,
 * and a forked child cannot use a context its parent made), a backend call checked with the
 * backend's message, the relative L2 distance of logits, and a small CPU task pool. Header-only. */
#ifndef PIPELINE_CUDA_TEST_UTIL_H
#define PIPELINE_CUDA_TEST_UTIL_H
#include <check.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"

#define CUDA_OK(call)                                                                              \
	do {                                                                                       \
		cudaError_t e_ = (call);                                                           \
		ck_assert_msg(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));         \
	} while (0)

/* Asks a child process whether a GPU is there. */
static inline bool have_gpu(void)
{
	pid_t pid = fork();
	if (pid < 0)
		return false;
	if (pid == 0) {
		int count = 0;
		_exit(cudaGetDeviceCount(&count) == cudaSuccess && count > 0 ? 0 : 1);
	}
	int status = 0;
	if (waitpid(pid, &status, 0) != pid)
		return false;
	return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* A backend call of a test's run (run->be) that must succeed, with the backend's message. */
#define RUN_OK(run, expr)                                                                                  \
	do {                                                                                               \
		int rc_ = (expr);                                                                          \
		ck_assert_msg(rc_ == 0, "%s: %d %s", #expr, rc_, backend_error((run)->be));                \
	} while (0)

/* The relative L2 distance of a from ref (n values); every value of a must be finite. */
static inline double rel_l2(const float *a, const float *ref, uint32_t n)
{
	double num = 0, den = 0;
	for (uint32_t i = 0; i < n; i++) {
		ck_assert_msg(isfinite(a[i]), "logit %u is %g", i, (double)a[i]);
		num += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
		den += (double)ref[i] * ref[i];
	}
	return sqrt(num / den);
}

/* A task pool of 4 workers, not pinned (the CPU's share in a test). */
static inline struct task_pool *pool_new(void)
{
	char err[256];
	struct task_pool *pool = NULL;
	struct task_pool_config pc;
	task_pool_config_default(&pc);
	pc.threads = 4;
	pc.pin = false;
	ck_assert_msg(task_pool_create(&pc, &pool, err, sizeof(err)) == 0, "%s", err);
	return pool;
}

#endif

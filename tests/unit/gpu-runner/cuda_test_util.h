/* cuda_test_util.h - what the CUDA backend's tests share: a checked CUDA runtime call inside a
 * Check test, a GPU probe that leaves this process's CUDA uninitialised (Check forks the tests,
 * and a forked child cannot use a context its parent made), their main and a backend call checked
 * with the backend's message (rel_l2: test_helpers.h; pool_new: runner_test_util.h). Header-only. */
#ifndef PIPELINE_CUDA_TEST_UTIL_H
#define PIPELINE_CUDA_TEST_UTIL_H
#include <check.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "services/gpu-runner/backend.h"
#include "tests/unit/common/test_helpers.h"
#include "tests/unit/gpu-runner/runner_test_util.h"

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

/* A CUDA test's main: 77 (skipped, for ctest) without a GPU, else suite make() run, in fork mode
 * unless CK_FORK=no (the sanitizer runs). */
static inline int gpu_suite_main(const char *name, Suite *(*make)(void))
{
	if (!have_gpu()) {
		fprintf(stderr, "%s: no CUDA device: skipped\n", name);
		return 77;
	}
	SRunner *sr = srunner_create(make());
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

#endif

/* cuda_test_util.h - what the CUDA backend's tests share: a checked CUDA runtime call inside a
 * Check test, and a GPU probe that leaves this process's CUDA uninitialised (Check forks the
 * tests, and a forked child cannot use a context its parent made). Header-only. */
#ifndef PIPELINE_CUDA_TEST_UTIL_H
#define PIPELINE_CUDA_TEST_UTIL_H
#include <check.h>
#include <stdbool.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

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

#endif

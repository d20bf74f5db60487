/* cuda_try.h - bench-limits' CUDA calls in its .cu files: TRY(call) prints the failing call and
 * its error on stderr and jumps to the function's `out` label. */
#ifndef PIPELINE_BENCH_LIMITS_CUDA_TRY_H
#define PIPELINE_BENCH_LIMITS_CUDA_TRY_H

#include <cuda_runtime_api.h>
#include <stdio.h>

#define TRY(call)                                                                                       \
	do {                                                                                            \
		cudaError_t e_ = (call);                                                                \
		if (e_ != cudaSuccess) {                                                                \
			fprintf(stderr, "bench-limits: %s: %s\n", #call, cudaGetErrorString(e_));        \
			goto out;                                                                       \
		}                                                                                       \
	} while (0)

#endif

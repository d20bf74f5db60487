/* attention.cuh - device code the attention kernels (attention_fp32.cu, attention_mma.cu) may share. */
#ifndef GPU_RUNNER_CUDA_ATTENTION_CUH
#define GPU_RUNNER_CUDA_ATTENTION_CUH
#include "services/gpu-runner/cuda/cuda_internal.h"

/* The span holding key k: prefix[s] <= k < prefix[s + 1] (a binary search over the spans). */
static __device__ __forceinline__ uint32_t span_of_key(const uint32_t *prefix, uint32_t n_spans, uint32_t k)
{
	uint32_t lo = 0, hi = n_spans;
	while (hi - lo > 1) {
		uint32_t mid = (lo + hi) / 2;
		if (prefix[mid] <= k)
			lo = mid;
		else
			hi = mid;
	}
	return lo;
}

#endif

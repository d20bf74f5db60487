/* cpu_handoff_kernels.h - the device side of test_cpu_handoff: a kernel that
 * writes a step's input vector, and one that checks a step's result and adds it up. Values are
 * small integers in float, so every sum is exact. */
#ifndef PIPELINE_CPU_HANDOFF_KERNELS_H
#define PIPELINE_CPU_HANDOFF_KERNELS_H
#include <stdint.h>

#include <cuda_runtime_api.h>
#ifdef __cplusplus
extern "C" {
#endif

/* x[i] = handoff_test_x(i, step) for i < n. */
cudaError_t handoff_test_fill(float *x, uint32_t n, uint32_t step, cudaStream_t stream);
/* For i < n: if y[i] != 2 * x(i, step) + step, adds 1 to bad[step]; acc[i] += y[i]. */
cudaError_t handoff_test_check(const float *y, uint32_t n, uint32_t step, uint32_t *bad, float *acc,
			       cudaStream_t stream);

/* Holds the stream about `us` microseconds (one thread reading the global timer). */
cudaError_t handoff_test_delay(uint32_t us, cudaStream_t stream);

/* The input value the fill kernel writes (and the host recomputes): integers below 4096. */
static inline float handoff_test_x(uint32_t i, uint32_t step)
{
	return (float)((i * 7u + step * 13u) % 4096u);
}

#ifdef __cplusplus
}
#endif
#endif

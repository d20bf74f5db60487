/* cpu_handoff_kernels.cu - the kernels of cpu_handoff_kernels.h. */
#include "tests/unit/gpu-runner/cpu_handoff_kernels.h"

__global__ void fill_kernel(float *x, uint32_t n, uint32_t step)
{
	uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n)
		x[i] = (float)((i * 7u + step * 13u) % 4096u);
}

__global__ void check_kernel(const float *y, uint32_t n, uint32_t step, uint32_t *bad, float *acc)
{
	uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i >= n)
		return;
	float want = 2.0f * (float)((i * 7u + step * 13u) % 4096u) + (float)step;
	if (y[i] != want)
		atomicAdd(&bad[step], 1u);
	acc[i] += y[i];
}

__global__ void delay_kernel(uint64_t ns)
{
	uint64_t t0, t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
	do {
		__nanosleep(1000);
		asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	} while (t - t0 < ns);
}

extern "C" cudaError_t handoff_test_delay(uint32_t us, cudaStream_t stream)
{
	delay_kernel<<<1, 1, 0, stream>>>((uint64_t)us * 1000u);
	return cudaGetLastError();
}

extern "C" cudaError_t handoff_test_fill(float *x, uint32_t n, uint32_t step, cudaStream_t stream)
{
	fill_kernel<<<(n + 255) / 256, 256, 0, stream>>>(x, n, step);
	return cudaGetLastError();
}

extern "C" cudaError_t handoff_test_check(const float *y, uint32_t n, uint32_t step, uint32_t *bad, float *acc,
					  cudaStream_t stream)
{
	check_kernel<<<(n + 255) / 256, 256, 0, stream>>>(y, n, step, bad, acc);
	return cudaGetLastError();
}

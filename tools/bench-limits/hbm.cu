/* hbm.cu - bench-limits' device memory (HBM) bandwidth, measured now: a read kernel and a
 * device-to-device copy (hbm.h says what each returns).
 *
 * The HBM bound scripts/bench sets against an all-resident decode (S2) is hbm_bytes_per_s, the
 * better of the two, which is the read: a decode token's GEMVs read every weight once and write a
 * few vectors, so what they can approach is how fast the memory delivers reads. A copy also
 * counts its writes, which a GEMV hardly does, and pays the bus's read/write turnarounds; it is
 * reported beside the read so that a read kernel falling short of what the memory gives shows.
 * The kernel reads like a good GEMV does: 16-byte loads, a warp covering 512 contiguous bytes,
 * four independent loads in flight per thread, enough blocks to fill every SM; it reduces what it
 * read to one word and stores it only on a value the data never gives, so the loads cannot be
 * optimised away. The buffer is far larger than L2 (50 MB on H100): the passes come from HBM. */
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>

#include "cuda_try.h"
#include "hbm.h"

#define READ_THREADS 256
#define FILL_BYTE    0x5a /* every word 0x5a5a5a5a: the XOR of any four of them is 0 */
#define NEVER        0x9e3779b9u

static __device__ __forceinline__ uint32_t fold(uint4 v)
{
	return v.x ^ v.y ^ v.z ^ v.w;
}

/* Reads p[0 .. n) once, grid-stride, four loads per thread per step. */
static __global__ void read_kernel(const uint4 *__restrict__ p, size_t n, uint32_t *sink)
{
	size_t stride = (size_t)gridDim.x * blockDim.x;
	size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	uint32_t acc = 0;
	for (; i + 3 * stride < n; i += 4 * stride) {
		uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
		acc ^= fold(a) ^ fold(b) ^ fold(c) ^ fold(d);
	}
	for (; i < n; i += stride)
		acc ^= fold(p[i]);
	if (acc == NEVER)
		*sink = acc;
}

/* Times `reps` passes of what `pass` launches on `s`, one pair of events each; returns the
 * shortest in ms, or a negative value when a CUDA call failed. */
template <typename F> static float best_ms(cudaStream_t s, int reps, F pass)
{
	cudaEvent_t a = NULL, b = NULL;
	float best = -1, ms;
	TRY(cudaEventCreate(&a));
	TRY(cudaEventCreate(&b));
	TRY(pass()); /* warm-up */
	for (int r = 0; r < reps; r++) {
		TRY(cudaEventRecord(a, s));
		TRY(pass());
		TRY(cudaEventRecord(b, s));
		TRY(cudaEventSynchronize(b));
		TRY(cudaEventElapsedTime(&ms, a, b));
		if (best < 0 || ms < best)
			best = ms;
	}
out:
	if (a)
		cudaEventDestroy(a);
	if (b)
		cudaEventDestroy(b);
	return best;
}

extern "C" double hbm_read(size_t bytes, int reps)
{
	uint4 *buf = NULL;
	uint32_t *sink = NULL;
	cudaStream_t s = NULL;
	double rate = -1;
	int dev, sms, per_sm = 0;
	size_t n = bytes / sizeof(uint4);
	unsigned grid;
	float ms;
	TRY(cudaGetDevice(&dev));
	TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
	TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_kernel, READ_THREADS, 0));
	grid = (unsigned)sms * (unsigned)(per_sm > 0 ? per_sm : 1);
	TRY(cudaMalloc((void **)&buf, n * sizeof(uint4)));
	TRY(cudaMalloc((void **)&sink, sizeof(*sink)));
	TRY(cudaMemset(buf, FILL_BYTE, n * sizeof(uint4)));
	TRY(cudaStreamCreate(&s));
	TRY(cudaDeviceSynchronize());
	ms = best_ms(s, reps, [&] {
		read_kernel<<<grid, READ_THREADS, 0, s>>>(buf, n, sink);
		return cudaGetLastError();
	});
	if (ms > 0)
		rate = (double)(n * sizeof(uint4)) / (ms * 1e-3);
out:
	if (s)
		cudaStreamDestroy(s);
	cudaFree(sink);
	cudaFree(buf);
	return rate;
}

extern "C" double hbm_copy(size_t bytes, int reps)
{
	void *src = NULL, *dst = NULL;
	cudaStream_t s = NULL;
	double rate = -1;
	float ms;
	TRY(cudaMalloc(&src, bytes));
	TRY(cudaMalloc(&dst, bytes));
	TRY(cudaMemset(src, FILL_BYTE, bytes));
	TRY(cudaStreamCreate(&s));
	TRY(cudaDeviceSynchronize());
	ms = best_ms(s, reps, [&] { return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s); });
	if (ms > 0)
		rate = 2.0 * (double)bytes / (ms * 1e-3);
out:
	if (s)
		cudaStreamDestroy(s);
	cudaFree(dst);
	cudaFree(src);
	return rate;
}

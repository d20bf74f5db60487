/* handoff.cu - bench-limits' hand-off costs (handoff.h says what each is).
 *
 * Every phase is the same tiny work, so that what is timed is the hand-off alone: thread 0 of
 * each block reads the word one block of the phase before wrote (a different block each phase,
 * read past L1) and writes its own; the block's other threads wait for it at a barrier, as a
 * product's threads wait for their staged input. The words alternate between two rows.
 *
 * - Kernel boundaries: `phases` launches of the phase's kernel in one stream, timed from an event
 *   after a kernel that holds the GPU for 20 ms while the host queues them (so the host's launch
 *   rate is not what is timed). With programmatic dependent launch each kernel lets the next
 *   launch first thing and waits for the one before (griddepcontrol, as device.cuh's grid_wait
 *   and grid_launch_next), as the decode step's kernels do.
 * - One persistent grid (a cooperative launch: every block resident, so a block that waits for
 *   the others cannot starve them): each phase's producers add to the phase's counter (a release)
 *   and its consumers wait until it reaches the block count (acquire loads); or a grid barrier
 *   (cooperative_groups' grid.sync) between phases. */
#include <cooperative_groups.h>
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>

#include "cuda_try.h"
#include "handoff.h"

#define HOLD_NS		 20000000ull /* what the held GPU gives the host to queue the kernels */
#define BLOCKS_PER_SM	 4
#define HANDOFF_THREADS 256

static __device__ __forceinline__ uint64_t now_ns(void)
{
	uint64_t t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	return t;
}

static __global__ void hold_kernel(uint64_t ns)
{
	const uint64_t t0 = now_ns();
	while (now_ns() - t0 < ns)
		__nanosleep(1000);
}

/* Phase p's work in block b of n: read a word of row p & 1 (phase p - 1's), write row (p + 1) & 1. */
static __device__ __forceinline__ void phase_work(uint32_t *words, uint32_t n, uint32_t p, uint32_t b)
{
	if (threadIdx.x == 0) {
		const uint32_t src = (b * 37u + p) % n;
		const uint32_t v = __ldcg(words + (size_t)(p & 1) * n + src);
		words[(size_t)((p + 1) & 1) * n + b] = v + 1;
	}
	__syncthreads();
}

static __global__ void __launch_bounds__(HANDOFF_THREADS) phase_kernel(uint32_t *words, uint32_t n, uint32_t p)
{
	asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
	asm volatile("griddepcontrol.wait;" ::: "memory");
	phase_work(words, n, p, blockIdx.x);
}

static __device__ __forceinline__ uint32_t load_acquire(const uint32_t *p)
{
	uint32_t v;
	asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
	return v;
}

static __device__ __forceinline__ void add_release(uint32_t *p, uint32_t v)
{
	asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* count: phases words, zero at launch. */
static __global__ void __launch_bounds__(HANDOFF_THREADS)
counter_kernel(uint32_t *words, uint32_t *count, uint32_t n, uint32_t phases)
{
	for (uint32_t p = 0; p < phases; p++) {
		if (p > 0 && threadIdx.x == 0)
			while (load_acquire(count + p - 1) < n)
				;
		__syncthreads();
		phase_work(words, n, p, blockIdx.x);
		if (threadIdx.x == 0)
			add_release(count + p, 1); /* after phase_work's barrier: the block's phase is done */
	}
}

static __global__ void __launch_bounds__(HANDOFF_THREADS) grid_sync_kernel(uint32_t *words, uint32_t n, uint32_t phases)
{
	cooperative_groups::grid_group grid = cooperative_groups::this_grid();
	for (uint32_t p = 0; p < phases; p++) {
		phase_work(words, n, p, blockIdx.x);
		grid.sync();
	}
}

enum way { PLAIN, PDL, COUNTER, GRID_SYNC };

/* One run of `phases` phases the given way, in microseconds a phase; < 0: a CUDA call failed. */
static double run(enum way w, uint32_t *words, uint32_t *count, uint32_t n, uint32_t phases, cudaStream_t s,
		  cudaEvent_t a, cudaEvent_t b)
{
	float ms = -1;
	hold_kernel<<<1, 32, 0, s>>>(HOLD_NS);
	TRY(cudaGetLastError());
	TRY(cudaMemsetAsync(count, 0, phases * sizeof(uint32_t), s));
	TRY(cudaEventRecord(a, s));
	if (w == PLAIN || w == PDL) {
		cudaLaunchAttribute at[1];
		at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
		at[0].val.programmaticStreamSerializationAllowed = 1;
		cudaLaunchConfig_t cfg = {};
		cfg.gridDim = n;
		cfg.blockDim = HANDOFF_THREADS;
		cfg.stream = s;
		cfg.attrs = at;
		cfg.numAttrs = w == PDL ? 1 : 0;
		for (uint32_t p = 0; p < phases; p++)
			TRY(cudaLaunchKernelEx(&cfg, phase_kernel, words, n, p));
	} else {
		void *args_counter[] = {&words, &count, &n, &phases}, *args_sync[] = {&words, &n, &phases};
		if (w == COUNTER)
			TRY(cudaLaunchCooperativeKernel((const void *)counter_kernel, n, HANDOFF_THREADS, args_counter, 0, s));
		else
			TRY(cudaLaunchCooperativeKernel((const void *)grid_sync_kernel, n, HANDOFF_THREADS, args_sync, 0, s));
	}
	TRY(cudaEventRecord(b, s));
	TRY(cudaEventSynchronize(b));
	TRY(cudaEventElapsedTime(&ms, a, b));
out:
	return ms < 0 ? -1.0 : (double)ms * 1000.0 / phases;
}

int handoff_measure(int phases, int reps, struct handoff_costs *out)
{
	uint32_t *words = NULL, *count = NULL;
	cudaStream_t s = NULL;
	cudaEvent_t a = NULL, b = NULL;
	int rc = -1, dev = 0, sms = 0, per_sm = 0;
	double *slot[] = {&out->plain_us, &out->pdl_us, &out->counter_us, &out->grid_sync_us};
	TRY(cudaGetDevice(&dev));
	TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
	TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, counter_kernel, HANDOFF_THREADS, 0));
	{
		int sync_per_sm = 0;
		TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&sync_per_sm, grid_sync_kernel, HANDOFF_THREADS, 0));
		per_sm = per_sm < sync_per_sm ? per_sm : sync_per_sm;
	}
	if (per_sm > BLOCKS_PER_SM)
		per_sm = BLOCKS_PER_SM;
	{
		const uint32_t n = (uint32_t)(sms * per_sm);
		out->blocks = (int)n;
		out->threads = HANDOFF_THREADS;
		TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
		TRY(cudaEventCreate(&a));
		TRY(cudaEventCreate(&b));
		TRY(cudaMalloc(&words, 2 * (size_t)n * sizeof(uint32_t)));
		TRY(cudaMemset(words, 0, 2 * (size_t)n * sizeof(uint32_t)));
		TRY(cudaMalloc(&count, (size_t)phases * sizeof(uint32_t)));
		for (int w = PLAIN; w <= GRID_SYNC; w++) {
			double best = -1;
			for (int r = 0; r < reps; r++) {
				double us = run((enum way)w, words, count, n, (uint32_t)phases, s, a, b);
				if (us < 0)
					goto out;
				if (best < 0 || us < best)
					best = us;
			}
			*slot[w] = best;
		}
		rc = 0;
	}
out:
	cudaFree(words);
	cudaFree(count);
	if (a)
		cudaEventDestroy(a);
	if (b)
		cudaEventDestroy(b);
	if (s)
		cudaStreamDestroy(s);
	return rc;
}

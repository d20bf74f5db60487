/* cuda_runtime_api.h (tests only) - a host-memory stand-in for the part of the CUDA runtime the GPU
 * weight window uses, so that test_gpu_window_host runs the window's bookkeeping (its plan, the
 * state table with --strict checks, the visit order, routing, the split's shares, the grants it
 * holds of the loader's ring) where there is no GPU, as CI has none. Device memory is host memory;
 * copies happen when they are issued; an event reports "not ready" to its first query after a
 * record (as a copy in flight would) and done after that or a synchronize. Nothing here runs a
 * kernel or models the GPU's ordering: test_gpu_window (label gpu) runs the same cases on a GPU. */
#ifndef TEST_CUDA_HOST_RUNTIME_API_H
#define TEST_CUDA_HOST_RUNTIME_API_H
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef enum { cudaSuccess = 0, cudaErrorMemoryAllocation = 2, cudaErrorNotReady = 600 } cudaError_t;
enum cudaMemcpyKind { cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };
struct CUstream_st {
	int unused;
};
struct CUevent_st {
	int pending; /* recorded, not yet queried */
};
typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
#define cudaEventDisableTiming 2u
#define cudaStreamNonBlocking 1u
#define cudaHostRegisterDefault 0u

static inline const char *cudaGetErrorString(cudaError_t e)
{
	return e == cudaErrorMemoryAllocation ? "out of memory (host stand-in)" : "error (host stand-in)";
}
static inline cudaError_t cudaGetLastError(void)
{
	return cudaSuccess;
}
static inline cudaError_t cudaGetDeviceCount(int *n)
{
	*n = 1;
	return cudaSuccess;
}
static inline cudaError_t cudaDeviceGetStreamPriorityRange(int *lo, int *hi)
{
	*lo = 0;
	*hi = -1;
	return cudaSuccess;
}
static inline cudaError_t cudaStreamCreate(cudaStream_t *s)
{
	*s = (cudaStream_t)calloc(1, sizeof(**s));
	return *s ? cudaSuccess : cudaErrorMemoryAllocation;
}
static inline cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned flags, int priority)
{
	(void)flags;
	(void)priority;
	return cudaStreamCreate(s);
}
static inline cudaError_t cudaStreamDestroy(cudaStream_t s)
{
	free(s);
	return cudaSuccess;
}
static inline cudaError_t cudaStreamSynchronize(cudaStream_t s)
{
	(void)s;
	return cudaSuccess;
}
static inline cudaError_t cudaDeviceSynchronize(void)
{
	return cudaSuccess;
}
static inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags)
{
	(void)s;
	(void)e;
	(void)flags;
	return cudaSuccess;
}
static inline cudaError_t cudaEventCreate(cudaEvent_t *e)
{
	*e = (cudaEvent_t)calloc(1, sizeof(**e));
	return *e ? cudaSuccess : cudaErrorMemoryAllocation;
}
static inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags)
{
	(void)flags;
	return cudaEventCreate(e);
}
static inline cudaError_t cudaEventDestroy(cudaEvent_t e)
{
	free(e);
	return cudaSuccess;
}
static inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s)
{
	(void)s;
	e->pending = 1;
	return cudaSuccess;
}
static inline cudaError_t cudaEventQuery(cudaEvent_t e)
{
	if (e->pending) {
		e->pending = 0;
		return cudaErrorNotReady;
	}
	return cudaSuccess;
}
static inline cudaError_t cudaEventSynchronize(cudaEvent_t e)
{
	e->pending = 0;
	return cudaSuccess;
}
static inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
	(void)a;
	(void)b;
	*ms = 1.0f;
	return cudaSuccess;
}
/* A block of 2 MiB or more starts on a 2 MiB boundary and asks for huge pages: the window's H2D
 * measurement takes two 64 MiB blocks anew at every create and fills them, and in 4 KiB pages
 * their faults took most of the test's time (about 1 s a create on a VM). */
static inline cudaError_t cudaMalloc(void **p, size_t n)
{
	const size_t huge = (size_t)2 << 20;
	if (n >= huge) {
		if (posix_memalign(p, huge, n) != 0) {
			*p = NULL;
			return cudaErrorMemoryAllocation;
		}
		madvise(*p, n, MADV_HUGEPAGE); /* advice: where it is refused, small pages do */
		return cudaSuccess;
	}
	*p = malloc(n ? n : 1);
	return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
static inline cudaError_t cudaFree(void *p)
{
	free(p);
	return cudaSuccess;
}
static inline cudaError_t cudaMallocHost(void **p, size_t n)
{
	return cudaMalloc(p, n);
}
static inline cudaError_t cudaFreeHost(void *p)
{
	free(p);
	return cudaSuccess;
}
static inline cudaError_t cudaHostRegister(void *p, size_t n, unsigned flags)
{
	(void)p;
	(void)n;
	(void)flags;
	return cudaSuccess;
}
static inline cudaError_t cudaHostUnregister(void *p)
{
	(void)p;
	return cudaSuccess;
}
static inline cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
					  cudaStream_t s)
{
	(void)kind;
	(void)s;
	memcpy(dst, src, n);
	return cudaSuccess;
}
static inline cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind)
{
	return cudaMemcpyAsync(dst, src, n, kind, NULL);
}
static inline cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
					    size_t height, enum cudaMemcpyKind kind, cudaStream_t s)
{
	(void)kind;
	(void)s;
	for (size_t i = 0; i < height; i++)
		memcpy((char *)dst + i * dpitch, (const char *)src + i * spitch, width);
	return cudaSuccess;
}
#endif

/* staging.cu - the pinned upload ring of the CUDA backend. Token rows of the embedding table
 * (host memory), destination rows and spans go up from a pinned ring buffer with
 * cudaMemcpyAsync on the compute stream; each upload records an event, and a region of the ring
 * is rewritten only once the event of the copy that last read it has completed (normally long
 * done: the host waits only when it runs a full ring ahead of the GPU). */
#include "services/gpu-runner/cuda/cuda_internal.h"

#include <assert.h>

static int up_wait_oldest(struct backend_dev *be)
{
	struct upload_ring *u = &be->up;
	assert(u->count > 0);
	cudaError_t e = cudaEventQuery(u->ev[u->first]);
	if (e == cudaErrorNotReady)
		e = cudaEventSynchronize(u->ev[u->first]);
	if (e != cudaSuccess)
		return cuda_fail(be, e, "waiting for an upload from the staging ring");
	u->first = (u->first + 1) % UPLOAD_EVENTS;
	u->count--;
	return 0;
}

int up_alloc(struct backend_dev *be, size_t size, char **out, size_t *off)
{
	struct upload_ring *u = &be->up;
	size = (size + UPLOAD_ALIGN - 1) / UPLOAD_ALIGN * UPLOAD_ALIGN;
	if (size > u->cap) {
		/* Rare (a request larger than the ring was sized for): drain and grow. */
		while (u->count) {
			int rc = up_wait_oldest(be);
			if (rc)
				return rc;
		}
		size_t cap = size > 2 * u->cap ? size : 2 * u->cap;
		char *host = NULL;
		CUDA_TRY(be, "cudaMallocHost (staging ring)", cudaMallocHost((void **)&host, cap));
		cudaFreeHost(u->host);
		u->host = host;
		u->cap = cap;
		u->head = 0;
	}
	size_t b = u->head + size <= u->cap ? u->head : 0;
	for (;;) {
		bool clash = u->count == UPLOAD_EVENTS;
		for (uint32_t k = 0; k < u->count && !clash; k++) {
			uint32_t i = (u->first + k) % UPLOAD_EVENTS;
			clash = b < u->end[i] && u->beg[i] < b + size;
		}
		if (!clash)
			break;
		int rc = up_wait_oldest(be);
		if (rc)
			return rc;
	}
	u->head = b + size;
	*out = u->host + b;
	*off = b;
	return 0;
}

int up_send(struct backend_dev *be, void *dst, const char *h, size_t off, size_t size, const char *what)
{
	cudaError_t e = cudaMemcpyAsync(dst, h, size, cudaMemcpyHostToDevice, be->stream);
	if (e != cudaSuccess)
		return cuda_fail(be, e, what);
	struct upload_ring *u = &be->up;
	/* up_alloc left a free event, but one region may go up in several copies (the experts'
	 * tokens and weights): the oldest copy, long done as a rule, gives its event back. */
	if (u->count == UPLOAD_EVENTS) {
		int rc = up_wait_oldest(be);
		if (rc)
			return rc;
	}
	uint32_t i = (u->first + u->count) % UPLOAD_EVENTS;
	CUDA_TRY(be, "cudaEventRecord (staging ring)", cudaEventRecord(u->ev[i], be->stream));
	u->beg[i] = off;
	u->end[i] = off + (size + UPLOAD_ALIGN - 1) / UPLOAD_ALIGN * UPLOAD_ALIGN;
	u->count++;
	return 0;
}

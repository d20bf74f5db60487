#include "services/kv-store/events.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

#ifdef PIPELINE_HAVE_CUDA
#include <cuda_runtime_api.h>

/* Events kept open: a runner re-records KV_EVENTS_IN_FLIGHT (64) of its own, so this holds the sets
 * of the eight runners of a split model with room for their successors; past it, the event waited
 * for least recently is closed (a gone runner's). */
#define KV_EVENTS_MAX 1024

struct kv_events {
	bool ready; /* a CUDA context exists */
	uint32_t n;
	uint64_t clock;
	unsigned char handle[KV_EVENTS_MAX][KV_EVENT_HANDLE_BYTES];
	cudaEvent_t event[KV_EVENTS_MAX];
	uint64_t used[KV_EVENTS_MAX]; /* clock at the last wait on it */
};

struct kv_events *kv_events_create(void)
{
	return calloc(1, sizeof(struct kv_events));
}

void kv_events_destroy(struct kv_events **evp)
{
	if (!evp || !*evp)
		return;
	struct kv_events *ev = *evp;
	for (uint32_t i = 0; i < ev->n; i++)
		cudaEventDestroy(ev->event[i]);
	free(ev);
	*evp = NULL;
}

int kv_events_wait(struct kv_events *ev, const void *handle, char *err, size_t errlen)
{
	if (!ev->ready) {
		int n = 0;
		if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
			cudaGetLastError();
			return errorf(err, errlen, -ENODEV,
				      "CUDA IPC events given, but this kv-store sees no GPU to wait on them with");
		}
		cudaError_t e = cudaSetDevice(0);
		if (e != cudaSuccess)
			return errorf(err, errlen, -ENODEV, "cudaSetDevice: %s", cudaGetErrorString(e));
		ev->ready = true;
	}
	uint32_t i = 0;
	while (i < ev->n && memcmp(ev->handle[i], handle, KV_EVENT_HANDLE_BYTES) != 0)
		i++;
	if (i == ev->n && ev->n == KV_EVENTS_MAX) {
		/* Full: the least recently used goes (closing it does not touch the runner's event). */
		uint32_t old = 0;
		for (uint32_t k = 1; k < ev->n; k++)
			if (ev->used[k] < ev->used[old])
				old = k;
		cudaEventDestroy(ev->event[old]);
		ev->n--;
		ev->event[old] = ev->event[ev->n];
		ev->used[old] = ev->used[ev->n];
		memcpy(ev->handle[old], ev->handle[ev->n], KV_EVENT_HANDLE_BYTES);
		i = ev->n;
	}
	if (i == ev->n) {
		cudaIpcEventHandle_t h;
		_Static_assert(sizeof(h) == KV_EVENT_HANDLE_BYTES, "an IPC event handle is 64 bytes");
		memcpy(&h, handle, sizeof(h));
		cudaError_t e = cudaIpcOpenEventHandle(&ev->event[i], h);
		if (e != cudaSuccess)
			return errorf(err, errlen, -EIO, "cudaIpcOpenEventHandle: %s", cudaGetErrorString(e));
		memcpy(ev->handle[i], handle, KV_EVENT_HANDLE_BYTES);
		ev->n++;
	}
	ev->used[i] = ++ev->clock;
	cudaError_t e = cudaEventSynchronize(ev->event[i]);
	if (e != cudaSuccess)
		return errorf(err, errlen, -EIO, "waiting for the runner's copy: %s", cudaGetErrorString(e));
	return 0;
}

#else

struct kv_events {
	int unused;
};

struct kv_events *kv_events_create(void)
{
	return calloc(1, sizeof(struct kv_events));
}

void kv_events_destroy(struct kv_events **evp)
{
	if (!evp || !*evp)
		return;
	free(*evp);
	*evp = NULL;
}

int kv_events_wait(struct kv_events *ev, const void *handle, char *err, size_t errlen)
{
	return errorf(err, errlen, -ENOTSUP,
		      "CUDA IPC events given but this kv-store was built without CUDA (send ready flags instead)");
}

#endif

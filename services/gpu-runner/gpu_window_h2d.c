/* gpu_window_h2d.c - the GPU window's measurements of the H2D link: pinned copies queued on a
 * stream between two events and waited for, from a buffer of their own (the link's rate alone, at
 * start) or from the weight ring's pinned slots (beside the CPU's measurement, gpu_window_split.c).
 * See gpu_window_internal.h (struct gw_h2d). */
#include "services/gpu-runner/gpu_window_internal.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* Queues the n copies into h->dev (allocated here, as large as the largest) between h->a and h->b. */
static bool h2d_queue(cudaStream_t s, const void *const *src, const size_t *len, uint32_t n, struct gw_h2d *h)
{
	size_t most = 0;
	for (uint32_t i = 0; i < n; i++)
		most = len[i] > most ? len[i] : most;
	if (!n || !most || cudaMalloc(&h->dev, most) != cudaSuccess || cudaEventCreate(&h->a) != cudaSuccess ||
	    cudaEventCreate(&h->b) != cudaSuccess || cudaEventRecord(h->a, s) != cudaSuccess)
		return false;
	for (uint32_t i = 0; i < n; i++) {
		if (cudaMemcpyAsync(h->dev, src[i], len[i], cudaMemcpyHostToDevice, s) != cudaSuccess)
			return false;
		h->bytes += len[i];
	}
	return cudaEventRecord(h->b, s) == cudaSuccess;
}

/* Undoes a failed start: waits for what was queued, frees what was taken. */
static bool h2d_fail(cudaStream_t s, struct gw_h2d *h)
{
	cudaStreamSynchronize(s);
	cudaGetLastError();
	if (h->a)
		cudaEventDestroy(h->a);
	if (h->b)
		cudaEventDestroy(h->b);
	cudaFree(h->dev);
	cudaFreeHost(h->host);
	memset(h, 0, sizeof(*h));
	return false;
}

bool gw_h2d_start(cudaStream_t s, uint32_t copies, struct gw_h2d *h)
{
	memset(h, 0, sizeof(*h));
	if (!copies || cudaMallocHost(&h->host, GW_H2D_CHUNK) != cudaSuccess)
		return h2d_fail(s, h);
	memset(h->host, 1, GW_H2D_CHUNK);
	const void **src = calloc(copies, sizeof(*src));
	size_t *len = calloc(copies, sizeof(*len));
	bool ok = src && len;
	for (uint32_t i = 0; ok && i < copies; i++) {
		src[i] = h->host;
		len[i] = GW_H2D_CHUNK;
	}
	ok = ok && h2d_queue(s, src, len, copies, h);
	free(src);
	free(len);
	return ok ? true : h2d_fail(s, h);
}

bool gw_h2d_start_from(cudaStream_t s, const void *const *src, const size_t *len, uint32_t n, struct gw_h2d *h)
{
	memset(h, 0, sizeof(*h));
	return h2d_queue(s, src, len, n, h) ? true : h2d_fail(s, h);
}

double gw_h2d_finish(struct gw_h2d *h)
{
	float ms = 0;
	double bps = 0;
	if (cudaEventSynchronize(h->b) == cudaSuccess && cudaEventElapsedTime(&ms, h->a, h->b) == cudaSuccess && ms > 0)
		bps = (double)h->bytes / (ms * 1e-3);
	cudaGetLastError();
	cudaEventDestroy(h->a);
	cudaEventDestroy(h->b);
	cudaFree(h->dev);
	cudaFreeHost(h->host);
	return bps;
}

int gw_measure_h2d(struct gpu_window *w, double *bps)
{
	struct gw_h2d h;
	*bps = 0;
	for (int rep = 0; rep < 2; rep++) {
		if (!gw_h2d_start(w->copy, 4, &h))
			return errorf(w->base.error, sizeof(w->base.error), -ENOMEM, "no memory to measure H2D bandwidth");
		*bps = gw_h2d_finish(&h);
	}
	if (*bps <= 0)
		return errorf(w->base.error, sizeof(w->base.error), -EIO, "measuring H2D bandwidth failed");
	return 0;
}

/* kv_copy.cu - the KV arena's copies to and from host memory (the kv-store pool). The
 * synchronous copies run on the compute stream and wait; the write-behind runs on a
 * low-priority D2H stream of its own behind the compute that wrote the blocks, and records an
 * interprocess event the kv-store waits on; the read-ahead runs on a KV H2D stream behind the
 * compute that last read the blocks it overwrites. The compute stream waits for a write-behind
 * copy only where it rewrites a block the copy still reads (kv_d2h_guard). */
#include "services/gpu-runner/cuda/cuda_internal.h"

#include <assert.h>
#include <string.h>

static size_t cuda_kv_block_bytes(const struct model_config *cfg, const struct backend_params *p)
{
	return 2 * (size_t)p->block_tokens * cfg->n_kv_heads * cfg->head_dim * dtype_size((enum dtype)p->kv_dtype);
}

/* The batch of a layer's commit: every copy queued behind the compute that wrote the blocks,
 * then one wait. */
static int cuda_kv_to_host(struct backend_dev *be, uint32_t n, const uint32_t *blocks, void *const *dsts)
{
	int frc = attention_flush(be); /* held-back attention first: it reads blocks this may overwrite */
	if (frc)
		return frc;
	size_t bytes = be->block_elems * be->kv_esize;
	for (uint32_t i = 0; i < n; i++) {
		CUDA_TRY(be, "cudaMemcpyAsync (kv_to_host)",
			 cudaMemcpyAsync(dsts[i], (char *)be->arena + blocks[i] * bytes, bytes, cudaMemcpyDeviceToHost,
					 be->stream));
	}
	CUDA_TRY(be, "cudaStreamSynchronize (kv_to_host)", cudaStreamSynchronize(be->stream));
	return 0;
}

/* Interprocess events for the KV write-behind, created on first use and re-recorded
 * round-robin (docs/architecture.md, KV path: re-record rather than recreate; the importer keeps them). */
#define KV_IPC_EVENTS (2 * KV_EVENTS_IN_FLIGHT)
static cudaEvent_t kv_ipc_event[KV_IPC_EVENTS];
static cudaIpcEventHandle_t kv_ipc_handle[KV_IPC_EVENTS];
static uint32_t kv_ipc_next;

/* Before the compute stream writes arena blocks (new rows, copies from the pool) or orders the
 * read-ahead behind itself: it waits for the write-behind copies still reading those blocks.
 * One wait covers them all (the copies are in order on one stream). */
int kv_d2h_guard(struct backend_dev *be, uint32_t n, const uint32_t *blocks)
{
	if (!be->kv_d2h_ev)
		return 0;
	uint64_t best = 0;
	int32_t ev = -1;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t b = blocks[i];
		if (b >= be->p.n_kv_blocks || be->kv_d2h_ev[b] < 0)
			continue;
		if (be->kv_d2h_seq[b] >= best) {
			best = be->kv_d2h_seq[b];
			ev = be->kv_d2h_ev[b];
		}
		be->kv_d2h_ev[b] = -1;
	}
	if (ev >= 0)
		CUDA_TRY(be, "cudaStreamWaitEvent (KV write-behind)", cudaStreamWaitEvent(be->stream, kv_ipc_event[ev], 0));
	return 0;
}

/* The write-behind: copies on a low-priority stream of their own, behind the compute that wrote
 * the blocks; the compute stream goes on, and waits for them only where it reuses one of the
 * blocks (kv_d2h_guard). The interprocess event after them goes to the kv-store. */
static int cuda_kv_write_behind(struct backend_dev *be, uint32_t n, const uint32_t *blocks, void *const *dsts,
				void *event_handle)
{
	size_t bytes = be->block_elems * be->kv_esize;
	if (!be->kv_d2h) {
		int least = 0, greatest = 0;
		CUDA_TRY(be, "cudaDeviceGetStreamPriorityRange", cudaDeviceGetStreamPriorityRange(&least, &greatest));
		CUDA_TRY(be, "cudaStreamCreateWithPriority (KV D2H)",
			 cudaStreamCreateWithPriority(&be->kv_d2h, cudaStreamNonBlocking, least));
		CUDA_TRY(be, "cudaEventCreateWithFlags (KV D2H order)",
			 cudaEventCreateWithFlags(&be->kv_d2h_order, cudaEventDisableTiming));
		be->kv_d2h_ev = (int32_t *)malloc(sizeof(int32_t) * be->p.n_kv_blocks);
		be->kv_d2h_seq = (uint64_t *)calloc(be->p.n_kv_blocks, sizeof(uint64_t));
		if (!be->kv_d2h_ev || !be->kv_d2h_seq)
			return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for the write-behind's table");
		for (uint32_t b = 0; b < be->p.n_kv_blocks; b++)
			be->kv_d2h_ev[b] = -1;
	}
	CUDA_TRY(be, "cudaEventRecord (KV D2H order)", cudaEventRecord(be->kv_d2h_order, be->stream));
	CUDA_TRY(be, "cudaStreamWaitEvent (KV D2H)", cudaStreamWaitEvent(be->kv_d2h, be->kv_d2h_order, 0));
	for (uint32_t i = 0; i < n; i++)
		CUDA_TRY(be, "cudaMemcpyAsync (kv_write_behind)",
			 cudaMemcpyAsync(dsts[i], (char *)be->arena + blocks[i] * bytes, bytes, cudaMemcpyDeviceToHost,
					 be->kv_d2h));
	uint32_t k = kv_ipc_next++ % KV_IPC_EVENTS;
	if (!kv_ipc_event[k]) {
		CUDA_TRY(be, "cudaEventCreateWithFlags (interprocess)",
			 cudaEventCreateWithFlags(&kv_ipc_event[k], cudaEventInterprocess | cudaEventDisableTiming));
		CUDA_TRY(be, "cudaIpcGetEventHandle", cudaIpcGetEventHandle(&kv_ipc_handle[k], kv_ipc_event[k]));
	}
	CUDA_TRY(be, "cudaEventRecord (kv write-behind)", cudaEventRecord(kv_ipc_event[k], be->kv_d2h));
	be->kv_d2h_batches++;
	for (uint32_t i = 0; i < n; i++) {
		be->kv_d2h_ev[blocks[i]] = (int32_t)k;
		be->kv_d2h_seq[blocks[i]] = be->kv_d2h_batches;
	}
	static_assert(sizeof(cudaIpcEventHandle_t) == BACKEND_EVENT_BYTES, "an IPC event handle is 64 bytes");
	memcpy(event_handle, &kv_ipc_handle[k], BACKEND_EVENT_BYTES);
	return 1;
}

static int cuda_pin_host(struct backend_dev *be, void *p, size_t bytes)
{
	CUDA_TRY(be, "cudaHostRegister", cudaHostRegister(p, bytes, cudaHostRegisterDefault));
	return 0;
}

static void cuda_unpin_host(struct backend_dev *be, void *p)
{
	cudaHostUnregister(p);
}

/* A run of blocks fetched from the pool: every copy queued, then one wait (a wait per block
 * costs more than a small block's copy). */
static int cuda_kv_from_host(struct backend_dev *be, uint32_t n, const uint32_t *blocks, const void *const *srcs)
{
	int frc = attention_flush(be); /* held-back attention first: it reads blocks this may overwrite */
	if (frc)
		return frc;
	size_t bytes = be->block_elems * be->kv_esize;
	for (uint32_t i = 0; i < n; i++) {
		int grc = kv_d2h_guard(be, 1, &blocks[i]);
		if (grc)
			return grc;
		CUDA_TRY(be, "cudaMemcpyAsync (kv_from_host)",
			 cudaMemcpyAsync((char *)be->arena + blocks[i] * bytes, srcs[i], bytes, cudaMemcpyHostToDevice,
					 be->stream));
	}
	CUDA_TRY(be, "cudaStreamSynchronize (kv_from_host)", cudaStreamSynchronize(be->stream));
	return 0;
}

/* The KV read-ahead: copies on a stream of their own, so they run while the compute stream
 * attends the layer before. They start behind everything queued on the compute stream so far:
 * the attention that last read a block they overwrite, and the write-behind copy that saved it. */
static int cuda_kv_prefetch(struct backend_dev *be, uint32_t n, const uint32_t *blocks, const void *const *srcs,
			    uint32_t slot)
{
	int frc = attention_flush(be); /* held-back attention first: it reads blocks this may overwrite */
	if (frc)
		return frc;
	if (!be->kv_h2d) {
		CUDA_TRY(be, "cudaStreamCreateWithFlags (KV H2D)", cudaStreamCreateWithFlags(&be->kv_h2d, cudaStreamNonBlocking));
		CUDA_TRY(be, "cudaEventCreateWithFlags (KV order)",
			 cudaEventCreateWithFlags(&be->kv_order, cudaEventDisableTiming));
		for (int i = 0; i < 2; i++)
			CUDA_TRY(be, "cudaEventCreateWithFlags (KV read-ahead)",
				 cudaEventCreateWithFlags(&be->kv_done[i], cudaEventDisableTiming));
	}
	size_t bytes = be->block_elems * be->kv_esize;
	int grc = kv_d2h_guard(be, n, blocks);
	if (grc)
		return grc;
	CUDA_TRY(be, "cudaEventRecord (KV order)", cudaEventRecord(be->kv_order, be->stream));
	CUDA_TRY(be, "cudaStreamWaitEvent (KV H2D)", cudaStreamWaitEvent(be->kv_h2d, be->kv_order, 0));
	for (uint32_t i = 0; i < n; i++)
		CUDA_TRY(be, "cudaMemcpyAsync (kv_prefetch)",
			 cudaMemcpyAsync((char *)be->arena + blocks[i] * bytes, srcs[i], bytes, cudaMemcpyHostToDevice,
					 be->kv_h2d));
	CUDA_TRY(be, "cudaEventRecord (KV read-ahead)", cudaEventRecord(be->kv_done[slot], be->kv_h2d));
	return 0;
}

static int cuda_kv_sync(struct backend_dev *be)
{
	/* Held-back attention first; every stream is waited for whatever it or another stream gives
	 * (callers free pool blocks the copies may still be writing once this returns), and the first
	 * failure is the one returned. */
	int rc = attention_flush(be);
	const struct {
		cudaStream_t s;
		const char *what;
	} streams[] = {{be->stream, "cudaStreamSynchronize (KV sync)"},
		       {be->kv_d2h, "cudaStreamSynchronize (KV D2H)"},
		       {be->kv_h2d, "cudaStreamSynchronize (KV H2D)"}};
	for (size_t i = 0; i < sizeof(streams) / sizeof(streams[0]); i++) {
		if (i > 0 && !streams[i].s)
			continue;
		const cudaError_t e = cudaStreamSynchronize(streams[i].s);
		if (e != cudaSuccess && !rc)
			rc = cuda_fail(be, e, streams[i].what);
	}
	return rc;
}

static int cuda_kv_prefetch_wait(struct backend_dev *be, uint32_t slot)
{
	if (!be->kv_h2d)
		return 0;
	CUDA_TRY(be, "cudaEventSynchronize (KV read-ahead)", cudaEventSynchronize(be->kv_done[slot]));
	return 0;
}

void kv_copy_destroy(struct backend_dev *be)
{
	if (be->kv_d2h) {
		cudaStreamSynchronize(be->kv_d2h);
		cudaStreamDestroy(be->kv_d2h);
		cudaEventDestroy(be->kv_d2h_order);
	}
	free(be->kv_d2h_ev);
	free(be->kv_d2h_seq);
	if (be->kv_h2d) {
		cudaStreamSynchronize(be->kv_h2d);
		cudaStreamDestroy(be->kv_h2d);
		cudaEventDestroy(be->kv_order);
		cudaEventDestroy(be->kv_done[0]);
		cudaEventDestroy(be->kv_done[1]);
	}
}

/* In the order of struct backend_kv_ops (C++17 has no designated initializers). */
const struct backend_kv_ops cuda_kv_ops = {
	cuda_kv_block_bytes,	/* block_bytes */
	cuda_kv_to_host,	/* to_host */
	cuda_kv_from_host,	/* from_host */
	cuda_kv_write_behind,	/* write_behind */
	cuda_kv_prefetch,	/* prefetch */
	cuda_kv_prefetch_wait,	/* prefetch_wait */
	cuda_kv_sync,		/* sync */
	cuda_pin_host,		/* pin_host */
	cuda_unpin_host,	/* unpin_host */
};

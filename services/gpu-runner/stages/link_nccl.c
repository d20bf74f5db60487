/* link_nccl.c - the nccl kind of stage link (link.h): point-to-point NCCL sends of the hidden state,
 * device to device, queued on the CUDA backend's stream. C over the CUDA runtime API and NCCL.
 *
 * The communicator is nonblocking (ncclConfig_t.blocking = 0): no NCCL call blocks the host, so every
 * wait for it (the communicator's forming, a call still in progress, a step's transfers) is a loop of
 * short looks that also watches the peers' processes and the formation's abort word; a peer that dies
 * makes the link abort its communicator (ncclCommAbort), which ends the transfers it had queued on
 * the GPU, instead of hanging. NVLink multicast (NVLS) is left off unless the environment asks for it:
 * this link only sends point to point. */
#include "services/gpu-runner/stages/link_internal.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <nccl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/proc.h"
#include "common/util.h"

_Static_assert(sizeof(ncclUniqueId) == STAGE_NCCL_ID_BYTES, "ncclUniqueId is 128 bytes");

/* The host may block in a CUDA call of its own (a KV copy's wait) behind a receive whose sender died,
 * where no wait of this link can see it: a watchdog thread aborts the communicator as soon as the
 * formation is given up or a peer's process is gone, which ends the transfers and unblocks the
 * stream. Every use of comm holds mu, so the abort never meets a call in progress. */
struct nccl_state {
	pthread_mutex_t mu;
	ncclComm_t comm;  /* NULL once aborted */
	cudaEvent_t done; /* recorded after the transfers queued, for stage_link_wait */
	int device;
	pthread_t dog;
	bool dog_running;
	_Atomic bool stop;
};

int stage_link_nccl_new_id(void *id, char *err, size_t errlen)
{
	setenv("NCCL_NVLS_ENABLE", "0", 0); /* NCCL reads its environment once, at its first call */
	ncclUniqueId u;
	ncclResult_t r = ncclGetUniqueId(&u);
	if (r != ncclSuccess)
		return errorf(err, errlen, -EIO, "ncclGetUniqueId: %s", ncclGetErrorString(r));
	memcpy(id, &u, sizeof(u));
	return 0;
}

/* Gives the communicator up: its queued transfers end (on the GPU too). */
static void abort_comm(struct nccl_state *st)
{
	pthread_mutex_lock(&st->mu);
	if (st->comm)
		ncclCommAbort(st->comm);
	st->comm = NULL;
	pthread_mutex_unlock(&st->mu);
}

/* ncclCommGetAsyncError under the lock; ncclInvalidUsage once the communicator is gone. */
static ncclResult_t async_error(struct nccl_state *st, ncclResult_t *r)
{
	pthread_mutex_lock(&st->mu);
	ncclResult_t rc = st->comm ? ncclCommGetAsyncError(st->comm, r) : ncclInvalidUsage;
	pthread_mutex_unlock(&st->mu);
	return rc;
}

static void *watchdog(void *arg)
{
	struct stage_link *l = arg;
	struct nccl_state *st = l->impl;
	cudaSetDevice(st->device);
	while (!atomic_load(&st->stop)) {
		usleep(50 * 1000);
		bool gone = atomic_load_explicit(&l->h->aborted, memory_order_acquire) != 0;
		for (uint32_t r = 0; r < l->p.ranks && !gone; r++)
			gone = r != l->p.rank && !process_alive(l->p.pids[r], l->p.starts[r]);
		if (gone) {
			abort_comm(st);
			break;
		}
	}
	return NULL;
}

/* Waits while the communicator says ncclInProgress (nonblocking calls), looking at the peers. */
static int settle(struct stage_link *l, struct nccl_state *st, ncclResult_t r, const char *what)
{
	uint64_t t0 = now_ns();
	bool first = true;
	while (r == ncclInProgress) {
		int rc = link_check_wait(l, first ? 0 : (now_ns() - t0) / 1000000, what);
		first = false;
		if (rc) {
			abort_comm(st);
			return rc;
		}
		usleep(50);
		if (async_error(st, &r) != ncclSuccess)
			break;
	}
	if (r != ncclSuccess) {
		abort_comm(st);
		return link_fail(l, -EIO, "%s: %s", what, ncclGetErrorString(r));
	}
	return 0;
}

static int nccl_connect(struct stage_link *l)
{
	struct nccl_state *st = calloc(1, sizeof(*st));
	if (!st)
		return link_fail(l, -ENOMEM, "out of memory");
	pthread_mutex_init(&st->mu, NULL);
	l->impl = st;
	setenv("NCCL_NVLS_ENABLE", "0", 0);
	if (cudaGetDevice(&st->device) != cudaSuccess ||
	    cudaEventCreateWithFlags(&st->done, cudaEventDisableTiming) != cudaSuccess) {
		cudaGetLastError();
		return link_fail(l, -EIO, "nccl link: no CUDA device to join the communicator from");
	}
	ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
	config.blocking = 0;
	ncclUniqueId id;
	memcpy(&id, l->id, sizeof(id));
	ncclResult_t r = ncclCommInitRankConfig(&st->comm, (int)l->p.ranks, id, (int)l->p.rank, &config);
	if (r != ncclSuccess && r != ncclInProgress) {
		st->comm = NULL;
		return link_fail(l, -EIO, "ncclCommInitRankConfig (rank %u of %u): %s", l->p.rank, l->p.ranks,
				 ncclGetErrorString(r));
	}
	char what[96];
	snprintf(what, sizeof(what), "forming the NCCL communicator (rank %u of %u)", l->p.rank, l->p.ranks);
	int rc = settle(l, st, ncclInProgress, what);
	if (rc == 0) {
		if (pthread_create(&st->dog, NULL, watchdog, l) != 0) {
			abort_comm(st);
			return link_fail(l, -EAGAIN, "nccl link: cannot start its watchdog thread");
		}
		st->dog_running = true;
	}
	return rc;
}

static int device_rows(struct stage_link *l, struct backend *be, float **x, cudaStream_t *stream)
{
	struct nccl_state *st = l->impl;
	bool gone = !st;
	if (st) {
		pthread_mutex_lock(&st->mu);
		gone = !st->comm;
		pthread_mutex_unlock(&st->mu);
	}
	if (gone)
		return link_fail(l, -EPIPE, "nccl link: no communicator (not connected, or given up)");
	struct CUstream_st *s;
	int rc = backend_hidden_device(be, x, &s);
	if (rc)
		return link_fail(l, rc, "nccl link: %s", backend_error(be));
	*stream = s;
	return 0;
}

static int nccl_send(struct stage_link *l, struct backend *be, uint32_t row0, uint32_t n)
{
	struct nccl_state *st = l->impl;
	float *x;
	cudaStream_t s;
	int rc = device_rows(l, be, &x, &s);
	if (rc)
		return rc;
	uint32_t to = (l->p.rank + 1) % l->p.ranks;
	pthread_mutex_lock(&st->mu);
	ncclResult_t r = st->comm ? ncclSend(x + (size_t)row0 * l->p.dim, (size_t)n * l->p.dim, ncclFloat32, (int)to,
					     st->comm, s)
				  : ncclInvalidUsage;
	pthread_mutex_unlock(&st->mu);
	char what[64];
	snprintf(what, sizeof(what), "ncclSend to stage %u", to);
	return settle(l, st, r, what);
}

static int nccl_recv(struct stage_link *l, struct backend *be, uint32_t row0, uint32_t n, const struct backend_batch *b)
{
	struct nccl_state *st = l->impl;
	float *x;
	cudaStream_t s;
	int rc = device_rows(l, be, &x, &s);
	if (rc)
		return rc;
	uint32_t from = (l->p.rank + l->p.ranks - 1) % l->p.ranks;
	pthread_mutex_lock(&st->mu);
	ncclResult_t r = st->comm ? ncclRecv(x + (size_t)row0 * l->p.dim, (size_t)n * l->p.dim, ncclFloat32, (int)from,
					     st->comm, s)
				  : ncclInvalidUsage;
	pthread_mutex_unlock(&st->mu);
	char what[64];
	snprintf(what, sizeof(what), "ncclRecv from stage %u", from);
	if ((rc = settle(l, st, r, what)) != 0)
		return rc;
	if (b && (rc = backend_hidden_in(be, b, NULL)) != 0)
		return link_fail(l, rc, "nccl link: %s", backend_error(be));
	return 0;
}

static int nccl_wait(struct stage_link *l, struct backend *be)
{
	struct nccl_state *st = l->impl;
	float *x;
	cudaStream_t s;
	int rc = device_rows(l, be, &x, &s);
	if (rc)
		return rc;
	if (cudaEventRecord(st->done, s) != cudaSuccess) {
		cudaGetLastError();
		return link_fail(l, -EIO, "nccl link: cannot record the step's end");
	}
	uint64_t t0 = now_ns();
	bool first = true;
	for (uint32_t spin = 0;; spin++) {
		cudaError_t q = cudaEventQuery(st->done);
		if (q == cudaSuccess)
			break;
		if (q != cudaErrorNotReady) {
			cudaGetLastError();
			abort_comm(st);
			return link_fail(l, -EIO, "nccl link: the step failed on the GPU: %s", cudaGetErrorString(q));
		}
		ncclResult_t r;
		if (async_error(st, &r) == ncclSuccess && r != ncclSuccess && r != ncclInProgress) {
			abort_comm(st);
			return link_fail(l, -EIO, "nccl link: %s", ncclGetErrorString(r));
		}
		if (spin < 200)
			continue;
		if ((rc = link_check_wait(l, first ? 0 : (now_ns() - t0) / 1000000, "waiting for the step's transfers"))) {
			abort_comm(st); /* ends the transfers that wait for a gone peer, so the stream runs on */
			return rc;
		}
		first = false;
		usleep(20);
	}
	if ((rc = backend_finish(be)) != 0)
		return link_fail(l, rc, "%s", backend_error(be));
	return 0;
}

static void nccl_destroy(struct stage_link *l)
{
	struct nccl_state *st = l->impl;
	if (!st)
		return;
	atomic_store(&st->stop, true);
	if (st->dog_running)
		pthread_join(st->dog, NULL);
	abort_comm(st);
	if (st->done)
		cudaEventDestroy(st->done);
	pthread_mutex_destroy(&st->mu);
	free(st);
	l->impl = NULL;
}

static void nccl_abort(struct stage_link *l)
{
	struct nccl_state *st = l->impl;
	if (st)
		abort_comm(st);
}

const struct stage_link_ops stage_link_nccl_ops = {
	.kind = "nccl",
	.abort = nccl_abort,
	.connect = nccl_connect,
	.send = nccl_send,
	.recv = nccl_recv,
	.wait = nccl_wait,
	.destroy = nccl_destroy,
};

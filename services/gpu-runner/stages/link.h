/* link.h - how the hidden state passes from one stage of a split model to the next (stages.h).
 *
 * The runners of a split model are ranks 0 .. ranks-1, each computing a contiguous range of layers.
 * Their hops form a ring: rank r sends to rank r + 1, and the last rank sends to rank 0 (one row,
 * when a step wants the head). Both ends of a hop count its messages, so the k-th send on a hop is
 * the k-th receive there: the stages agree on the order because every step reaches each of them in
 * the same order (MSG_STAGE_STEP).
 *
 * Rank 0 lays out a shared-memory object for each formation (0600, "/llmp-<uid>-<instance>-stages"):
 * every rank's pid, an abort word, and for the shm kind the message slots. Two kinds move the rows:
 *  - shm: two slots per hop in that object; the rows go through host memory (backend_hidden_get /
 *    put / in), so any backend can use it (the C backend in CI; two CUDA runners on one GPU). A send
 *    waits until its slot's earlier message was taken; a receive waits for its message; both sleep on
 *    a futex in the object.
 *  - nccl: NCCL point-to-point sends on the CUDA backend's stream, device to device; nothing waits on
 *    the host until stage_link_wait. Built where NCCL is found (PIPELINE_HAVE_NCCL).
 *
 * Every wait gives up, with a message naming the peer, when a peer's process is gone (its pid and
 * start time from the formation), when any rank aborted the formation (stage_link_abort: its step
 * failed, so the messages of the ring no longer match), when the wait hook says the runner is
 * stopping, or after timeout_ms. A link that gave up is broken: every later call fails, and the
 * ranks form anew.
 *
 *   rank 0:  stage_link_open(&p, "nccl", instance, &l, name, sizeof(name), id, err, sizeof(err));
 *            ... MSG_STAGE_SETUP with name and id to the others ...
 *   rank r:  stage_link_join(&p, "nccl", name, id, &l, err, sizeof(err));
 *   all:     stage_link_connect(l);      (nccl: the communicator, every rank at about the same time)
 *   stage_link_send(l, be, 0, n);  stage_link_recv(l, be, 0, n, &batch);  stage_link_wait(l, be);
 *   stage_link_destroy(&l);
 */
#ifndef GPU_RUNNER_STAGES_LINK_H
#define GPU_RUNNER_STAGES_LINK_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/protocol.h"
#include "services/gpu-runner/backend.h"
#ifdef __cplusplus
extern "C" {
#endif

struct stage_link;

#define STAGE_NCCL_ID_BYTES 128 /* sizeof(ncclUniqueId) */

struct stage_link_params {
	uint64_t formation;	       /* names the link's messages; the shm object carries it */
	uint32_t rank, ranks;	       /* this runner's rank, and how many there are (2..STAGE_MAX_RANKS) */
	uint32_t dim, max_rows;	       /* a row is dim float32; a message holds at most max_rows */
	int pids[STAGE_MAX_RANKS];     /* each rank's process */
	uint64_t starts[STAGE_MAX_RANKS]; /* and its start time (process_start_time; 0: unknown) */
	int timeout_ms;		       /* the longest wait for a peer */
	bool (*wait_hook)(void *ctx);  /* called between slices of a wait (heartbeats); true: give up */
	void *wait_ctx;
};

/* Is a kind ("shm", "nccl") built into this binary? */
bool stage_link_kind_available(const char *kind);

/* Rank 0: lays out the formation's object (a leftover of a dead owner is reclaimed) and writes its name
 * into name; for nccl, a new communicator's unique id (STAGE_NCCL_ID_BYTES) into id. Returns 0 or
 * -errno with err set (-ENOTSUP: a kind not built in). */
int stage_link_open(const struct stage_link_params *p, const char *kind, const char *instance, struct stage_link **out,
		    char *name, size_t name_len, void *id, char *err, size_t errlen);
/* Another rank: maps the object rank 0 named, checking that it is p->formation's (id: nccl's). */
int stage_link_join(const struct stage_link_params *p, const char *kind, const char *name, const void *id,
		    struct stage_link **out, char *err, size_t errlen);
/* Every rank, at about the same time, after open or join: nccl joins the communicator on the current
 * CUDA device, waiting until all ranks have; shm has nothing to do. Returns 0 or -errno. */
int stage_link_connect(struct stage_link *l);
/* The step failed here: every rank's waits on this formation give up with why. */
void stage_link_abort(struct stage_link *l, const char *why);

/* Sends rows [row0, row0 + n) of be's hidden state to the next rank. */
int stage_link_send(struct stage_link *l, struct backend *be, uint32_t row0, uint32_t n);
/* Receives n rows from the previous rank into be's hidden state at row0: with b, they start b's step
 * (backend_hidden_in; row0 0, n = b->n); without, they overwrite rows of the step in flight. */
int stage_link_recv(struct stage_link *l, struct backend *be, uint32_t row0, uint32_t n, const struct backend_batch *b);
/* Waits until every send and receive so far has completed, and the backend's work before them
 * (backend_finish); for shm they have on return already. */
int stage_link_wait(struct stage_link *l, struct backend *be);

const char *stage_link_kind(const struct stage_link *l); /* "shm", "nccl" */
const char *stage_link_error(const struct stage_link *l);
bool stage_link_broken(const struct stage_link *l);
/* Bytes of hidden state sent and received so far. */
void stage_link_counts(const struct stage_link *l, uint64_t *sent, uint64_t *received);
/* Leaves the link (the shm creator unlinks its object; an NCCL communicator is aborted if a peer may
 * be gone, else destroyed). Safe on NULL; NULLs *l. */
void stage_link_destroy(struct stage_link **l);

#ifdef __cplusplus
}
#endif
#endif

/* link_internal.h - what the kinds of stage link share (link.h is the public side): the formation's
 * shared-memory object, the link's state, the waits. link.c has the object and the dispatch,
 * link_shm.c the shm kind's slots, link_nccl.c the nccl kind. */
#ifndef GPU_RUNNER_STAGES_LINK_INTERNAL_H
#define GPU_RUNNER_STAGES_LINK_INTERNAL_H
#include <stdatomic.h>

#include "common/shm.h"
#include "services/gpu-runner/stages/link.h"

#define SLINK_LAYOUT_VERSION 1
#define SLINK_SLOTS 2 /* per hop: a sender may be one message ahead of its receiver */

struct slink_slot {
	_Atomic uint32_t seq;	/* the number of the last message written into the slot (from 1); futex word */
	_Atomic uint32_t taken; /* the number of the last message read from it; futex word */
	uint32_t rows;		/* rows of that message */
	uint32_t reserved;
	uint64_t data_off;	/* from the object's base: max_rows * dim float32 */
};

/* The formation's object. Hop h carries rank h's messages to rank (h + 1) % ranks. */
struct slink_header {
	struct shm_header shm;
	uint64_t formation;
	uint32_t ranks, dim, max_rows, slots; /* slots per hop: SLINK_SLOTS for shm, 0 for nccl */
	_Atomic uint32_t aborted;	      /* 1 once a rank gave the formation up (stage_link_abort) */
	uint32_t aborted_by;		      /* which rank */
	char why[256];			      /* and why */
	struct slink_slot slot[STAGE_MAX_RANKS][SLINK_SLOTS];
};

struct stage_link_ops {
	const char *kind;
	int (*connect)(struct stage_link *l);
	int (*send)(struct stage_link *l, struct backend *be, uint32_t row0, uint32_t n);
	int (*recv)(struct stage_link *l, struct backend *be, uint32_t row0, uint32_t n, const struct backend_batch *b);
	int (*wait)(struct stage_link *l, struct backend *be);
	void (*destroy)(struct stage_link *l); /* frees what the kind holds (not l, not the object) */
	void (*abort)(struct stage_link *l);   /* optional: the formation was given up here */
};

struct stage_link {
	const struct stage_link_ops *ops;
	struct stage_link_params p;
	struct shm_object *obj;
	struct slink_header *h;
	bool owner;		 /* rank 0: unlinks the object at destroy */
	uint32_t sent_k, recv_k; /* messages sent on this rank's hop, received on the one before */
	uint64_t next_check_ms;	 /* link_check_wait: when the next look at the peers is due */
	bool broken;
	uint64_t sent, received; /* bytes */
	char error[512];
	void *impl;		 /* the kind's own state (nccl) */
	uint8_t id[STAGE_NCCL_ID_BYTES];
};

extern const struct stage_link_ops stage_link_shm_ops;
#ifdef PIPELINE_HAVE_NCCL
extern const struct stage_link_ops stage_link_nccl_ops;
/* ncclGetUniqueId into id. Returns 0 or -EIO with err set. */
int stage_link_nccl_new_id(void *id, char *err, size_t errlen);
#endif

/* Records a message and marks the link broken; returns rc. */
int link_fail(struct stage_link *l, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Between slices of a wait (every few ms): -ECONNABORTED when a rank aborted the formation, -EPIPE
 * when a peer's process is gone, -ECANCELED when the wait hook says stop, -ETIMEDOUT once waited_ms
 * reached the timeout (each with a message naming `what` and the cause, the link broken); 0: wait on.
 * The hook and the processes are looked at every 100 ms at most. */
int link_check_wait(struct stage_link *l, uint64_t waited_ms, const char *what);
/* The futex word w holds v: sleeps until it may not, for at most ms milliseconds. */
void link_futex_wait(_Atomic uint32_t *w, uint32_t v, int ms);
void link_futex_wake(_Atomic uint32_t *w);

#endif

/* gpu_window.h - the GPU tier of weights: which groups live in device memory, and the
 * copies that bring the others in just ahead of compute.
 *
 * A weight source (weights.h) over the loader's ring (weights_ring.h). Under --gpu-budget it
 * keeps the head group (final norm and lm_head; with tied embeddings the embedding table too)
 * and as many layer groups as fit resident for good, and streams the remaining layer groups
 * through a window of `depth` device slots per size class. The embedding table stays in host
 * memory: the backend gathers one row per token there.
 *
 * Streamed groups of a class are copied in visit order, copy k into slot k % depth, so the
 * copy for a group can start as soon as the group `depth` places before it in that class has
 * been computed. All ordering is on the GPU (docs/architecture.md, weight path 4):
 *  - the compute stream waits on a group's H2D event before using it (cudaStreamWaitEvent);
 *  - a copy into a slot waits on the compute-done event of the slot's previous occupant;
 *  - a host ring slot goes back to the loader only once its H2D event has completed, noticed
 *    with cudaEventQuery on later calls, never by blocking.
 * Nothing here synchronises the host with the device.
 *
 * Each group has one state: ABSENT -> INFLIGHT (copy issued) -> RESIDENT (copy seen complete)
 * -> RETIRING (its slot chosen for the next copy; the copy waits on its compute) -> ABSENT.
 * Transitions are checked; with strict on, every call also checks the invariants of the whole
 * table (gpu_window_check).
 *
 *   struct gpu_window *w;
 *   rc = gpu_window_create(ring, backend_stream, &params, &w, err, sizeof(err));
 *   engine uses gpu_window_base(w) as its weight source
 *   gpu_window_stats(w, &st);  gpu_window_destroy(&w);
 */
#ifndef GPU_RUNNER_GPU_WINDOW_H
#define GPU_RUNNER_GPU_WINDOW_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "services/gpu-runner/weights.h"
#include "services/gpu-runner/weights_ring.h"
#ifdef __cplusplus
extern "C" {
#endif

struct gpu_window_params {
	uint64_t gpu_budget; /* bytes of device memory for weights */
	uint32_t depth;	     /* device slots per streamed class (>= 1; 2 or more overlaps copies) */
	bool strict;	     /* check every invariant on every call */
	bool time_copies;    /* record timing events around each copy (for the benchmark) */
	double h2d_bytes_per_s; /* 0: measure at create */
	uint32_t copy_streams;	/* H2D concurrency: copies go round-robin over this many streams (1..4) */
};

enum gwin_state {
	GWIN_ABSENT = 0,
	GWIN_INFLIGHT = 1,
	GWIN_RESIDENT = 2,
	GWIN_RETIRING = 3,
};

struct gpu_window_stats {
	uint64_t resident_groups, streamed_groups;
	uint64_t resident_bytes;	 /* device bytes held for good */
	uint64_t window_bytes;		 /* device bytes of the streaming slots */
	uint64_t streamed_bytes_per_token; /* what crosses PCIe per token in decode */
	uint64_t bytes_h2d, copies;	 /* all time */
	uint64_t late_copies;		 /* copies issued by an acquire rather than ahead of it */
	uint32_t depth;
	double h2d_bytes_per_s;		 /* measured (or given) */
	double copy_ms;			 /* with time_copies: device time spent copying, since reset */
	uint64_t timed_copies;
	uint32_t copy_streams;
};

struct gpu_window;

/* Borrows ring (it must outlive the window); stream is the backend's compute stream
 * (a cudaStream_t). Pins the ring's memory, plans, allocates the device slots, copies the
 * resident groups (waiting for them: this is start-up, not the token path) and measures H2D
 * bandwidth unless given. Returns 0, -ENOSPC when the budget cannot hold the head group and one
 * slot of each streamed class (err says how much is needed), other -errno with err set. */
int gpu_window_create(struct ring_source *ring, struct CUstream_st *stream, const struct gpu_window_params *p,
		      struct gpu_window **out, char *err, size_t errlen);
void gpu_window_destroy(struct gpu_window **w);

struct weight_source *gpu_window_base(struct gpu_window *w);
void gpu_window_stats(struct gpu_window *w, struct gpu_window_stats *st);
/* For inspection: group g's state (enum gwin_state; GWIN_ABSENT for g out of range) and
 * whether it is held on the device for good (*resident, may be NULL). */
enum gwin_state gpu_window_group_state(const struct gpu_window *w, uint32_t g, bool *resident);
/* Starts a new period for copy timing (the benchmark calls it between prefill and decode). */
void gpu_window_reset_timing(struct gpu_window *w);
/* A line saying what the plan is and what it predicts per decode token. */
void gpu_window_describe(const struct gpu_window *w, char *buf, size_t len);

/* Checks every invariant of the state table; returns 0 or -EFAULT with err saying which broke. */
int gpu_window_check(const struct gpu_window *w, char *err, size_t errlen);

/* The planning on its own (tests, the benchmark's predictions): given the group sizes of a
 * model, which layer groups stay resident under budget with depth slots per streamed class.
 * resident[g] is set for resident groups. Returns the bytes streamed per token, or -ENOSPC. */
int64_t gpu_window_plan(const struct model_config *cfg, const struct group_desc *groups, uint32_t n_groups,
			uint64_t budget, uint32_t depth, bool *resident, uint64_t *need, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif

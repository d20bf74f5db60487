/* handoff.h - what it costs to pass a result from every block of one phase of GPU work to every
 * block of the next, measured in handoff.cu for bench-limits --handoffs: between two kernels of a
 * stream (plainly launched, and with programmatic dependent launch as a decode step's kernels
 * are), and inside one persistent grid (a counter each phase, or a cooperative grid barrier).
 * The floor under every kernel boundary of a decode step, and what a step as one persistent
 * kernel (docs/design.md) could put in its place. */
#ifndef PIPELINE_BENCH_LIMITS_HANDOFF_H
#define PIPELINE_BENCH_LIMITS_HANDOFF_H

#ifdef __cplusplus
extern "C" {
#endif

struct handoff_costs {
	double plain_us;     /* a kernel boundary, kernels launched plainly */
	double pdl_us;	     /* a kernel boundary, programmatic dependent launch */
	double counter_us;   /* a phase of one persistent grid, waiting on a counter its producers add to */
	double grid_sync_us; /* a phase of one persistent grid, a cooperative grid barrier */
	int blocks;	     /* blocks of each phase (every block resident: the persistent grid's size) */
	int threads;	     /* threads a block */
};

/* Measures each hand-off over `phases` phases of `threads`-thread blocks, four blocks a
 * multiprocessor (the products' shape), on the current device; the best of `reps` runs each.
 * Returns 0, or -1 with the failing CUDA call on stderr. */
int handoff_measure(int phases, int reps, struct handoff_costs *out);

#ifdef __cplusplus
}
#endif

#endif

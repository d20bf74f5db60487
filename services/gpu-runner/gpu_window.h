/* gpu_window.h - the GPU tier of weights: which groups live in device memory, and the
 * copies that bring the others in just ahead of compute.
 *
 * A weight source (weights.h) over the loader's ring (weights_ring.h). Under --gpu-budget it
 * keeps the head group (final norm and lm_head; with tied embeddings the embedding table too)
 * and as many layer groups as fit resident for good, then, for a mixture of experts, the experts
 * the routing chooses most (window_plan.h; the runner makes the window anew between requests when
 * the routing it counted says others are hotter: experts.c), and streams the remaining groups
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
 * Split FFNs (--cpu-share; split_plan.h): a streamed FFN group whose host bytes stay in DRAM (pinned
 * by the loader) may be computed in two shares (backend.h, struct ffn_split). The window then copies
 * only the first share: gate and up rows [0, r) and down's columns [0, r) of every row (one 2D
 * copy from the ring's full rows), so its slots and the bytes that cross PCIe shrink; the rows the
 * CPU takes never cross. In a decode step (at most plan.max_tokens tokens) the engine gets the
 * second share in place in the ring, for the CPU (FFN_SPLIT_CPU). A prefill step needs the whole
 * FFN on the GPU: the second share is copied into one more device buffer (sized for the largest),
 * ahead of use where it can (at the release of the split FFN before it in the step) and waited
 * for on the GPU, and the backend computes both shares (FFN_SPLIT_BACKEND).
 *
 * Mixture-of-experts layers (route/skip of weights.h): once the engine has told the window a layer's
 * routing, the expert groups of that layer its tokens chose are copied and the others passed over
 * (counted as visited, never copied, and never asked of the loader, which reads an expert from disk
 * only when asked); the experts of a layer
 * not yet routed are not copied ahead. So a decode token moves the bytes of its chosen experts only.
 * With a CPU pool and --cpu-share, a decode step (at most FFN_SPLIT_MAX_TOKENS tokens) also leaves
 * some chosen experts in host memory for the CPU (acquire_host): those whose host bytes stay in
 * DRAM, each to the side (copy, or CPU product) that would finish the layer's experts first at the
 * measured H2D and CPU rates (auto), or a fixed fraction of their bytes (--cpu-share 0.5).
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

#include "services/gpu-runner/split_plan.h"
#include "services/gpu-runner/weights.h"
#include "services/gpu-runner/weights_ring.h"
#ifdef __cplusplus
extern "C" {
#endif

struct gpu_window_params {
	uint64_t gpu_budget; /* bytes of device memory for weights */
	uint32_t depth;	     /* device slots per streamed layer class (>= 1; 2 or more overlaps copies) */
	uint32_t expert_depth; /* the experts' slots (0: window_expert_depth's choice, fewer where the
				* budget cannot hold them, down to depth) */
	bool strict;	     /* check every invariant on every call */
	bool time_copies;    /* record timing events around each copy (for the benchmark) */
	double h2d_bytes_per_s; /* 0: measure at create */
	uint32_t copy_streams;	/* H2D concurrency: copies go round-robin over this many streams (1..4) */
	struct cpu_share_policy cpu_share; /* which streamed FFNs split with the CPU (mode off: none) */
	struct task_pool *cpu_pool;	   /* where the CPU's rates are measured (auto); NULL: no split */
	/* A mixture of experts: (n_layers, n_experts) the share of decode steps whose routing chose each
	 * expert, which picks the experts kept resident (window_plan.h); NULL: none counted yet. Read
	 * during create only. */
	const float *expert_heat;
	/* Kept layer groups spread among the layers, not the first ones (window_plan_spread); only
	 * where the loader holds every layer group in DRAM (else the streamed layers would come from
	 * disk, which reads the first layers while the GPU keeps them). */
	bool spread;
	/* spread only where the plan keeps every attention group of the stage (window_plan_attn_kept;
	 * --window-spread auto) and some FFN splits with the CPU: with attention streamed, P2 on an
	 * H200 waited 33.8 ms a token for copies spread against 2.0 with the first layers kept
	 * (docs/design.md, "Which layers the GPU keeps"). Each plan asks again: the first one, with
	 * whole sizes, and the one with the memory the split frees (gw_split_refill), which may keep
	 * every attention group where the first did not; where no FFN splits in the end, the first
	 * layers are kept as the plan with whole sizes has them. */
	bool spread_attn_kept;
	/* Where the kept layers spread, auto's balance takes the GPU's reads of the layers between two
	 * split FFNs (at hbm_bytes_per_s) off the CPU's side: the link copies through them while the CPU
	 * waits for the next split layer's input (split_layer.gpu_s; --split-gaps, off by default:
	 * P3 on an H200 host measured alike with and without). */
	bool split_gaps;
	double hbm_bytes_per_s;
	/* The residency planned with whole group sizes is kept: the memory the split's smaller slots
	 * free stays unused (gw_split_refill not run; --fixed-residency, for comparison). */
	bool fixed_residency;
	/* A mixture of experts in decode: a later layer's streamed experts are copied before its route,
	 * those its last routing chose, and the others passed over; one passed over that the route then
	 * chooses is computed by the CPU from DRAM (--predict-experts, the runner's default; it acts
	 * only with the CPU's share of experts on, where their host bytes stay in DRAM). */
	bool predict_experts;
	/* A mixture of experts in decode, with the CPU's share of experts on: a chosen expert whose
	 * copy would take at least GW_SPLIT_EXPERT_MIN_S of the link is split between the two sides
	 * (the link copies rows [0, r) of its gate and up and columns [0, r) of its down, the CPU
	 * computes the rest from DRAM), r such that both sides end together; such a layer's experts
	 * are not guessed (GW_SPLIT_AUTO, the runner's default). GW_SPLIT_ALWAYS splits whatever the
	 * size (tests), GW_SPLIT_OFF (zero) never: whole experts to one side. */
	enum gw_split_experts { GW_SPLIT_OFF = 0, GW_SPLIT_AUTO = 1, GW_SPLIT_ALWAYS = 2 } split_experts;
	/* A mixture of experts in one-token steps, auto: the routes balance a layer's two sides so that
	 * they end together as measured (weight_source.route_ends_ns), not only as the rates say: each
	 * measure moves ends_lag, the time the route counts the link's side as started late (< 0: the
	 * CPU's), by GW_ENDS_GAIN of the GPU's side's lateness (--balance-ends, the runner's default).
	 * ends_lag_s: where it starts (the window before's; gpu_window_stats.ends_lag_ms). */
	bool balance_ends;
	double ends_lag_s;
};

/* What a measure of a layer's ends moves the lag by (of the GPU's side's lateness; a smaller step
 * than the whole, as the measures of single layers scatter by the host's wakes), and the most the
 * lag may be either way (seconds; about two of MX2's layers). */
#define GW_ENDS_GAIN 0.25
#define GW_ENDS_MAX_S 1e-3

/* The link time (seconds) of an expert's copy from which GW_SPLIT_AUTO splits it: Mixtral-8x7B's
 * experts (99 MB in Q4_K, 352 in bf16: 1.9 and 6.6 ms at 53 GB/s), not Qwen3-30B-A3B's (9.4 MB in
 * bf16), whose layers of eight balance whole. */
#define GW_SPLIT_EXPERT_MIN_S 1e-3

enum gwin_state {
	GWIN_ABSENT = 0,
	GWIN_INFLIGHT = 1,
	GWIN_RESIDENT = 2,
	GWIN_RETIRING = 3,
};

/* The engine's calls into the window, timed each (gpu_window_stats.host_ms_op). */
enum gw_host_op {
	GW_OP_ACQUIRE = 0,
	GW_OP_RELEASE = 1,
	GW_OP_ROUTE = 2,
	GW_OP_SKIP = 3,
	GW_OP_ACQUIRE_HOST = 4,
	GW_HOST_OPS = 5,
};
/* Their names in the stats ("acquire", "release", "route", "skip", "acquire_host"). */
extern const char *const gw_host_op_names[GW_HOST_OPS];

struct gpu_window_stats {
	uint64_t resident_groups, streamed_groups;
	uint64_t resident_bytes;	 /* device bytes held for good */
	uint64_t window_bytes;		 /* device bytes of the streaming slots */
	uint64_t streamed_bytes_per_token; /* what crosses PCIe per token in decode */
	uint64_t bytes_h2d, copies;	 /* all time */
	uint64_t bytes_h2d_decode;	 /* of which copied during one-token steps */
	uint64_t late_copies;		 /* copies issued by an acquire rather than ahead of it */
	uint64_t experts_passed;	 /* streamed expert groups no token chose, not copied (all time) */
	uint64_t experts_cpu, experts_cpu_bytes; /* routed expert groups left to the CPU, and their bytes */
	uint64_t experts_guessed;	 /* streamed experts copied before their layer's route (predict_experts) */
	uint64_t guess_hits;		 /* of those, chosen by the route */
	uint64_t guess_missed;		 /* passed over before the route, then chosen: left to the CPU */
	uint64_t experts_split;		 /* routed experts split between the link and the CPU (split_experts) */
	uint64_t experts_split_cpu_bytes; /* of experts_cpu_bytes, the CPU's rows of split experts */
	uint64_t step_resets;		 /* failed steps settled before the next (weights.h, reset) */
	uint32_t pins_kept;		 /* ring mappings taken over pinned from the window before */
	uint32_t one_copy_groups;	 /* groups copied in one piece, laid out as in their host slot */
	double host_ms;			 /* the host's time in the engine's calls: acquire, release, skip,
					  * route, acquire_host (the loader's reads they wait for included) */
	double host_ms_op[GW_HOST_OPS];	 /* host_ms by call (enum gw_host_op) */
	uint64_t host_calls_op[GW_HOST_OPS];
	double host_ms_copy;		 /* of host_ms: issuing copies (their cudaMemcpyAsync and events) */
	double host_ms_poll;		 /* of host_ms: polling the copies in flight (cudaEventQuery) */
	uint32_t experts_resident;	 /* expert groups kept on the device for good (the plan's) */
	double expert_heat_resident;	 /* the share of the routing they take (window_plan.h) */
	uint32_t depth;
	uint32_t expert_depth;		 /* the streamed experts' slots (0: none streams) */
	double h2d_bytes_per_s;		 /* measured (or given) */
	double h2d_beside_cpu_bytes_per_s; /* measured beside the CPU's rates (split plan; 0: not) */
	bool spread;			 /* params.spread moved kept layer groups off the first layers */
	double copy_ms;			 /* with time_copies: device time spent copying, since reset */
	uint64_t timed_copies;
	double copy_ms_decode;		 /* of copy_ms: copies issued in one-token steps (the link's
					  * busy time in decode); since reset, as copy_ms (a request's
					  * decode start), where bytes_h2d_decode counts all time */
	uint64_t timed_copies_decode;
	double copy_wait_ms;		 /* with time_copies: the compute stream's time waiting for copies */
	uint64_t timed_waits;
	uint64_t waits;			 /* with time_copies: the waits timed (timed_waits once done) */
	uint32_t copy_streams;
	/* Split FFNs. */
	uint32_t split_groups;		 /* FFN groups computed with the CPU in decode */
	uint32_t split_r_min, split_r_max; /* their r (ffn_dim when none) */
	uint32_t split_max_tokens;	 /* steps of at most this many tokens give the CPU its share */
	double cpu_share;		 /* the share of the rows the plan aimed at */
	uint64_t cpu_bytes_per_token;	 /* weight bytes the CPU reads per decode token */
	uint64_t expert_cpu_bytes_per_token; /* of those, routed experts' (expected, as win_route splits) */
	double pcie_ms, cpu_ms;		 /* the plan's times per decode token: the copies, the CPU */
	double cpu_jobs_ms;		 /* of cpu_ms, the CPU's products alone (no handoffs) */
	double split_gaps_ms;		 /* the GPU's work between split FFNs that auto counted on the copies'
					  * side (split_gaps), per decode token; 0: none counted */
	bool rates_from_jobs;		 /* the plan took the rates of jobs that ran (cpu_share_policy), no calibration */
	double expert_rate_jobs;	 /* the rate a route weighs the CPU's experts with, from their spans (0: the
					  * calibration's, cpu_rate of the experts' format) */
	double expert_rate_jobs_multi;	 /* ... in steps of several tokens (0: expert_rate_jobs) */
	double expert_lead_ms;		 /* the lead of a layer's copies over its CPU experts the guesses count */
	/* How one-token layers whose route gave both sides work ended (route_ends_ns, the layer after
	 * measuring), all time: measured layers, the GPU's side's lateness summed where it ended last
	 * and the CPU's where it did; the lag the routes count now (balance_ends). */
	uint64_t ends_measured;
	double ends_gpu_late_ms, ends_cpu_late_ms;
	double ends_lag_ms;
	uint64_t refill_bytes;		 /* device bytes kept more with the memory the split frees (gw_split_refill) */
	bool split_balance_token;	 /* each layer's own share did not fit: one for every FFN (gw_split_fit) */
	uint64_t side_bytes;		 /* device bytes of the prefill copy of a split FFN's CPU rows */
	uint64_t side_copies, side_bytes_h2d; /* such copies (prefill steps) and their bytes, all time */
	uint64_t cpu_shares;		 /* FFNs handed over with a CPU share, all time */
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
/* The same, leaving the ring's mappings page-locked for the next window made in this process to
 * take over (the runner's window made anew between requests: pinning tens of GB again takes
 * seconds). What the next window does not map is unpinned when it is made. */
void gpu_window_destroy_keeping_pins(struct gpu_window **w);

struct weight_source *gpu_window_base(struct gpu_window *w);
void gpu_window_stats(struct gpu_window *w, struct gpu_window_stats *st);
/* For inspection: group g's state (enum gwin_state; GWIN_ABSENT for g out of range) and
 * whether it is held on the device for good (*resident, may be NULL). */
enum gwin_state gpu_window_group_state(const struct gpu_window *w, uint32_t g, bool *resident);
/* Starts a new period for copy timing (the benchmark calls it between prefill and decode). */
void gpu_window_reset_timing(struct gpu_window *w);
/* A line saying what the plan is and what it predicts per decode token. */
void gpu_window_describe(const struct gpu_window *w, char *buf, size_t len);
/* A mixture of experts: the share of heat ((n_layers, n_experts), window_plan.h) the experts kept now
 * take (*now), and the share a plan made with heat would keep (*planned); the runner re-plans
 * between requests when the gain is worth a new window. Returns 0 or -errno. */
int gpu_window_expert_gain(const struct gpu_window *w, const float *heat, double *now, double *planned);
/* r of group g's FFN split (backend.h, struct ffn_split); ffn_dim when it does not split. */
uint32_t gpu_window_split_r(const struct gpu_window *w, uint32_t g);
/* The CPU's product rate the plan measured for weight format f (bytes a second; 0: not measured). */
double gpu_window_cpu_rate(const struct gpu_window *w, enum dtype f);
/* Auto with experts on the CPU: the rate (bytes a second) the routes of one-token steps from now on
 * weigh the CPU's side of a layer with, as its experts' spans in such steps ran, the rate for steps
 * of several tokens (multi_bytes_per_s: each weight byte computed for every token; 0: the one-token
 * rate), and the time a layer in which copies run and the CPU's experts cannot (lead_s: the gaps
 * between layers' CPU experts), which the guesses give the copies more for (the runner's;
 * split_plan.h, expert_spans_rate and expert_spans_lead); 0 goes back to the calibration's rate, and
 * to no lead. The plan made at start and its prediction keep the calibration's rate. */
void gpu_window_set_expert_rate(struct gpu_window *w, double bytes_per_s, double multi_bytes_per_s, double lead_s);
/* The rate the routes of a step of `tokens` weigh the CPU's experts with now: the ones set above (a
 * step of several tokens the one-token rate where none is set for it), else the calibration's for
 * the experts' format (0: none measured). */
double gpu_window_expert_rate(const struct gpu_window *w, uint32_t tokens);

/* Checks every invariant of the state table; returns 0 or -EFAULT with err saying which broke. */
int gpu_window_check(const struct gpu_window *w, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif

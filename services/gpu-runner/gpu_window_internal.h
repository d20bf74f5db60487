/* gpu_window_internal.h - what the parts of the GPU window share (gpu_window.h is the public
 * side): the window's state and the split of streamed FFNs between the GPU and the CPU.
 *
 *   gpu_window.c        the window: plan, slots, copies ahead of compute, states, stats
 *   gpu_window_split.c  the split FFNs: the plan (split_plan.h) with the CPU's rates measured on
 *                       the ring, the device share's copies, the views handed to the engine, and
 *                       the prefill copy of the CPU's rows
 * C over the CUDA runtime API. */
#ifndef GPU_RUNNER_GPU_WINDOW_INTERNAL_H
#define GPU_RUNNER_GPU_WINDOW_INTERNAL_H
#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stdint.h>

#include "services/gpu-runner/gpu_window.h"
#include "services/gpu-runner/split_plan.h"

#define NO_SLOT UINT32_MAX
#define NO_GROUP UINT32_MAX
#define NO_SPAN UINT64_MAX
/* Ring mappings page-locked at once: the current one and those of loaders that went away whose
 * copies are still in flight (weights_ring.c keeps at most 8 of those). */
#define PINNED_MAX 16

struct gslot {
	uint32_t group;		   /* occupant, NO_GROUP */
	uint32_t size_class;
	void *dev;		   /* device memory of the slot */
	cudaEvent_t compute_done;  /* recorded on the compute stream when the occupant is released */
	bool compute_recorded;	   /* compute_done has been recorded at least once */
};

struct gent {
	uint8_t state;	   /* enum gwin_state */
	bool resident;	   /* held for good */
	bool in_use;	   /* acquired by the engine, not yet released */
	bool host_held;	   /* a ring grant held for a copy whose completion is not yet seen */
	uint32_t host_gen; /* with host_held: the ring mapping the copy reads (ring_source_generation) */
	uint32_t slot;	   /* streaming slot, NO_SLOT */
	void *dev;	   /* device base of the group's bytes, NULL when not on the device */
	cudaEvent_t h2d;   /* recorded on the copy stream after the group's copy */
	bool unused;	   /* an expert group its layer's routing did not choose this step (route) */
	bool passed;	   /* counted as issued without a copy (unused): skip consumes it */
	bool on_cpu;	   /* an expert group the route left in host memory for the CPU this step */
	bool guessed;	   /* issued before its layer's route on the guess the previous step's routing
			    * left (copied if the guess has it, else passed over), until the route
			    * (--predict-experts) */
	bool guessed_in;   /* of a guess: copied, the guess (guess_next) has it */
};

/* With time_copies: timing pairs, an event before and after each timed span (a copy on its copy
 * stream, the compute stream's wait for one), in a ring of GW_TIMES. A pair is added to the stats
 * once its second event is done; one whose turn comes again is waited for, not dropped (the host
 * issues a slot's next copy before its last is done, and a one-token step of 32 layers waits up to
 * 64 times, an MoE step more: with a pair a slot and a ring of 64 waits, most copies and many waits
 * went uncounted). GW_TIMES spans several steps, and the host never runs more than a step or so
 * ahead of the streams, so a pair's turn comes long after its span has ended. */
#define GW_TIMES 256
struct gw_times {
	cudaEvent_t ev[GW_TIMES][2];
	bool timed[GW_TIMES];  /* ev[i] holds a span not yet added to the stats */
	bool decode[GW_TIMES]; /* ... issued in a one-token step (copies: copy_ms_decode too) */
	uint32_t next;
};

struct gpu_window {
	struct weight_source base; /* first: the engine's view */
	struct ring_source *ring;
	struct weight_source *rs;
	cudaStream_t compute, copy; /* copy: the first of the copy streams (start-up work) */
	cudaStream_t copies[4];
	uint32_t n_copies;
	void *pinned[PINNED_MAX];  /* ring mappings registered with cudaHostRegister */
	size_t pinned_len[PINNED_MAX]; /* their lengths */
	uint32_t n_pinned;
	void *resident_mem;	   /* one allocation for every resident group */
	void *window_mem;	   /* one allocation for the streaming slots */
	struct gent *g;		   /* n_groups */
	struct gslot *slots;
	uint32_t n_slots;
	uint32_t depth[CLASS_COUNT];
	uint32_t xdepth; /* the experts' class's slots as planned (depth[CLASS_EXPERT] up to it) */
	uint32_t first_slot[CLASS_COUNT];
	uint32_t *order[CLASS_COUNT]; /* streamed groups of a class in visit order */
	uint32_t m[CLASS_COUNT];
	uint64_t issued[CLASS_COUNT], consumed[CLASS_COUNT];
	uint64_t copied[CLASS_COUNT];	      /* issued with a copy: copy k goes into slot k % depth */
	uint64_t passed_pending[CLASS_COUNT]; /* issued without a copy, not yet consumed */
	/* Routed experts (route/skip): once the engine routes, an expert group is issued only when its
	 * layer's routing is known (routed_layer), and passed over without a copy when unused. */
	bool routing;
	uint32_t routed_layer;
	uint64_t route_pos;	   /* consumed[CLASS_EXPERT] when routed_layer was routed: its routing holds
				    * for issue positions route_pos .. route_pos + m - 1 only (this step's) */
	bool copies_due;	   /* a decode route that split experts left its copies to the engine's next
				    * call (after it handed the CPU's shares to the pool: share_host), which
				    * issues them; gw_top_up clears it */
	uint32_t *expert0;	   /* n_layers: the layer's first expert group (NO_GROUP: none), on first route */
	bool *fetch;		   /* n_experts: the experts a route asks of the ring together (win_route) */
	bool predict;		   /* --predict-experts: a later layer's experts issued on its last routing */
	enum gw_split_experts split_experts; /* which chosen experts a route may split with the CPU */
	uint64_t op_ns[GW_HOST_OPS], op_calls[GW_HOST_OPS]; /* the host's time in the engine's calls, by
							     * call (window_ops' timed_*) */
	uint64_t copy_ns, poll_ns; /* of it: issuing copies, polling those in flight */
	bool early_grants;	   /* a pinned group's grant went back while its copy ran (let_go_copy):
				    * the copy streams are waited for before a ring mapping is let go */
	uint32_t *inflight;	   /* (n_groups) the groups whose state is INFLIGHT, in no order (set_state) */
	uint32_t n_inflight;
	bool *guess_set;	   /* (n_layers, n_experts): what each layer's next decode step copies before
				    * its route, from its last decode routing (guess_next; predict) */
	bool *last_known;	   /* n_layers: a decode routing of the layer has been seen (predict) */
	double guess_carry;	   /* bytes the last layer guessed took less than its share (more: < 0) */
	bool balance_ends;	   /* params.balance_ends: the routes learn ends_lag_s */
	double ends_lag_s;	   /* the time a route counts the link's side as started late (< 0: the
				    * CPU's): gw_route, ends_learn */
	bool ends_cpu;		   /* the last route (of layer ends_layer, a one-token step's) gave the
				    * CPU work: the next layer's route_ends_ns measures its balance */
	uint32_t ends_layer;	   /* UINT32_MAX: none */
	struct cpu_share_policy moe_policy; /* which routed experts the CPU computes (mode off: none) */
	uint32_t moe_format;	   /* the experts' matrix format (gate's), whose CPU rate auto weighs */
	bool host_reads;	   /* acquire_host handed out ring pointers the backend may still read (until
				    * the next route or release_all): no ring mapping is let go meanwhile */
	bool strict, time_copies;
	struct gw_times wait_times; /* with time_copies: the compute stream's waits for copies */
	struct gw_times copy_times; /* with time_copies: the copies, on their copy streams */
	struct gpu_window_stats st;
	uint32_t embed_group, head_group;
	bool tied;
	bool heat_known;	   /* the expert plan had routing counts (gpu_window_params.expert_heat) */
	/* Device layout: each tensor at a 256-byte boundary (the kernels' vector loads need 16,
	 * and a checkpoint guarantees only 8), so a group's device bytes differ from its slot. */
	uint64_t *dev_off;   /* n_tensors: offset of the tensor in its group's device memory */
	uint64_t *dev_bytes; /* n_groups */
	uint64_t *copy_bytes; /* n_groups: what a copy of the group moves (a split FFN: its device share) */
	uint64_t *span_base;  /* n_groups: where the group's one copy starts in its host slot (its tensors
			       * then lie on the device as in the slot, less that), NO_SPAN: a copy each */
	struct group_desc *plan_groups; /* n_groups: the groups as the plan saw them (slot_bytes: dev_bytes
					 * before any FFN split), for a plan made again (expert_gain) */
	uint64_t budget;      /* --gpu-budget the plan had */

	/* Split FFNs (gpu_window_split.c). */
	uint32_t *split_r;	   /* n_groups: r of a split FFN group, or of an expert group its route split
				    * this step (gw_route); ffn_dim for every other group */
	uint32_t *split_r_layer;   /* n_layers: the plan's r per layer */
	struct split_plan plan;	   /* plan.r is split_r_layer */
	double cpu_rate[DT_COUNT]; /* the CPU's measured product rates (auto) */
	uint32_t calibrations;	   /* times gw_split_plan measured the CPU (split_calibrate) */
	void *side_mem;		   /* the CPU rows of one split FFN, for a prefill step */
	uint64_t *side_off;	   /* n_tensors: offset of a split FFN tensor's rest in side_mem */
	cudaStream_t side_stream;  /* their copies */
	uint32_t side_group;	   /* whose rows side_mem holds (or is receiving), NO_GROUP */
	uint32_t side_user;	   /* the group computing from side_mem now, NO_GROUP */
	cudaEvent_t side_h2d;	   /* after the last copy into side_mem */
	cudaEvent_t side_done;	   /* on the compute stream after the last group that read side_mem */
	bool side_recorded;	   /* side_done has been recorded */
	cudaEvent_t cpu_done;	   /* on the compute stream after the last FFN whose CPU share read the ring */
	bool cpu_recorded;
};

#define DEV_ALIGN 256u


/* ---- gpu_window_split.c ---- */

/* What a copy of tensor ti of group g takes from the group's host slot: height rows of width bytes,
 * spitch apart, from src_off. rest false: what goes to the group's device memory (all of a tensor,
 * or the first share of a split FFN's matrices); true: the second share of a split FFN's matrices
 * (width 0 for every other tensor). */
struct gw_piece {
	uint64_t src_off, width, height, spitch;
};
struct gw_piece gw_piece(const struct gpu_window *w, uint32_t g, uint32_t ti, bool rest);
/* Queues the copies of group g's pieces (rest as gw_piece) from host (its slot) to dev, tensor ti
 * at off[ti], on s. Returns 0 or -EIO with the message in w->base.error. */
int gw_copy_pieces(struct gpu_window *w, uint32_t g, bool rest, void *dev, const uint64_t *off, const void *host,
		   cudaStream_t s);
/* copies H2D copies of GW_H2D_CHUNK bytes from pinned memory, queued on s and timed with events
 * (gw_h2d_start), then waited for (gw_h2d_finish): the H2D rate alone at start. Beside the CPU's
 * measurement (gw_split_plan) the copies read the weight ring's own pinned slots, n pieces of
 * len[i] bytes (at most GW_H2D_CHUNK each) at src[i] (gw_h2d_start_from), as decode's copies do: a
 * 64 MiB buffer copied over and over sits partly in the CPU's last-level cache, where the DMA
 * reads it without loading DRAM, and the CPU measured faster beside it than beside decode's
 * copies. */
#define GW_H2D_CHUNK ((size_t)64 << 20)
struct gw_h2d {
	void *host, *dev; /* host: gw_h2d_start's own buffer (NULL from the ring) */
	cudaEvent_t a, b;
	uint64_t bytes;
};
/* Queue the copies; false (nothing queued, nothing held) when memory or a call fails. */
bool gw_h2d_start(cudaStream_t s, uint32_t copies, struct gw_h2d *h);
bool gw_h2d_start_from(cudaStream_t s, const void *const *src, const size_t *len, uint32_t n, struct gw_h2d *h);
/* Whether [p, p + len) lies in a ring mapping registered with CUDA (pinned: copies from it are
 * asynchronous). */
bool gw_registered(const struct gpu_window *w, const void *p, size_t len);
/* Waits for the copies; their rate in bytes/s (0 when it cannot be read), and frees what start took. */
double gw_h2d_finish(struct gw_h2d *h);
/* The pinned H2D rate alone on the window's copy stream: four copies to warm up, four timed.
 * Returns 0, or -ENOMEM / -EIO with the message in w->base.error. */
int gw_measure_h2d(struct gpu_window *w, double *bps);
/* Plans the split once the resident groups are known (resident[g]) and the H2D rate measured:
 * which streamed FFNs split and where (w->split_r, w->plan), with the CPU's rates measured on
 * p->cpu_pool for auto. Sets every split_r to ffn_dim when nothing splits. Returns 0 or -errno with
 * err set. */
int gw_split_plan(struct gpu_window *w, const bool *resident, const struct gpu_window_params *p, char *err,
		  size_t errlen);
/* Once the split is planned and laid out: the memory its smaller slots free (the residency plan
 * counted streamed FFNs whole) kept by more resident groups. The residency is planned again under
 * the budget raised by that much, the split again with the rates just measured, and the new plan
 * kept where it fits --gpu-budget with its prefill buffer and predicts a faster token; else the
 * first is restored. Dense models only (experts' residency follows their heat). resident is
 * updated; spread: window_plan_spread applies. Returns 0 or -errno with err set. */
int gw_split_refill(struct gpu_window *w, bool *resident, const struct gpu_window_params *p, uint32_t depth,
		    bool spread, char *err, size_t errlen);
/* After gw_split_refill: the plan's device bytes (resident groups, slots, prefill buffer) within
 * --gpu-budget. Each layer's own share (--cpu-share-balance layer) sizes the slots by the largest
 * GPU share and the prefill buffer by the largest CPU share, which together may pass what the
 * unsplit FFN slots took; then one share for every FFN (whose slots and buffer never pass them), and
 * where even that does not fit, nothing splits (the caller lays out again). Returns 0 or -errno. */
int gw_split_fit(struct gpu_window *w, const bool *resident, const struct gpu_window_params *p, uint32_t depth,
		 char *err, size_t errlen);
/* The device layout of every group as the split stands (dev_off, dev_bytes, copy_bytes). */
void gw_layout(struct gpu_window *w);
/* The slots size class c streams through at most: depth for a layer class, xdepth for the experts. */
static inline uint32_t gw_class_depth(const struct gpu_window *w, uint32_t depth, uint32_t c)
{
	return c == CLASS_EXPERT ? w->xdepth : depth;
}
/* Device bytes the streaming slots take: per size class, gw_class_depth slots (fewer if fewer
 * groups stream) of its largest streamed group, as laid out now (whole: the plan table's whole group sizes).
 * resident: the groups a plan keeps (the embedding is read on the host); NULL: the window's own. */
uint64_t gw_slot_bytes(const struct gpu_window *w, const bool *resident, uint32_t depth, bool whole);
/* The device memory, stream and events of the prefill copy, sized for the split groups (after
 * gw_split_plan). Returns 0 or -errno with err set. */
int gw_split_create(struct gpu_window *w, char *err, size_t errlen);
void gw_split_destroy(struct gpu_window *w);
/* Group g was filled with whole tensors at its device memory: for a split FFN, the first share's
 * shapes, and the second share: host memory in place for a decode step (steps of at most
 * plan.max_tokens tokens: FFN_SPLIT_CPU), else its copy in side_mem (FFN_SPLIT_BACKEND; the copy
 * issued now if it was not ahead, and the compute stream made to wait for it). Returns 0 or -EIO. */
int gw_split_fill(struct gpu_window *w, uint32_t g, struct group_weights *gw);
/* Is expert group g split between the link and the CPU this step (gw_route set split_r[g] below
 * the experts' intermediate rows)? Its copy takes only the GPU's rows (gw_piece). */
bool gw_expert_split(const struct gpu_window *w, uint32_t g);
/* split_r of group g whole: its intermediate rows (an expert's expert_ffn_dim, else ffn_dim). */
static inline uint32_t gw_whole_r(const struct gpu_window *w, uint32_t g)
{
	return w->base.groups[g].kind == GROUP_EXPERT ? w->base.cfg->expert_ffn_dim : w->base.cfg->ffn_dim;
}
/* The bytes a copy of group g moves now: copy_bytes, or a split expert's pieces. */
uint64_t gw_copy_bytes(const struct gpu_window *w, uint32_t g);
/* Group g was computed: what read the ring or side_mem is recorded; in a prefill step the next split
 * FFN's rows start copying into side_mem. Returns 0 or -EIO. */
int gw_split_release(struct gpu_window *w, uint32_t g);
/* Might the CPU share or a prefill copy still read a ring mapping (so a retired one stays mapped)? */
bool gw_split_reads_ring(const struct gpu_window *w);
/* What the split plan is, appended to gpu_window_describe's line ("" when nothing splits). */
void gw_split_describe(const struct gpu_window *w, char *buf, size_t len);

/* gpu_window.c's machinery the experts' operations use: copies done handed back (grants, slots),
 * the next copies issued while slots are free, and the state table checked where strict. Each
 * returns 0 or -errno with the message in w->base.error. */
int gw_poll_copies(struct gpu_window *w);
int gw_top_up(struct gpu_window *w);
int gw_strict_check(struct gpu_window *w);
/* A GWIN_ state's name, for messages. */
const char *gw_state_name(uint8_t s);
/* The engine's calls (acquire, release, skip, route, ...): the window's weight_source_ops
 * (gpu_window.c, for gpu_window_create.c). */
extern const struct weight_source_ops gw_window_ops;
/* Unmaps the rings of loaders that went away once no copy of ours reads one. */
void gw_trim_retired(struct gpu_window *w);
/* gpu_window_experts.c: weight_source's route, skip and acquire_host (weights.h). */
int gw_route(struct weight_source *ws, uint32_t layer, const bool *used, bool *on_cpu);
int gw_skip(struct weight_source *ws, uint32_t group);
int gw_acquire_host(struct weight_source *ws, uint32_t group, struct group_weights *gw);
/* gpu_window_split.c: weight_source's share_host (weights.h), the CPU's share of a split expert. */
int gw_share_host(struct weight_source *ws, uint32_t group, struct ffn_split *share);
/* Whether issue may guess the experts of `layer` (not routed yet this step) from its last routing:
 * --predict-experts, a decode step, that routing seen, and the CPU there for an expert guessed out
 * but then chosen (its visit has gone by: the route leaves it in DRAM for the CPU). */
bool gw_may_guess(const struct gpu_window *w, uint32_t layer);

#endif

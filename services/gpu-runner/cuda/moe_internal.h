/* moe_internal.h - the CUDA backend's mixture-of-experts state, shared by moe.cu (the route, the
 * GPU's experts, the end of a layer) and moe_cpu.cu (the experts the CPU pool computes). */
#ifndef GPU_RUNNER_CUDA_MOE_INTERNAL_H
#define GPU_RUNNER_CUDA_MOE_INTERNAL_H
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cpu-compute/ffn_share.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"

#include <cuda.h>
#include <cudaTypedefs.h>

/* An expert noted for the CPU: its matrices in host memory. */
struct moe_cpu_expert {
	uint32_t expert;
	float w;	/* one token's routing weight of it (gpu_wait) */
	struct ffn_share_mat gate, up, down;
};

#define MOE_CPU_JOBS_MAX BACKEND_MOE_CPU_JOBS /* experts the pool computes at once */
#define MOE_WIDE_BYTES_MAX (128u << 20) /* a prefill chunk's routed rows and their outputs at most (cuda_moe.xa) */
#define MOE_COMBINE_MAX 32 /* experts a token chooses that combine_kernel sums in one launch */

/* combine_kernel's weights, by value: the GPU's rows' (w), and the CPU's rows in mapped host
 * memory with theirs (cpu_y, cpu_w; n_cpu of them, summed first). */
struct moe_combine_w {
	float w[MOE_COMBINE_MAX];
	const float *cpu_y[MOE_CPU_JOBS_MAX];
	float cpu_w[MOE_CPU_JOBS_MAX];
	uint32_t n_cpu;
};

/* A job's completion word and its sleepers, on a cache line of their own (in mapped pinned memory
 * where the stream waits on them). */
struct moe_word {
	uint32_t done, waiters;
	uint32_t pad[14];
};

/* One of the concurrent CPU jobs: an expert's rows in, its output out. */
struct moe_cpu_job {
	struct ffn_share *share;
	struct ffn_share_job job;
	struct task_job tj;		/* the pool's job */
	float *x, *y;			/* (FFN_SPLIT_MAX_TOKENS, dim); y in mapped pinned memory with gpu_waits */
	const float *y_dev;		/* y as the device addresses it (gpu_waits) */
	uint32_t *done, *waiters, seq;	/* the job's completion word, its sleepers (in words), the last value */
	CUdeviceptr done_dev;		/* done as the stream addresses it (gpu_waits) */
	uint64_t end_ns;		/* when it ended (job_ended; read once done shows seq) */
	uint32_t per;			/* the threads share's parts were cut for (ffn_share_threads_for) */
	bool fail;			/* cuda_test_fail_cpu_expert: the job's first part fails */
};

/* The events that time a step's start on the GPU's clock (cuda_moe.begin_ev), in their order. */
enum { MOE_EV_RET, MOE_EV_EMBED, MOE_EV_ROUTER, MOE_EV_ROUTED, MOE_BEGIN_EVENTS };

struct cuda_moe {
	uint32_t E, k, F;	/* experts, chosen per token, an expert's intermediate size */
	/* Device memory. */
	float *xn;		/* (max_chunk, dim) the normed rows in float32 */
	float *logits;		/* (max_chunk, E) router logits */
	float *router_f;	/* (E, dim) a block-format router dequantized */
	float *sum;		/* (max_chunk, dim) the layer's weighted sum of expert outputs */
	void *xg;		/* (max_chunk, dim) an expert's gathered rows in its activation dtype */
	float *gu;		/* (max_chunk, 2 F) gate then up (the unfused paths) */
	void *act;		/* (max_chunk, F) SiLU(gate) * up in the activation dtype */
	float *y;		/* (max_chunk, dim) down_proj of an expert's rows */
	float *ys;		/* (k, dim) one token: each GPU expert's down_proj row, in the order given */
	uint32_t *tok0;		/* (1) 0: one token's gather index */
	uint32_t *tok;		/* (max_chunk k) tokens of each expert, expert after expert (off[]) */
	float *tw;		/* (max_chunk k) their weights */
	/* A chunk of more than FFN_SPLIT_MAX_TOKENS tokens (a prefill chunk or a step of more sequences;
	 * no CPU experts then; not with --experts-apart), where wide_rows holds its n k routed rows
	 * (wide_rows 0: max_chunk at most FFN_SPLIT_MAX_TOKENS, or the buffers would pass
	 * MOE_WIDE_BYTES_MAX): every row gathered once a layer into xa (expert after expert, as
	 * tok), each expert's down_proj rows into ya at their place, and one combine at moe_end sums
	 * each token's rows in its experts' order (pos) into the residual stream, as the per-expert
	 * scatters into a cleared sum and the add did. */
	void *xa;		/* (wide_rows, dim) the routed rows in the activation dtype xa_at */
	float *ya;		/* (wide_rows, dim) their experts' down_proj rows */
	uint32_t *pos;		/* (wide_rows) token t's rows are pos[t k .. t k + k), in expert order */
	uint32_t wide_rows;	/* 0: none allocated (too large); else max_chunk k */
	bool wide;		/* this chunk takes that path */
	bool xa_ok;		/* xa holds this layer's rows in dtype xa_at */
	uint32_t xa_at;
	uint32_t wide_done;	/* rows whose experts have been computed this layer */
	/* Host memory. */
	float *h_logits;	/* (max_chunk, E) pinned, mapped */
	float *h_logits_dev;	/* h_logits as the device addresses it (NULL: not mapped, copied down) */
	uint32_t *sel;		/* (max_chunk, k) each token's experts */
	float *sel_w;		/* (max_chunk, k) and weights */
	uint32_t *off;		/* (E + 1) expert e's tokens are [off[e], off[e + 1]) of tok/tw */
	uint32_t *h_tok;	/* (max_chunk k) */
	float *h_tw;
	bool routed;		/* route ran for the chunk in flight */
	/* One token (route: n == 1, k <= MOE_COMBINE_MAX): its row in xg once, rows into ys. */
	bool one;
	bool xg_ok;		/* xg holds the token's row in dtype xg_at */
	uint32_t xg_at;
	uint32_t n_gpu;		/* experts computed into ys */
	float yw[MOE_COMBINE_MAX]; /* their routing weights */
	size_t act_stride;	/* bytes from one of the token's experts' act rows to the next (16-byte multiple) */
	/* One token: experts the window keeps (group_weights.resident), noted in moe_expert and
	 * launched together (experts_batch) at moe_end, when GEMV_MATS are noted, or before xg changes. */
	struct mm_expert held[GEMV_MATS];
	uint32_t n_held;
	/* Experts on the CPU (backend_params.cpu_pool): up to n_jobs at once, each an ffn_share job of
	 * its own (scratch, rows, output) on a slice of the pool's threads. */
	struct moe_cpu_job *jobs;	/* (n_jobs) */
	uint32_t n_jobs;
	float *h_xn;			/* (FFN_SPLIT_MAX_TOKENS, dim) pinned, mapped: xn of a decode step */
	float *h_xn_dev;		/* h_xn as the device addresses it (NULL: not mapped, copied down) */
	bool xn_down;			/* h_xn holds this chunk's rows */
	float *csum;			/* (FFN_SPLIT_MAX_TOKENS, dim) the CPU's sum */
	float *csum_dev;		/* (FFN_SPLIT_MAX_TOKENS, dim) the CPU's sum, device memory */
	struct moe_cpu_expert *cpu;	/* (E) the experts noted for the CPU this layer, in order */
	uint32_t n_cpu;			/* noted (and submitted) */
	uint32_t collected;		/* of which waited for and added into csum */
	struct moe_word *words;		/* (n_jobs) the jobs' completion words: pinned, mapped with gpu_waits */
	bool gpu_waits;			/* one token's CPU experts may be waited for on the GPU (setup) */
	bool gpu_wait;			/* this layer's are (route: one token and gpu_waits) */
	uint32_t n_waited;		/* jobs of the last such layer, slots 0.., whose results moe_check reads */
	float *ybuf;			/* (n_jobs, FFN_SPLIT_MAX_TOKENS, dim) the jobs' y, mapped (gpu_waits) */
	PFN_cuStreamWaitValue32_v11070 wait32;
	uint64_t cpu_experts, cpu_ns, route_wait_ns; /* experts the CPU computed, and the host's times (all time) */
	uint64_t route_wait_step_ns; /* ... of route_wait_ns, in steps of at most FFN_SPLIT_MAX_TOKENS tokens */
	uint64_t layer_t0, waited_t0;	/* when this layer's first CPU expert was submitted; the waited layer's */
	uint64_t layer_bytes, waited_bytes; /* the weight bytes of this layer's CPU experts; the waited layer's */
	uint32_t layer_n, waited_n;	/* the tokens of the step of each */
	uint64_t span_ns, span_layers;	/* one-token steps' layers' CPU experts, first submission to last end,
					 * summed (all time) */
	uint64_t span_bytes;		/* the weight bytes of those layers' CPU experts */
	/* The same in steps of several tokens, apart: each weight byte is computed for every token (MX2:
	 * the remainder of a prompt the kv-store restored, 16 tokens, ran at 48-64 GB/s of weights where
	 * one-token steps ran at 93-97), and the routes weigh each kind at its own rate. */
	uint64_t span_ns_multi, span_layers_multi, span_bytes_multi;
	uint32_t pool_threads;		/* the CPU pool's workers */
	uint64_t wait_ns_gone;		/* the phase waits of the jobs' shares made anew (ffn_share_stats) */
	/* The gaps between layers' CPU experts (backend_cpu_share_stats): the end of the last layer's
	 * last job (0: none, or not in this step), the return of this layer's wait for its routing and
	 * the gap to it, until the layer's first submission counts both. */
	uint64_t last_end_ns, route_t1, gap_pending_ns;
	uint64_t gap_gpu_ns, gap_host_ns, gaps;
	/* ... and across a step's end: the end of the last step's last layer's last job (0: none, or a
	 * failed step), the gap to the next step's first routing, and the gaps counted so. */
	uint64_t step_end_ns, step_pending_ns;
	uint64_t step_gap_ns, step_gaps;
	/* ... of which from that end to the step's return (moe_check_step, once the host has the step's
	 * output): the last layer's GPU work after its CPU experts, the head and the pick. */
	uint64_t step_ret_ns, step_tail_pending_ns, step_tail_ns;
	/* ... and after the return, the first routing of a step of at most FFN_SPLIT_MAX_TOKENS tokens
	 * (the steps the CPU takes experts in) after such a step, within MOE_STEP_GAP_MAX_MS: the
	 * host's time from that return to the router's launch (the host between the steps, the
	 * embedding, the first attention's launches) and its wait for the logits, summed over the
	 * begins counted; and on the GPU's clock, from events on the compute stream: at the return
	 * (MOE_EV_RET; where the host waited for the step's output, as in every decode step, the stream is
	 * idle then), after the embedding, before the router's first kernel and after its last.
	 * begin: 1 once MOE_EV_RET is recorded (at the return of a step of at most FFN_SPLIT_MAX_TOKENS), 2
	 * once MOE_EV_EMBED is (0: this step's start not timed). begin_gpu_ms[i]: from event i to i + 1. */
	uint64_t begin_host_ns, begin_wait_ns, begins;
	uint32_t begin;
	/* A step whose first MoE layer routes on the device (moe_layer: every expert of it kept): its
	 * router timed there, the times read at the step's end (moe_check_step), when the stream is
	 * idle; the host's time from the return to that router's launch, kept until then. */
	bool begin_dev;
	uint64_t begin_dev_host_ns;
	cudaEvent_t begin_ev[MOE_BEGIN_EVENTS];
	double begin_gpu_ms[MOE_BEGIN_EVENTS - 1];
	/* How a one-token layer's two sides ended (backend_moe_ends), measured at the next routing:
	 * ends_ev on the stream once a layer's GPU experts are computed (moe_end, before the stream's
	 * waits for its CPU experts), routed_ev after the next layer's router. The GPU's side ended at
	 * that routing's return on the host's clock (route_sync_ns, the stream idle then) less the
	 * time between the two events; the CPU's at its last job's end (last_end_ns). */
	cudaEvent_t ends_ev, routed_ev;
	bool ends_marked, routed_marked;
	uint64_t route_sync_ns;
	int ends_known;			/* 1: ends_ns holds this routing's measure */
	int64_t ends_ns;		/* the GPU's side's end less the CPU's */
	uint32_t fail_in;		/* cuda_test_fail_cpu_expert: the CPU jobs to go until one fails (0: none) */
	/* Layers routed on the device (moe_device.cu): NULL until the first experts' table. */
	struct moe_dev *dev;
	uint64_t dev_layers;		/* layers moe_layer computed (all time) */
};

/* ---- moe_cpu.cu: a step's start timed (begin above) ---- */

/* At a step's first routing (t_in: its start on the host's clock; cond: the step may be timed):
 * whether its start is timed (the events up to the embedding recorded, the step before returned
 * within MOE_STEP_GAP_MAX_MS), MOE_EV_ROUTER then recorded. Ends the step's begin either way. */
bool moe_begin_timed(struct backend_dev *be, uint64_t t_in, bool cond);
/* Once the stream has passed MOE_EV_ROUTED: the start's times added to the statistics (host_ns
 * from the return to the router's launch, wait_ns the host's wait for the logits); false, the
 * error cleared, where an event's time could not be read. */
bool moe_begin_count(struct cuda_moe *m, uint64_t host_ns, uint64_t wait_ns);

/* ---- moe.cu ---- */

/* The router rw as router_kernel takes it: its own rows (an element format, packed) or a block
 * format's dequantized to float32 into router_f; -ENOTSUP for rows with gaps. */
int moe_router_matrix(struct backend_dev *be, const struct weight_tensor *rw, const void **rmat, uint32_t *rt);

/* One warp per (token, expert): out[t][e] = sum_d xn[t][d] w[e][d] in float32. early: w is the
 * model's own matrix (no kernel of the step writes it; not moe_router_matrix's dequantized copy),
 * and its first values are loaded before the wait for the kernel before. */
__global__ void router_kernel(const float *xn, const void *w, uint32_t wt, uint32_t dim, uint32_t E, uint32_t n,
			      float *out, bool early);
/* One token: x += the sum of its experts' rows ys weighted by w.w (or wd, device memory), with the
 * CPU's rows of w first (moe.cu). */
__global__ void combine_kernel(float *x, const float *ys, uint32_t cnt, uint32_t dim, const moe_combine_w w,
			       const float *wd);

/* Bytes from one of a token's experts' SwiGLU rows (F values) to the next: a row of any activation
 * dtype, 16-byte aligned (the products' x). */
static inline size_t moe_act_stride(uint32_t F)
{
	return ((size_t)F * sizeof(float) + 15) / 16 * 16;
}

/* Pinned host memory of `bytes` at *host, mapped for the device at *dev where the device can (NULL
 * there else: the caller copies down instead). */
int moe_host_mapped(struct backend_dev *be, size_t bytes, void **host, void **dev, const char *what);

/* ---- moe_cpu.cu ---- */

/* The CPU's jobs of moe_setup (nothing without backend_params.cpu_pool), and their teardown (the
 * stream synchronized first). */
int moe_cpu_setup(struct backend_dev *be);
void moe_cpu_teardown(struct backend_dev *be);
/* Every job submitted and not yet collected waited for, and those the stream waits for. */
void moe_settle_jobs(struct cuda_moe *m);
/* A route's wait for its logits has returned (and moe_check has run): the gap since the layer
 * before's CPU experts ended, until this layer's first submission. */
void moe_cpu_routed(struct cuda_moe *m);
/* The CPU's side of moe_end: one token's experts waited for on the stream (their rows and weights
 * into cw for combine_kernel), or collected by the host and their sum added into the residual. */
int moe_cpu_end(struct backend_dev *be, moe_combine_w *cw);
/* The CPU experts' part of backend_cpu_share_stats. */
void moe_cpu_stats(const struct cuda_moe *m, struct backend_cpu_share_stats *out);

/* ---- moe_device.cu ---- */

/* Frees the device routing's state (moe_teardown). */
void moe_dev_teardown(struct backend_dev *be);
/* A step's end (moe_check_step): waits for the layers routed on the device and fails where a
 * router logit was not finite. */
int moe_dev_check(struct backend_dev *be);

#endif

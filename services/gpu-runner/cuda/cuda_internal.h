/* cuda_internal.h - what the files of the CUDA backend share: the device state, the error
 * helpers, the argument blocks of the kernels and the host-side launchers, one per kernel
 * family. Included by the .cu files of this folder only.
 *
 *   backend_cuda.cu   the operations of a forward step, create and destroy
 *   staging.cu        the pinned upload ring (token rows, KV destinations, spans)
 *   matmul.cu         matrix products: cuBLAS GEMM, and the GEMV kernel for one token (gemv.cu);
 *                     block-quantized weights: the fused GEMV of a few tokens (gemv_quant.cu), or
 *                     rows dequantized to BF16 (dequant.cu) and cuBLAS, a row chunk at a time
 *   gemv_quant.cu     decode products reading GGUF blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) in place: x as
 *                     float32 for a few tokens, and the launch of every such product
 *   gemv_dp4a.cu      the one-token integer path (x as int8, __dp4a; kernels in gemv_dp4a.cuh): Q4_K,
 *                     Q6_K, Q8_0, which products take it, its grids, two formats in one launch
 *   gemv_quant.cuh    what both share: the formats' lane geometry, a warp's rows, the row's end
 *   dequant.cu        GGUF blocks to BF16 (prefill's scratch) or float32 (embedding rows)
 *   quant.cuh         device reads and exact dequantization of the block formats
 *   norm_rope.cu      embedding widening, RMSNorm, RoPE and the KV row writes, SiLU * up
 *   attention.cu      attention over KV spans: the kernel and key splits of a call, span lists,
 *                     several sequences' decode in one launch, attn_end's output
 *   attention_fp32.cu attention of few queries on the CUDA cores in float32 (decode), the split merge
 *   attention_mma.cu  prefill attention on the tensor cores (BF16 KV)
 *   sampling.cu       argmax and the sampler on the device
 *   kv_copy.cu        KV arena copies to and from host memory, write-behind and read-ahead streams
 *   ffn_split.cu      a split FFN: the shares on the GPU, the CPU's share handed to the task pool
 */
#ifndef GPU_RUNNER_CUDA_INTERNAL_H
#define GPU_RUNNER_CUDA_INTERNAL_H
#include "services/gpu-runner/backend_impl.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CUDA_ERR_MAX 400
#define ATTN_TILE 32		/* keys staged in shared memory at a time: one per lane */
#define ATTN_MAX_WARPS 16	/* queries (warps) per attention block */
#define ATTN_MAX_SPLITS 64	/* key-range splits of one attn_blocks call */
#define ATTN_BLOCKS_PER_SM 4	/* splitting the keys aims at this many blocks per multiprocessor */
#define ATTN_MERGE_COUNTERS 1024 /* split attention merged by its last block up to this many block columns */
#define MMA_ROWS 64		/* tensor-core attention: queries per block, 16 per warp */
#define MMA_KEYS 64		/* tensor-core attention: keys per staged tile */
#define MAX_HEAD_DIM 256	/* per-lane accumulators: 2 dims per lane per 64 */
#define GEMV_WARPS 8		/* warps per GEMV block */
#define GEMV_UNROLL 4		/* 16-byte loads in flight per row and lane */
#define GEMV_DEFAULT_ROWS 1	/* rows per warp unless backend_params.gemv says otherwise */
/* Products of at most QGEMV_MAX_TOKENS tokens with block-quantized weights read the blocks in
 * place (gemv_quant.cu), QG_MAX_NT tokens per pass; larger ones dequantize to BF16 and use
 * cuBLAS. A pass reads the weights once for its tokens and costs a permute and NT FMAs per
 * weight (for 8 tokens about 11 instructions a weight: ~3 ms for an 8B model on an H100, compute
 * bound); dequantizing writes and reads 2 bytes per weight on top of the quantized read (~12 ms
 * for the same model before cuBLAS's own work), so passes win up to about 32 tokens. 16 stays
 * well inside that; what lands between is a prompt's tail chunk, prefill proper is far above. */
#define QGEMV_MAX_TOKENS 16
#define QG_MAX_NT 8		/* tokens of one quantized GEMV pass (its per-token registers) */
#define QG_WARPS 8		/* warps (output rows) per block of the quantized GEMV */
#define QG_SMEM_MAX (72u * 1024) /* shared memory of one quantized GEMV block: staged x */
#define DQ_SM_SMEM_MAX (112u * 1024) /* the integer path through shared memory: x and the weight stages */
#define DQ_WIDE_MAX 4	/* row-group blocks (QG_WARPS warps each) one block of that path may hold, x
			 * staged once for all of them (gemv_dp4a.cuh) */
#define QG_OCC_CACHE 32		/* (kernel, shared memory) pairs whose occupancy a backend remembers */
/* The dequantization scratch holds the largest matrix of a layer, at most this many BF16
 * elements (128 MiB); lm_head and larger matrices go through it a row chunk at a time. */
#define QSCRATCH_MAX_ELEMS ((size_t)64 << 20)
#define UPLOAD_EVENTS 128	/* uploads in flight in the staging ring */
#define UPLOAD_ALIGN 256
#define BLAS_WORKSPACE (32u << 20) /* what cuBLAS asks for on Hopper */
/* Small per-layer lists travel in the kernel's parameters instead of an upload (a copy on the
 * compute stream between two kernels): the KV destinations of up to ROPE_INLINE_TOKENS tokens and
 * up to ATTN_INLINE_SPANS spans of the CUDA-core attention (decode: 8192 keys in 16-token blocks
 * where CUDA takes kernel parameters of up to 32 KB, 12.1 on; 2048 in 4 KB before). */
#define ROPE_INLINE_TOKENS 8
/* Most sequences one step takes (their RoPE launches' parameters are made on the host's stack). */
#define ROPE_MAX_RUNS_INLINE 64
#if CUDART_VERSION >= 12010
#define ATTN_INLINE_SPANS 512
#else
#define ATTN_INLINE_SPANS 128
#endif
/* Spans an attention block copies into shared memory: those holding its split's keys. */
#define ATTN_WINDOW_SPANS 128

/* What device kernels report to the host; read back with the logits. */
struct dev_status {
	int32_t token;	   /* logits_argmax's result */
	int32_t err;	   /* 1: a query saw no keys */
	uint32_t err_layer;
	uint32_t err_pos;
	unsigned long long best; /* logits_argmax's blocks: their largest key so far, 0 between calls */
	uint32_t done;		 /* logits_argmax's blocks that have folded theirs in, 0 between calls */
};

/* Pinned host memory that uploads are staged in, reused as a ring (see the header comment). */
struct upload_ring {
	char *host;	    /* pinned, cap bytes */
	size_t cap;
	size_t head;	    /* where the next region starts */
	cudaEvent_t ev[UPLOAD_EVENTS];
	size_t beg[UPLOAD_EVENTS], end[UPLOAD_EVENTS]; /* region each pending event guards */
	uint32_t first, count;			       /* pending events, oldest first */
	uint32_t n_events;			       /* events created (destroy) */
};

/* Where a launch's blocks stamp the time (bench-kernels --trace through cuda_test_trace): t is
 * NULL when tracing is off, else KTRACE_MAX_BLOCKS rows of KTRACE_POINTS globaltimer readings
 * (ns), row = the block's linear index, 0 where a point was not reached (device.cuh: ktrace_mark,
 * ktrace_end). */
#define KTRACE_STAMPS	  4 /* the block's start, its wait's end, its input staged, its last warp's end */
#define KTRACE_END	  (KTRACE_STAMPS - 1)
#define KTRACE_SM	  KTRACE_STAMPS	/* then 1 + the multiprocessor the block ran on */
#define KTRACE_POINTS	  (KTRACE_STAMPS + 1)
#define KTRACE_MAX_BLOCKS 2048
#define KTRACE_MAX_LAUNCHES 512
struct ktrace {
	unsigned long long *t;
};
/* A traced step's launches (cuda_test_trace): the stamps on the device, what each launch was. */
struct ktrace_log {
	unsigned long long *dev;	/* (KTRACE_MAX_LAUNCHES, KTRACE_MAX_BLOCKS, KTRACE_POINTS) */
	const char *what[KTRACE_MAX_LAUNCHES];
	uint32_t n;			/* launches stamped this step (more are not) */
	bool on;			/* the next one-token steps are traced */
};
/* The stamps of the next launch of the step, named what (a string literal), or none (tracing off,
 * a step of several tokens, the log full). */
struct ktrace ktrace_next(const struct backend_dev *be, const char *what);
/* A step of n tokens begins: a traced one-token step's stamps cleared (on the stream). */
int ktrace_step(struct backend_dev *be, uint32_t n);
/* At a step's start (n tokens): PIPELINE_CUDA_PROFILE_STEP=N runs the N-th step of more than one
 * token since the backend was made (a prefill chunk, a batched decode step) between
 * cudaProfilerStart and cudaProfilerStop, so that a profiler whose collection starts off (ncu
 * --profile-from-start off, under PIPELINE_WRAP_GPU_RUNNER) measures that step's kernels alone;
 * PIPELINE_CUDA_PROFILE_DECODE=N the same for the N-th step of one token (a decode step).
 * The collection stops at the next step's start, or at destroy (profile_end). */
void profile_step(struct backend_dev *be, uint32_t n);
void profile_end(struct backend_dev *be);
void ktrace_free(struct backend_dev *be);

struct backend_dev {
	struct model_config cfg;
	struct backend_params p;
	char err[CUDA_ERR_MAX];

	int device;
	int sm_count;
	cudaStream_t stream;
	cudaStream_t kv_h2d;	/* the KV read-ahead's copies (kv_prefetch_n), made on first use */
	cudaEvent_t kv_order;	/* recorded on stream: what the read-ahead's copies wait for */
	cudaEvent_t kv_done[2];	/* recorded on kv_h2d per slot */
	cudaStream_t kv_d2h;	/* the KV write-behind's copies (kv_to_host_async), lowest priority, made on first use */
	cudaEvent_t kv_d2h_order; /* recorded on stream: what the write-behind's copies wait for */
	int32_t *kv_d2h_ev;	/* per arena block: the interprocess event after its last write-behind copy that
				 * the compute stream has not been made to wait for, or -1 */
	uint64_t *kv_d2h_seq;	/* per arena block: that copy's batch number (the latest one covers the rest) */
	uint64_t kv_d2h_batches;
	cublasHandle_t blas;
	void *blas_ws;		/* cuBLAS workspace, BLAS_WORKSPACE bytes */
	int gemv_rows;		/* decode through the GEMV kernel with this many rows per warp (0: cuBLAS) */
	bool qgemv_ok;		/* the device gives the quantized GEMV its shared memory (QG_SMEM_MAX) */
	uint32_t dq_smem_max;	/* dynamic shared memory a block of the integer path may take: what a block
				 * may opt in to, less 1 KiB for its static shared memory (create) */
	bool qgemv_dp4a;	/* one-token quantized products take x as int8 (integer dot products) */
	bool dq_sm;		/* ... with the weights through shared memory (cp.async) where aligned */
	struct {
		const void *fn;
		size_t smem;
		uint32_t threads;
		uint32_t blocks;	/* resident per multiprocessor */
	} qg_occ[QG_OCC_CACHE];	/* gemv_quant.cu's grid sizes */
	uint32_t qg_occ_n;
	bool attn_mma;		/* prefill attention on tensor cores where it applies */
	bool pdl;		/* kernels of a step launch with programmatic dependent launch (launch_k) */
	bool fuse_x;		/* one-token integer products compute their x while staging it (struct xsrc) */
	bool wide_dq;		/* ... in blocks of several row groups where that fills the GPU (DQ_WIDE_MAX) */
	bool mix_dq;		/* ... parts in two formats in one launch (dq_mix_kernel) */
	bool whole_dq;		/* ... rows of whole steps walked by dq_sm_rows_whole */
	bool wide_qkv;		/* ... q/k/v in wide blocks too (BACKEND_FUSE_WIDE_QKV) */
	bool rows_apart;	/* ... a wide block's row-group blocks gridDim.x apart (BACKEND_FUSE_ROWS_APART) */
	bool dq_narrow;		/* the products launched now feed the attention: blocks of one row group */
	bool early_kv;		/* attn_args.early_keys where the keys are settled (backend_params.fuse) */
	uint32_t attn_key_warps; /* attn_kernel's warps a query where the block has room (backend_params.fuse) */
	uint32_t leave_out;	/* enum cuda_test_part: kernels one-token steps leave out (timing only) */
	uint64_t early_kv_launches; /* attn_kernel launches with early_keys and inline spans (tests) */
	uint64_t two_warp_launches; /* attn_kernel launches with two warps a query (tests) */
	uint64_t wide_launches;	/* dq_sm_kernel launches in wide blocks (tests) */
	uint64_t apart_launches; /* ... of them with their row-group blocks apart (tests) */
	uint64_t mix_launches;	/* dq_mix_kernel launches (tests) */
	uint64_t whole_launches; /* integer launches walking rows of whole steps (GEMV_WHOLE_BIT; tests) */
	struct ktrace_log *trace; /* cuda_test_trace's stamps, NULL until first asked for */
	int32_t prof_left;	/* PIPELINE_CUDA_PROFILE_STEP: steps of several tokens to go until the profiled
				 * one (0: none; -1: not read yet) */
	int32_t prof_one_left;	/* PIPELINE_CUDA_PROFILE_DECODE: the same for steps of one token */
	bool profiling;		/* between cudaProfilerStart and cudaProfilerStop (profile_step) */
	bool kv_synced;		/* the host waited for the stream since the step began (finish_step) */
	bool kv_settled;	/* ... before this step began: every KV row that earlier steps wrote is in
				 * the arena, so a kernel may read those rows before it waits for the one
				 * before (programmatic launches; attn_args.early_keys) */

	uint32_t q_dim;		/* n_heads * head_dim */
	uint32_t kv_dim;	/* n_kv_heads * head_dim */
	uint32_t qkv_ld;	/* q_dim + 2 * kv_dim: a token's row of qkv */
	uint32_t max_in;	/* widest matrix input: max(dim, q_dim, ffn_dim) */
	size_t kv_esize;	/* bytes of one K or V element */
	size_t block_elems;	/* elements of one arena block: K then V, (block_tokens, n_kv_heads, head_dim) each */
	size_t attn_smem_max;	/* dynamic shared memory of the largest attention block */
	float scale;		/* 1 / sqrt(head_dim) */

	/* Device memory. */
	void *arena;		/* (n_kv_blocks, block_elems) in kv_dtype */
	float *inv_freq;	/* (head_dim / 2) RoPE inverse frequencies, scaling applied */
	float *x;		/* (max_chunk, dim) residual stream */
	void *xa;		/* (max_chunk, max_in) matrix input in the activation dtype; embed's raw rows */
	void *xb;		/* (max_chunk, ffn_dim) SiLU(gate) * up in the activation dtype */
	void *qscratch;		/* (qscratch_elems) BF16: rows of a quantized matrix, dequantized */
	size_t qscratch_elems;
	float *qkv;		/* (max_chunk, qkv_ld) q (RoPE'd in place), k, v */
	float *gu;		/* (max_chunk, 2 * ffn_dim) gate then up (cuBLAS path) */
	float *logits;		/* (vocab_size) */
	float *st_m, *st_l;	/* (max_chunk, n_heads) running max and sum of the softmax */
	float *st_acc;		/* (max_chunk, n_heads, head_dim) running weighted sum of V */
	float *pm, *pl, *pacc;	/* partial states of split attention: part_cap pairs (and head_dim) */
	uint32_t part_cap;	/* (split, token, head) triples the partial buffers hold */
	uint32_t *attn_count;	/* (attn_count_n) split attention's merge counters, zeroed at create */
	uint32_t attn_count_n;
	uint32_t *dst;		/* (2, max_chunk) destination blocks, then rows */
	uint32_t *dst_pos;	/* (3, max_chunk) the same, then each row's position: RoPE over several sequences */
	/* Decode attention held back for one launch (attention_flush): host memory. */
	struct kv_span *pend_spans;
	uint32_t pend_n, pend_cap;
	struct attn_seq *pend_seqs; /* (max_chunk) */
	uint32_t pend_nseq;
	void *spanbuf;		/* spans, then their key offsets (prefix sums) */
	size_t spanbuf_bytes;
	struct dev_status *status;

	struct dev_status *h_status; /* pinned */
	struct upload_ring up;

	/* The batch in flight (backend.c has checked the call order). */
	uint32_t n;		/* tokens in the chunk */
	uint32_t pos0;		/* position of its first token */
	/* Its sequences (backend.h: runs of consecutive positions), in row order: n_runs of them. */
	uint32_t *run_row0, *run_n, *run_pos0; /* (max_chunk) host memory */
	uint32_t n_runs;
	uint32_t *pos;		/* (max_chunk) host memory: each row's position */
	float *logits_rows;	/* (logits_rows_cap, vocab_size) logits_rows' output, made on first use */
	uint32_t logits_rows_cap;
	struct dev_status *picks;   /* (picks_cap) logits_pick_rows' tokens, made on first use */
	struct dev_status *h_picks; /* pinned */
	uint32_t picks_cap;
	uint32_t layer;		/* layer between attn_begin and attn_end */
	uint32_t attn_act;	/* activation dtype of the attention matrices of that layer */

	/* The CPU share of split FFNs (ffn_split.cu), with backend_params.cpu_pool. */
	struct cpu_handoff *handoff;	/* the stream's handoff to the pool */
	struct ffn_share *share;	/* the jobs' scratch */
	struct split_job *split_jobs;	/* ring of the jobs handed over */
	uint64_t split_n;		/* jobs handed over so far */
	float *partial;			/* (FFN_SPLIT_MAX_TOKENS, dim) the CPU share's result, device memory */
	uint64_t split_fail_at;		/* test hook: the job of this number (split_n after it) fails; 0 none */
	struct split_timing *split_tm;	/* (SPLIT_TIMED) ring of timed split FFNs (ffn_split.cu) */
	uint64_t split_tm_head, split_tm_tail; /* recorded, harvested */
	/* Mixture-of-experts layers (moe.cu); NULL on a dense model. */
	struct cuda_moe *moe;
	uint64_t split_timed;
	double split_stream_ms, split_wait_ms;
	uint64_t split_hist[BACKEND_HANDOFF_BUCKETS]; /* the timed FFNs' handoffs (backend.h) */
};

/* ---- errors ------------------------------------------------------------------------------ */

/* Records a message (it starts with "cuda backend: ") and returns rc. */
__attribute__((format(printf, 3, 4))) int cuda_failf(struct backend_dev *be, int rc, const char *fmt, ...);
/* A failed CUDA runtime call: -ENOMEM for allocations, -EIO for the rest. */
int cuda_fail(struct backend_dev *be, cudaError_t e, const char *what);
int blas_fail(struct backend_dev *be, cublasStatus_t st, const char *what);

#define CUDA_TRY(be, what, call)                                  \
	do {                                                      \
		cudaError_t e_ = (call);                          \
		if (e_ != cudaSuccess)                            \
			return cuda_fail((be), e_, (what));       \
	} while (0)

/* After a kernel launch: a bad configuration shows here; faults show at the next sync. */
#define LAUNCHED(be, what) CUDA_TRY(be, "launch of " what, cudaGetLastError())

/* Launches kernel k, with programmatic dependent launch where pdl is set (device.cuh's grid_wait
 * says what the kernel must do then). Errors show through cudaGetLastError (LAUNCHED). */
template <typename... KP, typename... A>
static inline void launch_k(bool pdl, void (*k)(KP...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
			    A... args)
{
	cudaLaunchConfig_t cfg = {};
	cudaLaunchAttribute at[1];
	at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
	at[0].val.programmaticStreamSerializationAllowed = 1;
	cfg.gridDim = grid;
	cfg.blockDim = block;
	cfg.dynamicSmemBytes = smem;
	cfg.stream = s;
	cfg.attrs = at;
	cfg.numAttrs = pdl ? 1 : 0;
	cudaError_t e = cudaLaunchKernelEx(&cfg, k, args...);
	(void)e; /* also returned by cudaGetLastError */
}

/* A kernel of one block per token runs few blocks in decode: give each block more threads. */
static inline bool small_grid(uint32_t blocks)
{
	return blocks < 32;
}

static inline unsigned grid_for(size_t count, unsigned threads)
{
	size_t b = (count + threads - 1) / threads;
	return b > 4096 ? 4096 : (unsigned)(b ? b : 1);
}

/* ---- moe.cu ------------------------------------------------------------------------------- */

/* The expert state of a mixture-of-experts config (nothing for a dense one); moe_teardown frees it. */
int moe_setup(struct backend_dev *be);
void moe_teardown(struct backend_dev *be);
/* backend.h's moe_route, moe_expert and moe_end. route waits for the router's logits (the host
 * routes); moe_expert_used says whether a token of the chunk chose an expert (after route). */
int moe_route(struct backend_dev *be, const struct group_weights *w);
bool moe_expert_used(struct backend_dev *be, uint32_t expert);
int moe_expert(struct backend_dev *be, const struct group_weights *w, uint32_t expert);
int moe_end(struct backend_dev *be);
/* The experts' part of backend_cpu_share_stats (nothing for a dense model). */
void moe_stats(struct backend_dev *be, struct backend_cpu_share_stats *out);
/* backend.h's moe_expert_cpu: submitted to the pool at once, collected in order at moe_end;
 * moe_settle waits for those still running (a failed step). */
int moe_expert_cpu(struct backend_dev *be, const struct group_weights *w, uint32_t expert);
/* The CPU's share of an expert split with the pool (struct ffn_split, FFN_SPLIT_CPU: rows [r, F) of
 * gate and up, down's columns [r, F), in host memory), submitted as moe_expert_cpu's whole experts
 * are; moe_expert computes rows [0, r) and calls it. */
int moe_expert_cpu_share(struct backend_dev *be, const struct ffn_split *s, uint32_t expert);
/* backend_moe_ends: 1 and *gpu_late_ns where this routing measured the layer before's ends. */
int moe_ends(struct backend_dev *be, int64_t *gpu_late_ns);
void moe_settle(struct backend_dev *be);
/* The results of the CPU's experts whose jobs the stream waited for (one token: moe.cu), waited
 * for where the stream has not passed them yet (a route, backend.h's moe_check at a step's end):
 * 0, or the first failed job's error (the request fails). */
int moe_check(struct backend_dev *be);
/* backend.h's moe_check at a step's end: moe_check, and the step's last layer is no layer's before
 * for the gap the stats time (the next step's first route follows the step's tail). */
int moe_check_step(struct backend_dev *be);
/* After a step's embedding: where the step's start is timed, its event (moe_internal.h: begin). */
void moe_embedded(struct backend_dev *be);
/* Records ev on stream for the statistics' timing: false (the error cleared) where it could not. */
bool moe_time_mark(cudaEvent_t ev, cudaStream_t stream);
/* backend.h's moe_layer_experts, moe_layer and moe_layer_chosen (moe_device.cu): a one-token
 * layer routed on the device from a table of its experts' addresses. */
int moe_layer_experts(struct backend_dev *be, uint32_t layer, const struct group_weights *experts);
int moe_layer(struct backend_dev *be, const struct group_weights *w, uint32_t layer);
int moe_layer_chosen(struct backend_dev *be, uint32_t layer, uint32_t *ids);
/* Qwen3's per-head RMSNorm of the chunk's q and k (in be->qkv), before RoPE. */
int qk_norm(struct backend_dev *be, const void *qn, uint32_t qt, const void *kn, uint32_t kt);

/* cudaMalloc of a * b elements of es bytes into *p (backend_cuda.cu); -ENOMEM with a message naming
 * what. */
int dev_alloc(struct backend_dev *be, void **p, size_t a, size_t b, size_t es, const char *what);

/* ---- staging.cu ---------------------------------------------------------------------------- */

/* A region of `size` bytes of the pinned ring that no pending copy reads; *off is where it
 * starts. Fill it, then up_send it. */
int up_alloc(struct backend_dev *be, size_t size, char **out, size_t *off);
/* Copies the region (or a part of it: a region may go up in several copies) to dst on the
 * compute stream and marks it busy until the copy has run (what: the copy's name in a message). */
int up_send(struct backend_dev *be, void *dst, const char *h, size_t off, size_t size, const char *what);

/* ---- matmul.cu, gemv.cu -------------------------------------------------------------------- */

enum gemv_mode {
	GEMV_STORE = 0,	  /* out[part][o] = y */
	GEMV_ADD = 1,	  /* out[0][o] += y (residual) */
	GEMV_SWIGLU = 2,  /* act[o] = silu(W0 x) * (W1 x), in the activation dtype */
};
/* Or'ed into the MODE of a quantized one-token kernel: several matrices (qgemv_args.m), a kernel
 * of its own so that the one-matrix kernels' registers are what they were. */
#define GEMV_MATS_BIT 4
/* Or'ed into the MODE of dq_mix_kernel: parts in two formats in one launch (qgemv_args.vb0). */
#define GEMV_MIX_BIT 8
/* Or'ed into the MODE of an integer kernel through shared memory: its rows are whole steps, walked
 * by dq_sm_rows_whole (a kernel of its own, so that the general walk's registers stay its own). */
#define GEMV_WHOLE_BIT 16
#define GEMV_MODE_OF(mode) ((mode) & ~(GEMV_MATS_BIT | GEMV_MIX_BIT | GEMV_WHOLE_BIT)) /* the enum gemv_mode of such a MODE */

/* The activation dtype of a weight format: a block format multiplies BF16 activations (cuBLAS
 * takes the dequantized BF16 rows with them), an element format its own dtype. The matrices of
 * one product chain must agree on it. */
static inline uint32_t act_dtype(uint32_t fmt)
{
	return dtype_is_element((enum dtype)fmt) ? fmt : (uint32_t)DT_BF16;
}

/* Several matrices of one shape and format in one launch of a one-token product: a layer's
 * chosen experts that the GPU keeps (moe.cu), each with an x and an output of its own. Block b of
 * the grid computes matrix b / blocks, its rows as a launch of that matrix alone with `blocks`
 * blocks would, so each result is that launch's. n == 0: one matrix, as the product's own fields
 * say (w, out, x, act); else those are not read, and the product has one part (STORE or SWIGLU). */
#define GEMV_MATS 8
struct gemv_mats {
	uint32_t n;			/* matrices, 0..GEMV_MATS */
	uint32_t blocks;		/* blocks of the grid each (filled in by the launch) */
	const void *w[GEMV_MATS];	/* each one's weights (SWIGLU: gate) */
	const void *w2[GEMV_MATS];	/* SWIGLU: each one's up */
	/* Or in device memory, when a kernel before chose them (moe_device.cu): w[j] is wd[j], w2[j]
	 * wd[GEMV_MATS + j]; NULL: the arrays above. The kernels then wait for the kernel before
	 * (grid_wait) before anything else, with no weights read ahead. */
	const void *const *wd;
	const void *x[GEMV_MATS];	/* each one's x (in) in the activation dtype, 16-byte aligned */
	float *out[GEMV_MATS];		/* STORE: each one's output row */
	void *act[GEMV_MATS];		/* SWIGLU: each one's output row */
};

struct gemv_args {
	const void *w[3];	/* (rows[p], in) row-major */
	float *out[3];
	uint32_t rows[3];
	uint32_t total;		/* rows over all parts (SWIGLU: rows of one); of one matrix with m.n */
	uint32_t in8;		/* in / 8: 16-byte chunks per row */
	const void *x;		/* (in) in the weight dtype */
	void *act;		/* SWIGLU output */
	struct gemv_mats m;	/* several matrices (m.n > 0) instead of w, out, x, act */
};

struct mm_part {
	const void *w;	/* (rows, in) row-major, device memory */
	uint32_t rows;
	float *out;	/* (n, ldc) token-major float32 */
	uint32_t format;   /* enum dtype of w */
	uint64_t row_bytes; /* bytes from one row of w to the next */
};

/* Where the one-token integer path (gemv_dp4a.cuh) takes its x from: the BF16 activations, or
 * values it computes while staging x, so the kernel that would have written them is not
 * launched. Each value is what that kernel writes: rounded to BF16, then quantized to int8. */
enum xsrc_kind {
	XSRC_ACT = 0,  /* qgemv_args.x */
	XSRC_NORM = 1, /* RMSNorm of the residual row res with weight norm_w (rmsnorm_kernel) */
	XSRC_ATTN = 2, /* acc / l of each head, the attention output (attn_out_kernel); a head with
			* l == 0 saw no keys: 0, and flagged in st as attn_out_kernel does */
};

struct xsrc {
	uint32_t kind;		/* enum xsrc_kind */
	const float *res;	/* XSRC_NORM: (in) float32 residual row */
	const void *norm_w;	/* XSRC_NORM: (in) in dtype norm_wt */
	uint32_t norm_wt;
	float eps;
	const float *l, *acc;	/* XSRC_ATTN: (in / head_dim) sums, (in) weighted sums */
	uint32_t head_dim;
	struct dev_status *st;
	uint32_t layer, pos0;
};

struct qgemv_args {
	const uint8_t *w[3];	/* (rows[p], in) in one block format, row_bytes per row, device memory */
	float *out[3];		/* (n, ldc) token-major: out[p][t * ldc + o] */
	uint32_t rows[3];
	uint32_t total;		/* rows over all parts (SWIGLU: rows of one) */
	uint64_t row_bytes;
	uint32_t in, n, ldc;
	const __nv_bfloat16 *x;	/* (n, in) */
	__nv_bfloat16 *act;	/* SWIGLU output (rows of one part) */
	struct xsrc src;	/* the integer path's x: x itself unless src.kind says otherwise */
	struct gemv_mats m;	/* several matrices (m.n > 0; the integer path, x its own, src XSRC_ACT):
				 * total, rows[0] and groups are then one matrix's */
	/* Filled in by qgemv_launch: */
	uint32_t nb;		/* blocks per row */
	uint32_t steps;		/* warp steps per row */
	uint32_t tile_steps;	/* steps of x staged in shared memory at a time */
	uint32_t groups;	/* row groups (QG_WARPS rows each) */
	uint32_t vb0, vbn;	/* a launch of two formats (dq_mix_kernel): the row-group blocks
				 * [vb0, vb0 + vbn) walk these parts' row groups */
	uint32_t vb_apart;	/* a wide block's row-group blocks are gridDim.x apart (qg_vblock;
				 * BACKEND_FUSE_ROWS_APART), else side by side */
	struct ktrace tr;	/* the launch's stamps (bench-kernels --trace), set by the launcher */
};

/* Can the GEMV kernel take this product: one token, 16-bit weights, 16-byte rows and pointers? */
bool gemv_fits(const struct backend_dev *be, uint32_t wt, uint32_t in, const struct mm_part *parts, uint32_t np);
/* Launches the GEMV kernel (gemv.cu) for weights of dtype wt with rows_per_warp rows per warp. */
void gemv_launch(uint32_t wt, int rows_per_warp, const gemv_args &g, int mode, bool pdl, cudaStream_t s);
/* Lets the quantized GEMV kernels use their shared memory: QG_SMEM_MAX bytes, the integer path
 * through shared memory dq_smem_max (create). */
cudaError_t qgemv_init(uint32_t dq_smem_max);
/* Can the quantized GEMV take this product: n <= QGEMV_MAX_TOKENS tokens, the GEMV on
 * (backend_params.gemv), whole blocks per row, tensors aligned for the format's loads? */
/* Would a one-token product of format fmt on x take the integer path (gemv_dp4a.cuh, the quantized
 * path that takes several matrices, qgemv_args.m)? */
bool qgemv_integer(const struct backend_dev *be, uint32_t fmt, uint32_t in, const void *x);
bool qgemv_fits(const struct backend_dev *be, uint32_t fmt, uint32_t in, uint32_t n, const struct mm_part *parts,
		uint32_t np);
/* Would a one-token product of these parts (each part's format its own) take the integer path
 * for every part, so that x can come from a struct xsrc? */
bool qgemv_fuses_x(const struct backend_dev *be, uint32_t in, const struct mm_part *parts, uint32_t np);
/* The args of a product of parts (one block format, np <= 3) on n tokens of x (or src), outputs
 * ldc apart; the launch fields are qgemv_launch's to fill. */
void qgemv_args_of(qgemv_args &g, const struct mm_part *parts, uint32_t np, const void *x, const struct xsrc *src,
		   uint32_t in, uint32_t n, uint32_t ldc);
/* A one-token product of two runs of parts (p1, p2), each in one block format and the two in
 * two (Q4_K and Q6_K or Q8_0), on x or src, as one launch on the integer path (dq_mix_kernel):
 * false, launching nothing, where that path does not take them (the caller launches each run). */
bool qgemv_launch_mix(struct backend_dev *be, const struct mm_part *p1, uint32_t n1, const struct mm_part *p2,
		      uint32_t n2, const void *x, const struct xsrc *src, uint32_t in, uint32_t ldc);
/* Launches the quantized GEMV (gemv_quant.cu) for block format fmt; fills a's launch fields. */
void qgemv_launch(struct backend_dev *be, uint32_t fmt, qgemv_args &a, int mode, cudaStream_t s);
/* Dequantizes rows [0, rows) of a block-format matrix (row_bytes apart, device memory) into out
 * (rows, cols) in dtype ot: DT_BF16 or DT_F32 (dequant.cu). */
void dequant_launch(uint32_t fmt, const void *src, uint64_t row_bytes, uint32_t rows, uint32_t cols, void *out,
		    uint32_t ot, cudaStream_t s);
/* One cuBLAS product: pt->out (n, ldc) (+)= x (n, in) W^T, all in dtype wt but the float32 out. */
int gemm(struct backend_dev *be, uint32_t wt, const struct mm_part *pt, const void *x, uint32_t in, uint32_t n,
	 uint32_t ldc, bool add, const char *what);
/* out_p[t] (+)= W_p x[t] for the parts, x (n, in) in activation dtype at (device memory). Parts
 * may differ in format where their activation dtype is at (parts of one format go together).
 * src: NULL, or where x comes from when qgemv_fuses_x said yes (x is then not read). */
int matmul(struct backend_dev *be, uint32_t at, const void *x, const struct xsrc *src, uint32_t in, uint32_t n,
	   const struct mm_part *parts, uint32_t np, uint32_t ldc, bool add, const char *what);
/* act (n, rows) in dtype at = SiLU(gate x) * (up x) for gu = {gate, up} (rows each, outs at
 * gu[0].out and gu[0].out + rows of a (n, 2 * rows) float32 buffer the unfused path uses); src as
 * matmul's. */
int swiglu_product(struct backend_dev *be, uint32_t at, const struct mm_part gu[2], const void *x,
		   const struct xsrc *src, uint32_t in, uint32_t n, void *act, const char *what);

/* One token's product through an expert (gate, up: (F, dim); down: (dim, F)), for experts_batch. */
struct mm_expert {
	struct mm_part gate, up, down;	/* down.out: the expert's output row (dim float32) */
	void *act;			/* its SwiGLU row (F values in the activation dtype), 16-byte aligned */
};
/* Can experts_batch take this expert: gate and up of one format, down of one with the same
 * activation dtype, each product a one-token GEMV kernel that takes several matrices (BF16/F16, or
 * the integer path's Q4_K, Q6_K, Q8_0), x 16-byte aligned? */
bool expert_batch_fits(const struct backend_dev *be, const struct mm_expert *e, uint32_t dim, uint32_t F,
		       const void *x);
/* Can b join a batch whose first expert is a (the same formats and row sizes)? */
bool expert_batch_joins(const struct mm_expert *a, const struct mm_expert *b);
/* The one-token products of n (1..GEMV_MATS) experts that expert_batch_fits and join one batch,
 * x (dim values in the activation dtype) their common input: act_j = SiLU(gate_j x) * (up_j x) in
 * one launch, then down_j act_j into their rows in another; each result is that of the expert's
 * own swiglu_product and matmul. The matrices are e's, or (gu_wd, down_wd not NULL: experts a
 * kernel before chose, moe_device.cu) at addresses in device memory, gate and up at gu_wd
 * (gemv_mats.wd), down at down_wd, e giving the rest (formats, row sizes, outputs, act rows). */
int experts_batch(struct backend_dev *be, const struct mm_expert *e, uint32_t n, const void *x, uint32_t dim,
		  uint32_t F, const void *const *gu_wd, const void *const *down_wd);

/* ---- norm_rope.cu -------------------------------------------------------------------------- */

struct rope_args {
	float *qkv;		/* (n, ld): q, k, v of each token */
	uint32_t ld;
	const float *inv_freq;
	const uint32_t *dst;	/* (2, n): blocks, then rows (device memory), unless n <= ROPE_INLINE_TOKENS: */
	uint32_t dst_in[2 * ROPE_INLINE_TOKENS]; /* the same, (2, n), in the parameters */
	void *arena;
	uint64_t block_elems;
	uint32_t block_tokens, n_heads, n_kv_heads, head_dim, pos0, n;
	uint32_t adjacent;	/* cfg.rope_layout == ROPE_ADJACENT: pairs (2i, 2i + 1), else (i, i + hd/2) */
	float *m, *l, *acc;	/* running attention state, reset here */
	const uint32_t *pos;	/* (n) each row's position (device memory; rows of several sequences), or
				 * NULL: pos0 + t, and dst as above */
	struct ktrace tr;	/* the launch's stamps (bench-kernels --trace) */
};

/* RMSNorm of rows [row0, row0 + rows) of be->x into be->xa (from its start) in dtype ot. */
int rmsnorm(struct backend_dev *be, const void *w, uint32_t wt, uint32_t row0, uint32_t rows, uint32_t ot);
/* The same in float32 into out, and into host too where set (mapped host memory the device
 * writes across the bus: no copy queued after the kernel). */
int rmsnorm_f32(struct backend_dev *be, const void *w, uint32_t wt, uint32_t row0, uint32_t rows, float *out,
		float *host);
/* RMSNorm of rows rows[0..n) of be->x into rows 0..n-1 of be->xa in dtype ot. */
int rmsnorm_rows(struct backend_dev *be, const void *w, uint32_t wt, const uint32_t *rows, uint32_t n, uint32_t ot);
/* Gathered embedding rows raw (count elements of element dtype dt) widened into x (block
 * formats: dequant_launch). */
void embed_launch(uint32_t dt, const void *raw, float *x, size_t count, cudaStream_t s);
/* RoPE, the K and V rows into the arena (kv_dtype), accumulators reset: one block per token. */
void rope_launch(uint32_t kv_dtype, const rope_args &a, bool pdl, cudaStream_t s);
/* x[i] += y[i] for count floats. */
void add_launch(float *x, const float *y, size_t count, cudaStream_t s);
/* SiLU(gate) * up of the cuBLAS path ((n, 2 * ffn) float32) into out in dtype ot. */
void silu_mul_launch(uint32_t ot, const float *gu, uint32_t ffn, size_t count, void *out, cudaStream_t s);

/* ---- attention.cu, attention_fp32.cu, attention_mma.cu ------------------------------------- */

/* One sequence's run of rows in a launch over several (attn_args.seqs): its spans are
 * spans[span0, span0 + n_spans), their key offsets prefix[prefix0, prefix0 + n_spans]. */
struct attn_seq {
	uint32_t row0, n, pos0;
	uint32_t span0, prefix0, n_spans, total_keys;
};

struct attn_args {
	const float *q;		/* qkv: token t's query heads at t * q_ld */
	uint32_t q_ld;
	const void *arena;
	uint64_t block_elems;
	uint32_t block_tokens, kv_dim;
	const struct kv_span *spans;
	const uint32_t *prefix;	/* (n_spans + 1) key offset of each span in the flattened key list */
	uint32_t inline_spans;	/* 1: spans and prefix are the copies below (attn_kernel only) */
	uint32_t early_keys;	/* 1: keys below pos0 are settled (backend_dev.kv_settled): attn_kernel may
				 * load them before it waits for the kernel before */
	struct kv_span span_in[ATTN_INLINE_SPANS];
	uint32_t prefix_in[ATTN_INLINE_SPANS + 1];
	uint32_t n_spans, total_keys, keys_per_split;
	uint32_t n, pos0, n_heads, group, head_dim, window, qtiles;
	float scale;
	float *m, *l, *acc;	/* running state (token, head) */
	float *pm, *pl, *pacc;	/* partial state (split, token, head), NULL with one split */
	uint32_t *merge_count;	/* per block column: splits done, 0 between calls; NULL: attn_combine_kernel merges */
	/* Several sequences' runs in one launch (attention_flush), NULL otherwise: sequence
	 * blockIdx.z is seqs[blockIdx.z]; n is then the step's rows, q and m, l, acc its first row's,
	 * and n_spans, total_keys, pos0 and the inline spans unused. */
	const struct attn_seq *seqs;
	struct ktrace tr;	/* the launch's stamps (bench-kernels --trace) */
};

/* attention_fp32.cu: bytes of dynamic shared memory of an attention block of nw queries. */
size_t attn_smem_bytes(uint32_t hd, size_t esize, uint32_t nw);
/* Lets the attention kernel of kv_dtype use `bytes` of dynamic shared memory. */
cudaError_t attn_allow_smem(uint32_t kv_dtype, size_t bytes);
/* attn_kernel on grid for nw queries a block; returns its warps a query (1 or 2, each taking its
 * share of a tile's keys). */
uint32_t attn_launch(const struct backend_dev *be, const attn_args &a, dim3 grid, uint32_t nw);
/* attn_combine_kernel: the splits' partial states (be->pm, pl, pacc) of `pairs` (token, head)
 * pairs merged into the running state m, l, acc. */
void attn_combine_launch(const struct backend_dev *be, uint32_t pairs, uint32_t splits, float *m, float *l, float *acc);
/* attn_blocks: the spans up, the key range split over blocks, the kernels queued. */
int attention_blocks(struct backend_dev *be, const struct kv_span *spans, uint32_t n_spans);
/* Launches the decode attention attention_blocks has held back (the one-row runs of a step of
 * several sequences: one launch for all of them); a no-op when none waits. Called before
 * anything reads the attention state or writes the arena (attn_end, the KV copies). */
int attention_flush(struct backend_dev *be);
/* Forgets what is held back (a new step; the last one failed on the way). */
void attention_drop(struct backend_dev *be);
/* attn_end's first half: att = acc / l per (token, head) into be->xa in dtype ot. */
void attn_out_launch(uint32_t ot, const struct backend_dev *be, cudaStream_t s);
/* The tensor-core kernel for head_dim hd (64 or 128). */
void attn_mma_launch(uint32_t hd, const attn_args &a, dim3 grid, cudaStream_t s);

/* ---- sampling.cu --------------------------------------------------------------------------- */

void argmax_launch(const float *v, uint32_t n, struct dev_status *st, cudaStream_t s);
void sample_launch(const float *v, uint32_t n, float inv_t, uint32_t top_k, float top_p, float min_p, double u,
		   struct dev_status *st, cudaStream_t s);

/* ---- ffn_split.cu -------------------------------------------------------------------------- */

/* With backend_params.cpu_pool: the scratch, the result buffer and the handoff (memops, falling
 * back to hostfunc where the default is asked and memops are missing). Returns 0 or -errno with
 * the message in be->err. */
int ffn_split_setup(struct backend_dev *be);
/* Undoes ffn_split_setup (the handoff first: it waits for its jobs); safe on a partial setup. */
void ffn_split_teardown(struct backend_dev *be);
/* The ffn of a split group (w->split.where set): queued on the stream, nothing waited for. */
int ffn_split_compute(struct backend_dev *be, const struct group_weights *w);
/* After the host synchronised with the stream: a CPU share that failed since the last check
 * fails the step here (-errno, message in be->err). */
int ffn_split_check(struct backend_dev *be);
/* Waits for the compute stream (cudaStreamSynchronize's result); with backend_params.cpu_dispatch_poll
 * handing the CPU pool the split FFNs' jobs as their triggers come (cpu_handoff_poll) meanwhile. */
cudaError_t ffn_split_stream_wait(struct backend_dev *be);
/* After a failed step: its CPU shares waited for (the stream run out) and their failures
 * forgotten (logged), so that the next step's check does not report them. */
void ffn_split_settle(struct backend_dev *be);
/* The CPU share's counters (backend_get_cpu_share_stats). */
void ffn_split_stats(struct backend_dev *be, struct backend_cpu_share_stats *out);

/* ---- kv_copy.cu ---------------------------------------------------------------------------- */

/* Before the compute stream writes arena blocks: waits (on the device) for the write-behind
 * copies still reading them. */
int kv_d2h_guard(struct backend_dev *be, uint32_t n, const uint32_t *blocks);
/* Frees the KV copy streams and tables (destroy). */
void kv_copy_destroy(struct backend_dev *be);
extern const struct backend_kv_ops cuda_kv_ops;

#endif

/* backend.h - the compute interface of the gpu-runner: one implementation per device, driven
 * through one front (backend.c) that checks every call and fills in what an implementation
 * leaves out.
 *
 * Two implementations exist: the plain C reference ("cpu", cpu/backend_ref.c: float32
 * accumulation, any weight format), which runs the whole pipeline in CI and is the oracle for
 * the CUDA backend ("cuda", cuda/). The engine (engine.c) drives a backend group by group, so
 * the same forward pass works whether weights are all resident or streamed, and whether the KV
 * of a layer fits the backend's KV arena or is brought in a few blocks at a time.
 *
 * The interface has two parts:
 *  - compute: one forward step over a batch of tokens, group by group;
 *  - KV copies: arena blocks to and from host memory (the kv-store pool), synchronous, behind
 *    the compute (write-behind) or ahead of it (read-ahead).
 *
 * One forward step processes a batch of n tokens (n = prompt chunk in prefill, 1 in decode).
 * Each token carries its position and the sequence it belongs to (struct backend_batch): the
 * tokens of one sequence sit together (a run) at consecutive positions. A backend that batches
 * sequences (backend_batches_sequences: the C backend) takes several runs in one step: every
 * product covers all the rows, attention gives each run its own KV (kv_span's rows), and
 * logits_rows gives the head of each run's last row. The others take one run, which the front
 * checks:
 *
 *   backend_embed(be, &embed_w, &batch);
 *   for each layer l:
 *       backend_attn_begin(be, &attn_w[l], l, dst_block, dst_row);  // q,k,v; RoPE; new K,V into the arena
 *       backend_attn_blocks(be, spans, n_spans);                       // as often as needed, any order
 *       backend_attn_end(be, &attn_w[l]);                              // o_proj + residual
 *       backend_ffn(be, &ffn_w[l]);                                    // norm, SwiGLU, residual
 *                                                 // (ffn_w[l].split: in two shares, one maybe on the CPU)
 *       or, for a mixture-of-experts layer (model.h: a moe group, then one group per expert):
 *       backend_moe_route(be, &moe_w[l]);                              // norm, router, top-k per token
 *       backend_moe_expert(be, &expert_w[l][e], e);                    // for experts in increasing order
 *       backend_moe_end(be);                                           // the weighted sum into the residual
 *   backend_logits(be, &head_w, out);                                  // final norm, lm_head, last token
 *
 * Weights: a struct weight_tensor per role says where the tensor's bytes can be read (host
 * memory, device memory or both), its format and its shape. A backend reads its own place
 * (backend_weight_place: host for the C backend, the GPU weight window's device memory for
 * CUDA), except the embedding table, which is always read on the host (rows are gathered there
 * and copied up, so the table needs no GPU memory).
 *
 * KV arena: the backend owns n_kv_blocks blocks of backend_kv_block_bytes (device memory for
 * CUDA). Block b holds block_tokens tokens of one layer: K as (block_tokens, n_kv_heads,
 * head_dim) then V likewise, in kv_dtype. attn_blocks accumulates attention of the batch's
 * queries over the listed blocks with an online softmax (running max and sum per query and
 * head), applying the causal mask from each span's positions, so a layer's context can be
 * visited in pieces and the result is the same as one pass over all of it. Every block holding
 * positions < pos0 + n must be visited exactly once between attn_begin and attn_end, including
 * the blocks the batch itself wrote.
 *
 * Errors: functions return 0 or a negative errno and leave a message readable through
 * backend_error(). Calls out of order (attn_begin before embed, ...) and arguments out of range
 * are refused with -EINVAL before the implementation sees them.
 */
#ifndef GPU_RUNNER_BACKEND_H
#define GPU_RUNNER_BACKEND_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/model.h"
#include "services/gpu-runner/sampler.h"
#ifdef __cplusplus
extern "C" {
#endif

struct backend;
/* The CUDA runtime's stream type (cudaStream_t is a pointer to it), named here so that C code
 * without the CUDA headers can hold one. */
struct CUstream_st;

/* Matrix-vector kernel for decode steps on the CUDA backend (comparisons and benchmarks).
 * Block-quantized weights (GGUF) have a GEMV of their own for up to a few tokens; every choice
 * but BACKEND_GEMV_CUBLAS uses it, which dequantizes to BF16 for cuBLAS instead. */
enum backend_gemv {
	BACKEND_GEMV_DEFAULT = 0, /* the backend's choice (CUDA: one row per warp; one-token products of
				   * Q4_K, Q6_K, Q8_0 weights with x quantized to int8, as BACKEND_GEMV_DP4A) */
	BACKEND_GEMV_CUBLAS = 1,  /* no GEMV kernel: cuBLAS for decode too */
	BACKEND_GEMV_ROWS1 = 2,	  /* the GEMV kernel, one weight row per warp; quantized weights with float x */
	BACKEND_GEMV_ROWS2 = 3,	  /* the GEMV kernel, two rows per warp; quantized weights with float x */
	BACKEND_GEMV_DP4A = 4,	  /* one-token products with Q4_K, Q6_K or Q8_0 weights take x quantized to
				   * int8 per 32 values (integer dot products), the weights copied through
				   * shared memory several items ahead (cp.async) where 16-byte aligned */
	BACKEND_GEMV_DP4A_REGS = 5, /* the same integer products with the weights loaded into registers
				     * (two items ahead per warp) */
};

/* Attention of prefill chunks on the CUDA backend. */
enum backend_attn {
	BACKEND_ATTN_DEFAULT = 0, /* tensor cores where they apply (BF16 KV, head_dim 64 or 128) */
	BACKEND_ATTN_SIMPLE = 1,  /* the CUDA-core kernel for every chunk */
};

/* How the CUDA backend chains the kernels of a step (comparisons and benchmarks). */
enum backend_fuse {
	BACKEND_FUSE_DEFAULT = 0, /* kernels launch with programmatic dependent launch (each may start as
				   * the one before ends), and one-token integer products compute their x
				   * (RMSNorm, attention output) while staging it instead of after a kernel of
				   * its own */
	BACKEND_FUSE_NONE = 1,	  /* every kernel alone, after the one before has ended */
	BACKEND_FUSE_LATE_KV = 2, /* the default, but decode attention loads the keys of earlier steps
				   * after the kernel before has ended, not before (comparisons) */
	BACKEND_FUSE_ONE_KEY_WARP = 3, /* the default, but the CUDA-core attention gives each query one
					* warp for a tile's keys, not two (comparisons) */
	BACKEND_FUSE_NARROW_DQ = 4, /* the default, but one-token integer products run in blocks of one
				     * row group each, every block staging x (comparisons) */
	BACKEND_FUSE_APART_DQ = 5,  /* the default, but a one-token integer product of parts in two
				     * formats (a Q4_K_M layer's q/k and v) is a launch a format
				     * (comparisons) */
	BACKEND_FUSE_WIDE_QKV = 6,  /* the default, but the one-token q/k/v products run in wide blocks
				     * like the others, not in blocks of one row group (comparisons) */
	BACKEND_FUSE_ANY_ITEMS = 7, /* the default, but one-token integer products walk rows of whole
				     * steps with the general walk (tails, a block's checks) as other
				     * rows take (comparisons) */
	BACKEND_FUSE_ROWS_APART = 8, /* the default, but a wide block's row-group blocks are the grid's
				      * width apart, not side by side, so the row-group blocks that walk
				      * one row group more than the others spread over the multiprocessors
				      * (dq_sm_kernel's wide launches, not those of two formats; a trial:
				      * comparisons) */
};

/* How the CUDA backend's stream hands the CPU share of a split FFN to the pool
 * (cuda/cpu_handoff.h): stream memory operations, or host functions. */
enum backend_cpu_handoff {
	BACKEND_HANDOFF_DEFAULT = 0,  /* memops where the driver and device have them, else hostfunc */
	BACKEND_HANDOFF_HOSTFUNC = 1, /* cudaLaunchHostFunc */
	BACKEND_HANDOFF_MEMOPS = 2,   /* cuStreamWriteValue32 / cuStreamWaitValue32; refused where missing */
};

struct task_pool; /* cpu-compute/task_pool.h */

struct backend_params {
	uint32_t max_chunk;	 /* most tokens per forward step */
	uint32_t block_tokens;	 /* tokens per KV block */
	uint32_t n_kv_blocks;	 /* blocks in the KV arena */
	uint32_t kv_dtype;	 /* enum dtype of K and V in the arena (DT_F32 on the C backend) */
	uint32_t threads;	 /* CPU threads for the C backend (0 or 1: none) */
	uint32_t gemv;		 /* enum backend_gemv */
	uint32_t attn;		 /* enum backend_attn */
	uint32_t fuse;		 /* enum backend_fuse */
	/* The CPU share of split FFNs (FFN_SPLIT_CPU): the pool it runs on (borrowed: it must outlive
	 * the backend; NULL: no CPU share, such a split is refused) and, on the CUDA backend, how the
	 * stream hands it over (enum backend_cpu_handoff). */
	struct task_pool *cpu_pool;
	uint32_t cpu_handoff;
	bool cpu_result_mapped; /* the CPU's partial result read by a kernel from mapped host memory
				 * (cuda/cpu_handoff.h, mapped_out) instead of copied up; the runner's
				 * default (--cpu-result mapped) */
	bool cpu_result_polled; /* ... by a kernel that also waits for the job, polling its completion
				 * word in mapped memory (memops; --cpu-result polled) */
	bool cpu_dispatch_poll; /* memops: the host thread waiting for a step's end hands the pool the
				 * split FFNs' jobs too, beside the dispatcher (--cpu-dispatch both, all) */
	bool cpu_dispatch_workers; /* memops: so do the pool's idle workers while they spin between jobs
				    * (--cpu-dispatch workers, all) */
	uint64_t cpu_prefetch;	   /* with those: the weight bytes of the next split FFN's CPU share the
				    * idle workers read into the caches before its input comes (0: none;
				    * --cpu-prefetch) */
	bool cpu_expert_taper;	/* a routed expert's CPU job tapers its chunks (ffn_share_job.taper; the
				 * runner's default, --cpu-expert-chunks taper) */
	uint64_t cpu_expert_chunk; /* about the weight bytes a chunk of such a job reads
				    * (ffn_share_threads_for_chunk; 0: FFN_SHARE_CHUNK_BYTES) */
	bool experts_apart;	/* CUDA, one token: each expert the GPU keeps launched at its visit
				 * (--experts-apart), not a layer's together at moe_end */
	bool moe_host_route;	/* CUDA: every layer routed on the host (--moe-host-route), none by
				 * moe_layer */
};

/* Where a weight tensor's bytes can be read. */
enum weight_place {
	PLACE_HOST = 0,	  /* host memory: the weight ring (shared memory) or a copy in this process */
	PLACE_DEVICE = 1, /* device memory of the backend: the GPU weight window */
	PLACE_COUNT = 2,
};

/* One weight tensor as a backend reads it: `rows` rows of `cols` elements each, stored in
 * `format`, each row row_bytes after the one before (block formats store whole blocks of
 * dtype_block_elems elements). A vector (a norm weight) is one row. A slice holds rows
 * [row0, row0 + rows) and columns [col0, col0 + cols) of the checkpoint's tensor (col0 a multiple
 * of the format's block); a whole tensor has row0 = col0 = 0. Only the shares of a split FFN
 * (struct ffn_split) are slices. */
struct weight_tensor {
	const void *data[PLACE_COUNT]; /* element (row0, col0)'s first byte where it can be read, NULL where not */
	uint32_t format;	       /* enum dtype */
	uint32_t row0;		       /* first row held */
	uint32_t rows;		       /* rows held; 0: the group has no such tensor */
	uint32_t col0;		       /* first column held */
	uint32_t cols;		       /* elements per row */
	uint64_t row_bytes;	       /* bytes from one row to the next (>= the bytes of cols elements) */
};

/* Where the second share of a split FFN is computed (struct ffn_split). */
enum ffn_split_where {
	FFN_SPLIT_NONE = 0,    /* no split: the group's gate, up and down are whole */
	FFN_SPLIT_CPU = 1,     /* on the CPU task pool (backend_params.cpu_pool), from host memory in place, while
				* the backend computes the first share (decode steps) */
	FFN_SPLIT_BACKEND = 2, /* by the backend itself, from its own place, after the first share (prefill of a
				* layer whose second share has a copy on the device) */
	FFN_SPLIT_GIVEN = 3,   /* an expert's FFN_SPLIT_CPU share handed to the pool already
				* (backend_moe_expert_cpu_share): what an implementation's moe_expert sees at the
				* expert's visit in place of FFN_SPLIT_CPU, computing the first share only; never a
				* caller's */
};

/* Tokens a step may have for its FFN to be split with FFN_SPLIT_CPU (the CPU computes one product per
 * token: past a few tokens it is slower than copying the rows over). */
#define FFN_SPLIT_MAX_TOKENS 16

/* An FFN computed in two shares along the intermediate dimension ffn_dim. The group's own gate,
 * up and down (group_weights.t) hold the first share, intermediate rows [0, r): gate and up rows
 * [0, r) (rows = r), down's columns [0, r) (cols = r). The tensors here hold the second, [r,
 * ffn_dim): gate and up rows [r, ffn_dim) (row0 = r), down's columns [r, ffn_dim) (col0 = r). As
 * down(silu(gate x) * up x) sums over the intermediate dimension, the FFN is the sum of the two
 * shares' down products, each added into the residual stream. r is a multiple of
 * ffn_split_unit(down's format), below ffn_dim; r = 0 gives the whole FFN to the second share (the
 * group's gate, up and down are then not read, and may be absent). Both shares have the same
 * formats; the second is read at the backend's place (FFN_SPLIT_BACKEND) or in host memory
 * (FFN_SPLIT_CPU). */
struct ffn_split {
	uint32_t where;		     /* enum ffn_split_where */
	uint32_t r;		     /* intermediate rows of the first share */
	struct weight_tensor gate;   /* rows [r, ffn_dim) */
	struct weight_tensor up;     /* rows [r, ffn_dim) */
	struct weight_tensor down;   /* columns [r, ffn_dim) of every row */
};

/* Weights of one group, by role; roles the group does not have have rows == 0. For the head
 * group, t[ROLE_LM_HEAD] is the embedding table when embeddings are tied. An FFN group's split
 * says whether its FFN is computed in two shares (where FFN_SPLIT_NONE: not). */
struct group_weights {
	struct weight_tensor t[ROLE_COUNT];
	struct ffn_split split;
	bool resident;	/* set by the GPU window for a group it keeps for good (its acquire; false from
			 * every other source): the device copy stays where it is to the step's end, so a
			 * backend may still read it after the group's release, as the CUDA backend does
			 * with a layer's kept experts (launched together at moe_end) */
};

/* What r of a split FFN must be a multiple of, for a down projection in format `down`: its block
 * (256 for the K formats, 32 for Q8_0 and Q4_0), 64 for the element formats (rows of 16-byte
 * multiples for the GPU's loads). */
static inline uint32_t ffn_split_unit(enum dtype down)
{
	return dtype_is_element(down) ? 64u : dtype_block_elems(down);
}

/* Describes a whole tensor of `format` and shape (rows, cols) at data in place. */
void weight_tensor_set(struct weight_tensor *t, enum weight_place place, const void *data, enum dtype format,
		       uint32_t rows, uint32_t cols);

/* The tokens of one forward step: token i is tokens[i] at position pos[i] of sequence seq[i]. The
 * tokens of a sequence are one run of the batch, at consecutive positions (pos[i + 1] == pos[i] + 1
 * within it); a sequence id appears in one run only. One run, unless the backend batches sequences
 * (backend_batches_sequences). */
struct backend_batch {
	uint32_t n;
	const int32_t *tokens;	/* (n) token ids */
	const uint32_t *pos;	/* (n) positions */
	const uint32_t *seq;	/* (n) sequence ids */
};

/* A run of positions held by one arena block: positions pos0 .. pos0+n_tokens-1 are rows
 * 0 .. n_tokens-1 of block `block`; the queries of the step's rows [row0, row0 + n_rows) attend to
 * them (their sequence's KV), or every row's with n_rows 0. */
struct kv_span {
	uint32_t block;
	uint32_t pos0;
	uint32_t n_tokens;
	uint32_t row0, n_rows;
};

#define KV_EVENTS_IN_FLIGHT 64 /* commits a runner may have unanswered (kv_remote.h) */
#define BACKEND_EVENT_BYTES 64 /* an interprocess event handle (kv_write_behind) */

/* ---- creating one ---------------------------------------------------------------------- */

/* The backends built into this binary, by name ("cpu", "cuda"). backend_known is false for an
 * unknown name and for "cuda" where nvcc was absent at build time. */
bool backend_known(const char *name);
/* Does backend `name` take several sequences in one step (backend_batches_sequences)? False for an
 * unknown name. */
bool backend_name_batches(const char *name);
/* "cuda" when the CUDA backend is built and a GPU is present, else "cpu". */
const char *backend_default_name(void);
/* Makes CUDA device `gpu` the current one of this process (for backend `name`; "cpu" computes on no
 * device and refuses). Before the backend is made. Returns 0, or -EINVAL / -ENODEV with err set. */
int backend_use_device(const char *name, int gpu, char *err, size_t errlen);
/* Bytes of one arena block of backend `name` for cfg and p (so the runner can size the arena
 * before it creates the backend); 0 for an unknown name. */
size_t backend_kv_block_bytes(const char *name, const struct model_config *cfg, const struct backend_params *p);

/* Creates backend `name` for cfg (copied). Returns 0 with *out owned by the caller
 * (backend_destroy), or -errno with *out NULL and a message in err: -ENOENT for a backend this
 * binary does not have, -EINVAL / -ENOTSUP for a configuration it cannot compute, -ENOMEM. */
int backend_create(const char *name, const struct model_config *cfg, const struct backend_params *p,
		   struct backend **out, char *err, size_t errlen);
/* Frees the backend (waiting for its device work first); NULLs *be; safe on NULL and twice. */
void backend_destroy(struct backend **be);

const char *backend_name(const struct backend *be);
/* The last error message. */
const char *backend_error(const struct backend *be);
/* Where this backend reads weights other than the embedding table. */
enum weight_place backend_weight_place(const struct backend *be);
/* The CUDA stream compute runs on; NULL on the C backend. The GPU weight window orders its
 * copies against it with events. */
struct CUstream_st *backend_cuda_stream(const struct backend *be);

/* ---- compute --------------------------------------------------------------------------- */

/* Gathers the embeddings of the batch's tokens into the hidden state. w->t[ROLE_EMBED] is read
 * on the host on every backend (one row per token is gathered). */
int backend_embed(struct backend *be, const struct group_weights *w, const struct backend_batch *b);
/* RMSNorm, q/k/v projections, RoPE for the batch; writes token i's K and V into row dst_row[i]
 * of arena block dst_block[i]; resets the attention accumulators. */
int backend_attn_begin(struct backend *be, const struct group_weights *w, uint32_t layer, const uint32_t *dst_block,
		       const uint32_t *dst_row);
/* Accumulates attention over the spans (see above). */
int backend_attn_blocks(struct backend *be, const struct kv_span *spans, uint32_t n_spans);
/* Normalises the accumulators, applies o_proj and adds the residual. */
int backend_attn_end(struct backend *be, const struct group_weights *w);
/* A mixture-of-experts layer (cfg.n_experts > 0), after attn_end: RMSNorm (ROLE_FFN_NORM), the router
 * logits (ROLE_ROUTER) and each token's experts and weights (model.h says how), and clears the sum. */
int backend_moe_route(struct backend *be, const struct group_weights *w);
/* Expert `expert` of that layer (ROLE_EXPERT_GATE/UP/DOWN): its SwiGLU over the tokens routed to it,
 * each weighted and added into the layer's sum. Experts come in increasing order (the order of the
 * sum); an expert no token chose may be left out, and costs nothing when given. w->split
 * FFN_SPLIT_CPU (the GPU window's route, a decode step): the expert in two shares as a split FFN's
 * (struct ffn_split, with the expert's rows), the second computed by the CPU pool from host memory,
 * each share's output weighed and summed; only a backend that computes experts on the CPU takes it
 * (-ENOTSUP otherwise). */
int backend_moe_expert(struct backend *be, const struct group_weights *w, uint32_t expert);
/* After moe_route: false when no token of the chunk chose expert `expert`, so its weights need not
 * be fetched (moe_expert would compute nothing); true when one did, and outside moe_route ..
 * moe_end or on a backend that does not say. */
bool backend_moe_expert_used(struct backend *be, uint32_t expert);
/* After moe_route of a one-token step: 1 where the backend measured how the two sides of the layer
 * routed before it (in this step, with experts on the CPU) ended, *gpu_late_ns the GPU's side's end
 * (its copied and kept experts computed) less the CPU's (its last expert done), on the host's clock:
 * > 0 the GPU's side ended last. 0 (and *gpu_late_ns 0) where it did not: no CPU expert in that
 * layer, the step's first routed layer, a backend that does not measure. */
int backend_moe_ends(struct backend *be, int64_t *gpu_late_ns);
/* Expert `expert` computed by the CPU from host memory (w's tensors at PLACE_HOST: the weight
 * ring in place); its result joins the sum by moe_end. The CPU's experts come in increasing order
 * among themselves (the order of their sum), before or between the GPU's; each expert once.
 * Needs backend_params.cpu_pool and a step of at most FFN_SPLIT_MAX_TOKENS tokens; -ENOTSUP on a
 * backend that does not compute experts on the CPU. */
int backend_moe_expert_cpu(struct backend *be, const struct group_weights *w, uint32_t expert);
/* The CPU's share of expert `expert` split with it (s->where FFN_SPLIT_CPU: rows [s->r, F) of gate and
 * up and those columns of down, in host memory in place), handed to the pool now, between moe_route
 * and the expert's visit, so that the CPU starts on it at the route rather than at the visit. That
 * visit's backend_moe_expert must carry the same split (its second share is not given again; a
 * visit of the whole expert or another r is refused, -EPROTO). Among the CPU's experts in increasing
 * order, as backend_moe_expert_cpu's (the order of their sum), and before the GPU's next expert.
 * -ENOTSUP on a backend that does not split experts with the CPU. */
int backend_moe_expert_cpu_share(struct backend *be, const struct ffn_split *s, uint32_t expert);
/* Adds the layer's sum into the residual stream. */
int backend_moe_end(struct backend *be);
/* A mixture-of-experts layer whose every expert stays in device memory, routed without the host
 * (the CUDA backend; the host's route waits for the router's logits). moe_layer_experts gives the
 * layer's experts once: experts[e] for each of cfg.n_experts, their tensors at PLACE_DEVICE, which
 * must stay where they are until the same call with experts NULL (which forgets them) or the
 * backend's end. Then a step of one token may compute the layer with moe_layer (after attn_end,
 * in place of moe_route .. moe_end): the same choice and sum as those, on the device. -ENOTSUP
 * (with a message) where it cannot: another backend, experts whose formats do not go in one
 * launch, more than 8 experts a token, --experts-apart or --moe-host-route; the caller routes that
 * layer on the host. */
int backend_moe_layer_experts(struct backend *be, uint32_t layer, const struct group_weights *experts);
int backend_moe_layer(struct backend *be, const struct group_weights *w, uint32_t layer);
/* The experts moe_layer chose for `layer` in this step (cfg.n_experts_used ids, increasing), after the step's last call and before backend_moe_check: waits for the device.
 * -ENODATA where moe_layer did not compute that layer since the last check. */
int backend_moe_layer_chosen(struct backend *be, uint32_t layer, uint32_t *ids);
/* Experts the CUDA backend's pool computes at once (moe_expert_cpu waits for the oldest beyond it). */
#define BACKEND_MOE_CPU_JOBS 8
/* After a failed step: waits for the CPU work the step handed over (the experts the CPU still
 * computes, which read host memory that may go away once the step has failed; a split FFN's
 * share) and forgets its results and failures, so that none is taken for the next step's. Safe at
 * any time; the next moe_route starts afresh. */
void backend_settle(struct backend *be);
/* At the end of a step that went well: waits for the experts the CPU computed whose results the
 * device took without the host (the CUDA backend, one token: the stream waits for them) and
 * returns 0, or the first of them that failed (-errno, message in backend_error): the step's
 * result is then wrong. A step whose output the host waited for has had them checked already. */
int backend_moe_check(struct backend *be);
/* post-attention RMSNorm, SwiGLU (down(silu(gate x) * up x)), residual add. With w->split.where
 * set, the FFN is computed in two shares (struct ffn_split): FFN_SPLIT_CPU needs a step of at most
 * FFN_SPLIT_MAX_TOKENS tokens and backend_params.cpu_pool. A failure of the CPU's share shows
 * here on the C backend, and at the step's end (logits) on CUDA, which does not wait for it on
 * the host. */
int backend_ffn(struct backend *be, const struct group_weights *w);
/* Final RMSNorm and lm_head for the batch's last token: out holds vocab_size floats (host
 * memory). */
int backend_logits(struct backend *be, const struct group_weights *w, float *out);
/* Does the backend take several sequences in one step (struct backend_batch, kv_span's rows,
 * logits_rows)? */
bool backend_batches_sequences(const struct backend *be);
/* Final RMSNorm and lm_head for rows rows[0..n_rows) of the step (increasing, each < the batch's n: the
 * last row of each sequence that wants its next token): out holds n_rows x vocab_size floats (host
 * memory), row by row. -ENOTSUP on a backend that does not batch sequences. */
int backend_logits_rows(struct backend *be, const struct group_weights *w, const uint32_t *rows, uint32_t n_rows,
			float *out);
/* The same, but only the id of the largest logit (lowest id on ties) comes back to the host:
 * computed on the device where the backend can, so the vocabulary does not cross the bus. */
int backend_logits_argmax(struct backend *be, const struct group_weights *w, int32_t *token);
/* Can the backend draw tokens where the logits are (backend_logits_sample)? */
bool backend_samples_on_device(const struct backend *be);
/* A row's next token for backend_logits_pick_rows: its argmax (sp NULL), or a draw with
 * sp (temperature > 0) and the uniform u, as backend_logits_sample makes it. */
struct backend_pick {
	const struct sampler_params *sp;
	double u;
};
/* Can the backend pick the tokens of several rows where their logits are
 * (backend_logits_pick_rows)? */
bool backend_picks_rows(const struct backend *be);
/* logits_rows, then each row's token picked where the logits are (picks[i] for rows[i]), so only
 * n_rows token ids cross the bus: tokens[i]. The same tokens as logits_argmax and logits_sample
 * give for those logits. -ENOTSUP where the backend cannot (backend_picks_rows). */
int backend_logits_pick_rows(struct backend *be, const struct group_weights *w, const uint32_t *rows,
			     uint32_t n_rows, const struct backend_pick *picks, int32_t *tokens);
/* Like logits, then a draw where the logits are, so only the token id crosses the bus.
 * z = logits / sp->temperature; top_k keeps the tokens whose z is at least the k-th largest
 * (ties at the boundary all stay); weights exp(z - max z); top_p keeps the tokens whose weight
 * is at least the largest threshold that still leaves top_p of the mass; min_p keeps weights
 * of at least min_p; then the token where the running sum of kept weights, in id order, passes
 * u (in [0, 1)) times their total. (0 / >= 1 switch a filter off as in sampler.h; the same
 * distribution as the sampler, drawn another way.) -ENOTSUP where the backend cannot. */
int backend_logits_sample(struct backend *be, const struct group_weights *w, const struct sampler_params *sp,
			  double u, int32_t *token);

/* ---- a stage of a model split across runners (stages/stages.h) ----------------------------
 * The hidden state (the residual stream) is max_chunk rows of dim float32 in the backend's memory.
 * A stage that does not start with the embedding takes the previous stage's rows instead; a stage
 * hands its rows to the next one at the end of its layers. */

/* Starts a step without the embedding: the batch b as backend_embed takes it, its hidden state (b->n
 * rows of dim float32) from x in host memory, or, x NULL, as a link left it in the backend's own
 * memory (backend_hidden_device). attn_begin, ffn, moe_route or logits may follow. */
int backend_hidden_in(struct backend *be, const struct backend_batch *b, const float *x);
/* Copies rows [row0, row0 + n) of the step's hidden state to host memory x (n * dim float32), once
 * what was queued before has computed them. Between layers (after embed or hidden_in, not inside a
 * layer's calls). */
int backend_hidden_get(struct backend *be, uint32_t row0, uint32_t n, float *x);
/* Overwrites rows [row0, row0 + n) of the step's hidden state from host memory x (the last stage's
 * rows coming back before the head); x may be reused on return. Between layers, as hidden_get. */
int backend_hidden_put(struct backend *be, uint32_t row0, uint32_t n, const float *x);
/* The hidden state in device memory (max_chunk rows of dim float32) for a link that moves it device to
 * device, and the stream that orders work on it; -ENOTSUP on a backend without device memory. */
int backend_hidden_device(struct backend *be, float **x, struct CUstream_st **stream);
/* Waits for everything queued so far and reports what the device flagged in it (a stage that ends
 * without a head: its step's failures show here, as they show at logits otherwise). */
int backend_finish(struct backend *be);

/* Longest gap between one step's last CPU experts and the next step's first routing that counts as
 * the token's ends (backend_cpu_share_stats.experts_step_gap_ms); longer, the steps are apart. */
#define MOE_STEP_GAP_MAX_MS 50

/* What the CPU share of split FFNs has done since the backend was made (all zero without one). */
#define BACKEND_HANDOFF_BUCKETS 6
struct backend_cpu_share_stats {
	char handoff[16];    /* how it is handed over: "memops", "hostfunc" (CUDA), "direct" (the C backend), "none" */
	uint64_t jobs;	     /* CPU shares computed (a failed one included) */
	uint64_t failed;     /* of which failed */
	uint64_t bytes;	     /* weight bytes they read */
	double cpu_ms;	     /* their time on the CPU, first part's start to last part's end, summed */
	double phase_wait_ms; /* their parts' waits for a job's first phase to end (ffn_share_stats:
			       * workers idle), summed over parts */
	uint64_t timed;	     /* split FFNs timed on the CUDA stream (each, while its ring of timings has room) */
	double stream_ms;    /* those FFNs' time on the stream, from x's copy down to the partial's add, summed */
	double wait_ms;	     /* of which the stream waited for the CPU and its result's copy up, summed */
	/* The timed FFNs by their handoff (stream time less their job's time on the CPU), in us:
	 * [0, 50), [50, 100), [100, 200), [200, 500), [500, 1000), 1000 and more. */
	uint64_t handoff_hist[BACKEND_HANDOFF_BUCKETS];
	uint64_t dispatched;  /* jobs timed on the host's clock (cuda/cpu_handoff.h's stats) */
	double dispatch_ms, dispatch_max_ms; /* from a job's dispatch to its first part: summed, the largest */
	double gap_ms;	      /* from a job's end to the next one's start (the pool without a job), summed */
	uint64_t gaps;
	uint64_t host_late;   /* jobs the stream reached before the host had submitted them */
	uint64_t dispatch_stalls; /* the handoff's dispatcher off its CPU 100 us or more while it waited */
	double dispatch_stall_ms; /* for a trigger: how often, and their time */
	uint64_t dispatched_by_poll; /* jobs the host thread waiting for the step handed over (--cpu-dispatch both) */
	uint64_t dispatched_by_workers; /* jobs the pool's idle workers handed over (--cpu-dispatch workers) */
	uint64_t prefetched;	/* weight bytes the idle workers read ahead (--cpu-prefetch) */
	/* Mixture-of-experts layers (CUDA). */
	uint64_t experts;    /* routed experts the CPU computed */
	double experts_ms;   /* the host's time computing them (moe_end), summed */
	double route_wait_ms; /* the host's time waiting for the router logits (moe_route), summed: with the
			       * CPU's experts waited for on the stream, the end of the layer before's too */
	double route_wait_step_ms; /* ... of it in steps of at most FFN_SPLIT_MAX_TOKENS tokens (decode
				    * steps: the ones the CPU takes experts in), not a prompt's chunks */
	double experts_span_ms; /* a layer's CPU experts from the first one's submission to the last one's
				 * end, summed over the one-token steps' layers that had any */
	uint64_t expert_layers; /* those layers */
	uint64_t experts_span_bytes; /* the weight bytes of their CPU experts */
	/* The same in steps of several tokens (a prompt's remainder, several sequences at once): each
	 * weight byte computed for every token, so their rate is their own. */
	double experts_span_ms_multi;
	uint64_t expert_layers_multi, experts_span_bytes_multi;
	double experts_phase_wait_ms; /* the experts' jobs' parts waiting for their first phase to end
				       * (workers idle), summed over parts */
	/* From a layer's last CPU expert's end to the next layer's first submission, in the same step
	 * (the chain the CPU waits out between two layers): to the return of the host's wait for the
	 * next routing (the stream's wait, the combine, the attention and router on the GPU), then to the
	 * first expert handed to the pool (the host's route), summed over the expert_gaps seen. */
	double experts_gap_gpu_ms, experts_gap_host_ms;
	uint64_t expert_gaps;
	/* The same from a step's last layer's CPU experts to the next step's first layer's (the
	 * token's ends: the head, the pick, the next step's first layers), where the next step routes
	 * within MOE_STEP_GAP_MAX_MS (50) of them: their time, summed, and their count. */
	double experts_step_gap_ms;
	uint64_t expert_step_gaps;
	/* Of experts_step_gap_ms, the part before the step's return (its output on the host): the last
	 * layer's GPU work after its CPU experts, the head and the pick; the rest is the host's between
	 * the steps and the next step up to its first routing. */
	double experts_step_tail_ms;
	/* The first routing of a step of at most FFN_SPLIT_MAX_TOKENS tokens after such a step that
	 * returned within MOE_STEP_GAP_MAX_MS: the host's time from that return to the router's launch, then its wait for
	 * the routing (none where the step's first MoE layer routes on the device: every expert of it
	 * kept); on the GPU's clock, from the return to the embedding's end, from there to the
	 * router's first kernel (the first attention), and the router's kernels; summed over
	 * step_begins. */
	double step_begin_host_ms, step_begin_wait_ms;
	double step_begin_gpu_embed_ms, step_begin_gpu_attn_ms, step_begin_gpu_router_ms;
	uint64_t step_begins;
};

/* Fills out (zeros and "none" where the backend has no CPU share). Never fails. */
void backend_get_cpu_share_stats(struct backend *be, struct backend_cpu_share_stats *out);

/* ---- KV copies ------------------------------------------------------------------------- */

/* Copies n arena blocks to host buffers of backend_kv_block_bytes; returns once all are
 * complete. */
int backend_kv_to_host(struct backend *be, uint32_t n, const uint32_t *blocks, void *const *dsts);
/* Copies n host buffers into arena blocks; returns once all are complete (the host buffers may
 * be reused). */
int backend_kv_from_host(struct backend *be, uint32_t n, const uint32_t *blocks, const void *const *srcs);
/* The write-behind: backend_kv_to_host without waiting where the backend can. The copies are
 * queued behind the compute that wrote the blocks, then an interprocess event is recorded after
 * them and its handle (BACKEND_EVENT_BYTES) written to event_handle: whoever waits on it (the
 * kv-store) knows the bytes are in host memory; later work that reuses the blocks is ordered
 * after the copies on the device. A small set of events is re-recorded round-robin: a handle
 * stays meaningful for at least the next KV_EVENTS_IN_FLIGHT calls. Returns 1 when an event
 * was recorded, 0 when the copies are complete on return (no event: the C backend), -errno. */
int backend_kv_write_behind(struct backend *be, uint32_t n, const uint32_t *blocks, void *const *dsts,
			    void *event_handle);
/* The read-ahead (kv_cache.h): queues copies of n host buffers into arena blocks behind every
 * compute queued so far (so the blocks' earlier readers are done before they are overwritten),
 * and returns at once; slot (0 or 1) names the batch to wait for. Several calls may share a
 * slot: a wait covers all of them. The host buffers must stay as they are until
 * backend_kv_prefetch_wait(slot) returns; nothing may read the blocks before it does. A backend
 * without a copy engine copies at once and waits for nothing. */
int backend_kv_prefetch(struct backend *be, uint32_t n, const uint32_t *blocks, const void *const *srcs,
			uint32_t slot);
int backend_kv_prefetch_wait(struct backend *be, uint32_t slot);
/* Waits until no KV copy (write-behind, read-ahead, or one a failed call left queued) touches
 * host memory any more: before pool blocks a copy may still use are handed back, and before
 * the pool is unregistered or unmapped. */
int backend_kv_sync(struct backend *be);
/* Page-locks host memory the backend will copy to and from (the KV pool), so its copies run at
 * the link's speed (nothing to do on the C backend); unpin_host before that memory is
 * unmapped. */
int backend_pin_host(struct backend *be, void *p, size_t bytes);
void backend_unpin_host(struct backend *be, void *p);

#ifdef __cplusplus
}
#endif
#endif

/* backend.h - the compute interface of the gpu-runner: one implementation per device.
 *
 * backend_ref.c is the plain C reference (float32 accumulation, any weight dtype), which
 * runs the whole pipeline in CI and is the oracle for the CUDA backend (backend_cuda.cu).
 * The engine (engine.c) drives a backend group by group, so the same forward pass works
 * whether weights are all resident or streamed, and whether the KV of a layer fits the
 * backend's KV arena or is brought in a few blocks at a time.
 *
 * One forward step processes a chunk of n tokens at positions pos0..pos0+n-1 (n = prompt
 * chunk in prefill, 1 in decode):
 *
 *   be->ops->embed(be, &embed_w, tokens, n, pos0);
 *   for each layer l:
 *       be->ops->attn_begin(be, &attn_w[l], l, dst_block, dst_row);  // q,k,v; RoPE; new K,V into the arena
 *       be->ops->attn_blocks(be, spans, n_spans);                       // as often as needed, any order
 *       be->ops->attn_end(be, &attn_w[l]);                              // o_proj + residual
 *       be->ops->ffn(be, &ffn_w[l]);                                    // norm, SwiGLU, residual
 *   be->ops->logits(be, &head_w, out);                                  // final norm, lm_head, last token
 *
 * Weights: t[] points at memory the backend computes from: the weight ring's host memory for
 * the C backend; device memory of the GPU weight window for CUDA, except t[ROLE_EMBED], which
 * is always host memory (rows are gathered on the host and copied up, so the embedding table
 * needs no GPU memory).
 *
 * KV arena: the backend owns n_kv_blocks blocks of kv_block_bytes (device memory for CUDA).
 * Block b holds block_tokens tokens of one layer: K as (block_tokens, n_kv_heads, head_dim)
 * then V likewise, in kv_dtype. attn_blocks accumulates attention of the chunk's queries
 * over the listed blocks with an online softmax (running max and sum per query and head),
 * applying the causal mask from each span's positions, so a layer's context can be visited
 * in pieces and the result is the same as one pass over all of it. Every block holding
 * positions < pos0 + n must be visited exactly once between attn_begin and attn_end,
 * including the blocks the chunk itself wrote.
 *
 * Errors: functions return 0 or a negative errno and leave a message readable through
 * ops->error(be).
 */
#ifndef GPU_RUNNER_BACKEND_H
#define GPU_RUNNER_BACKEND_H
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/model.h"
#ifdef __cplusplus
extern "C" {
#endif

struct backend;

struct backend_params {
	uint32_t max_chunk;	 /* most tokens per forward step */
	uint32_t block_tokens;	 /* tokens per KV block */
	uint32_t n_kv_blocks;	 /* blocks in the KV arena */
	uint32_t kv_dtype;	 /* enum dtype of K and V in the arena (DT_F32 on the C backend) */
	uint32_t threads;	 /* CPU threads for the C backend (1: none) */
};

/* Weights of one group: pointers the backend can read (host memory for the C backend,
 * device memory for CUDA), NULL for roles the group does not have. For the head group,
 * t[ROLE_LM_HEAD] is the embedding table when embeddings are tied. */
struct group_weights {
	const void *t[ROLE_COUNT];
	uint32_t dtype[ROLE_COUNT]; /* enum dtype of each tensor */
};

/* A run of positions held by one arena block: positions pos0 .. pos0+n_tokens-1 are rows
 * 0 .. n_tokens-1 of block `block`. */
struct kv_span {
	uint32_t block;
	uint32_t pos0;
	uint32_t n_tokens;
};

struct backend_ops {
	const char *name; /* "cpu", "cuda" */
	/* Creates a backend for cfg. Returns 0 or -errno with a message in err. */
	int (*create)(const struct model_config *cfg, const struct backend_params *p, struct backend **out,
		      char *err, size_t errlen);
	void (*destroy)(struct backend **be);

	/* Bytes of one arena block for cfg and params (so the runner can size the arena). */
	size_t (*kv_block_bytes)(const struct model_config *cfg, const struct backend_params *p);
	/* Copies arena block b to / from host memory of kv_block_bytes (for the kv-store pool). */
	int (*kv_to_host)(struct backend *be, uint32_t block, void *dst);
	int (*kv_from_host)(struct backend *be, uint32_t block, const void *src);

	/* Gathers the embeddings of tokens[0..n) into the hidden state; the chunk sits at pos0.
	 * w->t[ROLE_EMBED] is host memory on every backend (one row per token is gathered). */
	int (*embed)(struct backend *be, const struct group_weights *w, const int32_t *tokens, uint32_t n,
		     uint32_t pos0);
	/* RMSNorm, q/k/v projections, RoPE for the chunk; writes token i's K and V into row
	 * dst_row[i] of arena block dst_block[i]; resets the attention accumulators. */
	int (*attn_begin)(struct backend *be, const struct group_weights *w, uint32_t layer,
			  const uint32_t *dst_block, const uint32_t *dst_row);
	/* Accumulates attention over the spans (see above). */
	int (*attn_blocks)(struct backend *be, const struct kv_span *spans, uint32_t n_spans);
	/* Normalises the accumulators, applies o_proj and adds the residual. */
	int (*attn_end)(struct backend *be, const struct group_weights *w);
	/* post-attention RMSNorm, SwiGLU (down(silu(gate x) * up x)), residual add. */
	int (*ffn)(struct backend *be, const struct group_weights *w);
	/* Final RMSNorm and lm_head for the chunk's last token: out holds vocab_size floats
	 * (host memory). */
	int (*logits)(struct backend *be, const struct group_weights *w, float *out);
	/* Optional (NULL where the backend has none): the same, but only the id of the largest
	 * logit (lowest id on ties) comes back to the host: greedy decoding without moving the
	 * vocabulary across the bus. */
	int (*logits_argmax)(struct backend *be, const struct group_weights *w, int32_t *token);

	/* The device stream compute runs on (a cudaStream_t for CUDA), NULL on the C backend. The
	 * GPU weight window orders its copies against it with events. */
	void *(*stream)(struct backend *be);

	/* The last error message. */
	const char *(*error)(struct backend *be);

	/* Optional (NULL: the runner calls kv_to_host per block): copies n arena blocks to host
	 * buffers of kv_block_bytes and returns once all of them are complete: one wait for the
	 * batch instead of one per block. */
	int (*kv_to_host_n)(struct backend *be, uint32_t n, const uint32_t *blocks, void *const *dsts);
	/* Optional: page-lock host memory the backend will copy to and from (the KV pool), so its
	 * copies run at the link's speed; unpin_host before that memory is unmapped. */
	int (*pin_host)(struct backend *be, void *p, size_t bytes);
	void (*unpin_host)(struct backend *be, void *p);

	/* Optional: like logits, then a draw where the logits are, so only the token id crosses
	 * the bus. z = logits / temperature; top_k keeps the tokens whose z is at least the k-th
	 * largest (ties at the boundary all stay); weights exp(z - max z); top_p keeps the tokens
	 * whose weight is at least the largest threshold that still leaves top_p of the mass;
	 * min_p keeps weights of at least min_p; then the token where the running sum of kept
	 * weights, in id order, passes u (in [0, 1)) times their total. (0 / >= 1 switch a filter
	 * off as in sampler.h; the same distribution as the sampler, drawn another way.) */
	int (*logits_sample)(struct backend *be, const struct group_weights *w, float temperature, uint32_t top_k,
			     float top_p, float min_p, double u, int32_t *token);

	/* Optional: kv_to_host_n without waiting. The copies are queued behind the compute that
	 * wrote the blocks, then an interprocess event is recorded after them and its handle
	 * (KV_EVENT_HANDLE_BYTES) written to event_handle: whoever waits on it (the kv-store) knows
	 * the bytes are in host memory; later work that reuses the blocks is ordered after the
	 * copies on the device. A small set of events is re-recorded round-robin: a handle stays
	 * meaningful for at least the next KV_EVENTS_IN_FLIGHT calls. */
	int (*kv_to_host_async)(struct backend *be, uint32_t n, const uint32_t *blocks, void *const *dsts,
				void *event_handle);
	/* Optional (NULL: kv_from_host per block): copies n host buffers into arena blocks and
	 * returns once all are complete (the host buffers may be reused): one wait per batch. */
	int (*kv_from_host_n)(struct backend *be, uint32_t n, const uint32_t *blocks, const void *const *srcs);

	/* Optional, both or neither (the KV read-ahead, kv_cache.h): queues copies of n host buffers
	 * into arena blocks on the KV H2D stream, behind every compute queued so far (so the blocks'
	 * earlier readers are done before they are overwritten), and returns at once; slot (0 or 1)
	 * names the batch to wait for. Several calls may share a slot: a wait covers all of them.
	 * The host buffers must stay as they are until kv_prefetch_wait(slot) returns; nothing may
	 * read the blocks before it does. The C backend copies at once and waits for nothing. */
	int (*kv_prefetch_n)(struct backend *be, uint32_t n, const uint32_t *blocks, const void *const *srcs,
			     uint32_t slot);
	int (*kv_prefetch_wait)(struct backend *be, uint32_t slot);
	/* Optional: waits until no KV copy (write-behind, read-ahead, or one a failed call left
	 * queued) touches host memory any more: before pool blocks a copy may still use are handed
	 * back, and before the pool is unregistered or unmapped. */
	int (*kv_sync)(struct backend *be);
};

#define KV_EVENTS_IN_FLIGHT 64 /* commits a runner may have unanswered (kv_remote.h) */

/* The checks every backend's create makes first: no zero size, heads a multiple of kv heads, a
 * finite rms_norm_eps >= 0, positive chunk, block and arena sizes. name ("cpu", "cuda") starts
 * the message. Returns 0 or -EINVAL with the message in err. */
int backend_check_config(const char *name, const struct model_config *c, const struct backend_params *p, char *err,
			 size_t errlen);

/* The backends built into this binary. backend_find returns NULL for an unknown or
 * unbuilt name ("cuda" where nvcc was absent). */
extern const struct backend_ops backend_ref_ops;
const struct backend_ops *backend_find(const char *name);
/* "cuda" when the CUDA backend is built and a GPU is present, else "cpu". */
const char *backend_default_name(void);

#ifdef __cplusplus
}
#endif
#endif

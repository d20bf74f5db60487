/* backend_impl.h - what a backend implementation provides to the front (backend.c).
 *
 * An implementation defines its own `struct backend_dev` (the device state) and three tables:
 * compute, KV copies, and the impl itself. The front calls them only with arguments it has
 * checked (the call order of a forward step, layer and arena ranges, roles present in the
 * weights, readable at the implementation's place, token ids inside the vocabulary), so an
 * implementation checks only what is its own (a kernel's limits, a dtype it cannot mix).
 * Entries marked optional may be NULL: the front fills in a default once, at create, and
 * callers never see the difference.
 *
 * Every function returns 0 or -errno with a message in the device's error buffer (error()),
 * which starts with the backend's name ("cuda backend: ...").
 */
#ifndef GPU_RUNNER_BACKEND_IMPL_H
#define GPU_RUNNER_BACKEND_IMPL_H
#include "services/gpu-runner/backend.h"
#ifdef __cplusplus
extern "C" {
#endif

struct backend_dev;

struct backend_compute_ops {
	int (*embed)(struct backend_dev *d, const struct group_weights *w, const struct backend_batch *b);
	int (*attn_begin)(struct backend_dev *d, const struct group_weights *w, uint32_t layer,
			  const uint32_t *dst_block, const uint32_t *dst_row);
	int (*attn_blocks)(struct backend_dev *d, const struct kv_span *spans, uint32_t n_spans);
	int (*attn_end)(struct backend_dev *d, const struct group_weights *w);
	int (*ffn)(struct backend_dev *d, const struct group_weights *w);
	int (*logits)(struct backend_dev *d, const struct group_weights *w, float *out);
	/* Optional: default logits into a host buffer, then argmax_f32 there. */
	int (*logits_argmax)(struct backend_dev *d, const struct group_weights *w, int32_t *token);
	/* Optional: default -ENOTSUP (the runner samples on the host). */
	int (*logits_sample)(struct backend_dev *d, const struct group_weights *w, const struct sampler_params *sp,
			     double u, int32_t *token);
	/* Optional: default zeros and "none" (no CPU share). */
	void (*cpu_share_stats)(struct backend_dev *d, struct backend_cpu_share_stats *out);
	/* Optional, all three or none: default -ENOTSUP (the backend computes no mixture-of-experts
	 * layers). */
	int (*moe_route)(struct backend_dev *d, const struct group_weights *w);
	int (*moe_expert)(struct backend_dev *d, const struct group_weights *w, uint32_t expert);
	int (*moe_end)(struct backend_dev *d);
	/* Optional: default true (every expert counts as chosen). */
	bool (*moe_expert_used)(struct backend_dev *d, uint32_t expert);
	/* Optional: default -ENOTSUP (no experts on the CPU). */
	int (*moe_expert_cpu)(struct backend_dev *d, const struct group_weights *w, uint32_t expert);
	/* Optional: after a failed step, waits for the CPU work it handed over (experts, a split FFN's
	 * share) and forgets that work's results and failures. */
	void (*settle)(struct backend_dev *d);
	/* Optional (default 0): waits for the CPU's experts whose results the stream takes without the
	 * host and returns the first failure among them. */
	int (*moe_check)(struct backend_dev *d);
	/* Optional, all three or none: default -ENOTSUP (every layer routed on the host). */
	int (*moe_layer_experts)(struct backend_dev *d, uint32_t layer, const struct group_weights *experts);
	int (*moe_layer)(struct backend_dev *d, const struct group_weights *w, uint32_t layer);
	int (*moe_layer_chosen)(struct backend_dev *d, uint32_t layer, uint32_t *ids);
	/* A stage of a split model (backend.h): all three, or none (default -ENOTSUP). hidden_in sets the
	 * batch as embed does (x NULL: the hidden state is in place already); get and put copy rows. */
	int (*hidden_in)(struct backend_dev *d, const struct backend_batch *b, const float *x);
	int (*hidden_get)(struct backend_dev *d, uint32_t row0, uint32_t n, float *x);
	int (*hidden_put)(struct backend_dev *d, uint32_t row0, uint32_t n, const float *x);
	/* Optional: default -ENOTSUP (no device memory). */
	int (*hidden_device)(struct backend_dev *d, float **x);
	/* Optional: default nothing to wait for (work is done when a call returns). */
	int (*finish)(struct backend_dev *d);
	/* Optional: an implementation that has it batches sequences (backend.h: several runs in a
	 * batch, spans with rows, logits of several rows); default -ENOTSUP, and one run a batch. */
	int (*logits_rows)(struct backend_dev *d, const struct group_weights *w, const uint32_t *rows,
			   uint32_t n_rows, float *out);
	/* Optional (with logits_rows and logits_sample): default -ENOTSUP, and the runner picks the
	 * rows' tokens on the host from logits_rows. */
	int (*logits_pick_rows)(struct backend_dev *d, const struct group_weights *w, const uint32_t *rows,
				uint32_t n_rows, const struct backend_pick *picks, int32_t *tokens);
	/* Optional (with moe_expert_cpu): default -ENOTSUP. An expert's CPU share handed to the pool
	 * before its visit, whose moe_expert then has split.where FFN_SPLIT_GIVEN. */
	int (*moe_expert_cpu_share)(struct backend_dev *d, const struct ffn_split *s, uint32_t expert);
	/* Optional: default 0 (the ends of a layer's two sides not measured). */
	int (*moe_ends)(struct backend_dev *d, int64_t *gpu_late_ns);
};

struct backend_kv_ops {
	size_t (*block_bytes)(const struct model_config *cfg, const struct backend_params *p);
	int (*to_host)(struct backend_dev *d, uint32_t n, const uint32_t *blocks, void *const *dsts);
	int (*from_host)(struct backend_dev *d, uint32_t n, const uint32_t *blocks, const void *const *srcs);
	/* Optional: default to_host, returning 0 (no event). */
	int (*write_behind)(struct backend_dev *d, uint32_t n, const uint32_t *blocks, void *const *dsts,
			    void *event_handle);
	/* Optional, both or neither: default from_host now, and nothing to wait for. */
	int (*prefetch)(struct backend_dev *d, uint32_t n, const uint32_t *blocks, const void *const *srcs,
			uint32_t slot);
	int (*prefetch_wait)(struct backend_dev *d, uint32_t slot);
	/* Optional: default nothing to wait for. */
	int (*sync)(struct backend_dev *d);
	/* Optional, both or neither: default nothing to pin. */
	int (*pin_host)(struct backend_dev *d, void *p, size_t bytes);
	void (*unpin_host)(struct backend_dev *d, void *p);
};

struct backend_impl {
	const char *name;	  /* "cpu", "cuda" */
	enum weight_place place;  /* where it reads weights (the embedding table aside: host) */
	/* Creates the device state for cfg and p (checked by backend_check_config first).
	 * Returns 0 or -errno with a message in err. */
	int (*create)(const struct model_config *cfg, const struct backend_params *p, struct backend_dev **out,
		      char *err, size_t errlen);
	void (*destroy)(struct backend_dev **d);
	const char *(*error)(struct backend_dev *d);
	/* Optional: NULL on a backend without a CUDA stream. */
	struct CUstream_st *(*cuda_stream)(struct backend_dev *d);
	const struct backend_compute_ops *compute;
	const struct backend_kv_ops *kv;
};

/* The implementations built into this binary (backend.c looks them up by name). */
extern const struct backend_impl backend_ref_impl;
#ifdef PIPELINE_HAVE_CUDA
extern const struct backend_impl backend_cuda_impl;
#endif
const struct backend_impl *backend_impl_find(const char *name);
/* The implementation and device state behind a backend (for an implementation's test hooks,
 * e.g. cuda/cuda_test.h); the backend keeps both. */
const struct backend_impl *backend_impl_of(const struct backend *be);
struct backend_dev *backend_dev_of(struct backend *be);

/* The checks every backend's create gets first: no zero size, heads a multiple of kv heads, a
 * finite rms_norm_eps >= 0, positive chunk, block and arena sizes. name ("cpu", "cuda") starts
 * the message. Returns 0 or -EINVAL with the message in err. */
int backend_check_config(const char *name, const struct model_config *c, const struct backend_params *p, char *err,
			 size_t errlen);

#ifdef __cplusplus
}
#endif
#endif

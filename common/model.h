/* model.h - the description of a model that every service shares: its configuration,
 * its tensors and the weight groups they form. Plain data, no pointers, so these structs
 * are copied as they are into the weight ring in shared memory, where the gpu-runner
 * reads them (the runner never opens model files).
 *
 * Groups are the unit of weight movement. The group table (struct group_desc, in the manifest
 * and in the weight ring) is the description of a model's forward pass: groups are numbered in
 * the order a forward pass visits them, and each group's kind says what is computed with it
 * (model_groups_check states the rules). The engine walks the table, so a model whose layers
 * hold other groups (experts, slices of a tensor) adds kinds, not formulas. The dense Llama
 * layout that manifest_load builds today is
 *   0            embed   (model.embed_tokens.weight)
 *   1 + 2*l      attn(l) (input_layernorm, q_proj, k_proj, v_proj, o_proj of layer l)
 *   2 + 2*l      ffn(l)  (post_attention_layernorm, gate_proj, up_proj, down_proj)
 *   1 + 2*L      head    (model.norm, lm_head; with tied embeddings the head group holds only
 *                         the norm and the lm_head role resolves to the embed group's tensor)
 * and the group_id_* helpers below number it (the planners of the dense layout use them).
 * A mixture-of-experts model (n_experts > 0) has 2 + n_experts groups per layer instead of 2:
 *   attn(l), moe(l) (post_attention_layernorm and the router), then expert(l, e) for e = 0..E-1
 *   (that expert's gate, up and down projections; group_desc.expert says which), each expert a
 *   unit of residency of its own (CLASS_EXPERT).
 * model_group_attn/ffn/expert number either layout; group_id_attn/ffn only the dense one.
 */
#ifndef PIPELINE_MODEL_H
#define PIPELINE_MODEL_H
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#ifdef __cplusplus
extern "C" {
#endif

#define MODEL_MAX_EOS 8
#define TENSOR_NAME_MAX 96

enum model_arch {
	ARCH_LLAMA = 1,	  /* LlamaForCausalLM */
	ARCH_MISTRAL = 2, /* MistralForCausalLM */
	ARCH_QWEN3 = 3,	  /* Qwen3ForCausalLM: q_norm and k_norm per head before RoPE */
	ARCH_MIXTRAL = 4, /* MixtralForCausalLM: every layer's FFN a sparse mixture of experts */
	ARCH_QWEN3_MOE = 5, /* Qwen3MoeForCausalLM: Qwen3 attention, sparse mixture-of-experts FFNs */
};

/* model_config.flags */
#define MODEL_QK_NORM	    1u /* RMSNorm over each head of q and k (q_norm, k_norm) before RoPE */
#define MODEL_NORM_TOPK	    2u /* the chosen experts' weights renormalised to sum to 1 */
#define MODEL_MAX_EXPERTS   512u


enum rope_scaling {
	ROPE_SCALING_NONE = 0,
	ROPE_SCALING_LINEAR = 1,
	ROPE_SCALING_LLAMA3 = 2,
};

/* Which dimensions of a head RoPE rotates together. Hugging Face checkpoints pair dimension i with
 * i + head_dim/2 (rotate_half); GGUF files of the llama architecture (not qwen3, qwen3moe) store
 * the rows of wq and wk permuted so that pairs are adjacent (2i, 2i+1), the order llama.cpp's RoPE
 * expects there. Rotating adjacent pairs of the permuted rows computes the same attention scores
 * as rotating halves of the original ones (q.k is a sum over pairs, and both q and k are permuted
 * alike), so the stored bytes are used as they are. */
enum rope_layout {
	ROPE_HALVES = 0,   /* (i, i + head_dim/2), frequency i: Hugging Face */
	ROPE_ADJACENT = 1, /* (2i, 2i + 1), frequency i: GGUF */
};

struct model_config {
	uint32_t arch;		  /* enum model_arch */
	uint32_t n_layers;
	uint32_t dim;		  /* hidden_size */
	uint32_t n_heads;	  /* num_attention_heads */
	uint32_t n_kv_heads;	  /* num_key_value_heads (== n_heads without GQA) */
	uint32_t head_dim;	  /* head_dim, or dim / n_heads */
	uint32_t ffn_dim;	  /* intermediate_size */
	uint32_t vocab_size;
	uint32_t max_position;	  /* max_position_embeddings */
	float rms_eps;		  /* rms_norm_eps */
	float rope_theta;
	uint32_t rope_scaling;	  /* enum rope_scaling */
	float rope_factor;	  /* rope_scaling.factor */
	float rope_low_freq_factor;
	float rope_high_freq_factor;
	uint32_t rope_original_max_position; /* rope_scaling.original_max_position_embeddings */
	uint32_t tie_embeddings;  /* tie_word_embeddings */
	int32_t bos_id;		  /* -1 when none */
	uint32_t n_eos;
	int32_t eos_ids[MODEL_MAX_EOS];
	uint32_t sliding_window;  /* 0 when none (Mistral v0.1 sets 4096) */
	uint32_t rope_layout;	  /* enum rope_layout: how the rows of wq and wk pair up for RoPE */
	/* Mixture of experts (0 when dense). Routing: softmax over all n_experts router logits (float32),
	 * the n_experts_used largest kept, renormalised when MODEL_NORM_TOPK (always for Mixtral, whose
	 * softmax over the top-k logits is the same thing), each chosen expert's SwiGLU weighted by its
	 * probability and summed. */
	uint32_t n_experts;	  /* num_local_experts (Mixtral), num_experts (Qwen3-MoE) */
	uint32_t n_experts_used;  /* num_experts_per_tok */
	uint32_t expert_ffn_dim;  /* intermediate size of one expert (Qwen3-MoE: moe_intermediate_size) */
	uint32_t flags;		  /* MODEL_QK_NORM, MODEL_NORM_TOPK */
	uint32_t reserved[2];
};

enum tensor_role {
	ROLE_EMBED = 0,	     /* (vocab, dim) */
	ROLE_ATTN_NORM = 1,  /* (dim) */
	ROLE_WQ = 2,	     /* (n_heads*head_dim, dim) */
	ROLE_WK = 3,	     /* (n_kv_heads*head_dim, dim) */
	ROLE_WV = 4,	     /* (n_kv_heads*head_dim, dim) */
	ROLE_WO = 5,	     /* (dim, n_heads*head_dim) */
	ROLE_FFN_NORM = 6,   /* (dim) */
	ROLE_W_GATE = 7,     /* (ffn_dim, dim) */
	ROLE_W_UP = 8,	     /* (ffn_dim, dim) */
	ROLE_W_DOWN = 9,     /* (dim, ffn_dim) */
	ROLE_FINAL_NORM = 10,/* (dim) */
	ROLE_LM_HEAD = 11,   /* (vocab, dim) */
	ROLE_Q_NORM = 12,    /* (head_dim): Qwen3's RMSNorm weight over each query head */
	ROLE_K_NORM = 13,    /* (head_dim): the same over each key head */
	ROLE_ROUTER = 14,    /* (n_experts, dim): the router of a mixture-of-experts layer */
	ROLE_EXPERT_GATE = 15, /* (expert_ffn_dim, dim): one expert's gate projection */
	ROLE_EXPERT_UP = 16,   /* (expert_ffn_dim, dim) */
	ROLE_EXPERT_DOWN = 17, /* (dim, expert_ffn_dim) */
	ROLE_COUNT = 18,
};

/* What the engine computes with a group (only appended to). */
enum group_kind {
	GROUP_EMBED = 0, /* the embedding table: gathers the batch's rows */
	GROUP_ATTN = 1,	 /* a layer's attention: norm, q/k/v, RoPE, KV, o_proj, residual */
	GROUP_FFN = 2,	 /* a layer's dense feed-forward: norm, SwiGLU, residual */
	GROUP_HEAD = 3,	 /* the final norm and lm_head */
	GROUP_MOE = 4,	 /* a mixture-of-experts layer's norm and router: routes the batch's tokens */
	GROUP_EXPERT = 5, /* one expert of that layer: its SwiGLU over the tokens routed to it */
	GROUP_KIND_COUNT = 6,
};

/* Slot size classes: groups of one class share one slot size, so nothing fragments. */
enum size_class {
	CLASS_ATTN = 0,
	CLASS_FFN = 1,
	CLASS_GLOBAL = 2, /* embed and head */
	CLASS_EXPERT = 3, /* one expert of a mixture-of-experts layer (the router goes with CLASS_FFN) */
	CLASS_COUNT = 4,
};

struct tensor_desc {
	char name[TENSOR_NAME_MAX]; /* as in the checkpoint, NUL-terminated */
	uint32_t group;		    /* group id */
	uint32_t role;		    /* enum tensor_role */
	uint32_t dtype;		    /* enum dtype */
	uint32_t ndim;		    /* 1 or 2 */
	uint64_t shape[2];	    /* PyTorch order: (rows, cols), or (n, 0) */
	uint64_t nbytes;
	uint64_t slot_offset;	    /* where the first byte lies in its group's slot */
	uint32_t file_index;	    /* which checkpoint file (manifest.files; loader side) */
	uint32_t reserved;
	uint64_t file_offset;	    /* absolute offset of the first byte in that file */
};

struct group_desc {
	uint32_t kind;	     /* enum group_kind */
	uint32_t layer;	     /* layer index; 0 for embed and head */
	uint32_t size_class; /* enum size_class */
	uint32_t first_tensor;
	uint32_t n_tensors;
	uint32_t first_extent; /* read extents (manifest.h), loader side */
	uint32_t n_extents;
	uint32_t expert;     /* GROUP_EXPERT: the expert's index in its layer; else 0 */
	uint64_t slot_bytes; /* bytes the group occupies in a slot */
	uint64_t tensor_bytes; /* payload bytes (sum of nbytes), what a copy to the GPU moves */
};

/* Groups per layer: 2 (attn, ffn), or 2 + n_experts (attn, moe, the experts). */
static inline uint32_t model_layer_groups(const struct model_config *c)
{
	return 2 + c->n_experts;
}
static inline uint32_t model_n_groups(const struct model_config *c)
{
	return 2 + model_layer_groups(c) * c->n_layers;
}
/* The attention group of layer l, in either layout. */
static inline uint32_t model_group_attn(const struct model_config *c, uint32_t l)
{
	return 1 + model_layer_groups(c) * l;
}
/* Layer l's FFN group: the dense FFN, or the router group (GROUP_MOE) of a mixture of experts. */
static inline uint32_t model_group_ffn(const struct model_config *c, uint32_t l)
{
	return 2 + model_layer_groups(c) * l;
}
/* Expert e of layer l (a mixture-of-experts model only). */
static inline uint32_t model_group_expert(const struct model_config *c, uint32_t l, uint32_t e)
{
	return 3 + model_layer_groups(c) * l + e;
}
static inline uint32_t group_id_embed(void)
{
	return 0;
}
static inline uint32_t group_id_attn(uint32_t layer)
{
	return 1 + 2 * layer;
}
static inline uint32_t group_id_ffn(uint32_t layer)
{
	return 2 + 2 * layer;
}
static inline uint32_t group_id_head(const struct model_config *c)
{
	return 1 + model_layer_groups(c) * c->n_layers;
}

const char *tensor_role_name(enum tensor_role r);
/* A readable name of an architecture ("Llama", "Mistral", "Qwen3", "Mixtral", "Qwen3-MoE"), "?" for an
 * unknown one. */
const char *model_arch_name(uint32_t arch);

/* The shape config implies for a tensor of role r: writes ndim (1 or 2) and shape (PyTorch
 * order). Returns 0, or -EINVAL for an unknown role. */
int model_expected_shape(const struct model_config *cfg, enum tensor_role r, uint32_t *ndim, uint64_t shape[2]);

/* The group a role belongs to in layer `layer` (ignored for embed and head roles); expert names the
 * expert for the ROLE_EXPERT_* roles (ignored for the others). */
uint32_t model_role_group(const struct model_config *cfg, enum tensor_role r, uint32_t layer, uint32_t expert);

/* Checks a configuration's values for ranges and consistency (positive dims, heads divisible
 * by kv heads, token ids inside the vocabulary, rope scaling parameters). Returns 0, or
 * -EINVAL (-ENOTSUP for an unknown arch) with a message naming the config.json field.
 * manifest_load runs it; so does the runner on the config it reads from the weight ring. */
int model_config_check(const struct model_config *cfg, char *err, size_t errlen);

/* Checks that a group table is a forward pass the engine can walk: the embed group first, the
 * head group last, every layer 0..n_layers-1 in order, each opening with its attention group
 * and followed by at least one group of its own (its FFN), known kinds and size classes.
 * Returns 0 or -EINVAL with a message naming the group. */
int model_groups_check(const struct model_config *cfg, const struct group_desc *groups, uint32_t n_groups, char *err,
		       size_t errlen);

/* Looks up the tensor of a role in a group over plain tables (the manifest's, or the copy
 * the runner takes from the weight ring): returns its index or -1. For ROLE_LM_HEAD with tied
 * embeddings this is the embed group's tensor. */
int model_find_tensor(const struct model_config *cfg, const struct tensor_desc *tensors,
		      const struct group_desc *groups, uint32_t group, enum tensor_role role);
const char *group_kind_name(enum group_kind k);

#ifdef __cplusplus
}
#endif
#endif

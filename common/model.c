#include "common/model.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>

#include "common/util.h"

static const char *const role_names[ROLE_COUNT] = {
	"embed",      "attn_norm", "wq",	  "wk",	       "wv",	      "wo",
	"ffn_norm",   "w_gate",	   "w_up",	  "w_down",    "final_norm",  "lm_head",
	"q_norm",     "k_norm",	   "router",	  "expert_gate", "expert_up", "expert_down",
};

const char *tensor_role_name(enum tensor_role r)
{
	return (unsigned)r < ROLE_COUNT ? role_names[r] : "?";
}

const char *model_arch_name(uint32_t arch)
{
	static const char *const names[] = {"?", "Llama", "Mistral", "Qwen3", "Mixtral", "Qwen3-MoE"};
	return arch < ARRAY_SIZE(names) ? names[arch] : "?";
}

int model_groups_check(const struct model_config *c, const struct group_desc *groups, uint32_t n, char *err,
		       size_t errlen)
{
	if (n < 2 || groups[0].kind != GROUP_EMBED || groups[n - 1].kind != GROUP_HEAD)
		return errorf(err, errlen, -EINVAL, "the group table (%u groups) does not open with the embedding and end "
			      "with the head", n);
	uint32_t layer = 0, in_layer = 0; /* groups seen of layer `layer` (0: none yet) */
	for (uint32_t g = 1; g + 1 < n; g++) {
		const struct group_desc *d = &groups[g];
		if (d->kind >= GROUP_KIND_COUNT || d->size_class >= CLASS_COUNT)
			return errorf(err, errlen, -EINVAL, "group %u has an unknown kind %u or size class %u", g, d->kind,
				      d->size_class);
		if (d->kind == GROUP_EMBED || d->kind == GROUP_HEAD)
			return errorf(err, errlen, -EINVAL, "group %u is a %s group inside the layers", g,
				      group_kind_name((enum group_kind)d->kind));
		if (d->kind == GROUP_ATTN) {
			if (in_layer == 1 || d->layer != (in_layer ? layer + 1 : layer))
				return errorf(err, errlen, -EINVAL, "group %u opens layer %u out of order (after layer "
					      "%u, %u group(s) of it)", g, d->layer, layer, in_layer);
			layer = d->layer;
			in_layer = 1;
		} else {
			if (!in_layer || d->layer != layer)
				return errorf(err, errlen, -EINVAL, "group %u (%s of layer %u) does not follow its layer's "
					      "attention", g, group_kind_name((enum group_kind)d->kind), d->layer);
			if (d->kind == GROUP_EXPERT && (d->expert >= c->n_experts || in_layer < 2))
				return errorf(err, errlen, -EINVAL, "group %u (expert %u of layer %u) is not an expert of a "
					      "mixture-of-experts layer after its router", g, d->expert, d->layer);
			in_layer++;
		}
	}
	if (in_layer < 2 || layer + 1 != c->n_layers)
		return errorf(err, errlen, -EINVAL, "the group table ends after layer %u (%u group(s) of it); the model "
			      "has %u layers", layer, in_layer, c->n_layers);
	return 0;
}

const char *group_kind_name(enum group_kind k)
{
	switch (k) {
	case GROUP_EMBED:
		return "embed";
	case GROUP_ATTN:
		return "attn";
	case GROUP_FFN:
		return "ffn";
	case GROUP_HEAD:
		return "head";
	case GROUP_MOE:
		return "moe";
	case GROUP_EXPERT:
		return "expert";
	case GROUP_KIND_COUNT:
		break;
	}
	return "?";
}

int model_expected_shape(const struct model_config *c, enum tensor_role r, uint32_t *ndim, uint64_t shape[2])
{
	uint64_t q = (uint64_t)c->n_heads * c->head_dim, kv = (uint64_t)c->n_kv_heads * c->head_dim;
	*ndim = 2;
	switch (r) {
	case ROLE_EMBED:
	case ROLE_LM_HEAD:
		shape[0] = c->vocab_size;
		shape[1] = c->dim;
		return 0;
	case ROLE_ATTN_NORM:
	case ROLE_FFN_NORM:
	case ROLE_FINAL_NORM:
		*ndim = 1;
		shape[0] = c->dim;
		shape[1] = 0;
		return 0;
	case ROLE_WQ:
		shape[0] = q;
		shape[1] = c->dim;
		return 0;
	case ROLE_WK:
	case ROLE_WV:
		shape[0] = kv;
		shape[1] = c->dim;
		return 0;
	case ROLE_WO:
		shape[0] = c->dim;
		shape[1] = q;
		return 0;
	case ROLE_W_GATE:
	case ROLE_W_UP:
		shape[0] = c->ffn_dim;
		shape[1] = c->dim;
		return 0;
	case ROLE_W_DOWN:
		shape[0] = c->dim;
		shape[1] = c->ffn_dim;
		return 0;
	case ROLE_Q_NORM:
	case ROLE_K_NORM:
		*ndim = 1;
		shape[0] = c->head_dim;
		shape[1] = 0;
		return 0;
	case ROLE_ROUTER:
		shape[0] = c->n_experts;
		shape[1] = c->dim;
		return 0;
	case ROLE_EXPERT_GATE:
	case ROLE_EXPERT_UP:
		shape[0] = c->expert_ffn_dim;
		shape[1] = c->dim;
		return 0;
	case ROLE_EXPERT_DOWN:
		shape[0] = c->dim;
		shape[1] = c->expert_ffn_dim;
		return 0;
	case ROLE_COUNT:
		break;
	}
	return -EINVAL;
}

uint32_t model_role_group(const struct model_config *c, enum tensor_role r, uint32_t layer, uint32_t expert)
{
	switch (r) {
	case ROLE_EMBED:
		return group_id_embed();
	case ROLE_FINAL_NORM:
	case ROLE_LM_HEAD:
		return group_id_head(c);
	case ROLE_ATTN_NORM:
	case ROLE_WQ:
	case ROLE_WK:
	case ROLE_WV:
	case ROLE_WO:
	case ROLE_Q_NORM:
	case ROLE_K_NORM:
		return model_group_attn(c, layer);
	case ROLE_EXPERT_GATE:
	case ROLE_EXPERT_UP:
	case ROLE_EXPERT_DOWN:
		return model_group_expert(c, layer, expert);
	default:
		return model_group_ffn(c, layer);
	}
}

int model_config_check(const struct model_config *c, char *err, size_t errlen)
{
	const char *f = "config.json";
	if (c->arch < ARCH_LLAMA || c->arch > ARCH_QWEN3_MOE)
		return errorf(err, errlen, -ENOTSUP, "%s: architecture %u is not supported", f, c->arch);
	bool moe = c->arch == ARCH_MIXTRAL || c->arch == ARCH_QWEN3_MOE;
	bool qwen3 = c->arch == ARCH_QWEN3 || c->arch == ARCH_QWEN3_MOE;
	if (c->flags & ~(MODEL_QK_NORM | MODEL_NORM_TOPK))
		return errorf(err, errlen, -EINVAL, "%s: unknown model flags %#x", f, c->flags);
	if (!!(c->flags & MODEL_QK_NORM) != qwen3)
		return errorf(err, errlen, -EINVAL, "%s: q/k norms go with the Qwen3 architectures only", f);
	if (!moe && (c->n_experts || c->n_experts_used || c->expert_ffn_dim || (c->flags & MODEL_NORM_TOPK)))
		return errorf(err, errlen, -EINVAL, "%s: a dense architecture has no experts", f);
	if (moe) {
		if (c->n_experts < 1 || c->n_experts > MODEL_MAX_EXPERTS)
			return errorf(err, errlen, -EINVAL, "%s: the number of experts %u is out of range [1, %u]", f,
				      c->n_experts, MODEL_MAX_EXPERTS);
		if (c->n_experts_used < 1 || c->n_experts_used > c->n_experts)
			return errorf(err, errlen, -EINVAL, "%s: num_experts_per_tok %u must be in [1, %u] (the number "
				      "of experts)", f, c->n_experts_used, c->n_experts);
		if (c->expert_ffn_dim < 1 || c->expert_ffn_dim > (1u << 20))
			return errorf(err, errlen, -EINVAL, "%s: the experts' intermediate size %u is out of range [1, "
				      "%u]", f, c->expert_ffn_dim, 1u << 20);
	}
	struct {
		const char *name;
		uint32_t v, lo, hi;
	} r[] = {
		{"num_hidden_layers", c->n_layers, 1, 1024},
		{"hidden_size", c->dim, 1, 1u << 17},
		{"num_attention_heads", c->n_heads, 1, 1024},
		{"num_key_value_heads", c->n_kv_heads, 1, 1024},
		{"head_dim", c->head_dim, 1, 1024},
		{"intermediate_size", c->ffn_dim, 1, 1u << 20},
		{"vocab_size", c->vocab_size, 1, 1u << 24},
		{"max_position_embeddings", c->max_position, 1, UINT32_MAX},
	};
	for (size_t i = 0; i < ARRAY_SIZE(r); i++)
		if (r[i].v < r[i].lo || r[i].v > r[i].hi)
			return errorf(err, errlen, -EINVAL, "%s: %s %u is out of range [%u, %u]", f, r[i].name, r[i].v,
				    r[i].lo, r[i].hi);
	if (c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads)
		return errorf(err, errlen, -EINVAL,
			    "%s: num_key_value_heads %u must divide num_attention_heads %u (grouped-query attention)",
			    f, c->n_kv_heads, c->n_heads);
	if (!(c->rms_eps > 0 && c->rms_eps < 1))
		return errorf(err, errlen, -EINVAL, "%s: rms_norm_eps %g must be in (0, 1)", f, (double)c->rms_eps);
	if (!(c->rope_theta > 0 && isfinite(c->rope_theta)))
		return errorf(err, errlen, -EINVAL, "%s: rope_theta %g must be positive", f, (double)c->rope_theta);
	if (c->rope_scaling > ROPE_SCALING_LLAMA3)
		return errorf(err, errlen, -EINVAL, "%s: rope_scaling kind %u is unknown", f, c->rope_scaling);
	if (c->rope_scaling != ROPE_SCALING_NONE && !(c->rope_factor > 0 && isfinite(c->rope_factor)))
		return errorf(err, errlen, -EINVAL, "%s: rope_scaling factor %g must be positive", f,
			    (double)c->rope_factor);
	if (c->rope_scaling == ROPE_SCALING_LLAMA3) {
		/* HF divides by (high - low): equal factors would divide by zero. */
		if (!(c->rope_low_freq_factor > 0 && c->rope_high_freq_factor > c->rope_low_freq_factor &&
		      isfinite(c->rope_high_freq_factor)))
			return errorf(err, errlen, -EINVAL,
				    "%s: rope_scaling needs 0 < low_freq_factor (%g) < high_freq_factor (%g)", f,
				    (double)c->rope_low_freq_factor, (double)c->rope_high_freq_factor);
		if (c->rope_original_max_position < 1)
			return errorf(err, errlen, -EINVAL,
				    "%s: rope_scaling original_max_position_embeddings must be positive", f);
	}
	if (c->rope_layout > ROPE_ADJACENT)
		return errorf(err, errlen, -EINVAL, "%s: rope layout %u is unknown", f, c->rope_layout);
	if (c->tie_embeddings > 1)
		return errorf(err, errlen, -EINVAL, "%s: tie_word_embeddings %u must be 0 or 1", f, c->tie_embeddings);
	if (c->bos_id < -1 || c->bos_id >= (int64_t)c->vocab_size)
		return errorf(err, errlen, -EINVAL, "%s: bos_token_id %d is outside the vocabulary (vocab_size %u)", f,
			    c->bos_id, c->vocab_size);
	if (c->n_eos > MODEL_MAX_EOS)
		return errorf(err, errlen, -EINVAL, "%s: eos_token_id lists %u ids, at most %u are supported", f,
			    c->n_eos, MODEL_MAX_EOS);
	for (uint32_t i = 0; i < c->n_eos; i++)
		if (c->eos_ids[i] < 0 || c->eos_ids[i] >= (int64_t)c->vocab_size)
			return errorf(err, errlen, -EINVAL,
				    "%s: eos_token_id %d is outside the vocabulary (vocab_size %u)", f, c->eos_ids[i],
				    c->vocab_size);
	return 0;
}

int model_find_tensor(const struct model_config *cfg, const struct tensor_desc *tensors,
		      const struct group_desc *groups, uint32_t group, enum tensor_role role)
{
	assert(cfg && tensors && groups);
	if (group >= model_n_groups(cfg))
		return -1;
	if (role == ROLE_LM_HEAD && cfg->tie_embeddings) {
		/* Tied: the output projection is the embedding matrix, kept once in the embed group. */
		if (group != group_id_head(cfg) && group != group_id_embed())
			return -1;
		group = group_id_embed();
		role = ROLE_EMBED;
	}
	const struct group_desc *g = &groups[group];
	for (uint32_t i = 0; i < g->n_tensors; i++)
		if (tensors[g->first_tensor + i].role == (uint32_t)role)
			return (int)(g->first_tensor + i);
	return -1;
}

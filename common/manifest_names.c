/* manifest_names.c - checkpoint tensor names (Hugging Face's and GGUF's) and the canonical slots
 * of the tensor table. */
#include "common/manifest_internal.h"

#include <stdio.h>
#include <string.h>

#include "common/util.h"

uint32_t mf_n_slots(const struct model_config *c)
{
	return 2 + LAYER_ROLES * c->n_layers + (c->tie_embeddings ? 0 : 1);
}

static const char *const layer_suffix[LAYER_ROLES] = {
	"input_layernorm.weight",  "self_attn.q_proj.weight", "self_attn.k_proj.weight",
	"self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
	"mlp.gate_proj.weight",	   "mlp.up_proj.weight",      "mlp.down_proj.weight",
};

/* What slot s holds: role, group and checkpoint name. */
void mf_slot_info(const struct model_config *c, uint32_t s, uint32_t *role, uint32_t *group, char *name, size_t len)
{
	uint32_t head0 = 1 + LAYER_ROLES * c->n_layers;
	if (s == 0) {
		*role = ROLE_EMBED;
		*group = group_id_embed();
		snprintf(name, len, "model.embed_tokens.weight");
	} else if (s < head0) {
		uint32_t l = (s - 1) / LAYER_ROLES, k = (s - 1) % LAYER_ROLES;
		*role = ROLE_ATTN_NORM + k; /* roles 1..9 run in the same order as layer_suffix */
		*group = k < 5 ? group_id_attn(l) : group_id_ffn(l);
		snprintf(name, len, "model.layers.%u.%s", l, layer_suffix[k]);
	} else if (s == head0) {
		*role = ROLE_FINAL_NORM;
		*group = group_id_head(c);
		snprintf(name, len, "model.norm.weight");
	} else {
		*role = ROLE_LM_HEAD;
		*group = group_id_head(c);
		snprintf(name, len, "lm_head.weight");
	}
}

/* For "<prefix><layer>.<rest>" with a layer of c: the layer in *l and a pointer to rest; else NULL.
 * Strict decimal: no sign, no leading zero, so every layer has exactly one spelling. */
static const char *layer_rest(const struct model_config *c, const char *name, const char *prefix, uint32_t *l)
{
	size_t n = strlen(prefix);
	if (strncmp(name, prefix, n) != 0)
		return NULL;
	const char *p = name + n;
	if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] != '.'))
		return NULL;
	uint64_t v = 0;
	while (*p >= '0' && *p <= '9') {
		v = v * 10 + (uint64_t)(*p++ - '0');
		if (v > UINT32_MAX)
			return NULL;
	}
	if (*p++ != '.' || v >= c->n_layers)
		return NULL;
	*l = (uint32_t)v;
	return p;
}

/* Maps a checkpoint tensor name to its slot. */
enum name_class mf_classify(const struct model_config *c, const char *name, uint32_t *slot)
{
	if (!strcmp(name, "model.embed_tokens.weight")) {
		*slot = 0;
		return NAME_SLOT;
	}
	if (!strcmp(name, "model.norm.weight")) {
		*slot = 1 + LAYER_ROLES * c->n_layers;
		return NAME_SLOT;
	}
	if (!strcmp(name, "lm_head.weight")) {
		if (c->tie_embeddings)
			return NAME_IGNORE; /* some exports save the tied copy too; the embedding is the one used */
		*slot = 2 + LAYER_ROLES * c->n_layers;
		return NAME_SLOT;
	}
	uint32_t l;
	const char *p = layer_rest(c, name, "model.layers.", &l);
	if (!p)
		return NAME_UNEXPECTED;
	if (!strcmp(p, "self_attn.rotary_emb.inv_freq"))
		return NAME_IGNORE; /* old exports saved the RoPE table; it is recomputed from the config */
	for (uint32_t k = 0; k < LAYER_ROLES; k++) {
		if (!strcmp(p, layer_suffix[k])) {
			*slot = 1 + LAYER_ROLES * l + k;
			return NAME_SLOT;
		}
	}
	return NAME_UNEXPECTED;
}

/* llama.cpp's names, in the order of layer_suffix. */
static const char *const gguf_layer_suffix[LAYER_ROLES] = {
	"attn_norm.weight", "attn_q.weight",   "attn_k.weight", "attn_v.weight",   "attn_output.weight",
	"ffn_norm.weight",  "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
};

void mf_slot_name_gguf(const struct model_config *c, uint32_t s, char *name, size_t len)
{
	uint32_t head0 = 1 + LAYER_ROLES * c->n_layers;
	if (s == 0)
		snprintf(name, len, "token_embd.weight");
	else if (s < head0)
		snprintf(name, len, "blk.%u.%s", (s - 1) / LAYER_ROLES, gguf_layer_suffix[(s - 1) % LAYER_ROLES]);
	else if (s == head0)
		snprintf(name, len, "output_norm.weight");
	else
		snprintf(name, len, "output.weight");
}

enum name_class mf_classify_gguf(const struct model_config *c, const char *name, uint32_t *slot)
{
	if (!strcmp(name, "token_embd.weight")) {
		*slot = 0;
		return NAME_SLOT;
	}
	if (!strcmp(name, "output_norm.weight")) {
		*slot = 1 + LAYER_ROLES * c->n_layers;
		return NAME_SLOT;
	}
	if (!strcmp(name, "output.weight")) {
		if (c->tie_embeddings)
			return NAME_IGNORE;
		*slot = 2 + LAYER_ROLES * c->n_layers;
		return NAME_SLOT;
	}
	uint32_t l;
	const char *p = layer_rest(c, name, "blk.", &l);
	if (!p)
		return NAME_UNEXPECTED;
	for (uint32_t k = 0; k < LAYER_ROLES; k++) {
		if (!strcmp(p, gguf_layer_suffix[k])) {
			*slot = 1 + LAYER_ROLES * l + k;
			return NAME_SLOT;
		}
	}
	return NAME_UNEXPECTED;
}

void mf_format_shape(char *buf, size_t len, const uint64_t *shape, uint32_t ndim)
{
	size_t n = (size_t)snprintf(buf, len, "[");
	for (uint32_t i = 0; i < ndim && n < len; i++)
		n += (size_t)snprintf(buf + n, len - n, "%s%llu", i ? ", " : "", (unsigned long long)shape[i]);
	if (n < len)
		snprintf(buf + n, len - n, "]");
}

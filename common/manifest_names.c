/* manifest_names.c - checkpoint tensor names (Hugging Face's and GGUF's) and the canonical slots
 * of the tensor table. */
#include "common/manifest_internal.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "common/util.h"

/* Slots of one layer: the attention's (5, 7 with q/k norms), then the FFN's: 4 dense, or the norm,
 * the router and 3 per expert. */
static uint32_t attn_slots(const struct model_config *c)
{
	return 5 + ((c->flags & MODEL_QK_NORM) ? 2 : 0);
}

static uint32_t layer_slots(const struct model_config *c)
{
	return attn_slots(c) + (c->n_experts ? 2 + 3 * c->n_experts : 4);
}

uint32_t mf_n_slots(const struct model_config *c)
{
	return 2 + layer_slots(c) * c->n_layers + (c->tie_embeddings ? 0 : 1);
}

static const char *const layer_suffix[LAYER_ROLES] = {
	"input_layernorm.weight",  "self_attn.q_proj.weight", "self_attn.k_proj.weight",
	"self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
	"mlp.gate_proj.weight",	   "mlp.up_proj.weight",      "mlp.down_proj.weight",
};

/* Slot k of a layer: its role and, for the ROLE_EXPERT_* roles, the expert. */
static void layer_slot_role(const struct model_config *c, uint32_t k, uint32_t *role, uint32_t *expert)
{
	uint32_t na = attn_slots(c);
	*expert = 0;
	if (k < 5) {
		*role = ROLE_ATTN_NORM + k;
	} else if (k < na) {
		*role = ROLE_Q_NORM + (k - 5);
	} else if (!c->n_experts) {
		*role = ROLE_FFN_NORM + (k - na);
	} else if (k - na < 2) {
		*role = k == na ? ROLE_FFN_NORM : ROLE_ROUTER;
	} else {
		*expert = (k - na - 2) / 3;
		*role = ROLE_EXPERT_GATE + (k - na - 2) % 3;
	}
}

/* The Hugging Face name of a layer tensor, after "model.layers.N.". */
static void layer_tensor_name(const struct model_config *c, uint32_t role, uint32_t expert, char *name, size_t len)
{
	bool mixtral = c->arch == ARCH_MIXTRAL;
	switch (role) {
	case ROLE_Q_NORM:
		snprintf(name, len, "self_attn.q_norm.weight");
		break;
	case ROLE_K_NORM:
		snprintf(name, len, "self_attn.k_norm.weight");
		break;
	case ROLE_ROUTER:
		snprintf(name, len, mixtral ? "block_sparse_moe.gate.weight" : "mlp.gate.weight");
		break;
	case ROLE_EXPERT_GATE:
	case ROLE_EXPERT_UP:
	case ROLE_EXPERT_DOWN: {
		/* Mixtral: w1 gate, w3 up, w2 down. */
		static const char *const mx[3] = {"w1", "w3", "w2"};
		static const char *const qw[3] = {"gate_proj", "up_proj", "down_proj"};
		uint32_t m = role - ROLE_EXPERT_GATE;
		if (mixtral)
			snprintf(name, len, "block_sparse_moe.experts.%u.%s.weight", expert, mx[m]);
		else
			snprintf(name, len, "mlp.experts.%u.%s.weight", expert, qw[m]);
		break;
	}
	default:
		snprintf(name, len, "%s", role >= ROLE_ATTN_NORM && role <= ROLE_W_DOWN ? layer_suffix[role - 1] : "?");
	}
}

/* What slot s holds: role, group and checkpoint name. */
void mf_slot_info(const struct model_config *c, uint32_t s, uint32_t *role, uint32_t *group, char *name, size_t len)
{
	uint32_t head0 = 1 + layer_slots(c) * c->n_layers;
	if (s == 0) {
		*role = ROLE_EMBED;
		*group = group_id_embed();
		snprintf(name, len, "model.embed_tokens.weight");
	} else if (s < head0) {
		uint32_t l = (s - 1) / layer_slots(c), k = (s - 1) % layer_slots(c), e;
		layer_slot_role(c, k, role, &e);
		*group = model_role_group(c, (enum tensor_role)*role, l, e);
		char rest[TENSOR_NAME_MAX];
		layer_tensor_name(c, *role, e, rest, sizeof(rest));
		snprintf(name, len, "model.layers.%u.%s", l, rest);
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

/* A strict decimal below max at *p (no sign, no leading zero, so every index has exactly one
 * spelling) followed by '.': the value in *v and a pointer past the dot; else NULL. */
static const char *parse_index(const char *p, uint32_t max, uint32_t *v)
{
	if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] != '.'))
		return NULL;
	uint64_t x = 0;
	while (*p >= '0' && *p <= '9') {
		x = x * 10 + (uint64_t)(*p++ - '0');
		if (x > UINT32_MAX)
			return NULL;
	}
	if (*p++ != '.' || x >= max)
		return NULL;
	*v = (uint32_t)x;
	return p;
}

/* For "<prefix><layer>.<rest>" with a layer of c: the layer in *l and a pointer to rest; else NULL. */
static const char *layer_rest(const struct model_config *c, const char *name, const char *prefix, uint32_t *l)
{
	size_t n = strlen(prefix);
	if (strncmp(name, prefix, n) != 0)
		return NULL;
	return parse_index(name + n, c->n_layers, l);
}

/* Maps a checkpoint tensor name to its slot. */
enum name_class mf_classify(const struct model_config *c, const char *name, uint32_t *slot)
{
	uint32_t ls = layer_slots(c);
	if (!strcmp(name, "model.embed_tokens.weight")) {
		*slot = 0;
		return NAME_SLOT;
	}
	if (!strcmp(name, "model.norm.weight")) {
		*slot = 1 + ls * c->n_layers;
		return NAME_SLOT;
	}
	if (!strcmp(name, "lm_head.weight")) {
		if (c->tie_embeddings)
			return NAME_IGNORE; /* some exports save the tied copy too; the embedding is the one used */
		*slot = 2 + ls * c->n_layers;
		return NAME_SLOT;
	}
	uint32_t l;
	const char *p = layer_rest(c, name, "model.layers.", &l);
	if (!p)
		return NAME_UNEXPECTED;
	if (!strcmp(p, "self_attn.rotary_emb.inv_freq"))
		return NAME_IGNORE; /* old exports saved the RoPE table; it is recomputed from the config */
	uint32_t base = 1 + ls * l, na = attn_slots(c);
	/* Every slot but the experts' by name; an expert's by its index, then its matrix. */
	uint32_t plain = na + (c->n_experts ? 2 : 4);
	char want[TENSOR_NAME_MAX];
	for (uint32_t k = 0; k < plain; k++) {
		uint32_t role, e;
		layer_slot_role(c, k, &role, &e);
		layer_tensor_name(c, role, e, want, sizeof(want));
		if (!strcmp(p, want)) {
			*slot = base + k;
			return NAME_SLOT;
		}
	}
	if (!c->n_experts)
		return NAME_UNEXPECTED;
	const char *prefix = c->arch == ARCH_MIXTRAL ? "block_sparse_moe.experts." : "mlp.experts.";
	size_t n = strlen(prefix);
	uint32_t e;
	if (strncmp(p, prefix, n) != 0 || !parse_index(p + n, c->n_experts, &e))
		return NAME_UNEXPECTED;
	for (uint32_t m = 0; m < 3; m++) {
		layer_tensor_name(c, ROLE_EXPERT_GATE + m, e, want, sizeof(want));
		if (!strcmp(p, want)) {
			*slot = base + plain + 3 * e + m;
			return NAME_SLOT;
		}
	}
	return NAME_UNEXPECTED;
}

/* llama.cpp's name of a layer tensor, after "blk.N.": the experts' fused tensors (ffn_gate_exps,
 * ffn_up_exps, ffn_down_exps), which hold every expert of the layer. */
static const char *gguf_layer_name(uint32_t role)
{
	static const char *const names[ROLE_COUNT] = {
		[ROLE_ATTN_NORM] = "attn_norm.weight",	   [ROLE_WQ] = "attn_q.weight",
		[ROLE_WK] = "attn_k.weight",		   [ROLE_WV] = "attn_v.weight",
		[ROLE_WO] = "attn_output.weight",	   [ROLE_FFN_NORM] = "ffn_norm.weight",
		[ROLE_W_GATE] = "ffn_gate.weight",	   [ROLE_W_UP] = "ffn_up.weight",
		[ROLE_W_DOWN] = "ffn_down.weight",	   [ROLE_Q_NORM] = "attn_q_norm.weight",
		[ROLE_K_NORM] = "attn_k_norm.weight",	   [ROLE_ROUTER] = "ffn_gate_inp.weight",
		[ROLE_EXPERT_GATE] = "ffn_gate_exps.weight", [ROLE_EXPERT_UP] = "ffn_up_exps.weight",
		[ROLE_EXPERT_DOWN] = "ffn_down_exps.weight",
	};
	return role < ROLE_COUNT && names[role] ? names[role] : "?";
}

void mf_slot_name_gguf(const struct model_config *c, uint32_t s, char *name, size_t len)
{
	uint32_t ls = layer_slots(c), head0 = 1 + ls * c->n_layers;
	if (s == 0) {
		snprintf(name, len, "token_embd.weight");
	} else if (s < head0) {
		uint32_t role, e;
		layer_slot_role(c, (s - 1) % ls, &role, &e);
		snprintf(name, len, "blk.%u.%s", (s - 1) / ls, gguf_layer_name(role));
	} else if (s == head0) {
		snprintf(name, len, "output_norm.weight");
	} else {
		snprintf(name, len, "output.weight");
	}
}

enum name_class mf_classify_gguf(const struct model_config *c, const char *name, uint32_t *slot)
{
	uint32_t ls = layer_slots(c);
	if (!strcmp(name, "token_embd.weight")) {
		*slot = 0;
		return NAME_SLOT;
	}
	if (!strcmp(name, "output_norm.weight")) {
		*slot = 1 + ls * c->n_layers;
		return NAME_SLOT;
	}
	if (!strcmp(name, "output.weight")) {
		if (c->tie_embeddings)
			return NAME_IGNORE;
		*slot = 2 + ls * c->n_layers;
		return NAME_SLOT;
	}
	uint32_t l;
	const char *p = layer_rest(c, name, "blk.", &l);
	if (!p)
		return NAME_UNEXPECTED;
	uint32_t base = 1 + ls * l, na = attn_slots(c);
	/* Every slot but the experts' by name; the experts' fused tensors by their matrix. */
	uint32_t plain = na + (c->n_experts ? 2 : 4);
	for (uint32_t k = 0; k < plain; k++) {
		uint32_t role, e;
		layer_slot_role(c, k, &role, &e);
		if (!strcmp(p, gguf_layer_name(role))) {
			*slot = base + k;
			return NAME_SLOT;
		}
	}
	if (!c->n_experts)
		return NAME_UNEXPECTED;
	/* The layout older converters wrote for Mixtral: one tensor per expert, blk.N.ffn_gate.E.weight. */
	static const char *const old[3] = {"ffn_gate.", "ffn_up.", "ffn_down."};
	for (uint32_t m = 0; m < 3; m++) {
		if (!strcmp(p, gguf_layer_name(ROLE_EXPERT_GATE + m))) {
			*slot = base + plain + m;
			return NAME_EXPERTS;
		}
		size_t n = strlen(old[m]);
		uint32_t e;
		const char *q;
		if (!strncmp(p, old[m], n) && (q = parse_index(p + n, c->n_experts, &e)) && !strcmp(q, "weight")) {
			*slot = base + plain + 3 * e + m;
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

/* manifest_gguf_moe.c - what the GGUF reader (manifest_gguf.c) takes beyond a dense llama: the
 * architectures "qwen3" and "qwen3moe" (keys qwen3.* / qwen3moe.*, per-head q/k norms, RoPE over
 * halves of each head as in the Hugging Face checkpoint: llama.cpp permutes wq/wk rows for the
 * "llama" architecture only), the experts of "llama" (Mixtral) and "qwen3moe" from the
 * <arch>.expert_* keys, and the fused expert tensors (blk.N.ffn_gate_exps.weight, ffn_up_exps,
 * ffn_down_exps: ggml ne = [cols, rows, n_experts], expert e's matrix the e-th contiguous run of
 * rows * row_bytes bytes) cut into one tensor per expert, each in its expert's slot. */
#include "common/manifest_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "common/gguf.h"
#include "common/util.h"

#define GATING_SOFTMAX 1u /* llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX */

int mf_gguf_arch(const struct gguf *g, struct model_config *c, const char **prefix, char *err, size_t errlen)
{
	const char *arch;
	int rc = gguf_get_str(g, "general.architecture", &arch, NULL, err, errlen);
	if (rc)
		return rc;
	if (!strcmp(arch, "llama")) {
		c->arch = ARCH_LLAMA;
		c->rope_layout = ROPE_ADJACENT; /* convert_hf_to_gguf.py's LlamaModel permutes wq and wk */
		*prefix = "llama";
	} else if (!strcmp(arch, "qwen3") || !strcmp(arch, "qwen3moe")) {
		c->arch = arch[5] ? ARCH_QWEN3_MOE : ARCH_QWEN3;
		c->rope_layout = ROPE_HALVES; /* stored as in the checkpoint; llama.cpp's NEOX RoPE */
		c->flags |= MODEL_QK_NORM;
		*prefix = arch[5] ? "qwen3moe" : "qwen3";
	} else {
		return errorf(err, errlen, -ENOTSUP,
			      "%s: architecture \"%.60s\" is not supported (supported: llama, qwen3, qwen3moe)",
			      gguf_path(g), arch);
	}
	return 0;
}

const char *mf_gguf_arch_name(const struct model_config *c)
{
	return c->arch == ARCH_QWEN3 ? "qwen3" : c->arch == ARCH_QWEN3_MOE ? "qwen3moe" : "llama";
}

/* <prefix>.<suffix> into buf. */
static const char *key_name(char *buf, size_t len, const char *prefix, const char *suffix)
{
	snprintf(buf, len, "%s.%s", prefix, suffix);
	return buf;
}

/* An optional u32 key: absent leaves *v, present must read. */
static int opt_u32(const struct gguf *g, const char *key, uint32_t *v, char *err, size_t errlen)
{
	int rc = gguf_get_u32(g, key, v, err, errlen);
	return rc == -ENOENT ? 0 : rc;
}

int mf_gguf_read_experts(const struct gguf *g, const char *prefix, struct model_config *c, char *err,
			 size_t errlen)
{
	const char *path = gguf_path(g);
	char k_count[64], k_used[64], k[64];
	uint32_t count = 0;
	key_name(k_count, sizeof(k_count), prefix, "expert_count");
	key_name(k_used, sizeof(k_used), prefix, "expert_used_count");
	int rc = opt_u32(g, k_count, &count, err, errlen);
	if (rc)
		return rc;
	if (c->arch == ARCH_QWEN3_MOE && count == 0)
		return errorf(err, errlen, -EINVAL, "%s: %s is %s: a qwen3moe model has experts", path, k_count,
			      gguf_find_key(g, k_count) >= 0 ? "0" : "missing");
	if (count == 0) {
		uint32_t used = 0;
		rc = opt_u32(g, k_used, &used, err, errlen);
		if (!rc && used)
			rc = errorf(err, errlen, -EINVAL, "%s: %s is %u, but the model has no experts (%s)", path,
				    k_used, used, k_count);
		return rc;
	}
	if (c->arch == ARCH_QWEN3)
		return errorf(err, errlen, -EINVAL,
			      "%s: %s is %u, but a qwen3 model is dense (its mixture of experts is qwen3moe)", path,
			      k_count, count);
	if (count > MODEL_MAX_EXPERTS)
		return errorf(err, errlen, -EINVAL, "%s: %s %u is out of range [1, %u]", path, k_count, count,
			      MODEL_MAX_EXPERTS);
	c->n_experts = count;
	rc = gguf_get_u32(g, k_used, &c->n_experts_used, err, errlen);
	if (rc)
		return rc == -ENOENT ? errorf(err, errlen, -EINVAL, "%s: key %s is missing (%s is %u)", path, k_used,
					      k_count, count)
				     : rc;
	if (c->n_experts_used < 1 || c->n_experts_used > count)
		return errorf(err, errlen, -EINVAL, "%s: %s %u must be in [1, %u] (%s)", path, k_used,
			      c->n_experts_used, count, k_count);
	/* What the compute path does not implement: experts shared by every token, dense leading
	 * layers, routing other than a softmax. */
	static const char *const zero_keys[] = {"expert_shared_count", "leading_dense_block_count"};
	for (size_t i = 0; i < ARRAY_SIZE(zero_keys); i++) {
		uint32_t v = 0;
		rc = opt_u32(g, key_name(k, sizeof(k), prefix, zero_keys[i]), &v, err, errlen);
		if (rc)
			return rc;
		if (v)
			return errorf(err, errlen, -ENOTSUP, "%s: %s %u is not supported", path, k, v);
	}
	uint32_t gating = GATING_SOFTMAX;
	rc = opt_u32(g, key_name(k, sizeof(k), prefix, "expert_gating_func"), &gating, err, errlen);
	if (rc)
		return rc;
	if (gating != GATING_SOFTMAX)
		return errorf(err, errlen, -ENOTSUP, "%s: %s %u is not supported (only 1, softmax)", path, k, gating);
	char k_eff[64];
	key_name(k_eff, sizeof(k_eff), prefix, "expert_feed_forward_length");
	bool have_eff = gguf_find_key(g, k_eff) >= 0;
	if (have_eff && (rc = gguf_get_u32(g, k_eff, &c->expert_ffn_dim, err, errlen)) != 0)
		return rc;
	if (c->arch == ARCH_LLAMA) {
		/* Mixtral: every expert has feed_forward_length, the top-k weights renormalised. */
		if (have_eff && c->expert_ffn_dim != c->ffn_dim)
			return errorf(err, errlen, -ENOTSUP,
				      "%s: %s %u differs from llama.feed_forward_length %u: a llama model's experts "
				      "have feed_forward_length",
				      path, k_eff, c->expert_ffn_dim, c->ffn_dim);
		c->arch = ARCH_MIXTRAL;
		c->expert_ffn_dim = c->ffn_dim;
		c->flags |= MODEL_NORM_TOPK;
	} else {
		if (!have_eff)
			return errorf(err, errlen, -EINVAL, "%s: key %s is missing (the experts' intermediate size)",
				      path, k_eff);
		if (c->expert_ffn_dim < 1 || c->expert_ffn_dim > (1u << 20))
			return errorf(err, errlen, -EINVAL, "%s: %s %u is out of range [1, %u]", path, k_eff,
				      c->expert_ffn_dim, 1u << 20);
		/* llama.cpp renormalises Qwen3-MoE's top-k weights whatever the key says; converters write
		 * it from norm_topk_prob, which the computation here follows. */
		bool norm = true;
		key_name(k, sizeof(k), prefix, "expert_weights_norm");
		if (gguf_find_key(g, k) >= 0 && (rc = gguf_get_bool(g, k, &norm, err, errlen)) != 0)
			return rc;
		if (norm)
			c->flags |= MODEL_NORM_TOPK;
	}
	float scale = 1.0f;
	key_name(k, sizeof(k), prefix, "expert_weights_scale");
	if (gguf_find_key(g, k) >= 0 && (rc = gguf_get_f32(g, k, &scale, err, errlen)) != 0)
		return rc;
	if (scale != 1.0f)
		return errorf(err, errlen, -ENOTSUP, "%s: %s %g is not supported (only 1)", path, k, (double)scale);
	return 0;
}

int mf_gguf_place_experts(struct manifest *m, const struct gguf *g, uint32_t fi, uint64_t ti, uint32_t slot0,
			  bool *found, char *err, size_t errlen)
{
	const struct gguf_tensor *t = gguf_tensor(g, ti);
	const struct model_config *c = &m->cfg;
	const char *path = gguf_path(g);
	uint32_t role, group, ndim;
	uint64_t want[2];
	char name[TENSOR_NAME_MAX];
	mf_slot_info(c, slot0, &role, &group, name, sizeof(name));
	if (model_expected_shape(c, (enum tensor_role)role, &ndim, want) != 0 || ndim != 2)
		return errorf(err, errlen, -EINVAL, "%s: tensor %s: no expert matrix (a bug)", path, t->name);
	enum dtype dt;
	if (mf_gguf_dtype(g, t, &dt, err, errlen) != 0)
		return -ENOTSUP;
	/* ggml order: ne[0] columns, ne[1] rows, ne[2] experts (a writer that drops trailing 1s gives a
	 * single expert's two dimensions). */
	if (t->n_dims < 2 || t->ne[0] != want[1] || t->ne[1] != want[0] || t->ne[2] != c->n_experts ||
	    t->ne[3] != 1) {
		char got_s[128], want_s[96];
		uint64_t shape[GGUF_MAX_DIMS], w3[3] = {c->n_experts, want[0], want[1]};
		for (uint32_t d = 0; d < t->n_dims; d++)
			shape[d] = t->ne[t->n_dims - 1 - d];
		mf_format_shape(got_s, sizeof(got_s), shape, t->n_dims);
		mf_format_shape(want_s, sizeof(want_s), w3, 3);
		return errorf(err, errlen, -EINVAL,
			      "%s: tensor %s has shape %s (experts, rows, columns), but the metadata implies %s "
			      "(%s.expert_count %u)",
			      path, t->name, got_s, want_s, mf_gguf_arch_name(c), c->n_experts);
	}
	/* Each expert is whole rows, so whole blocks of a quantized type (the parser checked that a row
	 * holds whole blocks); the slices tile the tensor's bytes exactly. */
	uint32_t be = dtype_block_elems(dt);
	uint64_t row_bytes = dtype_row_bytes(dt, want[1]), slice = row_bytes * want[0];
	if (want[1] % be || slice * c->n_experts != t->nbytes)
		return errorf(err, errlen, -EINVAL,
			      "%s: tensor %s: %s data of %" PRIu64 " bytes does not hold %u experts of %" PRIu64
			      " bytes",
			      path, t->name, dtype_name(dt), t->nbytes, c->n_experts, slice);
	for (uint32_t e = 0; e < c->n_experts; e++) {
		uint32_t slot = slot0 + 3 * e;
		if (found[slot])
			return errorf(err, errlen, -EINVAL,
				      "%s: expert %u of tensor %s is given twice in the split set (a fused and a "
				      "per-expert tensor, or two fused ones)",
				      path, e, t->name);
		struct tensor_desc *d = &m->tensors[slot];
		memset(d, 0, sizeof(*d));
		if (snprintf(d->name, sizeof(d->name), "%s[%u]", t->name, e) >= (int)sizeof(d->name))
			return errorf(err, errlen, -EINVAL, "%s: tensor name %s is too long", path, t->name);
		mf_slot_info(c, slot, &d->role, &d->group, name, sizeof(name));
		d->dtype = dt;
		d->ndim = 2;
		d->shape[0] = want[0];
		d->shape[1] = want[1];
		d->nbytes = slice;
		d->file_index = fi;
		d->file_offset = gguf_data_start(g) + t->offset + (uint64_t)e * slice;
		found[slot] = true;
	}
	return 0;
}

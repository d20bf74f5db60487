/* manifest_config.c - config.json and generation_config.json read into a model_config: the
 * architecture, the shapes, RoPE and its scaling, the special ids, and what is refused. */
#include "common/manifest_internal.h"

#include <errno.h>
#include <float.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/tokenizer/ids.h"
#include "common/util.h"

/* Reads integer field key of obj into *out, checked against [lo, hi]. Absent or null: with
 * required an error, else *out is left as it is. */
static int get_u32(const json_t *obj, const char *file, const char *key, bool required, uint32_t lo, uint32_t hi,
		   uint32_t *out, char *err, size_t errlen)
{
	const json_t *v = json_object_get(obj, key);
	if (!v || json_is_null(v)) {
		if (required)
			return errorf(err, errlen, -EINVAL, "%s: missing field %s", file, key);
		return 0;
	}
	/* Some exporters write integral values as reals (4096.0); accept those, nothing fractional. */
	double d;
	if (json_is_integer(v))
		d = (double)json_integer_value(v);
	else if (json_is_real(v) && floor(json_real_value(v)) == json_real_value(v))
		d = json_real_value(v);
	else
		return errorf(err, errlen, -EINVAL, "%s: %s must be an integer, got %s", file, key, tok_json_kind(v));
	if (d < lo || d > hi)
		return errorf(err, errlen, -EINVAL, "%s: %s must be in [%u, %u], got %.0f", file, key, lo, hi, d);
	*out = (uint32_t)d;
	return 0;
}

static int get_float(const json_t *obj, const char *file, const char *key, float *out, char *err, size_t errlen)
{
	const json_t *v = json_object_get(obj, key);
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_number(v))
		return errorf(err, errlen, -EINVAL, "%s: %s must be a number, got %s", file, key, tok_json_kind(v));
	/* Said in double, before float32 would make it inf or 0 and the checks name that instead. */
	const double d = json_number_value(v);
	if (!isfinite(d) || fabs(d) > FLT_MAX || (d != 0 && fabs(d) < FLT_MIN))
		return errorf(err, errlen, -EINVAL, "%s: %s %g is outside float32's range (%g to %g in magnitude)", file,
			      key, d, (double)FLT_MIN, (double)FLT_MAX);
	*out = (float)d;
	return 0;
}

/* Reads an optional boolean; absent or null leaves *out. */
static int get_bool(const json_t *obj, const char *file, const char *key, bool *out, char *err, size_t errlen)
{
	const json_t *v = json_object_get(obj, key);
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_boolean(v))
		return errorf(err, errlen, -EINVAL, "%s: %s must be true or false, got %s", file, key, tok_json_kind(v));
	*out = json_is_true(v);
	return 0;
}

/* Token ids: an integer, a list of integers, or null (none). Present: replaces *ids / *n. */
static int get_token_ids(const json_t *obj, const char *file, const char *key, int32_t *ids, uint32_t *n, uint32_t max,
			 char *err, size_t errlen)
{
	const json_t *v = json_object_get(obj, key);
	if (!v)
		return 0;
	if (json_is_null(v)) {
		*n = 0;
		return 0;
	}
	const json_t *one = v;
	size_t count = 1;
	if (json_is_array(v)) {
		count = json_array_size(v);
		if (count > max)
			return errorf(err, errlen, -EINVAL, "%s: %s lists %zu ids, at most %u are supported", file, key,
				    count, max);
	}
	for (size_t i = 0; i < count; i++) {
		if (json_is_array(v))
			one = json_array_get(v, i);
		if (!json_is_integer(one) || json_integer_value(one) < 0 || json_integer_value(one) > INT32_MAX)
			return errorf(err, errlen, -EINVAL, "%s: %s must be a non-negative integer or a list of them",
				    file, key);
		ids[i] = (int32_t)json_integer_value(one);
	}
	*n = (uint32_t)count;
	return 0;
}

static int parse_rope_scaling(const json_t *root, struct model_config *c, char *err, size_t errlen)
{
	const char *file = "config.json";
	const json_t *rs = json_object_get(root, "rope_scaling");
	c->rope_scaling = ROPE_SCALING_NONE;
	if (!rs || json_is_null(rs))
		return 0;
	if (!json_is_object(rs))
		return errorf(err, errlen, -EINVAL, "%s: rope_scaling must be an object or null, got %s", file,
			    tok_json_kind(rs));
	/* Newer configs say rope_type, older ones type; some write both. */
	const json_t *t = json_object_get(rs, "rope_type");
	if (!t || json_is_null(t))
		t = json_object_get(rs, "type");
	if (!json_is_string(t))
		return errorf(err, errlen, -EINVAL, "%s: rope_scaling needs a rope_type (or type) string", file);
	const char *type = json_string_value(t);
	int rc;
	if (!strcmp(type, "default"))
		return 0;
	if (!strcmp(type, "linear")) {
		c->rope_scaling = ROPE_SCALING_LINEAR;
	} else if (!strcmp(type, "llama3")) {
		c->rope_scaling = ROPE_SCALING_LLAMA3;
	} else {
		return errorf(err, errlen, -ENOTSUP,
			    "%s: rope_scaling type \"%s\" is not supported (supported: default, linear, llama3)", file,
			    type);
	}
	if (!json_object_get(rs, "factor"))
		return errorf(err, errlen, -EINVAL, "%s: rope_scaling (%s) is missing factor", file, type);
	rc = get_float(rs, file, "factor", &c->rope_factor, err, errlen);
	if (rc)
		return rc;
	if (c->rope_scaling == ROPE_SCALING_LINEAR)
		return 0;
	static const char *const need[] = {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};
	for (size_t i = 0; i < ARRAY_SIZE(need); i++)
		if (!json_object_get(rs, need[i]))
			return errorf(err, errlen, -EINVAL, "%s: rope_scaling (llama3) is missing %s", file, need[i]);
	rc = get_float(rs, file, "low_freq_factor", &c->rope_low_freq_factor, err, errlen);
	if (!rc)
		rc = get_float(rs, file, "high_freq_factor", &c->rope_high_freq_factor, err, errlen);
	if (!rc)
		rc = get_u32(rs, file, "original_max_position_embeddings", true, 1, UINT32_MAX,
			     &c->rope_original_max_position, err, errlen);
	return rc;
}

static int parse_arch(const json_t *root, struct model_config *c, char *err, size_t errlen)
{
	const json_t *a = json_object_get(root, "architectures");
	const char *name = NULL;
	if (a && !json_is_null(a)) {
		if (!json_is_array(a) || json_array_size(a) == 0 || !json_is_string(json_array_get(a, 0)))
			return errorf(err, errlen, -EINVAL, "config.json: architectures must be a list of names");
		name = json_string_value(json_array_get(a, 0));
	} else {
		/* Old exports leave architectures out; model_type then says what it is. */
		const json_t *mt = json_object_get(root, "model_type");
		if (!json_is_string(mt))
			return errorf(err, errlen, -EINVAL, "config.json: missing field architectures (and model_type)");
		const char *s = json_string_value(mt);
		name = !strcmp(s, "llama")	? "LlamaForCausalLM"
		       : !strcmp(s, "mistral")	? "MistralForCausalLM"
		       : !strcmp(s, "qwen3")	? "Qwen3ForCausalLM"
		       : !strcmp(s, "mixtral")	? "MixtralForCausalLM"
		       : !strcmp(s, "qwen3_moe") ? "Qwen3MoeForCausalLM"
						: s;
	}
	static const struct {
		const char *name;
		uint32_t arch;
	} known[] = {
		{"LlamaForCausalLM", ARCH_LLAMA},     {"MistralForCausalLM", ARCH_MISTRAL},
		{"Qwen3ForCausalLM", ARCH_QWEN3},     {"MixtralForCausalLM", ARCH_MIXTRAL},
		{"Qwen3MoeForCausalLM", ARCH_QWEN3_MOE},
	};
	for (size_t i = 0; i < ARRAY_SIZE(known); i++) {
		if (!strcmp(name, known[i].name)) {
			c->arch = known[i].arch;
			return 0;
		}
	}
	return errorf(err, errlen, -ENOTSUP,
		      "config.json: architecture %s is not supported (supported: LlamaForCausalLM, MistralForCausalLM, "
		      "Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM)",
		      name);
}

/* Features these architectures may switch on that the compute path does not implement. */
static int check_unsupported(const json_t *root, char *err, size_t errlen)
{
	static const char *const flags[] = {"attention_bias", "mlp_bias"};
	for (size_t i = 0; i < ARRAY_SIZE(flags); i++) {
		bool on = false;
		int rc = get_bool(root, "config.json", flags[i], &on, err, errlen);
		if (rc)
			return rc;
		if (on)
			return errorf(err, errlen, -ENOTSUP, "config.json: %s true is not supported (no bias terms)",
				    flags[i]);
	}
	const json_t *act = json_object_get(root, "hidden_act");
	if (act && json_is_string(act) && strcmp(json_string_value(act), "silu") != 0)
		return errorf(err, errlen, -ENOTSUP, "config.json: hidden_act %s is not supported (supported: silu)",
			    json_string_value(act));
	const json_t *q = json_object_get(root, "quantization_config");
	if (q && !json_is_null(q))
		return errorf(err, errlen, -ENOTSUP,
			    "config.json: quantized checkpoints (quantization_config) are not "
			    "supported; use a BF16, F16 or F32 checkpoint");
	return 0;
}

/* What the Qwen3 and mixture-of-experts architectures add: q/k norms, the experts and their
 * routing, and the variants refused (sliding windows on Qwen3, dense layers between sparse ones). */
static int parse_arch_extras(const json_t *root, struct model_config *c, char *err, size_t errlen)
{
	const char *f = "config.json";
	int rc = 0;
	if (c->arch == ARCH_QWEN3 || c->arch == ARCH_QWEN3_MOE) {
		c->flags |= MODEL_QK_NORM;
		bool sw = false;
		rc = get_bool(root, f, "use_sliding_window", &sw, err, errlen);
		if (rc)
			return rc;
		if (sw)
			return errorf(err, errlen, -ENOTSUP,
				      "%s: use_sliding_window true is not supported for Qwen3 (layers past "
				      "max_window_layers would attend through a window)", f);
		/* transformers keeps sliding_window only with use_sliding_window; it means nothing here. */
		c->sliding_window = 0;
	}
	if (c->arch == ARCH_MIXTRAL) {
		rc = get_u32(root, f, "num_local_experts", true, 1, MODEL_MAX_EXPERTS, &c->n_experts, err, errlen);
		if (!rc)
			rc = get_u32(root, f, "num_experts_per_tok", true, 1, MODEL_MAX_EXPERTS, &c->n_experts_used, err,
				     errlen);
		c->expert_ffn_dim = c->ffn_dim;
		c->flags |= MODEL_NORM_TOPK; /* softmax over the top-k logits */
	} else if (c->arch == ARCH_QWEN3_MOE) {
		rc = get_u32(root, f, "num_experts", true, 1, MODEL_MAX_EXPERTS, &c->n_experts, err, errlen);
		if (!rc)
			rc = get_u32(root, f, "num_experts_per_tok", true, 1, MODEL_MAX_EXPERTS, &c->n_experts_used, err,
				     errlen);
		if (!rc)
			rc = get_u32(root, f, "moe_intermediate_size", true, 1, UINT32_MAX, &c->expert_ffn_dim, err,
				     errlen);
		bool norm = false; /* Qwen3MoeConfig's default */
		if (!rc)
			rc = get_bool(root, f, "norm_topk_prob", &norm, err, errlen);
		if (norm)
			c->flags |= MODEL_NORM_TOPK;
		uint32_t step = 1;
		if (!rc)
			rc = get_u32(root, f, "decoder_sparse_step", false, 0, UINT32_MAX, &step, err, errlen);
		if (!rc && step != 1)
			rc = errorf(err, errlen, -ENOTSUP,
				    "%s: decoder_sparse_step %u is not supported (only 1: every layer a mixture of "
				    "experts)", f, step);
		const json_t *mlp_only = json_object_get(root, "mlp_only_layers");
		if (!rc && mlp_only && !json_is_null(mlp_only) &&
		    (!json_is_array(mlp_only) || json_array_size(mlp_only) != 0))
			rc = errorf(err, errlen, -ENOTSUP,
				    "%s: mlp_only_layers is not supported (only an empty list: every layer a mixture "
				    "of experts)", f);
	}
	if (!rc && c->n_experts && c->n_experts_used > c->n_experts)
		rc = errorf(err, errlen, -EINVAL, "%s: num_experts_per_tok %u exceeds the number of experts %u", f,
			    c->n_experts_used, c->n_experts);
	return rc;
}

static int parse_config(const json_t *root, struct model_config *c, char *err, size_t errlen)
{
	const char *f = "config.json";
	int rc;
	if (!json_is_object(root))
		return errorf(err, errlen, -EINVAL, "%s: the top level must be an object", f);
	memset(c, 0, sizeof(*c));
	rc = parse_arch(root, c, err, errlen);
	if (!rc)
		rc = check_unsupported(root, err, errlen);
	if (!rc)
		rc = get_u32(root, f, "hidden_size", true, 1, UINT32_MAX, &c->dim, err, errlen);
	if (!rc)
		rc = get_u32(root, f, "num_hidden_layers", true, 1, UINT32_MAX, &c->n_layers, err, errlen);
	if (!rc)
		rc = get_u32(root, f, "num_attention_heads", true, 1, UINT32_MAX, &c->n_heads, err, errlen);
	c->n_kv_heads = c->n_heads;
	if (!rc)
		rc = get_u32(root, f, "num_key_value_heads", false, 1, UINT32_MAX, &c->n_kv_heads, err, errlen);
	if (!rc)
		rc = get_u32(root, f, "head_dim", false, 1, UINT32_MAX, &c->head_dim, err, errlen);
	if (!rc)
		rc = get_u32(root, f, "intermediate_size", true, 1, UINT32_MAX, &c->ffn_dim, err, errlen);
	if (!rc)
		rc = get_u32(root, f, "vocab_size", true, 1, UINT32_MAX, &c->vocab_size, err, errlen);
	c->max_position = 2048; /* the defaults of transformers' LlamaConfig */
	c->rms_eps = 1e-6f;
	c->rope_theta = 10000.0f;
	if (!rc)
		rc = get_u32(root, f, "max_position_embeddings", false, 1, UINT32_MAX, &c->max_position, err, errlen);
	if (!rc)
		rc = get_float(root, f, "rms_norm_eps", &c->rms_eps, err, errlen);
	if (!rc)
		rc = get_float(root, f, "rope_theta", &c->rope_theta, err, errlen);
	if (!rc)
		rc = parse_rope_scaling(root, c, err, errlen);
	bool tie = false;
	if (!rc)
		rc = get_bool(root, f, "tie_word_embeddings", &tie, err, errlen);
	c->tie_embeddings = tie;
	if (!rc)
		rc = get_u32(root, f, "sliding_window", false, 0, UINT32_MAX, &c->sliding_window, err, errlen);
	int32_t bos[1];
	uint32_t n_bos = 0;
	if (!rc)
		rc = get_token_ids(root, f, "bos_token_id", bos, &n_bos, 1, err, errlen);
	c->bos_id = n_bos ? bos[0] : -1;
	if (!rc)
		rc = get_token_ids(root, f, "eos_token_id", c->eos_ids, &c->n_eos, MODEL_MAX_EOS, err, errlen);
	if (!rc)
		rc = parse_arch_extras(root, c, err, errlen);
	if (rc)
		return rc;
	if (!c->head_dim) {
		if (c->dim % c->n_heads)
			return errorf(err, errlen, -EINVAL,
				    "%s: num_attention_heads %u does not divide hidden_size %u (no head_dim)", f,
				    c->n_heads, c->dim);
		c->head_dim = c->dim / c->n_heads;
	}
	return 0;
}

/* generation_config.json, when present, says what generation stops on; its ids win. */
static int parse_generation_config(const char *dir, struct model_config *c, char *err, size_t errlen)
{
	const char *f = "generation_config.json";
	char path[PATH_MAX];
	if (snprintf(path, sizeof(path), "%s/%s", dir, f) >= (int)sizeof(path))
		return errorf(err, errlen, -ENAMETOOLONG, "%s/%s: path too long", dir, f);
	if (access(path, F_OK) != 0)
		return 0;
	json_error_t je;
	json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
	if (!root)
		return errorf(err, errlen, -EINVAL, "%s: bad JSON at line %d column %d: %s", path, je.line, je.column,
			    je.text);
	int rc = 0;
	if (!json_is_object(root)) {
		rc = errorf(err, errlen, -EINVAL, "%s: the top level must be an object", path);
		goto out_root;
	}
	int32_t bos[1];
	uint32_t n_bos = c->bos_id >= 0;
	bos[0] = c->bos_id;
	rc = get_token_ids(root, f, "bos_token_id", bos, &n_bos, 1, err, errlen);
	if (rc)
		goto out_root;
	c->bos_id = n_bos ? bos[0] : -1;
	rc = get_token_ids(root, f, "eos_token_id", c->eos_ids, &c->n_eos, MODEL_MAX_EOS, err, errlen);
out_root:
	json_decref(root);
	return rc;
}

/* config.json, then generation_config.json over it, then the whole checked (model_config_check). */
int mf_load_config(const char *dir, struct model_config *cfg, char *err, size_t errlen)
{
	char path[PATH_MAX];
	if (snprintf(path, sizeof(path), "%s/config.json", dir) >= (int)sizeof(path))
		return errorf(err, errlen, -ENAMETOOLONG, "%s: path too long", dir);
	if (access(path, F_OK) != 0)
		return errorf(err, errlen, -ENOENT, "%s: no such file (is %s a Hugging Face checkpoint directory?)", path,
			    dir);
	json_error_t je;
	json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
	if (!root)
		return errorf(err, errlen, -EINVAL, "%s: bad JSON at line %d column %d: %s", path, je.line, je.column,
			    je.text);
	int rc = parse_config(root, cfg, err, errlen);
	json_decref(root);
	if (!rc)
		rc = parse_generation_config(dir, cfg, err, errlen);
	if (!rc)
		rc = model_config_check(cfg, err, errlen);
	return rc;
}

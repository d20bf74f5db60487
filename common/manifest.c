/* manifest.c - reads a Hugging Face Llama/Mistral checkpoint directory into a manifest.
 *
 * Order of work: config.json (+ generation_config.json) -> the list of safetensors files
 * (index or single file) -> each file's header, every tensor checked against the config ->
 * canonical tensor table (group, then role) -> read extents per group -> hash.
 *
 * The tensor table is indexed by a canonical slot from the start: slot 0 is the embedding,
 * then 9 slots per layer (attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up, w_down), then
 * the final norm and, when untied, lm_head. That is group order then role order, which is
 * the order the manifest publishes, so no sort is needed afterwards. */
#include "common/manifest.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/tokenizer/ids.h"
#include "common/util.h"

#define HEADER_MAX	  (100ull << 20) /* a safetensors header above this is corrupt, not big */
#define MERGE_GAP	  (64ull << 10)	 /* reading a gap this small costs less than another request */
#define LAYER_ROLES	  9		 /* tensors per layer: 5 attention + 4 feed-forward */
#define GROUP_MAX_TENSORS 8		 /* attn holds 5, the most of any group */
#define INDEX_NAME	  "model.safetensors.index.json"
#define SINGLE_NAME	  "model.safetensors"

/* ---- configuration ---- */

static const char *json_type_name(const json_t *v)
{
	switch (json_typeof(v)) {
	case JSON_OBJECT:
		return "an object";
	case JSON_ARRAY:
		return "a list";
	case JSON_STRING:
		return "a string";
	case JSON_INTEGER:
		return "an integer";
	case JSON_REAL:
		return "a real number";
	case JSON_TRUE:
	case JSON_FALSE:
		return "a boolean";
	case JSON_NULL:
		return "null";
	}
	return "?";
}

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
		return errorf(err, errlen, -EINVAL, "%s: %s must be an integer, got %s", file, key, json_type_name(v));
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
		return errorf(err, errlen, -EINVAL, "%s: %s must be a number, got %s", file, key, json_type_name(v));
	*out = (float)json_number_value(v);
	return 0;
}

/* Reads an optional boolean; absent or null leaves *out. */
static int get_bool(const json_t *obj, const char *file, const char *key, bool *out, char *err, size_t errlen)
{
	const json_t *v = json_object_get(obj, key);
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_boolean(v))
		return errorf(err, errlen, -EINVAL, "%s: %s must be true or false, got %s", file, key, json_type_name(v));
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
			    json_type_name(rs));
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
		name = !strcmp(s, "llama") ? "LlamaForCausalLM" : !strcmp(s, "mistral") ? "MistralForCausalLM" : s;
	}
	if (!strcmp(name, "LlamaForCausalLM"))
		c->arch = ARCH_LLAMA;
	else if (!strcmp(name, "MistralForCausalLM"))
		c->arch = ARCH_MISTRAL;
	else
		return errorf(err, errlen, -ENOTSUP,
			    "config.json: architecture %s is not supported (supported: LlamaForCausalLM, "
			    "MistralForCausalLM)",
			    name);
	return 0;
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

/* ---- tensor names ---- */

static uint32_t n_slots(const struct model_config *c)
{
	return 2 + LAYER_ROLES * c->n_layers + (c->tie_embeddings ? 0 : 1);
}

static const char *const layer_suffix[LAYER_ROLES] = {
	"input_layernorm.weight",  "self_attn.q_proj.weight", "self_attn.k_proj.weight",
	"self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
	"mlp.gate_proj.weight",	   "mlp.up_proj.weight",      "mlp.down_proj.weight",
};

/* What slot s holds: role, group and checkpoint name. */
static void slot_info(const struct model_config *c, uint32_t s, uint32_t *role, uint32_t *group, char *name, size_t len)
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

enum name_class { NAME_SLOT = 0, NAME_IGNORE = 1, NAME_UNEXPECTED = 2 };

/* Maps a checkpoint tensor name to its slot. */
static enum name_class classify(const struct model_config *c, const char *name, uint32_t *slot)
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
	static const char prefix[] = "model.layers.";
	if (strncmp(name, prefix, sizeof(prefix) - 1) != 0)
		return NAME_UNEXPECTED;
	const char *p = name + sizeof(prefix) - 1;
	/* Strict decimal: no sign, no leading zero, so every layer has exactly one spelling. */
	if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] != '.'))
		return NAME_UNEXPECTED;
	uint64_t l = 0;
	while (*p >= '0' && *p <= '9') {
		l = l * 10 + (uint64_t)(*p++ - '0');
		if (l > UINT32_MAX)
			return NAME_UNEXPECTED;
	}
	if (*p++ != '.' || l >= c->n_layers)
		return NAME_UNEXPECTED;
	if (!strcmp(p, "self_attn.rotary_emb.inv_freq"))
		return NAME_IGNORE; /* old exports saved the RoPE table; it is recomputed from the config */
	for (uint32_t k = 0; k < LAYER_ROLES; k++) {
		if (!strcmp(p, layer_suffix[k])) {
			*slot = 1 + LAYER_ROLES * (uint32_t)l + k;
			return NAME_SLOT;
		}
	}
	return NAME_UNEXPECTED;
}

static void format_shape(char *buf, size_t len, const uint64_t *shape, uint32_t ndim)
{
	size_t n = (size_t)snprintf(buf, len, "[");
	for (uint32_t i = 0; i < ndim && n < len; i++)
		n += (size_t)snprintf(buf + n, len - n, "%s%llu", i ? ", " : "", (unsigned long long)shape[i]);
	if (n < len)
		snprintf(buf + n, len - n, "]");
}

/* ---- loading ---- */

#define NO_FILE UINT32_MAX

struct loader {
	const char *dir;
	struct manifest *m;
	char **file_names;    /* n_files, plain names inside dir */
	uint32_t *index_file; /* per slot: the file the index names, or NO_FILE (no index or not listed) */
	bool have_index;
	bool *found; /* per slot */
	char *err;
	size_t errlen;
};

static int name_is_plain(const char *s)
{
	return *s && strcmp(s, ".") && strcmp(s, "..") && !strchr(s, '/') && strlen(s) < NAME_MAX;
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

static uint32_t file_lookup(const struct loader *ld, const char *name)
{
	for (uint32_t i = 0; i < ld->m->n_files; i++)
		if (!strcmp(ld->file_names[i], name))
			return i;
	return NO_FILE;
}

/* model.safetensors.index.json: the files (sorted by name, each once) and, per tensor, its file. */
static int read_index(struct loader *ld, const char *path)
{
	struct manifest *m = ld->m;
	json_error_t je;
	json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
	if (!root)
		return errorf(ld->err, ld->errlen, -EINVAL, "%s: bad JSON at line %d column %d: %s", path, je.line,
			    je.column, je.text);
	int rc = 0;
	json_t *wm = json_is_object(root) ? json_object_get(root, "weight_map") : NULL;
	if (!json_is_object(wm)) {
		rc = errorf(ld->err, ld->errlen, -EINVAL, "%s: missing weight_map object", path);
		goto out_root;
	}
	size_t n = json_object_size(wm);
	ld->file_names = calloc(n ? n : 1, sizeof(*ld->file_names));
	if (!ld->file_names) {
		rc = errorf(ld->err, ld->errlen, -ENOMEM, "out of memory reading %s", path);
		goto out_root;
	}
	const char *key;
	json_t *val;
	/* Pass 1: the distinct file names. */
	json_object_foreach(wm, key, val) {
		if (!json_is_string(val) || !name_is_plain(json_string_value(val))) {
			rc = errorf(ld->err, ld->errlen, -EINVAL,
				  "%s: weight_map entry for %s must be a plain file name inside the model directory "
				  "(no '/' or '..')",
				  path, key);
			goto out_root;
		}
		if (file_lookup(ld, json_string_value(val)) != NO_FILE)
			continue;
		ld->file_names[m->n_files] = strdup(json_string_value(val));
		if (!ld->file_names[m->n_files]) {
			rc = errorf(ld->err, ld->errlen, -ENOMEM, "out of memory reading %s", path);
			goto out_root;
		}
		m->n_files++;
	}
	if (m->n_files == 0) {
		rc = errorf(ld->err, ld->errlen, -EINVAL, "%s: weight_map is empty", path);
		goto out_root;
	}
	qsort(ld->file_names, m->n_files, sizeof(*ld->file_names), cmp_str);
	/* Pass 2: which file each tensor lives in. */
	json_object_foreach(wm, key, val) {
		uint32_t slot;
		enum name_class nc = classify(&m->cfg, key, &slot);
		if (nc == NAME_UNEXPECTED) {
			rc = errorf(ld->err, ld->errlen, -EINVAL, "%s: unexpected tensor %s (not part of a %u-layer %s)",
				  path, key, m->cfg.n_layers, m->cfg.arch == ARCH_MISTRAL ? "Mistral" : "Llama");
			goto out_root;
		}
		if (nc == NAME_SLOT)
			ld->index_file[slot] = file_lookup(ld, json_string_value(val));
	}
out_root:
	json_decref(root);
	return rc;
}

static int parse_u64_pair(const json_t *a, uint64_t *x, uint64_t *y)
{
	if (!json_is_array(a) || json_array_size(a) != 2)
		return -1;
	const json_t *v0 = json_array_get(a, 0), *v1 = json_array_get(a, 1);
	if (!json_is_integer(v0) || !json_is_integer(v1) || json_integer_value(v0) < 0 || json_integer_value(v1) < 0)
		return -1;
	*x = (uint64_t)json_integer_value(v0);
	*y = (uint64_t)json_integer_value(v1);
	return 0;
}

/* Checks one header entry and, for a tensor the model uses, records it in its slot. */
static int read_tensor_entry(struct loader *ld, uint32_t fi, const char *name, const json_t *e)
{
	struct manifest *m = ld->m;
	const struct manifest_file *mf = &m->files[fi];
	const char *fname = ld->file_names[fi];
	char *err = ld->err;
	size_t errlen = ld->errlen;
	uint32_t slot = 0;
	enum name_class nc = classify(&m->cfg, name, &slot);
	if (nc == NAME_UNEXPECTED)
		return errorf(err, errlen, -EINVAL, "%s: unexpected tensor %s (not part of a %u-layer %s)", fname, name,
			    m->cfg.n_layers, m->cfg.arch == ARCH_MISTRAL ? "Mistral" : "Llama");
	if (!json_is_object(e))
		return errorf(err, errlen, -EINVAL, "%s: header entry %s must be an object", fname, name);
	const json_t *jd = json_object_get(e, "dtype"), *js = json_object_get(e, "shape");
	const json_t *jo = json_object_get(e, "data_offsets");
	if (!json_is_string(jd) || !json_is_array(js) || !jo)
		return errorf(err, errlen, -EINVAL, "%s: tensor %s needs dtype, shape and data_offsets", fname, name);
	uint64_t begin, end;
	if (parse_u64_pair(jo, &begin, &end))
		return errorf(err, errlen, -EINVAL,
			    "%s: tensor %s: data_offsets must be [begin, end], two non-negative "
			    "integers",
			    fname, name);
	uint64_t data_len = mf->size - mf->data_start;
	if (begin > end)
		return errorf(err, errlen, -EINVAL, "%s: tensor %s: data_offsets [%llu, %llu] end before they begin",
			    fname, name, (unsigned long long)begin, (unsigned long long)end);
	if (end > data_len)
		return errorf(err, errlen, -EINVAL,
			    "%s: tensor %s: data_offsets [%llu, %llu] run past the end of the data (%llu bytes): the "
			    "file is truncated or the header is corrupt",
			    fname, name, (unsigned long long)begin, (unsigned long long)end,
			    (unsigned long long)data_len);
	if (nc == NAME_IGNORE)
		return 0; /* bounds checked; its dtype and shape do not matter to us */

	enum dtype dt;
	int rc = dtype_parse(json_string_value(jd), &dt);
	if (rc == -ENOTSUP)
		return errorf(err, errlen, -ENOTSUP,
			    "%s: tensor %s has dtype %s, which is not supported (supported: BF16, F16, F32)", fname,
			    name, json_string_value(jd));
	if (rc)
		return errorf(err, errlen, -EINVAL, "%s: tensor %s has unknown dtype \"%s\"", fname, name,
			    json_string_value(jd));
	uint64_t shape[8] = {0};
	size_t ndim = json_array_size(js);
	if (ndim > ARRAY_SIZE(shape))
		return errorf(err, errlen, -EINVAL, "%s: tensor %s has %zu dimensions", fname, name, ndim);
	uint64_t count = 1;
	for (size_t i = 0; i < ndim; i++) {
		const json_t *d = json_array_get(js, i);
		if (!json_is_integer(d) || json_integer_value(d) < 0 || json_integer_value(d) > (1ll << 40))
			return errorf(err, errlen, -EINVAL, "%s: tensor %s: shape must hold non-negative integers", fname,
				    name);
		shape[i] = (uint64_t)json_integer_value(d);
		if (__builtin_mul_overflow(count, shape[i], &count))
			return errorf(err, errlen, -EINVAL, "%s: tensor %s: shape overflows", fname, name);
	}
	uint32_t role, group, want_ndim;
	uint64_t want[2];
	char want_name[TENSOR_NAME_MAX];
	slot_info(&m->cfg, slot, &role, &group, want_name, sizeof(want_name));
	int src = model_expected_shape(&m->cfg, (enum tensor_role)role, &want_ndim, want);
	assert(src == 0);
	(void)src;
	if (ndim != want_ndim || shape[0] != want[0] || (want_ndim == 2 && shape[1] != want[1])) {
		char got_s[128], want_s[64];
		format_shape(got_s, sizeof(got_s), shape, (uint32_t)ndim);
		format_shape(want_s, sizeof(want_s), want, want_ndim);
		return errorf(err, errlen, -EINVAL, "%s: tensor %s has shape %s, but config.json implies %s", fname, name,
			    got_s, want_s);
	}
	uint64_t nbytes = count * dtype_size(dt);
	if (end - begin != nbytes)
		return errorf(err, errlen, -EINVAL,
			    "%s: tensor %s: data_offsets [%llu, %llu] hold %llu bytes, but %s of shape [%llu%s] needs "
			    "%llu",
			    fname, name, (unsigned long long)begin, (unsigned long long)end,
			    (unsigned long long)(end - begin), dtype_name(dt), (unsigned long long)shape[0],
			    ndim == 2 ? ", ..." : "", (unsigned long long)nbytes);

	if (ld->have_index) {
		if (ld->index_file[slot] == NO_FILE)
			return errorf(err, errlen, -EINVAL, "%s holds tensor %s, which %s does not list", fname, name,
				    INDEX_NAME);
		if (ld->index_file[slot] != fi)
			return 0; /* a stray copy: the index says where the tensor is */
	}
	if (ld->found[slot])
		return errorf(err, errlen, -EINVAL, "tensor %s appears twice", name); /* single file: JSON forbids it */
	struct tensor_desc *t = &m->tensors[slot];
	memset(t, 0, sizeof(*t));
	str_copy(t->name, sizeof(t->name), want_name);
	t->group = group;
	t->role = role;
	t->dtype = dt;
	t->ndim = want_ndim;
	t->shape[0] = shape[0];
	t->shape[1] = want_ndim == 2 ? shape[1] : 0;
	t->nbytes = nbytes;
	t->file_index = fi;
	t->file_offset = mf->data_start + begin;
	ld->found[slot] = true;
	return 0;
}

/* Opens file fi, reads and checks its header, records its tensors. */
static int read_safetensors(struct loader *ld, uint32_t fi)
{
	struct manifest_file *mf = &ld->m->files[fi];
	const char *fname = ld->file_names[fi];
	char *err = ld->err;
	size_t errlen = ld->errlen;
	int rc = 0;
	char *hdr = NULL;
	json_t *root = NULL;

	int fd = open(mf->path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		rc = -errno;
		return errorf(err, errlen, rc, "%s: cannot open: %s%s", mf->path, strerror(-rc),
			    ld->have_index ? " (named in " INDEX_NAME ")" : "");
	}
	struct stat st;
	if (fstat(fd, &st) != 0) {
		rc = errorf(err, errlen, -errno, "%s: stat: %s", mf->path, strerror(errno));
		goto out_close;
	}
	if (!S_ISREG(st.st_mode)) {
		rc = errorf(err, errlen, -EINVAL, "%s: not a regular file", mf->path);
		goto out_close;
	}
	mf->size = (uint64_t)st.st_size;
	unsigned char lenbuf[8];
	if (mf->size < 8 || pread(fd, lenbuf, 8, 0) != 8) {
		rc = errorf(err, errlen, -EINVAL, "%s: too short for a safetensors file (%llu bytes)", fname,
			  (unsigned long long)mf->size);
		goto out_close;
	}
	uint64_t n = 0;
	for (int i = 7; i >= 0; i--)
		n = (n << 8) | lenbuf[i];
	if (n == 0 || n > HEADER_MAX) {
		rc = errorf(err, errlen, -EINVAL, "%s: header length %llu is invalid (must be 1 .. 100 MiB)", fname,
			  (unsigned long long)n);
		goto out_close;
	}
	if (8 + n > mf->size) {
		rc = errorf(err, errlen, -EINVAL, "%s: header length %llu runs past the end of the file (%llu bytes)",
			  fname, (unsigned long long)n, (unsigned long long)mf->size);
		goto out_close;
	}
	mf->data_start = 8 + n;
	hdr = malloc(n);
	if (!hdr) {
		rc = errorf(err, errlen, -ENOMEM, "%s: out of memory for a %llu-byte header", fname,
			  (unsigned long long)n);
		goto out_close;
	}
	ssize_t got = pread(fd, hdr, n, 8);
	if (got != (ssize_t)n) {
		rc = errorf(err, errlen, got < 0 ? -errno : -EIO, "%s: reading the header: %s", fname,
			  got < 0 ? strerror(errno) : "short read");
		goto out_free;
	}
	json_error_t je;
	root = json_loadb(hdr, n, JSON_REJECT_DUPLICATES, &je);
	if (!root) {
		rc = errorf(err, errlen, -EINVAL, "%s: bad JSON header at column %d: %s", fname, je.column, je.text);
		goto out_free;
	}
	if (!json_is_object(root)) {
		rc = errorf(err, errlen, -EINVAL, "%s: the header must be a JSON object", fname);
		goto out_json;
	}
	const char *key;
	json_t *val;
	json_object_foreach(root, key, val) {
		if (!strcmp(key, "__metadata__"))
			continue;
		rc = read_tensor_entry(ld, fi, key, val);
		if (rc)
			goto out_json;
	}
out_json:
	json_decref(root);
out_free:
	free(hdr);
out_close:
	close(fd);
	return rc;
}

/* Sorts idx[0..n) by (file, offset): the order the disk wants to be read in. */
static void sort_by_position(const struct tensor_desc *t, uint32_t *idx, uint32_t n)
{
	for (uint32_t i = 1; i < n; i++) {
		uint32_t k = idx[i], j = i;
		while (j > 0 &&
		       (t[idx[j - 1]].file_index > t[k].file_index || (t[idx[j - 1]].file_index == t[k].file_index &&
								       t[idx[j - 1]].file_offset > t[k].file_offset))) {
			idx[j] = idx[j - 1];
			j--;
		}
		idx[j] = k;
	}
}

static int build_layout(struct manifest *m)
{
	const struct model_config *c = &m->cfg;
	m->n_groups = model_n_groups(c);
	m->groups = calloc(m->n_groups, sizeof(*m->groups));
	m->extents = calloc(m->n_tensors, sizeof(*m->extents)); /* never more extents than tensors */
	if (!m->groups || !m->extents)
		return -ENOMEM;
	for (uint32_t t = 0; t < m->n_tensors; t++) {
		struct group_desc *g = &m->groups[m->tensors[t].group];
		if (g->n_tensors == 0)
			g->first_tensor = t;
		g->n_tensors++;
	}
	uint32_t ne = 0;
	for (uint32_t gi = 0; gi < m->n_groups; gi++) {
		struct group_desc *g = &m->groups[gi];
		if (gi == group_id_embed()) {
			g->kind = GROUP_EMBED;
			g->size_class = CLASS_GLOBAL;
		} else if (gi == group_id_head(c)) {
			g->kind = GROUP_HEAD;
			g->size_class = CLASS_GLOBAL;
		} else {
			g->kind = gi % 2 ? GROUP_ATTN : GROUP_FFN;
			g->layer = (gi - 1) / 2;
			g->size_class = gi % 2 ? CLASS_ATTN : CLASS_FFN;
		}
		assert(g->n_tensors >= 1 && g->n_tensors <= GROUP_MAX_TENSORS);
		uint32_t idx[GROUP_MAX_TENSORS];
		for (uint32_t k = 0; k < g->n_tensors; k++)
			idx[k] = g->first_tensor + k;
		sort_by_position(m->tensors, idx, g->n_tensors);
		g->first_extent = ne;
		uint64_t slot = 0;
		for (uint32_t k = 0; k < g->n_tensors; k++) {
			struct tensor_desc *t = &m->tensors[idx[k]];
			uint64_t b = t->file_offset & ~(uint64_t)(MANIFEST_ALIGN - 1);
			uint64_t e = ALIGN_UP(t->file_offset + t->nbytes, (uint64_t)MANIFEST_ALIGN);
			struct read_extent *x = ne > g->first_extent ? &m->extents[ne - 1] : NULL;
			if (x && x->file_index == t->file_index && b < x->file_offset + x->length + MERGE_GAP) {
				/* Touching, overlapping or a small gap: one read covers both. */
				uint64_t xe = x->file_offset + x->length;
				if (e > xe) {
					slot += e - xe;
					x->length = e - x->file_offset;
				}
			} else {
				x = &m->extents[ne++];
				x->group = gi;
				x->file_index = t->file_index;
				x->file_offset = b;
				x->length = e - b;
				x->slot_offset = slot;
				slot += e - b;
			}
			t->slot_offset = x->slot_offset + (t->file_offset - x->file_offset);
			g->tensor_bytes += t->nbytes;
		}
		g->n_extents = ne - g->first_extent;
		g->slot_bytes = slot;
		if (slot > m->class_bytes[g->size_class])
			m->class_bytes[g->size_class] = slot;
	}
	m->n_extents = ne;
	return 0;
}

static void finish_summary(struct manifest *m)
{
	uint64_t h = fnv1a64(FNV64_INIT, &m->cfg, sizeof(m->cfg));
	uint32_t counts[DT_COUNT] = {0};
	m->total_tensor_bytes = 0;
	for (uint32_t i = 0; i < m->n_tensors; i++) {
		const struct tensor_desc *t = &m->tensors[i];
		h = fnv1a64(h, t->name, strlen(t->name) + 1);
		h = fnv1a64(h, &t->dtype, sizeof(t->dtype));
		h = fnv1a64(h, &t->ndim, sizeof(t->ndim));
		h = fnv1a64(h, t->shape, sizeof(t->shape));
		m->total_tensor_bytes += t->nbytes;
		if (t->ndim == 2)
			counts[t->dtype]++;
	}
	m->hash = h;
	m->weight_dtype = 0;
	for (uint32_t d = 1; d < DT_COUNT; d++)
		if (counts[d] > counts[m->weight_dtype])
			m->weight_dtype = d;
}

static void loader_free(struct loader *ld)
{
	if (ld->file_names)
		for (uint32_t i = 0; i < ld->m->n_files; i++)
			free(ld->file_names[i]);
	free(ld->file_names);
	free(ld->index_file);
	free(ld->found);
}

static int load_config(const char *dir, struct model_config *cfg, char *err, size_t errlen)
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

int manifest_load(const char *dir, struct manifest **out, char *err, size_t errlen)
{
	assert(dir && out);
	*out = NULL;
	struct stat st;
	if (stat(dir, &st) != 0) {
		int e = errno;
		return errorf(err, errlen, -e, "model directory %s %s", dir,
			    e == ENOENT ? "does not exist" : strerror(e));
	}
	if (!S_ISDIR(st.st_mode))
		return errorf(err, errlen, -ENOTDIR, "model directory %s is not a directory", dir);

	struct manifest *m = calloc(1, sizeof(*m));
	if (!m)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	struct loader ld = {.dir = dir, .m = m, .err = err, .errlen = errlen};
	int rc = load_config(dir, &m->cfg, err, errlen);
	if (rc)
		goto out_free;

	uint32_t ns = n_slots(&m->cfg);
	m->n_tensors = ns;
	m->tensors = calloc(ns, sizeof(*m->tensors));
	ld.index_file = malloc(ns * sizeof(*ld.index_file));
	ld.found = calloc(ns, sizeof(*ld.found));
	if (!m->tensors || !ld.index_file || !ld.found) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out_free;
	}
	for (uint32_t s = 0; s < ns; s++)
		ld.index_file[s] = NO_FILE;

	char path[PATH_MAX];
	if (snprintf(path, sizeof(path), "%s/%s", dir, INDEX_NAME) >= (int)sizeof(path)) {
		rc = errorf(err, errlen, -ENAMETOOLONG, "%s: path too long", dir);
		goto out_free;
	}
	if (access(path, F_OK) == 0) {
		ld.have_index = true;
		rc = read_index(&ld, path);
		if (rc)
			goto out_free;
	} else {
		snprintf(path, sizeof(path), "%s/%s", dir, SINGLE_NAME);
		if (access(path, F_OK) != 0) {
			rc = errorf(err, errlen, -ENOENT, "%s holds neither %s nor %s: no weights to load", dir,
				  INDEX_NAME, SINGLE_NAME);
			goto out_free;
		}
		ld.file_names = calloc(1, sizeof(*ld.file_names));
		if (!ld.file_names || !(ld.file_names[0] = strdup(SINGLE_NAME))) {
			rc = errorf(err, errlen, -ENOMEM, "out of memory");
			goto out_free;
		}
		m->n_files = 1;
	}

	m->files = calloc(m->n_files, sizeof(*m->files));
	if (!m->files) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out_free;
	}
	for (uint32_t i = 0; i < m->n_files; i++) {
		if (snprintf(m->files[i].path, sizeof(m->files[i].path), "%s/%s", dir, ld.file_names[i]) >=
		    (int)sizeof(m->files[i].path)) {
			rc = errorf(err, errlen, -ENAMETOOLONG, "%s/%s: path too long", dir, ld.file_names[i]);
			goto out_free;
		}
		rc = read_safetensors(&ld, i);
		if (rc)
			goto out_free;
	}
	for (uint32_t s = 0; s < ns; s++) {
		if (ld.found[s])
			continue;
		uint32_t role, group;
		char name[TENSOR_NAME_MAX];
		slot_info(&m->cfg, s, &role, &group, name, sizeof(name));
		if (ld.have_index && ld.index_file[s] != NO_FILE)
			rc = errorf(err, errlen, -EINVAL, "%s puts tensor %s in %s, but that file does not hold it",
				  INDEX_NAME, name, ld.file_names[ld.index_file[s]]);
		else
			rc = errorf(err, errlen, -EINVAL, "missing tensor %s (config.json: %u layers, %s embeddings)",
				  name, m->cfg.n_layers, m->cfg.tie_embeddings ? "tied" : "untied");
		goto out_free;
	}
	rc = build_layout(m);
	if (rc) {
		errorf(err, errlen, rc, "out of memory laying out %s", dir);
		goto out_free;
	}
	finish_summary(m);
	snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
	if (access(path, F_OK) == 0 && (rc = manifest_attach_tokenizer(m, path, err, errlen)) != 0)
		goto out_free;
	loader_free(&ld);
	*out = m;
	return 0;

out_free:
	loader_free(&ld);
	manifest_destroy(&m);
	return rc;
}

int manifest_attach_tokenizer(struct manifest *m, const char *path, char *err, size_t errlen)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errorf(err, errlen, -errno, "tokenizer %s: %s", path, strerror(errno));
	struct stat st;
	char *data = NULL;
	int rc = 0;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		rc = errorf(err, errlen, -EINVAL, "tokenizer %s is not a regular file", path);
		goto out_close;
	}
	if (st.st_size > (off_t)(256u << 20)) {
		rc = errorf(err, errlen, -EFBIG, "tokenizer %s is larger than 256 MiB", path);
		goto out_close;
	}
	data = malloc((size_t)st.st_size + 1);
	if (!data) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out_close;
	}
	size_t done = 0;
	while (done < (size_t)st.st_size) {
		ssize_t n = pread(fd, data + done, (size_t)st.st_size - done, (off_t)done);
		if (n <= 0) {
			rc = errorf(err, errlen, n < 0 ? -errno : -EIO, "reading tokenizer %s: %s", path,
				    n < 0 ? strerror(errno) : "short read");
			goto out_close;
		}
		done += (size_t)n;
	}
	uint32_t tv;
	rc = tokenizer_ids_scan(path, data, done, &tv, err, errlen);
	if (rc)
		goto out_close;
	if (tv > m->cfg.vocab_size) {
		rc = errorf(err, errlen, -EINVAL,
			    "tokenizer %s defines ids up to %u, but config.json's vocab_size is %u: they belong to "
			    "different models",
			    path, tv - 1, m->cfg.vocab_size);
		goto out_close;
	}
	free(m->tokenizer_json);
	m->tokenizer_json = data;
	m->tokenizer_bytes = done;
	data = NULL;
	str_copy(m->tokenizer_path, sizeof(m->tokenizer_path), path);
out_close:
	free(data);
	close(fd);
	return rc;
}

void manifest_destroy(struct manifest **mp)
{
	if (!mp || !*mp)
		return;
	struct manifest *m = *mp;
	free(m->tokenizer_json);
	free(m->tensors);
	free(m->groups);
	free(m->extents);
	free(m->files);
	free(m);
	*mp = NULL;
}


int manifest_find_tensor(const struct manifest *m, uint32_t group, enum tensor_role role)
{
	assert(m);
	return model_find_tensor(&m->cfg, m->tensors, m->groups, group, role);
}

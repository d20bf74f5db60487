/* synthetic.c - what a synthetic checkpoint holds: its values, its shapes, the plan of its
 * files, and the text of its JSON files (synthetic_write.c writes them).
 *
 * Values: a 65536-entry table holds the quantiles of N(0, SYNTH_INIT_STD) (and their bf16
 * and f16 roundings); element i of a tensor takes the table entry picked by 16 bits of
 * splitmix64(key + (i / 4) * golden), where key hashes the seed and the tensor name. That
 * is stateless, so any range of any tensor can be filled on its own: the output does not
 * depend on buffer sizes or sharding, and a 16-bit fill costs one hash per 4 elements.
 *
 * Layout: tensors are assigned to shards in the order transformers' state_dict lists them
 * (embed, then per layer q, k, v, o, gate, up, down, the two norms, then norm, lm_head), and
 * inside a file the safetensors library orders them by name, header and data alike. So
 * "model.layers.10.*" comes before "model.layers.2.*" and a layer's norms sit after its MLP,
 * as in a real checkpoint: readers must not assume a friendlier order. */
#include "tools/make-synthetic-model/synthetic_internal.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

#define TABLE_SIZE 65536
#define GOLDEN	   0x9e3779b97f4a7c15ull
#define MAX_SHARDS 99999u /* the 5-digit file numbering */

/* ---- values ---- */

static float table_f32[TABLE_SIZE];
static uint16_t table_bf16[TABLE_SIZE];
static uint16_t table_f16[TABLE_SIZE];
static float table_bf16_f32[TABLE_SIZE]; /* table_bf16 and table_f16 widened again */
static float table_f16_f32[TABLE_SIZE];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

/* Inverse of the standard normal CDF (P. J. Acklam's rational approximation, relative error
 * below 1.2e-9: far finer than bf16 or f16 can show). */
static double normal_quantile(double p)
{
	static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,  -2.759285104469687e+02,
				   1.383577518672690e+02,  -3.066479806614716e+01, 2.506628277459239e+00};
	static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
				   6.680131188771972e+01, -1.328068155288572e+01};
	static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
				   -2.549732539343734e+00, 4.374664141464968e+00,  2.938163982698783e+00};
	static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
				   3.754408661907416e+00};
	const double lo = 0.02425;
	if (p < lo) {
		double q = sqrt(-2 * log(p));
		return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
		       ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
	}
	if (p > 1 - lo) {
		double q = sqrt(-2 * log(1 - p));
		return -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
		       ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
	}
	double q = p - 0.5, r = q * q;
	return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
	       (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
}

static void tables_init(void)
{
	/* The quantiles at the bin centres: a uniform index into the table draws N(0, std). */
	for (int i = 0; i < TABLE_SIZE; i++) {
		float v = (float)(SYNTH_INIT_STD * normal_quantile((i + 0.5) / TABLE_SIZE));
		table_f32[i] = v;
		table_bf16[i] = f32_to_bf16(v);
		table_f16[i] = f32_to_f16(v);
		table_bf16_f32[i] = bf16_to_f32(table_bf16[i]);
		table_f16_f32[i] = f16_to_f32(table_f16[i]);
	}
}

void syn_values_init(void)
{
	pthread_once(&table_once, tables_init);
}

static inline uint64_t mix64(uint64_t z)
{
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint64_t tensor_key(uint64_t seed, const char *name)
{
	return mix64(fnv1a64(FNV64_INIT, name, strlen(name)) ^ mix64(seed + GOLDEN));
}

static inline uint32_t elem_index(uint64_t key, uint64_t i)
{
	uint64_t r = mix64(key + ((i >> 2) + 1) * GOLDEN);
	return (uint32_t)(r >> (16 * (i & 3))) & 0xffffu;
}

float synth_value(uint64_t seed, const char *name, bool is_norm, uint64_t i)
{
	pthread_once(&table_once, tables_init);
	float v = table_f32[elem_index(tensor_key(seed, name), i)];
	return is_norm ? 1.0f + v : v;
}

/* Stores element value v (already in float) as dtype dt at dst[i]. */
static inline void store_elem(enum dtype dt, void *dst, uint64_t i, float v)
{
	if (dt == DT_F32)
		((float *)dst)[i] = v;
	else if (dt == DT_BF16)
		((uint16_t *)dst)[i] = f32_to_bf16(v);
	else
		((uint16_t *)dst)[i] = f32_to_f16(v);
}

/* Fills elements [e0, e0 + n) of a tensor into dst (dst holds element e0 first). */
void syn_fill_range(uint64_t key, bool norm, enum dtype dt, uint64_t e0, uint64_t n, void *dst)
{
	uint64_t i = 0;
	if (norm) { /* dim elements per norm: not worth a fast path */
		for (; i < n; i++)
			store_elem(dt, dst, i, 1.0f + table_f32[elem_index(key, e0 + i)]);
		return;
	}
	/* Up to the next multiple of 4, element by element; then 4 per hash; then the tail. */
	for (; i < n && ((e0 + i) & 3); i++)
		store_elem(dt, dst, i, table_f32[elem_index(key, e0 + i)]);
	uint64_t blocks = (n - i) / 4;
	uint64_t s = key + (((e0 + i) >> 2) + 1) * GOLDEN;
	if (dt == DT_F32) {
		float *o = (float *)dst + i;
		for (uint64_t b = 0; b < blocks; b++, s += GOLDEN, o += 4) {
			uint64_t r = mix64(s);
			o[0] = table_f32[r & 0xffff];
			o[1] = table_f32[(r >> 16) & 0xffff];
			o[2] = table_f32[(r >> 32) & 0xffff];
			o[3] = table_f32[r >> 48];
		}
	} else {
		const uint16_t *tb = dt == DT_BF16 ? table_bf16 : table_f16;
		uint16_t *o = (uint16_t *)dst + i;
		for (uint64_t b = 0; b < blocks; b++, s += GOLDEN, o += 4) {
			uint64_t r = mix64(s);
			o[0] = tb[r & 0xffff];
			o[1] = tb[(r >> 16) & 0xffff];
			o[2] = tb[(r >> 32) & 0xffff];
			o[3] = tb[r >> 48];
		}
	}
	i += blocks * 4;
	for (; i < n; i++)
		store_elem(dt, dst, i, table_f32[elem_index(key, e0 + i)]);
}

/* v rounded to dt (an element format) and widened again. */
static inline float round_to(enum dtype dt, float v)
{
	return dt == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : dt == DT_F16 ? f16_to_f32(f32_to_f16(v)) : v;
}

void syn_fill_f32(uint64_t key, bool norm, enum dtype round, uint64_t e0, uint64_t n, float *dst)
{
	uint64_t i = 0;
	if (norm) {
		for (; i < n; i++)
			dst[i] = round_to(round, 1.0f + table_f32[elem_index(key, e0 + i)]);
		return;
	}
	const float *tb = round == DT_BF16 ? table_bf16_f32 : round == DT_F16 ? table_f16_f32 : table_f32;
	for (; i < n && ((e0 + i) & 3); i++)
		dst[i] = tb[elem_index(key, e0 + i)];
	uint64_t blocks = (n - i) / 4;
	uint64_t s = key + (((e0 + i) >> 2) + 1) * GOLDEN;
	float *o = dst + i;
	for (uint64_t b = 0; b < blocks; b++, s += GOLDEN, o += 4) {
		uint64_t r = mix64(s);
		o[0] = tb[r & 0xffff];
		o[1] = tb[(r >> 16) & 0xffff];
		o[2] = tb[(r >> 32) & 0xffff];
		o[3] = tb[r >> 48];
	}
	i += blocks * 4;
	for (; i < n; i++)
		dst[i] = tb[elem_index(key, e0 + i)];
}

uint64_t syn_tensor_key(uint64_t seed, const char *name)
{
	return tensor_key(seed, name);
}

/* ---- shapes ---- */

static void llama3_rope(struct model_config *c)
{
	c->rope_theta = 500000.0f;
	c->rope_scaling = ROPE_SCALING_LLAMA3;
	c->rope_factor = 8.0f;
	c->rope_low_freq_factor = 1.0f;
	c->rope_high_freq_factor = 4.0f;
	c->rope_original_max_position = 8192;
}

static void no_rope_scaling(struct model_config *c, float theta)
{
	c->rope_theta = theta;
	c->rope_scaling = ROPE_SCALING_NONE;
	c->rope_factor = c->rope_low_freq_factor = c->rope_high_freq_factor = 0;
	c->rope_original_max_position = 0;
}

/* spec is name or "name:N": true, with the layer count in *layers (max without ":N"); *layers 0 and a
 * message for an N outside 1..max. False for another name. */
static bool layers_spec(const char *spec, const char *name, uint32_t max, uint32_t *layers, char *err, size_t errlen)
{
	size_t n = strlen(name);
	if (strncmp(spec, name, n) != 0 || (spec[n] != 0 && spec[n] != ':'))
		return false;
	*layers = max;
	if (spec[n] == ':') {
		char *end = NULL;
		errno = 0;
		unsigned long l = strtoul(spec + n + 1, &end, 10);
		if (errno || end == spec + n + 1 || *end || l < 1 || l > max) {
			errorf(err, errlen, -EINVAL, "shape %s: the layer count must be 1..%u", spec, max);
			*layers = 0;
		} else {
			*layers = (uint32_t)l;
		}
	}
	return true;
}

/* The tiny shapes of the Qwen3 and mixture-of-experts architectures (synthetic.h). */
static bool tiny_moe_shape(const char *spec, struct model_config *c)
{
	bool qwen3 = !strcmp(spec, "qwen3-tiny"), mixtral = !strcmp(spec, "mixtral-tiny");
	bool qmoe = !strcmp(spec, "qwen3-moe-tiny");
	if (!qwen3 && !mixtral && !qmoe)
		return false;
	no_rope_scaling(c, 1000000.0f);
	c->arch = qwen3 ? ARCH_QWEN3 : mixtral ? ARCH_MIXTRAL : ARCH_QWEN3_MOE;
	c->rms_eps = mixtral ? 1e-5f : 1e-6f;
	c->dim = 64;
	c->n_layers = 2;
	c->n_heads = 4;
	c->n_kv_heads = 2;
	c->head_dim = mixtral ? 16 : 32; /* Qwen3: n_heads * head_dim != dim */
	c->ffn_dim = mixtral ? 128 : 192;
	c->vocab_size = 512;
	c->max_position = 4096;
	c->bos_id = 1;
	c->n_eos = 1;
	c->eos_ids[0] = 2;
	c->flags = qwen3 || qmoe ? MODEL_QK_NORM : 0;
	c->tie_embeddings = qwen3;
	if (mixtral || qmoe) {
		c->n_experts = 8;
		c->n_experts_used = 2;
		c->expert_ffn_dim = mixtral ? c->ffn_dim : 48;
		c->flags |= MODEL_NORM_TOPK;
	}
	return true;
}

int synth_shape_config(const char *spec, struct model_config *c, char *err, size_t errlen)
{
	assert(spec && c);
	memset(c, 0, sizeof(*c));
	c->arch = ARCH_LLAMA;
	c->rms_eps = 1e-5f;
	llama3_rope(c);
	if (tiny_moe_shape(spec, c))
		return 0;
	if (!strcmp(spec, "tiny")) {
		c->dim = 64;
		c->n_layers = 2;
		c->n_heads = 4;
		c->n_kv_heads = 2;
		c->head_dim = 16;
		c->ffn_dim = 192;
		c->vocab_size = 512;
		c->max_position = 4096;
		c->bos_id = 1;
		c->n_eos = 1;
		c->eos_ids[0] = 2;
		return 0;
	}
	c->head_dim = 128;
	c->n_kv_heads = 8;
	c->vocab_size = 128256;
	c->max_position = 131072;
	c->bos_id = 128000;
	c->n_eos = 3;
	c->eos_ids[0] = 128001;
	c->eos_ids[1] = 128008;
	c->eos_ids[2] = 128009;
	if (!strcmp(spec, "llama3-8b")) {
		c->dim = 4096;
		c->n_layers = 32;
		c->n_heads = 32;
		c->ffn_dim = 14336;
		return 0;
	}
	if (layers_spec(spec, "llama3-70b", 80, &c->n_layers, err, errlen)) {
		c->dim = 8192;
		c->n_heads = 64;
		c->ffn_dim = 28672;
		return c->n_layers ? 0 : -EINVAL;
	}
	if (layers_spec(spec, "mixtral-8x7b", 32, &c->n_layers, err, errlen)) {
		c->arch = ARCH_MIXTRAL;
		no_rope_scaling(c, 1000000.0f);
		c->dim = 4096;
		c->n_heads = 32;
		c->ffn_dim = 14336;
		c->expert_ffn_dim = 14336;
		c->n_experts = 8;
		c->n_experts_used = 2;
		c->flags = MODEL_NORM_TOPK;
		c->vocab_size = 32000;
		c->max_position = 32768;
		c->bos_id = 1;
		c->n_eos = 1;
		c->eos_ids[0] = 2;
		return c->n_layers ? 0 : -EINVAL;
	}
	if (layers_spec(spec, "qwen3-30b-a3b", 48, &c->n_layers, err, errlen)) {
		c->arch = ARCH_QWEN3_MOE;
		no_rope_scaling(c, 1000000.0f);
		c->rms_eps = 1e-6f;
		c->dim = 2048;
		c->n_heads = 32;
		c->n_kv_heads = 4;
		c->ffn_dim = 6144;
		c->expert_ffn_dim = 768;
		c->n_experts = 128;
		c->n_experts_used = 8;
		c->flags = MODEL_QK_NORM | MODEL_NORM_TOPK;
		c->vocab_size = 151936;
		c->max_position = 40960;
		c->bos_id = 151643;
		c->n_eos = 1;
		c->eos_ids[0] = 151645;
		return c->n_layers ? 0 : -EINVAL;
	}
	memset(c, 0, sizeof(*c));
	return errorf(err, errlen, -EINVAL,
		      "unknown shape \"%s\" (known: tiny, qwen3-tiny, mixtral-tiny, qwen3-moe-tiny, llama3-8b, "
		      "llama3-70b[:LAYERS], mixtral-8x7b[:LAYERS], qwen3-30b-a3b[:LAYERS])",
		      spec);
}

int synth_parse_rope_scaling(const char *text, struct model_config *c, char *err, size_t errlen)
{
	c->rope_factor = 0;
	c->rope_low_freq_factor = 0;
	c->rope_high_freq_factor = 0;
	c->rope_original_max_position = 0;
	if (!strcmp(text, "none")) {
		c->rope_scaling = ROPE_SCALING_NONE;
		return 0;
	}
	if (!strcmp(text, "llama3")) {
		float theta = c->rope_theta;
		llama3_rope(c);
		c->rope_theta = theta; /* only the scaling changes */
		return 0;
	}
	if (!strncmp(text, "linear:", 7)) {
		char *end = NULL;
		errno = 0;
		double f = strtod(text + 7, &end);
		if (!errno && end != text + 7 && !*end && f > 0 && isfinite(f)) {
			c->rope_scaling = ROPE_SCALING_LINEAR;
			c->rope_factor = (float)f;
			return 0;
		}
	}
	return errorf(err, errlen, -EINVAL, "rope scaling \"%s\" is not one of none, linear:FACTOR, llama3", text);
}

uint64_t synth_param_count(const struct model_config *c, bool tied)
{
	uint64_t d = c->dim, q = (uint64_t)c->n_heads * c->head_dim, kv = (uint64_t)c->n_kv_heads * c->head_dim;
	uint64_t ffn = c->n_experts ? (uint64_t)c->n_experts * (d + 3 * d * c->expert_ffn_dim) : 3 * d * c->ffn_dim;
	uint64_t layer = 2 * d + d * q + 2 * d * kv + q * d + ffn + ((c->flags & MODEL_QK_NORM) ? 2 * c->head_dim : 0);
	uint64_t n = (uint64_t)c->vocab_size * d + c->n_layers * layer + d;
	if (!tied && !c->tie_embeddings)
		n += (uint64_t)c->vocab_size * d;
	return n;
}

/* ---- planning ---- */

static void add_tensor(struct plan *p, const struct synth_options *o, const char *name, uint64_t rows, uint64_t cols)
{
	struct stensor *t = &p->t[p->n++];
	str_copy(t->name, sizeof(t->name), name);
	t->ndim = cols ? 2 : 1;
	t->shape[0] = rows;
	t->shape[1] = cols;
	t->nelem = rows * (cols ? cols : 1);
	t->nbytes = t->nelem * dtype_size(o->dtype);
	t->norm = cols == 0;
	t->key = tensor_key(o->seed, name);
}

static int cmp_by_name(const void *a, const void *b, void *arg)
{
	const struct stensor *t = arg;
	return strcmp(t[*(const uint32_t *)a].name, t[*(const uint32_t *)b].name);
}

void syn_plan_free(struct plan *p)
{
	free(p->t);
	free(p->order);
	free(p->file_first);
	free(p->file_size);
	free(p->file_name);
	memset(p, 0, sizeof(*p));
}

int syn_plan_build(struct plan *p, const struct model_config *c, const struct synth_options *o, bool tied, char *err,
		   size_t errlen)
{
	memset(p, 0, sizeof(*p));
	bool qk = c->flags & MODEL_QK_NORM, mixtral = c->arch == ARCH_MIXTRAL;
	uint32_t cap = 3 + (11 + 3 * c->n_experts) * c->n_layers;
	p->t = calloc(cap, sizeof(*p->t));
	if (!p->t)
		return errorf(err, errlen, -ENOMEM, "out of memory planning %u tensors", cap);
	uint64_t d = c->dim, q = (uint64_t)c->n_heads * c->head_dim, kv = (uint64_t)c->n_kv_heads * c->head_dim;
	uint64_t ef = c->expert_ffn_dim;
	char name[TENSOR_NAME_MAX];
	add_tensor(p, o, "model.embed_tokens.weight", c->vocab_size, d);
	/* Each layer in the order of transformers' state_dict. */
	for (uint32_t l = 0; l < c->n_layers; l++) {
		static const char *const attn[] = {"q", "k", "v", "o"};
		static const char *const mlp[] = {"gate", "up", "down"};
		for (int k = 0; k < 4; k++) {
			snprintf(name, sizeof(name), "model.layers.%u.self_attn.%s_proj.weight", l, attn[k]);
			add_tensor(p, o, name, k == 0 ? q : k == 3 ? d : kv, k == 3 ? q : d);
		}
		for (int k = 0; qk && k < 2; k++) {
			snprintf(name, sizeof(name), "model.layers.%u.self_attn.%s_norm.weight", l, k ? "k" : "q");
			add_tensor(p, o, name, c->head_dim, 0);
		}
		if (c->n_experts) {
			/* Mixtral: w1 gate, w2 down, w3 up; Qwen3-MoE: gate_proj, up_proj, down_proj. */
			static const char *const mx[] = {"w1", "w2", "w3"};
			const char *moe = mixtral ? "block_sparse_moe" : "mlp";
			snprintf(name, sizeof(name), "model.layers.%u.%s.gate.weight", l, moe);
			add_tensor(p, o, name, c->n_experts, d);
			for (uint32_t e = 0; e < c->n_experts; e++) {
				for (int k = 0; k < 3; k++) {
					bool down = mixtral ? k == 1 : k == 2;
					if (mixtral)
						snprintf(name, sizeof(name), "model.layers.%u.%s.experts.%u.%s.weight", l, moe,
							 e, mx[k]);
					else
						snprintf(name, sizeof(name), "model.layers.%u.%s.experts.%u.%s_proj.weight", l,
							 moe, e, mlp[k]);
					add_tensor(p, o, name, down ? d : ef, down ? ef : d);
				}
			}
		} else {
			for (int k = 0; k < 3; k++) {
				snprintf(name, sizeof(name), "model.layers.%u.mlp.%s_proj.weight", l, mlp[k]);
				add_tensor(p, o, name, k == 2 ? d : c->ffn_dim, k == 2 ? c->ffn_dim : d);
			}
		}
		snprintf(name, sizeof(name), "model.layers.%u.input_layernorm.weight", l);
		add_tensor(p, o, name, d, 0);
		snprintf(name, sizeof(name), "model.layers.%u.post_attention_layernorm.weight", l);
		add_tensor(p, o, name, d, 0);
	}
	add_tensor(p, o, "model.norm.weight", d, 0);
	if (!tied)
		add_tensor(p, o, "lm_head.weight", c->vocab_size, d);
	for (uint32_t i = 0; i < p->n; i++)
		p->tensor_bytes += p->t[i].nbytes;

	/* Shards, in state_dict order. */
	if (o->shards) {
		if (o->shards > p->n || o->shards > MAX_SHARDS)
			return errorf(err, errlen, -EINVAL, "cannot split %u tensors into %u shards", p->n, o->shards);
		/* Cut where the running total passes each 1/shards of the bytes, keeping at least one
		 * tensor for every shard still to come. */
		uint32_t shard = 0, in_shard = 0;
		uint64_t before = 0;
		for (uint32_t i = 0; i < p->n; i++) {
			struct stensor *t = &p->t[i];
			bool must = p->n - i <= o->shards - 1 - shard;
			bool past = (before + t->nbytes / 2) * (uint64_t)o->shards >=
				    (uint64_t)(shard + 1) * p->tensor_bytes;
			if (in_shard && shard + 1 < o->shards && (must || past)) {
				shard++;
				in_shard = 0;
			}
			t->file = shard;
			in_shard++;
			before += t->nbytes;
		}
		p->n_files = o->shards;
	} else {
		if (!o->shard_bytes)
			return errorf(err, errlen, -EINVAL, "shard size 0: give a size or a shard count");
		/* transformers: a new shard when this tensor would push the current one past the limit. */
		uint32_t shard = 0;
		uint64_t acc = 0;
		for (uint32_t i = 0; i < p->n; i++) {
			struct stensor *t = &p->t[i];
			if (acc && acc + t->nbytes > o->shard_bytes) {
				shard++;
				acc = 0;
			}
			t->file = shard;
			acc += t->nbytes;
		}
		p->n_files = shard + 1;
		if (p->n_files > MAX_SHARDS)
			return errorf(err, errlen, -EINVAL, "shard size %llu gives %u files, more than %u",
				    (unsigned long long)o->shard_bytes, p->n_files, MAX_SHARDS);
	}

	p->order = calloc(p->n, sizeof(*p->order));
	p->file_first = calloc(p->n_files + 1, sizeof(*p->file_first));
	p->file_size = calloc(p->n_files, sizeof(*p->file_size));
	p->file_name = calloc(p->n_files, sizeof(*p->file_name));
	if (!p->order || !p->file_first || !p->file_size || !p->file_name)
		return errorf(err, errlen, -ENOMEM, "out of memory planning %u files", p->n_files);
	/* State-dict order already groups by file (shards are contiguous runs); sort each by name. */
	for (uint32_t i = 0; i < p->n; i++) {
		p->order[i] = i;
		p->file_first[p->t[i].file + 1] = i + 1;
	}
	for (uint32_t f = 0; f < p->n_files; f++) {
		uint32_t a = p->file_first[f], b = p->file_first[f + 1];
		qsort_r(p->order + a, b - a, sizeof(*p->order), cmp_by_name, p->t);
		uint64_t off = 0;
		for (uint32_t k = a; k < b; k++) {
			p->t[p->order[k]].begin = off;
			off += p->t[p->order[k]].nbytes;
		}
		if (p->n_files == 1)
			snprintf(p->file_name[f], sizeof(p->file_name[f]), SINGLE_NAME);
		else
			snprintf(p->file_name[f], sizeof(p->file_name[f]), "model-%05u-of-%05u.safetensors", f + 1,
				 p->n_files);
	}
	return 0;
}

/* ---- text building ---- */

static void sb_printf(struct sbuf *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void sb_printf(struct sbuf *s, const char *fmt, ...)
{
	if (s->oom)
		return;
	for (;;) {
		va_list ap;
		va_start(ap, fmt);
		int n = vsnprintf(s->p ? s->p + s->len : NULL, s->p ? s->cap - s->len : 0, fmt, ap);
		va_end(ap);
		if (n < 0) {
			s->oom = 1;
			return;
		}
		if (s->p && s->len + (size_t)n < s->cap) {
			s->len += (size_t)n;
			return;
		}
		size_t cap = s->cap ? s->cap : 4096;
		while (cap <= s->len + (size_t)n)
			cap *= 2;
		char *np = realloc(s->p, cap);
		if (!np) {
			s->oom = 1;
			return;
		}
		s->p = np;
		s->cap = cap;
	}
}

void syn_sb_put(struct sbuf *s, const void *p, size_t n)
{
	if (s->oom)
		return;
	if (s->len + n > s->cap) {
		size_t cap = s->cap ? s->cap : 4096;
		while (cap < s->len + n)
			cap *= 2;
		char *np = realloc(s->p, cap);
		if (!np) {
			s->oom = 1;
			return;
		}
		s->p = np;
		s->cap = cap;
	}
	memcpy(s->p + s->len, p, n);
	s->len += n;
}

/* The shortest decimal that reads back as the same float ("1e-05", not 9.99999975e-06), with a
 * ".0" on whole numbers as Python writes floats. */
static void fmt_float(char *buf, size_t len, float v)
{
	if (v == floorf(v) && fabsf(v) < 1e16f) {
		snprintf(buf, len, "%.1f", (double)v);
		return;
	}
	for (int prec = 1; prec <= 9; prec++) {
		snprintf(buf, len, "%.*g", prec, (double)v);
		if (strtof(buf, NULL) == v)
			break;
	}
	if (!strpbrk(buf, ".eEn"))
		strncat(buf, ".0", len - strlen(buf) - 1);
}

static void sb_float(struct sbuf *s, float v)
{
	char b[48];
	fmt_float(b, sizeof(b), v);
	sb_printf(s, "%s", b);
}

static const char *torch_dtype(enum dtype t)
{
	return t == DT_F32 ? "float32" : t == DT_F16 ? "float16" : "bfloat16";
}

void syn_build_config_json(struct sbuf *s, const struct model_config *c, const struct synth_options *o, bool tied)
{
	static const char *const arch_names[][2] = {
		[ARCH_LLAMA] = {"LlamaForCausalLM", "llama"},
		[ARCH_MISTRAL] = {"MistralForCausalLM", "mistral"},
		[ARCH_QWEN3] = {"Qwen3ForCausalLM", "qwen3"},
		[ARCH_MIXTRAL] = {"MixtralForCausalLM", "mixtral"},
		[ARCH_QWEN3_MOE] = {"Qwen3MoeForCausalLM", "qwen3_moe"},
	};
	uint32_t arch = c->arch < ARRAY_SIZE(arch_names) && arch_names[c->arch][0] ? c->arch : ARCH_LLAMA;
	bool qwen3 = arch == ARCH_QWEN3 || arch == ARCH_QWEN3_MOE;
	sb_printf(s, "{\n  \"architectures\": [\n    \"%s\"\n  ],\n", arch_names[arch][0]);
	sb_printf(s, "  \"attention_bias\": false,\n  \"attention_dropout\": 0.0,\n");
	if (c->bos_id >= 0)
		sb_printf(s, "  \"bos_token_id\": %d,\n", c->bos_id);
	else
		sb_printf(s, "  \"bos_token_id\": null,\n");
	if (c->n_eos == 0) {
		sb_printf(s, "  \"eos_token_id\": null,\n");
	} else if (c->n_eos == 1) {
		sb_printf(s, "  \"eos_token_id\": %d,\n", c->eos_ids[0]);
	} else {
		sb_printf(s, "  \"eos_token_id\": [\n");
		for (uint32_t i = 0; i < c->n_eos; i++)
			sb_printf(s, "    %d%s\n", c->eos_ids[i], i + 1 < c->n_eos ? "," : "");
		sb_printf(s, "  ],\n");
	}
	sb_printf(s, "  \"head_dim\": %u,\n  \"hidden_act\": \"silu\",\n  \"hidden_size\": %u,\n", c->head_dim, c->dim);
	sb_printf(s, "  \"initializer_range\": 0.02,\n  \"intermediate_size\": %u,\n", c->ffn_dim);
	sb_printf(s, "  \"max_position_embeddings\": %u,\n  \"mlp_bias\": false,\n", c->max_position);
	sb_printf(s, "  \"model_type\": \"%s\",\n", arch_names[arch][1]);
	if (arch == ARCH_QWEN3_MOE)
		sb_printf(s, "  \"decoder_sparse_step\": 1,\n  \"mlp_only_layers\": [],\n  \"moe_intermediate_size\": %u,\n"
			  "  \"norm_topk_prob\": %s,\n  \"num_experts\": %u,\n  \"num_experts_per_tok\": %u,\n",
			  c->expert_ffn_dim, (c->flags & MODEL_NORM_TOPK) ? "true" : "false", c->n_experts,
			  c->n_experts_used);
	if (arch == ARCH_MIXTRAL)
		sb_printf(s, "  \"num_experts_per_tok\": %u,\n  \"num_local_experts\": %u,\n  \"output_router_logits\": "
			  "false,\n  \"router_aux_loss_coef\": 0.02,\n", c->n_experts_used, c->n_experts);
	if (qwen3)
		sb_printf(s, "  \"max_window_layers\": %u,\n  \"use_sliding_window\": false,\n", c->n_layers);
	sb_printf(s, "  \"num_attention_heads\": %u,\n  \"num_hidden_layers\": %u,\n  \"num_key_value_heads\": %u,\n",
		  c->n_heads, c->n_layers, c->n_kv_heads);
	sb_printf(s,
		  "  \"pipeline_synthetic\": {\n    \"note\": \"random weights, not a trained model\",\n"
		  "    \"seed\": %llu\n  },\n",
		  (unsigned long long)o->seed);
	sb_printf(s, "  \"pretraining_tp\": 1,\n  \"rms_norm_eps\": ");
	sb_float(s, c->rms_eps);
	sb_printf(s, ",\n  \"rope_scaling\": ");
	if (c->rope_scaling == ROPE_SCALING_LLAMA3) {
		sb_printf(s, "{\n    \"factor\": ");
		sb_float(s, c->rope_factor);
		sb_printf(s, ",\n    \"high_freq_factor\": ");
		sb_float(s, c->rope_high_freq_factor);
		sb_printf(s, ",\n    \"low_freq_factor\": ");
		sb_float(s, c->rope_low_freq_factor);
		sb_printf(s, ",\n    \"original_max_position_embeddings\": %u,\n    \"rope_type\": \"llama3\"\n  }",
			  c->rope_original_max_position);
	} else if (c->rope_scaling == ROPE_SCALING_LINEAR) {
		sb_printf(s, "{\n    \"factor\": ");
		sb_float(s, c->rope_factor);
		sb_printf(s, ",\n    \"rope_type\": \"linear\"\n  }");
	} else {
		sb_printf(s, "null");
	}
	sb_printf(s, ",\n  \"rope_theta\": ");
	sb_float(s, c->rope_theta);
	if (c->sliding_window)
		sb_printf(s, ",\n  \"sliding_window\": %u", c->sliding_window);
	else
		sb_printf(s, ",\n  \"sliding_window\": null");
	sb_printf(s, ",\n  \"tie_word_embeddings\": %s,\n  \"torch_dtype\": \"%s\",\n", tied ? "true" : "false",
		  torch_dtype(o->dtype));
	sb_printf(s, "  \"use_cache\": true,\n  \"vocab_size\": %u\n}\n", c->vocab_size);
}

void syn_build_generation_json(struct sbuf *s, const struct model_config *c)
{
	sb_printf(s, "{\n");
	if (c->bos_id >= 0)
		sb_printf(s, "  \"bos_token_id\": %d,\n", c->bos_id);
	sb_printf(s, "  \"do_sample\": true,\n  \"eos_token_id\": [");
	for (uint32_t i = 0; i < c->n_eos; i++)
		sb_printf(s, "%s%d", i ? ", " : "", c->eos_ids[i]);
	sb_printf(s, "],\n  \"temperature\": 0.6,\n  \"top_p\": 0.9\n}\n");
}

static int cmp_name_ptr(const void *a, const void *b)
{
	return strcmp((*(const struct stensor *const *)a)->name, (*(const struct stensor *const *)b)->name);
}

int syn_build_index_json(struct sbuf *s, const struct plan *p)
{
	/* transformers sorts weight_map by name. */
	const struct stensor **v = malloc(p->n * sizeof(*v));
	if (!v)
		return -ENOMEM;
	for (uint32_t i = 0; i < p->n; i++)
		v[i] = &p->t[i];
	qsort(v, p->n, sizeof(*v), cmp_name_ptr);
	sb_printf(s, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {\n",
		  (unsigned long long)p->tensor_bytes);
	for (uint32_t i = 0; i < p->n; i++)
		sb_printf(s, "    \"%s\": \"%s\"%s\n", v[i]->name, p->file_name[v[i]->file], i + 1 < p->n ? "," : "");
	sb_printf(s, "  }\n}\n");
	free(v);
	return 0;
}

/* The 8-byte length and the JSON header of file f, padded with spaces to a multiple of 8. */
void syn_build_st_header(struct sbuf *s, const struct plan *p, uint32_t f, enum dtype dt)
{
	sb_printf(s, "%8s", ""); /* room for the length */
	sb_printf(s, "{\"__metadata__\":{\"format\":\"pt\"}");
	for (uint32_t k = p->file_first[f]; k < p->file_first[f + 1]; k++) {
		const struct stensor *t = &p->t[p->order[k]];
		sb_printf(s, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%llu", t->name, dtype_name(dt),
			  (unsigned long long)t->shape[0]);
		if (t->ndim == 2)
			sb_printf(s, ",%llu", (unsigned long long)t->shape[1]);
		sb_printf(s, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)t->begin,
			  (unsigned long long)(t->begin + t->nbytes));
	}
	sb_printf(s, "}");
	while (!s->oom && (s->len - 8) % 8)
		sb_printf(s, " ");
	if (s->oom)
		return;
	uint64_t n = s->len - 8;
	for (int i = 0; i < 8; i++)
		s->p[i] = (char)(n >> (8 * i));
}

/* synthetic_gguf.c - what a synthetic GGUF file holds: its tensors (names, types, shapes, files,
 * offsets) and its header, as llama.cpp's convert_hf_to_gguf.py (metadata, names, the wq/wk row
 * permutation, rope_freqs, the experts stacked into one tensor per matrix) and llama-quantize (the
 * types of the Q4_K_M and Q5_K_M mixes) make them of the Hugging Face checkpoint of the same
 * options.
 * synthetic_gguf_write.c writes the files.
 *
 * A file: "GGUF", version 3, the tensor and key/value counts, the key/value pairs, the tensor
 * infos (name, dimensions in ggml order, ggml type, offset), zeros up to the next multiple of
 * general.alignment (32), then the data section: each tensor at an offset that is a multiple of
 * 32, followed by zeros up to the next one (after the last tensor too, as ggml and gguf-py write
 * it). Tensors come in llama.cpp's order: rope_freqs (llama3 RoPE scaling only), token_embd, per
 * block attn_norm, attn_q, attn_k, attn_v, attn_output, (Qwen3) attn_q_norm, attn_k_norm, ffn_norm,
 * then ffn_gate, ffn_up, ffn_down, or with experts the router ffn_gate_inp (F32) and ffn_gate_exps,
 * ffn_up_exps, ffn_down_exps (ggml ne = [cols, rows, n_experts]: expert e's matrix is the e-th run
 * of rows); then output_norm and output (absent when the embeddings are tied). The architecture is
 * llama for Llama, Mistral and Mixtral (wq/wk rows permuted), qwen3 and qwen3moe for Qwen3's (rows
 * as in the checkpoint). A split set cuts that sequence into contiguous runs of about equal bytes. */
#include "tools/make-synthetic-model/synthetic_internal.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/quant.h"
#include "common/util.h"

#define GGUF_VERSION	      3u
#define GGML_QUANT_VERSION    2u
#define DEFAULT_NAME	      "synthetic"
#define LLAMA3_PRE_TOKENIZER  "llama-bpe"

/* gguf value types */
enum {
	GV_UINT16 = 2,
	GV_INT32 = 5,
	GV_UINT32 = 4,
	GV_FLOAT32 = 6,
	GV_BOOL = 7,
	GV_STRING = 8,
	GV_ARRAY = 9,
};

/* ---- types ---- */

static const struct {
	const char *name;
	enum synth_gguf_type type;
	enum dtype base; /* the type of most matrices */
} gguf_types[] = {
	{"f32", SYNTH_GGUF_F32, DT_F32},	{"f16", SYNTH_GGUF_F16, DT_F16},
	{"bf16", SYNTH_GGUF_BF16, DT_BF16},	{"q8_0", SYNTH_GGUF_Q8_0, DT_Q8_0},
	{"q4_0", SYNTH_GGUF_Q4_0, DT_Q4_0},	{"q4_k_m", SYNTH_GGUF_Q4_K_M, DT_Q4_K},
	{"q5_k_m", SYNTH_GGUF_Q5_K_M, DT_Q5_K}, {"q6_k", SYNTH_GGUF_Q6_K, DT_Q6_K},
};

int synth_parse_gguf_type(const char *text, enum synth_gguf_type *out)
{
	for (size_t i = 0; i < sizeof(gguf_types) / sizeof(gguf_types[0]); i++) {
		if (!strcasecmp(text, gguf_types[i].name)) {
			*out = gguf_types[i].type;
			return 0;
		}
	}
	return -EINVAL;
}

const char *synth_gguf_type_name(enum synth_gguf_type t)
{
	for (size_t i = 0; i < sizeof(gguf_types) / sizeof(gguf_types[0]); i++)
		if (gguf_types[i].type == t)
			return gguf_types[i].name;
	return "?";
}

static int base_type(enum synth_gguf_type t, enum dtype *out)
{
	for (size_t i = 0; i < sizeof(gguf_types) / sizeof(gguf_types[0]); i++) {
		if (gguf_types[i].type == t) {
			*out = gguf_types[i].base;
			return 0;
		}
	}
	return -EINVAL;
}

uint32_t syn_ggml_type(enum dtype t)
{
	switch (t) {
	case DT_F32:
		return 0;
	case DT_F16:
		return 1;
	case DT_Q4_0:
		return 2;
	case DT_Q8_0:
		return 8;
	case DT_Q4_K:
		return 12;
	case DT_Q5_K:
		return 13;
	case DT_Q6_K:
		return 14;
	case DT_BF16:
		return 30;
	default:
		assert(!"no ggml type");
		return 0;
	}
}

/* llama-quantize's layers that get more bits in the _M mixes (its use_more_bits). */
static bool use_more_bits(int i, int n)
{
	return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

/* The type of matrix t: llama-quantize's choice for a Llama model without an importance matrix
 * (llama_tensor_get_type), then its fallback for rows that do not hold whole K blocks (Q4_0 for
 * Q4_K and Q5_K, where llama.cpp takes Q5_0 / Q5_1, which we do not store; Q8_0 for Q6_K). The
 * single-type files (Q8_0, Q4_0, Q6_K, F32, F16, BF16) hold every matrix in their type, as
 * convert_hf_to_gguf.py and `llama-quantize --pure` write them. */
static int matrix_type(struct gtensor *t, const struct model_config *c, enum synth_gguf_type gt, bool tied,
		       char *err, size_t errlen)
{
	enum dtype ty;
	int rc = base_type(gt, &ty);
	assert(rc == 0);
	if (gt == SYNTH_GGUF_Q4_K_M || gt == SYNTH_GGUF_Q5_K_M) {
		int i = (int)t->layer, n = (int)c->n_layers;
		if (t->kind == GK_OUTPUT || (tied && t->kind == GK_EMBED)) {
			ty = t->ne[0] % QK_K ? DT_Q8_0 : DT_Q6_K;
		} else if (t->kind == GK_WV) {
			if (use_more_bits(i, n))
				ty = DT_Q6_K;
			/* llama.cpp's LLM_TYPE_70B (80 layers, GQA): attn_v is 8x smaller than attn_q and
			 * gets a step more */
			if (c->n_layers == 80 && c->n_heads != c->n_kv_heads && ty == DT_Q4_K)
				ty = DT_Q5_K;
		} else if (t->kind == GK_DOWN && use_more_bits(i, n)) {
			ty = DT_Q6_K;
		}
		/* Its rules for a model of 8 experts: attn_v and attn_k in Q8_0, attn_output in Q5_K (Q4_K_M) */
		if (c->n_experts == 8 && (t->kind == GK_WV || t->kind == GK_WK))
			ty = DT_Q8_0;
		if (c->n_experts == 8 && t->kind == GK_WO && gt == SYNTH_GGUF_Q4_K_M)
			ty = DT_Q5_K;
	}
	if (t->kind == GK_ROUTER)
		ty = DT_F32;
	if (t->ne[0] % dtype_block_elems(ty)) {
		if (ty == DT_Q4_K || ty == DT_Q5_K)
			ty = DT_Q4_0;
		else if (ty == DT_Q6_K)
			ty = DT_Q8_0;
	}
	if (t->ne[0] % dtype_block_elems(ty))
		return errorf(err, errlen, -EINVAL, "tensor %s: rows of %llu values do not hold whole %s blocks of %u",
			      t->name, (unsigned long long)t->ne[0], dtype_name(ty), dtype_block_elems(ty));
	t->type = ty;
	return 0;
}

/* ---- tensors ---- */

static struct gtensor *add(struct gplan *p, const struct synth_options *o, const char *name, const char *hf_name,
			   enum gkind kind, uint32_t layer, uint64_t cols, uint64_t rows)
{
	struct gtensor *t = &p->t[p->n++];
	str_copy(t->name, sizeof(t->name), name);
	t->kind = kind;
	t->layer = layer;
	t->ndim = rows ? 2 : 1;
	t->ne[0] = cols;
	t->ne[1] = rows ? rows : 1;
	t->ne[2] = 1;
	t->key = hf_name ? syn_tensor_key(o->seed, hf_name) : 0;
	t->type = DT_F32; /* vectors; matrix_type sets the matrices' */
	return t;
}

/* convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for llama3 scaling: each frequency's
 * divisor, in float32 as torch computes it there. */
static void llama3_rope_freqs(const struct model_config *c, float *out)
{
	uint32_t hd = c->head_dim;
	float factor = c->rope_factor, lo = c->rope_low_freq_factor, hi = c->rope_high_freq_factor;
	float old_ctx = (float)c->rope_original_max_position;
	float lo_wavelen = old_ctx / lo, hi_wavelen = old_ctx / hi;
	for (uint32_t i = 0; i < hd / 2; i++) {
		float freq = 1.0f / powf(c->rope_theta, (float)(2 * i) / (float)hd);
		float wavelen = (float)(2 * M_PI) / freq;
		if (wavelen < hi_wavelen) {
			out[i] = 1.0f;
		} else if (wavelen > lo_wavelen) {
			out[i] = factor;
		} else {
			float smooth = (old_ctx / wavelen - lo) / (hi - lo);
			out[i] = 1.0f / ((1.0f - smooth) / factor + smooth);
		}
	}
}

/* The Hugging Face name of matrix m (0 gate, 1 up, 2 down) of expert e in layer l. */
static void expert_hf_name(const struct model_config *c, uint32_t l, uint32_t e, int m, char *buf, size_t len)
{
	static const char *const mx[3] = {"w1", "w3", "w2"}, *const qw[3] = {"gate", "up", "down"};
	if (c->arch == ARCH_MIXTRAL)
		snprintf(buf, len, "model.layers.%u.block_sparse_moe.experts.%u.%s.weight", l, e, mx[m]);
	else
		snprintf(buf, len, "model.layers.%u.mlp.experts.%u.%s_proj.weight", l, e, qw[m]);
}

static int plan_tensors(struct gplan *p, const struct model_config *c, const struct synth_options *o, bool tied,
			char *err, size_t errlen)
{
	uint32_t cap = 4 + 14 * c->n_layers;
	p->t = calloc(cap, sizeof(*p->t));
	p->n_expert_keys = 3 * c->n_experts * c->n_layers;
	p->expert_keys = calloc(p->n_expert_keys ? p->n_expert_keys : 1, sizeof(*p->expert_keys));
	if (!p->t || !p->expert_keys)
		return errorf(err, errlen, -ENOMEM, "out of memory planning %u tensors", cap);
	uint64_t d = c->dim, q = (uint64_t)c->n_heads * c->head_dim, kv = (uint64_t)c->n_kv_heads * c->head_dim;
	uint64_t ef = c->expert_ffn_dim;
	/* convert_hf_to_gguf.py permutes wq/wk rows for the llama architecture (Llama, Mistral, Mixtral),
	 * not for Qwen3's. */
	bool permute = c->arch != ARCH_QWEN3 && c->arch != ARCH_QWEN3_MOE;
	char name[TENSOR_NAME_MAX], hf[TENSOR_NAME_MAX];
	if (c->rope_scaling == ROPE_SCALING_LLAMA3) {
		p->rope_freqs = malloc(c->head_dim / 2 * sizeof(float));
		if (!p->rope_freqs)
			return errorf(err, errlen, -ENOMEM, "out of memory");
		llama3_rope_freqs(c, p->rope_freqs);
		add(p, o, "rope_freqs.weight", NULL, GK_ROPE_FREQS, 0, c->head_dim / 2, 0);
	}
	add(p, o, "token_embd.weight", "model.embed_tokens.weight", GK_EMBED, 0, d, c->vocab_size);
	static const struct {
		const char *gguf, *hf;
		enum gkind kind;
	} blk[] = {
		{"attn_norm", "input_layernorm", GK_NORM},   {"attn_q", "self_attn.q_proj", GK_WQ},
		{"attn_k", "self_attn.k_proj", GK_WK},	      {"attn_v", "self_attn.v_proj", GK_WV},
		{"attn_output", "self_attn.o_proj", GK_WO},   {"attn_q_norm", "self_attn.q_norm", GK_NORM},
		{"attn_k_norm", "self_attn.k_norm", GK_NORM}, {"ffn_norm", "post_attention_layernorm", GK_NORM},
		{"ffn_gate", "mlp.gate_proj", GK_GATE},	      {"ffn_up", "mlp.up_proj", GK_UP},
		{"ffn_down", "mlp.down_proj", GK_DOWN},
	};
	for (uint32_t l = 0; l < c->n_layers; l++) {
		for (size_t k = 0; k < sizeof(blk) / sizeof(blk[0]); k++) {
			bool qk_norm = k == 5 || k == 6, ffn = blk[k].kind >= GK_GATE && blk[k].kind <= GK_DOWN;
			if (qk_norm && !(c->flags & MODEL_QK_NORM))
				continue;
			if (ffn && c->n_experts)
				break;
			snprintf(name, sizeof(name), "blk.%u.%s.weight", l, blk[k].gguf);
			snprintf(hf, sizeof(hf), "model.layers.%u.%s.weight", l, blk[k].hf);
			uint64_t cols = d, rows = 0;
			switch (blk[k].kind) {
			case GK_WQ:
				rows = q;
				break;
			case GK_WK:
			case GK_WV:
				rows = kv;
				break;
			case GK_WO:
				rows = d;
				cols = q;
				break;
			case GK_GATE:
			case GK_UP:
				rows = c->ffn_dim;
				break;
			case GK_DOWN:
				rows = d;
				cols = c->ffn_dim;
				break;
			default: /* norms */
				if (qk_norm)
					cols = c->head_dim;
				break;
			}
			struct gtensor *t = add(p, o, name, hf, blk[k].kind, l, cols, rows);
			if (permute && blk[k].kind == GK_WQ)
				t->perm_heads = c->n_heads;
			else if (permute && blk[k].kind == GK_WK)
				t->perm_heads = c->n_kv_heads;
		}
		if (!c->n_experts)
			continue;
		/* The router, then each matrix of every expert stacked into one tensor (ggml ne = [cols,
		 * rows, n_experts]), as convert_hf_to_gguf.py merges them. */
		snprintf(name, sizeof(name), "blk.%u.ffn_gate_inp.weight", l);
		snprintf(hf, sizeof(hf), "model.layers.%u.%s.gate.weight", l,
			 c->arch == ARCH_MIXTRAL ? "block_sparse_moe" : "mlp");
		add(p, o, name, hf, GK_ROUTER, l, d, c->n_experts);
		static const char *const exps[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
		for (int m = 0; m < 3; m++) {
			snprintf(name, sizeof(name), "blk.%u.%s.weight", l, exps[m]);
			struct gtensor *t = add(p, o, name, NULL, m == 0 ? GK_GATE : m == 1 ? GK_UP : GK_DOWN, l,
						m == 2 ? ef : d, m == 2 ? d : ef);
			t->ndim = 3;
			t->ne[2] = c->n_experts;
			t->keys_at = (3 * l + (uint32_t)m) * c->n_experts;
			for (uint32_t e = 0; e < c->n_experts; e++) {
				expert_hf_name(c, l, e, m, hf, sizeof(hf));
				p->expert_keys[t->keys_at + e] = syn_tensor_key(o->seed, hf);
			}
		}
	}
	add(p, o, "output_norm.weight", "model.norm.weight", GK_NORM, 0, d, 0);
	if (!tied)
		add(p, o, "output.weight", "lm_head.weight", GK_OUTPUT, 0, d, c->vocab_size);
	for (uint32_t i = 0; i < p->n; i++) {
		struct gtensor *t = &p->t[i];
		if (t->ndim >= 2) {
			int rc = matrix_type(t, c, (enum synth_gguf_type)o->gguf_type, tied, err, errlen);
			if (rc)
				return rc;
		}
		t->row_bytes = dtype_row_bytes(t->type, t->ne[0]);
		t->nbytes = t->row_bytes * t->ne[1] * t->ne[2];
		p->tensor_bytes += t->nbytes;
		if (t->ne[0] > p->max_cols)
			p->max_cols = t->ne[0];
		if (t->row_bytes > p->max_row_bytes)
			p->max_row_bytes = t->row_bytes;
	}
	return 0;
}

/* Contiguous runs of about tensor_bytes / shards bytes, at least one tensor each (the cut rule of
 * the safetensors shards). */
static int plan_files(struct gplan *p, const char *out, uint32_t shards, char *err, size_t errlen)
{
	uint32_t n_files = shards ? shards : 1;
	if (n_files > p->n || n_files > GGUF_MAX_SPLITS)
		return errorf(err, errlen, -EINVAL, "cannot split %u tensors into %u GGUF files (at most %u)", p->n,
			      n_files, p->n < GGUF_MAX_SPLITS ? p->n : GGUF_MAX_SPLITS);
	p->f = calloc(n_files, sizeof(*p->f));
	if (!p->f)
		return errorf(err, errlen, -ENOMEM, "out of memory planning %u files", n_files);
	p->n_files = n_files;
	uint32_t file = 0, in_file = 0;
	uint64_t before = 0;
	for (uint32_t i = 0; i < p->n; i++) {
		struct gtensor *t = &p->t[i];
		bool must = p->n - i <= n_files - 1 - file;
		bool past = (before + t->nbytes / 2) * (uint64_t)n_files >= (uint64_t)(file + 1) * p->tensor_bytes;
		if (in_file && file + 1 < n_files && (must || past)) {
			file++;
			in_file = 0;
		}
		if (in_file == 0)
			p->f[file].first = i;
		t->file = file;
		p->f[file].n++;
		in_file++;
		before += t->nbytes;
	}
	for (uint32_t f = 0; f < n_files; f++)
		if (synth_gguf_path(out, f, n_files, p->f[f].path, sizeof(p->f[f].path)))
			return errorf(err, errlen, -ENAMETOOLONG, "%s: path too long", out);
	return 0;
}

int synth_gguf_path(const char *out, uint32_t i, uint32_t n_files, char *buf, size_t len)
{
	size_t n = strlen(out);
	int w;
	if (n > 5 && !strcmp(out + n - 5, ".gguf")) {
		if (n_files == 1)
			w = snprintf(buf, len, "%s", out);
		else
			w = snprintf(buf, len, "%.*s-%05u-of-%05u.gguf", (int)(n - 5), out, i + 1, n_files);
	} else {
		while (n > 1 && out[n - 1] == '/')
			n--;
		if (n_files == 1)
			w = snprintf(buf, len, "%.*s/model.gguf", (int)n, out);
		else
			w = snprintf(buf, len, "%.*s/model-%05u-of-%05u.gguf", (int)n, out, i + 1, n_files);
	}
	return w < 0 || (size_t)w >= len ? -ENAMETOOLONG : 0;
}

/* ---- header ---- */

/* Key/value pairs being built: the bytes and their count. */
struct kvs {
	struct sbuf s;
	uint64_t n;
};

static void put_u32(struct sbuf *s, uint32_t v)
{
	uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
	syn_sb_put(s, b, 4);
}

static void put_u64(struct sbuf *s, uint64_t v)
{
	put_u32(s, (uint32_t)v);
	put_u32(s, (uint32_t)(v >> 32));
}

static void put_str(struct sbuf *s, const char *p, size_t n)
{
	put_u64(s, n);
	syn_sb_put(s, p, n);
}

static void key(struct kvs *k, const char *name, uint32_t type)
{
	put_str(&k->s, name, strlen(name));
	put_u32(&k->s, type);
	k->n++;
}

static void kv_u32(struct kvs *k, const char *name, uint32_t v)
{
	key(k, name, GV_UINT32);
	put_u32(&k->s, v);
}

static void kv_u16(struct kvs *k, const char *name, uint16_t v)
{
	key(k, name, GV_UINT16);
	uint8_t b[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
	syn_sb_put(&k->s, b, 2);
}

static void kv_i32(struct kvs *k, const char *name, int32_t v)
{
	key(k, name, GV_INT32);
	put_u32(&k->s, (uint32_t)v);
}

static void kv_f32(struct kvs *k, const char *name, float v)
{
	key(k, name, GV_FLOAT32);
	uint32_t u;
	memcpy(&u, &v, 4);
	put_u32(&k->s, u);
}

static void kv_bool(struct kvs *k, const char *name, bool v)
{
	key(k, name, GV_BOOL);
	uint8_t b = v;
	syn_sb_put(&k->s, &b, 1);
}

static void kv_str(struct kvs *k, const char *name, const char *v)
{
	key(k, name, GV_STRING);
	put_str(&k->s, v, strlen(v));
}

static void kv_str_array(struct kvs *k, const char *name, uint32_t n, const char *const *v, const size_t *len)
{
	key(k, name, GV_ARRAY);
	put_u32(&k->s, GV_STRING);
	put_u64(&k->s, n);
	for (uint32_t i = 0; i < n; i++)
		put_str(&k->s, v[i], len[i]);
}

static void kv_i32_array(struct kvs *k, const char *name, uint32_t n, const int32_t *v)
{
	key(k, name, GV_ARRAY);
	put_u32(&k->s, GV_INT32);
	put_u64(&k->s, n);
	for (uint32_t i = 0; i < n; i++)
		put_u32(&k->s, (uint32_t)v[i]);
}

/* What convert_hf_to_gguf.py writes for a LlamaForCausalLM / MistralForCausalLM /
 * MixtralForCausalLM (architecture llama), Qwen3ForCausalLM (qwen3) or Qwen3MoeForCausalLM
 * (qwen3moe) checkpoint, and the general.* keys llama-quantize adds. */
static void model_keys(struct kvs *k, const struct model_config *c, const struct synth_options *o)
{
	bool qwen = c->arch == ARCH_QWEN3 || c->arch == ARCH_QWEN3_MOE;
	const char *a = c->arch == ARCH_QWEN3 ? "qwen3" : c->arch == ARCH_QWEN3_MOE ? "qwen3moe" : "llama";
	char key[96];
#define AK(suffix) (snprintf(key, sizeof(key), "%s.%s", a, suffix), key)
	kv_str(k, "general.architecture", a);
	kv_str(k, "general.name", o->name ? o->name : DEFAULT_NAME);
	kv_u32(k, "general.alignment", GGUF_ALIGNMENT);
	kv_u32(k, AK("block_count"), c->n_layers);
	kv_u32(k, AK("context_length"), c->max_position);
	kv_u32(k, AK("embedding_length"), c->dim);
	kv_u32(k, AK("feed_forward_length"), c->ffn_dim);
	kv_u32(k, AK("attention.head_count"), c->n_heads);
	kv_u32(k, AK("attention.head_count_kv"), c->n_kv_heads);
	kv_f32(k, AK("rope.freq_base"), c->rope_theta);
	kv_f32(k, AK("attention.layer_norm_rms_epsilon"), c->rms_eps);
	/* Qwen3's config.json always has head_dim, which the converter writes. */
	if (qwen || (uint64_t)c->head_dim * c->n_heads != c->dim) {
		kv_u32(k, AK("attention.key_length"), c->head_dim);
		kv_u32(k, AK("attention.value_length"), c->head_dim);
	}
	if (c->n_experts) {
		kv_u32(k, AK("expert_count"), c->n_experts);
		kv_u32(k, AK("expert_used_count"), c->n_experts_used);
	}
	if (c->arch == ARCH_QWEN3_MOE) {
		kv_u32(k, AK("expert_feed_forward_length"), c->expert_ffn_dim);
		kv_bool(k, AK("expert_weights_norm"), (c->flags & MODEL_NORM_TOPK) != 0);
	}
	if (c->rope_scaling == ROPE_SCALING_LINEAR) {
		kv_str(k, AK("rope.scaling.type"), "linear");
		kv_f32(k, AK("rope.scaling.factor"), c->rope_factor);
	}
	/* llama.cpp reads no sliding window for the llama architecture (Mistral v0.1's is dropped on
	 * conversion); the key keeps it for readers that honour it. */
	if (c->sliding_window)
		kv_u32(k, AK("attention.sliding_window"), c->sliding_window);
	kv_u32(k, "general.file_type", o->gguf_type);
	if (!qwen)
		kv_u32(k, AK("vocab_size"), c->vocab_size);
	kv_u32(k, AK("rope.dimension_count"), c->head_dim);
	kv_u32(k, "general.quantization_version", GGML_QUANT_VERSION);
#undef AK
}

/* The tokenizer keys of a Llama 3 tokenizer (convert_hf_to_gguf.py's _set_vocab_gpt2 and its
 * SpecialVocab), or without one the BOS/EOS ids alone (llama.cpp refuses such a file; our reader
 * runs on ids). */
static void tokenizer_keys(struct kvs *k, const struct model_config *c, const struct syn_vocab *v)
{
	if (v) {
		kv_str(k, "tokenizer.ggml.model", "gpt2");
		kv_str(k, "tokenizer.ggml.pre", LLAMA3_PRE_TOKENIZER);
		kv_str_array(k, "tokenizer.ggml.tokens", v->n_tokens, v->tok, v->tok_len);
		kv_i32_array(k, "tokenizer.ggml.token_type", v->n_tokens, v->type);
		kv_str_array(k, "tokenizer.ggml.merges", v->n_merges, v->merge, v->merge_len);
	}
	if (c->bos_id >= 0)
		kv_u32(k, "tokenizer.ggml.bos_token_id", (uint32_t)c->bos_id);
	if (c->n_eos)
		kv_u32(k, "tokenizer.ggml.eos_token_id", (uint32_t)c->eos_ids[0]);
	if (v) {
		if (v->eot >= 0)
			kv_u32(k, "tokenizer.ggml.eot_token_id", (uint32_t)v->eot);
		kv_bool(k, "tokenizer.ggml.add_bos_token", true);
		if (v->chat_llama3)
			kv_str(k, "tokenizer.chat_template", syn_llama3_chat_template);
	}
}

/* File f's header: the counts, its key/value pairs (all metadata in the first file only, the
 * split keys in every file of a split set, as gguf-split writes them), its tensor infos, zeros
 * to the data section. Also sets its tensors' offsets and the file's size. */
static int build_header(struct gplan *p, uint32_t f, const struct model_config *c, const struct synth_options *o,
			const struct syn_vocab *v, char *err, size_t errlen)
{
	struct gfile *gf = &p->f[f];
	struct kvs k = {0};
	if (f == 0) {
		model_keys(&k, c, o);
		tokenizer_keys(&k, c, v);
	}
	if (p->n_files > 1) {
		kv_u16(&k, "split.no", (uint16_t)f);
		kv_u16(&k, "split.count", (uint16_t)p->n_files);
		kv_i32(&k, "split.tensors.count", (int32_t)p->n);
	}
	struct sbuf *h = &gf->head;
	syn_sb_put(h, "GGUF", 4);
	put_u32(h, GGUF_VERSION);
	put_u64(h, gf->n);
	put_u64(h, k.n);
	if (k.s.len)
		syn_sb_put(h, k.s.p, k.s.len);
	free(k.s.p);
	uint64_t off = 0;
	for (uint32_t i = gf->first; i < gf->first + gf->n; i++) {
		struct gtensor *t = &p->t[i];
		t->offset = off;
		off = (off + t->nbytes + GGUF_ALIGNMENT - 1) / GGUF_ALIGNMENT * GGUF_ALIGNMENT;
		put_str(h, t->name, strlen(t->name));
		put_u32(h, t->ndim);
		for (uint32_t d = 0; d < t->ndim; d++)
			put_u64(h, t->ne[d]);
		put_u32(h, syn_ggml_type(t->type));
		put_u64(h, t->offset);
	}
	static const uint8_t zeros[GGUF_ALIGNMENT];
	syn_sb_put(h, zeros, (GGUF_ALIGNMENT - h->len % GGUF_ALIGNMENT) % GGUF_ALIGNMENT);
	if (h->oom)
		return errorf(err, errlen, -ENOMEM, "out of memory building the header of %s", gf->path);
	gf->size = h->len + off;
	p->file_bytes += gf->size;
	return 0;
}

void syn_gguf_plan_free(struct gplan *p)
{
	for (uint32_t f = 0; p->f && f < p->n_files; f++)
		free(p->f[f].head.p);
	free(p->f);
	free(p->t);
	free(p->rope_freqs);
	free(p->expert_keys);
	memset(p, 0, sizeof(*p));
}

int syn_gguf_plan(struct gplan *p, const char *out, const struct model_config *c, const struct synth_options *o,
		  bool tied, char *err, size_t errlen)
{
	memset(p, 0, sizeof(*p));
	enum dtype base;
	if (base_type((enum synth_gguf_type)o->gguf_type, &base))
		return errorf(err, errlen, -EINVAL, "GGUF type %u is not one of f32, f16, bf16, q8_0, q4_0, q4_k_m, "
			      "q5_k_m, q6_k", o->gguf_type);
	if (!dtype_is_element(o->dtype))
		return errorf(err, errlen, -EINVAL, "dtype %s: values are rounded to an element format (bf16, f16, "
			      "f32) before they are converted", dtype_name(o->dtype));
	if (c->head_dim % 2)
		return errorf(err, errlen, -EINVAL, "head_dim %u is odd: RoPE rotates pairs of dimensions",
			      c->head_dim);
	p->round = o->dtype;
	p->head_dim = c->head_dim;
	int rc = plan_tensors(p, c, o, tied, err, errlen);
	if (!rc)
		rc = plan_files(p, out, o->shards, err, errlen);
	struct syn_vocab vocab, *v = NULL;
	if (!rc && o->tokenizer) {
		rc = syn_vocab_load(o->tokenizer, c->vocab_size, &vocab, err, errlen);
		if (!rc)
			v = &vocab;
	}
	for (uint32_t f = 0; f < p->n_files && !rc; f++)
		rc = build_header(p, f, c, o, v, err, errlen);
	if (v)
		syn_vocab_free(v);
	if (rc)
		syn_gguf_plan_free(p);
	return rc;
}

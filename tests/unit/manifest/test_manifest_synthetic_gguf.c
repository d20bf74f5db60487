/* test_manifest_synthetic_gguf.c - the GGUF files of the synthetic checkpoint writer
 * (tools/make-synthetic-model/, o.format = SYNTH_GGUF), read back with a minimal GGUF parser of
 * the test's own (gguf_test_parse.h, not the project's reader): the metadata keys and values, the
 * tensor infos, offsets and sizes; tensor types per llama.cpp's mix rule; every tensor's bytes
 * against the values synth_value draws (wq/wk rows permuted as convert_hf_to_gguf.py permutes
 * them); split sets; the embedded tokenizer; refusals; cleanup after a failed write; the tool. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "common/quant.h"
#include "tests/unit/common/test_helpers.h"
#include "tests/unit/manifest/gguf_test_parse.h"
#include "tests/unit/manifest/manifest_test_util.h"

/* ---- what the files must hold ---- */

/* Offsets aligned and packed in order, zeros in every gap, the file ending after the last
 * tensor's padding. */
static void check_file_layout(const struct gg *g)
{
	for (size_t i = g->infos_end; i < g->data_start; i++)
		ck_assert_msg(g->data[i] == 0, "header padding byte %zu is not zero", i);
	uint64_t end = 0;
	for (uint64_t i = 0; i < g->n_t; i++) {
		const struct gti *t = &g->t[i];
		ck_assert_msg(t->off % 32 == 0, "%s at offset %llu is not aligned", t->name,
			      (unsigned long long)t->off);
		ck_assert_msg(t->off == (end + 31) / 32 * 32, "%s at %llu, not right after the tensor before it (%llu)",
			      t->name, (unsigned long long)t->off, (unsigned long long)end);
		for (uint64_t b = end; b < t->off; b++)
			ck_assert(g->data[g->data_start + b] == 0);
		end = t->off + t->nbytes;
	}
	uint64_t padded = (end + 31) / 32 * 32;
	ck_assert_msg(g->size == g->data_start + padded, "file of %zu bytes; data start %llu + last tensor end %llu "
		      "(padded to 32) is %llu", g->size, (unsigned long long)g->data_start, (unsigned long long)end,
		      (unsigned long long)(g->data_start + padded));
	for (uint64_t b = end; b < padded; b++)
		ck_assert(g->data[g->data_start + b] == 0);
}

/* The Hugging Face tensor a GGUF tensor is converted from (NULL for rope_freqs). */
static const char *hf_name(const char *gguf, char *buf, size_t len)
{
	static const char *const map[][2] = {
		{"attn_norm", "input_layernorm"},
		{"attn_q", "self_attn.q_proj"},
		{"attn_k", "self_attn.k_proj"},
		{"attn_v", "self_attn.v_proj"},
		{"attn_output", "self_attn.o_proj"},
		{"ffn_norm", "post_attention_layernorm"},
		{"ffn_gate", "mlp.gate_proj"},
		{"ffn_up", "mlp.up_proj"},
		{"ffn_down", "mlp.down_proj"},
	};
	unsigned l;
	char part[64];
	if (!strcmp(gguf, "token_embd.weight"))
		return "model.embed_tokens.weight";
	if (!strcmp(gguf, "output_norm.weight"))
		return "model.norm.weight";
	if (!strcmp(gguf, "output.weight"))
		return "lm_head.weight";
	if (sscanf(gguf, "blk.%u.%63[a-z_].weight", &l, part) == 2) {
		for (size_t i = 0; i < ARRAY_SIZE(map); i++) {
			if (!strcmp(part, map[i][0])) {
				snprintf(buf, len, "model.layers.%u.%s.weight", l, map[i][1]);
				return buf;
			}
		}
	}
	ck_assert_msg(!strcmp(gguf, "rope_freqs.weight"), "unexpected tensor %s", gguf);
	return NULL;
}

static float round_to(enum dtype dt, float v)
{
	return dt == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : dt == DT_F16 ? f16_to_f32(f32_to_f16(v)) : v;
}

/* Every row of every tensor with a Hugging Face counterpart is the conversion of synth_value's
 * draws rounded to round, at the Hugging Face row LlamaModel.permute puts there for attn_q/attn_k;
 * and the dequantized values are near the draws (max_rel_rms: the worst relative RMS error). */
static void check_values(const struct gg *g, uint64_t seed, enum dtype round, double *max_rel_rms)
{
	uint32_t heads = (uint32_t)kv_u(g, "llama.attention.head_count", V_U32);
	uint32_t kv_heads = (uint32_t)kv_u(g, "llama.attention.head_count_kv", V_U32);
	*max_rel_rms = 0;
	for (uint64_t i = 0; i < g->n_t; i++) {
		const struct gti *t = &g->t[i];
		char buf[128];
		const char *hf = hf_name(t->name, buf, sizeof(buf));
		if (!hf)
			continue;
		bool norm = strstr(t->name, "_norm.weight") != NULL;
		uint32_t h = strstr(t->name, ".attn_q.") ? heads : strstr(t->name, ".attn_k.") ? kv_heads : 0;
		int ty = type_index(t->type);
		enum dtype dt = ggml_types[ty].dt;
		uint64_t cols = t->ne[0], rows = t->ne[1], rb = t->nbytes / rows;
		float *v = malloc(cols * sizeof(float)), *back = malloc(cols * sizeof(float));
		uint8_t *want = malloc(rb);
		double err2 = 0, ref2 = 0;
		for (uint64_t r = 0; r < rows; r++) {
			/* permute: reshape(heads, 2, hd/2, cols).swapaxes(1, 2): GGUF row (head, j, t) of
			 * (heads, hd/2, 2) holds Hugging Face row (head, t, j) of (heads, 2, hd/2). */
			uint64_t src = r;
			if (h) {
				uint64_t hd = rows / h, head = r / hd, j = (r % hd) / 2, tt = r % 2;
				src = head * hd + tt * (hd / 2) + j;
			}
			for (uint64_t c = 0; c < cols; c++)
				v[c] = round_to(round, synth_value(seed, hf, norm, src * cols + c));
			if (dt == DT_F32)
				memcpy(want, v, rb);
			else if (dt == DT_F16 || dt == DT_BF16)
				for (uint64_t c = 0; c < cols; c++) {
					uint16_t x = dt == DT_F16 ? f32_to_f16(v[c]) : f32_to_bf16(v[c]);
					memcpy(want + 2 * c, &x, 2);
				}
			else
				quant_quantize(dt, v, want, cols);
			const uint8_t *got = tdata(g, t) + r * rb;
			TH_CHECK(!memcmp(got, want, rb), "%s row %llu differs from the conversion of its values",
				 t->name, (unsigned long long)r);
			quant_dequantize(dt, got, back, cols);
			for (uint64_t c = 0; c < cols; c++) {
				err2 += (back[c] - v[c]) * (back[c] - v[c]);
				ref2 += (norm ? v[c] - 1 : v[c]) * (norm ? v[c] - 1 : v[c]);
			}
		}
		double rel = sqrt(err2 / ref2);
		if (rel > *max_rel_rms)
			*max_rel_rms = rel;
		free(v);
		free(back);
		free(want);
	}
}

/* A model with K-block rows: dim 256, 8 layers, 4 heads of 64, 2 kv heads, ffn 512, vocab 512. */
static struct model_config mix_cfg(void)
{
	struct model_config c = tiny_cfg();
	c.dim = 256;
	c.n_layers = 8;
	c.head_dim = 64;
	c.ffn_dim = 512;
	return c;
}

static struct synth_options gguf_opts(enum synth_gguf_type t, enum dtype round, uint32_t shards)
{
	struct synth_options o = opts(round, 5, shards);
	o.format = SYNTH_GGUF;
	o.gguf_type = t;
	o.threads = 3;
	return o;
}

/* Writes a GGUF file (or set) at tpath(name) and opens the file name or, in a directory, its
 * model.gguf. */
static struct gg *write_open(const char *name, const struct model_config *c, const struct synth_options *o)
{
	const char *out = write_model(name, c, o);
	size_t n = strlen(out);
	return gg_open(n > 5 && !strcmp(out + n - 5, ".gguf") ? out : tpath("%s/model.gguf", name));
}

/* ---- tests ---- */

/* The Llama keys convert_hf_to_gguf.py writes, rope_freqs for llama3 scaling, and no tokenizer. */
START_TEST(test_metadata)
{
	struct model_config c = tiny_cfg();
	struct synth_options o = gguf_opts(SYNTH_GGUF_F32, DT_BF16, 0);
	o.name = "tiny-test";
	struct gg *g = write_open("m.gguf", &c, &o);
	kv_str_is(g, "general.architecture", "llama");
	kv_str_is(g, "general.name", "tiny-test");
	ck_assert_uint_eq(kv_u(g, "general.alignment", V_U32), 32);
	ck_assert_uint_eq(kv_u(g, "general.file_type", V_U32), 0); /* ALL_F32 */
	ck_assert_uint_eq(kv_u(g, "llama.block_count", V_U32), 2);
	ck_assert_uint_eq(kv_u(g, "llama.context_length", V_U32), 4096);
	ck_assert_uint_eq(kv_u(g, "llama.embedding_length", V_U32), 64);
	ck_assert_uint_eq(kv_u(g, "llama.feed_forward_length", V_U32), 192);
	ck_assert_uint_eq(kv_u(g, "llama.attention.head_count", V_U32), 4);
	ck_assert_uint_eq(kv_u(g, "llama.attention.head_count_kv", V_U32), 2);
	ck_assert_uint_eq(kv_u(g, "llama.rope.dimension_count", V_U32), 16);
	ck_assert_uint_eq(kv_u(g, "llama.vocab_size", V_U32), 512);
	ck_assert_float_eq(kv_f32(g, "llama.rope.freq_base"), 500000.0f);
	ck_assert_float_eq(kv_f32(g, "llama.attention.layer_norm_rms_epsilon"), 1e-5f);
	ck_assert_uint_eq(kv_u(g, "tokenizer.ggml.bos_token_id", V_U32), 1);
	ck_assert_uint_eq(kv_u(g, "tokenizer.ggml.eos_token_id", V_U32), 2);
	static const char *const absent[] = {"llama.attention.key_length", "llama.rope.scaling.type",
					     "llama.rope.scaling.factor",  "tokenizer.ggml.model",
					     "tokenizer.ggml.tokens",	   "split.count"};
	for (size_t i = 0; i < ARRAY_SIZE(absent); i++)
		ck_assert_msg(kv(g, absent[i]) == NULL, "%s is written", absent[i]);
	/* llama3 scaling: rope_freqs.weight, F32, head_dim / 2 divisors (convert_hf_to_gguf.py) */
	const struct gti *rf = tensor(g, "rope_freqs.weight");
	ck_assert_ptr_nonnull(rf);
	ck_assert_uint_eq(rf->type, 0);
	ck_assert_uint_eq(rf->ndim, 1);
	ck_assert_uint_eq(rf->ne[0], 8);
	bool seen[3] = {0};
	for (int i = 0; i < 8; i++) {
		double freq = 1.0 / pow(500000.0, 2.0 * i / 16), wavelen = 2 * M_PI / freq, want;
		if (wavelen < 8192.0 / 4)
			want = 1, seen[0] = true;
		else if (wavelen > 8192.0 / 1)
			want = 8, seen[1] = true;
		else {
			double smooth = (8192 / wavelen - 1) / (4 - 1);
			want = 1 / ((1 - smooth) / 8 + smooth);
			seen[2] = true;
		}
		float got;
		memcpy(&got, tdata(g, rf) + 4 * i, 4);
		ck_assert_msg(fabs(got - want) <= 1e-5 * want, "rope_freqs[%d] = %g, want %g", i, got, want);
	}
	ck_assert(seen[0] && seen[1] && seen[2]);
	/* The order llama.cpp writes. */
	static const char *const blk[] = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
					  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"};
	ck_assert_uint_eq(g->n_t, 2 + 2 * 9 + 2);
	ck_assert_str_eq(g->t[0].name, "rope_freqs.weight");
	ck_assert_str_eq(g->t[1].name, "token_embd.weight");
	for (int l = 0; l < 2; l++)
		for (int k = 0; k < 9; k++) {
			char name[64];
			snprintf(name, sizeof(name), "blk.%d.%s.weight", l, blk[k]);
			ck_assert_str_eq(g->t[2 + 9 * l + k].name, name);
		}
	ck_assert_str_eq(g->t[20].name, "output_norm.weight");
	ck_assert_str_eq(g->t[21].name, "output.weight");
	ck_assert_uint_eq(tensor(g, "token_embd.weight")->ne[0], 64); /* ggml order: (dim, vocab) */
	ck_assert_uint_eq(tensor(g, "token_embd.weight")->ne[1], 512);
	ck_assert_uint_eq(tensor(g, "blk.0.ffn_down.weight")->ne[0], 192);
	ck_assert_uint_eq(tensor(g, "blk.0.attn_k.weight")->ne[1], 32);
	check_file_layout(g);
	gg_close(g);

	/* head_dim != dim / heads, linear scaling, tied, a sliding window */
	c = tiny_cfg();
	c.head_dim = 32;
	c.rope_scaling = ROPE_SCALING_LINEAR;
	c.rope_factor = 2.5f;
	c.tie_embeddings = 1;
	c.sliding_window = 4096;
	o.gguf_type = SYNTH_GGUF_Q8_0;
	o.name = NULL;
	g = write_open("lin", &c, &o);
	kv_str_is(g, "general.name", "synthetic");
	ck_assert_uint_eq(kv_u(g, "general.file_type", V_U32), 7); /* MOSTLY_Q8_0 */
	ck_assert_uint_eq(kv_u(g, "llama.attention.key_length", V_U32), 32);
	ck_assert_uint_eq(kv_u(g, "llama.attention.value_length", V_U32), 32);
	ck_assert_uint_eq(kv_u(g, "llama.rope.dimension_count", V_U32), 32);
	ck_assert_uint_eq(kv_u(g, "llama.attention.sliding_window", V_U32), 4096);
	kv_str_is(g, "llama.rope.scaling.type", "linear");
	ck_assert_float_eq(kv_f32(g, "llama.rope.scaling.factor"), 2.5f);
	ck_assert_ptr_null(tensor(g, "rope_freqs.weight"));
	ck_assert_ptr_null(tensor(g, "output.weight"));
	ck_assert_uint_eq(tensor(g, "blk.1.attn_q.weight")->ne[1], 4 * 32);
	check_file_layout(g);
	gg_close(g);
}
END_TEST

/* --dtype f32 --type f32 holds exactly the safetensors checkpoint's values, wq/wk rows permuted;
 * --type f32 from bf16 the bf16 values; f16 and bf16 files their conversions. */
START_TEST(test_values_f32)
{
	struct model_config c = tiny_cfg();
	struct synth_options so = opts(DT_F32, 5, 0);
	struct manifest *m = load_ok(write_model("st", &c, &so));
	struct synth_options o = gguf_opts(SYNTH_GGUF_F32, DT_F32, 0);
	struct gg *g = write_open("f32.gguf", &c, &o);
	check_file_layout(g);
	double rel;
	check_values(g, 5, DT_F32, &rel);
	ck_assert(rel == 0);
	/* The same bytes as the safetensors file, wq's rows permuted over heads of 16 rows. */
	int ei = manifest_find_tensor(m, group_id_embed(), ROLE_EMBED);
	float *st = tensor_bytes(m, &m->tensors[ei]);
	ck_assert(!memcmp(st, tdata(g, tensor(g, "token_embd.weight")), m->tensors[ei].nbytes));
	free(st);
	int qi = manifest_find_tensor(m, group_id_attn(1), ROLE_WQ);
	st = tensor_bytes(m, &m->tensors[qi]);
	const float *q = (const float *)tdata(g, tensor(g, "blk.1.attn_q.weight"));
	float dq[64];
	for (int r = 0; r < 64; r++) {
		quant_dequantize(DT_F32, q + 64 * r, dq, 64); /* as a reader would */
		int head = r / 16, pair = (r % 16) / 2, half = r % 2;
		int src = head * 16 + half * 8 + pair;
		for (int k = 0; k < 64; k++) {
			ck_assert(dq[k] == st[64 * src + k]);
			float want = synth_value(5, "model.layers.1.self_attn.q_proj.weight", false, 64 * src + k);
			ck_assert(dq[k] == want);
		}
	}
	ck_assert(!memcmp(q + 64, st + 64 * 8, 256) && memcmp(q + 64, st + 64, 256)); /* row 1 holds row 8 */
	free(st);
	gg_close(g);
	manifest_destroy(&m);

	static const enum synth_gguf_type types[] = {SYNTH_GGUF_F32, SYNTH_GGUF_F16, SYNTH_GGUF_BF16};
	static const uint32_t ggml[] = {0, 1, 30};
	for (int i = 0; i < 3; i++) {
		o = gguf_opts(types[i], DT_BF16, 0);
		g = write_open(i == 0 ? "b0.gguf" : i == 1 ? "b1.gguf" : "b2.gguf", &c, &o);
		ck_assert_uint_eq(kv_u(g, "general.file_type", V_U32), types[i]);
		for (uint64_t k = 0; k < g->n_t; k++)
			ck_assert_uint_eq(g->t[k].type, g->t[k].ndim == 1 ? 0 : ggml[i]);
		check_values(g, 5, DT_BF16, &rel);
		ck_assert_msg(types[i] == SYNTH_GGUF_F16 ? rel < 1e-3 : rel == 0, "relative RMS error %g", rel);
		gg_close(g);
	}
}
END_TEST

static bool use_more_bits(int i, int n)
{
	return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

/* Each tensor's ggml type in a file of c written as t: llama-quantize's rule, written out here. */
static uint32_t want_type(const struct model_config *c, enum synth_gguf_type t, const struct gti *ti)
{
	if (ti->ndim == 1)
		return 0;
	bool mix = t == SYNTH_GGUF_Q4_K_M || t == SYNTH_GGUF_Q5_K_M;
	uint32_t k = t == SYNTH_GGUF_Q4_K_M ? 12 : 13, q6 = 14, base;
	switch (t) {
	case SYNTH_GGUF_Q8_0:
		base = 8;
		break;
	case SYNTH_GGUF_Q4_0:
		base = 2;
		break;
	case SYNTH_GGUF_Q6_K:
		base = 14;
		break;
	default:
		base = k;
	}
	int l = -1, n = (int)c->n_layers;
	sscanf(ti->name, "blk.%d.", &l);
	uint32_t ty = base;
	if (mix) {
		if (!strcmp(ti->name, "output.weight") || (c->tie_embeddings && !strcmp(ti->name, "token_embd.weight")))
			ty = ti->ne[0] % 256 ? 8 : q6;
		else if (strstr(ti->name, ".attn_v.")) {
			ty = use_more_bits(l, n) ? q6 : k;
			if (n == 80 && c->n_heads != c->n_kv_heads && ty == 12)
				ty = 13; /* llama.cpp's 70B */
		} else if (strstr(ti->name, ".ffn_down.") && use_more_bits(l, n))
			ty = q6;
	}
	if (ti->ne[0] % 256 && (ty == 12 || ty == 13))
		ty = 2; /* Q4_0 */
	if (ti->ne[0] % 256 && ty == 14)
		ty = 8; /* Q8_0 */
	return ty;
}

static void check_types(const struct gg *g, const struct model_config *c, enum synth_gguf_type t, int *n_q6)
{
	*n_q6 = 0;
	for (uint64_t i = 0; i < g->n_t; i++) {
		uint32_t want = want_type(c, t, &g->t[i]);
		ck_assert_msg(g->t[i].type == want, "%s is type %u, want %u", g->t[i].name, g->t[i].type, want);
		*n_q6 += g->t[i].type == 14;
	}
	ck_assert_uint_eq(kv_u(g, "general.file_type", V_U32), t);
}

/* The Q4_K_M and Q5_K_M mixes per tensor, tied and not, llama.cpp's 70B rule, and the fallbacks
 * for rows that do not hold whole K blocks. */
START_TEST(test_types)
{
	struct model_config c = mix_cfg();
	int n_q6;
	struct synth_options o = gguf_opts(SYNTH_GGUF_Q4_K_M, DT_BF16, 0);
	struct gg *g = write_open("q4km.gguf", &c, &o);
	check_types(g, &c, SYNTH_GGUF_Q4_K_M, &n_q6);
	ck_assert_uint_eq(tensor(g, "token_embd.weight")->type, 12);
	ck_assert_uint_eq(tensor(g, "output.weight")->type, 14);
	ck_assert_uint_eq(tensor(g, "blk.0.attn_v.weight")->type, 14); /* use_more_bits: layers 0, 3, 6, 7 */
	ck_assert_uint_eq(tensor(g, "blk.1.attn_v.weight")->type, 12);
	ck_assert_uint_eq(tensor(g, "blk.3.ffn_down.weight")->type, 14);
	ck_assert_uint_eq(tensor(g, "blk.4.ffn_down.weight")->type, 12);
	ck_assert_uint_eq(tensor(g, "blk.6.attn_q.weight")->type, 12);
	ck_assert_int_eq(n_q6, 1 + 2 * 4);
	check_file_layout(g);
	gg_close(g);

	o.gguf_type = SYNTH_GGUF_Q5_K_M;
	c.tie_embeddings = 1;
	g = write_open("q5km.gguf", &c, &o);
	check_types(g, &c, SYNTH_GGUF_Q5_K_M, &n_q6);
	ck_assert_ptr_null(tensor(g, "output.weight"));
	ck_assert_uint_eq(tensor(g, "token_embd.weight")->type, 14); /* tied: the output's type */
	ck_assert_uint_eq(tensor(g, "blk.2.attn_v.weight")->type, 13);
	gg_close(g);

	/* 80 layers with GQA is llama.cpp's 70B: Q4_K_M's attn_v is Q5_K where not Q6_K. */
	c = mix_cfg();
	c.n_layers = 80;
	c.ffn_dim = 256;
	c.vocab_size = 256;
	o.gguf_type = SYNTH_GGUF_Q4_K_M;
	g = write_open("q4km80.gguf", &c, &o);
	check_types(g, &c, SYNTH_GGUF_Q4_K_M, &n_q6);
	ck_assert_uint_eq(tensor(g, "blk.11.attn_v.weight")->type, 13);
	ck_assert_uint_eq(tensor(g, "blk.12.attn_v.weight")->type, 14);
	gg_close(g);

	/* tiny's rows of 64 and 192 values hold no K blocks: Q4_0 for Q4_K, Q8_0 for Q6_K. */
	c = tiny_cfg();
	g = write_open("tiny.gguf", &c, &o);
	check_types(g, &c, SYNTH_GGUF_Q4_K_M, &n_q6);
	ck_assert_int_eq(n_q6, 0);
	ck_assert_uint_eq(tensor(g, "blk.0.attn_v.weight")->type, 2);
	ck_assert_uint_eq(tensor(g, "blk.1.attn_v.weight")->type, 8);
	ck_assert_uint_eq(tensor(g, "output.weight")->type, 8);
	gg_close(g);

	/* One type for every matrix. */
	static const enum synth_gguf_type one[] = {SYNTH_GGUF_Q8_0, SYNTH_GGUF_Q4_0, SYNTH_GGUF_Q6_K};
	c = mix_cfg();
	for (int i = 0; i < 3; i++) {
		o.gguf_type = one[i];
		g = write_open(i == 0 ? "a.gguf" : i == 1 ? "b.gguf" : "c.gguf", &c, &o);
		check_types(g, &c, one[i], &n_q6);
		gg_close(g);
	}
}
END_TEST

/* Each quantized tensor is the quantization of the bf16 checkpoint's values, close to them. */
START_TEST(test_values_quantized)
{
	static const struct {
		enum synth_gguf_type t;
		double max_rel_rms;
	} cases[] = {{SYNTH_GGUF_Q8_0, 0.01}, {SYNTH_GGUF_Q6_K, 0.04}, {SYNTH_GGUF_Q5_K_M, 0.08},
		     {SYNTH_GGUF_Q4_K_M, 0.12}, {SYNTH_GGUF_Q4_0, 0.15}};
	struct model_config c = mix_cfg();
	c.n_layers = 3;
	for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
		struct synth_options o = gguf_opts(cases[i].t, DT_BF16, 0);
		char name[32];
		snprintf(name, sizeof(name), "q%zu.gguf", i);
		struct gg *g = write_open(name, &c, &o);
		double rel;
		check_values(g, 5, DT_BF16, &rel);
		ck_assert_msg(rel > 0 && rel < cases[i].max_rel_rms, "%s: relative RMS error %g",
			      synth_gguf_type_name(cases[i].t), rel);
		gg_close(g);
	}
}
END_TEST

/* Files of several 8 MiB segments, rows cut at their edges: the same bytes from 1 thread or 3. */
START_TEST(test_threads)
{
	struct model_config c = mix_cfg();
	c.n_layers = 1;
	c.vocab_size = 48000; /* token_embd Q4_K 6.9 MB, output Q6_K 10.1 MB */
	struct synth_options o = gguf_opts(SYNTH_GGUF_Q4_K_M, DT_BF16, 0);
	o.threads = 1;
	const char *a = write_model("t1.gguf", &c, &o);
	o.threads = 3;
	const char *b = write_model("t3.gguf", &c, &o);
	size_t la, lb;
	void *da = read_file(a, &la), *db = read_file(b, &lb);
	ck_assert_uint_gt(la, 2 * (8u << 20));
	ck_assert(la == lb && !memcmp(da, db, la));
	free(da);
	free(db);
	struct gg *g = gg_open(b);
	check_file_layout(g);
	double rel;
	check_values(g, 5, DT_BF16, &rel);
	gg_close(g);
}
END_TEST

/* A split set as gguf-split writes it: split keys everywhere, the metadata in the first file,
 * the tensors of the single file in the same order, with the same bytes. */
START_TEST(test_split)
{
	struct model_config c = tiny_cfg();
	struct synth_options o = gguf_opts(SYNTH_GGUF_Q8_0, DT_BF16, 0);
	struct gg *one = write_open("one.gguf", &c, &o);
	o.shards = 3;
	write_model("set", &c, &o);
	ck_assert_int_eq(access(tpath("set/model.gguf"), F_OK), -1);
	uint64_t k = 0;
	for (uint32_t f = 0; f < 3; f++) {
		struct gg *g = gg_open(tpath("set/model-%05u-of-00003.gguf", f + 1));
		ck_assert_uint_eq(kv_u(g, "split.no", V_U16), f);
		ck_assert_uint_eq(kv_u(g, "split.count", V_U16), 3);
		ck_assert_uint_eq(kv_u(g, "split.tensors.count", V_I32), one->n_t);
		if (f == 0) {
			ck_assert_uint_eq(g->n_kv, one->n_kv + 3);
			for (uint64_t i = 0; i < one->n_kv; i++)
				ck_assert_msg(kv(g, one->kv[i].key) != NULL, "%s missing", one->kv[i].key);
		} else {
			ck_assert_uint_eq(g->n_kv, 3);
		}
		ck_assert_uint_gt(g->n_t, 0);
		for (uint64_t i = 0; i < g->n_t; i++, k++) {
			const struct gti *t = &g->t[i], *w = &one->t[k];
			ck_assert_str_eq(t->name, w->name);
			ck_assert(t->type == w->type && t->nbytes == w->nbytes);
			ck_assert(!memcmp(tdata(g, t), tdata(one, w), t->nbytes));
		}
		check_file_layout(g);
		gg_close(g);
	}
	ck_assert_uint_eq(k, one->n_t);
	gg_close(one);

	/* A file name: PREFIX-0000i-of-0000n.gguf beside it; a rewrite leaves one checkpoint. */
	o.shards = 2;
	write_model("d/x.gguf", &c, &o);
	ck_assert_int_eq(access(tpath("d/x-00001-of-00002.gguf"), F_OK), 0);
	ck_assert_int_eq(access(tpath("d/x-00002-of-00002.gguf"), F_OK), 0);
	ck_assert_int_eq(access(tpath("d/x.gguf"), F_OK), -1);
	write_file(tpath("d/keep.gguf"), "k", 1);
	o.shards = 0;
	write_model("d/x.gguf", &c, &o);
	ck_assert_int_eq(access(tpath("d/x.gguf"), F_OK), 0);
	ck_assert_int_eq(access(tpath("d/x-00001-of-00002.gguf"), F_OK), -1);
	ck_assert_int_eq(access(tpath("d/keep.gguf"), F_OK), 0);
	o.shards = 3;
	write_model("set", &c, &o);
	o.shards = 1;
	write_model("set", &c, &o);
	ck_assert_int_eq(access(tpath("set/model-00001-of-00003.gguf"), F_OK), -1);
	ck_assert_int_eq(access(tpath("set/model.gguf"), F_OK), 0);
}
END_TEST

/* A small tokenizer.json of Llama 3's kind: ids 0-3 and 10-14 of a 512-id model. merge_pair
 * spells the second merge as a pair; pre replaces the pre-tokenizer; extra adds a token. */
static const char *small_tokenizer(const char *name, bool merge_pair, const char *pre, const char *extra)
{
	static const char llama3_pre[] =
		"{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": "
		"\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}{1,3}| "
		"?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"}, \"behavior\": "
		"\"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\", \"add_prefix_space\": false, "
		"\"trim_offsets\": true, \"use_regex\": false}]}";
	char text[4096];
	snprintf(text, sizeof(text),
		 "{\"version\": \"1.0\", \"added_tokens\": ["
		 "{\"id\": 10, \"content\": \"<|begin_of_text|>\", \"special\": true},"
		 "{\"id\": 11, \"content\": \"<|end_of_text|>\", \"special\": true},"
		 "{\"id\": 12, \"content\": \"<|eot_id|>\", \"special\": true},"
		 "{\"id\": 13, \"content\": \"<|start_header_id|>\", \"special\": true},"
		 "{\"id\": 14, \"content\": \"<custom>\", \"special\": false}%s],"
		 "\"pre_tokenizer\": %s,"
		 "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2, \"\\u0120a\": 3},"
		 "\"merges\": [\"a b\", %s]}}",
		 extra ? extra : "", pre ? pre : llama3_pre, merge_pair ? "[\"\\u0120\", \"a\"]" : "\"\\u0120 a\"");
	const char *path = tpath("%s", name);
	write_file(path, text, strlen(text));
	return path;
}

START_TEST(test_tokenizer)
{
	struct model_config c = tiny_cfg();
	c.bos_id = 10;
	c.eos_ids[0] = 11;
	struct synth_options o = gguf_opts(SYNTH_GGUF_Q8_0, DT_BF16, 0);
	o.tokenizer = small_tokenizer("tok.json", true, NULL, NULL);
	struct gg *g = write_open("tok.gguf", &c, &o);
	kv_str_is(g, "tokenizer.ggml.model", "gpt2");
	kv_str_is(g, "tokenizer.ggml.pre", "llama-bpe");
	ck_assert_uint_eq(kv(g, "tokenizer.ggml.tokens")->an, 512);
	ck_assert_uint_eq(kv(g, "tokenizer.ggml.token_type")->an, 512);
	static const struct {
		uint32_t id;
		const char *text;
		int32_t type;
	} want[] = {{0, "a", 1},
		    {3, "\xc4\xa0" "a", 1},
		    {4, "[PAD4]", 5},
		    {10, "<|begin_of_text|>", 3},
		    {12, "<|eot_id|>", 3},
		    {14, "<custom>", 4},
		    {15, "[PAD15]", 5},
		    {511, "[PAD511]", 5}};
	for (size_t i = 0; i < ARRAY_SIZE(want); i++) {
		size_t len;
		int32_t type;
		const char *s = kv_arr_at(g, "tokenizer.ggml.tokens", want[i].id, &len, NULL);
		ck_assert_msg(len == strlen(want[i].text) && !memcmp(s, want[i].text, len), "token %u is \"%.*s\"",
			      want[i].id, (int)len, s);
		kv_arr_at(g, "tokenizer.ggml.token_type", want[i].id, NULL, &type);
		ck_assert_msg(type == want[i].type, "token %u has type %d", want[i].id, type);
	}
	ck_assert_uint_eq(kv(g, "tokenizer.ggml.merges")->an, 2);
	size_t len;
	const char *m = kv_arr_at(g, "tokenizer.ggml.merges", 1, &len, NULL);
	ck_assert(len == 4 && !memcmp(m, "\xc4\xa0 a", 4));
	ck_assert_uint_eq(kv_u(g, "tokenizer.ggml.bos_token_id", V_U32), 10);
	ck_assert_uint_eq(kv_u(g, "tokenizer.ggml.eos_token_id", V_U32), 11);
	ck_assert_uint_eq(kv_u(g, "tokenizer.ggml.eot_token_id", V_U32), 12);
	ck_assert_uint_eq(kv_u(g, "tokenizer.ggml.add_bos_token", V_BOOL), 1);
	const struct gkv *tmpl = kv(g, "tokenizer.chat_template");
	ck_assert(tmpl && tmpl->type == V_STR);
	char *t = strndup(tmpl->s, tmpl->slen);
	ck_assert(strstr(t, "<|start_header_id|>") && strstr(t, "<|eot_id|>") && strstr(t, "add_generation_prompt"));
	free(t);
	check_file_layout(g);
	gg_close(g);

	/* Llama 3's own tokenizer in a model of its vocabulary. */
	const char *src = getenv("PIPELINE_SOURCE_DIR");
	ck_assert_msg(src != NULL, "PIPELINE_SOURCE_DIR is not set (ctest sets it)");
	char path[600];
	snprintf(path, sizeof(path), "%s/tests/data/llama3-tokenizer/tokenizer.json", src);
	char err[512];
	ck_assert_int_eq(synth_shape_config("llama3-8b", &c, err, sizeof(err)), 0);
	c.n_layers = 1;
	c.dim = 64;
	c.n_heads = 4;
	c.n_kv_heads = 2;
	c.head_dim = 16;
	c.ffn_dim = 64;
	o.tokenizer = path;
	g = write_open("l3.gguf", &c, &o);
	ck_assert_uint_eq(kv(g, "tokenizer.ggml.tokens")->an, 128256);
	ck_assert_uint_eq(kv(g, "tokenizer.ggml.merges")->an, 280147);
	const char *s = kv_arr_at(g, "tokenizer.ggml.tokens", 128009, &len, NULL);
	ck_assert(len == 10 && !memcmp(s, "<|eot_id|>", 10));
	int32_t type;
	kv_arr_at(g, "tokenizer.ggml.token_type", 128000, NULL, &type);
	ck_assert_int_eq(type, 3);
	kv_arr_at(g, "tokenizer.ggml.token_type", 1000, NULL, &type);
	ck_assert_int_eq(type, 1);
	ck_assert_uint_eq(kv_u(g, "tokenizer.ggml.eot_token_id", V_U32), 128009);
	ck_assert_uint_eq(kv_u(g, "tokenizer.ggml.bos_token_id", V_U32), 128000);
	ck_assert_uint_eq(kv_u(g, "tokenizer.ggml.eos_token_id", V_U32), 128001);
	gg_close(g);
}
END_TEST

/* An added token past the 512 ids of tiny. */
#define TOKEN_600 ",{\"id\": 600, \"content\": \"<x>\", \"special\": true}"

/* synth_write must fail with rc and a message containing word, leaving nothing at out. */
static void write_fails(const char *out, const struct model_config *c, const struct synth_options *o, int want_rc,
			const char *word)
{
	char err[512] = "";
	int rc = synth_write(tpath("%s", out), c, o, err, sizeof(err));
	ck_assert_msg(rc == want_rc, "synth_write %s: rc %d (%s), wanted %d", out, rc, err, want_rc);
	ck_assert_msg(strstr(err, word) != NULL, "message \"%s\" lacks \"%s\"", err, word);
	ck_assert_int_eq(access(tpath("%s", out), F_OK), -1);
}

START_TEST(test_refusals)
{
	struct model_config c = tiny_cfg();
	c.bos_id = 10;
	c.eos_ids[0] = 11;
	struct synth_options o = gguf_opts(SYNTH_GGUF_Q8_0, DT_BF16, 0);
	/* Tokenizers that do not fit the vocabulary, or are not Llama 3's. */
	o.tokenizer = small_tokenizer("big.json", false, NULL, TOKEN_600);
	write_fails("big", &c, &o, -EINVAL, "does not fit");
	o.tokenizer = small_tokenizer("sp.json", false, "{\"type\": \"Metaspace\", \"replacement\": \"_\"}", NULL);
	write_fails("sp", &c, &o, -EINVAL, "pre-tokenizer");
	o.tokenizer = tpath("missing.json");
	write_fails("miss", &c, &o, -ENOENT, "missing.json");
	/* A tokenizer with safetensors. */
	o.tokenizer = small_tokenizer("ok.json", false, NULL, NULL);
	o.format = SYNTH_SAFETENSORS;
	write_fails("st", &c, &o, -EINVAL, "GGUF");
	/* Rows that hold no whole blocks, named; an odd head_dim; an unknown type. */
	o = gguf_opts(SYNTH_GGUF_Q8_0, DT_BF16, 0);
	c = tiny_cfg();
	c.dim = 48;
	c.n_heads = 3;
	c.n_kv_heads = 1;
	write_fails("rows", &c, &o, -EINVAL, "token_embd.weight");
	o.gguf_type = SYNTH_GGUF_F16;
	write_model("rows", &c, &o); /* element types take any row */
	c = tiny_cfg();
	c.head_dim = 15;
	write_fails("odd", &c, &o, -EINVAL, "head_dim");
	c = tiny_cfg();
	o.gguf_type = 3; /* llama.cpp's Q4_1, not written */
	write_fails("t3", &c, &o, -EINVAL, "q4_k_m");
	o.gguf_type = SYNTH_GGUF_Q8_0;
	o.shards = 100; /* more files than tensors */
	write_fails("many", &c, &o, -EINVAL, "100");
}
END_TEST

/* A write that fails part way (the file size limit stands in for a full disk) leaves nothing. */
START_TEST(test_write_failure_cleans_up)
{
	signal(SIGXFSZ, SIG_IGN);
	struct rlimit saved, rl = {100000, 100000};
	ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &saved), 0);
	rl.rlim_max = saved.rlim_max;
	ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
	struct model_config c = tiny_cfg();
	struct synth_options o = gguf_opts(SYNTH_GGUF_F32, DT_BF16, 2);
	char err[512] = "";
	int rc = synth_write(tpath("deep/er/model"), &c, &o, err, sizeof(err));
	setrlimit(RLIMIT_FSIZE, &saved);
	ck_assert_int_eq(rc, -EFBIG);
	ck_assert_msg(strstr(err, "model-00001-of-00002.gguf") != NULL, "message \"%s\" does not name the file", err);
	ck_assert_int_eq(access(tpath("deep"), F_OK), -1);
}
END_TEST

START_TEST(test_tool)
{
	char err[1024];
	const char *out = tpath("tool");
	ck_assert_int_eq(run_tool((const char *[]){"--shape", "tiny", "--out", out, "--type", "q8_0", NULL}, err,
				  sizeof(err)),
			 2);
	ck_assert_ptr_nonnull(strstr(err, "--format gguf"));
	ck_assert_int_eq(run_tool((const char *[]){"--shape", "tiny", "--out", out, "--tokenizer", "t.json", NULL},
				  NULL, 0),
			 2);
	ck_assert_int_eq(run_tool((const char *[]){"--shape", "tiny", "--out", out, "--format", "onnx", NULL}, NULL, 0),
			 2);
	ck_assert_int_eq(run_tool((const char *[]){"--shape", "tiny", "--out", out, "--format", "gguf", "--type",
						   "q3_k", NULL},
				  NULL, 0),
			 2);
	ck_assert_int_eq(access(out, F_OK), -1);
	const char *tok = small_tokenizer("tok.json", false, NULL, NULL);
	/* clang-format off */
	const char *const ok[] = {"--shape", "tiny", "--out", out, "--format", "gguf", "--type", "q4_k_m",
				  "--bos", "10", "--eos", "11", "--tokenizer", tok, "--threads", "2", "--quiet", NULL};
	/* clang-format on */
	ck_assert_int_eq(run_tool(ok, err, sizeof(err)), 0);
	struct gg *g = gg_open(tpath("tool/model.gguf"));
	ck_assert_uint_eq(kv_u(g, "general.file_type", V_U32), 15);
	kv_str_is(g, "general.name", "tiny");
	ck_assert_uint_eq(kv_u(g, "tokenizer.ggml.eos_token_id", V_U32), 11);
	check_file_layout(g);
	gg_close(g);
	ck_assert_int_eq(run_tool(ok, err, sizeof(err)), 1); /* exists */
	ck_assert_ptr_nonnull(strstr(err, "--force"));
	/* A tokenizer that does not fit: a failure, nothing written. */
	const char *big = small_tokenizer("big.json", false, NULL, TOKEN_600);
	const char *const bad[] = {"--shape", "tiny", "--out", tpath("t.gguf"), "--format", "gguf", "--tokenizer", big,
				   "--quiet", NULL};
	ck_assert_int_eq(run_tool(bad, err, sizeof(err)), 1);
	ck_assert_ptr_nonnull(strstr(err, "does not fit"));
	ck_assert_int_eq(access(tpath("t.gguf"), F_OK), -1);
	/* A split set into a file name. */
	const char *const split[] = {"--shape", "tiny", "--out", tpath("s.gguf"), "--format", "gguf", "--shards", "2",
				     "--dtype", "f32", "--type", "f32", "--quiet", NULL};
	ck_assert_int_eq(run_tool(split, NULL, 0), 0);
	g = gg_open(tpath("s-00002-of-00002.gguf"));
	ck_assert_uint_eq(kv_u(g, "split.no", V_U16), 1);
	gg_close(g);
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
		{"file", {test_metadata, test_values_f32, test_types, test_values_quantized, test_threads, NULL}},
		{"split", {test_split, NULL}},
		{"tokenizer", {test_tokenizer, NULL}},
		{"failures", {test_refusals, test_write_failure_cleans_up, NULL}},
		{"tool", {test_tool, NULL}},
	};
	return run_cases("manifest_synthetic_gguf", cases, ARRAY_SIZE(cases));
}

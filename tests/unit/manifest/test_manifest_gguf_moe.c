/* test_manifest_gguf_moe.c - GGUF checkpoints of Qwen3 (qwen3), Mixtral (llama with experts) and
 * Qwen3-MoE (qwen3moe) read into the manifest: the GGUF file make-synthetic-model writes of a shape
 * gives the manifest its safetensors checkpoint of the same seed gives (config, groups, roles,
 * shapes; the GGUF names), each expert's tensor a slice of the fused ffn_*_exps tensor holding
 * that expert's values (F32: the safetensors values widened; Q8_0: those values quantized); the
 * per-expert tensors of older Mixtral files; and the metadata and tensors refused. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/quant.h"
#include "tests/unit/manifest/gguf_test_writer.h"
#include "tests/unit/manifest/manifest_test_util.h"

#define SEED 5

static struct model_config shape(const char *spec)
{
	struct model_config c;
	char err[256];
	ck_assert_msg(synth_shape_config(spec, &c, err, sizeof(err)) == 0, "%s: %s", spec, err);
	return c;
}

/* The shape written as safetensors (BF16) and as GGUF of type gt (from the same BF16 values). */
static void write_pair(const char *spec, const struct model_config *c, enum synth_gguf_type gt, const char **st,
		       const char **gg)
{
	struct synth_options o = opts(DT_BF16, SEED, 0);
	char name[64];
	snprintf(name, sizeof(name), "%s-st", spec);
	*st = write_model(name, c, &o);
	o.format = SYNTH_GGUF;
	o.gguf_type = gt;
	snprintf(name, sizeof(name), "%s-%s.gguf", spec, synth_gguf_type_name(gt));
	*gg = write_model(name, c, &o);
}

/* The GGUF name of the tensor a manifest tensor of role r in layer l (expert e) comes from. */
static void gguf_name(const struct tensor_desc *t, uint32_t l, uint32_t e, char *buf, size_t len)
{
	static const char *const names[ROLE_COUNT] = {
	    [ROLE_EMBED] = "token_embd",	  [ROLE_ATTN_NORM] = "attn_norm",     [ROLE_WQ] = "attn_q",
	    [ROLE_WK] = "attn_k",		  [ROLE_WV] = "attn_v",		      [ROLE_WO] = "attn_output",
	    [ROLE_FFN_NORM] = "ffn_norm",	  [ROLE_W_GATE] = "ffn_gate",	      [ROLE_W_UP] = "ffn_up",
	    [ROLE_W_DOWN] = "ffn_down",		  [ROLE_FINAL_NORM] = "output_norm",  [ROLE_LM_HEAD] = "output",
	    [ROLE_Q_NORM] = "attn_q_norm",	  [ROLE_K_NORM] = "attn_k_norm",      [ROLE_ROUTER] = "ffn_gate_inp",
	    [ROLE_EXPERT_GATE] = "ffn_gate_exps", [ROLE_EXPERT_UP] = "ffn_up_exps",
	    [ROLE_EXPERT_DOWN] = "ffn_down_exps",
	};
	uint32_t r = t->role;
	if (r == ROLE_EMBED || r == ROLE_FINAL_NORM || r == ROLE_LM_HEAD)
		snprintf(buf, len, "%s.weight", names[r]);
	else if (r >= ROLE_EXPERT_GATE)
		snprintf(buf, len, "blk.%u.%s.weight[%u]", l, names[r], e);
	else
		snprintf(buf, len, "blk.%u.%s.weight", l, names[r]);
}

/* The values of a tensor as float32 (element types only). */
static float *values(const struct manifest *m, const struct tensor_desc *t, uint64_t n)
{
	void *b = tensor_bytes(m, t);
	float *f = malloc(n * sizeof(float));
	ck_assert_ptr_nonnull(f);
	dtype_to_f32((enum dtype)t->dtype, b, f, n);
	free(b);
	return f;
}

/* Hugging Face row of GGUF row r of wq/wk (convert_hf_to_gguf.py's permutation for the llama
 * architecture: pairs (j, j + hd/2) of a head made adjacent). */
static uint64_t hf_row(uint64_t r, uint32_t hd)
{
	uint64_t h = r / hd, w = r % hd;
	return h * hd + (w & 1) * (hd / 2) + w / 2;
}

/* The GGUF manifest g against the safetensors manifest s of the same values: the same
 * configuration (but for how RoPE pairs wq/wk rows in a llama file), groups, roles, shapes; the
 * GGUF names; every tensor's values (an element type: the BF16 values converted to it; a quantized
 * GGUF type: the bytes of those values quantized). */
static void check_same(const struct manifest *s, const struct manifest *g, bool permuted)
{
	struct model_config cs = s->cfg, cg = g->cfg;
	ck_assert_uint_eq(cg.rope_layout, permuted ? ROPE_ADJACENT : ROPE_HALVES);
	cg.rope_layout = cs.rope_layout;
	ck_assert_msg(!memcmp(&cs, &cg, sizeof(cs)), "the configurations differ");
	ck_assert_uint_eq(g->n_groups, s->n_groups);
	ck_assert_uint_eq(g->n_tensors, s->n_tensors);
	for (uint32_t i = 0; i < s->n_groups; i++) {
		const struct group_desc *a = &s->groups[i], *b = &g->groups[i];
		ck_assert_uint_eq(b->kind, a->kind);
		ck_assert_uint_eq(b->layer, a->layer);
		ck_assert_uint_eq(b->size_class, a->size_class);
		ck_assert_uint_eq(b->expert, a->expert);
		ck_assert_uint_eq(b->first_tensor, a->first_tensor);
		ck_assert_uint_eq(b->n_tensors, a->n_tensors);
	}
	uint32_t n_experts = 0;
	for (uint32_t i = 0; i < s->n_tensors; i++) {
		const struct tensor_desc *a = &s->tensors[i], *b = &g->tensors[i];
		const struct group_desc *gr = &g->groups[b->group];
		ck_assert_uint_eq(b->role, a->role);
		ck_assert_uint_eq(b->group, a->group);
		ck_assert_uint_eq(b->ndim, a->ndim);
		ck_assert_uint_eq(b->shape[0], a->shape[0]);
		ck_assert_uint_eq(b->shape[1], a->shape[1]);
		char want[TENSOR_NAME_MAX];
		gguf_name(b, gr->layer, gr->expert, want, sizeof(want));
		ck_assert_str_eq(b->name, want);
		n_experts += b->role >= ROLE_EXPERT_GATE;
		uint64_t rows = a->shape[0], cols = a->ndim == 2 ? a->shape[1] : 1, n = rows * cols;
		ck_assert_uint_eq(b->nbytes, dtype_row_bytes((enum dtype)b->dtype, cols) * rows);
		float *va = values(s, a, n);
		bool perm = permuted && (a->role == ROLE_WQ || a->role == ROLE_WK);
		if (perm) { /* va in GGUF's row order */
			float *p = malloc(n * sizeof(float));
			for (uint64_t r = 0; r < rows; r++)
				memcpy(p + r * cols, va + hf_row(r, s->cfg.head_dim) * cols, cols * sizeof(float));
			free(va);
			va = p;
		}
		if (dtype_is_element((enum dtype)b->dtype)) {
			float *vb = values(g, b, n);
			for (uint64_t k = 0; b->dtype == DT_F16 && k < n; k++)
				va[k] = f16_to_f32(f32_to_f16(va[k])); /* BF16 values converted to F16 */
			for (uint64_t k = 0; k < n; k++)
				ck_assert_msg(va[k] == vb[k], "%s value %llu: %g, the safetensors %s has %g", b->name,
					      (unsigned long long)k, (double)vb[k], a->name, (double)va[k]);
			free(vb);
		} else {
			uint8_t *q = malloc(b->nbytes), *got = tensor_bytes(g, b);
			quant_quantize((enum dtype)b->dtype, va, q, n);
			ck_assert_msg(!memcmp(q, got, b->nbytes), "%s: not the %s of the safetensors %s", b->name,
				      dtype_name((enum dtype)b->dtype), a->name);
			free(q);
			free(got);
		}
		free(va);
	}
	ck_assert_uint_eq(n_experts, 3 * s->cfg.n_experts * s->cfg.n_layers);
	check_layout(g);
}

static void check_shape(const char *spec, enum synth_gguf_type gt)
{
	struct model_config c = shape(spec);
	const char *st, *gg;
	write_pair(spec, &c, gt, &st, &gg);
	struct manifest *s = load_ok(st), *g = load_ok(gg);
	check_same(s, g, c.arch == ARCH_MIXTRAL);
	manifest_destroy(&s);
	manifest_destroy(&g);
}

START_TEST(test_qwen3)
{
	check_shape("qwen3-tiny", SYNTH_GGUF_F32);
	check_shape("qwen3-tiny", SYNTH_GGUF_Q8_0);
}
END_TEST

START_TEST(test_mixtral)
{
	check_shape("mixtral-tiny", SYNTH_GGUF_F32);
	check_shape("mixtral-tiny", SYNTH_GGUF_Q8_0);
	check_shape("mixtral-tiny", SYNTH_GGUF_F16);
}
END_TEST

START_TEST(test_qwen3_moe)
{
	check_shape("qwen3-moe-tiny", SYNTH_GGUF_F32);
	check_shape("qwen3-moe-tiny", SYNTH_GGUF_BF16);
	/* norm_topk_prob false travels as qwen3moe.expert_weights_norm */
	struct model_config c = shape("qwen3-moe-tiny");
	c.flags &= ~MODEL_NORM_TOPK;
	const char *st, *gg;
	write_pair("nonorm", &c, SYNTH_GGUF_F32, &st, &gg);
	struct manifest *s = load_ok(st), *g = load_ok(gg);
	ck_assert_uint_eq(g->cfg.flags, MODEL_QK_NORM);
	check_same(s, g, false);
	manifest_destroy(&s);
	manifest_destroy(&g);
}
END_TEST

/* llama-quantize's Q4_K_M for a model of 8 experts: attn_k and attn_v in Q8_0, attn_output in
 * Q5_K, the experts as the dense matrices (ffn_down_exps Q6_K in the layers use_more_bits picks),
 * the router F32; the file reads back as the same model. */
START_TEST(test_q4_k_m_mix)
{
	struct model_config c = shape("mixtral-tiny");
	c.dim = 256;
	c.ffn_dim = c.expert_ffn_dim = 256;
	c.head_dim = 64; /* attn_output rows of 256: whole K blocks */
	c.n_layers = 8;
	const char *st, *gg;
	write_pair("mx256", &c, SYNTH_GGUF_Q4_K_M, &st, &gg);
	struct manifest *s = load_ok(st), *g = load_ok(gg);
	for (uint32_t l = 0; l < c.n_layers; l++) {
		bool more = l < 1 || l >= 7 || (l - 1) % 3 == 2; /* use_more_bits(l, 8) */
		uint32_t a = model_group_attn(&c, l), r = model_group_ffn(&c, l), e3 = model_group_expert(&c, l, 3);
		ck_assert_uint_eq(g->tensors[manifest_find_tensor(g, a, ROLE_WQ)].dtype, DT_Q4_K);
		ck_assert_uint_eq(g->tensors[manifest_find_tensor(g, a, ROLE_WK)].dtype, DT_Q8_0);
		ck_assert_uint_eq(g->tensors[manifest_find_tensor(g, a, ROLE_WV)].dtype, DT_Q8_0);
		ck_assert_uint_eq(g->tensors[manifest_find_tensor(g, a, ROLE_WO)].dtype, DT_Q5_K);
		ck_assert_uint_eq(g->tensors[manifest_find_tensor(g, r, ROLE_ROUTER)].dtype, DT_F32);
		ck_assert_uint_eq(g->tensors[manifest_find_tensor(g, e3, ROLE_EXPERT_GATE)].dtype, DT_Q4_K);
		ck_assert_uint_eq(g->tensors[manifest_find_tensor(g, e3, ROLE_EXPERT_DOWN)].dtype,
				  more ? DT_Q6_K : DT_Q4_K);
	}
	check_same(s, g, true);
	manifest_destroy(&s);
	manifest_destroy(&g);
}
END_TEST

/* ---- older Mixtral files: one tensor per expert ---- */

#define OLD_E 2 /* experts of the hand-written Mixtral */

enum old_variant {
	OLD_OK = 0,
	OLD_DUP = 1,	   /* a per-expert tensor beside the fused one that holds it */
	OLD_MORE_EXP = 2, /* blk.0.ffn_up_exps.weight holds OLD_E + 1 experts */
};

/* The tiny llama with OLD_E experts of 192 (its feed_forward_length), the router, and the
 * experts' matrices fused (blk.N.ffn_gate_exps.weight) or one per expert (blk.N.ffn_gate.E.weight),
 * the same values either way: data[l][m] holds matrix m of every expert of layer l. */
static const char *write_old_mixtral(const char *name, bool fused, float *const data[2][3], enum old_variant v)
{
	static const char *const dense[6] = {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight",
					     "blk.1.ffn_gate.weight", "blk.1.ffn_up.weight", "blk.1.ffn_down.weight"};
	struct gw *w = gw_new();
	for (int i = 0; i < 6; i++)
		w->skip[i] = dense[i];
	gw_tiny_llama(w, &(struct gw_llama){.type = GW_F32});
	memset(w->skip, 0, sizeof(w->skip));
	gw_u32(w, "llama.expert_count", OLD_E);
	gw_u32(w, "llama.expert_used_count", 1);
	static const char *const mat[3] = {"gate", "up", "down"};
	char t[64];
	for (uint32_t l = 0; l < 2; l++) {
		uint64_t r_ne[2] = {64, OLD_E};
		snprintf(t, sizeof(t), "blk.%u.ffn_gate_inp.weight", l);
		gw_tensor(w, t, GW_F32, 2, r_ne, NULL);
		for (int m = 0; m < 3; m++) {
			uint64_t cols = m == 2 ? 192 : 64, rows = m == 2 ? 64 : 192;
			if (fused) {
				bool more = v == OLD_MORE_EXP && l == 0 && m == 1;
				uint64_t ne[3] = {cols, rows, OLD_E + more};
				snprintf(t, sizeof(t), "blk.%u.ffn_%s_exps.weight", l, mat[m]);
				gw_tensor(w, t, GW_F32, 3, ne, more ? NULL : data[l][m]);
				if (v == OLD_DUP && l == 1 && m == 1) {
					snprintf(t, sizeof(t), "blk.%u.ffn_%s.1.weight", l, mat[m]);
					gw_tensor(w, t, GW_F32, 2, ne, NULL);
				}
				continue;
			}
			for (uint32_t e = 0; e < OLD_E; e++) {
				uint64_t ne[2] = {cols, rows};
				snprintf(t, sizeof(t), "blk.%u.ffn_%s.%u.weight", l, mat[m], e);
				gw_tensor(w, t, GW_F32, 2, ne, data[l][m] + e * rows * cols);
			}
		}
	}
	const char *path = tpath("%s", name);
	ck_assert_int_eq(gw_write(w, path), 0);
	gw_free(&w);
	return path;
}

START_TEST(test_per_expert_tensors)
{
	float *data[2][3];
	uint64_t n = OLD_E * 64 * 192;
	for (int l = 0; l < 2; l++)
		for (int m = 0; m < 3; m++) {
			data[l][m] = malloc(n * sizeof(float));
			for (uint64_t k = 0; k < n; k++)
				data[l][m][k] = (float)(k % 97) * 0.01f + (float)(l * 3 + m);
		}
	struct manifest *f = load_ok(write_old_mixtral("fused.gguf", true, data, OLD_OK));
	struct manifest *p = load_ok(write_old_mixtral("old.gguf", false, data, OLD_OK));
	ck_assert_uint_eq(p->cfg.arch, ARCH_MIXTRAL);
	ck_assert_uint_eq(p->cfg.n_experts, OLD_E);
	ck_assert_uint_eq(p->cfg.expert_ffn_dim, 192);
	ck_assert_uint_eq(p->cfg.flags, MODEL_NORM_TOPK);
	ck_assert_uint_eq(p->n_tensors, f->n_tensors);
	int seen = 0;
	for (uint32_t i = 0; i < p->n_tensors; i++) {
		const struct tensor_desc *a = &f->tensors[i], *b = &p->tensors[i];
		ck_assert_uint_eq(a->role, b->role);
		ck_assert_uint_eq(a->group, b->group);
		if (b->role < ROLE_EXPERT_GATE)
			continue;
		const struct group_desc *gr = &p->groups[b->group];
		static const char *const mat[3] = {"gate", "up", "down"};
		char want[64];
		snprintf(want, sizeof(want), "blk.%u.ffn_%s.%u.weight", gr->layer, mat[b->role - ROLE_EXPERT_GATE],
			 gr->expert);
		ck_assert_str_eq(b->name, want);
		snprintf(want, sizeof(want), "blk.%u.ffn_%s_exps.weight[%u]", gr->layer,
			 mat[b->role - ROLE_EXPERT_GATE], gr->expert);
		ck_assert_str_eq(a->name, want);
		ck_assert_uint_eq(a->nbytes, 64 * 192 * 4);
		ck_assert_uint_eq(b->nbytes, a->nbytes);
		void *x = tensor_bytes(f, a), *y = tensor_bytes(p, b);
		const float *d = data[gr->layer][b->role - ROLE_EXPERT_GATE] + gr->expert * 64 * 192;
		ck_assert(!memcmp(x, d, a->nbytes));
		ck_assert(!memcmp(y, d, b->nbytes));
		free(x);
		free(y);
		seen++;
	}
	ck_assert_int_eq(seen, 2 * 3 * OLD_E);
	check_layout(p);
	check_layout(f);
	manifest_destroy(&f);
	manifest_destroy(&p);
	/* The same expert twice; a fused tensor of more experts than the metadata's. */
	load_fails(write_old_mixtral("dup.gguf", true, data, OLD_DUP), -EINVAL, "twice");
	load_fails(write_old_mixtral("more.gguf", true, data, OLD_MORE_EXP), -EINVAL,
		   "tensor blk.0.ffn_up_exps.weight has shape [3, 192, 64] (experts, rows, columns), but the metadata "
		   "implies [2, 192, 64] (llama.expert_count 2)");
	for (int l = 0; l < 2; l++)
		for (int m = 0; m < 3; m++)
			free(data[l][m]);
}
END_TEST

/* ---- refusals ---- */

/* Sets the uint32 value of key in a GGUF file written by make-synthetic-model (the key, its type
 * UINT32, then the value). */
static void patch_u32(const char *path, const char *key, uint32_t v)
{
	size_t len, kl = strlen(key);
	uint8_t *b = read_file(path, &len);
	uint8_t *at = NULL;
	for (size_t i = 8; i + kl + 8 <= len && !at; i++)
		if (!memcmp(b + i, key, kl) && b[i - 8] == kl && b[i - 7] == 0)
			at = b + i + kl;
	ck_assert_msg(at, "no key %s in %s", key, path);
	ck_assert_uint_eq(at[0], 4); /* UINT32 */
	memcpy(at + 4, &v, 4);
	write_file(path, b, len);
	free(b);
}

/* Renames a tensor or key in place (same length). */
static void patch_name(const char *path, const char *from, const char *to)
{
	size_t len, n = strlen(from);
	ck_assert_uint_eq(strlen(to), n);
	uint8_t *b = read_file(path, &len);
	bool found = false;
	for (size_t i = 0; i + n <= len; i++)
		if (!memcmp(b + i, from, n)) {
			memcpy(b + i, to, n);
			found = true;
		}
	ck_assert_msg(found, "no %s in %s", from, path);
	write_file(path, b, len);
	free(b);
}

static const char *write_gguf(const char *name, const char *spec)
{
	struct model_config c = shape(spec);
	struct synth_options o = opts(DT_BF16, SEED, 0);
	o.format = SYNTH_GGUF;
	o.gguf_type = SYNTH_GGUF_F32;
	return write_model(name, &c, &o);
}

static void fails_u32(const char *spec, const char *key, uint32_t v, int rc, const char *word)
{
	const char *path = write_gguf("bad.gguf", spec);
	patch_u32(path, key, v);
	load_fails(path, rc, word);
}

START_TEST(test_refused)
{
	fails_u32("mixtral-tiny", "llama.expert_count", 4, -EINVAL,
		  "tensor blk.0.ffn_gate_inp.weight has shape [8, 64] (rows first), but the metadata implies [4, 64]");
	fails_u32("mixtral-tiny", "llama.expert_count", 1000, -EINVAL, "llama.expert_count 1000 is out of range");
	fails_u32("mixtral-tiny", "llama.expert_used_count", 9, -EINVAL,
		  "llama.expert_used_count 9 must be in [1, 8] (llama.expert_count)");
	fails_u32("mixtral-tiny", "llama.expert_used_count", 0, -EINVAL, "llama.expert_used_count 0 must be in");
	fails_u32("qwen3-moe-tiny", "qwen3moe.expert_feed_forward_length", 32, -EINVAL,
		  "blk.0.ffn_gate_exps.weight has shape [8, 48, 64] (experts, rows, columns), but the metadata "
		  "implies [8, 32, 64]");
	fails_u32("qwen3-moe-tiny", "qwen3moe.expert_count", 0, -EINVAL,
		  "qwen3moe.expert_count is 0: a qwen3moe model has experts");
	fails_u32("qwen3-tiny", "qwen3.attention.key_length", 16, -ENOTSUP,
		  "qwen3.attention.value_length 32 differs from key_length 16");
	fails_u32("qwen3-tiny", "qwen3.attention.value_length", 16, -ENOTSUP,
		  "qwen3.attention.value_length 16 differs from key_length 32");
	/* A dense llama file that names a used count; a missing one with experts. */
	const char *path = write_gguf("bad.gguf", "mixtral-tiny");
	patch_name(path, "llama.expert_used_count", "llama.expert_usedXcount");
	load_fails(path, -EINVAL, "key llama.expert_used_count is missing (llama.expert_count is 8)");
	path = write_gguf("bad.gguf", "mixtral-tiny");
	patch_name(path, "llama.expert_count", "llama.expertXcount");
	load_fails(path, -EINVAL, "llama.expert_used_count is 2, but the model has no experts");
	/* Expert tensors where the metadata has none: qwen3 with a count is refused. */
	path = write_gguf("bad.gguf", "qwen3-moe-tiny");
	patch_name(path, "qwen3moe", "qwen3xxx");
	load_fails(path, -ENOTSUP, "architecture \"qwen3xxx\" is not supported (supported: llama, qwen3, qwen3moe)");
	/* A tensor missing: its fused name. */
	path = write_gguf("bad.gguf", "qwen3-moe-tiny");
	patch_name(path, "blk.1.ffn_down_exps.weight", "blk.1.ffn_down_expX.weight");
	load_fails(path, -EINVAL, "unexpected tensor blk.1.ffn_down_expX.weight (not part of a 2-layer qwen3moe with "
				  "experts)");
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
	    {"same_as_safetensors", {test_qwen3, test_mixtral, test_qwen3_moe, test_q4_k_m_mix, NULL}},
	    {"per_expert", {test_per_expert_tensors, NULL}},
	    {"refused", {test_refused, NULL}},
	};
	return run_cases("manifest_gguf_moe", cases, ARRAY_SIZE(cases));
}

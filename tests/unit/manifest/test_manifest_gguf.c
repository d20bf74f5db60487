/* test_manifest_gguf.c - manifest_load on GGUF checkpoints written by the test writer
 * (gguf_test_writer.h): the tiny Llama in F32 and Q8_0, tied, in a directory, as a split set of
 * three files; the configuration from the llama.* keys (defaults, special ids, RoPE scaling with
 * rope_freqs.weight); and files it must refuse, each with its return code and a message that names
 * the fault. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/unit/manifest/gguf_test_writer.h"
#include "tests/unit/manifest/manifest_test_util.h"

static const char *write_w(struct gw *w, const char *name)
{
	const char *path = tpath("%s", name);
	ck_assert_int_eq(gw_write(w, path), 0);
	return path;
}

/* The tiny model of type `type`, with the key or tensor skip left out (NULL: none). */
static struct gw *tiny(uint32_t type, const char *skip)
{
	struct gw *w = gw_new();
	w->skip[0] = skip;
	gw_tiny_llama(w, &(struct gw_llama){.type = type});
	w->skip[0] = NULL;
	return w;
}

static const char *write_tiny_gguf(const char *name, uint32_t type)
{
	struct gw *w = tiny(type, NULL);
	const char *path = write_w(w, name);
	gw_free(&w);
	return path;
}

/* Tensor `name` of m: its role, group, dtype and shape (cols 0 for a vector). */
static void check_gguf_tensor(const struct manifest *m, uint32_t group, uint32_t role, const char *name, enum dtype dt,
			      uint64_t rows, uint64_t cols)
{
	int i = manifest_find_tensor(m, group, (enum tensor_role)role);
	ck_assert_msg(i >= 0, "no %s in group %u", tensor_role_name((enum tensor_role)role), group);
	const struct tensor_desc *t = &m->tensors[i];
	ck_assert_str_eq(t->name, name);
	ck_assert_uint_eq(t->dtype, dt);
	ck_assert_uint_eq(t->ndim, cols ? 2 : 1);
	ck_assert_uint_eq(t->shape[0], rows);
	ck_assert_uint_eq(t->shape[1], cols);
	ck_assert_uint_eq(t->nbytes, dtype_row_bytes(dt, cols ? cols : rows) * (cols ? rows : 1));
}

static void check_tiny(const struct manifest *m, enum dtype dt, bool tied)
{
	const struct model_config *c = &m->cfg;
	ck_assert_uint_eq(c->arch, ARCH_LLAMA);
	ck_assert_uint_eq(c->rope_layout, ROPE_ADJACENT);
	ck_assert_uint_eq(c->dim, 64);
	ck_assert_uint_eq(c->n_layers, 2);
	ck_assert_uint_eq(c->n_heads, 4);
	ck_assert_uint_eq(c->n_kv_heads, 2);
	ck_assert_uint_eq(c->head_dim, 16);
	ck_assert_uint_eq(c->ffn_dim, 192);
	ck_assert_uint_eq(c->vocab_size, 512);
	ck_assert_uint_eq(c->max_position, 2048);
	ck_assert_float_eq(c->rms_eps, 1e-5f);
	ck_assert_float_eq(c->rope_theta, 10000.0f);
	ck_assert_uint_eq(c->rope_scaling, ROPE_SCALING_NONE);
	ck_assert_uint_eq(c->tie_embeddings, tied);
	ck_assert_int_eq(c->bos_id, 1);
	ck_assert_uint_eq(c->n_eos, 1);
	ck_assert_int_eq(c->eos_ids[0], 2);
	ck_assert_uint_eq(m->n_groups, 6);
	ck_assert_uint_eq(m->n_tensors, 2 + 18 + !tied);
	check_gguf_tensor(m, 0, ROLE_EMBED, "token_embd.weight", dt, 512, 64);
	char name[64];
	for (uint32_t l = 0; l < 2; l++) {
		uint32_t ga = group_id_attn(l), gf = group_id_ffn(l);
#define T(g, role, suffix, type, r, cc)                                                                                \
	snprintf(name, sizeof(name), "blk.%u.%s", l, suffix);                                                          \
	check_gguf_tensor(m, g, role, name, type, r, cc)
		T(ga, ROLE_ATTN_NORM, "attn_norm.weight", DT_F32, 64, 0);
		T(ga, ROLE_WQ, "attn_q.weight", dt, 64, 64);
		T(ga, ROLE_WK, "attn_k.weight", dt, 32, 64);
		T(ga, ROLE_WV, "attn_v.weight", dt, 32, 64);
		T(ga, ROLE_WO, "attn_output.weight", dt, 64, 64);
		T(gf, ROLE_FFN_NORM, "ffn_norm.weight", DT_F32, 64, 0);
		T(gf, ROLE_W_GATE, "ffn_gate.weight", dt, 192, 64);
		T(gf, ROLE_W_UP, "ffn_up.weight", dt, 192, 64);
		T(gf, ROLE_W_DOWN, "ffn_down.weight", dt, 64, 192);
#undef T
	}
	check_gguf_tensor(m, 5, ROLE_FINAL_NORM, "output_norm.weight", DT_F32, 64, 0);
	if (tied) {
		ck_assert_uint_eq(m->groups[5].n_tensors, 1);
		ck_assert_int_eq(manifest_find_tensor(m, 5, ROLE_LM_HEAD), manifest_find_tensor(m, 0, ROLE_EMBED));
	} else {
		check_gguf_tensor(m, 5, ROLE_LM_HEAD, "output.weight", dt, 512, 64);
	}
	ck_assert_uint_eq(m->weight_dtype, dt);
	check_layout(m); /* every tensor's bytes, read through the extents, are the file's */
}

START_TEST(test_tiny)
{
	static const struct {
		uint32_t type;
		enum dtype dt;
	} types[] = {{GW_F32, DT_F32}, {GW_Q8_0, DT_Q8_0}, {GW_F16, DT_F16}, {GW_BF16, DT_BF16}};
	uint64_t hashes[4];
	for (size_t i = 0; i < 4; i++) {
		char name[32];
		snprintf(name, sizeof(name), "tiny-%zu.gguf", i);
		struct gw *w = tiny(types[i].type, NULL);
		const char *path = write_w(w, name);
		struct manifest *m = load_ok(path);
		check_tiny(m, types[i].dt, false);
		ck_assert_uint_eq(m->n_files, 1);
		ck_assert_str_eq(m->files[0].path, path);
		ck_assert_uint_eq(m->files[0].data_start, w->data_start);
		struct stat st;
		ck_assert_int_eq(stat(path, &st), 0);
		ck_assert_uint_eq(m->files[0].size, (uint64_t)st.st_size);
		ck_assert_ptr_null(m->tokenizer_json);
		ck_assert_ptr_nonnull(strstr(m->tokenizer_note, "no tokenizer"));
		ck_assert_ptr_null(m->chat_template);
		hashes[i] = m->hash;
		manifest_destroy(&m);
		manifest_destroy(&m);
		gw_free(&w);
	}
	ck_assert_uint_ne(hashes[0], hashes[1]);
	/* The same model again hashes the same. */
	struct manifest *m = load_ok(write_tiny_gguf("again.gguf", GW_F32));
	ck_assert_uint_eq(m->hash, hashes[0]);
	manifest_destroy(&m);
	/* A GGUF file whatever its name. */
	m = load_ok(write_tiny_gguf("weights.bin", GW_Q8_0));
	ck_assert_uint_eq(m->hash, hashes[1]);
	manifest_destroy(&m);
}
END_TEST

START_TEST(test_tied_and_defaults)
{
	struct gw *w = gw_new();
	w->skip[0] = "llama.vocab_size"; /* then the token table's rows say it */
	w->skip[1] = "tokenizer.ggml.eos_token_id";
	gw_tiny_llama(w, &(struct gw_llama){.type = GW_Q8_0, .tied = true});
	w->skip[0] = w->skip[1] = NULL;
	gw_u32(w, "tokenizer.ggml.eos_token_id", 2);
	gw_u32(w, "tokenizer.ggml.eot_token_id", 7);
	gw_u32(w, "tokenizer.ggml.eom_token_id", 2); /* the same as EOS: listed once */
	gw_str(w, "tokenizer.chat_template", "{{ messages }}");
	struct manifest *m = load_ok(write_w(w, "tied.gguf"));
	ck_assert_uint_eq(m->cfg.n_eos, 2);
	ck_assert_int_eq(m->cfg.eos_ids[0], 2);
	ck_assert_int_eq(m->cfg.eos_ids[1], 7);
	m->cfg.n_eos = 1; /* for check_tiny */
	check_tiny(m, DT_Q8_0, true);
	ck_assert_str_eq(m->chat_template, "{{ messages }}");
	ck_assert_str_eq(m->chat_template_note, "");
	manifest_destroy(&m);
	gw_free(&w);
	/* A template over 1 MiB is left out, with a note the loader logs. */
	w = gw_new();
	gw_tiny_llama(w, &(struct gw_llama){.type = GW_F32});
	char *huge = malloc(MANIFEST_MAX_CHAT_TEMPLATE + 2);
	ck_assert_ptr_nonnull(huge);
	memset(huge, 'x', MANIFEST_MAX_CHAT_TEMPLATE + 1);
	huge[MANIFEST_MAX_CHAT_TEMPLATE + 1] = 0;
	gw_str(w, "tokenizer.chat_template", huge);
	free(huge);
	m = load_ok(write_w(w, "huge-template.gguf"));
	ck_assert_ptr_null(m->chat_template);
	ck_assert_ptr_nonnull(strstr(m->chat_template_note, "longer than 1 MiB"));
	manifest_destroy(&m);
	gw_free(&w);
	/* The end-of-turn tokens are also found by their text, as llama.cpp finds them: a converted
	 * Llama 3.1 Instruct file names <|eot_id|> as its EOS id and nothing else. */
	w = gw_new();
	gw_tiny_llama(w, &(struct gw_llama){.type = GW_F32});
	static char names[512][16];
	const char *tokens[512];
	for (int i = 0; i < 512; i++) {
		snprintf(names[i], sizeof(names[i]), "t%d", i);
		tokens[i] = names[i];
	}
	tokens[7] = "<|eot_id|>";
	tokens[9] = "<|eom_id|>";
	tokens[11] = "<|eot_id|x"; /* not the text */
	gw_arr_str(w, "tokenizer.ggml.tokens", tokens, NULL, 512);
	m = load_ok(write_w(w, "eog.gguf"));
	ck_assert_uint_eq(m->cfg.n_eos, 3);
	ck_assert_int_eq(m->cfg.eos_ids[0], 2);
	ck_assert_int_eq(m->cfg.eos_ids[1], 7);
	ck_assert_int_eq(m->cfg.eos_ids[2], 9);
	manifest_destroy(&m);
	gw_free(&w);
	/* No special ids at all. */
	w = gw_new();
	gw_tiny_llama(w, &(struct gw_llama){.no_tokens_meta = true});
	m = load_ok(write_w(w, "noids.gguf"));
	ck_assert_int_eq(m->cfg.bos_id, -1);
	ck_assert_uint_eq(m->cfg.n_eos, 0);
	manifest_destroy(&m);
	gw_free(&w);
}
END_TEST

START_TEST(test_directory)
{
	const char *dir = tpath("d");
	ck_assert_int_eq(mkdir(dir, 0700), 0);
	write_tiny_gguf("d/model-Q8_0.gguf", GW_Q8_0);
	struct manifest *m = load_ok(dir);
	check_tiny(m, DT_Q8_0, false);
	ck_assert_str_eq(m->files[0].path, tpath("d/model-Q8_0.gguf"));
	manifest_destroy(&m);
	/* Two files that are not one split set: which one? */
	write_tiny_gguf("d/model-F32.gguf", GW_F32);
	load_fails(dir, -EINVAL, "not one split set: give the file to load");
	/* A safetensors checkpoint beside a GGUF file: the directory is the safetensors one. */
	const char *hf = write_tiny("hf");
	write_tiny_gguf("hf/extra.gguf", GW_F32);
	m = load_ok(hf);
	ck_assert_str_eq(m->tensors[0].name, "model.embed_tokens.weight");
	ck_assert_uint_eq(m->cfg.rope_layout, ROPE_HALVES);
	manifest_destroy(&m);
	/* A directory with neither: the Hugging Face message, as before. */
	const char *empty = tpath("empty");
	ck_assert_int_eq(mkdir(empty, 0700), 0);
	load_fails(empty, -ENOENT, "config.json");
}
END_TEST

/* The tiny model over n files named <prefix>-0000i-of-0000n.gguf in dir; skip_no: the file whose
 * split.no is written wrong (0: none); tensors_count: split.tensors.count (0: the right one). */
static void write_split(const char *prefix, uint32_t n, uint32_t type, uint32_t wrong_no, int32_t tensors_count)
{
	struct gw_llama o = {.type = type};
	uint32_t total = gw_tiny_llama_n_tensors(&o);
	for (uint32_t i = 0; i < n; i++) {
		struct gw *w = gw_new();
		if (i == 0)
			gw_tiny_llama_keys(w, &o);
		gw_u16(w, "split.no", (uint16_t)(i + 1 == wrong_no ? i + 1 : i));
		gw_u16(w, "split.count", (uint16_t)n);
		gw_i32(w, "split.tensors.count", tensors_count ? tensors_count : (int32_t)total);
		gw_tiny_llama_tensors(w, &o, total * i / n, total * (i + 1) / n);
		char name[128];
		snprintf(name, sizeof(name), "%s-%05u-of-%05u.gguf", prefix, i + 1, n);
		write_w(w, name);
		gw_free(&w);
	}
}

START_TEST(test_split)
{
	struct manifest *single = load_ok(write_tiny_gguf("single.gguf", GW_Q8_0));
	const char *dir = tpath("s");
	ck_assert_int_eq(mkdir(dir, 0700), 0);
	write_split("s/tiny", 3, GW_Q8_0, 0, 0);
	const char *paths[] = {tpath("s/tiny-00001-of-00003.gguf"), tpath("s/tiny-00002-of-00003.gguf"), dir};
	for (size_t k = 0; k < 3; k++) {
		struct manifest *m = load_ok(paths[k]);
		check_tiny(m, DT_Q8_0, false);
		ck_assert_uint_eq(m->n_files, 3);
		for (uint32_t i = 0; i < 3; i++) {
			char want[600];
			snprintf(want, sizeof(want), "%s/tiny-%05u-of-00003.gguf", dir, i + 1);
			ck_assert_str_eq(m->files[i].path, want);
		}
		/* The embedding is in the first file, the head in the last. */
		ck_assert_uint_eq(m->tensors[manifest_find_tensor(m, 0, ROLE_EMBED)].file_index, 0);
		ck_assert_uint_eq(m->tensors[manifest_find_tensor(m, 5, ROLE_LM_HEAD)].file_index, 2);
		ck_assert_uint_eq(m->hash, single->hash); /* the same model, however it is stored */
		manifest_destroy(&m);
	}
	manifest_destroy(&single);
	/* A file of the set missing. */
	ck_assert_int_eq(unlink(tpath("s/tiny-00003-of-00003.gguf")), 0);
	load_fails(paths[0], -ENOENT, "file 3 of the split set (3 files) is missing");
	/* The directory, with that file missing: which one, not "not one split set". */
	load_fails(tpath("s"), -ENOENT, "holds 2 of the 3 files of the split set tiny-*-of-00003.gguf: file 3 "
					"(tiny-00003-of-00003.gguf) is missing");
	/* A file that says it is another. */
	ck_assert_int_eq(mkdir(tpath("w"), 0700), 0);
	write_split("w/tiny", 3, GW_Q8_0, 2, 0);
	load_fails(tpath("w/tiny-00001-of-00003.gguf"), -EINVAL,
		   "split.no 2 and split.count 3, but the name makes it file 2");
	/* The count of tensors over the set. */
	ck_assert_int_eq(mkdir(tpath("c"), 0700), 0);
	write_split("c/tiny", 3, GW_Q8_0, 0, 20);
	load_fails(tpath("c/tiny-00001-of-00003.gguf"), -EINVAL, "split.tensors.count is 20, but the 3 files hold 21");
	/* A split file renamed out of the pattern: the others cannot be found. */
	ck_assert_int_eq(rename(tpath("c/tiny-00002-of-00003.gguf"), tpath("c/renamed.gguf")), 0);
	load_fails(tpath("c/renamed.gguf"), -EINVAL, "the other files of the set cannot be found");
	/* A tensor in two files of the set. */
	ck_assert_int_eq(mkdir(tpath("t"), 0700), 0);
	struct gw_llama o = {.type = GW_Q8_0};
	for (uint32_t i = 0; i < 2; i++) {
		struct gw *w = gw_new();
		if (i == 0)
			gw_tiny_llama_keys(w, &o);
		gw_u16(w, "split.no", (uint16_t)i);
		gw_u16(w, "split.count", 2);
		gw_tiny_llama_tensors(w, &o, i == 0 ? 0 : 10, i == 0 ? 11 : 21);
		write_w(w, i == 0 ? "t/x-00001-of-00002.gguf" : "t/x-00002-of-00002.gguf");
		gw_free(&w);
	}
	load_fails(tpath("t"), -EINVAL, "appears twice in the split set");
}
END_TEST

/* llama3 RoPE divisors as convert_hf_to_gguf.py (LlamaModel) computes them: float32 throughout. */
static void llama3_factors(float *out, uint32_t head_dim, float theta, float factor, float orig)
{
	const float low = 1.0f, high = 4.0f, low_wl = orig / low, high_wl = orig / high;
	for (uint32_t i = 0; i < head_dim / 2; i++) {
		float freq = 1.0f / powf(theta, (float)(2 * i) / (float)head_dim);
		float wl = (float)(2 * M_PI) / freq;
		if (wl < high_wl)
			out[i] = 1.0f;
		else if (wl > low_wl)
			out[i] = factor;
		else {
			float smooth = (orig / wl - low) / (high - low);
			out[i] = 1.0f / ((1 - smooth) / factor + smooth);
		}
	}
}

/* The tiny model with rope.freq_base 500000, rope_freqs.weight holding v (n values), extra keys
 * from fn. */
static const char *write_rope(const char *name, const float *v, uint32_t n, void (*fn)(struct gw *w))
{
	struct gw *w = gw_new();
	w->skip[0] = "llama.rope.freq_base";
	gw_tiny_llama(w, &(struct gw_llama){.type = GW_F32});
	w->skip[0] = NULL;
	gw_f32(w, "llama.rope.freq_base", 500000.0f);
	if (fn)
		fn(w);
	if (v) {
		uint64_t ne[1] = {n};
		gw_tensor(w, "rope_freqs.weight", GW_F32, 1, ne, v);
	}
	const char *path = write_w(w, name);
	gw_free(&w);
	return path;
}

static void orig_4096(struct gw *w)
{
	gw_u32(w, "llama.rope.scaling.original_context_length", 4096);
}

static void linear_2(struct gw *w)
{
	gw_str(w, "llama.rope.scaling.type", "linear");
	gw_f32(w, "llama.rope.scaling.factor", 2.0f);
}

static void yarn(struct gw *w)
{
	gw_str(w, "llama.rope.scaling.type", "yarn");
	gw_f32(w, "llama.rope.scaling.factor", 4.0f);
}

static void old_linear(struct gw *w)
{
	gw_f32(w, "llama.rope.scale_linear", 4.0f);
}

START_TEST(test_rope)
{
	float v[8];
	llama3_factors(v, 16, 500000.0f, 8.0f, 8192.0f);
	ck_assert_float_eq(v[0], 1.0f);
	ck_assert(v[4] > 1.0f && v[4] < 8.0f); /* one value in the smooth band */
	ck_assert_float_eq(v[7], 8.0f);
	struct manifest *m = load_ok(write_rope("l3.gguf", v, 8, NULL));
	ck_assert_uint_eq(m->cfg.rope_scaling, ROPE_SCALING_LLAMA3);
	ck_assert_float_eq(m->cfg.rope_factor, 8.0f);
	ck_assert_float_eq(m->cfg.rope_low_freq_factor, 1.0f);
	ck_assert_float_eq(m->cfg.rope_high_freq_factor, 4.0f);
	ck_assert_uint_eq(m->cfg.rope_original_max_position, 8192);
	ck_assert_float_eq(m->cfg.rope_theta, 500000.0f);
	ck_assert_uint_eq(m->n_tensors, 21); /* rope_freqs is not a weight that streams */
	manifest_destroy(&m);
	llama3_factors(v, 16, 500000.0f, 32.0f, 4096.0f);
	m = load_ok(write_rope("l3b.gguf", v, 8, orig_4096));
	ck_assert_float_eq(m->cfg.rope_factor, 32.0f);
	ck_assert_uint_eq(m->cfg.rope_original_max_position, 4096);
	manifest_destroy(&m);
	/* The right values with the wrong original context: refused, naming the value. */
	load_fails(write_rope("l3c.gguf", v, 8, NULL), -ENOTSUP, "rope_freqs.weight value 4 is");
	llama3_factors(v, 16, 500000.0f, 8.0f, 8192.0f);
	v[3] *= 1.001f;
	load_fails(write_rope("l3d.gguf", v, 8, NULL), -ENOTSUP, "rope_freqs.weight value 3 is 1.001");
	for (int i = 0; i < 8; i++)
		v[i] = 1.0f;
	m = load_ok(write_rope("ones.gguf", v, 8, NULL));
	ck_assert_uint_eq(m->cfg.rope_scaling, ROPE_SCALING_NONE);
	manifest_destroy(&m);
	load_fails(write_rope("short.gguf", v, 7, NULL), -EINVAL, "must hold 8 F32 values");
	v[2] = -1.0f;
	load_fails(write_rope("neg.gguf", v, 8, NULL), -EINVAL, "value 2 is -1");
	load_fails(write_rope("lin-freqs.gguf", v, 8, linear_2), -ENOTSUP, "linear RoPE scaling together");
	/* Linear, the old key, yarn. */
	m = load_ok(write_rope("lin.gguf", NULL, 0, linear_2));
	ck_assert_uint_eq(m->cfg.rope_scaling, ROPE_SCALING_LINEAR);
	ck_assert_float_eq(m->cfg.rope_factor, 2.0f);
	manifest_destroy(&m);
	m = load_ok(write_rope("old.gguf", NULL, 0, old_linear));
	ck_assert_uint_eq(m->cfg.rope_scaling, ROPE_SCALING_LINEAR);
	ck_assert_float_eq(m->cfg.rope_factor, 4.0f);
	manifest_destroy(&m);
	load_fails(write_rope("yarn.gguf", NULL, 0, yarn), -ENOTSUP,
		   "llama.rope.scaling.type \"yarn\" is not supported");
}
END_TEST

/* ---- refusals ---- */

/* The tiny model with `skip` left out and fn adding what replaces it. */
static const char *write_variant(const char *name, const char *skip, void (*fn)(struct gw *w))
{
	struct gw *w = tiny(GW_F32, skip);
	if (fn)
		fn(w);
	const char *path = write_w(w, name);
	gw_free(&w);
	return path;
}

static void arch_qwen(struct gw *w)
{
	gw_str(w, "general.architecture", "qwen2");
}
static void ffn_128(struct gw *w)
{
	gw_u32(w, "llama.feed_forward_length", 128);
}
static void experts(struct gw *w)
{
	gw_u32(w, "llama.expert_count", 8);
}
static void bos_600(struct gw *w)
{
	gw_u32(w, "tokenizer.ggml.bos_token_id", 600);
}
static void rope_dims_8(struct gw *w)
{
	gw_u32(w, "llama.rope.dimension_count", 8);
}
static void kv_heads_3(struct gw *w)
{
	gw_u32(w, "llama.attention.head_count_kv", 3);
}
static void q_bias(struct gw *w)
{
	uint64_t ne[1] = {64};
	gw_tensor(w, "blk.0.attn_q.bias", GW_F32, 1, ne, NULL);
}
static void q_q4_1(struct gw *w)
{
	uint64_t ne[2] = {64, 64};
	gw_tensor(w, "blk.0.attn_q.weight", GW_Q4_1, 2, ne, NULL);
}
static void q_transposed(struct gw *w)
{
	uint64_t ne[2] = {32, 64}; /* (64 rows of 32): attn_k's shape swapped */
	gw_tensor(w, "blk.1.attn_k.weight", GW_F32, 2, ne, NULL);
}
static void eps_string(struct gw *w)
{
	gw_str(w, "llama.attention.layer_norm_rms_epsilon", "1e-5");
}

START_TEST(test_refused)
{
	static const struct {
		const char *skip;
		void (*fn)(struct gw *w);
		int rc;
		const char *word;
	} cases[] = {
	    {"general.architecture", arch_qwen, -ENOTSUP,
	     "architecture \"qwen2\" is not supported (supported: llama, qwen3, qwen3moe)"},
	    {"llama.feed_forward_length", ffn_128, -EINVAL,
	     "tensor blk.0.ffn_gate.weight has shape [192, 64] (rows first), but the metadata implies [128, 64]"},
	    {NULL, experts, -EINVAL, "key llama.expert_used_count is missing (llama.expert_count is 8)"},
	    {"tokenizer.ggml.bos_token_id", bos_600, -EINVAL,
	     "tokenizer.ggml.bos_token_id 600 is outside the vocabulary (vocab_size 512)"},
	    {"llama.rope.dimension_count", rope_dims_8, -ENOTSUP, "partial rotary embeddings are not supported"},
	    {"llama.attention.head_count_kv", kv_heads_3, -EINVAL, "llama.attention.head_count_kv 3 must divide"},
	    {NULL, q_bias, -EINVAL, "unexpected tensor blk.0.attn_q.bias (not part of a 2-layer llama)"},
	    {"blk.0.attn_q.weight", q_q4_1, -ENOTSUP,
	     "tensor blk.0.attn_q.weight has type Q4_1, which is not supported (supported: F32, F16, BF16, Q8_0, "
	     "Q4_0, Q4_K, Q5_K, Q6_K)"},
	    {"blk.1.ffn_up.weight", NULL, -EINVAL,
	     "missing tensor blk.1.ffn_up.weight (the metadata: 2 layers, "
	     "untied embeddings)"},
	    {"blk.1.attn_k.weight", q_transposed, -EINVAL, "blk.1.attn_k.weight has shape [64, 32]"},
	    {"llama.block_count", NULL, -EINVAL, "key llama.block_count is missing"},
	    {"llama.attention.layer_norm_rms_epsilon", eps_string, -EINVAL,
	     "llama.attention.layer_norm_rms_epsilon is a string, expected a float32"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char name[32];
		snprintf(name, sizeof(name), "case%zu.gguf", i);
		const char *path = write_variant(name, cases[i].skip, cases[i].fn);
		char err[512] = "";
		struct manifest *m = (struct manifest *)0x1;
		int rc = manifest_load(path, &m, err, sizeof(err));
		ck_assert_msg(rc == cases[i].rc && !m && strstr(err, cases[i].word) && strstr(err, path),
			      "case %zu: rc %d \"%s\", wanted %d \"%s\"", i, rc, err, cases[i].rc, cases[i].word);
	}
}
END_TEST

START_TEST(test_corrupt)
{
	/* Not a GGUF file. */
	write_file(tpath("plain.bin"), "GGUX and more", 13);
	load_fails(tpath("plain.bin"), -ENOTDIR, "not a directory and not a GGUF file");
	/* An unsupported version. */
	struct gw *w = tiny(GW_F32, NULL);
	w->version = 4;
	load_fails(write_w(w, "v4.gguf"), -ENOTSUP, "GGUF version 4 is not supported");
	w->version = 3;
	/* Absurd counts. */
	w->n_tensors = 1ull << 33;
	load_fails(write_w(w, "count.gguf"), -EINVAL, "8589934592 tensors");
	w->n_tensors = GW_AUTO;
	/* A truncated header, and truncated data. */
	unsigned char *b;
	size_t len;
	gw_bytes(w, &b, &len);
	write_file(tpath("cut.gguf"), b, 300);
	load_fails(tpath("cut.gguf"), -EINVAL, "truncated");
	write_file(tpath("short.gguf"), b, len - 100);
	load_fails(tpath("short.gguf"), -EINVAL, "output.weight: its 131072 bytes at offset");
	/* An absurd string length: the first key's. */
	b[24] = 0xff, b[25] = 0xff, b[26] = 0xff, b[27] = 0x7f;
	write_file(tpath("strlen.gguf"), b, len);
	load_fails(tpath("strlen.gguf"), -EINVAL, "a key of");
	free(b);
	gw_free(&w);
	/* A misaligned offset. */
	w = tiny(GW_F32, NULL);
	w->t[3].offset = 16;
	load_fails(write_w(w, "align.gguf"), -EINVAL,
		   "tensor blk.0.attn_k.weight: offset 16 is not a multiple of the "
		   "alignment 32");
	gw_free(&w);
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
	    {"good", {test_tiny, test_tied_and_defaults, test_directory, test_split, test_rope, NULL}},
	    {"bad", {test_refused, test_corrupt, NULL}},
	};
	return run_cases("manifest_gguf", cases, ARRAY_SIZE(cases));
}

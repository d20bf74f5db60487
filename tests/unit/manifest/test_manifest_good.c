/* test_manifest_good.c - manifest_load on good synthetic checkpoints: one file and sharded, tied
 * and explicit head_dim, every dtype, multi-head attention, Mistral, the layout's invariants and
 * generation_config.json's ids. Each test writes under its own mkdtemp() directory in /tmp. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/unit/manifest/manifest_test_util.h"

START_TEST(test_tiny_single_file)
{
	const char *dir = write_tiny("tiny");
	struct manifest *m = load_ok(dir);
	const struct model_config *c = &m->cfg;
	ck_assert_uint_eq(c->arch, ARCH_LLAMA);
	ck_assert_uint_eq(c->dim, 64);
	ck_assert_uint_eq(c->n_layers, 2);
	ck_assert_uint_eq(c->n_heads, 4);
	ck_assert_uint_eq(c->n_kv_heads, 2);
	ck_assert_uint_eq(c->head_dim, 16);
	ck_assert_uint_eq(c->ffn_dim, 192);
	ck_assert_uint_eq(c->vocab_size, 512);
	ck_assert_uint_eq(c->max_position, 4096);
	ck_assert_float_eq(c->rms_eps, 1e-5f);
	ck_assert_float_eq(c->rope_theta, 500000.0f);
	ck_assert_uint_eq(c->rope_scaling, ROPE_SCALING_LLAMA3);
	ck_assert_float_eq(c->rope_factor, 8.0f);
	ck_assert_float_eq(c->rope_low_freq_factor, 1.0f);
	ck_assert_float_eq(c->rope_high_freq_factor, 4.0f);
	ck_assert_uint_eq(c->rope_original_max_position, 8192);
	ck_assert_uint_eq(c->tie_embeddings, 0);
	ck_assert_int_eq(c->bos_id, 1);
	ck_assert_uint_eq(c->n_eos, 1);
	ck_assert_int_eq(c->eos_ids[0], 2);
	ck_assert_uint_eq(c->sliding_window, 0);
	ck_assert_uint_eq(m->n_files, 1);
	ck_assert_uint_eq(m->weight_dtype, DT_BF16);
	ck_assert_str_eq(m->files[0].path, tpath("tiny/model.safetensors"));
	ck_assert_uint_eq(m->files[0].data_start % 8, 0);
	check_all_tensors(m);
	check_layout(m);
	ck_assert_uint_eq(m->total_tensor_bytes, synth_param_count(c, false) * 2);
	manifest_destroy(&m);
	ck_assert_ptr_null(m);
	manifest_destroy(&m); /* twice is fine */
}
END_TEST

START_TEST(test_sharded_same_as_single)
{
	struct model_config c = tiny_cfg();
	struct synth_options o1 = opts(DT_BF16, 3, 1), o3 = opts(DT_BF16, 3, 3), os = opts(DT_BF16, 3, 0);
	os.shard_bytes = 40000; /* transformers-style splitting at a size: many files */
	struct manifest *a = load_ok(write_model("one", &c, &o1));
	struct manifest *b = load_ok(write_model("three", &c, &o3));
	struct manifest *s = load_ok(write_model("small", &c, &os));
	ck_assert_uint_eq(a->n_files, 1);
	ck_assert_uint_eq(b->n_files, 3);
	ck_assert_uint_gt(s->n_files, 3);
	ck_assert_str_eq(b->files[0].path, tpath("three/model-00001-of-00003.safetensors"));
	ck_assert_str_eq(b->files[2].path, tpath("three/model-00003-of-00003.safetensors"));
	ck_assert_uint_eq(a->hash, b->hash);
	ck_assert_uint_eq(a->hash, s->hash);
	/* Another checkpoint of the same shape and types (other weights): another hash, so that
	 * neither takes the other's cached or persisted KV. */
	struct synth_options o4 = opts(DT_BF16, 4, 1);
	struct manifest *d = load_ok(write_model("other", &c, &o4));
	ck_assert_uint_ne(a->hash, d->hash);
	manifest_destroy(&d);
	ck_assert_mem_eq(&a->cfg, &b->cfg, sizeof(a->cfg));
	ck_assert_uint_eq(a->n_tensors, b->n_tensors);
	ck_assert_uint_eq(a->total_tensor_bytes, b->total_tensor_bytes);
	/* Every shard holds something. */
	for (uint32_t f = 0; f < b->n_files; f++) {
		int used = 0;
		for (uint32_t i = 0; i < b->n_tensors; i++)
			used |= b->tensors[i].file_index == f;
		ck_assert_msg(used, "shard %u is empty", f);
	}
	for (uint32_t i = 0; i < a->n_tensors; i++) {
		const struct tensor_desc *ta = &a->tensors[i], *tb = &b->tensors[i], *ts = &s->tensors[i];
		ck_assert_str_eq(ta->name, tb->name);
		ck_assert_str_eq(ta->name, ts->name);
		ck_assert_uint_eq(ta->group, tb->group);
		ck_assert_uint_eq(ta->role, tb->role);
		ck_assert_uint_eq(ta->nbytes, tb->nbytes);
		void *x = tensor_bytes(a, ta), *y = tensor_bytes(b, tb), *z = tensor_bytes(s, ts);
		ck_assert_msg(memcmp(x, y, ta->nbytes) == 0 && memcmp(x, z, ta->nbytes) == 0,
			      "tensor %s differs between single file and shards", ta->name);
		free(x);
		free(y);
		free(z);
	}
	check_all_tensors(b);
	check_layout(b);
	check_layout(s);
	manifest_destroy(&a);
	manifest_destroy(&b);
	manifest_destroy(&s);
}
END_TEST

START_TEST(test_tied_explicit_head_dim)
{
	struct model_config c = tiny_cfg();
	c.head_dim = 32; /* n_heads * head_dim = 128 != dim 64, as some models have */
	struct synth_options o = opts(DT_BF16, 1, 0);
	o.tied = true;
	struct manifest *m = load_ok(write_model("tied", &c, &o));
	ck_assert_uint_eq(m->cfg.tie_embeddings, 1);
	ck_assert_uint_eq(m->cfg.head_dim, 32);
	check_all_tensors(m);
	check_layout(m);
	check_tensor(m, manifest_find_tensor(m, group_id_attn(0), ROLE_WQ), "model.layers.0.self_attn.q_proj.weight",
		     ROLE_WQ, 128, 64);
	check_tensor(m, manifest_find_tensor(m, group_id_attn(1), ROLE_WO), "model.layers.1.self_attn.o_proj.weight",
		     ROLE_WO, 64, 128);
	/* The runner's lookup over plain copies of the tables agrees. */
	struct tensor_desc *tt = malloc(m->n_tensors * sizeof(*tt));
	struct group_desc *gg = malloc(m->n_groups * sizeof(*gg));
	memcpy(tt, m->tensors, m->n_tensors * sizeof(*tt));
	memcpy(gg, m->groups, m->n_groups * sizeof(*gg));
	ck_assert_int_eq(model_find_tensor(&m->cfg, tt, gg, group_id_head(&m->cfg), ROLE_LM_HEAD), 0);
	ck_assert_int_eq(model_find_tensor(&m->cfg, tt, gg, group_id_ffn(1), ROLE_W_DOWN),
			 manifest_find_tensor(m, group_id_ffn(1), ROLE_W_DOWN));
	ck_assert_int_eq(model_find_tensor(&m->cfg, tt, gg, group_id_attn(0), ROLE_LM_HEAD), -1);
	free(tt);
	free(gg);

	manifest_destroy(&m);
	/* Untie the config of a tied checkpoint: lm_head is now missing. */
	set_config(tpath("tied"), "config.json", "tie_word_embeddings", "false");
	load_fails(tpath("tied"), -EINVAL, "missing tensor lm_head.weight");

	/* An untied checkpoint whose config says tied: the stored lm_head is ignored. */
	struct synth_options ou = opts(DT_BF16, 1, 0);
	const char *dir = write_model("untied", &c, &ou);
	set_config(dir, "config.json", "tie_word_embeddings", "true");
	m = load_ok(dir);
	ck_assert_uint_eq(m->groups[group_id_head(&m->cfg)].n_tensors, 1);
	ck_assert_int_eq(manifest_find_tensor(m, group_id_head(&m->cfg), ROLE_LM_HEAD), 0);
	check_layout(m);
	manifest_destroy(&m);
}
END_TEST

/* f16 and f32 files hold the same draws as bf16, rounded to their type. */
START_TEST(test_f16_f32)
{
	struct model_config c = tiny_cfg();
	static const enum dtype types[] = {DT_F16, DT_F32, DT_BF16};
	for (size_t k = 0; k < sizeof(types) / sizeof(types[0]); k++) {
		struct synth_options o = opts(types[k], 9, k == 1 ? 2 : 0);
		char name[32];
		snprintf(name, sizeof(name), "dt%zu", k);
		struct manifest *m = load_ok(write_model(name, &c, &o));
		ck_assert_uint_eq(m->weight_dtype, types[k]);
		ck_assert_uint_eq(m->total_tensor_bytes, synth_param_count(&c, false) * dtype_size(types[k]));
		check_all_tensors(m);
		check_layout(m);
		for (uint32_t i = 0; i < m->n_tensors; i++) {
			const struct tensor_desc *t = &m->tensors[i];
			ck_assert_uint_eq(t->dtype, types[k]);
			bool norm = t->ndim == 1;
			void *b = tensor_bytes(m, t);
			uint64_t n = t->nbytes / dtype_size(types[k]);
			for (uint64_t e = 0; e < n; e += 1 + e / 3) {
				float want = synth_value(9, t->name, norm, e), got = dtype_get_f32(types[k], b, e);
				float tol = types[k] == DT_F32	 ? 0
					    : types[k] == DT_F16 ? 1e-3f * fabsf(want) + 1e-7f
								 : 8e-3f * fabsf(want);
				ck_assert_msg(fabsf(got - want) <= tol, "%s[%llu] = %g, want %g", t->name,
					      (unsigned long long)e, (double)got, (double)want);
			}
			free(b);
		}
		manifest_destroy(&m);
	}
}
END_TEST

/* Files larger than the writer's 8 MiB buffers: tensors split across buffers at odd element
 * positions still hold exactly synth_value's draws, in every element. */
START_TEST(test_values_across_buffers)
{
	struct model_config c = tiny_cfg();
	c.vocab_size = 40000; /* 2 x 40000 x 64 elements: 10 MB in BF16, 20 MB in F32 */
	static const enum dtype types[] = {DT_BF16, DT_F32};
	for (size_t k = 0; k < 2; k++) {
		struct synth_options o = opts(types[k], 77, 0);
		char name[32];
		snprintf(name, sizeof(name), "big%zu", k);
		struct manifest *m = load_ok(write_model(name, &c, &o));
		ck_assert_uint_gt(m->files[0].size, 9u << 20);
		uint64_t mismatches = 0;
		for (uint32_t i = 0; i < m->n_tensors; i++) {
			const struct tensor_desc *t = &m->tensors[i];
			void *b = tensor_bytes(m, t);
			uint64_t n = t->nbytes / dtype_size(t->dtype);
			for (uint64_t e = 0; e < n; e++) {
				float v = synth_value(77, t->name, t->ndim == 1, e);
				if (types[k] == DT_F32)
					mismatches += ((float *)b)[e] != v;
				else
					mismatches += ((uint16_t *)b)[e] != f32_to_bf16(v);
			}
			free(b);
		}
		ck_assert_uint_eq(mismatches, 0);
		manifest_destroy(&m);
	}
}
END_TEST

START_TEST(test_mha)
{
	struct model_config c = tiny_cfg();
	c.n_kv_heads = c.n_heads;
	struct synth_options o = opts(DT_BF16, 2, 0);
	struct manifest *m = load_ok(write_model("mha", &c, &o));
	ck_assert_uint_eq(m->cfg.n_kv_heads, 4);
	check_all_tensors(m);
	check_tensor(m, manifest_find_tensor(m, group_id_attn(1), ROLE_WK), "model.layers.1.self_attn.k_proj.weight",
		     ROLE_WK, 64, 64);
	check_layout(m);
	manifest_destroy(&m);
	/* num_key_value_heads left out means MHA too. */
	set_config(tpath("mha"), "config.json", "num_key_value_heads", NULL);
	m = load_ok(tpath("mha"));
	ck_assert_uint_eq(m->cfg.n_kv_heads, 4);
	manifest_destroy(&m);
}
END_TEST

START_TEST(test_mistral)
{
	struct model_config c = tiny_cfg();
	c.arch = ARCH_MISTRAL;
	c.sliding_window = 4096;
	c.rope_scaling = ROPE_SCALING_NONE;
	c.rope_theta = 10000.0f;
	struct synth_options o = opts(DT_BF16, 4, 0);
	const char *dir = write_model("mistral", &c, &o);
	struct manifest *m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.arch, ARCH_MISTRAL);
	ck_assert_uint_eq(m->cfg.sliding_window, 4096);
	ck_assert_uint_eq(m->cfg.rope_scaling, ROPE_SCALING_NONE);
	ck_assert_float_eq(m->cfg.rope_theta, 10000.0f);
	check_all_tensors(m);
	manifest_destroy(&m);
	/* rope_scaling "default" and a linear one with the old "type" key. */
	set_config(dir, "config.json", "rope_scaling", "{\"rope_type\": \"default\"}");
	m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.rope_scaling, ROPE_SCALING_NONE);
	manifest_destroy(&m);
	set_config(dir, "config.json", "rope_scaling", "{\"type\": \"linear\", \"factor\": 2.0}");
	m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.rope_scaling, ROPE_SCALING_LINEAR);
	ck_assert_float_eq(m->cfg.rope_factor, 2.0f);
	manifest_destroy(&m);
	/* Defaults: rope_theta 10000, no head_dim key -> dim / heads. */
	set_config(dir, "config.json", "rope_theta", NULL);
	set_config(dir, "config.json", "head_dim", NULL);
	m = load_ok(dir);
	ck_assert_float_eq(m->cfg.rope_theta, 10000.0f);
	ck_assert_uint_eq(m->cfg.head_dim, 16);
	manifest_destroy(&m);
}
END_TEST

/* Larger tensors than tiny's: extents that merge, extents that do not, shards, and a
 * stray inv_freq buffer that is ignored. */
START_TEST(test_layout_invariants)
{
	struct model_config c = tiny_cfg();
	c.dim = 256;
	c.n_heads = 8;
	c.n_kv_heads = 2;
	c.head_dim = 32;
	c.ffn_dim = 704;
	c.vocab_size = 1000;
	c.n_layers = 3;
	for (uint32_t shards = 0; shards <= 4; shards += 4) {
		struct synth_options o = opts(shards ? DT_F32 : DT_BF16, 5, shards);
		char name[32];
		snprintf(name, sizeof(name), "big%u", shards);
		const char *dir = write_model(name, &c, &o);
		struct manifest *m = load_ok(dir);
		ck_assert_uint_eq(m->n_files, shards ? shards : 1);
		check_all_tensors(m);
		check_layout(m);
		/* Some group needs more than one extent and some extent covers more than one tensor. */
		uint32_t multi_ext = 0, merged = 0;
		for (uint32_t g = 0; g < m->n_groups; g++) {
			multi_ext += m->groups[g].n_extents > 1;
			merged += m->groups[g].n_extents < m->groups[g].n_tensors;
		}
		ck_assert_uint_gt(multi_ext, 0);
		ck_assert_uint_gt(merged, 0);
		manifest_destroy(&m);
	}
	/* An old export's rotary inv_freq buffer is skipped. */
	const char *dir = tpath("big0");
	struct tensor_patch p = {"model.layers.2.self_attn.k_proj.weight", NULL, NULL,
				 "model.layers.2.self_attn.rotary_emb.inv_freq"};
	tensor_patch(dir, "model.safetensors", p);
	load_fails(dir, -EINVAL, "missing tensor model.layers.2.self_attn.k_proj.weight");
}
END_TEST

START_TEST(test_generation_config_eos)
{
	const char *dir = write_tiny("gen");
	set_config(dir, "generation_config.json", "eos_token_id", "[2, 7, 9]");
	set_config(dir, "generation_config.json", "bos_token_id", "5");
	struct manifest *m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.n_eos, 3);
	ck_assert_int_eq(m->cfg.eos_ids[0], 2);
	ck_assert_int_eq(m->cfg.eos_ids[1], 7);
	ck_assert_int_eq(m->cfg.eos_ids[2], 9);
	ck_assert_int_eq(m->cfg.bos_id, 5);
	uint64_t h = m->hash;
	manifest_destroy(&m);
	/* A single id, and no generation_config.json at all: config.json's ids. */
	set_config(dir, "generation_config.json", "eos_token_id", "11");
	m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.n_eos, 1);
	ck_assert_int_eq(m->cfg.eos_ids[0], 11);
	ck_assert_uint_ne(m->hash, h); /* the hash covers the config */
	manifest_destroy(&m);
	ck_assert_int_eq(unlink(tpath("gen/generation_config.json")), 0);
	set_config(dir, "config.json", "eos_token_id", "[3, 4]");
	m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.n_eos, 2);
	ck_assert_int_eq(m->cfg.eos_ids[1], 4);
	ck_assert_int_eq(m->cfg.bos_id, 1);
	manifest_destroy(&m);
	set_config(dir, "config.json", "eos_token_id", "[1,2,3,4,5,6,7,8,9]");
	load_fails(dir, -EINVAL, "eos_token_id");
	set_config(dir, "config.json", "eos_token_id", "512");
	load_fails(dir, -EINVAL, "eos_token_id");

	/* The Llama 3 ids as the synthetic writer puts them in both files. */
	struct model_config c;
	char err[256];
	ck_assert_int_eq(synth_shape_config("llama3-8b", &c, err, sizeof(err)), 0);
	c.n_layers = 1;
	c.dim = 32;
	c.n_heads = 2;
	c.n_kv_heads = 1;
	c.head_dim = 16;
	c.ffn_dim = 64;
	struct synth_options o = opts(DT_BF16, 1, 0);
	o.tied = true;
	m = load_ok(write_model("l3ids", &c, &o));
	ck_assert_uint_eq(m->cfg.n_eos, 3);
	ck_assert_int_eq(m->cfg.eos_ids[0], 128001);
	ck_assert_int_eq(m->cfg.eos_ids[1], 128008);
	ck_assert_int_eq(m->cfg.eos_ids[2], 128009);
	ck_assert_int_eq(m->cfg.bos_id, 128000);
	manifest_destroy(&m);
}
END_TEST

/* The chat template of a Hugging Face directory: chat_template.jinja first, else
 * tokenizer_config.json's chat_template (a string, or the "default" of a list); a file given
 * instead; and the refusals. */
START_TEST(test_chat_template)
{
	const char *dir = write_tiny("chat");
	struct manifest *m = load_ok(dir);
	ck_assert_ptr_null(m->chat_template);
	manifest_destroy(&m);
	write_file(tpath("chat/tokenizer_config.json"), "{\"chat_template\": \"{{ a }}\"}", 28);
	m = load_ok(dir);
	ck_assert_str_eq(m->chat_template, "{{ a }}");
	ck_assert_str_eq(m->chat_template_from, tpath("chat/tokenizer_config.json"));
	manifest_destroy(&m);
	const char *named = "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}, "
			    "{\"name\": \"default\", \"template\": \"D\"}]}";
	write_file(tpath("chat/tokenizer_config.json"), named, strlen(named));
	m = load_ok(dir);
	ck_assert_str_eq(m->chat_template, "D");
	manifest_destroy(&m);
	write_file(tpath("chat/chat_template.jinja"), "{{ b }}\n", 8);
	m = load_ok(dir);
	ck_assert_str_eq(m->chat_template, "{{ b }}\n"); /* the file wins */
	ck_assert_str_eq(m->chat_template_from, tpath("chat/chat_template.jinja"));
	/* a file given instead */
	char err[512];
	write_file(tpath("other.jinja"), "{{ c }}", 7);
	ck_assert_int_eq(manifest_attach_chat_template(m, tpath("other.jinja"), err, sizeof(err)), 0);
	ck_assert_str_eq(m->chat_template, "{{ c }}");
	ck_assert_int_eq(manifest_attach_chat_template(m, tpath("missing.jinja"), err, sizeof(err)), -ENOENT);
	ck_assert_ptr_nonnull(strstr(err, "missing.jinja"));
	write_file(tpath("nul.jinja"), "a\0b", 3);
	ck_assert_int_eq(manifest_attach_chat_template(m, tpath("nul.jinja"), err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "NUL"));
	ck_assert_str_eq(m->chat_template, "{{ c }}"); /* kept */
	manifest_destroy(&m);
	/* refused: a chat_template of another type, a tokenizer_config.json that is not JSON */
	ck_assert_int_eq(unlink(tpath("chat/chat_template.jinja")), 0);
	write_file(tpath("chat/tokenizer_config.json"), "{\"chat_template\": 7}", 20);
	load_fails(dir, -EINVAL, "neither a string nor a list");
	write_file(tpath("chat/tokenizer_config.json"), "{oops", 5);
	load_fails(dir, -EINVAL, "tokenizer_config.json");
	/* a list without a default, or a null: no template */
	write_file(tpath("chat/tokenizer_config.json"), "{\"chat_template\": null}", 23);
	m = load_ok(dir);
	ck_assert_ptr_null(m->chat_template);
	manifest_destroy(&m);
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
		{"good",
		 {test_tiny_single_file, test_sharded_same_as_single, test_tied_explicit_head_dim, test_f16_f32,
		  test_values_across_buffers, test_mha, test_mistral, NULL}},
		{"layout", {test_layout_invariants, NULL}},
		{"generation_config", {test_generation_config_eos, NULL}},
		{"chat_template", {test_chat_template, NULL}},
	};
	return run_cases("manifest_good", cases, ARRAY_SIZE(cases));
}

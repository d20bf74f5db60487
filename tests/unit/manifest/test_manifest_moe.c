/* test_manifest_moe.c - Qwen3 (q/k norms) and the mixture-of-experts checkpoints (Mixtral,
 * Qwen3-MoE): the synthetic shapes, their configs read back, the group table with one group per
 * expert, every tensor's name, role, shape and group, and the variants and damage refused. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "tests/unit/manifest/manifest_test_util.h"

static struct model_config shape(const char *spec)
{
	struct model_config c;
	char err[256];
	ck_assert_msg(synth_shape_config(spec, &c, err, sizeof(err)) == 0, "%s: %s", spec, err);
	ck_assert_msg(model_config_check(&c, err, sizeof(err)) == 0, "%s: %s", spec, err);
	return c;
}

static const char *write_shape(const char *name, const char *spec, uint32_t shards)
{
	struct model_config c = shape(spec);
	struct synth_options o = opts(DT_BF16, 3, shards);
	return write_model(name, &c, &o);
}

START_TEST(test_shapes)
{
	/* The published parameter counts of the full models. */
	struct model_config c = shape("mixtral-8x7b");
	ck_assert_uint_eq(synth_param_count(&c, false), 46702792704ull);
	ck_assert_uint_eq(c.n_layers, 32);
	c = shape("qwen3-30b-a3b");
	ck_assert_uint_eq(synth_param_count(&c, false), 30532122624ull);
	ck_assert_uint_eq(c.n_experts, 128);
	ck_assert_uint_eq(c.n_experts_used, 8);
	ck_assert_uint_eq(c.flags, MODEL_QK_NORM | MODEL_NORM_TOPK);
	c = shape("qwen3-30b-a3b:2");
	ck_assert_uint_eq(c.n_layers, 2);
	c = shape("mixtral-8x7b:1");
	ck_assert_uint_eq(c.n_layers, 1);
	ck_assert_uint_eq(model_n_groups(&c), 2 + 10);
	c = shape("qwen3-tiny");
	ck_assert_uint_eq(c.arch, ARCH_QWEN3);
	ck_assert_uint_eq(c.n_experts, 0);
	ck_assert_uint_eq(model_n_groups(&c), 2 + 2 * c.n_layers);
	c = shape("mixtral-tiny");
	ck_assert_uint_eq(c.expert_ffn_dim, c.ffn_dim);
	c = shape("qwen3-moe-tiny");
	ck_assert_uint_eq(c.n_experts, 8);
	char err[256];
	static const char *const bad[] = {"mixtral-8x7b:0", "mixtral-8x7b:33", "qwen3-30b-a3b:49", "qwen3-30b-a3b:",
					  "mixtral-tinyx", "qwen3"};
	for (size_t i = 0; i < ARRAY_SIZE(bad); i++) {
		err[0] = 0;
		ck_assert_int_eq(synth_shape_config(bad[i], &c, err, sizeof(err)), -EINVAL);
		ck_assert_msg(strlen(err) > 0, "no message for %s", bad[i]);
	}
	/* GGUF of a mixture of experts: Q8_0 needs rows of whole blocks (Qwen3-MoE's experts of 48 have
	 * none; test_manifest_gguf_moe reads the files). */
	c = shape("qwen3-moe-tiny");
	struct synth_options o = opts(DT_BF16, 1, 0);
	o.format = SYNTH_GGUF;
	o.gguf_type = SYNTH_GGUF_Q8_0;
	ck_assert_int_eq(synth_write(tpath("g"), &c, &o, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "ffn_down_exps"));
	/* The checks of the expert fields. */
	c = shape("mixtral-tiny");
	c.n_experts_used = 9;
	ck_assert_int_eq(model_config_check(&c, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "num_experts_per_tok"));
	c = shape("qwen3-tiny");
	c.n_experts = 4;
	ck_assert_int_eq(model_config_check(&c, err, sizeof(err)), -EINVAL);
	c = shape("mixtral-tiny");
	c.flags |= MODEL_QK_NORM;
	ck_assert_int_eq(model_config_check(&c, err, sizeof(err)), -EINVAL);
}
END_TEST

/* Layer l's tensor of role at name "model.layers.<l>.<suffix>" in group g. */
static void check_layer_tensor(const struct manifest *m, uint32_t g, uint32_t l, enum tensor_role role,
			       const char *suffix, uint64_t r, uint64_t c)
{
	char name[128];
	snprintf(name, sizeof(name), "model.layers.%u.%s", l, suffix);
	check_tensor(m, manifest_find_tensor(m, g, role), name, role, r, c);
}

/* The whole table of a Qwen3, Mixtral or Qwen3-MoE checkpoint. */
static void check_model(const struct manifest *m)
{
	const struct model_config *c = &m->cfg;
	bool qk = c->flags & MODEL_QK_NORM, mixtral = c->arch == ARCH_MIXTRAL;
	uint64_t q = (uint64_t)c->n_heads * c->head_dim, kv = (uint64_t)c->n_kv_heads * c->head_dim;
	uint32_t E = c->n_experts;
	ck_assert_uint_eq(m->n_groups, 2 + (2 + E) * c->n_layers);
	ck_assert_uint_eq(m->n_tensors, 2 + c->n_layers * (5 + (qk ? 2 : 0) + (E ? 2 + 3 * E : 4)) +
						(c->tie_embeddings ? 0 : 1));
	char err[256];
	ck_assert_int_eq(model_groups_check(c, m->groups, m->n_groups, err, sizeof(err)), 0);
	for (uint32_t l = 0; l < c->n_layers; l++) {
		uint32_t ga = model_group_attn(c, l), gf = model_group_ffn(c, l);
		ck_assert_uint_eq(m->groups[ga].kind, GROUP_ATTN);
		ck_assert_uint_eq(m->groups[ga].layer, l);
		ck_assert_uint_eq(m->groups[ga].n_tensors, qk ? 7 : 5);
		check_layer_tensor(m, ga, l, ROLE_ATTN_NORM, "input_layernorm.weight", c->dim, 0);
		check_layer_tensor(m, ga, l, ROLE_WQ, "self_attn.q_proj.weight", q, c->dim);
		check_layer_tensor(m, ga, l, ROLE_WK, "self_attn.k_proj.weight", kv, c->dim);
		check_layer_tensor(m, ga, l, ROLE_WV, "self_attn.v_proj.weight", kv, c->dim);
		check_layer_tensor(m, ga, l, ROLE_WO, "self_attn.o_proj.weight", c->dim, q);
		if (qk) {
			check_layer_tensor(m, ga, l, ROLE_Q_NORM, "self_attn.q_norm.weight", c->head_dim, 0);
			check_layer_tensor(m, ga, l, ROLE_K_NORM, "self_attn.k_norm.weight", c->head_dim, 0);
		} else {
			ck_assert_int_eq(manifest_find_tensor(m, ga, ROLE_Q_NORM), -1);
		}
		check_layer_tensor(m, gf, l, ROLE_FFN_NORM, "post_attention_layernorm.weight", c->dim, 0);
		ck_assert_uint_eq(m->groups[gf].layer, l);
		if (!E) {
			ck_assert_uint_eq(m->groups[gf].kind, GROUP_FFN);
			check_layer_tensor(m, gf, l, ROLE_W_GATE, "mlp.gate_proj.weight", c->ffn_dim, c->dim);
			check_layer_tensor(m, gf, l, ROLE_W_UP, "mlp.up_proj.weight", c->ffn_dim, c->dim);
			check_layer_tensor(m, gf, l, ROLE_W_DOWN, "mlp.down_proj.weight", c->dim, c->ffn_dim);
			continue;
		}
		ck_assert_uint_eq(m->groups[gf].kind, GROUP_MOE);
		ck_assert_uint_eq(m->groups[gf].size_class, CLASS_FFN);
		ck_assert_uint_eq(m->groups[gf].n_tensors, 2);
		check_layer_tensor(m, gf, l, ROLE_ROUTER, mixtral ? "block_sparse_moe.gate.weight" : "mlp.gate.weight", E,
				   c->dim);
		for (uint32_t e = 0; e < E; e++) {
			uint32_t ge = model_group_expert(c, l, e);
			const struct group_desc *g = &m->groups[ge];
			ck_assert_uint_eq(g->kind, GROUP_EXPERT);
			ck_assert_uint_eq(g->size_class, CLASS_EXPERT);
			ck_assert_uint_eq(g->layer, l);
			ck_assert_uint_eq(g->expert, e);
			ck_assert_uint_eq(g->n_tensors, 3);
			ck_assert_uint_eq(g->tensor_bytes, 3 * (uint64_t)c->dim * c->expert_ffn_dim * 2);
			/* Mixtral: w1 gate, w3 up, w2 down. */
			char s[96];
			const char *pre = mixtral ? "block_sparse_moe" : "mlp";
			snprintf(s, sizeof(s), "%s.experts.%u.%s.weight", pre, e, mixtral ? "w1" : "gate_proj");
			check_layer_tensor(m, ge, l, ROLE_EXPERT_GATE, s, c->expert_ffn_dim, c->dim);
			snprintf(s, sizeof(s), "%s.experts.%u.%s.weight", pre, e, mixtral ? "w3" : "up_proj");
			check_layer_tensor(m, ge, l, ROLE_EXPERT_UP, s, c->expert_ffn_dim, c->dim);
			snprintf(s, sizeof(s), "%s.experts.%u.%s.weight", pre, e, mixtral ? "w2" : "down_proj");
			check_layer_tensor(m, ge, l, ROLE_EXPERT_DOWN, s, c->dim, c->expert_ffn_dim);
			ck_assert_int_eq(manifest_find_tensor(m, ge, ROLE_W_GATE), -1);
		}
	}
	uint32_t gh = group_id_head(c);
	ck_assert_uint_eq(m->groups[gh].kind, GROUP_HEAD);
	check_tensor(m, manifest_find_tensor(m, gh, ROLE_FINAL_NORM), "model.norm.weight", ROLE_FINAL_NORM, c->dim, 0);
	if (c->tie_embeddings)
		ck_assert_int_eq(manifest_find_tensor(m, gh, ROLE_LM_HEAD), manifest_find_tensor(m, 0, ROLE_EMBED));
	else
		check_tensor(m, manifest_find_tensor(m, gh, ROLE_LM_HEAD), "lm_head.weight", ROLE_LM_HEAD,
			     c->vocab_size, c->dim);
	ck_assert_uint_gt(m->class_bytes[CLASS_ATTN], 0);
	if (E)
		ck_assert_uint_gt(m->class_bytes[CLASS_EXPERT], 0);
	else
		ck_assert_uint_eq(m->class_bytes[CLASS_EXPERT], 0);
	check_layout(m);
}

START_TEST(test_read_back)
{
	static const char *const specs[] = {"qwen3-tiny", "mixtral-tiny", "qwen3-moe-tiny"};
	for (size_t i = 0; i < ARRAY_SIZE(specs); i++) {
		for (uint32_t shards = 0; shards <= 3; shards += 3) {
			const char *dir = write_shape(tpath("%s-%u", specs[i], shards), specs[i], shards);
			struct manifest *m = load_ok(dir);
			struct model_config want = shape(specs[i]);
			const struct model_config *c = &m->cfg;
			ck_assert_uint_eq(c->arch, want.arch);
			ck_assert_uint_eq(c->n_experts, want.n_experts);
			ck_assert_uint_eq(c->n_experts_used, want.n_experts_used);
			ck_assert_uint_eq(c->expert_ffn_dim, want.expert_ffn_dim);
			ck_assert_uint_eq(c->flags, want.flags);
			ck_assert_uint_eq(c->head_dim, want.head_dim);
			ck_assert_uint_eq(c->tie_embeddings, want.tie_embeddings);
			ck_assert_uint_eq(c->sliding_window, 0);
			check_model(m);
			manifest_destroy(&m);
		}
	}
	/* Qwen3-MoE without norm_topk_prob (its default when absent). */
	const char *dir = write_shape(tpath("nonorm"), "qwen3-moe-tiny", 0);
	set_config(dir, "config.json", "norm_topk_prob", NULL);
	struct manifest *m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.flags, MODEL_QK_NORM);
	manifest_destroy(&m);
	/* model_type alone names the architecture; Qwen3's sliding_window means nothing without
	 * use_sliding_window. */
	dir = write_shape(tpath("mt"), "qwen3-tiny", 0);
	set_config(dir, "config.json", "architectures", NULL);
	set_config(dir, "config.json", "sliding_window", "4096");
	m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.arch, ARCH_QWEN3);
	ck_assert_uint_eq(m->cfg.sliding_window, 0);
	manifest_destroy(&m);
}
END_TEST

START_TEST(test_refused)
{
	const char *dir = write_shape(tpath("q"), "qwen3-tiny", 0);
	set_config(dir, "config.json", "use_sliding_window", "true");
	load_fails(dir, -ENOTSUP, "use_sliding_window");

	dir = write_shape(tpath("qm"), "qwen3-moe-tiny", 0);
	set_config(dir, "config.json", "decoder_sparse_step", "2");
	load_fails(dir, -ENOTSUP, "decoder_sparse_step 2");
	set_config(dir, "config.json", "decoder_sparse_step", "1");
	set_config(dir, "config.json", "mlp_only_layers", "[1]");
	load_fails(dir, -ENOTSUP, "mlp_only_layers");
	set_config(dir, "config.json", "mlp_only_layers", "[]");
	set_config(dir, "config.json", "num_experts_per_tok", "9");
	load_fails(dir, -EINVAL, "num_experts_per_tok 9");
	set_config(dir, "config.json", "num_experts_per_tok", "2");
	set_config(dir, "config.json", "moe_intermediate_size", NULL);
	load_fails(dir, -EINVAL, "moe_intermediate_size");
	set_config(dir, "config.json", "moe_intermediate_size", "40");
	load_fails(dir, -EINVAL, "has shape [64, 48], but config.json implies [64, 40]");
	set_config(dir, "config.json", "moe_intermediate_size", "48");
	set_config(dir, "config.json", "num_experts", "4");
	load_fails(dir, -EINVAL, "unexpected tensor");

	dir = write_shape(tpath("mx"), "mixtral-tiny", 0);
	set_config(dir, "config.json", "num_local_experts", NULL);
	load_fails(dir, -EINVAL, "num_local_experts");
	set_config(dir, "config.json", "num_local_experts", "8");
	set_config(dir, "config.json", "architectures", "[\"DeepseekV3ForCausalLM\"]");
	load_fails(dir, -ENOTSUP, "Qwen3MoeForCausalLM");
	set_config(dir, "config.json", "architectures", "[\"MixtralForCausalLM\"]");
	struct manifest *m = load_ok(dir);
	manifest_destroy(&m);

	/* Damaged tensors: a missing expert matrix, an expert outside the layer, a leading zero, a
	 * missing q/k norm, a q/k norm of the wrong length. */
	dir = write_shape(tpath("mx2"), "mixtral-tiny", 0);
	tensor_patch(dir, "model.safetensors",
		     (struct tensor_patch){.name = "model.layers.1.block_sparse_moe.experts.7.w2.weight"});
	load_fails(dir, -EINVAL, "missing tensor model.layers.1.block_sparse_moe.experts.7.w2.weight");
	dir = write_shape(tpath("mx3"), "mixtral-tiny", 0);
	tensor_patch(dir, "model.safetensors",
		     (struct tensor_patch){.name = "model.layers.0.block_sparse_moe.experts.3.w1.weight",
					   .rename = "model.layers.0.block_sparse_moe.experts.8.w1.weight"});
	load_fails(dir, -EINVAL, "unexpected tensor model.layers.0.block_sparse_moe.experts.8.w1.weight");
	dir = write_shape(tpath("mx4"), "mixtral-tiny", 0);
	tensor_patch(dir, "model.safetensors",
		     (struct tensor_patch){.name = "model.layers.0.block_sparse_moe.experts.3.w1.weight",
					   .rename = "model.layers.0.block_sparse_moe.experts.03.w1.weight"});
	load_fails(dir, -EINVAL, "unexpected tensor model.layers.0.block_sparse_moe.experts.03.w1.weight (not part of "
				 "a 2-layer Mixtral)");
	dir = write_shape(tpath("q2"), "qwen3-tiny", 0);
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){.name = "model.layers.0.self_attn.k_norm.weight"});
	load_fails(dir, -EINVAL, "missing tensor model.layers.0.self_attn.k_norm.weight");
	dir = write_shape(tpath("q3"), "qwen3-tiny", 0);
	tensor_patch(dir, "model.safetensors",
		     (struct tensor_patch){.name = "model.layers.1.self_attn.q_norm.weight", .field = "shape",
					   .json = "[16]"});
	load_fails(dir, -EINVAL, "q_norm.weight");
	/* A Llama checkpoint has no q/k norms: one named there is unexpected. */
	dir = write_tiny("l");
	tensor_patch(dir, "model.safetensors",
		     (struct tensor_patch){.name = "model.layers.0.input_layernorm.weight",
					   .rename = "model.layers.0.self_attn.q_norm.weight"});
	load_fails(dir, -EINVAL, "unexpected tensor model.layers.0.self_attn.q_norm.weight");
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
		{"moe", {test_shapes, test_read_back, test_refused, NULL}},
	};
	return run_cases("manifest_moe", cases, ARRAY_SIZE(cases));
}

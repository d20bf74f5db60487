/* test_manifest_bad.c - manifest_load on corrupt and unsupported checkpoints, made by patching a
 * synthetic one: its config JSON, its safetensors header (rewritten with the same data), its
 * index or its bytes; each refused with its return code and a message that names the fault. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/unit/manifest/manifest_test_util.h"

START_TEST(test_missing_inputs)
{
	load_fails(tpath("nowhere"), -ENOENT, "does not exist");
	const char *dir = write_tiny("m");
	ck_assert_int_eq(unlink(tpath("m/model.safetensors")), 0);
	load_fails(dir, -ENOENT, "model.safetensors");
	ck_assert_int_eq(unlink(tpath("m/config.json")), 0);
	load_fails(dir, -ENOENT, "config.json");
	/* A file where the directory should be. */
	write_file(tpath("plain"), "x", 1);
	load_fails(tpath("plain"), -ENOTDIR, "not a directory");
}
END_TEST

START_TEST(test_bad_config)
{
	const char *dir = write_tiny("c");
	write_file(tpath("c/config.json"), "{\"hidden_size\": 64,", 19);
	load_fails(dir, -EINVAL, "JSON");

	dir = write_tiny("a");
	set_config(dir, "config.json", "architectures", "[\"Qwen2ForCausalLM\"]");
	load_fails(dir, -ENOTSUP, "Qwen2ForCausalLM");

	dir = write_tiny("r");
	set_config(dir, "config.json", "rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4.0}");
	load_fails(dir, -ENOTSUP, "yarn");

	static const struct {
		const char *key, *json, *word;
		int rc;
	} cases[] = {
		{"hidden_size", "0", "hidden_size", -EINVAL},
		{"hidden_size", "\"64\"", "hidden_size", -EINVAL},
		{"num_hidden_layers", NULL, "num_hidden_layers", -EINVAL},
		{"num_key_value_heads", "3", "num_key_value_heads", -EINVAL},
		{"vocab_size", "-5", "vocab_size", -EINVAL},
		{"rms_norm_eps", "0", "rms_norm_eps", -EINVAL},
		{"rms_norm_eps", "1e-46", "rms_norm_eps 1e-46 is outside float32's range", -EINVAL},
		{"rope_theta", "1e39", "rope_theta 1e+39 is outside float32's range", -EINVAL},
		{"attention_bias", "true", "attention_bias", -ENOTSUP},
		{"mlp_bias", "true", "mlp_bias", -ENOTSUP},
		{"hidden_act", "\"gelu\"", "gelu", -ENOTSUP},
		{"bos_token_id", "100000", "bos_token_id", -EINVAL},
		{"rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8.0}", "low_freq_factor", -EINVAL},
		{"rope_scaling", "[1]", "rope_scaling", -EINVAL},
		{"tie_word_embeddings", "1", "tie_word_embeddings", -EINVAL},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char name[32];
		snprintf(name, sizeof(name), "case%zu", i);
		dir = write_tiny(name);
		unlink(tpath("%s/generation_config.json", name)); /* its ids would replace config.json's */
		set_config(dir, "config.json", cases[i].key, cases[i].json);
		load_fails(dir, cases[i].rc, cases[i].word);
	}
	/* head_dim absent and heads not dividing the hidden size. */
	dir = write_tiny("nodiv");
	set_config(dir, "config.json", "head_dim", NULL);
	set_config(dir, "config.json", "num_attention_heads", "6");
	set_config(dir, "config.json", "num_key_value_heads", "2");
	load_fails(dir, -EINVAL, "num_attention_heads");
	/* Config shape differing from the file's tensors. */
	dir = write_tiny("ffn");
	set_config(dir, "config.json", "intermediate_size", "128");
	load_fails(dir, -EINVAL, "down_proj.weight has shape [64, 192], but config.json implies [64, 128]");
}
END_TEST

START_TEST(test_bad_header)
{
	/* Header length past the end of the file. */
	const char *dir = write_tiny("len");
	size_t len;
	unsigned char *b = read_file(tpath("len/model.safetensors"), &len);
	uint64_t n = len + 10;
	for (int i = 0; i < 8; i++)
		b[i] = (unsigned char)(n >> (8 * i));
	write_file(tpath("len/model.safetensors"), b, len);
	load_fails(dir, -EINVAL, "header length");
	/* Zero and absurd lengths. */
	memset(b, 0, 8);
	write_file(tpath("len/model.safetensors"), b, len);
	load_fails(dir, -EINVAL, "header length 0");
	b[6] = 1; /* 2^48 */
	write_file(tpath("len/model.safetensors"), b, len);
	load_fails(dir, -EINVAL, "header length");
	/* A header that is not JSON. */
	b[6] = 0;
	b[0] = 16;
	memcpy(b + 8, "{\"a\": [1, 2, 3 ", 16);
	write_file(tpath("len/model.safetensors"), b, len);
	load_fails(dir, -EINVAL, "JSON");
	/* Shorter than the length field. */
	write_file(tpath("len/model.safetensors"), b, 5);
	load_fails(dir, -EINVAL, "too short");
	free(b);

	/* Truncated data. */
	dir = write_tiny("trunc");
	ck_assert_int_eq(truncate(tpath("trunc/model.safetensors"), (off_t)(len - 100)), 0);
	load_fails(dir, -EINVAL, "truncated");
}
END_TEST

START_TEST(test_bad_tensors)
{
	const char *q = "model.layers.1.self_attn.q_proj.weight";
	const char *dir = write_tiny("off");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "data_offsets", "[0, 10]", NULL});
	load_fails(dir, -EINVAL, "data_offsets");
	dir = write_tiny("rev");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "data_offsets", "[100, 10]", NULL});
	load_fails(dir, -EINVAL, "data_offsets");
	dir = write_tiny("neg");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "data_offsets", "[-2, 8190]", NULL});
	load_fails(dir, -EINVAL, "data_offsets");

	dir = write_tiny("shape");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "shape", "[32, 128]", NULL});
	load_fails(dir, -EINVAL, "shape [32, 128], but config.json implies [64, 64]");
	dir = write_tiny("ndim");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "shape", "[4096]", NULL});
	load_fails(dir, -EINVAL, "shape");

	dir = write_tiny("miss");
	tensor_patch(dir, "model.safetensors",
		     (struct tensor_patch){"model.layers.1.mlp.up_proj.weight", NULL, NULL, NULL});
	load_fails(dir, -EINVAL, "missing tensor model.layers.1.mlp.up_proj.weight");

	static const char *const strays[] = {"model.layers.0.self_attn.q_proj.bias",
					     "model.layers.2.mlp.up_proj.weight", "model.layers.01.mlp.up_proj.weight",
					     "transformer.wte.weight"};
	for (size_t i = 0; i < sizeof(strays) / sizeof(strays[0]); i++) {
		char name[32];
		snprintf(name, sizeof(name), "stray%zu", i);
		dir = write_tiny(name);
		tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, NULL, NULL, strays[i]});
		char want[128];
		snprintf(want, sizeof(want), "unexpected tensor %s", strays[i]);
		load_fails(dir, -EINVAL, want);
	}

	dir = write_tiny("i8");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "dtype", "\"I8\"", NULL});
	load_fails(dir, -ENOTSUP, "I8");
	dir = write_tiny("weird");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "dtype", "\"Q4\"", NULL});
	load_fails(dir, -EINVAL, "Q4");
	/* F32 norms in a BF16 checkpoint are fine: only sizes must agree. */
	dir = write_tiny("f32norm");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){"model.norm.weight", "dtype", "\"F32\"", NULL});
	load_fails(dir, -EINVAL, "data_offsets"); /* 64 x 4 bytes does not fit the 128 the file gives */
}
END_TEST

START_TEST(test_bad_index)
{
	struct model_config c = tiny_cfg();
	struct synth_options o = opts(DT_BF16, 1, 3);
	const char *dir = write_model("idx", &c, &o);
	/* The index sends a tensor to a shard that does not hold it. */
	struct kv kv = {"model.layers.0.self_attn.q_proj.weight", "\"model-00003-of-00003.safetensors\""};
	char path[600];
	snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
	json_error_t je;
	json_t *root = json_load_file(path, 0, &je);
	json_t *saved = json_deep_copy(root);
	set_key(json_object_get(root, "weight_map"), &kv);
	json_dump_file(root, path, 0);
	json_decref(root);
	load_fails(dir, -EINVAL, "does not hold it");
	/* A file name that leaves the directory. */
	root = json_deep_copy(saved);
	kv.json = "\"../model-00001-of-00003.safetensors\"";
	set_key(json_object_get(root, "weight_map"), &kv);
	json_dump_file(root, path, 0);
	json_decref(root);
	load_fails(dir, -EINVAL, "plain file name");
	/* A tensor the index does not list. */
	root = json_deep_copy(saved);
	kv.json = NULL;
	set_key(json_object_get(root, "weight_map"), &kv);
	json_dump_file(root, path, 0);
	json_decref(root);
	load_fails(dir, -EINVAL, "does not list");
	/* An unexpected name in the index. */
	root = json_deep_copy(saved);
	kv.key = "model.layers.7.mlp.up_proj.weight";
	kv.json = "\"model-00001-of-00003.safetensors\"";
	set_key(json_object_get(root, "weight_map"), &kv);
	json_dump_file(root, path, 0);
	json_decref(root);
	load_fails(dir, -EINVAL, "unexpected tensor model.layers.7.mlp.up_proj.weight");
	/* A shard that is gone. */
	json_dump_file(saved, path, 0);
	ck_assert_int_eq(unlink(tpath("idx/model-00002-of-00003.safetensors")), 0);
	load_fails(dir, -ENOENT, "model-00002-of-00003.safetensors");
	/* Bad JSON. */
	write_file(path, "{", 1);
	load_fails(dir, -EINVAL, "JSON");
	json_decref(saved);
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
		{"missing", {test_missing_inputs, NULL}},
		{"config", {test_bad_config, NULL}},
		{"header", {test_bad_header, test_bad_tensors, test_bad_index, NULL}},
	};
	return run_cases("manifest_bad", cases, ARRAY_SIZE(cases));
}

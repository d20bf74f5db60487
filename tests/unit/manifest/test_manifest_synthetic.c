/* test_manifest_synthetic.c - the synthetic checkpoint writer (tools/make-synthetic-model/):
 * shapes, determinism, sharding, rewriting, cleanup after a failed write, and the command-line
 * tool; what it writes is read back with manifest_load. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "tests/unit/manifest/manifest_test_util.h"

START_TEST(test_shapes)
{
	struct model_config c;
	char err[256];
	ck_assert_int_eq(synth_shape_config("llama3-8b", &c, err, sizeof(err)), 0);
	ck_assert_int_eq(model_config_check(&c, err, sizeof(err)), 0);
	ck_assert_uint_eq(synth_param_count(&c, false), 8030261248ull); /* Meta-Llama-3-8B */
	ck_assert_uint_eq(c.n_eos, 3);
	ck_assert_uint_eq(c.max_position, 131072);
	ck_assert_int_eq(synth_shape_config("llama3-70b", &c, err, sizeof(err)), 0);
	ck_assert_uint_eq(synth_param_count(&c, false), 70553706496ull); /* Meta-Llama-3-70B */
	ck_assert_uint_eq(c.n_layers, 80);
	ck_assert_int_eq(synth_shape_config("llama3-70b:3", &c, err, sizeof(err)), 0);
	ck_assert_uint_eq(c.n_layers, 3);
	ck_assert_uint_eq(c.dim, 8192);
	ck_assert_uint_eq(c.head_dim, 128);
	ck_assert_int_eq(synth_shape_config("tiny", &c, err, sizeof(err)), 0);
	ck_assert_int_eq(model_config_check(&c, err, sizeof(err)), 0);
	static const char *const bad[] = {"llama3-70b:0", "llama3-70b:81", "llama3-70b:", "llama3-70bx", "gpt2", ""};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		err[0] = 0;
		ck_assert_int_eq(synth_shape_config(bad[i], &c, err, sizeof(err)), -EINVAL);
		ck_assert_msg(strlen(err) > 0, "no message for %s", bad[i]);
	}
	c = tiny_cfg();
	ck_assert_int_eq(synth_parse_rope_scaling("linear:4", &c, err, sizeof(err)), 0);
	ck_assert_uint_eq(c.rope_scaling, ROPE_SCALING_LINEAR);
	ck_assert_float_eq(c.rope_factor, 4.0f);
	ck_assert_int_eq(synth_parse_rope_scaling("none", &c, err, sizeof(err)), 0);
	ck_assert_uint_eq(c.rope_scaling, ROPE_SCALING_NONE);
	ck_assert_int_eq(synth_parse_rope_scaling("llama3", &c, err, sizeof(err)), 0);
	ck_assert_uint_eq(c.rope_original_max_position, 8192);
	ck_assert_int_eq(synth_parse_rope_scaling("linear:-1", &c, err, sizeof(err)), -EINVAL);
	ck_assert_int_eq(synth_parse_rope_scaling("yarn", &c, err, sizeof(err)), -EINVAL);
	/* A bad config is refused before anything is written. */
	c = tiny_cfg();
	c.n_kv_heads = 3;
	struct synth_options o = opts(DT_BF16, 1, 0);
	ck_assert_int_eq(synth_write(tpath("bad"), &c, &o, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "num_key_value_heads"));
	ck_assert_int_eq(access(tpath("bad"), F_OK), -1);
	c = tiny_cfg();
	o.shards = 100; /* more shards than tensors */
	ck_assert_int_eq(synth_write(tpath("bad"), &c, &o, err, sizeof(err)), -EINVAL);
}
END_TEST

START_TEST(test_deterministic)
{
	struct model_config c = tiny_cfg();
	struct synth_options o = opts(DT_BF16, 42, 2);
	write_model("d1", &c, &o);
	write_model("d2", &c, &o);
	o.seed = 43;
	write_model("d3", &c, &o);
	static const char *const files[] = {"config.json", "generation_config.json", "model.safetensors.index.json",
					    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
	for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
		size_t l1, l2, l3;
		char *a = read_file(tpath("d1/%s", files[i]), &l1);
		char *b = read_file(tpath("d2/%s", files[i]), &l2);
		char *d = read_file(tpath("d3/%s", files[i]), &l3);
		ck_assert_uint_eq(l1, l2);
		ck_assert_msg(memcmp(a, b, l1) == 0, "%s differs for one seed", files[i]);
		if (strstr(files[i], "-of-"))
			ck_assert_msg(l1 != l3 || memcmp(a, d, l1) != 0, "%s is the same for two seeds", files[i]);
		free(a);
		free(b);
		free(d);
	}
	/* The draws look like N(0, 0.02) for matrices and 1 + N(0, 0.02) for norms, and differ. */
	struct manifest *m = load_ok(tpath("d1"));
	int gi = manifest_find_tensor(m, group_id_ffn(0), ROLE_W_UP);
	uint16_t *w = tensor_bytes(m, &m->tensors[gi]);
	uint64_t n = m->tensors[gi].nbytes / 2;
	double s = 0, s2 = 0;
	for (uint64_t i = 0; i < n; i++) {
		double v = bf16_to_f32(w[i]);
		s += v;
		s2 += v * v;
	}
	double mean = s / (double)n, sd = sqrt(s2 / (double)n - mean * mean);
	ck_assert_msg(fabs(mean) < 0.002 && sd > 0.018 && sd < 0.022, "mean %g sd %g", mean, sd);
	free(w);
	int ni = manifest_find_tensor(m, group_id_attn(1), ROLE_ATTN_NORM);
	uint16_t *nw = tensor_bytes(m, &m->tensors[ni]);
	int distinct = 0;
	for (uint32_t i = 0; i < 64; i++) {
		float v = bf16_to_f32(nw[i]);
		ck_assert(v > 0.85f && v < 1.15f);
		distinct += i && nw[i] != nw[0];
	}
	ck_assert_int_gt(distinct, 10);
	free(nw);
	manifest_destroy(&m);
}
END_TEST

START_TEST(test_rewrite_removes_stale)
{
	struct model_config c = tiny_cfg();
	struct synth_options o = opts(DT_BF16, 1, 3);
	const char *dir = write_model("re", &c, &o);
	write_file(tpath("re/notes.txt"), "keep", 4);
	o.shards = 1;
	write_model("re", &c, &o);
	ck_assert_int_eq(access(tpath("re/model.safetensors.index.json"), F_OK), -1);
	ck_assert_int_eq(access(tpath("re/model-00001-of-00003.safetensors"), F_OK), -1);
	ck_assert_int_eq(access(tpath("re/notes.txt"), F_OK), 0);
	struct manifest *m = load_ok(dir);
	ck_assert_uint_eq(m->n_files, 1);
	manifest_destroy(&m);
	o.shards = 2;
	write_model("re", &c, &o);
	ck_assert_int_eq(access(tpath("re/model.safetensors"), F_OK), -1);
	m = load_ok(dir);
	ck_assert_uint_eq(m->n_files, 2);
	manifest_destroy(&m);
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
	struct synth_options o = opts(DT_F32, 1, 0);
	char err[512] = "";
	const char *dir = tpath("deep/er/model");
	int rc = synth_write(dir, &c, &o, err, sizeof(err));
	setrlimit(RLIMIT_FSIZE, &saved); /* so a CK_FORK=no run can go on */
	ck_assert_int_eq(rc, -EFBIG);
	ck_assert_msg(strstr(err, "model.safetensors") != NULL, "message \"%s\" does not name the file", err);
	ck_assert_int_eq(access(tpath("deep"), F_OK), -1); /* the directories it made are gone too */
	/* Under a path that cannot be a directory. */
	write_file(tpath("file"), "x", 1);
	rc = synth_write(tpath("file/model"), &c, &o, err, sizeof(err));
	ck_assert_int_lt(rc, 0);
	ck_assert_ptr_nonnull(strstr(err, "file"));
}
END_TEST

static int tool(const char *const *args)
{
	return run_tool(args, NULL, 0);
}

START_TEST(test_tool)
{
	const char *out = tpath("tool");
	ck_assert_int_eq(tool((const char *[]){"--help", NULL}), 0);
	ck_assert_int_eq(tool((const char *[]){NULL}), 2);
	ck_assert_int_eq(tool((const char *[]){"--shape", "gpt2", "--out", out, NULL}), 2);
	ck_assert_int_eq(tool((const char *[]){"--shape", "tiny", "--out", out, "--dtype", "i8", NULL}), 2);
	ck_assert_int_eq(tool((const char *[]){"--shape", "tiny", "--out", out, "--kv-heads", "3", NULL}), 2);
	ck_assert_int_eq(tool((const char *[]){"--shape", "tiny", "--out", out, "--bogus", NULL}), 2);
	ck_assert_int_eq(tool((const char *[]){"--shape", "tiny", "--out", out, "--quiet", NULL}), 0);
	ck_assert_int_eq(tool((const char *[]){"--shape", "tiny", "--out", out, NULL}), 1); /* exists */
	/* Every override at once, over an existing checkpoint. */
	/* clang-format off */
	const char *const all[] = {"--shape", "llama3-70b:2", "--out", out, "--force", "--quiet", "--dim", "128",
				   "--heads", "4", "--mha", "--ffn", "256", "--vocab", "300", "--layers", "3",
				   "--arch", "mistral", "--rope-scaling", "linear:2", "--tied", "--dtype", "f16",
				   "--shards", "2", "--seed", "7", NULL};
	/* clang-format on */
	ck_assert_int_eq(tool(all), 0);
	struct manifest *m = load_ok(out);
	ck_assert_uint_eq(m->cfg.arch, ARCH_MISTRAL);
	ck_assert_uint_eq(m->cfg.n_layers, 3);
	ck_assert_uint_eq(m->cfg.dim, 128);
	ck_assert_uint_eq(m->cfg.n_heads, 4);
	ck_assert_uint_eq(m->cfg.n_kv_heads, 4);
	ck_assert_uint_eq(m->cfg.head_dim, 32);
	ck_assert_uint_eq(m->cfg.ffn_dim, 256);
	ck_assert_uint_eq(m->cfg.vocab_size, 300);
	ck_assert_uint_eq(m->cfg.tie_embeddings, 1);
	ck_assert_uint_eq(m->cfg.rope_scaling, ROPE_SCALING_LINEAR);
	ck_assert_uint_eq(m->weight_dtype, DT_F16);
	ck_assert_uint_eq(m->n_files, 2);
	for (uint32_t i = 0; i < m->cfg.n_eos; i++)
		ck_assert_int_lt(m->cfg.eos_ids[i], 300);
	ck_assert_int_lt(m->cfg.bos_id, 300);
	check_all_tensors(m);
	check_layout(m);
	manifest_destroy(&m);
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
		{"synthetic",
		 {test_shapes, test_deterministic, test_rewrite_removes_stale, test_write_failure_cleans_up, NULL}},
		{"tool", {test_tool, NULL}},
	};
	return run_cases("manifest_synthetic", cases, ARRAY_SIZE(cases));
}

/* hf_check.c CASE_DIR - runs one dump of hf_ref.py through the C reference backend, as one
 * chunk and token by token, and compares with the logits transformers computed, and its RoPE
 * table (rope.h) bit for bit with transformers' inv_freq.
 * Exits 0 when the logits agree (relative L2 < 1e-5) and the table is bit-identical, 1 if not,
 * 2 on a broken dump. Built and run by run.sh. */
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/rope.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ERR_MAX 512

#define PARITY_TOL 1e-5

/* Tensor role r of the model at data, in dtype wt, with the shape the config gives it. */
static void set_tensor(const struct model_config *c, struct group_weights *g, enum tensor_role r, const void *data,
		       uint32_t wt)
{
	uint32_t ndim;
	uint64_t shape[2];
	model_expected_shape(c, r, &ndim, shape);
	weight_tensor_set(&g->t[r], PLACE_HOST, data, (enum dtype)wt, ndim == 1 ? 1 : (uint32_t)shape[0],
			  (uint32_t)(ndim == 1 ? shape[0] : shape[1]));
}

static void *load(const char *dir, const char *name, size_t bytes)
{
	char path[512];
	snprintf(path, sizeof(path), "%s/%s.bin", dir, name);
	FILE *f = fopen(path, "rb");
	if (!f) {
		fprintf(stderr, "hf_check: cannot open %s: %s\n", path, strerror(errno));
		exit(2);
	}
	void *p = malloc(bytes ? bytes : 1);
	if (!p || fread(p, 1, bytes, f) != bytes) {
		fprintf(stderr, "hf_check: %s is shorter than %zu bytes\n", path, bytes);
		exit(2);
	}
	fclose(f);
	return p;
}

static int read_config(const char *dir, struct model_config *c, uint32_t *wt, uint32_t *n, uint32_t *pos0)
{
	char path[512], key[64];
	double v;
	snprintf(path, sizeof(path), "%s/config.txt", dir);
	FILE *f = fopen(path, "r");
	if (!f)
		return -errno;
	*c = (struct model_config){.arch = ARCH_LLAMA, .bos_id = -1};
	while (fscanf(f, "%63s %lf", key, &v) == 2) {
		static const char *const keys[] = {"layers", "dim", "heads", "kv_heads", "head_dim", "ffn", "vocab",
						   "scaling", "orig", "tie", "window", "wdtype", "n", "pos0"};
		uint32_t *dst[] = {&c->n_layers, &c->dim, &c->n_heads, &c->n_kv_heads, &c->head_dim, &c->ffn_dim,
				   &c->vocab_size, &c->rope_scaling, &c->rope_original_max_position, &c->tie_embeddings,
				   &c->sliding_window, wt, n, pos0};
		for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
			if (!strcmp(key, keys[i]))
				*dst[i] = (uint32_t)v;
		if (!strcmp(key, "eps"))
			c->rms_eps = (float)v;
		else if (!strcmp(key, "theta"))
			c->rope_theta = (float)v;
		else if (!strcmp(key, "factor"))
			c->rope_factor = (float)v;
		else if (!strcmp(key, "low"))
			c->rope_low_freq_factor = (float)v;
		else if (!strcmp(key, "high"))
			c->rope_high_freq_factor = (float)v;
	}
	fclose(f);
	if (c->sliding_window)
		c->arch = ARCH_MISTRAL;
	return *n && *n <= 256 && *wt < DT_COUNT ? 0 : -EINVAL;
}

/* Runs tokens in chunks of `step` (n: one chunk) into logits. Returns 0 or the backend's rc. */
static int run(const struct model_config *c, const struct group_weights *ew, const struct group_weights *aw,
	       const struct group_weights *fw, const struct group_weights *hw, const int32_t *tok, uint32_t n,
	       uint32_t pos0, uint32_t step, float *logits)
{
	uint32_t bt = 16, bpl = (n + bt - 1) / bt;
	struct backend_params p = {.max_chunk = step, .block_tokens = bt, .n_kv_blocks = c->n_layers * bpl,
				   .kv_dtype = DT_F32, .threads = 2};
	struct backend *be;
	char err[ERR_MAX];
	int rc = backend_create("cpu", c, &p, &be, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "hf_check: %s\n", err);
		return rc;
	}
	for (uint32_t s = 0; s < n && !rc; s += step) {
		uint32_t cnt = s + step <= n ? step : n - s, db[256], dr[256], ns = 0, end = s + cnt;
		struct kv_span sp[16];
		uint32_t pos[256], seq[256];
		for (uint32_t i = 0; i < cnt; i++) {
			pos[i] = pos0 + s + i;
			seq[i] = 0;
		}
		struct backend_batch batch = {.n = cnt, .tokens = tok + s, .pos = pos, .seq = seq};
		rc = backend_embed(be, ew, &batch);
		for (uint32_t l = 0; l < c->n_layers && !rc; l++) {
			for (uint32_t i = 0; i < cnt; i++) {
				db[i] = l * bpl + (s + i) / bt;
				dr[i] = (s + i) % bt;
			}
			ns = 0;
			for (uint32_t b = 0; b * bt < end; b++)
				sp[ns++] = (struct kv_span){.block = l * bpl + b, .pos0 = pos0 + b * bt,
							    .n_tokens = end - b * bt < bt ? end - b * bt : bt};
			rc = backend_attn_begin(be, &aw[l], l, db, dr);
			rc = rc ? rc : backend_attn_blocks(be, sp, ns);
			rc = rc ? rc : backend_attn_end(be, &aw[l]);
			rc = rc ? rc : backend_ffn(be, &fw[l]);
		}
		rc = rc ? rc : backend_logits(be, hw, logits);
	}
	if (rc)
		fprintf(stderr, "hf_check: %s\n", backend_error(be));
	backend_destroy(&be);
	return rc;
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: hf_check CASE_DIR\n");
		return 2;
	}
	const char *dir = argv[1];
	struct model_config c;
	uint32_t wt = 0, n = 0, pos0 = 0;
	if (read_config(dir, &c, &wt, &n, &pos0)) {
		fprintf(stderr, "hf_check: %s/config.txt is missing or invalid\n", dir);
		return 2;
	}
	size_t es = dtype_size((enum dtype)wt);
	size_t qd = (size_t)c.n_heads * c.head_dim, kvd = (size_t)c.n_kv_heads * c.head_dim;
	uint32_t half = c.head_dim / 2;
	float *hf_inv = load(dir, "inv_freq", half * sizeof(float)), *ours = calloc(half, sizeof(float));
	char err[ERR_MAX];
	if (rope_inv_freq(&c, ours, err, sizeof(err))) {
		fprintf(stderr, "hf_check: %s\n", err);
		return 2;
	}
	uint32_t mismatches = 0;
	for (uint32_t i = 0; i < half; i++)
		mismatches += memcmp(&ours[i], &hf_inv[i], sizeof(float)) != 0;

	struct group_weights ew = {0}, hw = {0};
	struct group_weights *aw = calloc(c.n_layers, sizeof(*aw)), *fw = calloc(c.n_layers, sizeof(*fw));
	void *embed = load(dir, "model.embed_tokens.weight", (size_t)c.vocab_size * c.dim * es);
	set_tensor(&c, &ew, ROLE_EMBED, embed, wt);
	set_tensor(&c, &hw, ROLE_FINAL_NORM, load(dir, "model.norm.weight", c.dim * es), wt);
	set_tensor(&c, &hw, ROLE_LM_HEAD,
		   c.tie_embeddings ? embed : load(dir, "lm_head.weight", (size_t)c.vocab_size * c.dim * es), wt);
	static const struct {
		enum tensor_role role;
		const char *suffix;
	} names[] = {
		{ROLE_ATTN_NORM, "input_layernorm.weight"}, {ROLE_WQ, "self_attn.q_proj.weight"},
		{ROLE_WK, "self_attn.k_proj.weight"},	    {ROLE_WV, "self_attn.v_proj.weight"},
		{ROLE_WO, "self_attn.o_proj.weight"},	    {ROLE_FFN_NORM, "post_attention_layernorm.weight"},
		{ROLE_W_GATE, "mlp.gate_proj.weight"},	    {ROLE_W_UP, "mlp.up_proj.weight"},
		{ROLE_W_DOWN, "mlp.down_proj.weight"},
	};
	for (uint32_t l = 0; l < c.n_layers; l++) {
		for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
			enum tensor_role r = names[i].role;
			size_t elems = r == ROLE_ATTN_NORM || r == ROLE_FFN_NORM ? c.dim
				     : r == ROLE_WQ || r == ROLE_WO		  ? qd * c.dim
				     : r == ROLE_WK || r == ROLE_WV		  ? kvd * c.dim
									  : (size_t)c.ffn_dim * c.dim;
			char nm[128];
			snprintf(nm, sizeof(nm), "model.layers.%u.%s", l, names[i].suffix);
			struct group_weights *g = r >= ROLE_FFN_NORM ? &fw[l] : &aw[l];
			set_tensor(&c, g, r, load(dir, nm, elems * es), wt);
		}
	}
	int32_t *tok = load(dir, "tokens", n * sizeof(int32_t));
	float *want = load(dir, "logits", c.vocab_size * sizeof(float)), *got = malloc(c.vocab_size * sizeof(float));

	const char *name = strrchr(dir, '/') ? strrchr(dir, '/') + 1 : dir;
	int failed = mismatches != 0;
	for (int mode = 0; mode < 2; mode++) {
		if (run(&c, &ew, aw, fw, &hw, tok, n, pos0, mode ? 1 : n, got))
			return 2;
		double num = 0, den = 0, mx = 0;
		for (uint32_t i = 0; i < c.vocab_size; i++) {
			double d = (double)got[i] - want[i];
			num += d * d;
			den += (double)want[i] * want[i];
			mx = fabs(d) > mx ? fabs(d) : mx;
		}
		double rel = sqrt(num / den);
		failed |= !(rel < PARITY_TOL);
		printf("%-34s %-9s rel_l2 %.3e max_abs %.3e  inv_freq bits differ %u/%u  %s\n", name,
		       mode ? "decode" : "one-chunk", rel, mx, mismatches, half,
		       rel < PARITY_TOL && !mismatches ? "ok" : "FAIL");
	}
	return failed;
}

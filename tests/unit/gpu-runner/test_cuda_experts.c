/* test_cuda_experts.c - a layer's experts of one token computed together (cuda/moe.cu's kept
 * experts: one launch for their gate/up products, one for their down products, gemv_mats) against
 * the same experts each on its own (LABELS gpu).
 *
 * Together and apart must give the same bits: each row is computed by one warp in the same order
 * either way, the launch only maps blocks to matrices. Both are also checked against a reference
 * in double (relative L2 <= 2e-2: x rounded to BF16 or F16, and for the integer path quantized
 * to int8 per 32 values, act rounded to the activation dtype), so that two equal wrong answers
 * fail too. Each case runs PIPELINE_TEST_ROUNDS times (3 unless set), every round's bits the first's.
 * Formats: BF16, F16, Q8_0, Q4_K, Q6_K, and Q4_K gate/up with a Q6_K down as Q4_K_M files
 * mix them (Q6_K rows of 630 bytes: the register path, dq_kernel); 1, 3 and 8 experts; shapes
 * whose row counts are not multiples of a block's rows; the register path for every format
 * (BACKEND_GEMV_DP4A_REGS). F32 experts cannot go together (-ENOTSUP).
 *
 * Then a layer through the backend as the engine drives it (embed, route, the chosen experts as
 * kept ones, end), one token a step: the residual after each step is the same bits as with
 * --experts-apart (backend_params.experts_apart), with 10 of 16 experts chosen (a batch of 8, then
 * the rest) in one set of formats, and with formats that change from expert to expert (BF16, Q4_K
 * with a Q6_K down, Q8_0, F16: batches cut where the formats change, and before the token's row is
 * gathered in F16). And the same layer routed on the device (backend_moe_layer, 8 experts a token,
 * Q4_K with a Q6_K down, and BF16): the residual the same bits as the host's route, the same experts
 * chosen; a layer of 10 experts a token, of mixed formats, or with --moe-host-route refused.
 *
 * Without a GPU the program exits 77 (ctest: skipped). */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "common/dtype.h"
#include "common/model.h"
#include "common/quant.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/cuda/cuda_test.h"
#include "tests/unit/gpu-runner/cuda_test_util.h"
#include "tests/unit/gpu-runner/runner_test_util.h"

#define TOL_REF 2e-2
#define MAX_EXPERTS 8

/* A backend of a small dense config (the hook needs only its stream and kernels). */
static struct backend *open_backend(uint32_t gemv)
{
	struct model_config c = {
		.arch = ARCH_LLAMA, .n_layers = 1, .dim = 256, .n_heads = 4, .n_kv_heads = 2, .head_dim = 64,
		.ffn_dim = 512, .vocab_size = 512, .max_position = 4096, .rms_eps = 1e-5f, .rope_theta = 10000.0f,
		.rope_scaling = ROPE_SCALING_NONE, .bos_id = -1,
	};
	struct backend_params p = {.max_chunk = 4, .block_tokens = 16, .n_kv_blocks = 8, .kv_dtype = DT_BF16,
				   .threads = 1, .gemv = gemv};
	struct backend *be = NULL;
	char err[400] = "";
	int rc = backend_create("cuda", &c, &p, &be, err, sizeof(err));
	ck_assert_msg(rc == 0, "cuda create: %d %s", rc, err);
	return be;
}

/* A matrix (rows, cols) of format f from random values (amplitude amp): its stored bytes on the
 * device, and the values they hold on the host (float32). */
struct mat {
	void *dev;
	float *val;
};

static void mat_new(struct mat *m, enum dtype f, uint32_t rows, uint32_t cols, double amp)
{
	size_t n = (size_t)rows * cols, bytes = rows * dtype_row_bytes(f, cols);
	float *src = malloc(n * sizeof(float));
	void *host = malloc(bytes);
	m->val = malloc(n * sizeof(float));
	ck_assert(src && host && m->val);
	for (size_t i = 0; i < n; i++)
		src[i] = (float)(amp * rng_normal());
	if (dtype_is_element(f)) {
		for (size_t i = 0; i < n; i++) {
			if (f == DT_F32)
				((float *)host)[i] = src[i];
			else if (f == DT_BF16)
				((uint16_t *)host)[i] = f32_to_bf16(src[i]);
			else
				((uint16_t *)host)[i] = f32_to_f16(src[i]);
			m->val[i] = dtype_get_f32(f, host, i);
		}
	} else {
		quant_quantize(f, src, host, n);
		quant_dequantize(f, host, m->val, n);
	}
	CUDA_OK(cudaMalloc(&m->dev, bytes));
	CUDA_OK(cudaMemcpy(m->dev, host, bytes, cudaMemcpyHostToDevice));
	/* The DMA of a pageable copy may land after it returns, and the backend's stream (non-blocking)
	 * does not wait for the legacy one's copies. */
	CUDA_OK(cudaDeviceSynchronize());
	free(src);
	free(host);
}

static void mat_free(struct mat *m)
{
	CUDA_OK(cudaFree(m->dev));
	free(m->val);
}

/* The activation dtype of weight format f (cuda_internal.h's act_dtype). */
static uint32_t act_of(enum dtype f)
{
	return dtype_is_element(f) ? (uint32_t)f : (uint32_t)DT_BF16;
}

/* v rounded to the activation dtype at. */
static float round_act(uint32_t at, float v)
{
	return at == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : at == DT_F16 ? f16_to_f32(f32_to_f16(v)) : v;
}

/* The expert's down row in double from the held values: act = silu(g x) * (u x) rounded to at. */
static void ref_expert(uint32_t at, const struct mat *g, const struct mat *u, const struct mat *d, const float *x,
		       uint32_t dim, uint32_t F, float *out)
{
	float *act = malloc(F * sizeof(float));
	ck_assert_ptr_nonnull(act);
	for (uint32_t o = 0; o < F; o++) {
		double sg = 0, su = 0;
		for (uint32_t i = 0; i < dim; i++) {
			const double xi = round_act(at, x[i]);
			sg += g->val[(size_t)o * dim + i] * xi;
			su += u->val[(size_t)o * dim + i] * xi;
		}
		act[o] = round_act(at, (float)(sg / (1.0 + exp(-sg)) * su));
	}
	for (uint32_t o = 0; o < dim; o++) {
		double s = 0;
		for (uint32_t i = 0; i < F; i++)
			s += d->val[(size_t)o * F + i] * (double)act[i];
		out[o] = (float)s;
	}
	free(act);
}

/* Rounds of each case (PIPELINE_TEST_ROUNDS, default 3): every round must give the same bits as
 * the first, together and apart, so that a result that depends on the kernels' timing (a race
 * between a launch and the one before it) shows up here rather than once in a while. */
static uint32_t test_rounds(void)
{
	const char *v = getenv("PIPELINE_TEST_ROUNDS");
	const long r = v ? strtol(v, NULL, 10) : 3;
	return r < 1 ? 1 : r > 1000 ? 1000 : (uint32_t)r;
}

/* Where a and b (n values) differ: how many, the first and last index; 0 when they agree. */
static uint32_t diff_rows(const float *a, const float *b, uint32_t n, uint32_t *first, uint32_t *last)
{
	uint32_t c = 0;
	for (uint32_t o = 0; o < n; o++)
		if (memcmp(&a[o], &b[o], sizeof(float))) {
			if (!c++)
				*first = o;
			*last = o;
		}
	return c;
}

/* n experts of formats gf (gate, up) and df (down), shape (F, dim), on a backend with gemv:
 * together == apart to the bit in every round, and both within TOL_REF of the reference. */
static void check_experts(uint32_t gemv, enum dtype gf, enum dtype df, uint32_t n, uint32_t dim, uint32_t F)
{
	rng_state = 0x5eed0000u + n * 131u + dim * 7u + F + gf * 1000u + df * 100000u;
	struct backend *be = open_backend(gemv);
	struct mat g[MAX_EXPERTS], u[MAX_EXPERTS], d[MAX_EXPERTS];
	struct cuda_test_experts t = {.gate_format = gf, .down_format = df, .n = n, .dim = dim, .F = F};
	const size_t nv = (size_t)n * dim;
	float *x = malloc(dim * sizeof(float));
	float *together = malloc(nv * sizeof(float)), *apart = malloc(nv * sizeof(float));
	float *first = malloc(nv * sizeof(float)); /* round 0's (== apart's) */
	float *ref = malloc(nv * sizeof(float));
	ck_assert(x && together && apart && first && ref);
	for (uint32_t i = 0; i < dim; i++)
		x[i] = (float)rng_normal();
	for (uint32_t j = 0; j < n; j++) {
		mat_new(&g[j], gf, F, dim, 1.0 / sqrt(dim));
		mat_new(&u[j], gf, F, dim, 1.0 / sqrt(dim));
		mat_new(&d[j], df, dim, F, 1.0 / sqrt(F));
		t.gate[j] = g[j].dev;
		t.up[j] = u[j].dev;
		t.down[j] = d[j].dev;
		ref_expert(act_of(gf), &g[j], &u[j], &d[j], x, dim, F, ref + (size_t)j * dim);
	}
	t.x = x;
	t.together = together;
	t.apart = apart;
	const uint32_t rounds = test_rounds();
	for (uint32_t round = 0; round < rounds; round++) {
		char err[400] = "";
		int rc = cuda_test_experts_together(be, &t, err, sizeof(err));
		ck_assert_msg(rc == 0, "%u experts %s/%s (%u x %u): %d %s", n, dtype_name(gf), dtype_name(df), F, dim, rc,
			      err);
		for (uint32_t j = 0; j < n; j++) {
			const size_t off = (size_t)j * dim;
			const float *a = together + off, *b = apart + off, *r = ref + off;
			uint32_t lo = 0, hi = 0, nd = diff_rows(a, b, dim, &lo, &hi);
			/* Which of the two is wrong: the one farther from the reference. */
			ck_assert_msg(nd == 0,
				      "%u experts %s/%s (%u x %u), gemv %u, round %u: expert %u, %u rows differ (%u..%u), "
				      "row %u together %.9g, apart %.9g; from the reference together %.3e, apart %.3e",
				      n, dtype_name(gf), dtype_name(df), F, dim, gemv, round, j, nd, lo, hi, lo,
				      (double)a[lo], (double)b[lo], rel_l2(a, r, dim), rel_l2(b, r, dim));
			if (round > 0) {
				nd = diff_rows(a, first + off, dim, &lo, &hi);
				ck_assert_msg(nd == 0,
					      "%u experts %s/%s (%u x %u), gemv %u: expert %u, round %u differs from round 0 "
					      "in %u rows (%u..%u)",
					      n, dtype_name(gf), dtype_name(df), F, dim, gemv, j, round, nd, lo, hi);
				continue;
			}
			const double e = rel_l2(a, r, dim);
			if (test_verbose())
				fprintf(stderr,
					"test_cuda_experts: %u experts %s/%s %u x %u gemv %u, expert %u: relative L2 %.3e\n",
					n, dtype_name(gf), dtype_name(df), F, dim, gemv, j, e);
			ck_assert_msg(e <= TOL_REF, "%u experts %s/%s: expert %u is %.3e from the reference", n,
				      dtype_name(gf), dtype_name(df), j, e);
		}
		if (round == 0)
			memcpy(first, together, nv * sizeof(float));
	}
	for (uint32_t j = 0; j < n; j++) {
		mat_free(&g[j]);
		mat_free(&u[j]);
		mat_free(&d[j]);
	}
	free(x);
	free(together);
	free(apart);
	free(first);
	free(ref);
	backend_destroy(&be);
}

static const uint32_t COUNTS[] = {1, 3, 8};

START_TEST(test_element_formats)
{
	const enum dtype f = _i == 0 ? DT_BF16 : DT_F16;
	for (size_t c = 0; c < sizeof(COUNTS) / sizeof(COUNTS[0]); c++) {
		check_experts(BACKEND_GEMV_DEFAULT, f, f, COUNTS[c], 136, 40); /* 17 and 5 row groups */
		check_experts(BACKEND_GEMV_DEFAULT, f, f, COUNTS[c], 512, 768);
	}
}
END_TEST

/* Gate/up and down formats of the quantized cases. */
static const enum dtype QPAIRS[][2] = {
	{DT_Q4_K, DT_Q4_K}, {DT_Q4_K, DT_Q6_K}, {DT_Q6_K, DT_Q6_K}, {DT_Q8_0, DT_Q8_0}, {DT_Q8_0, DT_Q4_K},
};

START_TEST(test_quant_formats)
{
	const enum dtype gf = QPAIRS[_i][0], df = QPAIRS[_i][1];
	const bool small = gf == DT_Q8_0 && df == DT_Q8_0;
	for (size_t c = 0; c < sizeof(COUNTS) / sizeof(COUNTS[0]); c++)
		for (int regs = 0; regs < 2; regs++) {
			const uint32_t gemv = regs ? BACKEND_GEMV_DP4A_REGS : BACKEND_GEMV_DEFAULT;
			if (small)
				check_experts(gemv, gf, df, COUNTS[c], 96, 160); /* 12 and 20 row groups */
			check_experts(gemv, gf, df, COUNTS[c], 512, 768);
			check_experts(gemv, gf, df, COUNTS[c], 256, 256);
		}
}
END_TEST

START_TEST(test_f32_refused)
{
	struct backend *be = open_backend(BACKEND_GEMV_DEFAULT);
	struct mat g, u, d;
	rng_state = 7;
	mat_new(&g, DT_F32, 40, 64, 0.1);
	mat_new(&u, DT_F32, 40, 64, 0.1);
	mat_new(&d, DT_F32, 64, 40, 0.1);
	float x[64], a[64], b[64];
	for (int i = 0; i < 64; i++)
		x[i] = (float)rng_normal();
	struct cuda_test_experts t = {.gate_format = DT_F32, .down_format = DT_F32, .n = 1, .dim = 64, .F = 40,
				      .gate = {g.dev}, .up = {u.dev}, .down = {d.dev}, .x = x, .together = a,
				      .apart = b};
	char err[400] = "";
	int rc = cuda_test_experts_together(be, &t, err, sizeof(err));
	ck_assert_msg(rc == -ENOTSUP, "F32 experts together: %d %s", rc, err);
	mat_free(&g);
	mat_free(&u);
	mat_free(&d);
	backend_destroy(&be);
}
END_TEST

/* ---- a layer through the backend: kept experts noted and launched together, or each apart ---- */

#define L_EXPERTS 16
#define L_USED 10 /* more than GEMV_MATS (8): a full batch, then the rest */
#define L_DIM 256
#define L_F 256
#define L_TOKENS 4

/* Experts of every format mix: BF16, Q4_K with a Q6_K down (as Q4_K_M files), Q8_0, F16 (whose
 * activations are F16: the token's row is gathered anew, so the noted ones go first). */
static const enum dtype MIX_GATE[] = {DT_BF16, DT_Q4_K, DT_Q8_0, DT_F16};
static const enum dtype MIX_DOWN[] = {DT_BF16, DT_Q6_K, DT_Q8_0, DT_F16};

struct layer {
	struct model_config cfg;
	struct group_weights embed, moe, exp[L_EXPERTS];
	void *host[4 + 3 * L_EXPERTS];
	struct mat m[3 * L_EXPERTS + 2];
	uint32_t n_host, n_mat;
};

/* A tensor of role r on the device (resident: the window's kept experts) from random values. */
static void layer_tensor(struct layer *y, struct group_weights *w, enum tensor_role r, enum dtype f, uint32_t rows,
			 uint32_t cols, double amp)
{
	struct mat *m = &y->m[y->n_mat++];
	mat_new(m, f, rows, cols, amp);
	weight_tensor_set(&w->t[r], PLACE_DEVICE, m->dev, f, rows, cols);
}

/* Every expert in one set of formats: Q4_K with a Q6_K down, or BF16. */
static enum dtype uniform_gate = DT_Q4_K, uniform_down = DT_Q6_K;

/* mixed: expert e in formats MIX_*[e % 4]; else every expert uniform_gate with a uniform_down down;
 * used experts a token. */
static void layer_new_k(struct layer *y, bool mixed, uint32_t used)
{
	memset(y, 0, sizeof(*y));
	y->cfg = (struct model_config){.arch = ARCH_MIXTRAL, .n_layers = 1, .dim = L_DIM, .n_heads = 4,
				       .n_kv_heads = 2, .head_dim = 64, .ffn_dim = L_F, .vocab_size = 64,
				       .max_position = 4096, .rms_eps = 1e-5f, .rope_theta = 10000.0f,
				       .rope_scaling = ROPE_SCALING_NONE, .bos_id = -1, .n_experts = L_EXPERTS,
				       .n_experts_used = used, .expert_ffn_dim = L_F, .flags = MODEL_NORM_TOPK};
	char err[256];
	ck_assert_msg(model_config_check(&y->cfg, err, sizeof(err)) == 0, "%s", err);
	rng_state = mixed ? 17 : 29;
	/* The embedding in host memory (the backend gathers rows there), BF16. */
	uint16_t *emb = malloc((size_t)y->cfg.vocab_size * L_DIM * sizeof(uint16_t));
	ck_assert_ptr_nonnull(emb);
	for (size_t i = 0; i < (size_t)y->cfg.vocab_size * L_DIM; i++)
		emb[i] = f32_to_bf16((float)rng_normal());
	y->host[y->n_host++] = emb;
	weight_tensor_set(&y->embed.t[ROLE_EMBED], PLACE_HOST, emb, DT_BF16, y->cfg.vocab_size, L_DIM);
	layer_tensor(y, &y->moe, ROLE_FFN_NORM, DT_F32, 1, L_DIM, 1.0);
	layer_tensor(y, &y->moe, ROLE_ROUTER, DT_F32, L_EXPERTS, L_DIM, 0.5);
	for (uint32_t e = 0; e < L_EXPERTS; e++) {
		const enum dtype gf = mixed ? MIX_GATE[e % 4] : uniform_gate, df = mixed ? MIX_DOWN[e % 4] : uniform_down;
		layer_tensor(y, &y->exp[e], ROLE_EXPERT_GATE, gf, L_F, L_DIM, 1.0 / sqrt(L_DIM));
		layer_tensor(y, &y->exp[e], ROLE_EXPERT_UP, gf, L_F, L_DIM, 1.0 / sqrt(L_DIM));
		layer_tensor(y, &y->exp[e], ROLE_EXPERT_DOWN, df, L_DIM, L_F, 1.0 / sqrt(L_F));
		y->exp[e].resident = true;
	}
}

static void layer_new(struct layer *y, bool mixed)
{
	layer_new_k(y, mixed, L_USED);
}

static void layer_free(struct layer *y)
{
	for (uint32_t i = 0; i < y->n_mat; i++)
		mat_free(&y->m[i]);
	for (uint32_t i = 0; i < y->n_host; i++)
		free(y->host[i]);
}

/* One-token steps of the layer alone (embed, route, the chosen experts in order, end) on a backend
 * with or without --experts-apart; each step's residual row into out (L_TOKENS, L_DIM), and the
 * experts each step chose into used (NULL: not wanted). */
static void layer_run(struct layer *y, bool apart, float *out, uint32_t *chosen, bool (*used)[L_EXPERTS])
{
	struct backend_params p = {.max_chunk = 4, .block_tokens = 16, .n_kv_blocks = 8, .kv_dtype = DT_BF16,
				   .threads = 1, .experts_apart = apart};
	struct backend *be = NULL;
	char err[400] = "";
	int rc = backend_create("cuda", &y->cfg, &p, &be, err, sizeof(err));
	ck_assert_msg(rc == 0, "cuda create: %d %s", rc, err);
	*chosen = 0;
	for (uint32_t t = 0; t < L_TOKENS; t++) {
		const int32_t tok = (int32_t)(7 + 11 * t);
		const uint32_t pos = t, seq = 0;
		struct backend_batch b = {.n = 1, .tokens = &tok, .pos = &pos, .seq = &seq};
		ck_assert_msg(backend_embed(be, &y->embed, &b) == 0, "embed: %s", backend_error(be));
		ck_assert_msg(backend_moe_route(be, &y->moe) == 0, "route: %s", backend_error(be));
		for (uint32_t e = 0; e < L_EXPERTS; e++) {
			const bool u = backend_moe_expert_used(be, e);
			if (used)
				used[t][e] = u;
			if (u) {
				ck_assert_msg(backend_moe_expert(be, &y->exp[e], e) == 0, "expert %u: %s", e, backend_error(be));
				(*chosen)++;
			}
		}
		ck_assert_msg(backend_moe_end(be) == 0, "end: %s", backend_error(be));
		ck_assert_msg(cuda_test_residual(be, out + (size_t)t * L_DIM, 1, err, sizeof(err)) == 0, "%s", err);
	}
	backend_destroy(&be);
}

/* The residual after each step is the same bits with the kept experts together as apart; and the
 * layer moved it (the experts were computed at all). */
static void layer_compare(bool mixed)
{
	struct layer *y = malloc(sizeof(*y));
	ck_assert_ptr_nonnull(y);
	layer_new(y, mixed);
	float together[L_TOKENS * L_DIM], apart[L_TOKENS * L_DIM], emb[L_DIM];
	uint32_t n_together, n_apart;
	layer_run(y, false, together, &n_together, NULL);
	layer_run(y, true, apart, &n_apart, NULL);
	ck_assert_uint_eq(n_together, L_TOKENS * L_USED);
	ck_assert_uint_eq(n_apart, L_TOKENS * L_USED);
	for (uint32_t i = 0; i < L_TOKENS * L_DIM; i++)
		ck_assert_msg(memcmp(&together[i], &apart[i], sizeof(float)) == 0,
			      "%s experts: token %u value %u together %.9g, apart %.9g", mixed ? "mixed" : "Q4_K",
			      i / L_DIM, i % L_DIM, (double)together[i], (double)apart[i]);
	/* The last token's row moved away from its embedding by the experts' sum. */
	const int32_t tok = (int32_t)(7 + 11 * (L_TOKENS - 1));
	for (uint32_t d = 0; d < L_DIM; d++)
		emb[d] = bf16_to_f32(((const uint16_t *)y->host[0])[(size_t)tok * L_DIM + d]);
	const double moved = rel_l2(together + (size_t)(L_TOKENS - 1) * L_DIM, emb, L_DIM);
	ck_assert_msg(moved > 1e-3, "the layer left the residual at its embedding (%.3e)", moved);
	layer_free(y);
	free(y);
}

/* The layer routed on the device (backend_moe_layer, its experts' table given once) against the
 * host's route with the kept experts together: the residual after each step the same bits, and
 * the same experts chosen. The experts' weights are those the engine would pass. */
static void layer_device(enum dtype gf, enum dtype df)
{
	uniform_gate = gf;
	uniform_down = df;
	struct layer *y = malloc(sizeof(*y));
	ck_assert_ptr_nonnull(y);
	const uint32_t k = 8;
	layer_new_k(y, false, k);
	float host[L_TOKENS * L_DIM], dev[L_TOKENS * L_DIM];
	uint32_t n_host;
	bool used_host[L_TOKENS][L_EXPERTS]; /* the host's choices, step by step */
	layer_run(y, false, host, &n_host, used_host);
	ck_assert_uint_eq(n_host, L_TOKENS * k);
	struct backend_params p = {.max_chunk = 4, .block_tokens = 16, .n_kv_blocks = 8, .kv_dtype = DT_BF16,
				   .threads = 1};
	struct backend *be = NULL;
	char err[400] = "";
	ck_assert_msg(backend_create("cuda", &y->cfg, &p, &be, err, sizeof(err)) == 0, "cuda create: %s", err);
	/* Before its table, the layer cannot be routed on the device. */
	uint32_t ids[8];
	ck_assert_int_eq(backend_moe_layer_chosen(be, 0, ids), -ENODATA);
	int rc = backend_moe_layer_experts(be, 0, y->exp);
	ck_assert_msg(rc == 0, "the experts' table: %d %s", rc, backend_error(be));
	for (uint32_t t = 0; t < L_TOKENS; t++) {
		const int32_t tok = (int32_t)(7 + 11 * t);
		const uint32_t pos = t, seq = 0;
		struct backend_batch b = {.n = 1, .tokens = &tok, .pos = &pos, .seq = &seq};
		ck_assert_msg(backend_embed(be, &y->embed, &b) == 0, "embed: %s", backend_error(be));
		rc = backend_moe_layer(be, &y->moe, 0);
		ck_assert_msg(rc == 0, "moe_layer: %d %s", rc, backend_error(be));
		rc = backend_moe_layer_chosen(be, 0, ids);
		ck_assert_msg(rc == 0, "chosen: %d %s", rc, backend_error(be));
		bool seen[L_EXPERTS] = {false};
		for (uint32_t i = 0; i < k; i++) {
			ck_assert_uint_lt(ids[i], L_EXPERTS);
			ck_assert_msg(!seen[ids[i]] && (i == 0 || ids[i] > ids[i - 1]), "token %u: expert %u out of order",
				      t, ids[i]);
			seen[ids[i]] = true;
			ck_assert_msg(used_host[t][ids[i]], "token %u: the device chose expert %u, the host did not", t,
				      ids[i]);
		}
		ck_assert_int_eq(backend_moe_check(be), 0);
		ck_assert_msg(cuda_test_residual(be, dev + (size_t)t * L_DIM, 1, err, sizeof(err)) == 0, "%s", err);
	}
	uint32_t lo = 0, hi = 0, nd = diff_rows(dev, host, L_TOKENS * L_DIM, &lo, &hi);
	ck_assert_msg(nd == 0, "%s/%s experts routed on the device: %u values differ from the host's route (%u..%u), "
		      "value %u device %.9g, host %.9g", dtype_name(gf), dtype_name(df), nd, lo, hi, lo, (double)dev[lo],
		      (double)host[lo]);
	/* A model of 10 experts a token does not go in one launch: the host routes it. */
	backend_destroy(&be);
	layer_free(y);
	layer_new_k(y, false, L_USED);
	ck_assert_msg(backend_create("cuda", &y->cfg, &p, &be, err, sizeof(err)) == 0, "cuda create: %s", err);
	ck_assert_int_eq(backend_moe_layer_experts(be, 0, y->exp), -ENOTSUP);
	backend_destroy(&be);
	layer_free(y);
	/* Experts of different formats neither. */
	layer_new_k(y, true, k);
	ck_assert_msg(backend_create("cuda", &y->cfg, &p, &be, err, sizeof(err)) == 0, "cuda create: %s", err);
	ck_assert_int_eq(backend_moe_layer_experts(be, 0, y->exp), -ENOTSUP);
	/* Nor with --moe-host-route. */
	backend_destroy(&be);
	p.moe_host_route = true;
	ck_assert_msg(backend_create("cuda", &y->cfg, &p, &be, err, sizeof(err)) == 0, "cuda create: %s", err);
	layer_free(y);
	layer_new_k(y, false, k);
	ck_assert_int_eq(backend_moe_layer_experts(be, 0, y->exp), -ENOTSUP);
	backend_destroy(&be);
	layer_free(y);
	free(y);
	uniform_gate = DT_Q4_K;
	uniform_down = DT_Q6_K;
}

START_TEST(test_layer_device)
{
	if (_i == 0)
		layer_device(DT_Q4_K, DT_Q6_K);
	else
		layer_device(DT_BF16, DT_BF16);
}
END_TEST

START_TEST(test_layer_uniform)
{
	layer_compare(false);
}
END_TEST

START_TEST(test_layer_mixed)
{
	layer_compare(true);
}
END_TEST

static Suite *experts_suite(void)
{
	Suite *s = suite_create("cuda_experts");
	TCase *tc = tcase_create("together");
	tcase_set_timeout(tc, 300);
	tcase_add_loop_test(tc, test_element_formats, 0, 2);
	tcase_add_loop_test(tc, test_quant_formats, 0, (int)(sizeof(QPAIRS) / sizeof(QPAIRS[0])));
	tcase_add_test(tc, test_f32_refused);
	suite_add_tcase(s, tc);
	TCase *tl = tcase_create("layer");
	tcase_set_timeout(tl, 300);
	tcase_add_test(tl, test_layer_uniform);
	tcase_add_test(tl, test_layer_mixed);
	tcase_add_loop_test(tl, test_layer_device, 0, 2);
	suite_add_tcase(s, tl);
	return s;
}

int main(void)
{
	return gpu_suite_main("test_cuda_experts", experts_suite);
}

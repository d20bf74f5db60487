/* test_cuda_moe_cpu.c - the CUDA backend's mixture-of-experts layers with some routed experts
 * computed by the CPU task pool (backend.h: moe_expert_cpu; cuda/moe_cpu.cu) against the C
 * reference, which computes every expert itself (LABELS gpu).
 *
 * A small random Mixtral-shaped model (two layers, dim 256, 8 experts of 256 rows, 2 a token,
 * BF16 matrices) runs a prompt in chunks of 8, then single tokens, as the engine drives a layer:
 * the route, the experts the test leaves to the CPU (the odd ones, in increasing order, right
 * after the route), the others on the GPU (every expert, in increasing order), the end; then the
 * logits and the step's check of the CPU's jobs. The CPU experts' weights are in host memory only
 * (what the weight window hands over for them), the GPU's in device memory only. The logits of
 * every step are compared with the reference's: within TOL_MOE relative L2 (BF16 activations and
 * KV, near-ties of the routing weights), with the CPU's results waited for on the stream and read from mapped memory (the default)
 * and copied up by the host (cpu_result_mapped false), with the jobs' chunks tapered and equal,
 * and with experts of 6144 rows (9.4 MB: each job's share made anew, cut finer).
 * Then a CPU expert that fails (cuda_test.h's hook) fails its step with a message naming it, both
 * ways, and the next step computes again; and a hook asked of a dense backend is refused.
 *
 * Without a GPU the program exits 77 (ctest: skipped). */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/cuda/cuda_test.h"
#include "tests/unit/gpu-runner/cuda_test_util.h"
#include "tests/unit/gpu-runner/runner_test_util.h"

/* The GPU's experts take their inputs and SwiGLU output in BF16, the reference's in F32, and the KV
 * is BF16: a few 1e-3 of the logits, which two tokens' routing weights near a tie (0.53 / 0.47 in
 * one of the decode steps) amplify to a few 1e-2. A wrong expert, weight or row moves them by
 * order 1. */
#define TOL_MOE 1e-1
#define PROMPT 20
#define CHUNK 8
#define DECODE 6
#define MAX_CTX 64
#define BT 16
#define LAYERS 2
#define EXPERTS 8
#define MAX_ALLOCS 512

struct tmodel {
	struct model_config cfg;
	struct group_weights embed, h_head, d_head;
	struct group_weights h_attn[LAYERS], d_attn[LAYERS];
	struct group_weights h_moe[LAYERS], d_moe[LAYERS];		   /* norm and router */
	struct group_weights h_exp[LAYERS][EXPERTS], d_exp[LAYERS][EXPERTS]; /* host only, device only */
	void *allocs[MAX_ALLOCS], *dallocs[MAX_ALLOCS];
	uint32_t n_allocs, n_dallocs;
};

static void *keep(struct tmodel *m, void *p)
{
	ck_assert_ptr_nonnull(p);
	ck_assert_uint_lt(m->n_allocs, MAX_ALLOCS);
	return m->allocs[m->n_allocs++] = p;
}

static void *upload(struct tmodel *m, const void *src, size_t bytes)
{
	void *d = NULL;
	CUDA_OK(cudaMalloc(&d, bytes ? bytes : 256));
	ck_assert_uint_lt(m->n_dallocs, MAX_ALLOCS);
	m->dallocs[m->n_dallocs++] = d;
	CUDA_OK(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice));
	CUDA_OK(cudaDeviceSynchronize()); /* the DMA of a pageable copy may land after it returns */
	return d;
}

/* A (rows, cols) tensor of role r in format f (F32 or BF16), values mean + std N(0, 1): its host
 * bytes in h (when h), a device copy in d (when d). */
static void tensor(struct tmodel *m, enum tensor_role r, enum dtype f, uint32_t rows, uint32_t cols, double mean,
		   double std, struct group_weights *h, struct group_weights *d)
{
	size_t n = (size_t)rows * cols;
	void *host = keep(m, malloc(dtype_row_bytes(f, cols) * rows));
	for (size_t i = 0; i < n; i++) {
		float v = (float)(mean + std * rng_normal());
		if (f == DT_F32)
			((float *)host)[i] = v;
		else
			((uint16_t *)host)[i] = f32_to_bf16(v);
	}
	if (h)
		weight_tensor_set(&h->t[r], PLACE_HOST, host, f, rows, cols);
	if (d)
		weight_tensor_set(&d->t[r], PLACE_DEVICE, upload(m, host, dtype_row_bytes(f, cols) * rows), f, rows, cols);
}

/* Experts of F rows (256; 6144: 9.4 MB each, which ffn_share_threads_for cuts for 3 threads where
 * the jobs' setup cut them for 2 (the test's 4 over k = 2), so each job's share is made anew at its
 * first such expert). */
static struct tmodel *model_new(uint32_t F)
{
	struct tmodel *m = calloc(1, sizeof(*m));
	ck_assert_ptr_nonnull(m);
	m->cfg = (struct model_config){.arch = ARCH_MIXTRAL, .n_layers = LAYERS, .dim = 256, .n_heads = 4,
				       .n_kv_heads = 2, .head_dim = 64, .ffn_dim = F, .vocab_size = 512,
				       .max_position = 4096, .rms_eps = 1e-5f, .rope_theta = 10000.0f,
				       .rope_scaling = ROPE_SCALING_NONE, .bos_id = -1, .n_experts = EXPERTS,
				       .n_experts_used = 2, .expert_ffn_dim = F, .flags = MODEL_NORM_TOPK};
	char err[256];
	ck_assert_msg(model_config_check(&m->cfg, err, sizeof(err)) == 0, "%s", err);
	const uint32_t dim = m->cfg.dim, q = m->cfg.n_heads * m->cfg.head_dim, kv = m->cfg.n_kv_heads * m->cfg.head_dim;
	const double std = 0.05 * sqrt(256.0 / F); /* the down product's sum over F kept alike */
	rng_state = 91;
	tensor(m, ROLE_EMBED, DT_BF16, m->cfg.vocab_size, dim, 0, 0.02, &m->embed, NULL);
	for (uint32_t l = 0; l < LAYERS; l++) {
		tensor(m, ROLE_ATTN_NORM, DT_F32, 1, dim, 1.0, 0.1, &m->h_attn[l], &m->d_attn[l]);
		tensor(m, ROLE_WQ, DT_BF16, q, dim, 0, 0.02, &m->h_attn[l], &m->d_attn[l]);
		tensor(m, ROLE_WK, DT_BF16, kv, dim, 0, 0.02, &m->h_attn[l], &m->d_attn[l]);
		tensor(m, ROLE_WV, DT_BF16, kv, dim, 0, 0.02, &m->h_attn[l], &m->d_attn[l]);
		tensor(m, ROLE_WO, DT_BF16, dim, q, 0, 0.02, &m->h_attn[l], &m->d_attn[l]);
		tensor(m, ROLE_FFN_NORM, DT_F32, 1, dim, 1.0, 0.1, &m->h_moe[l], &m->d_moe[l]);
		tensor(m, ROLE_ROUTER, DT_F32, EXPERTS, dim, 0, 0.5, &m->h_moe[l], &m->d_moe[l]);
		for (uint32_t e = 0; e < EXPERTS; e++) {
			tensor(m, ROLE_EXPERT_GATE, DT_BF16, F, dim, 0, 0.05, &m->h_exp[l][e], &m->d_exp[l][e]);
			tensor(m, ROLE_EXPERT_UP, DT_BF16, F, dim, 0, 0.05, &m->h_exp[l][e], &m->d_exp[l][e]);
			tensor(m, ROLE_EXPERT_DOWN, DT_BF16, dim, F, 0, std, &m->h_exp[l][e], &m->d_exp[l][e]);
		}
	}
	tensor(m, ROLE_FINAL_NORM, DT_F32, 1, dim, 1.0, 0.1, &m->h_head, &m->d_head);
	tensor(m, ROLE_LM_HEAD, DT_BF16, m->cfg.vocab_size, dim, 0, 0.02, &m->h_head, &m->d_head);
	return m;
}

static void model_free(struct tmodel **mp)
{
	struct tmodel *m = *mp;
	for (uint32_t i = 0; i < m->n_allocs; i++)
		free(m->allocs[i]);
	for (uint32_t i = 0; i < m->n_dallocs; i++)
		CUDA_OK(cudaFree(m->dallocs[i]));
	free(m);
	*mp = NULL;
}

/* ---- driving a backend as the engine does -------------------------------------------------- */

struct run {
	struct backend *be;
	struct tmodel *m;
	bool device; /* the cuda backend: device weights, the odd experts on the CPU */
	bool dev0;   /* ... and layer 0 of a one-token step routed on the device (moe_layer), as the
		      * runner does where the window keeps every expert of a layer */
	uint32_t ends_known, ends_bad; /* routings that measured the layer before's ends; of them (or of
					* the others, a value given) out of place */
};

static void run_open(struct run *r, struct tmodel *m, const char *name, struct task_pool *pool, bool mapped,
		     bool taper)
{
	char err[400] = "";
	memset(r, 0, sizeof(*r));
	r->m = m;
	r->device = strcmp(name, "cpu") != 0;
	struct backend_params p = {.max_chunk = CHUNK, .block_tokens = BT, .n_kv_blocks = LAYERS * (MAX_CTX / BT),
				   .kv_dtype = r->device ? DT_BF16 : DT_F32, .threads = 1,
				   .cpu_pool = r->device ? pool : NULL, .cpu_result_mapped = mapped,
				   .cpu_expert_taper = taper};
	int rc = backend_create(name, &m->cfg, &p, &r->be, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s: %s", name, err);
}

/* The first failure of a step: its code (a failed step's CPU jobs settled, as the engine does). */
static int step_rc(struct run *r, int rc)
{
	if (rc && r->device)
		backend_settle(r->be);
	return rc;
}

/* One step over tokens[0..n) at pos; the last token's logits into out. Returns 0 or the first
 * failure's code (the message in backend_error). */
static int run_step(struct run *r, const int32_t *tok, uint32_t n, uint32_t pos, float *out, uint32_t *cpu_experts)
{
	struct tmodel *m = r->m;
	uint32_t dst_block[CHUNK], dst_row[CHUNK], seq[CHUNK], ps[CHUNK];
	struct kv_span spans[MAX_CTX / BT];
	for (uint32_t i = 0; i < n; i++) {
		ps[i] = pos + i;
		seq[i] = 0;
	}
	struct backend_batch b = {.n = n, .tokens = tok, .pos = ps, .seq = seq};
	int rc = backend_embed(r->be, &m->embed, &b);
	for (uint32_t l = 0; l < LAYERS && !rc; l++) {
		for (uint32_t i = 0; i < n; i++) {
			dst_block[i] = l * (MAX_CTX / BT) + (pos + i) / BT;
			dst_row[i] = (pos + i) % BT;
		}
		const struct group_weights *attn = r->device ? &m->d_attn[l] : &m->h_attn[l];
		uint32_t end = pos + n, ns = 0;
		for (uint32_t k = 0; k * BT < end; k++)
			spans[ns++] = (struct kv_span){.block = l * (MAX_CTX / BT) + k, .pos0 = k * BT,
						       .n_tokens = end - k * BT < BT ? end - k * BT : BT};
		if ((rc = backend_attn_begin(r->be, attn, l, dst_block, dst_row)) ||
		    (rc = backend_attn_blocks(r->be, spans, ns)) || (rc = backend_attn_end(r->be, attn)))
			break;
		if (r->dev0 && n == 1 && l == 0) {
			rc = backend_moe_layer(r->be, &m->d_moe[0], 0);
			continue;
		}
		if ((rc = backend_moe_route(r->be, r->device ? &m->d_moe[l] : &m->h_moe[l])))
			break;
		/* How the layer before's two sides ended (backend_moe_ends): measured only in one-token steps,
		 * never at a step's first routed layer, and within a second either way. */
		int64_t late = 0;
		if (backend_moe_ends(r->be, &late) == 1) {
			r->ends_known++;
			r->ends_bad += n != 1 || l == 0 || late > 1000000000 || late < -1000000000;
		} else {
			r->ends_bad += late != 0;
		}
		bool used[EXPERTS];
		for (uint32_t e = 0; e < EXPERTS; e++)
			used[e] = backend_moe_expert_used(r->be, e);
		/* The odd experts chosen go to the CPU right after the route (--cpu-experts route), from
		 * host memory; the GPU's come after, every expert in order (nothing for one not chosen). */
		for (uint32_t e = 1; r->device && e < EXPERTS && !rc; e += 2)
			if (used[e]) {
				rc = backend_moe_expert_cpu(r->be, &m->h_exp[l][e], e);
				(*cpu_experts)++;
			}
		for (uint32_t e = 0; e < EXPERTS && !rc; e++)
			if (!r->device || e % 2 == 0)
				rc = backend_moe_expert(r->be, r->device ? &m->d_exp[l][e] : &m->h_exp[l][e], e);
		if (!rc)
			rc = backend_moe_end(r->be);
	}
	if (!rc)
		rc = backend_logits(r->be, r->device ? &m->d_head : &m->h_head, out);
	if (!rc && r->device)
		rc = backend_moe_check(r->be); /* the engine's check at a step's end */
	return step_rc(r, rc);
}

static void tokens(int32_t *tok, uint32_t n, uint32_t vocab)
{
	rng_state = 5;
	for (uint32_t i = 0; i < n; i++)
		tok[i] = (int32_t)(rng_next() % vocab);
}

/* The sequence on the reference and on CUDA with the odd experts (of F rows) on the CPU; every
 * step's error within the bound. */
static void compare(bool mapped, bool taper, uint32_t F, bool dev0)
{
	struct tmodel *m = model_new(F);
	const uint32_t vocab = m->cfg.vocab_size;
	int32_t tok[PROMPT + DECODE];
	tokens(tok, PROMPT + DECODE, vocab);
	float *want = malloc(vocab * sizeof(float)), *got = malloc(vocab * sizeof(float));
	ck_assert(want && got);
	struct task_pool *pool = pool_new(4);
	struct run ref, cu;
	run_open(&ref, m, "cpu", NULL, false, false);
	run_open(&cu, m, "cuda", pool, mapped, taper);
	if (dev0) {
		cu.dev0 = true;
		RUN_OK(&cu, backend_moe_layer_experts(cu.be, 0, m->d_exp[0]));
	}
	double worst = 0;
	uint32_t cpu = 0, none = 0;
	for (uint32_t i = 0; i < PROMPT + DECODE;) {
		uint32_t n = i < PROMPT ? (PROMPT - i < CHUNK ? PROMPT - i : CHUNK) : 1;
		RUN_OK(&ref, run_step(&ref, tok + i, n, i, want, &none));
		RUN_OK(&cu, run_step(&cu, tok + i, n, i, got, &cpu));
		double e = rel_l2(got, want, vocab);
		worst = e > worst ? e : worst;
		i += n;
	}
	if (test_verbose())
		fprintf(stderr, "test_cuda_moe_cpu: results %s, chunks %s, experts of %u rows: %u on the CPU, relative L2 "
			"error %.3e\n", mapped ? "mapped" : "copied", taper ? "tapered" : "equal", F, cpu, worst);
	ck_assert_msg(worst < TOL_MOE, "results %s, chunks %s, experts of %u rows: relative L2 error %.3e (bound %g)",
		      mapped ? "mapped" : "copied", taper ? "tapered" : "equal", F, worst, TOL_MOE);
	ck_assert_uint_gt(cpu, 0); /* the routing chose odd experts: the CPU computed some */
	struct backend_cpu_share_stats st;
	backend_get_cpu_share_stats(cu.be, &st);
	ck_assert_uint_eq(st.experts, cpu);
	/* The spans of one-token steps and of steps of several tokens apart (the routes weigh each kind at
	 * its own rate): at most every layer of each decode step in the first, the prompt's chunks of CHUNK
	 * tokens in the second. */
	ck_assert_uint_gt(st.expert_layers, 0);
	ck_assert_uint_le(st.expert_layers, (uint64_t)DECODE * LAYERS);
	ck_assert_uint_gt(st.experts_span_bytes, 0);
	ck_assert_uint_gt(st.expert_layers_multi, 0);
	ck_assert_uint_le(st.expert_layers_multi, (uint64_t)((PROMPT + CHUNK - 1) / CHUNK) * LAYERS);
	ck_assert(st.experts_span_bytes_multi > 0 && st.experts_span_ms_multi > 0);
	/* The layers' ends (backend_moe_ends): measured where one token's CPU experts were waited for on
	 * the stream (results mapped), at most at every decode step's layers but its first routed one
	 * (with layer 0 routed on the device, layer 1 measures nothing: LAYERS is 2); never by the C
	 * reference. */
	ck_assert_uint_eq(cu.ends_bad, 0);
	ck_assert_uint_eq(ref.ends_known + ref.ends_bad, 0);
	ck_assert_uint_le(cu.ends_known, (uint64_t)DECODE * (LAYERS - 1));
	if (mapped && !dev0)
		ck_assert_uint_gt(cu.ends_known, 0);
	if (dev0)
		ck_assert_uint_eq(cu.ends_known, 0);
	/* Steps of the CPU's experts' sizes (at most FFN_SPLIT_MAX_TOKENS tokens: here every one) that
	 * follow one within MOE_STEP_GAP_MAX_MS had their starts timed, on the host and on the GPU's
	 * clock: some, and never the first (no step before it). */
	const uint32_t steps = (PROMPT + CHUNK - 1) / CHUNK + DECODE;
	ck_assert_uint_gt(st.step_begins, 0);
	ck_assert_uint_le(st.step_begins, steps - 1);
	ck_assert(st.step_begin_host_ms > 0 && st.step_begin_wait_ms > 0);
	/* With layer 0 routed on the device, the decode steps' starts are timed at its router: every
	 * one of them (each follows a step), as with the route on the host. */
	if (dev0)
		ck_assert_uint_ge(st.step_begins, DECODE);
	ck_assert(st.step_begin_gpu_embed_ms > 0 && st.step_begin_gpu_attn_ms > 0 && st.step_begin_gpu_router_ms > 0);
	backend_destroy(&cu.be);
	backend_destroy(&ref.be);
	task_pool_destroy(&pool);
	free(want);
	free(got);
	model_free(&m);
}

START_TEST(test_experts_mapped_tapered)
{
	compare(true, true, 256, false);
}
END_TEST

START_TEST(test_experts_first_layer_on_device)
{
	compare(true, true, 256, true);
}
END_TEST

START_TEST(test_experts_mapped_equal)
{
	compare(true, false, 256, false);
}
END_TEST

START_TEST(test_experts_copied)
{
	compare(false, true, 256, false);
}
END_TEST

START_TEST(test_experts_cut_finer)
{
	compare(true, true, 6144, false);
}
END_TEST

/* A CPU expert that fails: its step fails naming it (at the step's check where the stream waited
 * for it, at the layer's end where the host did), and the next steps compute. */
static void failure(bool mapped)
{
	struct tmodel *m = model_new(256);
	const uint32_t vocab = m->cfg.vocab_size;
	int32_t tok[PROMPT + DECODE];
	tokens(tok, PROMPT + DECODE, vocab);
	float *out = malloc(vocab * sizeof(float));
	ck_assert_ptr_nonnull(out);
	struct task_pool *pool = pool_new(4);
	struct run cu;
	run_open(&cu, m, "cuda", pool, mapped, true);
	uint32_t cpu = 0, pos = 0;
	for (; pos < PROMPT; pos += CHUNK)
		RUN_OK(&cu, run_step(&cu, tok + pos, PROMPT - pos < CHUNK ? PROMPT - pos : CHUNK, pos, out, &cpu));
	pos = PROMPT;
	/* Decode until a step has given the CPU an expert with the failure armed. */
	char err[256] = "";
	ck_assert_msg(cuda_test_fail_cpu_expert(cu.be, 1, err, sizeof(err)) == 0, "%s", err);
	int rc = 0;
	uint32_t before = cpu;
	for (; pos < PROMPT + DECODE - 1 && !rc; pos++) {
		before = cpu;
		rc = run_step(&cu, tok + pos, 1, pos, out, &cpu);
	}
	ck_assert_msg(rc == -EIO, "results %s: a failed CPU expert gave %d (%s), %u experts on the CPU after %u",
		      mapped ? "mapped" : "copied", rc, backend_error(cu.be), cpu, before);
	ck_assert_msg(strstr(backend_error(cu.be), "on the CPU") && strstr(backend_error(cu.be), "injected"),
		      "message: %s", backend_error(cu.be));
	/* The failed position again (a failure at a layer's end leaves the later layers' KV of it
	 * unwritten), then the next: both compute. */
	RUN_OK(&cu, run_step(&cu, tok + pos - 1, 1, pos - 1, out, &cpu));
	RUN_OK(&cu, run_step(&cu, tok + pos, 1, pos, out, &cpu));
	for (uint32_t i = 0; i < vocab; i++)
		ck_assert_msg(isfinite(out[i]), "logit %u is %g after the failed step", i, (double)out[i]);
	struct backend_cpu_share_stats st;
	backend_get_cpu_share_stats(cu.be, &st);
	ck_assert_uint_gt(st.experts, 0);
	backend_destroy(&cu.be);
	task_pool_destroy(&pool);
	free(out);
	model_free(&m);
}

START_TEST(test_expert_failure_mapped)
{
	failure(true);
}
END_TEST

START_TEST(test_expert_failure_copied)
{
	failure(false);
}
END_TEST

/* The hook on a backend with no experts on the CPU (no pool) is refused, saying why. */
START_TEST(test_hook_refused_without_pool)
{
	struct tmodel *m = model_new(256);
	struct run cu;
	run_open(&cu, m, "cuda", NULL, true, true);
	char err[256] = "";
	ck_assert_int_eq(cuda_test_fail_cpu_expert(cu.be, 1, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "no experts on the CPU"), "message: %s", err);
	backend_destroy(&cu.be);
	model_free(&m);
}
END_TEST

static Suite *suite(void)
{
	Suite *s = suite_create("cuda_moe_cpu");
	TCase *tc = tcase_create("logits");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_experts_mapped_tapered);
	tcase_add_test(tc, test_experts_mapped_equal);
	tcase_add_test(tc, test_experts_first_layer_on_device);
	tcase_add_test(tc, test_experts_copied);
	tcase_add_test(tc, test_experts_cut_finer);
	suite_add_tcase(s, tc);
	tc = tcase_create("errors");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_expert_failure_mapped);
	tcase_add_test(tc, test_expert_failure_copied);
	tcase_add_test(tc, test_hook_refused_without_pool);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return gpu_suite_main("test_cuda_moe_cpu", suite);
}

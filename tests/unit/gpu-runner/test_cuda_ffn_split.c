/* test_cuda_ffn_split.c - the CUDA backend's split FFN (backend.h, struct ffn_split) against the
 * C reference's whole FFN (LABELS gpu).
 *
 * A small random model (dim 256, ffn 768, two layers) in F32, BF16, Q8_0 or Q4_K matrices is
 * laid out as the GPU window lays out a split layer: gate and up rows [0, r) and down's columns
 * [0, r) in device memory, compact (down copied with cudaMemcpy2D from the full rows), the rest
 * of the FFN read in place from host memory by the CPU task pool (FFN_SPLIT_CPU), or, for prefill
 * chunks, a device copy of it computed by the GPU (FFN_SPLIT_BACKEND). The sequence (a prompt in
 * chunks of 8, then single tokens) runs on the reference with whole FFNs and on CUDA split at r =
 * 0 (all of the FFN on the CPU), one unit, half and the last unit below ffn, for both handoffs
 * (host functions; stream memory operations where the driver has them), and the logits of every
 * step are compared: F32 within 1e-4, the rest within 2e-2 (BF16 activations and KV). Then a CPU
 * share that fails (cuda_test.h's hook) fails the step at the logits with its message, and the
 * next step computes again. PIPELINE_TEST_VERBOSE=1 prints each error measured.
 *
 * Without a GPU the program exits 77 (ctest: skipped). */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "common/quant.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/cuda/cuda_test.h"
#include "services/gpu-runner/weights.h"
#include "tests/unit/gpu-runner/cuda_test_util.h"
#include "tests/unit/gpu-runner/runner_test_util.h"

#define TOL_F32 1e-4
#define TOL_16 2e-2
#define PROMPT 20
#define CHUNK 8
#define DECODE 6
#define MAX_CTX 64
#define BT 16
#define MAX_ALLOCS 256

struct tmodel {
	struct model_config cfg;
	enum dtype wt;			 /* the matrices' format */
	struct group_weights embed, h_attn[2], h_ffn[2], h_head, d_attn[2], d_ffn_norm[2], d_head;
	void *allocs[MAX_ALLOCS], *dallocs[MAX_ALLOCS];
	uint32_t n_allocs, n_dallocs;
};

static void *keep(struct tmodel *m, void *p)
{
	ck_assert_ptr_nonnull(p);
	ck_assert_uint_lt(m->n_allocs, MAX_ALLOCS);
	return m->allocs[m->n_allocs++] = p;
}

static void *dev_alloc(struct tmodel *m, size_t bytes)
{
	void *d = NULL;
	CUDA_OK(cudaMalloc(&d, bytes ? bytes : 256));
	ck_assert_uint_lt(m->n_dallocs, MAX_ALLOCS);
	return m->dallocs[m->n_dallocs++] = d;
}

static void *upload(struct tmodel *m, const void *src, size_t bytes)
{
	void *d = dev_alloc(m, bytes);
	CUDA_OK(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice));
	CUDA_OK(cudaDeviceSynchronize()); /* the DMA of a pageable copy may land after it returns */
	return d;
}

/* rows x cols values mean + std N(0, 1) in format f: host bytes. */
static void *draw(struct tmodel *m, enum dtype f, uint32_t rows, uint32_t cols, double mean, double std)
{
	size_t n = (size_t)rows * cols;
	float *v = malloc(n * sizeof(float));
	ck_assert_ptr_nonnull(v);
	for (size_t i = 0; i < n; i++)
		v[i] = (float)(mean + std * rng_normal());
	void *out = keep(m, malloc(dtype_row_bytes(f, cols) * rows));
	if (f == DT_F32) {
		memcpy(out, v, n * sizeof(float));
	} else if (f == DT_BF16) {
		for (size_t i = 0; i < n; i++)
			((uint16_t *)out)[i] = f32_to_bf16(v[i]);
	} else {
		for (uint32_t r = 0; r < rows; r++)
			quant_quantize(f, v + (size_t)r * cols, (char *)out + r * dtype_row_bytes(f, cols), cols);
	}
	free(v);
	return out;
}

/* Tensor role r (format f, shape from the config): host copy into h, device copy into d. */
static void tensor(struct tmodel *m, enum tensor_role r, enum dtype f, double mean, double std, struct group_weights *h,
		   struct group_weights *d)
{
	uint32_t ndim;
	uint64_t shape[2];
	ck_assert_int_eq(model_expected_shape(&m->cfg, r, &ndim, shape), 0);
	uint32_t rows = ndim == 1 ? 1 : (uint32_t)shape[0], cols = (uint32_t)(ndim == 1 ? shape[0] : shape[1]);
	void *host = draw(m, f, rows, cols, mean, std);
	weight_tensor_set(&h->t[r], PLACE_HOST, host, f, rows, cols);
	if (d)
		weight_tensor_set(&d->t[r], PLACE_DEVICE, upload(m, host, dtype_row_bytes(f, cols) * rows), f, rows, cols);
}

static struct tmodel *model_new(enum dtype wt)
{
	struct tmodel *m = calloc(1, sizeof(*m));
	ck_assert_ptr_nonnull(m);
	m->cfg = (struct model_config){.arch = ARCH_LLAMA, .n_layers = 2, .dim = 256, .n_heads = 4, .n_kv_heads = 2,
				       .head_dim = 64, .ffn_dim = 768, .vocab_size = 512, .max_position = 4096,
				       .rms_eps = 1e-5f, .rope_theta = 10000.0f, .rope_scaling = ROPE_SCALING_NONE,
				       .bos_id = -1};
	m->wt = wt;
	rng_state = 77;
	enum dtype act = dtype_is_element(wt) ? wt : DT_BF16, norm = DT_F32;
	tensor(m, ROLE_EMBED, act, 0, 0.02, &m->embed, NULL);
	for (uint32_t l = 0; l < 2; l++) {
		tensor(m, ROLE_ATTN_NORM, norm, 1.0, 0.1, &m->h_attn[l], &m->d_attn[l]);
		tensor(m, ROLE_WQ, wt, 0, 0.02, &m->h_attn[l], &m->d_attn[l]);
		tensor(m, ROLE_WK, wt, 0, 0.02, &m->h_attn[l], &m->d_attn[l]);
		tensor(m, ROLE_WV, wt, 0, 0.02, &m->h_attn[l], &m->d_attn[l]);
		tensor(m, ROLE_WO, wt, 0, 0.02, &m->h_attn[l], &m->d_attn[l]);
		tensor(m, ROLE_FFN_NORM, norm, 1.0, 0.1, &m->h_ffn[l], &m->d_ffn_norm[l]);
		tensor(m, ROLE_W_GATE, wt, 0, 0.02, &m->h_ffn[l], NULL);
		tensor(m, ROLE_W_UP, wt, 0, 0.02, &m->h_ffn[l], NULL);
		tensor(m, ROLE_W_DOWN, wt, 0, 0.02, &m->h_ffn[l], NULL);
	}
	tensor(m, ROLE_FINAL_NORM, norm, 1.0, 0.1, &m->h_head, &m->d_head);
	tensor(m, ROLE_LM_HEAD, act, 0, 0.02, &m->h_head, &m->d_head);
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

/* Rows [r0, r0 + rows) x columns [c0, c0 + cols) of a host matrix (row_bytes apart) into compact
 * device memory, described as that slice. */
static void dev_slice(struct tmodel *m, const struct weight_tensor *h, uint32_t r0, uint32_t rows, uint32_t c0,
		      uint32_t cols, struct weight_tensor *out)
{
	enum dtype f = (enum dtype)h->format;
	uint64_t w = dtype_row_bytes(f, cols);
	void *d = dev_alloc(m, w * rows);
	if (rows && cols)
		CUDA_OK(cudaMemcpy2D(d, w,
				     (const char *)h->data[PLACE_HOST] + r0 * h->row_bytes + dtype_row_bytes(f, c0),
				     h->row_bytes, w, rows, cudaMemcpyHostToDevice));
	weight_tensor_set(out, PLACE_DEVICE, d, f, rows, cols);
	out->row0 = r0;
	out->col0 = c0;
}

/* The FFN group of layer l split at r as the window hands it over: the first share on the device;
 * the second in host memory in place (cpu) or a device copy (backend). */
static void split_groups(struct tmodel *m, uint32_t l, uint32_t r, struct group_weights *cpu,
			 struct group_weights *backend)
{
	const struct group_weights *h = &m->h_ffn[l];
	uint32_t ffn = m->cfg.ffn_dim, dim = m->cfg.dim;
	memset(cpu, 0, sizeof(*cpu));
	cpu->t[ROLE_FFN_NORM] = m->d_ffn_norm[l].t[ROLE_FFN_NORM];
	if (r) {
		dev_slice(m, &h->t[ROLE_W_GATE], 0, r, 0, dim, &cpu->t[ROLE_W_GATE]);
		dev_slice(m, &h->t[ROLE_W_UP], 0, r, 0, dim, &cpu->t[ROLE_W_UP]);
		dev_slice(m, &h->t[ROLE_W_DOWN], 0, dim, 0, r, &cpu->t[ROLE_W_DOWN]);
	}
	struct group_weights whole = *h;
	weights_split_ffn(&whole, r, FFN_SPLIT_CPU);
	cpu->split = whole.split;
	*backend = *cpu;
	backend->split.where = FFN_SPLIT_BACKEND;
	dev_slice(m, &h->t[ROLE_W_GATE], r, ffn - r, 0, dim, &backend->split.gate);
	dev_slice(m, &h->t[ROLE_W_UP], r, ffn - r, 0, dim, &backend->split.up);
	dev_slice(m, &h->t[ROLE_W_DOWN], 0, dim, r, ffn - r, &backend->split.down);
}

/* ---- driving a backend as the engine does -------------------------------------------------- */

struct run {
	struct backend *be;
	struct tmodel *m;
	bool device;
	struct group_weights cpu[2], backend[2]; /* split FFN groups (device runs) */
	bool cpu_in_prefill;			 /* prefill chunks split with FFN_SPLIT_CPU too */
};

static void run_open(struct run *r, struct tmodel *m, const char *name, struct task_pool *pool, uint32_t handoff,
		     int *rc_out)
{
	char err[400] = "";
	memset(r, 0, sizeof(*r));
	r->m = m;
	r->device = strcmp(name, "cpu") != 0;
	struct backend_params p = {.max_chunk = CHUNK, .block_tokens = BT, .n_kv_blocks = 2 * (MAX_CTX / BT),
				   .kv_dtype = r->device && m->wt != DT_F32 ? DT_BF16 : DT_F32, .threads = 1,
				   .cpu_pool = r->device ? pool : NULL, .cpu_handoff = handoff};
	int rc = backend_create(name, &m->cfg, &p, &r->be, err, sizeof(err));
	if (rc_out) {
		*rc_out = rc;
		if (rc)
			return;
	}
	ck_assert_msg(rc == 0, "%s: %s", name, err);
}

/* One step over tokens[0..n) at pos; the last token's logits into out. Returns the logits' rc. */
/* The first `layers` layers of a step (no logits: the host never waits for it). */
static int run_layers(struct run *r, const int32_t *tok, uint32_t n, uint32_t pos, uint32_t layers)
{
	struct tmodel *m = r->m;
	uint32_t dst_block[CHUNK], dst_row[CHUNK], seq[CHUNK], ps[CHUNK];
	struct kv_span spans[MAX_CTX / BT];
	for (uint32_t i = 0; i < n; i++) {
		ps[i] = pos + i;
		seq[i] = 0;
	}
	struct backend_batch b = {.n = n, .tokens = tok, .pos = ps, .seq = seq};
	RUN_OK(r, backend_embed(r->be, &m->embed, &b));
	for (uint32_t l = 0; l < layers; l++) {
		for (uint32_t i = 0; i < n; i++) {
			dst_block[i] = l * (MAX_CTX / BT) + (pos + i) / BT;
			dst_row[i] = (pos + i) % BT;
		}
		RUN_OK(r, backend_attn_begin(r->be, r->device ? &m->d_attn[l] : &m->h_attn[l], l, dst_block, dst_row));
		uint32_t end = pos + n, ns = 0;
		for (uint32_t k = 0; k * BT < end; k++)
			spans[ns++] = (struct kv_span){.block = l * (MAX_CTX / BT) + k, .pos0 = k * BT,
						       .n_tokens = end - k * BT < BT ? end - k * BT : BT};
		RUN_OK(r, backend_attn_blocks(r->be, spans, ns));
		RUN_OK(r, backend_attn_end(r->be, r->device ? &m->d_attn[l] : &m->h_attn[l]));
		const struct group_weights *f = &m->h_ffn[l];
		if (r->device)
			f = n == 1 || r->cpu_in_prefill ? &r->cpu[l] : &r->backend[l];
		RUN_OK(r, backend_ffn(r->be, f));
	}
	return 0;
}

static int run_step(struct run *r, const int32_t *tok, uint32_t n, uint32_t pos, float *out)
{
	int rc = run_layers(r, tok, n, pos, 2);
	return rc ? rc : backend_logits(r->be, r->device ? &r->m->d_head : &r->m->h_head, out);
}

/* The sequence on the reference (whole FFNs) and on CUDA split at r; the worst step's error.
 * Returns -1 when the handoff is not available here (memops without driver support). */
static double compare(struct tmodel *m, uint32_t r, uint32_t handoff, bool cpu_in_prefill, const char *what)
{
	uint32_t vocab = m->cfg.vocab_size;
	int32_t tok[PROMPT + DECODE];
	rng_state = 5;
	for (uint32_t i = 0; i < PROMPT + DECODE; i++)
		tok[i] = (int32_t)(rng_next() % vocab);
	float *want = malloc(vocab * sizeof(float)), *got = malloc(vocab * sizeof(float));
	ck_assert(want && got);
	struct task_pool *pool = pool_new(4);
	struct run ref, cu;
	int rc = 0;
	run_open(&ref, m, "cpu", NULL, 0, NULL);
	run_open(&cu, m, "cuda", pool, handoff, &rc);
	if (rc == -ENOTSUP && handoff == BACKEND_HANDOFF_MEMOPS) {
		fprintf(stderr, "test_cuda_ffn_split: %s: memops not available here: skipped\n", what);
		backend_destroy(&ref.be);
		task_pool_destroy(&pool);
		free(want);
		free(got);
		return -1;
	}
	ck_assert_int_eq(rc, 0);
	cu.cpu_in_prefill = cpu_in_prefill;
	for (uint32_t l = 0; l < 2; l++)
		split_groups(m, l, l == 0 ? r : m->cfg.ffn_dim - ffn_split_unit(m->wt), &cu.cpu[l], &cu.backend[l]);
	double worst = 0;
	for (uint32_t i = 0; i < PROMPT + DECODE;) {
		uint32_t n = i < PROMPT ? (PROMPT - i < CHUNK ? PROMPT - i : CHUNK) : 1;
		RUN_OK(&ref, run_step(&ref, tok + i, n, i, want));
		RUN_OK(&cu, run_step(&cu, tok + i, n, i, got));
		double e = rel_l2(got, want, vocab);
		worst = e > worst ? e : worst;
		i += n;
	}
	if (test_verbose())
		fprintf(stderr, "test_cuda_ffn_split: %-64s relative L2 error %.3e\n", what, worst);
	backend_destroy(&cu.be);
	backend_destroy(&ref.be);
	task_pool_destroy(&pool);
	free(want);
	free(got);
	return worst;
}

static void check_format(enum dtype wt)
{
	struct tmodel *m = model_new(wt);
	uint32_t u = ffn_split_unit(wt), ffn = m->cfg.ffn_dim;
	uint32_t rs[4] = {0, u, ffn / 2 / u * u, ffn - u};
	double tol = wt == DT_F32 ? TOL_F32 : TOL_16;
	static const uint32_t modes[2] = {BACKEND_HANDOFF_HOSTFUNC, BACKEND_HANDOFF_MEMOPS};
	for (uint32_t i = 0; i < 4; i++) {
		if (i > 0 && rs[i] == rs[i - 1])
			continue;
		for (uint32_t k = 0; k < 2; k++) {
			for (uint32_t cp = 0; cp < 2; cp++) {
				char what[160];
				snprintf(what, sizeof(what), "%s, r %u of %u, %s, prefill %s", dtype_name(wt), rs[i], ffn,
					 modes[k] == BACKEND_HANDOFF_HOSTFUNC ? "hostfunc" : "memops",
					 cp ? "on the CPU too" : "on the GPU");
				double e = compare(m, rs[i], modes[k], cp != 0, what);
				ck_assert_msg(e < tol, "%s: relative L2 error %.3e (bound %g)", what, e, tol);
			}
		}
	}
	model_free(&m);
}

START_TEST(test_split_f32)
{
	check_format(DT_F32);
}
END_TEST

START_TEST(test_split_bf16)
{
	check_format(DT_BF16);
}
END_TEST

START_TEST(test_split_q8_0)
{
	check_format(DT_Q8_0);
}
END_TEST

START_TEST(test_split_q4_k)
{
	check_format(DT_Q4_K);
}
END_TEST

/* A CPU share that fails: the step fails at the logits, naming it; the next step computes. */
START_TEST(test_cpu_share_failure)
{
	struct tmodel *m = model_new(DT_BF16);
	struct task_pool *pool = pool_new(4);
	struct run cu;
	run_open(&cu, m, "cuda", pool, BACKEND_HANDOFF_DEFAULT, NULL);
	for (uint32_t l = 0; l < 2; l++)
		split_groups(m, l, m->cfg.ffn_dim / 2, &cu.cpu[l], &cu.backend[l]);
	float *out = malloc(m->cfg.vocab_size * sizeof(float));
	ck_assert_ptr_nonnull(out);
	int32_t tok[4] = {3, 9, 27, 81};
	char err[256] = "";
	RUN_OK(&cu, run_step(&cu, tok, 1, 0, out));
	/* The second job from now: layer 1 of the next step. */
	ck_assert_msg(cuda_test_fail_cpu_share(cu.be, 2, err, sizeof(err)) == 0, "%s", err);
	int rc = run_step(&cu, tok + 1, 1, 1, out);
	ck_assert_int_eq(rc, -EIO);
	ck_assert_msg(strstr(backend_error(cu.be), "CPU share failed") && strstr(backend_error(cu.be), "injected"),
		      "message: %s", backend_error(cu.be));
	RUN_OK(&cu, run_step(&cu, tok + 2, 1, 2, out));
	backend_destroy(&cu.be);
	task_pool_destroy(&pool);
	free(out);
	model_free(&m);
}
END_TEST

/* A step that fails on the way after its CPU share failed (as a step fails when a service goes
 * away between layers): settled as the engine settles it, the share's failure is not the next
 * step's, which computes. */
START_TEST(test_cpu_share_failure_settled)
{
	struct tmodel *m = model_new(DT_BF16);
	struct task_pool *pool = pool_new(4);
	struct run cu;
	run_open(&cu, m, "cuda", pool, BACKEND_HANDOFF_DEFAULT, NULL);
	for (uint32_t l = 0; l < 2; l++)
		split_groups(m, l, m->cfg.ffn_dim / 2, &cu.cpu[l], &cu.backend[l]);
	float *out = malloc(m->cfg.vocab_size * sizeof(float));
	ck_assert_ptr_nonnull(out);
	int32_t tok[4] = {3, 9, 27, 81};
	char err[256] = "";
	RUN_OK(&cu, run_step(&cu, tok, 1, 0, out));
	/* Layer 0's job of the next step fails; the step ends after layer 0, its logits never asked. */
	ck_assert_msg(cuda_test_fail_cpu_share(cu.be, 1, err, sizeof(err)) == 0, "%s", err);
	RUN_OK(&cu, run_layers(&cu, tok + 1, 1, 1, 1));
	backend_settle(cu.be);
	/* The same position again, as a retried request would. */
	RUN_OK(&cu, run_step(&cu, tok + 1, 1, 1, out));
	RUN_OK(&cu, run_step(&cu, tok + 2, 1, 2, out));
	backend_destroy(&cu.be);
	task_pool_destroy(&pool);
	free(out);
	model_free(&m);
}
END_TEST

/* A CPU share on a backend made without a pool is refused. */
START_TEST(test_cpu_share_without_pool)
{
	struct tmodel *m = model_new(DT_BF16);
	struct run cu;
	run_open(&cu, m, "cuda", NULL, BACKEND_HANDOFF_DEFAULT, NULL);
	for (uint32_t l = 0; l < 2; l++)
		split_groups(m, l, m->cfg.ffn_dim / 2, &cu.cpu[l], &cu.backend[l]);
	uint32_t pos = 0, seq = 0;
	int32_t tok = 1;
	struct backend_batch b = {.n = 1, .tokens = &tok, .pos = &pos, .seq = &seq};
	RUN_OK(&cu, backend_embed(cu.be, &m->embed, &b));
	ck_assert_int_eq(backend_ffn(cu.be, &cu.cpu[0]), -ENOTSUP);
	ck_assert_msg(strstr(backend_error(cu.be), "CPU pool"), "message: %s", backend_error(cu.be));
	backend_destroy(&cu.be);
	model_free(&m);
}
END_TEST

static Suite *suite(void)
{
	Suite *s = suite_create("cuda_ffn_split");
	TCase *tc = tcase_create("logits");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_split_f32);
	tcase_add_test(tc, test_split_bf16);
	tcase_add_test(tc, test_split_q8_0);
	tcase_add_test(tc, test_split_q4_k);
	suite_add_tcase(s, tc);
	tc = tcase_create("errors");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_cpu_share_failure);
	tcase_add_test(tc, test_cpu_share_failure_settled);
	tcase_add_test(tc, test_cpu_share_without_pool);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return gpu_suite_main("test_cuda_ffn_split", suite);
}

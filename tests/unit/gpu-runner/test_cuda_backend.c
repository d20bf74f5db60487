/* test_cuda_backend.c - the CUDA backend against the C reference backend (LABELS gpu).
 *
 * Small random models (normal weights of std 0.02, norms 1 + small noise) are built on the host;
 * the C reference runs on the host copies, the CUDA backend on device copies (the embedding
 * table stays host memory, as backend.h says; with tied embeddings the head's lm_head is a
 * device copy of it). Both are driven as the engine drives them (embed; per layer attn_begin,
 * attn_blocks, attn_end, ffn; logits), with KV blocks managed here, and the logits of every
 * step are compared by relative L2 error: F32 weights and F32 KV within 1e-4, 16-bit weights
 * and BF16 KV within 2e-2 (PIPELINE_TEST_VERBOSE=1 prints each error measured).
 *
 * Timings of the same kernels on a Llama-3-8B shape are a benchmark, not a test:
 * tools/bench-kernels.
 *
 * Without a GPU the program exits 77 (ctest: skipped). CUDA is never touched by the parent
 * process before fork: each test's child initialises it on its own. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "common/dtype.h"
#include "common/model.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/cuda/cuda_test.h"
#include "tests/unit/gpu-runner/cuda_test_util.h"
#include "tests/unit/gpu-runner/runner_test_util.h"

#define TOL_F32 1e-4  /* F32 weights, F32 KV: relative L2 error of the logits */
#define TOL_16 2e-2   /* BF16/F16 weights, BF16 or F32 KV */
#define MAX_CTX 640   /* positions a test sequence may use */
#define MAX_ALLOCS 512

static void report(const char *what, double err)
{
	if (test_verbose())
		fprintf(stderr, "test_cuda_backend: %-52s relative L2 error %.3e\n", what, err);
}

/* ---- test models -------------------------------------------------------------------------- */

/* Host weights for the reference (h_*) and device copies for CUDA (d_*); the embed group is
 * host memory for both. */
struct tmodel {
	struct model_config cfg;
	enum dtype wt;
	struct group_weights embed_w, h_head, d_head;
	struct group_weights *h_attn, *h_ffn, *d_attn, *d_ffn; /* (n_layers) */
	void *allocs[MAX_ALLOCS];
	uint32_t n_allocs;
	void *dallocs[MAX_ALLOCS];
	uint32_t n_dallocs;
};

static void *track(struct tmodel *m, void *p)
{
	ck_assert_ptr_nonnull(p);
	ck_assert_uint_lt(m->n_allocs, MAX_ALLOCS);
	m->allocs[m->n_allocs++] = p;
	return p;
}

static void *upload(struct tmodel *m, const void *src, size_t bytes)
{
	void *d = NULL;
	CUDA_OK(cudaMalloc(&d, bytes));
	CUDA_OK(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice));
	CUDA_OK(cudaDeviceSynchronize()); /* the DMA of a pageable copy may land after it returns */
	ck_assert_uint_lt(m->n_dallocs, MAX_ALLOCS);
	m->dallocs[m->n_dallocs++] = d;
	return d;
}

/* Tensor role r of the model at data in place, with the shape the config gives it. */
static void set_tensor(const struct tmodel *m, struct group_weights *g, enum tensor_role r, enum weight_place place,
		       const void *data)
{
	uint32_t ndim;
	uint64_t shape[2];
	ck_assert_int_eq(model_expected_shape(&m->cfg, r, &ndim, shape), 0);
	weight_tensor_set(&g->t[r], place, data, m->wt, ndim == 1 ? 1 : (uint32_t)shape[0],
			  (uint32_t)(ndim == 1 ? shape[0] : shape[1]));
}

/* A tensor of n values mean + std * N(0,1) in the model's dtype: host copy into h->t[role],
 * device copy into d->t[role] (d NULL: host only). */
static void *tensor(struct tmodel *m, size_t n, double mean, double std, struct group_weights *h,
		    struct group_weights *d, enum tensor_role role)
{
	void *enc = track(m, malloc(n * dtype_size(m->wt)));
	for (size_t i = 0; i < n; i++) {
		float f = (float)(mean + std * rng_normal());
		if (m->wt == DT_F32)
			((float *)enc)[i] = f;
		else if (m->wt == DT_BF16)
			((uint16_t *)enc)[i] = f32_to_bf16(f);
		else
			((uint16_t *)enc)[i] = f32_to_f16(f);
	}
	set_tensor(m, h, role, PLACE_HOST, enc);
	if (d)
		set_tensor(m, d, role, PLACE_DEVICE, upload(m, enc, n * dtype_size(m->wt)));
	return enc;
}

static struct model_config base_cfg(void)
{
	struct model_config c = {
		.arch = ARCH_LLAMA, .n_layers = 2, .dim = 64, .n_heads = 4, .n_kv_heads = 2, .head_dim = 16,
		.ffn_dim = 192, .vocab_size = 512, .max_position = 131072, .rms_eps = 1e-5f, .rope_theta = 10000.0f,
		.rope_scaling = ROPE_SCALING_NONE, .bos_id = -1,
	};
	return c;
}

static struct tmodel *model_new(const struct model_config *cfg, enum dtype wt, uint64_t seed)
{
	struct tmodel *m = calloc(1, sizeof(*m));
	ck_assert_ptr_nonnull(m);
	m->cfg = *cfg;
	m->wt = wt;
	rng_state = seed;
	const struct model_config *c = &m->cfg;
	size_t qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
	m->h_attn = track(m, calloc(c->n_layers, sizeof(*m->h_attn)));
	m->h_ffn = track(m, calloc(c->n_layers, sizeof(*m->h_ffn)));
	m->d_attn = track(m, calloc(c->n_layers, sizeof(*m->d_attn)));
	m->d_ffn = track(m, calloc(c->n_layers, sizeof(*m->d_ffn)));
	void *embed = tensor(m, (size_t)c->vocab_size * c->dim, 0, 0.02, &m->embed_w, NULL, ROLE_EMBED);
	for (uint32_t l = 0; l < c->n_layers; l++) {
		struct group_weights *ha = &m->h_attn[l], *hf = &m->h_ffn[l], *da = &m->d_attn[l], *df = &m->d_ffn[l];
		tensor(m, c->dim, 1.0, 0.1, ha, da, ROLE_ATTN_NORM);
		tensor(m, qd * c->dim, 0, 0.02, ha, da, ROLE_WQ);
		tensor(m, kvd * c->dim, 0, 0.02, ha, da, ROLE_WK);
		tensor(m, kvd * c->dim, 0, 0.02, ha, da, ROLE_WV);
		tensor(m, (size_t)c->dim * qd, 0, 0.02, ha, da, ROLE_WO);
		tensor(m, c->dim, 1.0, 0.1, hf, df, ROLE_FFN_NORM);
		tensor(m, (size_t)c->ffn_dim * c->dim, 0, 0.02, hf, df, ROLE_W_GATE);
		tensor(m, (size_t)c->ffn_dim * c->dim, 0, 0.02, hf, df, ROLE_W_UP);
		tensor(m, (size_t)c->dim * c->ffn_dim, 0, 0.02, hf, df, ROLE_W_DOWN);
	}
	tensor(m, c->dim, 1.0, 0.1, &m->h_head, &m->d_head, ROLE_FINAL_NORM);
	if (c->tie_embeddings) {
		/* The head's lm_head is the embed table: host for the reference, a device copy for CUDA. */
		size_t bytes = (size_t)c->vocab_size * c->dim * dtype_size(wt);
		set_tensor(m, &m->h_head, ROLE_LM_HEAD, PLACE_HOST, embed);
		set_tensor(m, &m->d_head, ROLE_LM_HEAD, PLACE_DEVICE, upload(m, embed, bytes));
	} else {
		tensor(m, (size_t)c->vocab_size * c->dim, 0, 0.02, &m->h_head, &m->d_head, ROLE_LM_HEAD);
	}
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

static void make_prompt(int32_t *tok, uint32_t n, uint32_t vocab, uint64_t seed)
{
	rng_state = seed;
	for (uint32_t i = 0; i < n; i++)
		tok[i] = (int32_t)(rng_next() % vocab);
}

/* ---- driving a backend like the engine ---------------------------------------------------- */

enum span_mode {
	SPANS_IN_ORDER = 0, /* one attn_blocks call, blocks in position order */
	SPANS_REVERSE = 1,  /* one attn_blocks call per block, last block first */
	SPANS_PIECES = 2,   /* odd blocks in one call, then even blocks in another */
};

struct runner {
	const char *name; /* "cuda" or "cpu" */
	struct backend *be;
	struct backend_params p;
	const struct tmodel *m;
	bool device;	/* device weights (CUDA) or host weights (reference) */
	uint32_t base;	/* first position of the sequence */
	uint32_t bpl;	/* blocks per layer */
};

/* The kernel choices of the CUDA runners a test opens (backend_params.gemv, .attn). */
static uint32_t knob_gemv = BACKEND_GEMV_DEFAULT, knob_attn = BACKEND_ATTN_DEFAULT, knob_fuse = BACKEND_FUSE_DEFAULT;

static struct backend_params params(uint32_t max_chunk, uint32_t block_tokens, enum dtype kv)
{
	return (struct backend_params){.max_chunk = max_chunk, .block_tokens = block_tokens,
				       .kv_dtype = kv, .threads = 1, .gemv = knob_gemv, .attn = knob_attn,
				       .fuse = knob_fuse};
}

/* p.n_kv_blocks is set here: MAX_CTX positions per layer. */
static void runner_open(struct runner *r, const char *name, const struct tmodel *m, struct backend_params p,
			uint32_t base)
{
	char err[400] = "";
	r->name = name;
	r->m = m;
	r->device = strcmp(name, "cpu") != 0;
	r->base = base;
	r->bpl = (MAX_CTX + p.block_tokens - 1) / p.block_tokens;
	p.n_kv_blocks = m->cfg.n_layers * r->bpl;
	r->p = p;
	int rc = backend_create(name, &m->cfg, &p, &r->be, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s create: %d %s", name, rc, err);
}

static void runner_close(struct runner *r)
{
	backend_destroy(&r->be);
	ck_assert_ptr_null(r->be);
	backend_destroy(&r->be); /* safe twice */
}

/* embed of tokens[0..n) at consecutive positions from pos0, one sequence (as the engine). */
static int embed(struct backend *be, const struct group_weights *w, const int32_t *tok, uint32_t n, uint32_t pos0)
{
	static uint32_t pos[MAX_CTX + 1], seq[MAX_CTX + 1];
	ck_assert_uint_le(n, MAX_CTX + 1);
	for (uint32_t i = 0; i < n; i++) {
		pos[i] = pos0 + i;
		seq[i] = 0;
	}
	struct backend_batch b = {.n = n, .tokens = tok, .pos = pos, .seq = seq};
	return backend_embed(be, w, &b);
}

static int sample(struct backend *be, const struct group_weights *w, float t, uint32_t k, float p, float mp, double u,
		  int32_t *tok)
{
	struct sampler_params sp = {.temperature = t, .top_k = k, .top_p = p, .min_p = mp};
	return backend_logits_sample(be, w, &sp, u, tok);
}

/* One arena block to and from host memory. */
static int kv_out(struct backend *be, uint32_t block, void *dst)
{
	return backend_kv_to_host(be, 1, &block, &dst);
}

static int kv_in(struct backend *be, uint32_t block, const void *src)
{
	return backend_kv_from_host(be, 1, &block, &src);
}

#define CHECK_RC(r, expr)                                                                         \
	do {                                                                                      \
		int rc_ = (expr);                                                                 \
		ck_assert_msg(rc_ == 0, "%s: %s: %d %s", (r)->name, #expr, rc_,                    \
			      backend_error((r)->be));                                            \
	} while (0)

static uint32_t block_of(const struct runner *r, uint32_t layer, uint32_t pos)
{
	return layer * r->bpl + (pos - r->base) / r->p.block_tokens;
}

/* One forward step over tokens[0..n) at positions pos.. ; logits (or, with argmax, the id of
 * the largest through logits_argmax) of the last token. */
static void runner_step(struct runner *r, const int32_t *tok, uint32_t n, uint32_t pos, enum span_mode mode,
			float *logits, int32_t *argmax)
{
	const struct tmodel *m = r->m;
	uint32_t bt = r->p.block_tokens, dst_block[MAX_CTX], dst_row[MAX_CTX];
	struct kv_span spans[MAX_CTX], part[MAX_CTX];
	ck_assert_uint_le(pos + n - r->base, MAX_CTX);
	CHECK_RC(r, embed(r->be, &m->embed_w, tok, n, pos));
	for (uint32_t l = 0; l < m->cfg.n_layers; l++) {
		for (uint32_t i = 0; i < n; i++) {
			dst_block[i] = block_of(r, l, pos + i);
			dst_row[i] = (pos + i - r->base) % bt;
		}
		const struct group_weights *aw = r->device ? &m->d_attn[l] : &m->h_attn[l];
		const struct group_weights *fw = r->device ? &m->d_ffn[l] : &m->h_ffn[l];
		CHECK_RC(r, backend_attn_begin(r->be, aw, l, dst_block, dst_row));
		uint32_t end = pos + n - r->base, ns = 0;
		for (uint32_t b = 0; b * bt < end; b++) {
			uint32_t cnt = end - b * bt < bt ? end - b * bt : bt;
			spans[ns++] = (struct kv_span){.block = l * r->bpl + b, .pos0 = r->base + b * bt, .n_tokens = cnt};
		}
		if (mode == SPANS_IN_ORDER) {
			CHECK_RC(r, backend_attn_blocks(r->be, spans, ns));
		} else if (mode == SPANS_REVERSE) {
			for (uint32_t s = ns; s-- > 0;)
				CHECK_RC(r, backend_attn_blocks(r->be, &spans[s], 1));
		} else {
			for (uint32_t pass = 0; pass < 2; pass++) {
				uint32_t np = 0;
				for (uint32_t s = pass == 0 ? 1 : 0; s < ns; s += 2)
					part[np++] = spans[s];
				CHECK_RC(r, backend_attn_blocks(r->be, part, np));
			}
		}
		CHECK_RC(r, backend_attn_end(r->be, aw));
		CHECK_RC(r, backend_ffn(r->be, fw));
	}
	const struct group_weights *hw = r->device ? &m->d_head : &m->h_head;
	if (argmax)
		CHECK_RC(r, backend_logits_argmax(r->be, hw, argmax));
	else
		CHECK_RC(r, backend_logits(r->be, hw, logits));
}

/* Lowest id on ties, as logits_argmax promises. */
static int32_t host_argmax(const float *v, uint32_t n)
{
	int32_t best = 0;
	for (uint32_t i = 1; i < n; i++)
		if (v[i] > v[best])
			best = (int32_t)i;
	return best;
}

struct schedule {
	uint32_t base;	      /* first position */
	uint32_t prompt;      /* prompt tokens */
	uint32_t chunk;	      /* prefill chunk (0: the whole prompt) */
	uint32_t decode;      /* tokens decoded one at a time after the prompt */
	enum span_mode prefill_mode, decode_mode;
	uint32_t block_tokens;
};

static const struct schedule DEFAULT_SCHED = {.base = 0, .prompt = 45, .chunk = 16, .decode = 4,
					      .prefill_mode = SPANS_IN_ORDER, .decode_mode = SPANS_PIECES,
					      .block_tokens = 16};

/* Runs the schedule on the reference (F32 KV) and on CUDA (kv), comparing the logits of every
 * step; returns the largest relative L2 error. */
static double compare(const struct tmodel *m, enum dtype kv, const struct schedule *s, const char *what)
{
	uint32_t total = s->prompt + s->decode, vocab = m->cfg.vocab_size;
	uint32_t chunk = s->chunk ? s->chunk : s->prompt;
	int32_t *tok = malloc(total * sizeof(int32_t));
	float *want = malloc(vocab * sizeof(float)), *got = malloc(vocab * sizeof(float));
	ck_assert(tok && want && got);
	make_prompt(tok, total, vocab, 99);
	struct runner ref, cu;
	runner_open(&ref, "cpu", m, params(chunk, s->block_tokens, DT_F32), s->base);
	runner_open(&cu, "cuda", m, params(chunk, s->block_tokens, kv), s->base);
	double worst = 0;
	for (uint32_t i = 0; i < total;) {
		uint32_t n = i < s->prompt ? (s->prompt - i < chunk ? s->prompt - i : chunk) : 1;
		enum span_mode mode = i < s->prompt ? s->prefill_mode : s->decode_mode;
		runner_step(&ref, tok + i, n, s->base + i, mode, want, NULL);
		runner_step(&cu, tok + i, n, s->base + i, mode, got, NULL);
		double e = rel_l2(got, want, vocab);
		if (e > worst)
			worst = e;
		i += n;
	}
	char line[160];
	snprintf(line, sizeof(line), "%s, kv %s", what, dtype_name(kv));
	report(line, worst);
	runner_close(&ref);
	runner_close(&cu);
	free(tok);
	free(want);
	free(got);
	return worst;
}

static void check_f32(const struct model_config *c, const struct schedule *s, const char *what)
{
	struct tmodel *m = model_new(c, DT_F32, 1234);
	double e = compare(m, DT_F32, s, what);
	ck_assert_msg(e < TOL_F32, "%s: relative L2 error %.3e against the reference (F32 weights and KV)", what, e);
	model_free(&m);
}

/* ---- F32 weights and KV: the same numbers as the reference ---------------------------- */

START_TEST(test_gqa_f32)
{
	struct model_config c = base_cfg();
	check_f32(&c, &DEFAULT_SCHED, "gqa f32");
}
END_TEST

START_TEST(test_mha_f32)
{
	struct model_config c = base_cfg();
	c.n_kv_heads = c.n_heads;
	check_f32(&c, &DEFAULT_SCHED, "mha f32");
}
END_TEST

START_TEST(test_head_dim_not_dim_over_heads)
{
	struct model_config c = base_cfg();
	c.head_dim = 24; /* q_proj (96, 64), o_proj (64, 96) */
	check_f32(&c, &DEFAULT_SCHED, "head_dim 24, dim 64, 4 heads");
	c.head_dim = 128; /* wider heads than the model: two 64-dim lanes' worth */
	c.n_kv_heads = 1;
	check_f32(&c, &DEFAULT_SCHED, "head_dim 128, one kv head");
}
END_TEST

START_TEST(test_tied_embeddings)
{
	struct model_config c = base_cfg();
	c.tie_embeddings = 1;
	check_f32(&c, &DEFAULT_SCHED, "tied embeddings");
}
END_TEST

START_TEST(test_rope_llama3)
{
	struct model_config c = base_cfg();
	c.rope_scaling = ROPE_SCALING_LLAMA3;
	c.rope_factor = 8;
	c.rope_low_freq_factor = 1;
	c.rope_high_freq_factor = 4;
	c.rope_original_max_position = 64;
	check_f32(&c, &DEFAULT_SCHED, "llama3 rope scaling");
	c.rope_scaling = ROPE_SCALING_LINEAR;
	check_f32(&c, &DEFAULT_SCHED, "linear rope scaling");
}
END_TEST

/* Llama 3.1's RoPE parameters at positions near 120000: the float32 angle matters there. */
START_TEST(test_long_positions)
{
	struct model_config c = base_cfg();
	c.head_dim = 32;
	c.rope_theta = 500000.0f;
	c.rope_scaling = ROPE_SCALING_LLAMA3;
	c.rope_factor = 8;
	c.rope_low_freq_factor = 1;
	c.rope_high_freq_factor = 4;
	c.rope_original_max_position = 8192;
	struct schedule s = DEFAULT_SCHED;
	s.base = 120000;
	check_f32(&c, &s, "positions from 120000, llama3.1 rope");
	s.base = 131072 - 64;
	s.prompt = 50;
	check_f32(&c, &s, "positions up to 131071");
}
END_TEST

START_TEST(test_sliding_window)
{
	struct model_config c = base_cfg();
	c.arch = ARCH_MISTRAL;
	c.sliding_window = 8;
	check_f32(&c, &DEFAULT_SCHED, "sliding window 8");
	c.sliding_window = 40;
	struct schedule s = DEFAULT_SCHED;
	s.prompt = 300;
	s.chunk = 64;
	s.decode_mode = SPANS_IN_ORDER;
	check_f32(&c, &s, "sliding window 40, 300 tokens");
}
END_TEST

/* Long enough that decode splits the key range over blocks (and a small prefill chunk too). */
START_TEST(test_split_attention)
{
	struct model_config c = base_cfg();
	struct schedule s = DEFAULT_SCHED;
	s.prompt = 520;
	s.chunk = 64;
	s.decode = 3;
	s.decode_mode = SPANS_IN_ORDER;
	check_f32(&c, &s, "520 tokens, split decode");
	s.prompt = 528;
	s.chunk = 8; /* 8-token chunks at long context: split prefill */
	s.decode = 2;
	s.prefill_mode = SPANS_IN_ORDER;
	s.decode_mode = SPANS_REVERSE;
	check_f32(&c, &s, "528 tokens in 8-token chunks, decode reversed");
	s.prompt = 300;
	s.chunk = 0;
	s.decode = 3;
	s.block_tokens = 5; /* spans shorter than a tile, tiles across spans */
	s.decode_mode = SPANS_PIECES;
	check_f32(&c, &s, "block_tokens 5, 300 tokens, pieces");
	s.prompt = 600;
	s.block_tokens = 1; /* more spans than travel in the parameters: uploaded, each block's copied */
	s.decode_mode = SPANS_IN_ORDER;
	check_f32(&c, &s, "block_tokens 1, 600 tokens");
}
END_TEST

/* ---- 16-bit weights, BF16 KV ---------------------------------------------------------------- */

static void check_16(enum dtype wt, enum dtype kv, bool gemv, const char *what)
{
	knob_gemv = gemv ? BACKEND_GEMV_ROWS1 : BACKEND_GEMV_CUBLAS;
	struct model_config c = base_cfg();
	c.rope_theta = 500000.0f;
	c.rope_scaling = ROPE_SCALING_LLAMA3;
	c.rope_factor = 8;
	c.rope_low_freq_factor = 1;
	c.rope_high_freq_factor = 4;
	c.rope_original_max_position = 8192;
	c.dim = 256;
	c.ffn_dim = 512;
	c.head_dim = 64;
	struct tmodel *m = model_new(&c, wt, 4321);
	struct schedule s = DEFAULT_SCHED;
	s.prompt = 100;
	s.chunk = 32;
	s.decode = 6;
	char line[128];
	snprintf(line, sizeof(line), "%s (%s)", what, gemv ? "gemv" : "cublas");
	double e = compare(m, kv, &s, line);
	ck_assert_msg(e < TOL_16, "%s: relative L2 error %.3e against the reference", line, e);
	fprintf(stderr, "test_cuda_backend: %s, KV %s: relative L2 error %.3e\n", line, dtype_name(kv), e);
	model_free(&m);
	knob_gemv = BACKEND_GEMV_DEFAULT;
}

START_TEST(test_bf16)
{
	check_16(DT_BF16, DT_BF16, true, "bf16 weights");
	check_16(DT_BF16, DT_BF16, false, "bf16 weights");
	check_16(DT_BF16, DT_F32, true, "bf16 weights");
}
END_TEST

START_TEST(test_f16)
{
	check_16(DT_F16, DT_BF16, true, "f16 weights");
	check_16(DT_F16, DT_F32, false, "f16 weights");
}
END_TEST

/* Decode through the GEMV kernel (one or two rows per warp) and through cuBLAS: the two GEMV
 * variants sum in the same order (bit-identical logits); cuBLAS sums in another order, which
 * flips the 16-bit rounding of some activations: close, not equal. */
START_TEST(test_gemv_matches_cublas)
{
	struct model_config c = base_cfg();
	c.dim = 256;
	c.ffn_dim = 768;
	c.head_dim = 64;
	struct tmodel *m = model_new(&c, DT_BF16, 55);
	int32_t tok[40];
	make_prompt(tok, 40, c.vocab_size, 7);
	float *a = malloc(c.vocab_size * sizeof(float)), *b = malloc(c.vocab_size * sizeof(float));
	float *d = malloc(c.vocab_size * sizeof(float));
	ck_assert(a && b && d);
	static const uint32_t modes[3] = {BACKEND_GEMV_ROWS1, BACKEND_GEMV_CUBLAS, BACKEND_GEMV_ROWS2};
	struct runner r[3];
	for (int i = 0; i < 3; i++) {
		knob_gemv = modes[i];
		runner_open(&r[i], "cuda", m, params(32, 16, DT_BF16), 0);
		runner_step(&r[i], tok, 32, 0, SPANS_IN_ORDER, a, NULL);
	}
	knob_gemv = BACKEND_GEMV_DEFAULT;
	double worst = 0;
	for (uint32_t p = 32; p < 40; p++) {
		runner_step(&r[0], tok + p, 1, p, SPANS_IN_ORDER, a, NULL);
		runner_step(&r[1], tok + p, 1, p, SPANS_IN_ORDER, b, NULL);
		runner_step(&r[2], tok + p, 1, p, SPANS_IN_ORDER, d, NULL);
		ck_assert_msg(!memcmp(a, d, c.vocab_size * sizeof(float)), "gemv 1 and 2 rows per warp differ at %u", p);
		double e = rel_l2(a, b, c.vocab_size);
		worst = e > worst ? e : worst;
	}
	report("decode: gemv vs cublas, bf16", worst);
	ck_assert_msg(worst < 1e-2, "gemv and cublas decode differ by %.3e", worst);
	for (int i = 0; i < 3; i++)
		runner_close(&r[i]);
	free(a);
	free(b);
	free(d);
	model_free(&m);
}
END_TEST

/* Prefill attention on the tensor cores (BF16 KV, head_dim 64 or 128, 64 or more queries per
 * KV head in a chunk) and on the CUDA cores: both against the reference, and against each
 * other (they differ by the rounding of the softmax weights to bf16). */
static void check_attn_paths(uint32_t hd, uint32_t kv_heads, uint32_t chunk, uint32_t window, const char *what)
{
	struct model_config c = base_cfg();
	c.dim = 256;
	c.ffn_dim = 512;
	c.n_heads = 8;
	c.n_kv_heads = kv_heads;
	c.head_dim = hd;
	c.sliding_window = window;
	c.arch = window ? ARCH_MISTRAL : ARCH_LLAMA;
	struct tmodel *m = model_new(&c, DT_BF16, 777 + hd);
	struct schedule s = DEFAULT_SCHED;
	s.prompt = 200;
	s.chunk = chunk;
	s.decode = 2;
	s.prefill_mode = SPANS_PIECES;
	char line[160];
	double e[2];
	for (int i = 0; i < 2; i++) {
		knob_attn = i ? BACKEND_ATTN_SIMPLE : BACKEND_ATTN_DEFAULT;
		snprintf(line, sizeof(line), "%s, %s attention", what, i ? "simple" : "tensor-core");
		e[i] = compare(m, DT_BF16, &s, line);
		fprintf(stderr, "test_cuda_backend: %s: relative L2 error %.3e\n", line, e[i]);
		ck_assert_msg(e[i] < TOL_16, "%s: relative L2 error %.3e against the reference", line, e[i]);
	}
	knob_attn = BACKEND_ATTN_DEFAULT;
	model_free(&m);
}

START_TEST(test_attention_paths)
{
	check_attn_paths(128, 2, 64, 0, "head_dim 128, gqa 4, chunks of 64");
	check_attn_paths(128, 2, 16, 0, "head_dim 128, gqa 4, chunks of 16 (split)");
	check_attn_paths(64, 4, 96, 50, "head_dim 64, gqa 2, window 50");
	check_attn_paths(128, 8, 100, 0, "head_dim 128, mha, chunks of 100");
}
END_TEST

/* The CUDA-core attention with two warps a query (the default) and one (BACKEND_FUSE_ONE_KEY_WARP)
 * over head dims that are not a multiple of 16 (a lane's share of a key row is uneven) and of 256
 * (four chunks of 64 a lane), each with: decode in one split (no partial states), multi-head with
 * the keys split and merged by the last block, 8 queries a KV head (16 warps a block) with a
 * window over 5-token blocks, a window over 1-token blocks (many spans, uploaded), and BF16 KV
 * without and with a window. */
static void attn_shape_f32(uint32_t hd, uint32_t nh, uint32_t nkv, uint32_t window, uint32_t prompt, uint32_t chunk,
			   uint32_t bt, const char *what)
{
	struct model_config c = base_cfg();
	c.head_dim = hd;
	c.n_heads = nh;
	c.n_kv_heads = nkv;
	c.sliding_window = window;
	c.arch = window ? ARCH_MISTRAL : ARCH_LLAMA;
	struct schedule s = DEFAULT_SCHED;
	s.prompt = prompt;
	s.chunk = chunk;
	s.decode = 4;
	s.block_tokens = bt;
	s.decode_mode = SPANS_IN_ORDER;
	check_f32(&c, &s, what);
}

static void attn_shape_bf16(uint32_t hd, uint32_t nh, uint32_t nkv, uint32_t window, uint32_t prompt, uint32_t chunk,
			    const char *what)
{
	struct model_config c = base_cfg();
	c.dim = 256;
	c.ffn_dim = 512;
	c.head_dim = hd;
	c.n_heads = nh;
	c.n_kv_heads = nkv;
	c.sliding_window = window;
	c.arch = window ? ARCH_MISTRAL : ARCH_LLAMA;
	struct tmodel *m = model_new(&c, DT_BF16, 999 + hd);
	struct schedule s = DEFAULT_SCHED;
	s.prompt = prompt;
	s.chunk = chunk;
	s.decode = 4;
	s.decode_mode = SPANS_IN_ORDER;
	double e = compare(m, DT_BF16, &s, what);
	ck_assert_msg(e < TOL_16, "%s: relative L2 error %.3e against the reference", what, e);
	model_free(&m);
}

START_TEST(test_attention_warps_a_query)
{
	static const uint32_t hds[] = {40, 72, 256};
	char w[160];
	for (int f = 0; f < 2; f++) {
		knob_fuse = f ? BACKEND_FUSE_ONE_KEY_WARP : BACKEND_FUSE_DEFAULT;
		const char *how = f ? "one warp a query" : "two warps a query";
		for (unsigned i = 0; i < sizeof(hds) / sizeof(hds[0]); i++) {
			uint32_t hd = hds[i];
			snprintf(w, sizeof(w), "head_dim %u, gqa 2, one split, %s", hd, how);
			attn_shape_f32(hd, 4, 2, 0, 45, 16, 16, w);
			snprintf(w, sizeof(w), "head_dim %u, mha, 400 keys split, %s", hd, how);
			attn_shape_f32(hd, 4, 4, 0, 400, 64, 16, w);
			snprintf(w, sizeof(w), "head_dim %u, gqa 8, window 20, blocks of 5, %s", hd, how);
			attn_shape_f32(hd, 8, 1, 20, 200, 32, 5, w);
			snprintf(w, sizeof(w), "head_dim %u, gqa 4, window 9, blocks of 1, %s", hd, how);
			attn_shape_f32(hd, 8, 2, 9, 150, 4, 1, w);
			snprintf(w, sizeof(w), "head_dim %u, gqa 2, %s", hd, how);
			attn_shape_bf16(hd, 8, 4, 0, 300, 32, w);
			snprintf(w, sizeof(w), "head_dim %u, gqa 8, window 33, %s", hd, how);
			attn_shape_bf16(hd, 8, 1, 33, 300, 6, w);
		}
	}
	knob_fuse = BACKEND_FUSE_DEFAULT;
}
END_TEST

/* ---- logits_argmax ------------------------------------------------------------------------ */

START_TEST(test_argmax)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_BF16, 66);
	int32_t tok[60];
	make_prompt(tok, 60, c.vocab_size, 8);
	float *lg = malloc(c.vocab_size * sizeof(float));
	ck_assert_ptr_nonnull(lg);
	struct runner r, g;
	runner_open(&r, "cuda", m, params(32, 16, DT_BF16), 0);
	runner_open(&g, "cuda", m, params(32, 16, DT_BF16), 0);
	/* The same steps on two backends: one returns the logits, the other only the argmax. */
	for (uint32_t p = 0; p < 60;) {
		uint32_t n = p < 32 ? 32 : 1;
		int32_t id = -1;
		runner_step(&r, tok + p, n, p, SPANS_IN_ORDER, lg, NULL);
		runner_step(&g, tok + p, n, p, SPANS_IN_ORDER, NULL, &id);
		ck_assert_int_eq(id, host_argmax(lg, c.vocab_size));
		p += n;
	}
	runner_close(&r);
	runner_close(&g);

	/* Ties: an lm_head whose rows are all one row but row 0, which is zero: every logit but
	 * the first is the same number, so the answer is 0 or 1 (lowest id of the tie). */
	size_t row = (size_t)c.dim * dtype_size(DT_BF16);
	char *head = malloc(row * c.vocab_size);
	ck_assert_ptr_nonnull(head);
	const char *src = m->h_head.t[ROLE_LM_HEAD].data[PLACE_HOST];
	memset(head, 0, row);
	for (uint32_t v = 1; v < c.vocab_size; v++)
		memcpy(head + v * row, src + row, row);
	struct tmodel *mt = model_new(&c, DT_BF16, 66);
	set_tensor(mt, &mt->d_head, ROLE_LM_HEAD, PLACE_DEVICE, upload(mt, head, row * c.vocab_size));
	runner_open(&r, "cuda", mt, params(32, 16, DT_BF16), 0);
	runner_open(&g, "cuda", mt, params(32, 16, DT_BF16), 0);
	for (uint32_t p = 0; p < 36;) {
		uint32_t n = p < 32 ? 32 : 1;
		int32_t id = -1;
		runner_step(&r, tok + p, n, p, SPANS_IN_ORDER, lg, NULL);
		runner_step(&g, tok + p, n, p, SPANS_IN_ORDER, NULL, &id);
		ck_assert(lg[1] == lg[c.vocab_size - 1]);
		ck_assert_int_eq(id, lg[1] > 0 ? 1 : 0);
		p += n;
	}
	runner_close(&r);
	runner_close(&g);
	free(head);
	free(lg);
	model_free(&mt);
	model_free(&m);
}
END_TEST


/* ---- sampling on the device ---------------------------------------------------------------- */

static int cmp_float_desc(const void *a, const void *b)
{
	float x = *(const float *)a, y = *(const float *)b;
	return x < y ? 1 : x > y ? -1 : 0;
}

/* The semantics of backend.h's logits_sample on the host: returns the token for u, and in
 * *slack the distance from target to the nearest running-sum boundary (relative to the total),
 * so a disagreement that float rounding can explain is told apart from a wrong answer. */
static int32_t host_sample(const float *lg, uint32_t n, float temp, uint32_t k, float top_p, float min_p, double u,
			   double *slack)
{
	float inv_t = 1.0f / temp, mx = -INFINITY;
	float *z = malloc(n * sizeof(float)), *srt = malloc(n * sizeof(float));
	for (uint32_t i = 0; i < n; i++) {
		z[i] = lg[i] * inv_t;
		mx = fmaxf(mx, z[i]);
	}
	float zth = -INFINITY;
	if (k > 0 && k < n) {
		memcpy(srt, z, n * sizeof(float));
		qsort(srt, n, sizeof(float), cmp_float_desc);
		zth = srt[k - 1];
	}
	double tot = 0;
	for (uint32_t i = 0; i < n; i++) {
		z[i] = z[i] >= zth ? expf(z[i] - mx) : 0.0f; /* now the weights */
		tot += z[i];
	}
	float wth = 0.0f;
	if (top_p > 0.0f && top_p < 1.0f) {
		memcpy(srt, z, n * sizeof(float));
		qsort(srt, n, sizeof(float), cmp_float_desc);
		double need = (double)top_p * tot, run = 0;
		for (uint32_t i = 0; i < n; i++) {
			run += srt[i];
			if (run >= need) {
				wth = srt[i];
				break;
			}
		}
	}
	if (min_p > 0.0f)
		wth = fmaxf(wth, fminf(min_p, 1.0f));
	double kept = 0;
	for (uint32_t i = 0; i < n; i++)
		if (z[i] > 0.0f && z[i] >= wth)
			kept += z[i];
	double target = u * kept, run = 0;
	int32_t pick = -1;
	*slack = 1.0;
	for (uint32_t i = 0; i < n; i++) {
		if (!(z[i] > 0.0f && z[i] >= wth))
			continue;
		double before = run;
		run += z[i];
		double d = fmin(fabs(target - before), fabs(run - target)) / kept;
		if (pick < 0 && target < run) {
			pick = (int32_t)i;
			*slack = d;
		}
	}
	free(z);
	free(srt);
	return pick;
}

START_TEST(test_sampling_on_device)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_F32, 67);
	int32_t tok[40];
	make_prompt(tok, 40, c.vocab_size, 9);
	float *lg = malloc(c.vocab_size * sizeof(float));
	ck_assert_ptr_nonnull(lg);
	struct runner r;
	runner_open(&r, "cuda", m, params(40, 16, DT_F32), 0);
	runner_step(&r, tok, 40, 0, SPANS_IN_ORDER, lg, NULL);
	/* Flatter logits make the filters matter: scale them up so a few tokens dominate. */
	static const struct {
		float t;
		uint32_t k;
		float p, mp;
	} cases[] = {{1.0f, 0, 1.0f, 0}, {0.05f, 40, 1.0f, 0}, {0.05f, 0, 0.9f, 0}, {0.05f, 0, 1.0f, 0.05f},
		     {0.04f, 50, 0.95f, 0.02f}, {0.02f, 1, 1.0f, 0}};
	uint32_t checked = 0, near = 0;
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		for (int j = 0; j < 200; j++) {
			double u = (j + 0.37) / 200.0, slack;
			int32_t want = host_sample(lg, c.vocab_size, cases[ci].t, cases[ci].k, cases[ci].p, cases[ci].mp, u,
						   &slack);
			int32_t got = -1;
			CHECK_RC(&r, sample(r.be, &m->d_head, cases[ci].t, cases[ci].k, cases[ci].p,
							   cases[ci].mp, u, &got));
			ck_assert(got >= 0 && (uint32_t)got < c.vocab_size);
			if (got != want) {
				/* Only a draw right at a boundary may differ (exp and sums round differently). */
				ck_assert_msg(slack < 1e-4, "case %zu u %.4f: device %d, host %d (slack %.2g)", ci, u, got,
					      want, slack);
				near++;
			}
			checked++;
		}
	}
	/* top_k 1 is greedy. */
	int32_t g = -1;
	CHECK_RC(&r, sample(r.be, &m->d_head, 1.0f, 1, 1.0f, 0, 0.999, &g));
	ck_assert_int_eq(g, host_argmax(lg, c.vocab_size));
	/* Bad arguments are refused. */
	ck_assert_int_eq(sample(r.be, &m->d_head, 0.0f, 0, 1.0f, 0, 0.5, &g), -EINVAL);
	ck_assert_int_eq(sample(r.be, &m->d_head, 1.0f, 0, 1.0f, 0, 1.0, &g), -EINVAL);
	if (test_verbose())
		printf("sampling on the device: %u draws agree with the host (%u at a rounding boundary)\n", checked - near,
		       near);
	runner_close(&r);
	free(lg);
	model_free(&m);
}
END_TEST

/* Logits that are not finite, drawn by the device's sampler as the host's sampler (sampler.c)
 * draws them: an infinite maximum leaves the infinite candidates alone, equally weighted, walked in
 * id order (without that, exp(inf - inf) made every weight NaN and no token was drawn); NaN never
 * drawn; every logit -inf or NaN gives token 0. */
START_TEST(test_sampling_infinite_logits)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_F32, 71);
	struct runner r;
	runner_open(&r, "cuda", m, params(8, 16, DT_F32), 0);
	const uint32_t n = c.vocab_size;
	float *lg = malloc(n * sizeof(float));
	ck_assert_ptr_nonnull(lg);
	for (uint32_t i = 0; i < n; i++)
		lg[i] = (float)(i % 17) * 0.25f;
	lg[3] = NAN;
	lg[5] = INFINITY;
	lg[9] = INFINITY;
	char err[300] = "";
	int32_t tok = -2;
	/* Two infinite candidates: the first half of u draws 5, the second 9, whatever the filters. */
	static const struct {
		float t;
		uint32_t k;
		float p, mp;
	} cases[] = {{1.0f, 0, 1.0f, 0}, {0.5f, 40, 1.0f, 0}, {1.0f, 0, 0.9f, 0}, {1.0f, 0, 1.0f, 0.1f}};
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		for (int j = 0; j < 8; j++) {
			const double u = (j + 0.5) / 8.0;
			ck_assert_msg(cuda_test_sample(r.be, lg, cases[ci].t, cases[ci].k, cases[ci].p, cases[ci].mp, u, &tok,
						       err, sizeof(err)) == 0, "%s", err);
			ck_assert_msg(tok == (u < 0.5 ? 5 : 9), "case %zu u %.3f: drew %d, want %d", ci, u, tok,
				      u < 0.5 ? 5 : 9);
		}
	}
	/* One infinite candidate: always it. */
	lg[9] = 1.0f;
	ck_assert_msg(cuda_test_sample(r.be, lg, 1.0f, 0, 1.0f, 0, 0.99, &tok, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(tok, 5);
	/* Nothing but -inf and NaN: token 0. */
	for (uint32_t i = 0; i < n; i++)
		lg[i] = i % 2 ? -INFINITY : NAN;
	ck_assert_msg(cuda_test_sample(r.be, lg, 1.0f, 0, 1.0f, 0, 0.3, &tok, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(tok, 0);
	runner_close(&r);
	free(lg);
	model_free(&m);
}
END_TEST

/* ---- the KV arena ----------------------------------------------------------------------- */

/* ---- several sequences in one step (continuous batching) ------------------------------------ */

#define BSEQS 3
/* One sequence of a batched step: tokens at positions pos0.., its KV in region `region` of the arena
 * (regions of n_layers * bpl blocks). */
struct bseq {
	const int32_t *tok;
	uint32_t n, pos0, region;
};

/* A runner whose arena holds BSEQS sequences of MAX_CTX positions. */
static void batch_open(struct runner *r, const char *name, const struct tmodel *m, struct backend_params p)
{
	char err[400] = "";
	r->name = name;
	r->m = m;
	r->device = strcmp(name, "cpu") != 0;
	r->base = 0;
	r->bpl = (MAX_CTX + p.block_tokens - 1) / p.block_tokens;
	p.n_kv_blocks = BSEQS * m->cfg.n_layers * r->bpl;
	r->p = p;
	int rc = backend_create(name, &m->cfg, &p, &r->be, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s create: %d %s", name, rc, err);
}

/* One step over the sequences' runs, as the engine batches them: even layers attend a sequence a
 * call (odd sequences in two), odd ones every sequence's spans in one call; logits of each
 * sequence's last row (n_seqs x vocab). */
static void batch_step(struct runner *r, const struct bseq *sq, uint32_t n_seqs, float *logits,
		       const struct backend_pick *picks, int32_t *tokens)
{
	const struct tmodel *m = r->m;
	uint32_t bt = r->p.block_tokens, n = 0, dst_block[MAX_CTX], dst_row[MAX_CTX], pos[MAX_CTX], seq[MAX_CTX],
		 last[BSEQS];
	int32_t tok[MAX_CTX];
	for (uint32_t s = 0; s < n_seqs; s++)
		for (uint32_t i = 0; i < sq[s].n; i++, n++) {
			tok[n] = sq[s].tok[i];
			pos[n] = sq[s].pos0 + i;
			seq[n] = 7 + s;
		}
	struct backend_batch b = {.n = n, .tokens = tok, .pos = pos, .seq = seq};
	CHECK_RC(r, backend_embed(r->be, &m->embed_w, &b));
	for (uint32_t l = 0; l < m->cfg.n_layers; l++) {
		for (uint32_t s = 0, row = 0; s < n_seqs; row += sq[s++].n)
			for (uint32_t i = 0; i < sq[s].n; i++) {
				dst_block[row + i] = sq[s].region * m->cfg.n_layers * r->bpl + l * r->bpl + (sq[s].pos0 + i) / bt;
				dst_row[row + i] = (sq[s].pos0 + i) % bt;
			}
		const struct group_weights *aw = r->device ? &m->d_attn[l] : &m->h_attn[l];
		const struct group_weights *fw = r->device ? &m->d_ffn[l] : &m->h_ffn[l];
		CHECK_RC(r, backend_attn_begin(r->be, aw, l, dst_block, dst_row));
		static struct kv_span spans[BSEQS * MAX_CTX];
		uint32_t ns = 0;
		for (uint32_t s = 0, row = 0; s < n_seqs; row += sq[s++].n) {
			uint32_t end = sq[s].pos0 + sq[s].n;
			for (uint32_t k = 0; k * bt < end; k++)
				spans[ns++] = (struct kv_span){.block = sq[s].region * m->cfg.n_layers * r->bpl + l * r->bpl + k,
							       .pos0 = k * bt, .n_tokens = end - k * bt < bt ? end - k * bt : bt,
							       .row0 = row, .n_rows = sq[s].n};
			if (l % 2 == 0) {
				/* Odd sequences' spans in two calls (the KV cache cuts them so when the arena
				 * is short): a row's second piece after its first. */
				uint32_t half = s % 2 == 1 && ns > 1 ? ns / 2 : 0;
				if (half)
					CHECK_RC(r, backend_attn_blocks(r->be, spans, half));
				CHECK_RC(r, backend_attn_blocks(r->be, spans + half, ns - half));
				ns = 0;
			}
		}
		if (ns)
			CHECK_RC(r, backend_attn_blocks(r->be, spans, ns));
		CHECK_RC(r, backend_attn_end(r->be, aw));
		CHECK_RC(r, backend_ffn(r->be, fw));
	}
	for (uint32_t s = 0, row = 0; s < n_seqs; s++) {
		row += sq[s].n;
		last[s] = row - 1;
	}
	const struct group_weights *hw = r->device ? &m->d_head : &m->h_head;
	if (picks)
		CHECK_RC(r, backend_logits_pick_rows(r->be, hw, last, n_seqs, picks, tokens));
	else
		CHECK_RC(r, backend_logits_rows(r->be, hw, last, n_seqs, logits));
}

/* Three sequences (prompts of 40, 9 and 23 tokens) computed together in prefill chunks of 16 (cut
 * where a sequence's prompt ends) and then in decode steps of a token each, on CUDA and on the C
 * reference: every sequence's logits within tol at every step. */
static void check_batched(const struct model_config *cfg, enum dtype wt, enum dtype kv, double tol, const char *what)
{
	struct tmodel *m = model_new(cfg, wt, 4321);
	const struct model_config c = *cfg;
	enum { STEPS = 4 };
	static const uint32_t plen[BSEQS] = {40, 9, 23};
	static int32_t tok[BSEQS][MAX_CTX];
	for (uint32_t s = 0; s < BSEQS; s++)
		make_prompt(tok[s], plen[s] + STEPS, c.vocab_size, 50 + s);
	struct runner ref, cu, pk;
	batch_open(&ref, "cpu", m, params(64, 16, DT_F32));
	batch_open(&cu, "cuda", m, params(64, 16, kv));
	/* The same steps again, each row's token picked on the device (logits_pick_rows). */
	batch_open(&pk, "cuda", m, params(64, 16, kv));
	ck_assert(backend_batches_sequences(cu.be) && backend_picks_rows(pk.be));
	const struct sampler_params draw = {.temperature = 0.7f, .top_k = 40, .top_p = 0.9f};
	uint32_t picked = 0, drawn = 0, near = 0;
	float *want = malloc((size_t)BSEQS * c.vocab_size * sizeof(float)),
	      *got = malloc((size_t)BSEQS * c.vocab_size * sizeof(float));
	ck_assert(want && got);
	uint32_t done[BSEQS] = {0};
	double worst = 0;
	for (uint32_t step = 0;; step++) {
		struct bseq sq[BSEQS];
		uint32_t n_seqs = 0;
		for (uint32_t s = 0; s < BSEQS; s++) {
			if (done[s] >= plen[s] + STEPS)
				continue;
			uint32_t n = done[s] < plen[s] ? (plen[s] - done[s] < 16 ? plen[s] - done[s] : 16) : 1;
			sq[n_seqs++] = (struct bseq){.tok = tok[s] + done[s], .n = n, .pos0 = done[s], .region = s};
		}
		if (!n_seqs)
			break;
		batch_step(&ref, sq, n_seqs, want, NULL, NULL);
		batch_step(&cu, sq, n_seqs, got, NULL, NULL);
		struct backend_pick picks[BSEQS];
		int32_t toks[BSEQS];
		for (uint32_t k = 0; k < n_seqs; k++)
			picks[k] = (struct backend_pick){.sp = (k + step) % 2 ? &draw : NULL, .u = (step * 7 + k + 0.5) / 64.0};
		batch_step(&pk, sq, n_seqs, NULL, picks, toks);
		for (uint32_t k = 0; k < n_seqs; k++) {
			const float *row = got + (size_t)k * c.vocab_size;
			double slack = 1;
			int32_t host = picks[k].sp ? host_sample(row, c.vocab_size, draw.temperature, draw.top_k, draw.top_p, 0,
								 picks[k].u, &slack)
						   : host_argmax(row, c.vocab_size);
			if (toks[k] != host) {
				/* Only at a rounding boundary: a near tie, or a draw right at one. */
				bool tie = !picks[k].sp && toks[k] >= 0 && (uint32_t)toks[k] < c.vocab_size &&
					   row[host] - row[toks[k]] <= 1e-5f * (1.0f + fabsf(row[host]));
				ck_assert_msg(tie || (picks[k].sp && slack < 1e-4), "%s: step %u: sequence %u: picked %d on the "
					      "device, %d from its logits on the host", what, step, sq[k].region, toks[k], host);
				near++;
			}
			picked++;
			drawn += picks[k].sp != NULL;
		}
		for (uint32_t k = 0; k < n_seqs; k++) {
			double e = rel_l2(got + (size_t)k * c.vocab_size, want + (size_t)k * c.vocab_size, c.vocab_size);
			ck_assert_msg(e < tol, "%s: step %u: sequence %u at position %u: relative L2 %.3e against the "
				      "reference", what, step, sq[k].region, sq[k].pos0 + sq[k].n - 1, e);
			worst = e > worst ? e : worst;
		}
		for (uint32_t k = 0; k < n_seqs; k++)
			done[sq[k].region] += sq[k].n;
	}
	report(what, worst);
	if (test_verbose())
		printf("%s: %u tokens picked on the device (%u drawn) as the host picks them from the logits (%u at a "
		       "rounding boundary)\n", what, picked, drawn, near);
	runner_close(&ref);
	runner_close(&cu);
	runner_close(&pk);
	free(want);
	free(got);
	model_free(&m);
}

START_TEST(test_batched_sequences)
{
	struct model_config c = base_cfg();
	check_batched(&c, DT_F32, DT_F32, TOL_F32, "three sequences batched, f32");
}
END_TEST

/* The same in bf16 with head_dim 64 and four query heads per KV head: 16-row prefill runs take the
 * tensor-core attention, decode rows the split CUDA-core one. */
START_TEST(test_batched_sequences_bf16)
{
	struct model_config c = base_cfg();
	c.dim = 256;
	c.ffn_dim = 512;
	c.n_heads = 8;
	c.n_kv_heads = 2;
	c.head_dim = 64;
	check_batched(&c, DT_BF16, DT_BF16, TOL_16, "three sequences batched, bf16, head_dim 64");
}
END_TEST

START_TEST(test_kv_block_bytes)
{
	struct model_config c = base_cfg();
	struct backend_params p = params(16, 16, DT_BF16);
	ck_assert_uint_eq(backend_kv_block_bytes("cuda", &c, &p), 2u * 16 * 2 * 16 * 2);
	p.kv_dtype = DT_F32;
	ck_assert_uint_eq(backend_kv_block_bytes("cuda", &c, &p), 2u * 16 * 2 * 16 * 4);
}
END_TEST

/* Prefill on one backend, move every block through host memory into a fresh one, decode the
 * next tokens on both: the same logits, bit for bit. Then a block moved to another index. */
START_TEST(test_kv_host_roundtrip)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_BF16, 21);
	uint32_t n = 38;
	int32_t tok[40];
	make_prompt(tok, 40, c.vocab_size, 22);
	float *la = malloc(c.vocab_size * sizeof(float)), *lb = malloc(c.vocab_size * sizeof(float));
	ck_assert(la && lb);
	struct runner a, b;
	runner_open(&a, "cuda", m, params(64, 16, DT_BF16), 0);
	runner_open(&b, "cuda", m, params(64, 16, DT_BF16), 0);
	runner_step(&a, tok, n, 0, SPANS_IN_ORDER, la, NULL);
	size_t bytes = backend_kv_block_bytes("cuda", &c, &a.p);
	char *buf = malloc(bytes), *back = malloc(bytes);
	ck_assert(buf && back);
	for (uint32_t blk = 0; blk < a.p.n_kv_blocks; blk++) {
		CHECK_RC(&a, kv_out(a.be, blk, buf));
		CHECK_RC(&b, kv_in(b.be, blk, buf));
		CHECK_RC(&b, kv_out(b.be, blk, back));
		ck_assert_int_eq(memcmp(buf, back, bytes), 0);
	}
	for (uint32_t p = n; p < 40; p++) {
		runner_step(&a, tok + p, 1, p, SPANS_IN_ORDER, la, NULL);
		runner_step(&b, tok + p, 1, p, SPANS_IN_ORDER, lb, NULL);
		ck_assert_int_eq(memcmp(la, lb, c.vocab_size * sizeof(float)), 0);
	}
	ck_assert_int_eq(kv_out(a.be, a.p.n_kv_blocks, buf), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(a.be), "outside the arena"));
	ck_assert_int_eq(kv_in(b.be, b.p.n_kv_blocks, buf), -EINVAL);
	free(buf);
	free(back);
	runner_close(&a);
	runner_close(&b);
	free(la);
	free(lb);
	model_free(&m);
}
END_TEST

/* ---- errors ----------------------------------------------------------------------------- */

START_TEST(test_bad_config_rejected)
{
	struct model_config c = base_cfg();
	struct backend_params p = params(16, 16, DT_F16);
	p.n_kv_blocks = 8;
	struct backend *be = (struct backend *)(uintptr_t)1; /* create must set NULL on failure */
	char err[400] = "";
	ck_assert_int_eq(backend_create("cuda", &c, &p, &be, err, sizeof(err)), -ENOTSUP);
	ck_assert_ptr_null(be);
	ck_assert_msg(strstr(err, "kv_dtype F16") != NULL, "message: %s", err);
	p.kv_dtype = DT_BF16;
	c.head_dim = 20;
	ck_assert_int_eq(backend_create("cuda", &c, &p, &be, err, sizeof(err)), -ENOTSUP);
	ck_assert_msg(strstr(err, "head_dim 20") != NULL, "message: %s", err);
	c = base_cfg();
	c.n_kv_heads = 3;
	ck_assert_int_eq(backend_create("cuda", &c, &p, &be, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "not a multiple of 3 kv heads") != NULL, "message: %s", err);
	c = base_cfg();
	p.block_tokens = 0;
	ck_assert_int_eq(backend_create("cuda", &c, &p, &be, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_null(be);
}
END_TEST

START_TEST(test_bad_calls_rejected)
{
	struct model_config c = base_cfg();
	struct tmodel *m = model_new(&c, DT_BF16, 4);
	struct runner r;
	runner_open(&r, "cuda", m, params(16, 16, DT_BF16), 0);
	uint32_t blk = 0, row = 0;
	struct kv_span sp = {.block = 0, .pos0 = 0, .n_tokens = 1};
	float *lg = malloc(c.vocab_size * sizeof(float));
	ck_assert_ptr_nonnull(lg);
	/* Out of order. */
	ck_assert_int_eq(backend_attn_begin(r.be, &m->d_attn[0], 0, &blk, &row), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(r.be), "before embed"));
	ck_assert_int_eq(backend_attn_blocks(r.be, &sp, 1), -EINVAL);
	ck_assert_int_eq(backend_logits(r.be, &m->d_head, lg), -EINVAL);
	/* Tokens. */
	int32_t bad[] = {1, 2, 512};
	ck_assert_int_eq(embed(r.be, &m->embed_w, bad, 3, 0), -EINVAL);
	ck_assert_msg(strstr(backend_error(r.be), "token id 512") != NULL, "message: %s", backend_error(r.be));
	ck_assert_int_eq(embed(r.be, &m->embed_w, bad, 17, 0), -EINVAL); /* > max_chunk */
	int32_t tok[] = {7};
	CHECK_RC(&r, embed(r.be, &m->embed_w, tok, 1, 0));
	/* A destination outside the arena, a missing tensor, mixed dtypes. */
	blk = r.p.n_kv_blocks;
	ck_assert_int_eq(backend_attn_begin(r.be, &m->d_attn[0], 0, &blk, &row), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(r.be), "outside the arena"));
	blk = 0;
	struct group_weights w = m->d_attn[0];
	w.t[ROLE_WK].data[PLACE_DEVICE] = NULL;
	ck_assert_int_eq(backend_attn_begin(r.be, &w, 0, &blk, &row), -EINVAL);
	ck_assert_ptr_nonnull(strstr(backend_error(r.be), "no wk tensor"));
	w = m->d_attn[0];
	w.t[ROLE_WV].format = DT_F16;
	ck_assert_int_eq(backend_attn_begin(r.be, &w, 0, &blk, &row), -ENOTSUP);
	ck_assert_ptr_nonnull(strstr(backend_error(r.be), "mixed matrix dtypes"));
	CHECK_RC(&r, backend_attn_begin(r.be, &m->d_attn[0], 0, &blk, &row));
	/* Bad spans; then attn_end without the query's own block: found on the GPU, reported by
	 * the next logits. */
	struct kv_span badsp = {.block = r.p.n_kv_blocks, .pos0 = 0, .n_tokens = 1};
	ck_assert_int_eq(backend_attn_blocks(r.be, &badsp, 1), -EINVAL);
	badsp = (struct kv_span){.block = 0, .pos0 = 0, .n_tokens = r.p.block_tokens + 1};
	ck_assert_int_eq(backend_attn_blocks(r.be, &badsp, 1), -EINVAL);
	ck_assert_int_eq(backend_ffn(r.be, &m->d_ffn[0]), -EINVAL);
	CHECK_RC(&r, backend_attn_end(r.be, &m->d_attn[0]));
	CHECK_RC(&r, backend_ffn(r.be, &m->d_ffn[0]));
	ck_assert_int_eq(backend_logits(r.be, &m->d_head, lg), -EINVAL);
	ck_assert_msg(strstr(backend_error(r.be), "saw no keys") && strstr(backend_error(r.be), "layer 0"),
		      "message: %s", backend_error(r.be));
	/* Reported once: the backend goes on. */
	CHECK_RC(&r, backend_logits(r.be, &m->d_head, lg));
	free(lg);
	runner_close(&r);
	model_free(&m);
}
END_TEST

START_TEST(test_registry)
{
	ck_assert(backend_known("cuda"));
	ck_assert_str_eq(backend_default_name(), "cuda"); /* this test runs only with a GPU */
	struct model_config c = base_cfg();
	struct backend_params p = params(4, 16, DT_BF16);
	p.n_kv_blocks = 4;
	struct backend *be = NULL;
	char err[400] = "";
	ck_assert_int_eq(backend_create("cuda", &c, &p, &be, err, sizeof(err)), 0);
	ck_assert_str_eq(backend_name(be), "cuda");
	ck_assert_int_eq(backend_weight_place(be), PLACE_DEVICE);
	ck_assert(backend_samples_on_device(be));
	ck_assert_ptr_nonnull(backend_cuda_stream(be));
	backend_destroy(&be);
}
END_TEST

static Suite *cuda_suite(void)
{
	Suite *s = suite_create("backend_cuda");
	TCase *tc = tcase_create("f32");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_gqa_f32);
	tcase_add_test(tc, test_mha_f32);
	tcase_add_test(tc, test_head_dim_not_dim_over_heads);
	tcase_add_test(tc, test_tied_embeddings);
	tcase_add_test(tc, test_rope_llama3);
	tcase_add_test(tc, test_long_positions);
	tcase_add_test(tc, test_sliding_window);
	suite_add_tcase(s, tc);

	tc = tcase_create("split_attention");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_split_attention);
	suite_add_tcase(s, tc);

	tc = tcase_create("attention_warps");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_attention_warps_a_query);
	suite_add_tcase(s, tc);

	tc = tcase_create("half");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_bf16);
	tcase_add_test(tc, test_f16);
	tcase_add_test(tc, test_gemv_matches_cublas);
	tcase_add_test(tc, test_attention_paths);
	suite_add_tcase(s, tc);

	tc = tcase_create("batch");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_batched_sequences);
	tcase_add_test(tc, test_batched_sequences_bf16);
	suite_add_tcase(s, tc);

	tc = tcase_create("argmax");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_argmax);
	tcase_add_test(tc, test_sampling_on_device);
	tcase_add_test(tc, test_sampling_infinite_logits);
	suite_add_tcase(s, tc);

	tc = tcase_create("kv_arena");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_kv_block_bytes);
	tcase_add_test(tc, test_kv_host_roundtrip);
	suite_add_tcase(s, tc);

	tc = tcase_create("errors");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_bad_config_rejected);
	tcase_add_test(tc, test_bad_calls_rejected);
	tcase_add_test(tc, test_registry);
	suite_add_tcase(s, tc);

	return s;
}

int main(void)
{
	return gpu_suite_main("test_cuda_backend", cuda_suite);
}

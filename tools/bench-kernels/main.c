/* bench-kernels: the CUDA backend's kernels on a Llama-3-8B shape with every weight resident
 * (random BF16 weights in device memory, no services): prefill of 512-token chunks and decode
 * ms/token at a short and a ~4K context, lm_head alone (the matrix-vector bandwidth), for each
 * decode and attention path (backend_params.gemv, .attn). Prints a line per measurement on
 * stderr and one JSON object per path on stdout. A benchmark, not a test: it asserts nothing
 * about speed.
 *
 * --quant runs the same shape in GGUF's Q4_K_M mix instead (random valid blocks: Q4_K, with
 * Q6_K for wv and down_proj of the layers llama.cpp gives more bits, and for lm_head; F32 norms;
 * a Q4_K embedding table on the host), decoding through the quantized GEMV (and, without
 * --quick, through dequantization and cuBLAS). Every JSON object carries the HBM bound of its
 * decode step: the bytes the step reads over the device memory's read rate measured first
 * (bench-limits' read kernel).
 *
 *   bench-kernels                       # every path; the first also at ~4K context
 *   bench-kernels --quick               # the default path and the unfused one, no ~4K context
 *                                       # (--quant: every one-token path but cuBLAS)
 *   bench-kernels --default-only        # the default path alone, no ~4K context
 *   bench-kernels --parts [--quant]     # a decode step whole, its attention groups alone, its
 *                                       # FFN groups alone (as they run, launches overlapping)
 *   bench-kernels --without [--quant]   # a decode step, then with each kind of kernel left out
 *                                       # of every layer (wrong results): each kind's share of
 *                                       # the step as it runs
 *   bench-kernels --ab-fuse N [--quant] # the default path and backend_params.fuse N in turn
 *   bench-kernels --trace [--quant]     # a decode step's launches stamped in every block: where
 *                                       # each place of a layer spends its time
 *   bench-kernels --trace-blocks L      # the same, and layer L's launches block by block
 *   bench-kernels --quant [--quick]     # Q4_K_M weights
 *   bench-kernels --batch [--quant]     # decode steps of 1 to 64 sequences (continuous batching)
 *   bench-kernels --profile decode      # one decode step (or prefill) alone between
 *                                       # cudaProfilerStart/Stop: ncu --profile-from-start off
 */
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/config.h"
#include "common/dtype.h"
#include "common/model.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/cuda/cuda_test.h"
#include "tools/bench-limits/hbm.h"

#define CHECK(cond, ...)                                                                           \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			fprintf(stderr, "bench-kernels: " __VA_ARGS__);                            \
			fputc('\n', stderr);                                                       \
			exit(1);                                                                   \
		}                                                                                  \
	} while (0)

#define CUDA_OK(call)                                                                              \
	do {                                                                                       \
		cudaError_t e_ = (call);                                                           \
		CHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                 \
	} while (0)

#define PERF_CTX 4224
#define PERF_CHUNK 512
#define TRACE_BLOCKS_MAX 2048 /* blocks of one launch the trace holds (KTRACE_MAX_BLOCKS) */

static uint64_t rng_state;

static uint64_t rng_next(void)
{
	uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static double rng_uniform(void)
{
	return ((double)(rng_next() >> 11) + 0.5) * 0x1.0p-53; /* (0, 1) */
}

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static const char *gemv_name(uint32_t g, bool quant)
{
	if (quant)
		return g == BACKEND_GEMV_CUBLAS			       ? "dequantize + cublas"
		       : g == BACKEND_GEMV_ROWS1 || g == BACKEND_GEMV_ROWS2 ? "quantized gemv, float x"
		       : g == BACKEND_GEMV_DP4A_REGS			       ? "quantized gemv, int8 x (dp4a), weights via registers"
									   : "quantized gemv, int8 x (dp4a)";
	return g == BACKEND_GEMV_CUBLAS ? "cublas" : g == BACKEND_GEMV_ROWS2 ? "2 rows/warp" : "1 row/warp";
}

/* Role r of the 8B shape as BF16 at data in place. */
static void set_bf16(const struct model_config *c, struct group_weights *g, enum tensor_role r, enum weight_place place,
		     const void *data)
{
	uint32_t ndim;
	uint64_t shape[2];
	model_expected_shape(c, r, &ndim, shape);
	weight_tensor_set(&g->t[r], place, data, DT_BF16, ndim == 1 ? 1 : (uint32_t)shape[0],
			  (uint32_t)(ndim == 1 ? shape[0] : shape[1]));
}

struct big {
	struct model_config cfg;
	struct group_weights embed, head, *attn, *ffn;
	void *pool;	  /* device: all matrices and norms */
	void *embed_host; /* the embedding table */
	size_t weight_bytes; /* bytes a decode step reads (all but the embedding table) */
	size_t head_bytes;   /* of lm_head */
	const char *weights; /* "BF16", "Q4_K_M" */
	bool quant;	     /* block formats */
};

static struct model_config llama3_8b(void)
{
	struct model_config c = {
		.arch = ARCH_LLAMA, .n_layers = 32, .dim = 4096, .n_heads = 32, .n_kv_heads = 8, .head_dim = 128,
		.ffn_dim = 14336, .vocab_size = 128256, .max_position = 131072, .rms_eps = 1e-5f,
		.rope_theta = 500000.0f, .rope_scaling = ROPE_SCALING_LLAMA3, .rope_factor = 8,
		.rope_low_freq_factor = 1, .rope_high_freq_factor = 4, .rope_original_max_position = 8192,
		.bos_id = -1,
	};
	return c;
}

/* Random BF16 weights, ~N(0, 0.02)-sized uniform values (not zeros, which run faster than
 * real data): 64 MiB generated on the host, replicated over the device tensors. */
static void big_new(struct big *b)
{
	struct model_config c = llama3_8b();
	b->cfg = c;
	b->weights = "BF16";
	size_t dim = c.dim, qd = (size_t)c.n_heads * c.head_dim, kvd = (size_t)c.n_kv_heads * c.head_dim;
	size_t per_layer = (dim + qd * dim + 2 * kvd * dim + dim * qd) + (dim + 3 * (size_t)c.ffn_dim * dim);
	size_t elems = per_layer * c.n_layers + dim + (size_t)c.vocab_size * dim;
	b->weight_bytes = elems * 2;
	CUDA_OK(cudaMalloc(&b->pool, b->weight_bytes));
	size_t chunk = 32u << 20; /* elements */
	uint16_t *h = malloc(chunk * 2);
	CHECK(h != NULL, "out of memory");
	rng_state = 17;
	for (size_t i = 0; i < chunk; i++)
		h[i] = f32_to_bf16((float)((rng_uniform() - 0.5) * 0.07));
	CUDA_OK(cudaMemcpy(b->pool, h, chunk * 2, cudaMemcpyHostToDevice));
	for (size_t off = chunk; off < elems; off += chunk) {
		size_t n = elems - off < chunk ? elems - off : chunk;
		CUDA_OK(cudaMemcpy((uint16_t *)b->pool + off, b->pool, n * 2, cudaMemcpyDeviceToDevice));
	}
	/* Norm weights near 1. */
	for (size_t i = 0; i < dim; i++)
		h[i] = f32_to_bf16((float)(1.0 + 0.1 * (rng_uniform() - 0.5)));
	b->attn = calloc(c.n_layers, sizeof(*b->attn));
	b->ffn = calloc(c.n_layers, sizeof(*b->ffn));
	CHECK(b->attn && b->ffn, "out of memory");
	uint16_t *p = b->pool;
#define TAKE(gw, role, count)                                                   \
	do {                                                                    \
		set_bf16(&b->cfg, (gw), role, PLACE_DEVICE, p);                 \
		p += (count);                                                   \
	} while (0)
	for (uint32_t l = 0; l < c.n_layers; l++) {
		CUDA_OK(cudaMemcpy(p, h, dim * 2, cudaMemcpyHostToDevice));
		TAKE(&b->attn[l], ROLE_ATTN_NORM, dim);
		TAKE(&b->attn[l], ROLE_WQ, qd * dim);
		TAKE(&b->attn[l], ROLE_WK, kvd * dim);
		TAKE(&b->attn[l], ROLE_WV, kvd * dim);
		TAKE(&b->attn[l], ROLE_WO, dim * qd);
		CUDA_OK(cudaMemcpy(p, h, dim * 2, cudaMemcpyHostToDevice));
		TAKE(&b->ffn[l], ROLE_FFN_NORM, dim);
		TAKE(&b->ffn[l], ROLE_W_GATE, (size_t)c.ffn_dim * dim);
		TAKE(&b->ffn[l], ROLE_W_UP, (size_t)c.ffn_dim * dim);
		TAKE(&b->ffn[l], ROLE_W_DOWN, dim * c.ffn_dim);
	}
	CUDA_OK(cudaMemcpy(p, h, dim * 2, cudaMemcpyHostToDevice));
	TAKE(&b->head, ROLE_FINAL_NORM, dim);
	TAKE(&b->head, ROLE_LM_HEAD, (size_t)c.vocab_size * dim);
	b->head_bytes = (size_t)c.vocab_size * dim * 2;
#undef TAKE
	CHECK(p == (uint16_t *)b->pool + elems, "weights laid out wrongly");
	/* The embedding table (host): the random chunk repeated. */
	size_t eb = (size_t)c.vocab_size * dim;
	b->embed_host = malloc(eb * 2);
	CHECK(b->embed_host != NULL, "out of memory");
	for (size_t off = 0; off < eb; off += chunk)
		memcpy((uint16_t *)b->embed_host + off, h, (eb - off < chunk ? eb - off : chunk) * 2);
	set_bf16(&b->cfg, &b->embed, ROLE_EMBED, PLACE_HOST, b->embed_host);
	free(h);
	CUDA_OK(cudaDeviceSynchronize());
}

/* ---- the Q4_K_M mix -------------------------------------------------------------------------- */

static void put_f16(uint8_t *p, float v)
{
	uint16_t h = f32_to_f16(v);
	memcpy(p, &h, 2);
}

/* `bytes` (whole blocks) of random valid blocks of format f, values within about +-0.05: random
 * quants and scales, f16 scales set so no value is NaN or huge. */
static uint8_t *random_blocks(enum dtype f, size_t bytes)
{
	uint8_t *h = malloc(bytes);
	CHECK(h != NULL, "out of memory");
	for (size_t i = 0; i < bytes; i++)
		h[i] = (uint8_t)(rng_next() >> 56);
	size_t bb = dtype_block_bytes(f);
	for (size_t off = 0; off + bb <= bytes; off += bb) {
		float u = (float)(0.5 + 0.5 * rng_uniform());
		if (f == DT_Q4_K) {
			put_f16(h + off, u * 0.05f / 945);
			put_f16(h + off + 2, u * 0.05f / 126);
		} else {
			put_f16(h + off + 208, u * 0.05f / 4096); /* Q6_K */
		}
	}
	return h;
}

/* llama.cpp's use_more_bits: the layers whose wv and ffn_down a Q4_K_M file stores in Q6_K. */
static bool more_bits(uint32_t i, uint32_t n)
{
	return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

/* The 8B shape in the Q4_K_M mix: every tensor at a 256-byte aligned offset of one pool, filled
 * by copies of a random chunk of its format (8 MiB rounded to whole blocks). */
static void big_new_quant(struct big *b)
{
	struct model_config c = llama3_8b();
	b->cfg = c;
	b->weights = "Q4_K_M";
	b->quant = true;
	const uint32_t dim = c.dim, qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim, ffn = c.ffn_dim;
	b->attn = calloc(c.n_layers, sizeof(*b->attn));
	b->ffn = calloc(c.n_layers, sizeof(*b->ffn));
	CHECK(b->attn && b->ffn, "out of memory");
	struct plan {
		struct group_weights *g;
		enum tensor_role r;
		enum dtype f;
		uint32_t rows, cols;
		size_t off;
	} *pl = calloc(9 * c.n_layers + 2, sizeof(*pl));
	CHECK(pl != NULL, "out of memory");
	uint32_t np = 0;
	for (uint32_t l = 0; l < c.n_layers; l++) {
		enum dtype hi = more_bits(l, c.n_layers) ? DT_Q6_K : DT_Q4_K;
		struct group_weights *a = &b->attn[l], *f = &b->ffn[l];
		pl[np++] = (struct plan){a, ROLE_ATTN_NORM, DT_F32, 1, dim, 0};
		pl[np++] = (struct plan){a, ROLE_WQ, DT_Q4_K, qd, dim, 0};
		pl[np++] = (struct plan){a, ROLE_WK, DT_Q4_K, kvd, dim, 0};
		pl[np++] = (struct plan){a, ROLE_WV, hi, kvd, dim, 0};
		pl[np++] = (struct plan){a, ROLE_WO, DT_Q4_K, dim, qd, 0};
		pl[np++] = (struct plan){f, ROLE_FFN_NORM, DT_F32, 1, dim, 0};
		pl[np++] = (struct plan){f, ROLE_W_GATE, DT_Q4_K, ffn, dim, 0};
		pl[np++] = (struct plan){f, ROLE_W_UP, DT_Q4_K, ffn, dim, 0};
		pl[np++] = (struct plan){f, ROLE_W_DOWN, hi, dim, ffn, 0};
	}
	pl[np++] = (struct plan){&b->head, ROLE_FINAL_NORM, DT_F32, 1, dim, 0};
	pl[np++] = (struct plan){&b->head, ROLE_LM_HEAD, DT_Q6_K, c.vocab_size, dim, 0};
	size_t total = 0;
	b->weight_bytes = 0;
	for (uint32_t i = 0; i < np; i++) {
		size_t bytes = (size_t)pl[i].rows * dtype_row_bytes(pl[i].f, pl[i].cols);
		pl[i].off = total;
		total += (bytes + 255) / 256 * 256;
		b->weight_bytes += bytes;
	}
	b->head_bytes = (size_t)c.vocab_size * dtype_row_bytes(DT_Q6_K, dim);
	CUDA_OK(cudaMalloc(&b->pool, total));
	rng_state = 17;
	const size_t target = 8u << 20;
	uint8_t *chunk[2] = {random_blocks(DT_Q4_K, target / 144 * 144), random_blocks(DT_Q6_K, target / 210 * 210)};
	size_t chunk_bytes[2] = {target / 144 * 144, target / 210 * 210};
	float *norm = malloc(dim * sizeof(float));
	CHECK(norm != NULL, "out of memory");
	for (uint32_t i = 0; i < dim; i++)
		norm[i] = (float)(1.0 + 0.1 * (rng_uniform() - 0.5));
	void *dchunk[2];
	for (int k = 0; k < 2; k++) {
		CUDA_OK(cudaMalloc(&dchunk[k], chunk_bytes[k]));
		CUDA_OK(cudaMemcpy(dchunk[k], chunk[k], chunk_bytes[k], cudaMemcpyHostToDevice));
	}
	for (uint32_t i = 0; i < np; i++) {
		char *dst = (char *)b->pool + pl[i].off;
		size_t bytes = (size_t)pl[i].rows * dtype_row_bytes(pl[i].f, pl[i].cols);
		if (pl[i].f == DT_F32) {
			CUDA_OK(cudaMemcpy(dst, norm, bytes, cudaMemcpyHostToDevice));
		} else {
			int k = pl[i].f == DT_Q6_K;
			for (size_t o = 0; o < bytes; o += chunk_bytes[k])
				CUDA_OK(cudaMemcpy(dst + o, dchunk[k], bytes - o < chunk_bytes[k] ? bytes - o : chunk_bytes[k],
						   cudaMemcpyDeviceToDevice));
		}
		weight_tensor_set(&pl[i].g->t[pl[i].r], PLACE_DEVICE, dst, pl[i].f, pl[i].rows, pl[i].cols);
	}
	/* The embedding table (host): Q4_K blocks, the chunk repeated. */
	size_t eb = (size_t)c.vocab_size * dtype_row_bytes(DT_Q4_K, dim);
	b->embed_host = malloc(eb);
	CHECK(b->embed_host != NULL, "out of memory");
	for (size_t o = 0; o < eb; o += chunk_bytes[0])
		memcpy((char *)b->embed_host + o, chunk[0], eb - o < chunk_bytes[0] ? eb - o : chunk_bytes[0]);
	weight_tensor_set(&b->embed.t[ROLE_EMBED], PLACE_HOST, b->embed_host, DT_Q4_K, c.vocab_size, dim);
	for (int k = 0; k < 2; k++) {
		CUDA_OK(cudaFree(dchunk[k]));
		free(chunk[k]);
	}
	free(norm);
	free(pl);
	CUDA_OK(cudaDeviceSynchronize());
}

static void big_free(struct big *b)
{
	CUDA_OK(cudaFree(b->pool));
	free(b->embed_host);
	free(b->attn);
	free(b->ffn);
}

struct perf_run {
	const struct big *b;
	struct backend *be;
	uint32_t bt, bpl;
	int32_t *tok;
	uint32_t *pos, *seq;
	struct kv_span *spans;
	uint32_t *dst_block, *dst_row;
	float *logits; /* set: perf_step brings the logits here (vocab floats) instead of the argmax */
};

/* enum backend_fuse of the runs: how kernels are chained (big_run sets it). */
static uint32_t bench_fuse = BACKEND_FUSE_DEFAULT;

/* A backend for the 8B shape with the kernel choices given. */
static void perf_open(struct perf_run *r, const struct big *b, uint32_t gemv, uint32_t attn)
{
	const struct model_config *c = &b->cfg;
	r->b = b;
	r->logits = NULL;
	r->bt = 16;
	r->bpl = PERF_CTX / r->bt;
	struct backend_params p = {.max_chunk = PERF_CHUNK, .block_tokens = r->bt, .n_kv_blocks = c->n_layers * r->bpl,
				   .kv_dtype = DT_BF16, .threads = 1, .gemv = gemv, .attn = attn,
				   .fuse = bench_fuse};
	char err[400] = "";
	int rc = backend_create("cuda", c, &p, &r->be, err, sizeof(err));
	CHECK(rc == 0, "create: %s", err);
	r->tok = malloc(PERF_CTX * sizeof(int32_t));
	r->pos = malloc(PERF_CHUNK * sizeof(uint32_t));
	r->seq = malloc(PERF_CHUNK * sizeof(uint32_t));
	r->spans = malloc(r->bpl * sizeof(*r->spans));
	r->dst_block = malloc(PERF_CHUNK * sizeof(uint32_t));
	r->dst_row = malloc(PERF_CHUNK * sizeof(uint32_t));
	CHECK(r->tok && r->pos && r->seq && r->spans && r->dst_block && r->dst_row, "out of memory");
	rng_state = 3;
	for (uint32_t i = 0; i < PERF_CTX; i++)
		r->tok[i] = (int32_t)(rng_next() % c->vocab_size);
}

static void perf_close(struct perf_run *r)
{
	backend_destroy(&r->be);
	free(r->tok);
	free(r->pos);
	free(r->seq);
	free(r->spans);
	free(r->dst_block);
	free(r->dst_row);
}

static double enqueue_ms; /* host time of the last perf_step until logits_argmax */

/* What a step computes of each layer (--parts): both groups, or one of them alone (the numbers
 * are then meaningless, the time is that group's as the step runs it). */
enum step_parts { PARTS_ALL = 0, PARTS_ATTN = 1, PARTS_FFN = 2 };
static uint32_t step_parts = PARTS_ALL;

/* One step as the engine runs it, spans in order from position 0; returns the argmax. */
static int32_t perf_step(struct perf_run *r, uint32_t n, uint32_t pos)
{
	const struct big *b = r->b;
	struct backend *be = r->be;
	uint32_t bt = r->bt;
	int32_t id = -1;
	double t0 = now_ms();
	for (uint32_t i = 0; i < n; i++) {
		r->pos[i] = pos + i;
		r->seq[i] = 0;
	}
	struct backend_batch batch = {.n = n, .tokens = r->tok + pos, .pos = r->pos, .seq = r->seq};
	int rc = backend_embed(be, &b->embed, &batch);
	CHECK(rc == 0, "embed: %s", backend_error(be));
	for (uint32_t l = 0; l < b->cfg.n_layers; l++) {
		for (uint32_t i = 0; i < n; i++) {
			r->dst_block[i] = l * r->bpl + (pos + i) / bt;
			r->dst_row[i] = (pos + i) % bt;
		}
		if (step_parts != PARTS_FFN) {
			rc = backend_attn_begin(be, &b->attn[l], l, r->dst_block, r->dst_row);
			CHECK(rc == 0, "attn_begin: %s", backend_error(be));
			uint32_t end = pos + n, ns = 0;
			for (uint32_t k = 0; k * bt < end; k++)
				r->spans[ns++] = (struct kv_span){.block = l * r->bpl + k, .pos0 = k * bt,
								  .n_tokens = end - k * bt < bt ? end - k * bt : bt};
			rc = backend_attn_blocks(be, r->spans, ns);
			CHECK(rc == 0, "attn_blocks: %s", backend_error(be));
			rc = backend_attn_end(be, &b->attn[l]);
			CHECK(rc == 0, "attn_end: %s", backend_error(be));
		}
		if (step_parts != PARTS_ATTN) {
			rc = backend_ffn(be, &b->ffn[l]);
			CHECK(rc == 0, "ffn: %s", backend_error(be));
		}
	}
	enqueue_ms = now_ms() - t0;
	if (r->logits) {
		const uint32_t row = 0;
		rc = backend_logits_rows(be, &b->head, &row, 1, r->logits);
		CHECK(rc == 0, "logits_rows: %s", backend_error(be));
		return -1;
	}
	rc = backend_logits_argmax(be, &b->head, &id);
	CHECK(rc == 0, "logits_argmax: %s", backend_error(be));
	return id;
}

/* The median of v[0, n) (sorted in place; the upper one of an even count). */
static double median_of(double *v, uint32_t n)
{
	qsort(v, n, sizeof(double), cmp_double);
	return n ? v[n / 2] : 0.0;
}

/* Median ms of nd decode steps from *pos on (advanced); the median host enqueue time too. */
static double perf_decode(struct perf_run *r, uint32_t *pos, uint32_t nd, double *enqueue)
{
	double d[64], q[64];
	CHECK(nd <= 64, "at most 64 steps");
	for (uint32_t i = 0; i < nd; i++, (*pos)++) {
		double t0 = now_ms();
		perf_step(r, 1, *pos);
		d[i] = now_ms() - t0;
		q[i] = enqueue_ms;
	}
	*enqueue = median_of(q, nd);
	return median_of(d, nd);
}

static double hbm_read_rate; /* bytes/s, measured at start */

/* Prefill a 512-token chunk at 0, decode 16 tokens (~context 528), time lm_head alone; with
 * long_ctx, prefill on to ~4k in 512-token chunks and decode 32 more. */
static void big_run(const struct big *b, uint32_t gemv, uint32_t attn, bool long_ctx, FILE *json)
{
	struct perf_run r;
	perf_open(&r, b, gemv, attn);
	char how[128];
	snprintf(how, sizeof(how), "%s, gemv %s, attention %s%s", b->weights, gemv_name(gemv, b->quant),
		 attn == BACKEND_ATTN_SIMPLE ? "simple" : "mma",
		 bench_fuse == BACKEND_FUSE_NONE      ? ", kernels unfused"
		 : bench_fuse == BACKEND_FUSE_LATE_KV ? ", earlier keys loaded after the wait"
		 : bench_fuse == BACKEND_FUSE_ONE_KEY_WARP ? ", one attention warp a query"
		 : bench_fuse == BACKEND_FUSE_NARROW_DQ ? ", integer products in blocks of one row group"
		 : bench_fuse == BACKEND_FUSE_APART_DQ ? ", a launch per format of a product's parts"
		 : bench_fuse == BACKEND_FUSE_WIDE_QKV ? ", q/k/v in wide blocks"
		 : bench_fuse == BACKEND_FUSE_ANY_ITEMS ? ", whole steps walked as any rows"
		 : bench_fuse == BACKEND_FUSE_ROWS_APART ? ", wide blocks' row groups apart"
							: "");

	/* Warm-up: one chunk and a few decode steps, then start over at position 0. */
	perf_step(&r, PERF_CHUNK, 0);
	for (uint32_t i = 0; i < 3; i++)
		perf_step(&r, 1, PERF_CHUNK + i);

	double pf[3];
	for (int i = 0; i < 3; i++) {
		double t0 = now_ms();
		perf_step(&r, PERF_CHUNK, 0);
		pf[i] = now_ms() - t0;
	}
	const double pf_ms = median_of(pf, 3);
	fprintf(stderr, "perf (%s): prefill 512 tokens at position 0: %.2f ms, %.0f tokens/s\n", how, pf_ms,
		PERF_CHUNK / pf_ms * 1e3);
	uint32_t pos = PERF_CHUNK;
	double enq, dt = perf_decode(&r, &pos, 16, &enq), dt_short = dt, enq_short = enq;
	const double bound_ms = b->weight_bytes / hbm_read_rate * 1e3;
	fprintf(stderr, "perf (%s): decode at context ~%u: median %.3f ms/token, %.0f GB/s of weights, %.2fx the HBM "
		"bound of %.3f ms; host enqueue %.3f ms\n", how, pos, dt, b->weight_bytes / (dt * 1e-3) / 1e9,
		dt / bound_ms, bound_ms, enq);
	/* lm_head alone (final norm, one GEMV over 1 GB, argmax): the matrix-vector bandwidth. */
	double lm[16];
	for (int i = 0; i < 16; i++) {
		int32_t id;
		double t0 = now_ms();
		int rc = backend_logits_argmax(r.be, &b->head, &id);
		CHECK(rc == 0, "logits_argmax: %s", backend_error(r.be));
		lm[i] = now_ms() - t0;
	}
	const double lm_ms = median_of(lm, 16);
	fprintf(stderr, "perf (%s): lm_head alone: %.3f ms, %.0f GB/s\n", how, lm_ms,
		(double)b->head_bytes / (lm_ms * 1e-3) / 1e9);
	double chunk_ms = 0, dt_long = 0;
	uint32_t ctx_long = 0;
	if (long_ctx) {
		double tot = 0;
		uint32_t chunks = 0;
		while (pos + PERF_CHUNK + 40 <= PERF_CTX) {
			double t0 = now_ms();
			perf_step(&r, PERF_CHUNK, pos);
			tot += now_ms() - t0;
			pos += PERF_CHUNK;
			chunks++;
		}
		fprintf(stderr, "perf (%s): prefill %u more 512-token chunks up to position %u: %.2f ms each, %.0f "
			"tokens/s\n", how, chunks, pos, tot / chunks, PERF_CHUNK * chunks / tot * 1e3);
		dt_long = perf_decode(&r, &pos, 32, &enq);
		fprintf(stderr, "perf (%s): decode at context ~%u: median %.3f ms/token; host enqueue %.3f ms\n", how, pos,
			dt_long, enq);
		chunk_ms = tot / chunks;
		ctx_long = pos;
	}
	fprintf(json,
		"{\"weights\": \"%s\", \"gemv\": \"%s\", \"attention\": \"%s\", \"fused\": %s, \"fuse\": %u, "
		"\"prefill_512_ms\": %.4f, "
		"\"decode_ms\": %.4f, \"decode_context\": %u, \"enqueue_ms\": %.4f, \"weight_bytes\": %zu, "
		"\"hbm_read_bytes_per_s\": %.4g, \"hbm_bound_ms\": %.4f, \"decode_over_bound\": %.3f, "
		"\"lm_head_ms\": %.4f, \"prefill_512_long_ms\": %.4f, \"decode_long_ms\": %.4f, "
		"\"decode_long_context\": %u}\n",
		b->weights, gemv_name(gemv, b->quant), attn == BACKEND_ATTN_SIMPLE ? "simple" : "mma",
		bench_fuse == BACKEND_FUSE_NONE ? "false" : "true", bench_fuse, pf_ms, dt_short,
		PERF_CHUNK + 16, enq_short, b->weight_bytes, hbm_read_rate, bound_ms, dt_short / bound_ms, lm_ms,
		chunk_ms, dt_long, ctx_long);
	fflush(json);
	perf_close(&r);
}

/* ---- several sequences a decode step (continuous batching) ----------------------------------
 * N sequences share the first PERF_CHUNK positions' KV (blocks 0.. of each layer, prefilled once)
 * and each writes its own tokens into a block of its own after them, as the runner's sequences
 * with a common prefix do; a step takes one token of each and brings every row's logits to the
 * host (logits_rows into pageable memory, as batch.c does). */
#define BATCH_MAX 64

static double perf_batch_step(struct perf_run *r, uint32_t n, uint32_t pos, float *logits, double *enqueue)
{
	const struct big *b = r->b;
	struct backend *be = r->be;
	uint32_t bt = r->bt, pre = PERF_CHUNK / bt, rows[BATCH_MAX];
	double t0 = now_ms();
	for (uint32_t i = 0; i < n; i++) {
		r->pos[i] = pos;
		r->seq[i] = i;
		rows[i] = i;
	}
	struct backend_batch batch = {.n = n, .tokens = r->tok + pos, .pos = r->pos, .seq = r->seq};
	int rc = backend_embed(be, &b->embed, &batch);
	CHECK(rc == 0, "embed: %s", backend_error(be));
	for (uint32_t l = 0; l < b->cfg.n_layers; l++) {
		for (uint32_t i = 0; i < n; i++) {
			r->dst_block[i] = l * r->bpl + pre + i;
			r->dst_row[i] = pos % bt;
		}
		rc = backend_attn_begin(be, &b->attn[l], l, r->dst_block, r->dst_row);
		CHECK(rc == 0, "attn_begin: %s", backend_error(be));
		/* Each sequence's spans in one call, as kv_cache_attend makes them. */
		for (uint32_t i = 0; i < n; i++) {
			uint32_t ns = 0;
			for (uint32_t k = 0; k < pre; k++)
				r->spans[ns++] = (struct kv_span){.block = l * r->bpl + k, .pos0 = k * bt, .n_tokens = bt,
								  .row0 = i, .n_rows = 1};
			r->spans[ns++] = (struct kv_span){.block = l * r->bpl + pre + i, .pos0 = pre * bt,
							  .n_tokens = pos + 1 - pre * bt, .row0 = i, .n_rows = 1};
			rc = backend_attn_blocks(be, r->spans, ns);
			CHECK(rc == 0, "attn_blocks: %s", backend_error(be));
		}
		rc = backend_attn_end(be, &b->attn[l]);
		CHECK(rc == 0, "attn_end: %s", backend_error(be));
		rc = backend_ffn(be, &b->ffn[l]);
		CHECK(rc == 0, "ffn: %s", backend_error(be));
	}
	*enqueue = now_ms() - t0;
	rc = backend_logits_rows(be, &b->head, rows, n, logits);
	CHECK(rc == 0, "logits_rows: %s", backend_error(be));
	return now_ms() - t0;
}

/* Decode steps of 1, 4, 16, 32 and 64 sequences at context ~PERF_CHUNK + 8: median ms a step. */
static void big_batch(const struct big *b)
{
	static const uint32_t ns[] = {1, 4, 16, 32, 64};
	struct perf_run r;
	perf_open(&r, b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_DEFAULT);
	CHECK(PERF_CHUNK / r.bt + BATCH_MAX <= r.bpl, "the arena holds too few blocks a layer");
	free(r.spans);
	r.spans = malloc((PERF_CHUNK / r.bt + 1) * sizeof(*r.spans));
	float *logits = malloc((size_t)BATCH_MAX * b->cfg.vocab_size * sizeof(float));
	CHECK(r.spans && logits, "out of memory");
	perf_step(&r, PERF_CHUNK, 0); /* the shared prefix's KV */
	double one = 0;
	for (size_t k = 0; k < sizeof(ns) / sizeof(ns[0]); k++) {
		double d[12], q[12], enq;
		for (uint32_t i = 0; i < 12; i++) {
			d[i] = perf_batch_step(&r, ns[k], PERF_CHUNK + i % r.bt, logits, &enq);
			q[i] = enq;
		}
		const double step_ms = median_of(d, 12), enq_ms = median_of(q, 12);
		if (k == 0)
			one = step_ms;
		fprintf(stderr, "perf (%s, batched): %2u sequences a decode step: median %.3f ms a step (%.2fx one "
			"sequence's), %.0f tokens/s; host enqueue %.3f ms\n", b->weights, ns[k], step_ms, step_ms / one,
			ns[k] / step_ms * 1e3, enq_ms);
		printf("{\"weights\": \"%s\", \"batch\": %u, \"step_ms\": %.4f, \"enqueue_ms\": %.4f}\n", b->weights,
		       ns[k], step_ms, enq_ms);
	}
	fflush(stdout);
	free(logits);
	perf_close(&r);
}

/* One decode step or one 512-token prefill chunk (at context ~512) alone in the profiler's
 * window, after a warm-up. */
static void big_profile(const struct big *b, const char *what)
{
	struct perf_run r;
	perf_open(&r, b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_DEFAULT);
	perf_step(&r, PERF_CHUNK, 0);
	for (uint32_t i = 0; i < 3; i++)
		perf_step(&r, 1, PERF_CHUNK + i);
	bool decode = !strcmp(what, "decode");
	CUDA_OK(cudaProfilerStart());
	perf_step(&r, decode ? 1 : PERF_CHUNK, PERF_CHUNK + 3);
	CUDA_OK(cudaProfilerStop());
	fprintf(stderr, "perf: profiled one %s step\n", decode ? "decode" : "512-token prefill");
	perf_close(&r);
}

/* Bytes of a group's matrices and vectors in device memory. */
static size_t group_bytes(const struct group_weights *w)
{
	size_t n = 0;
	for (int r = 0; r < ROLE_COUNT; r++)
		if (w->t[r].data[PLACE_DEVICE])
			n += (size_t)w->t[r].rows * w->t[r].row_bytes;
	return n;
}

/* --parts: the default path's decode step at context ~528 whole, then with only the attention
 * groups and only the FFN groups of its layers (lm_head in each), each against the HBM bound of
 * the bytes it reads: where a step's time goes as it runs, launches overlapping (Nsight Compute
 * runs the kernels one after another). */
static void big_parts(const struct big *b)
{
	size_t attn = 0, ffn = 0;
	for (uint32_t l = 0; l < b->cfg.n_layers; l++) {
		attn += group_bytes(&b->attn[l]);
		ffn += group_bytes(&b->ffn[l]);
	}
	static const char *const names[3] = {"whole step", "attention groups only", "FFN groups only"};
	const size_t bytes[3] = {b->weight_bytes, attn + b->head_bytes, ffn + b->head_bytes};
	for (uint32_t p = PARTS_ALL; p <= PARTS_FFN; p++) {
		struct perf_run r;
		step_parts = PARTS_ALL;
		perf_open(&r, b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_DEFAULT);
		perf_step(&r, PERF_CHUNK, 0); /* the context, every layer's KV written */
		step_parts = p;
		uint32_t pos = PERF_CHUNK;
		double enq;
		perf_decode(&r, &pos, 3, &enq); /* warm-up */
		const double dt = perf_decode(&r, &pos, 16, &enq);
		const double bound = (double)bytes[p] / hbm_read_rate * 1e3;
		fprintf(stderr, "perf (%s, parts): %s: decode median %.3f ms/token, %.2f GB read, %.2fx its HBM bound "
			"of %.3f ms (%.1f us a layer)\n", b->weights, names[p], dt, (double)bytes[p] / 1e9, dt / bound,
			bound, dt * 1e3 / b->cfg.n_layers);
		printf("{\"weights\": \"%s\", \"parts\": \"%s\", \"decode_ms\": %.4f, \"bytes\": %zu, "
		       "\"hbm_bound_ms\": %.4f}\n", b->weights, names[p], dt, bytes[p], bound);
		fflush(stdout);
		perf_close(&r);
	}
	step_parts = PARTS_ALL;
}

/* The default path's decode step, then the same with one kind of kernel left out of every layer
 * (cuda_test_leave_out: the results are wrong, the time is what the step spends with those kernels
 * in it as it runs), each kind in turn, twice. */
static void big_without(const struct big *b)
{
	static const struct {
		uint32_t parts;
		const char *name;
	} kinds[] = {
		{0, "nothing"},
		{CUDA_TEST_QKV, "q/k/v"},
		{CUDA_TEST_ROPE, "RoPE and the KV write"},
		{CUDA_TEST_ATTN, "RoPE and the attention"},
		{CUDA_TEST_OPROJ, "o_proj"},
		{CUDA_TEST_GATEUP, "gate/up"},
		{CUDA_TEST_DOWN, "down"},
	};
	const uint32_t nk = sizeof(kinds) / sizeof(kinds[0]);
	double base[2] = {0, 0};
	for (int round = 0; round < 2; round++) {
		for (uint32_t k = 0; k < nk; k++) {
			struct perf_run r;
			perf_open(&r, b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_DEFAULT);
			perf_step(&r, PERF_CHUNK, 0); /* the context, every layer's KV written */
			char err[200] = "";
			CHECK(cuda_test_leave_out(r.be, kinds[k].parts, err, sizeof(err)) == 0, "%s", err);
			uint32_t pos = PERF_CHUNK;
			double enq;
			perf_decode(&r, &pos, 3, &enq); /* warm-up */
			const double dt = perf_decode(&r, &pos, 16, &enq);
			if (k == 0)
				base[round] = dt;
			const double us = (base[round] - dt) * 1e3 / b->cfg.n_layers;
			fprintf(stderr, "perf (%s, without): %s left out: decode median %.3f ms/token, %.1f us a layer "
				"less than with everything (round %d)\n", b->weights, kinds[k].name, dt, us, round + 1);
			printf("{\"weights\": \"%s\", \"left_out\": \"%s\", \"decode_ms\": %.4f, "
			       "\"us_a_layer\": %.2f, \"round\": %d}\n", b->weights, kinds[k].name, dt, us, round + 1);
			fflush(stdout);
			perf_close(&r);
		}
	}
}

/* --trace: the default path's decode step at context ~528 with each launch of its products, RoPE
 * and attention stamping the time in every block (cuda_test_trace): when its blocks started, ended
 * their wait for the kernel before, had their input staged and ended. Prints the last traced
 * step's launches, then for each launch of a layer the medians over the middle layers of: the
 * time from the launch before's last block to its own (what the place adds to the step), from that
 * block to the first of its own past the wait (the hand-off), the median block's staging and
 * work, and its last block's lead over its median one (the tail). */
static int cmp_block_end(const void *a, const void *b)
{
	const double x = ((const struct cuda_trace_block *)a)->end, y = ((const struct cuda_trace_block *)b)->end;
	return x < y ? -1 : x > y;
}

/* --trace-blocks L: the blocks of layer L's launches from the traced step, each launch's sorted by
 * their end: where each ran (multiprocessor, and how many of the launch's blocks shared it) and its
 * stamps, the attention's every block, the others' last 16. */
static void trace_layer_blocks(struct perf_run *r, const struct cuda_trace_launch *L, uint32_t first,
			       uint32_t count)
{
	static struct cuda_trace_block B[TRACE_BLOCKS_MAX];
	static uint32_t on_sm[1024];
	char err[200] = "";
	for (uint32_t i = first; i < first + count; i++) {
		uint32_t n = 0;
		CHECK(cuda_test_trace_blocks(r->be, i, B, TRACE_BLOCKS_MAX, &n, err, sizeof(err)) == 0, "%s", err);
		memset(on_sm, 0, sizeof(on_sm));
		for (uint32_t k = 0; k < n; k++)
			if (B[k].sm >= 0 && B[k].sm < 1024)
				on_sm[B[k].sm]++;
		uint32_t hist[5] = {0}, sms = 0;
		for (uint32_t m = 0; m < 1024; m++) {
			hist[on_sm[m] < 4 ? on_sm[m] : 4]++;
			sms += on_sm[m] > 0;
		}
		fprintf(stderr, "blocks: launch %u %s: %u blocks on %u multiprocessors (with 1, 2, 3, 4+ of them: %u %u %u "
			"%u); block, sm (its blocks there), start, wait, staged, end (us)\n", i, L[i].what, n, sms, hist[1],
			hist[2], hist[3], hist[4]);
		qsort(B, n, sizeof(B[0]), cmp_block_end);
		const bool all = strcmp(L[i].what, "attention") == 0;
		for (uint32_t k = all || n < 16 ? 0 : n - 16; k < n; k++)
			fprintf(stderr, "blocks: %3u %5u %4d (%u)  %8.2f %8.2f %8.2f %8.2f\n", i, B[k].block, B[k].sm,
				B[k].sm >= 0 && B[k].sm < 1024 ? on_sm[B[k].sm] : 0, B[k].start, B[k].wait, B[k].staged,
				B[k].end);
	}
}

static void big_trace(const struct big *b, long blocks_layer)
{
	struct perf_run r;
	perf_open(&r, b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_DEFAULT);
	perf_step(&r, PERF_CHUNK, 0); /* the context, every layer's KV written */
	uint32_t pos = PERF_CHUNK, n = 0;
	double enq;
	char err[200] = "";
	perf_decode(&r, &pos, 3, &enq); /* warm-up */
	const double plain = perf_decode(&r, &pos, 8, &enq);
	CHECK(cuda_test_trace(r.be, true, err, sizeof(err)) == 0, "%s", err);
	const double traced = perf_decode(&r, &pos, 8, &enq);
	static struct cuda_trace_launch L[512];
	CHECK(cuda_test_trace_read(r.be, L, 512, &n, err, sizeof(err)) == 0, "%s", err);
	const uint32_t nl = b->cfg.n_layers;
	fprintf(stderr, "perf (%s, trace): decode median %.3f ms/token, %.3f with the stamps; %u launches stamped\n",
		b->weights, plain, traced, n);
	fprintf(stderr, "trace: launch, what, blocks; us from the step's first stamp: first start, waits first..last, "
		"staged median, ends median..last\n");
	for (uint32_t i = 0; i < n; i++)
		fprintf(stderr, "trace: %3u %-16s %4u  %8.2f  %8.2f..%-8.2f  %8.2f  %8.2f..%-8.2f\n", i, L[i].what,
			L[i].blocks, L[i].start_first, L[i].wait_first, L[i].wait_last, L[i].staged_med, L[i].end_med,
			L[i].end_last);
	/* A layer's launches: the products before RoPE (q/k/v, or q/k and then v where v's format
	 * differs), RoPE, the attention, o_proj, gate/up, down; lm_head last. */
	static const char *const roles[] = {"q/k/v", "q/k", "v", "RoPE", "attention", "o_proj", "gate/up", "down"};
	enum { NROLES = sizeof(roles) / sizeof(roles[0]) };
	double v[NROLES][5][64];
	uint32_t cnt[NROLES] = {0}, l = 0, i = 0;
	while (i + 1 < n && l < nl) {
		uint32_t pre = 0;
		while (i + pre < n && strcmp(L[i + pre].what, "rope") != 0)
			pre++;
		CHECK((pre == 1 || pre == 2) && i + pre + 5 <= n, "layer %u: %u launches before RoPE, not 1 or 2", l, pre);
		if ((long)l == blocks_layer)
			trace_layer_blocks(&r, L, i, pre + 5);
		for (uint32_t k = 0; k < pre + 5; k++) {
			const uint32_t role = k < pre ? (pre == 1 ? 0 : 1 + k) : 3 + (k - pre);
			const struct cuda_trace_launch *c = &L[i + k], *p = c - 1;
			if (l == 0 || l + 1 == nl || i + k == 0 || cnt[role] == 64)
				continue; /* the middle layers only */
			double *o[5];
			for (int m = 0; m < 5; m++)
				o[m] = &v[role][m][cnt[role]];
			*o[0] = c->end_last - p->end_last;
			*o[1] = c->wait_first - p->end_last;
			*o[2] = c->staged_med >= 0 ? c->staged_med - c->wait_med : 0.0;
			*o[3] = c->end_med - (c->staged_med >= 0 ? c->staged_med : c->wait_med);
			*o[4] = c->end_last - c->end_med;
			cnt[role]++;
		}
		i += pre + 5;
		l++;
	}
	CHECK(l == nl && i + 1 == n, "%u launches stamped: not %u layers and lm_head", n, nl);
	fprintf(stderr, "trace: medians over layers 1..%u; us: adds to the step (last block to last block), hand-off "
		"(the last block before to the first past its wait), staging (median block), work (median block), "
		"tail (last block after the median)\n", nl - 2);
	for (uint32_t ro = 0; ro < NROLES; ro++) {
		if (!cnt[ro])
			continue;
		double m[5];
		for (int k = 0; k < 5; k++)
			m[k] = median_of(v[ro][k], cnt[ro]);
		fprintf(stderr, "trace: %-10s (%2u layers) adds %6.2f  hand-off %5.2f  staging %5.2f  work %6.2f  tail %5.2f\n",
			roles[ro], cnt[ro], m[0], m[1], m[2], m[3], m[4]);
		printf("{\"weights\": \"%s\", \"trace_role\": \"%s\", \"layers\": %u, \"adds_us\": %.2f, "
		       "\"handoff_us\": %.2f, \"staging_us\": %.2f, \"work_us\": %.2f, \"tail_us\": %.2f}\n", b->weights,
		       roles[ro], cnt[ro], m[0], m[1], m[2], m[3], m[4]);
	}
	fflush(stdout);
	CHECK(cuda_test_trace(r.be, false, err, sizeof(err)) == 0, "%s", err);
	/* The next step's logits, hashed: the same bits from two trees say that a change of how the
	 * kernels run computes the same function. */
	const uint32_t vocab = b->cfg.vocab_size;
	r.logits = malloc((size_t)vocab * sizeof(float));
	CHECK(r.logits != NULL, "out of memory");
	perf_step(&r, 1, pos);
	uint64_t hash = 1469598103934665603ull;
	const unsigned char *bytes = (const unsigned char *)r.logits;
	for (size_t k = 0; k < (size_t)vocab * sizeof(float); k++)
		hash = (hash ^ bytes[k]) * 1099511628211ull;
	fprintf(stderr, "perf (%s, trace): logits of the step at position %u: FNV-1a %016llx\n", b->weights, pos,
		(unsigned long long)hash);
	free(r.logits);
	r.logits = NULL;
	perf_close(&r);
}

int main(int argc, char **argv)
{
	bool quick = false, quant = false, default_only = false, parts = false, without = false, trace = false;
	long ab_fuse = -1, trace_blocks = -1;
	char *profile = NULL;
	bool batch = false;
	struct opt opts[] = {
		{"batch", OPT_BOOL, &batch, NULL,
		 "decode steps of 1, 4, 16, 32 and 64 sequences (continuous batching) only, their ms a step"},
		{"quick", OPT_BOOL, &quick, NULL,
		 "no ~4K context, no cuBLAS decode and no simple attention: the default path, the unfused one and "
		 "(--quant) the other one-token quantized paths"},
		{"default-only", OPT_BOOL, &default_only, NULL,
		 "the default decode and attention path alone, no ~4K context (one run: to compare a change)"},
		{"parts", OPT_BOOL, &parts, NULL,
		 "the default path's decode step whole, with the layers' attention groups only and with their FFN "
		 "groups only, each against the HBM bound of what it reads"},
		{"ab-fuse", OPT_INT, &ab_fuse, NULL,
		 "the default path and the same with backend_params.fuse N (enum backend_fuse) in turn, twice "
		 "(one machine's A/B of a way of chaining kernels)"},
		{"without", OPT_BOOL, &without, NULL,
		 "the default path's decode step, then with each kind of kernel left out of every layer (q/k/v, "
		 "RoPE, the attention, o_proj, gate/up, down; wrong results, timing only), twice: each kind's "
		 "share of the step as it runs"},
		{"trace", OPT_BOOL, &trace, NULL,
		 "the default path's decode step with each launch's blocks stamping the time (start, wait, input "
		 "staged, end): the launches of one step, then per place in a layer what it adds to the step, its "
		 "hand-off, staging, work and tail"},
		{"trace-blocks", OPT_INT, &trace_blocks, NULL,
		 "--trace, and for layer N's launches each block's multiprocessor and stamps (the attention's every "
		 "block, the others' last 16 to end)"},
		{"quant", OPT_BOOL, &quant, NULL, "GGUF Q4_K_M weights (Q4_K and Q6_K blocks) instead of BF16"},
		{"profile", OPT_STRING, &profile, NULL,
		 "decode or prefill: one such step alone between cudaProfilerStart and cudaProfilerStop"},
		{0},
	};
	int rc = config_parse("bench-kernels",
			      "times the CUDA backend's kernels on a Llama-3-8B shape, every weight resident", opts,
			      argc, argv, NULL, NULL);
	if (rc > 0)
		return 0;
	if (rc < 0)
		return 2;
	if (profile && strcmp(profile, "decode") && strcmp(profile, "prefill")) {
		fprintf(stderr, "bench-kernels: --profile takes decode or prefill, not '%s'\n", profile);
		return 2;
	}
	size_t free_b = 0, total_b = 0;
	CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
	if (free_b < (18ull << 30)) {
		fprintf(stderr, "bench-kernels: %.1f GiB free on the GPU, the 8B shape needs ~18\n",
			free_b / (double)(1ull << 30));
		return 1;
	}
	/* The bound every decode step is set against: how fast device memory delivers reads. */
	hbm_read_rate = hbm_read((size_t)2 << 30, 10);
	CHECK(hbm_read_rate > 0, "the HBM read measurement failed");
	fprintf(stderr, "perf: HBM read %.2f TB/s\n", hbm_read_rate / 1e12);
	struct big b;
	memset(&b, 0, sizeof(b));
	if (quant)
		big_new_quant(&b);
	else
		big_new(&b);
	if (batch || profile) {
		if (batch)
			big_batch(&b);
		else
			big_profile(&b, profile);
		big_free(&b);
		return 0;
	}
	fprintf(stderr, "perf: Llama-3-8B shape, %s weights resident (%.2f GB read per decode step), BF16 KV, "
		"16-token blocks\n", b.weights, b.weight_bytes / 1e9);
	if (trace || trace_blocks >= 0) {
		big_trace(&b, trace_blocks);
	} else if (parts) {
		big_parts(&b);
	} else if (without) {
		big_without(&b);
	} else if (ab_fuse >= 0) {
		for (int i = 0; i < 2; i++) {
			big_run(&b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_DEFAULT, false, stdout);
			bench_fuse = (uint32_t)ab_fuse;
			big_run(&b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_DEFAULT, false, stdout);
			bench_fuse = BACKEND_FUSE_DEFAULT;
		}
	} else if (default_only) {
		big_run(&b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_DEFAULT, false, stdout);
	} else if (quant) {
		big_run(&b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_DEFAULT, !quick, stdout);
		big_run(&b, BACKEND_GEMV_DP4A_REGS, BACKEND_ATTN_DEFAULT, false, stdout);
		bench_fuse = BACKEND_FUSE_NONE;
		big_run(&b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_DEFAULT, false, stdout);
		bench_fuse = BACKEND_FUSE_DEFAULT;
		big_run(&b, BACKEND_GEMV_ROWS1, BACKEND_ATTN_DEFAULT, !quick, stdout);
		if (!quick)
			big_run(&b, BACKEND_GEMV_CUBLAS, BACKEND_ATTN_DEFAULT, false, stdout);
	} else {
		big_run(&b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_DEFAULT, !quick, stdout);
		bench_fuse = BACKEND_FUSE_NONE;
		big_run(&b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_DEFAULT, false, stdout);
		bench_fuse = BACKEND_FUSE_DEFAULT;
		if (!quick) {
			big_run(&b, BACKEND_GEMV_ROWS2, BACKEND_ATTN_DEFAULT, false, stdout);
			big_run(&b, BACKEND_GEMV_CUBLAS, BACKEND_ATTN_DEFAULT, false, stdout);
			big_run(&b, BACKEND_GEMV_DEFAULT, BACKEND_ATTN_SIMPLE, false, stdout);
		}
	}
	big_free(&b);
	return 0;
}

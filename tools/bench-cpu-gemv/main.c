/* bench-cpu-gemv: the CPU products of cpu-compute/ (cpu_compute.h) timed over a matrix larger
 * than the caches, on N threads of the CPU worker pool (each a contiguous range of rows, as the
 * runner splits its CPU share), in GB/s of weight bytes read. The number to hold it against is
 * the machine's read bandwidth: the same rows read on the same threads with nothing computed,
 * measured in the same run and printed beside it.
 *
 *   bench-cpu-gemv [--format BF16] [--rows 8192] [--cols 8192] [--threads N] [--repeats 10] [--scalar]
 *   bench-cpu-gemv --ffn-tokens N [...]   the CPU's share of a split FFN instead (ffn_share.h): gate
 *       and up of --rows x --cols, down of --cols x --rows, for N tokens at once, against one token
 *   bench-cpu-gemv --experts K [--expert-pool E] [--job-threads P] [--gap-us G] [--no-taper]
 *       [--no-help] [--trace N] [...]   a decode layer's K routed experts on the CPU as the CUDA
 *       backend runs them (cuda/moe_cpu.cu): K jobs of
 *       the runner's task pool submitted at once, each an expert (gate and up of --rows x --cols,
 *       down of --cols x --rows) of E, cut for P threads (default ffn_share_threads_for), a gap of G
 *       us between layers (the GPU's part of the chain); timed from the first submission to the
 *       last job's end, as the runner's experts_span_ms; --trace N prints the last N layers' parts,
 *       when each started and ended; --expert-share R gives each job the CPU's share of an expert
 *       split at row R (rows R.. of gate and up, those columns of down: --split-experts)
 *
 * The weights are random: 64 distinct rows of Gaussian values quantized with quant_quantize,
 * repeated to fill the matrix (the K formats' quantizer is too slow to make every row; every byte
 * is still read from memory). x is Gaussian; its preparation (one thread) is timed on its own. */
#include <stdbool.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "common/config.h"
#include "common/quant.h"
#include "common/util.h"
#include "services/gpu-runner/cpu-compute/cpu_compute.h"
#include "services/gpu-runner/cpu-compute/ffn_share.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/cpu/pool.h"

#define DISTINCT_ROWS 64

struct job {
	const struct cpu_vec *x;
	const uint8_t *w;
	enum dtype t;
	uint64_t row_bytes;
	uint32_t cols;
	float *y;
	int failed; /* a thread's product failed (it cannot print from there) */
};

static void run_rows(const void *arg, uint32_t tid, uint32_t begin, uint32_t end)
{
	struct job *j = (struct job *)arg;
	char err[256];
	if (cpu_matvec(j->x, j->w, j->t, j->row_bytes, begin, end, 0, j->cols, j->y + begin, err, sizeof(err)))
		j->failed = 1;
}

/* The bound: the same rows read and nothing computed, four rows at a time as the kernels read
 * them, with the same prefetch (eight 64-bit words a row and step, folded with xor so the reads
 * cannot be dropped). */
struct read_job {
	const uint8_t *w;
	uint64_t row_bytes;
	uint64_t sink[CPU_POOL_MAX_THREADS];
};

static uint64_t read_span(const uint8_t *p, uint64_t stride, int nrows, uint64_t len)
{
	uint64_t a[8] = {0};
	for (uint64_t o = 0; o + 64 <= len; o += 64)
		for (int k = 0; k < nrows; k++) {
			const uint8_t *q = p + k * stride + o;
			/* as the kernels (CC_PF_AHEAD along each row, past its end into the row of the next step) */
			__builtin_prefetch(q + 1024 + (o + 1024 >= len ? nrows * stride - len : 0));
			for (int i = 0; i < 8; i++) {
				uint64_t v;
				memcpy(&v, q + 8 * i, 8);
				a[i] ^= v;
			}
		}
	return a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
}

static void read_rows(const void *arg, uint32_t tid, uint32_t begin, uint32_t end)
{
	struct read_job *j = (struct read_job *)arg;
	uint64_t h = 0;
	uint32_t r = begin;
	for (; r + 4 <= end; r += 4)
		h ^= read_span(j->w + r * j->row_bytes, j->row_bytes, 4, j->row_bytes);
	for (; r < end; r++)
		h ^= read_span(j->w + r * j->row_bytes, j->row_bytes, 1, j->row_bytes);
	j->sink[tid] = h;
}

static uint64_t rng = 0x243f6a8885a308d3ull;

static uint64_t splitmix(void)
{
	uint64_t a = (rng += 0x9e3779b97f4a7c15ull);
	a = (a ^ (a >> 30)) * 0xbf58476d1ce4e5b9ull;
	a = (a ^ (a >> 27)) * 0x94d049bb133111ebull;
	return a ^ (a >> 31);
}

static double normal(void)
{
	uint64_t a = (rng += 0x9e3779b97f4a7c15ull), b = (rng += 0x9e3779b97f4a7c15ull);
	a = (a ^ (a >> 30)) * 0xbf58476d1ce4e5b9ull;
	a ^= a >> 31;
	b = (b ^ (b >> 30)) * 0xbf58476d1ce4e5b9ull;
	b ^= b >> 31;
	const double u = ((double)(a >> 11) + 0.5) * 0x1.0p-53, v = ((double)(b >> 11) + 0.5) * 0x1.0p-53;
	return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static int cmp_double(const void *a, const void *b)
{
	const double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* ---- --ffn-tokens: an FFN share job (ffn_share.h) ---- */

#define FFN_BENCH_MAX_TOKENS 16

struct ffn_run {
	struct ffn_share *fs;
	struct ffn_share_job *job;
	const void *x;
	float *y;
	uint32_t threads;
	int failed;
	uint64_t prefetch; /* bytes of the job's reading order brought into the caches before it (untimed) */
};

/* Thread tid brings its slice of the job's first r->prefetch bytes into the caches (ffn_share_prefetch),
 * as the runner's idle workers do in the gap before a split FFN. */
static void prefetch_parts(const void *arg, uint32_t tid, uint32_t begin, uint32_t end)
{
	(void)tid;
	(void)end;
	const struct ffn_run *r = (const struct ffn_run *)arg;
	const uint64_t b = r->prefetch * begin / r->threads, e = r->prefetch * (begin + 1) / r->threads;
	ffn_share_prefetch(r->fs, r->job, b, e - b);
}

/* Thread tid takes parts tid, tid + threads, ...: every thread's first-phase parts come before its
 * second-phase ones, as the task pool's FIFO hands them out. */
static void run_parts(const void *arg, uint32_t tid, uint32_t begin, uint32_t end)
{
	(void)tid;
	(void)end;
	struct ffn_run *r = (struct ffn_run *)arg;
	const uint32_t np = ffn_share_parts(r->fs);
	char err[256];
	for (uint32_t p = begin; p < np; p += r->threads)
		if (ffn_share_part(r->fs, r->job, r->x, r->y, p, np, err, sizeof(err)))
			r->failed = 1;
}

/* A matrix of rows x cols in format t: DISTINCT_ROWS random rows repeated. NULL when out of memory. */
static uint8_t *make_matrix(enum dtype t, uint32_t rows, uint32_t cols)
{
	const uint64_t row_bytes = dtype_row_bytes(t, cols), bytes = row_bytes * rows;
	uint8_t *w = aligned_alloc(2u << 20, (bytes + (2u << 20) - 1) / (2u << 20) * (2u << 20));
	float *src = malloc((size_t)cols * sizeof(float));
	if (!w || !src) {
		free(w);
		free(src);
		return NULL;
	}
	for (uint32_t r = 0; r < rows && r < DISTINCT_ROWS; r++) {
		for (uint32_t c = 0; c < cols; c++)
			src[c] = (float)(0.02 * normal());
		quant_quantize(t, src, w + r * row_bytes, cols);
	}
	for (uint32_t r = DISTINCT_ROWS; r < rows; r++)
		memcpy(w + r * row_bytes, w + (r % DISTINCT_ROWS) * row_bytes, row_bytes);
	free(src);
	return w;
}

/* A copy of a matrix of `bytes` that make_matrix made, in memory of its own (aligned the same way). */
static uint8_t *copy_matrix(const uint8_t *src, uint64_t bytes)
{
	uint8_t *w = aligned_alloc(2u << 20, (bytes + (2u << 20) - 1) / (2u << 20) * (2u << 20));
	if (w)
		memcpy(w, src, bytes);
	return w;
}

/* The best time of `repeats` jobs of n tokens (after one warm-up), or a negative value on failure. */
static double time_ffn(struct cpu_pool *pool, struct ffn_run *r, const struct ffn_share_mat m[3], uint32_t rows,
		       uint32_t n, uint32_t repeats)
{
	struct ffn_share_job job;
	r->job = &job;
	double best = 1e30;
	for (uint32_t i = 0; i <= repeats; i++) {
		ffn_share_job_init(&job, &m[0], &m[1], &m[2], rows, n, DT_BF16);
		if (r->prefetch)
			cpu_pool_run(pool, prefetch_parts, r, r->threads);
		double t0 = now_s();
		cpu_pool_run(pool, run_parts, r, r->threads);
		double dt = now_s() - t0;
		if (i && dt < best)
			best = dt;
	}
	r->job = NULL;
	return r->failed ? -1 : best;
}

static int bench_ffn(enum dtype t, uint32_t rows, uint32_t dim, uint32_t n, uint32_t threads, uint32_t repeats,
		     uint64_t prefetch)
{
	uint8_t *gate = make_matrix(t, rows, dim), *up = make_matrix(t, rows, dim), *down = make_matrix(t, dim, rows);
	uint16_t *x = malloc((size_t)n * dim * sizeof(uint16_t));
	float *y = malloc((size_t)n * dim * sizeof(float));
	char err[256];
	struct cpu_pool *pool = NULL;
	struct ffn_share *fs = NULL;
	int rc = gate && up && down && x && y ? 0 : -1;
	if (rc)
		snprintf(err, sizeof(err), "cannot allocate the FFN's weights");
	if (!rc)
		rc = cpu_pool_create(threads, &pool, err, sizeof(err));
	if (!rc)
		rc = ffn_share_create(dim, rows, FFN_BENCH_MAX_TOKENS, cpu_pool_threads(pool), &fs, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "bench-cpu-gemv: %s\n", err);
		return 1;
	}
	for (size_t i = 0; i < (size_t)n * dim; i++)
		x[i] = f32_to_bf16((float)normal());
	const struct ffn_share_mat m[3] = {{gate, t, dtype_row_bytes(t, dim)},
					   {up, t, dtype_row_bytes(t, dim)},
					   {down, t, dtype_row_bytes(t, rows)}};
	const double bytes = (double)rows * (double)(2 * m[0].row_bytes) + (double)dim * (double)m[2].row_bytes;
	struct ffn_run r = {.fs = fs, .x = x, .y = y, .threads = cpu_pool_threads(pool)};
	double one = time_ffn(pool, &r, m, rows, 1, repeats), all = time_ffn(pool, &r, m, rows, n, repeats);
	if (one < 0 || all < 0) {
		fprintf(stderr, "bench-cpu-gemv: an FFN share job failed\n");
		return 1;
	}
	printf("FFN share %s %s: %u rows of %u (%.1f MB), %u threads: %u tokens at once %.3f ms (%.3f ms a token, "
	       "%.2f GB/s of weights read once); one token %.3f ms (%.2f GB/s)\n",
	       dtype_name(t), cpu_matmul_path(t), rows, dim, bytes / 1e6, r.threads, n, all * 1e3, all * 1e3 / n,
	       bytes / all / 1e9, one * 1e3, bytes / one / 1e9);
	if (prefetch) {
		/* The same job of one token after its first bytes were brought into the caches (untimed). */
		r.prefetch = prefetch;
		double pf = time_ffn(pool, &r, m, rows, 1, repeats);
		if (pf < 0) {
			fprintf(stderr, "bench-cpu-gemv: an FFN share job failed\n");
			return 1;
		}
		const double left = bytes > (double)prefetch ? bytes - (double)prefetch : 0;
		printf("FFN share, one token, its first %.1f MiB in the caches first: %.3f ms (%.2f GB/s; %+.3f ms against "
		       "none, %.2f GB/s for the bytes left to read)\n",
		       (double)prefetch / 1048576.0, pf * 1e3, bytes / pf / 1e9, (pf - one) * 1e3, left / pf / 1e9);
	}
	ffn_share_destroy(&fs);
	cpu_pool_destroy(&pool);
	free(gate);
	free(up);
	free(down);
	free(x);
	free(y);
	return 0;
}

/* ---- --experts: a layer's routed experts on the task pool (cuda/moe.cu's CPU jobs) ---- */

#define EXPERTS_MAX 8
#define EXPERTS_MADE 32 /* distinct experts a pool makes; more are copies (bench_experts) */

struct expert_slot {
	struct ffn_share *fs;
	uint64_t *trace; /* --trace N: (N, parts, 2) each traced layer's parts' start and end, ns since the
			  * layer's start, and (N) its end (trace_end); NULL without */
	uint64_t *trace_end;
	int traced;	 /* the traced layer running (0..N-1), or -1 */
	uint32_t parts;	 /* of the job (ffn_share_parts) */
	uint64_t t0;	 /* the layer's start */
	struct ffn_share_job job;
	struct task_job tj;
	float *x, *y;
	uint32_t done, waiters, seq;
	uint64_t end_ns;
};

static int expert_part(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	struct expert_slot *es = (struct expert_slot *)arg;
	const uint64_t s = es->traced >= 0 ? now_ns() : 0;
	int rc = ffn_share_part(es->fs, &es->job, es->x, es->y, part, n_parts, err, errlen);
	if (es->traced >= 0) {
		uint64_t *t = es->trace + ((size_t)es->traced * es->parts + part) * 2;
		t[0] = s - es->t0;
		t[1] = now_ns() - es->t0;
	}
	return rc;
}

/* --trace: the traced layers' parts, each job's in part order: when each started and ended (us
 * after the layer's first submission), the first phase's parts [0, P) and then [P, 2P), which run
 * the second phase after it. A part that waits for its job's first phase runs queued parts of the
 * others meanwhile (task_pool_help): its time holds theirs. */
static void print_trace(const struct expert_slot *slot, uint32_t k, uint32_t n, uint32_t first)
{
	const uint32_t parts = slot[0].parts;
	for (uint32_t l = 0; l < n; l++) {
		printf("trace of layer %u (us after its first submission: start-end of each part; parts %u.. also "
		       "run the second phase):\n", first + l, parts / 2);
		for (uint32_t i = 0; i < k; i++) {
			const uint64_t *t = slot[i].trace + (size_t)l * parts * 2;
			printf("  job %u (ended %.1f):", i, (double)slot[i].trace_end[l] * 1e-3);
			for (uint32_t p = 0; p < parts; p++)
				printf(" %.1f-%.1f", (double)t[2 * p] * 1e-3, (double)t[2 * p + 1] * 1e-3);
			printf("\n");
		}
	}
}

static void expert_ended(struct task_job *tj)
{
	((struct expert_slot *)tj->user)->end_ns = now_ns();
}

static int bench_experts(enum dtype t, uint32_t rows, uint32_t dim, uint32_t k, uint32_t pool_e, uint32_t per,
			 bool taper, bool help, uint32_t gap_us, uint32_t threads, uint32_t layers, uint32_t trace,
			 uint32_t share_r)
{
	char err[256];
	const uint64_t mat = (uint64_t)rows * dtype_row_bytes(t, dim),
		       expert = 2 * mat + (uint64_t)dim * dtype_row_bytes(t, rows);
	/* --expert-share R: the CPU's share of a split expert, rows [R, rows) of gate and up and those
	 * columns of down (its rows a whole row apart), as the runner's route leaves it (0: whole). */
	const uint32_t srows = rows - share_r;
	const uint64_t share = 2 * (uint64_t)srows * dtype_row_bytes(t, dim) + (uint64_t)dim * dtype_row_bytes(t, srows);
	uint8_t **w = calloc(3 * (size_t)pool_e, sizeof(*w));
	if (!w)
		return 1;
	printf("experts: making %u experts of %.1f MB (%s, %u x %u)...\n", pool_e, (double)expert / 1e6, dtype_name(t),
	       rows, dim);
	fflush(stdout);
	/* EXPERTS_MADE distinct experts; a larger pool's others are copies of them in memory of their own
	 * (where the bytes lie is what a pool larger than the caches is for, not their values). */
	for (uint32_t e = 0; e < pool_e; e++) {
		const uint32_t f = 3 * (e % EXPERTS_MADE);
		const bool made = e < EXPERTS_MADE;
		if (!(w[3 * e] = made ? make_matrix(t, rows, dim) : copy_matrix(w[f], mat)) ||
		    !(w[3 * e + 1] = made ? make_matrix(t, rows, dim) : copy_matrix(w[f + 1], mat)) ||
		    !(w[3 * e + 2] = made ? make_matrix(t, dim, rows) : copy_matrix(w[f + 2], expert - 2 * mat))) {
			fprintf(stderr, "bench-cpu-gemv: cannot allocate %u experts of %.1f MB\n", pool_e, (double)expert / 1e6);
			return 1;
		}
	}
	/* The pool as the runner makes it beside a GPU (cpu_share.c): pinned workers that poll through
	 * the gaps between layers, the first two CPUs left to the thread that submits and the runner's
	 * handoff dispatcher where there are enough. */
	struct task_pool_config pc;
	task_pool_config_default(&pc);
	const long online = sysconf(_SC_NPROCESSORS_ONLN);
	pc.threads = threads;
	pc.cpu_offset = online >= (long)threads + 2 ? 2 : online > (long)threads ? 1 : 0;
	pc.spin_us = 1000;
	struct task_pool *pool = NULL;
	if (task_pool_create(&pc, &pool, err, sizeof(err))) {
		fprintf(stderr, "bench-cpu-gemv: %s\n", err);
		return 1;
	}
	if (!per)
		per = ffn_share_threads_for(share, threads);
	struct expert_slot slot[EXPERTS_MAX];
	memset(slot, 0, sizeof(slot));
	for (uint32_t i = 0; i < k; i++) {
		slot[i].x = malloc((size_t)dim * sizeof(float));
		slot[i].y = malloc((size_t)dim * sizeof(float));
		slot[i].traced = -1;
		if (!slot[i].x || !slot[i].y || ffn_share_create(dim, rows, 1, per, &slot[i].fs, err, sizeof(err))) {
			fprintf(stderr, "bench-cpu-gemv: %s\n", slot[i].x && slot[i].y ? err : "out of memory");
			return 1;
		}
		slot[i].parts = ffn_share_parts(slot[i].fs);
		if (trace && (!(slot[i].trace = calloc((size_t)trace * slot[i].parts * 2, sizeof(uint64_t))) ||
			      !(slot[i].trace_end = calloc(trace, sizeof(uint64_t))))) {
			fprintf(stderr, "bench-cpu-gemv: out of memory for the trace of %u layers\n", trace);
			return 1;
		}
		for (uint32_t c = 0; c < dim; c++)
			slot[i].x[c] = (float)normal();
	}
	double *span = malloc(((size_t)layers + 1) * sizeof(double));
	if (!span)
		return 1;
	uint32_t chosen[EXPERTS_MAX];
	uint64_t wait0 = 0;
	for (uint32_t l = 0; l <= layers; l++) { /* layer 0 warms up */
		if (l == 1)
			for (uint32_t i = 0; i < k; i++) {
				struct ffn_share_stats ss;
				ffn_share_get_stats(slot[i].fs, &ss);
				wait0 += ss.wait_ns;
			}
		for (uint32_t i = 0; i < k; i++) { /* k distinct experts at random */
			uint32_t e;
			bool again;
			do {
				e = (uint32_t)(splitmix() >> 33) % pool_e;
				again = false;
				for (uint32_t j = 0; j < i; j++)
					again |= chosen[j] == e;
			} while (again);
			chosen[i] = e;
		}
		const int traced = trace && l + trace > layers ? (int)(l + trace - layers - 1) : -1;
		const uint64_t t0 = now_ns();
		for (uint32_t i = 0; i < k; i++) {
			struct expert_slot *es = &slot[i];
			es->t0 = t0;
			es->traced = traced;
			const uint64_t gu_off = (uint64_t)share_r * dtype_row_bytes(t, dim), d_off = dtype_row_bytes(t, share_r);
			const struct ffn_share_mat g = {w[3 * chosen[i]] + gu_off, t, dtype_row_bytes(t, dim)},
						   u = {w[3 * chosen[i] + 1] + gu_off, t, dtype_row_bytes(t, dim)},
						   d = {w[3 * chosen[i] + 2] + d_off, t, dtype_row_bytes(t, rows)};
			ffn_share_job_init(&es->job, &g, &u, &d, srows, 1, DT_F32);
			es->job.taper = taper;
			es->job.pool = help ? pool : NULL;
			memset(&es->tj, 0, sizeof(es->tj));
			task_job_init(&es->tj, expert_part, es, ffn_share_parts(es->fs), &es->done, ++es->seq);
			es->tj.done_waiters = &es->waiters;
			es->tj.on_complete = expert_ended;
			es->tj.user = es;
			task_pool_submit(pool, &es->tj);
		}
		uint64_t end = 0;
		for (uint32_t i = 0; i < k; i++) {
			task_word_wait(&slot[i].done, &slot[i].waiters, slot[i].seq, 50, 0);
			if (slot[i].tj.rc) {
				fprintf(stderr, "bench-cpu-gemv: an expert's job failed: %s\n", slot[i].tj.err);
				return 1;
			}
			end = slot[i].end_ns > end ? slot[i].end_ns : end;
			if (traced >= 0)
				slot[i].trace_end[traced] = slot[i].end_ns - t0;
		}
		span[l] = (double)(end - t0) * 1e-9;
		for (uint64_t g0 = now_ns(); now_ns() - g0 < (uint64_t)gap_us * 1000;)
			;
	}
	if (trace)
		print_trace(slot, k, trace, layers - trace + 1);
	qsort(span + 1, layers, sizeof(double), cmp_double);
	double sum = 0;
	for (uint32_t l = 1; l <= layers; l++)
		sum += span[l];
	const double bytes = (double)k * (double)share, mean = sum / layers, med = span[1 + layers / 2];
	uint64_t wait = 0;
	for (uint32_t i = 0; i < k; i++) {
		struct ffn_share_stats ss;
		ffn_share_get_stats(slot[i].fs, &ss);
		wait += ss.wait_ns;
	}
	char shared[96] = "";
	if (share_r)
		snprintf(shared, sizeof(shared), " (the CPU's share of each: rows %u.. of %u, %.1f MB)", share_r, rows,
			 (double)share / 1e6);
	printf("experts %s %s: %u of %.1f MB a layer%s (%u to choose from), jobs cut for %u threads (%u parts, chunks "
	       "of about %.0f KB%s%s), %u workers, a gap of %u us: a layer's span median %.3f ms (%.2f GB/s), mean %.3f ms "
	       "(%.2f GB/s), best %.3f ms; parts waiting for their job's first phase %.1f%% of the workers' time\n",
	       dtype_name(t), cpu_compute_path(t), k, (double)expert / 1e6, shared, pool_e, per, ffn_share_parts(slot[0].fs),
	       (double)share / (3.0 * FFN_SHARE_PARTS_PER_THREAD * per) / 1024,
	       !taper ? "" : FFN_SHARE_PARTS_PER_THREAD * per >= FFN_SHARE_TAPER_MIN_CHUNKS ? ", tapered"
	       : 2 * FFN_SHARE_PARTS_PER_THREAD * per >= FFN_SHARE_TAPER_MIN_CHUNKS ? ", the first phase tapered"
										 : ", too few to taper",
	       help ? "" : ", waiting parts spin",
	       task_pool_threads(pool), gap_us, med * 1e3,
	       bytes / med / 1e9, mean * 1e3, bytes / mean / 1e9, span[1] * 1e3,
	       100.0 * (double)(wait - wait0) * 1e-9 / (sum * task_pool_threads(pool)));
	for (uint32_t i = 0; i < k; i++) {
		ffn_share_destroy(&slot[i].fs);
		free(slot[i].x);
		free(slot[i].y);
		free(slot[i].trace);
		free(slot[i].trace_end);
	}
	task_pool_destroy(&pool);
	for (uint32_t i = 0; i < 3 * pool_e; i++)
		free(w[i]);
	free(w);
	free(span);
	return 0;
}

/* A count option's value in [min, max], or -1 with the reason on stderr. */
static int in_range(const char *opt, long v, long min, long max, uint32_t *out)
{
	if (v < min) {
		fprintf(stderr, "bench-cpu-gemv: --%s %ld: expected a number >= %ld\n", opt, v, min);
		return -1;
	}
	if (v > max) {
		fprintf(stderr, "bench-cpu-gemv: --%s %ld: at most %ld\n", opt, v, max);
		return -1;
	}
	*out = (uint32_t)v;
	return 0;
}

int main(int argc, char **argv)
{
	char *format = NULL;
	long rows_l = 0, cols_l = 0, threads_l = sysconf(_SC_NPROCESSORS_ONLN), repeats_l = 0, ffn_tokens_l = 0,
	     experts_l = 0, pool_l = 0, job_threads_l = -1, gap_l = 0, trace_l = 0, share_l = 0, prefetch_l = 0;
	bool scalar = false, no_taper = false, no_help = false;
	const struct opt table[] = {
		{"format", OPT_STRING, &format, "BF16", "weight format: F32 F16 BF16 Q8_0 Q4_0 Q4_K Q5_K Q6_K"},
		{"rows", OPT_INT, &rows_l, "8192", "rows of the matrix"},
		{"cols", OPT_INT, &cols_l, "8192", "columns, a multiple of the format's block"},
		{"threads", OPT_INT, &threads_l, NULL, "threads, the caller included (default: the CPUs online)"},
		{"repeats", OPT_INT, &repeats_l, "10", "timed products after one warm-up (--experts: layers)"},
		{"scalar", OPT_BOOL, &scalar, NULL,
		 "the plain C path (PIPELINE_CPU_ISA=scalar does the same; =amx adds the AMX tiles to BF16 FFN "
		 "shares where the CPU has them)"},
		{"ffn-tokens", OPT_INT, &ffn_tokens_l, "0",
		 "time the CPU's share of a split FFN for N tokens (1..16) instead: gate and up of --rows x --cols, "
		 "down of --cols x --rows, all in --format, as the runner runs it (ffn_share.h); printed beside the "
		 "same job of one token"},
		{"experts", OPT_INT, &experts_l, "0",
		 "time a decode layer's K routed experts (1..8) on the runner's task pool instead (--threads "
		 "workers), as the CUDA backend runs them: one job each, submitted at once; gate and up of --rows x "
		 "--cols, down of --cols x --rows"},
		{"expert-pool", OPT_INT, &pool_l, "32",
		 "experts to choose from, distinct at random each layer (32 made, any more copies of them in memory "
		 "of their own: a pool larger than the CPU's caches reads from DRAM)"},
		{"job-threads", OPT_INT, &job_threads_l, NULL,
		 "cut each expert's job for P threads (default: ffn_share_threads_for)"},
		{"gap-us", OPT_INT, &gap_l, "150", "microseconds between layers (the GPU's part of a layer)"},
		{"prefetch", OPT_INT, &prefetch_l, "0",
		 "--ffn-tokens: also time the one-token job after its first N MiB (its reading order) were brought "
		 "into the caches by the threads, untimed, as idle workers could between two split FFNs"},
		{"expert-share", OPT_INT, &share_l, "0",
		 "--experts: each expert split at intermediate row R, the CPU computing rows R.. of gate and up and "
		 "those columns of down, as the runner's --split-experts leaves it (0: whole experts; R a multiple "
		 "of the format's block, below --rows)"},
		{"trace", OPT_INT, &trace_l, "0",
		 "--experts: print the last N layers' parts, when each started and ended (the first phase's, then "
		 "those that also run the second)"},
		{"no-taper", OPT_BOOL, &no_taper, NULL,
		 "equal chunks in each phase of a job (the runner tapers an expert's: smaller toward each phase's "
		 "end, ffn_share_job.taper)"},
		{"no-help", OPT_BOOL, &no_help, NULL,
		 "a part that waits for its job's first phase spins (the runner's runs the pool's queued parts "
		 "meanwhile, ffn_share_job.pool)"},
		{0},
	};
	int prc = config_parse("bench-cpu-gemv",
			      "The CPU products of cpu-compute/ timed over a matrix larger than the caches, in GB/s of "
			      "weight bytes read, beside the rate of plainly reading the same bytes (the best and "
			      "median of --repeats); or a split FFN's CPU share (--ffn-tokens), or a decode layer's "
			      "routed experts (--experts).",
			      table, argc, argv, NULL, NULL);
	if (prc > 0)
		return 0;
	if (prc < 0)
		return 2;
	enum dtype t = DT_COUNT;
	for (int i = 0; i < DT_COUNT; i++)
		if (strcasecmp(format, dtype_name((enum dtype)i)) == 0)
			t = (enum dtype)i;
	if (t == DT_COUNT) {
		fprintf(stderr, "bench-cpu-gemv: --format %s: unknown (see --help)\n", format);
		return 2;
	}
	uint32_t rows, cols, threads, repeats, ffn_tokens, experts, expert_pool, job_threads, gap_us, trace, share_r, prefetch_mb;
	if (in_range("rows", rows_l, 1, UINT32_MAX, &rows) || in_range("cols", cols_l, 1, UINT32_MAX, &cols) ||
	    in_range("threads", threads_l, 1, UINT32_MAX, &threads) ||
	    in_range("repeats", repeats_l, 1, UINT32_MAX, &repeats) ||
	    in_range("ffn-tokens", ffn_tokens_l, 0, FFN_BENCH_MAX_TOKENS, &ffn_tokens) ||
	    in_range("experts", experts_l, 0, EXPERTS_MAX, &experts) ||
	    in_range("expert-pool", pool_l, 1, UINT32_MAX, &expert_pool) ||
	    (job_threads_l != -1 && in_range("job-threads", job_threads_l, 1, FFN_SHARE_MAX_THREADS, &job_threads)) ||
	    in_range("gap-us", gap_l, 0, UINT32_MAX, &gap_us) || in_range("trace", trace_l, 0, UINT32_MAX, &trace) ||
	    in_range("prefetch", prefetch_l, 0, 1u << 20, &prefetch_mb) ||
	    in_range("expert-share", share_l, 0, UINT32_MAX, &share_r))
		return 2;
	if (job_threads_l == -1)
		job_threads = 0; /* ffn_share_threads_for */
	const bool taper = !no_taper, help = !no_help;
	if (cols % dtype_block_elems(t)) {
		fprintf(stderr, "bench-cpu-gemv: --cols %u is not a multiple of %s's block of %u\n", cols,
			dtype_name(t), dtype_block_elems(t));
		return 2;
	}
	if (scalar)
		cpu_compute_force_isa(CPU_ISA_SCALAR);
	if (experts) {
		if (rows % dtype_block_elems(t)) {
			fprintf(stderr, "bench-cpu-gemv: --rows %u (down's columns) is not a multiple of %s's block of %u\n",
				rows, dtype_name(t), dtype_block_elems(t));
			return 2;
		}
		if (expert_pool < experts) {
			fprintf(stderr, "bench-cpu-gemv: --expert-pool %u: fewer than --experts %u\n", expert_pool, experts);
			return 2;
		}
		if (share_r >= rows || share_r % dtype_block_elems(t)) {
			fprintf(stderr, "bench-cpu-gemv: --expert-share %u: expected a multiple of %s's block of %u below "
				"--rows %u\n", share_r, dtype_name(t), dtype_block_elems(t), rows);
			return 2;
		}
		return bench_experts(t, rows, cols, experts, expert_pool, job_threads, taper, help, gap_us, threads,
				     repeats, trace < repeats ? trace : repeats, share_r);
	}
	if (ffn_tokens) {
		if (rows % dtype_block_elems(t)) {
			fprintf(stderr, "bench-cpu-gemv: --rows %u (down's columns) is not a multiple of %s's block of %u\n",
				rows, dtype_name(t), dtype_block_elems(t));
			return 2;
		}
		return bench_ffn(t, rows, cols, ffn_tokens, threads, repeats, (uint64_t)prefetch_mb << 20);
	}

	const uint64_t row_bytes = dtype_row_bytes(t, cols), bytes = row_bytes * rows;
	uint8_t *w = make_matrix(t, rows, cols);
	float *x = malloc((size_t)cols * sizeof(float)), *y = malloc((size_t)rows * sizeof(float));
	if (!w || !x || !y) {
		fprintf(stderr, "bench-cpu-gemv: cannot allocate %.1f MB of weights\n", (double)bytes / 1e6);
		return 1;
	}
	for (uint32_t c = 0; c < cols; c++)
		x[c] = (float)normal();

	char err[256];
	struct cpu_vec *xv = NULL;
	struct cpu_pool *pool = NULL;
	int rc = cpu_vec_create(cols, &xv, err, sizeof(err));
	if (!rc)
		rc = cpu_pool_create(threads, &pool, err, sizeof(err));
	double t0, prep_s = 1e30; /* the best of repeats + 1 preparations, the first warming the buffers */
	for (uint32_t i = 0; i <= repeats && !rc; i++) {
		t0 = now_s();
		rc = cpu_vec_prepare(xv, t, x, cols, err, sizeof(err));
		if (now_s() - t0 < prep_s)
			prep_s = now_s() - t0;
	}
	if (!rc)
		rc = cpu_matvec(xv, w, t, row_bytes, 0, 1, 0, cols, y, err, sizeof(err)); /* the arguments, once */
	if (rc) {
		fprintf(stderr, "bench-cpu-gemv: %s\n", err);
		return 1;
	}
	struct job job = {.x = xv, .w = w, .t = t, .row_bytes = row_bytes, .cols = cols, .y = y};
	cpu_pool_run(pool, run_rows, &job, rows); /* warm-up: page faults, caches */
	double *times = malloc(repeats * sizeof(double));
	if (!times)
		return 1;
	for (uint32_t i = 0; i < repeats; i++) {
		t0 = now_s();
		cpu_pool_run(pool, run_rows, &job, rows);
		times[i] = now_s() - t0;
	}
	if (job.failed) {
		fprintf(stderr, "bench-cpu-gemv: a product failed\n");
		return 1;
	}
	qsort(times, repeats, sizeof(double), cmp_double);
	const double best = times[0], med = times[repeats / 2];
	static struct read_job rj;
	rj.w = w;
	rj.row_bytes = row_bytes;
	double read_best = 1e30;
	for (uint32_t i = 0; i < repeats; i++) {
		t0 = now_s();
		cpu_pool_run(pool, read_rows, &rj, rows);
		if (now_s() - t0 < read_best)
			read_best = now_s() - t0;
	}
	printf("%s %s: %u x %u (%.1f MB), %u threads: best %.3f ms (%.2f GB/s), median %.3f ms (%.2f GB/s); "
	       "reading the same bytes: %.2f GB/s; x prepared in %.1f us\n",
	       dtype_name(t), cpu_compute_path(t), rows, cols, (double)bytes / 1e6, cpu_pool_threads(pool), best * 1e3,
	       (double)bytes / best / 1e9, med * 1e3, (double)bytes / med / 1e9, (double)bytes / read_best / 1e9,
	       prep_s * 1e6);
	free(times);
	cpu_pool_destroy(&pool);
	cpu_vec_destroy(&xv);
	free(w);
	free(x);
	free(y);
	return 0;
}

/* ffn_share.c - the CPU's share of a split FFN as a two-phase job of the task pool. See
 * ffn_share.h. */
#include "services/gpu-runner/cpu-compute/ffn_share.h"

#include <errno.h>
#include <sched.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "services/gpu-runner/cpu-compute/cpu_compute.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/cpu/kernels.h"

#define SPINS_BEFORE_YIELD 4096u
/* With several tokens a part goes through its rows in blocks of about this many weight bytes, every
 * token's product over a block before the next block: the block is read from memory once and from
 * the core's cache for the other tokens (a part's rows of a large FFN are megabytes, more than the
 * cache holds, and were read again for every token). */
#define BLOCK_BYTES (256u * 1024u)

/* What one part keeps between jobs. */
struct part_scratch {
	/* (max_tokens) per token: x prepared for gate's and up's formats (xu: when they differ), h for
	 * down's. Token 0's are made at create; the others grow at their first use. */
	struct cpu_vec **xg, **xu;
	struct cpu_vec **xh;
	float *xf;		 /* (dim) x of one token widened */
	float *tmp;		 /* (ffn_dim) up's products, when gate's and up's formats or strides differ */
	struct cpu_xtiles *tg, *th; /* several tokens on AMX tiles: xg's and xh's vectors (tiles()) */
};

struct ffn_share {
	uint32_t dim, ffn_dim, max_tokens, threads;
	uint32_t parts; /* of each phase: FFN_SHARE_PARTS_PER_THREAD a thread, so that a worker the OS
			 * preempts (the runner's own threads, the loader's, share the CPUs) delays one
			 * small part, which the others make up for, not a thread's whole share */
	uint64_t jobs, bytes, ns;    /* ffn_share_stats (atomic) */
	uint64_t wait_ns, waits;     /* the same */
	float *h;		     /* (max_tokens, ffn_dim) the SwiGLU output, rounded to act */
	struct part_scratch *ps;     /* (2 parts) a part's own: every part may work on either phase */
};

int ffn_share_create(uint32_t dim, uint32_t ffn_dim, uint32_t max_tokens, uint32_t threads, struct ffn_share **out,
		     char *err, size_t errlen)
{
	*out = NULL;
	if (!dim || !ffn_dim || !max_tokens || max_tokens > 1024 || !threads || threads > FFN_SHARE_MAX_THREADS)
		return errorf(err, errlen, -EINVAL,
			      "cpu share: dim %u, ffn_dim %u, %u tokens, %u threads (threads 1..%u, tokens 1..1024)", dim,
			      ffn_dim, max_tokens, threads, FFN_SHARE_MAX_THREADS);
	struct ffn_share *fs = calloc(1, sizeof(*fs));
	if (!fs)
		return errorf(err, errlen, -ENOMEM, "cpu share: out of memory");
	fs->dim = dim;
	fs->ffn_dim = ffn_dim;
	fs->max_tokens = max_tokens;
	fs->threads = threads;
	fs->parts = threads * FFN_SHARE_PARTS_PER_THREAD;
	fs->h = calloc((size_t)max_tokens * ffn_dim, sizeof(float));
	fs->ps = calloc(2 * (size_t)fs->parts, sizeof(*fs->ps));
	int rc = 0;
	if (!fs->h || !fs->ps) {
		rc = errorf(err, errlen, -ENOMEM, "cpu share: out of memory for %u tokens of %u rows", max_tokens,
			    ffn_dim);
		goto out_destroy;
	}
	for (uint32_t i = 0; i < 2 * fs->parts; i++) {
		struct part_scratch *p = &fs->ps[i];
		p->xf = calloc(dim, sizeof(float));
		p->tmp = calloc(ffn_dim, sizeof(float));
		if (!p->xf || !p->tmp) {
			rc = errorf(err, errlen, -ENOMEM, "cpu share: out of memory for the scratch of %u threads",
				    threads);
			goto out_destroy;
		}
		if ((rc = cpu_xtiles_create(&p->tg, err, errlen)) || (rc = cpu_xtiles_create(&p->th, err, errlen)))
			goto out_destroy;
		p->xg = calloc(max_tokens, sizeof(*p->xg));
		p->xu = calloc(max_tokens, sizeof(*p->xu));
		p->xh = calloc(max_tokens, sizeof(*p->xh));
		if (!p->xg || !p->xu || !p->xh) {
			rc = errorf(err, errlen, -ENOMEM, "cpu share: out of memory for the scratch of %u threads",
				    threads);
			goto out_destroy;
		}
		for (uint32_t t = 0; t < max_tokens; t++)
			if ((rc = cpu_vec_create(t ? 0 : dim, &p->xg[t], err, errlen)) ||
			    (rc = cpu_vec_create(t ? 0 : dim, &p->xu[t], err, errlen)) ||
			    (rc = cpu_vec_create(t ? 0 : ffn_dim, &p->xh[t], err, errlen)))
				goto out_destroy;
	}
	*out = fs;
	return 0;

out_destroy:
	ffn_share_destroy(&fs);
	return rc;
}

void ffn_share_destroy(struct ffn_share **fsp)
{
	if (!fsp || !*fsp)
		return;
	struct ffn_share *fs = *fsp;
	for (uint32_t i = 0; fs->ps && i < 2 * fs->parts; i++) {
		for (uint32_t t = 0; t < fs->max_tokens; t++) {
			if (fs->ps[i].xg)
				cpu_vec_destroy(&fs->ps[i].xg[t]);
			if (fs->ps[i].xu)
				cpu_vec_destroy(&fs->ps[i].xu[t]);
			if (fs->ps[i].xh)
				cpu_vec_destroy(&fs->ps[i].xh[t]);
		}
		free(fs->ps[i].xg);
		free(fs->ps[i].xu);
		free(fs->ps[i].xh);
		free(fs->ps[i].xf);
		free(fs->ps[i].tmp);
		cpu_xtiles_destroy(&fs->ps[i].tg);
		cpu_xtiles_destroy(&fs->ps[i].th);
	}
	free(fs->ps);
	free(fs->h);
	free(fs);
	*fsp = NULL;
}

uint32_t ffn_share_parts(const struct ffn_share *fs)
{
	return 2 * fs->parts;
}

void ffn_share_job_init(struct ffn_share_job *job, const struct ffn_share_mat *gate, const struct ffn_share_mat *up,
			const struct ffn_share_mat *down, uint32_t rows, uint32_t n, enum dtype act)
{
	memset(job, 0, sizeof(*job));
	job->gate = *gate;
	job->up = *up;
	job->down = *down;
	job->rows = rows;
	job->n = n;
	job->act = act;
}

/* Rows [*b, *e) of total for part p of n: contiguous, in order, sizes differing by at most one. */
static void range(uint32_t total, uint32_t n, uint32_t p, uint32_t *b, uint32_t *e)
{
	*b = (uint32_t)((uint64_t)total * p / n);
	*e = (uint32_t)((uint64_t)total * (p + 1) / n);
}

/* v rounded to dtype act and widened back (what the GPU's activation of that dtype holds). */
static inline float round_act(uint32_t act, float v)
{
	if (act == DT_BF16)
		return bf16_to_f32(f32_to_bf16(v));
	if (act == DT_F16)
		return f16_to_f32(f32_to_f16(v));
	return v;
}

static size_t act_size(uint32_t act)
{
	return act == DT_F32 ? 4 : 2;
}

/* Rows a block of a part holds: about BLOCK_BYTES of weights when several tokens share them (one
 * token reads every row once whatever the blocks: the whole range). */
static uint32_t block_rows(uint32_t n, uint64_t row_bytes, uint32_t b, uint32_t e)
{
	if (n < 2 || !row_bytes)
		return e - b;
	uint64_t k = BLOCK_BYTES / row_bytes;
	return k < 1 ? 1 : k > e - b ? e - b : (uint32_t)k;
}

/* Products on AMX tiles (cpu_matmul; AMX in use, PIPELINE_CPU_ISA=amx): BF16 gate and up over
 * whole tiles of columns, up to CPU_MATMUL_MAX_TOKENS tokens. The tiles read each weight once for
 * every token, where the vector path reads a block of rows once and computes it once a token. One
 * token takes them too, so that a token's sums do not depend on how many others share its step
 * (batch.c's promise); a row on the tiles or not depends only on the chunks, which are cut on 16
 * rows then (chunk). */
#define TILE_ROWS 64 /* rows of a block on the tiles (their products of every token on the stack) */
static bool tiles(const struct ffn_share *fs, const struct ffn_share_job *job)
{
	return job->n <= CPU_MATMUL_MAX_TOKENS && job->gate.format == DT_BF16 && job->up.format == DT_BF16 &&
	       fs->dim % 32 == 0 && (cpu_compute_isa() & CPU_ISA_AMX_BF16);
}

/* ... and down's: BF16, over whole tiles of its columns (the share's rows of h). */
static bool tiles_down(const struct ffn_share *fs, const struct ffn_share_job *job)
{
	return job->n <= CPU_MATMUL_MAX_TOKENS && job->down.format == DT_BF16 && job->rows % 32 == 0 &&
	       (cpu_compute_isa() & CPU_ISA_AMX_BF16);
}

/* Where chunk i of n of a tapered phase begins (i = n: total): the first n / 2 chunks take three
 * quarters of the rows, the others the last quarter. Never decreasing in i. */
static uint32_t taper_start(uint32_t total, uint32_t n, uint32_t i)
{
	const uint32_t h = n / 2;
	const uint64_t big = h ? (uint64_t)total * 3 / 4 : 0;
	if (i <= h)
		return h ? (uint32_t)(big * i / h) : 0;
	return (uint32_t)(big + ((uint64_t)total - big) * (i - h) / (n - h));
}

/* Chunk i of n of a phase's total rows: range, or tapered (ffn_share_job.taper, n at least
 * FFN_SHARE_TAPER_MIN_CHUNKS); on the tiles (a16) every boundary but the last on a multiple of 16
 * rows (the tiles' rows). */
static void chunk(bool taper, bool a16, uint32_t total, uint32_t n, uint32_t i, uint32_t *b, uint32_t *e)
{
	if (taper && n >= FFN_SHARE_TAPER_MIN_CHUNKS) {
		*b = taper_start(total, n, i);
		*e = taper_start(total, n, i + 1);
	} else {
		range(total, n, i, b, e);
	}
	if (a16) {
		*b &= ~15u;
		*e = i + 1 == n ? total : *e & ~15u;
	}
}

/* x of every token prepared for gate's (and up's) format, in the part's scratch. */
static int prepare_x(struct ffn_share *fs, const struct ffn_share_job *job, struct part_scratch *ps, const void *x,
		     bool fused, char *err, size_t errlen)
{
	const uint32_t dim = fs->dim;
	int rc = 0;
	for (uint32_t t = 0; t < job->n && rc == 0; t++) {
		dtype_to_f32((enum dtype)job->act, (const char *)x + (size_t)t * dim * act_size(job->act), ps->xf, dim);
		rc = cpu_vec_prepare(ps->xg[t], (enum dtype)job->gate.format, ps->xf, dim, err, errlen);
		if (rc == 0 && !fused)
			rc = cpu_vec_prepare(ps->xu[t], (enum dtype)job->up.format, ps->xf, dim, err, errlen);
	}
	if (rc == 0 && tiles(fs, job)) /* gate's and up's format alike: xg serves both */
		rc = cpu_xtiles_prepare(ps->tg, ps->xg, job->n, err, errlen);
	return rc;
}

/* swiglu_rows on the tiles: gate's and up's products of every token a block of rows at a time. */
static int swiglu_tiles(struct ffn_share *fs, const struct ffn_share_job *job, struct part_scratch *ps, uint32_t b,
			uint32_t e, char *err, size_t errlen)
{
	float g[CPU_MATMUL_MAX_TOKENS * TILE_ROWS], u[CPU_MATMUL_MAX_TOKENS * TILE_ROWS];
	int rc = 0;
	for (uint32_t r0 = b; r0 < e && rc == 0; r0 += TILE_ROWS) {
		const uint32_t r1 = e - r0 < TILE_ROWS ? e : r0 + TILE_ROWS, m = r1 - r0;
		if ((rc = cpu_matmul(ps->tg, job->gate.data, DT_BF16, job->gate.row_bytes, r0, r1, 0, fs->dim, g, m,
				     err, errlen)) ||
		    (rc = cpu_matmul(ps->tg, job->up.data, DT_BF16, job->up.row_bytes, r0, r1, 0, fs->dim, u, m, err,
				     errlen)))
			break;
		for (uint32_t t = 0; t < job->n; t++) {
			float *h = fs->h + (size_t)t * fs->ffn_dim + r0;
			for (uint32_t i = 0; i < m; i++)
				h[i] = round_act(job->act, cpu_silu_mul(g[t * m + i], u[t * m + i]));
		}
	}
	return rc;
}

/* The first phase over rows [b, e) of the share: h for every token, block after block of rows. */
static int swiglu_rows(struct ffn_share *fs, const struct ffn_share_job *job, struct part_scratch *ps, bool fused,
		       uint32_t b, uint32_t e, char *err, size_t errlen)
{
	const uint32_t dim = fs->dim, n = job->n;
	const enum dtype gf = (enum dtype)job->gate.format, uf = (enum dtype)job->up.format;
	if (tiles(fs, job))
		return swiglu_tiles(fs, job, ps, b, e, err, errlen);
	int rc = 0;
	const uint32_t step = block_rows(n, job->gate.row_bytes + job->up.row_bytes, b, e);
	for (uint32_t r0 = b; r0 < e && rc == 0; r0 += step) {
		const uint32_t r1 = e - r0 < step ? e : r0 + step;
		for (uint32_t t = 0; t < n && rc == 0; t++) {
			float *h = fs->h + (size_t)t * fs->ffn_dim;
			if (fused) {
				rc = cpu_swiglu(ps->xg[t], job->gate.data, job->up.data, gf, job->gate.row_bytes, r0, r1, 0,
						dim, h + r0, err, errlen);
			} else {
				/* Gate and up in different formats (or strides): two products, then SiLU * up. */
				if ((rc = cpu_matvec(ps->xg[t], job->gate.data, gf, job->gate.row_bytes, r0, r1, 0, dim,
						     h + r0, err, errlen)) ||
				    (rc = cpu_matvec(ps->xu[t], job->up.data, uf, job->up.row_bytes, r0, r1, 0, dim, ps->tmp,
						     err, errlen)))
					break;
				for (uint32_t i = r0; i < r1; i++)
					h[i] = cpu_silu_mul(h[i], ps->tmp[i - r0]);
			}
			if (rc)
				break;
			for (uint32_t i = r0; i < r1; i++)
				h[i] = round_act(job->act, h[i]);
		}
	}
	return rc;
}

/* The second phase over rows [b, e) of down: y for every token, block after block of rows (h
 * prepared in the part's scratch). */
static int down_rows(struct ffn_share *fs, const struct ffn_share_job *job, struct part_scratch *ps, float *y,
		     uint32_t b, uint32_t e, char *err, size_t errlen)
{
	const enum dtype df = (enum dtype)job->down.format;
	const uint32_t n = job->n;
	if (tiles_down(fs, job)) /* every row of every token in one pass */
		return cpu_matmul(ps->th, job->down.data, df, job->down.row_bytes, b, e, 0, job->rows, y + b, fs->dim,
				  err, errlen);
	int rc = 0;
	const uint32_t step = block_rows(n, job->down.row_bytes, b, e);
	for (uint32_t r0 = b; r0 < e && rc == 0; r0 += step) {
		const uint32_t r1 = e - r0 < step ? e : r0 + step;
		for (uint32_t t = 0; t < n && rc == 0; t++)
			rc = cpu_matvec(ps->xh[t], job->down.data, df, job->down.row_bytes, r0, r1, 0, job->rows,
					y + (size_t)t * fs->dim + r0, err, errlen);
	}
	return rc;
}

/* Claims the first phase's chunks (2P of the share's rows, in order: one for each part of the job,
 * so that every part that runs while the first phase is under way has some of it) and runs them
 * until none is left. A chunk that fails, or one of a job that does not fit, counts as done all the
 * same, so the second phase never waits for ever; the first error is returned. */
static int run_phase1(struct ffn_share *fs, struct ffn_share_job *job, struct part_scratch *ps, const void *x,
		      bool valid, char *err, size_t errlen)
{
	const uint32_t C = 2 * fs->parts;
	const bool fused = job->gate.format == job->up.format && job->gate.row_bytes == job->up.row_bytes;
	bool prepared = false;
	int rc = 0;
	for (;;) {
		uint32_t i = __atomic_fetch_add(&job->claimed1, 1, __ATOMIC_RELAXED);
		if (i >= C)
			break;
		uint32_t b, e;
		chunk(job->taper, tiles(fs, job), job->rows, C, i, &b, &e);
		if (valid && rc == 0 && b < e) {
			if (!prepared) {
				rc = prepare_x(fs, job, ps, x, fused, err, errlen);
				prepared = true;
			}
			if (rc == 0)
				rc = swiglu_rows(fs, job, ps, fused, b, e, err, errlen);
		}
		/* Release: this chunk's rows of h before the count (pairs with the acquire in the wait). */
		__atomic_add_fetch(&job->phase1_done, 1, __ATOMIC_RELEASE);
	}
	return rc;
}

int ffn_share_part(struct ffn_share *fs, struct ffn_share_job *job, const void *x, float *y, uint32_t part,
		   uint32_t n_parts, char *err, size_t errlen)
{
	const uint32_t P = fs->parts;
	/* A job cut otherwise than ffn_share_parts says fails in every part (each returns at once,
	 * none waits for another). */
	if (n_parts != 2 * P || part >= n_parts)
		return errorf(err, errlen, -EINVAL, "cpu share: part %u of %u, where the share is cut in %u parts", part,
			      n_parts, 2 * P);
	struct part_scratch *ps = &fs->ps[part];
	int rc = 0;
	uint64_t zero = 0, t = now_ns();
	__atomic_compare_exchange_n(&job->t0_ns, &zero, t, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
	const bool valid = job->n > 0 && job->n <= fs->max_tokens && job->rows <= fs->ffn_dim &&
			   (job->act == DT_F32 || job->act == DT_BF16 || job->act == DT_F16);
	if (!valid)
		rc = errorf(err, errlen, -EINVAL, "cpu share: %u tokens of %u rows in %s (at most %u tokens of %u "
			    "rows; activations F32, BF16 or F16)", job->n, job->rows,
			    job->act < DT_COUNT ? dtype_name((enum dtype)job->act) : "?", fs->max_tokens, fs->ffn_dim);
	/* Every part works on the first phase while some of it is left: a part of the second phase
	 * helps rather than waits (with few chunks a job, as an expert's on a slice of the pool, half of
	 * the workers would otherwise spin). */
	int prc = run_phase1(fs, job, ps, x, valid, err, errlen);
	rc = rc ? rc : prc;
	if (part < P)
		return rc;
	/* Waiting for the first phase's last chunks (the parts that took them finish them before they
	 * wait for anything): the pool's queued parts run here meanwhile where the job names its pool.
	 * wait_ns counts the time no part ran. */
	uint32_t spins = 0;
	uint64_t w0 = __atomic_load_n(&job->phase1_done, __ATOMIC_ACQUIRE) < 2 * P ? now_ns() : 0, helped = 0;
	while (__atomic_load_n(&job->phase1_done, __ATOMIC_ACQUIRE) < 2 * P) {
		uint64_t ran = 0;
		if (job->pool && task_pool_help(job->pool, &ran)) {
			helped += ran;
			spins = 0;
			continue;
		}
		if (++spins < SPINS_BEFORE_YIELD) {
#if defined(__x86_64__) || defined(__i386__)
			__builtin_ia32_pause();
#endif
		} else {
			sched_yield();
		}
	}
	if (w0) {
		const uint64_t waited = now_ns() - w0;
		__atomic_add_fetch(&fs->wait_ns, waited > helped ? waited - helped : 0, __ATOMIC_RELAXED);
		__atomic_add_fetch(&fs->waits, 1, __ATOMIC_RELAXED);
	}
	/* The second phase: down's rows in P chunks, claimed as the first phase's were. */
	bool prepared = false;
	for (;;) {
		uint32_t j = __atomic_fetch_add(&job->claimed2, 1, __ATOMIC_RELAXED);
		if (j >= P)
			break;
		if (!valid || rc)
			continue;
		if (!prepared) {
			const enum dtype df = (enum dtype)job->down.format;
			for (uint32_t tk = 0; tk < job->n && rc == 0; tk++)
				rc = cpu_vec_prepare(ps->xh[tk], df, fs->h + (size_t)tk * fs->ffn_dim, job->rows, err,
						     errlen);
			if (rc == 0 && tiles_down(fs, job))
				rc = cpu_xtiles_prepare(ps->th, ps->xh, job->n, err, errlen);
			prepared = true;
		}
		uint32_t b, e;
		chunk(job->taper, tiles_down(fs, job), fs->dim, P, j, &b, &e);
		if (rc == 0 && b < e)
			rc = down_rows(fs, job, ps, y, b, e, err, errlen);
	}
	if (__atomic_add_fetch(&job->phase2_done, 1, __ATOMIC_ACQ_REL) == P) {
		/* The job's last part of the second phase (every chunk of it done): what it read, and how long
		 * it took. */
		const uint64_t bytes = job->n * ffn_share_job_bytes(fs, job);
		__atomic_add_fetch(&fs->jobs, 1, __ATOMIC_RELAXED);
		__atomic_add_fetch(&fs->bytes, bytes, __ATOMIC_RELAXED);
		__atomic_add_fetch(&fs->ns, now_ns() - __atomic_load_n(&job->t0_ns, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
	}
	return rc;
}

/* ---- the job's weights into the caches ---- */

uint64_t ffn_share_job_bytes(const struct ffn_share *fs, const struct ffn_share_job *job)
{
	return (uint64_t)job->rows * (job->gate.row_bytes + job->up.row_bytes) +
	       (uint64_t)fs->dim * dtype_row_bytes((enum dtype)job->down.format, job->rows);
}

#define LINE 64u

/* A load of every line of [p, p + len). */
static uint64_t touch(const uint8_t *p, uint64_t len)
{
	uint64_t sum = 0;
	const uintptr_t end = (uintptr_t)p + len;
	for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)(LINE - 1); a < end; a += LINE)
		sum += *(const volatile uint8_t *)a;
	return sum;
}

uint64_t ffn_share_prefetch(const struct ffn_share *fs, const struct ffn_share_job *job, uint64_t offset,
			    uint64_t bytes)
{
	const uint64_t g = job->gate.row_bytes, u = job->up.row_bytes, pair = g + u;
	const uint64_t d = dtype_row_bytes((enum dtype)job->down.format, job->rows);
	const uint64_t first = (uint64_t)job->rows * pair, total = first + (uint64_t)fs->dim * d;
	if (offset >= total || !bytes)
		return 0;
	if (bytes > total - offset)
		bytes = total - offset;
	uint64_t left = bytes, at = offset, sink = 0;
	while (left) {
		const uint8_t *seg;
		uint64_t seg_len, in;
		if (at < first) { /* gate's row i, then up's */
			const uint64_t i = at / pair, w = at % pair;
			if (w < g) {
				seg = (const uint8_t *)job->gate.data + i * g;
				seg_len = g;
				in = w;
			} else {
				seg = (const uint8_t *)job->up.data + i * u;
				seg_len = u;
				in = w - g;
			}
		} else { /* down's row o, the share's columns */
			const uint64_t o = (at - first) / d;
			seg = (const uint8_t *)job->down.data + o * job->down.row_bytes;
			seg_len = d;
			in = (at - first) % d;
		}
		const uint64_t n = seg_len - in < left ? seg_len - in : left;
		sink += touch(seg + in, n);
		at += n;
		left -= n;
	}
	__asm__ __volatile__("" : : "r"(sink));
	return bytes;
}

uint32_t ffn_share_threads_for(uint64_t bytes, uint32_t pool_threads)
{
	return ffn_share_threads_for_chunk(bytes, pool_threads, FFN_SHARE_CHUNK_BYTES);
}

uint32_t ffn_share_threads_for_chunk(uint64_t bytes, uint32_t pool_threads, uint64_t chunk_bytes)
{
	uint64_t per = bytes / ((chunk_bytes ? chunk_bytes : FFN_SHARE_CHUNK_BYTES) * 3 * FFN_SHARE_PARTS_PER_THREAD);
	if (per > pool_threads)
		per = pool_threads;
	if (per > FFN_SHARE_MAX_THREADS)
		per = FFN_SHARE_MAX_THREADS;
	return per ? (uint32_t)per : 1;
}

void ffn_share_get_stats(const struct ffn_share *fs, struct ffn_share_stats *out)
{
	out->jobs = __atomic_load_n(&fs->jobs, __ATOMIC_RELAXED);
	out->bytes = __atomic_load_n(&fs->bytes, __ATOMIC_RELAXED);
	out->ns = __atomic_load_n(&fs->ns, __ATOMIC_RELAXED);
	out->wait_ns = __atomic_load_n(&fs->wait_ns, __ATOMIC_RELAXED);
	out->waits = __atomic_load_n(&fs->waits, __ATOMIC_RELAXED);
}

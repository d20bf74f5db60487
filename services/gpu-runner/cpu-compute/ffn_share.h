/* ffn_share.h - the CPU's share of a split FFN (services/gpu-runner/backend.h, struct ffn_split)
 * as a job of the task pool: rows [r, ffn_dim) of gate and up and columns [r, ffn_dim) of down,
 * read in place from host memory, for the n tokens of a decode step, into a partial hidden vector
 * per token that the caller adds into the residual stream.
 *
 *   struct ffn_share *fs;
 *   rc = ffn_share_create(dim, ffn_dim, task_pool_threads(pool), &fs, err, sizeof(err));
 *   per step:
 *     struct ffn_share_job job;
 *     ffn_share_job_init(&job, &gate, &up, &down, ffn_dim - r, n, DT_BF16);
 *     a task_job of ffn_share_parts(fs) parts whose part p calls
 *       ffn_share_part(fs, &job, x, y, p, n_parts, err, errlen);   // x (n, dim) in act; y (n, dim) float
 *   ffn_share_destroy(&fs);
 *
 * What is computed, per token t: x' = x[t] as float (x is stored in `act`, the dtype the GPU's
 * products take: BF16, F16 or F32), h[i] = silu(gate_i . x') * (up_i . x') over the share's rows
 * i (cpu_swiglu, x' prepared for gate's and up's formats as cpu_compute.h says), h rounded to
 * act (as the GPU rounds its SwiGLU output before down), then y[t][o] = down_o[r..ffn) . h (x
 * prepared for down's format). y is the share's contribution only: the caller adds it. With several
 * tokens a part goes through its rows in blocks of about 256 KB of weights, every token's products
 * over a block before the next, so that the rows are read from memory once, not once a token; each
 * row's product is the same whatever the blocks (cpu_compute.h).
 *
 * The job runs in two phases (P = FFN_SHARE_PARTS_PER_THREAD times the threads given at create, so
 * that a preempted worker delays a small chunk): the SwiGLU rows in 2P chunks, then the rows of down
 * in P. Its 2P parts claim chunks (an atomic counter a phase): parts [0, P) run chunks of the first
 * phase while any is left; parts [P, 2P) do the same first, then wait (running the pool's queued
 * parts where the job names its pool, else spinning, then yielding) for the first phase's chunks
 * others still run, then claim chunks of the second. So no
 * worker spins while work of the job it holds is left (with few chunks a job, as an expert's job on
 * a slice of the pool, half of the workers did), and the wait cannot deadlock whatever order the
 * parts run in: a chunk is claimed only by a running part, which finishes it. One job at a time per
 * ffn_share (its scratch is per part); a failed chunk of the first phase still counts as finished,
 * and its error is the job's.
 */
#ifndef GPU_RUNNER_FFN_SHARE_H
#define GPU_RUNNER_FFN_SHARE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"

struct task_pool;
#ifdef __cplusplus
extern "C" {
#endif

#define FFN_SHARE_MAX_THREADS 256
#define FFN_SHARE_PARTS_PER_THREAD 4 /* parts of each phase per thread (dynamic balance) */
/* The fewest chunks of a phase that ffn_share_job.taper tapers. With fewer the taper's first chunks
 * are what the phase waits for: a Q4_K expert of Qwen3-30B-A3B's shape (2.7 MB, cut for one
 * thread: 8 chunks, then 4) ran 4 a layer on 14 workers in 0.193 ms tapered and 0.138 equal
 * (bench-cpu-gemv --experts 4 --format Q4_K, H200 host); a BF16 one (cut for 3: 24, then 12) in
 * 0.406 tapered and 0.424 equal. */
#define FFN_SHARE_TAPER_MIN_CHUNKS 12

/* One matrix of the share in host memory: its first row (gate, up: intermediate row r) or, for
 * down, row 0 at column r; rows row_bytes apart. */
struct ffn_share_mat {
	const void *data;
	uint32_t format;    /* enum dtype */
	uint64_t row_bytes;
};

struct ffn_share_job {
	struct ffn_share_mat gate, up, down;
	uint32_t rows;	       /* intermediate rows of the share: ffn_dim - r */
	uint32_t n;	       /* tokens */
	uint32_t act;	       /* enum dtype of x, and what h is rounded to (DT_F32: not rounded) */
	bool taper;	       /* chunks that get smaller toward each phase's end (the first half of a
				* phase's chunks take three quarters of its rows): with several jobs at once
				* (a layer's experts), the parts that wait for a phase's last chunks wait for
				* small ones. Only a phase of 12 chunks or more (a job cut for 3 threads
				* or more): with fewer the first chunks are what the phase waits for. The
				* caller's, after ffn_share_job_init (false there); the same bits either
				* way */
	struct task_pool *pool; /* NULL, or the pool the job's parts run on: a part of the second phase
				 * that waits for the first runs the pool's queued parts meanwhile
				 * (task_pool_help: with a layer's experts at once, the other jobs'), rather
				 * than spin. The caller's, after ffn_share_job_init (NULL there); the
				 * same bits either way */
	uint32_t claimed1, claimed2; /* chunks of each phase handed out (atomic; 2P, then P) */
	uint32_t phase1_done;  /* chunks of the first phase finished (atomic; the second waits for 2P) */
	uint32_t phase2_done;  /* parts of the second phase finished (atomic; the last one counts the job) */
	uint64_t t0_ns;	       /* when the first part started (atomic, 0 until then) */
};

/* What the jobs of an ffn_share did, all time (counted by the part that finishes a job last). */
struct ffn_share_stats {
	uint64_t jobs;	 /* jobs finished, failed ones included */
	uint64_t bytes;	 /* weight bytes they read */
	uint64_t ns;	 /* their time, from the first part's start to the last part's end, summed */
	uint64_t wait_ns; /* the second phase's parts waiting for the first's last chunks, summed over
			   * parts: time a worker held a part and did nothing */
	uint64_t waits;	 /* parts that waited */
};

struct ffn_share;

/* Scratch for products of x of dim values and shares of up to ffn_dim rows, for tokens of up to
 * max_tokens, computed by `threads` threads (1..FFN_SHARE_MAX_THREADS). Returns 0 and the object
 * in *out (the caller owns it), or -EINVAL / -ENOMEM with a message in err ("cpu share: ..."). */
int ffn_share_create(uint32_t dim, uint32_t ffn_dim, uint32_t max_tokens, uint32_t threads, struct ffn_share **out,
		     char *err, size_t errlen);
/* Frees it; NULLs *fs; safe on NULL and twice. No job may be running. */
void ffn_share_destroy(struct ffn_share **fs);
/* The parts a job has: 2 FFN_SHARE_PARTS_PER_THREAD times the threads given at create. */
uint32_t ffn_share_parts(const struct ffn_share *fs);

#define FFN_SHARE_CHUNK_BYTES (256u << 10) /* about what a chunk of a small job reads (threads_for) */
/* The threads to create a share with for jobs that read `bytes` of weights on a pool of
 * pool_threads workers, when several such jobs run at once (a layer's experts): a job runs 3 P
 * chunks (P = FFN_SHARE_PARTS_PER_THREAD a thread) and any worker takes any part, so this sets the
 * chunks' size, not the workers: about FFN_SHARE_CHUNK_BYTES, 1..pool_threads (and
 * FFN_SHARE_MAX_THREADS). Coarser chunks leave a job's last ones on a few workers while the others
 * have nothing left; finer ones pay each part's start (x prepared for it) more often. */
uint32_t ffn_share_threads_for(uint64_t bytes, uint32_t pool_threads);
/* The same for chunks of about chunk_bytes (FFN_SHARE_CHUNK_MIN..FFN_SHARE_CHUNK_MAX; 0:
 * FFN_SHARE_CHUNK_BYTES). */
#define FFN_SHARE_CHUNK_MIN (16u << 10)
#define FFN_SHARE_CHUNK_MAX (16u << 20)
uint32_t ffn_share_threads_for_chunk(uint64_t bytes, uint32_t pool_threads, uint64_t chunk_bytes);

/* Sets job up for a share of `rows` intermediate rows of the matrices given, n tokens, x in act. */
void ffn_share_job_init(struct ffn_share_job *job, const struct ffn_share_mat *gate, const struct ffn_share_mat *up,
			const struct ffn_share_mat *down, uint32_t rows, uint32_t n, enum dtype act);
/* Runs part `part` of n_parts (which must be ffn_share_parts(fs)) of job: x (n, dim) in job->act,
 * y (n, dim) float32 written by the second phase. Returns 0, or -EINVAL with a message in err
 * for a job that does not fit fs (tokens, rows, act) or a product the CPU kernels refuse, -ENOMEM
 * when a prepared vector cannot grow. */
int ffn_share_part(struct ffn_share *fs, struct ffn_share_job *job, const void *x, float *y, uint32_t part,
		   uint32_t n_parts, char *err, size_t errlen);
/* The weight bytes a job reads, in the order its chunks read them: the first phase's rows i = 0, 1,
 * ... (gate's row i, then up's), then down's rows o = 0 .. dim - 1 (each the share's columns). */
uint64_t ffn_share_job_bytes(const struct ffn_share *fs, const struct ffn_share_job *job);
/* Brings bytes [offset, offset + bytes) of that order into the caches (a load of every 64-byte line;
 * nothing is written), so that the chunks that read them first find them there: for a worker
 * waiting for the job's input while its weights are known (cpu_handoff.h, prefetch). Returns the
 * bytes it touched: fewer at the job's end, 0 past it. Any thread, any number at once. */
uint64_t ffn_share_prefetch(const struct ffn_share *fs, const struct ffn_share_job *job, uint64_t offset,
			    uint64_t bytes);
/* A snapshot of the counters (any thread). */
void ffn_share_get_stats(const struct ffn_share *fs, struct ffn_share_stats *out);

#ifdef __cplusplus
}
#endif
#endif

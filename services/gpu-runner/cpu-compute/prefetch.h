/* prefetch.h - weights read into the CPU's caches ahead of their product: a job of the task pool
 * (task_pool_submit_idle) whose parts each load one line in 64 bytes of their chunk of a few byte
 * ranges, so that the product that follows (a layer's experts on the CPU, whose input is not known
 * yet) reads them from the caches instead of DRAM.
 *
 *   struct cpu_prefetch pf;
 *   cpu_prefetch_init(&pf, 64 << 10, &layer_stamp, stamp_now + 1);
 *   cpu_prefetch_add(&pf, gate, gate_bytes); ...            // in the order the product reads them
 *   task_job_init(&job, cpu_prefetch_part, &pf, cpu_prefetch_parts(&pf), &done, ++seq);
 *   task_pool_submit_idle(pool, &job);
 *   ... the product starts: __atomic_store_n(&layer_stamp, stamp_now + 1, __ATOMIC_RELEASE) ...
 *
 * Parts that run once *stamp has reached `until` (a cyclic compare, as task_word_wait's) read
 * nothing: their bytes' product has begun, and reading them then would only take DRAM from it. The
 * ranges must stay mapped until the job's done word is stored (the reads are of memory the caller
 * owns; their values are never used).
 */
#ifndef GPU_RUNNER_CPU_PREFETCH_H
#define GPU_RUNNER_CPU_PREFETCH_H
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

#define CPU_PREFETCH_RANGES 48 /* a layer's experts chosen at most (16) x their three matrices */
#define CPU_PREFETCH_LINE 64u

struct cpu_prefetch {
	const uint8_t *base[CPU_PREFETCH_RANGES];
	uint64_t len[CPU_PREFETCH_RANGES];
	uint64_t start[CPU_PREFETCH_RANGES]; /* range i's first byte in the concatenation */
	uint32_t n;			    /* ranges added */
	uint64_t total;			    /* bytes of every range */
	uint64_t chunk;			    /* a part's bytes (a multiple of CPU_PREFETCH_LINE) */
	const uint32_t *stamp;		    /* NULL, or the word that says the product has begun */
	uint32_t until;
	/* The parts' (atomic adds): bytes read, parts that found the product begun. */
	uint64_t read_bytes;
	uint32_t stale_parts;
	uint32_t sink; /* what the loads folded to: stored so that they are made */
};

/* An empty set of ranges read in parts of `chunk` bytes (rounded up to a line; 0: 64 KiB); parts
 * read nothing once (int32_t)(*stamp - until) >= 0 (stamp NULL: always read). */
void cpu_prefetch_init(struct cpu_prefetch *pf, uint64_t chunk, const uint32_t *stamp, uint32_t until);
/* Appends [p, p + len). Returns 0, or -ENOSPC with CPU_PREFETCH_RANGES already added (nothing
 * changed). len 0 adds nothing. */
int cpu_prefetch_add(struct cpu_prefetch *pf, const void *p, uint64_t len);
/* The parts a job over the ranges takes: the total in chunks, at least 1 where there are bytes. */
uint32_t cpu_prefetch_parts(const struct cpu_prefetch *pf);
/* The task function (task_pool.h): part `part` of `n_parts` reads its chunk of the ranges, in the
 * order they were added. Always returns 0. */
int cpu_prefetch_part(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif

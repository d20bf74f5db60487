/* pool.h - a fixed set of CPU worker threads that run one parallel job at a time.
 *
 *   struct cpu_pool *pool;
 *   rc = cpu_pool_create(16, &pool, err, sizeof(err));
 *   cpu_pool_run(pool, rows_fn, &job, n_rows);   // fn(&job, tid, begin, end) on every thread
 *   cpu_pool_destroy(&pool);
 *
 * A job's items [0, total) are split into contiguous ranges, one per thread, by a fixed rule
 * (cpu_pool_range), so the same item always goes to the same thread for a given thread count; the
 * caller is thread 0 and cpu_pool_run returns when every range is done. Each thread owns its
 * tid's scratch space in the job (the C backend's widened rows), so nothing is shared but the
 * outputs, which the ranges split. One thread drives a pool; jobs do not nest.
 */
#ifndef GPU_RUNNER_CPU_POOL_H
#define GPU_RUNNER_CPU_POOL_H
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

#define CPU_POOL_MAX_THREADS 1024

struct cpu_pool;

/* Runs items [begin, end) of a job on thread tid (0 is the caller). */
typedef void (*cpu_pool_fn)(const void *job, uint32_t tid, uint32_t begin, uint32_t end);

/* Starts threads - 1 workers (0 or 1: none; the caller runs every job). Returns 0, or -EINVAL
 * for more than CPU_POOL_MAX_THREADS, -errno of pthread_create / allocation with a message in
 * err ("cannot start N threads: ..."). */
int cpu_pool_create(uint32_t threads, struct cpu_pool **out, char *err, size_t errlen);
/* Joins the workers; NULLs *pool; safe on NULL and twice. */
void cpu_pool_destroy(struct cpu_pool **pool);
/* Threads that run a job, the caller included (>= 1). */
uint32_t cpu_pool_threads(const struct cpu_pool *pool);
/* The range [*begin, *end) of items [0, total) that thread tid of `threads` runs. */
void cpu_pool_range(uint32_t total, uint32_t threads, uint32_t tid, uint32_t *begin, uint32_t *end);
/* Runs fn over [0, total) split in contiguous ranges, one per thread; returns when all are done. */
void cpu_pool_run(struct cpu_pool *pool, cpu_pool_fn fn, const void *job, uint32_t total);

#ifdef __cplusplus
}
#endif
#endif

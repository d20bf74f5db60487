/* pool.c - the CPU worker pool (pool.h): workers sleep on a condition variable between jobs;
 * a job is published under the mutex with a new generation number, and the caller waits
 * until the count of workers still running it drops to zero. */
#include "services/gpu-runner/cpu/pool.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct cpu_pool {
	uint32_t threads;     /* the caller and threads - 1 workers */
	uint32_t n_workers;   /* workers started (joined at destroy) */
	pthread_t *workers;
	pthread_mutex_t mu;
	pthread_cond_t wake;  /* a new job (generation changed) or stop */
	pthread_cond_t done;  /* pending reached 0 */
	bool sync_init;
	uint64_t generation;
	uint32_t pending;     /* workers still running the current job */
	bool stop;
	cpu_pool_fn fn;
	const void *job;
	uint32_t total;
};

struct worker_arg {
	struct cpu_pool *pool;
	uint32_t tid;
};

void cpu_pool_range(uint32_t total, uint32_t threads, uint32_t tid, uint32_t *begin, uint32_t *end)
{
	*begin = (uint32_t)((uint64_t)total * tid / threads);
	*end = (uint32_t)((uint64_t)total * (tid + 1) / threads);
}

static void *worker_main(void *arg)
{
	struct worker_arg wa = *(struct worker_arg *)arg;
	free(arg);
	struct cpu_pool *p = wa.pool;
	uint64_t seen = 0;
	pthread_mutex_lock(&p->mu);
	for (;;) {
		while (!p->stop && p->generation == seen)
			pthread_cond_wait(&p->wake, &p->mu);
		if (p->stop)
			break;
		seen = p->generation;
		cpu_pool_fn fn = p->fn;
		const void *job = p->job;
		uint32_t begin, end;
		cpu_pool_range(p->total, p->threads, wa.tid, &begin, &end);
		pthread_mutex_unlock(&p->mu);
		if (begin < end)
			fn(job, wa.tid, begin, end);
		pthread_mutex_lock(&p->mu);
		if (--p->pending == 0)
			pthread_cond_signal(&p->done);
	}
	pthread_mutex_unlock(&p->mu);
	return NULL;
}

void cpu_pool_run(struct cpu_pool *p, cpu_pool_fn fn, const void *job, uint32_t total)
{
	if (p->threads == 1 || total < 2) {
		fn(job, 0, 0, total);
		return;
	}
	pthread_mutex_lock(&p->mu);
	p->fn = fn;
	p->job = job;
	p->total = total;
	p->pending = p->threads - 1;
	p->generation++;
	pthread_cond_broadcast(&p->wake);
	pthread_mutex_unlock(&p->mu);

	uint32_t begin, end;
	cpu_pool_range(total, p->threads, 0, &begin, &end);
	if (begin < end)
		fn(job, 0, begin, end);

	pthread_mutex_lock(&p->mu);
	while (p->pending)
		pthread_cond_wait(&p->done, &p->mu);
	pthread_mutex_unlock(&p->mu);
}

uint32_t cpu_pool_threads(const struct cpu_pool *p)
{
	return p->threads;
}

void cpu_pool_destroy(struct cpu_pool **pp)
{
	struct cpu_pool *p = pp ? *pp : NULL;
	if (!p)
		return;
	if (p->sync_init) {
		pthread_mutex_lock(&p->mu);
		p->stop = true;
		pthread_cond_broadcast(&p->wake);
		pthread_mutex_unlock(&p->mu);
		for (uint32_t i = 0; i < p->n_workers; i++)
			pthread_join(p->workers[i], NULL);
		pthread_cond_destroy(&p->done);
		pthread_cond_destroy(&p->wake);
		pthread_mutex_destroy(&p->mu);
	}
	free(p->workers);
	free(p);
	*pp = NULL;
}

int cpu_pool_create(uint32_t threads, struct cpu_pool **out, char *err, size_t errlen)
{
	*out = NULL;
	if (threads > CPU_POOL_MAX_THREADS) {
		snprintf(err, errlen, "%u threads requested, at most %u", threads, CPU_POOL_MAX_THREADS);
		return -EINVAL;
	}
	struct cpu_pool *p = calloc(1, sizeof(*p));
	if (!p) {
		snprintf(err, errlen, "cannot start %u threads: %s", threads, strerror(ENOMEM));
		return -ENOMEM;
	}
	p->threads = threads ? threads : 1;
	int rc = pthread_mutex_init(&p->mu, NULL);
	if (rc)
		goto out_msg;
	rc = pthread_cond_init(&p->wake, NULL);
	if (rc)
		goto out_mutex;
	rc = pthread_cond_init(&p->done, NULL);
	if (rc)
		goto out_wake;
	p->sync_init = true;
	if (p->threads > 1 && !(p->workers = calloc(p->threads - 1, sizeof(*p->workers)))) {
		rc = ENOMEM;
		goto out_msg;
	}
	for (uint32_t t = 1; t < p->threads; t++) {
		struct worker_arg *wa = malloc(sizeof(*wa));
		if (!wa) {
			rc = ENOMEM;
			goto out_msg;
		}
		wa->pool = p;
		wa->tid = t;
		rc = pthread_create(&p->workers[t - 1], NULL, worker_main, wa);
		if (rc) {
			free(wa);
			goto out_msg;
		}
		p->n_workers++;
	}
	*out = p;
	return 0;

	/* cpu_pool_destroy joins the workers already started. */
out_wake:
	pthread_cond_destroy(&p->wake);
out_mutex:
	pthread_mutex_destroy(&p->mu);
out_msg:
	snprintf(err, errlen, "cannot start %u threads: %s", p->threads, strerror(rc));
	cpu_pool_destroy(&p);
	return -rc;
}

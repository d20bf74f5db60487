/* ffn_split.cu - the CUDA backend's split FFN (backend.h, struct ffn_split): the first share on
 * the GPU, the second on the GPU too (FFN_SPLIT_BACKEND: prefill, from a device copy of its rows)
 * or on the CPU task pool (FFN_SPLIT_CPU: decode, from the weight ring in place), handed over
 * with cuda/cpu_handoff.h; and the kernel that adds the CPU's partial result.
 *
 * A step with a CPU share, all queued on the compute stream, the host waiting for nothing:
 *   RMSNorm of the residual stream into xa (the activation dtype: BF16 for BF16 and block formats),
 *   handoff submit: xa's n rows copied down, the job started (cpu-compute/ffn_share.h: x widened
 *     from that dtype, SwiGLU over rows [r, ffn), h rounded to it, down's columns [r, ffn)),
 *   the first share: SwiGLU over rows [0, r) into xb, down's columns [0, r) added into x,
 *   handoff wait: the stream waits for the job, then its (n, dim) floats come up into partial,
 *   x += partial.
 * The CPU and the GPU compute at once; the stream waits only for whichever is later. The RMSNorm
 * runs as a kernel of its own (the one-token integer path's fused norm would leave no x to copy
 * down). A failed job completes all the same (the stream never hangs on it); its message comes
 * out of finish_step at the step's end (ffn_split_check).
 *
 * The jobs of the handoffs live in a ring of SPLIT_JOBS, twice the handoff's ring: when job k is
 * written the handoff has seen job k - SPLIT_JOBS complete (its submit of k - ring waited for it),
 * so a job is never rewritten while the pool reads it. One ffn_share holds the scratch of every
 * job: the stream runs them one after another (job k + 1 starts after the wait for job k). */
#include "services/gpu-runner/cuda/cuda_internal.h"

#include "common/log.h"
#include "services/gpu-runner/cpu-compute/ffn_share.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/cuda/cpu_handoff.h"
#include <assert.h>
#include <sched.h>

#define HANDOFF_RING 64u
#define SPLIT_JOBS (2 * HANDOFF_RING)
#define HANDOFF_SPIN_US 50u
#define SPLIT_TIMED 32u /* split FFNs timed on the stream and not yet harvested, at most */

/* A timed split FFN: events before x's copy down, after the GPU's share, after the partial's add;
 * its handoff's seq, whose job time the harvest subtracts. */
struct split_timing {
	cudaEvent_t ev[3];
	uint64_t seq;
};

static const double hist_us[BACKEND_HANDOFF_BUCKETS - 1] = {50, 100, 200, 500, 1000};

struct split_job {
	struct backend_dev *be;
	struct ffn_share_job job;
	bool fail; /* cuda_test_fail_cpu_share: the first part fails */
};

/* The read-ahead argument of a split FFN's job: the share and a copy of the job (its matrices name
 * the weight ring, which stays mapped). */
struct split_prefetch_arg {
	const struct ffn_share *share;
	struct ffn_share_job job;
};

static uint64_t split_prefetch(const void *arg, uint64_t offset, uint64_t bytes)
{
	const struct split_prefetch_arg *a = (const struct split_prefetch_arg *)arg;
	return ffn_share_prefetch(a->share, &a->job, offset, bytes);
}

/* A part of a handoff's job: the share reads the copied x and writes the pinned output. */
static int split_part(const struct cpu_handoff_task *t, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	struct split_job *sj = (struct split_job *)t->user;
	int rc = ffn_share_part(sj->be->share, &sj->job, t->in, (float *)t->out, part, n_parts, err, errlen);
	if (sj->fail && part == 0 && rc == 0) {
		/* The part's work done (the others' chunks wait for nothing), then a failure reported. */
		snprintf(err, errlen, "an injected failure (cuda_test_fail_cpu_share)");
		return -EIO;
	}
	return rc;
}

/* A CPU for the memops dispatcher (which spins while a handoff is in flight): the second CPU this
 * thread may use that no worker of the pool is pinned to (the first is left to the runner's own
 * thread, which drives the stream), or -1 (unpinned). */
static int dispatcher_cpu(const struct task_pool *pool)
{
	cpu_set_t set;
	if (sched_getaffinity(0, sizeof(set), &set) != 0)
		return -1;
	int seen = 0;
	for (int c = 0; c < CPU_SETSIZE; c++) {
		if (!CPU_ISSET(c, &set))
			continue;
		bool taken = false;
		for (uint32_t i = 0; i < task_pool_threads(pool) && !taken; i++)
			taken = task_pool_worker_cpu(pool, i) == c;
		if (!taken && seen++ == 1)
			return c;
	}
	return -1;
}

int ffn_split_setup(struct backend_dev *be)
{
	const struct backend_params *p = &be->p;
	if (!p->cpu_pool)
		return 0;
	char msg[CPU_HANDOFF_ERR_MAX];
	uint32_t threads = task_pool_threads(p->cpu_pool);
	if (threads > FFN_SHARE_MAX_THREADS)
		threads = FFN_SHARE_MAX_THREADS;
	int rc = ffn_share_create(be->cfg.dim, be->cfg.ffn_dim, FFN_SPLIT_MAX_TOKENS, threads, &be->share, msg,
				  sizeof(msg));
	if (rc)
		return cuda_failf(be, rc, "cuda backend: %s", msg);
	be->split_jobs = (struct split_job *)calloc(SPLIT_JOBS, sizeof(struct split_job));
	if (!be->split_jobs)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for the CPU share's jobs");
	size_t bytes = (size_t)FFN_SPLIT_MAX_TOKENS * be->cfg.dim * sizeof(float);
	cudaError_t e = cudaMalloc((void **)&be->partial, bytes);
	if (e != cudaSuccess) {
		be->partial = NULL;
		return cuda_fail(be, e, "cudaMalloc (the CPU share's result)");
	}
	struct cpu_handoff_params hp;
	memset(&hp, 0, sizeof(hp));
	hp.max_in_bytes = bytes; /* x in float32 at most */
	hp.max_out_bytes = bytes;
	hp.ring = HANDOFF_RING;
	hp.spin_us = HANDOFF_SPIN_US;
	hp.dispatcher_cpu = dispatcher_cpu(p->cpu_pool);
	hp.mode = p->cpu_handoff == BACKEND_HANDOFF_HOSTFUNC ? CPU_HANDOFF_HOSTFUNC : CPU_HANDOFF_MEMOPS;
	hp.mapped_out = p->cpu_result_mapped;
	hp.poll_out = p->cpu_result_mapped && p->cpu_result_polled;
	hp.workers_dispatch = p->cpu_dispatch_workers;
	hp.prefetch_bytes = p->cpu_prefetch; /* read ahead only where the workers dispatch (memops) */
	rc = cpu_handoff_create(p->cpu_pool, be->stream, &hp, &be->handoff, msg, sizeof(msg));
	if (rc == -ENOTSUP && p->cpu_handoff == BACKEND_HANDOFF_DEFAULT) {
		log_info("cuda backend: the CPU share is handed over by host functions: %s", msg);
		hp.mode = CPU_HANDOFF_HOSTFUNC;
		if (p->cpu_dispatch_poll || p->cpu_dispatch_workers)
			log_info("cuda backend: --cpu-dispatch changes nothing with host functions: the stream's "
				 "callback hands the pool each job");
		if (p->cpu_prefetch)
			log_info("cuda backend: --cpu-prefetch reads nothing ahead with host functions (the "
				 "stream memory operations are not available here)");
		rc = cpu_handoff_create(p->cpu_pool, be->stream, &hp, &be->handoff, msg, sizeof(msg));
	}
	if (rc)
		return cuda_failf(be, rc, "cuda backend: %s", msg);
	be->split_tm = (struct split_timing *)calloc(SPLIT_TIMED, sizeof(struct split_timing));
	if (!be->split_tm)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for the CPU share's timing");
	for (uint32_t k = 0; k < SPLIT_TIMED; k++)
		for (int i = 0; i < 3; i++)
			CUDA_TRY(be, "cudaEventCreate (timing the CPU share)", cudaEventCreate(&be->split_tm[k].ev[i]));
	return 0;
}

void ffn_split_teardown(struct backend_dev *be)
{
	cpu_handoff_destroy(&be->handoff); /* waits for the jobs it handed over, before their scratch goes */
	for (uint32_t k = 0; be->split_tm && k < SPLIT_TIMED; k++)
		for (int i = 0; i < 3; i++)
			if (be->split_tm[k].ev[i])
				cudaEventDestroy(be->split_tm[k].ev[i]);
	free(be->split_tm);
	be->split_tm = NULL;
	ffn_share_destroy(&be->share);
	free(be->split_jobs);
	be->split_jobs = NULL;
	cudaFree(be->partial);
	be->partial = NULL;
}

int ffn_split_check(struct backend_dev *be)
{
	if (!be->handoff)
		return 0;
	char msg[CPU_HANDOFF_ERR_MAX];
	int rc = cpu_handoff_check(be->handoff, msg, sizeof(msg));
	return rc ? cuda_failf(be, rc, "cuda backend: ffn: the CPU share failed: %s", msg) : 0;
}

#define POLLS_A_QUERY 64u /* looks at the handoff's trigger between two looks at the stream */

cudaError_t ffn_split_stream_wait(struct backend_dev *be)
{
	cudaError_t e;
	if (!be->handoff || !be->p.cpu_dispatch_poll || cpu_handoff_mode(be->handoff) != CPU_HANDOFF_MEMOPS) {
		e = cudaStreamSynchronize(be->stream);
	} else {
		while ((e = cudaStreamQuery(be->stream)) == cudaErrorNotReady) {
			for (uint32_t i = 0; i < POLLS_A_QUERY; i++) {
				(void)cpu_handoff_poll(be->handoff);
#if defined(__x86_64__) || defined(__i386__)
				__builtin_ia32_pause();
#endif
			}
		}
	}
	/* No read-ahead outlives the step: the ring's weights may be unmapped between steps. */
	cpu_handoff_quiesce_prefetch(be->handoff, e != cudaSuccess);
	return e;
}

void ffn_split_settle(struct backend_dev *be)
{
	if (!be->handoff)
		return;
	char msg[CPU_HANDOFF_ERR_MAX];
	if (cpu_handoff_settle(be->handoff, msg, sizeof(msg)) != 0)
		log_warn("cuda backend: ffn: a failed step's CPU share had failed too: %s", msg);
}

/* The timed split FFNs' events that the stream has passed, oldest first. Never waits. */
static void harvest(struct backend_dev *be)
{
	while (be->split_tm_tail != be->split_tm_head) {
		struct split_timing *t = &be->split_tm[be->split_tm_tail % SPLIT_TIMED];
		if (cudaEventQuery(t->ev[2]) != cudaSuccess)
			return; /* not yet (or failed: the step's own error says so) */
		float all = 0, wait = 0;
		uint64_t job_ns = 0;
		if (cudaEventElapsedTime(&all, t->ev[0], t->ev[2]) == cudaSuccess &&
		    cudaEventElapsedTime(&wait, t->ev[1], t->ev[2]) == cudaSuccess) {
			be->split_stream_ms += all;
			be->split_wait_ms += wait;
			be->split_timed++;
			if (cpu_handoff_job_ns(be->handoff, t->seq, &job_ns) == 0) {
				const double us = all * 1e3 - (double)job_ns * 1e-3;
				uint32_t b = 0;
				while (b < BACKEND_HANDOFF_BUCKETS - 1 && us >= hist_us[b])
					b++;
				be->split_hist[b]++;
			}
		}
		be->split_tm_tail++;
	}
}

void ffn_split_stats(struct backend_dev *be, struct backend_cpu_share_stats *out)
{
	moe_stats(be, out);
	if (!be->handoff)
		return;
	harvest(be);
	struct ffn_share_stats ss;
	ffn_share_get_stats(be->share, &ss);
	struct cpu_handoff_stats hs;
	cpu_handoff_get_stats(be->handoff, &hs);
	snprintf(out->handoff, sizeof(out->handoff), "%s", cpu_handoff_mode_name(hs.mode));
	out->jobs = ss.jobs;
	out->failed = hs.failed;
	out->bytes = ss.bytes;
	out->cpu_ms = (double)ss.ns / 1e6;
	out->phase_wait_ms = (double)ss.wait_ns / 1e6;
	out->timed = be->split_timed;
	out->stream_ms = be->split_stream_ms;
	out->wait_ms = be->split_wait_ms;
	memcpy(out->handoff_hist, be->split_hist, sizeof(out->handoff_hist));
	out->dispatched = hs.timed;
	out->dispatch_ms = (double)hs.dispatch_ns / 1e6;
	out->dispatch_max_ms = (double)hs.dispatch_max_ns / 1e6;
	out->gap_ms = (double)hs.gap_ns / 1e6;
	out->gaps = hs.gaps;
	out->host_late = hs.host_late;
	out->dispatch_stalls = hs.stalls;
	out->dispatch_stall_ms = (double)hs.stall_ns / 1e6;
	out->dispatched_by_poll = hs.by_poll;
	out->dispatched_by_workers = hs.by_workers;
	out->prefetched = hs.prefetched;
}

/* A matrix of a share in device memory as a part of a product into out. */
static struct mm_part mat(const struct weight_tensor *t, uint32_t rows, float *out)
{
	struct mm_part p = {t->data[PLACE_DEVICE], rows, out, t->format, t->row_bytes};
	return p;
}

/* cuBLAS and the GEMV of the element formats read rows `in` elements apart: such a share's
 * matrices must be compact on the device (the GPU window copies them so). */
static int check_compact(struct backend_dev *be, const struct weight_tensor *t, enum tensor_role role,
			 const char *which)
{
	if (!dtype_is_element((enum dtype)t->format) || t->row_bytes == dtype_row_bytes((enum dtype)t->format, t->cols))
		return 0;
	return cuda_failf(be, -ENOTSUP, "cuda backend: ffn: the %s share's %s rows are %llu bytes apart, not %llu: "
			  "device shares of %s matrices must be compact", which, tensor_role_name(role),
			  (unsigned long long)t->row_bytes,
			  (unsigned long long)dtype_row_bytes((enum dtype)t->format, t->cols),
			  dtype_name((enum dtype)t->format));
}

/* SwiGLU over `rows` intermediate rows of gate and up (device memory), then down's matching
 * columns added into x. */
static int device_share(struct backend_dev *be, uint32_t at, const struct weight_tensor *gate,
			const struct weight_tensor *up, const struct weight_tensor *down, uint32_t rows,
			const char *what)
{
	struct mm_part gu[2] = {mat(gate, rows, be->gu), mat(up, rows, be->gu + rows)};
	int rc = swiglu_product(be, at, gu, be->xa, NULL, be->cfg.dim, be->n, be->xb, what);
	if (rc)
		return rc;
	struct mm_part d = mat(down, be->cfg.dim, be->x);
	return matmul(be, at, be->xb, NULL, rows, be->n, &d, 1, be->cfg.dim, true, what);
}

static struct ffn_share_mat host_mat(const struct weight_tensor *t)
{
	struct ffn_share_mat m = {t->data[PLACE_HOST], t->format, t->row_bytes};
	return m;
}

int ffn_split_compute(struct backend_dev *be, const struct group_weights *w)
{
	const struct ffn_split *s = &w->split;
	const struct model_config *c = &be->cfg;
	const uint32_t n = be->n, r = s->r, rest = c->ffn_dim - r;
	const uint32_t at = act_dtype(s->gate.format);
	if (act_dtype(s->up.format) != at || act_dtype(s->down.format) != at)
		return cuda_failf(be, -ENOTSUP, "cuda backend: ffn: gate %s, up %s and down %s do not take one "
				  "activation dtype", dtype_name((enum dtype)s->gate.format),
				  dtype_name((enum dtype)s->up.format), dtype_name((enum dtype)s->down.format));
	if (s->where == FFN_SPLIT_CPU && !be->handoff)
		return cuda_failf(be, -ENOTSUP, "cuda backend: ffn: a CPU share, but the backend has no handoff to the "
				  "CPU pool");
	/* Everything that can be refused is, before anything is queued. */
	int rc = 0;
	const struct weight_tensor *first[3] = {&w->t[ROLE_W_GATE], &w->t[ROLE_W_UP], &w->t[ROLE_W_DOWN]};
	const struct weight_tensor *second[3] = {&s->gate, &s->up, &s->down};
	static const enum tensor_role roles[3] = {ROLE_W_GATE, ROLE_W_UP, ROLE_W_DOWN};
	for (int i = 0; i < 3 && !rc; i++) {
		if (r)
			rc = check_compact(be, first[i], roles[i], "first");
		if (!rc && s->where == FFN_SPLIT_BACKEND)
			rc = check_compact(be, second[i], roles[i], "second");
	}
	if (rc)
		return rc;
	const struct weight_tensor *norm = &w->t[ROLE_FFN_NORM];
	rc = rmsnorm(be, norm->data[PLACE_DEVICE], norm->format, 0, n, at);
	if (rc)
		return rc;
	uint64_t seq = 0;
	char msg[CPU_HANDOFF_ERR_MAX];
	struct split_timing *tm = NULL;
	if (s->where == FFN_SPLIT_CPU) {
		harvest(be);
		if (be->split_tm_head - be->split_tm_tail < SPLIT_TIMED) {
			tm = &be->split_tm[be->split_tm_head % SPLIT_TIMED];
			CUDA_TRY(be, "cudaEventRecord (timing the CPU share)", cudaEventRecord(tm->ev[0], be->stream));
		}
		struct split_job *sj = &be->split_jobs[be->split_n % SPLIT_JOBS];
		struct ffn_share_mat g = host_mat(&s->gate), u = host_mat(&s->up), d = host_mat(&s->down);
		sj->be = be;
		sj->fail = be->split_n + 1 == be->split_fail_at;
		ffn_share_job_init(&sj->job, &g, &u, &d, rest, n, (enum dtype)at);
		struct cpu_handoff_job hj;
		memset(&hj, 0, sizeof(hj));
		hj.fn = split_part;
		hj.user = sj;
		if (be->p.cpu_prefetch) {
			static_assert(sizeof(struct split_prefetch_arg) <= CPU_HANDOFF_PREFETCH_ARG,
				      "a split FFN's read-ahead argument does not fit the handoff's");
			struct split_prefetch_arg pa = {be->share, sj->job};
			hj.prefetch = split_prefetch;
			memcpy(hj.prefetch_arg, &pa, sizeof(pa));
		}
		hj.n_parts = ffn_share_parts(be->share);
		hj.in_bytes = (size_t)n * c->dim * dtype_size((enum dtype)at);
		hj.out_bytes = (size_t)n * c->dim * sizeof(float);
#ifndef NDEBUG
		/* One job at a time: every job shares be->share's scratch (see the top of this file). */
		struct cpu_handoff_stats hs;
		cpu_handoff_get_stats(be->handoff, &hs);
		assert(hs.submitted == hs.waited);
#endif
		rc = cpu_handoff_submit(be->handoff, be->xa, &hj, &seq, msg, sizeof(msg));
		if (rc)
			return cuda_failf(be, rc, "cuda backend: ffn: %s", msg);
		be->split_n++;
		if (tm)
			tm->seq = seq;
	}
	if (r && (rc = device_share(be, at, first[0], first[1], first[2], r, "ffn (first share)"))) {
		/* The handoff's waits come in order: this one is queued all the same, so the next layer's
		 * submit and wait still pair up; the step fails with the first error. */
		if (s->where == FFN_SPLIT_CPU)
			(void)cpu_handoff_wait(be->handoff, seq, be->partial, msg, sizeof(msg));
		return rc;
	}
	if (s->where == FFN_SPLIT_BACKEND)
		return device_share(be, at, second[0], second[1], second[2], rest, "ffn (second share)");
	/* The wait is queued even when the event fails, so that submits and waits stay paired. */
	const cudaError_t ev = tm ? cudaEventRecord(tm->ev[1], be->stream) : cudaSuccess;
	rc = cpu_handoff_wait(be->handoff, seq, be->partial, msg, sizeof(msg));
	if (ev != cudaSuccess)
		return cuda_fail(be, ev, "cudaEventRecord (timing the CPU share)");
	if (rc)
		return cuda_failf(be, rc, "cuda backend: ffn: %s", msg);
	size_t count = (size_t)n * c->dim;
	add_launch(be->x, be->partial, count, be->stream);
	LAUNCHED(be, "add_kernel (CPU share)");
	if (tm) {
		CUDA_TRY(be, "cudaEventRecord (timing the CPU share)", cudaEventRecord(tm->ev[2], be->stream));
		be->split_tm_head++;
	}
	return 0;
}

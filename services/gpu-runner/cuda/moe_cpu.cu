/* moe_cpu.cu - the CUDA backend's routed experts computed by the CPU pool (moe.cu has the route,
 * the GPU's experts and the end of a layer; moe_internal.h the state they share):
 *
 *  - expert e on the CPU (moe_expert_cpu: the weight window left it in host memory, a decode step
 *    with backend_params.cpu_pool): submitted to the pool at once, over its tokens' xn rows (in host
 *    memory with the logits), as an ffn_share job of the whole expert, up to MOE_CPU_JOBS_MAX experts
 *    at once on slices of the pool's threads, so the CPU computes while the engine goes on with the
 *    GPU's experts; at moe_end the jobs are collected in expert order (the weighted rows summed on
 *    the host), and the sum goes up and into the residual stream beside the GPU's.
 *  - one token, the CPU's experts waited for on the GPU (gpu_waits: backend_params.cpu_result_mapped,
 *    the stream memory operations there, k <= the jobs at once): the host does not wait at moe_end.
 *    The stream waits for each job's completion word (mapped pinned memory: cuStreamWaitValue32),
 *    and combine_kernel reads the jobs' output rows from mapped host memory and sums them first,
 *    in the order they were noted (s = 0, s += y_i * w_i, x += s: the host's collection and add),
 *    then the GPU's rows as before. The host goes on to the next layer while the CPU computes; the
 *    jobs' results are checked after the host's next wait for the stream (the next route, or the
 *    step's end: moe_check).
 *
 * Times (backend_cpu_share_stats): a layer's CPU experts from the first submission to the last
 * one's end (spans, with their bytes), their jobs' parts idle between a job's phases, and the gaps
 * from a layer's last CPU expert to the next layer's first: to the return of the next routing's
 * wait, then on the host.
 */
#include "services/gpu-runner/cuda/moe_internal.h"
#include "services/gpu-runner/cuda/cpu_handoff.h"
#include "common/log.h"
#include "common/util.h"

#include <stdlib.h>
#include <string.h>

/* The jobs' completion words, and with gpu_waits their outputs, in pinned memory: mapped where one
 * token's CPU experts are waited for on the GPU (backend_params.cpu_result_mapped and not host
 * functions, k at most the jobs at once, the driver's stream memory operations there; else the
 * host waits at moe_end, as with --cpu-result copy). A stream that cannot wait on a word already
 * reached is refused here, not found out by a hung step. */
static int gpu_waits_setup(struct backend_dev *be, size_t rows)
{
	struct cuda_moe *m = be->moe;
	bool want = be->p.cpu_result_mapped && be->p.cpu_handoff != BACKEND_HANDOFF_HOSTFUNC && m->k <= m->n_jobs;
	char why[256] = "";
	if (want) {
		int device = 0;
		void *fn = NULL;
		if (cudaGetDevice(&device) != cudaSuccess || cpu_handoff_wait_entry(device, &fn, why, sizeof(why)) != 0)
			want = false;
		m->wait32 = (PFN_cuStreamWaitValue32_v11070)fn;
	}
	const unsigned flags = want ? cudaHostAllocMapped | cudaHostAllocPortable : cudaHostAllocDefault;
	CUDA_TRY(be, "cudaHostAlloc (the CPU experts' completion words)",
		 cudaHostAlloc((void **)&m->words, m->n_jobs * sizeof(struct moe_word), flags));
	memset(m->words, 0, m->n_jobs * sizeof(struct moe_word));
	if (want) {
		CUDA_TRY(be, "cudaHostAlloc (the CPU experts' rows)",
			 cudaHostAlloc((void **)&m->ybuf, m->n_jobs * rows * sizeof(float),
				       cudaHostAllocMapped | cudaHostAllocPortable));
		/* A wait for a value the word holds already: it must pass at once. */
		void *dw = NULL;
		CUDA_TRY(be, "cudaHostGetDevicePointer (a completion word)", cudaHostGetDevicePointer(&dw, &m->words[0].done, 0));
		CUresult r = m->wait32((CUstream)be->stream, (CUdeviceptr)(uintptr_t)dw, 0, CU_STREAM_WAIT_VALUE_EQ);
		cudaError_t e = r == CUDA_SUCCESS ? cudaStreamSynchronize(be->stream) : cudaSuccess;
		if (r != CUDA_SUCCESS || e != cudaSuccess) {
			snprintf(why, sizeof(why), "cuStreamWaitValue32 on mapped host memory: %s",
				 r != CUDA_SUCCESS ? "refused" : cudaGetErrorString(e));
			if (e != cudaSuccess)
				return cuda_fail(be, e, "the probe of a wait on a CPU expert's word");
			cudaFreeHost(m->ybuf);
			m->ybuf = NULL;
			want = false;
		}
	}
	m->gpu_waits = want;
	if (!want && be->p.cpu_result_mapped && why[0])
		log_info("cuda backend: the CPU's experts are waited for by the host: %s", why);
	return 0;
}

int moe_cpu_setup(struct backend_dev *be)
{
	const struct model_config *c = &be->cfg;
	struct cuda_moe *m = be->moe;
	const size_t dim = c->dim;
	int rc;
	if (!be->p.cpu_pool)
		return 0;
	/* As many jobs as a token chooses experts (at most MOE_CPU_JOBS_MAX), each cut for its share of
	 * the threads: small experts split over all of them would be mostly overhead (larger ones are
	 * cut finer at their first job: ffn_share_threads_for). */
	uint32_t t = task_pool_threads(be->p.cpu_pool);
	m->n_jobs = m->k < MOE_CPU_JOBS_MAX ? m->k : MOE_CPU_JOBS_MAX;
	uint32_t per = t / m->n_jobs ? t / m->n_jobs : 1;
	if (per > FFN_SHARE_MAX_THREADS)
		per = FFN_SHARE_MAX_THREADS;
	m->pool_threads = t;
	size_t rows = (size_t)FFN_SPLIT_MAX_TOKENS * dim;
	m->jobs = (struct moe_cpu_job *)calloc(m->n_jobs, sizeof(*m->jobs));
	m->csum = (float *)malloc(rows * sizeof(float));
	m->cpu = (struct moe_cpu_expert *)calloc(m->E, sizeof(*m->cpu));
	if (!m->jobs || !m->csum || !m->cpu)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for experts on the CPU");
	if ((rc = gpu_waits_setup(be, rows)))
		return rc;
	char why[256];
	for (uint32_t j = 0; j < m->n_jobs; j++) {
		struct moe_cpu_job *cj = &m->jobs[j];
		if (ffn_share_create(c->dim, m->F, FFN_SPLIT_MAX_TOKENS, per, &cj->share, why, sizeof(why)) != 0)
			return cuda_failf(be, -ENOMEM, "cuda backend: experts on the CPU: %s", why);
		cj->per = per;
		cj->x = (float *)malloc(rows * sizeof(float));
		cj->y = m->gpu_waits ? m->ybuf + j * rows : (float *)malloc(rows * sizeof(float));
		if (!cj->x || !cj->y)
			return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for experts on the CPU");
		cj->done = &m->words[j].done;
		cj->waiters = &m->words[j].waiters;
		if (m->gpu_waits) {
			void *dy = NULL, *dw = NULL;
			CUDA_TRY(be, "cudaHostGetDevicePointer (a CPU expert's rows)", cudaHostGetDevicePointer(&dy, cj->y, 0));
			CUDA_TRY(be, "cudaHostGetDevicePointer (a CPU expert's word)",
				 cudaHostGetDevicePointer(&dw, cj->done, 0));
			cj->y_dev = (const float *)dy;
			cj->done_dev = (CUdeviceptr)(uintptr_t)dw;
		}
	}
	if ((rc = moe_host_mapped(be, rows * sizeof(float), (void **)&m->h_xn, (void **)&m->h_xn_dev, "experts' rows for the CPU")))
		return rc;
	return dev_alloc(be, (void **)&m->csum_dev, FFN_SPLIT_MAX_TOKENS, dim, sizeof(float), "the CPU experts' sum");
}

void moe_cpu_teardown(struct backend_dev *be)
{
	struct cuda_moe *m = be->moe;
	moe_settle_jobs(m); /* the stream may not have waited for them (a failed step, a sticky error) */
	/* The task pool outlives this backend: the thread that completed the last job may still read
	 * m->waiters. */
	if (m->jobs && be->p.cpu_pool)
		task_pool_quiesce(be->p.cpu_pool);
	for (uint32_t j = 0; m->jobs && j < m->n_jobs; j++) {
		ffn_share_destroy(&m->jobs[j].share);
		free(m->jobs[j].x);
		if (!m->ybuf)
			free(m->jobs[j].y);
	}
	free(m->jobs);
	cudaFreeHost(m->ybuf);
	cudaFreeHost(m->words);
	cudaFreeHost(m->h_xn);
	free(m->csum);
	free(m->cpu);
	cudaFree(m->csum_dev);
}

static struct ffn_share_mat host_mat(const struct weight_tensor *t)
{
	struct ffn_share_mat mt = {t->data[PLACE_HOST], t->format, t->row_bytes};
	return mt;
}

/* The weight bytes of a matrix as the CPU reads them (its rows packed: a host row's stride may be longer). */
static uint64_t mat_bytes(const struct weight_tensor *t)
{
	return (uint64_t)t->rows * dtype_row_bytes((enum dtype)t->format, t->cols);
}

static void job_ended(struct task_job *tj)
{
	((struct moe_cpu_job *)tj->user)->end_ns = now_ns();
}

static int cpu_part(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	struct moe_cpu_job *cj = (struct moe_cpu_job *)arg;
	int rc = ffn_share_part(cj->share, &cj->job, cj->x, cj->y, part, n_parts, err, errlen);
	if (cj->fail && part == 0 && rc == 0) {
		/* The part's work done (the others' chunks wait for nothing), then a failure reported. */
		snprintf(err, errlen, "an injected failure (cuda_test_fail_cpu_expert)");
		return -EIO;
	}
	return rc;
}

/* Waits for CPU expert i (its job in slot i % n_jobs) and adds its weighted rows into csum. Experts
 * are collected in the order they were noted: the sum's order. */
static int cpu_collect(struct backend_dev *be, uint32_t i)
{
	struct cuda_moe *m = be->moe;
	const uint32_t dim = be->cfg.dim;
	const struct moe_cpu_expert *ce = &m->cpu[i];
	struct moe_cpu_job *cj = &m->jobs[i % m->n_jobs];
	task_word_wait(cj->done, cj->waiters, cj->seq, 50, 0);
	if (cj->tj.rc)
		return cuda_failf(be, cj->tj.rc, "cuda backend: expert %u on the CPU: %s", ce->expert, cj->tj.err);
	const uint32_t o = m->off[ce->expert], cnt = m->off[ce->expert + 1] - o;
	for (uint32_t r = 0; r < cnt; r++) {
		float *dst = m->csum + (size_t)m->h_tok[o + r] * dim;
		const float *y = cj->y + (size_t)r * dim, wt = m->h_tw[o + r];
		for (uint32_t d = 0; d < dim; d++)
			dst[d] += y[d] * wt;
	}
	m->cpu_experts++;
	return 0;
}

/* Expert `expert`'s rows gate, up (intermediate rows in host memory, in place) and down's matching
 * columns (a row's stride may be longer than its columns) to the pool: a whole expert, or the CPU's
 * share of a split one. Submitted at once, so the pool computes it while the engine goes on with the
 * GPU's experts (whose copies pace it); its slot's previous job is collected first. */
static int cpu_submit(struct backend_dev *be, const struct weight_tensor *gate, const struct weight_tensor *up,
		      const struct weight_tensor *down, uint32_t expert)
{
	struct cuda_moe *m = be->moe;
	if (!moe_expert_used(be, expert))
		return 0;
	if (!m->xn_down)
		return cuda_failf(be, -ENOTSUP, "cuda backend: expert %u on the CPU: a step of %u tokens (the CPU takes "
				  "experts in steps of at most %u, with a CPU pool)", expert, be->n, FFN_SPLIT_MAX_TOKENS);
	uint64_t t0 = now_ns();
	const uint32_t i = m->n_cpu, dim = be->cfg.dim;
	if (m->gpu_wait && i >= m->n_jobs) /* k <= n_jobs: one token's chosen experts all fit */
		return cuda_failf(be, -EPROTO, "cuda backend: expert %u is the CPU's %u-th for one token, which chose %u",
				  expert, i + 1, m->k);
	if (i == 0) {
		m->layer_t0 = t0;
		m->layer_bytes = 0;
		m->layer_n = be->n;
		if (m->gap_pending_ns) {
			m->gap_gpu_ns += m->gap_pending_ns;
			m->gap_host_ns += t0 > m->route_t1 ? t0 - m->route_t1 : 0;
			m->gaps++;
			m->gap_pending_ns = 0;
		}
		if (m->step_pending_ns) {
			m->step_gap_ns += m->step_pending_ns + (t0 > m->route_t1 ? t0 - m->route_t1 : 0);
			m->step_tail_ns += m->step_tail_pending_ns;
			m->step_gaps++;
			m->step_pending_ns = m->step_tail_pending_ns = 0;
		}
	}
	if (i == 0 && !m->gpu_wait)
		memset(m->csum, 0, (size_t)be->n * dim * sizeof(float));
	if (!m->gpu_wait && i >= m->n_jobs && m->collected <= i - m->n_jobs) {
		int rc = cpu_collect(be, i - m->n_jobs);
		m->collected = i - m->n_jobs + 1;
		if (rc)
			return rc;
	}
	struct moe_cpu_expert *ce = &m->cpu[i];
	ce->expert = expert;
	ce->gate = host_mat(gate);
	ce->up = host_mat(up);
	ce->down = host_mat(down);
	struct moe_cpu_job *cj = &m->jobs[i % m->n_jobs];
	const uint32_t o = m->off[expert], cnt = m->off[expert + 1] - o;
	ce->w = m->h_tw[o];
	for (uint32_t r = 0; r < cnt; r++)
		memcpy(cj->x + (size_t)r * dim, m->h_xn + (size_t)m->h_tok[o + r] * dim, dim * sizeof(float));
	const uint64_t bytes = mat_bytes(gate) + mat_bytes(up) + mat_bytes(down);
	/* Cut finer for larger experts, in chunks of about --cpu-expert-chunk bytes
	 * (ffn_share_threads_for_chunk: with the pool's threads over the k jobs,
	 * 1 of 14 on the H200 host, a bf16 expert of Qwen3-30B-A3B, 9.4 MB, went in 12 chunks of 786 KB,
	 * and a layer's last expert ran its down on 4 workers while the others had nothing left); never
	 * coarser again (a model whose layers' experts differ in format would make it anew layer after
	 * layer). The slot's last job is over: collected above, or a layer's before (the route settles
	 * them). */
	const uint32_t per = ffn_share_threads_for_chunk(bytes, m->pool_threads, be->p.cpu_expert_chunk);
	if (per > cj->per) {
		char why[256];
		if (cj->share) {
			struct ffn_share_stats ss;
			ffn_share_get_stats(cj->share, &ss);
			m->wait_ns_gone += ss.wait_ns;
		}
		ffn_share_destroy(&cj->share);
		cj->per = 0; /* none now: a failed create is tried again by the next expert of the slot */
		int rc = ffn_share_create(dim, m->F, FFN_SPLIT_MAX_TOKENS, per, &cj->share, why, sizeof(why));
		if (rc)
			return cuda_failf(be, rc, "cuda backend: expert %u on the CPU: %s", expert, why);
		cj->per = per;
	}
	ffn_share_job_init(&cj->job, &ce->gate, &ce->up, &ce->down, gate->rows, cnt, DT_F32);
	cj->job.taper = be->p.cpu_expert_taper; /* several at once: a phase's last chunks small */
	cj->job.pool = be->p.cpu_pool;		/* a part waiting between phases runs the others' */
	cj->fail = m->fail_in && --m->fail_in == 0;
	memset(&cj->tj, 0, sizeof(cj->tj));
	task_job_init(&cj->tj, cpu_part, cj, ffn_share_parts(cj->share), cj->done, ++cj->seq);
	cj->tj.done_waiters = cj->waiters;
	cj->tj.on_complete = job_ended;
	cj->tj.user = cj;
	task_pool_submit(be->p.cpu_pool, &cj->tj); /* -ESHUTDOWN completes the job with its error */
	m->layer_bytes += bytes;
	m->n_cpu++;
	m->cpu_ns += now_ns() - t0;
	return 0;
}

int moe_expert_cpu(struct backend_dev *be, const struct group_weights *w, uint32_t expert)
{
	return cpu_submit(be, &w->t[ROLE_EXPERT_GATE], &w->t[ROLE_EXPERT_UP], &w->t[ROLE_EXPERT_DOWN], expert);
}

int moe_expert_cpu_share(struct backend_dev *be, const struct ffn_split *s, uint32_t expert)
{
	return cpu_submit(be, &s->gate, &s->up, &s->down, expert);
}

/* Every job submitted and not yet collected waited for, and those the stream waits for (kept for
 * moe_check). */
void moe_settle_jobs(struct cuda_moe *m)
{
	if (!m->jobs)
		return;
	for (uint32_t i = m->collected; i < m->n_cpu; i++) {
		struct moe_cpu_job *cj = &m->jobs[i % m->n_jobs];
		task_word_wait(cj->done, cj->waiters, cj->seq, 50, 0);
	}
	m->collected = m->n_cpu;
	for (uint32_t i = 0; i < m->n_waited; i++)
		task_word_wait(m->jobs[i].done, m->jobs[i].waiters, m->jobs[i].seq, 50, 0);
}

/* A failed step: its jobs are over, and their results are the failed step's. */
void moe_settle(struct backend_dev *be)
{
	struct cuda_moe *m = be->moe;
	if (!m)
		return;
	moe_settle_jobs(m);
	m->n_waited = 0;
	m->last_end_ns = m->gap_pending_ns = m->step_end_ns = m->step_pending_ns = 0;
	m->step_ret_ns = m->step_tail_pending_ns = 0;
	m->ends_marked = m->routed_marked = false;
	m->ends_known = 0;
	m->begin = 0;
	m->begin_dev = false;
	(void)moe_dev_check(be); /* the failed step's device routing forgotten, a flag of its with it */
}

/* A layer's CPU experts (bytes of weights), first submission (t0) to the last of jobs [i0, i1) (slots
 * i % n_jobs) to end. */
static void count_span(struct cuda_moe *m, uint64_t t0, uint32_t i0, uint32_t i1, uint64_t bytes, uint32_t n)
{
	uint64_t end = 0;
	for (uint32_t i = i0; i < i1; i++)
		end = m->jobs[i % m->n_jobs].end_ns > end ? m->jobs[i % m->n_jobs].end_ns : end;
	if (i1 > i0 && end > t0) {
		/* A step of one token, or of several (apart: moe_internal.h). */
		*(n == 1 ? &m->span_ns : &m->span_ns_multi) += end - t0;
		(*(n == 1 ? &m->span_layers : &m->span_layers_multi))++;
		*(n == 1 ? &m->span_bytes : &m->span_bytes_multi) += bytes;
		m->last_end_ns = end;
	}
}

int moe_check(struct backend_dev *be)
{
	struct cuda_moe *m = be->moe;
	if (!m)
		return 0;
	int rc = 0;
	for (uint32_t i = 0; i < m->n_waited; i++) {
		struct moe_cpu_job *cj = &m->jobs[i];
		task_word_wait(cj->done, cj->waiters, cj->seq, 50, 0); /* at once where the stream has seen it */
		if (cj->tj.rc && !rc)
			rc = cuda_failf(be, cj->tj.rc, "cuda backend: expert %u on the CPU: %s", m->cpu[i].expert,
					cj->tj.err);
	}
	count_span(m, m->waited_t0, 0, m->n_waited, m->waited_bytes, m->waited_n);
	m->n_waited = 0;
	return rc;
}

int moe_check_step(struct backend_dev *be)
{
	int rc = moe_check(be);
	const int drc = moe_dev_check(be);
	if (!rc)
		rc = drc;
	if (be->moe && be->moe->begin_dev) {
		/* The step's start timed at a layer routed on the device: the stream is idle now
		 * (moe_dev_check waited for it). */
		struct cuda_moe *m = be->moe;
		if (rc == 0)
			(void)moe_begin_count(m, m->begin_dev_host_ns, 0);
		m->begin_dev = false;
	}
	if (be->moe) {
		/* The step's last CPU experts' end, for the gap to the next step's first (none after a
		 * failure). */
		be->moe->step_end_ns = rc ? 0 : be->moe->last_end_ns;
		be->moe->step_ret_ns = rc ? 0 : now_ns();
		/* The return on the GPU's clock (after a step whose output the host waited for, a decode
		 * step's, the stream is idle: the event completes at once). */
		be->moe->begin = rc == 0 && be->n <= FFN_SPLIT_MAX_TOKENS &&
					 moe_time_mark(be->moe->begin_ev[MOE_EV_RET], be->stream)
				 ? 1
				 : 0;
		be->moe->last_end_ns = be->moe->gap_pending_ns = be->moe->step_pending_ns = 0;
		be->moe->ends_marked = false; /* the ends are measured within a step */
	}
	return rc;
}

void moe_embedded(struct backend_dev *be)
{
	struct cuda_moe *m = be->moe;
	if (m && m->begin == 1)
		m->begin = moe_time_mark(m->begin_ev[MOE_EV_EMBED], be->stream) ? 2 : 0;
}

bool moe_begin_timed(struct backend_dev *be, uint64_t t_in, bool cond)
{
	struct cuda_moe *m = be->moe;
	const bool timed = cond && m->begin == 2 && t_in - m->step_ret_ns < MOE_STEP_GAP_MAX_MS * 1000000ull;
	m->begin = 0;
	return timed && moe_time_mark(m->begin_ev[MOE_EV_ROUTER], be->stream); /* statistics: never fails the step */
}

bool moe_begin_count(struct cuda_moe *m, uint64_t host_ns, uint64_t wait_ns)
{
	float part[MOE_BEGIN_EVENTS - 1];
	bool got = true;
	for (int i = 0; got && i < MOE_BEGIN_EVENTS - 1; i++)
		got = cudaEventElapsedTime(&part[i], m->begin_ev[i], m->begin_ev[i + 1]) == cudaSuccess;
	if (!got) {
		(void)cudaGetLastError(); /* nothing left for the next launch's check to find */
		return false;
	}
	m->begin_host_ns += host_ns;
	m->begin_wait_ns += wait_ns;
	for (int i = 0; i < MOE_BEGIN_EVENTS - 1; i++)
		m->begin_gpu_ms[i] += part[i];
	m->begins++;
	return true;
}

bool moe_time_mark(cudaEvent_t ev, cudaStream_t stream)
{
	if (cudaEventRecord(ev, stream) == cudaSuccess)
		return true;
	(void)cudaGetLastError(); /* not left for the next launch's check to find */
	return false;
}

/* One token's CPU experts, noted this layer: the stream waits for each job's completion word, and
 * combine_kernel reads their rows from mapped host memory (cw). The host goes on. */
static int cpu_experts_waited(struct backend_dev *be, moe_combine_w *cw)
{
	struct cuda_moe *m = be->moe;
	for (uint32_t i = 0; i < m->n_cpu; i++) {
		struct moe_cpu_job *cj = &m->jobs[i];
		/* EQ, not GEQ (an unsigned compare, where seq wraps): a slot's next job is submitted only
		 * after the host's next wait for the stream has passed this one. */
		CUresult r = m->wait32((CUstream)be->stream, cj->done_dev, cj->seq, CU_STREAM_WAIT_VALUE_EQ);
		if (r != CUDA_SUCCESS)
			return cuda_failf(be, -EIO, "cuda backend: cuStreamWaitValue32 (expert %u on the CPU) failed: %d",
					  m->cpu[i].expert, (int)r);
		cw->cpu_y[i] = cj->y_dev;
		cw->cpu_w[i] = m->cpu[i].w;
	}
	cw->n_cpu = m->n_cpu;
	m->n_waited = m->n_cpu;
	m->waited_t0 = m->layer_t0;
	m->waited_bytes = m->layer_bytes;
	m->waited_n = m->layer_n;
	m->cpu_experts += m->n_cpu;
	m->n_cpu = 0;
	m->collected = 0;
	return 0;
}

/* The rest of the noted experts collected, in order; csum up. Every submitted job is waited for,
 * a failed one included (its slot and buffers are reused by the next layer). */
static int cpu_experts(struct backend_dev *be, float **sum_dev)
{
	struct cuda_moe *m = be->moe;
	uint64_t t0 = now_ns();
	int rc = 0;
	for (uint32_t i = m->collected; i < m->n_cpu; i++) {
		int r = cpu_collect(be, i);
		if (r && !rc)
			rc = r;
	}
	count_span(m, m->layer_t0, m->n_cpu > m->n_jobs ? m->n_cpu - m->n_jobs : 0, m->n_cpu, m->layer_bytes,
		   m->layer_n);
	m->collected = 0;
	m->cpu_ns += now_ns() - t0;
	if (rc)
		return rc;
	char *h;
	size_t off, bytes = (size_t)be->n * be->cfg.dim * sizeof(float);
	if ((rc = up_alloc(be, bytes, &h, &off)))
		return rc;
	memcpy(h, m->csum, bytes);
	if ((rc = up_send(be, m->csum_dev, h, off, bytes, "cudaMemcpyAsync (the CPU experts' sum)")))
		return rc;
	*sum_dev = m->csum_dev;
	return 0;
}

void moe_cpu_routed(struct cuda_moe *m)
{
	m->route_t1 = now_ns();
	/* The layer before's ends (backend_moe_ends): both events are past (the host has waited for the
	 * stream), the CPU's jobs of that layer counted by moe_check (last_end_ns). */
	m->ends_known = 0;
	m->ends_ns = 0;
	float ms = 0;
	if (m->routed_marked && m->last_end_ns && m->route_sync_ns) {
		if (cudaEventElapsedTime(&ms, m->ends_ev, m->routed_ev) == cudaSuccess && ms >= 0) {
			m->ends_ns = (int64_t)m->route_sync_ns - (int64_t)((double)ms * 1e6) - (int64_t)m->last_end_ns;
			m->ends_known = 1;
		} else {
			(void)cudaGetLastError(); /* statistics: never fails the step */
		}
	}
	m->routed_marked = false;
	m->gap_pending_ns = m->last_end_ns && m->route_t1 > m->last_end_ns ? m->route_t1 - m->last_end_ns : 0;
	/* A step's first routing after one whose last layer had CPU experts: the token's ends, where the
	 * step follows at once (a later request's first step does not). */
	const uint64_t since = m->route_t1 > m->step_end_ns ? m->route_t1 - m->step_end_ns : 0;
	m->step_pending_ns = !m->last_end_ns && m->step_end_ns && since < MOE_STEP_GAP_MAX_MS * 1000000ull ? since : 0;
	m->step_tail_pending_ns = m->step_pending_ns && m->step_ret_ns > m->step_end_ns ? m->step_ret_ns - m->step_end_ns : 0;
	m->step_end_ns = m->step_ret_ns = 0;
	m->last_end_ns = 0;
}

int moe_ends(struct backend_dev *be, int64_t *gpu_late_ns)
{
	const struct cuda_moe *m = be->moe;
	if (!m || m->ends_known != 1)
		return 0;
	*gpu_late_ns = m->ends_ns;
	return 1;
}

int moe_cpu_end(struct backend_dev *be, moe_combine_w *cw)
{
	struct cuda_moe *m = be->moe;
	m->gap_pending_ns = m->step_pending_ns = m->step_tail_pending_ns = 0; /* a layer with no CPU expert: no gap */
	if (m->n_cpu && m->gpu_wait)
		return cpu_experts_waited(be, cw);
	if (m->n_cpu) {
		float *cs = NULL;
		int rc = cpu_experts(be, &cs);
		m->n_cpu = 0;
		if (rc)
			return rc;
		add_launch(be->x, cs, (size_t)be->n * be->cfg.dim, be->stream);
		LAUNCHED(be, "add_kernel (CPU experts' sum)");
	}
	return 0;
}

void moe_cpu_stats(const struct cuda_moe *m, struct backend_cpu_share_stats *out)
{
	out->experts = m->cpu_experts;
	out->experts_ms = (double)m->cpu_ns / 1e6;
	out->experts_span_ms = (double)m->span_ns / 1e6;
	out->expert_layers = m->span_layers;
	out->experts_span_bytes = m->span_bytes;
	out->experts_span_ms_multi = (double)m->span_ns_multi / 1e6;
	out->expert_layers_multi = m->span_layers_multi;
	out->experts_span_bytes_multi = m->span_bytes_multi;
	uint64_t wait = m->wait_ns_gone;
	for (uint32_t j = 0; j < m->n_jobs; j++)
		if (m->jobs[j].share) {
			struct ffn_share_stats ss;
			ffn_share_get_stats(m->jobs[j].share, &ss);
			wait += ss.wait_ns;
		}
	out->experts_phase_wait_ms = (double)wait / 1e6;
	out->experts_gap_gpu_ms = (double)m->gap_gpu_ns / 1e6;
	out->experts_gap_host_ms = (double)m->gap_host_ns / 1e6;
	out->expert_gaps = m->gaps;
	out->experts_step_gap_ms = (double)m->step_gap_ns / 1e6;
	out->experts_step_tail_ms = (double)m->step_tail_ns / 1e6;
	out->step_begin_host_ms = (double)m->begin_host_ns / 1e6;
	out->step_begin_wait_ms = (double)m->begin_wait_ns / 1e6;
	out->step_begin_gpu_embed_ms = m->begin_gpu_ms[MOE_EV_RET];
	out->step_begin_gpu_attn_ms = m->begin_gpu_ms[MOE_EV_EMBED];
	out->step_begin_gpu_router_ms = m->begin_gpu_ms[MOE_EV_ROUTER];
	out->step_begins = m->begins;
	out->expert_step_gaps = m->step_gaps;
}

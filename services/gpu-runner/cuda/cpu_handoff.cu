/* cpu_handoff.cu - the stream-to-pool handoff of cpu_handoff.h: pinned slots, completion words,
 * the descriptor ring, the two mechanisms (host functions; stream memory operations with a
 * dispatcher thread). Host code but one kernel: read_mapped_kernel brings a result up from mapped
 * host memory (mapped_out).
 *
 * Who touches what:
 *  - the descriptor of handoff seq (ring[seq % ring]) is written by the submitting thread, read
 *    by whoever submits the job (the hostfunc host function; with memops the dispatcher, a
 *    thread in cpu_handoff_poll or an idle worker of the pool) and by the job's
 *    parts and hook; the submitting thread writes it again only once the job has completed (its
 *    slot's done word has reached seq), and the pool touches a job not at all after that store;
 *  - done[slot].value is written only by job completions (seq, growing by 2 per slot: the jobs
 *    of one slot are ordered by the stream, since job seq + 2 starts after the stream's wait for
 *    seq); read by the stream (memops), the wait host function (hostfunc) and the submitter;
 *  - trigger (memops) is written only by the stream, read by the dispatcher, cpu_handoff_poll and
 *    the pool's idle workers (idle_dispatch, where workers_dispatch set the pool's idle hook);
 *  - published (memops) is written only by the submitting thread, read by the same three;
 *  - next_dispatch (memops) is taken seq by seq with a compare-and-swap by whichever of them sees
 *    seq published and triggered first: each job goes to the pool once.
 *
 * The driver API's stream memory operations are reached through cudaGetDriverEntryPointByVersion,
 * so nothing links libcuda.so (a binary that does will not load where no driver is installed).
 */
#include "services/gpu-runner/cuda/cpu_handoff.h"

#include <assert.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"

#define DEFAULT_RING 64u
#define MAX_RING (1u << 16)
#define WORDS_BYTES 4096
#define SLOT_ALIGN 4096
#define RING_POLL_NS 1000000u /* a submit waiting for the ring checks the stream this often */
#define DISPATCH_CHECK_NS 10000000u /* a trigger this late: the dispatcher asks the stream once a ms */
#define DISPATCH_STALL_NS 100000u   /* a turn of the dispatcher this long after the last: a stall */
/* The driver API version whose entry points are asked for: the v2 stream memory operations (the
 * only ones from CUDA 12 on; the v1 ones needed a kernel module parameter). */
#define DRIVER_API_VERSION 12000

/* Completion word of a slot and the count of host threads asleep on it, on a line of its own. */
struct done_word {
	uint32_t value;
	uint32_t waiters;
	uint32_t pad[14];
};

/* Pinned (in memops mode: mapped) host memory the stream and the CPU signal each other through. */
struct handoff_words {
	uint32_t trigger; /* memops: the stream writes seq here once handoff seq's D2H is done */
	uint32_t probe;	  /* memops: create's test write */
	uint32_t pad[14];
	struct done_word done[2];
};

struct handoff_desc {
	struct cpu_handoff *h;
	cpu_handoff_fn fn;
	cpu_handoff_prefetch_fn prefetch;
	uint64_t prefetch_arg[CPU_HANDOFF_PREFETCH_ARG / 8]; /* words stored (submit) and loaded (prefetch_next)
							      * atomically */
	uint64_t pf_next; /* the next offset of its read-ahead to claim (atomic) */
	struct cpu_handoff_task task;
	struct task_job job;
	/* CLOCK_MONOTONIC ns (cpu_handoff_times): published by the submitter, handed to the pool,
	 * the first part's start, the job's end; 0 until then. */
	uint64_t t_publish, t_dispatch, t_first, t_end;
};

struct cpu_handoff {
	enum cpu_handoff_mode mode;
	struct task_pool *pool;
	cudaStream_t stream;
	size_t max_in, max_out;
	char *pinned;		    /* in[0], in[1], out[0], out[1] */
	void *in[2], *out[2];
	bool mapped_out;	    /* the results come up by read_mapped_kernel from out_dev */
	bool poll_out;		    /* memops, mapped_out: by wait_read_kernel, which waits for the job too */
	void *out_dev[2];	    /* out[] as the device addresses them (mapped_out) */
	size_t out_bytes[2];	    /* what the wait of the slot's handoff copies up */
	struct handoff_words *words;
	CUdeviceptr d_trigger, d_probe, d_done[2];
	PFN_cuStreamWriteValue32_v11070 write32;
	PFN_cuStreamWaitValue32_v11070 wait32;
	PFN_cuGetErrorName_v6000 error_name;
	struct handoff_desc *ring;
	uint32_t ring_n;	    /* a power of two */
	uint32_t spin_us;

	/* The submitting thread's. */
	uint64_t submitted;	    /* last seq submitted */
	uint64_t waited;	    /* last seq whose wait is queued */
	uint64_t ring_waits;
	int broken;		    /* 0, or the -errno of a failed CUDA call */
	char broken_msg[CPU_HANDOFF_ERR_MAX];

	/* Host functions' (they run one at a time, in stream order). */
	uint64_t hf_waited;
	/* Last seq handed to the pool (hf_submit; with memops the dispatcher, cpu_handoff_poll or an idle
	 * worker: with two jobs in flight and both triggered, two threads may store them out of order,
	 * so destroy takes next_dispatch - 1 in memops). */
	uint32_t dispatched;
	uint64_t n_dispatched;

	/* memops: the dispatcher. */
	pthread_t dispatcher;
	bool dispatcher_started;
	int dispatcher_cpu;
	uint32_t published;	    /* last seq the submitter published */
	uint32_t next_dispatch;	    /* the next seq to hand to the pool: taken by a compare-and-swap, by the
				     * dispatcher, a thread in cpu_handoff_poll or an idle worker, whichever
				     * sees its trigger first */
	uint64_t by_poll;	    /* jobs dispatched from cpu_handoff_poll */
	uint64_t by_workers;	    /* jobs dispatched by the pool's idle workers (workers_dispatch) */
	bool idle_hook;		    /* the pool's idle hook is this handoff's (idle_dispatch) */
	uint64_t prefetch_max;	    /* params.prefetch_bytes */
	uint64_t prefetched;	    /* bytes read ahead (atomic) */
	uint32_t pf_inflight;	    /* workers between their check of a job and the end of its chunk's
				     * read (cpu_handoff_quiesce_prefetch waits for 0) */
	uint32_t pf_off;	    /* set for good once the stream failed: its published jobs are never
				     * dispatched, and nothing reads them ahead any more */
	uint32_t wake_seq;	    /* futex word the dispatcher sleeps on: bumped by publish and stop */
	uint32_t disp_sleeping;
	uint32_t stop;

	/* The jobs' timing (cpu_handoff_stats), written by the thread completing a job: one job runs at
	 * a time (job k + 1 is dispatched after the stream's wait for job k). */
	uint64_t timed, dispatch_ns, dispatch_max_ns, gap_ns, gaps, host_late, last_end;
	/* memops: the dispatcher's turns while a handoff was published and not yet triggered that
	 * came DISPATCH_STALL_NS or more after the one before (the thread held off its CPU), and
	 * their time; written by the dispatcher only. */
	uint64_t stalls, stall_ns;

	/* Failures of jobs, from the pool's threads. */
	pthread_mutex_t err_mu;
	int err_rc;
	char err_msg[CPU_HANDOFF_ERR_MAX];
	uint64_t failed;
};

/* The result of a handoff from its output slot in mapped host memory into device memory: 16 bytes
 * a load (__ldcv: one uncached 16-byte load, where a volatile uint4 would be four 4-byte ones; the
 * slots and d_out are 16-byte aligned), the last few bytes one at a time. Uncached: the host wrote
 * them after the stream's last look (the wait orders them). */
static __device__ __forceinline__ void copy_mapped(uint4 *dst, const uint4 *src, size_t words, unsigned char *dst_tail,
						    const unsigned char *src_tail, size_t tail, size_t first, size_t stride,
						    bool tail_here)
{
	for (size_t i = first; i < words; i += stride)
		dst[i] = __ldcv(src + i);
	if (tail_here && threadIdx.x < tail)
		dst_tail[threadIdx.x] = ((const volatile unsigned char *)src_tail)[threadIdx.x];
}

__global__ void read_mapped_kernel(uint4 *dst, const uint4 *src, size_t words, unsigned char *dst_tail,
				   const unsigned char *src_tail, size_t tail)
{
	copy_mapped(dst, src, words, dst_tail, src_tail, tail, blockIdx.x * (size_t)blockDim.x + threadIdx.x,
		    (size_t)gridDim.x * blockDim.x, blockIdx.x == 0);
}

/* read_mapped_kernel after the job's completion word (mapped host memory) has reached seq, which
 * one block's first thread polls (an acquire load at system scope: the job's outputs, stored
 * before its word, are read after it). One block: a poll is a round trip over the link, and the
 * result is a few KB a token. */
__global__ void wait_read_kernel(const uint32_t *done, uint32_t seq, uint4 *dst, const uint4 *src, size_t words,
				 unsigned char *dst_tail, const unsigned char *src_tail, size_t tail)
{
	if (threadIdx.x == 0) {
		for (;;) {
			uint32_t v;
			asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(done) : "memory");
			if ((int32_t)(v - seq) >= 0)
				break;
			__nanosleep(256);
		}
	}
	__syncthreads();
	copy_mapped(dst, src, words, dst_tail, src_tail, tail, threadIdx.x, blockDim.x, true);
}

static inline bool reached(uint32_t v, uint32_t target)
{
	return (int32_t)(v - target) >= 0;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

static void futex_wake(uint32_t *addr, int n)
{
	syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static void futex_wait(uint32_t *addr, uint32_t val)
{
	syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

const char *cpu_handoff_mode_name(enum cpu_handoff_mode mode)
{
	switch (mode) {
	case CPU_HANDOFF_HOSTFUNC:
		return "hostfunc";
	case CPU_HANDOFF_MEMOPS:
		return "memops";
	}
	return "?";
}

int cpu_handoff_parse_mode(const char *text, enum cpu_handoff_mode *out, char *err, size_t errlen)
{
	if (strcmp(text, "hostfunc") == 0) {
		*out = CPU_HANDOFF_HOSTFUNC;
		return 0;
	}
	if (strcmp(text, "memops") == 0) {
		*out = CPU_HANDOFF_MEMOPS;
		return 0;
	}
	return errorf(err, errlen, -EINVAL, "cpu handoff: unknown mode '%s' (hostfunc or memops)", text);
}

/* ---- errors ---- */

/* Marks the handoff broken by a failed CUDA call; returns the error. */
static int broke(struct cpu_handoff *h, char *err, size_t errlen, cudaError_t e, const char *what, uint64_t seq)
{
	if (!h->broken) {
		h->broken = -EIO;
		snprintf(h->broken_msg, sizeof(h->broken_msg), "cpu handoff: handoff %llu: %s: %s",
			 (unsigned long long)seq, what, cudaGetErrorString(e));
	}
	return errorf(err, errlen, h->broken, "%s", h->broken_msg);
}

static const char *cu_name(const struct cpu_handoff *h, CUresult r, char *buf, size_t len)
{
	const char *name = NULL;
	if (h && h->error_name && h->error_name(r, &name) == CUDA_SUCCESS && name)
		return name;
	snprintf(buf, len, "CUresult %d", (int)r);
	return buf;
}

static int broke_cu(struct cpu_handoff *h, char *err, size_t errlen, CUresult r, const char *what, uint64_t seq)
{
	if (!h->broken) {
		char buf[32];
		h->broken = -EIO;
		snprintf(h->broken_msg, sizeof(h->broken_msg), "cpu handoff: handoff %llu: %s: %s",
			 (unsigned long long)seq, what, cu_name(h, r, buf, sizeof(buf)));
	}
	return errorf(err, errlen, h->broken, "%s", h->broken_msg);
}

/* A job dispatched this soon after its publish found the stream there before the host: the
 * stream had waited for the host's submit (cpu_handoff_stats host_late). */
#define HOST_LATE_NS 5000u
/* A time without a job this long is not a decode step's (a prefill ran, or a request ended): not a
 * gap (cpu_handoff_stats gap_ns). */
#define GAP_MAX_NS 10000000u

/* The job's times into its descriptor and the handoff's sums (relaxed: read by stats). */
static void job_times(struct cpu_handoff *h, struct handoff_desc *d)
{
	const uint64_t end = now_ns();
	uint64_t first = __atomic_load_n(&d->t_first, __ATOMIC_RELAXED);
	if (!first)
		first = end; /* no part ran (n_parts 0) */
	const uint64_t disp = d->t_dispatch, pub = d->t_publish;
	const uint64_t lat = first > disp ? first - disp : 0;
	__atomic_store_n(&h->dispatch_ns, h->dispatch_ns + lat, __ATOMIC_RELAXED);
	if (lat > h->dispatch_max_ns)
		__atomic_store_n(&h->dispatch_max_ns, lat, __ATOMIC_RELAXED);
	if (h->last_end && first > h->last_end && first - h->last_end < GAP_MAX_NS) {
		__atomic_store_n(&h->gap_ns, h->gap_ns + (first - h->last_end), __ATOMIC_RELAXED);
		__atomic_store_n(&h->gaps, h->gaps + 1, __ATOMIC_RELAXED);
	}
	if (disp >= pub && disp - pub < HOST_LATE_NS)
		__atomic_store_n(&h->host_late, h->host_late + 1, __ATOMIC_RELAXED);
	h->last_end = end;
	__atomic_store_n(&d->t_end, end, __ATOMIC_RELAXED);
	__atomic_store_n(&h->timed, h->timed + 1, __ATOMIC_RELAXED);
}

/* The pool's hook: runs in the thread completing a job, before its word is stored. */
static void job_done(struct task_job *job)
{
	struct handoff_desc *d = (struct handoff_desc *)job->arg;
	struct cpu_handoff *h = d->h;
	job_times(h, d);
	if (job->rc == 0)
		return;
	pthread_mutex_lock(&h->err_mu);
	h->failed++;
	if (h->err_rc == 0) {
		h->err_rc = job->rc;
		snprintf(h->err_msg, sizeof(h->err_msg), "cpu handoff: handoff %llu: %s",
			 (unsigned long long)d->task.seq, job->err);
	}
	pthread_mutex_unlock(&h->err_mu);
}

static int part_fn(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	struct handoff_desc *d = (struct handoff_desc *)arg;
	if (!__atomic_load_n(&d->t_first, __ATOMIC_RELAXED)) {
		uint64_t zero = 0;
		__atomic_compare_exchange_n(&d->t_first, &zero, now_ns(), false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
	}
	return d->fn(&d->task, part, n_parts, err, errlen);
}

/* Hands descriptor d's job to the pool (hf_submit, or dispatch_ready's caller). */
static void dispatch(struct cpu_handoff *h, struct handoff_desc *d)
{
	__atomic_store_n(&h->dispatched, (uint32_t)d->task.seq, __ATOMIC_RELEASE);
	__atomic_add_fetch(&h->n_dispatched, 1, __ATOMIC_RELAXED);
	d->t_dispatch = now_ns();
	/* -ESHUTDOWN: the pool is going away; the job has completed with its error all the same. */
	(void)task_pool_submit(h->pool, &d->job);
}

/* ---- hostfunc ---- */

static void CUDART_CB hf_submit(void *arg)
{
	struct handoff_desc *d = (struct handoff_desc *)arg;
	dispatch(d->h, d);
}

/* Holds the stream until the next handoff's job (waits are queued in submit order) completes. */
static void CUDART_CB hf_wait(void *arg)
{
	struct cpu_handoff *h = (struct cpu_handoff *)arg;
	uint64_t seq = __atomic_add_fetch(&h->hf_waited, 1, __ATOMIC_RELAXED);
	struct done_word *dw = &h->words->done[seq & 1];
	/* Acquire (inside): the job's outputs are visible before the stream's H2D copy reads them. */
	task_word_wait(&dw->value, &dw->waiters, (uint32_t)seq, h->spin_us, 0);
}

/* ---- memops ---- */

/* Hands the pool every job published and triggered from next_dispatch on, each taken by one
 * thread (the dispatcher, one in cpu_handoff_poll or an idle worker) with a compare-and-swap. Two jobs may be in
 * flight (two slots), so with both triggered, one thread may hand over seq + 1 while the other is
 * still handing over seq: the jobs are independent, and destroy waits by next_dispatch. Returns
 * the jobs this thread dispatched. */
static uint32_t dispatch_ready(struct cpu_handoff *h)
{
	uint32_t n = 0;
	for (;;) {
		uint32_t next = __atomic_load_n(&h->next_dispatch, __ATOMIC_ACQUIRE);
		/* Pairs with the submitter's store: the descriptors up to pub are written. */
		const uint32_t pub = __atomic_load_n(&h->published, __ATOMIC_ACQUIRE);
		if (!reached(pub, next))
			return n;
		/* The stream wrote the trigger after its D2H copy, with a fence before the write
		 * (cuStreamWriteValue32 without CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER): seeing seq
		 * here means the copied bytes are in host memory. */
		const uint32_t trig = __atomic_load_n(&h->words->trigger, __ATOMIC_ACQUIRE);
		if (!reached(trig, next))
			return n;
		if (!__atomic_compare_exchange_n(&h->next_dispatch, &next, next + 1, false, __ATOMIC_ACQ_REL,
						 __ATOMIC_ACQUIRE))
			continue; /* the other thread took it */
		dispatch(h, &h->ring[next & (h->ring_n - 1)]);
		n++;
	}
}

uint32_t cpu_handoff_poll(struct cpu_handoff *h)
{
	if (!h || h->mode != CPU_HANDOFF_MEMOPS || !h->words)
		return 0;
	const uint32_t n = dispatch_ready(h);
	if (n)
		__atomic_add_fetch(&h->by_poll, n, __ATOMIC_RELAXED);
	return n;
}

#define PREFETCH_CHUNK (32u << 10) /* a read-ahead claim: a few us of one worker, who looks at the
				    * trigger again only after it */

/* One chunk of the next job's read-ahead, when a job is published and not yet dispatched: claimed
 * from its descriptor's cursor, up to prefetch_max. The descriptor is rewritten only once its job
 * has completed (and the ring has come round), so the copy of its function and argument (relaxed
 * word loads, then an acquire fence) is the job's own if next_dispatch, read after the copy, still
 * names it undispatched. The read itself is counted in pf_inflight from before that check to its
 * end: the weights it names stay mapped while their step runs, and the step's end waits for the
 * count (cpu_handoff_quiesce_prefetch) before anything may unmap them. Returns the bytes read. */
static uint64_t prefetch_next(struct cpu_handoff *h)
{
	const uint32_t next = __atomic_load_n(&h->next_dispatch, __ATOMIC_ACQUIRE);
	const uint32_t pub = __atomic_load_n(&h->published, __ATOMIC_ACQUIRE);
	if (!reached(pub, next))
		return 0;
	struct handoff_desc *d = &h->ring[next & (h->ring_n - 1)];
	const cpu_handoff_prefetch_fn fn = __atomic_load_n(&d->prefetch, __ATOMIC_RELAXED);
	if (!fn || __atomic_load_n(&d->pf_next, __ATOMIC_RELAXED) >= h->prefetch_max)
		return 0;
	const uint64_t off = __atomic_fetch_add(&d->pf_next, PREFETCH_CHUNK, __ATOMIC_RELAXED);
	if (off >= h->prefetch_max)
		return 0;
	uint64_t arg[CPU_HANDOFF_PREFETCH_ARG / 8];
	for (size_t i = 0; i < CPU_HANDOFF_PREFETCH_ARG / 8; i++)
		arg[i] = __atomic_load_n(&d->prefetch_arg[i], __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_ACQUIRE);
	__atomic_add_fetch(&h->pf_inflight, 1, __ATOMIC_SEQ_CST);
	uint64_t got = 0;
	if (__atomic_load_n(&h->next_dispatch, __ATOMIC_SEQ_CST) == next && /* else dispatched meanwhile */
	    !__atomic_load_n(&h->pf_off, __ATOMIC_SEQ_CST)) {
		const uint64_t want = h->prefetch_max - off < PREFETCH_CHUNK ? h->prefetch_max - off : PREFETCH_CHUNK;
		got = fn(arg, off, want);
		if (got < want) /* the job's end: no more to claim */
			__atomic_store_n(&d->pf_next, h->prefetch_max, __ATOMIC_RELAXED);
		if (got)
			__atomic_add_fetch(&h->prefetched, got, __ATOMIC_RELAXED);
	}
	__atomic_sub_fetch(&h->pf_inflight, 1, __ATOMIC_RELEASE);
	return got;
}

void cpu_handoff_quiesce_prefetch(struct cpu_handoff *h, bool stream_failed)
{
	if (!h || !h->prefetch_max)
		return;
	/* Every job handed over (the caller's step has ended): a worker that counts itself in from here
	 * finds next_dispatch past its job and reads nothing. A failed stream leaves jobs published and
	 * never dispatched: the read-ahead stops for good. */
	if (stream_failed)
		__atomic_store_n(&h->pf_off, 1, __ATOMIC_SEQ_CST);
	while (__atomic_load_n(&h->pf_inflight, __ATOMIC_SEQ_CST))
		cpu_relax();
}

/* The pool's idle hook (workers_dispatch): an idle worker, spinning between jobs, hands the pool
 * the jobs whose triggers have come, as the dispatcher does (one held off its CPU is then not the
 * only thread that could); with none triggered, it reads a chunk of the next job's weights ahead
 * (prefetch_bytes). */
static uint32_t idle_dispatch(void *arg)
{
	struct cpu_handoff *h = (struct cpu_handoff *)arg;
	const uint32_t n = dispatch_ready(h);
	if (n) {
		__atomic_add_fetch(&h->by_workers, n, __ATOMIC_RELAXED);
		return n;
	}
	return h->prefetch_max && prefetch_next(h) ? 1 : 0;
}

static void *dispatcher_main(void *arg)
{
	struct cpu_handoff *h = (struct cpu_handoff *)arg;
	pthread_setname_np(pthread_self(), "cpu-handoff");
	if (h->dispatcher_cpu >= 0) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(h->dispatcher_cpu, &set);
		int e = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
		if (e != 0)
			log_warn("cpu handoff: cannot pin the dispatcher to CPU %d (%s): it runs unpinned",
				 h->dispatcher_cpu, strerror(e));
	}
	uint64_t idle_since = now_ns(), last_check = 0, last_turn = 0;
	for (;;) {
		if (__atomic_load_n(&h->stop, __ATOMIC_ACQUIRE))
			break;
		const uint32_t next = __atomic_load_n(&h->next_dispatch, __ATOMIC_ACQUIRE);
		const uint32_t pub = __atomic_load_n(&h->published, __ATOMIC_ACQUIRE);
		if (!reached(pub, next)) {
			/* Nothing outstanding: spin a while, then sleep until the next publish. */
			last_turn = 0; /* not waiting for a trigger: no stall */
			if (now_ns() - idle_since < (uint64_t)h->spin_us * 1000u) {
				cpu_relax();
				continue;
			}
			/* Announce, read the wake word, re-check, sleep while the word holds: a publish or
			 * stop after the re-check bumps the word and wakes (all sequentially consistent). */
			__atomic_store_n(&h->disp_sleeping, 1, __ATOMIC_SEQ_CST);
			uint32_t w = __atomic_load_n(&h->wake_seq, __ATOMIC_SEQ_CST);
			if (__atomic_load_n(&h->published, __ATOMIC_SEQ_CST) == pub &&
			    !__atomic_load_n(&h->stop, __ATOMIC_SEQ_CST))
				futex_wait(&h->wake_seq, w);
			__atomic_store_n(&h->disp_sleeping, 0, __ATOMIC_SEQ_CST);
			continue;
		}
		if (dispatch_ready(h) || __atomic_load_n(&h->next_dispatch, __ATOMIC_ACQUIRE) != next) {
			/* dispatched here or by a poll: either way the idle spin counts from now */
			idle_since = last_turn = now_ns();
			continue;
		}
		cpu_relax();
		/* Published, not triggered: the stream is behind (it may be a step behind the host), or
		 * it has failed and will never write the trigger. Past a while, ask it once a
		 * millisecond; a failed stream gets this thread asleep between looks, not spinning. */
		const uint64_t t = now_ns();
		if (last_turn && t - last_turn >= DISPATCH_STALL_NS) {
			__atomic_store_n(&h->stalls, h->stalls + 1, __ATOMIC_RELAXED);
			__atomic_store_n(&h->stall_ns, h->stall_ns + (t - last_turn), __ATOMIC_RELAXED);
		}
		last_turn = t;
		if (t - idle_since > DISPATCH_CHECK_NS && t - last_check > 1000000u) {
			last_check = t;
			last_turn = 0; /* the turn after a look at the stream is not a stall */
			const cudaError_t e = cudaStreamQuery(h->stream);
			if (e != cudaSuccess && e != cudaErrorNotReady) {
				const struct timespec ms = {0, 1000000};
				nanosleep(&ms, NULL);
			}
		}
	}
	return NULL;
}

static int resolve(const char *symbol, void **fn, char *err, size_t errlen)
{
	cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
	cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, fn, DRIVER_API_VERSION, cudaEnableDefault, &q);
	if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !*fn)
		return errorf(err, errlen, -ENOTSUP, "cpu handoff: memops: the driver has no %s for CUDA %d.%d (%s, %s)",
			      symbol, DRIVER_API_VERSION / 1000, DRIVER_API_VERSION % 1000 / 10, cudaGetErrorString(e),
			      q == cudaDriverEntryPointVersionNotSufficent ? "driver too old" : "symbol not found");
	return 0;
}

int cpu_handoff_memops_supported(int device, char *err, size_t errlen)
{
	int version = 0;
	cudaError_t e = cudaDriverGetVersion(&version);
	if (e != cudaSuccess)
		return errorf(err, errlen, -EIO, "cpu handoff: memops: cudaDriverGetVersion: %s", cudaGetErrorString(e));
	if (version < DRIVER_API_VERSION)
		return errorf(err, errlen, -ENOTSUP,
			      "cpu handoff: memops: the driver supports CUDA %d.%d; stream memory operations on "
			      "host memory need 12.0 or later",
			      version / 1000, version % 1000 / 10);
	int can_map = 0;
	e = cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory, device);
	if (e != cudaSuccess)
		return errorf(err, errlen, -EIO, "cpu handoff: memops: device %d: cudaDeviceGetAttribute: %s", device,
			      cudaGetErrorString(e));
	if (!can_map)
		return errorf(err, errlen, -ENOTSUP,
			      "cpu handoff: memops: device %d cannot map host memory (cudaDevAttrCanMapHostMemory 0)",
			      device);
	void *fn = NULL;
	int rc = resolve("cuStreamWriteValue32", &fn, err, errlen);
	if (rc == 0)
		rc = resolve("cuStreamWaitValue32", &fn, err, errlen);
	return rc;
}

int cpu_handoff_wait_entry(int device, void **fn, char *err, size_t errlen)
{
	*fn = NULL;
	int rc = cpu_handoff_memops_supported(device, err, errlen);
	return rc ? rc : resolve("cuStreamWaitValue32", fn, err, errlen);
}

/* ---- create, destroy ---- */

static size_t slot_size(size_t bytes)
{
	return ALIGN_UP(bytes ? bytes : 1, (size_t)SLOT_ALIGN);
}

/* memops: the entry points, the device pointers of the words, and one write and wait on the
 * stream, synchronised, so that a platform without the operations is refused here and not
 * found out by a hung stream. */
static int memops_setup(struct cpu_handoff *h, char *err, size_t errlen)
{
	int device = 0;
	cudaError_t e = cudaGetDevice(&device);
	if (e != cudaSuccess)
		return errorf(err, errlen, -EIO, "cpu handoff: cudaGetDevice: %s", cudaGetErrorString(e));
	int rc = cpu_handoff_memops_supported(device, err, errlen);
	if (rc)
		return rc;
	rc = resolve("cuStreamWriteValue32", (void **)&h->write32, err, errlen);
	if (rc == 0)
		rc = resolve("cuStreamWaitValue32", (void **)&h->wait32, err, errlen);
	if (rc)
		return rc;
	void *fn = NULL;
	if (resolve("cuGetErrorName", &fn, err, errlen) == 0)
		h->error_name = (PFN_cuGetErrorName_v6000)fn;
	if (errlen)
		err[0] = '\0';

	void *dev = NULL;
	e = cudaHostGetDevicePointer(&dev, h->words, 0);
	if (e != cudaSuccess)
		return errorf(err, errlen, -ENOTSUP, "cpu handoff: memops: no device address for mapped host memory: %s",
			      cudaGetErrorString(e));
	CUdeviceptr base = (CUdeviceptr)(uintptr_t)dev;
	h->d_trigger = base + offsetof(struct handoff_words, trigger);
	h->d_probe = base + offsetof(struct handoff_words, probe);
	for (int s = 0; s < 2; s++)
		h->d_done[s] = base + offsetof(struct handoff_words, done) + s * sizeof(struct done_word) +
			       offsetof(struct done_word, value);

	char buf[32];
	CUstream cs = (CUstream)h->stream;
	CUresult r = h->write32(cs, h->d_probe, 1, CU_STREAM_WRITE_VALUE_DEFAULT);
	if (r != CUDA_SUCCESS)
		return errorf(err, errlen, r == CUDA_ERROR_NOT_SUPPORTED ? -ENOTSUP : -EIO,
			      "cpu handoff: memops: cuStreamWriteValue32 on mapped host memory, device %d: %s", device,
			      cu_name(h, r, buf, sizeof(buf)));
	r = h->wait32(cs, h->d_probe, 1, CU_STREAM_WAIT_VALUE_GEQ);
	if (r != CUDA_SUCCESS)
		return errorf(err, errlen, r == CUDA_ERROR_NOT_SUPPORTED ? -ENOTSUP : -EIO,
			      "cpu handoff: memops: cuStreamWaitValue32 on mapped host memory, device %d: %s", device,
			      cu_name(h, r, buf, sizeof(buf)));
	e = cudaStreamSynchronize(h->stream);
	if (e != cudaSuccess)
		return errorf(err, errlen, -EIO, "cpu handoff: memops: the probe write and wait: %s",
			      cudaGetErrorString(e));
	if (__atomic_load_n(&h->words->probe, __ATOMIC_ACQUIRE) != 1)
		return errorf(err, errlen, -ENOTSUP,
			      "cpu handoff: memops: the stream's write did not reach host memory (device %d)", device);
	return 0;
}

int cpu_handoff_create(struct task_pool *pool, cudaStream_t stream, const struct cpu_handoff_params *params,
		       struct cpu_handoff **out, char *err, size_t errlen)
{
	*out = NULL;
	if (params->mode != CPU_HANDOFF_HOSTFUNC && params->mode != CPU_HANDOFF_MEMOPS)
		return errorf(err, errlen, -EINVAL, "cpu handoff: unknown mode %d", (int)params->mode);
	uint32_t ring = params->ring ? params->ring : DEFAULT_RING;
	if (ring < 2 || ring > MAX_RING || (ring & (ring - 1)))
		return errorf(err, errlen, -EINVAL, "cpu handoff: ring %u is not a power of two in [2, %u]", ring, MAX_RING);
	if (params->max_in_bytes > ((size_t)1 << 40) || params->max_out_bytes > ((size_t)1 << 40))
		return errorf(err, errlen, -EINVAL, "cpu handoff: slots of %zu and %zu bytes are too large",
			      params->max_in_bytes, params->max_out_bytes);

	int rc = 0;
	cudaError_t e;
	struct cpu_handoff *h = (struct cpu_handoff *)calloc(1, sizeof(*h));
	if (!h)
		return errorf(err, errlen, -ENOMEM, "cpu handoff: out of memory");
	h->mode = params->mode;
	h->pool = pool;
	h->stream = stream;
	h->max_in = params->max_in_bytes;
	h->max_out = params->max_out_bytes;
	h->ring_n = ring;
	h->next_dispatch = 1; /* seqs start at 1 */
	h->spin_us = params->spin_us;
	h->dispatcher_cpu = params->dispatcher_cpu;
	h->prefetch_max = params->workers_dispatch && params->mode == CPU_HANDOFF_MEMOPS ? params->prefetch_bytes : 0;
	pthread_mutex_init(&h->err_mu, NULL);

	h->ring = (struct handoff_desc *)calloc(ring, sizeof(*h->ring));
	if (!h->ring) {
		rc = errorf(err, errlen, -ENOMEM, "cpu handoff: out of memory for a ring of %u", ring);
		goto out_free;
	}
	{
		size_t in_sz = slot_size(h->max_in), out_sz = slot_size(h->max_out);
		e = cudaHostAlloc((void **)&h->pinned, 2 * in_sz + 2 * out_sz,
				  params->mapped_out ? cudaHostAllocMapped : cudaHostAllocDefault);
		if (e != cudaSuccess) {
			h->pinned = NULL;
			rc = errorf(err, errlen, -ENOMEM, "cpu handoff: cannot pin %zu bytes of slots: %s",
				    2 * in_sz + 2 * out_sz, cudaGetErrorString(e));
			goto out_free;
		}
		h->in[0] = h->pinned;
		h->in[1] = h->pinned + in_sz;
		h->out[0] = h->pinned + 2 * in_sz;
		h->out[1] = h->pinned + 2 * in_sz + out_sz;
		for (int s = 0; params->mapped_out && s < 2; s++) {
			e = cudaHostGetDevicePointer(&h->out_dev[s], h->out[s], 0);
			if (e != cudaSuccess) {
				rc = errorf(err, errlen, -EIO, "cpu handoff: the output slots in mapped host memory "
					    "have no device address: %s", cudaGetErrorString(e));
				goto out_free;
			}
		}
		h->mapped_out = params->mapped_out;
		h->poll_out = params->mapped_out && params->poll_out && params->mode == CPU_HANDOFF_MEMOPS;
	}
	/* The words: mapped for memops, the stream reads and writes them itself. */
	e = cudaHostAlloc((void **)&h->words, WORDS_BYTES,
			  h->mode == CPU_HANDOFF_MEMOPS ? cudaHostAllocMapped | cudaHostAllocPortable : cudaHostAllocDefault);
	if (e != cudaSuccess) {
		h->words = NULL;
		rc = errorf(err, errlen, h->mode == CPU_HANDOFF_MEMOPS ? -ENOTSUP : -ENOMEM,
			    "cpu handoff: cannot allocate %s pinned words: %s",
			    h->mode == CPU_HANDOFF_MEMOPS ? "mapped" : "", cudaGetErrorString(e));
		goto out_free;
	}
	memset(h->words, 0, WORDS_BYTES);
	if (h->mode == CPU_HANDOFF_MEMOPS) {
		rc = memops_setup(h, err, errlen);
		if (rc)
			goto out_free;
		int pe = params->no_dispatcher ? 0 : pthread_create(&h->dispatcher, NULL, dispatcher_main, h);
		if (pe != 0) {
			rc = errorf(err, errlen, -pe, "cpu handoff: cannot start the dispatcher: %s", strerror(pe));
			goto out_free;
		}
		h->dispatcher_started = !params->no_dispatcher;
		if (params->workers_dispatch) {
			rc = task_pool_set_idle(pool, idle_dispatch, h);
			if (rc) {
				rc = errorf(err, errlen, rc, "cpu handoff: the pool's idle workers cannot dispatch: %s",
					    rc == -EBUSY ? "another hook is set" : strerror(-rc));
				goto out_free;
			}
			h->idle_hook = true;
		}
	}
	*out = h;
	return 0;

out_free:
	cpu_handoff_destroy(&h);
	return rc;
}

void cpu_handoff_destroy(struct cpu_handoff **hp)
{
	if (!hp || !*hp)
		return;
	struct cpu_handoff *h = *hp;
	/* Everything queued runs out (create's probe too, which writes into the words): the waits
	 * need the dispatcher, so it stops only after. */
	cudaError_t e = cudaStreamSynchronize(h->stream);
	if (e != cudaSuccess)
		log_warn("cpu handoff: destroy: the stream ended with %s", cudaGetErrorString(e));
	if (h->dispatcher_started) {
		__atomic_store_n(&h->stop, 1, __ATOMIC_SEQ_CST);
		__atomic_add_fetch(&h->wake_seq, 1, __ATOMIC_SEQ_CST);
		futex_wake(&h->wake_seq, INT_MAX);
		pthread_join(h->dispatcher, NULL);
	}
	if (h->idle_hook)
		(void)task_pool_set_idle(h->pool, NULL, NULL); /* returns once no worker is inside */
	/* Jobs handed to the pool may still run (a handoff never waited for): they read the slots
	 * and the ring, so wait for the last of each slot. Those of one slot complete in order. */
	uint32_t last = __atomic_load_n(&h->dispatched, __ATOMIC_ACQUIRE);
	if (h->mode == CPU_HANDOFF_MEMOPS)
		last = __atomic_load_n(&h->next_dispatch, __ATOMIC_ACQUIRE) - 1; /* the dispatcher joined, the
										  * hook cleared, the poller
										  * is this thread */
	if (h->words && __atomic_load_n(&h->n_dispatched, __ATOMIC_RELAXED) > 0) {
		for (uint32_t k = 0; k < 2; k++) {
			uint32_t s = last - k;
			if (k == 1 && __atomic_load_n(&h->n_dispatched, __ATOMIC_RELAXED) < 2)
				break;
			struct done_word *dw = &h->words->done[s & 1];
			task_word_wait(&dw->value, &dw->waiters, s, 0, 0);
		}
	}
	/* The thread that stored the last word may still read the waiter count beside it. */
	if (h->pool)
		task_pool_quiesce(h->pool);
	if (h->words)
		cudaFreeHost(h->words);
	if (h->pinned)
		cudaFreeHost(h->pinned);
	free(h->ring);
	pthread_mutex_destroy(&h->err_mu);
	free(h);
	*hp = NULL;
}

/* ---- the token path ---- */

int cpu_handoff_submit(struct cpu_handoff *h, const void *d_in, const struct cpu_handoff_job *job, uint64_t *seq_out,
		       char *err, size_t errlen)
{
	if (h->broken)
		return errorf(err, errlen, h->broken, "%s", h->broken_msg);
	uint64_t seq = h->submitted + 1;
	/* Two slots: the handoff two back must have its wait queued (stream order then keeps this
	 * one's D2H behind that job's end). */
	assert(seq - h->waited <= 2);
	assert(job->fn || job->n_parts == 0);
	assert(job->in_bytes <= h->max_in && job->out_bytes <= h->max_out && job->n_parts <= TASK_POOL_MAX_PARTS);
	assert(job->in_bytes == 0 || d_in);
	uint32_t slot = (uint32_t)(seq & 1);
	struct done_word *dw = &h->words->done[slot];

	/* The descriptor is the one of seq - ring (same slot, ring being even): free once that job
	 * has completed. The stream must get there first: a stream that failed never will, so the
	 * wait looks at it every millisecond (cudaStreamQuery: no synchronisation). */
	if (seq > h->ring_n) {
		uint32_t behind = (uint32_t)(seq - h->ring_n);
		if (!reached(__atomic_load_n(&dw->value, __ATOMIC_ACQUIRE), behind)) {
			h->ring_waits++;
			uint32_t spin = h->spin_us;
			while (task_word_wait(&dw->value, &dw->waiters, behind, spin, RING_POLL_NS) == -ETIMEDOUT) {
				cudaError_t e = cudaStreamQuery(h->stream);
				if (e != cudaSuccess && e != cudaErrorNotReady)
					return broke(h, err, errlen, e, "the stream failed while submit waited for the ring",
						     seq);
				spin = 0;
			}
		}
	}
	struct handoff_desc *d = &h->ring[seq & (h->ring_n - 1)];
	d->h = h;
	d->fn = job->fn;
	/* Atomic, after a release fence: an idle worker reads them (prefetch_next) once published; a
	 * stale one may still look at this descriptor's previous job's, which it finds dispatched (its
	 * acquire fence and re-check of next_dispatch), and drops what it read. */
	const cpu_handoff_prefetch_fn pf = h->prefetch_max ? job->prefetch : NULL;
	__atomic_thread_fence(__ATOMIC_RELEASE);
	if (pf) {
		uint64_t words[CPU_HANDOFF_PREFETCH_ARG / 8];
		memcpy(words, job->prefetch_arg, sizeof(words));
		for (size_t i = 0; i < CPU_HANDOFF_PREFETCH_ARG / 8; i++)
			__atomic_store_n(&d->prefetch_arg[i], words[i], __ATOMIC_RELAXED);
	}
	__atomic_store_n(&d->prefetch, pf, __ATOMIC_RELAXED);
	__atomic_store_n(&d->pf_next, 0, __ATOMIC_RELAXED);
	d->task.in = h->in[slot];
	d->task.out = h->out[slot];
	d->task.in_bytes = job->in_bytes;
	d->task.out_bytes = job->out_bytes;
	d->task.seq = seq;
	d->task.slot = slot;
	d->task.user = job->user;
	d->t_dispatch = d->t_first = d->t_end = 0;
	d->t_publish = now_ns();
	task_job_init(&d->job, part_fn, d, job->n_parts, &dw->value, (uint32_t)seq);
	d->job.done_waiters = &dw->waiters;
	d->job.on_complete = job_done;
	h->out_bytes[slot] = job->out_bytes;

	cudaError_t e;
	if (job->in_bytes) {
		e = cudaMemcpyAsync(h->in[slot], d_in, job->in_bytes, cudaMemcpyDeviceToHost, h->stream);
		if (e != cudaSuccess)
			return broke(h, err, errlen, e, "the activation's copy to the host", seq);
	}
	if (h->mode == CPU_HANDOFF_HOSTFUNC) {
		e = cudaLaunchHostFunc(h->stream, hf_submit, d);
		if (e != cudaSuccess)
			return broke(h, err, errlen, e, "cudaLaunchHostFunc (submit)", seq);
	} else {
		CUresult r = h->write32((CUstream)h->stream, h->d_trigger, (uint32_t)seq, CU_STREAM_WRITE_VALUE_DEFAULT);
		if (r != CUDA_SUCCESS)
			return broke_cu(h, err, errlen, r, "cuStreamWriteValue32 (trigger)", seq);
		/* Published after the trigger is queued (a failed queueing publishes nothing the
		 * dispatcher would wait for); release: the descriptor before the number. */
		__atomic_store_n(&h->published, (uint32_t)seq, __ATOMIC_SEQ_CST);
		if (__atomic_load_n(&h->disp_sleeping, __ATOMIC_SEQ_CST)) {
			__atomic_add_fetch(&h->wake_seq, 1, __ATOMIC_SEQ_CST);
			futex_wake(&h->wake_seq, 1);
		}
	}
	h->submitted = seq;
	*seq_out = seq;
	return 0;
}

int cpu_handoff_wait(struct cpu_handoff *h, uint64_t seq, void *d_out, char *err, size_t errlen)
{
	if (h->broken)
		return errorf(err, errlen, h->broken, "%s", h->broken_msg);
	assert(seq == h->waited + 1 && seq <= h->submitted);
	uint32_t slot = (uint32_t)(seq & 1);
	assert(h->out_bytes[slot] == 0 || d_out);
	if (h->poll_out) {
		/* The kernel waits for the job and reads its result (a job without a result: no bytes). */
		assert(((uintptr_t)d_out & 15) == 0 || h->out_bytes[slot] == 0);
		const size_t words = h->out_bytes[slot] / 16, tail = h->out_bytes[slot] % 16;
		wait_read_kernel<<<1, 1024, 0, h->stream>>>(
			(const uint32_t *)(uintptr_t)h->d_done[slot], (uint32_t)seq, (uint4 *)d_out,
			(const uint4 *)h->out_dev[slot], words, (unsigned char *)d_out + words * 16,
			(const unsigned char *)h->out_dev[slot] + words * 16, tail);
		cudaError_t e = cudaGetLastError();
		if (e != cudaSuccess)
			return broke(h, err, errlen, e, "the wait for the job and its result's read from host memory", seq);
		h->waited = seq;
		return 0;
	}
	if (h->mode == CPU_HANDOFF_HOSTFUNC) {
		cudaError_t e = cudaLaunchHostFunc(h->stream, hf_wait, h);
		if (e != cudaSuccess)
			return broke(h, err, errlen, e, "cudaLaunchHostFunc (wait)", seq);
	} else {
		/* The job stores seq with release order after its outputs; the copy below is queued
		 * behind the wait and reads them from host memory. CU_STREAM_WAIT_VALUE_FLUSH is not
		 * needed: it orders remote writes into device memory, and the outputs stay in host
		 * memory until this stream's own copy reads them. */
		CUresult r = h->wait32((CUstream)h->stream, h->d_done[slot], (uint32_t)seq, CU_STREAM_WAIT_VALUE_GEQ);
		if (r != CUDA_SUCCESS)
			return broke_cu(h, err, errlen, r, "cuStreamWaitValue32 (result)", seq);
	}
	if (h->out_bytes[slot] && h->mapped_out) {
		assert(((uintptr_t)d_out & 15) == 0);
		/* Read over the link by the kernel's loads, which no copy engine queue holds back. */
		const size_t words = h->out_bytes[slot] / 16, tail = h->out_bytes[slot] % 16;
		const unsigned blocks = (unsigned)((words + 255) / 256 < 64 ? (words + 255) / 256 : 64);
		read_mapped_kernel<<<blocks ? blocks : 1, 256, 0, h->stream>>>(
			(uint4 *)d_out, (const uint4 *)h->out_dev[slot], words, (unsigned char *)d_out + words * 16,
			(const unsigned char *)h->out_dev[slot] + words * 16, tail);
		cudaError_t e = cudaGetLastError();
		if (e != cudaSuccess)
			return broke(h, err, errlen, e, "the partial result's read from host memory", seq);
	} else if (h->out_bytes[slot]) {
		cudaError_t e = cudaMemcpyAsync(d_out, h->out[slot], h->out_bytes[slot], cudaMemcpyHostToDevice, h->stream);
		if (e != cudaSuccess)
			return broke(h, err, errlen, e, "the partial result's copy to the device", seq);
	}
	h->waited = seq;
	return 0;
}

int cpu_handoff_check(struct cpu_handoff *h, char *err, size_t errlen)
{
	if (h->broken)
		return errorf(err, errlen, h->broken, "%s", h->broken_msg);
	pthread_mutex_lock(&h->err_mu);
	int rc = h->err_rc;
	if (rc)
		errorf(err, errlen, rc, "%s", h->err_msg);
	h->err_rc = 0;
	h->err_msg[0] = '\0';
	pthread_mutex_unlock(&h->err_mu);
	return rc;
}

int cpu_handoff_settle(struct cpu_handoff *h, char *err, size_t errlen)
{
	if (h->broken)
		return 0;
	/* Every submit has its wait queued behind it (ffn_split pairs them), so once the stream is
	 * through, every job has stored its word, and job_done ran before that store. */
	cudaError_t e = cudaStreamSynchronize(h->stream);
	cpu_handoff_quiesce_prefetch(h, e != cudaSuccess);
	if (e != cudaSuccess)
		return errorf(err, errlen, -EIO, "cpu handoff: settle: the stream ended with %s", cudaGetErrorString(e));
	return cpu_handoff_check(h, err, errlen);
}

void cpu_handoff_get_stats(const struct cpu_handoff *ch, struct cpu_handoff_stats *out)
{
	struct cpu_handoff *h = (struct cpu_handoff *)ch;
	memset(out, 0, sizeof(*out));
	out->mode = h->mode;
	out->submitted = h->submitted;
	out->waited = h->waited;
	out->dispatched = __atomic_load_n(&h->n_dispatched, __ATOMIC_RELAXED);
	pthread_mutex_lock(&h->err_mu);
	out->failed = h->failed;
	pthread_mutex_unlock(&h->err_mu);
	out->ring_waits = h->ring_waits;
	out->timed = __atomic_load_n(&h->timed, __ATOMIC_RELAXED);
	out->dispatch_ns = __atomic_load_n(&h->dispatch_ns, __ATOMIC_RELAXED);
	out->dispatch_max_ns = __atomic_load_n(&h->dispatch_max_ns, __ATOMIC_RELAXED);
	out->gap_ns = __atomic_load_n(&h->gap_ns, __ATOMIC_RELAXED);
	out->gaps = __atomic_load_n(&h->gaps, __ATOMIC_RELAXED);
	out->host_late = __atomic_load_n(&h->host_late, __ATOMIC_RELAXED);
	out->stalls = __atomic_load_n(&h->stalls, __ATOMIC_RELAXED);
	out->by_poll = __atomic_load_n(&h->by_poll, __ATOMIC_RELAXED);
	out->by_workers = __atomic_load_n(&h->by_workers, __ATOMIC_RELAXED);
	out->prefetched = __atomic_load_n(&h->prefetched, __ATOMIC_RELAXED);
	out->stall_ns = __atomic_load_n(&h->stall_ns, __ATOMIC_RELAXED);
}

int cpu_handoff_job_ns(const struct cpu_handoff *h, uint64_t seq, uint64_t *job_ns)
{
	const struct handoff_desc *d = &h->ring[seq & (h->ring_n - 1)];
	if (d->task.seq != seq)
		return -ENOENT;
	const uint64_t end = __atomic_load_n(&d->t_end, __ATOMIC_ACQUIRE), first = __atomic_load_n(&d->t_first, __ATOMIC_RELAXED);
	if (!end)
		return -EAGAIN;
	*job_ns = first && end > first ? end - first : 0;
	return 0;
}

enum cpu_handoff_mode cpu_handoff_mode(const struct cpu_handoff *h)
{
	return h->mode;
}

/* cpu_handoff.h - a CUDA stream hands work to the CPU task pool (cpu-compute/task_pool.h) and
 * waits for the result on the GPU: the stream copies an activation down into pinned memory, a
 * job of the pool computes from it into a pinned partial result, and the stream, later, waits for
 * the job and copies the result up, where a kernel adds it. No host thread synchronises with the
 * stream on the way.
 *
 *   struct cpu_handoff_params hp = {.mode = CPU_HANDOFF_MEMOPS, .max_in_bytes = 16384,
 *                                   .max_out_bytes = 16384};
 *   rc = cpu_handoff_create(pool, stream, &hp, &h, err, sizeof(err));   // -ENOTSUP: try HOSTFUNC
 *   per layer, on the stream's own thread:
 *     struct cpu_handoff_job job = {.fn = ffn_rows, .user = &layer, .n_parts = 16,
 *                                   .in_bytes = 16384, .out_bytes = 16384};
 *     cpu_handoff_submit(h, d_x, &job, &seq, err, sizeof(err));   // D2H x, then the CPU starts
 *     ...queue the GPU's own share of the layer on the stream...
 *     cpu_handoff_wait(h, seq, d_partial, err, sizeof(err));      // GPU waits, then H2D
 *     ...a kernel adds d_partial...
 *   at the end of the step, once the host has synchronised for its own reasons (the token):
 *     rc = cpu_handoff_check(h, err, sizeof(err));   // a failed job fails the request here
 *
 * Handoffs are numbered 1, 2, ... (seq); handoff seq uses the pinned pair of slot seq & 1, so the
 * next one can be submitted (its D2H queued) before this one is waited for: at most two are
 * between submit and wait at any time, and waits come in submit order.
 *
 * Two mechanisms (docs/design.md, "CPU compute pool and the handoff"):
 *  - CPU_HANDOFF_HOSTFUNC: after the D2H copy, cudaLaunchHostFunc runs a host function that
 *    submits the job; the wait is a second host function that returns once the job's completion
 *    word shows seq (it spins spin_us, then sleeps on a futex), holding back the stream behind it.
 *    The D2H bytes are visible to the host function because its start "has the same effect as
 *    synchronizing an event recorded in the same stream immediately prior to the function"
 *    (cudaLaunchHostFunc), and to the workers through the queue's release/acquire.
 *  - CPU_HANDOFF_MEMOPS: no host thread blocks inside a CUDA callback. After the D2H copy the
 *    stream writes seq into a word of mapped pinned memory (cuStreamWriteValue32, default flags:
 *    a memory fence before the write, "similar semantics to __threadfence_system() but scoped to
 *    the stream" (cuda.h), so the copied bytes are visible before the word); a dispatcher thread
 *    polls that word and submits the job; the job's completion stores seq into another mapped
 *    word with release order, and the stream waits on it with cuStreamWaitValue32
 *    (CU_STREAM_WAIT_VALUE_GEQ, a cyclic >= on numbers that only grow, so no word is ever reset).
 *    The dispatcher polls only while a handoff is submitted and not yet triggered (plus spin_us),
 *    and sleeps otherwise. Beside it, the thread that waits for the stream may poll the word too
 *    (cpu_handoff_poll), and so may the pool's idle workers while they spin between jobs
 *    (workers_dispatch): each job is taken by whichever sees its trigger first, so a dispatcher
 *    that the OS holds off its CPU is not the only thread that could hand it over. Needs the stream memory operations of the driver (v2, CUDA 12+) on
 *    host memory; cpu_handoff_create probes them on the stream and refuses with -ENOTSUP.
 *
 * Errors: a job that fails still completes (the stream never hangs on it); its message is kept,
 * and cpu_handoff_check returns it. A CUDA call that fails in submit or wait leaves the handoff
 * broken: that call and every later one return -EIO with the first message.
 *
 * Threads: submit, wait, check and stats are called from one thread, the one that drives the
 * stream (check may also be called from another thread while nothing is submitted). The pool
 * must outlive the handoff; destroy the handoff first.
 */
#ifndef GPU_RUNNER_CPU_HANDOFF_H
#define GPU_RUNNER_CPU_HANDOFF_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "services/gpu-runner/cpu-compute/task_pool.h"
#ifdef __cplusplus
extern "C" {
#endif

#define CPU_HANDOFF_ERR_MAX 512

enum cpu_handoff_mode {
	CPU_HANDOFF_HOSTFUNC = 0,
	CPU_HANDOFF_MEMOPS = 1,
};

/* What a part function of a handoff's job sees. The pointers are pinned host memory. */
struct cpu_handoff_task {
	const void *in;	  /* the activation the stream copied down, in_bytes */
	void *out;	  /* the partial result the stream copies up, out_bytes */
	size_t in_bytes;
	size_t out_bytes;
	uint64_t seq;	  /* this handoff's number */
	uint32_t slot;	  /* seq & 1: which pinned pair */
	void *user;	  /* cpu_handoff_job.user */
};

/* Runs part `part` of `n_parts` of a handoff's job (task_part_range splits rows). Returns 0 or
 * -errno with a message in err. */
typedef int (*cpu_handoff_fn)(const struct cpu_handoff_task *t, uint32_t part, uint32_t n_parts, char *err,
			      size_t errlen);

#define CPU_HANDOFF_PREFETCH_ARG 192 /* bytes of a job's read-ahead argument */
/* Brings bytes [offset, offset + bytes) of the job's weights (in the order its parts read them)
 * into the caches, from arg (the job's prefetch_arg, copied: it names memory that stays mapped).
 * Returns the bytes touched, 0 past the job's end. Reads only; never fails. */
typedef uint64_t (*cpu_handoff_prefetch_fn)(const void *arg, uint64_t offset, uint64_t bytes);

struct cpu_handoff_job {
	cpu_handoff_fn fn;
	void *user;
	/* NULL, or the job's read-ahead (params.prefetch_bytes): the pool's idle workers call it, a
	 * chunk at a time, between the job's submit and its dispatch, with a copy of prefetch_arg. */
	cpu_handoff_prefetch_fn prefetch;
	unsigned char prefetch_arg[CPU_HANDOFF_PREFETCH_ARG];
	uint32_t n_parts;  /* 1..TASK_POOL_MAX_PARTS (0: the job does nothing, the handoff still runs) */
	size_t in_bytes;   /* <= max_in_bytes; 0 copies nothing down */
	size_t out_bytes;  /* <= max_out_bytes; 0 copies nothing up */
};

struct cpu_handoff_params {
	enum cpu_handoff_mode mode;
	size_t max_in_bytes;  /* per slot */
	size_t max_out_bytes; /* per slot */
	uint32_t ring;	      /* handoffs the host may submit ahead of the CPU before submit waits
			       * for the oldest job (a power of two >= 2; 0: 64) */
	uint32_t spin_us;     /* a waiting host thread polls this long before it sleeps (0: 0) */
	int dispatcher_cpu;   /* memops: pin the dispatcher to this CPU; -1 (or any negative): don't */
	bool mapped_out;      /* the wait's result comes up by a kernel that reads the output slot in
			       * mapped host memory, not by cudaMemcpyAsync: a copy on the compute
			       * stream queues on the H2D engine behind weight copies issued before it
			       * (false: the copy) */
	bool poll_out;	      /* memops, mapped_out: that kernel waits for the job itself, polling the
			       * completion word in mapped memory, in place of cuStreamWaitValue32 */
	bool no_dispatcher;   /* memops: no dispatcher thread; jobs reach the pool only from
			       * cpu_handoff_poll, which the caller must keep calling while the stream
			       * runs, and a submit that waits for the ring hangs (tests of the poll) */
	bool workers_dispatch; /* memops: the pool's idle workers, while they spin between jobs, hand
				* it the jobs whose triggers have come, beside the dispatcher (the
				* pool's idle hook, task_pool_set_idle: the pool must have none) */
	uint64_t prefetch_bytes; /* with workers_dispatch: while the next job is submitted and not yet
				  * triggered, the idle workers read up to this many of its weight bytes
				  * into the caches (its prefetch function), so that its first parts
				  * find them there; 0: none */
};

struct cpu_handoff_stats {
	enum cpu_handoff_mode mode;
	uint64_t submitted;  /* handoffs queued on the stream */
	uint64_t waited;     /* waits queued */
	uint64_t dispatched; /* jobs handed to the pool (the stream reached them) */
	uint64_t failed;     /* jobs that failed */
	uint64_t ring_waits; /* submits that waited for the job a ring behind */
	/* The jobs' timing on the host's clock: */
	uint64_t timed;	     /* jobs completed (each timed) */
	uint64_t dispatch_ns, dispatch_max_ns; /* from the job's dispatch (the trigger seen, or the host
						* function run) to its first part's start: summed, the largest */
	uint64_t gap_ns, gaps; /* from a job's end to the next one's first part: the time the pool had
				* no job, summed, and their count (a token's ends among them; under 10 ms:
				* not a prefill's or the time between requests) */
	uint64_t host_late;  /* jobs dispatched within 5 us of their submit: the stream was there first */
	uint64_t stalls, stall_ns; /* memops: the dispatcher, waiting for a trigger, off its CPU 100 us
				    * or more at once: how often, and for how long in all */
	uint64_t by_poll;    /* memops: jobs dispatched from cpu_handoff_poll, not by the dispatcher */
	uint64_t by_workers; /* memops: jobs dispatched by the pool's idle workers (workers_dispatch) */
	uint64_t prefetched; /* weight bytes the idle workers read ahead (prefetch_bytes) */
};

struct cpu_handoff;

/* "hostfunc" / "memops". */
const char *cpu_handoff_mode_name(enum cpu_handoff_mode mode);
/* Parses "hostfunc" or "memops". Returns 0, or -EINVAL with a message in err. */
int cpu_handoff_parse_mode(const char *text, enum cpu_handoff_mode *out, char *err, size_t errlen);

/* Whether device can run CPU_HANDOFF_MEMOPS, before any stream is made: a driver of CUDA 12 or
 * later (the v2 stream memory operations), the device able to map host memory, and the driver
 * entry points found. Returns 0, or -ENOTSUP / -EIO with the reason in err. Touches CUDA (makes
 * the primary context current). */
int cpu_handoff_memops_supported(int device, char *err, size_t errlen);

/* The driver's cuStreamWaitValue32 (the v2 stream memory operations) in *fn, for a stream that
 * waits on a word of mapped pinned memory outside a handoff (cuda/moe.cu: the experts the CPU
 * computes). Checks what cpu_handoff_memops_supported does first. Returns 0, or -ENOTSUP / -EIO
 * with the reason in err. */
int cpu_handoff_wait_entry(int device, void **fn, char *err, size_t errlen);

/* Makes a handoff for `stream` (of the current device) onto `pool`: pinned buffers for two
 * slots, the completion words, the descriptor ring; for memops also the dispatcher thread, and a
 * probe of a write and a wait on the stream (synchronised: create is not on the token path).
 * Returns 0 and the handoff in *out (the caller owns it), or -EINVAL (a mode, size or ring it
 * cannot take), -ENOTSUP (memops not available here: the message says why), -ENOMEM, -EIO (a
 * CUDA call failed), with the message in err ("cpu handoff: ..."). */
int cpu_handoff_create(struct task_pool *pool, cudaStream_t stream, const struct cpu_handoff_params *params,
		       struct cpu_handoff **out, char *err, size_t errlen);
/* Synchronises the stream, stops the dispatcher, waits for every job handed to the pool, frees
 * everything; NULLs *h; safe on NULL and twice. */
void cpu_handoff_destroy(struct cpu_handoff **h);

/* Queues on the stream: the copy of job->in_bytes from d_in (device memory) into this handoff's
 * pinned slot, then the job's start. *seq gets the handoff's number, for cpu_handoff_wait. If the
 * host is `ring` handoffs ahead of the CPU it first waits for the job a ring behind (counted in
 * ring_waits). Returns 0, or -EIO (a CUDA call failed: the handoff is broken) with the message in
 * err. Submitting a third handoff before the first is waited for, or a job out of bounds, is a
 * programmer error (asserted). */
int cpu_handoff_submit(struct cpu_handoff *h, const void *d_in, const struct cpu_handoff_job *job, uint64_t *seq,
		       char *err, size_t errlen);
/* Queues on the stream: a wait for handoff seq's job, then the copy of its out_bytes into d_out
 * (device memory, 16-byte aligned with mapped_out: a kernel then reads them from host memory). Returns 0, or -EIO as submit. seq must be the oldest handoff submitted and not
 * waited for (asserted). */
int cpu_handoff_wait(struct cpu_handoff *h, uint64_t seq, void *d_out, char *err, size_t errlen);
/* The first failure since the last check: returns 0, or the failed job's -errno with "cpu
 * handoff: handoff N: part P of M: ..." in err, and forgets it (the count in stats stays). Call
 * it once the stream has passed the waits of the step (after the host's synchronisation). A
 * broken handoff returns -EIO with its first message every time. */
int cpu_handoff_check(struct cpu_handoff *h, char *err, size_t errlen);
/* After a step that failed on the way (the host never waited for it): waits for the stream and so
 * for every job handed over (their waits are queued), then returns and forgets their first
 * failure as cpu_handoff_check does. Not for the token path. A broken handoff is left broken (0). */
int cpu_handoff_settle(struct cpu_handoff *h, char *err, size_t errlen);
void cpu_handoff_get_stats(const struct cpu_handoff *h, struct cpu_handoff_stats *out);
/* memops: hands the pool the jobs whose triggers the stream has written, as the dispatcher does,
 * each job taken by whichever thread sees it first; for a thread that waits for the stream
 * anyway (the runner's, for a step's end), so that a dispatcher held off its CPU holds up a job only
 * where it was held off between taking it (the compare-and-swap) and handing it over.
 * Never blocks. Returns the jobs this call dispatched (0 with hostfunc). */
uint32_t cpu_handoff_poll(struct cpu_handoff *h);
/* Returns once no idle worker is reading a job's weights ahead (prefetch_bytes). For the thread
 * that drives the stream, at a step's end (the stream synchronised: every job of the step handed
 * over), or with stream_failed after the stream failed (its read-ahead then stops for good):
 * after it, the weights the step's jobs named may be unmapped. cpu_handoff_settle calls it. */
void cpu_handoff_quiesce_prefetch(struct cpu_handoff *h, bool stream_failed);
/* The time handoff seq's job took on the CPU (its first part's start to its end) into *job_ns.
 * Returns 0; -EAGAIN while it has not completed; -ENOENT once its descriptor was reused (a ring
 * later) or for a seq never submitted. */
int cpu_handoff_job_ns(const struct cpu_handoff *h, uint64_t seq, uint64_t *job_ns);
enum cpu_handoff_mode cpu_handoff_mode(const struct cpu_handoff *h);

#ifdef __cplusplus
}
#endif
#endif

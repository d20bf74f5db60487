/* bench-cpu-handoff: how long it takes to hand work from a CUDA stream to the CPU task pool and
 * back (services/gpu-runner/cuda/cpu_handoff.h), for both mechanisms, and what the pool alone
 * costs (services/gpu-runner/cpu-compute/task_pool.h). Prints tables meant to be read as they
 * are; docs/design.md ("CPU compute pool and the handoff") says what the numbers decide.
 *
 *   1. the pool alone, no CUDA: submit -> completion seen by the submitting thread (which spins
 *      on the completion word), back to back and after an idle gap longer than the workers' spin
 *      (so they must be woken from their futex), for an empty job and a job that reads
 *      --job-bytes; and the CPU an idle pool burns;
 *   2. GPU stream -> pool -> GPU stream: per round trip, GPU time from an event recorded before
 *      the activation's D2H copy to one after the partial result's H2D copy, every round trip
 *      queued ahead with no host synchronisation (as the token path runs); against the same two
 *      copies with no handoff; with the CPU cores busy (all threads of this process) meanwhile.
 *
 *   bench-cpu-handoff [--iters 2000] [--spin-us 0,50,1000] [--job-bytes 32MiB] [--vec-bytes 16KiB] ...
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <sched.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "common/config.h"
#include "common/util.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/cuda/cpu_handoff.h"

#define MAX_SPINS 8

#define CHECK_CUDA(call)                                                                                  \
	do {                                                                                              \
		cudaError_t e_ = (call);                                                                  \
		if (e_ != cudaSuccess) {                                                                  \
			fprintf(stderr, "bench-cpu-handoff: %s: %s\n", #call, cudaGetErrorString(e_));     \
			exit(1);                                                                          \
		}                                                                                         \
	} while (0)

struct opts {
	long iters, warmup, threads, cpu_offset, parts, gap_us, wait_spin_us, dispatcher_cpu;
	uint64_t job_bytes, vec_bytes, load_bytes;
	char *spins, *modes;
	bool no_pin;
	uint32_t spin[MAX_SPINS];
	int n_spin;
	bool mode_on[2];
};

/* ---- the jobs ---- */

/* The weights a sized job reads: ordinary (pageable) memory, as the weight ring is. */
static const float *g_weights;
static size_t g_weight_floats;
static volatile float g_sink;

/* Sums part's share of the weights (4 accumulators: memory-bound, as a GEMV slice is). */
static float read_share(uint32_t part, uint32_t n_parts)
{
	size_t b = g_weight_floats * part / n_parts, e = g_weight_floats * (part + 1) / n_parts;
	float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
	size_t i = b;
	for (; i + 4 <= e; i += 4) {
		s0 += g_weights[i];
		s1 += g_weights[i + 1];
		s2 += g_weights[i + 2];
		s3 += g_weights[i + 3];
	}
	for (; i < e; i++)
		s0 += g_weights[i];
	return s0 + s1 + s2 + s3;
}

static int empty_part(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	return 0;
}

static int sized_part(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	g_sink = read_share(part, n_parts);
	return 0;
}

static int empty_handoff(const struct cpu_handoff_task *t, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	return 0;
}

/* Reads the activation's first value and the part's share of the weights; writes its partial. */
static int sized_handoff(const struct cpu_handoff_task *t, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	float x = t->in_bytes >= sizeof(float) ? ((const float *)t->in)[0] : 0;
	float s = read_share(part, n_parts) * x;
	if ((part + 1) * sizeof(float) <= t->out_bytes)
		((float *)t->out)[part] = s;
	return 0;
}

/* ---- measuring ---- */

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

struct summary {
	double median, p99, mean, max;
};

static struct summary summarise(double *v, size_t n)
{
	struct summary s = {0};
	if (n == 0)
		return s;
	qsort(v, n, sizeof(*v), cmp_double);
	double sum = 0;
	for (size_t i = 0; i < n; i++)
		sum += v[i];
	s.median = v[n / 2];
	s.p99 = v[n * 99 / 100 < n ? n * 99 / 100 : n - 1];
	s.mean = sum / n;
	s.max = v[n - 1];
	return s;
}

static double cpu_seconds(void)
{
	struct rusage ru;
	getrusage(RUSAGE_SELF, &ru);
	return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

static void nap_us(long us)
{
	struct timespec ts = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
	nanosleep(&ts, NULL);
}

static struct task_pool *make_pool(const struct opts *o, uint32_t spin_us)
{
	struct task_pool_config cfg;
	task_pool_config_default(&cfg);
	cfg.threads = (uint32_t)o->threads;
	cfg.cpu_offset = (uint32_t)o->cpu_offset;
	cfg.pin = !o->no_pin;
	cfg.spin_us = spin_us;
	char err[256];
	struct task_pool *p = NULL;
	if (task_pool_create(&cfg, &p, err, sizeof(err)) != 0) {
		fprintf(stderr, "bench-cpu-handoff: %s\n", err);
		exit(1);
	}
	return p;
}

/* Section 1: one job at a time from this thread, which spins on the word. */
static struct summary pool_latency(const struct opts *o, struct task_pool *p, bool sized, long gap_us, double *v)
{
	static uint32_t done, waiters; /* long-lived, as the pool wants its words */
	uint32_t parts = (uint32_t)o->parts;
	size_t n = 0;
	for (long i = 0; i < o->warmup + o->iters; i++) {
		if (gap_us)
			nap_us(gap_us);
		struct task_job job;
		uint32_t value = done + 1;
		task_job_init(&job, sized ? sized_part : empty_part, NULL, parts, &done, value);
		job.done_waiters = &waiters;
		uint64_t t0 = now_ns();
		task_pool_submit(p, &job);
		task_word_wait(&done, &waiters, value, 1000000, 0);
		uint64_t t1 = now_ns();
		if (i >= o->warmup)
			v[n++] = (t1 - t0) / 1e3;
	}
	return summarise(v, n);
}

struct gpu {
	cudaStream_t stream;
	cudaEvent_t *ev_a, *ev_b; /* iters each */
	void *d_in, *d_out, *h_in, *h_out;
	/* Section 3: weight copies on a stream of their own, one queued with each round trip. */
	cudaStream_t load;
	void *load_h, *load_d;
	bool mapped;	    /* the handoff's result read from mapped host memory (mapped_out) */
	bool loaded;	    /* a load copy with each round trip */
};

/* Section 2: `mode` < 0 is the copies alone. Returns the GPU-time summary; *cores gets the CPU
 * time of this process over the wall time of the measured loop. */
static struct summary gpu_latency(const struct opts *o, struct gpu *g, struct task_pool *pool, int mode, bool sized,
				  double *v, double *cores, char *why, size_t whylen)
{
	struct summary bad = {-1, -1, -1, -1};
	char err[CPU_HANDOFF_ERR_MAX];
	struct cpu_handoff *h = NULL;
	if (mode >= 0) {
		struct cpu_handoff_params hp = {.mode = (enum cpu_handoff_mode)mode,
						.max_in_bytes = o->vec_bytes,
						.max_out_bytes = o->vec_bytes,
						.ring = 64,
						.spin_us = (uint32_t)o->wait_spin_us,
						.dispatcher_cpu = (int)o->dispatcher_cpu,
						.mapped_out = g->mapped};
		int rc = cpu_handoff_create(pool, g->stream, &hp, &h, err, sizeof(err));
		if (rc) {
			snprintf(why, whylen, "%s", err);
			return bad;
		}
	}
	struct cpu_handoff_job job = {.fn = sized ? sized_handoff : empty_handoff,
				      .n_parts = (uint32_t)o->parts,
				      .in_bytes = o->vec_bytes,
				      .out_bytes = o->vec_bytes};
	CHECK_CUDA(cudaStreamSynchronize(g->stream));
	double c0 = 0;
	uint64_t w0 = 0;
	for (long i = 0; i < o->warmup + o->iters; i++) {
		long k = i - o->warmup;
		if (k == 0) {
			/* The warm-up ran out first: the measured loop starts on an idle stream. */
			CHECK_CUDA(cudaStreamSynchronize(g->stream));
			c0 = cpu_seconds();
			w0 = now_ns();
		}
		if (g->loaded) /* as the weight window's prefetch: a large H2D copy always queued */
			CHECK_CUDA(cudaMemcpyAsync(g->load_d, g->load_h, o->load_bytes, cudaMemcpyHostToDevice, g->load));
		if (k >= 0)
			CHECK_CUDA(cudaEventRecord(g->ev_a[k], g->stream));
		if (mode < 0) {
			CHECK_CUDA(cudaMemcpyAsync(g->h_in, g->d_in, o->vec_bytes, cudaMemcpyDeviceToHost, g->stream));
			CHECK_CUDA(cudaMemcpyAsync(g->d_out, g->h_out, o->vec_bytes, cudaMemcpyHostToDevice, g->stream));
		} else {
			uint64_t seq;
			if (cpu_handoff_submit(h, g->d_in, &job, &seq, err, sizeof(err)) ||
			    cpu_handoff_wait(h, seq, g->d_out, err, sizeof(err))) {
				fprintf(stderr, "bench-cpu-handoff: %s\n", err);
				exit(1);
			}
		}
		if (k >= 0)
			CHECK_CUDA(cudaEventRecord(g->ev_b[k], g->stream));
	}
	CHECK_CUDA(cudaStreamSynchronize(g->stream));
	double wall = (now_ns() - w0) / 1e9;
	*cores = wall > 0 ? (cpu_seconds() - c0) / wall : 0;
	if (g->loaded) /* the load queued ahead (up to a ring of round trips): drained, not counted */
		CHECK_CUDA(cudaStreamSynchronize(g->load));
	for (long k = 0; k < o->iters; k++) {
		float ms = 0;
		CHECK_CUDA(cudaEventElapsedTime(&ms, g->ev_a[k], g->ev_b[k]));
		v[k] = ms * 1e3;
	}
	if (h) {
		if (cpu_handoff_check(h, err, sizeof(err)) != 0) {
			fprintf(stderr, "bench-cpu-handoff: a job failed: %s\n", err);
			exit(1);
		}
		cpu_handoff_destroy(&h);
	}
	return summarise(v, (size_t)o->iters);
}

/* ---- the report ---- */

static void cpu_model(char *buf, size_t len)
{
	snprintf(buf, len, "unknown CPU");
	FILE *f = fopen("/proc/cpuinfo", "r");
	if (!f)
		return;
	char line[512];
	while (fgets(line, sizeof(line), f)) {
		if (strncmp(line, "model name", 10) == 0) {
			char *c = strchr(line, ':');
			if (c) {
				c += 2;
				c[strcspn(c, "\n")] = '\0';
				snprintf(buf, len, "%s", c);
			}
			break;
		}
	}
	fclose(f);
}

static int parse_list(const char *text, uint32_t *out, int max)
{
	int n = 0;
	const char *p = text;
	while (*p && n < max) {
		char *end;
		long v = strtol(p, &end, 10);
		if (end == p || v < 0)
			return -1;
		out[n++] = (uint32_t)v;
		p = *end == ',' ? end + 1 : end;
		if (*end && *end != ',')
			return -1;
	}
	return n;
}

static void print_pool_info(struct task_pool *p, const struct opts *o)
{
	uint32_t n = task_pool_threads(p);
	printf("  pool: %u workers, %u parts per job, ", n, (uint32_t)o->parts);
	if (o->no_pin) {
		printf("not pinned\n");
		return;
	}
	printf("pinned to CPUs");
	for (uint32_t i = 0; i < n && i < 64; i++)
		printf("%s%d", i ? "," : " ", task_pool_worker_cpu(p, i));
	printf("%s\n", n > 64 ? ",..." : "");
}

int main(int argc, char **argv)
{
	struct opts o;
	memset(&o, 0, sizeof(o));
	const struct opt table[] = {
		{"iters", OPT_INT, &o.iters, "2000", "round trips (jobs) measured per line"},
		{"warmup", OPT_INT, &o.warmup, "200", "round trips run first and not counted"},
		{"threads", OPT_INT, &o.threads, "0", "pool workers (0: one per allowed CPU after --cpu-offset)"},
		{"cpu-offset", OPT_INT, &o.cpu_offset, "2",
		 "leave this many allowed CPUs to other threads (this one, CUDA's, the memops dispatcher)"},
		{"no-pin", OPT_BOOL, &o.no_pin, NULL, "do not pin the workers"},
		{"parts", OPT_INT, &o.parts, "0", "parts per job (0: one per worker)"},
		{"spin-us", OPT_STRING, &o.spins, "0,50,1000",
		 "pool workers' idle spin before they sleep, a comma list: every table is made for each"},
		{"wait-spin-us", OPT_INT, &o.wait_spin_us, "100",
		 "the handoff's host-side spin (hostfunc: the waiting host function; memops: the idle dispatcher)"},
		{"dispatcher-cpu", OPT_INT, &o.dispatcher_cpu, "-2",
		 "memops: pin the dispatcher to this CPU; -1: leave it unpinned; -2: the last CPU --cpu-offset leaves out"},
		{"gap-us", OPT_INT, &o.gap_us, "2000", "section 1: idle time between jobs for the woken-from-sleep lines"},
		{"job-bytes", OPT_SIZE, &o.job_bytes, "32MiB", "what a sized job reads, split over its parts"},
		{"vec-bytes", OPT_SIZE, &o.vec_bytes, "16KiB",
		 "activation copied down and partial result copied up per handoff (16 KiB: 8192 bf16)"},
		{"modes", OPT_STRING, &o.modes, "hostfunc,memops", "sections 2 and 3: which mechanisms"},
		{"load-bytes", OPT_SIZE, &o.load_bytes, "64MiB",
		 "section 3: the H2D weight copy queued on another stream with each round trip (0: no section 3)"},
		{0},
	};
	int rc = config_parse("bench-cpu-handoff",
			      "Latency of a GPU stream -> CPU task pool -> GPU stream handoff (hostfunc and memops), "
			      "and of the pool alone.",
			      table, argc, argv, NULL, NULL);
	if (rc > 0)
		return 0;
	if (rc < 0)
		return 2;
	o.n_spin = parse_list(o.spins, o.spin, MAX_SPINS);
	if (o.n_spin <= 0 || o.iters < 1 || o.warmup < 0 || o.threads < 0 || o.cpu_offset < 0 || o.parts < 0 ||
	    o.gap_us < 0 || o.wait_spin_us < 0 || o.vec_bytes < sizeof(float)) {
		fprintf(stderr, "bench-cpu-handoff: bad arguments (see --help)\n");
		return 2;
	}
	o.mode_on[CPU_HANDOFF_HOSTFUNC] = strstr(o.modes, "hostfunc") != NULL;
	o.mode_on[CPU_HANDOFF_MEMOPS] = strstr(o.modes, "memops") != NULL;

	/* CUDA first: its own threads inherit the affinity of the thread that starts it, and this
	 * one stays unpinned. */
	int ndev = 0;
	bool have_gpu = cudaGetDeviceCount(&ndev) == cudaSuccess && ndev > 0;
	if (have_gpu)
		CHECK_CUDA(cudaFree(0));

	cpu_set_t allowed;
	sched_getaffinity(0, sizeof(allowed), &allowed);
	if (o.dispatcher_cpu == -2) {
		o.dispatcher_cpu = -1;
		for (int c = 0, idx = 0; c < CPU_SETSIZE; c++)
			if (CPU_ISSET(c, &allowed) && idx++ == o.cpu_offset - 1)
				o.dispatcher_cpu = c;
	}
	char model[256];
	cpu_model(model, sizeof(model));
	struct task_pool *probe = make_pool(&o, 0);
	if (o.parts == 0)
		o.parts = task_pool_threads(probe);
	printf("bench-cpu-handoff: handing work from a CUDA stream to the CPU task pool and back\n");
	printf("  CPU: %s, %d CPUs allowed; this thread unpinned\n", model, CPU_COUNT(&allowed));
	print_pool_info(probe, &o);
	task_pool_destroy(&probe);
	printf("  jobs: \"empty\" parts return at once; \"read X\" parts sum their share of an X buffer of\n"
	       "  ordinary memory (memory-bound, like a GEMV slice); %ld measured after %ld warm-up each\n",
	       o.iters, o.warmup);

	g_weight_floats = o.job_bytes / sizeof(float);
	float *w = malloc(g_weight_floats ? g_weight_floats * sizeof(float) : sizeof(float));
	if (!w) {
		fprintf(stderr, "bench-cpu-handoff: out of memory for %llu bytes\n", (unsigned long long)o.job_bytes);
		return 1;
	}
	for (size_t i = 0; i < g_weight_floats; i++)
		w[i] = (float)(i & 7) * 0.125f;
	g_weights = w;
	char jb[32], vb[32];
	format_size(o.job_bytes, jb, sizeof(jb));
	format_size(o.vec_bytes, vb, sizeof(vb));

	double *v = malloc(sizeof(double) * (size_t)(o.iters + o.warmup));
	if (!v)
		return 1;

	/* ---- 1 ---- */
	printf("\n1. The pool alone, no CUDA: submit -> completion seen by the submitting thread (spinning on the word)\n");
	printf("   %-9s %-22s %-14s %10s %10s %10s\n", "pool spin", "between jobs", "job", "median us", "p99 us",
	       "mean us");
	for (int si = 0; si < o.n_spin; si++) {
		struct task_pool *p = make_pool(&o, o.spin[si]);
		for (int gap = 0; gap < 2; gap++)
			for (int sized = 0; sized < 2; sized++) {
				long gap_us = gap ? o.gap_us : 0;
				struct summary s = pool_latency(&o, p, sized, gap_us, v);
				char gtext[40], jtext[40];
				if (gap_us)
					snprintf(gtext, sizeof(gtext), "idle %ld us%s", gap_us,
						 gap_us > (long)o.spin[si] ? " (asleep)" : "");
				else
					snprintf(gtext, sizeof(gtext), "none (back to back)");
				snprintf(jtext, sizeof(jtext), sized ? "read %s" : "empty", jb);
				printf("   %-9u %-22s %-14s %10.1f %10.1f %10.1f\n", o.spin[si], gtext, jtext, s.median,
				       s.p99, s.mean);
			}
		/* What an idle pool burns: CPU time over a second after the spin has run out. */
		nap_us(o.spin[si] + 100000);
		double c0 = cpu_seconds();
		uint64_t t0 = now_ns();
		nap_us(1000000);
		double idle = (cpu_seconds() - c0) / ((now_ns() - t0) / 1e9);
		struct task_pool_stats st;
		task_pool_get_stats(p, &st);
		printf("   %-9u idle for 1 s: %.2f%% of one core used; %u of %u workers asleep\n", o.spin[si], idle * 100,
		       st.sleeping, st.threads);
		task_pool_destroy(&p);
	}

	/* ---- 2 ---- */
	printf("\n2. GPU stream -> pool -> GPU stream, per round trip: GPU time from an event before the D2H copy\n"
	       "   of the activation (%s) to one after the H2D copy of the partial result (%s); all round\n"
	       "   trips queued ahead, no host synchronisation between them. \"copies\": the same two copies, no\n"
	       "   handoff. \"- copies\": the round trip's median minus the copies' median. \"cores\": CPU time of\n"
	       "   this process / wall time while the round trips ran (spinning workers and dispatcher count).\n",
	       vb, vb);
	if (!have_gpu) {
		printf("   no CUDA device: skipped\n");
		free(v);
		free(w);
		return 0;
	}
	struct cudaDeviceProp prop;
	CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
	int drv = 0, can_map = 0, uva = 0, host_ptr = 0, flush = 0;
	cudaDriverGetVersion(&drv);
	cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory, 0);
	cudaDeviceGetAttribute(&uva, cudaDevAttrUnifiedAddressing, 0);
	cudaDeviceGetAttribute(&host_ptr, cudaDevAttrCanUseHostPointerForRegisteredMem, 0);
	cudaDeviceGetAttribute(&flush, cudaDevAttrCanFlushRemoteWrites, 0);
	char why[CPU_HANDOFF_ERR_MAX];
	int mrc = cpu_handoff_memops_supported(0, why, sizeof(why));
	printf("   GPU: %s, driver CUDA %d.%d; canMapHostMemory %d, unifiedAddressing %d, "
	       "canUseHostPointerForRegisteredMem %d, canFlushRemoteWrites %d\n",
	       prop.name, drv / 1000, drv % 1000 / 10, can_map, uva, host_ptr, flush);
	printf("   memops: %s\n", mrc == 0 ? "supported" : why);
	if (o.dispatcher_cpu >= 0)
		printf("   memops' dispatcher pinned to CPU %ld; ", o.dispatcher_cpu);
	else
		printf("   memops' dispatcher unpinned; ");
	printf("hostfunc's host functions run on CUDA's own thread (unpinned)\n");

	struct gpu g;
	memset(&g, 0, sizeof(g));
	CHECK_CUDA(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
	g.ev_a = calloc((size_t)o.iters, sizeof(cudaEvent_t));
	g.ev_b = calloc((size_t)o.iters, sizeof(cudaEvent_t));
	if (!g.ev_a || !g.ev_b)
		return 1;
	for (long k = 0; k < o.iters; k++) {
		CHECK_CUDA(cudaEventCreate(&g.ev_a[k]));
		CHECK_CUDA(cudaEventCreate(&g.ev_b[k]));
	}
	CHECK_CUDA(cudaMalloc(&g.d_in, o.vec_bytes));
	CHECK_CUDA(cudaMalloc(&g.d_out, o.vec_bytes));
	CHECK_CUDA(cudaMemset(g.d_in, 0, o.vec_bytes));
	CHECK_CUDA(cudaMallocHost(&g.h_in, o.vec_bytes));
	CHECK_CUDA(cudaMallocHost(&g.h_out, o.vec_bytes));
	memset(g.h_out, 0, o.vec_bytes);

	double cores = 0;
	struct summary copies = gpu_latency(&o, &g, NULL, -1, false, v, &cores, why, sizeof(why));
	printf("   %-9s %-9s %-14s %10s %10s %10s %10s %9s %6s\n", "mechanism", "pool spin", "job", "median us", "p99 us",
	       "mean us", "max us", "- copies", "cores");
	printf("   %-9s %-9s %-14s %10.1f %10.1f %10.1f %10.1f %9s %6.2f\n", "copies", "-", "-", copies.median, copies.p99,
	       copies.mean, copies.max, "-", cores);
	for (int si = 0; si < o.n_spin; si++) {
		struct task_pool *p = make_pool(&o, o.spin[si]);
		for (int mode = 0; mode < 2; mode++) {
			if (!o.mode_on[mode])
				continue;
			for (int sized = 0; sized < 2; sized++) {
				char jtext[40];
				snprintf(jtext, sizeof(jtext), sized ? "read %s" : "empty", jb);
				struct summary s = gpu_latency(&o, &g, p, mode, sized, v, &cores, why, sizeof(why));
				if (s.median < 0) {
					printf("   %-9s %-9u %-14s refused: %s\n", cpu_handoff_mode_name(mode), o.spin[si],
					       jtext, why);
					break;
				}
				printf("   %-9s %-9u %-14s %10.1f %10.1f %10.1f %10.1f %9.1f %6.2f\n",
				       cpu_handoff_mode_name(mode), o.spin[si], jtext, s.median, s.p99, s.mean, s.max,
				       s.median - copies.median, cores);
			}
		}
		task_pool_destroy(&p);
	}
	printf("\n   Read \"- copies\" with an empty job as the cost of the handoff itself (trigger, dispatch,\n"
	       "   wake-up, completion, the stream's wait); with a sized job it adds the job's own time\n"
	       "   (section 1, back to back, same spin).\n");

	/* ---- 3 ---- */
	if (o.load_bytes) {
		char lb[32];
		format_size(o.load_bytes, lb, sizeof(lb));
		printf("\n3. The same round trips (job \"read %s\", pool spin %u) with an H2D copy of %s queued on another\n"
		       "   stream before each, as the weight window's copies run beside a split FFN; the result comes up\n"
		       "   by cudaMemcpyAsync on the round trip's stream (\"copy\") or by a kernel reading it from mapped\n"
		       "   host memory (\"mapped\"). Round trips are paced by the load: the median is what one costs.\n",
		       jb, o.spin[0], lb);
		CHECK_CUDA(cudaStreamCreateWithFlags(&g.load, cudaStreamNonBlocking));
		CHECK_CUDA(cudaMallocHost(&g.load_h, o.load_bytes));
		CHECK_CUDA(cudaMalloc(&g.load_d, o.load_bytes));
		memset(g.load_h, 1, o.load_bytes);
		printf("   %-9s %-7s %-6s %10s %10s %10s %10s %6s\n", "mechanism", "result", "load", "median us", "p99 us",
		       "mean us", "max us", "cores");
		struct task_pool *p = make_pool(&o, o.spin[0]);
		for (int mode = 0; mode < 2; mode++) {
			if (!o.mode_on[mode])
				continue;
			for (int loaded = 0; loaded < 2; loaded++)
				for (int mapped = 0; mapped < 2; mapped++) {
					g.loaded = loaded;
					g.mapped = mapped;
					struct summary s = gpu_latency(&o, &g, p, mode, true, v, &cores, why, sizeof(why));
					if (s.median < 0) {
						printf("   %-9s %-7s %-6s refused: %s\n", cpu_handoff_mode_name(mode),
						       mapped ? "mapped" : "copy", loaded ? lb : "none", why);
						continue;
					}
					printf("   %-9s %-7s %-6s %10.1f %10.1f %10.1f %10.1f %6.2f\n", cpu_handoff_mode_name(mode),
					       mapped ? "mapped" : "copy", loaded ? lb : "none", s.median, s.p99, s.mean, s.max,
					       cores);
				}
		}
		task_pool_destroy(&p);
		g.loaded = g.mapped = false;
		cudaFreeHost(g.load_h);
		cudaFree(g.load_d);
		cudaStreamDestroy(g.load);
	}

	for (long k = 0; k < o.iters; k++) {
		cudaEventDestroy(g.ev_a[k]);
		cudaEventDestroy(g.ev_b[k]);
	}
	free(g.ev_a);
	free(g.ev_b);
	cudaFree(g.d_in);
	cudaFree(g.d_out);
	cudaFreeHost(g.h_in);
	cudaFreeHost(g.h_out);
	cudaStreamDestroy(g.stream);
	free(v);
	free(w);
	return 0;
}

/* cpu_share.c - the gpu-runner's CPU share of streamed FFNs (--cpu-share, --cpu-threads,
 * --cpu-handoff): the flags, the task pool of its workers, with the C backend and a fixed share
 * the split of every FFN (the GPU window plans the CUDA backend's: gpu_window.h), the window's
 * split planned anew between requests from the rate its jobs ran at (auto), and the rate its routes
 * weigh the CPU's experts with taken from the rate they ran at. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "services/gpu-runner/cpu-compute/ffn_share.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/runner.h"
#include "services/gpu-runner/weights_ring.h"
#ifdef PIPELINE_HAVE_CUDA
#include "services/gpu-runner/gpu_window.h"
#endif

#define CPU_PREFETCH_MAX (4ull << 30) /* --cpu-prefetch: more than any cache */
/* --cpu-prefetch auto: on H200 hosts (300 MiB of L3) P3's decode read 22-23 MB of each split FFN's
 * CPU share ahead in the 330-370 us the pool waits between two, and came within 0.99-1.05 of its
 * limit in all seven runs on three hosts against 0.89-1.20 without; P1 1.004-1.006 (docs/
 * benchmarks.md, 2026-12-03, eighth session). 48MiB read 25-27 MB and took the idle workers from
 * their dispatching (0.95-1.10). */
#define CPU_PREFETCH_AUTO (24ull << 20)

/* auto's read-ahead: CPU_PREFETCH_AUTO, at most half the L3 cache where the C library knows its
 * size (bytes read ahead that the job's own reads would evict again gain nothing; where it reports
 * one core complex's L3, the cap is that complex's). */
static uint64_t cpu_prefetch_auto(void)
{
	long llc = 0;
#ifdef _SC_LEVEL3_CACHE_SIZE
	llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
	uint64_t bytes = CPU_PREFETCH_AUTO;
	if (llc > 0 && (uint64_t)llc / 2 < CPU_PREFETCH_AUTO)
		bytes = (uint64_t)llc / 2 / 4096 * 4096;
	char a[32], b[32];
	log_info("--cpu-prefetch auto: up to %s of each split FFN's CPU share read ahead where FFNs split (L3: %s)",
		 format_size(bytes, a, sizeof(a)), llc > 0 ? format_size((uint64_t)llc, b, sizeof(b)) : "not known");
	return bytes;
}

/* --cpu-prefetch into r->cpu_prefetch: auto's size where the idle workers dispatch (none elsewhere),
 * or a size given, refused where nothing would read it ahead. disp: --cpu-dispatch as given. */
static int parse_prefetch(struct runner *r, const char *disp, char *err, size_t errlen)
{
	const char *pf = r->cpu_prefetch_arg ? r->cpu_prefetch_arg : "auto";
	if (!strcmp(pf, "auto")) {
		/* Only where the idle workers have turns and a trigger to watch: else none, quietly. */
		r->cpu_prefetch = r->cpu_handoff != BACKEND_HANDOFF_HOSTFUNC && r->cpu_dispatch_workers
					  ? cpu_prefetch_auto() : 0;
		return 0;
	}
	if (parse_size(pf, &r->cpu_prefetch))
		return errorf(err, errlen, -EINVAL, "--cpu-prefetch '%s' is not auto or a size (e.g. 24MiB)", pf);
	if (r->cpu_prefetch > CPU_PREFETCH_MAX)
		return errorf(err, errlen, -EINVAL, "--cpu-prefetch %llu bytes: expected at most 4GiB",
			      (unsigned long long)r->cpu_prefetch);
	if (r->cpu_prefetch && r->cpu_handoff == BACKEND_HANDOFF_HOSTFUNC)
		return errorf(err, errlen, -EINVAL, "--cpu-prefetch reads ahead in the idle workers' turns, which "
			      "memops handoffs give them, not hostfunc");
	if (r->cpu_prefetch && !r->cpu_dispatch_workers)
		return errorf(err, errlen, -EINVAL, "--cpu-prefetch reads ahead in the idle workers' turns: it needs "
			      "--cpu-dispatch workers or all, not %s", disp);
	return 0;
}

int runner_parse_cpu_flags(struct runner *r, char *err, size_t errlen)
{
	int rc = cpu_share_parse(r->cpu_share_arg, &r->cpu_share, err, errlen);
	if (rc)
		return rc;
	if (r->cpu_threads < 0 || r->cpu_threads > TASK_POOL_MAX_THREADS)
		return errorf(err, errlen, -EINVAL,
			      "--cpu-threads %ld is out of range: 0 (one per CPU the runner may use, but one or two) to %u",
			      r->cpu_threads, TASK_POOL_MAX_THREADS);
	const char *h = r->cpu_handoff_arg ? r->cpu_handoff_arg : "auto";
	if (!strcmp(h, "auto"))
		r->cpu_handoff = BACKEND_HANDOFF_DEFAULT;
	else if (!strcmp(h, "memops"))
		r->cpu_handoff = BACKEND_HANDOFF_MEMOPS;
	else if (!strcmp(h, "hostfunc"))
		r->cpu_handoff = BACKEND_HANDOFF_HOSTFUNC;
	else
		return errorf(err, errlen, -EINVAL, "--cpu-handoff '%s' is not auto, memops or hostfunc", h);
	const char *res = r->cpu_result_arg ? r->cpu_result_arg : "mapped";
	if (strcmp(res, "copy") && strcmp(res, "mapped") && strcmp(res, "polled"))
		return errorf(err, errlen, -EINVAL, "--cpu-result '%s' is not mapped, polled or copy", res);
	r->cpu_result_mapped = strcmp(res, "copy") != 0;
	r->cpu_result_polled = !strcmp(res, "polled");
	/* workers by default: on an H200 host P3's hand-offs of 1 ms and more (the dispatcher held off
	 * its CPU) went from 4 in 660 to none, its ms/token alike (docs/benchmarks.md, 2026-12-03,
	 * seventh session). */
	const char *disp = r->cpu_dispatch_arg ? r->cpu_dispatch_arg : "workers";
	if (strcmp(disp, "dispatcher") && strcmp(disp, "both") && strcmp(disp, "workers") && strcmp(disp, "all"))
		return errorf(err, errlen, -EINVAL, "--cpu-dispatch '%s' is not dispatcher, both, workers or all", disp);
	r->cpu_dispatch_poll = !strcmp(disp, "both") || !strcmp(disp, "all");
	r->cpu_dispatch_workers = !strcmp(disp, "workers") || !strcmp(disp, "all");
	/* layer by default: on an H200 host it came within 1.05-1.08x of P1's and P3's limits where one
	 * share for the token came within 1.16-1.26x (docs/benchmarks.md, 2026-11-29 night). */
	const char *bal = r->cpu_share_balance_arg ? r->cpu_share_balance_arg : "layer";
	if (strcmp(bal, "token") && strcmp(bal, "layer"))
		return errorf(err, errlen, -EINVAL, "--cpu-share-balance '%s' is not token or layer", bal);
	r->cpu_share.per_layer = !strcmp(bal, "layer");
	if (r->cpu_share_balance_arg && r->cpu_share.mode != CPU_SHARE_AUTO)
		log_warn("--cpu-share-balance %s chooses among auto's shares; with --cpu-share %s it changes nothing", bal,
			 r->cpu_share_arg ? r->cpu_share_arg : "?");
	const char *ex = r->cpu_experts_arg ? r->cpu_experts_arg : "route";
	if (strcmp(ex, "visit") && strcmp(ex, "route"))
		return errorf(err, errlen, -EINVAL, "--cpu-experts '%s' is not route or visit", ex);
	r->cpu_experts_early = !strcmp(ex, "route");
	const char *sp = r->split_experts_arg ? r->split_experts_arg : "auto";
	if (strcmp(sp, "auto") && strcmp(sp, "always") && strcmp(sp, "off"))
		return errorf(err, errlen, -EINVAL, "--split-experts '%s' is not auto, always or off", sp);
	r->split_experts = !strcmp(sp, "off") ? 0 : !strcmp(sp, "auto") ? 1 : 2;
	const char *ch = r->cpu_expert_chunks_arg ? r->cpu_expert_chunks_arg : "taper";
	if (strcmp(ch, "taper") && strcmp(ch, "equal"))
		return errorf(err, errlen, -EINVAL, "--cpu-expert-chunks '%s' is not taper or equal", ch);
	r->cpu_expert_taper = !strcmp(ch, "taper");
	/* true/false and 1/0 as the flag took them when it was a switch (PIPELINE_GPU_RUNNER_WINDOW_SPREAD=1) */
	const char *spread = r->window_spread_arg ? r->window_spread_arg : "auto";
	const bool yes = !strcmp(spread, "yes") || !strcmp(spread, "true") || !strcmp(spread, "1");
	const bool no = !strcmp(spread, "no") || !strcmp(spread, "false") || !strcmp(spread, "0");
	if (!yes && !no && strcmp(spread, "auto"))
		return errorf(err, errlen, -EINVAL, "--window-spread '%s' is not auto, yes or no", spread);
	r->window_spread = no ? 0 : yes ? 2 : 1;
	const char *pin = r->cpu_pin_runner_arg ? r->cpu_pin_runner_arg : "yes";
	if (strcmp(pin, "yes") && strcmp(pin, "no"))
		return errorf(err, errlen, -EINVAL, "--cpu-pin-runner '%s' is not yes or no", pin);
	r->cpu_pin_runner = !strcmp(pin, "yes");
	if (r->cpu_expert_chunk < FFN_SHARE_CHUNK_MIN || r->cpu_expert_chunk > FFN_SHARE_CHUNK_MAX)
		return errorf(err, errlen, -EINVAL, "--cpu-expert-chunk %llu bytes: expected 16KiB to 16MiB",
			      (unsigned long long)r->cpu_expert_chunk);
	const char *pp = r->cpu_prefetch_plan_arg ? r->cpu_prefetch_plan_arg : "no";
	if (strcmp(pp, "yes") && strcmp(pp, "no"))
		return errorf(err, errlen, -EINVAL, "--cpu-prefetch-plan '%s' is not yes or no", pp);
	rc = parse_prefetch(r, disp, err, errlen);
	if (rc)
		return rc;
	/* auto's balance counts the read-ahead only where asked (not measured yet) and where it reads. */
	r->cpu_share.prefetch_bytes = !strcmp(pp, "yes") ? r->cpu_prefetch : 0;
	if (!strcmp(pp, "yes") && !r->cpu_prefetch)
		log_info("--cpu-prefetch-plan yes counts nothing: nothing is read ahead (--cpu-prefetch 0, or the "
			 "idle workers do not dispatch)");
	return 0;
}

/* The C backend with a fixed share: every FFN splits, at the same fraction of its rows. */
static int plan_cpu_backend(struct runner *r, char *err, size_t errlen)
{
	const struct weight_source *ws = ring_source_base(r->ring);
	const struct model_config *c = &r->cfg;
	static const enum tensor_role mats[3] = {ROLE_W_GATE, ROLE_W_UP, ROLE_W_DOWN};
	struct split_layer *ly = calloc(c->n_layers, sizeof(*ly));
	r->cpu_split_r = calloc(c->n_layers, sizeof(uint32_t));
	if (!ly || !r->cpu_split_r) {
		free(ly);
		return errorf(err, errlen, -ENOMEM, "out of memory");
	}
	for (uint32_t l = 0; l < c->n_layers; l++) {
		ly[l].eligible = true;
		for (int i = 0; i < 3; i++) {
			int ti = model_find_tensor(c, ws->tensors, ws->groups, model_group_ffn(c, l), mats[i]);
			ly[l].eligible = ly[l].eligible && ti >= 0 && ws->tensors[ti].dtype < DT_COUNT;
			ly[l].format[i] = ti >= 0 ? ws->tensors[ti].dtype : DT_COUNT;
			ly[l].bytes[i] = ti >= 0 ? ws->tensors[ti].nbytes : 0;
		}
		if (ly[l].eligible && c->ffn_dim % ffn_split_unit((enum dtype)ly[l].format[2]))
			ly[l].eligible = false;
	}
	struct split_plan plan = {.r = r->cpu_split_r};
	int rc = split_plan_choose(c, ly, 0, 0, &r->cpu_share, &plan, err, errlen);
	free(ly);
	if (rc)
		return rc;
	r->cpu_split_bytes = plan.cpu_bytes;
	char b[32];
	log_info("cpu share: the cpu backend computes rows [r, %u) of %u FFNs (r %u..%u) with cpu-compute on %u "
		 "threads in decode steps: %s a token", c->ffn_dim, plan.split_layers, plan.r_min, plan.r_max,
		 task_pool_threads(r->cpu_pool), format_size(plan.cpu_bytes, b, sizeof(b)));
	return 0;
}

#define CPU_SHARE_GPU_SPIN_US 1000u /* the pool's idle polling beside a GPU (task_pool.h spin_us) */

int runner_setup_cpu_share(struct runner *r, char *err, size_t errlen)
{
	bool cpu_backend = !strcmp(r->backend_name, "cpu");
	if (r->cpu_share.mode == CPU_SHARE_AUTO && cpu_backend) {
		/* Nothing streams to a GPU: the C backend computes every layer on the CPU already. */
		log_info("cpu share: auto splits no FFN on the cpu backend (a fraction in --cpu-share does)");
		r->cpu_share.mode = CPU_SHARE_OFF;
	}
	if (r->cpu_share.mode == CPU_SHARE_OFF)
		return 0;
	cpu_set_t set;
	uint32_t allowed = sched_getaffinity(0, sizeof(set), &set) == 0 ? (uint32_t)CPU_COUNT(&set) : 1;
	struct task_pool_config pc;
	task_pool_config_default(&pc);
	/* Several runners on this host (--ranks, each run with the same flags): each takes its own
	 * slice of the CPUs allowed, rank r the r-th of --ranks, so that their workers are not pinned
	 * two and more a CPU (a preempted worker holds up its job). */
	int slice[CPU_SETSIZE];
	bool sliced = false;
	if (r->ranks > 1 && allowed >= (uint32_t)r->ranks) {
		const uint32_t per = allowed / (uint32_t)r->ranks, first = (uint32_t)r->rank * per;
		uint32_t n = 0, at = 0;
		for (int c = 0; c < CPU_SETSIZE && n < per; c++)
			if (CPU_ISSET(c, &set) && at++ >= first)
				slice[n++] = c;
		allowed = n;
		sliced = true;
	}
	/* The first CPU allowed stays with the runner's own thread (it drives the stream), the second
	 * with the handoff's dispatcher on the CUDA backend (it spins while a handoff is in flight): a
	 * worker sharing a CPU with either is preempted and holds up its job. */
	const uint32_t keep = cpu_backend ? 1 : 2;
	pc.cpu_offset = allowed > keep ? keep : 0;
	if (sliced) {
		/* This rank's slice as the workers' CPUs, its first keep left to its own threads. */
		pc.cpus = slice + pc.cpu_offset;
		pc.n_cpus = allowed - pc.cpu_offset;
		pc.cpu_offset = 0;
	}
	pc.threads = r->cpu_threads ? (uint32_t)r->cpu_threads : allowed > keep ? allowed - keep : 1;
	if (r->cpu_threads && allowed > keep && pc.threads > allowed - keep)
		log_warn("cpu share: --cpu-threads %u is more than the %u CPUs left beside the runner's thread%s: "
			 "workers %u and on share those %u CPUs, where a preempted worker holds up its job",
			 pc.threads, allowed - keep, keep > 1 ? " and the handoff's dispatcher" : "", allowed - keep,
			 allowed - keep);
	/* With the GPU, a decode token hands the pool a job per split FFN (or a layer's experts) with
	 * the GPU's part of a layer in between, 0.1-0.3 ms (P1 on an H200 host: 140 us a layer): workers
	 * that slept there were woken one futex call each at every job. They keep polling through such
	 * gaps on CPUs of their own; a pool idle longer sleeps as before. */
	if (!cpu_backend && allowed > keep && pc.threads <= allowed - keep)
		pc.spin_us = CPU_SHARE_GPU_SPIN_US;
	char why[256];
	int rc = task_pool_create(&pc, &r->cpu_pool, why, sizeof(why));
	if (rc)
		return errorf(err, errlen, rc, "cpu share: %s", why);
	/* The runner's thread onto the CPUs kept for it: left to the scheduler, it was seen (M1 on an
	 * H200 host, /proc's samples) running on a worker's CPU through decode, the two sharing it. Its
	 * threads made from here on (the driver's) inherit the mask. Not onto the first CPU alone,
	 * leaving the second to the handoff's dispatcher: so pinned, P1 on an H200 host took 103.2
	 * ms/token against 66-67, the dispatcher held off its CPU 239 times for 887 ms in all while it
	 * waited for triggers (the threads made before, and the other services', went there). */
	if (!cpu_backend && r->cpu_pin_runner && allowed > keep) {
		cpu_set_t own;
		CPU_ZERO(&own);
		uint32_t n = 0;
		for (int c = 0; c < CPU_SETSIZE && n < keep; c++) {
			if (sliced ? c == slice[n] : CPU_ISSET(c, &set)) {
				CPU_SET(c, &own);
				n++;
			}
		}
		int e = pthread_setaffinity_np(pthread_self(), sizeof(own), &own);
		if (e != 0)
			log_warn("cpu share: cannot keep the runner's thread on its %u CPUs (%s): it runs where the "
				 "scheduler puts it", keep, strerror(e));
		else
			log_info("cpu share: the runner's thread kept on its %u CPU%s beside the workers'", keep,
				 keep == 1 ? "" : "s");
	}
	char share[32];
	log_info("cpu share %s: %u worker threads, %u CPUs allowed%s",
		 cpu_share_text(&r->cpu_share, share, sizeof(share)), task_pool_threads(r->cpu_pool), allowed,
		 sliced ? " (this rank's slice of the host's)" : "");
	return cpu_backend ? plan_cpu_backend(r, err, errlen) : 0;
}

/* ---- the split planned anew from its jobs ---- */

#define SPLIT_REPLANS_MAX 3 /* a runner's windows made anew for the rate at most (no see-saw) */

static struct split_jobs jobs_now(struct runner *r)
{
	struct backend_cpu_share_stats bs;
	backend_get_cpu_share_stats(r->be, &bs);
	return (struct split_jobs){.jobs = bs.jobs, .bytes = bs.bytes, .ns = (uint64_t)(bs.cpu_ms * 1e6)};
}

void runner_split_mark(struct runner *r)
{
	if (r->be)
		r->split_base = jobs_now(r);
}

void runner_replan_split(struct runner *r)
{
#ifdef PIPELINE_HAVE_CUDA
	/* Auto on a dense model of one runner, over a ring whose loader is there (as for the experts). */
	if (!r->win || !r->be || r->cpu_share.mode != CPU_SHARE_AUTO || r->fixed_split || r->cfg.n_experts ||
	    r->ranks > 1 || r->loader_suspect || r->split_replans >= SPLIT_REPLANS_MAX || !ring_source_owner_alive(r->ring) ||
	    ring_source_reconnected(r->ring))
		return;
	struct gpu_window_stats ws;
	gpu_window_stats(r->win, &ws);
	const struct split_jobs now = jobs_now(r);
	if (now.jobs < r->split_base.jobs || now.bytes < r->split_base.bytes || now.ns < r->split_base.ns) {
		r->split_base = now; /* counters that went back: counted afresh */
		return;
	}
	struct split_jobs seen = {now.jobs - r->split_base.jobs, now.bytes - r->split_base.bytes,
				  now.ns - r->split_base.ns};
	const double k = split_jobs_factor(&seen, ws.split_groups, ws.cpu_bytes_per_token, ws.cpu_jobs_ms * 1e-3);
	if (!(k > 0))
		return;
	if (fabs(k - 1) < SPLIT_REPLAN_MIN_CHANGE) {
		r->split_base = now; /* as planned: the next stretch is asked anew */
		return;
	}
	struct cpu_share_policy pol = r->cpu_share;
	for (uint32_t f = 0; f < DT_COUNT; f++)
		pol.cpu_bytes_per_s[f] = gpu_window_cpu_rate(r->win, (enum dtype)f) * k;
	pol.rates_known = true;
	pol.h2d_beside_bytes_per_s = ws.h2d_beside_cpu_bytes_per_s;
	log_info("cpu share: %llu jobs read %.2f GB in %.1f ms, %.1f GB/s: %.2fx the rate the split was planned with; "
		 "making the weight window anew with it", (unsigned long long)seen.jobs, (double)seen.bytes / 1e9,
		 (double)seen.ns / 1e6, (double)seen.bytes / ((double)seen.ns * 1e-9) / 1e9, k);
	r->cpu_share = pol;
	if (runner_window_anew(r, "cpu share"))
		r->split_replans++;
#else
	(void)r;
#endif
}

/* ---- the CPU's experts weighed at the rate they ran at ---- */

/* The backend's spans of one kind of step: one-token steps (with the gaps between layers', every
 * step's), or steps of several tokens (multi; no gaps). */
static struct expert_spans spans_now(struct runner *r, bool multi)
{
	struct backend_cpu_share_stats bs;
	backend_get_cpu_share_stats(r->be, &bs);
	if (multi)
		return (struct expert_spans){.layers = bs.expert_layers_multi,
					     .bytes = bs.experts_span_bytes_multi,
					     .ms = bs.experts_span_ms_multi};
	return (struct expert_spans){.layers = bs.expert_layers,
				     .bytes = bs.experts_span_bytes,
				     .ms = bs.experts_span_ms,
				     .gaps = bs.expert_gaps + bs.expert_step_gaps,
				     .gap_ms = bs.experts_gap_gpu_ms + bs.experts_gap_host_ms + bs.experts_step_gap_ms};
}

/* One kind of step's spans since *base: once EXPERT_RATE_MIN_LAYERS layers have run, their rate
 * folded into *rate (expert_rate_fold) and the layers, bytes and time of *base moved up; once
 * EXPERT_LEAD_MIN_GAPS gaps have (one-token steps: a stretch of a few tokens has fewer), their
 * mean in *lead and the gaps of *base moved up. The stretch in *seen. Returns the rate the stretch ran
 * at, 0 while it says nothing yet. */
static double learn(struct runner *r, bool multi, struct expert_spans *base, double *rate, double *lead,
		    struct expert_spans *seen)
{
	const struct expert_spans now = spans_now(r, multi), *b = base;
	if (now.layers < b->layers || now.bytes < b->bytes || now.ms < b->ms || now.gaps < b->gaps ||
	    now.gap_ms < b->gap_ms) {
		*base = now; /* counters that went back: counted afresh */
		return 0;
	}
	*seen = (struct expert_spans){now.layers - b->layers, now.bytes - b->bytes, now.ms - b->ms,
				      now.gaps - b->gaps, now.gap_ms - b->gap_ms};
	const double gaps = expert_spans_lead(seen);
	if (gaps > 0) {
		*lead = gaps;
		base->gaps = now.gaps;
		base->gap_ms = now.gap_ms;
	}
	const double ran = expert_spans_rate(seen);
	if (!(ran > 0))
		return 0;
	base->layers = now.layers;
	base->bytes = now.bytes;
	base->ms = now.ms;
	*rate = expert_rate_fold(*rate, ran);
	return ran;
}

void runner_expert_rate(struct runner *r, bool in_request)
{
#ifdef PIPELINE_HAVE_CUDA
	/* A layer's span is the CPU's side of its route only where the CPU's experts go to the pool at
	 * the route (--cpu-experts route): handed over at their visits, it spans the GPU's experts too. */
	if (!r->win || !r->be || !r->cfg.n_experts || r->cpu_share.mode != CPU_SHARE_AUTO || r->fixed_split ||
	    !r->cpu_experts_early)
		return;
	for (int multi = 0; multi < 2; multi++) {
		const double before = gpu_window_expert_rate(r->win, multi ? 2 : 1);
		const bool first = !(multi ? r->expert_rate_multi : r->expert_rate);
		struct expert_spans seen = {0};
		double lead = 0; /* the gaps are one-token steps' (spans_now) */
		const double ran = learn(r, multi, multi ? &r->expert_base_multi : &r->expert_base,
					 multi ? &r->expert_rate_multi : &r->expert_rate, &lead, &seen);
		if (lead > 0)
			r->expert_lead = lead;
		if (!(ran > 0))
			continue;
		const double rate = multi ? r->expert_rate_multi : r->expert_rate;
		char gaps[160] = "";
		if (!multi)
			snprintf(gaps, sizeof(gaps), ", and the guesses give the copies %.0f us a layer (the gaps from a "
				 "layer's last to the next one's first, the token's ends among them)", r->expert_lead * 1e6);
		if (!(before > 0) || fabs(rate / before - 1) >= 0.10 || first)
			log_info("cpu share: the CPU's experts of %llu layers of %s read %.2f GB in %.1f ms, %.1f GB/s (the "
				 "routes weighed them at %.1f): the routes weigh them at %.1f from now on%s%s",
				 (unsigned long long)seen.layers, multi ? "steps of several tokens" : "one-token steps",
				 (double)seen.bytes / 1e9, seen.ms, ran / 1e9, before / 1e9, rate / 1e9,
				 in_request ? " (within a request)" : "", gaps);
	}
	if (r->expert_rate > 0 || r->expert_rate_multi > 0)
		gpu_window_set_expert_rate(r->win, r->expert_rate, r->expert_rate_multi, r->expert_lead);
#else
	(void)r;
	(void)in_request;
#endif
}

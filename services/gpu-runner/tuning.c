/* tuning.c - the gpu-runner's live tuning (`pipectl tune`): the tunables a running runner
 * takes, bounded by their values at start, and the fixed values it lists beside them. */
#include <stdio.h>

#include "common/host_profile.h"
#include "common/service.h"
#include "common/tunable.h"
#include "services/gpu-runner/runner.h"
#include "services/gpu-runner/weights_ring.h"

static void timeout_get(void *ctx, struct tunable_value *v)
{
	v->i = ((struct runner *)ctx)->timeout_ms;
}

/* The loader's and the kv-store's clients wait this long from their next request on. */
static int timeout_set(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen)
{
	struct runner *r = ctx;
	if (!apply)
		return 0;
	r->timeout_ms = v->i;
	r->kv.timeout_ms = (int)v->i;
	if (r->ring)
		ring_source_set_timeout(r->ring, (int)v->i);
	return 0;
}

/* A long of struct runner (ctx points at it) that takes effect where it is next read:
 * max-context for requests started from now on (the one running keeps its limit), max-queued
 * for new requests (those past it are refused with EBUSY; those queued stay). */
static void long_get(void *ctx, struct tunable_value *v)
{
	v->i = *(const long *)ctx;
}

static int long_set(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen)
{
	if (apply)
		*(long *)ctx = v->i;
	return 0;
}

static void profile_get(void *ctx, struct tunable_value *v)
{
	(void)ctx;
	v->i = host_profile_running();
}

/* On: sampling starts from zero on this thread, the one that runs the steps (the service's loop);
 * off: it stops, and the stats keep what it counted. */
static int profile_set(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen)
{
	(void)ctx;
	if (!apply)
		return 0;
	if (!v->i) {
		host_profile_stop();
		return 0;
	}
	return host_profile_start(RUNNER_PROFILE_HZ, why, whylen);
}

static void fetch_batch_get(void *ctx, struct tunable_value *v)
{
	v->i = ((struct runner *)ctx)->kv.max_batch;
}

/* The next ALLOC or FETCH, also in the middle of a request (the values do not depend on it). */
static int fetch_batch_set(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen)
{
	if (apply)
		((struct runner *)ctx)->kv.max_batch = (uint32_t)v->i;
	return 0;
}

static void add_fixed_long(struct service *s, const char *name, enum tunable_type type, long long v, const char *help)
{
	char num[32];
	snprintf(num, sizeof(num), "%lld", v);
	service_add_fixed(s, name, type, num, help);
}

void runner_register_tunables(struct runner *r)
{
	struct service *s = r->svc;
	r->start_timeout_ms = r->timeout_ms;
	r->start_max_context = r->max_context;
	r->max_queued = QUEUE_MAX;
	struct tunable t[] = {
		{.name = "timeout-ms",
		 .help = "how long to wait for a reply from ssd-loader or kv-store (at most the value at start: the "
			 "supervisor's peer grace follows it)",
		 .type = TUNABLE_INT, .min = 100, .max = r->start_timeout_ms, .get = timeout_get, .set = timeout_set},
		{.name = "max-context",
		 .help = "positions per sequence, for requests started from now on (at most the value at start: the "
			 "KV tables are sized for it)",
		 .type = TUNABLE_INT, .min = 2, .max = r->start_max_context, .get = long_get, .set = long_set,
		 .ctx = &r->max_context},
		{.name = "kv-fetch-batch",
		 .help = "KV blocks per kv-store ALLOC or FETCH at most (0: as many as the pool holds); smaller batches "
			 "make more requests, the values stay the same",
		 .type = TUNABLE_INT, .min = 0, .max = 65536, .get = fetch_batch_get, .set = fetch_batch_set},
		{.name = "max-queued",
		 .help = "generate requests queued at most; more are refused with EBUSY",
		 .type = TUNABLE_INT, .min = 1, .max = QUEUE_MAX, .get = long_get, .set = long_set,
		 .ctx = &r->max_queued},
		{.name = "profile-host",
		 .help = "sample the CPU time of the thread that runs the steps by program counter (on: from zero; "
			 "`pipectl stats gpu-runner`: host_profile)",
		 .type = TUNABLE_BOOL, .get = profile_get, .set = profile_set},
	};
	for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) {
		if (!t[i].ctx)
			t[i].ctx = r;
		service_add_tunable(s, &t[i]);
	}
	service_add_fixed(s, "backend", TUNABLE_STRING, r->backend_name, "the compute backend");
	add_fixed_long(s, "gpu-budget", TUNABLE_BYTES, (long long)r->gpu_budget, "GPU memory for weights (cuda)");
	add_fixed_long(s, "prefetch-depth", TUNABLE_INT, r->prefetch_depth,
		       "device slots per streamed group class (cuda): allocated at start");
	add_fixed_long(s, "expert-depth", TUNABLE_INT, r->expert_depth,
		       "the experts' device slots (cuda; 0: the window's choice): allocated at start");
	add_fixed_long(s, "copy-streams", TUNABLE_INT, r->copy_streams, "H2D copy streams (cuda): created at start");
	add_fixed_long(s, "h2d-bytes-per-s", TUNABLE_BYTES, (long long)r->h2d_bps, "H2D bandwidth of the plan");
	add_fixed_long(s, "hbm-bytes-per-s", TUNABLE_BYTES, (long long)r->hbm_bps, "GPU memory bandwidth of the plan");
	service_add_fixed(s, "strict", TUNABLE_BOOL, r->strict ? "true" : "false", "check the GPU window's invariants");
	service_add_fixed(s, "predict-experts", TUNABLE_BOOL, r->predict_experts ? "true" : "false",
			  "the GPU's share of later layers' experts copied before their routing, on their last one");
	service_add_fixed(s, "expert-rate-within", TUNABLE_BOOL, r->expert_rate_within ? "true" : "false",
			  "the CPU's experts weighed anew after every token of a request, not only between requests");
	service_add_fixed(s, "balance-ends", TUNABLE_BOOL, r->balance_ends ? "true" : "false",
			  "a layer's copies and CPU experts balanced as they were measured to end (cuda, decode)");
	service_add_fixed(s, "split-gaps", TUNABLE_BOOL, r->split_gaps ? "true" : "false",
			  "the GPU's work between split layers counted on the copies' side (cuda, cpu share auto, spread)");
	service_add_fixed(s, "split-experts", TUNABLE_STRING,
			  r->split_experts == 2 ? "always" : r->split_experts == 1 ? "auto" : "off",
			  "chosen experts split between the copies and the CPU (cuda, decode)");
	service_add_fixed(s, "experts-apart", TUNABLE_BOOL, r->experts_apart ? "true" : "false",
			  "each expert the GPU keeps launched on its own, not a layer's together (cuda, decode)");
	service_add_fixed(s, "moe-host-route", TUNABLE_BOOL, r->moe_host_route ? "true" : "false",
			  "every layer routed on the host, none on the device (cuda, decode)");
	service_add_fixed(s, "fixed-experts", TUNABLE_BOOL, r->fixed_experts ? "true" : "false",
			  "keep the experts the first plan made resident (no re-plan from the routing counted)");
	service_add_fixed(s, "fixed-split", TUNABLE_BOOL, r->fixed_split ? "true" : "false",
			  "keep the CPU share auto chose at start (no re-plan from its jobs' rate)");
	service_add_fixed(s, "fixed-residency", TUNABLE_BOOL, r->fixed_residency ? "true" : "false",
			  "the resident groups as planned with whole sizes (no refill with the split's memory)");
	service_add_fixed(s, "window-spread", TUNABLE_STRING,
			  r->window_spread == 2 ? "yes" : r->window_spread == 1 ? "auto" : "no",
			  "the layer groups the GPU keeps spread among the layers (where DRAM holds them all): yes, no, "
			  "or auto (where the CPU computes a share of dense FFNs and every attention group is kept)");
	service_add_fixed(s, "profile-copies", TUNABLE_BOOL, r->profile_copies ? "true" : "false",
			  "time every weight copy");
	service_add_fixed(s, "kv-dtype", TUNABLE_STRING, r->bp.kv_dtype == DT_F32 ? "f32" : "bf16",
			  "the KV element type");
	add_fixed_long(s, "kv-gpu-budget", TUNABLE_BYTES, (long long)r->kv_gpu_budget,
		       "memory for the runner's KV blocks: the arena is laid out at start");
	add_fixed_long(s, "kv-block-tokens", TUNABLE_INT, r->block_tokens, "tokens per KV block (names cached blocks)");
	add_fixed_long(s, "prefill-chunk", TUNABLE_INT, r->prefill_chunk,
		       "most prompt tokens per forward step (the chunk grid keeps reused prefixes exact)");
	add_fixed_long(s, "threads", TUNABLE_INT, r->threads, "CPU threads of the cpu backend: started at start");
	char share[32];
	service_add_fixed(s, "cpu-share", TUNABLE_STRING, cpu_share_text(&r->cpu_share, share, sizeof(share)),
			  "the CPU's part of each streamed FFN (off, auto or a fraction): planned at start");
	add_fixed_long(s, "cpu-threads", TUNABLE_INT, r->cpu_threads,
		       "worker threads of the CPU share (0: one per CPU allowed, but one): started at start");
	service_add_fixed(s, "cpu-handoff", TUNABLE_STRING, r->cpu_handoff_arg ? r->cpu_handoff_arg : "auto",
			  "how the cuda stream hands the CPU its share: set up at start");
	service_add_fixed(s, "cpu-result", TUNABLE_STRING, r->cpu_result_polled ? "polled" : r->cpu_result_mapped ? "mapped" : "copy",
			  "how the CPU's partial result reaches the GPU: set up at start");
	service_add_fixed(s, "cpu-dispatch", TUNABLE_STRING,
			  r->cpu_dispatch_poll ? (r->cpu_dispatch_workers ? "all" : "both")
					       : (r->cpu_dispatch_workers ? "workers" : "dispatcher"),
			  "who hands the pool a split FFN's job (memops): the dispatcher, with the waiting runner "
			  "(both), with the idle workers (workers), or all three");
	service_add_fixed(s, "cpu-share-balance", TUNABLE_STRING, r->cpu_share.per_layer ? "layer" : "token",
			  "how auto chooses the CPU's part of the FFNs (one share, or each layer's): planned at start");
	service_add_fixed(s, "cpu-expert-chunks", TUNABLE_STRING, r->cpu_expert_taper ? "taper" : "equal",
			  "how a routed expert's job on the CPU is cut: set at start");
	add_fixed_long(s, "cpu-expert-chunk", TUNABLE_BYTES, (long long)r->cpu_expert_chunk,
		       "about the weight bytes a chunk of a routed expert's CPU job reads: set at start");
	add_fixed_long(s, "cpu-prefetch", TUNABLE_BYTES, (long long)r->cpu_prefetch,
		       "the weight bytes of a split FFN's CPU share the idle workers read ahead: set at start");
	service_add_fixed(s, "cpu-prefetch-plan", TUNABLE_STRING, r->cpu_share.prefetch_bytes ? "yes" : "no",
			  "whether auto's balance counts the read-ahead as read: planned at start");
	service_add_fixed(s, "cpu-pin-runner", TUNABLE_STRING, r->cpu_pin_runner ? "yes" : "no",
			  "whether the runner's thread stays off the CPU pool's CPUs: set at start");
	service_add_fixed(s, "cpu-experts", TUNABLE_STRING, r->cpu_experts_early ? "route" : "visit",
			  "when the experts left for the CPU go to its pool: set at start");
	service_add_fixed(s, "instance", TUNABLE_STRING, r->instance, "the instance name");
	service_add_fixed(s, "run-dir", TUNABLE_STRING, r->run_dir, "the run directory");
}

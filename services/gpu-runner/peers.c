/* peers.c - the gpu-runner's connections to its peers: the ssd-loader (its weight ring, the
 * tokenizer it sends, the GPU window over the ring with a device backend, the decode-time
 * prediction) and the kv-store (its pool, page-locked for a device backend). Connects at start,
 * reconnects before a request to a peer that restarted or failed us, and in the middle of a
 * request to a kv-store that went away. Every wait on a peer beats and gives up at a stop. */
#include <errno.h>
#include <stdio.h>
#include <unistd.h>

#include "common/jinja/jinja.h"
#include "common/log.h"
#include "common/service.h"
#include "common/shm.h"
#include "common/tokenizer/tokenizer.h"
#include "common/util.h"
#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/kv_cache.h"
#include "services/gpu-runner/runner.h"
#include "services/gpu-runner/stages/stages.h"
#include "services/gpu-runner/text.h"
#include "services/gpu-runner/weights_ring.h"
#ifdef PIPELINE_HAVE_CUDA
#include "services/gpu-runner/gpu_window.h"
#endif

#define RECONNECT_TIMEOUT_MS 30000
#define RECONNECT_FAILED_HOLD_MS 5000

/* The weight source the engine computes from: the GPU window over the ring, or the ring. */
struct weight_source *runner_weights(struct runner *r)
{
#ifdef PIPELINE_HAVE_CUDA
	if (r->win)
		return gpu_window_base(r->win);
#endif
	return ring_source_base(r->ring);
}

#ifdef PIPELINE_HAVE_CUDA
/* The time a decode token should take under the plans of both tiers: the most of the bytes
 * that cross PCIe over the H2D bandwidth, the CPU's shares of split FFNs at its measured rates
 * (with a handoff each), the bytes read from disk over the disk's bandwidth, and every weight byte
 * the GPU reads (the CPU's shares aside; of the experts, the k of E a token chooses) once over GPU
 * memory's bandwidth. */
static void predict(struct runner *r)
{
	struct gpu_window_stats st;
	gpu_window_stats(r->win, &st);
	uint64_t disk_bytes, disk_bps;
	ring_source_disk_plan(r->ring, &disk_bytes, &disk_bps);
	const struct weight_source *ws = ring_source_base(r->ring);
	uint64_t weights = 0;
	for (uint32_t g = 1; g < ws->n_groups; g++) { /* the embedding is read one row a token, on the host */
		if (!weight_stage_has(&ws->stage, &ws->groups[g])) /* several runners: this one's layers */
			continue;
		/* An expert is read by the tokens that choose it: k of E, as a decode token expects. */
		if (ws->groups[g].kind == GROUP_EXPERT && r->cfg.n_experts)
			weights += ws->groups[g].tensor_bytes * r->cfg.n_experts_used / r->cfg.n_experts;
		else
			weights += ws->groups[g].tensor_bytes;
	}
	weights -= st.cpu_bytes_per_token;
	double pcie = st.h2d_bytes_per_s > 0 ? (double)st.streamed_bytes_per_token / st.h2d_bytes_per_s * 1e3 : 0;
	double disk = disk_bytes && disk_bps ? (double)disk_bytes / (double)disk_bps * 1e3 : 0;
	double hbm = r->hbm_bps ? (double)weights / (double)r->hbm_bps * 1e3 : 0;
	r->predicted_ms = pcie;
	r->binding = "the PCIe link";
	if (st.cpu_ms > r->predicted_ms) {
		r->predicted_ms = st.cpu_ms;
		r->binding = "the CPU share";
	}
	if (st.split_groups && st.spread) {
		/* Split FFNs among kept layers: the CPU's jobs wait for the GPU's reads, while the copies
		 * run through them (the next split layer's rows into a slot the last one left). */
		const double chain = st.cpu_ms + hbm;
		r->predicted_ms = pcie > chain ? pcie : chain;
		r->binding = pcie > chain ? "the PCIe link, beside GPU memory" : "the CPU share, after GPU memory";
	} else if (st.split_groups) {
		/* Split FFNs: the CPU waits for each split layer's input, and the copies run at most the
		 * window's depth ahead of compute, so the GPU's own reads come on top of the longer of the
		 * two (on an H200, P3: predicted 17.1 ms, measured 17.2; max alone said 14.6). */
		r->predicted_ms += hbm;
		r->binding = pcie > st.cpu_ms ? "the PCIe link, after GPU memory" : "the CPU share, after GPU memory";
	}
	if (disk > r->predicted_ms) {
		r->predicted_ms = disk;
		r->binding = "the disk";
	}
	if (hbm > r->predicted_ms) {
		r->predicted_ms = hbm;
		r->binding = "GPU memory bandwidth";
	}
	char a[32], b[32], c[32], d[32];
	log_info("per decode token: %s over PCIe (%.1f ms at %.1f GB/s), %s on the CPU (%.1f ms, %u split FFNs), %s "
		 "from disk (%.1f ms at %.2f GB/s), %s from GPU memory (%.1f ms at %.1f TB/s): predicted %.1f ms/token; "
		 "%s binds", format_size(st.streamed_bytes_per_token, a, sizeof(a)), pcie, st.h2d_bytes_per_s / 1e9,
		 format_size(st.cpu_bytes_per_token, d, sizeof(d)), st.cpu_ms, st.split_groups,
		 format_size(disk_bytes, b, sizeof(b)), disk, (double)disk_bps / 1e9, format_size(weights, c, sizeof(c)), hbm,
		 (double)r->hbm_bps / 1e12, r->predicted_ms, r->binding);
}
#endif

/* Whether the GPU keeps its layer groups spread among the layers (--window-spread). auto: where
 * the CPU computes a share of dense FFNs and the plan keeps every attention group (the window asks
 * each plan: spread_attn_kept). There the resident layers' compute is time in which the CPU waits
 * for the next split layer's input while the link could copy; with the kept layers first, the link
 * fills its slots and idles through them, and the streamed layers then wait for copies. Measured on
 * H200 hosts (docs/benchmarks.md, "2026-12-03 (fifth session)"): P1 66.2 and 67.3 ms/token spread
 * against 80.3 and 76.1, P3's ratio to its limit 1.02-1.20 against 1.10-1.28; but P2, whose
 * attention streams, 174.2 spread against 150.3, its compute waiting 33.8 ms a token for copies
 * against 2.0. Routed experts are planned by their own slots and routes: the first layers stay
 * kept there. */
#ifdef PIPELINE_HAVE_CUDA
static bool runner_window_spread(const struct runner *r)
{
	if (r->window_spread != 1)
		return r->window_spread == 2;
	return r->cpu_share.mode != CPU_SHARE_OFF && r->cpu_pool && !r->cfg.n_experts;
}
#endif

/* With a device backend, the GPU window over the ring (nothing to do on the C backend). */
int runner_make_window(struct runner *r, char *err, size_t errlen)
{
	struct CUstream_st *stream = backend_cuda_stream(r->be);
	if (!stream)
		return 0;
#ifdef PIPELINE_HAVE_CUDA
	struct gpu_window_params wp = {.gpu_budget = r->gpu_budget, .depth = (uint32_t)r->prefetch_depth,
				       .expert_depth = (uint32_t)r->expert_depth, .strict = r->strict, .time_copies = r->profile_copies,
				       .h2d_bytes_per_s = (double)r->h2d_bps, .copy_streams = (uint32_t)r->copy_streams,
				       .cpu_share = r->cpu_share, .cpu_pool = r->cpu_pool,
				       .expert_heat = r->expert_heat, .spread = runner_window_spread(r),
				       .spread_attn_kept = r->window_spread == 1,
				       .split_gaps = r->split_gaps, .hbm_bytes_per_s = (double)r->hbm_bps,
				       .predict_experts = r->predict_experts,
				       .split_experts = (enum gw_split_experts)r->split_experts,
				       .fixed_residency = r->fixed_residency, .balance_ends = r->balance_ends,
				       .ends_lag_s = r->ends_lag};
	if (!wp.h2d_bytes_per_s)
		wp.h2d_bytes_per_s = r->h2d_measured; /* a window made anew: the rate the first one measured */
	int rc = gpu_window_create(r->ring, stream, &wp, &r->win, err, errlen);
	if (rc)
		return rc;
	struct gpu_window_stats ws;
	gpu_window_stats(r->win, &ws);
	r->h2d_measured = ws.h2d_bytes_per_s;
	char line[1024];
	gpu_window_describe(r->win, line, sizeof(line));
	log_info("%s", line);
	predict(r);
	runner_split_mark(r); /* its jobs counted from here (cpu_share.c) */
	if (r->expert_rate > 0 || r->expert_rate_multi > 0) /* the window before's */
		gpu_window_set_expert_rate(r->win, r->expert_rate, r->expert_rate_multi, r->expert_lead);
	return 0;
#else
	snprintf(err, errlen, "a device backend without CUDA support in this build");
	return -ENOTSUP;
#endif
}

void runner_drop_window(struct runner *r)
{
#ifdef PIPELINE_HAVE_CUDA
	gpu_window_destroy(&r->win);
#endif
}

bool runner_window_anew(struct runner *r, const char *what)
{
	char err[1024];
	engine_destroy(&r->engine);
#ifdef PIPELINE_HAVE_CUDA
	if (r->win) { /* the lag it learnt goes on in the next (balance_ends) */
		struct gpu_window_stats st;
		gpu_window_stats(r->win, &st);
		r->ends_lag = st.ends_lag_ms * 1e-3;
	}
	gpu_window_destroy_keeping_pins(&r->win); /* the new window takes the ring over pinned */
#endif
	int rc = runner_make_window(r, err, sizeof(err));
	if (rc == 0)
		rc = runner_make_engine(r, err, sizeof(err));
	if (rc) {
		log_warn("%s: making the weight window anew failed (%s): the next request starts over from the ssd-loader",
			 what, err);
		r->loader_suspect = true;
		return false;
	}
	return true;
}

/* Long work (a forward step, per layer; a wait on a peer, every 100 ms) keeps the heartbeat
 * going: the supervisor then tells a runner at work from a stopped one. */
static void beat(void *ctx)
{
	struct runner *r = ctx;
	service_beat(r->svc);
}

/* A wait on a peer beats too, and gives up when the runner is told to stop (SIGTERM, SIGINT):
 * `pipeline stop` during a peer's outage then ends the request at once instead of waiting out
 * the 30 s and meeting the supervisor's SIGKILL. */
bool runner_wait_beat(void *ctx)
{
	struct runner *r = ctx;
	service_beat(r->svc);
	return service_stop_requested(r->svc);
}

#define STOPPING_MSG "gpu-runner is stopping"

static void no_answer(struct runner *r, const char *peer, int deadline_ms, char *err, size_t errlen)
{
	snprintf(err, errlen, "%s did not answer at %s/%s.ctl within %g s", peer, r->run_dir, peer, deadline_ms / 1000.0);
}

/* HELLO to peer over client c, afresh (the client reset first), waiting up to deadline_ms.
 * Returns 0 with the reply in *hello (the caller frees it with msg_free), or the error of
 * rpc_wait_ready with nothing to free. */
static int hello_peer(struct runner *r, struct rpc_client *c, const char *peer, int deadline_ms, struct msg *hello,
		      char *err, size_t errlen)
{
	rpc_client_reset(c);
	int rc = rpc_wait_ready(c, hello, deadline_ms);
	if (rc == -EREMOTEIO) {
		/* It answered, with an error (a protocol version it does not speak, say): say that. */
		snprintf(err, errlen, "%s refused the runner's HELLO: %.*s", peer, (int)hello->error.text.len,
			 hello->error.text.p ? hello->error.text.p : "");
		msg_free(hello);
	} else if (rc) {
		no_answer(r, peer, deadline_ms, err, errlen);
	}
	return rc;
}

typedef int (*connect_fn)(struct runner *r, int deadline_ms, char *err, size_t errlen);

/* connect in short tries until deadline_ms pass, beating between them; gives up at a stop
 * (-ECANCELED). With gone_too, a peer that went away while the runner connected (-ECONNRESET,
 * -ENOENT, -EAGAIN: it died after HELLO; a successor comes) is tried again too. */
static int connect_retry(struct runner *r, connect_fn connect, const char *peer, bool gone_too, int deadline_ms,
			 char *err, size_t errlen)
{
	uint64_t deadline = now_ns() + (uint64_t)deadline_ms * 1000000ull;
	int rc;
	while ((rc = connect(r, 500, err, errlen)) != 0 && now_ns() < deadline &&
	       (rc == -ETIMEDOUT || (gone_too && (rc == -ECONNRESET || rc == -ENOENT || rc == -EAGAIN)))) {
		if (rc != -ETIMEDOUT) {
			log_warn("%s went away while the runner connected (%s): trying again", peer, err);
			usleep(50 * 1000);
		}
		if (runner_wait_beat(r)) {
			snprintf(err, errlen, STOPPING_MSG " (while waiting for %s)", peer);
			return -ECANCELED;
		}
	}
	if (rc == -ETIMEDOUT)
		no_answer(r, peer, deadline_ms, err, errlen);
	return rc;
}

static int connect_loader(struct runner *r, int deadline_ms, char *err, size_t errlen)
{
	struct msg hello;
	runner_drop_window(r); /* it pins and reads the ring: it goes first */
	ring_source_destroy(&r->ring);
	int rc = hello_peer(r, r->loader_c, "ssd-loader", deadline_ms, &hello, err, errlen);
	if (rc)
		return rc;
	rc = ring_source_create(r->loader_c, &hello.hello_reply, (int)r->timeout_ms, &r->stage, runner_wait_beat, r,
				&r->ring, err, errlen);
	msg_free(&hello);
	if (rc)
		return rc;
	tokenizer_destroy(&r->tok);
	jinja_free(&r->chat_template);
	const char *tdata;
	size_t tlen;
	ring_source_tokenizer(r->ring, &tdata, &tlen);
	if (tlen) {
		char why[512];
		rc = tokenizer_load_buffer("tokenizer.json (from the weight ring)", tdata, tlen, &r->tok, why, sizeof(why));
		if (rc) {
			snprintf(err, errlen, "the tokenizer the loader sent does not load: %s", why);
			ring_source_destroy(&r->ring);
			return rc;
		}
		/* The chat template: a text the model file brought, checked like any input; one that
		 * does not parse leaves the built-in formats (the loader warned at its start too). */
		const char *cdata;
		size_t clen;
		ring_source_chat_template(r->ring, &cdata, &clen);
		if (clen && jinja_parse(cdata, clen, &r->chat_template, why, sizeof(why)) != 0)
			log_warn("the model's chat template does not parse (%s): chats use the built-in format (%s)", why,
				 chat_format_name(chat_format_of(r->tok)));
		log_info("tokenizer: %u ids, chat format %s", tokenizer_vocab_size(r->tok),
			 r->chat_template ? "template" : chat_format_name(chat_format_of(r->tok)));
	}
	if (r->manifest_hash && ring_source_manifest_hash(r->ring) != r->manifest_hash) {
		snprintf(err, errlen, "ssd-loader now serves another model than the one this runner started with; "
			 "restart gpu-runner");
		ring_source_destroy(&r->ring);
		return -EPROTO;
	}
	r->loader_suspect = false;
	return 0;
}

/* connect_loader in short tries until deadline_ms pass, beating between them. A loader that went
 * away while the runner took its ring (it died after HELLO; a successor comes) is tried again
 * too, rather than failing a request, or the runner's start. */
int runner_connect_loader_retry(struct runner *r, int deadline_ms, char *err, size_t errlen)
{
	return connect_retry(r, connect_loader, "ssd-loader", true, deadline_ms, err, errlen);
}

/* Page-locks the KV pool for a device backend (copies then run at the link's speed and
 * asynchronously); undone before the pool is unmapped. */
static void pin_pool(struct runner *r)
{
	if (!r->kv.obj)
		return;
	void *base = shm_object_base(r->kv.obj);
	if (backend_pin_host(r->be, base, shm_object_size(r->kv.obj)) == 0)
		r->pool_pinned = base;
	else
		log_warn("cannot pin the KV pool: %s (its copies run from pageable memory)", backend_error(r->be));
}

void runner_unpin_pool(struct runner *r)
{
	kv_cache_quiesce(r->cache); /* no read-ahead copy may still read the pool */
	for (uint32_t k = 1; k < r->n_slots; k++)
		kv_cache_quiesce(r->slot_kv[k]);
	if (r->pool_pinned)
		backend_unpin_host(r->be, r->pool_pinned);
	r->pool_pinned = NULL;
}

void runner_drop_caches(struct runner *r)
{
	/* r->cache is slot 0's cache (or none); no read-ahead copy may still run once they go. */
	if (r->slot_kv[0] == r->cache)
		r->slot_kv[0] = NULL;
	kv_cache_quiesce(r->cache);
	kv_cache_destroy(&r->cache);
	for (uint32_t k = 0; k < RUNNER_MAX_BATCH; k++) {
		kv_cache_quiesce(r->slot_kv[k]);
		kv_cache_destroy(&r->slot_kv[k]);
	}
	kv_arena_destroy(&r->kv_arena);
}

int runner_make_cache(struct runner *r, char *err, size_t errlen)
{
	runner_drop_caches(r);
	/* Batching: a cache a request running at once, all over the one arena. */
	uint32_t slots = r->n_slots; /* 1 without batching */
	struct kv_cache_params kp = {.n_layers = r->cfg.n_layers, .block_tokens = (uint32_t)r->block_tokens,
				     .max_context = (uint32_t)r->max_context, .max_chunk = (uint32_t)r->prefill_chunk,
				     .n_arena = r->bp.n_kv_blocks, .commits_held = r->kv.defer_commits};
	if (r->stage.split) {
		kp.layer0 = r->stage.layer0;
		kp.layer1 = r->stage.layer1;
	}
	if (r->batching && kv_arena_create(r->bp.n_kv_blocks, &r->kv_arena) != 0)
		return errorf(err, errlen, -ENOMEM, "out of memory for the KV arena's table");
	kp.arena = r->kv_arena;
	for (uint32_t k = 0; k < slots; k++) {
		int rc = kv_cache_create(&kp, r->be, &kv_remote_ops_pool, &r->kv, &r->slot_kv[k], err, errlen);
		if (rc) {
			runner_drop_caches(r);
			return rc;
		}
	}
	r->cache = r->slot_kv[0];
	return 0;
}

int runner_connect_kv(struct runner *r, int deadline_ms, char *err, size_t errlen)
{
	struct msg hello;
	runner_unpin_pool(r); /* and no KV copy touches the pool any more (kv_cache_quiesce) */
	/* A reply given up (the kv-store stopped answering, or died after it may have done the request,
	 * in a pool the next one adopts): what that request did is the old session's, which a new one
	 * makes the store let go of (this runner's session is its own; a split model's is the
	 * formation's, which rank 0 renews as it forms: runner_idle_stages). */
	if (r->kv.orphans && !r->stage.split) {
		r->kv_renewed = true;
		rpc_client_set_session(r->kv_c, random_u64() | 1);
		kv_remote_forget_session(&r->kv);
		log_warn("a kv-store reply was given up: a new session, so that the store lets go of what the "
			 "old one held (its cached blocks stay)");
	}
	int rc = hello_peer(r, r->kv_c, "kv-store", deadline_ms, &hello, err, errlen);
	if (rc)
		return rc;
	/* A kv-store that dies before it answers the pool configuration is noticed by its pid. */
	kv_remote_set_peer(&r->kv, hello.hello_reply.pid);
	msg_free(&hello);
	bool same = false;
	rc = kv_remote_connect(&r->kv, r->kv_c, r->pool_block_bytes, r->manifest_hash, (int)r->timeout_ms, &same, err,
			       errlen);
	if (rc)
		return rc;
	pin_pool(r);
	if (r->kv_connected && (!same || r->kv_renewed)) {
		if (!same)
			log_warn("kv-store has a new pool: the blocks it held are gone");
		kv_cache_forget_remote(r->cache);
		for (uint32_t k = 1; k < r->n_slots; k++)
			kv_cache_forget_remote(r->slot_kv[k]);
	}
	r->kv_connected = true;
	r->kv_renewed = false;
	r->kv_suspect = false;
	return 0;
}

/* A request to the kv-store failed in the middle of a generation. If the connection is gone
 * (the kv-store died or restarted), reconnect, waiting up to RECONNECT_TIMEOUT_MS for it to
 * come back, while serving our own socket so that heartbeats go on and a stop is heard. */
int runner_kv_failure(void *ctx, char *err, size_t errlen)
{
	struct runner *r = ctx;
	if (!kv_remote_lost(&r->kv))
		return 0; /* it answered, with a refusal (a dropped block, say): nothing to reconnect */
	log_warn("kv-store connection lost in the middle of a request: reconnecting");
	uint64_t deadline = now_ns() + (uint64_t)RECONNECT_TIMEOUT_MS * 1000000ull;
	for (;;) {
		int rc = runner_connect_kv(r, 250, err, errlen);
		if (rc == 0) {
			log_info("kv-store is back: rebuilding the KV of the request in flight");
			return 0;
		}
		/* No answer yet, or a kv-store that died again before it answered: its successor may come. */
		if (rc != -ETIMEDOUT && rc != -ECONNRESET && rc != -ENOENT && rc != -EAGAIN)
			return rc;
		if (now_ns() >= deadline) {
			snprintf(err, errlen, "kv-store did not come back at %s/kv-store.ctl within %d s", r->run_dir,
				 RECONNECT_TIMEOUT_MS / 1000);
			return rc;
		}
		if (service_poll_once(r->svc, rc == -ETIMEDOUT ? 0 : 50)) {
			snprintf(err, errlen, STOPPING_MSG);
			return -ECANCELED;
		}
	}
}

/* Idle, and the loader went away: its ring goes now (the window's registration of it first),
 * so its shared memory is free for the loader that replaces it, which faults in a ring of its
 * own; the next request connects to that one (runner_ensure_connections). */
void runner_release_dead_loader(struct runner *r)
{
	if (!r->ring || ring_source_owner_alive(r->ring))
		return;
	log_warn("ssd-loader went away while idle: unmapped its weight ring; the next request connects to "
		 "its successor");
	runner_drop_window(r);
	ring_source_destroy(&r->ring);
	r->loader_suspect = true;
}

/* The engine over the weight source as it is now (a new ring, a new window): the one before goes. */
int runner_make_engine(struct runner *r, char *err, size_t errlen)
{
	runner_fold_routing(r); /* the routing it counted outlives it (experts.c) */
	engine_destroy(&r->engine);
	r->replan_checked = 0;
	int rc = engine_create(&r->cfg, r->be, runner_weights(r), r->cache, r->bp.max_chunk, &r->engine, err,
			       errlen);
	if (rc)
		return rc;
	engine_set_progress(r->engine, beat, r);
	engine_set_cpu_experts_early(r->engine, r->cpu_experts_early);
	runner_set_engine_stages(r);
	if (r->cpu_split_r)
		return engine_set_ffn_split(r->engine, r->cpu_split_r, 1, err, errlen);
	return 0;
}

static int ensure_connections(struct runner *r, char *err, size_t errlen);

/* Before a request (queued at queued_ns; 0: not a queued request): reconnect to a service that
 * restarted or failed us. A reconnection that failed (after its wait of up to
 * RECONNECT_TIMEOUT_MS) answers the requests that were queued before it failed, for
 * RECONNECT_FAILED_HOLD_MS: they fail with its error at once (each waited out its own 30 s: with
 * 128 queued, the last answer came after an hour); a request queued after it tries again. */
int runner_ensure_connections(struct runner *r, uint64_t queued_ns, char *err, size_t errlen)
{
	const uint64_t now = now_ns();
	if (r->reconnect_failed_rc && queued_ns && queued_ns < r->reconnect_failed_ns &&
	    now - r->reconnect_failed_ns < (uint64_t)RECONNECT_FAILED_HOLD_MS * 1000000ull) {
		snprintf(err, errlen, "%s (the reconnection that failed just before)", r->reconnect_failed_err);
		return r->reconnect_failed_rc;
	}
	int rc = ensure_connections(r, err, errlen);
	r->reconnect_failed_rc = rc;
	if (rc) {
		r->reconnect_failed_ns = now_ns();
		snprintf(r->reconnect_failed_err, sizeof(r->reconnect_failed_err), "%s", err);
		/* Whatever part failed (the window or the engine after the loader's HELLO), the next
		 * try starts over from both peers. */
		r->loader_suspect = r->kv_suspect = true;
	}
	return rc;
}

static int ensure_connections(struct runner *r, char *err, size_t errlen)
{
	int rc;
	/* A source that moved to a new loader in the middle of a step still maps the old ring (and a
	 * GPU window registered it): start over from the new loader. */
	if (r->loader_suspect || !r->ring || !ring_source_owner_alive(r->ring) || ring_source_reconnected(r->ring)) {
		log_info("reconnecting to ssd-loader");
		rc = runner_connect_loader_retry(r, RECONNECT_TIMEOUT_MS, err, errlen);
		if (rc)
			return rc;
		if ((rc = runner_make_window(r, err, errlen)) != 0)
			return rc;
		if ((rc = runner_make_engine(r, err, errlen)) != 0)
			return rc;
	}
	if (r->kv_suspect || kv_remote_lost(&r->kv)) {
		log_info("reconnecting to kv-store");
		rc = connect_retry(r, runner_connect_kv, "kv-store", true, RECONNECT_TIMEOUT_MS, err, errlen);
		if (rc)
			return rc;
	}
	/* Rank 0 of a split model: the other ranks formed (again, after one restarted). */
	if (r->front && (rc = stage_front_form(r->front, RECONNECT_TIMEOUT_MS, err, errlen)) != 0)
		return rc;
	return 0;
}

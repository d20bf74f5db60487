/* gpu-runner: owns compute, the runner's KV arena, scheduling, sampling and the generate
 * API. Weights come from the ssd-loader's ring, KV blocks go to and come from the kv-store
 * pool; this process never opens a model file.
 *
 * Requests are queued and run one at a time (batch 1); while a request runs, the service
 * keeps answering between tokens (HELLO, stats, more requests to queue). Before each request
 * it checks that the ssd-loader and kv-store it mapped are still the live owners of their
 * shared memory, and reconnects if one was restarted. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/config.h"
#include "common/log.h"
#include "common/service.h"
#include "common/shm.h"
#include "common/tokenizer/tokenizer.h"
#include "common/util.h"
#include "common/weight_ring.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/generate.h"
#include "services/gpu-runner/kv_cache.h"
#include "services/gpu-runner/kv_remote.h"
#include "services/gpu-runner/text.h"
#include "services/gpu-runner/weights_ring.h"
#ifdef PIPELINE_HAVE_CUDA
#include "services/gpu-runner/gpu_window.h"
#endif

#define QUEUE_MAX 16
#define CONNECT_TIMEOUT_MS 120000
#define RECONNECT_TIMEOUT_MS 30000

struct job {
	struct bus_peer peer;
	uint64_t corr;
	int32_t *tokens; /* the prompt as ids, when the request gave ids */
	uint32_t n_tokens;
	int32_t *stop;	 /* the request's stop ids, room for one more (a chat's end of turn) */
	struct gen_params params;
	uint64_t flags;	 /* enum gen_flags */
	char *prompt, *chat, *stop_strings; /* owned copies, NULL when not given */
	uint32_t prompt_len, chat_len, stop_strings_len;
};

struct runner {
	/* options */
	const char *instance, *run_dir, *backend_name, *log_level, *kv_dtype_name;
	uint64_t gpu_budget, kv_gpu_budget;
	long block_tokens, threads, max_context, prefill_chunk, timeout_ms, prefetch_depth, copy_streams;
	/* live tuning: the start values bound what a tune may set; max_queued caps the queue */
	long start_timeout_ms, start_max_context, max_queued;
	uint64_t h2d_bps, hbm_bps;
	double predicted_ms;	/* per decode token, from the plans of both tiers */
	const char *binding;	/* which limit the prediction says binds */
	bool strict, profile_copies;

	void *zctx; /* for the clients of the other services */
	struct rpc_client *loader_c, *kv_c;
	struct ring_source *ring;
#ifdef PIPELINE_HAVE_CUDA
	struct gpu_window *win; /* the GPU tier of weights, with the cuda backend */
#endif
	struct kv_remote kv;
	void *pool_pinned; /* the KV pool mapping, page-locked for the backend's copies */
	bool loader_suspect, kv_suspect;
	bool kv_connected; /* a pool was mapped before */

	struct model_config cfg;
	uint64_t manifest_hash;
	uint64_t kv_seed; /* names model, backend and KV format in KV block keys */
	struct tokenizer *tok; /* from the ring; NULL when the model has no tokenizer.json */
	const struct backend_ops *ops;
	struct backend *be;
	struct backend_params bp;
	size_t arena_block_bytes;
	uint64_t pool_block_bytes;
	struct kv_cache *cache;
	struct engine *engine;
	struct service *svc;

	struct job queue[QUEUE_MAX];
	uint32_t q_head, q_len;
	struct job *current;
	struct text_stream *ts; /* the current request's text, when it wants text or has stop strings */

	/* counters */
	uint64_t requests, prompt_tokens, tokens_generated, failures;
	double prefill_ms, decode_ms, last_prefill_tok_s, last_decode_tok_s;
};

static void job_free(struct job *j)
{
	free(j->tokens);
	free(j->stop);
	free(j->prompt);
	free(j->chat);
	free(j->stop_strings);
	memset(j, 0, sizeof(*j));
}

/* A heap copy of a decoded string field (NULL when empty). Returns -ENOMEM or 0. */
static int copy_bytes(const struct bytes *b, char **out, uint32_t *len)
{
	*out = NULL;
	*len = 0;
	if (!b->len)
		return 0;
	if (!(*out = malloc(b->len + 1)))
		return -ENOMEM;
	memcpy(*out, b->p, b->len + 1);
	*len = b->len;
	return 0;
}

/* ---- connections ---- */

/* The weight source the engine computes from: the GPU window over the ring, or the ring. */
static struct weight_source *weights(struct runner *r)
{
#ifdef PIPELINE_HAVE_CUDA
	if (r->win)
		return gpu_window_base(r->win);
#endif
	return ring_source_base(r->ring);
}

#ifdef PIPELINE_HAVE_CUDA
/* The time a decode token should take under the plans of both tiers: the most of the bytes
 * that cross PCIe over the H2D bandwidth, the bytes read from disk over the disk's bandwidth,
 * and every weight byte read from GPU memory once over its bandwidth. */
static void predict(struct runner *r)
{
	struct gpu_window_stats st;
	gpu_window_stats(r->win, &st);
	uint64_t disk_bytes, disk_bps;
	ring_source_disk_plan(r->ring, &disk_bytes, &disk_bps);
	const struct weight_source *ws = ring_source_base(r->ring);
	uint64_t weights = 0;
	for (uint32_t g = 1; g < ws->n_groups; g++) /* the embedding is read one row a token, on the host */
		weights += ws->groups[g].tensor_bytes;
	double pcie = st.h2d_bytes_per_s > 0 ? (double)st.streamed_bytes_per_token / st.h2d_bytes_per_s * 1e3 : 0;
	double disk = disk_bytes && disk_bps ? (double)disk_bytes / (double)disk_bps * 1e3 : 0;
	double hbm = r->hbm_bps ? (double)weights / (double)r->hbm_bps * 1e3 : 0;
	r->predicted_ms = pcie;
	r->binding = "the PCIe link";
	if (disk > r->predicted_ms) {
		r->predicted_ms = disk;
		r->binding = "the disk";
	}
	if (hbm > r->predicted_ms) {
		r->predicted_ms = hbm;
		r->binding = "GPU memory bandwidth";
	}
	char a[32], b[32], c[32];
	log_info("per decode token: %s over PCIe (%.1f ms at %.1f GB/s), %s from disk (%.1f ms at %.2f GB/s), %s from "
		 "GPU memory (%.1f ms at %.1f TB/s): predicted %.1f ms/token; %s binds",
		 format_size(st.streamed_bytes_per_token, a, sizeof(a)), pcie, st.h2d_bytes_per_s / 1e9,
		 format_size(disk_bytes, b, sizeof(b)), disk, (double)disk_bps / 1e9, format_size(weights, c, sizeof(c)), hbm,
		 (double)r->hbm_bps / 1e12, r->predicted_ms, r->binding);
}
#endif

/* With a device backend, the GPU window over the ring (nothing to do on the C backend). */
static int make_window(struct runner *r, char *err, size_t errlen)
{
	void *stream = r->ops->stream ? r->ops->stream(r->be) : NULL;
	if (!stream)
		return 0;
#ifdef PIPELINE_HAVE_CUDA
	struct gpu_window_params wp = {.gpu_budget = r->gpu_budget, .depth = (uint32_t)r->prefetch_depth,
				       .strict = r->strict, .time_copies = r->profile_copies,
				       .h2d_bytes_per_s = (double)r->h2d_bps, .copy_streams = (uint32_t)r->copy_streams};
	int rc = gpu_window_create(r->ring, stream, &wp, &r->win, err, errlen);
	if (rc)
		return rc;
	char line[512];
	gpu_window_describe(r->win, line, sizeof(line));
	log_info("%s", line);
	predict(r);
	return 0;
#else
	snprintf(err, errlen, "a device backend without CUDA support in this build");
	return -ENOTSUP;
#endif
}

static void drop_window(struct runner *r)
{
#ifdef PIPELINE_HAVE_CUDA
	gpu_window_destroy(&r->win);
#endif
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
static bool wait_beat(void *ctx)
{
	struct runner *r = ctx;
	service_beat(r->svc);
	return service_stop_requested(r->svc);
}

#define STOPPING_MSG "gpu-runner is stopping"

static int connect_loader(struct runner *r, int deadline_ms, char *err, size_t errlen)
{
	struct msg hello;
	drop_window(r); /* it pins and reads the ring: it goes first */
	ring_source_destroy(&r->ring);
	rpc_client_reset(r->loader_c);
	int rc = rpc_wait_ready(r->loader_c, &hello, deadline_ms);
	if (rc) {
		snprintf(err, errlen, "ssd-loader did not answer at %s/ssd-loader.ctl within %d s", r->run_dir,
			 deadline_ms / 1000);
		if (rc == -EREMOTEIO)
			msg_free(&hello);
		return rc;
	}
	rc = ring_source_create(r->loader_c, &hello.hello_reply, (int)r->timeout_ms, &r->ring, err, errlen);
	msg_free(&hello);
	if (rc)
		return rc;
	ring_source_set_wait_hook(r->ring, wait_beat, r);
	tokenizer_destroy(&r->tok);
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
		log_info("tokenizer: %u ids, chat format %s", tokenizer_vocab_size(r->tok),
			 chat_format_name(chat_format_of(r->tok)));
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
static int connect_loader_retry(struct runner *r, int deadline_ms, char *err, size_t errlen)
{
	uint64_t deadline = now_ns() + (uint64_t)deadline_ms * 1000000ull;
	int rc;
	while ((rc = connect_loader(r, 500, err, errlen)) != 0 && now_ns() < deadline &&
	       (rc == -ETIMEDOUT || rc == -ECONNRESET || rc == -ENOENT || rc == -EAGAIN)) {
		if (rc != -ETIMEDOUT) {
			log_warn("ssd-loader went away while the runner connected (%s): trying again", err);
			usleep(50 * 1000);
		}
		if (wait_beat(r)) {
			snprintf(err, errlen, STOPPING_MSG " (while waiting for ssd-loader)");
			return -ECANCELED;
		}
	}
	if (rc == -ETIMEDOUT)
		snprintf(err, errlen, "ssd-loader did not answer at %s/ssd-loader.ctl within %d s", r->run_dir,
			 deadline_ms / 1000);
	return rc;
}

/* Page-locks the KV pool for a device backend (copies then run at the link's speed and
 * asynchronously); undone before the pool is unmapped. */
static void pin_pool(struct runner *r)
{
	if (!r->ops->pin_host || !r->kv.obj)
		return;
	void *base = shm_object_base(r->kv.obj);
	if (r->ops->pin_host(r->be, base, shm_object_size(r->kv.obj)) == 0)
		r->pool_pinned = base;
	else
		log_warn("cannot pin the KV pool: %s (its copies run from pageable memory)", r->ops->error(r->be));
}

static void unpin_pool(struct runner *r)
{
	kv_cache_quiesce(r->cache); /* no read-ahead copy may still read the pool */
	if (r->pool_pinned && r->ops->unpin_host)
		r->ops->unpin_host(r->be, r->pool_pinned);
	r->pool_pinned = NULL;
}

static int connect_kv(struct runner *r, int deadline_ms, char *err, size_t errlen)
{
	struct msg hello;
	unpin_pool(r);
	rpc_client_reset(r->kv_c);
	int rc = rpc_wait_ready(r->kv_c, &hello, deadline_ms);
	if (rc) {
		snprintf(err, errlen, "kv-store did not answer at %s/kv-store.ctl within %d s", r->run_dir,
			 deadline_ms / 1000);
		if (rc == -EREMOTEIO)
			msg_free(&hello);
		return rc;
	}
	msg_free(&hello);
	bool same = false;
	rc = kv_remote_connect(&r->kv, r->kv_c, r->pool_block_bytes, r->manifest_hash, (int)r->timeout_ms, &same, err,
			       errlen);
	if (rc)
		return rc;
	pin_pool(r);
	if (r->kv_connected && !same) {
		log_warn("kv-store has a new pool: the blocks it held are gone");
		kv_cache_forget_remote(r->cache);
	}
	r->kv_connected = true;
	r->kv_suspect = false;
	return 0;
}

/* A request to the kv-store failed in the middle of a generation. If the connection is gone
 * (the kv-store died or restarted), reconnect, waiting up to RECONNECT_TIMEOUT_MS for it to
 * come back, while serving our own socket so that heartbeats go on and a stop is heard. */
static int kv_failure(void *ctx, char *err, size_t errlen)
{
	struct runner *r = ctx;
	if (!kv_remote_lost(&r->kv))
		return 0; /* it answered, with a refusal (a dropped block, say): nothing to reconnect */
	log_warn("kv-store connection lost in the middle of a request: reconnecting");
	uint64_t deadline = now_ns() + (uint64_t)RECONNECT_TIMEOUT_MS * 1000000ull;
	for (;;) {
		int rc = connect_kv(r, 250, err, errlen);
		if (rc == 0) {
			log_info("kv-store is back: rebuilding the KV of the request in flight");
			return 0;
		}
		if (rc != -ETIMEDOUT)
			return rc;
		if (now_ns() >= deadline) {
			snprintf(err, errlen, "kv-store did not come back at %s/kv-store.ctl within %d s", r->run_dir,
				 RECONNECT_TIMEOUT_MS / 1000);
			return rc;
		}
		if (service_poll_once(r->svc, 0)) {
			snprintf(err, errlen, STOPPING_MSG);
			return -ECANCELED;
		}
	}
}

/* Idle, and the loader went away: its ring goes now (the window's registration of it first),
 * so its shared memory is free for the loader that replaces it, which faults in a ring of its
 * own; the next request connects to that one (ensure_connections). */
static void release_dead_loader(struct runner *r)
{
	if (!r->ring || ring_source_owner_alive(r->ring))
		return;
	log_warn("ssd-loader went away while idle: unmapped its weight ring; the next request connects to "
		 "its successor");
	drop_window(r);
	ring_source_destroy(&r->ring);
	r->loader_suspect = true;
}

/* Before a request: reconnect to a service that restarted or failed us. */
static int ensure_connections(struct runner *r, char *err, size_t errlen)
{
	int rc;
	/* A source that moved to a new loader in the middle of a step still maps the old ring (and a
	 * GPU window registered it): start over from the new loader. */
	if (r->loader_suspect || !r->ring || !ring_source_owner_alive(r->ring) || ring_source_reconnected(r->ring)) {
		log_info("reconnecting to ssd-loader");
		rc = connect_loader_retry(r, RECONNECT_TIMEOUT_MS, err, errlen);
		if (rc)
			return rc;
		if ((rc = make_window(r, err, errlen)) != 0)
			return rc;
		engine_destroy(&r->engine);
		rc = engine_create(&r->cfg, r->ops, r->be, weights(r), r->cache, r->bp.max_chunk, &r->engine, err,
				   errlen);
		if (rc)
			return rc;
		engine_set_progress(r->engine, beat, r);
	}
	if (r->kv_suspect || kv_remote_lost(&r->kv)) {
		log_info("reconnecting to kv-store");
		uint64_t deadline = now_ns() + (uint64_t)RECONNECT_TIMEOUT_MS * 1000000ull;
		while ((rc = connect_kv(r, 500, err, errlen)) == -ETIMEDOUT && now_ns() < deadline) {
			if (wait_beat(r)) {
				snprintf(err, errlen, STOPPING_MSG " (while waiting for kv-store)");
				return -ECANCELED;
			}
		}
		if (rc == -ETIMEDOUT)
			snprintf(err, errlen, "kv-store did not answer at %s/kv-store.ctl within %d s", r->run_dir,
				 RECONNECT_TIMEOUT_MS / 1000);
		if (rc)
			return rc;
	}
	return 0;
}

/* ---- requests ---- */

/* A step is over (a token came out of it): without a GPU window nothing reads the weight ring
 * between steps, so the ring of a loader that went away in the middle of a step is unmapped now;
 * its tmpfs pages go with the last mapping, and the new loader needs them. With a window, the
 * window unmaps it once its copies from it have completed. */
static void trim_retired(struct runner *r)
{
#ifdef PIPELINE_HAVE_CUDA
	if (r->win)
		return;
#endif
	if (r->ring && ring_source_n_retired(r->ring))
		ring_source_trim_retired(r->ring);
}

static enum gen_emit emit_token(void *ctx, uint32_t index, int32_t token)
{
	struct runner *r = ctx;
	struct msg m;
	msg_init(&m, MSG_TOKEN, r->current->corr);
	m.token.index = index;
	m.token.token = (uint64_t)token;
	bool hit = false;
	if (r->ts) {
		const char *piece;
		size_t len;
		if (text_stream_push(r->ts, token, &piece, &len, &hit) == 0 && (r->current->flags & GEN_TEXT)) {
			m.token.text.p = (char *)piece;
			m.token.text.len = (uint32_t)len;
		}
	}
	ring_source_count_token(r->ring);
	trim_retired(r);
	if (service_reply(r->svc, &r->current->peer, &m) == -EHOSTUNREACH) {
		log_warn("the client of request %llu went away: cancelling it", (unsigned long long)r->current->corr);
		return GEN_CANCEL;
	}
	/* Keep serving between tokens; a stop request ends the generation. */
	if (service_poll_once(r->svc, 0))
		return GEN_CANCEL;
	return hit ? GEN_STOP_STRING : GEN_CONTINUE;
}

/* GEN_LOGITS: the prompt's last-position logits go to the client before the first token. */
static int send_logits(void *ctx, uint32_t position, const float *logits, uint32_t n)
{
	struct runner *r = ctx;
	struct msg m;
	msg_init(&m, MSG_LOGITS, r->current->corr);
	m.logits.position = position;
	m.logits.values.p = (char *)logits; /* float32 in host order: little-endian on every target */
	m.logits.values.len = n * (uint32_t)sizeof(float);
	int rc = service_reply(r->svc, &r->current->peer, &m);
	return rc == -EHOSTUNREACH ? rc : 0;
}

/* Prefill is done: weight-copy timing from here on measures decode alone. */
static void decode_starts(void *ctx)
{
#ifdef PIPELINE_HAVE_CUDA
	struct runner *r = ctx;
	if (r->win)
		gpu_window_reset_timing(r->win);
#endif
}

static void run_job(struct runner *r, struct job *j)
{
	char err[1024] = "";
	struct gen_result res = {0};
	r->current = j;
	r->requests++;
	struct text_prompt tp = {.end_of_turn = -1};
	const int32_t *prompt = j->tokens;
	uint32_t n_prompt = j->n_tokens;
	const char *tail = "";
	size_t tail_len = 0;
	int rc = ensure_connections(r, err, sizeof(err));
	if (rc == 0 && !j->n_tokens) {
		struct msg_generate g = {.prompt = {j->prompt, j->prompt_len}, .chat = {j->chat, j->chat_len},
					 .flags = j->flags};
		rc = text_prompt_build(r->tok, &r->cfg, &g, &tp, err, sizeof(err));
		prompt = (const int32_t *)tp.ids.ids; /* ids < vocab_size < 2^31 */
		n_prompt = (uint32_t)tp.ids.n;
		if (rc == 0 && tp.end_of_turn >= 0)
			j->stop[j->params.n_stop++] = tp.end_of_turn;
	}
	if (rc == 0 && ((j->flags & GEN_TEXT) || j->stop_strings_len)) {
		if (!r->tok) {
			rc = -ENOTSUP;
			snprintf(err, sizeof(err), "the model has no tokenizer.json: no text output and no stop strings");
		} else {
			rc = text_stream_create(r->tok, j->stop_strings, j->stop_strings_len, &r->ts, err, sizeof(err));
		}
	}
	if (rc == 0) {
		rc = generate_run(r->engine, prompt, n_prompt, (uint32_t)r->max_context, &j->params, emit_token, r,
				  &res, err, sizeof(err));
		if (rc == 0 && r->ts && (j->flags & GEN_TEXT))
			text_stream_finish(r->ts, &tail, &tail_len);
		/* Hand streamed groups back; a dead loader would only make the client wait a timeout, and
		 * a runner that stops needs not (the loader drops them at the next runner's HELLO). */
		bool stopping = rc == -ECANCELED && service_stop_requested(r->svc);
		int wrc = !stopping && ring_source_owner_alive(r->ring) ? weights(r)->ops->release_all(weights(r)) : 0;
		if (wrc && !ring_source_owner_alive(r->ring)) {
			/* It died between the check and the release: what we held died with it. */
			log_warn("ssd-loader went away while the request's weights were handed back: %s",
				 weights(r)->error);
			r->loader_suspect = true;
			wrc = 0;
		}
		if (wrc && !rc) {
			snprintf(err, sizeof(err), "%s", weights(r)->error);
			rc = wrc;
		}
	}
	if (rc) {
		r->failures++;
		/* Whatever failed, check both peers before the next request. */
		r->loader_suspect = true;
		r->kv_suspect = true;
		log_error("request %llu failed: %s", (unsigned long long)j->corr, err);
		service_reply_error(r->svc, &j->peer, j->corr, -rc, err);
	} else {
		struct msg m;
		msg_init(&m, MSG_GEN_DONE, j->corr);
		m.gen_done.n_prompt = res.n_prompt;
		m.gen_done.n_generated = res.n_generated;
		m.gen_done.reason.p = (char *)res.reason;
		m.gen_done.reason.len = (uint32_t)strlen(res.reason);
		m.gen_done.prefill_ms = res.prefill_ms;
		m.gen_done.decode_ms = res.decode_ms;
		m.gen_done.text.p = (char *)tail;
		m.gen_done.text.len = (uint32_t)tail_len;
		service_reply(r->svc, &j->peer, &m);
		r->prompt_tokens += res.n_prompt;
		r->tokens_generated += res.n_generated;
		r->prefill_ms += res.prefill_ms;
		r->decode_ms += res.decode_ms;
		r->last_prefill_tok_s = res.prefill_ms > 0 ? res.n_prompt / (res.prefill_ms / 1e3) : 0;
		r->last_decode_tok_s =
			res.decode_ms > 0 && res.n_generated > 1 ? (res.n_generated - 1) / (res.decode_ms / 1e3) : 0;
		log_info("request %llu: %u prompt tokens (%u restored from the kv-store), %u generated (%s), prefill "
			 "%.1f tok/s, decode %.1f tok/s%s",
			 (unsigned long long)j->corr, res.n_prompt, res.n_restored, res.n_generated, res.reason,
			 r->last_prefill_tok_s, r->last_decode_tok_s, res.n_rebuilds ? ", KV rebuilt after a kv-store failure" : "");
	}
	text_prompt_free(&tp);
	text_stream_destroy(&r->ts);
	r->current = NULL;
}

static int queue_generate(struct runner *r, const struct bus_peer *peer, const struct msg *req, char *errtext,
			  size_t errlen)
{
	const struct msg_generate *g = &req->generate;
	if (r->q_len >= QUEUE_MAX || (r->max_queued && r->q_len >= (uint32_t)r->max_queued)) {
		snprintf(errtext, errlen, "the runner has %u requests queued; try again later", r->q_len);
		return -EBUSY;
	}
	if ((g->tokens.n > 0) + (g->prompt.len > 0) + (g->chat.len > 0) != 1) {
		snprintf(errtext, errlen, "give the prompt one way: token ids, text (prompt) or chat messages");
		return -EINVAL;
	}
	if ((g->prompt.len || g->chat.len || g->stop_strings.len || (g->flags & GEN_TEXT)) && !r->tok) {
		snprintf(errtext, errlen, "the model has no tokenizer.json, so the runner takes token ids only and "
			 "returns ids only (start the loader with --tokenizer FILE)");
		return -ENOTSUP;
	}
	if (g->max_new > (1u << 24)) {
		snprintf(errtext, errlen, "max_new %llu is too large", (unsigned long long)g->max_new);
		return -EINVAL;
	}
	if (!isfinite(g->temperature) || g->temperature < 0 || !isfinite(g->top_p) || g->top_p < 0 || g->top_p > 1 ||
	    !isfinite(g->min_p) || g->min_p < 0 || g->min_p > 1 || !isfinite(g->repetition_penalty) ||
	    g->repetition_penalty < 0) {
		snprintf(errtext, errlen,
			 "temperature must be >= 0, top_p and min_p in [0, 1], repetition_penalty >= 0");
		return -EINVAL;
	}
	for (uint32_t i = 0; i < g->tokens.n; i++) {
		if (g->tokens.v[i] >= r->cfg.vocab_size) {
			snprintf(errtext, errlen, "prompt token %u is %llu, outside the vocabulary of %u", i,
				 (unsigned long long)g->tokens.v[i], r->cfg.vocab_size);
			return -EINVAL;
		}
	}
	struct job *j = &r->queue[(r->q_head + r->q_len) % QUEUE_MAX];
	memset(j, 0, sizeof(*j));
	j->peer = *peer;
	j->corr = req->corr;
	j->n_tokens = g->tokens.n;
	j->flags = g->flags;
	j->tokens = malloc(sizeof(int32_t) * (g->tokens.n + 1));
	j->stop = malloc(sizeof(int32_t) * (g->stop_ids.n + 1));
	if (!j->tokens || !j->stop || copy_bytes(&g->prompt, &j->prompt, &j->prompt_len) ||
	    copy_bytes(&g->chat, &j->chat, &j->chat_len) ||
	    copy_bytes(&g->stop_strings, &j->stop_strings, &j->stop_strings_len)) {
		job_free(j);
		snprintf(errtext, errlen, "out of memory");
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < g->tokens.n; i++)
		j->tokens[i] = (int32_t)g->tokens.v[i];
	for (uint32_t i = 0; i < g->stop_ids.n; i++)
		j->stop[i] = g->stop_ids.v[i] > INT32_MAX ? -1 : (int32_t)g->stop_ids.v[i];
	j->params = (struct gen_params){
		.max_new = (uint32_t)g->max_new,
		.sampling = {.temperature = (float)g->temperature, .top_k = g->top_k > UINT32_MAX ? 0 : (uint32_t)g->top_k,
			     .top_p = g->top_p == 0 ? 1.0f : (float)g->top_p, .seed = g->seed, .min_p = (float)g->min_p},
		.repetition_penalty = (float)g->repetition_penalty,
		.ignore_eos = (g->flags & GEN_IGNORE_EOS) != 0,
		.on_logits = (g->flags & GEN_LOGITS) ? send_logits : NULL,
		.on_decode = decode_starts,
		.on_kv_failure = kv_failure,
		.kv_seed = r->kv_seed,
		.stop_ids = j->stop,
		.n_stop = g->stop_ids.n,
	};
	r->q_len++;
	return 0;
}

static int handle(void *ctx, struct service *s, const struct bus_peer *peer, const struct msg *req, char *errtext,
		  size_t errlen)
{
	struct runner *r = ctx;
	if (req->type == MSG_GENERATE)
		return queue_generate(r, peer, req, errtext, errlen);
	snprintf(errtext, errlen, "gpu-runner does not handle %s", msg_type_name(req->type));
	return -ENOTSUP;
}

/* ---- what pipeline-inspect shows (built with the stats, once a second; nothing on the token path) ---- */

/* The runner's view of weight group g: on the device (cuda: G held for good, W in a window
 * slot, C copying in, T retiring), else in the loader's ring (H granted to the runner, R ready,
 * L loading, E empty). */
static char group_letter(struct runner *r, struct wring_header *h, uint32_t g)
{
#ifdef PIPELINE_HAVE_CUDA
	if (r->win) {
		bool for_good;
		switch (gpu_window_group_state(r->win, g, &for_good)) {
		case GWIN_RESIDENT:
			return for_good ? 'G' : 'W';
		case GWIN_INFLIGHT:
			return 'C';
		case GWIN_RETIRING:
			return 'T';
		default:
			break;
		}
	}
#endif
	if (g >= h->n_groups)
		return '?';
	uint32_t s = atomic_load_explicit(&wring_group_state(h)[g].slot, memory_order_relaxed);
	if (s >= h->n_slots)
		return 'E';
	struct wring_slot *sl = &wring_slots(h)[s];
	if (atomic_load_explicit(&sl->group, memory_order_relaxed) != g)
		return 'E';
	switch (atomic_load_explicit(&sl->state, memory_order_relaxed)) {
	case WSLOT_READY:
		return atomic_load_explicit(&sl->refs, memory_order_relaxed) ? 'H' : 'R';
	case WSLOT_LOADING:
		return 'L';
	default:
		return 'E';
	}
}

/* busy, tokens_computed and tokens_per_s (over the last second or more), weight_groups
 * (embed, head, and per layer the attn and ffn letters), copy_queue, KV blocks per layer. */
static void inspect_stats(struct runner *r, json_t *o)
{
	static uint64_t last_tokens, last_ns;
	static double rate;
	void *base = NULL;
	size_t size = 0;
	if (r->ring)
		ring_source_mapping(r->ring, &base, &size);
	struct wring_header *h = base;
	uint64_t tokens = h ? atomic_load_explicit(&h->runner.tokens, memory_order_relaxed) : 0, now = now_ns();
	if (!last_ns || tokens < last_tokens) { /* the first call, or a new ring */
		last_ns = now;
		last_tokens = tokens;
		rate = 0;
	} else if (now - last_ns >= 900000000ull) {
		rate = (double)(tokens - last_tokens) / ((double)(now - last_ns) / 1e9);
		last_ns = now;
		last_tokens = tokens;
	}
	json_object_set_new(o, "busy", json_boolean(r->current != NULL));
	json_object_set_new(o, "tokens_computed", json_integer((json_int_t)tokens));
	json_object_set_new(o, "tokens_per_s", json_real(rate));
	uint32_t n_layers = r->cfg.n_layers;
	if (h) {
		json_t *layers = json_array();
		uint32_t held = 0, copying = 0;
		for (uint32_t g = 0; g < h->n_groups; g++) {
			char c = group_letter(r, h, g);
			held += c == 'H';
			copying += c == 'C';
		}
		for (uint32_t l = 0; layers && l < n_layers; l++) {
			char pair[3] = {group_letter(r, h, group_id_attn(l)), group_letter(r, h, group_id_ffn(l)), 0};
			json_array_append_new(layers, json_string(pair));
		}
		char embed[2] = {group_letter(r, h, group_id_embed()), 0};
		char head[2] = {group_letter(r, h, group_id_head(&r->cfg)), 0};
		json_object_set_new(o, "weight_groups", json_pack("{s:s, s:s, s:o*}", "embed", embed, "head", head,
								  "layers", layers));
		json_object_set_new(o, "copy_queue", json_pack("{s:i, s:i}", "weights_h2d_in_flight", (int)copying,
							       "weight_grants_held", (int)held));
	}
	uint32_t *per_layer = r->cache && n_layers ? calloc(2 * (size_t)n_layers, sizeof(uint32_t)) : NULL;
	if (per_layer) {
		uint32_t used;
		kv_cache_usage(r->cache, &used, per_layer, per_layer + n_layers);
		json_t *gpu = json_array(), *store = json_array();
		for (uint32_t l = 0; gpu && store && l < n_layers; l++) {
			json_array_append_new(gpu, json_integer(per_layer[l]));
			json_array_append_new(store, json_integer(per_layer[n_layers + l]));
		}
		json_object_set_new(o, "kv_gpu_blocks_used", json_integer(used));
		json_object_set_new(o, "kv_layers", json_pack("{s:o*, s:o*}", "gpu", gpu, "store", store));
		free(per_layer);
	}
}

static char *stats(void *ctx)
{
	struct runner *r = ctx;
	struct kv_cache_stats ks = {0};
	if (r->cache)
		kv_cache_get_stats(r->cache, &ks);
	struct weight_source *ws = r->ring ? weights(r) : NULL;
	json_t *o = json_pack("{s:s, s:I, s:I, s:I, s:I, s:f, s:f, s:f, s:f, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:b, "
			      "s:I}",
			      "backend", r->ops->name, "requests", (json_int_t)r->requests, "failures",
			      (json_int_t)r->failures, "prompt_tokens", (json_int_t)r->prompt_tokens,
			      "tokens_generated", (json_int_t)r->tokens_generated, "prefill_ms", r->prefill_ms,
			      "decode_ms", r->decode_ms, "last_prefill_tok_s", r->last_prefill_tok_s,
			      "last_decode_tok_s", r->last_decode_tok_s, "weight_bytes_acquired",
			      (json_int_t)(ws ? ws->bytes_acquired : 0), "weight_acquires",
			      (json_int_t)(ws ? ws->acquires : 0), "kv_blocks_committed", (json_int_t)ks.committed,
			      "kv_blocks_fetched", (json_int_t)ks.fetched, "kv_gpu_blocks", (json_int_t)r->bp.n_kv_blocks,
			      "kv_block_bytes", (json_int_t)r->arena_block_bytes, "queued", (json_int_t)r->q_len,
			      "weights_all_resident", r->ring ? ring_source_all_resident(r->ring) : 0, "max_context",
			      (json_int_t)r->max_context);
	if (o) {
		json_object_set_new(o, "kv_prefix_lookups", json_integer((json_int_t)ks.prefix_lookups));
		json_object_set_new(o, "kv_prefix_positions", json_integer((json_int_t)ks.prefix_positions));
		json_object_set_new(o, "kv_prefix_blocks_on_gpu", json_integer((json_int_t)ks.prefix_on_gpu));
		json_object_set_new(o, "kv_rebuilds", json_integer((json_int_t)ks.recoveries));
		json_object_set_new(o, "kv_fetch_runs", json_integer((json_int_t)ks.fetch_runs));
		json_object_set_new(o, "kv_fetch_request_ms", json_real((double)ks.fetch_ns / 1e6));
		json_object_set_new(o, "kv_fetch_copy_ms", json_real((double)ks.copy_ns / 1e6));
		json_object_set_new(o, "kv_readahead_blocks", json_integer((json_int_t)ks.readahead_blocks));
		json_object_set_new(o, "kv_readahead_wait_ms", json_real((double)ks.readahead_wait_ns / 1e6));
	}
#ifdef PIPELINE_HAVE_CUDA
	if (o && r->win) {
		struct gpu_window_stats ws2;
		gpu_window_stats(r->win, &ws2);
		json_object_set_new(o, "predicted_ms_per_token", json_real(r->predicted_ms));
		json_object_set_new(o, "binding", json_string(r->binding ? r->binding : ""));
		json_t *g = json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:i, s:f, s:f, s:I}", "resident_groups",
				      (json_int_t)ws2.resident_groups, "streamed_groups", (json_int_t)ws2.streamed_groups,
				      "resident_bytes", (json_int_t)ws2.resident_bytes, "window_bytes",
				      (json_int_t)ws2.window_bytes, "streamed_bytes_per_token",
				      (json_int_t)ws2.streamed_bytes_per_token, "bytes_h2d", (json_int_t)ws2.bytes_h2d,
				      "copies", (json_int_t)ws2.copies, "late_copies", (json_int_t)ws2.late_copies, "depth",
				      (int)ws2.depth, "h2d_bytes_per_s", ws2.h2d_bytes_per_s, "copy_ms", ws2.copy_ms,
				      "timed_copies", (json_int_t)ws2.timed_copies);
		if (g)
			json_object_set_new(o, "gpu_window", g);
	}
#endif
	if (o)
		inspect_stats(r, o);
	if (o) {
		json_object_set_new(o, "tokenizer", json_boolean(r->tok != NULL));
		json_object_set_new(o, "chat_format", json_string(chat_format_name(chat_format_of(r->tok))));
	}
	char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
	json_decref(o);
	return text;
}

static void hello(void *ctx, const struct msg *req, struct msg_hello_reply *rep)
{
	struct runner *r = ctx;
	rep->manifest_hash = r->manifest_hash;
}

static const struct service_ops runner_ops = {.handle = handle, .stats = stats, .hello = hello};

/* ---- live tuning ---- */

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

static void max_context_get(void *ctx, struct tunable_value *v)
{
	v->i = ((struct runner *)ctx)->max_context;
}

/* Requests started from now on; the one running keeps its limit. */
static int max_context_set(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen)
{
	if (apply)
		((struct runner *)ctx)->max_context = v->i;
	return 0;
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

static void max_queued_get(void *ctx, struct tunable_value *v)
{
	v->i = ((struct runner *)ctx)->max_queued;
}

/* New requests past it are refused (EBUSY); those queued stay. */
static int max_queued_set(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen)
{
	if (apply)
		((struct runner *)ctx)->max_queued = v->i;
	return 0;
}

static void add_fixed_long(struct service *s, const char *name, enum tunable_type type, long long v, const char *help)
{
	char num[32];
	snprintf(num, sizeof(num), "%lld", v);
	service_add_fixed(s, name, type, num, help);
}

static void register_tunables(struct runner *r)
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
		 .type = TUNABLE_INT, .min = 2, .max = r->start_max_context, .get = max_context_get,
		 .set = max_context_set},
		{.name = "kv-fetch-batch",
		 .help = "KV blocks per kv-store ALLOC or FETCH at most (0: as many as the pool holds); smaller batches "
			 "make more requests, the values stay the same",
		 .type = TUNABLE_INT, .min = 0, .max = 65536, .get = fetch_batch_get, .set = fetch_batch_set},
		{.name = "max-queued",
		 .help = "generate requests queued at most; more are refused with EBUSY",
		 .type = TUNABLE_INT, .min = 1, .max = QUEUE_MAX, .get = max_queued_get, .set = max_queued_set},
	};
	for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) {
		t[i].ctx = r;
		service_add_tunable(s, &t[i]);
	}
	service_add_fixed(s, "backend", TUNABLE_STRING, r->ops->name, "the compute backend");
	add_fixed_long(s, "gpu-budget", TUNABLE_BYTES, (long long)r->gpu_budget, "GPU memory for weights (cuda)");
	add_fixed_long(s, "prefetch-depth", TUNABLE_INT, r->prefetch_depth,
		       "device slots per streamed group class (cuda): allocated at start");
	add_fixed_long(s, "copy-streams", TUNABLE_INT, r->copy_streams, "H2D copy streams (cuda): created at start");
	add_fixed_long(s, "h2d-bytes-per-s", TUNABLE_BYTES, (long long)r->h2d_bps, "H2D bandwidth of the plan");
	add_fixed_long(s, "hbm-bytes-per-s", TUNABLE_BYTES, (long long)r->hbm_bps, "GPU memory bandwidth of the plan");
	service_add_fixed(s, "strict", TUNABLE_BOOL, r->strict ? "true" : "false", "check the GPU window's invariants");
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
	service_add_fixed(s, "instance", TUNABLE_STRING, r->instance, "the instance name");
	service_add_fixed(s, "run-dir", TUNABLE_STRING, r->run_dir, "the run directory");
}

/* ---- start ---- */

static int setup(struct runner *r)
{
	char err[1024];
	r->ops = backend_find(r->backend_name);
	if (!r->ops) {
		if (!strcmp(r->backend_name, "cuda"))
			log_error("the cuda backend is not built into this gpu-runner (built without nvcc, or not yet "
				  "available); use --backend cpu");
		else
			log_error("unknown backend '%s' (cpu or cuda)", r->backend_name);
		return -EINVAL;
	}
	if (r->block_tokens < 1 || r->block_tokens > 4096 || r->prefill_chunk < 1 || r->prefill_chunk > 65536 ||
	    r->threads < 1 || r->threads > 1024 || r->max_context < 0 || r->timeout_ms < 100) {
		log_error("--kv-block-tokens (1..4096), --prefill-chunk (1..65536), --threads (1..1024), --max-context "
			  "(>= 0) or --timeout-ms (>= 100) out of range");
		return -EINVAL;
	}
	r->zctx = zmq_ctx_new();
	r->loader_c = rpc_client_create(r->zctx, r->run_dir, "ssd-loader", "gpu-runner");
	r->kv_c = rpc_client_create(r->zctx, r->run_dir, "kv-store", "gpu-runner");
	if (!r->zctx || !r->loader_c || !r->kv_c) {
		log_error("cannot create sockets under %s: %s", r->run_dir, strerror(errno));
		return -EIO;
	}
	/* One session for this process: a service that sees it again after a reconnect knows the
	 * blocks and slots it holds are still ours. */
	uint64_t session = random_u64() | 1;
	rpc_client_set_session(r->loader_c, session);
	rpc_client_set_session(r->kv_c, session);
	log_info("waiting for ssd-loader");
	int rc = connect_loader_retry(r, CONNECT_TIMEOUT_MS, err, sizeof(err));
	if (rc) {
		log_error("%s", err);
		return rc;
	}
	r->cfg = *ring_source_base(r->ring)->cfg;
	r->manifest_hash = ring_source_manifest_hash(r->ring);
	if (r->max_context == 0)
		r->max_context = r->cfg.max_position < 8192 ? r->cfg.max_position : 8192;
	if ((uint64_t)r->max_context > r->cfg.max_position) {
		log_warn("--max-context %ld exceeds the model's max_position_embeddings %u; using %u", r->max_context,
			 r->cfg.max_position, r->cfg.max_position);
		r->max_context = r->cfg.max_position;
	}
	enum dtype kv_dtype;
	if (!r->kv_dtype_name || !*r->kv_dtype_name)
		kv_dtype = strcmp(r->ops->name, "cpu") ? DT_BF16 : DT_F32;
	else if (!strcmp(r->kv_dtype_name, "f32"))
		kv_dtype = DT_F32;
	else if (!strcmp(r->kv_dtype_name, "bf16"))
		kv_dtype = DT_BF16;
	else {
		log_error("--kv-dtype '%s' is not f32 or bf16", r->kv_dtype_name);
		return -EINVAL;
	}
	r->bp = (struct backend_params){.max_chunk = (uint32_t)r->prefill_chunk,
					.block_tokens = (uint32_t)r->block_tokens,
					.kv_dtype = kv_dtype,
					.threads = (uint32_t)r->threads};
	r->arena_block_bytes = r->ops->kv_block_bytes(&r->cfg, &r->bp);
	r->pool_block_bytes = ALIGN_UP((uint64_t)r->arena_block_bytes, 4096);
	/* Blocks are reused only by a runner that would compute the same bytes: same model, same
	 * backend, same KV element type and block size. */
	r->kv_seed = fnv1a64(FNV64_INIT, &r->manifest_hash, sizeof(r->manifest_hash));
	r->kv_seed = fnv1a64(r->kv_seed, r->ops->name, strlen(r->ops->name));
	r->kv_seed = fnv1a64(r->kv_seed, &r->bp.kv_dtype, sizeof(r->bp.kv_dtype));
	r->kv_seed = fnv1a64(r->kv_seed, &r->bp.block_tokens, sizeof(r->bp.block_tokens));
	r->kv_seed |= 1;
	uint32_t per_layer = (uint32_t)((r->max_context + r->block_tokens - 1) / r->block_tokens);
	uint64_t all = (uint64_t)per_layer * r->cfg.n_layers;
	uint64_t fit = r->kv_gpu_budget / r->arena_block_bytes;
	uint32_t need = kv_cache_min_blocks(r->cfg.n_layers, (uint32_t)r->block_tokens, (uint32_t)r->prefill_chunk);
	if (fit < need && fit < all) {
		char have[32], want[32];
		log_error("--kv-gpu-budget %s holds %llu KV blocks of %zu bytes; at least %u blocks (%s) are needed",
			  format_size(r->kv_gpu_budget, have, sizeof(have)), (unsigned long long)fit,
			  r->arena_block_bytes, need, format_size((uint64_t)need * r->arena_block_bytes, want, sizeof(want)));
		return -ENOSPC;
	}
	r->bp.n_kv_blocks = (uint32_t)(fit < all ? fit : all);
	rc = r->ops->create(&r->cfg, &r->bp, &r->be, err, sizeof(err));
	if (rc) {
		log_error("backend %s: %s", r->ops->name, err);
		return rc;
	}
	if (r->prefetch_depth < 1 || r->prefetch_depth > 64 || r->copy_streams < 1 || r->copy_streams > 4) {
		log_error("--prefetch-depth (1..64) or --copy-streams (1..4) out of range");
		return -EINVAL;
	}
	rc = make_window(r, err, sizeof(err));
	if (rc) {
		log_error("%s", err);
		return rc;
	}
	struct kv_cache_params kp = {.n_layers = r->cfg.n_layers, .block_tokens = (uint32_t)r->block_tokens,
				     .max_context = (uint32_t)r->max_context, .max_chunk = (uint32_t)r->prefill_chunk,
				     .n_arena = r->bp.n_kv_blocks};
	rc = kv_cache_create(&kp, r->ops, r->be, &kv_remote_ops_pool, &r->kv, &r->cache, err, sizeof(err));
	if (rc) {
		log_error("%s", err);
		return rc;
	}
	r->kv.wait_hook = wait_beat;
	r->kv.wait_ctx = r;
	log_info("waiting for kv-store");
	rc = connect_kv(r, CONNECT_TIMEOUT_MS, err, sizeof(err));
	if (rc) {
		log_error("%s", err);
		return rc;
	}
	rc = engine_create(&r->cfg, r->ops, r->be, weights(r), r->cache, r->bp.max_chunk, &r->engine, err,
			   sizeof(err));
	if (rc) {
		log_error("%s", err);
		return rc;
	}
	engine_set_progress(r->engine, beat, r);
	log_info("backend %s, %u layers, KV arena %u blocks of %zu bytes (%ld tokens each), context %ld", r->ops->name,
		 r->cfg.n_layers, r->bp.n_kv_blocks, r->arena_block_bytes, r->block_tokens, r->max_context);
	return 0;
}

static void teardown(struct runner *r)
{
	engine_destroy(&r->engine);
	kv_cache_destroy(&r->cache);
	if (r->ops && r->be)
		r->ops->destroy(&r->be);
	unpin_pool(r);
	kv_remote_disconnect(&r->kv);
	drop_window(r);
	ring_source_destroy(&r->ring);
	tokenizer_destroy(&r->tok);
	rpc_client_destroy(&r->loader_c);
	rpc_client_destroy(&r->kv_c);
	if (r->zctx)
		zmq_ctx_term(r->zctx);
	for (uint32_t i = 0; i < r->q_len; i++) {
		struct job *j = &r->queue[(r->q_head + i) % QUEUE_MAX];
		if (r->svc)
			service_reply_error(r->svc, &j->peer, j->corr, ESHUTDOWN, "gpu-runner is stopping: request not run");
		job_free(j);
	}
	service_destroy(&r->svc);
}

int main(int argc, char **argv)
{
	struct runner r = {0};
	char default_run_dir[256];
	const struct opt opts[] = {
		{"instance", OPT_STRING, &r.instance, "default", "instance name (shared-memory names, run directory)"},
		{"run-dir", OPT_STRING, &r.run_dir, NULL, "run directory with the sockets (default /tmp/llmp-UID/INSTANCE)"},
		{"backend", OPT_STRING, &r.backend_name, backend_default_name(), "compute backend: cpu or cuda"},
		{"gpu-budget", OPT_SIZE, &r.gpu_budget, "6GiB", "GPU memory for weights (cuda backend; the cpu backend computes from the ring in place)"},
		{"prefetch-depth", OPT_INT, &r.prefetch_depth, "2",
		 "device slots per streamed group class: copies run this far ahead of compute"},
		{"copy-streams", OPT_INT, &r.copy_streams, "1", "H2D concurrency: weight copies spread over this many streams (1..4)"},
		{"h2d-bytes-per-s", OPT_SIZE, &r.h2d_bps, "0", "host-to-device bandwidth for the plan (0: measure at start)"},
		{"hbm-bytes-per-s", OPT_SIZE, &r.hbm_bps, "2.7TB", "GPU memory bandwidth the prediction assumes for reading weights"},
		{"strict", OPT_BOOL, &r.strict, NULL, "check the GPU window's invariants at every step"},
		{"profile-copies", OPT_BOOL, &r.profile_copies, NULL, "time every weight copy (stats: gpu_window.copy_ms)"},
		{"kv-dtype", OPT_STRING, &r.kv_dtype_name, NULL, "KV element type: f32 or bf16 (default: f32 on cpu, bf16 on cuda)"},
		{"kv-gpu-budget", OPT_SIZE, &r.kv_gpu_budget, "1GiB", "memory for the runner's KV blocks"},
		{"kv-block-tokens", OPT_INT, &r.block_tokens, "16", "tokens per KV block"},
		{"max-context", OPT_INT, &r.max_context, "0", "positions per sequence (0: min(model, 8192))"},
		{"prefill-chunk", OPT_INT, &r.prefill_chunk, "256", "most prompt tokens per forward step"},
		{"threads", OPT_INT, &r.threads, "1", "CPU threads of the cpu backend"},
		{"timeout-ms", OPT_INT, &r.timeout_ms, "60000", "how long to wait for a reply from another service"},
		{"log-level", OPT_STRING, &r.log_level, "info", "debug, info, warn or error"},
		{0},
	};
	int rc = config_parse("gpu-runner",
			      "Computes the model: takes weights from the ssd-loader's ring, keeps KV in its arena and the "
			      "kv-store, serves generate requests.",
			      opts, argc, argv, NULL, NULL);
	if (rc > 0)
		return 0;
	if (rc < 0)
		return 2;
	log_init("gpu-runner");
	enum log_level lv;
	if (log_parse_level(r.log_level, &lv) != 0) {
		fprintf(stderr, "gpu-runner: --log-level '%s' is not debug, info, warn or error\n", r.log_level);
		return 2;
	}
	log_set_level(lv);
	if (!r.run_dir) {
		if (run_dir_default(r.instance, default_run_dir, sizeof(default_run_dir)) != 0) {
			fprintf(stderr, "gpu-runner: run directory path too long\n");
			return 2;
		}
		r.run_dir = default_run_dir;
	}
	if (run_dir_prepare(r.run_dir) != 0)
		return 1;
	rc = setup(&r);
	if (rc == 0) {
		r.svc = service_create("gpu-runner", r.run_dir, &runner_ops, &r);
		if (!r.svc)
			rc = -EIO;
		else
			register_tunables(&r);
	}
	if (rc) {
		teardown(&r);
		return 1;
	}
	while (service_poll_once(r.svc, r.q_len ? 0 : 100) == 0) {
		if (!r.q_len) {
			release_dead_loader(&r);
			continue;
		}
		struct job *j = &r.queue[r.q_head];
		run_job(&r, j);
		job_free(j);
		r.q_head = (r.q_head + 1) % QUEUE_MAX;
		r.q_len--;
	}
	log_info("stopping");
	teardown(&r);
	return 0;
}

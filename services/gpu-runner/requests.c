/* requests.c - the gpu-runner's requests: MSG_GENERATE checked and queued (at most QUEUE_MAX,
 * or the max-queued tunable), then run one at a time: the prompt built (ids, text or chat), the
 * generation run with its tokens, logits and text streamed back, the weights handed back, and
 * MSG_GEN_DONE or the error sent. Between tokens the service keeps answering. */
#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/service.h"
#include "common/util.h"
#include "services/gpu-runner/runner.h"
#include "services/gpu-runner/text.h"
#include "services/gpu-runner/weights_ring.h"
#ifdef PIPELINE_HAVE_CUDA
#include "services/gpu-runner/gpu_window.h"
#endif

void runner_job_free(struct job *j)
{
	text_prompt_free(&j->tp);
	text_stream_destroy(&j->ts);
	free(j->emitted);
	free(j->tokens);
	free(j->stop);
	free(j->done);
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

enum gen_emit runner_job_emit(void *ctx, uint32_t index, int32_t token)
{
	struct job *j = ctx;
	struct runner *r = j->r;
	struct msg m;
	msg_init(&m, MSG_TOKEN, j->corr);
	m.token.index = index;
	m.token.token = (uint64_t)token;
	bool hit = false;
	/* The token that ends the run (an end-of-sequence, end-of-turn or stop id) is sent as an id
	 * with no text: an answer ends before it, as OpenAI's and a chat's do (its text was
	 * "<|eot_id|>" at the end of every Llama 3 chat answer). */
	if (j->ts && !gen_is_stop(&r->cfg, &j->params, token)) {
		const char *piece;
		size_t len;
		if (text_stream_push(j->ts, token, &piece, &len, &hit) == 0 && (j->flags & GEN_TEXT)) {
			m.token.text.p = (char *)piece;
			m.token.text.len = (uint32_t)len;
		}
	}
	ring_source_count_token(r->ring);
	trim_retired(r);
	/* The steps to come weigh the CPU's experts at the rate the last ones ran at: the warm-up of a
	 * run is not its steady state (MX2: the first request's spans at 77 GB/s, the next one's at 85-88). */
	if (r->expert_rate_within)
		runner_expert_rate(r, true);
	if (j->n_emitted == j->cap_emitted) {
		uint32_t cap = j->cap_emitted ? 2 * j->cap_emitted : 256;
		int32_t *e = realloc(j->emitted, cap * sizeof(int32_t));
		if (e) {
			j->emitted = e;
			j->cap_emitted = cap;
		}
	}
	if (j->n_emitted < j->cap_emitted)
		j->emitted[j->n_emitted++] = token;
	const int src = service_reply(r->svc, &j->peer, &m);
	if (src == -EHOSTUNREACH) {
		log_warn("the client of request %llu went away: cancelling it", (unsigned long long)j->corr);
		return GEN_CANCEL;
	}
	if (src == -EAGAIN) {
		/* Its tokens would be lost from here on, and its end with them. */
		log_warn("the client of request %llu has not read its last %d replies: cancelling it",
			 (unsigned long long)j->corr, BUS_ROUTER_HWM);
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
	struct job *j = ctx;
	struct msg m;
	msg_init(&m, MSG_LOGITS, j->corr);
	m.logits.position = position;
	m.logits.values.p = (char *)logits; /* float32 in host order: little-endian on every target */
	m.logits.values.len = n * (uint32_t)sizeof(float);
	int rc = service_reply(j->r->svc, &j->peer, &m);
	j->logits_sent = true;
	if (rc == -EHOSTUNREACH) {
		/* As a client gone between tokens: cancelled, not a failure (which would have both peers
		 * checked, and the window and the engine made anew, before the next request). */
		log_warn("the client of request %llu went away before its prompt's logits: cancelling it",
			 (unsigned long long)j->corr);
		return -ECANCELED;
	}
	return 0;
}

/* Prefill is done: weight-copy timing from here on measures decode alone. */
static void decode_starts(void *ctx)
{
#ifdef PIPELINE_HAVE_CUDA
	struct job *j = ctx;
	if (j->r->win)
		gpu_window_reset_timing(j->r->win);
#else
	(void)ctx;
#endif
}

static int job_kv_failure(void *ctx, char *err, size_t errlen)
{
	struct job *j = ctx;
	return runner_kv_failure(j->r, err, errlen);
}

/* j's text stream (its stop strings) over r->tok, fed the n ids already sent without sending them
 * again (stop strings that span the cut, text held back); a stop string among them ends a resumed
 * run at once (done_stop_string). A stop id is no text, and an id the tokenizer does not decode
 * (a vocabulary padded past the tokenizer's) is no text, as in a live run (runner_job_emit), not
 * a failure. */
static int job_text_stream(struct runner *r, struct job *j, const int32_t *sent, uint32_t n, char *err,
			   size_t errlen)
{
	int rc = text_stream_create(r->tok, j->stop_strings, j->stop_strings_len, &j->ts, err, errlen);
	for (uint32_t i = 0; rc == 0 && i < n; i++) {
		const char *piece;
		size_t len;
		bool hit = false;
		if (!gen_is_stop(&r->cfg, &j->params, sent[i]) &&
		    text_stream_push(j->ts, sent[i], &piece, &len, &hit) == 0 && hit)
			j->params.done_stop_string = true;
	}
	return rc;
}

int runner_job_prepare(struct runner *r, struct job *j, char *err, size_t errlen)
{
	j->r = r;
	j->ids = j->tokens;
	j->n_ids = j->n_tokens;
	j->tp = (struct text_prompt){.end_of_turn = -1};
	int rc = 0;
	if (!j->n_tokens) {
		struct msg_generate g = {.prompt = {j->prompt, j->prompt_len}, .chat = {j->chat, j->chat_len},
					 .flags = j->flags};
		rc = text_prompt_build(r->tok, r->chat_template, &r->cfg, &g, &j->tp, err, errlen);
		j->ids = (const int32_t *)j->tp.ids.ids; /* ids < vocab_size < 2^31 */
		j->n_ids = (uint32_t)j->tp.ids.n;
		if (rc == 0 && j->tp.end_of_turn >= 0)
			j->stop[j->params.n_stop++] = j->tp.end_of_turn;
	}
	if (rc == 0 && ((j->flags & GEN_TEXT) || j->stop_strings_len)) {
		if (!r->tok) {
			rc = -ENOTSUP;
			snprintf(err, errlen, "the model has no tokenizer (no tokenizer.json, nor one in its GGUF file): no text output and no stop strings");
		} else {
			/* A resumed request: the text before the cut was sent already. */
			rc = job_text_stream(r, j, j->done, j->params.n_done, err, errlen);
		}
	}
	/* What was sent before a resume (MSG_GENERATE's done) counts as sent. */
	if (rc == 0 && j->params.n_done) {
		j->emitted = malloc(j->params.n_done * sizeof(int32_t));
		if (!j->emitted) {
			rc = -ENOMEM;
			snprintf(err, errlen, "out of memory");
		} else {
			memcpy(j->emitted, j->params.done, j->params.n_done * sizeof(int32_t));
			j->n_emitted = j->cap_emitted = j->params.n_done;
		}
	}
	j->refused = rc != 0 && rc != -ENOMEM; /* its input: no peer to check */
	return rc;
}

int runner_release_weights(struct runner *r, bool stopping, char *err, size_t errlen)
{
	/* The KV blocks allocated ahead go back too: an idle runner holds none (kv_remote.h). */
	if (kv_remote_release_stash(&r->kv) != 0)
		log_warn("handing back the KV blocks allocated ahead: %s", r->kv.error);
	/* Hand streamed groups back; a dead loader would only make the client wait a timeout, and
	 * a runner that stops needs not (the loader drops them at the next runner's HELLO). */
	int wrc = !stopping && ring_source_owner_alive(r->ring) ? runner_weights(r)->ops->release_all(runner_weights(r)) : 0;
	if (wrc && !ring_source_owner_alive(r->ring)) {
		/* It died between the check and the release: what we held died with it. */
		log_warn("ssd-loader went away while the request's weights were handed back: %s",
			 runner_weights(r)->error);
		r->loader_suspect = true;
		wrc = 0;
	}
	if (wrc)
		snprintf(err, errlen, "%s", runner_weights(r)->error);
	return wrc;
}

void runner_job_reply(struct runner *r, struct job *j, int rc, const struct gen_result *res, const char *err)
{
	if (rc) {
		r->failures++;
		/* Check both peers before the next request, unless the request failed of itself: its
		 * input refused (runner_job_prepare: a bad chat or stop strings; -E2BIG: a prompt longer
		 * than the context), or cancelled (its client gone, a stop). A reconnection makes the
		 * window and the engine anew: every invalid request paid for it, a GPU's weights copied
		 * again. */
		if (!j->refused && rc != -E2BIG && rc != -ECANCELED) {
			r->loader_suspect = true;
			r->kv_suspect = true;
		}
		log_error("request %llu failed: %s", (unsigned long long)j->corr, err);
		service_reply_error(r->svc, &j->peer, j->corr, -rc, err);
		return;
	}
	const char *tail = "";
	size_t tail_len = 0;
	if (j->ts && (j->flags & GEN_TEXT))
		text_stream_finish(j->ts, &tail, &tail_len);
	struct msg m;
	msg_init(&m, MSG_GEN_DONE, j->corr);
	m.gen_done.n_prompt = res->n_prompt;
	m.gen_done.n_generated = res->n_generated;
	m.gen_done.reason.p = (char *)res->reason;
	m.gen_done.reason.len = (uint32_t)strlen(res->reason);
	m.gen_done.prefill_ms = res->prefill_ms;
	m.gen_done.decode_ms = res->decode_ms;
	m.gen_done.text.p = (char *)tail;
	m.gen_done.text.len = (uint32_t)tail_len;
	const int src = service_reply(r->svc, &j->peer, &m);
	/* A client gone (its request cancelled for it, and said so) is not said again. */
	if (src && !(src == -EHOSTUNREACH && !strcmp(res->reason, "cancelled")))
		log_warn("request %llu: its end could not be sent to its client (%s): %s",
			 (unsigned long long)j->corr, res->reason,
			 src == -EAGAIN ? "it has not read its earlier replies" : strerror(-src));
	r->prompt_tokens += res->n_prompt;
	/* Tokens this runner generated: not those the client's resume gave (a stage's resume moves
	 * params.n_done up to what was sent, which this runner did generate). */
	r->tokens_generated += res->n_generated - (res->n_generated >= j->n_done_asked ? j->n_done_asked : 0);
	r->prefill_ms += res->prefill_ms;
	r->decode_ms += res->decode_ms;
	r->last_prefill_tok_s = res->prefill_ms > 0 ? res->n_prompt / (res->prefill_ms / 1e3) : 0;
	r->last_decode_tok_s =
		res->decode_ms > 0 && res->n_generated > 1 ? (res->n_generated - 1) / (res->decode_ms / 1e3) : 0;
	log_info("request %llu: %u prompt tokens (%u restored from the kv-store), %u generated (%s), prefill "
		 "%.1f tok/s, decode %.1f tok/s%s",
		 (unsigned long long)j->corr, res->n_prompt, res->n_restored, res->n_generated, res->reason,
		 r->last_prefill_tok_s, r->last_decode_tok_s, res->n_rebuilds ? ", KV rebuilt after a kv-store failure" : "");
}

void runner_between_requests(struct runner *r)
{
	runner_replan_experts(r); /* hotter experts kept on the GPU */
	runner_replan_split(r);	  /* the CPU's share at the rate its jobs ran at */
	runner_expert_rate(r, false); /* the CPU's experts weighed at the rate they ran at */
}

/* The job's text stream made again over r->tok, fed the tokens sent so far (nothing sent): a
 * reconnection to the loader in the middle of a request loads the tokenizer anew, and the old
 * stream's decoder points into the one it freed. A stop string among them (a stage that died as
 * the request ended) ends the resumed run at once. */
static int job_text_again(struct runner *r, struct job *j, char *err, size_t errlen)
{
	if (!j->ts)
		return 0;
	text_stream_destroy(&j->ts);
	if (!r->tok) {
		snprintf(err, errlen, "the loader's tokenizer went away under the request");
		return -EPROTO;
	}
	return job_text_stream(r, j, j->emitted, j->n_emitted, err, errlen);
}

static void run_job(struct runner *r, struct job *j)
{
	char err[1024] = "";
	struct gen_result res = {0};
	bool ran = false, stopping = false;
	const uint64_t corr = j->corr;
	r->current = j;
	r->requests++;
	runner_between_requests(r);
	int rc = runner_ensure_connections(r, j->queued_ns, err, sizeof(err));
	if (rc == 0)
		rc = runner_job_prepare(r, j, err, sizeof(err));
	if (rc == 0) {
		ran = true;
		j->max_context = (uint32_t)r->max_context;
		rc = generate_run(r->engine, j->ids, j->n_ids, j->max_context, &j->params, runner_job_emit, j,
				  &res, err, sizeof(err));
		/* A stage of a split model died under the request: once the ranks are formed again it goes
		 * on from the tokens sent, as a request resumed after its runner died does (generate.h):
		 * the client sees the tokens of an uninterrupted run. */
		for (uint32_t tries = 0; rc && rc != -ECANCELED && runner_stage_failed(r) && tries < 3; tries++) {
			log_warn("request %llu: %s; resuming after %u tokens once the stages are formed again",
				 (unsigned long long)j->corr, err, j->n_emitted);
			char why[512];
			if (runner_ensure_connections(r, 0, why, sizeof(why)) != 0) {
				size_t k = strlen(err);
				snprintf(err + k, sizeof(err) - k, "; the stages did not form again: %.480s", why);
				break;
			}
			if ((rc = job_text_again(r, j, why, sizeof(why))) != 0) {
				size_t k = strlen(err);
				snprintf(err + k, sizeof(err) - k, "; its text after the stages formed again: %.480s", why);
				break;
			}
			j->params.done = j->emitted;
			j->params.n_done = j->n_emitted;
			if (j->logits_sent)
				j->params.on_logits = NULL;
			r->stage_resumes++;
			err[0] = 0;
			rc = generate_run(r->engine, j->ids, j->n_ids, j->max_context, &j->params, runner_job_emit,
					  j, &res, err, sizeof(err));
		}
		stopping = rc == -ECANCELED && service_stop_requested(r->svc);
	}
	runner_job_reply(r, j, rc, &res, err);
	/* The streamed weights go back after the reply, as after a batched step: the end of a request
	 * never waits on the loader (one killed just then was waited for in slices, but waited for). */
	if (ran) {
		char werr[512];
		if (runner_release_weights(r, stopping, werr, sizeof(werr)) != 0) {
			log_warn("handing the weights back after request %llu: %s", (unsigned long long)corr, werr);
			r->loader_suspect = true; /* checked before the next request */
		}
	}
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
		snprintf(errtext, errlen, "the model has no tokenizer (no tokenizer.json, nor one in its GGUF file), so the runner takes token ids only and "
			 "returns ids only (start the loader with --tokenizer FILE)");
		return -ENOTSUP;
	}
	/* A prompt of ids that cannot fit is refused now, not after the requests queued before it (a
	 * text prompt's length is known once it is built, when the request runs; the run checks both
	 * against the context then in force: max-context is tunable). */
	if (g->tokens.n && r->max_context > 0 && g->tokens.n >= (uint64_t)r->max_context) {
		snprintf(errtext, errlen, "the prompt has %u tokens; it must be shorter than the context of %llu (--max-context)",
			 g->tokens.n, (unsigned long long)r->max_context);
		return -E2BIG;
	}
	if (g->max_new > (1u << 24)) {
		snprintf(errtext, errlen, "max_new %llu is too large", (unsigned long long)g->max_new);
		return -EINVAL;
	}
	/* A repetition penalty is 0 (off) or in [1e-6, 1e6]: a logit divided by a tinier one is
	 * infinite in float32 (float's own range would take 1e-45 to 0). */
	const bool penalty_ok = isfinite(g->repetition_penalty) &&
				(g->repetition_penalty == 0 || (g->repetition_penalty >= 1e-6 && g->repetition_penalty <= 1e6));
	if (!isfinite(g->temperature) || g->temperature < 0 || !isfinite(g->top_p) || g->top_p < 0 || g->top_p > 1 ||
	    !isfinite(g->min_p) || g->min_p < 0 || g->min_p > 1 || !penalty_ok) {
		snprintf(errtext, errlen,
			 "temperature must be >= 0, top_p and min_p in [0, 1], repetition_penalty 0 (off) or in [1e-6, 1e6]");
		return -EINVAL;
	}
	if (g->done.n > g->max_new) {
		snprintf(errtext, errlen, "the resumed request gives %u generated tokens; max_new is %llu", g->done.n,
			 (unsigned long long)g->max_new);
		return -EINVAL;
	}
	for (uint32_t i = 0; i < g->done.n; i++) {
		if (g->done.v[i] >= r->cfg.vocab_size) {
			snprintf(errtext, errlen, "resumed token %u is %llu, outside the vocabulary of %u", i,
				 (unsigned long long)g->done.v[i], r->cfg.vocab_size);
			return -EINVAL;
		}
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
	j->queued_ns = now_ns();
	j->peer = *peer;
	j->corr = req->corr;
	j->n_tokens = g->tokens.n;
	j->n_done_asked = g->done.n;
	j->flags = g->flags;
	j->tokens = malloc(sizeof(int32_t) * (g->tokens.n + 1));
	j->stop = malloc(sizeof(int32_t) * (g->stop_ids.n + 1));
	j->done = g->done.n ? malloc(sizeof(int32_t) * g->done.n) : NULL;
	if (!j->tokens || !j->stop || (g->done.n && !j->done) || copy_bytes(&g->prompt, &j->prompt, &j->prompt_len) ||
	    copy_bytes(&g->chat, &j->chat, &j->chat_len) ||
	    copy_bytes(&g->stop_strings, &j->stop_strings, &j->stop_strings_len)) {
		runner_job_free(j);
		snprintf(errtext, errlen, "out of memory");
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < g->tokens.n; i++)
		j->tokens[i] = (int32_t)g->tokens.v[i];
	for (uint32_t i = 0; i < g->done.n; i++)
		j->done[i] = (int32_t)g->done.v[i];
	for (uint32_t i = 0; i < g->stop_ids.n; i++)
		j->stop[i] = g->stop_ids.v[i] > INT32_MAX ? -1 : (int32_t)g->stop_ids.v[i];
	j->params = (struct gen_params){
		.max_new = (uint32_t)g->max_new,
		.sampling = {.temperature = sampler_temperature(g->temperature), .top_k = g->top_k > UINT32_MAX ? 0 : (uint32_t)g->top_k,
			     .top_p = g->top_p == 0 ? 1.0f : (float)g->top_p, .seed = g->seed, .min_p = (float)g->min_p},
		.repetition_penalty = (float)g->repetition_penalty,
		.ignore_eos = (g->flags & GEN_IGNORE_EOS) != 0,
		.on_logits = (g->flags & GEN_LOGITS) ? send_logits : NULL,
		.on_decode = decode_starts,
		.on_kv_failure = job_kv_failure,
		.kv_seed = r->kv_seed,
		.stop_ids = j->stop,
		.n_stop = g->stop_ids.n,
		.done = j->done,
		.n_done = g->done.n,
	};
	r->q_len++;
	return 0;
}

void runner_run_next(struct runner *r)
{
	assert(r->q_len > 0);
	struct job *j = &r->queue[r->q_head];
	run_job(r, j);
	runner_job_free(j);
	r->q_head = (r->q_head + 1) % QUEUE_MAX;
	r->q_len--;
}

void runner_drop_queued(struct runner *r)
{
	for (uint32_t i = 0; i < r->q_len; i++) {
		struct job *j = &r->queue[(r->q_head + i) % QUEUE_MAX];
		if (r->svc)
			service_reply_error(r->svc, &j->peer, j->corr, ESHUTDOWN, "gpu-runner is stopping: request not run");
		runner_job_free(j);
	}
	r->q_len = 0;
}

int runner_handle(void *ctx, struct service *s, const struct bus_peer *peer, const struct msg *req, char *errtext,
		  size_t errlen)
{
	struct runner *r = ctx;
	if (req->type == MSG_GENERATE) {
		if (r->rank)
			return errorf(errtext, errlen, -EINVAL, "%s computes layers %u..%u of a split model; send "
				      "requests to gpu-runner (the first stage)", r->service_name, r->stage.layer0,
				      r->stage.layer1 - 1);
		return queue_generate(r, peer, req, errtext, errlen);
	}
	if (req->type == MSG_STAGE_SETUP || req->type == MSG_STAGE_SEQ || req->type == MSG_STAGE_STEP)
		return runner_handle_stage(r, s, peer, req, errtext, errlen);
	snprintf(errtext, errlen, "gpu-runner does not handle %s", msg_type_name(req->type));
	return -ENOTSUP;
}

#include "services/gpu-runner/generate.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"

bool gen_is_stop(const struct model_config *cfg, const struct gen_params *p, int32_t tok)
{
	if (!p->ignore_eos)
		for (uint32_t i = 0; i < cfg->n_eos; i++)
			if (cfg->eos_ids[i] == tok)
				return true;
	for (uint32_t i = 0; i < p->n_stop; i++)
		if (p->stop_ids[i] == tok)
			return true;
	return false;
}

/* Computes the KV of seq[from, upto) without logits, as the first pass did: prompt positions
 * in chunks on the same grid (multiples of the chunk size, ending at the prompt's end),
 * generated positions one at a time, so that a rebuilt cache holds the same values. */
static int catch_up(struct engine *e, const int32_t *seq, uint32_t from, uint32_t upto, uint32_t n_prompt)
{
	uint32_t chunk = engine_max_chunk(e);
	for (uint32_t pos = from; pos < upto;) {
		uint32_t end = pos + 1;
		if (pos < n_prompt) {
			end = (pos / chunk + 1) * chunk;
			if (end > n_prompt)
				end = n_prompt;
		}
		if (end > upto)
			end = upto;
		int rc = engine_forward(e, seq + pos, end - pos, pos, NULL);
		if (rc)
			return rc;
		pos = end;
	}
	return 0;
}

/* A step failed because the kv-store failed a request (it dropped a block that failed its
 * checksum, or it restarted). Lets the caller reconnect, then rebuilds the KV of seq[0, upto):
 * the prefix the store still holds comes back, the rest is computed again. Returns 0 (retry
 * the step) or -errno with err set. */
static int rebuild(struct engine *e, const struct gen_params *p, void *ctx, const int32_t *seq, uint32_t upto,
		   uint32_t n_prompt, uint32_t *attempts, char *err, size_t errlen)
{
	struct kv_cache *kv = engine_kv(e);
	for (;;) {
		if (++*attempts > GEN_MAX_REBUILDS) {
			snprintf(err, errlen, "the KV cache failed %u times in one request; last: %s", GEN_MAX_REBUILDS,
				 kv_cache_error(kv));
			return -EIO;
		}
		log_warn("rebuilding the KV cache of %u positions: %s", upto, kv_cache_error(kv));
		int rc = p->on_kv_failure ? p->on_kv_failure(ctx, err, errlen) : 0;
		if (rc)
			return rc;
		if ((rc = engine_kv_recover(e)) == 0) {
			int restored = engine_restore_prefix(e, seq, upto + 1, p->kv_seed);
			rc = restored < 0 ? restored : catch_up(e, seq, (uint32_t)restored, upto, n_prompt);
			if (rc == 0)
				return 0;
		}
		if (!kv_cache_remote_failed(kv)) {
			snprintf(err, errlen, "rebuilding the KV cache: %s", engine_error(e));
			return rc;
		}
	}
}

/* The end of a request: our references to the store's blocks go back. If the store went away
 * just now, a request that has produced every token waits for it (on_kv_failure) and hands them
 * back to its successor, which adopted them; a request that failed leaves the reconnect to the
 * next one. Whatever happens, the cache is empty afterwards. With request_ok, a failure's
 * message goes to err. */
static int end_sequence(struct engine *e, const struct gen_params *p, void *ctx, bool request_ok, char *err,
			size_t errlen)
{
	struct kv_cache *kv = engine_kv(e);
	int rc = engine_seq_end(e);
	if (rc && kv_cache_remote_failed(kv) && request_ok && p->on_kv_failure) {
		char why[256];
		log_warn("handing the request's KV blocks back: %s", engine_error(e));
		if (p->on_kv_failure(ctx, why, sizeof(why)) == 0)
			rc = kv_cache_recover(kv);
	}
	if (rc) {
		if (request_ok)
			snprintf(err, errlen, "%s", kv_cache_remote_failed(kv) ? kv_cache_error(kv) : engine_error(e));
		kv_cache_forget_remote(kv);
	}
	return rc;
}

/* Resuming: the KV of seq[0, n_prompt + n_done - 1) (the prompt and every generated token but the
 * last, which the first decode step feeds), restored from the store or computed as the first run
 * computed it. Returns 0 or -errno with err set. */
static int resume_cache(struct engine *e, const struct gen_params *p, void *ctx, const int32_t *seq,
			uint32_t n_prompt, uint32_t n_done, uint32_t *attempts, struct gen_result *res, char *err,
			size_t errlen)
{
	struct kv_cache *kv = engine_kv(e);
	uint32_t upto = n_prompt + n_done - 1;
	int restored;
	while ((restored = p->kv_seed ? engine_restore_prefix(e, seq, upto + 1, p->kv_seed) : 0) < 0) {
		if (!kv_cache_remote_failed(kv)) {
			snprintf(err, errlen, "%s", engine_error(e));
			return restored;
		}
		int rc = rebuild(e, p, ctx, seq, 0, n_prompt, attempts, err, errlen);
		if (rc)
			return rc;
	}
	res->n_restored = (uint32_t)restored;
	int rc = catch_up(e, seq, (uint32_t)restored, upto, n_prompt);
	if (rc && kv_cache_remote_failed(kv))
		return rebuild(e, p, ctx, seq, upto, n_prompt, attempts, err, errlen);
	if (rc)
		snprintf(err, errlen, "restoring the resumed request's cache: %s", engine_error(e));
	return rc;
}

/* ---- one sequence, a step at a time (generate.h: struct gen_seq) ---- */

enum gen_state {
	GS_PREFILL = 0, /* prompt positions [pos, n_prompt) to compute */
	GS_FEED = 1,	/* the token `pending` to feed at pos (a decode step) */
	GS_DONE = 2,
};

struct gen_seq {
	struct engine *e;
	struct kv_cache *kv;
	const struct model_config *cfg;
	struct gen_params p;
	gen_emit_fn emit;
	void *ctx;
	uint32_t n_prompt, max_context, chunk;
	int32_t *seq;	    /* the sequence so far (prompt, then each token as it is fed back): names KV blocks */
	uint32_t seq_n;
	float *logits;	    /* (vocab) the host's copy, for a step computed one sequence at a time */
	struct sampler *s;
	uint8_t *seen;	    /* with a repetition penalty: the tokens in the sequence so far */
	bool penalty, greedy, device_draw;
	enum gen_state state;
	uint32_t pos;	    /* the next position to compute */
	int32_t pending;    /* GS_FEED: the token fed at pos */
	double u;	    /* GS_FEED with device_draw: the step's uniform (the same on a retry; a float
			     * could round it up to 1, which no draw takes) */
	bool u_ready;	    /* u is drawn for the coming token (a decode step's), not yet used */
	uint32_t attempts;  /* KV rebuilds */
	bool untouched;	    /* ended before its cache was used (a resume cut after its last token) */
	uint64_t t0, t1;    /* prefill's and decode's start */
	struct gen_result res;
};

bool gen_seq_done(const struct gen_seq *g)
{
	return g->state == GS_DONE;
}

/* Decode begins (the prompt's last logits are in, or a resume restored its cache). */
static void enter_decode(struct gen_seq *g)
{
	if (g->penalty)
		for (uint32_t i = 0; i < g->seq_n; i++)
			g->seen[g->seq[i]] = 1;
	if (g->p.on_decode)
		g->p.on_decode(g->ctx);
	g->t1 = now_ns();
}

/* The next token from logits (host) or the device's pick (tok >= 0): emitted, then either the
 * sequence ends (res.reason) or the token is fed in the next step. */
static void take_token(struct gen_seq *g, float *logits, int32_t tok)
{
	const struct model_config *cfg = g->cfg;
	if (g->res.n_generated >= g->p.max_new) {
		g->state = GS_DONE;
		return;
	}
	if (tok < 0) {
		if (g->penalty)
			for (uint32_t v = 0; v < cfg->vocab_size; v++)
				if (g->seen[v])
					logits[v] = logits[v] < 0 ? logits[v] * g->p.repetition_penalty
								  : logits[v] / g->p.repetition_penalty;
		/* A device draw's uniform is drawn ahead (the step may be picked on the device): the
		 * host draws with it when the step brought the logits here instead. */
		tok = g->device_draw && g->u_ready ? sampler_pick_u(g->s, logits, g->u) : sampler_pick(g->s, logits);
	}
	g->u_ready = false;
	uint32_t index = g->res.n_generated++;
	if (g->penalty)
		g->seen[tok] = 1;
	enum gen_emit said = g->emit ? g->emit(g->ctx, index, tok) : GEN_CONTINUE;
	g->state = GS_DONE;
	if (said == GEN_CANCEL)
		g->res.reason = "cancelled";
	else if (said == GEN_STOP_STRING)
		g->res.reason = "stop_string";
	else if (gen_is_stop(cfg, &g->p, tok))
		g->res.reason = "stop";
	else if (g->res.n_generated == g->p.max_new)
		; /* "length" */
	else if (g->pos >= g->max_context)
		g->res.reason = "context";
	else
		g->state = GS_FEED;
	if (g->state != GS_FEED)
		return;
	g->seq[g->seq_n++] = tok; /* pos == seq_n - 1 */
	g->pending = tok;
	g->u = g->device_draw ? sampler_next_uniform(g->s) : 0;
	g->u_ready = g->device_draw;
}

int gen_seq_create(struct engine *e, struct kv_cache *kv, const int32_t *prompt, uint32_t n_prompt,
		   uint32_t max_context, const struct gen_params *p, bool host_logits, gen_emit_fn emit, void *ctx,
		   struct gen_seq **out, char *err, size_t errlen)
{
	const struct model_config *cfg = engine_config(e);
	*out = NULL;
	if (n_prompt == 0) {
		snprintf(err, errlen, "the prompt is empty: give at least one token");
		return -EINVAL;
	}
	if (n_prompt >= max_context) {
		snprintf(err, errlen,
			 "the prompt has %u tokens; it must be shorter than the context of %u (--max-context)",
			 n_prompt, max_context);
		return -E2BIG;
	}
	for (uint32_t i = 0; i < n_prompt; i++) {
		if (prompt[i] < 0 || (uint32_t)prompt[i] >= cfg->vocab_size) {
			snprintf(err, errlen, "prompt token %u is %d, outside the vocabulary of %u", i, prompt[i],
				 cfg->vocab_size);
			return -EINVAL;
		}
	}
	uint32_t n_done = p->done ? p->n_done : 0;
	if (n_done > p->max_new) {
		snprintf(err, errlen, "the resumed request gives %u generated tokens; it asked for %u", n_done,
			 p->max_new);
		return -EINVAL;
	}
	for (uint32_t i = 0; i < n_done; i++) {
		if (p->done[i] < 0 || (uint32_t)p->done[i] >= cfg->vocab_size) {
			snprintf(err, errlen, "resumed token %u is %d, outside the vocabulary of %u", i, p->done[i],
				 cfg->vocab_size);
			return -EINVAL;
		}
	}
	struct gen_seq *g = calloc(1, sizeof(*g));
	if (!g) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	*g = (struct gen_seq){.e = e, .kv = kv, .cfg = cfg, .p = *p, .emit = emit, .ctx = ctx, .n_prompt = n_prompt,
			      .max_context = max_context, .chunk = engine_max_chunk(e), .seq_n = n_prompt};
	g->res = (struct gen_result){.n_prompt = n_prompt, .reason = "length"};
	*out = g;
	/* Cut off after its last token (before its MSG_GEN_DONE): it ends as it would have, for the
	 * reason the decode would have given. */
	if (n_done) {
		g->res.reason = NULL;
		if (p->done_stop_string)
			g->res.reason = "stop_string";
		else if (gen_is_stop(cfg, p, p->done[n_done - 1]))
			g->res.reason = "stop";
		else if (n_done == p->max_new)
			g->res.reason = "length";
		else if ((uint64_t)n_prompt + n_done > max_context)
			g->res.reason = "context";
		if (g->res.reason) {
			g->res.n_generated = n_done;
			g->state = GS_DONE;
			g->untouched = true;
			return 0;
		}
		g->res.reason = "length";
	}
	g->logits = malloc(sizeof(float) * cfg->vocab_size);
	g->s = sampler_create(&p->sampling, cfg->vocab_size);
	g->penalty = p->repetition_penalty > 0 && p->repetition_penalty != 1.0f;
	g->seen = g->penalty ? calloc(cfg->vocab_size, 1) : NULL;
	uint64_t cap = (uint64_t)n_prompt + p->max_new + 1 < max_context ? (uint64_t)n_prompt + p->max_new + 1
									  : max_context;
	g->seq = malloc(sizeof(int32_t) * (cap > n_prompt + n_done ? cap : n_prompt + n_done));
	if (!g->logits || !g->s || (g->penalty && !g->seen) || !g->seq) {
		snprintf(err, errlen, "out of memory");
		g->state = GS_DONE;
		return -ENOMEM;
	}
	/* Greedy without a penalty needs only the best id each step: the backend finds it where the
	 * logits are (on the GPU, the vocabulary then never crosses the bus). Sampling without a
	 * penalty can draw on the device too, with a uniform from our generator. Steps of several
	 * sequences bring every sequence's logits to the host (host_logits). */
	g->greedy = !host_logits && !(p->sampling.temperature > 0) && !g->penalty;
	g->device_draw = !host_logits && !g->greedy && !g->penalty && engine_samples_on_device(e);
	memcpy(g->seq, prompt, sizeof(int32_t) * n_prompt);
	if (n_done) {
		memcpy(g->seq + n_prompt, p->done, sizeof(int32_t) * n_done);
		g->seq_n += n_done;
	}
	engine_set_kv(e, kv);
	if (p->kv_seed)
		kv_cache_set_sequence(kv, g->seq, &g->seq_n, p->kv_seed);
	g->t0 = now_ns();
	int rc;
	if (n_done) {
		/* Resuming: the cache as the first run had it, the sampler past the draws made, and the
		 * step that feeds the last token generated before the cut first. */
		rc = resume_cache(e, p, ctx, g->seq, n_prompt, n_done, &g->attempts, &g->res, err, errlen);
		if (rc) {
			g->state = GS_DONE;
			return rc;
		}
		sampler_skip(g->s, n_done);
		g->res.n_generated = n_done;
		enter_decode(g);
		g->state = GS_FEED;
		g->pending = p->done[n_done - 1];
		g->pos = n_prompt + n_done - 1;
		g->u = g->device_draw ? sampler_next_uniform(g->s) : 0;
		g->u_ready = g->device_draw;
		return 0;
	}
	/* Positions whose KV the store already holds (an earlier request with the same start). */
	int restored;
	while ((restored = p->kv_seed ? engine_restore_prefix(e, g->seq, n_prompt, p->kv_seed) : 0) < 0) {
		if (!kv_cache_remote_failed(kv)) {
			snprintf(err, errlen, "%s", engine_error(e));
			g->state = GS_DONE;
			return restored;
		}
		if ((rc = rebuild(e, p, ctx, g->seq, 0, n_prompt, &g->attempts, err, errlen)) != 0) {
			g->state = GS_DONE;
			return rc;
		}
	}
	g->res.n_restored = (uint32_t)restored;
	g->pos = (uint32_t)restored;
	g->state = GS_PREFILL;
	return 0;
}

bool gen_seq_device_pick(const struct gen_seq *g, struct backend_pick *pick)
{
	if (g->state != GS_FEED || !(g->greedy || g->device_draw))
		return false;
	pick->sp = g->greedy ? NULL : &g->p.sampling;
	pick->u = g->u;
	return true;
}

uint32_t gen_seq_piece(struct gen_seq *g, uint32_t max_tokens, struct engine_seq *piece)
{
	if (g->state == GS_DONE || max_tokens == 0)
		return 0;
	*piece = (struct engine_seq){.kv = g->kv, .pos0 = g->pos, .out = true};
	if (g->state == GS_FEED) {
		piece->tokens = &g->pending;
		piece->n = 1;
		return 1;
	}
	/* The same chunk grid as a cold run (the values do not depend on what was reused), cut to
	 * what the step has room for. */
	uint32_t end = (g->pos / g->chunk + 1) * g->chunk < g->n_prompt ? (g->pos / g->chunk + 1) * g->chunk
									   : g->n_prompt;
	if (end - g->pos > max_tokens)
		end = g->pos + max_tokens;
	piece->tokens = g->seq + g->pos;
	piece->n = end - g->pos;
	piece->out = end == g->n_prompt;
	return piece->n;
}

int gen_seq_advance(struct gen_seq *g, uint32_t n, float *logits, int32_t token, char *err, size_t errlen)
{
	if (g->state == GS_PREFILL) {
		g->pos += n;
		if (g->pos < g->n_prompt)
			return 0;
		g->res.prefill_ms = (double)(now_ns() - g->t0) / 1e6;
		int lrc = g->p.on_logits ? g->p.on_logits(g->ctx, g->n_prompt - 1, logits, g->cfg->vocab_size) : 0;
		if (lrc == -ECANCELED) {
			g->res.reason = "cancelled";
			g->state = GS_DONE;
			return 0;
		}
		if (lrc) {
			snprintf(err, errlen, "sending the prompt's logits failed");
			g->state = GS_DONE;
			return lrc;
		}
		enter_decode(g);
	} else if (g->state == GS_FEED) {
		g->pos++;
	} else {
		return 0;
	}
	take_token(g, logits, token);
	if (g->state == GS_DONE && g->t1)
		g->res.decode_ms = (double)(now_ns() - g->t1) / 1e6;
	return 0;
}

int gen_seq_step(struct gen_seq *g, char *err, size_t errlen)
{
	struct engine_seq piece;
	uint32_t n = gen_seq_piece(g, g->chunk, &piece);
	if (!n)
		return 0;
	engine_set_kv(g->e, g->kv);
	int32_t next = -1;
	float *logits = piece.out ? g->logits : NULL;
	for (;;) {
		int rc;
		if (g->state == GS_FEED && g->greedy)
			rc = engine_forward_greedy(g->e, piece.tokens, 1, piece.pos0, &next);
		else if (g->state == GS_FEED && g->device_draw)
			rc = engine_forward_sample(g->e, piece.tokens, 1, piece.pos0, &g->p.sampling, g->u, &next);
		else
			rc = engine_forward(g->e, piece.tokens, n, piece.pos0, logits);
		if (rc == 0)
			break;
		if (!kv_cache_remote_failed(g->kv)) {
			if (g->state == GS_PREFILL)
				snprintf(err, errlen, "prefill: %s", engine_error(g->e));
			else
				snprintf(err, errlen, "decode at position %u: %s", piece.pos0, engine_error(g->e));
			return rc;
		}
		/* The same step again on a rebuilt cache (with the same draw). */
		if ((rc = gen_seq_recover(g, err, errlen)) != 0)
			return rc;
	}
	return gen_seq_advance(g, n, logits, next, err, errlen);
}

int gen_seq_recover(struct gen_seq *g, char *err, size_t errlen)
{
	engine_set_kv(g->e, g->kv);
	return rebuild(g->e, &g->p, g->ctx, g->seq, g->pos, g->n_prompt, &g->attempts, err, errlen);
}

int gen_seq_finish(struct gen_seq **gp, bool ok, struct gen_result *res, char *err, size_t errlen)
{
	struct gen_seq *g = *gp;
	if (!g)
		return 0;
	*gp = NULL;
	if (res) {
		*res = g->res;
		res->n_rebuilds = g->attempts;
	}
	int rc = 0;
	if (!g->untouched) {
		engine_set_kv(g->e, g->kv);
		rc = end_sequence(g->e, &g->p, g->ctx, ok, err, errlen);
	}
	sampler_destroy(&g->s);
	free(g->seq);
	free(g->seen);
	free(g->logits);
	free(g);
	return rc;
}

int generate_run(struct engine *e, const int32_t *prompt, uint32_t n_prompt, uint32_t max_context,
		 const struct gen_params *p, gen_emit_fn emit, void *ctx, struct gen_result *res, char *err,
		 size_t errlen)
{
	struct gen_seq *g = NULL;
	*res = (struct gen_result){.n_prompt = n_prompt, .reason = "length"};
	int rc = gen_seq_create(e, engine_kv(e), prompt, n_prompt, max_context, p, false, emit, ctx, &g, err, errlen);
	if (!g)
		return rc;
	while (rc == 0 && !gen_seq_done(g))
		rc = gen_seq_step(g, err, errlen);
	int frc = gen_seq_finish(&g, rc == 0, res, err, errlen);
	return rc ? rc : frc;
}

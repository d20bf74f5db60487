#include "services/gpu-runner/generate.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"

static bool is_stop(const struct model_config *cfg, const struct gen_params *p, int32_t tok)
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

int generate_run(struct engine *e, const int32_t *prompt, uint32_t n_prompt, uint32_t max_context,
		 const struct gen_params *p, gen_emit_fn emit, void *ctx, struct gen_result *res, char *err,
		 size_t errlen)
{
	const struct model_config *cfg = engine_config(e);
	*res = (struct gen_result){.n_prompt = n_prompt, .reason = "length"};
	if (n_prompt == 0) {
		snprintf(err, errlen, "the prompt is empty: give at least one token");
		return -EINVAL;
	}
	if (n_prompt >= max_context) {
		snprintf(err, errlen, "the prompt has %u tokens; the context holds %u (--max-context)", n_prompt,
			 max_context);
		return -EINVAL;
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
	/* Cut off after its last token (before its MSG_GEN_DONE): it ends as it would have, for the
	 * reason the loop below would have given. */
	if (n_done) {
		res->reason = NULL;
		if (p->done_stop_string)
			res->reason = "stop_string";
		else if (is_stop(cfg, p, p->done[n_done - 1]))
			res->reason = "stop";
		else if (n_done == p->max_new)
			res->reason = "length";
		else if ((uint64_t)n_prompt + n_done > max_context)
			res->reason = "context";
		if (res->reason) {
			res->n_generated = n_done;
			return 0;
		}
		res->reason = "length";
	}
	float *logits = malloc(sizeof(float) * cfg->vocab_size);
	struct sampler *s = sampler_create(&p->sampling, cfg->vocab_size);
	bool penalty = p->repetition_penalty > 0 && p->repetition_penalty != 1.0f;
	uint8_t *seen = penalty ? calloc(cfg->vocab_size, 1) : NULL; /* tokens in the sequence so far */
	/* The sequence so far (prompt, then each token as it is fed back): names KV blocks. */
	uint64_t cap = (uint64_t)n_prompt + p->max_new + 1 < max_context ? (uint64_t)n_prompt + p->max_new + 1
									  : max_context;
	int32_t *seq = malloc(sizeof(int32_t) * (cap > n_prompt ? cap : n_prompt));
	uint32_t seq_n = n_prompt, attempts = 0;
	struct kv_cache *kv = engine_kv(e);
	int rc = 0;
	if (!logits || !s || (penalty && !seen) || !seq) {
		snprintf(err, errlen, "out of memory");
		rc = -ENOMEM;
		goto out;
	}
	memcpy(seq, prompt, sizeof(int32_t) * n_prompt);
	if (n_done) {
		memcpy(seq + n_prompt, p->done, sizeof(int32_t) * n_done);
		seq_n += n_done;
	}
	if (p->kv_seed)
		kv_cache_set_sequence(kv, seq, &seq_n, p->kv_seed);
	uint64_t t0 = now_ns();
	uint32_t chunk = engine_max_chunk(e);
	if (n_done) {
		rc = resume_cache(e, p, ctx, seq, n_prompt, n_done, &attempts, res, err, errlen);
		if (rc)
			goto out;
		sampler_skip(s, n_done);
		res->n_generated = n_done;
		goto decode;
	}
	/* Positions whose KV the store already holds (an earlier request with the same start). */
	int restored;
	while ((restored = p->kv_seed ? engine_restore_prefix(e, seq, n_prompt, p->kv_seed) : 0) < 0) {
		if (!kv_cache_remote_failed(kv)) {
			rc = restored;
			snprintf(err, errlen, "%s", engine_error(e));
			goto out;
		}
		if ((rc = rebuild(e, p, ctx, seq, 0, n_prompt, &attempts, err, errlen)) != 0)
			goto out;
	}
	res->n_restored = (uint32_t)restored;
	for (uint32_t pos = (uint32_t)restored; pos < n_prompt;) {
		/* The same chunk grid as a cold run: the values do not depend on what was reused. */
		uint32_t end = (pos / chunk + 1) * chunk < n_prompt ? (pos / chunk + 1) * chunk : n_prompt;
		rc = engine_forward(e, prompt + pos, end - pos, pos, end == n_prompt ? logits : NULL);
		if (rc && kv_cache_remote_failed(kv)) {
			rc = rebuild(e, p, ctx, seq, pos, n_prompt, &attempts, err, errlen);
			if (rc)
				goto out;
			continue;
		}
		if (rc) {
			snprintf(err, errlen, "prefill: %s", engine_error(e));
			goto out;
		}
		pos = end;
	}
	res->prefill_ms = (double)(now_ns() - t0) / 1e6;
	if (p->on_logits && (rc = p->on_logits(ctx, n_prompt - 1, logits, cfg->vocab_size)) != 0) {
		snprintf(err, errlen, "sending the prompt's logits failed");
		goto out;
	}
decode:
	if (penalty)
		for (uint32_t i = 0; i < seq_n; i++)
			seen[seq[i]] = 1;
	if (p->on_decode)
		p->on_decode(ctx);
	/* Greedy without a penalty needs only the best id each step: the backend finds it where the
	 * logits are (on the GPU, the vocabulary then never crosses the bus). */
	bool greedy = !(p->sampling.temperature > 0) && !penalty;
	/* Sampling without a penalty can draw on the device too, with a uniform from our generator. */
	bool device_draw = !greedy && !penalty && engine_samples_on_device(e);
	int32_t next = -1;
	uint32_t pos = n_prompt + (n_done ? n_done - 1 : 0);
	/* Resuming: the step that feeds the last token generated before the cut comes first. */
	bool feed_done = n_done > 0;
	uint64_t t1 = now_ns();
	while (res->n_generated < p->max_new) {
		int32_t tok;
		if (feed_done) {
			feed_done = false;
			tok = p->done[n_done - 1];
			goto forward;
		}
		if (penalty)
			for (uint32_t v = 0; v < cfg->vocab_size; v++)
				if (seen[v])
					logits[v] = logits[v] < 0 ? logits[v] * p->repetition_penalty
								  : logits[v] / p->repetition_penalty;
		tok = next >= 0 ? next : sampler_pick(s, logits);
		next = -1;
		uint32_t index = res->n_generated++;
		if (penalty)
			seen[tok] = 1;
		enum gen_emit said = emit ? emit(ctx, index, tok) : GEN_CONTINUE;
		if (said == GEN_CANCEL) {
			res->reason = "cancelled";
			break;
		}
		if (said == GEN_STOP_STRING) {
			res->reason = "stop_string";
			break;
		}
		if (is_stop(cfg, p, tok)) {
			res->reason = "stop";
			break;
		}
		if (res->n_generated == p->max_new)
			break;
		if (pos >= max_context) {
			res->reason = "context";
			break;
		}
		seq[seq_n++] = tok; /* pos == seq_n - 1 */
forward:;
		float u = device_draw ? sampler_next_uniform(s) : 0;
		for (;;) {
			if (greedy)
				rc = engine_forward_greedy(e, &tok, 1, pos, &next);
			else if (device_draw)
				rc = engine_forward_sample(e, &tok, 1, pos, &p->sampling, u, &next);
			else
				rc = engine_forward(e, &tok, 1, pos, logits);
			if (!rc || !kv_cache_remote_failed(kv))
				break;
			/* The same step again on a rebuilt cache, with the same draw. */
			if ((rc = rebuild(e, p, ctx, seq, pos, n_prompt, &attempts, err, errlen)) != 0)
				goto out;
		}
		if (rc) {
			snprintf(err, errlen, "decode at position %u: %s", pos, engine_error(e));
			goto out;
		}
		pos++;
	}
	res->decode_ms = (double)(now_ns() - t1) / 1e6;
out:
	res->n_rebuilds = attempts;
	{
		int rrc = end_sequence(e, p, ctx, rc == 0, err, errlen);
		if (rrc && !rc)
			rc = rrc;
	}
	sampler_destroy(&s);
	free(seq);
	free(seen);
	free(logits);
	return rc;
}

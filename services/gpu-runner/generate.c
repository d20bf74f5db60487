#include "services/gpu-runner/generate.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

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
	float *logits = malloc(sizeof(float) * cfg->vocab_size);
	struct sampler *s = sampler_create(&p->sampling, cfg->vocab_size);
	bool penalty = p->repetition_penalty > 0 && p->repetition_penalty != 1.0f;
	uint8_t *seen = penalty ? calloc(cfg->vocab_size, 1) : NULL; /* tokens in the sequence so far */
	int rc = 0;
	if (!logits || !s || (penalty && !seen)) {
		snprintf(err, errlen, "out of memory");
		rc = -ENOMEM;
		goto out;
	}
	uint64_t t0 = now_ns();
	uint32_t chunk = engine_max_chunk(e);
	for (uint32_t pos = 0; pos < n_prompt; pos += chunk) {
		uint32_t n = n_prompt - pos < chunk ? n_prompt - pos : chunk;
		rc = engine_forward(e, prompt + pos, n, pos, pos + n == n_prompt ? logits : NULL);
		if (rc) {
			snprintf(err, errlen, "prefill: %s", engine_error(e));
			goto out;
		}
	}
	uint64_t t1 = now_ns();
	res->prefill_ms = (double)(t1 - t0) / 1e6;
	if (p->on_logits && (rc = p->on_logits(ctx, n_prompt - 1, logits, cfg->vocab_size)) != 0) {
		snprintf(err, errlen, "sending the prompt's logits failed");
		goto out;
	}
	if (penalty)
		for (uint32_t i = 0; i < n_prompt; i++)
			seen[prompt[i]] = 1;
	if (p->on_decode)
		p->on_decode(ctx);
	/* Greedy without a penalty needs only the best id each step: the backend finds it where the
	 * logits are (on the GPU, the vocabulary then never crosses the bus). */
	bool greedy = !(p->sampling.temperature > 0) && !penalty;
	/* Sampling without a penalty can draw on the device too, with a uniform from our generator. */
	bool device_draw = !greedy && !penalty && engine_samples_on_device(e);
	int32_t next = -1;
	uint32_t pos = n_prompt;
	while (res->n_generated < p->max_new) {
		if (penalty)
			for (uint32_t v = 0; v < cfg->vocab_size; v++)
				if (seen[v])
					logits[v] = logits[v] < 0 ? logits[v] * p->repetition_penalty
								  : logits[v] / p->repetition_penalty;
		int32_t tok = next >= 0 ? next : sampler_pick(s, logits);
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
		if (greedy)
			rc = engine_forward_greedy(e, &tok, 1, pos, &next);
		else if (device_draw)
			rc = engine_forward_sample(e, &tok, 1, pos, &p->sampling, sampler_next_uniform(s), &next);
		else
			rc = engine_forward(e, &tok, 1, pos, logits);
		if (rc) {
			snprintf(err, errlen, "decode at position %u: %s", pos, engine_error(e));
			goto out;
		}
		pos++;
	}
	res->decode_ms = (double)(now_ns() - t1) / 1e6;
out:
	{
		int rrc = kv_cache_reset(engine_kv(e));
		if (rrc && !rc) {
			snprintf(err, errlen, "%s", kv_cache_error(engine_kv(e)));
			rc = rrc;
		}
	}
	sampler_destroy(&s);
	free(seen);
	free(logits);
	return rc;
}

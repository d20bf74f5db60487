/* batch.c - continuous batching: several requests in every forward step.
 *
 * Where the backend batches sequences (backend_batches_sequences) and this runner computes every
 * layer, up to n_slots requests run at once. Each has a slot: its own KV cache, all over the one
 * arena (r->slot_kv, r->kv_arena, made in peers.c: a request alone has the whole arena), and its
 * generation state (generate.h, struct gen_seq).
 * A step:
 *
 *   1. requests waiting in the queue join while slots are free (their prompt prepared, their
 *      cached prefix restored from the kv-store);
 *   2. each running request gives its next piece, round robin from a rotating start, while the
 *      step's budget of --max-step-tokens lasts: a decode step's one token, or a prefill chunk (cut
 *      to what is left of the budget), so new prompts are computed beside the decode of the others;
 *   3. one engine step computes every piece (engine_forward_batch): the weights of each layer are
 *      read once for all of them;
 *   4. each request takes its logits: its next token is sampled with its own sampler and seed and
 *      streamed to its client, and a request that ended (a stop, its length, its client gone) is
 *      answered and leaves, its KV blocks handed back to the store.
 *
 * A request's tokens do not depend on what else is in the step (engine.h); tests/unit/gpu-runner/
 * test_batch.c and tests/integration/batch.sh hold that. When a step fails because the kv-store
 * failed a request (it restarted, or dropped a block), every sequence whose cache lost its store
 * rebuilds its KV (generate.h) and the step runs again; another failure fails the requests of the
 * step. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/kv_cache.h"
#include "services/gpu-runner/runner.h"

/* The most times one step is run again after the kv-store failed it. */
#define STEP_RETRIES 3

void runner_plan_batch(struct runner *r, uint64_t all, uint64_t fit, uint32_t need, uint32_t *n_blocks)
{
	uint32_t want = r->max_batch > 0 ? (uint32_t)r->max_batch : RUNNER_DEFAULT_BATCH;
	r->batching = want > 1 && r->ranks <= 1 && backend_name_batches(r->backend_name);
	if (want > 1 && !r->batching)
		log_info("--max-batch %u: the %s backend%s computes one sequence a step; requests run one at a time", want,
			 r->backend_name, r->ranks > 1 ? " of a model split across runners" : "");
	if (!r->batching) {
		r->n_slots = 1;
		*n_blocks = (uint32_t)(fit < all ? fit : all);
		return;
	}
	uint64_t blocks = all * want < fit ? all * want : fit;
	uint32_t slots = want;
	if (blocks / slots < need) {
		slots = (uint32_t)(blocks / need);
		log_warn("--kv-gpu-budget holds %llu KV blocks: %u requests at once, not %u (each needs %u blocks at "
			 "least in the arena they share)", (unsigned long long)blocks, slots, want, need);
	}
	r->n_slots = slots;
	if (slots < 2) {
		r->batching = false;
		r->n_slots = 1;
	}
	*n_blocks = (uint32_t)blocks;
}

/* The job in slot k ended (rc 0: res says how; else err): answered, its state finished, its slot
 * free. */
static void finish(struct runner *r, uint32_t k, int rc, const char *why)
{
	struct job *j = &r->active[k];
	char err[1024];
	snprintf(err, sizeof(err), "%s", why ? why : "");
	struct gen_result res = {0};
	int frc = gen_seq_finish(&j->g, rc == 0, &res, err, sizeof(err));
	if (frc && !rc)
		rc = frc;
	runner_job_reply(r, j, rc, &res, err);
	runner_job_free(j);
	r->slot_used[k] = false;
	r->n_active--;
}

/* Queued requests join while slots are free. */
static void admit(struct runner *r)
{
	while (r->q_len && r->n_active < r->n_slots) {
		uint32_t k = 0;
		while (r->slot_used[k])
			k++;
		struct job *j = &r->active[k];
		*j = r->queue[r->q_head];
		memset(&r->queue[r->q_head], 0, sizeof(r->queue[r->q_head]));
		r->q_head = (r->q_head + 1) % QUEUE_MAX;
		r->q_len--;
		r->slot_used[k] = true;
		r->n_active++;
		r->requests++;
		j->slot = k;
		char err[1024] = "";
		int rc = runner_job_prepare(r, j, err, sizeof(err));
		if (rc == 0)
			rc = gen_seq_create(r->engine, r->slot_kv[k], j->ids, j->n_ids, (uint32_t)r->max_context,
					    &j->params, !engine_picks_rows(r->engine), runner_job_emit, j, &j->g, err,
					    sizeof(err));
		if (rc || gen_seq_done(j->g))
			finish(r, k, rc, err);
	}
}

/* The step failed. When the kv-store failed it (a request refused or lost, or a cache that forgot
 * the store's blocks after the store came back with a new pool), every sequence of the step rebuilds
 * its KV up to its piece and the step runs again (true): the layers the failed step got through
 * wrote, and committed, blocks of the others too, which the step would otherwise write twice. A
 * rebuild that fails ends its request. Any other failure fails the requests of the step (false). */
static bool recover(struct runner *r, const uint32_t *who, uint32_t n, const char *why)
{
	bool store = false;
	for (uint32_t i = 0; i < n && !store; i++)
		store = kv_cache_remote_failed(r->slot_kv[who[i]]) || kv_cache_lost(r->slot_kv[who[i]]);
	if (!store) {
		for (uint32_t i = 0; i < n; i++)
			if (r->slot_used[who[i]])
				finish(r, who[i], -EIO, why);
		return false;
	}
	log_warn("%s: rebuilding the KV of the %u requests of the step", why, n);
	for (uint32_t i = 0; i < n; i++) {
		struct job *j = &r->active[who[i]];
		char err[1024];
		int rc = gen_seq_recover(j->g, err, sizeof(err));
		if (rc)
			finish(r, who[i], rc, err);
	}
	return true;
}

void runner_batch_step(struct runner *r)
{
	char err[1024] = "";
	uint32_t admitted = 0;
	if (r->q_len && r->n_active < r->n_slots) {
		/* The peers are checked (and reconnected, which makes the engine and the caches anew) only
		 * when no request runs; while some do, a peer that went away is dealt with inside their
		 * steps (the weight source, the caches' rebuild). */
		if (!r->n_active)
			runner_between_requests(r);
		int rc = r->n_active ? 0 : runner_ensure_connections(r, r->queue[r->q_head].queued_ns, err, sizeof(err));
		if (rc) {
			/* A peer is down for good: the request that would run fails, as one at a time does. */
			struct job *j = &r->queue[r->q_head];
			j->r = r;
			runner_job_reply(r, j, rc, NULL, err);
			runner_job_free(j);
			r->q_head = (r->q_head + 1) % QUEUE_MAX;
			r->q_len--;
			return;
		}
		admitted = r->q_len;
		admit(r);
		admitted -= r->q_len;
	}
	if (!r->n_active) {
		/* Every request admitted ended at once (refused, or a resume cut after its last token):
		 * what a resume's catch-up streamed goes back, as after a request run alone. */
		if (admitted && runner_release_weights(r, service_stop_requested(r->svc), err, sizeof(err)) != 0)
			log_warn("handing the weights back after the requests: %s", err);
		return;
	}
	struct engine_seq seqs[RUNNER_MAX_BATCH];
	uint32_t who[RUNNER_MAX_BATCH], n = 0, n_out = 0;
	uint32_t budget = (uint32_t)r->max_step_tokens;
	for (uint32_t i = 0; i < r->n_slots && budget; i++) {
		uint32_t k = (r->rr + i) % r->n_slots;
		if (!r->slot_used[k])
			continue;
		uint32_t got = gen_seq_piece(r->active[k].g, budget, &seqs[n]);
		if (!got)
			continue;
		budget -= got;
		n_out += seqs[n].out;
		who[n++] = k;
	}
	r->rr = (r->rr + 1) % r->n_slots;
	if (!n)
		return;
	size_t vocab = r->cfg.vocab_size;
	/* Room for a row of logits a slot, made once. */
	if (!r->batch_logits && !(r->batch_logits = malloc(sizeof(float) * vocab * r->n_slots))) {
		for (uint32_t i = 0; i < n; i++)
			finish(r, who[i], -ENOMEM, "out of memory for the step's logits");
		return;
	}
	float *logits = r->batch_logits;
	/* Where every sequence that wants its next token can have it picked on the device (greedy or a
	 * plain draw: gen_seq_device_pick), only the tokens come back, not a vocabulary of logits each. */
	struct backend_pick picks[RUNNER_MAX_BATCH];
	int32_t tokens[RUNNER_MAX_BATCH];
	bool pick = false;
	int rc;
	for (uint32_t tries = 0;; tries++) {
		pick = n_out > 0 && engine_picks_rows(r->engine);
		for (uint32_t i = 0, o = 0; i < n && pick; i++)
			if (seqs[i].out)
				pick = gen_seq_device_pick(r->active[who[i]].g, &picks[o++]);
		rc = pick ? engine_forward_batch_pick(r->engine, seqs, n, picks, tokens)
			  : engine_forward_batch(r->engine, seqs, n, logits);
		if (rc == 0)
			break;
		snprintf(err, sizeof(err), "a step of %u requests: %s", n, engine_error(r->engine));
		if (tries == STEP_RETRIES || !recover(r, who, n, err))
			break;
		/* Again with those still running (a failed rebuild ended its request). */
		uint32_t m = 0;
		n_out = 0;
		for (uint32_t i = 0; i < n; i++)
			if (r->slot_used[who[i]]) {
				seqs[m] = seqs[i];
				n_out += seqs[m].out;
				who[m++] = who[i];
			}
		n = m;
		if (!n)
			break;
	}
	if (rc) {
		for (uint32_t i = 0; i < n; i++)
			if (r->slot_used[who[i]])
				finish(r, who[i], rc, err);
	} else {
		r->batch_steps++;
		r->batch_seqs += n;
		for (uint32_t i = 0; i < n; i++)
			r->batch_tokens += seqs[i].n;
		if (n > r->max_seqs_seen)
			r->max_seqs_seen = n;
		for (uint32_t i = 0, o = 0; i < n; i++) {
			struct job *j = &r->active[who[i]];
			float *row = seqs[i].out && !pick ? logits + vocab * o : NULL;
			int32_t tok = seqs[i].out && pick ? tokens[o] : -1;
			o += seqs[i].out;
			int arc = gen_seq_advance(j->g, seqs[i].n, row, tok, err, sizeof(err));
			if (arc || gen_seq_done(j->g))
				finish(r, who[i], arc, err);
		}
	}
	if (!r->n_active) {
		/* Nothing runs now: the streamed weights go back to the loader, as after a request run alone. */
		bool stopping = service_stop_requested(r->svc);
		if (runner_release_weights(r, stopping, err, sizeof(err)) != 0)
			log_warn("handing the weights back after the requests: %s", err);
	}
}

void runner_batch_drop(struct runner *r)
{
	for (uint32_t k = 0; k < r->n_slots; k++)
		if (r->slot_used[k])
			finish(r, k, -ESHUTDOWN, "gpu-runner is stopping: the request was cut off");
}

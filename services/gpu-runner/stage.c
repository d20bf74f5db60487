/* stage.c - the gpu-runner as one of several runners that split a model's layers (stages/stages.h):
 * the flags, the plan of every rank's layers (each rank makes the same from the model and the flags,
 * so it can take up its own at start), rank 0's front, and a later rank's side: it answers
 * MSG_STAGE_SETUP (the formation: its layers, the link, the kv-store session), MSG_STAGE_SEQ (its KV of
 * the sequence) and MSG_STAGE_STEP (its layers of a step, the rows taken from the rank before and
 * passed to the one after). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/proc.h"
#include "common/service.h"
#include "common/util.h"
#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/kv_cache.h"
#include "services/gpu-runner/runner.h"
#include "services/gpu-runner/stages/stages.h"
#include "services/gpu-runner/weights_ring.h"
#ifdef PIPELINE_HAVE_CUDA
#include "services/gpu-runner/gpu_window.h"
#endif

/* --stage-split as given: the first layer of ranks 1.. (ranks - 1 numbers). */
static int parse_split(const struct runner *r, uint32_t *first, char *err, size_t errlen)
{
	const char *s = r->stage_split_arg;
	for (long i = 1; i < r->ranks; i++) {
		char *end;
		errno = 0;
		unsigned long v = strtoul(s, &end, 10);
		if (end == s || errno || v > UINT32_MAX || (i + 1 < r->ranks ? *end != ',' : *end != 0))
			return errorf(err, errlen, -EINVAL, "--stage-split '%s': give the first layer of each rank after "
				      "the first, %ld numbers separated by commas", r->stage_split_arg, r->ranks - 1);
		first[i - 1] = (uint32_t)v;
		s = end + 1;
	}
	return 0;
}

int runner_parse_stage_flags(struct runner *r, char *err, size_t errlen)
{
	if (r->ranks < 1 || r->ranks > STAGE_MAX_RANKS)
		return errorf(err, errlen, -EINVAL, "--ranks %ld: 1 to %d runners", r->ranks, STAGE_MAX_RANKS);
	if (r->rank < 0 || r->rank >= r->ranks)
		return errorf(err, errlen, -EINVAL, "--rank %ld: 0 to %ld (--ranks %ld)", r->rank, r->ranks - 1, r->ranks);
	if (r->gpu < -1 || r->gpu > 1023)
		return errorf(err, errlen, -EINVAL, "--gpu %ld: a CUDA device number, or -1 for the default", r->gpu);
	if (r->rank)
		snprintf(r->service_name, sizeof(r->service_name), "gpu-runner-%ld", r->rank);
	else
		snprintf(r->service_name, sizeof(r->service_name), "gpu-runner");
	const char *k = r->stage_link_arg ? r->stage_link_arg : "auto";
	bool cuda = !strcmp(r->backend_name, "cuda");
	/* NCCL joins ranks on distinct devices; runners without --gpu may share one. */
	if (!strcmp(k, "auto"))
		k = cuda && r->gpu >= 0 && stage_link_kind_available("nccl") ? "nccl" : "shm";
	if (strcmp(k, "shm") && strcmp(k, "nccl"))
		return errorf(err, errlen, -EINVAL, "--stage-link '%s' is not auto, shm or nccl", k);
	if (!strcmp(k, "nccl") && !cuda)
		return errorf(err, errlen, -EINVAL, "--stage-link nccl moves the hidden state between GPUs: it needs "
			      "--backend cuda (the %s backend passes it through shared memory: shm)", r->backend_name);
	if (!stage_link_kind_available(k))
		return errorf(err, errlen, -ENOTSUP, "--stage-link nccl: this gpu-runner was built without NCCL "
			      "(use shm)");
	snprintf(r->stage_link_kind, sizeof(r->stage_link_kind), "%s", k);
	if (r->stage_split_arg && *r->stage_split_arg) {
		uint32_t first[STAGE_MAX_RANKS];
		if (r->ranks < 2)
			return errorf(err, errlen, -EINVAL, "--stage-split needs --ranks 2 or more");
		int rc = parse_split(r, first, err, errlen);
		if (rc)
			return rc;
	}
	return 0;
}

int runner_plan_stages(struct runner *r, char *err, size_t errlen)
{
	if (r->ranks < 2) {
		r->stage = (struct weight_stage){0};
		return 0;
	}
	uint32_t first[STAGE_MAX_RANKS];
	bool given = r->stage_split_arg && *r->stage_split_arg;
	if (given && parse_split(r, first, err, errlen))
		return -EINVAL;
	const struct weight_source *ws = ring_source_base(r->ring);
	struct stage_plan_params pp = {.ranks = (uint32_t)r->ranks,
				       .budget = strcmp(r->backend_name, "cuda") ? 0 : r->gpu_budget,
				       .depth = (uint32_t)r->prefetch_depth,
				       .expert_depth = (uint32_t)r->expert_depth,
				       .h2d_bps = (double)r->h2d_bps,
				       .hbm_bps = (double)r->hbm_bps,
				       .split = given ? first : NULL};
	int rc = stage_plan_make(ws->cfg, ws->groups, ws->n_groups, &pp, &r->stage_plan, err, errlen);
	if (rc)
		return rc;
	r->stage = (struct weight_stage){.split = true,
					 .layer0 = r->stage_plan.layer0[r->rank],
					 .layer1 = r->stage_plan.layer1[r->rank],
					 .first = r->rank == 0};
	char line[1024];
	stage_plan_describe(&r->stage_plan, line, sizeof(line));
	log_info("rank %ld of %ld computes layers %u..%u (%s): %s", r->rank, r->ranks, r->stage.layer0,
		 r->stage.layer1 - 1, given ? "--stage-split" : "planned", line);
	if ((rc = ring_source_set_stage(r->ring, &r->stage, err, errlen)) != 0)
		return rc;
	if (r->rank) {
		r->kv.defer_commits = true; /* kv_remote.h: its events follow the ranks before it */
		free(r->stage_seq);
		if (!(r->stage_seq = calloc((size_t)r->max_context, sizeof(int32_t))))
			return errorf(err, errlen, -ENOMEM, "out of memory");
	}
	return 0;
}

/* rank 0's front: a new formation's kv-store session (nothing the last one held is this rank's). */
static int kv_session(void *ctx, uint64_t session, char *err, size_t errlen)
{
	struct runner *r = ctx;
	rpc_client_set_session(r->kv_c, session);
	kv_remote_forget_session(&r->kv);
	int rc = runner_connect_kv(r, (int)r->timeout_ms, err, errlen);
	if (rc == 0)
		kv_cache_forget_remote(r->cache); /* the store let go of the last formation's blocks */
	return rc;
}

int runner_make_front(struct runner *r, char *err, size_t errlen)
{
	if (r->ranks < 2 || r->rank)
		return 0;
	struct stage_front_params fp = {.instance = r->instance, .run_dir = r->run_dir, .zctx = r->zctx,
					.link = r->stage_link_kind, .plan = &r->stage_plan, .be = r->be,
					.backend = r->backend_name, .manifest_hash = r->manifest_hash,
					.dim = r->cfg.dim, .max_chunk = r->bp.max_chunk,
					.block_tokens = r->bp.block_tokens, .kv_dtype = r->bp.kv_dtype,
					.max_context = (uint32_t)r->max_context, .timeout_ms = (int)r->timeout_ms,
					.wait_hook = runner_wait_beat, .wait_ctx = r, .kv_session = kv_session};
	return stage_front_create(&fp, &r->front, err, errlen);
}

/* ---- a later rank ---- */

static int back_begin(void *ctx, const int32_t *tokens, uint32_t n, uint32_t pos0, bool out)
{
	return -EINVAL;
}

static int back_take(void *ctx, struct backend *be, const struct backend_batch *b)
{
	struct runner *r = ctx;
	return r->slink ? stage_link_recv(r->slink, be, 0, b->n, b) : -EPIPE;
}

static int back_pass(void *ctx, struct backend *be, uint32_t n, bool out)
{
	struct runner *r = ctx;
	if (!r->slink)
		return -EPIPE;
	if (r->rank + 1 < r->ranks)
		return stage_link_send(r->slink, be, 0, n);
	return out ? stage_link_send(r->slink, be, n - 1, 1) : 0; /* the last rank: the head's row back */
}

static int back_back(void *ctx, struct backend *be, uint32_t n)
{
	return -EINVAL;
}

static int back_restore(void *ctx, const int32_t *tokens, uint32_t n, uint32_t limit, uint64_t seed,
			uint32_t *restored)
{
	return -EINVAL;
}

static int back_none(void *ctx)
{
	return -EINVAL;
}

static const char *back_error(void *ctx)
{
	struct runner *r = ctx;
	return r->slink ? stage_link_error(r->slink) : "the stage is not in a formation";
}

static const struct engine_stage_ops back_ops = {
	.begin = back_begin,
	.take = back_take,
	.pass = back_pass,
	.back = back_back,
	.restore = back_restore,
	.end = back_none,
	.recover = back_none,
	.error = back_error,
};

void runner_set_engine_stages(struct runner *r)
{
	if (!r->engine || r->ranks < 2)
		return;
	if (r->rank == 0)
		engine_set_stages(r->engine, r->front ? &stage_front_ops : NULL, r->front);
	else
		engine_set_stages(r->engine, &back_ops, r);
}

/* What this rank holds, for MSG_STAGE_READY and the log. */
static void describe(struct runner *r, char *buf, size_t len)
{
	int k = snprintf(buf, len, "layers %u..%u", r->stage.layer0, r->stage.layer1 - 1);
	if (k < 0 || (size_t)k >= len)
		return;
#ifdef PIPELINE_HAVE_CUDA
	if (r->win) {
		struct gpu_window_stats st;
		gpu_window_stats(r->win, &st);
		char a[32], b[32];
		snprintf(buf + k, len - (size_t)k, ", %llu groups resident (%s), %llu streamed (%s per token at %.1f GB/s); "
			 "predicted %.1f ms/token", (unsigned long long)st.resident_groups,
			 format_size(st.resident_bytes, a, sizeof(a)), (unsigned long long)st.streamed_groups,
			 format_size(st.streamed_bytes_per_token, b, sizeof(b)), st.h2d_bytes_per_s / 1e9, r->predicted_ms);
		return;
	}
#endif
	snprintf(buf + k, len - (size_t)k, ", computed on the %s backend from the weight ring in place", r->backend_name);
}

/* The first runner's view of what every runner must agree on. */
static int check_setup(struct runner *r, const struct msg_stage_setup *s, char *err, size_t errlen)
{
	if (s->ranks != (uint64_t)r->ranks || s->rank != (uint64_t)r->rank)
		return errorf(err, errlen, -EINVAL, "%s was started as rank %ld of %ld; the first runner has it as rank "
			      "%llu of %llu (start every runner with the same --ranks)", r->service_name, r->rank, r->ranks,
			      (unsigned long long)s->rank, (unsigned long long)s->ranks);
	if (s->manifest_hash != r->manifest_hash)
		return errorf(err, errlen, -EPROTO, "the first runner computes another model (manifest %016llx, this "
			      "runner's %016llx)", (unsigned long long)s->manifest_hash,
			      (unsigned long long)r->manifest_hash);
	if (strcmp(s->backend.p, r->backend_name))
		return errorf(err, errlen, -EINVAL, "the first runner computes on the %s backend, this one on %s: give "
			      "every runner the same --backend", s->backend.p, r->backend_name);
	if (s->max_chunk != r->bp.max_chunk || s->block_tokens != r->bp.block_tokens || s->kv_dtype != r->bp.kv_dtype ||
	    s->max_context != (uint64_t)r->max_context)
		return errorf(err, errlen, -EINVAL, "the first runner has --prefill-chunk %llu, --kv-block-tokens %llu, "
			      "KV type %s, --max-context %llu; this one %u, %u, %s, %ld: give every runner the same flags",
			      (unsigned long long)s->max_chunk, (unsigned long long)s->block_tokens,
			      s->kv_dtype < DT_COUNT ? dtype_name((enum dtype)s->kv_dtype) : "?",
			      (unsigned long long)s->max_context, r->bp.max_chunk, r->bp.block_tokens,
			      dtype_name((enum dtype)r->bp.kv_dtype), r->max_context);
	if (s->layer0 >= s->layer1 || s->layer1 > r->cfg.n_layers)
		return errorf(err, errlen, -EINVAL, "layers %llu..%llu are not a range of the model's %u",
			      (unsigned long long)s->layer0, (unsigned long long)s->layer1, r->cfg.n_layers);
	if (s->pids.n != s->ranks || s->pids.v[r->rank] != (uint64_t)getpid())
		return errorf(err, errlen, -EINVAL, "the formation names %u processes for %llu ranks, and this rank's "
			      "not as %d", s->pids.n, (unsigned long long)s->ranks, (int)getpid());
	if (!stage_link_kind_available(s->link.p))
		return errorf(err, errlen, -ENOTSUP, "the first runner passes the hidden state by %s, which this "
			      "gpu-runner does not have", s->link.p);
	if (!s->link_name.len)
		return errorf(err, errlen, -EINVAL, "a formation without the name of its shared-memory object");
	if ((!strcmp(s->link.p, "nccl") ? s->nccl_id.len != STAGE_NCCL_ID_BYTES : s->nccl_id.len != 0))
		return errorf(err, errlen, -EINVAL, "a formation's NCCL id of %u bytes for a %s link", s->nccl_id.len,
			      s->link.p);
	return 0;
}

/* The layers of this rank changed: the window, the KV cache and the engine anew for them. */
static int take_up_layers(struct runner *r, uint32_t l0, uint32_t l1, char *err, size_t errlen)
{
	log_info("rank %ld takes up layers %u..%u (it had %u..%u)", r->rank, l0, l1 - 1, r->stage.layer0,
		 r->stage.layer1 - 1);
	engine_destroy(&r->engine);
	runner_drop_caches(r);
	runner_drop_window(r);
	r->stage.layer0 = l0;
	r->stage.layer1 = l1;
	int rc = ring_source_set_stage(r->ring, &r->stage, err, errlen);
	if (rc == 0)
		rc = runner_make_window(r, err, errlen);
	if (rc == 0)
		rc = runner_make_cache(r, err, errlen);
	if (rc == 0)
		rc = runner_make_engine(r, err, errlen);
	if (rc) /* half made: the next SETUP takes the layers up again, whatever they are */
		r->stage.layer0 = r->stage.layer1 = 0;
	return rc;
}

static int stage_setup(struct runner *r, const struct msg_stage_setup *s, char *err, size_t errlen)
{
	int rc = check_setup(r, s, err, errlen);
	if (rc)
		return rc;
	stage_link_destroy(&r->slink);
	r->formation = 0;
	if ((s->layer0 != r->stage.layer0 || s->layer1 != r->stage.layer1 || !r->engine || !r->cache) &&
	    (rc = take_up_layers(r, (uint32_t)s->layer0, (uint32_t)s->layer1, err, errlen)) != 0)
		return rc;
	/* The formation's kv-store session: the store dropped the last one's blocks when the first
	 * runner said HELLO with it; what this rank still names of them goes. */
	rpc_client_set_session(r->kv_c, s->kv_session);
	if ((rc = runner_connect_kv(r, (int)r->timeout_ms, err, errlen)) != 0)
		return rc;
	kv_cache_forget_remote(r->cache);
	if ((rc = runner_ensure_connections(r, 0, err, errlen)) != 0)
		return rc;
	struct stage_link_params lp = {.formation = s->formation, .rank = (uint32_t)r->rank, .ranks = (uint32_t)r->ranks,
				       .dim = r->cfg.dim, .max_rows = r->bp.max_chunk, .timeout_ms = (int)r->timeout_ms,
				       .wait_hook = runner_wait_beat, .wait_ctx = r};
	for (uint32_t i = 0; i < s->ranks; i++) {
		lp.pids[i] = (int)s->pids.v[i];
		lp.starts[i] = process_start_time(lp.pids[i]);
	}
	if ((rc = stage_link_join(&lp, s->link.p, s->link_name.p, s->nccl_id.len ? s->nccl_id.p : NULL, &r->slink, err,
				  errlen)) != 0)
		return rc;
	if ((rc = stage_link_connect(r->slink)) != 0) {
		errorf(err, errlen, rc, "%s", stage_link_error(r->slink));
		stage_link_destroy(&r->slink);
		return rc;
	}
	r->formation = s->formation;
	r->stage_seq_n = 0;
	r->stage_forms++;
	runner_set_engine_stages(r);
	char line[512];
	describe(r, line, sizeof(line));
	log_info("formation %016llx: rank %ld of %ld, %s link; %s", (unsigned long long)r->formation, r->rank, r->ranks,
		 stage_link_kind(r->slink), line);
	return 0;
}

/* The formation a message names is this rank's. */
static int check_formation(struct runner *r, uint64_t formation, char *err, size_t errlen)
{
	if (!r->slink || formation != r->formation)
		return errorf(err, errlen, -ESTALE, "%s is not in formation %016llx (%s)", r->service_name,
			      (unsigned long long)formation, r->slink ? "it is in another" : "it is in none");
	if (stage_link_broken(r->slink))
		return errorf(err, errlen, -EPIPE, "the formation's link is broken: %s", stage_link_error(r->slink));
	return 0;
}

static int stage_seq(struct runner *r, const struct msg_stage_seq *q, uint64_t *value, char *err, size_t errlen)
{
	int rc = check_formation(r, q->formation, err, errlen);
	if (rc)
		return rc;
	*value = 0;
	switch (q->op) {
	case STAGE_SEQ_RESTORE: {
		if (q->tokens.n > (uint64_t)r->max_context)
			return errorf(err, errlen, -EINVAL, "a sequence of %u tokens; the context holds %ld", q->tokens.n,
				      r->max_context);
		for (uint32_t i = 0; i < q->tokens.n; i++) {
			if (q->tokens.v[i] >= r->cfg.vocab_size)
				return errorf(err, errlen, -EINVAL, "token %u is %llu, outside the vocabulary", i,
					      (unsigned long long)q->tokens.v[i]);
			r->stage_seq[i] = (int32_t)q->tokens.v[i];
		}
		/* A restore within the sequence (the ranks agreeing on fewer positions) starts over. */
		if ((rc = kv_cache_reset(r->cache)) != 0)
			return errorf(err, errlen, rc, "%s", kv_cache_error(r->cache));
		r->stage_seq_n = q->tokens.n;
		kv_cache_set_sequence(r->cache, r->stage_seq, &r->stage_seq_n, q->seed);
		uint32_t upto = q->limit + 1 < q->tokens.n ? (uint32_t)q->limit + 1 : q->tokens.n;
		int restored = kv_cache_restore_prefix(r->cache, upto);
		if (restored < 0)
			return errorf(err, errlen, restored, "%s", kv_cache_error(r->cache));
		*value = (uint64_t)restored;
		return 0;
	}
	case STAGE_SEQ_END: {
		rc = kv_cache_reset(r->cache);
		if (rc)
			errorf(err, errlen, rc, "%s", kv_cache_error(r->cache));
		int wrc = runner_weights(r)->ops->release_all(runner_weights(r));
		if (wrc && !rc)
			rc = errorf(err, errlen, wrc, "%s", runner_weights(r)->error);
		/* Between sequences a rank holds no KV blocks allocated ahead either (kv_remote.h). */
		if (kv_remote_release_stash(&r->kv) != 0)
			log_warn("handing back the KV blocks allocated ahead: %s", r->kv.error);
		r->stage_seq_n = 0;
		if (rc)
			kv_cache_forget_remote(r->cache);
		return rc;
	}
	case STAGE_SEQ_RECOVER:
		if (kv_remote_lost(&r->kv) && (rc = runner_connect_kv(r, (int)r->timeout_ms, err, errlen)) != 0)
			return rc;
		rc = kv_cache_recover(r->cache);
		return rc ? errorf(err, errlen, rc, "%s", kv_cache_error(r->cache)) : 0;
	default:
		return errorf(err, errlen, -EINVAL, "MSG_STAGE_SEQ op %llu is unknown", (unsigned long long)q->op);
	}
}

static int step_of(struct runner *r, const struct msg_stage_step *q, char *err, size_t errlen);

static int stage_step(struct runner *r, const struct msg_stage_step *q, char *err, size_t errlen)
{
	int rc = check_formation(r, q->formation, err, errlen);
	if (rc)
		return rc; /* another formation's: this one's ranks wait for nothing from it */
	if ((rc = step_of(r, q, err, errlen)) != 0) {
		kv_remote_drop_commits(&r->kv); /* a failed step's KV is not kept */
		/* The ranks before and after wait for rows that will not come (or not be taken): they give
		 * the step up too, at once. */
		stage_link_abort(r->slink, err);
	}
	return rc;
}

/* The step of a formation that is this rank's: 0, or -errno with err set. */
static int step_of(struct runner *r, const struct msg_stage_step *q, char *err, size_t errlen)
{
	int rc;
	uint32_t n = q->tokens.n;
	if (n == 0 || n > r->bp.max_chunk || q->pos0 > (uint64_t)r->max_context || n > r->max_context - q->pos0)
		return errorf(err, errlen, -EINVAL, "a step of %u tokens at position %llu (1..%u tokens, within %ld)", n,
			      (unsigned long long)q->pos0, r->bp.max_chunk, r->max_context);
	uint32_t pos0 = (uint32_t)q->pos0;
	for (uint32_t i = 0; i < n; i++) {
		if (q->tokens.v[i] >= r->cfg.vocab_size)
			return errorf(err, errlen, -EINVAL, "token %u is %llu, outside the vocabulary", i,
				      (unsigned long long)q->tokens.v[i]);
		r->stage_seq[pos0 + i] = (int32_t)q->tokens.v[i];
	}
	if (pos0 + n > r->stage_seq_n)
		r->stage_seq_n = pos0 + n;
	rc = engine_forward_stage(r->engine, r->stage_seq + pos0, n, pos0, (q->flags & STAGE_STEP_OUT) != 0);
	if (rc == 0 && (rc = stage_link_wait(r->slink, r->be)) != 0)
		errorf(err, errlen, rc, "%s", stage_link_error(r->slink));
	else if (rc)
		errorf(err, errlen, rc, "%s", engine_error(r->engine));
	/* The step's KV commits (held back: kv_remote.h), now that its copies are complete. */
	if (rc == 0 && (rc = kv_remote_flush_commits(&r->kv)) != 0)
		errorf(err, errlen, rc, "%s", r->kv.error);
	if (rc == 0)
		r->stage_steps++;
	return rc;
}

int runner_handle_stage(struct runner *r, struct service *s, const struct bus_peer *peer, const struct msg *req,
			char *errtext, size_t errlen)
{
	if (r->ranks < 2 || r->rank == 0)
		return errorf(errtext, errlen, -EINVAL, "%s is %s: it takes no %s", r->service_name,
			      r->ranks < 2 ? "not a stage of a split model" : "the first stage", msg_type_name(req->type));
	struct msg rep;
	int rc;
	switch (req->type) {
	case MSG_STAGE_SETUP: {
		char line[512] = "";
		if ((rc = stage_setup(r, &req->stage_setup, errtext, errlen)) != 0) {
			log_error("formation %016llx: %s", (unsigned long long)req->stage_setup.formation, errtext);
			return rc;
		}
		describe(r, line, sizeof(line));
		msg_init(&rep, MSG_STAGE_READY, req->corr);
		rep.stage_ready = (struct msg_stage_ready){.rank = (uint64_t)r->rank, .pid = (uint64_t)getpid(),
							   .layer0 = r->stage.layer0, .layer1 = r->stage.layer1,
							   .plan = {line, (uint32_t)strlen(line)}};
		break;
	}
	case MSG_STAGE_SEQ: {
		uint64_t value = 0;
		if ((rc = stage_seq(r, &req->stage_seq, &value, errtext, errlen)) != 0)
			return rc;
		msg_init(&rep, MSG_STAGE_DONE, req->corr);
		rep.stage_done.value = value;
		break;
	}
	case MSG_STAGE_STEP:
		if ((rc = stage_step(r, &req->stage_step, errtext, errlen)) != 0) {
			log_warn("step %llu failed: %s", (unsigned long long)req->stage_step.step, errtext);
			return rc;
		}
		msg_init(&rep, MSG_STAGE_DONE, req->corr);
		break;
	default:
		return errorf(errtext, errlen, -ENOTSUP, "%s does not handle %s", r->service_name, msg_type_name(req->type));
	}
	service_reply(s, peer, &rep);
	return 0;
}

void runner_stage_stats(struct runner *r, char *buf, size_t len)
{
	buf[0] = 0;
	if (r->ranks < 2)
		return;
	if (r->front) {
		stage_front_stats(r->front, buf, len);
		return;
	}
	uint64_t sent = 0, received = 0;
	if (r->slink)
		stage_link_counts(r->slink, &sent, &received);
	snprintf(buf, len,
		 "\"rank\":%ld,\"ranks\":%ld,\"layer0\":%u,\"layer1\":%u,\"link\":\"%s\",\"formed\":%s,"
		 "\"formation\":\"%016llx\",\"forms\":%llu,\"steps\":%llu,\"bytes_sent\":%llu,\"bytes_received\":%llu",
		 r->rank, r->ranks, r->stage.layer0, r->stage.layer1, r->slink ? stage_link_kind(r->slink) : r->stage_link_kind,
		 r->slink && !stage_link_broken(r->slink) ? "true" : "false", (unsigned long long)r->formation,
		 (unsigned long long)r->stage_forms, (unsigned long long)r->stage_steps, (unsigned long long)sent,
		 (unsigned long long)received);
}

void runner_idle_stages(struct runner *r)
{
	if (!r->front)
		return;
	/* A kv-store reply given up (kv_remote.orphans): what that request did is the formation's
	 * session's, which only a new formation renews (runner_connect_kv renews a runner's own). */
	if (r->kv.orphans && stage_front_formed(r->front)) {
		log_warn("a kv-store reply was given up: the ranks are formed anew, with a kv-store session that "
			 "lets go of what the old one held");
		stage_front_break(r->front, "a kv-store reply was given up");
		r->stage_form_try_ns = 0;
	}
	uint64_t now = now_ns();
	if (now - r->stage_form_try_ns < 1000000000ull)
		return;
	r->stage_form_try_ns = now;
	char err[512];
	int rc = stage_front_form(r->front, 250, err, sizeof(err));
	if (rc)
		log_debug("stages not formed yet: %s", err);
}

bool runner_stage_failed(const struct runner *r)
{
	return r->front && !stage_front_formed(r->front);
}

void runner_drop_stages(struct runner *r)
{
	stage_front_destroy(&r->front);
	stage_link_destroy(&r->slink);
	free(r->stage_seq);
	r->stage_seq = NULL;
}

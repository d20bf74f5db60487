/* front.c - the first runner's side of a split model (stages.h): forming the ranks, and the engine's
 * stage ops on rank 0 (the steps and the sequence's KV calls on every rank). */
#include "services/gpu-runner/stages/stages.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/proc.h"
#include "common/util.h"

#define SLICE_MS 100

struct rank_peer {
	struct rpc_client *c;
	char name[32];	     /* "gpu-runner-r" */
	int pid;
	uint64_t start;
	uint64_t pending[STAGE_STEPS_AHEAD + 1]; /* MSG_STAGE_STEP ids not yet answered, oldest first */
	uint32_t n_pending;
	char plan[256];	     /* its MSG_STAGE_READY line */
};

struct stage_front {
	struct stage_front_params p;
	char instance[128], run_dir[256], link_kind[16], backend[16];
	struct stage_plan plan;
	struct rank_peer peer[STAGE_MAX_RANKS]; /* [1, ranks) */
	struct stage_link *link;
	bool formed;
	uint64_t formation, steps;
	uint64_t *tokens;    /* (max_chunk or max_context) token ids as the messages carry them */
	uint32_t tokens_cap;
	uint64_t forms, steps_total, failures;
	char error[768];
};

static int fail(struct stage_front *f, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(struct stage_front *f, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(f->error, sizeof(f->error), fmt, ap);
	va_end(ap);
	return rc;
}

int stage_front_create(const struct stage_front_params *p, struct stage_front **out, char *err, size_t errlen)
{
	if (!p->plan || p->plan->ranks < 2 || p->plan->ranks > STAGE_MAX_RANKS)
		return errorf(err, errlen, -EINVAL, "a split model has 2..%d stages", STAGE_MAX_RANKS);
	if (!stage_link_kind_available(p->link))
		return errorf(err, errlen, -ENOTSUP, "stage link '%s' is not built into this gpu-runner", p->link);
	struct stage_front *f = calloc(1, sizeof(*f));
	if (!f)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	f->p = *p;
	snprintf(f->instance, sizeof(f->instance), "%s", p->instance);
	snprintf(f->run_dir, sizeof(f->run_dir), "%s", p->run_dir);
	snprintf(f->link_kind, sizeof(f->link_kind), "%s", p->link);
	snprintf(f->backend, sizeof(f->backend), "%s", p->backend);
	f->p.instance = f->instance;
	f->p.run_dir = f->run_dir;
	f->p.link = f->link_kind;
	f->p.backend = f->backend;
	f->plan = *p->plan;
	f->p.plan = &f->plan;
	f->tokens_cap = p->max_context > p->max_chunk ? p->max_context : p->max_chunk;
	f->tokens = calloc(f->tokens_cap, sizeof(uint64_t));
	if (!f->tokens) {
		free(f);
		return errorf(err, errlen, -ENOMEM, "out of memory");
	}
	for (uint32_t r = 1; r < f->plan.ranks; r++) {
		struct rank_peer *pr = &f->peer[r];
		snprintf(pr->name, sizeof(pr->name), "gpu-runner-%u", r);
		pr->c = rpc_client_create(p->zctx, p->run_dir, pr->name, "gpu-runner");
		if (!pr->c) {
			int e = errno;
			stage_front_destroy(&f);
			return errorf(err, errlen, -e, "cannot make a client of %s under %s: %s", f ? "" : "gpu-runner-N",
				      p->run_dir, strerror(e));
		}
	}
	*out = f;
	return 0;
}

void stage_front_destroy(struct stage_front **fp)
{
	if (!fp || !*fp)
		return;
	struct stage_front *f = *fp;
	stage_link_destroy(&f->link);
	for (uint32_t r = 1; r < STAGE_MAX_RANKS; r++)
		rpc_client_destroy(&f->peer[r].c);
	free(f->tokens);
	free(f);
	*fp = NULL;
}

bool stage_front_formed(const struct stage_front *f)
{
	return f->formed && f->link && !stage_link_broken(f->link);
}

void stage_front_set_backend(struct stage_front *f, struct backend *be)
{
	f->p.be = be;
}

/* Waits for rank r's reply to corr in slices: a rank whose process is gone is noticed at once, the
 * wait hook runs, and the whole wait lasts at most timeout_ms. Returns 0 with rep filled, -EREMOTEIO
 * (rep holds MSG_ERROR), -EPIPE, -ECANCELED, -ETIMEDOUT or a socket's -errno; after any, msg_free(rep)
 * is safe. */
static int wait_reply(struct stage_front *f, uint32_t r, uint64_t corr, struct msg *rep, int timeout_ms)
{
	struct rank_peer *pr = &f->peer[r];
	for (int waited = 0;;) {
		int step = timeout_ms - waited < SLICE_MS ? timeout_ms - waited : SLICE_MS;
		int rc = rpc_wait(pr->c, corr, rep, step > 0 ? step : 0);
		if (rc != -ETIMEDOUT)
			return rc;
		waited += step;
		if (pr->pid && !process_alive(pr->pid, pr->start))
			return -EPIPE;
		if (waited >= timeout_ms)
			return -ETIMEDOUT;
		if (f->p.wait_hook && f->p.wait_hook(f->p.wait_ctx))
			return -ECANCELED;
	}
}

/* A reply's failure as a message naming the rank. */
static int reply_fail(struct stage_front *f, uint32_t r, int rc, const struct msg *rep, const char *what)
{
	const struct rank_peer *pr = &f->peer[r];
	if (rc == -EREMOTEIO)
		return fail(f, rep->error.code > 0 && rep->error.code < 4096 ? -(int)rep->error.code : -EIO,
			    "stage %u (%s): %s", r, pr->name, rep->error.text.p);
	if (rc == -EPIPE)
		return fail(f, rc, "stage %u (%s, pid %d) is gone (%s)", r, pr->name, pr->pid, what);
	if (rc == -ECANCELED)
		return fail(f, rc, "gpu-runner is stopping (%s)", what);
	if (rc == -ETIMEDOUT)
		return fail(f, rc, "stage %u (%s) did not answer %s within %d s", r, pr->name, what,
			    f->p.timeout_ms / 1000);
	return fail(f, rc, "stage %u (%s): %s: %s", r, pr->name, what, strerror(-rc));
}

void stage_front_break(struct stage_front *f, const char *why)
{
	/* Always: a link that failed here has not told the others yet (the abort word is idempotent). */
	if (f->link)
		stage_link_abort(f->link, why);
	if (f->formed)
		log_warn("stages: the formation is given up (%s); the next request forms the stages anew", why);
	f->formed = false;
}

/* Takes rank r's unanswered STEP replies (block: waiting for each; else those already there). The
 * first failure is returned, the rest still taken (none more after a rank is gone or silent). */
static int reap(struct stage_front *f, uint32_t r, bool block)
{
	struct rank_peer *pr = &f->peer[r];
	int first = 0;
	while (pr->n_pending) {
		struct msg rep;
		int rc = block ? wait_reply(f, r, pr->pending[0], &rep, f->p.timeout_ms)
			       : rpc_wait(pr->c, pr->pending[0], &rep, 0);
		if (rc == -ETIMEDOUT && !block) {
			msg_free(&rep);
			return first;
		}
		if (rc == 0 && rep.type != MSG_STAGE_DONE)
			rc = fail(f, -EPROTO, "stage %u answered a step with %s", r, msg_type_name(rep.type));
		else if (rc && !first)
			rc = reply_fail(f, r, rc, &rep, "a step");
		msg_free(&rep);
		memmove(pr->pending, pr->pending + 1, --pr->n_pending * sizeof(uint64_t));
		if (rc && !first)
			first = rc;
		if (rc == -EPIPE || rc == -ECANCELED || rc == -ETIMEDOUT) {
			pr->n_pending = 0; /* no more answers are coming */
			break;
		}
	}
	return first;
}

/* Every rank's replies, waited for. */
static int drain(struct stage_front *f)
{
	int first = 0;
	for (uint32_t r = 1; r < f->plan.ranks; r++) {
		int rc = reap(f, r, true);
		if (rc && !first)
			first = rc;
	}
	return first;
}

/* A step or call failed (f->error says why): the formation goes, so that the ranks stop waiting (the
 * first to fail aborts the link with its reason, which the others' messages then carry), and the
 * answers still due are taken with a short wait. */
static int step_failed(struct stage_front *f, int rc, const char *what)
{
	char why[sizeof(f->error)];
	snprintf(why, sizeof(why), "%s", f->error[0] ? f->error : what);
	stage_front_break(f, why);
	f->failures++;
	for (uint32_t r = 1; r < f->plan.ranks; r++) {
		struct rank_peer *pr = &f->peer[r];
		while (pr->n_pending) {
			struct msg rep;
			int wrc = wait_reply(f, r, pr->pending[0], &rep, 2000);
			msg_free(&rep);
			memmove(pr->pending, pr->pending + 1, --pr->n_pending * sizeof(uint64_t));
			if (wrc && wrc != -EREMOTEIO)
				pr->n_pending = 0;
		}
	}
	snprintf(f->error, sizeof(f->error), "%s", why);
	return rc;
}

/* ---- forming ---- */

static bool peers_same(struct stage_front *f)
{
	for (uint32_t r = 1; r < f->plan.ranks; r++)
		if (!f->peer[r].pid || !process_alive(f->peer[r].pid, f->peer[r].start))
			return false;
	return true;
}

int stage_front_form(struct stage_front *f, int deadline_ms, char *err, size_t errlen)
{
	if (stage_front_formed(f) && peers_same(f))
		return 0;
	if (f->formed)
		stage_front_break(f, "a stage's runner is gone");
	stage_link_destroy(&f->link);
	const uint32_t R = f->plan.ranks;
	uint64_t t0 = now_ns();
	struct stage_link_params lp = {.ranks = R, .rank = 0, .dim = f->p.dim, .max_rows = f->p.max_chunk,
				       .timeout_ms = f->p.timeout_ms, .wait_hook = f->p.wait_hook,
				       .wait_ctx = f->p.wait_ctx};
	lp.pids[0] = getpid();
	lp.starts[0] = process_start_time(lp.pids[0]);
	/* Each rank's process: HELLO (it answers once it has the model from the loader). */
	for (uint32_t r = 1; r < R; r++) {
		struct rank_peer *pr = &f->peer[r];
		pr->n_pending = 0;
		int left = deadline_ms - (int)((now_ns() - t0) / 1000000);
		struct msg hello;
		rpc_client_reset(pr->c);
		int rc = rpc_wait_ready(pr->c, &hello, left > 250 ? left : 250);
		if (rc) {
			if (rc == -EREMOTEIO)
				errorf(err, errlen, -EPROTO, "stage %u (%s) refused HELLO: %s", r, pr->name, hello.error.text.p);
			else
				errorf(err, errlen, rc, "stage %u (%s) did not answer at %s/%s.ctl within %d s", r, pr->name,
				       f->run_dir, pr->name, deadline_ms / 1000);
			msg_free(&hello);
			return rc == -EREMOTEIO ? -EPROTO : rc;
		}
		pr->pid = (int)hello.hello_reply.pid;
		pr->start = process_start_time(pr->pid);
		uint64_t hash = hello.hello_reply.manifest_hash;
		msg_free(&hello);
		if (hash != f->p.manifest_hash)
			return errorf(err, errlen, -EPROTO, "stage %u (%s, pid %d) has another model than this runner "
				      "(manifest %016llx, ours %016llx)", r, pr->name, pr->pid, (unsigned long long)hash,
				      (unsigned long long)f->p.manifest_hash);
		lp.pids[r] = pr->pid;
		lp.starts[r] = pr->start;
	}
	f->formation = random_u64() | 1;
	lp.formation = f->formation;
	int rc = f->p.kv_session ? f->p.kv_session(f->p.wait_ctx, f->formation, err, errlen) : 0;
	if (rc)
		return rc;
	char name[128];
	uint8_t id[STAGE_NCCL_ID_BYTES] = {0};
	if ((rc = stage_link_open(&lp, f->link_kind, f->instance, &f->link, name, sizeof(name), id, err, errlen)) != 0)
		return rc;
	uint64_t corr[STAGE_MAX_RANKS] = {0}, pids[STAGE_MAX_RANKS];
	for (uint32_t r = 0; r < R; r++)
		pids[r] = (uint64_t)lp.pids[r];
	for (uint32_t r = 1; r < R; r++) {
		struct msg m;
		msg_init(&m, MSG_STAGE_SETUP, 0);
		struct msg_stage_setup *s = &m.stage_setup;
		s->formation = f->formation;
		s->rank = r;
		s->ranks = R;
		s->layer0 = f->plan.layer0[r];
		s->layer1 = f->plan.layer1[r];
		s->manifest_hash = f->p.manifest_hash;
		s->max_chunk = f->p.max_chunk;
		s->block_tokens = f->p.block_tokens;
		s->kv_dtype = f->p.kv_dtype;
		s->max_context = f->p.max_context;
		s->backend = (struct bytes){f->backend, (uint32_t)strlen(f->backend)};
		s->link = (struct bytes){f->link_kind, (uint32_t)strlen(f->link_kind)};
		s->link_name = (struct bytes){name, (uint32_t)strlen(name)};
		if (!strcmp(f->link_kind, "nccl"))
			s->nccl_id = (struct bytes){(char *)id, STAGE_NCCL_ID_BYTES};
		s->pids = (struct u64_array){pids, R};
		s->kv_session = f->formation;
		if ((rc = rpc_send(f->peer[r].c, &m, &corr[r])) != 0) {
			stage_link_abort(f->link, "forming failed");
			return errorf(err, errlen, rc, "cannot reach stage %u (%s): %s", r, f->peer[r].name, strerror(-rc));
		}
	}
	/* The link (NCCL: every rank joins the communicator now), then each rank's answer. */
	if ((rc = stage_link_connect(f->link)) != 0) {
		errorf(err, errlen, rc, "forming the stages' %s link: %s", f->link_kind, stage_link_error(f->link));
		stage_link_abort(f->link, err);
		return rc;
	}
	for (uint32_t r = 1; r < R; r++) {
		struct msg rep;
		rc = wait_reply(f, r, corr[r], &rep, f->p.timeout_ms);
		if (rc == 0 && rep.type != MSG_STAGE_READY)
			rc = fail(f, -EPROTO, "stage %u answered MSG_STAGE_SETUP with %s", r, msg_type_name(rep.type));
		else if (rc == 0 && (rep.stage_ready.rank != r || rep.stage_ready.layer0 != f->plan.layer0[r] ||
				     rep.stage_ready.layer1 != f->plan.layer1[r]))
			rc = fail(f, -EPROTO, "stage %u took up rank %llu, layers %llu..%llu, not what it was given", r,
				  (unsigned long long)rep.stage_ready.rank, (unsigned long long)rep.stage_ready.layer0,
				  (unsigned long long)rep.stage_ready.layer1);
		else if (rc)
			reply_fail(f, r, rc, &rep, "MSG_STAGE_SETUP");
		if (rc == 0)
			snprintf(f->peer[r].plan, sizeof(f->peer[r].plan), "%s", rep.stage_ready.plan.p ? rep.stage_ready.plan.p : "");
		msg_free(&rep);
		if (rc) {
			errorf(err, errlen, rc, "%s", f->error);
			stage_link_abort(f->link, err);
			return rc;
		}
	}
	f->formed = true;
	f->steps = 0;
	f->forms++;
	char line[1024];
	stage_plan_describe(&f->plan, line, sizeof(line));
	log_info("stages formed (formation %016llx, %s link, %.0f ms): %s", (unsigned long long)f->formation,
		 f->link_kind, (double)(now_ns() - t0) / 1e6, line);
	for (uint32_t r = 1; r < R; r++)
		log_info("stage %u (%s, pid %d): %s", r, f->peer[r].name, f->peer[r].pid, f->peer[r].plan);
	return 0;
}

/* ---- the engine's ops ---- */

static int front_begin(void *ctx, const int32_t *tokens, uint32_t n, uint32_t pos0, bool out)
{
	struct stage_front *f = ctx;
	f->error[0] = 0;
	if (!stage_front_formed(f))
		return fail(f, -EPIPE, "the stages are not formed");
	int rc = 0;
	for (uint32_t r = 1; r < f->plan.ranks && !rc; r++) {
		struct rank_peer *pr = &f->peer[r];
		rc = reap(f, r, false);
		if (!rc && pr->n_pending >= STAGE_STEPS_AHEAD) {
			uint32_t keep = STAGE_STEPS_AHEAD - 1;
			while (!rc && pr->n_pending > keep) { /* the oldest, waited for */
				struct msg rep;
				int wrc = wait_reply(f, r, pr->pending[0], &rep, f->p.timeout_ms);
				rc = wrc ? reply_fail(f, r, wrc, &rep, "a step")
				   : rep.type != MSG_STAGE_DONE
					   ? fail(f, -EPROTO, "stage %u answered a step with %s", r, msg_type_name(rep.type))
					   : 0;
				msg_free(&rep);
				memmove(pr->pending, pr->pending + 1, --pr->n_pending * sizeof(uint64_t));
			}
		}
	}
	if (rc)
		return step_failed(f, rc, "an earlier step");
	for (uint32_t i = 0; i < n; i++)
		f->tokens[i] = (uint64_t)tokens[i];
	f->steps++;
	f->steps_total++;
	for (uint32_t r = 1; r < f->plan.ranks; r++) {
		struct msg m;
		msg_init(&m, MSG_STAGE_STEP, 0);
		m.stage_step = (struct msg_stage_step){.formation = f->formation, .step = f->steps, .pos0 = pos0,
						       .flags = out ? STAGE_STEP_OUT : 0, .tokens = {f->tokens, n}};
		struct rank_peer *pr = &f->peer[r];
		uint64_t corr;
		if ((rc = rpc_send(pr->c, &m, &corr)) != 0)
			return step_failed(f, fail(f, rc, "cannot reach stage %u (%s): %s", r, pr->name, strerror(-rc)),
					   "a step");
		pr->pending[pr->n_pending++] = corr;
	}
	return 0;
}

static int front_take(void *ctx, struct backend *be, const struct backend_batch *b)
{
	struct stage_front *f = ctx;
	return fail(f, -EINVAL, "the first stage takes no rows: it embeds");
}

static int front_pass(void *ctx, struct backend *be, uint32_t n, bool out)
{
	struct stage_front *f = ctx;
	int rc = stage_link_send(f->link, be, 0, n);
	if (rc)
		return step_failed(f, fail(f, rc, "%s", stage_link_error(f->link)), "passing the hidden state");
	return 0;
}

static int front_back(void *ctx, struct backend *be, uint32_t n)
{
	struct stage_front *f = ctx;
	int rc = stage_link_recv(f->link, be, n - 1, 1, NULL);
	if (rc == 0)
		rc = stage_link_wait(f->link, be);
	if (rc)
		return step_failed(f, fail(f, rc, "%s", stage_link_error(f->link)), "the last stage's rows");
	if ((rc = drain(f)) != 0)
		return step_failed(f, rc, "the step");
	return 0;
}

/* Sends one MSG_STAGE_SEQ to every rank and waits for the answers; *value gets the least. */
static int seq_all(struct stage_front *f, uint32_t op, const int32_t *tokens, uint32_t n, uint32_t limit,
		   uint64_t seed, uint32_t *value)
{
	f->error[0] = 0;
	if (!stage_front_formed(f))
		return fail(f, -EPIPE, "the stages are not formed");
	int rc = drain(f);
	if (rc)
		return step_failed(f, rc, "an earlier step");
	if (n > f->tokens_cap)
		return fail(f, -EINVAL, "a sequence of %u tokens (at most %u)", n, f->tokens_cap);
	for (uint32_t i = 0; i < n; i++)
		f->tokens[i] = (uint64_t)tokens[i];
	uint64_t corr[STAGE_MAX_RANKS];
	for (uint32_t r = 1; r < f->plan.ranks; r++) {
		struct msg m;
		msg_init(&m, MSG_STAGE_SEQ, 0);
		m.stage_seq = (struct msg_stage_seq){.formation = f->formation, .op = op, .tokens = {f->tokens, n},
						     .limit = limit, .seed = seed};
		if ((rc = rpc_send(f->peer[r].c, &m, &corr[r])) != 0)
			return step_failed(f, fail(f, rc, "cannot reach stage %u (%s): %s", r, f->peer[r].name,
						   strerror(-rc)), "a sequence call");
	}
	uint64_t least = UINT64_MAX;
	int first = 0;
	for (uint32_t r = 1; r < f->plan.ranks; r++) {
		struct msg rep;
		rc = wait_reply(f, r, corr[r], &rep, f->p.timeout_ms);
		if (rc == 0 && rep.type != MSG_STAGE_DONE)
			rc = fail(f, -EPROTO, "stage %u answered MSG_STAGE_SEQ with %s", r, msg_type_name(rep.type));
		else if (rc)
			rc = reply_fail(f, r, rc, &rep, "a sequence call");
		else if (rep.stage_done.value < least)
			least = rep.stage_done.value;
		msg_free(&rep);
		if (rc && !first)
			first = rc;
	}
	if (first)
		return step_failed(f, first, "a sequence call");
	if (value)
		*value = least > limit ? limit : (uint32_t)least;
	return 0;
}

static int front_restore(void *ctx, const int32_t *tokens, uint32_t n, uint32_t limit, uint64_t seed,
			 uint32_t *restored)
{
	return seq_all(ctx, STAGE_SEQ_RESTORE, tokens, n, limit, seed, restored);
}

static int front_end(void *ctx)
{
	return seq_all(ctx, STAGE_SEQ_END, NULL, 0, 0, 0, NULL);
}

static int front_recover(void *ctx)
{
	return seq_all(ctx, STAGE_SEQ_RECOVER, NULL, 0, 0, 0, NULL);
}

static void front_abort(void *ctx, const char *why)
{
	struct stage_front *f = ctx;
	if (stage_front_formed(f))
		f->failures++;
	stage_front_break(f, why);
}

static const char *front_error(void *ctx)
{
	const struct stage_front *f = ctx;
	return f->error;
}

const struct engine_stage_ops stage_front_ops = {
	.begin = front_begin,
	.take = front_take,
	.pass = front_pass,
	.back = front_back,
	.restore = front_restore,
	.end = front_end,
	.recover = front_recover,
	.abort = front_abort,
	.error = front_error,
};

void stage_front_stats(const struct stage_front *f, char *buf, size_t len)
{
	uint64_t sent = 0, received = 0;
	if (f->link)
		stage_link_counts(f->link, &sent, &received);
	size_t k = 0;
	int w = snprintf(buf, len,
			 "\"ranks\":%u,\"link\":\"%s\",\"formed\":%s,\"formation\":\"%016llx\",\"forms\":%llu,"
			 "\"steps\":%llu,\"failures\":%llu,\"bytes_sent\":%llu,\"bytes_received\":%llu,\"plan\":[",
			 f->plan.ranks, f->link_kind, stage_front_formed(f) ? "true" : "false",
			 (unsigned long long)f->formation, (unsigned long long)f->forms,
			 (unsigned long long)f->steps_total, (unsigned long long)f->failures, (unsigned long long)sent,
			 (unsigned long long)received);
	if (w < 0 || (size_t)w >= len)
		return;
	k = (size_t)w;
	for (uint32_t r = 0; r < f->plan.ranks && k < len; r++) {
		w = snprintf(buf + k, len - k,
			     "%s{\"rank\":%u,\"service\":\"%s\",\"pid\":%d,\"layer0\":%u,\"layer1\":%u,\"bytes\":%llu,"
			     "\"streamed\":%llu,\"predicted_ms\":%.3f}", r ? "," : "", r, r ? f->peer[r].name : "gpu-runner",
			     r ? f->peer[r].pid : (int)getpid(), f->plan.layer0[r], f->plan.layer1[r],
			     (unsigned long long)f->plan.bytes[r], (unsigned long long)f->plan.streamed[r], f->plan.ms[r]);
		if (w < 0)
			return;
		k += (size_t)w;
	}
	if (k < len)
		snprintf(buf + k, len - k, "]");
}

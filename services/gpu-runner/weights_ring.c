#include "services/gpu-runner/weights_ring.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/manifest.h"
#include "common/shm.h"
#include "common/util.h"
#include "common/weight_ring.h"

/* How long a step waits for a loader that went away to come back, in slices of WAIT_SLICE_MS
 * (the liveness of the loader is checked, and the wait hook called, between slices). */
#define RECONNECT_MS 30000
#define WAIT_SLICE_MS 100
/* Loaders that may go away within one step before it fails; rings of gone loaders mapped at
 * once (a retired ring is unmapped by ring_source_trim_retired once nothing reads it). */
#define RECONNECT_TRIES 8
#define RETIRED_MAX 8

struct held {
	bool held;	 /* we hold a grant */
	bool permanent;	 /* acquired for good (at creation, or again after a reconnect) */
	bool stale;	 /* granted by a loader that has gone since: never released to its successor */
	bool ahead;	 /* acquired at its layer's routing (ring_route): the engine's acquire sends nothing */
	uint32_t slot;
	uint64_t generation;
	uint64_t epoch;	 /* HELLO epoch of the loader that granted it */
	char *map;	 /* the ring mapping the grant points into (the gone loader's stays mapped) */
	uint64_t offset; /* slot data offset from map */
};

struct ring_source {
	struct weight_source base; /* first: ring_source_base casts */
	struct rpc_client *loader;
	struct shm_object *obj;
	struct wring_header *h;
	int owner_pid;
	uint64_t manifest_hash;
	bool all_resident;
	int timeout_ms;
	struct model_config cfg;   /* private copies of the loader's tables */
	struct tensor_desc *tensors;
	struct group_desc *groups;
	struct held *held;	   /* n_groups */
	uint64_t *pending_release; /* groups released, not yet told to the loader */
	uint32_t n_pending;
	uint64_t epoch;		   /* HELLO epoch of the loader the current grants come from */
	struct shm_object *retired[RETIRED_MAX]; /* rings of loaders that went away, still mapped */
	uint32_t n_retired;
	uint32_t reconnects;
	uint64_t experts_ahead;	   /* expert groups acquired at their layer's routing (all time) */
	bool (*wait_hook)(void *ctx);
	void *wait_ctx;
	void (*on_map)(void *ctx, void *base, size_t size);   /* a new ring was mapped (reconnect) */
	void (*on_unmap)(void *ctx, void *base, size_t size); /* a retired ring is about to be unmapped */
	void *map_ctx;
};

/* The errno an MSG_ERROR carries, if it is one (1..4095); EIO for anything else, so that a
 * code that truncates to 0 in an int never reads as success. */
static int reply_errno(const struct msg *rep)
{
	return rep->error.code > 0 && rep->error.code < 4096 ? (int)rep->error.code : EIO;
}

/* Checks the tables the loader laid out, against the object's size and the config. */
static int check_tables(struct ring_source *rs, size_t size, char *err, size_t errlen)
{
	struct wring_header *h = rs->h;
	char why[256];
	if (model_config_check(&h->cfg, why, sizeof(why)) != 0)
		return errorf(err, errlen, -EPROTO, "the weight ring's model config is invalid: %s", why);
	rs->cfg = h->cfg;
	const struct model_config *c = &rs->cfg;
	uint32_t nt = h->n_tensors, ng = h->n_groups, ns = h->n_slots;
	if (ng != model_n_groups(c) || nt == 0 || nt > 16 * ng || ns == 0 || ns > ng)
		return errorf(err, errlen, -EPROTO, "the weight ring's table sizes are inconsistent (%u groups, %u tensors, "
			    "%u slots)", ng, nt, ns);
	struct {
		uint64_t off, bytes;
	} tables[] = {{h->tensors_off, (uint64_t)nt * sizeof(struct tensor_desc)},
		      {h->groups_off, (uint64_t)ng * sizeof(struct group_desc)},
		      {h->group_state_off, (uint64_t)ng * sizeof(struct wring_group)},
		      {h->slots_off, (uint64_t)ns * sizeof(struct wring_slot)},
		      {h->tokenizer_bytes ? h->tokenizer_off : sizeof(*h), h->tokenizer_bytes},
		      {h->chat_template_bytes ? h->chat_template_off : sizeof(*h), h->chat_template_bytes},
		      {h->data_off, h->data_bytes}};
	for (size_t i = 0; i < ARRAY_SIZE(tables); i++)
		if (tables[i].off < sizeof(*h) || tables[i].off > size || tables[i].bytes > size - tables[i].off)
			return errorf(err, errlen, -EPROTO, "the weight ring's table %zu lies outside the object", i);
	rs->tensors = malloc((size_t)nt * sizeof(struct tensor_desc));
	rs->groups = malloc((size_t)ng * sizeof(struct group_desc));
	rs->held = calloc(ng, sizeof(struct held));
	rs->pending_release = calloc(ng, sizeof(uint64_t));
	if (!rs->tensors || !rs->groups || !rs->held || !rs->pending_release)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	memcpy(rs->tensors, wring_tensors(h), (size_t)nt * sizeof(struct tensor_desc));
	memcpy(rs->groups, wring_groups(h), (size_t)ng * sizeof(struct group_desc));
	if (model_groups_check(c, rs->groups, ng, why, sizeof(why)))
		return errorf(err, errlen, -EPROTO, "the weight ring's groups: %s", why);
	for (uint32_t g = 0; g < ng; g++) {
		const struct group_desc *gd = &rs->groups[g];
		if (gd->size_class >= CLASS_COUNT || gd->slot_bytes > h->class_bytes[gd->size_class] ||
		    gd->first_tensor > nt || gd->n_tensors > nt - gd->first_tensor)
			return errorf(err, errlen, -EPROTO, "the weight ring's group %u is inconsistent", g);
		bool seen[ROLE_COUNT] = {0};
		for (uint32_t i = 0; i < gd->n_tensors; i++) {
			const struct tensor_desc *t = &rs->tensors[gd->first_tensor + i];
			uint32_t nd;
			uint64_t shape[2];
			if (t->role >= ROLE_COUNT || seen[t->role] || t->group != g || t->dtype >= DT_COUNT ||
			    model_expected_shape(c, (enum tensor_role)t->role, &nd, shape) != 0 || t->ndim != nd ||
			    t->shape[0] != shape[0] || (nd == 2 && t->shape[1] != shape[1]) ||
			    t->nbytes != (nd == 2 ? shape[0] : 1) *
						 dtype_row_bytes((enum dtype)t->dtype, nd == 2 ? shape[1] : shape[0]) ||
			    t->slot_offset > gd->slot_bytes || t->nbytes > gd->slot_bytes - t->slot_offset ||
			    model_role_group(c, (enum tensor_role)t->role, gd->layer, gd->expert) != g)
				return errorf(err, errlen, -EPROTO, "the weight ring's tensor %u (group %u) is inconsistent",
					    gd->first_tensor + i, g);
			seen[t->role] = true;
		}
	}
	return 0;
}

static void count_grant(struct ring_source *rs, uint32_t g)
{
	rs->base.bytes_acquired += rs->groups[g].tensor_bytes;
	rs->base.acquires++;
	atomic_fetch_add_explicit(&rs->h->runner.bytes_acquired, rs->groups[g].tensor_bytes, memory_order_relaxed);
}

/* Takes one MSG_W_GRANT, checks it against the ring, records it. */
static int take_grant(struct ring_source *rs, const struct msg *m, const bool *wanted)
{
	const struct msg_w_grant *gr = &m->w_grant;
	struct wring_header *h = rs->h;
	if (m->type != MSG_W_GRANT)
		return errorf(rs->base.error, sizeof(rs->base.error), -EPROTO, "the loader answered %s, not a grant",
			    msg_type_name(m->type));
	if (gr->group >= h->n_groups || !wanted[gr->group] || gr->slot >= h->n_slots)
		return errorf(rs->base.error, sizeof(rs->base.error), -EPROTO,
			    "the loader granted group %llu slot %llu, which was not asked for or does not exist",
			    (unsigned long long)gr->group, (unsigned long long)gr->slot);
	struct wring_slot *s = &wring_slots(h)[gr->slot];
	uint32_t g = (uint32_t)gr->group;
	/* The slot's data must lie inside the object: the engine reads it in place. */
	uint64_t size = shm_object_size(rs->obj);
	if (gr->offset != s->data_offset || gr->offset < h->data_off || gr->offset > size ||
	    rs->groups[g].slot_bytes > size - gr->offset || rs->groups[g].slot_bytes > s->capacity ||
	    atomic_load_explicit(&s->group, memory_order_acquire) != g ||
	    (atomic_load_explicit(&s->seq, memory_order_acquire) & 1u))
		return errorf(rs->base.error, sizeof(rs->base.error), -EPROTO,
			    "the grant of group %u does not match slot %llu in the ring", g,
			    (unsigned long long)gr->slot);
	rs->held[g] = (struct held){.held = true, .slot = (uint32_t)gr->slot, .generation = gr->generation,
				    .epoch = rs->epoch, .map = (char *)rs->h, .offset = gr->offset};
	count_grant(rs, g);
	return 0;
}

/* Waits for the reply to corr in slices: a loader that died is noticed at once rather than after
 * the whole timeout, and the wait hook runs (the runner's heartbeat). Returns as rpc_wait, or
 * -ECONNRESET when the loader that laid out the ring is gone. */
static int wait_reply(struct ring_source *rs, uint64_t corr, struct msg *rep)
{
	for (int waited = 0;;) {
		int step = rs->timeout_ms - waited < WAIT_SLICE_MS ? rs->timeout_ms - waited : WAIT_SLICE_MS;
		int rc = rpc_wait(rs->loader, corr, rep, step > 0 ? step : 0);
		if (rc != -ETIMEDOUT)
			return rc;
		waited += step;
		if (!ring_source_owner_alive(rs))
			return -ECONNRESET;
		if (waited >= rs->timeout_ms)
			return -ETIMEDOUT;
		if (rs->wait_hook && rs->wait_hook(rs->wait_ctx))
			return -ECANCELED;
	}
}

/* An acquire given up (a grant not in time, a refusal or a bad grant among several) with the
 * loader alive: the grants it sends later for that request are dropped unread (rpc_wait keeps only
 * the awaited correlation), yet the loader counted a reference for each, under our session; with
 * the smallest ring one such grant pins the only slot of its kind, and every later request failed.
 * So the session changes: before the next request the runner starts over from the loader
 * (ring_source_reconnected: a new source, window and engine, as after a loader's restart), and the
 * new session's HELLO makes the loader let go of everything the old one held (loader_hello). */
/* Every grant held is stale from here (the loader that made it is gone, or dropped it at a HELLO):
 * none is released to the loader, each is asked for again when needed. Returns how many were not
 * stale already. */
static uint32_t forget_grants(struct ring_source *rs)
{
	uint32_t dropped = 0;
	for (uint32_t g = 0; g < rs->base.n_groups; g++) {
		dropped += rs->held[g].held && !rs->held[g].stale;
		rs->held[g].stale = rs->held[g].held;
		rs->held[g].permanent = rs->held[g].ahead = false;
	}
	rs->n_pending = 0;
	return dropped;
}

static void renew_session(struct ring_source *rs)
{
	rpc_client_set_session(rs->loader, random_u64() | 1);
	rpc_client_reset(rs->loader); /* the late grants of the old requests go with the old socket */
	const uint32_t dropped = forget_grants(rs);
	rs->reconnects++;
	log_warn("ssd-loader: an acquire was given up (%s): a new session, so that the loader lets go of what "
		 "it granted for it (%u grants held before); the runner starts over from the loader",
		 rs->base.error, dropped);
}

/* Sends one ACQUIRE for groups[0..n) (with the pending releases) and collects the grants. */
static int acquire_groups(struct ring_source *rs, const uint64_t *groups, uint32_t n)
{
	/* A successor of a loader that went away would be sent releases of grants it never made
	 * (and refuse the whole acquire): look first. */
	if (!ring_source_owner_alive(rs))
		return errorf(rs->base.error, sizeof(rs->base.error), -ECONNRESET,
			      "ssd-loader (pid %d) went away", rs->owner_pid);
	struct msg req, rep;
	msg_init(&req, MSG_W_ACQUIRE, 0);
	req.w_acquire.groups.v = (uint64_t *)groups;
	req.w_acquire.groups.n = n;
	req.w_acquire.release.v = rs->pending_release;
	req.w_acquire.release.n = rs->n_pending;
	req.w_acquire.session = rpc_client_session(rs->loader);
	/* Before the request goes: a failure after it would leave its grants to nobody. */
	bool *wanted = calloc(rs->h->n_groups, sizeof(bool));
	if (!wanted)
		return errorf(rs->base.error, sizeof(rs->base.error), -ENOMEM, "out of memory");
	uint64_t corr;
	int rc = rpc_send(rs->loader, &req, &corr);
	if (rc) {
		free(wanted);
		return errorf(rs->base.error, sizeof(rs->base.error), rc, "cannot reach ssd-loader: %s", strerror(-rc));
	}
	rs->n_pending = 0;
	for (uint32_t i = 0; i < n; i++)
		wanted[groups[i]] = true;
	for (uint32_t got = 0; got < n; got++) {
		rc = wait_reply(rs, corr, &rep);
		if (rc == -EREMOTEIO) {
			rc = errorf(rs->base.error, sizeof(rs->base.error), -reply_errno(&rep), "ssd-loader: %s",
				    rep.error.text.p);
			msg_free(&rep);
			break;
		}
		if (rc) {
			errorf(rs->base.error, sizeof(rs->base.error), rc, "no grant from ssd-loader: %s",
			       rc == -ECONNRESET ? "its process died"
			       : rc == -ECANCELED ? "gpu-runner is stopping"
						   : strerror(-rc));
			break;
		}
		rc = take_grant(rs, &rep, wanted);
		if (rc == 0)
			wanted[rep.w_grant.group] = false;
		msg_free(&rep);
		if (rc)
			break;
	}
	free(wanted);
	if (rc && rc != -ECONNRESET && rc != -ECANCELED && ring_source_owner_alive(rs))
		renew_session(rs);
	return rc;
}

static int reconnect(struct ring_source *rs);

static int ring_acquire(struct weight_source *ws, uint32_t group, struct group_weights *w)
{
	struct ring_source *rs = (struct ring_source *)ws;
	if (group >= rs->base.n_groups)
		return errorf(ws->error, sizeof(ws->error), -EINVAL, "no group %u", group);
	if (!weight_stage_has(&ws->stage, &rs->groups[group]))
		return errorf(ws->error, sizeof(ws->error), -EINVAL, "group %u is not in this runner's layers %u..%u",
			      group, ws->stage.layer0, ws->stage.layer1 - 1);
	for (uint32_t attempt = 0;; attempt++) {
		atomic_store_explicit(&rs->h->runner.position, group, memory_order_relaxed);
		struct held *hd = &rs->held[group];
		int rc = 0;
		if (!hd->held || hd->stale) {
			uint64_t g = group;
			rc = acquire_groups(rs, &g, 1);
		} else if (hd->ahead) {
			hd->ahead = false; /* granted (and counted) at the routing */
		} else if (!hd->permanent) {
			count_grant(rs, group);
		}
		if (rc == 0)
			break;
		/* The loader is there: it refused, or did not answer in time; or the runner is stopping.
		 * -ECONNRESET means a liveness check already found it gone: a second look at a process
		 * being torn down may answer otherwise, and reconnecting to a live loader is safe (its
		 * HELLO drops our grants, which we then hold as stale). */
		if (rc == -ECANCELED || (rc != -ECONNRESET && ring_source_owner_alive(rs)))
			return rc;
		/* It went away (killed, restarted): its successor serves the same bytes. Drop what the
		 * gone one granted, say HELLO to the new one and ask again; the step goes on. */
		if (attempt == RECONNECT_TRIES)
			return errorf(ws->error, sizeof(ws->error), -ECONNRESET,
				      "ssd-loader went away %d times during one step", RECONNECT_TRIES);
		if ((rc = reconnect(rs)) != 0)
			return rc;
	}
	const struct held *hd = &rs->held[group], *e = &rs->held[group_id_embed()];
	weights_fill(ws, group, hd->map + hd->offset, e->held ? e->map + e->offset : NULL, w);
	return 0;
}

static int ring_release(struct weight_source *ws, uint32_t group)
{
	struct ring_source *rs = (struct ring_source *)ws;
	if (group >= rs->base.n_groups || !rs->held[group].held)
		return errorf(ws->error, sizeof(ws->error), -EINVAL, "group %u is not held", group);
	if (rs->held[group].stale) { /* its loader is gone, and the successor never granted it */
		rs->held[group].held = rs->held[group].stale = false;
		return 0;
	}
	if (rs->held[group].permanent)
		return 0;
	rs->held[group].held = rs->held[group].ahead = false;
	rs->pending_release[rs->n_pending++] = group;
	return 0;
}

static int send_release(struct ring_source *rs, uint64_t *groups, uint32_t n)
{
	if (!n)
		return 0;
	struct msg req, rep;
	msg_init(&req, MSG_W_RELEASE, 0);
	req.w_release.groups.v = groups;
	req.w_release.groups.n = n;
	req.w_release.session = rpc_client_session(rs->loader);
	/* Waited for as an acquire is: a loader killed after the caller looked at it is noticed in
	 * a slice, not after the whole timeout, and the runner beats meanwhile (a client takes five
	 * seconds without a heartbeat for a runner gone, and gives the request up). */
	uint64_t corr;
	memset(&rep, 0, sizeof(rep));
	int rc = rpc_send(rs->loader, &req, &corr);
	if (rc == 0)
		rc = wait_reply(rs, corr, &rep);
	if (rc == -EREMOTEIO)
		errorf(rs->base.error, sizeof(rs->base.error), rc, "ssd-loader refused a release: %s", rep.error.text.p);
	else if (rc)
		errorf(rs->base.error, sizeof(rs->base.error), rc, "ssd-loader did not answer a release: %s",
		       rc == -ECONNRESET ? "its process died"
		       : rc == -ECANCELED ? "gpu-runner is stopping"
					   : strerror(-rc));
	if (rc == 0 || rc == -EREMOTEIO)
		msg_free(&rep);
	return rc;
}

static int ring_release_all(struct weight_source *ws)
{
	struct ring_source *rs = (struct ring_source *)ws;
	for (uint32_t g = 0; g < rs->base.n_groups; g++) {
		if (rs->held[g].held && rs->held[g].stale) {
			rs->held[g].held = rs->held[g].stale = false;
		} else if (rs->held[g].held && !rs->held[g].permanent) {
			rs->held[g].held = rs->held[g].ahead = false;
			rs->pending_release[rs->n_pending++] = g;
		}
	}
	int rc = send_release(rs, rs->pending_release, rs->n_pending);
	rs->n_pending = 0;
	return rc;
}

static int ring_flush(struct weight_source *ws)
{
	struct ring_source *rs = (struct ring_source *)ws;
	if (!rs->n_pending || !ring_source_owner_alive(rs))
		return 0; /* a gone loader's successor never granted them: the next acquire drops them */
	int rc = send_release(rs, rs->pending_release, rs->n_pending);
	rs->n_pending = 0;
	return rc;
}

/* A mixture-of-experts layer's routing: the engine then acquires only the experts it chose, and
 * passes the others over (skip), so the loader reads no unchosen expert from disk (it reads experts
 * only when asked: loader.h). The chosen ones that stream (not pinned, not held) are asked for here
 * in one ACQUIRE, as many as the expert class's streaming slots hold beside our grants, so that the
 * loader reads them at once; the engine's acquires then find them held (ahead). Not for a stage of a
 * split model (ranks share the expert slots: one waiting for another's release could wait on a rank
 * that waits for it). No expert is left for the CPU here (on_cpu stays false). */
static int ring_route(struct weight_source *ws, uint32_t layer, const bool *used, bool *on_cpu)
{
	struct ring_source *rs = (struct ring_source *)ws;
	(void)on_cpu;
	const uint32_t E = rs->cfg.n_experts;
	if (rs->all_resident || ws->stage.split || !E || layer >= rs->cfg.n_layers)
		return 0;
	uint64_t *want = malloc(E * sizeof(uint64_t));
	if (!want)
		return 0; /* the engine's acquires ask one at a time */
	uint32_t n = 0;
	for (uint32_t e = 0; e < E; e++) {
		uint32_t g = model_group_expert(&rs->cfg, layer, e);
		if (used[e] && g < rs->base.n_groups && !ring_source_group_pinned(rs, g) &&
		    !(rs->held[g].held && !rs->held[g].stale))
			want[n++] = g;
	}
	/* One is what the engine's acquire would ask for anyway. Else as many as there is room for: the
	 * expert class's streaming slots, less those our grants hold (a release pending goes with the
	 * acquire, before it); counted only then, as it walks every group. */
	if (n >= 2) {
		uint32_t room = ring_source_streaming_slots(rs, CLASS_EXPERT);
		for (uint32_t g = 0; g < rs->base.n_groups && room; g++)
			if (rs->groups[g].size_class == CLASS_EXPERT && rs->held[g].held && !rs->held[g].stale &&
			    !ring_source_group_pinned(rs, g))
				room--;
		n = n < room ? n : room;
	}
	/* A loader that went away is the engine's acquire's to reconnect to (what was granted is kept);
	 * any other failure fails the step, as an acquire's would. */
	int rc = n >= 2 ? acquire_groups(rs, want, n) : 0;
	if (rc == -ECONNRESET || (rc && rc != -ECANCELED && !ring_source_owner_alive(rs))) {
		rs->base.error[0] = 0;
		rc = 0;
	}
	for (uint32_t i = 0; n >= 2 && i < n; i++)
		if (rs->held[want[i]].held && !rs->held[want[i]].stale) {
			rs->held[want[i]].ahead = true;
			rs->experts_ahead++;
		}
	free(want);
	return rc;
}

static int ring_skip(struct weight_source *ws, uint32_t group)
{
	return 0;
}

static const struct weight_source_ops ring_ops = {
	.acquire = ring_acquire,
	.release = ring_release,
	.release_all = ring_release_all,
	.route = ring_route,
	.skip = ring_skip,
	.flush = ring_flush,
};

/* Maps the ring a HELLO reply names and checks its tables into rs (tensors, groups, held,
 * pending_release allocated; free them with free_tables). */
static int open_ring(struct ring_source *rs, const struct msg_hello_reply *hello, char *err, size_t errlen)
{
	if (hello->layout != WRING_LAYOUT_VERSION)
		return errorf(err, errlen, -EPROTO, "ssd-loader uses weight ring layout %llu, this runner %d",
			      (unsigned long long)hello->layout, WRING_LAYOUT_VERSION);
	int rc = shm_object_attach(hello->shm_name.p, SHM_KIND_WEIGHT_RING, WRING_LAYOUT_VERSION, true, &rs->obj);
	if (rc)
		return errorf(err, errlen, rc, "cannot map the weight ring %s: %s", hello->shm_name.p, strerror(-rc));
	rs->h = shm_object_base(rs->obj);
	rs->owner_pid = atomic_load(&rs->h->shm.owner_pid);
	rs->epoch = hello->epoch;
	if (rs->h->manifest_hash != hello->manifest_hash)
		return errorf(err, errlen, -EPROTO, "the weight ring holds another model than ssd-loader announced");
	rc = check_tables(rs, shm_object_size(rs->obj), err, errlen);
	if (rc)
		return rc;
	rs->manifest_hash = rs->h->manifest_hash;
	rs->all_resident = rs->h->all_resident != 0;
	return 0;
}

static void free_tables(struct ring_source *rs)
{
	free(rs->tensors);
	free(rs->groups);
	free(rs->held);
	free(rs->pending_release);
	rs->tensors = NULL;
	rs->groups = NULL;
	rs->held = NULL;
	rs->pending_release = NULL;
}

/* Acquires the groups kept for good: all when resident, else the globals (embed, head) and the
 * groups the loader pins in DRAM (they never leave their slots: held for good they cost no message a
 * token, and the CPU reads them in place); of the stage's groups only (weights.h), and not those
 * held already. */
static int acquire_keep(struct ring_source *rs)
{
	uint32_t ng = rs->base.n_groups, n = 0;
	uint64_t *keep = calloc(ng, sizeof(uint64_t));
	if (!keep)
		return errorf(rs->base.error, sizeof(rs->base.error), -ENOMEM, "out of memory");
	for (uint32_t g = 0; g < ng; g++)
		if ((rs->all_resident || rs->groups[g].kind == GROUP_EMBED || rs->groups[g].kind == GROUP_HEAD ||
		     ring_source_group_pinned(rs, g)) &&
		    weight_stage_has(&rs->base.stage, &rs->groups[g]) && !(rs->held[g].held && !rs->held[g].stale))
			keep[n++] = g;
	int rc = acquire_groups(rs, keep, n);
	for (uint32_t i = 0; i < n && rc == 0; i++)
		rs->held[keep[i]].permanent = true;
	free(keep);
	return rc;
}

int ring_source_create(struct rpc_client *loader, const struct msg_hello_reply *hello, int timeout_ms,
		       const struct weight_stage *stage, bool (*wait_hook)(void *ctx), void *wait_ctx,
		       struct ring_source **out, char *err, size_t errlen)
{
	struct ring_source *rs = calloc(1, sizeof(*rs));
	if (!rs)
		return -ENOMEM;
	rs->loader = loader;
	rs->timeout_ms = timeout_ms;
	rs->wait_hook = wait_hook; /* the acquire of the groups kept for good, below, beats too */
	rs->wait_ctx = wait_ctx;
	int rc = open_ring(rs, hello, err, errlen);
	if (rc)
		goto out_free;
	rs->base.ops = &ring_ops;
	rs->base.cfg = &rs->cfg;
	rs->base.tensors = rs->tensors;
	rs->base.groups = rs->groups;
	rs->base.n_tensors = rs->h->n_tensors;
	rs->base.n_groups = rs->h->n_groups;
	if (stage) {
		if (stage->split && (stage->layer0 > stage->layer1 || stage->layer1 > rs->cfg.n_layers)) {
			rc = errorf(err, errlen, -EINVAL, "layers %u..%u are not a range of the model's %u layers",
				    stage->layer0, stage->layer1, rs->cfg.n_layers);
			goto out_free;
		}
		rs->base.stage = *stage;
	}
	rc = acquire_keep(rs);
	if (rc) {
		errorf(err, errlen, rc, "%s", rs->base.error);
		goto out_free;
	}
	log_info("weight ring %s: %u groups, %s", hello->shm_name.p, rs->base.n_groups,
		 rs->all_resident ? "all resident" : "globals resident, layers streamed");
	*out = rs;
	return 0;

out_free:
	shm_object_close(&rs->obj, false);
	free_tables(rs);
	free(rs);
	return rc;
}

/* Does the ring t (a successor's) describe the model exactly as rs does: the same tensors at the
 * same places in their slots? The engine computes from rs's tables. */
static int same_layout(const struct ring_source *rs, const struct ring_source *t, char *err, size_t errlen)
{
	if (t->manifest_hash != rs->manifest_hash || t->h->n_tensors != rs->base.n_tensors ||
	    t->h->n_groups != rs->base.n_groups)
		return errorf(err, errlen, -EPROTO, "ssd-loader came back with another model");
	for (uint32_t i = 0; i < rs->base.n_tensors; i++) {
		const struct tensor_desc *a = &rs->tensors[i], *b = &t->tensors[i];
		if (a->group != b->group || a->role != b->role || a->dtype != b->dtype || a->ndim != b->ndim ||
		    a->shape[0] != b->shape[0] || a->shape[1] != b->shape[1] || a->nbytes != b->nbytes ||
		    a->slot_offset != b->slot_offset)
			return errorf(err, errlen, -EPROTO, "ssd-loader came back with tensor %u laid out otherwise", i);
	}
	for (uint32_t g = 0; g < rs->base.n_groups; g++) {
		const struct group_desc *a = &rs->groups[g], *b = &t->groups[g];
		if (a->kind != b->kind || a->layer != b->layer || a->size_class != b->size_class ||
		    a->first_tensor != b->first_tensor || a->n_tensors != b->n_tensors ||
		    a->slot_bytes != b->slot_bytes || a->tensor_bytes != b->tensor_bytes)
			return errorf(err, errlen, -EPROTO, "ssd-loader came back with group %u laid out otherwise", g);
	}
	return 0;
}

/* One try at taking the ring of the loader that now answers: HELLO (the loader drops every
 * grant an earlier HELLO's runner held), map its ring, check it holds the same layout, switch
 * to it (the old mapping is kept: stale grants still point into it), acquire the groups kept
 * for good. Returns 0; -ETIMEDOUT, -ENOENT, -EAGAIN or -ECONNRESET when trying again may help
 * (no answer yet, the ring not there yet, the new loader gone too); another -errno otherwise. */
static int take_new_ring(struct ring_source *rs, char *err, size_t errlen)
{
	struct msg hello;
	rpc_client_reset(rs->loader); /* replies meant for the old socket are dropped with it */
	int rc = rpc_hello(rs->loader, &hello, 250);
	if (rc == -EREMOTEIO) {
		errorf(err, errlen, -EPROTO, "ssd-loader refused HELLO: %s", hello.error.text.p);
		msg_free(&hello);
		return -EPROTO;
	}
	if (rc)
		return errorf(err, errlen, -ETIMEDOUT, "no ssd-loader answers HELLO");
	if (rs->n_retired == RETIRED_MAX) {
		msg_free(&hello);
		return errorf(err, errlen, -EMFILE, "ssd-loader went away %d times in one request", RETIRED_MAX);
	}
	struct ring_source t = {.loader = rs->loader, .timeout_ms = rs->timeout_ms};
	rc = open_ring(&t, &hello.hello_reply, err, errlen);
	msg_free(&hello);
	if (rc == 0)
		rc = same_layout(rs, &t, err, errlen);
	free_tables(&t);
	if (rc) {
		shm_object_close(&t.obj, false);
		return rc;
	}
	/* Every grant so far came from a loader that is gone now (or from this one before our HELLO,
	 * which dropped it): none is released to the new one. */
	(void)forget_grants(rs);
	rs->retired[rs->n_retired++] = rs->obj;
	rs->obj = t.obj;
	rs->h = t.h;
	rs->owner_pid = t.owner_pid;
	rs->epoch = t.epoch;
	rs->all_resident = t.all_resident;
	rs->reconnects++; /* grants from here on point into the new mapping (ring_source_generation) */
	if (rs->on_map) /* a GPU window page-locks it, as it did the first one */
		rs->on_map(rs->map_ctx, rs->h, shm_object_size(rs->obj));
	rc = acquire_keep(rs);
	if (rc)
		errorf(err, errlen, rc, "%s", rs->base.error);
	return rc;
}

/* The loader went away in the middle of a step. Its grants are dropped without a release (its
 * successor never made them), and the new loader's ring is taken; the caller asks again for
 * what the step needs. Waits up to RECONNECT_MS for a loader to answer. Returns 0 or -errno with
 * the source's error set. */
static int reconnect(struct ring_source *rs)
{
	int old_pid = rs->owner_pid;
	uint32_t dropped = 0;
	for (uint32_t g = 0; g < rs->base.n_groups; g++)
		dropped += rs->held[g].held && !rs->held[g].stale && rs->held[g].epoch == rs->epoch;
	log_warn("ssd-loader (pid %d) went away in the middle of a step (%s): dropping the %u grants it made, "
		 "reconnecting",
		 old_pid, rs->base.error, dropped);
	char err[512] = "";
	uint64_t deadline = now_ns() + (uint64_t)RECONNECT_MS * 1000000ull;
	for (;;) {
		if (rs->wait_hook && rs->wait_hook(rs->wait_ctx))
			return errorf(rs->base.error, sizeof(rs->base.error), -ECANCELED,
				      "ssd-loader (pid %d) went away in the middle of a step, and gpu-runner is stopping",
				      old_pid);
		int rc = take_new_ring(rs, err, sizeof(err));
		if (rc == 0)
			break;
		if (rc != -ETIMEDOUT && rc != -ENOENT && rc != -EAGAIN && rc != -ECONNRESET)
			return errorf(rs->base.error, sizeof(rs->base.error), rc,
				      "ssd-loader (pid %d) went away in the middle of a step; taking over from its "
				      "successor failed: %s",
				      old_pid, err);
		if (now_ns() >= deadline)
			return errorf(rs->base.error, sizeof(rs->base.error), rc,
				      "ssd-loader (pid %d) went away and no loader took over within %d s: %s", old_pid,
				      RECONNECT_MS / 1000, err);
		if (rc != -ETIMEDOUT) /* a HELLO try waits by itself */
			usleep(50 * 1000);
	}
	log_info("ssd-loader is back (pid %d, epoch %016llx, ring %s): the step goes on", rs->owner_pid,
		 (unsigned long long)rs->epoch, shm_object_get_name(rs->obj));
	return 0;
}

void ring_source_destroy(struct ring_source **rsp)
{
	if (!rsp || !*rsp)
		return;
	struct ring_source *rs = *rsp;
	if (ring_source_owner_alive(rs)) {
		for (uint32_t g = 0; g < rs->base.n_groups; g++)
			if (rs->held[g].held)
				rs->held[g].permanent = false;
		ring_release_all(&rs->base);
	}
	shm_object_close(&rs->obj, false);
	for (uint32_t i = 0; i < rs->n_retired; i++)
		shm_object_close(&rs->retired[i], false);
	free_tables(rs);
	free(rs);
	*rsp = NULL;
}

int ring_source_set_stage(struct ring_source *rs, const struct weight_stage *stage, char *err, size_t errlen)
{
	const struct model_config *c = &rs->cfg;
	if (stage->split && (stage->layer0 > stage->layer1 || stage->layer1 > c->n_layers))
		return errorf(err, errlen, -EINVAL, "layers %u..%u are not a range of the model's %u layers",
			      stage->layer0, stage->layer1, c->n_layers);
	rs->base.stage = *stage;
	/* Groups kept for good that the stage leaves go back to the loader (with the releases pending)... */
	uint32_t n = rs->n_pending;
	for (uint32_t g = 0; g < rs->base.n_groups; g++) {
		struct held *hd = &rs->held[g];
		if (!hd->held || weight_stage_has(stage, &rs->groups[g]))
			continue;
		if (hd->stale) {
			hd->held = hd->stale = false;
			continue;
		}
		hd->held = hd->permanent = false;
		rs->pending_release[n++] = g;
	}
	int rc = send_release(rs, rs->pending_release, n);
	rs->n_pending = 0;
	if (rc == 0)
		rc = acquire_keep(rs); /* ...and those it takes on are acquired */
	if (rc)
		return errorf(err, errlen, rc, "%s", rs->base.error);
	return 0;
}

void ring_source_set_wait_hook(struct ring_source *rs, bool (*fn)(void *ctx), void *ctx)
{
	rs->wait_hook = fn;
	rs->wait_ctx = ctx;
}

void ring_source_set_mapping_hooks(struct ring_source *rs, void (*on_map)(void *ctx, void *base, size_t size),
				   void (*on_unmap)(void *ctx, void *base, size_t size), void *ctx)
{
	rs->on_map = on_map;
	rs->on_unmap = on_unmap;
	rs->map_ctx = ctx;
}

uint32_t ring_source_generation(const struct ring_source *rs)
{
	return rs->reconnects;
}

uint32_t ring_source_n_retired(const struct ring_source *rs)
{
	return rs->n_retired;
}

uint32_t ring_source_trim_retired(struct ring_source *rs)
{
	uint32_t kept = 0, unmapped = 0;
	for (uint32_t i = 0; i < rs->n_retired; i++) {
		struct shm_object *o = rs->retired[i];
		const char *base = shm_object_base(o);
		size_t size = shm_object_size(o);
		/* A stale grant still points into it: whoever holds it may still read it. */
		uint32_t refs = 0;
		for (uint32_t g = 0; g < rs->base.n_groups; g++)
			refs += rs->held[g].held && rs->held[g].stale && rs->held[g].map >= base &&
				rs->held[g].map < base + size;
		if (refs) {
			rs->retired[kept++] = o;
			continue;
		}
		if (rs->on_unmap)
			rs->on_unmap(rs->map_ctx, (void *)base, size);
		log_info("unmapped the weight ring of the ssd-loader that went away (%s, %zu bytes)",
			 shm_object_get_name(o), size);
		shm_object_close(&o, false);
		unmapped++;
	}
	for (uint32_t i = kept; i < rs->n_retired; i++)
		rs->retired[i] = NULL;
	rs->n_retired = kept;
	return unmapped;
}

bool ring_source_reconnected(const struct ring_source *rs)
{
	return rs->reconnects > 0;
}

struct weight_source *ring_source_base(struct ring_source *rs)
{
	return &rs->base;
}

bool ring_source_owner_alive(const struct ring_source *rs)
{
	return atomic_load(&rs->h->shm.owner_pid) == rs->owner_pid && shm_owner_alive(&rs->h->shm);
}

uint64_t ring_source_manifest_hash(const struct ring_source *rs)
{
	return rs->manifest_hash;
}

bool ring_source_all_resident(const struct ring_source *rs)
{
	return rs->all_resident;
}

const void *ring_source_group_base(const struct ring_source *rs, uint32_t group)
{
	/* (A group the loader pins is held for good: acquire_keep.) */
	if (group >= rs->base.n_groups || !rs->held[group].held)
		return NULL;
	return rs->held[group].map + rs->held[group].offset;
}

uint64_t ring_source_experts_ahead(const struct ring_source *rs)
{
	return rs->experts_ahead;
}

uint32_t ring_source_streaming_slots(const struct ring_source *rs, uint32_t c)
{
	if (rs->all_resident || c >= CLASS_COUNT)
		return UINT32_MAX;
	uint32_t pinned = 0;
	const struct wring_group *gs = wring_group_state(rs->h);
	for (uint32_t g = 0; g < rs->h->n_groups; g++)
		if (rs->groups[g].size_class == c && atomic_load_explicit(&gs[g].pinned, memory_order_relaxed))
			pinned++;
	uint32_t slots = rs->h->class_slots[c];
	return slots > pinned ? slots - pinned : 0;
}

bool ring_source_group_pinned(const struct ring_source *rs, uint32_t g)
{
	if (rs->all_resident)
		return true;
	return g < rs->h->n_groups && atomic_load_explicit(&wring_group_state(rs->h)[g].pinned, memory_order_relaxed);
}

void ring_source_disk_plan(const struct ring_source *rs, uint64_t *bytes_per_token, uint64_t *bytes_per_s)
{
	*bytes_per_token = rs->h->plan.disk_bytes_per_token;
	*bytes_per_s = rs->h->plan.disk_bytes_per_s;
}

void ring_source_mapping(const struct ring_source *rs, void **base, size_t *size)
{
	*base = rs->h;
	*size = shm_object_size(rs->obj);
}

void ring_source_chat_template(const struct ring_source *rs, const char **data, size_t *len)
{
	*data = rs->h->chat_template_bytes ? (const char *)rs->h + rs->h->chat_template_off : NULL;
	*len = (size_t)rs->h->chat_template_bytes;
}

void ring_source_tokenizer(const struct ring_source *rs, const char **data, size_t *len)
{
	*data = rs->h->tokenizer_bytes ? (const char *)rs->h + rs->h->tokenizer_off : NULL;
	*len = (size_t)rs->h->tokenizer_bytes;
}

void ring_source_count_token(struct ring_source *rs)
{
	atomic_fetch_add_explicit(&rs->h->runner.tokens, 1, memory_order_relaxed);
}

void ring_source_set_timeout(struct ring_source *rs, int timeout_ms)
{
	rs->timeout_ms = timeout_ms;
}

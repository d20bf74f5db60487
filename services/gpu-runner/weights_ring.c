#include "services/gpu-runner/weights_ring.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/manifest.h"
#include "common/shm.h"
#include "common/util.h"
#include "common/weight_ring.h"

struct held {
	bool held;	 /* we hold a grant */
	bool permanent;	 /* acquired for good at creation */
	uint32_t slot;
	uint64_t generation;
	uint64_t offset; /* slot data offset from the base */
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
			    t->nbytes != shape[0] * (nd == 2 ? shape[1] : 1) * dtype_size((enum dtype)t->dtype) ||
			    t->slot_offset > gd->slot_bytes || t->nbytes > gd->slot_bytes - t->slot_offset ||
			    model_role_group(c, (enum tensor_role)t->role, gd->layer) != g)
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
				    .offset = gr->offset};
	count_grant(rs, g);
	return 0;
}

/* Sends one ACQUIRE for groups[0..n) (with the pending releases) and collects the grants. */
static int acquire_groups(struct ring_source *rs, const uint64_t *groups, uint32_t n)
{
	struct msg req, rep;
	msg_init(&req, MSG_W_ACQUIRE, 0);
	req.w_acquire.groups.v = (uint64_t *)groups;
	req.w_acquire.groups.n = n;
	req.w_acquire.release.v = rs->pending_release;
	req.w_acquire.release.n = rs->n_pending;
	uint64_t corr;
	int rc = rpc_send(rs->loader, &req, &corr);
	if (rc)
		return errorf(rs->base.error, sizeof(rs->base.error), rc, "cannot reach ssd-loader: %s", strerror(-rc));
	rs->n_pending = 0;
	bool *wanted = calloc(rs->h->n_groups, sizeof(bool));
	if (!wanted)
		return -ENOMEM;
	for (uint32_t i = 0; i < n; i++)
		wanted[groups[i]] = true;
	for (uint32_t got = 0; got < n; got++) {
		rc = rpc_wait(rs->loader, corr, &rep, rs->timeout_ms);
		if (rc == -EREMOTEIO) {
			rc = errorf(rs->base.error, sizeof(rs->base.error), -reply_errno(&rep), "ssd-loader: %s",
				    rep.error.text.p);
			msg_free(&rep);
			break;
		}
		if (rc) {
			errorf(rs->base.error, sizeof(rs->base.error), rc, "no grant from ssd-loader: %s", strerror(-rc));
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
	return rc;
}

static int ring_acquire(struct weight_source *ws, uint32_t group, struct group_weights *w)
{
	struct ring_source *rs = (struct ring_source *)ws;
	if (group >= rs->h->n_groups)
		return errorf(ws->error, sizeof(ws->error), -EINVAL, "no group %u", group);
	atomic_store_explicit(&rs->h->runner.position, group, memory_order_relaxed);
	if (!rs->held[group].held) {
		uint64_t g = group;
		int rc = acquire_groups(rs, &g, 1);
		if (rc)
			return rc;
	} else if (!rs->held[group].permanent) {
		count_grant(rs, group);
	}
	const struct held *e = &rs->held[group_id_embed()];
	weights_fill(ws, group, (char *)rs->h + rs->held[group].offset, e->held ? (char *)rs->h + e->offset : NULL, w);
	return 0;
}

static int ring_release(struct weight_source *ws, uint32_t group)
{
	struct ring_source *rs = (struct ring_source *)ws;
	if (group >= rs->h->n_groups || !rs->held[group].held)
		return errorf(ws->error, sizeof(ws->error), -EINVAL, "group %u is not held", group);
	if (rs->held[group].permanent)
		return 0;
	rs->held[group].held = false;
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
	int rc = rpc_call(rs->loader, &req, &rep, rs->timeout_ms);
	if (rc == -EREMOTEIO)
		errorf(rs->base.error, sizeof(rs->base.error), rc, "ssd-loader refused a release: %s", rep.error.text.p);
	else if (rc)
		errorf(rs->base.error, sizeof(rs->base.error), rc, "ssd-loader did not answer a release: %s",
		     strerror(-rc));
	if (rc == 0 || rc == -EREMOTEIO)
		msg_free(&rep);
	return rc;
}

static int ring_release_all(struct weight_source *ws)
{
	struct ring_source *rs = (struct ring_source *)ws;
	for (uint32_t g = 0; g < rs->h->n_groups; g++) {
		if (rs->held[g].held && !rs->held[g].permanent) {
			rs->held[g].held = false;
			rs->pending_release[rs->n_pending++] = g;
		}
	}
	int rc = send_release(rs, rs->pending_release, rs->n_pending);
	rs->n_pending = 0;
	return rc;
}

static const struct weight_source_ops ring_ops = {
	.acquire = ring_acquire,
	.release = ring_release,
	.release_all = ring_release_all,
};

int ring_source_create(struct rpc_client *loader, const struct msg_hello_reply *hello, int timeout_ms,
		       struct ring_source **out, char *err, size_t errlen)
{
	if (hello->layout != WRING_LAYOUT_VERSION)
		return errorf(err, errlen, -EPROTO, "ssd-loader uses weight ring layout %llu, this runner %d",
			    (unsigned long long)hello->layout, WRING_LAYOUT_VERSION);
	struct ring_source *rs = calloc(1, sizeof(*rs));
	if (!rs)
		return -ENOMEM;
	rs->loader = loader;
	rs->timeout_ms = timeout_ms;
	int rc = shm_object_attach(hello->shm_name.p, SHM_KIND_WEIGHT_RING, WRING_LAYOUT_VERSION, true, &rs->obj);
	if (rc) {
		errorf(err, errlen, rc, "cannot map the weight ring %s: %s", hello->shm_name.p, strerror(-rc));
		goto out_free;
	}
	rs->h = shm_object_base(rs->obj);
	rs->owner_pid = atomic_load(&rs->h->shm.owner_pid);
	if (rs->h->manifest_hash != hello->manifest_hash) {
		rc = errorf(err, errlen, -EPROTO, "the weight ring holds another model than ssd-loader announced");
		goto out_free;
	}
	rc = check_tables(rs, shm_object_size(rs->obj), err, errlen);
	if (rc)
		goto out_free;
	rs->manifest_hash = rs->h->manifest_hash;
	rs->all_resident = rs->h->all_resident != 0;
	rs->base.ops = &ring_ops;
	rs->base.cfg = &rs->cfg;
	rs->base.tensors = rs->tensors;
	rs->base.groups = rs->groups;
	rs->base.n_tensors = rs->h->n_tensors;
	rs->base.n_groups = rs->h->n_groups;

	/* Groups kept for good: all when resident, else the globals. */
	uint32_t ng = rs->h->n_groups, n = 0;
	uint64_t *keep = calloc(ng, sizeof(uint64_t));
	if (!keep) {
		rc = -ENOMEM;
		goto out_free;
	}
	for (uint32_t g = 0; g < ng; g++)
		if (rs->all_resident || rs->groups[g].kind == GROUP_EMBED || rs->groups[g].kind == GROUP_HEAD)
			keep[n++] = g;
	rc = acquire_groups(rs, keep, n);
	free(keep);
	if (rc) {
		errorf(err, errlen, rc, "%s", rs->base.error);
		goto out_free;
	}
	for (uint32_t g = 0; g < ng; g++)
		if (rs->held[g].held)
			rs->held[g].permanent = true;
	log_info("weight ring %s: %u groups, %s", hello->shm_name.p, ng,
		 rs->all_resident ? "all resident" : "globals resident, layers streamed");
	*out = rs;
	return 0;

out_free:
	shm_object_close(&rs->obj, false);
	free(rs->tensors);
	free(rs->groups);
	free(rs->held);
	free(rs->pending_release);
	free(rs);
	return rc;
}

void ring_source_destroy(struct ring_source **rsp)
{
	if (!rsp || !*rsp)
		return;
	struct ring_source *rs = *rsp;
	if (ring_source_owner_alive(rs)) {
		for (uint32_t g = 0; g < rs->h->n_groups; g++)
			if (rs->held[g].held)
				rs->held[g].permanent = false;
		ring_release_all(&rs->base);
	}
	shm_object_close(&rs->obj, false);
	free(rs->tensors);
	free(rs->groups);
	free(rs->held);
	free(rs->pending_release);
	free(rs);
	*rsp = NULL;
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
	if (group >= rs->h->n_groups || !rs->held[group].held)
		return NULL;
	return (const char *)rs->h + rs->held[group].offset;
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

void ring_source_tokenizer(const struct ring_source *rs, const char **data, size_t *len)
{
	*data = rs->h->tokenizer_bytes ? (const char *)rs->h + rs->h->tokenizer_off : NULL;
	*len = (size_t)rs->h->tokenizer_bytes;
}

void ring_source_count_token(struct ring_source *rs)
{
	atomic_fetch_add_explicit(&rs->h->runner.tokens, 1, memory_order_relaxed);
}

/* loader.c - slot state machine, waiters, read-ahead and eviction. See loader.h. */
#include "services/ssd-loader/loader.h"

#include <assert.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "services/ssd-loader/reader.h"

#define NO_GROUP WRING_NO_GROUP
#define NO_SLOT WRING_NO_SLOT
#define PROGRESS_NS 1000000000ull

/* Loader-side view of a slot; the shared state (seq, state, group, refs, generation) lives in
 * the ring, written only here. */
struct lslot {
	uint32_t cls;	       /* enum size_class */
	uint32_t dedicated;    /* the pinned group this slot is for, or NO_GROUP (streaming) */
	uint32_t extents_left; /* reads of the current load not yet completed */
	int err;	       /* first error of the current load */
	char errtext[PATH_MAX + 256];
};

struct lgroup {
	uint32_t slot;	  /* slot holding or loading the group, NO_SLOT */
	uint32_t waiters; /* queued acquires of this group */
	bool failed;	  /* the last read failed: read-ahead leaves it until an acquire asks again */
	bool window;	  /* inside the read-ahead window of the current position (scratch) */
	bool initial;	  /* part of the initial load (progress log) */
};

struct waiter {
	struct bus_peer peer;
	uint64_t corr;
	uint32_t group;
	uint32_t holder; /* whose reference the grant will be */
};

/* Whose references a slot's refs count: one holder per client session (the runners of a model split
 * across several each hold their own groups), so that a runner that restarts drops only what its
 * predecessor held. Session 0: clients that name none. */
struct holder {
	bool used;
	char name[64];	  /* the client name its session said HELLO with ("" until one does) */
	uint64_t session;
	uint32_t *refs;	  /* n_groups: references held */
};

struct loader {
	const struct manifest *m;
	const struct plan *plan;
	struct wring_header *h;
	struct wring_slot *slots;
	struct wring_group *gstate;
	uint64_t ring_bytes;
	struct reader *reader;
	struct loader_ops ops;
	void *ctx;

	uint32_t n_groups, n_slots;
	struct lslot *ls;	 /* n_slots */
	struct lgroup *lg;	 /* n_groups */
	uint64_t *ext_need;	 /* per extent: bytes the file must supply (the rest may lie past its end) */
	uint32_t *counts;	 /* n_groups scratch for validating releases, kept zero */
	struct waiter *w;
	uint32_t n_w, cap_w;
	struct holder holders[LOADER_MAX_HOLDERS];

	uint32_t position;
	bool need_schedule;
	bool has_streaming;
	uint32_t read_ahead, read_ahead_max; /* groups per class read ahead of the position (live tuning) */

	uint64_t groups_loaded, grants, releases, waits;
	/* Loads into streaming slots (reads from disk of groups not pinned), and their bytes, per class. */
	uint64_t streamed[CLASS_COUNT], streamed_bytes[CLASS_COUNT];

	bool initial_active;
	uint32_t initial_left, initial_groups;
	uint64_t initial_bytes, initial_start_ns, last_progress_ns, initial_read_base;
};

static void on_read_done(void *ctx, uint64_t tag, int rc, const char *text);

static const char *group_label(const struct loader *l, uint32_t g, char *buf, size_t len)
{
	const struct group_desc *gd = &l->m->groups[g];
	if (gd->kind == GROUP_ATTN || gd->kind == GROUP_FFN)
		snprintf(buf, len, "group %u (%s of layer %u)", g, group_kind_name(gd->kind), gd->layer);
	else
		snprintf(buf, len, "group %u (%s)", g, group_kind_name(gd->kind));
	return buf;
}

/* Checks that the manifest's extents fit the slots and computes how much of each extent the
 * file must supply: up to the end of the last tensor byte inside it. */
static int check_and_measure(struct loader *l, char *err, size_t errlen)
{
	const struct manifest *m = l->m;
	for (uint32_t g = 0; g < m->n_groups; g++) {
		const struct group_desc *gd = &m->groups[g];
		uint64_t cap = plan_class_capacity(l->plan, gd->size_class);
		if (gd->slot_bytes > cap || (uint64_t)gd->first_extent + gd->n_extents > m->n_extents ||
		    (uint64_t)gd->first_tensor + gd->n_tensors > m->n_tensors) {
			snprintf(err, errlen, "group %u does not fit its slot (%llu of %llu bytes) or its tables", g,
				 (unsigned long long)gd->slot_bytes, (unsigned long long)cap);
			return -EINVAL;
		}
		if (!plan_group_pinned(l->plan, g) && plan_streaming_slots(l->plan, gd->size_class) == 0) {
			snprintf(err, errlen, "group %u is neither pinned nor has a streaming slot of its class", g);
			return -EINVAL;
		}
		for (uint32_t e = gd->first_extent; e < gd->first_extent + gd->n_extents; e++) {
			const struct read_extent *x = &m->extents[e];
			if (x->group != g || x->file_index >= m->n_files || x->length == 0 ||
			    x->slot_offset + x->length > cap || x->file_offset % MANIFEST_ALIGN ||
			    x->length % MANIFEST_ALIGN || x->slot_offset % MANIFEST_ALIGN) {
				snprintf(err, errlen,
					 "read extent %u of group %u (file %u, offset %llu, %llu bytes, slot offset %llu) "
					 "is not aligned or does not fit a slot of %llu bytes",
					 e, g, x->file_index, (unsigned long long)x->file_offset,
					 (unsigned long long)x->length, (unsigned long long)x->slot_offset,
					 (unsigned long long)cap);
				return -EINVAL;
			}
			uint64_t x_end = x->file_offset + x->length, need = 0;
			for (uint32_t t = gd->first_tensor; t < gd->first_tensor + gd->n_tensors; t++) {
				const struct tensor_desc *td = &m->tensors[t];
				uint64_t t_end = td->file_offset + td->nbytes;
				if (td->file_index != x->file_index || td->file_offset >= x_end ||
				    t_end <= x->file_offset)
					continue;
				uint64_t end = (t_end < x_end ? t_end : x_end) - x->file_offset;
				if (end > need)
					need = end;
			}
			l->ext_need[e] = need;
		}
	}
	return 0;
}

int loader_create(const struct loader_params *p, const struct loader_ops *ops, void *ctx, struct loader **out,
		  char *err, size_t errlen)
{
	if (!p || !p->m || !p->plan || !p->ring || !ops || !ops->grant || !ops->fail ||
	    plan_n_groups(p->plan) != p->m->n_groups || p->ring->n_slots != plan_n_slots(p->plan) ||
	    p->ring->n_groups != p->m->n_groups || p->m->n_files == 0) {
		snprintf(err, errlen, "loader parameters do not match (manifest, plan and ring disagree)");
		return -EINVAL;
	}
	int rc = -ENOMEM;
	struct loader *l = calloc(1, sizeof(*l));
	if (!l)
		goto out_nomem;
	l->m = p->m;
	l->plan = p->plan;
	l->h = p->ring;
	l->ring_bytes = p->ring_bytes;
	l->slots = wring_slots(p->ring);
	l->gstate = wring_group_state(p->ring);
	l->ops = *ops;
	l->ctx = ctx;
	l->n_groups = p->m->n_groups;
	l->n_slots = plan_n_slots(p->plan);
	l->ls = calloc(l->n_slots ? l->n_slots : 1, sizeof(*l->ls));
	l->lg = calloc(l->n_groups, sizeof(*l->lg));
	l->ext_need = calloc(p->m->n_extents ? p->m->n_extents : 1, sizeof(*l->ext_need));
	l->counts = calloc(l->n_groups, sizeof(*l->counts));
	if (!l->ls || !l->lg || !l->ext_need || !l->counts)
		goto out_free;
	for (uint32_t s = 0; s < l->n_slots; s++) {
		const struct wring_slot *ws = &l->slots[s];
		l->ls[s].cls = plan_slot_class(p->plan, s);
		l->ls[s].dedicated = plan_slot_group(p->plan, s);
		if (l->ls[s].dedicated == NO_GROUP)
			l->has_streaming = true;
		if (ws->data_offset % PLAN_SLOT_ALIGN || ws->data_offset + ws->capacity > p->ring_bytes ||
		    ws->capacity < plan_class_capacity(p->plan, l->ls[s].cls)) {
			snprintf(err, errlen, "slot %u of the ring does not match the plan", s);
			rc = -EINVAL;
			goto out_free;
		}
	}
	for (uint32_t g = 0; g < l->n_groups; g++)
		l->lg[g].slot = NO_SLOT;
	for (uint32_t c = 0; c < CLASS_COUNT; c++)
		if (plan_streaming_slots(p->plan, c) > l->read_ahead_max)
			l->read_ahead_max = plan_streaming_slots(p->plan, c);
	l->read_ahead = l->read_ahead_max;
	rc = check_and_measure(l, err, errlen);
	if (rc)
		goto out_free;

	const char **paths = calloc(p->m->n_files, sizeof(*paths));
	struct file_id *ids = calloc(p->m->n_files, sizeof(*ids));
	if (!paths || !ids) {
		free(paths);
		free(ids);
		rc = -ENOMEM;
		goto out_free;
	}
	/* The files the manifest read: a rewrite since (its hash and offsets are the old file's)
	 * fails the start with -ESTALE rather than serving the new bytes as the old layout. */
	for (uint32_t i = 0; i < p->m->n_files; i++) {
		paths[i] = p->m->files[i].path;
		ids[i] = p->m->files[i].id;
	}
	struct reader_params rp = {.n_files = p->m->n_files, .paths = paths, .queue_depth = p->io_depth,
				   .max_read = p->max_read, .buffered = p->buffered,
				   .inline_issue = p->inline_issue, .ids = ids};
	rc = reader_create(&rp, on_read_done, l, &l->reader, err, errlen);
	free(paths);
	free(ids);
	if (rc)
		goto out_free;
	*out = l;
	return 0;

out_free:
	free(l->ls);
	free(l->lg);
	free(l->ext_need);
	free(l->counts);
	free(l);
out_nomem:
	if (rc == -ENOMEM)
		snprintf(err, errlen, "out of memory setting up the loader");
	return rc;
}

void loader_destroy(struct loader **lp)
{
	if (!lp || !*lp)
		return;
	struct loader *l = *lp;
	/* First: the kernel may still be writing into slots. */
	reader_destroy(&l->reader);
	free(l->ls);
	free(l->lg);
	free(l->ext_need);
	free(l->counts);
	free(l->w);
	for (uint32_t i = 0; i < LOADER_MAX_HOLDERS; i++)
		free(l->holders[i].refs);
	free(l);
	*lp = NULL;
}

static void sync_counters(struct loader *l)
{
	struct reader_stats st;
	reader_get_stats(l->reader, &st);
	atomic_store(&l->h->loader.bytes_read, st.bytes_read);
	atomic_store(&l->h->loader.reads_done, st.reads_done);
	atomic_store(&l->h->loader.reads_pending, st.in_flight);
	atomic_store(&l->h->loader.groups_loaded, l->groups_loaded);
	atomic_store(&l->h->loader.grants, l->grants);
	atomic_store(&l->h->loader.releases, l->releases);
	atomic_store(&l->h->loader.waits, l->waits);
	atomic_store(&l->h->loader.position, l->position);
}

static uint32_t distance(const struct loader *l, uint32_t g)
{
	return (g + l->n_groups - l->position) % l->n_groups;
}

static uint32_t slot_refs(const struct loader *l, uint32_t g)
{
	uint32_t s = l->lg[g].slot;
	if (s == NO_SLOT || atomic_load(&l->slots[s].state) != WSLOT_READY)
		return 0;
	return atomic_load(&l->slots[s].refs);
}

static void grant(struct loader *l, const struct bus_peer *peer, uint64_t corr, uint32_t g, uint32_t holder)
{
	uint32_t s = l->lg[g].slot;
	struct wring_slot *ws = &l->slots[s];
	assert(s != NO_SLOT && atomic_load(&ws->state) == WSLOT_READY && atomic_load(&ws->group) == g);
	struct msg_w_grant gr = {.group = g,
				 .slot = s,
				 .generation = atomic_load(&ws->generation),
				 .offset = ws->data_offset,
				 .bytes = l->m->groups[g].slot_bytes};
	/* The reference first: a runner that reads the slot as soon as the grant arrives must
	 * find it counted. */
	atomic_fetch_add(&ws->refs, 1);
	l->holders[holder].refs[g]++;
	int rc = l->ops.grant(l->ctx, peer, corr, &gr);
	if (rc) {
		char lab[96];
		atomic_fetch_sub(&ws->refs, 1);
		l->holders[holder].refs[g]--;
		log_warn("the grant of %s could not be delivered (%s): no reference taken",
			 group_label(l, g, lab, sizeof(lab)), strerror(-rc));
		return;
	}
	l->grants++;
}

static void remove_waiters(struct loader *l, uint32_t g, int code, const char *text)
{
	uint32_t j = 0;
	for (uint32_t i = 0; i < l->n_w; i++) {
		struct waiter *w = &l->w[i];
		if (w->group != g) {
			if (j != i)
				l->w[j] = *w;
			j++;
			continue;
		}
		if (code)
			l->ops.fail(l->ctx, &w->peer, w->corr, code, text);
		else
			grant(l, &w->peer, w->corr, g, w->holder);
	}
	l->n_w = j;
	l->lg[g].waiters = 0;
}

static void finish_load(struct loader *l, uint32_t s)
{
	struct wring_slot *ws = &l->slots[s];
	struct lslot *ls = &l->ls[s];
	uint32_t g = atomic_load(&ws->group);
	struct lgroup *lg = &l->lg[g];
	char lab[96];
	group_label(l, g, lab, sizeof(lab));
	if (ls->err == 0) {
		atomic_fetch_add(&ws->generation, 1);
		atomic_store(&ws->state, WSLOT_READY);
		/* Even again: the slot is stable (pairs with the runner's acquire load of seq). */
		atomic_fetch_add_explicit(&ws->seq, 1, memory_order_release);
		atomic_store(&l->gstate[g].slot, s);
		atomic_fetch_add(&l->gstate[g].loads, 1);
		l->groups_loaded++;
		if (ls->dedicated == NO_GROUP && ls->cls < CLASS_COUNT) {
			l->streamed[ls->cls]++;
			l->streamed_bytes[ls->cls] += l->m->groups[g].slot_bytes;
		}
		lg->failed = false;
		log_debug("%s ready in slot %u", lab, s);
		remove_waiters(l, g, 0, NULL);
	} else {
		char text[sizeof(ls->errtext) + 128];
		snprintf(text, sizeof(text), "cannot load %s: %s", lab, ls->errtext);
		log_error("%s", text);
		/* The load's own errno (ESTALE: the checkpoint changed under the loader, which a retry
		 * cannot mend), EIO where it has none. */
		remove_waiters(l, g, ls->err < 0 && ls->err > -4096 ? -ls->err : EIO, text);
		atomic_store(&ws->state, WSLOT_EMPTY);
		atomic_store(&ws->group, NO_GROUP);
		atomic_fetch_add_explicit(&ws->seq, 1, memory_order_release);
		lg->slot = NO_SLOT;
		lg->failed = true;
	}
	if (lg->initial) {
		lg->initial = false;
		l->initial_left--;
	}
	l->need_schedule = true;
}

static void on_read_done(void *ctx, uint64_t tag, int rc, const char *text)
{
	struct loader *l = ctx;
	assert(tag < l->n_slots);
	struct lslot *ls = &l->ls[tag];
	if (rc && !ls->err) {
		ls->err = rc;
		str_copy(ls->errtext, sizeof(ls->errtext), text ? text : strerror(-rc));
	}
	assert(ls->extents_left > 0);
	if (--ls->extents_left == 0)
		finish_load(l, (uint32_t)tag);
}

/* Fills slot s with group g: the previous occupant (if any) leaves the slot first. */
static void begin_load(struct loader *l, uint32_t s, uint32_t g)
{
	struct wring_slot *ws = &l->slots[s];
	struct lslot *ls = &l->ls[s];
	const struct group_desc *gd = &l->m->groups[g];
	uint32_t state = atomic_load(&ws->state);
	assert(state != WSLOT_LOADING && atomic_load(&ws->refs) == 0 && l->lg[g].slot == NO_SLOT);
	if (state == WSLOT_READY) {
		uint32_t old = atomic_load(&ws->group);
		assert(l->lg[old].waiters == 0);
		atomic_store(&l->gstate[old].slot, NO_SLOT);
		l->lg[old].slot = NO_SLOT;
	}
	/* Odd: the slot is being written (the runner holds no grant on it). */
	atomic_fetch_add_explicit(&ws->seq, 1, memory_order_acq_rel);
	atomic_store(&ws->state, WSLOT_LOADING);
	atomic_store(&ws->group, g);
	l->lg[g].slot = s;
	ls->err = 0;
	ls->errtext[0] = 0;
	ls->extents_left = gd->n_extents;
	char *base = (char *)l->h + ws->data_offset;
	for (uint32_t e = gd->first_extent; e < gd->first_extent + gd->n_extents; e++) {
		const struct read_extent *x = &l->m->extents[e];
		int rc = reader_read(l->reader, x->file_index, x->file_offset, x->length, l->ext_need[e],
				     base + x->slot_offset, s);
		if (rc) {
			if (!ls->err) {
				ls->err = -EIO;
				snprintf(ls->errtext, sizeof(ls->errtext), "cannot queue the read of %s at offset %llu: %s",
					 l->m->files[x->file_index].path, (unsigned long long)x->file_offset,
					 strerror(-rc));
			}
			ls->extents_left--;
		}
	}
	if (ls->extents_left == 0)
		finish_load(l, s);
}

/* A slot of class c to load into: an EMPTY streaming slot, else the READY one whose group is
 * used farthest ahead, is unreferenced, has no waiters and lies outside the window. */
static uint32_t pick_slot(struct loader *l, uint32_t c)
{
	uint32_t best = NO_SLOT, best_d = 0;
	for (uint32_t s = 0; s < l->n_slots; s++) {
		if (l->ls[s].dedicated != NO_GROUP || l->ls[s].cls != c)
			continue;
		struct wring_slot *ws = &l->slots[s];
		uint32_t state = atomic_load(&ws->state);
		if (state == WSLOT_EMPTY)
			return s;
		if (state != WSLOT_READY || atomic_load(&ws->refs) != 0)
			continue;
		uint32_t v = atomic_load(&ws->group);
		if (l->lg[v].waiters || l->lg[v].window)
			continue;
		uint32_t d = distance(l, v);
		if (best == NO_SLOT || d > best_d) {
			best = s;
			best_d = d;
		}
	}
	return best;
}

static void mark_window(struct loader *l)
{
	for (uint32_t g = 0; g < l->n_groups; g++)
		l->lg[g].window = false;
	/* Experts are read only when asked for: a token's routing chooses a few of each layer's, and the
	 * runner asks for those alone (loader.h). */
	for (uint32_t c = 0; c < CLASS_COUNT; c++) {
		if (c == CLASS_EXPERT)
			continue;
		uint32_t k = plan_streaming_slots(l->plan, c), n = 0;
		if (k > l->read_ahead)
			k = l->read_ahead;
		for (uint32_t d = 0; d < l->n_groups && n < k; d++) {
			uint32_t g = (l->position + d) % l->n_groups;
			if (l->m->groups[g].size_class != c || plan_group_pinned(l->plan, g))
				continue;
			l->lg[g].window = true;
			n++;
		}
	}
}

static void schedule_once(struct loader *l)
{
	l->need_schedule = false;
	/* Pinned groups: their own slot, read at start and again only if asked after a failure. */
	for (uint32_t s = 0; s < l->n_slots; s++) {
		uint32_t g = l->ls[s].dedicated;
		if (g == NO_GROUP || atomic_load(&l->slots[s].state) != WSLOT_EMPTY)
			continue;
		if (!l->lg[g].failed || l->lg[g].waiters)
			begin_load(l, s, g);
	}
	if (!l->has_streaming)
		return;
	/* Streaming groups in order of need: waited-for ones and the read-ahead window. */
	mark_window(l);
	bool blocked[CLASS_COUNT] = {false};
	for (uint32_t d = 0; d < l->n_groups; d++) {
		uint32_t g = (l->position + d) % l->n_groups;
		uint32_t c = l->m->groups[g].size_class;
		struct lgroup *lg = &l->lg[g];
		if (plan_group_pinned(l->plan, g) || blocked[c] || lg->slot != NO_SLOT)
			continue;
		if (!lg->waiters && !(lg->window && !lg->failed))
			continue;
		uint32_t s = pick_slot(l, c);
		if (s == NO_SLOT) {
			/* Every slot of the class is in use or needed sooner: wait for a release. */
			blocked[c] = true;
			continue;
		}
		begin_load(l, s, g);
	}
}

static void schedule(struct loader *l)
{
	/* A pass can finish loads at once (a read that could not be queued), which may free a
	 * slot; failed groups are not retried without a waiter, so this ends. */
	l->need_schedule = true;
	for (uint32_t i = 0; l->need_schedule && i <= l->n_groups + 1; i++)
		schedule_once(l);
	sync_counters(l);
}

void loader_start(struct loader *l)
{
	l->initial_start_ns = now_ns();
	l->last_progress_ns = l->initial_start_ns;
	struct reader_stats st;
	reader_get_stats(l->reader, &st);
	l->initial_read_base = st.bytes_read;
	schedule(l);
	for (uint32_t g = 0; g < l->n_groups; g++) {
		uint32_t s = l->lg[g].slot;
		if (s == NO_SLOT || atomic_load(&l->slots[s].state) != WSLOT_LOADING)
			continue;
		l->lg[g].initial = true;
		l->initial_left++;
		l->initial_groups++;
		const struct group_desc *gd = &l->m->groups[g];
		for (uint32_t e = gd->first_extent; e < gd->first_extent + gd->n_extents; e++)
			l->initial_bytes += l->m->extents[e].length;
	}
	l->initial_active = true;
	char total[32];
	log_info("reading %u groups (%s) into the weight ring", l->initial_groups,
		 format_size(l->initial_bytes, total, sizeof(total)));
}

static void set_position(struct loader *l, uint32_t g)
{
	l->position = g;
	atomic_store(&l->h->loader.position, g);
}

/* Does holder h hold anything: a reference, or a waiting acquire? */
static bool holder_busy(const struct loader *l, const struct holder *h)
{
	for (uint32_t g = 0; g < l->n_groups; g++)
		if (h->refs[g])
			return true;
	for (uint32_t i = 0; i < l->n_w; i++)
		if (l->w[i].holder == (uint32_t)(h - l->holders))
			return true;
	return false;
}

/* The holder of session's references, made on first use when create; NULL (err set) when there is
 * none and create is false, or every holder is taken (an idle one is reclaimed first). */
static struct holder *holder_of(struct loader *l, uint64_t session, bool create, int *code, char *err,
				size_t errlen)
{
	struct holder *free_h = NULL;
	for (uint32_t i = 0; i < LOADER_MAX_HOLDERS; i++) {
		struct holder *h = &l->holders[i];
		if (h->used && h->session == session)
			return h;
		if (!h->used && !free_h)
			free_h = h;
	}
	if (!create) {
		snprintf(err, errlen, "a release from a client session that holds no weight group (released more "
			 "often than granted)");
		*code = -EINVAL;
		return NULL;
	}
	for (uint32_t i = 0; !free_h && i < LOADER_MAX_HOLDERS; i++)
		if (!holder_busy(l, &l->holders[i]))
			free_h = &l->holders[i]; /* holds nothing: its session is over, or never held */
	if (!free_h) {
		snprintf(err, errlen, "more than %d client sessions hold weight groups", LOADER_MAX_HOLDERS);
		*code = -EUSERS;
		return NULL;
	}
	if (!free_h->refs && !(free_h->refs = calloc(l->n_groups, sizeof(uint32_t)))) {
		snprintf(err, errlen, "out of memory for a client session's references (%u groups)", l->n_groups);
		*code = -ENOMEM;
		return NULL;
	}
	free_h->used = true;
	free_h->session = session;
	free_h->name[0] = 0;
	return free_h;
}

/* Checks ids and that each release has a reference of holder h to drop; applies nothing. */
static int validate(struct loader *l, const struct holder *h, const char *what, const uint64_t *groups, uint32_t n,
		    const uint64_t *release, uint32_t n_release, char *err, size_t errlen)
{
	int rc = 0;
	for (uint32_t i = 0; i < n; i++) {
		if (groups[i] >= l->n_groups) {
			snprintf(err, errlen, "%s: group id %llu is out of range (the model has %u groups)", what,
				 (unsigned long long)groups[i], l->n_groups);
			return -EINVAL;
		}
	}
	for (uint32_t i = 0; i < n_release; i++) {
		if (release[i] >= l->n_groups) {
			snprintf(err, errlen, "%s: release of group id %llu, out of range (the model has %u groups)",
				 what, (unsigned long long)release[i], l->n_groups);
			return -EINVAL;
		}
	}
	for (uint32_t i = 0; i < n_release && !rc; i++) {
		uint32_t g = (uint32_t)release[i];
		uint32_t held = slot_refs(l, g) < h->refs[g] ? slot_refs(l, g) : h->refs[g];
		if (++l->counts[g] > held) {
			char lab[96];
			snprintf(err, errlen, "%s: release of %s, of which this client holds %u reference%s (released more "
				 "often than granted)", what, group_label(l, g, lab, sizeof(lab)), held, held == 1 ? "" : "s");
			rc = -EINVAL;
		}
	}
	for (uint32_t i = 0; i < n_release; i++)
		l->counts[release[i]] = 0;
	return rc;
}

static void release_one(struct loader *l, struct holder *h, uint32_t g)
{
	struct wring_slot *ws = &l->slots[l->lg[g].slot];
	uint32_t refs = atomic_fetch_sub(&ws->refs, 1) - 1;
	h->refs[g]--;
	l->releases++;
	/* The runner is done with the group it was at: it is past it now. */
	if (refs == 0 && g == l->position)
		set_position(l, (g + 1) % l->n_groups);
}

int loader_acquire(struct loader *l, uint64_t session, const struct bus_peer *peer, uint64_t corr,
		   const uint64_t *groups, uint32_t n, const uint64_t *release, uint32_t n_release, char *err, size_t errlen)
{
	int code = 0;
	struct holder *h = holder_of(l, session, true, &code, err, errlen);
	if (!h)
		return code;
	int rc = validate(l, h, "MSG_W_ACQUIRE", groups, n, release, n_release, err, errlen);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n_release; i++)
		release_one(l, h, (uint32_t)release[i]);
	if (n)
		set_position(l, (uint32_t)groups[0]);
	for (uint32_t i = 0; i < n; i++) {
		uint32_t g = (uint32_t)groups[i];
		struct lgroup *lg = &l->lg[g];
		if (lg->slot != NO_SLOT && atomic_load(&l->slots[lg->slot].state) == WSLOT_READY) {
			grant(l, peer, corr, g, (uint32_t)(h - l->holders));
			continue;
		}
		if (l->n_w == l->cap_w) {
			uint32_t cap = l->cap_w ? 2 * l->cap_w : 64;
			struct waiter *w = realloc(l->w, cap * sizeof(*w));
			if (!w) {
				/* Grants already sent stand; the rest of this acquire is refused. */
				snprintf(err, errlen, "out of memory queueing an acquire of group %u", g);
				schedule(l);
				return -ENOMEM;
			}
			l->w = w;
			l->cap_w = cap;
		}
		l->w[l->n_w++] = (struct waiter){.peer = *peer, .corr = corr, .group = g,
						 .holder = (uint32_t)(h - l->holders)};
		lg->waiters++;
		lg->failed = false; /* asked for again: try the read again */
		l->waits++;
	}
	schedule(l);
	return 0;
}

int loader_release(struct loader *l, uint64_t session, const uint64_t *groups, uint32_t n, char *err, size_t errlen)
{
	int code = 0;
	struct holder *h = holder_of(l, session, false, &code, err, errlen);
	if (!h)
		return n ? code : 0;
	int rc = validate(l, h, "MSG_W_RELEASE", NULL, 0, groups, n, err, errlen);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n; i++)
		release_one(l, h, (uint32_t)groups[i]);
	schedule(l);
	return 0;
}

/* Drops what holder h holds: its references and its waiting acquires; frees it. */
static void drop_holder(struct loader *l, struct holder *h, const char *client)
{
	uint64_t refs = 0;
	uint32_t hi = (uint32_t)(h - l->holders), waiters = 0, j = 0;
	for (uint32_t g = 0; g < l->n_groups; g++) {
		if (!h->refs[g])
			continue;
		refs += h->refs[g];
		if (l->lg[g].slot != NO_SLOT)
			atomic_fetch_sub(&l->slots[l->lg[g].slot].refs, h->refs[g]);
		h->refs[g] = 0;
	}
	for (uint32_t i = 0; i < l->n_w; i++) {
		if (l->w[i].holder == hi) {
			l->lg[l->w[i].group].waiters--;
			waiters++;
			continue;
		}
		l->w[j++] = l->w[i];
	}
	l->n_w = j;
	h->used = false;
	log_info("%s said HELLO: dropped %llu references and %u waiting acquires held by an earlier %s", client,
		 (unsigned long long)refs, waiters, h->name[0] ? h->name : "client");
}

void loader_hello(struct loader *l, const char *client, uint64_t session)
{
	bool runner = !strncmp(client, "gpu-runner", strlen("gpu-runner"));
	for (uint32_t i = 0; i < LOADER_MAX_HOLDERS; i++) {
		struct holder *h = &l->holders[i];
		if (!h->used || (session && h->session == session))
			continue;
		/* A runner's new session replaces its earlier one (the process restarted); one that names
		 * none replaces every holder that named none, as when one runner was all there was. */
		if (runner && (h->session == 0 || !strcmp(h->name, client)))
			drop_holder(l, h, client);
	}
	if (session) {
		char err[128];
		int code = 0;
		struct holder *h = holder_of(l, session, true, &code, err, sizeof(err));
		if (h)
			snprintf(h->name, sizeof(h->name), "%s", client);
	}
	schedule(l);
}

int loader_eventfd(const struct loader *l)
{
	return reader_eventfd(l->reader);
}

int loader_process_io(struct loader *l, bool wait)
{
	int n = reader_process(l->reader, wait);
	if (n < 0)
		log_error("io_uring failed: %s", strerror(-n));
	if (l->need_schedule)
		schedule(l);
	else
		sync_counters(l);
	return n;
}

bool loader_io_busy(const struct loader *l)
{
	return !reader_idle(l->reader);
}

void loader_tick(struct loader *l)
{
	/* A submission the kernel refused for the moment (EAGAIN/EBUSY) with nothing in flight
	 * gives no completion to wake the loop: retry it from the tick. */
	if (loader_io_busy(l))
		loader_process_io(l, false);
	if (!l->initial_active)
		return;
	uint64_t now = now_ns();
	struct reader_stats st;
	reader_get_stats(l->reader, &st);
	double secs = (double)(now - l->initial_start_ns) * 1e-9;
	uint64_t done = st.bytes_read - l->initial_read_base;
	if (l->initial_left == 0) {
		char total[32];
		l->initial_active = false;
		log_info("loaded %u groups (%s) in %.2f s, %.2f GB/s", l->initial_groups,
			 format_size(done, total, sizeof(total)), secs, secs > 0 ? (double)done / secs * 1e-9 : 0.0);
		return;
	}
	if (now - l->last_progress_ns < PROGRESS_NS)
		return;
	l->last_progress_ns = now;
	log_info("loaded %.1f of %.1f GiB, %.1f GB/s", (double)done / (1024.0 * 1024 * 1024),
		 (double)l->initial_bytes / (1024.0 * 1024 * 1024), secs > 0 ? (double)done / secs * 1e-9 : 0.0);
}

uint32_t loader_read_ahead(const struct loader *l)
{
	return l->read_ahead;
}

uint32_t loader_read_ahead_max(const struct loader *l)
{
	return l->read_ahead_max;
}

void loader_set_read_ahead(struct loader *l, uint32_t groups)
{
	l->read_ahead = groups < l->read_ahead_max ? groups : l->read_ahead_max;
	schedule(l); /* a wider window starts its reads now */
}

uint32_t loader_io_limit(const struct loader *l)
{
	return reader_limit(l->reader);
}

uint32_t loader_io_depth(const struct loader *l)
{
	return reader_depth(l->reader);
}

int loader_set_io_limit(struct loader *l, uint32_t reads)
{
	int rc = reader_set_limit(l->reader, reads);
	if (rc == 0)
		sync_counters(l);
	return rc;
}

uint32_t loader_waiters(const struct loader *l)
{
	return l->n_w;
}

uint32_t loader_position(const struct loader *l)
{
	return l->position;
}

bool loader_o_direct(const struct loader *l)
{
	struct reader_stats st;
	reader_get_stats(l->reader, &st);
	return st.direct_files > 0;
}

char *loader_stats_json(const struct loader *l)
{
	struct reader_stats st;
	reader_get_stats(l->reader, &st);
	double secs = (double)st.busy_ns * 1e-9;
	json_t *o = json_object();
	if (!o)
		return NULL;
	uint32_t waiting = l->n_w;
	/* What a decode token reads from disk once the resident groups are in. */
	uint64_t per_token = plan_disk_bytes_per_pass(l->plan, l->m), streamed = 0;
	for (uint32_t c = 0; c < CLASS_COUNT; c++)
		streamed += l->streamed[c];
	struct {
		const char *key;
		json_t *v;
	} kv[] = {
		{"disk_bytes_per_token", json_integer((json_int_t)per_token)},
		{"groups", json_integer(l->n_groups)},
		{"slots", json_integer(l->n_slots)},
		{"slots_attn", json_integer(plan_class_slots(l->plan, CLASS_ATTN))},
		{"slots_ffn", json_integer(plan_class_slots(l->plan, CLASS_FFN))},
		{"slots_global", json_integer(plan_class_slots(l->plan, CLASS_GLOBAL))},
		{"slots_expert", json_integer(plan_class_slots(l->plan, CLASS_EXPERT))},
		{"groups_streamed", json_integer((json_int_t)streamed)},
		{"expert_groups_streamed", json_integer((json_int_t)l->streamed[CLASS_EXPERT])},
		{"expert_bytes_streamed", json_integer((json_int_t)l->streamed_bytes[CLASS_EXPERT])},
		{"all_resident", json_boolean(plan_all_resident(l->plan))},
		{"dram_budget", json_integer((json_int_t)plan_budget(l->plan))},
		{"ring_bytes", json_integer((json_int_t)l->ring_bytes)},
		{"model_bytes", json_integer((json_int_t)l->m->total_tensor_bytes)},
		{"bytes_read", json_integer((json_int_t)st.bytes_read)},
		{"reads_done", json_integer((json_int_t)st.reads_done)},
		{"reads_pending", json_integer((json_int_t)st.in_flight)},
		{"reads_queued", json_integer((json_int_t)st.queued)},
		{"groups_loaded", json_integer((json_int_t)l->groups_loaded)},
		{"grants", json_integer((json_int_t)l->grants)},
		{"releases", json_integer((json_int_t)l->releases)},
		{"waits", json_integer((json_int_t)l->waits)},
		{"waiting", json_integer(waiting)},
		{"position", json_integer(l->position)},
		{"o_direct", json_boolean(st.direct_files > 0)},
		{"read_ahead", json_integer(l->read_ahead)},
		{"io_depth_limit", json_integer(reader_limit(l->reader))},
		{"disk_read_seconds", json_real(secs)},
		{"disk_bytes_per_s", json_real(secs > 0 ? (double)st.bytes_read / secs : 0.0)},
	};
	char *text = NULL;
	bool ok = true;
	/* set_new takes each value, also when it fails; a NULL value (ENOMEM) fails the call. */
	for (size_t i = 0; i < ARRAY_SIZE(kv); i++)
		ok = json_object_set_new(o, kv[i].key, kv[i].v) == 0 && ok;
	/* Slots by state (for pipeline-inspect): one pass over the slot table, once a second. A
	 * READY slot with grants outstanding is "held" (by the runner), not "ready". */
	uint32_t by_state[4] = {0};
	for (uint32_t s = 0; s < l->n_slots; s++) {
		uint32_t state = atomic_load_explicit(&l->slots[s].state, memory_order_relaxed);
		if (state == WSLOT_READY && atomic_load_explicit(&l->slots[s].refs, memory_order_relaxed))
			state = 3;
		by_state[state < 3 ? state : 3]++;
	}
	ok = json_object_set_new(o, "slots_by_state",
				 json_pack("{s:i, s:i, s:i, s:i}", "empty", (int)by_state[WSLOT_EMPTY], "loading",
					   (int)by_state[WSLOT_LOADING], "ready", (int)by_state[WSLOT_READY], "held",
					   (int)by_state[3])) == 0 && ok;
	if (ok)
		text = json_dumps(o, JSON_COMPACT);
	json_decref(o);
	return text;
}

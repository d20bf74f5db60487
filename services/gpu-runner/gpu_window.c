/* gpu_window.c - the GPU tier of weights at work: copies issued ahead of compute in visit order,
 * the engine's acquires and releases, the state table and its checks. Made and taken down in
 * gpu_window_create.c. See gpu_window.h. C over the CUDA runtime API. */
#include "services/gpu-runner/gpu_window_internal.h"
#include "services/gpu-runner/window_plan.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"

/* Copies group g's tensors (a split FFN: its device share) from its host slot to dev, each at its
 * device offset. */
static int copy_group(struct gpu_window *w, uint32_t g, void *dev, const void *host, cudaStream_t s)
{
	return gw_copy_pieces(w, g, false, dev, w->dev_off, host, s);
}

/* group_weights of group g at device address dev (lm_head of a tied head: the embedding copy; a
 * split FFN: its shares). */
static int fill_device(struct gpu_window *w, uint32_t g, void *dev, struct group_weights *gw)
{
	weights_fill_at(&w->base, g, PLACE_DEVICE, dev, w->dev_off, w->g[w->embed_group].dev, gw);
	gw->resident = w->g[g].resident;
	return gw_split_fill(w, g, gw);
}

#define CUDA_TRY(call, what)                                                                       \
	do {                                                                                       \
		cudaError_t e_ = (call);                                                           \
		if (e_ != cudaSuccess)                                                             \
			return errorf(w->base.error, sizeof(w->base.error), -EIO, "%s: %s (%s)", what, \
				      cudaGetErrorString(e_), #call);                              \
	} while (0)

const char *gw_state_name(uint8_t s)
{
	static const char *const n[] = {"ABSENT", "INFLIGHT", "RESIDENT", "RETIRING"};
	return s < 4 ? n[s] : "?";
}

/* The one place states change: only the edges of the state machine are legal. */
static int set_state(struct gpu_window *w, uint32_t g, uint8_t to)
{
	uint8_t from = w->g[g].state;
	bool ok = (from == GWIN_ABSENT && to == GWIN_INFLIGHT) || (from == GWIN_INFLIGHT && to == GWIN_RESIDENT) ||
		  (from == GWIN_INFLIGHT && to == GWIN_RETIRING) || (from == GWIN_RESIDENT && to == GWIN_RETIRING) ||
		  (from == GWIN_RETIRING && to == GWIN_ABSENT);
	if (!ok)
		return errorf(w->base.error, sizeof(w->base.error), -EFAULT,
			      "weight window: group %u may not go from %s to %s", g, gw_state_name(from), gw_state_name(to));
	w->g[g].state = to;
	/* The in-flight list, so that polling the copies costs the copies in flight, not the groups
	 * (a model of many experts has thousands, polled at every acquire and copy). */
	if (to == GWIN_INFLIGHT) {
		w->inflight[w->n_inflight++] = g;
	} else if (from == GWIN_INFLIGHT) {
		for (uint32_t i = 0; i < w->n_inflight; i++)
			if (w->inflight[i] == g) {
				w->inflight[i] = w->inflight[--w->n_inflight];
				break;
			}
	}
	return 0;
}

/* Rings of loaders that went away are unmapped (unpinned first, by the hook) as soon as no copy
 * of ours reads one: every copy issued from an older mapping than the current one has been seen
 * complete (its host grant handed back). Copies issued since read the current mapping. */
void gw_trim_retired(struct gpu_window *w)
{
	if (!ring_source_n_retired(w->ring) || gw_split_reads_ring(w) || w->host_reads)
		return;
	uint32_t gen = ring_source_generation(w->ring);
	for (uint32_t g = 0; g < w->base.n_groups; g++)
		if (w->g[g].host_held && w->g[g].host_gen != gen)
			return;
	/* Copies whose grants went back early (let_go_copy) may still read an old mapping. */
	for (uint32_t i = 0; w->early_grants && i < w->n_copies; i++)
		if (cudaStreamSynchronize(w->copies[i]) != cudaSuccess)
			return;
	w->early_grants = false;
	ring_source_trim_retired(w->ring);
}

/* Host copies whose completion is now visible hand their ring grant back. Never blocks. */
static int poll_copies(struct gpu_window *w);
int gw_poll_copies(struct gpu_window *w)
{
	const uint64_t t0 = now_ns();
	int rc = poll_copies(w);
	w->poll_ns += now_ns() - t0;
	return rc;
}

static int poll_copies(struct gpu_window *w)
{
	/* From the last: set_state moves the list's last entry (seen already) into a finished one's place. */
	for (uint32_t i = w->n_inflight; i-- > 0;) {
		const uint32_t g = w->inflight[i];
		struct gent *e = &w->g[g];
		cudaError_t q = cudaEventQuery(e->h2d);
		if (q == cudaErrorNotReady)
			continue;
		if (q != cudaSuccess)
			return errorf(w->base.error, sizeof(w->base.error), -EIO, "copy of group %u failed: %s", g,
				      cudaGetErrorString(q));
		int rc = set_state(w, g, GWIN_RESIDENT);
		if (rc)
			return rc;
		if (e->host_held) {
			e->host_held = false;
			rc = w->rs->ops->release(w->rs, g);
			if (rc)
				return errorf(w->base.error, sizeof(w->base.error), rc, "%s", w->rs->error);
		}
	}
	gw_trim_retired(w);
	return 0;
}

/* Timing pair i of t, once its span is done (wait: its turn has come again, so wait for it rather
 * than drop it): its time in ms, *decode what it was issued in, and the pair free again; -1 while
 * the span is in flight, where the pair holds none, or where it cannot be read (an error: the copy's
 * or the stream's own event reports it; the pair is let go). */
static float times_take(struct gw_times *t, uint32_t i, bool wait, bool *decode)
{
	if (!t->timed[i])
		return -1.0f;
	const cudaError_t e = wait ? cudaEventSynchronize(t->ev[i][1]) : cudaEventQuery(t->ev[i][1]);
	if (e == cudaErrorNotReady)
		return -1.0f;
	t->timed[i] = false;
	*decode = t->decode[i];
	float ms;
	return e == cudaSuccess && cudaEventElapsedTime(&ms, t->ev[i][0], t->ev[i][1]) == cudaSuccess ? ms : -1.0f;
}

/* Adds copy pair i's time to copy_ms once its copy is done (times_take). */
static void collect_copy(struct gpu_window *w, uint32_t i, bool wait)
{
	bool decode;
	const float ms = times_take(&w->copy_times, i, wait, &decode);
	if (ms < 0)
		return;
	w->st.copy_ms += ms;
	w->st.timed_copies++;
	if (decode) {
		w->st.copy_ms_decode += ms;
		w->st.timed_copies_decode++;
	}
}

/* Adds wait pair i's time to copy_wait_ms once the compute stream has passed it (times_take). */
static void collect_wait(struct gpu_window *w, uint32_t i, bool wait)
{
	bool decode;
	const float ms = times_take(&w->wait_times, i, wait, &decode);
	if (ms < 0)
		return;
	w->st.copy_wait_ms += ms;
	w->st.timed_waits++;
}

/* The compute stream waits for group h's copy: timed with time_copies (an event each side). */
static cudaError_t compute_waits(struct gpu_window *w, const struct gent *e)
{
	if (!w->time_copies) /* its events made at create */
		return cudaStreamWaitEvent(w->compute, e->h2d, 0);
	struct gw_times *t = &w->wait_times;
	const uint32_t i = t->next++ % GW_TIMES;
	collect_wait(w, i, true);
	cudaError_t ce = cudaEventRecord(t->ev[i][0], w->compute);
	if (ce == cudaSuccess)
		ce = cudaStreamWaitEvent(w->compute, e->h2d, 0);
	if (ce == cudaSuccess)
		ce = cudaEventRecord(t->ev[i][1], w->compute);
	t->timed[i] = ce == cudaSuccess;
	w->st.waits += ce == cudaSuccess;
	return ce;
}

/* Group g leaves its slot while its copy may still run: the copy into the slot next waits on the
 * GPU for g's compute, which waited for g's copy, so only g's ring grant waits for the copy. Where
 * the loader pins g's host bytes the grant goes back at once (the bytes stay; before, the host
 * waited here for the copy: a release that issued the next copy blocked for the last one, 7 ms of
 * M1's 18 a token on the H200); else the copy is waited for (the loader may reuse the DRAM slot). */
static int let_go_copy(struct gpu_window *w, uint32_t g)
{
	struct gent *e = &w->g[g];
	if (e->state != GWIN_INFLIGHT || !e->host_held)
		return 0;
	if (ring_source_group_pinned(w->ring, g)) {
		cudaError_t q = cudaEventQuery(e->h2d);
		if (q != cudaSuccess && q != cudaErrorNotReady)
			return errorf(w->base.error, sizeof(w->base.error), -EIO, "copy of group %u failed: %s", g,
				      cudaGetErrorString(q));
		w->early_grants |= q == cudaErrorNotReady;
		e->host_held = false;
		int rc = w->rs->ops->release(w->rs, g);
		return rc ? errorf(w->base.error, sizeof(w->base.error), rc, "%s", w->rs->error) : 0;
	}
	CUDA_TRY(cudaEventSynchronize(e->h2d), "waiting for an old copy");
	return gw_poll_copies(w);
}

/* Group g out of its slot (whose occupant it is; no longer in use): its copy let go, its state
 * ABSENT, the slot free for the copy its turn brings. */
static int vacate(struct gpu_window *w, uint32_t g)
{
	struct gent *e = &w->g[g];
	struct gslot *os = &w->slots[e->slot];
	int rc = let_go_copy(w, g);
	if (rc || (rc = set_state(w, g, GWIN_RETIRING)) || (rc = set_state(w, g, GWIN_ABSENT)))
		return rc;
	e->slot = NO_SLOT;
	e->dev = NULL;
	os->group = NO_GROUP;
	return 0;
}

enum { ISSUED = 0, PASSED = 1, LATER = 2 };

/* Issues the next group of class c, order[c][issued % m]: its copy into slot copied % depth
 * (ISSUED), or, for an expert group its layer's routing did not choose, nothing (PASSED); LATER
 * when it is an expert group of a layer not routed yet. */
static int issue_next(struct gpu_window *w, uint32_t c)
{
	uint64_t k = w->issued[c];
	uint32_t h = w->order[c][k % w->m[c]];
	struct gslot *s = &w->slots[w->first_slot[c] + (uint32_t)(w->copied[c] % w->depth[c])];
	struct gent *e = &w->g[h];
	bool guess_copy = false;
	if (w->routing && w->base.groups[h].kind == GROUP_EXPERT) {
		/* Only this step's groups of the routed layer: when every streamed expert lies in one
		 * layer, the next step's come round again while the routing is still this step's. A
		 * later layer's, this step, on the guess its last routing left (guess_next) where
		 * that may be guessed. */
		const uint32_t gl = w->base.groups[h].layer;
		const bool this_step = k < w->route_pos + w->m[c];
		bool out = e->unused;
		if (gl != w->routed_layer || !this_step) {
			if (!this_step || gl < w->routed_layer || !gw_may_guess(w, gl))
				return LATER;
			out = !w->guess_set[(size_t)gl * w->base.cfg->n_experts + w->base.groups[h].expert];
			if (out && !ring_source_group_pinned(w->ring, h))
				return LATER; /* the CPU could not take it if the route chose it */
			e->guessed = true;
			e->guessed_in = guess_copy = !out;
		}
		/* Not wanted and still in its slot from an earlier visit (every streamed expert in one
		 * layer, a step's copies fewer than the slots): let go, not copied again for nothing (as
		 * a chosen one in that case is copied again into the slot due, below). */
		if (out && e->state != GWIN_ABSENT && !e->in_use && e->slot != NO_SLOT && w->slots[e->slot].group == h) {
			int vrc = vacate(w, h);
			if (vrc)
				return vrc;
		}
		/* Passed over whether the loader holds it or not: it reads an expert only when asked. */
		if (out && e->state == GWIN_ABSENT) {
			e->passed = true;
			w->issued[c]++;
			w->passed_pending[c]++;
			w->st.experts_passed++;
			return PASSED;
		}
	}
	/* Only the route of its own layer in this step splits an expert's copy (gw_route): any other
	 * copy takes it whole (a guess, a window's or a reset's first copies). Here, where a copy is
	 * issued, not above: a position this step's routing does not cover may name a group of the
	 * routed layer whose visit in this step is still to come (every streamed expert in one layer:
	 * the next step's first), and a LATER there must leave that visit's split as it is. */
	if (w->split_r && w->base.groups[h].kind == GROUP_EXPERT &&
	    !(w->routing && w->base.groups[h].layer == w->routed_layer && k < w->route_pos + w->m[c]))
		w->split_r[h] = gw_whole_r(w, h);
	/* Hand back the host slots of copies already done first: the release then rides on the
	 * acquire below, and the loader can read ahead while we wait for this group. */
	int rc = gw_poll_copies(w);
	if (rc)
		return rc;
	if (e->state != GWIN_ABSENT && !e->in_use && e->slot != NO_SLOT &&
	    w->slots[e->slot].group == h && w->routing) {
		/* With experts passed over, fewer than depth copies may have come since this group's
		 * last visit, so it is still in its slot (never otherwise: a class streams at least depth
		 * groups). Its last use is over: let it go, and copy it again into the slot due. */
		if ((rc = vacate(w, h)))
			return rc;
	}
	if (e->state != GWIN_ABSENT)
		return errorf(w->base.error, sizeof(w->base.error), -EFAULT,
			      "weight window: group %u is due for a copy but is %s", h, gw_state_name(e->state));
	if (s->group != NO_GROUP) {
		struct gent *o = &w->g[s->group];
		if (o->in_use)
			return errorf(w->base.error, sizeof(w->base.error), -EFAULT,
				      "weight window: slot of group %u reused while in use", s->group);
		if ((rc = vacate(w, s->group)))
			return rc;
	}
	/* The loader streams this class through a few slots: never ask for another group while we
	 * hold grants on all of them (it could not load it). Only where DRAM streams, i.e. where the
	 * disk binds anyway, can this wait for a copy. */
	if (!ring_source_group_pinned(w->ring, h)) {
		uint32_t limit = ring_source_streaming_slots(w->ring, c);
		for (;;) {
			uint32_t held = 0, oldest = NO_GROUP;
			for (uint32_t i = 0; i < w->m[c]; i++) {
				uint32_t q = w->order[c][(w->issued[c] + i) % w->m[c]];
				if (w->g[q].host_held && !ring_source_group_pinned(w->ring, q)) {
					held++;
					if (oldest == NO_GROUP)
						oldest = q;
				}
			}
			if (held < limit || oldest == NO_GROUP)
				break;
			CUDA_TRY(cudaEventSynchronize(w->g[oldest].h2d), "waiting for a copy to free a DRAM slot");
			if ((rc = gw_poll_copies(w)))
				return rc;
		}
	}
	struct group_weights hw;
	rc = w->rs->ops->acquire(w->rs, h, &hw); /* the host bytes; may wait for the loader's read */
	if (rc)
		return errorf(w->base.error, sizeof(w->base.error), rc, "%s", w->rs->error);
	const void *src = ring_source_group_base(w->ring, h);
	uint64_t bytes = gw_copy_bytes(w, h);
	/* Copies go round-robin over the copy streams (--copy-streams); every ordering is by
	 * events, so it does not matter which stream carries which copy. */
	cudaStream_t cs = w->copies[w->st.copies % w->n_copies];
	const uint64_t t0 = now_ns();
	/* The slot's last occupant must be done before its bytes are overwritten. */
	if (s->compute_recorded)
		CUDA_TRY(cudaStreamWaitEvent(cs, s->compute_done, 0), "ordering a copy after compute");
	struct gw_times *t = &w->copy_times;
	const uint32_t ti = t->next % GW_TIMES;
	if (w->time_copies) {
		collect_copy(w, ti, true);
		CUDA_TRY(cudaEventRecord(t->ev[ti][0], cs), "timing a copy");
	}
	if ((rc = copy_group(w, h, s->dev, src, cs)))
		return rc;
	if (w->time_copies) {
		CUDA_TRY(cudaEventRecord(t->ev[ti][1], cs), "timing a copy");
		t->timed[ti] = true;
		t->decode[ti] = w->base.step_tokens == 1;
		t->next++;
	}
	CUDA_TRY(cudaEventRecord(e->h2d, cs), "recording a copy");
	w->copy_ns += now_ns() - t0;
	if ((rc = set_state(w, h, GWIN_INFLIGHT)))
		return rc;
	e->slot = (uint32_t)(s - w->slots);
	e->dev = s->dev;
	e->host_held = true;
	e->host_gen = ring_source_generation(w->ring); /* src lies in the mapping of the acquire */
	s->group = h;
	w->issued[c]++;
	w->copied[c]++;
	w->st.bytes_h2d += bytes;
	w->st.experts_guessed += guess_copy;
	if (w->base.step_tokens == 1)
		w->st.bytes_h2d_decode += bytes;
	w->st.copies++;
	return 0;
}

/* Keeps depth copies ahead of compute in every streamed class (groups passed over do not count). */
int gw_top_up(struct gpu_window *w)
{
	w->copies_due = false;
	for (uint32_t c = 0; c < CLASS_COUNT; c++)
		while (w->m[c] && w->issued[c] < w->consumed[c] + w->depth[c] + w->passed_pending[c]) {
			int rc = issue_next(w, c);
			if (rc < 0)
				return rc;
			if (rc == LATER)
				break;
		}
	return 0;
}

int gpu_window_check(const struct gpu_window *w, char *err, size_t errlen)
{
	for (uint32_t s = 0; s < w->n_slots; s++) {
		uint32_t g = w->slots[s].group;
		if (g == NO_GROUP)
			continue;
		if (g >= w->base.n_groups || w->g[g].slot != s || w->g[g].resident)
			return errorf(err, errlen, -EFAULT, "slot %u names group %u, which does not name it back", s, g);
	}
	uint32_t inflight = 0;
	for (uint32_t i = 0; i < w->n_inflight; i++)
		if (w->inflight[i] >= w->base.n_groups || w->g[w->inflight[i]].state != GWIN_INFLIGHT)
			return errorf(err, errlen, -EFAULT, "the in-flight list names group %u, which is not in flight",
				      w->inflight[i]);
	for (uint32_t g = 0; g < w->base.n_groups; g++) {
		const struct gent *e = &w->g[g];
		inflight += e->state == GWIN_INFLIGHT;
		if (e->resident && e->state != GWIN_RESIDENT && g != w->embed_group)
			return errorf(err, errlen, -EFAULT, "resident group %u is %s", g, gw_state_name(e->state));
		if (e->state == GWIN_RETIRING)
			return errorf(err, errlen, -EFAULT, "group %u left RETIRING half done", g);
		if (!e->resident && e->slot != NO_SLOT && w->slots[e->slot].group != g)
			return errorf(err, errlen, -EFAULT, "group %u names slot %u, which holds %u", g, e->slot,
				      w->slots[e->slot].group);
		if (!e->resident && (e->state == GWIN_ABSENT) != (e->slot == NO_SLOT))
			return errorf(err, errlen, -EFAULT, "group %u is %s with%s a slot", g, gw_state_name(e->state),
				      e->slot == NO_SLOT ? "out" : "");
		if (e->in_use && !e->resident && e->state == GWIN_ABSENT)
			return errorf(err, errlen, -EFAULT, "group %u is in use but ABSENT", g);
		if (e->host_held && e->state != GWIN_INFLIGHT)
			return errorf(err, errlen, -EFAULT, "group %u holds a ring grant while %s", g, gw_state_name(e->state));
		if (e->passed && (e->state != GWIN_ABSENT || e->in_use))
			return errorf(err, errlen, -EFAULT, "group %u was passed over but is %s%s", g, gw_state_name(e->state),
				      e->in_use ? " and in use" : "");
	}
	if (inflight != w->n_inflight)
		return errorf(err, errlen, -EFAULT, "%u groups in flight, %u on the in-flight list", inflight,
			      w->n_inflight);
	for (uint32_t c = 0; c < CLASS_COUNT; c++)
		if (w->m[c] && (w->issued[c] < w->consumed[c] ||
				w->issued[c] > w->consumed[c] + w->depth[c] + w->passed_pending[c]))
			return errorf(err, errlen, -EFAULT, "class %u: %llu copies issued, %llu consumed, depth %u", c,
				      (unsigned long long)w->issued[c], (unsigned long long)w->consumed[c], w->depth[c]);
	return 0;
}

int gw_strict_check(struct gpu_window *w)
{
	if (!w->strict)
		return 0;
	char why[256];
	int rc = gpu_window_check(w, why, sizeof(why));
	if (rc) {
		log_error("--strict: %s", why);
		return errorf(w->base.error, sizeof(w->base.error), rc, "--strict: %s", why);
	}
	return 0;
}

static int win_flush(struct weight_source *ws);

static int win_acquire(struct weight_source *ws, uint32_t group, struct group_weights *gw)
{
	struct gpu_window *w = (struct gpu_window *)ws;
	if (group >= ws->n_groups)
		return errorf(ws->error, sizeof(ws->error), -EINVAL, "no group %u", group);
	struct gent *e = &w->g[group];
	int rc;
	if (group == w->embed_group) {
		/* The embedding stays in host memory: the backend gathers rows there. */
		rc = w->rs->ops->acquire(w->rs, group, gw);
		if (rc)
			return errorf(ws->error, sizeof(ws->error), rc, "%s", w->rs->error);
		e->in_use = true;
		ws->acquires++;
		return 0;
	}
	if ((rc = gw_poll_copies(w)) || (w->copies_due && (rc = gw_top_up(w))))
		return rc;
	if (!e->resident) {
		uint32_t c = ws->groups[group].size_class;
		if (w->m[c] == 0 || w->order[c][w->consumed[c] % w->m[c]] != group)
			return errorf(ws->error, sizeof(ws->error), -EPROTO,
				      "weight window: group %u acquired out of visit order", group);
		if (e->passed)
			return errorf(ws->error, sizeof(ws->error), -EPROTO,
				      "weight window: expert group %u acquired after its routing left it out", group);
		if (e->state == GWIN_ABSENT) { /* not copied ahead: at the very start, or a routed expert */
			w->st.late_copies++;
			if ((rc = gw_top_up(w)))
				return rc;
		}
		if (e->state != GWIN_INFLIGHT && e->state != GWIN_RESIDENT)
			return errorf(ws->error, sizeof(ws->error), -EFAULT, "weight window: group %u is %s at use",
				      group, gw_state_name(e->state));
		/* Compute waits for the copy on the GPU, not here. */
		cudaError_t ce = compute_waits(w, e);
		if (ce != cudaSuccess)
			return errorf(ws->error, sizeof(ws->error), -EIO, "ordering compute after a copy: %s",
				      cudaGetErrorString(ce));
		ws->bytes_acquired += gw_copy_bytes(w, group);
	}
	e->in_use = true;
	ws->acquires++;
	int frc = fill_device(w, group, e->dev, gw);
	return frc ? frc : gw_strict_check(w);
}

static int win_release(struct weight_source *ws, uint32_t group)
{
	struct gpu_window *w = (struct gpu_window *)ws;
	if (group >= ws->n_groups || !w->g[group].in_use)
		return errorf(ws->error, sizeof(ws->error), -EINVAL, "group %u is not in use", group);
	struct gent *e = &w->g[group];
	e->in_use = false;
	if (group == w->embed_group) {
		int rc = w->rs->ops->release(w->rs, group);
		return rc ? errorf(ws->error, sizeof(ws->error), rc, "%s", w->rs->error) : 0;
	}
	/* The router group's release after its route: the copies the route left (copies_due). */
	int src = gw_split_release(w, group);
	if (src || (w->copies_due && (src = gw_top_up(w))))
		return src;
	if (e->resident)
		return gw_strict_check(w);
	struct gslot *s = &w->slots[e->slot];
	cudaError_t ce = cudaEventRecord(s->compute_done, w->compute);
	if (ce != cudaSuccess)
		return errorf(ws->error, sizeof(ws->error), -EIO, "recording compute done: %s", cudaGetErrorString(ce));
	s->compute_recorded = true;
	w->consumed[ws->groups[group].size_class]++;
	int rc = gw_top_up(w);
	return rc ? rc : gw_strict_check(w);
}

static int win_release_all(struct weight_source *ws)
{
	/* End of a request, not the token path: let the copies in flight finish so that every
	 * host slot they read can go back to the loader (a slot must never be refilled while a
	 * copy still reads it). The copied groups stay valid on the device for the next request. */
	struct gpu_window *w = (struct gpu_window *)ws;
	for (uint32_t i = 0; i < w->n_copies; i++) {
		cudaError_t ce = cudaStreamSynchronize(w->copies[i]);
		if (ce != cudaSuccess)
			return errorf(ws->error, sizeof(ws->error), -EIO, "finishing weight copies: %s",
				      cudaGetErrorString(ce));
	}
	w->host_reads = false;
	int rc = gw_poll_copies(w);
	if (!rc)
		rc = w->rs->ops->release_all(w->rs);
	return rc ? errorf(ws->error, sizeof(ws->error), rc, "%s", w->rs->error) : 0;
}

static int win_flush(struct weight_source *ws)
{
	/* Only where DRAM streams (the disk binds): the host slots of copies in flight go back once the
	 * copies are done, so this waits for them. Resident rings hold no streaming slot. */
	struct gpu_window *w = (struct gpu_window *)ws;
	if (ring_source_all_resident(w->ring))
		return 0;
	for (uint32_t g = 0; g < ws->n_groups; g++)
		if (w->g[g].host_held && !ring_source_group_pinned(w->ring, g))
			CUDA_TRY(cudaEventSynchronize(w->g[g].h2d), "waiting for a copy to hand its DRAM slot back");
	int rc = gw_poll_copies(w);
	if (!rc && w->rs->ops->flush && (rc = w->rs->ops->flush(w->rs)) != 0)
		return errorf(ws->error, sizeof(ws->error), rc, "%s", w->rs->error);
	return rc;
}

/* The engine's last step failed part way (weights.h, reset): every stream waited for, every copy
 * seen done (its ring grant handed back), then every streamed group out of its slot and every
 * visit, routing and guess forgotten, so that the next step visits each class from its first group,
 * whose copies start now, as a new window's do. Resident groups stay. */
static int win_reset(struct weight_source *ws)
{
	struct gpu_window *w = (struct gpu_window *)ws;
	cudaError_t ce = cudaStreamSynchronize(w->compute);
	for (uint32_t i = 0; ce == cudaSuccess && i < w->n_copies; i++)
		ce = cudaStreamSynchronize(w->copies[i]);
	if (ce == cudaSuccess && w->side_stream)
		ce = cudaStreamSynchronize(w->side_stream);
	for (uint32_t i = 0; ce == cudaSuccess && i < w->n_inflight; i++)
		ce = cudaEventSynchronize(w->g[w->inflight[i]].h2d); /* done with its stream: at once */
	if (ce != cudaSuccess)
		return errorf(ws->error, sizeof(ws->error), -EIO, "settling a failed step: %s", cudaGetErrorString(ce));
	int rc = gw_poll_copies(w);
	if (rc)
		return rc;
	w->guess_carry = 0;
	w->ends_cpu = false;
	w->ends_layer = UINT32_MAX;
	for (uint32_t g = 0; g < ws->n_groups; g++) {
		struct gent *e = &w->g[g];
		e->in_use = false;
		e->unused = e->passed = e->on_cpu = e->guessed = e->guessed_in = false;
		if (e->resident || g == w->embed_group)
			continue;
		if (e->state == GWIN_RESIDENT &&
		    ((rc = set_state(w, g, GWIN_RETIRING)) || (rc = set_state(w, g, GWIN_ABSENT))))
			return rc;
		if (e->state != GWIN_ABSENT || e->host_held)
			return errorf(ws->error, sizeof(ws->error), -EFAULT,
				      "weight window: group %u is %s%s after its copies were waited for", g,
				      gw_state_name(e->state), e->host_held ? " and holds its ring grant" : "");
		e->slot = NO_SLOT;
		e->dev = NULL;
	}
	for (uint32_t s = 0; s < w->n_slots; s++)
		w->slots[s].group = NO_GROUP;
	for (uint32_t c = 0; c < CLASS_COUNT; c++)
		w->issued[c] = w->consumed[c] = w->copied[c] = w->passed_pending[c] = 0;
	w->routing = false;
	w->copies_due = false;
	w->routed_layer = 0;
	w->route_pos = 0;
	w->host_reads = false;
	w->side_user = NO_GROUP;
	w->st.step_resets++;
	rc = gw_top_up(w);
	return rc ? rc : gw_strict_check(w);
}

const char *const gw_host_op_names[GW_HOST_OPS] = {"acquire", "release", "route", "skip", "acquire_host"};

/* The engine's calls per step, timed: the host's time in the window (a model of many experts makes
 * thousands of them a token; what they cost is in the stats, host_ms and host_ms_op). */
#define TIMED(op, call)                                                                        \
	{                                                                                      \
		struct gpu_window *w_ = (struct gpu_window *)ws;                               \
		const uint64_t t0_ = now_ns();                                                 \
		int rc_ = call;                                                                \
		w_->op_ns[op] += now_ns() - t0_;                                               \
		w_->op_calls[op]++;                                                            \
		return rc_;                                                                    \
	}
static int timed_acquire(struct weight_source *ws, uint32_t g, struct group_weights *gw)
TIMED(GW_OP_ACQUIRE, win_acquire(ws, g, gw))
static int timed_release(struct weight_source *ws, uint32_t g)
TIMED(GW_OP_RELEASE, win_release(ws, g))
static int timed_route(struct weight_source *ws, uint32_t layer, const bool *used, bool *on_cpu)
TIMED(GW_OP_ROUTE, gw_route(ws, layer, used, on_cpu))
static int timed_skip_(struct weight_source *ws, uint32_t g)
TIMED(GW_OP_SKIP, gw_skip(ws, g))
/* A resident expert's skip is nothing (most of a model's, 128 a layer): not worth two clock reads. */
static int timed_skip(struct weight_source *ws, uint32_t g)
{
	const struct gpu_window *w = (const struct gpu_window *)ws;
	if (g < ws->n_groups && ws->groups[g].kind == GROUP_EXPERT && w->g[g].resident && !w->copies_due)
		return 0; /* as gw_skip does then */
	return timed_skip_(ws, g);
}
static int timed_acquire_host(struct weight_source *ws, uint32_t g, struct group_weights *gw)
TIMED(GW_OP_ACQUIRE_HOST, gw_acquire_host(ws, g, gw))
#undef TIMED

static bool win_kept(struct weight_source *ws, uint32_t g)
{
	const struct gpu_window *w = (const struct gpu_window *)ws;
	return g < ws->n_groups && g != w->embed_group && w->g[g].resident;
}

const struct weight_source_ops gw_window_ops = {
	.acquire = timed_acquire,
	.release = timed_release,
	.release_all = win_release_all,
	.route = timed_route,
	.skip = timed_skip,
	.acquire_host = timed_acquire_host,
	.share_host = gw_share_host,
	.flush = win_flush,
	.reset = win_reset,
	.kept = win_kept,
};

struct weight_source *gpu_window_base(struct gpu_window *w)
{
	return &w->base;
}

void gpu_window_stats(struct gpu_window *w, struct gpu_window_stats *st)
{
	if (w->time_copies) {
		for (uint32_t i = 0; i < GW_TIMES; i++) {
			collect_copy(w, i, false);
			collect_wait(w, i, false);
		}
	}
	*st = w->st;
	st->ends_lag_ms = w->ends_lag_s * 1e3;
	st->host_ms = 0;
	for (int i = 0; i < GW_HOST_OPS; i++) {
		st->host_ms_op[i] = (double)w->op_ns[i] / 1e6;
		st->host_ms += st->host_ms_op[i];
		st->host_calls_op[i] = w->op_calls[i];
	}
	st->host_ms_copy = (double)w->copy_ns / 1e6;
	st->host_ms_poll = (double)w->poll_ns / 1e6;
}

enum gwin_state gpu_window_group_state(const struct gpu_window *w, uint32_t g, bool *resident)
{
	bool in = g < w->base.n_groups;
	if (resident)
		*resident = in && w->g[g].resident;
	return in ? (enum gwin_state)w->g[g].state : GWIN_ABSENT;
}

void gpu_window_reset_timing(struct gpu_window *w)
{
	memset(w->copy_times.timed, 0, sizeof(w->copy_times.timed));
	memset(w->wait_times.timed, 0, sizeof(w->wait_times.timed));
	w->st.copy_ms = w->st.copy_ms_decode = 0;
	w->st.timed_copies = w->st.timed_copies_decode = 0;
	w->st.copy_wait_ms = 0;
	w->st.timed_waits = w->st.waits = 0;
}

void gpu_window_describe(const struct gpu_window *w, char *buf, size_t len)
{
	char r[32], win[32], s[32];
	double ms = w->st.h2d_bytes_per_s > 0 ? (double)w->st.streamed_bytes_per_token / w->st.h2d_bytes_per_s * 1e3 : 0;
	snprintf(buf, len,
		 "GPU weights: %llu groups resident (%s), %llu streamed through %u slot%s per class (%s); %s cross "
		 "PCIe per decode token: %.1f ms/token at the measured %.1f GB/s",
		 (unsigned long long)w->st.resident_groups, format_size(w->st.resident_bytes, r, sizeof(r)),
		 (unsigned long long)w->st.streamed_groups, w->st.depth, w->st.depth == 1 ? "" : "s",
		 format_size(w->st.window_bytes, win, sizeof(win)),
		 format_size(w->st.streamed_bytes_per_token, s, sizeof(s)), ms, w->st.h2d_bytes_per_s / 1e9);
	size_t k = strlen(buf);
	if (k < len && w->st.spread)
		snprintf(buf + k, len - k, "; the kept layer groups spread among the layers");
	k = strlen(buf);
	if (k < len && w->base.cfg->n_experts)
		snprintf(buf + k, len - k, "; %u experts resident, chosen by %.1f%% of the routing %s, %u slot%s for the "
			 "streamed ones", w->st.experts_resident, 100.0 * w->st.expert_heat_resident,
			 w->heat_known ? "counted" : "expected (none counted yet)", w->depth[CLASS_EXPERT],
			 w->depth[CLASS_EXPERT] == 1 ? "" : "s");
	k = strlen(buf);
	if (k < len)
		gw_split_describe(w, buf + k, len - k);
}

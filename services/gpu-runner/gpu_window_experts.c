/* gpu_window_experts.c - the GPU window's side of a mixture-of-experts layer: the route (which of
 * the layer's streamed experts this step copies, which it passes over, which it leaves in DRAM for
 * the CPU, and the chosen ones asked of the loader together), the visits of experts not copied
 * (skip), the CPU's experts in host memory (acquire_host), and what a plan from counted routing
 * would keep (gpu_window_expert_gain). See gpu_window.h; the window itself is gpu_window.c. */
#include "services/gpu-runner/gpu_window_internal.h"
#include "services/gpu-runner/window_plan.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

static void on_cpu_set(bool *on_cpu, uint32_t x, bool v)
{
	if (on_cpu)
		on_cpu[x] = v;
}

/* May a route split expert group g with the CPU (split_experts)? Its host bytes pinned in DRAM (the
 * CPU reads them in place) and, in auto, its copy taking at least GW_SPLIT_EXPERT_MIN_S of the link
 * (as measured); always; or never. */
static bool may_split(const struct gpu_window *w, uint32_t g)
{
	if (w->split_experts == GW_SPLIT_OFF || w->moe_policy.mode == CPU_SHARE_OFF ||
	    !ring_source_group_pinned(w->ring, g))
		return false;
	if (w->split_experts == GW_SPLIT_ALWAYS)
		return true;
	return w->st.h2d_bytes_per_s > 0 && (double)w->copy_bytes[g] / w->st.h2d_bytes_per_s >= GW_SPLIT_EXPERT_MIN_S;
}

bool gw_may_guess(const struct gpu_window *w, uint32_t layer)
{
	/* Not the experts a route splits: split after the route, both sides end together, where a
	 * guess copies a whole expert that random routings mostly do not choose (MX1: 69 of 251) and
	 * leaves a chosen one it passed over whole to the CPU. */
	return w->predict && w->last_known && layer < w->base.cfg->n_layers && w->last_known[layer] &&
	       w->moe_policy.mode != CPU_SHARE_OFF && w->base.step_tokens <= FFN_SPLIT_MAX_TOKENS &&
	       !(w->expert0 && w->expert0[layer] != NO_GROUP && may_split(w, w->expert0[layer]));
}

/* The GPU's rows r of expert group g (0 < r < its intermediate rows, a multiple of down's
 * ffn_split_unit) that end the link's side (gpu_s, the copy of the whole th seconds) and the CPU's
 * (cpu_s, the whole tc) together; 0 where the balance gives it whole to either side. */
static uint32_t split_rows(const struct gpu_window *w, uint32_t g, double gpu_s, double cpu_s, double th, double tc)
{
	const struct weight_source *ws = &w->base;
	const uint32_t F = ws->cfg->expert_ffn_dim;
	int ti = model_find_tensor(ws->cfg, ws->tensors, ws->groups, g, ROLE_EXPERT_DOWN);
	if (ti < 0 || !(th + tc > 0))
		return 0;
	const uint32_t unit = ffn_split_unit((enum dtype)ws->tensors[ti].dtype);
	if (!unit || F % unit || F < 2 * unit)
		return 0;
	const double f = (cpu_s + tc - gpu_s) / (th + tc); /* gpu_s + f th = cpu_s + (1 - f) tc */
	if (!(f > 0) || !(f < 1))
		return 0;
	const uint32_t units = F / unit, r = (uint32_t)lround(f * units) * unit;
	return r > 0 && r < F ? r : 0;
}

/* What the next decode step copies of `layer`'s streamed experts before its route, from this
 * routing (`used`, its sides settled in on_cpu): not every chosen expert, which would leave the CPU
 * only the guesses' misses, but the GPU's share of their bytes by the rates the sides go at (h2d,
 * cpu; cpu 0: all of them) and the lead the copies have over the CPU's experts, which wait for the
 * layer's route (expert_copy_share), the experts the GPU took this step first. The rest of the
 * choice is passed over, and chosen again it goes to the CPU, as a miss does. An expert whose host
 * bytes stream is guessed in whenever chosen: only a copy can take it. Whole experts: with carry,
 * what a layer takes more or less than its share is carried to the next layer guessed
 * (guess_carry), so that a share of 3.4 experts in 8 is 3 in some layers and 4 in others, not 3 in
 * all (the experts only a copy can take are not in it: they go whatever the share); without, each
 * layer's share is rounded on its own. */
static void guess_next(struct gpu_window *w, uint32_t layer, const bool *used, double h2d, double cpu, double lead,
		       bool carry)
{
	const struct weight_source *ws = &w->base;
	const uint32_t E = ws->cfg->n_experts, g0 = w->expert0[layer];
	bool *next = w->guess_set + (size_t)layer * E;
	memset(next, 0, E * sizeof(bool));
	double chosen = 0, got = 0, most = 0, got0 = 0, target1 = 0;
	for (uint32_t g = g0; g < ws->n_groups && ws->groups[g].kind == GROUP_EXPERT && ws->groups[g].layer == layer;
	     g++)
		if (used[ws->groups[g].expert] && !w->g[g].resident) {
			chosen += (double)w->copy_bytes[g];
			most = (double)w->copy_bytes[g] > most ? (double)w->copy_bytes[g] : most;
		}
	const double target = expert_copy_share(chosen, h2d, cpu, lead) * chosen + (carry ? w->guess_carry : 0);
	for (int pass = 0; pass < 3; pass++) {
		if (pass == 1) { /* what is left of the target for the experts either side can take */
			got0 = got;
			target1 = target > got0 ? target - got0 : 0;
		}
		for (uint32_t g = g0; g < ws->n_groups && ws->groups[g].kind == GROUP_EXPERT &&
				      ws->groups[g].layer == layer; g++) {
			const uint32_t x = ws->groups[g].expert;
			const struct gent *e = &w->g[g];
			if (!used[x] || e->resident || next[x])
				continue;
			const double b = (double)w->copy_bytes[g];
			const bool pinned = ring_source_group_pinned(w->ring, g);
			/* pass 0: the ones only a copy can take; 1: the GPU's this step; 2: the CPU's */
			if ((pass == 0 && pinned) || (pass == 1 && e->on_cpu) || (pass > 0 && got + b / 2 > target))
				continue;
			next[x] = true;
			got += b;
		}
	}
	/* At most one expert's bytes carried either way; a layer with nothing to copy leaves the carry
	 * to the next. */
	const double miss = target1 - (got - got0);
	if (!carry)
		w->guess_carry = 0;
	else if (chosen > 0)
		w->guess_carry = miss > most ? most : miss < -most ? -most : miss;
}

/* How the layer routed before `layer` ended, where the engine measured it (route_ends_ns) and that
 * route gave the CPU work (the GPU's side may have had none: it ended at once, and the CPU last):
 * counted, and the lag moved by GW_ENDS_GAIN of the GPU's side's lateness (balance_ends). The
 * route gives the link's side the lag as a start (ended late: less for the link), so the next
 * measure is the last less that step: a fraction of it a layer, so that one layer's scatter (the
 * host's wake for a routing, a copy's start) moves the lag little. */
static void ends_learn(struct gpu_window *w, uint32_t layer)
{
	const struct weight_source *ws = &w->base;
	const bool known = ws->route_ends_known && ws->step_tokens == 1 && w->ends_cpu &&
			   w->ends_layer != UINT32_MAX && w->ends_layer + 1 == layer;
	w->ends_cpu = false;
	if (!known)
		return;
	const double late = (double)ws->route_ends_ns * 1e-9;
	w->st.ends_measured++;
	if (late > 0)
		w->st.ends_gpu_late_ms += late * 1e3;
	else
		w->st.ends_cpu_late_ms -= late * 1e3;
	if (!w->balance_ends)
		return;
	const double lag = w->ends_lag_s + GW_ENDS_GAIN * late;
	w->ends_lag_s = lag > GW_ENDS_MAX_S ? GW_ENDS_MAX_S : lag < -GW_ENDS_MAX_S ? -GW_ENDS_MAX_S : lag;
}

int gw_route(struct weight_source *ws, uint32_t layer, const bool *used, bool *on_cpu)
{
	struct gpu_window *w = (struct gpu_window *)ws;
	const struct model_config *cfg = ws->cfg;
	if (layer >= cfg->n_layers || !cfg->n_experts)
		return errorf(ws->error, sizeof(ws->error), -EINVAL, "route: layer %u of a model of %u layers and %u "
			      "experts", layer, cfg->n_layers, cfg->n_experts);
	if (!w->expert0) {
		w->expert0 = malloc(cfg->n_layers * sizeof(uint32_t));
		if (!w->expert0)
			return errorf(ws->error, sizeof(ws->error), -ENOMEM, "route: out of memory");
		w->fetch = calloc(cfg->n_experts, sizeof(bool)); /* NULL: no asking ahead */
		for (uint32_t l = 0; l < cfg->n_layers; l++)
			w->expert0[l] = NO_GROUP;
		for (uint32_t g = ws->n_groups; g-- > 0;)
			if (ws->groups[g].kind == GROUP_EXPERT)
				w->expert0[ws->groups[g].layer] = g;
		if (w->predict) { /* NULL: no guesses */
			w->guess_set = calloc((size_t)cfg->n_layers * cfg->n_experts, sizeof(bool));
			w->last_known = calloc(cfg->n_layers, sizeof(bool));
			if (!w->guess_set || !w->last_known) {
				free(w->guess_set);
				free(w->last_known);
				w->guess_set = NULL;
				w->last_known = NULL;
			}
		}
	}
	w->host_reads = false; /* the layer before has ended (moe_end) */
	uint32_t g0 = w->expert0[layer];
	/* A split holds for the step whose route made it: the route starts from whole experts (and any
	 * copy not issued after its own layer's route takes one whole: issue_next). */
	for (uint32_t g = g0; w->split_r && g != NO_GROUP && g < ws->n_groups && ws->groups[g].kind == GROUP_EXPERT &&
			      ws->groups[g].layer == layer; g++)
		w->split_r[g] = gw_whole_r(w, g);
	/* The CPU's side: chosen experts not resident whose host bytes stay in DRAM, in a decode step. */
	const struct cpu_share_policy *pol = &w->moe_policy;
	const bool cpu = pol->mode != CPU_SHARE_OFF && on_cpu && ws->step_tokens <= FFN_SPLIT_MAX_TOKENS;
	ends_learn(w, layer);
	/* Auto in a one-token step: the side the measures found ending last starts by the lag (the
	 * link's copies wait for the route's issue and the GPU then computes its rows; the CPU's wait
	 * for the pool's wake and its rows' stride: none of that is in the rates). */
	const bool lagged = w->balance_ends && cpu && ws->step_tokens == 1 && pol->mode == CPU_SHARE_AUTO;
	double gpu_s = lagged && w->ends_lag_s > 0 ? w->ends_lag_s : 0, cpu_s = lagged && w->ends_lag_s < 0 ? -w->ends_lag_s : 0;
	const double gpu_s0 = gpu_s, cpu_s0 = cpu_s;
	bool split_any = false;
	/* The CPU's rate for the experts' format as the balance below takes it: the rate the CPU's
	 * experts ran at where the runner has told it (gpu_window_set_expert_rate), else the start's
	 * calibration (a fixed share: the rate that gives it). */
	const double h2d_r = w->st.h2d_bytes_per_s > 0 ? w->st.h2d_bytes_per_s : 1;
	/* The link at its rate beside the CPU where auto has learnt the CPU's (as guess_next takes it):
	 * in MX1 and MX2 the copies, weighed at the link's rate alone, ended after the CPU's rows (12.8
	 * against 11.8 ms a token). */
	const double beside = w->st.h2d_beside_cpu_bytes_per_s;
	const bool learnt = pol->mode == CPU_SHARE_AUTO &&
			    (w->st.expert_rate_jobs > 0 || (ws->step_tokens > 1 && w->st.expert_rate_jobs_multi > 0));
	const double h2d_b = learnt && beside > 0 && beside < h2d_r ? beside : h2d_r;
	const double cpu_r = pol->mode == CPU_SHARE_FIXED
				     ? (pol->fraction >= 1 ? 1e30 : h2d_r * pol->fraction / (1 - pol->fraction))
				     : gpu_window_expert_rate(w, ws->step_tokens);
	for (uint32_t g = g0; g != NO_GROUP && g < ws->n_groups && ws->groups[g].kind == GROUP_EXPERT &&
			      ws->groups[g].layer == layer; g++) {
		uint32_t x = ws->groups[g].expert;
		struct gent *e = &w->g[g];
		e->on_cpu = false;
		if (e->guessed) {
			const bool in = e->guessed_in;
			e->guessed = e->guessed_in = false;
			if (e->passed && used[x]) {
				/* Guessed out on its last routing, chosen now: its visit has gone by without a copy,
				 * and the CPU computes it from DRAM (gw_may_guess held when it was passed over, and
				 * its bytes are pinned). Not where this step cannot give the CPU experts: a guess
				 * of a step that ended before this layer's route (a failed one), settled by a
				 * prefill chunk. */
				if (!cpu || !on_cpu)
					return errorf(ws->error, sizeof(ws->error), -EPROTO,
						      "weight window: expert group %u (layer %u) was passed over on a guess "
						      "(--predict-experts) in a step that ended before its route, and this "
						      "step of %u tokens cannot leave it to the CPU",
						      g, layer, ws->step_tokens);
				e->on_cpu = true;
				cpu_s += cpu_r > 0 ? (double)ws->groups[g].tensor_bytes / cpu_r : 0;
				w->st.experts_cpu++;
				w->st.experts_cpu_bytes += ws->groups[g].tensor_bytes;
				w->st.guess_missed++;
			} else if (used[x] && in) {
				w->st.guess_hits++;
				if (e->state == GWIN_INFLIGHT) /* its copy still takes the link */
					gpu_s += (double)w->copy_bytes[g] / h2d_b;
			}
		}
		if (!e->on_cpu && cpu && used[x] && !e->resident && e->state == GWIN_ABSENT &&
		    ring_source_group_pinned(w->ring, g)) {
			/* To the side that then finishes first: copies at the H2D rate, or the CPU at its
			 * product rate for the experts' format. */
			/* What a copy moves (its slot's gaps included: gw_layout) against what the CPU reads. */
			double b = (double)w->copy_bytes[g], bc = (double)ws->groups[g].tensor_bytes, h2d = h2d_b,
			       rate = cpu_r;
			/* Or split between them (split_experts), so that both end together: the copy takes
			 * the GPU's rows [0, r), the CPU the rest, the visit both (gw_split_fill). */
			const uint32_t F = cfg->expert_ffn_dim,
				       r = rate > 0 && w->split_r && may_split(w, g)
						   ? split_rows(w, g, gpu_s, cpu_s, b / h2d, bc / rate) : 0;
			if (r) {
				const double fc = (double)(F - r) / F;
				split_any = true;
				w->split_r[g] = r;
				gpu_s += (1 - fc) * b / h2d;
				cpu_s += fc * bc / rate;
				w->st.experts_split++;
				w->st.experts_split_cpu_bytes += (uint64_t)(fc * bc + 0.5);
				w->st.experts_cpu_bytes += (uint64_t)(fc * bc + 0.5);
			} else if (rate > 0 && cpu_s + bc / rate <= gpu_s + b / h2d) {
				e->on_cpu = true;
				cpu_s += bc / rate;
				w->st.experts_cpu++;
				w->st.experts_cpu_bytes += ws->groups[g].tensor_bytes;
			} else {
				gpu_s += b / h2d;
			}
		}
		on_cpu_set(on_cpu, x, e->on_cpu);
		e->unused = !used[x] || e->on_cpu;
	}
	/* The CPU given work in a one-token step: the next layer's route learns how the two sides
	 * ended. Given none where the lag held the CPU back (< 0) and the link took experts, nothing
	 * would measure it again: it comes back towards none instead. */
	w->ends_cpu = cpu && ws->step_tokens == 1 && cpu_s > cpu_s0;
	w->ends_layer = layer;
	if (lagged && !w->ends_cpu && w->ends_lag_s < 0 && gpu_s > gpu_s0)
		w->ends_lag_s *= 1 - GW_ENDS_GAIN;
	/* A decode step's routing is the guess for the layer's next (a prefill chunk chooses nearly
	 * every expert: it guesses nothing). */
	if (w->guess_set && ws->step_tokens <= FFN_SPLIT_MAX_TOKENS) {
		/* Auto once the runner has given the rates the CPU's experts ran at (gpu_window_set_expert_rate):
		 * the link as it runs beside the CPU where the calibration measured it so, the lead of the
		 * copies, the share carried from layer to layer. Else (the start's calibration, a fixed
		 * share): the rates as the route takes them, each layer rounded on its own. */
		guess_next(w, layer, used, h2d_b, cpu ? cpu_r : 0, learnt ? w->st.expert_lead_ms * 1e-3 : 0, learnt);
		w->last_known[layer] = true;
	} else if (w->last_known) {
		w->last_known[layer] = false;
		w->guess_carry = 0; /* a prefill chunk: the guesses start over */
	}
	/* The chosen experts the window copies from the loader's streaming slots are asked for together
	 * (the ring's route: one ACQUIRE, the loader reads them at once) before the first copy waits on
	 * one of them. Never the resident ones: the window takes nothing of theirs from the ring. */
	if (w->rs->ops->route && !ring_source_all_resident(w->ring) && w->fetch && g0 != NO_GROUP) {
		const uint32_t c = ws->groups[g0].size_class;
		for (uint32_t x = 0; x < cfg->n_experts; x++)
			w->fetch[x] = false;
		/* This step's visit of the layer's streamed experts starts at consumed[c] (every expert before
		 * it has been consumed); those below issued[c] were copied before this routing (a new window's
		 * first copies), and nothing more of theirs is taken from the ring this step. */
		for (uint64_t k = w->consumed[c]; w->m[c] && k < w->consumed[c] + w->m[c]; k++) {
			uint32_t g = w->order[c][k % w->m[c]];
			if (ws->groups[g].kind != GROUP_EXPERT || ws->groups[g].layer != layer)
				break;
			uint32_t x = ws->groups[g].expert;
			w->fetch[x] = used[x] && !w->g[g].on_cpu && k >= w->issued[c];
		}
		int prc = gw_poll_copies(w); /* finished copies' grants go back with the ACQUIRE: more room */
		if (prc)
			return prc;
		if ((prc = w->rs->ops->route(w->rs, layer, w->fetch, NULL)) != 0)
			return errorf(ws->error, sizeof(ws->error), prc, "%s", w->rs->error);
	}
	w->routing = true;
	w->routed_layer = layer;
	w->route_pos = w->consumed[CLASS_EXPERT];
	/* Where the route split experts with the CPU, the engine hands the CPU's shares to the pool
	 * first (share_host): the copies of the GPU's rows go at its next call (the router group's
	 * release), so that the CPU does not wait for their issue (some 13 us a copy of pieces). */
	if (split_any) {
		w->copies_due = true;
		return gw_strict_check(w);
	}
	int rc = gw_top_up(w);
	return rc ? rc : gw_strict_check(w);
}

/* An expert group the step does not use, in visit order: passed over, or (copied before its layer
 * was routed, or its host bytes stream) consumed once its copy is done. */
int gw_skip(struct weight_source *ws, uint32_t group)
{
	struct gpu_window *w = (struct gpu_window *)ws;
	if (group >= ws->n_groups || ws->groups[group].kind != GROUP_EXPERT)
		return errorf(ws->error, sizeof(ws->error), -EINVAL, "skip: group %u is not an expert group", group);
	struct gent *e = &w->g[group];
	int rc;
	if (w->copies_due && (rc = gw_top_up(w)))
		return rc;
	if (e->resident)
		return 0;
	uint32_t c = ws->groups[group].size_class;
	if (w->m[c] == 0 || w->order[c][w->consumed[c] % w->m[c]] != group)
		return errorf(ws->error, sizeof(ws->error), -EPROTO, "weight window: group %u skipped out of visit order",
			      group);
	/* Not issued yet: the top-up passes it over (or, its host bytes streaming, copies it). */
	if (!e->passed && e->state == GWIN_ABSENT && (rc = gw_top_up(w)) != 0)
		return rc;
	if (e->passed) {
		e->passed = false;
		w->passed_pending[c]--;
		w->consumed[c]++;
		rc = gw_top_up(w);
		return rc ? rc : gw_strict_check(w);
	}
	if (e->state != GWIN_INFLIGHT && e->state != GWIN_RESIDENT)
		return errorf(ws->error, sizeof(ws->error), -EFAULT, "weight window: skipped group %u is %s", group,
			      gw_state_name(e->state));
	/* Its slot is free once the copy into it is done: the compute stream records that. */
	struct gslot *s = &w->slots[e->slot];
	cudaError_t ce = cudaStreamWaitEvent(w->compute, e->h2d, 0);
	if (ce == cudaSuccess)
		ce = cudaEventRecord(s->compute_done, w->compute);
	if (ce != cudaSuccess)
		return errorf(ws->error, sizeof(ws->error), -EIO, "skipping group %u: %s", group, cudaGetErrorString(ce));
	s->compute_recorded = true;
	w->consumed[c]++;
	rc = gw_top_up(w);
	return rc ? rc : gw_strict_check(w);
}

/* An expert group route left for the CPU: consumed as a skipped one, its host bytes in place. */
int gw_acquire_host(struct weight_source *ws, uint32_t group, struct group_weights *gw)
{
	struct gpu_window *w = (struct gpu_window *)ws;
	if (group >= ws->n_groups || !w->g[group].on_cpu || !w->routing || ws->groups[group].layer != w->routed_layer)
		return errorf(ws->error, sizeof(ws->error), -EPROTO,
			      "weight window: group %u was not left for the CPU by the route of its layer", group);
	const void *base = ring_source_group_base(w->ring, group);
	if (!base)
		return errorf(ws->error, sizeof(ws->error), -EPROTO,
			      "weight window: group %u, left for the CPU, is not in DRAM", group);
	/* Its visit is the engine's skip, later (pinned in DRAM: no grant is held for it). */
	weights_fill(ws, group, base, NULL, gw);
	w->host_reads = true;
	ws->acquires++;
	return 0;
}

int gpu_window_expert_gain(const struct gpu_window *w, const float *heat, double *now, double *planned)
{
	const struct model_config *cfg = w->base.cfg;
	const uint32_t ng = w->base.n_groups, E = cfg->n_experts;
	*now = *planned = 0;
	if (!E)
		return 0;
	const struct group_desc *dg = w->plan_groups;
	bool *res = malloc(ng * sizeof(bool));
	if (!res)
		return -ENOMEM;
	double sum = 0, kept = 0;
	for (uint32_t g = 0; g < ng; g++) {
		if (dg[g].kind != GROUP_EXPERT || !weight_stage_has(&w->base.stage, &dg[g]))
			continue;
		float h = heat[(size_t)dg[g].layer * E + dg[g].expert];
		h = h > 0 ? h : 0;
		sum += h;
		kept += w->g[g].resident ? h : 0;
	}
	*now = sum > 0 ? kept / sum : 0;
	struct window_plan plan;
	char err[256];
	int rc = window_plan(cfg, dg, ng, &w->base.stage, w->budget, w->st.depth, w->xdepth, heat, res, &plan, err,
			     sizeof(err));
	if (rc == 0)
		*planned = plan.expert_heat_resident;
	free(res);
	return rc;
}

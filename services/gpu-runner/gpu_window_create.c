/* gpu_window_create.c - the GPU window made and taken down: its plan (what stays resident, the
 * streaming slots, the CPU's share of split FFNs), the resident weights copied, the ring pinned
 * (and re-pinned as loaders come and go), and everything freed. The window at work (copies,
 * acquires, the visit order) is gpu_window.c; see gpu_window.h. */
#include "services/gpu-runner/gpu_window_internal.h"
#include "services/gpu-runner/window_plan.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"

/* Ring mappings a window made anew left page-locked (gpu_window_destroy_keeping_pins) for the
 * next one to take over: pinning tens of GB again costs seconds (about 3 s for 15 GB). One
 * window at a time in a process: the runner's. */
static void *kept_base[PINNED_MAX];
static size_t kept_len[PINNED_MAX];
static uint32_t n_kept;

static void unregister(void *base)
{
	cudaError_t e = cudaHostUnregister(base);
	if (e != cudaSuccess) {
		cudaGetLastError();
		log_warn("cannot unpin a weight ring mapping: %s", cudaGetErrorString(e));
	}
}

/* Unpins what no window took over (the ring was mapped anew meanwhile, or the window failed). */
static void drop_kept(void)
{
	while (n_kept)
		unregister(kept_base[--n_kept]);
}

/* Page-locks a ring mapping: DMA from pinned memory runs at the link's rate (docs/architecture.md).
 * Failing that, copies from it run from pageable memory (slower, and synchronous). A mapping the
 * window before left pinned is taken over as it is. */
static void pin_mapping(struct gpu_window *w, void *base, size_t size)
{
	bool kept = false;
	for (uint32_t i = 0; i < n_kept && w->n_pinned < PINNED_MAX && !kept; i++) {
		if (kept_base[i] != base || kept_len[i] != size)
			continue;
		kept = true;
		n_kept--;
		kept_base[i] = kept_base[n_kept];
		kept_len[i] = kept_len[n_kept];
	}
	if (w->n_pinned < PINNED_MAX && (kept || cudaHostRegister(base, size, cudaHostRegisterDefault) == cudaSuccess)) {
		w->pinned_len[w->n_pinned] = size;
		w->pinned[w->n_pinned++] = base;
		w->st.pins_kept += kept;
		return;
	}
	cudaGetLastError();
	log_warn("cannot pin the weight ring (%zu bytes): copies will run from pageable memory, far slower", size);
}

bool gw_registered(const struct gpu_window *w, const void *p, size_t len)
{
	const char *q = p;
	for (uint32_t i = 0; q && i < w->n_pinned; i++) {
		const char *b = w->pinned[i];
		if (q >= b && len <= w->pinned_len[i] && (size_t)(q - b) <= w->pinned_len[i] - len)
			return true;
	}
	return false;
}

/* Undoes pin_mapping (nothing if base was not pinned). No copy from it may be in flight. */
static void unpin_mapping(struct gpu_window *w, void *base)
{
	for (uint32_t i = 0; i < w->n_pinned; i++) {
		if (w->pinned[i] != base)
			continue;
		unregister(base);
		w->pinned[i] = w->pinned[--w->n_pinned];
		w->pinned_len[i] = w->pinned_len[w->n_pinned];
		return;
	}
}

/* Mapping hooks of the ring (weights_ring.h): the ring of a loader that took over in the middle
 * of a step is pinned at once, and a gone loader's ring is unpinned before it is unmapped. */
static void on_ring_mapped(void *ctx, void *base, size_t size)
{
	pin_mapping(ctx, base, size);
}

static void on_ring_unmapping(void *ctx, void *base, size_t size)
{
	(void)size;
	unpin_mapping(ctx, base);
}

static void destroy(struct gpu_window **wp);

void gpu_window_destroy_keeping_pins(struct gpu_window **wp)
{
	if (!wp || !*wp)
		return;
	struct gpu_window *w = *wp;
	drop_kept(); /* a window's leftovers no other took over: not this one's */
	for (uint32_t i = 0; i < w->n_pinned; i++) {
		kept_base[n_kept] = w->pinned[i];
		kept_len[n_kept++] = w->pinned_len[i];
	}
	w->n_pinned = 0;
	destroy(wp);
}

void gpu_window_destroy(struct gpu_window **wp)
{
	if (!wp || !*wp)
		return;
	drop_kept(); /* no window takes them over now */
	destroy(wp);
}

static void destroy(struct gpu_window **wp)
{
	struct gpu_window *w = *wp;
	if (w->ring)
		ring_source_set_mapping_hooks(w->ring, NULL, NULL, NULL);
	for (uint32_t i = 0; i < w->n_copies; i++)
		cudaStreamSynchronize(w->copies[i]);
	if (w->g) {
		for (uint32_t g = 0; g < w->base.n_groups; g++) {
			if (w->g[g].host_held && w->rs)
				w->rs->ops->release(w->rs, g);
			if (w->g[g].h2d)
				cudaEventDestroy(w->g[g].h2d);
		}
	}
	for (uint32_t s = 0; s < w->n_slots; s++) {
		if (w->slots[s].compute_done)
			cudaEventDestroy(w->slots[s].compute_done);
	}
	for (uint32_t i = 0; i < GW_TIMES; i++)
		for (int j = 0; j < 2; j++) {
			if (w->wait_times.ev[i][j])
				cudaEventDestroy(w->wait_times.ev[i][j]);
			if (w->copy_times.ev[i][j])
				cudaEventDestroy(w->copy_times.ev[i][j]);
		}
	gw_split_destroy(w); /* waits for its copies */
	for (uint32_t i = 0; i < w->n_copies; i++)
		cudaStreamDestroy(w->copies[i]);
	cudaFree(w->resident_mem);
	cudaFree(w->window_mem);
	while (w->n_pinned)
		unpin_mapping(w, w->pinned[w->n_pinned - 1]);
	for (uint32_t c = 0; c < CLASS_COUNT; c++)
		free(w->order[c]);
	free(w->expert0);
	free(w->fetch);
	free(w->guess_set);
	free(w->last_known);
	free(w->slots);
	free(w->g);
	free(w->inflight);
	free(w->dev_off);
	free(w->dev_bytes);
	free(w->plan_groups);
	free(w->copy_bytes);
	free(w->span_base);
	free(w->split_r);
	free(w->split_r_layer);
	free(w->side_off);
	free(w);
	*wp = NULL;
}

/* Whether group g's tensors go to the device as they lie in its host slot, in one copy (*base: where
 * that copy starts in the slot; span_base): each whole (no FFN split), every tensor's distance from
 * the first a multiple of 16 (the kernels' vector loads; then each lies 16-byte aligned on the
 * device), and the gaps between them (the loader's extents start at 4 KiB boundaries) at most a
 * 32nd of the copy. A cudaMemcpyAsync costs the host a few microseconds: a model of many small experts
 * copies thousands of groups a token. */
static bool one_copy(const struct gpu_window *w, uint32_t g, uint64_t *base, uint64_t *span)
{
	const struct group_desc *gd = &w->base.groups[g];
	uint64_t lo = UINT64_MAX, hi = 0, sum = 0;
	for (uint32_t i = 0; i < gd->n_tensors; i++) {
		const struct tensor_desc *t = &w->base.tensors[gd->first_tensor + i];
		struct gw_piece pc = gw_piece(w, g, gd->first_tensor + i, false);
		if (pc.height != 1 || pc.src_off != t->slot_offset || pc.width != t->nbytes)
			return false;
		lo = t->slot_offset < lo ? t->slot_offset : lo;
		hi = t->slot_offset + t->nbytes > hi ? t->slot_offset + t->nbytes : hi;
		sum += t->nbytes;
	}
	if (!gd->n_tensors)
		return false;
	for (uint32_t i = 0; i < gd->n_tensors; i++)
		if ((w->base.tensors[gd->first_tensor + i].slot_offset - lo) % 16)
			return false;
	const uint64_t slack = sum / 32;
	const uint64_t r = lo % 16, b = (lo - r) / DEV_ALIGN * DEV_ALIGN + r; /* off - b keeps off's alignment */
	if (hi - b - sum > slack)
		return false;
	*base = b;
	*span = hi - b;
	return true;
}

/* Each group's device layout (w->dev_off, dev_bytes) and copy size (copy_bytes) from the pieces its
 * copies take: the slot's own layout in one copy where one_copy allows (span_base), else every
 * tensor at a DEV_ALIGN boundary, a copy each. */
void gw_layout(struct gpu_window *w)
{
	w->st.one_copy_groups = 0;
	for (uint32_t g = 0; g < w->base.n_groups; g++) {
		const struct group_desc *gd = &w->base.groups[g];
		uint64_t base, span;
		if (one_copy(w, g, &base, &span)) {
			for (uint32_t i = 0; i < gd->n_tensors; i++)
				w->dev_off[gd->first_tensor + i] = w->base.tensors[gd->first_tensor + i].slot_offset - base;
			w->span_base[g] = base;
			w->copy_bytes[g] = span;
			w->dev_bytes[g] = ALIGN_UP(span, (uint64_t)DEV_ALIGN);
			w->st.one_copy_groups++;
			continue;
		}
		w->span_base[g] = NO_SPAN;
		uint64_t off = 0, bytes = 0;
		for (uint32_t i = 0; i < gd->n_tensors; i++) {
			struct gw_piece pc = gw_piece(w, g, gd->first_tensor + i, false);
			w->dev_off[gd->first_tensor + i] = off;
			off = ALIGN_UP(off + pc.width * pc.height, (uint64_t)DEV_ALIGN);
			bytes += pc.width * pc.height;
		}
		w->dev_bytes[g] = off;
		w->copy_bytes[g] = bytes;
	}
}

uint64_t gw_slot_bytes(const struct gpu_window *w, const bool *resident, uint32_t depth, bool whole)
{
	uint64_t total = 0;
	for (uint32_t c = 0; c < CLASS_COUNT; c++) {
		uint64_t cls = 0, m = 0;
		for (uint32_t g = 0; g < w->base.n_groups; g++) {
			const bool kept = resident ? resident[g] || g == w->embed_group : w->g[g].resident;
			if (kept || w->base.groups[g].size_class != c || !weight_stage_has(&w->base.stage, &w->base.groups[g]))
				continue;
			const uint64_t b = whole ? w->plan_groups[g].slot_bytes : w->dev_bytes[g];
			m++;
			cls = b > cls ? b : cls;
		}
		const uint64_t d = gw_class_depth(w, depth, c);
		total += (m < d ? m : d) * cls;
	}
	return total;
}

#define CREATE_TRY(call, what)                                                                     \
	do {                                                                                       \
		cudaError_t e_ = (call);                                                           \
		if (e_ != cudaSuccess) {                                                           \
			rc = errorf(err, errlen, e_ == cudaErrorMemoryAllocation ? -ENOMEM : -EIO,    \
				    "%s: %s", what, cudaGetErrorString(e_));                       \
			goto out_fail;                                                             \
		}                                                                                  \
	} while (0)

int gpu_window_create(struct ring_source *ring, struct CUstream_st *stream, const struct gpu_window_params *p,
		      struct gpu_window **out, char *err, size_t errlen)
{
	struct weight_source *rs = ring_source_base(ring);
	const struct model_config *cfg = rs->cfg;
	uint32_t ng = rs->n_groups;
	struct gpu_window *w = calloc(1, sizeof(*w));
	bool *resident = calloc(ng, sizeof(bool));
	int rc = 0;
	if (!w || !resident) {
		free(w);
		free(resident);
		return errorf(err, errlen, -ENOMEM, "out of memory");
	}
	w->base = *rs; /* config, tables */
	w->base.ops = &gw_window_ops;
	w->base.bytes_acquired = w->base.acquires = 0;
	w->ring = ring;
	w->rs = rs;
	w->compute = stream;
	w->strict = p->strict;
	w->time_copies = p->time_copies;
	w->embed_group = group_id_embed();
	w->head_group = group_id_head(cfg);
	w->tied = cfg->tie_embeddings != 0;
	w->heat_known = p->expert_heat != NULL;
	w->predict = p->predict_experts && cfg->n_experts;
	w->split_experts = p->split_experts;
	w->balance_ends = p->balance_ends;
	w->ends_lag_s = p->balance_ends && fabs(p->ends_lag_s) <= GW_ENDS_MAX_S ? p->ends_lag_s : 0;
	w->ends_layer = UINT32_MAX;
	uint32_t depth = p->depth ? p->depth : 2;

	/* The device layout of every group whole, and the group table the plan sees with device sizes. */
	w->dev_off = calloc(rs->n_tensors, sizeof(uint64_t));
	w->dev_bytes = calloc(ng, sizeof(uint64_t));
	w->copy_bytes = calloc(ng, sizeof(uint64_t));
	w->span_base = calloc(ng, sizeof(uint64_t));
	w->split_r = calloc(ng, sizeof(uint32_t));
	w->plan_groups = calloc(ng, sizeof(struct group_desc));
	if (!w->dev_off || !w->dev_bytes || !w->copy_bytes || !w->span_base || !w->split_r || !w->plan_groups) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out_fail;
	}
	for (uint32_t g = 0; g < ng; g++)
		w->split_r[g] = gw_whole_r(w, g);
	gw_layout(w);
	for (uint32_t g = 0; g < ng; g++) {
		w->plan_groups[g] = rs->groups[g];
		w->plan_groups[g].slot_bytes = w->dev_bytes[g];
	}
	w->budget = p->gpu_budget;

	struct window_plan plan;
	w->xdepth = window_expert_depth(cfg, depth, p->expert_depth);
	rc = window_plan(cfg, w->plan_groups, ng, &rs->stage, p->gpu_budget, depth, w->xdepth, p->expert_heat, resident,
			 &plan, err, errlen);
	while (rc == -ENOSPC && !p->expert_depth && w->xdepth > depth) {
		/* The experts' own choice of slots does not fit: fewer, down to as many as a layer class has. */
		w->xdepth--;
		rc = window_plan(cfg, w->plan_groups, ng, &rs->stage, p->gpu_budget, depth, w->xdepth, p->expert_heat,
				 resident, &plan, err, errlen);
	}
	if (rc)
		goto out_fail;
	bool spread = false; /* the kept groups spread (window_plan_spread): again when the plan is made again */
	if (p->spread) {
		bool dram = true; /* every layer group of the stage held in DRAM by the loader */
		for (uint32_t g = 0; g < ng && dram; g++)
			if ((rs->groups[g].kind == GROUP_ATTN || rs->groups[g].kind == GROUP_FFN ||
			     rs->groups[g].kind == GROUP_MOE) &&
			    weight_stage_has(&rs->stage, &rs->groups[g]))
				dram = ring_source_group_pinned(ring, g);
		spread = dram;
		if (dram)
			w->st.spread = window_plan_spread(cfg, &rs->stage, resident, p->spread_attn_kept);
		else if (!p->spread_attn_kept) /* asked for (yes); auto says nothing of it */
			log_info("GPU weights: --window-spread keeps the first layers resident: the loader streams some "
				 "layer groups from disk, and reads them while the GPU keeps the first layers");
	}
	w->st.experts_resident = plan.experts_resident;
	w->st.expert_heat_resident = plan.expert_heat_resident;
	w->g = calloc(ng, sizeof(struct gent));
	w->inflight = calloc(ng, sizeof(uint32_t));
	if (!w->g || !w->inflight) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out_fail;
	}
	int lo, hi;
	CREATE_TRY(cudaDeviceGetStreamPriorityRange(&lo, &hi), "reading stream priorities");
	/* Weight copies are the critical path: the highest priority. */
	uint32_t nc = p->copy_streams ? p->copy_streams : 1;
	if (nc > 4)
		nc = 4;
	for (uint32_t i = 0; i < nc; i++) {
		CREATE_TRY(cudaStreamCreateWithPriority(&w->copies[i], cudaStreamNonBlocking, hi), "creating a copy stream");
		w->n_copies = i + 1;
	}
	w->copy = w->copies[0];
	w->st.copy_streams = nc;
	for (uint32_t g = 0; g < ng; g++) {
		w->g[g].slot = NO_SLOT;
		CREATE_TRY(cudaEventCreateWithFlags(&w->g[g].h2d, cudaEventDisableTiming), "creating events");
	}

	/* Pin the ring: DMA from pinned memory runs at the link's rate (docs/architecture.md). The ring
	 * of a loader that takes over in the middle of a step is pinned when it is mapped, and a gone
	 * loader's ring is unpinned before the source unmaps it (the hooks, trim_retired). */
	void *rbase;
	size_t rsize;
	ring_source_mapping(ring, &rbase, &rsize);
	pin_mapping(w, rbase, rsize);
	drop_kept(); /* what the window before pinned that this one does not map */
	ring_source_set_mapping_hooks(ring, on_ring_mapped, on_ring_unmapping, w);

	/* The split of streamed FFNs with the CPU (it needs the H2D rate), then the layout again: a
	 * split FFN keeps only its device share on the device. */
	w->st.h2d_bytes_per_s = p->h2d_bytes_per_s;
	if (w->st.h2d_bytes_per_s <= 0) {
		rc = gw_measure_h2d(w, &w->st.h2d_bytes_per_s);
		if (rc) {
			errorf(err, errlen, rc, "%s", w->base.error);
			goto out_fail;
		}
	}
	if ((rc = gw_split_plan(w, resident, p, err, errlen)) != 0)
		goto out_fail;
	gw_layout(w);
	if ((rc = gw_split_refill(w, resident, p, depth, spread, err, errlen)) != 0)
		goto out_fail;
	if ((rc = gw_split_fit(w, resident, p, depth, err, errlen)) != 0)
		goto out_fail;
	if (p->spread_attn_kept && w->st.spread && !w->plan.split_layers) {
		/* auto spreads for a split, and none came of it (a share of 0, no FFN that can split, or
		 * none that fits): the first layers kept, as the plan with whole sizes has them. */
		rc = window_plan(cfg, w->plan_groups, ng, &rs->stage, p->gpu_budget, depth, w->xdepth, p->expert_heat,
				 resident, &plan, err, errlen);
		if (rc)
			goto out_fail;
		w->st.spread = false;
		w->st.refill_bytes = 0; /* a refill's residency, where the split was then cancelled, is gone too */
	}
	gw_layout(w);
	if ((rc = gw_split_create(w, err, errlen)) != 0)
		goto out_fail;

	/* Resident groups: one allocation, copied now. */
	uint64_t res_bytes = 0;
	for (uint32_t g = 0; g < ng; g++) {
		bool keep = resident[g] || (w->tied && g == w->embed_group);
		if (keep)
			res_bytes += w->dev_bytes[g];
	}
	CREATE_TRY(cudaMalloc(&w->resident_mem, res_bytes ? res_bytes : 256), "allocating resident weights");
	uint64_t off = 0;
	for (uint32_t g = 0; g < ng; g++) {
		bool keep = resident[g] || (w->tied && g == w->embed_group);
		if (g == w->embed_group)
			w->g[g].resident = true; /* host side: always available */
		if (!keep)
			continue;
		struct group_weights hw;
		rc = rs->ops->acquire(rs, g, &hw);
		if (rc) {
			errorf(err, errlen, rc, "%s", rs->error);
			goto out_fail;
		}
		w->g[g].dev = (char *)w->resident_mem + off;
		rc = gw_copy_pieces(w, g, false, w->g[g].dev, w->dev_off, ring_source_group_base(ring, g), w->copy);
		if (rc) {
			errorf(err, errlen, rc, "%s", w->base.error);
			goto out_fail;
		}
		CREATE_TRY(cudaStreamSynchronize(w->copy), "copying resident weights");
		rs->ops->release(rs, g);
		off += w->dev_bytes[g];
		w->g[g].resident = true;
		if (g != w->embed_group)
			w->g[g].state = GWIN_RESIDENT;
		w->st.resident_groups++;
	}
	w->st.resident_bytes = res_bytes;


	/* Streaming classes: visit order and slots. */
	uint64_t win_bytes = 0;
	uint32_t n_slots = 0;
	for (uint32_t c = 0; c < CLASS_COUNT; c++) {
		w->order[c] = calloc(ng, sizeof(uint32_t));
		if (!w->order[c]) {
			rc = errorf(err, errlen, -ENOMEM, "out of memory");
			goto out_fail;
		}
		for (uint32_t g = 0; g < ng; g++)
			if (!w->g[g].resident && rs->groups[g].size_class == c && weight_stage_has(&rs->stage, &rs->groups[g]))
				w->order[c][w->m[c]++] = g;
		const uint32_t d = gw_class_depth(w, depth, c);
		w->depth[c] = w->m[c] < d ? w->m[c] : d;
		w->first_slot[c] = n_slots;
		n_slots += w->depth[c];
		uint64_t cls = 0;
		for (uint32_t i = 0; i < w->m[c]; i++)
			if (w->dev_bytes[w->order[c][i]] > cls)
				cls = w->dev_bytes[w->order[c][i]];
		win_bytes += (uint64_t)w->depth[c] * cls;
		w->st.streamed_groups += w->m[c];
	}
	w->n_slots = n_slots;
	w->slots = calloc(n_slots ? n_slots : 1, sizeof(struct gslot));
	if (!w->slots) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out_fail;
	}
	if (win_bytes)
		CREATE_TRY(cudaMalloc(&w->window_mem, win_bytes), "allocating the streaming window");
	off = 0;
	for (uint32_t c = 0; c < CLASS_COUNT; c++) {
		uint64_t cls = 0;
		for (uint32_t i = 0; i < w->m[c]; i++)
			if (w->dev_bytes[w->order[c][i]] > cls)
				cls = w->dev_bytes[w->order[c][i]];
		for (uint32_t i = 0; i < w->depth[c]; i++) {
			struct gslot *s = &w->slots[w->first_slot[c] + i];
			s->group = NO_GROUP;
			s->size_class = c;
			s->dev = (char *)w->window_mem + off;
			off += cls;
			CREATE_TRY(cudaEventCreateWithFlags(&s->compute_done, cudaEventDisableTiming), "creating events");
		}
	}
	for (uint32_t i = 0; w->time_copies && i < GW_TIMES; i++)
		for (int j = 0; j < 2; j++) {
			CREATE_TRY(cudaEventCreate(&w->wait_times.ev[i][j]), "creating events");
			CREATE_TRY(cudaEventCreate(&w->copy_times.ev[i][j]), "creating events");
		}
	w->st.window_bytes = win_bytes;
	/* What crosses PCIe per decode token: the bytes copies of the streamed groups move; of a streamed
	 * expert, as often as routing chooses it (its heat; none known, k of E). */
	double cpu_able = 0; /* of those, the experts' that stay in DRAM for good: the CPU may take them */
	for (uint32_t g = 0; g < ng; g++) {
		const struct group_desc *gd = &rs->groups[g];
		if (w->g[g].resident || !weight_stage_has(&rs->stage, gd))
			continue;
		double often = 1.0;
		if (gd->kind == GROUP_EXPERT) {
			often = p->expert_heat ? p->expert_heat[(size_t)gd->layer * cfg->n_experts + gd->expert]
					       : (double)cfg->n_experts_used / cfg->n_experts;
			often = often < 0 ? 0 : often > 1 ? 1 : often;
		}
		w->st.streamed_bytes_per_token += (uint64_t)(often * (double)w->copy_bytes[g] + 0.5);
		if (gd->kind == GROUP_EXPERT && ring_source_group_pinned(w->ring, g))
			cpu_able += often * (double)w->copy_bytes[g];
	}
	/* With the CPU on for experts, a decode step's route leaves it the share of those bytes that
	 * makes both sides finish together (win_route): rate / (rate + H2D), or the fixed fraction. */
	const double h2d = w->st.h2d_bytes_per_s, rate = w->cpu_rate[w->moe_format];
	if (w->moe_policy.mode != CPU_SHARE_OFF && cpu_able > 0 && h2d > 0 && rate > 0) {
		const double f = w->moe_policy.mode == CPU_SHARE_FIXED ? w->moe_policy.fraction : rate / (rate + h2d);
		const uint64_t moved = (uint64_t)(f * cpu_able + 0.5);
		w->st.streamed_bytes_per_token -= moved < w->st.streamed_bytes_per_token ? moved : w->st.streamed_bytes_per_token;
		w->st.cpu_bytes_per_token += moved;
		w->st.expert_cpu_bytes_per_token = moved;
		w->st.cpu_ms += (double)moved / rate * 1e3;
	}
	w->st.depth = depth;
	w->st.expert_depth = w->depth[CLASS_EXPERT]; /* 0: no expert streams */
	/* Start copying the first streamed groups now; then hand back what the loader's streaming slots
	 * hold for us beyond need (the releases of the resident groups' copies, held back for a next
	 * acquire that may be far off): another runner of a split model may need those slots first. */
	rc = gw_top_up(w);
	if (rc == 0)
		rc = gw_window_ops.flush(&w->base);
	if (rc) {
		errorf(err, errlen, rc, "%s", w->base.error);
		goto out_fail;
	}
	free(resident);
	*out = w;
	return 0;

out_fail:
	free(resident);
	gpu_window_destroy(&w);
	return rc ? rc : -EIO;
}


/* gpu_window_split.c - the GPU window's part of split FFNs (gpu_window.h says what they are): the
 * plan with the CPU's rates measured on the ring, the pieces a copy takes, the views handed to the
 * engine, and the prefill copy of a split FFN's CPU rows. C over the CUDA runtime API.
 *
 * Only FFN groups whose host bytes stay in DRAM for good (ring_source_group_pinned) split: the CPU
 * and the prefill copies read them at any time, with no grant to hold, and the loader's streaming
 * slots are not held up. A retired ring (a loader that went away) stays mapped while a CPU share
 * or a prefill copy issued from it may still read it (gw_split_reads_ring). */
#include "services/gpu-runner/gpu_window_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "services/gpu-runner/window_plan.h"

#define SPLIT_TRY(call, what)                                                                              \
	do {                                                                                               \
		cudaError_t e_ = (call);                                                                   \
		if (e_ != cudaSuccess)                                                                     \
			return errorf(w->base.error, sizeof(w->base.error), -EIO, "%s: %s", what,           \
				      cudaGetErrorString(e_));                                             \
	} while (0)

/* Bytes of each format the experts the CPU's rate for experts is measured on hold, at least where
 * the streamed experts have them: twice split_calibrate's bytes a run. */
#define MOE_CALIBRATE_BYTES_EACH (2 * SPLIT_CALIBRATE_BYTES)

/* A split FFN group (the plan's; an expert split by its route is gw_expert_split). */
static bool is_split(const struct gpu_window *w, uint32_t g)
{
	return w->split_r && w->base.groups[g].kind != GROUP_EXPERT && w->split_r[g] < w->base.cfg->ffn_dim;
}

bool gw_expert_split(const struct gpu_window *w, uint32_t g)
{
	return w->split_r && w->base.groups[g].kind == GROUP_EXPERT && w->split_r[g] < w->base.cfg->expert_ffn_dim;
}

struct gw_piece gw_piece(const struct gpu_window *w, uint32_t g, uint32_t ti, bool rest)
{
	const struct tensor_desc *t = &w->base.tensors[ti];
	struct gw_piece pc = {t->slot_offset, t->nbytes, 1, t->nbytes};
	const bool expert = gw_expert_split(w, g);
	const bool down = t->role == (expert ? ROLE_EXPERT_DOWN : ROLE_W_DOWN);
	const bool mat = down || t->role == (expert ? ROLE_EXPERT_GATE : ROLE_W_GATE) ||
			 t->role == (expert ? ROLE_EXPERT_UP : ROLE_W_UP);
	if (!(expert || is_split(w, g)) || !mat) {
		if (rest)
			pc.width = 0;
		return pc;
	}
	const uint32_t ffn = expert ? w->base.cfg->expert_ffn_dim : w->base.cfg->ffn_dim, r = w->split_r[g];
	const uint32_t a = rest ? r : 0, n = rest ? ffn - r : r;
	const enum dtype f = (enum dtype)t->dtype;
	const uint64_t full = dtype_row_bytes(f, t->shape[1]);
	if (down) {
		/* Columns [a, a + n) of every row: whole blocks, contiguous within a row. */
		pc.src_off += dtype_row_bytes(f, a);
		pc.width = dtype_row_bytes(f, n);
		pc.height = t->shape[0];
		pc.spitch = full;
	} else {
		pc.src_off += a * full;
		pc.width = n * full;
		pc.spitch = pc.width;
	}
	return pc;
}

int gw_copy_pieces(struct gpu_window *w, uint32_t g, bool rest, void *dev, const uint64_t *off, const void *host,
		   cudaStream_t s)
{
	const struct group_desc *gd = &w->base.groups[g];
	if (!rest && off == w->dev_off && w->span_base[g] != NO_SPAN && !gw_expert_split(w, g)) {
		/* The slot's layout: one copy (gw_layout). */
		cudaError_t e = cudaMemcpyAsync(dev, (const char *)host + w->span_base[g], w->copy_bytes[g],
						cudaMemcpyHostToDevice, s);
		if (e != cudaSuccess)
			return errorf(w->base.error, sizeof(w->base.error), -EIO, "copying group %u: %s", g,
				      cudaGetErrorString(e));
		return 0;
	}
	for (uint32_t i = 0; i < gd->n_tensors; i++) {
		uint32_t ti = gd->first_tensor + i;
		struct gw_piece pc = gw_piece(w, g, ti, rest);
		if (!pc.width || !pc.height)
			continue;
		char *dst = (char *)dev + off[ti];
		const char *src = (const char *)host + pc.src_off;
		cudaError_t e = pc.height == 1 ? cudaMemcpyAsync(dst, src, pc.width, cudaMemcpyHostToDevice, s)
					       : cudaMemcpy2DAsync(dst, pc.width, src, pc.spitch, pc.width, pc.height,
								   cudaMemcpyHostToDevice, s);
		if (e != cudaSuccess)
			return errorf(w->base.error, sizeof(w->base.error), -EIO, "copying %s of group %u: %s",
				      rest ? "the CPU rows" : "tensors", g, cudaGetErrorString(e));
	}
	return 0;
}

/* ---- the plan ---- */

/* Tensor of role r in group g, or NULL. */
static const struct tensor_desc *find(const struct gpu_window *w, uint32_t g, enum tensor_role r)
{
	int ti = model_find_tensor(w->base.cfg, w->base.tensors, w->base.groups, g, r);
	return ti >= 0 ? &w->base.tensors[ti] : NULL;
}

/* H2D copies queued on the window's copy stream while the CPU's rates are measured: in a decode
 * step the CPU share and the copies read the same DRAM at once, and each alone is far faster than
 * beside the other (on the H100 host a BF16 share measured 70 GB/s alone and ran at 46 GB/s beside
 * the copies), so the plan takes both rates measured together. */
#define H2D_LOAD_COPIES 48 /* the load from a buffer of its own: ~60 ms at 50 GB/s */
#define H2D_LOAD_BYTES ((uint64_t)H2D_LOAD_COPIES * GW_H2D_CHUNK) /* the load from the ring */
#define H2D_LOAD_PIECES 4096 /* copies of it at most (a small expert's slot is one) */

/* Does group g stream through the window: one of the runner's (its stage's) and not resident? */
static bool streams(const struct gpu_window *w, const bool *resident, uint32_t g)
{
	return !resident[g] && weight_stage_has(&w->base.stage, &w->base.groups[g]);
}

/* An expert group the CPU may compute: it streams, and its host bytes stay in DRAM. */
static bool cpu_able_expert(const struct gpu_window *w, const bool *resident, uint32_t g)
{
	return w->base.groups[g].kind == GROUP_EXPERT && streams(w, resident, g) && ring_source_group_pinned(w->ring, g);
}

/* Starts the H2D load beside the CPU's measurement: the streamed groups' pinned slots in the ring,
 * from the last group back (the loader pins from the last layer down and the CPU measures from
 * the first split layer up: they start apart), once each, at most H2D_LOAD_BYTES and half of them
 * (so that the two do not meet in the same slots, whose second reader would find them in the
 * caches), in pieces of at most GW_H2D_CHUNK; a buffer of its own when the ring has no such slot
 * registered with CUDA (copies from pageable memory would run before the CPU's, not beside). */
static bool h2d_load_start(struct gpu_window *w, const bool *resident, struct gw_h2d *load)
{
	uint64_t all = 0;
	for (uint32_t g = 0; g < w->base.n_groups; g++)
		if (streams(w, resident, g) && ring_source_group_pinned(w->ring, g))
			all += w->base.groups[g].tensor_bytes;
	const uint64_t cap = all / 2 < H2D_LOAD_BYTES ? all / 2 : H2D_LOAD_BYTES;
	const void **src = calloc(H2D_LOAD_PIECES, sizeof(*src));
	size_t *len = calloc(H2D_LOAD_PIECES, sizeof(*len));
	uint32_t n = 0;
	uint64_t total = 0;
	for (uint32_t g = w->base.n_groups; src && len && g-- > 0 && total < cap && n < H2D_LOAD_PIECES;) {
		if (!streams(w, resident, g) || !ring_source_group_pinned(w->ring, g))
			continue;
		const char *base = ring_source_group_base(w->ring, g);
		const uint64_t bytes = w->base.groups[g].tensor_bytes;
		if (!base || !gw_registered(w, base, bytes))
			continue;
		for (uint64_t off = 0; off < bytes && total < cap && n < H2D_LOAD_PIECES; off += GW_H2D_CHUNK, n++) {
			src[n] = base + off;
			len[n] = (size_t)(bytes - off < GW_H2D_CHUNK ? bytes - off : GW_H2D_CHUNK);
			total += len[n];
		}
	}
	bool ok = n && total >= GW_H2D_CHUNK && gw_h2d_start_from(w->copy, src, len, n, load);
	free(src);
	free(len);
	return ok || gw_h2d_start(w->copy, H2D_LOAD_COPIES, load);
}

/* The copies beside the CPU's measurement (split_calibrate's split_load): one load a format, their
 * bytes and seconds summed. */
struct beside {
	struct gpu_window *w;
	const bool *resident;
	struct gw_h2d load;
	uint64_t bytes;
	double seconds;
};

static bool beside_start(void *arg)
{
	struct beside *b = arg;
	return h2d_load_start(b->w, b->resident, &b->load);
}

static bool beside_busy(void *arg)
{
	const struct beside *b = arg;
	return cudaEventQuery(b->load.b) == cudaErrorNotReady;
}

static void beside_finish(void *arg)
{
	struct beside *b = arg;
	const uint64_t bytes = b->load.bytes;
	const double bps = gw_h2d_finish(&b->load);
	if (bps > 0) {
		b->bytes += bytes;
		b->seconds += (double)bytes / bps;
	}
}

/* The seconds a decode token's GPU reads everything but the FFNs that may split, at hbm_bps
 * (split_plan.gpu_s: the CPU's jobs wait them out). per_layer: also each eligible layer's gpu_s
 * (split_layer.gpu_s): the bytes the GPU reads between the eligible layer before it (a token's last
 * one, before the first) and its own attention: the groups of the layers in between, resident or
 * streamed whole, and the head where the token ends in between; where the kept layers spread,
 * those layers sit between the split ones and the link copies through them. */
static double gpu_gaps(struct gpu_window *w, struct split_layer *ly, double hbm_bps, bool per_layer)
{
	const struct model_config *cfg = w->base.cfg;
	const uint32_t L = cfg->n_layers;
	uint64_t *own = calloc(L + 1, sizeof(uint64_t)), elig_rest = 0; /* own[L]: the head */
	if (!own)
		return 0; /* no gaps: the balance without them */
	for (uint32_t g = 0; g < w->base.n_groups; g++) {
		const struct group_desc *gd = &w->base.groups[g];
		if (g == w->embed_group || !weight_stage_has(&w->base.stage, gd))
			continue;
		if (gd->kind == GROUP_HEAD)
			own[L] += gd->tensor_bytes;
		else if (gd->layer < L && !ly[gd->layer].eligible)
			own[gd->layer] += gd->tensor_bytes;
		else if (gd->layer < L && gd->kind != GROUP_FFN)
			elig_rest += gd->tensor_bytes; /* a split layer's attention: in its handoff's time */
	}
	uint64_t all = elig_rest;
	uint32_t last = L;
	for (uint32_t l = 0; l <= L; l++) {
		all += own[l];
		if (l < L && ly[l].eligible)
			last = l;
	}
	if (last == L || !per_layer) {
		free(own);
		return (double)all / hbm_bps;
	}
	/* From the last eligible layer round the token's end: the layers after it, the head, then
	 * the ones before each eligible layer. */
	uint64_t bytes = own[L];
	for (uint32_t l = last + 1; l < L; l++)
		bytes += own[l];
	for (uint32_t l = 0; l < L; l++) {
		if (!ly[l].eligible) {
			bytes += own[l];
			continue;
		}
		ly[l].gpu_s = (double)bytes / hbm_bps;
		bytes = 0;
	}
	free(own);
	return (double)all / hbm_bps;
}

int gw_split_plan(struct gpu_window *w, const bool *resident, const struct gpu_window_params *p, char *err,
		  size_t errlen)
{
	static const enum tensor_role mats[3] = {ROLE_W_GATE, ROLE_W_UP, ROLE_W_DOWN};
	const struct model_config *cfg = w->base.cfg;
	const uint32_t L = cfg->n_layers, ng = w->base.n_groups;
	struct cpu_share_policy pol = p->cpu_share;
	const bool on = pol.mode != CPU_SHARE_OFF && p->cpu_pool;
	struct split_layer *ly = calloc(L, sizeof(*ly));
	struct split_sample *samples = calloc(3 * ((size_t)L + ng), sizeof(*samples));
	free(w->split_r_layer); /* a plan made again (gw_split_refill) */
	w->split_r_layer = calloc(L, sizeof(uint32_t));
	int rc = 0;
	if (!ly || !samples || !w->split_r_layer) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out;
	}
	uint32_t ns = 0, n_elig = 0;
	for (uint32_t l = 0; l < L; l++) {
		uint32_t g = model_group_ffn(cfg, l);
		const struct tensor_desc *t[3] = {find(w, g, mats[0]), find(w, g, mats[1]), find(w, g, mats[2])};
		bool ok = on && streams(w, resident, g) && ring_source_group_pinned(w->ring, g) && t[0] && t[1] && t[2];
		for (int i = 0; ok && i < 3; i++)
			ok = t[i]->dtype < DT_COUNT && t[i]->ndim == 2;
		if (ok)
			ok = cfg->ffn_dim % ffn_split_unit((enum dtype)t[2]->dtype) == 0;
		ly[l].eligible = ok;
		n_elig += ok;
		for (int i = 0; i < 3; i++) {
			ly[l].format[i] = t[i] ? t[i]->dtype : DT_COUNT;
			ly[l].bytes[i] = t[i] ? t[i]->nbytes : 0;
			if (ok)
				samples[ns++] = (struct split_sample){
					.data = (const char *)ring_source_group_base(w->ring, g) + t[i]->slot_offset,
					.format = t[i]->dtype, .rows = (uint32_t)t[i]->shape[0],
					.cols = (uint32_t)t[i]->shape[1],
					.row_bytes = dtype_row_bytes((enum dtype)t[i]->dtype, t[i]->shape[1])};
		}
	}
	/* A mixture-of-experts model: the routed experts the CPU may compute (gpu_window.c, win_route),
	 * its rate measured on the streamed expert groups that stay in DRAM, every stride-th spread over
	 * the layers: enough that each format's samples hold MOE_CALIBRATE_BYTES_EACH, so that no
	 * calibration run reads rows an earlier one left in the CPU's caches (64 experts of a Q4_K_M
	 * file held 113 MB of Q4_K and less of Q6_K, read again run after run: 127 and 195 GB/s, where
	 * the CPU's experts ran at 62-115 in their spans), or all of them. */
	w->moe_policy.mode = CPU_SHARE_OFF;
	if (on && cfg->n_experts) {
		static const enum tensor_role em[3] = {ROLE_EXPERT_GATE, ROLE_EXPERT_UP, ROLE_EXPERT_DOWN};
		uint32_t cand = 0, seen = 0;
		uint64_t fmt_bytes[DT_COUNT] = {0};
		for (uint32_t g = 0; g < ng; g++) {
			if (!cpu_able_expert(w, resident, g))
				continue;
			cand++;
			for (int i = 0; i < 3; i++) {
				const struct tensor_desc *t = find(w, g, em[i]);
				if (t && t->dtype < DT_COUNT)
					fmt_bytes[t->dtype] += t->nbytes;
			}
		}
		uint32_t stride = cand ? cand : 1; /* every stride-th candidate: the least of the formats' */
		for (uint32_t f = 0; f < DT_COUNT; f++)
			if (fmt_bytes[f]) {
				const uint64_t s = fmt_bytes[f] / MOE_CALIBRATE_BYTES_EACH;
				stride = s < stride ? (uint32_t)(s ? s : 1) : stride;
			}
		for (uint32_t g = 0; g < ng; g++) {
			if (!cpu_able_expert(w, resident, g))
				continue;
			if (seen++ % stride)
				continue;
			const struct tensor_desc *t[3] = {find(w, g, em[0]), find(w, g, em[1]), find(w, g, em[2])};
			if (!t[0] || !t[1] || !t[2])
				continue;
			for (int i = 0; i < 3; i++)
				samples[ns++] = (struct split_sample){
					.data = (const char *)ring_source_group_base(w->ring, g) + t[i]->slot_offset,
					.format = t[i]->dtype, .rows = (uint32_t)t[i]->shape[0],
					.cols = (uint32_t)t[i]->shape[1],
					.row_bytes = dtype_row_bytes((enum dtype)t[i]->dtype, t[i]->shape[1])};
			w->moe_policy = pol;
			w->moe_format = t[0]->dtype;
		}
	}
	uint64_t other = 0;
	for (uint32_t g = 0; g < ng; g++) {
		const struct group_desc *gd = &w->base.groups[g];
		if (!streams(w, resident, g) || g == w->embed_group || (gd->kind == GROUP_FFN && ly[gd->layer].eligible))
			continue;
		other += gd->tensor_bytes;
		if (gd->kind != GROUP_HEAD && gd->layer < L) /* a layer's own: --cpu-share-balance layer */
			ly[gd->layer].other_bytes += gd->tensor_bytes;
	}
	/* A layer whose FFN does not split hands its other bytes to the next split layer: the window
	 * copies them in the run-up to it (the kept layers spread, a streamed attention group often sits
	 * in a layer whose FFN stays on the GPU). */
	uint64_t carry = 0;
	for (uint32_t l = 0; l < L; l++) {
		carry += ly[l].other_bytes;
		ly[l].other_bytes = ly[l].eligible ? carry : 0;
		if (ly[l].eligible)
			carry = 0;
	}
	double gpu_all = 0;
	if (p->split_gaps && p->hbm_bytes_per_s > 0)
		gpu_all = gpu_gaps(w, ly, p->hbm_bytes_per_s, w->st.spread);
	double h2d = w->st.h2d_bytes_per_s;
	/* Rates of jobs that ran (the runner's re-plan): taken as they are where they cover every format
	 * the samples hold. */
	bool given = ns && pol.rates_known;
	for (uint32_t i = 0; given && i < ns; i++)
		given = pol.cpu_bytes_per_s[samples[i].format] > 0;
	if (given) {
		const double beside = pol.h2d_beside_bytes_per_s;
		if (beside > 0 && beside < h2d)
			h2d = beside;
		w->st.h2d_beside_cpu_bytes_per_s = beside;
		w->st.rates_from_jobs = true;
		log_info("cpu share: planned with rates measured before (%s %.1f GB/s; H2D %.1f GB/s beside the CPU)",
			 dtype_name((enum dtype)samples[0].format), pol.cpu_bytes_per_s[samples[0].format] / 1e9,
			 beside / 1e9);
	} else if (ns) { /* auto chooses by them; a fixed share gets its prediction and its token limit */
		struct beside bs = {.w = w, .resident = resident};
		const struct split_load load = {.start = beside_start, .busy = beside_busy, .finish = beside_finish,
						.arg = &bs};
		uint64_t t0 = now_ns();
		w->calibrations++;
		rc = split_calibrate(p->cpu_pool, samples, ns, SPLIT_CALIBRATE_BYTES, &load, pol.cpu_bytes_per_s, err,
				     errlen);
		const double cal_ms = (double)(now_ns() - t0) / 1e6;
		const double h2d_beside = bs.seconds > 0 ? (double)bs.bytes / bs.seconds : 0;
		const bool loaded = bs.bytes > 0;
		if (rc)
			goto out;
		if (h2d_beside > 0 && h2d_beside < h2d)
			h2d = h2d_beside;
		w->st.h2d_beside_cpu_bytes_per_s = h2d_beside;
		log_info("cpu share: measured the CPU's products in %.0f ms beside %s H2D copies (H2D %.1f GB/s alone, "
			 "%.1f GB/s beside the CPU)", cal_ms, loaded ? "running" : "no (they could not start)",
			 w->st.h2d_bytes_per_s / 1e9, h2d_beside / 1e9);
	}
	memcpy(w->cpu_rate, pol.cpu_bytes_per_s, sizeof(w->cpu_rate));
	w->plan.r = w->split_r_layer;
	rc = split_plan_choose(cfg, ly, other, h2d, &pol, &w->plan, err, errlen);
	if (rc)
		goto out;
	w->plan.gpu_s = gpu_all;
	w->st.split_gaps_ms = 0;
	for (uint32_t l = 0; l < L; l++) {
		w->split_r[model_group_ffn(cfg, l)] = w->split_r_layer[l];
		if (w->split_r_layer[l] < cfg->ffn_dim && pol.mode == CPU_SHARE_AUTO)
			w->st.split_gaps_ms += ly[l].gpu_s * 1e3;
	}
	w->st.split_groups = w->plan.split_layers;
	w->st.split_r_min = w->plan.r_min;
	w->st.split_r_max = w->plan.r_max;
	w->st.split_max_tokens = w->plan.max_tokens;
	w->st.cpu_share = w->plan.share;
	w->st.cpu_bytes_per_token = w->plan.cpu_bytes;
	w->st.pcie_ms = w->plan.pcie_s * 1e3;
	w->st.cpu_ms = w->plan.cpu_s * 1e3;
	w->st.cpu_jobs_ms = w->plan.jobs_s * 1e3;
out:
	free(ly);
	free(samples);
	return rc;
}

/* The prefill buffer's layout (side_off, when not NULL) and size: the CPU rows of the largest split FFN. */
static uint64_t side_layout(struct gpu_window *w, uint64_t *side_off)
{
	uint64_t most = 0;
	for (uint32_t g = 0; g < w->base.n_groups; g++) {
		if (!is_split(w, g))
			continue;
		const struct group_desc *gd = &w->base.groups[g];
		uint64_t off = 0;
		for (uint32_t i = 0; i < gd->n_tensors; i++) {
			struct gw_piece pc = gw_piece(w, g, gd->first_tensor + i, true);
			if (side_off)
				side_off[gd->first_tensor + i] = off;
			off = ALIGN_UP(off + pc.width * pc.height, (uint64_t)DEV_ALIGN);
		}
		most = off > most ? off : most;
	}
	return most;
}

/* Device bytes of the plan in resident[] as laid out now (whole: the plan table's whole group
 * sizes): the resident groups, depth slots of each streamed class's largest group, and with the
 * split the prefill buffer. */
static uint64_t planned_bytes(struct gpu_window *w, const bool *resident, uint32_t depth, bool whole)
{
	uint64_t total = gw_slot_bytes(w, resident, depth, whole);
	for (uint32_t g = 0; g < w->base.n_groups; g++)
		if (resident[g] || (w->tied && g == w->embed_group))
			total += whole ? w->plan_groups[g].slot_bytes : w->dev_bytes[g];
	return total + (whole ? 0 : side_layout(w, NULL));
}

/* A decode token as the plan predicts it: the longer of the copies and the CPU. */
static double plan_token_s(const struct split_plan *pl)
{
	return pl->pcie_s > pl->cpu_s + pl->gpu_s ? pl->pcie_s : pl->cpu_s + pl->gpu_s;
}

/* Device bytes of the groups resident[] keeps. */
static uint64_t kept_bytes(const struct gpu_window *w, const bool *resident)
{
	uint64_t b = 0;
	for (uint32_t g = 0; g < w->base.n_groups; g++)
		b += resident[g] ? w->plan_groups[g].slot_bytes : 0;
	return b;
}

/* The split planned again over resident[], every FFN whole first, at the rates the window measured
 * already (no second calibration; what the stats say of where they came from stays), each layer its
 * own share or one for all (per_layer), and laid out. Returns gw_split_plan's result. */
static int split_again(struct gpu_window *w, const bool *resident, const struct gpu_window_params *p, bool per_layer,
		       char *err, size_t errlen)
{
	struct gpu_window_params q = *p;
	memcpy(q.cpu_share.cpu_bytes_per_s, w->cpu_rate, sizeof(w->cpu_rate));
	q.cpu_share.rates_known = true;
	q.cpu_share.h2d_beside_bytes_per_s = w->st.h2d_beside_cpu_bytes_per_s;
	q.cpu_share.per_layer = per_layer;
	const bool from_jobs = w->st.rates_from_jobs;
	for (uint32_t g = 0; g < w->base.n_groups; g++)
		w->split_r[g] = gw_whole_r(w, g);
	gw_layout(w);
	int rc = gw_split_plan(w, resident, &q, err, errlen);
	w->st.rates_from_jobs = from_jobs;
	gw_layout(w);
	return rc;
}

int gw_split_refill(struct gpu_window *w, bool *resident, const struct gpu_window_params *p, uint32_t depth,
		    bool spread, char *err, size_t errlen)
{
	const struct model_config *cfg = w->base.cfg;
	const uint32_t ng = w->base.n_groups;
	if (!w->plan.split_layers || cfg->n_experts || w->plan.cpu_s <= 0 || p->fixed_residency)
		return 0;
	const uint64_t used = planned_bytes(w, resident, depth, false);
	const uint64_t assumed = planned_bytes(w, resident, depth, true);
	if (used >= p->gpu_budget || assumed <= used)
		return 0;
	bool *first = malloc(ng * sizeof(bool));
	if (!first)
		return 0; /* the first plan stands */
	memcpy(first, resident, ng * sizeof(bool));
	const double t0 = plan_token_s(&w->plan);
	const bool spread0 = w->st.spread;
	const uint64_t kept0 = kept_bytes(w, first);
	/* The plan again, its budget raised by what the split's smaller slots free; a raise that
	 * overshoots once it splits again is taken back by the overshoot (twice at most). A try that
	 * fails, or would measure a format the first plan did not (its rates unknown), is not taken. */
	uint64_t raise = assumed - used;
	bool better = false;
	char why[256] = "";
	for (int tries = 0; tries < 3 && raise && !better; tries++) {
		struct window_plan wp;
		for (uint32_t g = 0; g < ng; g++)
			w->split_r[g] = gw_whole_r(w, g);
		gw_layout(w);
		if (window_plan(cfg, w->plan_groups, ng, &w->base.stage, p->gpu_budget + raise, depth, w->xdepth, NULL,
				resident, &wp, why, sizeof(why)))
			break;
		if (spread)
			w->st.spread = window_plan_spread(cfg, &w->base.stage, resident, p->spread_attn_kept);
		const uint32_t cal = w->calibrations;
		if (split_again(w, resident, p, p->cpu_share.per_layer, why, sizeof(why)) || w->calibrations != cal)
			break;
		const uint64_t now = planned_bytes(w, resident, depth, false);
		better = now <= p->gpu_budget && kept_bytes(w, resident) > kept0 && plan_token_s(&w->plan) < t0;
		if (!better)
			raise = now > p->gpu_budget && now - p->gpu_budget < raise ? raise - (now - p->gpu_budget) : 0;
	}
	int rc = 0;
	if (better) {
		char a[32], b[32];
		const uint64_t kept = kept_bytes(w, resident);
		w->st.refill_bytes = kept - kept0;
		log_info("GPU weights: the split's smaller slots free %s: %s more kept on the GPU; predicted %.1f "
			 "ms/token, from %.1f", format_size(assumed - used, a, sizeof(a)),
			 format_size(kept - kept0, b, sizeof(b)), plan_token_s(&w->plan) * 1e3, t0 * 1e3);
	} else { /* the first plan again, as it was (the same rates, the same residency) */
		if (why[0])
			log_info("GPU weights: the plan with the memory the split frees was not taken (%s)", why);
		memcpy(resident, first, ng * sizeof(bool));
		w->st.spread = spread0;
		rc = split_again(w, resident, p, p->cpu_share.per_layer, err, errlen);
	}
	free(first);
	return rc;
}

/* Splits nothing after all (the prefill buffer does not fit the budget): every split_r back to ffn_dim,
 * the plan's numbers those of no split. The caller lays out again. */
static void split_cancel(struct gpu_window *w)
{
	gw_split_destroy(w);
	for (uint32_t g = 0; g < w->base.n_groups; g++)
		w->split_r[g] = gw_whole_r(w, g);
	for (uint32_t l = 0; l < w->base.cfg->n_layers; l++)
		w->split_r_layer[l] = w->base.cfg->ffn_dim;
	w->plan.pcie_bytes += w->plan.cpu_bytes;
	w->plan.pcie_s = w->st.h2d_bytes_per_s > 0 ? (double)w->plan.pcie_bytes / w->st.h2d_bytes_per_s : 0;
	w->plan.cpu_bytes = 0;
	w->plan.cpu_s = w->plan.jobs_s = 0;
	w->plan.split_layers = 0;
	w->plan.r_min = w->plan.r_max = w->base.cfg->ffn_dim;
	w->st.split_groups = 0;
	w->st.split_r_min = w->st.split_r_max = w->base.cfg->ffn_dim;
	w->st.cpu_bytes_per_token = 0;
	w->st.pcie_ms = w->plan.pcie_s * 1e3;
	w->st.cpu_ms = w->st.cpu_jobs_ms = 0;
	w->st.side_bytes = 0;
}

int gw_split_fit(struct gpu_window *w, const bool *resident, const struct gpu_window_params *p, uint32_t depth,
		 char *err, size_t errlen)
{
	if (!w->plan.split_layers || planned_bytes(w, resident, depth, false) <= p->gpu_budget)
		return 0;
	char a[32], b[32];
	const uint64_t side = side_layout(w, NULL);
	if (p->cpu_share.mode == CPU_SHARE_AUTO && p->cpu_share.per_layer) {
		int rc = split_again(w, resident, p, false, err, errlen);
		if (rc)
			return rc;
		if (!w->plan.split_layers || planned_bytes(w, resident, depth, false) <= p->gpu_budget) {
			w->st.split_balance_token = w->plan.split_layers > 0;
			log_warn("cpu share: each layer's own share needs a prefill buffer of %s beside slots for the largest "
				 "GPU share: past --gpu-budget %s; one share for every FFN instead",
				 format_size(side, a, sizeof(a)), format_size(p->gpu_budget, b, sizeof(b)));
			return 0;
		}
	}
	log_warn("cpu share: the prefill copy of a split FFN's CPU rows (%s) does not fit --gpu-budget %s beside the "
		 "slots: no FFN splits", format_size(side_layout(w, NULL), a, sizeof(a)),
		 format_size(p->gpu_budget, b, sizeof(b)));
	split_cancel(w);
	return 0;
}

int gw_split_create(struct gpu_window *w, char *err, size_t errlen)
{
	w->side_group = w->side_user = NO_GROUP;
	if (!w->plan.split_layers)
		return 0;
	w->side_off = calloc(w->base.n_tensors, sizeof(uint64_t));
	if (!w->side_off)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	const uint64_t most = side_layout(w, w->side_off);
	int lo, hi;
	cudaError_t e = cudaDeviceGetStreamPriorityRange(&lo, &hi);
	if (e == cudaSuccess)
		e = cudaStreamCreateWithPriority(&w->side_stream, cudaStreamNonBlocking, hi);
	if (e == cudaSuccess)
		e = cudaEventCreateWithFlags(&w->side_h2d, cudaEventDisableTiming);
	if (e == cudaSuccess)
		e = cudaEventCreateWithFlags(&w->side_done, cudaEventDisableTiming);
	if (e == cudaSuccess)
		e = cudaEventCreateWithFlags(&w->cpu_done, cudaEventDisableTiming);
	if (e == cudaSuccess)
		e = cudaMalloc(&w->side_mem, most ? most : DEV_ALIGN);
	if (e != cudaSuccess) {
		char b[32];
		return errorf(err, errlen, e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO,
			      "the prefill copy of a split FFN's CPU rows (%s): %s", format_size(most, b, sizeof(b)),
			      cudaGetErrorString(e));
	}
	w->st.side_bytes = most;
	return 0;
}

void gw_split_destroy(struct gpu_window *w)
{
	if (w->side_stream) {
		cudaStreamSynchronize(w->side_stream);
		cudaStreamDestroy(w->side_stream);
		w->side_stream = NULL;
	}
	if (w->side_h2d)
		cudaEventDestroy(w->side_h2d);
	if (w->side_done)
		cudaEventDestroy(w->side_done);
	if (w->cpu_done)
		cudaEventDestroy(w->cpu_done);
	w->side_h2d = w->side_done = w->cpu_done = NULL;
	cudaFree(w->side_mem);
	w->side_mem = NULL;
}

/* ---- the token path ---- */

/* Queues the copy of group g's CPU rows into side_mem, behind the compute that last read it. */
static int issue_side(struct gpu_window *w, uint32_t g)
{
	if (w->side_recorded)
		SPLIT_TRY(cudaStreamWaitEvent(w->side_stream, w->side_done, 0),
			  "ordering a prefill copy after compute");
	int rc = gw_copy_pieces(w, g, true, w->side_mem, w->side_off, ring_source_group_base(w->ring, g),
				w->side_stream);
	if (rc)
		return rc;
	SPLIT_TRY(cudaEventRecord(w->side_h2d, w->side_stream), "recording a prefill copy");
	w->side_group = g;
	w->st.side_copies++;
	w->st.side_bytes_h2d += w->base.groups[g].tensor_bytes - w->copy_bytes[g];
	return 0;
}

uint64_t gw_copy_bytes(const struct gpu_window *w, uint32_t g)
{
	if (!gw_expert_split(w, g))
		return w->copy_bytes[g];
	const struct group_desc *gd = &w->base.groups[g];
	uint64_t bytes = 0;
	for (uint32_t i = 0; i < gd->n_tensors; i++) {
		struct gw_piece pc = gw_piece(w, g, gd->first_tensor + i, false);
		bytes += pc.width * pc.height;
	}
	return bytes;
}

/* The CPU's share of an expert split by its route: rows [r, F) in the ring in place (pinned:
 * gw_route splits no other). */
static int expert_cpu_share(struct gpu_window *w, uint32_t g, struct ffn_split *share)
{
	const void *base = ring_source_group_base(w->ring, g);
	if (!base)
		return errorf(w->base.error, sizeof(w->base.error), -EPROTO,
			      "weight window: expert group %u, split with the CPU, is not in DRAM", g);
	struct group_weights hw;
	weights_fill(&w->base, g, base, NULL, &hw);
	weights_split_expert(&hw, w->split_r[g], FFN_SPLIT_CPU);
	*share = hw.split;
	w->host_reads = true; /* the pool reads the ring until the layer's end */
	return 0;
}

/* A split group's device tensors narrowed to the GPU's share as its copy laid it out
 * (gw_copy_pieces): gate's and up's first r rows in place, down's first r columns packed (rows of r
 * columns). */
static void first_share(struct group_weights *gw, enum tensor_role gr, enum tensor_role ur, enum tensor_role dr,
			uint32_t r)
{
	struct weight_tensor *gt = &gw->t[gr], *ut = &gw->t[ur], *dt = &gw->t[dr];
	gt->rows = ut->rows = r;
	dt->cols = r;
	dt->row_bytes = dtype_row_bytes((enum dtype)dt->format, r);
}

static int expert_split_fill(struct gpu_window *w, uint32_t g, struct group_weights *gw)
{
	first_share(gw, ROLE_EXPERT_GATE, ROLE_EXPERT_UP, ROLE_EXPERT_DOWN, w->split_r[g]);
	return expert_cpu_share(w, g, &gw->split);
}

int gw_share_host(struct weight_source *ws, uint32_t g, struct ffn_split *share)
{
	struct gpu_window *w = (struct gpu_window *)ws;
	if (g >= ws->n_groups || ws->groups[g].kind != GROUP_EXPERT || !w->routing ||
	    ws->groups[g].layer != w->routed_layer)
		return errorf(ws->error, sizeof(ws->error), -EPROTO,
			      "weight window: group %u is not an expert group of the layer routed last", g);
	if (!gw_expert_split(w, g))
		return 0;
	int rc = expert_cpu_share(w, g, share);
	return rc ? rc : 1;
}

int gw_split_fill(struct gpu_window *w, uint32_t g, struct group_weights *gw)
{
	if (gw_expert_split(w, g))
		return expert_split_fill(w, g, gw);
	if (!is_split(w, g))
		return 0;
	const uint32_t ffn = w->base.cfg->ffn_dim, r = w->split_r[g];
	first_share(gw, ROLE_W_GATE, ROLE_W_UP, ROLE_W_DOWN, r);
	if (w->base.step_tokens <= w->plan.max_tokens) {
		/* Decode: the CPU reads the rest in place (a pinned group: always there). */
		struct group_weights hw;
		weights_fill(&w->base, g, ring_source_group_base(w->ring, g), NULL, &hw);
		weights_split_ffn(&hw, r, FFN_SPLIT_CPU);
		gw->split = hw.split;
		w->st.cpu_shares++;
		return 0;
	}
	/* Prefill: the rest from side_mem, copied now unless it came ahead. */
	if (w->side_group != g) {
		int rc = issue_side(w, g);
		if (rc)
			return rc;
	}
	SPLIT_TRY(cudaStreamWaitEvent(w->compute, w->side_h2d, 0), "ordering compute after a prefill copy");
	struct ffn_split *s = &gw->split;
	memset(s, 0, sizeof(*s));
	s->where = FFN_SPLIT_BACKEND;
	s->r = r;
	const struct tensor_desc *tg = find(w, g, ROLE_W_GATE), *tu = find(w, g, ROLE_W_UP);
	const struct tensor_desc *td = find(w, g, ROLE_W_DOWN);
	const char *base = w->side_mem;
	weight_tensor_from_desc(&s->gate, tg, PLACE_DEVICE, base + w->side_off[tg - w->base.tensors]);
	weight_tensor_from_desc(&s->up, tu, PLACE_DEVICE, base + w->side_off[tu - w->base.tensors]);
	weight_tensor_from_desc(&s->down, td, PLACE_DEVICE, base + w->side_off[td - w->base.tensors]);
	s->gate.row0 = s->up.row0 = r;
	s->gate.rows = s->up.rows = ffn - r;
	s->down.col0 = r;
	s->down.cols = ffn - r;
	s->down.row_bytes = dtype_row_bytes((enum dtype)td->dtype, ffn - r);
	w->side_user = g;
	return 0;
}

int gw_split_release(struct gpu_window *w, uint32_t g)
{
	if (!is_split(w, g))
		return 0;
	if (w->side_user != g) {
		SPLIT_TRY(cudaEventRecord(w->cpu_done, w->compute), "recording the CPU share's end");
		w->cpu_recorded = true;
		return 0;
	}
	SPLIT_TRY(cudaEventRecord(w->side_done, w->compute), "recording a prefill copy's use");
	w->side_recorded = true;
	w->side_user = NO_GROUP;
	/* The next split FFN of this step starts copying now, during the layers between. */
	for (uint32_t n = g + 1; n < w->base.n_groups; n++)
		if (is_split(w, n))
			return issue_side(w, n);
	return 0;
}

bool gw_split_reads_ring(const struct gpu_window *w)
{
	if (w->cpu_recorded && cudaEventQuery(w->cpu_done) == cudaErrorNotReady)
		return true;
	return w->side_group != NO_GROUP && cudaEventQuery(w->side_h2d) == cudaErrorNotReady;
}

/* ---- what it says ---- */

void gw_split_describe(const struct gpu_window *w, char *buf, size_t len)
{
	if (!w->plan.split_layers) {
		char e[32];
		if (w->st.expert_cpu_bytes_per_token)
			snprintf(buf, len, "; no FFN splits with the CPU; routed experts on the CPU: %s per decode token "
				 "expected (%.1f ms at %.1f GB/s %s)", format_size(w->st.expert_cpu_bytes_per_token, e, sizeof(e)),
				 w->st.cpu_ms, w->cpu_rate[w->moe_format] / 1e9, dtype_name((enum dtype)w->moe_format));
		else
			snprintf(buf, len, "; no FFN splits with the CPU");
		return;
	}
	char cpu[32], side[32], rates[160] = "";
	size_t k = 0;
	for (uint32_t f = 0; f < DT_COUNT && k < sizeof(rates); f++)
		if (w->cpu_rate[f] > 0)
			k += (size_t)snprintf(rates + k, sizeof(rates) - k, "%s%s %.1f GB/s", k ? ", " : " (measured: ",
					      dtype_name((enum dtype)f), w->cpu_rate[f] / 1e9);
	if (k && k + 1 < sizeof(rates))
		strcat(rates, ")");
	char gaps[96] = "";
	if (w->st.split_gaps_ms > 0)
		snprintf(gaps, sizeof(gaps), ", less as the GPU's work between them takes %.1f ms of the link's time",
			 w->st.split_gaps_ms);
	snprintf(buf, len,
		 "; %u FFN groups split with the CPU at r %u..%u of %u (%.0f%% of their rows on the CPU): %s read by "
		 "the CPU per decode token, %.1f ms%s%s; steps of up to %u token%s use it, longer ones copy the CPU "
		 "rows up (%s buffer)%s", w->plan.split_layers, w->plan.r_min, w->plan.r_max, w->base.cfg->ffn_dim,
		 100.0 * (1.0 - (double)(w->plan.r_min + w->plan.r_max) / 2 / w->base.cfg->ffn_dim),
		 format_size(w->plan.cpu_bytes, cpu, sizeof(cpu)), w->plan.cpu_s * 1e3, rates, gaps, w->plan.max_tokens,
		 w->plan.max_tokens == 1 ? "" : "s", format_size(w->st.side_bytes, side, sizeof(side)),
		 w->st.split_balance_token ? "; one share for every FFN (each layer's own did not fit the budget)" : "");
}

uint32_t gpu_window_split_r(const struct gpu_window *w, uint32_t g)
{
	return g < w->base.n_groups && w->split_r ? w->split_r[g] : w->base.cfg->ffn_dim;
}

double gpu_window_cpu_rate(const struct gpu_window *w, enum dtype f)
{
	return (unsigned)f < DT_COUNT ? w->cpu_rate[f] : 0;
}

void gpu_window_set_expert_rate(struct gpu_window *w, double bytes_per_s, double multi_bytes_per_s, double lead_s)
{
	w->st.expert_rate_jobs = bytes_per_s > 0 ? bytes_per_s : 0;
	w->st.expert_rate_jobs_multi = multi_bytes_per_s > 0 ? multi_bytes_per_s : 0;
	w->st.expert_lead_ms = lead_s > 0 ? lead_s * 1e3 : 0;
}

double gpu_window_expert_rate(const struct gpu_window *w, uint32_t tokens)
{
	if (tokens > 1 && w->st.expert_rate_jobs_multi > 0)
		return w->st.expert_rate_jobs_multi;
	return w->st.expert_rate_jobs > 0 ? w->st.expert_rate_jobs : w->cpu_rate[w->moe_format];
}

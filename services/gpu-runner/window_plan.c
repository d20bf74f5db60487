/* window_plan.c - the GPU weight window's plan (window_plan.h). */
#include "services/gpu-runner/window_plan.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* An expert group and what keeping it is worth. */
struct candidate {
	float heat;
	uint32_t g;
};

/* Hottest first; equal heat in table order (so with none known, layer after layer). */
static int by_heat(const void *pa, const void *pb)
{
	const struct candidate *a = pa, *b = pb;
	if (a->heat != b->heat)
		return a->heat > b->heat ? -1 : 1;
	return a->g < b->g ? -1 : a->g > b->g;
}

static uint64_t min_u64(uint64_t a, uint64_t b)
{
	return a < b ? a : b;
}

/* The stage's layers [*l0, *l1): all of cfg's where stage is NULL or not split. */
static void stage_layers(const struct model_config *cfg, const struct weight_stage *stage, uint32_t *l0, uint32_t *l1)
{
	const bool split = stage && stage->split;
	*l0 = split ? stage->layer0 : 0;
	*l1 = split ? stage->layer1 : cfg->n_layers;
}

int window_plan(const struct model_config *cfg, const struct group_desc *groups, uint32_t n_groups,
		const struct weight_stage *stage, uint64_t budget, uint32_t depth, uint32_t xdepth, const float *heat,
		bool *resident, struct window_plan *out, char *err, size_t errlen)
{
	memset(out, 0, sizeof(*out));
	memset(resident, 0, n_groups * sizeof(bool));
	const struct weight_stage whole = {0};
	if (!stage)
		stage = &whole;
	/* The stage's layers l0 .. l0 + L - 1, and the head when it has it. */
	const bool head = !stage->split || stage->first;
	uint32_t l0, l1;
	stage_layers(cfg, stage, &l0, &l1);
	const uint32_t L = l1 - l0;
	const uint32_t E = cfg->n_experts;
	if (group_id_head(cfg) >= n_groups || (L && model_group_ffn(cfg, l0 + L - 1) >= n_groups) ||
	    (L && E && model_group_expert(cfg, l0 + L - 1, E - 1) >= n_groups))
		return errorf(err, errlen, -EINVAL, "window plan: %u groups do not hold the model's %u layers", n_groups,
			      cfg->n_layers);
	const uint64_t globals =
		head ? groups[group_id_head(cfg)].slot_bytes + (cfg->tie_embeddings ? groups[group_id_embed()].slot_bytes : 0)
		     : 0;
	/* The largest attention, FFN (router) and expert group of the stage. */
	uint64_t a = 0, f = 0, x = 0, all_x = 0;
	for (uint32_t l = l0; l < l0 + L; l++) {
		a = groups[model_group_attn(cfg, l)].slot_bytes > a ? groups[model_group_attn(cfg, l)].slot_bytes : a;
		f = groups[model_group_ffn(cfg, l)].slot_bytes > f ? groups[model_group_ffn(cfg, l)].slot_bytes : f;
		for (uint32_t e = 0; e < E; e++) {
			uint64_t b = groups[model_group_expert(cfg, l, e)].slot_bytes;
			x = b > x ? b : x;
			all_x += b;
		}
	}
	const uint32_t n_exp = L * E;
	out->experts = n_exp;
	if (depth < 1)
		depth = 1;
	if (xdepth < 1)
		xdepth = 1;
	/* Experts stream through their own slots (unless every one is kept: below). */
	const uint64_t win_x = n_exp ? min_u64(n_exp, xdepth) * x : 0;
	/* The layer groups every token reads: na attention and nf FFN groups kept, from the stage's
	 * first layer, the rest through their slots; the split that keeps the most bytes. */
	uint64_t best = 0, best_win = 0;
	int64_t best_na = -1, best_nf = -1;
	for (uint32_t na = 0; na <= L; na++) {
		for (int64_t nf = L; nf >= 0; nf--) {
			uint32_t sa = L - na, sf = L - (uint32_t)nf;
			uint64_t win = (sa ? min_u64(sa, depth) * a : 0) + (sf ? min_u64(sf, depth) * f : 0) + win_x;
			uint64_t res = (uint64_t)na * a + (uint64_t)nf * f;
			if (globals + res + win > budget)
				continue;
			if (best_na < 0 || res > best) {
				best = res;
				best_win = win;
				best_na = na;
				best_nf = nf;
			}
			break; /* the largest nf for this na */
		}
	}
	out->need = globals + (L ? (uint64_t)depth * (a + f) : 0) + (n_exp ? (uint64_t)xdepth * x : 0);
	if (best_na < 0) {
		char b[32], n[32];
		return errorf(err, errlen, -ENOSPC,
			      "--gpu-budget %s is too small: %s%u slot%s of each streamed layer group%s need %s (%llu bytes)",
			      format_size(budget, b, sizeof(b)),
			      !head ? "" : cfg->tie_embeddings ? "the head group with the tied embedding and " : "the head group and ",
			      depth, depth == 1 ? "" : "s", n_exp ? (xdepth == depth ? " and of the experts" : " and the experts' slots") : "",
			      format_size(out->need, n, sizeof(n)), (unsigned long long)out->need);
	}
	if (head) {
		resident[group_id_head(cfg)] = true;
		if (cfg->tie_embeddings)
			resident[group_id_embed()] = true;
	}
	uint64_t kept = globals, slots = best_win;
	for (uint32_t l = l0; l < l0 + L; l++) {
		uint32_t ga = model_group_attn(cfg, l), gf = model_group_ffn(cfg, l);
		resident[ga] = l - l0 < (uint32_t)best_na;
		resident[gf] = l - l0 < (uint32_t)best_nf;
		kept += resident[ga] ? groups[ga].slot_bytes : 0;
		kept += resident[gf] ? groups[gf].slot_bytes : 0;
		out->streamed_bytes += resident[ga] ? 0 : groups[ga].slot_bytes;
		out->streamed_bytes += resident[gf] ? 0 : groups[gf].slot_bytes;
	}
	if (n_exp) {
		/* What is left beside the slots goes to experts, hottest first; if all of them fit in it and
		 * their slots, none streams. The room counts the kept layer groups as the loop above did
		 * (each its class's largest), which is never less than they take. */
		uint64_t room = budget - (globals + best) - slots;
		double heat_sum = 0, heat_kept = 0;
		struct candidate *c = malloc(n_exp * sizeof(*c));
		if (!c)
			return errorf(err, errlen, -ENOMEM, "out of memory");
		uint32_t k = 0;
		for (uint32_t l = l0; l < l0 + L; l++)
			for (uint32_t e = 0; e < E; e++) {
				float h = heat ? heat[(size_t)l * E + e] : 0.0f;
				c[k++] = (struct candidate){.heat = h > 0 ? h : 0.0f, .g = model_group_expert(cfg, l, e)};
				heat_sum += h > 0 ? h : 0.0f;
			}
		bool all = all_x <= room + win_x;
		if (!all)
			qsort(c, n_exp, sizeof(*c), by_heat);
		else
			slots -= win_x;
		for (uint32_t i = 0; i < n_exp; i++) {
			uint64_t b = groups[c[i].g].slot_bytes;
			if (!all && b > room)
				continue;
			room -= all ? 0 : b;
			resident[c[i].g] = true;
			out->experts_resident++;
			out->expert_bytes_resident += b;
			heat_kept += c[i].heat;
		}
		free(c);
		kept += out->expert_bytes_resident;
		out->expert_heat_resident = heat_sum > 0 ? heat_kept / heat_sum : (double)out->experts_resident / n_exp;
	}
	out->resident_bytes = kept;
	out->slot_bytes = slots;
	return 0;
}

bool window_plan_spread(const struct model_config *cfg, const struct weight_stage *stage, bool *resident,
			bool attn_kept)
{
	if (attn_kept && !window_plan_attn_kept(cfg, stage, resident))
		return false;
	uint32_t l0, l1;
	stage_layers(cfg, stage, &l0, &l1);
	const uint32_t L = l1 - l0;
	uint32_t na = 0, nf = 0;
	for (uint32_t i = 0; i < L; i++) {
		na += resident[model_group_attn(cfg, l0 + i)];
		nf += resident[model_group_ffn(cfg, l0 + i)];
	}
	bool moved = false;
	for (uint32_t i = 0; i < L; i++) {
		const uint32_t ga = model_group_attn(cfg, l0 + i), gf = model_group_ffn(cfg, l0 + i);
		const bool ka = (uint64_t)(i + 1) * na / L > (uint64_t)i * na / L;
		const bool kf = (uint64_t)(i + 1) * nf / L > (uint64_t)i * nf / L;
		moved |= resident[ga] != ka || resident[gf] != kf;
		resident[ga] = ka;
		resident[gf] = kf;
	}
	return moved;
}

bool window_plan_attn_kept(const struct model_config *cfg, const struct weight_stage *stage, const bool *resident)
{
	uint32_t l0, l1;
	stage_layers(cfg, stage, &l0, &l1);
	for (uint32_t l = l0; l < l1; l++)
		if (!resident[model_group_attn(cfg, l)])
			return false;
	return true;
}

void window_heat_fold(float *heat, uint32_t *weight, const uint32_t *routed, const uint32_t *steps, uint32_t n_layers,
		      uint32_t n_experts, uint32_t cap)
{
	for (uint32_t l = 0; l < n_layers; l++) {
		if (!steps[l])
			continue;
		double w = weight[l] < cap ? weight[l] : cap, n = steps[l];
		for (uint32_t e = 0; e < n_experts; e++) {
			size_t i = (size_t)l * n_experts + e;
			heat[i] = (float)(((double)heat[i] * w + routed[i]) / (w + n));
		}
		uint64_t sum = (uint64_t)w + steps[l];
		weight[l] = sum < cap ? (uint32_t)sum : cap;
	}
}

uint32_t window_expert_depth(const struct model_config *cfg, uint32_t depth, uint32_t expert_depth)
{
	if (expert_depth)
		return expert_depth;
	depth = depth ? depth : 1;
	return cfg->n_experts_used > depth ? cfg->n_experts_used : depth;
}

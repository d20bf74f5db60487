/* plan.c - the split of a model's layers between stages (plan.h). */
#include "services/gpu-runner/stages/plan.h"
#include "services/gpu-runner/window_plan.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

#define DEFAULT_H2D 50e9
#define DEFAULT_HBM 2.7e12

struct range_cost {
	uint64_t bytes, streamed;
	double ms;
};

/* The cost of layers [a, b) on rank r (plan.h). */
static struct range_cost cost(const struct model_config *cfg, const struct group_desc *groups, uint32_t n_groups,
			      const struct stage_plan_params *p, uint32_t a, uint32_t b, uint32_t r)
{
	uint64_t bytes = 0, head = 0, big[CLASS_COUNT] = {0};
	for (uint32_t g = 0; g < n_groups; g++) {
		const struct group_desc *gd = &groups[g];
		if (gd->kind == GROUP_HEAD) {
			if (r == 0)
				head += gd->slot_bytes + (cfg->tie_embeddings ? groups[0].slot_bytes : 0);
			continue;
		}
		if (gd->kind == GROUP_EMBED || gd->layer < a || gd->layer >= b)
			continue;
		bytes += gd->slot_bytes;
		if (gd->size_class < CLASS_COUNT && gd->slot_bytes > big[gd->size_class])
			big[gd->size_class] = gd->slot_bytes;
	}
	struct range_cost c = {.bytes = bytes + head};
	double h2d = p->h2d_bps > 0 ? p->h2d_bps : DEFAULT_H2D, hbm = p->hbm_bps > 0 ? p->hbm_bps : DEFAULT_HBM;
	if (p->budget) {
		uint64_t window = 0;
		const uint32_t depth = p->depth ? p->depth : 2;
		for (uint32_t k = 0; k < CLASS_COUNT; k++)
			window += (uint64_t)(k == CLASS_EXPERT ? window_expert_depth(cfg, depth, p->expert_depth) : depth) *
				  big[k];
		uint64_t room = p->budget > head + window ? p->budget - head - window : 0;
		c.streamed = bytes > room ? bytes - room : 0;
	}
	double copy = (double)c.streamed / h2d * 1e3, read = (double)c.bytes / hbm * 1e3;
	c.ms = copy > read ? copy : read;
	return c;
}

static void fill(struct stage_plan *out, const struct model_config *cfg, const struct group_desc *groups,
		 uint32_t n_groups, const struct stage_plan_params *p, const uint32_t *first)
{
	out->ranks = p->ranks;
	for (uint32_t r = 0; r < p->ranks; r++) {
		out->layer0[r] = r ? first[r - 1] : 0;
		out->layer1[r] = r + 1 < p->ranks ? first[r] : cfg->n_layers;
		struct range_cost c = cost(cfg, groups, n_groups, p, out->layer0[r], out->layer1[r], r);
		out->bytes[r] = c.bytes;
		out->streamed[r] = c.streamed;
		out->ms[r] = c.ms;
	}
}

int stage_plan_make(const struct model_config *cfg, const struct group_desc *groups, uint32_t n_groups,
		    const struct stage_plan_params *p, struct stage_plan *out, char *err, size_t errlen)
{
	const uint32_t L = cfg->n_layers, R = p->ranks;
	memset(out, 0, sizeof(*out));
	if (R < 1 || R > STAGE_MAX_RANKS)
		return errorf(err, errlen, -EINVAL, "%u stages: 1..%d", R, STAGE_MAX_RANKS);
	if (L < R)
		return errorf(err, errlen, -EINVAL, "a model of %u layers cannot be split across %u runners", L, R);
	if (p->split) {
		for (uint32_t r = 1; r < R; r++) {
			uint32_t lo = r == 1 ? 0 : p->split[r - 2];
			if (p->split[r - 1] <= lo || p->split[r - 1] >= L)
				return errorf(err, errlen, -EINVAL, "the split gives stage %u layer %u: each stage's first "
					      "layer must come after the one before's, and below %u", r, p->split[r - 1], L);
		}
		fill(out, cfg, groups, n_groups, p, p->split);
		return 0;
	}
	/* best[r][b]: the best split of layers [0, b) over ranks 0..r (the largest time, then the sum of
	 * squared times); from[r][b]: where rank r's range starts in it. */
	size_t cells = (size_t)R * (L + 1);
	double *worst = malloc(cells * sizeof(double)), *sq = malloc(cells * sizeof(double));
	uint32_t *from = malloc(cells * sizeof(uint32_t));
	if (!worst || !sq || !from) {
		free(worst);
		free(sq);
		free(from);
		return errorf(err, errlen, -ENOMEM, "out of memory");
	}
#define AT(r, b) ((size_t)(r) * (L + 1) + (b))
	for (size_t i = 0; i < cells; i++)
		worst[i] = -1;
	for (uint32_t b = 1; b <= L; b++) {
		double ms = cost(cfg, groups, n_groups, p, 0, b, 0).ms;
		worst[AT(0, b)] = ms;
		sq[AT(0, b)] = ms * ms;
		from[AT(0, b)] = 0;
	}
	for (uint32_t r = 1; r < R; r++)
		for (uint32_t b = r + 1; b <= L; b++)
			for (uint32_t a = r; a < b; a++) {
				if (worst[AT(r - 1, a)] < 0)
					continue;
				double ms = cost(cfg, groups, n_groups, p, a, b, r).ms;
				double w = worst[AT(r - 1, a)] > ms ? worst[AT(r - 1, a)] : ms;
				double s = sq[AT(r - 1, a)] + ms * ms;
				double *bw = &worst[AT(r, b)];
				if (*bw < 0 || w < *bw * (1 - 1e-9) || (w <= *bw * (1 + 1e-9) && s < sq[AT(r, b)])) {
					*bw = w;
					sq[AT(r, b)] = s;
					from[AT(r, b)] = a;
				}
			}
	uint32_t first[STAGE_MAX_RANKS];
	for (uint32_t r = R - 1, b = L; r > 0; r--) {
		first[r - 1] = from[AT(r, b)];
		b = first[r - 1];
	}
#undef AT
	free(worst);
	free(sq);
	free(from);
	fill(out, cfg, groups, n_groups, p, first);
	return 0;
}

void stage_plan_describe(const struct stage_plan *plan, char *buf, size_t len)
{
	size_t k = 0;
	buf[0] = 0;
	for (uint32_t r = 0; r < plan->ranks && k < len; r++) {
		char b[32], s[32];
		int w = snprintf(buf + k, len - k, "%sstage %u: layers %u..%u (%s, %s streamed, %.1f ms)", r ? " | " : "",
				 r, plan->layer0[r], plan->layer1[r] - 1, format_size(plan->bytes[r], b, sizeof(b)),
				 format_size(plan->streamed[r], s, sizeof(s)), plan->ms[r]);
		if (w < 0)
			break;
		k += (size_t)w;
	}
}

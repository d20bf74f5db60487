/* plan.h - where a model's layers are split between the stages of a split model (stages.h): each rank
 * takes a contiguous range, rank 0 the first (with the embedding and the head).
 *
 * A range costs its rank the time of its bytes: those that stay resident read once from device memory
 * (hbm_bps), those that do not fit its budget beside its streaming slots copied over its own link
 * (h2d_bps) as they are read. The split minimises the largest rank's time (batched steps run as fast
 * as the slowest stage), ties going to the split whose times are closest. With budget 0 (the C backend
 * reads the ring in place) a range costs its bytes. */
#ifndef GPU_RUNNER_STAGES_PLAN_H
#define GPU_RUNNER_STAGES_PLAN_H
#include <stddef.h>
#include <stdint.h>

#include "common/model.h"
#include "common/protocol.h"
#ifdef __cplusplus
extern "C" {
#endif

struct stage_plan_params {
	uint32_t ranks;		/* 1..STAGE_MAX_RANKS */
	uint64_t budget;	/* device bytes for weights on each rank; 0: none (weights read in place) */
	uint32_t depth;		/* streaming slots per layer group class (the GPU window's --prefetch-depth) */
	uint32_t expert_depth;	/* the experts' (--expert-depth; 0: window_expert_depth's choice) */
	double h2d_bps, hbm_bps; /* each rank's link and device memory (0: a default) */
	const uint32_t *split;	/* given: the first layer of ranks 1..ranks-1, increasing (NULL: plan) */
};

struct stage_plan {
	uint32_t ranks;
	uint32_t layer0[STAGE_MAX_RANKS], layer1[STAGE_MAX_RANKS]; /* rank r computes [layer0, layer1) */
	uint64_t bytes[STAGE_MAX_RANKS];    /* weight bytes each rank computes from (rank 0: the head's too) */
	uint64_t streamed[STAGE_MAX_RANKS]; /* of those, copied per token (what its budget does not hold) */
	double ms[STAGE_MAX_RANKS];	    /* its predicted time per decode token */
};

/* Plans (or checks a given split) for cfg's groups. Returns 0, or -EINVAL with err set (fewer layers
 * than ranks, a given split out of order or out of range). */
int stage_plan_make(const struct model_config *cfg, const struct group_desc *groups, uint32_t n_groups,
		    const struct stage_plan_params *p, struct stage_plan *out, char *err, size_t errlen);
/* "layers 0..13 (6.9 GiB, 3.1 GiB streamed, 58.2 ms) | 14..31 (...)" into buf. */
void stage_plan_describe(const struct stage_plan *plan, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif

/* window_plan.h - what the GPU weight window (gpu_window.h) keeps on the device for good under
 * --gpu-budget, and what it streams: plain C over a model's group table, so tests and the
 * benchmark's predictions run it without a GPU.
 *
 * In order of the bytes a decode token reads per byte kept:
 *  1. the head group (final norm and lm_head; with tied embeddings the embedding table too);
 *  2. the layer groups every token reads: attention groups and FFN groups (a mixture of experts'
 *     router group in the FFN's place), as many of each as fit beside the streaming slots, the
 *     split between the two the one that keeps the most bytes (layers from the stage's first);
 *  3. for a mixture of experts, experts: a token reads an expert only when its routing chooses
 *     it, so expert e of layer l is worth heat[l][e] (the share of decode steps whose routing
 *     chose it, counted by the runner), and they are kept hottest first while they fit. With no
 *     heat known every expert is worth the same, and they are kept in table order.
 * Each layer size class that streams has min(depth, groups of the class that stream) slots of its
 * largest streamed group, the experts' class min(xdepth, ...); a class with nothing streamed has
 * none.
 *
 *   bool *resident = calloc(n_groups, 1);
 *   struct window_plan p;
 *   rc = window_plan(cfg, groups, n_groups, &stage, budget, depth, xdepth, heat, resident, &p, err,
 *                   sizeof(err));
 *
 * groups[g].slot_bytes are the bytes group g takes on the device (the window's own layout).
 */
#ifndef GPU_RUNNER_WINDOW_PLAN_H
#define GPU_RUNNER_WINDOW_PLAN_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/model.h"
#include "services/gpu-runner/weights.h"
#ifdef __cplusplus
extern "C" {
#endif

struct window_plan {
	uint64_t need;		 /* the least budget: the head group and the slots of each streamed class */
	uint64_t resident_bytes; /* device bytes kept for good, the head group's included */
	uint64_t slot_bytes;	 /* device bytes of the streaming slots */
	uint64_t streamed_bytes; /* bytes of the streamed layer groups a token reads (every attention and
				  * FFN group that streams; experts not counted: routing picks them) */
	uint32_t experts, experts_resident; /* the stage's expert groups, and those kept */
	uint64_t expert_bytes_resident;
	double expert_heat_resident; /* of the stage's heat, the share the kept experts hold (0..1; with
				      * no heat known, the share of experts kept) */
};

/* Plans the window of stage (NULL: every layer and the head) under budget with depth (>= 1) slots
 * per streamed layer class and xdepth (>= 1; window_expert_depth) for the experts. heat:
 * (n_layers, n_experts) shares of decode steps, or NULL (none known); ignored for a dense model. resident (n_groups) is set for the groups kept. Returns 0, or
 * -ENOSPC with err naming the budget needed in bytes. */
int window_plan(const struct model_config *cfg, const struct group_desc *groups, uint32_t n_groups,
		const struct weight_stage *stage, uint64_t budget, uint32_t depth, uint32_t xdepth, const float *heat,
		bool *resident, struct window_plan *out, char *err, size_t errlen);

/* The experts' slots: expert_depth where given (> 0), else the larger of depth and the experts a
 * layer's routing chooses (n_experts_used). A decode step copies its guesses of a layer's experts
 * before that layer's route (--predict-experts), so the slots bound how many of a layer's experts
 * can be on their way at once: with two slots, about one expert a layer was copied where the
 * balance with the CPU asked for three or four (docs/design.md, "How deep the experts' slots"). */
uint32_t window_expert_depth(const struct model_config *cfg, uint32_t depth, uint32_t expert_depth);

/* Places the attention and the FFN groups that plan kept (resident) evenly among the stage's layers
 * instead of from its first (--window-spread): as many of each kind as before, so the same bytes
 * and slots where every layer's groups of a kind are alike. The window copies a streamed group
 * only its depth of groups ahead, so with the streamed layers all at the end the link idles
 * while the resident layers compute, and then the streamed ones have no slack; spread, each
 * streamed layer's copy runs beside the resident layers before it. Kept groups of kind a and f
 * go to layers where (i + 1) k / L passes a whole number (i the layer's place, k the kept count).
 * With attn_kept (--window-spread auto), only where resident keeps every attention group of the
 * stage (window_plan_attn_kept); else nothing moves.
 * Returns whether any group moved (not when every group of a kind is kept or streamed). */
bool window_plan_spread(const struct model_config *cfg, const struct weight_stage *stage, bool *resident,
			bool attn_kept);

/* Whether resident keeps every attention group of the stage's layers. */
bool window_plan_attn_kept(const struct model_config *cfg, const struct weight_stage *stage, const bool *resident);

/* Folds the routing counts of decode steps (engine_moe_routing: routed (n_layers, n_experts), steps
 * (n_layers)) into heat (n_layers, n_experts): each expert's share of its layer's steps, averaged
 * with what heat held, worth weight[l] steps (at most cap: older routing fades). weight (n_layers)
 * is updated. A layer with no steps keeps its heat. */
void window_heat_fold(float *heat, uint32_t *weight, const uint32_t *routed, const uint32_t *steps, uint32_t n_layers,
		      uint32_t n_experts, uint32_t cap);

#ifdef __cplusplus
}
#endif
#endif

/* experts.c - hot experts on the GPU: the routing the engines counted (engine_moe_routing), folded
 * into each expert's heat (its share of the decode steps whose routing chose it; window_plan.h),
 * and the GPU window made anew between requests, never in the middle of a step, when a plan made
 * from the heat would keep experts that take a larger share of the routing than those it keeps.
 *
 * The first window of a model with experts knows no routing and keeps experts in table order (every
 * expert is worth the same then). Once REPLAN_MIN_STEPS decode steps have been counted, each idle
 * moment between requests asks the window what a plan from the heat would keep: a gain of at least
 * REPLAN_MIN_GAIN of the routing makes the window (and the engine over it) anew, its resident
 * groups copied again. Old routing fades: the heat stands for at most HEAT_CAP_STEPS steps. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/runner.h"
#include "services/gpu-runner/window_plan.h"
#include "services/gpu-runner/weights_ring.h"
#ifdef PIPELINE_HAVE_CUDA
#include "services/gpu-runner/gpu_window.h"
#endif

#define REPLAN_MIN_STEPS 32
#define REPLAN_MIN_GAIN 0.05
#define HEAT_CAP_STEPS 4096

/* heat and its weights made, zero. Returns false when out of memory. */
static bool heat_alloc(struct runner *r)
{
	const uint32_t L = r->cfg.n_layers, E = r->cfg.n_experts;
	if (r->expert_heat)
		return true;
	r->expert_heat = calloc((size_t)L * E, sizeof(float));
	r->heat_weight = calloc(L, sizeof(uint32_t));
	if (r->expert_heat && r->heat_weight)
		return true;
	free(r->expert_heat);
	free(r->heat_weight);
	r->expert_heat = NULL;
	r->heat_weight = NULL;
	return false;
}

/* The decode steps the engine counted (the most through any layer). */
static uint32_t counted_steps(const struct runner *r, const uint32_t **routed, const uint32_t **steps)
{
	*routed = *steps = NULL;
	if (!r->engine || !r->cfg.n_experts)
		return 0;
	engine_moe_routing(r->engine, routed, steps);
	uint32_t most = 0;
	for (uint32_t l = 0; *steps && l < r->cfg.n_layers; l++)
		most = (*steps)[l] > most ? (*steps)[l] : most;
	return *routed ? most : 0;
}

void runner_fold_routing(struct runner *r)
{
	const uint32_t *routed, *steps;
	if (!counted_steps(r, &routed, &steps))
		return;
	if (!heat_alloc(r)) {
		log_warn("out of memory for the experts' heat: the routing of %u layers is not counted",
			 r->cfg.n_layers);
		return;
	}
	window_heat_fold(r->expert_heat, r->heat_weight, routed, steps, r->cfg.n_layers, r->cfg.n_experts,
			 HEAT_CAP_STEPS);
}

void runner_replan_experts(struct runner *r)
{
#ifdef PIPELINE_HAVE_CUDA
	const uint32_t L = r->cfg.n_layers, E = r->cfg.n_experts;
	const uint32_t *routed, *steps;
	/* One runner only: a rank of a split model keeps its plan (the others may start a step at any time). */
	/* Nor over a ring whose loader went or moved: runner_ensure_connections starts that over. */
	bool ring_ok = r->ring && ring_source_owner_alive(r->ring) && !ring_source_reconnected(r->ring);
	uint32_t n = r->win && ring_ok && !r->fixed_experts && !r->loader_suspect && r->ranks <= 1 ? counted_steps(r, &routed, &steps) : 0;
	/* The counts change only in a step: an idle loop asks again only after new ones. */
	if (n < REPLAN_MIN_STEPS || n == r->replan_checked)
		return;
	r->replan_checked = n;
	/* The heat as it would be with this engine's counts folded in (they are, when it goes). */
	float *heat = malloc((size_t)L * E * sizeof(float));
	uint32_t *weight = malloc(L * sizeof(uint32_t));
	if (!heat || !weight) {
		free(heat);
		free(weight);
		return;
	}
	if (r->expert_heat) {
		memcpy(heat, r->expert_heat, (size_t)L * E * sizeof(float));
		memcpy(weight, r->heat_weight, L * sizeof(uint32_t));
	} else {
		memset(heat, 0, (size_t)L * E * sizeof(float));
		memset(weight, 0, L * sizeof(uint32_t));
	}
	window_heat_fold(heat, weight, routed, steps, L, E, HEAT_CAP_STEPS);
	double now = 0, planned = 0;
	int rc = gpu_window_expert_gain(r->win, heat, &now, &planned);
	free(heat);
	free(weight);
	if (rc || planned - now < REPLAN_MIN_GAIN)
		return;
	/* Worth a new window: the engine goes first (its counts folded in), then the window it read. */
	log_info("hot experts: after %u decode steps the experts kept on the GPU take %.1f%% of the routing; a new "
		 "plan keeps %.1f%%: making the weight window anew",
		 n, 100.0 * now, 100.0 * planned);
	runner_fold_routing(r);
	if (runner_window_anew(r, "hot experts"))
		r->expert_replans++;
#else
	(void)r;
#endif
}

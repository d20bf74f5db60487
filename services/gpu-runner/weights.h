/* weights.h - where the engine gets a group's weights from.
 *
 * The engine calls acquire(g) right before it computes group g and release(g) right after.
 * Two sources exist:
 *  - the weight ring (weights_ring.c): the ssd-loader's shared-memory ring, through
 *    MSG_W_ACQUIRE/GRANT/RELEASE; when every group is resident they are all acquired once
 *    and per-token calls cost no message at all; otherwise releases are batched into the
 *    next acquire so a token costs one round trip per streamed group.
 *  - memory (tools/run-local): the whole checkpoint read into memory, for the in-process
 *    oracle that integration tests compare the services against.
 *
 *   struct group_weights w;
 *   rc = src->ops->acquire(src, g, &w);  ... compute ...;  src->ops->release(src, g);
 */
#ifndef GPU_RUNNER_WEIGHTS_H
#define GPU_RUNNER_WEIGHTS_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/model.h"
#include "services/gpu-runner/backend.h"
#ifdef __cplusplus
extern "C" {
#endif

struct weight_source;

struct weight_source_ops {
	/* Makes group g readable and fills w with pointers to its tensors (for the head group
	 * with tied embeddings, t[ROLE_LM_HEAD] points at the embedding table, which the source
	 * keeps available too). Blocks until the group is there. Returns 0 or -errno with a
	 * message in the source (weight_source_error). */
	int (*acquire)(struct weight_source *s, uint32_t group, struct group_weights *w);
	/* The engine is done with group g for now. Returns 0 or -errno. */
	int (*release)(struct weight_source *s, uint32_t group);
	/* Hands every group back (end of a request, or before a reconnect). */
	int (*release_all)(struct weight_source *s);
	/* Optional, route and skip both or neither (a source that fetches ahead): the experts of a
	 * mixture-of-experts layer the step uses (used[e] for each of cfg.n_experts, told after the
	 * layer's routing, before its first expert group is acquired), so that the source fetches only
	 * those. The source may set on_cpu[e] for used experts it leaves in host memory for the CPU to
	 * compute (the others false); the engine then takes them with acquire_host. skip(g) stands in
	 * for acquire/release of an expert group the step does not use or leaves for the CPU. Return 0
	 * or -errno with the message in the source. */
	int (*route)(struct weight_source *s, uint32_t layer, const bool *used, bool *on_cpu);
	int (*skip)(struct weight_source *s, uint32_t group);
	/* Optional (a source whose route may set on_cpu): an expert group the layer's route left for
	 * the CPU, at any time between that route and the group's place in the visit order (where the
	 * engine skips it): w gets its tensors in host memory (PLACE_HOST), readable until the engine's
	 * step returns; no release follows. The engine takes them at their visit, or all right after
	 * the route (engine_set_cpu_experts_early), so that the CPU computes them while the window
	 * copies the GPU's experts. */
	int (*acquire_host)(struct weight_source *s, uint32_t group, struct group_weights *w);
	/* Optional (a source whose route may split an expert with the CPU): the CPU's share of expert
	 * group g as its layer's route split it (FFN_SPLIT_CPU: rows [r, F) in host memory in place,
	 * readable until the engine's step returns), at any time between that route and the group's
	 * visit, whose acquire then gives the same split. Returns 1 with *share filled, 0 where the
	 * route did not split g, or -errno with the message in the source. The engine hands the share
	 * to the backend right after the route (engine_set_cpu_experts_early), so that the CPU starts
	 * on it while the window copies the GPU's rows. */
	int (*share_host)(struct weight_source *s, uint32_t group, struct ffn_split *share);
	/* Optional: hands back now what the source holds of the loader's streaming slots without need
	 * (releases held back for the next acquire, the host side of copies done): a stage of a split
	 * model at the end of its layers, so that the next stage's runner finds the slots free while this
	 * one waits. Returns 0 or -errno with the message in the source. */
	int (*flush)(struct weight_source *s);
	/* Optional: the engine's last step failed part way (a kv-store failure the request rebuilds
	 * after, say): whatever it left (groups acquired and not released, a visit stopped in the middle
	 * of the groups, a routing half used) is settled so that the next step visits from the first
	 * group again. The engine calls it before that step. Returns 0 or -errno with the message. */
	int (*reset)(struct weight_source *s);
	/* Optional: does group g stay in device memory for the source's life (acquire gives the same
	 * device addresses every time, copies nothing and waits for nothing)? The engine then may give
	 * the addresses of a layer's experts to the backend once (backend_moe_layer_experts). */
	bool (*kept)(struct weight_source *s, uint32_t group);
};

/* The part of the model a source serves when several runners split the layers between them (the
 * stages, stages/stages.h): layers [layer0, layer1), and the embedding table and the head when first.
 * split false (a zeroed struct): one runner alone, every group. */
struct weight_stage {
	bool split;
	uint32_t layer0, layer1;
	bool first;
};

/* Does group gd belong to stage s? */
static inline bool weight_stage_has(const struct weight_stage *s, const struct group_desc *gd)
{
	if (!s->split)
		return true;
	if (gd->kind == GROUP_EMBED || gd->kind == GROUP_HEAD)
		return s->first;
	return gd->layer >= s->layer0 && gd->layer < s->layer1;
}

/* The common part of every source; implementations embed it first. */
struct weight_source {
	const struct weight_source_ops *ops;
	const struct model_config *cfg;
	const struct tensor_desc *tensors;
	const struct group_desc *groups;
	uint32_t n_tensors, n_groups;
	uint64_t bytes_acquired; /* tensor bytes handed to the engine (what crosses to the device) */
	uint64_t acquires;
	uint32_t step_tokens;	 /* tokens of the step the engine is computing (it sets this before the
				  * step's first acquire): a source that splits FFNs chooses by it */
	/* Set by the engine before each mixture-of-experts layer's route: how the two sides of the layer
	 * routed before it ended (backend_moe_ends; known in one-token steps where the backend
	 * measures it), the GPU's side's end less the CPU's in ns (> 0: the GPU's side, which the
	 * link's copies pace, ended last). A source that balances the two sides learns from it. */
	bool route_ends_known;
	int64_t route_ends_ns;
	struct weight_stage stage; /* the groups it serves; the engine computes only those */
	char error[512];
};

/* Describes tensor t (format and shape from the manifest's table) at data in place. */
void weight_tensor_from_desc(struct weight_tensor *wt, const struct tensor_desc *t, enum weight_place place,
			     const void *data);

/* Fills w from a group's base address in place: tensor i lies at base + offsets[i] (offsets
 * indexed by tensor, NULL: the tensors' slot_offset). lm_head of the tied head group resolves
 * through embed_base, the embed group's base. */
void weights_fill_at(const struct weight_source *s, uint32_t group, enum weight_place place, const void *base,
		     const uint64_t *offsets, const void *embed_base, struct group_weights *w);

/* Rows [r0, r0 + n) of the whole tensor t (at every place it has), into out. */
void weight_tensor_rows(const struct weight_tensor *t, uint32_t r0, uint32_t n, struct weight_tensor *out);
/* Columns [c0, c0 + n) of every row of the whole tensor t (c0 on a block boundary), into out: rows
 * keep t's row_bytes. */
void weight_tensor_cols(const struct weight_tensor *t, uint32_t c0, uint32_t n, struct weight_tensor *out);
/* Splits the whole FFN of w in two shares at intermediate row r (0 <= r < ffn_dim, a multiple of
 * ffn_split_unit; backend.h, struct ffn_split): w's gate, up and down become the first share, read
 * in place (down keeps its row_bytes), w->split the second, at the same places, computed `where`. */
void weights_split_ffn(struct group_weights *w, uint32_t r, enum ffn_split_where where);
/* The same for a routed expert's gate, up and down (ROLE_EXPERT_*): 0 < r < its intermediate rows. */
void weights_split_expert(struct group_weights *w, uint32_t r, enum ffn_split_where where);

/* weights_fill_at in host memory at the tensors' slot offsets (the weight ring's layout). */
void weights_fill(const struct weight_source *s, uint32_t group, const void *base, const void *embed_base,
		  struct group_weights *w);

#ifdef __cplusplus
}
#endif
#endif

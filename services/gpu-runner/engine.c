/* engine.c - one forward step over the model, group by group (engine.h). */
#include "services/gpu-runner/engine.h"

#include "services/gpu-runner/sampler.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"

/* Records a message in the object and returns rc. */
#define set_err(obj, rc, ...) errorf((obj)->error, sizeof((obj)->error), rc, __VA_ARGS__)

struct engine {
	const struct model_config *cfg;
	bool step_failed; /* the last step failed part way: the weight source settles it first */
	struct backend *be;
	struct weight_source *ws;
	struct kv_cache *kv;
	uint32_t max_chunk;
	uint32_t *dst_block, *dst_row;	/* (max_chunk) where each token's K and V go */
	uint32_t *pos, *seq;		/* (max_chunk) each token's position and sequence */
	int32_t *tokens;		/* (max_chunk) the step's tokens, the sequences' runs one after another */
	char error[768];
	void (*progress)(void *ctx); /* engine_set_progress: once per layer */
	void *progress_ctx;
	uint32_t *split_r;		/* (n_layers) engine_set_ffn_split, NULL: none */
	uint32_t split_max_tokens;
	bool *used;			/* (n_experts) the experts the layer's routing chose (a source that
					 * fetches ahead is told, and skips the others) */
	bool *on_cpu;			/* (n_experts) of those, the ones the source left for the CPU */
	bool cpu_experts_early;		/* those go to the backend at the route, not at their visit */
	bool *cpu_given;		/* (n_experts) of those, the ones given at this layer's route */
	uint32_t *routed;		/* (n_layers, n_experts) decode steps whose routing chose the expert */
	uint32_t *routed_steps;		/* (n_layers) decode steps routed through the layer */
	/* Layers routed on the device (backend_moe_layer): whether a layer's one-token steps are, asked
	 * at its first such step, and which were in this step (their choices counted at its end). */
	uint8_t *moe_dev;		/* (n_layers) enum moe_dev */
	bool *moe_dev_step;		/* (n_layers) */
	bool moe_dev_any;
	uint32_t *moe_dev_ids;		/* (n_layers, n_experts_used) their choices, until the step is checked */
	const struct engine_stage_ops *stages; /* engine_set_stages: a split model; NULL: none */
	void *stages_ctx;
	struct engine_step_stats st;	/* engine_step_stats */
	uint64_t out_ns;		/* when the last decode step with an output returned; 0: none since */
};

enum moe_dev {
	MOE_DEV_UNKNOWN = 0,
	MOE_DEV_YES = 1, /* the backend has the layer's experts' table */
	MOE_DEV_NO = 2,	 /* routed on the host */
};

int engine_create(const struct model_config *cfg, struct backend *be,
		  struct weight_source *weights, struct kv_cache *kv, uint32_t max_chunk, struct engine **out,
		  char *err, size_t errlen)
{
	if (!max_chunk) {
		snprintf(err, errlen, "the prefill chunk must be at least one token");
		return -EINVAL;
	}
	int rc = model_groups_check(cfg, weights->groups, weights->n_groups, err, errlen);
	if (rc)
		return rc;
	struct engine *e = calloc(1, sizeof(*e));
	if (!e)
		return -ENOMEM;
	e->cfg = cfg;
	e->be = be;
	e->ws = weights;
	e->kv = kv;
	e->max_chunk = max_chunk;
	e->dst_block = calloc(max_chunk, sizeof(uint32_t));
	e->dst_row = calloc(max_chunk, sizeof(uint32_t));
	e->pos = calloc(max_chunk, sizeof(uint32_t));
	e->seq = calloc(max_chunk, sizeof(uint32_t));
	e->tokens = calloc(max_chunk, sizeof(int32_t));
	e->used = calloc(cfg->n_experts ? cfg->n_experts : 1, sizeof(bool));
	e->on_cpu = calloc(cfg->n_experts ? cfg->n_experts : 1, sizeof(bool));
	e->cpu_given = calloc(cfg->n_experts ? cfg->n_experts : 1, sizeof(bool));
	e->routed = calloc(cfg->n_experts ? (size_t)cfg->n_layers * cfg->n_experts : 1, sizeof(uint32_t));
	e->routed_steps = calloc(cfg->n_layers ? cfg->n_layers : 1, sizeof(uint32_t));
	e->moe_dev = calloc(cfg->n_layers ? cfg->n_layers : 1, sizeof(uint8_t));
	e->moe_dev_step = calloc(cfg->n_layers ? cfg->n_layers : 1, sizeof(bool));
	e->moe_dev_ids = calloc(cfg->n_experts ? (size_t)cfg->n_layers * cfg->n_experts_used : 1, sizeof(uint32_t));
	if (!e->dst_block || !e->dst_row || !e->pos || !e->seq || !e->tokens || !e->used || !e->on_cpu || !e->cpu_given || !e->routed ||
	    !e->routed_steps || !e->moe_dev || !e->moe_dev_step || !e->moe_dev_ids) {
		engine_destroy(&e);
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	/* A table of experts an engine before gave may point at weights a window before held. */
	for (uint32_t l = 0; cfg->n_experts && l < cfg->n_layers; l++)
		(void)backend_moe_layer_experts(be, l, NULL);
	*out = e;
	return 0;
}

void engine_destroy(struct engine **ep)
{
	if (!ep || !*ep)
		return;
	free((*ep)->pos);
	free((*ep)->seq);
	free((*ep)->tokens);
	free((*ep)->dst_block);
	free((*ep)->dst_row);
	free((*ep)->split_r);
	free((*ep)->used);
	free((*ep)->on_cpu);
	free((*ep)->cpu_given);
	free((*ep)->routed);
	free((*ep)->routed_steps);
	free((*ep)->moe_dev);
	free((*ep)->moe_dev_step);
	free((*ep)->moe_dev_ids);
	free(*ep);
	*ep = NULL;
}

uint32_t engine_max_chunk(const struct engine *e)
{
	return e->max_chunk;
}
const struct model_config *engine_config(const struct engine *e)
{
	return e->cfg;
}
struct kv_cache *engine_kv(struct engine *e)
{
	return e->kv;
}
void engine_set_kv(struct engine *e, struct kv_cache *kv)
{
	e->kv = kv;
}
void engine_set_cpu_experts_early(struct engine *e, bool early)
{
	e->cpu_experts_early = early;
}

void engine_set_progress(struct engine *e, void (*fn)(void *ctx), void *ctx)
{
	e->progress = fn;
	e->progress_ctx = ctx;
}

int engine_set_ffn_split(struct engine *e, const uint32_t *r, uint32_t max_tokens, char *err, size_t errlen)
{
	free(e->split_r);
	e->split_r = NULL;
	if (!r)
		return 0;
	if (backend_weight_place(e->be) != PLACE_HOST)
		return errorf(err, errlen, -ENOTSUP, "the engine splits FFNs only for a backend that reads weights in host "
			      "memory (the %s backend reads device memory: its weight window splits)", backend_name(e->be));
	if (max_tokens < 1 || max_tokens > FFN_SPLIT_MAX_TOKENS)
		return errorf(err, errlen, -EINVAL, "a split FFN's CPU share takes steps of 1..%u tokens, not %u",
			      FFN_SPLIT_MAX_TOKENS, max_tokens);
	const struct model_config *c = e->cfg;
	for (uint32_t l = 0; l < c->n_layers; l++) {
		int ti = model_find_tensor(c, e->ws->tensors, e->ws->groups, model_group_ffn(c, l), ROLE_W_DOWN);
		if (r[l] >= c->ffn_dim)
			continue;
		uint32_t unit = ti >= 0 ? ffn_split_unit((enum dtype)e->ws->tensors[ti].dtype) : 0;
		if (!unit || r[l] % unit)
			return errorf(err, errlen, -EINVAL, "layer %u: the FFN cannot be split at row %u (a multiple of %u "
				      "below %u)", l, r[l], unit, c->ffn_dim);
	}
	e->split_r = malloc(c->n_layers * sizeof(uint32_t));
	if (!e->split_r)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	memcpy(e->split_r, r, c->n_layers * sizeof(uint32_t));
	e->split_max_tokens = max_tokens;
	return 0;
}

struct weight_source *engine_weights(struct engine *e)
{
	return e->ws;
}
const char *engine_error(const struct engine *e)
{
	return e->error;
}

void engine_set_stages(struct engine *e, const struct engine_stage_ops *ops, void *ctx)
{
	e->stages = ops;
	e->stages_ctx = ctx;
}

/* A stage op failed: its message. */
static int stage_err(struct engine *e, int rc, const char *what)
{
	return set_err(e, rc, "%s: %s", what, e->stages->error(e->stages_ctx));
}

int engine_restore_prefix(struct engine *e, const int32_t *seq, uint32_t n_prompt, uint64_t seed)
{
	int r0 = kv_cache_restore_prefix(e->kv, n_prompt);
	if (r0 < 0)
		return set_err(e, r0, "%s", kv_cache_error(e->kv));
	if (!e->stages)
		return r0;
	/* Every stage must restore the same positions: each restores at most what the others did, until
	 * they agree (a count only goes down; 0 always agrees). */
	for (;;) {
		uint32_t fewest;
		int rc = e->stages->restore(e->stages_ctx, seq, n_prompt, (uint32_t)r0, seed, &fewest);
		if (rc)
			return stage_err(e, rc, "restoring the KV prefix on the other stages");
		if (fewest >= (uint32_t)r0)
			return r0;
		if ((rc = kv_cache_reset(e->kv)) != 0)
			return set_err(e, rc, "%s", kv_cache_error(e->kv));
		r0 = kv_cache_restore_prefix(e->kv, fewest + 1);
		if (r0 < 0)
			return set_err(e, r0, "%s", kv_cache_error(e->kv));
	}
}

int engine_seq_end(struct engine *e)
{
	int rc = kv_cache_reset(e->kv);
	if (rc)
		set_err(e, rc, "%s", kv_cache_error(e->kv));
	if (e->stages) {
		int src = e->stages->end(e->stages_ctx);
		if (src && !rc)
			rc = stage_err(e, src, "ending the sequence on the other stages");
	}
	return rc;
}

int engine_kv_recover(struct engine *e)
{
	if (e->stages) {
		int rc = e->stages->recover(e->stages_ctx);
		if (rc)
			return stage_err(e, rc, "dropping the KV of the other stages");
	}
	int rc = kv_cache_recover(e->kv);
	return rc ? set_err(e, rc, "%s", kv_cache_error(e->kv)) : 0;
}

static int acquire(struct engine *e, uint32_t group, struct group_weights *w)
{
	int rc = e->ws->ops->acquire(e->ws, group, w);
	if (rc)
		return set_err(e, rc, "weights of group %u: %s", group, e->ws->error);
	return 0;
}

static int release(struct engine *e, uint32_t group)
{
	int rc = e->ws->ops->release(e->ws, group);
	if (rc)
		return set_err(e, rc, "releasing group %u: %s", group, e->ws->error);
	return 0;
}

#define BE_CHECK(call, what)                                                                   \
	do {                                                                                   \
		int rc_ = (call);                                                              \
		if (rc_) {                                                                     \
			set_err(e, rc_, "%s: %s", what, backend_error(e->be));                  \
			release(e, group);                                                     \
			return rc_;                                                            \
		}                                                                              \
	} while (0)

#define KV_CHECK(kv, call)                                                                     \
	do {                                                                                   \
		int rc_ = (call);                                                              \
		if (rc_) {                                                                     \
			set_err(e, rc_, "%s", kv_cache_error(kv));                             \
			release(e, group);                                                     \
			return rc_;                                                            \
		}                                                                              \
	} while (0)

static int forward(struct engine *e, const int32_t *tokens, uint32_t n, uint32_t pos0, float *logits, int32_t *argmax,
		   const struct sampler_params *sp, double u, bool stage_out);

/* Is group g the last expert group of its layer (after it, the layer's sum goes into the residual)? */
static bool last_expert(const struct engine *e, uint32_t g)
{
	const struct group_desc *gr = e->ws->groups;
	return g + 1 == e->ws->n_groups || gr[g + 1].kind != GROUP_EXPERT || gr[g + 1].layer != gr[g].layer;
}

/* Are layer l's one-token steps routed on the device (1), or on the host (0)? Asked at the layer's
 * first such step (its moe group at `group`): where the source keeps every one of its experts in
 * device memory, their addresses go to the backend once, and a backend that takes them routes the
 * layer from then on (backend_moe_layer_experts; -ENOTSUP: the host routes it). < 0: an error. */
static int moe_on_device(struct engine *e, uint32_t group, uint32_t l)
{
	if (e->moe_dev[l] != MOE_DEV_UNKNOWN)
		return e->moe_dev[l] == MOE_DEV_YES;
	e->moe_dev[l] = MOE_DEV_NO; /* but after an error: asked again at the next step */
	const struct group_desc *groups = e->ws->groups;
	const uint32_t E = e->cfg->n_experts, g0 = group + 1;
	if (!e->ws->ops->kept || g0 + E > e->ws->n_groups)
		return 0;
	for (uint32_t x = 0; x < E; x++)
		if (groups[g0 + x].kind != GROUP_EXPERT || groups[g0 + x].layer != l || groups[g0 + x].expert != x ||
		    !e->ws->ops->kept(e->ws, g0 + x))
			return 0;
	struct group_weights *w = calloc(E, sizeof(*w));
	if (!w)
		return set_err(e, -ENOMEM, "out of memory for the experts of layer %u", l);
	uint32_t got = 0;
	int rc = 0;
	while (got < E && (rc = acquire(e, g0 + got, &w[got])) == 0)
		got++;
	if (rc == 0) {
		rc = backend_moe_layer_experts(e->be, l, w);
		if (rc && rc != -ENOTSUP)
			set_err(e, rc, "the experts of layer %u to the device: %s", l, backend_error(e->be));
	}
	for (uint32_t x = 0; x < got; x++) {
		const int rrc = release(e, g0 + x);
		if (!rc)
			rc = rrc;
	}
	free(w);
	if (rc == -ENOTSUP) {
		if (l == 0)
			log_info("experts: layer 0 is routed on the host: %s", backend_error(e->be));
		return 0;
	}
	if (rc) {
		e->moe_dev[l] = MOE_DEV_UNKNOWN;
		return rc;
	}
	e->moe_dev[l] = MOE_DEV_YES;
	if (l == 0)
		log_info("experts: layer 0's are all on the GPU, routed there without the host's wait");
	return 1;
}

/* After a step that went well so far: the choices of the layers routed on the device, read before
 * backend_moe_check (which forgets them) into moe_dev_ids. */
static int moe_dev_collect(struct engine *e)
{
	const uint32_t k = e->cfg->n_experts_used;
	for (uint32_t l = 0; e->moe_dev_any && l < e->cfg->n_layers; l++) {
		if (!e->moe_dev_step[l])
			continue;
		int rc = backend_moe_layer_chosen(e->be, l, e->moe_dev_ids + (size_t)l * k);
		if (rc)
			return set_err(e, rc, "experts of layer %u: %s", l, backend_error(e->be));
	}
	return 0;
}

/* The step's end: the choices collected counted as the host's routes count theirs, where the step
 * went well (count), and forgotten. */
static void moe_dev_done(struct engine *e, bool count)
{
	const uint32_t E = e->cfg->n_experts, k = e->cfg->n_experts_used;
	for (uint32_t l = 0; e->moe_dev_any && l < e->cfg->n_layers; l++) {
		if (!e->moe_dev_step[l])
			continue;
		e->moe_dev_step[l] = false;
		if (!count)
			continue;
		const uint32_t *ids = e->moe_dev_ids + (size_t)l * k;
		e->routed_steps[l]++;
		for (uint32_t i = 0; i < k; i++)
			if (ids[i] < E)
				e->routed[(size_t)l * E + ids[i]]++;
	}
	e->moe_dev_any = false;
}

int engine_forward(struct engine *e, const int32_t *tokens, uint32_t n, uint32_t pos0, float *logits)
{
	return forward(e, tokens, n, pos0, logits, NULL, NULL, 0, false);
}

int engine_forward_stage(struct engine *e, const int32_t *tokens, uint32_t n, uint32_t pos0, bool out)
{
	if (!e->stages || !e->ws->stage.split || e->ws->stage.first)
		return set_err(e, -EINVAL, "a stage step is for a later stage of a split model");
	return forward(e, tokens, n, pos0, NULL, NULL, NULL, 0, out);
}

int engine_forward_greedy(struct engine *e, const int32_t *tokens, uint32_t n, uint32_t pos0, int32_t *token)
{
	return forward(e, tokens, n, pos0, NULL, token, NULL, 0, false);
}

void engine_moe_routing(const struct engine *e, const uint32_t **routed, const uint32_t **steps)
{
	*routed = e->cfg->n_experts ? e->routed : NULL;
	*steps = e->cfg->n_experts ? e->routed_steps : NULL;
}

bool engine_samples_on_device(const struct engine *e)
{
	return backend_samples_on_device(e->be);
}

int engine_forward_sample(struct engine *e, const int32_t *tokens, uint32_t n, uint32_t pos0,
			  const struct sampler_params *sp, double u, int32_t *token)
{
	if (!backend_samples_on_device(e->be))
		return set_err(e, -ENOTSUP, "the %s backend does not sample on the device", backend_name(e->be));
	return forward(e, tokens, n, pos0, NULL, token, sp, u, false);
}

static int forward_groups(struct engine *e, const struct engine_seq *seqs, uint32_t n_seqs, float *logits,
			  int32_t *argmax, const struct sampler_params *sp, double u, bool stage_out,
			  const struct backend_pick *picks);

/* One step; on the first stage of a split model, a failure of its own tells the other stages (they
 * wait for its rows, or its taking theirs). */
static int forward(struct engine *e, const int32_t *tokens, uint32_t n, uint32_t pos0, float *logits, int32_t *argmax,
		   const struct sampler_params *sp, double u, bool stage_out)
{
	struct engine_seq one = {.kv = e->kv, .tokens = tokens, .n = n, .pos0 = pos0, .out = logits || argmax};
	int rc = forward_groups(e, &one, 1, logits, argmax, sp, u, stage_out, NULL);
	if (rc && e->stages && e->ws->stage.split && e->ws->stage.first && e->stages->abort)
		e->stages->abort(e->stages_ctx, e->error);
	return rc;
}

/* The checks of a batched step; *n_out: the sequences that want their next token. */
static int batch_check(struct engine *e, const struct engine_seq *seqs, uint32_t n_seqs, uint32_t *n_out);

int engine_forward_batch(struct engine *e, const struct engine_seq *seqs, uint32_t n_seqs, float *logits)
{
	uint32_t n_out = 0;
	int rc = batch_check(e, seqs, n_seqs, &n_out);
	if (rc)
		return rc;
	if (n_out && !logits)
		return set_err(e, -EINVAL, "%u sequences of the step want logits, and there is nowhere to put them", n_out);
	return forward_groups(e, seqs, n_seqs, n_out ? logits : NULL, NULL, NULL, 0, false, NULL);
}

bool engine_picks_rows(const struct engine *e)
{
	return backend_picks_rows(e->be) && !(e->stages && e->ws->stage.split);
}

int engine_forward_batch_pick(struct engine *e, const struct engine_seq *seqs, uint32_t n_seqs,
			      const struct backend_pick *picks, int32_t *tokens)
{
	uint32_t n_out = 0;
	int rc = batch_check(e, seqs, n_seqs, &n_out);
	if (rc)
		return rc;
	if (!engine_picks_rows(e))
		return set_err(e, -ENOTSUP, "the %s backend picks no tokens itself", backend_name(e->be));
	if (!n_out || !picks || !tokens)
		return set_err(e, -EINVAL, "a step whose tokens are picked needs a sequence that wants one, its pick and "
			       "room for its token");
	return forward_groups(e, seqs, n_seqs, NULL, tokens, NULL, 0, false, picks);
}

static int batch_check(struct engine *e, const struct engine_seq *seqs, uint32_t n_seqs, uint32_t *n_out_p)
{
	if (n_seqs == 0 || !seqs)
		return set_err(e, -EINVAL, "a batched step takes at least one sequence");
	if (n_seqs > 1 && !backend_batches_sequences(e->be))
		return set_err(e, -ENOTSUP, "the %s backend computes one sequence a step", backend_name(e->be));
	if (e->stages && e->ws->stage.split)
		return set_err(e, -ENOTSUP, "a model split across runners computes one sequence a step");
	uint32_t n_out = 0;
	for (uint32_t s = 0; s < n_seqs; s++) {
		if (!seqs[s].kv || !seqs[s].tokens || !seqs[s].n)
			return set_err(e, -EINVAL, "sequence %u of the step has no KV cache or no tokens", s);
		for (uint32_t t = 0; t < s; t++)
			if (seqs[t].kv == seqs[s].kv)
				return set_err(e, -EINVAL, "sequences %u and %u of the step share one KV cache", t, s);
		n_out += seqs[s].out;
	}
	*n_out_p = n_out;
	return 0;
}

/* The head of a batched step for each sequence's last row that wants its next token: the rows'
 * logits into logits, or (picks) each row's token picked where the logits are into tokens. */
static int head_rows(struct engine *e, const struct group_weights *w, const struct engine_seq *seqs, uint32_t n_seqs,
		     float *logits, const struct backend_pick *picks, int32_t *tokens)
{
	uint32_t rows[n_seqs], n_out = 0, row = 0;
	for (uint32_t s = 0; s < n_seqs; s++) {
		row += seqs[s].n;
		if (seqs[s].out)
			rows[n_out++] = row - 1;
	}
	return picks ? backend_logits_pick_rows(e->be, w, rows, n_out, picks, tokens)
		     : backend_logits_rows(e->be, w, rows, n_out, logits);
}

static int step_groups(struct engine *e, const struct engine_seq *seqs, uint32_t n_seqs, float *logits,
		       int32_t *argmax, const struct sampler_params *sp, double u, bool stage_out,
		       const struct backend_pick *picks);

/* Expert group g, which its layer's route left in host memory, to the backend's CPU pool. */
static int give_cpu_expert(struct engine *e, uint32_t g)
{
	struct group_weights hw;
	int rc = e->ws->ops->acquire_host(e->ws, g, &hw);
	if (rc)
		return set_err(e, rc, "weights of group %u: %s", g, e->ws->error);
	if ((rc = backend_moe_expert_cpu(e->be, &hw, e->ws->groups[g].expert)))
		return set_err(e, rc, "expert on the CPU: %s", backend_error(e->be));
	return 0;
}

/* A step; a failed one first waits for the experts the CPU may still compute from host memory
 * (the weights they read can go away once the step has failed: a release, a reconnect). */
static int forward_groups(struct engine *e, const struct engine_seq *seqs, uint32_t n_seqs, float *logits,
			  int32_t *argmax, const struct sampler_params *sp, double u, bool stage_out,
			  const struct backend_pick *picks)
{
	if (e->step_failed && e->ws->ops->reset) {
		int src = e->ws->ops->reset(e->ws);
		if (src)
			return set_err(e, src, "weights, after a failed step: %s", e->ws->error);
	}
	e->step_failed = false;
	/* A decode step (one token a sequence) with an output: its time, and the host's between the
	 * last one's return and this one's start where they follow each other (engine_step_stats). */
	bool decode = n_seqs > 0, out = logits || argmax || picks;
	for (uint32_t i = 0; i < n_seqs; i++)
		decode = decode && seqs[i].n == 1;
	const uint64_t t0 = now_ns();
	if (decode && e->out_ns && t0 - e->out_ns < (uint64_t)ENGINE_STEPS_APART_MS * 1000000u) {
		e->st.between_ms += (double)(t0 - e->out_ns) / 1e6;
		e->st.betweens++;
	}
	e->out_ns = 0;
	int rc = step_groups(e, seqs, n_seqs, logits, argmax, sp, u, stage_out, picks);
	if (rc == 0)
		rc = moe_dev_collect(e);
	/* A step with no output the host waited for (a prefill chunk before the last, a position
	 * caught up) has not looked at the results of the last layer's CPU experts yet. */
	if (rc == 0 && e->cfg->n_experts && (rc = backend_moe_check(e->be)) != 0)
		set_err(e, rc, "experts: %s", backend_error(e->be));
	moe_dev_done(e, rc == 0);
	if (rc)
		backend_settle(e->be);
	e->step_failed = rc != 0;
	if (rc == 0 && decode && out) {
		e->out_ns = now_ns();
		e->st.step_ms += (double)(e->out_ns - t0) / 1e6;
		e->st.steps++;
	}
	return rc;
}

const char *const engine_begin_part_names[ENGINE_BEGIN_PARTS] = {"embed", "attn_acquire", "attn_launch", "attend",
								  "attn_end", "ffn_acquire"};

void engine_step_stats(const struct engine *e, struct engine_step_stats *out)
{
	*out = e->st;
}

static int step_groups(struct engine *e, const struct engine_seq *seqs, uint32_t n_seqs, float *logits,
		       int32_t *argmax, const struct sampler_params *sp, double u, bool stage_out,
		       const struct backend_pick *picks)
{
	uint32_t n = 0;
	for (uint32_t s = 0; s < n_seqs; s++) {
		if (seqs[s].n > e->max_chunk - n)
			return set_err(e, -EINVAL, "a step takes 1..%u tokens, not %u or more", e->max_chunk,
				       n + seqs[s].n);
		/* Sequence s: rows [n, n + its tokens), consecutive positions. */
		for (uint32_t i = 0; i < seqs[s].n; i++) {
			e->pos[n + i] = seqs[s].pos0 + i;
			e->seq[n + i] = s;
		}
		if (n_seqs > 1)
			memcpy(e->tokens + n, seqs[s].tokens, seqs[s].n * sizeof(int32_t));
		kv_cache_set_rows(seqs[s].kv, n_seqs > 1 ? n : 0, n_seqs > 1 ? seqs[s].n : 0);
		n += seqs[s].n;
	}
	if (n == 0)
		return set_err(e, -EINVAL, "a step takes 1..%u tokens, not 0", e->max_chunk);
	const int32_t *tokens = n_seqs > 1 ? e->tokens : seqs[0].tokens; /* one run: as given */
	uint32_t pos0 = seqs[0].pos0; /* one sequence: the step's (a split model steps one sequence) */
	bool multi = n_seqs > 1;
	struct backend_batch batch = {.n = n, .tokens = tokens, .pos = e->pos, .seq = e->seq};
	e->ws->step_tokens = n;
	/* A split model (engine_set_stages): the first stage tells the others and hands its rows on before
	 * the head; a later stage takes its rows first and hands them on at the end. */
	const struct weight_stage *st = &e->ws->stage;
	bool staged = e->stages && st->split, out = logits || argmax;
	int rc;
	if (staged && st->first && (rc = e->stages->begin(e->stages_ctx, tokens, n, pos0, out)) != 0)
		return stage_err(e, rc, "starting the step on the other stages");
	if (staged && !st->first && (rc = e->stages->take(e->stages_ctx, e->be, &batch)) != 0)
		return stage_err(e, rc, "taking the previous stage's hidden state");
	/* A decode step's start on the host, part by part up to its first FFN (engine_step_stats): kept
	 * once the step reaches that FFN. */
	bool marking = n == n_seqs && (out || picks); /* a decode step with its output, as engine_step_stats counts */
	uint64_t mark_t = marking ? now_ns() : 0;
	double part_ms[ENGINE_BEGIN_PARTS] = {0};
#define MARK(part)                                                                                 \
	do {                                                                                       \
		if (marking) {                                                                     \
			const uint64_t t_ = now_ns();                                              \
			part_ms[part] += (double)(t_ - mark_t) / 1e6;                              \
			mark_t = t_;                                                               \
		}                                                                                  \
	} while (0)
#define MARKED()                                                                                   \
	do {                                                                                       \
		MARK(BEGIN_FFN_ACQUIRE);                                                           \
		for (int i_ = 0; marking && i_ < ENGINE_BEGIN_PARTS; i_++)                         \
			e->st.begin_ms[i_] += part_ms[i_];                                         \
		e->st.begins += marking;                                                           \
		marking = false;                                                                   \
	} while (0)
	/* The groups in the table's order (model.h): what each one computes is its kind's. */
	const struct group_desc *groups = e->ws->groups;
	for (uint32_t group = 0; group < e->ws->n_groups; group++) {
		uint32_t kind = groups[group].kind, l = groups[group].layer;
		if (!weight_stage_has(st, &groups[group]))
			continue; /* another stage's */
		if (kind == GROUP_HEAD && staged) {
			if (e->ws->ops->flush && (rc = e->ws->ops->flush(e->ws)) != 0)
				return set_err(e, rc, "weights: %s", e->ws->error);
			if ((rc = e->stages->pass(e->stages_ctx, e->be, n, out)) != 0)
				return stage_err(e, rc, "handing the hidden state to the next stage");
			if (out && (rc = e->stages->back(e->stages_ctx, e->be, n)) != 0)
				return stage_err(e, rc, "the last stage's hidden state");
		}
		if (kind == GROUP_HEAD && !logits && !argmax)
			break; /* a prefill chunk before the last: no output wanted */
		if (kind == GROUP_ATTN && e->progress)
			e->progress(e->progress_ctx);
		if (kind == GROUP_EXPERT && e->ws->ops->skip &&
		    (!e->used[groups[group].expert] || e->on_cpu[groups[group].expert])) {
			/* No token chose it: the source passes it over (it was told at the route). Or the
			 * source left it in host memory: the backend computes it on the CPU (given here, or
			 * at the route when early); the source then passes its visit over all the same. */
			uint32_t x = groups[group].expert;
			if (e->used[x] && !e->cpu_given[x] && (rc = give_cpu_expert(e, group)))
				return rc;
			if ((rc = e->ws->ops->skip(e->ws, group)))
				return set_err(e, rc, "weights: %s", e->ws->error);
			if (last_expert(e, group) && (rc = backend_moe_end(e->be)))
				return set_err(e, rc, "experts: %s", backend_error(e->be));
			continue;
		}
		struct group_weights w;
		rc = acquire(e, group, &w);
		if (rc)
			return rc;
		uint32_t last = group; /* the group the visit goes on after */
		switch (kind) {
		case GROUP_EMBED:
			BE_CHECK(backend_embed(e->be, &w, &batch), "embedding");
			break;
		case GROUP_ATTN:
			MARK(BEGIN_ATTN_ACQUIRE);
			for (uint32_t s = 0, row = 0; s < n_seqs; row += seqs[s++].n)
				KV_CHECK(seqs[s].kv, kv_cache_prepare(seqs[s].kv, l, seqs[s].pos0, seqs[s].n,
								      e->dst_block + row, e->dst_row + row));
			BE_CHECK(backend_attn_begin(e->be, &w, l, e->dst_block, e->dst_row), "attention");
			MARK(BEGIN_ATTN_LAUNCH);
			for (uint32_t s = 0; s < n_seqs; s++)
				KV_CHECK(seqs[s].kv, kv_cache_attend(seqs[s].kv, l, seqs[s].pos0 + seqs[s].n));
			MARK(BEGIN_ATTEND);
			BE_CHECK(backend_attn_end(e->be, &w), "attention output");
			for (uint32_t s = 0; s < n_seqs; s++)
				KV_CHECK(seqs[s].kv, kv_cache_finish_layer(seqs[s].kv, l, seqs[s].pos0,
									   seqs[s].pos0 + seqs[s].n));
			MARK(BEGIN_ATTN_END);
			break;
		case GROUP_FFN:
			MARKED();
			if (e->split_r && e->split_r[l] < e->cfg->ffn_dim && n <= e->split_max_tokens &&
			    w.split.where == FFN_SPLIT_NONE)
				weights_split_ffn(&w, e->split_r[l], FFN_SPLIT_CPU);
			BE_CHECK(backend_ffn(e->be, &w), "feed-forward");
			break;
		case GROUP_MOE:
			MARKED();
			if (n == 1 && !staged && (rc = moe_on_device(e, group, l)) != 0) {
				if (rc < 0) {
					release(e, group);
					return rc;
				}
				/* The whole layer on the device; its expert groups are not visited. */
				BE_CHECK(backend_moe_layer(e->be, &w, l), "experts routed on the device");
				e->moe_dev_step[l] = e->moe_dev_any = true;
				while (last + 1 < e->ws->n_groups && groups[last + 1].kind == GROUP_EXPERT &&
				       groups[last + 1].layer == l)
					last++;
				break;
			}
			BE_CHECK(backend_moe_route(e->be, &w), "router");
			for (uint32_t x = 0; x < e->cfg->n_experts; x++)
				e->used[x] = backend_moe_expert_used(e->be, x);
			if (n == n_seqs) {
				/* A decode step (a token a sequence): what the routing chose, counted. */
				e->routed_steps[l]++;
				for (uint32_t x = 0; x < e->cfg->n_experts; x++)
					e->routed[(size_t)l * e->cfg->n_experts + x] += e->used[x];
			}
			memset(e->on_cpu, 0, e->cfg->n_experts * sizeof(bool));
			e->ws->route_ends_known = backend_moe_ends(e->be, &e->ws->route_ends_ns) == 1;
			if (e->ws->ops->route && (rc = e->ws->ops->route(e->ws, l, e->used, e->on_cpu)) != 0) {
				set_err(e, rc, "weights: %s", e->ws->error);
				release(e, group);
				return rc;
			}
			/* Early: the experts left for the CPU, and the CPU's shares of those the route split
			 * with it, go to its pool now, in table order (the order of their sum), so that it
			 * computes them while the copies of the GPU's experts pace the engine (at their
			 * visits, the host reaches them only after those copies, and after the GPU's
			 * launches of the experts before). As many as the backend computes at once: one more
			 * would wait for the first before any GPU expert is queued; the rest go at their
			 * visits. */
			memset(e->cpu_given, 0, e->cfg->n_experts * sizeof(bool));
			uint32_t early = e->cpu_experts_early ? e->cfg->n_experts_used : 0;
			if (early > BACKEND_MOE_CPU_JOBS)
				early = BACKEND_MOE_CPU_JOBS;
			for (uint32_t g = group + 1; early && g < e->ws->n_groups && groups[g].kind == GROUP_EXPERT &&
						     groups[g].layer == l; g++) {
				const uint32_t x = groups[g].expert;
				struct ffn_split share;
				int sh = 0; /* 1: a chosen expert the route split with the CPU, its share in `share` */
				if (!e->on_cpu[x]) {
					if (!e->used[x] || !e->ws->ops->share_host)
						continue;
					if ((sh = e->ws->ops->share_host(e->ws, g, &share)) == 0)
						continue;
				}
				early--;
				if (sh < 0)
					rc = set_err(e, sh, "weights: %s", e->ws->error);
				else if (sh && (rc = backend_moe_expert_cpu_share(e->be, &share, x)))
					set_err(e, rc, "expert's CPU share: %s", backend_error(e->be));
				else if (!sh) {
					e->cpu_given[x] = true;
					rc = give_cpu_expert(e, g);
				}
				if (rc) {
					release(e, group);
					return rc;
				}
			}
			break;
		case GROUP_EXPERT:
			BE_CHECK(backend_moe_expert(e->be, &w, groups[group].expert), "expert");
			/* The layer's last expert group: its sum goes into the residual stream. */
			if (last_expert(e, group))
				BE_CHECK(backend_moe_end(e->be), "experts");
			break;
		case GROUP_HEAD:
			if (picks || multi)
				BE_CHECK(head_rows(e, &w, seqs, n_seqs, logits, picks, argmax),
					 picks ? "picking the tokens" : "logits");
			else if (logits)
				BE_CHECK(backend_logits(e->be, &w, logits), "logits");
			else if (sp)
				BE_CHECK(backend_logits_sample(e->be, &w, sp, u, argmax), "sampling");
			else
				BE_CHECK(backend_logits_argmax(e->be, &w, argmax), "logits");
			break;
		default:
			release(e, group);
			return set_err(e, -EPROTO, "group %u is of kind %u, which this engine does not compute", group, kind);
		}
		if ((rc = release(e, group)))
			return rc;
		if (kind == GROUP_EMBED)
			MARK(BEGIN_EMBED);
		group = last;
	}
#undef MARKED
#undef MARK
	if (staged && !st->first && e->ws->ops->flush && (rc = e->ws->ops->flush(e->ws)) != 0)
		return set_err(e, rc, "weights: %s", e->ws->error);
	if (staged && !st->first && (rc = e->stages->pass(e->stages_ctx, e->be, n, stage_out)) != 0)
		return stage_err(e, rc, "handing the hidden state on");
	return 0;
}

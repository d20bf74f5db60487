/* stats.c - the gpu-runner's stats (service_ops.stats, built once a second; nothing on the token
 * path): counters of requests and tokens, the KV cache's and the weight window's numbers, the CPU
 * share of split FFNs (its pool, the split in force, what it computed, its times), and what
 * pipeline-inspect shows (the state of every weight group, the copy queue, KV blocks per layer). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/host_profile.h"
#include "common/tokenizer/tokenizer.h"
#include "common/util.h"
#include "common/weight_ring.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/kv_cache.h"
#include "services/gpu-runner/runner.h"
#include "services/gpu-runner/text.h"
#include "services/gpu-runner/weights_ring.h"
#ifdef PIPELINE_HAVE_CUDA
#include "services/gpu-runner/gpu_window.h"
#endif

/* ---- what pipeline-inspect shows (built with the stats, once a second; nothing on the token path) ---- */

/* The runner's view of weight group g: on the device (cuda: G held for good, W in a window
 * slot, C copying in, T retiring), else in the loader's ring (H granted to the runner, R ready,
 * L loading, E empty). */
static char group_letter(struct runner *r, struct wring_header *h, uint32_t g)
{
#ifdef PIPELINE_HAVE_CUDA
	if (r->win) {
		bool for_good;
		switch (gpu_window_group_state(r->win, g, &for_good)) {
		case GWIN_RESIDENT:
			return for_good ? 'G' : 'W';
		case GWIN_INFLIGHT:
			return 'C';
		case GWIN_RETIRING:
			return 'T';
		default:
			break;
		}
	}
#endif
	if (g >= h->n_groups)
		return '?';
	uint32_t s = atomic_load_explicit(&wring_group_state(h)[g].slot, memory_order_relaxed);
	if (s >= h->n_slots)
		return 'E';
	struct wring_slot *sl = &wring_slots(h)[s];
	if (atomic_load_explicit(&sl->group, memory_order_relaxed) != g)
		return 'E';
	switch (atomic_load_explicit(&sl->state, memory_order_relaxed)) {
	case WSLOT_READY:
		return atomic_load_explicit(&sl->refs, memory_order_relaxed) ? 'H' : 'R';
	case WSLOT_LOADING:
		return 'L';
	default:
		return 'E';
	}
}

/* busy, tokens_computed and tokens_per_s (over the last second or more), weight_groups
 * (embed, head, and per layer the attn and ffn letters), copy_queue, KV blocks per layer. */
static void inspect_stats(struct runner *r, json_t *o)
{
	static uint64_t last_tokens, last_ns;
	static double rate;
	void *base = NULL;
	size_t size = 0;
	if (r->ring)
		ring_source_mapping(r->ring, &base, &size);
	struct wring_header *h = base;
	uint64_t tokens = h ? atomic_load_explicit(&h->runner.tokens, memory_order_relaxed) : 0, now = now_ns();
	if (!last_ns || tokens < last_tokens) { /* the first call, or a new ring */
		last_ns = now;
		last_tokens = tokens;
		rate = 0;
	} else if (now - last_ns >= 900000000ull) {
		rate = (double)(tokens - last_tokens) / ((double)(now - last_ns) / 1e9);
		last_ns = now;
		last_tokens = tokens;
	}
	json_object_set_new(o, "busy", json_boolean(r->current != NULL || r->n_active > 0));
	json_object_set_new(o, "tokens_computed", json_integer((json_int_t)tokens));
	json_object_set_new(o, "tokens_per_s", json_real(rate));
	uint32_t n_layers = r->cfg.n_layers;
	if (h) {
		json_t *layers = json_array();
		uint32_t held = 0, copying = 0;
		for (uint32_t g = 0; g < h->n_groups; g++) {
			char c = group_letter(r, h, g);
			held += c == 'H';
			copying += c == 'C';
		}
		for (uint32_t l = 0; layers && l < n_layers; l++) {
			/* A mixture-of-experts layer shows its attention and its router group. */
			char pair[3] = {group_letter(r, h, model_group_attn(&r->cfg, l)),
					group_letter(r, h, model_group_ffn(&r->cfg, l)), 0};
			json_array_append_new(layers, json_string(pair));
		}
		char embed[2] = {group_letter(r, h, group_id_embed()), 0};
		char head[2] = {group_letter(r, h, group_id_head(&r->cfg)), 0};
		json_object_set_new(o, "weight_groups", json_pack("{s:s, s:s, s:o*}", "embed", embed, "head", head,
								  "layers", layers));
		json_object_set_new(o, "copy_queue", json_pack("{s:i, s:i}", "weights_h2d_in_flight", (int)copying,
							       "weight_grants_held", (int)held));
	}
	uint32_t *per_layer = r->cache && n_layers ? calloc(4 * (size_t)n_layers, sizeof(uint32_t)) : NULL;
	if (per_layer) {
		/* Every running request's cache (batching), summed. */
		uint32_t used = 0, *one = per_layer + 2 * (size_t)n_layers;
		for (uint32_t k = 0; k < r->n_slots; k++) {
			struct kv_cache *kv = r->slot_kv[k];
			if (!kv)
				continue;
			uint32_t u;
			kv_cache_usage(kv, &u, one, one + n_layers);
			used += u;
			for (uint32_t i = 0; i < 2 * n_layers; i++)
				per_layer[i] += one[i];
		}
		json_t *gpu = json_array(), *store = json_array();
		for (uint32_t l = 0; gpu && store && l < n_layers; l++) {
			json_array_append_new(gpu, json_integer(per_layer[l]));
			json_array_append_new(store, json_integer(per_layer[n_layers + l]));
		}
		json_object_set_new(o, "kv_gpu_blocks_used", json_integer(used));
		json_object_set_new(o, "kv_layers", json_pack("{s:o*, s:o*}", "gpu", gpu, "store", store));
		free(per_layer);
	}
}

/* "cpu_share": the policy and the split in force, the pool (queue depth, tasks), what the CPU
 * computed (jobs, bytes, per token) and how long it took (its jobs on the CPU, the split FFNs on the
 * stream, the handoff's part of that). Averages are per job / per timed FFN; 0 before any. */
static json_t *cpu_share_stats(struct runner *r)
{
	char policy[32];
	json_t *o = json_object();
	if (!o)
		return NULL;
	json_object_set_new(o, "policy", json_string(cpu_share_text(&r->cpu_share, policy, sizeof(policy))));
	json_object_set_new(o, "balance", json_string(r->cpu_share.per_layer ? "layer" : "token"));
	json_object_set_new(o, "replans", json_integer((json_int_t)r->split_replans));
	uint32_t split = 0, r_min = r->cfg.ffn_dim, r_max = r->cfg.ffn_dim, max_tokens = 0;
	uint64_t planned = 0;
	double planned_ms = 0;
#ifdef PIPELINE_HAVE_CUDA
	if (r->win) {
		struct gpu_window_stats ws;
		gpu_window_stats(r->win, &ws);
		split = ws.split_groups;
		r_min = ws.split_r_min;
		r_max = ws.split_r_max;
		max_tokens = ws.split_max_tokens;
		planned = ws.cpu_bytes_per_token;
		planned_ms = ws.cpu_ms;
	}
#endif
	if (r->cpu_split_r) {
		r_min = r_max = r->cfg.ffn_dim;
		for (uint32_t l = 0; l < r->cfg.n_layers; l++) {
			if (r->cpu_split_r[l] >= r->cfg.ffn_dim)
				continue;
			split++;
			r_min = r->cpu_split_r[l] < r_min ? r->cpu_split_r[l] : r_min;
			r_max = split == 1 || r->cpu_split_r[l] > r_max ? r->cpu_split_r[l] : r_max;
		}
		max_tokens = 1;
		planned = r->cpu_split_bytes;
	}
	json_object_set_new(o, "split_ffns", json_integer(split));
	json_object_set_new(o, "r_min", json_integer(r_min));
	json_object_set_new(o, "r_max", json_integer(r_max));
	json_object_set_new(o, "ffn_dim", json_integer(r->cfg.ffn_dim));
	json_object_set_new(o, "max_tokens", json_integer(max_tokens));
	json_object_set_new(o, "planned_bytes_per_token", json_integer((json_int_t)planned));
	json_object_set_new(o, "planned_ms_per_token", json_real(planned_ms));
	if (r->cpu_pool) {
		struct task_pool_stats ps;
		task_pool_get_stats(r->cpu_pool, &ps);
		json_object_set_new(o, "threads", json_integer(ps.threads));
		json_object_set_new(o, "queue_depth", json_integer(ps.queue_depth));
		json_object_set_new(o, "queue_high_water", json_integer(ps.queue_high_water));
		json_object_set_new(o, "tasks_submitted", json_integer((json_int_t)ps.jobs_submitted));
		json_object_set_new(o, "tasks_done", json_integer((json_int_t)ps.jobs_done));
		json_object_set_new(o, "tasks_failed", json_integer((json_int_t)ps.jobs_failed));
		json_object_set_new(o, "parts_run", json_integer((json_int_t)ps.parts_run));
		json_object_set_new(o, "busy_ms", json_real((double)ps.busy_ns / 1e6));
	}
	struct backend_cpu_share_stats bs;
	if (r->be)
		backend_get_cpu_share_stats(r->be, &bs);
	else
		memset(&bs, 0, sizeof(bs));
	double job_us = bs.jobs ? bs.cpu_ms * 1e3 / (double)bs.jobs : 0;
	double ffn_us = bs.timed ? bs.stream_ms * 1e3 / (double)bs.timed : 0;
	json_object_set_new(o, "handoff", json_string(bs.handoff[0] ? bs.handoff : "none"));
	json_object_set_new(o, "jobs", json_integer((json_int_t)bs.jobs));
	json_object_set_new(o, "jobs_failed", json_integer((json_int_t)bs.failed));
	json_object_set_new(o, "bytes", json_integer((json_int_t)bs.bytes));
	/* A decode token runs one job per split FFN. */
	json_object_set_new(o, "bytes_per_token",
			    json_integer(bs.jobs && split ? (json_int_t)(bs.bytes / bs.jobs * split) : 0));
	json_object_set_new(o, "cpu_job_us", json_real(job_us));
	json_object_set_new(o, "timed_ffns", json_integer((json_int_t)bs.timed));
	json_object_set_new(o, "stream_ffn_us", json_real(ffn_us));
	json_object_set_new(o, "stream_wait_us", json_real(bs.timed ? bs.wait_ms * 1e3 / (double)bs.timed : 0));
	/* The split FFN's time on the stream beyond its CPU job: when the CPU binds, the handoff's own
	 * cost both ways (x's copy down, the dispatch, the wait's end, the copy up, the add). */
	json_object_set_new(o, "handoff_us", json_real(bs.timed && ffn_us > job_us ? ffn_us - job_us : 0));
	/* The same per timed FFN, counted by size: under 50, 100, 200, 500, 1000 us, and longer. */
	json_t *hist = json_array();
	for (int b = 0; hist && b < BACKEND_HANDOFF_BUCKETS; b++)
		json_array_append_new(hist, json_integer((json_int_t)bs.handoff_hist[b]));
	json_object_set_new(o, "handoff_hist", hist ? hist : json_null());
	/* On the host's clock: a job's dispatch to its first part (the pool's start), and the pool's
	 * time without a job between two (what the CPU cannot spend on the shares: the GPU's work
	 * between split FFNs, the handoffs, a token's ends). */
	json_object_set_new(o, "dispatch_us", json_real(bs.dispatched ? bs.dispatch_ms * 1e3 / (double)bs.dispatched : 0));
	json_object_set_new(o, "dispatch_max_us", json_real(bs.dispatch_max_ms * 1e3));
	json_object_set_new(o, "gap_us", json_real(bs.gaps ? bs.gap_ms * 1e3 / (double)bs.gaps : 0));
	json_object_set_new(o, "host_late", json_integer((json_int_t)bs.host_late));
	json_object_set_new(o, "dispatch_stalls", json_integer((json_int_t)bs.dispatch_stalls));
	json_object_set_new(o, "dispatch_stall_ms", json_real(bs.dispatch_stall_ms));
	json_object_set_new(o, "dispatched_by_wait", json_integer((json_int_t)bs.dispatched_by_poll));
	json_object_set_new(o, "dispatched_by_workers", json_integer((json_int_t)bs.dispatched_by_workers));
	json_object_set_new(o, "prefetched_mb", json_real((double)bs.prefetched / 1e6));
	json_object_set_new(o, "experts", json_integer((json_int_t)bs.experts));
	json_object_set_new(o, "experts_ms", json_real(bs.experts_ms));
	json_object_set_new(o, "route_wait_ms", json_real(bs.route_wait_ms));
	json_object_set_new(o, "route_wait_step_ms", json_real(bs.route_wait_step_ms));
	json_object_set_new(o, "experts_span_ms", json_real(bs.experts_span_ms));
	json_object_set_new(o, "expert_layers", json_integer((json_int_t)bs.expert_layers));
	json_object_set_new(o, "experts_span_bytes", json_integer((json_int_t)bs.experts_span_bytes));
	json_object_set_new(o, "experts_span_ms_multi", json_real(bs.experts_span_ms_multi));
	json_object_set_new(o, "expert_layers_multi", json_integer((json_int_t)bs.expert_layers_multi));
	json_object_set_new(o, "experts_span_bytes_multi", json_integer((json_int_t)bs.experts_span_bytes_multi));
	json_object_set_new(o, "experts_phase_wait_ms", json_real(bs.experts_phase_wait_ms));
	json_object_set_new(o, "phase_wait_ms", json_real(bs.phase_wait_ms));
	json_object_set_new(o, "experts_gap_gpu_ms", json_real(bs.experts_gap_gpu_ms));
	json_object_set_new(o, "experts_gap_host_ms", json_real(bs.experts_gap_host_ms));
	json_object_set_new(o, "expert_gaps", json_integer((json_int_t)bs.expert_gaps));
	json_object_set_new(o, "experts_step_gap_ms", json_real(bs.experts_step_gap_ms));
	json_object_set_new(o, "expert_step_gaps", json_integer((json_int_t)bs.expert_step_gaps));
	json_object_set_new(o, "experts_step_tail_ms", json_real(bs.experts_step_tail_ms));
	json_object_set_new(o, "step_begin_host_ms", json_real(bs.step_begin_host_ms));
	json_object_set_new(o, "step_begin_wait_ms", json_real(bs.step_begin_wait_ms));
	json_object_set_new(o, "step_begin_gpu_embed_ms", json_real(bs.step_begin_gpu_embed_ms));
	json_object_set_new(o, "step_begin_gpu_attn_ms", json_real(bs.step_begin_gpu_attn_ms));
	json_object_set_new(o, "step_begin_gpu_router_ms", json_real(bs.step_begin_gpu_router_ms));
	json_object_set_new(o, "step_begins", json_integer((json_int_t)bs.step_begins));
	return o;
}

/* The decode steps' routing (engine_moe_routing): steps counted, experts a layer and step on
 * average, and the HOT experts chosen most often (layer, expert, share of the layer's steps). NULL
 * for a model without experts or before the engine exists. */
#define MOE_HOT 8
static json_t *moe_stats(const struct runner *r)
{
	const uint32_t *routed, *steps;
	if (!r->engine || !r->cfg.n_experts)
		return NULL;
	engine_moe_routing(r->engine, &routed, &steps);
	if (!routed)
		return NULL;
	const uint32_t L = r->cfg.n_layers, E = r->cfg.n_experts;
	uint64_t total = 0, layer_steps = 0, most = 0;
	uint32_t moe_layers = 0;
	for (uint32_t l = 0; l < L; l++) {
		if (!steps[l])
			continue;
		moe_layers++;
		layer_steps += steps[l];
		most = steps[l] > most ? steps[l] : most;
		for (uint32_t x = 0; x < E; x++)
			total += routed[(size_t)l * E + x];
	}
	/* The hottest, by their share of their layer's steps (a partial selection: few of them). */
	uint32_t hot_l[MOE_HOT], hot_x[MOE_HOT], n_hot = 0;
	double hot_s[MOE_HOT];
	for (uint32_t l = 0; l < L; l++) {
		if (!steps[l])
			continue;
		for (uint32_t x = 0; x < E; x++) {
			double sh = (double)routed[(size_t)l * E + x] / (double)steps[l];
			if (sh <= 0 || (n_hot == MOE_HOT && sh <= hot_s[MOE_HOT - 1]))
				continue;
			uint32_t i = n_hot < MOE_HOT ? n_hot++ : MOE_HOT - 1;
			while (i > 0 && hot_s[i - 1] < sh) {
				hot_s[i] = hot_s[i - 1];
				hot_l[i] = hot_l[i - 1];
				hot_x[i] = hot_x[i - 1];
				i--;
			}
			hot_s[i] = sh;
			hot_l[i] = l;
			hot_x[i] = x;
		}
	}
	json_t *hot = json_array();
	for (uint32_t i = 0; hot && i < n_hot; i++)
		json_array_append_new(hot, json_pack("[i, i, f]", (int)hot_l[i], (int)hot_x[i], hot_s[i]));
	return json_pack("{s:I, s:i, s:I, s:f, s:o}", "decode_steps", (json_int_t)most, "layers", (int)moe_layers,
			 "routed", (json_int_t)total, "experts_per_step",
			 layer_steps ? (double)total / (double)layer_steps : 0.0, "hot", hot ? hot : json_array());
}

/* The host profile (tuning.c, profile-host) once it has counted: [module, offset, nearest exported
 * symbol or null, samples] for the addresses sampled most; `addr2line -f -e MODULE OFFSET` names
 * the function of each. */
static json_t *host_profile_stats(void)
{
	struct host_profile_entry top[RUNNER_PROFILE_TOP];
	uint64_t total = 0;
	size_t n = host_profile_top(top, RUNNER_PROFILE_TOP, &total);
	if (!total && !host_profile_running())
		return NULL;
	json_t *list = json_array();
	for (size_t i = 0; list && i < n; i++) {
		char off[32];
		snprintf(off, sizeof(off), "0x%llx", (unsigned long long)top[i].offset);
		json_array_append_new(list, json_pack("[s, s, s?, I]", top[i].module, off, top[i].symbol,
						      (json_int_t)top[i].samples));
	}
	return json_pack("{s:b, s:i, s:I, s:o}", "running", host_profile_running(), "hz_asked", RUNNER_PROFILE_HZ,
			 "samples", (json_int_t)total, "top", list ? list : json_array());
}

char *runner_stats(void *ctx)
{
	struct runner *r = ctx;
	struct kv_cache_stats ks = {0};
	/* Every cache's (batching: one a request running at once). */
	for (uint32_t k = 0; k < r->n_slots; k++)
		if (r->slot_kv[k])
			kv_cache_add_stats(r->slot_kv[k], &ks);
	struct weight_source *ws = r->ring ? runner_weights(r) : NULL;
	json_t *o = json_pack("{s:s, s:I, s:I, s:I, s:I, s:f, s:f, s:f, s:f, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:b, "
			      "s:I}",
			      "backend", r->backend_name, "requests", (json_int_t)r->requests, "failures",
			      (json_int_t)r->failures, "prompt_tokens", (json_int_t)r->prompt_tokens,
			      "tokens_generated", (json_int_t)r->tokens_generated, "prefill_ms", r->prefill_ms,
			      "decode_ms", r->decode_ms, "last_prefill_tok_s", r->last_prefill_tok_s,
			      "last_decode_tok_s", r->last_decode_tok_s, "weight_bytes_acquired",
			      (json_int_t)(ws ? ws->bytes_acquired : 0), "weight_acquires",
			      (json_int_t)(ws ? ws->acquires : 0), "kv_blocks_committed", (json_int_t)ks.committed,
			      "kv_blocks_fetched", (json_int_t)ks.fetched, "kv_gpu_blocks", (json_int_t)r->bp.n_kv_blocks,
			      "kv_block_bytes", (json_int_t)r->arena_block_bytes, "queued", (json_int_t)r->q_len,
			      "weights_all_resident", r->ring ? ring_source_all_resident(r->ring) : 0, "max_context",
			      (json_int_t)r->max_context);
	if (o) {
		json_object_set_new(o, "experts_ahead",
				    json_integer((json_int_t)(r->ring ? ring_source_experts_ahead(r->ring) : 0)));
		json_object_set_new(o, "kv_prefix_lookups", json_integer((json_int_t)ks.prefix_lookups));
		json_object_set_new(o, "kv_prefix_positions", json_integer((json_int_t)ks.prefix_positions));
		json_object_set_new(o, "kv_prefix_blocks_on_gpu", json_integer((json_int_t)ks.prefix_on_gpu));
		json_object_set_new(o, "kv_rebuilds", json_integer((json_int_t)ks.recoveries));
		json_object_set_new(o, "kv_fetch_runs", json_integer((json_int_t)ks.fetch_runs));
		json_object_set_new(o, "kv_fetch_cuts", json_integer((json_int_t)ks.fetch_cuts));
		json_object_set_new(o, "kv_fetch_request_ms", json_real((double)ks.fetch_ns / 1e6));
		json_object_set_new(o, "kv_fetch_copy_ms", json_real((double)ks.copy_ns / 1e6));
		json_object_set_new(o, "kv_readahead_blocks", json_integer((json_int_t)ks.readahead_blocks));
		json_object_set_new(o, "kv_readahead_wait_ms", json_real((double)ks.readahead_wait_ns / 1e6));
		if (r->engine) { /* decode steps: their time, and the host's between them (engine_step_stats) */
			struct engine_step_stats es;
			engine_step_stats(r->engine, &es);
			json_t *d = json_pack("{s:I, s:f, s:I, s:f, s:I}", "steps_timed", (json_int_t)es.steps,
					      "in_steps_ms", es.step_ms, "gaps", (json_int_t)es.betweens,
					      "between_steps_ms", es.between_ms, "begins_timed", (json_int_t)es.begins);
			json_t *b = json_object();
			for (int i = 0; b && i < ENGINE_BEGIN_PARTS; i++)
				json_object_set_new(b, engine_begin_part_names[i], json_real(es.begin_ms[i]));
			if (d && b)
				json_object_set_new(d, "begin_ms", b);
			else
				json_decref(b);
			if (d)
				json_object_set_new(o, "decode_step_times", d);
		}
		json_t *moe = moe_stats(r);
		if (moe)
			json_object_set_new(o, "moe", moe);
		json_t *prof = host_profile_stats();
		if (prof)
			json_object_set_new(o, "host_profile", prof);
		/* Continuous batching: requests running now, the most at once, and per step on average the
		 * sequences and tokens computed together. */
		json_object_set_new(o, "batch",
				    json_pack("{s:b, s:i, s:i, s:i, s:i, s:I, s:f, s:f}", "on", r->batching, "max_batch",
					      (int)r->n_slots, "max_step_tokens", (int)r->max_step_tokens, "running",
					      (int)r->n_active, "most_at_once", (int)r->max_seqs_seen, "batched_steps",
					      (json_int_t)r->batch_steps, "seqs_per_step",
					      r->batch_steps ? (double)r->batch_seqs / (double)r->batch_steps : 0.0,
					      "tokens_per_step",
					      r->batch_steps ? (double)r->batch_tokens / (double)r->batch_steps : 0.0));
	}
#ifdef PIPELINE_HAVE_CUDA
	if (o && r->win) {
		struct gpu_window_stats ws2;
		gpu_window_stats(r->win, &ws2);
		json_object_set_new(o, "predicted_ms_per_token", json_real(r->predicted_ms));
		json_object_set_new(o, "binding", json_string(r->binding ? r->binding : ""));
		json_t *g = json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:i, s:f, s:f, s:I}", "resident_groups",
				      (json_int_t)ws2.resident_groups, "streamed_groups", (json_int_t)ws2.streamed_groups,
				      "resident_bytes", (json_int_t)ws2.resident_bytes, "window_bytes",
				      (json_int_t)ws2.window_bytes, "streamed_bytes_per_token",
				      (json_int_t)ws2.streamed_bytes_per_token, "bytes_h2d", (json_int_t)ws2.bytes_h2d,
				      "copies", (json_int_t)ws2.copies, "late_copies", (json_int_t)ws2.late_copies, "depth",
				      (int)ws2.depth, "h2d_bytes_per_s", ws2.h2d_bytes_per_s, "copy_ms", ws2.copy_ms,
				      "timed_copies", (json_int_t)ws2.timed_copies);
		if (g) {
			json_object_set_new(g, "split_groups", json_integer(ws2.split_groups));
			json_object_set_new(g, "expert_depth", json_integer(ws2.expert_depth));
			json_object_set_new(g, "copy_wait_ms", json_real(ws2.copy_wait_ms));
			json_object_set_new(g, "copy_ms_decode", json_real(ws2.copy_ms_decode));
			json_object_set_new(g, "timed_copies_decode", json_integer((json_int_t)ws2.timed_copies_decode));
			json_object_set_new(g, "timed_waits", json_integer((json_int_t)ws2.timed_waits));
			json_object_set_new(g, "waits", json_integer((json_int_t)ws2.waits));
			json_object_set_new(g, "h2d_beside_cpu_bytes_per_s", json_real(ws2.h2d_beside_cpu_bytes_per_s));
			json_object_set_new(g, "spread", json_boolean(ws2.spread));
			json_object_set_new(g, "experts_passed", json_integer((json_int_t)ws2.experts_passed));
			json_object_set_new(g, "bytes_h2d_decode", json_integer((json_int_t)ws2.bytes_h2d_decode));
			json_object_set_new(g, "experts_cpu", json_integer((json_int_t)ws2.experts_cpu));
			json_object_set_new(g, "experts_cpu_bytes", json_integer((json_int_t)ws2.experts_cpu_bytes));
			json_object_set_new(g, "experts_guessed", json_integer((json_int_t)ws2.experts_guessed));
			json_object_set_new(g, "guess_hits", json_integer((json_int_t)ws2.guess_hits));
			json_object_set_new(g, "guess_missed", json_integer((json_int_t)ws2.guess_missed));
			json_object_set_new(g, "experts_split", json_integer((json_int_t)ws2.experts_split));
			json_object_set_new(g, "experts_split_cpu_bytes",
					    json_integer((json_int_t)ws2.experts_split_cpu_bytes));
			json_object_set_new(g, "step_resets", json_integer((json_int_t)ws2.step_resets));
			json_object_set_new(g, "host_ms", json_real(ws2.host_ms));
			json_t *by = json_object(), *calls = json_object();
			for (int i = 0; i < GW_HOST_OPS; i++) {
				json_object_set_new(by, gw_host_op_names[i], json_real(ws2.host_ms_op[i]));
				json_object_set_new(calls, gw_host_op_names[i], json_integer((json_int_t)ws2.host_calls_op[i]));
			}
			json_object_set_new(by, "copy_calls", json_real(ws2.host_ms_copy));
			json_object_set_new(by, "poll", json_real(ws2.host_ms_poll));
			json_object_set_new(g, "host_ms_by", by);
			json_object_set_new(g, "host_calls", calls);
			json_object_set_new(g, "pins_kept", json_integer(ws2.pins_kept));
			json_object_set_new(g, "one_copy_groups", json_integer(ws2.one_copy_groups));
			json_object_set_new(g, "experts_resident", json_integer(ws2.experts_resident));
			json_object_set_new(g, "experts_resident_routing", json_real(ws2.expert_heat_resident));
			json_object_set_new(g, "expert_replans", json_integer((json_int_t)r->expert_replans));
			json_object_set_new(g, "rates_from_jobs", json_boolean(ws2.rates_from_jobs));
			json_object_set_new(g, "expert_rate_from_spans", json_real(ws2.expert_rate_jobs));
			json_object_set_new(g, "expert_rate_from_spans_multi", json_real(ws2.expert_rate_jobs_multi));
			json_object_set_new(g, "expert_lead_ms", json_real(ws2.expert_lead_ms));
			json_object_set_new(g, "ends_measured", json_integer((json_int_t)ws2.ends_measured));
			json_object_set_new(g, "ends_gpu_late_ms", json_real(ws2.ends_gpu_late_ms));
			json_object_set_new(g, "ends_cpu_late_ms", json_real(ws2.ends_cpu_late_ms));
			json_object_set_new(g, "ends_lag_ms", json_real(ws2.ends_lag_ms));
			json_object_set_new(g, "refill_bytes", json_integer((json_int_t)ws2.refill_bytes));
			json_object_set_new(g, "split_balance_token", json_boolean(ws2.split_balance_token));
			json_object_set_new(g, "cpu_bytes_per_token", json_integer((json_int_t)ws2.cpu_bytes_per_token));
			json_object_set_new(g, "split_gaps_ms", json_real(ws2.split_gaps_ms));
			json_object_set_new(g, "prefill_copy_bytes", json_integer((json_int_t)ws2.side_bytes));
			json_object_set_new(g, "prefill_copies", json_integer((json_int_t)ws2.side_copies));
			json_object_set_new(g, "prefill_copy_bytes_h2d", json_integer((json_int_t)ws2.side_bytes_h2d));
			json_object_set_new(g, "cpu_shares", json_integer((json_int_t)ws2.cpu_shares));
			json_t *rates = json_object();
			for (uint32_t f = 0; rates && f < DT_COUNT; f++)
				if (gpu_window_cpu_rate(r->win, (enum dtype)f) > 0)
					json_object_set_new(rates, dtype_name((enum dtype)f),
							    json_real(gpu_window_cpu_rate(r->win, (enum dtype)f)));
			json_object_set_new(g, "cpu_bytes_per_s", rates ? rates : json_null());
			json_object_set_new(o, "gpu_window", g);
		}
	}
#endif
	if (o)
		json_object_set_new(o, "cpu_share", cpu_share_stats(r));
	if (o && r->ranks > 1) { /* a split model: this rank's part and the formation */
		char members[4096], text[4100];
		runner_stage_stats(r, members, sizeof(members));
		snprintf(text, sizeof(text), "{%s}", members);
		json_t *st = json_loads(text, 0, NULL);
		if (st)
			json_object_set_new(o, "stages", st);
	}
	if (o)
		inspect_stats(r, o);
	if (o) {
		json_object_set_new(o, "tokenizer", json_boolean(r->tok != NULL));
		json_object_set_new(o, "chat_format", json_string(r->chat_template ? "template"
										 : chat_format_name(chat_format_of(r->tok))));
	}
	char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
	json_decref(o);
	return text;
}

/* gpu-runner: owns compute, the runner's KV arena, scheduling, sampling and the generate
 * API. Weights come from the ssd-loader's ring, KV blocks go to and come from the kv-store
 * pool; this process never opens a model file.
 *
 * Requests are queued and run one at a time, or, where the backend batches sequences, up to
 * --max-batch of them together (batch.c: continuous batching); while requests run, the service
 * keeps answering between tokens (HELLO, stats, more requests to queue). Before each request
 * it checks that the ssd-loader and kv-store it mapped are still the live owners of their
 * shared memory, and reconnects if one was restarted.
 *
 * This file: the flags (--help), start (the backend, the peers, the KV cache and the engine),
 * the main loop and teardown. The parts it starts are in runner.h.
 *
 * With --ranks N (several GPUs: stages/stages.h) N runners split the model's layers: rank 0 is the
 * service "gpu-runner" and serves requests, rank r the service "gpu-runner-r", computing its layers for
 * rank 0's steps. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/jinja/jinja.h"
#include "common/bus.h"
#include "common/config.h"
#include "common/log.h"
#include "common/service.h"
#include "common/tokenizer/tokenizer.h"
#include "common/util.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/kv_cache.h"
#include "services/gpu-runner/runner.h"
#include "services/gpu-runner/weights_ring.h"

#define CONNECT_TIMEOUT_MS 120000

static void hello(void *ctx, const struct msg *req, struct msg_hello_reply *rep)
{
	struct runner *r = ctx;
	rep->manifest_hash = r->manifest_hash;
}

static const struct service_ops runner_ops = {.handle = runner_handle, .stats = runner_stats, .hello = hello};

static int setup(struct runner *r)
{
	char err[1024];
	if (!backend_known(r->backend_name)) {
		if (!strcmp(r->backend_name, "cuda"))
			log_error("the cuda backend is not built into this gpu-runner (built without nvcc, or not yet "
				  "available); use --backend cpu");
		else
			log_error("unknown backend '%s' (cpu or cuda)", r->backend_name);
		return -EINVAL;
	}
	if (r->block_tokens < 1 || r->block_tokens > 4096 || r->prefill_chunk < 1 || r->prefill_chunk > 65536 ||
	    r->threads < 1 || r->threads > 1024 || r->max_context < 0 || r->timeout_ms < 100) {
		log_error("--kv-block-tokens (1..4096), --prefill-chunk (1..65536), --threads (1..1024), --max-context "
			  "(>= 0) or --timeout-ms (>= 100) out of range");
		return -EINVAL;
	}
	r->zctx = zmq_ctx_new();
	r->loader_c = rpc_client_create(r->zctx, r->run_dir, "ssd-loader", r->service_name);
	r->kv_c = rpc_client_create(r->zctx, r->run_dir, "kv-store", r->service_name);
	if (!r->zctx || !r->loader_c || !r->kv_c) {
		log_error("cannot create sockets under %s: %s", r->run_dir, strerror(errno));
		return -EIO;
	}
	/* One session for this process: a service that sees it again after a reconnect knows the
	 * blocks and slots it holds are still ours. */
	uint64_t session = random_u64() | 1;
	rpc_client_set_session(r->loader_c, session);
	rpc_client_set_session(r->kv_c, session);
	/* Several ranks: none of the model's groups until this rank's layers are planned (below). */
	if (r->ranks > 1)
		r->stage = (struct weight_stage){.split = true, .first = r->rank == 0};
	log_info("waiting for ssd-loader");
	int rc = runner_connect_loader_retry(r, CONNECT_TIMEOUT_MS, err, sizeof(err));
	if (rc) {
		log_error("%s", err);
		return rc;
	}
	r->cfg = *ring_source_base(r->ring)->cfg;
	r->manifest_hash = ring_source_manifest_hash(r->ring);
	if (r->max_context == 0)
		r->max_context = r->cfg.max_position < 8192 ? r->cfg.max_position : 8192;
	if ((uint64_t)r->max_context > r->cfg.max_position) {
		log_warn("--max-context %ld exceeds the model's max_position_embeddings %u; using %u", r->max_context,
			 r->cfg.max_position, r->cfg.max_position);
		r->max_context = r->cfg.max_position;
	}
	if ((rc = runner_plan_stages(r, err, sizeof(err))) != 0) {
		log_error("%s", err);
		return rc;
	}
	enum dtype kv_dtype;
	if (!r->kv_dtype_name || !*r->kv_dtype_name)
		kv_dtype = strcmp(r->backend_name, "cpu") ? DT_BF16 : DT_F32;
	else if (!strcmp(r->kv_dtype_name, "f32"))
		kv_dtype = DT_F32;
	else if (!strcmp(r->kv_dtype_name, "bf16"))
		kv_dtype = DT_BF16;
	else {
		log_error("--kv-dtype '%s' is not f32 or bf16", r->kv_dtype_name);
		return -EINVAL;
	}
	rc = runner_setup_cpu_share(r, err, sizeof(err));
	if (rc) {
		log_error("%s", err);
		return rc;
	}
	r->bp = (struct backend_params){.max_chunk = (uint32_t)r->prefill_chunk,
					.block_tokens = (uint32_t)r->block_tokens,
					.kv_dtype = kv_dtype,
					.threads = (uint32_t)r->threads,
					.cpu_pool = r->cpu_pool,
					.cpu_handoff = r->cpu_handoff,
					.cpu_result_mapped = r->cpu_result_mapped,
					.cpu_result_polled = r->cpu_result_polled,
					.cpu_dispatch_poll = r->cpu_dispatch_poll,
					.cpu_dispatch_workers = r->cpu_dispatch_workers,
					.cpu_prefetch = r->cpu_prefetch,
					.cpu_expert_taper = r->cpu_expert_taper,
					.cpu_expert_chunk = r->cpu_expert_chunk,
					.experts_apart = r->experts_apart,
					.moe_host_route = r->moe_host_route};
	r->arena_block_bytes = backend_kv_block_bytes(r->backend_name, &r->cfg, &r->bp);
	r->pool_block_bytes = ALIGN_UP((uint64_t)r->arena_block_bytes, 4096);
	/* Blocks are reused only by a runner that would compute the same bytes: same model, same
	 * backend, same KV element type and block size. */
	r->kv_seed = fnv1a64(FNV64_INIT, &r->manifest_hash, sizeof(r->manifest_hash));
	r->kv_seed = fnv1a64(r->kv_seed, r->backend_name, strlen(r->backend_name));
	r->kv_seed = fnv1a64(r->kv_seed, &r->bp.kv_dtype, sizeof(r->bp.kv_dtype));
	r->kv_seed = fnv1a64(r->kv_seed, &r->bp.block_tokens, sizeof(r->bp.block_tokens));
	r->kv_seed |= 1;
	uint32_t per_layer = (uint32_t)((r->max_context + r->block_tokens - 1) / r->block_tokens);
	uint32_t own_layers = r->stage.split ? r->stage.layer1 - r->stage.layer0 : r->cfg.n_layers;
	uint64_t all = (uint64_t)per_layer * own_layers;
	uint64_t fit = r->kv_gpu_budget / r->arena_block_bytes;
	uint32_t need = kv_cache_min_blocks(own_layers, (uint32_t)r->block_tokens, (uint32_t)r->prefill_chunk);
	if (fit < need && fit < all) {
		char have[32], want[32];
		log_error("--kv-gpu-budget %s holds %llu KV blocks of %zu bytes; at least %u blocks (%s) are needed",
			  format_size(r->kv_gpu_budget, have, sizeof(have)), (unsigned long long)fit,
			  r->arena_block_bytes, need, format_size((uint64_t)need * r->arena_block_bytes, want, sizeof(want)));
		return -ENOSPC;
	}
	if (r->max_batch < 0 || r->max_batch > RUNNER_MAX_BATCH || r->max_step_tokens < 0 ||
	    r->max_step_tokens > r->prefill_chunk) {
		log_error("--max-batch must be in 0..%d and --max-step-tokens in 0..%ld (--prefill-chunk; 0: that)",
			  RUNNER_MAX_BATCH, r->prefill_chunk);
		return -EINVAL;
	}
	if (!r->max_step_tokens)
		r->max_step_tokens = r->prefill_chunk;
	runner_plan_batch(r, all, fit, need, &r->bp.n_kv_blocks);
	rc = backend_create(r->backend_name, &r->cfg, &r->bp, &r->be, err, sizeof(err));
	if (rc) {
		log_error("backend %s: %s", r->backend_name, err);
		return rc;
	}
	if (r->prefetch_depth < 1 || r->prefetch_depth > 64 || r->copy_streams < 1 || r->copy_streams > 4) {
		log_error("--prefetch-depth (1..64) or --copy-streams (1..4) out of range");
		return -EINVAL;
	}
	if (r->expert_depth < 0 || r->expert_depth > 64) {
		log_error("--expert-depth %ld: want 0 (the experts chosen a layer, at least --prefetch-depth) or 1..64",
			  r->expert_depth);
		return -EINVAL;
	}
	rc = runner_make_window(r, err, sizeof(err));
	if (rc) {
		log_error("%s", err);
		return rc;
	}
	rc = runner_make_cache(r, err, sizeof(err));
	if (rc) {
		log_error("%s", err);
		return rc;
	}
	r->kv.wait_hook = runner_wait_beat;
	r->kv.wait_ctx = r;
	/* A later rank of a split model connects with the session of its formation (stage.c). */
	if (r->rank == 0) {
		log_info("waiting for kv-store");
		rc = runner_connect_kv(r, CONNECT_TIMEOUT_MS, err, sizeof(err));
		if (rc) {
			log_error("%s", err);
			return rc;
		}
	}
	rc = runner_make_front(r, err, sizeof(err));
	if (rc == 0)
		rc = runner_make_engine(r, err, sizeof(err));
	if (rc) {
		log_error("%s", err);
		return rc;
	}
	log_info("backend %s, %u layers, KV arena %u blocks of %zu bytes (%ld tokens each), context %ld", r->backend_name,
		 r->cfg.n_layers, r->bp.n_kv_blocks, r->arena_block_bytes, r->block_tokens, r->max_context);
	if (r->batching)
		log_info("continuous batching: up to %u requests at once (sharing the KV arena), steps of at most %ld "
			 "tokens", r->n_slots, r->max_step_tokens);
	return 0;
}

static void teardown(struct runner *r)
{
	engine_destroy(&r->engine);
	runner_drop_stages(r); /* the link reads the backend's memory: it goes first */
	runner_unpin_pool(r); /* the backend that pinned the pool unpins it, before it goes */
	runner_drop_caches(r);
	backend_destroy(&r->be);
	kv_remote_disconnect(&r->kv);
	runner_drop_window(r);
	task_pool_destroy(&r->cpu_pool); /* after the backend and the window that used it */
	free(r->cpu_split_r);
	free(r->expert_heat);
	free(r->heat_weight);
	free(r->batch_logits);
	ring_source_destroy(&r->ring);
	tokenizer_destroy(&r->tok);
	jinja_free(&r->chat_template);
	rpc_client_destroy(&r->loader_c);
	rpc_client_destroy(&r->kv_c);
	if (r->zctx)
		zmq_ctx_term(r->zctx);
	runner_drop_queued(r);
	service_destroy(&r->svc);
}

int main(int argc, char **argv)
{
	struct runner r = {0};
	char default_run_dir[256];
	const struct opt opts[] = {
		{"instance", OPT_STRING, &r.instance, "default", "instance name (shared-memory names, run directory)"},
		{"run-dir", OPT_STRING, &r.run_dir, NULL, "run directory with the sockets (default /tmp/llmp-UID/INSTANCE)"},
		{"backend", OPT_STRING, &r.backend_name, backend_default_name(), "compute backend: cpu or cuda"},
		{"gpu-budget", OPT_SIZE, &r.gpu_budget, "6GiB", "GPU memory for weights (cuda backend; the cpu backend computes from the ring in place)"},
		{"prefetch-depth", OPT_INT, &r.prefetch_depth, "2",
		 "device slots per streamed group class: copies run this far ahead of compute"},
		{"expert-depth", OPT_INT, &r.expert_depth, "0",
		 "mixture of experts: device slots for the streamed experts (0: as many as a layer's routing chooses, "
		 "at least --prefetch-depth, fewer where --gpu-budget cannot hold them)"},
		{"copy-streams", OPT_INT, &r.copy_streams, "1", "H2D concurrency: weight copies spread over this many streams (1..4)"},
		{"h2d-bytes-per-s", OPT_SIZE, &r.h2d_bps, "0", "host-to-device bandwidth for the plan (0: measure at start)"},
		{"hbm-bytes-per-s", OPT_SIZE, &r.hbm_bps, "2.7TB", "GPU memory bandwidth the prediction assumes for reading weights"},
		{"strict", OPT_BOOL, &r.strict, NULL, "check the GPU window's invariants at every step"},
		{"predict-experts", OPT_BOOL, &r.predict_experts, "true",
		 "mixture of experts, decode: copy the GPU's share of a later layer's streamed experts before its "
		 "routing, from its last routing (one chosen that was not copied goes to the CPU; acts with --cpu-share "
		 "on and the experts in DRAM); false: a layer's experts copied only after its routing"},
		{"experts-apart", OPT_BOOL, &r.experts_apart, NULL,
		 "mixture of experts, cuda, decode: launch each expert the GPU keeps on its own (two products "
		 "each), not a layer's kept experts together in two launches"},
		{"moe-host-route", OPT_BOOL, &r.moe_host_route, NULL,
		 "mixture of experts, cuda, decode: route every layer on the host (wait for the router's logits, "
		 "then launch the chosen experts), also where the GPU keeps all of a layer's experts, whose "
		 "layers are otherwise routed on the device without a wait"},
		{"fixed-experts", OPT_BOOL, &r.fixed_experts, NULL,
		 "keep the experts the first plan made resident (table order): no new plan from the routing counted"},
		{"expert-rate-within", OPT_BOOL, &r.expert_rate_within, "true",
		 "mixture of experts, cpu share auto: fold the rate the CPU's experts ran at into the routes' "
		 "weighing after every token of a request (false: only between requests)"},
		{"balance-ends", OPT_BOOL, &r.balance_ends, "true",
		 "mixture of experts, cuda, cpu share auto, decode: the routes give the link's copies and the CPU's "
		 "experts of a layer what makes them end together as measured at the next layer (the GPU's side "
		 "timed on the stream, the CPU's jobs' ends), not only what the rates say (false: the rates alone)"},
		{"fixed-split", OPT_BOOL, &r.fixed_split, NULL,
		 "keep the CPU share auto chose at start: no new plan from the rate its jobs ran at, and the CPU's "
		 "routed experts weighed at the start's calibrated rate, not the rate they ran at"},
		{"profile-copies", OPT_BOOL, &r.profile_copies, NULL, "time every weight copy (stats: gpu_window.copy_ms)"},
		{"fixed-residency", OPT_BOOL, &r.fixed_residency, NULL,
		 "keep the GPU's resident groups as planned with whole sizes: the memory the CPU share's smaller "
		 "slots free stays unused (by default more groups are kept with it)"},
		{"window-spread", OPT_STRING, &r.window_spread_arg, "auto",
		 "the layer groups the GPU keeps spread among the layers, not the first ones, so the streamed "
		 "layers' copies run beside the kept layers' compute (only where DRAM holds every layer): yes, no, "
		 "or auto (yes where the CPU computes a share of streamed dense FFNs and the GPU keeps every "
		 "attention group)"},
		{"kv-dtype", OPT_STRING, &r.kv_dtype_name, NULL, "KV element type: f32 or bf16 (default: f32 on cpu, bf16 on cuda)"},
		{"kv-gpu-budget", OPT_SIZE, &r.kv_gpu_budget, "1GiB", "memory for the runner's KV blocks"},
		{"kv-block-tokens", OPT_INT, &r.block_tokens, "16", "tokens per KV block"},
		{"max-context", OPT_INT, &r.max_context, "0", "positions per sequence (0: min(model, 8192))"},
		{"prefill-chunk", OPT_INT, &r.prefill_chunk, "256", "most prompt tokens per forward step"},
		{"threads", OPT_INT, &r.threads, "1", "CPU threads of the cpu backend"},
		{"max-batch", OPT_INT, &r.max_batch, "0",
		 "requests computed together, their tokens in every forward step (continuous batching, where one "
		 "runner computes every layer; both backends batch). The KV arena (--kv-gpu-budget) is shared "
		 "among them. 0: 16"},
		{"max-step-tokens", OPT_INT, &r.max_step_tokens, "0",
		 "most tokens of one forward step when batching: decode tokens of the running requests and prefill "
		 "chunks of new ones (0: --prefill-chunk, which bounds it)"},
		{"cpu-share", OPT_STRING, &r.cpu_share_arg, "auto",
		 "the CPU's part of each streamed layer's FFN (rows of gate/up, columns of down, read in place in DRAM): "
		 "auto (cuda: where the CPU and the copies over PCIe finish together; cpu: none), 0 (none), or a "
		 "fraction in (0, 1] of every FFN that may split (cuda: streamed and held in DRAM by the loader; "
		 "cpu: all). Decode steps only: prefill copies the CPU's rows up"},
		{"cpu-share-balance", OPT_STRING, &r.cpu_share_balance_arg, NULL,
		 "how auto chooses the CPU's part: layer (the default: each layer's own, where its copies and its "
		 "CPU rows take equally long: more where its attention streams too) or token (one share for every "
		 "FFN, where the CPU's rows and the copies of a token take equally long)"},
		{"split-gaps", OPT_BOOL, &r.split_gaps, "false",
		 "cuda, cpu share auto, the kept layers spread: the GPU's reads of the layers between two split "
		 "FFNs count on the copies' side (they run through them, while the CPU waits for the next split "
		 "layer's input), so the CPU takes less of each FFN (false, the default: a handoff's time alone; "
		 "P3 on an H200 host measured the two alike)"},
		{"cpu-threads", OPT_INT, &r.cpu_threads, "0",
		 "worker threads of the CPU share, pinned to a CPU each (0: one per CPU the runner may use but the "
		 "runner's own and, on cuda, the handoff's)"},
		{"cpu-handoff", OPT_STRING, &r.cpu_handoff_arg, "auto",
		 "how the cuda stream hands the CPU its share: memops (stream memory operations), hostfunc "
		 "(cudaLaunchHostFunc) or auto (memops where the driver has them)"},
		{"cpu-result", OPT_STRING, &r.cpu_result_arg, "mapped",
		 "how the CPU's partial result of a split FFN reaches the GPU: mapped (a kernel reads it from "
		 "mapped host memory: no copy engine queue), polled (as mapped, the kernel itself waiting for the "
		 "job by polling its completion word in mapped memory, where mapped has the stream wait with "
		 "cuStreamWaitValue32 first; memops handoffs) or copy (cudaMemcpyAsync on the compute stream, "
		 "queued behind the weight copies); for the CPU's experts of a token, mapped also means the "
		 "stream waits for them (the host goes on to the next layer), copy that the host waits at the "
		 "layer's end"},
		{"cpu-dispatch", OPT_STRING, &r.cpu_dispatch_arg, "workers",
		 "memops handoffs: who hands the CPU pool a split FFN's job once the stream has copied its input "
		 "down: the handoff's dispatcher thread (dispatcher); it and the runner's own thread while that "
		 "waits for a step's end (both); it and the pool's idle workers while they spin between jobs "
		 "(workers); all three (all). Whichever sees the job first takes it, so that a dispatcher held off "
		 "its CPU by the OS holds up no job"},
		{"cpu-expert-chunks", OPT_STRING, &r.cpu_expert_chunks_arg, "taper",
		 "how a routed expert's job on the CPU is cut: taper (each phase's chunks smaller toward its end "
		 "where the phase has 12 or more, so that with a layer's experts at once the workers that wait "
		 "for a phase's last chunks wait for small ones) or equal (equal chunks); the same results "
		 "either way"},
		{"cpu-pin-runner", OPT_STRING, &r.cpu_pin_runner_arg, "yes",
		 "with a CPU pool beside a GPU, the runner's own thread (it drives the stream and hands the "
		 "pool its jobs) kept on the CPUs the workers leave it (yes), or left to the scheduler (no), "
		 "which may place it beside a worker pinned to its CPU, each then holding the other up"},
		{"cpu-expert-chunk", OPT_SIZE, &r.cpu_expert_chunk, "256KiB",
		 "about how many weight bytes a chunk of a routed expert's job on the CPU reads (16KiB..16MiB): "
		 "finer chunks spread a layer of few experts over more workers, each chunk's start paid more "
		 "often; the same results either way"},
		{"cpu-prefetch", OPT_STRING, &r.cpu_prefetch_arg, "auto",
		 "with --cpu-dispatch workers or all: while a split FFN's CPU share is submitted and its input not "
		 "yet come, the pool's idle workers read up to SIZE of its weight bytes into the caches, in the "
		 "order its parts read them: auto (24MiB, at most half the L3 cache, where the handoff is not "
		 "hostfunc and the workers dispatch; else none), 0 (none) or SIZE; the same results either way"},
		{"cpu-prefetch-plan", OPT_STRING, &r.cpu_prefetch_plan_arg, "no",
		 "with --cpu-share auto: the balance counts the bytes --cpu-prefetch reads ahead of each split FFN's "
		 "CPU share as read (yes: the CPU gets that many bytes' time more of each FFN, at most its share "
		 "without them), or not (no; not measured yet)"},
		{"split-experts", OPT_STRING, &r.split_experts_arg, "auto",
		 "mixture of experts, cuda, decode with the CPU's share: split a chosen expert between the copies "
		 "(its first rows) and the CPU (the rest, from DRAM) so that both end together: auto (experts whose "
		 "copy takes 1 ms or more, such as Mixtral's; their layers are not guessed ahead), always (tests), or "
		 "off (each expert whole to one side)"},
		{"cpu-experts", OPT_STRING, &r.cpu_experts_arg, "route",
		 "when the experts a route leaves for the CPU, and the CPU's shares of those it splits, go to its "
		 "pool: route (right after the layer's routing, before the GPU's experts are queued and a split "
		 "expert's copy issued) or visit (at their place among the layer's experts)"},
		{"ranks", OPT_INT, &r.ranks, "1",
		 "runners the model's layers are split across, one per GPU (2..8; each takes a contiguous range)"},
		{"rank", OPT_INT, &r.rank, "0",
		 "this runner's place among them: 0 embeds, computes the first layers and the head and serves "
		 "requests (service gpu-runner); rank R computes later layers (service gpu-runner-R)"},
		{"gpu", OPT_INT, &r.gpu, "-1", "CUDA device to compute on (-1: the default device)"},
		{"stage-link", OPT_STRING, &r.stage_link_arg, "auto",
		 "how the hidden state passes between ranks: nccl (device to device), shm (through shared "
		 "memory) or auto (nccl on the cuda backend where built and --gpu names this rank's device, "
		 "else shm)"},
		{"stage-split", OPT_STRING, &r.stage_split_arg, NULL,
		 "the first layer of each rank after rank 0, comma-separated (default: planned so that every rank "
		 "takes about the same time per token)"},
		{"timeout-ms", OPT_INT, &r.timeout_ms, "60000", "how long to wait for a reply from another service (the KV pool's configuration at least 120 s, the kv-store's process watched)"},
		{"log-level", OPT_STRING, &r.log_level, "info", "debug, info, warn or error"},
		{0},
	};
	int rc = config_parse("gpu-runner",
			      "Computes the model: takes weights from the ssd-loader's ring, keeps KV in its arena and the "
			      "kv-store, serves generate requests.",
			      opts, argc, argv, NULL, NULL);
	if (rc > 0)
		return 0;
	if (rc < 0)
		return 2;
	char flag_err[256];
	if (runner_parse_stage_flags(&r, flag_err, sizeof(flag_err)) != 0) {
		fprintf(stderr, "gpu-runner: %s\n", flag_err);
		return 2;
	}
	log_init(r.service_name);
	enum log_level lv;
	if (log_parse_level(r.log_level, &lv) != 0) {
		fprintf(stderr, "gpu-runner: --log-level '%s' is not debug, info, warn or error\n", r.log_level);
		return 2;
	}
	log_set_level(lv);
	if (r.gpu >= 0 && backend_use_device(r.backend_name, (int)r.gpu, flag_err, sizeof(flag_err)) != 0) {
		fprintf(stderr, "gpu-runner: %s\n", flag_err);
		return 2;
	}
	if (runner_parse_cpu_flags(&r, flag_err, sizeof(flag_err)) != 0) {
		fprintf(stderr, "gpu-runner: %s\n", flag_err);
		return 2;
	}
	if (!r.run_dir) {
		if (run_dir_default(r.instance, default_run_dir, sizeof(default_run_dir)) != 0) {
			fprintf(stderr, "gpu-runner: run directory path too long\n");
			return 2;
		}
		r.run_dir = default_run_dir;
	}
	if (run_dir_prepare(r.run_dir) != 0)
		return 1;
	rc = setup(&r);
	if (rc == 0) {
		r.svc = service_create(r.service_name, r.run_dir, &runner_ops, &r);
		if (!r.svc)
			rc = -EIO;
		else
			runner_register_tunables(&r);
	}
	if (rc) {
		teardown(&r);
		return 1;
	}
	while (service_poll_once(r.svc, r.q_len || r.n_active ? 0 : 100) == 0) {
		if (!r.q_len && !r.n_active) {
			runner_release_dead_loader(&r);
			runner_idle_stages(&r);
			runner_between_requests(&r);
			continue;
		}
		if (r.batching)
			runner_batch_step(&r);
		else
			runner_run_next(&r);
	}
	log_info("stopping");
	runner_batch_drop(&r);
	teardown(&r);
	return 0;
}

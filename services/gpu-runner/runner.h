/* runner.h - what the parts of the gpu-runner executable share (internal: not part of runner_core).
 * struct runner is the one process-wide state: options, the peers' clients and mappings, the
 * backend, KV cache and engine, the request queue and the counters. Each part works on it:
 *   peers.c     the ssd-loader and kv-store: connect, reconnect, the weight source, KV pool pinning
 *   requests.c  the queue, running a generate job, its replies
 *   stats.c     the stats JSON, with what pipeline-inspect shows
 *   tuning.c    the live tunables and the fixed values `pipectl tune` lists
 *   stage.c     a model split across runners (stages/stages.h): the layers of this rank, and a later
 *               rank's side (MSG_STAGE_SETUP, _SEQ, _STEP)
 *   main.c      flags, start, the main loop and teardown
 * Functions return 0 or -errno and write a message into err where they take one. */
#ifndef GPU_RUNNER_RUNNER_H
#define GPU_RUNNER_RUNNER_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/bus.h"
#include "common/model.h"
#include "common/protocol.h"
#include "common/service.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/generate.h"
#include "services/gpu-runner/kv_remote.h"
#include "services/gpu-runner/split_plan.h"
#include "services/gpu-runner/text.h"
#include "services/gpu-runner/stages/plan.h"

#define QUEUE_MAX 128 /* requests queued at most (the runner may run --max-batch of them besides) */
#define RUNNER_PROFILE_HZ 1000 /* samples a second asked of the host profile (tuning.c: profile-host) */
#define RUNNER_PROFILE_TOP 100 /* addresses the stats list of it */
/* Most sequences one step computes (--max-batch), and how many when it says 0. */
#define RUNNER_MAX_BATCH 64
#define RUNNER_DEFAULT_BATCH 16

struct runner;

struct job {
	struct runner *r;	 /* the runner it runs in (the callbacks' context is the job) */
	struct bus_peer peer;
	uint64_t corr;
	int32_t *tokens; /* the prompt as ids, when the request gave ids */
	uint32_t n_tokens;
	int32_t *stop;	 /* the request's stop ids, room for one more (a chat's end of turn) */
	int32_t *done;	 /* a resumed request's tokens generated before the cut (params.done), or NULL */
	uint32_t n_done_asked;	 /* how many the client gave (params.n_done grows when a stage resumes it) */
	uint32_t max_context;	 /* the context its run took (max-context is tunable; a resume keeps it) */
	struct gen_params params;
	int32_t *emitted;	 /* every token sent so far (a resumed request's done ones first), for a
				  * resume in this runner when a stage of a split model died */
	uint32_t n_emitted, cap_emitted;
	bool logits_sent;	 /* GEN_LOGITS: sent (a resume does not send them again) */
	uint64_t flags;	 /* enum gen_flags */
	char *prompt, *chat, *stop_strings; /* owned copies, NULL when not given */
	uint32_t prompt_len, chat_len, stop_strings_len;
	/* Once it runs (runner_job_prepare): */
	struct text_prompt tp;	 /* a text or chat prompt's ids */
	const int32_t *ids;	 /* the prompt's ids (the request's, or tp's) */
	uint32_t n_ids;
	struct text_stream *ts;	 /* its text, when it wants text or has stop strings */
	struct gen_seq *g;	 /* batched: its generation (batch.c) */
	uint32_t slot;		 /* batched: its KV cache, r->slot_kv[slot] */
	uint64_t queued_ns;	 /* when it was queued (runner_ensure_connections' hold) */
	bool refused;		 /* it failed of itself: its input refused (runner_job_prepare, a prompt
				  * longer than the context), not a peer: runner_job_reply checks no peer */
};

struct runner {
	/* options */
	const char *instance, *run_dir, *backend_name, *log_level, *kv_dtype_name;
	uint64_t gpu_budget, kv_gpu_budget;
	long block_tokens, threads, max_context, prefill_chunk, timeout_ms, prefetch_depth, copy_streams;
	long expert_depth; /* --expert-depth: the experts' device slots (0: the window's choice) */
	/* live tuning: the start values bound what a tune may set; max_queued caps the queue */
	long start_timeout_ms, start_max_context, max_queued;
	uint64_t h2d_bps, hbm_bps;
	double predicted_ms;	/* per decode token, from the plans of both tiers */
	const char *binding;	/* which limit the prediction says binds */
	bool strict, profile_copies;
	bool fixed_experts;	/* --fixed-experts: no hot-expert re-plans (experts.c) */
	bool experts_apart;	/* --experts-apart: each kept expert launched on its own (cuda, decode) */
	bool moe_host_route;	/* --moe-host-route: no layer routed on the device (cuda, decode) */
	bool predict_experts;	/* --predict-experts: later layers' experts copied on their last routing */
	bool expert_rate_within; /* --expert-rate-within: runner_expert_rate after every token too */
	bool balance_ends;	 /* --balance-ends: the routes learn how a layer's two sides ended */
	bool split_gaps;	 /* --split-gaps: auto's split counts the GPU's work between split layers */
	const char *cpu_share_arg, *cpu_handoff_arg; /* --cpu-share, --cpu-handoff as given */
	const char *cpu_result_arg, *cpu_experts_arg; /* --cpu-result, --cpu-experts as given */
	const char *split_experts_arg;		      /* --split-experts as given */
	uint8_t split_experts;			      /* its enum gw_split_experts (gpu_window.h): 0 off,
						       * 1 auto, 2 always */
	const char *cpu_share_balance_arg;	      /* --cpu-share-balance as given */
	const char *cpu_expert_chunks_arg;	      /* --cpu-expert-chunks as given */
	const char *cpu_pin_runner_arg;		      /* --cpu-pin-runner as given */
	bool cpu_pin_runner;			      /* --cpu-pin-runner yes (the default) */
	const char *window_spread_arg;		      /* --window-spread as given */
	uint32_t window_spread;			      /* --window-spread: 0 no, 1 auto (where the CPU computes a
						       * share of dense FFNs and the GPU keeps every attention
						       * group), 2 yes */
	bool fixed_residency;			      /* --fixed-residency */
	bool cpu_result_mapped;			      /* --cpu-result mapped (the default) or polled */
	bool cpu_result_polled;			      /* --cpu-result polled */
	const char *cpu_dispatch_arg;		      /* --cpu-dispatch as given */
	bool cpu_dispatch_poll;			      /* --cpu-dispatch both or all */
	bool cpu_dispatch_workers;		      /* --cpu-dispatch workers or all */
	bool cpu_experts_early;			      /* --cpu-experts route */
	bool cpu_expert_taper;			      /* --cpu-expert-chunks taper (the default) */
	uint64_t cpu_expert_chunk;		      /* --cpu-expert-chunk: bytes a chunk of an expert's job */
	const char *cpu_prefetch_arg;		      /* --cpu-prefetch as given (auto or a size) */
	const char *cpu_prefetch_plan_arg;	      /* --cpu-prefetch-plan as given (yes, no) */
	uint64_t cpu_prefetch;			      /* --cpu-prefetch: bytes of a split FFN's CPU share read ahead */
	long cpu_threads;			     /* --cpu-threads (0: one per CPU allowed, but one) */
	struct cpu_share_policy cpu_share;	     /* --cpu-share parsed */
	uint32_t cpu_handoff;			     /* enum backend_cpu_handoff */
	struct task_pool *cpu_pool;		     /* the CPU share's workers; NULL: no CPU share */
	uint32_t *cpu_split_r;			     /* the C backend with a fixed share: r per layer (engine) */
	uint64_t cpu_split_bytes;		     /* ... and the weight bytes its CPU shares read per token */

	/* A model split across runners (stage.c): --ranks runners, this one rank --rank, on CUDA device
	 * --gpu; the service is "gpu-runner" for rank 0, "gpu-runner-<rank>" for the others. */
	long rank, ranks, gpu;
	const char *stage_link_arg, *stage_split_arg;
	char service_name[32];
	char stage_link_kind[16];     /* --stage-link resolved: "shm" or "nccl" */
	struct stage_plan stage_plan; /* the ranks' layers, as every rank plans them */
	struct weight_stage stage;    /* this rank's layers (split false: one runner, all) */
	struct stage_front *front;    /* rank 0 of several: forms the ranks, drives their steps */
	struct stage_link *slink;     /* a later rank: the link of the formation it is in (NULL: none) */
	uint64_t formation;	      /* a later rank: that formation */
	int32_t *stage_seq;	      /* a later rank: the sequence's tokens so far (max_context), for KV keys */
	uint32_t stage_seq_n;
	uint64_t stage_steps, stage_forms;
	uint64_t stage_resumes;	      /* rank 0: requests resumed after a stage died under them */
	uint64_t stage_form_try_ns;   /* rank 0: the last try at forming while idle */

	void *zctx; /* for the clients of the other services */
	struct rpc_client *loader_c, *kv_c;
	struct ring_source *ring;
#ifdef PIPELINE_HAVE_CUDA
	struct gpu_window *win; /* the GPU tier of weights, with the cuda backend */
#endif
	/* Hot experts (experts.c): each expert's share of the decode steps whose routing chose it, the
	 * engines' counts folded in as each engine goes (window_plan.h), and the plan of the experts kept
	 * on the GPU made from it between requests. */
	float *expert_heat;	    /* (n_layers, n_experts); NULL: nothing counted yet */
	uint32_t *heat_weight;	    /* (n_layers) the steps it stands for */
	uint64_t expert_replans;    /* windows made anew for hotter experts */
	uint32_t replan_checked;    /* the engine's decode steps when the gain was last asked (experts.c) */
	double h2d_measured;	    /* the first window's H2D rate, given to those made after it */
	/* The CPU share planned anew from its jobs' rate (cpu_share.c, runner_replan_split). */
	bool fixed_split;	    /* --fixed-split: keep the split the calibration chose */
	uint64_t split_replans;	    /* windows made anew for it */
	struct split_jobs split_base; /* the backend's job counters when the window in force was made */
	struct expert_spans expert_base; /* the backend's CPU expert spans when their rate was last asked */
	double expert_rate;	    /* the rate they ran at, given to the window's routes (0: none yet) */
	struct expert_spans expert_base_multi; /* the same in steps of several tokens */
	double expert_rate_multi;   /* ... and their rate (0: none yet) */
	double expert_lead;	    /* the mean gap between two layers' CPU experts (s), given with it */
	double ends_lag;	    /* the lag the window before had learnt (s; balance_ends), for the next */
	struct kv_remote kv;
	void *pool_pinned; /* the KV pool mapping, page-locked for the backend's copies */
	bool loader_suspect, kv_suspect;
	/* The last reconnection that failed (runner_ensure_connections): when, and its error, which
	 * the requests queued before it get at once (within RECONNECT_FAILED_HOLD_MS of it) instead of
	 * a wait of up to 30 s each. */
	uint64_t reconnect_failed_ns;
	int reconnect_failed_rc;
	char reconnect_failed_err[512];
	bool kv_connected; /* a pool was mapped before */
	bool kv_renewed;   /* a new kv-store session since the last connect: the caches forget the old one's blocks */

	struct model_config cfg;
	uint64_t manifest_hash;
	uint64_t kv_seed; /* names model, backend and KV format in KV block keys */
	struct tokenizer *tok; /* from the ring; NULL when the model has no tokenizer.json */
	struct jinja_template *chat_template; /* from the ring; NULL when the model has none (or it does
						 not parse: the built-in chat formats then) */
	struct backend *be;
	struct backend_params bp;
	size_t arena_block_bytes;
	uint64_t pool_block_bytes;
	struct kv_cache *cache;
	struct engine *engine;
	struct service *svc;

	struct job queue[QUEUE_MAX];
	uint32_t q_head, q_len;
	struct job *current;	/* one request at a time: the one running */

	/* Continuous batching (batch.c), where the backend batches sequences and one runner computes
	 * every layer: up to max_batch requests run together, each with its own KV cache over its own
	 * cache over the one arena (slot_kv), their pieces (prefill chunks, decode tokens) in one step of at
	 * most max_step_tokens tokens. */
	long max_batch, max_step_tokens; /* --max-batch, --max-step-tokens as given */
	bool batching;
	uint32_t n_slots;		 /* caches made: the requests that may run at once */
	struct kv_arena *kv_arena;	 /* the arena's blocks, shared by their caches */
	struct kv_cache *slot_kv[RUNNER_MAX_BATCH];
	struct job active[RUNNER_MAX_BATCH];
	bool slot_used[RUNNER_MAX_BATCH];
	uint32_t n_active, rr;		 /* requests running; where the next step's round starts */
	float *batch_logits;		 /* (n_slots, vocab_size) a step's logits, a row a request */
	uint64_t batch_steps, batch_seqs, batch_tokens; /* steps run, and the sequences and tokens in them */
	uint32_t max_seqs_seen;		 /* the most sequences one step had */

	/* counters */
	uint64_t requests, prompt_tokens, tokens_generated, failures;
	double prefill_ms, decode_ms, last_prefill_tok_s, last_decode_tok_s;
};

/* peers.c */
/* The weight source the engine computes from: the GPU window over the ring, or the ring. */
struct weight_source *runner_weights(struct runner *r);
/* With a device backend, the GPU window over the ring (nothing to do on the C backend). */
int runner_make_window(struct runner *r, char *err, size_t errlen);
void runner_drop_window(struct runner *r);
/* Between requests: the engine and the GPU window made anew (a new plan: hot experts, the CPU
 * share's rates). On failure logs "WHAT: making the weight window anew failed (...)", sets
 * loader_suspect (the next request starts over from the loader) and returns false. */
bool runner_window_anew(struct runner *r, const char *what);
/* A wait on a peer's hook: keeps the heartbeat going; true when the runner is told to stop. */
bool runner_wait_beat(void *ctx);
int runner_connect_loader_retry(struct runner *r, int deadline_ms, char *err, size_t errlen);
int runner_connect_kv(struct runner *r, int deadline_ms, char *err, size_t errlen);
void runner_unpin_pool(struct runner *r);
/* The KV cache of this runner's layers (r->stage) over its arena, one a request running at once
 * when batching; the ones before (if any) go. */
int runner_make_cache(struct runner *r, char *err, size_t errlen);
/* Every KV cache of the runner (r->cache, r->slot_kv) and the arena they share go. */
void runner_drop_caches(struct runner *r);
/* The engine over the weight source as it is now; the one before (if any) goes. With the C backend
 * and a fixed --cpu-share, every FFN splits with the CPU in decode steps. */
int runner_make_engine(struct runner *r, char *err, size_t errlen);
/* Parses --cpu-share, --cpu-threads and --cpu-handoff into r. Returns 0, or -EINVAL with a message
 * in err naming the flag and the value. */
int runner_parse_cpu_flags(struct runner *r, char *err, size_t errlen);
/* With a CPU share in force: the task pool of its workers (r->cpu_pool), and with the C backend and
 * a fixed share, each layer's split (r->cpu_split_r). Call once the ring (the model) is known and
 * before the backend is made. Returns 0 or -errno with err set. */
int runner_setup_cpu_share(struct runner *r, char *err, size_t errlen);
/* gen_params.on_kv_failure: reconnects to a kv-store that went away in the middle of a request. */
int runner_kv_failure(void *ctx, char *err, size_t errlen);
void runner_release_dead_loader(struct runner *r);
int runner_ensure_connections(struct runner *r, uint64_t queued_ns, char *err, size_t errlen);

/* experts.c: the engine's routing counts folded into r->expert_heat (before the engine goes), and,
 * between requests, the GPU window made anew when a plan from the heat would keep experts that
 * take a larger share of the routing. A failure to make it sets loader_suspect (the next request
 * starts over from the loader) and is logged. */
void runner_fold_routing(struct runner *r);
void runner_replan_experts(struct runner *r);

/* cpu_share.c: between requests, the GPU window made anew with the CPU rates its split FFNs' jobs ran
 * at, when they differ from those it planned with by SPLIT_REPLAN_MIN_CHANGE or more (split_plan.h);
 * runner_split_mark notes the job counters a new window starts from. A failure to make it sets
 * loader_suspect and is logged, as for the experts. */
void runner_replan_split(struct runner *r);
void runner_split_mark(struct runner *r);
/* cpu_share.c: with experts on the CPU (auto), the rate their spans ran at since it was last asked,
 * once EXPERT_RATE_MIN_LAYERS layers of them have run (split_plan.h), folded into the rate the
 * window's routes weigh them with (expert_rate_fold), which is given again to a window made anew;
 * --fixed-split keeps the calibration's. Between requests, and within one after each token
 * (in_request: the routes of the steps to come weigh it; a route made is not changed). */
void runner_expert_rate(struct runner *r, bool in_request);
/* requests.c: what is planned anew between requests, in this order: the experts kept on the GPU
 * (runner_replan_experts), the CPU's share (runner_replan_split), the rate the routes weigh the
 * CPU's experts with (runner_expert_rate). Only while no request runs. */
void runner_between_requests(struct runner *r);

/* requests.c */
/* Runs the request at the head of the queue (one is queued), replies, and takes it off. */
void runner_run_next(struct runner *r);
/* At a stop: each request still queued is answered ESHUTDOWN (with a service to answer from) and
 * freed; the queue is then empty. */
void runner_drop_queued(struct runner *r);
/* A request about to run: its prompt's ids (text and chat through the tokenizer), its text stream,
 * what a resumed request had sent. Returns 0 or -errno with err set. */
int runner_job_prepare(struct runner *r, struct job *j, char *err, size_t errlen);
/* A request ended (rc 0: res says how; else err says why): MSG_GEN_DONE with the text held back, or
 * the error; the counters and the log line. */
void runner_job_reply(struct runner *r, struct job *j, int rc, const struct gen_result *res, const char *err);
/* Frees what the job holds; it is then zeroed. */
void runner_job_free(struct job *j);
/* gen_params callbacks, their context the job. */
enum gen_emit runner_job_emit(void *ctx, uint32_t index, int32_t token);
/* Hands the streamed weight groups back to the loader after requests ended (none runs now), and
 * the KV blocks allocated ahead to the kv-store. A failure of the weights is returned with err set. */
int runner_release_weights(struct runner *r, bool stopping, char *err, size_t errlen);
/* service_ops.handle: queues MSG_GENERATE. */
int runner_handle(void *ctx, struct service *s, const struct bus_peer *peer, const struct msg *req, char *errtext,
		  size_t errlen);

/* batch.c */
/* Whether this runner batches (r->batching) and how many requests run at once, once the backend is
 * chosen: sets r->batching, and the arena's blocks for that many sequences in *n_blocks (all: one
 * sequence's whole context in every layer; fit: what the budget holds; need: the fewest one cache
 * runs with). */
void runner_plan_batch(struct runner *r, uint64_t all, uint64_t fit, uint32_t need, uint32_t *n_blocks);
/* One step of the requests running: the queued ones admitted while slots are free, each running
 * one's next piece (under the token budget), one engine step, then each one's next token out; the
 * ones that ended are answered. */
void runner_batch_step(struct runner *r);
/* At a stop: the requests running are answered (cancelled) and their caches emptied. */
void runner_batch_drop(struct runner *r);

/* stage.c */
/* Parses --rank, --ranks, --gpu, --stage-link and --stage-split (the checks that need no model).
 * Returns 0, or -EINVAL with a message in err naming the flag. */
int runner_parse_stage_flags(struct runner *r, char *err, size_t errlen);
/* With several ranks, once the model is known: the plan of every rank's layers (each rank makes the
 * same one), this rank's stage (r->stage), and the ring's groups narrowed to it. Returns 0 or -errno. */
int runner_plan_stages(struct runner *r, char *err, size_t errlen);
/* Rank 0 of several, once the engine exists: the front that forms the other ranks. */
int runner_make_front(struct runner *r, char *err, size_t errlen);
/* The engine's stage ops for this runner (none with one rank). */
void runner_set_engine_stages(struct runner *r);
/* A later rank: MSG_STAGE_SETUP, MSG_STAGE_SEQ and MSG_STAGE_STEP, answered here. Returns 0 (answered)
 * or -errno with errtext (the service replies MSG_ERROR). */
int runner_handle_stage(struct runner *r, struct service *s, const struct bus_peer *peer, const struct msg *req,
			char *errtext, size_t errlen);
/* The "stages" stats object's members (none with one rank) into buf. */
void runner_stage_stats(struct runner *r, char *buf, size_t len);
void runner_drop_stages(struct runner *r);
/* Rank 0, idle: forms the ranks when they are not (a rank restarted), at most once a second, so that
 * the next request finds them formed. */
void runner_idle_stages(struct runner *r);
/* Rank 0: did the request's failure come from the stages (a rank gone), so that it may resume? */
bool runner_stage_failed(const struct runner *r);

/* stats.c */
/* service_ops.stats: the stats as compact JSON (malloc'd; the caller frees it), NULL without memory. */
char *runner_stats(void *ctx);

/* tuning.c */
void runner_register_tunables(struct runner *r);

#endif

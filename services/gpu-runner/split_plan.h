/* split_plan.h - how much of each streamed layer's FFN the CPU computes (backend.h, struct
 * ffn_split): the policy of --cpu-share, the CPU's product rate per weight format measured at start
 * (split_calibrate), and the choice of the split row r of every FFN (split_plan_choose). Plain C,
 * no CUDA: the GPU window plans with it, the runner with the C backend too, CI tests it.
 *
 *   struct cpu_share_policy pol;
 *   rc = cpu_share_parse("auto", &pol, err, sizeof(err));
 *   rc = split_calibrate(pool, samples, n, SPLIT_CALIBRATE_BYTES, NULL, pol.cpu_bytes_per_s, err, sizeof(err));
 *   struct split_plan plan = {.r = r_per_layer};
 *   rc = split_plan_choose(cfg, layers, other_streamed, h2d_bps, &pol, &plan, err, sizeof(err));
 *
 * The model of a decode token (auto): every streamed byte crosses PCIe at the measured H2D rate,
 * while the CPU reads its share of each split FFN at the rate measured for the format, plus one
 * handoff per split layer; the GPU's own compute is not the limit when weights stream. Both sides
 * work at once (the copies run ahead of compute by the window's depth; the stream waits for the
 * CPU only at the end of each FFN), so a token takes the longer of the two: auto gives every
 * eligible FFN the same share s, the one where both are equal,
 *   s = (P - L h - G) / (F / h2d + C),   P: the streamed bytes over h2d, F: the split FFNs' bytes,
 *                                    C: those bytes' time on the CPU, L: split layers, h: a handoff,
 *                                    G: the GPU's own work between split layers (gpu_s, summed),
 * clamped to [0, 1] and rounded per layer to the unit of its down_proj (ffn_split_unit). With
 * per_layer (--cpu-share-balance layer), each eligible layer l gets the share where its own copies
 * (its other streamed bytes O_l and its FFN's GPU rows) and its CPU rows take equally long,
 *   s_l = ((O_l + F_l) / h2d - h - G_l) / (F_l / h2d + C_l),
 * so that a layer whose attention streams gives the CPU more than one whose attention is resident:
 * the window runs ahead of compute by a layer or two, not by the token (test: the bench's --ab).
 * With prefetch_bytes R (the idle workers' read-ahead, counted by --cpu-prefetch-plan), the CPU's
 * side of a layer is its share's time less R at the layer's rate, R at most the share the layer
 * gets without it (so the credit never exceeds what the share reads):
 *   s_l = ((O_l + F_l) / h2d - h - G_l + R_l C_l / F_l) / (F_l / h2d + C_l).
 * The CPU and DMA read the same DRAM: the GPU window measures the CPU's rates while H2D copies run
 * and the copies' rate beside the CPU (split_load; alone each is far higher than beside the other),
 * the plan takes both, and the runner logs the prediction beside the measured decode time. Steps of many tokens (prefill) do not split on the
 * CPU, which runs one product per token: up to max_tokens, the CPU share of n tokens takes no
 * longer than copying those rows over PCIe once (n <= CPU rate / H2D rate, at least 1).
 */
#ifndef GPU_RUNNER_SPLIT_PLAN_H
#define GPU_RUNNER_SPLIT_PLAN_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/model.h"
#ifdef __cplusplus
extern "C" {
#endif

/* What the plan adds to the CPU's time per split layer and token: the time the CPU cannot work on
 * the layer's share, from its previous job's end to this one's start (the stream adds the partial
 * result, computes the next attention, copies x down, signals, the pool starts). Measured on an
 * H200 host (P1, 2026-11-29): 23 jobs of 3.15 ms each in 77.7 ms a token, 1.9 ms of it the unsplit
 * layers and the head, leave about 140 us a split layer; it was 20 us, and auto gave the CPU the
 * part that then bound the token. */
#define SPLIT_HANDOFF_S 120e-6
#define SPLIT_CALIBRATE_BYTES (512ull << 20) /* weight bytes split_calibrate reads per run and format, at most */

enum cpu_share_mode {
	CPU_SHARE_OFF = 0,   /* "0": no FFN is split */
	CPU_SHARE_AUTO = 1,  /* "auto": the share where the CPU and the copies finish together */
	CPU_SHARE_FIXED = 2, /* a fraction: the CPU takes that part of every eligible FFN's rows */
};

struct cpu_share_policy {
	uint32_t mode;			  /* enum cpu_share_mode */
	double fraction;		  /* CPU_SHARE_FIXED: (0, 1] */
	double cpu_bytes_per_s[DT_COUNT]; /* the CPU's product rate per weight format, bytes of weights a second
					   * (split_calibrate; 0: not measured) */
	double handoff_s;		  /* per handoff; 0: SPLIT_HANDOFF_S */
	bool per_layer;			  /* auto: each layer's own share (--cpu-share-balance layer) */
	uint64_t prefetch_bytes;	  /* auto: bytes of each split FFN's CPU share the idle workers read
					   * ahead before its input comes (--cpu-prefetch), counted as read:
					   * the CPU's side of a layer takes that much less time, at most its
					   * share without it (--cpu-prefetch-plan; 0: not counted) */
	/* Rates measured already (the jobs' rate, split_jobs_factor; or the window's own calibration
	 * when it plans its residency again): the GPU window plans with cpu_bytes_per_s and this H2D
	 * rate beside the CPU as they are, measuring neither again. */
	bool rates_known;
	double h2d_beside_bytes_per_s;	  /* rates_known: the copies' rate beside the CPU (0: alone) */
};

/* Parses --cpu-share: "auto", "0" (off) or a fraction in (0, 1] ("0.5", "1"). Sets p (rates 0).
 * Returns 0, or -EINVAL with a message in err naming the value. */
int cpu_share_parse(const char *text, struct cpu_share_policy *p, char *err, size_t errlen);
/* "off", "auto" or "0.50" into buf. */
const char *cpu_share_text(const struct cpu_share_policy *p, char *buf, size_t len);

/* A matrix the calibration multiplies: rows of cols elements in format, row_bytes apart, in host
 * memory (the weight ring: what the CPU share reads). */
struct split_sample {
	const void *data;
	uint32_t format; /* enum dtype */
	uint32_t rows, cols;
	uint64_t row_bytes;
};

struct task_pool;
/* The H2D copies split_calibrate measures beside (the GPU window's): started before each format's
 * runs (start: false when none could start, and that format is measured alone), asked after each
 * run whether they still run (busy), finished when the format's runs end (finish), so that every
 * format's rate, and the copies' rate, are measured beside the other the whole time. */
struct split_load {
	bool (*start)(void *arg);
	bool (*busy)(void *arg);
	void (*finish)(void *arg);
	void *arg;
};
/* Measures the CPU's product rate of every format among the samples on pool: runs of up to budget
 * bytes of that format's rows, each run the rows after the last one's (round the samples, never a
 * row twice in one run), multiplied by a vector as the CPU share multiplies (cpu_compute.h), cut
 * into parts as a split FFN's job is; the first run warms (page tables, sleeping workers), then
 * SPLIT_CALIBRATE_RUNS are timed, and more while load (may be NULL) says its copies still run.
 * rates[f] gets the median run's bytes of weights a second for each format f seen (others are
 * left as they are). Returns 0, or -EINVAL (a sample the kernels refuse) / -ENOMEM with a message
 * in err. */
#define SPLIT_CALIBRATE_RUNS 3
#define SPLIT_CALIBRATE_MAX_RUNS 64 /* timed runs of one format at most, busy or not */
int split_calibrate(struct task_pool *pool, const struct split_sample *samples, uint32_t n, uint64_t budget,
		    const struct split_load *load, double rates[DT_COUNT], char *err, size_t errlen);

/* One layer's FFN as the plan sees it. */
struct split_layer {
	bool eligible;	     /* it may split: it streams to the GPU and its host bytes stay in DRAM */
	uint32_t format[3];  /* enum dtype of gate, up, down */
	uint64_t bytes[3];   /* tensor bytes of gate, up, down */
	uint64_t other_bytes; /* other bytes over PCIe per decode token that this layer's copies carry: its
			       * attention group when that streams, and those of the layers before it whose
			       * FFN does not split (counted in other_streamed too) */
	double gpu_s;	     /* seconds of the GPU's own work before this layer's FFN since the FFN that may split
			      * before it (0: none counted): the layers between, kept or streamed whole. The link
			      * copies through it and the CPU, waiting for this layer's input, cannot; auto takes
			      * it off the CPU's side (gpu_window_params.split_gaps) */
};

struct split_plan {
	uint32_t *r;	       /* (n_layers), the caller's: r of each FFN; ffn_dim where it does not split */
	uint32_t split_layers; /* FFNs that split */
	uint32_t r_min, r_max; /* over the split FFNs */
	double share;	       /* the share s the plan aimed at (the CPU's part of the rows) */
	uint64_t pcie_bytes;   /* per decode token: every streamed byte that still crosses PCIe */
	uint64_t cpu_bytes;    /* per decode token: what the CPU reads */
	double pcie_s, cpu_s;  /* per decode token: the copies at the H2D rate, the CPU's shares (+ handoffs) */
	double jobs_s;	       /* per decode token: the CPU's shares alone (cpu_s without the handoffs) */
	double gpu_s;	       /* per decode token: the GPU's reads of all it computes whole, which the CPU's
				* jobs wait out (set by the caller; 0: not counted) */
	uint32_t max_tokens;   /* steps of at most this many tokens take the CPU share */
};

/* Chooses r for every layer of cfg (layers: n_layers entries) under the policy: other_streamed is
 * what else crosses PCIe per decode token (attention groups, FFNs that do not split), h2d_bps the
 * measured H2D rate. Off, or no eligible layer: nothing splits (r = ffn_dim everywhere, the times
 * still predicted). Auto needs the rate of every format of the eligible FFNs and h2d_bps > 0.
 * Returns 0, or -EINVAL with a message in err (a rate missing, a format without a unit). */
int split_plan_choose(const struct model_config *cfg, const struct split_layer *layers, uint64_t other_streamed,
		      double h2d_bps, const struct cpu_share_policy *pol, struct split_plan *plan, char *err,
		      size_t errlen);

/* What the split FFNs' jobs did over a stretch of decode: their count, the weight bytes they read and
 * their time on the CPU (first part's start to last part's end, summed; backend_cpu_share_stats). */
struct split_jobs {
	uint64_t jobs, bytes, ns;
};
/* The jobs' rate moves by 10-20% from one request to the next on an H200 host (P3: 70.0 GB/s over a
 * request's first 5 tokens, then 76.8 over 15), so a new plan needs many tokens and a large miss:
 * it is a guard against a calibration far off (52.5 GB/s measured, 77.5 read), not a tuner. */
#define SPLIT_REPLAN_MIN_TOKENS 16  /* decode tokens' jobs a new plan from them needs at least */
#define SPLIT_REPLAN_MIN_CHANGE 0.15 /* and a rate that far from the plan's (a part) */
/* How much faster the jobs ran than a plan foresaw that gave the CPU plan_bytes a decode token in
 * plan_jobs_s (split_plan cpu_bytes and jobs_s) over split_layers FFNs: their rate (bytes / ns)
 * over the plan's. 0 when it says nothing yet: fewer jobs than SPLIT_REPLAN_MIN_TOKENS tokens hold,
 * no time, or no plan. The runner multiplies the rates it planned with by it (the calibration
 * measures a few hundred MB beside copies it starts itself; on an H200 host it said BF16 52.5
 * GB/s where P1's jobs then read 77.5, and auto gave the CPU too little). */
double split_jobs_factor(const struct split_jobs *seen, uint32_t split_layers, uint64_t plan_bytes, double plan_jobs_s);

/* What the CPU's routed experts did over a stretch of decode (backend_cpu_share_stats): the layers
 * that gave the CPU any, the weight bytes of their CPU experts, and their spans (a layer's first
 * expert handed to the pool to its last one's end), summed. */
struct expert_spans {
	uint64_t layers, bytes;
	double ms;
	uint64_t gaps;	/* from a layer's last CPU expert's end to the next layer's first handed over (in */
	double gap_ms;	/* one step, and across a token's ends): their count and time (the GPU's chain,
			 * the host's route; at a token's end the head, the pick and the first layers too) */
};
/* Layers with CPU experts a rate from their spans needs at least: a token of a 16-layer model, two of
 * an 8-layer one. With 48, a stretch of MX1's 8 layers was six tokens, so a 16-token request folded
 * twice and a start whose calibration said 87 GB/s still weighed the CPU at 75 when the request
 * ended, its spans running at 69 (the CPU's side ended 3.6 ms a token after the link's). */
#define EXPERT_RATE_MIN_LAYERS 16
/* Gaps the lead (expert_spans_lead) needs at least: 48, as the rate's stretch was before it became
 * 16. A mean over 16 gaps swung with each token's end (MX2's warm-up, 2026-12-03: 345-1478 us a
 * layer, and a lead of 1478 us adds a third or more of a layer's chosen experts' bytes to the
 * copies' share: expert_copy_share). */
#define EXPERT_LEAD_MIN_GAPS 48
/* The rate the CPU's experts of a layer ran at, bytes over span (bytes a second): what a route and
 * the guesses weigh the CPU's side with (gw_route) once it is known, in place of the start's
 * calibration, which measures a few hundred MB of experts beside copies (M1 on an H200 host: 97.7
 * GB/s where a layer's experts then read 74-78.5). 0 when it says nothing yet: fewer than
 * EXPERT_RATE_MIN_LAYERS layers, no bytes or no time. */
double expert_spans_rate(const struct expert_spans *seen);
/* Of a rate learnt before, what the next one keeps (expert_rate_fold). */
#define EXPERT_RATE_KEEP 0.5
/* The rate the routes weigh the CPU's experts with after a stretch that ran at seen (bytes a
 * second), where they weighed them at learnt (0: the start's calibration, which seen replaces):
 * EXPERT_RATE_KEEP of learnt and the rest of seen; learnt where seen says nothing (0). The rate a
 * share runs at depends on the share the weighing gave it (MX2 on an H200: routes weighing 77.7 GB/s
 * ran the CPU's rows at 88.4, while the calibration's 86-94 had run them at 77.7; its split rows read
 * down's columns a row apart, 98-106 GB/s where whole experts read 120), so taken whole each
 * stretch's rate answers the last one's weighing and swings; the mean settles where the two agree. */
double expert_rate_fold(double learnt, double seen);
/* The mean of those gaps in seconds: the time a layer in which the copies can run and the CPU's
 * experts cannot (they wait for the layer's route); 0 under EXPERT_LEAD_MIN_GAPS gaps. One mean
 * over both kinds, a token's ends among them: over a token the copies have the gaps' sum more than
 * the CPU, and slots deep enough let them spend it in any layer (with two, they cannot run that far
 * ahead, and the guesses are bound by the slots, whatever the share). */
double expert_spans_lead(const struct expert_spans *seen);
/* The part of a layer's chosen experts (chosen bytes, not kept on the GPU) that the copies should
 * take so that both sides end together, the link at h2d and the CPU at cpu bytes a second, the link
 * starting lead seconds before the CPU can: h2d / (h2d + cpu) with no lead, more with one; in
 * [0, 1]. Both sides then take (chosen + lead * cpu) / (h2d + cpu) from the copies' start, where
 * each alone would take chosen / h2d, or lead + chosen / cpu. */
double expert_copy_share(double chosen, double h2d, double cpu, double lead);

#ifdef __cplusplus
}
#endif
#endif

/* test_split_plan.c - the planning of split FFNs (split_plan.h): --cpu-share's values, the choice
 * of r (off, a fraction, auto's balance of the CPU against PCIe, ineligible layers, rounding to
 * the unit of down's format, the steps that take the CPU share, a share per layer) and the
 * calibration of the CPU's
 * product rates on a task pool. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/split_plan.h"
#include "tests/unit/common/test_helpers.h"

#define L 4
#define FFN 14336
#define DIM 4096

static struct model_config cfg(void)
{
	return (struct model_config){.n_layers = L, .dim = DIM, .ffn_dim = FFN};
}

/* Llama-3-8B-shaped BF16 FFNs: gate, up and down 117 MB each. */
static void layers(struct split_layer *ly, enum dtype down)
{
	for (uint32_t l = 0; l < L; l++) {
		ly[l].eligible = true;
		ly[l].other_bytes = 0;
		ly[l].gpu_s = 0;
		ly[l].format[0] = ly[l].format[1] = DT_BF16;
		ly[l].format[2] = down;
		for (int i = 0; i < 3; i++) {
			uint32_t rows = i == 2 ? DIM : FFN, cols = i == 2 ? FFN : DIM;
			ly[l].bytes[i] = dtype_row_bytes((enum dtype)ly[l].format[i], cols) * rows;
		}
	}
}

START_TEST(test_parse)
{
	struct cpu_share_policy p;
	char err[256], buf[32];
	ck_assert_int_eq(cpu_share_parse("auto", &p, err, sizeof(err)), 0);
	ck_assert_uint_eq(p.mode, CPU_SHARE_AUTO);
	ck_assert_str_eq(cpu_share_text(&p, buf, sizeof(buf)), "auto");
	ck_assert_int_eq(cpu_share_parse("0", &p, err, sizeof(err)), 0);
	ck_assert_uint_eq(p.mode, CPU_SHARE_OFF);
	ck_assert_str_eq(cpu_share_text(&p, buf, sizeof(buf)), "off");
	ck_assert_int_eq(cpu_share_parse("0.25", &p, err, sizeof(err)), 0);
	ck_assert_uint_eq(p.mode, CPU_SHARE_FIXED);
	ck_assert(p.fraction == 0.25);
	ck_assert_str_eq(cpu_share_text(&p, buf, sizeof(buf)), "0.25");
	ck_assert_int_eq(cpu_share_parse("1", &p, err, sizeof(err)), 0);
	ck_assert(p.fraction == 1);
	static const char *const bad[] = {"", "1.5", "-0.1", "half", "0.5x", "nan", "inf", "AUTO"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ck_assert_int_eq(cpu_share_parse(bad[i], &p, err, sizeof(err)), -EINVAL);
		ck_assert_msg(strstr(err, "--cpu-share"), "message for '%s': %s", bad[i], err);
	}
	ck_assert_int_eq(cpu_share_parse(NULL, &p, err, sizeof(err)), -EINVAL);
}
END_TEST

START_TEST(test_off_and_fixed)
{
	struct model_config c = cfg();
	struct split_layer ly[L];
	layers(ly, DT_BF16);
	uint32_t r[L];
	struct split_plan plan = {.r = r};
	struct cpu_share_policy pol;
	char err[256];
	uint64_t ffn_bytes = ly[0].bytes[0] * 3;

	ck_assert_int_eq(cpu_share_parse("0", &pol, err, sizeof(err)), 0);
	ck_assert_int_eq(split_plan_choose(&c, ly, 1000, 50e9, &pol, &plan, err, sizeof(err)), 0);
	for (uint32_t l = 0; l < L; l++)
		ck_assert_uint_eq(r[l], FFN);
	ck_assert_uint_eq(plan.split_layers, 0);
	ck_assert_uint_eq(plan.pcie_bytes, 1000 + L * ffn_bytes);
	ck_assert_uint_eq(plan.cpu_bytes, 0);

	ck_assert_int_eq(cpu_share_parse("0.5", &pol, err, sizeof(err)), 0);
	ly[1].eligible = false; /* streams from disk, say: stays whole (and counted by the caller) */
	ck_assert_int_eq(split_plan_choose(&c, ly, 1000, 50e9, &pol, &plan, err, sizeof(err)), 0);
	ck_assert_uint_eq(plan.split_layers, L - 1);
	ck_assert_uint_eq(r[1], FFN);
	for (uint32_t l = 0; l < L; l++)
		if (l != 1)
			ck_assert_uint_eq(r[l], FFN / 2 / 64 * 64 + (FFN / 2 % 64 >= 32 ? 64 : 0));
	ck_assert_uint_eq(plan.r_min, plan.r_max);
	ck_assert_uint_eq(plan.cpu_bytes + plan.pcie_bytes, 1000 + (L - 1) * ffn_bytes);
	ck_assert(fabs((double)plan.cpu_bytes - (L - 1) * ffn_bytes / 2.0) < (L - 1) * ffn_bytes * 0.01);
	ck_assert_uint_eq(plan.max_tokens, 1); /* no rates: one token */

	/* All of it on the CPU; and a tiny fraction still takes one unit (256 for a Q6_K down). */
	ck_assert_int_eq(cpu_share_parse("1", &pol, err, sizeof(err)), 0);
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 50e9, &pol, &plan, err, sizeof(err)), 0);
	ck_assert_uint_eq(r[0], 0);
	ck_assert_uint_eq(plan.pcie_bytes, 0);
	layers(ly, DT_Q6_K);
	ck_assert_int_eq(cpu_share_parse("0.001", &pol, err, sizeof(err)), 0);
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 50e9, &pol, &plan, err, sizeof(err)), 0);
	ck_assert_uint_eq(r[0], FFN - 256);
	ck_assert_uint_eq(r[0] % ffn_split_unit(DT_Q6_K), 0);
}
END_TEST

/* auto: the share where the copies and the CPU finish together. */
START_TEST(test_auto_balance)
{
	struct model_config c = cfg();
	struct split_layer ly[L];
	layers(ly, DT_BF16);
	uint32_t r[L];
	struct split_plan plan = {.r = r};
	struct cpu_share_policy pol;
	char err[256];
	ck_assert_int_eq(cpu_share_parse("auto", &pol, err, sizeof(err)), 0);
	/* No rate measured: refused, naming the format. */
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 50e9, &pol, &plan, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "BF16"), "message: %s", err);
	pol.cpu_bytes_per_s[DT_BF16] = 80e9;
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 0, &pol, &plan, err, sizeof(err)), -EINVAL);
	/* PCIe 50 GB/s, CPU 80 GB/s, no other bytes: s = 80 / 130 less the handoffs' part. */
	uint64_t other = 200000000;
	ck_assert_int_eq(split_plan_choose(&c, ly, other, 50e9, &pol, &plan, err, sizeof(err)), 0);
	ck_assert_uint_eq(plan.split_layers, L);
	double want = ((double)(other + L * ly[0].bytes[0] * 3) / 50e9 - L * SPLIT_HANDOFF_S) /
		      ((double)(L * ly[0].bytes[0] * 3) * (1 / 50e9 + 1 / 80e9));
	ck_assert_msg(fabs(plan.share - want) < 1e-9, "share %.6f, want %.6f", plan.share, want);
	ck_assert_msg(fabs(plan.pcie_s - plan.cpu_s) < 0.02 * plan.pcie_s, "pcie %.3f ms, cpu %.3f ms", plan.pcie_s * 1e3,
		      plan.cpu_s * 1e3);
	ck_assert_uint_eq(r[0] % 64, 0);
	/* the products alone: the handoffs aside, the CPU's bytes at its rate */
	ck_assert_double_eq_tol(plan.jobs_s, plan.cpu_s - L * SPLIT_HANDOFF_S, 1e-12);
	ck_assert_double_eq_tol(plan.jobs_s, (double)plan.cpu_bytes / 80e9, 1e-9);
	ck_assert_uint_eq(plan.max_tokens, 1); /* 80 / 50 */
	/* A CPU far faster than the link: everything on the CPU; and more tokens per step. */
	pol.cpu_bytes_per_s[DT_BF16] = 1000e9;
	ck_assert_int_eq(split_plan_choose(&c, ly, other * 50, 50e9, &pol, &plan, err, sizeof(err)), 0);
	ck_assert_uint_eq(r[0], 0);
	ck_assert_uint_eq(plan.max_tokens, FFN_SPLIT_MAX_TOKENS);
	/* A CPU so slow that its share rounds to no unit of rows: nothing splits. */
	pol.cpu_bytes_per_s[DT_BF16] = 1e6;
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 50e9, &pol, &plan, err, sizeof(err)), 0);
	ck_assert_uint_eq(plan.split_layers, 0);
	ck_assert_uint_eq(r[0], FFN);
}
END_TEST

/* --cpu-share auto, each layer its own share, the CPU's BF16 products at cpu bytes a second. */
static struct cpu_share_policy auto_per_layer(double cpu)
{
	struct cpu_share_policy pol;
	char err[256];
	ck_assert_msg(cpu_share_parse("auto", &pol, err, sizeof(err)) == 0, "%s", err);
	pol.cpu_bytes_per_s[DT_BF16] = cpu;
	pol.per_layer = true;
	return pol;
}

/* auto with --cpu-share-balance layer: each layer the share where its own copies (its attention
 * when that streams, and its FFN's GPU rows) and its CPU rows take equally long. */
START_TEST(test_auto_per_layer)
{
	struct model_config c = cfg();
	struct split_layer ly[L];
	layers(ly, DT_BF16);
	const uint64_t attn = 84000000; /* layers 1 and 3 stream their attention */
	ly[1].other_bytes = ly[3].other_bytes = attn;
	uint32_t r[L];
	struct split_plan plan = {.r = r};
	struct cpu_share_policy pol = auto_per_layer(100e9);
	char err[256];
	ck_assert_int_eq(split_plan_choose(&c, ly, 2 * attn, 50e9, &pol, &plan, err, sizeof(err)), 0);
	ck_assert_uint_eq(plan.split_layers, L);
	const double F = (double)ly[0].bytes[0] * 3;
	double mean = 0;
	for (uint32_t l = 0; l < L; l++) {
		double want = (((double)ly[l].other_bytes + F) / 50e9 - SPLIT_HANDOFF_S) / (F / 50e9 + F / 100e9);
		mean += want / L;
		/* r rounds the share to whole units of 64 rows */
		double got = (double)(FFN - r[l]) / FFN;
		ck_assert_msg(fabs(got - want) <= 64.0 / FFN, "layer %u: share %.4f, want %.4f", l, got, want);
		ck_assert_uint_eq(r[l] % 64, 0);
		/* its copies and its CPU rows: within a unit of rows of each other */
		double pcie = ((double)ly[l].other_bytes + F * r[l] / FFN) / 50e9;
		double cpu = F * (FFN - r[l]) / FFN / 100e9 + SPLIT_HANDOFF_S;
		ck_assert_msg(fabs(pcie - cpu) < 0.02 * pcie, "layer %u: pcie %.3f ms, cpu %.3f ms", l, pcie * 1e3,
			      cpu * 1e3);
	}
	ck_assert_msg(fabs(plan.share - mean) < 1e-9, "share %.6f, want %.6f", plan.share, mean);
	ck_assert_uint_lt(r[1], r[0]); /* the layer whose attention streams gives the CPU more rows */
	ck_assert_uint_eq(r[1], r[3]);
	ck_assert_uint_eq(r[0], r[2]);
	/* The same layers balanced over the token: one share for all. */
	pol.per_layer = false;
	ck_assert_int_eq(split_plan_choose(&c, ly, 2 * attn, 50e9, &pol, &plan, err, sizeof(err)), 0);
	ck_assert_uint_eq(r[0], r[1]);
	ck_assert_uint_eq(r[1], r[3]);
}
END_TEST

/* The GPU's own work between split layers (gpu_s, the kept layers spread): taken off the CPU's side
 * of each layer's balance, and of the token's. */
START_TEST(test_auto_gpu_gaps)
{
	struct model_config c = cfg();
	struct split_layer ly[L];
	layers(ly, DT_BF16);
	const double gap = 250e-6;
	ly[1].gpu_s = ly[3].gpu_s = gap; /* two kept layers' reads before layers 1 and 3 */
	uint32_t r[L];
	struct split_plan plan = {.r = r};
	struct cpu_share_policy pol = auto_per_layer(100e9);
	char err[256];
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 50e9, &pol, &plan, err, sizeof(err)), 0);
	ck_assert_uint_eq(plan.split_layers, L);
	const double F = (double)ly[0].bytes[0] * 3;
	for (uint32_t l = 0; l < L; l++) {
		/* its copies take as long as its CPU rows, the handoff and the GPU's work before it */
		double pcie = F * r[l] / FFN / 50e9;
		double cpu = F * (FFN - r[l]) / FFN / 100e9 + SPLIT_HANDOFF_S + ly[l].gpu_s;
		ck_assert_msg(fabs(pcie - cpu) < 0.02 * pcie, "layer %u: pcie %.3f ms, cpu %.3f ms", l, pcie * 1e3,
			      cpu * 1e3);
	}
	ck_assert_uint_gt(r[1], r[0]); /* the GPU's work before layer 1 gives the CPU fewer rows */
	ck_assert_uint_eq(r[1], r[3]);
	ck_assert_uint_eq(r[0], r[2]);
	/* Over the token: one share, smaller than with no gaps, by their sum. */
	pol.per_layer = false;
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 50e9, &pol, &plan, err, sizeof(err)), 0);
	const double with = plan.share;
	double want = (4 * F / 50e9 - 4 * SPLIT_HANDOFF_S - 2 * gap) / (4 * F / 50e9 + 4 * F / 100e9);
	ck_assert_msg(fabs(with - want) < 1e-9, "share %.6f, want %.6f", with, want);
	ly[1].gpu_s = ly[3].gpu_s = 0;
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 50e9, &pol, &plan, err, sizeof(err)), 0);
	ck_assert(plan.share > with);
}
END_TEST

/* The idle workers' read-ahead counted (cpu_share_policy.prefetch_bytes): each layer's CPU side is
 * its share's time less the bytes read ahead at its rate, so the CPU gets more rows; the credit is
 * at most the share the layer had without it; the plan's CPU time and jobs' time are net of it. */
START_TEST(test_auto_prefetch_credit)
{
	struct model_config c = cfg();
	struct split_layer ly[L];
	layers(ly, DT_BF16);
	uint32_t r0[L], r[L];
	struct split_plan plan0 = {.r = r0}, plan = {.r = r};
	struct cpu_share_policy pol = auto_per_layer(100e9);
	char err[256];
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 50e9, &pol, &plan0, err, sizeof(err)), 0);
	const double F = (double)ly[0].bytes[0] * 3, R = 24.0 * 1048576;
	pol.prefetch_bytes = 24ull << 20;
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 50e9, &pol, &plan, err, sizeof(err)), 0);
	ck_assert_uint_eq(plan.split_layers, L);
	for (uint32_t l = 0; l < L; l++) {
		ck_assert_uint_lt(r[l], r0[l]); /* more rows on the CPU */
		/* its copies as long as its CPU rows less the read-ahead, and the handoff */
		double pcie = F * r[l] / FFN / 50e9;
		double cpu = (F * (FFN - r[l]) / FFN - R) / 100e9 + SPLIT_HANDOFF_S;
		ck_assert_msg(fabs(pcie - cpu) < 0.02 * pcie, "layer %u: pcie %.3f ms, cpu %.3f ms", l, pcie * 1e3,
			      cpu * 1e3);
	}
	const double cpu_b = (double)plan.cpu_bytes / L;
	ck_assert_msg(fabs(plan.jobs_s - L * (cpu_b - R) / 100e9) < 1e-6, "jobs %.3f ms", plan.jobs_s * 1e3);
	ck_assert_msg(fabs(plan.cpu_s - plan.jobs_s - L * SPLIT_HANDOFF_S) < 1e-9, "cpu %.3f ms", plan.cpu_s * 1e3);
	/* Over the token: the same credit, one share for all. */
	pol.per_layer = false;
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 50e9, &pol, &plan, err, sizeof(err)), 0);
	double want = (4 * F / 50e9 - 4 * SPLIT_HANDOFF_S + 4 * R / 100e9) / (4 * F / 50e9 + 4 * F / 100e9);
	ck_assert_msg(fabs(plan.share - want) < 1e-9, "share %.6f, want %.6f", plan.share, want);
	/* A read-ahead larger than the share: counted only up to the share without it. */
	pol.per_layer = true;
	pol.prefetch_bytes = 1ull << 40;
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 50e9, &pol, &plan, err, sizeof(err)), 0);
	const double s0 = (double)(FFN - r0[0]) / FFN;
	for (uint32_t l = 0; l < L; l++) {
		double pcie = F * r[l] / FFN / 50e9;
		double cpu = (F * (FFN - r[l]) / FFN - s0 * F) / 100e9 + SPLIT_HANDOFF_S;
		ck_assert_msg(fabs(pcie - cpu) < 0.03 * pcie, "capped, layer %u: pcie %.3f ms, cpu %.3f ms", l,
			      pcie * 1e3, cpu * 1e3);
	}
	ck_assert_msg(fabs(plan.jobs_s - ((double)plan.cpu_bytes - L * s0 * F) / 100e9) < 0.02 * plan.jobs_s,
		      "capped: jobs %.3f ms", plan.jobs_s * 1e3);
	/* A fixed share is what was asked: no credit moves it. */
	pol.mode = CPU_SHARE_FIXED;
	pol.fraction = 0.5;
	ck_assert_int_eq(split_plan_choose(&c, ly, 0, 50e9, &pol, &plan, err, sizeof(err)), 0);
	ck_assert_uint_eq(r[0], FFN / 2);
}
END_TEST

/* split_calibrate's load: busy while *arg counts down, each call counted; starts and finishes
 * counted (one of each per format). */
static uint32_t busy_calls, starts, finishes;
static bool load_start(void *arg)
{
	(void)arg;
	starts++;
	return true;
}
static bool busy_counting(void *arg)
{
	uint32_t *left = arg;
	busy_calls++;
	if (*left == 0)
		return false;
	if (*left != UINT32_MAX)
		(*left)--;
	return true;
}
static void load_finish(void *arg)
{
	(void)arg;
	finishes++;
}

START_TEST(test_calibrate)
{
	char err[256];
	struct task_pool *pool = NULL;
	struct task_pool_config pc;
	task_pool_config_default(&pc);
	pc.threads = 2;
	pc.pin = false;
	ck_assert_msg(task_pool_create(&pc, &pool, err, sizeof(err)) == 0, "%s", err);
	uint32_t rows = 512, cols = 256;
	uint16_t *bf = calloc((size_t)rows * cols, 2);
	uint8_t *q = calloc(rows, dtype_row_bytes(DT_Q8_0, cols));
	ck_assert(bf && q);
	for (size_t i = 0; i < (size_t)rows * cols; i++)
		bf[i] = f32_to_bf16((float)(i % 7) - 3);
	struct split_sample s[2] = {
		{.data = bf, .format = DT_BF16, .rows = rows, .cols = cols, .row_bytes = dtype_row_bytes(DT_BF16, cols)},
		{.data = q, .format = DT_Q8_0, .rows = rows, .cols = cols, .row_bytes = dtype_row_bytes(DT_Q8_0, cols)},
	};
	double rates[DT_COUNT] = {0};
	rates[DT_F16] = 123; /* not among the samples: left alone */
	ck_assert_msg(split_calibrate(pool, s, 2, 1 << 20, NULL, rates, err, sizeof(err)) == 0, "%s", err);
	ck_assert(rates[DT_BF16] > 0 && isfinite(rates[DT_BF16]));
	/* A load keeps the CPU measuring (the GPU window's copies beside it): started and finished
	 * once a format, asked after each run from the third on; the runs stop at the cap when it
	 * never says no. */
	uint32_t left = 5;
	busy_calls = starts = finishes = 0;
	const struct split_load load = {.start = load_start, .busy = busy_counting, .finish = load_finish, .arg = &left};
	ck_assert_msg(split_calibrate(pool, s, 1, 1 << 20, &load, rates, err, sizeof(err)) == 0, "%s", err);
	ck_assert_uint_eq(left, 0);
	ck_assert_uint_eq(busy_calls, 6); /* five yes, then the no that ends it */
	ck_assert_uint_eq(starts, 1);
	ck_assert_uint_eq(finishes, 1);
	/* Two formats: a load each; the second is asked as the first was. */
	left = 2;
	busy_calls = starts = finishes = 0;
	ck_assert_msg(split_calibrate(pool, s, 2, 1 << 20, &load, rates, err, sizeof(err)) == 0, "%s", err);
	ck_assert_uint_eq(starts, 2);
	ck_assert_uint_eq(finishes, 2);
	ck_assert_uint_eq(busy_calls, 4); /* BF16: yes, yes, no; Q8_0: no */
	left = UINT32_MAX;
	busy_calls = 0;
	ck_assert_msg(split_calibrate(pool, s, 1, 1 << 20, &load, rates, err, sizeof(err)) == 0, "%s", err);
	ck_assert_uint_eq(busy_calls, SPLIT_CALIBRATE_MAX_RUNS - SPLIT_CALIBRATE_RUNS);
	ck_assert(rates[DT_Q8_0] > 0 && isfinite(rates[DT_Q8_0]));
	ck_assert(rates[DT_F16] == 123);
	ck_assert(rates[DT_F32] == 0);
	/* A sample the kernels refuse (rows shorter than their columns): the message names it. */
	s[0].row_bytes = 16;
	ck_assert_int_eq(split_calibrate(pool, s, 1, 1 << 20, NULL, rates, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "calibration"), "message: %s", err);
	free(bf);
	free(q);
	task_pool_destroy(&pool);
}
END_TEST

/* The rate the jobs ran at against the plan's: a plan of 1 GB a token in 10 ms (100 GB/s) over 4
 * FFNs, and jobs that read at 80 GB/s, say 0.8; too few of them say nothing. */
START_TEST(test_jobs_factor)
{
	struct split_jobs seen = {.jobs = 4 * SPLIT_REPLAN_MIN_TOKENS, .bytes = 8000000000ull, .ns = 100000000ull};
	ck_assert_double_eq_tol(split_jobs_factor(&seen, 4, 1000000000ull, 0.010), 0.8, 1e-12);
	seen.ns = 50000000ull; /* 160 GB/s */
	ck_assert_double_eq_tol(split_jobs_factor(&seen, 4, 1000000000ull, 0.010), 1.6, 1e-12);
	seen.jobs--; /* not SPLIT_REPLAN_MIN_TOKENS tokens */
	ck_assert(split_jobs_factor(&seen, 4, 1000000000ull, 0.010) == 0);
	seen.jobs++;
	ck_assert(split_jobs_factor(&seen, 0, 1000000000ull, 0.010) == 0); /* nothing split */
	ck_assert(split_jobs_factor(&seen, 4, 0, 0.010) == 0);
	ck_assert(split_jobs_factor(&seen, 4, 1000000000ull, 0) == 0);
	seen.ns = 0;
	ck_assert(split_jobs_factor(&seen, 4, 1000000000ull, 0.010) == 0);
}
END_TEST

START_TEST(test_expert_spans_rate)
{
	struct expert_spans seen = {.layers = EXPERT_RATE_MIN_LAYERS, .bytes = 8000000000ull, .ms = 100.0};
	ck_assert_double_eq_tol(expert_spans_rate(&seen), 80e9, 1e-3);
	seen.ms = 50.0; /* the same bytes in half the time */
	ck_assert_double_eq_tol(expert_spans_rate(&seen), 160e9, 1e-3);
	seen.layers--; /* too few layers say nothing */
	ck_assert(expert_spans_rate(&seen) == 0);
	seen.layers++;
	seen.bytes = 0;
	ck_assert(expert_spans_rate(&seen) == 0);
	seen.bytes = 1;
	seen.ms = 0;
	ck_assert(expert_spans_rate(&seen) == 0);
	seen.ms = -1;
	ck_assert(expert_spans_rate(&seen) == 0);
	/* the lead: the gaps' mean, once EXPERT_LEAD_MIN_GAPS of them (more than the rate's layers:
	 * a stretch the rate reads says nothing of the lead yet) */
	ck_assert_uint_gt(EXPERT_LEAD_MIN_GAPS, EXPERT_RATE_MIN_LAYERS);
	seen.gaps = EXPERT_RATE_MIN_LAYERS;
	seen.gap_ms = EXPERT_RATE_MIN_LAYERS * 0.09;
	ck_assert(expert_spans_lead(&seen) == 0);
	seen.gaps = EXPERT_LEAD_MIN_GAPS;
	seen.gap_ms = EXPERT_LEAD_MIN_GAPS * 0.09;
	ck_assert_double_eq_tol(expert_spans_lead(&seen), 90e-6, 1e-12);
	seen.gaps--;
	ck_assert(expert_spans_lead(&seen) == 0);
	seen.gaps++;
	seen.gap_ms = 0;
	ck_assert(expert_spans_lead(&seen) == 0);
}
END_TEST

START_TEST(test_expert_rate_fold)
{
	/* The first rate learnt replaces the calibration's (0 here). */
	ck_assert_double_eq_tol(expert_rate_fold(0, 88e9), 88e9, 1e-3);
	/* Then the mean of the rate weighed with and the one the stretch ran at. */
	ck_assert_double_eq_tol(expert_rate_fold(77.7e9, 88.4e9),
				EXPERT_RATE_KEEP * 77.7e9 + (1 - EXPERT_RATE_KEEP) * 88.4e9, 1e-3);
	ck_assert(expert_rate_fold(77.7e9, 88.4e9) > 77.7e9 && expert_rate_fold(77.7e9, 88.4e9) < 88.4e9);
	/* A stretch that says nothing keeps what was learnt. */
	ck_assert_double_eq_tol(expert_rate_fold(77.7e9, 0), 77.7e9, 1e-3);
	ck_assert(expert_rate_fold(0, 0) == 0);
	ck_assert(expert_rate_fold(-1, -1) == 0);
	/* A rate that swings with the weighing (a share faster where it is smaller) settles: each
	 * stretch runs at 160 GB/s less the weighing, 80 GB/s where the two agree. Taken whole the rate
	 * would swing between 100 and 60 for ever; folded, it ends within 0.1 GB/s of 80. */
	double w = 100e9;
	for (int i = 0; i < 20; i++)
		w = expert_rate_fold(w, 160e9 - w);
	ck_assert_double_eq_tol(w, 80e9, 1e8);
}
END_TEST

START_TEST(test_expert_copy_share)
{
	/* No lead: the link's part of the rates. */
	ck_assert_double_eq_tol(expert_copy_share(70e6, 50e9, 75e9, 0), 0.4, 1e-12);
	/* A lead: both sides end together, the CPU starting lead later. */
	const double chosen = 70e6, h2d = 50e9, cpu = 75e9, lead = 100e-6;
	const double f = expert_copy_share(chosen, h2d, cpu, lead);
	ck_assert_double_gt(f, 0.4);
	ck_assert_double_eq_tol(f * chosen / h2d, lead + (1 - f) * chosen / cpu, 1e-12);
	/* Bounds: a lead longer than the copies of all take all; no CPU, all; no link, none. */
	ck_assert(expert_copy_share(chosen, h2d, cpu, 1.0) == 1);
	ck_assert(expert_copy_share(chosen, h2d, 0, 0) == 1);
	ck_assert(expert_copy_share(chosen, 0, cpu, lead) == 0);
	ck_assert_double_eq_tol(expert_copy_share(0, h2d, cpu, lead), 0.4, 1e-12); /* nothing chosen */
}
END_TEST

static Suite *plan_suite(void)
{
	Suite *s = suite_create("split_plan");
	TCase *tc = tcase_create("plan");
	tcase_add_test(tc, test_parse);
	tcase_add_test(tc, test_off_and_fixed);
	tcase_add_test(tc, test_auto_balance);
	tcase_add_test(tc, test_auto_per_layer);
	tcase_add_test(tc, test_auto_gpu_gaps);
	tcase_add_test(tc, test_auto_prefetch_credit);
	tcase_add_test(tc, test_calibrate);
	tcase_add_test(tc, test_jobs_factor);
	tcase_add_test(tc, test_expert_spans_rate);
	tcase_add_test(tc, test_expert_rate_fold);
	tcase_add_test(tc, test_expert_copy_share);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(plan_suite());
}

/* split_plan.c - the policy, calibration and choice of the CPU's share of streamed FFNs. See
 * split_plan.h. */
#include "services/gpu-runner/split_plan.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/cpu-compute/cpu_compute.h"
#include "services/gpu-runner/cpu-compute/ffn_share.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"

#define CAL_ROWS 64 /* rows per product of the calibration (a part's output on its stack) */
/* The calibration's job is cut as a split FFN's is (FFN_SHARE_PARTS_PER_THREAD parts a thread):
 * with one part a thread, the job waited for its slowest thread, and a worker that shared its CPU
 * with the runner's or the loader's threads made the rate far lower than the jobs then ran at (on
 * an H200 host: BF16 measured 43.7 GB/s, P1's split FFNs then read 80 GB/s). */
#define CAL_PARTS_PER_THREAD FFN_SHARE_PARTS_PER_THREAD


int cpu_share_parse(const char *text, struct cpu_share_policy *p, char *err, size_t errlen)
{
	memset(p, 0, sizeof(*p));
	if (!text || !*text)
		return errorf(err, errlen, -EINVAL, "--cpu-share needs a value: auto, 0 or a fraction in (0, 1]");
	if (!strcmp(text, "auto")) {
		p->mode = CPU_SHARE_AUTO;
		return 0;
	}
	char *end = NULL;
	errno = 0;
	double f = strtod(text, &end);
	if (errno || end == text || *end || !isfinite(f) || f < 0 || f > 1)
		return errorf(err, errlen, -EINVAL,
			      "--cpu-share '%s' is not auto, 0 or a fraction in (0, 1] (the CPU's part of each streamed "
			      "FFN)", text);
	p->mode = f == 0 ? CPU_SHARE_OFF : CPU_SHARE_FIXED;
	p->fraction = f;
	return 0;
}

const char *cpu_share_text(const struct cpu_share_policy *p, char *buf, size_t len)
{
	if (p->mode == CPU_SHARE_AUTO)
		snprintf(buf, len, "auto");
	else if (p->mode == CPU_SHARE_FIXED)
		snprintf(buf, len, "%.2f", p->fraction);
	else
		snprintf(buf, len, "off");
	return buf;
}

/* ---- calibration ---- */

/* The rows of one format a run multiplies: rows [row0[i], row0[i] + rows[i]) of samples sel[i]. */
struct cal_job {
	const struct split_sample *samples;
	uint32_t *sel, *row0, *rows;
	uint32_t n_sel;
	uint64_t total_rows;
	uint32_t format;
	struct cpu_vec **x; /* one per part */
	const float *xs;    /* (max cols) the vector */
};

static int cal_part(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	struct cal_job *j = arg;
	uint64_t b = j->total_rows * part / n_parts, e = j->total_rows * (part + 1) / n_parts, base = 0;
	float y[CAL_ROWS];
	uint32_t prepared = 0;
	for (uint32_t i = 0; i < j->n_sel && base < e; base += j->rows[i], i++) {
		uint64_t lo = b > base ? b - base : 0, hi = e - base < j->rows[i] ? e - base : j->rows[i];
		if (lo >= hi)
			continue;
		const struct split_sample *s = &j->samples[j->sel[i]];
		if (prepared != s->cols) {
			int rc = cpu_vec_prepare(j->x[part], (enum dtype)s->format, j->xs, s->cols, err, errlen);
			if (rc)
				return rc;
			prepared = s->cols;
		}
		for (uint64_t r = lo; r < hi; r += CAL_ROWS) {
			uint32_t r1 = (uint32_t)(hi - r < CAL_ROWS ? hi : r + CAL_ROWS);
			int rc = cpu_matvec(j->x[part], s->data, (enum dtype)s->format, s->row_bytes,
					    j->row0[i] + (uint32_t)r, j->row0[i] + r1, 0, s->cols, y, err, errlen);
			if (rc)
				return rc;
		}
	}
	return 0;
}

/* Runs the job on the pool and waits; its time in *ns. */
static int cal_run(struct task_pool *pool, struct cal_job *j, uint32_t parts, uint64_t *ns, char *err, size_t errlen)
{
	static uint32_t done, waiters, seq; /* long-lived words (task_pool.h); calibration runs on one thread */
	struct task_job tj;
	task_job_init(&tj, cal_part, j, parts, &done, ++seq);
	tj.done_waiters = &waiters;
	uint64_t t0 = now_ns();
	task_pool_submit(pool, &tj);
	task_word_wait(&done, &waiters, seq, 50, 0);
	*ns = now_ns() - t0;
	if (tj.rc)
		return errorf(err, errlen, tj.rc, "cpu share calibration: %s", tj.err);
	return 0;
}

static int cmp_double(const void *a, const void *b)
{
	const double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

/* Where the next run of a format starts: sample i, row r. */
struct cal_cursor {
	uint32_t i, r;
};

/* Selects into j the next budget bytes of j->format's rows from c on, going round the samples
 * (a format with fewer bytes than budget is read whole, once), and moves c past them.
 * Each run reads rows the runs before did not, as far as the samples go: run after run over the
 * same 512 MiB found part of it in the CPU's last-level cache and measured a rate (114 GB/s on
 * an H200 host) that the split FFNs, each read once a token, never reached (99). Returns the
 * bytes selected. j->sel, row0 and rows hold 2 n entries. */
static uint64_t cal_select(struct cal_job *j, uint32_t n, uint64_t budget, struct cal_cursor *c)
{
	uint64_t bytes = 0;
	j->n_sel = 0;
	j->total_rows = 0;
	const struct cal_cursor start = *c;
	for (uint32_t step = 0; step < 2 * n && bytes < budget && j->n_sel < 2 * n; step++) {
		const struct split_sample *s = &j->samples[c->i];
		if (step && c->i == start.i && c->r == start.r)
			break; /* round to where the run began: a row read twice would come from the caches */
		if (s->format == j->format && s->rows && s->row_bytes && c->r < s->rows) {
			uint64_t take = (budget - bytes) / s->row_bytes;
			if (take == 0 && bytes)
				break; /* less than a row of the budget left */
			if (take == 0)
				take = 1;
			/* back round at the run's first sample: up to the row the run began at */
			const uint32_t end = step && c->i == start.i && c->r < start.r ? start.r : s->rows;
			if (take > end - c->r)
				take = end - c->r;
			j->sel[j->n_sel] = c->i;
			j->row0[j->n_sel] = c->r;
			j->rows[j->n_sel++] = (uint32_t)take;
			j->total_rows += take;
			bytes += take * dtype_row_bytes((enum dtype)j->format, s->cols);
			c->r += (uint32_t)take;
			if (c->r < s->rows)
				continue; /* the budget is spent, or the run is back where it began */
		}
		c->i = (c->i + 1) % n;
		c->r = 0;
	}
	return bytes;
}

int split_calibrate(struct task_pool *pool, const struct split_sample *samples, uint32_t n, uint64_t budget,
		    const struct split_load *load, double rates[DT_COUNT], char *err, size_t errlen)
{
	uint32_t parts = task_pool_threads(pool) * CAL_PARTS_PER_THREAD, max_cols = 0;
	for (uint32_t i = 0; i < n; i++) {
		if (samples[i].format >= DT_COUNT)
			return errorf(err, errlen, -EINVAL, "cpu share calibration: sample %u has unknown format %u", i,
				      samples[i].format);
		max_cols = samples[i].cols > max_cols ? samples[i].cols : max_cols;
	}
	const size_t slots = 2 * (size_t)(n ? n : 1);
	uint32_t *sel = calloc(slots, sizeof(uint32_t)), *row0 = calloc(slots, sizeof(uint32_t)),
		 *rows = calloc(slots, sizeof(uint32_t));
	float *xs = calloc(max_cols ? max_cols : 1, sizeof(float));
	struct cpu_vec **x = calloc(parts, sizeof(*x));
	int rc = 0;
	if (!sel || !row0 || !rows || !xs || !x) {
		rc = errorf(err, errlen, -ENOMEM, "cpu share calibration: out of memory");
		goto out;
	}
	for (uint32_t i = 0; i < max_cols; i++)
		xs[i] = (float)((i * 2654435761u >> 16) % 2001) / 1000.0f - 1.0f;
	for (uint32_t p = 0; p < parts && rc == 0; p++)
		rc = cpu_vec_create(max_cols, &x[p], err, errlen);
	for (uint32_t f = 0; f < DT_COUNT && rc == 0; f++) {
		struct cal_job j = {
			.samples = samples, .sel = sel, .row0 = row0, .rows = rows, .format = f, .x = x, .xs = xs};
		struct cal_cursor c = {0, 0};
		uint64_t bytes = cal_select(&j, n, budget, &c), ns = 0;
		if (!bytes)
			continue;
		double rate[SPLIT_CALIBRATE_MAX_RUNS];
		uint32_t runs = 0;
		const bool loaded = load && load->start(load->arg);
		rc = cal_run(pool, &j, parts, &ns, err, errlen); /* warms up */
		while (rc == 0 && runs < SPLIT_CALIBRATE_MAX_RUNS &&
		       (runs < SPLIT_CALIBRATE_RUNS || (loaded && load->busy(load->arg)))) {
			bytes = cal_select(&j, n, budget, &c);
			rc = cal_run(pool, &j, parts, &ns, err, errlen);
			rate[runs++] = (double)bytes / ((double)(ns ? ns : 1) * 1e-9);
		}
		if (loaded)
			load->finish(load->arg);
		if (rc)
			break;
		qsort(rate, runs, sizeof(rate[0]), cmp_double);
		rates[f] = rate[runs / 2];
	}
out:
	for (uint32_t p = 0; x && p < parts; p++)
		cpu_vec_destroy(&x[p]);
	free(x);
	free(xs);
	free(sel);
	free(row0);
	free(rows);
	return rc;
}

/* ---- the choice ---- */

/* Seconds the CPU takes for a whole FFN of layer l (all its rows), from the rates. */
static double cpu_time(const struct split_layer *l, const double *rates)
{
	double t = 0;
	for (int i = 0; i < 3; i++)
		t += rates[l->format[i]] > 0 ? (double)l->bytes[i] / rates[l->format[i]] : INFINITY;
	return t;
}

int split_plan_choose(const struct model_config *cfg, const struct split_layer *layers, uint64_t other_streamed,
		      double h2d_bps, const struct cpu_share_policy *pol, struct split_plan *plan, char *err,
		      size_t errlen)
{
	const uint32_t L = cfg->n_layers, ffn = cfg->ffn_dim;
	const double handoff = pol->handoff_s > 0 ? pol->handoff_s : SPLIT_HANDOFF_S;
	uint32_t *r = plan->r;
	memset(plan, 0, sizeof(*plan));
	plan->r = r;
	plan->max_tokens = 1;
	uint64_t split_bytes = 0, pcie = other_streamed;
	uint32_t n_elig = 0;
	double cpu_all = 0; /* the eligible FFNs whole on the CPU */
	double gaps = 0;    /* the GPU's own work between them (split_layer.gpu_s) */
	for (uint32_t l = 0; l < L; l++) {
		r[l] = ffn;
		uint64_t b = layers[l].bytes[0] + layers[l].bytes[1] + layers[l].bytes[2];
		if (pol->mode == CPU_SHARE_OFF || !layers[l].eligible) {
			pcie += layers[l].eligible ? b : 0;
			continue;
		}
		n_elig++;
		split_bytes += b;
		gaps += layers[l].gpu_s > 0 ? layers[l].gpu_s : 0;
		if (layers[l].format[2] >= DT_COUNT)
			return errorf(err, errlen, -EINVAL, "cpu share: layer %u's down_proj has unknown format %u", l,
				      layers[l].format[2]);
		if (pol->mode == CPU_SHARE_AUTO) {
			double t = cpu_time(&layers[l], pol->cpu_bytes_per_s);
			const uint32_t *f = layers[l].format;
			if (!isfinite(t))
				return errorf(err, errlen, -EINVAL,
					      "cpu share: auto needs the CPU's rate for %s, %s and %s (layer %u): not "
					      "measured", dtype_name((enum dtype)f[0]), dtype_name((enum dtype)f[1]),
					      dtype_name((enum dtype)f[2]), l);
			cpu_all += t;
		}
	}
	double s = 0, credit = 0; /* credit: auto's bytes of a share counted as read ahead */
	if (n_elig && pol->mode == CPU_SHARE_FIXED) {
		s = pol->fraction;
	} else if (n_elig && pol->mode == CPU_SHARE_AUTO) {
		if (!(h2d_bps > 0))
			return errorf(err, errlen, -EINVAL, "cpu share: auto needs the measured H2D rate");
		double p_all = (double)(other_streamed + split_bytes) / h2d_bps; /* nothing split */
		s = (p_all - n_elig * handoff - gaps) / ((double)split_bytes / h2d_bps + cpu_all);
		s = !(s > 0) ? 0 : s > 1 ? 1 : s; /* NaN (0 / 0): none */
		/* The read-ahead, at most the bytes the share read without it, at the FFNs' mean rate. */
		const double per = split_bytes ? (double)split_bytes / n_elig : 0;
		const double ra = pol->prefetch_bytes < s * per ? (double)pol->prefetch_bytes : s * per;
		if (ra > 0) {
			s = (p_all - n_elig * handoff - gaps + n_elig * ra * cpu_all / (double)split_bytes) /
			    ((double)split_bytes / h2d_bps + cpu_all);
			s = !(s > 0) ? 0 : s > 1 ? 1 : s;
			credit = ra;
		}
	}
	plan->share = s;
	plan->r_min = ffn;
	const bool per_layer = pol->mode == CPU_SHARE_AUTO && pol->per_layer && n_elig;
	double s_sum = 0;
	double cpu_s = 0, jobs_s = 0, rate_min = INFINITY;
	for (uint32_t l = 0; l < L && n_elig; l++) {
		const struct split_layer *ly = &layers[l];
		if (!ly->eligible)
			continue;
		uint64_t b = ly->bytes[0] + ly->bytes[1] + ly->bytes[2];
		uint32_t unit = ffn_split_unit((enum dtype)ly->format[2]);
		double s_l = s, credit_l = credit;
		if (per_layer) { /* this layer's copies and CPU rows equally long */
			const double gap = ly->gpu_s > 0 ? ly->gpu_s : 0, t = cpu_time(ly, pol->cpu_bytes_per_s);
			const double num = (double)(ly->other_bytes + b) / h2d_bps - handoff - gap,
				     den = (double)b / h2d_bps + t;
			s_l = b ? num / den : 0;
			s_l = !(s_l > 0) ? 0 : s_l > 1 ? 1 : s_l; /* NaN: none */
			/* The read-ahead, at most what the share read without it. */
			const double ra = (double)pol->prefetch_bytes < s_l * b ? (double)pol->prefetch_bytes : s_l * b;
			if (ra > 0) {
				s_l = (num + ra * t / (double)b) / den;
				s_l = !(s_l > 0) ? 0 : s_l > 1 ? 1 : s_l;
			}
			credit_l = ra > 0 ? ra : 0;
			s_sum += s_l;
		}
		uint32_t units = ffn / unit, cpu_units = (uint32_t)lround(s_l * units);
		if (pol->mode == CPU_SHARE_FIXED && cpu_units == 0)
			cpu_units = 1; /* a share was asked for: at least one unit */
		if (cpu_units > units)
			cpu_units = units;
		if (cpu_units == 0 || ffn % unit) {
			pcie += b;
			continue;
		}
		r[l] = ffn - cpu_units * unit;
		/* Every matrix of the FFN splits in proportion: rows of gate and up, whole blocks of down's rows. */
		uint64_t cpu_b = (uint64_t)((double)b * (ffn - r[l]) / ffn + 0.5);
		plan->cpu_bytes += cpu_b;
		pcie += b - cpu_b;
		plan->split_layers++;
		plan->r_min = r[l] < plan->r_min ? r[l] : plan->r_min;
		plan->r_max = r[l] > plan->r_max ? r[l] : plan->r_max;
		double t = cpu_time(ly, pol->cpu_bytes_per_s);
		if (isfinite(t)) {
			/* What the plan counted as read ahead is not the job's time. */
			const double ra = (credit_l < (double)cpu_b ? credit_l : (double)cpu_b) * t / (double)b;
			jobs_s += t * (ffn - r[l]) / ffn - ra;
			cpu_s += t * (ffn - r[l]) / ffn - ra + handoff;
			double rate = (double)b / t;
			rate_min = rate < rate_min ? rate : rate_min;
		}
	}
	if (per_layer)
		plan->share = s_sum / n_elig;
	if (!plan->split_layers)
		plan->r_min = plan->r_max = ffn;
	plan->pcie_bytes = pcie;
	plan->pcie_s = h2d_bps > 0 ? (double)pcie / h2d_bps : 0;
	plan->cpu_s = cpu_s;
	plan->jobs_s = jobs_s;
	if (h2d_bps > 0 && isfinite(rate_min)) {
		double n = floor(rate_min / h2d_bps);
		plan->max_tokens = n < 1 ? 1 : n > FFN_SPLIT_MAX_TOKENS ? FFN_SPLIT_MAX_TOKENS : (uint32_t)n;
	}
	return 0;
}

double split_jobs_factor(const struct split_jobs *seen, uint32_t split_layers, uint64_t plan_bytes, double plan_jobs_s)
{
	if (!split_layers || !plan_bytes || !(plan_jobs_s > 0) || !seen->ns || !seen->bytes ||
	    seen->jobs < (uint64_t)SPLIT_REPLAN_MIN_TOKENS * split_layers)
		return 0;
	const double seen_rate = (double)seen->bytes / ((double)seen->ns * 1e-9);
	return seen_rate / ((double)plan_bytes / plan_jobs_s);
}

double expert_spans_rate(const struct expert_spans *seen)
{
	if (seen->layers < EXPERT_RATE_MIN_LAYERS || !seen->bytes || !(seen->ms > 0))
		return 0;
	return (double)seen->bytes / (seen->ms * 1e-3);
}

double expert_rate_fold(double learnt, double seen)
{
	if (!(seen > 0))
		return learnt > 0 ? learnt : 0;
	return learnt > 0 ? EXPERT_RATE_KEEP * learnt + (1 - EXPERT_RATE_KEEP) * seen : seen;
}

double expert_spans_lead(const struct expert_spans *seen)
{
	if (seen->gaps < EXPERT_LEAD_MIN_GAPS || !(seen->gap_ms > 0))
		return 0;
	return seen->gap_ms * 1e-3 / (double)seen->gaps;
}

double expert_copy_share(double chosen, double h2d, double cpu, double lead)
{
	if (!(h2d > 0))
		return 0;
	if (!(cpu > 0))
		return 1;
	/* copies c / h2d = lead + (chosen - c) / cpu */
	double f = h2d / (h2d + cpu);
	if (lead > 0 && chosen > 0)
		f += lead * h2d * cpu / (chosen * (h2d + cpu));
	return f < 0 ? 0 : f > 1 ? 1 : f;
}

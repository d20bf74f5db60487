/* test_hooks.cu - the CUDA backend's test hooks (cuda_test.h): a product through matmul() /
 * swiglu_product() with buffers of the hook's own, a layer's experts computed together and apart,
 * a read of the residual stream, a failure injected into the CPU share of a split FFN or into
 * a routed expert the CPU computes, the stamps of a traced step's launches, a draw of the device's
 * sampler from given logits, and one step between cudaProfilerStart and cudaProfilerStop
 * (PIPELINE_CUDA_PROFILE_STEP). */
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cuda/cuda_test.h"
#include "services/gpu-runner/cuda/moe_internal.h"
#include "common/log.h"

#include <cuda_profiler_api.h>
#include <stdint.h>
#include <stdlib.h>

/* The cuda device state behind be, or NULL with a message. */
static struct backend_dev *cuda_dev(struct backend *be, char *err, size_t errlen)
{
	if (backend_impl_of(be) != &backend_cuda_impl) {
		snprintf(err, errlen, "test hook: backend '%s' is not the cuda backend", backend_name(be));
		return NULL;
	}
	return backend_dev_of(be);
}

/* x (count floats) rounded to dtype at into dst. */
static void to_act(uint32_t at, const float *x, size_t count, void *dst)
{
	for (size_t i = 0; i < count; i++) {
		if (at == DT_F32)
			((float *)dst)[i] = x[i];
		else if (at == DT_BF16)
			((uint16_t *)dst)[i] = f32_to_bf16(x[i]);
		else
			((uint16_t *)dst)[i] = f32_to_f16(x[i]);
	}
}

static int product(struct backend_dev *be, const struct cuda_test_product *t, void *dx, float *dout, void *dact)
{
	const uint32_t at = act_dtype(t->format);
	const uint64_t rb = dtype_row_bytes((enum dtype)t->format, t->cols);
	if (t->mode == CUDA_TEST_SWIGLU) {
		struct mm_part gu[2] = {{t->w[0], t->rows, dout, t->format, rb},
					{t->w[1], t->rows, dout + t->rows, t->format, rb}};
		return swiglu_product(be, at, gu, dx, NULL, t->cols, t->n, dact, "test gate/up");
	}
	struct mm_part p = {t->w[0], t->rows, dout, t->format, rb};
	return matmul(be, at, dx, NULL, t->cols, t->n, &p, 1, t->rows, t->mode == CUDA_TEST_ADD, "test product");
}

int cuda_test_matmul(struct backend *bk, const struct cuda_test_product *t, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	if (!be)
		return -EINVAL;
	if (!t->rows || !t->cols || !t->n || t->format >= DT_COUNT || t->mode > CUDA_TEST_SWIGLU ||
	    t->cols % dtype_block_elems((enum dtype)t->format)) {
		snprintf(err, errlen, "test hook: bad product (%u x %u of format %u, %u tokens, mode %u)", t->rows, t->cols,
			 t->format, t->n, t->mode);
		return -EINVAL;
	}
	const uint32_t at = act_dtype(t->format);
	const size_t es = dtype_size((enum dtype)at), nx = (size_t)t->n * t->cols, no = (size_t)t->n * t->rows;
	const bool sw = t->mode == CUDA_TEST_SWIGLU;
	void *hx = malloc(nx * es), *hact = malloc(no * es), *dx = NULL, *dact = NULL;
	float *dout = NULL;
	int rc = -ENOMEM;
	if (!hx || !hact) {
		snprintf(err, errlen, "test hook: out of host memory");
		goto out;
	}
	to_act(at, t->x, nx, hx);
	rc = -EIO;
	if (cudaMalloc(&dx, nx * es) != cudaSuccess ||
	    cudaMalloc((void **)&dout, no * (sw ? 2 : 1) * sizeof(float)) != cudaSuccess ||
	    cudaMalloc(&dact, no * es) != cudaSuccess) {
		snprintf(err, errlen, "test hook: cudaMalloc failed");
		goto out;
	}
	if (cudaMemcpyAsync(dx, hx, nx * es, cudaMemcpyHostToDevice, be->stream) != cudaSuccess ||
	    (t->mode == CUDA_TEST_ADD &&
	     cudaMemcpyAsync(dout, t->out, no * sizeof(float), cudaMemcpyHostToDevice, be->stream) != cudaSuccess)) {
		snprintf(err, errlen, "test hook: upload failed");
		goto out;
	}
	rc = product(be, t, dx, dout, dact);
	if (rc) {
		snprintf(err, errlen, "%s", be->err);
		goto out;
	}
	rc = -EIO;
	cudaError_t e;
	if (sw) {
		e = cudaMemcpyAsync(hact, dact, no * es, cudaMemcpyDeviceToHost, be->stream);
		if (e == cudaSuccess)
			e = cudaStreamSynchronize(be->stream);
		if (e == cudaSuccess)
			for (size_t i = 0; i < no; i++)
				t->out[i] = dtype_get_f32((enum dtype)at, hact, i);
	} else {
		e = cudaMemcpyAsync(t->out, dout, no * sizeof(float), cudaMemcpyDeviceToHost, be->stream);
		if (e == cudaSuccess)
			e = cudaStreamSynchronize(be->stream);
	}
	if (e != cudaSuccess) {
		snprintf(err, errlen, "test hook: the product failed on the device: %s", cudaGetErrorString(e));
		goto out;
	}
	rc = 0;
out:
	cudaStreamSynchronize(be->stream);
	cudaFree(dx);
	cudaFree(dout);
	cudaFree(dact);
	free(hx);
	free(hact);
	return rc;
}

int cuda_test_experts_together(struct backend *bk, const struct cuda_test_experts *t, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	if (!be)
		return -EINVAL;
	const uint32_t at = act_dtype(t->gate_format), n = t->n, dim = t->dim, F = t->F;
	if (!n || n > GEMV_MATS || !dim || !F || t->gate_format >= DT_COUNT || t->down_format >= DT_COUNT ||
	    act_dtype(t->down_format) != at) {
		snprintf(err, errlen, "test hook: bad experts (%u of %u x %u, formats %u and %u)", n, F, dim,
			 t->gate_format, t->down_format);
		return -EINVAL;
	}
	const size_t es = dtype_size((enum dtype)at);
	const size_t stride = moe_act_stride(F); /* moe.cu's act rows */
	const uint64_t grb = dtype_row_bytes((enum dtype)t->gate_format, dim),
		       drb = dtype_row_bytes((enum dtype)t->down_format, F);
	void *hx = malloc((size_t)dim * es), *dx = NULL, *dact = NULL;
	float *dout = NULL, *dgu = NULL;
	int rc = -ENOMEM;
	if (!hx) {
		snprintf(err, errlen, "test hook: out of host memory");
		goto out;
	}
	to_act(at, t->x, dim, hx);
	rc = -EIO;
	if (cudaMalloc(&dx, (size_t)dim * es) != cudaSuccess || cudaMalloc(&dact, n * stride) != cudaSuccess ||
	    cudaMalloc((void **)&dout, 2 * (size_t)n * dim * sizeof(float)) != cudaSuccess ||
	    cudaMalloc((void **)&dgu, 2 * (size_t)F * sizeof(float)) != cudaSuccess ||
	    cudaMemcpyAsync(dx, hx, (size_t)dim * es, cudaMemcpyHostToDevice, be->stream) != cudaSuccess ||
	    cudaMemsetAsync(dout, 0xff, 2 * (size_t)n * dim * sizeof(float), be->stream) != cudaSuccess) {
		snprintf(err, errlen, "test hook: device buffers failed");
		goto out;
	}
	struct mm_expert ex[GEMV_MATS];
	for (uint32_t j = 0; j < n; j++) {
		ex[j].gate = (struct mm_part){t->gate[j], F, dgu, t->gate_format, grb};
		ex[j].up = (struct mm_part){t->up[j], F, dgu + F, t->gate_format, grb};
		ex[j].down = (struct mm_part){t->down[j], dim, dout + (size_t)j * dim, t->down_format, drb};
		ex[j].act = (char *)dact + j * stride;
		if (!expert_batch_fits(be, &ex[j], dim, F, dx) || !expert_batch_joins(&ex[0], &ex[j])) {
			snprintf(err, errlen, "test hook: expert %u cannot go with the others", j);
			rc = -ENOTSUP;
			goto out;
		}
	}
	if ((rc = experts_batch(be, ex, n, dx, dim, F, NULL, NULL))) {
		snprintf(err, errlen, "%s", be->err);
		goto out;
	}
	/* Apart, into the second half, through the same act rows (the stream orders them). */
	for (uint32_t j = 0; j < n; j++) {
		struct mm_part gu[2] = {ex[j].gate, ex[j].up}, down = ex[j].down;
		down.out = dout + (size_t)(n + j) * dim;
		if ((rc = swiglu_product(be, at, gu, dx, NULL, dim, 1, ex[j].act, "test experts' gate/up")) ||
		    (rc = matmul(be, at, ex[j].act, NULL, F, 1, &down, 1, dim, false, "test experts' down"))) {
			snprintf(err, errlen, "%s", be->err);
			goto out;
		}
	}
	rc = -EIO;
	cudaError_t e;
	if ((e = cudaMemcpyAsync(t->together, dout, (size_t)n * dim * sizeof(float), cudaMemcpyDeviceToHost,
				 be->stream)) != cudaSuccess ||
	    (e = cudaMemcpyAsync(t->apart, dout + (size_t)n * dim, (size_t)n * dim * sizeof(float),
				 cudaMemcpyDeviceToHost, be->stream)) != cudaSuccess ||
	    (e = cudaStreamSynchronize(be->stream)) != cudaSuccess) {
		snprintf(err, errlen, "test hook: the experts failed on the device: %s", cudaGetErrorString(e));
		goto out;
	}
	rc = 0;
out:
	cudaStreamSynchronize(be->stream);
	cudaFree(dx);
	cudaFree(dact);
	cudaFree(dout);
	cudaFree(dgu);
	free(hx);
	return rc;
}

int cuda_test_residual(struct backend *bk, float *out, uint32_t n, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	if (!be)
		return -EINVAL;
	if (n > be->p.max_chunk) {
		snprintf(err, errlen, "test hook: %u rows of the residual stream, it holds %u", n, be->p.max_chunk);
		return -EINVAL;
	}
	cudaError_t e = cudaMemcpyAsync(out, be->x, (size_t)n * be->cfg.dim * sizeof(float), cudaMemcpyDeviceToHost,
					be->stream);
	if (e == cudaSuccess)
		e = cudaStreamSynchronize(be->stream);
	if (e != cudaSuccess) {
		snprintf(err, errlen, "test hook: reading the residual stream failed: %s", cudaGetErrorString(e));
		return -EIO;
	}
	return 0;
}

int cuda_test_sample(struct backend *bk, const float *logits, float temperature, uint32_t top_k, float top_p,
		     float min_p, double u, int32_t *token, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	if (!be)
		return -EINVAL;
	if (!(temperature > 0.0f)) {
		snprintf(err, errlen, "test hook: temperature %g is not > 0", (double)temperature);
		return -EINVAL;
	}
	const uint32_t n = be->cfg.vocab_size;
	cudaError_t e = cudaMemcpyAsync(be->logits, logits, (size_t)n * sizeof(float), cudaMemcpyHostToDevice, be->stream);
	if (e == cudaSuccess) {
		sample_launch(be->logits, n, 1.0f / temperature, top_k, top_p, min_p, u, be->status, be->stream);
		e = cudaGetLastError();
	}
	if (e == cudaSuccess) /* the kernel sets the token first (-1: none drawn) */
		e = cudaMemcpyAsync(be->h_status, be->status, sizeof(*be->status), cudaMemcpyDeviceToHost, be->stream);
	if (e == cudaSuccess)
		e = cudaStreamSynchronize(be->stream);
	if (e != cudaSuccess) {
		snprintf(err, errlen, "test hook: sampling failed: %s", cudaGetErrorString(e));
		return -EIO;
	}
	*token = be->h_status->token;
	return 0;
}

int64_t cuda_test_early_kv_launches(struct backend *bk, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	return be ? (int64_t)be->early_kv_launches : -EINVAL;
}

int64_t cuda_test_wide_launches(struct backend *bk, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	return be ? (int64_t)be->wide_launches : -EINVAL;
}

int64_t cuda_test_apart_launches(struct backend *bk, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	return be ? (int64_t)be->apart_launches : -EINVAL;
}

int64_t cuda_test_mix_launches(struct backend *bk, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	return be ? (int64_t)be->mix_launches : -EINVAL;
}

int64_t cuda_test_whole_launches(struct backend *bk, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	return be ? (int64_t)be->whole_launches : -EINVAL;
}

int64_t cuda_test_two_warp_launches(struct backend *bk, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	return be ? (int64_t)be->two_warp_launches : -EINVAL;
}

int cuda_test_leave_out(struct backend *bk, uint32_t parts, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	if (!be)
		return -EINVAL;
	if (parts >= 2 * CUDA_TEST_DOWN) {
		snprintf(err, errlen, "test hook: leave_out 0x%x names parts that do not exist", parts);
		return -EINVAL;
	}
	be->leave_out = parts & CUDA_TEST_ATTN ? parts | CUDA_TEST_ROPE : parts;
	return 0;
}

int cuda_test_fail_cpu_share(struct backend *bk, uint32_t nth, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	if (!be)
		return -EINVAL;
	if (!be->handoff) {
		snprintf(err, errlen, "test hook: the backend has no CPU share (no backend_params.cpu_pool)");
		return -EINVAL;
	}
	be->split_fail_at = nth ? be->split_n + nth : 0;
	return 0;
}

int cuda_test_fail_cpu_expert(struct backend *bk, uint32_t nth, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	if (!be)
		return -EINVAL;
	if (!be->moe || !be->moe->jobs) {
		snprintf(err, errlen, "test hook: the backend has no experts on the CPU (a mixture-of-experts config "
			 "and backend_params.cpu_pool)");
		return -EINVAL;
	}
	be->moe->fail_in = nth;
	return 0;
}

/* ---- a step's launches stamped (cuda_test_trace) ---------------------------------------------- */

#define KTRACE_LAUNCH_STAMPS ((size_t)KTRACE_MAX_BLOCKS * KTRACE_POINTS)
#define KTRACE_LOG_BYTES (KTRACE_MAX_LAUNCHES * KTRACE_LAUNCH_STAMPS * sizeof(unsigned long long))

struct ktrace ktrace_next(const struct backend_dev *be, const char *what)
{
	struct ktrace k = {NULL};
	struct ktrace_log *lg = be->trace;
	if (!lg || !lg->on || be->n != 1 || lg->n >= KTRACE_MAX_LAUNCHES)
		return k;
	lg->what[lg->n] = what;
	k.t = lg->dev + lg->n++ * KTRACE_LAUNCH_STAMPS;
	return k;
}

int ktrace_step(struct backend_dev *be, uint32_t n)
{
	struct ktrace_log *lg = be->trace;
	if (!lg || !lg->on || n != 1)
		return 0;
	lg->n = 0;
	CUDA_TRY(be, "cudaMemsetAsync (trace)",
		 cudaMemsetAsync(lg->dev, 0, KTRACE_LOG_BYTES, be->stream));
	return 0;
}

/* A step number from the environment variable `name` (0 where unset or not one, said once). */
static int32_t profile_env(const char *name)
{
	const char *v = getenv(name);
	char *end = NULL;
	long k = v && *v ? strtol(v, &end, 10) : 0;
	if (v && *v && (*end || k < 0 || k > INT32_MAX)) {
		log_warn("cuda backend: %s=%s is not a step number (1, 2, ...; 0: none): no step is profiled", name, v);
		k = 0;
	}
	return (int32_t)k;
}

void profile_step(struct backend_dev *be, uint32_t n)
{
	if (be->prof_left < 0) {
		be->prof_left = profile_env("PIPELINE_CUDA_PROFILE_STEP");
		be->prof_one_left = profile_env("PIPELINE_CUDA_PROFILE_DECODE");
	}
	profile_end(be);
	int32_t *left = n > 1 ? &be->prof_left : &be->prof_one_left;
	if (*left > 0 && --*left == 0) {
		cudaError_t e = cudaProfilerStart();
		if (e != cudaSuccess) {
			log_warn("cuda backend: cudaProfilerStart: %s", cudaGetErrorString(e));
			(void)cudaGetLastError();
			return;
		}
		be->profiling = true;
		log_info("cuda backend: profiling a step of %u token%s (%s)", n, n == 1 ? "" : "s",
			 n > 1 ? "PIPELINE_CUDA_PROFILE_STEP" : "PIPELINE_CUDA_PROFILE_DECODE");
	}
}

void profile_end(struct backend_dev *be)
{
	if (!be->profiling)
		return;
	be->profiling = false;
	if (cudaProfilerStop() != cudaSuccess)
		(void)cudaGetLastError();
}

void ktrace_free(struct backend_dev *be)
{
	if (!be->trace)
		return;
	cudaFree(be->trace->dev);
	free(be->trace);
	be->trace = NULL;
}

int cuda_test_trace(struct backend *bk, bool on, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	if (!be)
		return -EINVAL;
	if (on && !be->trace) {
		struct ktrace_log *lg = (struct ktrace_log *)calloc(1, sizeof(*lg));
		cudaError_t e = lg ? cudaMalloc(&lg->dev, KTRACE_LOG_BYTES) : cudaErrorMemoryAllocation;
		if (e != cudaSuccess) {
			free(lg);
			snprintf(err, errlen, "test hook: the trace's %zu MiB: %s", KTRACE_LOG_BYTES >> 20,
				 cudaGetErrorString(e));
			return -ENOMEM;
		}
		be->trace = lg;
	}
	if (be->trace)
		be->trace->on = on;
	return 0;
}

static int cmp_u64(const void *a, const void *b)
{
	const unsigned long long x = *(const unsigned long long *)a, y = *(const unsigned long long *)b;
	return x < y ? -1 : x > y;
}

/* The last traced step's first nl launches' stamps, copied to the host (*hp, to free), and the
 * step's first stamp (*t0). */
static int trace_copy(struct backend_dev *be, uint32_t nl, unsigned long long **hp, unsigned long long *t0,
		      char *err, size_t errlen)
{
	const size_t count = nl * KTRACE_LAUNCH_STAMPS;
	unsigned long long *h = (unsigned long long *)malloc(count * sizeof(*h) + 1);
	cudaError_t e = h ? cudaStreamSynchronize(be->stream) : cudaErrorMemoryAllocation;
	if (e == cudaSuccess)
		e = cudaMemcpy(h, be->trace->dev, count * sizeof(*h), cudaMemcpyDeviceToHost);
	if (e != cudaSuccess) {
		free(h);
		snprintf(err, errlen, "test hook: reading the trace: %s", cudaGetErrorString(e));
		return -EIO;
	}
	*t0 = ~0ull;
	for (size_t i = 0; i < count; i += KTRACE_POINTS)
		if (h[i] && h[i] < *t0)
			*t0 = h[i];
	*hp = h;
	return 0;
}

int cuda_test_trace_read(struct backend *bk, struct cuda_trace_launch *out, uint32_t max, uint32_t *n, char *err,
			 size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	if (!be)
		return -EINVAL;
	struct ktrace_log *lg = be->trace;
	*n = 0;
	if (!lg)
		return 0;
	const uint32_t nl = lg->n < max ? lg->n : max;
	unsigned long long *h = NULL, t0;
	unsigned long long *col = (unsigned long long *)malloc(KTRACE_MAX_BLOCKS * sizeof(*col));
	if (!col) {
		snprintf(err, errlen, "test hook: reading the trace: out of memory");
		return -ENOMEM;
	}
	int rc = trace_copy(be, nl, &h, &t0, err, errlen);
	if (rc) {
		free(col);
		return rc;
	}
	for (uint32_t l = 0; l < nl; l++) {
		const unsigned long long *r = h + l * KTRACE_LAUNCH_STAMPS;
		struct cuda_trace_launch *o = out + l;
		double *med[KTRACE_STAMPS] = {&o->start_med, &o->wait_med, &o->staged_med, &o->end_med};
		double *lo[KTRACE_STAMPS] = {&o->start_first, &o->wait_first, &o->staged_first, &o->end_first};
		double *hi[KTRACE_STAMPS] = {&o->start_last, &o->wait_last, &o->staged_last, &o->end_last};
		o->what = lg->what[l];
		o->blocks = 0;
		for (uint32_t p = 0; p < KTRACE_STAMPS; p++) {
			uint32_t k = 0;
			for (uint32_t b = 0; b < KTRACE_MAX_BLOCKS; b++)
				if (r[(size_t)b * KTRACE_POINTS + p])
					col[k++] = r[(size_t)b * KTRACE_POINTS + p] - t0;
			if (p == 0)
				o->blocks = k;
			qsort(col, k, sizeof(*col), cmp_u64);
			*lo[p] = k ? col[0] / 1e3 : -1.0;
			*med[p] = k ? col[k / 2] / 1e3 : -1.0;
			*hi[p] = k ? col[k - 1] / 1e3 : -1.0;
		}
	}
	*n = nl;
	free(h);
	free(col);
	return 0;
}

int cuda_test_trace_blocks(struct backend *bk, uint32_t launch, struct cuda_trace_block *out, uint32_t max,
			   uint32_t *n, char *err, size_t errlen)
{
	struct backend_dev *be = cuda_dev(bk, err, errlen);
	if (!be)
		return -EINVAL;
	*n = 0;
	if (!be->trace || launch >= be->trace->n)
		return 0;
	unsigned long long *h = NULL, t0;
	int rc = trace_copy(be, launch + 1, &h, &t0, err, errlen);
	if (rc)
		return rc;
	const unsigned long long *r = h + launch * KTRACE_LAUNCH_STAMPS;
	for (uint32_t b = 0; b < KTRACE_MAX_BLOCKS && *n < max; b++) {
		const unsigned long long *s = r + (size_t)b * KTRACE_POINTS;
		if (!s[0])
			continue;
		struct cuda_trace_block *o = out + (*n)++;
		o->block = b;
		o->sm = s[KTRACE_SM] ? (int32_t)(s[KTRACE_SM] - 1) : -1;
		double *v[KTRACE_STAMPS] = {&o->start, &o->wait, &o->staged, &o->end};
		for (uint32_t p = 0; p < KTRACE_STAMPS; p++)
			*v[p] = s[p] ? (s[p] - t0) / 1e3 : -1.0;
	}
	free(h);
	return 0;
}

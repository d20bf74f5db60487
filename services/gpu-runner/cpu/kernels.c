/* kernels.c - the C reference's scalar kernels (kernels.h): numerics as kernels.h describes. */
#include "services/gpu-runner/cpu/kernels.h"

#include <math.h>

/* sum a[i] * b[i] in double: float products are exact in double; four partial sums in a fixed
 * order let the compiler pipeline them without changing the result from run to run. */
double cpu_dot_f32(const float *a, const float *b, uint32_t n)
{
	double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
	uint32_t i = 0;
	for (; i + 4 <= n; i += 4) {
		s0 += (double)a[i] * b[i];
		s1 += (double)a[i + 1] * b[i + 1];
		s2 += (double)a[i + 2] * b[i + 2];
		s3 += (double)a[i + 3] * b[i + 3];
	}
	for (; i < n; i++)
		s0 += (double)a[i] * b[i];
	return (s0 + s1) + (s2 + s3);
}

/* transformers LlamaRMSNorm in float32: variance = mean(x^2); x * rsqrt(variance + eps), then
 * weight * that. The mean is taken in double and rounded; the rest rounds as torch does. */
void cpu_rmsnorm(float *out, const float *x, const void *w, uint32_t wt, uint32_t dim, float eps)
{
	double ss = 0;
	for (uint32_t i = 0; i < dim; i++)
		ss += (double)x[i] * x[i];
	float var = (float)(ss / dim);
	float r = 1.0f / sqrtf(var + eps);
	for (uint32_t i = 0; i < dim; i++)
		out[i] = dtype_get_f32((enum dtype)wt, w, i) * (x[i] * r);
}

/* silu(g) * u as torch: silu rounded to float32, then the float32 product. */
float cpu_silu_mul(float g, float u)
{
	float s = (float)((double)g / (1.0 + exp(-(double)g)));
	return s * u;
}

/* cos and sin of position pos for each frequency: the angle is the float32 product, as
 * transformers' freqs = inv_freq.float() @ pos.float(); cos/sin of that float angle. */
void cpu_rope_cos_sin(const float *inv, uint32_t half, uint32_t pos, float *cs, float *sn)
{
	for (uint32_t i = 0; i < half; i++) {
		float angle = (float)pos * inv[i];
		cs[i] = (float)cos((double)angle);
		sn[i] = (float)sin((double)angle);
	}
}

/* rotate_half layout (not interleaved): the pair is (x[i], x[i + hd/2]). */
void cpu_rope_apply(float *x, const float *cs, const float *sn, uint32_t half)
{
	for (uint32_t i = 0; i < half; i++) {
		float x1 = x[i], x2 = x[i + half];
		x[i] = x1 * cs[i] - x2 * sn[i];
		x[i + half] = x2 * cs[i] + x1 * sn[i];
	}
}

/* GGUF's layout: the pair is (x[2i], x[2i + 1]), with the same arithmetic per pair. */
void cpu_rope_apply_adjacent(float *x, const float *cs, const float *sn, uint32_t half)
{
	for (uint32_t i = 0; i < half; i++) {
		float x1 = x[2 * i], x2 = x[2 * i + 1];
		x[2 * i] = x1 * cs[i] - x2 * sn[i];
		x[2 * i + 1] = x2 * cs[i] + x1 * sn[i];
	}
}

void cpu_moe_route(const float *logits, uint32_t n, uint32_t k, bool norm, uint32_t *ids, float *w)
{
	/* softmax: exp(l - max) / sum, the sum in double, each probability rounded to float32. */
	float mx = logits[0];
	for (uint32_t e = 1; e < n; e++)
		if (logits[e] > mx)
			mx = logits[e];
	double sum = 0;
	for (uint32_t e = 0; e < n; e++)
		sum += exp((double)logits[e] - (double)mx);
	/* Top k by insertion: a probability enters before the first smaller one, so equal ones keep
	 * the order of their ids. */
	uint32_t have = 0;
	for (uint32_t e = 0; e < n; e++) {
		float p = (float)(exp((double)logits[e] - (double)mx) / sum);
		uint32_t at = have;
		while (at > 0 && w[at - 1] < p)
			at--;
		if (at >= k)
			continue;
		uint32_t last = have < k ? have : k - 1;
		for (uint32_t i = last; i > at; i--) {
			w[i] = w[i - 1];
			ids[i] = ids[i - 1];
		}
		w[at] = p;
		ids[at] = e;
		if (have < k)
			have++;
	}
	if (!norm)
		return;
	float s = 0;
	for (uint32_t i = 0; i < k; i++)
		s += w[i];
	for (uint32_t i = 0; i < k; i++)
		w[i] /= s;
}

/* test_cpu_kernels.c - the kernels of the C reference backend (RMSNorm, RoPE table and
 * rotation, SiLU, dot product) against double-precision versions, and the CPU worker pool. */
#include "services/gpu-runner/cpu/kernels.h"
#include "services/gpu-runner/cpu/pool.h"
#include "services/gpu-runner/rope.h"
#include "tests/unit/common/test_helpers.h"

#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 42;

static double rng_uniform(void)
{
	uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	z ^= z >> 31;
	return ((double)(z >> 11) + 0.5) * 0x1.0p-53;
}

static double rng_normal(void)
{
	return sqrt(-2.0 * log(rng_uniform())) * cos(2.0 * M_PI * rng_uniform());
}

static double rel_diff(double got, double want)
{
	return fabs(got - want) / fabs(want);
}

static struct model_config llama31_cfg(void)
{
	/* Llama-3.1-8B: head_dim 128, theta 5e5, rope_scaling llama3 (8, 1, 4, 8192). */
	struct model_config c = {
		.n_layers = 1, .dim = 4096, .n_heads = 32, .n_kv_heads = 8, .head_dim = 128, .ffn_dim = 14336,
		.vocab_size = 128256, .rms_eps = 1e-5f, .rope_theta = 500000.0f, .rope_scaling = ROPE_SCALING_LLAMA3,
		.rope_factor = 8.0f, .rope_low_freq_factor = 1.0f, .rope_high_freq_factor = 4.0f,
		.rope_original_max_position = 8192,
	};
	return c;
}

START_TEST(test_rmsnorm)
{
	enum { DIM = 4096 };
	static float x[DIM], wf[DIM], out[DIM];
	static uint16_t wb[DIM];
	for (int i = 0; i < DIM; i++) {
		x[i] = (float)(3.0 * rng_normal());
		wf[i] = (float)(1.0 + 0.1 * rng_normal());
		wb[i] = f32_to_bf16(wf[i]);
	}
	double ss = 0;
	for (int i = 0; i < DIM; i++)
		ss += (double)x[i] * x[i];
	double r = 1.0 / sqrt(ss / DIM + 1e-5);
	for (int pass = 0; pass < 2; pass++) {
		if (pass == 0)
			cpu_rmsnorm(out, x, wf, DT_F32, DIM, 1e-5f);
		else
			cpu_rmsnorm(out, x, wb, DT_BF16, DIM, 1e-5f);
		for (int i = 0; i < DIM; i++) {
			double w = pass == 0 ? wf[i] : bf16_to_f32(wb[i]);
			double want = w * x[i] * r;
			/* Five float32 roundings at most: variance, +eps, sqrt, 1/, x*r, w*. */
			ck_assert_msg(fabs(out[i] - want) <= 4e-7 * fabs(want) + 1e-30, "element %d: %.9g vs %.9g", i,
				      (double)out[i], want);
		}
	}
}
END_TEST

START_TEST(test_silu)
{
	for (int i = -4000; i <= 4000; i++) {
		float g = (float)i / 100.0f;
		double want = (double)g / (1.0 + exp(-(double)g));
		float got = cpu_silu_mul(g, 1.0f);
		if (want == 0)
			ck_assert(got == 0);
		else
			ck_assert_msg(rel_diff(got, want) <= 0x1.0p-24, "silu(%g) = %.9g, want %.12g", (double)g,
				      (double)got, want);
		float u = (float)rng_normal();
		double want_mul = want * u;
		got = cpu_silu_mul(g, u);
		if (want_mul != 0)
			ck_assert_msg(rel_diff(got, want_mul) <= 0x1.0p-23, "silu(%g) * %g", (double)g, (double)u);
	}
}
END_TEST

START_TEST(test_dot)
{
	enum { N = 10007 };
	static float a[N], b[N];
	long double exact = 0, mag = 0;
	for (int i = 0; i < N; i++) {
		a[i] = (float)rng_normal();
		b[i] = (float)rng_normal();
		exact += (long double)a[i] * b[i];
		mag += fabsl((long double)a[i] * b[i]);
	}
	double got = cpu_dot_f32(a, b, N);
	ck_assert_msg(fabsl(got - exact) / mag < 1e-14, "dot error %.3Le", fabsl(got - exact) / mag);
	ck_assert(cpu_dot_f32(a, b, 0) == 0);
	ck_assert(cpu_dot_f32(a, b, 3) == (double)a[0] * b[0] + (double)a[1] * b[1] + (double)a[2] * b[2]);
}
END_TEST

START_TEST(test_rope_table_default)
{
	struct model_config c = llama31_cfg();
	c.rope_scaling = ROPE_SCALING_NONE;
	float inv[64];
	char err[128];
	ck_assert_int_eq(rope_inv_freq(&c, inv, err, sizeof(err)), 0);
	ck_assert(inv[0] == 1.0f);
	for (int i = 0; i < 64; i++) {
		double want = 1.0 / pow(500000.0, (double)(2 * i) / 128.0);
		/* powf and the reciprocal round twice: within 2 float ulps of the exact value. */
		ck_assert_msg(rel_diff(inv[i], want) <= 2 * 0x1.0p-24, "inv_freq[%d] = %.9g, want %.12g", i,
			      (double)inv[i], want);
	}
	c.rope_scaling = ROPE_SCALING_LINEAR;
	c.rope_factor = 4.0f;
	float lin[64];
	ck_assert_int_eq(rope_inv_freq(&c, lin, err, sizeof(err)), 0);
	for (int i = 0; i < 64; i++)
		ck_assert(lin[i] == inv[i] / 4.0f);
}
END_TEST

START_TEST(test_rope_table_llama3)
{
	struct model_config c = llama31_cfg();
	float inv[64];
	char err[128];
	ck_assert_int_eq(rope_inv_freq(&c, inv, err, sizeof(err)), 0);
	/* Values computed by hand (Python, double) from _compute_llama3_parameters. */
	static const struct {
		int i;
		double v;
	} pinned[] = {
		{0, 1.0},			  /* high frequency: kept */
		{10, 0.12868737343265052},	  /* kept */
		{28, 0.0032114459947525913},	  /* kept: wavelen 1956 < 2048 */
		{29, 0.002166570763503359},	  /* blended: wavelen 2402 */
		{30, 0.0013718935677611381},	  /* blended */
		{32, 0.0005248461609929547},	  /* blended: wavelen 4443 */
		{34, 0.00017850781276799638},	  /* blended: wavelen 6695 */
		{35, 9.556212353964683e-05},	  /* divided by 8: wavelen 8219 > 8192 */
		{40, 3.428102195952591e-05},	  /* divided */
		{63, 3.068925988914511e-07},	  /* divided */
	};
	for (size_t k = 0; k < sizeof(pinned) / sizeof(pinned[0]); k++)
		ck_assert_msg(rel_diff(inv[pinned[k].i], pinned[k].v) < 1e-6, "inv_freq[%d] = %.9g, want %.12g",
			      pinned[k].i, (double)inv[pinned[k].i], pinned[k].v);
	/* And every entry against the same formula in double. */
	for (int i = 0; i < 64; i++) {
		double f = 1.0 / pow(500000.0, i / 64.0), wl = 2 * M_PI / f, want;
		if (wl < 2048)
			want = f;
		else if (wl > 8192)
			want = f / 8;
		else {
			double s = (8192 / wl - 1) / 3;
			want = (1 - s) * f / 8 + s * f;
		}
		ck_assert_msg(rel_diff(inv[i], want) < 1e-6, "inv_freq[%d] = %.9g, want %.12g", i, (double)inv[i],
			      want);
	}
}
END_TEST

START_TEST(test_rope_table_rejects)
{
	struct model_config c = llama31_cfg();
	float inv[64];
	char err[160] = "";
	c.rope_high_freq_factor = 1.0f; /* high == low: the band would divide by zero */
	ck_assert_int_eq(rope_inv_freq(&c, inv, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "low_freq_factor < high_freq_factor"));
	c = llama31_cfg();
	c.rope_factor = 0;
	ck_assert_int_eq(rope_inv_freq(&c, inv, err, sizeof(err)), -EINVAL);
	c = llama31_cfg();
	c.rope_scaling = 9;
	ck_assert_int_eq(rope_inv_freq(&c, inv, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "unknown rope_scaling"));
	c = llama31_cfg();
	c.rope_theta = 0;
	ck_assert_int_eq(rope_inv_freq(&c, inv, err, sizeof(err)), -EINVAL);
}
END_TEST

START_TEST(test_rope_rotation)
{
	struct model_config c = llama31_cfg();
	c.rope_scaling = ROPE_SCALING_NONE;
	float inv[64], cs[64], sn[64], x[128], x0[128];
	char err[128];
	ck_assert_int_eq(rope_inv_freq(&c, inv, err, sizeof(err)), 0);
	for (int i = 0; i < 128; i++)
		x0[i] = (float)rng_normal();
	for (uint32_t pos = 0; pos < 64; pos += 7) {
		memcpy(x, x0, sizeof(x));
		cpu_rope_cos_sin(inv, 64, pos, cs, sn);
		cpu_rope_apply(x, cs, sn, 64);
		for (int i = 0; i < 64; i++) {
			double a = (double)pos * inv[i];
			double w1 = x0[i] * cos(a) - x0[i + 64] * sin(a), w2 = x0[i + 64] * cos(a) + x0[i] * sin(a);
			/* The backend rounds the angle to float32 (error up to |a| * 2^-24 rad), then
			 * cos, sin and the rotation round once each. */
			double tol = (fabs(a) * 0x1.0p-23 + 4e-7) * (fabs(x0[i]) + fabs(x0[i + 64]));
			ck_assert_msg(fabs(x[i] - w1) < tol && fabs(x[i + 64] - w2) < tol, "pos %u pair %d", pos, i);
		}
	}
	/* The angle is the float32 product pos * inv_freq, as transformers has it: at i = 0 the
	 * frequency is exactly 1, so the angle of position 100000 is exactly 100000. */
	cpu_rope_cos_sin(inv, 64, 100000, cs, sn);
	ck_assert(cs[0] == (float)cos(100000.0));
	ck_assert(sn[0] == (float)sin(100000.0));
	ck_assert(cs[5] == (float)cos((double)(100000.0f * inv[5])));
}
END_TEST

static uint32_t hits[1000], owner[1000];

static void count_items(const void *job, uint32_t tid, uint32_t begin, uint32_t end)
{
	for (uint32_t i = begin; i < end; i++) {
		hits[i]++;
		owner[i] = tid;
	}
}

START_TEST(test_pool_covers_every_item_once)
{
	struct cpu_pool *pool = NULL;
	char err[256] = "";
	ck_assert_int_eq(cpu_pool_create(3, &pool, err, sizeof(err)), 0);
	ck_assert_uint_eq(cpu_pool_threads(pool), 3);
	for (uint32_t total = 0; total <= 1000; total += 97) {
		memset(hits, 0, sizeof(hits));
		for (int rep = 0; rep < 3; rep++)
			cpu_pool_run(pool, count_items, NULL, total);
		for (uint32_t i = 0; i < total; i++) {
			ck_assert_uint_eq(hits[i], 3);
			uint32_t b, e;
			cpu_pool_range(total, 3, owner[i], &b, &e);
			ck_assert(i >= b && i < e);
		}
	}
	cpu_pool_destroy(&pool);
	ck_assert_ptr_null(pool);
	cpu_pool_destroy(&pool); /* safe twice */
	ck_assert_int_eq(cpu_pool_create(CPU_POOL_MAX_THREADS + 1, &pool, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_null(pool);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("cpu_kernels");
	TCase *tc = tcase_create("kernels");
	tcase_add_test(tc, test_rmsnorm);
	tcase_add_test(tc, test_silu);
	tcase_add_test(tc, test_dot);
	suite_add_tcase(s, tc);
	tc = tcase_create("rope");
	tcase_add_test(tc, test_rope_table_default);
	tcase_add_test(tc, test_rope_table_llama3);
	tcase_add_test(tc, test_rope_table_rejects);
	tcase_add_test(tc, test_rope_rotation);
	suite_add_tcase(s, tc);
	tc = tcase_create("pool");
	tcase_add_test(tc, test_pool_covers_every_item_once);
	suite_add_tcase(s, tc);

	return th_run(s);
}

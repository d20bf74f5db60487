/* test_cpu_matvec.c - the CPU products (cpu-compute/cpu_compute.h) of every weight format on odd
 * shapes (rows not a multiple of four, one to a few blocks, row and column offsets, rows padded
 * and at odd addresses), on the AVX-512 path where this CPU has it and on the plain path always:
 * - tight: against sum W[r][c] x'[c] in double, W from common/quant.c's dequantizers and x' the
 *   prepared x (bf16-rounded or int8 codes times d): |y - ref| <= 1e-5 sum |W x'|;
 * - loose: against the float32 x, the error the preparation adds: none for F32/F16, 2^-8 per
 *   value for bf16 rounding, half a step d/2 = amax/254 per value for the int8 groups;
 * - a row's result does not depend on the rows computed with it (how threads split them);
 * - SwiGLU is cpu_silu_mul of the two products, bit for bit;
 * - bad arguments are refused with a message. PIPELINE_TEST_VERBOSE=1 prints the errors seen. */
#include "common/quant.h"
#include "services/gpu-runner/cpu-compute/cpu_compute.h"
#include "services/gpu-runner/cpu/kernels.h"
#include "tests/unit/common/test_helpers.h"
#include "tests/unit/gpu-runner/runner_test_util.h"
#include "tests/unit/gpu-runner/test_mat.h"

#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* n values of x, groups of 32 of very different sizes (the int8 scales vary), one group of zeros. */
static float *make_x(uint32_t n)
{
	float *x = malloc((size_t)n * sizeof(float));
	ck_assert_ptr_nonnull(x);
	for (uint32_t i = 0; i < n; i++)
		x[i] = (float)(rng_normal() * pow(10.0, (double)((i / 32) % 5) - 2.0));
	if (n >= 96)
		memset(x + 64, 0, 32 * sizeof(float));
	return x;
}

/* Worst errors seen, as a fraction of sum |W x'|, per format and check (PIPELINE_TEST_VERBOSE). */
struct errs {
	double tight, loose, loose_bound;
};

/* One product over rows [r0, r1) and columns [c0, c1) of m on the path in use, checked. */
static void check_product(const struct mat *m, uint32_t r0, uint32_t r1, uint32_t c0, uint32_t c1, struct errs *e)
{
	const uint32_t n = c1 - c0, rows = r1 - r0;
	float *x = make_x(n);
	char err[256];
	struct cpu_vec *v;
	ck_assert_int_eq(cpu_vec_create(0, &v, err, sizeof(err)), 0);
	ck_assert_msg(cpu_vec_prepare(v, m->t, x, n, err, sizeof(err)) == 0, "%s", err);
	float *y = malloc((rows + 1) * sizeof(float));
	ck_assert_ptr_nonnull(y);
	y[rows] = 12345.0f;
	int rc = cpu_matvec(v, m->w, m->t, m->row_bytes, r0, r1, c0, c1, y, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s rows [%u, %u) cols [%u, %u): %s", dtype_name(m->t), r0, r1, c0, c1, err);
	ck_assert_float_eq(y[rows], 12345.0f); /* nothing written past the rows */
	for (uint32_t r = r0; r < r1; r++) {
		const float *wr = m->deq + (size_t)r * m->cols + c0;
		double ref = 0, mag = 0, ref_x = 0, qerr = 0;
		for (uint32_t c = 0; c < n; c++) {
			const double xp = cpu_vec_value(v, c);
			ref += wr[c] * xp;
			mag += fabs(wr[c] * xp);
			ref_x += (double)wr[c] * x[c];
			if (m->t == DT_BF16) {
				qerr += fabs((double)wr[c] * x[c]) * 0x1p-8;
			} else if (!dtype_is_element(m->t)) {
				double amax = 0;
				for (uint32_t i = c / 32 * 32; i < c / 32 * 32 + 32; i++)
					amax = fmax(amax, fabs((double)x[i]));
				qerr += fabs((double)wr[c]) * amax / 254.0 * (1 + 1e-6);
			}
		}
		const double got = y[r - r0], tight = 1e-5 * mag + 1e-30;
		TH_CHECK(fabs(got - ref) <= tight,
			 "%s (%s) row %u of [%u, %u), cols [%u, %u): %.9g vs %.9g (sum |wx| %.3g)", dtype_name(m->t),
			 cpu_compute_path(m->t), r, r0, r1, c0, c1, got, ref, mag);
		TH_CHECK(fabs(got - ref_x) <= qerr + tight, "%s (%s) row %u vs float x: %.9g vs %.9g, bound %.3g",
			 dtype_name(m->t), cpu_compute_path(m->t), r, got, ref_x, qerr + tight);
		if (mag > 0) {
			e->tight = fmax(e->tight, fabs(got - ref) / mag);
			e->loose = fmax(e->loose, fabs(got - ref_x) / mag);
			e->loose_bound = fmax(e->loose_bound, qerr / mag);
		}
	}
	/* each row alone gives the same bits as with its neighbours */
	for (uint32_t r = r0; r < r1; r++) {
		float one;
		ck_assert_int_eq(cpu_matvec(v, m->w, m->t, m->row_bytes, r, r + 1, c0, c1, &one, err, sizeof(err)), 0);
		TH_CHECK(memcmp(&one, &y[r - r0], 4) == 0, "%s row %u alone: %.9g, with others %.9g", dtype_name(m->t),
			 r, (double)one, (double)y[r - r0]);
	}
	free(y);
	free(x);
	cpu_vec_destroy(&v);
}

/* Every shape of one format on the path in use. */
static void check_format(enum dtype t, struct errs *e)
{
	const uint32_t blk = dtype_block_elems(t);
	const uint32_t elem_cols[] = {1, 5, 16, 33, 97, 300};
	const uint32_t block_counts[] = {1, 2, 3, 5, 9};
	const uint32_t ncols = dtype_is_element(t) ? 6 : 5;
	const uint32_t row_ranges[][2] = {{0, 11}, {2, 9}, {3, 4}, {5, 5}};
	for (uint32_t i = 0; i < ncols; i++) {
		const uint32_t cols = dtype_is_element(t) ? elem_cols[i] : block_counts[i] * blk;
		struct mat m = make_mat(t, 11, cols, (i & 1) ? 6 : 0, (i & 2) ? 3 : 0);
		uint32_t col_ranges[3][2] = {{0, cols}}, nranges = 1;
		if (dtype_is_element(t) && cols > 6) {
			col_ranges[nranges][0] = 3;
			col_ranges[nranges++][1] = cols - 2;
		}
		if (!dtype_is_element(t) && cols >= 2 * blk) {
			col_ranges[nranges][0] = blk;
			col_ranges[nranges++][1] = cols;
		}
		if (!dtype_is_element(t) && cols >= 3 * blk) {
			col_ranges[nranges][0] = blk;
			col_ranges[nranges++][1] = cols - blk;
		}
		for (uint32_t cr = 0; cr < nranges; cr++)
			for (uint32_t rr = 0; rr < 4; rr++)
				check_product(&m, row_ranges[rr][0], row_ranges[rr][1], col_ranges[cr][0],
					      col_ranges[cr][1], e);
		free_mat(&m);
	}
	/* long rows: many steps of every loop */
	struct mat m = make_mat(t, 9, 4096, 0, 1);
	check_product(&m, 0, 9, 0, 4096, e);
	check_product(&m, 1, 8, dtype_is_element(t) ? 17 : blk, 4096 - blk, e);
	free_mat(&m);
}

/* Both paths: the SIMD one where the CPU has it (otherwise a note), the plain one always. */
START_TEST(test_format)
{
	const enum dtype t = (enum dtype)_i;
	rng_state = 1000 + (uint64_t)_i;
	struct errs simd = {0}, plain = {0};
	cpu_compute_force_isa(CPU_ISA_ALL);
	const int have_simd = strcmp(cpu_compute_path(t), "scalar") != 0;
	if (have_simd)
		check_format(t, &simd);
	else
		printf("%s: this CPU has no SIMD path for it; the plain path only\n", dtype_name(t));
	ck_assert_uint_eq(cpu_compute_force_isa(CPU_ISA_SCALAR), CPU_ISA_SCALAR);
	ck_assert_str_eq(cpu_compute_path(t), "scalar");
	check_format(t, &plain);
	if (test_verbose()) {
		if (have_simd)
			printf("%-5s simd:  vs x' %.2e, vs float x %.2e (bound %.2e) of sum |W x'|\n", dtype_name(t),
			       simd.tight, simd.loose, simd.loose_bound);
		printf("%-5s plain: vs x' %.2e, vs float x %.2e (bound %.2e) of sum |W x'|\n", dtype_name(t),
		       plain.tight, plain.loose, plain.loose_bound);
	}
}
END_TEST

/* SwiGLU is cpu_silu_mul of the two products, on both paths, over more rows than one pass. */
START_TEST(test_swiglu)
{
	const enum dtype t = (enum dtype)_i;
	rng_state = 2000 + (uint64_t)_i;
	const uint32_t cols = dtype_is_element(t) ? 200 : 2 * dtype_block_elems(t), r0 = 5, r1 = 147;
	struct mat g = make_mat(t, 150, cols, 2, 1), u = make_mat(t, 150, cols, 2, 1);
	float *x = make_x(cols);
	static float h[150], yg[150], yu[150];
	char err[256];
	struct cpu_vec *v;
	ck_assert_int_eq(cpu_vec_create(cols, &v, err, sizeof(err)), 0);
	ck_assert_int_eq(cpu_vec_prepare(v, t, x, cols, err, sizeof(err)), 0);
	for (int pass = 0; pass < 2; pass++) {
		cpu_compute_force_isa(pass ? CPU_ISA_SCALAR : CPU_ISA_ALL);
		int rc = cpu_swiglu(v, g.w, u.w, t, g.row_bytes, r0, r1, 0, cols, h, err, sizeof(err));
		ck_assert_msg(rc == 0, "%s", err);
		ck_assert_int_eq(cpu_matvec(v, g.w, t, g.row_bytes, r0, r1, 0, cols, yg, err, sizeof(err)), 0);
		ck_assert_int_eq(cpu_matvec(v, u.w, t, u.row_bytes, r0, r1, 0, cols, yu, err, sizeof(err)), 0);
		for (uint32_t i = 0; i < r1 - r0; i++) {
			const float want = cpu_silu_mul(yg[i], yu[i]);
			TH_CHECK(memcmp(&h[i], &want, 4) == 0, "%s (%s) row %u: %.9g vs %.9g", dtype_name(t),
				 cpu_compute_path(t), r0 + i, (double)h[i], (double)want);
		}
	}
	ck_assert_int_eq(cpu_swiglu(v, g.w, u.w, t, g.row_bytes, 3, 2, 0, cols, h, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "backwards"), "%s", err);
	cpu_vec_destroy(&v);
	free(x);
	free_mat(&g);
	free_mat(&u);
}
END_TEST

#define REFUSED(call, text)                                                                                            \
	do {                                                                                                           \
		err[0] = 0;                                                                                            \
		ck_assert_int_eq((call), -EINVAL);                                                                     \
		ck_assert_msg(strstr(err, (text)) != NULL, "'%s' lacks '%s'", err, (text));                            \
		ck_assert_float_eq(y[0], -1.0f);                                                                       \
	} while (0)

START_TEST(test_refuses)
{
	static uint8_t w[4096];
	float x[512] = {0}, y[4] = {-1, -1, -1, -1};
	char err[256];
	struct cpu_vec *v;
	ck_assert_int_eq(cpu_vec_create(0, &v, err, sizeof(err)), 0);
	REFUSED(cpu_matvec(v, w, DT_F32, 64, 0, 1, 0, 16, y, err, sizeof(err)), "not prepared");
	ck_assert_int_eq(cpu_vec_prepare(v, DT_Q4_K, x, 256, err, sizeof(err)), 0);
	REFUSED(cpu_matvec(v, w, DT_Q5_K, 176, 0, 1, 0, 256, y, err, sizeof(err)),
		"prepared for Q4_K weights, not Q5_K");
	REFUSED(cpu_matvec(v, w, DT_COUNT, 176, 0, 1, 0, 256, y, err, sizeof(err)), "unknown weight format");
	REFUSED(cpu_matvec(v, w, DT_Q4_K, 144, 2, 1, 0, 256, y, err, sizeof(err)), "rows [2, 1) run backwards");
	REFUSED(cpu_matvec(v, w, DT_Q4_K, 288, 0, 1, 0, 512, y, err, sizeof(err)), "for x of 256 values");
	REFUSED(cpu_matvec(v, w, DT_Q4_K, 288, 0, 1, 128, 384, y, err, sizeof(err)), "block of 256");
	REFUSED(cpu_matvec(v, w, DT_Q4_K, 143, 0, 1, 0, 256, y, err, sizeof(err)),
		"take 144 bytes, rows are 143 apart");
	REFUSED(cpu_matvec(v, w, DT_Q4_K, 287, 0, 1, 256, 512, y, err, sizeof(err)), "take 288 bytes");
	REFUSED(cpu_matvec(v, w, DT_Q4_K, UINT64_MAX / 2, 0, 3, 0, 256, y, err, sizeof(err)), "overflow");
	REFUSED(cpu_swiglu(v, w, w, DT_Q6_K, 210, 0, 1, 0, 256, y, err, sizeof(err)), "not Q6_K");
	ck_assert_int_eq(cpu_vec_prepare(v, DT_Q8_0, x, 32, err, sizeof(err)), 0);
	REFUSED(cpu_matvec(v, w, DT_Q8_0, 340, 0, 1, 16, 48, y, err, sizeof(err)), "block of 32");
	ck_assert_int_eq(cpu_vec_prepare(v, DT_BF16, x, 7, err, sizeof(err)), 0);
	REFUSED(cpu_matvec(v, w, DT_BF16, 16, 0, 1, 3, 10, y, err, sizeof(err)), "take 20 bytes, rows are 16 apart");
	/* element formats take any column offset; no rows is no work */
	ck_assert_int_eq(cpu_matvec(v, w, DT_BF16, 20, 0, 1, 3, 10, y, err, sizeof(err)), 0);
	ck_assert_float_eq(y[0], 0.0f);
	y[0] = -1.0f;
	ck_assert_int_eq(cpu_matvec(v, w, DT_BF16, 20, 4, 4, 3, 10, y, err, sizeof(err)), 0);
	ck_assert_float_eq(y[0], -1.0f);
	cpu_vec_destroy(&v);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("cpu_matvec");
	TCase *tc = tcase_create("products");
	tcase_set_timeout(tc, 60);
	tcase_add_loop_test(tc, test_format, 0, DT_COUNT);
	suite_add_tcase(s, tc);
	tc = tcase_create("swiglu");
	tcase_add_loop_test(tc, test_swiglu, 0, DT_COUNT);
	suite_add_tcase(s, tc);
	tc = tcase_create("refuses");
	tcase_add_test(tc, test_refuses);
	suite_add_tcase(s, tc);
	return th_run(s);
}

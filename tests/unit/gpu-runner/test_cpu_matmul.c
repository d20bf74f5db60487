/* test_cpu_matmul.c - several tokens' products at once (cpu-compute/cpu_compute.h: cpu_xtiles,
 * cpu_matmul), on odd shapes (rows not a multiple of 16, column offsets, padded rows at odd
 * addresses, 1 to 16 tokens), against each token's cpu_matvec:
 * - where the path is "amx-bf16" (BF16 with AMX in use: cpu_compute_force_isa(CPU_ISA_ALL) asks
 *   for it, as PIPELINE_CPU_ISA=amx does), rows in tiles of 16 within
 *   1e-5 sum |W x'| of it (the tile unit sums in its own order), and every row within that of the
 *   double-precision sum; the rows past the last tile, and every other case, bit for bit;
 * - a token's results the same bits whatever the other tokens of the call (alone, or among 16);
 * - the tiles counted (cpu_matmul_tile_rows) exactly where they should have run;
 * - the same with AMX taken away (cpu_compute_force_isa), bit for bit: the token-by-token path;
 * - nothing written between one token's rows and the next's (y_ld past the rows);
 * - bad arguments refused with a message.
 * On a CPU without AMX only the token-by-token path runs here; the test says so. */
#include "common/quant.h"
#include "services/gpu-runner/cpu-compute/cpu_compute.h"
#include "tests/unit/common/test_helpers.h"
#include "tests/unit/gpu-runner/runner_test_util.h"
#include "tests/unit/gpu-runner/test_mat.h"

#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SENTINEL -12345.0f

/* n tokens' products of rows [r0, r1), columns [c0, c0 + len) of m (cols columns a row) through
 * cpu_matmul, checked against cpu_matvec and the double sum. Returns whether the tiles ran. */
static bool check_case(enum dtype t, const struct mat *m, uint32_t cols, uint32_t n, uint32_t r0, uint32_t r1,
		       uint32_t c0, uint32_t len)
{
	char err[256];
	struct cpu_vec *xs[CPU_MATMUL_MAX_TOKENS];
	struct cpu_xtiles *xt;
	float *x = malloc(len * sizeof(float));
	ck_assert_ptr_nonnull(x);
	for (uint32_t k = 0; k < n; k++) {
		for (uint32_t i = 0; i < len; i++)
			x[i] = (float)(rng_normal() * (1 + k % 4));
		ck_assert_int_eq(cpu_vec_create(0, &xs[k], err, sizeof(err)), 0);
		ck_assert_msg(cpu_vec_prepare(xs[k], t, x, len, err, sizeof(err)) == 0, "%s", err);
	}
	ck_assert_int_eq(cpu_xtiles_create(&xt, err, sizeof(err)), 0);
	ck_assert_msg(cpu_xtiles_prepare(xt, xs, n, err, sizeof(err)) == 0, "%s", err);
	const uint32_t rows = r1 - r0, ld = rows + 5;
	float *y = malloc((size_t)n * ld * sizeof(float)), *one = malloc(rows * sizeof(float));
	ck_assert(y && one);
	for (size_t i = 0; i < (size_t)n * ld; i++)
		y[i] = SENTINEL;
	const uint64_t counted = cpu_matmul_tile_rows();
	ck_assert_msg(cpu_matmul(xt, m->w, t, m->row_bytes, r0, r1, c0, c0 + len, y, ld, err, sizeof(err)) == 0, "%s",
		      err);
	const bool tiled = !strcmp(cpu_matmul_path(t), "amx-bf16") && len % 32 == 0 && rows >= 16;
	const uint32_t tile_rows = tiled ? rows & ~15u : 0;
	ck_assert_uint_eq(cpu_matmul_tile_rows() - counted, tile_rows);
	/* The last token alone: the same bits as among the others. */
	struct cpu_xtiles *one_xt;
	float *alone = malloc(rows * sizeof(float));
	ck_assert_ptr_nonnull(alone);
	ck_assert_int_eq(cpu_xtiles_create(&one_xt, err, sizeof(err)), 0);
	ck_assert_int_eq(cpu_xtiles_prepare(one_xt, xs + n - 1, 1, err, sizeof(err)), 0);
	ck_assert_int_eq(cpu_matmul(one_xt, m->w, t, m->row_bytes, r0, r1, c0, c0 + len, alone, rows, err, sizeof(err)),
			 0);
	ck_assert_msg(memcmp(alone, y + (size_t)(n - 1) * ld, rows * sizeof(float)) == 0,
		      "%s: token %u's results alone differ from among %u tokens", dtype_name(t), n - 1, n);
	cpu_xtiles_destroy(&one_xt);
	free(alone);
	for (uint32_t k = 0; k < n; k++) {
		ck_assert_int_eq(cpu_matvec(xs[k], m->w, t, m->row_bytes, r0, r1, c0, c0 + len, one, err, sizeof(err)), 0);
		for (uint32_t i = 0; i < rows; i++) {
			const float got = y[(size_t)k * ld + i];
			double ref = 0, mag = 0;
			for (uint32_t c = 0; c < len; c++) {
				const double p = (double)m->deq[(size_t)(r0 + i) * cols + c0 + c] * cpu_vec_value(xs[k], c);
				ref += p;
				mag += fabs(p);
			}
			if (i < tile_rows) {
				ck_assert_msg(fabs(got - one[i]) <= 1e-5 * mag + 1e-30,
					      "%s, %u tokens, token %u row %u: tiles %.9g, vector path %.9g", dtype_name(t), n, k,
					      r0 + i, got, one[i]);
			} else {
				ck_assert_msg(got == one[i], "%s, %u tokens, token %u row %u: %.9g, vector path %.9g",
					      dtype_name(t), n, k, r0 + i, got, one[i]);
			}
			ck_assert_msg(fabs(got - ref) <= 1e-5 * mag + 1e-30, "%s token %u row %u: %.9g, double %.9g",
				      dtype_name(t), k, r0 + i, got, ref);
		}
		for (uint32_t i = rows; i < ld; i++)
			ck_assert_msg(y[(size_t)k * ld + i] == SENTINEL, "token %u: written past its rows at %u", k, i);
	}
	free(y);
	free(one);
	free(x);
	cpu_xtiles_destroy(&xt);
	cpu_xtiles_destroy(&xt);
	for (uint32_t k = 0; k < n; k++)
		cpu_vec_destroy(&xs[k]);
	return tiled;
}

/* Every shape and token count of one format, on the paths this CPU has. */
static bool check_format(enum dtype t)
{
	static const uint32_t tokens[] = {1, 2, 3, 7, 16};
	const uint32_t blk = dtype_block_elems(t), cols = blk >= 256 ? 512 : 160;
	struct mat m = make_mat(t, 100, cols, 6, 3);
	bool tiled = false;
	if (t == DT_BF16) { /* a row of 4096 columns: the tiles' steps of four blocks many times over */
		struct mat big = make_mat(t, 48, 4096, 0, 3);
		tiled |= check_case(t, &big, 4096, 16, 0, 48, 0, 4096);
		tiled |= check_case(t, &big, 4096, 5, 8, 40, 1024, 2048);
		free_mat(&big);
	}
	for (size_t i = 0; i < sizeof(tokens) / sizeof(tokens[0]); i++) {
		tiled |= check_case(t, &m, cols, tokens[i], 0, 100, 0, cols);		 /* 6 tiles and 4 rows */
		tiled |= check_case(t, &m, cols, tokens[i], 3, 35, 0, cols);		 /* 2 tiles from an odd row */
		tiled |= check_case(t, &m, cols, tokens[i], 50, 61, 0, cols);		 /* no tile: 11 rows */
		if (blk == 1) {
			tiled |= check_case(t, &m, cols, tokens[i], 16, 80, 32, 96);	 /* a column slice, 3 blocks */
			tiled |= check_case(t, &m, cols, tokens[i], 16, 80, 2, 48);	 /* not a multiple of 32 */
		} else if (blk == 32) {
			tiled |= check_case(t, &m, cols, tokens[i], 16, 80, 32, 96);
		}
	}
	free_mat(&m);
	return tiled;
}

START_TEST(test_formats)
{
	static const enum dtype formats[] = {DT_BF16, DT_F32, DT_F16, DT_Q8_0, DT_Q4_K};
	for (size_t f = 0; f < sizeof(formats) / sizeof(formats[0]); f++) {
		const enum dtype t = formats[f];
		cpu_compute_force_isa(CPU_ISA_ALL);
		const bool tiled = check_format(t);
		ck_assert_msg(tiled == (t == DT_BF16 && !strcmp(cpu_matmul_path(DT_BF16), "amx-bf16")),
			      "%s: the tiles %s", dtype_name(t), tiled ? "ran" : "did not run");
		/* The same without AMX: token by token, bit for bit. */
		cpu_compute_force_isa(CPU_ISA_ALL & ~(unsigned)CPU_ISA_AMX_BF16);
		ck_assert_str_ne(cpu_matmul_path(t), "amx-bf16");
		ck_assert(!check_format(t));
	}
	cpu_compute_force_isa(CPU_ISA_ALL);
	printf("test_cpu_matmul: cpu_matmul's BF16 path on this CPU: %s%s\n", cpu_matmul_path(DT_BF16),
	       strcmp(cpu_matmul_path(DT_BF16), "amx-bf16") ? " (no AMX here: only the token-by-token path ran)" : "");
}
END_TEST

#define REFUSED(call, text)                                                                                    \
	do {                                                                                                   \
		err[0] = 0;                                                                                    \
		ck_assert_int_eq((call), -EINVAL);                                                             \
		ck_assert_msg(strstr(err, (text)) != NULL, "message '%s' lacks '%s'", err, (text));              \
	} while (0)

START_TEST(test_refuses)
{
	static uint8_t w[4096];
	float x[64] = {0}, y[64];
	char err[256];
	struct cpu_vec *a, *b, *none, *xs[CPU_MATMUL_MAX_TOKENS + 1];
	struct cpu_xtiles *xt;
	ck_assert_int_eq(cpu_vec_create(0, &a, err, sizeof(err)), 0);
	ck_assert_int_eq(cpu_vec_create(0, &b, err, sizeof(err)), 0);
	ck_assert_int_eq(cpu_vec_create(0, &none, err, sizeof(err)), 0);
	ck_assert_int_eq(cpu_xtiles_create(&xt, err, sizeof(err)), 0);
	REFUSED(cpu_matmul(xt, w, DT_BF16, 128, 0, 1, 0, 64, y, 1, err, sizeof(err)), "no tokens prepared");
	ck_assert_int_eq(cpu_vec_prepare(a, DT_BF16, x, 64, err, sizeof(err)), 0);
	ck_assert_int_eq(cpu_vec_prepare(b, DT_BF16, x, 32, err, sizeof(err)), 0);
	for (int i = 0; i <= CPU_MATMUL_MAX_TOKENS; i++)
		xs[i] = a;
	REFUSED(cpu_xtiles_prepare(xt, xs, 0, err, sizeof(err)), "0 tokens at once");
	REFUSED(cpu_xtiles_prepare(xt, xs, CPU_MATMUL_MAX_TOKENS + 1, err, sizeof(err)), "17 tokens at once");
	xs[1] = none;
	REFUSED(cpu_xtiles_prepare(xt, xs, 2, err, sizeof(err)), "token 1's x is not prepared");
	xs[1] = b;
	REFUSED(cpu_xtiles_prepare(xt, xs, 2, err, sizeof(err)), "is not like token 0's");
	ck_assert_int_eq(cpu_vec_prepare(b, DT_F32, x, 64, err, sizeof(err)), 0);
	REFUSED(cpu_xtiles_prepare(xt, xs, 2, err, sizeof(err)), "(64 values for F32) is not like token 0's");
	/* a refused prepare leaves no tokens */
	REFUSED(cpu_matmul(xt, w, DT_BF16, 128, 0, 1, 0, 64, y, 1, err, sizeof(err)), "no tokens prepared");
	xs[1] = a;
	ck_assert_int_eq(cpu_xtiles_prepare(xt, xs, 2, err, sizeof(err)), 0);
	REFUSED(cpu_matmul(xt, w, DT_BF16, 128, 0, 20, 0, 64, y, 19, err, sizeof(err)), "20 rows a token, 19 floats");
	REFUSED(cpu_matmul(xt, w, DT_Q8_0, 128, 0, 1, 0, 64, y, 1, err, sizeof(err)), "prepared for BF16 weights");
	REFUSED(cpu_matmul(xt, w, DT_BF16, 100, 0, 20, 0, 64, y, 20, err, sizeof(err)), "rows are 100 apart");
	REFUSED(cpu_matmul(xt, w, DT_BF16, 128, 0, 20, 0, 32, y, 20, err, sizeof(err)), "for x of 64 values");
	REFUSED(cpu_matmul(xt, w, DT_BF16, 128, 20, 4, 0, 64, y, 20, err, sizeof(err)), "rows [20, 4) run backwards");
	/* no rows: nothing computed, nothing written */
	y[0] = -1.0f;
	ck_assert_int_eq(cpu_matmul(xt, w, DT_BF16, 128, 4, 4, 0, 64, y, 0, err, sizeof(err)), 0);
	ck_assert_float_eq(y[0], -1.0f);
	cpu_xtiles_destroy(&xt);
	cpu_vec_destroy(&a);
	cpu_vec_destroy(&b);
	cpu_vec_destroy(&none);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("cpu_matmul");
	TCase *tc = tcase_create("products");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_formats);
	suite_add_tcase(s, tc);
	tc = tcase_create("refuses");
	tcase_add_test(tc, test_refuses);
	suite_add_tcase(s, tc);
	return th_run(s);
}

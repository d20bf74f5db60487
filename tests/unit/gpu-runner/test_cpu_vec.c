/* test_cpu_vec.c - x as the CPU products take it (cpu-compute/cpu_compute.h): cpu_vec_prepare's
 * float32, bf16 and int8 forms against a quantizer written here from the GPU's rule (gemv_dp4a.cuh,
 * dq_stage), ties and edge values, the refusals; and the choice of path (CPU features, the
 * environment, cpu_compute_force_isa). */
#include "services/gpu-runner/cpu-compute/cpu_compute.h"
#include "tests/unit/common/test_helpers.h"
#include "tests/unit/gpu-runner/runner_test_util.h"

#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The GPU's rule for one group of 32, written out on its own: d = amax / 127, q = rint(x / d)
 * through the float32 reciprocal, clamped to +-127. */
static void quantize_ref(const float *x, float *out)
{
	float amax = 0.0f;
	for (int i = 0; i < 32; i++)
		if (fabsf(x[i]) > amax)
			amax = fabsf(x[i]);
	volatile float d = amax / 127.0f; /* volatile: each step rounds to float32 */
	volatile float id = d > 0.0f ? 1.0f / d : 0.0f;
	for (int i = 0; i < 32; i++) {
		volatile float t = x[i] * id;
		double q = nearbyint((double)t);
		if (q > 127)
			q = 127;
		if (q < -127)
			q = -127;
		out[i] = (float)q * d;
	}
}

static void check_vec(const struct cpu_vec *v, enum dtype t, const float *x, uint32_t n)
{
	ck_assert_uint_eq(cpu_vec_len(v), n);
	if (t == DT_F32 || t == DT_F16) {
		for (uint32_t i = 0; i < n; i++)
			TH_CHECK(cpu_vec_value(v, i) == x[i], "%s value %u: %g vs %g", dtype_name(t), i,
				 (double)cpu_vec_value(v, i), (double)x[i]);
	} else if (t == DT_BF16) {
		for (uint32_t i = 0; i < n; i++)
			TH_CHECK(cpu_vec_value(v, i) == bf16_to_f32(f32_to_bf16(x[i])), "BF16 value %u: %g", i,
				 (double)cpu_vec_value(v, i));
	} else {
		float want[32];
		for (uint32_t g = 0; g < n / 32; g++) {
			quantize_ref(x + 32 * g, want);
			for (uint32_t i = 0; i < 32; i++) {
				const float got = cpu_vec_value(v, 32 * g + i);
				TH_CHECK(got == want[i], "%s value %u: %.9g vs %.9g (x %.9g)", dtype_name(t),
					 32 * g + i, (double)got, (double)want[i], (double)x[32 * g + i]);
			}
		}
	}
	ck_assert_float_eq(cpu_vec_value(v, n), 0.0f); /* past the end: 0 */
}

START_TEST(test_prepare_forms)
{
	enum { N = 1024 };
	static float x[N];
	rng_state = 7;
	for (int i = 0; i < N; i++) /* groups of very different sizes */
		x[i] = (float)(rng_normal() * pow(10.0, (i / 32) % 7 - 3));
	for (int i = 64; i < 96; i++) /* a group of zeros: d = 0, q = 0 */
		x[i] = 0.0f;
	char err[256];
	struct cpu_vec *v = NULL;
	ck_assert_int_eq(cpu_vec_create(0, &v, err, sizeof(err)), 0);
	ck_assert_uint_eq(cpu_vec_len(v), 0);
	for (int path = 0; path < 2; path++) {
		cpu_compute_force_isa(path ? CPU_ISA_SCALAR : CPU_ISA_ALL);
		for (int t = 0; t < DT_COUNT; t++) {
			for (uint32_t n = dtype_block_elems(t); n <= N; n *= 2) {
				ck_assert_msg(cpu_vec_prepare(v, (enum dtype)t, x, n, err, sizeof(err)) == 0,
					      "%s n=%u: %s", dtype_name(t), n, err);
				check_vec(v, (enum dtype)t, x, n);
			}
		}
	}
	cpu_vec_destroy(&v);
	ck_assert_ptr_null(v);
	cpu_vec_destroy(&v);
}
END_TEST

/* Ties round to even, the clamp holds at +-127, NaN becomes 0, and a bf16-valued x gives the same
 * codes whatever its float32 spelling. */
START_TEST(test_prepare_edges)
{
	float x[32] = {0};
	x[0] = 127.0f; /* amax 127: d = 1, id = 1 */
	x[1] = 2.5f;
	x[2] = 3.5f;
	x[3] = -2.5f;
	x[4] = -0.5f;
	x[5] = 0.5f;
	x[6] = -127.0f;
	x[7] = 126.5f;
	x[8] = NAN;
	const float want[9] = {127, 2, 4, -2, -0.0f, 0, -127, 126, 0};
	char err[256];
	struct cpu_vec *v;
	ck_assert_int_eq(cpu_vec_create(32, &v, err, sizeof(err)), 0);
	for (int path = 0; path < 2; path++) {
		cpu_compute_force_isa(path ? CPU_ISA_SCALAR : CPU_ISA_ALL);
		x[8] = NAN;
		ck_assert_int_eq(cpu_vec_prepare(v, DT_Q8_0, x, 32, err, sizeof(err)), 0);
		for (int i = 0; i < 9; i++)
			ck_assert_msg(cpu_vec_value(v, (uint32_t)i) == want[i], "path %d value %d: %g, want %g", path,
				      i, (double)cpu_vec_value(v, (uint32_t)i), (double)want[i]);
		/* bf16: ties to even, NaN stays NaN */
		const float b[3] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, NAN};
		float xb[16] = {b[0], b[1], b[2]};
		ck_assert_int_eq(cpu_vec_prepare(v, DT_BF16, xb, 16, err, sizeof(err)), 0);
		ck_assert_float_eq(cpu_vec_value(v, 0), 1.0f);
		ck_assert_float_eq(cpu_vec_value(v, 1), 1.0f + 4 * 0x1p-8f);
		ck_assert(isnan(cpu_vec_value(v, 2)));
		/* infinity: d = inf, 1 / d = 0: every code 0 (x' is 0 * inf) */
		x[8] = INFINITY;
		ck_assert_int_eq(cpu_vec_prepare(v, DT_Q4_K, x, 32, err, sizeof(err)), -EINVAL); /* 32 < a K block */
		ck_assert_int_eq(cpu_vec_prepare(v, DT_Q4_0, x, 32, err, sizeof(err)), 0);
		for (int i = 0; i < 32; i++)
			ck_assert(isnan(cpu_vec_value(v, (uint32_t)i)));
		/* subnormal amax: 1 / d overflows to infinity, nonzero values clamp to +-127, zeros stay 0 */
		float xs[32] = {1e-40f, -1e-40f, 5e-41f, 0.0f, -1e-45f};
		ck_assert_int_eq(cpu_vec_prepare(v, DT_Q8_0, xs, 32, err, sizeof(err)), 0);
		const float dsub = 1e-40f / 127.0f;
		ck_assert_float_eq(cpu_vec_value(v, 0), 127 * dsub);
		ck_assert_float_eq(cpu_vec_value(v, 1), -127 * dsub);
		ck_assert_float_eq(cpu_vec_value(v, 2), 127 * dsub);
		ck_assert_float_eq(cpu_vec_value(v, 3), 0.0f);
		ck_assert_float_eq(cpu_vec_value(v, 4), -127 * dsub);
	}
	cpu_vec_destroy(&v);
}
END_TEST

START_TEST(test_prepare_refuses)
{
	float x[256] = {0};
	char err[256];
	struct cpu_vec *v;
	ck_assert_int_eq(cpu_vec_create(0, &v, err, sizeof(err)), 0);
	err[0] = 0;
	ck_assert_int_eq(cpu_vec_prepare(v, DT_COUNT, x, 32, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "unknown weight format"), "%s", err);
	ck_assert_int_eq(cpu_vec_prepare(v, DT_BF16, x, 0, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "0 values for BF16"), "%s", err);
	ck_assert_int_eq(cpu_vec_prepare(v, DT_Q8_0, x, 48, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "48 values for Q8_0") && strstr(err, "multiple of 32"), "%s", err);
	ck_assert_int_eq(cpu_vec_prepare(v, DT_Q6_K, x, 128, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "multiple of 256"), "%s", err);
	ck_assert_int_eq(cpu_vec_prepare(v, DT_F32, x, (1u << 30) + 1, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "at most"), "%s", err);
	/* a failed prepare leaves nothing prepared */
	ck_assert_int_eq(cpu_vec_prepare(v, DT_F32, x, 16, err, sizeof(err)), 0);
	ck_assert_uint_eq(cpu_vec_len(v), 16);
	ck_assert_int_eq(cpu_vec_prepare(v, DT_Q8_0, x, 16, err, sizeof(err)), -EINVAL);
	ck_assert_uint_eq(cpu_vec_len(v), 0);
	cpu_vec_destroy(&v);
	ck_assert_int_eq(cpu_vec_create(UINT32_MAX, &v, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_null(v);
}
END_TEST

/* A vector grows when x is longer than its room, and keeps serving shorter ones. */
START_TEST(test_prepare_grows)
{
	enum { N = 4096 };
	static float x[N];
	rng_state = 11;
	for (int i = 0; i < N; i++)
		x[i] = (float)rng_normal();
	char err[256];
	struct cpu_vec *v;
	ck_assert_int_eq(cpu_vec_create(64, &v, err, sizeof(err)), 0);
	const uint32_t lens[] = {64, 4096, 256, 2048, 32};
	for (int path = 0; path < 2; path++) {
		cpu_compute_force_isa(path ? CPU_ISA_SCALAR : CPU_ISA_ALL);
		for (int t = 0; t < DT_COUNT; t++) {
			for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
				if (lens[k] % dtype_block_elems(t))
					continue;
				ck_assert_int_eq(cpu_vec_prepare(v, (enum dtype)t, x, lens[k], err, sizeof(err)), 0);
				check_vec(v, (enum dtype)t, x, lens[k]);
			}
		}
	}
	cpu_vec_destroy(&v);
}
END_TEST

START_TEST(test_paths)
{
	unsetenv("PIPELINE_CPU_ISA"); /* read on first use, below (see test_env_scalar) */
	const unsigned have = cpu_compute_isa_supported();
	ck_assert_uint_eq(have & ~(unsigned)CPU_ISA_ALL, 0);
	/* by default everything the CPU has but AMX's tiles (asked for with PIPELINE_CPU_ISA=amx) */
	ck_assert_uint_eq(cpu_compute_isa(), have & ~(unsigned)CPU_ISA_AMX_BF16);
	ck_assert_str_eq(cpu_compute_path(DT_COUNT), "?");
	ck_assert_uint_eq(cpu_compute_force_isa(CPU_ISA_SCALAR), CPU_ISA_SCALAR);
	for (int t = 0; t < DT_COUNT; t++)
		ck_assert_str_eq(cpu_compute_path((enum dtype)t), "scalar");
	ck_assert_uint_eq(cpu_compute_force_isa(CPU_ISA_ALL), have);
	ck_assert_str_eq(cpu_compute_path(DT_F32), have & CPU_ISA_AVX512F ? "avx512f" : "scalar");
	ck_assert_str_eq(cpu_compute_path(DT_F16), have & CPU_ISA_AVX512F ? "avx512f" : "scalar");
	ck_assert_str_eq(cpu_compute_path(DT_BF16), have & CPU_ISA_AVX512_BF16 ? "avx512-bf16" : "scalar");
	for (int t = DT_Q8_0; t < DT_COUNT; t++)
		ck_assert_str_eq(cpu_compute_path((enum dtype)t),
				 have & CPU_ISA_AVX512_VNNI ? "avx512-vnni" : "scalar");
	/* a mask narrows to what the CPU has */
	ck_assert_uint_eq(cpu_compute_force_isa(CPU_ISA_AVX512_VNNI), have & CPU_ISA_AVX512_VNNI);
	ck_assert_str_eq(cpu_compute_path(DT_BF16), "scalar");
	cpu_compute_force_isa(CPU_ISA_ALL);
	printf("cpu compute paths on this machine: F32 %s, BF16 %s, Q4_K %s\n", cpu_compute_path(DT_F32),
	       cpu_compute_path(DT_BF16), cpu_compute_path(DT_Q4_K));
}
END_TEST

/* PIPELINE_CPU_ISA=scalar is read when the library first looks at the CPU: this test's process
 * is a fresh fork of main (Check's fork mode), which has not. */
START_TEST(test_env_scalar)
{
	const char *fork_mode = getenv("CK_FORK");
	if (fork_mode && strcmp(fork_mode, "no") == 0) {
		printf("test_env_scalar: skipped without fork mode\n");
		return;
	}
	setenv("PIPELINE_CPU_ISA", "scalar", 1);
	ck_assert_uint_eq(cpu_compute_isa(), CPU_ISA_SCALAR);
	ck_assert_str_eq(cpu_compute_path(DT_Q4_K), "scalar");
	/* forcing afterwards still works */
	ck_assert_uint_eq(cpu_compute_force_isa(CPU_ISA_ALL), cpu_compute_isa_supported());
}
END_TEST

int main(void)
{
	Suite *s = suite_create("cpu_vec");
	TCase *tc = tcase_create("prepare");
	tcase_add_test(tc, test_prepare_forms);
	tcase_add_test(tc, test_prepare_edges);
	tcase_add_test(tc, test_prepare_refuses);
	tcase_add_test(tc, test_prepare_grows);
	suite_add_tcase(s, tc);
	tc = tcase_create("paths");
	tcase_add_test(tc, test_paths);
	tcase_add_test(tc, test_env_scalar);
	suite_add_tcase(s, tc);
	return th_run(s);
}

/* test_dtype.c - common/dtype.c: bf16/f16 conversions against references computed in double,
 * and the dtype names. */
#include <check.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/dtype.h"
#include "common/util.h"
#include "tests/unit/common/test_helpers.h"

static uint32_t f32_bits(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	return u;
}

static float bits_f32(uint32_t u)
{
	float f;
	memcpy(&f, &u, 4);
	return f;
}

/* IEEE half from its fields, in double (exact): the reference for f16_to_f32. */
static double f16_ref(uint16_t h)
{
	int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
	double v;
	if (exp == 0)
		v = ldexp(mant, -24);
	else if (exp == 31)
		v = mant ? NAN : INFINITY;
	else
		v = ldexp(1024 + mant, exp - 25);
	return sign ? -v : v;
}

/* bfloat16 from its fields, in double; exponent 255 without mantissa counts as 2^128 so that the
 * reference rounding sees the step past the largest finite value as IEEE's unbounded exponent does. */
static double bf16_ref(uint16_t h)
{
	int sign = h >> 15, exp = (h >> 7) & 0xff, mant = h & 0x7f;
	double v;
	if (exp == 0)
		v = ldexp(mant, -133);
	else if (exp == 255)
		v = mant ? NAN : ldexp(1, 128);
	else
		v = ldexp(128 + mant, exp - 134);
	return sign ? -v : v;
}

/* Reference narrowing by round to nearest, ties to even, over a table of the magnitudes of
 * every finite value of the narrow type in bit order plus the one step past the largest
 * (which encodes infinity). */
static uint16_t round_ref(const double *mag, int n, double x, uint16_t inf_bits)
{
	uint16_t sign = signbit(x) ? 0x8000 : 0;
	double a = fabs(x);
	if (a >= mag[n - 1])
		return sign | inf_bits;
	int lo = 0, hi = n - 1; /* mag[lo] <= a < mag[hi] */
	while (hi - lo > 1) {
		int mid = (lo + hi) / 2;
		if (mag[mid] <= a)
			lo = mid;
		else
			hi = mid;
	}
	double dlo = a - mag[lo], dhi = mag[hi] - a;
	int pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo & 1) ? hi : lo;
	return (uint16_t)(sign | pick);
}

static double f16_mag[0x7c01];
static double bf16_mag[0x7f81];

static void build_tables(void)
{
	for (int i = 0; i <= 0x7c00; i++)
		f16_mag[i] = i == 0x7c00 ? 65536.0 : f16_ref((uint16_t)i);
	for (int i = 0; i <= 0x7f80; i++)
		bf16_mag[i] = bf16_ref((uint16_t)i);
}

static uint16_t f16_round_ref(float f)
{
	return round_ref(f16_mag, 0x7c01, f, 0x7c00);
}

static uint16_t bf16_round_ref(float f)
{
	return round_ref(bf16_mag, 0x7f81, f, 0x7f80);
}

static void check_f16(float f)
{
	uint16_t got = f32_to_f16(f), want = f16_round_ref(f);
	TH_CHECK(got == want, "f32_to_f16(%a [%08x]) = %04x, want %04x", (double)f, f32_bits(f), got, want);
}

static void check_bf16(float f)
{
	uint16_t got = f32_to_bf16(f), want = bf16_round_ref(f);
	TH_CHECK(got == want, "f32_to_bf16(%a [%08x]) = %04x, want %04x", (double)f, f32_bits(f), got, want);
}

/* ---- f16 ---- */

START_TEST(test_f16_widen_all)
{
	for (uint32_t h = 0; h < 65536; h++) {
		float f = f16_to_f32((uint16_t)h);
		double want = f16_ref((uint16_t)h);
		if (isnan(want)) {
			TH_CHECK(isnan(f), "f16 %04x should widen to NaN", h);
			TH_CHECK(!!signbit(f) == !!(h & 0x8000), "f16 %04x: NaN sign", h);
			continue;
		}
		TH_CHECK((double)f == want && !!signbit(f) == !!signbit(want), "f16 %04x -> %a, want %a", h,
			      (double)f, want);
	}
}
END_TEST

START_TEST(test_f16_round_trip_all)
{
	for (uint32_t h = 0; h < 65536; h++) {
		uint16_t back = f32_to_f16(f16_to_f32((uint16_t)h));
		if (((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff)) {
			/* NaN stays NaN (a quiet one), with its sign */
			TH_CHECK((back & 0x7c00) == 0x7c00 && (back & 0x3ff) && (back & 0x8000) == (h & 0x8000),
				      "NaN %04x came back as %04x", h, back);
			continue;
		}
		TH_CHECK(back == h, "f16 %04x came back as %04x", h, back);
	}
}
END_TEST

START_TEST(test_f16_rounding)
{
	build_tables();
	/* Around every f16 value: itself, the midpoint to its successor, and the floats either side. */
	for (int i = 0; i < 0x7c00; i++) {
		double mid = (f16_mag[i] + f16_mag[i + 1]) / 2; /* exact: 12 significant bits */
		float m = (float)mid;
		TH_CHECK(m == mid, "midpoint %a not a float", mid);
		float c[] = {(float)f16_mag[i], m, nextafterf(m, 0), nextafterf(m, INFINITY),
			     nextafterf((float)f16_mag[i], INFINITY)};
		for (size_t k = 0; k < ARRAY_SIZE(c); k++) {
			check_f16(c[k]);
			check_f16(-c[k]);
		}
	}
	/* A stride over every float bit pattern. */
	for (uint64_t u = 0; u < (1ull << 32); u += 4099) {
		float f = bits_f32((uint32_t)u);
		if (!isnan(f))
			check_f16(f);
	}
	/* Every float in the region where f16 results are subnormal or the smallest normals. */
	for (uint32_t u = 0x32800000u; u < 0x38900000u; u += 7)
		check_f16(bits_f32(u));
}
END_TEST

START_TEST(test_f16_specials)
{
	ck_assert_uint_eq(f32_to_f16(0.0f), 0x0000);
	ck_assert_uint_eq(f32_to_f16(-0.0f), 0x8000);
	ck_assert_uint_eq(f32_to_f16(1.0f), 0x3c00);
	ck_assert_uint_eq(f32_to_f16(-2.0f), 0xc000);
	ck_assert_uint_eq(f32_to_f16(65504.0f), 0x7bff);
	/* Overflow: 65519.99 rounds down to the largest finite value, 65520 (the tie) goes to infinity. */
	ck_assert_uint_eq(f32_to_f16(nextafterf(65520.0f, 0)), 0x7bff);
	ck_assert_uint_eq(f32_to_f16(65520.0f), 0x7c00);
	ck_assert_uint_eq(f32_to_f16(1e10f), 0x7c00);
	ck_assert_uint_eq(f32_to_f16(-1e10f), 0xfc00);
	ck_assert_uint_eq(f32_to_f16(INFINITY), 0x7c00);
	ck_assert_uint_eq(f32_to_f16(-INFINITY), 0xfc00);
	ck_assert_uint_eq(f32_to_f16(FLT_MAX), 0x7c00);
	/* Subnormals: 2^-24 is the smallest; half of it is a tie that goes to zero (even). */
	ck_assert_uint_eq(f32_to_f16(ldexpf(1, -24)), 0x0001);
	ck_assert_uint_eq(f32_to_f16(ldexpf(1, -25)), 0x0000);
	ck_assert_uint_eq(f32_to_f16(nextafterf(ldexpf(1, -25), 1)), 0x0001);
	ck_assert_uint_eq(f32_to_f16(ldexpf(3, -25)), 0x0002); /* 1.5 steps: tie to even */
	ck_assert_uint_eq(f32_to_f16(ldexpf(5, -25)), 0x0002); /* 2.5 steps: tie to even */
	ck_assert_uint_eq(f32_to_f16(ldexpf(1, -14)), 0x0400); /* smallest normal */
	ck_assert_uint_eq(f32_to_f16(ldexpf(1023.5f, -24)), 0x0400); /* rounds up into the normals */
	ck_assert_uint_eq(f32_to_f16(FLT_MIN), 0x0000);
	ck_assert_uint_eq(f32_to_f16(-FLT_MIN), 0x8000);
	/* Ties between normals. */
	ck_assert_uint_eq(f32_to_f16(1.0f + ldexpf(1, -11)), 0x3c00);		   /* to even (down) */
	ck_assert_uint_eq(f32_to_f16(1.0f + 3 * ldexpf(1, -11)), 0x3c02);	   /* to even (up) */
	ck_assert_uint_eq(f32_to_f16(nextafterf(1.0f + ldexpf(1, -11), 2)), 0x3c01); /* past the tie */
	/* NaN in, NaN out */
	uint16_t n = f32_to_f16(NAN);
	ck_assert((n & 0x7c00) == 0x7c00 && (n & 0x3ff));
	n = f32_to_f16(bits_f32(0x7f800001u)); /* signalling NaN with only a low payload bit */
	ck_assert((n & 0x7c00) == 0x7c00 && (n & 0x3ff));
	ck_assert(isnan(f16_to_f32(0x7e00)));
	ck_assert(isinf(f16_to_f32(0x7c00)) && f16_to_f32(0x7c00) > 0);
	ck_assert(isinf(f16_to_f32(0xfc00)) && f16_to_f32(0xfc00) < 0);
}
END_TEST

/* ---- bf16 ---- */

START_TEST(test_bf16_widen_and_round_trip_all)
{
	for (uint32_t h = 0; h < 65536; h++) {
		float f = bf16_to_f32((uint16_t)h);
		int exp = (h >> 7) & 0xff, mant = h & 0x7f;
		if (exp == 255 && mant) {
			TH_CHECK(isnan(f), "bf16 %04x should widen to NaN", h);
			uint16_t back = f32_to_bf16(f);
			TH_CHECK((back & 0x7f80) == 0x7f80 && (back & 0x7f) && (back & 0x40) &&
					      (back & 0x8000) == (h & 0x8000),
				      "NaN %04x came back as %04x (want a quiet NaN)", h, back);
			continue;
		}
		double want = exp == 255 ? (h & 0x8000 ? -INFINITY : INFINITY) : bf16_ref((uint16_t)h);
		TH_CHECK((double)f == want && !!signbit(f) == !!(h & 0x8000), "bf16 %04x -> %a, want %a", h,
			      (double)f, want);
		TH_CHECK(f32_bits(f) == h << 16, "bf16 %04x widened to %08x", h, f32_bits(f));
		uint16_t back = f32_to_bf16(f);
		TH_CHECK(back == h, "bf16 %04x came back as %04x", h, back);
	}
}
END_TEST

START_TEST(test_bf16_rounding)
{
	build_tables();
	for (int i = 0; i < 0x7f80; i++) {
		double mid = (bf16_mag[i] + bf16_mag[i + 1]) / 2;
		float m = (float)mid;
		TH_CHECK(m == mid, "midpoint %a not a float", mid);
		float c[] = {(float)bf16_mag[i], m, nextafterf(m, 0), nextafterf(m, INFINITY)};
		for (size_t k = 0; k < ARRAY_SIZE(c); k++) {
			check_bf16(c[k]);
			check_bf16(-c[k]);
		}
	}
	for (uint64_t u = 0; u < (1ull << 32); u += 4099) {
		float f = bits_f32((uint32_t)u);
		if (!isnan(f))
			check_bf16(f);
	}
	ck_assert_uint_eq(f32_to_bf16(FLT_MAX), 0x7f80); /* rounds past the largest finite bf16 */
	ck_assert_uint_eq(f32_to_bf16(-INFINITY), 0xff80);
	ck_assert_uint_eq(f32_to_bf16(1.0f), 0x3f80);
	ck_assert_uint_eq(f32_to_bf16(bits_f32(0x7f800001u)) & 0x7fc0, 0x7fc0); /* quiet NaN */
}
END_TEST

/* ---- bulk conversion and names ---- */

START_TEST(test_dtype_to_f32)
{
	uint16_t h[5] = {0x3c00, 0xc000, 0x0001, 0x7bff, 0x8000};
	float out[5];
	dtype_to_f32(DT_F16, h, out, 5);
	for (int i = 0; i < 5; i++) {
		ck_assert(out[i] == f16_to_f32(h[i]));
		ck_assert(dtype_get_f32(DT_F16, h, (size_t)i) == out[i]);
	}
	uint16_t b[3] = {0x3f80, 0xc040, 0x0001};
	dtype_to_f32(DT_BF16, b, out, 3);
	ck_assert(out[0] == 1.0f && out[1] == -3.0f && out[2] == bf16_to_f32(0x0001));
	ck_assert(dtype_get_f32(DT_BF16, b, 1) == -3.0f);
	float f[3] = {1.5f, -0.0f, 1e30f};
	dtype_to_f32(DT_F32, f, out, 3);
	ck_assert_mem_eq(out, f, sizeof(f));
	ck_assert(dtype_get_f32(DT_F32, f, 2) == 1e30f);
	dtype_to_f32(DT_F16, h, out, 0); /* nothing to do, nothing touched */
	ck_assert_uint_eq(dtype_size(DT_F32), 4);
	ck_assert_uint_eq(dtype_size(DT_F16), 2);
	ck_assert_uint_eq(dtype_size(DT_BF16), 2);
}
END_TEST

START_TEST(test_dtype_names)
{
	for (int t = 0; t < DT_ELEMENT_COUNT; t++) {
		enum dtype back = DT_COUNT;
		ck_assert_int_eq(dtype_parse(dtype_name((enum dtype)t), &back), 0);
		ck_assert_int_eq(back, t);
	}
	/* The GGUF block formats have names but are no safetensors dtype. */
	static const char *const blocks[] = {"Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"};
	for (int t = DT_ELEMENT_COUNT; t < DT_COUNT; t++) {
		ck_assert_str_eq(dtype_name((enum dtype)t), blocks[t - DT_ELEMENT_COUNT]);
		enum dtype back = DT_COUNT;
		ck_assert_int_eq(dtype_parse(dtype_name((enum dtype)t), &back), -EINVAL);
		ck_assert_int_eq(back, DT_COUNT);
		ck_assert(!dtype_is_element((enum dtype)t));
		ck_assert_uint_eq(dtype_size((enum dtype)t), 0);
	}
	ck_assert_uint_eq(dtype_row_bytes(DT_Q4_K, 4096), 16 * 144);
	ck_assert_uint_eq(dtype_row_bytes(DT_Q8_0, 96), 3 * 34);
	ck_assert_uint_eq(dtype_row_bytes(DT_Q6_K, 512), 2 * 210);
	ck_assert_uint_eq(dtype_row_bytes(DT_BF16, 100), 200);
	ck_assert_str_eq(dtype_name(DT_F32), "F32");
	ck_assert_str_eq(dtype_name(DT_F16), "F16");
	ck_assert_str_eq(dtype_name(DT_BF16), "BF16");
	ck_assert_str_eq(dtype_name(DT_COUNT), "?");
	ck_assert_str_eq(dtype_name((enum dtype)-1), "?");
	/* Types a safetensors file may hold that we do not compute in. */
	static const char *const unsupported[] = {"F64", "I64",	 "I32",	    "I16",     "I8",	  "U8",
						  "BOOL", "F8_E4M3", "F8_E5M2", "U16", "U32", "U64",
						  "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"};
	for (size_t i = 0; i < ARRAY_SIZE(unsupported); i++) {
		enum dtype t = DT_COUNT;
		ck_assert_msg(dtype_parse(unsupported[i], &t) == -ENOTSUP, "%s", unsupported[i]);
		ck_assert_int_eq(t, DT_COUNT);
	}
	static const char *const garbage[] = {"", "f32", "bf16", "BF16 ", " F16", "FP16", "float32", "F", "F1",
					      "F32\n", "BF", "I9"};
	for (size_t i = 0; i < ARRAY_SIZE(garbage); i++) {
		enum dtype t = DT_COUNT;
		ck_assert_msg(dtype_parse(garbage[i], &t) == -EINVAL, "'%s'", garbage[i]);
		ck_assert_int_eq(t, DT_COUNT);
	}
}
END_TEST

static Suite *dtype_suite(void)
{
	Suite *s = suite_create("dtype");
	TCase *tc = tcase_create("f16");
	tcase_add_test(tc, test_f16_widen_all);
	tcase_add_test(tc, test_f16_round_trip_all);
	tcase_add_test(tc, test_f16_rounding);
	tcase_add_test(tc, test_f16_specials);
	tcase_set_timeout(tc, 30);
	suite_add_tcase(s, tc);
	tc = tcase_create("bf16");
	tcase_add_test(tc, test_bf16_widen_and_round_trip_all);
	tcase_add_test(tc, test_bf16_rounding);
	tcase_set_timeout(tc, 30);
	suite_add_tcase(s, tc);
	tc = tcase_create("names");
	tcase_add_test(tc, test_dtype_to_f32);
	tcase_add_test(tc, test_dtype_names);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(dtype_suite());
}

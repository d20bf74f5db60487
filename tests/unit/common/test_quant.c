/* test_quant.c - common/quant.c and common/quantize.c: the GGUF block formats.
 *
 * Dequantization, bit for bit, against an independent implementation: llama.cpp's Python
 * package gguf-py, whose numpy dequantizers made tests/fixtures/quant/<TYPE>.bin
 * (scripts/fixtures/quant_reference.py): random blocks with every field's bits exercised and
 * f16 scales of every kind, and the float32 bits gguf-py gives for them. Any change to a layout
 * or to the arithmetic of quant.c that changes one value fails here.
 *
 * Quantization: the error of quantize then dequantize per format on Gaussian data and on data
 * with outliers, held to bounds measured and explained below; blocks of zeros, constants, huge,
 * tiny and non-finite values; the element formats.
 *
 *   test_common_quant            the tests
 *   test_common_quant --bench    prints quantization speed per format (values/s, one thread);
 *                                speed is measured, never asserted */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/dtype.h"
#include "common/quant.h"
#include "tests/unit/common/test_helpers.h"

#ifndef QUANT_FIXTURE_DIR
#error "QUANT_FIXTURE_DIR: the build gives the path of tests/fixtures/quant"
#endif

static const enum dtype block_types[] = {DT_Q8_0, DT_Q4_0, DT_Q4_K, DT_Q5_K, DT_Q6_K};
#define N_BLOCK_TYPES (sizeof(block_types) / sizeof(block_types[0]))

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

/* ---- dequantization against gguf-py -------------------------------------------------------- */

/* The fixture files (format in scripts/fixtures/quant_reference.py): each names its type by
 * ggml's number, which must be the one GGUF files use for our dtype. */
static const struct {
	enum dtype t;
	uint32_t ggml_type;
} fixtures[] = {
	{DT_F16, 1}, {DT_BF16, 30}, {DT_Q8_0, 8}, {DT_Q4_0, 2}, {DT_Q4_K, 12}, {DT_Q5_K, 13}, {DT_Q6_K, 14},
};
#define FIXTURE_HEADER 24

static uint32_t rd32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

struct fixture {
	uint8_t *file;		 /* the whole file */
	size_t nblocks;
	const uint8_t *blocks;	 /* nblocks * dtype_block_bytes(t) */
	const uint8_t *expected; /* nblocks * dtype_block_elems(t) little-endian float32 bit patterns */
	size_t n;		 /* values */
};

static void fixture_load(enum dtype t, uint32_t ggml_type, struct fixture *fx)
{
	char path[512];
	snprintf(path, sizeof(path), "%s/%s.bin", QUANT_FIXTURE_DIR, dtype_name(t));
	FILE *f = fopen(path, "rb");
	ck_assert_msg(f != NULL, "%s: %s (made by scripts/fixtures/quant_reference.py)", path, strerror(errno));
	size_t cap = 1 << 20;
	fx->file = malloc(cap);
	ck_assert_ptr_nonnull(fx->file);
	size_t size = fread(fx->file, 1, cap, f);
	ck_assert_msg(!ferror(f) && size < cap, "%s: read error or larger than %zu bytes", path, cap);
	fclose(f);
	ck_assert_msg(size >= FIXTURE_HEADER && !memcmp(fx->file, "PQFX", 4) && rd32(fx->file + 4) == 1,
		      "%s: not a version 1 quant fixture", path);
	const uint32_t type = rd32(fx->file + 8), be = rd32(fx->file + 12), bb = rd32(fx->file + 16);
	fx->nblocks = rd32(fx->file + 20);
	ck_assert_msg(type == ggml_type, "%s: ggml type %u, want %u", path, type, ggml_type);
	/* gguf-py's GGML_QUANT_SIZES against dtype.h */
	ck_assert_msg(be == dtype_block_elems(t) && bb == dtype_block_bytes(t),
		      "%s: gguf-py's block is %u values in %u bytes, dtype.h says %u in %zu", path, be, bb,
		      dtype_block_elems(t), dtype_block_bytes(t));
	ck_assert_msg(fx->nblocks > 0 && size == FIXTURE_HEADER + fx->nblocks * (bb + 4ull * be),
		      "%s: %zu bytes do not hold %zu blocks", path, size, fx->nblocks);
	fx->blocks = fx->file + FIXTURE_HEADER;
	fx->expected = fx->blocks + fx->nblocks * bb;
	fx->n = fx->nblocks * be;
}

/* Every value has gguf-py's bits (a NaN matches any NaN: gguf-py widens halves through numpy,
 * which may quiet a signalling NaN). */
static void check_bits(enum dtype t, const struct fixture *fx, const float *got, const char *how)
{
	size_t bad = 0, first = 0;
	for (size_t i = 0; i < fx->n; i++) {
		const uint32_t want = rd32(fx->expected + 4 * i), have = f32_bits(got[i]);
		if (want != have && !(isnan(bits_f32(want)) && isnan(got[i]))) {
			if (!bad++)
				first = i;
		}
	}
	if (bad) {
		const uint32_t want = rd32(fx->expected + 4 * first);
		ck_abort_msg("%s (%s): %zu of %zu values differ from gguf-py; first: value %zu (block %zu, "
			     "element %zu) is %a (0x%08x), gguf-py says %a (0x%08x)",
			     dtype_name(t), how, bad, fx->n, first, first / dtype_block_elems(t),
			     first % dtype_block_elems(t), got[first], f32_bits(got[first]), bits_f32(want), want);
	}
}

START_TEST(test_dequantize_matches_gguf_py)
{
	const enum dtype t = fixtures[_i].t;
	struct fixture fx;
	fixture_load(t, fixtures[_i].ggml_type, &fx);
	const size_t bytes = dtype_row_bytes(t, fx.n);
	float *got = malloc(fx.n * sizeof(float));
	uint8_t *shifted = malloc(bytes + 1);
	ck_assert(got && shifted);

	/* the blocks where the file has them (24 bytes in: aligned for every block struct) */
	quant_dequantize(t, fx.blocks, got, fx.n);
	check_bits(t, &fx, got, "aligned");
	/* one byte off: the path that copies each block out first (block formats take any
	 * alignment; element formats are read as arrays of their type) */
	if (!dtype_is_element(t)) {
		memcpy(shifted + 1, fx.blocks, bytes);
		memset(got, 0xff, fx.n * sizeof(float));
		quant_dequantize(t, shifted + 1, got, fx.n);
		check_bits(t, &fx, got, "unaligned");
	}
	/* through dtype_to_f32, as the loader reads tensors */
	memset(got, 0xff, fx.n * sizeof(float));
	dtype_to_f32(t, fx.blocks, got, fx.n);
	check_bits(t, &fx, got, "dtype_to_f32");

	free(shifted);
	free(got);
	free(fx.file);
}
END_TEST

/* ---- quantization: data ------------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) /* splitmix64 */
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static double rng_unit(uint64_t *s) /* (0, 1) */
{
	return ((rng_next(s) >> 11) + 0.5) / 9007199254740992.0;
}

/* n standard normal values (Box-Muller), scaled by scale; every 64th value times `outlier`. */
static void gaussian(float *x, size_t n, uint64_t seed, float scale, float outlier)
{
	for (size_t i = 0; i < n; i++) {
		const double g = sqrt(-2 * log(rng_unit(&seed))) * cos(2 * M_PI * rng_unit(&seed));
		x[i] = (float)g * scale * (i % 64 == 7 ? outlier : 1.0f);
	}
}

/* Quantizes x[0..n) to t and back into y. */
static void round_trip(enum dtype t, const float *x, float *y, size_t n)
{
	void *q = malloc(dtype_row_bytes(t, n) ? dtype_row_bytes(t, n) : 1);
	ck_assert_ptr_nonnull(q);
	quant_quantize(t, x, q, n);
	quant_dequantize(t, q, y, n);
	free(q);
}

/* ||x - y|| / ||x|| over values where x is finite. */
static double rel_rms(const float *x, const float *y, size_t n)
{
	double e = 0, s = 0;
	for (size_t i = 0; i < n; i++) {
		if (!isfinite(x[i]))
			continue;
		e += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
		s += (double)x[i] * x[i];
	}
	return s > 0 ? sqrt(e / s) : sqrt(e);
}

static void check_finite(enum dtype t, const float *y, size_t n, const char *what)
{
	for (size_t i = 0; i < n; i++)
		TH_CHECK(isfinite(y[i]), "%s, %s: value %zu decodes to %g", dtype_name(t), what, i, y[i]);
}

/* ---- quantization: error bounds ------------------------------------------------------------ */

#define RT_N (64 * QK_K) /* values of the error tests: 64 super-blocks, 512 blocks of 32 */

/* Relative RMS error bounds, Gaussian data (gaussian(seed 1, scale 1)) and the same with every
 * 64th value ten times larger. Measured on that data (quant_quantize / llama.cpp's reference
 * quantizer, ggml-quants.c's quantize_row_*_ref, run on the same data for comparison):
 *
 *            Gaussian          outliers
 *   Q8_0     0.536% / 0.536%   1.042% / 1.042%   amax / 127 is the reference's choice too
 *   Q6_K     1.772% / 1.771%   2.985% / 2.975%   step amax / 32 over 16 values: 1.8% expected
 *   Q5_K     3.474% / 3.581%   4.761% / 4.891%
 *   Q4_K     7.012% / 7.079%   9.520% / 9.609%
 *   Q4_0     8.407% / 8.585%  15.648% /15.573%   symmetric: outliers stretch all 32 values' step
 *
 * The uniform-noise estimate step / sqrt(12) gives the same scale: 6 bits over a 16-value block
 * of Gaussians (amax about 2 sigma) is 1.8%, 4 bits with a min over 32 values about 7%. The
 * bounds sit about 5% above the measurement: a quantizer that gets worse fails, one that merely
 * rounds a tie differently does not. */
static const struct {
	enum dtype t;
	double gauss, outliers;
} bounds[] = {
	{DT_Q8_0, 0.0057, 0.0110}, {DT_Q4_0, 0.088, 0.165}, {DT_Q4_K, 0.074, 0.100},
	{DT_Q5_K, 0.0365, 0.050},  {DT_Q6_K, 0.0186, 0.0314},
};

START_TEST(test_quantize_error_gaussian)
{
	const enum dtype t = bounds[_i].t;
	float *x = malloc(RT_N * sizeof(float)), *y = malloc(RT_N * sizeof(float));
	ck_assert(x && y);
	gaussian(x, RT_N, 1, 1.0f, 1.0f);
	round_trip(t, x, y, RT_N);
	const double e = rel_rms(x, y, RT_N);
	gaussian(x, RT_N, 1, 1.0f, 10.0f);
	round_trip(t, x, y, RT_N);
	const double eo = rel_rms(x, y, RT_N);
	printf("%s: relative RMS error %.4f%% on Gaussian data, %.4f%% with outliers\n", dtype_name(t), 100 * e,
	       100 * eo);
	ck_assert_msg(e < bounds[_i].gauss, "%s: relative RMS error %.4f%% on Gaussian data, bound %.4f%%",
		      dtype_name(t), 100 * e, 100 * bounds[_i].gauss);
	ck_assert_msg(eo < bounds[_i].outliers, "%s: relative RMS error %.4f%% with outliers, bound %.4f%%",
		      dtype_name(t), 100 * eo, 100 * bounds[_i].outliers);
	free(x);
	free(y);
}
END_TEST

/* The error does not depend on the magnitude while the scales stay normal halves: values around
 * 1e4 and 1e-2 quantize as well as values around 1, and a block of values near 1e4 (the f16 d of
 * Q4_0 is 1e4 / 8 * 2.5) stays finite. */
START_TEST(test_quantize_error_scale_free)
{
	const enum dtype t = bounds[_i].t;
	float *x = malloc(RT_N * sizeof(float)), *y = malloc(RT_N * sizeof(float));
	ck_assert(x && y);
	const float scales[] = {1e4f, 3e3f, 1e-2f};
	for (size_t k = 0; k < sizeof(scales) / sizeof(scales[0]); k++) {
		gaussian(x, RT_N, 2 + k, scales[k], 1.0f);
		round_trip(t, x, y, RT_N);
		check_finite(t, y, RT_N, "Gaussian data");
		const double e = rel_rms(x, y, RT_N);
		ck_assert_msg(e < bounds[_i].gauss, "%s: relative RMS error %.4f%% on Gaussian data of scale %g",
			      dtype_name(t), 100 * e, scales[k]);
	}
	free(x);
	free(y);
}
END_TEST

/* ---- quantization: special blocks ---------------------------------------------------------- */

/* One super-block (256 values, whole blocks of every format) of the value v. */
static void fill(float *x, float v)
{
	for (int i = 0; i < QK_K; i++)
		x[i] = v;
}

START_TEST(test_quantize_zeros)
{
	const enum dtype t = block_types[_i];
	float x[QK_K], y[QK_K];
	fill(x, 0.0f);
	memset(y, 0xff, sizeof(y));
	round_trip(t, x, y, QK_K);
	for (int i = 0; i < QK_K; i++)
		ck_assert_msg(f32_bits(y[i]) == 0, "%s: a block of zeros decodes value %d to %a", dtype_name(t), i,
			      y[i]);
	/* and a block with zeros among other values keeps them at zero */
	gaussian(x, QK_K, 5, 1.0f, 1.0f);
	for (int i = 0; i < QK_K; i += 3)
		x[i] = 0;
	round_trip(t, x, y, QK_K);
	for (int i = 0; i < QK_K; i += 3)
		if (t == DT_Q8_0 || t == DT_Q4_0 || t == DT_Q6_K) /* symmetric formats: level 0 is exact */
			ck_assert_msg(y[i] == 0, "%s: zero at %d decodes to %g", dtype_name(t), i, y[i]);
}
END_TEST

/* A constant block decodes to the constant, to the precision of its f16 scale. (The constants are
 * large enough for every format's scale to be a normal half: Q6_K's d is c / 4096, Q4_K's
 * c / 945. Below that d is subnormal and coarser, as it is for ggml.) */
START_TEST(test_quantize_constant)
{
	const enum dtype t = block_types[_i];
	const float values[] = {1.0f, -1.0f, 3.7f, -3.7f, 0.5f, -0.5f, 1e4f, -1e4f};
	float x[QK_K], y[QK_K];
	for (size_t k = 0; k < sizeof(values) / sizeof(values[0]); k++) {
		fill(x, values[k]);
		round_trip(t, x, y, QK_K);
		for (int i = 0; i < QK_K; i++)
			ck_assert_msg(fabsf(y[i] - values[k]) <= 2e-3f * fabsf(values[k]),
				      "%s: constant %g decodes value %d to %.9g", dtype_name(t), values[k], i, y[i]);
	}
}
END_TEST

/* Values too small for any f16 scale, subnormal floats, and values up to 1e8 or past it (clipped):
 * every block decodes to finite values, and tiny blocks to values no larger than their input. */
START_TEST(test_quantize_extremes)
{
	const enum dtype t = block_types[_i];
	float x[QK_K], y[QK_K];
	const float tiny[] = {1e-6f, 1e-12f, 1e-30f, 1e-40f /* subnormal */, 1.4e-45f /* the smallest */};
	for (size_t k = 0; k < sizeof(tiny) / sizeof(tiny[0]); k++) {
		gaussian(x, QK_K, 10 + k, tiny[k], 1.0f);
		round_trip(t, x, y, QK_K);
		check_finite(t, y, QK_K, "tiny values");
		float amax = 0, ymax = 0;
		for (int i = 0; i < QK_K; i++) {
			amax = fmaxf(amax, fabsf(x[i]));
			ymax = fmaxf(ymax, fabsf(y[i]));
		}
		ck_assert_msg(ymax <= 2 * amax + 1e-7f, "%s: values of scale %g decode up to %g", dtype_name(t),
			      tiny[k], ymax);
	}
	const float huge[] = {1e4f, 6e4f, 1e6f, 1e8f, 1e12f, 3e38f};
	for (size_t k = 0; k < sizeof(huge) / sizeof(huge[0]); k++) {
		gaussian(x, QK_K, 20 + k, huge[k], 1.0f);
		round_trip(t, x, y, QK_K);
		check_finite(t, y, QK_K, "huge values");
		fill(x, huge[k]);
		round_trip(t, x, y, QK_K);
		check_finite(t, y, QK_K, "a huge constant");
		fill(x, -huge[k]);
		round_trip(t, x, y, QK_K);
		check_finite(t, y, QK_K, "a huge negative constant");
	}
	/* one huge value among ordinary ones */
	gaussian(x, QK_K, 30, 1.0f, 1.0f);
	x[17] = 1e4f;
	x[200] = -3e4f;
	round_trip(t, x, y, QK_K);
	check_finite(t, y, QK_K, "two huge values among ordinary ones");
}
END_TEST

/* NaN and infinities in the input: finite output; a NaN counts as 0 and leaves its block's other
 * values quantized as well as without it. */
START_TEST(test_quantize_non_finite)
{
	const enum dtype t = bounds[_i].t;
	float x[QK_K], y[QK_K], y0[QK_K];
	gaussian(x, QK_K, 40, 1.0f, 1.0f);
	round_trip(t, x, y0, QK_K);
	const double e0 = rel_rms(x, y0, QK_K);
	for (int i = 0; i < QK_K; i += 37)
		x[i] = NAN;
	round_trip(t, x, y, QK_K);
	check_finite(t, y, QK_K, "NaN among the values");
	const double e = rel_rms(x, y, QK_K);
	ck_assert_msg(e < 1.5 * bounds[_i].gauss, "%s: NaN spoils its block: error %.4f%% (%.4f%% without)",
		      dtype_name(t), 100 * e, 100 * e0);
	const float bad[] = {INFINITY, -INFINITY, NAN};
	for (size_t k = 0; k < 3; k++) {
		fill(x, bad[k]);
		round_trip(t, x, y, QK_K);
		check_finite(t, y, QK_K, "a block of one non-finite value");
		gaussian(x, QK_K, 41, 1.0f, 1.0f);
		x[3] = bad[k];
		round_trip(t, x, y, QK_K);
		check_finite(t, y, QK_K, "a non-finite value among ordinary ones");
	}
}
END_TEST

/* quant_quantize writes dtype_row_bytes and not a byte more, to any alignment, the same bytes
 * every time. */
START_TEST(test_quantize_bounds_and_alignment)
{
	const enum dtype t = block_types[_i];
	enum { N = 2 * QK_K };
	float x[N];
	gaussian(x, N, 50, 1.0f, 1.0f);
	const size_t bytes = dtype_row_bytes(t, N);
	uint8_t *a = malloc(bytes + 64), *b = malloc(bytes + 64);
	ck_assert(a && b);
	memset(a, 0xa5, bytes + 64);
	memset(b, 0x5a, bytes + 64);
	quant_quantize(t, x, a + 16, N);
	quant_quantize(t, x, b + 17, N);
	for (int i = 0; i < 16; i++)
		ck_assert_msg(a[i] == 0xa5 && a[16 + bytes + i] == 0xa5, "%s: wrote outside its %zu bytes",
			      dtype_name(t), bytes);
	ck_assert_msg(!memcmp(a + 16, b + 17, bytes), "%s: output depends on the destination's alignment",
		      dtype_name(t));
	free(a);
	free(b);
}
END_TEST

/* ---- element formats ------------------------------------------------------------------------- */

START_TEST(test_quantize_elements)
{
	enum { N = 1 << 16 };
	float *x = malloc(N * sizeof(float)), *y = malloc(N * sizeof(float));
	uint16_t *h = malloc(N * sizeof(uint16_t));
	ck_assert(x && y && h);

	/* F32 copies, NaN payloads and all */
	uint64_t seed = 60;
	for (int i = 0; i < N; i++)
		x[i] = bits_f32((uint32_t)rng_next(&seed));
	quant_quantize(DT_F32, x, y, N);
	ck_assert(!memcmp(x, y, N * sizeof(float)));

	/* every f16 and bf16 value comes back as itself (NaN as a NaN) */
	for (int i = 0; i < N; i++)
		x[i] = f16_to_f32((uint16_t)i);
	quant_quantize(DT_F16, x, h, N);
	for (int i = 0; i < N; i++)
		TH_CHECK(h[i] == i || (isnan(x[i]) && isnan(f16_to_f32(h[i]))), "F16 0x%04x comes back as 0x%04x", i,
			 h[i]);
	for (int i = 0; i < N; i++)
		x[i] = bf16_to_f32((uint16_t)i);
	quant_quantize(DT_BF16, x, h, N);
	for (int i = 0; i < N; i++)
		TH_CHECK(h[i] == i || (isnan(x[i]) && isnan(bf16_to_f32(h[i]))), "BF16 0x%04x comes back as 0x%04x", i,
			 h[i]);

	/* values between them round as f32_to_f16 and f32_to_bf16 do (test_dtype checks those) */
	gaussian(x, N, 61, 3.0f, 1.0f);
	quant_quantize(DT_F16, x, h, N);
	for (int i = 0; i < N; i++)
		TH_CHECK(h[i] == f32_to_f16(x[i]), "F16 of %a: 0x%04x", x[i], h[i]);
	round_trip(DT_F16, x, y, N);
	for (int i = 0; i < N; i++)
		TH_CHECK(y[i] == f16_to_f32(f32_to_f16(x[i])), "F16 round trip of %a: %a", x[i], y[i]);
	quant_quantize(DT_BF16, x, h, N);
	for (int i = 0; i < N; i++)
		TH_CHECK(h[i] == f32_to_bf16(x[i]), "BF16 of %a: 0x%04x", x[i], h[i]);
	free(x);
	free(y);
	free(h);
}
END_TEST

/* ---- speed (--bench) ----------------------------------------------------------------------- */

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int bench(void)
{
	enum { N = 1 << 22 };
	float *x = malloc(N * sizeof(float)), *y = malloc(N * sizeof(float));
	void *q = malloc(N * sizeof(float));
	if (!x || !y || !q)
		return EXIT_FAILURE;
	gaussian(x, N, 1, 1.0f, 1.0f);
	printf("quant_quantize, one thread, %d Gaussian values per format:\n", N);
	for (size_t k = 0; k < N_BLOCK_TYPES; k++) {
		const enum dtype t = block_types[k];
		double best = INFINITY;
		for (int rep = 0; rep < 3; rep++) {
			const double t0 = now_s();
			quant_quantize(t, x, q, N);
			const double dt = now_s() - t0;
			best = dt < best ? dt : best;
		}
		const double t0 = now_s();
		quant_dequantize(t, q, y, N);
		const double dq = now_s() - t0;
		printf("  %-5s %7.1f million values/s quantize, %7.1f dequantize; relative RMS error %.4f%%\n",
		       dtype_name(t), N / best / 1e6, N / dq / 1e6, 100 * rel_rms(x, y, N));
	}
	free(x);
	free(y);
	free(q);
	return EXIT_SUCCESS;
}

static Suite *quant_suite(void)
{
	Suite *s = suite_create("quant");
	TCase *tc = tcase_create("dequantize");
	tcase_add_loop_test(tc, test_dequantize_matches_gguf_py, 0, sizeof(fixtures) / sizeof(fixtures[0]));
	suite_add_tcase(s, tc);

	tc = tcase_create("quantize error");
	tcase_set_timeout(tc, 60);
	tcase_add_loop_test(tc, test_quantize_error_gaussian, 0, sizeof(bounds) / sizeof(bounds[0]));
	tcase_add_loop_test(tc, test_quantize_error_scale_free, 0, sizeof(bounds) / sizeof(bounds[0]));
	suite_add_tcase(s, tc);

	tc = tcase_create("quantize blocks");
	tcase_add_loop_test(tc, test_quantize_zeros, 0, N_BLOCK_TYPES);
	tcase_add_loop_test(tc, test_quantize_constant, 0, N_BLOCK_TYPES);
	tcase_add_loop_test(tc, test_quantize_extremes, 0, N_BLOCK_TYPES);
	tcase_add_loop_test(tc, test_quantize_non_finite, 0, sizeof(bounds) / sizeof(bounds[0]));
	tcase_add_loop_test(tc, test_quantize_bounds_and_alignment, 0, N_BLOCK_TYPES);
	suite_add_tcase(s, tc);

	tc = tcase_create("elements");
	tcase_add_test(tc, test_quantize_elements);
	suite_add_tcase(s, tc);
	return s;
}

int main(int argc, char **argv)
{
	if (argc == 2 && !strcmp(argv[1], "--bench"))
		return bench();
	return th_run(quant_suite());
}

/* test_sampler.c - greedy and seeded sampling. Every draw is seeded, so the frequency checks
 * are deterministic: they cannot flake, and their bounds (5 standard deviations) are loose
 * enough that any correct generator passes them for any seed. */
#include <check.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "services/gpu-runner/sampler.h"

#define DRAWS 20000

static struct sampler *make(float temperature, uint32_t top_k, float top_p, uint64_t seed, uint32_t vocab)
{
	struct sampler_params p = {.temperature = temperature, .top_k = top_k, .top_p = top_p, .seed = seed};
	struct sampler *s = sampler_create(&p, vocab);
	ck_assert_ptr_nonnull(s);
	return s;
}

static void softmax(const float *logits, uint32_t n, double temperature, double *p)
{
	double mx = -INFINITY, sum = 0;
	for (uint32_t i = 0; i < n; i++)
		if (logits[i] / temperature > mx)
			mx = logits[i] / temperature;
	for (uint32_t i = 0; i < n; i++)
		sum += p[i] = exp(logits[i] / temperature - mx);
	for (uint32_t i = 0; i < n; i++)
		p[i] /= sum;
}

/* Draws DRAWS tokens and checks every frequency against p within 5 sigma (+ 0.002). */
static void check_frequencies(struct sampler *s, const float *logits, const double *p, uint32_t n)
{
	uint32_t count[64] = {0};
	ck_assert_uint_le(n, 64);
	for (int d = 0; d < DRAWS; d++) {
		int32_t t = sampler_pick(s, logits);
		ck_assert(t >= 0 && (uint32_t)t < n);
		count[t]++;
	}
	for (uint32_t i = 0; i < n; i++) {
		double f = (double)count[i] / DRAWS, sigma = sqrt(p[i] * (1 - p[i]) / DRAWS);
		ck_assert_msg(fabs(f - p[i]) <= 5 * sigma + 0.002, "token %u: frequency %.4f, probability %.4f", i, f,
			      p[i]);
	}
}

static const float logits8[8] = {1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 0.0f, 2.5f, -2.0f};

START_TEST(test_greedy_is_argmax)
{
	float l[] = {0.1f, 5.0f, -3.0f, 5.0f, 4.9f};
	struct sampler *s = make(0.0f, 0, 0, 1, 5);
	ck_assert_int_eq(sampler_pick(s, l), 1); /* tie between 1 and 3: the lower id */
	sampler_destroy(&s);
	s = make(-1.0f, 40, 0.9f, 1, 5);
	ck_assert_int_eq(sampler_pick(s, l), 1);
	sampler_destroy(&s);
	ck_assert_ptr_null(s);
	sampler_destroy(&s); /* safe twice */
	s = make(0.0f, 0, 0, 1, 8);
	ck_assert_int_eq(sampler_pick(s, logits8), 4);
	sampler_destroy(&s);

	ck_assert_int_eq(argmax_f32(l, 5), 1);
	ck_assert_int_eq(argmax_f32(l, 1), 0);
	float nan_first[] = {NAN, -1.0f, 2.0f, 2.0f};
	ck_assert_int_eq(argmax_f32(nan_first, 4), 2);
	float all_neg[] = {-INFINITY, -7.0f, -7.0f};
	ck_assert_int_eq(argmax_f32(all_neg, 3), 1);
}
END_TEST

START_TEST(test_logits_not_modified)
{
	float l[8], copy[8];
	memcpy(l, logits8, sizeof(l));
	memcpy(copy, l, sizeof(l));
	struct sampler *s = make(0.7f, 3, 0.9f, 3, 8);
	for (int i = 0; i < 10; i++)
		sampler_pick(s, l);
	ck_assert_int_eq(memcmp(l, copy, sizeof(l)), 0);
	sampler_destroy(&s);
}
END_TEST

START_TEST(test_create_rejects_empty_vocab)
{
	struct sampler_params p = {.temperature = 1.0f};
	ck_assert_ptr_null(sampler_create(&p, 0));
}
END_TEST

START_TEST(test_same_seed_same_sequence)
{
	struct sampler *a = make(1.0f, 0, 0, 7, 8), *b = make(1.0f, 0, 0, 7, 8);
	for (int i = 0; i < 500; i++)
		ck_assert_int_eq(sampler_pick(a, logits8), sampler_pick(b, logits8));
	sampler_destroy(&a);
	sampler_destroy(&b);
	a = make(0.8f, 5, 0.9f, 12345, 8);
	b = make(0.8f, 5, 0.9f, 12345, 8);
	for (int i = 0; i < 500; i++)
		ck_assert_int_eq(sampler_pick(a, logits8), sampler_pick(b, logits8));
	sampler_destroy(&a);
	sampler_destroy(&b);
}
END_TEST

START_TEST(test_different_seeds_differ)
{
	float flat[16] = {0};
	struct sampler *a = make(1.0f, 0, 0, 7, 16), *b = make(1.0f, 0, 0, 8, 16);
	int same = 0;
	for (int i = 0; i < 200; i++)
		same += sampler_pick(a, flat) == sampler_pick(b, flat);
	/* Independent uniform draws over 16 tokens agree about 200/16 = 12.5 times. */
	ck_assert_int_lt(same, 50);
	sampler_destroy(&a);
	sampler_destroy(&b);
}
END_TEST

/* The generator is xoshiro256** seeded by splitmix64: pin its first draws so a change of
 * generator (which would change every seeded run) is caught. Under a flat 2^20-token
 * vocabulary, a pick is the top 20 bits of the 53-bit uniform, i.e. output >> 44. */
START_TEST(test_generator_pinned)
{
	uint32_t vocab = 1u << 20;
	float *flat = calloc(vocab, sizeof(float));
	ck_assert_ptr_nonnull(flat);
	struct sampler *s = make(1.0f, 0, 0, 0, vocab);
	/* Reference: splitmix64(0) seeds, xoshiro256** outputs, computed independently below. */
	uint64_t x = 0, st[4];
	for (int i = 0; i < 4; i++) {
		uint64_t z = (x += 0x9e3779b97f4a7c15ull);
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
		z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
		st[i] = z ^ (z >> 31);
	}
	for (int d = 0; d < 8; d++) {
		uint64_t r = st[1] * 5;
		r = ((r << 7) | (r >> 57)) * 9;
		uint64_t t = st[1] << 17;
		st[2] ^= st[0];
		st[3] ^= st[1];
		st[1] ^= st[2];
		st[0] ^= st[3];
		st[2] ^= t;
		st[3] = (st[3] << 45) | (st[3] >> 19);
		ck_assert_int_eq(sampler_pick(s, flat), (int32_t)(r >> 44));
	}
	sampler_destroy(&s);
	free(flat);
}
END_TEST

/* Infinite logits (a tiny repetition penalty, or the model): drawn among themselves alone, with
 * or without top-p and top-k; they made every weight NaN and the draw the last candidate. */
START_TEST(test_infinite_logits)
{
	float l[] = {0.5f, INFINITY, 1.0f, INFINITY, -1.0f, 3.0f};
	const float top_ps[] = {1.0f, 0.9f};
	const int32_t top_ks[] = {0, 4};
	for (int c = 0; c < 2; c++) {
		struct sampler *s = make(1.0f, top_ks[c], top_ps[c], 7, 6);
		int seen[6] = {0};
		for (int i = 0; i < 400; i++)
			seen[sampler_pick(s, l)]++;
		ck_assert_int_eq(seen[1] + seen[3], 400);
		ck_assert_int_gt(seen[1], 100);
		ck_assert_int_gt(seen[3], 100);
		sampler_destroy(&s);
	}
}
END_TEST

START_TEST(test_top_k_one_is_greedy)
{
	float l[] = {0.5f, 2.0f, 1.0f, 2.0f, -1.0f};
	struct sampler *s = make(1.5f, 1, 0, 99, 5);
	for (int i = 0; i < 200; i++)
		ck_assert_int_eq(sampler_pick(s, l), 1);
	sampler_destroy(&s);
}
END_TEST

START_TEST(test_samples_stay_in_top_k)
{
	enum { V = 1000, K = 5 };
	static float l[V];
	uint64_t x = 17;
	for (int i = 0; i < V; i++) {
		x = x * 6364136223846793005ull + 1442695040888963407ull;
		l[i] = (float)((x >> 40) % 1000) / 300.0f;
	}
	/* The top 5 by value, lower id on ties (the test's own order). */
	int top[K];
	for (int k = 0; k < K; k++) {
		int best = -1;
		for (int i = 0; i < V; i++) {
			int taken = 0;
			for (int j = 0; j < k; j++)
				taken |= top[j] == i;
			if (!taken && (best < 0 || l[i] > l[best]))
				best = i;
		}
		top[k] = best;
	}
	struct sampler *s = make(2.0f, K, 0, 5, V);
	int seen[K] = {0};
	for (int d = 0; d < 4000; d++) {
		int32_t t = sampler_pick(s, l);
		int in = -1;
		for (int k = 0; k < K; k++)
			if (top[k] == t)
				in = k;
		ck_assert_msg(in >= 0, "token %d (logit %g) is outside the top %d", t, (double)l[t], K);
		seen[in]++;
	}
	for (int k = 0; k < K; k++)
		ck_assert_int_gt(seen[k], 0);
	sampler_destroy(&s);

	/* top_k at or past the vocabulary size is off. */
	double p[8];
	softmax(logits8, 8, 1.0, p);
	s = make(1.0f, 8, 0, 6, 8);
	check_frequencies(s, logits8, p, 8);
	sampler_destroy(&s);
}
END_TEST

START_TEST(test_top_k_frequencies)
{
	/* top-k 3 of logits8 keeps ids 4 (3.0), 6 (2.5), 1 (2.0), renormalised. */
	double full[8], p[8] = {0};
	softmax(logits8, 8, 1.0, full);
	double mass = full[4] + full[6] + full[1];
	p[4] = full[4] / mass;
	p[6] = full[6] / mass;
	p[1] = full[1] / mass;
	struct sampler *s = make(1.0f, 3, 0, 11, 8);
	check_frequencies(s, logits8, p, 8);
	sampler_destroy(&s);
}
END_TEST

START_TEST(test_tiny_top_p_is_greedy)
{
	struct sampler *s = make(1.0f, 0, 1e-6f, 4, 8);
	for (int i = 0; i < 500; i++)
		ck_assert_int_eq(sampler_pick(s, logits8), 4);
	sampler_destroy(&s);
	float tie[] = {1.0f, 3.0f, 3.0f};
	s = make(1.0f, 0, 1e-6f, 4, 3);
	for (int i = 0; i < 100; i++)
		ck_assert_int_eq(sampler_pick(s, tie), 1);
	sampler_destroy(&s);
}
END_TEST

/* Top-p over a vocabulary of thousands, as sampler.c defines it and written here the plain way:
 * every candidate sorted (larger z first, lower id on ties), the head kept until its weight
 * reaches top_p of the total (summed in id order); ref_draw then walks the kept ids in id order. */
struct ref_nucleus {
	double *w;   /* (n) exp(z - max z) */
	bool *kept;  /* (n) */
	double mass; /* the kept weights' sum, in the order they were kept */
};
static const double *ref_z;
static int ref_by_z(const void *a, const void *b)
{
	int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
	if (ref_z[x] != ref_z[y])
		return ref_z[x] > ref_z[y] ? -1 : 1;
	return (x > y) - (x < y);
}

static struct ref_nucleus ref_top_p(const float *logits, uint32_t n, double temperature, double top_p)
{
	struct ref_nucleus r = {malloc(sizeof(double) * n), calloc(n, sizeof(bool)), 0};
	double *z = malloc(sizeof(double) * n);
	int32_t *idx = malloc(sizeof(int32_t) * n);
	ck_assert(r.w && r.kept && z && idx);
	double zmax = -INFINITY, total = 0;
	for (uint32_t i = 0; i < n; i++)
		zmax = fmax(zmax, z[i] = (double)logits[i] * (1.0 / temperature));
	for (uint32_t i = 0; i < n; i++)
		total += r.w[i] = exp(z[i] - zmax);
	for (uint32_t i = 0; i < n; i++)
		idx[i] = (int32_t)i;
	ref_z = z;
	qsort(idx, n, sizeof(*idx), ref_by_z);
	for (uint32_t k = 0; k < n;) {
		r.mass += r.w[idx[k]];
		r.kept[idx[k++]] = true;
		if (r.mass >= top_p * total)
			break;
	}
	free(z);
	free(idx);
	return r;
}

static int32_t ref_draw(const struct ref_nucleus *r, uint32_t n, double u)
{
	double target = u * r->mass, c = 0;
	int32_t last = -1;
	for (uint32_t id = 0; id < n; id++) {
		if (!r->kept[id])
			continue;
		last = (int32_t)id;
		c += r->w[id];
		if (target < c)
			break;
	}
	return last;
}

START_TEST(test_top_p_large_vocabulary)
{
	/* Peaked logits (a nucleus of a few tokens), spread ones (hundreds: the head grows) and flat
	 * ones (most of the vocabulary: every candidate sorted), distinct values so that no two tie. */
	const uint32_t n = 6000;
	float *l = malloc(sizeof(float) * n);
	ck_assert_ptr_nonnull(l);
	const float scales[3] = {40.0f, 6.0f, 0.05f};
	const float top_ps[3] = {0.5f, 0.9f, 0.99f};
	uint64_t x = 12345;
	for (int sc = 0; sc < 3; sc++) {
		for (uint32_t i = 0; i < n; i++) {
			x = x * 6364136223846793005ull + 1442695040888963407ull;
			l[i] = scales[sc] * (float)((double)(x >> 11) / 9007199254740992.0) + 1e-6f * (float)i;
		}
		for (int tp = 0; tp < 3; tp++) {
			struct sampler *s = make(0.8f, 0, top_ps[tp], 1, n);
			struct ref_nucleus r = ref_top_p(l, n, (double)0.8f, (double)top_ps[tp]);
			for (int d = 0; d < 50; d++) {
				const double u = (d + 0.5) / 50.0;
				ck_assert_int_eq(sampler_pick_u(s, l, u), ref_draw(&r, n, u));
			}
			free(r.w);
			free(r.kept);
			sampler_destroy(&s);
		}
	}
	free(l);
}
END_TEST

START_TEST(test_top_p_nucleus)
{
	/* Probabilities 0.5, 0.3, 0.15, 0.05 (as logs): top_p 0.75 keeps {0, 1} (0.5 < 0.75 <= 0.8). */
	float l[4] = {logf(0.5f), logf(0.3f), logf(0.15f), logf(0.05f)};
	double p[4] = {0.5 / 0.8, 0.3 / 0.8, 0, 0};
	struct sampler *s = make(1.0f, 0, 0.75f, 21, 4);
	check_frequencies(s, l, p, 4);
	sampler_destroy(&s);
	/* top_p 0.85 keeps {0, 1, 2}. */
	double p3[4] = {0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0};
	s = make(1.0f, 0, 0.85f, 22, 4);
	check_frequencies(s, l, p3, 4);
	sampler_destroy(&s);
	/* top_p 1 is off. */
	double p4[4] = {0.5, 0.3, 0.15, 0.05};
	s = make(1.0f, 0, 1.0f, 23, 4);
	check_frequencies(s, l, p4, 4);
	sampler_destroy(&s);
}
END_TEST

START_TEST(test_min_p)
{
	/* Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps what is at least 0.25 likely: {0, 1}. */
	float l[4] = {logf(0.5f), logf(0.3f), logf(0.15f), logf(0.05f)};
	struct sampler_params sp = {.temperature = 1.0f, .seed = 31, .min_p = 0.5f};
	struct sampler *s = sampler_create(&sp, 4);
	ck_assert_ptr_nonnull(s);
	double p[4] = {0.5 / 0.8, 0.3 / 0.8, 0, 0};
	check_frequencies(s, l, p, 4);
	sampler_destroy(&s);
	/* min_p 0.25 keeps {0, 1, 2} (0.15 >= 0.125), unsorted candidates included. */
	sp.min_p = 0.25f;
	sp.seed = 32;
	s = sampler_create(&sp, 4);
	double p3[4] = {0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0};
	check_frequencies(s, l, p3, 4);
	sampler_destroy(&s);
	/* min_p of 1 or more keeps the likeliest alone; with top-k first, on what top-k left. */
	sp.min_p = 2.0f;
	sp.top_k = 3;
	s = sampler_create(&sp, 4);
	for (int i = 0; i < 200; i++)
		ck_assert_int_eq(sampler_pick(s, l), 0);
	sampler_destroy(&s);
}
END_TEST

START_TEST(test_frequencies_temperature_one)
{
	double p[8];
	softmax(logits8, 8, 1.0, p);
	struct sampler *s = make(1.0f, 0, 0, 2024, 8);
	check_frequencies(s, logits8, p, 8);
	sampler_destroy(&s);
}
END_TEST

START_TEST(test_temperature_scaling)
{
	static const float temps[] = {0.5f, 1.0f, 2.0f};
	double top_freq[3];
	for (int k = 0; k < 3; k++) {
		double p[8];
		softmax(logits8, 8, temps[k], p);
		struct sampler *s = make(temps[k], 0, 0, 77 + (uint64_t)k, 8);
		check_frequencies(s, logits8, p, 8);
		sampler_destroy(&s);
		s = make(temps[k], 0, 0, 500 + (uint64_t)k, 8);
		int hits = 0;
		for (int d = 0; d < DRAWS; d++)
			hits += sampler_pick(s, logits8) == 4;
		top_freq[k] = (double)hits / DRAWS;
		sampler_destroy(&s);
	}
	/* Colder is sharper: the most likely token (p = 0.65, 0.44, 0.29) gets ever fewer draws. */
	ck_assert(top_freq[0] > top_freq[1] + 0.1);
	ck_assert(top_freq[1] > top_freq[2] + 0.1);
}
END_TEST

/* A request's temperature under SAMPLER_GREEDY_BELOW is greedy (1 / T overflows float32 where a
 * backend scales on the device); from it on, the temperature as given. */
START_TEST(test_tiny_temperature_is_greedy)
{
	ck_assert(sampler_temperature(1e-39) == 0.0f);
	ck_assert(sampler_temperature(1e-7) == 0.0f);
	ck_assert(sampler_temperature(0) == 0.0f);
	ck_assert(sampler_temperature(1e-6) == (float)1e-6);
	ck_assert(sampler_temperature(0.8) == 0.8f);
	/* Its float32 reciprocal is finite, and so is a large logit scaled by it. */
	float inv_t = 1.0f / sampler_temperature(SAMPLER_GREEDY_BELOW);
	ck_assert(isfinite(inv_t) && isfinite(1e30f * inv_t));
}
END_TEST

START_TEST(test_masked_tokens_never_drawn)
{
	float l[6] = {-INFINITY, 1.0f, NAN, 1.0f, -INFINITY, 0.0f};
	struct sampler *s = make(1.0f, 0, 0, 8, 6);
	for (int i = 0; i < 2000; i++) {
		int32_t t = sampler_pick(s, l);
		ck_assert(t == 1 || t == 3 || t == 5);
	}
	sampler_destroy(&s);
	float none[3] = {-INFINITY, -INFINITY, -INFINITY};
	s = make(1.0f, 2, 0.5f, 8, 3);
	ck_assert_int_eq(sampler_pick(s, none), 0);
	sampler_destroy(&s);
}
END_TEST

/* A resumed request skips the draws of the tokens it already has: the picks after skipping n are
 * those after picking n, for every kind of sampling; greedy draws nothing. */
/* A pick with a uniform drawn ahead (sampler_next_uniform, then sampler_pick_u) is the pick that
 * draws it: the runner draws a step's uniform ahead and uses it on the host or the device. */
START_TEST(test_pick_u_matches_pick)
{
	static const struct sampler_params kinds[] = {
		{.temperature = 1.0f, .seed = 7},
		{.temperature = 0.7f, .top_k = 5, .top_p = 0.9f, .seed = 11},
		{.temperature = 1.3f, .min_p = 0.05f, .seed = 12},
	};
	for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
		struct sampler *a = sampler_create(&kinds[k], 8), *b = sampler_create(&kinds[k], 8);
		ck_assert(a && b);
		int differ = 0;
		for (int i = 0; i < 500; i++) {
			double u = sampler_next_uniform(b);
			int32_t want = sampler_pick(a, logits8);
			ck_assert_int_eq(sampler_pick_u(b, logits8, u), want);
			/* and another uniform gives other tokens */
			differ += sampler_pick_u(b, logits8, u < 0.5 ? u + 0.5 : u - 0.5) != want;
		}
		ck_assert_int_gt(differ, 0);
		/* sampler_pick_u draws nothing: the generators are still in step. */
		ck_assert(sampler_next_uniform(a) == sampler_next_uniform(b));
		sampler_destroy(&a);
		sampler_destroy(&b);
	}
}
END_TEST

START_TEST(test_skip_matches_picks)
{
	static const struct sampler_params kinds[] = {
		{.temperature = 1.0f, .seed = 7},
		{.temperature = 0.7f, .top_k = 5, .top_p = 0.9f, .seed = 11},
		{.temperature = 1.3f, .min_p = 0.05f, .seed = 12},
	};
	for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
		for (uint64_t n = 0; n < 40; n += 13) {
			struct sampler *a = sampler_create(&kinds[k], 8), *b = sampler_create(&kinds[k], 8);
			ck_assert(a && b);
			for (uint64_t i = 0; i < n; i++)
				sampler_pick(a, logits8);
			sampler_skip(b, n);
			for (int i = 0; i < 500; i++)
				ck_assert_int_eq(sampler_pick(a, logits8), sampler_pick(b, logits8));
			ck_assert(sampler_next_uniform(a) == sampler_next_uniform(b));
			sampler_destroy(&a);
			sampler_destroy(&b);
		}
	}
	/* Skipping moves the generator: one skipped draw shifts the picks. */
	struct sampler *a = make(1.0f, 0, 0, 7, 8), *b = make(1.0f, 0, 0, 7, 8);
	sampler_skip(b, 1);
	int same = 0;
	for (int i = 0; i < 500; i++)
		same += sampler_pick(a, logits8) == sampler_pick(b, logits8);
	ck_assert_int_lt(same, 500);
	sampler_destroy(&a);
	sampler_destroy(&b);
	/* Greedy draws nothing: skipping leaves its uniforms where they were. */
	a = make(0.0f, 0, 0, 7, 8);
	b = make(0.0f, 0, 0, 7, 8);
	sampler_skip(b, 5);
	ck_assert(sampler_next_uniform(a) == sampler_next_uniform(b));
	sampler_destroy(&a);
	sampler_destroy(&b);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("sampler");
	TCase *tc = tcase_create("greedy");
	tcase_add_test(tc, test_greedy_is_argmax);
	tcase_add_test(tc, test_logits_not_modified);
	tcase_add_test(tc, test_create_rejects_empty_vocab);
	suite_add_tcase(s, tc);
	tc = tcase_create("seeding");
	tcase_add_test(tc, test_same_seed_same_sequence);
	tcase_add_test(tc, test_different_seeds_differ);
	tcase_add_test(tc, test_generator_pinned);
	tcase_add_test(tc, test_skip_matches_picks);
	tcase_add_test(tc, test_pick_u_matches_pick);
	suite_add_tcase(s, tc);
	tc = tcase_create("top_k");
	tcase_add_test(tc, test_top_k_one_is_greedy);
	tcase_add_test(tc, test_samples_stay_in_top_k);
	tcase_add_test(tc, test_top_k_frequencies);
	suite_add_tcase(s, tc);
	tc = tcase_create("top_p");
	tcase_add_test(tc, test_tiny_top_p_is_greedy);
	tcase_add_test(tc, test_top_p_nucleus);
	tcase_add_test(tc, test_top_p_large_vocabulary);
	tcase_add_test(tc, test_min_p);
	suite_add_tcase(s, tc);
	tc = tcase_create("distribution");
	tcase_add_test(tc, test_frequencies_temperature_one);
	tcase_add_test(tc, test_temperature_scaling);
	tcase_add_test(tc, test_tiny_temperature_is_greedy);
	tcase_add_test(tc, test_masked_tokens_never_drawn);
	tcase_add_test(tc, test_infinite_logits);
	suite_add_tcase(s, tc);

	SRunner *sr = srunner_create(s);
	srunner_set_fork_status(sr, CK_FORK);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

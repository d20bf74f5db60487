/* sampler.c - greedy and seeded temperature / top-k / top-p sampling (see sampler.h).
 *
 * Determinism: the generator is xoshiro256** seeded through splitmix64, every ordering of
 * candidates is a total order (probability descending, then token id ascending), and the draw
 * walks the kept tokens in id order (as the CUDA backend's draw on the device does), so the same
 * seed and logits give the same tokens on every machine and on either side of the bus. (exp() is libm's: two libms that
 * differ in the last bit could only disagree on a draw landing exactly on a boundary.) */
#include "services/gpu-runner/sampler.h"

#include <assert.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

struct sampler {
	struct sampler_params p;
	uint32_t vocab;
	uint64_t s[4];	/* xoshiro256** state */
	double *z;	/* (vocab) scaled logits, then unnormalised probabilities, by token id */
	int32_t *idx;	/* (vocab) candidate token ids */
	int32_t *tmp;	/* (vocab) merge-sort scratch */
};

static uint64_t splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

static uint64_t xoshiro_next(uint64_t s[4])
{
	uint64_t result = rotl(s[1] * 5, 7) * 9;
	uint64_t t = s[1] << 17;
	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl(s[3], 45);
	return result;
}

/* Uniform double in [0, 1): the top 53 bits. */
static double uniform01(uint64_t s[4])
{
	return (double)(xoshiro_next(s) >> 11) * 0x1.0p-53;
}

struct sampler *sampler_create(const struct sampler_params *p, uint32_t vocab)
{
	assert(p);
	if (vocab == 0 || vocab > INT32_MAX)
		return NULL;
	struct sampler *s = calloc(1, sizeof(*s));
	if (!s)
		return NULL;
	s->p = *p;
	s->vocab = vocab;
	uint64_t x = p->seed;
	for (int i = 0; i < 4; i++)
		s->s[i] = splitmix64(&x);
	s->z = malloc((size_t)vocab * sizeof(*s->z));
	s->idx = malloc((size_t)vocab * sizeof(*s->idx));
	s->tmp = malloc((size_t)vocab * sizeof(*s->tmp));
	if (!s->z || !s->idx || !s->tmp)
		sampler_destroy(&s);
	return s;
}

void sampler_destroy(struct sampler **sp)
{
	struct sampler *s = *sp;
	if (!s)
		return;
	free(s->z);
	free(s->idx);
	free(s->tmp);
	free(s);
	*sp = NULL;
}

double sampler_next_uniform(struct sampler *s)
{
	return uniform01(s->s);
}

void sampler_skip(struct sampler *s, uint64_t n)
{
	if (!(s->p.temperature > 0.0f))
		return;
	for (uint64_t i = 0; i < n; i++)
		xoshiro_next(s->s);
}

const struct sampler_params *sampler_params_of(const struct sampler *s)
{
	return &s->p;
}

int32_t argmax_f32(const float *v, uint32_t n)
{
	int32_t best = -1;
	float bv = 0;
	for (uint32_t i = 0; i < n; i++) {
		if (isnan(v[i]))
			continue;
		if (best < 0 || v[i] > bv) {
			best = (int32_t)i;
			bv = v[i];
		}
	}
	return best < 0 ? 0 : best;
}

/* The total order of candidates: larger value first, lower id on ties. */
static inline bool before(const double *z, int32_t a, int32_t b)
{
	return z[a] > z[b] || (z[a] == z[b] && a < b);
}

/* Sorts a[0..n) by `before`, using tmp (n entries). Bottom-up merge sort: O(n log n) always. */
static void sort_candidates(int32_t *a, int32_t *tmp, uint32_t n, const double *z)
{
	int32_t *src = a, *dst = tmp;
	for (size_t width = 1; width < n; width *= 2) {
		for (size_t lo = 0; lo < n; lo += 2 * width) {
			size_t mid = lo + width < n ? lo + width : n;
			size_t hi = lo + 2 * width < n ? lo + 2 * width : n;
			size_t i = lo, j = mid, k = lo;
			while (i < mid && j < hi)
				dst[k++] = before(z, src[j], src[i]) ? src[j++] : src[i++];
			while (i < mid)
				dst[k++] = src[i++];
			while (j < hi)
				dst[k++] = src[j++];
		}
		int32_t *t = src;
		src = dst;
		dst = t;
	}
	if (src != a)
		memcpy(a, src, (size_t)n * sizeof(*a));
}

/* Heap helpers for top-k selection: a min-heap under `before`, the root being the candidate
 * that would leave first. */
static void heap_down(int32_t *h, uint32_t n, uint32_t i, const double *z)
{
	for (;;) {
		uint32_t l = 2 * i + 1, r = l + 1, w = i;
		if (l < n && before(z, h[w], h[l]))
			w = l;
		if (r < n && before(z, h[w], h[r]))
			w = r;
		if (w == i)
			return;
		int32_t t = h[i];
		h[i] = h[w];
		h[w] = t;
		i = w;
	}
}

static void heap_up(int32_t *h, uint32_t i, const double *z)
{
	while (i > 0) {
		uint32_t parent = (i - 1) / 2;
		if (!before(z, h[parent], h[i]))
			return;
		int32_t t = h[i];
		h[i] = h[parent];
		h[parent] = t;
		i = parent;
	}
}

/* The k best ids under `before`, sorted, into s->idx[0..k). */
static void select_top_k(struct sampler *s, uint32_t k)
{
	int32_t *h = s->idx;
	uint32_t n = 0;
	for (uint32_t i = 0; i < s->vocab; i++) {
		int32_t id = (int32_t)i;
		if (n < k) {
			h[n] = id;
			heap_up(h, n++, s->z);
		} else if (before(s->z, id, h[0])) {
			h[0] = id;
			heap_down(h, n, 0, s->z);
		}
	}
	sort_candidates(h, s->tmp, k, s->z);
}

static int by_id(const void *a, const void *b)
{
	int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
	return (x > y) - (x < y);
}

/* idx[0..n) (distinct ids) into ascending id order: a sort when few, else one pass over the
 * vocabulary with tmp as a mark per id. */
static void ids_ascending(struct sampler *s, uint32_t n)
{
	if (n <= 4096 || n < s->vocab / 16) {
		qsort(s->idx, n, sizeof(*s->idx), by_id);
		return;
	}
	memset(s->tmp, 0, sizeof(*s->tmp) * s->vocab);
	for (uint32_t i = 0; i < n; i++)
		s->tmp[s->idx[i]] = 1;
	uint32_t k = 0;
	for (uint32_t id = 0; id < s->vocab; id++)
		if (s->tmp[id])
			s->idx[k++] = (int32_t)id;
}

/* Top-p without top-k: the nucleus is the head of the order (`before`), usually a small part of a
 * large vocabulary, so the best k are selected and sorted (k = 64, then 8 times more while their
 * weights fall short of top_p of the total; all of them at worst) rather than the whole
 * vocabulary sorted at every token. Leaves the head in s->idx[0..n) and returns n; *total is the
 * weights' sum exp(z - max z) over every candidate, in id order. */
static uint32_t nucleus_head(struct sampler *s, double top_p, double *total)
{
	const double *z = s->z;
	double zmax = -INFINITY;
	for (uint32_t i = 0; i < s->vocab; i++)
		if (z[i] > zmax)
			zmax = z[i];
	if (zmax == -INFINITY) { /* nothing to weigh: the first in the order is picked */
		*total = 0;
		select_top_k(s, 1);
		return 1;
	}
	double sum = 0;
	for (uint32_t i = 0; i < s->vocab; i++)
		sum += exp(z[i] - zmax);
	*total = sum;
	const double need = top_p * sum;
	for (uint64_t k = 64; k < s->vocab; k *= 8) {
		select_top_k(s, (uint32_t)k);
		double cum = 0;
		for (uint32_t i = 0; i < k; i++) {
			cum += exp(z[s->idx[i]] - zmax);
			if (cum >= need)
				return (uint32_t)k;
		}
	}
	for (uint32_t i = 0; i < s->vocab; i++)
		s->idx[i] = (int32_t)i;
	sort_candidates(s->idx, s->tmp, s->vocab, z);
	return s->vocab;
}

static int32_t pick(struct sampler *s, const float *logits, const double *u);

int32_t sampler_pick(struct sampler *s, const float *logits)
{
	return pick(s, logits, NULL);
}

int32_t sampler_pick_u(struct sampler *s, const float *logits, double u)
{
	return pick(s, logits, &u);
}

/* u: the draw to use (NULL: the generator's next). */
static int32_t pick(struct sampler *s, const float *logits, const double *u)
{
	assert(s && logits);
	const struct sampler_params *p = &s->p;
	if (!(p->temperature > 0.0f))
		return argmax_f32(logits, s->vocab);

	double *z = s->z;
	double inv_t = 1.0 / (double)p->temperature;
	for (uint32_t i = 0; i < s->vocab; i++)
		z[i] = isnan(logits[i]) ? -INFINITY : (double)logits[i] * inv_t;

	bool top_p = p->top_p > 0.0f && p->top_p < 1.0f;
	bool sorted = false;
	uint32_t n = s->vocab;
	double total = -1; /* every candidate's weight summed, where only the nucleus's head is kept below */
	if (p->top_k > 0 && p->top_k < s->vocab) {
		n = p->top_k;
		select_top_k(s, n);
		sorted = true;
	} else if (top_p) {
		n = nucleus_head(s, (double)p->top_p, &total);
		sorted = true;
	} else {
		for (uint32_t i = 0; i < n; i++)
			s->idx[i] = (int32_t)i;
	}

	double zmax = -INFINITY;
	if (sorted) {
		zmax = z[s->idx[0]];
	} else {
		for (uint32_t i = 0; i < n; i++)
			if (z[i] > zmax)
				zmax = z[i];
	}
	if (zmax == -INFINITY) /* every candidate is -inf or NaN: nothing to weigh */
		return s->idx[0];

	/* Softmax with the maximum subtracted; probabilities stay unnormalised (divided by sum below).
	 * An infinite maximum (a logit divided by a tiny repetition penalty, or the model's own):
	 * those candidates alone, equally (inf - inf would make every weight NaN, and the draw the
	 * last candidate whatever it was). */
	double sum = 0;
	for (uint32_t i = 0; i < n; i++) {
		int32_t id = s->idx[i];
		z[id] = zmax == INFINITY ? (z[id] == INFINITY ? 1.0 : 0.0) : exp(z[id] - zmax);
		sum += z[id];
	}
	if (top_p) {
		double need = (double)p->top_p * (total >= 0 ? total : sum), cum = 0;
		uint32_t keep = 0;
		while (keep < n) {
			cum += z[s->idx[keep++]];
			if (cum >= need)
				break;
		}
		n = keep;
		sum = cum;
	}

	/* min-p: weights are exp(z - zmax), so the likeliest weighs 1 and the bar is min_p itself. */
	double floor_w = p->min_p > 0.0f ? (p->min_p < 1.0f ? (double)p->min_p : 1.0) : 0.0;
	if (floor_w > 0) {
		sum = 0;
		for (uint32_t i = 0; i < n; i++)
			if (z[s->idx[i]] >= floor_w)
				sum += z[s->idx[i]];
	}
	/* The draw walks the kept tokens in id order, as a backend drawing where the logits are does
	 * (backend.h, logits_sample): a request gives the same tokens whichever of the two draws. */
	if (sorted)
		ids_ascending(s, n);
	double target = (u ? *u : uniform01(s->s)) * sum, cum = 0;
	int32_t last = s->idx[0];
	for (uint32_t i = 0; i < n; i++) {
		if (z[s->idx[i]] < floor_w)
			continue;
		last = s->idx[i];
		cum += z[last];
		if (target < cum)
			return last;
	}
	return last; /* target fell past the rounded total */
}

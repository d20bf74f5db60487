/* sampler.h - picks the next token from logits: greedy, or seeded temperature / top-k /
 * top-p sampling. The same seed and logits give the same tokens on every machine (the
 * generator is xoshiro256** seeded through splitmix64; no libc rand).
 *
 *   struct sampler *s = sampler_create(&(struct sampler_params){.temperature = 0.8f, .top_k = 40,
 *                                                              .top_p = 0.95f, .seed = 7}, vocab);
 *   int32_t tok = sampler_pick(s, logits);      // logits: vocab floats, left as they are
 *   sampler_destroy(&s);
 *
 * Order of operations (as in transformers' generate): temperature scaling, top-k, softmax,
 * top-p (keep the smallest set of most likely tokens whose mass reaches top_p, at least one),
 * min-p (drop tokens less likely than min_p times the likeliest), draw (a uniform times the kept
 * mass, the kept tokens summed in id order: the draw a backend makes on the device too). A repetition penalty
 * is a logits processor that comes before all of this (generate.c applies it). temperature <= 0 means greedy (argmax; the lowest id wins a tie). */
#ifndef GPU_RUNNER_SAMPLER_H
#define GPU_RUNNER_SAMPLER_H
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

struct sampler_params {
	float temperature; /* <= 0: greedy */
	uint32_t top_k;	   /* 0: off */
	float top_p;	   /* >= 1 or <= 0: off */
	uint64_t seed;
	float min_p;	   /* keep tokens at least min_p times as likely as the likeliest; <= 0: off */
};

struct sampler;

/* Temperatures below this are greedy (sampler_temperature): 1 / T in float32, as a backend
 * scales the logits on the device, overflows for T under about 3e-39, and a logit of 100 scaled
 * by 1 / T does under 3e-37; the host's double would still draw. Below 1e-6 the draw is the
 * greedy pick anyway, but for logits closer together than a millionth of their size. */
#define SAMPLER_GREEDY_BELOW 1e-6

/* A request's temperature as sampler_params take it: 0 (greedy) below SAMPLER_GREEDY_BELOW, so
 * that host and device pick alike. */
static inline float sampler_temperature(double t)
{
	return t < SAMPLER_GREEDY_BELOW ? 0.0f : (float)t;
}

/* Returns NULL on allocation failure or vocab == 0. */
struct sampler *sampler_create(const struct sampler_params *p, uint32_t vocab);
void sampler_destroy(struct sampler **s);
/* Returns the chosen token id. logits is not modified. */
int32_t sampler_pick(struct sampler *s, const float *logits);
/* The same with the uniform u in [0, 1) (from sampler_next_uniform) instead of the generator's
 * next draw: the token a backend drawing with u where the logits are picks (up to rounding). */
int32_t sampler_pick_u(struct sampler *s, const float *logits, double u);
/* The next uniform draw in [0, 1) from s's generator: what sampler_pick would use, for a
 * backend that draws where the logits are (backend.h, logits_sample). */
double sampler_next_uniform(struct sampler *s);
/* Advances s's generator past the draws of n sampled tokens, as if sampler_pick had picked n
 * tokens (each pick draws one uniform, or none when greedy): a resumed request continues with
 * the draws an uninterrupted run would make. */
void sampler_skip(struct sampler *s, uint64_t n);
const struct sampler_params *sampler_params_of(const struct sampler *s);

/* Index of the largest value (lowest index on ties). */
int32_t argmax_f32(const float *v, uint32_t n);

#ifdef __cplusplus
}
#endif
#endif

/* kernels.h - scalar kernels of the C reference backend, rounded as transformers' float32
 * computation rounds (backend_ref.c says why each sum runs in double). Every output is
 * computed by one call in a fixed order, so results are bit-identical for any thread count.
 */
#ifndef GPU_RUNNER_CPU_KERNELS_H
#define GPU_RUNNER_CPU_KERNELS_H
#include <stdbool.h>
#include <stdint.h>

#include "common/dtype.h"
#ifdef __cplusplus
extern "C" {
#endif

/* sum a[i] * b[i] over n, in double (float products are exact in double). */
double cpu_dot_f32(const float *a, const float *b, uint32_t n);
/* transformers LlamaRMSNorm in float32: out = w * (x * rsqrt(mean(x^2) + eps)); w is dim
 * elements of enum dtype wt. */
void cpu_rmsnorm(float *out, const float *x, const void *w, uint32_t wt, uint32_t dim, float eps);
/* silu(g) * u as torch rounds it: silu to float32, then the float32 product. */
float cpu_silu_mul(float g, float u);
/* cos and sin of position pos for each of half frequencies inv (the float32 angle pos * inv). */
void cpu_rope_cos_sin(const float *inv, uint32_t half, uint32_t pos, float *cs, float *sn);
/* Rotates one head of 2 * half dimensions in rotate_half layout: pairs (x[i], x[i + half]). */
void cpu_rope_apply(float *x, const float *cs, const float *sn, uint32_t half);
/* The same rotation in GGUF's layout (ROPE_ADJACENT): pairs (x[2i], x[2i + 1]). */
void cpu_rope_apply_adjacent(float *x, const float *cs, const float *sn, uint32_t half);
/* The routing of one token in a mixture-of-experts layer, as transformers' MixtralSparseMoeBlock and
 * Qwen3MoeSparseMoeBlock compute it: the softmax in float32 over all n router logits, the k largest
 * probabilities (ties: the lower expert id first), renormalised to sum to 1 when norm (the float32
 * sum of the k, each divided by it). Writes the chosen experts' ids to ids and weights to w, largest
 * first. k <= n. */
void cpu_moe_route(const float *logits, uint32_t n, uint32_t k, bool norm, uint32_t *ids, float *w);

#ifdef __cplusplus
}
#endif
#endif

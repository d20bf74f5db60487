/* kernels.h - scalar kernels of the C reference backend, rounded as transformers' float32
 * computation rounds (backend_ref.c says why each sum runs in double). Every output is
 * computed by one call in a fixed order, so results are bit-identical for any thread count.
 */
#ifndef GPU_RUNNER_CPU_KERNELS_H
#define GPU_RUNNER_CPU_KERNELS_H
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
/* The same rotation with adjacent pairs (x[2i], x[2i + 1]) (ROPE_ADJACENT: GGUF's wq/wk rows). */
void cpu_rope_apply_adjacent(float *x, const float *cs, const float *sn, uint32_t half);

#ifdef __cplusplus
}
#endif
#endif

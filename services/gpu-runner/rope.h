/* rope.h - the RoPE inverse frequencies of a model, bit for bit as transformers computes them.
 *
 * One implementation for every backend: the C reference and the CUDA backend must agree on
 * these bits (positions reach 131072, where one ulp of a frequency moves the angle visibly).
 *
 *   float inv[head_dim / 2];
 *   rc = rope_inv_freq(cfg, inv, err, sizeof(err));
 */
#ifndef GPU_RUNNER_ROPE_H
#define GPU_RUNNER_ROPE_H
#include <stddef.h>

#include "common/model.h"
#ifdef __cplusplus
extern "C" {
#endif

/* Fills inv[0 .. head_dim/2) (see rope.c for the float32 steps). Returns 0, or -EINVAL with a
 * message for parameters that give no finite frequencies. */
int rope_inv_freq(const struct model_config *cfg, float *inv, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif

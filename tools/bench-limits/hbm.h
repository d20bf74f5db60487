/* hbm.h - the device memory (HBM) bandwidth measurements of bench-limits, in hbm.cu.
 *
 * Both run on the current device, take `bytes` of device memory per buffer (hbm_read one buffer,
 * hbm_copy two) for the duration of the call, and return bytes per second, the best of `reps`
 * timed passes, or a negative value (-1) when a CUDA call failed (the message on stderr). */
#ifndef PIPELINE_BENCH_LIMITS_HBM_H
#define PIPELINE_BENCH_LIMITS_HBM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Rate of a kernel that reads every byte of a `bytes` buffer once per pass with 16-byte loads and
 * reduces them to one word: what a GEMV over weights that are all in device memory can approach. */
double hbm_read(size_t bytes, int reps);

/* Rate of cudaMemcpyAsync device to device of `bytes`, counted as read plus write (2 * bytes). */
double hbm_copy(size_t bytes, int reps);

#ifdef __cplusplus
}
#endif

#endif

/* ref_test.h - a hook of the C reference backend for tests (cf. cuda/cuda_test.h). */
#ifndef GPU_RUNNER_CPU_REF_TEST_H
#define GPU_RUNNER_CPU_REF_TEST_H

#include <stddef.h>
#include <stdint.h>

struct backend;

/* The nth split FFN's CPU share from now (1: the next) fails after its first part's work: the step
 * fails with "cpu backend: ffn: the CPU share failed: an injected failure ...", as a worker's
 * error would; 0 clears it. -EINVAL (err says why) for another backend or one with no CPU pool. */
int backend_ref_test_fail_cpu_share(struct backend *be, uint32_t nth, char *err, size_t errlen);

#endif

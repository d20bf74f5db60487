/* memory_source.h - a weight source (services/gpu-runner/weights.h) over a whole checkpoint
 * read into memory, each group laid out as its slot would be in the weight ring: what run-local
 * computes from, and what tests that drive the engine without services use.
 *
 *   struct memory_source *ms;
 *   rc = memory_source_create(manifest, &ms, err, sizeof(err));   // reads every group
 *   if (backend_weight_place(be) == PLACE_DEVICE) rc = memory_source_to_device(ms, err, sizeof(err));
 *   engine_create(cfg, be, memory_source_base(ms), kv, ...);
 *   memory_source_destroy(&ms);
 */
#ifndef TOOLS_RUN_LOCAL_MEMORY_SOURCE_H
#define TOOLS_RUN_LOCAL_MEMORY_SOURCE_H
#include <stddef.h>

#include "common/manifest.h"
#include "services/gpu-runner/weights.h"

struct memory_source;

/* Reads every group of m (borrowed: it must outlive the source). Returns 0, or -errno with a
 * message in err naming the file. */
int memory_source_create(const struct manifest *m, struct memory_source **out, char *err, size_t errlen);
/* Copies every group into device memory (the CUDA backend's place, backend_weight_place), once:
 * the weights are then given at PLACE_DEVICE as well as PLACE_HOST. Returns 0, or -ENOMEM / -EIO
 * with a message (how much did not fit), -ENOTSUP in a build without CUDA. */
int memory_source_to_device(struct memory_source *ms, char *err, size_t errlen);
void memory_source_destroy(struct memory_source **ms);
struct weight_source *memory_source_base(struct memory_source *ms);

#endif

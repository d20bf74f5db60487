/* ring.h - lays out the weight ring (common/weight_ring.h) for a manifest and a plan.
 *
 *   struct shm_object *o;
 *   rc = ring_create(name, m, p, &o, err, sizeof(err));    // created, laid out, ready
 *   struct wring_header *h = shm_object_base(o);
 *   ...
 *   shm_object_close(&o, true);                               // unmap and unlink
 *
 * or, in memory of one's own (tests, tools): ring_memsize() then ring_init(). Every table and
 * slot offset is counted from the base; slot data starts 4 KiB aligned (what O_DIRECT reads
 * into). Slots start EMPTY with seq 0; group states say which groups the plan pins. */
#ifndef SSD_LOADER_RING_H
#define SSD_LOADER_RING_H
#include <stddef.h>
#include <stdint.h>

#include "common/manifest.h"
#include "common/shm.h"
#include "common/weight_ring.h"
#include "services/ssd-loader/plan.h"
#ifdef __cplusplus
extern "C" {
#endif

/* Bytes the ring of m under plan p takes: header, tables and slot data. */
uint64_t ring_memsize(const struct manifest *m, const struct plan *p);

/* Lays out the ring in mem (ring_memsize bytes, 4 KiB aligned, zeroed), leaving the
 * struct shm_header at its start as it is. m and p are read during the call only. */
void ring_init(void *mem, uint64_t size, const struct manifest *m, const struct plan *p);

/* Creates the shared-memory object name (SHM_RECLAIM: a dead instance's leftover is
 * replaced) and lays it out; the caller fills in what the header's plan figures say that the
 * layout does not (disk_bytes_per_token, disk_bytes_per_s) and then marks it ready
 * (shm_object_set_ready), so that nothing attached sees them unset. Returns 0 with *out owned by
 * the caller; -EBUSY when a live process owns name; -ENOSPC where shared memory has no room for
 * it; other -errno; err says what went wrong. */
int ring_create(const char *name, const struct manifest *m, const struct plan *p, struct shm_object **out,
		char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif

/* spill_internal.h - what the spill file (spill.c) offers its tests beyond spill.h: spill_open
 * with the open(2) it uses passed in, so a test can make the filesystem refuse O_DIRECT or
 * open the file read-only (the buffered fallback and failed writes cannot otherwise be reached
 * on a filesystem that takes O_DIRECT). Not for the kv-store's own code: it calls spill_open.
 */
#ifndef PIPELINE_KVSTORE_SPILL_INTERNAL_H
#define PIPELINE_KVSTORE_SPILL_INTERNAL_H
#include <sys/types.h>

#include "services/kv-store/spill.h"

/* open(2) as spill_open calls it: returns a descriptor, or -1 with errno set. */
typedef int (*spill_open_fn)(const char *path, int flags, mode_t mode);

/* spill_open, with every open of the file going through open_fn. Same returns as spill_open. */
int spill_open_with(spill_open_fn open_fn, const char *path, uint64_t block_bytes, uint32_t n_slots,
		    uint32_t io_depth, enum spill_open_mode mode, struct spill **out, char *err, size_t errlen);

#endif

/* calibrate.h - the disk's read bandwidth, measured at start so the runner can predict how
 * long a token takes when the DRAM tier streams (docs/architecture.md: limits to measure against).
 *
 *   double bps;
 *   rc = calibrate_disk(path, buf, buf_bytes, 256u << 20, 64, &bps, err, sizeof(err));
 *
 * Reads up to max_bytes of path with O_DIRECT (buffered where the file system refuses it: then
 * the figure is the page cache's, and says so in err), 4 MiB per read with depth reads in flight
 * through io_uring, into buf (4 KiB aligned, wrapping). Well under a second for 256 MiB. */
#ifndef SSD_LOADER_CALIBRATE_H
#define SSD_LOADER_CALIBRATE_H
#include <stddef.h>
#include <stdint.h>

/* Returns 0 with *bytes_per_s set; -ERANGE when the file or buffer holds less than one read;
 * other -errno with err saying what failed. */
int calibrate_disk(const char *path, void *buf, size_t buf_bytes, uint64_t max_bytes, unsigned depth,
		   double *bytes_per_s, char *err, size_t errlen);

#endif

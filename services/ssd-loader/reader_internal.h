/* reader_internal.h - the two calls of reader.c that its unit test replaces
 * (tests/unit/ssd-loader/test_reader.c), and nothing else sets: the open() of a file, so a test
 * can refuse O_DIRECT as an older file system does, and the preparation of each read, so a test
 * can make the kernel refuse the reads of an O_DIRECT descriptor. Neither shows on a file
 * system that takes O_DIRECT (tmpfs does since Linux 6.6).
 *
 *   reader_hooks.open_file = fake_open;     // before reader_create
 *   ...
 *   reader_hooks = (struct reader_hooks){0}; // back to open() and io_uring_prep_read() */
#ifndef SSD_LOADER_READER_INTERNAL_H
#define SSD_LOADER_READER_INTERNAL_H
#include <liburing.h>
#ifdef __cplusplus
extern "C" {
#endif

struct reader_hooks {
	/* Opens path as open(2) does (returns a descriptor, or -1 with errno set); NULL: open(2). */
	int (*open_file)(const char *path, int flags);
	/* Prepares the read of one piece as io_uring_prep_read does; NULL: io_uring_prep_read. */
	void (*prep_read)(struct io_uring_sqe *sqe, int fd, void *buf, unsigned nbytes, __u64 offset);
};

/* Read by every reader at each open and each read it prepares. Not thread-safe: set it while
 * no reader runs. */
extern struct reader_hooks reader_hooks;

#ifdef __cplusplus
}
#endif
#endif

/* reader.h - reads byte ranges of a set of files into memory with io_uring, O_DIRECT where
 * the file system allows it.
 *
 *   const char *paths[] = {"/m/model-00001-of-00002.safetensors", ...};
 *   struct reader_params p = {.n_files = 2, .paths = paths, .queue_depth = 64, .max_read = 4 << 20};
 *   struct reader *r;
 *   rc = reader_create(&p, on_done, ctx, &r, err, sizeof(err));
 *   rc = reader_read(r, file, offset, length, min_length, dst, tag);   // queued, returns at once
 *   ... poll reader_eventfd(r) for reading, then:
 *   reader_process(r, false);      // reaps completions: on_done(ctx, tag, rc, text) per read
 *   reader_destroy(&r);            // waits for reads in flight
 *
 * A read (a request) is split into pieces of at most max_read bytes, and at most
 * queue_depth pieces are in flight; the rest wait in FIFO order. Each file is opened with
 * O_DIRECT unless params.buffered; when the file system refuses O_DIRECT (open, or a read,
 * fails with EINVAL, as on older tmpfs) that file falls back to buffered reads and a line is
 * logged. With O_DIRECT, file offsets, lengths and buffers must be multiples of
 * READER_ALIGN; the caller's extents are (manifest.h).
 *
 * A read that comes back short (the file ends inside the range) is fine as long as at least
 * min_length bytes arrived: the bytes past the end of the file are zeroed in dst. Fewer, or
 * an I/O error, completes the request with -EIO and a message naming the file and offset.
 *
 * A file is trusted as it was when first opened: a request whose file's size or modification
 * time has changed by the time its reads are done completes with -ESTALE and a message that says
 * so (a checkpoint rewritten in place while served would mix old and new weights; one replaced
 * by a rename is still read from the file first opened), and a reopen for the buffered fallback
 * that finds another file fails its pieces with -ESTALE.
 *
 * Not thread-safe: one thread (the service loop) owns a reader. */
#ifndef SSD_LOADER_READER_H
#define SSD_LOADER_READER_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util.h"
#ifdef __cplusplus
extern "C" {
#endif

#define READER_ALIGN 4096u	     /* O_DIRECT alignment of offsets, lengths and buffers */
#define READER_MAX_READ (1u << 30)   /* largest piece: io_uring lengths are 32-bit */
#define READER_MAX_DEPTH 4096u

struct reader;

struct reader_params {
	uint32_t n_files;
	const char *const *paths; /* n_files paths, copied */
	uint32_t queue_depth;	  /* pieces in flight at most, 1..READER_MAX_DEPTH */
	uint64_t max_read;	  /* bytes per piece: a multiple of READER_ALIGN, up to READER_MAX_READ */
	bool buffered;		  /* never use O_DIRECT */
	bool inline_issue;	  /* issue reads inside io_uring_enter (into memory whose pages exist)
				   * instead of from io-wq workers */
	const struct file_id *ids; /* NULL, or n_files identities (util.h) the files must still have
				    * when opened (the ones whose headers were read): else -ESTALE */
};

/* Completion of one request. rc is 0 or a negative errno; text (NULL on success) names the
 * file, the offset and the problem and is valid only during the call. The callback may
 * call reader_read. */
typedef void (*reader_done_fn)(void *ctx, uint64_t tag, int rc, const char *text);

struct reader_stats {
	uint64_t bytes_read;  /* bytes that came back from reads, all time */
	uint64_t reads_done;  /* pieces completed (each io_uring read) */
	uint64_t in_flight;   /* pieces submitted and not yet completed */
	uint64_t queued;      /* pieces waiting for room in the queue */
	uint64_t busy_ns;     /* time with at least one piece in flight */
	uint32_t direct_files;/* files read with O_DIRECT */
	uint32_t n_files;
};

/* Opens every file and sets up io_uring with an eventfd. Returns 0 with *out owned by the
 * caller (reader_destroy); -EINVAL for bad params; -ENOENT/-EACCES/... when a file cannot
 * be opened; other -errno from io_uring_queue_init (e.g. -ENOSYS, -EPERM where io_uring is
 * not allowed). On failure err names the file or the problem and nothing is left open. */
int reader_create(const struct reader_params *p, reader_done_fn done, void *ctx, struct reader **out, char *err,
		  size_t errlen);

/* Waits for the pieces in flight (their memory must stay valid until then), drops queued
 * ones without callbacks, closes everything. Safe on NULL and twice; NULLs *r. */
void reader_destroy(struct reader **r);

/* Queues the read of [offset, offset + length) of file into dst (length bytes, the caller
 * keeps it valid until the completion) and submits what fits the queue. min_length: the
 * fewest bytes the file must supply (the rest may lie past its end). Returns 0; -EINVAL for
 * a bad file index, min_length > length, or unaligned offset/length/dst on an O_DIRECT file;
 * -ENOMEM. The request then completes exactly once through the callback (from a later
 * reader_process, never from inside reader_read). */
int reader_read(struct reader *r, uint32_t file, uint64_t offset, uint64_t length, uint64_t min_length, void *dst,
		uint64_t tag);

/* The eventfd that io_uring signals on each completion: poll it for reading. */
int reader_eventfd(const struct reader *r);

/* Clears the eventfd, reaps every completion (calling the callback for each finished
 * request) and submits queued pieces. With wait, first blocks until at least one piece
 * completes if any is in flight. Returns the number of requests completed, or a negative
 * errno when io_uring itself fails. */
int reader_process(struct reader *r, bool wait);

/* Nothing in flight and nothing queued. */
bool reader_idle(const struct reader *r);

void reader_get_stats(const struct reader *r, struct reader_stats *st);

/* Live tuning: at most limit pieces in flight from now on (1..queue_depth; pieces already in
 * flight finish). Returns 0 or -EINVAL. reader_limit: the limit now; reader_depth: queue_depth. */
int reader_set_limit(struct reader *r, uint32_t limit);
uint32_t reader_limit(const struct reader *r);
uint32_t reader_depth(const struct reader *r);

/* Whether file is read with O_DIRECT now. */
bool reader_file_direct(const struct reader *r, uint32_t file);

#ifdef __cplusplus
}
#endif
#endif

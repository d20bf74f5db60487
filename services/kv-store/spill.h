/* spill.h - the kv-store's spill file: fixed-size block slots on disk, read and written with
 * io_uring.
 *
 * Spill slot i holds bytes [i * block_bytes, (i + 1) * block_bytes) of the file. The file is
 * opened with O_DIRECT where the filesystem takes it (block_bytes, the offsets and the
 * buffers are then 4 KiB aligned: the caller passes page-aligned pool slots) and buffered
 * where open(O_DIRECT) fails with EINVAL (tmpfs on older kernels, some FUSE filesystems).
 * The file is sparse: nothing is preallocated, a slot never written reads back short.
 *
 *   struct spill *sp;
 *   rc = spill_open("/run/x/kv-spill.bin", 65536, 1024, 32, SPILL_TRUNCATE, &sp, err, sizeof(err));
 *   struct spill_io io[2] = {{.buf = a, .slot = 3, .write = true}, {.buf = b, .slot = 7}};
 *   rc = spill_run(sp, io, 2, err, sizeof(err));   // -EIO: io[i].res says which failed
 *   spill_close(&sp, true);                         // and delete the file
 *
 * Single-threaded: one caller at a time per spill.
 */
#ifndef PIPELINE_KVSTORE_SPILL_H
#define PIPELINE_KVSTORE_SPILL_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SPILL_MAX_IO_DEPTH 4096

enum spill_open_mode {
	SPILL_TRUNCATE = 0, /* a fresh pool: whatever the file held is meaningless */
	SPILL_KEEP = 1,	    /* an adopted pool: spilled handles point into the file */
};

struct spill;

/* One block transfer between buf (block_bytes, 4 KiB aligned) and spill slot `slot`. */
struct spill_io {
	void *buf;
	uint32_t slot;
	bool write;
	int res; /* out: 0, or -errno (-EIO for a short transfer) */
};

/* Opens (creating it 0600) the spill file at path for n_slots slots of block_bytes, with an
 * io_uring of io_depth entries (1..SPILL_MAX_IO_DEPTH). block_bytes must be a positive
 * multiple of 4096 (asserted). Returns 0 and *out (owned by the caller: spill_close); else
 * -errno with err naming the file and the problem, and nothing left open (a file it created
 * stays, empty). */
int spill_open(const char *path, uint64_t block_bytes, uint32_t n_slots, uint32_t io_depth,
	       enum spill_open_mode mode, struct spill **out, char *err, size_t errlen);

/* Closes the file and the ring; with remove, also deletes the file. Safe on NULL and twice;
 * NULLs *sp. */
void spill_close(struct spill **sp, bool remove);

/* Runs n transfers, at most io_depth in flight, and waits for all of them. Every slot must be
 * < n_slots (asserted). Returns 0 when every one moved all its bytes; -EIO when any failed
 * or came up short (each io->res says which; err names the file and the first failed
 * offset); other -errno when the ring itself failed (the transfers' outcome is then unknown
 * and each res is -EIO). */
int spill_run(struct spill *sp, struct spill_io *ios, uint32_t n, char *err, size_t errlen);

/* Live tuning: spill_run keeps at most limit transfers in flight from its next call on
 * (1..io_depth). Returns 0 or -EINVAL. */
int spill_set_limit(struct spill *sp, uint32_t limit);

/* Was the file opened with O_DIRECT? */
bool spill_o_direct(const struct spill *sp);
const char *spill_path(const struct spill *sp);
/* The file's current size in bytes (0 if it cannot be read). */
uint64_t spill_file_size(const struct spill *sp);
/* fdatasync: what was written survives a power loss. Returns 0 or -errno. */
int spill_sync(struct spill *sp);
/* Byte offset of slot in the file. */
uint64_t spill_slot_offset(const struct spill *sp, uint32_t slot);

#endif

#include "services/kv-store/spill.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "services/kv-store/spill_internal.h"

struct spill {
	char path[512];
	int fd;
	bool o_direct;
	uint64_t block_bytes;
	uint32_t n_slots;
	uint32_t depth;
	uint32_t limit; /* transfers in flight at most now: 1..depth (live tuning) */
	bool broken; /* the ring failed: entries may be stuck in it */
	struct io_uring ring;
};

/* The file at path, created 0600 where absent; never through a symbolic link (O_NOFOLLOW), and
 * emptied for SPILL_TRUNCATE only once it is known to be a regular file of this user's (spill_open):
 * a link or another user's file planted at the path must not be truncated. */
static int open_file(spill_open_fn open_fn, const char *path, enum spill_open_mode mode, bool *o_direct)
{
	(void)mode;
	int flags = O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW;
	int fd = open_fn(path, flags | O_DIRECT, 0600);
	if (fd >= 0) {
		*o_direct = true;
		return fd;
	}
	if (errno != EINVAL)
		return -errno;
	/* The filesystem does not do direct I/O: the page cache is the price of working at all. */
	fd = open_fn(path, flags, 0600);
	if (fd < 0)
		return -errno;
	*o_direct = false;
	return fd;
}

static int sys_open(const char *path, int flags, mode_t mode)
{
	return open(path, flags, mode);
}

int spill_open(const char *path, uint64_t block_bytes, uint32_t n_slots, uint32_t io_depth,
	       enum spill_open_mode mode, struct spill **out, char *err, size_t errlen)
{
	return spill_open_with(sys_open, path, block_bytes, n_slots, io_depth, mode, out, err, errlen);
}

int spill_open_with(spill_open_fn open_fn, const char *path, uint64_t block_bytes, uint32_t n_slots,
		    uint32_t io_depth, enum spill_open_mode mode, struct spill **out, char *err, size_t errlen)
{
	assert(block_bytes > 0 && block_bytes % 4096 == 0);
	if (io_depth == 0 || io_depth > SPILL_MAX_IO_DEPTH) {
		snprintf(err, errlen, "io depth %u is out of range (1..%u)", io_depth, SPILL_MAX_IO_DEPTH);
		return -EINVAL;
	}
	struct spill *sp = calloc(1, sizeof(*sp));
	if (!sp) {
		snprintf(err, errlen, "out of memory opening spill file %s", path);
		return -ENOMEM;
	}
	int rc;
	if (str_copy(sp->path, sizeof(sp->path), path) != 0) {
		snprintf(err, errlen, "spill file path too long (%zu bytes, at most %zu): %s", strlen(path),
			 sizeof(sp->path) - 1, path);
		rc = -ENAMETOOLONG;
		goto out_free;
	}
	sp->block_bytes = block_bytes;
	sp->n_slots = n_slots;
	sp->depth = io_depth;
	sp->limit = io_depth;
	rc = open_file(open_fn, path, mode, &sp->o_direct);
	if (rc < 0) {
		snprintf(err, errlen, "cannot open spill file %s: %s", path, strerror(-rc));
		goto out_free;
	}
	sp->fd = rc;
	struct stat st;
	if (fstat(sp->fd, &st) != 0) {
		rc = -errno;
		snprintf(err, errlen, "cannot look at spill file %s: %s", path, strerror(errno));
		goto out_close;
	}
	if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || st.st_nlink != 1) {
		rc = -EPERM;
		snprintf(err, errlen, "spill file %s is %s: not used (remove it or name another --spill-file)", path,
			 !S_ISREG(st.st_mode)	   ? "not a regular file"
			 : st.st_uid != geteuid() ? "another user's"
						   : "a hard link of another name");
		goto out_close;
	}
	/* One kv-store a file: another instance given the same path (or this one's persisted file)
	 * would empty it under the first and delete it at its stop. Held until the file is closed. */
	if (flock(sp->fd, LOCK_EX | LOCK_NB) != 0) {
		const int e = errno;
		rc = e == EWOULDBLOCK ? -EBUSY : -e;
		if (rc == -EBUSY)
			snprintf(err, errlen, "spill file %s is in use by another kv-store: name another --spill-file "
				 "(or --instance)", path);
		else
			snprintf(err, errlen, "cannot lock spill file %s: %s", path, strerror(e));
		goto out_close;
	}
	if (mode == SPILL_TRUNCATE && st.st_size > 0 && ftruncate(sp->fd, 0) != 0) {
		rc = -errno;
		snprintf(err, errlen, "cannot empty spill file %s: %s", path, strerror(errno));
		goto out_close;
	}
	/* An existing file keeps its mode through O_CREAT: make it 0600 whatever it was. */
	if (fchmod(sp->fd, 0600) != 0) {
		rc = -errno;
		snprintf(err, errlen, "cannot set mode 0600 on spill file %s: %s", path, strerror(errno));
		goto out_close;
	}
	rc = io_uring_queue_init(io_depth, &sp->ring, 0);
	if (rc < 0) {
		snprintf(err, errlen, "cannot set up io_uring of depth %u for spill file %s: %s", io_depth, path,
			 strerror(-rc));
		goto out_close;
	}
	log_info("spill file %s: %u slots of %llu bytes, %s I/O, io depth %u", path, n_slots,
		 (unsigned long long)block_bytes, sp->o_direct ? "direct" : "buffered (no O_DIRECT here)", io_depth);
	*out = sp;
	return 0;

out_close:
	close(sp->fd);
out_free:
	free(sp);
	return rc;
}

void spill_close(struct spill **spp, bool remove)
{
	if (!spp || !*spp)
		return;
	struct spill *sp = *spp;
	io_uring_queue_exit(&sp->ring);
	close(sp->fd);
	if (remove && unlink(sp->path) != 0 && errno != ENOENT)
		log_warn("cannot delete spill file %s: %s", sp->path, strerror(errno));
	free(sp);
	*spp = NULL;
}

bool spill_o_direct(const struct spill *sp)
{
	return sp->o_direct;
}

const char *spill_path(const struct spill *sp)
{
	return sp->path;
}

uint64_t spill_file_size(const struct spill *sp)
{
	struct stat st;
	return fstat(sp->fd, &st) == 0 ? (uint64_t)st.st_size : 0;
}

int spill_sync(struct spill *sp)
{
	return fdatasync(sp->fd) == 0 ? 0 : -errno;
}

uint64_t spill_slot_offset(const struct spill *sp, uint32_t slot)
{
	return (uint64_t)slot * sp->block_bytes;
}

static void note_failure(struct spill *sp, struct spill_io *io, int res, int *first_failed, char *err,
			 size_t errlen, uint32_t index)
{
	io->res = res;
	if (*first_failed >= 0)
		return;
	*first_failed = (int)index;
	snprintf(err, errlen, "%s of %llu bytes at offset %llu of spill file %s failed: %s",
		 io->write ? "write" : "read", (unsigned long long)sp->block_bytes,
		 (unsigned long long)spill_slot_offset(sp, io->slot), sp->path,
		 res == -EIO ? "short transfer or I/O error" : strerror(-res));
}

/* Submits that may fail for a moment (the kernel short of memory for the request, a completion
 * queue to reap first) are tried again this many times, a millisecond apart, before the ring is
 * given up. */
#define SPILL_SUBMIT_RETRIES 200

int spill_run(struct spill *sp, struct spill_io *ios, uint32_t n, char *err, size_t errlen)
{
	uint32_t prepped = 0, submitted = 0, done = 0, retries = 0;
	int first_failed = -1;
	int rc = 0;
	if (sp->broken) {
		snprintf(err, errlen, "the io_uring of spill file %s failed earlier; restart kv-store", sp->path);
		rc = -EIO;
		goto out_fail_all;
	}
	for (uint32_t i = 0; i < n; i++) {
		assert(ios[i].slot < sp->n_slots);
		ios[i].res = 0;
	}
	while (done < n) {
		/* Fill the queue up to the depth, then submit the batch with one system call. */
		while (prepped < n && prepped - done < sp->limit) {
			struct io_uring_sqe *sqe = io_uring_get_sqe(&sp->ring);
			if (!sqe)
				break;
			struct spill_io *io = &ios[prepped];
			off_t off = (off_t)spill_slot_offset(sp, io->slot);
			if (io->write)
				io_uring_prep_write(sqe, sp->fd, io->buf, (unsigned)sp->block_bytes, off);
			else
				io_uring_prep_read(sqe, sp->fd, io->buf, (unsigned)sp->block_bytes, off);
			io_uring_sqe_set_data64(sqe, prepped);
			prepped++;
		}
		int sub = io_uring_submit_and_wait(&sp->ring, 1);
		if (sub == -EINTR)
			continue;
		if ((sub == -EAGAIN || sub == -EBUSY || sub == -ENOMEM) && retries < SPILL_SUBMIT_RETRIES) {
			/* Nothing went in: the entries stay queued for the next submit. Reap what has
			 * completed meanwhile (below), wait a moment, try again. */
			if (retries++ == 0)
				log_warn("io_uring submit on spill file %s: %s; trying again", sp->path, strerror(-sub));
			struct timespec ts = {0, 1000000};
			nanosleep(&ts, NULL);
			sub = 0;
		}
		if (sub < 0) {
			rc = sub;
			snprintf(err, errlen, "io_uring submit on spill file %s failed: %s", sp->path, strerror(-sub));
			goto out_abandon;
		}
		submitted += (uint32_t)sub;
		struct io_uring_cqe *cqe;
		unsigned head, seen = 0;
		io_uring_for_each_cqe(&sp->ring, head, cqe) {
			uint64_t idx = io_uring_cqe_get_data64(cqe);
			assert(idx < n);
			struct spill_io *io = &ios[idx];
			if (cqe->res < 0)
				note_failure(sp, io, cqe->res, &first_failed, err, errlen, (uint32_t)idx);
			else if ((uint64_t)cqe->res != sp->block_bytes)
				note_failure(sp, io, -EIO, &first_failed, err, errlen, (uint32_t)idx);
			seen++;
		}
		io_uring_cq_advance(&sp->ring, seen);
		done += seen;
	}
	return first_failed >= 0 ? -EIO : 0;

out_abandon:
	/* Buffers may still be in flight: drain what the kernel owes before the caller reuses
	 * them. Entries prepared but never submitted would go out with a later batch, so the
	 * ring is retired. */
	sp->broken = true;
	while (done < submitted) {
		struct io_uring_cqe *cqe;
		if (io_uring_wait_cqe(&sp->ring, &cqe) < 0)
			break;
		io_uring_cqe_seen(&sp->ring, cqe);
		done++;
	}
out_fail_all:
	for (uint32_t i = 0; i < n; i++)
		ios[i].res = -EIO;
	return rc;
}

int spill_set_limit(struct spill *sp, uint32_t limit)
{
	if (limit < 1 || limit > sp->depth)
		return -EINVAL;
	sp->limit = limit;
	return 0;
}

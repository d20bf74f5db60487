/* reader.c - io_uring reads of file ranges, split into pieces, O_DIRECT with a buffered
 * fallback per file. See reader.h. */
#include "services/ssd-loader/reader.h"
#include "services/ssd-loader/reader_internal.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"

/* Tests replace open() and the preparation of reads to see the fallback on file systems that
 * do take O_DIRECT (reader_internal.h); the service leaves both NULL. */
struct reader_hooks reader_hooks;

static int open_path(const char *path, int flags)
{
	return reader_hooks.open_file ? reader_hooks.open_file(path, flags) : open(path, flags);
}

#define NO_EOF UINT64_MAX

struct rfile {
	char *path;
	int fd;
	bool direct;
	/* What the file was when first opened: a read is trusted only while it still is (a
	 * checkpoint rewritten in place would mix old and new weights), and a reopen must find the
	 * same file. */
	struct file_id at;     /* at its first open */
	struct file_id want;   /* what its caller read (reader_params.ids), or ino 0: nothing to match */
	bool replaced; /* a reopen found another file under its name (said once) */
};

/* One reader_read: pieces are cut from it in order until `issued` reaches length. */
struct request {
	struct request *next; /* FIFO of requests with pieces not yet issued */
	uint64_t tag;
	uint32_t file;
	uint64_t offset, length, min_length; /* bytes */
	char *dst;
	uint64_t issued;      /* bytes handed to pieces so far */
	uint32_t pieces_out;  /* pieces issued and not finished */
	uint64_t eof;	      /* bytes from offset where the file ended, NO_EOF if it did not */
	int rc;		      /* first error */
	int err_errno;	      /* errno of the first failed piece */
	uint64_t err_offset;  /* file offset of the first failed piece */
};

/* One io_uring read of at most max_read bytes of a request. */
struct piece {
	struct piece *next; /* free list or retry list */
	struct request *req;
	uint64_t rel;	    /* offset of the piece inside the request */
	uint32_t len;	    /* bytes */
	uint32_t done;	    /* bytes already read (a short read resubmits the rest) */
	bool direct;	    /* last issued on an O_DIRECT descriptor */
};

struct reader {
	struct io_uring ring;
	int efd;
	reader_done_fn done;
	void *ctx;
	uint32_t depth;
	uint32_t limit;		   /* pieces in flight at most now: 1..depth (live tuning) */
	uint64_t max_read;
	bool inline_issue;
	uint32_t n_files;
	struct rfile *files;

	struct piece *pieces;	   /* depth entries */
	struct piece *free_pieces;
	struct piece *retry;	   /* pieces to submit again (short read, EAGAIN, O_DIRECT refused) */
	struct request *q_head, *q_tail;

	uint32_t outstanding;	   /* pieces taken from the pool */
	uint32_t retry_len;
	uint32_t unsubmitted;	   /* SQEs prepared but not yet taken by io_uring_submit */
	uint64_t queued_pieces;	   /* pieces not yet cut from queued requests */
	bool closing;		   /* reader_destroy: no callbacks, no retries */

	uint64_t bytes_read, reads_done;
	uint64_t requests_done;
	uint64_t busy_ns, busy_since;
};

static uint32_t in_kernel(const struct reader *r)
{
	return r->outstanding - r->retry_len - r->unsubmitted;
}

static uint64_t pieces_of(const struct reader *r, uint64_t bytes)
{
	return (bytes + r->max_read - 1) / r->max_read;
}

/* The file's identity, recorded at its first open; -ESTALE where it is not the file its caller
 * read (a checkpoint rewritten or replaced between its header's read and this open: its weights
 * would not be what the manifest describes and hashes). */
static int note_identity(struct rfile *f, char *err, size_t errlen)
{
	struct stat st;
	if (fstat(f->fd, &st) != 0) {
		int rc = -errno;
		snprintf(err, errlen, "cannot stat %s: %s", f->path, strerror(errno));
		return rc;
	}
	file_id_of(&st, &f->at);
	if (f->want.ino && !file_id_same(&f->want, &f->at)) {
		char a[128], b[128];
		snprintf(err, errlen,
			 "%s changed after its header was read (%s then, %s%s now): restart the pipeline to read the "
			 "new one", f->path, file_id_text(&f->want, a, sizeof(a)), file_id_text(&f->at, b, sizeof(b)),
			 f->want.ino != f->at.ino || f->want.dev != f->at.dev ? ", another file," : "");
		return -ESTALE;
	}
	return 0;
}

/* Is the open file still what it was at its first open (size and modification time)? 0, or
 * -ESTALE with the reason in text. Not its change time: a rename, a new link or an unlink moves
 * that too, and the file renamed away or replaced by a rename is still the bytes first opened. */
static int check_unchanged(const struct rfile *f, char *text, size_t len)
{
	struct stat st;
	if (fstat(f->fd, &st) != 0) {
		int rc = -errno;
		snprintf(text, len, "cannot stat %s: %s", f->path, strerror(errno));
		return rc;
	}
	struct file_id now;
	file_id_of(&st, &now);
	if (now.size == f->at.size && now.mtime_s == f->at.mtime_s && now.mtime_ns == f->at.mtime_ns)
		return 0;
	char a[128], b[128];
	snprintf(text, len,
		 "%s changed while the loader serves it (%s when opened, now %s): weights from the old and the new "
		 "file must not mix; restart the pipeline to read the new one",
		 f->path, file_id_text(&f->at, a, sizeof(a)), file_id_text(&now, b, sizeof(b)));
	return -ESTALE;
}

static int open_file(struct rfile *f, bool buffered, char *err, size_t errlen)
{
	if (!buffered) {
		f->fd = open_path(f->path, O_RDONLY | O_CLOEXEC | O_DIRECT);
		if (f->fd >= 0) {
			f->direct = true;
			return note_identity(f, err, errlen);
		}
		if (errno != EINVAL) {
			int rc = -errno;
			snprintf(err, errlen, "cannot open %s: %s", f->path, strerror(errno));
			return rc;
		}
		log_info("%s: the file system refuses O_DIRECT; reading this file through the page cache", f->path);
	}
	f->fd = open_path(f->path, O_RDONLY | O_CLOEXEC);
	if (f->fd < 0) {
		int rc = -errno;
		snprintf(err, errlen, "cannot open %s: %s", f->path, strerror(errno));
		return rc;
	}
	f->direct = false;
	return note_identity(f, err, errlen);
}

/* A read on an O_DIRECT descriptor failed with EINVAL: some file systems accept the open and
 * refuse the read. Reopen buffered under the same descriptor number (dup2): reads prepared on
 * that number but not yet submitted then go to the buffered file, and the number is never free
 * for another thread to reuse. io_uring holds its own reference to the file of reads in flight. */
static int fall_back_to_buffered(struct rfile *f)
{
	/* The same file, whatever now has its name: through the descriptor where /proc shows it,
	 * else by its path, then checked to be the file first opened. */
	char self[64];
	snprintf(self, sizeof(self), "/proc/self/fd/%d", f->fd);
	int fd = open(self, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		fd = open_path(f->path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	struct stat st;
	if (fstat(fd, &st) != 0 || (uint64_t)st.st_dev != f->at.dev || (uint64_t)st.st_ino != f->at.ino) {
		if (!f->replaced)
			log_error("%s: reopened for reads through the page cache, it is another file than the one first "
				  "opened (replaced while the loader serves it)",
				  f->path);
		f->replaced = true; /* said once; each refused O_DIRECT read fails so from here on */
		close(fd);
		return -ESTALE;
	}
	log_warn("%s: an O_DIRECT read was refused (EINVAL); reading this file through the page cache", f->path);
	if (dup3(fd, f->fd, O_CLOEXEC) < 0) {
		int rc = -errno;
		close(fd);
		return rc;
	}
	close(fd);
	f->direct = false;
	return 0;
}

int reader_create(const struct reader_params *p, reader_done_fn done, void *ctx, struct reader **out, char *err,
		  size_t errlen)
{
	if (!p || !done || !out || p->n_files == 0 || !p->paths || p->queue_depth == 0 ||
	    p->queue_depth > READER_MAX_DEPTH || p->max_read < READER_ALIGN || p->max_read > READER_MAX_READ ||
	    p->max_read % READER_ALIGN) {
		snprintf(err, errlen,
			 "bad reader parameters: need files, a queue depth of 1..%u and a read size that is a multiple "
			 "of %u up to %u bytes",
			 READER_MAX_DEPTH, READER_ALIGN, READER_MAX_READ);
		return -EINVAL;
	}
	int rc = -ENOMEM;
	struct reader *r = calloc(1, sizeof(*r));
	if (!r)
		goto out_nomem;
	r->done = done;
	r->ctx = ctx;
	r->depth = p->queue_depth;
	r->limit = p->queue_depth;
	r->max_read = p->max_read;
	r->inline_issue = p->inline_issue;
	r->efd = -1;
	r->files = calloc(p->n_files, sizeof(*r->files));
	r->pieces = calloc(p->queue_depth, sizeof(*r->pieces));
	if (!r->files || !r->pieces)
		goto out_free;
	for (uint32_t i = 0; i < p->queue_depth; i++) {
		r->pieces[i].next = r->free_pieces;
		r->free_pieces = &r->pieces[i];
	}
	for (uint32_t i = 0; i < p->n_files; i++) {
		r->files[i].fd = -1;
		if (p->ids)
			r->files[i].want = p->ids[i];
		r->files[i].path = strdup(p->paths[i]);
		if (!r->files[i].path) {
			rc = -ENOMEM;
			goto out_close_files;
		}
		r->n_files = i + 1;
		rc = open_file(&r->files[i], p->buffered, err, errlen);
		if (rc)
			goto out_close_files;
	}
	/* The CQ ring defaults to twice the SQ: with at most depth pieces out it never overflows. */
	rc = io_uring_queue_init(p->queue_depth, &r->ring, 0);
	if (rc) {
		snprintf(err, errlen, "cannot set up io_uring with %u entries: %s", p->queue_depth, strerror(-rc));
		goto out_close_files;
	}
	r->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (r->efd < 0) {
		rc = -errno;
		snprintf(err, errlen, "cannot create an eventfd: %s", strerror(errno));
		goto out_exit_ring;
	}
	rc = io_uring_register_eventfd(&r->ring, r->efd);
	if (rc) {
		snprintf(err, errlen, "cannot register an eventfd with io_uring: %s", strerror(-rc));
		goto out_close_efd;
	}
	*out = r;
	return 0;

out_close_efd:
	close(r->efd);
out_exit_ring:
	io_uring_queue_exit(&r->ring);
out_close_files:
	for (uint32_t i = 0; i < r->n_files; i++) {
		if (r->files[i].fd >= 0)
			close(r->files[i].fd);
		free(r->files[i].path);
	}
out_free:
	free(r->pieces);
	free(r->files);
	free(r);
out_nomem:
	if (rc == -ENOMEM)
		snprintf(err, errlen, "out of memory setting up the reader");
	return rc;
}

static void busy_add(struct reader *r)
{
	if (r->outstanding++ == 0)
		r->busy_since = now_ns();
}

static void busy_sub(struct reader *r)
{
	if (--r->outstanding == 0)
		r->busy_ns += now_ns() - r->busy_since;
}

static void prep_piece(struct reader *r, struct piece *pc)
{
	struct request *q = pc->req;
	struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
	/* At most depth pieces exist and the SQ has depth entries: there is always room. */
	assert(sqe);
	uint64_t at = pc->rel + pc->done;
	pc->direct = r->files[q->file].direct;
	if (reader_hooks.prep_read)
		reader_hooks.prep_read(sqe, r->files[q->file].fd, q->dst + at, pc->len - pc->done, q->offset + at);
	else
		io_uring_prep_read(sqe, r->files[q->file].fd, q->dst + at, pc->len - pc->done, q->offset + at);
	io_uring_sqe_set_data(sqe, pc);
	/* Inline (the loader's default) or from io-wq workers. An O_DIRECT read pins its buffer,
	 * and the first read into a fresh page faults it in inside the submitting call: inline
	 * issue wants the pages to exist already (the loader faults its ring in at creation);
	 * workers keep the loop responsive where they do not, at a cost: 1.60 against 1.93 GB/s
	 * into existing pages on the lent H100 machine (4 MiB reads, 64 in flight). */
	io_uring_sqe_set_flags(sqe, r->inline_issue ? 0 : IOSQE_ASYNC);
	r->unsubmitted++;
}

static void submit_pending(struct reader *r)
{
	while (r->retry) {
		struct piece *pc = r->retry;
		r->retry = pc->next;
		r->retry_len--;
		prep_piece(r, pc);
	}
	while (r->free_pieces && r->q_head && r->outstanding < r->limit) {
		struct request *q = r->q_head;
		struct piece *pc = r->free_pieces;
		r->free_pieces = pc->next;
		uint64_t n = q->length - q->issued;
		if (n > r->max_read)
			n = r->max_read;
		*pc = (struct piece){.req = q, .rel = q->issued, .len = (uint32_t)n};
		q->issued += n;
		q->pieces_out++;
		r->queued_pieces--;
		if (q->issued == q->length) {
			r->q_head = q->next;
			if (!r->q_head)
				r->q_tail = NULL;
		}
		busy_add(r);
		prep_piece(r, pc);
	}
	if (r->unsubmitted) {
		int n = io_uring_submit(&r->ring);
		/* On -EAGAIN/-EBUSY the SQEs stay in the ring and the next call submits them. */
		if (n > 0)
			r->unsubmitted -= (uint32_t)n > r->unsubmitted ? r->unsubmitted : (uint32_t)n;
		else if (n < 0 && n != -EAGAIN && n != -EBUSY && n != -EINTR)
			log_error("io_uring_submit failed: %s", strerror(-n));
	}
}

int reader_read(struct reader *r, uint32_t file, uint64_t offset, uint64_t length, uint64_t min_length, void *dst,
		uint64_t tag)
{
	if (file >= r->n_files || length == 0 || min_length > length || !dst)
		return -EINVAL;
	if (r->files[file].direct &&
	    (offset % READER_ALIGN || length % READER_ALIGN || (uintptr_t)dst % READER_ALIGN))
		return -EINVAL;
	struct request *q = calloc(1, sizeof(*q));
	if (!q)
		return -ENOMEM;
	*q = (struct request){.tag = tag, .file = file, .offset = offset, .length = length,
			      .min_length = min_length, .dst = dst, .eof = NO_EOF};
	if (r->q_tail)
		r->q_tail->next = q;
	else
		r->q_head = q;
	r->q_tail = q;
	r->queued_pieces += pieces_of(r, length);
	submit_pending(r);
	return 0;
}

static void finish_request(struct reader *r, struct request *q)
{
	char text[PATH_MAX + 256];
	const char *path = r->files[q->file].path;
	int rc = q->rc;
	uint64_t got = q->eof == NO_EOF ? q->length : q->eof;
	if (rc) {
		snprintf(text, sizeof(text), "read of %s at offset %llu failed: %s%s", path,
			 (unsigned long long)q->err_offset, strerror(q->err_errno),
			 q->err_errno == ESTALE ? " (the file was replaced while the loader serves it)" : "");
	} else if ((rc = check_unchanged(&r->files[q->file], text, sizeof(text))) != 0) {
		/* Read after the pieces: a change before this check shows, and bytes read before a
		 * change that comes after it are the old file's, whole. */
	} else if (got < q->min_length) {
		rc = -EIO;
		snprintf(text, sizeof(text),
			 "%s ends at byte %llu, inside tensor data that runs to byte %llu (read at offset %llu): the "
			 "file is shorter than its header says (truncated or rewritten?)",
			 path, (unsigned long long)(q->offset + got), (unsigned long long)(q->offset + q->min_length),
			 (unsigned long long)q->offset);
	}
	/* Past the end of the file: zeros, not what the slot held before. */
	if (!rc && got < q->length)
		memset(q->dst + got, 0, q->length - got);
	r->requests_done++;
	if (!r->closing)
		r->done(r->ctx, q->tag, rc, rc ? text : NULL);
	free(q);
}

static void piece_finished(struct reader *r, struct piece *pc)
{
	struct request *q = pc->req;
	pc->next = r->free_pieces;
	r->free_pieces = pc;
	busy_sub(r);
	q->pieces_out--;
	if (q->pieces_out == 0 && q->issued == q->length)
		finish_request(r, q);
}

static void piece_retry(struct reader *r, struct piece *pc)
{
	if (r->closing) {
		piece_finished(r, pc);
		return;
	}
	pc->next = r->retry;
	r->retry = pc;
	r->retry_len++;
}

static void piece_failed(struct reader *r, struct piece *pc, int res)
{
	struct request *q = pc->req;
	if (!q->rc) {
		q->rc = res == -ESTALE ? -ESTALE : -EIO; /* ESTALE: the file was replaced (reader.h) */
		q->err_errno = -res;
		q->err_offset = q->offset + pc->rel + pc->done;
	}
	piece_finished(r, pc);
}

static void on_cqe(struct reader *r, struct piece *pc, int res)
{
	struct request *q = pc->req;
	struct rfile *f = &r->files[q->file];
	if (res < 0) {
		if (res == -EAGAIN || res == -EINTR) {
			piece_retry(r, pc);
		} else if (res == -EINVAL && pc->direct && !r->closing) {
			/* The other pieces in flight on the O_DIRECT descriptor come back refused
			 * too, after the first one switched the file: they only need a retry. */
			int rc = f->direct ? fall_back_to_buffered(f) : 0;
			if (rc)
				piece_failed(r, pc, rc);
			else
				piece_retry(r, pc);
		} else {
			piece_failed(r, pc, res);
		}
		return;
	}
	r->reads_done++;
	r->bytes_read += (uint64_t)res;
	pc->done += (uint32_t)res;
	uint64_t end = pc->rel + pc->done;
	if (pc->done == pc->len) {
		piece_finished(r, pc);
	} else if (res == 0 || (f->direct && pc->done % READER_ALIGN)) {
		/* The file ends here: a direct read stops short only at the end of the file, and
		 * the rest of an unaligned tail could not be asked for anyway. */
		if (end < q->eof)
			q->eof = end;
		piece_finished(r, pc);
	} else {
		piece_retry(r, pc); /* a plain short read: ask for the rest */
	}
}

static void reap(struct reader *r)
{
	struct io_uring_cqe *cqe;
	while (io_uring_peek_cqe(&r->ring, &cqe) == 0) {
		struct piece *pc = io_uring_cqe_get_data(cqe);
		int res = cqe->res;
		/* Consume the entry first: a callback may submit more reads. */
		io_uring_cqe_seen(&r->ring, cqe);
		on_cqe(r, pc, res);
	}
}

int reader_process(struct reader *r, bool wait)
{
	uint64_t v;
	while (read(r->efd, &v, sizeof(v)) == (ssize_t)sizeof(v)) {
	}
	uint64_t before = r->requests_done;
	submit_pending(r);
	if (wait && in_kernel(r) > 0) {
		struct io_uring_cqe *cqe;
		int rc;
		do
			rc = io_uring_wait_cqe(&r->ring, &cqe);
		while (rc == -EINTR);
		if (rc)
			return rc;
	}
	reap(r);
	submit_pending(r);
	return (int)(r->requests_done - before);
}

bool reader_idle(const struct reader *r)
{
	return r->outstanding == 0 && !r->q_head;
}

int reader_eventfd(const struct reader *r)
{
	return r->efd;
}

void reader_get_stats(const struct reader *r, struct reader_stats *st)
{
	memset(st, 0, sizeof(*st));
	st->bytes_read = r->bytes_read;
	st->reads_done = r->reads_done;
	st->in_flight = r->outstanding;
	st->queued = r->queued_pieces;
	st->busy_ns = r->busy_ns + (r->outstanding ? now_ns() - r->busy_since : 0);
	st->n_files = r->n_files;
	for (uint32_t i = 0; i < r->n_files; i++)
		st->direct_files += r->files[i].direct;
}

int reader_set_limit(struct reader *r, uint32_t limit)
{
	if (limit < 1 || limit > r->depth)
		return -EINVAL;
	r->limit = limit;
	submit_pending(r); /* a higher limit: queued pieces may go now */
	return 0;
}

uint32_t reader_limit(const struct reader *r)
{
	return r->limit;
}

uint32_t reader_depth(const struct reader *r)
{
	return r->depth;
}

bool reader_file_direct(const struct reader *r, uint32_t file)
{
	return file < r->n_files && r->files[file].direct;
}

void reader_destroy(struct reader **rp)
{
	if (!rp || !*rp)
		return;
	struct reader *r = *rp;
	r->closing = true;
	/* Queued requests have no piece in flight: drop them. */
	while (r->q_head) {
		struct request *q = r->q_head;
		r->q_head = q->next;
		if (q->pieces_out == 0) {
			free(q);
		} else {
			/* Its issued pieces free it when they finish. */
			q->length = q->issued;
		}
	}
	r->q_tail = NULL;
	while (r->retry) {
		struct piece *pc = r->retry;
		r->retry = pc->next;
		r->retry_len--;
		piece_finished(r, pc);
	}
	/* Prepared SQEs that io_uring never took are discarded by queue_exit; the kernel must
	 * finish writing into the caller's memory for the ones it did take. */
	if (r->unsubmitted) {
		int n = io_uring_submit(&r->ring);
		if (n > 0)
			r->unsubmitted -= (uint32_t)n > r->unsubmitted ? r->unsubmitted : (uint32_t)n;
	}
	while (in_kernel(r) > 0) {
		struct io_uring_cqe *cqe;
		int rc = io_uring_wait_cqe(&r->ring, &cqe);
		if (rc == -EINTR)
			continue;
		if (rc)
			break;
		reap(r);
		while (r->retry) {
			struct piece *pc = r->retry;
			r->retry = pc->next;
			r->retry_len--;
			piece_finished(r, pc);
		}
	}
	io_uring_queue_exit(&r->ring);
	close(r->efd);
	for (uint32_t i = 0; i < r->n_files; i++) {
		if (r->files[i].fd >= 0)
			close(r->files[i].fd);
		free(r->files[i].path);
	}
	free(r->pieces);
	free(r->files);
	free(r);
	*rp = NULL;
}

#include "services/ssd-loader/calibrate.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

#define CAL_READ (4u << 20)

int calibrate_disk(const char *path, void *buf, size_t buf_bytes, uint64_t max_bytes, unsigned depth,
		   double *bytes_per_s, char *err, size_t errlen)
{
	int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
	bool direct = fd >= 0;
	if (fd < 0 && errno == EINVAL)
		fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errorf(err, errlen, -errno, "calibration: cannot open %s: %s", path, strerror(errno));
	struct stat st;
	int rc = 0;
	if (fstat(fd, &st) != 0) {
		rc = errorf(err, errlen, -errno, "calibration: %s: %s", path, strerror(errno));
		goto out_close;
	}
	uint64_t size = (uint64_t)st.st_size & ~(uint64_t)4095;
	if (size > max_bytes)
		size = max_bytes;
	size_t slots = buf_bytes / CAL_READ;
	if (size < CAL_READ || slots == 0) {
		rc = errorf(err, errlen, -ERANGE, "disk not measured: %s or the buffer is smaller than one read", path);
		goto out_close;
	}
	if (depth > slots)
		depth = (unsigned)slots;
	struct io_uring ring;
	rc = io_uring_queue_init(depth, &ring, 0);
	if (rc) {
		errorf(err, errlen, rc, "calibration: io_uring: %s", strerror(-rc));
		goto out_close;
	}
	uint64_t next = 0, done = 0, issued = 0;
	unsigned inflight = 0;
	uint64_t t0 = now_ns();
	/* Until every read issued has completed: a short one (a file that shrank, a filesystem that
	 * returns less) leaves done below size, and waiting for more with nothing in flight hung. */
	while (rc == 0 && (next < size || inflight > 0)) {
		while (inflight < depth && next < size) {
			struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
			size_t len = size - next < CAL_READ ? (size_t)(size - next) : CAL_READ;
			io_uring_prep_read(sqe, fd, (char *)buf + (issued % slots) * CAL_READ, (unsigned)len, next);
			next += len;
			issued++;
			inflight++;
		}
		io_uring_submit(&ring);
		struct io_uring_cqe *cqe;
		rc = io_uring_wait_cqe(&ring, &cqe);
		if (rc) {
			errorf(err, errlen, rc, "calibration: waiting for a read: %s", strerror(-rc));
			break;
		}
		if (cqe->res <= 0) {
			rc = errorf(err, errlen, cqe->res ? cqe->res : -EIO, "calibration: reading %s: %s", path,
				    cqe->res ? strerror(-cqe->res) : "end of file");
		} else {
			done += (uint64_t)cqe->res;
		}
		inflight--;
		io_uring_cqe_seen(&ring, cqe);
	}
	double secs = (double)(now_ns() - t0) * 1e-9;
	/* Reap what is still in flight after an error before the buffer can be reused. */
	while (inflight) {
		struct io_uring_cqe *cqe;
		if (io_uring_wait_cqe(&ring, &cqe) != 0)
			break;
		io_uring_cqe_seen(&ring, cqe);
		inflight--;
	}
	io_uring_queue_exit(&ring);
	if (rc == 0) {
		*bytes_per_s = secs > 0 ? (double)done / secs : 0;
		if (!direct)
			errorf(err, errlen, 0, "%s refuses O_DIRECT: the figure is the page cache's", path);
	}
out_close:
	close(fd);
	return rc;
}

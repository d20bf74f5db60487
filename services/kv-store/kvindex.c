#include "services/kv-store/kvindex.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

struct kvindex_header {
	uint64_t magic;
	uint32_t version;
	uint32_t record_bytes;
	uint64_t block_bytes;
	uint64_t manifest_hash;
	uint32_t n_slots;
	uint32_t crc; /* CRC-32C of the header with this field 0 */
	uint8_t reserved[24];
};
_Static_assert(sizeof(struct kvindex_header) == KVINDEX_HEADER_BYTES, "index header");

struct kvindex {
	char path[512];
	int fd;
	uint32_t n_slots; /* records the file holds now */
};

int kvindex_open(const char *path, struct kvindex **out, char *err, size_t errlen)
{
	struct kvindex *ix = calloc(1, sizeof(*ix));
	int rc;
	if (!ix)
		return errorf(err, errlen, -ENOMEM, "out of memory opening spill index %s", path);
	if (str_copy(ix->path, sizeof(ix->path), path) != 0) {
		rc = errorf(err, errlen, -ENAMETOOLONG, "spill index path too long (%zu bytes, at most %zu): %s",
			    strlen(path), sizeof(ix->path) - 1, path);
		goto out_free;
	}
	ix->fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (ix->fd < 0) {
		rc = errorf(err, errlen, -errno, "cannot open spill index %s: %s", path, strerror(errno));
		goto out_free;
	}
	/* One kv-store per index: two sharing a --persist-dir would overwrite each other's blocks. */
	if (flock(ix->fd, LOCK_EX | LOCK_NB) != 0) {
		rc = errno == EWOULDBLOCK ? -EBUSY : -errno;
		errorf(err, errlen, rc, "spill index %s is in use by another kv-store (give each its own "
		       "--persist-dir): %s", path, rc == -EBUSY ? "locked" : strerror(-rc));
		goto out_close;
	}
	if (fchmod(ix->fd, 0600) != 0) {
		rc = errorf(err, errlen, -errno, "cannot set mode 0600 on spill index %s: %s", path, strerror(errno));
		goto out_close;
	}
	*out = ix;
	return 0;

out_close:
	close(ix->fd);
out_free:
	free(ix);
	return rc;
}

void kvindex_close(struct kvindex **ixp)
{
	if (!ixp || !*ixp)
		return;
	close((*ixp)->fd);
	free(*ixp);
	*ixp = NULL;
}

const char *kvindex_path(const struct kvindex *ix)
{
	return ix->path;
}

static void header_make(struct kvindex_header *hd, const struct kvindex_geometry *g)
{
	memset(hd, 0, sizeof(*hd));
	hd->magic = KVINDEX_MAGIC;
	hd->version = KVINDEX_VERSION;
	hd->record_bytes = KVINDEX_RECORD_BYTES;
	hd->block_bytes = g->block_bytes;
	hd->manifest_hash = g->manifest_hash;
	hd->n_slots = g->n_slots;
	hd->crc = crc32c(0, hd, sizeof(*hd));
}

static uint32_t record_crc(const struct kvindex_record *r)
{
	struct kvindex_record c = *r;
	c.crc = 0;
	return crc32c(0, &c, sizeof(c));
}

/* Reads exactly len bytes at off. Returns 0, -EIO for a short read, or -errno. */
static int read_full(int fd, void *buf, size_t len, off_t off)
{
	size_t done = 0;
	while (done < len) {
		ssize_t n = pread(fd, (char *)buf + done, len - done, off + (off_t)done);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		if (n == 0)
			return -EIO;
		done += (size_t)n;
	}
	return 0;
}

static int write_full(int fd, const void *buf, size_t len, off_t off)
{
	size_t done = 0;
	while (done < len) {
		ssize_t n = pwrite(fd, (const char *)buf + done, len - done, off + (off_t)done);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		if (n == 0)
			return -EIO;
		done += (size_t)n;
	}
	return 0;
}

int kvindex_load(struct kvindex *ix, const struct kvindex_geometry *g, struct kvindex_record *recs, uint32_t *bad,
		 char *why, size_t whylen)
{
	struct stat st;
	struct kvindex_header hd, want;
	if (bad)
		*bad = 0;
	why[0] = 0;
	if (fstat(ix->fd, &st) != 0)
		return errorf(why, whylen, -errno, "cannot stat spill index %s: %s", ix->path, strerror(errno));
	if (st.st_size == 0)
		return 0;
	uint64_t size = KVINDEX_HEADER_BYTES + (uint64_t)g->n_slots * KVINDEX_RECORD_BYTES;
	if ((uint64_t)st.st_size < sizeof(hd)) {
		snprintf(why, whylen, "it is %lld bytes, shorter than its header", (long long)st.st_size);
		return 0;
	}
	int rc = read_full(ix->fd, &hd, sizeof(hd), 0);
	if (rc)
		return errorf(why, whylen, rc, "cannot read spill index %s: %s", ix->path, strerror(-rc));
	uint32_t crc = hd.crc;
	hd.crc = 0;
	if (hd.magic != KVINDEX_MAGIC) {
		snprintf(why, whylen, "it is not a spill index (magic %016llx)", (unsigned long long)hd.magic);
		return 0;
	}
	if (crc32c(0, &hd, sizeof(hd)) != crc) {
		snprintf(why, whylen, "its header is corrupt (checksum mismatch)");
		return 0;
	}
	if (hd.version != KVINDEX_VERSION || hd.record_bytes != KVINDEX_RECORD_BYTES) {
		snprintf(why, whylen, "it is of version %u with %u-byte records; this kv-store writes version %d with "
			 "%u-byte records", hd.version, hd.record_bytes, KVINDEX_VERSION, KVINDEX_RECORD_BYTES);
		return 0;
	}
	header_make(&want, g);
	if (hd.block_bytes != want.block_bytes || hd.manifest_hash != want.manifest_hash ||
	    hd.n_slots != want.n_slots) {
		snprintf(why, whylen, "it describes %u spill blocks of %llu bytes for model %016llx, the pool now %u "
			 "blocks of %llu bytes for model %016llx", hd.n_slots, (unsigned long long)hd.block_bytes,
			 (unsigned long long)hd.manifest_hash, g->n_slots, (unsigned long long)g->block_bytes,
			 (unsigned long long)g->manifest_hash);
		return 0;
	}
	if ((uint64_t)st.st_size != size) {
		snprintf(why, whylen, "it is %lld bytes; %u records make %llu", (long long)st.st_size, g->n_slots,
			 (unsigned long long)size);
		return 0;
	}
	if (g->n_slots) {
		rc = read_full(ix->fd, recs, (size_t)g->n_slots * KVINDEX_RECORD_BYTES, KVINDEX_HEADER_BYTES);
		if (rc)
			return errorf(why, whylen, rc, "cannot read spill index %s: %s", ix->path, strerror(-rc));
	}
	for (uint32_t j = 0; j < g->n_slots; j++) {
		struct kvindex_record *r = &recs[j];
		if (r->in_use != 1)
			continue;
		if (r->crc != record_crc(r) || r->key == 0) {
			memset(r, 0, sizeof(*r));
			if (bad)
				(*bad)++;
		}
	}
	ix->n_slots = g->n_slots;
	return 1;
}

int kvindex_write_all(struct kvindex *ix, const struct kvindex_geometry *g, struct kvindex_record *recs,
		      char *err, size_t errlen)
{
	size_t len = KVINDEX_HEADER_BYTES + (size_t)g->n_slots * KVINDEX_RECORD_BYTES;
	char *buf = calloc(1, len);
	int rc;
	if (!buf)
		return errorf(err, errlen, -ENOMEM, "out of memory writing spill index %s", ix->path);
	header_make((struct kvindex_header *)buf, g);
	struct kvindex_record *out = (struct kvindex_record *)(buf + KVINDEX_HEADER_BYTES);
	for (uint32_t j = 0; recs && j < g->n_slots; j++) {
		if (recs[j].in_use != 1)
			continue;
		out[j] = recs[j];
		out[j].crc = record_crc(&out[j]);
	}
	rc = write_full(ix->fd, buf, len, 0);
	if (rc == 0 && ftruncate(ix->fd, (off_t)len) != 0)
		rc = -errno;
	if (rc)
		errorf(err, errlen, rc, "cannot write spill index %s: %s", ix->path, strerror(-rc));
	else
		ix->n_slots = g->n_slots;
	free(buf);
	return rc;
}

int kvindex_reset(struct kvindex *ix, const struct kvindex_geometry *g, char *err, size_t errlen)
{
	return kvindex_write_all(ix, g, NULL, err, errlen);
}

int kvindex_set(struct kvindex *ix, uint32_t slot, struct kvindex_record *r)
{
	assert(slot < ix->n_slots);
	r->crc = record_crc(r);
	return write_full(ix->fd, r, sizeof(*r), (off_t)(KVINDEX_HEADER_BYTES + (uint64_t)slot * KVINDEX_RECORD_BYTES));
}

int kvindex_clear(struct kvindex *ix, uint32_t slot)
{
	struct kvindex_record r;
	memset(&r, 0, sizeof(r));
	assert(slot < ix->n_slots);
	return write_full(ix->fd, &r, sizeof(r), (off_t)(KVINDEX_HEADER_BYTES + (uint64_t)slot * KVINDEX_RECORD_BYTES));
}

int kvindex_sync(struct kvindex *ix)
{
	return fdatasync(ix->fd) == 0 ? 0 : -errno;
}

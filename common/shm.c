#include "common/shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/proc.h"
#include "common/util.h"

struct shm_object {
	char name[SHM_NAME_MAX];
	void *base;
	size_t size;
};

int shm_object_name(const char *instance, const char *object, char *buf, size_t len)
{
	int n = snprintf(buf, len, "/llmp-%u-%s-%s", (unsigned)getuid(), instance, object);
	if (n < 0 || (size_t)n >= len || (size_t)n >= SHM_NAME_MAX)
		return -ENAMETOOLONG;
	return 0;
}

bool shm_owner_alive(const struct shm_header *h)
{
	return process_alive(atomic_load(&((struct shm_header *)h)->owner_pid), h->owner_start);
}

static int map_fd(int fd, size_t size, bool writable, void **base)
{
	void *p = mmap(NULL, size, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
	if (p == MAP_FAILED)
		return -errno;
	*base = p;
	return 0;
}

static void header_init(struct shm_header *h, size_t size, uint32_t kind, uint32_t version)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	memset(h, 0, sizeof(*h));
	h->magic = SHM_MAGIC;
	h->kind = kind;
	h->layout_version = version;
	h->total_size = size;
	h->instance_id = random_u64();
	atomic_store(&h->owner_pid, (int32_t)getpid());
	h->owner_start = process_start_time(getpid());
	h->created_unix_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Reads the header of the object open on fd into *h and its size into *size. Returns 1, or 0
 * when the object is too short to hold one (created, not sized yet). */
static int read_header(int fd, struct shm_header *h, size_t *size)
{
	struct stat st;
	if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(*h))
		return 0;
	if (pread(fd, h, sizeof(*h), 0) != (ssize_t)sizeof(*h))
		return 0;
	*size = (size_t)st.st_size;
	return 1;
}

int shm_object_owner(const char *name, int *owner_pid)
{
	int fd = shm_open(name, O_RDONLY | O_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	struct shm_header h;
	size_t size;
	int rc = read_header(fd, &h, &size) && h.magic == SHM_MAGIC && shm_owner_alive(&h);
	if (rc)
		*owner_pid = (int)atomic_load(&h.owner_pid);
	close(fd);
	return rc;
}

/* Is the object open on fd this user's, and private to it (no group or other permission bits)?
 * 0; -EPERM, logged, where another user owns it (/dev/shm is everyone's: a name can be taken
 * first); -EACCES where it is ours but others may open it; -errno of fstat. */
static int check_private(int fd, const char *name)
{
	struct stat st;
	if (fstat(fd, &st) != 0)
		return -errno;
	if (st.st_uid != geteuid()) {
		log_error("shared-memory object %s belongs to uid %u, not to this user (uid %u): it is not used; "
			  "remove it (/dev/shm%s) or pick another --instance",
			  name, (unsigned)st.st_uid, (unsigned)geteuid(), name);
		return -EPERM;
	}
	return (st.st_mode & 077) ? -EACCES : 0;
}

/* Looks at a leftover object: returns 1 if adoptable, 0 if it should be reclaimed, -EBUSY
 * if its owner lives, -EPERM if another user owns it. A leftover too short to hold a header
 * counts as dead; one of ours that others may open is reclaimed, never adopted. */
static int inspect_leftover(const char *name, size_t size, uint32_t kind, uint32_t version)
{
	int fd = shm_open(name, O_RDONLY | O_CLOEXEC, 0);
	if (fd < 0 && errno == EACCES) {
		/* Not ours to read: another user's (mode 0600 keeps us out). */
		log_error("shared-memory object %s is another user's (not readable by this user): it is not used; "
			  "remove it (/dev/shm%s) or pick another --instance",
			  name, name);
		return -EPERM;
	}
	if (fd < 0)
		return errno == ENOENT ? 0 : -errno;
	int rc = check_private(fd, name);
	if (rc == -EACCES) {
		log_warn("shared-memory object %s is open to other users: it is laid out anew", name);
		rc = 0;
		goto out_close;
	}
	if (rc)
		goto out_close;
	struct shm_header h;
	size_t st_size;
	if (!read_header(fd, &h, &st_size))
		goto out_close;
	if (h.magic == SHM_MAGIC && shm_owner_alive(&h)) {
		rc = -EBUSY;
		log_error("shared-memory object %s is owned by the live process %d: stop that instance first "
			  "(scripts/pipeline stop) or pick another --instance",
			  name, (int)h.owner_pid);
		goto out_close;
	}
	if (h.magic == SHM_MAGIC && h.kind == kind && h.layout_version == version && h.total_size == size &&
	    st_size == size && atomic_load(&h.ready))
		rc = 1;
out_close:
	close(fd);
	return rc;
}

int shm_object_create(const char *name, size_t size, uint32_t kind, uint32_t layout_version,
		      enum shm_leftover policy, struct shm_object **out, bool *adopted)
{
	if (!name || name[0] != '/' || strchr(name + 1, '/') || strlen(name) >= SHM_NAME_MAX ||
	    size < sizeof(struct shm_header))
		return -EINVAL;
	if (adopted)
		*adopted = false;
	struct shm_object *o = calloc(1, sizeof(*o));
	if (!o)
		return -ENOMEM;
	str_copy(o->name, sizeof(o->name), name);
	o->size = size;
	int rc, fd = -1;

	for (int attempt = 0; attempt < 3; attempt++) {
		fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
		if (fd >= 0)
			break;
		if (errno != EEXIST) {
			rc = -errno;
			goto out_free;
		}
		rc = inspect_leftover(name, size, kind, layout_version);
		if (rc < 0)
			goto out_free;
		if (rc == 1 && policy == SHM_ADOPT) {
			fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
			if (fd < 0) {
				rc = -errno;
				goto out_free;
			}
			rc = map_fd(fd, size, true, &o->base);
			close(fd);
			if (rc)
				goto out_free;
			struct shm_header *h = o->base;
			atomic_store(&h->owner_pid, (int32_t)getpid());
			h->owner_start = process_start_time(getpid());
			h->adoptions++;
			log_info("adopted shared-memory object %s left by a dead owner", name);
			if (adopted)
				*adopted = true;
			*out = o;
			return 0;
		}
		log_info("reclaiming shared-memory object %s left by a dead instance", name);
		if (shm_unlink(name) != 0 && errno != ENOENT) {
			rc = -errno;
			goto out_free;
		}
	}
	if (fd < 0) {
		rc = -EEXIST;
		goto out_free;
	}
	/* shm_open applies the umask; make the mode exactly 0600 whatever it is. */
	if (fchmod(fd, 0600) != 0 || ftruncate(fd, (off_t)size) != 0) {
		rc = -errno;
		goto out_unlink;
	}
	rc = map_fd(fd, size, true, &o->base);
	if (rc)
		goto out_unlink;
	close(fd);
	header_init(o->base, size, kind, layout_version);
	*out = o;
	return 0;

out_unlink:
	close(fd);
	shm_unlink(name);
out_free:
	free(o);
	return rc;
}

int shm_room(uint64_t *free_bytes)
{
	struct statvfs vfs;
	if (statvfs("/dev/shm", &vfs) != 0)
		return -errno;
	*free_bytes = (uint64_t)vfs.f_bavail * (uint64_t)vfs.f_frsize;
	return 0;
}

int shm_object_resident(const struct shm_object *o, uint64_t *bytes)
{
	int fd = shm_open(o->name, O_RDONLY | O_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	struct stat st;
	int rc = fstat(fd, &st) == 0 ? 0 : -errno;
	close(fd);
	if (rc == 0)
		*bytes = (uint64_t)st.st_blocks * 512u;
	return rc;
}

int shm_object_attach(const char *name, uint32_t kind, uint32_t layout_version, bool writable,
		      struct shm_object **out)
{
	int fd = shm_open(name, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC, 0);
	if (fd < 0 && errno == EACCES) {
		log_error("shared-memory object %s is another user's (not open to this user): it is not used", name);
		return -EPERM;
	}
	if (fd < 0)
		return -errno;
	struct stat st;
	int rc = check_private(fd, name);
	if (rc == -EACCES) {
		log_error("shared-memory object %s is open to other users (not 0600): it is not used", name);
		rc = -EPERM;
	}
	if (rc)
		goto out_close;
	if (fstat(fd, &st) != 0) {
		rc = -errno;
		goto out_close;
	}
	if ((size_t)st.st_size < sizeof(struct shm_header)) {
		rc = -EAGAIN; /* created but not sized yet */
		goto out_close;
	}
	struct shm_object *o = calloc(1, sizeof(*o));
	if (!o) {
		rc = -ENOMEM;
		goto out_close;
	}
	str_copy(o->name, sizeof(o->name), name);
	o->size = (size_t)st.st_size;
	rc = map_fd(fd, o->size, writable, &o->base);
	if (rc) {
		free(o);
		goto out_close;
	}
	close(fd);
	struct shm_header *h = o->base;
	/* Pairs with the release store in shm_object_set_ready. */
	if (!atomic_load_explicit(&h->ready, memory_order_acquire)) {
		rc = -EAGAIN;
		goto out_unmap;
	}
	if (h->magic != SHM_MAGIC || h->kind != kind || h->layout_version != layout_version ||
	    h->total_size != o->size) {
		rc = -EPROTO;
		goto out_unmap;
	}
	*out = o;
	return 0;

out_unmap:
	munmap(o->base, o->size);
	free(o);
	return rc;
out_close:
	close(fd);
	return rc;
}

void *shm_object_base(const struct shm_object *o)
{
	return o->base;
}

size_t shm_object_size(const struct shm_object *o)
{
	return o->size;
}

const char *shm_object_get_name(const struct shm_object *o)
{
	return o->name;
}

void shm_object_set_ready(struct shm_object *o)
{
	struct shm_header *h = o->base;
	atomic_store_explicit(&h->ready, 1, memory_order_release);
}

void shm_object_close(struct shm_object **op, bool unlink)
{
	if (!op || !*op)
		return;
	struct shm_object *o = *op;
	if (o->base)
		munmap(o->base, o->size);
	if (unlink)
		shm_unlink(o->name);
	free(o);
	*op = NULL;
}

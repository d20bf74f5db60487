/* synthetic_files.c - what both writers (safetensors: synthetic_write.c, GGUF:
 * synthetic_gguf_write.c) do with files: directories made with their parents, the list of what
 * was created (so a failure removes it), whole writes, and the large sequential writes of the
 * weight files past the page cache (O_DIRECT). */
#include "tools/make-synthetic-model/synthetic_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

int syn_created_add(struct created *cr, const char *path)
{
	if (cr->n == cr->cap) {
		uint32_t cap = cr->cap ? 2 * cr->cap : 16;
		void *np = realloc(cr->paths, cap * sizeof(*cr->paths));
		if (!np)
			return -ENOMEM;
		cr->paths = np;
		cr->cap = cap;
	}
	str_copy(cr->paths[cr->n++], PATH_MAX, path);
	return 0;
}

void syn_created_remove(struct created *files, struct created *dirs)
{
	for (uint32_t i = files->n; i-- > 0;)
		unlink(files->paths[i]);
	for (uint32_t i = dirs->n; i-- > 0;)
		rmdir(dirs->paths[i]);
}

int syn_write_all(int fd, const void *buf, size_t len)
{
	const char *p = buf;
	while (len) {
		ssize_t n = write(fd, p, len);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		if (n == 0)
			return -EIO;
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

const char *syn_why(int rc)
{
	return rc == -ENOSPC ? "no space left on device" : strerror(-rc);
}

int syn_write_small_file(const char *dir, const char *name, const struct sbuf *s, struct created *cr, char *err,
			 size_t errlen)
{
	char path[PATH_MAX];
	if (snprintf(path, sizeof(path), "%s/%s", dir, name) >= (int)sizeof(path))
		return errorf(err, errlen, -ENAMETOOLONG, "%s/%s: path too long", dir, name);
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return errorf(err, errlen, -errno, "cannot create %s: %s", path, strerror(errno));
	int rc = syn_created_add(cr, path);
	if (!rc)
		rc = syn_write_all(fd, s->p, s->len);
	if (close(fd) != 0 && !rc)
		rc = -errno;
	if (rc)
		return errorf(err, errlen, rc, "writing %s: %s", path, syn_why(rc));
	return 0;
}

int syn_make_dirs(const char *dir, struct created *dirs, char *err, size_t errlen)
{
	char path[PATH_MAX];
	if (str_copy(path, sizeof(path), dir))
		return errorf(err, errlen, -ENAMETOOLONG, "%s: path too long", dir);
	size_t n = strlen(path);
	while (n > 1 && path[n - 1] == '/')
		path[--n] = 0;
	for (char *p = path + 1;; p++) {
		if (*p != '/' && *p != 0)
			continue;
		char save = *p;
		*p = 0;
		if (mkdir(path, 0755) == 0) {
			if (syn_created_add(dirs, path))
				return errorf(err, errlen, -ENOMEM, "out of memory");
		} else if (errno != EEXIST) {
			return errorf(err, errlen, -errno, "cannot create directory %s: %s", path, strerror(errno));
		}
		*p = save;
		if (!save)
			break;
	}
	struct stat st;
	if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
		return errorf(err, errlen, -ENOTDIR, "%s exists and is not a directory", path);
	return 0;
}

int syn_find_in_dir(const char *dir, bool (*match)(const char *name, const void *ctx), const void *ctx, char *path,
		    size_t len)
{
	DIR *d = opendir(dir);
	if (!d)
		return 0;
	int found = 0;
	struct dirent *e;
	while (!found && (e = readdir(d)))
		if (match(e->d_name, ctx))
			found = snprintf(path, len, "%s/%s", dir, e->d_name) < (int)len;
	closedir(d);
	return found;
}

int syn_open_weights(const char *path)
{
	/* O_DIRECT: many GB through the page cache cost a copy and reclaim, and evict what
	 * everyone else had cached; where the file system refuses it, buffered writes. */
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
	if (fd < 0 && errno == EINVAL)
		fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	return fd < 0 ? -errno : fd;
}

int syn_write_direct(int fd, const void *buf, size_t len)
{
	const uint8_t *data = buf;
	int fl = fcntl(fd, F_GETFL);
	if (fl < 0)
		return -errno;
	size_t direct = fl & O_DIRECT ? len & ~(size_t)(SYN_DIRECT_ALIGN - 1) : 0;
	int rc = direct ? syn_write_all(fd, data, direct) : 0;
	if (rc == -EINVAL && fcntl(fd, F_SETFL, fl & ~O_DIRECT) == 0) {
		direct = 0;
		rc = 0;
	}
	if (rc || direct == len)
		return rc;
	if ((fl & O_DIRECT) && fcntl(fd, F_SETFL, fl & ~O_DIRECT) != 0)
		return -errno;
	return syn_write_all(fd, data + direct, len - direct);
}

#include "common/util.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int parse_size(const char *text, uint64_t *out)
{
	if (!text || !*text)
		return -EINVAL;
	errno = 0;
	char *end = NULL;
	double v = strtod(text, &end);
	/* "inf" and "nan" are not sizes; a number too large for a double ("1e400") is out of range. */
	if (end == text || !(v >= 0) || (isinf(v) && errno != ERANGE))
		return -EINVAL;
	while (*end == ' ')
		end++;
	static const struct {
		const char *suffix;
		double mult;
	} units[] = {
		{"", 1},		  {"B", 1},		    {"K", 1024.0},	      {"KiB", 1024.0},
		{"KB", 1e3},		  {"M", 1048576.0},	    {"MiB", 1048576.0},	      {"MB", 1e6},
		{"G", 1073741824.0},	  {"GiB", 1073741824.0},    {"GB", 1e9},	      {"T", 1099511627776.0},
		{"TiB", 1099511627776.0}, {"TB", 1e12},
	};
	for (size_t i = 0; i < ARRAY_SIZE(units); i++) {
		if (strcasecmp(end, units[i].suffix) == 0) {
			double bytes = v * units[i].mult;
			if (!(bytes < 0x1p63)) /* 2^63 is exact in a double; below it the cast cannot overflow */
				return -ERANGE;
			*out = (uint64_t)(bytes + 0.5);
			return 0;
		}
	}
	return -EINVAL;
}

char *format_size(uint64_t bytes, char *buf, size_t len)
{
	static const char *const names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
	double v = (double)bytes;
	int i = 0;
	while (v >= 1024.0 && i < 4) {
		v /= 1024.0;
		i++;
	}
	if (i == 0)
		snprintf(buf, len, "%llu B", (unsigned long long)bytes);
	else
		snprintf(buf, len, "%.2f %s", v, names[i]);
	return buf;
}

uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

double now_s(void)
{
	return (double)now_ns() * 1e-9;
}

uint64_t fnv1a64(uint64_t h, const void *data, size_t len)
{
	const unsigned char *p = data;
	for (size_t i = 0; i < len; i++) {
		h ^= p[i];
		h *= 0x100000001b3ull;
	}
	return h;
}

/* Slicing-by-8 CRC-32C tables, built once (pthread_once: two threads filling the tables at
 * the same time while a third reads them would be a data race, even writing equal values). */
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void)
{
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;
		for (int k = 0; k < 8; k++)
			c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
		crc_table[0][i] = c;
	}
	for (uint32_t i = 0; i < 256; i++)
		for (int t = 1; t < 8; t++)
			crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

#if defined(__x86_64__)
/* SSE4.2 has CRC-32C in hardware: about five times the table's speed (the kv-store checksums
 * every committed KV block, so this is on the prefill path). */
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const void *data, size_t len)
{
	const unsigned char *p = data;
	uint64_t c = ~crc;
	while (len && ((uintptr_t)p & 7)) {
		c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
		len--;
	}
	while (len >= 8) {
		uint64_t w;
		memcpy(&w, p, 8);
		c = __builtin_ia32_crc32di(c, w);
		p += 8;
		len -= 8;
	}
	while (len--)
		c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
	return ~(uint32_t)c;
}
#endif


uint32_t crc32c(uint32_t crc, const void *data, size_t len)
{
#if defined(__x86_64__)
	static int hw = -1; /* racing first callers compute the same answer */
	if (hw < 0)
		hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
	if (hw)
		return crc32c_hw(crc, data, len);
#endif
	return crc32c_portable(crc, data, len);
}

uint32_t crc32c_portable(uint32_t crc, const void *data, size_t len)
{
	int rc = pthread_once(&crc_once, crc_init);
	assert(rc == 0);
	(void)rc;
	const unsigned char *p = data;
	crc = ~crc;
	while (len && ((uintptr_t)p & 7)) {
		crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
		len--;
	}
	while (len >= 8) {
		uint64_t w;
		memcpy(&w, p, 8);
		w ^= crc;
		crc = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^ crc_table[5][(w >> 16) & 0xff] ^
		      crc_table[4][(w >> 24) & 0xff] ^ crc_table[3][(w >> 32) & 0xff] ^
		      crc_table[2][(w >> 40) & 0xff] ^ crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
		p += 8;
		len -= 8;
	}
	while (len--)
		crc = (crc >> 8) ^ crc_table[0][(crc ^ *p++) & 0xff];
	return ~crc;
}

uint64_t random_u64(void)
{
	uint64_t v;
	if (getrandom(&v, sizeof(v), 0) == (ssize_t)sizeof(v))
		return v;
	return now_ns() ^ ((uint64_t)getpid() << 32);
}

int pid_alive(int pid)
{
	if (pid <= 0)
		return 0;
	return kill(pid, 0) == 0 || errno == EPERM;
}

int str_has_prefix(const char *s, const char *prefix)
{
	return strncmp(s, prefix, strlen(prefix)) == 0;
}

int str_copy(char *dst, size_t len, const char *src)
{
	assert(len > 0); /* no room even for the NUL: a caller's mistake */
	size_t n = strlen(src);
	if (n >= len) {
		memcpy(dst, src, len - 1);
		dst[len - 1] = 0;
		return -ENAMETOOLONG;
	}
	memcpy(dst, src, n + 1);
	return 0;
}

int errorf(char *err, size_t errlen, int rc, const char *fmt, ...)
{
	if (err && errlen) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(err, errlen, fmt, ap);
		va_end(ap);
	}
	return rc;
}

int write_file_atomic(const char *path, const char *text, size_t len)
{
	/* A temporary name of this process's own: two writers of one path (two supervisors started
	 * for one run directory at once) must not rename each other's file away. */
	char tmp[PATH_MAX + 32];
	if (snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid()) >= (int)sizeof(tmp))
		return -ENAMETOOLONG;
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (fd < 0)
		return -errno;
	int rc = write(fd, text, len) == (ssize_t)len ? 0 : -EIO;
	if (close(fd) != 0 && !rc)
		rc = -errno;
	if (!rc && rename(tmp, path) != 0)
		rc = -errno;
	if (rc)
		unlink(tmp);
	return rc;
}

void file_id_of(const struct stat *st, struct file_id *id)
{
	id->dev = (uint64_t)st->st_dev;
	id->ino = (uint64_t)st->st_ino;
	id->size = (uint64_t)st->st_size;
	id->mtime_s = (int64_t)st->st_mtim.tv_sec;
	id->mtime_ns = (int64_t)st->st_mtim.tv_nsec;
	id->ctime_s = (int64_t)st->st_ctim.tv_sec;
	id->ctime_ns = (int64_t)st->st_ctim.tv_nsec;
}

int file_id_same(const struct file_id *a, const struct file_id *b)
{
	return a->dev == b->dev && a->ino == b->ino && a->size == b->size && a->mtime_s == b->mtime_s &&
	       a->mtime_ns == b->mtime_ns && a->ctime_s == b->ctime_s && a->ctime_ns == b->ctime_ns;
}

const char *file_id_text(const struct file_id *id, char *buf, size_t len)
{
	snprintf(buf, len, "%llu bytes modified at %lld.%09lld (changed at %lld.%09lld)", (unsigned long long)id->size,
		 (long long)id->mtime_s, (long long)id->mtime_ns, (long long)id->ctime_s, (long long)id->ctime_ns);
	return buf;
}

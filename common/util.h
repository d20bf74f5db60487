/* util.h - small helpers every module needs: sizes, clocks, hashes, checksums.
 *
 * Sizes are written like "6GiB", "512MiB", "1.5GB", "4096" (bytes). */
#ifndef PIPELINE_UTIL_H
#define PIPELINE_UTIL_H
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define ALIGN_UP(x, a) (((x) + ((a)-1)) & ~((__typeof__(x))(a)-1))
#define CACHE_LINE 64

/* Parses a byte size. Returns 0, or -EINVAL for text that is not a size, -ERANGE past 2^63. */
int parse_size(const char *text, uint64_t *out);
/* Formats bytes as "1.50 GiB" into buf. Returns buf. */
char *format_size(uint64_t bytes, char *buf, size_t len);

/* Monotonic clock in nanoseconds / seconds. */
uint64_t now_ns(void);
double now_s(void);

/* FNV-1a 64 over bytes, continuing from h (start with FNV64_INIT). */
#define FNV64_INIT 0xcbf29ce484222325ull
uint64_t fnv1a64(uint64_t h, const void *data, size_t len);

/* CRC-32C (Castagnoli) continuing from crc (start with 0): in hardware where the CPU has it
 * (SSE4.2), else crc32c_portable, the table version that every machine runs. */
uint32_t crc32c(uint32_t crc, const void *data, size_t len);
uint32_t crc32c_portable(uint32_t crc, const void *data, size_t len);

/* Formats a message into err (of errlen bytes) and returns rc: the one-line error path
 * `return errorf(err, errlen, -EINVAL, "tensor %s: ...", name);`. */
int errorf(char *err, size_t errlen, int rc, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* A random 64-bit value from getrandom(2) (falls back to time and pid). */
uint64_t random_u64(void);

/* Is process pid alive (kill(pid, 0) succeeds or fails with EPERM)? */
int pid_alive(int pid);

/* Starts-with / copy helpers for bounded strings. */
int str_has_prefix(const char *s, const char *prefix);
/* Copies src (NUL-terminated) into dst of size len, always NUL-terminated. Returns -ENAMETOOLONG if cut. */
int str_copy(char *dst, size_t len, const char *src);
/* Writes len bytes of text to path (mode 0600) through path.tmp.PID and a rename, so that a reader
 * never sees half of it. Returns 0 or -errno; the temporary file does not stay. */
int write_file_atomic(const char *path, const char *text, size_t len);

/* A file's identity as fstat(2) gives it: the same inode with the same size, modification and
 * change times is the same bytes (a rewrite in place moves the change time even where it puts the
 * modification time back, as cp -p and rsync -t do). ino 0: not recorded. */
struct file_id {
	uint64_t dev, ino, size;
	int64_t mtime_s, mtime_ns, ctime_s, ctime_ns;
};
struct stat;
void file_id_of(const struct stat *st, struct file_id *id);
/* Does b still name the file a was (both recorded)? */
int file_id_same(const struct file_id *a, const struct file_id *b);
/* "N bytes modified at S.NS (changed at S.NS)" into buf. */
const char *file_id_text(const struct file_id *id, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif

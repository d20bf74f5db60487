/* proc.c - /proc/PID/stat and /proc/PID/cmdline read once, for everyone (proc.h). */
#include "common/proc.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/util.h"

/* Reads the whole of a small /proc file into buf (NUL-terminated). Returns the bytes read, or
 * -errno. */
static ssize_t read_small(const char *path, char *buf, size_t len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	size_t n = 0;
	while (n < len - 1) {
		ssize_t r = read(fd, buf + n, len - 1 - n);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			int e = errno;
			close(fd);
			return -e;
		}
		if (r == 0)
			break;
		n += (size_t)r;
	}
	close(fd);
	buf[n] = 0;
	return (ssize_t)n;
}

int proc_read(int pid, struct proc_info *info)
{
	if (pid <= 0)
		return -EINVAL;
	char path[64], buf[1024];
	snprintf(path, sizeof(path), "/proc/%d/stat", pid);
	ssize_t n = read_small(path, buf, sizeof(buf));
	if (n <= 0)
		return -ENOENT; /* gone (ESRCH on a read of an exiting process), or no procfs */
	const char *open_paren = strchr(buf, '(');
	const char *close_paren = strrchr(buf, ')');
	if (!open_paren || !close_paren || close_paren < open_paren)
		return -EPROTO;
	/* Fields 3 to 22 after ") ": state ppid pgrp session tty tpgid flags minflt cminflt majflt
	 * cmajflt utime stime cutime cstime priority nice threads itrealvalue starttime. */
	struct proc_info pi = {0};
	unsigned long long utime, stime, start;
	if (sscanf(close_paren + 1, " %c %d %d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d %*d %llu",
		   &pi.state, &pi.ppid, &pi.pgrp, &utime, &stime, &start) != 6)
		return -EPROTO;
	pi.cpu_ticks = utime + stime;
	pi.start_ticks = start;
	size_t comm_len = (size_t)(close_paren - open_paren - 1);
	if (comm_len >= sizeof(pi.comm))
		comm_len = sizeof(pi.comm) - 1;
	memcpy(pi.comm, open_paren + 1, comm_len);
	pi.comm[comm_len] = 0;
	*info = pi;
	return 0;
}

bool proc_running(int pid)
{
	return process_alive(pid, 0);
}

uint64_t process_start_time(int pid)
{
	struct proc_info pi;
	return proc_read(pid, &pi) == 0 ? pi.start_ticks : 0;
}

bool process_alive(int pid, uint64_t start_time)
{
	if (!pid_alive(pid))
		return false;
	struct proc_info pi;
	if (proc_read(pid, &pi) != 0)
		/* No /proc, or the process exited after kill(pid, 0): ask kill again. */
		return pid_alive(pid);
	/* An exited process that its parent has not reaped yet is a zombie: it owns nothing. */
	if (pi.state == 'Z' || pi.state == 'X')
		return false;
	return start_time == 0 || pi.start_ticks == start_time;
}

uint64_t proc_age_ms(const struct proc_info *info)
{
	struct timespec ts;
	long hz = sysconf(_SC_CLK_TCK);
	/* start_ticks counts from boot on the clock that CLOCK_BOOTTIME reads (suspend included). */
	if (hz <= 0 || clock_gettime(CLOCK_BOOTTIME, &ts) != 0)
		return 0;
	uint64_t now_ms = (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
	uint64_t start_ms = info->start_ticks * 1000u / (uint64_t)hz;
	return now_ms > start_ms ? now_ms - start_ms : 0;
}

int proc_cmdline(int pid, char *buf, size_t len, size_t *n)
{
	*n = 0;
	if (pid <= 0)
		return -ENOENT;
	char path[64];
	snprintf(path, sizeof(path), "/proc/%d/cmdline", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -ENOENT;
	int rc = 0;
	while (*n < len) {
		ssize_t r = read(fd, buf + *n, len - *n);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			rc = -ENOENT; /* it exited while we read */
			break;
		}
		if (r == 0)
			break;
		*n += (size_t)r;
	}
	if (!rc && *n == len) {
		char extra;
		ssize_t r;
		do
			r = read(fd, &extra, 1);
		while (r < 0 && errno == EINTR);
		if (r > 0)
			rc = -E2BIG;
	}
	close(fd);
	return rc;
}

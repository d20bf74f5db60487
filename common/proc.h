/* proc.h - what Linux's /proc says about a process: the one reader of /proc/PID/stat and
 * /proc/PID/cmdline in the tree (shared-memory owners, the supervisor's health checks, the
 * clients' "is it still there").
 *
 *   struct proc_info pi;
 *   if (proc_read(pid, &pi) == 0 && pi.state == 'T') ...   // stopped (SIGSTOP, a debugger)
 *   if (!proc_running(pid)) ...                             // gone, or a zombie: it has exited
 *   uint64_t t = process_start_time(pid);                   // recorded with the pid ...
 *   if (!process_alive(pid, t)) ...                         // ... so that a reused pid is not taken for it
 *
 * The fields of /proc/PID/stat come after the command name, which may hold spaces and
 * parentheses: they are read after the line's last ')'. Without procfs (another OS, a hidepid
 * mount) proc_read fails with -ENOENT and the liveness checks fall back to kill(pid, 0). */
#ifndef PIPELINE_PROC_H
#define PIPELINE_PROC_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

#define PROC_COMM_MAX 64 /* bytes of comm kept, the NUL included (Linux's names have 15) */

struct proc_info {
	char state;	      /* R running, S sleeping, D disk wait, T/t stopped, Z zombie, X dead, ... */
	int ppid;
	int pgrp;	      /* its process group */
	uint64_t cpu_ticks;   /* user + system time used so far, clock ticks */
	uint64_t start_ticks; /* when it started, clock ticks since boot (stat's field 22) */
	char comm[PROC_COMM_MAX]; /* the command name (stat's field 2, without the parentheses) */
};

/* Reads /proc/<pid>/stat into *info. Returns 0; -EINVAL for pid <= 0; -ENOENT when there is no
 * such process (or no procfs); -EPROTO when the line does not parse. *info is left as it was on
 * failure. */
int proc_read(int pid, struct proc_info *info);

/* Is pid a live process that has not exited (not a zombie waiting for its parent)? */
bool proc_running(int pid);

/* Start time of pid in clock ticks since boot (proc_info.start_ticks), 0 if unknown. */
uint64_t process_start_time(int pid);

/* Is pid a live process (not a zombie) that started at start_time (process_start_time; 0: at
 * any time, which does not guard against the pid's reuse)? */
bool process_alive(int pid, uint64_t start_time);

/* Milliseconds since the process of info started (what `ps -o etimes` counts). */
uint64_t proc_age_ms(const struct proc_info *info);

/* Reads /proc/<pid>/cmdline, the words of its command line each ended by a NUL, into buf (len
 * bytes) and sets *n to the bytes read. Returns 0; -ENOENT when there is no such process;
 * -E2BIG when the line is longer than buf (buf then holds its first len bytes, *n == len). */
int proc_cmdline(int pid, char *buf, size_t len, size_t *n);

#ifdef __cplusplus
}
#endif
#endif

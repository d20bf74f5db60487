/* test_proc.c - common/proc.c: the fields of /proc/PID/stat (a command name with spaces and
 * parentheses included), the states a process goes through (running, stopped, zombie, gone),
 * the start-time guard against a reused pid, and the command line. */
#include <check.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/proc.h"
#include "tests/unit/common/test_helpers.h"

/* Field 22 of /proc/<pid>/stat, read independently of proc.c. */
static unsigned long long start_field(pid_t pid)
{
	char path[64], buf[2048];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	FILE *f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	char *p = strrchr(buf, ')');
	ck_assert_ptr_nonnull(p);
	unsigned long long v = 0;
	int got = sscanf(p + 2, "%*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %llu",
			 &v);
	ck_assert_int_eq(got, 1);
	return v;
}

/* A child that names itself name, then waits (pause) until killed. Returns its pid once the name
 * is set. */
static pid_t spawn_named(const char *name)
{
	int p[2];
	ck_assert_int_eq(pipe(p), 0);
	pid_t child = fork();
	ck_assert_int_ge(child, 0);
	if (child == 0) {
		prctl(PR_SET_NAME, name);
		char c = 1;
		ssize_t w = write(p[1], &c, 1);
		(void)w;
		for (;;)
			pause();
	}
	close(p[1]);
	char c;
	ck_assert_int_eq(read(p[0], &c, 1), 1);
	close(p[0]);
	return child;
}

static void reap(pid_t pid)
{
	int st;
	kill(pid, SIGKILL);
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
}

/* Waits (bounded) until pid's state is one of states. */
static char wait_state(pid_t pid, const char *states)
{
	struct proc_info pi = {0};
	for (int i = 0; i < 500; i++) {
		if (proc_read(pid, &pi) == 0 && strchr(states, pi.state))
			return pi.state;
		struct timespec ts = {0, 10 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
	ck_abort_msg("pid %d never reached a state of '%s' (last '%c')", (int)pid, states, pi.state);
	return 0;
}

START_TEST(test_read_self)
{
	struct proc_info pi;
	ck_assert_int_eq(proc_read(getpid(), &pi), 0);
	ck_assert_int_eq(pi.state, 'R'); /* reading its own stat, it runs */
	ck_assert_int_eq(pi.ppid, getppid());
	ck_assert_int_eq(pi.pgrp, getpgrp());
	ck_assert_uint_eq(pi.start_ticks, start_field(getpid()));
	ck_assert_uint_ne(pi.start_ticks, 0);
	ck_assert_uint_eq(process_start_time(getpid()), pi.start_ticks);
	ck_assert_uint_eq(process_start_time(getpid()), pi.start_ticks); /* stable */
	ck_assert_uint_le(process_start_time(1), pi.start_ticks);
	/* It burns CPU time: the ticks grow. */
	uint64_t before = pi.cpu_ticks;
	long hz = sysconf(_SC_CLK_TCK);
	struct timespec t0, t;
	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t0);
	do
		clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
	while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < 3 * 1000000000L / hz);
	ck_assert_int_eq(proc_read(getpid(), &pi), 0);
	ck_assert_uint_gt(pi.cpu_ticks, before);
	/* It started before now and after boot. */
	ck_assert_uint_lt(proc_age_ms(&pi), 24ull * 3600 * 1000 * 365);
	struct proc_info init;
	ck_assert_int_eq(proc_read(1, &init), 0);
	ck_assert_uint_le(init.start_ticks, pi.start_ticks);
	ck_assert_uint_ge(proc_age_ms(&init), proc_age_ms(&pi));
}
END_TEST

START_TEST(test_read_bad_pids)
{
	struct proc_info pi = {.state = 'q'};
	ck_assert_int_eq(proc_read(0, &pi), -EINVAL);
	ck_assert_int_eq(proc_read(-5, &pi), -EINVAL);
	ck_assert_int_eq(proc_read(0x3fffffff, &pi), -ENOENT); /* past pid_max */
	ck_assert_int_eq(pi.state, 'q');		       /* untouched on failure */
	ck_assert_uint_eq(process_start_time(0), 0);
	ck_assert_uint_eq(process_start_time(-5), 0);
	ck_assert_uint_eq(process_start_time(0x3fffffff), 0);
	ck_assert(!proc_running(0));
	ck_assert(!proc_running(-1));
	ck_assert(!proc_running(0x3fffffff));
}
END_TEST

START_TEST(test_comm_with_parentheses)
{
	/* A command name with spaces and parentheses does not shift the fields. */
	pid_t child = spawn_named("a) b (c) 1 2 3");
	struct proc_info pi;
	ck_assert_int_eq(proc_read(child, &pi), 0);
	ck_assert_str_eq(pi.comm, "a) b (c) 1 2 3");
	ck_assert_int_eq(pi.ppid, getpid());
	ck_assert_int_eq(pi.pgrp, getpgrp());
	ck_assert_uint_eq(pi.start_ticks, start_field(child));
	ck_assert_uint_eq(process_start_time(child), start_field(child));
	ck_assert_uint_ge(pi.start_ticks, process_start_time(getpid()));
	wait_state(child, "S"); /* in pause() */
	reap(child);
}
END_TEST

START_TEST(test_states)
{
	pid_t child = spawn_named("proc-states");
	uint64_t start = process_start_time(child);
	ck_assert(proc_running(child));
	ck_assert(process_alive(child, start));
	ck_assert(process_alive(child, 0));
	ck_assert(!process_alive(child, start + 1)); /* another process under the same pid */

	/* Stopped: alive, state T. */
	kill(child, SIGSTOP);
	int st;
	ck_assert_int_eq(waitpid(child, &st, WUNTRACED), child);
	ck_assert(WIFSTOPPED(st));
	ck_assert_int_eq(wait_state(child, "Tt"), 'T');
	ck_assert(proc_running(child));

	/* Exited, not reaped: a zombie, which kill(0) still finds but which runs no more. */
	kill(child, SIGKILL);
	ck_assert_int_eq(waitid(P_PID, (id_t)child, NULL, WEXITED | WNOWAIT), 0);
	ck_assert_int_eq(wait_state(child, "ZX"), 'Z');
	ck_assert(!proc_running(child));
	ck_assert(!process_alive(child, start));
	ck_assert(!process_alive(child, 0));

	/* Reaped: gone. */
	ck_assert_int_eq(waitpid(child, &st, 0), child);
	struct proc_info pi;
	ck_assert_int_eq(proc_read(child, &pi), -ENOENT);
	ck_assert(!proc_running(child));
	ck_assert_uint_eq(process_start_time(child), 0);
}
END_TEST

START_TEST(test_cmdline)
{
	/* Our own: the test program's path first, NUL-separated. */
	char buf[4096];
	size_t n = 0;
	ck_assert_int_eq(proc_cmdline(getpid(), buf, sizeof(buf), &n), 0);
	ck_assert_uint_gt(n, 0);
	ck_assert_int_eq(buf[n - 1], 0);
	ck_assert_ptr_nonnull(strstr(buf, "test_common_proc"));

	/* A child run with words of our choosing (a space inside one stays in it). */
	pid_t child = fork();
	ck_assert_int_ge(child, 0);
	if (child == 0) {
		execl("/bin/sh", "sh", "-c", "while :; do sleep 1; done", "sh", "--run-dir=/tmp/a b", (char *)NULL);
		_exit(127);
	}
	char want[] = "sh\0" "-c\0" "while :; do sleep 1; done\0" "sh\0" "--run-dir=/tmp/a b";
	int rc = -1;
	for (int i = 0; i < 500; i++) {
		rc = proc_cmdline(child, buf, sizeof(buf), &n);
		if (rc == 0 && n == sizeof(want) && !memcmp(buf, want, n))
			break;
		struct timespec ts = {0, 10 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
	ck_assert_int_eq(rc, 0);
	ck_assert_uint_eq(n, sizeof(want));
	ck_assert_mem_eq(buf, want, n);

	/* Cut to the buffer: -E2BIG, the first bytes kept. */
	char small[8];
	ck_assert_int_eq(proc_cmdline(child, small, sizeof(small), &n), -E2BIG);
	ck_assert_uint_eq(n, sizeof(small));
	ck_assert_mem_eq(small, want, sizeof(small));
	/* Exactly the size of the line: not cut. */
	char exact[sizeof(want)];
	ck_assert_int_eq(proc_cmdline(child, exact, sizeof(exact), &n), 0);
	ck_assert_uint_eq(n, sizeof(exact));
	reap(child);
	ck_assert_int_eq(proc_cmdline(child, buf, sizeof(buf), &n), -ENOENT);
	ck_assert_uint_eq(n, 0);
	ck_assert_int_eq(proc_cmdline(0, buf, sizeof(buf), &n), -ENOENT);
}
END_TEST

static Suite *proc_suite(void)
{
	Suite *s = suite_create("proc");
	TCase *tc = tcase_create("stat");
	tcase_add_test(tc, test_read_self);
	tcase_add_test(tc, test_read_bad_pids);
	tcase_add_test(tc, test_comm_with_parentheses);
	suite_add_tcase(s, tc);
	tc = tcase_create("states");
	tcase_add_test(tc, test_states);
	suite_add_tcase(s, tc);
	tc = tcase_create("cmdline");
	tcase_add_test(tc, test_cmdline);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(proc_suite());
}

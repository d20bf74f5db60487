/* instance.c - an instance seen from outside, with or without its supervisor: which of its
 * processes live (the pid files checked against /proc), stopping whatever runs of it, and
 * removing what it leaves behind. The commands pids, ps, stop and cleanup; scripts/pipeline runs
 * them rather than looking at /proc and /dev/shm itself. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/proc.h"
#include "common/service.h"
#include "common/shm.h"
#include "common/util.h"
#include "tools/supervisor/supervisor.h"

#define HELLO_TIMEOUT_MS 2000	 /* ps: a service that does not answer HELLO in this is "no" */
#define STRAY_SHUTDOWN_MS 2000	 /* stop: MSG_SHUTDOWN to a socket without a pid file of ours */
#define KILL_WAIT_MS 5000	 /* after SIGKILL: how long to wait for the exit */
#define CMDLINE_MAX (128 * 1024) /* bytes of a command line looked at */

/* The program a process of the instance runs: the service (a further runner, gpu-runner-R, runs
 * gpu-runner), or pipeline-supervisor. */
static const char *program_of(const char *name)
{
	int kind = sup_service_kind(name, NULL);
	return kind >= 0 ? sup_service_names[kind] : strcmp(name, SUP_NAME) ? name : "pipeline-supervisor";
}

/* Is there anything of service i in run_dir (the three always count)? */
static bool service_exists(const char *run_dir, int i, char *name, size_t len)
{
	sup_service_name(i, name, len);
	if (i < SUP_N_SERVICES)
		return true;
	char path[PATH_MAX];
	struct stat st;
	snprintf(path, sizeof(path), "%s/%s.pid", run_dir, name);
	if (stat(path, &st) == 0)
		return true;
	snprintf(path, sizeof(path), "%s/%s.ctl", run_dir, name);
	return stat(path, &st) == 0;
}

/* Do a and b name one directory (the same words, or the same file however spelled: a trailing
 * slash, a symbolic link)? */
static bool same_dir(const char *a, const char *b)
{
	if (!strcmp(a, b))
		return true;
	struct stat sa, sb;
	return stat(a, &sa) == 0 && stat(b, &sb) == 0 && S_ISDIR(sa.st_mode) && sa.st_dev == sb.st_dev &&
	       sa.st_ino == sb.st_ino;
}

/* Is pid a live process (not a zombie) that runs program for run_dir? program is its command
 * name or the last part of one of its words (under a wrapper of PIPELINE_WRAP_*, the word that
 * runs it), and "--run-dir run_dir" or "--run-dir=run_dir" is among its words (run_dir however
 * spelled: same_dir). This guards against a stale pid file whose number now belongs to another
 * process. */
static bool runs_for(int pid, const char *program, const char *run_dir)
{
	struct proc_info pi;
	if (proc_read(pid, &pi) != 0 || pi.state == 'Z' || pi.state == 'X')
		return false;
	char *buf = malloc(CMDLINE_MAX + 1);
	if (!buf)
		return false;
	size_t n;
	int rc = proc_cmdline(pid, buf, CMDLINE_MAX, &n);
	bool runs = !strcmp(pi.comm, program), ours = false;
	if (rc == 0 || rc == -E2BIG) {
		buf[n] = 0; /* a line cut short ends in a whole word */
		const char *prev = "";
		for (const char *w = buf; w < buf + n; w += strlen(w) + 1) {
			const char *slash = strrchr(w, '/');
			runs = runs || !strcmp(slash ? slash + 1 : w, program);
			ours = ours || (!strcmp(prev, "--run-dir") && same_dir(w, run_dir)) ||
			       (str_has_prefix(w, "--run-dir=") && same_dir(w + strlen("--run-dir="), run_dir));
			prev = w;
		}
	}
	free(buf);
	return runs && ours;
}

/* The pid of name (SUP_NAME or a service) if its pid file names a live process that runs it for
 * run_dir, else 0. */
static int live_pid(const char *run_dir, const char *name)
{
	int pid = sup_read_pid_file(run_dir, name);
	return pid && runs_for(pid, program_of(name), run_dir) ? pid : 0;
}

int sup_instance_live_pid(const char *run_dir, const char *name)
{
	return live_pid(run_dir, name);
}

int sup_instance_pids(const char *run_dir, const char *name)
{
	int found = 0;
	char buf[32];
	for (int i = -1; i < SUP_MAX_SERVICES; i++) {
		const char *n = SUP_NAME;
		if (i >= 0) {
			sup_service_name(i, buf, sizeof(buf));
			n = buf;
		}
		if (name && strcmp(name, n) != 0)
			continue;
		int pid = live_pid(run_dir, n);
		if (!pid)
			continue;
		found++;
		if (name)
			printf("%d\n", pid);
		else
			printf("%s %d\n", n, pid);
	}
	return found ? SUP_EXIT_OK : SUP_EXIT_FAIL;
}

/* Does name answer HELLO (as itself) on its socket in run_dir? */
static bool answers_hello(void *zctx, const char *run_dir, const char *name)
{
	char path[PATH_MAX];
	struct stat st;
	snprintf(path, sizeof(path), "%s/%s.ctl", run_dir, name);
	if (stat(path, &st) != 0 || !S_ISSOCK(st.st_mode))
		return false;
	struct rpc_client *c = rpc_client_create(zctx, run_dir, name, "pipeline-supervisor");
	if (!c)
		return false;
	struct msg rep;
	bool ok = rpc_hello(c, &rep, HELLO_TIMEOUT_MS) == 0;
	if (ok) {
		ok = rep.hello_reply.service.p && !strcmp(rep.hello_reply.service.p, name);
		msg_free(&rep);
	}
	rpc_client_destroy(&c);
	return ok;
}

/* The first line of <run_dir>/<name>.pid as it is written (it may not be a number), or "-". */
static void pid_file_text(const char *run_dir, const char *name, char *buf, size_t len)
{
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/%s.pid", run_dir, name);
	FILE *f = fopen(path, "r");
	if (!f || !fgets(buf, (int)len, f))
		str_copy(buf, len, f ? "" : "-");
	if (f)
		fclose(f);
	buf[strcspn(buf, "\n")] = 0;
}

int sup_instance_ps(const char *run_dir)
{
	void *zctx = zmq_ctx_new();
	if (!zctx) {
		fprintf(stderr, "pipeline-supervisor: cannot create a ZeroMQ context: %s\n", strerror(errno));
		return SUP_EXIT_FAIL;
	}
	int running = 0;
	printf("%-12s %-8s %-8s %-6s %s\n", "service", "pid", "process", "HELLO", "uptime");
	char name[32];
	for (int i = 0; i < SUP_MAX_SERVICES; i++) {
		if (!service_exists(run_dir, i, name, sizeof(name)))
			continue;
		char text[32], uptime[32] = "-";
		pid_file_text(run_dir, name, text, sizeof(text));
		const char *process = strcmp(text, "-") ? "dead" : "-";
		int pid = live_pid(run_dir, name);
		struct proc_info pi;
		if (pid) {
			process = "alive";
			running++;
			if (proc_read(pid, &pi) == 0)
				sup_format_duration((double)proc_age_ms(&pi) / 1000.0, uptime, sizeof(uptime));
		}
		printf("%-12s %-8s %-8s %-6s %s\n", name, text, process, answers_hello(zctx, run_dir, name) ? "yes" : "no",
		       uptime);
		fflush(stdout);
	}
	zmq_ctx_term(zctx);
	return running ? SUP_EXIT_OK : SUP_EXIT_FAIL;
}

/* Sends SIGKILL to pid (name's process) and waits for it to go. Returns 0, or -1 after saying
 * that it survived. */
static int kill_and_wait(const char *name, int pid)
{
	kill(pid, SIGKILL);
	if (sup_wait_exit(pid, KILL_WAIT_MS))
		return 0;
	fprintf(stderr, "pipeline-supervisor: %s (pid %d) survived SIGKILL\n", name, pid);
	return -1;
}

/* The process group the signals for a service's pid go to: its own, where it leads a group that
 * is not ours (the supervisor starts each service in a group of its own, so a wrapper that does
 * not exec and the service under it are both in it); else none (0), and the signals go to the
 * process alone (a service started by hand may share its group with others). */
static int service_group(int pid)
{
	const pid_t g = getpgid(pid);
	return g == pid && g != getpgid(0) ? pid : 0;
}

/* Does any live process of group g remain? Zombies do not count (kill(-g, 0) counts them: where
 * nobody reaps the orphans of a killed supervisor, the stop waited out its timeout and reported
 * a service that survived SIGKILL). */
static bool group_alive(int g)
{
	if (kill(-g, 0) != 0 && errno != EPERM)
		return false;
	DIR *d = opendir("/proc");
	if (!d)
		return true;
	bool alive = false;
	struct dirent *e;
	while (!alive && (e = readdir(d))) {
		char *end;
		long pid = strtol(e->d_name, &end, 10);
		struct proc_info pi;
		if (*end || pid <= 0 || proc_read((int)pid, &pi) != 0)
			continue;
		alive = pi.pgrp == g && pi.state != 'Z' && pi.state != 'X';
	}
	closedir(d);
	return alive;
}

static void signal_service(int pid, int group, int sig)
{
	if (!group || kill(-group, sig) != 0)
		kill(pid, sig);
}

/* Waits until pid and every process of its group (none: 0) have gone; false after timeout_ms. */
static bool wait_service_exit(int pid, int group, long timeout_ms)
{
	uint64_t deadline = now_ns() + (uint64_t)timeout_ms * 1000000ull;
	if (!sup_wait_exit(pid, timeout_ms))
		return false;
	while (group && group_alive(group)) {
		if (now_ns() > deadline)
			return false;
		const struct timespec ts = {.tv_nsec = 50 * 1000000L};
		nanosleep(&ts, NULL);
	}
	return true;
}

/* The stop ladder (supervisor.h) for a service that runs without a supervisor (it was killed, or
 * the service was started by hand): MSG_SHUTDOWN (it removes its shared state), SIGTERM if that
 * is not acknowledged (with SIGCONT, so that a stopped service takes it), SIGKILL when it has not
 * exited after stop_timeout_s. Where the service leads a process group of its own, the signals go
 * to the group and the stop waits for all of it (service_group). */
static int stop_unsupervised(const char *run_dir, const char *name, int pid, long stop_timeout_s)
{
	char err[256];
	const int group = service_group(pid);
	if (sup_ask_shutdown(run_dir, name, SUP_SHUTDOWN_ANSWER_MS, err, sizeof(err)) != 0) {
		signal_service(pid, group, SIGTERM);
		signal_service(pid, group, SIGCONT);
	}
	if (wait_service_exit(pid, group, stop_timeout_s * 1000))
		return 0;
	fprintf(stderr, "pipeline-supervisor: %s (pid %d%s) did not exit in %ld s; killing it\n", name, pid,
		group ? " and its process group" : "", stop_timeout_s);
	signal_service(pid, group, SIGKILL);
	if (wait_service_exit(pid, group, KILL_WAIT_MS))
		return 0;
	fprintf(stderr, "pipeline-supervisor: %s (pid %d) survived SIGKILL\n", name, pid);
	return -1;
}

static void print_name(const char *name)
{
	printf("%s\n", name);
	fflush(stdout);
}

int sup_instance_stop(const char *instance, const char *run_dir, long stop_timeout_s)
{
	int status = SUP_EXIT_OK;
	int sup_pid = live_pid(run_dir, SUP_NAME);
	if (sup_pid) {
		print_name(SUP_NAME);
		int n = 0;
		char name[32];
		for (int i = 0; i < SUP_MAX_SERVICES; i++) {
			sup_service_name(i, name, sizeof(name));
			if (live_pid(run_dir, name)) {
				print_name(name);
				n++;
			}
		}
		/* Each service its stop timeout, one after the other, and some to spare: the longer of
		 * this command's and the one the instance was started with (its own stops wait that long,
		 * and a shorter wait here killed it half way through them). */
		const long t = sup_client_stop_timeout(run_dir, stop_timeout_s);
		if (sup_client_stop_supervisor(run_dir, sup_pid, (n > 3 ? n : 3) * t + 20) != 0) {
			fprintf(stderr, "pipeline-supervisor: the supervisor (pid %d) did not stop the instance in time; "
					"killing it\n",
				sup_pid);
			if (kill_and_wait("the supervisor", sup_pid) != 0)
				status = SUP_EXIT_FAIL;
		}
	}
	/* What runs without it: none, unless it was killed (its services, reparented, go on). */
	for (int k = 0; k < SUP_MAX_SERVICES; k++) {
		char name[32];
		sup_service_name(sup_stop_order(SUP_MAX_SERVICES, k), name, sizeof(name));
		int pid = live_pid(run_dir, name);
		char path[PATH_MAX], err[256];
		struct stat st;
		snprintf(path, sizeof(path), "%s/%s.ctl", run_dir, name);
		if (pid) {
			print_name(name);
			if (stop_unsupervised(run_dir, name, pid, stop_timeout_s) != 0)
				status = SUP_EXIT_FAIL;
		} else if (stat(path, &st) == 0 && S_ISSOCK(st.st_mode) &&
			   sup_ask_shutdown(run_dir, name, STRAY_SHUTDOWN_MS, err, sizeof(err)) == 0) {
			/* A socket but no pid file of ours: a service started by hand (or a stale socket,
			 * which does not answer). */
			print_name(name);
		}
	}
	sup_instance_cleanup(instance, run_dir);
	return status;
}

/* The spill file a dead kv-store recorded (KV_SPILL_RECORD, common/service.h), where no kv-store
 * of the instance lives: removed where it is still a regular file of ours, then the record. */
static void remove_recorded_spill(const char *run_dir)
{
	char rec[PATH_MAX], spill[PATH_MAX];
	snprintf(rec, sizeof(rec), "%s/%s", run_dir, KV_SPILL_RECORD);
	if (live_pid(run_dir, "kv-store"))
		return;
	FILE *f = fopen(rec, "re");
	if (!f)
		return;
	bool got = fgets(spill, sizeof(spill), f) != NULL;
	fclose(f);
	spill[strcspn(spill, "\n")] = 0;
	struct stat st;
	if (got && spill[0] == '/' && lstat(spill, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == getuid()) {
		if (unlink(spill) != 0)
			fprintf(stderr, "pipeline-supervisor: cannot remove the dead kv-store's spill file %s: %s\n", spill,
				strerror(errno));
	}
	unlink(rec);
}

/* A file write_file_atomic left behind (NAME.tmp.PID: its writer died between the write and the
 * rename), NAME a pid file or the spill record. */
static bool atomic_leftover(const char *name)
{
	const char *t = strstr(name, ".tmp.");
	if (!t || !t[5] || strspn(t + 5, "0123456789") != strlen(t + 5))
		return false;
	const size_t base = (size_t)(t - name);
	return (base > 4 && !strncmp(t - 4, ".pid", 4)) ||
	       (base == strlen(KV_SPILL_RECORD) && !strncmp(name, KV_SPILL_RECORD, base));
}

int sup_instance_cleanup(const char *instance, const char *run_dir)
{
	/* A live supervisor holds its lock (daemon.c): its files and its services' are not ours to
	 * remove (it would run on where no command finds it). Held while the files go, so that no
	 * supervisor starts among them. */
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/%s.lock", run_dir, SUP_NAME);
	const int lock_fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
	if (lock_fd >= 0 && flock(lock_fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
		close(lock_fd);
		fprintf(stderr, "pipeline-supervisor: a supervisor runs for %s (it holds %s.lock): its files are left "
				"as they are; stop it first\n",
			run_dir, SUP_NAME);
		return SUP_EXIT_FAIL;
	}
	sup_instance_cleanup_locked(instance, run_dir);
	if (lock_fd >= 0)
		close(lock_fd); /* the lock, where it was had, goes with it */
	return SUP_EXIT_OK;
}

void sup_instance_cleanup_locked(const char *instance, const char *run_dir)
{
	static const char *const suffixes[] = {"pid", "pid.tmp", "ctl", "pub", "restart"};
	char path[PATH_MAX];
	for (int i = -1; i < SUP_MAX_SERVICES; i++) {
		char name[32] = SUP_NAME;
		if (i >= 0)
			sup_service_name(i, name, sizeof(name));
		/* A service that lives on with no supervisor (it was killed): its pid file and socket are
		 * how stop finds it, so they stay (stop removes them once it is gone). */
		const int pid = i >= 0 ? live_pid(run_dir, name) : 0;
		if (pid) {
			fprintf(stderr, "pipeline-supervisor: left the files of %s: it lives (pid %d); stop the instance "
					"to end it\n", name, pid);
			continue;
		}
		for (size_t k = 0; k < ARRAY_SIZE(suffixes); k++) {
			snprintf(path, sizeof(path), "%s/%s.%s", run_dir, name, suffixes[k]);
			unlink(path);
		}
	}
	snprintf(path, sizeof(path), "%s/start.args", run_dir);
	unlink(path);
	snprintf(path, sizeof(path), "%s/start.timeouts", run_dir);
	unlink(path);
	DIR *rd = opendir(run_dir);
	if (rd) {
		struct dirent *e;
		while ((e = readdir(rd)) != NULL) {
			if (!atomic_leftover(e->d_name))
				continue;
			snprintf(path, sizeof(path), "%s/%s", run_dir, e->d_name);
			unlink(path);
		}
		closedir(rd);
	}
	/* A dead kv-store's spill file at its default place (a live one removes it on MSG_SHUTDOWN),
	 * and one placed elsewhere that its record names. */
	if (!live_pid(run_dir, "kv-store")) {
		snprintf(path, sizeof(path), "%s/kv-spill.bin", run_dir);
		unlink(path);
		remove_recorded_spill(run_dir);
	}

	char prefix[SHM_NAME_MAX];
	if (shm_object_name(instance, "", prefix, sizeof(prefix)) != 0)
		return; /* no object of an instance of that name fits a name either */
	DIR *d = opendir("/dev/shm");
	if (!d)
		return;
	struct dirent *e;
	while ((e = readdir(d)) != NULL) {
		/* Object names hold no '-': a remainder with one belongs to an instance whose name
		 * starts like ours ("demo" must not take "demo-2"'s objects). */
		if (!str_has_prefix(e->d_name, prefix + 1) || strchr(e->d_name + strlen(prefix + 1), '-'))
			continue;
		char name[SHM_NAME_MAX + 256];
		snprintf(name, sizeof(name), "/%s", e->d_name);
		int owner = 0;
		if (shm_object_owner(name, &owner) == 1) {
			fprintf(stderr,
				"pipeline-supervisor: left /dev/shm%s: the live process %d owns it (an instance %s with "
				"another run directory?)\n",
				name, owner, instance);
			continue;
		}
		shm_unlink(name);
	}
	closedir(d);
	return;
}

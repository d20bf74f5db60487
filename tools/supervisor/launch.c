/* launch.c - starting a service and what follows its exit: the command line it runs with, the
 * fork and exec into a process group of its own with its log, its pid file, the restart policy
 * (backoff and burst limit), and reaping it (daemon_internal.h has the life of a service). */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "tools/supervisor/daemon_internal.h"

/* ---- a service's process ---- */

/* Writes pid to path through a temporary file and rename, so a reader never sees half a number. */
int write_pid_file(const char *path, int pid)
{
	char text[32];
	int n = snprintf(text, sizeof(text), "%d\n", pid);
	return write_file_atomic(path, text, (size_t)n);
}

/* Signals the process group of the service (the wrapper and what it runs), or the process alone
 * when the group is not there (it had no time to make it). */
void svc_signal(struct svc *v, int sig)
{
	if (v->pid <= 0)
		return;
	if (kill(-v->pid, sig) != 0 && errno == ESRCH)
		kill(v->pid, sig);
}

/* ---- the command line ---- */

/* Finds word in PATH (unless it names a path). Returns a malloc'd path or NULL. */
static char *find_program(const char *word)
{
	if (strchr(word, '/'))
		return strdup(word);
	const char *path = getenv("PATH");
	if (!path || !*path)
		path = "/usr/local/bin:/usr/bin:/bin";
	char buf[PATH_MAX];
	for (const char *p = path; *p;) {
		const char *end = strchr(p, ':');
		size_t len = end ? (size_t)(end - p) : strlen(p);
		int n = snprintf(buf, sizeof(buf), "%.*s/%s", (int)len, len ? p : ".", word);
		if (n > 0 && (size_t)n < sizeof(buf) && access(buf, X_OK) == 0)
			return strdup(buf);
		p += len + (end ? 1 : 0);
		if (!end)
			break;
	}
	return NULL;
}

/* Builds v's command line: [wrapper...] <bin_dir>/<service> --instance I --run-dir R [args...]. */
int build_argv(const struct sup_config *cfg, struct svc *v, char *err, size_t errlen)
{
	const struct sup_words *wrap = &cfg->wrap[v->kind], *args = &cfg->args[v->kind];
	size_t n = (size_t)wrap->n + 5 + (size_t)args->n + 6 + 1;
	v->argv = calloc(n, sizeof(char *));
	if (!v->argv)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	size_t k = 0;
	char path[PATH_MAX];
	if (wrap->n) {
		v->argv[k] = find_program(wrap->v[0]);
		if (!v->argv[k])
			return errorf(err, errlen, -ENOENT, "the wrapper of %s, '%s', is not found in PATH", v->name,
				      wrap->v[0]);
		k++;
		for (int i = 1; i < wrap->n; i++)
			v->argv[k++] = strdup(wrap->v[i]);
		v->wrapped = true;
	}
	snprintf(path, sizeof(path), "%s/%s", cfg->bin_dir, sup_service_names[v->kind]);
	if (access(path, X_OK) != 0)
		return errorf(err, errlen, -ENOENT, "%s is not an executable (%s): is the tree built?", path, strerror(errno));
	/* The binary itself, held open: every start of the service runs the program the instance
	 * started with, even after a rebuild or an upgrade put another file at the path (services of
	 * two builds may not agree on a shared-memory layout or a message). A wrapper runs the
	 * service by its path, so a wrapped service is started by path. */
	v->exe_fd = -1;
	if (!wrap->n && (v->exe_fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
		return errorf(err, errlen, -errno, "cannot open %s: %s", path, strerror(errno));
	v->argv[k++] = strdup(path);
	v->argv[k++] = strdup("--instance");
	v->argv[k++] = strdup(cfg->instance);
	v->argv[k++] = strdup("--run-dir");
	v->argv[k++] = strdup(cfg->run_dir);
	if (v->kind == SUP_HTTP_API && cfg->http_listen) {
		v->argv[k++] = strdup("--listen");
		v->argv[k++] = strdup(cfg->http_listen);
	}
	for (int i = 0; i < args->n; i++)
		v->argv[k++] = strdup(args->v[i]);
	/* --ranks, --gpus: each runner told its place among them, and its device. */
	char num[16];
	if (v->kind == SUP_GPU_RUNNER && cfg->n_ranks > 1) {
		v->argv[k++] = strdup("--rank");
		snprintf(num, sizeof(num), "%d", v->rank);
		v->argv[k++] = strdup(num);
		v->argv[k++] = strdup("--ranks");
		snprintf(num, sizeof(num), "%d", cfg->n_ranks);
		v->argv[k++] = strdup(num);
	}
	if (v->kind == SUP_GPU_RUNNER && cfg->n_gpus > 0) {
		v->argv[k++] = strdup("--gpu");
		snprintf(num, sizeof(num), "%d", cfg->gpus[v->rank]);
		v->argv[k++] = strdup(num);
	}
	for (size_t i = 0; i < k; i++)
		if (!v->argv[i])
			return errorf(err, errlen, -ENOMEM, "out of memory");
	return 0;
}

void free_argv(struct svc *v)
{
	if (v->exe_fd > 2)
		close(v->exe_fd);
	v->exe_fd = -1;
	if (!v->argv)
		return;
	for (char **a = v->argv; *a; a++)
		free(*a);
	free(v->argv);
	v->argv = NULL;
}

/* ---- restart policy ---- */

/* Counts a restart decided at now_ms against the burst limit. Returns the backoff in ms before
 * it, or -1 when it would be more than burst_limit restarts within the window (give up). The
 * backoff doubles with each restart still in the window: min, 2 min, 4 min, ... up to max. */
static int64_t restart_delay(const struct sup_config *cfg, struct svc *v, uint64_t now_ms)
{
	uint64_t window = (uint64_t)cfg->burst_window_s * 1000;
	uint32_t k = 0;
	for (uint32_t i = 0; i < v->n_history; i++)
		if (now_ms - v->history_ms[i] < window)
			v->history_ms[k++] = v->history_ms[i];
	v->n_history = k;
	/* Starts that never came up count too, however far apart (a runner that loads for longer than
	 * the window divided by the limit and then fails would otherwise restart for ever). */
	if (k >= (uint32_t)cfg->burst_limit || v->failed_starts > (uint32_t)cfg->burst_limit)
		return -1;
	/* failed_starts counts this failure too (k the restarts before it): one less, the same steps. */
	const uint32_t f = v->failed_starts ? v->failed_starts - 1 : 0;
	const uint32_t level = k > f ? k : f;
	uint64_t d = (uint64_t)cfg->backoff_min_ms;
	for (uint32_t i = 0; i < level && d < (uint64_t)cfg->backoff_max_ms; i++)
		d *= 2;
	if (d > (uint64_t)cfg->backoff_max_ms)
		d = (uint64_t)cfg->backoff_max_ms;
	assert(v->n_history < MAX_HISTORY); /* burst_limit < MAX_HISTORY, checked at parse */
	v->history_ms[v->n_history++] = now_ms;
	return (int64_t)d;
}
/* ---- starting a service ---- */

static void iso_time(char *buf, size_t len)
{
	struct timespec ts;
	struct tm tm;
	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	strftime(buf, len, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

static void svc_failure(struct sup *sup, struct svc *v, bool permanent);

/* Starts v's command line in a new process group, stdin from /dev/null, stdout and stderr
 * appended to <run-dir>/<service>.log. why is written to the log ("" for the first start). */
void svc_launch(struct sup *sup, struct svc *v, const char *why)
{
	char path[PATH_MAX], when[32];
	uint64_t now = now_ns();
	if (v->launches++ > 0)
		v->restarts++;
	v->exec_failed = false;
	v->state = SVC_STARTING;
	v->started_ns = now;
	v->hello_pending = false;
	v->hello_pid_warned = false;
	v->epoch = 0;
	v->service_pid = 0;
	v->kill_reason = KILL_NONE;
	v->requested = false;
	v->kill_deadline_ns = 0;
	v->shutdown_pending = false;
	v->busy = false;
	/* Replies a service's previous process never sent must not wait in our socket. */
	rpc_client_reset(v->rpc);

	path_of(sup, v->name, "log", path, sizeof(path));
	int logfd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
	if (logfd < 0) {
		snprintf(v->last_error, sizeof(v->last_error), "cannot open its log %.400s: %s", path, strerror(errno));
		log_error("%s: %s", v->name, v->last_error);
		svc_failure(sup, v, true);
		return;
	}
	iso_time(when, sizeof(when));
	dprintf(logfd, "==== %s: %s started by pipeline-supervisor%s%s\n", when, v->name, *why ? ": " : "", why);
	int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	int ep[2];
	if (null_fd < 0 || pipe2(ep, O_CLOEXEC) != 0) {
		snprintf(v->last_error, sizeof(v->last_error), "cannot prepare its start: %s", strerror(errno));
		goto out_fail;
	}
	int pid = fork();
	if (pid == 0) {
		/* The child: only async-signal-safe calls until exec (the parent has ZeroMQ threads). */
		setpgid(0, 0);
		struct sigaction dfl = {.sa_handler = SIG_DFL};
		sigemptyset(&dfl.sa_mask);
		const int sigs[] = {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGCHLD};
		for (size_t i = 0; i < ARRAY_SIZE(sigs); i++)
			sigaction(sigs[i], &dfl, NULL);
		sigset_t none;
		sigemptyset(&none);
		sigprocmask(SIG_SETMASK, &none, NULL);
		if (dup2(null_fd, 0) < 0 || dup2(logfd, 1) < 0 || dup2(logfd, 2) < 0)
			goto child_fail;
		/* Nothing of ours but the error pipe and the binary (both close-on-exec) goes with it. */
		int lo = v->exe_fd < ep[1] ? v->exe_fd : ep[1], hi = v->exe_fd < ep[1] ? ep[1] : v->exe_fd;
		int keep[2] = {lo, hi}; /* ascending; one below 3 (-1: no binary held) is skipped */
		unsigned from = 3;
		for (int i = 0; i < 2; i++) {
			if (keep[i] < 3)
				continue;
			if ((unsigned)keep[i] > from)
				close_range(from, (unsigned)keep[i] - 1, 0);
			from = (unsigned)keep[i] + 1;
		}
		close_range(from, ~0u, 0);
		if (v->exe_fd > 2) {
			fexecve(v->exe_fd, v->argv, environ);
			if (errno != ENOENT) /* ENOENT: a script, whose interpreter needs the path */
				goto child_fail;
		}
		execv(v->argv[0], v->argv);
child_fail: {
		int e = errno;
		ssize_t w = write(ep[1], &e, sizeof(e));
		(void)w;
		_exit(127);
	}
	}
	int fork_errno = errno;
	close(ep[1]);
	close(null_fd);
	close(logfd);
	if (pid < 0) {
		close(ep[0]);
		snprintf(v->last_error, sizeof(v->last_error), "cannot fork: %s", strerror(fork_errno));
		log_error("%s: %s", v->name, v->last_error);
		svc_failure(sup, v, false);
		return;
	}
	/* Both sides set the group, so that a signal sent right after fork finds it. */
	setpgid(pid, pid);
	v->pid = pid;
	/* The pipe closes at exec; an errno arrives when exec failed. */
	int e = 0;
	ssize_t n;
	do
		n = read(ep[0], &e, sizeof(e));
	while (n < 0 && errno == EINTR);
	close(ep[0]);
	if (n == (ssize_t)sizeof(e)) {
		v->exec_failed = true;
		snprintf(v->last_error, sizeof(v->last_error), "cannot run %s: %s", v->argv[0], strerror(e));
		log_error("%s: %s", v->name, v->last_error);
		return; /* the child exits 127; the exit is handled when it is reaped */
	}
	path_of(sup, v->name, "pid", path, sizeof(path));
	int rc = write_pid_file(path, pid);
	if (rc)
		log_warn("cannot write %s: %s", path, strerror(-rc));
	log_info("started %s (pid %d)%s%s", v->name, pid, *why ? ": " : "", why);
	return;

out_fail:
	if (null_fd >= 0)
		close(null_fd);
	close(logfd);
	log_error("%s: %s", v->name, v->last_error);
	svc_failure(sup, v, false);
}

/* v failed (its last_error says how): restart it after the backoff, or give up. */
static void svc_failure(struct sup *sup, struct svc *v, bool permanent)
{
	uint64_t now = now_ns();
	if (!permanent) {
		int64_t d = restart_delay(sup->cfg, v, now / NS_PER_MS);
		if (d >= 0) {
			v->state = SVC_RESTARTING;
			v->restart_at_ns = now + (uint64_t)d * NS_PER_MS;
			log_warn("%s: restarting it in %.1f s (restart %u within %ld s; at most %ld)", v->name,
				 (double)d / 1000, v->n_history, sup->cfg->burst_window_s, sup->cfg->burst_limit);
			return;
		}
		char last[sizeof(v->last_error)];
		snprintf(last, sizeof(last), "%s", v->last_error);
		if (v->n_history >= (uint32_t)sup->cfg->burst_limit)
			snprintf(v->last_error, sizeof(v->last_error),
				 "gave up after %u restarts within %ld s; the last: %.400s", v->n_history,
				 sup->cfg->burst_window_s, last);
		else
			snprintf(v->last_error, sizeof(v->last_error),
				 "gave up after %u restarts in a row, each ended before it answered HELLO; the last: %.400s",
				 v->failed_starts - 1, last);
	}
	v->state = SVC_FAILED;
	log_error("%s failed: %s", v->name, v->last_error);
}
/* ---- a service exited ---- */

static void describe_status(int status, char *exit_text, size_t exit_len, char *sentence, size_t len)
{
	if (WIFEXITED(status)) {
		snprintf(exit_text, exit_len, "exit %d", WEXITSTATUS(status));
		snprintf(sentence, len, "exited with status %d", WEXITSTATUS(status));
	} else if (WIFSIGNALED(status)) {
		int sig = WTERMSIG(status);
		const char *abbrev = sigabbrev_np(sig);
		snprintf(exit_text, exit_len, "signal %d (SIG%s)", sig, abbrev ? abbrev : "?");
		snprintf(sentence, len, "was killed by signal %d (SIG%s)", sig, abbrev ? abbrev : "?");
	} else {
		snprintf(exit_text, exit_len, "status %#x", (unsigned)status);
		snprintf(sentence, len, "ended with wait status %#x", (unsigned)status);
	}
}

static void on_child_exit(struct sup *sup, struct svc *v, int status)
{
	int pid = v->pid;
	char sentence[96], path[PATH_MAX];
	describe_status(status, v->last_exit, sizeof(v->last_exit), sentence, sizeof(sentence));
	bool before_ready = v->state == SVC_STARTING;
	bool was_up = v->state == SVC_UP;
	enum kill_reason why = v->kill_reason;
	bool requested = v->requested;
	/* What is left of its process group (a wrapper's child) goes with it: a successor must
	 * find the sockets and shared memory free. The group only: the pid itself is reaped, and its
	 * number free for another process. */
	kill(-pid, SIGKILL);
	v->pid = 0;
	v->epoch = 0;
	v->service_pid = 0;
	v->hello_pending = false;
	v->shutdown_pending = false;
	v->kill_reason = KILL_NONE;
	v->requested = false;
	v->kill_deadline_ns = 0;
	v->busy = false;
	path_of(sup, v->name, "pid", path, sizeof(path));
	unlink(path);
	if (was_up && (v->kind == SUP_KV_STORE || v->kind == SUP_SSD_LOADER))
		runner_peer_down(sup);

	if (sup->phase == PHASE_STOPPING || why == KILL_STOP) {
		v->state = SVC_STOPPED;
		log_info("%s (pid %d) stopped: %s", v->name, pid, sentence);
		return;
	}
	if (requested) {
		log_info("%s (pid %d) %s for the restart that was asked for; starting it again", v->name, pid,
			 sentence);
		svc_launch(sup, v, "restart asked for");
		return;
	}
	switch (why) {
	case KILL_HANG:
	case KILL_READY:
	case KILL_HELLO_ERROR:
		break; /* last_error already says why it was killed */
	default:
		if (!v->exec_failed)
			snprintf(v->last_error, sizeof(v->last_error), "%s%s", sentence,
				 before_ready ? " before it answered HELLO" : "");
		break;
	}
	log_warn("%s (pid %d) %s%s", v->name, pid, sentence, before_ready ? " before it answered HELLO" : "");
	if (before_ready)
		v->failed_starts++; /* reset when it answers HELLO (health.c) or a restart is asked for */
	/* A service that never came up and says, by its exit, that it refuses this command line (1: a
	 * failure at start, 2: a bad flag), or could not be run at all, would only refuse again. One
	 * that was up and could not be run again is restarted as after any other death (its binary may
	 * be being rebuilt under it: a moment later it runs), within the burst's limit. */
	bool refusal = why == KILL_HELLO_ERROR ||
		       (!v->ever_up && (v->exec_failed || why == KILL_READY ||
					(WIFEXITED(status) && (WEXITSTATUS(status) == 1 || WEXITSTATUS(status) == 2))));
	if (refusal) {
		size_t n = strlen(v->last_error);
		const char *why_not = v->exec_failed || why == KILL_HELLO_ERROR ? ""
				      : why == KILL_READY ? ": it never came up"
							  : ": it refuses this command line";
		snprintf(v->last_error + n, sizeof(v->last_error) - n, "; not restarted%s (see its log %s/%s.log)",
			 why_not, sup->cfg->run_dir, v->name);
	}
	svc_failure(sup, v, refusal);
}

void reap_children(struct sup *sup)
{
	for (;;) {
		int status;
		int pid = waitpid(-1, &status, WNOHANG);
		if (pid <= 0)
			return;
		struct svc *v = NULL;
		for (int i = 0; i < sup->n; i++)
			if (sup->s[i].pid == pid)
				v = &sup->s[i];
		if (v)
			on_child_exit(sup, v, status);
		else /* a wrapper's child, reparented to us (we are a subreaper) */
			log_debug("reaped pid %d (left by a service's wrapper)", pid);
	}
}

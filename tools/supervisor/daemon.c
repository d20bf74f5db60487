/* daemon.c - the supervisor proper: one event loop (common/service.h's) that starts the three
 * services, reaps them, watches their heartbeats, restarts them and answers status.
 *
 * A service's life here:
 *
 *   stopped --launch--> starting --HELLO answered--> up
 *      ^                   |                          |  exits, or hung (killed), or did not answer HELLO
 *      |                   +-----------+--------------+
 *      |                               v
 *      |             a refusal at its first start, or the burst limit passed --> failed
 *      |                               | else
 *      |                               v
 *      +--- (stop) ----------  restarting --backoff passed--> launch again (same command line)
 *
 * A restart asked for by the operator (the marker file <run-dir>/<service>.restart) sends SIGTERM,
 * which makes the service leave its shared state to its successor, and starts it again at once,
 * without counting toward the burst limit. A stop (MSG_SHUTDOWN, SIGTERM or SIGINT to the
 * supervisor) sends MSG_SHUTDOWN to gpu-runner, then ssd-loader, then kv-store, one after the
 * other, SIGTERM when one does not answer, SIGKILL after the stop timeout, and then exits.
 *
 * Each service runs in a process group of its own (the wrapper of PIPELINE_WRAP_* and the service
 * under it together), and signals go to the group. The supervisor is a child subreaper, so a
 * service whose wrapper died is still reaped here and never lingers as a zombie. */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/log.h"
#include "common/proc.h"
#include "common/service.h"
#include "common/util.h"
#include "tools/supervisor/supervisor.h"

#define TICK_MS 100
#define HELLO_RETRY_MS 500	  /* a HELLO unanswered this long is sent again on a fresh socket */
#define SHUTDOWN_ANSWER_MS 5000	  /* MSG_SHUTDOWN unanswered this long: SIGTERM instead */
#define MAX_HISTORY 64		  /* restarts remembered for the burst limit */
#define NS_PER_MS 1000000ull

enum svc_state { SVC_STOPPED = 0, SVC_STARTING = 1, SVC_UP = 2, SVC_RESTARTING = 3, SVC_FAILED = 4 };
static const char *const state_names[] = {"stopped", "starting", "up", "restarting", "failed"};

/* Why the supervisor is ending the current process of a service (what its exit means). */
enum kill_reason {
	KILL_NONE = 0,
	KILL_HANG = 1,	      /* heartbeats stopped: a failure, restarted */
	KILL_READY = 2,	      /* no HELLO within the ready timeout */
	KILL_HELLO_ERROR = 3, /* answered HELLO with MSG_ERROR (another protocol version) */
	KILL_STOP = 4,	      /* the supervisor is stopping: not restarted */
};

struct svc {
	int id;
	const char *name;
	char **argv;	   /* the command line, the same at every start (owned, NULL-terminated) */
	bool wrapped;	   /* argv[0] is a wrapper, not the service */
	enum svc_state state;
	int pid;	   /* the process started (group leader), 0 when none */
	unsigned launches; /* processes started so far */
	unsigned restarts; /* launches after the first */
	uint64_t started_ns, up_ns;
	bool ever_up;
	bool exec_failed;
	char last_exit[64];
	char last_error[512];
	uint64_t history_ms[MAX_HISTORY]; /* when each counted restart was decided, for the burst limit */
	uint32_t n_history;
	uint64_t restart_at_ns; /* restarting: when to launch */

	/* readiness: HELLO over a DEALER, never blocking the loop */
	struct rpc_client *rpc;
	bool hello_pending;
	uint64_t hello_corr, hello_sent_ns;
	bool hello_pid_warned;
	uint64_t epoch;	  /* from HELLO: heartbeats of another epoch are not this process's */
	int service_pid;  /* from HELLO (the service itself, under a wrapper too) */

	/* heartbeats and hang detection */
	uint64_t last_beat_ns, beats;
	uint64_t check_ns;  /* silence is judged from here (the last beat, or the last busy verdict) */
	uint64_t cpu_mark;  /* the process's CPU ticks at check_ns */
	bool busy;	    /* silent but using CPU */
	uint64_t grace_until_ns; /* gpu-runner: not judged hung before this (a peer restarted) */

	/* ending the current process */
	enum kill_reason kill_reason;
	bool requested;		  /* an operator's restart: start again at once, uncounted */
	uint64_t kill_deadline_ns; /* SIGKILL when this passes; 0: none */
	bool shutdown_pending;
	uint64_t shutdown_corr, shutdown_sent_ns;
};

enum phase { PHASE_STARTING = 0, PHASE_RUNNING = 1, PHASE_STOPPING = 2 };
static const char *const phase_names[] = {"starting", "running", "stopping"};

struct sup {
	const struct sup_config *cfg;
	struct service *svc;
	void *zctx;
	void *sub; /* subscribed to every service's .pub */
	int sigfd;
	enum phase phase;
	int stop_index; /* services stopped so far, in stop order */
	bool done;
	uint64_t started_ns;
	struct svc s[SUP_N_SERVICES];
	char pid_path[PATH_MAX];
};

const char *const sup_service_names[SUP_N_SERVICES] = {"kv-store", "ssd-loader", "gpu-runner"};

int sup_service_index(const char *name)
{
	for (int i = 0; i < SUP_N_SERVICES; i++)
		if (!strcmp(name, sup_service_names[i]))
			return i;
	return -1;
}

void sup_config_defaults(struct sup_config *cfg)
{
	*cfg = (struct sup_config){
		.log_level = "info",
		.heartbeat_ms = 1000,
		.hang_periods = 2,
		.peer_grace_ms = 65000,
		.backoff_min_ms = 200,
		.backoff_max_ms = 5000,
		.burst_limit = 5,
		.burst_window_s = 60,
		.ready_timeout_s = 600,
		.stop_timeout_s = 10,
	};
}

static double ns_to_s(uint64_t ns)
{
	return (double)ns / 1e9;
}

static uint64_t hang_ns(const struct sup *sup)
{
	return (uint64_t)sup->cfg->hang_periods * (uint64_t)sup->cfg->heartbeat_ms * NS_PER_MS;
}

static void path_of(const struct sup *sup, const char *name, const char *suffix, char *buf, size_t len)
{
	snprintf(buf, len, "%s/%s.%s", sup->cfg->run_dir, name, suffix);
}

/* Writes pid to path through a temporary file and rename, so a reader never sees half a number. */
static int write_pid_file(const char *path, int pid)
{
	char tmp[PATH_MAX + 8];
	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0)
		return -errno;
	char text[32];
	int n = snprintf(text, sizeof(text), "%d\n", pid);
	int rc = write(fd, text, (size_t)n) == n ? 0 : -EIO;
	if (close(fd) != 0 && !rc)
		rc = -errno;
	if (!rc && rename(tmp, path) != 0)
		rc = -errno;
	if (rc)
		unlink(tmp);
	return rc;
}

/* Signals the process group of the service (the wrapper and what it runs), or the process alone
 * when the group is not there (it had no time to make it). */
static void svc_signal(struct svc *v, int sig)
{
	if (v->pid <= 0)
		return;
	if (kill(-v->pid, sig) != 0 && errno == ESRCH)
		kill(v->pid, sig);
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
	if (k >= (uint32_t)cfg->burst_limit)
		return -1;
	uint64_t d = (uint64_t)cfg->backoff_min_ms;
	for (uint32_t i = 0; i < k && d < (uint64_t)cfg->backoff_max_ms; i++)
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

static void runner_peer_down(struct sup *sup);
static void svc_failure(struct sup *sup, struct svc *v, bool permanent);

/* Starts v's command line in a new process group, stdin from /dev/null, stdout and stderr
 * appended to <run-dir>/<service>.log. why is written to the log ("" for the first start). */
static void svc_launch(struct sup *sup, struct svc *v, const char *why)
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
		/* Nothing of ours but the error pipe (close-on-exec) goes with it. */
		if (ep[1] > 3)
			close_range(3, (unsigned)ep[1] - 1, 0);
		close_range((unsigned)ep[1] + 1, ~0u, 0);
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
		snprintf(v->last_error, sizeof(v->last_error), "gave up after %u restarts within %ld s; the last: %.400s",
			 v->n_history, sup->cfg->burst_window_s, last);
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
	if (was_up && v->id != SUP_GPU_RUNNER)
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
	/* A service that never came up and says, by its exit, that it refuses this command line (1: a
	 * failure at start, 2: a bad flag), or could not be run at all, would only refuse again. */
	bool refusal = v->exec_failed || why == KILL_HELLO_ERROR ||
		       (!v->ever_up && (why == KILL_READY ||
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

static void reap_children(struct sup *sup)
{
	for (;;) {
		int status;
		int pid = waitpid(-1, &status, WNOHANG);
		if (pid <= 0)
			return;
		struct svc *v = NULL;
		for (int i = 0; i < SUP_N_SERVICES; i++)
			if (sup->s[i].pid == pid)
				v = &sup->s[i];
		if (v)
			on_child_exit(sup, v, status);
		else /* a wrapper's child, reparented to us (we are a subreaper) */
			log_debug("reaped pid %d (left by a service's wrapper)", pid);
	}
}

/* ---- readiness and heartbeats ---- */

/* gpu-runner waits for a peer that went away up to its own --timeout-ms (it beats meanwhile, with
 * service_beat; the grace stays for a runner that is silent anyway): it is not judged hung while
 * kv-store or ssd-loader is down after having been up, nor for peer_grace_ms after both answer
 * again. */
static void runner_peer_down(struct sup *sup)
{
	sup->s[SUP_GPU_RUNNER].grace_until_ns = UINT64_MAX;
}

static void runner_peer_up(struct sup *sup, uint64_t now)
{
	struct svc *r = &sup->s[SUP_GPU_RUNNER];
	bool peers_up = sup->s[SUP_KV_STORE].state == SVC_UP && sup->s[SUP_SSD_LOADER].state == SVC_UP;
	if (peers_up && r->grace_until_ns == UINT64_MAX)
		r->grace_until_ns = now + (uint64_t)sup->cfg->peer_grace_ms * NS_PER_MS;
}

static void svc_mark_up(struct sup *sup, struct svc *v, const struct msg_hello_reply *h, uint64_t now)
{
	v->state = SVC_UP;
	v->ever_up = true;
	v->up_ns = now;
	v->epoch = h->epoch;
	v->service_pid = (int)h->pid;
	/* The hang clock starts now: the first heartbeat is due within a period. */
	v->last_beat_ns = now;
	v->check_ns = now;
	struct proc_info pi;
	v->cpu_mark = proc_read(v->service_pid, &pi) == 0 ? pi.cpu_ticks : 0;
	v->busy = false;
	log_info("%s is up (pid %d%s, epoch %016llx) after %.2f s", v->name, v->pid, v->wrapped ? ", under a wrapper" : "",
		 (unsigned long long)v->epoch, ns_to_s(now - v->started_ns));
	if (v->id != SUP_GPU_RUNNER)
		runner_peer_up(sup, now);
}

/* Is the process that answered HELLO (pid) the one we started? Without a wrapper it must be that
 * very process; under a wrapper, one in its process group. Another answer comes from a process
 * that holds the socket while ours fails to bind. */
static bool hello_from_ours(const struct svc *v, int pid)
{
	if (pid == v->pid)
		return true;
	struct proc_info pi;
	return v->wrapped && proc_read(pid, &pi) == 0 && pi.pgrp == v->pid;
}

static void svc_check_ready(struct sup *sup, struct svc *v, uint64_t now)
{
	if (v->state != SVC_STARTING || !v->pid || v->kill_reason != KILL_NONE)
		return;
	if (v->hello_pending) {
		struct msg rep;
		int rc = rpc_wait(v->rpc, v->hello_corr, &rep, 0);
		if (rc == 0 && rep.type == MSG_HELLO_REPLY && rep.hello_reply.service.p &&
		    !strcmp(rep.hello_reply.service.p, v->name)) {
			v->hello_pending = false;
			if (hello_from_ours(v, (int)rep.hello_reply.pid)) {
				svc_mark_up(sup, v, &rep.hello_reply, now);
			} else if (!v->hello_pid_warned) {
				v->hello_pid_warned = true;
				log_warn("%s.ctl is answered by pid %llu, not by the %s we started (pid %d): waiting for ours",
					 v->name, (unsigned long long)rep.hello_reply.pid, v->name, v->pid);
			}
		} else if (rc == 0) {
			v->hello_pending = false;
			log_warn("%s answered HELLO with %s from '%s': ignored", v->name, msg_type_name(rep.type),
				 rep.type == MSG_HELLO_REPLY && rep.hello_reply.service.p ? rep.hello_reply.service.p : "");
		} else if (rc == -EREMOTEIO) {
			v->hello_pending = false;
			snprintf(v->last_error, sizeof(v->last_error), "answered HELLO with an error: %s",
				 rep.error.text.p ? rep.error.text.p : "(no text)");
			log_error("%s (pid %d) %s: killing it", v->name, v->pid, v->last_error);
			v->kill_reason = KILL_HELLO_ERROR;
			svc_signal(v, SIGKILL);
		} else if (rc != -ETIMEDOUT || now - v->hello_sent_ns > HELLO_RETRY_MS * NS_PER_MS) {
			/* Sent before the service bound its socket, or lost: again, on a fresh socket. */
			v->hello_pending = false;
			rpc_client_reset(v->rpc);
		}
		msg_free(&rep);
	}
	if (v->state != SVC_STARTING || v->kill_reason != KILL_NONE)
		return;
	if (!v->hello_pending) {
		struct msg req;
		msg_init(&req, MSG_HELLO, 0);
		req.hello.client.p = "pipeline-supervisor";
		req.hello.client.len = (uint32_t)strlen(req.hello.client.p);
		req.hello.proto = PROTO_VERSION;
		if (rpc_send(v->rpc, &req, &v->hello_corr) == 0) {
			v->hello_pending = true;
			v->hello_sent_ns = now;
		}
	}
	if (now - v->started_ns > (uint64_t)sup->cfg->ready_timeout_s * 1000000000ull) {
		snprintf(v->last_error, sizeof(v->last_error), "did not answer HELLO within %ld s of its start",
			 sup->cfg->ready_timeout_s);
		log_error("%s (pid %d) %s: killing it", v->name, v->pid, v->last_error);
		v->kill_reason = KILL_READY;
		svc_signal(v, SIGKILL);
	}
}

static void on_heartbeat(struct sup *sup, const struct msg_heartbeat *hb, uint64_t now)
{
	int i = hb->service.p ? sup_service_index(hb->service.p) : -1;
	if (i < 0) {
		log_debug("a heartbeat from an unknown service '%s': ignored", hb->service.p ? hb->service.p : "");
		return;
	}
	struct svc *v = &sup->s[i];
	/* Only the process that answered HELLO counts: a beat of an earlier epoch (or one sent before
	 * HELLO) says nothing about it. */
	if (v->state != SVC_UP || hb->epoch != v->epoch) {
		log_debug("%s: a heartbeat of epoch %016llx, not %016llx: ignored", v->name,
			  (unsigned long long)hb->epoch, (unsigned long long)v->epoch);
		return;
	}
	if (v->busy)
		log_info("%s beats again after %.1f s", v->name, ns_to_s(now - v->last_beat_ns));
	v->last_beat_ns = now;
	v->check_ns = now;
	v->beats++;
	v->busy = false;
	struct proc_info pi;
	if (proc_read(v->service_pid, &pi) == 0)
		v->cpu_mark = pi.cpu_ticks;
}

static void drain_heartbeats(struct sup *sup, uint64_t now)
{
	for (int n = 0; n < 1024; n++) {
		struct msg m;
		char err[256];
		int rc = bus_recv(sup->sub, &m, 0, err, sizeof(err));
		if (rc == -ETIMEDOUT)
			return;
		if (rc == -EINTR)
			continue;
		if (rc == -EBADMSG || rc == -ENOMSG || rc == -EPROTONOSUPPORT) {
			log_warn("a notification on a service's .pub does not decode: %s", err);
			continue;
		}
		if (rc) {
			log_warn("receiving heartbeats failed: %s", strerror(-rc));
			return;
		}
		if (m.type == MSG_HEARTBEAT)
			on_heartbeat(sup, &m.heartbeat, now);
		msg_free(&m);
	}
}

/* A service counts as hung when it has sent no heartbeat for hang_periods periods while its
 * process exists and either is stopped (SIGSTOP, a debugger) or sleeps having used no CPU time
 * since the last check (deadlocked, blocked). One that computes without beating (a long forward
 * step), waits to run, or waits for the disk is busy, not hung: it is looked at again a hang time
 * later. So a stopped process is found after hang_periods periods; a blocked one after one to two
 * hang times (it may have used CPU between its last beat and blocking). */
static void svc_check_hang(struct sup *sup, struct svc *v, uint64_t now)
{
	if (v->state != SVC_UP || v->kill_reason != KILL_NONE || sup->cfg->hang_periods <= 0)
		return;
	uint64_t limit = hang_ns(sup);
	if (now - v->check_ns <= limit)
		return;
	if (v->id == SUP_GPU_RUNNER && now < v->grace_until_ns)
		return;
	struct proc_info pi;
	int pid = v->service_pid > 0 ? v->service_pid : v->pid;
	if (proc_read(pid, &pi) != 0 && proc_read(v->pid, &pi) != 0)
		return; /* gone: its exit is reaped next */
	char st = pi.state;
	uint64_t ticks = pi.cpu_ticks;
	const char *how;
	if (st == 'T' || st == 't') {
		how = "its process is stopped";
	} else if (ticks > v->cpu_mark || st == 'R' || st == 'D') {
		if (!v->busy)
			log_info("%s has sent no heartbeat for %.1f s but is using CPU: busy, not hung", v->name,
				 ns_to_s(now - v->last_beat_ns));
		v->busy = true;
		v->cpu_mark = ticks;
		v->check_ns = now;
		return;
	} else {
		how = "it used no CPU time meanwhile";
	}
	snprintf(v->last_error, sizeof(v->last_error), "hung: no heartbeat for %.1f s (the limit is %.1f s) and %s; killed",
		 ns_to_s(now - v->last_beat_ns), ns_to_s(limit), how);
	log_warn("%s (pid %d) is hung: no heartbeat for %.1f s (the limit is %.1f s) and %s: killing it", v->name,
		 v->pid, ns_to_s(now - v->last_beat_ns), ns_to_s(limit), how);
	v->kill_reason = KILL_HANG;
	svc_signal(v, SIGKILL);
}

/* ---- restarts asked for, and stopping ---- */

static void request_restart(struct sup *sup, struct svc *v, uint64_t now)
{
	if (sup->phase == PHASE_STOPPING) {
		log_info("a restart of %s was asked for while stopping: ignored", v->name);
		return;
	}
	log_info("a restart of %s was asked for (it is %s)", v->name, state_names[v->state]);
	switch (v->state) {
	case SVC_STARTING:
	case SVC_UP:
		if (v->requested)
			return;
		v->requested = true;
		if (v->kill_reason == KILL_NONE) {
			/* SIGTERM: the service exits and leaves its shared state to its successor. */
			svc_signal(v, SIGTERM);
			v->kill_deadline_ns = now + (uint64_t)sup->cfg->stop_timeout_s * 1000000000ull;
		}
		return;
	case SVC_RESTARTING:
	case SVC_FAILED:
	case SVC_STOPPED:
		/* Asked for by the operator: the burst limit starts over. */
		v->n_history = 0;
		svc_launch(sup, v, "restart asked for");
		return;
	}
}

/* <run-dir>/<service>.restart asks for a restart; removing it is how the supervisor takes the
 * request (and tells the asker it did). */
static void check_markers(struct sup *sup, uint64_t now)
{
	char path[PATH_MAX];
	for (int i = 0; i < SUP_N_SERVICES; i++) {
		path_of(sup, sup->s[i].name, "restart", path, sizeof(path));
		if (unlink(path) == 0)
			request_restart(sup, &sup->s[i], now);
	}
}

static void begin_stop(struct sup *sup, const char *why)
{
	if (sup->phase == PHASE_STOPPING)
		return;
	log_info("stopping the services (%s)", why);
	sup->phase = PHASE_STOPPING;
	sup->stop_index = 0;
	for (int i = 0; i < SUP_N_SERVICES; i++) {
		struct svc *v = &sup->s[i];
		if (!v->pid && v->state != SVC_FAILED)
			v->state = SVC_STOPPED;
	}
}

/* Stops the services one at a time, gpu-runner first (it holds weight groups and KV blocks of the
 * others), with MSG_SHUTDOWN (the service removes its shared state), SIGTERM when that is not
 * answered; SIGKILL comes from the deadline check. */
static void stop_step(struct sup *sup, uint64_t now)
{
	while (sup->stop_index < SUP_N_SERVICES) {
		struct svc *v = &sup->s[SUP_N_SERVICES - 1 - sup->stop_index];
		if (!v->pid) {
			sup->stop_index++;
			continue;
		}
		if (v->kill_reason != KILL_STOP) {
			v->kill_reason = KILL_STOP;
			v->requested = false;
			v->kill_deadline_ns = now + (uint64_t)sup->cfg->stop_timeout_s * 1000000000ull;
			struct msg req;
			msg_init(&req, MSG_SHUTDOWN, 0);
			if (v->state == SVC_UP && rpc_send(v->rpc, &req, &v->shutdown_corr) == 0) {
				v->shutdown_pending = true;
				v->shutdown_sent_ns = now;
				log_info("asked %s (pid %d) to shut down", v->name, v->pid);
			} else {
				log_info("stopping %s (pid %d, %s) with SIGTERM", v->name, v->pid, state_names[v->state]);
				svc_signal(v, SIGTERM);
			}
		} else if (v->shutdown_pending) {
			struct msg rep;
			int rc = rpc_wait(v->rpc, v->shutdown_corr, &rep, 0);
			if (rc == 0 && rep.type == MSG_OK) {
				v->shutdown_pending = false;
			} else if (rc != -ETIMEDOUT || now - v->shutdown_sent_ns > SHUTDOWN_ANSWER_MS * NS_PER_MS) {
				v->shutdown_pending = false;
				log_warn("%s (pid %d) did not acknowledge MSG_SHUTDOWN: SIGTERM", v->name, v->pid);
				svc_signal(v, SIGTERM);
			}
			msg_free(&rep);
		}
		return;
	}
	sup->done = true;
}

static void check_deadlines(struct sup *sup, uint64_t now)
{
	for (int i = 0; i < SUP_N_SERVICES; i++) {
		struct svc *v = &sup->s[i];
		if (v->pid && v->kill_deadline_ns && now > v->kill_deadline_ns) {
			log_warn("%s (pid %d) did not exit in %ld s: SIGKILL", v->name, v->pid, sup->cfg->stop_timeout_s);
			v->kill_deadline_ns = 0;
			svc_signal(v, SIGKILL);
		}
		if (v->state == SVC_RESTARTING && now >= v->restart_at_ns && sup->phase != PHASE_STOPPING) {
			char why[600];
			snprintf(why, sizeof(why), "restart %u after: %s", v->restarts + 1, v->last_error);
			svc_launch(sup, v, why);
		}
	}
}

static void tick(struct sup *sup)
{
	uint64_t now = now_ns();
	reap_children(sup);
	drain_heartbeats(sup, now);
	for (int i = 0; i < SUP_N_SERVICES; i++) {
		svc_check_ready(sup, &sup->s[i], now);
		svc_check_hang(sup, &sup->s[i], now);
	}
	check_markers(sup, now);
	check_deadlines(sup, now);
	if (sup->phase == PHASE_STARTING && sup->s[SUP_KV_STORE].state == SVC_UP &&
	    sup->s[SUP_SSD_LOADER].state == SVC_UP) {
		/* The runner connects to both at its start: it comes once they answer. */
		if (sup->s[SUP_GPU_RUNNER].state == SVC_STOPPED)
			svc_launch(sup, &sup->s[SUP_GPU_RUNNER], "");
		sup->phase = PHASE_RUNNING;
	}
	if (sup->phase == PHASE_STOPPING)
		stop_step(sup, now);
}

/* ---- status ---- */

static const char *svc_health(const struct sup *sup, const struct svc *v, uint64_t now)
{
	switch (v->state) {
	case SVC_FAILED:
		return "failed";
	case SVC_UP:
		break;
	default:
		return "down";
	}
	if (v->kill_reason != KILL_NONE || v->requested)
		return "down";
	uint64_t silent = now - v->last_beat_ns;
	if (silent <= (uint64_t)sup->cfg->heartbeat_ms * NS_PER_MS + 500 * NS_PER_MS)
		return "ok";
	if (v->busy)
		return "busy";
	if (v->id == SUP_GPU_RUNNER && now < v->grace_until_ns && silent > hang_ns(sup))
		return "waiting";
	return "late";
}

/* Seconds to the millisecond (printed with JSON_REAL_PRECISION(10): no float noise). */
static json_t *json_seconds(uint64_t ns)
{
	return json_real((double)(ns / NS_PER_MS) / 1000.0);
}

static json_t *svc_json(const struct sup *sup, const struct svc *v, uint64_t now)
{
	json_t *o = json_object();
	json_t *argv = json_array();
	for (char **a = v->argv; *a; a++)
		json_array_append_new(argv, json_string(*a));
	char epoch[20];
	snprintf(epoch, sizeof(epoch), "%016llx", (unsigned long long)v->epoch);
	json_object_set_new(o, "pid", v->pid ? json_integer(v->pid) : json_null());
	json_object_set_new(o, "service_pid", v->service_pid ? json_integer(v->service_pid) : json_null());
	json_object_set_new(o, "state", json_string(state_names[v->state]));
	json_object_set_new(o, "health", json_string(svc_health(sup, v, now)));
	json_object_set_new(o, "uptime_s", v->pid ? json_seconds(now - v->started_ns) : json_null());
	json_object_set_new(o, "restarts", json_integer(v->restarts));
	json_object_set_new(o, "last_exit", v->last_exit[0] ? json_string(v->last_exit) : json_null());
	json_object_set_new(o, "last_error", v->last_error[0] ? json_string(v->last_error) : json_null());
	json_object_set_new(o, "epoch", v->state == SVC_UP ? json_string(epoch) : json_null());
	json_object_set_new(o, "heartbeats", json_integer((json_int_t)v->beats));
	json_object_set_new(o, "heartbeat_age_ms",
			    v->state == SVC_UP ? json_integer((json_int_t)((now - v->last_beat_ns) / NS_PER_MS)) : json_null());
	json_object_set_new(o, "next_restart_ms",
			    v->state == SVC_RESTARTING && v->restart_at_ns > now
				    ? json_integer((json_int_t)((v->restart_at_ns - now) / NS_PER_MS))
				    : json_null());
	json_object_set_new(o, "failures_in_window", json_integer(v->n_history));
	json_object_set_new(o, "argv", argv);
	return o;
}

static char *stats_json(void *ctx)
{
	struct sup *sup = ctx;
	const struct sup_config *cfg = sup->cfg;
	uint64_t now = now_ns();
	json_t *top = json_object();
	json_t *me = json_object();
	json_object_set_new(me, "pid", json_integer(getpid()));
	json_object_set_new(me, "instance", json_string(cfg->instance));
	json_object_set_new(me, "run_dir", json_string(cfg->run_dir));
	json_object_set_new(me, "state", json_string(phase_names[sup->phase]));
	json_object_set_new(me, "uptime_s", json_seconds(now - sup->started_ns));
	json_object_set_new(me, "heartbeat_ms", json_integer(cfg->heartbeat_ms));
	json_object_set_new(me, "hang_ms", json_integer((json_int_t)(hang_ns(sup) / NS_PER_MS)));
	json_object_set_new(me, "burst_limit", json_integer(cfg->burst_limit));
	json_object_set_new(me, "burst_window_s", json_integer(cfg->burst_window_s));
	json_object_set_new(top, "supervisor", me);
	json_t *services = json_object();
	for (int i = 0; i < SUP_N_SERVICES; i++)
		json_object_set_new(services, sup->s[i].name, svc_json(sup, &sup->s[i], now));
	json_object_set_new(top, "services", services);
	char *text = json_dumps(top, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
	json_decref(top);
	return text;
}

static void on_signal_fd(void *ctx, struct service *s, int fd)
{
	struct sup *sup = ctx;
	struct signalfd_siginfo si;
	while (read(fd, &si, sizeof(si)) == (ssize_t)sizeof(si)) {
		switch (si.ssi_signo) {
		case SIGCHLD:
			reap_children(sup);
			break;
		case SIGUSR1:
			check_markers(sup, now_ns());
			break;
		case SIGTERM:
		case SIGINT:
			begin_stop(sup, si.ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT");
			break;
		default:
			log_info("signal %u ignored", si.ssi_signo);
			break;
		}
	}
}

/* ---- setting up ---- */

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
static int build_argv(const struct sup_config *cfg, struct svc *v, char *err, size_t errlen)
{
	const struct sup_words *wrap = &cfg->wrap[v->id], *args = &cfg->args[v->id];
	size_t n = (size_t)wrap->n + 5 + (size_t)args->n + 1;
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
	snprintf(path, sizeof(path), "%s/%s", cfg->bin_dir, v->name);
	if (access(path, X_OK) != 0)
		return errorf(err, errlen, -ENOENT, "%s is not an executable (%s): is the tree built?", path, strerror(errno));
	v->argv[k++] = strdup(path);
	v->argv[k++] = strdup("--instance");
	v->argv[k++] = strdup(cfg->instance);
	v->argv[k++] = strdup("--run-dir");
	v->argv[k++] = strdup(cfg->run_dir);
	for (int i = 0; i < args->n; i++)
		v->argv[k++] = strdup(args->v[i]);
	for (size_t i = 0; i < k; i++)
		if (!v->argv[i])
			return errorf(err, errlen, -ENOMEM, "out of memory");
	return 0;
}

static void free_argv(struct svc *v)
{
	if (!v->argv)
		return;
	for (char **a = v->argv; *a; a++)
		free(*a);
	free(v->argv);
	v->argv = NULL;
}

/* Tells the process that started us (through the pipe fd) that we are serving, or why not. */
static void notify_parent(int *fd, const char *text)
{
	if (*fd < 0)
		return;
	size_t len = strlen(text);
	ssize_t w = write(*fd, text, len);
	(void)w;
	close(*fd);
	*fd = -1;
}

static int supervise(const struct sup_config *cfg, int notify_fd)
{
	struct sup sup = {.cfg = cfg, .sigfd = -1, .started_ns = now_ns()};
	char err[512];
	int status = SUP_EXIT_FAIL;

	for (int i = 0; i < SUP_N_SERVICES; i++) {
		sup.s[i].id = i;
		sup.s[i].name = sup_service_names[i];
		if (build_argv(cfg, &sup.s[i], err, sizeof(err)) != 0)
			goto out_argv;
	}
	/* Orphans of a service's wrapper come to us, and are reaped here. */
	if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0)
		log_warn("cannot become a child subreaper (%s): a wrapper's orphans go to init", strerror(errno));


	static const struct service_ops ops = {.stats = stats_json};
	sup.svc = service_create(SUP_NAME, cfg->run_dir, &ops, &sup);
	if (!sup.svc) {
		snprintf(err, sizeof(err), "cannot serve on %s/%s.ctl (is a supervisor of this instance running? see %s/%s.log)",
			 cfg->run_dir, SUP_NAME, cfg->run_dir, SUP_NAME);
		goto out_argv;
	}
	/* service_create set handlers for SIGINT and SIGTERM that end its loop at once; they come
	 * through the signalfd instead, so that the stop can take its time and reap as it goes. */
	sigset_t mask;
	sigemptyset(&mask);
	sigaddset(&mask, SIGCHLD);
	sigaddset(&mask, SIGTERM);
	sigaddset(&mask, SIGINT);
	sigaddset(&mask, SIGUSR1);
	sigaddset(&mask, SIGHUP);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	sup.sigfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
	if (sup.sigfd < 0 || service_add_fd(sup.svc, sup.sigfd, on_signal_fd) != 0) {
		snprintf(err, sizeof(err), "cannot watch signals: %s", strerror(errno));
		goto out_service;
	}
	sup.zctx = service_zmq_context(sup.svc);
	for (int i = 0; i < SUP_N_SERVICES; i++) {
		sup.s[i].rpc = rpc_client_create(sup.zctx, cfg->run_dir, sup.s[i].name, "pipeline-supervisor");
		if (!sup.s[i].rpc) {
			snprintf(err, sizeof(err), "cannot open a client of %s: %s", sup.s[i].name, strerror(errno));
			goto out_clients;
		}
	}
	/* One SUB for the three .pub sockets: it connects before they are bound and reconnects
	 * to each new process on its own. */
	char ep[300];
	bus_endpoint(cfg->run_dir, sup.s[0].name, "pub", ep, sizeof(ep));
	sup.sub = bus_connect_sub(sup.zctx, ep);
	for (int i = 1; sup.sub && i < SUP_N_SERVICES; i++) {
		bus_endpoint(cfg->run_dir, sup.s[i].name, "pub", ep, sizeof(ep));
		if (zmq_connect(sup.sub, ep) != 0) {
			zmq_close(sup.sub);
			sup.sub = NULL;
		}
	}
	if (!sup.sub) {
		snprintf(err, sizeof(err), "cannot subscribe to the services' heartbeats: %s", zmq_strerror(errno));
		goto out_clients;
	}
	snprintf(sup.pid_path, sizeof(sup.pid_path), "%s/%s.pid", cfg->run_dir, SUP_NAME);
	int rc = write_pid_file(sup.pid_path, getpid());
	if (rc) {
		snprintf(err, sizeof(err), "cannot write %.400s: %s", sup.pid_path, strerror(-rc));
		goto out_sub;
	}
	log_info("supervising instance %s in %s (heartbeat %ld ms, hung after %ld periods, at most %ld restarts in "
		 "%ld s, backoff %ld..%ld ms)",
		 cfg->instance, cfg->run_dir, cfg->heartbeat_ms, cfg->hang_periods, cfg->burst_limit, cfg->burst_window_s,
		 cfg->backoff_min_ms, cfg->backoff_max_ms);
	notify_parent(&notify_fd, "ok");

	svc_launch(&sup, &sup.s[SUP_KV_STORE], "");
	svc_launch(&sup, &sup.s[SUP_SSD_LOADER], "");
	while (!sup.done) {
		if (service_poll_once(sup.svc, TICK_MS) && sup.phase != PHASE_STOPPING)
			begin_stop(&sup, "MSG_SHUTDOWN");
		tick(&sup);
	}
	/* Answer what is waiting (a last STATS) before the socket goes. */
	service_poll_once(sup.svc, 0);
	log_info("every service is stopped: exiting");
	status = SUP_EXIT_OK;
	unlink(sup.pid_path);
	for (int i = 0; i < SUP_N_SERVICES; i++) {
		char path[PATH_MAX];
		path_of(&sup, sup.s[i].name, "restart", path, sizeof(path));
		unlink(path);
	}
out_sub:
	if (sup.sub)
		zmq_close(sup.sub);
out_clients:
	for (int i = 0; i < SUP_N_SERVICES; i++)
		rpc_client_destroy(&sup.s[i].rpc);
out_service:
	service_destroy(&sup.svc);
	if (sup.sigfd >= 0)
		close(sup.sigfd);
out_argv:
	for (int i = 0; i < SUP_N_SERVICES; i++)
		free_argv(&sup.s[i]);
	if (status != SUP_EXIT_OK) {
		log_error("%s", err);
		notify_parent(&notify_fd, err);
	}
	return status;
}

int sup_daemon_run(const struct sup_config *cfg)
{
	if (run_dir_prepare(cfg->run_dir) != 0)
		return SUP_EXIT_FAIL;
	if (cfg->foreground)
		return supervise(cfg, -1);

	char log_path[PATH_MAX];
	snprintf(log_path, sizeof(log_path), "%s/%s.log", cfg->run_dir, SUP_NAME);
	int p[2];
	if (pipe2(p, O_CLOEXEC) != 0) {
		fprintf(stderr, "pipeline-supervisor: cannot make a pipe: %s\n", strerror(errno));
		return SUP_EXIT_FAIL;
	}
	int pid = fork();
	if (pid < 0) {
		fprintf(stderr, "pipeline-supervisor: cannot fork: %s\n", strerror(errno));
		close(p[0]);
		close(p[1]);
		return SUP_EXIT_FAIL;
	}
	if (pid > 0) {
		/* The starter: waits until the supervisor serves (it writes "ok") or says why not. */
		close(p[1]);
		char buf[1024];
		size_t n = 0;
		for (;;) {
			ssize_t r = read(p[0], buf + n, sizeof(buf) - 1 - n);
			if (r < 0 && errno == EINTR)
				continue;
			if (r <= 0 || (n += (size_t)r) >= sizeof(buf) - 1)
				break;
		}
		close(p[0]);
		buf[n] = 0;
		if (!strcmp(buf, "ok")) {
			printf("supervisor of instance %s started (pid %d, log %s)\n", cfg->instance, pid, log_path);
			return SUP_EXIT_OK;
		}
		fprintf(stderr, "pipeline-supervisor: %s\n",
			n ? buf : "the supervisor exited before it served (its log may say why)");
		return SUP_EXIT_FAIL;
	}

	/* The supervisor: its own session, no terminal, its output in the log. */
	close(p[0]);
	setsid();
	umask(077);
	int null_fd = open("/dev/null", O_RDWR);
	int log_fd = open(log_path, O_WRONLY | O_APPEND | O_CREAT, 0600);
	if (null_fd < 0 || log_fd < 0) {
		char err[PATH_MAX + 64];
		snprintf(err, sizeof(err), "cannot open %s: %s", null_fd < 0 ? "/dev/null" : log_path, strerror(errno));
		notify_parent(&p[1], err);
		_exit(SUP_EXIT_FAIL);
	}
	dup2(null_fd, 0);
	dup2(log_fd, 1);
	dup2(log_fd, 2);
	close(null_fd);
	close(log_fd);
	/* Paths are absolute (checked at parse): the working directory is not held. */
	if (chdir("/") != 0)
		log_warn("cannot change directory to /: %s", strerror(errno));
	exit(supervise(cfg, p[1]));
}

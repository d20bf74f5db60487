/* daemon.c - the supervisor proper: one event loop (common/service.h's) that starts the three
 * services (and a runner per GPU beyond the first), reaps them, watches their heartbeats, restarts them and answers status; and becoming
 * a daemon. The loop's parts are in launch.c, health.c, stop.c and status.c
 * (daemon_internal.h). */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/log.h"
#include "common/service.h"
#include "common/util.h"
#include "tools/supervisor/daemon_internal.h"

const char *const svc_state_names[] = {"stopped", "starting", "up", "restarting", "failed"};

const char *const sup_service_names[SUP_N_KINDS] = {"kv-store", "ssd-loader", "gpu-runner", "http-api"};

int sup_service_index(const char *name)
{
	for (int i = 0; i < SUP_N_KINDS; i++)
		if (!strcmp(name, sup_service_names[i]))
			return i;
	return -1;
}

int sup_service_kind(const char *name, int *rank)
{
	int i = sup_service_index(name);
	if (rank)
		*rank = 0;
	if (i >= 0)
		return i;
	size_t len = strlen(sup_service_names[SUP_GPU_RUNNER]);
	if (strncmp(name, sup_service_names[SUP_GPU_RUNNER], len) || name[len] != '-' || name[len + 1] < '1' ||
	    name[len + 1] > '0' + SUP_MAX_RANKS - 1 || name[len + 2])
		return -1;
	if (rank)
		*rank = name[len + 1] - '0';
	return SUP_GPU_RUNNER;
}

void sup_service_name(int i, char *buf, size_t len)
{
	if (i < SUP_N_SERVICES)
		snprintf(buf, len, "%s", sup_service_names[i]);
	else if (i == SUP_HTTP_NAME_INDEX)
		snprintf(buf, len, "%s", sup_service_names[SUP_HTTP_API]);
	else
		snprintf(buf, len, "%s-%d", sup_service_names[SUP_GPU_RUNNER], i - SUP_GPU_RUNNER);
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
		.stop_timeout_s = SUP_STOP_TIMEOUT_S,
	};
}

static void tick(struct sup *sup)
{
	uint64_t now = now_ns();
	reap_children(sup);
	drain_heartbeats(sup, now);
	for (int i = 0; i < sup->n; i++) {
		svc_check_ready(sup, &sup->s[i], now);
		svc_check_hang(sup, &sup->s[i], now);
	}
	check_markers(sup, now);
	check_deadlines(sup, now);
	if (sup->phase == PHASE_STARTING && sup->s[SUP_KV_STORE].state == SVC_UP &&
	    sup->s[SUP_SSD_LOADER].state == SVC_UP) {
		/* The runners connect to both at their start: they come once they answer, all at once
		 * (rank 0 forms the others, each of which plans and loads its own layers meanwhile). */
		for (int i = SUP_GPU_RUNNER; i < sup->n; i++) /* the runners, and http-api */
			if (sup->s[i].state == SVC_STOPPED)
				svc_launch(sup, &sup->s[i], "");
		sup->phase = PHASE_RUNNING;
	}
	if (sup->phase == PHASE_STOPPING)
		stop_step(sup, now);
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
	int lock_fd = -1;

	/* kv-store, ssd-loader, the runners, then http-api: the start order. */
	int n_runners = cfg->n_ranks > 1 ? cfg->n_ranks : 1;
	sup.n = SUP_GPU_RUNNER + n_runners + (cfg->http_listen ? 1 : 0);
	for (int i = 0; i < sup.n; i++) {
		struct svc *v = &sup.s[i];
		v->id = i;
		v->kind = i < SUP_GPU_RUNNER ? i : i < SUP_GPU_RUNNER + n_runners ? SUP_GPU_RUNNER : SUP_HTTP_API;
		v->rank = v->kind == SUP_GPU_RUNNER ? i - SUP_GPU_RUNNER : 0;
		sup_service_name(v->kind == SUP_HTTP_API ? SUP_HTTP_NAME_INDEX : i, v->name_buf, sizeof(v->name_buf));
		v->name = v->name_buf;
		if (build_argv(cfg, v, err, sizeof(err)) != 0)
			goto out_argv;
	}
	/* Orphans of a service's wrapper come to us, and are reaped here. */
	if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0)
		log_warn("cannot become a child subreaper (%s): a wrapper's orphans go to init", strerror(errno));


	/* One supervisor a run directory, for its whole life: a second one (two runs at once, which
	 * the script's start lock does not see) would bind over the first's sockets and remove them
	 * on its way out, leaving the first running where no command finds it. */
	char lock_path[PATH_MAX];
	snprintf(lock_path, sizeof(lock_path), "%s/%s.lock", cfg->run_dir, SUP_NAME);
	lock_fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (lock_fd < 0) {
		snprintf(err, sizeof(err), "cannot open %.400s: %s", lock_path, strerror(errno));
		goto out_argv;
	}
	if (flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
		snprintf(err, sizeof(err), "another supervisor runs for %.400s (it holds %s.lock): stop it first, or "
			 "pick another --instance", cfg->run_dir, SUP_NAME);
		goto out_argv;
	}

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
	for (int i = 0; i < sup.n; i++) {
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
	for (int i = 1; sup.sub && i < sup.n; i++) {
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
	for (int i = 0; i < sup.n; i++) {
		char path[PATH_MAX];
		path_of(&sup, sup.s[i].name, "restart", path, sizeof(path));
		unlink(path);
	}
out_sub:
	if (sup.sub)
		zmq_close(sup.sub);
out_clients:
	for (int i = 0; i < sup.n; i++)
		rpc_client_destroy(&sup.s[i].rpc);
out_service:
	service_destroy(&sup.svc);
	if (sup.sigfd >= 0)
		close(sup.sigfd);
out_argv:
	for (int i = 0; i < sup.n; i++)
		free_argv(&sup.s[i]);
	/* What the services left (one killed after its stop timeout leaves its sockets and shared
	 * memory), removed as a client's stop would, the lock still held so that no new supervisor
	 * starts among the files (its own sockets are gone with the service above). */
	if (status == SUP_EXIT_OK)
		sup_instance_cleanup_locked(cfg->instance, cfg->run_dir);
	if (lock_fd >= 0)
		close(lock_fd); /* the lock goes with it (the file stays: removing it would race a new one) */
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

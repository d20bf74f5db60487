/* supervisor.h - pipeline-supervisor: one process per instance that starts the three services,
 * restarts them when they exit or hang, and answers status on <run-dir>/supervisor.ctl.
 *
 *   struct sup_config cfg;  sup_config_defaults(&cfg);  ... fill from the command line ...
 *   rc = sup_daemon_run(&cfg);            // daemonises (unless cfg.foreground); returns the exit status
 *
 *   rc = sup_client_status(run_dir, json, timeout_s);      // the client commands of the same binary
 *   rc = sup_client_wait(run_dir, timeout_s);
 *   rc = sup_client_shutdown(run_dir, timeout_s);
 *   rc = sup_client_restart(run_dir, "kv-store", timeout_s);
 *
 * The supervisor speaks the project's protocol (common/protocol.h) through common/service.h's
 * loop: MSG_HELLO, MSG_PING, MSG_STATS_GET (-> MSG_STATS, the JSON below) and MSG_SHUTDOWN (stop
 * the services, then exit). A restart of one service is asked for with a marker file,
 * <run-dir>/<service>.restart, that the supervisor removes when it acts on it.
 *
 * The status JSON:
 *   {"supervisor": {"pid", "instance", "run_dir", "state": "starting"|"running"|"stopping",
 *                   "uptime_s", "heartbeat_ms", "hang_ms", "burst_limit", "burst_window_s"},
 *    "services": {"kv-store": {...}, "ssd-loader": {...}, "gpu-runner": {...}}}
 * and per service: "pid" (the process the supervisor started, or null), "service_pid" (the pid the
 * service named in HELLO: another one under a wrapper), "state" (starting, up, restarting, failed,
 * stopped), "health" (ok, late, busy, waiting, down, failed), "uptime_s", "restarts", "last_exit"
 * ("exit N", "signal N (SIGNAME)" or null), "last_error" (text or null), "epoch", "heartbeat_age_ms",
 * "next_restart_ms", "failures_in_window", "argv". Exit status of the commands: 0 success, 1 failure,
 * 2 bad usage. */
#ifndef PIPELINE_SUPERVISOR_H
#define PIPELINE_SUPERVISOR_H
#include <stdbool.h>
#include <stdint.h>

#define SUP_N_SERVICES 3
#define SUP_EXIT_OK 0
#define SUP_EXIT_FAIL 1
#define SUP_EXIT_USAGE 2
/* The stop ladder, for each service in turn (the supervisor's stop, and the stop of services that
 * run without one): MSG_SHUTDOWN (the service removes its shared state and exits); SIGTERM when
 * that is not acknowledged within SUP_SHUTDOWN_ANSWER_MS; SIGKILL when it has not exited after
 * the stop timeout (--stop-timeout-s, PIPELINE_STOP_TIMEOUT in scripts/pipeline). */
#define SUP_SHUTDOWN_ANSWER_MS 5000
#define SUP_STOP_TIMEOUT_S 10 /* the stop timeout's default */
/* The name the supervisor's sockets, pid file and log carry in the run directory. */
#define SUP_NAME "supervisor"
#define SUP_MAX_WORDS 256 /* words per service command line (arguments or wrapper) */

/* Start order: kv-store and ssd-loader together, then gpu-runner (it connects to both). Stop goes
 * the other way. */
enum sup_service { SUP_KV_STORE = 0, SUP_SSD_LOADER = 1, SUP_GPU_RUNNER = 2 };
extern const char *const sup_service_names[SUP_N_SERVICES];

/* The k-th service to stop (k = 0 .. SUP_N_SERVICES - 1): the start order reversed. */
static inline int sup_stop_order(int k)
{
	return SUP_N_SERVICES - 1 - k;
}

/* Returns the index of name in sup_service_names, or -1. */
int sup_service_index(const char *name);

struct sup_words {
	const char *v[SUP_MAX_WORDS]; /* borrowed from argv */
	int n;
};

struct sup_config {
	const char *instance;
	const char *run_dir; /* absolute */
	const char *bin_dir; /* absolute: <bin_dir>/<service> is run */
	const char *log_level;
	long heartbeat_ms;   /* the period the services publish MSG_HEARTBEAT at */
	long hang_periods;   /* missed periods before an up service counts as hung; 0: never */
	long peer_grace_ms;  /* gpu-runner is not judged hung this long after a peer comes back */
	long backoff_min_ms, backoff_max_ms;
	long burst_limit;    /* restarts allowed within burst_window_s before giving up */
	long burst_window_s;
	long ready_timeout_s; /* HELLO must come this long after a start */
	long stop_timeout_s;  /* after MSG_SHUTDOWN or SIGTERM, SIGKILL when this passes */
	bool foreground;
	struct sup_words args[SUP_N_SERVICES]; /* after --instance NAME --run-dir DIR */
	struct sup_words wrap[SUP_N_SERVICES]; /* a tool the service runs under (PIPELINE_WRAP_*) */
};

void sup_config_defaults(struct sup_config *cfg);

/* Runs the supervisor. Without cfg->foreground the calling process returns 0 once the
 * supervisor (a new session, logging to <run-dir>/supervisor.log) has bound its socket and
 * written <run-dir>/supervisor.pid, or 1 after printing why it could not. Returns an exit status. */
int sup_daemon_run(const struct sup_config *cfg);

/* ---- client commands (client.c): each prints what it found and returns an exit status ---- */

/* Prints the supervisor's view (a table, or the JSON with json). 0 when all three services are up. */
int sup_client_status(const char *run_dir, bool json, long timeout_s);
/* Waits until all three services are up (0), one failed (1, with its log's tail), the
 * supervisor went away (1) or timeout_s passed (1; 0 waits as long as the supervisor lives).
 * Prints "SERVICE ready (pid N)" as each comes up. */
int sup_client_wait(const char *run_dir, long timeout_s);
/* MSG_SHUTDOWN, then waits up to timeout_s for the supervisor to exit. */
int sup_client_shutdown(const char *run_dir, long timeout_s);
/* Asks for a restart of service (the marker file) and waits until it is up again. */
int sup_client_restart(const char *run_dir, const char *service, long timeout_s);

/* ---- shared by both sides ---- */

/* Prints the last lines of <run_dir>/<name>.log on stderr, indented ("  | "). */
void sup_print_log_tail(const char *run_dir, const char *name, int lines);

#endif

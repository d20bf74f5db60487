/* supervisor.h - pipeline-supervisor: one process per instance that starts the three services
 * (and the HTTP front door with --http),
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
 *   rc = sup_instance_pids(run_dir, NULL);                  // the instance seen from outside, with
 *   rc = sup_instance_stop(instance, run_dir, 10);          // or without a supervisor
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
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SUP_N_SERVICES 3 /* the services every instance runs: kv-store, ssd-loader, gpu-runner */
#define SUP_N_KINDS 4	 /* the kinds of service: those three and http-api (--http) */
/* Runners of one model split across GPUs (--gpus: gpu-runner, gpu-runner-1, ...). */
#define SUP_MAX_RANKS 8
#define SUP_SERVICE_BEAT_MS 1000 /* the period every service beats at (common/service.c's HEARTBEAT_MS) */
/* The names a supervisor's services may have, in start order (sup_service_name): the three,
 * gpu-runner-1 .. gpu-runner-<SUP_MAX_RANKS - 1>, then http-api; and so the most services one
 * supervisor runs. */
#define SUP_MAX_SERVICES (SUP_N_SERVICES - 1 + SUP_MAX_RANKS + 1)
#define SUP_HTTP_NAME_INDEX (SUP_MAX_SERVICES - 1)
#define SUP_EXIT_OK 0
#define SUP_EXIT_FAIL 1
#define SUP_EXIT_USAGE 2
#define SUP_TIMEOUT_MAX_S (INT_MAX / 1000) /* --timeout: its wait in milliseconds fits an int */
#define SUP_EXIT_NO_SERVICE 3 /* restart: the instance runs no such service */
/* The stop ladder, for each service in turn (the supervisor's stop, and the stop of services that
 * run without one): MSG_SHUTDOWN (the service removes its shared state and exits); SIGTERM when
 * that is not acknowledged within SUP_SHUTDOWN_ANSWER_MS; SIGKILL when it has not exited after
 * the stop timeout (--stop-timeout-s, PIPELINE_STOP_TIMEOUT in scripts/pipeline). */
#define SUP_SHUTDOWN_ANSWER_MS 5000
#define SUP_STOP_TIMEOUT_S 10 /* the stop timeout's default */
/* The name the supervisor's sockets, pid file and log carry in the run directory. */
#define SUP_NAME "supervisor"
#define SUP_MAX_WORDS 256 /* words per service command line (arguments or wrapper) */

/* Start order: kv-store and ssd-loader together, then gpu-runner (it connects to both), and with
 * --gpus each further runner gpu-runner-1 .. gpu-runner-<N-1> with it, and with --http the HTTP
 * front door with them (it answers 503 until the runner is up). Stop goes the other way: http-api
 * first, so that no request comes in while the rest stops. */
enum sup_service { SUP_KV_STORE = 0, SUP_SSD_LOADER = 1, SUP_GPU_RUNNER = 2, SUP_HTTP_API = 3 };
extern const char *const sup_service_names[SUP_N_KINDS];

/* The k-th of n services to stop (k = 0 .. n - 1): the start order reversed. */
static inline int sup_stop_order(int n, int k)
{
	return n - 1 - k;
}

/* Returns the index of name in sup_service_names, or -1. */
int sup_service_index(const char *name);
/* The kind of service `name` is (an index of sup_service_names), with the runner's rank in *rank
 * (may be NULL): "gpu-runner-R" (R 1 .. SUP_MAX_RANKS - 1) is a gpu-runner of rank R, the others rank
 * 0. -1 for a name that is none. */
int sup_service_kind(const char *name, int *rank);
/* The i-th name of the names a supervisor's services may have (i < SUP_MAX_SERVICES) into buf:
 * kv-store, ssd-loader, gpu-runner, gpu-runner-1, ..., gpu-runner-7, http-api. */
void sup_service_name(int i, char *buf, size_t len);

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
	struct sup_words args[SUP_N_KINDS]; /* after --instance NAME --run-dir DIR, per kind */
	struct sup_words wrap[SUP_N_KINDS]; /* a tool the service runs under (PIPELINE_WRAP_*) */
	/* --http ADDR:PORT: run http-api too, with --listen ADDR:PORT before its words; NULL: not. */
	const char *http_listen;
	/* --ranks / --gpus: runners that split the model's layers (n_ranks; 0 or 1: one runner, as args
	 * say), and the CUDA device of each (n_gpus of them, n_gpus == n_ranks; 0: none given). Runner R
	 * gets --rank R --ranks n_ranks (with several) and --gpu gpus[R] (with devices) after its args. */
	int n_ranks;
	int gpus[SUP_MAX_RANKS];
	int n_gpus;
};

void sup_config_defaults(struct sup_config *cfg);

/* Runs the supervisor. Without cfg->foreground the calling process returns 0 once the
 * supervisor (a new session, logging to <run-dir>/supervisor.log) has bound its socket and
 * written <run-dir>/supervisor.pid, or 1 after printing why it could not. Returns an exit status. */
int sup_daemon_run(const struct sup_config *cfg);

/* ---- client commands (client.c): each prints what it found and returns an exit status ---- */

/* Prints the supervisor's view (a table, or the JSON with json). 0 when all its services are up. */
int sup_client_status(const char *run_dir, bool json, long timeout_s);
/* Waits until all its services are up (0), one failed (1, with its log's tail), the
 * supervisor went away (1) or timeout_s passed (1; 0 waits as long as the supervisor lives).
 * Prints "SERVICE ready (pid N)" as each comes up. */
int sup_client_wait(const char *run_dir, long timeout_s);
/* MSG_SHUTDOWN, then waits up to timeout_s for the supervisor to exit. */
int sup_client_shutdown(const char *run_dir, long timeout_s);
/* Asks for a restart of service (the marker file) and waits until it is up again. */
int sup_client_restart(const char *run_dir, const char *service, long timeout_s);

/* ---- the instance seen from outside (instance.c): each prints what it found, returns an exit status ---- */

/* Prints "NAME PID" for each live process of the instance, the supervisor first, then the
 * services in start order (with name, only that one's pid). 0 when one was found, 1 when none. */
int sup_instance_pids(const char *run_dir, const char *name);
/* The pid in name's pid file (SUP_NAME or a service) if it names a live process that runs that
 * program for run_dir (not another that got the number since), else 0. */
int sup_instance_live_pid(const char *run_dir, const char *name);
/* Prints each service's pid file, whether that process runs the service, whether the service
 * answers HELLO and how long it has run: a table for when no supervisor answers. 0 when one of
 * them runs, 1 when none does. */
int sup_instance_ps(const char *run_dir);
/* Stops the instance, whatever runs of it: the supervisor (sup_client_stop_supervisor, waiting
 * 3 x the longer of stop_timeout_s and the instance's own stop timeout, + 20 s, SIGKILL after
 * that), then each service still running without one,
 * in stop order, down the stop ladder; a service's socket without its pid file gets MSG_SHUTDOWN.
 * Then sup_instance_cleanup. Prints the name of each process it found running, one a line (the
 * supervisor and what it supervised, then what ran without it). 0, or 1 when one survived SIGKILL. */
int sup_instance_stop(const char *instance, const char *run_dir, long stop_timeout_s);
/* Removes what a stopped instance leaves in run_dir: pid files, sockets, restart markers,
 * start.args, a dead kv-store's kv-spill.bin; and its shared-memory objects
 * (/dev/shm/llmp-<uid>-<instance>-<object>), except one a live process owns (common/shm.h's
 * header names it): that is another instance of the same name in another run directory, whose
 * objects a failed start must not take away. Logs stay. Returns 0; 1 (nothing removed) where a
 * live supervisor holds run_dir's supervisor.lock, which is held while the files go. */
int sup_instance_cleanup(const char *instance, const char *run_dir);
/* The same without the lock's check: for the one holding it (the supervisor at its exit). */
void sup_instance_cleanup_locked(const char *instance, const char *run_dir);
/* The live supervisor's stop timeout (its status's stop_timeout_s) where longer than fallback_s,
 * else fallback_s (also where it does not answer). */
long sup_client_stop_timeout(const char *run_dir, long fallback_s);

/* ---- shared by both sides ---- */

/* Prints the last lines of <run_dir>/<name>.log on stderr, indented ("  | "). */
void sup_print_log_tail(const char *run_dir, const char *name, int lines);

/* Formats seconds as "45s", "3m10s", "2h05m09s" or "1d02h05m". */
void sup_format_duration(double s, char *buf, size_t len);
/* The pid in <run_dir>/<name>.pid (name: SUP_NAME or a service), 0 when there is none. */
int sup_read_pid_file(const char *run_dir, const char *name);
/* Sends MSG_SHUTDOWN to <run_dir>/<name>.ctl and waits up to timeout_ms for MSG_OK. Returns 0, or
 * -ENOENT (no socket), -ETIMEDOUT, -EBADMSG (another answer) or another -errno, saying which in
 * err. */
int sup_ask_shutdown(const char *run_dir, const char *name, int timeout_ms, char *err, size_t errlen);
/* Waits up to timeout_ms for pid to exit (a zombie has). Returns true once it has. */
bool sup_wait_exit(int pid, long timeout_ms);
/* Stops the supervisor pid of run_dir: MSG_SHUTDOWN, SIGTERM when that is not acknowledged, then
 * waits up to timeout_s for it to exit. Prints only what went wrong. Returns 0 or -ETIMEDOUT. */
int sup_client_stop_supervisor(const char *run_dir, int pid, long timeout_s);

#endif

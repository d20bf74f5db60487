/* daemon_internal.h - what the parts of the supervisor daemon share: the state of each service
 * and of the supervisor, and the calls one part makes into another. Not for the client commands
 * (supervisor.h has what both sides share).
 *
 *   daemon.c   the event loop: setting up, the tick, signals, becoming a daemon
 *   launch.c   starting a service, its command line, restart policy, reaping its exit
 *   health.c   readiness (HELLO), heartbeats and hang detection
 *   stop.c     restarts asked for by the operator, and the stop of the whole instance
 *   status.c   the status JSON (MSG_STATS)
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
 * supervisor) goes down the stop ladder (supervisor.h) for gpu-runner, then ssd-loader, then
 * kv-store, one after the other, and then exits.
 *
 * Each service runs in a process group of its own (the wrapper of PIPELINE_WRAP_* and the service
 * under it together), and signals go to the group. The supervisor is a child subreaper, so a
 * service whose wrapper died is still reaped here and never lingers as a zombie. */
#ifndef PIPELINE_SUPERVISOR_DAEMON_INTERNAL_H
#define PIPELINE_SUPERVISOR_DAEMON_INTERNAL_H
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "common/bus.h"
#include "tools/supervisor/supervisor.h"

#define TICK_MS 100
#define HELLO_RETRY_MS 500 /* a HELLO unanswered this long is sent again on a fresh socket */
#define MAX_HISTORY 64	   /* restarts remembered for the burst limit */
#define NS_PER_MS 1000000ull

enum svc_state { SVC_STOPPED = 0, SVC_STARTING = 1, SVC_UP = 2, SVC_RESTARTING = 3, SVC_FAILED = 4 };
extern const char *const svc_state_names[]; /* by enum svc_state: "stopped", "starting", ... */

/* Why the supervisor is ending the current process of a service (what its exit means). */
enum kill_reason {
	KILL_NONE = 0,
	KILL_HANG = 1,	      /* heartbeats stopped: a failure, restarted */
	KILL_READY = 2,	      /* no HELLO within the ready timeout */
	KILL_HELLO_ERROR = 3, /* answered HELLO with MSG_ERROR (another protocol version) */
	KILL_STOP = 4,	      /* the supervisor is stopping: not restarted */
};

struct svc {
	int id;		   /* its index in sup.s */
	int kind;	   /* enum sup_service */
	int rank;	   /* a gpu-runner's rank (--gpus), 0 for the others */
	const char *name;
	char name_buf[32];
	char **argv;	   /* the command line, the same at every start (owned, NULL-terminated) */
	int exe_fd;	   /* argv's service binary, open since build_argv: what every start runs
			    * (fexecve), -1 for a wrapped service (started by path) */
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
	uint32_t failed_starts; /* starts in a row that ended before HELLO (0 once one comes up): the
				 * limit for failures slower than the window can count */
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
	struct svc s[SUP_MAX_SERVICES];
	int n; /* services: the three kinds, plus a runner per GPU beyond the first */
	char pid_path[PATH_MAX];
};

static inline double ns_to_s(uint64_t ns)
{
	return (double)ns / 1e9;
}

/* The silence after which an up service is looked at for a hang. */
static inline uint64_t hang_ns(const struct sup *sup)
{
	return (uint64_t)sup->cfg->hang_periods * (uint64_t)sup->cfg->heartbeat_ms * NS_PER_MS;
}

/* <run-dir>/<name>.<suffix> */
static inline void path_of(const struct sup *sup, const char *name, const char *suffix, char *buf, size_t len)
{
	snprintf(buf, len, "%s/%s.%s", sup->cfg->run_dir, name, suffix);
}

/* ---- launch.c ---- */

/* Builds v's command line: [wrapper...] <bin_dir>/<service> --instance I --run-dir R [args...].
 * Returns 0, or -errno with a message in err; free_argv undoes it (after a failure too). */
int build_argv(const struct sup_config *cfg, struct svc *v, char *err, size_t errlen);
void free_argv(struct svc *v);
/* Starts v's command line in a new process group, stdin from /dev/null, stdout and stderr
 * appended to <run-dir>/<service>.log. why is written to the log ("" for the first start). */
void svc_launch(struct sup *sup, struct svc *v, const char *why);
/* Signals the process group of v (the wrapper and what it runs), or the process alone when the
 * group is not there (it had no time to make it). */
void svc_signal(struct svc *v, int sig);
/* Reaps every child that exited, and acts on the exit of a service. */
void reap_children(struct sup *sup);
/* Writes pid to path through a temporary file and rename, so a reader never sees half a
 * number. Returns 0 or -errno. */
int write_pid_file(const char *path, int pid);

/* ---- health.c ---- */

/* The runners' grace: a peer (kv-store or ssd-loader) that was up went down. */
void runner_peer_down(struct sup *sup);
/* A starting v: HELLO sent, its answer taken (v is up), or the ready timeout enforced. */
void svc_check_ready(struct sup *sup, struct svc *v, uint64_t now);
/* Takes the heartbeats waiting on the SUB socket. */
void drain_heartbeats(struct sup *sup, uint64_t now);
/* An up v silent for the hang time: busy (looked at again later) or hung (killed). */
void svc_check_hang(struct sup *sup, struct svc *v, uint64_t now);

/* ---- stop.c ---- */

/* Acts on the restart markers <run-dir>/<service>.restart. */
void check_markers(struct sup *sup, uint64_t now);
/* Enters the stopping phase (why is logged); stop_step then stops one service at a time. */
void begin_stop(struct sup *sup, const char *why);
void stop_step(struct sup *sup, uint64_t now);
/* SIGKILL for a process past its deadline; the launch of a restart whose backoff passed. */
void check_deadlines(struct sup *sup, uint64_t now);

/* ---- status.c ---- */

/* The status JSON (supervisor.h), malloc'd; the stats callback of the supervisor's service. */
char *stats_json(void *ctx);

#endif

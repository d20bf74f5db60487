/* service.h - the event loop every service runs: its ROUTER and PUB sockets, generic
 * messages (HELLO, PING, STATS_GET, SHUTDOWN), heartbeats, extra file descriptors (an
 * io_uring eventfd), periodic ticks and clean exit on SIGINT/SIGTERM.
 *
 *   struct service_ops ops = {.handle = my_handle, .hello = my_hello, .stats = my_stats};
 *   struct service *s = service_create("kv-store", run_dir, &ops, me);
 *   service_add_fd(s, ring_eventfd, my_on_fd);
 *   rc = service_run(s);           // until SHUTDOWN or a signal
 *   service_destroy(&s);
 *
 * Every second the PUB socket carries MSG_HEARTBEAT and, when ops->stats is set, MSG_STATS.
 * MSG_CONFIG_GET / MSG_CONFIG_SET read and change the parameters registered with
 * service_add_tunable / service_add_fixed (live tuning; log-level is always there).
 * A malformed or unknown request gets MSG_ERROR and a log line; the loop keeps serving.
 * service_create makes the run directory (mode 0700) if needed, refuses one that another user
 * owns, and sets one that group or others may use to 0700 (run_dir_prepare). */
#ifndef PIPELINE_SERVICE_H
#define PIPELINE_SERVICE_H
#include <stdbool.h>
#include <stdint.h>

#include "common/bus.h"
#include "common/protocol.h"
#include "common/tunable.h"
#ifdef __cplusplus
extern "C" {
#endif

struct service;

struct service_ops {
	/* A request of a type the loop does not handle itself. Reply through service_reply*
	 * now or later (keep a copy of peer and corr). Return 0, or a negative errno to have the
	 * loop reply MSG_ERROR with errtext (a message naming the problem). */
	int (*handle)(void *ctx, struct service *s, const struct bus_peer *peer, const struct msg *req,
		      char *errtext, size_t errlen);
	/* Fills the service-specific HELLO fields (layout, manifest_hash, shm_name, shm_size);
	 * req is the client's HELLO (req->hello.client names it). Strings must stay alive until
	 * the reply is sent. May be NULL. */
	void (*hello)(void *ctx, const struct msg *req, struct msg_hello_reply *reply);
	/* Returns a malloc'd JSON object text of the service's counters. May be NULL. */
	char *(*stats)(void *ctx);
	/* Called about every tick_ms. May be NULL. */
	void (*tick)(void *ctx, struct service *s);
	/* Called when the loop is about to return (after SHUTDOWN or a signal). May be NULL. */
	void (*stopping)(void *ctx, struct service *s);
};

typedef void (*service_fd_fn)(void *ctx, struct service *s, int fd);

/* Prepares run_dir (0700), binds <run_dir>/<name>.ctl and .pub. Returns NULL after logging why. */
struct service *service_create(const char *name, const char *run_dir, const struct service_ops *ops, void *ctx);
void service_destroy(struct service **s);

/* Adds a file descriptor to poll for reading; fn runs when it is readable. Returns 0 or -ENOSPC. */
int service_add_fd(struct service *s, int fd, service_fd_fn fn);
/* Sets the period of ops->tick and of heartbeats' check (default 100 ms). */
void service_set_tick(struct service *s, int tick_ms);

/* Runs until SHUTDOWN, SIGINT or SIGTERM, or service_stop. Returns 0. */
int service_run(struct service *s);
void service_stop(struct service *s);

/* Why the loop stopped. MSG_SHUTDOWN means "stop and remove your shared state" (the
 * supervisor's stop); a signal means "exit, and leave shared state for a successor to adopt"
 * (the supervisor's restart; kill -9 leaves it too). */
enum service_stop_reason { SERVICE_RUNNING = 0, SERVICE_STOP_SHUTDOWN = 1, SERVICE_STOP_SIGNAL = 2 };
enum service_stop_reason service_stop_reason(const struct service *s);

/* Polls the sockets once without blocking and handles what is waiting: a long computation
 * calls this between steps so the service keeps answering. Returns 1 if a stop was asked. */
int service_poll_once(struct service *s, int timeout_ms);

/* Publishes MSG_HEARTBEAT (and the stats with it) if one is due, and nothing else: no socket
 * is read, no request handled. For long work that cannot serve requests (a forward step, a
 * wait on another service), so that the supervisor keeps hearing the service. Safe on NULL. */
void service_beat(struct service *s);

/* Has a stop been asked for: SIGINT or SIGTERM received (taken as service_poll_once takes it:
 * the loop then stops, for a signal's reason), or a stop already recorded? Reads no socket. For
 * long waits on another service that only beat (service_beat), so that they give up at once
 * when the service is told to stop. False on NULL. */
bool service_stop_requested(struct service *s);

/* Live tuning (common/tunable.h): parameters the loop serves through MSG_CONFIG_GET and
 * MSG_CONFIG_SET. service_create registers log-level (every service's, tunable); a service adds
 * its own after service_create, before service_run. Each returns 0 or a negative errno (logged). */
int service_add_tunable(struct service *s, const struct tunable *t);
int service_add_fixed(struct service *s, const char *name, enum tunable_type type, const char *value,
		      const char *help);
struct tunables *service_tunables(struct service *s);

int service_reply(struct service *s, const struct bus_peer *peer, const struct msg *m);
int service_reply_error(struct service *s, const struct bus_peer *peer, uint64_t corr, int code, const char *text);
int service_publish(struct service *s, const struct msg *m);

void *service_zmq_context(struct service *s);
const char *service_name(const struct service *s);
const char *service_run_dir(const struct service *s);
uint64_t service_epoch(const struct service *s);
/* Milliseconds since the service started. */
uint64_t service_uptime_ms(const struct service *s);

/* Makes dir (and parents) with mode 0700, or checks an existing one: owned by us, a
 * directory, not readable by others (fixed to 0700 if looser). Returns 0 or -errno with a
 * logged reason. */
int run_dir_prepare(const char *dir);
/* The same for any directory of this user's files: what names it in the messages ("persist
 * directory"), elsewhere says how to pick another ("name another --persist-dir"). A mode made
 * 0700 is logged. */
int private_dir_prepare(const char *dir, const char *what, const char *elsewhere);

/* The default run directory for an instance: $PIPELINE_RUN_DIR if set, else
 * /tmp/llmp-<uid>/<instance>. */
int run_dir_default(const char *instance, char *buf, size_t len);

/* A file of the run directory holding the absolute path of a kv-store's spill file placed outside
 * it (--spill-file), one line: the kv-store writes it once the file is made and removes both at a
 * clean stop; the instance's cleanup (pipeline stop after a crash) removes the file it names, as it
 * removes <run-dir>/kv-spill.bin. */
#define KV_SPILL_RECORD "kv-spill.path"

#ifdef __cplusplus
}
#endif
#endif

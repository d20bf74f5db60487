/* bus.h - ZeroMQ sockets for the control plane, speaking protocol.h messages.
 *
 * Services bind a ROUTER at ipc://<run-dir>/<service>.ctl and a PUB at
 * ipc://<run-dir>/<service>.pub; clients connect a DEALER (struct rpc_client). Every socket
 * sets ZMQ_MAXMSGSIZE (PROTO_MAX_MSG_BYTES) and ZMQ_LINGER 0.
 *
 * A service's receive loop:
 *   struct bus_peer peer; struct msg req;
 *   rc = bus_recv_request(router, &peer, &req, err, sizeof(err));
 *   if (rc == -EBADMSG ...) bus_reply_error(router, &peer, corr, -rc, err);   // keep serving
 *   ... bus_reply(router, &peer, &reply); msg_free(&req);
 *
 * A client:
 *   struct rpc_client *c = rpc_client_create(ctx, run_dir, "kv-store", "gpu-runner");
 *   struct msg req, rep; msg_init(&req, MSG_KV_ALLOC, 0); req.kv_alloc.count = 2;
 *   rc = rpc_call(c, &req, &rep, 5000);    // 0, -ETIMEDOUT, -EREMOTEIO (rep holds MSG_ERROR), ...
 *   msg_free(&rep);
 */
#ifndef PIPELINE_BUS_H
#define PIPELINE_BUS_H
#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/protocol.h"
#ifdef __cplusplus
extern "C" {
#endif

#define BUS_IDENTITY_MAX 256

/* The routing identity a ROUTER saw on a request, needed to reply. */
struct bus_peer {
	uint8_t id[BUS_IDENTITY_MAX];
	size_t id_len;
};

/* Builds "ipc://<run_dir>/<service>.<suffix>" ("ctl" or "pub"). Returns 0 or -ENAMETOOLONG
 * (an ipc path must fit in 107 bytes). */
int bus_endpoint(const char *run_dir, const char *service, const char *suffix, char *buf, size_t len);

/* Connects to the unix socket at path and hangs up at once: true when a process listens there
 * (one with a full backlog too). pid (may be NULL) receives the listener's pid in our pid
 * namespace, 0 when unknown (not connected, or another namespace: the kernel says 0). */
bool bus_unix_listener(const char *path, int *pid);

/* Binds a ROUTER or PUB socket. Returns the socket or NULL (errno set; message logged).
 * An ipc endpoint where a live process listens is refused with EADDRINUSE (ZeroMQ alone
 * would take the path over); a socket file left by a dead process is replaced. */
void *bus_bind_router(void *ctx, const char *endpoint);
void *bus_bind_pub(void *ctx, const char *endpoint);
/* Connects a SUB socket subscribed to everything. */
void *bus_connect_sub(void *ctx, const char *endpoint);

/* Receives one request on a ROUTER. Returns 0 with peer and req filled (msg_free req);
 * -EAGAIN when nothing is waiting (the socket is polled by the caller, recv is non-blocking);
 * -EBADMSG/-ENOMSG/-EPROTONOSUPPORT with err set and peer filled when the bytes were not a
 * valid message (reply with bus_reply_error and keep serving); *corr_out (may be NULL)
 * receives the correlation id if one could be read, else 0. Frames other than
 * [identity][payload] are drained and reported as -EBADMSG. Any other -errno comes from the
 * socket (peer->id_len is 0 when not even the identity frame arrived). On every failure err
 * says what happened and req holds nothing to free. */
int bus_recv_request(void *router, struct bus_peer *peer, struct msg *req, uint64_t *corr_out, char *err,
		     size_t errlen);

/* Replies a ROUTER queues for one peer that has not taken them (a stream's tokens for a client that
 * does not read); one more is -EAGAIN. About 40 MB of token messages at most. A client that leaves
 * that many unread has its request cancelled by the runner, whose last reply then meets the same
 * full queue: such a client learns of the end only by its own timeout. */
#define BUS_ROUTER_HWM 262144

/* Sends m to peer through a ROUTER. Returns 0 or -errno (-EHOSTUNREACH: the peer is gone;
 * -EAGAIN: it has BUS_ROUTER_HWM replies it has not read). */
int bus_reply(void *router, const struct bus_peer *peer, const struct msg *m);
/* Sends MSG_ERROR{code, text} to peer. */
int bus_reply_error(void *router, const struct bus_peer *peer, uint64_t corr, int code, const char *text);

/* Publishes m on a PUB socket (never blocks; dropped if no subscriber keeps up). */
int bus_publish(void *pub, const struct msg *m);

/* Sends m on a DEALER/PUB-style socket with no routing frame. Returns 0 or -errno. */
int bus_send(void *sock, const struct msg *m, int flags);
/* Receives one message on a DEALER/SUB with no routing frame, waiting up to timeout_ms (-1:
 * forever). Returns 0, -ETIMEDOUT, -EBADMSG (err set), -EINTR. m is zeroed first, so
 * msg_free(m) is safe after any return. */
int bus_recv(void *sock, struct msg *m, int timeout_ms, char *err, size_t errlen);

/* ---- request/reply client over a DEALER ---- */

struct rpc_client;

/* Creates a client of service `service` in run_dir; `self` names the caller in HELLO and
 * logs. The socket connects lazily and reconnects on its own when the service restarts.
 * Returns NULL on failure (errno set). */
struct rpc_client *rpc_client_create(void *ctx, const char *run_dir, const char *service, const char *self);
void rpc_client_destroy(struct rpc_client **c);

/* Sends req (its corr is replaced by a fresh id) and waits up to timeout_ms for the reply
 * with that id, discarding stale replies. Returns 0 with reply filled (msg_free it);
 * -EREMOTEIO when the reply is MSG_ERROR (reply holds it: code and text); -ETIMEDOUT;
 * -EBADMSG when the reply could not be decoded; -errno from the socket. After any return
 * msg_free(reply) is safe (reply is zeroed first), as the example above does. */
int rpc_call(struct rpc_client *c, struct msg *req, struct msg *reply, int timeout_ms);

/* Sends req with a fresh id without waiting; returns the id through *corr. Then
 * rpc_wait(c, corr, ...) collects replies one by one (for streamed replies). */
int rpc_send(struct rpc_client *c, struct msg *req, uint64_t *corr);
int rpc_wait(struct rpc_client *c, uint64_t corr, struct msg *reply, int timeout_ms);

/* Closes and reopens the socket: replies still in flight to the old socket are lost. Used
 * after a timeout, when the service may have restarted. Returns 0 or -errno. */
int rpc_client_reset(struct rpc_client *c);

/* The session this client names in HELLO (0: none): random per process, so a service tells
 * a client reconnecting (same session: keep what it holds) from a new one (another session). */
void rpc_client_set_session(struct rpc_client *c, uint64_t session);
uint64_t rpc_client_session(const struct rpc_client *c);

/* HELLO round trip: fills *reply (msg_free it). Returns as rpc_call. */
int rpc_hello(struct rpc_client *c, struct msg *reply, int timeout_ms);

/* Retries HELLO until it succeeds or deadline_ms passes; resets the socket between tries.
 * Returns 0; -EREMOTEIO when the service answered HELLO with MSG_ERROR (another protocol
 * version, say: retrying cannot help; reply holds the error); or -ETIMEDOUT. */
int rpc_wait_ready(struct rpc_client *c, struct msg *reply, int deadline_ms);

/* The underlying DEALER (to poll it) and the service name. */
void *rpc_client_socket(struct rpc_client *c);
const char *rpc_client_service(const struct rpc_client *c);

#ifdef __cplusplus
}
#endif
#endif

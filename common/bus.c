#include "common/bus.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/util.h"

int bus_endpoint(const char *run_dir, const char *service, const char *suffix, char *buf, size_t len)
{
	int n = snprintf(buf, len, "ipc://%s/%s.%s", run_dir, service, suffix);
	if (n < 0 || (size_t)n >= len || n - 6 > 107)
		return -ENAMETOOLONG;
	return 0;
}

static int set_common(void *s)
{
	int64_t max = PROTO_MAX_MSG_BYTES;
	int linger = 0;
	if (zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &max, sizeof(max)) != 0 ||
	    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger)) != 0)
		return -1;
	return 0;
}

/* ZeroMQ unlinks whatever file sits at an ipc path before it binds, so a second process
 * binding the same endpoint would silently take it over from a live one (and remove it on
 * exit). A file left by a dead process refuses connections and may be replaced; a live
 * listener may not. */
static bool ipc_in_use(const char *endpoint)
{
	/* not ipc, or a path too long: zmq_bind reports it */
	return str_has_prefix(endpoint, "ipc://") && bus_unix_listener(endpoint + 6, NULL);
}

bool bus_unix_listener(const char *path, int *pid)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	if (pid)
		*pid = 0;
	if (str_copy(sa.sun_path, sizeof(sa.sun_path), path) != 0)
		return false;
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return false;
	/* non-blocking: a listener with a full backlog answers EAGAIN instead of making us wait */
	bool connected = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
	bool live = connected || errno == EAGAIN;
	struct ucred cr;
	socklen_t len = sizeof(cr);
	if (pid && connected && getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0 && len == sizeof(cr))
		*pid = cr.pid;
	close(fd);
	return live;
}

static void *bind_socket(void *ctx, int type, const char *endpoint)
{
	void *s = zmq_socket(ctx, type);
	if (!s)
		return NULL;
	if (set_common(s) != 0)
		goto out_close;
	if (type == ZMQ_ROUTER) {
		/* Replies to a vanished peer fail with EHOSTUNREACH instead of vanishing silently. */
		int one = 1;
		if (zmq_setsockopt(s, ZMQ_ROUTER_MANDATORY, &one, sizeof(one)) != 0)
			goto out_close;
		/* Replies queued for one peer before a send would block (EAGAIN): a stream's tokens for a
		 * client that reads slowly, or not for a while (ZeroMQ's default is 1000, which a
		 * generation passes in a second or two). */
		int hwm = BUS_ROUTER_HWM;
		if (zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm)) != 0)
			goto out_close;
	}
	if (type == ZMQ_PUB) {
		int hwm = 1000;
		zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof(hwm));
	}
	if (ipc_in_use(endpoint)) {
		log_error("cannot bind %s: a live process listens there (another instance of this service?)",
			  endpoint);
		errno = EADDRINUSE;
		goto out_close;
	}
	if (zmq_bind(s, endpoint) != 0) {
		log_error("cannot bind %s: %s", endpoint, zmq_strerror(errno));
		goto out_close;
	}
	return s;
out_close: {
	int e = errno;
	zmq_close(s);
	errno = e;
}
	return NULL;
}

void *bus_bind_router(void *ctx, const char *endpoint)
{
	return bind_socket(ctx, ZMQ_ROUTER, endpoint);
}

void *bus_bind_pub(void *ctx, const char *endpoint)
{
	return bind_socket(ctx, ZMQ_PUB, endpoint);
}

void *bus_connect_sub(void *ctx, const char *endpoint)
{
	void *s = zmq_socket(ctx, ZMQ_SUB);
	if (!s)
		return NULL;
	if (set_common(s) != 0 || zmq_setsockopt(s, ZMQ_SUBSCRIBE, "", 0) != 0 || zmq_connect(s, endpoint) != 0) {
		int e = errno;
		zmq_close(s);
		errno = e;
		return NULL;
	}
	return s;
}

/* Reads the correlation id from a message that may not decode: [v, type, corr, ...]. */
static uint64_t peek_corr(const uint8_t *p, size_t len)
{
	/* fixarray of 4, then up to two small uints, then the id as any msgpack uint. */
	size_t i = 0;
	if (len < 4 || p[i++] != 0x94)
		return 0;
	for (int field = 0; field < 2; field++) {
		if (i >= len)
			return 0;
		uint8_t b = p[i++];
		if (b <= 0x7f)
			continue;
		int n = b == 0xcc ? 1 : b == 0xcd ? 2 : b == 0xce ? 4 : b == 0xcf ? 8 : -1;
		if (n < 0 || i + (size_t)n > len)
			return 0;
		i += (size_t)n;
	}
	if (i >= len)
		return 0;
	uint8_t b = p[i++];
	if (b <= 0x7f)
		return b;
	int n = b == 0xcc ? 1 : b == 0xcd ? 2 : b == 0xce ? 4 : b == 0xcf ? 8 : -1;
	if (n < 0 || i + (size_t)n > len)
		return 0;
	uint64_t v = 0;
	for (int k = 0; k < n; k++)
		v = (v << 8) | p[i + (size_t)k];
	return v;
}

static void drain_more(void *sock)
{
	int more = 0;
	size_t sz = sizeof(more);
	while (zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &sz) == 0 && more) {
		zmq_msg_t part;
		zmq_msg_init(&part);
		zmq_msg_recv(&part, sock, 0);
		zmq_msg_close(&part);
	}
}

int bus_recv_request(void *router, struct bus_peer *peer, struct msg *req, uint64_t *corr_out, char *err,
		     size_t errlen)
{
	zmq_msg_t id, body;
	int rc;
	if (corr_out)
		*corr_out = 0;
	peer->id_len = 0;
	memset(req, 0, sizeof(*req));
	zmq_msg_init(&id);
	if (zmq_msg_recv(&id, router, ZMQ_DONTWAIT) < 0) {
		rc = -errno;
		zmq_msg_close(&id);
		snprintf(err, errlen, "receiving a request: %s", zmq_strerror(-rc));
		return rc;
	}
	size_t idn = zmq_msg_size(&id);
	if (idn > BUS_IDENTITY_MAX)
		idn = BUS_IDENTITY_MAX;
	memcpy(peer->id, zmq_msg_data(&id), idn);
	peer->id_len = idn;
	int more = zmq_msg_more(&id);
	zmq_msg_close(&id);
	if (!more) {
		snprintf(err, errlen, "a request without a body frame");
		return -EBADMSG;
	}
	zmq_msg_init(&body);
	if (zmq_msg_recv(&body, router, 0) < 0) {
		rc = -errno;
		zmq_msg_close(&body);
		snprintf(err, errlen, "receiving the body of a request: %s", zmq_strerror(-rc));
		return rc == -EAGAIN ? -EBADMSG : rc;
	}
	if (zmq_msg_more(&body)) {
		zmq_msg_close(&body);
		drain_more(router);
		snprintf(err, errlen, "a request must be one frame (a DEALER sends [payload])");
		return -EBADMSG;
	}
	if (corr_out)
		*corr_out = peek_corr(zmq_msg_data(&body), zmq_msg_size(&body));
	rc = msg_decode(zmq_msg_data(&body), zmq_msg_size(&body), req, err, errlen);
	zmq_msg_close(&body);
	return rc;
}

static int send_encoded(void *sock, const struct bus_peer *peer, const struct msg *m, int flags)
{
	void *buf;
	size_t len;
	int rc = msg_encode(m, &buf, &len);
	if (rc)
		return rc;
	if (peer && zmq_send(sock, peer->id, peer->id_len, ZMQ_SNDMORE | flags) < 0) {
		rc = -errno;
		goto out;
	}
	if (zmq_send(sock, buf, len, flags) < 0)
		rc = -errno;
out:
	free(buf);
	return rc;
}

int bus_reply(void *router, const struct bus_peer *peer, const struct msg *m)
{
	return send_encoded(router, peer, m, ZMQ_DONTWAIT);
}

int bus_reply_error(void *router, const struct bus_peer *peer, uint64_t corr, int code, const char *text)
{
	struct msg m;
	msg_make_error(&m, corr, code, text);
	return bus_reply(router, peer, &m);
}

int bus_publish(void *pub, const struct msg *m)
{
	int rc = send_encoded(pub, NULL, m, ZMQ_DONTWAIT);
	return rc == -EAGAIN ? 0 : rc;
}

int bus_send(void *sock, const struct msg *m, int flags)
{
	return send_encoded(sock, NULL, m, flags);
}

int bus_recv(void *sock, struct msg *m, int timeout_ms, char *err, size_t errlen)
{
	memset(m, 0, sizeof(*m)); /* whatever happens, msg_free(m) is safe */
	zmq_pollitem_t item = {.socket = sock, .events = ZMQ_POLLIN};
	int n = zmq_poll(&item, 1, timeout_ms);
	if (n < 0)
		return -errno;
	if (n == 0)
		return -ETIMEDOUT;
	zmq_msg_t body;
	zmq_msg_init(&body);
	if (zmq_msg_recv(&body, sock, ZMQ_DONTWAIT) < 0) {
		int rc = -errno;
		zmq_msg_close(&body);
		return rc == -EAGAIN ? -ETIMEDOUT : rc;
	}
	int rc;
	if (zmq_msg_more(&body)) {
		drain_more(sock);
		snprintf(err, errlen, "a reply must be one frame");
		rc = -EBADMSG;
	} else {
		rc = msg_decode(zmq_msg_data(&body), zmq_msg_size(&body), m, err, errlen);
	}
	zmq_msg_close(&body);
	return rc;
}

/* ---- client ---- */

struct rpc_client {
	void *ctx;
	void *sock;
	char endpoint[256];
	char service[64];
	char self[64];
	uint64_t next_corr;
	uint64_t session;
};

static int client_open(struct rpc_client *c)
{
	c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
	if (!c->sock)
		return -errno;
	int hwm = 10000;
	if (set_common(c->sock) != 0 || zmq_setsockopt(c->sock, ZMQ_SNDHWM, &hwm, sizeof(hwm)) != 0 ||
	    zmq_connect(c->sock, c->endpoint) != 0) {
		int rc = -errno;
		zmq_close(c->sock);
		c->sock = NULL;
		return rc;
	}
	return 0;
}

struct rpc_client *rpc_client_create(void *ctx, const char *run_dir, const char *service, const char *self)
{
	struct rpc_client *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->ctx = ctx;
	/* Start ids at a random point so replies meant for an earlier incarnation never match. */
	c->next_corr = (random_u64() >> 16) | 1;
	if (bus_endpoint(run_dir, service, "ctl", c->endpoint, sizeof(c->endpoint)) != 0 ||
	    str_copy(c->service, sizeof(c->service), service) != 0 ||
	    str_copy(c->self, sizeof(c->self), self) != 0) {
		free(c);
		errno = ENAMETOOLONG;
		return NULL;
	}
	int rc = client_open(c);
	if (rc) {
		free(c);
		errno = -rc;
		return NULL;
	}
	return c;
}

void rpc_client_destroy(struct rpc_client **cp)
{
	if (!cp || !*cp)
		return;
	if ((*cp)->sock)
		zmq_close((*cp)->sock);
	free(*cp);
	*cp = NULL;
}

int rpc_client_reset(struct rpc_client *c)
{
	if (c->sock)
		zmq_close(c->sock);
	c->sock = NULL;
	return client_open(c);
}

void *rpc_client_socket(struct rpc_client *c)
{
	return c->sock;
}

const char *rpc_client_service(const struct rpc_client *c)
{
	return c->service;
}

int rpc_send(struct rpc_client *c, struct msg *req, uint64_t *corr)
{
	if (!c->sock) {
		int rc = client_open(c);
		if (rc)
			return rc;
	}
	req->corr = c->next_corr++;
	if (corr)
		*corr = req->corr;
	/* Never block on a send: a service that is down makes the queue fill, not the caller hang. */
	int rc = bus_send(c->sock, req, ZMQ_DONTWAIT);
	return rc == -EAGAIN ? -ETIMEDOUT : rc;
}

int rpc_wait(struct rpc_client *c, uint64_t corr, struct msg *reply, int timeout_ms)
{
	uint64_t deadline = now_ns() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms) * 1000000ull;
	memset(reply, 0, sizeof(*reply)); /* msg_free(reply) is safe after any return */
	for (;;) {
		int left = -1;
		if (timeout_ms >= 0) {
			uint64_t now = now_ns();
			left = now >= deadline ? 0 : (int)((deadline - now) / 1000000ull);
		}
		char err[256];
		int rc = bus_recv(c->sock, reply, left, err, sizeof(err));
		if (rc == -EBADMSG || rc == -ENOMSG || rc == -EPROTONOSUPPORT) {
			log_warn("bad reply from %s: %s", c->service, err);
			return -EBADMSG;
		}
		if (rc == -EINTR)
			continue;
		if (rc)
			return rc;
		if (reply->corr != corr) {
			log_debug("dropping a stale reply %s (id %llu) from %s", msg_type_name(reply->type),
				  (unsigned long long)reply->corr, c->service);
			msg_free(reply);
			if (timeout_ms >= 0 && now_ns() >= deadline)
				return -ETIMEDOUT;
			continue;
		}
		return reply->type == MSG_ERROR ? -EREMOTEIO : 0;
	}
}

int rpc_call(struct rpc_client *c, struct msg *req, struct msg *reply, int timeout_ms)
{
	uint64_t corr;
	memset(reply, 0, sizeof(*reply)); /* msg_free(reply) is safe after any return */
	int rc = rpc_send(c, req, &corr);
	if (rc)
		return rc;
	return rpc_wait(c, corr, reply, timeout_ms);
}

void rpc_client_set_session(struct rpc_client *c, uint64_t session)
{
	c->session = session;
}

uint64_t rpc_client_session(const struct rpc_client *c)
{
	return c->session;
}

int rpc_hello(struct rpc_client *c, struct msg *reply, int timeout_ms)
{
	struct msg req;
	msg_init(&req, MSG_HELLO, 0);
	req.hello.client.p = c->self;
	req.hello.client.len = (uint32_t)strlen(c->self);
	req.hello.proto = PROTO_VERSION;
	req.hello.session = c->session;
	int rc = rpc_call(c, &req, reply, timeout_ms);
	if (rc == 0 && reply->type != MSG_HELLO_REPLY) {
		msg_free(reply);
		return -EBADMSG;
	}
	return rc;
}

int rpc_wait_ready(struct rpc_client *c, struct msg *reply, int deadline_ms)
{
	uint64_t deadline = now_ns() + (uint64_t)deadline_ms * 1000000ull;
	int wait = 100;
	for (;;) {
		/* No try waits past the deadline. */
		uint64_t now = now_ns();
		int left = now >= deadline ? 0 : (int)((deadline - now) / 1000000ull);
		int rc = rpc_hello(c, reply, wait < left ? wait : left);
		if (rc == 0 || rc == -EREMOTEIO)
			return rc;
		if (now_ns() >= deadline)
			return -ETIMEDOUT;
		rpc_client_reset(c);
		if (wait < 1000)
			wait *= 2;
	}
}

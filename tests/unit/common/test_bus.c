/* test_bus.c - common/bus.c: ROUTER/DEALER requests and replies over ipc in a temporary run
 * directory, with a scripted server thread; malformed frames; PUB/SUB; endpoint limits. */
#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/util.h"
#include "tests/unit/common/test_helpers.h"

#define SVC "test-svc"

static char *base_dir; /* made and removed by the runner process, so a failed test leaves nothing */
static char *run_dir;  /* a fresh one per test, under base_dir */
static void *ctx;

static void setup_base(void)
{
	base_dir = th_tmpdir("/tmp");
}

static void teardown_base(void)
{
	th_rmtree(base_dir);
	free(base_dir);
	base_dir = NULL;
}

static void setup(void)
{
	run_dir = th_tmpdir(base_dir);
	ctx = zmq_ctx_new();
	ck_assert_ptr_nonnull(ctx);
}

static void teardown(void)
{
	if (ctx)
		zmq_ctx_term(ctx);
	ctx = NULL;
	th_rmtree(run_dir);
	free(run_dir);
	run_dir = NULL;
}

static void endpoint(const char *service, const char *suffix, char *buf, size_t len)
{
	ck_assert_int_eq(bus_endpoint(run_dir, service, suffix, buf, len), 0);
}

/* ---- a scripted server: what it answers depends on the request type ---- */

struct server {
	void *router;
	pthread_t thread;
	atomic_int stop;
	atomic_int requests; /* requests received, malformed ones included */
};

static void reply(struct server *s, const struct bus_peer *peer, struct msg *m)
{
	int rc = bus_reply(s->router, peer, m);
	/* A client that gave up and reset its socket (rpc_wait_ready retrying) is gone: that is
	 * the service's normal lot, not a failure. */
	ck_assert_msg(rc == 0 || rc == -EHOSTUNREACH, "server reply %s: %d", msg_type_name(m->type), rc);
}

static void serve_one(struct server *s, const struct bus_peer *peer, const struct msg *req)
{
	struct msg rep;
	uint64_t v[8];
	switch (req->type) {
	case MSG_PING:
		msg_init(&rep, MSG_OK, req->corr);
		reply(s, peer, &rep);
		break;
	case MSG_HELLO:
		msg_init(&rep, MSG_HELLO_REPLY, req->corr);
		rep.hello_reply.service.p = SVC;
		rep.hello_reply.service.len = (uint32_t)strlen(SVC);
		rep.hello_reply.pid = (uint64_t)getpid();
		rep.hello_reply.epoch = 42;
		rep.hello_reply.shm_name.p = "";
		reply(s, peer, &rep);
		break;
	case MSG_KV_ALLOC: /* count handles 0.., offsets 4096 * i */
		msg_init(&rep, MSG_KV_BLOCKS, req->corr);
		for (uint64_t i = 0; i < req->kv_alloc.count && i < 8; i++)
			v[i] = i;
		rep.kv_blocks.handles.v = v;
		rep.kv_blocks.handles.n = (uint32_t)(req->kv_alloc.count < 8 ? req->kv_alloc.count : 8);
		rep.kv_blocks.offsets = rep.kv_blocks.handles;
		reply(s, peer, &rep);
		break;
	case MSG_KV_FREE:
		bus_reply_error(s->router, peer, req->corr, ENOENT, "no such block 7");
		break;
	case MSG_KV_UNPIN: /* never answered */
		break;
	case MSG_KV_FETCH: /* two replies to other requests first */
		msg_init(&rep, MSG_OK, req->corr + 1);
		reply(s, peer, &rep);
		msg_make_error(&rep, req->corr - 1, EIO, "stale error");
		reply(s, peer, &rep);
		msg_init(&rep, MSG_KV_BLOCKS, req->corr);
		reply(s, peer, &rep);
		break;
	case MSG_W_RELEASE: /* answered late: well past its caller's 50 ms, even on a loaded machine */
		usleep(1500 * 1000);
		msg_init(&rep, MSG_TOKEN, req->corr);
		reply(s, peer, &rep);
		break;
	case MSG_GENERATE: /* a stream */
		for (uint64_t i = 0; i < 3; i++) {
			msg_init(&rep, MSG_TOKEN, req->corr);
			rep.token.index = i;
			rep.token.token = 100 + i;
			reply(s, peer, &rep);
		}
		msg_init(&rep, MSG_GEN_DONE, req->corr);
		rep.gen_done.n_generated = 3;
		rep.gen_done.reason.p = "length";
		rep.gen_done.reason.len = 6;
		reply(s, peer, &rep);
		break;
	case MSG_STATS_GET: /* bytes that are no message */
		ck_assert_int_ge(zmq_send(s->router, peer->id, peer->id_len, ZMQ_SNDMORE), 0);
		ck_assert_int_ge(zmq_send(s->router, "\xc1garbage", 8, 0), 0);
		break;
	case MSG_HEARTBEAT: { /* a valid reply, but in two frames */
		void *buf;
		size_t len;
		msg_init(&rep, MSG_OK, req->corr);
		ck_assert_int_eq(msg_encode(&rep, &buf, &len), 0);
		ck_assert_int_ge(zmq_send(s->router, peer->id, peer->id_len, ZMQ_SNDMORE), 0);
		ck_assert_int_ge(zmq_send(s->router, buf, len, ZMQ_SNDMORE), 0);
		ck_assert_int_ge(zmq_send(s->router, buf, len, 0), 0);
		free(buf);
		break;
	}
	default:
		bus_reply_error(s->router, peer, req->corr, ENOTSUP, "not scripted");
		break;
	}
}

static void *server_main(void *arg)
{
	struct server *s = arg;
	while (!atomic_load(&s->stop)) {
		zmq_pollitem_t it = {.socket = s->router, .events = ZMQ_POLLIN};
		if (zmq_poll(&it, 1, 20) <= 0)
			continue;
		for (;;) {
			struct bus_peer peer;
			struct msg req;
			uint64_t corr;
			char err[256];
			int rc = bus_recv_request(s->router, &peer, &req, &corr, err, sizeof(err));
			if (rc == -EAGAIN)
				break;
			atomic_fetch_add(&s->requests, 1);
			if (rc) {
				if (peer.id_len)
					bus_reply_error(s->router, &peer, corr, -rc, err);
				continue;
			}
			serve_one(s, &peer, &req);
			msg_free(&req);
		}
	}
	return NULL;
}

static void server_start(struct server *s)
{
	char ep[256];
	endpoint(SVC, "ctl", ep, sizeof(ep));
	memset(s, 0, sizeof(*s));
	s->router = bus_bind_router(ctx, ep);
	ck_assert_ptr_nonnull(s->router);
	ck_assert_int_eq(pthread_create(&s->thread, NULL, server_main, s), 0);
}

static void server_stop(struct server *s)
{
	atomic_store(&s->stop, 1);
	pthread_join(s->thread, NULL);
	zmq_close(s->router);
}

static struct rpc_client *client(void)
{
	struct rpc_client *c = rpc_client_create(ctx, run_dir, SVC, "tester");
	ck_assert_ptr_nonnull(c);
	ck_assert_str_eq(rpc_client_service(c), SVC);
	ck_assert_ptr_nonnull(rpc_client_socket(c));
	return c;
}

/* ---- endpoints ---- */

START_TEST(test_endpoint)
{
	char buf[256];
	ck_assert_int_eq(bus_endpoint("/run/x", "kv-store", "ctl", buf, sizeof(buf)), 0);
	ck_assert_str_eq(buf, "ipc:///run/x/kv-store.ctl");
	ck_assert_int_eq(bus_endpoint("/run/x", "kv-store", "pub", buf, sizeof(buf)), 0);
	ck_assert_str_eq(buf, "ipc:///run/x/kv-store.pub");
	/* The socket path ("/tmp/x/" + name + ".ctl") may hold 107 bytes, not 108. */
	char name[128];
	memset(name, 'a', sizeof(name));
	name[96] = 0; /* 7 + 96 + 4 = 107 */
	ck_assert_int_eq(bus_endpoint("/tmp/x", name, "ctl", buf, sizeof(buf)), 0);
	ck_assert_uint_eq(strlen(buf) - strlen("ipc://"), 107);
	name[96] = 'a';
	name[97] = 0;
	ck_assert_int_eq(bus_endpoint("/tmp/x", name, "ctl", buf, sizeof(buf)), -ENAMETOOLONG);
	/* a buffer too small */
	char small[16];
	ck_assert_int_eq(bus_endpoint("/run/x", "kv-store", "ctl", small, sizeof(small)), -ENAMETOOLONG);
	/* and a client for a too-long path is refused */
	errno = 0;
	struct rpc_client *c = rpc_client_create(ctx, "/tmp/x", name, "tester");
	ck_assert_ptr_null(c);
	ck_assert_int_eq(errno, ENAMETOOLONG);
}
END_TEST

START_TEST(test_endpoint_longest_binds)
{
	/* The longest path bus_endpoint accepts is one ZeroMQ can bind. */
	char name[128];
	size_t n = 107 - strlen(run_dir) - 1 - strlen(".ctl");
	memset(name, 's', n);
	name[n] = 0;
	char ep[256];
	endpoint(name, "ctl", ep, sizeof(ep));
	void *r = bus_bind_router(ctx, ep);
	ck_assert_msg(r != NULL, "bind %s: %s", ep, zmq_strerror(errno));
	zmq_close(r);
}
END_TEST

START_TEST(test_bind_twice)
{
	char ep[256];
	endpoint(SVC, "ctl", ep, sizeof(ep));
	void *r = bus_bind_router(ctx, ep);
	ck_assert_ptr_nonnull(r);
	struct th_capture cap;
	th_capture_begin(&cap, STDERR_FILENO);
	errno = 0;
	void *r2 = bus_bind_router(ctx, ep);
	int e = errno;
	char *err = th_capture_end(&cap);
	ck_assert_ptr_null(r2);
	ck_assert_int_eq(e, EADDRINUSE);
	ck_assert_ptr_nonnull(strstr(err, ep)); /* the message names the endpoint */
	free(err);
	/* The first socket still owns the path: a client reaches it. */
	struct rpc_client *c = client();
	struct msg req, rep;
	msg_init(&req, MSG_PING, 0);
	ck_assert_int_eq(rpc_send(c, &req, NULL), 0);
	zmq_pollitem_t it = {.socket = r, .events = ZMQ_POLLIN};
	ck_assert_int_eq(zmq_poll(&it, 1, 5000), 1);
	struct bus_peer peer;
	char text[256];
	ck_assert_int_eq(bus_recv_request(r, &peer, &rep, NULL, text, sizeof(text)), 0);
	ck_assert_uint_eq(rep.type, MSG_PING);
	msg_free(&rep);
	rpc_client_destroy(&c);
	zmq_close(r);
}
END_TEST

START_TEST(test_bind_over_stale_file)
{
	/* A socket file whose process is gone (bound, then closed without unlink) is replaced. */
	char ep[256];
	endpoint(SVC, "ctl", ep, sizeof(ep));
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	ck_assert_int_eq(str_copy(sa.sun_path, sizeof(sa.sun_path), ep + strlen("ipc://")), 0);
	int fd = socket(AF_UNIX, SOCK_STREAM, 0);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	close(fd);
	ck_assert_int_eq(access(sa.sun_path, F_OK), 0);
	void *r = bus_bind_router(ctx, ep);
	ck_assert_msg(r != NULL, "bind over a stale file: %s", zmq_strerror(errno));
	zmq_close(r);
}
END_TEST

/* ---- rpc ---- */

START_TEST(test_call_reply)
{
	struct server s;
	server_start(&s);
	struct rpc_client *c = client();
	struct msg req, rep;
	msg_init(&req, MSG_KV_ALLOC, 0);
	req.kv_alloc.count = 3;
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_KV_BLOCKS);
	ck_assert_uint_eq(rep.corr, req.corr); /* rpc_call gave the request a fresh id */
	ck_assert_uint_eq(rep.kv_blocks.handles.n, 3);
	ck_assert_uint_eq(rep.kv_blocks.handles.v[2], 2);
	msg_free(&rep);
	/* Ids are fresh on every call. */
	uint64_t first = req.corr;
	msg_init(&req, MSG_PING, first);
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_OK);
	ck_assert_uint_ne(req.corr, first);
	msg_free(&rep);
	ck_assert_int_eq(rpc_hello(c, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_HELLO_REPLY);
	ck_assert_str_eq(rep.hello_reply.service.p, SVC);
	ck_assert_uint_eq(rep.hello_reply.epoch, 42);
	msg_free(&rep);
	rpc_client_destroy(&c);
	ck_assert_ptr_null(c);
	rpc_client_destroy(&c);
	server_stop(&s);
}
END_TEST

START_TEST(test_call_error)
{
	struct server s;
	server_start(&s);
	struct rpc_client *c = client();
	struct msg req, rep;
	msg_init(&req, MSG_KV_FREE, 0);
	uint64_t h = 7;
	req.kv_handles.handles.v = &h;
	req.kv_handles.handles.n = 1;
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), -EREMOTEIO);
	ck_assert_uint_eq(rep.type, MSG_ERROR);
	ck_assert_uint_eq(rep.corr, req.corr);
	ck_assert_int_eq(rep.error.code, ENOENT);
	ck_assert_str_eq(rep.error.text.p, "no such block 7");
	msg_free(&rep);
	/* A request the server does not decode: the error names the problem. */
	msg_init(&req, 9999, 0);
	uint64_t corr;
	ck_assert_int_eq(rpc_send(c, &req, &corr), -EINVAL); /* cannot even be encoded */
	rpc_client_destroy(&c);
	server_stop(&s);
}
END_TEST

START_TEST(test_call_timeout)
{
	struct server s;
	server_start(&s);
	struct rpc_client *c = client();
	struct msg req, rep;
	msg_init(&req, MSG_KV_UNPIN, 0);
	req.kv_handles.handles.n = 0;
	/* A reply left in a bad state would make this msg_free crash. */
	msg_init(&rep, MSG_ERROR, 0);
	rep.error.text.p = (char *)0x5a5a5a5a5a5a;
	rep.error.text.len = 3;
	ck_assert_int_eq(rpc_call(c, &req, &rep, 150), -ETIMEDOUT);
	msg_free(&rep);
	/* The client still works afterwards. */
	msg_init(&req, MSG_PING, 0);
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_OK);
	msg_free(&rep);
	rpc_client_destroy(&c);
	server_stop(&s);
}
END_TEST

START_TEST(test_call_no_service)
{
	/* Nobody bound: the call times out (connects are lazy), it does not hang or fail early. */
	struct rpc_client *c = client();
	struct msg req, rep;
	msg_init(&req, MSG_PING, 0);
	ck_assert_int_eq(rpc_call(c, &req, &rep, 100), -ETIMEDOUT);
	msg_free(&rep);
	ck_assert_int_eq(rpc_wait_ready(c, &rep, 300), -ETIMEDOUT);
	msg_free(&rep);
	/* A service that comes up later is found by rpc_wait_ready. */
	struct server s;
	server_start(&s);
	ck_assert_int_eq(rpc_wait_ready(c, &rep, 10000), 0);
	ck_assert_uint_eq(rep.type, MSG_HELLO_REPLY);
	msg_free(&rep);
	rpc_client_destroy(&c);
	server_stop(&s);
}
END_TEST

START_TEST(test_stale_replies)
{
	struct server s;
	server_start(&s);
	struct rpc_client *c = client();
	struct msg req, rep;
	/* Replies with other ids arrive first; the one with ours is returned. */
	msg_init(&req, MSG_KV_FETCH, 0);
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_KV_BLOCKS);
	ck_assert_uint_eq(rep.corr, req.corr);
	msg_free(&rep);
	/* A reply that comes after its caller gave up is dropped by the next call. */
	msg_init(&req, MSG_W_RELEASE, 0);
	ck_assert_int_eq(rpc_call(c, &req, &rep, 50), -ETIMEDOUT);
	msg_free(&rep);
	/* No wait: the server answers one request at a time, so the late MSG_TOKEN leaves it
	 * before the reply to this PING, and the pipe between them keeps that order. */
	msg_init(&req, MSG_PING, 0);
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_OK);
	ck_assert_uint_eq(rep.corr, req.corr);
	msg_free(&rep);
	rpc_client_destroy(&c);
	server_stop(&s);
}
END_TEST

START_TEST(test_stream)
{
	struct server s;
	server_start(&s);
	struct rpc_client *c = client();
	struct msg req, rep;
	msg_init(&req, MSG_GENERATE, 0);
	uint64_t tokens[2] = {1, 2};
	req.generate.tokens.v = tokens;
	req.generate.tokens.n = 2;
	uint64_t corr = 0;
	ck_assert_int_eq(rpc_send(c, &req, &corr), 0);
	ck_assert_uint_eq(corr, req.corr);
	for (uint64_t i = 0; i < 3; i++) {
		ck_assert_int_eq(rpc_wait(c, corr, &rep, 5000), 0);
		ck_assert_uint_eq(rep.type, MSG_TOKEN);
		ck_assert_uint_eq(rep.token.index, i);
		ck_assert_uint_eq(rep.token.token, 100 + i);
		msg_free(&rep);
	}
	ck_assert_int_eq(rpc_wait(c, corr, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_GEN_DONE);
	ck_assert_str_eq(rep.gen_done.reason.p, "length");
	msg_free(&rep);
	ck_assert_int_eq(rpc_wait(c, corr, &rep, 50), -ETIMEDOUT); /* the stream ended */
	msg_free(&rep);
	rpc_client_destroy(&c);
	server_stop(&s);
}
END_TEST

START_TEST(test_bad_replies)
{
	struct server s;
	server_start(&s);
	struct rpc_client *c = client();
	struct msg req, rep;
	msg_init(&req, MSG_STATS_GET, 0);
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), -EBADMSG);
	msg_free(&rep);
	msg_init(&req, MSG_HEARTBEAT, 0);
	req.heartbeat.service.p = "x";
	req.heartbeat.service.len = 1;
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), -EBADMSG);
	msg_free(&rep);
	/* After a reset (what a caller does when the service may have restarted) calls work. */
	ck_assert_int_eq(rpc_client_reset(c), 0);
	msg_init(&req, MSG_PING, 0);
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_OK);
	msg_free(&rep);
	rpc_client_destroy(&c);
	server_stop(&s);
}
END_TEST

/* ---- the ROUTER side with a raw DEALER ---- */

static void *raw_dealer(const char *identity)
{
	char ep[256];
	endpoint(SVC, "ctl", ep, sizeof(ep));
	void *d = zmq_socket(ctx, ZMQ_DEALER);
	ck_assert_ptr_nonnull(d);
	int linger = 0;
	zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof(linger));
	ck_assert_int_eq(zmq_setsockopt(d, ZMQ_ROUTING_ID, identity, strlen(identity)), 0);
	ck_assert_int_eq(zmq_connect(d, ep), 0);
	return d;
}

/* Waits for the next request on router; returns bus_recv_request's code. */
static int next_request(void *router, struct bus_peer *peer, struct msg *req, uint64_t *corr, char *err, size_t len)
{
	zmq_pollitem_t it = {.socket = router, .events = ZMQ_POLLIN};
	ck_assert_int_eq(zmq_poll(&it, 1, 5000), 1);
	return bus_recv_request(router, peer, req, corr, err, len);
}

START_TEST(test_recv_request_bad_frames)
{
	char ep[256];
	endpoint(SVC, "ctl", ep, sizeof(ep));
	void *router = bus_bind_router(ctx, ep);
	ck_assert_ptr_nonnull(router);
	struct bus_peer peer;
	struct msg req;
	uint64_t corr = 99;
	char err[256];
	ck_assert_int_eq(bus_recv_request(router, &peer, &req, &corr, err, sizeof(err)), -EAGAIN);
	ck_assert_uint_eq(corr, 0);
	void *d = raw_dealer("client-1");

	/* two frames */
	ck_assert_int_ge(zmq_send(d, "a", 1, ZMQ_SNDMORE), 0);
	ck_assert_int_ge(zmq_send(d, "b", 1, ZMQ_SNDMORE), 0);
	ck_assert_int_ge(zmq_send(d, "c", 1, 0), 0);
	err[0] = 0;
	ck_assert_int_eq(next_request(router, &peer, &req, &corr, err, sizeof(err)), -EBADMSG);
	ck_assert_uint_eq(peer.id_len, 8);
	ck_assert_mem_eq(peer.id, "client-1", 8);
	ck_assert_ptr_nonnull(strstr(err, "one frame"));
	msg_free(&req);
	/* the extra frames were drained: the next request is read whole */
	struct msg m;
	void *buf;
	size_t len;
	msg_init(&m, MSG_PING, 1234);
	ck_assert_int_eq(msg_encode(&m, &buf, &len), 0);
	ck_assert_int_ge(zmq_send(d, buf, len, 0), 0);
	free(buf);
	ck_assert_int_eq(next_request(router, &peer, &req, &corr, err, sizeof(err)), 0);
	ck_assert_uint_eq(req.type, MSG_PING);
	ck_assert_uint_eq(req.corr, 1234);
	ck_assert_uint_eq(corr, 1234);
	msg_free(&req);

	/* garbage */
	ck_assert_int_ge(zmq_send(d, "\xc1\x00\xff garbage", 11, 0), 0);
	err[0] = 0;
	ck_assert_int_eq(next_request(router, &peer, &req, &corr, err, sizeof(err)), -EBADMSG);
	ck_assert_uint_eq(peer.id_len, 8);
	ck_assert_uint_eq(corr, 0);
	ck_assert(err[0]);
	/* an empty frame */
	ck_assert_int_ge(zmq_send(d, "", 0, 0), 0);
	ck_assert_int_eq(next_request(router, &peer, &req, &corr, err, sizeof(err)), -EBADMSG);

	/* unknown type and wrong version: the id is still read, so the error reply can carry it */
	static const uint8_t unknown[] = {0x94, 0x01, 0xcd, 0x03, 0xe7, 0xcd, 0x12, 0x34, 0x80};
	static const uint8_t version[] = {0x94, 0x07, 0x05, 0xcf, 0, 0, 0, 1, 0, 0, 0, 2, 0x80};
	ck_assert_int_ge(zmq_send(d, unknown, sizeof(unknown), 0), 0);
	ck_assert_int_eq(next_request(router, &peer, &req, &corr, err, sizeof(err)), -ENOMSG);
	ck_assert_uint_eq(corr, 0x1234);
	ck_assert_ptr_nonnull(strstr(err, "999"));
	ck_assert_int_eq(bus_reply_error(router, &peer, corr, ENOMSG, err), 0);
	zmq_pollitem_t it = {.socket = d, .events = ZMQ_POLLIN};
	ck_assert_int_eq(zmq_poll(&it, 1, 5000), 1);
	char errtext[256];
	ck_assert_int_eq(bus_recv(d, &m, 5000, errtext, sizeof(errtext)), 0);
	ck_assert_uint_eq(m.type, MSG_ERROR);
	ck_assert_uint_eq(m.corr, 0x1234);
	ck_assert_int_eq(m.error.code, ENOMSG);
	ck_assert_str_eq(m.error.text.p, err);
	msg_free(&m);
	ck_assert_int_ge(zmq_send(d, version, sizeof(version), 0), 0);
	ck_assert_int_eq(next_request(router, &peer, &req, &corr, err, sizeof(err)), -EPROTONOSUPPORT);
	ck_assert_uint_eq(corr, (1ull << 32) + 2);

	/* nothing more waiting */
	ck_assert_int_eq(bus_recv_request(router, &peer, &req, &corr, err, sizeof(err)), -EAGAIN);
	zmq_close(d);
	zmq_close(router);
}
END_TEST

START_TEST(test_reply_unreachable)
{
	char ep[256];
	endpoint(SVC, "ctl", ep, sizeof(ep));
	void *router = bus_bind_router(ctx, ep);
	ck_assert_ptr_nonnull(router);
	struct bus_peer nobody = {.id = "nobody", .id_len = 6};
	struct msg m;
	msg_init(&m, MSG_OK, 1);
	ck_assert_int_eq(bus_reply(router, &nobody, &m), -EHOSTUNREACH);
	ck_assert_int_eq(bus_reply_error(router, &nobody, 1, EIO, "x"), -EHOSTUNREACH);
	/* an unencodable reply is refused before anything is sent */
	msg_init(&m, 4242, 1);
	ck_assert_int_eq(bus_reply(router, &nobody, &m), -EINVAL);
	zmq_close(router);
}
END_TEST

START_TEST(test_recv_timeout_and_frames)
{
	/* bus_recv on a DEALER: timeout, then a multi-frame message, then a good one. */
	char ep[256];
	endpoint(SVC, "ctl", ep, sizeof(ep));
	void *router = bus_bind_router(ctx, ep);
	ck_assert_ptr_nonnull(router);
	void *d = raw_dealer("c2");
	struct msg m;
	char err[256];
	ck_assert_int_eq(bus_recv(d, &m, 0, err, sizeof(err)), -ETIMEDOUT);
	ck_assert_int_eq(bus_recv(d, &m, 30, err, sizeof(err)), -ETIMEDOUT);
	ck_assert_int_ge(zmq_send(d, "hi", 2, 0), 0); /* so the router learns the peer */
	struct bus_peer peer;
	struct msg req;
	uint64_t corr;
	ck_assert_int_eq(next_request(router, &peer, &req, &corr, err, sizeof(err)), -EBADMSG);
	ck_assert_int_ge(zmq_send(router, peer.id, peer.id_len, ZMQ_SNDMORE), 0);
	ck_assert_int_ge(zmq_send(router, "x", 1, ZMQ_SNDMORE), 0);
	ck_assert_int_ge(zmq_send(router, "y", 1, 0), 0);
	msg_init(&m, MSG_OK, 5);
	ck_assert_int_eq(bus_reply(router, &peer, &m), 0);
	err[0] = 0;
	ck_assert_int_eq(bus_recv(d, &m, 5000, err, sizeof(err)), -EBADMSG);
	ck_assert_ptr_nonnull(strstr(err, "one frame"));
	msg_free(&m);
	ck_assert_int_eq(bus_recv(d, &m, 5000, err, sizeof(err)), 0);
	ck_assert_uint_eq(m.type, MSG_OK);
	ck_assert_uint_eq(m.corr, 5);
	msg_free(&m);
	zmq_close(d);
	zmq_close(router);
}
END_TEST

/* ---- PUB/SUB ---- */

START_TEST(test_pub_sub)
{
	char ep[256];
	endpoint(SVC, "pub", ep, sizeof(ep));
	void *pub = bus_bind_pub(ctx, ep);
	ck_assert_ptr_nonnull(pub);
	struct msg m;
	msg_init(&m, MSG_HEARTBEAT, 0);
	m.heartbeat.service.p = SVC;
	m.heartbeat.service.len = (uint32_t)strlen(SVC);
	ck_assert_int_eq(bus_publish(pub, &m), 0); /* nobody listening: dropped, not an error */
	void *sub = bus_connect_sub(ctx, ep);
	ck_assert_ptr_nonnull(sub);
	/* A subscription takes a moment to reach the publisher: publish until one arrives. */
	struct msg got;
	int rc = -ETIMEDOUT;
	for (uint64_t seq = 1; seq <= 100 && rc == -ETIMEDOUT; seq++) {
		m.heartbeat.seq = seq;
		ck_assert_int_eq(bus_publish(pub, &m), 0);
		char err[256];
		rc = bus_recv(sub, &got, 100, err, sizeof(err));
	}
	ck_assert_int_eq(rc, 0);
	ck_assert_uint_eq(got.type, MSG_HEARTBEAT);
	ck_assert_str_eq(got.heartbeat.service.p, SVC);
	ck_assert_uint_ge(got.heartbeat.seq, 1);
	msg_free(&got);
	zmq_close(sub);
	zmq_close(pub);
}
END_TEST

static Suite *bus_suite(void)
{
	Suite *s = suite_create("bus");
	TCase *tc = tcase_create("endpoints");
	tcase_add_unchecked_fixture(tc, setup_base, teardown_base);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_endpoint);
	tcase_add_test(tc, test_endpoint_longest_binds);
	tcase_add_test(tc, test_bind_twice);
	tcase_add_test(tc, test_bind_over_stale_file);
	suite_add_tcase(s, tc);
	tc = tcase_create("rpc");
	tcase_add_unchecked_fixture(tc, setup_base, teardown_base);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_call_reply);
	tcase_add_test(tc, test_call_error);
	tcase_add_test(tc, test_call_timeout);
	tcase_add_test(tc, test_call_no_service);
	tcase_add_test(tc, test_stale_replies);
	tcase_add_test(tc, test_stream);
	tcase_add_test(tc, test_bad_replies);
	suite_add_tcase(s, tc);
	tc = tcase_create("router");
	tcase_add_unchecked_fixture(tc, setup_base, teardown_base);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_recv_request_bad_frames);
	tcase_add_test(tc, test_reply_unreachable);
	tcase_add_test(tc, test_recv_timeout_and_frames);
	suite_add_tcase(s, tc);
	tc = tcase_create("pubsub");
	tcase_add_unchecked_fixture(tc, setup_base, teardown_base);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_pub_sub);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(bus_suite());
}

/* test_service.c - common/service.c: a real service loop in a forked child, driven over its
 * ROUTER and PUB sockets in a temporary run directory; run directory preparation. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/log.h"
#include "common/service.h"
#include "common/util.h"
#include "tests/unit/common/test_helpers.h"

#define SVC "test-svc"

/* Exit codes of the service child. */
enum {
	EXIT_SHUTDOWN = 0,  /* stopped by MSG_SHUTDOWN, stopping() ran */
	EXIT_SIGNAL = 2,    /* stopped by a signal, stopping() ran */
	EXIT_NO_SERVICE = 3, /* service_create failed */
	EXIT_NO_STOPPING = 4,
	EXIT_BAD_RUN = 5,
};

static char *base_dir; /* made and removed by the runner process */
static char *tmp_dir;  /* fresh per test, under base_dir */
static char run_dir[512];
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
	tmp_dir = th_tmpdir(base_dir);
	/* The run directory does not exist yet: service_create makes it (and its parent). */
	snprintf(run_dir, sizeof(run_dir), "%s/run/inst", tmp_dir);
	ctx = NULL;
}

static void teardown(void)
{
	if (ctx)
		zmq_ctx_term(ctx);
	ctx = NULL;
	th_rmtree(tmp_dir);
	free(tmp_dir);
}

/* ---- the service under test (runs in the child) ---- */

struct svc_state {
	int handled, ticks, fd_events;
	bool released, stopping_called;
	int fd;
};

static int svc_handle(void *vctx, struct service *s, const struct bus_peer *peer, const struct msg *req,
		      char *errtext, size_t errlen)
{
	struct svc_state *st = vctx;
	st->handled++;
	struct msg rep;
	switch (req->type) {
	case MSG_KV_ALLOC: {
		if (req->kv_alloc.count == 0) {
			snprintf(errtext, errlen, "count must be at least 1");
			return -EINVAL;
		}
		uint64_t h[4] = {10, 11, 12, 13};
		msg_init(&rep, MSG_KV_BLOCKS, req->corr);
		rep.kv_blocks.handles.v = h;
		rep.kv_blocks.handles.n = req->kv_alloc.count < 4 ? (uint32_t)req->kv_alloc.count : 4;
		rep.kv_blocks.offsets = rep.kv_blocks.handles;
		return service_reply(s, peer, &rep);
	}
	case MSG_KV_FREE:
		snprintf(errtext, errlen, "block %llu is not allocated",
			 req->kv_handles.handles.n ? (unsigned long long)req->kv_handles.handles.v[0] : 0ull);
		return -ENOENT;
	case MSG_GENERATE: {
		/* A long computation: one token, then keep serving (service_poll_once) until a
		 * W_RELEASE from another client arrives, then finish. */
		struct bus_peer me = *peer;
		uint64_t corr = req->corr;
		msg_init(&rep, MSG_TOKEN, corr);
		rep.token.token = 1;
		service_reply(s, &me, &rep);
		for (int i = 0; i < 400 && !st->released; i++)
			if (service_poll_once(s, 25))
				break;
		msg_init(&rep, MSG_GEN_DONE, corr);
		rep.gen_done.n_generated = st->released ? 1 : 0;
		rep.gen_done.reason.p = st->released ? "stop" : "timeout";
		rep.gen_done.reason.len = (uint32_t)strlen(rep.gen_done.reason.p);
		return service_reply(s, &me, &rep);
	}
	case MSG_W_RELEASE:
		st->released = true;
		msg_init(&rep, MSG_OK, req->corr);
		return service_reply(s, peer, &rep);
	default:
		return -ENOTSUP; /* no text: the loop says what was not handled */
	}
}

static void svc_hello(void *vctx, const struct msg *req, struct msg_hello_reply *reply)
{
	reply->layout = 7;
	reply->manifest_hash = 0xabcull;
	reply->shm_name.p = "/llmp-x";
	reply->shm_size = 4096;
}

static char *svc_stats(void *vctx)
{
	struct svc_state *st = vctx;
	char *text = NULL;
	if (asprintf(&text, "{\"handled\": %d, \"ticks\": %d, \"fd_events\": %d}", st->handled, st->ticks,
		     st->fd_events) < 0)
		return NULL;
	return text;
}

static void svc_tick(void *vctx, struct service *s)
{
	((struct svc_state *)vctx)->ticks++;
}

static void svc_stopping(void *vctx, struct service *s)
{
	((struct svc_state *)vctx)->stopping_called = true;
}

static void svc_on_fd(void *vctx, struct service *s, int fd)
{
	struct svc_state *st = vctx;
	char buf[16];
	if (read(fd, buf, sizeof(buf)) > 0)
		st->fd_events++;
}

static const struct service_ops ops = {
	.handle = svc_handle, .hello = svc_hello, .stats = svc_stats, .tick = svc_tick, .stopping = svc_stopping};

/* Runs the service in a child; the exit code says how it stopped. fd_in: a descriptor the
 * service polls (or -1). */
static pid_t start_service(int fd_in)
{
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid)
		return pid;
	/* If the test dies (a failed assertion), the service goes with it. */
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	if (getppid() == 1)
		_exit(EXIT_BAD_RUN);
	log_set_level(LOG_ERROR);
	static struct svc_state st;
	st.fd = fd_in;
	struct service *s = service_create(SVC, run_dir, &ops, &st);
	if (!s)
		_exit(EXIT_NO_SERVICE);
	service_set_tick(s, 20);
	if (fd_in >= 0 && service_add_fd(s, fd_in, svc_on_fd) != 0)
		_exit(EXIT_BAD_RUN);
	int rc = service_run(s);
	enum service_stop_reason why = service_stop_reason(s);
	service_destroy(&s);
	if (rc != 0 || s != NULL)
		_exit(EXIT_BAD_RUN);
	if (!st.stopping_called)
		_exit(EXIT_NO_STOPPING);
	_exit(why == SERVICE_STOP_SHUTDOWN ? EXIT_SHUTDOWN : why == SERVICE_STOP_SIGNAL ? EXIT_SIGNAL : EXIT_BAD_RUN);
}

/* Waits for the child; returns its exit code (the test fails if it did not exit normally). */
static int wait_exit(pid_t pid)
{
	int st;
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert_msg(WIFEXITED(st), "service child ended by signal %d", WIFSIGNALED(st) ? WTERMSIG(st) : 0);
	return WEXITSTATUS(st);
}

/* Connects a client and waits until the service answers HELLO; fills *hello. */
static struct rpc_client *connect_client(struct msg *hello)
{
	if (!ctx)
		ctx = zmq_ctx_new();
	ck_assert_ptr_nonnull(ctx);
	struct rpc_client *c = rpc_client_create(ctx, run_dir, SVC, "unit-test");
	ck_assert_ptr_nonnull(c);
	int rc = rpc_wait_ready(c, hello, 10000);
	ck_assert_msg(rc == 0, "the service did not answer HELLO: %d", rc);
	return c;
}

/* Stops the child with SHUTDOWN; returns its exit code. */
static int shutdown_service(struct rpc_client *c, pid_t pid)
{
	struct msg req, rep;
	msg_init(&req, MSG_SHUTDOWN, 0);
	int rc = rpc_call(c, &req, &rep, 5000);
	ck_assert_int_eq(rc, 0);
	ck_assert_uint_eq(rep.type, MSG_OK);
	msg_free(&rep);
	return wait_exit(pid);
}

static bool socket_exists(const char *suffix)
{
	char path[600];
	snprintf(path, sizeof(path), "%s/%s.%s", run_dir, SVC, suffix);
	struct stat st;
	return stat(path, &st) == 0;
}

/* ---- tests ---- */

START_TEST(test_hello_ping_stats)
{
	pid_t pid = start_service(-1);
	struct msg hello, req, rep;
	struct rpc_client *c = connect_client(&hello);
	/* The run directory was made, private. */
	struct stat st;
	ck_assert_int_eq(stat(run_dir, &st), 0);
	ck_assert(S_ISDIR(st.st_mode));
	ck_assert_uint_eq(st.st_mode & 07777, 0700);
	ck_assert(socket_exists("ctl") && socket_exists("pub"));

	ck_assert_uint_eq(hello.type, MSG_HELLO_REPLY);
	ck_assert_str_eq(hello.hello_reply.service.p, SVC);
	ck_assert_uint_eq(hello.hello_reply.pid, (uint64_t)pid);
	ck_assert_uint_ne(hello.hello_reply.epoch, 0);
	ck_assert_uint_eq(hello.hello_reply.layout, 7);
	ck_assert_uint_eq(hello.hello_reply.manifest_hash, 0xabc);
	ck_assert_str_eq(hello.hello_reply.shm_name.p, "/llmp-x");
	ck_assert_uint_eq(hello.hello_reply.shm_size, 4096);
	/* The epoch is the service's, the same on every HELLO. */
	ck_assert_int_eq(rpc_hello(c, &rep, 5000), 0);
	ck_assert_uint_eq(rep.hello_reply.epoch, hello.hello_reply.epoch);
	msg_free(&rep);
	/* A client of another protocol version gets an error that says so. */
	msg_init(&req, MSG_HELLO, 0);
	req.hello.client.p = "future";
	req.hello.client.len = 6;
	req.hello.proto = PROTO_VERSION + 1;
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), -EREMOTEIO);
	ck_assert_int_eq(rep.error.code, EPROTONOSUPPORT);
	ck_assert_ptr_nonnull(strstr(rep.error.text.p, "protocol"));
	msg_free(&rep);

	msg_init(&req, MSG_PING, 0);
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_OK);
	ck_assert_uint_eq(rep.corr, req.corr);
	msg_free(&rep);

	/* STATS: the JSON object from ops->stats; ticks run on their own. */
	json_t *j = NULL;
	for (int tries = 0; tries < 500; tries++) {
		msg_init(&req, MSG_STATS_GET, 0);
		ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), 0);
		ck_assert_uint_eq(rep.type, MSG_STATS);
		ck_assert_str_eq(rep.stats.service.p, SVC);
		json_error_t jerr;
		json_decref(j);
		j = json_loads(rep.stats.json.p, 0, &jerr);
		ck_assert_msg(j && json_is_object(j), "stats '%s' is not a JSON object: %s", rep.stats.json.p,
			      jerr.text);
		msg_free(&rep);
		if (json_integer_value(json_object_get(j, "ticks")) >= 2)
			break;
		usleep(10 * 1000);
	}
	ck_assert_int_ge(json_integer_value(json_object_get(j, "ticks")), 2);
	ck_assert(json_is_integer(json_object_get(j, "handled")));
	json_decref(j);
	msg_free(&hello);
	ck_assert_int_eq(shutdown_service(c, pid), EXIT_SHUTDOWN);
	rpc_client_destroy(&c);
}
END_TEST

START_TEST(test_handler_errors)
{
	pid_t pid = start_service(-1);
	struct msg hello, req, rep;
	struct rpc_client *c = connect_client(&hello);
	msg_free(&hello);
	msg_init(&req, MSG_KV_ALLOC, 0);
	req.kv_alloc.count = 0;
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), -EREMOTEIO);
	ck_assert_uint_eq(rep.corr, req.corr);
	ck_assert_int_eq(rep.error.code, EINVAL);
	ck_assert_str_eq(rep.error.text.p, "count must be at least 1");
	msg_free(&rep);
	req.kv_alloc.count = 2;
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_KV_BLOCKS);
	ck_assert_uint_eq(rep.kv_blocks.handles.n, 2);
	ck_assert_uint_eq(rep.kv_blocks.handles.v[1], 11);
	msg_free(&rep);
	uint64_t h = 99;
	msg_init(&req, MSG_KV_FREE, 0);
	req.kv_handles.handles.v = &h;
	req.kv_handles.handles.n = 1;
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), -EREMOTEIO);
	ck_assert_int_eq(rep.error.code, ENOENT);
	ck_assert_str_eq(rep.error.text.p, "block 99 is not allocated");
	msg_free(&rep);
	/* A type the handler refuses without a text: the loop names it. */
	msg_init(&req, MSG_TOKEN, 0);
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), -EREMOTEIO);
	ck_assert_int_eq(rep.error.code, ENOTSUP);
	ck_assert_str_eq(rep.error.text.p, SVC " does not handle MSG_TOKEN");
	msg_free(&rep);
	ck_assert_int_eq(shutdown_service(c, pid), EXIT_SHUTDOWN);
	rpc_client_destroy(&c);
}
END_TEST

/* Sends raw frames on a DEALER and returns the decoded reply (the test fails without one). */
static void raw_exchange(void *d, const void *const *frames, const size_t *lens, int n, struct msg *rep)
{
	for (int i = 0; i < n; i++)
		ck_assert_int_ge(zmq_send(d, frames[i], lens[i], i + 1 < n ? ZMQ_SNDMORE : 0), 0);
	char err[256] = "";
	int rc = bus_recv(d, rep, 5000, err, sizeof(err));
	ck_assert_msg(rc == 0, "no decodable reply: %d %s", rc, err);
}

START_TEST(test_garbage_frames)
{
	pid_t pid = start_service(-1);
	struct msg hello, req, rep;
	struct rpc_client *c = connect_client(&hello);
	msg_free(&hello);
	void *d = zmq_socket(ctx, ZMQ_DEALER);
	ck_assert_ptr_nonnull(d);
	int linger = 0;
	zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof(linger));
	char ep[600];
	ck_assert_int_eq(bus_endpoint(run_dir, SVC, "ctl", ep, sizeof(ep)), 0);
	ck_assert_int_eq(zmq_connect(d, ep), 0);

	/* random bytes of many lengths */
	uint64_t x = 0x9e3779b97f4a7c15ull;
	for (int i = 0; i < 40; i++) {
		uint8_t buf[64];
		size_t len = (size_t)i + 1;
		for (size_t j = 0; j < len; j++) {
			x ^= x << 13, x ^= x >> 7, x ^= x << 17;
			buf[j] = (uint8_t)x;
		}
		if (i % 3 == 0)
			buf[0] = 0x94; /* starts like a message */
		const void *f[] = {buf};
		raw_exchange(d, f, &len, 1, &rep);
		ck_assert_uint_eq(rep.type, MSG_ERROR);
		ck_assert(rep.error.code == EBADMSG || rep.error.code == ENOMSG || rep.error.code == EPROTONOSUPPORT);
		ck_assert_uint_gt(rep.error.text.len, 0);
		msg_free(&rep);
	}
	/* an empty frame, and several frames */
	const void *empty[] = {""};
	size_t empty_len[] = {0};
	raw_exchange(d, empty, empty_len, 1, &rep);
	ck_assert_uint_eq(rep.type, MSG_ERROR);
	ck_assert_int_eq(rep.error.code, EBADMSG);
	msg_free(&rep);
	const void *multi[] = {"a", "bc", "def"};
	size_t multi_len[] = {1, 2, 3};
	raw_exchange(d, multi, multi_len, 3, &rep);
	ck_assert_uint_eq(rep.type, MSG_ERROR);
	ck_assert_int_eq(rep.error.code, EBADMSG);
	ck_assert_ptr_nonnull(strstr(rep.error.text.p, "one frame"));
	msg_free(&rep);
	/* an unknown type: the error carries the request's id */
	static const uint8_t unknown[] = {0x94, 0x01, 0xcd, 0x03, 0xe7, 0x2a, 0x80};
	const void *u[] = {unknown};
	size_t ulen[] = {sizeof(unknown)};
	raw_exchange(d, u, ulen, 1, &rep);
	ck_assert_uint_eq(rep.type, MSG_ERROR);
	ck_assert_uint_eq(rep.corr, 42);
	ck_assert_int_eq(rep.error.code, ENOMSG);
	ck_assert_ptr_nonnull(strstr(rep.error.text.p, "999"));
	msg_free(&rep);
	/* a reply type sent as a request goes to the handler, which refuses it */
	msg_init(&req, MSG_HELLO_REPLY, 5);
	void *buf;
	size_t len;
	ck_assert_int_eq(msg_encode(&req, &buf, &len), 0);
	const void *hr[] = {buf};
	raw_exchange(d, hr, &len, 1, &rep);
	free(buf);
	ck_assert_uint_eq(rep.type, MSG_ERROR);
	ck_assert_int_eq(rep.error.code, ENOTSUP);
	msg_free(&rep);
	zmq_close(d);

	/* and the service keeps answering */
	msg_init(&req, MSG_PING, 0);
	ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_OK);
	msg_free(&rep);
	ck_assert_int_eq(shutdown_service(c, pid), EXIT_SHUTDOWN);
	rpc_client_destroy(&c);
}
END_TEST

START_TEST(test_poll_once_in_handler)
{
	/* While a handler computes and calls service_poll_once, other clients are served. */
	pid_t pid = start_service(-1);
	struct msg hello, req, rep;
	struct rpc_client *c1 = connect_client(&hello);
	msg_free(&hello);
	struct rpc_client *c2 = connect_client(&hello);
	msg_free(&hello);
	msg_init(&req, MSG_GENERATE, 0);
	uint64_t t = 1;
	req.generate.tokens.v = &t;
	req.generate.tokens.n = 1;
	uint64_t corr;
	ck_assert_int_eq(rpc_send(c1, &req, &corr), 0);
	ck_assert_int_eq(rpc_wait(c1, corr, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_TOKEN); /* the handler is now inside its loop */
	msg_free(&rep);
	msg_init(&req, MSG_PING, 0);
	ck_assert_int_eq(rpc_call(c2, &req, &rep, 5000), 0);
	ck_assert_uint_eq(rep.type, MSG_OK);
	msg_free(&rep);
	msg_init(&req, MSG_W_RELEASE, 0);
	ck_assert_int_eq(rpc_call(c2, &req, &rep, 5000), 0);
	msg_free(&rep);
	ck_assert_int_eq(rpc_wait(c1, corr, &rep, 10000), 0);
	ck_assert_uint_eq(rep.type, MSG_GEN_DONE);
	ck_assert_str_eq(rep.gen_done.reason.p, "stop");
	msg_free(&rep);
	ck_assert_int_eq(shutdown_service(c1, pid), EXIT_SHUTDOWN);
	rpc_client_destroy(&c1);
	rpc_client_destroy(&c2);
}
END_TEST

START_TEST(test_extra_fd_and_heartbeat)
{
	int p[2];
	ck_assert_int_eq(pipe(p), 0);
	pid_t pid = start_service(p[0]);
	close(p[0]);
	struct msg hello, req, rep;
	struct rpc_client *c = connect_client(&hello);
	/* heartbeats on PUB: service name, pid and epoch of this run */
	char ep[600];
	ck_assert_int_eq(bus_endpoint(run_dir, SVC, "pub", ep, sizeof(ep)), 0);
	void *sub = bus_connect_sub(ctx, ep);
	ck_assert_ptr_nonnull(sub);
	char err[256];
	struct msg beat;
	ck_assert_int_eq(bus_recv(sub, &beat, 10000, err, sizeof(err)), 0);
	ck_assert_uint_eq(beat.type, MSG_HEARTBEAT);
	ck_assert_str_eq(beat.heartbeat.service.p, SVC);
	ck_assert_uint_eq(beat.heartbeat.pid, (uint64_t)pid);
	ck_assert_uint_eq(beat.heartbeat.epoch, hello.hello_reply.epoch);
	ck_assert_uint_ge(beat.heartbeat.seq, 1);
	msg_free(&beat);
	/* right behind it, the counters */
	ck_assert_int_eq(bus_recv(sub, &beat, 10000, err, sizeof(err)), 0);
	ck_assert_uint_eq(beat.type, MSG_STATS);
	ck_assert_str_eq(beat.stats.service.p, SVC);
	json_t *stats = json_loads(beat.stats.json.p, 0, NULL);
	ck_assert_ptr_nonnull(stats);
	ck_assert_ptr_nonnull(json_object_get(stats, "fd_events"));
	json_decref(stats);
	msg_free(&beat);
	zmq_close(sub);
	/* the extra descriptor: a write makes the service call its function */
	ck_assert_int_eq(write(p[1], "x", 1), 1);
	long events = 0;
	for (int tries = 0; tries < 500 && events < 1; tries++) {
		msg_init(&req, MSG_STATS_GET, 0);
		ck_assert_int_eq(rpc_call(c, &req, &rep, 5000), 0);
		json_t *j = json_loads(rep.stats.json.p, 0, NULL);
		ck_assert_ptr_nonnull(j);
		events = (long)json_integer_value(json_object_get(j, "fd_events"));
		json_decref(j);
		msg_free(&rep);
		if (events < 1)
			usleep(10 * 1000);
	}
	ck_assert_int_eq(events, 1);
	close(p[1]);
	msg_free(&hello);
	ck_assert_int_eq(shutdown_service(c, pid), EXIT_SHUTDOWN);
	rpc_client_destroy(&c);
}
END_TEST

START_TEST(test_shutdown)
{
	pid_t pid = start_service(-1);
	struct msg hello;
	struct rpc_client *c = connect_client(&hello);
	msg_free(&hello);
	ck_assert(socket_exists("ctl") && socket_exists("pub"));
	ck_assert_int_eq(shutdown_service(c, pid), EXIT_SHUTDOWN);
	ck_assert(!socket_exists("ctl"));
	ck_assert(!socket_exists("pub"));
	struct stat st;
	ck_assert_int_eq(stat(run_dir, &st), 0); /* the directory itself stays */
	rpc_client_destroy(&c);
}
END_TEST

START_TEST(test_sigterm)
{
	static const int sigs[] = {SIGTERM, SIGINT};
	for (size_t i = 0; i < ARRAY_SIZE(sigs); i++) {
		pid_t pid = start_service(-1);
		struct msg hello;
		struct rpc_client *c = connect_client(&hello);
		msg_free(&hello);
		ck_assert_int_eq(kill(pid, sigs[i]), 0);
		ck_assert_int_eq(wait_exit(pid), EXIT_SIGNAL);
		ck_assert(!socket_exists("ctl"));
		ck_assert(!socket_exists("pub"));
		rpc_client_destroy(&c);
	}
}
END_TEST

/* A SUB socket receives only what is published after its subscription has reached the PUB
 * socket (ZeroMQ's slow joiner). Publishes probes (MSG_PING, corr 1, 2, ...) on s's PUB socket
 * until sub receives one, then takes the probes still on their way up to the last one sent:
 * from then on sub receives what s publishes and nothing is queued before it. Fails the test
 * when no probe arrives within 5 s. */
static void wait_subscribed(struct service *s, void *sub)
{
	char err[256];
	struct msg m;
	uint64_t sent = 0, got = 0;
	uint64_t deadline = now_ns() + 5000000000ull;
	while (!got) {
		ck_assert_msg(now_ns() < deadline, "no probe of %llu published reached the subscriber in 5 s",
			      (unsigned long long)sent);
		struct msg probe;
		msg_init(&probe, MSG_PING, ++sent);
		ck_assert_int_eq(service_publish(s, &probe), 0);
		int rc = bus_recv(sub, &m, 20, err, sizeof(err));
		if (rc == -ETIMEDOUT)
			continue;
		ck_assert_msg(rc == 0, "bus_recv on the subscriber: %d (%s)", rc, err);
		ck_assert_uint_eq(m.type, MSG_PING);
		got = m.corr;
		msg_free(&m);
	}
	while (got < sent) {
		ck_assert_int_eq(bus_recv(sub, &m, 5000, err, sizeof(err)), 0);
		ck_assert_uint_eq(m.type, MSG_PING);
		got = m.corr;
		msg_free(&m);
	}
}

START_TEST(test_beat_and_signal)
{
	/* In this process: service_beat publishes a heartbeat when one is due and nothing else; a
	 * signal stops the service whose poll takes it, and only that one. */
	struct svc_state st = {.fd = -1};
	struct service *s = service_create(SVC, run_dir, &ops, &st);
	ck_assert_ptr_nonnull(s);
	if (!ctx)
		ctx = zmq_ctx_new();
	char ep[600], err[256];
	ck_assert_int_eq(bus_endpoint(run_dir, SVC, "pub", ep, sizeof(ep)), 0);
	void *sub = bus_connect_sub(ctx, ep);
	ck_assert_ptr_nonnull(sub);
	wait_subscribed(s, sub);
	const uint64_t first = now_ns();
	service_beat(s); /* none yet: due at once */
	struct msg m;
	ck_assert_int_eq(bus_recv(sub, &m, 5000, err, sizeof(err)), 0);
	ck_assert_uint_eq(m.type, MSG_HEARTBEAT);
	ck_assert_uint_eq(m.heartbeat.seq, 1);
	ck_assert_uint_eq(m.heartbeat.epoch, service_epoch(s));
	msg_free(&m);
	ck_assert_int_eq(bus_recv(sub, &m, 5000, err, sizeof(err)), 0); /* the counters with it */
	ck_assert_uint_eq(m.type, MSG_STATS);
	msg_free(&m);
	/* The next is a period (1 s) away: nothing published, unless this thread stalled that long
	 * since the first (a loaded machine), when a beat is due and the check says nothing. */
	if (now_ns() - first < 700000000ull) {
		service_beat(s);
		ck_assert_int_eq(bus_recv(sub, &m, 300, err, sizeof(err)), -ETIMEDOUT);
	}
	ck_assert_int_eq(st.handled + st.ticks, 0); /* it neither read a socket nor ticked */
	service_beat(NULL);
	zmq_close(sub);

	ck_assert_int_eq(raise(SIGTERM), 0);
	ck_assert_int_eq(service_poll_once(s, 0), 1);
	ck_assert_int_eq(service_stop_reason(s), SERVICE_STOP_SIGNAL);
	ck_assert_int_eq(service_poll_once(s, 0), 1); /* it stays stopped */
	service_destroy(&s);
	/* A service made afterwards in this process does not take the old signal for its own. */
	s = service_create(SVC, run_dir, &ops, &st);
	ck_assert_ptr_nonnull(s);
	ck_assert_int_eq(service_poll_once(s, 0), 0);
	ck_assert_int_eq(service_stop_reason(s), SERVICE_RUNNING);
	service_destroy(&s);
}
END_TEST

START_TEST(test_second_instance_refused)
{
	/* A second service of the same name in the same run directory must not take the
	 * sockets over from the first, nor remove them when it gives up. */
	pid_t first = start_service(-1);
	struct msg hello, rep;
	struct rpc_client *c = connect_client(&hello);
	msg_free(&hello);
	pid_t second = start_service(-1);
	ck_assert_int_eq(wait_exit(second), EXIT_NO_SERVICE);
	ck_assert(socket_exists("ctl") && socket_exists("pub"));
	ck_assert_int_eq(rpc_client_reset(c), 0); /* a new connection reaches the first */
	ck_assert_int_eq(rpc_hello(c, &rep, 5000), 0);
	ck_assert_uint_eq(rep.hello_reply.pid, (uint64_t)first);
	msg_free(&rep);
	ck_assert_int_eq(shutdown_service(c, first), EXIT_SHUTDOWN);
	rpc_client_destroy(&c);
}
END_TEST

/* ---- run directories ---- */

START_TEST(test_run_dir_prepare)
{
	char path[600];
	struct stat st;
	/* missing, with missing parents: made 0700 */
	snprintf(path, sizeof(path), "%s/a/b/c", tmp_dir);
	umask(022);
	ck_assert_int_eq(run_dir_prepare(path), 0);
	ck_assert_int_eq(stat(path, &st), 0);
	ck_assert(S_ISDIR(st.st_mode));
	ck_assert_uint_eq(st.st_mode & 07777, 0700);
	/* existing and already right: untouched, succeeds again */
	ck_assert_int_eq(run_dir_prepare(path), 0);
	/* a trailing slash is the same directory */
	snprintf(path, sizeof(path), "%s/a/b/c/", tmp_dir);
	ck_assert_int_eq(run_dir_prepare(path), 0);
	/* too loose: tightened */
	snprintf(path, sizeof(path), "%s/loose", tmp_dir);
	ck_assert_int_eq(mkdir(path, 0755), 0);
	ck_assert_int_eq(chmod(path, 0755), 0);
	ck_assert_int_eq(run_dir_prepare(path), 0);
	ck_assert_int_eq(stat(path, &st), 0);
	ck_assert_uint_eq(st.st_mode & 07777, 0700);
	ck_assert_int_eq(chmod(path, 0777), 0);
	ck_assert_int_eq(run_dir_prepare(path), 0);
	ck_assert_int_eq(stat(path, &st), 0);
	ck_assert_uint_eq(st.st_mode & 07777, 0700);
	/* a file where the directory should be: refused with a message naming it */
	snprintf(path, sizeof(path), "%s/file", tmp_dir);
	FILE *f = fopen(path, "w");
	ck_assert_ptr_nonnull(f);
	fclose(f);
	struct th_capture cap;
	th_capture_begin(&cap, STDERR_FILENO);
	int rc = run_dir_prepare(path);
	char *err = th_capture_end(&cap);
	ck_assert_int_eq(rc, -ENOTDIR);
	ck_assert_ptr_nonnull(strstr(err, path));
	free(err);
	ck_assert_int_eq(stat(path, &st), 0);
	ck_assert(S_ISREG(st.st_mode)); /* left alone */
	/* a parent others may write, not sticky: refused (another user could replace the run
	 * directory); sticky, as /tmp is: taken */
	char parent[600];
	snprintf(parent, sizeof(parent), "%s/open", tmp_dir);
	ck_assert_int_eq(mkdir(parent, 0700), 0);
	ck_assert_int_eq(chmod(parent, 0777), 0);
	snprintf(path, sizeof(path), "%s/open/run", tmp_dir);
	th_capture_begin(&cap, STDERR_FILENO);
	rc = run_dir_prepare(path);
	err = th_capture_end(&cap);
	ck_assert_int_eq(rc, -EPERM);
	ck_assert_ptr_nonnull(strstr(err, "writable by other users"));
	free(err);
	/* ... and for another directory of the user's files, in its own words (the kv-store's
	 * --persist-dir, which PIPELINE_RUN_DIR does not move) */
	snprintf(path, sizeof(path), "%s/open/persist", tmp_dir);
	th_capture_begin(&cap, STDERR_FILENO);
	rc = private_dir_prepare(path, "persist directory", "name another --persist-dir");
	err = th_capture_end(&cap);
	ck_assert_int_eq(rc, -EPERM);
	ck_assert_msg(strstr(err, "persist directory's parent") && strstr(err, "name another --persist-dir") &&
			      !strstr(err, "run directory") && !strstr(err, "PIPELINE_RUN_DIR"),
		      "%s", err);
	free(err);
	ck_assert_int_eq(chmod(parent, 01777), 0);
	ck_assert_int_eq(run_dir_prepare(path), 0);
	/* further up the same: a directory of ours (0700) inside one others may write, not sticky,
	 * is no safer (they may rename ours away and make their own in its place) */
	char mine[640];
	snprintf(mine, sizeof(mine), "%s/open/mine", tmp_dir);
	ck_assert_int_eq(mkdir(mine, 0700), 0);
	ck_assert_int_eq(chmod(parent, 0777), 0);
	snprintf(path, sizeof(path), "%s/open/mine/run", tmp_dir);
	th_capture_begin(&cap, STDERR_FILENO);
	rc = run_dir_prepare(path);
	err = th_capture_end(&cap);
	ck_assert_int_eq(rc, -EPERM);
	ck_assert_msg(strstr(err, "a directory above the run directory") && strstr(err, "writable by other users"),
		      "%s", err);
	free(err);
	ck_assert_int_eq(chmod(parent, 01777), 0);
	ck_assert_int_eq(run_dir_prepare(path), 0);
	snprintf(path, sizeof(path), "%s/open/persist", tmp_dir);
	if (geteuid() == 0) {
		/* another user's parent (made first where everyone may create it): refused */
		ck_assert_int_eq(chmod(parent, 0755), 0);
		ck_assert_int_eq(chown(parent, 65534, 65534), 0);
		th_capture_begin(&cap, STDERR_FILENO);
		rc = run_dir_prepare(path);
		err = th_capture_end(&cap);
		ck_assert_int_eq(rc, -EPERM);
		ck_assert_ptr_nonnull(strstr(err, "belongs to uid 65534"));
		free(err);
		ck_assert_int_eq(chown(parent, 0, 0), 0);
	}
	/* a file as a parent */
	snprintf(path, sizeof(path), "%s/file/sub", tmp_dir);
	th_capture_begin(&cap, STDERR_FILENO);
	rc = run_dir_prepare(path);
	free(th_capture_end(&cap));
	ck_assert_int_eq(rc, -ENOTDIR);
	/* too long */
	char *longpath = malloc(1024);
	memset(longpath, 'x', 1023);
	longpath[0] = '/';
	longpath[1023] = 0;
	th_capture_begin(&cap, STDERR_FILENO);
	rc = run_dir_prepare(longpath);
	err = th_capture_end(&cap);
	ck_assert_int_eq(rc, -ENAMETOOLONG);
	ck_assert_ptr_nonnull(strstr(err, "too long")); /* every refusal is logged with its reason */
	free(err);
	free(longpath);
	/* service_create refuses a run directory that is a file */
	snprintf(run_dir, sizeof(run_dir), "%s/file", tmp_dir);
	th_capture_begin(&cap, STDERR_FILENO);
	struct service *s = service_create(SVC, run_dir, &ops, NULL);
	free(th_capture_end(&cap));
	ck_assert_ptr_null(s);
}
END_TEST

START_TEST(test_run_dir_default)
{
	char buf[256], want[256];
	unsetenv("PIPELINE_RUN_DIR");
	ck_assert_int_eq(run_dir_default("default", buf, sizeof(buf)), 0);
	snprintf(want, sizeof(want), "/tmp/llmp-%u/default", (unsigned)getuid());
	ck_assert_str_eq(buf, want);
	setenv("PIPELINE_RUN_DIR", "/somewhere/else", 1);
	ck_assert_int_eq(run_dir_default("default", buf, sizeof(buf)), 0);
	ck_assert_str_eq(buf, "/somewhere/else");
	setenv("PIPELINE_RUN_DIR", "", 1); /* empty counts as unset */
	ck_assert_int_eq(run_dir_default("x", buf, sizeof(buf)), 0);
	snprintf(want, sizeof(want), "/tmp/llmp-%u/x", (unsigned)getuid());
	ck_assert_str_eq(buf, want);
	char small[8];
	ck_assert_int_eq(run_dir_default("default", small, sizeof(small)), -ENAMETOOLONG);
}
END_TEST

static Suite *service_suite(void)
{
	Suite *s = suite_create("service");
	TCase *tc = tcase_create("requests");
	tcase_add_unchecked_fixture(tc, setup_base, teardown_base);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_hello_ping_stats);
	tcase_add_test(tc, test_handler_errors);
	tcase_add_test(tc, test_garbage_frames);
	tcase_add_test(tc, test_poll_once_in_handler);
	tcase_add_test(tc, test_extra_fd_and_heartbeat);
	tcase_set_timeout(tc, 30);
	suite_add_tcase(s, tc);
	tc = tcase_create("lifecycle");
	tcase_add_unchecked_fixture(tc, setup_base, teardown_base);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_shutdown);
	tcase_add_test(tc, test_sigterm);
	tcase_add_test(tc, test_beat_and_signal);
	tcase_add_test(tc, test_second_instance_refused);
	tcase_set_timeout(tc, 30);
	suite_add_tcase(s, tc);
	tc = tcase_create("run_dir");
	tcase_add_unchecked_fixture(tc, setup_base, teardown_base);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_run_dir_prepare);
	tcase_add_test(tc, test_run_dir_default);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(service_suite());
}

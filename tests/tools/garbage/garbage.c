/* garbage.c - pipeline-garbage SERVICE: a test tool (tests/integration/garbage.sh runs it), not
 * part of the product. It sends a battery of malformed and nonsensical requests to a service's
 * control socket. Each must be answered with MSG_ERROR (where a reply is expected at all); then
 * a PING on a fresh socket must still be answered. Exit 0 only if every case behaved and the
 * service still serves; 1 otherwise; 2 on bad usage.
 *
 *   pipeline-garbage [--instance NAME] [--run-dir DIR] [--timeout SEC] [--seed N] SERVICE
 *
 * The requests are written byte by byte with msgpack-c, not with the codec, because the
 * codec refuses to write most of them. */
#include <errno.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/config.h"
#include "common/log.h"
#include "common/protocol.h"
#include "common/service.h"
#include "common/util.h"

#define PROG "pipeline-garbage"
#define EXIT_OK 0
#define EXIT_FAIL 1
#define EXIT_USAGE 2
#define DEFAULT_TIMEOUT_S 10 /* seconds to wait for each reply */

#define BAD_ID (1ull << 40) /* a group, block or token id no service has */

struct garbage {
	void *zctx;
	const char *service;
	void *sock;
	char endpoint[300];
	uint64_t rng;
	uint64_t next_corr;
	int timeout_ms;
	int cases, failures;
};

/* One request: payload bytes (plus an optional second frame), whether the service should
 * answer, and the correlation id the answer should carry (0: any, the id is unreadable). */
struct bad_request {
	msgpack_sbuffer body;
	bool two_frames;
	bool expect_reply;
	uint64_t corr;
};

static uint64_t next_random(struct garbage *g)
{
	/* xorshift64*: reproducible from --seed, good enough for junk bytes. */
	g->rng ^= g->rng >> 12;
	g->rng ^= g->rng << 25;
	g->rng ^= g->rng >> 27;
	return g->rng * 0x2545f4914f6cdd1dull;
}

static int open_socket(struct garbage *g)
{
	g->sock = zmq_socket(g->zctx, ZMQ_DEALER);
	if (!g->sock)
		return -errno;
	int64_t max = PROTO_MAX_MSG_BYTES;
	int linger = 0;
	if (zmq_setsockopt(g->sock, ZMQ_MAXMSGSIZE, &max, sizeof(max)) != 0 ||
	    zmq_setsockopt(g->sock, ZMQ_LINGER, &linger, sizeof(linger)) != 0 ||
	    zmq_connect(g->sock, g->endpoint) != 0) {
		int rc = -errno;
		zmq_close(g->sock);
		g->sock = NULL;
		return rc;
	}
	return 0;
}

static void close_socket(struct garbage *g)
{
	if (g->sock)
		zmq_close(g->sock);
	g->sock = NULL;
}

/* Starts [version, type, corr, <body follows>]. */
static int pack_head(msgpack_packer *pk, uint64_t version, uint64_t type, uint64_t corr)
{
	int rc = msgpack_pack_array(pk, 4);
	rc = rc ? rc : msgpack_pack_uint64(pk, version);
	rc = rc ? rc : msgpack_pack_uint64(pk, type);
	return rc ? rc : msgpack_pack_uint64(pk, corr);
}

static int pack_str(msgpack_packer *pk, const char *s)
{
	size_t n = strlen(s);
	int rc = msgpack_pack_str(pk, n);
	return rc ? rc : msgpack_pack_str_body(pk, s, n);
}

/* A whole valid-looking message whose body holds one u64 array field `key` = {values}. */
static int pack_array_msg(msgpack_packer *pk, uint32_t type, uint64_t corr, uint8_t key, const uint64_t *v,
			  uint32_t n, int extra_u64_key, uint64_t extra_u64)
{
	int rc = pack_head(pk, PROTO_VERSION, type, corr);
	rc = rc ? rc : msgpack_pack_map(pk, extra_u64_key ? 2 : 1);
	rc = rc ? rc : msgpack_pack_uint8(pk, key);
	rc = rc ? rc : msgpack_pack_array(pk, n);
	for (uint32_t i = 0; !rc && i < n; i++)
		rc = msgpack_pack_uint64(pk, v[i]);
	if (!rc && extra_u64_key) {
		rc = msgpack_pack_uint8(pk, (uint8_t)extra_u64_key);
		rc = rc ? rc : msgpack_pack_uint64(pk, extra_u64);
	}
	return rc;
}

/* Sends r and checks the answer. Prints one line; counts a failure. */
static void run_case(struct garbage *g, const char *name, struct bad_request *r)
{
	g->cases++;
	char line[600];
	bool ok = false;
	int flags = r->two_frames ? ZMQ_SNDMORE : 0;
	if (zmq_send(g->sock, r->body.data, r->body.size, flags | ZMQ_DONTWAIT) < 0 ||
	    (r->two_frames && zmq_send(g->sock, "extra", 5, ZMQ_DONTWAIT) < 0)) {
		snprintf(line, sizeof(line), "could not send: %s", zmq_strerror(errno));
		goto out;
	}
	if (!r->expect_reply) {
		snprintf(line, sizeof(line), "sent, no reply expected");
		ok = true;
		goto out;
	}
	struct msg rep;
	char err[256];
	int rc = bus_recv(g->sock, &rep, g->timeout_ms, err, sizeof(err));
	if (rc == -ETIMEDOUT) {
		snprintf(line, sizeof(line), "no reply in %d s", g->timeout_ms / 1000);
		goto out;
	}
	if (rc) {
		snprintf(line, sizeof(line), "a reply that does not decode: %s", rc == -EBADMSG ? err : strerror(-rc));
		goto out;
	}
	if (rep.type != MSG_ERROR) {
		snprintf(line, sizeof(line), "answered %s instead of MSG_ERROR", msg_type_name(rep.type));
	} else if (r->corr && rep.corr != r->corr) {
		snprintf(line, sizeof(line), "MSG_ERROR with id %llu, the request's was %llu",
			 (unsigned long long)rep.corr, (unsigned long long)r->corr);
	} else {
		snprintf(line, sizeof(line), "MSG_ERROR %lld: %.400s", (long long)rep.error.code, rep.error.text.p);
		ok = true;
	}
	msg_free(&rep);
out:
	printf("%-5s %-44s %s\n", ok ? "ok" : "FAIL", name, line);
	fflush(stdout);
	if (!ok)
		g->failures++;
	msgpack_sbuffer_destroy(&r->body);
}

/* Prepares r for a new case: an empty body and a fresh correlation id in *corr. */
static msgpack_packer start(struct garbage *g, struct bad_request *r, uint64_t *corr)
{
	msgpack_packer pk;
	memset(r, 0, sizeof(*r));
	msgpack_sbuffer_init(&r->body);
	msgpack_packer_init(&pk, &r->body, msgpack_sbuffer_write);
	*corr = g->next_corr++;
	r->expect_reply = true;
	return pk;
}

/* Reports a case that could not be built (out of memory in msgpack). */
static void build_failed(struct garbage *g, const char *name, struct bad_request *r)
{
	g->cases++;
	g->failures++;
	printf("FAIL  %-44s could not build the request\n", name);
	msgpack_sbuffer_destroy(&r->body);
}

#define RUN(name, build_rc)                            \
	do {                                           \
		if ((build_rc) != 0)                   \
			build_failed(g, name, &r);     \
		else                                   \
			run_case(g, name, &r);         \
	} while (0)

static void generic_cases(struct garbage *g)
{
	struct bad_request r;
	uint64_t corr;
	msgpack_packer pk;
	int rc;

	pk = start(g, &r, &corr);
	RUN("an empty frame", 0);

	static const size_t random_lens[] = {1, 7, 64, 1000};
	for (size_t i = 0; i < ARRAY_SIZE(random_lens); i++) {
		pk = start(g, &r, &corr);
		rc = 0;
		for (size_t k = 0; !rc && k < random_lens[i]; k++) {
			uint8_t b = (uint8_t)next_random(g);
			/* No array marker first: random bytes that happened to form a message would be a fluke. */
			if (k == 0 && ((b & 0xf0) == 0x90 || b == 0xdc || b == 0xdd))
				b = 0xc1;
			rc = msgpack_sbuffer_write(&r.body, (const char *)&b, 1);
		}
		char name[64];
		snprintf(name, sizeof(name), "%zu random bytes", random_lens[i]);
		RUN(name, rc);
	}

	/* The right first byte (an array of 4), random bytes after it: reaches the decoder's later checks. */
	pk = start(g, &r, &corr);
	rc = msgpack_sbuffer_write(&r.body, "\x94", 1);
	for (size_t k = 0; !rc && k < 63; k++) {
		uint8_t b = (uint8_t)next_random(g);
		rc = msgpack_sbuffer_write(&r.body, (const char *)&b, 1);
	}
	RUN("an array of 4 holding random bytes", rc);

	pk = start(g, &r, &corr);
	RUN("a map instead of the message array", msgpack_pack_map(&pk, 0));

	pk = start(g, &r, &corr);
	rc = msgpack_pack_array(&pk, 3);
	rc = rc ? rc : msgpack_pack_uint64(&pk, PROTO_VERSION);
	rc = rc ? rc : msgpack_pack_uint64(&pk, MSG_PING);
	rc = rc ? rc : msgpack_pack_uint64(&pk, corr);
	RUN("an array of 3 instead of 4", rc);

	/* A valid HELLO cut in half. */
	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_HELLO, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 2);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	rc = rc ? rc : pack_str(&pk, PROG);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 2);
	rc = rc ? rc : msgpack_pack_uint64(&pk, PROTO_VERSION);
	r.body.size /= 2;
	RUN("a truncated HELLO", rc);

	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_PING, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 0);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 7);
	RUN("a PING with a trailing byte", rc);

	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, 999, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 0);
	r.corr = corr;
	RUN("an unknown message type (999)", rc);

	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION + 1, MSG_PING, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 0);
	r.corr = corr;
	RUN("a wrong protocol version", rc);

	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_HELLO, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 2);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	rc = rc ? rc : pack_str(&pk, PROG);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 2);
	rc = rc ? rc : msgpack_pack_uint64(&pk, PROTO_VERSION + 41);
	r.corr = corr;
	RUN("a HELLO claiming another protocol", rc);

	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_PING, corr);
	rc = rc ? rc : msgpack_pack_array(&pk, 1);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	r.corr = corr;
	RUN("a body that is not a map", rc);

	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_HELLO, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 2);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	rc = rc ? rc : msgpack_pack_uint64(&pk, 5);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 2);
	rc = rc ? rc : msgpack_pack_uint64(&pk, PROTO_VERSION);
	r.corr = corr;
	RUN("a field of the wrong kind", rc);

	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_HELLO, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 1);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 2);
	rc = rc ? rc : msgpack_pack_uint64(&pk, PROTO_VERSION);
	r.corr = corr;
	RUN("a missing required field", rc);

	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_HELLO, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 3);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	rc = rc ? rc : pack_str(&pk, "a");
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	rc = rc ? rc : pack_str(&pk, "b");
	rc = rc ? rc : msgpack_pack_uint8(&pk, 2);
	rc = rc ? rc : msgpack_pack_uint64(&pk, PROTO_VERSION);
	r.corr = corr;
	RUN("a duplicate key", rc);

	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_HELLO, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 2);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	rc = rc ? rc : pack_str(&pk, "a-client-name-far-longer-than-the-sixty-four-bytes-a-hello-allows-for-it");
	rc = rc ? rc : msgpack_pack_uint8(&pk, 2);
	rc = rc ? rc : msgpack_pack_uint64(&pk, PROTO_VERSION);
	r.corr = corr;
	RUN("a string over its field's limit", rc);

	/* An array header claiming 2^32-1 elements, followed by none. */
	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_GENERATE, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 2);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 2);
	rc = rc ? rc : msgpack_pack_uint64(&pk, 4);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	rc = rc ? rc : msgpack_sbuffer_write(&r.body, "\xdd\xff\xff\xff\xff", 5);
	RUN("an array claiming 2^32-1 elements", rc);

	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_HELLO, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 1);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	rc = rc ? rc : msgpack_sbuffer_write(&r.body, "\xdb\xff\xff\xff\xf0xyz", 8);
	RUN("a string claiming 4 GiB", rc);

	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_PING, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 1);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	for (int i = 0; !rc && i < 8; i++)
		rc = msgpack_pack_array(&pk, 1);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	RUN("nesting 10 levels deep", rc);

	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_PING, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 0);
	r.two_frames = true;
	RUN("a request of two frames", rc);

	/* Well-formed, but a message no service takes as a request. */
	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_HEARTBEAT, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 5);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	rc = rc ? rc : pack_str(&pk, PROG);
	for (uint8_t k = 2; !rc && k <= 5; k++) {
		rc = msgpack_pack_uint8(&pk, k);
		rc = rc ? rc : msgpack_pack_uint64(&pk, 1);
	}
	r.corr = corr;
	RUN("a HEARTBEAT sent as a request", rc);

	/* Live tuning: well-formed messages whose JSON is not what the service takes. */
	static const struct {
		uint32_t type;
		const char *json, *name;
	} config[] = {
		{MSG_CONFIG_SET, "not json", "CONFIG_SET of text that is not JSON"},
		{MSG_CONFIG_SET, "[\"log-level\", \"debug\"]", "CONFIG_SET of an array"},
		{MSG_CONFIG_SET, "{}", "CONFIG_SET of nothing"},
		{MSG_CONFIG_SET, "{\"log-level\": {\"x\": 1}}", "CONFIG_SET of an object value"},
		{MSG_CONFIG_SET, "{\"log-level\": \"debug\", \"log-level\": \"info\"}", "CONFIG_SET of a key twice"},
		{MSG_CONFIG_SET, "{\"no-such-key\": \"1\"}", "CONFIG_SET of an unknown key"},
		{MSG_CONFIG_SET, "{\"log-level\": \"loud\"}", "CONFIG_SET of a bad value"},
		{MSG_CONFIG_SET, "{\"instance\": \"other\"}", "CONFIG_SET of a fixed key"},
		{MSG_CONFIG_GET, "{\"log-level\": 1}", "CONFIG_GET of an object"},
		{MSG_CONFIG_GET, "[\"no-such-key\"]", "CONFIG_GET of an unknown key"},
		{MSG_CONFIG_GET, "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]"
				 "]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
		 "CONFIG_GET of nested arrays"},
	};
	for (size_t i = 0; i < ARRAY_SIZE(config); i++) {
		pk = start(g, &r, &corr);
		rc = pack_head(&pk, PROTO_VERSION, config[i].type, corr);
		rc = rc ? rc : msgpack_pack_map(&pk, 1);
		rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
		rc = rc ? rc : pack_str(&pk, config[i].json);
		r.corr = corr;
		RUN(config[i].name, rc);
	}
	/* the value of a key far past its limit: the codec refuses it */
	pk = start(g, &r, &corr);
	rc = pack_head(&pk, PROTO_VERSION, MSG_CONFIG_SET, corr);
	rc = rc ? rc : msgpack_pack_map(&pk, 1);
	rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
	rc = rc ? rc : msgpack_pack_str(&pk, 70000);
	for (int i = 0; !rc && i < 70000 / 10; i++)
		rc = msgpack_pack_str_body(&pk, "0123456789", 10);
	r.corr = corr;
	RUN("CONFIG_SET of 70000 bytes", rc);
}

/* Well-formed requests naming things that do not exist, per service. */
static void service_cases(struct garbage *g)
{
	struct bad_request r;
	uint64_t corr, bad = BAD_ID;
	msgpack_packer pk;

	if (!strcmp(g->service, "ssd-loader")) {
		pk = start(g, &r, &corr);
		r.corr = corr;
		RUN("W_ACQUIRE of a group that does not exist",
		    pack_array_msg(&pk, MSG_W_ACQUIRE, corr, 1, &bad, 1, 0, 0));
		pk = start(g, &r, &corr);
		r.corr = corr;
		RUN("W_RELEASE of a group never acquired", pack_array_msg(&pk, MSG_W_RELEASE, corr, 1, &bad, 1, 0, 0));
		pk = start(g, &r, &corr);
		r.corr = corr;
		RUN("KV_FREE sent to the loader", pack_array_msg(&pk, MSG_KV_FREE, corr, 1, &bad, 1, 0, 0));
	} else if (!strcmp(g->service, "kv-store")) {
		pk = start(g, &r, &corr);
		r.corr = corr;
		RUN("KV_FETCH of a block that does not exist",
		    pack_array_msg(&pk, MSG_KV_FETCH, corr, 1, &bad, 1, 0, 0));
		pk = start(g, &r, &corr);
		r.corr = corr;
		RUN("KV_UNPIN of a block that does not exist",
		    pack_array_msg(&pk, MSG_KV_UNPIN, corr, 1, &bad, 1, 0, 0));
		pk = start(g, &r, &corr);
		r.corr = corr;
		RUN("KV_FREE of a block that does not exist", pack_array_msg(&pk, MSG_KV_FREE, corr, 1, &bad, 1, 0, 0));
		pk = start(g, &r, &corr);
		r.corr = corr;
		int rc = pack_head(&pk, PROTO_VERSION, MSG_KV_ALLOC, corr);
		rc = rc ? rc : msgpack_pack_map(&pk, 1);
		rc = rc ? rc : msgpack_pack_uint8(&pk, 1);
		rc = rc ? rc : msgpack_pack_uint64(&pk, bad);
		RUN("KV_ALLOC of 2^40 blocks", rc);
	} else {
		pk = start(g, &r, &corr);
		r.corr = corr;
		RUN("GENERATE with an empty prompt", pack_array_msg(&pk, MSG_GENERATE, corr, 1, NULL, 0, 2, 4));
		pk = start(g, &r, &corr);
		r.corr = corr;
		RUN("GENERATE with a token past the vocabulary",
		    pack_array_msg(&pk, MSG_GENERATE, corr, 1, &bad, 1, 2, 4));
		pk = start(g, &r, &corr);
		r.corr = corr;
		RUN("W_ACQUIRE sent to the runner", pack_array_msg(&pk, MSG_W_ACQUIRE, corr, 1, &bad, 1, 0, 0));
	}
}

/* Cases after which the connection is gone: a message over ZMQ_MAXMSGSIZE (the service
 * drops the connection, no reply), and for gpu-runner a GENERATE whose client hangs up
 * after the first token. Each reopens the socket. A case passes when it could be sent: what
 * counts is that the service answers afterwards (the final PING). */
static void disconnect_cases(struct garbage *g)
{
	struct bad_request r;
	uint64_t corr;
	struct msg rep;
	char err[256];
	msgpack_packer pk = start(g, &r, &corr);
	size_t big = (size_t)PROTO_MAX_MSG_BYTES + 4096;
	char *junk = calloc(1, big);
	int rc = junk ? msgpack_sbuffer_write(&r.body, junk, big) : -ENOMEM;
	free(junk);
	r.expect_reply = false;
	RUN("a message over the size limit", rc);
	/* Give the bytes time to leave before the socket closes (linger is 0): a PING behind them
	 * is answered, or lost with the connection the service dropped. Either is fine. */
	pk = start(g, &r, &corr);
	if (pack_head(&pk, PROTO_VERSION, MSG_PING, corr) == 0 && msgpack_pack_map(&pk, 0) == 0 &&
	    zmq_send(g->sock, r.body.data, r.body.size, ZMQ_DONTWAIT) >= 0 &&
	    bus_recv(g->sock, &rep, 2000, err, sizeof(err)) == 0)
		msg_free(&rep);
	msgpack_sbuffer_destroy(&r.body);
	close_socket(g);
	if (open_socket(g) != 0)
		return;

	if (!strcmp(g->service, "gpu-runner")) {
		static const uint64_t prompt[] = {1, 2, 3};
		pk = start(g, &r, &corr);
		g->cases++;
		bool ok = pack_array_msg(&pk, MSG_GENERATE, corr, 1, prompt, 3, 2, 32) == 0 &&
			  zmq_send(g->sock, r.body.data, r.body.size, ZMQ_DONTWAIT) >= 0;
		msgpack_sbuffer_destroy(&r.body);
		/* Hang up once the stream has begun (or failed). */
		if (ok && bus_recv(g->sock, &rep, g->timeout_ms, err, sizeof(err)) == 0)
			msg_free(&rep);
		printf("%-5s %-44s %s\n", ok ? "ok" : "FAIL", "GENERATE whose client hangs up",
		       ok ? "hung up after the first reply" : "could not send");
		g->failures += !ok;
		close_socket(g);
		open_socket(g);
	}
}

/* Prints why a call to service failed: rc from rpc_call, rep the MSG_ERROR reply when rc is
 * -EREMOTEIO (freed here). */
static void rpc_failed(const char *service, const char *what, int rc, struct msg *rep, int timeout_ms)
{
	if (rc == -EREMOTEIO) {
		fprintf(stderr, PROG ": %s: %s\n", service, rep->error.text.p ? rep->error.text.p : "(no text)");
		msg_free(rep);
	} else if (rc == -ETIMEDOUT) {
		fprintf(stderr, PROG ": %s did not answer %s in %d s\n", service, what, timeout_ms / 1000);
	} else {
		fprintf(stderr, PROG ": %s %s failed: %s\n", service, what, strerror(-rc));
	}
}

/* The battery against service, through a client c of it; the verdict is a fresh client's PING.
 * Returns 0 when every case behaved and the service still answers. */
static int run_battery(struct garbage *g, struct rpc_client *c, const char *run_dir)
{
	/* The service must answer before the battery, or its failures would mean nothing. */
	struct msg rep;
	int rc = rpc_hello(c, &rep, g->timeout_ms);
	if (rc) {
		rpc_failed(g->service, "HELLO", rc, &rep, g->timeout_ms);
		return rc;
	}
	msg_free(&rep);
	if (bus_endpoint(run_dir, g->service, "ctl", g->endpoint, sizeof(g->endpoint)) != 0 || open_socket(g) != 0) {
		fprintf(stderr, PROG ": cannot open a socket to %s in %s\n", g->service, run_dir);
		return -EIO;
	}
	generic_cases(g);
	service_cases(g);
	disconnect_cases(g);
	close_socket(g);

	struct msg req;
	msg_init(&req, MSG_PING, 0);
	rpc_client_reset(c);
	rc = rpc_call(c, &req, &rep, g->timeout_ms);
	if (rc) {
		rpc_failed(g->service, "PING after the battery", rc, &rep, g->timeout_ms);
		return rc;
	}
	if (rep.type != MSG_OK) {
		fprintf(stderr, PROG ": %s answered PING with %s\n", g->service, msg_type_name(rep.type));
		msg_free(&rep);
		return -EBADMSG;
	}
	msg_free(&rep);
	printf("%s still answers after %d malformed requests (%d handled wrongly)\n", g->service, g->cases,
	       g->failures);
	return g->failures ? -EPROTO : 0;
}

int main(int argc, char **argv)
{
	const char *instance = NULL, *run_dir_flag = NULL;
	long timeout_s = DEFAULT_TIMEOUT_S, seed = 1;
	struct opt opts[] = {
		{"instance", OPT_STRING, &instance, "default", "the instance to talk to"},
		{"run-dir", OPT_STRING, &run_dir_flag, NULL,
		 "its run directory (default /tmp/llmp-<uid>/<instance>)"},
		{"timeout", OPT_INT, &timeout_s, NULL, "seconds to wait for each reply (default 10)"},
		{"seed", OPT_INT, &seed, NULL, "seed of the random bytes (default 1)"},
		{0},
	};
	log_init(PROG);
	char **pos = calloc((size_t)argc + 1, sizeof(*pos));
	if (!pos)
		return EXIT_FAIL;
	int n_pos = 0;
	int rc = config_parse(PROG " SERVICE",
			      "Sends malformed requests to the control socket of SERVICE (ssd-loader, kv-store or "
			      "gpu-runner), checks each is answered with MSG_ERROR, then that the service still "
			      "answers PING. A test tool.",
			      opts, argc, argv, pos, &n_pos);
	const char *service = pos[0];
	free(pos);
	if (rc)
		return rc > 0 ? EXIT_OK : EXIT_USAGE;
	if (n_pos != 1) {
		fprintf(stderr, PROG ": %s (usage: " PROG " [flags] SERVICE; --help for the flags)\n",
			n_pos ? "one service only" : "missing the service");
		return EXIT_USAGE;
	}
	if (strcmp(service, "ssd-loader") && strcmp(service, "kv-store") && strcmp(service, "gpu-runner")) {
		fprintf(stderr, PROG ": unknown service '%s' (one of: ssd-loader, kv-store, gpu-runner)\n", service);
		return EXIT_USAGE;
	}
	if (timeout_s < 0 || timeout_s > 86400) {
		fprintf(stderr, PROG ": --timeout must be 0..86400 seconds\n");
		return EXIT_USAGE;
	}
	char run_dir[256];
	if (run_dir_flag && *run_dir_flag ? str_copy(run_dir, sizeof(run_dir), run_dir_flag) != 0
					  : run_dir_default(instance, run_dir, sizeof(run_dir)) != 0) {
		fprintf(stderr, PROG ": the run directory's path is too long\n");
		return EXIT_USAGE;
	}
	/* A missing socket is reported at once instead of after a timeout. */
	char path[512];
	struct stat st;
	snprintf(path, sizeof(path), "%s/%s.ctl", run_dir, service);
	if (stat(path, &st) != 0) {
		fprintf(stderr, PROG ": %s is not running: no control socket %s\n", service, path);
		return EXIT_FAIL;
	}

	struct garbage g = {
		.service = service,
		.rng = (uint64_t)seed * 0x9e3779b97f4a7c15ull + 1,
		.next_corr = 1000,
		.timeout_ms = (int)(timeout_s * 1000),
	};
	g.zctx = zmq_ctx_new();
	if (!g.zctx) {
		fprintf(stderr, PROG ": cannot create a ZeroMQ context: %s\n", strerror(errno));
		return EXIT_FAIL;
	}
	struct rpc_client *c = rpc_client_create(g.zctx, run_dir, service, PROG);
	if (!c) {
		rc = errno ? -errno : -EIO;
		fprintf(stderr, PROG ": cannot open a client of %s at %s: %s\n", service, path, strerror(-rc));
		goto out_ctx;
	}
	rc = run_battery(&g, c, run_dir);
	rpc_client_destroy(&c);
out_ctx:
	zmq_ctx_term(g.zctx);
	return rc ? EXIT_FAIL : EXIT_OK;
}

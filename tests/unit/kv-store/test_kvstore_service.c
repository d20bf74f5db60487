/* Tests of the kv-store binary: started for real (PIPELINE_BIN_DIR, else the build's bin/) in
 * a scratch run directory, spoken to over its socket with rpc_client as the runner would. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/kv_pool.h"
#include "common/protocol.h"
#include "common/shm.h"
#include "common/util.h"
#include "tests/unit/kv-store/kvtest.h"

#define BB 8192u
#define HASH 0xfeedf00dull

struct svc {
	char dir[256];
	char instance[64];
	char shm[SHM_NAME_MAX];
	char spill[512];
	pid_t pid;
	void *zctx;
	struct rpc_client *c;
};

static void bin_path(char *buf, size_t len)
{
	const char *dir = getenv("PIPELINE_BIN_DIR");
	snprintf(buf, len, "%s/kv-store", dir && *dir ? dir : KVSTORE_BUILD_BIN_DIR);
}

/* Runs kv-store with args (NULL-terminated, after argv[0]); output goes to out_path.
 * Returns the child's pid. The child dies with this test process. */
static pid_t spawn(const char *out_path, const char *const *args)
{
	char bin[512];
	bin_path(bin, sizeof(bin));
	ck_assert_msg(access(bin, X_OK) == 0, "no kv-store binary at %s", bin);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (out_path) {
			int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
			if (fd >= 0) {
				dup2(fd, 1);
				dup2(fd, 2);
			}
		}
		const char *argv[32] = {"kv-store"};
		int n = 1;
		for (; args[n - 1] && n < 31; n++)
			argv[n] = args[n - 1];
		argv[n] = NULL;
		execv(bin, (char *const *)argv);
		_exit(127);
	}
	return pid;
}

/* Waits up to 10 s for pid; returns its exit status (or -1 if it died by a signal). */
static int wait_exit(pid_t pid)
{
	for (int i = 0; i < 1000; i++) {
		int status;
		pid_t r = waitpid(pid, &status, WNOHANG);
		ck_assert_int_ge(r, 0);
		if (r == pid)
			return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
		usleep(10000);
	}
	kill(pid, SIGKILL);
	ck_abort_msg("kv-store %d did not exit", (int)pid);
	return -1;
}

static void svc_names(struct svc *v)
{
	memset(v, 0, sizeof(*v));
	kvt_mkdtemp("/tmp", v->dir, sizeof(v->dir));
	snprintf(v->instance, sizeof(v->instance), "kvt-%d-%d", kvt_runner_pid, (int)getpid());
	ck_assert_int_eq(shm_object_name(v->instance, "kv", v->shm, sizeof(v->shm)), 0);
	snprintf(v->spill, sizeof(v->spill), "%s/kv-spill.bin", v->dir);
	v->zctx = zmq_ctx_new();
	ck_assert_ptr_nonnull(v->zctx);
}

/* Starts kv-store with the test's budgets and extra flags (NULL-terminated; may be NULL),
 * its output to log (NULL: inherited), and waits for HELLO. */
static void svc_start_with(struct svc *v, const char *const *extra, const char *log)
{
	const char *args[32] = {"--instance", v->instance, "--run-dir", v->dir, "--kv-dram-budget", "64KiB",
				"--kv-disk-budget", "256KiB", "--io-depth", "4", "--log-level", "warn"};
	int n = 12;
	for (int i = 0; extra && extra[i] && n < 31; i++)
		args[n++] = extra[i];
	args[n] = NULL;
	v->pid = spawn(log, args);
	v->c = rpc_client_create(v->zctx, v->dir, "kv-store", "test");
	ck_assert_ptr_nonnull(v->c);
	struct msg rep;
	int rc = rpc_wait_ready(v->c, &rep, 10000);
	ck_assert_msg(rc == 0, "kv-store did not answer HELLO: %d", rc);
	ck_assert_uint_eq(rep.type, MSG_HELLO_REPLY);
	ck_assert_str_eq(rep.hello_reply.service.p, "kv-store");
	ck_assert_uint_eq(rep.hello_reply.pid, (uint64_t)v->pid);
	ck_assert_uint_eq(rep.hello_reply.layout, KVPOOL_LAYOUT_VERSION);
	msg_free(&rep);
}

static void svc_start(struct svc *v)
{
	svc_start_with(v, NULL, NULL);
}

static void svc_finish(struct svc *v)
{
	rpc_client_destroy(&v->c);
	zmq_ctx_term(v->zctx);
	kvt_rm_rf(v->dir);
}

/* One request; expects reply type want (MSG_ERROR: then *code gets its code). */
static void call(struct svc *v, struct msg *req, struct msg *rep, uint32_t want)
{
	int rc = rpc_call(v->c, req, rep, 10000);
	ck_assert_msg(rc == 0 || rc == -EREMOTEIO, "%s: rpc_call %d", msg_type_name(req->type), rc);
	ck_assert_msg(rep->type == want, "%s answered %s (%s), wanted %s", msg_type_name(req->type),
		      msg_type_name(rep->type), rep->type == MSG_ERROR ? rep->error.text.p : "",
		      msg_type_name(want));
}

static void call_error(struct svc *v, struct msg *req, int code, const char *needle)
{
	struct msg rep;
	call(v, req, &rep, MSG_ERROR);
	ck_assert_msg(rep.error.code == code, "%s: code %lld (%s), wanted %d", msg_type_name(req->type),
		      (long long)rep.error.code, rep.error.text.p, code);
	ck_assert_msg(strstr(rep.error.text.p, needle), "error '%s' lacks '%s'", rep.error.text.p, needle);
	msg_free(&rep);
}

static void call_ok(struct svc *v, struct msg *req)
{
	struct msg rep;
	call(v, req, &rep, MSG_OK);
	msg_free(&rep);
}

static void configure(struct svc *v, uint64_t block_bytes, struct msg *rep)
{
	struct msg req;
	msg_init(&req, MSG_KV_CONFIGURE, 0);
	req.kv_configure.block_bytes = block_bytes;
	req.kv_configure.manifest_hash = HASH;
	call(v, &req, rep, MSG_KV_POOL);
}

static void handles_req(struct msg *req, uint32_t type, uint64_t *h, uint32_t n)
{
	msg_init(req, type, 0);
	req->kv_handles.handles = (struct u64_array){.v = h, .n = n};
}

static json_t *get_stats(struct svc *v)
{
	struct msg req, rep;
	msg_init(&req, MSG_STATS_GET, 0);
	call(v, &req, &rep, MSG_STATS);
	ck_assert_str_eq(rep.stats.service.p, "kv-store");
	json_error_t je;
	json_t *o = json_loads(rep.stats.json.p, 0, &je);
	ck_assert_msg(o != NULL, "stats are not JSON: %s", rep.stats.json.p);
	msg_free(&rep);
	return o;
}

static long long jint(json_t *o, const char *key)
{
	json_t *x = json_object_get(o, key);
	ck_assert_msg(x != NULL, "stats lack %s", key);
	return json_is_boolean(x) ? json_is_true(x) : json_integer_value(x);
}

/* Allocates n blocks, writes seeds seed0.. into them, commits; handles into h. */
static void put_blocks(struct svc *v, struct kvpool_header *pool, uint64_t *h, uint32_t n, uint64_t seed0)
{
	struct msg req, rep;
	msg_init(&req, MSG_KV_ALLOC, 0);
	req.kv_alloc.count = n;
	call(v, &req, &rep, MSG_KV_BLOCKS);
	ck_assert_uint_eq(rep.kv_blocks.handles.n, n);
	ck_assert_uint_eq(rep.kv_blocks.offsets.n, n);
	for (uint32_t i = 0; i < n; i++) {
		h[i] = rep.kv_blocks.handles.v[i];
		ck_assert_uint_lt(rep.kv_blocks.offsets.v[i], pool->shm.total_size);
		kvt_write_block(pool, rep.kv_blocks.offsets.v[i], seed0 + i);
	}
	msg_free(&rep);
	msg_init(&req, MSG_KV_COMMIT, 0);
	req.kv_commit.handles = (struct u64_array){.v = h, .n = n};
	call_ok(v, &req);
}

/* As put_blocks, committing with keys key0.. */
static void put_keyed_blocks(struct svc *v, struct kvpool_header *pool, uint64_t *h, uint32_t n, uint64_t seed0,
			     uint64_t key0)
{
	struct msg req, rep;
	uint64_t keys[64];
	ck_assert_uint_le(n, 64);
	msg_init(&req, MSG_KV_ALLOC, 0);
	req.kv_alloc.count = n;
	call(v, &req, &rep, MSG_KV_BLOCKS);
	for (uint32_t i = 0; i < n; i++) {
		h[i] = rep.kv_blocks.handles.v[i];
		keys[i] = key0 + i;
		kvt_write_block(pool, rep.kv_blocks.offsets.v[i], seed0 + i);
	}
	msg_free(&rep);
	msg_init(&req, MSG_KV_COMMIT, 0);
	req.kv_commit.handles = (struct u64_array){.v = h, .n = n};
	req.kv_commit.keys = (struct u64_array){.v = keys, .n = n};
	call_ok(v, &req);
}

/* LOOKUP keys key0..key0+n-1 into h (0 for a miss). */
static void lookup_keys(struct svc *v, uint64_t *h, uint32_t n, uint64_t key0)
{
	struct msg req, rep;
	uint64_t keys[64];
	ck_assert_uint_le(n, 64);
	for (uint32_t i = 0; i < n; i++)
		keys[i] = key0 + i;
	msg_init(&req, MSG_KV_LOOKUP, 0);
	req.kv_lookup.keys = (struct u64_array){.v = keys, .n = n};
	call(v, &req, &rep, MSG_KV_BLOCKS);
	ck_assert_uint_eq(rep.kv_blocks.handles.n, n);
	for (uint32_t i = 0; i < n; i++) {
		h[i] = rep.kv_blocks.handles.v[i];
		ck_assert_uint_eq(rep.kv_blocks.offsets.v[i], 0);
	}
	msg_free(&rep);
}

static void free_blocks(struct svc *v, uint64_t *h, uint32_t n)
{
	struct msg req;
	handles_req(&req, MSG_KV_FREE, h, n);
	call_ok(v, &req);
}

static struct rpc_client *runner_hello(struct svc *v, uint64_t session)
{
	struct rpc_client *r = rpc_client_create(v->zctx, v->dir, "kv-store", "gpu-runner");
	ck_assert_ptr_nonnull(r);
	rpc_client_set_session(r, session);
	struct msg rep;
	ck_assert_int_eq(rpc_hello(r, &rep, 5000), 0);
	msg_free(&rep);
	return r;
}

static void shutdown_svc(struct svc *v)
{
	struct msg req;
	msg_init(&req, MSG_SHUTDOWN, 0);
	call_ok(v, &req);
	ck_assert_int_eq(wait_exit(v->pid), 0);
	rpc_client_destroy(&v->c);
	ck_assert_int_eq(shm_open(v->shm, O_RDONLY, 0), -1);
}

static struct kvpool_header *map_pool(struct svc *v, struct shm_object **o)
{
	*o = NULL;
	ck_assert_int_eq(shm_object_attach(v->shm, SHM_KIND_KV_POOL, KVPOOL_LAYOUT_VERSION, true, o), 0);
	return shm_object_base(*o);
}

/* Fetches n blocks, compares them with seeds seed0.., unpins them. */
static void check_blocks(struct svc *v, struct kvpool_header *pool, uint64_t *h, uint32_t n, uint64_t seed0)
{
	struct msg req, rep;
	handles_req(&req, MSG_KV_FETCH, h, n);
	call(v, &req, &rep, MSG_KV_BLOCKS);
	ck_assert_uint_eq(rep.kv_blocks.offsets.n, n);
	for (uint32_t i = 0; i < n; i++) {
		ck_assert_uint_eq(rep.kv_blocks.handles.v[i], h[i]);
		ck_assert_msg(kvt_check((char *)pool + rep.kv_blocks.offsets.v[i], BB, seed0 + i),
			      "block %u read back different", i);
	}
	msg_free(&rep);
	handles_req(&req, MSG_KV_UNPIN, h, n);
	call_ok(v, &req);
}

/* Sends raw frames on a DEALER of our own and collects what comes back for a while. */
static int send_garbage(struct svc *v)
{
	void *d = zmq_socket(v->zctx, ZMQ_DEALER);
	ck_assert_ptr_nonnull(d);
	int linger = 0;
	zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof(linger));
	char ep[300];
	ck_assert_int_eq(bus_endpoint(v->dir, "kv-store", "ctl", ep, sizeof(ep)), 0);
	ck_assert_int_eq(zmq_connect(d, ep), 0);
	unsigned int seed = 12345;
	int sent = 0;
	/* Random frames. */
	for (int i = 0; i < 20; i++) {
		unsigned char buf[256];
		size_t n = (size_t)(rand_r(&seed) % sizeof(buf));
		for (size_t k = 0; k < n; k++)
			buf[k] = (unsigned char)rand_r(&seed);
		ck_assert_int_ge(zmq_send(d, buf, n, 0), 0);
		sent++;
	}
	/* A valid FETCH cut short. */
	struct msg m;
	uint64_t hs[4] = {1, 2, 3, 4};
	handles_req(&m, MSG_KV_FETCH, hs, 4);
	m.corr = 77;
	void *buf;
	size_t len;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), 0);
	ck_assert_int_ge(zmq_send(d, buf, len - 3, 0), 0);
	free(buf);
	sent++;
	/* An unknown message type (999), correlation id 5. */
	const unsigned char unknown[] = {0x94, 0x01, 0xcd, 0x03, 0xe7, 0x05, 0x80};
	ck_assert_int_ge(zmq_send(d, unknown, sizeof(unknown), 0), 0);
	sent++;
	/* A reply type sent as a request (known to the codec, not a request kv-store takes). */
	msg_init(&m, MSG_KV_POOL, 9);
	m.kv_pool.shm_name = (struct bytes){.p = "x", .len = 1};
	ck_assert_int_eq(msg_encode(&m, &buf, &len), 0);
	ck_assert_int_ge(zmq_send(d, buf, len, 0), 0);
	free(buf);
	sent++;
	/* Two frames in one message; an empty frame. */
	ck_assert_int_ge(zmq_send(d, "ab", 2, ZMQ_SNDMORE), 0);
	ck_assert_int_ge(zmq_send(d, "cd", 2, 0), 0);
	ck_assert_int_ge(zmq_send(d, "", 0, 0), 0);
	sent += 2;

	/* Every one is answered with MSG_ERROR (waited for up to 30 s each: a loaded machine may be
	 * slow, and a missing answer still shows as too few errors). */
	int errors = 0, unknown_seen = 0, pool_seen = 0;
	for (;;) {
		struct msg r;
		char err[256];
		int rc = bus_recv(d, &r, 30000, err, sizeof(err));
		if (rc == -ETIMEDOUT)
			break;
		ck_assert_msg(rc == 0, "bad reply: %s", err);
		ck_assert_uint_eq(r.type, MSG_ERROR);
		errors++;
		if (r.corr == 5) {
			unknown_seen = 1;
			ck_assert_int_eq(r.error.code, ENOMSG);
		}
		if (r.corr == 9) {
			pool_seen = 1;
			ck_assert_int_eq(r.error.code, ENOTSUP);
		}
		msg_free(&r);
		if (errors == sent)
			break;
	}
	zmq_close(d);
	ck_assert(unknown_seen);
	ck_assert(pool_seen);
	return errors;
}

START_TEST(test_protocol_round_trip)
{
	struct svc v;
	svc_names(&v);
	svc_start(&v);
	struct msg req, rep;
	/* Before configure HELLO names no pool. */
	ck_assert_int_eq(rpc_hello(v.c, &rep, 5000), 0);
	ck_assert_uint_eq(rep.hello_reply.shm_name.len, 0);
	ck_assert_uint_eq(rep.hello_reply.shm_size, 0);
	msg_free(&rep);
	msg_init(&req, MSG_KV_ALLOC, 0);
	req.kv_alloc.count = 1;
	call_error(&v, &req, EINVAL, "not configured");

	msg_init(&req, MSG_KV_CONFIGURE, 0);
	req.kv_configure.block_bytes = 1000;
	call_error(&v, &req, EINVAL, "multiple of 4096");
	req.kv_configure.block_bytes = 1 << 20;
	call_error(&v, &req, EINVAL, "holds no block of 1048576 bytes");

	configure(&v, BB, &rep);
	ck_assert_str_eq(rep.kv_pool.shm_name.p, v.shm);
	ck_assert_uint_eq(rep.kv_pool.n_blocks, 8);
	ck_assert_uint_eq(rep.kv_pool.block_bytes, BB);
	uint64_t epoch = rep.kv_pool.epoch, size = rep.kv_pool.shm_size;
	msg_free(&rep);
	configure(&v, BB, &rep);
	ck_assert_uint_eq(rep.kv_pool.epoch, epoch);
	msg_free(&rep);
	ck_assert_int_eq(rpc_hello(v.c, &rep, 5000), 0);
	ck_assert_str_eq(rep.hello_reply.shm_name.p, v.shm);
	ck_assert_uint_eq(rep.hello_reply.shm_size, size);
	ck_assert_uint_eq(rep.hello_reply.manifest_hash, HASH);
	msg_free(&rep);

	/* Map the pool as the runner does. */
	struct shm_object *o = NULL;
	ck_assert_int_eq(shm_object_attach(v.shm, SHM_KIND_KV_POOL, KVPOOL_LAYOUT_VERSION, true, &o), 0);
	struct kvpool_header *pool = shm_object_base(o);
	ck_assert_uint_eq(shm_object_size(o), size);

	uint64_t h[2];
	msg_init(&req, MSG_KV_ALLOC, 0);
	req.kv_alloc.count = 2;
	call(&v, &req, &rep, MSG_KV_BLOCKS);
	for (int i = 0; i < 2; i++) {
		h[i] = rep.kv_blocks.handles.v[i];
		kvt_fill((char *)pool + rep.kv_blocks.offsets.v[i], BB, 10 + (uint64_t)i);
	}
	msg_free(&rep);
	/* Commit before the ready flag: EAGAIN. */
	msg_init(&req, MSG_KV_COMMIT, 0);
	req.kv_commit.handles = (struct u64_array){.v = h, .n = 2};
	call_error(&v, &req, EAGAIN, "not ready");
	/* Mark both slots ready the way the runner does. */
	struct kvpool_handle *ht = kvpool_handles(pool);
	for (int i = 0; i < 2; i++)
		atomic_store_explicit(&kvpool_slots(pool)[ht[kv_handle_index(h[i])].where].ready, 1,
				      memory_order_release);
	/* Events and keys are checked. */
	msg_init(&req, MSG_KV_COMMIT, 0);
	req.kv_commit.handles = (struct u64_array){.v = h, .n = 2};
	char ev[2 * KV_EVENT_HANDLE_BYTES] = {0};
	req.kv_commit.events = (struct bytes){.p = ev, .len = sizeof(ev)};
	/* Events without the means to wait on them: no CUDA in this build, or no GPU here. */
#ifdef PIPELINE_HAVE_CUDA
	call_error(&v, &req, ENODEV, "no GPU");
#else
	call_error(&v, &req, ENOTSUP, "built without CUDA");
#endif
	/* ... and a wrong number of event bytes is malformed either way. */
	req.kv_commit.events = (struct bytes){.p = ev, .len = KV_EVENT_HANDLE_BYTES};
	call_error(&v, &req, EINVAL, "bytes of events");
	uint64_t keys[1] = {42};
	req.kv_commit.events = (struct bytes){0};
	req.kv_commit.keys = (struct u64_array){.v = keys, .n = 1};
	call_error(&v, &req, EINVAL, "1 keys for 2 handles");
	/* ... before any event is waited for or block marked ready: a COMMIT refused has done nothing
	 * (here the events would have been refused first, ENODEV / ENOTSUP). */
	req.kv_commit.events = (struct bytes){.p = ev, .len = sizeof(ev)};
	call_error(&v, &req, EINVAL, "1 keys for 2 handles");
	req.kv_commit.events = (struct bytes){0};
	uint64_t keys2[2] = {42, 43};
	req.kv_commit.keys = (struct u64_array){.v = keys2, .n = 2};
	call_ok(&v, &req);
	ck_assert_uint_eq(ht[kv_handle_index(h[1])].key, 43);

	check_blocks(&v, pool, h, 2, 10);
	/* A resent commit (its reply lost) is answered OK. */
	call_ok(&v, &req);
	handles_req(&req, MSG_KV_FREE, h, 2);
	call_ok(&v, &req);
	/* Keyed: cached, so a second FREE finds no reference. */
	char hex[32];
	snprintf(hex, sizeof(hex), "0x%llx", (unsigned long long)h[0]);
	call_error(&v, &req, EINVAL, hex);
	uint64_t lk[3] = {43, 44, 42};
	msg_init(&req, MSG_KV_LOOKUP, 0);
	req.kv_lookup.keys = (struct u64_array){.v = lk, .n = 3};
	call(&v, &req, &rep, MSG_KV_BLOCKS);
	ck_assert_uint_eq(rep.kv_blocks.handles.n, 3);
	ck_assert_uint_eq(rep.kv_blocks.offsets.n, 3);
	ck_assert_uint_eq(rep.kv_blocks.handles.v[0], h[1]);
	ck_assert_uint_eq(rep.kv_blocks.handles.v[1], 0);
	ck_assert_uint_eq(rep.kv_blocks.handles.v[2], h[0]);
	for (int i = 0; i < 3; i++)
		ck_assert_uint_eq(rep.kv_blocks.offsets.v[i], 0);
	msg_free(&rep);
	check_blocks(&v, pool, h, 2, 10);
	handles_req(&req, MSG_KV_FREE, h, 2);
	call_ok(&v, &req);

	/* Enough blocks to spill some, all read back through the socket. */
	uint64_t many[12];
	put_blocks(&v, pool, many, 6, 100);
	put_blocks(&v, pool, many + 6, 6, 200);
	check_blocks(&v, pool, many, 6, 100);
	check_blocks(&v, pool, many + 6, 6, 200);

	json_t *st = get_stats(&v);
	ck_assert_int_eq(jint(st, "allocs"), 14);
	ck_assert_int_eq(jint(st, "commits"), 14);
	ck_assert_int_eq(jint(st, "fetches"), 16);
	ck_assert_int_eq(jint(st, "frees"), 4);
	ck_assert_int_eq(jint(st, "prefix_hits"), 2);
	ck_assert_int_eq(jint(st, "prefix_misses"), 1);
	ck_assert_int_eq(jint(st, "cached_blocks"), 2);
	ck_assert_int_eq(jint(st, "referenced_blocks"), 12);
	ck_assert_int_eq(jint(st, "cache_drops"), 0);
	ck_assert_int_eq(jint(st, "persistent"), 0);
	ck_assert_int_ge(jint(st, "spills"), 4);
	ck_assert_int_ge(jint(st, "fetches_from_disk"), 4);
	ck_assert_int_eq(jint(st, "pool_blocks"), 8);
	ck_assert_int_eq(jint(st, "spill_blocks"), 32);
	ck_assert_int_eq(jint(st, "block_bytes"), BB);
	ck_assert_int_eq(jint(st, "checksum_failures"), 0);
	ck_assert_int_eq(jint(st, "adopted"), 0);
	ck_assert_ptr_nonnull(json_object_get(st, "o_direct"));
	ck_assert_int_eq(jint(st, "spill_bytes_written"), jint(st, "spills") * BB);
	json_decref(st);

	/* Garbage does not hurt it. */
	ck_assert_int_ge(send_garbage(&v), 20);
	msg_init(&req, MSG_PING, 0);
	call_ok(&v, &req);
	check_blocks(&v, pool, many, 6, 100);

	/* UNPIN_ALL drops every pin, here one FETCH left behind. */
	handles_req(&req, MSG_KV_FETCH, many, 1);
	call(&v, &req, &rep, MSG_KV_BLOCKS);
	msg_free(&rep);
	msg_init(&req, MSG_KV_UNPIN_ALL, 0);
	call_ok(&v, &req);
	handles_req(&req, MSG_KV_UNPIN, many, 1);
	call_error(&v, &req, EINVAL, "not pinned");

	/* A new runner (no session) holds nothing: what is still live (here, 12 committed blocks
	 * and one left half-written) belonged to one that died, and is freed; the two cached
	 * blocks stay. */
	msg_init(&req, MSG_KV_ALLOC, 0);
	req.kv_alloc.count = 1;
	call(&v, &req, &rep, MSG_KV_BLOCKS);
	msg_free(&rep);
	struct rpc_client *runner = rpc_client_create(v.zctx, v.dir, "kv-store", "gpu-runner");
	ck_assert_ptr_nonnull(runner);
	ck_assert_int_eq(rpc_hello(runner, &rep, 5000), 0);
	msg_free(&rep);
	rpc_client_destroy(&runner);
	st = get_stats(&v);
	ck_assert_int_eq(jint(st, "live_handles"), 2);
	ck_assert_int_eq(jint(st, "cached_blocks"), 2);
	ck_assert_int_eq(jint(st, "referenced_blocks"), 0);
	ck_assert_int_eq(jint(st, "pool_used") + jint(st, "spill_used"), 2);
	json_decref(st);
	handles_req(&req, MSG_KV_FETCH, many, 1);
	call_error(&v, &req, EINVAL, "stale");

	shm_object_close(&o, false);
	msg_init(&req, MSG_SHUTDOWN, 0);
	call_ok(&v, &req);
	ck_assert_int_eq(wait_exit(v.pid), 0);
	/* Nothing left behind. */
	ck_assert_int_eq(shm_open(v.shm, O_RDONLY, 0), -1);
	ck_assert_int_eq(errno, ENOENT);
	ck_assert_int_eq(access(v.spill, F_OK), -1);
	char sock[512];
	snprintf(sock, sizeof(sock), "%s/kv-store.ctl", v.dir);
	ck_assert_int_eq(access(sock, F_OK), -1);
	svc_finish(&v);
}
END_TEST

START_TEST(test_restart_adopts)
{
	struct svc v;
	svc_names(&v);
	svc_start(&v);
	struct msg req, rep;
	configure(&v, BB, &rep);
	uint64_t epoch = rep.kv_pool.epoch;
	msg_free(&rep);
	struct shm_object *o = NULL;
	ck_assert_int_eq(shm_object_attach(v.shm, SHM_KIND_KV_POOL, KVPOOL_LAYOUT_VERSION, true, &o), 0);
	struct kvpool_header *pool = shm_object_base(o);
	uint64_t h[12];
	put_blocks(&v, pool, h, 6, 500);
	put_blocks(&v, pool, h + 6, 6, 600); /* 4 spilled */

	/* A second kv-store of the same instance refuses to start while the first lives. */
	char out[512];
	snprintf(out, sizeof(out), "%s/second.log", v.dir);
	const char *args[] = {"--instance", v.instance, "--run-dir", v.dir, NULL};
	ck_assert_int_eq(wait_exit(spawn(out, args)), 1);
	msg_init(&req, MSG_PING, 0);
	call_ok(&v, &req);

	/* A signal: the pool and the spill file stay. */
	ck_assert_int_eq(kill(v.pid, SIGTERM), 0);
	ck_assert_int_eq(wait_exit(v.pid), 0);
	ck_assert_int_eq(access(v.spill, F_OK), 0);
	int fd = shm_open(v.shm, O_RDONLY, 0);
	ck_assert_int_ge(fd, 0);
	close(fd);
	rpc_client_destroy(&v.c);

	/* The successor adopts it at start, before any CONFIGURE. */
	svc_start(&v);
	ck_assert_int_eq(rpc_hello(v.c, &rep, 5000), 0);
	ck_assert_str_eq(rep.hello_reply.shm_name.p, v.shm);
	ck_assert_uint_eq(rep.hello_reply.manifest_hash, HASH);
	msg_free(&rep);
	json_t *st = get_stats(&v);
	ck_assert_int_eq(jint(st, "adopted"), 1);
	ck_assert_int_eq(jint(st, "allocs"), 12);
	json_decref(st);
	/* The runner's mapping and handles still work. */
	check_blocks(&v, pool, h, 6, 500);
	check_blocks(&v, pool, h + 6, 6, 600);
	configure(&v, BB, &rep);
	ck_assert_uint_eq(rep.kv_pool.epoch, epoch);
	msg_free(&rep);
	shm_object_close(&o, false);

	msg_init(&req, MSG_SHUTDOWN, 0);
	call_ok(&v, &req);
	ck_assert_int_eq(wait_exit(v.pid), 0);
	ck_assert_int_eq(shm_open(v.shm, O_RDONLY, 0), -1);
	ck_assert_int_eq(access(v.spill, F_OK), -1);
	svc_finish(&v);
}
END_TEST

static int run_flags(const char *dir, const char *const *args, char *out, size_t outlen)
{
	char path[512];
	snprintf(path, sizeof(path), "%s/out.txt", dir);
	int code = wait_exit(spawn(path, args));
	FILE *f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	size_t n = fread(out, 1, outlen - 1, f);
	out[n] = 0;
	fclose(f);
	return code;
}

START_TEST(test_flags)
{
	struct svc v;
	svc_names(&v);
	char out[8192];
	const char *help[] = {"--help", NULL};
	ck_assert_int_eq(run_flags(v.dir, help, out, sizeof(out)), 0);
	ck_assert_ptr_nonnull(strstr(out, "--kv-dram-budget"));
	ck_assert_ptr_nonnull(strstr(out, "PIPELINE_KV_STORE_SPILL_FILE"));
	ck_assert_ptr_nonnull(strstr(out, "--persist-dir"));
	ck_assert_ptr_nonnull(strstr(out, "PIPELINE_KV_STORE_PERSIST_DIR"));
	const char *bogus[] = {"--bogus", NULL};
	ck_assert_int_eq(run_flags(v.dir, bogus, out, sizeof(out)), 2);
	ck_assert_ptr_nonnull(strstr(out, "--bogus"));
	const char *depth[] = {"--io-depth", "0", NULL};
	ck_assert_int_eq(run_flags(v.dir, depth, out, sizeof(out)), 2);
	ck_assert_ptr_nonnull(strstr(out, "--io-depth"));
	const char *size[] = {"--kv-dram-budget", "lots", NULL};
	ck_assert_int_eq(run_flags(v.dir, size, out, sizeof(out)), 2);
	ck_assert_ptr_nonnull(strstr(out, "lots"));
	const char *level[] = {"--log-level", "loud", NULL};
	ck_assert_int_eq(run_flags(v.dir, level, out, sizeof(out)), 2);
	/* A run directory that cannot be made: exit 1 with a message naming it. */
	char file[512], bad[600];
	snprintf(file, sizeof(file), "%s/plainfile", v.dir);
	close(open(file, O_WRONLY | O_CREAT, 0600));
	snprintf(bad, sizeof(bad), "%s/sub", file);
	const char *rundir[] = {"--instance", v.instance, "--run-dir", bad, NULL};
	ck_assert_int_eq(run_flags(v.dir, rundir, out, sizeof(out)), 1);
	ck_assert_ptr_nonnull(strstr(out, bad));
	svc_finish(&v);
}
END_TEST

START_TEST(test_sessions_survive_restart)
{
	struct svc v;
	svc_names(&v);
	svc_start(&v);
	struct msg req, rep;
	configure(&v, BB, &rep);
	msg_free(&rep);
	struct shm_object *o;
	struct kvpool_header *pool = map_pool(&v, &o);
	struct rpc_client *runner = runner_hello(&v, 0x5e551);
	uint64_t h[4], k[2];
	put_blocks(&v, pool, h, 4, 700);
	put_keyed_blocks(&v, pool, k, 2, 800, 0x900);
	/* The runner reconnects (same session): it keeps its blocks. */
	rpc_client_destroy(&runner);
	runner = runner_hello(&v, 0x5e551);
	check_blocks(&v, pool, h, 4, 700);
	/* The kv-store restarts (a signal): the pool, the references and the session are adopted. */
	ck_assert_int_eq(kill(v.pid, SIGTERM), 0);
	ck_assert_int_eq(wait_exit(v.pid), 0);
	rpc_client_destroy(&v.c);
	svc_start(&v);
	rpc_client_destroy(&runner);
	runner = runner_hello(&v, 0x5e551);
	check_blocks(&v, pool, h, 4, 700);
	check_blocks(&v, pool, k, 2, 800);
	json_t *st = get_stats(&v);
	ck_assert_int_eq(jint(st, "adopted"), 1);
	ck_assert_int_eq(jint(st, "referenced_blocks"), 6);
	json_decref(st);
	/* A new runner: the unkeyed blocks go, the keyed ones stay cached. */
	rpc_client_destroy(&runner);
	runner = runner_hello(&v, 0x5e552);
	rpc_client_destroy(&runner);
	handles_req(&req, MSG_KV_FETCH, h, 1);
	call_error(&v, &req, EINVAL, "stale");
	st = get_stats(&v);
	ck_assert_int_eq(jint(st, "live_handles"), 2);
	ck_assert_int_eq(jint(st, "cached_blocks"), 2);
	json_decref(st);
	/* Requests naming the ended session (sent before its runner gave it up, read after the new
	 * HELLO) are refused and do nothing; one naming none (these tests' own) is served below. */
	uint64_t old_keys[2] = {0x900, 0x901};
	msg_init(&req, MSG_KV_LOOKUP, 0);
	req.kv_lookup.keys = (struct u64_array){.v = old_keys, .n = 2};
	req.kv_lookup.session = 0x5e551;
	call_error(&v, &req, ESTALE, "has ended");
	msg_init(&req, MSG_KV_ALLOC, 0);
	req.kv_alloc.count = 1;
	req.kv_alloc.session = 0x5e551;
	call_error(&v, &req, ESTALE, "has ended");
	handles_req(&req, MSG_KV_FREE, k, 1);
	req.kv_handles.session = 0x5e551;
	call_error(&v, &req, ESTALE, "has ended");
	st = get_stats(&v);
	ck_assert_int_eq(jint(st, "referenced_blocks"), 0);
	ck_assert_int_eq(jint(st, "live_handles"), 2);
	json_decref(st);
	/* The current session's are served. */
	msg_init(&req, MSG_KV_ALLOC, 0);
	req.kv_alloc.count = 1;
	req.kv_alloc.session = 0x5e552;
	call(&v, &req, &rep, MSG_KV_BLOCKS);
	ck_assert_uint_eq(rep.kv_blocks.handles.n, 1);
	free_blocks(&v, rep.kv_blocks.handles.v, 1);
	msg_free(&rep);
	uint64_t got[2];
	lookup_keys(&v, got, 2, 0x900);
	ck_assert_uint_eq(got[0], k[0]);
	ck_assert_uint_eq(got[1], k[1]);
	check_blocks(&v, pool, k, 2, 800);
	shm_object_close(&o, false);
	shutdown_svc(&v);
	svc_finish(&v);
}
END_TEST

/* Does the file at path contain needle? */
static bool file_has(const char *path, const char *needle)
{
	char buf[16384];
	FILE *f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	buf[n] = 0;
	fclose(f);
	return strstr(buf, needle) != NULL;
}

START_TEST(test_persist_across_shutdown)
{
	struct svc v;
	svc_names(&v);
	char pdir[300], idx[600], log[512];
	snprintf(pdir, sizeof(pdir), "%s/persist", v.dir);
	snprintf(v.spill, sizeof(v.spill), "%s/kv-spill.bin", pdir);
	snprintf(idx, sizeof(idx), "%s/kv-spill.idx", pdir);
	snprintf(log, sizeof(log), "%s/kv.log", v.dir);
	const char *persist[] = {"--persist-dir", pdir, NULL};
	svc_start_with(&v, persist, NULL);
	struct msg req, rep;
	configure(&v, BB, &rep);
	msg_free(&rep);
	struct shm_object *o;
	struct kvpool_header *pool = map_pool(&v, &o);
	/* 12 keyed blocks through a pool of 8: some spilled, some in the pool at the stop. */
	uint64_t h[12], got[13];
	put_keyed_blocks(&v, pool, h, 6, 1000, 0xa000);
	free_blocks(&v, h, 6);
	put_keyed_blocks(&v, pool, h + 6, 6, 1006, 0xa006);
	free_blocks(&v, h + 6, 6);
	json_t *st = get_stats(&v);
	ck_assert_int_eq(jint(st, "persistent"), 1);
	ck_assert_int_eq(jint(st, "cached_blocks"), 12);
	json_decref(st);
	shm_object_close(&o, false);
	shutdown_svc(&v);
	ck_assert_int_eq(access(v.spill, F_OK), 0);
	ck_assert_int_eq(access(idx, F_OK), 0);

	/* A new kv-store: CONFIGURE loads the index, LOOKUP hits, FETCH returns the same bytes. */
	svc_start_with(&v, persist, NULL);
	configure(&v, BB, &rep);
	msg_free(&rep);
	pool = map_pool(&v, &o);
	lookup_keys(&v, got, 13, 0xa000);
	for (int i = 0; i < 12; i++)
		ck_assert_msg(got[i] != 0, "key %d missed after the restart", i);
	ck_assert_uint_eq(got[12], 0);
	for (int i = 0; i < 12; i++)
		check_blocks(&v, pool, &got[i], 1, 1000 + (uint64_t)i);
	st = get_stats(&v);
	ck_assert_int_eq(jint(st, "prefix_hits"), 12);
	ck_assert_int_eq(jint(st, "prefix_misses"), 1);
	ck_assert_int_eq(jint(st, "fetches_from_disk"), 12);
	ck_assert_int_eq(jint(st, "checksum_failures"), 0);
	json_decref(st);
	free_blocks(&v, got, 12);
	shm_object_close(&o, false);
	shutdown_svc(&v);

	/* A flipped byte in the persisted spill file: caught at FETCH (EIO), the block dropped. */
	svc_start_with(&v, persist, NULL);
	configure(&v, BB, &rep);
	msg_free(&rep);
	pool = map_pool(&v, &o);
	lookup_keys(&v, got, 12, 0xa000);
	struct kvpool_handle *ht = kvpool_handles(pool);
	const struct kvpool_handle *bad = &ht[kv_handle_index(got[5])];
	ck_assert_uint_eq(bad->location, KVLOC_SPILL);
	int fd = open(v.spill, O_RDWR);
	ck_assert_int_ge(fd, 0);
	off_t at = (off_t)bad->where * BB + 4000;
	unsigned char c;
	ck_assert_int_eq(pread(fd, &c, 1, at), 1);
	c ^= 0x01;
	ck_assert_int_eq(pwrite(fd, &c, 1, at), 1);
	close(fd);
	handles_req(&req, MSG_KV_FETCH, &got[5], 1);
	call_error(&v, &req, EIO, "checksum mismatch");
	st = get_stats(&v);
	ck_assert_int_eq(jint(st, "checksum_failures"), 1);
	ck_assert_int_eq(jint(st, "cached_blocks"), 0);
	ck_assert_int_eq(jint(st, "referenced_blocks"), 11);
	json_decref(st);
	uint64_t again;
	lookup_keys(&v, &again, 1, 0xa005);
	ck_assert_uint_eq(again, 0);
	check_blocks(&v, pool, &got[6], 1, 1006);
	shm_object_close(&o, false);
	shutdown_svc(&v);

	/* A kv-store with another disk budget: the index does not match, is discarded with a
	 * log line, and the spill file is truncated. */
	const char *other[] = {"--persist-dir", pdir, "--kv-disk-budget", "128KiB", "--log-level", "info", NULL};
	svc_start_with(&v, other, log);
	configure(&v, BB, &rep);
	msg_free(&rep);
	lookup_keys(&v, got, 12, 0xa000);
	for (int i = 0; i < 12; i++)
		ck_assert_uint_eq(got[i], 0);
	struct stat sst;
	ck_assert_int_eq(stat(v.spill, &sst), 0);
	ck_assert_int_eq(sst.st_size, 0);
	ck_assert_msg(file_has(log, "discarded"), "no log line about the discarded index");
	shutdown_svc(&v);

	/* --persist-dir and --spill-file exclude each other. */
	char out[4096];
	const char *both[] = {"--persist-dir", pdir, "--spill-file", v.spill, NULL};
	ck_assert_int_eq(run_flags(v.dir, both, out, sizeof(out)), 2);
	ck_assert_ptr_nonnull(strstr(out, "--persist-dir"));
	svc_finish(&v);
}
END_TEST

static Suite *service_suite(void)
{
	Suite *s = suite_create("kvstore_service");
	TCase *tc = kvt_tcase(s, "protocol");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_protocol_round_trip);

	tc = kvt_tcase(s, "restart");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_restart_adopts);

	tc = kvt_tcase(s, "sessions");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_sessions_survive_restart);

	tc = kvt_tcase(s, "persistence");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_persist_across_shutdown);

	tc = kvt_tcase(s, "flags");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_flags);
	return s;
}

int main(void)
{
	return kvt_main(service_suite());
}

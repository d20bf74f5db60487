/* test_remote.c - the runner's side of the other services (weights_ring.c, kv_remote.c)
 * against a scripted peer: a thread that binds the service's socket and answers the way a
 * broken or hostile ssd-loader or kv-store might. The shared memory is real: a weight ring
 * laid out by the loader's own ring.c, a KV pool by the kv-store's pool.c.
 *
 * Everything a peer says is checked: an error whose code does not fit an errno must not
 * read as success, and a grant must not point the runner outside the ring it mapped. */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/kv_pool.h"
#include "common/log.h"
#include "common/shm.h"
#include "common/weight_ring.h"
#include "services/gpu-runner/kv_remote.h"
#include "services/gpu-runner/weights_ring.h"
#include "services/kv-store/pool.h"
#include "services/ssd-loader/plan.h"
#include "services/ssd-loader/ring.h"
#include "tests/unit/ssd-loader/loader_test_util.h"

#define TIMEOUT_MS 5000
#define BIG_CODE (1ll << 32) /* (int) of it is 0 */

/* Every name a test makes starts "rt-<runner pid>-", so the unchecked teardown (which runs in
 * the runner even when a forked test failed half-way) removes what a test left behind. */
static int runner_pid;

static char *scratch_dir(void)
{
	char *dir = malloc(64);
	ck_assert_ptr_nonnull(dir);
	snprintf(dir, 64, "/tmp/rt-%d-XXXXXX", runner_pid);
	ck_assert_ptr_nonnull(mkdtemp(dir));
	return dir;
}

static void shm_name_for(char *buf, size_t len, const char *what)
{
	snprintf(buf, len, "/rt-%d-%d-%s", runner_pid, (int)getpid(), what);
}

static void sweep(const char *dir, const char *prefix)
{
	DIR *d = opendir(dir);
	if (!d)
		return;
	struct dirent *e;
	while ((e = readdir(d))) {
		char path[512];
		if (strncmp(e->d_name, prefix, strlen(prefix)) != 0 ||
		    snprintf(path, sizeof(path), "%s/%s", dir, e->d_name) >= (int)sizeof(path))
			continue;
		th_rmtree(path);
	}
	closedir(d);
}

static void sweep_all(void)
{
	char prefix[32];
	snprintf(prefix, sizeof(prefix), "rt-%d-", runner_pid);
	sweep("/tmp", prefix);
	sweep("/dev/shm", prefix);
}

/* ---- the scripted peer ---- */

struct peer {
	void *zctx, *router;
	pthread_t thread;
	atomic_bool stop;
	/* the script, set before start */
	int64_t error_code;	    /* non-zero: answer every request but HELLO with MSG_ERROR{code} */
	uint32_t silent_type;	    /* non-zero: never answer a request of this type (a peer that hangs) */
	struct wring_header *ring;  /* ssd-loader: grants point at the slots that hold each group */
	const struct kvstore *kv;   /* kv-store: MSG_KV_CONFIGURE answers with this pool */
	struct kvstore *kv_rw;	    /* ... and MSG_KV_ALLOC, MSG_KV_FREE take and give its blocks */
	pid_t die_after_alloc;	    /* non-zero: an ALLOC is done, then not answered, and the pool's
				     * owner becomes this (dead) pid: a kv-store that died before it
				     * answered */
	atomic_uint requests;
	atomic_uint allocs, frees;  /* MSG_KV_ALLOC, MSG_KV_FREE answered */
	atomic_uint last_alloc, last_free; /* the blocks the last of each asked for */
	atomic_uint lookups, most_keys;	   /* MSG_KV_LOOKUP answered (the real pool's), most keys in one */
};

static void peer_answer(struct peer *p, const struct bus_peer *who, const struct msg *req)
{
	struct msg rep;
	if (req->type == MSG_HELLO) {
		msg_init(&rep, MSG_HELLO_REPLY, req->corr);
		rep.hello_reply.service = (struct bytes){.p = "peer", .len = 4};
		rep.hello_reply.shm_name = (struct bytes){.p = "", .len = 0};
		bus_reply(p->router, who, &rep);
		return;
	}
	switch (req->type) {
	case MSG_W_ACQUIRE: {
		struct wring_slot *slots = wring_slots(p->ring);
		for (uint32_t i = 0; i < req->w_acquire.groups.n; i++) {
			uint64_t g = req->w_acquire.groups.v[i];
			for (uint32_t s = 0; s < p->ring->n_slots; s++) {
				if (atomic_load(&slots[s].group) != g)
					continue;
				msg_init(&rep, MSG_W_GRANT, req->corr);
				rep.w_grant = (struct msg_w_grant){.group = g,
								   .slot = s,
								   .generation = atomic_load(&slots[s].generation),
								   .offset = slots[s].data_offset,
								   .bytes = wring_groups(p->ring)[g].slot_bytes};
				bus_reply(p->router, who, &rep);
				break;
			}
		}
		return;
	}
	case MSG_KV_CONFIGURE: {
		struct kvstore_info info;
		kvstore_info(p->kv, &info);
		msg_init(&rep, MSG_KV_POOL, req->corr);
		rep.kv_pool.shm_name = (struct bytes){.p = (char *)info.shm_name, .len = (uint32_t)strlen(info.shm_name)};
		rep.kv_pool.shm_size = info.shm_size;
		rep.kv_pool.n_blocks = info.n_slots;
		rep.kv_pool.block_bytes = info.block_bytes;
		rep.kv_pool.epoch = info.epoch;
		bus_reply(p->router, who, &rep);
		return;
	}
	case MSG_KV_ALLOC:
		if (p->kv_rw) {
			uint32_t n = (uint32_t)req->kv_alloc.count;
			uint64_t handles[256], offsets[256];
			char err[256];
			int rc = n <= 256 ? kvstore_alloc(p->kv_rw, n, handles, offsets, err, sizeof(err)) : -EINVAL;
			atomic_fetch_add(&p->allocs, 1);
			atomic_store(&p->last_alloc, n);
			if (rc == 0 && p->die_after_alloc) {
				atomic_store(&kvstore_header(p->kv_rw)->shm.owner_pid, (int32_t)p->die_after_alloc);
				return;
			}
			if (rc) {
				bus_reply_error(p->router, who, req->corr, -rc, n <= 256 ? err : "too many");
				return;
			}
			msg_init(&rep, MSG_KV_BLOCKS, req->corr);
			rep.kv_blocks.handles = (struct u64_array){.v = handles, .n = n};
			rep.kv_blocks.offsets = (struct u64_array){.v = offsets, .n = n};
			bus_reply(p->router, who, &rep);
			return;
		}
		break;
	case MSG_KV_COMMIT:
		if (p->kv_rw) {
			const struct msg_kv_commit *c = &req->kv_commit;
			char err[256];
			int rc = kvstore_commit(p->kv_rw, c->handles.v, c->keys.n ? c->keys.v : NULL, c->handles.n, err,
						sizeof(err));
			if (rc) {
				bus_reply_error(p->router, who, req->corr, -rc, err);
				return;
			}
		}
		break;
	case MSG_KV_LOOKUP:
		if (p->kv_rw) {
			const struct u64_array *k = &req->kv_lookup.keys;
			uint64_t *h = malloc(sizeof(uint64_t) * (k->n ? k->n : 1));
			uint64_t *off = calloc(k->n ? k->n : 1, sizeof(uint64_t));
			char err[256] = "out of memory";
			int rc = h && off ? kvstore_lookup(p->kv_rw, k->v, k->n, h, err, sizeof(err)) : -ENOMEM;
			atomic_fetch_add(&p->lookups, 1);
			if (k->n > atomic_load(&p->most_keys))
				atomic_store(&p->most_keys, k->n);
			if (rc) {
				bus_reply_error(p->router, who, req->corr, -rc, err);
			} else {
				msg_init(&rep, MSG_KV_BLOCKS, req->corr);
				rep.kv_blocks.handles = (struct u64_array){.v = h, .n = k->n};
				rep.kv_blocks.offsets = (struct u64_array){.v = off, .n = k->n};
				bus_reply(p->router, who, &rep);
			}
			free(h);
			free(off);
			return;
		}
		break;
	case MSG_KV_FREE:
		if (p->kv_rw) {
			char err[256];
			int rc = kvstore_free(p->kv_rw, req->kv_handles.handles.v, req->kv_handles.handles.n, err,
					      sizeof(err));
			atomic_fetch_add(&p->frees, 1);
			atomic_store(&p->last_free, req->kv_handles.handles.n);
			if (rc) {
				bus_reply_error(p->router, who, req->corr, -rc, err);
				return;
			}
		}
		break;
	default:
		break;
	}
	msg_init(&rep, MSG_OK, req->corr);
	bus_reply(p->router, who, &rep);
}

static void *peer_main(void *arg)
{
	struct peer *p = arg;
	while (!atomic_load(&p->stop)) {
		zmq_pollitem_t it = {.socket = p->router, .events = ZMQ_POLLIN};
		if (zmq_poll(&it, 1, 20) <= 0)
			continue;
		struct bus_peer who;
		struct msg req;
		char err[256];
		if (bus_recv_request(p->router, &who, &req, NULL, err, sizeof(err)) != 0)
			continue;
		atomic_fetch_add(&p->requests, 1);
		if (p->silent_type && req.type == p->silent_type) {
			msg_free(&req);
			continue;
		}
		if (req.type != MSG_HELLO && p->error_code) {
			/* By hand: bus_reply_error takes an int, the wire an int64. */
			struct msg rep;
			msg_init(&rep, MSG_ERROR, req.corr);
			rep.error.code = p->error_code;
			rep.error.text = (struct bytes){.p = "scripted failure", .len = 16};
			bus_reply(p->router, &who, &rep);
		} else {
			peer_answer(p, &who, &req);
		}
		msg_free(&req);
	}
	return NULL;
}

static void peer_start(struct peer *p, const char *dir, const char *service)
{
	char ep[300];
	ck_assert_int_eq(bus_endpoint(dir, service, "ctl", ep, sizeof(ep)), 0);
	p->zctx = zmq_ctx_new();
	ck_assert_ptr_nonnull(p->zctx);
	p->router = bus_bind_router(p->zctx, ep);
	ck_assert_ptr_nonnull(p->router);
	ck_assert_int_eq(pthread_create(&p->thread, NULL, peer_main, p), 0);
}

static void peer_stop(struct peer *p)
{
	atomic_store(&p->stop, true);
	pthread_join(p->thread, NULL);
	zmq_close(p->router);
	zmq_ctx_term(p->zctx);
}

/* ---- a weight ring as the ssd-loader lays it out, every group in its slot ---- */

struct ring_fx {
	char *dir, *model;
	struct manifest *m;
	struct plan *plan;
	struct shm_object *obj;
	struct wring_header *h;
	char name[SHM_NAME_MAX];
};

static void ring_fx_open(struct ring_fx *f)
{
	memset(f, 0, sizeof(*f));
	f->dir = scratch_dir();
	f->model = lt_make_model(f->dir, 2);
	f->m = lt_load(f->model);
	char err[512];
	ck_assert_msg(plan_create(f->m, 1ull << 40, &f->plan, err, sizeof(err)) == 0, "%s", err);
	ck_assert(plan_all_resident(f->plan));
	shm_name_for(f->name, sizeof(f->name), "ring");
	ck_assert_msg(ring_create(f->name, f->m, f->plan, &f->obj, err, sizeof(err)) == 0, "%s", err);
	shm_object_set_ready(f->obj);
	f->h = shm_object_base(f->obj);
	struct wring_slot *slots = wring_slots(f->h);
	/* Loaded, as far as anyone reading the tables can tell (seq even, READY). */
	for (uint32_t s = 0; s < f->h->n_slots; s++) {
		atomic_store(&slots[s].group, plan_slot_group(f->plan, s));
		atomic_store(&slots[s].state, WSLOT_READY);
		atomic_store(&slots[s].generation, 1);
	}
}

static void ring_fx_close(struct ring_fx *f)
{
	shm_object_close(&f->obj, true);
	plan_destroy(&f->plan);
	manifest_destroy(&f->m);
	th_rmtree(f->dir);
	free(f->model);
	free(f->dir);
}

static struct msg_hello_reply ring_hello(struct ring_fx *f)
{
	return (struct msg_hello_reply){.layout = WRING_LAYOUT_VERSION,
					.manifest_hash = f->h->manifest_hash,
					.shm_name = {.p = f->name, .len = (uint32_t)strlen(f->name)}};
}

START_TEST(ring_source_takes_a_good_loader)
{
	/* The control case: the same script with honest answers works. */
	struct ring_fx f;
	ring_fx_open(&f);
	struct peer p = {.ring = f.h};
	peer_start(&p, f.dir, "ssd-loader");
	void *zctx = zmq_ctx_new();
	struct rpc_client *c = rpc_client_create(zctx, f.dir, "ssd-loader", "gpu-runner");
	ck_assert_ptr_nonnull(c);
	struct msg_hello_reply hello = ring_hello(&f);
	struct ring_source *rs = NULL;
	char err[512] = "";
	int rc = ring_source_create(c, &hello, TIMEOUT_MS, NULL, NULL, NULL, &rs, err, sizeof(err));
	ck_assert_msg(rc == 0, "ring_source_create: %s", err);
	struct weight_source *ws = ring_source_base(rs);
	struct group_weights w;
	ck_assert_int_eq(ws->ops->acquire(ws, 1, &w), 0);
	ck_assert_int_eq(ws->ops->release(ws, 1), 0);
	ring_source_destroy(&rs);
	rpc_client_destroy(&c);
	zmq_ctx_term(zctx);
	peer_stop(&p);
	ring_fx_close(&f);
}
END_TEST

/* The wait hook the runner beats with: counts its calls, and asks to stop after stop_after (0:
 * never). */
struct hook_count {
	unsigned calls, stop_after;
};

static bool count_hook(void *ctx)
{
	struct hook_count *h = ctx;
	h->calls++;
	return h->stop_after && h->calls >= h->stop_after;
}

START_TEST(ring_source_beats_while_a_release_is_not_answered)
{
	/* A loader that grants but never answers a release (one being killed, say): the release waits
	 * in slices with the hook between them (the runner's heartbeat), and ends after the timeout
	 * instead of blocking silently. */
	struct ring_fx f;
	ring_fx_open(&f);
	f.h->all_resident = 0; /* so the layer groups stream (not pinned), and a release is sent */
	for (uint32_t g = 0; g < f.h->n_groups; g++)
		if (wring_groups(f.h)[g].kind != GROUP_EMBED && wring_groups(f.h)[g].kind != GROUP_HEAD)
			atomic_store(&wring_group_state(f.h)[g].pinned, 0);
	struct peer p = {.ring = f.h, .silent_type = MSG_W_RELEASE};
	peer_start(&p, f.dir, "ssd-loader");
	void *zctx = zmq_ctx_new();
	struct rpc_client *c = rpc_client_create(zctx, f.dir, "ssd-loader", "gpu-runner");
	ck_assert_ptr_nonnull(c);
	struct msg_hello_reply hello = ring_hello(&f);
	struct ring_source *rs = NULL;
	struct hook_count hc = {0};
	char err[512] = "";
	int rc = ring_source_create(c, &hello, 700, NULL, count_hook, &hc, &rs, err, sizeof(err));
	ck_assert_msg(rc == 0, "ring_source_create: %s", err);
	struct weight_source *ws = ring_source_base(rs);
	struct group_weights w;
	ck_assert_int_eq(ws->ops->acquire(ws, 1, &w), 0);
	unsigned before = hc.calls;
	ck_assert_int_eq(ws->ops->release_all(ws), -ETIMEDOUT);
	ck_assert_msg(hc.calls - before >= 4, "the hook ran %u times in a 700 ms wait", hc.calls - before);
	ck_assert_msg(strstr(ws->error, "did not answer a release"), "error: %s", ws->error);
	/* A stop asked for during the wait ends it at once. */
	ck_assert_int_eq(ws->ops->acquire(ws, 1, &w), 0);
	hc = (struct hook_count){.stop_after = 1};
	ck_assert_int_eq(ws->ops->release_all(ws), -ECANCELED);
	ck_assert_msg(strstr(ws->error, "gpu-runner is stopping"), "error: %s", ws->error);
	ring_source_destroy(&rs);
	rpc_client_destroy(&c);
	zmq_ctx_term(zctx);
	peer_stop(&p);
	ring_fx_close(&f);
}
END_TEST

START_TEST(ring_source_refuses_an_error_code_beyond_int)
{
	/* MSG_ERROR{code = 2^32}: (int) of it is 0, which must not read as "granted". */
	struct ring_fx f;
	ring_fx_open(&f);
	struct peer p = {.ring = f.h, .error_code = BIG_CODE};
	peer_start(&p, f.dir, "ssd-loader");
	void *zctx = zmq_ctx_new();
	struct rpc_client *c = rpc_client_create(zctx, f.dir, "ssd-loader", "gpu-runner");
	struct msg_hello_reply hello = ring_hello(&f);
	struct ring_source *rs = NULL;
	char err[512] = "";
	int rc = ring_source_create(c, &hello, TIMEOUT_MS, NULL, NULL, NULL, &rs, err, sizeof(err));
	ck_assert_msg(rc < 0 && rs == NULL, "a refused acquire made a ring source (rc %d)", rc);
	ck_assert_msg(strstr(err, "scripted failure") != NULL, "the error says what the loader said: %s", err);
	rpc_client_destroy(&c);
	zmq_ctx_term(zctx);
	peer_stop(&p);
	ring_fx_close(&f);
}
END_TEST

START_TEST(ring_source_refuses_a_grant_outside_the_ring)
{
	/* The loader's slot table says a slot's data lies past the end of the object, and the
	 * grant agrees: the runner must not take it (it would read outside its mapping). */
	struct ring_fx f;
	ring_fx_open(&f);
	struct wring_slot *slots = wring_slots(f.h);
	slots[1].data_offset = shm_object_size(f.obj);
	struct peer p = {.ring = f.h};
	peer_start(&p, f.dir, "ssd-loader");
	void *zctx = zmq_ctx_new();
	struct rpc_client *c = rpc_client_create(zctx, f.dir, "ssd-loader", "gpu-runner");
	struct msg_hello_reply hello = ring_hello(&f);
	struct ring_source *rs = NULL;
	char err[512] = "";
	int rc = ring_source_create(c, &hello, TIMEOUT_MS, NULL, NULL, NULL, &rs, err, sizeof(err));
	ck_assert_msg(rc == -EPROTO && rs == NULL, "a grant outside the ring was taken (rc %d)", rc);
	ck_assert_msg(strstr(err, "slot 1") != NULL, "the error names the slot: %s", err);
	rpc_client_destroy(&c);
	zmq_ctx_term(zctx);
	peer_stop(&p);
	ring_fx_close(&f);
}
END_TEST

/* ---- the KV pool ---- */

struct pool_fx {
	char *dir;
	char shm[64], spill[512];
	struct kvstore *kv;
};

/* A pool of n_blocks blocks of 4096 bytes. */
static void pool_fx_open_n(struct pool_fx *f, uint64_t n_blocks)
{
	memset(f, 0, sizeof(*f));
	f->dir = scratch_dir();
	shm_name_for(f->shm, sizeof(f->shm), "kv");
	snprintf(f->spill, sizeof(f->spill), "%s/kv-spill.bin", f->dir);
	struct kvstore_config cfg = {.shm_name = f->shm, .spill_path = f->spill, .dram_budget = n_blocks * 4096,
				     .disk_budget = 4 * 4096, .io_depth = 4};
	ck_assert_int_eq(kvstore_create(&cfg, &f->kv), 0);
	char err[512];
	ck_assert_msg(kvstore_configure(f->kv, 4096, 77, err, sizeof(err)) == 0, "%s", err);
}

static void pool_fx_open(struct pool_fx *f)
{
	pool_fx_open_n(f, 4);
}

static void pool_fx_close(struct pool_fx *f)
{
	kvstore_destroy(&f->kv, true);
	th_rmtree(f->dir);
	free(f->dir);
}

START_TEST(kv_connect_refuses_an_error_code_beyond_int)
{
	struct pool_fx f;
	pool_fx_open(&f);
	struct peer p = {.kv = f.kv, .error_code = BIG_CODE};
	peer_start(&p, f.dir, "kv-store");
	void *zctx = zmq_ctx_new();
	struct rpc_client *c = rpc_client_create(zctx, f.dir, "kv-store", "gpu-runner");
	struct kv_remote kr = {0};
	char err[512] = "";
	bool same = true;
	int rc = kv_remote_connect(&kr, c, 4096, 77, TIMEOUT_MS, &same, err, sizeof(err));
	ck_assert_msg(rc < 0, "a refused configure read as connected (rc %d)", rc);
	ck_assert(!kv_remote_owner_alive(&kr));
	kv_remote_disconnect(&kr);
	rpc_client_destroy(&c);
	zmq_ctx_term(zctx);
	peer_stop(&p);
	pool_fx_close(&f);
}
END_TEST

START_TEST(kv_connect_beats_while_the_configuration_is_not_answered)
{
	/* A kv-store that answered HELLO and hangs before the pool configuration: the runner's hook
	 * runs while it waits, the wait ends after the configuration's own wait (longer than the calls'
	 * timeout: the store makes the pool then, and a 1 GiB pool took 445 ms on a loaded host where
	 * the runner's --timeout-ms was 300), and a stop ends it at once. */
	struct pool_fx f;
	pool_fx_open(&f);
	struct peer p = {.kv = f.kv, .silent_type = MSG_KV_CONFIGURE};
	peer_start(&p, f.dir, "kv-store");
	void *zctx = zmq_ctx_new();
	struct rpc_client *c = rpc_client_create(zctx, f.dir, "kv-store", "gpu-runner");
	struct kv_remote kr = {0};
	struct hook_count hc = {0};
	kr.wait_hook = count_hook;
	kr.wait_ctx = &hc;
	kr.configure_wait_ms = 700;
	char err[512] = "";
	ck_assert_int_eq(kv_remote_connect(&kr, c, 4096, 77, 100, NULL, err, sizeof(err)), -ETIMEDOUT);
	ck_assert_msg(hc.calls >= 4, "the hook ran %u times in a 700 ms wait", hc.calls);
	ck_assert_int_eq(kr.timeout_ms, 100); /* the calls after it wait as long as they did */
	ck_assert_msg(strstr(err, "did not answer the pool configuration"), "error: %s", err);
	hc = (struct hook_count){.stop_after = 2};
	ck_assert_int_eq(kv_remote_connect(&kr, c, 4096, 77, 5000, NULL, err, sizeof(err)), -ECANCELED);
	ck_assert_msg(strstr(err, "gpu-runner is stopping"), "error: %s", err);
	kv_remote_disconnect(&kr);
	rpc_client_destroy(&c);
	zmq_ctx_term(zctx);
	peer_stop(&p);
	pool_fx_close(&f);
}
END_TEST

/* A child process that waits for a signal (killed by the test: a kv-store that dies). */
static pid_t paused_child(void)
{
	pid_t child = fork();
	ck_assert_int_ge(child, 0);
	if (child == 0) {
		pause();
		_exit(0);
	}
	return child;
}

START_TEST(kv_connect_notices_a_kv_store_that_died_before_the_configuration)
{
	/* A kv-store that answered HELLO (its pid in the reply) and died before the pool
	 * configuration: there is no pool to look at yet, so its pid is, and the wait ends at once
	 * as a death rather than after the whole timeout. Pids that cannot be a process's are not
	 * taken. */
	struct pool_fx f;
	pool_fx_open(&f);
	pid_t child = paused_child();
	struct peer p = {.kv = f.kv, .silent_type = MSG_KV_CONFIGURE};
	peer_start(&p, f.dir, "kv-store");
	void *zctx = zmq_ctx_new();
	struct rpc_client *c = rpc_client_create(zctx, f.dir, "kv-store", "gpu-runner");
	struct kv_remote kr = {0};
	kv_remote_set_peer(&kr, 0);
	ck_assert_int_eq(kr.peer_pid, 0);
	kv_remote_set_peer(&kr, (uint64_t)INT_MAX + 1);
	ck_assert_int_eq(kr.peer_pid, 0);
	kv_remote_set_peer(&kr, (uint64_t)child);
	ck_assert_int_eq(kr.peer_pid, child);
	ck_assert_int_eq(kill(child, SIGKILL), 0);
	ck_assert_int_eq(waitpid(child, NULL, 0), child);
	char err[512] = "";
	ck_assert_int_eq(kv_remote_connect(&kr, c, 4096, 77, 60000, NULL, err, sizeof(err)), -ECONNRESET);
	ck_assert_msg(strstr(err, "the kv-store process died"), "error: %s", err);
	/* Alive (this process stands in for it): the timeout ends the wait, as before. */
	kv_remote_set_peer(&kr, (uint64_t)getpid());
	kr.configure_wait_ms = 500;
	ck_assert_int_eq(kv_remote_connect(&kr, c, 4096, 77, 500, NULL, err, sizeof(err)), -ETIMEDOUT);
	kv_remote_disconnect(&kr);
	rpc_client_destroy(&c);
	zmq_ctx_term(zctx);
	peer_stop(&p);
	pool_fx_close(&f);
}
END_TEST

START_TEST(kv_ops_refuse_an_error_code_beyond_int)
{
	struct pool_fx f;
	pool_fx_open(&f);
	struct peer p = {.kv = f.kv};
	peer_start(&p, f.dir, "kv-store");
	void *zctx = zmq_ctx_new();
	struct rpc_client *c = rpc_client_create(zctx, f.dir, "kv-store", "gpu-runner");
	struct kv_remote kr = {0};
	char err[512] = "";
	int rc = kv_remote_connect(&kr, c, 4096, 77, TIMEOUT_MS, NULL, err, sizeof(err));
	ck_assert_msg(rc == 0, "connect: %s", err);
	/* From here on every request is refused with a code beyond int. */
	peer_stop(&p);
	struct peer q = {.kv = f.kv, .error_code = BIG_CODE};
	peer_start(&q, f.dir, "kv-store");
	uint64_t h = kv_handle_make(0, 1);
	/* An unpin is write-behind: its refusal comes out of the next request, as a negative code. */
	rc = kv_remote_ops_pool.unpin(&kr, 1, &h);
	ck_assert_int_eq(rc, 0);
	rc = kv_remote_ops_pool.release(&kr, 1, &h);
	ck_assert_msg(rc < 0, "a refused unpin read as done (rc %d)", rc);
	ck_assert_ptr_nonnull(strstr(kv_remote_ops_pool.error(&kr), "unpin"));
	ck_assert_ptr_nonnull(strstr(kv_remote_ops_pool.error(&kr), "scripted failure"));
	rc = kv_remote_ops_pool.release(&kr, 1, &h);
	ck_assert_msg(rc < 0, "a refused free read as done (rc %d)", rc);
	ck_assert_ptr_nonnull(strstr(kv_remote_ops_pool.error(&kr), "scripted failure"));
	kv_remote_disconnect(&kr);
	rpc_client_destroy(&c);
	zmq_ctx_term(zctx);
	peer_stop(&q);
	pool_fx_close(&f);
}
END_TEST

/* A kv_remote connected to a scripted kv-store whose ALLOC, COMMIT and FREE are a real pool's
 * (n_blocks blocks of 4096 bytes). */
struct kv_fx {
	struct pool_fx f;
	struct peer p;
	void *zctx;
	struct rpc_client *c;
	struct kv_remote kr;
};

static void kv_fx_open(struct kv_fx *x, uint64_t n_blocks)
{
	memset(x, 0, sizeof(*x));
	pool_fx_open_n(&x->f, n_blocks);
	x->p.kv = x->f.kv;
	x->p.kv_rw = x->f.kv;
	peer_start(&x->p, x->f.dir, "kv-store");
	x->zctx = zmq_ctx_new();
	x->c = rpc_client_create(x->zctx, x->f.dir, "kv-store", "gpu-runner");
	char err[512] = "";
	ck_assert_msg(kv_remote_connect(&x->kr, x->c, 4096, 77, TIMEOUT_MS, NULL, err, sizeof(err)) == 0, "connect: %s",
		      err);
}

static void kv_fx_close(struct kv_fx *x)
{
	kv_remote_disconnect(&x->kr);
	rpc_client_destroy(&x->c);
	zmq_ctx_term(x->zctx);
	peer_stop(&x->p);
	pool_fx_close(&x->f);
}

/* A connect to the same pool hands the stash back: the FREE request number `frees`, of the
 * stash's KV_STASH_BLOCKS - 1 blocks. */
static void reconnect_frees_the_stash(struct kv_fx *x, unsigned frees)
{
	char err[512] = "";
	bool same = false;
	ck_assert_msg(kv_remote_connect(&x->kr, x->c, 4096, 77, TIMEOUT_MS, &same, err, sizeof(err)) == 0, "%s", err);
	ck_assert(same);
	ck_assert_uint_eq(atomic_load(&x->p.frees), frees);
	ck_assert_uint_eq(atomic_load(&x->p.last_free), KV_STASH_BLOCKS - 1);
	ck_assert_uint_eq(x->kr.n_stash, 0);
}

/* Decode commits a block or two a layer: those come from blocks allocated ahead, 64 an ALLOC, so a
 * layer's allocation sends no request (which would wait for the commits before it); larger requests
 * go as they are, a nearly full pool gives no more than it has free, and the stash goes back when
 * asked (an idle runner) or on a reconnect to the same pool. */
/* A reconnect that fails part way (a kv-store that adopted the pool died before it answered the
 * configuration) does not make the runner forget which pool it had: the next kv-store that adopts
 * the same pool is the same pool (its blocks and the runner's handles stay good). */
START_TEST(kv_reconnect_after_a_failed_one_is_the_same_pool)
{
	struct kv_fx x;
	kv_fx_open(&x, 64);
	char err[512] = "";
	bool same = true;
	peer_stop(&x.p);
	x.p.stop = false;
	x.p.silent_type = MSG_KV_CONFIGURE;
	peer_start(&x.p, x.f.dir, "kv-store");
	x.kr.configure_wait_ms = 500;
	ck_assert_int_eq(kv_remote_connect(&x.kr, x.c, 4096, 77, 500, &same, err, sizeof(err)), -ETIMEDOUT);
	peer_stop(&x.p);
	x.p.stop = false;
	x.p.silent_type = 0;
	peer_start(&x.p, x.f.dir, "kv-store");
	ck_assert_msg(kv_remote_connect(&x.kr, x.c, 4096, 77, TIMEOUT_MS, &same, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(same, "the pool of the connection before the failed one read as a new pool");
	kv_fx_close(&x);
}
END_TEST

/* A kv-store that did a request and died before it answered: an ALLOC granted in the pool that
 * the next kv-store adopts, with its reference, under the runner's session. The runner cannot know
 * what the request took, so the reply counts as given up (kv_remote.orphans: its next connection
 * says HELLO with a new session, which makes the store let go of what the old one held), as when
 * a reply is given up while the store lives. */
START_TEST(kv_request_done_by_a_kv_store_that_died_leaves_orphans)
{
	struct kv_fx x;
	kv_fx_open(&x, 64);
	pid_t child = paused_child();
	ck_assert_int_eq(kill(child, SIGKILL), 0);
	ck_assert_int_eq(waitpid(child, NULL, 0), child);
	struct kvpool_header *hd = kvstore_header(x.f.kv);
	const uint64_t allocs = atomic_load(&hd->store.allocs);
	peer_stop(&x.p);
	x.p.stop = false;
	x.p.die_after_alloc = child;
	peer_start(&x.p, x.f.dir, "kv-store");
	uint64_t h;
	void *ptr;
	ck_assert_int_ne(kv_remote_ops_pool.alloc(&x.kr, 1, &h, &ptr), 0);
	ck_assert_ptr_nonnull(strstr(kv_remote_ops_pool.error(&x.kr), "the kv-store process died"));
	ck_assert_uint_gt(atomic_load(&hd->store.allocs), allocs); /* the store took the blocks */
	ck_assert_msg(x.kr.orphans, "a request the dead kv-store did is not counted as given up");
	ck_assert(kv_remote_lost(&x.kr));
	atomic_store(&hd->shm.owner_pid, (int32_t)getpid()); /* for the fixture's teardown */
	kv_fx_close(&x);
}
END_TEST

/* A prefix lookup of more keys than one kv-store request may name (a long prompt over many
 * layers) goes as several requests, each within the limit, and the hits come back at their keys'
 * places; their references go back in requests within the limit too. */
START_TEST(kv_lookup_of_more_keys_than_a_request_takes)
{
	struct kv_fx x;
	kv_fx_open(&x, 64);
	struct kv_remote *kr = &x.kr;
	/* Three cached blocks, keyed 11, 22 and 33. */
	uint64_t h[3], ck[3] = {11, 22, 33};
	void *ptr[3];
	ck_assert_msg(kv_remote_ops_pool.alloc(kr, 3, h, ptr) == 0, "%s", kr->error);
	ck_assert_msg(kv_remote_ops_pool.commit(kr, 3, h, ptr, ck, NULL) == 0, "%s", kr->error);
	const uint32_t n = 2 * KV_MAX_REQUEST_BLOCKS + 100, at[3] = {5, KV_MAX_REQUEST_BLOCKS + 4464, n - 2};
	uint64_t *keys = malloc(sizeof(uint64_t) * n), *got = malloc(sizeof(uint64_t) * n);
	ck_assert_ptr_nonnull(keys);
	ck_assert_ptr_nonnull(got);
	for (uint32_t i = 0; i < n; i++)
		keys[i] = 1000000 + i;
	for (int i = 0; i < 3; i++)
		keys[at[i]] = ck[i];
	const unsigned before = atomic_load(&x.p.lookups);
	ck_assert_msg(kv_remote_ops_pool.lookup(kr, n, keys, got) == 0, "%s", kr->error);
	ck_assert_uint_eq(atomic_load(&x.p.lookups) - before, 3);
	ck_assert_uint_le(atomic_load(&x.p.most_keys), KV_MAX_REQUEST_BLOCKS);
	uint32_t hits = 0;
	for (uint32_t i = 0; i < n; i++)
		hits += got[i] != 0;
	ck_assert_uint_eq(hits, 3);
	for (int i = 0; i < 3; i++)
		ck_assert_msg(got[at[i]] == h[i], "key %llu at %u: block %llx, want %llx", (unsigned long long)ck[i],
			      at[i], (unsigned long long)got[at[i]], (unsigned long long)h[i]);
	/* The lookup's references go back, and our own of the allocation. */
	const uint64_t back[3] = {got[at[0]], got[at[1]], got[at[2]]};
	ck_assert_msg(kv_remote_ops_pool.release(kr, 3, back) == 0, "%s", kr->error);
	ck_assert_msg(kv_remote_ops_pool.release(kr, 3, h) == 0, "%s", kr->error);
	free(keys);
	free(got);
	kv_fx_close(&x);
}
END_TEST

START_TEST(kv_alloc_takes_decode_blocks_from_a_stash)
{
	struct kv_fx x;
	kv_fx_open(&x, KV_STASH_MIN_POOL);
	struct kv_remote *kr = &x.kr;
	char err[512] = "";
	uint64_t h[KV_STASH_BLOCKS + 1], big[40];
	void *ptr[KV_STASH_BLOCKS + 1], *bigp[40];
	for (int i = 0; i < KV_STASH_BLOCKS; i++)
		ck_assert_msg(kv_remote_ops_pool.alloc(kr, 1, &h[i], &ptr[i]) == 0, "%s", kr->error);
	ck_assert_uint_eq(atomic_load(&x.p.allocs), 1);
	ck_assert_uint_eq(atomic_load(&x.p.last_alloc), KV_STASH_BLOCKS);
	for (int i = 0; i < KV_STASH_BLOCKS; i++)
		for (int j = 0; j < i; j++)
			ck_assert_msg(h[i] != h[j] && ptr[i] != ptr[j], "blocks %d and %d are one", i, j);
	ck_assert_int_eq(kv_remote_ops_pool.alloc(kr, 1, &h[KV_STASH_BLOCKS], &ptr[KV_STASH_BLOCKS]), 0);
	ck_assert_uint_eq(atomic_load(&x.p.allocs), 2);
	ck_assert_uint_eq(kr->n_stash, KV_STASH_BLOCKS - 1);
	/* A prefill's many blocks: one request of just those. */
	ck_assert_int_eq(kv_remote_ops_pool.alloc(kr, 40, big, bigp), 0);
	ck_assert_uint_eq(atomic_load(&x.p.allocs), 3);
	ck_assert_uint_eq(atomic_load(&x.p.last_alloc), 40);
	/* Idle: the stash goes back, in one FREE. */
	ck_assert_msg(kv_remote_release_stash(kr) == 0, "%s", kr->error);
	ck_assert_uint_eq(atomic_load(&x.p.frees), 1);
	ck_assert_uint_eq(atomic_load(&x.p.last_free), KV_STASH_BLOCKS - 1);
	ck_assert_uint_eq(kr->n_stash, 0);
	ck_assert_int_eq(kv_remote_release_stash(kr), 0); /* nothing held: no request */
	ck_assert_uint_eq(atomic_load(&x.p.frees), 1);
	/* A reconnect to the same pool hands the stash back too. */
	ck_assert_int_eq(kv_remote_ops_pool.alloc(kr, 1, &h[0], &ptr[0]), 0);
	ck_assert_uint_eq(kr->n_stash, KV_STASH_BLOCKS - 1);
	reconnect_frees_the_stash(&x, 2);
	/* Nearly full: no more than the pool has free (the store would spill or drop cached blocks
	 * for the rest). */
	uint32_t used = KV_STASH_BLOCKS + 1 + 40 + 1; /* the blocks this test holds */
	uint32_t fill = KV_STASH_MIN_POOL - used - 10;
	uint64_t *fh = malloc(fill * sizeof(uint64_t)), *fo = malloc(fill * sizeof(uint64_t));
	ck_assert(fh && fo);
	ck_assert_msg(kvstore_alloc(x.f.kv, fill, fh, fo, err, sizeof(err)) == 0, "%s", err);
	uint32_t before = atomic_load(&x.p.allocs);
	ck_assert_msg(kv_remote_ops_pool.alloc(kr, 1, &h[0], &ptr[0]) == 0, "%s", kr->error);
	ck_assert_uint_eq(atomic_load(&x.p.allocs), before + 1);
	ck_assert_uint_eq(atomic_load(&x.p.last_alloc), 10);
	ck_assert_uint_eq(kr->n_stash, 9);
	free(fh);
	free(fo);
	kv_fx_close(&x);
}
END_TEST

/* An idle runner's stash goes back even when a commit before it was refused (the refusal is
 * what the release returns), and stays while the connection is lost. */
START_TEST(kv_stash_goes_back_past_a_refused_commit)
{
	struct kv_fx x;
	kv_fx_open(&x, KV_STASH_MIN_POOL);
	struct kv_remote *kr = &x.kr;
	uint64_t h;
	void *ptr;
	ck_assert_msg(kv_remote_ops_pool.alloc(kr, 1, &h, &ptr) == 0, "%s", kr->error);
	ck_assert_uint_eq(kr->n_stash, KV_STASH_BLOCKS - 1);
	/* A commit of a handle the store never gave (another generation): refused, write-behind. */
	uint64_t bogus = h ^ (1ull << 40), key = 5;
	ck_assert_int_eq(kv_remote_ops_pool.commit(kr, 1, &bogus, &ptr, &key, NULL), 0);
	int rc = kv_remote_release_stash(kr);
	ck_assert_msg(rc < 0, "the refused commit did not come out of the release (rc %d)", rc);
	ck_assert_ptr_nonnull(strstr(kr->error, "refused a commit"));
	ck_assert_uint_eq(atomic_load(&x.p.frees), 1);
	ck_assert_uint_eq(atomic_load(&x.p.last_free), KV_STASH_BLOCKS - 1);
	ck_assert_uint_eq(kr->n_stash, 0);
	/* Lost: the stash stays for the next connect to the same pool, which hands it back. */
	ck_assert_msg(kv_remote_ops_pool.alloc(kr, 1, &h, &ptr) == 0, "%s", kr->error);
	kr->lost = true;
	ck_assert_int_eq(kv_remote_release_stash(kr), 0);
	ck_assert_uint_eq(kr->n_stash, KV_STASH_BLOCKS - 1);
	ck_assert_uint_eq(atomic_load(&x.p.frees), 1);
	reconnect_frees_the_stash(&x, 2);
	kv_fx_close(&x);
}
END_TEST

/* A small pool: every block asked for when needed, none ahead. */
START_TEST(kv_alloc_of_a_small_pool_takes_no_stash)
{
	struct kv_fx x;
	kv_fx_open(&x, 64);
	struct kv_remote *kr = &x.kr;
	uint64_t h[3];
	void *ptr[3];
	for (int i = 0; i < 3; i++)
		ck_assert_msg(kv_remote_ops_pool.alloc(kr, 1, &h[i], &ptr[i]) == 0, "%s", kr->error);
	ck_assert_uint_eq(atomic_load(&x.p.allocs), 3);
	ck_assert_uint_eq(atomic_load(&x.p.last_alloc), 1);
	ck_assert_uint_eq(kr->n_stash, 0);
	kv_fx_close(&x);
}
END_TEST

static Suite *remote_suite(void)
{
	Suite *s = suite_create("runner_remote");
	TCase *tc = tcase_create("weight_ring");
	tcase_set_timeout(tc, 30); /* the beats tests wait ~0.7 s by design: room for a loaded machine */
	tcase_add_unchecked_fixture(tc, NULL, sweep_all);
	tcase_add_test(tc, ring_source_takes_a_good_loader);
	tcase_add_test(tc, ring_source_beats_while_a_release_is_not_answered);
	tcase_add_test(tc, ring_source_refuses_an_error_code_beyond_int);
	tcase_add_test(tc, ring_source_refuses_a_grant_outside_the_ring);
	suite_add_tcase(s, tc);
	tc = tcase_create("kv_pool");
	tcase_set_timeout(tc, 30);
	tcase_add_unchecked_fixture(tc, NULL, sweep_all);
	tcase_add_test(tc, kv_connect_refuses_an_error_code_beyond_int);
	tcase_add_test(tc, kv_connect_beats_while_the_configuration_is_not_answered);
	tcase_add_test(tc, kv_connect_notices_a_kv_store_that_died_before_the_configuration);
	tcase_add_test(tc, kv_request_done_by_a_kv_store_that_died_leaves_orphans);
	tcase_add_test(tc, kv_ops_refuse_an_error_code_beyond_int);
	tcase_add_test(tc, kv_alloc_takes_decode_blocks_from_a_stash);
	tcase_add_test(tc, kv_alloc_of_a_small_pool_takes_no_stash);
	tcase_add_test(tc, kv_stash_goes_back_past_a_refused_commit);
	tcase_add_test(tc, kv_lookup_of_more_keys_than_a_request_takes);
	tcase_add_test(tc, kv_reconnect_after_a_failed_one_is_the_same_pool);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	runner_pid = (int)getpid();
	log_set_level(LOG_ERROR);
	return th_run(remote_suite());
}

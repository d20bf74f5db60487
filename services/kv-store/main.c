/* kv-store: the DRAM tier of the KV cache (a block pool in shared memory) with LRU spill to
 * a file on disk and a prefix cache (committed keyed blocks outlive their last reference and
 * are found by MSG_KV_LOOKUP). Flags in usage(); the messages it takes are MSG_KV_* in
 * common/protocol.h.
 *
 * Start: the run directory is prepared, a pool left by a dead kv-store of the same instance
 * is adopted (so a restart loses no block and the runner's handles stay valid), then the
 * sockets are bound. Stop: MSG_SHUTDOWN removes the pool and the spill file (with
 * --persist-dir: keeps the spill file and its index, with the cached blocks, for the next
 * kv-store to load at CONFIGURE); a signal leaves both for the next kv-store to adopt.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"
#include "common/service.h"
#include "common/shm.h"
#include "common/util.h"
#include "services/kv-store/events.h"
#include "services/kv-store/pool.h"
#include "services/kv-store/spill.h"

#define SERVICE_NAME "kv-store"

struct kvsvc {
	struct kvstore *kv;
	struct kv_events *events; /* the runner's copy completions (CUDA IPC events) */
};

static void set_bytes(struct bytes *b, const char *s)
{
	b->p = (char *)s;
	b->len = (uint32_t)strlen(s);
}

static int reply_blocks(struct service *s, const struct bus_peer *peer, uint64_t corr, uint64_t *handles,
			uint64_t *offsets, uint32_t n)
{
	struct msg rep;
	msg_init(&rep, MSG_KV_BLOCKS, corr);
	rep.kv_blocks.handles = (struct u64_array){.v = handles, .n = n};
	rep.kv_blocks.offsets = (struct u64_array){.v = offsets, .n = n};
	service_reply(s, peer, &rep);
	return 0;
}

static int reply_ok(struct service *s, const struct bus_peer *peer, uint64_t corr)
{
	struct msg rep;
	msg_init(&rep, MSG_OK, corr);
	service_reply(s, peer, &rep);
	return 0;
}

static int on_configure(struct kvsvc *k, struct service *s, const struct bus_peer *peer, const struct msg *req,
			char *err, size_t errlen)
{
	int rc = kvstore_configure(k->kv, req->kv_configure.block_bytes, req->kv_configure.manifest_hash, err, errlen);
	if (rc)
		return rc;
	struct kvstore_info info;
	kvstore_info(k->kv, &info);
	struct msg rep;
	msg_init(&rep, MSG_KV_POOL, req->corr);
	set_bytes(&rep.kv_pool.shm_name, info.shm_name);
	rep.kv_pool.shm_size = info.shm_size;
	rep.kv_pool.n_blocks = info.n_slots;
	rep.kv_pool.block_bytes = info.block_bytes;
	rep.kv_pool.epoch = info.epoch;
	service_reply(s, peer, &rep);
	return 0;
}

static int on_alloc(struct kvsvc *k, struct service *s, const struct bus_peer *peer, const struct msg *req,
		    char *err, size_t errlen)
{
	uint64_t count = req->kv_alloc.count;
	if (count == 0 || count > KVSTORE_MAX_REQUEST) {
		snprintf(err, errlen, "ALLOC count %llu is out of range (1..%u per request)", (unsigned long long)count,
			 KVSTORE_MAX_REQUEST);
		return -EINVAL;
	}
	uint64_t *handles = malloc(sizeof(uint64_t) * count), *offsets = malloc(sizeof(uint64_t) * count);
	int rc = -ENOMEM;
	if (!handles || !offsets) {
		snprintf(err, errlen, "out of memory allocating %llu blocks", (unsigned long long)count);
		goto out_free;
	}
	rc = kvstore_alloc(k->kv, (uint32_t)count, handles, offsets, err, errlen);
	if (rc == 0)
		reply_blocks(s, peer, req->corr, handles, offsets, (uint32_t)count);
out_free:
	free(handles);
	free(offsets);
	return rc;
}

static int on_commit(struct kvsvc *k, struct service *s, const struct bus_peer *peer, const struct msg *req,
		     char *err, size_t errlen)
{
	const struct msg_kv_commit *c = &req->kv_commit;
	/* Every check before any effect: the events are waited for and the blocks marked ready only
	 * for a COMMIT that can be taken. */
	if (c->keys.n && c->keys.n != c->handles.n) {
		snprintf(err, errlen, "COMMIT gives %u keys for %u handles (give one per handle, or none)", c->keys.n,
			 c->handles.n);
		return -EINVAL;
	}
	if (c->events.len) {
		/* The runner's copies completing: wait on their events here (never the runner), then
		 * the bytes are real. Blocks of one batch share an event: wait once per distinct one. */
		if (c->events.len != (uint64_t)c->handles.n * KV_EVENT_HANDLE_BYTES) {
			snprintf(err, errlen, "COMMIT gives %u bytes of events for %u handles (%d per handle)", c->events.len,
				 c->handles.n, KV_EVENT_HANDLE_BYTES);
			return -EINVAL;
		}
		for (uint32_t i = 0; i < c->handles.n; i++) {
			const char *h = c->events.p + (size_t)i * KV_EVENT_HANDLE_BYTES;
			if (i && !memcmp(h, h - KV_EVENT_HANDLE_BYTES, KV_EVENT_HANDLE_BYTES))
				continue;
			int rc = kv_events_wait(k->events, h, err, errlen);
			if (rc)
				return rc;
		}
		int rc = kvstore_mark_ready(k->kv, c->handles.v, c->handles.n, err, errlen);
		if (rc)
			return rc;
	}
	int rc = kvstore_commit(k->kv, c->handles.v, c->keys.n ? c->keys.v : NULL, c->handles.n, err, errlen);
	return rc ? rc : reply_ok(s, peer, req->corr);
}

static int on_fetch(struct kvsvc *k, struct service *s, const struct bus_peer *peer, const struct msg *req,
		    char *err, size_t errlen)
{
	const struct u64_array *h = &req->kv_handles.handles;
	uint64_t *offsets = malloc(sizeof(uint64_t) * (h->n ? h->n : 1));
	if (!offsets) {
		snprintf(err, errlen, "out of memory fetching %u blocks", h->n);
		return -ENOMEM;
	}
	int rc = kvstore_fetch(k->kv, h->v, h->n, offsets, err, errlen);
	if (rc == 0)
		reply_blocks(s, peer, req->corr, h->v, offsets, h->n);
	free(offsets);
	return rc;
}

static int on_lookup(struct kvsvc *k, struct service *s, const struct bus_peer *peer, const struct msg *req,
		     char *err, size_t errlen)
{
	const struct u64_array *keys = &req->kv_lookup.keys;
	uint64_t *handles = malloc(sizeof(uint64_t) * (keys->n ? keys->n : 1));
	uint64_t *offsets = calloc(keys->n ? keys->n : 1, sizeof(uint64_t)); /* the runner FETCHes what it uses */
	int rc = -ENOMEM;
	if (!handles || !offsets) {
		snprintf(err, errlen, "out of memory looking up %u keys", keys->n);
		goto out_free;
	}
	rc = kvstore_lookup(k->kv, keys->v, keys->n, handles, err, errlen);
	if (rc == 0)
		reply_blocks(s, peer, req->corr, handles, offsets, keys->n);
out_free:
	free(handles);
	free(offsets);
	return rc;
}

static int handle(void *ctx, struct service *s, const struct bus_peer *peer, const struct msg *req, char *err,
		  size_t errlen)
{
	struct kvsvc *k = ctx;
	int rc;
	const uint64_t *named = msg_kv_session(req);
	const uint64_t session = named ? *named : 0;
	if (kvstore_session_ended(k->kv, session)) {
		/* Sent before its runner gave the session up (it gave up waiting for a reply, and said
		 * HELLO with a new one): what it asks for would be held for nobody. */
		snprintf(err, errlen, "%s of gpu-runner session %016llx, which a HELLO with another has ended: not done",
			 msg_type_name(req->type), (unsigned long long)session);
		return -ESTALE;
	}
	switch (req->type) {
	case MSG_KV_CONFIGURE:
		return on_configure(k, s, peer, req, err, errlen);
	case MSG_KV_ALLOC:
		return on_alloc(k, s, peer, req, err, errlen);
	case MSG_KV_COMMIT:
		return on_commit(k, s, peer, req, err, errlen);
	case MSG_KV_FETCH:
		return on_fetch(k, s, peer, req, err, errlen);
	case MSG_KV_UNPIN:
		rc = kvstore_unpin(k->kv, req->kv_handles.handles.v, req->kv_handles.handles.n, err, errlen);
		return rc ? rc : reply_ok(s, peer, req->corr);
	case MSG_KV_FREE:
		rc = kvstore_free(k->kv, req->kv_handles.handles.v, req->kv_handles.handles.n, err, errlen);
		return rc ? rc : reply_ok(s, peer, req->corr);
	case MSG_KV_LOOKUP:
		return on_lookup(k, s, peer, req, err, errlen);
	case MSG_KV_UNPIN_ALL: {
		uint64_t pins = kvstore_unpin_all(k->kv);
		if (pins)
			log_info("UNPIN_ALL: dropped %llu pins", (unsigned long long)pins);
		return reply_ok(s, peer, req->corr);
	}
	default:
		snprintf(err, errlen, "kv-store does not handle %s", msg_type_name(req->type));
		return -ENOTSUP;
	}
}

static void hello(void *ctx, const struct msg *req, struct msg_hello_reply *reply)
{
	struct kvsvc *k = ctx;
	/* A runner says HELLO when it (re)connects. With the session of the last runner it is the
	 * same process reconnecting (perhaps mid-request): it keeps its blocks. Another session is
	 * a new runner: whatever the old one held is let go (keyed blocks stay cached). The runners of
	 * a model split across several ("gpu-runner", "gpu-runner-1", ...) share one session, new with
	 * each formation of them, so that what a formation held is let go together. */
	if (req->hello.client.len && !strncmp(req->hello.client.p, "gpu-runner", strlen("gpu-runner"))) {
		struct kvstore_hello r;
		kvstore_runner_hello(k->kv, req->hello.session, &r);
		if (r.kept)
			log_info("the gpu-runner of session %016llx reconnected: its blocks are kept",
				 (unsigned long long)req->hello.session);
		else if (!r.pending && (r.freed || r.cached || r.pins))
			log_info("a new gpu-runner (session %016llx) said HELLO: freed %u blocks the earlier one left "
				 "(%u being written), kept %u as cached, dropped %llu pins",
				 (unsigned long long)req->hello.session, r.freed, r.writing, r.cached,
				 (unsigned long long)r.pins);
	}
	struct kvstore_info info;
	kvstore_info(k->kv, &info);
	reply->layout = KVPOOL_LAYOUT_VERSION;
	reply->shm_name.p = (char *)info.shm_name; /* lives as long as the kvstore */
	reply->shm_size = info.shm_size;
	reply->manifest_hash = info.manifest_hash;
}

static char *stats(void *ctx)
{
	struct kvsvc *k = ctx;
	return kvstore_stats_json(k->kv);
}

static void tick(void *ctx, struct service *s)
{
	struct kvsvc *k = ctx;
	kvstore_enforce_budgets(k->kv); /* a lowered DRAM budget: spill down to it */
}

/* ---- live tuning ---- */

static void dram_range(void *ctx, int64_t *min, int64_t *max)
{
	uint64_t a, b;
	kvstore_dram_range(((struct kvsvc *)ctx)->kv, &a, &b);
	*min = (int64_t)a;
	*max = (int64_t)b;
}

static void dram_get(void *ctx, struct tunable_value *v)
{
	v->i = (int64_t)kvstore_dram_budget(((struct kvsvc *)ctx)->kv);
}

static int dram_set(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen)
{
	return kvstore_set_dram_budget(((struct kvsvc *)ctx)->kv, (uint64_t)v->i, apply, why, whylen);
}

static void disk_range(void *ctx, int64_t *min, int64_t *max)
{
	uint64_t a, b;
	kvstore_disk_range(((struct kvsvc *)ctx)->kv, &a, &b);
	*min = (int64_t)a;
	*max = (int64_t)b;
}

static void disk_get(void *ctx, struct tunable_value *v)
{
	v->i = (int64_t)kvstore_disk_budget(((struct kvsvc *)ctx)->kv);
}

static int disk_set(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen)
{
	return kvstore_set_disk_budget(((struct kvsvc *)ctx)->kv, (uint64_t)v->i, apply, why, whylen);
}

static void io_get(void *ctx, struct tunable_value *v)
{
	v->i = kvstore_io_limit(((struct kvsvc *)ctx)->kv);
}

static int io_set(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen)
{
	int rc = apply ? kvstore_set_io_limit(((struct kvsvc *)ctx)->kv, (uint32_t)v->i) : 0;
	if (rc)
		snprintf(why, whylen, "the spill file refused a depth of %lld", (long long)v->i);
	return rc;
}

/* --spill-file outside the run directory: its absolute path into KV_SPILL_RECORD there (0600),
 * for the cleanup after a crash. True when written; a failure is logged and costs only that. */
static bool record_spill(const char *run_dir, const char *spill_file)
{
	char abs[PATH_MAX + 1], cwd[PATH_MAX], path[PATH_MAX];
	/* Made later (at the pool's configuration): its absolute name, not its resolved one. */
	int n = spill_file[0] == '/' ? snprintf(abs, sizeof(abs), "%s", spill_file)
		: getcwd(cwd, sizeof(cwd))  ? snprintf(abs, sizeof(abs), "%s/%s", cwd, spill_file)
					    : -1;
	if (n < 0 || (size_t)n >= sizeof(abs) - 1) {
		log_warn("the spill file %s: no absolute name (not recorded for the cleanup after a crash)", spill_file);
		return false;
	}
	snprintf(path, sizeof(path), "%s/%s", run_dir, KV_SPILL_RECORD);
	abs[n] = '\n'; /* one line */
	int rc = write_file_atomic(path, abs, (size_t)n + 1);
	abs[n] = 0;
	if (rc == 0)
		return true;
	log_warn("cannot record the spill file's place in %s: %s (a crash would leave %s behind)", path, strerror(-rc),
		 abs);
	return false;
}

static void forget_spill(const char *run_dir)
{
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/%s", run_dir, KV_SPILL_RECORD);
	unlink(path);
}

static void register_tunables(struct service *s, struct kvsvc *k, const char *instance, const char *run_dir,
			      const char *spill_file, const char *persist_dir)
{
	struct tunable dram = {.name = "kv-dram-budget",
			       .help = "KV blocks the shared-memory pool holds; lowering it spills the least recently "
				       "used down to it (at most the pool laid out at start)",
			       .type = TUNABLE_BYTES, .range = dram_range, .get = dram_get, .set = dram_set, .ctx = k};
	struct tunable disk = {.name = "kv-disk-budget",
			       .help = "KV blocks the spill file may hold (not below what it holds now; at most the file "
				       "laid out at start)",
			       .type = TUNABLE_BYTES, .range = disk_range, .get = disk_get, .set = disk_set, .ctx = k};
	struct tunable io = {.name = "io-depth",
			     .help = "spill-file reads and writes in flight at most (a cap under the io_uring depth set "
				     "at start)",
			     .type = TUNABLE_INT, .min = 1, .max = kvstore_io_depth(k->kv), .get = io_get, .set = io_set,
			     .ctx = k};
	service_add_tunable(s, &dram);
	service_add_tunable(s, &disk);
	service_add_tunable(s, &io);
	service_add_fixed(s, "spill-file", TUNABLE_STRING, spill_file, "the spill file");
	service_add_fixed(s, "persist-dir", TUNABLE_STRING, persist_dir ? persist_dir : "",
			  "where the spill file and its index outlive a clean stop");
	service_add_fixed(s, "instance", TUNABLE_STRING, instance, "the instance name");
	service_add_fixed(s, "run-dir", TUNABLE_STRING, run_dir, "the run directory");
}

int main(int argc, char **argv)
{
	char *instance = NULL, *run_dir = NULL, *spill_file = NULL, *persist_dir = NULL, *level = NULL;
	uint64_t dram_budget = 0, disk_budget = 0;
	long io_depth = 0;
	struct opt opts[] = {
		{"instance", OPT_STRING, &instance, "default", "instance name (shared-memory and run-dir names)"},
		{"run-dir", OPT_STRING, &run_dir, NULL,
		 "directory of the sockets and the spill file (default /tmp/llmp-<uid>/<instance>)"},
		{"kv-dram-budget", OPT_SIZE, &dram_budget, "1GiB", "shared memory for KV blocks"},
		{"kv-disk-budget", OPT_SIZE, &disk_budget, "4GiB", "spill file space for KV blocks"},
		{"spill-file", OPT_STRING, &spill_file, NULL, "spill file (default <run-dir>/kv-spill.bin)"},
		{"persist-dir", OPT_STRING, &persist_dir, NULL,
		 "keep the spill file and its index (kv-spill.bin, kv-spill.idx) here across clean stops, so "
		 "cached KV blocks outlive the kv-store (instead of --spill-file)"},
		{"io-depth", OPT_INT, &io_depth, "32", "io_uring queue depth of the spill file"},
		{"log-level", OPT_STRING, &level, "info", "debug, info, warn or error"},
		{0},
	};
	log_init(SERVICE_NAME);
	int rc = config_parse(SERVICE_NAME, "the KV block pool in shared memory, spilled to disk with io_uring", opts,
			      argc, argv, NULL, NULL);
	if (rc > 0)
		return 0;
	if (rc < 0)
		return 2;
	enum log_level lv;
	if (log_parse_level(level, &lv) != 0) {
		fprintf(stderr, "%s: --log-level '%s' is not one of debug, info, warn, error\n", SERVICE_NAME, level);
		return 2;
	}
	log_set_level(lv);
	if (io_depth < 1 || io_depth > SPILL_MAX_IO_DEPTH) {
		fprintf(stderr, "%s: --io-depth %ld is out of range (1..%d)\n", SERVICE_NAME, io_depth,
			SPILL_MAX_IO_DEPTH);
		return 2;
	}
	if (!*instance || strchr(instance, '/')) {
		fprintf(stderr, "%s: --instance '%s' must be a non-empty name without '/'\n", SERVICE_NAME, instance);
		return 2;
	}

	if (persist_dir && *persist_dir && spill_file && *spill_file) {
		fprintf(stderr, "%s: --persist-dir places the spill file itself; give it or --spill-file, not both\n",
			SERVICE_NAME);
		return 2;
	}
	char run_buf[256], spill_buf[512], index_buf[512], shm_name[SHM_NAME_MAX];
	const char *index_file = NULL;
	if (persist_dir && *persist_dir) {
		int n = snprintf(spill_buf, sizeof(spill_buf), "%s/kv-spill.bin", persist_dir);
		int m = snprintf(index_buf, sizeof(index_buf), "%s/kv-spill.idx", persist_dir);
		if (n < 0 || (size_t)n >= sizeof(spill_buf) || m < 0 || (size_t)m >= sizeof(index_buf)) {
			log_error("--persist-dir path too long: %s", persist_dir);
			return 1;
		}
		spill_file = spill_buf;
		index_file = index_buf;
	}
	if (!run_dir || !*run_dir) {
		if (run_dir_default(instance, run_buf, sizeof(run_buf)) != 0) {
			log_error("the default run directory for instance %s is too long", instance);
			return 1;
		}
		run_dir = run_buf;
	}
	if (!spill_file || !*spill_file) {
		int n = snprintf(spill_buf, sizeof(spill_buf), "%s/kv-spill.bin", run_dir);
		if (n < 0 || (size_t)n >= sizeof(spill_buf)) {
			log_error("run directory path too long for the spill file: %s", run_dir);
			return 1;
		}
		spill_file = spill_buf;
	}
	if (shm_object_name(instance, "kv", shm_name, sizeof(shm_name)) != 0) {
		log_error("instance name %s is too long for a shared-memory name", instance);
		return 1;
	}
	if (run_dir_prepare(run_dir) != 0)
		return 1; /* logged */
	if (index_file && private_dir_prepare(persist_dir, "persist directory", "name another --persist-dir") != 0)
		return 1; /* logged */

	struct kvsvc k = {0};
	struct kvstore_config cfg = {.shm_name = shm_name,
				     .spill_path = spill_file,
				     .index_path = index_file,
				     .dram_budget = dram_budget,
				     .disk_budget = disk_budget,
				     .io_depth = (uint32_t)io_depth};
	rc = kvstore_create(&cfg, &k.kv);
	if (rc) {
		log_error("cannot set up the kv-store: %s", strerror(-rc));
		return 1;
	}
	/* Adopt before binding: a live kv-store of this instance keeps its sockets. */
	char err[512] = "";
	rc = kvstore_adopt(k.kv, err, sizeof(err));
	if (rc < 0) {
		log_error("%s", err);
		kvstore_destroy(&k.kv, false);
		return 1;
	}
	k.events = kv_events_create();
	struct service_ops ops = {.handle = handle, .hello = hello, .stats = stats, .tick = tick};
	struct service *s = k.events ? service_create(SERVICE_NAME, run_dir, &ops, &k) : NULL;
	if (!s) {
		kv_events_destroy(&k.events);
		kvstore_destroy(&k.kv, false);
		return 1; /* logged */
	}
	register_tunables(s, &k, instance, run_dir, spill_file, index_file ? persist_dir : NULL);
	const bool recorded = !index_file && spill_file != spill_buf && record_spill(run_dir, spill_file);
	service_run(s);
	bool remove = service_stop_reason(s) == SERVICE_STOP_SHUTDOWN;
	if (remove && index_file)
		log_info("shutting down: removing the KV pool; the spill file and its index stay in %s", persist_dir);
	else if (remove)
		log_info("shutting down: removing the KV pool and the spill file");
	else
		log_info("stopping: the KV pool and the spill file stay for the next kv-store to adopt");
	kvstore_destroy(&k.kv, remove);
	if (recorded && remove)
		forget_spill(run_dir);
	kv_events_destroy(&k.events);
	service_destroy(&s);
	return 0;
}

/* test_service.c - the ssd-loader binary: started on a tiny synthetic checkpoint with a temp
 * run directory, spoken to over its socket with rpc_client (and a raw DEALER for garbage),
 * the ring attached read-only; bad starts exit non-zero naming the problem. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/shm.h"
#include "common/util.h"
#include "common/weight_ring.h"
#include "tests/unit/ssd-loader/loader_test_util.h"

#define WAIT_MS 10000

static char *loader_bin(void)
{
	const char *bin = getenv("PIPELINE_BIN_DIR");
	ck_assert_msg(bin && *bin, "PIPELINE_BIN_DIR is not set (run through ctest)");
	size_t len = strlen(bin) + 32;
	char *path = malloc(len);
	snprintf(path, len, "%s/ssd-loader", bin);
	ck_assert_msg(access(path, X_OK) == 0, "%s is not built", path);
	return path;
}

/* Starts the loader with args (NULL-terminated, without argv[0]); its stdout and stderr
 * go to out_path. */
static pid_t spawn(const char *const *args, const char *out_path)
{
	char *bin = loader_bin();
	const char *argv[32] = {bin};
	int n = 1;
	for (; args[n - 1]; n++) {
		ck_assert_int_lt(n, 31);
		argv[n] = args[n - 1];
	}
	argv[n] = NULL;
	fflush(stdout);
	fflush(stderr);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0)
			_exit(126);
		execv(bin, (char *const *)argv);
		_exit(127);
	}
	free(bin);
	return pid;
}

/* Waits up to WAIT_MS for pid; returns its wait status (kills it and fails if it hangs). */
static int wait_exit(pid_t pid)
{
	for (int i = 0; i < WAIT_MS / 10; i++) {
		int st;
		pid_t r = waitpid(pid, &st, WNOHANG);
		ck_assert_int_ge(r, 0);
		if (r == pid)
			return st;
		usleep(10000);
	}
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	ck_abort_msg("ssd-loader (pid %d) did not exit", (int)pid);
	return -1;
}

static char *slurp(const char *path)
{
	FILE *f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	char *buf = calloc(1, 1 << 16);
	size_t n = fread(buf, 1, (1 << 16) - 1, f);
	buf[n] = 0;
	fclose(f);
	return buf;
}

static void instance_name(char *buf, size_t len, const char *tag)
{
	snprintf(buf, len, "lt%s%d", tag, (int)getpid());
}

static bool shm_exists(const char *name)
{
	int fd = shm_open(name, O_RDONLY, 0);
	if (fd >= 0)
		close(fd);
	return fd >= 0;
}

/* Runs the loader to completion with args; returns the exit code and its output. */
static int run_to_exit(const char *const *args, const char *out_path, char **output)
{
	pid_t pid = spawn(args, out_path);
	int st = wait_exit(pid);
	*output = slurp(out_path);
	ck_assert_msg(WIFEXITED(st), "ssd-loader died: %s", *output);
	return WEXITSTATUS(st);
}

/* A raw DEALER sends frames and expects a MSG_ERROR back. */
static void expect_error_reply(void *sock, const char *what, uint64_t want_corr)
{
	struct msg rep;
	char err[256];
	int rc = bus_recv(sock, &rep, WAIT_MS, err, sizeof(err));
	ck_assert_msg(rc == 0, "no reply to %s: %d %s", what, rc, err);
	ck_assert_msg(rep.type == MSG_ERROR, "%s: reply %s", what, msg_type_name(rep.type));
	ck_assert_msg(rep.error.text.len > 0, "%s: empty error text", what);
	if (want_corr)
		ck_assert_uint_eq(rep.corr, want_corr);
	msg_free(&rep);
}

static void send_garbage(void *zctx, const char *run_dir)
{
	char ep[300];
	ck_assert_int_eq(bus_endpoint(run_dir, "ssd-loader", "ctl", ep, sizeof(ep)), 0);
	void *sock = zmq_socket(zctx, ZMQ_DEALER);
	int linger = 0;
	zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger));
	ck_assert_int_eq(zmq_connect(sock, ep), 0);

	uint8_t rnd[64];
	for (size_t i = 0; i < sizeof(rnd); i += 8) {
		uint64_t v = random_u64();
		memcpy(rnd + i, &v, 8);
	}
	rnd[0] = 0xc1; /* never valid msgpack */
	ck_assert_int_eq(zmq_send(sock, rnd, sizeof(rnd), 0), (int)sizeof(rnd));
	expect_error_reply(sock, "random bytes", 0);

	struct msg ping;
	void *buf;
	size_t len;
	msg_init(&ping, MSG_PING, 77);
	ck_assert_int_eq(msg_encode(&ping, &buf, &len), 0);
	ck_assert_int_eq(zmq_send(sock, buf, len - 1, 0), (int)(len - 1));
	expect_error_reply(sock, "a truncated message", 0);

	/* [version 1, type 999, corr 42, {}] */
	static const uint8_t unknown[] = {0x94, 0x01, 0xcd, 0x03, 0xe7, 0x2a, 0x80};
	ck_assert_int_eq(zmq_send(sock, unknown, sizeof(unknown), 0), (int)sizeof(unknown));
	expect_error_reply(sock, "an unknown type", 42);

	ck_assert_int_eq(zmq_send(sock, buf, len, ZMQ_SNDMORE), (int)len);
	ck_assert_int_eq(zmq_send(sock, buf, len, 0), (int)len);
	expect_error_reply(sock, "two frames", 0);

	ck_assert_int_eq(zmq_send(sock, "", 0, 0), 0);
	expect_error_reply(sock, "an empty frame", 0);
	free(buf);

	/* Well formed, but not the loader's: MSG_KV_ALLOC. */
	struct msg kv;
	msg_init(&kv, MSG_KV_ALLOC, 43);
	kv.kv_alloc.count = 1;
	ck_assert_int_eq(bus_send(sock, &kv, 0), 0);
	expect_error_reply(sock, "another service's request", 43);
	zmq_close(sock);
}

struct running {
	char *dir, *model, run_dir[256], out[300], instance[64], shm[SHM_NAME_MAX];
	pid_t pid;
	void *zctx;
	struct rpc_client *c;
	struct manifest *m;
};

static void start_loader(struct running *r, const char *budget)
{
	free(loader_bin()); /* fail before making anything to clean up */
	r->dir = th_tmpdir("/tmp");
	r->model = lt_make_model(r->dir, 2);
	r->m = lt_load(r->model);
	snprintf(r->run_dir, sizeof(r->run_dir), "%s/run", r->dir);
	snprintf(r->out, sizeof(r->out), "%s/loader.log", r->dir);
	instance_name(r->instance, sizeof(r->instance), "s");
	ck_assert_int_eq(shm_object_name(r->instance, "weights", r->shm, sizeof(r->shm)), 0);
	const char *args[] = {"--model", r->model, "--instance", r->instance, "--run-dir", r->run_dir,
			      "--dram-budget", budget, "--log-level", "debug", NULL};
	r->pid = spawn(args, r->out);
	r->zctx = zmq_ctx_new();
	r->c = rpc_client_create(r->zctx, r->run_dir, "ssd-loader", "test-client");
	ck_assert_ptr_nonnull(r->c);
}

static void stop_loader(struct running *r)
{
	struct msg req, rep;
	msg_init(&req, MSG_SHUTDOWN, 0);
	ck_assert_int_eq(rpc_call(r->c, &req, &rep, WAIT_MS), 0);
	ck_assert_uint_eq(rep.type, MSG_OK);
	msg_free(&rep);
	int st = wait_exit(r->pid);
	char *log = slurp(r->out);
	ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d: %s", st, log);
	free(log);
	/* The ring and the sockets are gone. */
	ck_assert(!shm_exists(r->shm));
	char sock[400];
	snprintf(sock, sizeof(sock), "%s/ssd-loader.ctl", r->run_dir);
	ck_assert_int_ne(access(sock, F_OK), 0);
	rpc_client_destroy(&r->c);
	zmq_ctx_term(r->zctx);
	manifest_destroy(&r->m);
	th_rmtree(r->dir);
	free(r->dir);
	free(r->model);
}

START_TEST(serves_grants_and_survives_garbage)
{
	struct running r = {0};
	start_loader(&r, "16GiB");
	struct msg rep;
	int rc = rpc_wait_ready(r.c, &rep, WAIT_MS);
	ck_assert_msg(rc == 0, "no HELLO reply: %d", rc);
	ck_assert_str_eq(rep.hello_reply.service.p, "ssd-loader");
	ck_assert_uint_eq(rep.hello_reply.layout, WRING_LAYOUT_VERSION);
	ck_assert_uint_eq(rep.hello_reply.manifest_hash, r.m->hash);
	ck_assert_str_eq(rep.hello_reply.shm_name.p, r.shm);
	uint64_t shm_size = rep.hello_reply.shm_size;
	msg_free(&rep);

	struct shm_object *o = NULL;
	ck_assert_int_eq(shm_object_attach(r.shm, SHM_KIND_WEIGHT_RING, WRING_LAYOUT_VERSION, false, &o), 0);
	ck_assert_uint_eq(shm_object_size(o), shm_size);
	struct wring_header *h = shm_object_base(o);
	ck_assert_uint_eq(h->manifest_hash, r.m->hash);
	ck_assert_uint_eq(h->n_groups, r.m->n_groups);
	ck_assert_uint_eq(h->all_resident, 1);

	/* Every group at once: one grant each, with the request's id. */
	uint32_t n = r.m->n_groups;
	uint64_t ids[64];
	for (uint32_t g = 0; g < n; g++)
		ids[g] = g;
	struct msg req;
	msg_init(&req, MSG_W_ACQUIRE, 0);
	req.w_acquire.groups.v = ids;
	req.w_acquire.groups.n = n;
	uint64_t corr;
	ck_assert_int_eq(rpc_send(r.c, &req, &corr), 0);
	bool seen[64] = {false};
	for (uint32_t i = 0; i < n; i++) {
		ck_assert_int_eq(rpc_wait(r.c, corr, &rep, WAIT_MS), 0);
		ck_assert_uint_eq(rep.type, MSG_W_GRANT);
		struct msg_w_grant g = rep.w_grant;
		msg_free(&rep);
		ck_assert_uint_lt(g.group, n);
		ck_assert(!seen[g.group]);
		seen[g.group] = true;
		ck_assert_uint_le(g.offset + g.bytes, shm_size);
		ck_assert_uint_eq(g.bytes, r.m->groups[g.group].slot_bytes);
		struct wring_slot *s = &wring_slots(h)[g.slot];
		ck_assert_uint_eq(atomic_load(&s->group), g.group);
		ck_assert_uint_eq(atomic_load(&s->refs), 1);
		ck_assert_uint_eq(atomic_load(&s->generation), g.generation);
		lt_check_group(r.m, (uint32_t)g.group, (char *)h + g.offset);
	}

	msg_init(&req, MSG_W_RELEASE, 0);
	req.w_release.groups.v = ids;
	req.w_release.groups.n = n;
	ck_assert_int_eq(rpc_call(r.c, &req, &rep, WAIT_MS), 0);
	ck_assert_uint_eq(rep.type, MSG_OK);
	msg_free(&rep);
	for (uint32_t s = 0; s < h->n_slots; s++)
		ck_assert_uint_eq(atomic_load(&wring_slots(h)[s].refs), 0);

	/* A second release, and an id out of range: EINVAL, the service goes on. */
	ck_assert_int_eq(rpc_call(r.c, &req, &rep, WAIT_MS), -EREMOTEIO);
	ck_assert_int_eq(rep.error.code, EINVAL);
	msg_free(&rep);
	uint64_t bad = 9999;
	msg_init(&req, MSG_W_ACQUIRE, 0);
	req.w_acquire.groups.v = &bad;
	req.w_acquire.groups.n = 1;
	ck_assert_int_eq(rpc_call(r.c, &req, &rep, WAIT_MS), -EREMOTEIO);
	ck_assert_int_eq(rep.error.code, EINVAL);
	ck_assert_msg(strstr(rep.error.text.p, "9999"), "%s", rep.error.text.p);
	msg_free(&rep);

	send_garbage(r.zctx, r.run_dir);
	struct msg ping;
	msg_init(&ping, MSG_PING, 0);
	ck_assert_int_eq(rpc_call(r.c, &ping, &rep, WAIT_MS), 0);
	ck_assert_uint_eq(rep.type, MSG_OK);
	msg_free(&rep);

	/* A gpu-runner's HELLO drops what an earlier runner held. */
	uint64_t g0 = 0;
	msg_init(&req, MSG_W_ACQUIRE, 0);
	req.w_acquire.groups.v = &g0;
	req.w_acquire.groups.n = 1;
	ck_assert_int_eq(rpc_call(r.c, &req, &rep, WAIT_MS), 0);
	ck_assert_uint_eq(rep.type, MSG_W_GRANT);
	ck_assert_uint_eq(atomic_load(&wring_slots(h)[rep.w_grant.slot].refs), 1);
	uint64_t slot0 = rep.w_grant.slot;
	msg_free(&rep);
	struct rpc_client *runner = rpc_client_create(r.zctx, r.run_dir, "ssd-loader", "gpu-runner");
	ck_assert_int_eq(rpc_hello(runner, &rep, WAIT_MS), 0);
	msg_free(&rep);
	ck_assert_uint_eq(atomic_load(&wring_slots(h)[slot0].refs), 0);
	rpc_client_destroy(&runner);

	struct msg st;
	msg_init(&st, MSG_STATS_GET, 0);
	ck_assert_int_eq(rpc_call(r.c, &st, &rep, WAIT_MS), 0);
	ck_assert_uint_eq(rep.type, MSG_STATS);
	json_error_t je;
	json_t *j = json_loads(rep.stats.json.p, 0, &je);
	ck_assert_msg(j != NULL, "%s", rep.stats.json.p);
	ck_assert_int_eq(json_integer_value(json_object_get(j, "groups")), n);
	ck_assert_int_eq(json_integer_value(json_object_get(j, "grants")), n + 1);
	ck_assert_int_eq(json_integer_value(json_object_get(j, "releases")), n);
	ck_assert_int_eq(json_integer_value(json_object_get(j, "groups_loaded")), n);
	ck_assert(json_is_true(json_object_get(j, "all_resident")));
	ck_assert(json_is_true(json_object_get(j, "o_direct")));
	json_decref(j);
	msg_free(&rep);

	ck_assert_int_eq(waitpid(r.pid, NULL, WNOHANG), 0); /* alive all along */
	shm_object_close(&o, false);
	stop_loader(&r);
}
END_TEST

START_TEST(streaming_over_the_socket)
{
	/* Smallest budget that streams: the globals and one attention and one FFN slot. */
	struct running r = {0};
	char budget[32];
	struct manifest *probe;
	free(loader_bin());
	{
		char *pd = th_tmpdir("/tmp");
		char *pm = lt_make_model(pd, 2);
		probe = lt_load(pm);
		uint64_t b = 2 * ALIGN_UP(probe->class_bytes[CLASS_GLOBAL], 4096ull) +
			     ALIGN_UP(probe->class_bytes[CLASS_ATTN], 4096ull) +
			     ALIGN_UP(probe->class_bytes[CLASS_FFN], 4096ull);
		snprintf(budget, sizeof(budget), "%llu", (unsigned long long)b);
		manifest_destroy(&probe);
		th_rmtree(pd);
		free(pd);
		free(pm);
	}
	start_loader(&r, budget);
	struct msg rep, req;
	ck_assert_int_eq(rpc_wait_ready(r.c, &rep, WAIT_MS), 0);
	msg_free(&rep);
	struct shm_object *o = NULL;
	ck_assert_int_eq(shm_object_attach(r.shm, SHM_KIND_WEIGHT_RING, WRING_LAYOUT_VERSION, false, &o), 0);
	struct wring_header *h = shm_object_base(o);
	ck_assert_uint_eq(h->all_resident, 0);
	ck_assert_uint_eq(h->n_slots, 4);
	/* Two cycles in visit order, each acquire releasing the group before. */
	uint64_t prev = 0;
	bool holding = false;
	for (int c = 0; c < 2; c++) {
		for (uint64_t g = 0; g < r.m->n_groups; g++) {
			msg_init(&req, MSG_W_ACQUIRE, 0);
			req.w_acquire.groups.v = &g;
			req.w_acquire.groups.n = 1;
			req.w_acquire.release.v = &prev;
			req.w_acquire.release.n = holding ? 1 : 0;
			ck_assert_int_eq(rpc_call(r.c, &req, &rep, WAIT_MS), 0);
			ck_assert_uint_eq(rep.type, MSG_W_GRANT);
			ck_assert_uint_eq(rep.w_grant.group, g);
			lt_check_group(r.m, (uint32_t)g, (char *)h + rep.w_grant.offset);
			msg_free(&rep);
			prev = g;
			holding = true;
		}
	}
	shm_object_close(&o, false);
	stop_loader(&r);
}
END_TEST

START_TEST(second_instance_refused)
{
	struct running r = {0};
	start_loader(&r, "16GiB");
	struct msg rep;
	ck_assert_int_eq(rpc_wait_ready(r.c, &rep, WAIT_MS), 0);
	msg_free(&rep);
	char run2[300], out2[300];
	snprintf(run2, sizeof(run2), "%s/run2", r.dir);
	snprintf(out2, sizeof(out2), "%s/second.log", r.dir);
	const char *args[] = {"--model", r.model, "--instance", r.instance, "--run-dir", run2, NULL};
	char *log;
	ck_assert_int_eq(run_to_exit(args, out2, &log), 1);
	ck_assert_msg(strstr(log, r.shm) && strstr(log, "live process"), "%s", log);
	free(log);
	/* The first one is unharmed. */
	ck_assert(shm_exists(r.shm));
	struct msg ping;
	msg_init(&ping, MSG_PING, 0);
	ck_assert_int_eq(rpc_call(r.c, &ping, &rep, WAIT_MS), 0);
	msg_free(&rep);
	stop_loader(&r);
}
END_TEST

static void expect_start_failure(const char *const *args, const char *out, int code, const char *needle,
				 const char *instance)
{
	char *log;
	int rc = run_to_exit(args, out, &log);
	ck_assert_msg(rc == code, "exit %d (wanted %d): %s", rc, code, log);
	ck_assert_msg(strstr(log, needle) != NULL, "output does not name '%s': %s", needle, log);
	free(log);
	if (instance) {
		char shm[SHM_NAME_MAX];
		ck_assert_int_eq(shm_object_name(instance, "weights", shm, sizeof(shm)), 0);
		ck_assert(!shm_exists(shm));
	}
}

START_TEST(bad_starts_name_the_problem)
{
	free(loader_bin());
	char *dir = th_tmpdir("/tmp");
	char out[300], run_dir[300], missing[300], inst[64];
	snprintf(out, sizeof(out), "%s/out.log", dir);
	snprintf(run_dir, sizeof(run_dir), "%s/run", dir);
	snprintf(missing, sizeof(missing), "%s/no-such-model", dir);
	instance_name(inst, sizeof(inst), "b");

	const char *a_missing[] = {"--model", missing, "--instance", inst, "--run-dir", run_dir, NULL};
	expect_start_failure(a_missing, out, 1, "no-such-model", inst);

	char *model = lt_make_model(dir, 2);
	char st[400];
	snprintf(st, sizeof(st), "%s/model.safetensors", model);
	/* The header length claims more bytes than the file has. */
	int fd = open(st, O_WRONLY);
	ck_assert_int_ge(fd, 0);
	uint64_t huge = 1ull << 40;
	ck_assert_int_eq(pwrite(fd, &huge, sizeof(huge), 0), (ssize_t)sizeof(huge));
	close(fd);
	const char *a_corrupt[] = {"--model", model, "--instance", inst, "--run-dir", run_dir, NULL};
	expect_start_failure(a_corrupt, out, 1, "model.safetensors", inst);

	char *model2 = lt_make_model(dir, 2);
	const char *a_small[] = {"--model", model2, "--instance", inst, "--run-dir", run_dir, "--dram-budget", "8KiB",
				 NULL};
	expect_start_failure(a_small, out, 1, "too small", inst);

	const char *a_nomodel[] = {"--instance", inst, NULL};
	expect_start_failure(a_nomodel, out, 2, "--model is required", NULL);
	const char *a_badflag[] = {"--model", model2, "--no-such-flag", NULL};
	expect_start_failure(a_badflag, out, 2, "--no-such-flag", NULL);
	const char *a_badsize[] = {"--model", model2, "--max-read", "1000", NULL};
	expect_start_failure(a_badsize, out, 2, "--max-read", NULL);
	const char *a_help[] = {"--help", NULL};
	expect_start_failure(a_help, out, 0, "--dram-budget", NULL);

	th_rmtree(dir);
	free(model);
	free(model2);
	free(dir);
}
END_TEST

static Suite *service_suite(void)
{
	Suite *s = suite_create("ssd-loader service");
	TCase *tc = tcase_create("serve");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, serves_grants_and_survives_garbage);
	tcase_add_test(tc, streaming_over_the_socket);
	tcase_add_test(tc, second_instance_refused);
	suite_add_tcase(s, tc);
	tc = tcase_create("start");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, bad_starts_name_the_problem);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(service_suite());
}

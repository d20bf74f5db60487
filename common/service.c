#include "common/service.h"

#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/tunable.h"
#include "common/util.h"

#define SERVICE_MAX_FDS 8
#define HEARTBEAT_MS 1000

struct service {
	char name[64];
	char run_dir[256];
	const struct service_ops *ops;
	void *ctx;
	void *zctx;
	void *router;
	void *pub;
	uint64_t epoch;
	uint64_t started_ns;
	uint64_t last_tick_ns, last_beat_ns, beat_seq;
	int tick_ms;
	int n_fds;
	int fds[SERVICE_MAX_FDS];
	service_fd_fn fd_fns[SERVICE_MAX_FDS];
	volatile bool stop;
	enum service_stop_reason reason;
	struct tunables *tunables; /* live tuning: MSG_CONFIG_GET / MSG_CONFIG_SET */
};

static volatile sig_atomic_t got_signal;

static void on_signal(int sig)
{
	got_signal = sig;
}

int run_dir_default(const char *instance, char *buf, size_t len)
{
	const char *env = getenv("PIPELINE_RUN_DIR");
	int n = env && *env ? snprintf(buf, len, "%s", env)
			    : snprintf(buf, len, "/tmp/llmp-%u/%s", (unsigned)getuid(), instance);
	return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

/* One directory above a private one (private_dir_prepare): the immediate parent, or one further
 * up. Returns 0, or -EPERM (or -errno) with the reason logged. */
static int ancestor_check(const char *dir, bool parent, const char *what, const char *elsewhere)
{
	char role[96];
	if (parent)
		snprintf(role, sizeof(role), "the %s's parent", what);
	else
		snprintf(role, sizeof(role), "a directory above the %s", what);
	struct stat ps;
	/* A link on the way: its owner may point it elsewhere later. */
	if (lstat(dir, &ps) == 0 && S_ISLNK(ps.st_mode) && ps.st_uid != getuid() && ps.st_uid != 0) {
		log_error("%s, %s, is a symbolic link of uid %u: another user could replace the %s (%s)", dir, role,
			  (unsigned)ps.st_uid, what, elsewhere);
		return -EPERM;
	}
	if (stat(dir, &ps) != 0) {
		int rc = -errno;
		log_error("cannot look at %s, %s: %s", dir, role, strerror(errno));
		return rc;
	}
	if (ps.st_uid != getuid() && ps.st_uid != 0) {
		log_error("%s, %s, belongs to uid %u: another user could replace the %s (remove it, or %s)", dir, role,
			  (unsigned)ps.st_uid, what, elsewhere);
		return -EPERM;
	}
	if ((ps.st_mode & 022) && !(ps.st_mode & S_ISVTX)) {
		log_error("%s, %s, is writable by other users (mode %03o, not sticky): another user could replace "
			  "the %s (chmod go-w it, or %s)", dir, role, (unsigned)(ps.st_mode & 0777), what, elsewhere);
		return -EPERM;
	}
	return 0;
}

int private_dir_prepare(const char *dir, const char *what, const char *elsewhere)
{
	char path[512];
	if (str_copy(path, sizeof(path), dir) != 0) {
		log_error("%s path too long (%zu bytes, at most %zu): %.64s...", what, strlen(dir), sizeof(path) - 1,
			  dir);
		return -ENAMETOOLONG;
	}
	/* Parents: plain mkdir, keeping what exists. */
	for (char *p = path + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = 0;
		if (mkdir(path, 0700) != 0 && errno != EEXIST) {
			int rc = -errno;
			log_error("cannot create %s: %s", path, strerror(errno));
			return rc;
		}
		*p = '/';
	}
	if (mkdir(path, 0700) != 0 && errno != EEXIST) {
		int rc = -errno;
		log_error("cannot create %s %s: %s", what, path, strerror(errno));
		return rc;
	}
	struct stat st;
	if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) {
		log_error("%s %s is not a directory", what, path);
		return -ENOTDIR;
	}
	if (st.st_uid != getuid()) {
		log_error("%s %s belongs to uid %u, not to us", what, path, (unsigned)st.st_uid);
		return -EPERM;
	}
	if ((st.st_mode & 0777) != 0700) {
		if (chmod(path, 0700) != 0) {
			int rc = -errno;
			log_error("cannot set mode 0700 on %s %s: %s", what, path, strerror(errno));
			return rc;
		}
		log_info("%s %s: mode %03o made 0700 (its files are this user's alone)", what, path,
			 (unsigned)(st.st_mode & 0777));
	}
	/* Whoever may write the parent, or any directory above it, may rename the run directory (or
	 * a directory on its way) and put sockets of their own where the services and clients look
	 * for each other's (/tmp/llmp-UID made first by another user, or a directory above it left
	 * open to others): every one up to / must be ours or root's, not writable by others unless
	 * sticky (as /tmp is), and not another user's symbolic link. */
	size_t n = strlen(path);
	while (n > 1 && path[n - 1] == '/')
		path[--n] = 0;
	char up[1024];
	if (path[0] == '/') {
		if (str_copy(up, sizeof(up), path) != 0)
			return -ENAMETOOLONG;
	} else {
		char cwd[512];
		if (!getcwd(cwd, sizeof(cwd)) || (size_t)snprintf(up, sizeof(up), "%s/%s", cwd, path) >= sizeof(up)) {
			log_error("cannot make %s %s an absolute path", what, path);
			return -ENAMETOOLONG;
		}
	}
	for (bool parent = true;; parent = false) {
		char *slash = strrchr(up, '/');
		if (!slash || (slash == up && up[1] == 0))
			break; /* past / */
		if (slash == up)
			slash[1] = 0; /* the root directory */
		else
			*slash = 0;
		int rc = ancestor_check(up, parent, what, elsewhere);
		if (rc)
			return rc;
	}
	return 0;
}

int run_dir_prepare(const char *dir)
{
	return private_dir_prepare(dir, "run directory", "set PIPELINE_RUN_DIR elsewhere");
}

/* log-level: every service's, tunable at run time. */
static const char *const log_level_names[] = {"debug", "info", "warn", "error", NULL};

static void log_level_get(void *ctx, struct tunable_value *v)
{
	(void)ctx;
	v->i = (int64_t)log_get_level();
	v->s = log_level_names[v->i];
}

static int log_level_set(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen)
{
	(void)ctx;
	(void)why;
	(void)whylen;
	if (apply)
		log_set_level((enum log_level)v->i);
	return 0;
}

struct service *service_create(const char *name, const char *run_dir, const struct service_ops *ops, void *ctx)
{
	struct service *s = calloc(1, sizeof(*s));
	if (!s)
		return NULL;
	str_copy(s->name, sizeof(s->name), name);
	if (str_copy(s->run_dir, sizeof(s->run_dir), run_dir) != 0) {
		log_error("run directory path too long: %s", run_dir);
		goto out_free;
	}
	s->ops = ops;
	s->ctx = ctx;
	s->epoch = random_u64();
	s->started_ns = now_ns();
	s->tick_ms = 100;
	s->tunables = tunables_create(s->name);
	struct tunable level = {.name = "log-level",
				.help = "the least severe records logged: debug, info, warn or error",
				.type = TUNABLE_ENUM,
				.values = log_level_names,
				.get = log_level_get,
				.set = log_level_set};
	if (!s->tunables || tunables_add(s->tunables, &level) != 0)
		goto out_free;
	if (run_dir_prepare(run_dir) != 0)
		goto out_free;
	s->zctx = zmq_ctx_new();
	if (!s->zctx)
		goto out_free;
	char ep[300];
	if (bus_endpoint(run_dir, name, "ctl", ep, sizeof(ep)) != 0) {
		log_error("socket path too long under %s (ipc paths hold at most 107 bytes)", run_dir);
		goto out_ctx;
	}
	s->router = bus_bind_router(s->zctx, ep);
	if (!s->router)
		goto out_ctx;
	bus_endpoint(run_dir, name, "pub", ep, sizeof(ep));
	s->pub = bus_bind_pub(s->zctx, ep);
	if (!s->pub)
		goto out_router;
	struct sigaction sa = {.sa_handler = on_signal};
	sigemptyset(&sa.sa_mask);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);
	return s;

out_router:
	zmq_close(s->router);
out_ctx:
	zmq_ctx_term(s->zctx);
out_free:
	tunables_destroy(&s->tunables);
	free(s);
	return NULL;
}

static void unlink_endpoint(const struct service *s, const char *suffix)
{
	char path[512];
	snprintf(path, sizeof(path), "%s/%s.%s", s->run_dir, s->name, suffix);
	unlink(path);
}

void service_destroy(struct service **sp)
{
	if (!sp || !*sp)
		return;
	struct service *s = *sp;
	if (s->pub)
		zmq_close(s->pub);
	if (s->router)
		zmq_close(s->router);
	if (s->zctx)
		zmq_ctx_term(s->zctx);
	/* Leave no socket file behind. */
	unlink_endpoint(s, "ctl");
	unlink_endpoint(s, "pub");
	tunables_destroy(&s->tunables);
	free(s);
	*sp = NULL;
}

int service_add_fd(struct service *s, int fd, service_fd_fn fn)
{
	if (s->n_fds >= SERVICE_MAX_FDS)
		return -ENOSPC;
	s->fds[s->n_fds] = fd;
	s->fd_fns[s->n_fds] = fn;
	s->n_fds++;
	return 0;
}

void service_set_tick(struct service *s, int tick_ms)
{
	s->tick_ms = tick_ms > 0 ? tick_ms : 100;
}

void service_stop(struct service *s)
{
	s->stop = true;
}

enum service_stop_reason service_stop_reason(const struct service *s)
{
	return s->reason;
}

int service_reply(struct service *s, const struct bus_peer *peer, const struct msg *m)
{
	int rc = bus_reply(s->router, peer, m);
	if (rc)
		log_warn("reply %s lost: %s", msg_type_name(m->type), strerror(-rc));
	return rc;
}

int service_reply_error(struct service *s, const struct bus_peer *peer, uint64_t corr, int code, const char *text)
{
	return bus_reply_error(s->router, peer, corr, code, text);
}

int service_publish(struct service *s, const struct msg *m)
{
	return bus_publish(s->pub, m);
}

void *service_zmq_context(struct service *s)
{
	return s->zctx;
}
const char *service_name(const struct service *s)
{
	return s->name;
}
const char *service_run_dir(const struct service *s)
{
	return s->run_dir;
}
uint64_t service_epoch(const struct service *s)
{
	return s->epoch;
}
uint64_t service_uptime_ms(const struct service *s)
{
	return (now_ns() - s->started_ns) / 1000000ull;
}

int service_add_tunable(struct service *s, const struct tunable *t)
{
	int rc = tunables_add(s->tunables, t);
	if (rc)
		log_error("cannot register the tunable parameter %s: %s", t && t->name ? t->name : "(no name)",
			  strerror(-rc));
	return rc;
}

int service_add_fixed(struct service *s, const char *name, enum tunable_type type, const char *value,
		      const char *help)
{
	int rc = tunables_add_fixed(s->tunables, name, type, value, help);
	if (rc)
		log_error("cannot register the parameter %s: %s", name ? name : "(no name)", strerror(-rc));
	return rc;
}

struct tunables *service_tunables(struct service *s)
{
	return s->tunables;
}

/* MSG_CONFIG_GET and MSG_CONFIG_SET: the registry does the work; the answer is MSG_CONFIG. */
static void handle_config(struct service *s, const struct bus_peer *peer, const struct msg *req)
{
	char why[4096];
	int rc = 0;
	char *json = req->type == MSG_CONFIG_GET
			     ? tunables_get_json(s->tunables, req->config_get.keys.p, req->config_get.keys.len, &rc, why,
						 sizeof(why))
			     : tunables_set_json(s->tunables, req->config_set.settings.p, req->config_set.settings.len,
						 &rc, why, sizeof(why));
	if (!json) {
		log_warn("%s refused: %s", msg_type_name(req->type), why);
		service_reply_error(s, peer, req->corr, rc ? -rc : EINVAL, why);
		return;
	}
	struct msg rep;
	msg_init(&rep, MSG_CONFIG, req->corr);
	rep.config.service.p = s->name;
	rep.config.service.len = (uint32_t)strlen(s->name);
	rep.config.json.p = json;
	rep.config.json.len = (uint32_t)strlen(json);
	service_reply(s, peer, &rep);
	free(json);
}

static void handle_generic(struct service *s, const struct bus_peer *peer, const struct msg *req)
{
	struct msg rep;
	char errtext[512];
	switch (req->type) {
	case MSG_HELLO:
		if (req->hello.proto != PROTO_VERSION) {
			snprintf(errtext, sizeof(errtext), "%s speaks protocol %d, the client %llu", s->name,
				 PROTO_VERSION, (unsigned long long)req->hello.proto);
			service_reply_error(s, peer, req->corr, EPROTONOSUPPORT, errtext);
			return;
		}
		msg_init(&rep, MSG_HELLO_REPLY, req->corr);
		rep.hello_reply.service.p = s->name;
		rep.hello_reply.service.len = (uint32_t)strlen(s->name);
		rep.hello_reply.pid = (uint64_t)getpid();
		rep.hello_reply.epoch = s->epoch;
		rep.hello_reply.shm_name.p = "";
		if (s->ops->hello)
			s->ops->hello(s->ctx, req, &rep.hello_reply);
		rep.hello_reply.shm_name.len = (uint32_t)strlen(rep.hello_reply.shm_name.p);
		service_reply(s, peer, &rep);
		return;
	case MSG_PING:
		msg_init(&rep, MSG_OK, req->corr);
		service_reply(s, peer, &rep);
		return;
	case MSG_STATS_GET: {
		char *json = s->ops->stats ? s->ops->stats(s->ctx) : NULL;
		msg_init(&rep, MSG_STATS, req->corr);
		rep.stats.service.p = s->name;
		rep.stats.service.len = (uint32_t)strlen(s->name);
		rep.stats.json.p = json ? json : "{}";
		rep.stats.json.len = (uint32_t)strlen(rep.stats.json.p);
		service_reply(s, peer, &rep);
		free(json);
		return;
	}
	case MSG_CONFIG_GET:
	case MSG_CONFIG_SET:
		handle_config(s, peer, req);
		return;
	case MSG_SHUTDOWN:
		log_info("shutdown requested");
		msg_init(&rep, MSG_OK, req->corr);
		service_reply(s, peer, &rep);
		s->stop = true;
		s->reason = SERVICE_STOP_SHUTDOWN;
		return;
	default:
		break;
	}
	errtext[0] = 0;
	int rc = s->ops->handle ? s->ops->handle(s->ctx, s, peer, req, errtext, sizeof(errtext)) : -ENOTSUP;
	if (rc < 0) {
		if (!errtext[0])
			snprintf(errtext, sizeof(errtext), "%s does not handle %s", s->name, msg_type_name(req->type));
		log_warn("%s from a client failed: %s", msg_type_name(req->type), errtext);
		service_reply_error(s, peer, req->corr, -rc, errtext);
	}
}

static void drain_router(struct service *s)
{
	for (int n = 0; n < 256; n++) {
		struct bus_peer peer;
		struct msg req;
		uint64_t corr;
		char err[512];
		int rc = bus_recv_request(s->router, &peer, &req, &corr, err, sizeof(err));
		if (rc == -EAGAIN || rc == -EINTR)
			return;
		if (rc && !peer.id_len) { /* the socket failed, not a client: nobody to answer */
			log_warn("receiving on %s.ctl failed: %s", s->name, err);
			return;
		}
		if (rc) {
			log_warn("rejected a request: %s", err);
			if (peer.id_len)
				service_reply_error(s, &peer, corr, -rc, err);
			continue;
		}
		handle_generic(s, &peer, &req);
		msg_free(&req);
	}
}

static void heartbeat(struct service *s)
{
	struct msg m;
	msg_init(&m, MSG_HEARTBEAT, 0);
	m.heartbeat.service.p = s->name;
	m.heartbeat.service.len = (uint32_t)strlen(s->name);
	m.heartbeat.pid = (uint64_t)getpid();
	m.heartbeat.epoch = s->epoch;
	m.heartbeat.seq = ++s->beat_seq;
	m.heartbeat.uptime_ms = service_uptime_ms(s);
	bus_publish(s->pub, &m);
	/* The counters go out with every beat, so a subscriber sees them without asking. */
	char *json = s->ops->stats ? s->ops->stats(s->ctx) : NULL;
	if (json) {
		msg_init(&m, MSG_STATS, 0);
		m.stats.service.p = s->name;
		m.stats.service.len = (uint32_t)strlen(s->name);
		m.stats.json.p = json;
		m.stats.json.len = (uint32_t)strlen(json);
		bus_publish(s->pub, &m);
		free(json);
	}
}

/* Taken once: the stop it causes stays in s->stop, and a later service in this process (a
 * test's) must not see an old signal as its own. */
static void take_signal(struct service *s)
{
	int sig = got_signal;
	if (sig) {
		got_signal = 0;
		log_info("signal %d: stopping", sig);
		s->stop = true;
		if (!s->reason)
			s->reason = SERVICE_STOP_SIGNAL;
	}
}

int service_poll_once(struct service *s, int timeout_ms)
{
	zmq_pollitem_t items[1 + SERVICE_MAX_FDS];
	items[0] = (zmq_pollitem_t){.socket = s->router, .events = ZMQ_POLLIN};
	for (int i = 0; i < s->n_fds; i++)
		items[1 + i] = (zmq_pollitem_t){.fd = s->fds[i], .events = ZMQ_POLLIN};
	int n = zmq_poll(items, 1 + s->n_fds, timeout_ms);
	if (n < 0 && errno != EINTR)
		log_warn("poll failed: %s", zmq_strerror(errno));
	if (n > 0) {
		for (int i = 0; i < s->n_fds; i++)
			if (items[1 + i].revents & ZMQ_POLLIN)
				s->fd_fns[i](s->ctx, s, s->fds[i]);
		if (items[0].revents & ZMQ_POLLIN)
			drain_router(s);
	}
	uint64_t now = now_ns();
	if (now - s->last_tick_ns >= (uint64_t)s->tick_ms * 1000000ull) {
		s->last_tick_ns = now;
		if (s->ops->tick)
			s->ops->tick(s->ctx, s);
	}
	if (now - s->last_beat_ns >= HEARTBEAT_MS * 1000000ull) {
		s->last_beat_ns = now;
		heartbeat(s);
	}
	take_signal(s);
	return s->stop ? 1 : 0;
}

/* ---- heartbeats from long work (service_beat) ---- */

void service_beat(struct service *s)
{
	if (!s)
		return;
	uint64_t now = now_ns();
	if (now - s->last_beat_ns >= HEARTBEAT_MS * 1000000ull) {
		s->last_beat_ns = now;
		heartbeat(s);
	}
}

bool service_stop_requested(struct service *s)
{
	if (!s)
		return false;
	take_signal(s);
	return s->stop;
}

int service_run(struct service *s)
{
	log_info("serving on %s/%s.ctl (pid %d)", s->run_dir, s->name, (int)getpid());
	while (!s->stop)
		service_poll_once(s, s->tick_ms);
	if (s->ops->stopping)
		s->ops->stopping(s->ctx, s);
	return 0;
}

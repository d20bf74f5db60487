/* pipeline-inspect - a read-only live view of one instance: the supervisor's status, the
 * loader's slots and reads, the runner's weight groups per layer, copies and tokens/s, the
 * kv-store's pool, spill and prefix cache.
 *
 *   pipeline-inspect [--instance NAME] [--run-dir DIR] [--once] [--json] [SERVICE]
 *
 * It listens on the PUB sockets and maps the shared-memory objects read-only (inspect.h): it
 * sends no message to any service and writes nothing, so attaching changes neither what the
 * pipeline computes nor how fast. Exit status: 0; 1 when nothing of the instance is
 * reachable; 2 bad usage. */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/config.h"
#include "common/kv_pool.h"
#include "common/service.h"
#include "common/util.h"
#include "common/weight_ring.h"
#include "tools/inspect/inspect.h"

const char *const inspect_services[INSPECT_N_SERVICES] = {"ssd-loader", "kv-store", "gpu-runner"};

#define SUPERVISOR "supervisor"
#define N_PUBS (1 + INSPECT_N_SERVICES) /* [0]: the supervisor */
#define UP_MS 3000			/* heard from within this: up (three heartbeat periods) */

struct inspector {
	const char *instance, *run_dir, *only;
	void *zctx, *sub;
	struct pub_state pubs[N_PUBS];
	struct shm_view ring, pool;
};

static volatile sig_atomic_t quit_signal, resized;

static void on_quit(int sig)
{
	quit_signal = sig;
}

static void on_winch(int sig)
{
	resized = 1;
}

/* ---- listening ---- */

static struct pub_state *pub_find(struct inspector *in, const struct bytes *name)
{
	for (int i = 0; i < N_PUBS; i++)
		if (name->p && name->len == strlen(in->pubs[i].name) && !memcmp(name->p, in->pubs[i].name, name->len))
			return &in->pubs[i];
	return NULL;
}

static void on_message(struct inspector *in, const struct msg *m)
{
	struct pub_state *p;
	uint64_t now = now_ns();
	if (m->type == MSG_HEARTBEAT && (p = pub_find(in, &m->heartbeat.service)) != NULL) {
		if (p->beat_ns && p->epoch != m->heartbeat.epoch) { /* a new process: the old one's counters go */
			json_decref(p->stats);
			p->stats = NULL;
			p->stats_ns = 0;
		}
		p->heard = true;
		p->beat_ns = now;
		p->pid = m->heartbeat.pid;
		p->epoch = m->heartbeat.epoch;
		p->seq = m->heartbeat.seq;
		p->uptime_ms = m->heartbeat.uptime_ms;
	} else if (m->type == MSG_STATS && (p = pub_find(in, &m->stats.service)) != NULL) {
		json_t *j = json_loadb(m->stats.json.p ? m->stats.json.p : "", m->stats.json.len, 0, NULL);
		if (!json_is_object(j)) { /* not a JSON object: keep what we had */
			json_decref(j);
			return;
		}
		json_decref(p->stats);
		p->stats = j;
		p->stats_ns = now;
		p->heard = true;
	}
}

/* Takes every message waiting on the SUB socket, after waiting up to timeout_ms for the first. */
static void drain(struct inspector *in, int timeout_ms)
{
	for (int i = 0; i < 1024; i++) {
		struct msg m;
		char err[256];
		int rc = bus_recv(in->sub, &m, i ? 0 : timeout_ms, err, sizeof(err));
		if (rc == 0)
			on_message(in, &m);
		msg_free(&m);
		if (rc == -ETIMEDOUT || rc == -EINTR || (rc && rc != -EBADMSG && rc != -ENOMSG && rc != -EPROTONOSUPPORT))
			return;
	}
}

/* Is <run-dir>/<name>.pub a socket (someone bound it; maybe a dead process)? */
static bool pub_exists(const struct inspector *in, const char *name)
{
	char path[512];
	struct stat st;
	snprintf(path, sizeof(path), "%s/%s.pub", in->run_dir, name);
	return stat(path, &st) == 0 && S_ISSOCK(st.st_mode);
}

static bool wanted(const struct inspector *in, int i)
{
	return i == 0 || !in->only || !strcmp(in->only, in->pubs[i].name);
}

/* Waits up to wait_ms until every wanted publisher whose socket exists has sent its stats. */
static void wait_first(struct inspector *in, int wait_ms)
{
	uint64_t deadline = now_ns() + (uint64_t)wait_ms * 1000000ull;
	while (!quit_signal) {
		bool done = true;
		for (int i = 0; i < N_PUBS; i++)
			if (wanted(in, i) && !in->pubs[i].stats_ns && pub_exists(in, in->pubs[i].name))
				done = false;
		uint64_t now = now_ns();
		if (done || now >= deadline)
			return;
		uint64_t left = (deadline - now) / 1000000ull;
		drain(in, left < 100 ? (int)left + 1 : 100);
	}
}

/* ---- snapshots ---- */

static bool pub_up(const struct pub_state *p, uint64_t now)
{
	uint64_t last = p->beat_ns > p->stats_ns ? p->beat_ns : p->stats_ns;
	/* A killed process is down at once, not three periods later. */
	return p->heard && now - last < UP_MS * 1000000ull && (!p->pid || pid_alive((int)p->pid));
}

static json_t *ms_since(uint64_t then, uint64_t now)
{
	return then ? json_integer((json_int_t)((now - then) / 1000000ull)) : json_null();
}

static json_t *pub_json(const struct pub_state *p, uint64_t now)
{
	bool up = pub_up(p, now);
	char epoch[20];
	snprintf(epoch, sizeof(epoch), "%016llx", (unsigned long long)p->epoch);
	json_t *o = json_object();
	json_object_set_new(o, "up", json_boolean(up));
	json_object_set_new(o, "pid", p->heard ? json_integer((json_int_t)p->pid) : json_null());
	json_object_set_new(o, "epoch", p->beat_ns ? json_string(epoch) : json_null());
	/* The uptime the last beat said, carried forward to now. */
	json_object_set_new(o, "uptime_ms", up && p->beat_ns ? json_integer((json_int_t)(p->uptime_ms + (now - p->beat_ns) / 1000000ull))
							      : json_null());
	json_object_set_new(o, "heartbeat_age_ms", ms_since(p->beat_ns, now));
	json_object_set_new(o, "stats_age_ms", ms_since(p->stats_ns, now));
	return o;
}

/* A new object with the listed keys of src (those it has). */
static json_t *pick(json_t *src, const char *const *keys)
{
	json_t *o = json_object();
	for (; o && *keys; keys++) {
		json_t *v = json_object_get(src, *keys);
		if (v)
			json_object_set(o, *keys, v);
	}
	return o;
}

static double wall_time(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (double)ts.tv_sec + (double)(ts.tv_nsec / 1000000) / 1e3;
}

/* The snapshot (see docs/operations.md); *reachable: anything of the instance is alive. */
static json_t *snapshot(struct inspector *in, bool *reachable)
{
	uint64_t now = now_ns();
	json_t *ring = shm_view_ring(&in->ring), *pool = shm_view_pool(&in->pool);
	*reachable = jnum(ring, "owner_alive", 0) || jnum(pool, "owner_alive", 0);
	json_t *snap = json_object();
	json_object_set_new(snap, "instance", json_string(in->instance));
	json_object_set_new(snap, "run_dir", json_string(in->run_dir));
	json_object_set_new(snap, "time", json_real(wall_time()));
	struct pub_state *sp = &in->pubs[0];
	json_t *sup = pub_json(sp, now);
	bool sup_up = pub_up(sp, now);
	json_object_set(sup, "status", sup_up && sp->stats ? sp->stats : json_null());
	json_object_set_new(snap, "supervisor", sup);
	*reachable = *reachable || sup_up;
	json_t *svcs = json_object();
	for (int i = 1; i < N_PUBS; i++) {
		struct pub_state *p = &in->pubs[i];
		bool up = pub_up(p, now);
		*reachable = *reachable || up;
		if (!wanted(in, i))
			continue;
		json_t *s = pub_json(p, now);
		json_object_set(s, "stats", up && p->stats ? p->stats : json_null());
		if (!strcmp(p->name, "ssd-loader")) {
			json_object_set(s, "shm", ring);
		} else if (!strcmp(p->name, "kv-store")) {
			json_object_set(s, "shm", pool);
		} else {
			/* The runner owns no object; its cache lines in both, and what the table needs. */
			static const char *const ring_keys[] = {"name", "attached", "error", "n_layers", "groups",
								"pinned", "runner", NULL};
			static const char *const pool_keys[] = {"name", "attached", "error", "n_blocks", "block_bytes",
								"blocks", "spill_used", "n_spill_slots", "runner", NULL};
			json_object_set_new(s, "shm", json_pack("{s:o, s:o}", "ring", pick(ring, ring_keys), "pool",
								pick(pool, pool_keys)));
		}
		json_object_set_new(svcs, p->name, s);
	}
	json_object_set_new(snap, "services", svcs);
	json_decref(ring);
	json_decref(pool);
	return snap;
}

/* ---- the terminal ---- */

static struct termios saved_tio;
static bool tio_saved, screen_on;

static void term_restore(void)
{
	if (screen_on) {
		fputs("\033[?25h\033[?1049l", stdout); /* cursor back, main screen back */
		fflush(stdout);
		screen_on = false;
	}
	if (tio_saved) {
		tcsetattr(STDIN_FILENO, TCSANOW, &saved_tio);
		tio_saved = false;
	}
}

static void term_enter(void)
{
	if (isatty(STDIN_FILENO) && tcgetattr(STDIN_FILENO, &saved_tio) == 0) {
		struct termios t = saved_tio;
		t.c_lflag &= ~(tcflag_t)(ICANON | ECHO); /* keys one by one, unechoed; Ctrl-C still signals */
		t.c_cc[VMIN] = 0;
		t.c_cc[VTIME] = 0;
		if (tcsetattr(STDIN_FILENO, TCSANOW, &t) == 0)
			tio_saved = true;
	}
	fputs("\033[?1049h\033[?25l\033[H\033[2J", stdout); /* the alternate screen, no cursor */
	fflush(stdout);
	screen_on = true;
	atexit(term_restore);
}

static void term_size(int *cols, int *rows)
{
	struct winsize ws;
	*cols = 100;
	*rows = 0;
	if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) {
		*cols = ws.ws_col;
		*rows = ws.ws_row;
	}
}

/* Redraws the screen in one write: home, the lines (each clearing its rest), clear below. */
static int draw_screen(json_t *snap, const char *only)
{
	int cols, rows;
	term_size(&cols, &rows);
	char *text = NULL;
	size_t len = 0;
	FILE *m = open_memstream(&text, &len);
	if (!m)
		return -ENOMEM;
	render_text(m, snap, only, cols, "\033[K\n");
	fprintf(m, "\033[K\n(q quits; refreshed every second; read-only: nothing is sent to the services)\033[K\n");
	fclose(m);
	/* Keep within the screen: the lines past its last row would scroll the view. */
	size_t keep = len;
	if (rows > 1) {
		int n = 0;
		for (size_t i = 0; i < len; i++)
			if (text[i] == '\n' && ++n == rows - 1) {
				keep = i + 1;
				break;
			}
	}
	fputs("\033[H", stdout);
	fwrite(text, 1, keep, stdout);
	fputs("\033[J", stdout);
	free(text);
	return fflush(stdout) == 0 ? 0 : -EIO;
}

/* Reads the keys waiting: returns true on q. */
static bool read_keys(void)
{
	char c[64];
	ssize_t n = read(STDIN_FILENO, c, sizeof(c));
	for (ssize_t i = 0; i < n; i++)
		if (c[i] == 'q' || c[i] == 'Q' || c[i] == 3)
			return true;
	return false;
}

/* ---- main ---- */

static int print_once(json_t *snap, const char *only, bool json)
{
	if (json) {
		char *t = json_dumps(snap, JSON_INDENT(2) | JSON_REAL_PRECISION(15));
		if (t)
			printf("%s\n", t);
		free(t);
	} else {
		render_text(stdout, snap, only, 0, "\n");
	}
	return fflush(stdout) == 0 ? 0 : -EIO;
}

int main(int argc, char **argv)
{
	struct inspector in = {0};
	bool once = false, json = false;
	long interval_ms = 1000, wait_ms = 2500;
	char default_run_dir[256];
	char **pos = calloc((size_t)argc + 1, sizeof(*pos)); /* config_parse: room for every argument */
	int n_pos = 0;
	if (!pos) {
		fprintf(stderr, "pipeline-inspect: out of memory\n");
		return 2;
	}
	const struct opt opts[] = {
		{"instance", OPT_STRING, &in.instance, NULL, "the instance to look at (default \"default\")"},
		{"run-dir", OPT_STRING, &in.run_dir, NULL,
		 "its run directory (default /tmp/llmp-UID/INSTANCE; with --instance: the sockets are in the "
		 "run directory, the shared memory is named by the instance)"},
		{"once", OPT_BOOL, &once, NULL, "print one snapshot and exit (after waiting for each service's stats)"},
		{"json", OPT_BOOL, &json, NULL, "print snapshots as JSON (with --once: one object; else one per line)"},
		{"interval-ms", OPT_INT, &interval_ms, "1000", "time between two refreshes"},
		{"wait-ms", OPT_INT, &wait_ms, "2500", "how long to wait for the first stats of each service"},
		{0},
	};
	int rc = config_parse("pipeline-inspect [SERVICE]",
			      "A live view of one instance, refreshed every second: the supervisor's status, then per "
			      "service\nssd-loader's slots by state and its reads, gpu-runner's weight groups per layer, "
			      "copies, tokens/s\nand KV blocks per tier, kv-store's pool blocks by state, spill queue and "
			      "prefix hits. SERVICE\n(ssd-loader, kv-store or gpu-runner) shows that one only. On a "
			      "terminal: a full screen, q quits;\nelse one snapshot a second as text. Read-only: it "
			      "listens on the services' PUB sockets and maps\ntheir shared memory read-only; it sends "
			      "nothing. Exit status: 0; 1 when no part of the instance\nruns; 2 bad usage.",
			      opts, argc, argv, pos, &n_pos);
	if (rc > 0)
		return 0;
	if (rc < 0)
		return 2;
	if (n_pos > 1) {
		fprintf(stderr, "pipeline-inspect: one SERVICE at most (see --help)\n");
		return 2;
	}
	if (n_pos == 1) {
		for (int i = 0; i < INSPECT_N_SERVICES; i++)
			if (!strcmp(pos[0], inspect_services[i]))
				in.only = inspect_services[i];
		if (!in.only) {
			fprintf(stderr, "pipeline-inspect: unknown service '%s' (one of: ssd-loader, kv-store, gpu-runner)\n",
				pos[0]);
			return 2;
		}
	}
	if (interval_ms < 100 || interval_ms > 3600000 || wait_ms < 0 || wait_ms > 600000) {
		fprintf(stderr, "pipeline-inspect: --interval-ms (100..3600000) or --wait-ms (0..600000) out of range\n");
		return 2;
	}
	/* The sockets come from the run directory and the shared memory from the instance's name: a run
	 * directory alone showed its services beside instance "default"'s ring and pool. */
	if (in.run_dir && !in.instance) {
		fprintf(stderr, "pipeline-inspect: --run-dir needs --instance too (the instance whose run directory "
				"it is: its shared memory is named by it)\n");
		return 2;
	}
	if (!in.instance)
		in.instance = "default";
	if (!*in.instance || strchr(in.instance, '/')) {
		fprintf(stderr, "pipeline-inspect: instance name '%s' must be non-empty and hold no '/'\n", in.instance);
		return 2;
	}
	if (!in.run_dir) {
		if (run_dir_default(in.instance, default_run_dir, sizeof(default_run_dir)) != 0) {
			fprintf(stderr, "pipeline-inspect: run directory path too long\n");
			return 2;
		}
		in.run_dir = default_run_dir;
	}
	in.pubs[0].name = SUPERVISOR;
	for (int i = 0; i < INSPECT_N_SERVICES; i++)
		in.pubs[1 + i].name = inspect_services[i];
	shm_view_init(&in.ring, in.instance, "weights", SHM_KIND_WEIGHT_RING, WRING_LAYOUT_VERSION);
	shm_view_init(&in.pool, in.instance, "kv", SHM_KIND_KV_POOL, KVPOOL_LAYOUT_VERSION);

	struct sigaction sa = {.sa_handler = on_quit};
	sigemptyset(&sa.sa_mask);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGHUP, &sa, NULL);
	sa.sa_handler = on_winch;
	sigaction(SIGWINCH, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);

	/* One SUB for every PUB: it connects before a socket is bound and reconnects to each new
	 * process on its own (ZeroMQ), so a restarted service is heard again without us. */
	int status = 0;
	in.zctx = zmq_ctx_new();
	for (int i = 0; in.zctx && i < N_PUBS; i++) {
		char ep[300];
		if (bus_endpoint(in.run_dir, in.pubs[i].name, "pub", ep, sizeof(ep)) != 0) {
			fprintf(stderr, "pipeline-inspect: the run directory path is too long for a socket: %s\n", in.run_dir);
			status = 2;
			goto out;
		}
		if (!in.sub)
			in.sub = bus_connect_sub(in.zctx, ep);
		else if (zmq_connect(in.sub, ep) != 0) {
			zmq_close(in.sub);
			in.sub = NULL;
		}
		if (!in.sub)
			break;
	}
	if (!in.sub) {
		fprintf(stderr, "pipeline-inspect: cannot subscribe to %s/*.pub: %s\n", in.run_dir, zmq_strerror(errno));
		status = 1;
		goto out;
	}

	wait_first(&in, (int)wait_ms);
	bool reachable;
	json_t *snap = snapshot(&in, &reachable);
	if (!reachable) {
		fprintf(stderr, "pipeline-inspect: no instance %s running (run dir %s)\n", in.instance, in.run_dir);
		json_decref(snap);
		status = 1;
		goto out;
	}
	if (once) {
		if (print_once(snap, in.only, json) != 0)
			status = 1;
		json_decref(snap);
		goto out;
	}

	bool screen = isatty(STDOUT_FILENO) && !json;
	if (screen)
		term_enter();
	uint64_t next = now_ns();
	while (!quit_signal) {
		if (!snap)
			snap = snapshot(&in, &reachable);
		int out_rc;
		if (screen) {
			out_rc = draw_screen(snap, in.only);
		} else if (json) {
			char *t = json_dumps(snap, JSON_COMPACT | JSON_REAL_PRECISION(15));
			out_rc = t && printf("%s\n", t) < 0 ? -EIO : 0;
			free(t);
			out_rc = fflush(stdout) == 0 ? out_rc : -EIO;
		} else {
			render_text(stdout, snap, in.only, 0, "\n");
			printf("\n");
			out_rc = fflush(stdout) == 0 ? 0 : -EIO;
		}
		json_decref(snap);
		snap = NULL;
		if (out_rc) /* the reader went away (a closed pipe) */
			break;
		next += (uint64_t)interval_ms * 1000000ull;
		uint64_t now = now_ns();
		if (next < now)
			next = now + (uint64_t)interval_ms * 1000000ull;
		/* Listen (and read keys) until the next refresh. */
		while (!quit_signal && !resized && (now = now_ns()) < next) {
			zmq_pollitem_t items[2] = {{.socket = in.sub, .events = ZMQ_POLLIN},
						   {.fd = STDIN_FILENO, .events = ZMQ_POLLIN}};
			long left = (long)((next - now) / 1000000ull) + 1;
			int n = zmq_poll(items, tio_saved ? 2 : 1, left);
			if (n < 0 && errno != EINTR)
				break;
			if (n > 0 && (items[0].revents & ZMQ_POLLIN))
				drain(&in, 0);
			if (n > 0 && tio_saved && (items[1].revents & ZMQ_POLLIN) && read_keys())
				quit_signal = SIGINT;
		}
		if (resized) {
			resized = 0;
			next = now_ns();
		}
	}
	json_decref(snap);
	term_restore();

out:
	for (int i = 0; i < N_PUBS; i++)
		json_decref(in.pubs[i].stats);
	shm_view_close(&in.ring);
	shm_view_close(&in.pool);
	if (in.sub)
		zmq_close(in.sub);
	if (in.zctx)
		zmq_ctx_term(in.zctx);
	return status;
}

/* client.c - the commands that talk to a running supervisor: status, wait, shutdown, restart.
 * scripts/pipeline runs them; each prints what it found and returns an exit status. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/proc.h"
#include "common/util.h"
#include "tools/supervisor/supervisor.h"

#define POLL_MS 100
#define CALL_TIMEOUT_MS 5000
#define MAX_MISSED_CALLS 3 /* STATS unanswered this many times in a row: the supervisor is stuck */

struct conn {
	const char *run_dir;
	void *zctx;
	struct rpc_client *c;
};

static int conn_open(struct conn *k, const char *run_dir)
{
	k->run_dir = run_dir;
	k->zctx = zmq_ctx_new();
	if (!k->zctx) {
		fprintf(stderr, "pipeline-supervisor: cannot create a ZeroMQ context: %s\n", strerror(errno));
		return -ENOMEM;
	}
	k->c = rpc_client_create(k->zctx, run_dir, SUP_NAME, "pipeline-supervisor");
	if (!k->c) {
		int rc = -errno;
		fprintf(stderr, "pipeline-supervisor: cannot open a client of the supervisor in %s: %s\n", run_dir,
			strerror(errno));
		zmq_ctx_term(k->zctx);
		return rc;
	}
	return 0;
}

static void conn_close(struct conn *k)
{
	rpc_client_destroy(&k->c);
	if (k->zctx)
		zmq_ctx_term(k->zctx);
	k->zctx = NULL;
}

int sup_read_pid_file(const char *run_dir, const char *name)
{
	char path[PATH_MAX], buf[32];
	snprintf(path, sizeof(path), "%s/%s.pid", run_dir, name);
	FILE *f = fopen(path, "r");
	if (!f)
		return 0;
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	char *end;
	long pid = strtol(buf, &end, 10);
	return pid > 0 && pid < INT32_MAX && (*end == '\n' || *end == 0) ? (int)pid : 0;
}

/* Asks for the status. Returns the JSON (caller decrefs) after checking its shape, or NULL with
 * *rc_out the rpc failure (-ETIMEDOUT, ...) and a message in err. */
static json_t *fetch_status(struct conn *k, int timeout_ms, int *rc_out, char *err, size_t errlen)
{
	struct msg req, rep;
	json_t *j = NULL;
	msg_init(&req, MSG_STATS_GET, 0);
	int rc = rpc_call(k->c, &req, &rep, timeout_ms);
	*rc_out = rc;
	if (rc == -ETIMEDOUT) {
		snprintf(err, errlen, "the supervisor did not answer in %d s (run dir %s)", timeout_ms / 1000, k->run_dir);
		rpc_client_reset(k->c);
		goto out;
	}
	if (rc == -EREMOTEIO) {
		snprintf(err, errlen, "the supervisor answered: %s", rep.error.text.p ? rep.error.text.p : "(no text)");
		goto out;
	}
	if (rc) {
		snprintf(err, errlen, "asking the supervisor failed: %s", strerror(-rc));
		goto out;
	}
	*rc_out = -EBADMSG;
	if (rep.type != MSG_STATS || !rep.stats.service.p || strcmp(rep.stats.service.p, SUP_NAME) != 0) {
		snprintf(err, errlen, "%s/%s.ctl answered STATS_GET with %s, not the supervisor's status", k->run_dir,
			 SUP_NAME, msg_type_name(rep.type));
		goto out;
	}
	json_error_t jerr;
	j = json_loadb(rep.stats.json.p, rep.stats.json.len, 0, &jerr);
	json_t *services = j ? json_object_get(j, "services") : NULL;
	bool ok = json_is_object(json_object_get(j, "supervisor")) && json_is_object(services);
	for (int i = 0; ok && i < SUP_N_SERVICES; i++)
		ok = json_is_object(json_object_get(services, sup_service_names[i]));
	if (!ok) {
		snprintf(err, errlen, "the supervisor's status is not the JSON expected (%s)", j ? "fields missing" : jerr.text);
		json_decref(j);
		j = NULL;
		goto out;
	}
	*rc_out = 0;
out:
	msg_free(&rep);
	return j;
}

static json_t *service_obj(json_t *status, const char *name)
{
	return json_object_get(json_object_get(status, "services"), name);
}

/* The i-th of the names a service may have (sup_service_name) into name, and whether the status
 * has that service (the three always). Loops go over every i < SUP_MAX_SERVICES: a runner of a
 * rank not run leaves a gap before http-api. */
static bool service_at(json_t *status, int i, char *name, size_t len)
{
	if (i >= SUP_MAX_SERVICES)
		return false;
	sup_service_name(i, name, len);
	return i < SUP_N_SERVICES || service_obj(status, name) != NULL;
}

static const char *str_field(json_t *o, const char *key, const char *def)
{
	json_t *v = json_object_get(o, key);
	return json_is_string(v) ? json_string_value(v) : def;
}

static long long int_field(json_t *o, const char *key, long long def)
{
	json_t *v = json_object_get(o, key);
	return json_is_number(v) ? (long long)json_number_value(v) : def;
}

static bool all_up(json_t *status)
{
	char name[32];
	for (int i = 0; i < SUP_MAX_SERVICES; i++)
		if (service_at(status, i, name, sizeof(name)) &&
		    strcmp(str_field(service_obj(status, name), "state", ""), "up") != 0)
			return false;
	return true;
}

void sup_print_log_tail(const char *run_dir, const char *name, int lines)
{
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/%s.log", run_dir, name);
	FILE *f = fopen(path, "r");
	if (!f)
		return;
	/* The last 64 KiB hold the lines wanted unless they are very long. */
	static char buf[65536];
	fseek(f, 0, SEEK_END);
	long size = ftell(f);
	long start = size > (long)sizeof(buf) - 1 ? size - (long)sizeof(buf) + 1 : 0;
	fseek(f, start, SEEK_SET);
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	if (n && buf[n - 1] == '\n')
		buf[--n] = 0;
	char *p = buf + n;
	int found = 0;
	while (p > buf && found < lines) {
		p--;
		if (*p == '\n')
			found++;
	}
	if (*p == '\n')
		p++;
	fprintf(stderr, "---- last lines of %s:\n", path);
	for (char *line = p; line && *line;) {
		char *nl = strchr(line, '\n');
		fprintf(stderr, "  | %.*s\n", nl ? (int)(nl - line) : (int)strlen(line), line);
		line = nl ? nl + 1 : NULL;
	}
}

void sup_format_duration(double s, char *buf, size_t len)
{
	long t = (long)s;
	if (t >= 86400)
		snprintf(buf, len, "%ldd%02ldh%02ldm", t / 86400, t % 86400 / 3600, t % 3600 / 60);
	else if (t >= 3600)
		snprintf(buf, len, "%ldh%02ldm%02lds", t / 3600, t % 3600 / 60, t % 60);
	else if (t >= 60)
		snprintf(buf, len, "%ldm%02lds", t / 60, t % 60);
	else
		snprintf(buf, len, "%lds", t);
}

static void sleep_ms(int ms)
{
	struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

/* Checks that a supervisor answers in run_dir before a command talks to it. */
static bool supervisor_socket_exists(const char *run_dir)
{
	char path[PATH_MAX];
	struct stat st;
	snprintf(path, sizeof(path), "%s/%s.ctl", run_dir, SUP_NAME);
	if (stat(path, &st) == 0)
		return true;
	fprintf(stderr, "pipeline-supervisor: no supervisor runs in %s (no %s)\n", run_dir, path);
	return false;
}

int sup_client_status(const char *run_dir, bool json, long timeout_s)
{
	if (!supervisor_socket_exists(run_dir))
		return SUP_EXIT_FAIL;
	struct conn k;
	if (conn_open(&k, run_dir) != 0)
		return SUP_EXIT_FAIL;
	char err[512];
	int rc;
	int status = SUP_EXIT_FAIL;
	json_t *j = fetch_status(&k, (int)(timeout_s > 0 ? timeout_s * 1000 : CALL_TIMEOUT_MS), &rc, err, sizeof(err));
	if (!j) {
		fprintf(stderr, "pipeline-supervisor: %s\n", err);
		goto out_conn;
	}
	if (json) {
		char *text = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
		if (text)
			printf("%s\n", text);
		free(text);
	} else {
		json_t *me = json_object_get(j, "supervisor");
		char up[32];
		sup_format_duration(json_number_value(json_object_get(me, "uptime_s")), up, sizeof(up));
		printf("instance %s, run dir %s\n", str_field(me, "instance", "?"), str_field(me, "run_dir", "?"));
		printf("supervisor pid %lld, %s, up %s (heartbeat %lld ms, hung after %lld ms, at most %lld restarts "
		       "in %lld s)\n",
		       int_field(me, "pid", 0), str_field(me, "state", "?"), up, int_field(me, "heartbeat_ms", 0),
		       int_field(me, "hang_ms", 0), int_field(me, "burst_limit", 0), int_field(me, "burst_window_s", 0));
		printf("%-12s %-8s %-10s %-7s %-9s %-8s %-20s %s\n", "service", "pid", "state", "health", "uptime",
		       "restarts", "last exit", "last error");
		char name[32];
		for (int i = 0; i < SUP_MAX_SERVICES; i++) {
			if (!service_at(j, i, name, sizeof(name)))
				continue;
			json_t *o = service_obj(j, name);
			char pid[16] = "-", uptime[32] = "-";
			if (json_is_integer(json_object_get(o, "pid")))
				snprintf(pid, sizeof(pid), "%lld", int_field(o, "pid", 0));
			if (json_is_number(json_object_get(o, "uptime_s")))
				sup_format_duration(json_number_value(json_object_get(o, "uptime_s")), uptime, sizeof(uptime));
			printf("%-12s %-8s %-10s %-7s %-9s %-8lld %-20s %s\n", name, pid,
			       str_field(o, "state", "?"), str_field(o, "health", "?"), uptime, int_field(o, "restarts", 0),
			       str_field(o, "last_exit", "-"), str_field(o, "last_error", "-"));
		}
	}
	status = all_up(j) ? SUP_EXIT_OK : SUP_EXIT_FAIL;
	json_decref(j);
out_conn:
	conn_close(&k);
	return status;
}

/* Reports a failed service: its error and the end of its log. */
static void report_failed(const char *run_dir, const char *name, json_t *o)
{
	fprintf(stderr, "pipeline-supervisor: %s failed: %s\n", name, str_field(o, "last_error", "(no error recorded)"));
	sup_print_log_tail(run_dir, name, 20);
}

/* The supervisor is gone or stuck: says so with the end of its log. */
static void report_supervisor_lost(const char *run_dir, int pid, const char *err)
{
	if (pid && !proc_running(pid))
		fprintf(stderr, "pipeline-supervisor: the supervisor (pid %d) exited\n", pid);
	else
		fprintf(stderr, "pipeline-supervisor: %s\n", err);
	sup_print_log_tail(run_dir, SUP_NAME, 20);
}

int sup_client_wait(const char *run_dir, long timeout_s)
{
	struct conn k;
	if (conn_open(&k, run_dir) != 0)
		return SUP_EXIT_FAIL;
	int pid = sup_read_pid_file(run_dir, SUP_NAME);
	uint64_t deadline = timeout_s > 0 ? now_ns() + (uint64_t)timeout_s * 1000000000ull : 0;
	bool announced[SUP_MAX_SERVICES] = {false};
	int missed = 0, status = SUP_EXIT_FAIL;
	char err[512] = "";
	for (;;) {
		int rc;
		json_t *j = fetch_status(&k, CALL_TIMEOUT_MS, &rc, err, sizeof(err));
		if (!j) {
			if ((pid && !proc_running(pid)) || ++missed >= MAX_MISSED_CALLS || rc == -EBADMSG) {
				report_supervisor_lost(run_dir, pid, err);
				break;
			}
			continue;
		}
		missed = 0;
		if (!pid)
			pid = (int)int_field(json_object_get(j, "supervisor"), "pid", 0);
		bool failed = false;
		char name[32];
		for (int i = 0; i < SUP_MAX_SERVICES; i++) {
			if (!service_at(j, i, name, sizeof(name)))
				continue;
			json_t *o = service_obj(j, name);
			const char *state = str_field(o, "state", "");
			if (!strcmp(state, "up") && !announced[i]) {
				announced[i] = true;
				printf("%s ready (pid %lld)\n", name, int_field(o, "pid", 0));
				fflush(stdout);
			} else if (!strcmp(state, "failed")) {
				report_failed(run_dir, name, o);
				failed = true;
			}
		}
		bool done = all_up(j);
		json_decref(j);
		if (failed)
			break;
		if (done) {
			status = SUP_EXIT_OK;
			break;
		}
		if (deadline && now_ns() > deadline) {
			fprintf(stderr, "pipeline-supervisor: the services were not all up after %ld s\n", timeout_s);
			break;
		}
		sleep_ms(POLL_MS);
	}
	conn_close(&k);
	return status;
}

int sup_ask_shutdown(const char *run_dir, const char *name, int timeout_ms, char *err, size_t errlen)
{
	char path[PATH_MAX];
	struct stat st;
	snprintf(path, sizeof(path), "%s/%s.ctl", run_dir, name);
	if (stat(path, &st) != 0)
		return errorf(err, errlen, -ENOENT, "no socket %s", path);
	void *zctx = zmq_ctx_new();
	if (!zctx)
		return errorf(err, errlen, -ENOMEM, "cannot create a ZeroMQ context: %s", strerror(errno));
	int rc;
	struct rpc_client *c = rpc_client_create(zctx, run_dir, name, "pipeline-supervisor");
	if (!c) {
		rc = errorf(err, errlen, -errno, "cannot open a client of %s: %s", name, strerror(errno));
		goto out_ctx;
	}
	struct msg req, rep;
	msg_init(&req, MSG_SHUTDOWN, 0);
	rc = rpc_call(c, &req, &rep, timeout_ms);
	if (rc)
		errorf(err, errlen, rc, "%s", strerror(-rc));
	else if (rep.type != MSG_OK)
		rc = errorf(err, errlen, -EBADMSG, "%s", msg_type_name(rep.type));
	msg_free(&rep);
	rpc_client_destroy(&c);
out_ctx:
	zmq_ctx_term(zctx);
	return rc;
}

bool sup_wait_exit(int pid, long timeout_ms)
{
	uint64_t deadline = now_ns() + (uint64_t)timeout_ms * 1000000ull;
	while (proc_running(pid)) {
		if (now_ns() > deadline)
			return false;
		sleep_ms(50);
	}
	return true;
}

long sup_client_stop_timeout(const char *run_dir, long fallback_s)
{
	struct conn k;
	if (conn_open(&k, run_dir) != 0)
		return fallback_s;
	int rc = 0;
	char err[256];
	json_t *st = fetch_status(&k, 1000, &rc, err, sizeof(err)); /* one that does not answer soon: ours */
	conn_close(&k);
	long t = fallback_s;
	if (st) {
		const long long got = int_field(json_object_get(st, "supervisor"), "stop_timeout_s", 0);
		if (got > t && got <= 86400)
			t = (long)got;
		json_decref(st);
	}
	return t;
}

int sup_client_stop_supervisor(const char *run_dir, int pid, long timeout_s)
{
	char err[256];
	int rc = sup_ask_shutdown(run_dir, SUP_NAME, CALL_TIMEOUT_MS, err, sizeof(err));
	if (rc) {
		/* SIGTERM makes the same orderly stop. */
		fprintf(stderr, "pipeline-supervisor: the supervisor (pid %d) did not acknowledge MSG_SHUTDOWN (%s): "
				"sending SIGTERM\n",
			pid, err);
		kill(pid, SIGTERM);
	}
	if (!sup_wait_exit(pid, timeout_s * 1000)) {
		fprintf(stderr, "pipeline-supervisor: the supervisor (pid %d) did not exit in %ld s\n", pid, timeout_s);
		return -ETIMEDOUT;
	}
	return 0;
}

int sup_client_shutdown(const char *run_dir, long timeout_s)
{
	/* The pid file's number only where that process is this run directory's supervisor: after a
	 * supervisor killed with -9 the number may belong to anything by now. */
	int pid = sup_instance_live_pid(run_dir, SUP_NAME);
	if (!pid) {
		int stale = sup_read_pid_file(run_dir, SUP_NAME);
		if (stale && proc_running(stale))
			fprintf(stderr, "pipeline-supervisor: no supervisor runs in %s (its pid file names pid %d, "
					"which is another program now: left alone)\n",
				run_dir, stale);
		else
			fprintf(stderr, "pipeline-supervisor: no supervisor runs in %s\n", run_dir);
		return SUP_EXIT_FAIL;
	}
	if (sup_client_stop_supervisor(run_dir, pid, timeout_s) != 0)
		return SUP_EXIT_FAIL;
	printf("supervisor (pid %d) stopped the services and exited\n", pid);
	return SUP_EXIT_OK;
}

int sup_client_restart(const char *run_dir, const char *service, long timeout_s)
{
	if (!supervisor_socket_exists(run_dir))
		return SUP_EXIT_FAIL;
	struct conn k;
	if (conn_open(&k, run_dir) != 0)
		return SUP_EXIT_FAIL;
	int status = SUP_EXIT_FAIL, rc;
	char err[512], marker[PATH_MAX];
	json_t *j = fetch_status(&k, CALL_TIMEOUT_MS, &rc, err, sizeof(err));
	if (!j) {
		fprintf(stderr, "pipeline-supervisor: %s\n", err);
		goto out_conn;
	}
	int sup_pid = (int)int_field(json_object_get(j, "supervisor"), "pid", 0);
	json_t *o = service_obj(j, service);
	if (!o) {
		/* Not a service of this instance (another rank's runner, http-api without --http): the
		 * supervisor would never take the request, and the wait would run to its end. */
		char names[512] = "", name[32];
		size_t at = 0;
		for (int i = 0; i < SUP_MAX_SERVICES; i++)
			if (service_at(j, i, name, sizeof(name)) && at < sizeof(names))
				at += (size_t)snprintf(names + at, sizeof(names) - at, "%s%s", at ? ", " : "", name);
		fprintf(stderr, "pipeline-supervisor: the instance runs no %s (it runs %s)\n", service, names);
		json_decref(j);
		status = SUP_EXIT_NO_SERVICE;
		goto out_conn;
	}
	/* Launches, not restarts: a service not launched yet (a runner while its peers come up) is
	 * launched by the request without its restart count moving. */
	long long before = int_field(o, "launches", 0), old_pid = int_field(o, "pid", 0);
	json_decref(j);

	snprintf(marker, sizeof(marker), "%s/%s.restart", run_dir, service);
	int fd = open(marker, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0) {
		fprintf(stderr, "pipeline-supervisor: cannot write %s: %s\n", marker, strerror(errno));
		goto out_conn;
	}
	dprintf(fd, "restart asked for by pid %d\n", (int)getpid());
	close(fd);
	/* The supervisor also looks for the marker every 100 ms; the signal makes it look now. */
	if (sup_pid > 0)
		kill(sup_pid, SIGUSR1);

	uint64_t deadline = now_ns() + (uint64_t)timeout_s * 1000000000ull;
	int missed = 0;
	for (;;) {
		sleep_ms(POLL_MS);
		bool taken = access(marker, F_OK) != 0;
		j = fetch_status(&k, CALL_TIMEOUT_MS, &rc, err, sizeof(err));
		if (!j) {
			if (!proc_running(sup_pid) || ++missed >= MAX_MISSED_CALLS || rc == -EBADMSG) {
				report_supervisor_lost(run_dir, sup_pid, err);
				break;
			}
			continue;
		}
		missed = 0;
		o = service_obj(j, service);
		const char *state = str_field(o, "state", "");
		long long launches = int_field(o, "launches", 0), pid = int_field(o, "pid", 0);
		bool done = taken && launches > before && !strcmp(state, "up");
		bool failed = taken && launches > before && !strcmp(state, "failed");
		if (done) {
			if (old_pid)
				printf("%s restarted (pid %lld -> %lld)\n", service, old_pid, pid);
			else
				printf("%s started (pid %lld)\n", service, pid);
			status = SUP_EXIT_OK;
		} else if (failed) {
			report_failed(run_dir, service, o);
		}
		json_decref(j);
		if (done || failed)
			break;
		if (now_ns() > deadline) {
			fprintf(stderr, "pipeline-supervisor: %s was not up again after %ld s (%s)\n", service, timeout_s,
				taken ? "the supervisor took the request" : "the supervisor did not take the request");
			unlink(marker);
			break;
		}
	}
out_conn:
	conn_close(&k);
	return status;
}

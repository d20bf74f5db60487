/* http-api - an OpenAI-compatible HTTP front door to the model of a running instance.
 *
 *   http-api [--instance NAME] [--run-dir DIR] [--listen ADDR:PORT] [options]
 *
 * It serves GET /health, GET /metrics, GET /v1/models, POST /v1/completions and POST
 * /v1/chat/completions (server.h), and generates by sending MSG_GENERATE to the instance's gpu-runner as pipectl
 * generate does (runner_client.h), up to --concurrency requests at once (the runner batches
 * them); the others wait in a queue of --max-queue. It logs "listening on http://ADDR:PORT" once it serves.
 *
 * Like the other services it runs common/service.h's loop on its main thread (<run-dir>/http-api.ctl
 * and .pub: HELLO, PING, STATS_GET, heartbeats), so that the supervisor can start it (start --http),
 * see it hang or die and start it again; the HTTP connections are served on libmicrohttpd's threads
 * meanwhile. It stops on MSG_SHUTDOWN, SIGTERM or SIGINT. Exit status: 0 after a stop, 1 when it
 * could not start, 2 bad usage. */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/config.h"
#include "common/log.h"
#include "common/service.h"
#include "common/util.h"
#include "services/http-api/runner_client.h"
#include "services/http-api/server.h"

#define PROG "http-api"
#define MAX_TOKENS_LIMIT (1L << 20)
#define API_KEY_MAX 4096

/* Reads the bearer token from path: its first line, surrounding blanks dropped. */
static int read_api_key(const char *path, char *buf, size_t len)
{
	FILE *f = fopen(path, "r");
	if (!f) {
		fprintf(stderr, "%s: --api-key-file %s: %s\n", PROG, path, strerror(errno));
		return -1;
	}
	if (!fgets(buf, (int)len, f))
		buf[0] = 0;
	fclose(f);
	size_t n = strcspn(buf, "\r\n");
	buf[n] = 0;
	while (n && (buf[n - 1] == ' ' || buf[n - 1] == '\t'))
		buf[--n] = 0;
	size_t start = strspn(buf, " \t");
	memmove(buf, buf + start, n - start + 1);
	if (!*buf) {
		fprintf(stderr, "%s: --api-key-file %s holds no key on its first line\n", PROG, path);
		return -1;
	}
	return 0;
}

/* Splits "ADDR:PORT" (ADDR an IPv4 address; "localhost" is 127.0.0.1). */
static int parse_listen(const char *text, char *addr, size_t len, uint16_t *port)
{
	const char *colon = strrchr(text, ':');
	if (!colon || colon == text || (size_t)(colon - text) >= len) {
		fprintf(stderr, "%s: --listen '%s' is not ADDR:PORT (e.g. 127.0.0.1:8000)\n", PROG, text);
		return -1;
	}
	char *end;
	errno = 0;
	long p = strtol(colon + 1, &end, 10);
	if (errno || end == colon + 1 || *end || p < 0 || p > 65535) {
		fprintf(stderr, "%s: --listen '%s': the port must be 0..65535\n", PROG, text);
		return -1;
	}
	memcpy(addr, text, (size_t)(colon - text));
	addr[colon - text] = 0;
	if (!strcmp(addr, "localhost"))
		str_copy(addr, len, "127.0.0.1");
	*port = (uint16_t)p;
	return 0;
}

/* What MSG_STATS carries: where it listens. */
struct api_status {
	char listen[96];
	unsigned port;
};

static char *stats_json(void *ctx)
{
	const struct api_status *st = ctx;
	json_t *o = json_pack("{s:s, s:i}", "listen", st->listen, "port", (json_int_t)st->port);
	char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
	json_decref(o);
	return text;
}

int main(int argc, char **argv)
{
	const char *instance = NULL, *run_dir_opt = NULL, *listen = NULL, *key_file = NULL, *model_id = NULL,
		   *level = NULL, *name = NULL, *cors = NULL;
	uint64_t max_body = 0, send_buffer = 0;
	long max_queue = 0, concurrency = 0, max_connections = 0, default_max_tokens = 0, timeout_s = 0, hello_ms = 0, resume_s = 0,
	     idle_s = 0, per_ip = 0;
	struct opt opts[] = {
		{"instance", OPT_STRING, &instance, "default", "the instance whose model is served"},
		{"run-dir", OPT_STRING, &run_dir_opt, NULL, "its run directory (default /tmp/llmp-<uid>/<instance>)"},
		{"listen", OPT_STRING, &listen, "127.0.0.1:8000",
		 "ADDR:PORT to listen on (an IPv4 address; port 0: any)"},
		{"api-key-file", OPT_STRING, &key_file, NULL,
		 "a file whose first line is the key every request but /health and /metrics must send as "
		 "'Authorization: Bearer KEY'"},
		{"max-body", OPT_SIZE, &max_body, "1MiB", "the largest request body taken (larger: 413)"},
		{"concurrency", OPT_INT, &concurrency, "16",
		 "requests sent to gpu-runner at once (it computes them together, up to its --max-batch; more "
		 "wait here)"},
		{"max-queue", OPT_INT, &max_queue, "64",
		 "requests that may wait for the model behind those it serves (more: 429)"},
		{"max-connections", OPT_INT, &max_connections, "0", "connections served at once (0: max-queue + 32)"},
		{"max-connections-per-ip", OPT_INT, &per_ip, "0",
		 "connections one client address may hold at once; more are closed unanswered (0: no limit, "
		 "as behind a proxy, where every connection comes from the proxy's address)"},
		{"idle-timeout", OPT_INT, &idle_s, "60",
		 "seconds a connection may send and take nothing before it is closed: a client that sends its "
		 "request too slowly, stops reading its answer, or an idle keep-alive one; not one that waits "
		 "while the model makes its answer (0: never)"},
		{"send-buffer", OPT_SIZE, &send_buffer, "0",
		 "the kernel's send buffer of each connection (SO_SNDBUF; the kernel doubles it): a client that "
		 "stops reading blocks its answer after about this much, then --idle-timeout closes it "
		 "(0: the kernel's default, which grows up to net.ipv4.tcp_wmem's largest, 4 MiB by default)"},
		{"cors-origin", OPT_STRING, &cors, NULL,
		 "let web pages of this origin (e.g. http://localhost:3000, or * for any) call the API from a "
		 "browser: Access-Control-Allow-Origin on every answer, and OPTIONS preflights answered "
		 "(default: none, as a browser then refuses such calls; the API key still applies)"},
		{"model-id", OPT_STRING, &model_id, NULL,
		 "the model's name in replies (default: the checkpoint's file or directory name, from ssd-loader)"},
		{"default-max-tokens", OPT_INT, &default_max_tokens, "256", "max_tokens of a request that gives none"},
		{"timeout", OPT_INT, &timeout_s, "600", "seconds gpu-runner may be silent during a generation"},
		{"hello-timeout-ms", OPT_INT, &hello_ms, "2000",
		 "how long gpu-runner may take to answer HELLO; a runner that still listens (busy in a long step) "
		 "is asked again until --timeout, one that is gone counts as unavailable (503)"},
		{"resume-timeout", OPT_INT, &resume_s, "60",
		 "seconds to wait for a gpu-runner that died during a request to be started again; the request "
		 "then goes on where it was cut off (0: fail it at once; a third death during one request fails "
		 "it too)"},
		{"log-level", OPT_STRING, &level, "info", "debug, info, warn or error"},
		{"name", OPT_STRING, &name, PROG,
		 "its name in the run directory (NAME.ctl and NAME.pub: HELLO, stats and heartbeats for the "
		 "supervisor and the tools); a second http-api of one instance needs a name of its own"},
		{0},
	};
	int rc = config_parse(PROG,
			      "An OpenAI-compatible HTTP server for the model of a running instance: GET /health, GET "
			      "/metrics (Prometheus), GET /v1/models, POST /v1/completions and POST "
			      "/v1/chat/completions (with \"stream\": true, server-sent events). It generates through "
			      "the instance's gpu-runner, several requests at once. Clients connect with base_url "
			      "http://ADDR:PORT/v1.",
			      opts, argc, argv, NULL, NULL);
	if (rc > 0)
		return 0;
	if (rc < 0)
		return 2;
	log_init(PROG);
	enum log_level lv;
	if (log_parse_level(level, &lv) != 0) {
		fprintf(stderr, "%s: --log-level '%s' is not one of debug, info, warn, error\n", PROG, level);
		return 2;
	}
	log_set_level(lv);
	if (!*instance || strchr(instance, '/')) {
		fprintf(stderr, "%s: instance name '%s' must be non-empty and hold no '/'\n", PROG, instance);
		return 2;
	}
	if (!*name || strlen(name) > 32 || strspn(name, "abcdefghijklmnopqrstuvwxyz0123456789-_") != strlen(name)) {
		fprintf(stderr, "%s: --name '%s': 1 to 32 of a-z, 0-9, '-' and '_'\n", PROG, name);
		return 2;
	}
	if (idle_s < 0 || idle_s > 86400) {
		fprintf(stderr, "%s: --idle-timeout must be in 0..86400 seconds\n", PROG);
		return 2;
	}
	if (cors && *cors) {
		size_t n = strlen(cors);
		bool ok = n <= 256;
		for (size_t i = 0; ok && i < n; i++)
			ok = cors[i] > 0x20 && cors[i] < 0x7f;
		/* An origin is a scheme, a host and maybe a port: no path (a browser's Origin has none, so
		 * one with a path would never match). */
		const char *host = !strncmp(cors, "http://", 7) ? cors + 7 : !strncmp(cors, "https://", 8) ? cors + 8 : NULL;
		if (!ok || (strcmp(cors, "*") && (!host || !*host || strchr(host, '/')))) {
			fprintf(stderr, "%s: --cors-origin '%.64s': *, or an origin such as https://chat.example.com "
				"(a scheme and a host, no path; printable, no spaces, at most 256 bytes)\n", PROG, cors);
			return 2;
		}
	}
	if (send_buffer && (send_buffer < 1024 || send_buffer > (1u << 30))) {
		fprintf(stderr, "%s: --send-buffer must be 0 or 1KiB..1GiB\n", PROG);
		return 2;
	}
	if (max_queue < 0 || max_queue > 100000 || max_connections < 0 || max_connections > 100000 || per_ip < 0 ||
	    per_ip > 100000) {
		fprintf(stderr, "%s: --max-queue, --max-connections and --max-connections-per-ip must be in 0..100000\n",
			PROG);
		return 2;
	}
	if (concurrency < 1 || concurrency > 256) {
		fprintf(stderr, "%s: --concurrency must be in 1..256\n", PROG);
		return 2;
	}
	if (default_max_tokens < 1 || default_max_tokens > MAX_TOKENS_LIMIT || timeout_s < 1 || hello_ms < 1 ||
	    timeout_s > 86400 * 365 || hello_ms > 3600000 || resume_s < 0 || resume_s > 86400) {
		fprintf(stderr,
			"%s: --default-max-tokens must be in 1..%ld, --timeout and --hello-timeout-ms positive, "
			"--resume-timeout in 0..86400\n", PROG,
			MAX_TOKENS_LIMIT);
		return 2;
	}
	if (max_body < 2 || max_body > (1u << 30)) {
		fprintf(stderr, "%s: --max-body must be between 2 bytes and 1GiB\n", PROG);
		return 2;
	}
	char run_dir[256], addr[64];
	uint16_t port;
	if (run_dir_opt && *run_dir_opt ? str_copy(run_dir, sizeof(run_dir), run_dir_opt) != 0
					: run_dir_default(instance, run_dir, sizeof(run_dir)) != 0) {
		fprintf(stderr, "%s: the run directory's path is too long\n", PROG);
		return 2;
	}
	if (parse_listen(listen, addr, sizeof(addr), &port) != 0)
		return 2;
	static char key[API_KEY_MAX];
	if (key_file && read_api_key(key_file, key, sizeof(key)) != 0)
		return 2;

	/* SIGTERM and SIGINT are taken by the service loop on this thread: every thread started from
	 * here blocks them, and this one takes them again once they are started. */
	sigset_t sigs;
	sigemptyset(&sigs);
	sigaddset(&sigs, SIGTERM);
	sigaddset(&sigs, SIGINT);
	pthread_sigmask(SIG_BLOCK, &sigs, NULL);
	signal(SIGPIPE, SIG_IGN);
	signal(SIGHUP, SIG_IGN);

	static struct api_status status;
	static const struct service_ops ops = {.stats = stats_json};
	struct service *svc = service_create(name, run_dir, &ops, &status);
	if (!svc) /* why is logged */
		return 1;
	void *zctx = zmq_ctx_new();
	if (!zctx) {
		fprintf(stderr, "%s: cannot create a ZeroMQ context: %s\n", PROG, strerror(errno));
		service_destroy(&svc);
		return 1;
	}
	struct runner_options ro = {
		.zctx = zctx,
		.run_dir = run_dir,
		.max_queue = max_queue,
		.concurrency = concurrency,
		.hello_timeout_ms = hello_ms,
		.reply_timeout_ms = timeout_s * 1000,
		.resume_timeout_ms = resume_s * 1000,
	};
	char err[512];
	struct runner_client *runner = NULL;
	if (runner_client_start(&ro, &runner, err, sizeof(err)) != 0) {
		fprintf(stderr, "%s: %s\n", PROG, err);
		zmq_ctx_term(zctx);
		service_destroy(&svc);
		return 1;
	}
	struct server_config cfg = {
		.listen_addr = addr,
		.port = port,
		.max_body = max_body,
		.max_connections = max_connections ? max_connections : max_queue + concurrency + 32,
		.max_per_ip = per_ip,
		.idle_timeout_s = (unsigned)idle_s,
		.send_buffer = (int)send_buffer,
		.cors_origin = cors && *cors ? cors : NULL,
		.api_key = key_file ? key : NULL,
		.model_id = model_id && *model_id ? model_id : NULL,
		.limits = {.max_tokens_default = default_max_tokens, .max_tokens_limit = MAX_TOKENS_LIMIT},
		.runner = runner,
		.ro = &ro,
	};
	struct server *srv = NULL;
	if (server_start(&cfg, &srv, err, sizeof(err)) != 0) {
		log_error("%s", err);
		runner_client_destroy(&runner);
		zmq_ctx_term(zctx);
		service_destroy(&svc);
		return 1;
	}
	status.port = server_port(srv);
	snprintf(status.listen, sizeof(status.listen), "http://%s:%u", addr, status.port);
	log_info("listening on %s (instance %s, run dir %s%s)", status.listen, instance, run_dir,
		 key_file ? ", API key required" : "");
	pthread_sigmask(SIG_UNBLOCK, &sigs, NULL);
	service_run(svc);
	log_info("stopping (%s)", service_stop_reason(svc) == SERVICE_STOP_SHUTDOWN ? "MSG_SHUTDOWN" : "a signal");
	/* The generations end first (their readers wake up), then the connections, then the rest. */
	runner_client_stop(runner);
	server_stop(&srv);
	runner_client_destroy(&runner);
	zmq_ctx_term(zctx);
	service_destroy(&svc);
	return 0;
}

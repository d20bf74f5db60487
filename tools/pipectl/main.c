/* pipectl - the command-line client of the pipeline services.
 *
 *   pipectl [--instance NAME] [--run-dir DIR] [--timeout SEC] COMMAND [ARGS]
 *
 * It speaks the protocol of common/protocol.h over the services' control sockets in the
 * instance's run directory; scripts/pipeline uses it for readiness and shutdown, and users
 * for generation and statistics. Exit status: 0 success, 1 failure, 2 bad usage. */
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/proc.h"
#include "common/service.h"
#include "common/util.h"
#include "tools/pipectl/tokenize.h"
#include "tools/pipectl/pipectl.h"

const char *const pipectl_services[] = {"ssd-loader", "kv-store", "gpu-runner", NULL};

struct command {
	const char *name;
	int (*fn)(struct pipectl *p, int argc, char **argv);
	const char *help;
};

static const struct command commands[] = {
	{"hello", cmd_hello, "hello SERVICE           print the service's HELLO reply"},
	{"ping", cmd_ping, "ping SERVICE            check that the service answers"},
	{"wait-ready", cmd_wait_ready, "wait-ready SERVICE      wait until the service answers HELLO"},
	{"stats", cmd_stats, "stats SERVICE           print the service's counters (JSON)"},
	{"shutdown", cmd_shutdown, "shutdown SERVICE        stop the service and remove its shared state"},
	{"generate", cmd_generate, "generate --prompt TEXT | --chat TEXT | --tokens IDS [-n N]   generate with gpu-runner"},
	{"summary", cmd_summary, "summary                 what moved through each tier (all services)"},
	{"get", cmd_get, "get SERVICE [KEY...]    the service's parameters: value, tunable or fixed, range (--json)"},
	{"tune", cmd_tune, "tune SERVICE KEY=VALUE...  change parameters of a running service at once"},
	{"tokenize", cmd_tokenize, "tokenize --tokenizer FILE    text on stdin -> token ids"},
	{"detokenize", cmd_detokenize, "detokenize --tokenizer FILE  token ids on stdin -> text"},
	{NULL, NULL, NULL},
};

static void usage(FILE *f)
{
	fprintf(f, "usage: pipectl [--instance NAME] [--run-dir DIR] [--timeout SEC] COMMAND [ARGS]\n"
		   "The client of the pipeline services (ssd-loader, kv-store, gpu-runner).\n\n"
		   "commands (pipectl COMMAND --help for each):\n");
	for (const struct command *c = commands; c->name; c++)
		fprintf(f, "  %s\n", c->help);
	fprintf(f, "\nglobal options:\n"
		   "  --instance NAME      the instance to talk to (default \"default\") [PIPELINE_INSTANCE]\n"
		   "  --run-dir DIR        its run directory (default /tmp/llmp-<uid>/<instance>) [PIPELINE_RUN_DIR]\n"
		   "  --timeout SEC        how long to wait for a reply (default %d s; generate: 600 s between\n"
		   "                       messages; wait-ready: 30 s) [PIPELINE_PIPECTL_TIMEOUT]\n"
		   "  --help               print this help and exit\n"
		   "\nexit status: 0 success, 1 failure, 2 bad usage\n",
		PIPECTL_DEFAULT_TIMEOUT_S);
}

bool pipectl_check_service(const char *name)
{
	for (int i = 0; pipectl_services[i]; i++)
		if (!strcmp(name, pipectl_services[i]))
			return true;
	/* The further runners of a model split across GPUs (start --gpus, --ranks): gpu-runner-1 .. 7. */
	if (!strncmp(name, "gpu-runner-", 11) && name[11] >= '1' && name[11] <= '7' && !name[12])
		return true;
	/* The HTTP front door (start --http) answers HELLO, ping, stats and config like the others. */
	if (!strcmp(name, "http-api"))
		return true;
	fprintf(stderr,
		"pipectl: unknown service '%s' (one of: ssd-loader, kv-store, gpu-runner, gpu-runner-N, http-api)\n",
		name);
	return false;
}

int pipectl_timeout_ms(const struct pipectl *p, long def_s)
{
	long s = p->timeout_s >= 0 ? p->timeout_s : def_s;
	if (s > PIPECTL_TIMEOUT_MAX_S)
		s = PIPECTL_TIMEOUT_MAX_S;
	return (int)(s * 1000);
}

struct rpc_client *pipectl_connect(struct pipectl *p, const char *service)
{
	char path[512];
	struct stat st;
	snprintf(path, sizeof(path), "%s/%s.ctl", p->run_dir, service);
	if (stat(path, &st) != 0) {
		fprintf(stderr,
			"pipectl: %s of instance %s is not running: no control socket %s (see scripts/pipeline status)\n",
			service, p->instance, path);
		return NULL;
	}
	struct rpc_client *c = rpc_client_create(p->zctx, p->run_dir, service, "pipectl");
	if (!c)
		fprintf(stderr, "pipectl: cannot open a client of %s at %s: %s\n", service, path, strerror(errno));
	return c;
}

json_t *pipectl_json_object(const char *service, const char *what, const char *text, size_t len)
{
	json_error_t jerr;
	json_t *j = json_loadb(text, len, 0, &jerr);
	if (j && json_is_object(j))
		return j;
	fprintf(stderr, "pipectl: %s sent %s that are not a JSON object (%s)\n", service, what,
		j ? "another JSON value" : jerr.text);
	json_decref(j);
	return NULL;
}

int pipectl_rpc_failed(const struct pipectl *p, const char *service, const char *what, int rc, struct msg *rep)
{
	switch (rc) {
	case -EREMOTEIO:
		fprintf(stderr, "pipectl: %s: %s\n", service, rep->error.text.p ? rep->error.text.p : "(no text)");
		msg_free(rep);
		break;
	case -ETIMEDOUT:
		fprintf(stderr, "pipectl: %s did not answer %s in %d s (run dir %s)\n", service, what,
			pipectl_timeout_ms(p, PIPECTL_DEFAULT_TIMEOUT_S) / 1000, p->run_dir);
		break;
	case -EBADMSG:
		fprintf(stderr, "pipectl: %s answered %s with a message that does not decode\n", service, what);
		break;
	default:
		fprintf(stderr, "pipectl: %s %s failed: %s\n", service, what, strerror(-rc));
		break;
	}
	return PIPECTL_EXIT_FAIL;
}

int pipectl_parse(const char *usage_text, const char *summary, const struct opt *opts, int argc, char **argv,
		  char **pos, int n_pos_min, int n_pos_max, int *n_pos)
{
	char prog[256];
	int n = 0;
	snprintf(prog, sizeof(prog), "pipectl %s", usage_text);
	int rc = config_parse(prog, summary, opts, argc, argv, pos, &n);
	if (rc > 0)
		return 1;
	if (rc < 0)
		return 2;
	if (n < n_pos_min || n > n_pos_max) {
		if (n < n_pos_min)
			fprintf(stderr, "pipectl: %s: missing argument (usage: pipectl %s)\n", argv[0], usage_text);
		else
			fprintf(stderr, "pipectl: %s: unexpected argument '%s' (usage: pipectl %s)\n", argv[0],
				pos[n_pos_max], usage_text);
		return 2;
	}
	if (n_pos)
		*n_pos = n;
	return 0;
}

int pipectl_parse_ids(const char *text, uint64_t max, uint64_t **out, uint32_t *n_out, char *err, size_t errlen)
{
	uint32_t cap = 1;
	for (const char *q = text; *q; q++)
		cap += *q == ',';
	uint64_t *v = malloc(sizeof(*v) * cap);
	if (!v) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	uint32_t n = 0;
	const char *q = text;
	for (;;) {
		const char *end = q;
		while (*end && *end != ',')
			end++;
		int len = (int)(end - q);
		if (len == 0) {
			snprintf(err, errlen, "an empty element in '%s' (expected a comma-separated list like 1,2,3)",
				 text);
			goto out_free;
		}
		uint64_t val = 0;
		for (const char *d = q; d < end; d++) {
			if (*d < '0' || *d > '9') {
				snprintf(err, errlen,
					 "'%.*s' is not a non-negative integer (expected a comma-separated list like 1,2,3)",
					 len, q);
				goto out_free;
			}
			if (val > (max - (uint64_t)(*d - '0')) / 10) {
				snprintf(err, errlen, "'%.*s' is larger than %llu", len, q, (unsigned long long)max);
				goto out_free;
			}
			val = val * 10 + (uint64_t)(*d - '0');
		}
		v[n++] = val;
		if (!*end)
			break;
		q = end + 1;
	}
	*out = v;
	*n_out = n;
	return 0;
out_free:
	free(v);
	return -EINVAL;
}

/* ---- the small request/reply commands ---- */

/* Parses "COMMAND SERVICE" with no flags of its own. Returns -1 with *service set (borrowed
 * from argv) when the command should go on, else the exit status to return now. */
static int parse_service_arg(const char *usage_text, const char *summary, int argc, char **argv, const char **service)
{
	struct opt opts[] = {{0}};
	char **pos = calloc((size_t)argc + 1, sizeof(*pos));
	if (!pos)
		return PIPECTL_EXIT_FAIL;
	int rc = pipectl_parse(usage_text, summary, opts, argc, argv, pos, 1, 1, NULL);
	*service = pos[0];
	free(pos);
	if (rc)
		return rc == 1 ? PIPECTL_EXIT_OK : PIPECTL_EXIT_USAGE;
	return pipectl_check_service(*service) ? -1 : PIPECTL_EXIT_USAGE;
}

/* Checks that a reply naming a service names the one asked. */
bool pipectl_same_service(const char *asked, const struct bytes *named, const char *what)
{
	if (named->p && !strcmp(named->p, asked))
		return true;
	fprintf(stderr, "pipectl: the %s socket answered %s as '%s'\n", asked, what, named->p ? named->p : "");
	return false;
}

int cmd_hello(struct pipectl *p, int argc, char **argv)
{
	const char *service;
	int rc = parse_service_arg("hello SERVICE", "Prints the service's HELLO reply.", argc,
				   argv, &service);
	if (rc >= 0)
		return rc;
	struct rpc_client *c = pipectl_connect(p, service);
	if (!c)
		return PIPECTL_EXIT_FAIL;
	struct msg rep;
	int status = PIPECTL_EXIT_FAIL;
	rc = rpc_hello(c, &rep, pipectl_timeout_ms(p, PIPECTL_DEFAULT_TIMEOUT_S));
	if (rc) {
		pipectl_rpc_failed(p, service, "HELLO", rc, &rep);
		goto out_client;
	}
	const struct msg_hello_reply *h = &rep.hello_reply;
	if (!pipectl_same_service(service, &h->service, "HELLO"))
		goto out_reply;
	char size[32];
	printf("service        %s\n", h->service.p);
	printf("pid            %llu\n", (unsigned long long)h->pid);
	printf("epoch          %016llx\n", (unsigned long long)h->epoch);
	printf("layout         %llu\n", (unsigned long long)h->layout);
	printf("manifest_hash  %016llx\n", (unsigned long long)h->manifest_hash);
	printf("shm_name       %s\n", h->shm_name.len ? h->shm_name.p : "-");
	printf("shm_size       %s\n", h->shm_size ? format_size(h->shm_size, size, sizeof(size)) : "-");
	printf("run_dir        %s\n", p->run_dir);
	status = PIPECTL_EXIT_OK;
out_reply:
	msg_free(&rep);
out_client:
	rpc_client_destroy(&c);
	return status;
}

/* Sends a request that takes no fields and expects MSG_OK. */
static int call_for_ok(struct pipectl *p, const char *service, uint32_t type, const char *what)
{
	struct rpc_client *c = pipectl_connect(p, service);
	if (!c)
		return PIPECTL_EXIT_FAIL;
	struct msg req, rep;
	msg_init(&req, type, 0);
	int status = PIPECTL_EXIT_FAIL;
	int rc = rpc_call(c, &req, &rep, pipectl_timeout_ms(p, PIPECTL_DEFAULT_TIMEOUT_S));
	if (rc) {
		pipectl_rpc_failed(p, service, what, rc, &rep);
		goto out_client;
	}
	if (rep.type != MSG_OK)
		fprintf(stderr, "pipectl: %s answered %s with %s, not MSG_OK\n", service, what,
			msg_type_name(rep.type));
	else
		status = PIPECTL_EXIT_OK;
	msg_free(&rep);
out_client:
	rpc_client_destroy(&c);
	return status;
}

int cmd_ping(struct pipectl *p, int argc, char **argv)
{
	const char *service;
	int rc = parse_service_arg("ping SERVICE", "Checks that the service answers (MSG_PING -> MSG_OK).", argc,
				   argv, &service);
	if (rc >= 0)
		return rc;
	uint64_t t0 = now_ns();
	rc = call_for_ok(p, service, MSG_PING, "PING");
	if (rc == PIPECTL_EXIT_OK)
		printf("%s: ok (%.2f ms)\n", service, (double)(now_ns() - t0) / 1e6);
	return rc;
}

int cmd_shutdown(struct pipectl *p, int argc, char **argv)
{
	const char *service;
	int rc = parse_service_arg("shutdown SERVICE",
				   "Asks the service to stop and remove its shared state (MSG_SHUTDOWN); returns once it "
				   "has acknowledged.",
				   argc, argv, &service);
	if (rc >= 0)
		return rc;
	rc = call_for_ok(p, service, MSG_SHUTDOWN, "SHUTDOWN");
	if (rc == PIPECTL_EXIT_OK)
		printf("%s: shutting down\n", service);
	return rc;
}

int cmd_wait_ready(struct pipectl *p, int argc, char **argv)
{
	long timeout_s = p->timeout_s >= 0 ? p->timeout_s : 30;
	long pid = 0;
	struct opt opts[] = {
		{"timeout", OPT_INT, &timeout_s, NULL, "seconds to wait (default: the global --timeout, else 30)"},
		{"pid", OPT_INT, &pid, NULL, "stop waiting when this process exits (the service's pid)"},
		{0},
	};
	char **pos = calloc((size_t)argc + 1, sizeof(*pos));
	if (!pos)
		return PIPECTL_EXIT_FAIL;
	int rc = pipectl_parse("wait-ready SERVICE",
			       "Retries HELLO until the service answers (exit 0) or the timeout passes (exit 1).", opts,
			       argc, argv, pos, 1, 1, NULL);
	const char *service = pos[0];
	free(pos);
	if (rc)
		return rc == 1 ? PIPECTL_EXIT_OK : PIPECTL_EXIT_USAGE;
	if (!pipectl_check_service(service))
		return PIPECTL_EXIT_USAGE;
	if (timeout_s < 0 || pid < 0) {
		fprintf(stderr, "pipectl: wait-ready: --timeout and --pid must not be negative\n");
		return PIPECTL_EXIT_USAGE;
	}
	/* As the global --timeout (a wait in milliseconds past an int's range never ended); a pid past
	 * an int's was cut to another process's (4294967297 to init, which is always there). */
	if (timeout_s > PIPECTL_TIMEOUT_MAX_S || pid > INT_MAX) {
		fprintf(stderr, "pipectl: wait-ready: --timeout at most %d seconds, --pid at most %d\n",
			PIPECTL_TIMEOUT_MAX_S, INT_MAX);
		return PIPECTL_EXIT_USAGE;
	}
	struct rpc_client *c = rpc_client_create(p->zctx, p->run_dir, service, "pipectl");
	if (!c) {
		fprintf(stderr, "pipectl: cannot open a client of %s in %s: %s\n", service, p->run_dir,
			strerror(errno));
		return PIPECTL_EXIT_FAIL;
	}
	uint64_t deadline = now_ns() + (uint64_t)timeout_s * 1000000000ull;
	struct msg rep;
	int status = PIPECTL_EXIT_FAIL;
	for (;;) {
		/* Short rounds, so that a service that died at start is noticed within half a second. */
		uint64_t now = now_ns();
		int left_ms = now >= deadline ? 0 : (int)((deadline - now) / 1000000ull);
		rc = rpc_wait_ready(c, &rep, left_ms < 500 ? left_ms : 500);
		if (rc == 0)
			break;
		if (rc == -EREMOTEIO) {
			pipectl_rpc_failed(p, service, "HELLO", rc, &rep);
			goto out_client;
		}
		if (pid && !proc_running((int)pid)) {
			fprintf(stderr, "pipectl: %s (pid %ld) exited before it became ready\n", service, pid);
			goto out_client;
		}
		if (now_ns() >= deadline) {
			fprintf(stderr, "pipectl: %s did not become ready in %ld s\n", service, timeout_s);
			goto out_client;
		}
	}
	if (pipectl_same_service(service, &rep.hello_reply.service, "HELLO")) {
		printf("%s ready (pid %llu)\n", service, (unsigned long long)rep.hello_reply.pid);
		status = PIPECTL_EXIT_OK;
	}
	msg_free(&rep);
out_client:
	rpc_client_destroy(&c);
	return status;
}

int cmd_stats(struct pipectl *p, int argc, char **argv)
{
	const char *service;
	int rc = parse_service_arg("stats SERVICE", "Prints the service's counters as a JSON object.", argc, argv,
				   &service);
	if (rc >= 0)
		return rc;
	struct rpc_client *c = pipectl_connect(p, service);
	if (!c)
		return PIPECTL_EXIT_FAIL;
	struct msg req, rep;
	int status = PIPECTL_EXIT_FAIL;
	msg_init(&req, MSG_STATS_GET, 0);
	rc = rpc_call(c, &req, &rep, pipectl_timeout_ms(p, PIPECTL_DEFAULT_TIMEOUT_S));
	if (rc) {
		pipectl_rpc_failed(p, service, "STATS_GET", rc, &rep);
		goto out_client;
	}
	if (rep.type != MSG_STATS) {
		fprintf(stderr, "pipectl: %s answered STATS_GET with %s\n", service, msg_type_name(rep.type));
		goto out_reply;
	}
	if (!pipectl_same_service(service, &rep.stats.service, "STATS_GET"))
		goto out_reply;
	json_t *j = pipectl_json_object(service, "stats", rep.stats.json.p, rep.stats.json.len);
	if (!j)
		goto out_reply;
	char *text = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
	json_decref(j);
	if (!text) {
		fprintf(stderr, "pipectl: out of memory\n");
		goto out_reply;
	}
	printf("%s\n", text);
	free(text);
	status = PIPECTL_EXIT_OK;
out_reply:
	msg_free(&rep);
out_client:
	rpc_client_destroy(&c);
	return status;
}

/* ---- global flags and dispatch ---- */

/* Index of the command word in argv: the first argument that is not a global flag or its
 * value. Returns argc when there is none, -1 after printing a usage error. */
static int find_command(int argc, char **argv, const struct opt *globals)
{
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "--help") || !strcmp(a, "-h"))
			return i; /* handled by config_parse below */
		if (strncmp(a, "--", 2) != 0)
			return i;
		const char *eq = strchr(a, '=');
		size_t n = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
		const struct opt *o = globals;
		for (; o->name; o++)
			if (strlen(o->name) == n && !strncmp(o->name, a + 2, n))
				break;
		if (!o->name) {
			fprintf(stderr, "pipectl: unknown global flag '%s' (global flags come before the command; see "
					"pipectl --help)\n",
				a);
			return -1;
		}
		if (!eq)
			i++;
	}
	return argc;
}

int main(int argc, char **argv)
{
	struct pipectl p = {.timeout_s = -1};
	const char *run_dir = NULL;
	struct opt globals[] = {
		{"instance", OPT_STRING, &p.instance, "default", "instance name"},
		{"run-dir", OPT_STRING, &run_dir, NULL, "run directory"},
		{"timeout", OPT_INT, &p.timeout_s, NULL, "seconds to wait for a reply"},
		{0},
	};
	log_init("pipectl");
	/* A reader that goes away (pipectl generate | head) must not kill us mid-message. */
	signal(SIGPIPE, SIG_IGN);

	int ci = find_command(argc, argv, globals);
	if (ci < 0)
		return PIPECTL_EXIT_USAGE;
	if (ci < argc && (!strcmp(argv[ci], "--help") || !strcmp(argv[ci], "-h"))) {
		usage(stdout);
		return PIPECTL_EXIT_OK;
	}
	if (config_parse("pipectl", "", globals, ci, argv, NULL, NULL) != 0)
		return PIPECTL_EXIT_USAGE;
	if (ci == argc) {
		usage(stderr);
		return PIPECTL_EXIT_USAGE;
	}
	if ((p.timeout_s < 0 && p.timeout_s != -1) || p.timeout_s == 0) {
		/* 0 was taken, and every call then failed at once ("did not answer ... in 0 s"). */
		fprintf(stderr, "pipectl: --timeout must be at least 1 second\n");
		return PIPECTL_EXIT_USAGE;
	}
	/* A wait is milliseconds in an int (rpc_call): past this the product wrapped into a wait that
	 * never ended. */
	if (p.timeout_s > PIPECTL_TIMEOUT_MAX_S) {
		fprintf(stderr, "pipectl: --timeout %ld: at most %d seconds\n", p.timeout_s, PIPECTL_TIMEOUT_MAX_S);
		return PIPECTL_EXIT_USAGE;
	}
	if (!*p.instance || strchr(p.instance, '/')) {
		fprintf(stderr, "pipectl: instance name '%s' must be non-empty and hold no '/'\n", p.instance);
		return PIPECTL_EXIT_USAGE;
	}
	if (run_dir && *run_dir) {
		if (str_copy(p.run_dir, sizeof(p.run_dir), run_dir) != 0) {
			fprintf(stderr, "pipectl: run directory path too long: %s\n", run_dir);
			return PIPECTL_EXIT_USAGE;
		}
	} else if (run_dir_default(p.instance, p.run_dir, sizeof(p.run_dir)) != 0) {
		fprintf(stderr, "pipectl: run directory path for instance %s too long\n", p.instance);
		return PIPECTL_EXIT_USAGE;
	}

	const struct command *cmd = commands;
	for (; cmd->name; cmd++)
		if (!strcmp(cmd->name, argv[ci]))
			break;
	if (!cmd->name) {
		fprintf(stderr, "pipectl: unknown command '%s' (see pipectl --help)\n", argv[ci]);
		return PIPECTL_EXIT_USAGE;
	}
	p.zctx = zmq_ctx_new();
	if (!p.zctx) {
		fprintf(stderr, "pipectl: cannot create a ZeroMQ context: %s\n", strerror(errno));
		return PIPECTL_EXIT_FAIL;
	}
	int status = cmd->fn(&p, argc - ci, argv + ci);
	zmq_ctx_term(p.zctx);
	return status;
}

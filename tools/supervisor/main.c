/* pipeline-supervisor - supervises the services of one instance, and the commands that talk to it.
 *
 *   pipeline-supervisor [run] --instance NAME --run-dir DIR --bin-dir DIR [options] [service words]
 *   pipeline-supervisor status [--json] | wait | shutdown | restart SERVICE   [--run-dir DIR] [--timeout S]
 *   pipeline-supervisor pids [NAME] | ps | stop | cleanup | services          [--run-dir DIR]
 *
 * scripts/pipeline runs it; supervisor.h describes what it does. Exit status: 0 success, 1
 * failure, 2 bad usage, 3 (restart) the instance runs no such service. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/log.h"
#include "common/service.h"
#include "common/util.h"
#include "tools/supervisor/supervisor.h"

static void usage(FILE *f)
{
	fprintf(f,
		"usage: pipeline-supervisor [run] --instance NAME --run-dir DIR --bin-dir DIR [options] [service words]\n"
		"       pipeline-supervisor status [--json] [--run-dir DIR] [--instance NAME] [--timeout S]\n"
		"       pipeline-supervisor wait [--timeout S] [--run-dir DIR] [--instance NAME]\n"
		"       pipeline-supervisor shutdown [--timeout S] [--run-dir DIR] [--instance NAME]\n"
		"       pipeline-supervisor restart SERVICE [--timeout S] [--run-dir DIR] [--instance NAME]\n"
		"       pipeline-supervisor pids [NAME] | ps | cleanup   [--run-dir DIR] [--instance NAME]\n"
		"       pipeline-supervisor stop [--stop-timeout-s S] [--run-dir DIR] [--instance NAME]\n"
		"       pipeline-supervisor services\n"
		"\n"
		"run (the default): becomes a daemon (its own session, log DIR/supervisor.log, pid in\n"
		"DIR/supervisor.pid, socket DIR/supervisor.ctl) that starts kv-store and ssd-loader, then\n"
		"gpu-runner (and http-api with --http) once both answer HELLO; restarts a service that exits or hangs (stops sending\n"
		"heartbeats), with a backoff, until it restarted more than --burst-limit times within\n"
		"--burst-window-s (then the service is 'failed'); answers MSG_STATS_GET with its status as\n"
		"JSON; on MSG_SHUTDOWN, SIGTERM or SIGINT stops http-api, gpu-runner, ssd-loader, kv-store in turn\n"
		"and exits.\n"
		"Returns once the daemon serves.\n"
		"\n"
		"  --instance NAME          the instance (the services' --instance)\n"
		"  --run-dir DIR            its run directory, an absolute path\n"
		"  --bin-dir DIR            where the service binaries are, an absolute path\n"
		"  --heartbeat-ms MS        the period of the services' heartbeats (default 1000)\n"
		"  --hang-periods N         periods without a heartbeat after which an up service whose process\n"
		"                           is stopped or idle counts as hung and is killed (default 2; 0: never)\n"
		"  --peer-grace-ms MS       gpu-runner is not judged hung while kv-store or ssd-loader is down,\n"
		"                           nor this long after they are up again (default 65000: its --timeout-ms)\n"
		"  --backoff-min-ms MS      the first restart's delay, doubled for each restart within the\n"
		"  --backoff-max-ms MS      burst window up to the maximum (defaults 200 and 5000)\n"
		"  --burst-limit N          restarts allowed within the window before giving up (default 5)\n"
		"  --burst-window-s S       the window (default 60)\n"
		"  --ready-timeout-s S      a started service must answer HELLO within this (default 600)\n"
		"  --stop-timeout-s S       a service asked to stop is killed after this (default 10)\n"
		"  --log-level L            debug, info, warn or error (default info; PIPELINE_LOG_LEVEL)\n"
		"  --foreground             do not become a daemon (log on stderr)\n"
		"  --ranks N                gpu-runners that split the model's layers (1 to 8; default 1): gpu-runner,\n"
		"                           gpu-runner-1, ..., each with --rank R --ranks N after its words\n"
		"  --gpus LIST              CUDA devices, comma-separated: one gpu-runner on each (--ranks is their\n"
		"                           number), each with --gpu G after its words\n"
		"  --http ADDR:PORT         also run http-api, the OpenAI-compatible HTTP front door, with --listen\n"
		"                           ADDR:PORT before its words; started with the runners, stopped first\n"
		"service words, each flag once per word, in order (SERVICE: kv-store, ssd-loader, gpu-runner,\n"
		"http-api):\n"
		"  --SERVICE-arg WORD       a word of the service's command line after --instance and --run-dir\n"
		"  --SERVICE-wrap WORD      a word of the tool the service runs under (PIPELINE_WRAP_*)\n"
		"\n"
		"status prints each service's pid, state, health, uptime, restarts, last exit and last error\n"
		"(--json: the supervisor's JSON) and exits 0 when all three are up; wait waits until they are\n"
		"(1 when one failed: its error and log); shutdown stops the instance and waits for the\n"
		"supervisor to exit; restart asks for a restart of one service (SIGTERM, then the same\n"
		"command line; not counted toward the burst limit) and waits until it is up again (3 at once\n"
		"when the instance runs no such service).\n"
		"\n"
		"The instance seen from outside, with or without a supervisor (a pid file counts when its\n"
		"process runs that program with --run-dir DIR): pids prints \"NAME PID\" for each live\n"
		"process of the instance, the supervisor first, then the services in start order (with NAME:\n"
		"supervisor or a service, only its pid; exit 1 when none runs); ps prints each service's pid\n"
		"file, whether that process runs, whether it answers HELLO and its uptime; stop stops whatever\n"
		"runs: the supervisor (shutdown, waiting 3 x S + 20 s, S the longer of --stop-timeout-s and the\n"
		"instance's own, then SIGKILL), then each service left\n"
		"running without it, gpu-runner first: MSG_SHUTDOWN, SIGTERM when not acknowledged in 5 s,\n"
		"SIGKILL when it has not exited after --stop-timeout-s (default 10); then cleanup, and prints\n"
		"the name of each process that was running (exit 1 when one survived SIGKILL); cleanup (nothing,\n"
		"exit 1, beside a live supervisor: it holds DIR/supervisor.lock) removes\n"
		"the pid files, sockets, restart markers, start.args and start.timeouts, a dead kv-store's kv-spill.bin (or the\n"
		"spill file kv-spill.path names) and the instance's shared-memory objects that no live process\n"
		"owns (logs stay); services prints the services in start order.\n"
		"\n"
		"exit status: 0 success, 1 failure, 2 bad usage, 3 (restart) no such service\n");
}

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "pipeline-supervisor: ");
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "\npipeline-supervisor: see pipeline-supervisor --help\n");
	va_end(ap);
	return SUP_EXIT_USAGE;
}

struct int_flag {
	const char *name;
	long *dest;
	long min, max;
};

/* Which per-service word list, if any, the flag name ("kv-store-arg") names. */
static struct sup_words *words_of(struct sup_config *cfg, const char *name)
{
	for (int s = 0; s < SUP_N_KINDS; s++) {
		size_t len = strlen(sup_service_names[s]);
		if (strncmp(name, sup_service_names[s], len) != 0 || name[len] != '-')
			continue;
		if (!strcmp(name + len, "-arg"))
			return &cfg->args[s];
		if (!strcmp(name + len, "-wrap"))
			return &cfg->wrap[s];
	}
	return NULL;
}

static bool known_flag(const char *name, const struct int_flag *ints, size_t n_ints)
{
	static const char *const strings[] = {"instance", "run-dir", "bin-dir", "log-level", "gpus", "ranks", "http"};
	for (size_t k = 0; k < ARRAY_SIZE(strings); k++)
		if (!strcmp(name, strings[k]))
			return true;
	for (size_t k = 0; k < n_ints; k++)
		if (!strcmp(name, ints[k].name))
			return true;
	struct sup_config scratch;
	return words_of(&scratch, name) != NULL;
}

/* --gpus LIST into cfg: 1 to SUP_MAX_RANKS device numbers, each once. Returns 0 or SUP_EXIT_USAGE. */
static int parse_gpus(const char *value, struct sup_config *cfg)
{
	cfg->n_gpus = 0;
	for (const char *p = value;;) {
		char *end;
		errno = 0;
		long g = strtol(p, &end, 10);
		if (end == p || errno || g < 0 || g > 1023 || (*end && *end != ','))
			return usage_error("--gpus '%s': CUDA device numbers separated by commas, such as 0,1", value);
		if (cfg->n_gpus == SUP_MAX_RANKS)
			return usage_error("--gpus '%s': at most %d devices", value, SUP_MAX_RANKS);
		for (int k = 0; k < cfg->n_gpus; k++)
			if (cfg->gpus[k] == g)
				return usage_error("--gpus '%s': device %ld twice", value, g);
		cfg->gpus[cfg->n_gpus++] = (int)g;
		if (!*end)
			return 0;
		p = end + 1;
	}
}

/* Parses the run mode's flags into cfg. Returns 0, 1 after --help, or SUP_EXIT_USAGE. */
static int parse_run(int argc, char **argv, struct sup_config *cfg)
{
	const struct int_flag ints[] = {
		{"heartbeat-ms", &cfg->heartbeat_ms, 10, 3600000},
		{"hang-periods", &cfg->hang_periods, 0, 1000000},
		{"peer-grace-ms", &cfg->peer_grace_ms, 0, 86400000},
		{"backoff-min-ms", &cfg->backoff_min_ms, 1, 3600000},
		{"backoff-max-ms", &cfg->backoff_max_ms, 1, 3600000},
		{"burst-limit", &cfg->burst_limit, 0, 63},
		{"burst-window-s", &cfg->burst_window_s, 1, 86400},
		{"ready-timeout-s", &cfg->ready_timeout_s, 1, 86400 * 7},
		{"stop-timeout-s", &cfg->stop_timeout_s, 1, 3600},
	};
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage(stdout);
			return 1;
		}
		if (strncmp(a, "--", 2) != 0)
			return usage_error("unexpected argument '%s'", a);
		char name[64];
		const char *eq = strchr(a, '=');
		size_t n = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
		if (n >= sizeof(name))
			return usage_error("unknown flag '%s'", a);
		memcpy(name, a + 2, n);
		name[n] = 0;
		if (!strcmp(name, "foreground")) {
			if (eq)
				return usage_error("--foreground takes no value");
			cfg->foreground = true;
			continue;
		}
		if (!known_flag(name, ints, ARRAY_SIZE(ints)))
			return usage_error("unknown flag '--%s'", name);
		const char *value = eq ? eq + 1 : NULL;
		if (!value) {
			if (i + 1 >= argc)
				return usage_error("--%s needs a value", name);
			value = argv[++i];
		}
		if (!strcmp(name, "instance")) {
			cfg->instance = value;
			continue;
		}
		if (!strcmp(name, "run-dir")) {
			cfg->run_dir = value;
			continue;
		}
		if (!strcmp(name, "bin-dir")) {
			cfg->bin_dir = value;
			continue;
		}
		if (!strcmp(name, "log-level")) {
			cfg->log_level = value;
			continue;
		}
		if (!strcmp(name, "http")) {
			const char *colon = strrchr(value, ':');
			if (!colon || colon == value || !colon[1] || strspn(colon + 1, "0123456789") != strlen(colon + 1))
				return usage_error("--http '%s': ADDR:PORT, such as 127.0.0.1:8000", value);
			cfg->http_listen = value;
			continue;
		}
		if (!strcmp(name, "gpus")) {
			if (parse_gpus(value, cfg))
				return SUP_EXIT_USAGE;
			continue;
		}
		if (!strcmp(name, "ranks")) {
			char *end;
			errno = 0;
			long v = strtol(value, &end, 10);
			if (errno || end == value || *end || v < 1 || v > SUP_MAX_RANKS)
				return usage_error("--ranks '%s': 1 to %d runners", value, SUP_MAX_RANKS);
			cfg->n_ranks = (int)v;
			continue;
		}
		bool found = false;
		for (size_t k = 0; k < ARRAY_SIZE(ints) && !found; k++) {
			if (strcmp(name, ints[k].name) != 0)
				continue;
			found = true;
			char *end;
			errno = 0;
			long v = strtol(value, &end, 10);
			if (errno || end == value || *end)
				return usage_error("--%s: '%s' is not an integer", name, value);
			if (v < ints[k].min || v > ints[k].max) {
				char range[64];
				snprintf(range, sizeof(range), "%ld..%ld", ints[k].min, ints[k].max);
				fprintf(stderr, "pipeline-supervisor: --%s must be in %s, not %s\n", name, range, value);
				return SUP_EXIT_USAGE;
			}
			*ints[k].dest = v;
		}
		struct sup_words *w = found ? NULL : words_of(cfg, name);
		if (w) {
			found = true;
			if (w->n >= SUP_MAX_WORDS)
				return usage_error("more than 256 words for --%s", name);
			w->v[w->n++] = value;
		}
		if (!found)
			return usage_error("unknown flag '--%s'", name);
	}
	if (!cfg->instance || !*cfg->instance || strchr(cfg->instance, '/'))
		return usage_error("--instance NAME is required (a name without '/')");
	if (!cfg->run_dir || cfg->run_dir[0] != '/')
		return usage_error("--run-dir must be an absolute path");
	if (!cfg->bin_dir || cfg->bin_dir[0] != '/')
		return usage_error("--bin-dir must be an absolute path");
	if (cfg->backoff_max_ms < cfg->backoff_min_ms)
		return usage_error("--backoff-max-ms must not be below --backoff-min-ms");
	/* The services beat every second (common/service.c) whatever --heartbeat-ms says: a window
	 * shorter than two of their beats finds healthy idle services hung and kills them. */
	if (cfg->hang_periods && cfg->heartbeat_ms * cfg->hang_periods < 2 * SUP_SERVICE_BEAT_MS)
		return usage_error("--heartbeat-ms %ld x --hang-periods %ld is a hang window of %ld ms: the services beat "
				   "every %d ms, so at least %d (or --hang-periods 0: never)",
				   (long)cfg->heartbeat_ms, (long)cfg->hang_periods,
				   (long)(cfg->heartbeat_ms * cfg->hang_periods), SUP_SERVICE_BEAT_MS,
				   2 * SUP_SERVICE_BEAT_MS);
	if (cfg->n_gpus && cfg->n_ranks && cfg->n_ranks != cfg->n_gpus)
		return usage_error("--ranks %d with --gpus naming %d devices: one runner a device", cfg->n_ranks,
				   cfg->n_gpus);
	if (cfg->n_gpus)
		cfg->n_ranks = cfg->n_gpus;
	if (!cfg->http_listen && (cfg->args[SUP_HTTP_API].n || cfg->wrap[SUP_HTTP_API].n))
		return usage_error("--http-api-arg and --http-api-wrap go with --http ADDR:PORT");
	enum log_level lv;
	if (log_parse_level(cfg->log_level, &lv) != 0)
		return usage_error("--log-level '%s' is not debug, info, warn or error", cfg->log_level);
	log_set_level(lv);
	return 0;
}

/* The commands other than run: what each takes besides --instance and --run-dir. */
struct client_command {
	const char *name;
	int n_args;	   /* positional arguments: at most this many */
	bool arg_required; /* ... and exactly that many */
	bool timeout, json, stop_timeout;
	const char *summary;
};

static const struct client_command client_commands[] = {
	{"status", 0, false, true, true, false, "Talks to the instance's supervisor (see pipeline-supervisor --help)."},
	{"wait", 0, false, true, false, false, "Talks to the instance's supervisor (see pipeline-supervisor --help)."},
	{"shutdown", 0, false, true, false, false, "Talks to the instance's supervisor (see pipeline-supervisor --help)."},
	{"restart", 1, true, true, false, false, "Talks to the instance's supervisor (see pipeline-supervisor --help)."},
	{"pids", 1, false, false, false, false,
	 "Prints the live processes of the instance (see pipeline-supervisor --help)."},
	{"ps", 0, false, false, false, false,
	 "Prints the instance's services seen from outside (see pipeline-supervisor --help)."},
	{"stop", 0, false, false, false, true,
	 "Stops whatever runs of the instance and cleans up after it (see pipeline-supervisor --help)."},
	{"cleanup", 0, false, false, false, false,
	 "Removes what a stopped instance left behind (see pipeline-supervisor --help)."},
	{"services", 0, false, false, false, false, "Prints the services in start order."},
};

static const struct client_command *client_command(const char *name)
{
	for (size_t i = 0; i < ARRAY_SIZE(client_commands); i++)
		if (!strcmp(name, client_commands[i].name))
			return &client_commands[i];
	return NULL;
}

/* A client command: COMMAND [ARG] with --run-dir, --instance and what the command takes. */
static int client_main(const struct client_command *c, int argc, char **argv)
{
	const char *cmd = c->name, *instance = NULL, *run_dir = NULL;
	long timeout_s = 0, stop_timeout_s = SUP_STOP_TIMEOUT_S;
	bool json = false;
	struct opt opts[6];
	int n_opts = 0;
	opts[n_opts++] = (struct opt){"instance", OPT_STRING, &instance, "default",
				      "the instance (its run directory by default)"};
	opts[n_opts++] = (struct opt){"run-dir", OPT_STRING, &run_dir, NULL,
				      "the run directory (default /tmp/llmp-UID/INSTANCE)"};
	if (c->timeout)
		opts[n_opts++] = (struct opt){"timeout", OPT_INT, &timeout_s, "0",
					      "seconds to wait (status: for the answer, default 5; wait: 0 = while the "
					      "supervisor lives; shutdown: default 60; restart: default 660)"};
	if (c->json)
		opts[n_opts++] = (struct opt){"json", OPT_BOOL, &json, NULL, "print the supervisor's JSON"};
	if (c->stop_timeout)
		opts[n_opts++] = (struct opt){"stop-timeout-s", OPT_INT, &stop_timeout_s, NULL,
					      "seconds a service may take to exit once asked to stop, before SIGKILL "
					      "(default 10)"};
	opts[n_opts] = (struct opt){0};
	char prog[64];
	snprintf(prog, sizeof(prog), "pipeline-supervisor %s", cmd);
	char **pos = calloc((size_t)argc + 1, sizeof(*pos));
	if (!pos)
		return SUP_EXIT_FAIL;
	int n_pos = 0;
	int rc = config_parse(prog, c->summary, opts, argc, argv, pos, &n_pos);
	const char *arg = c->n_args && n_pos > 0 ? pos[0] : NULL;
	char *extra = n_pos > c->n_args ? pos[c->n_args] : NULL;
	free(pos);
	if (rc > 0)
		return SUP_EXIT_OK;
	if (rc < 0)
		return SUP_EXIT_USAGE;
	if (extra)
		return usage_error("%s: unexpected argument '%s'", cmd, extra);
	if (!strcmp(cmd, "restart") && (!arg || sup_service_kind(arg, NULL) < 0))
		return usage_error("restart takes one service: kv-store, ssd-loader, gpu-runner, gpu-runner-R or http-api");
	if (!strcmp(cmd, "pids") && arg && strcmp(arg, SUP_NAME) != 0 && sup_service_kind(arg, NULL) < 0)
		return usage_error("pids: '%s' is not supervisor, kv-store, ssd-loader, gpu-runner, gpu-runner-R or http-api",
				   arg);
	if (timeout_s < 0)
		return usage_error("--timeout must not be negative");
	/* Waits are counted in milliseconds in an int further on (a larger value wrapped to a negative
	 * wait, which waited for ever). */
	if (timeout_s > SUP_TIMEOUT_MAX_S)
		return usage_error("--timeout %ld: at most %d seconds", timeout_s, SUP_TIMEOUT_MAX_S);
	if (stop_timeout_s < 0 || stop_timeout_s > 3600)
		return usage_error("--stop-timeout-s must be in 0..3600, not %ld", stop_timeout_s);
	char dir[256];
	if (run_dir && *run_dir) {
		if (str_copy(dir, sizeof(dir), run_dir) != 0)
			return usage_error("run directory path too long: %s", run_dir);
	} else if (run_dir_default(instance, dir, sizeof(dir)) != 0) {
		return usage_error("run directory path for instance %s too long", instance);
	}
	if (!strcmp(cmd, "status"))
		return sup_client_status(dir, json, timeout_s);
	if (!strcmp(cmd, "wait"))
		return sup_client_wait(dir, timeout_s);
	if (!strcmp(cmd, "shutdown"))
		return sup_client_shutdown(dir, timeout_s ? timeout_s : 60);
	if (!strcmp(cmd, "restart"))
		return sup_client_restart(dir, arg, timeout_s ? timeout_s : 660);
	if (!strcmp(cmd, "pids"))
		return sup_instance_pids(dir, arg);
	if (!strcmp(cmd, "ps"))
		return sup_instance_ps(dir);
	if (!strcmp(cmd, "stop"))
		return sup_instance_stop(instance, dir, stop_timeout_s);
	if (!strcmp(cmd, "cleanup"))
		return sup_instance_cleanup(instance, dir);
	for (int i = 0; i < SUP_N_SERVICES; i++) /* services */
		printf("%s\n", sup_service_names[i]);
	return SUP_EXIT_OK;
}

int main(int argc, char **argv)
{
	log_init("pipeline-supervisor");
	if (argc >= 2) {
		const char *cmd = argv[1];
		const struct client_command *c = client_command(cmd);
		if (c)
			return client_main(c, argc - 1, argv + 1);
		if (!strcmp(cmd, "run")) {
			argc--;
			argv++;
		} else if (strncmp(cmd, "--", 2) != 0 && strcmp(cmd, "-h") != 0) {
			return usage_error("unknown command '%s'", cmd);
		}
	}
	struct sup_config cfg;
	sup_config_defaults(&cfg);
	int rc = parse_run(argc, argv, &cfg);
	if (rc == 1)
		return SUP_EXIT_OK;
	if (rc)
		return rc;
	return sup_daemon_run(&cfg);
}

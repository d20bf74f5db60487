/* pipeline-supervisor - supervises the services of one instance, and the commands that talk to it.
 *
 *   pipeline-supervisor [run] --instance NAME --run-dir DIR --bin-dir DIR [options] [service words]
 *   pipeline-supervisor status [--json] | wait | shutdown | restart SERVICE   [--run-dir DIR] [--timeout S]
 *
 * scripts/pipeline runs it; supervisor.h describes what it does. Exit status: 0 success, 1
 * failure, 2 bad usage. */
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
		"\n"
		"run (the default): becomes a daemon (its own session, log DIR/supervisor.log, pid in\n"
		"DIR/supervisor.pid, socket DIR/supervisor.ctl) that starts kv-store and ssd-loader, then\n"
		"gpu-runner once both answer HELLO; restarts a service that exits or hangs (stops sending\n"
		"heartbeats), with a backoff, until it restarted more than --burst-limit times within\n"
		"--burst-window-s (then the service is 'failed'); answers MSG_STATS_GET with its status as\n"
		"JSON; on MSG_SHUTDOWN, SIGTERM or SIGINT stops gpu-runner, ssd-loader, kv-store in turn and exits.\n"
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
		"service words, each flag once per word, in order (SERVICE: kv-store, ssd-loader, gpu-runner):\n"
		"  --SERVICE-arg WORD       a word of the service's command line after --instance and --run-dir\n"
		"  --SERVICE-wrap WORD      a word of the tool the service runs under (PIPELINE_WRAP_*)\n"
		"\n"
		"status prints each service's pid, state, health, uptime, restarts, last exit and last error\n"
		"(--json: the supervisor's JSON) and exits 0 when all three are up; wait waits until they are\n"
		"(1 when one failed: its error and log); shutdown stops the instance and waits for the\n"
		"supervisor to exit; restart asks for a restart of one service (SIGTERM, then the same\n"
		"command line; not counted toward the burst limit) and waits until it is up again.\n"
		"\n"
		"exit status: 0 success, 1 failure, 2 bad usage\n");
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
	for (int s = 0; s < SUP_N_SERVICES; s++) {
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
	static const char *const strings[] = {"instance", "run-dir", "bin-dir", "log-level"};
	for (size_t k = 0; k < ARRAY_SIZE(strings); k++)
		if (!strcmp(name, strings[k]))
			return true;
	for (size_t k = 0; k < n_ints; k++)
		if (!strcmp(name, ints[k].name))
			return true;
	struct sup_config scratch;
	return words_of(&scratch, name) != NULL;
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
	enum log_level lv;
	if (log_parse_level(cfg->log_level, &lv) != 0)
		return usage_error("--log-level '%s' is not debug, info, warn or error", cfg->log_level);
	log_set_level(lv);
	return 0;
}

/* The client commands: COMMAND [SERVICE] with --run-dir, --instance, --timeout (and --json). */
static int client_main(const char *cmd, int argc, char **argv)
{
	const char *instance = NULL, *run_dir = NULL;
	long timeout_s = 0;
	bool json = false;
	bool is_status = !strcmp(cmd, "status"), is_restart = !strcmp(cmd, "restart");
	struct opt opts[] = {
		{"instance", OPT_STRING, &instance, "default", "the instance (its run directory by default)"},
		{"run-dir", OPT_STRING, &run_dir, NULL, "the run directory (default /tmp/llmp-UID/INSTANCE)"},
		{"timeout", OPT_INT, &timeout_s, "0",
		 "seconds to wait (status: for the answer, default 5; wait: 0 = while the supervisor lives; "
		 "shutdown: default 60; restart: default 660)"},
		{is_status ? "json" : NULL, OPT_BOOL, &json, NULL, "print the supervisor's JSON"},
		{0},
	};
	char prog[64];
	snprintf(prog, sizeof(prog), "pipeline-supervisor %s", cmd);
	char **pos = calloc((size_t)argc + 1, sizeof(*pos));
	if (!pos)
		return SUP_EXIT_FAIL;
	int n_pos = 0;
	int rc = config_parse(prog, "Talks to the instance's supervisor (see pipeline-supervisor --help).", opts, argc,
			      argv, pos, &n_pos);
	const char *service = n_pos > 0 ? pos[0] : NULL;
	char *extra = n_pos > (is_restart ? 1 : 0) ? pos[is_restart ? 1 : 0] : NULL;
	free(pos);
	if (rc > 0)
		return SUP_EXIT_OK;
	if (rc < 0)
		return SUP_EXIT_USAGE;
	if (extra)
		return usage_error("%s: unexpected argument '%s'", cmd, extra);
	if (is_restart && (!service || sup_service_index(service) < 0))
		return usage_error("restart takes one service: kv-store, ssd-loader or gpu-runner");
	if (timeout_s < 0)
		return usage_error("--timeout must not be negative");
	char dir[256];
	if (run_dir && *run_dir) {
		if (str_copy(dir, sizeof(dir), run_dir) != 0)
			return usage_error("run directory path too long: %s", run_dir);
	} else if (run_dir_default(instance, dir, sizeof(dir)) != 0) {
		return usage_error("run directory path for instance %s too long", instance);
	}
	if (is_status)
		return sup_client_status(dir, json, timeout_s);
	if (!strcmp(cmd, "wait"))
		return sup_client_wait(dir, timeout_s);
	if (!strcmp(cmd, "shutdown"))
		return sup_client_shutdown(dir, timeout_s ? timeout_s : 60);
	return sup_client_restart(dir, service, timeout_s ? timeout_s : 660);
}

int main(int argc, char **argv)
{
	log_init("pipeline-supervisor");
	if (argc >= 2) {
		const char *cmd = argv[1];
		if (!strcmp(cmd, "status") || !strcmp(cmd, "wait") || !strcmp(cmd, "shutdown") ||
		    !strcmp(cmd, "restart"))
			return client_main(cmd, argc - 1, argv + 1);
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

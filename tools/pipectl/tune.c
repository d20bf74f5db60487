/* tune.c - pipectl get and pipectl tune: a service's parameters (MSG_CONFIG_GET) and live
 * changes to them (MSG_CONFIG_SET). See common/tunable.h for what the service does with them.
 *
 *   pipectl get kv-store                       every parameter, one line each
 *   pipectl get kv-store kv-dram-budget --json
 *   pipectl tune kv-store kv-dram-budget=8MiB io-depth=8
 *
 * A line reads "key = value  (tunable; range; description)" or "key = value  (fixed;
 * description)". A refusal (an unknown key, a bad value, a fixed key) prints the service's
 * message and exits 1; nothing was changed. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/pipectl/pipectl.h"

/* Prints one parameter as a line. */
static void print_entry(const char *key, json_t *e)
{
	const char *text = json_string_value(json_object_get(e, "text"));
	const char *range = json_string_value(json_object_get(e, "range"));
	const char *help = json_string_value(json_object_get(e, "description"));
	bool tunable = json_is_true(json_object_get(e, "tunable"));
	printf("%s = %s  (%s", key, text && *text ? text : "-", tunable ? "tunable" : "fixed");
	if (tunable && range && *range)
		printf("; %s", range);
	if (help && *help)
		printf("; %s", help);
	printf(")\n");
}

/* Sends req to service and prints the MSG_CONFIG answer. Returns the exit status. */
static int config_call(struct pipectl *p, const char *service, struct msg *req, const char *what, bool as_json)
{
	struct rpc_client *c = pipectl_connect(p, service);
	if (!c)
		return PIPECTL_EXIT_FAIL;
	struct msg rep;
	int status = PIPECTL_EXIT_FAIL;
	int rc = rpc_call(c, req, &rep, pipectl_timeout_ms(p, PIPECTL_DEFAULT_TIMEOUT_S));
	if (rc) {
		pipectl_rpc_failed(p, service, what, rc, &rep);
		goto out_client;
	}
	if (rep.type != MSG_CONFIG) {
		fprintf(stderr, "pipectl: %s answered %s with %s (a service built before live tuning?)\n", service, what,
			msg_type_name(rep.type));
		goto out_reply;
	}
	if (!pipectl_same_service(service, &rep.config.service, what))
		goto out_reply;
	json_t *j = pipectl_json_object(service, "parameters", rep.config.json.p, rep.config.json.len);
	if (!j)
		goto out_reply;
	if (as_json) {
		char *text = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
		if (text)
			printf("%s\n", text);
		free(text);
	} else {
		const char *key;
		json_t *e;
		json_object_foreach(j, key, e) print_entry(key, e);
	}
	json_decref(j);
	status = PIPECTL_EXIT_OK;
out_reply:
	msg_free(&rep);
out_client:
	rpc_client_destroy(&c);
	return status;
}

int cmd_get(struct pipectl *p, int argc, char **argv)
{
	bool as_json = false;
	struct opt opts[] = {
		{"json", OPT_BOOL, &as_json, NULL, "print the parameters as JSON (value, text, type, tunable, range, ...)"},
		{0},
	};
	char **pos = calloc((size_t)argc + 1, sizeof(*pos));
	if (!pos)
		return PIPECTL_EXIT_FAIL;
	int n = 0, status = PIPECTL_EXIT_FAIL;
	int rc = pipectl_parse("get SERVICE [KEY...] [--json]",
			       "Prints the service's parameters: every one, or the keys given. A line reads \"key = value  "
			       "(tunable; range; description)\" for one that `pipectl tune` can change while the service runs, "
			       "\"key = value  (fixed; description)\" for one fixed at start.",
			       opts, argc, argv, pos, 1, argc, &n);
	if (rc) {
		free(pos);
		return rc == 1 ? PIPECTL_EXIT_OK : PIPECTL_EXIT_USAGE;
	}
	const char *service = pos[0];
	if (!pipectl_check_service(service)) {
		free(pos);
		return PIPECTL_EXIT_USAGE;
	}
	struct msg req;
	msg_init(&req, MSG_CONFIG_GET, 0);
	char *keys = NULL;
	if (n > 1) {
		json_t *a = json_array();
		bool ok = a != NULL;
		for (int i = 1; ok && i < n; i++)
			ok = json_array_append_new(a, json_string(pos[i])) == 0; /* NULL: not UTF-8 */
		keys = ok ? json_dumps(a, JSON_COMPACT) : NULL;
		json_decref(a);
		if (!keys) {
			fprintf(stderr, "pipectl: get: the keys are not valid UTF-8, or out of memory\n");
			status = PIPECTL_EXIT_USAGE;
			goto out;
		}
		req.config_get.keys.p = keys;
		req.config_get.keys.len = (uint32_t)strlen(keys);
		if (req.config_get.keys.len > 16384) {
			fprintf(stderr, "pipectl: get: too many keys\n");
			status = PIPECTL_EXIT_USAGE;
			goto out;
		}
	}
	status = config_call(p, service, &req, "CONFIG_GET", as_json);
out:
	free(keys);
	free(pos);
	return status;
}

int cmd_tune(struct pipectl *p, int argc, char **argv)
{
	bool as_json = false;
	struct opt opts[] = {
		{"json", OPT_BOOL, &as_json, NULL, "print the new values as JSON"},
		{0},
	};
	char **pos = calloc((size_t)argc + 1, sizeof(*pos));
	if (!pos)
		return PIPECTL_EXIT_FAIL;
	int n = 0, status = PIPECTL_EXIT_USAGE;
	int rc = pipectl_parse("tune SERVICE KEY=VALUE... [--json]",
			       "Changes parameters of a running service at once (`pipectl get SERVICE` lists them). All "
			       "or nothing: when one pair is refused (an unknown key, a bad value, one fixed at start) the "
			       "service's message is printed, nothing changes, and the exit status is 1. On success the "
			       "new values are printed. A change lasts as long as the service's process: a restarted "
			       "service starts from its command line again.",
			       opts, argc, argv, pos, 2, argc, &n);
	if (rc) {
		free(pos);
		return rc == 1 ? PIPECTL_EXIT_OK : PIPECTL_EXIT_USAGE;
	}
	const char *service = pos[0];
	json_t *o = json_object();
	char *settings = NULL;
	if (!pipectl_check_service(service))
		goto out;
	if (!o) {
		status = PIPECTL_EXIT_FAIL;
		goto out;
	}
	for (int i = 1; i < n; i++) {
		char *eq = strchr(pos[i], '=');
		if (!eq || eq == pos[i]) {
			fprintf(stderr, "pipectl: tune: '%s' is not KEY=VALUE (usage: pipectl tune SERVICE KEY=VALUE...)\n",
				pos[i]);
			goto out;
		}
		*eq = 0;
		if (json_object_get(o, pos[i])) {
			fprintf(stderr, "pipectl: tune: %s is given twice\n", pos[i]);
			goto out;
		}
		json_t *v = json_string(eq + 1);
		if (!v || json_object_set_new(o, pos[i], v) != 0) {
			fprintf(stderr, "pipectl: tune: %s=%s is not valid UTF-8\n", pos[i], eq + 1);
			goto out;
		}
	}
	settings = json_dumps(o, JSON_COMPACT);
	if (!settings || strlen(settings) > 65536) {
		fprintf(stderr, "pipectl: tune: %s\n", settings ? "the settings are too long" : "out of memory");
		goto out;
	}
	struct msg req;
	msg_init(&req, MSG_CONFIG_SET, 0);
	req.config_set.settings.p = settings;
	req.config_set.settings.len = (uint32_t)strlen(settings);
	status = config_call(p, service, &req, "CONFIG_SET", as_json);
out:
	free(settings);
	json_decref(o);
	free(pos);
	return status;
}

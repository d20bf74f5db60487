/* status.c - the supervisor's status as JSON (supervisor.h describes it): what MSG_STATS_GET is
 * answered with and what supervisor.pub publishes. */
#include <jansson.h>
#include <unistd.h>

#include "common/util.h"
#include "tools/supervisor/daemon_internal.h"

static const char *const phase_names[] = {"starting", "running", "stopping"};

static const char *svc_health(const struct sup *sup, const struct svc *v, uint64_t now)
{
	switch (v->state) {
	case SVC_FAILED:
		return "failed";
	case SVC_UP:
		break;
	default:
		return "down";
	}
	if (v->kill_reason != KILL_NONE || v->requested)
		return "down";
	uint64_t silent = now - v->last_beat_ns;
	if (silent <= (uint64_t)sup->cfg->heartbeat_ms * NS_PER_MS + 500 * NS_PER_MS)
		return "ok";
	if (v->busy)
		return "busy";
	if (v->kind == SUP_GPU_RUNNER && now < v->grace_until_ns && silent > hang_ns(sup))
		return "waiting";
	return "late";
}

/* Seconds to the millisecond (printed with JSON_REAL_PRECISION(10): no float noise). */
static json_t *json_seconds(uint64_t ns)
{
	return json_real((double)(ns / NS_PER_MS) / 1000.0);
}

static json_t *svc_json(const struct sup *sup, const struct svc *v, uint64_t now)
{
	json_t *o = json_object();
	json_t *argv = json_array();
	for (char **a = v->argv; *a; a++)
		json_array_append_new(argv, json_string(*a));
	char epoch[20];
	snprintf(epoch, sizeof(epoch), "%016llx", (unsigned long long)v->epoch);
	json_object_set_new(o, "pid", v->pid ? json_integer(v->pid) : json_null());
	json_object_set_new(o, "service_pid", v->service_pid ? json_integer(v->service_pid) : json_null());
	json_object_set_new(o, "state", json_string(svc_state_names[v->state]));
	json_object_set_new(o, "health", json_string(svc_health(sup, v, now)));
	json_object_set_new(o, "uptime_s", v->pid ? json_seconds(now - v->started_ns) : json_null());
	json_object_set_new(o, "restarts", json_integer(v->restarts));
	json_object_set_new(o, "launches", json_integer(v->launches));
	json_object_set_new(o, "last_exit", v->last_exit[0] ? json_string(v->last_exit) : json_null());
	json_object_set_new(o, "last_error", v->last_error[0] ? json_string(v->last_error) : json_null());
	json_object_set_new(o, "epoch", v->state == SVC_UP ? json_string(epoch) : json_null());
	json_object_set_new(o, "heartbeats", json_integer((json_int_t)v->beats));
	json_object_set_new(o, "heartbeat_age_ms",
			    v->state == SVC_UP ? json_integer((json_int_t)((now - v->last_beat_ns) / NS_PER_MS)) : json_null());
	json_object_set_new(o, "next_restart_ms",
			    v->state == SVC_RESTARTING && v->restart_at_ns > now
				    ? json_integer((json_int_t)((v->restart_at_ns - now) / NS_PER_MS))
				    : json_null());
	json_object_set_new(o, "failures_in_window", json_integer(v->n_history));
	json_object_set_new(o, "argv", argv);
	return o;
}

char *stats_json(void *ctx)
{
	struct sup *sup = ctx;
	const struct sup_config *cfg = sup->cfg;
	uint64_t now = now_ns();
	json_t *top = json_object();
	json_t *me = json_object();
	json_object_set_new(me, "pid", json_integer(getpid()));
	json_object_set_new(me, "instance", json_string(cfg->instance));
	json_object_set_new(me, "run_dir", json_string(cfg->run_dir));
	json_object_set_new(me, "state", json_string(phase_names[sup->phase]));
	json_object_set_new(me, "uptime_s", json_seconds(now - sup->started_ns));
	json_object_set_new(me, "heartbeat_ms", json_integer(cfg->heartbeat_ms));
	json_object_set_new(me, "hang_ms", json_integer((json_int_t)(hang_ns(sup) / NS_PER_MS)));
	json_object_set_new(me, "burst_limit", json_integer(cfg->burst_limit));
	json_object_set_new(me, "burst_window_s", json_integer(cfg->burst_window_s));
	json_object_set_new(me, "stop_timeout_s", json_integer(cfg->stop_timeout_s));
	json_object_set_new(top, "supervisor", me);
	json_t *services = json_object();
	for (int i = 0; i < sup->n; i++)
		json_object_set_new(services, sup->s[i].name, svc_json(sup, &sup->s[i], now));
	json_object_set_new(top, "services", services);
	char *text = json_dumps(top, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
	json_decref(top);
	return text;
}

/* summary.c - pipectl summary: the counters of all three services read together and
 * printed per tier (disk -> DRAM, DRAM -> runner, KV cache, compute).
 *
 * A counter a service does not report (an older or newer service) prints as "-"; a service
 * that does not answer makes its lines "-" and the exit status 1. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "tools/pipectl/pipectl.h"

/* Fetches and parses the stats of service. Returns the JSON object (caller decrefs) or NULL
 * after printing why. */
static json_t *fetch_stats(struct pipectl *p, const char *service)
{
	struct rpc_client *c = pipectl_connect(p, service);
	if (!c)
		return NULL;
	struct msg req, rep;
	json_t *j = NULL;
	msg_init(&req, MSG_STATS_GET, 0);
	int rc = rpc_call(c, &req, &rep, pipectl_timeout_ms(p, PIPECTL_DEFAULT_TIMEOUT_S));
	if (rc) {
		pipectl_rpc_failed(p, service, "STATS_GET", rc, &rep);
		goto out_client;
	}
	if (rep.type != MSG_STATS || !rep.stats.service.p || strcmp(rep.stats.service.p, service) != 0) {
		const char *who = rep.type == MSG_STATS && rep.stats.service.p ? rep.stats.service.p : "";
		fprintf(stderr, "pipectl: %s answered STATS_GET with %s from '%s'\n", service, msg_type_name(rep.type),
			who);
		goto out_reply;
	}
	j = pipectl_json_object(service, "stats", rep.stats.json.p, rep.stats.json.len);
out_reply:
	msg_free(&rep);
out_client:
	rpc_client_destroy(&c);
	return j;
}

/* The value of key as a number; false when absent or not a number (booleans count as 0/1). */
static bool get_num(json_t *obj, const char *key, double *out)
{
	json_t *v = obj ? json_object_get(obj, key) : NULL;
	if (json_is_number(v))
		*out = json_number_value(v);
	else if (json_is_boolean(v))
		*out = json_is_true(v) ? 1 : 0;
	else
		return false;
	return true;
}

/* Formatters into a caller's buffer, "-" when the counter is missing. */
static const char *fmt_size(json_t *obj, const char *key, char *buf, size_t len)
{
	double v;
	if (!get_num(obj, key, &v) || v < 0)
		return "-";
	return format_size((uint64_t)v, buf, len);
}

static const char *fmt_count(json_t *obj, const char *key, char *buf, size_t len)
{
	double v;
	if (!get_num(obj, key, &v))
		return "-";
	snprintf(buf, len, "%.0f", v);
	return buf;
}

static const char *fmt_rate(json_t *obj, const char *key, char *buf, size_t len)
{
	double v;
	if (!get_num(obj, key, &v))
		return "-";
	snprintf(buf, len, "%.1f tok/s", v);
	return buf;
}

static const char *fmt_us(json_t *obj, const char *key, char *buf, size_t len)
{
	double v;
	if (!get_num(obj, key, &v))
		return "-";
	snprintf(buf, len, "%.1f us", v);
	return buf;
}

static const char *fmt_yes_no(json_t *obj, const char *key)
{
	double v;
	if (!get_num(obj, key, &v))
		return "-";
	return v != 0 ? "yes" : "no";
}

static const char *fmt_string(json_t *obj, const char *key)
{
	json_t *v = obj ? json_object_get(obj, key) : NULL;
	return json_is_string(v) ? json_string_value(v) : "-";
}

int cmd_summary(struct pipectl *p, int argc, char **argv)
{
	struct opt opts[] = {{0}};
	int rc = pipectl_parse("summary",
			       "Fetches the counters of ssd-loader, kv-store and gpu-runner and prints what moved "
			       "through each tier.",
			       opts, argc, argv, NULL, 0, 0, NULL);
	if (rc)
		return rc == 1 ? PIPECTL_EXIT_OK : PIPECTL_EXIT_USAGE;
	json_t *ld = fetch_stats(p, "ssd-loader");
	json_t *kv = fetch_stats(p, "kv-store");
	json_t *gr = fetch_stats(p, "gpu-runner");
	char a[32], b[32], c[32], d[32], e[32], f[32];

	printf("instance %s (run dir %s)\n", p->instance, p->run_dir);
	printf("%-22s %s read from disk in %s reads (model %s, DRAM budget %s, %s slots, all resident: %s, "
	       "O_DIRECT: %s)\n",
	       "SSD -> DRAM (loader)", fmt_size(ld, "bytes_read", a, sizeof(a)),
	       fmt_count(ld, "reads_done", b, sizeof(b)),
	       fmt_size(ld, "model_bytes", c, sizeof(c)), fmt_size(ld, "dram_budget", d, sizeof(d)),
	       fmt_count(ld, "slots", e, sizeof(e)), fmt_yes_no(ld, "all_resident"), fmt_yes_no(ld, "o_direct"));
	printf("%-22s %s of weights handed to the runner in %s group acquires (backend %s)\n", "DRAM -> runner",
	       fmt_size(gr, "weight_bytes_acquired", a, sizeof(a)), fmt_count(gr, "weight_acquires", b, sizeof(b)),
	       fmt_string(gr, "backend"));
	printf("%-22s %s blocks committed, %s spilled to disk (%s written), %s fetched (%s from disk); "
	       "pool %s blocks\n",
	       "KV cache", fmt_count(gr, "kv_blocks_committed", a, sizeof(a)), fmt_count(kv, "spills", b, sizeof(b)),
	       fmt_size(kv, "spill_bytes_written", c, sizeof(c)), fmt_count(gr, "kv_blocks_fetched", d, sizeof(d)),
	       fmt_count(kv, "fetches_from_disk", e, sizeof(e)), fmt_count(kv, "pool_blocks", f, sizeof(f)));
	printf("%-22s %s hits, %s misses (blocks looked up by key), %s blocks cached; the runner restored %s "
	       "positions in %s lookups (%s blocks still on its GPU)\n",
	       "KV prefix cache", fmt_count(kv, "prefix_hits", a, sizeof(a)), fmt_count(kv, "prefix_misses", b, sizeof(b)),
	       fmt_count(kv, "cached_blocks", c, sizeof(c)), fmt_count(gr, "kv_prefix_positions", d, sizeof(d)),
	       fmt_count(gr, "kv_prefix_lookups", e, sizeof(e)), fmt_count(gr, "kv_prefix_blocks_on_gpu", f, sizeof(f)));
	char g[32], h[32];
	printf("%-22s prefill %s (%s prompt tokens), decode %s (%s tokens generated), %s requests\n", "compute",
	       fmt_rate(gr, "last_prefill_tok_s", a, sizeof(a)), fmt_count(gr, "prompt_tokens", b, sizeof(b)),
	       fmt_rate(gr, "last_decode_tok_s", g, sizeof(g)), fmt_count(gr, "tokens_generated", h, sizeof(h)),
	       fmt_count(gr, "requests", c, sizeof(c)));
	json_t *cs = gr ? json_object_get(gr, "cpu_share") : NULL;
	if (json_is_object(cs)) {
		char fl[32];
		printf("%-22s %s, %s FFNs split (r %s..%s of %s), %s jobs on %s threads (%s), %s read (%s a token), "
		       "%s failed\n", "CPU share", fmt_string(cs, "policy"), fmt_count(cs, "split_ffns", a, sizeof(a)),
		       fmt_count(cs, "r_min", b, sizeof(b)), fmt_count(cs, "r_max", c, sizeof(c)),
		       fmt_count(cs, "ffn_dim", d, sizeof(d)), fmt_count(cs, "jobs", e, sizeof(e)),
		       fmt_count(cs, "threads", f, sizeof(f)), fmt_string(cs, "handoff"), fmt_size(cs, "bytes", g, sizeof(g)),
		       fmt_size(cs, "bytes_per_token", h, sizeof(h)), fmt_count(cs, "jobs_failed", fl, sizeof(fl)));
		/* The pool itself: its queue now and at its deepest, its tasks, and what a split FFN cost the
		 * stream beyond its CPU job (the handoff both ways; CUDA times it, 0 timed elsewhere). */
		printf("%-22s queue %s (at most %s), %s tasks done, %s failed; handoff %s beyond the job (%s split FFNs "
		       "timed on the stream)\n",
		       "CPU pool", fmt_count(cs, "queue_depth", a, sizeof(a)), fmt_count(cs, "queue_high_water", b, sizeof(b)),
		       fmt_count(cs, "tasks_done", c, sizeof(c)), fmt_count(cs, "tasks_failed", d, sizeof(d)),
		       fmt_us(cs, "handoff_us", e, sizeof(e)), fmt_count(cs, "timed_ffns", f, sizeof(f)));
		json_t *ex = json_object_get(cs, "experts");
		if (json_is_number(ex) && json_number_value(ex) > 0) {
			const double span = json_number_value(json_object_get(cs, "experts_span_ms")),
				     layers = json_number_value(json_object_get(cs, "expert_layers"));
			json_t *gw = json_object_get(gr, "gpu_window");
			printf("%-22s %s routed experts computed by the CPU pool (%s of them an expert's rows split with "
			       "the copies), a layer's in %.3f ms (first submitted to last done, over %s layers)\n",
			       "CPU experts", fmt_count(cs, "experts", a, sizeof(a)),
			       fmt_count(json_is_object(gw) ? gw : NULL, "experts_split", c, sizeof(c)),
			       layers > 0 ? span / layers : 0, fmt_count(cs, "expert_layers", b, sizeof(b)));
		}
	}
	int status = ld && kv && gr ? PIPECTL_EXIT_OK : PIPECTL_EXIT_FAIL;
	json_decref(ld);
	json_decref(kv);
	json_decref(gr);
	return status;
}

/* render.c - the text view of a snapshot (see inspect.h and docs/operations.md). Every value
 * comes from the snapshot's JSON; a counter that is missing (an older service, a service
 * that is down, an object not attached) prints as "-". */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/util.h"
#include "tools/inspect/inspect.h"

double jnum(json_t *o, const char *key, double def)
{
	json_t *v = o ? json_object_get(o, key) : NULL;
	if (json_is_number(v))
		return json_number_value(v);
	if (json_is_boolean(v))
		return json_is_true(v) ? 1 : 0;
	return def;
}

const char *jstr(json_t *o, const char *key, const char *def)
{
	json_t *v = o ? json_object_get(o, key) : NULL;
	return json_is_string(v) ? json_string_value(v) : def;
}

static json_t *jobj(json_t *o, const char *key)
{
	json_t *v = o ? json_object_get(o, key) : NULL;
	return json_is_object(v) ? v : NULL;
}

/* Is there a number (or boolean) at key? null and absent are not. */
static bool jhas(json_t *o, const char *key)
{
	json_t *v = o ? json_object_get(o, key) : NULL;
	return json_is_number(v) || json_is_boolean(v);
}

/* Up to 8 formatted values live at once per line: a small ring of buffers. */
static char *buf_next(void)
{
	static char bufs[16][48];
	static unsigned i;
	return bufs[i++ % 16];
}

static const char *count(json_t *o, const char *key)
{
	if (!jhas(o, key))
		return "-";
	char *b = buf_next();
	snprintf(b, 48, "%.0f", jnum(o, key, 0));
	return b;
}

static const char *size(json_t *o, const char *key)
{
	double v = jnum(o, key, -1);
	if (v < 0)
		return "-";
	return format_size((uint64_t)v, buf_next(), 48);
}

static const char *yes_no(json_t *o, const char *key)
{
	return !jhas(o, key) ? "-" : jnum(o, key, 0) != 0 ? "yes" : "no";
}

static const char *duration(double s)
{
	char *b = buf_next();
	if (s < 0)
		return "-";
	uint64_t t = (uint64_t)s;
	if (t < 60)
		snprintf(b, 48, "%.1fs", s);
	else if (t < 3600)
		snprintf(b, 48, "%um%02us", (unsigned)(t / 60), (unsigned)(t % 60));
	else if (t < 86400)
		snprintf(b, 48, "%uh%02um", (unsigned)(t / 3600), (unsigned)(t / 60 % 60));
	else
		snprintf(b, 48, "%ud%02uh", (unsigned)(t / 86400), (unsigned)(t / 3600 % 24));
	return b;
}

struct out {
	FILE *f;
	const char *eol;
	int width;
};

static void line(struct out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void line(struct out *o, const char *fmt, ...)
{
	char text[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	/* Cut at the screen's width so that nothing wraps and scrolls the view. */
	if (o->width > 0 && strlen(text) > (size_t)o->width)
		text[o->width] = 0;
	size_t n = strlen(text);
	while (n && text[n - 1] == ' ')
		text[--n] = 0;
	fprintf(o->f, "%s%s", text, o->eol);
}

/* "── NAME ─ detail ───" */
static void heading(struct out *o, const char *name, const char *detail)
{
	char text[512];
	int n = snprintf(text, sizeof(text), "-- %s -- %s ", name, detail);
	int w = o->width > 0 ? o->width : 100;
	while (n < w && n < (int)sizeof(text) - 1)
		text[n++] = '-';
	text[n] = 0;
	line(o, "%s", text);
}

/* "pid 4716, up 12m03s, beat 0.4 s ago" or "down (...)". */
static void service_heading(struct out *o, const char *name, json_t *svc)
{
	char detail[256];
	if (jnum(svc, "up", 0)) {
		snprintf(detail, sizeof(detail), "pid %s, up %s, heartbeat %.1f s ago", count(svc, "pid"),
			 duration(jnum(svc, "uptime_ms", -1000) / 1000), jnum(svc, "heartbeat_age_ms", 0) / 1000);
	} else if (jhas(svc, "heartbeat_age_ms")) {
		snprintf(detail, sizeof(detail), "DOWN (no heartbeat for %.1f s)", jnum(svc, "heartbeat_age_ms", 0) / 1000);
	} else {
		snprintf(detail, sizeof(detail), "DOWN (nothing heard on %s.pub)", name);
	}
	heading(o, name, detail);
}

static void shm_line(struct out *o, const char *what, json_t *shm)
{
	if (!shm)
		return;
	if (!jnum(shm, "attached", 0)) {
		line(o, "  %-6s %s: %s", what, jstr(shm, "name", "?"), jstr(shm, "error", "not attached"));
		return;
	}
	line(o, "  %-6s %s: %s, owner pid %s (%s), adoptions %s", what, jstr(shm, "name", "?"), size(shm, "size"),
	     count(shm, "owner_pid"), jnum(shm, "owner_alive", 0) ? "alive" : "DEAD", count(shm, "adoptions"));
}

/* ---- supervisor ---- */

static void render_supervisor(struct out *o, json_t *sup, const char *only)
{
	json_t *status = jobj(sup, "status");
	json_t *me = jobj(status, "supervisor");
	if (!jnum(sup, "up", 0) || !me) {
		line(o, "supervisor: DOWN (nothing heard on supervisor.pub: the services run unsupervised, or not at all)");
		return;
	}
	line(o, "supervisor pid %s, %s, up %s (heartbeat %s ms, hung after %s ms, at most %s restarts in %s s)",
	     count(me, "pid"), jstr(me, "state", "?"), duration(jnum(me, "uptime_s", -1)), count(me, "heartbeat_ms"),
	     count(me, "hang_ms"), count(me, "burst_limit"), count(me, "burst_window_s"));
	json_t *svcs = jobj(status, "services");
	line(o, "  %-12s %-8s %-10s %-7s %-9s %-8s %s", "service", "pid", "state", "health", "uptime", "restarts",
	     "last error");
	/* Every service the supervisor runs, in its order: the three, and the further runners of a model
	 * split across GPUs (gpu-runner-1, ...). */
	const char *name;
	json_t *s;
	json_object_foreach(svcs, name, s) {
		if (only && strcmp(only, name))
			continue;
		json_t *err = s ? json_object_get(s, "last_error") : NULL;
		line(o, "  %-12s %-8s %-10s %-7s %-9s %-8s %s", name, count(s, "pid"), jstr(s, "state", "-"),
		     jstr(s, "health", "-"), jhas(s, "uptime_s") ? duration(jnum(s, "uptime_s", -1)) : "-",
		     count(s, "restarts"), json_is_string(err) ? json_string_value(err) : "-");
	}
}

/* ---- ssd-loader ---- */

static void render_loader(struct out *o, json_t *svc)
{
	json_t *st = jobj(svc, "stats"), *shm = jobj(svc, "shm");
	bool ring = shm && jnum(shm, "attached", 0);
	shm_line(o, "ring", shm);
	json_t *slots = ring ? jobj(shm, "slots") : jobj(st, "slots_by_state");
	json_t *cls = jobj(shm, "class_slots");
	line(o, "  slots  %s (attn %s, ffn %s, expert %s, global %s): empty %s, loading %s, ready %s, held by the "
	     "runner %s%s",
	     ring ? count(shm, "n_slots") : count(st, "slots"), cls ? count(cls, "attn") : count(st, "slots_attn"),
	     cls ? count(cls, "ffn") : count(st, "slots_ffn"), cls ? count(cls, "expert") : count(st, "slots_expert"),
	     cls ? count(cls, "global") : count(st, "slots_global"), count(slots, "empty"), count(slots, "loading"),
	     count(slots, "ready"), count(slots, "held"), jnum(slots, "other", 0) ? " (some unreadable)" : "");
	line(o, "  reads  %s pending, %s queued, %s done: %s read, %s/s while reading; O_DIRECT %s",
	     count(st, "reads_pending"), count(st, "reads_queued"), count(st, "reads_done"), size(st, "bytes_read"),
	     size(st, "disk_bytes_per_s"), yes_no(st, "o_direct"));
	line(o, "  groups %s (%s pinned): %s loaded from disk, %s grants, %s releases, %s waits (%s waiting now), "
	     "read-ahead at group %s",
	     count(st, "groups"), ring ? count(shm, "pinned_groups") : "-", count(st, "groups_loaded"),
	     count(st, "grants"), count(st, "releases"), count(st, "waits"), count(st, "waiting"), count(st, "position"));
	line(o, "  plan   DRAM budget %s for a model of %s, all resident %s, %s read from disk per token",
	     size(st, "dram_budget"), size(st, "model_bytes"), yes_no(st, "all_resident"),
	     size(st, "disk_bytes_per_token"));
}

/* ---- kv-store ---- */

static void render_kv(struct out *o, json_t *svc)
{
	json_t *st = jobj(svc, "stats"), *shm = jobj(svc, "shm");
	bool pool = shm && jnum(shm, "attached", 0);
	if (shm && !pool && !strcmp(jstr(shm, "error", ""), "no such object"))
		line(o, "  pool   %s: none yet (made when the runner configures it)", jstr(shm, "name", "?"));
	else
		shm_line(o, "pool", shm);
	json_t *b = pool ? jobj(shm, "blocks") : jobj(st, "blocks_by_state");
	line(o, "  blocks %s of %s: free %s, writing %s, committed %s, spilling %s, loading %s; pinned %s%s",
	     pool ? count(shm, "n_blocks") : count(st, "pool_blocks"), pool ? size(shm, "block_bytes") : size(st, "block_bytes"),
	     count(b, "free"), count(b, "writing"), count(b, "committed"), count(b, "spilling"), count(b, "loading"),
	     pool ? count(shm, "pinned_blocks") : count(st, "pinned_blocks"), jnum(b, "other", 0) ? " (some unreadable)" : "");
	line(o, "  spill  %s of %s slots used; spill queue %s, fetch queue %s; %s written, %s read back",
	     pool ? count(shm, "spill_used") : count(st, "spill_used"),
	     pool ? count(shm, "n_spill_slots") : count(st, "spill_blocks"),
	     pool ? count(shm, "spill_queue") : count(st, "spill_queue"),
	     pool ? count(shm, "fetch_queue") : count(st, "fetch_queue"), size(st, "spill_bytes_written"),
	     size(st, "spill_bytes_read"));
	json_t *h = jobj(shm, "handles");
	line(o, "  blocks %s live: %s cached, %s referenced by the runner; %s in the pool, %s on disk",
	     h ? count(h, "live") : count(st, "live_handles"), h ? count(h, "cached") : count(st, "cached_blocks"),
	     h ? count(h, "referenced") : count(st, "referenced_blocks"), count(h, "in_pool"), count(h, "in_spill"));
	double hits = jnum(st, "prefix_hits", -1), misses = jnum(st, "prefix_misses", -1);
	char rate[32] = "-";
	if (hits >= 0 && misses >= 0 && hits + misses > 0)
		snprintf(rate, sizeof(rate), "%.1f%%", 100 * hits / (hits + misses));
	line(o, "  prefix %s hits, %s misses (%s), %s cached dropped; commits %s, fetches %s (%s from disk), spills %s, "
	     "checksum failures %s",
	     count(st, "prefix_hits"), count(st, "prefix_misses"), rate, count(st, "cache_drops"), count(st, "commits"),
	     count(st, "fetches"), count(st, "fetches_from_disk"), count(st, "spills"), count(st, "checksum_failures"));
}

/* ---- gpu-runner ---- */

/* The letter pair of layer l in a "layers" array, or "--". */
static const char *pair_at(json_t *layers, size_t l)
{
	json_t *v = json_is_array(layers) ? json_array_get(layers, l) : NULL;
	const char *s = json_is_string(v) ? json_string_value(v) : NULL;
	return s && strlen(s) == 2 ? s : "--";
}

static const char *int_at(json_t *arr, size_t l)
{
	json_t *v = json_is_array(arr) ? json_array_get(arr, l) : NULL;
	if (!json_is_integer(v))
		return "-";
	char *b = buf_next();
	snprintf(b, 48, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
	return b;
}

static void render_runner(struct out *o, json_t *svc)
{
	json_t *st = jobj(svc, "stats");
	json_t *ring = jobj(jobj(svc, "shm"), "ring"), *pool = jobj(jobj(svc, "shm"), "pool");
	if (ring && !jnum(ring, "attached", 0))
		ring = NULL;
	if (pool && !jnum(pool, "attached", 0))
		pool = NULL;
	char waiting[32] = "-"; /* "queued" counts the request being generated */
	if (jhas(st, "queued"))
		snprintf(waiting, sizeof(waiting), "%.0f", jnum(st, "queued", 0) - (jnum(st, "busy", 0) ? 1 : 0));
	line(o, "  run    backend %s; %s, %s requests waiting; %s requests done or running (%s failed); context %s",
	     jstr(st, "backend", "-"), !jhas(st, "busy") ? "-" : jnum(st, "busy", 0) ? "generating" : "idle", waiting,
	     count(st, "requests"), count(st, "failures"), count(st, "max_context"));
	char now[32] = "-";
	if (jhas(st, "tokens_per_s"))
		snprintf(now, sizeof(now), "%.1f", jnum(st, "tokens_per_s", 0));
	line(o, "  tok/s  %s now; last request: prefill %.1f, decode %.1f; %s generated, %s prompt tokens", now,
	     jnum(st, "last_prefill_tok_s", 0), jnum(st, "last_decode_tok_s", 0), count(st, "tokens_generated"),
	     count(st, "prompt_tokens"));
	json_t *cq = jobj(st, "copy_queue");
	line(o, "  copies %s weight copies to the GPU in flight, %s weight groups held; %s KV fetch runs (%.1f ms "
	     "requests, %.1f ms copies)",
	     count(cq, "weights_h2d_in_flight"), count(cq, "weight_grants_held"), count(st, "kv_fetch_runs"),
	     jnum(st, "kv_fetch_request_ms", 0), jnum(st, "kv_fetch_copy_ms", 0));
	json_t *cs = jobj(st, "cpu_share");
	if (cs && jnum(cs, "split_ffns", 0) > 0) {
		char rs[48];
		snprintf(rs, sizeof(rs), jnum(cs, "r_min", 0) == jnum(cs, "r_max", 0) ? "%.0f" : "%.0f..%.0f",
			 jnum(cs, "r_min", 0), jnum(cs, "r_max", 0));
		line(o, "  cpu    share %s (balance %s, planned anew %s times): %s FFNs split at r %s of %s (steps of <= %s "
		     "tokens), %s threads via %s; queue %s (most %s), %s tasks; %s jobs, %s a token; job %.0f us, FFN on "
		     "the stream %.0f us (waited %.0f), handoff %.0f us",
		     jstr(cs, "policy", "-"), jstr(cs, "balance", "-"), count(cs, "replans"), count(cs, "split_ffns"), rs,
		     count(cs, "ffn_dim"), count(cs, "max_tokens"),
		     count(cs, "threads"), jstr(cs, "handoff", "-"), count(cs, "queue_depth"), count(cs, "queue_high_water"),
		     count(cs, "tasks_done"), count(cs, "jobs"), size(cs, "bytes_per_token"), jnum(cs, "cpu_job_us", 0),
		     jnum(cs, "stream_ffn_us", 0), jnum(cs, "stream_wait_us", 0), jnum(cs, "handoff_us", 0));
		json_t *hist = json_object_get(cs, "handoff_hist");
		if (json_is_array(hist) && json_array_size(hist) == 6) {
			long long h[6];
			for (size_t i = 0; i < 6; i++)
				h[i] = json_integer_value(json_array_get(hist, i));
			line(o, "         handoffs by size (us <50/100/200/500/1000/more): %lld/%lld/%lld/%lld/%lld/%lld; a job "
			     "starts %.0f us after its dispatch (at most %.0f), the pool waits %.0f us between two",
			     h[0], h[1], h[2], h[3], h[4], h[5], jnum(cs, "dispatch_us", 0), jnum(cs, "dispatch_max_us", 0),
			     jnum(cs, "gap_us", 0));
		}
	} else if (cs) {
		line(o, "  cpu    share %s: no FFN split", jstr(cs, "policy", "-"));
	}
	if (cs && jnum(cs, "experts", 0) > 0) {
		/* A mixture of experts on CUDA: the routed experts the pool computed, a layer's of them from
		 * the first submitted to the last done, and the chain between two layers'. */
		const double layers = jnum(cs, "expert_layers", 0), span = jnum(cs, "experts_span_ms", 0),
			     gaps = jnum(cs, "expert_gaps", 0), step_gaps = jnum(cs, "expert_step_gaps", 0);
		line(o, "  cpu    experts %s computed (%s of them an expert's rows split with the copies); a layer's %.3f ms, "
		     "first submitted to last done (%.1f GB/s over %s "
		     "layers; parts idle between a job's phases %.1f ms in all); between two layers' %.3f ms to the "
		     "next routing, %.3f ms on the host; across a token's ends %.3f ms",
		     count(cs, "experts"), count(jobj(st, "gpu_window"), "experts_split"), layers > 0 ? span / layers : 0,
		     span > 0 ? jnum(cs, "experts_span_bytes", 0) / span / 1e6 : 0, count(cs, "expert_layers"),
		     jnum(cs, "experts_phase_wait_ms", 0), gaps > 0 ? jnum(cs, "experts_gap_gpu_ms", 0) / gaps : 0,
		     gaps > 0 ? jnum(cs, "experts_gap_host_ms", 0) / gaps : 0,
		     step_gaps > 0 ? jnum(cs, "experts_step_gap_ms", 0) / step_gaps : 0);
	}
	json_t *pb = jobj(pool, "blocks");
	char pool_used[64] = "-";
	if (pb)
		snprintf(pool_used, sizeof(pool_used), "%.0f of %s",
			 jnum(pool, "n_blocks", 0) - jnum(pb, "free", 0), count(pool, "n_blocks"));
	line(o, "  KV     blocks per tier: GPU %s of %s, DRAM pool %s, disk %s of %s; %s committed, %s fetched back",
	     count(st, "kv_gpu_blocks_used"), count(st, "kv_gpu_blocks"), pool_used, count(pool, "spill_used"),
	     count(pool, "n_spill_slots"), count(st, "kv_blocks_committed"), count(st, "kv_blocks_fetched"));

	json_t *wg = jobj(st, "weight_groups"), *rg = jobj(ring, "groups"), *pin = jobj(ring, "pinned");
	json_t *kvl = jobj(st, "kv_layers");
	size_t n = (size_t)jnum(ring, "n_layers", 0);
	if (json_is_array(json_object_get(wg, "layers")) && json_array_size(json_object_get(wg, "layers")) > n)
		n = json_array_size(json_object_get(wg, "layers"));
	line(o, "  weights embed %s/%s, head %s/%s (DRAM ring/runner).  R ready in DRAM, H held by the runner, "
	     "L loading, E not in DRAM,",
	     jstr(rg, "embed", "-"), jstr(wg, "embed", "-"), jstr(rg, "head", "-"), jstr(wg, "head", "-"));
	line(o, "          G on the GPU for good, W in a GPU window slot, C copying to the GPU, T leaving it; "
	     "* pinned in DRAM.");
	line(o, "  KV blocks of the sequence per layer: KVgpu in the runner's arena, store only in kv-store (DRAM "
	     "pool or disk)");
	if (!n)
		return;
	/* Column-major cells: "layer ring runner | KV gpu store". */
	const int cell = 30;
	int cols = (o->width > 0 ? o->width - 2 : 98) / cell;
	if (cols < 1)
		cols = 1;
	size_t rows = (n + (size_t)cols - 1) / (size_t)cols;
	if ((size_t)cols > n)
		cols = (int)n;
	char text[1024];
	int k = snprintf(text, sizeof(text), "  ");
	for (int c = 0; c < cols && k < (int)sizeof(text) - cell; c++)
		k += snprintf(text + k, sizeof(text) - (size_t)k, "%5s  %-4s %-3s  %5s %5s  ", "layer", "ring", "run",
			      "KVgpu", "store");
	line(o, "%s", text);
	json_t *pl = json_object_get(pin, "layers");
	for (size_t r = 0; r < rows; r++) {
		k = snprintf(text, sizeof(text), "  ");
		for (int c = 0; c < cols; c++) {
			size_t l = (size_t)c * rows + r;
			if (l >= n || k >= (int)sizeof(text) - cell)
				break;
			const char *p = pair_at(pl, l);
			char ring_cell[4];
			snprintf(ring_cell, sizeof(ring_cell), "%s%s", pair_at(json_object_get(rg, "layers"), l),
				 p[0] == 'P' || p[1] == 'P' ? "*" : "");
			k += snprintf(text + k, sizeof(text) - (size_t)k, "%5zu  %-4s %-3s  %5s %5s  ", l, ring_cell,
				      pair_at(json_object_get(wg, "layers"), l), int_at(json_object_get(kvl, "gpu"), l),
				      int_at(json_object_get(kvl, "store"), l));
		}
		line(o, "%s", text);
	}
}

void render_text(FILE *f, json_t *snap, const char *service, int width, const char *eol)
{
	struct out o = {.f = f, .eol = eol, .width = width};
	double t = jnum(snap, "time", 0);
	time_t secs = (time_t)t;
	struct tm tm;
	char when[32] = "";
	if (localtime_r(&secs, &tm))
		strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", &tm);
	line(&o, "instance %s (run dir %s)  %s", jstr(snap, "instance", "?"), jstr(snap, "run_dir", "?"), when);
	render_supervisor(&o, jobj(snap, "supervisor"), service);
	json_t *svcs = jobj(snap, "services");
	for (int i = 0; i < INSPECT_N_SERVICES; i++) {
		const char *name = inspect_services[i];
		if (service && strcmp(service, name))
			continue;
		json_t *s = jobj(svcs, name);
		line(&o, "%s", "");
		service_heading(&o, name, s);
		if (!strcmp(name, "ssd-loader"))
			render_loader(&o, s);
		else if (!strcmp(name, "kv-store"))
			render_kv(&o, s);
		else
			render_runner(&o, s);
	}
}

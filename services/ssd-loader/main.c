/* ssd-loader - reads a checkpoint (a Hugging Face safetensors directory or a GGUF file) into the
 * weight ring in shared memory and lends its slots to the gpu-runner (MSG_W_ACQUIRE / MSG_W_GRANT
 * / MSG_W_RELEASE).
 *
 *   ssd-loader --model /models/llama-3.1-8b --dram-budget 24GiB [--instance NAME] [--run-dir DIR]
 *
 * Start: the manifest (config.json and the safetensors headers, or the GGUF header), the plan
 * (plan.h), the ring (ring.h, shared-memory object "weights" of the instance), then the service
 * loop, which answers HELLO at once while the reads run on io_uring in the background. Exit: the
 * ring is unlinked whatever the reason (a restarted loader lays it out anew; a runner keeps its
 * old mapping until it attaches again). Never touches CUDA. */
#include <assert.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/jinja/jinja.h"
#include "common/log.h"
#include "common/manifest.h"
#include "common/service.h"
#include "common/shm.h"
#include "common/util.h"
#include "common/weight_ring.h"
#include "services/ssd-loader/calibrate.h"
#include "services/ssd-loader/loader.h"
#include "services/ssd-loader/plan.h"
#include "services/ssd-loader/reader.h"
#include "services/ssd-loader/ring.h"

#define SERVICE_NAME "ssd-loader"

struct app {
	struct service *svc;
	struct loader *loader;
	struct shm_object *ring;
	const struct manifest *m;
};

static int send_grant(void *ctx, const struct bus_peer *peer, uint64_t corr, const struct msg_w_grant *g)
{
	struct app *a = ctx;
	struct msg m;
	msg_init(&m, MSG_W_GRANT, corr);
	m.w_grant = *g;
	return service_reply(a->svc, peer, &m);
}

static void send_fail(void *ctx, const struct bus_peer *peer, uint64_t corr, int code, const char *text)
{
	struct app *a = ctx;
	service_reply_error(a->svc, peer, corr, code, text);
}

static int on_request(void *ctx, struct service *s, const struct bus_peer *peer, const struct msg *req, char *errtext,
		      size_t errlen)
{
	struct app *a = ctx;
	struct msg ok;
	int rc;
	switch (req->type) {
	case MSG_W_ACQUIRE: {
		const struct msg_w_acquire *q = &req->w_acquire;
		rc = loader_acquire(a->loader, q->session, peer, req->corr, q->groups.v, q->groups.n, q->release.v,
				    q->release.n, errtext, errlen);
		if (rc)
			return rc;
		/* Grants answer the groups; an acquire of none (releases only) still gets a reply. */
		if (q->groups.n == 0) {
			msg_init(&ok, MSG_OK, req->corr);
			service_reply(s, peer, &ok);
		}
		return 0;
	}
	case MSG_W_RELEASE:
		rc = loader_release(a->loader, req->w_release.session, req->w_release.groups.v, req->w_release.groups.n,
				    errtext, errlen);
		if (rc)
			return rc;
		msg_init(&ok, MSG_OK, req->corr);
		service_reply(s, peer, &ok);
		return 0;
	default:
		snprintf(errtext, errlen, "%s does not handle %s", SERVICE_NAME, msg_type_name(req->type));
		return -ENOTSUP;
	}
}

static void on_hello(void *ctx, const struct msg *req, struct msg_hello_reply *reply)
{
	struct app *a = ctx;
	loader_hello(a->loader, req->hello.client.p, req->hello.session);
	reply->layout = WRING_LAYOUT_VERSION;
	reply->manifest_hash = a->m->hash;
	reply->shm_name.p = (char *)shm_object_get_name(a->ring);
	reply->shm_size = shm_object_size(a->ring);
}

static char *on_stats(void *ctx)
{
	struct app *a = ctx;
	return loader_stats_json(a->loader);
}

static void on_tick(void *ctx, struct service *s)
{
	struct app *a = ctx;
	loader_tick(a->loader);
}

static void on_io(void *ctx, struct service *s, int fd)
{
	struct app *a = ctx;
	loader_process_io(a->loader, false);
}

/* ---- live tuning ---- */

static void read_ahead_get(void *ctx, struct tunable_value *v)
{
	v->i = loader_read_ahead(((struct app *)ctx)->loader);
}

static int read_ahead_set(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen)
{
	if (apply)
		loader_set_read_ahead(((struct app *)ctx)->loader, (uint32_t)v->i);
	return 0;
}

static void io_depth_get(void *ctx, struct tunable_value *v)
{
	v->i = loader_io_limit(((struct app *)ctx)->loader);
}

static int io_depth_set(void *ctx, const struct tunable_value *v, bool apply, char *why, size_t whylen)
{
	struct app *a = ctx;
	if (!apply)
		return 0;
	int rc = loader_set_io_limit(a->loader, (uint32_t)v->i);
	if (rc)
		snprintf(why, whylen, "the reader refused a limit of %lld", (long long)v->i);
	return rc;
}

/* What can change while the loader serves (the fixed parameters are added by main). */
static void register_tunables(struct app *a)
{
	uint32_t ra_max = loader_read_ahead_max(a->loader);
	struct tunable ra = {.name = "read-ahead",
			     .help = "groups of each streaming class read ahead of the runner (default: every "
				     "streaming slot); fewer read later and evict sooner",
			     .type = TUNABLE_INT, .min = 0, .max = ra_max, .get = read_ahead_get,
			     .set = read_ahead_set, .ctx = a};
	if (ra_max)
		service_add_tunable(a->svc, &ra);
	else
		service_add_fixed(a->svc, "read-ahead", TUNABLE_INT, "0",
				  "every group is resident in the DRAM budget: nothing streams, nothing is read ahead");
	struct tunable io = {.name = "io-depth",
			     .help = "reads in flight at most (a cap under the io_uring depth set at start)",
			     .type = TUNABLE_INT, .min = 1, .max = loader_io_depth(a->loader), .get = io_depth_get,
			     .set = io_depth_set, .ctx = a};
	service_add_tunable(a->svc, &io);
}

/* The chat template that goes to the runner: checked here too (the runner parses it again at its
 * start), so that `start` says at once when chats will not render by it. */
static void log_chat_template(const struct manifest *m)
{
	if (!m->chat_template) {
		if (m->chat_template_note[0])
			log_warn("%s", m->chat_template_note);
		log_info("no chat template: the runner renders chats in the format its tokenizer's special "
			 "tokens name (Llama 3 headers or ChatML), if any");
		return;
	}
	char err[512];
	struct jinja_template *t;
	if (jinja_parse(m->chat_template, strlen(m->chat_template), &t, err, sizeof(err)) != 0) {
		log_warn("the chat template of %s does not parse (%s): chats are rendered in the tokenizer's "
			 "built-in format where it has one, else refused; give a template with --chat-template FILE",
			 m->chat_template_from, err);
		return;
	}
	jinja_free(&t);
	log_info("chat template of %s (%zu bytes) goes to the runner with the weights", m->chat_template_from,
		 strlen(m->chat_template));
}

int main(int argc, char **argv)
{
	char *instance = NULL, *run_dir_flag = NULL, *model = NULL, *tokenizer = NULL, *log_level = NULL;
	char *chat_template = NULL;
	uint64_t budget = 0, max_read = 0;
	long io_depth = 0;
	bool buffered = false, io_async = false;
	uint64_t disk_bps = 0;
	struct opt opts[] = {
		{"instance", OPT_STRING, &instance, "default", "instance name (shared-memory and run-directory names)"},
		{"run-dir", OPT_STRING, &run_dir_flag, NULL, "directory of the control sockets (default "
							     "$PIPELINE_RUN_DIR or /tmp/llmp-<uid>/<instance>)"},
		{"model", OPT_STRING, &model, NULL,
		 "Hugging Face checkpoint directory, or a GGUF file (the first of a split set) (required)"},
		{"tokenizer", OPT_STRING, &tokenizer, NULL, "tokenizer.json to use instead of the model's own"},
		{"chat-template", OPT_STRING, &chat_template, NULL,
		 "a chat template (Jinja text, as tokenizer_config.json's chat_template) to use instead of the model's "
		 "own"},
		{"dram-budget", OPT_SIZE, &budget, "16GiB", "host memory for weight slots"},
		{"io-depth", OPT_INT, &io_depth, "64", "reads in flight at most"},
		{"max-read", OPT_SIZE, &max_read, "4MiB", "bytes per read (a multiple of 4 KiB)"},
		{"buffered", OPT_BOOL, &buffered, NULL, "read through the page cache, never O_DIRECT"},
		{"disk-bytes-per-s", OPT_SIZE, &disk_bps, "0",
		 "the disk's read bandwidth for the plan's prediction (0: measure at start, a fraction of a second)"},
		{"io-async", OPT_BOOL, &io_async, NULL,
		 "issue reads from io_uring's worker threads instead of inline (slower here; see ring.c)"},
		{"log-level", OPT_STRING, &log_level, NULL, "debug, info, warn or error (default info)"},
		{0},
	};
	log_init(SERVICE_NAME);
	int rc = config_parse(SERVICE_NAME, "reads a safetensors or GGUF checkpoint into the shared-memory weight ring",
			      opts, argc, argv, NULL, NULL);
	if (rc > 0)
		return 0;
	if (rc < 0)
		return 2;
	if (log_level) {
		enum log_level lv;
		if (log_parse_level(log_level, &lv) != 0) {
			fprintf(stderr, "%s: --log-level '%s' is not one of debug, info, warn, error\n", SERVICE_NAME,
				log_level);
			return 2;
		}
		log_set_level(lv);
	}
	if (!model || !*model) {
		fprintf(stderr, "%s: --model is required (a Hugging Face checkpoint directory or a GGUF file; see "
			"--help)\n", SERVICE_NAME);
		return 2;
	}
	if (io_depth < 1 || io_depth > (long)READER_MAX_DEPTH) {
		fprintf(stderr, "%s: --io-depth %ld is out of range (1..%u)\n", SERVICE_NAME, io_depth,
			READER_MAX_DEPTH);
		return 2;
	}
	if (max_read < READER_ALIGN || max_read > READER_MAX_READ || max_read % READER_ALIGN) {
		fprintf(stderr, "%s: --max-read %llu must be a multiple of %u bytes between 4KiB and 1GiB\n",
			SERVICE_NAME, (unsigned long long)max_read, READER_ALIGN);
		return 2;
	}
	char run_dir[256];
	if (run_dir_flag && *run_dir_flag) {
		if (str_copy(run_dir, sizeof(run_dir), run_dir_flag) != 0) {
			fprintf(stderr, "%s: --run-dir is too long\n", SERVICE_NAME);
			return 2;
		}
	} else if (run_dir_default(instance, run_dir, sizeof(run_dir)) != 0) {
		fprintf(stderr, "%s: the run directory for instance '%s' is too long\n", SERVICE_NAME, instance);
		return 2;
	}

	int status = 1;
	char err[1024];
	struct app app = {0};
	struct manifest *m = NULL;
	struct plan *plan = NULL;
	char shm_name[SHM_NAME_MAX];

	rc = manifest_load(model, &m, err, sizeof(err));
	if (rc) {
		log_error("cannot load the model in %s: %s", model, err);
		goto out;
	}
	app.m = m;
	char wsize[32];
	log_info("model %s: %u layers, dim %u, %u groups of %u tensors in %u file%s, %s of weights, manifest hash "
		 "%016llx",
		 model, m->cfg.n_layers, m->cfg.dim, m->n_groups, m->n_tensors, m->n_files, m->n_files == 1 ? "" : "s",
		 format_size(m->total_tensor_bytes, wsize, sizeof(wsize)), (unsigned long long)m->hash);

	if (tokenizer && *tokenizer) {
		rc = manifest_attach_tokenizer(m, tokenizer, err, sizeof(err));
		if (rc) {
			log_error("%s", err);
			goto out_manifest;
		}
	}
	if (m->tokenizer_bytes)
		log_info("tokenizer %s (%llu bytes) goes to the runner with the weights", m->tokenizer_path,
			 (unsigned long long)m->tokenizer_bytes);
	else if (m->tokenizer_note[0])
		log_warn("%s", m->tokenizer_note);
	else
		log_info("no tokenizer.json: the runner takes token ids only");
	if (chat_template && *chat_template) {
		rc = manifest_attach_chat_template(m, chat_template, err, sizeof(err));
		if (rc) {
			log_error("%s", err);
			goto out_manifest;
		}
	}
	log_chat_template(m);

	rc = plan_create(m, budget, &plan, err, sizeof(err));
	if (rc) {
		log_error("%s", err);
		goto out_manifest;
	}
	plan_describe(plan, err, sizeof(err));
	log_info("plan: %s", err);

	if (shm_object_name(instance, "weights", shm_name, sizeof(shm_name)) != 0) {
		log_error("the instance name '%s' is too long for a shared-memory name", instance);
		goto out_plan;
	}
	rc = ring_create(shm_name, m, plan, &app.ring, err, sizeof(err));
	if (rc) {
		log_error("%s", err);
		goto out_plan;
	}
	/* What the DRAM tier costs per token, for the runner's prediction: the bytes that stream,
	 * and the disk's bandwidth, measured now (into the ring's data region, which the loads
	 * overwrite next) unless given. */
	struct wring_header *rh = shm_object_base(app.ring);
	rh->plan.disk_bytes_per_token = plan_disk_bytes_per_pass(plan, m);
	if (!disk_bps && !buffered) {
		double bps = 0;
		uint32_t big = 0;
		for (uint32_t i = 1; i < m->n_files; i++)
			if (m->files[i].size > m->files[big].size)
				big = i;
		char why[512] = "";
		int crc = calibrate_disk(m->files[big].path, (char *)rh + rh->data_off, rh->data_bytes, 256u << 20,
					 (unsigned)io_depth, &bps, why, sizeof(why));
		if (crc == 0) {
			disk_bps = (uint64_t)bps;
			char b[32];
			log_info("disk: %.2f GB/s measured on %s (%s read)%s%s", bps / 1e9, m->files[big].path,
				 format_size(m->files[big].size < (256u << 20) ? m->files[big].size : (256u << 20), b,
					     sizeof(b)),
				 why[0] ? "; " : "", why);
		} else if (crc == -ERANGE) {
			log_info("%s", why);
		} else {
			log_warn("%s", why);
		}
	}
	rh->plan.disk_bytes_per_s = disk_bps;
	shm_object_set_ready(app.ring); /* the plan's figures are in: attach may see the ring */

	struct loader_params lp = {.m = m,
				   .plan = plan,
				   .ring = shm_object_base(app.ring),
				   .ring_bytes = shm_object_size(app.ring),
				   .io_depth = (uint32_t)io_depth,
				   .max_read = max_read,
				   .buffered = buffered,
				   .inline_issue = !io_async};
	struct loader_ops lops = {.grant = send_grant, .fail = send_fail};
	rc = loader_create(&lp, &lops, &app, &app.loader, err, sizeof(err));
	if (rc) {
		log_error("%s", err);
		goto out_ring;
	}
	char rsize[32];
	log_info("weight ring %s: %s, reads %s (depth %ld, %llu KiB each)", shm_name,
		 format_size(shm_object_size(app.ring), rsize, sizeof(rsize)),
		 loader_o_direct(app.loader) ? "O_DIRECT" : "buffered", io_depth, (unsigned long long)(max_read >> 10));

	struct service_ops sops = {.handle = on_request, .hello = on_hello, .stats = on_stats, .tick = on_tick};
	app.svc = service_create(SERVICE_NAME, run_dir, &sops, &app);
	if (!app.svc)
		goto out_loader;
	rc = service_add_fd(app.svc, loader_eventfd(app.loader), on_io);
	assert(rc == 0);
	register_tunables(&app);
	{
		char num[4][32];
		snprintf(num[0], sizeof(num[0]), "%llu", (unsigned long long)budget);
		snprintf(num[1], sizeof(num[1]), "%llu", (unsigned long long)max_read);
		snprintf(num[2], sizeof(num[2]), "%llu", (unsigned long long)disk_bps);
		service_add_fixed(app.svc, "model", TUNABLE_STRING, model, "the checkpoint (directory or GGUF file)");
		service_add_fixed(app.svc, "tokenizer", TUNABLE_STRING, m->tokenizer_bytes ? m->tokenizer_path : "",
				  "the tokenizer.json handed to the runner");
		service_add_fixed(app.svc, "dram-budget", TUNABLE_BYTES, num[0],
				  "host memory for weight slots: the ring is laid out for it at start");
		service_add_fixed(app.svc, "max-read", TUNABLE_BYTES, num[1], "bytes per read");
		service_add_fixed(app.svc, "buffered", TUNABLE_BOOL, buffered ? "true" : "false",
				  "read through the page cache, never O_DIRECT");
		service_add_fixed(app.svc, "disk-bytes-per-s", TUNABLE_BYTES, num[2],
				  "the disk bandwidth of the plan's prediction (0: not measured)");
		service_add_fixed(app.svc, "io-async", TUNABLE_BOOL, io_async ? "true" : "false",
				  "reads issued from io_uring's worker threads");
		service_add_fixed(app.svc, "instance", TUNABLE_STRING, instance, "the instance name");
		service_add_fixed(app.svc, "run-dir", TUNABLE_STRING, run_dir, "the run directory");
	}
	loader_start(app.loader);
	service_run(app.svc);
	log_info("stopping (%s): removing the weight ring %s",
		 service_stop_reason(app.svc) == SERVICE_STOP_SHUTDOWN ? "shutdown requested" : "signal", shm_name);
	status = 0;

	service_destroy(&app.svc);
out_loader:
	loader_destroy(&app.loader);
out_ring:
	shm_object_close(&app.ring, true);
out_plan:
	plan_destroy(&plan);
out_manifest:
	manifest_destroy(&m);
out:
	return status;
}

/* test_gpu_window.c - the GPU weight window against a real ssd-loader (label gpu; skips
 * without a GPU): with budgets that keep some groups resident and stream the rest, several
 * passes of acquire/release in visit order hand the engine device memory that holds exactly
 * the checkpoint's bytes, the state table stays consistent (strict mode checks it at every
 * call), streamed bytes per pass are what the plan says, and a budget below the minimum is
 * refused naming the size it needs. The DRAM tier streams too in one case, so the window's
 * grants and the loader's slots interlock. With --cpu-share 0.5 the streamed FFNs split: the
 * device holds exactly their first share (gate and up rows [0, r), down's columns [0, r) of every
 * row), a decode step gets the second share in place in the ring, a prefill step gets its copy on
 * the device, and fewer bytes cross per pass. A mixture of experts whose streamed experts are all of
 * one layer: routed steps get the checkpoint's bytes of every chosen expert. */
#include <check.h>
#include <cuda_runtime_api.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "common/bus.h"
#include "common/manifest.h"
#include "common/util.h"
#include "services/gpu-runner/cpu-compute/task_pool.h"
#include "services/gpu-runner/gpu_window.h"
#include "tools/make-synthetic-model/synthetic.h"

struct fixture {
	char dir[256], model[300], run[300], instance[64], log[300];
	pid_t loader;
	void *zctx;
	struct rpc_client *client;
	struct ring_source *ring;
	struct manifest *m;
	cudaStream_t stream;
};

static void start_config(struct fixture *f, const char *dram_budget, const struct model_config *c)
{
	memset(f, 0, sizeof(*f));
	snprintf(f->dir, sizeof(f->dir), "/tmp/llmp-gwt-XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(f->dir));
	snprintf(f->model, sizeof(f->model), "%s/model", f->dir);
	snprintf(f->run, sizeof(f->run), "%s/run", f->dir);
	snprintf(f->log, sizeof(f->log), "%s/loader.log", f->dir);
	/* An instance of its own each time: a case that fails leaves its loader behind (CK_NOFORK), and
	 * the next case must not meet it. */
	static int starts;
	snprintf(f->instance, sizeof(f->instance), "gwt%d-%d", (int)getpid(), starts++);
	struct model_config cfg = *c;
	char err[512];
	struct synth_options o;
	synth_options_default(&o);
	o.seed = 3;
	ck_assert_msg(synth_write(f->model, &cfg, &o, err, sizeof(err)) == 0, "%s", err);
	ck_assert_msg(manifest_load(f->model, &f->m, err, sizeof(err)) == 0, "%s", err);

	const char *bin = getenv("PIPELINE_BIN_DIR");
	ck_assert_msg(bin && *bin, "PIPELINE_BIN_DIR is not set (run through ctest)");
	char path[512];
	snprintf(path, sizeof(path), "%s/ssd-loader", bin);
	fflush(NULL);
	f->loader = fork();
	ck_assert_int_ge(f->loader, 0);
	if (f->loader == 0) {
		int fd = open(f->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
		dup2(fd, 1);
		dup2(fd, 2);
		execl(path, path, "--model", f->model, "--run-dir", f->run, "--instance", f->instance, "--dram-budget",
		      dram_budget, (char *)NULL);
		_exit(127);
	}
	f->zctx = zmq_ctx_new();
	f->client = rpc_client_create(f->zctx, f->run, "ssd-loader", "gpu-runner");
	ck_assert_ptr_nonnull(f->client);
	struct msg hello;
	ck_assert_msg(rpc_wait_ready(f->client, &hello, 20000) == 0, "ssd-loader did not answer (log %s)", f->log);
	int rc = ring_source_create(f->client, &hello.hello_reply, 20000, NULL, NULL, NULL, &f->ring, err, sizeof(err));
	msg_free(&hello);
	ck_assert_msg(rc == 0, "ring: %s", err);
	ck_assert_int_eq(cudaStreamCreate(&f->stream), cudaSuccess);
}

static void start_shape(struct fixture *f, const char *dram_budget, const char *shape, uint32_t layers)
{
	struct model_config cfg;
	char err[512];
	ck_assert_int_eq(synth_shape_config(shape, &cfg, err, sizeof(err)), 0);
	cfg.n_layers = layers;
	start_config(f, dram_budget, &cfg);
}

/* The tiny model with four layers, so there is something to keep and something to stream. */
static void start(struct fixture *f, const char *dram_budget)
{
	start_shape(f, dram_budget, "tiny", 4);
}

static void stop(struct fixture *f)
{
	ring_source_destroy(&f->ring);
	rpc_client_destroy(&f->client);
	zmq_ctx_term(f->zctx);
	kill(f->loader, SIGTERM);
	waitpid(f->loader, NULL, 0);
	cudaStreamDestroy(f->stream);
	manifest_destroy(&f->m);
	char cmd[400];
	snprintf(cmd, sizeof(cmd), "rm -rf %s", f->dir);
	ck_assert_int_eq(system(cmd), 0);
}

/* The bytes of tensor t as the checkpoint file holds them. */
static void *file_bytes(const struct manifest *m, const struct tensor_desc *t)
{
	void *buf = malloc(t->nbytes);
	int fd = open(m->files[t->file_index].path, O_RDONLY);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(pread(fd, buf, t->nbytes, (off_t)t->file_offset), (ssize_t)t->nbytes);
	close(fd);
	return buf;
}

/* One pass in visit order, as the engine makes it; every tensor checked on the device. */
static void pass(struct fixture *f, struct gpu_window *w)
{
	struct weight_source *ws = gpu_window_base(w);
	for (uint32_t g = 0; g < f->m->n_groups; g++) {
		struct group_weights gw;
		ck_assert_msg(ws->ops->acquire(ws, g, &gw) == 0, "acquire %u: %s", g, ws->error);
		const struct group_desc *gd = &f->m->groups[g];
		for (uint32_t i = 0; i < gd->n_tensors; i++) {
			const struct tensor_desc *t = &f->m->tensors[gd->first_tensor + i];
			void *want = file_bytes(f->m, t), *got = malloc(t->nbytes);
			if (g == group_id_embed()) {
				ck_assert_ptr_null(gw.t[t->role].data[PLACE_DEVICE]);
				memcpy(got, gw.t[t->role].data[PLACE_HOST], t->nbytes); /* host memory by contract */
			} else {
				/* Read it the way compute does: on the compute stream, after the wait. */
				ck_assert_ptr_nonnull(gw.t[t->role].data[PLACE_DEVICE]);
				ck_assert_int_eq(cudaMemcpyAsync(got, gw.t[t->role].data[PLACE_DEVICE], t->nbytes,
								 cudaMemcpyDeviceToHost,
								 f->stream),
						 cudaSuccess);
				ck_assert_int_eq(cudaStreamSynchronize(f->stream), cudaSuccess);
			}
			ck_assert_msg(memcmp(got, want, t->nbytes) == 0, "group %u tensor %s differs on the device", g,
				      t->name);
			free(want);
			free(got);
		}
		ck_assert_msg(ws->ops->release(ws, g) == 0, "release %u: %s", g, ws->error);
		char why[256];
		ck_assert_msg(gpu_window_check(w, why, sizeof(why)) == 0, "%s", why);
	}
}

/* rows x width bytes at src (pitch apart) in device memory, against want (pitch apart too). */
static void expect_rows(const void *dev, uint64_t dev_pitch, const char *want, uint64_t want_pitch, uint64_t width,
			uint32_t rows, cudaStream_t s, const char *what, uint32_t g)
{
	if (!rows || !width)
		return;
	char *got = malloc(width * rows);
	ck_assert_ptr_nonnull(got);
	ck_assert_int_eq(cudaMemcpy2DAsync(got, width, dev, dev_pitch, width, rows, cudaMemcpyDeviceToHost, s),
			 cudaSuccess);
	ck_assert_int_eq(cudaStreamSynchronize(s), cudaSuccess);
	for (uint32_t r = 0; r < rows; r++)
		ck_assert_msg(memcmp(got + r * width, want + r * want_pitch, width) == 0, "group %u: %s, row %u differs", g,
			      what, r);
	free(got);
}

/* One pass of `tokens`-token steps over a window whose streamed FFNs split: the shares hold the
 * checkpoint's rows where the split says, on the device or in host memory. */
static void pass_split(struct fixture *f, struct gpu_window *w, uint32_t tokens, uint32_t *split_seen)
{
	struct weight_source *ws = gpu_window_base(w);
	const uint32_t ffn = f->m->cfg.ffn_dim;
	ws->step_tokens = tokens;
	for (uint32_t g = 0; g < f->m->n_groups; g++) {
		struct group_weights gw;
		ck_assert_msg(ws->ops->acquire(ws, g, &gw) == 0, "acquire %u: %s", g, ws->error);
		uint32_t r = gpu_window_split_r(w, g);
		if (f->m->groups[g].kind != GROUP_FFN || r >= ffn) {
			ck_assert_uint_eq(gw.split.where, FFN_SPLIT_NONE);
			ck_assert_int_eq(ws->ops->release(ws, g), 0);
			continue;
		}
		(*split_seen)++;
		ck_assert_uint_eq(gw.split.r, r);
		ck_assert_uint_eq(gw.split.where, tokens == 1 ? FFN_SPLIT_CPU : FFN_SPLIT_BACKEND);
		enum weight_place rest = tokens == 1 ? PLACE_HOST : PLACE_DEVICE;
		static const enum tensor_role mats[3] = {ROLE_W_GATE, ROLE_W_UP, ROLE_W_DOWN};
		const struct weight_tensor *second[3] = {&gw.split.gate, &gw.split.up, &gw.split.down};
		for (int i = 0; i < 3; i++) {
			int ti = model_find_tensor(&f->m->cfg, f->m->tensors, f->m->groups, g, mats[i]);
			ck_assert_int_ge(ti, 0);
			const struct tensor_desc *t = &f->m->tensors[ti];
			enum dtype fmt = (enum dtype)t->dtype;
			char *want = file_bytes(f->m, t);
			uint64_t full = dtype_row_bytes(fmt, t->shape[1]);
			const struct weight_tensor *a = &gw.t[mats[i]], *b = second[i];
			if (mats[i] == ROLE_W_DOWN) {
				ck_assert_uint_eq(a->cols, r);
				ck_assert_uint_eq(b->col0, r);
				ck_assert_uint_eq(b->cols, ffn - r);
				expect_rows(a->data[PLACE_DEVICE], a->row_bytes, want, full, dtype_row_bytes(fmt, r),
					    (uint32_t)t->shape[0], f->stream, "down's first share", g);
				const char *wb = want + dtype_row_bytes(fmt, r);
				if (rest == PLACE_HOST)
					for (uint32_t row = 0; row < t->shape[0]; row++)
						ck_assert(memcmp((const char *)b->data[PLACE_HOST] + row * b->row_bytes,
								 wb + row * full, dtype_row_bytes(fmt, ffn - r)) == 0);
				else
					expect_rows(b->data[PLACE_DEVICE], b->row_bytes, wb, full,
						    dtype_row_bytes(fmt, ffn - r), (uint32_t)t->shape[0], f->stream,
						    "down's second share", g);
			} else {
				ck_assert_uint_eq(a->rows, r);
				ck_assert_uint_eq(b->row0, r);
				ck_assert_uint_eq(b->rows, ffn - r);
				expect_rows(a->data[PLACE_DEVICE], full, want, full, full, r, f->stream, "first share", g);
				if (rest == PLACE_HOST)
					ck_assert(memcmp(b->data[PLACE_HOST], want + r * full, (ffn - r) * full) == 0);
				else
					expect_rows(b->data[PLACE_DEVICE], full, want + r * full, full, full, ffn - r,
						    f->stream, "second share", g);
			}
			free(want);
		}
		ck_assert_msg(ws->ops->release(ws, g) == 0, "release %u: %s", g, ws->error);
		char why[256];
		ck_assert_msg(gpu_window_check(w, why, sizeof(why)) == 0, "%s", why);
	}
}

static int have_gpu(void)
{
	int n = 0;
	return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

static void run_case_as(const char *dram_budget, uint64_t gpu_budget, uint32_t depth, bool expect_streaming,
			bool spread)
{
	struct fixture f;
	start(&f, dram_budget);
	struct gpu_window_params p = {.gpu_budget = gpu_budget, .depth = depth, .strict = true, .time_copies = true,
				      .h2d_bytes_per_s = 0, .spread = spread};
	struct gpu_window *w = NULL;
	char err[512];
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	struct gpu_window_stats st;
	gpu_window_stats(w, &st);
	ck_assert_int_eq(st.streamed_groups > 0, expect_streaming);
	ck_assert(st.h2d_bytes_per_s > 0);
	ck_assert_int_eq(st.spread, spread);
	const uint32_t L = f.m->cfg.n_layers;
	if (spread) { /* each kind's k kept groups where (l + 1) k / L passes a whole number: not the first */
		for (int kind = 0; kind < 2; kind++) {
			bool kept[64] = {false};
			uint32_t k = 0;
			for (uint32_t l = 0; l < L && l < 64; l++) {
				gpu_window_group_state(w, kind ? group_id_ffn(l) : group_id_attn(l), &kept[l]);
				k += kept[l];
			}
			for (uint32_t l = 0; l < L && l < 64; l++)
				ck_assert_msg(kept[l] == ((l + 1) * k / L > l * k / L), "spread: %s of layer %u %s (%u of %u kept)",
					      kind ? "the FFN" : "the attention", l, kept[l] ? "kept" : "streamed", k, L);
		}
	}
	uint64_t before = st.bytes_h2d;
	for (int i = 0; i < 4; i++)
		pass(&f, w);
	gpu_window_stats(w, &st);
	if (expect_streaming) {
		/* Every streamed group crossed once per pass (the first depth copies of pass 0 were
		 * issued at create, the next pass's first ones already during the last). */
		uint64_t moved = st.bytes_h2d - before, per = st.streamed_bytes_per_token;
		ck_assert_msg(moved >= 3 * per && moved <= 5 * per, "moved %llu for %llu per pass",
			      (unsigned long long)moved, (unsigned long long)per);
		/* Every copy timed, none dropped: once they are done each one's time is in copy_ms (the
		 * host stand-in's events say done at their second query, hence two looks). */
		ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
		gpu_window_stats(w, &st);
		gpu_window_stats(w, &st);
		ck_assert_msg(st.timed_copies == st.copies && st.timed_copies > 0,
			      "%llu of %llu copies timed", (unsigned long long)st.timed_copies,
			      (unsigned long long)st.copies);
		ck_assert(st.copy_ms > 0);
		/* Every wait of the compute stream for a copy timed too, when there are more of them
		 * in flight than the ring of their timing pairs holds (it held 64: the ones past that
		 * were dropped, and an MoE step's waits read as none). */
		const uint64_t w0 = st.waits;
		pass(&f, w);
		gpu_window_stats(w, &st);
		const uint64_t per_pass = st.waits - w0; /* a pass's waits; no stats call below collects them */
		ck_assert(per_pass > 0);
		for (uint64_t i = 0; i <= 300 / per_pass; i++)
			pass(&f, w);
		ck_assert_int_eq(cudaDeviceSynchronize(), cudaSuccess);
		gpu_window_stats(w, &st);
		gpu_window_stats(w, &st);
		ck_assert_msg(st.timed_waits == st.waits, "%llu of %llu waits timed",
			      (unsigned long long)st.timed_waits, (unsigned long long)st.waits);
	}
	struct weight_source *ws = gpu_window_base(w);
	ck_assert_int_eq(ws->ops->release_all(ws), 0);
	/* Out of visit order is refused, not silently served: the last FFN group streams in both
	 * streaming cases and is never the next one due after whole passes. */
	/* The last streamed group of a class with two or more streamed: not the one due next. */
	uint32_t g = UINT32_MAX;
	for (int kind = 0; kind < 2 && g == UINT32_MAX; kind++) {
		uint32_t streamed = 0, last = 0;
		for (uint32_t l = 0; l < L; l++) {
			bool kept = true;
			const uint32_t x = kind ? group_id_attn(l) : group_id_ffn(l);
			gpu_window_group_state(w, x, &kept);
			if (!kept) {
				streamed++;
				last = x;
			}
		}
		if (streamed >= 2)
			g = last;
	}
	if (expect_streaming) {
		ck_assert_uint_ne(g, UINT32_MAX);
		struct group_weights gw;
		ck_assert_int_eq(ws->ops->acquire(ws, g, &gw), -EPROTO);
	}
	gpu_window_destroy(&w);
	stop(&f);
}

static void run_case(const char *dram_budget, uint64_t gpu_budget, uint32_t depth, bool expect_streaming)
{
	run_case_as(dram_budget, gpu_budget, depth, expect_streaming, false);
}

START_TEST(test_all_resident)
{
	run_case("1GiB", 1ull << 30, 2, false);
}
END_TEST

START_TEST(test_streaming_depth_2)
{
	/* The head, one resident FFN group maybe, and two slots per streamed class. */
	struct fixture f;
	start(&f, "1GiB");
	uint64_t head = f.m->groups[group_id_head(&f.m->cfg)].slot_bytes;
	uint64_t a = f.m->class_bytes[CLASS_ATTN], ff = f.m->class_bytes[CLASS_FFN];
	stop(&f);
	run_case("1GiB", head + 2 * (a + ff) + ff, 2, true);
}
END_TEST

/* A step that fails part way (a group acquired and never released, the visit stopped in the middle)
 * is settled by the source's reset before the next: the next steps hand out every group's bytes
 * again and the state table holds. Without it the next step's first streamed group is out of
 * visit order. */
START_TEST(test_failed_step_reset)
{
	struct fixture f;
	start(&f, "1GiB");
	uint64_t head = f.m->groups[group_id_head(&f.m->cfg)].slot_bytes;
	uint64_t a = f.m->class_bytes[CLASS_ATTN], ff = f.m->class_bytes[CLASS_FFN];
	struct gpu_window_params p = {.gpu_budget = head + 2 * (a + ff), .depth = 2, .strict = true};
	struct gpu_window *w = NULL;
	char err[512];
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	struct gpu_window_stats st;
	gpu_window_stats(w, &st);
	ck_assert_uint_gt(st.streamed_groups, 2);
	struct weight_source *ws = gpu_window_base(w);
	pass(&f, w);
	for (uint32_t stop_at = 2; stop_at < f.m->n_groups; stop_at += 3) {
		/* A step that fails at group stop_at: acquired, never released. */
		for (uint32_t g = 0; g <= stop_at; g++) {
			struct group_weights gw;
			ck_assert_msg(ws->ops->acquire(ws, g, &gw) == 0, "acquire %u: %s", g, ws->error);
			if (g < stop_at)
				ck_assert_int_eq(ws->ops->release(ws, g), 0);
		}
		ck_assert_msg(ws->ops->reset(ws) == 0, "reset: %s", ws->error);
		ck_assert_msg(gpu_window_check(w, err, sizeof(err)) == 0, "%s", err);
		pass(&f, w);
		pass(&f, w);
	}
	gpu_window_stats(w, &st);
	ck_assert_uint_gt(st.step_resets, 1);
	gpu_window_destroy(&w);
	stop(&f);
}
END_TEST

/* A window made anew (the hot experts' or the CPU share's re-plan) takes the ring's mapping over
 * pinned from the window before (gpu_window_destroy_keeping_pins) instead of pinning it again,
 * and hands out the same bytes; a window made after a plain destroy pins it itself. */
START_TEST(test_pins_kept)
{
	struct fixture f;
	start(&f, "1GiB");
	uint64_t head = f.m->groups[group_id_head(&f.m->cfg)].slot_bytes;
	uint64_t a = f.m->class_bytes[CLASS_ATTN], ff = f.m->class_bytes[CLASS_FFN];
	struct gpu_window_params p = {.gpu_budget = head + 2 * (a + ff), .depth = 2, .strict = true};
	struct gpu_window *w = NULL;
	char err[512];
	struct gpu_window_stats st;
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	gpu_window_stats(w, &st);
	ck_assert_uint_eq(st.pins_kept, 0);
	pass(&f, w);
	for (int i = 0; i < 2; i++) {
		gpu_window_destroy_keeping_pins(&w);
		ck_assert_ptr_null(w);
		ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
		gpu_window_stats(w, &st);
		ck_assert_uint_eq(st.pins_kept, 1);
		pass(&f, w);
	}
	gpu_window_destroy(&w);
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	gpu_window_stats(w, &st);
	ck_assert_uint_eq(st.pins_kept, 0);
	pass(&f, w);
	gpu_window_destroy(&w);
	stop(&f);
}
END_TEST

/* Groups whose tensors are large beside the gaps the loader's 4 KiB extents leave between them go
 * to the device in one copy, laid out as in their host slot (gw_layout): every tensor's bytes still
 * arrive where the engine is told they are (pass), and no tensor lies less than 16-byte aligned. */
START_TEST(test_one_copy_groups)
{
	struct model_config c;
	char err[512];
	ck_assert_int_eq(synth_shape_config("tiny", &c, err, sizeof(err)), 0);
	c.dim = 512;
	c.n_heads = 8;
	c.n_kv_heads = 4;
	c.head_dim = 64;
	c.ffn_dim = 1536;
	c.n_layers = 4;
	struct fixture f;
	start_config(&f, "1GiB", &c);
	uint64_t head = f.m->groups[group_id_head(&f.m->cfg)].slot_bytes;
	uint64_t a = f.m->class_bytes[CLASS_ATTN], ff = f.m->class_bytes[CLASS_FFN];
	struct gpu_window_params p = {.gpu_budget = head + 2 * (a + ff) + ff, .depth = 2, .strict = true};
	struct gpu_window *w = NULL;
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	struct gpu_window_stats st;
	gpu_window_stats(w, &st);
	ck_assert_uint_gt(st.streamed_groups, 0);
	ck_assert_uint_ge(st.one_copy_groups, 2 * c.n_layers); /* every layer's attention and FFN */
	struct weight_source *ws = gpu_window_base(w);
	for (int i = 0; i < 3; i++)
		pass(&f, w);
	for (uint32_t g = 0; g < f.m->n_groups; g++) {
		if (g == group_id_embed())
			continue;
		struct group_weights gw;
		ck_assert_msg(ws->ops->acquire(ws, g, &gw) == 0, "acquire %u: %s", g, ws->error);
		for (uint32_t r = 0; r < ROLE_COUNT; r++)
			if (gw.t[r].data[PLACE_DEVICE])
				ck_assert_msg((uintptr_t)gw.t[r].data[PLACE_DEVICE] % 16 == 0, "group %u role %u at %p", g, r,
					      gw.t[r].data[PLACE_DEVICE]);
		ck_assert_int_eq(ws->ops->release(ws, g), 0);
	}
	ck_assert_int_eq(ws->ops->release_all(ws), 0);
	gpu_window_destroy(&w);
	stop(&f);
}
END_TEST

/* --window-spread: the kept layer groups among the layers, not the first ones; every pass still
 * moves each streamed group once and the state table holds (strict). */
START_TEST(test_streaming_spread)
{
	struct fixture f;
	start(&f, "1GiB");
	uint64_t head = f.m->groups[group_id_head(&f.m->cfg)].slot_bytes;
	uint64_t a = f.m->class_bytes[CLASS_ATTN], ff = f.m->class_bytes[CLASS_FFN];
	const uint32_t L = f.m->cfg.n_layers;
	stop(&f);
	/* Room for every attention group and one FFN group beside two FFN slots, or the like: some of a
	 * kind kept and some streamed (st.spread says that kept groups moved). */
	run_case_as("1GiB", head + L * a + 3 * ff, 2, true, true);
}
END_TEST

static struct task_pool *two_workers(void);
static void auto_share_known(struct gpu_window_params *p, double cpu, double beside, double h2d);

/* The attention and FFN groups a window keeps (in *ka, *kf); spread as asked; with pool, the
 * streamed FFNs split with the CPU at --cpu-share 0.5 (else none splits, and run makes two passes
 * over it). Returns st.spread. */
static bool kept_counts(struct fixture *f, uint64_t budget, bool spread, bool attn_kept, struct task_pool *pool,
			uint32_t *ka, uint32_t *kf, bool run)
{
	struct gpu_window_params p = {.gpu_budget = budget, .depth = 2, .strict = true, .spread = spread,
				      .spread_attn_kept = attn_kept, .cpu_pool = pool};
	char msg[512];
	if (pool)
		ck_assert_msg(cpu_share_parse("0.5", &p.cpu_share, msg, sizeof(msg)) == 0, "%s", msg);
	struct gpu_window *w = NULL;
	char err[512];
	ck_assert_msg(gpu_window_create(f->ring, f->stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	struct gpu_window_stats st;
	gpu_window_stats(w, &st);
	ck_assert_msg(!pool || st.split_groups > 0, "budget %llu: no FFN split", (unsigned long long)budget);
	*ka = *kf = 0;
	for (uint32_t l = 0; l < f->m->cfg.n_layers; l++) {
		bool k = false;
		gpu_window_group_state(w, group_id_attn(l), &k);
		*ka += k;
		gpu_window_group_state(w, group_id_ffn(l), &k);
		*kf += k;
	}
	for (int i = 0; run && !pool && i < 2; i++) /* pass() compares whole groups: not a split one's */
		pass(f, w);
	gpu_window_destroy(&w);
	return st.spread;
}

/* The first budget (from the smallest up, in quarters of an FFN group) at which the plan, the first
 * layers kept, keeps every attention group and some FFN groups, fewer than below_ffn. */
static uint64_t budget_every_attn(struct fixture *f, uint32_t below_ffn)
{
	uint64_t head = f->m->groups[group_id_head(&f->m->cfg)].slot_bytes;
	uint64_t a = f->m->class_bytes[CLASS_ATTN], ff = f->m->class_bytes[CLASS_FFN];
	const uint32_t L = f->m->cfg.n_layers;
	uint32_t ka, kf;
	for (uint64_t b = head + L * a + 2 * ff; b <= head + L * (a + ff); b += ff / 4) {
		kept_counts(f, b, false, false, NULL, &ka, &kf, false);
		if (ka == L && kf > 0 && kf < below_ffn)
			return b;
	}
	ck_abort_msg("no budget keeps every attention group and streams FFNs");
	return 0;
}

/* --window-spread auto (spread_attn_kept): spread where FFNs split and the plan keeps every attention
 * group, the first layers kept where attention streams or nothing splits; yes spreads either way.
 * Passes still hold (strict). */
START_TEST(test_streaming_spread_auto)
{
	struct fixture f;
	start(&f, "1GiB");
	uint64_t head = f.m->groups[group_id_head(&f.m->cfg)].slot_bytes;
	uint64_t a = f.m->class_bytes[CLASS_ATTN], ff = f.m->class_bytes[CLASS_FFN];
	const uint32_t L = f.m->cfg.n_layers;
	struct task_pool *pool = two_workers();
	uint32_t ka, kf;
	/* A budget at which the plan keeps every attention group and some, not all, FFN groups. */
	const uint64_t every_attn = budget_every_attn(&f, L);
	ck_assert(kept_counts(&f, every_attn, true, true, pool, &ka, &kf, true));
	ck_assert_uint_eq(ka, L);
	/* Nothing splits (no CPU share): auto keeps the first layers, yes spreads. */
	ck_assert(!kept_counts(&f, every_attn, true, true, NULL, &ka, &kf, true));
	ck_assert(kept_counts(&f, every_attn, true, false, NULL, &ka, &kf, true));
	/* A budget at which attention streams and yes moves kept groups: auto keeps the first layers. */
	uint64_t attn_streams = 0;
	for (uint64_t b = head + 2 * (a + ff); b < head + L * a + 2 * ff && !attn_streams; b += a / 4)
		if (kept_counts(&f, b, true, false, NULL, &ka, &kf, false) && ka < L)
			attn_streams = b;
	ck_assert_msg(attn_streams, "no budget streams attention with kept groups to move");
	ck_assert(!kept_counts(&f, attn_streams, true, true, pool, &ka, &kf, true));
	ck_assert_uint_lt(ka, L);
	ck_assert(kept_counts(&f, attn_streams, true, false, pool, &ka, &kf, true));
	task_pool_destroy(&pool);
	stop(&f);
}
END_TEST

/* --split-gaps with the kept layers spread: each split layer's balance takes the GPU's reads of the
 * layers kept between it and the split layer before off the CPU's side, so the CPU takes less; the
 * first layers kept, no layer's gap is counted (the plan's token estimate still adds the GPU's reads
 * to the CPU's chain). */
static struct gpu_window_stats gaps_case(struct fixture *f, uint64_t budget, struct task_pool *pool, bool spread,
					 bool gaps, double hbm)
{
	struct gpu_window_params p = {.gpu_budget = budget, .depth = 2, .strict = true, .cpu_pool = pool,
				      .spread = spread, .split_gaps = gaps, .hbm_bytes_per_s = hbm};
	auto_share_known(&p, 2e7, 2e7, 2e7);
	p.cpu_share.per_layer = true;
	char err[512];
	struct gpu_window *w = NULL;
	ck_assert_msg(gpu_window_create(f->ring, f->stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	struct gpu_window_stats st;
	gpu_window_stats(w, &st);
	ck_assert(st.spread == spread || !st.split_groups);
	gpu_window_destroy(&w);
	return st;
}

START_TEST(test_split_gaps)
{
	struct fixture f;
	start(&f, "1GiB");
	const uint32_t L = f.m->cfg.n_layers;
	struct task_pool *pool = two_workers();
	/* every attention group kept, some FFN groups kept, two or more streamed */
	const uint64_t budget = budget_every_attn(&f, L - 1);
	struct gpu_window_stats off = gaps_case(&f, budget, pool, true, false, 1e9);
	ck_assert_uint_gt(off.split_groups, 0);
	ck_assert(off.split_gaps_ms == 0);
	/* The slower the GPU's reads, the longer the gaps: never more on the CPU, and less at some rate
	 * (a share rounds to thirds of the tiny FFN's rows). */
	uint32_t fewer = 0;
	for (double hbm = 1e9; hbm > 1e7; hbm /= 2) {
		struct gpu_window_stats on = gaps_case(&f, budget, pool, true, true, hbm);
		ck_assert_msg(!on.split_groups || on.split_gaps_ms > 0, "spread, --split-gaps: no gap counted");
		ck_assert_msg(on.cpu_bytes_per_token <= off.cpu_bytes_per_token,
			      "the CPU reads %llu with the gaps, %llu without", (unsigned long long)on.cpu_bytes_per_token,
			      (unsigned long long)off.cpu_bytes_per_token);
		fewer += on.cpu_bytes_per_token < off.cpu_bytes_per_token;
	}
	ck_assert_msg(fewer > 0, "the gaps never gave the CPU less");
	/* the first layers kept: the split layers are the last ones, with no kept layer between them */
	struct gpu_window_stats first = gaps_case(&f, budget, pool, false, true, 1e8);
	ck_assert(first.split_gaps_ms == 0);
	task_pool_destroy(&pool);
	stop(&f);
}
END_TEST

START_TEST(test_streaming_depth_1_dram_streams)
{
	/* The DRAM tier streams as well: the window's grants must leave the loader room. */
	struct fixture f;
	start(&f, "1GiB");
	uint64_t head = f.m->groups[group_id_head(&f.m->cfg)].slot_bytes;
	uint64_t a = f.m->class_bytes[CLASS_ATTN], ff = f.m->class_bytes[CLASS_FFN];
	uint64_t globals = f.m->class_bytes[CLASS_GLOBAL] * 2;
	stop(&f);
	char dram[64];
	snprintf(dram, sizeof(dram), "%llu", (unsigned long long)(globals + 2 * (a + ff)));
	run_case(dram, head + a + ff, 1, true);
}
END_TEST

/* The CPU share's pool of the split cases: two unpinned workers. */
static struct task_pool *two_workers(void)
{
	char err[512];
	struct task_pool *pool = NULL;
	struct task_pool_config pc;
	task_pool_config_default(&pc);
	pc.threads = 2;
	pc.pin = false;
	ck_assert_msg(task_pool_create(&pc, &pool, err, sizeof(err)) == 0, "%s", err);
	return pool;
}

/* --cpu-share auto with the rates a re-plan hands over (nothing measured at the window's start): the
 * CPU's product rate cpu for every format, and where given, H2D beside the CPU and H2D alone. */
static void auto_share_known(struct gpu_window_params *p, double cpu, double beside, double h2d)
{
	char err[512];
	ck_assert_msg(cpu_share_parse("auto", &p->cpu_share, err, sizeof(err)) == 0, "%s", err);
	for (uint32_t d = 0; d < DT_COUNT; d++)
		p->cpu_share.cpu_bytes_per_s[d] = cpu;
	p->cpu_share.rates_known = true;
	if (beside > 0)
		p->cpu_share.h2d_beside_bytes_per_s = beside;
	if (h2d > 0)
		p->h2d_bytes_per_s = h2d;
}

/* A budget that keeps one FFN group on the device and streams the rest, with --cpu-share 0.5: the
 * streamed FFNs that stay in DRAM split. dram: the loader's budget. */
static void split_case(const char *dram, bool dram_streams)
{
	struct fixture f;
	start(&f, dram);
	ck_assert(ring_source_all_resident(f.ring) == !dram_streams);
	uint64_t head = f.m->groups[group_id_head(&f.m->cfg)].slot_bytes;
	uint64_t a = f.m->class_bytes[CLASS_ATTN], ff = f.m->class_bytes[CLASS_FFN];
	char err[512];
	struct task_pool *pool = two_workers();
	struct gpu_window_params p = {.gpu_budget = head + 2 * (a + ff) + ff, .depth = 2, .strict = true,
				      .cpu_pool = pool};
	ck_assert_int_eq(cpu_share_parse("0.5", &p.cpu_share, err, sizeof(err)), 0);
	struct gpu_window *w = NULL, *whole = NULL;
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	struct gpu_window_stats st, st0;
	gpu_window_stats(w, &st);
	ck_assert_uint_gt(st.split_groups, 0);
	ck_assert_uint_lt(st.split_r_max, f.m->cfg.ffn_dim);
	ck_assert_uint_gt(st.cpu_bytes_per_token, 0);
	ck_assert_uint_gt(st.side_bytes, 0);
	char line[1024];
	gpu_window_describe(w, line, sizeof(line));
	ck_assert_msg(strstr(line, "split with the CPU"), "%s", line);
	uint32_t seen = 0;
	for (int i = 0; i < 3; i++) {
		pass_split(&f, w, 1, &seen);	/* decode */
		/* prefill: the CPU rows copied up */
		pass_split(&f, w, FFN_SPLIT_MAX_TOKENS + 1, &seen);
		pass_split(&f, w, FFN_SPLIT_MAX_TOKENS + 1, &seen);
	}
	ck_assert_uint_eq(seen, 9 * st.split_groups);
	gpu_window_stats(w, &st);
	ck_assert_uint_gt(st.side_copies, 0);
	ck_assert_uint_gt(st.cpu_shares, 0);
	struct weight_source *ws = gpu_window_base(w);
	ck_assert_int_eq(ws->ops->release_all(ws), 0);
	gpu_window_destroy(&w);
	/* Within the budget, the prefill buffer included. */
	ck_assert_uint_le(st.resident_bytes + st.window_bytes + st.side_bytes, p.gpu_budget);
	/* The same budget unsplit: more crosses per token, and the slots are larger; the memory the
	 * split's slots free keeps a group more (gw_split_refill: half an FFN group is left beside the
	 * halved FFN slots and their prefill buffer), so less moves per token than the split alone
	 * would leave. */
	p.cpu_share.mode = CPU_SHARE_OFF;
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &whole, err, sizeof(err)) == 0, "%s", err);
	gpu_window_stats(whole, &st0);
	ck_assert_uint_eq(st0.split_groups, 0);
	ck_assert_uint_eq(st0.streamed_groups, st.streamed_groups + 1);
	ck_assert_uint_eq(st.resident_groups, st0.resident_groups + 1);
	ck_assert_uint_gt(st0.streamed_bytes_per_token, st.streamed_bytes_per_token + st.cpu_bytes_per_token);
	ck_assert_uint_gt(st0.window_bytes, st.window_bytes);
	gpu_window_destroy(&whole);
	/* Auto with the rates of jobs that ran (the runner's re-plan): the plan takes them as they are,
	 * measures nothing, and a faster CPU gets more of every FFN. */
	uint64_t cpu_bytes[2];
	for (int i = 0; i < 2; i++) {
		const double rate = i ? 4e7 : 1e7;
		auto_share_known(&p, rate, 3e7, 4e7);
		ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &whole, err, sizeof(err)) == 0, "%s", err);
		gpu_window_stats(whole, &st0);
		ck_assert(st0.rates_from_jobs);
		ck_assert(st0.h2d_beside_cpu_bytes_per_s == 3e7);
		ck_assert(gpu_window_cpu_rate(whole, (enum dtype)f.m->tensors[0].dtype) == rate);
		ck_assert_uint_gt(st0.split_groups, 0);
		/* the copies planned at the rate beside the CPU */
		const double at_beside = (double)st0.streamed_bytes_per_token / 3e7 * 1e3;
		ck_assert_msg(fabs(st0.pcie_ms - at_beside) < 0.05 * at_beside, "%f ms, at 3e7 B/s %f", st0.pcie_ms, at_beside);
		cpu_bytes[i] = st0.cpu_bytes_per_token;
		gpu_window_destroy(&whole);
	}
	ck_assert_uint_gt(cpu_bytes[1], cpu_bytes[0]);
	p.h2d_bytes_per_s = 0;
	task_pool_destroy(&pool);
	stop(&f);
}

START_TEST(test_split_ffn)
{
	split_case("1GiB", false); /* every group stays in DRAM: every streamed FFN may split */
}
END_TEST

/* The split's freed memory kept by more groups (gw_split_refill) never takes the window past its
 * budget: resident groups, slots and the prefill buffer within --gpu-budget over a sweep of budgets,
 * with the kept groups first or spread among the layers. */
START_TEST(test_split_refill_budget)
{
	struct fixture f;
	start(&f, "1GiB");
	uint64_t head = f.m->groups[group_id_head(&f.m->cfg)].slot_bytes;
	uint64_t a = f.m->class_bytes[CLASS_ATTN], ff = f.m->class_bytes[CLASS_FFN];
	char err[512];
	struct task_pool *pool = two_workers();
	uint32_t refilled = 0, auto_ways[2] = {0, 0};
	for (uint64_t budget = head + 2 * (a + ff); budget < head + 2 * (a + ff) + 4 * ff; budget += ff / 3) {
		for (int spread = 0; spread < 3; spread++) { /* first layers, yes, auto (every attention kept) */
			struct gpu_window_params p = {.gpu_budget = budget, .depth = 2, .strict = true, .cpu_pool = pool,
						      .spread = spread > 0, .spread_attn_kept = spread == 2,
						      .h2d_bytes_per_s = 4e7};
			ck_assert_int_eq(cpu_share_parse("0.5", &p.cpu_share, err, sizeof(err)), 0);
			struct gpu_window *w = NULL, *whole = NULL;
			ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
			struct gpu_window_stats st, st0;
			gpu_window_stats(w, &st);
			ck_assert_msg(st.resident_bytes + st.window_bytes + st.side_bytes <= budget,
				      "budget %llu: %llu resident + %llu slots + %llu prefill buffer",
				      (unsigned long long)budget, (unsigned long long)st.resident_bytes,
				      (unsigned long long)st.window_bytes, (unsigned long long)st.side_bytes);
			p.cpu_share.mode = CPU_SHARE_OFF;
			ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &whole, err, sizeof(err)) == 0, "%s", err);
			gpu_window_stats(whole, &st0);
			ck_assert_uint_ge(st.resident_bytes, st0.resident_bytes); /* never fewer kept */
			ck_assert_uint_eq(st.refill_bytes, st.resident_bytes - st0.resident_bytes);
			refilled += st.resident_bytes > st0.resident_bytes;
			if (spread == 2) { /* auto spread only a plan, first or refilled, that keeps every attention group */
				uint32_t ka = 0;
				for (uint32_t l = 0; l < f.m->cfg.n_layers; l++) {
					bool k = false;
					gpu_window_group_state(w, group_id_attn(l), &k);
					ka += k;
				}
				ck_assert_msg(!st.spread || ka == f.m->cfg.n_layers, "budget %llu: spread with %u attention kept",
					      (unsigned long long)budget, ka);
				auto_ways[st.spread]++;
			}
			gpu_window_destroy(&whole);
			gpu_window_destroy(&w);
			if (spread)
				continue;
			/* --fixed-residency: the split keeps what the plan with whole sizes kept. */
			p.cpu_share.mode = CPU_SHARE_FIXED;
			p.fixed_residency = true;
			ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
			gpu_window_stats(w, &st);
			ck_assert_uint_eq(st.resident_bytes, st0.resident_bytes); /* (the split may not fit then) */
			ck_assert_uint_eq(st.refill_bytes, 0);
			gpu_window_destroy(&w);
		}
	}
	ck_assert_uint_gt(refilled, 0);
	ck_assert_msg(auto_ways[0] && auto_ways[1], "auto: %u plans spread, %u not", auto_ways[1], auto_ways[0]);
	task_pool_destroy(&pool);
	stop(&f);
}
END_TEST

/* Each layer's own share (auto, --cpu-share-balance layer) gives a layer whose attention streams a
 * larger CPU share: the slots then hold the largest GPU share and the prefill buffer the largest CPU
 * share. Where that passes the budget the window takes one share for every FFN (gw_split_fit), so
 * over a sweep of budgets the split stays within each and splits wherever one share would. */
START_TEST(test_split_fit_budget)
{
	/* Attention as large as the FFN (so a layer whose attention streams gives the CPU far more of
	 * its FFN), 16 units of FFN rows to choose among. */
	struct model_config c;
	char err[512];
	ck_assert_int_eq(synth_shape_config("tiny", &c, err, sizeof(err)), 0);
	c.n_layers = 6;
	c.dim = 512;
	c.n_heads = c.n_kv_heads = 16;
	c.head_dim = 64;
	c.ffn_dim = 512;
	struct fixture f;
	start_config(&f, "1GiB", &c);
	uint64_t head = f.m->groups[group_id_head(&f.m->cfg)].slot_bytes;
	uint64_t a = f.m->class_bytes[CLASS_ATTN], ff = f.m->class_bytes[CLASS_FFN];
	struct task_pool *pool = two_workers();
	uint32_t fell_back = 0, cases = 0;
	for (uint64_t budget = head + 2 * (a + ff); budget < head + 6 * (a + ff); budget += ff / 11) {
		struct gpu_window_stats st[2];
		for (int layer = 0; layer < 2; layer++) {
			struct gpu_window_params p = {.gpu_budget = budget, .depth = 2, .strict = true, .cpu_pool = pool,
						      .h2d_bytes_per_s = 4e7};
			auto_share_known(&p, 1e7, 0, 0);
			p.cpu_share.per_layer = layer;
			struct gpu_window *w = NULL;
			ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
			gpu_window_stats(w, &st[layer]);
			gpu_window_destroy(&w);
			ck_assert_msg(st[layer].resident_bytes + st[layer].window_bytes + st[layer].side_bytes <= budget,
				      "budget %llu, balance %s: %llu resident + %llu slots + %llu prefill buffer",
				      (unsigned long long)budget, layer ? "layer" : "token",
				      (unsigned long long)st[layer].resident_bytes, (unsigned long long)st[layer].window_bytes,
				      (unsigned long long)st[layer].side_bytes);
		}
		ck_assert(!st[0].split_balance_token); /* one share already */
		cases += st[0].split_groups > 0;
		fell_back += st[1].split_balance_token;
		if (st[0].split_groups)
			ck_assert_msg(st[1].split_groups > 0, "budget %llu: one share splits %llu FFNs, each layer's none",
				      (unsigned long long)budget, (unsigned long long)st[0].split_groups);
	}
	ck_assert_uint_gt(cases, 0);
	ck_assert_uint_gt(fell_back, 0); /* the sweep meets budgets where each layer's share does not fit */
	printf("split fit: %u budgets split, %u with one share for every FFN instead of each layer's\n", cases,
	       fell_back);
	task_pool_destroy(&pool);
	stop(&f);
}
END_TEST

START_TEST(test_split_ffn_dram_streams)
{
	/* The loader pins every FFN group and streams the attention groups through 3 slots (a budget of
	 * 3 attention and 4 FFN slots, below the whole model): the CPU's share reads the pinned FFN groups
	 * in place (the ring source holds them for good: acquire_keep). */
	struct fixture f;
	start(&f, "1GiB");
	uint64_t cap[CLASS_COUNT];
	for (int k = 0; k < CLASS_COUNT; k++)
		cap[k] = (f.m->class_bytes[k] + 4095) / 4096 * 4096;
	stop(&f);
	char dram[64];
	snprintf(dram, sizeof(dram), "%llu",
		 (unsigned long long)(2 * cap[CLASS_GLOBAL] + 3 * cap[CLASS_ATTN] + 4 * cap[CLASS_FFN]));
	split_case(dram, true);
}
END_TEST

/* Device bytes of group g as the window lays it out: each tensor at a 256-byte boundary. */
static uint64_t dev_bytes(const struct manifest *m, uint32_t g)
{
	const struct group_desc *gd = &m->groups[g];
	uint64_t b = 0;
	for (uint32_t i = 0; i < gd->n_tensors; i++)
		b += (m->tensors[gd->first_tensor + i].nbytes + 255) / 256 * 256;
	return b;
}

/* Device bytes of every layer's attention and FFN (a mixture of experts: router) groups. */
static uint64_t layer_bytes(const struct manifest *m)
{
	uint64_t b = 0;
	for (uint32_t l = 0; l < m->cfg.n_layers; l++)
		b += dev_bytes(m, model_group_attn(&m->cfg, l)) + dev_bytes(m, model_group_ffn(&m->cfg, l));
	return b;
}

static void routed_steps_from(struct fixture *f, struct gpu_window *w, int steps, bool at_route, uint32_t first);
static void routed_steps_as(struct fixture *f, struct gpu_window *w, int steps, bool at_route)
{
	routed_steps_from(f, w, steps, at_route, 16);
}

static void routed_steps(struct fixture *f, struct gpu_window *w, int steps)
{
	routed_steps_as(f, w, steps, false);
}

/* An expert group left for the CPU, taken with acquire_host: its bytes in host memory, in place. */
static void expect_host(struct fixture *f, struct weight_source *ws, int step, uint32_t h)
{
	const struct group_desc *hd = &f->m->groups[h];
	struct group_weights hw;
	ck_assert_msg(ws->ops->acquire_host(ws, h, &hw) == 0, "step %d: acquire_host %u: %s", step, h, ws->error);
	for (uint32_t i = 0; i < hd->n_tensors; i++) {
		const struct tensor_desc *t = &f->m->tensors[hd->first_tensor + i];
		char *want = file_bytes(f->m, t);
		ck_assert_ptr_nonnull(hw.t[t->role].data[PLACE_HOST]);
		ck_assert_msg(memcmp(hw.t[t->role].data[PLACE_HOST], want, t->nbytes) == 0,
			      "step %d: expert group %u left for the CPU: %s differs", step, h, t->name);
		free(want);
	}
}

static uint32_t experts_split_seen; /* split experts expect_expert_split checked */
/* What share_host gave for each expert group right after its layer's route (1: split, 0: whole), and
 * the CPU's share it gave: the visit's acquire must hand out the same. */
#define SHARES_MAX 1024
static int shared_at_route[SHARES_MAX];
static struct ffn_split shares_at_route[SHARES_MAX];

/* An expert its route split with the CPU (--split-experts), as acquired: rows [0, r) of its gate and
 * up and columns [0, r) of its down on the device (down's rows packed: r columns apart), the rest in
 * host memory in place, all the checkpoint's bytes. */
static void expect_expert_split(struct fixture *f, const struct group_weights *gw, uint32_t g)
{
	const uint32_t F = f->m->cfg.expert_ffn_dim, r = gw->split.r;
	ck_assert_uint_eq(gw->split.where, FFN_SPLIT_CPU);
	ck_assert_msg(r > 0 && r < F, "expert group %u split at %u of %u", g, r, F);
	static const enum tensor_role mats[3] = {ROLE_EXPERT_GATE, ROLE_EXPERT_UP, ROLE_EXPERT_DOWN};
	const struct weight_tensor *second[3] = {&gw->split.gate, &gw->split.up, &gw->split.down};
	for (int i = 0; i < 3; i++) {
		int ti = model_find_tensor(&f->m->cfg, f->m->tensors, f->m->groups, g, mats[i]);
		ck_assert_int_ge(ti, 0);
		const struct tensor_desc *t = &f->m->tensors[ti];
		const enum dtype fmt = (enum dtype)t->dtype;
		char *want = file_bytes(f->m, t);
		const uint64_t full = dtype_row_bytes(fmt, t->shape[1]);
		const struct weight_tensor *a = &gw->t[mats[i]], *b = second[i];
		ck_assert_ptr_nonnull(b->data[PLACE_HOST]);
		if (mats[i] == ROLE_EXPERT_DOWN) {
			ck_assert_uint_eq(a->cols, r);
			ck_assert_uint_eq(a->row_bytes, dtype_row_bytes(fmt, r));
			ck_assert_uint_eq(b->col0, r);
			ck_assert_uint_eq(b->cols, F - r);
			expect_rows(a->data[PLACE_DEVICE], a->row_bytes, want, full, dtype_row_bytes(fmt, r),
				    (uint32_t)t->shape[0], f->stream, "a split expert's down, the GPU's columns", g);
			for (uint32_t row = 0; row < t->shape[0]; row++)
				ck_assert(memcmp((const char *)b->data[PLACE_HOST] + row * b->row_bytes,
						 want + row * full + dtype_row_bytes(fmt, r), dtype_row_bytes(fmt, F - r)) == 0);
		} else {
			ck_assert_uint_eq(a->rows, r);
			ck_assert_uint_eq(b->row0, r);
			ck_assert_uint_eq(b->rows, F - r);
			expect_rows(a->data[PLACE_DEVICE], full, want, full, full, r, f->stream,
				    "a split expert's gate or up, the GPU's rows", g);
			ck_assert(memcmp(b->data[PLACE_HOST], want + r * full, (F - r) * full) == 0);
		}
		free(want);
	}
	experts_split_seen++;
}

/* steps routed steps over w (the first a chunk that chooses every expert, then decode with 2 experts
 * a token at random), as the engine makes them: every expert acquired holds the checkpoint's bytes,
 * and the state table stays consistent. Experts left for the CPU are taken right after their
 * layer's route (at_route: --cpu-experts route, the default) or at their visit, then skipped. */
/* Where set (>= 0), the two experts every decode step chooses in every layer, in place of random ones. */
static int fixed_choice[2] = {-1, -1};
/* What routed_steps_from tells each route of how the layer before ended (weight_source.route_ends_*,
 * as the engine sets them from backend_moe_ends). */
static bool ends_given;
static int64_t ends_given_ns;

/* The first step of `first` tokens (16: a prefill chunk that routes to every expert), then decode
 * steps of one. */
static void routed_steps_from(struct fixture *f, struct gpu_window *w, int steps, bool at_route, uint32_t first)
{
	const struct model_config *c = &f->m->cfg;
	const uint32_t E = c->n_experts;
	char err[512];
	struct weight_source *ws = gpu_window_base(w);
	bool used[64] = {false}, on_cpu[64] = {false};
	srand(7);
	for (int step = 0; step < steps; step++) {
		ws->step_tokens = step == 0 ? first : 1;
		for (uint32_t g = 0; g < f->m->n_groups; g++) {
			const struct group_desc *gd = &f->m->groups[g];
			if (gd->kind == GROUP_EXPERT && (!used[gd->expert] || on_cpu[gd->expert])) {
				/* Not chosen, or left for the CPU (taken here, or at the route below): the visit
				 * skips it. */
				if (used[gd->expert] && !at_route)
					expect_host(f, ws, step, g);
				ck_assert_msg(ws->ops->skip(ws, g) == 0, "step %d: skip %u: %s", step, g, ws->error);
				continue;
			}
			struct group_weights gw;
			ck_assert_msg(ws->ops->acquire(ws, g, &gw) == 0, "step %d: acquire %u: %s", step, g, ws->error);
			if (gd->kind == GROUP_MOE) {
				for (uint32_t e = 0; e < E; e++)
					used[e] = step == 0, on_cpu[e] = false;
				for (uint32_t k = 0; step && k < c->n_experts_used;) {
					uint32_t e = fixed_choice[0] >= 0 && k < 2 ? (uint32_t)fixed_choice[k] : (uint32_t)rand() % E;
					k += !used[e];
					used[e] = true;
				}
				ws->route_ends_known = ends_given;
				ws->route_ends_ns = ends_given_ns;
				ck_assert_msg(ws->ops->route(ws, gd->layer, used, on_cpu) == 0, "step %d: route %u: %s", step,
					      gd->layer, ws->error);
				/* Those left in DRAM for the CPU, taken at once as the engine does: their bytes in host
				 * memory, in place, before their visit; no release. */
				for (uint32_t h = g + 1; at_route && h < f->m->n_groups &&
							 f->m->groups[h].kind == GROUP_EXPERT && f->m->groups[h].layer == gd->layer;
				     h++)
					if (on_cpu[f->m->groups[h].expert]) {
						expect_host(f, ws, step, h);
					} else {
						/* Not left for the CPU: refused, and nothing of its visit taken. */
						struct group_weights hw;
						ck_assert_int_eq(ws->ops->acquire_host(ws, h, &hw), -EPROTO);
					}
				/* The CPU's share of each chosen expert the route split, as the engine takes it
				 * right after the route: the visit's acquire below gives the same; a group of
				 * another layer is refused. */
				for (uint32_t h = g + 1; h < f->m->n_groups && f->m->groups[h].kind == GROUP_EXPERT &&
							 f->m->groups[h].layer == gd->layer; h++) {
					ck_assert_uint_lt(h, SHARES_MAX);
					shared_at_route[h] = ws->ops->share_host(ws, h, &shares_at_route[h]);
					ck_assert_msg(shared_at_route[h] >= 0, "step %d: share_host %u: %s", step, h, ws->error);
					ck_assert(shared_at_route[h] == 0 || (used[f->m->groups[h].expert] &&
									      !on_cpu[f->m->groups[h].expert]));
				}
				struct ffn_split none;
				ck_assert_int_eq(ws->ops->share_host(ws, g, &none), -EPROTO);
			}
			if (gd->kind == GROUP_EXPERT) {
				ck_assert_uint_lt(g, SHARES_MAX);
				ck_assert_int_eq(shared_at_route[g], gw.split.where != FFN_SPLIT_NONE);
				if (shared_at_route[g]) {
					const struct ffn_split *a = &shares_at_route[g];
					ck_assert_uint_eq(a->where, gw.split.where);
					ck_assert_uint_eq(a->r, gw.split.r);
					ck_assert_ptr_eq(a->gate.data[PLACE_HOST], gw.split.gate.data[PLACE_HOST]);
					ck_assert_ptr_eq(a->up.data[PLACE_HOST], gw.split.up.data[PLACE_HOST]);
					ck_assert_ptr_eq(a->down.data[PLACE_HOST], gw.split.down.data[PLACE_HOST]);
					ck_assert_uint_eq(a->down.col0, gw.split.down.col0);
					ck_assert_uint_eq(a->down.row_bytes, gw.split.down.row_bytes);
				}
				shared_at_route[g] = 0;
			}
			if (gd->kind == GROUP_EXPERT && gw.split.where != FFN_SPLIT_NONE) {
				expect_expert_split(f, &gw, g);
			} else if (gd->kind == GROUP_EXPERT) {
				for (uint32_t i = 0; i < gd->n_tensors; i++) {
					const struct tensor_desc *t = &f->m->tensors[gd->first_tensor + i];
					char *want = file_bytes(f->m, t);
					expect_rows(gw.t[t->role].data[PLACE_DEVICE], t->nbytes, want, t->nbytes, t->nbytes, 1,
						    f->stream, t->name, g);
					free(want);
				}
			}
			ck_assert_msg(ws->ops->release(ws, g) == 0, "step %d: release %u: %s", step, g, ws->error);
		}
		ck_assert_msg(gpu_window_check(w, err, sizeof(err)) == 0, "step %d: %s", step, err);
	}
}


START_TEST(test_experts_of_one_layer_stream)
{
	/* Mixtral-tiny with 3 layers of 8 experts, under a budget that keeps everything but 5 experts
	 * (window_plan.h keeps them in table order while no routing is counted): the 5 that stream are
	 * all of the last layer's, so the visit order of streamed experts comes round to the same layer
	 * every step. Steps of routed decode (2 experts a token, chosen at random) hand out exactly the
	 * checkpoint's bytes for every expert chosen, resident or copied, and never mistake one step's
	 * routing for the next's. */
	struct fixture f;
	start_shape(&f, "1GiB", "mixtral-tiny", 3);
	const struct model_config *c = &f.m->cfg;
	const uint32_t E = c->n_experts;
	uint64_t x = dev_bytes(f.m, model_group_expert(c, 0, 0));
	struct gpu_window_params p = {.gpu_budget = 1ull << 30, .depth = 2, .strict = true};
	struct gpu_window *w = NULL;
	char err[512];
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	struct gpu_window_stats st;
	gpu_window_stats(w, &st);
	const uint64_t all = st.resident_bytes;
	ck_assert_uint_eq(st.experts_resident, c->n_layers * E);
	gpu_window_destroy(&w);
	p.gpu_budget = all - 5 * x + 2 * x; /* 5 experts fewer, 2 expert slots more */
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	gpu_window_stats(w, &st);
	ck_assert_uint_eq(st.experts_resident, c->n_layers * E - 5);
	ck_assert_uint_eq(st.streamed_groups, 5);
	for (uint32_t e = 0; e < E; e++) {
		bool resident = false;
		gpu_window_group_state(w, model_group_expert(c, c->n_layers - 1, e), &resident);
		ck_assert_msg(resident == (e < E - 5), "the last layer's expert %u %s", e,
			      resident ? "resident" : "streamed");
	}
	routed_steps(&f, w, 24);
	gpu_window_stats(w, &st);
	ck_assert_uint_gt(st.experts_passed, 0);
	gpu_window_destroy(&w);
	/* The same with the chosen experts split with the CPU (--split-experts always, --cpu-share 0.5):
	 * the top-up after a route comes round to the next step's visit of the layer's first streamed
	 * experts while this step's are still to come (one chosen expert streamed, the other resident),
	 * and must leave this step's splits as the route made them (each visit gives the split that
	 * share_host gave right after the route). */
	struct task_pool *pool = two_workers();
	p.cpu_pool = pool;
	p.split_experts = GW_SPLIT_ALWAYS;
	ck_assert_int_eq(cpu_share_parse("0.5", &p.cpu_share, err, sizeof(err)), 0);
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	experts_split_seen = 0;
	routed_steps(&f, w, 40);
	/* Every step the layer's first streamed expert and a resident one: one copy and four passed over
	 * (those still in a slot from an earlier step let go, not copied again), so that the top-up
	 * after the route reaches the next step's first streamed expert before this step's visit of it,
	 * whose split it must leave alone (a copy's reset of the split before the top-up's checks failed
	 * here: that visit gave the whole expert after share_host had given the CPU its rows). */
	fixed_choice[0] = (int)(E - 5);
	fixed_choice[1] = 0;
	gpu_window_stats(w, &st);
	const uint64_t copies = st.copies;
	routed_steps(&f, w, 6);
	fixed_choice[0] = fixed_choice[1] = -1;
	gpu_window_stats(w, &st);
	/* A prefill chunk's 5 copies, then a copy a decode step: the chosen streamed expert's, never one
	 * not chosen that is still in its slot from an earlier step. */
	ck_assert_uint_eq(st.copies - copies, 5 + 5);
	ck_assert_uint_gt(st.experts_split, 0);
	ck_assert_uint_eq(experts_split_seen, st.experts_split);
	gpu_window_destroy(&w);
	task_pool_destroy(&pool);
	stop(&f);
}
END_TEST

/* Mixtral-tiny (3 layers of 8 experts) with a DRAM budget of the globals, the attention and router
 * groups and `experts` expert slots (9: 3 streaming slots and 6 experts pinned; 2: 2 streaming slots,
 * none pinned), and a GPU budget that keeps only the attention and router groups: a layer's chosen
 * experts that stream from disk are asked of the loader together at its routing (ring_route, through
 * the window's route; never the experts the window copied before the routing, whose grants would
 * then be held by nobody and leave the loader no slot), and every copy holds the checkpoint's bytes.
 * With cpu, --cpu-share 0.5, or auto at given rates (auto_share). */
static void experts_from_disk(uint32_t experts, bool cpu, bool predict, bool auto_share)
{
	struct fixture f;
	start_shape(&f, "1GiB", "mixtral-tiny", 3);
	const struct model_config *c = &f.m->cfg;
	uint64_t cap[CLASS_COUNT];
	for (int k = 0; k < CLASS_COUNT; k++)
		cap[k] = (f.m->class_bytes[k] + 4095) / 4096 * 4096;
	uint64_t x = dev_bytes(f.m, model_group_expert(c, 0, 0)), dense = layer_bytes(f.m);
	uint64_t head = dev_bytes(f.m, group_id_head(c));
	const uint32_t L = c->n_layers;
	stop(&f); /* c goes with the manifest */
	char dram[64];
	snprintf(dram, sizeof(dram), "%llu",
		 (unsigned long long)(2 * cap[CLASS_GLOBAL] + L * (cap[CLASS_ATTN] + cap[CLASS_FFN]) +
				      experts * cap[CLASS_EXPERT]));
	start_shape(&f, dram, "mixtral-tiny", 3);
	c = &f.m->cfg;
	ck_assert(!ring_source_all_resident(f.ring));
	ck_assert_uint_eq(ring_source_streaming_slots(f.ring, CLASS_EXPERT), experts < 3 ? experts : 3);
	struct gpu_window_params p = {.gpu_budget = head + dense + 2 * x, .depth = 2, .strict = true,
				      .predict_experts = predict};
	struct gpu_window *w = NULL;
	char err[512];
	struct task_pool *pool = NULL;
	if (cpu) {
		pool = two_workers();
		p.cpu_pool = pool;
		if (auto_share) /* rates as a re-plan gives them: nothing measured */
			auto_share_known(&p, 1e7, 3e7, 4e7);
		else
			ck_assert_int_eq(cpu_share_parse("0.5", &p.cpu_share, err, sizeof(err)), 0);
	}
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	struct gpu_window_stats st;
	gpu_window_stats(w, &st);
	ck_assert_uint_eq(st.experts_resident, 0);
	if (cpu) { /* the plan expects the CPU to take part of the pinned experts' bytes, off PCIe */
		ck_assert_uint_gt(st.expert_cpu_bytes_per_token, 0);
		ck_assert_uint_eq(st.cpu_bytes_per_token, st.expert_cpu_bytes_per_token);
		char d[1024];
		gpu_window_describe(w, d, sizeof(d));
		ck_assert_msg(strstr(d, "routed experts on the CPU") != NULL, "%s", d);
	} else {
		ck_assert_uint_eq(st.expert_cpu_bytes_per_token, 0);
	}
	routed_steps(&f, w, 24);
	ck_assert_uint_gt(ring_source_experts_ahead(f.ring), 0);
	/* A step that fails with an expert of layer 1 acquired (its copy from the loader's streaming
	 * slots done or in flight, never released): the reset settles it, grants and all, and routed
	 * steps go on with every expert's bytes as before. */
	{
		struct weight_source *ws = gpu_window_base(w);
		ws->step_tokens = 1;
		bool used[64] = {false}, on_cpu[64] = {false};
		bool held = false;
		for (uint32_t g = 0; g < f.m->n_groups && !held; g++) {
			const struct group_desc *gd = &f.m->groups[g];
			if (gd->kind == GROUP_EXPERT && (!used[gd->expert] || on_cpu[gd->expert])) {
				ck_assert_msg(ws->ops->skip(ws, g) == 0, "skip %u: %s", g, ws->error);
				continue;
			}
			struct group_weights gw;
			ck_assert_msg(ws->ops->acquire(ws, g, &gw) == 0, "acquire %u: %s", g, ws->error);
			if (gd->kind == GROUP_MOE) {
				memset(used, 0, sizeof(used));
				memset(on_cpu, 0, sizeof(on_cpu));
				used[0] = used[3] = true;
				ck_assert_msg(ws->ops->route(ws, gd->layer, used, on_cpu) == 0, "route: %s", ws->error);
			}
			held = gd->kind == GROUP_EXPERT && gd->layer == 1;
			if (!held)
				ck_assert_int_eq(ws->ops->release(ws, g), 0);
		}
		ck_assert(held);
		ck_assert_msg(ws->ops->reset(ws) == 0, "reset: %s", ws->error);
		routed_steps(&f, w, 6);
	}
	gpu_window_stats(w, &st);
	ck_assert_uint_eq(st.step_resets, 1);
	if (cpu) { /* the pinned experts chosen in decode steps, half of them by bytes */
		ck_assert_uint_gt(st.experts_cpu, 0);
		/* ... and taken for the CPU right after their layer's route (--cpu-experts route). */
		uint64_t before = st.experts_cpu;
		routed_steps_as(&f, w, 12, true);
		gpu_window_stats(w, &st);
		ck_assert_uint_gt(st.experts_cpu, before);
	}
	if (auto_share) {
		/* Auto weighs a route's CPU side at the rate the runner gives (the experts' spans,
		 * runner_expert_rate), else the plan's: far too slow a CPU gets no expert (the plan's rate
		 * gave it some above), far too fast one gets chosen experts again; 0 goes back to the
		 * plan's rate. */
		ck_assert(gpu_window_expert_rate(w, 1) == 1e7 && gpu_window_expert_rate(w, 16) == 1e7);
		ck_assert(st.expert_rate_jobs == 0);
		gpu_window_set_expert_rate(w, 1.0, 0, 0);
		uint64_t before = st.experts_cpu;
		routed_steps_as(&f, w, 12, true);
		gpu_window_stats(w, &st);
		ck_assert_uint_eq(st.experts_cpu, before);
		/* A step of several tokens takes the one-token rate where none is set for it. */
		ck_assert(st.expert_rate_jobs == 1.0 && gpu_window_expert_rate(w, 1) == 1.0 &&
			  gpu_window_expert_rate(w, 16) == 1.0);
		/* Its own rate where one is: the same first step (16 tokens, routing to every expert), which
		 * gave the CPU none above at the slow one-token rate, gives it experts at a fast rate of its
		 * own. */
		gpu_window_set_expert_rate(w, 1.0, 1e18, 0);
		ck_assert(gpu_window_expert_rate(w, 1) == 1.0 && gpu_window_expert_rate(w, 16) == 1e18);
		routed_steps_as(&f, w, 1, true);
		gpu_window_stats(w, &st);
		ck_assert_uint_gt(st.experts_cpu, before);
		/* ... while one-token steps keep their own slow rate: no expert for the CPU. */
		before = st.experts_cpu;
		routed_steps_from(&f, w, 12, true, 1);
		gpu_window_stats(w, &st);
		ck_assert_uint_eq(st.experts_cpu, before);
		gpu_window_set_expert_rate(w, 1e18, 0, 0);
		routed_steps_as(&f, w, 12, true);
		gpu_window_stats(w, &st);
		ck_assert_uint_gt(st.experts_cpu, before);
		gpu_window_set_expert_rate(w, 0, 0, 0);
		ck_assert(gpu_window_expert_rate(w, 1) == 1e7 && gpu_window_expert_rate(w, 16) == 1e7);
	}
	if (predict) /* pinned experts guessed in or out; those that stream only ever guessed in */
		ck_assert_uint_gt(st.experts_guessed, 0);
	else
		ck_assert_uint_eq(st.experts_guessed, 0);
	gpu_window_destroy(&w);
	task_pool_destroy(&pool);
	stop(&f);
}

START_TEST(test_experts_streamed_from_disk)
{
	experts_from_disk(9, false, false, false);
}
END_TEST

START_TEST(test_experts_streamed_through_two_slots)
{
	experts_from_disk(2, false, false, false);
}
END_TEST

START_TEST(test_experts_on_the_cpu_from_dram)
{
	/* --cpu-share 0.5: chosen experts pinned in DRAM go to the CPU by half of their bytes, read in
	 * place in their slots (held for good by the ring source, never copied). */
	experts_from_disk(9, true, false, false);
}
END_TEST

START_TEST(test_experts_on_the_cpu_at_their_rate)
{
	/* --cpu-share auto: a route gives the CPU a chosen expert where its side then ends first, at the
	 * rate the runner last gave the window (the experts' spans) or else the plan's. */
	experts_from_disk(9, true, false, true);
}
END_TEST

START_TEST(test_experts_guessed_beside_disk)
{
	/* The same with --predict-experts: a later layer's pinned experts guessed (the CPU takes one
	 * guessed out but chosen), those that stream from disk guessed in when last chosen, else left
	 * for their route; every step's bytes and state table as before. */
	experts_from_disk(9, true, true, false);
}
END_TEST

/* A GPU budget of f's model that keeps the head, the attention and router groups of every layer
 * and `slots` experts' room: the experts stream through that many slots. */
static uint64_t attn_and_expert_slots(struct fixture *f, uint32_t slots)
{
	const struct model_config *c = &f->m->cfg;
	return dev_bytes(f->m, group_id_head(c)) + layer_bytes(f->m) +
	       slots * dev_bytes(f->m, model_group_expert(c, 0, 0));
}

/* --split-experts: mixtral-tiny (3 layers of 8 experts of 128 rows, 2 a token) all in DRAM, the GPU
 * holding the attention and router groups and two expert slots, --cpu-share 0.5 (the CPU as fast as
 * the link): with always, a decode route splits chosen experts between the link (the first 64 rows,
 * the only unit of 64 below 128) and the CPU, their pieces copied and read in place with the
 * checkpoint's bytes, its CPU bytes counted, and no layer guessed although --predict-experts is on;
 * with auto such small experts (a copy far under GW_SPLIT_EXPERT_MIN_S) and with off nothing splits.
 * The window's invariants hold at every step either way. */
START_TEST(test_experts_split_with_the_cpu)
{
	struct fixture f;
	start_shape(&f, "1GiB", "mixtral-tiny", 3);
	char err[512];
	struct task_pool *pool = two_workers();
	static const enum gw_split_experts modes[] = {GW_SPLIT_ALWAYS, GW_SPLIT_AUTO, GW_SPLIT_OFF};
	for (int k = 0; k < 3; k++) {
		struct gpu_window_params p = {.gpu_budget = attn_and_expert_slots(&f, 2), .depth = 2, .strict = true,
					      .cpu_pool = pool, .predict_experts = true, .split_experts = modes[k]};
		ck_assert_int_eq(cpu_share_parse("0.5", &p.cpu_share, err, sizeof(err)), 0);
		struct gpu_window *w = NULL;
		ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
		experts_split_seen = 0;
		routed_steps(&f, w, 24);
		struct gpu_window_stats st;
		gpu_window_stats(w, &st);
		if (modes[k] == GW_SPLIT_ALWAYS) {
			ck_assert_uint_gt(st.experts_split, 0);
			ck_assert_uint_eq(experts_split_seen, st.experts_split);
			/* A step that fails right after layer 0's route split its chosen experts: the reset
			 * and the copies it starts take them whole again, which the next steps' bytes (a
			 * prefill chunk's every expert first) check. */
			struct weight_source *ws = gpu_window_base(w);
			ws->step_tokens = 1;
			bool used[64] = {false}, on_cpu[64] = {false};
			used[0] = used[3] = true;
			const uint64_t before = st.experts_split;
			uint64_t copies = 0;
			for (uint32_t g = 0; g < f.m->n_groups; g++) {
				struct group_weights gw;
				ck_assert_msg(ws->ops->acquire(ws, g, &gw) == 0, "acquire %u: %s", g, ws->error);
				if (f.m->groups[g].kind == GROUP_MOE) {
					gpu_window_stats(w, &st);
					copies = st.copies;
					ck_assert_msg(ws->ops->route(ws, 0, used, on_cpu) == 0, "route: %s", ws->error);
					break;
				}
				ck_assert_int_eq(ws->ops->release(ws, g), 0);
			}
			gpu_window_stats(w, &st);
			ck_assert_uint_gt(st.experts_split, before);
			/* The split experts' copies wait for the engine's next call (the CPU's shares go
			 * first): none issued by the route itself. */
			ck_assert_uint_eq(st.copies, copies);
			ck_assert_msg(ws->ops->reset(ws) == 0, "reset: %s", ws->error);
			routed_steps(&f, w, 6);
			gpu_window_stats(w, &st);
			ck_assert_uint_gt(st.experts_split_cpu_bytes, 0);
			ck_assert_uint_ge(st.experts_cpu_bytes, st.experts_split_cpu_bytes);
			ck_assert_uint_eq(st.experts_guessed, 0);
		} else {
			ck_assert_uint_eq(st.experts_split, 0);
			ck_assert_uint_eq(experts_split_seen, 0);
			ck_assert_uint_gt(st.experts_guessed, 0);
		}
		gpu_window_destroy(&w);
	}
	task_pool_destroy(&pool);
	stop(&f);
}
END_TEST

/* --predict-experts: mixtral-tiny (3 layers of 8 experts, 2 a token) all in DRAM, the GPU holding
 * the attention and router groups and two expert slots, --cpu-share 0.5. In decode a later layer's
 * experts are copied before its route, those its last routing chose, and the others passed over;
 * the route then computes on the GPU a guess it chose, skips one it did not, and leaves to the CPU
 * one it chose that was passed over. Over random routings there are all three, every chosen expert
 * is handed out with the checkpoint's bytes (on the device or in host memory), and the window's
 * invariants hold at every step. Without it nothing is guessed. */
START_TEST(test_experts_guessed)
{
	struct fixture f;
	start_shape(&f, "1GiB", "mixtral-tiny", 3);
	const struct model_config *c = &f.m->cfg;
	const uint32_t E = c->n_experts;
	ck_assert(ring_source_all_resident(f.ring));
	char err[512];
	struct task_pool *pool = two_workers();
	for (int predict = 0; predict < 2; predict++) {
		struct gpu_window_params p = {.gpu_budget = attn_and_expert_slots(&f, 2), .depth = 2, .strict = true,
					      .cpu_pool = pool, .predict_experts = predict};
		ck_assert_int_eq(cpu_share_parse("0.5", &p.cpu_share, err, sizeof(err)), 0);
		struct gpu_window *w = NULL;
		ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
		struct gpu_window_stats st;
		gpu_window_stats(w, &st);
		ck_assert_uint_eq(st.experts_resident, 0);
		routed_steps_as(&f, w, 30, true);
		gpu_window_stats(w, &st);
		printf("experts guessed: predict %d, %llu copied on a guess, %llu of them chosen, %llu passed over then "
		       "chosen (to the CPU), %llu on the CPU in all, %llu passed over\n", predict,
		       (unsigned long long)st.experts_guessed, (unsigned long long)st.guess_hits,
		       (unsigned long long)st.guess_missed, (unsigned long long)st.experts_cpu,
		       (unsigned long long)st.experts_passed);
		if (predict) {
			ck_assert_uint_gt(st.experts_guessed, 0);
			ck_assert_uint_gt(st.guess_hits, 0);
			ck_assert_uint_lt(st.guess_hits, st.experts_guessed); /* copies not chosen were skipped */
			ck_assert_uint_gt(st.guess_missed, 0);
			ck_assert_uint_ge(st.experts_cpu, st.guess_missed);
			/* Top-2 of streamed experts at a share of 0.5: a layer's guess copies one of the
			 * two its last routing chose, the GPU's half (guess_next), never both. */
			ck_assert_uint_le(st.experts_guessed, 30 * c->n_layers);
		} else {
			ck_assert_uint_eq(st.experts_guessed + st.guess_hits + st.guess_missed, 0);
		}
		/* A decode step that fails right after layer 0's route, its guesses of the later layers
		 * issued and never settled: the reset forgets them, and steps from a prefill chunk on
		 * run as before. */
		struct weight_source *ws = gpu_window_base(w);
		ws->step_tokens = 1;
		for (uint32_t g = 0; g < f.m->n_groups; g++) {
			const struct group_desc *gd = &f.m->groups[g];
			if (gd->kind == GROUP_EXPERT)
				break;
			struct group_weights gw;
			ck_assert_msg(ws->ops->acquire(ws, g, &gw) == 0, "acquire %u: %s", g, ws->error);
			if (gd->kind == GROUP_MOE) {
				bool used[64] = {false}, on_cpu[64] = {false};
				used[1] = used[E - 1] = true;
				ck_assert_msg(ws->ops->route(ws, gd->layer, used, on_cpu) == 0, "route: %s", ws->error);
			}
			ck_assert_int_eq(ws->ops->release(ws, g), 0);
		}
		ck_assert_msg(ws->ops->reset(ws) == 0, "reset: %s", ws->error);
		routed_steps_as(&f, w, 6, true);
		gpu_window_stats(w, &st);
		ck_assert_uint_eq(st.step_resets, 1);
		gpu_window_destroy(&w);
	}
	task_pool_destroy(&pool);
	stop(&f);
}
END_TEST

/* --predict-experts with --cpu-share auto once the runner has given the rate the CPU's experts ran
 * at (gpu_window_set_expert_rate): the guesses then copy the link's share of a layer's last choice
 * by that rate and the lead (expert_copy_share), carried from layer to layer. Far too slow a CPU:
 * every chosen expert last time is copied, and the CPU gets only the guesses' misses (the route
 * gives it none). Far too fast: nothing is copied on a guess, and the route gives the CPU chosen
 * experts. Just as fast with a lead of a second a layer: the copies' lead makes the share whole
 * again. The window's invariants (--strict) at every step. */
START_TEST(test_experts_guessed_at_their_rate)
{
	struct fixture f;
	start_shape(&f, "1GiB", "mixtral-tiny", 3);
	const struct model_config *c = &f.m->cfg;
	char err[512];
	struct task_pool *pool = two_workers();
	struct gpu_window_params p = {.gpu_budget = attn_and_expert_slots(&f, 2), .depth = 2, .strict = true,
				      .cpu_pool = pool, .predict_experts = true};
	auto_share_known(&p, 1e7, 3e7, 4e7);
	struct gpu_window *w = NULL;
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	struct gpu_window_stats a, b;
	routed_steps_as(&f, w, 4, true); /* every layer's routing known */
	/* A CPU far too slow. */
	gpu_window_set_expert_rate(w, 1.0, 0, 0);
	gpu_window_stats(w, &a);
	routed_steps_as(&f, w, 20, true);
	gpu_window_stats(w, &b);
	const uint64_t slow_guessed = b.experts_guessed - a.experts_guessed;
	printf("guesses at a slow CPU's rate: %llu copied, %llu chosen, %llu missed, %llu on the CPU\n",
	       (unsigned long long)slow_guessed, (unsigned long long)(b.guess_hits - a.guess_hits),
	       (unsigned long long)(b.guess_missed - a.guess_missed), (unsigned long long)(b.experts_cpu - a.experts_cpu));
	ck_assert_uint_gt(slow_guessed, 0);
	ck_assert_uint_gt(b.guess_hits, a.guess_hits);
	ck_assert_uint_eq(b.experts_cpu - a.experts_cpu, b.guess_missed - a.guess_missed);
	/* A CPU far too fast, no lead. */
	gpu_window_set_expert_rate(w, 1e18, 0, 0);
	gpu_window_stats(w, &a);
	routed_steps_as(&f, w, 20, true);
	gpu_window_stats(w, &b);
	printf("guesses at a fast CPU's rate: %llu copied, %llu on the CPU\n",
	       (unsigned long long)(b.experts_guessed - a.experts_guessed),
	       (unsigned long long)(b.experts_cpu - a.experts_cpu));
	/* The first step's guesses were made at the slow rate, before it. */
	ck_assert_uint_le(b.experts_guessed - a.experts_guessed, 2 * c->n_layers);
	ck_assert_uint_gt(b.experts_cpu - a.experts_cpu, b.guess_missed - a.guess_missed);
	/* Just as fast, with a second's lead a layer: the copies take the whole choice again. */
	gpu_window_set_expert_rate(w, 1e18, 0, 1.0);
	gpu_window_stats(w, &a);
	ck_assert(a.expert_lead_ms == 1000.0);
	routed_steps_as(&f, w, 20, true);
	gpu_window_stats(w, &b);
	printf("guesses at a fast CPU's rate with a lead: %llu copied\n",
	       (unsigned long long)(b.experts_guessed - a.experts_guessed));
	ck_assert_uint_gt(b.experts_guessed - a.experts_guessed, slow_guessed / 2);
	gpu_window_destroy(&w);
	task_pool_destroy(&pool);
	stop(&f);
}
END_TEST

/* Eight one-token steps of test_experts_ends_balanced with the ends as given, the stats before (a)
 * and after (b), and what they did. */
static void ends_steps(struct fixture *f, struct gpu_window *w, int on, const char *how, struct gpu_window_stats *a,
		       struct gpu_window_stats *b)
{
	gpu_window_stats(w, a);
	routed_steps_from(f, w, 8, true, 1);
	gpu_window_stats(w, b);
	printf("balance-ends %s, the GPU's side %s: lag %.3f ms, %llu measured, %llu split, %llu experts to the CPU\n",
	       on ? "on" : "off", how, b->ends_lag_ms, (unsigned long long)(b->ends_measured - a->ends_measured),
	       (unsigned long long)(b->experts_split - a->experts_split),
	       (unsigned long long)(b->experts_cpu - a->experts_cpu));
}

/* --balance-ends: mixtral-tiny (3 layers of 8 experts of 128 rows, 2 a token, all streamed) with
 * --split-experts always and auto at rates that make either side of an expert take 0.1 us: with no
 * lag each chosen expert splits at its only unit (64 rows). Told that the layer before's GPU side
 * ended 10 ms after the CPU's, the routes count the link's side as started late by the most lag
 * (GW_ENDS_MAX_S, far above both sides' times) and give the CPU whole experts; told it ended 10 ms
 * early, the lag turns to the CPU's side and the link takes them whole, and a route that then gives
 * the CPU nothing brings the lag back towards none rather than keep it (nothing would measure it).
 * Not known (the step's first layer, a backend that does not measure), or --balance-ends false:
 * the lag stays 0, and false still counts what was measured. One-token steps only (the lag is
 * theirs; the first chooses every expert). The invariants hold at every step. */
START_TEST(test_experts_ends_balanced)
{
	struct fixture f;
	start_shape(&f, "1GiB", "mixtral-tiny", 3);
	char err[512];
	struct task_pool *pool = two_workers();
	for (int on = 1; on >= 0; on--) {
		struct gpu_window_params p = {.gpu_budget = attn_and_expert_slots(&f, 2), .depth = 2, .strict = true,
					      .cpu_pool = pool, .predict_experts = true, .split_experts = GW_SPLIT_ALWAYS,
					      .balance_ends = on != 0};
		auto_share_known(&p, 1e12, 1e12, 1e12);
		struct gpu_window *w = NULL;
		ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
		gpu_window_set_expert_rate(w, 1e12, 0, 0);
		struct gpu_window_stats a, b;
		/* Nothing known: balanced by the rates, every chosen expert split. */
		ends_given = false;
		gpu_window_stats(w, &a);
		routed_steps_from(&f, w, 8, true, 1);
		gpu_window_stats(w, &b);
		ck_assert(b.ends_lag_ms == 0);
		ck_assert_uint_eq(b.ends_measured, 0);
		const uint64_t split_even = b.experts_split - a.experts_split;
		ck_assert_uint_gt(split_even, 0);
		/* The GPU's side 10 ms late at every layer. */
		ends_given = true;
		ends_given_ns = 10000000;
		ends_steps(&f, w, on, "late", &a, &b);
		ck_assert_uint_gt(b.ends_measured, a.ends_measured);
		ck_assert(b.ends_gpu_late_ms > a.ends_gpu_late_ms);
		if (on) {
			ck_assert(b.ends_lag_ms == GW_ENDS_MAX_S * 1e3);
			/* Past the first measure, every chosen expert whole to the CPU. */
			ck_assert_uint_lt(b.experts_split - a.experts_split, split_even / 4);
			ck_assert_uint_gt(b.experts_cpu - a.experts_cpu, split_even / 2);
		} else {
			ck_assert(b.ends_lag_ms == 0);
			ck_assert_uint_ge(b.experts_split - a.experts_split, split_even * 3 / 4);
			ck_assert_uint_eq(b.experts_cpu, a.experts_cpu);
		}
		/* The GPU's side 10 ms early. */
		ends_given_ns = -10000000;
		ends_steps(&f, w, on, "early", &a, &b);
		ck_assert(b.ends_cpu_late_ms > a.ends_cpu_late_ms);
		if (on) {
			ck_assert(b.ends_lag_ms < 0 && b.ends_lag_ms >= -GW_ENDS_MAX_S * 1e3);
			ck_assert_uint_lt(b.experts_cpu - a.experts_cpu, split_even / 4);
		} else {
			ck_assert(b.ends_lag_ms == 0);
			ck_assert_uint_ge(b.experts_split - a.experts_split, split_even * 3 / 4);
			ck_assert_uint_eq(b.experts_cpu, a.experts_cpu);
		}
		/* Unknown again: the lag stays where it is. */
		ends_given = false;
		const double lag = b.ends_lag_ms;
		routed_steps_from(&f, w, 2, true, 1);
		gpu_window_stats(w, &b);
		ck_assert(b.ends_lag_ms == lag || (on && b.ends_lag_ms > lag && b.ends_lag_ms <= 0));
		gpu_window_destroy(&w);
	}
	ends_given = false;
	task_pool_destroy(&pool);
	stop(&f);
}
END_TEST

START_TEST(test_hot_experts)
{
	/* Room for 5 experts beside the attention and router groups and two expert slots. With no routing
	 * counted the window keeps layer 0's first five; what a plan from a heat that favours five others
	 * would keep (gpu_window_expert_gain) is all of the heat, against none now; a window made with that
	 * heat keeps those five, and routed steps still hand out the checkpoint's bytes. */
	struct fixture f;
	start_shape(&f, "1GiB", "mixtral-tiny", 3);
	const struct model_config *c = &f.m->cfg;
	const uint32_t E = c->n_experts;
	uint64_t x = dev_bytes(f.m, model_group_expert(c, 0, 0)), dense = layer_bytes(f.m);
	struct gpu_window_params p = {.gpu_budget = dev_bytes(f.m, group_id_head(c)) + dense + 2 * x + 5 * x + x / 2,
				      .depth = 2, .strict = true};
	struct gpu_window *w = NULL;
	char err[512];
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	struct gpu_window_stats st;
	gpu_window_stats(w, &st);
	ck_assert_uint_eq(st.experts_resident, 5);
	bool resident;
	for (uint32_t e = 0; e < E; e++) {
		gpu_window_group_state(w, model_group_expert(c, 0, e), &resident);
		ck_assert_msg(resident == (e < 5), "layer 0's expert %u", e);
	}
	float *heat = calloc((size_t)c->n_layers * E, sizeof(float));
	ck_assert_ptr_nonnull(heat);
	const uint32_t hot[5][2] = {{2, 7}, {1, 3}, {2, 0}, {1, 6}, {0, 6}};
	for (int i = 0; i < 5; i++)
		heat[hot[i][0] * E + hot[i][1]] = 0.9f - 0.1f * (float)i;
	double now = -1, planned = -1;
	ck_assert_int_eq(gpu_window_expert_gain(w, heat, &now, &planned), 0);
	ck_assert_msg(now == 0 && fabs(planned - 1) < 1e-6, "now %g, planned %g", now, planned);
	gpu_window_destroy(&w);
	p.expert_heat = heat;
	ck_assert_msg(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)) == 0, "%s", err);
	gpu_window_stats(w, &st);
	ck_assert_uint_eq(st.experts_resident, 5);
	ck_assert(fabs(st.expert_heat_resident - 1) < 1e-6);
	for (int i = 0; i < 5; i++) {
		gpu_window_group_state(w, model_group_expert(c, hot[i][0], hot[i][1]), &resident);
		ck_assert_msg(resident, "hot expert %u of layer %u not resident", hot[i][1], hot[i][0]);
	}
	ck_assert_int_eq(gpu_window_expert_gain(w, heat, &now, &planned), 0);
	ck_assert(fabs(now - 1) < 1e-6 && fabs(planned - 1) < 1e-6);
	char line[1024];
	gpu_window_describe(w, line, sizeof(line));
	ck_assert_msg(strstr(line, "5 experts resident, chosen by 100.0% of the routing counted"), "%s", line);
	routed_steps(&f, w, 12);
	gpu_window_destroy(&w);
	free(heat);
	stop(&f);
}
END_TEST

START_TEST(test_budget_too_small)
{
	struct fixture f;
	start(&f, "1GiB");
	struct gpu_window_params p = {.gpu_budget = 4096, .depth = 2, .strict = true};
	struct gpu_window *w = NULL;
	char err[512];
	ck_assert_int_eq(gpu_window_create(f.ring, f.stream, &p, &w, err, sizeof(err)), -ENOSPC);
	ck_assert_msg(strstr(err, "--gpu-budget") && strstr(err, "need"), "%s", err);
	stop(&f);
}
END_TEST

int main(void)
{
	if (!have_gpu()) {
		printf("no GPU: skipped\n");
		return 77;
	}
	Suite *s = suite_create("gpu_window");
	TCase *tc = tcase_create("window");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_all_resident);
	tcase_add_test(tc, test_streaming_depth_2);
	tcase_add_test(tc, test_streaming_spread);
	tcase_add_test(tc, test_streaming_spread_auto);
	tcase_add_test(tc, test_split_gaps);
	tcase_add_test(tc, test_failed_step_reset);
	tcase_add_test(tc, test_streaming_depth_1_dram_streams);
	tcase_add_test(tc, test_budget_too_small);
	tcase_add_test(tc, test_split_ffn);
	tcase_add_test(tc, test_split_ffn_dram_streams);
	tcase_add_test(tc, test_split_refill_budget);
	tcase_add_test(tc, test_split_fit_budget);
	tcase_add_test(tc, test_experts_of_one_layer_stream);
	tcase_add_test(tc, test_experts_streamed_from_disk);
	tcase_add_test(tc, test_experts_streamed_through_two_slots);
	tcase_add_test(tc, test_experts_on_the_cpu_from_dram);
	tcase_add_test(tc, test_experts_on_the_cpu_at_their_rate);
	tcase_add_test(tc, test_hot_experts);
	tcase_add_test(tc, test_experts_guessed);
	tcase_add_test(tc, test_experts_guessed_at_their_rate);
	tcase_add_test(tc, test_pins_kept);
	tcase_add_test(tc, test_one_copy_groups);
	tcase_add_test(tc, test_experts_guessed_beside_disk);
	tcase_add_test(tc, test_experts_split_with_the_cpu);
	tcase_add_test(tc, test_experts_ends_balanced);
	suite_add_tcase(s, tc);
	SRunner *sr = srunner_create(s);
	/* CUDA contexts do not survive fork: run in this process. */
	srunner_set_fork_status(sr, CK_NOFORK);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

/* synthetic_write.c - synth_write: the checkpoint's directory and files, written at disk speed
 * (the safetensors layout; synthetic_gguf_write.c writes GGUF files).
 *
 * The calling thread fills 8 MiB buffers, a second thread write()s them, so filling and I/O
 * overlap (the machine this runs on may have only 2 cores). A failure removes what was written. */
#include "tools/make-synthetic-model/synthetic_internal.h"

#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

#define BUF_BYTES    (8u << 20)
#define N_BUFS	     3

/* ---- files ---- */

/* Is nm a weight file of a checkpoint this writer makes (this write's or an earlier one's)? */
static bool is_stale(const char *nm)
{
	unsigned a, b;
	char tail[32];
	return !strcmp(nm, SINGLE_NAME) || !strcmp(nm, INDEX_NAME) ||
	       (sscanf(nm, "model-%5u-of-%5u.%31s", &a, &b, tail) == 3 && !strcmp(tail, "safetensors"));
}

/* A file a safetensors write replaces or removes. */
static bool replaced(const char *nm, const void *ctx)
{
	(void)ctx;
	return is_stale(nm) || !strcmp(nm, "config.json") || !strcmp(nm, "generation_config.json");
}

int syn_st_existing(const char *dir, char *path, size_t len)
{
	return syn_find_in_dir(dir, replaced, NULL, path, len);
}

/* Removes weight files an earlier write left, so the directory holds one checkpoint. */
static int remove_stale(const char *dir, char *err, size_t errlen)
{
	DIR *d = opendir(dir);
	if (!d)
		return errorf(err, errlen, -errno, "cannot list %s: %s", dir, strerror(errno));
	int rc = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (!is_stale(e->d_name))
			continue;
		char path[PATH_MAX];
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		if (unlink(path) != 0 && errno != ENOENT) {
			rc = errorf(err, errlen, -errno, "cannot remove the old %s: %s", path, strerror(errno));
			break;
		}
	}
	closedir(d);
	return rc;
}

/* ---- the writer thread ---- */

struct wbuf {
	uint8_t *data;
	size_t len;
	int fd;
	uint32_t file;
};

struct writer {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	struct wbuf bufs[N_BUFS];
	uint64_t submitted; /* buffers handed over; buffer k lives in bufs[k % N_BUFS] */
	uint64_t done;	    /* buffers written (or dropped after an error) */
	bool stop;
	int err; /* first write error, -errno */
	uint32_t err_file;
	uint64_t written; /* bytes, read by the progress line */
};

static void *writer_main(void *arg)
{
	struct writer *w = arg;
	pthread_mutex_lock(&w->mu);
	for (;;) {
		while (w->done == w->submitted && !w->stop)
			pthread_cond_wait(&w->cv, &w->mu);
		if (w->done == w->submitted)
			break;
		struct wbuf *b = &w->bufs[w->done % N_BUFS];
		bool skip = w->err != 0; /* after an error the rest is dropped so the filler never waits */
		pthread_mutex_unlock(&w->mu);
		int rc = skip ? 0 : syn_write_direct(b->fd, b->data, b->len);
		pthread_mutex_lock(&w->mu);
		if (rc && !w->err) {
			w->err = rc;
			w->err_file = b->file;
		}
		if (!rc && !skip)
			w->written += b->len;
		w->done++;
		pthread_cond_broadcast(&w->cv);
	}
	pthread_mutex_unlock(&w->mu);
	return NULL;
}

/* The filler's side: the buffer being filled and the bookkeeping for progress. */
struct filler {
	struct writer *w;
	struct wbuf *cur;
	int fd;
	uint32_t file;
	bool progress;
	uint64_t total;
	double t0, last_print;
};

/* Waits for a free buffer; returns the writer's error if one happened. */
static int filler_acquire(struct filler *f)
{
	struct writer *w = f->w;
	pthread_mutex_lock(&w->mu);
	while (w->submitted - w->done >= N_BUFS && !w->err)
		pthread_cond_wait(&w->cv, &w->mu);
	int rc = w->err;
	pthread_mutex_unlock(&w->mu);
	if (rc)
		return rc;
	f->cur = &w->bufs[w->submitted % N_BUFS];
	f->cur->len = 0;
	f->cur->fd = f->fd;
	f->cur->file = f->file;
	return 0;
}

static void print_progress(struct filler *f, bool final)
{
	double now = now_s();
	if (!f->progress || (!final && now - f->last_print < 1.0))
		return;
	f->last_print = now;
	pthread_mutex_lock(&f->w->mu);
	uint64_t wr = f->w->written;
	pthread_mutex_unlock(&f->w->mu);
	char a[32], b[32];
	double dt = now - f->t0;
	fprintf(stderr, "synthetic: wrote %s of %s, %.2f GB/s\n", format_size(wr, a, sizeof(a)),
		format_size(f->total, b, sizeof(b)), dt > 0 ? (double)wr / dt / 1e9 : 0.0);
}

static int filler_submit(struct filler *f)
{
	if (!f->cur || f->cur->len == 0)
		return 0;
	struct writer *w = f->w;
	pthread_mutex_lock(&w->mu);
	w->submitted++;
	pthread_cond_broadcast(&w->cv);
	pthread_mutex_unlock(&w->mu);
	f->cur = NULL;
	print_progress(f, false);
	return 0;
}

static int filler_space(struct filler *f, size_t *space)
{
	if (f->cur && f->cur->len == BUF_BYTES)
		filler_submit(f);
	if (!f->cur) {
		int rc = filler_acquire(f);
		if (rc)
			return rc;
	}
	*space = BUF_BYTES - f->cur->len;
	return 0;
}

static int filler_bytes(struct filler *f, const void *src, size_t len)
{
	const uint8_t *p = src;
	while (len) {
		size_t space;
		int rc = filler_space(f, &space);
		if (rc)
			return rc;
		size_t k = len < space ? len : space;
		memcpy(f->cur->data + f->cur->len, p, k);
		f->cur->len += k;
		p += k;
		len -= k;
	}
	return 0;
}

static int filler_tensor(struct filler *f, const struct stensor *t, enum dtype dt)
{
	size_t es = dtype_size(dt);
	uint64_t e = 0;
	while (e < t->nelem) {
		size_t space;
		int rc = filler_space(f, &space);
		if (rc)
			return rc;
		uint64_t k = space / es;
		if (k == 0) { /* a few bytes left (never with one dtype): hand the buffer over short */
			filler_submit(f);
			continue;
		}
		if (k > t->nelem - e)
			k = t->nelem - e;
		syn_fill_range(t->key, t->norm, dt, e, k, f->cur->data + f->cur->len);
		f->cur->len += k * es;
		e += k;
	}
	return 0;
}

/* Waits until everything handed over is written; returns the writer's error. */
static int filler_drain(struct filler *f)
{
	filler_submit(f);
	struct writer *w = f->w;
	pthread_mutex_lock(&w->mu);
	while (w->done != w->submitted)
		pthread_cond_wait(&w->cv, &w->mu);
	int rc = w->err;
	pthread_mutex_unlock(&w->mu);
	return rc;
}

static int write_weights(const char *dir, const struct plan *p, const struct synth_options *o, struct created *cr,
			 char *err, size_t errlen)
{
	int rc = 0;
	struct writer w = {0};
	struct sbuf hdr = {0};
	for (int i = 0; i < N_BUFS; i++) {
		if (posix_memalign((void **)&w.bufs[i].data, SYN_DIRECT_ALIGN, BUF_BYTES) != 0) {
			w.bufs[i].data = NULL;
			rc = errorf(err, errlen, -ENOMEM, "out of memory for write buffers");
			goto out_bufs;
		}
	}
	pthread_mutex_init(&w.mu, NULL);
	pthread_cond_init(&w.cv, NULL);
	pthread_t th;
	rc = -pthread_create(&th, NULL, writer_main, &w);
	if (rc) {
		errorf(err, errlen, rc, "cannot start the writer thread: %s", strerror(-rc));
		goto out_sync;
	}
	struct filler f = {.w = &w, .fd = -1, .progress = o->progress, .total = p->file_bytes, .t0 = now_s()};
	f.last_print = f.t0;
	char path[PATH_MAX];
	for (uint32_t fi = 0; fi < p->n_files && !rc; fi++) {
		snprintf(path, sizeof(path), "%s/%s", dir, p->file_name[fi]);
		f.fd = syn_open_weights(path);
		if (f.fd < 0) {
			rc = errorf(err, errlen, f.fd, "cannot create %s: %s", path, strerror(-f.fd));
			break;
		}
		f.file = fi;
		rc = syn_created_add(cr, path);
		hdr.len = 0;
		if (!rc)
			syn_build_st_header(&hdr, p, fi, o->dtype);
		if (!rc && hdr.oom)
			rc = -ENOMEM;
		if (!rc)
			rc = filler_bytes(&f, hdr.p, hdr.len);
		for (uint32_t k = p->file_first[fi]; k < p->file_first[fi + 1] && !rc; k++)
			rc = filler_tensor(&f, &p->t[p->order[k]], o->dtype);
		int drc = filler_drain(&f); /* the fd must outlive every buffer that names it */
		if (!rc)
			rc = drc;
		if (close(f.fd) != 0 && !rc)
			rc = -errno;
		f.fd = -1;
		if (rc)
			errorf(err, errlen, rc, "writing %s: %s", path, syn_why(rc));
	}
	if (!rc)
		print_progress(&f, true);
	pthread_mutex_lock(&w.mu);
	w.stop = true;
	pthread_cond_broadcast(&w.cv);
	pthread_mutex_unlock(&w.mu);
	pthread_join(th, NULL);
out_sync:
	pthread_cond_destroy(&w.cv);
	pthread_mutex_destroy(&w.mu);
out_bufs:
	for (int i = 0; i < N_BUFS; i++)
		free(w.bufs[i].data);
	free(hdr.p);
	return rc;
}

void synth_options_default(struct synth_options *o)
{
	memset(o, 0, sizeof(*o));
	o->dtype = DT_BF16;
	o->shard_bytes = SYNTH_DEFAULT_SHARD_BYTES;
	o->format = SYNTH_SAFETENSORS;
	o->gguf_type = SYNTH_GGUF_BF16;
}

int synth_existing(const char *out, const struct synth_options *o, char *path, size_t len)
{
	return o->format == SYNTH_GGUF ? syn_gguf_existing(out, path, len) : syn_st_existing(out, path, len);
}

int synth_write_stats(const char *dir, const struct model_config *cfg, const struct synth_options *o,
		      struct synth_stats *stats, char *err, size_t errlen)
{
	assert(dir && cfg && o);
	double t0 = now_s();
	if (!dtype_is_element(o->dtype)) /* safetensors holds element formats only; GGUF rounds to one */
		return errorf(err, errlen, -EINVAL, "dtype %u is not one of BF16, F16, F32", (unsigned)o->dtype);
	if (o->format != SYNTH_SAFETENSORS && o->format != SYNTH_GGUF)
		return errorf(err, errlen, -EINVAL, "format %u is neither safetensors nor GGUF", o->format);
	if (o->format == SYNTH_SAFETENSORS && o->tokenizer)
		return errorf(err, errlen, -EINVAL, "a tokenizer (%s) is embedded in GGUF files only", o->tokenizer);
	bool tied = o->tied || cfg->tie_embeddings;
	struct model_config c = *cfg;
	c.tie_embeddings = tied;
	int rc = model_config_check(&c, err, errlen);
	if (rc)
		return rc;
	if (o->format == SYNTH_GGUF)
		return syn_gguf_write(dir, &c, o, tied, stats, err, errlen);
	syn_values_init();

	struct plan p;
	struct created files = {0}, dirs = {0};
	struct sbuf s = {0};
	rc = syn_plan_build(&p, &c, o, tied, err, errlen);
	if (rc)
		goto out_plan;
	for (uint32_t f = 0; f < p.n_files; f++) {
		struct sbuf h = {0};
		syn_build_st_header(&h, &p, f, o->dtype);
		if (h.oom) {
			free(h.p);
			rc = errorf(err, errlen, -ENOMEM, "out of memory building a header");
			goto out_plan;
		}
		p.file_size[f] = h.len;
		for (uint32_t k = p.file_first[f]; k < p.file_first[f + 1]; k++)
			p.file_size[f] += p.t[p.order[k]].nbytes;
		p.file_bytes += p.file_size[f];
		free(h.p);
	}

	rc = syn_make_dirs(dir, &dirs, err, errlen);
	if (!rc)
		rc = remove_stale(dir, err, errlen);
	if (rc)
		goto out_cleanup;
	syn_build_config_json(&s, &c, o, tied);
	rc = s.oom ? errorf(err, errlen, -ENOMEM, "out of memory")
		   : syn_write_small_file(dir, "config.json", &s, &files, err, errlen);
	if (rc)
		goto out_cleanup;
	s.len = 0;
	syn_build_generation_json(&s, &c);
	rc = s.oom ? errorf(err, errlen, -ENOMEM, "out of memory")
		   : syn_write_small_file(dir, "generation_config.json", &s, &files, err, errlen);
	if (rc)
		goto out_cleanup;
	if (p.n_files > 1) {
		s.len = 0;
		rc = syn_build_index_json(&s, &p);
		if (rc || s.oom)
			rc = errorf(err, errlen, -ENOMEM, "out of memory");
		else
			rc = syn_write_small_file(dir, INDEX_NAME, &s, &files, err, errlen);
		if (rc)
			goto out_cleanup;
	}
	rc = write_weights(dir, &p, o, &files, err, errlen);
	if (rc)
		goto out_cleanup;
	if (stats) {
		memset(stats, 0, sizeof(*stats));
		stats->params = synth_param_count(&c, tied);
		stats->tensor_bytes = p.tensor_bytes;
		stats->file_bytes = p.file_bytes;
		stats->n_files = p.n_files;
		stats->n_tensors = p.n;
		stats->seconds = now_s() - t0;
	}
	goto out_plan;

out_cleanup:
	/* Leave nothing half-written behind: a partial checkpoint would look loadable. */
	syn_created_remove(&files, &dirs);
out_plan:
	free(s.p);
	free(files.paths);
	free(dirs.paths);
	syn_plan_free(&p);
	return rc;
}

int synth_write(const char *dir, const struct model_config *cfg, const struct synth_options *o, char *err,
		size_t errlen)
{
	return synth_write_stats(dir, cfg, o, NULL, err, errlen);
}

/* synthetic_gguf_write.c - synth_write for GGUF: the files of a gplan (synthetic_gguf.c), their
 * bytes converted and quantized on every core and written with large sequential writes.
 *
 * Each file is cut into 8 MiB segments, numbered across the files in the order they are written.
 * A pool of threads fills segments (header bytes, tensor rows generated, rounded, converted or
 * quantized, zero padding), each taking the next number while a buffer is free; the calling
 * thread writes the filled segments in order, several at a time with one writev (O_DIRECT where
 * the file system takes it). A segment's first and last rows may be cut by its edges: those rows
 * are computed by both segments that hold a part of them, so no segment waits for another. The
 * bytes do not depend on the number of threads. A failure removes what was written. */
#include "tools/make-synthetic-model/synthetic_internal.h"

#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/quant.h"
#include "common/util.h"

#define SEG_BYTES   (8ull << 20) /* a multiple of SYN_DIRECT_ALIGN */
#define MAX_GATHER  8	       /* segments per writev */
#define MAX_THREADS 256
#define SPARE_BUFS  4 /* buffers beyond one per thread: written, or waiting to be */

/* ---- filling ---- */

/* A filling thread's own memory for one row. */
struct scratch {
	float *f;     /* max_cols values */
	uint8_t *row; /* max_row_bytes: a row cut by a segment's edge */
};

/* Row r of tensor t in its type, into out (row_bytes). */
static void convert_row(const struct gplan *p, const struct gtensor *t, uint64_t r, uint8_t *out, struct scratch *sc)
{
	uint64_t cols = t->ne[0], key = t->key;
	if (t->ndim == 3) { /* a fused expert tensor: row r of expert r / ne[1] */
		key = p->expert_keys[t->keys_at + r / t->ne[1]];
		r %= t->ne[1];
	}
	uint64_t src = t->perm_heads ? syn_gguf_src_row(r, p->head_dim) : r;
	syn_fill_f32(key, t->kind == GK_NORM, p->round, src * cols, cols, sc->f);
	switch (t->type) {
	case DT_F32:
		memcpy(out, sc->f, cols * sizeof(float));
		break;
	case DT_F16:
	case DT_BF16:
		for (uint64_t i = 0; i < cols; i++) {
			uint16_t h = t->type == DT_F16 ? f32_to_f16(sc->f[i]) : f32_to_bf16(sc->f[i]);
			memcpy(out + 2 * i, &h, 2);
		}
		break;
	default:
		quant_quantize(t->type, sc->f, out, cols);
		break;
	}
}

/* Bytes [x, y) of tensor t into dst. */
static void fill_tensor(const struct gplan *p, const struct gtensor *t, uint64_t x, uint64_t y, uint8_t *dst,
			struct scratch *sc)
{
	if (t->kind == GK_ROPE_FREQS) {
		memcpy(dst, (const uint8_t *)p->rope_freqs + x, y - x);
		return;
	}
	uint64_t rb = t->row_bytes;
	for (uint64_t r = x / rb; r * rb < y; r++) {
		uint64_t rs = r * rb, re = rs + rb;
		uint64_t lo = rs > x ? rs : x, hi = re < y ? re : y;
		if (lo == rs && hi == re) {
			convert_row(p, t, r, dst + (rs - x), sc);
		} else {
			convert_row(p, t, r, sc->row, sc);
			memcpy(dst + (lo - x), sc->row + (lo - rs), hi - lo);
		}
	}
}

/* Bytes [a, b) of file f into dst. */
static void fill_range(const struct gplan *p, uint32_t f, uint64_t a, uint64_t b, uint8_t *dst, struct scratch *sc)
{
	const struct gfile *gf = &p->f[f];
	uint64_t hl = gf->head.len, pos = a;
	if (pos < hl) {
		uint64_t e = b < hl ? b : hl;
		memcpy(dst, gf->head.p + pos, e - pos);
		pos = e;
	}
	for (uint32_t i = gf->first; i < gf->first + gf->n && pos < b; i++) {
		const struct gtensor *t = &p->t[i];
		uint64_t ts = hl + t->offset, te = ts + t->nbytes;
		uint64_t pe = i + 1 < gf->first + gf->n ? hl + p->t[i + 1].offset : gf->size; /* padding's end */
		if (pe <= pos)
			continue;
		assert(pos >= ts); /* the header and each tensor's padding reach the next tensor */
		if (pos < te) {
			uint64_t e = b < te ? b : te;
			fill_tensor(p, t, pos - ts, e - ts, dst + (pos - a), sc);
			pos = e;
		}
		if (pos < pe && pos < b) {
			uint64_t e = b < pe ? b : pe;
			memset(dst + (pos - a), 0, e - pos);
			pos = e;
		}
	}
	assert(pos == b);
}

/* ---- the pool ---- */

struct segbuf {
	uint8_t *data;	 /* SEG_BYTES, SYN_DIRECT_ALIGN-aligned */
	uint64_t filled; /* job + 1 of the segment it holds once filled; 0 before */
};

struct pool {
	pthread_mutex_t mu;
	pthread_cond_t cv_free;	 /* fillers wait for a buffer */
	pthread_cond_t cv_ready; /* the writer waits for the next segment */
	const struct gplan *p;
	uint64_t *job_first; /* per file, the number of its first segment; [n_files] = n_jobs */
	uint64_t n_jobs;
	struct segbuf *bufs; /* segment j lives in bufs[j % n_bufs] */
	uint32_t n_bufs;
	uint64_t next;	  /* the next segment to hand to a filler */
	uint64_t written; /* segments written: their buffers are free */
	bool stop;
};

static void job_range(const struct pool *pl, uint64_t j, uint32_t *f, uint64_t *a, uint64_t *b)
{
	uint32_t fi = 0;
	while (j >= pl->job_first[fi + 1])
		fi++;
	uint64_t s = j - pl->job_first[fi], size = pl->p->f[fi].size;
	*f = fi;
	*a = s * SEG_BYTES;
	*b = *a + SEG_BYTES < size ? *a + SEG_BYTES : size;
}

struct filler_arg {
	struct pool *pl;
	struct scratch sc;
};

static void *filler_main(void *arg)
{
	struct filler_arg *fa = arg;
	struct pool *pl = fa->pl;
	pthread_mutex_lock(&pl->mu);
	for (;;) {
		while (!pl->stop && pl->next < pl->n_jobs && pl->next >= pl->written + pl->n_bufs)
			pthread_cond_wait(&pl->cv_free, &pl->mu);
		if (pl->stop || pl->next == pl->n_jobs)
			break;
		uint64_t j = pl->next++;
		struct segbuf *sb = &pl->bufs[j % pl->n_bufs];
		pthread_mutex_unlock(&pl->mu);
		uint32_t f;
		uint64_t a, b;
		job_range(pl, j, &f, &a, &b);
		fill_range(pl->p, f, a, b, sb->data, &fa->sc);
		pthread_mutex_lock(&pl->mu);
		sb->filled = j + 1;
		pthread_cond_broadcast(&pl->cv_ready);
	}
	pthread_mutex_unlock(&pl->mu);
	return NULL;
}

/* ---- writing ---- */

/* Whole segments (each a multiple of SYN_DIRECT_ALIGN long and aligned) with one writev; a file
 * system that refuses O_DIRECT for them gets buffered writes, and so does what is left after a
 * short write (the next write then reports why it was short). */
static int write_segments(int fd, struct iovec *iov, int n)
{
	size_t total = 0;
	for (int i = 0; i < n; i++)
		total += iov[i].iov_len;
	ssize_t w;
	do
		w = writev(fd, iov, n);
	while (w < 0 && errno == EINTR);
	int fl = fcntl(fd, F_GETFL);
	if (w < 0 && errno == EINVAL && fl >= 0 && (fl & O_DIRECT)) {
		if (fcntl(fd, F_SETFL, fl & ~O_DIRECT) != 0)
			return -errno;
		return write_segments(fd, iov, n);
	}
	if (w < 0)
		return -errno;
	if ((size_t)w == total)
		return 0;
	if (fl >= 0 && (fl & O_DIRECT) && fcntl(fd, F_SETFL, fl & ~O_DIRECT) != 0)
		return -errno;
	size_t skip = (size_t)w;
	for (int i = 0; i < n; i++) {
		if (skip >= iov[i].iov_len) {
			skip -= iov[i].iov_len;
			continue;
		}
		int rc = syn_write_all(fd, (const uint8_t *)iov[i].iov_base + skip, iov[i].iov_len - skip);
		if (rc)
			return rc;
		skip = 0;
	}
	return 0;
}

struct progress {
	bool on;
	uint64_t total, done;
	double t0, last;
};

static void print_progress(struct progress *pr, bool final)
{
	double now = now_s();
	if (!pr->on || (!final && now - pr->last < 1.0))
		return;
	pr->last = now;
	char a[32], b[32];
	double dt = now - pr->t0;
	fprintf(stderr, "synthetic: wrote %s of %s, %.2f GB/s\n", format_size(pr->done, a, sizeof(a)),
		format_size(pr->total, b, sizeof(b)), dt > 0 ? (double)pr->done / dt / 1e9 : 0.0);
}

/* The calling thread: takes the segments in order, opens and closes the files. */
static int write_files(struct pool *pl, bool progress, struct created *cr, char *err, size_t errlen)
{
	const struct gplan *p = pl->p;
	struct progress pr = {.on = progress, .total = p->file_bytes, .t0 = now_s()};
	pr.last = pr.t0;
	int fd = -1, rc = 0;
	uint32_t f = 0;
	for (uint64_t j = 0; j < pl->n_jobs && !rc;) {
		uint32_t jf;
		uint64_t a, b;
		job_range(pl, j, &jf, &a, &b);
		if (a == 0) {
			f = jf;
			fd = syn_open_weights(p->f[f].path);
			if (fd < 0)
				return errorf(err, errlen, fd, "cannot create %s: %s", p->f[f].path, strerror(-fd));
			rc = syn_created_add(cr, p->f[f].path);
			if (rc) {
				close(fd);
				return errorf(err, errlen, rc, "out of memory");
			}
		}
		/* This segment, and the filled whole segments of the same file after it. */
		struct iovec iov[MAX_GATHER];
		int n = 0;
		uint64_t bytes = 0;
		pthread_mutex_lock(&pl->mu);
		while (pl->bufs[j % pl->n_bufs].filled != j + 1)
			pthread_cond_wait(&pl->cv_ready, &pl->mu);
		for (;;) {
			uint32_t nf;
			uint64_t na, nb;
			job_range(pl, j + n, &nf, &na, &nb);
			iov[n].iov_base = pl->bufs[(j + n) % pl->n_bufs].data;
			iov[n].iov_len = nb - na;
			bytes += nb - na;
			n++;
			if (nb - na < SEG_BYTES || n == MAX_GATHER || j + n == pl->n_jobs)
				break;
			job_range(pl, j + n, &nf, &na, &nb);
			/* Another file's, or a file's short last segment (written alone), or not filled yet. */
			if (nf != f || nb - na < SEG_BYTES || pl->bufs[(j + n) % pl->n_bufs].filled != j + n + 1)
				break;
		}
		pthread_mutex_unlock(&pl->mu);
		if (n == 1 && iov[0].iov_len < SEG_BYTES)
			rc = syn_write_direct(fd, iov[0].iov_base, iov[0].iov_len);
		else
			rc = write_segments(fd, iov, n);
		pthread_mutex_lock(&pl->mu);
		pl->written = j + (uint64_t)n;
		pthread_cond_broadcast(&pl->cv_free);
		pthread_mutex_unlock(&pl->mu);
		j += (uint64_t)n;
		pr.done += bytes;
		if (!rc && j == pl->job_first[f + 1]) { /* the file is complete */
			rc = close(fd) != 0 ? -errno : 0;
			fd = -1;
		}
		if (rc)
			errorf(err, errlen, rc, "writing %s: %s", p->f[f].path, syn_why(rc));
		else
			print_progress(&pr, j == pl->n_jobs);
	}
	if (fd >= 0)
		close(fd);
	return rc;
}

static uint32_t thread_count(const struct synth_options *o)
{
	long n = o->threads ? (long)o->threads : sysconf(_SC_NPROCESSORS_ONLN);
	return n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (uint32_t)n;
}

static int run_pool(const struct gplan *p, const struct synth_options *o, struct created *cr, char *err,
		    size_t errlen)
{
	uint32_t nt = thread_count(o);
	struct pool pl = {.p = p, .n_bufs = nt + SPARE_BUFS};
	struct filler_arg *fa = calloc(nt, sizeof(*fa));
	pthread_t *th = calloc(nt, sizeof(*th));
	pl.job_first = calloc(p->n_files + 1, sizeof(*pl.job_first));
	pl.bufs = calloc(pl.n_bufs, sizeof(*pl.bufs));
	int rc = 0;
	uint32_t started = 0;
	if (!fa || !th || !pl.job_first || !pl.bufs) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out_free;
	}
	for (uint32_t f = 0; f < p->n_files; f++)
		pl.job_first[f + 1] = pl.job_first[f] + (p->f[f].size + SEG_BYTES - 1) / SEG_BYTES;
	pl.n_jobs = pl.job_first[p->n_files];
	for (uint32_t i = 0; i < pl.n_bufs; i++) {
		if (posix_memalign((void **)&pl.bufs[i].data, SYN_DIRECT_ALIGN, SEG_BYTES) != 0) {
			pl.bufs[i].data = NULL;
			rc = errorf(err, errlen, -ENOMEM, "out of memory for %u write buffers of %llu MiB", pl.n_bufs,
				    SEG_BYTES >> 20);
			goto out_free;
		}
	}
	for (uint32_t i = 0; i < nt; i++) {
		fa[i].pl = &pl;
		fa[i].sc.f = malloc(p->max_cols * sizeof(float));
		fa[i].sc.row = malloc(p->max_row_bytes);
		if (!fa[i].sc.f || !fa[i].sc.row) {
			rc = errorf(err, errlen, -ENOMEM, "out of memory");
			goto out_free;
		}
	}
	pthread_mutex_init(&pl.mu, NULL);
	pthread_cond_init(&pl.cv_free, NULL);
	pthread_cond_init(&pl.cv_ready, NULL);
	for (; started < nt; started++) {
		rc = -pthread_create(&th[started], NULL, filler_main, &fa[started]);
		if (rc) {
			errorf(err, errlen, rc, "cannot start a converting thread: %s", strerror(-rc));
			break;
		}
	}
	if (!rc)
		rc = write_files(&pl, o->progress, cr, err, errlen);
	pthread_mutex_lock(&pl.mu);
	pl.stop = true;
	pthread_cond_broadcast(&pl.cv_free);
	pthread_mutex_unlock(&pl.mu);
	for (uint32_t i = 0; i < started; i++)
		pthread_join(th[i], NULL);
	pthread_cond_destroy(&pl.cv_ready);
	pthread_cond_destroy(&pl.cv_free);
	pthread_mutex_destroy(&pl.mu);
out_free:
	for (uint32_t i = 0; fa && i < nt; i++) {
		free(fa[i].sc.f);
		free(fa[i].sc.row);
	}
	for (uint32_t i = 0; pl.bufs && i < pl.n_bufs; i++)
		free(pl.bufs[i].data);
	free(pl.bufs);
	free(pl.job_first);
	free(th);
	free(fa);
	return rc;
}

/* ---- the directory ---- */

/* The directory the files go into and the stem they are named after ("model", or the name given
 * without .gguf). */
static int split_out(const char *out, char *dir, size_t dlen, char *stem, size_t slen)
{
	size_t n = strlen(out);
	if (n > 5 && !strcmp(out + n - 5, ".gguf")) {
		const char *slash = strrchr(out, '/');
		size_t dl = slash ? (size_t)(slash - out) : 0;
		if (slash && dl == 0)
			dl = 1; /* "/x.gguf" */
		if (snprintf(dir, dlen, "%.*s", (int)dl, slash ? out : ".") >= (int)dlen)
			return -ENAMETOOLONG;
		const char *base = slash ? slash + 1 : out;
		if (snprintf(stem, slen, "%.*s", (int)(strlen(base) - 5), base) >= (int)slen)
			return -ENAMETOOLONG;
		return 0;
	}
	if (snprintf(dir, dlen, "%s", out) >= (int)dlen)
		return -ENAMETOOLONG;
	snprintf(stem, slen, "model");
	return 0;
}

/* Is nm STEM.gguf or STEM-NNNNN-of-NNNNN.gguf (a file of a write of stem, this one's or an earlier
 * one's)? */
static bool is_stale(const char *nm, const char *stem)
{
	size_t sl = strlen(stem);
	unsigned a, b;
	char tail[16];
	return !strncmp(nm, stem, sl) &&
	       (!strcmp(nm + sl, ".gguf") ||
		(sscanf(nm + sl, "-%5u-of-%5u.%15s", &a, &b, tail) == 3 && !strcmp(tail, "gguf")));
}

static bool stale_of(const char *nm, const void *stem)
{
	return is_stale(nm, (const char *)stem);
}

int syn_gguf_existing(const char *out, char *path, size_t len)
{
	char dir[PATH_MAX], stem[NAME_MAX + 1];
	if (split_out(out, dir, sizeof(dir), stem, sizeof(stem)) != 0)
		return 0;
	return syn_find_in_dir(dir, stale_of, stem, path, len);
}

/* Removes STEM.gguf and STEM-NNNNN-of-NNNNN.gguf an earlier write left in dir. */
static int remove_stale(const char *dir, const char *stem, char *err, size_t errlen)
{
	DIR *d = opendir(dir);
	if (!d)
		return errorf(err, errlen, -errno, "cannot list %s: %s", dir, strerror(errno));
	int rc = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		const char *nm = e->d_name;
		if (!is_stale(nm, stem))
			continue;
		char path[PATH_MAX];
		if (snprintf(path, sizeof(path), "%s/%s", dir, nm) >= (int)sizeof(path))
			continue; /* not a path this writer could have made */
		if (unlink(path) != 0 && errno != ENOENT) {
			rc = errorf(err, errlen, -errno, "cannot remove the old %s: %s", path, strerror(errno));
			break;
		}
	}
	closedir(d);
	return rc;
}

int syn_gguf_write(const char *out, const struct model_config *c, const struct synth_options *o, bool tied,
		   struct synth_stats *stats, char *err, size_t errlen)
{
	double t0 = now_s();
	syn_values_init();
	struct gplan p;
	int rc = syn_gguf_plan(&p, out, c, o, tied, err, errlen);
	if (rc)
		return rc;
	struct created files = {0}, dirs = {0};
	char dir[PATH_MAX], stem[NAME_MAX + 1];
	rc = split_out(out, dir, sizeof(dir), stem, sizeof(stem));
	if (rc) {
		errorf(err, errlen, rc, "%s: path too long", out);
		goto out_plan;
	}
	rc = syn_make_dirs(dir, &dirs, err, errlen);
	if (!rc)
		rc = remove_stale(dir, stem, err, errlen);
	if (!rc)
		rc = run_pool(&p, o, &files, err, errlen);
	if (rc) {
		/* Leave nothing half-written behind: a partial file would look loadable. */
		syn_created_remove(&files, &dirs);
		goto out_plan;
	}
	if (stats) {
		memset(stats, 0, sizeof(*stats));
		stats->params = synth_param_count(c, tied);
		stats->tensor_bytes = p.tensor_bytes;
		stats->file_bytes = p.file_bytes;
		stats->n_files = p.n_files;
		stats->n_tensors = p.n;
		stats->seconds = now_s() - t0;
	}
out_plan:
	free(files.paths);
	free(dirs.paths);
	syn_gguf_plan_free(&p);
	return rc;
}

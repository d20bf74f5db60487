/* test_reader.c - reader.c: extents of a synthetic checkpoint read into memory match the
 * file, with O_DIRECT and buffered; a truncated file fails cleanly.
 *
 * Replaces open() and the preparation of reads through reader_internal.h to see the buffered
 * fallback, which this kernel's tmpfs would not show (it takes O_DIRECT since Linux 6.6). */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>
#include <liburing.h>

#include "common/util.h"
#include "services/ssd-loader/reader.h"
#include "services/ssd-loader/reader_internal.h"
#include "tests/unit/ssd-loader/loader_test_util.h"

static int fake_refuse_direct; /* open() with O_DIRECT fails with EINVAL while set */
static int fake_refuse_direct_reads; /* reads on an O_DIRECT descriptor fail with EINVAL while set */
static int fake_open_calls;

/* A file system that takes open(O_DIRECT) and refuses the reads (EINVAL): an invalid I/O
 * priority class makes io_uring fail the read of an O_DIRECT descriptor with EINVAL. */
static void fake_prep_read(struct io_uring_sqe *sqe, int fd, void *buf, unsigned nbytes, __u64 offset)
{
	io_uring_prep_read(sqe, fd, buf, nbytes, offset);
	if (fake_refuse_direct_reads && (fcntl(fd, F_GETFL) & O_DIRECT))
		sqe->ioprio = 7 << 13; /* IOPRIO_PRIO_VALUE(7, 0): no such class */
}

static int fake_open(const char *path, int flags)
{
	fake_open_calls++;
	if (fake_refuse_direct && (flags & O_DIRECT)) {
		errno = EINVAL;
		return -1;
	}
	return open(path, flags);
}

struct done_log {
	uint32_t n, n_failed;
	uint64_t tags_seen;   /* requests completed */
	char text[1024];      /* the last error text */
	int last_rc;
	bool twice;	      /* a tag completed twice */
	uint8_t *seen;	      /* per tag */
	int rc[4096];	      /* per tag: the completion's rc */
};

static void on_done(void *ctx, uint64_t tag, int rc, const char *text)
{
	struct done_log *d = ctx;
	d->n++;
	if (d->seen[tag])
		d->twice = true;
	d->seen[tag] = 1;
	if (tag < 4096)
		d->rc[tag] = rc;
	if (rc) {
		d->n_failed++;
		d->last_rc = rc;
		ck_assert_ptr_nonnull(text);
		snprintf(d->text, sizeof(d->text), "%s", text);
	} else {
		ck_assert_ptr_null(text);
	}
}

/* One buffer per group (slot_bytes, 4 KiB aligned): reads every extent into it. */
struct group_bufs {
	uint32_t n;
	void **buf;
};

static struct group_bufs alloc_bufs(const struct manifest *m)
{
	struct group_bufs b = {.n = m->n_groups, .buf = calloc(m->n_groups, sizeof(void *))};
	ck_assert_ptr_nonnull(b.buf);
	for (uint32_t g = 0; g < m->n_groups; g++) {
		size_t sz = ALIGN_UP(m->groups[g].slot_bytes, 4096);
		b.buf[g] = aligned_alloc(4096, sz);
		ck_assert_ptr_nonnull(b.buf[g]);
		memset(b.buf[g], 0xa5, sz);
	}
	return b;
}

static void free_bufs(struct group_bufs *b)
{
	for (uint32_t g = 0; g < b->n; g++)
		free(b->buf[g]);
	free(b->buf);
}

static struct reader *open_reader(const struct manifest *m, uint32_t depth, uint64_t max_read, bool buffered,
				  struct done_log *d)
{
	const char **paths = calloc(m->n_files, sizeof(*paths));
	for (uint32_t i = 0; i < m->n_files; i++)
		paths[i] = m->files[i].path;
	struct reader_params p = {.n_files = m->n_files, .paths = paths, .queue_depth = depth, .max_read = max_read,
				  .buffered = buffered};
	struct reader *r = NULL;
	char err[512];
	int rc = reader_create(&p, on_done, d, &r, err, sizeof(err));
	ck_assert_msg(rc == 0, "reader_create: %s", err);
	free(paths);
	return r;
}

/* min_length of extent e: up to the last tensor byte inside it (what loader.c computes). */
static uint64_t extent_need(const struct manifest *m, uint32_t e)
{
	const struct read_extent *x = &m->extents[e];
	const struct group_desc *gd = &m->groups[x->group];
	uint64_t need = 0;
	for (uint32_t t = gd->first_tensor; t < gd->first_tensor + gd->n_tensors; t++) {
		const struct tensor_desc *td = &m->tensors[t];
		uint64_t te = td->file_offset + td->nbytes, xe = x->file_offset + x->length;
		if (td->file_index == x->file_index && td->file_offset < xe && te > x->file_offset) {
			uint64_t end = (te < xe ? te : xe) - x->file_offset;
			need = end > need ? end : need;
		}
	}
	return need;
}

/* Submits every extent (tag = extent index) and runs until all complete. Returns failures. */
static uint32_t read_all(struct reader *r, const struct manifest *m, struct group_bufs *b, struct done_log *d)
{
	ck_assert_uint_le(m->n_extents, 4096);
	d->seen = calloc(m->n_extents, 1);
	for (uint32_t e = 0; e < m->n_extents; e++) {
		const struct read_extent *x = &m->extents[e];
		uint64_t need = extent_need(m, e);
		int rc = reader_read(r, x->file_index, x->file_offset, x->length, need,
				     (char *)b->buf[x->group] + x->slot_offset, e);
		ck_assert_int_eq(rc, 0);
	}
	while (d->n < m->n_extents) {
		int n = reader_process(r, true);
		ck_assert_int_ge(n, 0);
	}
	ck_assert(reader_idle(r));
	ck_assert(!d->twice);
	return d->n_failed;
}

static void check_all(const struct manifest *m, struct group_bufs *b)
{
	for (uint32_t g = 0; g < m->n_groups; g++)
		lt_check_group(m, g, b->buf[g]);
}

static void run_case(const char *base, uint32_t depth, uint64_t max_read, bool buffered, bool expect_direct)
{
	char *dir = th_tmpdir(base);
	char *model = lt_make_model(dir, 2);
	struct manifest *m = lt_load(model);
	struct done_log d = {0};
	struct reader *r = open_reader(m, depth, max_read, buffered, &d);
	ck_assert_int_eq(reader_file_direct(r, 0), expect_direct);
	struct group_bufs b = alloc_bufs(m);
	ck_assert_uint_eq(read_all(r, m, &b, &d), 0);
	check_all(m, &b);
	struct reader_stats st;
	reader_get_stats(r, &st);
	ck_assert_uint_eq(st.direct_files, expect_direct ? m->n_files : 0);
	ck_assert_uint_gt(st.bytes_read, m->total_tensor_bytes - 1);
	ck_assert_uint_eq(st.in_flight, 0);
	/* Each piece is at most max_read: more reads than extents when pieces are small. */
	if (max_read == 4096)
		ck_assert_uint_gt(st.reads_done, m->n_extents);
	reader_destroy(&r);
	reader_destroy(&r);
	ck_assert_ptr_null(r);
	free_bufs(&b);
	free(d.seen);
	manifest_destroy(&m);
	th_rmtree(dir);
	free(model);
	free(dir);
}

START_TEST(direct_reads_match_file)
{
	run_case("/tmp", 64, 4u << 20, false, true);
}
END_TEST

START_TEST(limit_caps_reads_in_flight)
{
	/* Live tuning: a limit under the queue depth caps the pieces in flight; raising it lets the
	 * queued ones go. The bytes are right either way. */
	char *dir = th_tmpdir("/tmp");
	char *model = lt_make_model(dir, 2);
	struct manifest *m = lt_load(model);
	struct done_log d = {0};
	struct reader *r = open_reader(m, 16, 4096, false, &d);
	ck_assert_uint_eq(reader_depth(r), 16);
	ck_assert_uint_eq(reader_limit(r), 16);
	ck_assert_int_eq(reader_set_limit(r, 0), -EINVAL);
	ck_assert_int_eq(reader_set_limit(r, 17), -EINVAL);
	ck_assert_int_eq(reader_set_limit(r, 2), 0);
	struct group_bufs b = alloc_bufs(m);
	d.seen = calloc(m->n_extents, 1);
	for (uint32_t e = 0; e < m->n_extents; e++) {
		const struct read_extent *x = &m->extents[e];
		ck_assert_int_eq(reader_read(r, x->file_index, x->file_offset, x->length, extent_need(m, e),
					     (char *)b.buf[x->group] + x->slot_offset, e),
				 0);
	}
	struct reader_stats st;
	reader_get_stats(r, &st);
	ck_assert_uint_le(st.in_flight, 2);
	ck_assert_uint_gt(st.queued, 0);
	for (int i = 0; d.n < m->n_extents / 2; i++) {
		ck_assert_int_ge(reader_process(r, true), 0);
		reader_get_stats(r, &st);
		ck_assert_uint_le(st.in_flight, 2);
	}
	ck_assert_int_eq(reader_set_limit(r, 16), 0);
	while (d.n < m->n_extents)
		ck_assert_int_ge(reader_process(r, true), 0);
	ck_assert(reader_idle(r));
	ck_assert_uint_eq(d.n_failed, 0);
	check_all(m, &b);
	reader_destroy(&r);
	free_bufs(&b);
	free(d.seen);
	manifest_destroy(&m);
	th_rmtree(dir);
	free(model);
	free(dir);
}
END_TEST

START_TEST(direct_small_pieces_shallow_queue)
{
	/* 4 KiB pieces, two in flight: requests wait in the queue and split into many reads. */
	run_case("/tmp", 2, 4096, false, true);
}
END_TEST

START_TEST(buffered_flag_on_dev_shm)
{
	run_case("/dev/shm", 8, 8192, true, false);
}
END_TEST

START_TEST(fallback_when_direct_refused)
{
	/* A file system that refuses O_DIRECT at open (EINVAL): the file is read buffered. */
	fake_refuse_direct = 1;
	run_case("/dev/shm", 16, 4u << 20, false, false);
	ck_assert_int_gt(fake_open_calls, 1);
}
END_TEST

START_TEST(fallback_when_direct_reads_refused)
{
	/* Open takes O_DIRECT, the reads are refused: every piece in flight on the O_DIRECT
	 * descriptor comes back EINVAL, not only the first; all are read again buffered. */
	fake_refuse_direct_reads = 1;
	char *dir = th_tmpdir("/tmp");
	char *model = lt_make_model(dir, 2);
	struct manifest *m = lt_load(model);
	struct done_log d = {0};
	struct reader *r = open_reader(m, 16, 4096, false, &d);
	ck_assert(reader_file_direct(r, 0));
	struct group_bufs b = alloc_bufs(m);
	uint32_t failed = read_all(r, m, &b, &d);
	ck_assert_msg(failed == 0, "%u reads failed, the last: %s", failed, d.text);
	check_all(m, &b);
	ck_assert(!reader_file_direct(r, 0));
	reader_destroy(&r);
	free_bufs(&b);
	free(d.seen);
	manifest_destroy(&m);
	th_rmtree(dir);
	free(model);
	free(dir);
}
END_TEST

START_TEST(truncated_file_fails_cleanly)
{
	char *dir = th_tmpdir("/tmp");
	char *model = lt_make_model(dir, 2);
	struct manifest *m = lt_load(model);
	/* Cut the file in the middle of its last tensor, at an unaligned size. */
	uint32_t last = 0;
	for (uint32_t t = 1; t < m->n_tensors; t++)
		if (m->tensors[t].file_offset > m->tensors[last].file_offset)
			last = t;
	uint64_t cut = m->tensors[last].file_offset + m->tensors[last].nbytes / 2 + 3;
	ck_assert_int_eq(truncate(m->files[0].path, (off_t)cut), 0);

	struct done_log *d = calloc(1, sizeof(*d));
	struct reader *r = open_reader(m, 4, 8192, false, d);
	struct group_bufs b = alloc_bufs(m);
	uint32_t failed = read_all(r, m, &b, d);
	ck_assert_uint_ge(failed, 1);
	ck_assert_int_eq(d->last_rc, -EIO);
	ck_assert_msg(strstr(d->text, m->files[0].path) != NULL, "error names the file: %s", d->text);
	ck_assert_msg(strstr(d->text, "truncated") != NULL, "error says what is wrong: %s", d->text);
	/* Exactly the extents whose tensor bytes run past the cut fail; the others read right. */
	for (uint32_t e = 0; e < m->n_extents; e++) {
		bool past = m->extents[e].file_offset + extent_need(m, e) > cut;
		ck_assert_msg(d->rc[e] == (past ? -EIO : 0), "extent %u: rc %d", e, d->rc[e]);
	}
	for (uint32_t g = 0; g < m->n_groups; g++) {
		bool whole = true;
		for (uint32_t e = m->groups[g].first_extent; e < m->groups[g].first_extent + m->groups[g].n_extents; e++)
			whole = whole && d->rc[e] == 0;
		if (whole)
			lt_check_group(m, g, b.buf[g]);
	}
	free(d->seen);
	free(d);
	reader_destroy(&r);
	free_bufs(&b);
	manifest_destroy(&m);
	th_rmtree(dir);
	free(model);
	free(dir);
}
END_TEST

START_TEST(file_changed_in_place_fails)
{
	/* A checkpoint rewritten in place after the reader opened it: every read after the change
	 * fails with -ESTALE and says so, none gives bytes of the new file as the old one's. */
	char *dir = th_tmpdir("/tmp");
	char *model = lt_make_model(dir, 2);
	struct manifest *m = lt_load(model);
	struct done_log *d = calloc(1, sizeof(*d));
	struct reader *r = open_reader(m, 4, 8192, false, d);
	struct group_bufs b = alloc_bufs(m);
	ck_assert_uint_eq(read_all(r, m, &b, d), 0);
	check_all(m, &b);
	free(d->seen);
	memset(d, 0, sizeof(*d));

	/* The same size, one byte written, a modification time of its own. */
	int fd = open(m->files[0].path, O_WRONLY);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(pwrite(fd, "x", 1, (off_t)m->tensors[0].file_offset), 1);
	struct timespec times[2] = {{.tv_nsec = UTIME_OMIT}, {.tv_sec = 1000000000, .tv_nsec = 123}};
	ck_assert_int_eq(futimens(fd, times), 0);
	close(fd);
	ck_assert_uint_eq(read_all(r, m, &b, d), m->n_extents);
	ck_assert_int_eq(d->last_rc, -ESTALE);
	ck_assert_msg(strstr(d->text, m->files[0].path) != NULL, "error names the file: %s", d->text);
	ck_assert_msg(strstr(d->text, "changed while the loader serves it") != NULL, "error says what: %s", d->text);

	/* Replaced by a rename: the reader keeps reading the file it opened (whole, the old bytes). */
	reader_destroy(&r);
	free(d->seen);
	memset(d, 0, sizeof(*d));
	manifest_destroy(&m);
	th_rmtree(dir);
	free(model);
	dir = th_tmpdir("/tmp");
	model = lt_make_model(dir, 2);
	m = lt_load(model);
	free_bufs(&b);
	b = alloc_bufs(m);
	r = open_reader(m, 4, 8192, false, d);
	char moved[PATH_MAX + 8];
	snprintf(moved, sizeof(moved), "%s.old", m->files[0].path);
	ck_assert_int_eq(rename(m->files[0].path, moved), 0);
	fd = open(m->files[0].path, O_WRONLY | O_CREAT | O_EXCL, 0600);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(write(fd, "other", 5), 5);
	close(fd);
	ck_assert_uint_eq(read_all(r, m, &b, d), 0);
	ck_assert_int_eq(rename(moved, m->files[0].path), 0); /* the old file, to compare with */
	check_all(m, &b);

	reader_destroy(&r);
	free_bufs(&b);
	free(d->seen);
	free(d);
	manifest_destroy(&m);
	th_rmtree(dir);
	free(model);
	free(dir);
}
END_TEST

START_TEST(missing_file_is_named)
{
	const char *paths[] = {"/nonexistent/dir/model.safetensors"};
	struct reader_params p = {.n_files = 1, .paths = paths, .queue_depth = 4, .max_read = 4096};
	struct reader *r = NULL;
	char err[512] = "";
	struct done_log d = {0};
	ck_assert_int_eq(reader_create(&p, on_done, &d, &r, err, sizeof(err)), -ENOENT);
	ck_assert_ptr_null(r);
	ck_assert_msg(strstr(err, paths[0]) != NULL, "%s", err);
}
END_TEST

START_TEST(bad_arguments_rejected)
{
	char *dir = th_tmpdir("/tmp");
	char *model = lt_make_model(dir, 2);
	struct manifest *m = lt_load(model);
	struct done_log d = {0};
	char err[256];
	struct reader *r = NULL;
	const char *paths[] = {m->files[0].path};
	struct reader_params bad = {.n_files = 1, .paths = paths, .queue_depth = 4, .max_read = 5000};
	ck_assert_int_eq(reader_create(&bad, on_done, &d, &r, err, sizeof(err)), -EINVAL);
	bad.max_read = 4096;
	bad.queue_depth = 0;
	ck_assert_int_eq(reader_create(&bad, on_done, &d, &r, err, sizeof(err)), -EINVAL);

	r = open_reader(m, 4, 4096, false, &d);
	void *buf = aligned_alloc(4096, 8192);
	ck_assert_int_eq(reader_read(r, 1, 0, 4096, 0, buf, 0), -EINVAL);	   /* no such file */
	ck_assert_int_eq(reader_read(r, 0, 0, 4096, 4097, buf, 0), -EINVAL);	   /* min > length */
	ck_assert_int_eq(reader_read(r, 0, 0, 0, 0, buf, 0), -EINVAL);		   /* empty */
	ck_assert_int_eq(reader_read(r, 0, 100, 4096, 0, buf, 0), -EINVAL);	   /* unaligned, O_DIRECT */
	ck_assert_int_eq(reader_read(r, 0, 0, 4096, 0, (char *)buf + 8, 0), -EINVAL);
	ck_assert(reader_idle(r));
	ck_assert_uint_eq(d.n, 0);
	reader_destroy(&r);
	free(buf);
	manifest_destroy(&m);
	th_rmtree(dir);
	free(model);
	free(dir);
}
END_TEST

START_TEST(destroy_with_reads_in_flight)
{
	/* Destroy waits for what the kernel is writing and calls back nobody. */
	char *dir = th_tmpdir("/tmp");
	char *model = lt_make_model(dir, 2);
	struct manifest *m = lt_load(model);
	struct done_log d = {0};
	d.seen = calloc(m->n_extents, 1);
	struct reader *r = open_reader(m, 2, 4096, false, &d);
	struct group_bufs b = alloc_bufs(m);
	for (uint32_t e = 0; e < m->n_extents; e++) {
		const struct read_extent *x = &m->extents[e];
		ck_assert_int_eq(reader_read(r, x->file_index, x->file_offset, x->length, 0,
					     (char *)b.buf[x->group] + x->slot_offset, e),
				 0);
	}
	ck_assert(!reader_idle(r));
	reader_destroy(&r);
	ck_assert_uint_eq(d.n, 0);
	free_bufs(&b);
	free(d.seen);
	manifest_destroy(&m);
	th_rmtree(dir);
	free(model);
	free(dir);
}
END_TEST

static Suite *reader_suite(void)
{
	Suite *s = suite_create("reader");
	TCase *tc = tcase_create("direct");
	tcase_add_test(tc, direct_reads_match_file);
	tcase_add_test(tc, direct_small_pieces_shallow_queue);
	tcase_add_test(tc, limit_caps_reads_in_flight);
	suite_add_tcase(s, tc);
	tc = tcase_create("buffered");
	tcase_add_test(tc, buffered_flag_on_dev_shm);
	tcase_add_test(tc, fallback_when_direct_refused);
	tcase_add_test(tc, fallback_when_direct_reads_refused);
	suite_add_tcase(s, tc);
	tc = tcase_create("errors");
	tcase_add_test(tc, truncated_file_fails_cleanly);
	tcase_add_test(tc, file_changed_in_place_fails);
	tcase_add_test(tc, missing_file_is_named);
	tcase_add_test(tc, bad_arguments_rejected);
	tcase_add_test(tc, destroy_with_reads_in_flight);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	/* Every reader of this program opens and reads through the fakes (each test a fork). */
	reader_hooks.open_file = fake_open;
	reader_hooks.prep_read = fake_prep_read;
	return th_run(reader_suite());
}

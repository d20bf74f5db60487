/* loader_test_util.h - what the ssd-loader tests share: a synthetic checkpoint in a temp
 * directory, and a check that a group's bytes in memory are the file's bytes.
 *
 *   char *dir = th_tmpdir("/tmp");
 *   char *model = lt_make_model(dir, 4);          // dir/model, tiny shape with 4 layers
 *   struct manifest *m = lt_load(model);
 *   lt_check_group(m, g, slot_data);               // every tensor at its slot_offset == the file
 *
 * Header-only: each test is one program. */
#ifndef LOADER_TEST_UTIL_H
#define LOADER_TEST_UTIL_H
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/manifest.h"
#include "tests/unit/common/test_helpers.h"
#include "tools/make-synthetic-model/synthetic.h"

/* Writes the "tiny" shape with n_layers layers into <dir>/model. Returns the malloc'd path. */
static inline char *lt_make_model(const char *dir, uint32_t n_layers)
{
	struct model_config cfg;
	struct synth_options o;
	char err[512];
	synth_options_default(&o);
	o.seed = 11;
	ck_assert_msg(synth_shape_config("tiny", &cfg, err, sizeof(err)) == 0, "%s", err);
	cfg.n_layers = n_layers;
	size_t len = strlen(dir) + 16;
	char *path = malloc(len);
	ck_assert_ptr_nonnull(path);
	snprintf(path, len, "%s/model", dir);
	ck_assert_msg(synth_write(path, &cfg, &o, err, sizeof(err)) == 0, "%s", err);
	return path;
}

static inline struct manifest *lt_load(const char *model)
{
	struct manifest *m = NULL;
	char err[512];
	ck_assert_msg(manifest_load(model, &m, err, sizeof(err)) == 0, "manifest_load %s: %s", model, err);
	return m;
}

/* The file's bytes of tensor t, read with pread (malloc'd). */
static inline void *lt_file_bytes(const struct manifest *m, uint32_t t)
{
	const struct tensor_desc *td = &m->tensors[t];
	void *buf = malloc(td->nbytes ? td->nbytes : 1);
	ck_assert_ptr_nonnull(buf);
	int fd = open(m->files[td->file_index].path, O_RDONLY | O_CLOEXEC);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(pread(fd, buf, td->nbytes, (off_t)td->file_offset), (ssize_t)td->nbytes);
	close(fd);
	return buf;
}

/* Every tensor of group g lies at its slot_offset in slot, byte for byte as in its file. */
static inline void lt_check_group(const struct manifest *m, uint32_t g, const void *slot)
{
	const struct group_desc *gd = &m->groups[g];
	for (uint32_t t = gd->first_tensor; t < gd->first_tensor + gd->n_tensors; t++) {
		const struct tensor_desc *td = &m->tensors[t];
		void *want = lt_file_bytes(m, t);
		ck_assert_msg(memcmp((const char *)slot + td->slot_offset, want, td->nbytes) == 0,
			      "tensor %s of group %u differs from its file", td->name, g);
		free(want);
	}
}

#endif

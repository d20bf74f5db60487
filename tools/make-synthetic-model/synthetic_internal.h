/* synthetic_internal.h - what synthetic.c (values, shapes, the plan, the JSON text),
 * synthetic_write.c (the safetensors files) and synthetic_files.c (what both writers do with
 * files) share. Not for use outside this folder. */
#ifndef PIPELINE_SYNTHETIC_INTERNAL_H
#define PIPELINE_SYNTHETIC_INTERNAL_H
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/model.h"
#include "tools/make-synthetic-model/synthetic.h"

#define INDEX_NAME  "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"

/* ---- values ---- */

/* Builds the value tables once per process (thread-safe); before any syn_fill_range. */
void syn_values_init(void);
/* Fills elements [e0, e0 + n) of a tensor into dst (dst holds element e0 first). */
void syn_fill_range(uint64_t key, bool norm, enum dtype dt, uint64_t e0, uint64_t n, void *dst);

/* ---- planning ---- */

struct stensor {
	char name[TENSOR_NAME_MAX];
	uint32_t ndim;
	uint64_t shape[2];
	uint64_t nelem, nbytes;
	bool norm;
	uint64_t key;
	uint32_t file;
	uint64_t begin; /* data offset inside its file */
};

struct plan {
	struct stensor *t; /* state_dict order */
	uint32_t n;
	uint32_t n_files;
	uint32_t *order;      /* per file, contiguous: tensor indices in name order */
	uint32_t *file_first; /* n_files + 1 */
	uint64_t *file_size;  /* per file */
	char (*file_name)[64];
	uint64_t tensor_bytes, file_bytes;
};

/* Every tensor of c with its shape, file and offset, the files' names and sizes; 0 or -errno
 * with a message (-ENOMEM, -EINVAL for options that cannot be met). Free with syn_plan_free. */
int syn_plan_build(struct plan *p, const struct model_config *c, const struct synth_options *o, bool tied, char *err,
		   size_t errlen);
void syn_plan_free(struct plan *p);

/* ---- text building ---- */

/* A growing text; oom is set (and the text left as it was) when an append runs out of memory. */
struct sbuf {
	char *p;
	size_t len, cap;
	int oom;
};

/* config.json, generation_config.json, model.safetensors.index.json (0 or -ENOMEM) and the 8-byte
 * length and JSON header of file f (padded with spaces to a multiple of 8), appended to s. */
void syn_build_config_json(struct sbuf *s, const struct model_config *c, const struct synth_options *o, bool tied);
void syn_build_generation_json(struct sbuf *s, const struct model_config *c);
int syn_build_index_json(struct sbuf *s, const struct plan *p);
void syn_build_st_header(struct sbuf *s, const struct plan *p, uint32_t f, enum dtype dt);

/* ---- files (synthetic_files.c) ---- */

#define SYN_DIRECT_ALIGN 4096u /* O_DIRECT buffers, offsets and lengths are multiples of this */

/* Paths a write created, removed again when it fails. */
struct created {
	char (*paths)[PATH_MAX];
	uint32_t n, cap;
};

/* Appends path; 0 or -ENOMEM. */
int syn_created_add(struct created *cr, const char *path);
/* Unlinks the files, then removes the directories, newest first. */
void syn_created_remove(struct created *files, struct created *dirs);
/* write() until len bytes are written; 0 or -errno. */
int syn_write_all(int fd, const void *buf, size_t len);
/* The words for a -errno in messages ("no space left on device"). */
const char *syn_why(int rc);
/* Writes dir/name with the text of s and records it in cr; 0 or -errno with a message. */
int syn_write_small_file(const char *dir, const char *name, const struct sbuf *s, struct created *cr, char *err,
			 size_t errlen);
/* mkdir -p; records each directory it made in dirs. 0 or -errno with a message. */
int syn_make_dirs(const char *dir, struct created *dirs, char *err, size_t errlen);
/* Creates (truncates) a weight file for writing, with O_DIRECT where the file system takes it.
 * Returns the descriptor or -errno. */
int syn_open_weights(const char *path);
/* Writes len bytes of buf (SYN_DIRECT_ALIGN-aligned) at fd's position. With O_DIRECT on, the
 * whole SYN_DIRECT_ALIGN blocks go direct and a tail (a file's last bytes) through the page cache
 * after O_DIRECT is switched off; a file system that refuses the direct write (EINVAL) gets a
 * buffered one. 0 or -errno. */
int syn_write_direct(int fd, const void *buf, size_t len);

#endif

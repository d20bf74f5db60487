/* synthetic_internal.h - what synthetic.c (values, shapes, the plan, the JSON text) and
 * synthetic_write.c (the files) share. Not for use outside this folder. */
#ifndef PIPELINE_SYNTHETIC_INTERNAL_H
#define PIPELINE_SYNTHETIC_INTERNAL_H
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

#endif

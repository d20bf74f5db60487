/* manifest_internal.h - what the parts of the checkpoint reader share (not for use outside them).
 *
 * Order of work (manifest.c): config.json (+ generation_config.json, manifest_config.c) -> the
 * list of safetensors files (index or single file) -> each file's header, every tensor checked
 * against the config (manifest_safetensors.c) -> canonical tensor table (group, then role) ->
 * read extents per group -> hash (manifest_layout.c).
 *
 * The tensor table is indexed by a canonical slot from the start (manifest_names.c): slot 0 is
 * the embedding, then 9 slots per layer (attn_norm, wq, wk, wv, wo, ffn_norm, w_gate, w_up,
 * w_down), then the final norm and, when untied, lm_head. That is group order then role order,
 * which is the order the manifest publishes, so no sort is needed afterwards. */
#ifndef PIPELINE_MANIFEST_INTERNAL_H
#define PIPELINE_MANIFEST_INTERNAL_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/manifest.h"

#define LAYER_ROLES 9 /* tensors per layer: 5 attention + 4 feed-forward */
#define INDEX_NAME  "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"

/* ---- configuration (manifest_config.c) ---- */

/* Reads <dir>/config.json into *cfg; returns 0 or -errno with a message naming the file. */
int mf_load_config(const char *dir, struct model_config *cfg, char *err, size_t errlen);

/* ---- tensor names (manifest_names.c) ---- */

/* Slots of the tensor table for c. */
uint32_t mf_n_slots(const struct model_config *c);
/* What slot s holds: role, group and checkpoint name. */
void mf_slot_info(const struct model_config *c, uint32_t s, uint32_t *role, uint32_t *group, char *name, size_t len);

enum name_class { NAME_SLOT = 0, NAME_IGNORE = 1, NAME_UNEXPECTED = 2 };

/* Maps a checkpoint tensor name to its slot. */
enum name_class mf_classify(const struct model_config *c, const char *name, uint32_t *slot);
/* "[a, b]" into buf. */
void mf_format_shape(char *buf, size_t len, const uint64_t *shape, uint32_t ndim);

/* ---- the safetensors files (manifest_safetensors.c) ---- */

#define NO_FILE UINT32_MAX

struct loader {
	const char *dir;
	struct manifest *m;
	char **file_names;    /* n_files, plain names inside dir */
	uint32_t *index_file; /* per slot: the file the index names, or NO_FILE (no index or not listed) */
	bool have_index;
	bool *found; /* per slot */
	char *err;
	size_t errlen;
};

/* model.safetensors.index.json: the files (sorted by name, each once) and, per tensor, its file. */
int mf_read_index(struct loader *ld, const char *path);
/* File fi's header: every tensor checked against the config and put in its slot. */
int mf_read_safetensors(struct loader *ld, uint32_t fi);

/* ---- layout (manifest_layout.c) ---- */

/* Groups, read extents and slot sizes from the tensor table. 0 or -ENOMEM. */
int mf_build_layout(struct manifest *m);
/* The hash, total_tensor_bytes and weight_dtype. */
void mf_finish_summary(struct manifest *m);

#endif

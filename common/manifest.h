/* manifest.h - a checkpoint read into a model description: a Hugging Face checkpoint directory or
 * a GGUF file.
 *
 * A Hugging Face directory: config.json, model.safetensors or model.safetensors.index.json with
 * its shards, each safetensors header, and tokenizer.json when there is one. A GGUF file (or a
 * split set of them, or a directory holding one and no safetensors checkpoint): its metadata
 * gives the configuration and the tokenizer (converted to tokenizer.json text), its tensor table
 * the tensors (manifest_gguf.c says what is accepted). Either way every tensor is checked against
 * the configuration (names, shapes, dtypes, ranges inside the files) and the groups are laid out
 * for slots: each group's
 * tensors are covered by read extents aligned to 4 KiB (what O_DIRECT needs), and each
 * tensor records where it starts in the group's slot. Only the loader opens the files;
 * the other services see the result in the weight ring.
 *
 *   char err[512];
 *   struct manifest *m;
 *   if (manifest_load("/models/llama", &m, err, sizeof(err)) != 0) { fprintf(stderr, "%s\n", err); ... }
 *   ... m->cfg, m->groups[g], m->tensors[t], m->extents[e], m->files[i]
 *   manifest_destroy(&m);
 */
#ifndef PIPELINE_MANIFEST_H
#define PIPELINE_MANIFEST_H
#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include "common/model.h"
#include "common/util.h"
#ifdef __cplusplus
extern "C" {
#endif

#define MANIFEST_ALIGN 4096u /* O_DIRECT alignment for file offsets, lengths and buffers */

/* One aligned read: [file_offset, file_offset + length) of file file_index lands at
 * slot_offset in the group's slot. file_offset, length and slot_offset are multiples of
 * MANIFEST_ALIGN; the last extent of a file may reach past its end (the read comes back short). */
struct read_extent {
	uint32_t group;
	uint32_t file_index;
	uint64_t file_offset;
	uint64_t length;
	uint64_t slot_offset;
};

struct manifest_file {
	char path[PATH_MAX]; /* absolute or as given under the model directory */
	uint64_t size;	     /* bytes */
	uint64_t data_start; /* where tensor offsets count from: safetensors 8 + header length, GGUF the
				data section's start */
	struct file_id id;   /* the file whose header was read (the loader reads the weights only from
				that same file) */
};

struct manifest {
	struct model_config cfg;
	uint32_t n_tensors, n_groups, n_extents, n_files;
	struct tensor_desc *tensors;   /* n_tensors, grouped: a group's tensors are contiguous */
	struct group_desc *groups;     /* n_groups, by group id */
	struct read_extent *extents;   /* n_extents, grouped */
	struct manifest_file *files;   /* n_files */
	uint64_t class_bytes[CLASS_COUNT]; /* slot size of each class: the largest group in it */
	uint64_t total_tensor_bytes;   /* sum of every tensor's nbytes */
	uint64_t hash;		       /* over cfg, tensors (names, shapes, dtypes) and samples of the
					  weights' bytes: HELLO checks it, KV keys start from it */
	uint32_t weight_dtype;	       /* enum dtype of the matrices (the most common one) */
	char *tokenizer_json;	       /* tokenizer.json as read (checked), NULL when the model has none; for
					  a GGUF file the text made from its tokenizer.ggml.* keys */
	uint64_t tokenizer_bytes;
	char tokenizer_path[PATH_MAX]; /* the tokenizer.json, or the GGUF file its text came from */
	char tokenizer_note[256];      /* a warning about the tokenizer, "" when none: why a GGUF file's could
					  not be converted (the model then runs on token ids only) */
	char *chat_template;	       /* the chat template (Jinja text), NULL when the model has none: a GGUF
					  file's tokenizer.chat_template, a Hugging Face directory's
					  chat_template.jinja or tokenizer_config.json's chat_template */
	char chat_template_from[PATH_MAX]; /* the file it came from */
	char chat_template_note[128];	   /* why a template the file has was left out, "" when none was */
};

/* The longest chat template a model may carry (real ones are a few KiB). */
#define MANIFEST_MAX_CHAT_TEMPLATE (1u << 20)

/* Loads the checkpoint at path: a Hugging Face checkpoint directory; a GGUF file (recognised by
 * its first bytes, whatever its name); a file of a split set named <prefix>-NNNNN-of-MMMMM.gguf
 * (every file of the set is read, from the same directory); or a directory without
 * model.safetensors(.index.json) that holds one .gguf file or one split set. Returns 0 and *out
 * (owned by the caller: manifest_destroy); on failure returns -errno (-ENOENT missing directory or
 * file, -ENOTDIR path is a file but not a GGUF file, -EINVAL corrupt or inconsistent, -ENOTSUP
 * unsupported architecture, feature or dtype, -ENOMEM, or the errno of a failed open/read) with
 * *out NULL, and writes a message naming the file and the problem into err. */
int manifest_load(const char *path, struct manifest **out, char *err, size_t errlen);

/* Reads a tokenizer.json for m (manifest_load does it for <dir>/tokenizer.json when that
 * exists), checks its ids (tokenizer_ids_scan, common/tokenizer/ids.h: JSON with a vocab, every
 * id an integer) and that every id it defines is inside the model's vocab_size, and keeps its
 * bytes in m (replacing any earlier ones, and clearing tokenizer_note). The rest of the file (merges, normalizer, ...) is the
 * runner's to check: it loads the tokenizer at its start. Returns 0, or -errno with a message
 * naming the file and the problem (-EINVAL for a file whose ids do not read, or a vocabulary
 * that disagrees). */
int manifest_attach_tokenizer(struct manifest *m, const char *path, char *err, size_t errlen);

/* Reads a chat template (Jinja text) from path for m, replacing the model's own. Returns 0, or
 * -errno with a message naming the file (-EFBIG past MANIFEST_MAX_CHAT_TEMPLATE, -EINVAL for a
 * NUL byte in it). The text is not parsed here: the runner does, at its start. */
int manifest_attach_chat_template(struct manifest *m, const char *path, char *err, size_t errlen);

/* Frees everything. Safe on NULL and twice; NULLs *m. */
void manifest_destroy(struct manifest **m);

/* Looks up the tensor of a role in a group: returns its index or -1. For ROLE_LM_HEAD with
 * tied embeddings this is the embed group's tensor. */
int manifest_find_tensor(const struct manifest *m, uint32_t group, enum tensor_role role);

#ifdef __cplusplus
}
#endif
#endif

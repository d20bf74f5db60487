/* manifest_internal.h - what the parts of the checkpoint reader share (not for use outside them).
 *
 * Order of work (manifest.c): config.json (+ generation_config.json, manifest_config.c) -> the
 * list of safetensors files (index or single file) -> each file's header, every tensor checked
 * against the config (manifest_safetensors.c) -> canonical tensor table (group, then role) ->
 * read extents per group -> hash (manifest_layout.c). A GGUF checkpoint takes the same path from
 * other inputs (manifest_gguf.c): the header of each file of the set (common/gguf.h) -> the config
 * from its llama.* keys -> its tensor table into the canonical slots -> the same layout and hash;
 * its tokenizer.ggml.* keys become tokenizer.json text (manifest_gguf_vocab.c).
 *
 * The tensor table is indexed by a canonical slot from the start (manifest_names.c): slot 0 is
 * the embedding, then the slots of each layer (attn_norm, wq, wk, wv, wo, with Qwen3's q_norm and
 * k_norm; then ffn_norm, w_gate, w_up, w_down, or for a mixture of experts ffn_norm, the router and
 * each expert's gate, up and down), then the final norm and, when untied, lm_head. That is group order then role order,
 * which is the order the manifest publishes, so no sort is needed afterwards. */
#ifndef PIPELINE_MANIFEST_INTERNAL_H
#define PIPELINE_MANIFEST_INTERNAL_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/manifest.h"

#define LAYER_ROLES 9 /* tensors per dense Llama layer: 5 attention + 4 feed-forward (GGUF's layout) */
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
/* The same for GGUF (llama.cpp's) names: token_embd.weight, blk.N.attn_norm.weight, attn_q,
 * attn_k, attn_v, attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down, output_norm.weight and
 * output.weight (ignored when the embeddings are tied). */
enum name_class mf_classify_gguf(const struct model_config *c, const char *name, uint32_t *slot);
/* The GGUF name of slot s. */
void mf_slot_name_gguf(const struct model_config *c, uint32_t s, char *name, size_t len);
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

/* ---- tokenizer.json (manifest.c) ---- */

/* Checks len bytes of tokenizer.json text (name names them in messages) as
 * manifest_attach_tokenizer does, vocab_from saying where vocab_size came from ("config.json's"),
 * and keeps them in m. Consumes *data (malloc'd, len + 1 bytes) and NULLs it, on failure too.
 * Returns 0 or -EINVAL with a message. */
int mf_attach_tokenizer_bytes(struct manifest *m, const char *name, const char *vocab_from, char **data, size_t len,
			      char *err, size_t errlen);

/* ---- GGUF (manifest_gguf.c, manifest_gguf_vocab.c) ---- */

struct gguf;

/* Looks in dir for a GGUF checkpoint: one *.gguf file, or the files of one split set. Returns 1
 * and the path of the (first) file in path, 0 when dir holds no .gguf file, or -errno with a
 * message (-EINVAL when it holds several that are not one set). */
int mf_find_gguf(const char *dir, char *path, size_t len, char *err, size_t errlen);
/* Fills m (zeroed) from the GGUF file at path, or from the whole split set path belongs to: files,
 * config, tensors, layout, hash, tokenizer. Returns 0 or -errno with a message (manifest_load's
 * codes); m is left for manifest_destroy either way. */
int mf_load_gguf(struct manifest *m, const char *path, char *err, size_t errlen);
/* tokenizer.json text made from g's tokenizer.ggml.* keys (model "gpt2" with the pre-tokenizers
 * llama-bpe, smaug-bpe and gpt-2; model "llama", SentencePiece). Returns 0 with *json (malloc'd,
 * NUL-terminated, *len bytes; owned by the caller), or 0 with *json NULL and a note saying why
 * there is none (no tokenizer in the file, an unsupported model or pre-tokenizer, keys that do not
 * make a tokenizer this project loads); -ENOMEM with a message in err. */
int mf_gguf_tokenizer_json(const struct gguf *g, char **json, size_t *len, char *note, size_t notelen, char *err,
			   size_t errlen);

/* ---- layout (manifest_layout.c) ---- */

/* Groups, read extents and slot sizes from the tensor table. 0 or -ENOMEM. */
int mf_build_layout(struct manifest *m);
/* The hash, total_tensor_bytes and weight_dtype. */
void mf_finish_summary(struct manifest *m);

#endif

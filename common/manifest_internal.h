/* manifest_internal.h - what the parts of the checkpoint reader share (not for use outside them).
 *
 * Order of work (manifest.c): config.json (+ generation_config.json, manifest_config.c) -> the
 * list of safetensors files (index or single file) -> each file's header, every tensor checked
 * against the config (manifest_safetensors.c) -> canonical tensor table (group, then role) ->
 * read extents per group -> hash (manifest_layout.c). A GGUF checkpoint takes the same path from
 * other inputs (manifest_gguf.c): the header of each file of the set (common/gguf.h) -> the config
 * from its <arch>.* keys (manifest_gguf_moe.c: Qwen3's and the experts') -> its tensor table into
 * the canonical slots, a fused expert tensor cut into one tensor per expert -> the same layout and hash;
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

#define LAYER_ROLES 9 /* tensors per dense Llama layer: 5 attention + 4 feed-forward */
#define INDEX_NAME  "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"

/* ---- small files beside the weights (manifest.c) ---- */

/* A whole regular file of at most max bytes into *out (NUL-terminated, the caller's to free);
 * what names it in messages ("tokenizer"). Returns 0 or -errno with a message. */
int mf_read_file(const char *what, const char *path, size_t max, char **out, size_t *len, char *err, size_t errlen);

/* ---- the chat template of a Hugging Face directory (manifest_chat_template.c) ---- */

/* dir's chat_template.jinja, else its tokenizer_config.json's chat_template, into m (neither:
 * nothing). Returns 0 or -errno with a message. */
int mf_hf_chat_template(struct manifest *m, const char *dir, char *err, size_t errlen);

/* ---- configuration (manifest_config.c) ---- */

/* Reads <dir>/config.json into *cfg; returns 0 or -errno with a message naming the file. */
int mf_load_config(const char *dir, struct model_config *cfg, char *err, size_t errlen);

/* ---- tensor names (manifest_names.c) ---- */

/* Slots of the tensor table for c. */
uint32_t mf_n_slots(const struct model_config *c);
/* What slot s holds: role, group and checkpoint name. */
void mf_slot_info(const struct model_config *c, uint32_t s, uint32_t *role, uint32_t *group, char *name, size_t len);

/* NAME_EXPERTS: a GGUF tensor holding one matrix of every expert of a layer (mf_classify_gguf). */
enum name_class { NAME_SLOT = 0, NAME_IGNORE = 1, NAME_UNEXPECTED = 2, NAME_EXPERTS = 3 };

/* Maps a checkpoint tensor name to its slot. */
enum name_class mf_classify(const struct model_config *c, const char *name, uint32_t *slot);
/* The same for GGUF (llama.cpp's) names: token_embd.weight, blk.N.attn_norm.weight, attn_q,
 * attn_k, attn_v, attn_output, (Qwen3) attn_q_norm, attn_k_norm, ffn_norm, then ffn_gate, ffn_up,
 * ffn_down, or with experts the router ffn_gate_inp and the fused ffn_gate_exps, ffn_up_exps,
 * ffn_down_exps (NAME_EXPERTS: *slot is expert 0's slot of that matrix, expert e's is *slot + 3e)
 * or the per-expert blk.N.ffn_gate.E.weight of older Mixtral files; output_norm.weight and
 * output.weight (ignored when the embeddings are tied). */
enum name_class mf_classify_gguf(const struct model_config *c, const char *name, uint32_t *slot);
/* The GGUF name of slot s (an expert's: the fused tensor that holds it). */
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

/* ---- GGUF tensor types (manifest_gguf.c) ---- */
struct gguf_tensor;
/* The dtype of GGUF tensor t of file g into *dt; -ENOTSUP with a message naming the file, the
 * tensor and its type when the project does not read that type. */
int mf_gguf_dtype(const struct gguf *g, const struct gguf_tensor *t, enum dtype *dt, char *err, size_t errlen);

/* ---- GGUF architectures and experts (manifest_gguf_moe.c) ---- */

/* general.architecture of g: sets c->arch (ARCH_LLAMA for "llama", ARCH_QWEN3 for "qwen3",
 * ARCH_QWEN3_MOE for "qwen3moe"), c->rope_layout (llama.cpp permutes wq/wk rows for "llama" only)
 * and MODEL_QK_NORM, and points *prefix at the arch's key prefix. Returns 0, or -ENOTSUP (another
 * architecture) / -EINVAL with a message. */
int mf_gguf_arch(const struct gguf *g, struct model_config *c, const char **prefix, char *err, size_t errlen);
/* The experts of g's model from the <prefix>.expert_* keys: none for a dense llama or qwen3
 * (expert_count absent or 0); a llama with experts becomes ARCH_MIXTRAL (experts of
 * feed_forward_length, renormalised top-k); qwen3moe needs them (expert_feed_forward_length, and
 * expert_weights_norm, true when absent, as llama.cpp computes it). c->dim and c->ffn_dim are read
 * already. Returns 0, or -EINVAL (missing or inconsistent keys) / -ENOTSUP (shared experts, dense
 * leading layers, a gating function other than softmax) with a message naming the key. */
int mf_gguf_read_experts(const struct gguf *g, const char *prefix, struct model_config *c, char *err,
			 size_t errlen);
/* The GGUF name of m's architecture ("llama", "qwen3", "qwen3moe"). */
const char *mf_gguf_arch_name(const struct model_config *c);
/* Puts the fused expert tensor ti of file fi (ggml ne = [cols, rows, n_experts]) in the slots of its
 * n_experts experts, slot0 being expert 0's (mf_classify_gguf), expert e's tensor the e-th slice of
 * rows * row_bytes bytes, named "<name>[e]". Checks its type, shape and expert count against the
 * config and that no slot is filled twice (found). Returns 0 or -EINVAL / -ENOTSUP with a message. */
int mf_gguf_place_experts(struct manifest *m, const struct gguf *g, uint32_t fi, uint64_t ti, uint32_t slot0,
			  bool *found, char *err, size_t errlen);

/* ---- layout (manifest_layout.c) ---- */

/* Groups, read extents and slot sizes from the tensor table. 0 or -ENOMEM. */
int mf_build_layout(struct manifest *m);
/* The hash, total_tensor_bytes and weight_dtype. */
void mf_finish_summary(struct manifest *m);

#endif

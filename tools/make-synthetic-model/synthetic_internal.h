/* synthetic_internal.h - what synthetic.c (values, shapes, the plan, the JSON text),
 * synthetic_write.c (the safetensors files), the GGUF writer (synthetic_gguf*.c) and
 * synthetic_files.c (what both writers do with files) share. Not for use outside this folder. */
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
/* The same elements as float32, each rounded to the element format round first: the values a
 * safetensors file of dtype round holds, widened. */
void syn_fill_f32(uint64_t key, bool norm, enum dtype round, uint64_t e0, uint64_t n, float *dst);
/* The key of a tensor's values: a hash of the seed and its (Hugging Face) name. */
uint64_t syn_tensor_key(uint64_t seed, const char *name);

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
/* Appends n bytes (sets oom when out of memory). */
void syn_sb_put(struct sbuf *s, const void *p, size_t n);

/* ---- GGUF (synthetic_gguf.c: tensors and header; synthetic_gguf_tok.c: the vocabulary;
 * synthetic_gguf_write.c: the files) ---- */

#define GGUF_ALIGNMENT 32u
#define GGUF_MAX_SPLITS 65535u /* split.count is a u16 */

/* What a GGUF tensor is, for its type and its values. */
enum gkind {
	GK_ROPE_FREQS = 0, /* F32, computed (llama3 RoPE scaling) */
	GK_EMBED = 1,
	GK_NORM = 2,
	GK_WQ = 3,
	GK_WK = 4,
	GK_WV = 5,
	GK_WO = 6,
	GK_GATE = 7,
	GK_UP = 8,
	GK_DOWN = 9,
	GK_OUTPUT = 10,
	GK_ROUTER = 11, /* ffn_gate_inp: F32 in every type, as convert_hf_to_gguf.py and llama-quantize keep it */
};

struct gtensor {
	char name[TENSOR_NAME_MAX]; /* GGUF name ("blk.0.attn_q.weight") */
	uint32_t kind;		    /* enum gkind */
	uint32_t layer;		    /* block index; 0 outside blocks */
	enum dtype type;
	uint32_t ndim;
	uint64_t ne[3];	       /* ggml order: ne[0] values per row, ne[1] rows (1 for a vector), ne[2] experts
				* (a fused expert tensor, ndim 3) or 1 */
	uint64_t row_bytes;    /* bytes of one row in type */
	uint64_t nbytes;       /* ne[2] * ne[1] * row_bytes */
	uint64_t key;	       /* the values' key (syn_tensor_key of the Hugging Face name) */
	uint32_t keys_at;      /* a fused expert tensor: expert e's key is gplan.expert_keys[keys_at + e] */
	uint32_t perm_heads;   /* wq/wk: heads whose rows are permuted (GGUF row order); else 0 */
	uint32_t file;	       /* index into gplan.f */
	uint64_t offset;       /* from its file's data section; a multiple of GGUF_ALIGNMENT */
};

struct gfile {
	char path[PATH_MAX];
	struct sbuf head; /* header: counts, key/value pairs, tensor infos, zeros up to the data section */
	uint32_t first, n; /* tensors t[first, first + n) */
	uint64_t size;	   /* bytes of the file */
};

struct gplan {
	struct gtensor *t; /* in file order */
	uint32_t n;
	struct gfile *f;
	uint32_t n_files;
	enum dtype round;  /* element format the values are rounded to first (synth_options.dtype) */
	uint32_t head_dim; /* for the wq/wk row permutation */
	float *rope_freqs; /* GK_ROPE_FREQS values (head_dim / 2), or NULL */
	uint64_t *expert_keys; /* the keys of the experts' Hugging Face tensors (gtensor.keys_at) */
	uint32_t n_expert_keys;
	uint64_t max_cols; /* widest row: the scratch a converting thread needs */
	uint64_t max_row_bytes;
	uint64_t tensor_bytes, file_bytes;
};

/* The tensors of c (types per o->gguf_type), the files (paths from out), their headers; 0 or
 * -errno with a message (-EINVAL for a matrix that cannot hold the type's blocks, a tokenizer
 * refused, options that cannot be met; -ENOMEM). Free with syn_gguf_plan_free. */
int syn_gguf_plan(struct gplan *p, const char *out, const struct model_config *c, const struct synth_options *o,
		  bool tied, char *err, size_t errlen);
void syn_gguf_plan_free(struct gplan *p);
/* ggml's number for a type (GGML_TYPE_Q4_K = 12, ...). */
uint32_t syn_ggml_type(enum dtype t);
/* Hugging Face row of GGUF row r of a tensor with rows permuted over heads of head_dim rows
 * (convert_hf_to_gguf.py's LlamaModel.permute: GGUF row h*hd + 2j + t holds Hugging Face row
 * h*hd + t*hd/2 + j). */
static inline uint64_t syn_gguf_src_row(uint64_t r, uint32_t head_dim)
{
	uint64_t h = r / head_dim, w = r % head_dim;
	return h * head_dim + (w & 1) * (head_dim / 2) + w / 2;
}

/* Writes the GGUF file(s) for c (checked) at out (synth_write's rules), tied: no output tensor.
 * 0 or -errno with a message; removes what it wrote on failure. */
/* The first file in out that a write would replace or remove (a GGUF write's STEM.gguf and
 * STEM-*-of-*.gguf; a safetensors write's weight files, config.json, generation_config.json):
 * 1 with its path, else 0. */
int syn_gguf_existing(const char *out, char *path, size_t len);
int syn_st_existing(const char *dir, char *path, size_t len);
int syn_gguf_write(const char *out, const struct model_config *c, const struct synth_options *o, bool tied,
		   struct synth_stats *stats, char *err, size_t errlen);

/* A tokenizer.json as GGUF's tokenizer.ggml.* arrays. */
struct syn_vocab {
	void *root;	   /* the parsed JSON (json_t *), which tok and merge point into */
	uint32_t n_tokens; /* the model's vocab_size: ids past the tokenizer's are "[PAD<id>]" */
	const char **tok;  /* by id */
	size_t *tok_len;
	int32_t *type; /* llama.cpp's token types: 1 normal, 3 control, 4 user defined, 5 unused */
	uint32_t n_merges;
	const char **merge; /* "a b" */
	size_t *merge_len;
	char **owned; /* strings made here ("[PAD7]", merges given as pairs) */
	uint32_t n_owned;
	int32_t eot;	   /* id of <|eot_id|>, or -1 */
	bool chat_llama3;  /* has <|start_header_id|>: write the Llama 3 chat template */
};

/* Reads the tokenizer.json at path for a model of vocab_size ids. Only Llama 3's kind is taken
 * (BPE, its split regex then ByteLevel: tokenizer.ggml.pre "llama-bpe"); -EINVAL with a message
 * naming the file for another, for ids past vocab_size, malformed JSON; -errno for a file that
 * cannot be read; -ENOMEM. */
int syn_vocab_load(const char *path, uint32_t vocab_size, struct syn_vocab *v, char *err, size_t errlen);
void syn_vocab_free(struct syn_vocab *v);
/* The Llama 3 (Instruct) chat template, as its tokenizer_config.json has it. */
extern const char syn_llama3_chat_template[];

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
/* The first entry of dir whose name match(name, ctx) takes: 1 with dir/name in path, else 0 (no
 * such entry, or no dir). */
int syn_find_in_dir(const char *dir, bool (*match)(const char *name, const void *ctx), const void *ctx, char *path,
		    size_t len);
/* Creates (truncates) a weight file for writing, with O_DIRECT where the file system takes it.
 * Returns the descriptor or -errno. */
int syn_open_weights(const char *path);
/* Writes len bytes of buf (SYN_DIRECT_ALIGN-aligned) at fd's position. With O_DIRECT on, the
 * whole SYN_DIRECT_ALIGN blocks go direct and a tail (a file's last bytes) through the page cache
 * after O_DIRECT is switched off; a file system that refuses the direct write (EINVAL) gets a
 * buffered one. 0 or -errno. */
int syn_write_direct(int fd, const void *buf, size_t len);

#endif

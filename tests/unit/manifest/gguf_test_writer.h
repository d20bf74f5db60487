/* gguf_test_writer.h - a byte-level GGUF writer for the tests of the GGUF reader (common/gguf.h,
 * common/manifest_gguf.c) and the seeds of its fuzzer: it writes what it is told, valid or not,
 * so that tests can also make files with a wrong magic, counts that lie, offsets that do not
 * align, unknown types, values of the wrong kind. Independent of the reader: its own type sizes,
 * its own encoding. Plain C (no Check): a failed allocation aborts.
 *
 *   struct gw *w = gw_new();
 *   gw_str(w, "general.architecture", "llama");
 *   gw_u32(w, "llama.block_count", 2);
 *   uint64_t ne[2] = {64, 512};                       // GGUF order: columns first
 *   gw_tensor(w, "token_embd.weight", GW_F32, 2, ne, NULL);   // NULL: a deterministic fill
 *   gw_write(w, "/tmp/x.gguf");
 *   gw_free(&w);
 *
 *   gw_tiny_llama(w, &(struct gw_llama){.type = GW_Q8_0});   // the whole tiny model's keys and tensors
 */
#ifndef GGUF_TEST_WRITER_H
#define GGUF_TEST_WRITER_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ggml type ids the tests use (the format's numbering). */
enum {
	GW_F32 = 0,
	GW_F16 = 1,
	GW_Q4_0 = 2,
	GW_Q4_1 = 3,
	GW_Q8_0 = 8,
	GW_Q4_K = 12,
	GW_Q5_K = 13,
	GW_Q6_K = 14,
	GW_IQ2_XS = 17,
	GW_I32 = 26,
	GW_BF16 = 30,
};

/* Metadata value types. */
enum {
	GW_T_UINT8 = 0,
	GW_T_INT8 = 1,
	GW_T_UINT16 = 2,
	GW_T_INT16 = 3,
	GW_T_UINT32 = 4,
	GW_T_INT32 = 5,
	GW_T_FLOAT32 = 6,
	GW_T_BOOL = 7,
	GW_T_STRING = 8,
	GW_T_ARRAY = 9,
	GW_T_UINT64 = 10,
	GW_T_INT64 = 11,
	GW_T_FLOAT64 = 12,
};

#define GW_AUTO UINT64_MAX /* an override left to the writer */

struct gw_tensor {
	char *name;
	uint32_t type, n_dims;
	uint64_t ne[4];
	unsigned char *data; /* nbytes */
	uint64_t nbytes;
	uint64_t offset;   /* GW_AUTO: the next aligned place; else written as it is */
	uint64_t info_pos; /* after gw_bytes: where this tensor's info starts in the file */
	uint64_t data_pos; /* after gw_bytes: where its data starts (when offset is GW_AUTO) */
};

struct gw {
	char magic[4];	     /* "GGUF" */
	uint32_t version;    /* 3 */
	uint64_t n_tensors;  /* GW_AUTO: the tensors added */
	uint64_t n_kv;	     /* GW_AUTO: the pairs added */
	uint32_t alignment;  /* where the writer puts data; gw_alignment() also writes the key */
	bool header_only;    /* gw_bytes stops at the data section (a fuzzer seed: the harness
				  extends the file) */
	const char *skip[8]; /* keys and tensor names the gw_* calls leave out (to replace one of
				  gw_tiny_llama's: skip it, call gw_tiny_llama, clear skip, add yours) */
	unsigned char *kv;   /* the encoded pairs */
	size_t kv_len, kv_cap;
	uint64_t kv_count;
	struct gw_tensor *t;
	uint32_t nt, t_cap;
	uint64_t data_start; /* after gw_bytes */
};

struct gw *gw_new(void);
void gw_free(struct gw **w);

/* Key/value pairs, appended in call order. */
void gw_u8(struct gw *w, const char *key, uint8_t v);
void gw_u16(struct gw *w, const char *key, uint16_t v);
void gw_u32(struct gw *w, const char *key, uint32_t v);
void gw_i32(struct gw *w, const char *key, int32_t v);
void gw_u64(struct gw *w, const char *key, uint64_t v);
void gw_i64(struct gw *w, const char *key, int64_t v);
void gw_f32(struct gw *w, const char *key, float v);
void gw_f64(struct gw *w, const char *key, double v);
void gw_bool(struct gw *w, const char *key, bool v);
void gw_str(struct gw *w, const char *key, const char *v);
/* Arrays: n strings (lengths from strlen when lens is NULL), floats, int32s. */
void gw_arr_str(struct gw *w, const char *key, const char *const *v, const size_t *lens, size_t n);
void gw_arr_f32(struct gw *w, const char *key, const float *v, size_t n);
void gw_arr_i32(struct gw *w, const char *key, const int32_t *v, size_t n);
/* general.alignment = a (uint32), and the writer aligns to it. */
void gw_alignment(struct gw *w, uint32_t a);
/* A pair of raw bytes (counted as one pair): the key is written, then type and value as given. */
void gw_raw(struct gw *w, const char *key, uint32_t type, const void *value, size_t len);

/* A tensor (ne in GGUF order, ne[0] the contiguous dimension). data: nbytes of the type's size
 * (its block table below), or NULL for a fill that depends on the name. Returns its index. An
 * unknown type gets 0 bytes. UINT32_MAX when skipped. */
uint32_t gw_tensor(struct gw *w, const char *name, uint32_t type, uint32_t n_dims, const uint64_t *ne,
		   const void *data);
/* Bytes of n elements of a type the writer knows (0 for others). */
uint64_t gw_type_bytes(uint32_t type, uint64_t n);

/* The file in memory (malloc'd, owned by the caller) and its length. */
void gw_bytes(struct gw *w, unsigned char **out, size_t *len);
/* Writes the file; returns 0 or -errno. */
int gw_write(struct gw *w, const char *path);

/* The tiny Llama the tests use: dim 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, ffn 192,
 * vocab 512, context 2048 (the "tiny" shape of make-synthetic-model). */
struct gw_llama {
	uint32_t type;	     /* the matrices' ggml type (norms are F32); 0: F32 */
	bool tied;	     /* no output.weight */
	uint32_t n_layers;   /* 0: 2 */
	uint32_t vocab;	     /* 0: 512 */
	bool no_tokens_meta; /* leave out the bos/eos ids */
};
/* The llama.* and general.* keys and every tensor of the tiny model into w. */
void gw_tiny_llama(struct gw *w, const struct gw_llama *o);
/* Only the keys, or only the tensors (a split set spreads the tensors over its files). */
void gw_tiny_llama_keys(struct gw *w, const struct gw_llama *o);
void gw_tiny_llama_tensors(struct gw *w, const struct gw_llama *o, uint32_t first, uint32_t end);
/* The number of tensors gw_tiny_llama writes. */
uint32_t gw_tiny_llama_n_tensors(const struct gw_llama *o);

/* The tokenizer.ggml.* keys of a Hugging Face tokenizer.json (path): tokens (vocab and added
 * tokens by id), token_type (2 for the model's unk_token, 3 for other special added tokens, 4 for
 * the others, 6 for <0xNN> pieces of model "llama", 1 else), merges for "gpt2", scores for "llama" (made so that the merges'
 * order comes out of them: a merge's result scores -rank, other tokens below every merge), the
 * BOS/EOS ids given (-1: none). cut > 0 keeps the vocab ids below cut and the merges among them
 * and renumbers the added tokens from cut (at most n_added of them). pre may be NULL. Returns 0,
 * or -1 when the file does not read. */
int gw_tokenizer_from_hf(struct gw *w, const char *path, const char *model, const char *pre, uint32_t cut,
			 uint32_t n_added, int32_t bos, int32_t eos);

#endif

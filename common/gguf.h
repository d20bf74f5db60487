/* gguf.h - the header of a GGUF file (llama.cpp's checkpoint format, versions 2 and 3): its
 * metadata and its tensor table, read with pread and checked, never the tensor data itself
 * (files are tens of GB; the ssd-loader reads the data through the manifest).
 *
 *   char err[512];
 *   struct gguf *g;
 *   if (gguf_open("/models/llama-3.1-8b-Q4_K_M.gguf", &g, err, sizeof(err)) != 0) { ... err ... }
 *   uint32_t layers;
 *   if (gguf_get_u32(g, "llama.block_count", &layers, err, sizeof(err)) != 0) { ... }
 *   for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
 *           const struct gguf_tensor *t = gguf_tensor(g, i);
 *           ... t->name, t->type, t->ne[0] (columns), t->ne[1] (rows), gguf_data_start(g) + t->offset
 *   }
 *   gguf_close(&g);
 *
 * The layout: "GGUF", a u32 version, u64 tensor and key counts, the key/value pairs (a string key,
 * a u32 value type, the value; strings are a u64 length and the bytes; arrays a u32 element type,
 * a u64 count and the elements), the tensor infos (name, u32 dimension count, u64 per dimension,
 * u32 ggml type, u64 offset from the data section), padding to general.alignment (default 32), the
 * data section. Little-endian; version 2 has the same layout as 3 (3 added big-endian files,
 * which are refused: nothing in the file says which order it uses but the version's bytes).
 *
 * What gguf_open checks (the file is untrusted): the magic and version; every count and length
 * against the bytes left in the file before anything is allocated for it, and against the limits
 * below; keys and tensor names non-empty, without NUL bytes and unique; booleans 0 or 1; the
 * alignment a power of two; each tensor's dimensions (1 to 4, none zero, no overflow), a known
 * ggml type whose block divides ne[0], an offset that is a multiple of the alignment and data
 * that lies inside the file. Arrays of arrays are skipped (kept as a key whose value cannot be
 * read). Types the manifest cannot use (Q4_1, IQ2_XS, ...) pass here; gguf_type_to_dtype says
 * which can.
 *
 * A struct gguf is read-only after gguf_open: any number of threads may read it at once. The
 * pointers its accessors return live until gguf_close. */
#ifndef PIPELINE_GGUF_H
#define PIPELINE_GGUF_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/util.h"
#ifdef __cplusplus
extern "C" {
#endif

#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_DIMS	       4
#define GGUF_MAX_TENSORS       (1u << 20)  /* a model with more tensors is not one we can run */
#define GGUF_MAX_KV	       (1u << 20)  /* key/value pairs */
#define GGUF_MAX_KEY	       65535u	   /* bytes of a key (the format's own limit) */
#define GGUF_MAX_NAME	       255u	   /* bytes of a tensor name (llama.cpp writes at most 63) */
#define GGUF_MAX_STRING	       (64u << 20) /* bytes of one string value (chat templates are KB) */
#define GGUF_MAX_ARRAY	       (1u << 26)  /* elements of one array (vocabularies are ~10^5) */
#define GGUF_MAX_STRINGS       (1u << 24)  /* ... of one array of strings (16 bytes each in memory, from 8 in
					      the file: a file of empty strings made four times its size) */
#define GGUF_MAX_NESTING       4	   /* arrays of arrays: levels skipped */

/* Metadata value types (the format's numbering). */
enum gguf_value_type {
	GGUF_UINT8 = 0,
	GGUF_INT8 = 1,
	GGUF_UINT16 = 2,
	GGUF_INT16 = 3,
	GGUF_UINT32 = 4,
	GGUF_INT32 = 5,
	GGUF_FLOAT32 = 6,
	GGUF_BOOL = 7,
	GGUF_STRING = 8,
	GGUF_ARRAY = 9,
	GGUF_UINT64 = 10,
	GGUF_INT64 = 11,
	GGUF_FLOAT64 = 12,
	GGUF_VALUE_TYPE_COUNT = 13,
};

/* Tensor types: ggml's ids (ggml.h's enum ggml_type). Ids ggml retired (4, 5, 31-33, 36-38) are
 * unknown, like any above GGUF_TENSOR_TYPE_COUNT. */
enum gguf_tensor_type {
	GGUF_TENSOR_F32 = 0,
	GGUF_TENSOR_F16 = 1,
	GGUF_TENSOR_Q4_0 = 2,
	GGUF_TENSOR_Q4_1 = 3,
	GGUF_TENSOR_Q5_0 = 6,
	GGUF_TENSOR_Q5_1 = 7,
	GGUF_TENSOR_Q8_0 = 8,
	GGUF_TENSOR_Q8_1 = 9,
	GGUF_TENSOR_Q2_K = 10,
	GGUF_TENSOR_Q3_K = 11,
	GGUF_TENSOR_Q4_K = 12,
	GGUF_TENSOR_Q5_K = 13,
	GGUF_TENSOR_Q6_K = 14,
	GGUF_TENSOR_Q8_K = 15,
	GGUF_TENSOR_IQ2_XXS = 16,
	GGUF_TENSOR_IQ2_XS = 17,
	GGUF_TENSOR_IQ3_XXS = 18,
	GGUF_TENSOR_IQ1_S = 19,
	GGUF_TENSOR_IQ4_NL = 20,
	GGUF_TENSOR_IQ3_S = 21,
	GGUF_TENSOR_IQ2_S = 22,
	GGUF_TENSOR_IQ4_XS = 23,
	GGUF_TENSOR_I8 = 24,
	GGUF_TENSOR_I16 = 25,
	GGUF_TENSOR_I32 = 26,
	GGUF_TENSOR_I64 = 27,
	GGUF_TENSOR_F64 = 28,
	GGUF_TENSOR_IQ1_M = 29,
	GGUF_TENSOR_BF16 = 30,
	GGUF_TENSOR_TQ1_0 = 34,
	GGUF_TENSOR_TQ2_0 = 35,
	GGUF_TENSOR_MXFP4 = 39,
	GGUF_TENSOR_TYPE_COUNT = 40,
};

struct gguf;

/* A string of the metadata: len bytes at s, followed by a NUL (the bytes may hold NULs of
 * their own, and are not checked to be UTF-8). */
struct gguf_str {
	const char *s;
	uint64_t len;
};

/* One entry of the tensor table, checked (see above). */
struct gguf_tensor {
	const char *name;	    /* NUL-terminated, no NUL inside */
	uint32_t n_dims;	    /* 1 .. GGUF_MAX_DIMS */
	uint32_t type;		    /* enum gguf_tensor_type, a known one */
	uint64_t ne[GGUF_MAX_DIMS]; /* elements per dimension, ne[0] the contiguous one (a matrix's
					 columns, ne[1] its rows); 1 past n_dims */
	uint64_t offset;	    /* bytes from the data section's start, a multiple of the alignment */
	uint64_t nbytes;	    /* bytes of data: ne[0] / block elements * block bytes * ne[1] * ... */
};

/* Reads and checks the header of the GGUF file at path (the file is closed again before this
 * returns). Returns 0 and *out (owned by the caller: gguf_close); on failure *out is NULL, err
 * holds a message naming the file and what is wrong, and the return is -ENOENT (no such file),
 * -EINVAL (not a GGUF file, truncated, or corrupt: a count, length, value or tensor entry that
 * does not hold), -ENOTSUP (a version other than 2 and 3, a big-endian file), -ENOMEM, or the
 * -errno of a failed open or read. */
int gguf_open(const char *path, struct gguf **out, char *err, size_t errlen);

/* Frees everything. Safe on NULL and twice; NULLs *g. */
void gguf_close(struct gguf **g);

/* Is the file at path a GGUF file (does it start with "GGUF")? 1 yes, 0 no (too short, other
 * bytes, not a regular file), or -errno when it cannot be opened or read. */
int gguf_probe(const char *path);

const char *gguf_path(const struct gguf *g);   /* as given to gguf_open */
uint32_t gguf_version(const struct gguf *g);   /* 2 or 3 */
uint32_t gguf_alignment(const struct gguf *g); /* general.alignment, or 32 */
uint64_t gguf_file_size(const struct gguf *g);
/* The file's identity when it was opened (util.h). */
const struct file_id *gguf_file_id(const struct gguf *g);
/* Where the data section starts: the end of the tensor infos rounded up to the alignment. May be
 * past the end of a file without tensors. */
uint64_t gguf_data_start(const struct gguf *g);

/* ---- metadata ---- */

uint64_t gguf_n_kv(const struct gguf *g);
/* Key i (< gguf_n_kv), its value type and, for an array, its element type and count. */
const char *gguf_kv_key(const struct gguf *g, uint64_t i);
enum gguf_value_type gguf_kv_type(const struct gguf *g, uint64_t i);
enum gguf_value_type gguf_kv_array_type(const struct gguf *g, uint64_t i, uint64_t *n);
/* The index of key, or -1 when the file does not have it. */
int64_t gguf_find_key(const struct gguf *g, const char *key);

/* The typed getters: each returns 0 and the value, -ENOENT when the file does not have key, or
 * -EINVAL when its value is of another kind or out of the target's range; err names the file,
 * the key and what was found (the message is written for -ENOENT too, so that a required key can
 * pass the return on; an optional one ignores it). On failure *out is unchanged. */

/* Any integer type whose value fits in the target. */
int gguf_get_u32(const struct gguf *g, const char *key, uint32_t *out, char *err, size_t errlen);
int gguf_get_u64(const struct gguf *g, const char *key, uint64_t *out, char *err, size_t errlen);
int gguf_get_i64(const struct gguf *g, const char *key, int64_t *out, char *err, size_t errlen);
/* FLOAT32 or FLOAT64 (narrowed; a finite double that overflows a float is out of range). */
int gguf_get_f32(const struct gguf *g, const char *key, float *out, char *err, size_t errlen);
int gguf_get_bool(const struct gguf *g, const char *key, bool *out, char *err, size_t errlen);
/* A STRING: *s is NUL-terminated, *len its bytes (len may be NULL). */
int gguf_get_str(const struct gguf *g, const char *key, const char **s, size_t *len, char *err, size_t errlen);
/* Arrays of STRING, FLOAT32 and INT32 (exactly: tokenizer.ggml.tokens / merges, .scores,
 * .token_type): *v points at *n elements (NULL with *n 0 for an empty array). */
int gguf_get_str_array(const struct gguf *g, const char *key, const struct gguf_str **v, uint64_t *n, char *err,
		       size_t errlen);
int gguf_get_f32_array(const struct gguf *g, const char *key, const float **v, uint64_t *n, char *err, size_t errlen);
int gguf_get_i32_array(const struct gguf *g, const char *key, const int32_t **v, uint64_t *n, char *err, size_t errlen);

/* ---- tensors ---- */

uint64_t gguf_n_tensors(const struct gguf *g);
/* Tensor i (< gguf_n_tensors), in file order. */
const struct gguf_tensor *gguf_tensor(const struct gguf *g, uint64_t i);
/* The index of the tensor called name, or -1. */
int64_t gguf_find_tensor(const struct gguf *g, const char *name);
/* Reads tensor i's data (its nbytes, which must equal len) into buf. Returns 0, -EINVAL when len
 * differs, or the -errno of a failed open or a short read, with a message. */
int gguf_read_tensor(const struct gguf *g, uint64_t i, void *buf, size_t len, char *err, size_t errlen);

/* ggml's name of a tensor type ("Q4_K", "IQ2_XS"), or "unknown". */
const char *gguf_type_name(uint32_t type);
/* "uint32", "string", "array", ...; "unknown" past the last. */
const char *gguf_value_type_name(uint32_t type);
/* Elements and bytes of one block of type (1 and the element size for F32, F16, I8, ...).
 * Returns 0, or -EINVAL for an unknown type. */
int gguf_type_block(uint32_t type, uint32_t *block_elems, uint32_t *block_bytes);
/* The dtype (common/dtype.h) a tensor type is stored as where we compute in it: F32, F16, BF16,
 * Q8_0, Q4_0, Q4_K, Q5_K, Q6_K. Returns 0, or -ENOTSUP for every other type. */
int gguf_type_to_dtype(uint32_t type, enum dtype *out);

#ifdef __cplusplus
}
#endif
#endif

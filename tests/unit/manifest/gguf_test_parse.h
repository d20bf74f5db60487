/* gguf_test_parse.h - a minimal GGUF parser for the tests of the GGUF writer, written from the
 * format's description and independent of the project's reader: the header, every key/value pair
 * (scalars, strings, arrays kept as a position in the file), the tensor infos with their byte
 * sizes, and where the data section starts. A malformed file fails the test (Check asserts).
 *
 *   struct gg *g = gg_open(path);
 *   uint32_t n = (uint32_t)kv_u(g, "llama.block_count", V_U32);
 *   const struct gti *t = tensor(g, "blk.0.attn_q.weight");
 *   const uint8_t *bytes = tdata(g, t);          // t->nbytes of them
 *   gg_close(g);
 */
#ifndef GGUF_TEST_PARSE_H
#define GGUF_TEST_PARSE_H
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"

/* GGUF's value types. */
enum { V_U8, V_I8, V_U16, V_I16, V_U32, V_I32, V_F32, V_BOOL, V_STR, V_ARR, V_U64, V_I64, V_F64 };

struct gkv {
	char key[128];
	uint32_t type;
	uint64_t u;	/* an integer or bool's value, a float's bits */
	const char *s;	/* a string's bytes */
	size_t slen;
	uint32_t atype; /* an array's element type, count, and where its first element is */
	uint64_t an;
	size_t apos;
};

struct gti {
	char name[128];
	uint32_t ndim, type; /* type: ggml's number */
	uint64_t ne[4];	     /* ggml order: ne[0] values per row */
	uint64_t off;	     /* from the data section */
	uint64_t nbytes;
};

struct gg {
	uint8_t *data; /* the whole file */
	size_t size;
	uint64_t n_kv, n_t;
	struct gkv *kv;
	struct gti *t;	     /* in file order */
	size_t infos_end;    /* where the tensor infos end */
	uint64_t data_start; /* infos_end rounded up to 32 (general.alignment, checked by the tests) */
};

/* ggml's tensor types: its number, our dtype, values and bytes per block. */
struct ggml_type {
	uint32_t ggml;
	enum dtype dt;
	uint32_t blk, bytes;
};
extern const struct ggml_type ggml_types[8];
/* The index of ggml type number ggml in ggml_types; fails the test for another. */
int type_index(uint32_t ggml);

/* Reads and parses the file at path (malloc'd; gg_close frees it). */
struct gg *gg_open(const char *path);
void gg_close(struct gg *g);
/* The pair with this key, or NULL. */
const struct gkv *kv(const struct gg *g, const char *key);
/* The value of a scalar key of the given type (fails the test if absent or of another type). */
uint64_t kv_u(const struct gg *g, const char *key, uint32_t type);
float kv_f32(const struct gg *g, const char *key);
/* The string key has the value want. */
void kv_str_is(const struct gg *g, const char *key, const char *want);
/* Element i of an array: of strings (returned, with *len), or of int32 (into *iv; returns NULL). */
const char *kv_arr_at(const struct gg *g, const char *key, uint64_t i, size_t *len, int32_t *iv);
/* The tensor named name, or NULL; its bytes. */
const struct gti *tensor(const struct gg *g, const char *name);
const uint8_t *tdata(const struct gg *g, const struct gti *t);

#endif

/* gguf.c - the GGUF header reader (gguf.h): a buffered pread reader, the metadata values (kept in
 * an arena: a vocabulary is 10^5 small strings), the tensor table and its checks, and the lookups. */
#include "common/gguf.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdalign.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf.c keeps numeric arrays as the file stores them: little-endian hosts only"
#endif

#define READ_BUF     (1u << 20) /* bytes per pread of the header */
#define ARENA_CHUNK  (1u << 20)
#define MIN_KV_BYTES 14u /* key length, one key byte, value type, a one-byte value */
#define MIN_TI_BYTES 33u /* name length, one name byte, n_dims, one dimension, type, offset */

/* ---- type tables ---- */

static const struct {
	const char *name;
	uint32_t block_elems, block_bytes; /* 0: no such type */
} tensor_types[GGUF_TENSOR_TYPE_COUNT] = {
    [GGUF_TENSOR_F32] = {"F32", 1, 4},
    [GGUF_TENSOR_F16] = {"F16", 1, 2},
    [GGUF_TENSOR_Q4_0] = {"Q4_0", 32, 18},
    [GGUF_TENSOR_Q4_1] = {"Q4_1", 32, 20},
    [GGUF_TENSOR_Q5_0] = {"Q5_0", 32, 22},
    [GGUF_TENSOR_Q5_1] = {"Q5_1", 32, 24},
    [GGUF_TENSOR_Q8_0] = {"Q8_0", 32, 34},
    [GGUF_TENSOR_Q8_1] = {"Q8_1", 32, 36},
    [GGUF_TENSOR_Q2_K] = {"Q2_K", 256, 84},
    [GGUF_TENSOR_Q3_K] = {"Q3_K", 256, 110},
    [GGUF_TENSOR_Q4_K] = {"Q4_K", 256, 144},
    [GGUF_TENSOR_Q5_K] = {"Q5_K", 256, 176},
    [GGUF_TENSOR_Q6_K] = {"Q6_K", 256, 210},
    [GGUF_TENSOR_Q8_K] = {"Q8_K", 256, 292},
    [GGUF_TENSOR_IQ2_XXS] = {"IQ2_XXS", 256, 66},
    [GGUF_TENSOR_IQ2_XS] = {"IQ2_XS", 256, 74},
    [GGUF_TENSOR_IQ3_XXS] = {"IQ3_XXS", 256, 98},
    [GGUF_TENSOR_IQ1_S] = {"IQ1_S", 256, 50},
    [GGUF_TENSOR_IQ4_NL] = {"IQ4_NL", 32, 18},
    [GGUF_TENSOR_IQ3_S] = {"IQ3_S", 256, 110},
    [GGUF_TENSOR_IQ2_S] = {"IQ2_S", 256, 82},
    [GGUF_TENSOR_IQ4_XS] = {"IQ4_XS", 256, 136},
    [GGUF_TENSOR_I8] = {"I8", 1, 1},
    [GGUF_TENSOR_I16] = {"I16", 1, 2},
    [GGUF_TENSOR_I32] = {"I32", 1, 4},
    [GGUF_TENSOR_I64] = {"I64", 1, 8},
    [GGUF_TENSOR_F64] = {"F64", 1, 8},
    [GGUF_TENSOR_IQ1_M] = {"IQ1_M", 256, 56},
    [GGUF_TENSOR_BF16] = {"BF16", 1, 2},
    [GGUF_TENSOR_TQ1_0] = {"TQ1_0", 256, 54},
    [GGUF_TENSOR_TQ2_0] = {"TQ2_0", 256, 66},
    [GGUF_TENSOR_MXFP4] = {"MXFP4", 32, 17},
};

static const char *const value_type_names[GGUF_VALUE_TYPE_COUNT] = {
    "uint8", "int8",   "uint16", "int16",  "uint32", "int32",	"float32",
    "bool",  "string", "array",	 "uint64", "int64",  "float64",
};

/* Bytes of one scalar of type t; 0 for STRING and ARRAY. */
static uint32_t scalar_size(uint32_t t)
{
	static const uint8_t size[GGUF_VALUE_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
	return t < GGUF_VALUE_TYPE_COUNT ? size[t] : 0;
}

/* The fewest bytes an element of type t takes in the file. */
static uint32_t min_size(uint32_t t)
{
	return t == GGUF_STRING ? 8 : t == GGUF_ARRAY ? 12 : scalar_size(t);
}

const char *gguf_type_name(uint32_t type)
{
	return type < GGUF_TENSOR_TYPE_COUNT && tensor_types[type].name ? tensor_types[type].name : "unknown";
}

const char *gguf_value_type_name(uint32_t type)
{
	return type < GGUF_VALUE_TYPE_COUNT ? value_type_names[type] : "unknown";
}

int gguf_type_block(uint32_t type, uint32_t *block_elems, uint32_t *block_bytes)
{
	if (type >= GGUF_TENSOR_TYPE_COUNT || !tensor_types[type].name)
		return -EINVAL;
	*block_elems = tensor_types[type].block_elems;
	*block_bytes = tensor_types[type].block_bytes;
	return 0;
}

int gguf_type_to_dtype(uint32_t type, enum dtype *out)
{
	switch (type) {
	case GGUF_TENSOR_F32:
		*out = DT_F32;
		return 0;
	case GGUF_TENSOR_F16:
		*out = DT_F16;
		return 0;
	case GGUF_TENSOR_BF16:
		*out = DT_BF16;
		return 0;
	case GGUF_TENSOR_Q8_0:
		*out = DT_Q8_0;
		return 0;
	case GGUF_TENSOR_Q4_0:
		*out = DT_Q4_0;
		return 0;
	case GGUF_TENSOR_Q4_K:
		*out = DT_Q4_K;
		return 0;
	case GGUF_TENSOR_Q5_K:
		*out = DT_Q5_K;
		return 0;
	case GGUF_TENSOR_Q6_K:
		*out = DT_Q6_K;
		return 0;
	default:
		return -ENOTSUP;
	}
}

/* ---- the parsed file ---- */

struct chunk {
	struct chunk *next;
	size_t used, cap;
	alignas(max_align_t) unsigned char data[];
};

struct kv {
	const char *key;
	uint32_t type;
	uint32_t arr_type; /* arrays: the element type */
	uint64_t n;	   /* STRING: bytes; ARRAY: elements */
	union {
		uint64_t u; /* unsigned integers and bool */
		int64_t i;  /* signed integers */
		double d;   /* floats */
	} v;
	void *p; /* STRING: the bytes and a NUL; ARRAY of STRING: n struct gguf_str; ARRAY of numbers: n
		    elements as the file stores them; ARRAY of ARRAY: NULL (skipped) */
};

struct name_index {
	const char *s;
	uint32_t i;
};

struct gguf {
	char *path;
	uint32_t version, alignment;
	uint64_t size, data_start;
	struct file_id id; /* the file as opened */
	uint64_t n_kv, n_tensors;
	struct kv *kv;
	struct gguf_tensor *tensors;
	struct name_index *kv_sorted, *t_sorted; /* by key / name, for bsearch */
	struct chunk *arena;
};

static void *arena_alloc(struct gguf *g, size_t n)
{
	n = ALIGN_UP(n ? n : 1, (size_t)16);
	struct chunk *c = g->arena;
	if (!c || c->cap - c->used < n) {
		size_t cap = n > ARENA_CHUNK ? n : ARENA_CHUNK;
		c = malloc(sizeof(*c) + cap);
		if (!c)
			return NULL;
		c->used = 0;
		c->cap = cap;
		c->next = g->arena;
		g->arena = c;
	}
	void *p = c->data + c->used;
	c->used += n;
	return p;
}

void gguf_close(struct gguf **gp)
{
	if (!gp || !*gp)
		return;
	struct gguf *g = *gp;
	while (g->arena) {
		struct chunk *next = g->arena->next;
		free(g->arena);
		g->arena = next;
	}
	free(g->kv);
	free(g->tensors);
	free(g->kv_sorted);
	free(g->t_sorted);
	free(g->path);
	free(g);
	*gp = NULL;
}

/* ---- the reader ---- */

struct rd {
	int fd;
	struct gguf *g;
	uint64_t size, pos;
	unsigned char *buf;
	uint64_t buf_off;
	size_t buf_len;
	char ctx[160]; /* what is being read, for messages */
	char *err;
	size_t errlen;
};

static int truncated(struct rd *r, uint64_t need)
{
	return errorf(r->err, r->errlen, -EINVAL,
		      "%s: truncated: %s needs %" PRIu64 " bytes at offset %" PRIu64 ", but the file ends at %" PRIu64,
		      r->g->path, r->ctx, need, r->pos, r->size);
}

static int rd_bytes(struct rd *r, void *dst, uint64_t n)
{
	if (n > r->size - r->pos)
		return truncated(r, n);
	unsigned char *d = dst;
	while (n) {
		if (r->pos < r->buf_off || r->pos >= r->buf_off + r->buf_len) {
			uint64_t want = r->size - r->pos < READ_BUF ? r->size - r->pos : READ_BUF;
			ssize_t got;
			do
				got = pread(r->fd, r->buf, (size_t)want, (off_t)r->pos);
			while (got < 0 && errno == EINTR);
			if (got <= 0)
				return errorf(r->err, r->errlen, got < 0 ? -errno : -EIO,
					      "%s: reading %s at offset %" PRIu64 ": %s", r->g->path, r->ctx, r->pos,
					      got < 0 ? strerror(errno) : "unexpected end of file");
			r->buf_off = r->pos;
			r->buf_len = (size_t)got;
		}
		size_t k = (size_t)(r->buf_off + r->buf_len - r->pos);
		if (k > n)
			k = (size_t)n;
		memcpy(d, r->buf + (r->pos - r->buf_off), k);
		d += k;
		r->pos += k;
		n -= k;
	}
	return 0;
}

static int rd_skip(struct rd *r, uint64_t n)
{
	if (n > r->size - r->pos)
		return truncated(r, n);
	r->pos += n;
	return 0;
}

static int rd_u32(struct rd *r, uint32_t *v)
{
	unsigned char b[4];
	int rc = rd_bytes(r, b, 4);
	if (!rc)
		*v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
	return rc;
}

static int rd_u64(struct rd *r, uint64_t *v)
{
	unsigned char b[8];
	int rc = rd_bytes(r, b, 8);
	if (!rc) {
		*v = 0;
		for (int i = 7; i >= 0; i--)
			*v = *v << 8 | b[i];
	}
	return rc;
}

/* A string of at most max bytes into the arena (NUL-terminated). what: "key", "string", ... */
static int rd_string(struct rd *r, uint64_t max, const char *what, struct gguf_str *out)
{
	uint64_t len;
	int rc = rd_u64(r, &len);
	if (rc)
		return rc;
	if (len > max)
		return errorf(r->err, r->errlen, -EINVAL,
			      "%s: %s: a %s of %" PRIu64 " bytes (at most %" PRIu64 " are allowed)", r->g->path, r->ctx,
			      what, len, max);
	if (len > r->size - r->pos)
		return truncated(r, len);
	if (len == 0) { /* one "" for every empty string: no arena bytes */
		out->s = "";
		out->len = 0;
		return 0;
	}
	char *p = arena_alloc(r->g, (size_t)len + 1);
	if (!p)
		return errorf(r->err, r->errlen, -ENOMEM, "%s: out of memory reading %s", r->g->path, r->ctx);
	rc = rd_bytes(r, p, len);
	if (rc)
		return rc;
	p[len] = 0;
	out->s = p;
	out->len = len;
	return 0;
}

/* An array's element type and count, checked against the types, the limit and the bytes left. */
static int rd_array_head(struct rd *r, uint32_t *type, uint64_t *n)
{
	int rc = rd_u32(r, type);
	if (!rc)
		rc = rd_u64(r, n);
	if (rc)
		return rc;
	if (*type >= GGUF_VALUE_TYPE_COUNT)
		return errorf(r->err, r->errlen, -EINVAL, "%s: %s: an array of unknown value type %u", r->g->path,
			      r->ctx, *type);
	if (*n > GGUF_MAX_ARRAY)
		return errorf(r->err, r->errlen, -EINVAL,
			      "%s: %s: an array of %" PRIu64 " elements (at most %u are allowed)", r->g->path, r->ctx,
			      *n, GGUF_MAX_ARRAY);
	if (*n * min_size(*type) > r->size - r->pos)
		return errorf(r->err, r->errlen, -EINVAL,
			      "%s: truncated: %s is an array of %" PRIu64 " %s values, more than the %" PRIu64
			      " bytes left in the file hold",
			      r->g->path, r->ctx, *n, gguf_value_type_name(*type), r->size - r->pos);
	return 0;
}

/* Skips a value of type t inside an array of arrays, depth levels deep. */
static int skip_value(struct rd *r, uint32_t t, unsigned depth)
{
	uint64_t n;
	if (t == GGUF_STRING) {
		int rc = rd_u64(r, &n);
		return rc ? rc : rd_skip(r, n);
	}
	if (t != GGUF_ARRAY)
		return rd_skip(r, scalar_size(t));
	if (depth >= GGUF_MAX_NESTING)
		return errorf(r->err, r->errlen, -EINVAL, "%s: %s: arrays nested more than %d deep", r->g->path, r->ctx,
			      GGUF_MAX_NESTING);
	uint32_t et;
	int rc = rd_array_head(r, &et, &n);
	if (rc)
		return rc;
	if (et != GGUF_STRING && et != GGUF_ARRAY)
		return rd_skip(r, n * scalar_size(et));
	for (uint64_t i = 0; i < n && !rc; i++)
		rc = skip_value(r, et, depth + 1);
	return rc;
}

static int check_bool(struct rd *r, const unsigned char *b, uint64_t n)
{
	for (uint64_t i = 0; i < n; i++)
		if (b[i] > 1)
			return errorf(r->err, r->errlen, -EINVAL, "%s: %s: a bool of value %u (must be 0 or 1)",
				      r->g->path, r->ctx, b[i]);
	return 0;
}

static int read_array(struct rd *r, struct kv *kv)
{
	uint32_t et;
	uint64_t n;
	int rc = rd_array_head(r, &et, &n);
	if (rc)
		return rc;
	kv->arr_type = et;
	kv->n = n;
	if (et == GGUF_ARRAY) { /* nobody reads these: skipped */
		for (uint64_t i = 0; i < n && !rc; i++)
			rc = skip_value(r, et, 1);
		return rc;
	}
	if (et == GGUF_STRING) {
		if (n > GGUF_MAX_STRINGS)
			return errorf(r->err, r->errlen, -EINVAL,
				      "%s: %s: an array of %" PRIu64 " strings (at most %u are allowed)", r->g->path, r->ctx, n,
				      GGUF_MAX_STRINGS);
		struct gguf_str *v = arena_alloc(r->g, (size_t)n * sizeof(*v));
		if (!v)
			return errorf(r->err, r->errlen, -ENOMEM, "%s: out of memory reading %s", r->g->path, r->ctx);
		for (uint64_t i = 0; i < n && !rc; i++)
			rc = rd_string(r, GGUF_MAX_STRING, "string", &v[i]);
		kv->p = v;
		return rc;
	}
	uint64_t bytes = n * scalar_size(et);
	unsigned char *p = arena_alloc(r->g, (size_t)bytes);
	if (!p)
		return errorf(r->err, r->errlen, -ENOMEM, "%s: out of memory reading %s", r->g->path, r->ctx);
	rc = rd_bytes(r, p, bytes);
	if (!rc && et == GGUF_BOOL)
		rc = check_bool(r, p, n);
	kv->p = p;
	return rc;
}

static int read_scalar(struct rd *r, struct kv *kv)
{
	unsigned char b[8] = {0};
	uint32_t size = scalar_size(kv->type);
	int rc = rd_bytes(r, b, size);
	if (rc)
		return rc;
	uint64_t u = 0;
	for (int i = (int)size - 1; i >= 0; i--)
		u = u << 8 | b[i];
	switch (kv->type) {
	case GGUF_INT8:
		kv->v.i = (int8_t)u;
		break;
	case GGUF_INT16:
		kv->v.i = (int16_t)u;
		break;
	case GGUF_INT32:
		kv->v.i = (int32_t)u;
		break;
	case GGUF_INT64:
		kv->v.i = (int64_t)u;
		break;
	case GGUF_FLOAT32: {
		float f;
		uint32_t w = (uint32_t)u;
		memcpy(&f, &w, 4);
		kv->v.d = f;
		break;
	}
	case GGUF_FLOAT64:
		memcpy(&kv->v.d, &u, 8);
		break;
	case GGUF_BOOL:
		rc = check_bool(r, b, 1);
		kv->v.u = u;
		break;
	default:
		kv->v.u = u;
	}
	return rc;
}

static int has_nul(const struct gguf_str *s)
{
	return strlen(s->s) != s->len;
}

/* The name of item i (what: "key/value pair" or "tensor info"; field: "key" or "name"; label: the
 * string's name in a length error): at most max bytes, not empty, without a NUL inside. */
static int rd_name(struct rd *r, uint64_t max, const char *what, const char *field, const char *label, uint64_t i,
		   struct gguf_str *out)
{
	snprintf(r->ctx, sizeof(r->ctx), "%s %" PRIu64, what, i);
	int rc = rd_string(r, max, label, out);
	if (rc)
		return rc;
	if (!out->len || has_nul(out))
		return errorf(r->err, r->errlen, -EINVAL, "%s: %s %" PRIu64 " has an %s %s", r->g->path, what, i,
			      out->len ? "invalid (NUL inside)" : "empty", field);
	return 0;
}

static int read_kv(struct rd *r, uint64_t i)
{
	struct kv *kv = &r->g->kv[i];
	struct gguf_str key;
	int rc = rd_name(r, GGUF_MAX_KEY, "key/value pair", "key", "key", i, &key);
	if (rc)
		return rc;
	kv->key = key.s;
	snprintf(r->ctx, sizeof(r->ctx), "the value of key %.100s", key.s);
	rc = rd_u32(r, &kv->type);
	if (rc)
		return rc;
	if (kv->type >= GGUF_VALUE_TYPE_COUNT)
		return errorf(r->err, r->errlen, -EINVAL, "%s: key %.100s has unknown value type %u", r->g->path, key.s,
			      kv->type);
	if (kv->type == GGUF_STRING) {
		struct gguf_str s;
		rc = rd_string(r, GGUF_MAX_STRING, "string", &s);
		kv->p = (void *)s.s;
		kv->n = s.len;
		return rc;
	}
	if (kv->type == GGUF_ARRAY)
		return read_array(r, kv);
	return read_scalar(r, kv);
}

static int read_tensor_info(struct rd *r, uint64_t i)
{
	struct gguf_tensor *t = &r->g->tensors[i];
	struct gguf_str name;
	int rc = rd_name(r, GGUF_MAX_NAME, "tensor info", "name", "tensor name", i, &name);
	if (rc)
		return rc;
	t->name = name.s;
	snprintf(r->ctx, sizeof(r->ctx), "the info of tensor %s", name.s);
	rc = rd_u32(r, &t->n_dims);
	if (rc)
		return rc;
	if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
		return errorf(r->err, r->errlen, -EINVAL, "%s: tensor %s has %u dimensions (1 to %d are allowed)",
			      r->g->path, t->name, t->n_dims, GGUF_MAX_DIMS);
	for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
		t->ne[d] = 1;
		if (d < t->n_dims && (rc = rd_u64(r, &t->ne[d])) != 0)
			return rc;
		if (t->ne[d] == 0 || t->ne[d] > INT64_MAX)
			return errorf(r->err, r->errlen, -EINVAL,
				      "%s: tensor %s: dimension %u is %" PRIu64 " (must be 1 to 2^63-1)", r->g->path,
				      t->name, d, t->ne[d]);
	}
	rc = rd_u32(r, &t->type);
	if (!rc)
		rc = rd_u64(r, &t->offset);
	if (rc)
		return rc;
	uint32_t be, bb;
	if (gguf_type_block(t->type, &be, &bb) != 0)
		return errorf(r->err, r->errlen, -EINVAL, "%s: tensor %s has unknown ggml type %u", r->g->path, t->name,
			      t->type);
	if (t->ne[0] % be)
		return errorf(r->err, r->errlen, -EINVAL,
			      "%s: tensor %s: %" PRIu64 " columns are not a whole number of %s blocks (%u values each)",
			      r->g->path, t->name, t->ne[0], gguf_type_name(t->type), be);
	uint64_t elems = t->ne[0], bytes = t->ne[0] / be * bb;
	for (uint32_t d = 1; d < GGUF_MAX_DIMS; d++)
		if (__builtin_mul_overflow(elems, t->ne[d], &elems) || __builtin_mul_overflow(bytes, t->ne[d], &bytes))
			return errorf(r->err, r->errlen, -EINVAL, "%s: tensor %s: the shape overflows", r->g->path,
				      t->name);
	if (elems > INT64_MAX || bytes > INT64_MAX)
		return errorf(r->err, r->errlen, -EINVAL, "%s: tensor %s: the shape overflows", r->g->path, t->name);
	t->nbytes = bytes;
	return 0;
}

/* Checks tensor t's place once the data section's start is known. */
static int check_tensor_data(const struct gguf *g, const struct gguf_tensor *t, char *err, size_t errlen)
{
	if (t->offset % g->alignment)
		return errorf(err, errlen, -EINVAL,
			      "%s: tensor %s: offset %" PRIu64 " is not a multiple of the alignment %u", g->path,
			      t->name, t->offset, g->alignment);
	if (g->data_start > g->size || t->offset > g->size - g->data_start ||
	    t->nbytes > g->size - g->data_start - t->offset) {
		return errorf(err, errlen, -EINVAL,
			      "%s: tensor %s: its %" PRIu64 " bytes at offset %" PRIu64 " of the data section (which starts "
			      "at byte %" PRIu64 ") run past the end of the file (%" PRIu64
			      " bytes): the file is truncated or the tensor table is corrupt",
			      g->path, t->name, t->nbytes, t->offset, g->data_start, g->size);
	}
	return 0;
}

static int cmp_name(const void *a, const void *b)
{
	return strcmp(((const struct name_index *)a)->s, ((const struct name_index *)b)->s);
}

/* Sorts n names for bsearch; a name given twice is an error (what: "key", "tensor"). */
static int sort_names(struct gguf *g, struct name_index *v, uint64_t n, const char *what, char *err, size_t errlen)
{
	qsort(v, (size_t)n, sizeof(*v), cmp_name);
	for (uint64_t i = 1; i < n; i++)
		if (!strcmp(v[i - 1].s, v[i].s))
			return errorf(err, errlen, -EINVAL, "%s: %s %.200s appears twice", g->path, what, v[i].s);
	return 0;
}

static int read_header(struct rd *r)
{
	struct gguf *g = r->g;
	char magic[4];
	if (r->size < 4 || rd_bytes(r, magic, 4) != 0 || memcmp(magic, "GGUF", 4))
		return errorf(r->err, r->errlen, -EINVAL, "%s: not a GGUF file (it does not start with \"GGUF\")",
			      g->path);
	snprintf(r->ctx, sizeof(r->ctx), "the header");
	int rc = rd_u32(r, &g->version);
	if (rc)
		return rc;
	if (g->version == 0x02000000u || g->version == 0x03000000u)
		return errorf(r->err, r->errlen, -ENOTSUP,
			      "%s: a big-endian GGUF file (version %u byte-swapped): not "
			      "supported",
			      g->path, g->version >> 24);
	if (g->version != 2 && g->version != 3)
		return errorf(r->err, r->errlen, -ENOTSUP,
			      "%s: GGUF version %u is not supported (versions 2 and 3 are)", g->path, g->version);
	rc = rd_u64(r, &g->n_tensors);
	if (!rc)
		rc = rd_u64(r, &g->n_kv);
	if (rc)
		return rc;
	if (g->n_tensors > GGUF_MAX_TENSORS || g->n_kv > GGUF_MAX_KV)
		return errorf(r->err, r->errlen, -EINVAL,
			      "%s: the header claims %" PRIu64 " tensors and %" PRIu64
			      " key/value pairs (at most %u of each are allowed): the file is corrupt",
			      g->path, g->n_tensors, g->n_kv, GGUF_MAX_TENSORS);
	if (g->n_tensors * MIN_TI_BYTES + g->n_kv * MIN_KV_BYTES > r->size - r->pos)
		return errorf(r->err, r->errlen, -EINVAL,
			      "%s: truncated: %" PRIu64 " tensors and %" PRIu64
			      " key/value pairs cannot fit in the %" PRIu64 " bytes of the file",
			      g->path, g->n_tensors, g->n_kv, r->size);
	g->kv = calloc(g->n_kv ? g->n_kv : 1, sizeof(*g->kv));
	g->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof(*g->tensors));
	g->kv_sorted = calloc(g->n_kv ? g->n_kv : 1, sizeof(*g->kv_sorted));
	g->t_sorted = calloc(g->n_tensors ? g->n_tensors : 1, sizeof(*g->t_sorted));
	if (!g->kv || !g->tensors || !g->kv_sorted || !g->t_sorted)
		return errorf(r->err, r->errlen, -ENOMEM, "%s: out of memory", g->path);
	for (uint64_t i = 0; i < g->n_kv; i++) {
		rc = read_kv(r, i);
		if (rc)
			return rc;
		g->kv_sorted[i] = (struct name_index){g->kv[i].key, (uint32_t)i};
	}
	rc = sort_names(g, g->kv_sorted, g->n_kv, "key", r->err, r->errlen);
	if (rc)
		return rc;
	g->alignment = GGUF_DEFAULT_ALIGNMENT;
	if (gguf_find_key(g, "general.alignment") >= 0) {
		uint32_t a = 0;
		rc = gguf_get_u32(g, "general.alignment", &a, r->err, r->errlen);
		if (rc)
			return rc;
		if (a == 0 || (a & (a - 1)))
			return errorf(r->err, r->errlen, -EINVAL, "%s: general.alignment %u is not a power of two",
				      g->path, a);
		g->alignment = a;
	}
	for (uint64_t i = 0; i < g->n_tensors; i++) {
		rc = read_tensor_info(r, i);
		if (rc)
			return rc;
		g->t_sorted[i] = (struct name_index){g->tensors[i].name, (uint32_t)i};
	}
	rc = sort_names(g, g->t_sorted, g->n_tensors, "tensor", r->err, r->errlen);
	if (rc)
		return rc;
	/* pos < 2^63 (the file's size), so rounding up cannot wrap. */
	g->data_start = ALIGN_UP(r->pos, (uint64_t)g->alignment);
	for (uint64_t i = 0; i < g->n_tensors; i++) {
		rc = check_tensor_data(g, &g->tensors[i], r->err, r->errlen);
		if (rc)
			return rc;
	}
	return 0;
}

int gguf_open(const char *path, struct gguf **out, char *err, size_t errlen)
{
	assert(path && out);
	*out = NULL;
	struct gguf *g = calloc(1, sizeof(*g));
	if (!g || !(g->path = strdup(path))) {
		free(g);
		return errorf(err, errlen, -ENOMEM, "%s: out of memory", path);
	}
	struct rd r = {.fd = -1, .g = g, .err = err, .errlen = errlen};
	int rc;
	r.fd = open(path, O_RDONLY | O_CLOEXEC);
	if (r.fd < 0) {
		rc = -errno;
		errorf(err, errlen, rc, "%s: cannot open: %s", path, strerror(-rc));
		goto out_free;
	}
	struct stat st;
	if (fstat(r.fd, &st) != 0) {
		rc = errorf(err, errlen, -errno, "%s: cannot stat: %s", path, strerror(errno));
		goto out_close;
	}
	if (!S_ISREG(st.st_mode)) {
		rc = errorf(err, errlen, -EINVAL, "%s: not a regular file", path);
		goto out_close;
	}
	g->size = r.size = (uint64_t)st.st_size;
	file_id_of(&st, &g->id);
	r.buf = malloc(r.size < READ_BUF ? (size_t)r.size + 1 : READ_BUF);
	if (!r.buf) {
		rc = errorf(err, errlen, -ENOMEM, "%s: out of memory", path);
		goto out_close;
	}
	rc = read_header(&r);
	free(r.buf);
out_close:
	close(r.fd);
out_free:
	if (rc)
		gguf_close(&g);
	*out = g;
	return rc;
}

int gguf_probe(const char *path)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	struct stat st;
	char magic[4];
	int rc = 0;
	if (fstat(fd, &st) != 0)
		rc = -errno;
	else if (S_ISREG(st.st_mode) && pread(fd, magic, 4, 0) == 4 && !memcmp(magic, "GGUF", 4))
		rc = 1;
	close(fd);
	return rc;
}

/* ---- accessors ---- */

const struct file_id *gguf_file_id(const struct gguf *g)
{
	return &g->id;
}

const char *gguf_path(const struct gguf *g)
{
	return g->path;
}

uint32_t gguf_version(const struct gguf *g)
{
	return g->version;
}

uint32_t gguf_alignment(const struct gguf *g)
{
	return g->alignment;
}

uint64_t gguf_file_size(const struct gguf *g)
{
	return g->size;
}

uint64_t gguf_data_start(const struct gguf *g)
{
	return g->data_start;
}

uint64_t gguf_n_kv(const struct gguf *g)
{
	return g->n_kv;
}

const char *gguf_kv_key(const struct gguf *g, uint64_t i)
{
	assert(i < g->n_kv);
	return g->kv[i].key;
}

enum gguf_value_type gguf_kv_type(const struct gguf *g, uint64_t i)
{
	assert(i < g->n_kv);
	return (enum gguf_value_type)g->kv[i].type;
}

enum gguf_value_type gguf_kv_array_type(const struct gguf *g, uint64_t i, uint64_t *n)
{
	assert(i < g->n_kv && g->kv[i].type == GGUF_ARRAY);
	if (n)
		*n = g->kv[i].n;
	return (enum gguf_value_type)g->kv[i].arr_type;
}

static int64_t find(const struct name_index *v, uint64_t n, const char *name)
{
	struct name_index k = {name, 0};
	const struct name_index *hit = n ? bsearch(&k, v, (size_t)n, sizeof(*v), cmp_name) : NULL;
	return hit ? (int64_t)hit->i : -1;
}

int64_t gguf_find_key(const struct gguf *g, const char *key)
{
	return find(g->kv_sorted, g->n_kv, key);
}

uint64_t gguf_n_tensors(const struct gguf *g)
{
	return g->n_tensors;
}

const struct gguf_tensor *gguf_tensor(const struct gguf *g, uint64_t i)
{
	assert(i < g->n_tensors);
	return &g->tensors[i];
}

int64_t gguf_find_tensor(const struct gguf *g, const char *name)
{
	return find(g->t_sorted, g->n_tensors, name);
}

/* The entry of key, or NULL with -ENOENT and a message in *rc. */
static const struct kv *lookup(const struct gguf *g, const char *key, int *rc, char *err, size_t errlen)
{
	int64_t i = gguf_find_key(g, key);
	if (i < 0) {
		*rc = errorf(err, errlen, -ENOENT, "%s: key %s is missing", g->path, key);
		return NULL;
	}
	return &g->kv[i];
}

/* What kv holds, for messages: "a string", "an array of uint32". */
static const char *kind(const struct kv *kv, char *buf, size_t len)
{
	if (kv->type == GGUF_ARRAY)
		snprintf(buf, len, "an array of %s", gguf_value_type_name(kv->arr_type));
	else
		snprintf(buf, len, "a%s %s",
			 kv->type == GGUF_INT8 || kv->type == GGUF_INT16 || kv->type == GGUF_INT32 ||
				 kv->type == GGUF_INT64
			     ? "n"
			     : "",
			 gguf_value_type_name(kv->type));
	return buf;
}

static int wrong_kind(const struct gguf *g, const struct kv *kv, const char *want, char *err, size_t errlen)
{
	char k[48];
	return errorf(err, errlen, -EINVAL, "%s: key %s is %s, expected %s", g->path, kv->key, kind(kv, k, sizeof(k)),
		      want);
}

/* An integer key as sign and magnitude. */
static int get_int(const struct gguf *g, const char *key, bool *neg, uint64_t *mag, const struct kv **kvp, char *err,
		   size_t errlen)
{
	int rc = 0;
	const struct kv *kv = lookup(g, key, &rc, err, errlen);
	if (!kv)
		return rc;
	*kvp = kv;
	switch (kv->type) {
	case GGUF_UINT8:
	case GGUF_UINT16:
	case GGUF_UINT32:
	case GGUF_UINT64:
		*neg = false;
		*mag = kv->v.u;
		return 0;
	case GGUF_INT8:
	case GGUF_INT16:
	case GGUF_INT32:
	case GGUF_INT64:
		*neg = kv->v.i < 0;
		*mag = *neg ? (uint64_t)0 - (uint64_t)kv->v.i : (uint64_t)kv->v.i;
		return 0;
	default:
		return wrong_kind(g, kv, "an integer", err, errlen);
	}
}

static int out_of_range(const struct gguf *g, const char *key, bool neg, uint64_t mag, const char *target, char *err,
			size_t errlen)
{
	return errorf(err, errlen, -EINVAL, "%s: key %s = %s%" PRIu64 " does not fit in %s", g->path, key,
		      neg ? "-" : "", mag, target);
}

int gguf_get_u32(const struct gguf *g, const char *key, uint32_t *out, char *err, size_t errlen)
{
	bool neg;
	uint64_t mag;
	const struct kv *kv;
	int rc = get_int(g, key, &neg, &mag, &kv, err, errlen);
	if (rc)
		return rc;
	if (neg || mag > UINT32_MAX)
		return out_of_range(g, key, neg, mag, "a uint32", err, errlen);
	*out = (uint32_t)mag;
	return 0;
}

int gguf_get_u64(const struct gguf *g, const char *key, uint64_t *out, char *err, size_t errlen)
{
	bool neg;
	uint64_t mag;
	const struct kv *kv;
	int rc = get_int(g, key, &neg, &mag, &kv, err, errlen);
	if (rc)
		return rc;
	if (neg)
		return out_of_range(g, key, neg, mag, "a uint64", err, errlen);
	*out = mag;
	return 0;
}

int gguf_get_i64(const struct gguf *g, const char *key, int64_t *out, char *err, size_t errlen)
{
	bool neg;
	uint64_t mag;
	const struct kv *kv;
	int rc = get_int(g, key, &neg, &mag, &kv, err, errlen);
	if (rc)
		return rc;
	if (mag > (neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX))
		return out_of_range(g, key, neg, mag, "an int64", err, errlen);
	*out = neg ? (int64_t)(0 - mag) : (int64_t)mag;
	return 0;
}

int gguf_get_f32(const struct gguf *g, const char *key, float *out, char *err, size_t errlen)
{
	int rc = 0;
	const struct kv *kv = lookup(g, key, &rc, err, errlen);
	if (!kv)
		return rc;
	if (kv->type != GGUF_FLOAT32 && kv->type != GGUF_FLOAT64)
		return wrong_kind(g, kv, "a float32", err, errlen);
	if (isfinite(kv->v.d) && fabs(kv->v.d) > FLT_MAX)
		return errorf(err, errlen, -EINVAL, "%s: key %s = %g does not fit in a float32", g->path, key, kv->v.d);
	*out = (float)kv->v.d;
	return 0;
}

int gguf_get_bool(const struct gguf *g, const char *key, bool *out, char *err, size_t errlen)
{
	int rc = 0;
	const struct kv *kv = lookup(g, key, &rc, err, errlen);
	if (!kv)
		return rc;
	if (kv->type != GGUF_BOOL)
		return wrong_kind(g, kv, "a bool", err, errlen);
	*out = kv->v.u != 0;
	return 0;
}

int gguf_get_str(const struct gguf *g, const char *key, const char **s, size_t *len, char *err, size_t errlen)
{
	int rc = 0;
	const struct kv *kv = lookup(g, key, &rc, err, errlen);
	if (!kv)
		return rc;
	if (kv->type != GGUF_STRING)
		return wrong_kind(g, kv, "a string", err, errlen);
	*s = kv->p;
	if (len)
		*len = (size_t)kv->n;
	return 0;
}

static int get_array(const struct gguf *g, const char *key, uint32_t type, const void **v, uint64_t *n, char *err,
		     size_t errlen)
{
	int rc = 0;
	const struct kv *kv = lookup(g, key, &rc, err, errlen);
	if (!kv)
		return rc;
	if (kv->type != GGUF_ARRAY || kv->arr_type != type) {
		char want[48];
		snprintf(want, sizeof(want), "an array of %s", gguf_value_type_name(type));
		return wrong_kind(g, kv, want, err, errlen);
	}
	*v = kv->n ? kv->p : NULL;
	*n = kv->n;
	return 0;
}

int gguf_get_str_array(const struct gguf *g, const char *key, const struct gguf_str **v, uint64_t *n, char *err,
		       size_t errlen)
{
	return get_array(g, key, GGUF_STRING, (const void **)v, n, err, errlen);
}

int gguf_get_f32_array(const struct gguf *g, const char *key, const float **v, uint64_t *n, char *err, size_t errlen)
{
	return get_array(g, key, GGUF_FLOAT32, (const void **)v, n, err, errlen);
}

int gguf_get_i32_array(const struct gguf *g, const char *key, const int32_t **v, uint64_t *n, char *err, size_t errlen)
{
	return get_array(g, key, GGUF_INT32, (const void **)v, n, err, errlen);
}

int gguf_read_tensor(const struct gguf *g, uint64_t i, void *buf, size_t len, char *err, size_t errlen)
{
	assert(i < g->n_tensors);
	const struct gguf_tensor *t = &g->tensors[i];
	if (len != t->nbytes)
		return errorf(err, errlen, -EINVAL, "%s: tensor %s holds %" PRIu64 " bytes, not %zu", g->path, t->name,
			      t->nbytes, len);
	int fd = open(g->path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errorf(err, errlen, -errno, "%s: cannot open: %s", g->path, strerror(errno));
	int rc = 0;
	size_t done = 0;
	while (done < len) {
		ssize_t n = pread(fd, (char *)buf + done, len - done, (off_t)(g->data_start + t->offset + done));
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			rc = errorf(err, errlen, n < 0 ? -errno : -EIO, "%s: reading tensor %s: %s", g->path, t->name,
				    n < 0 ? strerror(errno) : "the file is shorter than its header says");
			break;
		}
		done += (size_t)n;
	}
	close(fd);
	return rc;
}

/* test_gguf.c - the GGUF header reader (common/gguf.h) on files from the test writer
 * (gguf_test_writer.h): every value type and its typed getters, the tensor table, alignment and
 * versions; then corrupt files (magic, versions, every truncation of a header, absurd counts and
 * lengths, bad values, bad tensor entries), each refused with a message that names the fault. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/gguf.h"
#include "tests/unit/common/test_helpers.h"
#include "tests/unit/manifest/gguf_test_writer.h"
#include "tests/unit/manifest/manifest_test_util.h"

static const char *write_w(struct gw *w, const char *name)
{
	const char *path = tpath("%s", name);
	ck_assert_int_eq(gw_write(w, path), 0);
	return path;
}

static struct gguf *open_ok(const char *path)
{
	char err[512] = "";
	struct gguf *g = NULL;
	int rc = gguf_open(path, &g, err, sizeof(err));
	ck_assert_msg(rc == 0, "gguf_open %s: %d %s", path, rc, err);
	ck_assert_ptr_nonnull(g);
	return g;
}

static void open_fails(const char *path, int want, const char *word)
{
	char err[512] = "";
	struct gguf *g = (struct gguf *)0x1;
	int rc = gguf_open(path, &g, err, sizeof(err));
	ck_assert_msg(rc == want, "gguf_open %s: rc %d (%s), wanted %d", path, rc, err, want);
	ck_assert_ptr_null(g);
	ck_assert_msg(strstr(err, word) != NULL, "message \"%s\" lacks \"%s\"", err, word);
	ck_assert_msg(strstr(err, path) != NULL, "message \"%s\" does not name the file", err);
}

/* Writes w's bytes, lets fn change them, and expects the reader to refuse the result. */
static void bytes_fail(struct gw *w, void (*fn)(unsigned char *b, size_t *len, void *arg), void *arg, int want,
		       const char *word)
{
	unsigned char *b;
	size_t len;
	gw_bytes(w, &b, &len);
	if (fn)
		fn(b, &len, arg);
	const char *path = tpath("bad-%d.gguf", rand());
	write_file(path, b, len);
	free(b);
	open_fails(path, want, word);
}

START_TEST(test_values)
{
	struct gw *w = gw_new();
	gw_u8(w, "a.u8", 200);
	gw_u16(w, "a.u16", 60000);
	gw_u32(w, "a.u32", 4000000000u);
	gw_i32(w, "a.i32", -5);
	gw_u64(w, "a.u64", 1ull << 40);
	gw_i64(w, "a.i64", -(1ll << 40));
	gw_f32(w, "a.f32", 0.5f);
	gw_f64(w, "a.f64", 1e300);
	gw_f64(w, "a.f64small", 0.25);
	gw_bool(w, "a.bool", true);
	gw_str(w, "a.str", "hello");
	const char *words[] = {"x", "", "z z"};
	gw_arr_str(w, "a.strs", words, NULL, 3);
	const float f[] = {1.5f, -2.0f};
	gw_arr_f32(w, "a.f32s", f, 2);
	const int32_t i[] = {1, 3, 6};
	gw_arr_i32(w, "a.i32s", i, 3);
	gw_arr_i32(w, "a.empty", NULL, 0);
	/* An array of arrays of strings: skipped, present, unreadable. */
	unsigned char nested[] = {GW_T_ARRAY,  0, 0,   0,	   2, 0, 0, 0, 0, 0, 0, 0, /* 2 arrays */
				  GW_T_STRING, 0, 0,   0,	   1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0,
				  0,	       0, 'q', GW_T_UINT8, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 7, 8, 9};
	gw_raw(w, "a.nested", GW_T_ARRAY, nested, sizeof(nested));
	const char *path = write_w(w, "v.gguf");
	struct gguf *g = open_ok(path);
	char err[256];
	ck_assert_uint_eq(gguf_version(g), 3);
	ck_assert_uint_eq(gguf_n_kv(g), 16);
	ck_assert_uint_eq(gguf_n_tensors(g), 0);
	ck_assert_uint_eq(gguf_alignment(g), 32);
	ck_assert_str_eq(gguf_path(g), path);
	uint32_t u32;
	uint64_t u64;
	int64_t i64;
	ck_assert_int_eq(gguf_get_u32(g, "a.u8", &u32, err, sizeof(err)), 0);
	ck_assert_uint_eq(u32, 200);
	ck_assert_int_eq(gguf_get_u32(g, "a.u16", &u32, err, sizeof(err)), 0);
	ck_assert_uint_eq(u32, 60000);
	ck_assert_int_eq(gguf_get_u32(g, "a.u32", &u32, err, sizeof(err)), 0);
	ck_assert_uint_eq(u32, 4000000000u);
	ck_assert_int_eq(gguf_get_u32(g, "a.u64", &u32, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "a.u64 = 1099511627776 does not fit"));
	ck_assert_int_eq(gguf_get_u32(g, "a.i32", &u32, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "a.i32 = -5"));
	ck_assert_int_eq(gguf_get_u64(g, "a.u64", &u64, err, sizeof(err)), 0);
	ck_assert_uint_eq(u64, 1ull << 40);
	ck_assert_int_eq(gguf_get_i64(g, "a.i64", &i64, err, sizeof(err)), 0);
	ck_assert_int_eq(i64, -(1ll << 40));
	ck_assert_int_eq(gguf_get_i64(g, "a.i32", &i64, err, sizeof(err)), 0);
	ck_assert_int_eq(i64, -5);
	ck_assert_int_eq(gguf_get_u32(g, "a.str", &u32, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "a.str is a string, expected an integer"));
	ck_assert_int_eq(gguf_get_u32(g, "no.such", &u32, err, sizeof(err)), -ENOENT);
	ck_assert_ptr_nonnull(strstr(err, "no.such is missing"));
	ck_assert_uint_eq(u32, 4000000000u); /* unchanged by the failures */
	float fv;
	ck_assert_int_eq(gguf_get_f32(g, "a.f32", &fv, err, sizeof(err)), 0);
	ck_assert_float_eq(fv, 0.5f);
	ck_assert_int_eq(gguf_get_f32(g, "a.f64small", &fv, err, sizeof(err)), 0);
	ck_assert_float_eq(fv, 0.25f);
	ck_assert_int_eq(gguf_get_f32(g, "a.f64", &fv, err, sizeof(err)), -EINVAL);
	ck_assert_int_eq(gguf_get_f32(g, "a.u8", &fv, err, sizeof(err)), -EINVAL);
	bool bv = false;
	ck_assert_int_eq(gguf_get_bool(g, "a.bool", &bv, err, sizeof(err)), 0);
	ck_assert(bv);
	const char *s;
	size_t sl;
	ck_assert_int_eq(gguf_get_str(g, "a.str", &s, &sl, err, sizeof(err)), 0);
	ck_assert_str_eq(s, "hello");
	ck_assert_uint_eq(sl, 5);
	const struct gguf_str *sv;
	uint64_t n;
	ck_assert_int_eq(gguf_get_str_array(g, "a.strs", &sv, &n, err, sizeof(err)), 0);
	ck_assert_uint_eq(n, 3);
	ck_assert_str_eq(sv[0].s, "x");
	ck_assert_uint_eq(sv[1].len, 0);
	ck_assert_str_eq(sv[2].s, "z z");
	const float *fa;
	ck_assert_int_eq(gguf_get_f32_array(g, "a.f32s", &fa, &n, err, sizeof(err)), 0);
	ck_assert_uint_eq(n, 2);
	ck_assert_float_eq(fa[1], -2.0f);
	const int32_t *ia;
	ck_assert_int_eq(gguf_get_i32_array(g, "a.i32s", &ia, &n, err, sizeof(err)), 0);
	ck_assert_uint_eq(n, 3);
	ck_assert_int_eq(ia[2], 6);
	ck_assert_int_eq(gguf_get_i32_array(g, "a.empty", &ia, &n, err, sizeof(err)), 0);
	ck_assert_uint_eq(n, 0);
	ck_assert_int_eq(gguf_get_i32_array(g, "a.f32s", &ia, &n, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "an array of float32, expected an array of int32"));
	ck_assert_int_eq(gguf_get_str_array(g, "a.nested", &sv, &n, err, sizeof(err)), -EINVAL);
	int64_t k = gguf_find_key(g, "a.nested");
	ck_assert_int_ge(k, 0);
	ck_assert_str_eq(gguf_kv_key(g, (uint64_t)k), "a.nested");
	ck_assert_uint_eq(gguf_kv_type(g, (uint64_t)k), GGUF_ARRAY);
	ck_assert_uint_eq(gguf_kv_array_type(g, (uint64_t)k, &n), GGUF_ARRAY);
	ck_assert_uint_eq(n, 2);
	ck_assert_int_eq(gguf_find_key(g, "a.nest"), -1);
	gguf_close(&g);
	gguf_close(&g);
	ck_assert_ptr_null(g);
	gw_free(&w);
}
END_TEST

START_TEST(test_tensors)
{
	for (int version = 2; version <= 3; version++) {
		struct gw *w = gw_new();
		w->version = (uint32_t)version;
		gw_alignment(w, 64);
		uint64_t ne[2] = {64, 3};
		gw_tensor(w, "a", GW_F32, 2, ne, NULL);
		gw_tensor(w, "b", GW_Q8_0, 2, ne, NULL);
		uint64_t ne4[4] = {256, 2, 1, 3};
		gw_tensor(w, "c.q4k", GW_Q4_K, 4, ne4, NULL);
		gw_tensor(w, "d.iq", GW_IQ2_XS, 1, ne4, NULL); /* a type the manifest refuses passes here */
		const char *path = write_w(w, "t.gguf");
		struct gguf *g = open_ok(path);
		ck_assert_uint_eq(gguf_version(g), (uint32_t)version);
		ck_assert_uint_eq(gguf_alignment(g), 64);
		ck_assert_uint_eq(gguf_n_tensors(g), 4);
		ck_assert_uint_eq(gguf_data_start(g), w->data_start);
		ck_assert_uint_eq(gguf_data_start(g) % 64, 0);
		const struct gguf_tensor *t = gguf_tensor(g, 1);
		ck_assert_str_eq(t->name, "b");
		ck_assert_uint_eq(t->type, GGUF_TENSOR_Q8_0);
		ck_assert_uint_eq(t->n_dims, 2);
		ck_assert_uint_eq(t->ne[0], 64);
		ck_assert_uint_eq(t->ne[1], 3);
		ck_assert_uint_eq(t->ne[2], 1);
		ck_assert_uint_eq(t->nbytes, 3 * 2 * 34);
		ck_assert_uint_eq(gguf_data_start(g) + t->offset, w->t[1].data_pos);
		t = gguf_tensor(g, 2);
		ck_assert_uint_eq(t->nbytes, 6 * 144);
		ck_assert_uint_eq(t->offset % 64, 0);
		ck_assert_int_eq(gguf_find_tensor(g, "c.q4k"), 2);
		ck_assert_int_eq(gguf_find_tensor(g, "c"), -1);
		/* The data as written. */
		char err[256];
		unsigned char buf[3 * 2 * 34];
		ck_assert_int_eq(gguf_read_tensor(g, 1, buf, sizeof(buf), err, sizeof(err)), 0);
		ck_assert_int_eq(memcmp(buf, w->t[1].data, sizeof(buf)), 0);
		ck_assert_int_eq(gguf_read_tensor(g, 1, buf, 10, err, sizeof(err)), -EINVAL);
		gguf_close(&g);
		gw_free(&w);
	}
	/* Types and dtypes. */
	enum dtype dt;
	ck_assert_int_eq(gguf_type_to_dtype(GGUF_TENSOR_Q6_K, &dt), 0);
	ck_assert_uint_eq(dt, DT_Q6_K);
	ck_assert_int_eq(gguf_type_to_dtype(GGUF_TENSOR_BF16, &dt), 0);
	ck_assert_uint_eq(dt, DT_BF16);
	ck_assert_int_eq(gguf_type_to_dtype(GGUF_TENSOR_Q4_1, &dt), -ENOTSUP);
	ck_assert_int_eq(gguf_type_to_dtype(99, &dt), -ENOTSUP);
	ck_assert_str_eq(gguf_type_name(GGUF_TENSOR_IQ2_XS), "IQ2_XS");
	ck_assert_str_eq(gguf_type_name(GGUF_TENSOR_MXFP4), "MXFP4");
	ck_assert_str_eq(gguf_type_name(4), "unknown");
	ck_assert_str_eq(gguf_type_name(1000), "unknown");
	ck_assert_str_eq(gguf_value_type_name(GGUF_FLOAT64), "float64");
	/* Our block sizes agree with dtype.h's for every type both know. */
	for (uint32_t t = 0; t < GGUF_TENSOR_TYPE_COUNT; t++) {
		uint32_t be, bb;
		if (gguf_type_to_dtype(t, &dt) != 0)
			continue;
		ck_assert_int_eq(gguf_type_block(t, &be, &bb), 0);
		ck_assert_uint_eq(be, dtype_block_elems(dt));
		ck_assert_uint_eq(bb, dtype_block_bytes(dt));
	}
	/* A file with no tensors and no padding: fine. */
	struct gw *w = gw_new();
	gw_str(w, "general.architecture", "llama");
	struct gguf *g = open_ok(write_w(w, "empty.gguf"));
	ck_assert_uint_eq(gguf_n_tensors(g), 0);
	gguf_close(&g);
	gw_free(&w);
	ck_assert_int_eq(gguf_probe(tpath("empty.gguf")), 1);
	write_file(tpath("text"), "GGU", 3);
	ck_assert_int_eq(gguf_probe(tpath("text")), 0);
	ck_assert_int_eq(gguf_probe(tpath("nothing")), -ENOENT);
}
END_TEST

static void set_u32_at(unsigned char *b, size_t *len, void *arg)
{
	const uint64_t *pv = arg; /* {offset, value} */
	(void)len;
	for (int i = 0; i < 4; i++)
		b[pv[0] + (uint64_t)i] = (unsigned char)(pv[1] >> (8 * i));
}

static void set_u64_at(unsigned char *b, size_t *len, void *arg)
{
	const uint64_t *pv = arg;
	(void)len;
	for (int i = 0; i < 8; i++)
		b[pv[0] + (uint64_t)i] = (unsigned char)(pv[1] >> (8 * i));
}

START_TEST(test_bad_header)
{
	struct gw *w = gw_new();
	gw_str(w, "general.architecture", "llama");
	uint64_t ne[2] = {32, 2};
	gw_tensor(w, "x", GW_F32, 2, ne, NULL);
	memcpy(w->magic, "GGUX", 4);
	bytes_fail(w, NULL, NULL, -EINVAL, "not a GGUF file");
	memcpy(w->magic, "GGUF", 4);
	w->version = 1;
	bytes_fail(w, NULL, NULL, -ENOTSUP, "version 1 is not supported");
	w->version = 4;
	bytes_fail(w, NULL, NULL, -ENOTSUP, "version 4 is not supported (versions 2 and 3 are)");
	w->version = 0x03000000u;
	bytes_fail(w, NULL, NULL, -ENOTSUP, "big-endian");
	w->version = 3;
	/* Counts: absurd, and more than the file can hold. */
	w->n_tensors = 1ull << 40;
	bytes_fail(w, NULL, NULL, -EINVAL, "1099511627776 tensors");
	w->n_tensors = GW_AUTO;
	w->n_kv = 1ull << 62;
	bytes_fail(w, NULL, NULL, -EINVAL, "key/value pairs (at most");
	w->n_kv = 5000;
	bytes_fail(w, NULL, NULL, -EINVAL, "truncated");
	w->n_kv = GW_AUTO;
	/* The key's length: 2^62 and 70000 bytes. */
	uint64_t at[2] = {24, 1ull << 62};
	bytes_fail(w, set_u64_at, at, -EINVAL, "a key of 4611686018427387904 bytes");
	at[1] = 70000;
	bytes_fail(w, set_u64_at, at, -EINVAL, "at most 65535");
	/* A string value longer than the file. */
	at[0] = 24 + 8 + strlen("general.architecture") + 4;
	at[1] = 1ull << 20;
	bytes_fail(w, set_u64_at, at, -EINVAL, "truncated");
	/* The tensor's name, dimension count, dimension, type and offset. */
	unsigned char *b;
	size_t len;
	gw_bytes(w, &b, &len);
	free(b);
	uint64_t info = w->t[0].info_pos, pos_ndims = info + 8 + 1, pos_ne0 = pos_ndims + 4, pos_type = pos_ne0 + 16,
		 pos_off = pos_type + 4;
	at[0] = info, at[1] = 300;
	bytes_fail(w, set_u64_at, at, -EINVAL, "a tensor name of 300 bytes");
	at[0] = pos_ndims, at[1] = 0;
	bytes_fail(w, set_u32_at, at, -EINVAL, "tensor x has 0 dimensions");
	at[1] = 7;
	bytes_fail(w, set_u32_at, at, -EINVAL, "tensor x has 7 dimensions");
	at[0] = pos_ne0, at[1] = 0;
	bytes_fail(w, set_u64_at, at, -EINVAL, "dimension 0 is 0");
	at[1] = 1ull << 63;
	bytes_fail(w, set_u64_at, at, -EINVAL, "dimension 0");
	at[0] = pos_ne0 + 8, at[1] = 1ull << 62; /* 32 x 2^62 elements */
	bytes_fail(w, set_u64_at, at, -EINVAL, "overflows");
	at[0] = pos_type, at[1] = 99;
	bytes_fail(w, set_u32_at, at, -EINVAL, "tensor x has unknown ggml type 99");
	at[1] = 4; /* retired by ggml */
	bytes_fail(w, set_u32_at, at, -EINVAL, "unknown ggml type 4");
	at[1] = GW_Q4_K; /* 32 columns are not a block of 256 */
	bytes_fail(w, set_u32_at, at, -EINVAL, "32 columns are not a whole number of Q4_K blocks");
	at[0] = pos_off, at[1] = 16;
	bytes_fail(w, set_u64_at, at, -EINVAL, "offset 16 is not a multiple of the alignment 32");
	at[1] = 1024;
	bytes_fail(w, set_u64_at, at, -EINVAL, "run past the end of the file");
	at[1] = UINT64_MAX - 31;
	bytes_fail(w, set_u64_at, at, -EINVAL, "run past the end of the file");
	gw_free(&w);
}
END_TEST

START_TEST(test_bad_values)
{
	static const struct {
		uint32_t type;
		unsigned char value[24];
		size_t len;
		const char *word;
	} cases[] = {
	    {GW_T_BOOL, {2}, 1, "a bool of value 2"},
	    {13, {0}, 1, "unknown value type 13"},
	    {GW_T_ARRAY, {99, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0}, 12, "an array of unknown value type 99"},
	    {GW_T_ARRAY, {GW_T_UINT32, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0}, 12, "elements (at most"},
	    {GW_T_ARRAY, {GW_T_UINT32, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0}, 12, "truncated"},
	    {GW_T_ARRAY, {GW_T_BOOL, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 1, 5}, 14, "a bool of value 5"},
	    {GW_T_ARRAY, {GW_T_STRING, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0, 0, 0, 0, 0, 0}, 20, "truncated"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct gw *w = gw_new();
		gw_str(w, "general.architecture", "llama");
		gw_raw(w, "bad.value", cases[i].type, cases[i].value, cases[i].len);
		gw_u32(w, "after", 1);
		bytes_fail(w, NULL, NULL, -EINVAL, cases[i].word);
		gw_free(&w);
	}
	/* Arrays nested past the limit. */
	struct gw *w = gw_new();
	unsigned char deep[12 * 6];
	for (int d = 0; d < 6; d++) {
		unsigned char lvl[12] = {d < 5 ? GW_T_ARRAY : GW_T_UINT8, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0};
		memcpy(deep + 12 * d, lvl, 12);
	}
	gw_raw(w, "deep", GW_T_ARRAY, deep, sizeof(deep));
	bytes_fail(w, NULL, NULL, -EINVAL, "nested more than");
	gw_free(&w);
	/* Keys: empty, with a NUL, twice. */
	w = gw_new();
	gw_u32(w, "", 1);
	bytes_fail(w, NULL, NULL, -EINVAL, "an empty key");
	gw_free(&w);
	w = gw_new();
	gw_u8(w, "ab", 1);
	unsigned char *b;
	size_t len;
	gw_bytes(w, &b, &len);
	b[24 + 8 + 1] = 0; /* the key "a\0" */
	const char *path = tpath("nulkey.gguf");
	write_file(path, b, len);
	free(b);
	open_fails(path, -EINVAL, "invalid (NUL inside) key");
	gw_free(&w);
	w = gw_new();
	gw_u32(w, "dup.key", 1);
	gw_u32(w, "dup.key", 2);
	bytes_fail(w, NULL, NULL, -EINVAL, "key dup.key appears twice");
	gw_free(&w);
	/* Tensors named twice, or with a NUL inside. */
	w = gw_new();
	uint64_t ne[1] = {32};
	gw_tensor(w, "t", GW_F32, 1, ne, NULL);
	gw_tensor(w, "t", GW_F32, 1, ne, NULL);
	bytes_fail(w, NULL, NULL, -EINVAL, "tensor t appears twice");
	gw_free(&w);
	w = gw_new();
	gw_tensor(w, "ab", GW_F32, 1, ne, NULL);
	gw_bytes(w, &b, &len);
	b[w->t[0].info_pos + 8 + 1] = 0; /* "a\0" */
	path = tpath("nul.gguf");
	write_file(path, b, len);
	free(b);
	open_fails(path, -EINVAL, "invalid (NUL inside)");
	gw_free(&w);
	/* The alignment: not a power of two, zero, of the wrong kind. */
	w = gw_new();
	gw_u32(w, "general.alignment", 48);
	bytes_fail(w, NULL, NULL, -EINVAL, "general.alignment 48 is not a power of two");
	gw_free(&w);
	w = gw_new();
	gw_u32(w, "general.alignment", 0);
	bytes_fail(w, NULL, NULL, -EINVAL, "general.alignment 0");
	gw_free(&w);
	w = gw_new();
	gw_str(w, "general.alignment", "32");
	bytes_fail(w, NULL, NULL, -EINVAL, "general.alignment is a string, expected an integer");
	gw_free(&w);
	/* Not a regular file, and not there. */
	open_fails(tmp_root, -EINVAL, "not a regular file");
	open_fails(tpath("missing.gguf"), -ENOENT, "cannot open");
}
END_TEST

/* Every prefix of a good header is refused (or, past the tensor infos, loads without data that
 * the file no longer holds: refused too), never a crash. */
START_TEST(test_every_truncation)
{
	struct gw *w = gw_new();
	gw_tiny_llama(w, &(struct gw_llama){.type = GW_Q8_0, .n_layers = 1});
	const char *words[] = {"a", "bc", "def"};
	gw_arr_str(w, "tokenizer.ggml.tokens", words, NULL, 3);
	unsigned char *b;
	size_t len;
	gw_bytes(w, &b, &len);
	const char *path = tpath("trunc.gguf");
	for (size_t n = 0; n < w->data_start + 64; n++) {
		write_file(path, b, n);
		char err[512] = "";
		struct gguf *g = (struct gguf *)0x1;
		int rc = gguf_open(path, &g, err, sizeof(err));
		TH_CHECK(rc == -EINVAL && g == NULL, "prefix of %zu bytes: rc %d (%s)", n, rc, err);
		TH_CHECK(strstr(err, "truncated") || strstr(err, "not a GGUF file") || strstr(err, "runs past the end"),
			 "prefix of %zu bytes: \"%s\"", n, err);
	}
	write_file(path, b, len);
	struct gguf *g = open_ok(path);
	gguf_close(&g);
	free(b);
	gw_free(&w);
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
	    {"good", {test_values, test_tensors, NULL}},
	    {"bad", {test_bad_header, test_bad_values, test_every_truncation, NULL}},
	};
	return run_cases("gguf", cases, ARRAY_SIZE(cases));
}

/* test_codec.c - common/codec.c: every message of protocol.h on the wire and back, every way
 * a decoder must refuse bytes, allocation failures, and a deterministic fuzz loop.
 *
 * The wire contract (keys, kinds, limits) is written down a second time here, from protocol.h,
 * and the encoder's bytes are compared with bytes packed independently from that table: a key
 * renumbered or a kind changed in codec.c fails this test. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "common/protocol.h"
#include "common/util.h"
#include "tests/unit/common/test_helpers.h"

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif

/* ---- the wire contract ---- */

enum tkind { T_U64 = 1, T_I64, T_F64, T_BYTES, T_ARRAY };

struct tfield {
	uint8_t key;
	uint8_t kind;
	bool req;
	uint32_t max; /* T_BYTES: bytes; T_ARRAY: elements */
	size_t off;
	const char *name;
};

struct tmsg {
	uint32_t type;
	const char *name;
	const struct tfield *f;
	size_t n;
};

#define TF(key, kind, req, max, member) {key, kind, req, max, offsetof(struct msg, member), #member}

static const struct tfield t_error[] = {TF(1, T_I64, true, 0, error.code), TF(2, T_BYTES, true, 4096, error.text)};
static const struct tfield t_hello[] = {TF(1, T_BYTES, true, 64, hello.client), TF(2, T_U64, true, 0, hello.proto),
					TF(3, T_U64, false, 0, hello.session)};
static const struct tfield t_kv_lookup[] = {TF(1, T_ARRAY, true, PROTO_MAX_ARRAY, kv_lookup.keys)};
static const struct tfield t_hello_reply[] = {
	TF(1, T_BYTES, true, 64, hello_reply.service), TF(2, T_U64, true, 0, hello_reply.pid),
	TF(3, T_U64, true, 0, hello_reply.epoch),	 TF(4, T_U64, true, 0, hello_reply.layout),
	TF(5, T_U64, true, 0, hello_reply.manifest_hash), TF(6, T_BYTES, true, 255, hello_reply.shm_name),
	TF(7, T_U64, true, 0, hello_reply.shm_size)};
static const struct tfield t_stats[] = {TF(1, T_BYTES, true, 64, stats.service),
					TF(2, T_BYTES, true, PROTO_MAX_STR, stats.json)};
static const struct tfield t_heartbeat[] = {
	TF(1, T_BYTES, true, 64, heartbeat.service), TF(2, T_U64, true, 0, heartbeat.pid),
	TF(3, T_U64, true, 0, heartbeat.epoch), TF(4, T_U64, true, 0, heartbeat.seq),
	TF(5, T_U64, true, 0, heartbeat.uptime_ms)};
static const struct tfield t_config_get[] = {TF(1, T_BYTES, false, 16384, config_get.keys)};
static const struct tfield t_config[] = {TF(1, T_BYTES, true, 64, config.service),
					 TF(2, T_BYTES, true, 1u << 18, config.json)};
static const struct tfield t_config_set[] = {TF(1, T_BYTES, true, 65536, config_set.settings)};
static const struct tfield t_w_acquire[] = {TF(1, T_ARRAY, true, 65536, w_acquire.groups),
					    TF(2, T_ARRAY, false, 65536, w_acquire.release)};
static const struct tfield t_w_grant[] = {TF(1, T_U64, true, 0, w_grant.group), TF(2, T_U64, true, 0, w_grant.slot),
					  TF(3, T_U64, true, 0, w_grant.generation),
					  TF(4, T_U64, true, 0, w_grant.offset), TF(5, T_U64, true, 0, w_grant.bytes)};
static const struct tfield t_w_release[] = {TF(1, T_ARRAY, true, 65536, w_release.groups)};
static const struct tfield t_kv_configure[] = {TF(1, T_U64, true, 0, kv_configure.block_bytes),
					       TF(2, T_U64, true, 0, kv_configure.manifest_hash)};
static const struct tfield t_kv_pool[] = {
	TF(1, T_BYTES, true, 255, kv_pool.shm_name), TF(2, T_U64, true, 0, kv_pool.shm_size),
	TF(3, T_U64, true, 0, kv_pool.n_blocks), TF(4, T_U64, true, 0, kv_pool.block_bytes),
	TF(5, T_U64, true, 0, kv_pool.epoch)};
static const struct tfield t_kv_alloc[] = {TF(1, T_U64, true, 0, kv_alloc.count)};
static const struct tfield t_kv_blocks[] = {TF(1, T_ARRAY, true, PROTO_MAX_ARRAY, kv_blocks.handles),
					    TF(2, T_ARRAY, true, PROTO_MAX_ARRAY, kv_blocks.offsets)};
static const struct tfield t_kv_commit[] = {TF(1, T_ARRAY, true, PROTO_MAX_ARRAY, kv_commit.handles),
					    TF(2, T_ARRAY, false, PROTO_MAX_ARRAY, kv_commit.keys),
					    TF(3, T_BYTES, false, PROTO_MAX_STR, kv_commit.events)};
static const struct tfield t_kv_handles[] = {TF(1, T_ARRAY, true, PROTO_MAX_ARRAY, kv_handles.handles)};
static const struct tfield t_generate[] = {
	TF(1, T_ARRAY, false, PROTO_MAX_ARRAY, generate.tokens), TF(2, T_U64, true, 0, generate.max_new),
	TF(3, T_F64, false, 0, generate.temperature), TF(4, T_U64, false, 0, generate.top_k),
	TF(5, T_F64, false, 0, generate.top_p), TF(6, T_U64, false, 0, generate.seed),
	TF(7, T_ARRAY, false, 1024, generate.stop_ids), TF(8, T_BYTES, false, PROTO_MAX_STR, generate.prompt),
	TF(9, T_BYTES, false, PROTO_MAX_STR, generate.chat), TF(10, T_U64, false, 0, generate.flags),
	TF(11, T_F64, false, 0, generate.min_p), TF(12, T_F64, false, 0, generate.repetition_penalty),
	TF(13, T_BYTES, false, 65536, generate.stop_strings)};
static const struct tfield t_token[] = {TF(1, T_U64, true, 0, token.index), TF(2, T_U64, true, 0, token.token),
					TF(3, T_BYTES, false, 65536, token.text)};
static const struct tfield t_logits[] = {TF(1, T_U64, true, 0, logits.position),
					 TF(2, T_BYTES, true, PROTO_MAX_STR, logits.values)};
static const struct tfield t_gen_done[] = {
	TF(1, T_U64, true, 0, gen_done.n_prompt), TF(2, T_U64, true, 0, gen_done.n_generated),
	TF(3, T_BYTES, true, 64, gen_done.reason), TF(4, T_F64, true, 0, gen_done.prefill_ms),
	TF(5, T_F64, true, 0, gen_done.decode_ms), TF(6, T_BYTES, false, 64, gen_done.text)};

#define TM(type, fields) {type, #type, fields, ARRAY_SIZE(fields)}
#define TM0(type) {type, #type, NULL, 0}
static const struct tmsg contract[] = {
	TM(MSG_ERROR, t_error),
	TM0(MSG_OK),
	TM(MSG_HELLO, t_hello),
	TM(MSG_HELLO_REPLY, t_hello_reply),
	TM0(MSG_PING),
	TM0(MSG_STATS_GET),
	TM(MSG_STATS, t_stats),
	TM0(MSG_SHUTDOWN),
	TM(MSG_HEARTBEAT, t_heartbeat),
	TM(MSG_W_ACQUIRE, t_w_acquire),
	TM(MSG_W_GRANT, t_w_grant),
	TM(MSG_W_RELEASE, t_w_release),
	TM(MSG_KV_CONFIGURE, t_kv_configure),
	TM(MSG_KV_POOL, t_kv_pool),
	TM(MSG_KV_ALLOC, t_kv_alloc),
	TM(MSG_KV_BLOCKS, t_kv_blocks),
	TM(MSG_KV_COMMIT, t_kv_commit),
	TM(MSG_KV_FETCH, t_kv_handles),
	TM(MSG_KV_UNPIN, t_kv_handles),
	TM(MSG_KV_FREE, t_kv_handles),
	TM(MSG_KV_LOOKUP, t_kv_lookup),
	TM0(MSG_KV_UNPIN_ALL),
	TM(MSG_GENERATE, t_generate),
	TM(MSG_TOKEN, t_token),
	TM(MSG_GEN_DONE, t_gen_done),
	TM(MSG_LOGITS, t_logits),
	/* appended: the indexes above are used by test_out_of_memory */
	TM(MSG_CONFIG_GET, t_config_get),
	TM(MSG_CONFIG, t_config),
	TM(MSG_CONFIG_SET, t_config_set),
};
#define N_TYPES ((int)ARRAY_SIZE(contract))

static void *at(const struct msg *m, const struct tfield *f)
{
	return (char *)m + f->off;
}

/* ---- values ---- */

static const uint64_t u64_values[] = {0,	     1,		   127,		 128,		 255,
				      256,	     65535,	   65536,	 0xffffffffull,	 0x100000000ull,
				      INT64_MAX,     0x8000000000000000ull, UINT64_MAX};
static const int64_t i64_values[] = {0,	      -1,	    -32,       -33,	    -128,      -129, -32768,
				     -32769,  INT32_MIN, (int64_t)INT32_MIN - 1, INT64_MIN, 1,    INT64_MAX};
static const double f64_values[] = {0.0, -0.0, 1.0 / 3, -1e300, 5e-324, INFINITY, -INFINITY, 0.1, 1e15 + 0.5, -2.5};
#define LEN_MAX SIZE_MAX /* "the field's limit" */
static const size_t str_lens[] = {0, 1, 5, 0 /* UTF-8 */, 31, 32, 255, 256, 65535, 65536, LEN_MAX};
static const size_t arr_lens[] = {0, 1, 3, 15, 16, 1000, 65535, 65536, LEN_MAX, 2};
#define UTF8 "h\xc3\xa9llo, w\xc3\xb6rld \xe2\x9c\x93 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e"
#define N_VARIANTS 11

/* What a filled message borrows, freed after the test. */
struct arena {
	void *p[16];
	int n;
};

static void *arena_alloc(struct arena *a, size_t n)
{
	ck_assert_int_lt(a->n, 16);
	void *p = malloc(n ? n : 1);
	ck_assert_ptr_nonnull(p);
	a->p[a->n++] = p;
	return p;
}

static void arena_free(struct arena *a)
{
	for (int i = 0; i < a->n; i++)
		free(a->p[i]);
	a->n = 0;
}

static void fill_bytes(struct bytes *b, struct arena *a, size_t len, uint32_t max, uint8_t key, int v)
{
	if (len == LEN_MAX || len > max)
		len = max;
	if (v == 3) { /* the UTF-8 variant */
		len = strlen(UTF8) < max ? strlen(UTF8) : max;
		b->p = arena_alloc(a, len);
		memcpy(b->p, UTF8, len);
	} else if (len == 0) {
		b->p = NULL; /* an empty string needs no pointer */
	} else {
		b->p = arena_alloc(a, len);
		for (size_t j = 0; j < len; j++) /* every byte value, NULs included */
			b->p[j] = (char)(j * 7 + key);
		if (len == 5)
			memcpy(b->p, "a\0b\0c", 5);
	}
	b->len = (uint32_t)len;
}

static void fill_array(struct u64_array *arr, struct arena *a, size_t n, uint32_t max, uint8_t key)
{
	if (n == LEN_MAX || n > max)
		n = max;
	arr->n = (uint32_t)n;
	arr->v = n ? arena_alloc(a, n * sizeof(uint64_t)) : NULL;
	for (size_t j = 0; j < n; j++)
		arr->v[j] = j < 64 ? u64_values[(j + key) % ARRAY_SIZE(u64_values)] : j * 0x9e3779b97f4a7c15ull;
}

/* Fills every field of contract type t, variant v: each field gets a different kind of value. */
static void fill(struct msg *m, const struct tmsg *t, int v, struct arena *a)
{
	msg_init(m, t->type, u64_values[(size_t)(v + 5) % ARRAY_SIZE(u64_values)]);
	for (size_t i = 0; i < t->n; i++) {
		const struct tfield *f = &t->f[i];
		size_t k = (size_t)v + i * 3;
		switch (f->kind) {
		case T_U64:
			*(uint64_t *)at(m, f) = u64_values[k % ARRAY_SIZE(u64_values)];
			break;
		case T_I64:
			*(int64_t *)at(m, f) = i64_values[k % ARRAY_SIZE(i64_values)];
			break;
		case T_F64:
			*(double *)at(m, f) = f64_values[k % ARRAY_SIZE(f64_values)];
			break;
		case T_BYTES:
			fill_bytes(at(m, f), a, str_lens[(size_t)v % ARRAY_SIZE(str_lens)], f->max, f->key, v);
			break;
		case T_ARRAY:
			/* neighbouring arrays get different sizes, so two of them never both take the
			 * limit (two 2^20-element arrays would pass the message limit) */
			fill_array(at(m, f), a, arr_lens[((size_t)v + i) % ARRAY_SIZE(arr_lens)], f->max, f->key);
			break;
		}
	}
}

/* Compares every field of a and b (bytes, not values: -0.0 and NaN payloads too). */
static void expect_same(const struct msg *a, const struct msg *b, const struct tmsg *t, int v)
{
	ck_assert_msg(a->type == b->type, "%s v%d: type %u != %u", t->name, v, a->type, b->type);
	ck_assert_msg(a->corr == b->corr, "%s v%d: corr", t->name, v);
	for (size_t i = 0; i < t->n; i++) {
		const struct tfield *f = &t->f[i];
		switch (f->kind) {
		case T_U64:
		case T_I64:
		case T_F64:
			ck_assert_msg(memcmp(at(a, f), at(b, f), 8) == 0, "%s v%d: %s differs", t->name, v, f->name);
			break;
		case T_BYTES: {
			const struct bytes *x = at(a, f), *y = at(b, f);
			ck_assert_msg(x->len == y->len, "%s v%d: %s length %u != %u", t->name, v, f->name, x->len,
				      y->len);
			ck_assert_msg(x->len == 0 || memcmp(x->p, y->p, x->len) == 0, "%s v%d: %s bytes differ", t->name,
				      v, f->name);
			break;
		}
		case T_ARRAY: {
			const struct u64_array *x = at(a, f), *y = at(b, f);
			ck_assert_msg(x->n == y->n, "%s v%d: %s has %u elements, want %u", t->name, v, f->name, y->n,
				      x->n);
			ck_assert_msg(x->n == 0 || memcmp(x->v, y->v, x->n * sizeof(uint64_t)) == 0,
				      "%s v%d: %s elements differ", t->name, v, f->name);
			break;
		}
		}
	}
}

/* ---- packing by hand ---- */

struct pk {
	msgpack_sbuffer sb;
	msgpack_packer p;
};

static void pk_init(struct pk *k)
{
	msgpack_sbuffer_init(&k->sb);
	msgpack_packer_init(&k->p, &k->sb, msgpack_sbuffer_write);
}

static void pk_free(struct pk *k)
{
	msgpack_sbuffer_destroy(&k->sb);
}

typedef void (*packfn)(msgpack_packer *p);

static void pack_value(msgpack_packer *p, const struct msg *m, const struct tfield *f)
{
	switch (f->kind) {
	case T_U64:
		msgpack_pack_uint64(p, *(const uint64_t *)at(m, f));
		break;
	case T_I64:
		msgpack_pack_int64(p, *(const int64_t *)at(m, f));
		break;
	case T_F64:
		msgpack_pack_double(p, *(const double *)at(m, f));
		break;
	case T_BYTES: {
		const struct bytes *b = at(m, f);
		msgpack_pack_str_with_body(p, b->p, b->len);
		break;
	}
	case T_ARRAY: {
		const struct u64_array *a = at(m, f);
		msgpack_pack_array(p, a->n);
		for (uint32_t j = 0; j < a->n; j++)
			msgpack_pack_uint64(p, a->v[j]);
		break;
	}
	}
}

/* How a hand-built message departs from m. */
struct edit {
	int skip_key;	   /* leave this key out */
	int replace_key;   /* pack replace() as this key's value */
	packfn replace;
	int extra_key;	   /* add this key (unknown or duplicate) with extra() as value */
	packfn extra;
	uint64_t version;  /* 0: PROTO_VERSION */
};

static void pack_msg(struct pk *k, const struct msg *m, const struct tmsg *t, const struct edit *e)
{
	static const struct edit none;
	if (!e)
		e = &none;
	pk_init(k);
	msgpack_pack_array(&k->p, 4);
	msgpack_pack_uint64(&k->p, e->version ? e->version : PROTO_VERSION);
	msgpack_pack_uint64(&k->p, t->type);
	msgpack_pack_uint64(&k->p, m->corr);
	size_t n = 0;
	for (size_t i = 0; i < t->n; i++)
		n += t->f[i].key != e->skip_key;
	msgpack_pack_map(&k->p, n + (e->extra ? 1 : 0));
	for (size_t i = 0; i < t->n; i++) {
		const struct tfield *f = &t->f[i];
		if (f->key == e->skip_key)
			continue;
		msgpack_pack_uint64(&k->p, f->key);
		if (f->key == e->replace_key)
			e->replace(&k->p);
		else
			pack_value(&k->p, m, f);
	}
	if (e->extra) {
		msgpack_pack_uint64(&k->p, (uint64_t)e->extra_key);
		e->extra(&k->p);
	}
}

/* Decodes bytes that must be refused with rc; the message must contain want (if not NULL). */
static void expect_reject(const void *buf, size_t len, int rc, const char *want, const char *what)
{
	struct msg out;
	memset(&out, 0x5a, sizeof(out));
	char err[256] = "";
	int got = msg_decode(buf, len, &out, err, sizeof(err));
	ck_assert_msg(got == rc, "%s: msg_decode = %d (%s), want %d", what, got, err, rc);
	ck_assert_msg(err[0], "%s: no message", what);
	ck_assert_msg(!want || strstr(err, want), "%s: message '%s' lacks '%s'", what, err, want);
	msg_free(&out); /* nothing to free, and safe */
	msg_free(&out);
}

static int decode_ok(const void *buf, size_t len, struct msg *out, const char *what)
{
	char err[256] = "";
	int rc = msg_decode(buf, len, out, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s: msg_decode = %d: %s", what, rc, err);
	return rc;
}

/* ---- round trips ---- */

START_TEST(test_catalogue_complete)
{
	/* Every type of protocol.h is in the codec under its own name, and no other number is. */
	int found = 0;
	for (uint32_t type = 0; type < 4096; type++) {
		const char *name = msg_type_name(type);
		const struct tmsg *t = NULL;
		for (int i = 0; i < N_TYPES; i++)
			if (contract[i].type == type)
				t = &contract[i];
		if (!t) {
			ck_assert_msg(!strcmp(name, "unknown"), "type %u has a name %s but no contract", type, name);
			continue;
		}
		ck_assert_str_eq(name, t->name);
		found++;
	}
	ck_assert_int_eq(found, N_TYPES);
	ck_assert_str_eq(msg_type_name(UINT32_MAX), "unknown");
}
END_TEST

START_TEST(test_round_trip)
{
	const struct tmsg *t = &contract[_i];
	for (int v = 0; v < N_VARIANTS; v++) {
		struct arena a = {0};
		struct msg m, out;
		fill(&m, t, v, &a);
		void *buf = NULL;
		size_t len = 0;
		int rc = msg_encode(&m, &buf, &len);
		ck_assert_msg(rc == 0, "%s v%d: msg_encode = %d", t->name, v, rc);
		ck_assert_uint_le(len, PROTO_MAX_MSG_BYTES);
		/* The same bytes as an independent packing from the contract table. */
		struct pk k;
		pack_msg(&k, &m, t, NULL);
		ck_assert_msg(k.sb.size == len && memcmp(k.sb.data, buf, len) == 0,
			      "%s v%d: encoding differs from the contract (%zu vs %zu bytes)", t->name, v, len,
			      k.sb.size);
		pk_free(&k);
		decode_ok(buf, len, &out, t->name);
		expect_same(&m, &out, t, v);
		/* Decoded strings are NUL-terminated copies; arrays are owned copies. */
		for (size_t i = 0; i < t->n; i++) {
			if (t->f[i].kind == T_BYTES) {
				const struct bytes *b = at(&out, &t->f[i]);
				ck_assert_ptr_nonnull(b->p);
				ck_assert_int_eq(b->p[b->len], 0);
			}
			if (t->f[i].kind == T_ARRAY) {
				const struct u64_array *x = at(&out, &t->f[i]), *y = at(&m, &t->f[i]);
				ck_assert(x->v != y->v || x->n == 0);
			}
		}
		msg_free(&out);
		msg_free(&out); /* twice is safe */
		for (size_t i = 0; i < t->n; i++) {
			if (t->f[i].kind == T_BYTES)
				ck_assert_ptr_null(((struct bytes *)at(&out, &t->f[i]))->p);
			if (t->f[i].kind == T_ARRAY)
				ck_assert_ptr_null(((struct u64_array *)at(&out, &t->f[i]))->v);
		}
		free(buf);
		arena_free(&a);
	}
}
END_TEST

START_TEST(test_optional_fields)
{
	/* Optional fields may be left out; they decode as zero / empty. */
	for (int i = 0; i < N_TYPES; i++) {
		const struct tmsg *t = &contract[i];
		for (size_t j = 0; j < t->n; j++) {
			if (t->f[j].req)
				continue;
			struct arena a = {0};
			struct msg m, out;
			fill(&m, t, 2, &a);
			struct pk k;
			struct edit e = {.skip_key = t->f[j].key};
			pack_msg(&k, &m, t, &e);
			decode_ok(k.sb.data, k.sb.size, &out, t->f[j].name);
			static const char zero[16];
			size_t size = t->f[j].kind == T_BYTES ? sizeof(struct bytes)
				      : t->f[j].kind == T_ARRAY ? sizeof(struct u64_array)
								: 8;
			ck_assert_msg(memcmp(at(&out, &t->f[j]), zero, size) == 0, "%s decoded as non-zero",
				      t->f[j].name);
			msg_free(&out);
			pk_free(&k);
			arena_free(&a);
		}
	}
}
END_TEST

START_TEST(test_alternative_encodings)
{
	/* Any msgpack spelling of a value is accepted: bin for strings, float32 and integers for
	 * doubles, int64 formats for small positive values, fixed-width uints. */
	static const uint8_t gen_done[] = {
		0x94, 0x01, 0x3e, 0xcf, 0, 0, 0, 0, 0, 0, 0, 7, 0x85,	    /* [1, 62, 7 (uint64), {5 entries */
		0x01, 0xd3, 0, 0, 0, 0, 0, 0, 0, 3,			    /* 1: 3 as int64 */
		0x02, 0xcd, 0x01, 0x00,					    /* 2: 256 as uint16 */
		0x03, 0xc4, 0x04, 's', 't', 'o', 'p',			    /* 3: bin8 "stop" */
		0x04, 0xca, 0x3f, 0xc0, 0x00, 0x00,			    /* 4: 1.5 as float32 */
		0x05, 0xff,						    /* 5: -1 as negative fixint */
	};
	struct msg out;
	decode_ok(gen_done, sizeof(gen_done), &out, "gen_done");
	ck_assert_uint_eq(out.type, MSG_GEN_DONE);
	ck_assert_uint_eq(out.corr, 7);
	ck_assert_uint_eq(out.gen_done.n_prompt, 3);
	ck_assert_uint_eq(out.gen_done.n_generated, 256);
	ck_assert_uint_eq(out.gen_done.reason.len, 4);
	ck_assert_str_eq(out.gen_done.reason.p, "stop");
	ck_assert_double_eq(out.gen_done.prefill_ms, 1.5);
	ck_assert_double_eq(out.gen_done.decode_ms, -1.0);
	msg_free(&out);
	/* error.code from a positive integer; str16 text */
	static const uint8_t error[] = {0x94, 0x01, 0x01, 0x00, 0x82, 0x01, 0x05, 0x02, 0xda, 0x00, 0x02, 'h', 'i'};
	decode_ok(error, sizeof(error), &out, "error");
	ck_assert_int_eq(out.error.code, 5);
	ck_assert_str_eq(out.error.text.p, "hi");
	msg_free(&out);
}
END_TEST

START_TEST(test_unknown_keys_skipped)
{
	/* A newer peer may append fields of any shape: they are skipped, the known ones kept. */
	static const uint8_t vals[][12] = {
		{0xc0},					    /* nil */
		{0xa3, 'n', 'e', 'w'},			    /* str */
		{0x81, 0x01, 0x92, 0x01, 0x02},		    /* {1: [1, 2]} */
		{0x92, 0x91, 0x01, 0x90},		    /* [[1], []] */
		{0xd4, 0x05, 0x00},			    /* fixext1 */
		{0xc7, 0x02, 0x07, 0xaa, 0xbb},		    /* ext8 */
		{0xcb, 0x40, 0x09, 0x21, 0xfb, 0x54, 0x44, 0x2d, 0x18}, /* pi */
		{0xd0, 0x80},				    /* int8 -128 */
		{0xc3},					    /* true */
	};
	static const size_t lens[] = {1, 4, 5, 4, 3, 5, 9, 2, 1};
	for (size_t i = 0; i < ARRAY_SIZE(vals); i++) {
		uint8_t buf[64];
		size_t n = 0;
		static const uint8_t head[] = {0x94, 0x01, 0x2a, 0x09, 0x82, 0x01, 0x04}; /* KV_ALLOC, corr 9, count 4 */
		memcpy(buf, head, sizeof(head));
		n = sizeof(head);
		buf[n++] = 63; /* the highest key */
		memcpy(buf + n, vals[i], lens[i]);
		n += lens[i];
		struct msg out;
		decode_ok(buf, n, &out, "unknown key");
		ck_assert_uint_eq(out.type, MSG_KV_ALLOC);
		ck_assert_uint_eq(out.corr, 9);
		ck_assert_uint_eq(out.kv_alloc.count, 4);
		msg_free(&out);
	}
	/* A message type without fields takes unknown keys too. */
	static const uint8_t ping[] = {0x94, 0x01, 0x05, 0x01, 0x81, 0x07, 0xa1, 'x'};
	struct msg out;
	decode_ok(ping, sizeof(ping), &out, "ping");
	ck_assert_uint_eq(out.type, MSG_PING);
	msg_free(&out);
}
END_TEST

START_TEST(test_make_error_and_init)
{
	struct msg m, out;
	msg_make_error(&m, 77, ENOSPC, "pool full: 0 of 12 blocks free");
	ck_assert_uint_eq(m.type, MSG_ERROR);
	void *buf;
	size_t len;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), 0);
	decode_ok(buf, len, &out, "error");
	ck_assert_uint_eq(out.corr, 77);
	ck_assert_int_eq(out.error.code, ENOSPC);
	ck_assert_str_eq(out.error.text.p, "pool full: 0 of 12 blocks free");
	msg_free(&out);
	free(buf);
	/* msg_free after msg_init is a no-op, for any type, known or not. */
	msg_init(&m, MSG_KV_COMMIT, 1);
	msg_free(&m);
	msg_init(&m, 12345, 1);
	msg_free(&m);
}
END_TEST

START_TEST(test_config_messages)
{
	/* Live tuning: the lists travel as JSON text; the codec checks kinds and lengths. */
	struct msg m, out;
	void *buf;
	size_t len;
	const char *settings = "{\"kv-dram-budget\": \"512MiB\", \"log-level\": \"debug\"}";
	msg_init(&m, MSG_CONFIG_SET, 5);
	m.config_set.settings.p = (char *)settings;
	m.config_set.settings.len = (uint32_t)strlen(settings);
	ck_assert_int_eq(msg_encode(&m, &buf, &len), 0);
	decode_ok(buf, len, &out, "CONFIG_SET");
	ck_assert_uint_eq(out.type, MSG_CONFIG_SET);
	ck_assert_str_eq(out.config_set.settings.p, settings);
	msg_free(&out);
	free(buf);
	/* CONFIG_GET without keys: every parameter */
	msg_init(&m, MSG_CONFIG_GET, 6);
	ck_assert_int_eq(msg_encode(&m, &buf, &len), 0);
	decode_ok(buf, len, &out, "CONFIG_GET");
	ck_assert_uint_eq(out.config_get.keys.len, 0);
	msg_free(&out);
	free(buf);
	msg_init(&m, MSG_CONFIG, 6);
	m.config.service.p = "kv-store";
	m.config.service.len = 8;
	m.config.json.p = "{}";
	m.config.json.len = 2;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), 0);
	decode_ok(buf, len, &out, "CONFIG");
	ck_assert_str_eq(out.config.service.p, "kv-store");
	ck_assert_str_eq(out.config.json.p, "{}");
	msg_free(&out);
	free(buf);
	/* over the limits: settings past 64 KiB, keys past 16 KiB, a service name past 64 bytes */
	char *big = malloc(65537);
	ck_assert_ptr_nonnull(big);
	memset(big, 'x', 65537);
	msg_init(&m, MSG_CONFIG_SET, 7);
	m.config_set.settings.p = big;
	m.config_set.settings.len = 65537;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), -EINVAL);
	msg_init(&m, MSG_CONFIG_GET, 7);
	m.config_get.keys.p = big;
	m.config_get.keys.len = 16385;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), -EINVAL);
	msg_init(&m, MSG_CONFIG, 7);
	m.config.service.p = big;
	m.config.service.len = 65;
	m.config.json.p = "{}";
	m.config.json.len = 2;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), -EINVAL);
	/* ... and the decoder refuses what a peer packed past them, or of the wrong kind */
	struct pk k;
	pk_init(&k);
	msgpack_pack_array(&k.p, 4);
	msgpack_pack_uint32(&k.p, PROTO_VERSION);
	msgpack_pack_uint32(&k.p, MSG_CONFIG_SET);
	msgpack_pack_uint64(&k.p, 8);
	msgpack_pack_map(&k.p, 1);
	msgpack_pack_uint8(&k.p, 1);
	msgpack_pack_str(&k.p, 65537);
	msgpack_pack_str_body(&k.p, big, 65537);
	expect_reject(k.sb.data, k.sb.size, -EBADMSG, "longer than 65536", "settings of 65537 bytes");
	pk_free(&k);
	pk_init(&k);
	msgpack_pack_array(&k.p, 4);
	msgpack_pack_uint32(&k.p, PROTO_VERSION);
	msgpack_pack_uint32(&k.p, MSG_CONFIG_GET);
	msgpack_pack_uint64(&k.p, 9);
	msgpack_pack_map(&k.p, 1);
	msgpack_pack_uint8(&k.p, 1);
	msgpack_pack_array(&k.p, 1); /* keys as a msgpack array: the wrong kind */
	msgpack_pack_uint8(&k.p, 1);
	expect_reject(k.sb.data, k.sb.size, -EBADMSG, "wrong type", "keys as an array");
	pk_free(&k);
	pk_init(&k);
	msgpack_pack_array(&k.p, 4);
	msgpack_pack_uint32(&k.p, PROTO_VERSION);
	msgpack_pack_uint32(&k.p, MSG_CONFIG_SET);
	msgpack_pack_uint64(&k.p, 10);
	msgpack_pack_map(&k.p, 0);
	expect_reject(k.sb.data, k.sb.size, -EBADMSG, "settings is missing", "CONFIG_SET without settings");
	pk_free(&k);
	free(big);
}
END_TEST

/* ---- encoder refusals ---- */

START_TEST(test_encode_refuses)
{
	struct msg m;
	void *buf = (void *)1;
	size_t len = 0;
	msg_init(&m, 999, 1);
	ck_assert_int_eq(msg_encode(&m, &buf, &len), -EINVAL);
	msg_init(&m, 0, 1);
	ck_assert_int_eq(msg_encode(&m, &buf, &len), -EINVAL);
	/* over a field's limit */
	char name[65];
	memset(name, 'n', sizeof(name));
	msg_init(&m, MSG_HELLO, 1);
	m.hello.client.p = name;
	m.hello.client.len = 65;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), -EINVAL);
	m.hello.client.len = 64;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), 0);
	free(buf);
	uint64_t stops[1025] = {0};
	msg_init(&m, MSG_GENERATE, 1);
	m.generate.stop_ids.v = stops;
	m.generate.stop_ids.n = 1025;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), -EINVAL);
	/* a length without a pointer */
	msg_init(&m, MSG_KV_FREE, 1);
	m.kv_handles.handles.n = 3;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), -EINVAL);
	msg_init(&m, MSG_STATS, 1);
	m.stats.json.len = 2;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), -EINVAL);
	/* past PROTO_MAX_MSG_BYTES in total, though each field is within its limit */
	uint64_t *big = malloc(sizeof(uint64_t) * PROTO_MAX_ARRAY);
	ck_assert_ptr_nonnull(big);
	for (uint32_t i = 0; i < PROTO_MAX_ARRAY; i++)
		big[i] = UINT64_MAX - i; /* 9 bytes each */
	msg_init(&m, MSG_KV_BLOCKS, 1);
	m.kv_blocks.handles.v = big;
	m.kv_blocks.handles.n = PROTO_MAX_ARRAY;
	m.kv_blocks.offsets.v = big;
	m.kv_blocks.offsets.n = PROTO_MAX_ARRAY;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), -EINVAL);
	m.kv_blocks.offsets.n = 1;
	ck_assert_int_eq(msg_encode(&m, &buf, &len), 0);
	free(buf);
	free(big);
}
END_TEST

/* ---- decoder refusals ---- */

/* A valid KV_ALLOC {1: 4}, corr 9, as bytes. */
static const uint8_t kv_alloc[] = {0x94, 0x01, 0x2a, 0x09, 0x81, 0x01, 0x04};

START_TEST(test_reject_framing)
{
	expect_reject(kv_alloc, 0, -EBADMSG, "empty", "empty input");
	uint8_t buf[64];
	memcpy(buf, kv_alloc, sizeof(kv_alloc));
	buf[sizeof(kv_alloc)] = 0x00;
	expect_reject(buf, sizeof(kv_alloc) + 1, -EBADMSG, "trailing", "one trailing byte");
	memcpy(buf + sizeof(kv_alloc), kv_alloc, sizeof(kv_alloc));
	expect_reject(buf, 2 * sizeof(kv_alloc), -EBADMSG, "trailing", "two messages in one frame");
	/* not an array */
	static const uint8_t not_array[][3] = {{0x81, 0x01, 0x02}, {0x05}, {0xa2, 'h', 'i'}, {0xc0}};
	static const size_t na_len[] = {3, 1, 3, 1};
	for (size_t i = 0; i < ARRAY_SIZE(not_array); i++)
		expect_reject(not_array[i], na_len[i], -EBADMSG, "array of 4", "not an array");
	/* arrays of the wrong length */
	static const uint8_t three[] = {0x93, 0x01, 0x2a, 0x09};
	static const uint8_t five[] = {0x95, 0x01, 0x2a, 0x09, 0x81, 0x01, 0x04, 0xc0};
	static const uint8_t zero[] = {0x90};
	expect_reject(three, sizeof(three), -EBADMSG, "array of 4", "array of 3");
	expect_reject(five, sizeof(five), -EBADMSG, "array of 4", "array of 5");
	expect_reject(zero, sizeof(zero), -EBADMSG, "array of 4", "empty array");
	/* header fields that are not unsigned integers */
	static const uint8_t neg_corr[] = {0x94, 0x01, 0x2a, 0xff, 0x80};
	static const uint8_t str_type[] = {0x94, 0x01, 0xa1, 'x', 0x01, 0x80};
	expect_reject(neg_corr, sizeof(neg_corr), -EBADMSG, "unsigned", "negative id");
	expect_reject(str_type, sizeof(str_type), -EBADMSG, "unsigned", "string type");
	/* over the message limit */
	uint8_t *huge = calloc(1, PROTO_MAX_MSG_BYTES + 1);
	ck_assert_ptr_nonnull(huge);
	expect_reject(huge, PROTO_MAX_MSG_BYTES + 1, -EBADMSG, "limit", "over PROTO_MAX_MSG_BYTES");
	free(huge);
}
END_TEST

START_TEST(test_reject_truncations)
{
	/* Every proper prefix of every valid message of moderate size is refused. */
	int checked = 0;
	for (int i = 0; i < N_TYPES; i++) {
		const struct tmsg *t = &contract[i];
		for (int v = 0; v < N_VARIANTS; v++) {
			struct arena a = {0};
			struct msg m;
			fill(&m, t, v, &a);
			void *buf;
			size_t len;
			ck_assert_int_eq(msg_encode(&m, &buf, &len), 0);
			if (len <= 1200) {
				for (size_t cut = 0; cut < len; cut++) {
					struct msg out;
					char err[256] = "";
					int rc = msg_decode(buf, cut, &out, err, sizeof(err));
					TH_CHECK(rc == -EBADMSG && err[0], "%s v%d cut at %zu of %zu: rc %d (%s)", t->name,
						 v, cut, len, rc, err);
					msg_free(&out);
				}
				checked++;
			}
			free(buf);
			arena_free(&a);
		}
	}
	ck_assert_int_gt(checked, 100);
}
END_TEST

START_TEST(test_reject_version_and_type)
{
	static const uint8_t v2[] = {0x94, 0x02, 0x05, 0x01, 0x80};
	static const uint8_t v0[] = {0x94, 0x00, 0x05, 0x01, 0x80};
	static const uint8_t vbig[] = {0x94, 0xcf, 0, 0, 0, 1, 0, 0, 0, 1, 0x05, 0x01, 0x80};
	expect_reject(v2, sizeof(v2), -EPROTONOSUPPORT, "protocol version 2", "version 2");
	expect_reject(v0, sizeof(v0), -EPROTONOSUPPORT, "protocol version 0", "version 0");
	expect_reject(vbig, sizeof(vbig), -EPROTONOSUPPORT, "version", "version 2^32+1");
	/* the version is checked before the type */
	static const uint8_t v2_unknown[] = {0x94, 0x02, 0xcd, 0x03, 0xe7, 0x01, 0x80};
	expect_reject(v2_unknown, sizeof(v2_unknown), -EPROTONOSUPPORT, NULL, "version 2, type 999");
	static const uint8_t t999[] = {0x94, 0x01, 0xcd, 0x03, 0xe7, 0x01, 0x80};
	static const uint8_t t0[] = {0x94, 0x01, 0x00, 0x01, 0x80};
	static const uint8_t t10[] = {0x94, 0x01, 0x0a, 0x01, 0x80};
	/* 2^32 + 5: must not wrap to MSG_PING */
	static const uint8_t twrap[] = {0x94, 0x01, 0xcf, 0, 0, 0, 1, 0, 0, 0, 5, 0x01, 0x80};
	expect_reject(t999, sizeof(t999), -ENOMSG, "unknown message type 999", "type 999");
	expect_reject(t0, sizeof(t0), -ENOMSG, "unknown message type 0", "type 0");
	expect_reject(t10, sizeof(t10), -ENOMSG, "unknown message type 10", "type 10");
	expect_reject(twrap, sizeof(twrap), -ENOMSG, "4294967301", "type 2^32+5");
}
END_TEST

START_TEST(test_reject_body)
{
	static const uint8_t body_array[] = {0x94, 0x01, 0x05, 0x01, 0x90};
	static const uint8_t body_nil[] = {0x94, 0x01, 0x2a, 0x01, 0xc0};
	static const uint8_t body_int[] = {0x94, 0x01, 0x2a, 0x01, 0x04};
	expect_reject(body_array, sizeof(body_array), -EBADMSG, "body is not a map", "array body");
	expect_reject(body_nil, sizeof(body_nil), -EBADMSG, "MSG_KV_ALLOC: body is not a map", "nil body");
	expect_reject(body_int, sizeof(body_int), -EBADMSG, "body is not a map", "int body");
	/* keys: 0, 64, 255, 2^40, negative, a string, a float, nil */
	static const uint8_t keys[][10] = {{0x00},		 {0x40},	{0xcc, 0xff},
					   {0xcf, 0, 0, 1, 0, 0, 0, 0, 0}, {0xff},	{0xa1, '1'},
					   {0xca, 0x3f, 0x80, 0, 0}, {0xc0}};
	static const size_t klen[] = {1, 1, 2, 9, 1, 2, 5, 1};
	for (size_t i = 0; i < ARRAY_SIZE(keys); i++) {
		uint8_t buf[32] = {0x94, 0x01, 0x2a, 0x09, 0x82, 0x01, 0x04};
		size_t n = 7;
		memcpy(buf + n, keys[i], klen[i]);
		n += klen[i];
		buf[n++] = 0x01;
		char what[32];
		snprintf(what, sizeof(what), "key case %zu", i);
		expect_reject(buf, n, -EBADMSG, "keys are integers 1..63", what);
	}
	/* a duplicate key, known or unknown */
	static const uint8_t dup[] = {0x94, 0x01, 0x2a, 0x09, 0x82, 0x01, 0x04, 0x01, 0x04};
	static const uint8_t dup_unknown[] = {0x94, 0x01, 0x2a, 0x09, 0x83, 0x01, 0x04, 0x20, 0x00, 0x20, 0x00};
	expect_reject(dup, sizeof(dup), -EBADMSG, "key 1 appears twice", "duplicate key");
	expect_reject(dup_unknown, sizeof(dup_unknown), -EBADMSG, "key 32 appears twice", "duplicate unknown key");
	/* more entries than any body may have */
	uint8_t many[8 + 65 * 2] = {0x94, 0x01, 0x05, 0x01, 0xde, 0x00, 65};
	size_t n = 7;
	for (int k = 0; k < 65; k++) {
		many[n++] = (uint8_t)(k % 63 + 1);
		many[n++] = 0x00;
	}
	expect_reject(many, n, -EBADMSG, NULL, "65 keys");
}
END_TEST

/* Values of the wrong kind for some field, one packer each. */
static void pk_neg(msgpack_packer *p)
{
	msgpack_pack_int64(p, -1);
}

static void pk_float(msgpack_packer *p)
{
	msgpack_pack_double(p, 1.0);
}

static void pk_str(msgpack_packer *p)
{
	msgpack_pack_str_with_body(p, "1", 1);
}

static void pk_bin(msgpack_packer *p)
{
	msgpack_pack_bin_with_body(p, "1", 1);
}

static void pk_nil(msgpack_packer *p)
{
	msgpack_pack_nil(p);
}

static void pk_true(msgpack_packer *p)
{
	msgpack_pack_true(p);
}

static void pk_map(msgpack_packer *p)
{
	msgpack_pack_map(p, 0);
}

static void pk_empty_array(msgpack_packer *p)
{
	msgpack_pack_array(p, 0);
}

static void pk_uint(msgpack_packer *p)
{
	msgpack_pack_uint64(p, 5);
}

static void pk_big_uint(msgpack_packer *p)
{
	msgpack_pack_uint64(p, (uint64_t)INT64_MAX + 1);
}

static void pk_ext(msgpack_packer *p)
{
	msgpack_pack_ext_with_body(p, "ab", 2, 3);
}

static void pk_arr_neg(msgpack_packer *p)
{
	msgpack_pack_array(p, 2);
	msgpack_pack_uint64(p, 1);
	msgpack_pack_int64(p, -1);
}

static void pk_arr_float(msgpack_packer *p)
{
	msgpack_pack_array(p, 1);
	msgpack_pack_double(p, 1.5);
}

static void pk_arr_str(msgpack_packer *p)
{
	msgpack_pack_array(p, 1);
	msgpack_pack_str_with_body(p, "x", 1);
}

static void pk_arr_nested(msgpack_packer *p)
{
	msgpack_pack_array(p, 1);
	msgpack_pack_array(p, 1);
	msgpack_pack_uint64(p, 1);
}

static void pk_arr_nil(msgpack_packer *p)
{
	msgpack_pack_array(p, 3);
	msgpack_pack_uint64(p, 1);
	msgpack_pack_uint64(p, 2);
	msgpack_pack_nil(p);
}

START_TEST(test_reject_wrong_kinds)
{
	static const packfn bad_u64[] = {pk_neg,	pk_float, pk_str,	  pk_bin, pk_nil,
					 pk_true, pk_map,   pk_empty_array, pk_ext};
	static const packfn bad_i64[] = {pk_big_uint, pk_float, pk_str, pk_nil, pk_true, pk_empty_array, pk_ext};
	static const packfn bad_f64[] = {pk_str, pk_bin, pk_nil, pk_true, pk_map, pk_empty_array, pk_ext};
	static const packfn bad_bytes[] = {pk_uint, pk_neg, pk_float, pk_nil, pk_true, pk_map, pk_empty_array, pk_ext};
	static const packfn bad_array[] = {pk_uint, pk_str, pk_bin, pk_nil, pk_map, pk_float, pk_ext, pk_arr_neg,
					   pk_arr_float, pk_arr_str, pk_arr_nested, pk_arr_nil};
	static const struct {
		const packfn *fns;
		size_t n;
	} bad[] = {
		[T_U64] = {bad_u64, ARRAY_SIZE(bad_u64)},	  [T_I64] = {bad_i64, ARRAY_SIZE(bad_i64)},
		[T_F64] = {bad_f64, ARRAY_SIZE(bad_f64)},	  [T_BYTES] = {bad_bytes, ARRAY_SIZE(bad_bytes)},
		[T_ARRAY] = {bad_array, ARRAY_SIZE(bad_array)},
	};
	int cases = 0;
	for (int i = 0; i < N_TYPES; i++) {
		const struct tmsg *t = &contract[i];
		for (size_t j = 0; j < t->n; j++) {
			const struct tfield *f = &t->f[j];
			for (size_t b = 0; b < bad[f->kind].n; b++) {
				struct arena a = {0};
				struct msg m;
				fill(&m, t, 2, &a);
				struct edit e = {.replace_key = f->key, .replace = bad[f->kind].fns[b]};
				struct pk k;
				pack_msg(&k, &m, t, &e);
				char want[128], what[128];
				snprintf(want, sizeof(want), "field %s has the wrong type", f->name);
				snprintf(what, sizeof(what), "%s, bad value %zu", f->name, b);
				expect_reject(k.sb.data, k.sb.size, -EBADMSG, want, what);
				pk_free(&k);
				arena_free(&a);
				cases++;
			}
		}
	}
	ck_assert_int_gt(cases, 300);
}
END_TEST

START_TEST(test_reject_missing)
{
	for (int i = 0; i < N_TYPES; i++) {
		const struct tmsg *t = &contract[i];
		for (size_t j = 0; j < t->n; j++) {
			if (!t->f[j].req)
				continue;
			struct arena a = {0};
			struct msg m;
			fill(&m, t, 1, &a);
			struct edit e = {.skip_key = t->f[j].key};
			struct pk k;
			pack_msg(&k, &m, t, &e);
			char want[128];
			snprintf(want, sizeof(want), "required field %s is missing", t->f[j].name);
			expect_reject(k.sb.data, k.sb.size, -EBADMSG, want, t->f[j].name);
			pk_free(&k);
			arena_free(&a);
		}
	}
}
END_TEST

/* Fields at their limit decode; one more is refused. */
static uint32_t limit_n;
static void pk_long_str(msgpack_packer *p)
{
	char *s = calloc(1, limit_n ? limit_n : 1);
	msgpack_pack_str_with_body(p, s, limit_n);
	free(s);
}
static void pk_long_bin(msgpack_packer *p)
{
	char *s = calloc(1, limit_n ? limit_n : 1);
	msgpack_pack_bin_with_body(p, s, limit_n);
	free(s);
}
static void pk_long_array(msgpack_packer *p)
{
	msgpack_pack_array(p, limit_n);
	for (uint32_t i = 0; i < limit_n; i++)
		msgpack_pack_uint64(p, i & 0x7f);
}

START_TEST(test_reject_over_limit)
{
	for (int i = 0; i < N_TYPES; i++) {
		const struct tmsg *t = &contract[i];
		for (size_t j = 0; j < t->n; j++) {
			const struct tfield *f = &t->f[j];
			if (f->kind != T_BYTES && f->kind != T_ARRAY)
				continue;
			for (int over = 0; over <= 1; over++) {
				for (int form = 0; form < (f->kind == T_BYTES ? 2 : 1); form++) {
					struct arena a = {0};
					struct msg m, out;
					fill(&m, t, 0, &a);
					limit_n = f->max + (uint32_t)over;
					struct edit e = {.replace_key = f->key,
							 .replace = f->kind == T_ARRAY ? pk_long_array
								    : form	       ? pk_long_bin
										       : pk_long_str};
					struct pk k;
					pack_msg(&k, &m, t, &e);
					if (over) {
						char want[128];
						snprintf(want, sizeof(want), "field %s longer than %u", f->name, f->max);
						expect_reject(k.sb.data, k.sb.size, -EBADMSG, want, f->name);
					} else {
						decode_ok(k.sb.data, k.sb.size, &out, f->name);
						uint32_t n = f->kind == T_ARRAY ? ((struct u64_array *)at(&out, f))->n
										: ((struct bytes *)at(&out, f))->len;
						ck_assert_uint_eq(n, f->max);
						msg_free(&out);
					}
					pk_free(&k);
					arena_free(&a);
				}
			}
		}
	}
}
END_TEST

START_TEST(test_reject_huge_claims)
{
	/* Containers and strings that claim far more than the bytes hold fail at once, without
	 * the unpacker reserving memory for the claim: with 1 GiB of address space, a 2^32-1
	 * element array of msgpack objects (64 GiB) could never be allocated. */
#ifndef UNDER_ASAN
	struct rlimit rl = {.rlim_cur = 1ull << 30, .rlim_max = 1ull << 30};
	ck_assert_int_eq(setrlimit(RLIMIT_AS, &rl), 0);
#endif
	static const uint8_t arr32[] = {0x94, 0x01, 0x2f, 0x01, 0x81, 0x01, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01, 0x02};
	static const uint8_t map32[] = {0x94, 0x01, 0x2f, 0x01, 0xdf, 0xff, 0xff, 0xff, 0xff, 0x01, 0x90};
	static const uint8_t str32[] = {0x94, 0x01, 0x01, 0x01, 0x82, 0x01, 0x01, 0x02, 0xdb, 0xff, 0xff, 0xff, 0xff, 'x'};
	static const uint8_t bin32[] = {0x94, 0x01, 0x01, 0x01, 0x82, 0x01, 0x01, 0x02, 0xc6, 0xff, 0xff, 0xff, 0xff, 'x'};
	static const uint8_t ext32[] = {0x94, 0x01, 0x2a, 0x01, 0x82, 0x01, 0x01, 0x09, 0xc9, 0xff, 0xff, 0xff, 0xff, 1};
	static const uint8_t top32[] = {0xdd, 0xff, 0xff, 0xff, 0xff, 0x01};
	static const uint8_t arr16[] = {0x94, 0x01, 0x2f, 0x01, 0x81, 0x01, 0xdc, 0xff, 0xff, 0x01};
	expect_reject(arr32, sizeof(arr32), -EBADMSG, "claims more elements", "array32 of 2^32-1");
	expect_reject(map32, sizeof(map32), -EBADMSG, "claims more elements", "map32 of 2^32-1");
	expect_reject(str32, sizeof(str32), -EBADMSG, "past the end", "str32 of 2^32-1");
	expect_reject(bin32, sizeof(bin32), -EBADMSG, "past the end", "bin32 of 2^32-1");
	expect_reject(ext32, sizeof(ext32), -EBADMSG, "past the end", "ext32 of 2^32-1");
	expect_reject(top32, sizeof(top32), -EBADMSG, "claims more elements", "top-level array32");
	expect_reject(arr16, sizeof(arr16), -EBADMSG, "claims more elements", "array16 of 65535");
	/* A large but honest array of one-byte elements still decodes under the limit. */
	struct pk k;
	pk_init(&k);
	msgpack_pack_array(&k.p, 4);
	msgpack_pack_uint64(&k.p, 1);
	msgpack_pack_uint64(&k.p, MSG_KV_FREE);
	msgpack_pack_uint64(&k.p, 1);
	msgpack_pack_map(&k.p, 1);
	msgpack_pack_uint64(&k.p, 1);
	msgpack_pack_array(&k.p, PROTO_MAX_ARRAY);
	for (uint32_t i = 0; i < PROTO_MAX_ARRAY; i++)
		msgpack_pack_uint64(&k.p, i & 0x7f);
	struct msg out;
	decode_ok(k.sb.data, k.sb.size, &out, "2^20 handles");
	ck_assert_uint_eq(out.kv_handles.handles.n, PROTO_MAX_ARRAY);
	msg_free(&out);
	pk_free(&k);
}
END_TEST

START_TEST(test_reject_nesting_and_reserved)
{
	/* Within the depth a message can have, unknown values nest; deeper is refused. */
	uint8_t buf[2048] = {0x94, 0x01, 0x2a, 0x09, 0x82, 0x01, 0x04, 0x30};
	size_t n = 8;
	buf[n++] = 0x91;
	buf[n++] = 0x91;
	buf[n++] = 0x90; /* [[[]]] under key 48 */
	struct msg out;
	decode_ok(buf, n, &out, "three levels");
	msg_free(&out);
	n = 8;
	for (int d = 0; d < 10; d++)
		buf[n++] = 0x91;
	buf[n++] = 0x01;
	expect_reject(buf, n, -EBADMSG, "nesting too deep", "10 levels");
	memset(buf, 0x91, sizeof(buf)); /* 2048 levels: a scanner without a depth limit recurses that deep */
	expect_reject(buf, sizeof(buf), -EBADMSG, "nesting too deep", "2048 levels");
	uint8_t maps[2048];
	for (size_t i = 0; i < sizeof(maps); i += 2) {
		maps[i] = 0x81;
		maps[i + 1] = 0x01;
	}
	expect_reject(maps, sizeof(maps), -EBADMSG, "nesting too deep", "nested maps");
	/* 0xc1 is never used */
	static const uint8_t c1_value[] = {0x94, 0x01, 0x2a, 0x09, 0x82, 0x01, 0x04, 0x30, 0xc1};
	static const uint8_t c1_top[] = {0xc1};
	static const uint8_t c1_field[] = {0x94, 0x01, 0x2a, 0x09, 0x81, 0x01, 0xc1};
	expect_reject(c1_value, sizeof(c1_value), -EBADMSG, "0xc1", "0xc1 in an unknown field");
	expect_reject(c1_top, sizeof(c1_top), -EBADMSG, "0xc1", "0xc1 alone");
	expect_reject(c1_field, sizeof(c1_field), -EBADMSG, "0xc1", "0xc1 as a value");
}
END_TEST

/* ---- allocation failures ---- */

#ifndef UNDER_ASAN
/* The test binary's malloc and realloc wrap glibc's so that the N-th call after arming fails
 * (SQLite-style fault injection). Check and libc call them too, so they are armed only around
 * the call under test. */
extern void *__libc_malloc(size_t n);
extern void *__libc_realloc(void *p, size_t n);
static long fail_countdown; /* 0: off; N: the N-th allocation from now fails */
static long fail_hits;

static bool should_fail(void)
{
	if (fail_countdown > 0 && --fail_countdown == 0) {
		fail_hits++;
		return true;
	}
	return false;
}

void *malloc(size_t n)
{
	if (should_fail()) {
		errno = ENOMEM;
		return NULL;
	}
	return __libc_malloc(n);
}

void *realloc(void *p, size_t n)
{
	if (should_fail()) {
		errno = ENOMEM;
		return NULL;
	}
	return __libc_realloc(p, n);
}
#endif

START_TEST(test_out_of_memory)
{
#ifdef UNDER_ASAN
	return; /* the sanitizer owns malloc; this test runs in the plain build */
#else
	/* A message with several heap copies; fail each allocation in turn: every failure is
	 * -ENOMEM, never a crash, and the first run without a failure round-trips. */
	struct arena a = {0};
	struct msg m;
	fill(&m, &contract[16], 3, &a); /* MSG_KV_COMMIT: two arrays and bytes */
	ck_assert_uint_eq(m.type, MSG_KV_COMMIT);
	int encode_failures = 0, decode_failures = 0;
	void *buf = NULL;
	size_t len = 0;
	for (long nth = 1;; nth++) {
		fail_hits = 0;
		fail_countdown = nth;
		int rc = msg_encode(&m, &buf, &len);
		fail_countdown = 0;
		if (!fail_hits) {
			ck_assert_int_eq(rc, 0);
			break;
		}
		ck_assert_msg(rc == -ENOMEM, "allocation %ld failed: msg_encode = %d", nth, rc);
		encode_failures++;
	}
	ck_assert_int_gt(encode_failures, 0);
	for (long nth = 1;; nth++) {
		struct msg out;
		char err[256] = "";
		fail_hits = 0;
		fail_countdown = nth;
		int rc = msg_decode(buf, len, &out, err, sizeof(err));
		fail_countdown = 0;
		if (!fail_hits) {
			ck_assert_int_eq(rc, 0);
			expect_same(&m, &out, &contract[16], 3);
			msg_free(&out);
			break;
		}
		ck_assert_msg(rc == -ENOMEM, "allocation %ld failed: msg_decode = %d (%s)", nth, rc, err);
		ck_assert_ptr_null(out.kv_commit.handles.v);
		ck_assert_ptr_null(out.kv_commit.keys.v);
		ck_assert_ptr_null(out.kv_commit.events.p);
		msg_free(&out);
		decode_failures++;
	}
	ck_assert_int_ge(decode_failures, 3); /* at least the three heap copies */
	free(buf);
	arena_free(&a);
#endif
}
END_TEST

/* ---- fuzz ---- */

static uint64_t rng_state;

static uint64_t rnd(void)
{
	uint64_t x = rng_state;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return rng_state = x;
}

static const uint8_t interesting[] = {0x00, 0x01, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1,
				      0xc4, 0xc7, 0xca, 0xcb, 0xcc, 0xcf, 0xd3, 0xd4, 0xd9, 0xdc, 0xdd,
				      0xde, 0xdf, 0xe0, 0xff, 0x94, 0x3f};

START_TEST(test_fuzz)
{
	/* Seeds: every type, small variants (a few hundred bytes at most). */
	enum { MAX_SEEDS = 128, BUF = 4096 };
	uint8_t *seeds[MAX_SEEDS];
	size_t seed_len[MAX_SEEDS];
	int n_seeds = 0;
	for (int i = 0; i < N_TYPES; i++) {
		for (int v = 0; v < N_VARIANTS && n_seeds < MAX_SEEDS; v++) {
			struct arena a = {0};
			struct msg m;
			fill(&m, &contract[i], v, &a);
			void *buf;
			size_t len;
			ck_assert_int_eq(msg_encode(&m, &buf, &len), 0);
			if (len <= 512) {
				seeds[n_seeds] = buf;
				seed_len[n_seeds++] = len;
			} else {
				free(buf);
			}
			arena_free(&a);
		}
	}
	ck_assert_int_gt(n_seeds, 50);
	rng_state = 0x2545f4914f6cdd1dull;
	uint8_t *buf = malloc(BUF);
	ck_assert_ptr_nonnull(buf);
	long accepted = 0, rejected = 0;
	for (long iter = 0; iter < 200000; iter++) {
		size_t len;
		uint64_t r = rnd();
		if (r % 8 == 0) { /* random bytes, often starting like a message */
			len = rnd() % 64;
			for (size_t j = 0; j < len; j++)
				buf[j] = (uint8_t)rnd();
			if (len && (r & 0x100))
				buf[0] = 0x94;
			if (len > 1 && (r & 0x200))
				buf[1] = 0x01;
		} else { /* a mutated valid message */
			int s = (int)(rnd() % (uint64_t)n_seeds);
			len = seed_len[s];
			memcpy(buf, seeds[s], len);
			int edits = 1 + (int)(rnd() % 4);
			for (int e = 0; e < edits; e++) {
				uint64_t what = rnd() % 6;
				size_t pos = len ? (size_t)(rnd() % len) : 0;
				if (what == 0 && len) { /* bit flip */
					buf[pos] ^= (uint8_t)(1u << (rnd() % 8));
				} else if (what == 1 && len) { /* an interesting byte */
					buf[pos] = interesting[rnd() % sizeof(interesting)];
				} else if (what == 2) { /* truncate */
					len = pos;
				} else if (what == 3 && len + 8 < BUF) { /* insert bytes */
					size_t k = 1 + (size_t)(rnd() % 8);
					memmove(buf + pos + k, buf + pos, len - pos);
					for (size_t j = 0; j < k; j++)
						buf[pos + j] = (uint8_t)rnd();
					len += k;
				} else if (what == 4 && len) { /* delete a byte */
					memmove(buf + pos, buf + pos + 1, len - pos - 1);
					len--;
				} else if (what == 5 && len && len * 2 < BUF) { /* duplicate a tail */
					size_t k = len - pos;
					memcpy(buf + len, buf + pos, k);
					len += k;
				}
			}
		}
		struct msg out;
		char err[256] = "";
		int rc = msg_decode(buf, len, &out, err, sizeof(err));
		if (rc == 0) {
			/* what decodes re-encodes, and that decodes to the same */
			void *again;
			size_t again_len;
			int erc = msg_encode(&out, &again, &again_len);
			TH_CHECK(erc == 0, "iteration %ld: decoded message does not re-encode: %d", iter, erc);
			struct msg out2;
			int drc = msg_decode(again, again_len, &out2, err, sizeof(err));
			TH_CHECK(drc == 0, "iteration %ld: re-encoding does not decode: %s", iter, err);
			void *third;
			size_t third_len;
			TH_CHECK(msg_encode(&out2, &third, &third_len) == 0, "iteration %ld", iter);
			TH_CHECK(third_len == again_len && memcmp(third, again, again_len) == 0,
				 "iteration %ld: encoding not stable", iter);
			free(third);
			free(again);
			msg_free(&out2);
			accepted++;
		} else {
			TH_CHECK(rc == -EBADMSG || rc == -ENOMSG || rc == -EPROTONOSUPPORT,
				 "iteration %ld: unexpected rc %d (%s)", iter, rc, err);
			TH_CHECK(err[0], "iteration %ld: rc %d without a message", iter, rc);
			rejected++;
		}
		msg_free(&out);
		msg_free(&out);
	}
	ck_assert_int_gt(accepted, 1000); /* the mutations keep some messages valid (unknown keys etc.) */
	ck_assert_int_gt(rejected, 100000);
	free(buf);
	for (int i = 0; i < n_seeds; i++)
		free(seeds[i]);
}
END_TEST

static Suite *codec_suite(void)
{
	Suite *s = suite_create("codec");
	TCase *tc = tcase_create("round_trip");
	tcase_add_test(tc, test_catalogue_complete);
	tcase_add_loop_test(tc, test_round_trip, 0, N_TYPES);
	tcase_add_test(tc, test_optional_fields);
	tcase_add_test(tc, test_alternative_encodings);
	tcase_add_test(tc, test_unknown_keys_skipped);
	tcase_add_test(tc, test_make_error_and_init);
	tcase_add_test(tc, test_config_messages);
	tcase_add_test(tc, test_encode_refuses);
	suite_add_tcase(s, tc);
	tc = tcase_create("reject");
	tcase_add_test(tc, test_reject_framing);
	tcase_add_test(tc, test_reject_truncations);
	tcase_add_test(tc, test_reject_version_and_type);
	tcase_add_test(tc, test_reject_body);
	tcase_add_test(tc, test_reject_wrong_kinds);
	tcase_add_test(tc, test_reject_missing);
	tcase_add_test(tc, test_reject_over_limit);
	tcase_add_test(tc, test_reject_huge_claims);
	tcase_add_test(tc, test_reject_nesting_and_reserved);
	suite_add_tcase(s, tc);
	tc = tcase_create("faults");
	tcase_add_test(tc, test_out_of_memory);
	suite_add_tcase(s, tc);
	tc = tcase_create("fuzz");
	tcase_add_test(tc, test_fuzz);
	tcase_set_timeout(tc, 60);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(codec_suite());
}

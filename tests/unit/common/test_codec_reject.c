/* test_codec_reject.c - common/codec.c: every way a decoder must refuse bytes (framing,
 * truncation, version and type, body, kinds, missing fields, limits, huge claims, nesting). */
#include <check.h>
#include <errno.h>
#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "common/protocol.h"
#include "common/util.h"
#include "tests/unit/common/codec_test_util.h"
#include "tests/unit/common/test_helpers.h"

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

int main(void)
{
	TCase *tc = tcase_create("reject");
	tcase_add_test(tc, test_reject_framing);
	tcase_add_test(tc, test_reject_truncations);
	tcase_add_test(tc, test_reject_version_and_type);
	tcase_add_test(tc, test_reject_body);
	tcase_add_test(tc, test_reject_wrong_kinds);
	tcase_add_test(tc, test_reject_missing);
	tcase_add_test(tc, test_reject_over_limit);
	tcase_add_test(tc, test_reject_huge_claims);
	tcase_add_test(tc, test_reject_nesting_and_reserved);
	return codec_run(tc);
}

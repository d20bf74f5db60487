/* test_codec_round_trip.c - common/codec.c: every message of protocol.h on the wire and back
 * (the encoder's bytes compared with bytes packed by hand from the contract of
 * codec_test_util.h), the spellings and unknown keys a decoder takes, and what the encoder
 * refuses. */
#include <check.h>
#include <errno.h>
#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/protocol.h"
#include "common/util.h"
#include "tests/unit/common/codec_test_util.h"
#include "tests/unit/common/test_helpers.h"

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

int main(void)
{
	TCase *tc = tcase_create("round_trip");
	tcase_add_test(tc, test_catalogue_complete);
	tcase_add_loop_test(tc, test_round_trip, 0, N_TYPES);
	tcase_add_test(tc, test_optional_fields);
	tcase_add_test(tc, test_alternative_encodings);
	tcase_add_test(tc, test_unknown_keys_skipped);
	tcase_add_test(tc, test_make_error_and_init);
	tcase_add_test(tc, test_config_messages);
	tcase_add_test(tc, test_encode_refuses);
	return codec_run(tc);
}

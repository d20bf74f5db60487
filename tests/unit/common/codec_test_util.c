/* codec_test_util.c - what the codec tests share (codec_test_util.h): the wire contract
 * written down from protocol.h, messages filled from it, and messages packed by hand from it. */
#include <check.h>
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
#include "tests/unit/common/codec_test_util.h"
#include "tests/unit/common/test_helpers.h"

/* A checked fixture: it runs in each test's forked process, whose CPU time starts at zero. */
static void limit_cpu(void)
{
	struct rlimit rl = {.rlim_cur = CODEC_TEST_CPU_S, .rlim_max = CODEC_TEST_CPU_S + 1};
	int rc = setrlimit(RLIMIT_CPU, &rl);
	ck_assert_msg(rc == 0, "setrlimit(RLIMIT_CPU): %d", rc);
}

int codec_run(TCase *tc)
{
	tcase_set_timeout(tc, 0); /* no wall-clock limit */
	tcase_add_checked_fixture(tc, limit_cpu, NULL);
	Suite *s = suite_create("codec");
	suite_add_tcase(s, tc);
	return th_run(s);
}

/* ---- the wire contract ---- */

#define TF(key, kind, req, max, member) {key, kind, req, max, offsetof(struct msg, member), #member}

static const struct tfield t_error[] = {TF(1, T_I64, true, 0, error.code), TF(2, T_BYTES, true, 4096, error.text)};
static const struct tfield t_hello[] = {TF(1, T_BYTES, true, 64, hello.client), TF(2, T_U64, true, 0, hello.proto),
					TF(3, T_U64, false, 0, hello.session)};
static const struct tfield t_kv_lookup[] = {TF(1, T_ARRAY, true, PROTO_MAX_ARRAY, kv_lookup.keys),
					    TF(2, T_U64, false, 0, kv_lookup.session)};
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
					    TF(2, T_ARRAY, false, 65536, w_acquire.release),
					    TF(3, T_U64, false, 0, w_acquire.session)};
static const struct tfield t_w_grant[] = {TF(1, T_U64, true, 0, w_grant.group), TF(2, T_U64, true, 0, w_grant.slot),
					  TF(3, T_U64, true, 0, w_grant.generation),
					  TF(4, T_U64, true, 0, w_grant.offset), TF(5, T_U64, true, 0, w_grant.bytes)};
static const struct tfield t_w_release[] = {TF(1, T_ARRAY, true, 65536, w_release.groups),
					    TF(2, T_U64, false, 0, w_release.session)};
static const struct tfield t_kv_configure[] = {TF(1, T_U64, true, 0, kv_configure.block_bytes),
					       TF(2, T_U64, true, 0, kv_configure.manifest_hash)};
static const struct tfield t_kv_pool[] = {
	TF(1, T_BYTES, true, 255, kv_pool.shm_name), TF(2, T_U64, true, 0, kv_pool.shm_size),
	TF(3, T_U64, true, 0, kv_pool.n_blocks), TF(4, T_U64, true, 0, kv_pool.block_bytes),
	TF(5, T_U64, true, 0, kv_pool.epoch)};
static const struct tfield t_kv_alloc[] = {TF(1, T_U64, true, 0, kv_alloc.count),
					   TF(2, T_U64, false, 0, kv_alloc.session)};
static const struct tfield t_kv_blocks[] = {TF(1, T_ARRAY, true, PROTO_MAX_ARRAY, kv_blocks.handles),
					    TF(2, T_ARRAY, true, PROTO_MAX_ARRAY, kv_blocks.offsets)};
static const struct tfield t_kv_commit[] = {TF(1, T_ARRAY, true, PROTO_MAX_ARRAY, kv_commit.handles),
					    TF(2, T_ARRAY, false, PROTO_MAX_ARRAY, kv_commit.keys),
					    TF(3, T_BYTES, false, PROTO_MAX_STR, kv_commit.events),
					    TF(4, T_U64, false, 0, kv_commit.session)};
static const struct tfield t_kv_handles[] = {TF(1, T_ARRAY, true, PROTO_MAX_ARRAY, kv_handles.handles),
					     TF(2, T_U64, false, 0, kv_handles.session)};
static const struct tfield t_kv_unpin_all[] = {TF(2, T_U64, false, 0, kv_handles.session)};
static const struct tfield t_generate[] = {
	TF(1, T_ARRAY, false, PROTO_MAX_ARRAY, generate.tokens), TF(2, T_U64, true, 0, generate.max_new),
	TF(3, T_F64, false, 0, generate.temperature), TF(4, T_U64, false, 0, generate.top_k),
	TF(5, T_F64, false, 0, generate.top_p), TF(6, T_U64, false, 0, generate.seed),
	TF(7, T_ARRAY, false, 1024, generate.stop_ids), TF(8, T_BYTES, false, PROTO_MAX_STR, generate.prompt),
	TF(9, T_BYTES, false, PROTO_MAX_STR, generate.chat), TF(10, T_U64, false, 0, generate.flags),
	TF(11, T_F64, false, 0, generate.min_p), TF(12, T_F64, false, 0, generate.repetition_penalty),
	TF(13, T_BYTES, false, 65536, generate.stop_strings), TF(14, T_ARRAY, false, PROTO_MAX_ARRAY, generate.done)};
static const struct tfield t_token[] = {TF(1, T_U64, true, 0, token.index), TF(2, T_U64, true, 0, token.token),
					TF(3, T_BYTES, false, 65536, token.text)};
static const struct tfield t_logits[] = {TF(1, T_U64, true, 0, logits.position),
					 TF(2, T_BYTES, true, PROTO_MAX_STR, logits.values)};
static const struct tfield t_gen_done[] = {
	TF(1, T_U64, true, 0, gen_done.n_prompt), TF(2, T_U64, true, 0, gen_done.n_generated),
	TF(3, T_BYTES, true, 64, gen_done.reason), TF(4, T_F64, true, 0, gen_done.prefill_ms),
	TF(5, T_F64, true, 0, gen_done.decode_ms), TF(6, T_BYTES, false, 64, gen_done.text)};
static const struct tfield t_stage_setup[] = {
	TF(1, T_U64, true, 0, stage_setup.formation), TF(2, T_U64, true, 0, stage_setup.rank),
	TF(3, T_U64, true, 0, stage_setup.ranks), TF(4, T_U64, true, 0, stage_setup.layer0),
	TF(5, T_U64, true, 0, stage_setup.layer1), TF(6, T_U64, true, 0, stage_setup.manifest_hash),
	TF(7, T_U64, true, 0, stage_setup.max_chunk), TF(8, T_U64, true, 0, stage_setup.block_tokens),
	TF(9, T_U64, true, 0, stage_setup.kv_dtype), TF(10, T_U64, true, 0, stage_setup.max_context),
	TF(11, T_BYTES, true, 16, stage_setup.backend), TF(12, T_BYTES, true, 16, stage_setup.link),
	TF(13, T_BYTES, false, 255, stage_setup.link_name), TF(14, T_BYTES, false, 128, stage_setup.nccl_id),
	TF(15, T_ARRAY, true, 8, stage_setup.pids), TF(16, T_U64, true, 0, stage_setup.kv_session)};
static const struct tfield t_stage_ready[] = {
	TF(1, T_U64, true, 0, stage_ready.rank), TF(2, T_U64, true, 0, stage_ready.pid),
	TF(3, T_U64, true, 0, stage_ready.layer0), TF(4, T_U64, true, 0, stage_ready.layer1),
	TF(5, T_BYTES, false, 1024, stage_ready.plan)};
static const struct tfield t_stage_seq[] = {
	TF(1, T_U64, true, 0, stage_seq.formation), TF(2, T_U64, true, 0, stage_seq.op),
	TF(3, T_ARRAY, false, PROTO_MAX_ARRAY, stage_seq.tokens), TF(4, T_U64, false, 0, stage_seq.limit),
	TF(5, T_U64, false, 0, stage_seq.seed)};
static const struct tfield t_stage_step[] = {
	TF(1, T_U64, true, 0, stage_step.formation), TF(2, T_U64, true, 0, stage_step.step),
	TF(3, T_U64, true, 0, stage_step.pos0), TF(4, T_U64, false, 0, stage_step.flags),
	TF(5, T_ARRAY, true, 65536, stage_step.tokens)};
static const struct tfield t_stage_done[] = {TF(1, T_U64, false, 0, stage_done.value)};

#define TM(type, fields) {type, #type, fields, ARRAY_SIZE(fields)}
#define TM0(type) {type, #type, NULL, 0}
const struct tmsg contract[] = {
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
	TM(MSG_KV_UNPIN_ALL, t_kv_unpin_all),
	TM(MSG_GENERATE, t_generate),
	TM(MSG_TOKEN, t_token),
	TM(MSG_GEN_DONE, t_gen_done),
	TM(MSG_LOGITS, t_logits),
	/* appended: the indexes above are used by test_out_of_memory */
	TM(MSG_CONFIG_GET, t_config_get),
	TM(MSG_CONFIG, t_config),
	TM(MSG_CONFIG_SET, t_config_set),
	TM(MSG_STAGE_SETUP, t_stage_setup),
	TM(MSG_STAGE_READY, t_stage_ready),
	TM(MSG_STAGE_SEQ, t_stage_seq),
	TM(MSG_STAGE_STEP, t_stage_step),
	TM(MSG_STAGE_DONE, t_stage_done),
};

const int contract_n = (int)ARRAY_SIZE(contract);

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

static void *arena_alloc(struct arena *a, size_t n)
{
	ck_assert_int_lt(a->n, 16);
	void *p = malloc(n ? n : 1);
	ck_assert_ptr_nonnull(p);
	a->p[a->n++] = p;
	return p;
}

void arena_free(struct arena *a)
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
void fill(struct msg *m, const struct tmsg *t, int v, struct arena *a)
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
void expect_same(const struct msg *a, const struct msg *b, const struct tmsg *t, int v)
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

void pk_init(struct pk *k)
{
	msgpack_sbuffer_init(&k->sb);
	msgpack_packer_init(&k->p, &k->sb, msgpack_sbuffer_write);
}

void pk_free(struct pk *k)
{
	msgpack_sbuffer_destroy(&k->sb);
}

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

void pack_msg(struct pk *k, const struct msg *m, const struct tmsg *t, const struct edit *e)
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
void expect_reject(const void *buf, size_t len, int rc, const char *want, const char *what)
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

int decode_ok(const void *buf, size_t len, struct msg *out, const char *what)
{
	char err[256] = "";
	int rc = msg_decode(buf, len, out, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s: msg_decode = %d: %s", what, rc, err);
	return rc;
}

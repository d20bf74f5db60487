/* codec.c - the one msgpack codec for every message in protocol.h.
 *
 * Each message type is described by a table of fields (key, kind, limits, where the value
 * lives in struct msg); one encoder and one decoder walk those tables. Before msgpack-c
 * unpacks anything, a bounds scan walks the raw bytes and rejects nesting deeper than a
 * message can have, containers whose declared length exceeds the bytes left, and more
 * elements in total than any message holds, so no input can make the unpacker allocate
 * more than a small multiple of the input size. */
#include "common/protocol.h"
#include "common/util.h"

#include <errno.h>
#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum field_kind { F_U64 = 1, F_I64, F_F64, F_BYTES, F_U64_ARRAY };

struct field_desc {
	uint8_t key;
	uint8_t kind;
	bool required;
	uint32_t max; /* F_BYTES: bytes; F_U64_ARRAY: elements */
	size_t offset; /* in struct msg */
	const char *name;
};

struct msg_desc {
	uint32_t type;
	const char *name;
	const struct field_desc *fields;
	size_t n_fields;
};

#define FLD(key, kind, req, max, member) {key, kind, req, max, offsetof(struct msg, member), #member}
#define REQ true
#define OPT false

static const struct field_desc f_error[] = {
	FLD(1, F_I64, REQ, 0, error.code),
	FLD(2, F_BYTES, REQ, 4096, error.text),
};
static const struct field_desc f_hello[] = {
	FLD(1, F_BYTES, REQ, 64, hello.client),
	FLD(2, F_U64, REQ, 0, hello.proto),
	FLD(3, F_U64, OPT, 0, hello.session),
};
static const struct field_desc f_hello_reply[] = {
	FLD(1, F_BYTES, REQ, 64, hello_reply.service),  FLD(2, F_U64, REQ, 0, hello_reply.pid),
	FLD(3, F_U64, REQ, 0, hello_reply.epoch),       FLD(4, F_U64, REQ, 0, hello_reply.layout),
	FLD(5, F_U64, REQ, 0, hello_reply.manifest_hash), FLD(6, F_BYTES, REQ, 255, hello_reply.shm_name),
	FLD(7, F_U64, REQ, 0, hello_reply.shm_size),
};
static const struct field_desc f_stats[] = {
	FLD(1, F_BYTES, REQ, 64, stats.service),
	FLD(2, F_BYTES, REQ, PROTO_MAX_STR, stats.json),
};
static const struct field_desc f_heartbeat[] = {
	FLD(1, F_BYTES, REQ, 64, heartbeat.service), FLD(2, F_U64, REQ, 0, heartbeat.pid),
	FLD(3, F_U64, REQ, 0, heartbeat.epoch),      FLD(4, F_U64, REQ, 0, heartbeat.seq),
	FLD(5, F_U64, REQ, 0, heartbeat.uptime_ms),
};
static const struct field_desc f_config_get[] = {
	FLD(1, F_BYTES, OPT, 16384, config_get.keys),
};
static const struct field_desc f_config[] = {
	FLD(1, F_BYTES, REQ, 64, config.service),
	FLD(2, F_BYTES, REQ, 1u << 18, config.json),
};
static const struct field_desc f_config_set[] = {
	FLD(1, F_BYTES, REQ, 65536, config_set.settings),
};
static const struct field_desc f_w_acquire[] = {
	FLD(1, F_U64_ARRAY, REQ, 65536, w_acquire.groups),
	FLD(2, F_U64_ARRAY, OPT, 65536, w_acquire.release),
	FLD(3, F_U64, OPT, 0, w_acquire.session),
};
static const struct field_desc f_w_grant[] = {
	FLD(1, F_U64, REQ, 0, w_grant.group),  FLD(2, F_U64, REQ, 0, w_grant.slot),
	FLD(3, F_U64, REQ, 0, w_grant.generation), FLD(4, F_U64, REQ, 0, w_grant.offset),
	FLD(5, F_U64, REQ, 0, w_grant.bytes),
};
static const struct field_desc f_w_release[] = {
	FLD(1, F_U64_ARRAY, REQ, 65536, w_release.groups),
	FLD(2, F_U64, OPT, 0, w_release.session),
};
static const struct field_desc f_kv_configure[] = {
	FLD(1, F_U64, REQ, 0, kv_configure.block_bytes),
	FLD(2, F_U64, REQ, 0, kv_configure.manifest_hash),
};
static const struct field_desc f_kv_pool[] = {
	FLD(1, F_BYTES, REQ, 255, kv_pool.shm_name), FLD(2, F_U64, REQ, 0, kv_pool.shm_size),
	FLD(3, F_U64, REQ, 0, kv_pool.n_blocks),     FLD(4, F_U64, REQ, 0, kv_pool.block_bytes),
	FLD(5, F_U64, REQ, 0, kv_pool.epoch),
};
static const struct field_desc f_kv_alloc[] = {
	FLD(1, F_U64, REQ, 0, kv_alloc.count),
	FLD(2, F_U64, OPT, 0, kv_alloc.session),
};
static const struct field_desc f_kv_blocks[] = {
	FLD(1, F_U64_ARRAY, REQ, 1u << 20, kv_blocks.handles),
	FLD(2, F_U64_ARRAY, REQ, 1u << 20, kv_blocks.offsets),
};
static const struct field_desc f_kv_commit[] = {
	FLD(1, F_U64_ARRAY, REQ, 1u << 20, kv_commit.handles),
	FLD(2, F_U64_ARRAY, OPT, 1u << 20, kv_commit.keys),
	FLD(3, F_BYTES, OPT, PROTO_MAX_STR, kv_commit.events),
	FLD(4, F_U64, OPT, 0, kv_commit.session),
};
static const struct field_desc f_kv_handles[] = {
	FLD(1, F_U64_ARRAY, REQ, 1u << 20, kv_handles.handles),
	FLD(2, F_U64, OPT, 0, kv_handles.session),
};
static const struct field_desc f_kv_unpin_all[] = {
	FLD(2, F_U64, OPT, 0, kv_handles.session),
};
static const struct field_desc f_kv_lookup[] = {
	FLD(1, F_U64_ARRAY, REQ, 1u << 20, kv_lookup.keys),
	FLD(2, F_U64, OPT, 0, kv_lookup.session),
};
static const struct field_desc f_generate[] = {
	FLD(1, F_U64_ARRAY, OPT, 1u << 20, generate.tokens), FLD(2, F_U64, REQ, 0, generate.max_new),
	FLD(3, F_F64, OPT, 0, generate.temperature),	      FLD(4, F_U64, OPT, 0, generate.top_k),
	FLD(5, F_F64, OPT, 0, generate.top_p),		      FLD(6, F_U64, OPT, 0, generate.seed),
	FLD(7, F_U64_ARRAY, OPT, 1024, generate.stop_ids),   FLD(8, F_BYTES, OPT, PROTO_MAX_STR, generate.prompt),
	FLD(9, F_BYTES, OPT, PROTO_MAX_STR, generate.chat),   FLD(10, F_U64, OPT, 0, generate.flags),
	FLD(11, F_F64, OPT, 0, generate.min_p),		      FLD(12, F_F64, OPT, 0, generate.repetition_penalty),
	FLD(13, F_BYTES, OPT, 65536, generate.stop_strings), FLD(14, F_U64_ARRAY, OPT, 1u << 20, generate.done),
};
static const struct field_desc f_token[] = {
	FLD(1, F_U64, REQ, 0, token.index),
	FLD(2, F_U64, REQ, 0, token.token),
	FLD(3, F_BYTES, OPT, 65536, token.text),
};
static const struct field_desc f_logits[] = {
	FLD(1, F_U64, REQ, 0, logits.position),
	FLD(2, F_BYTES, REQ, PROTO_MAX_STR, logits.values),
};
static const struct field_desc f_gen_done[] = {
	FLD(1, F_U64, REQ, 0, gen_done.n_prompt),   FLD(2, F_U64, REQ, 0, gen_done.n_generated),
	FLD(3, F_BYTES, REQ, 64, gen_done.reason),  FLD(4, F_F64, REQ, 0, gen_done.prefill_ms),
	FLD(5, F_F64, REQ, 0, gen_done.decode_ms), FLD(6, F_BYTES, OPT, 64, gen_done.text),
};
static const struct field_desc f_stage_setup[] = {
	FLD(1, F_U64, REQ, 0, stage_setup.formation),	  FLD(2, F_U64, REQ, 0, stage_setup.rank),
	FLD(3, F_U64, REQ, 0, stage_setup.ranks),	  FLD(4, F_U64, REQ, 0, stage_setup.layer0),
	FLD(5, F_U64, REQ, 0, stage_setup.layer1),	  FLD(6, F_U64, REQ, 0, stage_setup.manifest_hash),
	FLD(7, F_U64, REQ, 0, stage_setup.max_chunk),	  FLD(8, F_U64, REQ, 0, stage_setup.block_tokens),
	FLD(9, F_U64, REQ, 0, stage_setup.kv_dtype),	  FLD(10, F_U64, REQ, 0, stage_setup.max_context),
	FLD(11, F_BYTES, REQ, 16, stage_setup.backend),	  FLD(12, F_BYTES, REQ, 16, stage_setup.link),
	FLD(13, F_BYTES, OPT, 255, stage_setup.link_name), FLD(14, F_BYTES, OPT, 128, stage_setup.nccl_id),
	FLD(15, F_U64_ARRAY, REQ, 8, stage_setup.pids),	  FLD(16, F_U64, REQ, 0, stage_setup.kv_session),
};
static const struct field_desc f_stage_ready[] = {
	FLD(1, F_U64, REQ, 0, stage_ready.rank),   FLD(2, F_U64, REQ, 0, stage_ready.pid),
	FLD(3, F_U64, REQ, 0, stage_ready.layer0), FLD(4, F_U64, REQ, 0, stage_ready.layer1),
	FLD(5, F_BYTES, OPT, 1024, stage_ready.plan),
};
static const struct field_desc f_stage_seq[] = {
	FLD(1, F_U64, REQ, 0, stage_seq.formation), FLD(2, F_U64, REQ, 0, stage_seq.op),
	FLD(3, F_U64_ARRAY, OPT, 1u << 20, stage_seq.tokens), FLD(4, F_U64, OPT, 0, stage_seq.limit),
	FLD(5, F_U64, OPT, 0, stage_seq.seed),
};
static const struct field_desc f_stage_step[] = {
	FLD(1, F_U64, REQ, 0, stage_step.formation), FLD(2, F_U64, REQ, 0, stage_step.step),
	FLD(3, F_U64, REQ, 0, stage_step.pos0),	     FLD(4, F_U64, OPT, 0, stage_step.flags),
	FLD(5, F_U64_ARRAY, REQ, 65536, stage_step.tokens),
};
static const struct field_desc f_stage_done[] = {
	FLD(1, F_U64, OPT, 0, stage_done.value),
};

#define DESC(type, fields) {type, #type, fields, sizeof(fields) / sizeof(fields[0])}
#define DESC0(type) {type, #type, NULL, 0}
static const struct msg_desc catalogue[] = {
	DESC(MSG_ERROR, f_error),
	DESC0(MSG_OK),
	DESC(MSG_HELLO, f_hello),
	DESC(MSG_HELLO_REPLY, f_hello_reply),
	DESC0(MSG_PING),
	DESC0(MSG_STATS_GET),
	DESC(MSG_STATS, f_stats),
	DESC0(MSG_SHUTDOWN),
	DESC(MSG_HEARTBEAT, f_heartbeat),
	DESC(MSG_CONFIG_GET, f_config_get),
	DESC(MSG_CONFIG, f_config),
	DESC(MSG_CONFIG_SET, f_config_set),
	DESC(MSG_W_ACQUIRE, f_w_acquire),
	DESC(MSG_W_GRANT, f_w_grant),
	DESC(MSG_W_RELEASE, f_w_release),
	DESC(MSG_KV_CONFIGURE, f_kv_configure),
	DESC(MSG_KV_POOL, f_kv_pool),
	DESC(MSG_KV_ALLOC, f_kv_alloc),
	DESC(MSG_KV_BLOCKS, f_kv_blocks),
	DESC(MSG_KV_COMMIT, f_kv_commit),
	DESC(MSG_KV_FETCH, f_kv_handles),
	DESC(MSG_KV_UNPIN, f_kv_handles),
	DESC(MSG_KV_FREE, f_kv_handles),
	DESC(MSG_KV_LOOKUP, f_kv_lookup),
	DESC(MSG_KV_UNPIN_ALL, f_kv_unpin_all),
	DESC(MSG_GENERATE, f_generate),
	DESC(MSG_TOKEN, f_token),
	DESC(MSG_GEN_DONE, f_gen_done),
	DESC(MSG_LOGITS, f_logits),
	DESC(MSG_STAGE_SETUP, f_stage_setup),
	DESC(MSG_STAGE_READY, f_stage_ready),
	DESC(MSG_STAGE_SEQ, f_stage_seq),
	DESC(MSG_STAGE_STEP, f_stage_step),
	DESC(MSG_STAGE_DONE, f_stage_done),
};

static const struct msg_desc *find_desc(uint32_t type)
{
	for (size_t i = 0; i < sizeof(catalogue) / sizeof(catalogue[0]); i++)
		if (catalogue[i].type == type)
			return &catalogue[i];
	return NULL;
}

const char *msg_type_name(uint32_t type)
{
	const struct msg_desc *d = find_desc(type);
	return d ? d->name : "unknown";
}

uint64_t *msg_kv_session(const struct msg *m)
{
	struct msg *w = (struct msg *)m;
	switch (m->type) {
	case MSG_KV_ALLOC:
		return &w->kv_alloc.session;
	case MSG_KV_COMMIT:
		return &w->kv_commit.session;
	case MSG_KV_FETCH:
	case MSG_KV_UNPIN:
	case MSG_KV_FREE:
	case MSG_KV_UNPIN_ALL:
		return &w->kv_handles.session;
	case MSG_KV_LOOKUP:
		return &w->kv_lookup.session;
	default:
		return NULL;
	}
}

void msg_init(struct msg *m, uint32_t type, uint64_t corr)
{
	memset(m, 0, sizeof(*m));
	m->type = type;
	m->corr = corr;
}

void msg_make_error(struct msg *m, uint64_t corr, int code, const char *text)
{
	msg_init(m, MSG_ERROR, corr);
	m->error.code = code;
	m->error.text.p = (char *)text;
	m->error.text.len = (uint32_t)strlen(text);
}

/* ---- encoding ---- */

static int pack_field(msgpack_packer *pk, const struct msg *m, const struct field_desc *f)
{
	const char *base = (const char *)m + f->offset;
	int rc = msgpack_pack_uint8(pk, f->key);
	if (rc)
		return rc;
	switch (f->kind) {
	case F_U64:
		return msgpack_pack_uint64(pk, *(const uint64_t *)base);
	case F_I64:
		return msgpack_pack_int64(pk, *(const int64_t *)base);
	case F_F64:
		return msgpack_pack_double(pk, *(const double *)base);
	case F_BYTES: {
		const struct bytes *b = (const struct bytes *)base;
		if (b->len > f->max || (b->len && !b->p))
			return -EINVAL;
		rc = msgpack_pack_str(pk, b->len);
		return rc ? rc : msgpack_pack_str_body(pk, b->p, b->len);
	}
	case F_U64_ARRAY: {
		const struct u64_array *a = (const struct u64_array *)base;
		if (a->n > f->max || (a->n && !a->v))
			return -EINVAL;
		rc = msgpack_pack_array(pk, a->n);
		for (uint32_t i = 0; !rc && i < a->n; i++)
			rc = msgpack_pack_uint64(pk, a->v[i]);
		return rc;
	}
	}
	return -EINVAL;
}

int msg_encode(const struct msg *m, void **buf, size_t *len)
{
	const struct msg_desc *d = find_desc(m->type);
	if (!d)
		return -EINVAL;
	msgpack_sbuffer sb;
	msgpack_sbuffer_init(&sb);
	msgpack_packer pk;
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	int rc = msgpack_pack_array(&pk, 4);
	rc = rc ? rc : msgpack_pack_uint32(&pk, PROTO_VERSION);
	rc = rc ? rc : msgpack_pack_uint32(&pk, m->type);
	rc = rc ? rc : msgpack_pack_uint64(&pk, m->corr);
	rc = rc ? rc : msgpack_pack_map(&pk, d->n_fields);
	for (size_t i = 0; !rc && i < d->n_fields; i++)
		rc = pack_field(&pk, m, &d->fields[i]);
	if (rc == 0 && sb.size > PROTO_MAX_MSG_BYTES)
		rc = -EINVAL;
	if (rc) {
		msgpack_sbuffer_destroy(&sb);
		/* pack_field says -EINVAL; msgpack-c says -1 when the buffer cannot grow. */
		return rc == -EINVAL ? rc : -ENOMEM;
	}
	*len = sb.size;
	*buf = msgpack_sbuffer_release(&sb);
	msgpack_sbuffer_destroy(&sb);
	return 0;
}

/* ---- bounds scan over raw msgpack bytes ---- */

#define SCAN_MAX_DEPTH 4
#define SCAN_MAX_ELEMENTS (PROTO_MAX_ARRAY * 4u + 1024u)

struct scan {
	const uint8_t *p, *end;
	uint64_t elements;
	const char *why;
};

static uint64_t be_read(const uint8_t *p, int n)
{
	uint64_t v = 0;
	for (int i = 0; i < n; i++)
		v = (v << 8) | p[i];
	return v;
}

/* Skips one value; returns 0 or -1 with s->why set. */
static int scan_value(struct scan *s, int depth)
{
	if (depth > SCAN_MAX_DEPTH) {
		s->why = "nesting too deep";
		return -1;
	}
	if (s->p >= s->end) {
		s->why = "truncated";
		return -1;
	}
	if (++s->elements > SCAN_MAX_ELEMENTS) {
		s->why = "too many elements";
		return -1;
	}
	uint8_t b = *s->p++;
	uint64_t skip = 0, count = 0;
	bool is_map = false, container = false;
	size_t left = (size_t)(s->end - s->p);
	if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
		return 0;
	if ((b & 0xf0) == 0x80) {
		count = b & 0x0f;
		is_map = container = true;
	} else if ((b & 0xf0) == 0x90) {
		count = b & 0x0f;
		container = true;
	} else if ((b & 0xe0) == 0xa0) {
		skip = b & 0x1f;
	} else {
		static const int8_t fixed[] = {
			/* c4 bin8 */ -1, /* c5 */ -2, /* c6 */ -4, /* c7 ext8 */ -11, /* c8 */ -12, /* c9 */ -14,
			/* ca f32 */ 4, /* cb f64 */ 8, /* cc..cf uint */ 1, 2, 4, 8, /* d0..d3 int */ 1, 2, 4, 8,
			/* d4..d8 fixext */ 2, 3, 5, 9, 17, /* d9..db str */ -1, -2, -4,
			/* dc dd array */ -22, -24, /* de df map */ -32, -34};
		if (b < 0xc4) {
			s->why = "reserved byte 0xc1";
			return -1;
		}
		int8_t f = fixed[b - 0xc4];
		if (f > 0) {
			skip = (uint64_t)f;
		} else {
			int nlen = (-f) % 10; /* bytes of the length field */
			int cls = (-f) / 10;  /* 0 bytes/str, 1 ext, 2 array, 3 map */
			if (left < (size_t)nlen) {
				s->why = "truncated";
				return -1;
			}
			uint64_t n = be_read(s->p, nlen);
			s->p += nlen;
			left -= (size_t)nlen;
			if (cls == 0)
				skip = n;
			else if (cls == 1)
				skip = n + 1; /* type byte + data */
			else {
				count = n;
				container = true;
				is_map = cls == 3;
			}
		}
	}
	if (!container) {
		if (skip > left) {
			s->why = "a value runs past the end";
			return -1;
		}
		s->p += skip;
		return 0;
	}
	uint64_t items = is_map ? count * 2 : count;
	if (items > left) { /* every element takes at least one byte */
		s->why = "a container claims more elements than the bytes hold";
		return -1;
	}
	for (uint64_t i = 0; i < items; i++)
		if (scan_value(s, depth + 1))
			return -1;
	return 0;
}

/* ---- decoding ---- */

static bool get_u64(const msgpack_object *o, uint64_t *v)
{
	if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
		return false;
	*v = o->via.u64;
	return true;
}

static int decode_field(const struct field_desc *f, const msgpack_object *o, struct msg *m)
{
	char *base = (char *)m + f->offset;
	switch (f->kind) {
	case F_U64:
		return get_u64(o, (uint64_t *)base) ? 0 : -1;
	case F_I64:
		if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
			if (o->via.u64 > INT64_MAX)
				return -1;
			*(int64_t *)base = (int64_t)o->via.u64;
			return 0;
		}
		if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
			*(int64_t *)base = o->via.i64;
			return 0;
		}
		return -1;
	case F_F64:
		if (o->type == MSGPACK_OBJECT_FLOAT32 || o->type == MSGPACK_OBJECT_FLOAT64)
			*(double *)base = o->via.f64;
		else if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
			*(double *)base = (double)o->via.u64;
		else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
			*(double *)base = (double)o->via.i64;
		else
			return -1;
		return 0;
	case F_BYTES: {
		const char *p;
		uint32_t n;
		if (o->type == MSGPACK_OBJECT_STR) {
			p = o->via.str.ptr;
			n = o->via.str.size;
		} else if (o->type == MSGPACK_OBJECT_BIN) {
			p = o->via.bin.ptr;
			n = o->via.bin.size;
		} else {
			return -1;
		}
		if (n > f->max)
			return -2;
		struct bytes *b = (struct bytes *)base;
		b->p = malloc((size_t)n + 1);
		if (!b->p)
			return -3;
		if (n)
			memcpy(b->p, p, n);
		b->p[n] = 0;
		b->len = n;
		return 0;
	}
	case F_U64_ARRAY: {
		if (o->type != MSGPACK_OBJECT_ARRAY)
			return -1;
		uint32_t n = o->via.array.size;
		if (n > f->max)
			return -2;
		struct u64_array *a = (struct u64_array *)base;
		a->v = malloc(sizeof(uint64_t) * (n ? n : 1));
		if (!a->v)
			return -3;
		a->n = n;
		for (uint32_t i = 0; i < n; i++)
			if (!get_u64(&o->via.array.ptr[i], &a->v[i]))
				return -1;
		return 0;
	}
	}
	return -1;
}

int msg_decode(const void *buf, size_t len, struct msg *out, char *err, size_t errlen)
{
	memset(out, 0, sizeof(*out));
	if (len == 0)
		return errorf(err, errlen, -EBADMSG, "empty message");
	if (len > PROTO_MAX_MSG_BYTES)
		return errorf(err, errlen, -EBADMSG, "message of %zu bytes exceeds the limit of %u", len,
			    PROTO_MAX_MSG_BYTES);
	struct scan s = {.p = buf, .end = (const uint8_t *)buf + len};
	if (scan_value(&s, 0))
		return errorf(err, errlen, -EBADMSG, "malformed msgpack: %s", s.why);
	if (s.p != s.end)
		return errorf(err, errlen, -EBADMSG, "%zu trailing bytes after the message", (size_t)(s.end - s.p));

	msgpack_unpacked up;
	msgpack_unpacked_init(&up);
	size_t off = 0;
	int rc = 0;
	msgpack_unpack_return ur = msgpack_unpack_next(&up, buf, len, &off);
	if (ur != MSGPACK_UNPACK_SUCCESS || off != len) {
		rc = errorf(err, errlen, ur == MSGPACK_UNPACK_NOMEM_ERROR ? -ENOMEM : -EBADMSG,
			  "msgpack could not unpack the message (%d)", (int)ur);
		goto out;
	}
	const msgpack_object *root = &up.data;
	if (root->type != MSGPACK_OBJECT_ARRAY || root->via.array.size != 4) {
		rc = errorf(err, errlen, -EBADMSG, "a message is an array of 4: [version, type, id, body]");
		goto out;
	}
	const msgpack_object *el = root->via.array.ptr;
	uint64_t version, type, corr;
	if (!get_u64(&el[0], &version) || !get_u64(&el[1], &type) || !get_u64(&el[2], &corr)) {
		rc = errorf(err, errlen, -EBADMSG, "version, type and id must be unsigned integers");
		goto out;
	}
	if (version != PROTO_VERSION) {
		rc = errorf(err, errlen, -EPROTONOSUPPORT, "protocol version %llu, this side speaks %d",
			  (unsigned long long)version, PROTO_VERSION);
		goto out;
	}
	const struct msg_desc *d = type <= UINT32_MAX ? find_desc((uint32_t)type) : NULL;
	if (!d) {
		rc = errorf(err, errlen, -ENOMSG, "unknown message type %llu", (unsigned long long)type);
		goto out;
	}
	out->type = (uint32_t)type;
	out->corr = corr;
	const msgpack_object *body = &el[3];
	if (body->type != MSGPACK_OBJECT_MAP) {
		rc = errorf(err, errlen, -EBADMSG, "%s: body is not a map", d->name);
		goto out;
	}
	if (body->via.map.size > PROTO_MAX_KEYS) {
		rc = errorf(err, errlen, -EBADMSG, "%s: body has %u keys, at most %d", d->name, body->via.map.size,
			  PROTO_MAX_KEYS);
		goto out;
	}
	uint64_t seen = 0;
	for (uint32_t i = 0; i < body->via.map.size; i++) {
		const msgpack_object_kv *kv = &body->via.map.ptr[i];
		uint64_t key;
		if (!get_u64(&kv->key, &key) || key == 0 || key > 63) {
			rc = errorf(err, errlen, -EBADMSG, "%s: keys are integers 1..63", d->name);
			goto out;
		}
		if (seen & (1ull << key)) {
			rc = errorf(err, errlen, -EBADMSG, "%s: key %llu appears twice", d->name,
				  (unsigned long long)key);
			goto out;
		}
		seen |= 1ull << key;
		const struct field_desc *f = NULL;
		for (size_t k = 0; k < d->n_fields; k++)
			if (d->fields[k].key == key)
				f = &d->fields[k];
		if (!f)
			continue; /* appended by a newer peer */
		int frc = decode_field(f, &kv->val, out);
		if (frc == -2) {
			rc = errorf(err, errlen, -EBADMSG, "%s: field %s longer than %u", d->name, f->name, f->max);
			goto out;
		}
		if (frc == -3) {
			rc = errorf(err, errlen, -ENOMEM, "out of memory");
			goto out;
		}
		if (frc) {
			rc = errorf(err, errlen, -EBADMSG, "%s: field %s has the wrong type", d->name, f->name);
			goto out;
		}
	}
	for (size_t k = 0; k < d->n_fields; k++) {
		if (d->fields[k].required && !(seen & (1ull << d->fields[k].key))) {
			rc = errorf(err, errlen, -EBADMSG, "%s: required field %s is missing", d->name,
				  d->fields[k].name);
			goto out;
		}
	}
out:
	msgpack_unpacked_destroy(&up);
	if (rc)
		msg_free(out);
	return rc;
}

void msg_free(struct msg *m)
{
	const struct msg_desc *d = find_desc(m->type);
	if (!d)
		return;
	for (size_t k = 0; k < d->n_fields; k++) {
		char *base = (char *)m + d->fields[k].offset;
		if (d->fields[k].kind == F_BYTES) {
			struct bytes *b = (struct bytes *)base;
			free(b->p);
			b->p = NULL;
			b->len = 0;
		} else if (d->fields[k].kind == F_U64_ARRAY) {
			struct u64_array *a = (struct u64_array *)base;
			free(a->v);
			a->v = NULL;
			a->n = 0;
		}
	}
}

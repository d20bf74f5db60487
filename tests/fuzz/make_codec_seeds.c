/* make_codec_seeds.c - writes the seed corpus of fuzz_codec: every message type of protocol.h
 * encoded by msg_encode (with its fields filled, and with the optional ones left out), and a few
 * frames a peer could send that msg_encode never makes (a newer peer's unknown key, bin instead
 * of str, float32, an integer for a float, a negative error code, an array over its field's
 * limit, a body with too many keys).
 *
 *   make_codec_seeds DIR      (tests/fuzz/make-corpus.sh runs it into tests/fuzz/corpus/codec)
 */
#include <errno.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/protocol.h"

static const char *out_dir;
static int failures;

static void write_seed(const char *name, const void *buf, size_t len)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", out_dir, name);
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(buf, 1, len, f) != len || fclose(f) != 0) {
		fprintf(stderr, "make_codec_seeds: cannot write %s\n", path);
		exit(1);
	}
}

static void seed(const char *name, const struct msg *m)
{
	void *buf;
	size_t len;
	int rc = msg_encode(m, &buf, &len);
	if (rc) {
		fprintf(stderr, "make_codec_seeds: %s does not encode: %d\n", name, rc);
		failures++;
		return;
	}
	/* Every seed must decode: the fuzzer starts from valid messages. */
	struct msg back;
	char err[256];
	rc = msg_decode(buf, len, &back, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "make_codec_seeds: %s does not decode: %s\n", name, err);
		failures++;
	}
	msg_free(&back);
	write_seed(name, buf, len);
	free(buf);
}

#define BYTES(s) ((struct bytes){(char *)(s), (uint32_t)strlen(s)})

/* A frame built by hand: [1, type, corr, {...}] with the body packed by fn. */
static void raw_seed(const char *name, uint32_t type, void (*fn)(msgpack_packer *pk))
{
	msgpack_sbuffer sb;
	msgpack_sbuffer_init(&sb);
	msgpack_packer pk;
	msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
	msgpack_pack_array(&pk, 4);
	msgpack_pack_uint32(&pk, PROTO_VERSION);
	msgpack_pack_uint32(&pk, type);
	msgpack_pack_uint64(&pk, 77);
	fn(&pk);
	write_seed(name, sb.data, sb.size);
	msgpack_sbuffer_destroy(&sb);
}

static void body_hello_bin_unknown(msgpack_packer *pk)
{
	msgpack_pack_map(pk, 3);
	msgpack_pack_uint8(pk, 1);
	msgpack_pack_bin(pk, 10);
	msgpack_pack_bin_body(pk, "gpu-runner", 10);
	msgpack_pack_uint8(pk, 2);
	msgpack_pack_uint8(pk, 1);
	msgpack_pack_uint8(pk, 40); /* a key a newer peer added */
	msgpack_pack_array(pk, 2);
	msgpack_pack_str(pk, 1);
	msgpack_pack_str_body(pk, "x", 1);
	msgpack_pack_nil(pk);
}

static void body_generate_float32(msgpack_packer *pk)
{
	msgpack_pack_map(pk, 5);
	msgpack_pack_uint8(pk, 1);
	msgpack_pack_array(pk, 3);
	msgpack_pack_uint8(pk, 1);
	msgpack_pack_uint16(pk, 791);
	msgpack_pack_uint32(pk, 128000);
	msgpack_pack_uint8(pk, 2);
	msgpack_pack_uint8(pk, 16);
	msgpack_pack_uint8(pk, 3);
	msgpack_pack_float(pk, 0.7f);
	msgpack_pack_uint8(pk, 5);
	msgpack_pack_uint8(pk, 1); /* an integer where a float goes */
	msgpack_pack_uint8(pk, 11);
	msgpack_pack_int8(pk, -1);
}

static void body_error_negative(msgpack_packer *pk)
{
	msgpack_pack_map(pk, 2);
	msgpack_pack_uint8(pk, 1);
	msgpack_pack_int64(pk, -5);
	msgpack_pack_uint8(pk, 2);
	msgpack_pack_str(pk, 4);
	msgpack_pack_str_body(pk, "oops", 4);
}

static void body_kv_commit_ext(msgpack_packer *pk)
{
	msgpack_pack_map(pk, 2);
	msgpack_pack_uint8(pk, 1);
	msgpack_pack_array(pk, 1);
	msgpack_pack_uint64(pk, (3ull << 32) | 1);
	msgpack_pack_uint8(pk, 9); /* unknown key holding an ext and a map */
	msgpack_pack_array(pk, 2);
	msgpack_pack_ext(pk, 2, 7);
	msgpack_pack_ext_body(pk, "ab", 2);
	msgpack_pack_map(pk, 1);
	msgpack_pack_true(pk);
	msgpack_pack_double(pk, 1.5);
}

static void body_generate_too_many_stop_ids(msgpack_packer *pk)
{
	msgpack_pack_map(pk, 2);
	msgpack_pack_uint8(pk, 2);
	msgpack_pack_uint8(pk, 8);
	msgpack_pack_uint8(pk, 7); /* stop_ids: at most 1024 */
	msgpack_pack_array(pk, 1025);
	for (int i = 0; i < 1025; i++)
		msgpack_pack_uint8(pk, (uint8_t)(i & 0x7f));
}

static void body_ping_too_many_keys(msgpack_packer *pk)
{
	msgpack_pack_map(pk, PROTO_MAX_KEYS + 1);
	for (int i = 0; i < PROTO_MAX_KEYS + 1; i++) {
		msgpack_pack_uint8(pk, (uint8_t)(i % 63 + 1));
		msgpack_pack_nil(pk);
	}
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: make_codec_seeds DIR\n");
		return 2;
	}
	out_dir = argv[1];
	struct msg m;
	uint64_t groups[] = {1, 2, 3, 4}, rel[] = {0}, handles[] = {(1ull << 32) | 1, (2ull << 32) | 7},
		 offsets[] = {0, 4096}, keys[] = {0x9e3779b97f4a7c15ull, 0}, tokens[] = {128000, 791, 6864, 315};
	char events[2 * KV_EVENT_HANDLE_BYTES];
	memset(events, 0xab, sizeof(events));
	float logits[8] = {0.5f, -1.0f, 3.25f, 0, 1e-3f, -7.5f, 2.0f, 100.0f};

	msg_make_error(&m, 9, 22, "MSG_KV_FETCH: handle 0x100000007 is stale");
	seed("error", &m);
	msg_init(&m, MSG_OK, 9);
	seed("ok", &m);
	msg_init(&m, MSG_HELLO, 1);
	m.hello.client = BYTES("gpu-runner");
	m.hello.proto = PROTO_VERSION;
	m.hello.session = 0x1234567890abcdefull;
	seed("hello", &m);
	msg_init(&m, MSG_HELLO_REPLY, 1);
	m.hello_reply.service = BYTES("ssd-loader");
	m.hello_reply.pid = 4711;
	m.hello_reply.epoch = 0xfeedfacecafebeefull;
	m.hello_reply.layout = 2;
	m.hello_reply.manifest_hash = 0x0123456789abcdefull;
	m.hello_reply.shm_name = BYTES("/llmp-1000-default-weights");
	m.hello_reply.shm_size = 1ull << 30;
	seed("hello_reply", &m);
	msg_init(&m, MSG_PING, 2);
	seed("ping", &m);
	msg_init(&m, MSG_STATS_GET, 3);
	seed("stats_get", &m);
	msg_init(&m, MSG_STATS, 3);
	m.stats.service = BYTES("kv-store");
	m.stats.json = BYTES("{\"blocks\": 12, \"spilled\": 3, \"fetched\": 1}");
	seed("stats", &m);
	msg_init(&m, MSG_SHUTDOWN, 4);
	seed("shutdown", &m);
	msg_init(&m, MSG_HEARTBEAT, 0);
	m.heartbeat.service = BYTES("gpu-runner");
	m.heartbeat.pid = 4730;
	m.heartbeat.epoch = 99;
	m.heartbeat.seq = 1000;
	m.heartbeat.uptime_ms = 60000;
	seed("heartbeat", &m);
	msg_init(&m, MSG_W_ACQUIRE, 5);
	m.w_acquire.groups = (struct u64_array){groups, 4};
	m.w_acquire.release = (struct u64_array){rel, 1};
	seed("w_acquire", &m);
	msg_init(&m, MSG_W_ACQUIRE, 5);
	m.w_acquire.groups = (struct u64_array){groups, 1};
	seed("w_acquire_min", &m);
	msg_init(&m, MSG_W_GRANT, 5);
	m.w_grant.group = 3;
	m.w_grant.slot = 1;
	m.w_grant.generation = 17;
	m.w_grant.offset = 1ull << 22;
	m.w_grant.bytes = 1ull << 21;
	seed("w_grant", &m);
	msg_init(&m, MSG_W_RELEASE, 6);
	m.w_release.groups = (struct u64_array){groups, 2};
	seed("w_release", &m);
	msg_init(&m, MSG_KV_CONFIGURE, 7);
	m.kv_configure.block_bytes = 4096;
	m.kv_configure.manifest_hash = 0x0123456789abcdefull;
	seed("kv_configure", &m);
	msg_init(&m, MSG_KV_POOL, 7);
	m.kv_pool.shm_name = BYTES("/llmp-1000-default-kv");
	m.kv_pool.shm_size = 1ull << 30;
	m.kv_pool.n_blocks = 262144;
	m.kv_pool.block_bytes = 4096;
	m.kv_pool.epoch = 3;
	seed("kv_pool", &m);
	msg_init(&m, MSG_KV_ALLOC, 8);
	m.kv_alloc.count = 4;
	seed("kv_alloc", &m);
	msg_init(&m, MSG_KV_BLOCKS, 8);
	m.kv_blocks.handles = (struct u64_array){handles, 2};
	m.kv_blocks.offsets = (struct u64_array){offsets, 2};
	seed("kv_blocks", &m);
	msg_init(&m, MSG_KV_COMMIT, 9);
	m.kv_commit.handles = (struct u64_array){handles, 2};
	m.kv_commit.keys = (struct u64_array){keys, 2};
	m.kv_commit.events = (struct bytes){events, sizeof(events)};
	seed("kv_commit", &m);
	msg_init(&m, MSG_KV_COMMIT, 9);
	m.kv_commit.handles = (struct u64_array){handles, 1};
	seed("kv_commit_min", &m);
	static const uint32_t handle_types[] = {MSG_KV_FETCH, MSG_KV_UNPIN, MSG_KV_FREE};
	static const char *const handle_names[] = {"kv_fetch", "kv_unpin", "kv_free"};
	for (int i = 0; i < 3; i++) {
		msg_init(&m, handle_types[i], 10);
		m.kv_handles.handles = (struct u64_array){handles, 2};
		seed(handle_names[i], &m);
	}
	msg_init(&m, MSG_KV_LOOKUP, 11);
	m.kv_lookup.keys = (struct u64_array){keys, 2};
	seed("kv_lookup", &m);
	msg_init(&m, MSG_KV_UNPIN_ALL, 12);
	seed("kv_unpin_all", &m);
	msg_init(&m, MSG_GENERATE, 13);
	m.generate.tokens = (struct u64_array){tokens, 4};
	m.generate.max_new = 32;
	m.generate.temperature = 0.8;
	m.generate.top_k = 40;
	m.generate.top_p = 0.9;
	m.generate.seed = 7;
	m.generate.stop_ids = (struct u64_array){tokens, 1};
	m.generate.flags = GEN_TEXT | GEN_LOGITS;
	m.generate.min_p = 0.05;
	m.generate.repetition_penalty = 1.1;
	m.generate.stop_strings = BYTES("[\"\\n\\n\", \"END\"]");
	seed("generate_tokens", &m);
	msg_init(&m, MSG_GENERATE, 14);
	m.generate.max_new = 16;
	m.generate.prompt = BYTES("The capital of France is");
	m.generate.flags = GEN_TEXT | GEN_NO_BOS;
	seed("generate_prompt", &m);
	m.generate.done = (struct u64_array){tokens, 3};
	seed("generate_resume", &m);
	msg_init(&m, MSG_GENERATE, 15);
	m.generate.max_new = 64;
	m.generate.chat = BYTES("[{\"role\": \"system\", \"content\": \"Answer in one line.\"}, "
				"{\"role\": \"user\", \"content\": \"Name three primary colours.\"}]");
	m.generate.flags = GEN_TEXT | GEN_IGNORE_EOS | GEN_SPECIAL_AS_TEXT;
	seed("generate_chat", &m);
	msg_init(&m, MSG_TOKEN, 13);
	m.token.index = 3;
	m.token.token = 6864;
	m.token.text = BYTES(" caf\xc3\xa9");
	seed("token", &m);
	msg_init(&m, MSG_GEN_DONE, 13);
	m.gen_done.n_prompt = 4;
	m.gen_done.n_generated = 32;
	m.gen_done.reason = BYTES("length");
	m.gen_done.prefill_ms = 12.5;
	m.gen_done.decode_ms = 301.25;
	m.gen_done.text = BYTES("\xe2\x82");
	seed("gen_done", &m);
	msg_init(&m, MSG_LOGITS, 13);
	m.logits.position = 3;
	m.logits.values = (struct bytes){(char *)logits, sizeof(logits)};
	seed("logits", &m);

	/* The stages of a model split across runners. */
	static uint64_t pids[2] = {4711, 4712}, step_tokens[3] = {128000, 791, 6864};
	static char nccl_id[128];
	msg_init(&m, MSG_STAGE_SETUP, 14);
	m.stage_setup = (struct msg_stage_setup){
		.formation = 0x1234567890abcdefull, .rank = 1, .ranks = 2, .layer0 = 15, .layer1 = 32,
		.manifest_hash = 0xfeedfacecafebeefull, .max_chunk = 512, .block_tokens = 16, .kv_dtype = 2,
		.max_context = 2048, .backend = BYTES("cuda"), .link = BYTES("nccl"),
		.link_name = BYTES("/llmp-1000-default-stages"), .nccl_id = {nccl_id, sizeof(nccl_id)},
		.pids = {pids, 2}, .kv_session = 0x1234567890abcdefull};
	seed("stage_setup", &m);
	msg_init(&m, MSG_STAGE_READY, 14);
	m.stage_ready = (struct msg_stage_ready){.rank = 1, .pid = 4712, .layer0 = 15, .layer1 = 32,
						 .plan = BYTES("layers 15..31, 20 groups resident")};
	seed("stage_ready", &m);
	msg_init(&m, MSG_STAGE_SEQ, 15);
	m.stage_seq = (struct msg_stage_seq){.formation = 7, .op = STAGE_SEQ_RESTORE, .tokens = {step_tokens, 3},
					     .limit = 16, .seed = 99};
	seed("stage_seq", &m);
	msg_init(&m, MSG_STAGE_STEP, 16);
	m.stage_step = (struct msg_stage_step){.formation = 7, .step = 1, .pos0 = 0, .flags = STAGE_STEP_OUT,
					       .tokens = {step_tokens, 3}};
	seed("stage_step", &m);
	msg_init(&m, MSG_STAGE_DONE, 16);
	m.stage_done.value = 16;
	seed("stage_done", &m);

	raw_seed("raw_hello_bin_unknown_key", MSG_HELLO, body_hello_bin_unknown);
	raw_seed("raw_generate_float32", MSG_GENERATE, body_generate_float32);
	raw_seed("raw_error_negative", MSG_ERROR, body_error_negative);
	raw_seed("raw_kv_commit_ext", MSG_KV_COMMIT, body_kv_commit_ext);
	raw_seed("raw_generate_too_many_stop_ids", MSG_GENERATE, body_generate_too_many_stop_ids);
	raw_seed("raw_ping_too_many_keys", MSG_PING, body_ping_too_many_keys);
	return failures ? 1 : 0;
}

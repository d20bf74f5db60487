/* protocol.h - the message catalogue: every control message any service sends or takes.
 *
 * The protocol is written once, here and in codec.c. A message on the wire is one ZeroMQ
 * frame holding the msgpack array
 *     [PROTO_VERSION, type, correlation id, {key: value, ...}]
 * Keys are the small integers given below; values are unsigned or signed integers,
 * float64, strings/binary, or arrays of unsigned integers. Message types and keys are
 * numbered by hand and only ever appended; a number is never reused.
 *
 * Requests go from a DEALER to a service's ROUTER (<run-dir>/<service>.ctl); replies come
 * back with the request's correlation id. A request may be answered by several replies (a
 * stream: MSG_TOKEN... then MSG_GEN_DONE; MSG_W_GRANT once per group). Any request may be
 * answered by MSG_ERROR instead. Notifications go out on PUB (<run-dir>/<service>.pub).
 *
 * Decoding (codec.c) rejects, with a message naming the problem: bytes that are not one
 * complete msgpack value, trailing bytes, a wrong protocol version, an unknown type, a body
 * that is not a map, duplicate keys, a value of the wrong kind, a missing required field,
 * strings or arrays longer than the field allows, and containers whose declared length
 * exceeds what the bytes could hold. Unknown keys inside a known message are skipped (a
 * newer peer may append fields).
 *
 *   struct msg m;
 *   msg_init(&m, MSG_KV_ALLOC, corr);
 *   m.kv_alloc.count = 4;
 *   rc = msg_encode(&m, &buf, &len);          // buf: malloc'd, caller frees
 *   rc = msg_decode(buf, len, &out, err, sizeof(err));   ... msg_free(&out);
 */
#ifndef PIPELINE_PROTOCOL_H
#define PIPELINE_PROTOCOL_H
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

#define PROTO_VERSION 1
#define PROTO_MAX_MSG_BYTES (16u << 20)	/* ZMQ_MAXMSGSIZE on every socket */
#define PROTO_MAX_ARRAY (1u << 20)	/* elements in any u64 array */
#define PROTO_MAX_STR (4u << 20)	/* bytes in any string (a vocabulary's logits fit) */
#define PROTO_MAX_KEYS 64		/* entries in a body map */
#define KV_EVENT_HANDLE_BYTES 64	/* sizeof(cudaIpcEventHandle_t) */
#define STAGE_MAX_RANKS 8		/* runners one model's layers may be split across */

enum msg_type {
	/* generic, every service */
	MSG_ERROR = 1,	     /* reply: code, text */
	MSG_OK = 2,	     /* reply: nothing */
	MSG_HELLO = 3,	     /* request: client, proto */
	MSG_HELLO_REPLY = 4, /* reply: service, pid, epoch, layout, manifest_hash, shm_name, shm_size */
	MSG_PING = 5,	     /* request -> MSG_OK */
	MSG_STATS_GET = 6,   /* request -> MSG_STATS */
	MSG_STATS = 7,	     /* reply or PUB: service, json (a JSON object of counters) */
	MSG_SHUTDOWN = 8,    /* request: the service replies MSG_OK and exits cleanly */
	MSG_HEARTBEAT = 9,   /* PUB: service, pid, epoch, seq, uptime_ms */
	MSG_CONFIG_GET = 13, /* request: keys (optional) -> MSG_CONFIG: the service's parameters (common/tunable.h) */
	MSG_CONFIG = 14,     /* reply: service, json (an object: name -> {value, text, type, tunable, ...}) */
	MSG_CONFIG_SET = 15, /* request: settings -> MSG_CONFIG (the new values of the keys set), or MSG_ERROR
			      * naming the key and why; all or nothing */

	/* ssd-loader: the weight ring */
	MSG_W_ACQUIRE = 20, /* request: groups, release -> one MSG_W_GRANT per group as it is READY */
	MSG_W_GRANT = 21,   /* reply: group, slot, generation, offset, bytes */
	MSG_W_RELEASE = 22, /* request: groups -> MSG_OK */

	/* kv-store: the KV block pool */
	MSG_KV_CONFIGURE = 40, /* request: block_bytes, manifest_hash -> MSG_KV_POOL */
	MSG_KV_POOL = 41,      /* reply: shm_name, shm_size, n_blocks, block_bytes, epoch */
	MSG_KV_ALLOC = 42,     /* request: count -> MSG_KV_BLOCKS (each block pinned for writing) */
	MSG_KV_BLOCKS = 43,    /* reply: handles, offsets (bytes from the pool base) */
	MSG_KV_COMMIT = 44,    /* request: handles, keys, events -> MSG_OK */
	MSG_KV_FETCH = 45,     /* request: handles -> MSG_KV_BLOCKS (pinned until MSG_KV_UNPIN) */
	MSG_KV_UNPIN = 46,     /* request: handles -> MSG_OK */
	MSG_KV_FREE = 47,      /* request: handles -> MSG_OK (a block with a key stays cached: see LOOKUP) */
	MSG_KV_LOOKUP = 48,    /* request: keys -> MSG_KV_BLOCKS: handles (0 = not cached), offsets (0); each
				*  hit is referenced by the caller until it sends MSG_KV_FREE for it */
	MSG_KV_UNPIN_ALL = 49, /* request -> MSG_OK: drops every pin (a runner that reconnects holds none) */

	/* gpu-runner: generation */
	MSG_GENERATE = 60, /* request: tokens | prompt | chat, max_new, sampling, stops, flags[, done]
			    *  -> [MSG_LOGITS] MSG_TOKEN per token, then MSG_GEN_DONE (or MSG_ERROR) */
	MSG_TOKEN = 61,	   /* reply: index, token[, text] */
	MSG_GEN_DONE = 62, /* reply: n_prompt, n_generated, reason, prefill_ms, decode_ms */
	MSG_LOGITS = 63,   /* reply: position, values (float32 little-endian, vocab_size of them) */

	/* gpu-runner: a model's layers split across several runners, the stages (docs/design.md, "Several
	 * GPUs"). The first runner (rank 0) sends these to each other runner; only it serves MSG_GENERATE. */
	MSG_STAGE_SETUP = 70, /* request: formation, rank, ranks, layers, link, pids, ... -> MSG_STAGE_READY */
	MSG_STAGE_READY = 71, /* reply: rank, pid, layer0, layer1, plan */
	MSG_STAGE_SEQ = 72,   /* request: formation, op, tokens, limit, seed -> MSG_STAGE_DONE */
	MSG_STAGE_STEP = 73,  /* request: formation, step, pos0, tokens, flags -> MSG_STAGE_DONE once computed */
	MSG_STAGE_DONE = 74,  /* reply: value */
};

/* Error codes carried in MSG_ERROR.code: a positive errno value. */

struct u64_array {
	uint64_t *v; /* decoded: owned by the msg (msg_free); encoding: borrowed */
	uint32_t n;
};

struct bytes {
	char *p;      /* decoded: owned, NUL-terminated copy; encoding: borrowed */
	uint32_t len; /* bytes, without the NUL */
};

struct msg_error { int64_t code; struct bytes text; };
struct msg_hello {
	struct bytes client;
	uint64_t proto;
	uint64_t session; /* optional: random per client process; the same session reconnecting keeps
			   * what it holds, a new one from the same client name replaces it */
};
struct msg_hello_reply {
	struct bytes service;
	uint64_t pid;
	uint64_t epoch;	       /* random, new each time the service starts */
	uint64_t layout;       /* the shared-memory layout version the service uses; 0 if none */
	uint64_t manifest_hash;/* 0 when the service has no model */
	struct bytes shm_name; /* empty when the service owns no object */
	uint64_t shm_size;
};
struct msg_stats { struct bytes service; struct bytes json; };
struct msg_heartbeat { struct bytes service; uint64_t pid, epoch, seq, uptime_ms; };
/* Live tuning. Lists travel as JSON text (as generate.stop_strings does); the service checks
 * the structure, the counts and each name's and value's length (common/tunable.c). */
struct msg_config_get {
	struct bytes keys; /* optional: a JSON array of parameter names; empty: every parameter */
};
struct msg_config {
	struct bytes service;
	struct bytes json; /* a JSON object: name -> {value, text, type, tunable, min, max, values, description} */
};
struct msg_config_set {
	struct bytes settings; /* a JSON object: name -> value (a string, as typed: "512MiB", "debug", "8") */
};
struct msg_w_acquire {
	struct u64_array groups;  /* group ids to acquire, in the order they will be used */
	struct u64_array release; /* optional: group ids released at the same time */
	uint64_t session;	  /* optional: the client's HELLO session, whose references these are (0: none) */
};
struct msg_w_grant {
	uint64_t group, slot, generation;
	uint64_t offset; /* bytes from the ring base to the slot's data */
	uint64_t bytes;	 /* the group's slot_bytes */
};
struct msg_w_release {
	struct u64_array groups;
	uint64_t session; /* optional: as in msg_w_acquire */
};
struct msg_kv_configure { uint64_t block_bytes, manifest_hash; };
struct msg_kv_pool {
	struct bytes shm_name;
	uint64_t shm_size, n_blocks, block_bytes, epoch;
};
/* The KV requests (ALLOC, COMMIT, FETCH, UNPIN, FREE, LOOKUP, UNPIN_ALL) name the gpu-runner
 * session that sends them (its HELLO's; 0: none named): the kv-store does nothing for a session
 * that a HELLO with another has ended, so that a request sent before a runner gave its session
 * up cannot take blocks for the next one. */
struct msg_kv_alloc { uint64_t count, session; };
struct msg_kv_blocks { struct u64_array handles, offsets; };
struct msg_kv_commit {
	struct u64_array handles;
	struct u64_array keys; /* prefix-chain key per block, 0 when none */
	struct bytes events;   /* n * KV_EVENT_HANDLE_BYTES CUDA IPC event handles; empty on the CPU path */
	uint64_t session;
};
struct msg_kv_handles { struct u64_array handles; uint64_t session; }; /* FETCH, UNPIN, FREE; UNPIN_ALL: session */
struct msg_kv_lookup { struct u64_array keys; uint64_t session; };
/* MSG_GENERATE.flags */
enum gen_flags {
	GEN_SPECIAL_AS_TEXT = 1u << 0, /* prompt: special-token text is plain text */
	GEN_NO_BOS = 1u << 1,	       /* prompt: do not put the BOS token first */
	GEN_TEXT = 1u << 2,	       /* each MSG_TOKEN carries the text it completes */
	GEN_LOGITS = 1u << 3,	       /* send MSG_LOGITS for the last prompt position */
	GEN_IGNORE_EOS = 1u << 4,      /* do not stop on the model's end-of-sequence ids */
};

struct msg_generate {
	/* The prompt: exactly one of tokens, prompt (text) and chat. */
	struct u64_array tokens;
	uint64_t max_new;
	double temperature; /* 0: greedy */
	uint64_t top_k;	    /* 0: off */
	double top_p;	    /* 0 or 1: off */
	uint64_t seed;
	struct u64_array stop_ids; /* optional; the model's eos ids are always stops */
	struct bytes prompt;	   /* UTF-8 text, tokenized by the runner with the model's tokenizer */
	struct bytes chat;	   /* JSON array of {"role": ..., "content": ...}, in the model's chat format */
	uint64_t flags;		   /* enum gen_flags */
	double min_p;		   /* 0: off */
	double repetition_penalty; /* 0 or 1: off */
	struct bytes stop_strings; /* JSON array of strings; generation stops once the text holds one */
	/* Optional: resume a request that was cut off (its runner died). done holds the tokens it had
	 * generated (n_done = done.n, fewer than max_new); the prompt is given as the first time and
	 * built again the same way. The runner restores the KV of prompt + done, generates
	 * max_new - n_done more with MSG_TOKEN indices from n_done, lets stop strings see done's text
	 * (without sending it again), advances the seeded generator past the draws done's tokens took,
	 * and reports n_generated counting done: the tokens are those of an uninterrupted run. */
	struct u64_array done;
};
struct msg_token {
	uint64_t index, token;
	struct bytes text; /* with GEN_TEXT: the UTF-8 this token completes (may be empty) */
};
struct msg_logits {
	uint64_t position; /* the sequence position whose next-token distribution this is */
	struct bytes values;
};
struct msg_gen_done {
	uint64_t n_prompt, n_generated;
	struct bytes reason; /* "length", "stop", "stop_string", "context", "cancelled" */
	double prefill_ms, decode_ms;
	struct bytes text;   /* with GEN_TEXT: what the decoder held back until the end */
};

/* A stage's part of a forming (MSG_STAGE_SETUP): which layers it computes, how activations pass, and
 * what it must agree on with the first runner. A new formation (random, never 0) replaces the old one:
 * the stage drops what it held for it. */
struct msg_stage_setup {
	uint64_t formation;
	uint64_t rank, ranks;	  /* 1 <= rank < ranks <= STAGE_MAX_RANKS */
	uint64_t layer0, layer1;  /* the layers it computes: [layer0, layer1) */
	uint64_t manifest_hash;	  /* the model every stage must have */
	uint64_t max_chunk, block_tokens, kv_dtype, max_context; /* as the first runner's: steps and KV agree */
	struct bytes backend;	  /* "cpu" or "cuda": every stage computes alike */
	struct bytes link;	  /* how activations pass: "shm" or "nccl" */
	struct bytes link_name;	  /* shm: the shared-memory object of the hops */
	struct bytes nccl_id;	  /* nccl: the communicator's unique id (ncclUniqueId, 128 bytes) */
	struct u64_array pids;	  /* each rank's process id (ranks of them), for liveness */
	uint64_t kv_session;	  /* the session every stage names to the kv-store */
};
struct msg_stage_ready {
	uint64_t rank, pid, layer0, layer1;
	struct bytes plan; /* a line saying what the stage holds and predicts */
};
/* MSG_STAGE_SEQ.op: the sequence whose KV the stages hold, kept in step with the first runner's. */
enum stage_seq_op {
	STAGE_SEQ_RESTORE = 1, /* tokens: the sequence so far; restore at most limit positions of it from the
				* kv-store (seed names the model): MSG_STAGE_DONE.value = positions restored */
	STAGE_SEQ_END = 2,     /* the sequence is over: hand its KV blocks back */
	STAGE_SEQ_RECOVER = 3, /* the kv-store failed the sequence: drop what is held of it */
};
struct msg_stage_seq {
	uint64_t formation, op;
	struct u64_array tokens;
	uint64_t limit, seed;
};
/* MSG_STAGE_STEP.flags */
enum stage_step_flags {
	STAGE_STEP_OUT = 1u << 0, /* the last stage sends the step's last hidden row back to the first */
};
struct msg_stage_step {
	uint64_t formation, step; /* step: counts the formation's steps from 1, in the order they run */
	uint64_t pos0, flags;
	struct u64_array tokens;  /* the step's tokens, at positions pos0.. (they name KV blocks) */
};
struct msg_stage_done { uint64_t value; };

struct msg {
	uint32_t type; /* enum msg_type */
	uint64_t corr; /* correlation id: a reply carries its request's */
	union {
		struct msg_error error;
		struct msg_hello hello;
		struct msg_hello_reply hello_reply;
		struct msg_stats stats;
		struct msg_heartbeat heartbeat;
		struct msg_config_get config_get;
		struct msg_config config;
		struct msg_config_set config_set;
		struct msg_w_acquire w_acquire;
		struct msg_w_grant w_grant;
		struct msg_w_release w_release;
		struct msg_kv_configure kv_configure;
		struct msg_kv_pool kv_pool;
		struct msg_kv_alloc kv_alloc;
		struct msg_kv_blocks kv_blocks;
		struct msg_kv_commit kv_commit;
		struct msg_kv_handles kv_handles;
		struct msg_kv_lookup kv_lookup;
		struct msg_generate generate;
		struct msg_token token;
		struct msg_gen_done gen_done;
		struct msg_logits logits;
		struct msg_stage_setup stage_setup;
		struct msg_stage_ready stage_ready;
		struct msg_stage_seq stage_seq;
		struct msg_stage_step stage_step;
		struct msg_stage_done stage_done;
	};
};

/* Zeroes m and sets type and correlation id. */
void msg_init(struct msg *m, uint32_t type, uint64_t corr);

/* Encodes m. On success *buf is a malloc'd buffer of *len bytes that the caller frees.
 * Returns 0; -EINVAL for an unknown type or a field over its limit; -ENOMEM. */
int msg_encode(const struct msg *m, void **buf, size_t *len);

/* Decodes len bytes at buf into out. Strings and arrays in out are heap copies owned by out:
 * release them with msg_free. Returns 0; -EBADMSG for anything malformed (err says what);
 * -EPROTONOSUPPORT for another protocol version; -ENOMSG for an unknown type; -ENOMEM. On
 * failure out holds nothing to free. */
int msg_decode(const void *buf, size_t len, struct msg *out, char *err, size_t errlen);

/* Frees the heap copies a decode made. Safe after msg_init and twice. Only for decoded
 * messages: an encoded message's arrays are borrowed from the caller. */
void msg_free(struct msg *m);

/* "MSG_KV_ALLOC" style name, or "unknown". */
const char *msg_type_name(uint32_t type);

/* The session field of a KV request that has one (ALLOC, COMMIT, FETCH, UNPIN, FREE, LOOKUP,
 * UNPIN_ALL: the gpu-runner session that sends it), NULL for any other message. Like strchr, it
 * gives a writable pointer into m whether m was passed const or not. */
uint64_t *msg_kv_session(const struct msg *m);

/* Builds an error reply in m (text is borrowed: keep it alive until the encode). */
void msg_make_error(struct msg *m, uint64_t corr, int code, const char *text);

#ifdef __cplusplus
}
#endif
#endif

/* codec_test_util.h - what the codec tests (test_codec_*.c) share.
 *
 * The wire contract (keys, kinds, limits) is written down a second time here, from protocol.h,
 * and the encoder's bytes are compared with bytes packed independently from that table: a key
 * renumbered or a kind changed in codec.c fails the tests.
 *
 *   struct arena a = {0};
 *   struct msg m;
 *   fill(&m, &contract[i], v, &a);           // every field of type i, variant v (0..N_VARIANTS-1)
 *   struct pk k;
 *   pack_msg(&k, &m, &contract[i], NULL);    // the same message packed by hand; pk_free(&k)
 *   expect_reject(bytes, len, -EBADMSG, "what the message says", "what the case is");
 *   arena_free(&a); */
#ifndef CODEC_TEST_UTIL_H
#define CODEC_TEST_UTIL_H
#include <check.h>
#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/protocol.h"

/* UNDER_ASAN: built with AddressSanitizer, which owns malloc and the address space. */
#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif

/* Runs tc, the program's one test case, in a suite "codec" in fork mode and returns the exit
 * status for ctest. Each test is bounded by the CPU time its process uses (CODEC_TEST_CPU_S,
 * RLIMIT_CPU: a runaway loop ends with SIGXCPU) in place of Check's wall-clock timeout (4 s by
 * default). These tests compute and never wait for anything: on a loaded machine they take
 * longer without doing more, and a wall-clock limit failed them (test_reject_over_limit packs
 * and decodes arrays of 2^20 elements, under a second of CPU, and took over 4 s with the suite
 * running -j4 on two busy cores). ctest's TIMEOUT still bounds the program's wall time. */
#define CODEC_TEST_CPU_S 20
int codec_run(TCase *tc);

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

/* Every message type of protocol.h, in the order of the catalogue (test_out_of_memory uses
 * indexes into it: new types are appended). */
extern const struct tmsg contract[];
extern const int contract_n;
#define N_TYPES contract_n

/* The field f of message m. */
static inline void *at(const struct msg *m, const struct tfield *f)
{
	return (char *)m + f->off;
}

/* ---- values ---- */

#define N_VARIANTS 11 /* the variants fill() knows */

/* What a filled message borrows, freed after the test. */
struct arena {
	void *p[16];
	int n;
};

void arena_free(struct arena *a);

/* Fills every field of contract type t, variant v: each field gets a different kind of value. */
void fill(struct msg *m, const struct tmsg *t, int v, struct arena *a);

/* Compares every field of a and b (bytes, not values: -0.0 and NaN payloads too). */
void expect_same(const struct msg *a, const struct msg *b, const struct tmsg *t, int v);

/* ---- packing by hand ---- */

struct pk {
	msgpack_sbuffer sb;
	msgpack_packer p;
};

void pk_init(struct pk *k);
void pk_free(struct pk *k);

typedef void (*packfn)(msgpack_packer *p);

/* How a hand-built message departs from m. */
struct edit {
	int skip_key;	   /* leave this key out */
	int replace_key;   /* pack replace() as this key's value */
	packfn replace;
	int extra_key;	   /* add this key (unknown or duplicate) with extra() as value */
	packfn extra;
	uint64_t version;  /* 0: PROTO_VERSION */
};

/* Packs m (of contract type t) into k as the contract says, departing from it as e says (NULL:
 * not at all). The caller frees k (pk_free). */
void pack_msg(struct pk *k, const struct msg *m, const struct tmsg *t, const struct edit *e);

/* Decodes bytes that must be refused with rc; the message must contain want (if not NULL). */
void expect_reject(const void *buf, size_t len, int rc, const char *want, const char *what);

/* Decodes bytes that must decode; fails the test with the decoder's message otherwise. */
int decode_ok(const void *buf, size_t len, struct msg *out, const char *what);

#endif

/* tokenizer_test_util.h - what the tokenizer's test programs share: the fixtures' paths, loading
 * and expecting, random text, and the checks of encodings, decodings and round trips.
 *
 *   tcase_add_checked_fixture(tc, tmp_setup, tmp_teardown);   // tmp_root: a mkdtemp() per test
 *   struct tokenizer *t = load_ok(SP_LEGACY_JSON);
 *   EXPECT_IDS(t, "Hello world", 0, 285, 290);
 *   EXPECT_DECODE(t, 0, "Hello world", 285, 290);
 *   expect_bad(doc, -EINVAL, "model.vocab");                  // doc: a json_t, consumed
 *
 * Each program links tokenizer_test_util.c; test_helpers.h gives TH_CHECK and th_run. */
#ifndef TOKENIZER_TEST_UTIL_H
#define TOKENIZER_TEST_UTIL_H
#include <check.h>
#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tokenizer/tokenizer.h"
#include "common/util.h"
#include "tests/unit/common/test_helpers.h"

#ifndef TOK_TEST_LLAMA3_DIR
#error "TOK_TEST_LLAMA3_DIR must name tests/data/llama3-tokenizer"
#endif
#ifndef TOK_TEST_FIXTURE_DIR
#error "TOK_TEST_FIXTURE_DIR must name tests/unit/tokenizer/data"
#endif

#define LLAMA3_JSON	TOK_TEST_LLAMA3_DIR "/tokenizer.json"
#define SP_LEGACY_JSON	TOK_TEST_FIXTURE_DIR "/sp-legacy/tokenizer.json"
#define SP_META_JSON	TOK_TEST_FIXTURE_DIR "/sp-metaspace/tokenizer.json"

extern char tmp_root[64]; /* per test (tmp_setup) */
/* A deterministic generator's state (xorshift64*, rnd): seed it, so a failure reproduces. */
extern uint64_t rng_state;

/* A mkdtemp() directory per test in tmp_root (a checked fixture), removed with what it holds. */
void tmp_setup(void);
void tmp_teardown(void);

/* The whole file, NUL-terminated (malloc'd; *len without the NUL); checked to exist. */
char *read_all(const char *path, size_t *len);
/* The tokenizer at path (a file or a checkpoint directory), checked to load. */
struct tokenizer *load_ok(const char *path);
/* The JSON document at path, checked to parse. */
json_t *json_of(const char *path);
/* Writes text to a file of this test's directory; returns its path (static, one of 8). */
const char *write_text(const char *text, size_t len);
/* Dumps doc (which it consumes) to a file and loads it: rc, *t, err as tokenizer_load. */
int load_doc(json_t *doc, struct tokenizer **t, char *err, size_t errlen);
/* load_doc, checked to succeed. */
struct tokenizer *load_doc_ok(json_t *doc);
/* Expects doc to fail with rc and a message holding word. */
void expect_bad(json_t *doc, int rc_want, const char *word);

/* " 1 2 3" for ids (malloc'd). */
char *ids_text(const uint32_t *ids, size_t n);
/* encode(text) with flags gives exactly want (EXPECT_IDS below spells the ids inline). */
void expect_ids_n(const struct tokenizer *t, const char *text, size_t len, unsigned flags, const uint32_t *want,
		  size_t n_want);
/* decode(ids) as a malloc'd string, checked to succeed. */
char *decode_ok(const struct tokenizer *t, const uint32_t *ids, size_t n, unsigned flags, size_t *len);
/* decode(ids) with flags gives exactly want (EXPECT_DECODE below). */
void expect_decode(const struct tokenizer *t, const uint32_t *ids, size_t n, unsigned flags, const char *want,
		   size_t want_len);
/* encode then decode equals the text (flags for each side). */
void expect_round_trip(const struct tokenizer *t, const char *text, size_t len, unsigned enc_flags,
		       unsigned dec_flags);
/* Is s well-formed UTF-8 (restated independently of the tokenizer's own check)? */
bool valid_utf8(const char *s, size_t n);

/* A random number in [0, n) from rng_state. */
uint32_t rnd(uint32_t n);
/* Writes cp as UTF-8 to out (room for 4 bytes); returns its length. */
size_t put_cp(char *out, uint32_t cp);
/* Random valid UTF-8 of up to max_units pieces into buf (room for 16 * max_units + 1 bytes):
 * words, runs of spaces and newlines, digits, punctuation, accents, CJK, emoji, other scripts
 * with combining marks, the rarer white space, and now and then any valid code point. With
 * specials, now and then a special token's text. */
size_t random_text(char *buf, unsigned max_units, bool specials);

/* Checks t against vectors made by Hugging Face tokenizers 0.23.2 (data/hf-vectors, see
 * make_hf_vectors.js there): each text's ids, and the text those ids decode to with and without
 * skipping special tokens. */
void check_hf_vectors(const struct tokenizer *t, const char *path);

#define EXPECT_IDS(t, text, flags, ...)                                                     \
	do {                                                                                \
		const uint32_t want_[] = {__VA_ARGS__};                                     \
		expect_ids_n((t), (text), strlen(text), (flags), want_, ARRAY_SIZE(want_)); \
	} while (0)

#define EXPECT_DECODE(t, flags, want, ...)                                                    \
	do {                                                                                  \
		const uint32_t ids_[] = {__VA_ARGS__};                                        \
		expect_decode((t), ids_, ARRAY_SIZE(ids_), (flags), (want), sizeof(want) - 1); \
	} while (0)

#endif

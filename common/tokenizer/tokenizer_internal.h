/* tokenizer_internal.h - what the parts of the tokenizer share (not for use outside this folder).
 *
 * Loading (load.c) copies what encoding and decoding need out of the JSON document and drops
 * the document: every piece's text and decoded bytes in one arena, an open-addressing hash from
 * piece text to id, another from an id pair to its merge (rank and result), a byte trie of the
 * added tokens (vocab.c), and the normalizer, pre-tokenizer and decoder as short lists of steps
 * (normalize.c, pretokenize.c, decode.c).
 *
 * Encoding (encode.c) follows the Hugging Face pipeline: added tokens are split out of the raw
 * text; each stretch of text between them is normalized, then pre-tokenized by the steps in
 * order (each step cuts or rewrites the pieces the previous one produced; recursion instead of
 * lists, so a pre-token costs no allocation), and each pre-token goes through the BPE model
 * (bpe.c): the whole pre-token from the vocab where ignore_merges says so, else one symbol per
 * character (per byte in byte-level files) merged pair by pair, the lowest rank first and the
 * leftmost among equal ranks, with a binary heap of candidate pairs (n log n in the pre-token's
 * length, so a megabyte without a space is no worse than a megabyte of words).
 *
 * Decoding (decode.c) turns each id into the bytes its piece stands for (precomputed at load)
 * and lets the stream decoder hold back an incomplete UTF-8 sequence until the next piece
 * completes it.
 *
 * Every allocation of these files goes through tok_malloc, tok_calloc and tok_realloc (alloc.c),
 * so that a test can fail the N-th one (tests/unit/tokenizer/test_tokenizer_alloc.c). */
#ifndef PIPELINE_TOKENIZER_INTERNAL_H
#define PIPELINE_TOKENIZER_INTERNAL_H
#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tokenizer/ids.h"
#include "common/tokenizer/tokenizer.h"
#include "common/utf8.h"
#include "common/util.h"

#define MAX_STEPS     8	  /* steps of a normalizer, pre-tokenizer or decoder Sequence */
#define BL_CODEPOINTS 324 /* the byte-level mapping uses code points below this */

/* ---- allocation (alloc.c) ---- */

/* malloc, calloc and realloc. Defined weak: a test that defines its own replaces them (and
 * counts or fails the calls); nothing else may. */
void *tok_malloc(size_t n);
void *tok_calloc(size_t n, size_t size);
void *tok_realloc(void *p, size_t n);

/* ---- buffers and UTF-8 (utf8.c) ---- */

struct buf {
	char *p;
	size_t len, cap;
};

/* Room for extra more bytes; tok_buf_put appends n bytes. Return 0 or -ENOMEM (b unchanged). */
int tok_buf_reserve(struct buf *b, size_t extra);
int tok_buf_put(struct buf *b, const void *p, size_t n);
/* Frees b->p and zeroes *b. */
void tok_buf_free(struct buf *b);
bool tok_has_prefix(const char *s, size_t n, const char *p, size_t pn);
/* Appends s[0..n) to out with each from replaced by to. 0 or -ENOMEM. */
int tok_replace_all_append(const char *s, size_t n, const char *from, size_t from_len, const char *to,
			   size_t to_len, struct buf *out);

/* The code point at s or ending at s + pos, as utf8.c says at each (units: common/utf8.h). */
int32_t tok_utf8_cp(const uint8_t *s, size_t n, size_t *len);
int32_t tok_utf8_cp_before(const uint8_t *s, size_t pos, size_t *len);
/* Writes cp as UTF-8 to out (room for 4 bytes); returns its length. */
size_t tok_utf8_put(uint32_t cp, uint8_t *out);
/* Unicode White_Space. */
bool tok_is_white(int32_t cp);

/* ---- the tokenizer ---- */

enum entry_kind {
	ENTRY_HOLE = 0,	 /* no piece has this id */
	ENTRY_VOCAB = 1, /* model.vocab */
	ENTRY_ADDED = 2, /* added_tokens (possibly also in the vocab, with the same text) */
};

struct entry {
	uint32_t off, len;	   /* the piece in the arena, NUL-terminated */
	uint32_t dec_off, dec_len; /* the bytes it decodes to, in the arena */
	uint8_t kind;		   /* enum entry_kind */
	uint8_t in_vocab;	   /* in model.vocab (an added token may be too) */
	uint8_t special;	   /* an added token marked "special" */
};

struct vocab_slot {
	uint32_t hash; /* low bits of the piece's FNV-1a */
	uint32_t id1;  /* id + 1; 0 is an empty slot */
};

struct merge_slot {
	uint64_t key;  /* (left + 1) << 32 | right; 0 is an empty slot */
	uint32_t rank; /* the merge's position in model.merges */
	uint32_t id;   /* the piece left + right */
};

struct added_token {
	uint32_t id;
	bool special, lstrip, rstrip, single_word;
};

struct trie_node {
	uint32_t child;	  /* first child, 0 for none (the root is nobody's child) */
	uint32_t sibling; /* next child of the same parent, 0 for none */
	int32_t added;	  /* index into added of the token ending here, -1 for none */
	uint8_t byte;
};

enum prepend_scheme { PREPEND_NEVER = 0, PREPEND_FIRST = 1, PREPEND_ALWAYS = 2 };

enum norm_kind { NORM_PREPEND = 1, NORM_REPLACE = 2 };

struct norm_step {
	enum norm_kind kind;
	char *from; /* REPLACE: the string replaced; PREPEND: the prefix */
	size_t from_len;
	char *to; /* REPLACE: its replacement */
	size_t to_len;
};

enum pretok_kind { PRETOK_SPLIT = 1, PRETOK_METASPACE = 2, PRETOK_BYTELEVEL = 3 };

struct pretok_step {
	enum pretok_kind kind;
	pcre2_code *re;	   /* SPLIT, and BYTELEVEL with use_regex; else NULL */
	bool prefix_space; /* BYTELEVEL add_prefix_space */
	char repl[8];	   /* METASPACE replacement character, UTF-8 */
	size_t repl_len;
	enum prepend_scheme prepend; /* METASPACE */
	bool split;		     /* METASPACE: cut before each replacement character */
};

enum dec_kind { DEC_BYTELEVEL = 1, DEC_REPLACE = 2, DEC_BYTEFALLBACK = 3, DEC_STRIP = 4, DEC_METASPACE = 5 };

/* A decoder step applied to each token on its own (Hugging Face applies the steps before Fuse to
 * each token; a Strip after Fuse works on the whole text and is kept apart, see strip_*). */
struct dec_step {
	enum dec_kind kind;
	char *from, *to; /* REPLACE; METASPACE: from is the replacement character */
	size_t from_len, to_len;
	char strip[8]; /* STRIP: the character, UTF-8 */
	size_t strip_len;
	unsigned start, stop;	     /* STRIP: at most this many at the start / end */
	enum prepend_scheme prepend; /* METASPACE */
};

struct tokenizer {
	uint32_t n_ids;		/* highest id + 1 */
	struct entry *entries;	/* n_ids, by id */
	char *arena;		/* pieces and decoded bytes */
	size_t arena_len;
	struct vocab_slot *vocab; /* piece -> id over model.vocab; vocab_mask + 1 slots */
	uint32_t vocab_mask;
	struct merge_slot *merges; /* (left, right) -> merge; merge_bits of size */
	unsigned merge_bits;
	struct added_token *added; /* n_added */
	uint32_t n_added;
	struct trie_node *trie; /* node 0 is the root */
	uint32_t n_trie, cap_trie;
	uint32_t root[256]; /* the root's child for each first byte (0: none): no sibling walk per byte */

	struct norm_step norm[MAX_STEPS];
	unsigned n_norm;
	struct pretok_step pretok[MAX_STEPS];
	unsigned n_pretok;
	struct dec_step dec[MAX_STEPS];
	unsigned n_dec;
	unsigned strip_start; /* decoder Strip after Fuse: leading strip_char to drop from the text */
	char strip_char[8];
	size_t strip_len;
	bool dec_first; /* a Metaspace decoder: the first token decodes differently */

	bool byte_level;    /* the model sees byte-level-mapped text (a ByteLevel pre-tokenizer step) */
	bool byte_fallback; /* unknown characters become <0xNN> pieces */
	bool fuse_unk;	    /* consecutive unknown characters make one unk */
	bool ignore_merges; /* a pre-token that is a whole piece is that piece */
	int32_t unk_id, bos_id, eos_id; /* -1: none */
	int adds_bos;	    /* tokenizer_adds_bos: 1, 0, or -1 (the file does not say) */
	int32_t byte_id[256];	       /* byte-level: the id of each byte's mapped character, -1 if none */
	int32_t fallback_id[256];      /* the ids of <0x00> .. <0xFF>, -1 if none */
	uint8_t bl_utf8[256][2];       /* byte-level mapping of each byte, UTF-8 */
	uint8_t bl_len[256];
	int16_t bl_byte[BL_CODEPOINTS]; /* the inverse: code point -> byte, -1 */
	pcre2_code *word_re;		/* single_word: is a character a word character */
};

/* ---- lookups (vocab.c) ---- */

/* The vocab id of the piece s[0..n), or -1. */
int32_t tok_vocab_find(const struct tokenizer *t, const char *s, size_t n);
/* The merge of the pair (left, right), or NULL. */
const struct merge_slot *tok_merge_find(const struct tokenizer *t, uint32_t left, uint32_t right);
/* The child of trie node node for byte b (node 0: the root), 0 for none. */
uint32_t tok_trie_child(const struct tokenizer *t, uint32_t node, uint8_t b);

/* ---- loading (load.c and the parsers of each part) ---- */

struct loader {
	const char *name; /* the file, for messages */
	char *err;
	size_t errlen;
	struct tokenizer *t;
	struct buf arena;
};

#define LERR(L, rc, ...) errorf((L)->err, (L)->errlen, (rc), __VA_ARGS__)

/* The JSON field readers (load.c; tok_json_kind and tok_json_id are ids.h's): each returns 0 or
 * -errno with a message naming the file, where (the path of obj in the document) and key. */
int tok_get_bool(struct loader *L, const json_t *obj, const char *where, const char *key, bool *out);
int tok_get_str(struct loader *L, const json_t *obj, const char *where, const char *key, bool required,
		const char **out, size_t *len);
int tok_get_type(struct loader *L, const json_t *obj, const char *where, const char **type);
int tok_get_string_pattern(struct loader *L, const json_t *obj, const char *where, const char **s, size_t *n);
/* A Replace step's String pattern and content, each at most TOK_REPLACE_MAX bytes. */
int tok_get_replace(struct loader *L, const json_t *obj, const char *where, const char **from, size_t *from_len,
		    const char **to, size_t *to_len);
int tok_get_char(struct loader *L, const json_t *obj, const char *where, const char *key, const char *def,
		 char out[8], size_t *len);
int tok_get_prepend(struct loader *L, const json_t *obj, const char *where, enum prepend_scheme *out);
/* A malloc'd NUL-terminated copy of s[0..n), or NULL. */
char *tok_dup_bytes(const char *s, size_t n);
/* One step of a normalizer, pre-tokenizer or decoder Sequence (arg: the parser's own). */
typedef int (*tok_step_parser)(struct loader *L, const json_t *step, const char *where, void *arg);
/* obj.key, a list of steps, each parsed by parse (load.c). */
int tok_parse_sequence(struct loader *L, const json_t *obj, const char *where, const char *key,
		       tok_step_parser parse, void *arg);

/* The model: vocab, added tokens, merges, unk and byte fallback (vocab.c). */
int tok_load_model(struct loader *L, const json_t *root);
/* One more piece (NUL-terminated) in the loader's arena at *off (vocab.c). */
int tok_arena_add(struct loader *L, const char *s, size_t n, uint32_t *off);
/* bos_id and eos_id from the post_processor and the usual names (vocab.c); cannot fail. */
void tok_find_bos_eos(struct tokenizer *t, const json_t *root);
/* The normalizer (normalize.c) and pre-tokenizer (pretokenize.c) steps, parsed into L->t. */
int tok_parse_normalizer(struct loader *L, const json_t *n, const char *where);
int tok_parse_pretok(struct loader *L, const json_t *p, const char *where);
/* Compiles a split pattern (pretokenize.c); where names it in messages. */
int tok_compile_pattern(struct loader *L, const char *where, const char *pat, size_t n, bool literal,
			pcre2_code **out);
/* The decoder steps (decode.c); fused: a Fuse step came before (the steps after it see the
 * whole text). */
int tok_parse_decoder(struct loader *L, const json_t *d, const char *where, bool *fused);
/* Each entry's decoded bytes, appended to the arena (decode.c). */
int tok_precompute_decoded(struct loader *L);

/* ---- encoding ---- */

struct sym;
struct cand;

/* Per-call state: encoding shares nothing mutable, so concurrent calls are safe. */
struct enc {
	const struct tokenizer *t;
	struct tok_ids *out;
	pcre2_match_data *md[MAX_STEPS]; /* for pretok[i].re, made on first use */
	pcre2_match_data *word_md;
	struct buf norm[2];	    /* normalizer steps write these in turn */
	struct buf step[MAX_STEPS]; /* pre-tokenizer step i's rewritten text */
	struct buf mapped;	    /* the byte-level mapped pre-token, for the whole-piece lookup */
	struct sym *sym;
	size_t sym_cap;
	struct cand *heap;
	size_t heap_n, heap_cap;
};

/* Appends id to v (encode.c). 0 or -ENOMEM. */
int tok_ids_push(struct tok_ids *v, uint32_t id);
/* Runs the normalizer steps over *s, *len (normalize.c): on return they point at the result (in
 * e->norm, or the input when there are no steps). 0 or -ENOMEM. */
int tok_normalize(struct enc *e, const char **s, size_t *len);
/* Pre-tokenizer step i over s[0..len); past the last step, the model (pretokenize.c). */
int tok_pretok(struct enc *e, unsigned i, const char *s, size_t len, bool at_start);
/* A PCRE2 match error as -errno. */
int tok_regex_error(int rc);
/* Runs BPE over one pre-token and appends its ids (bpe.c). */
int tok_bpe_word(struct enc *e, const uint8_t *s, size_t len);

#endif

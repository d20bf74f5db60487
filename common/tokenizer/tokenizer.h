/* tokenizer.h - a checkpoint's Hugging Face tokenizer.json: text to token ids and back.
 *
 *   char err[512];
 *   struct tokenizer *tok;
 *   if (tokenizer_load("/models/llama/tokenizer.json", &tok, err, sizeof(err)) != 0) {
 *           fprintf(stderr, "%s\n", err); ...
 *   }
 *   struct tok_ids ids = {0};
 *   rc = tokenizer_encode(tok, text, strlen(text), TOK_ADD_BOS, &ids);  // appends to ids
 *   ... ids.ids[0 .. ids.n)
 *   tok_ids_free(&ids);
 *
 *   struct tok_decoder *d = tok_decoder_create(tok, 0);                 // one per output stream
 *   const char *s; size_t n;
 *   for each generated id: { rc = tok_decoder_feed(d, id, &s, &n); fwrite(s, 1, n, stdout); }
 *   rc = tok_decoder_flush(d, &s, &n); fwrite(s, 1, n, stdout);
 *   tok_decoder_destroy(&d);
 *   tokenizer_destroy(&tok);
 *
 * What loads: model "BPE" in the two layouts Llama-family checkpoints ship.
 *  - Byte-level BPE (Llama 3, GPT-2 style): pre_tokenizer Sequence[Split(Regex, Isolated),
 *    ByteLevel(use_regex false)] or ByteLevel(use_regex true, the GPT-2 pattern); decoder ByteLevel;
 *    "ignore_merges": a pre-token that is a whole vocabulary entry is one token.
 *  - SentencePiece-style BPE (Llama 2, Mistral): normalizer Sequence[Prepend("▁"), Replace(" ",
 *    "▁")] or pre_tokenizer Metaspace("▁", prepend_scheme first/always/never, split); byte_fallback
 *    (<0xNN> tokens), unk_token, fuse_unk; decoder Sequence[Replace("▁", " "), ByteFallback, Fuse,
 *    Strip(" ", n, 0)] or Metaspace.
 * Merges are "a b" strings or ["a", "b"] pairs; a merge's rank is its position (a pair listed
 * twice keeps the later rank, as Hugging Face does). Added tokens (added_tokens) are split out
 * of the text first, longest match, honouring lstrip/rstrip/single_word; the text between them is
 * normalized and pre-tokenized piece by piece, so "first" prepend schemes apply only to text at
 * the very start of the input. Other normalizer, pre_tokenizer, decoder or model types are
 * refused with -ENOTSUP and a message naming them.
 *
 * Where this differs from Hugging Face tokenizers (checked against it on random text):
 *  - Split patterns run on PCRE2 (UTF, Unicode properties; \s spelled as Unicode White_Space like
 *    the Rust engines). The installed PCRE2's Unicode tables decide \p{L}/\p{N}: Debian 12's
 *    10.42 has Unicode 14, so characters assigned since (CJK extension H, ...) split differently.
 *  - Added tokens keep the "id" the file gives them (Hugging Face renumbers those not in the vocab
 *    from the vocab's end: the same ids in every consistent file). Added tokens marked
 *    "normalized" are matched in the raw text like the others.
 *  - Byte-fallback bytes that are not valid UTF-8: U+FFFD per maximal invalid subpart (valid
 *    characters around them kept), where Hugging Face makes every byte token of the run U+FFFD.
 *
 * Invalid UTF-8 in the text to encode (defined, not an error): each byte that is not part of a
 * well-formed UTF-8 sequence is a pre-token of its own. Byte-level BPE encodes it through the
 * byte mapping like any byte; SentencePiece-style BPE through byte fallback (<0xNN>), else
 * unk_token (fused with its neighbours under fuse_unk). So decode(encode(x), TOK_DECODE_RAW) == x
 * for every x in byte-level files, and in SentencePiece files with byte fallback for text that
 * the normalizer does not change (the legacy layout: all text that holds no "▁" and no added
 * token's text; the Metaspace layout drops a leading space, as Hugging Face does). Where neither
 * a piece, byte fallback nor unk_token can spell a character, encoding fails with -EILSEQ rather
 * than dropping the character.
 *
 * Decoding: each id's piece is turned back into bytes the way the file's decoder says
 * (added tokens decode to their content as written); the decoder holds back a UTF-8 sequence
 * that is still incomplete at the end of a piece until the next piece completes it, so a
 * character split over tokens comes out whole and once. Bytes that cannot become UTF-8 (an
 * invalid sequence, or an incomplete one at the flush) come out as U+FFFD, one per maximal
 * invalid subpart (Unicode's "substitution of maximal subparts", what Rust's from_utf8_lossy
 * does), unless TOK_DECODE_RAW asks for the bytes as the tokens spell them.
 *
 * A loaded tokenizer is read-only: encode, decode and the lookups may run on many threads at
 * once; a tok_decoder belongs to one thread at a time. */
#ifndef PIPELINE_TOKENIZER_H
#define PIPELINE_TOKENIZER_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

/* The largest token id a file may use: ids index arrays sized by the largest one. */
#define TOK_MAX_ID ((1u << 24) - 1)
/* The longest pattern or content of a Replace step (normalizer or decoder) a file may use: real
 * files replace one character by another ("\u2581" and " "), and a long content multiplies what a
 * text or a piece grows to (every piece is decoded at load). */
#define TOK_REPLACE_MAX 64

struct tokenizer;
struct tok_decoder;

/* A growable array of ids, owned by the caller: start it as {0}, free it with tok_ids_free.
 * The functions that fill it append and grow it; on failure they leave n as it was. */
struct tok_ids {
	uint32_t *ids; /* n ids, capacity cap */
	size_t n;
	size_t cap;
};

/* Frees v->ids and zeroes *v. Safe on a zeroed struct and twice. */
void tok_ids_free(struct tok_ids *v);

enum tok_encode_flags {
	TOK_ADD_BOS = 1u << 0,	       /* put tokenizer_bos() first */
	TOK_SPECIAL_AS_TEXT = 1u << 1, /* special-token text in the input is plain text (added tokens
					  that are not special are still split out) */
};

enum tok_decode_flags {
	TOK_SKIP_SPECIAL = 1u << 0, /* special tokens decode to nothing (default: to their text) */
	TOK_DECODE_RAW = 1u << 1,   /* invalid UTF-8 comes out as the bytes are, not as U+FFFD */
};

/* Loads a tokenizer.json (or path/tokenizer.json where path is a directory). Returns 0 and
 * *out (owned by the caller: tokenizer_destroy); on failure *out is NULL, a message naming the
 * file and the problem is in err, and the return is -ENOENT (no such file), -EINVAL (not JSON,
 * or malformed: a missing vocab, a merges entry that is not a pair or names an unknown piece,
 * an id used twice, a regex that does not compile, ...), -ENOTSUP (a model, normalizer,
 * pre_tokenizer or decoder type or option this reader does not implement), -EFBIG (over 1 GiB),
 * -ENOMEM, or the -errno of a failed open or read. */
int tokenizer_load(const char *path, struct tokenizer **out, char *err, size_t errlen);

/* The same from size bytes of tokenizer.json already in memory (the runner gets them from the
 * weight ring); name names them in messages. Returns as tokenizer_load. */
int tokenizer_load_buffer(const char *name, const char *data, size_t size, struct tokenizer **out, char *err,
			  size_t errlen);

/* Frees everything. Safe on NULL and twice; NULLs *tok. */
void tokenizer_destroy(struct tokenizer **tok);

/* Encodes len bytes of text (any bytes; see "Invalid UTF-8" above) and appends the ids to out.
 * flags: enum tok_encode_flags. Returns 0; -ENOENT for TOK_ADD_BOS when the tokenizer knows no
 * BOS; -EILSEQ when a character has no piece, no byte fallback and no unk_token; -ENOMEM
 * (memory, or the regex engine's limits on a pathological input). On failure out->n is
 * unchanged. */
int tokenizer_encode(const struct tokenizer *tok, const char *text, size_t len, unsigned flags,
		     struct tok_ids *out);

/* The same, where a special token may match only text of which no byte is marked plain
 * (plain[i] != 0; plain NULL: none is): a chat template's own special tokens count, those inside
 * the text of a message do not. Returns as tokenizer_encode. */
int tokenizer_encode_marked(const struct tokenizer *tok, const char *text, size_t len, const uint8_t *plain,
			    unsigned flags, struct tok_ids *out);

/* Decodes a whole sequence into *out (malloc'd, NUL-terminated, owned by the caller; *len
 * without the NUL, and the text may hold NULs of its own). flags: enum tok_decode_flags.
 * Returns 0, -EINVAL for an id that is not in the tokenizer (*out NULL), or -ENOMEM. */
int tokenizer_decode(const struct tokenizer *tok, const uint32_t *ids, size_t n, unsigned flags, char **out,
		     size_t *len);

/* The highest id over the vocab and the added tokens, plus one. Ids below it that neither
 * defines (holes) are rejected by the decoder. */
uint32_t tokenizer_vocab_size(const struct tokenizer *tok);

/* The beginning-of-sequence id: the special token the post_processor (TemplateProcessing) puts
 * first; without one, the first of <|begin_of_text|>, <s>, <bos> that exists. -1 when none.
 * The checkpoint's config.json (model_config.bos_id) is the authority where both exist. */
int32_t tokenizer_bos(const struct tokenizer *tok);

/* Does an encoding of text begin with a BOS token, as the file's post_processor says? 1: a
 * TemplateProcessing puts a special token first; 0: its template puts none first, or the
 * post_processor is a byte-level one alone (GPT-2's, Qwen's files: nothing is added); -1: the file
 * has no post_processor, and does not say. */
int tokenizer_adds_bos(const struct tokenizer *tok);

/* The end-of-sequence id: the first of <|end_of_text|>, </s>, <eos>, <|endoftext|> that exists
 * (tokenizer.json does not record it; model_config.eos_ids does). -1 when none. */
int32_t tokenizer_eos(const struct tokenizer *tok);

/* The id of a piece written exactly as in the file ("<|eot_id|>", "Ġhello", "▁the"): added
 * tokens first, then the vocab. -1 when there is none. */
int32_t tokenizer_token_to_id(const struct tokenizer *tok, const char *piece);

/* The piece of an id as the file writes it (NUL-terminated, owned by the tokenizer), with its
 * length in *len when len is not NULL. NULL for an id that is not in the tokenizer. */
const char *tokenizer_id_to_piece(const struct tokenizer *tok, uint32_t id, size_t *len);

/* Is id an added token marked "special"? */
bool tokenizer_is_special(const struct tokenizer *tok, uint32_t id);

/* A streaming decoder over tok (which must outlive it). flags: enum tok_decode_flags. Returns
 * NULL when out of memory. Owned by the caller: tok_decoder_destroy. */
struct tok_decoder *tok_decoder_create(const struct tokenizer *tok, unsigned flags);

/* Feeds one id. *bytes and *len are what became complete text with it (possibly nothing: an
 * incomplete character is held back), valid until the next call on d. Returns 0, -EINVAL for an
 * id that is not in the tokenizer (nothing emitted, the state unchanged), or -ENOMEM. */
int tok_decoder_feed(struct tok_decoder *d, uint32_t id, const char **bytes, size_t *len);

/* Ends the sequence: what is held back comes out (U+FFFD unless TOK_DECODE_RAW) and the decoder
 * starts afresh, ready for another sequence. Returns 0 or -ENOMEM. */
int tok_decoder_flush(struct tok_decoder *d, const char **bytes, size_t *len);

/* Frees d. Safe on NULL and twice; NULLs *d. */
void tok_decoder_destroy(struct tok_decoder **d);

#ifdef __cplusplus
}
#endif
#endif

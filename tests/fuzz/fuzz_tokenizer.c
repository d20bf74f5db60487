/* fuzz_tokenizer.c - libFuzzer harness for the tokenizer.json loader (common/tokenizer/).
 *
 * The input is a tokenizer.json, optionally followed by a NUL byte and a text (a raw NUL cannot
 * occur in JSON, so the first one ends the document). tokenizer_load_buffer must take any bytes
 * without a crash, a leak or undefined behaviour. When the file loads, the harness encodes a
 * short fixed text and the text of the input (or, without a NUL, a window of the JSON itself,
 * which holds the vocabulary's pieces) with each set of flags, and checks what tokenizer.h
 * promises:
 *  - every id encode gives is inside tokenizer_vocab_size and decodes (tokenizer_decode
 *    returns 0 for it), with each set of decode flags;
 *  - the streaming decoder (tok_decoder_feed per id, then tok_decoder_flush) gives exactly the
 *    bytes tokenizer_decode gives for the whole sequence, again after the flush, and refuses an
 *    undefined id without a trace; the same for up to 64 defined ids taken from the text;
 *  - tokenizer_id_to_piece / tokenizer_token_to_id agree for every id that has a piece;
 *  - bos and eos are -1 or ids that have a piece;
 *  - in a plain byte-level file (no normalizer; pre_tokenizer ByteLevel without a prefix space,
 *    alone or after Split steps; decoder ByteLevel; no byte_fallback, no unk_token), decoding
 *    with TOK_DECODE_RAW gives the text back byte for byte when no added token was split out
 *    (tokenizer.h: "decode(encode(x), TOK_DECODE_RAW) == x for every x in byte-level files").
 *
 *   build-fuzz/fuzz/fuzz_tokenizer -dict=tests/fuzz/tokenizer.dict NEW_DIR tests/fuzz/corpus/tokenizer
 *
 * FUZZ_VERBOSE=1 prints what became of each input. docs/fuzzing.md says more. */
#include <errno.h>
#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond, ...)                                                   \
	do {                                                               \
		if (!(cond)) {                                             \
			fprintf(stderr, "fuzz_tokenizer: %s: ", #cond);    \
			fprintf(stderr, __VA_ARGS__);                      \
			fputc('\n', stderr);                               \
			abort();                                           \
		}                                                          \
	} while (0)

#define MAX_TEXT 256 /* bytes of the input's text encoded per run: the regex engine is not ours to fuzz */

static const char plain_text[] = "Hello world! The caf\xc3\xa9 costs 3\xe2\x82\xac, don't   worry.\n\n\t"
				 "\xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80\xff\xfe\xc3 12345 \xe2\x96\x81x";
static const char fixed_text[] = "Hello world! The caf\xc3\xa9 costs 3\xe2\x82\xac, don't   worry.\n"
				 "<|begin_of_text|><s> \xe2\x96\x81x\t\xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80"
				 "\xff\xfe\xc3 12345 </s>";

/* Decodes ids whole and streamed with flags; both must succeed and agree. */
static void check_decode(const struct tokenizer *tok, const struct tok_ids *ids, unsigned flags)
{
	char *whole = NULL;
	size_t whole_len = 0;
	int rc = tokenizer_decode(tok, ids->ids, ids->n, flags, &whole, &whole_len);
	if (rc == -ENOMEM)
		return;
	CHECK(rc == 0, "tokenizer_decode of defined ids returned %d", rc);
	CHECK(whole && whole[whole_len] == 0, "decoded text is not NUL-terminated");

	struct tok_decoder *d = tok_decoder_create(tok, flags);
	if (!d) {
		free(whole);
		return;
	}
	char *stream = malloc(whole_len + 1);
	size_t stream_len = 0;
	CHECK(stream != NULL, "out of memory");
	for (size_t i = 0; i <= ids->n; i++) {
		const char *s;
		size_t n;
		rc = i < ids->n ? tok_decoder_feed(d, ids->ids[i], &s, &n) : tok_decoder_flush(d, &s, &n);
		if (rc == -ENOMEM)
			goto out;
		CHECK(rc == 0, "the stream decoder refused id %u: %d", i < ids->n ? ids->ids[i] : 0, rc);
		CHECK(stream_len + n <= whole_len, "the stream decoder gives more bytes than tokenizer_decode");
		memcpy(stream + stream_len, s, n);
		stream_len += n;
	}
	CHECK(stream_len == whole_len && memcmp(stream, whole, whole_len) == 0,
	      "the stream decoder and tokenizer_decode disagree (flags %u, %zu and %zu bytes)", flags, stream_len,
	      whole_len);
	/* A flushed decoder starts afresh: the same ids decode the same again, and an id that is
	 * not in the tokenizer, fed before each, is refused without a trace (tokenizer.h). */
	stream_len = 0;
	for (size_t i = 0; i <= ids->n; i++) {
		const char *s;
		size_t n;
		rc = tok_decoder_feed(d, i % 2 ? UINT32_MAX : tokenizer_vocab_size(tok), &s, &n);
		CHECK(rc == -EINVAL && n == 0, "the stream decoder took an id outside the tokenizer: %d, %zu bytes", rc, n);
		rc = i < ids->n ? tok_decoder_feed(d, ids->ids[i], &s, &n) : tok_decoder_flush(d, &s, &n);
		if (rc == -ENOMEM)
			goto out;
		CHECK(rc == 0 && stream_len + n <= whole_len, "a flushed decoder decodes differently");
		memcpy(stream + stream_len, s, n);
		stream_len += n;
	}
	CHECK(stream_len == whole_len && memcmp(stream, whole, whole_len) == 0, "a flushed decoder decodes differently");
out:
	tok_decoder_destroy(&d);
	tok_decoder_destroy(&d);
	free(stream);
	free(whole);
}

/* What the harness reads from the JSON itself: is it a plain byte-level file, and which ids are
 * added tokens (the round trip is checked only for texts where none was split out). */
struct doc_info {
	bool plain_byte_level;
	bool *added; /* n_ids of them */
	uint32_t n_ids;
};

static bool is_type(const json_t *o, const char *type)
{
	const json_t *t = json_object_get(o, "type");
	return json_is_object(o) && json_is_string(t) && !strcmp(json_string_value(t), type);
}

static bool plain_byte_level(const json_t *root)
{
	const json_t *model = json_object_get(root, "model"), *n = json_object_get(root, "normalizer");
	const json_t *p = json_object_get(root, "pre_tokenizer"), *unk = json_object_get(model, "unk_token");
	if ((n && !json_is_null(n)) || !is_type(json_object_get(root, "decoder"), "ByteLevel") ||
	    json_is_true(json_object_get(model, "byte_fallback")) || (unk && !json_is_null(unk)))
		return false;
	const json_t *last = p;
	if (is_type(p, "Sequence")) {
		const json_t *list = json_object_get(p, "pretokenizers");
		size_t k = json_array_size(list);
		if (!k)
			return false;
		for (size_t i = 0; i + 1 < k; i++)
			if (!is_type(json_array_get(list, i), "Split"))
				return false;
		last = json_array_get(list, k - 1);
	}
	return is_type(last, "ByteLevel") && json_is_false(json_object_get(last, "add_prefix_space"));
}

static void doc_info_read(struct doc_info *di, const char *json, size_t len, uint32_t n_ids)
{
	memset(di, 0, sizeof(*di));
	json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, NULL);
	CHECK(root != NULL, "the harness cannot read what the tokenizer loaded");
	di->plain_byte_level = plain_byte_level(root);
	di->added = calloc(n_ids, sizeof(*di->added));
	CHECK(di->added != NULL, "out of memory");
	di->n_ids = n_ids;
	const json_t *list = json_object_get(root, "added_tokens");
	for (size_t i = 0; i < json_array_size(list); i++) {
		const json_t *id = json_object_get(json_array_get(list, i), "id");
		if (json_is_integer(id) && json_integer_value(id) >= 0 && json_integer_value(id) < n_ids)
			di->added[json_integer_value(id)] = true;
	}
	json_decref(root);
}

/* decode(encode(text), TOK_DECODE_RAW) == text in a plain byte-level file. */
static void check_round_trip(const struct tokenizer *tok, const struct doc_info *di, const struct tok_ids *ids,
			     const char *text, size_t len)
{
	if (!di->plain_byte_level)
		return;
	for (size_t i = 0; i < ids->n; i++)
		if (ids->ids[i] < di->n_ids && di->added[ids->ids[i]])
			return;
	char *back = NULL;
	size_t back_len = 0;
	int rc = tokenizer_decode(tok, ids->ids, ids->n, TOK_DECODE_RAW, &back, &back_len);
	if (rc == -ENOMEM)
		return;
	CHECK(rc == 0, "tokenizer_decode returned %d", rc);
	CHECK(back_len == len && memcmp(back, text, len) == 0,
	      "byte-level round trip: %zu bytes in, %zu out ('%.*s' -> '%.*s')", len, back_len, (int)(len > 80 ? 80 : len),
	      text, (int)(back_len > 80 ? 80 : back_len), back);
	free(back);
	if (getenv("FUZZ_VERBOSE"))
		fprintf(stderr, "fuzz_tokenizer: byte-level round trip of %zu bytes\n", len);
}

static void check_text(const struct tokenizer *tok, const struct doc_info *di, const char *text, size_t len)
{
	static const unsigned enc_flags[] = {0, TOK_ADD_BOS, TOK_SPECIAL_AS_TEXT};
	static const unsigned dec_flags[] = {0, TOK_SKIP_SPECIAL, TOK_DECODE_RAW};
	uint32_t vocab = tokenizer_vocab_size(tok);
	for (size_t f = 0; f < sizeof(enc_flags) / sizeof(enc_flags[0]); f++) {
		struct tok_ids ids = {0};
		int rc = tokenizer_encode(tok, text, len, enc_flags[f], &ids);
		if (rc) {
			CHECK(rc == -ENOENT || rc == -EILSEQ || rc == -ENOMEM, "tokenizer_encode returned %d", rc);
			CHECK(rc != -ENOENT || ((enc_flags[f] & TOK_ADD_BOS) && tokenizer_bos(tok) < 0),
			      "-ENOENT without a missing BOS");
			CHECK(ids.n == 0, "a failed encode left %zu ids", ids.n);
			tok_ids_free(&ids);
			continue;
		}
		for (size_t i = 0; i < ids.n; i++)
			CHECK(ids.ids[i] < vocab && tokenizer_id_to_piece(tok, ids.ids[i], NULL),
			      "encode gave id %u, which the tokenizer does not define (vocab size %u)", ids.ids[i],
			      vocab);
		if (enc_flags[f] & TOK_ADD_BOS)
			CHECK(ids.n >= 1 && ids.ids[0] == (uint32_t)tokenizer_bos(tok), "TOK_ADD_BOS put no BOS first");
		for (size_t k = 0; k < sizeof(dec_flags) / sizeof(dec_flags[0]); k++)
			check_decode(tok, &ids, dec_flags[k]);
		if (enc_flags[f] == 0)
			check_round_trip(tok, di, &ids, text, len);
		tok_ids_free(&ids);
		tok_ids_free(&ids);
	}
}

/* Any defined ids, not only what encode makes: up to 64, two bytes of the text each. Each set
 * of flags decodes them whole and streamed alike; with an undefined id among them,
 * tokenizer_decode refuses the sequence. */
static void check_any_ids(const struct tokenizer *tok, const char *text, size_t len)
{
	static const unsigned dec_flags[] = {0, TOK_SKIP_SPECIAL, TOK_DECODE_RAW, TOK_SKIP_SPECIAL | TOK_DECODE_RAW};
	uint32_t vocab = tokenizer_vocab_size(tok), hole = vocab;
	uint32_t ids[64];
	size_t n = 0;
	for (size_t i = 0; i + 1 < len && n < 64; i += 2) {
		uint32_t id = ((uint32_t)(uint8_t)text[i] | (uint32_t)(uint8_t)text[i + 1] << 8) % vocab;
		if (tokenizer_id_to_piece(tok, id, NULL))
			ids[n++] = id;
		else
			hole = id;
	}
	struct tok_ids v = {ids, n, 64};
	for (size_t k = 0; k < sizeof(dec_flags) / sizeof(dec_flags[0]); k++)
		check_decode(tok, &v, dec_flags[k]);
	if (n == 64)
		n--;
	ids[n++] = hole;
	char *out = (char *)(uintptr_t)1;
	size_t out_len = 0;
	int rc = tokenizer_decode(tok, ids, n, 0, &out, &out_len);
	CHECK(rc == -EINVAL || rc == -ENOMEM, "tokenizer_decode took undefined id %u: %d", hole, rc);
	CHECK(out == NULL, "a failed tokenizer_decode left *out set");
}

static void check_lookups(const struct tokenizer *tok)
{
	uint32_t vocab = tokenizer_vocab_size(tok);
	CHECK(vocab >= 1 && vocab <= TOK_MAX_ID + 1u, "vocab size %u", vocab);
	for (uint32_t id = 0; id < vocab; id++) {
		size_t len = 0;
		const char *piece = tokenizer_id_to_piece(tok, id, &len);
		if (!piece)
			continue;
		CHECK(len == strlen(piece) && len > 0, "piece of id %u: length %zu, strlen %zu", id, len, strlen(piece));
		int32_t back = tokenizer_token_to_id(tok, piece);
		CHECK(back == (int32_t)id, "id %u has piece '%s', which looks up as %d", id, piece, back);
	}
	CHECK(tokenizer_id_to_piece(tok, vocab, NULL) == NULL, "a piece past the vocab size");
	CHECK(tokenizer_id_to_piece(tok, UINT32_MAX, NULL) == NULL, "a piece for id UINT32_MAX");
	int32_t bos = tokenizer_bos(tok), eos = tokenizer_eos(tok);
	CHECK(bos == -1 || (bos >= 0 && tokenizer_id_to_piece(tok, (uint32_t)bos, NULL)), "bos %d", bos);
	CHECK(eos == -1 || (eos >= 0 && tokenizer_id_to_piece(tok, (uint32_t)eos, NULL)), "eos %d", eos);
	CHECK(tokenizer_token_to_id(tok, "") == -1, "the empty piece has an id");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const char *json = (const char *)data;
	const uint8_t *nul = memchr(data, 0, size);
	size_t json_len = nul ? (size_t)(nul - data) : size;
	const char *text;
	size_t text_len;
	if (nul) {
		text = (const char *)nul + 1;
		text_len = size - json_len - 1;
	} else {
		/* A window of the document: its pieces and the text around them. */
		text = json + json_len / 3;
		text_len = json_len - json_len / 3;
	}
	if (text_len > MAX_TEXT)
		text_len = MAX_TEXT;

	char err[512];
	struct tokenizer *tok = (struct tokenizer *)(uintptr_t)1;
	int rc = tokenizer_load_buffer("fuzz.json", json, json_len, &tok, err, sizeof(err));
	if (getenv("FUZZ_VERBOSE"))
		fprintf(stderr, "fuzz_tokenizer: %s\n", rc ? err : "loads");
	if (rc) {
		CHECK(tok == NULL, "a failed load left *out set");
		CHECK(rc == -EINVAL || rc == -ENOTSUP || rc == -ENOMEM || rc == -EFBIG, "tokenizer_load_buffer returned %d (%s)",
		      rc, err);
		CHECK(memchr(err, 0, sizeof(err)) != NULL, "the error message is not terminated");
		return 0;
	}
	CHECK(tok != NULL, "loaded, but no tokenizer");
	check_lookups(tok);
	struct doc_info di;
	doc_info_read(&di, json, json_len, tokenizer_vocab_size(tok));
	check_text(tok, &di, plain_text, sizeof(plain_text) - 1);
	check_text(tok, &di, fixed_text, sizeof(fixed_text) - 1);
	check_text(tok, &di, text, text_len);
	check_text(tok, &di, "", 0);
	check_any_ids(tok, text, text_len);
	free(di.added);
	tokenizer_destroy(&tok);
	tokenizer_destroy(&tok);
	return 0;
}

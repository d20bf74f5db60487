/* test_manifest_gguf_vocab.c - GGUF tokenizers made into tokenizer.json text
 * (manifest_gguf_vocab.c): tokenizer.json files of the tokenizer tests turned into
 * tokenizer.ggml.* keys by the test writer and back must tokenize and decode their test vectors
 * exactly as the original files do (the Llama 3 tokenizer with llama.cpp's vectors and Hugging
 * Face's, the SentencePiece fixture with Hugging Face's); a cut of Llama 3 travels with the tiny
 * model through manifest_load; keys that make no tokenizer this project loads leave the model
 * without one and a note, never a failure. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/gguf.h"
#include "common/manifest_internal.h"
#include "common/tokenizer/tokenizer.h"
#include "tests/unit/common/test_helpers.h"
#include "tests/unit/manifest/gguf_test_writer.h"
#include "tests/unit/manifest/manifest_test_util.h"

#define LLAMA3_JSON    TOK_TEST_LLAMA3_DIR "/tokenizer.json"
#define SP_LEGACY_JSON TOK_TEST_FIXTURE_DIR "/sp-legacy/tokenizer.json"

/* The tokenizer.json text made from the file at path: checked to be made, with no note. */
static char *convert_ok(const char *path, size_t *len)
{
	char err[512] = "", note[256] = "x";
	struct gguf *g = NULL;
	int rc = gguf_open(path, &g, err, sizeof(err));
	ck_assert_msg(rc == 0, "%s: %s", path, err);
	char *json = NULL;
	rc = mf_gguf_tokenizer_json(g, &json, len, note, sizeof(note), err, sizeof(err));
	ck_assert_msg(rc == 0 && json, "%s: rc %d, note \"%s\", err \"%s\"", path, rc, note, err);
	ck_assert_str_eq(note, "");
	gguf_close(&g);
	return json;
}

static struct tokenizer *load_json(const char *json, size_t len)
{
	char err[512] = "";
	struct tokenizer *t = NULL;
	int rc = tokenizer_load_buffer("converted", json, len, &t, err, sizeof(err));
	ck_assert_msg(rc == 0, "the converted tokenizer does not load: %s", err);
	return t;
}

static char *ids_str(const uint32_t *ids, size_t n)
{
	char *s = malloc(12 * n + 1);
	ck_assert_ptr_nonnull(s);
	size_t o = 0;
	s[0] = 0;
	for (size_t i = 0; i < n; i++)
		o += (size_t)sprintf(s + o, " %u", ids[i]);
	return s;
}

/* Hugging Face's vectors (tests/unit/tokenizer/data/hf-vectors): text -> ids, ids -> dec. */
static void check_hf_vectors(const struct tokenizer *t, const char *path)
{
	json_error_t je;
	json_t *cases = json_load_file(path, 0, &je);
	ck_assert_msg(cases && json_array_size(cases) > 100, "%s: %s", path, je.text);
	for (size_t i = 0; i < json_array_size(cases); i++) {
		const json_t *c = json_array_get(cases, i), *jids = json_object_get(c, "ids");
		const json_t *text = json_object_get(c, "text"), *dec = json_object_get(c, "dec");
		size_t n = json_array_size(jids);
		uint32_t *want = malloc(sizeof(*want) * (n + 1));
		ck_assert_ptr_nonnull(want);
		for (size_t k = 0; k < n; k++)
			want[k] = (uint32_t)json_integer_value(json_array_get(jids, k));
		struct tok_ids got = {0};
		TH_CHECK(tokenizer_encode(t, json_string_value(text), json_string_length(text), 0, &got) == 0,
			 "%s case %zu: encode failed", path, i);
		if (got.n != n || (n && memcmp(got.ids, want, n * sizeof(*want)))) {
			char *g = ids_str(got.ids, got.n), *w = ids_str(want, n);
			ck_abort_msg("%s case %zu '%s': want%s, got%s", path, i, json_string_value(text), w, g);
		}
		char *back;
		size_t len;
		TH_CHECK(tokenizer_decode(t, want, n, 0, &back, &len) == 0, "%s case %zu: decode failed", path, i);
		TH_CHECK(len == json_string_length(dec) && !memcmp(back, json_string_value(dec), len),
			 "%s case %zu: decodes to '%s', want '%s'", path, i, back, json_string_value(dec));
		free(back);
		tok_ids_free(&got);
		free(want);
	}
	json_decref(cases);
}

static char *slurp(const char *path, size_t *len)
{
	char *b = read_file(path, len);
	b[*len] = 0;
	return b;
}

/* llama.cpp's vectors for Llama 3 (tests/data/llama3-tokenizer/vocab.inp, .out). */
static void check_llama_cpp_vectors(const struct tokenizer *t)
{
	size_t in_len, out_len;
	char *in = slurp(TOK_TEST_LLAMA3_DIR "/vocab.inp", &in_len);
	char *out = slurp(TOK_TEST_LLAMA3_DIR "/vocab.out", &out_len);
	static const char delim[] = "\n__ggml_vocab_test__\n";
	const char *p = in, *line = out;
	int cases = 0;
	for (const char *q; (q = strstr(p, delim)) != NULL; p = q + strlen(delim)) {
		const char *nl = strchr(line, '\n');
		ck_assert_ptr_nonnull(nl);
		char *want = strndup(line, (size_t)(nl - line));
		line = nl + 1;
		struct tok_ids ids = {0};
		ck_assert_int_eq(tokenizer_encode(t, p, (size_t)(q - p), 0, &ids), 0);
		char *got = ids_str(ids.ids, ids.n);
		ck_assert_msg(!strcmp(got, want), "case %d '%.*s': want%s, got%s", cases, (int)(q - p), p, want, got);
		free(got);
		free(want);
		tok_ids_free(&ids);
		cases++;
	}
	ck_assert_int_eq(cases, 46);
	free(in);
	free(out);
}

START_TEST(test_llama3)
{
	struct gw *w = gw_new();
	ck_assert_int_eq(gw_tokenizer_from_hf(w, LLAMA3_JSON, "gpt2", "llama-bpe", 0, 0, 128000, 128001), 0);
	gw_bool(w, "tokenizer.ggml.add_bos_token", true);
	const char *path = tpath("llama3.gguf");
	ck_assert_int_eq(gw_write(w, path), 0);
	gw_free(&w);
	size_t len;
	char *json = convert_ok(path, &len);
	struct tokenizer *t = load_json(json, len);
	ck_assert_uint_eq(tokenizer_vocab_size(t), 128256);
	ck_assert_int_eq(tokenizer_bos(t), 128000);
	ck_assert_int_eq(tokenizer_eos(t), 128001);
	ck_assert_int_eq(tokenizer_token_to_id(t, "Hello"), 9906);
	ck_assert_int_eq(tokenizer_token_to_id(t, "<|eot_id|>"), 128009);
	ck_assert(tokenizer_is_special(t, 128009));
	ck_assert(!tokenizer_is_special(t, 9906));
	check_llama_cpp_vectors(t);
	check_hf_vectors(t, TOK_TEST_FIXTURE_DIR "/hf-vectors/llama3.json");
	/* Special tokens split out of text, and BOS. */
	struct tok_ids ids = {0};
	static const char chat[] = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>";
	ck_assert_int_eq(tokenizer_encode(t, chat, strlen(chat), TOK_ADD_BOS, &ids), 0);
	const uint32_t want[] = {128000, 128006, 882, 128007, 271, 13347, 128009};
	ck_assert_uint_eq(ids.n, 7);
	ck_assert_int_eq(memcmp(ids.ids, want, sizeof(want)), 0);
	tok_ids_free(&ids);
	tokenizer_destroy(&t);
	free(json);
}
END_TEST

START_TEST(test_sentencepiece)
{
	struct gw *w = gw_new();
	ck_assert_int_eq(gw_tokenizer_from_hf(w, SP_LEGACY_JSON, "llama", NULL, 0, 0, 1, 2), 0);
	gw_u32(w, "tokenizer.ggml.unknown_token_id", 0);
	const char *path = tpath("sp.gguf");
	ck_assert_int_eq(gw_write(w, path), 0);
	gw_free(&w);
	size_t len;
	char *json = convert_ok(path, &len);
	struct tokenizer *t = load_json(json, len);
	ck_assert_uint_eq(tokenizer_vocab_size(t), 295);
	ck_assert_int_eq(tokenizer_bos(t), 1);
	ck_assert_int_eq(tokenizer_eos(t), 2);
	check_hf_vectors(t, TOK_TEST_FIXTURE_DIR "/hf-vectors/sp-legacy.json");
	tokenizer_destroy(&t);
	free(json);
	/* Without the space prefix: " world" and "world" no longer agree on the first piece. Without
	 * unknown_token_id: the token of type unknown is unk_token. */
	w = gw_new();
	ck_assert_int_eq(gw_tokenizer_from_hf(w, SP_LEGACY_JSON, "llama", NULL, 0, 0, 1, 2), 0);
	gw_bool(w, "tokenizer.ggml.add_space_prefix", false);
	gw_bool(w, "tokenizer.ggml.add_bos_token", false);
	ck_assert_int_eq(gw_write(w, path), 0);
	gw_free(&w);
	json = convert_ok(path, &len);
	ck_assert_ptr_nonnull(strstr(json, "\"unk_token\":\"<unk>\""));
	t = load_json(json, len);
	ck_assert_int_eq(tokenizer_bos(t), -1); /* add_bos_token false */
	struct tok_ids a = {0}, b = {0};
	ck_assert_int_eq(tokenizer_encode(t, "world", 5, 0, &a), 0);
	ck_assert_int_eq(tokenizer_encode(t, " world", 6, 0, &b), 0);
	ck_assert_int_eq(tokenizer_token_to_id(t, "\xe2\x96\x81world"), (int32_t)b.ids[0]);
	ck_assert_int_ne(a.ids[0], b.ids[0]);
	char *back;
	size_t bl;
	ck_assert_int_eq(tokenizer_decode(t, b.ids, b.n, 0, &back, &bl), 0);
	ck_assert_str_eq(back, " world"); /* no Strip: the space stays */
	free(back);
	tok_ids_free(&a);
	tok_ids_free(&b);
	tokenizer_destroy(&t);
	free(json);
}
END_TEST

/* The tiny model with a cut of Llama 3 (ids below 500, 12 added tokens from 500) and the keys
 * fn adds. */
static const char *write_model_with_vocab(const char *name, const char *pre, void (*fn)(struct gw *w))
{
	struct gw *w = gw_new();
	gw_tiny_llama(w, &(struct gw_llama){.type = GW_Q8_0, .no_tokens_meta = true});
	ck_assert_int_eq(gw_tokenizer_from_hf(w, LLAMA3_JSON, "gpt2", pre, 500, 12, 500, 501), 0);
	if (fn)
		fn(w);
	const char *path = tpath("%s", name);
	ck_assert_int_eq(gw_write(w, path), 0);
	gw_free(&w);
	return path;
}

static void template(struct gw *w)
{
	gw_str(w, "tokenizer.chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}");
}

START_TEST(test_in_manifest)
{
	const char *path = write_model_with_vocab("m.gguf", "llama-bpe", template);
	struct manifest *m = load_ok(path);
	ck_assert_ptr_nonnull(m->tokenizer_json);
	ck_assert_uint_eq(m->tokenizer_bytes, strlen(m->tokenizer_json));
	ck_assert_str_eq(m->tokenizer_path, path);
	ck_assert_str_eq(m->tokenizer_note, "");
	ck_assert_str_eq(m->chat_template, "{% for m in messages %}{{ m.content }}{% endfor %}");
	ck_assert_int_eq(m->cfg.bos_id, 500);
	ck_assert_int_eq(m->cfg.eos_ids[0], 501);
	struct tokenizer *t = load_json(m->tokenizer_json, m->tokenizer_bytes);
	ck_assert_uint_eq(tokenizer_vocab_size(t), 512);
	ck_assert_int_eq(tokenizer_bos(t), 500);
	static const char text[] = "Hello, world! 123 \xc3\xa9t\xc3\xa9 <|eot_id|>";
	struct tok_ids ids = {0};
	ck_assert_int_eq(tokenizer_encode(t, text, strlen(text), TOK_ADD_BOS, &ids), 0);
	ck_assert_uint_eq(ids.ids[0], 500);
	char *back;
	size_t len;
	ck_assert_int_eq(tokenizer_decode(t, ids.ids + 1, ids.n - 1, 0, &back, &len), 0);
	ck_assert_str_eq(back, text);
	free(back);
	tok_ids_free(&ids);
	tokenizer_destroy(&t);
	manifest_destroy(&m);
	/* The GPT-2 pattern and smaug-bpe load as well. */
	m = load_ok(write_model_with_vocab("g.gguf", "gpt-2", NULL));
	ck_assert_ptr_nonnull(m->tokenizer_json);
	t = load_json(m->tokenizer_json, m->tokenizer_bytes);
	tokenizer_destroy(&t);
	manifest_destroy(&m);
	m = load_ok(write_model_with_vocab("s.gguf", "smaug-bpe", NULL));
	ck_assert_ptr_nonnull(m->tokenizer_json);
	manifest_destroy(&m);
}
END_TEST

/* ---- no tokenizer, and why ---- */

static void model_bert(struct gw *w)
{
	gw_str(w, "tokenizer.ggml.model", "bert");
}

/* A tokenizer built by hand: tokens (and ntypes types when given), merges, model gpt2 / llama-bpe. */
static const char *write_hand(const char *name, const char *const *tok, size_t n, const int32_t *types, size_t ntypes,
			      const char *const *merges, size_t nm)
{
	struct gw *w = gw_new();
	gw_tiny_llama(w, &(struct gw_llama){.type = GW_F32});
	gw_str(w, "tokenizer.ggml.model", "gpt2");
	gw_str(w, "tokenizer.ggml.pre", "llama-bpe");
	gw_arr_str(w, "tokenizer.ggml.tokens", tok, NULL, n);
	if (types)
		gw_arr_i32(w, "tokenizer.ggml.token_type", types, ntypes);
	gw_arr_str(w, "tokenizer.ggml.merges", merges, NULL, nm);
	const char *path = tpath("%s", name);
	ck_assert_int_eq(gw_write(w, path), 0);
	gw_free(&w);
	return path;
}

static void expect_note(const char *path, const char *word)
{
	struct manifest *m = load_ok(path);
	ck_assert_ptr_null(m->tokenizer_json);
	ck_assert_uint_eq(m->tokenizer_bytes, 0);
	ck_assert_msg(strstr(m->tokenizer_note, word) && strstr(m->tokenizer_note, "token ids only"),
		      "note \"%s\" lacks \"%s\"", m->tokenizer_note, word);
	manifest_destroy(&m);
}

START_TEST(test_no_tokenizer)
{
	expect_note(write_model_with_vocab("qwen.gguf", "qwen2", NULL),
		    "tokenizer.ggml.pre \"qwen2\" is not supported (supported: llama-bpe (llama3, llama-v3), smaug-bpe, gpt-2)");
	expect_note(write_model_with_vocab("nopre.gguf", NULL, NULL), "tokenizer.ggml.pre \"(none)\"");
	struct gw *w = gw_new();
	gw_tiny_llama(w, &(struct gw_llama){.type = GW_F32});
	model_bert(w);
	const char *path = tpath("bert.gguf");
	ck_assert_int_eq(gw_write(w, path), 0);
	gw_free(&w);
	expect_note(path, "tokenizer.ggml.model \"bert\" is not supported");

	const char *tok[] = {"a", "b", "ab", "a", "<|x|>", "\xff"};
	const int32_t types[] = {1, 1, 1, 1, 3, 1, 1};
	const char *merges[] = {"a b"};
	expect_note(write_hand("dup.gguf", tok, 4, NULL, 0, merges, 1), "tokens 0 and 3 are the same piece \"a\"");
	expect_note(write_hand("utf8.gguf", tok, 6, NULL, 0, merges, 1), "token 5 is not valid UTF-8");
	expect_note(write_hand("types.gguf", tok, 3, types, 7, merges, 1), "token_type has 7 entries for 3 tokens");
	const char *tok2[] = {"a", "b", "ab", "<|x|>", "<|x|>"};
	const int32_t types2[] = {1, 1, 1, 3, 3};
	expect_note(write_hand("dupadd.gguf", tok2, 5, types2, 5, merges, 1),
		    "the added token \"<|x|>\" appears twice");
	const char *tok3[] = {"a", "b", "ab", "a"};
	const int32_t types3[] = {1, 1, 1, 3};
	expect_note(write_hand("addvocab.gguf", tok3, 4, types3, 4, merges, 1), "is also token 0");
	const char *bad_merges[] = {"a c"};
	expect_note(write_hand("merge.gguf", tok, 3, NULL, 0, bad_merges, 1), "merge 0 \"a c\" names a piece");
	const char *bad_merges2[] = {"ab"};
	expect_note(write_hand("merge2.gguf", tok, 3, NULL, 0, bad_merges2, 1), "is not two pieces");
	const int32_t all_control[] = {3, 3, 3};
	expect_note(write_hand("control.gguf", tok, 3, all_control, 3, merges, 1), "the vocab is empty");
	/* A good hand-made one loads. */
	struct manifest *m = load_ok(write_hand("good.gguf", tok, 3, NULL, 0, merges, 1));
	ck_assert_ptr_nonnull(m->tokenizer_json);
	struct tokenizer *t = load_json(m->tokenizer_json, m->tokenizer_bytes);
	struct tok_ids ids = {0};
	ck_assert_int_eq(tokenizer_encode(t, "ab", 2, 0, &ids), 0);
	ck_assert_uint_eq(ids.n, 1);
	ck_assert_uint_eq(ids.ids[0], 2);
	tok_ids_free(&ids);
	tokenizer_destroy(&t);
	manifest_destroy(&m);
	/* More tokens than the model has rows: the file contradicts itself. */
	w = gw_new();
	gw_tiny_llama(w, &(struct gw_llama){.type = GW_F32});
	const char **many = calloc(600, sizeof(*many));
	char(*pieces)[8] = calloc(600, sizeof(*pieces));
	for (int i = 0; i < 600; i++) {
		snprintf(pieces[i], sizeof(pieces[i]), "p%d", i);
		many[i] = pieces[i];
	}
	gw_str(w, "tokenizer.ggml.model", "gpt2");
	gw_arr_str(w, "tokenizer.ggml.tokens", many, NULL, 600);
	path = tpath("many.gguf");
	ck_assert_int_eq(gw_write(w, path), 0);
	gw_free(&w);
	free(many);
	free(pieces);
	load_fails(path, -EINVAL, "tokenizer.ggml.tokens lists 600 tokens, but the model's vocab_size is 512");
}
END_TEST

/* A SentencePiece vocabulary of long pieces made of shorter ones (a^1..a^256, b^1..b^256): every
 * cut of every piece is a merge, some 65000 for 512 tokens, past the cap of 8 a token and 32768:
 * no tokenizer, said, where the conversion made gigabytes of JSON from a larger such file. */
START_TEST(test_sp_merges_capped)
{
	struct gw *w = gw_new();
	gw_tiny_llama(w, &(struct gw_llama){.type = GW_F32});
	const char **tok = calloc(512, sizeof(*tok));
	char(*pieces)[260] = calloc(512, sizeof(*pieces));
	float *score = calloc(512, sizeof(*score));
	for (int i = 0; i < 512; i++) {
		memset(pieces[i], i < 256 ? 'a' : 'b', (size_t)(i % 256 + 1));
		tok[i] = pieces[i];
		score[i] = -(float)(i % 256);
	}
	gw_str(w, "tokenizer.ggml.model", "llama");
	gw_arr_str(w, "tokenizer.ggml.tokens", tok, NULL, 512);
	gw_arr_f32(w, "tokenizer.ggml.scores", score, 512);
	const char *path = tpath("spmany.gguf");
	ck_assert_int_eq(gw_write(w, path), 0);
	gw_free(&w);
	free(tok);
	free(pieces);
	free(score);
	expect_note(path, "make more than 36864 merges");
}
END_TEST

int main(void)
{
	const struct test_case cases[] = {
	    {"convert", {test_llama3, test_sentencepiece, NULL}},
	    {"manifest", {test_in_manifest, test_no_tokenizer, test_sp_merges_capped, NULL}},
	};
	return run_cases("manifest_gguf_vocab", cases, ARRAY_SIZE(cases));
}

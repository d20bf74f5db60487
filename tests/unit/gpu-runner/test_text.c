/* test_text.c - the runner's text interface: prompts from text and chat messages in both
 * built-in chat formats and through a model's chat template, the end-of-turn stop, stop strings found across token boundaries, and the
 * errors a bad request gets. Uses the real Llama 3 tokenizer.json (tests/data); the ChatML
 * case renames two of its special tokens. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "services/gpu-runner/text.h"

static struct tokenizer *llama3, *chatml;
static struct model_config cfg;

static char *data_path(const char *rel)
{
	const char *src = getenv("PIPELINE_SOURCE_DIR");
	ck_assert_msg(src != NULL, "PIPELINE_SOURCE_DIR is not set (ctest sets it)");
	char *p = malloc(strlen(src) + strlen(rel) + 2);
	sprintf(p, "%s/%s", src, rel);
	return p;
}

/* The Llama 3 file with <|start_header_id|> and <|eot_id|> renamed to ChatML's tokens. */
static struct tokenizer *make_chatml(const char *llama3_path)
{
	json_error_t jerr;
	json_t *root = json_load_file(llama3_path, 0, &jerr);
	ck_assert_ptr_nonnull(root);
	json_t *added = json_object_get(root, "added_tokens");
	size_t i;
	json_t *t;
	json_array_foreach(added, i, t)
	{
		const char *c = json_string_value(json_object_get(t, "content"));
		if (!strcmp(c, "<|start_header_id|>"))
			json_object_set_new(t, "content", json_string("<|im_start|>"));
		else if (!strcmp(c, "<|eot_id|>"))
			json_object_set_new(t, "content", json_string("<|im_end|>"));
	}
	char *text = json_dumps(root, JSON_COMPACT);
	json_decref(root);
	struct tokenizer *tok = NULL;
	char err[512];
	ck_assert_msg(tokenizer_load_buffer("chatml", text, strlen(text), &tok, err, sizeof(err)) == 0, "%s", err);
	free(text);
	return tok;
}

/* The Llama 3 file with its post_processor replaced by pp (NULL: none at all). */
static struct tokenizer *with_post_processor(json_t *pp)
{
	char *path = data_path("tests/data/llama3-tokenizer/tokenizer.json");
	json_error_t jerr;
	json_t *root = json_load_file(path, 0, &jerr);
	free(path);
	ck_assert_ptr_nonnull(root);
	if (pp)
		json_object_set_new(root, "post_processor", pp);
	else
		json_object_del(root, "post_processor");
	char *text = json_dumps(root, JSON_COMPACT);
	json_decref(root);
	struct tokenizer *tok = NULL;
	char err[512];
	ck_assert_msg(tokenizer_load_buffer("variant", text, strlen(text), &tok, err, sizeof(err)) == 0, "%s", err);
	free(text);
	return tok;
}

static void setup(void)
{
	char *p = data_path("tests/data/llama3-tokenizer/tokenizer.json");
	char err[512];
	ck_assert_msg(tokenizer_load(p, &llama3, err, sizeof(err)) == 0, "%s", err);
	chatml = make_chatml(p);
	free(p);
	memset(&cfg, 0, sizeof(cfg));
	cfg.vocab_size = 128256;
	cfg.bos_id = 128000;
}

static void teardown(void)
{
	tokenizer_destroy(&llama3);
	tokenizer_destroy(&chatml);
}

static void expect_ids(const struct tokenizer *tok, const struct tok_ids *got, const char *text, unsigned flags)
{
	struct tok_ids want = {0};
	ck_assert_int_eq(tokenizer_encode(tok, text, strlen(text), flags, &want), 0);
	ck_assert_uint_eq(got->n, want.n);
	for (size_t i = 0; i < want.n; i++)
		ck_assert_msg(got->ids[i] == want.ids[i], "id %zu: %u, want %u", i, got->ids[i], want.ids[i]);
	tok_ids_free(&want);
}

static int build_with(const struct tokenizer *tok, const struct jinja_template *tmpl, const char *prompt,
		      const char *chat, uint64_t flags, struct text_prompt *tp, char *err, size_t errlen)
{
	struct msg_generate g = {.flags = flags};
	if (prompt)
		g.prompt = (struct bytes){(char *)prompt, (uint32_t)strlen(prompt)};
	if (chat)
		g.chat = (struct bytes){(char *)chat, (uint32_t)strlen(chat)};
	return text_prompt_build(tok, tmpl, &cfg, &g, tp, err, errlen);
}

static int build(const struct tokenizer *tok, const char *prompt, const char *chat, uint64_t flags,
		 struct text_prompt *tp, char *err, size_t errlen)
{
	return build_with(tok, NULL, prompt, chat, flags, tp, err, errlen);
}

START_TEST(test_formats_detected)
{
	ck_assert_int_eq(chat_format_of(llama3), CHAT_LLAMA3);
	ck_assert_int_eq(chat_format_of(chatml), CHAT_CHATML);
	ck_assert_int_eq(chat_format_of(NULL), CHAT_NONE);
}
END_TEST

START_TEST(test_prompt_text)
{
	struct text_prompt tp;
	char err[256];
	ck_assert_int_eq(build(llama3, "Hello world", NULL, 0, &tp, err, sizeof(err)), 0);
	expect_ids(llama3, &tp.ids, "<|begin_of_text|>Hello world", 0);
	ck_assert_int_eq(tp.end_of_turn, -1);
	text_prompt_free(&tp);
	/* No BOS; special-token text as plain text. */
	ck_assert_int_eq(build(llama3, "<|eot_id|>x", NULL, GEN_NO_BOS | GEN_SPECIAL_AS_TEXT, &tp, err, sizeof(err)), 0);
	expect_ids(llama3, &tp.ids, "<|eot_id|>x", TOK_SPECIAL_AS_TEXT);
	ck_assert_uint_ne(tp.ids.ids[0], 128009);
	text_prompt_free(&tp);
	/* Parsed as a special token by default. */
	ck_assert_int_eq(build(llama3, "<|eot_id|>x", NULL, GEN_NO_BOS, &tp, err, sizeof(err)), 0);
	ck_assert_uint_eq(tp.ids.ids[0], 128009);
	text_prompt_free(&tp);
}
END_TEST

/* Whether a text prompt starts with BOS is the tokenizer file's to say, as in Hugging Face: a
 * byte-level post_processor alone (Qwen's files) adds none, though config.json names a
 * bos_token_id; a file with no post_processor leaves it to config.json. */
START_TEST(test_prompt_bos_by_tokenizer)
{
	struct text_prompt tp;
	char err[256];
	ck_assert_int_eq(tokenizer_adds_bos(llama3), 1);
	struct tokenizer *bl = with_post_processor(json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space",
							     0, "trim_offsets", 0, "use_regex", 1));
	ck_assert_int_eq(tokenizer_adds_bos(bl), 0);
	struct tokenizer *seq = with_post_processor(json_pack("{s:s, s:[{s:s, s:b, s:b, s:b}]}", "type", "Sequence",
							      "processors", "type", "ByteLevel", "add_prefix_space", 0,
							      "trim_offsets", 0, "use_regex", 1));
	ck_assert_int_eq(tokenizer_adds_bos(seq), 0);
	tokenizer_destroy(&seq);
	ck_assert_int_eq(build(bl, "Hello world", NULL, 0, &tp, err, sizeof(err)), 0);
	expect_ids(bl, &tp.ids, "Hello world", 0);
	text_prompt_free(&tp);
	tokenizer_destroy(&bl);
	struct tokenizer *none = with_post_processor(NULL);
	ck_assert_int_eq(tokenizer_adds_bos(none), -1);
	ck_assert_int_eq(build(none, "Hello world", NULL, 0, &tp, err, sizeof(err)), 0);
	expect_ids(none, &tp.ids, "<|begin_of_text|>Hello world", 0);
	text_prompt_free(&tp);
	tokenizer_destroy(&none);
}
END_TEST

START_TEST(test_chat_llama3)
{
	struct text_prompt tp;
	char err[256];
	const char *chat = "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"  Hi\\n\"}]";
	ck_assert_int_eq(build(llama3, NULL, chat, 0, &tp, err, sizeof(err)), 0);
	expect_ids(llama3, &tp.ids,
		   "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
		   "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
		   "<|start_header_id|>assistant<|end_header_id|>\n\n",
		   0);
	ck_assert_int_eq(tp.end_of_turn, 128009);
	text_prompt_free(&tp);
	/* Jinja's trim is Python's str.strip(): Unicode's white space goes too (a no-break space, an
	 * ideographic space, a line separator, the file separator \x1c), whole characters; a character
	 * that only ends in a space's last byte (U+00E0 is C3 A0, as U+00A0 is C2 A0) stays. */
	chat = "[{\"role\":\"user\",\"content\":\"\\u3000\\u00a0Hi\\u00a0\\u2028\\u001c \"}]";
	ck_assert_int_eq(build(llama3, NULL, chat, 0, &tp, err, sizeof(err)), 0);
	expect_ids(llama3, &tp.ids,
		   "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
		   "<|start_header_id|>assistant<|end_header_id|>\n\n",
		   0);
	text_prompt_free(&tp);
	chat = "[{\"role\":\"user\",\"content\":\"Hi \\u00e0\"}]";
	ck_assert_int_eq(build(llama3, NULL, chat, 0, &tp, err, sizeof(err)), 0);
	expect_ids(llama3, &tp.ids,
		   "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi \xc3\xa0<|eot_id|>"
		   "<|start_header_id|>assistant<|end_header_id|>\n\n",
		   0);
	text_prompt_free(&tp);
}
END_TEST

START_TEST(test_chat_chatml)
{
	struct text_prompt tp;
	char err[256];
	const char *chat = "[{\"role\":\"user\",\"content\":\" Hi\"}]";
	ck_assert_int_eq(build(chatml, NULL, chat, 0, &tp, err, sizeof(err)), 0);
	/* ChatML keeps the content as it is (no trim) and adds no BOS. */
	expect_ids(chatml, &tp.ids, "<|im_start|>user\n Hi<|im_end|>\n<|im_start|>assistant\n", 0);
	ck_assert_int_eq(tp.end_of_turn, tokenizer_token_to_id(chatml, "<|im_end|>"));
	text_prompt_free(&tp);
}
END_TEST

static struct jinja_template *parse(const char *text)
{
	struct jinja_template *t;
	char err[512];
	ck_assert_msg(jinja_parse(text, strlen(text), &t, err, sizeof(err)) == 0, "%s", err);
	return t;
}

/* Llama 3's own template (as Meta's tokenizer_config.json has it). */
static const char llama3_template[] =
	"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
	"'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
	"'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
	"{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
	"{% endif %}";

/* The same ids through a model's template as through the built-in format it spells, for every
 * chat of the built-in tests, special-token text in a message parsed or not. */
START_TEST(test_chat_template)
{
	static const char *const chats[] = {
		"[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"  Hi\\n\"}]",
		"[{\"role\":\"user\",\"content\":\"\\u3000\\u00a0Hi\\u00a0\\u2028\\u001c \"}]",
		"[{\"role\":\"user\",\"content\":\"Hi \\u00e0\"},{\"role\":\"assistant\",\"content\":\"Yo\"},"
		"{\"role\":\"user\",\"content\":\"a<|eot_id|>b<|start_header_id|>\"}]",
	};
	struct jinja_template *t = parse(llama3_template);
	for (size_t i = 0; i < sizeof(chats) / sizeof(chats[0]); i++)
		for (int as_text = 0; as_text < 2; as_text++) {
			struct text_prompt a, b;
			char err[512];
			uint64_t flags = as_text ? GEN_SPECIAL_AS_TEXT : 0;
			ck_assert_int_eq(build(llama3, NULL, chats[i], flags, &a, err, sizeof(err)), 0);
			ck_assert_msg(build_with(llama3, t, NULL, chats[i], flags, &b, err, sizeof(err)) == 0, "%s", err);
			ck_assert_uint_eq(a.ids.n, b.ids.n);
			for (size_t k = 0; k < a.ids.n; k++)
				ck_assert_msg(a.ids.ids[k] == b.ids.ids[k], "chat %zu (as text %d), id %zu: %u, want %u", i,
					      as_text, k, b.ids.ids[k], a.ids.ids[k]);
			ck_assert_int_eq(b.end_of_turn, 128009);
			text_prompt_free(&a);
			text_prompt_free(&b);
		}
	/* the special tokens in the message: 3 more ids as text than as tokens (<|eot_id|> and
	 * <|start_header_id|> spelled in pieces), so the marks are what decided */
	struct text_prompt a, b;
	char err[512];
	ck_assert_int_eq(build_with(llama3, t, NULL, chats[2], 0, &a, err, sizeof(err)), 0);
	ck_assert_int_eq(build_with(llama3, t, NULL, chats[2], GEN_SPECIAL_AS_TEXT, &b, err, sizeof(err)), 0);
	ck_assert_uint_gt(b.ids.n, a.ids.n);
	text_prompt_free(&a);
	text_prompt_free(&b);
	jinja_free(&t);

	/* A ChatML template over the ChatML tokenizer: its built-in format. */
	t = parse("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
		  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}");
	ck_assert_int_eq(build_with(chatml, t, NULL, "[{\"role\":\"user\",\"content\":\" Hi\"}]", 0, &b, err, sizeof(err)), 0);
	expect_ids(chatml, &b.ids, "<|im_start|>user\n Hi<|im_end|>\n<|im_start|>assistant\n", 0);
	ck_assert_int_eq(b.end_of_turn, tokenizer_token_to_id(chatml, "<|im_end|>"));
	text_prompt_free(&b);
	jinja_free(&t);

	/* A template of another family: its text, tokenized whole, no BOS added (it writes "<s>" as
	 * text here: the Llama 3 vocabulary has no such token), and no end-of-turn id of its own. */
	t = parse("{{ bos_token }}{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}");
	ck_assert_int_eq(build_with(llama3, t, NULL, "[{\"role\":\"user\",\"content\":\"Hi\"}]", 0, &b, err, sizeof(err)), 0);
	expect_ids(llama3, &b.ids, "<|begin_of_text|>[INST] Hi [/INST]", 0);
	text_prompt_free(&b);
	jinja_free(&t);

	/* A template's refusal and error are the request's error. */
	t = parse("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ x.y }}");
	ck_assert_int_eq(build_with(llama3, t, NULL, "[{\"role\":\"system\",\"content\":\"s\"}]", 0, &b, err, sizeof(err)),
			 -EINVAL);
	ck_assert_msg(strstr(err, "refused the chat: first must be user"), "%s", err);
	ck_assert_int_eq(build_with(llama3, t, NULL, "[{\"role\":\"user\",\"content\":\"s\"}]", 0, &b, err, sizeof(err)),
			 -EINVAL);
	ck_assert_msg(strstr(err, "'x' is undefined"), "%s", err);
	/* and the messages are checked as for the built-in formats */
	ck_assert_int_eq(build_with(llama3, t, NULL, "[{\"role\":\"<|eot_id|>\",\"content\":\"s\"}]", 0, &b, err,
				    sizeof(err)),
			 -EINVAL);
	ck_assert_msg(strstr(err, "invalid role"), "%s", err);
	jinja_free(&t);
}
END_TEST

START_TEST(test_chat_errors)
{
	struct text_prompt tp;
	char err[256];
	static const struct {
		const char *chat, *word;
	} bad[] = {
		{"not json", "JSON array"},
		{"{\"role\":\"user\"}", "JSON array"},
		{"[]", "JSON array"},
		{"[{\"role\":\"user\"}]", "\"content\""},
		{"[{\"role\":\"\",\"content\":\"x\"}]", "\"role\""},
		{"[{\"role\":\"<|eot_id|>\",\"content\":\"x\"}]", "invalid role"},
		{"[{\"role\":\"user\",\"content\":7}]", "\"content\""},
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		err[0] = 0;
		ck_assert_int_eq(build(llama3, NULL, bad[i].chat, 0, &tp, err, sizeof(err)), -EINVAL);
		ck_assert_msg(strstr(err, bad[i].word), "case %zu: '%s' lacks '%s'", i, err, bad[i].word);
		ck_assert_uint_eq(tp.ids.n, 0);
	}
	/* Without a tokenizer, text is refused. */
	ck_assert_int_eq(build(NULL, "x", NULL, 0, &tp, err, sizeof(err)), -ENOTSUP);
	ck_assert_ptr_nonnull(strstr(err, "tokenizer.json"));
	/* A model whose vocabulary is smaller than the tokenizer's ids. */
	cfg.vocab_size = 1000;
	ck_assert_int_eq(build(llama3, "Hello", NULL, GEN_NO_BOS, &tp, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "outside the model's vocabulary"));
}
END_TEST

START_TEST(test_stop_strings)
{
	struct text_stream *ts = NULL;
	char err[256];
	/* "Hello world" is 9906 1917: the stop "o w" spans both tokens. */
	ck_assert_int_eq(text_stream_create(llama3, "[\"o w\", \"zzz\"]", 14, &ts, err, sizeof(err)), 0);
	ck_assert(text_stream_has_stops(ts));
	const char *piece;
	size_t len;
	bool hit;
	ck_assert_int_eq(text_stream_push(ts, 9906, &piece, &len, &hit), 0);
	ck_assert(!hit);
	ck_assert_uint_eq(len, 5);
	ck_assert_int_eq(text_stream_push(ts, 1917, &piece, &len, &hit), 0);
	ck_assert(hit);
	text_stream_destroy(&ts);
	/* A stop inside one token's text, and none before it. */
	ck_assert_int_eq(text_stream_create(llama3, "[\"ell\"]", 7, &ts, err, sizeof(err)), 0);
	ck_assert_int_eq(text_stream_push(ts, 1917, &piece, &len, &hit), 0);
	ck_assert(!hit);
	ck_assert_int_eq(text_stream_push(ts, 9906, &piece, &len, &hit), 0);
	ck_assert(hit);
	text_stream_destroy(&ts);
	/* A character split over tokens (🦙 = 11410 99 247) comes out whole, and then matches. */
	ck_assert_int_eq(text_stream_create(llama3, "[\"\xf0\x9f\xa6\x99\"]", 8, &ts, err, sizeof(err)), 0);
	ck_assert_int_eq(text_stream_push(ts, 11410, &piece, &len, &hit), 0);
	ck_assert(!hit);
	ck_assert_int_eq(text_stream_push(ts, 99, &piece, &len, &hit), 0);
	ck_assert(!hit);
	ck_assert_uint_eq(len, 0);
	ck_assert_int_eq(text_stream_push(ts, 247, &piece, &len, &hit), 0);
	ck_assert(hit);
	ck_assert_uint_eq(len, 4);
	text_stream_destroy(&ts);
	/* Bad stop lists. */
	static const char *const bad[] = {"{}", "[1]", "[\"\"]", "not json",
					  "[\"a\",\"b\",\"c\",\"d\",\"e\",\"f\",\"g\",\"h\",\"i\",\"j\",\"k\",\"l\",\"m\",\"n\","
					  "\"o\",\"p\",\"q\"]"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		ck_assert_int_eq(text_stream_create(llama3, bad[i], strlen(bad[i]), &ts, err, sizeof(err)), -EINVAL);
		ck_assert_ptr_null(ts);
	}
}
END_TEST

static Suite *suite(void)
{
	Suite *s = suite_create("text");
	TCase *tc = tcase_create("prompts");
	tcase_add_unchecked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, test_formats_detected);
	tcase_add_test(tc, test_prompt_text);
	tcase_add_test(tc, test_prompt_bos_by_tokenizer);
	tcase_add_test(tc, test_chat_llama3);
	tcase_add_test(tc, test_chat_chatml);
	tcase_add_test(tc, test_chat_template);
	tcase_add_test(tc, test_chat_errors);
	suite_add_tcase(s, tc);
	tc = tcase_create("stops");
	tcase_add_unchecked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, test_stop_strings);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(suite());
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

/* test_openai.c - http-api's OpenAI side (services/http-api/openai.c): what a completions or chat
 * body turns into (defaults, each parameter, what is refused and the parameter named), the JSON
 * shapes of replies, chunks and errors, and the stop-string filter (nothing that may begin a
 * stop string is given out early; the text ends before the first stop string, also one split
 * over several pieces), the UTF-8 check of the runner's text and an error message that is not
 * UTF-8 (its bad bytes replaced, never the message dropped). */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <string.h>

#include "common/utf8.h"
#include "services/http-api/openai.h"
#include "tests/unit/common/test_helpers.h"

static const struct api_limits lim = {.max_tokens_default = 256, .max_tokens_limit = 4096};

static int parse(const char *body, enum api_kind kind, struct api_request *req, struct api_problem *why)
{
	return api_parse_request(body, strlen(body), kind, &lim, req, why);
}

/* body must be refused naming param (NULL: none). */
static void expect_refused(const char *body, enum api_kind kind, const char *param)
{
	struct api_request req;
	struct api_problem why;
	ck_assert_msg(parse(body, kind, &req, &why) == -EINVAL, "accepted: %s", body);
	ck_assert_msg(why.message[0], "no message for %s", body);
	if (param)
		ck_assert_msg(why.param && !strcmp(why.param, param), "%s: param %s, want %s", body,
			      why.param ? why.param : "(none)", param);
	else
		ck_assert_msg(!why.param, "%s: param %s, want none", body, why.param);
	ck_assert_ptr_null(req.prompt);
	ck_assert_ptr_null(req.chat_json);
}

START_TEST(completion_defaults)
{
	struct api_request req;
	struct api_problem why;
	ck_assert_int_eq(parse("{\"prompt\": \"hi\", \"model\": \"x\", \"frequency_penalty\": 0, \"user\": {}}",
			       API_COMPLETION, &req, &why),
			 0);
	ck_assert_str_eq(req.prompt, "hi");
	ck_assert_ptr_null(req.chat_json);
	ck_assert_int_eq(req.max_tokens, 256);
	ck_assert(req.temperature == 1.0 && req.top_p == 1.0);
	ck_assert(req.top_k == 0 && req.min_p == 0 && req.repetition_penalty == 1.0);
	ck_assert(!req.has_seed && !req.stream && !req.include_usage && !req.ignore_eos);
	ck_assert_int_eq(req.n_stops, 0);
	ck_assert_ptr_null(req.stops_json);
	api_request_free(&req);
	api_request_free(&req); /* twice is safe */
}
END_TEST

START_TEST(completion_parameters)
{
	struct api_request req;
	struct api_problem why;
	const char *body = "{\"prompt\": [\"one\"], \"max_tokens\": 12, \"temperature\": 0.5, \"top_p\": 0.9, "
			   "\"seed\": 7, \"stop\": [\"a\", \"\\n\\n\"], \"stream\": true, \"n\": 1, "
			   "\"stream_options\": {\"include_usage\": true}, \"top_k\": 40, \"min_p\": 0.05, "
			   "\"repetition_penalty\": 1.2, \"ignore_eos\": true}";
	ck_assert_int_eq(parse(body, API_COMPLETION, &req, &why), 0);
	ck_assert(req.ignore_eos);
	ck_assert_str_eq(req.prompt, "one");
	ck_assert_int_eq(req.max_tokens, 12);
	ck_assert(req.temperature == 0.5 && req.top_p == 0.9);
	ck_assert(req.has_seed && req.seed == 7);
	ck_assert(req.stream && req.include_usage);
	ck_assert(req.top_k == 40 && req.min_p == 0.05 && req.repetition_penalty == 1.2);
	ck_assert_int_eq(req.n_stops, 2);
	ck_assert_str_eq(req.stops[1], "\n\n");
	ck_assert_str_eq(req.stops_json, "[\"a\",\"\\n\\n\"]");
	api_request_free(&req);

	/* One stop string; top_p 0 is greedy. */
	ck_assert_int_eq(parse("{\"prompt\": \"x\", \"stop\": \"END\", \"top_p\": 0}", API_COMPLETION, &req, &why), 0);
	ck_assert_int_eq(req.n_stops, 1);
	ck_assert_str_eq(req.stops_json, "[\"END\"]");
	ck_assert(req.temperature == 0 && req.top_p == 1);
	api_request_free(&req);
}
END_TEST

START_TEST(completion_refused)
{
	expect_refused("", API_COMPLETION, NULL);
	expect_refused("{\"prompt\": \"x\",", API_COMPLETION, NULL);
	expect_refused("[1]", API_COMPLETION, NULL);
	expect_refused("{\"prompt\": \"x\", \"prompt\": \"y\"}", API_COMPLETION, NULL);
	expect_refused("{}", API_COMPLETION, "prompt");
	expect_refused("{\"prompt\": 5}", API_COMPLETION, "prompt");
	expect_refused("{\"prompt\": \"\"}", API_COMPLETION, "prompt");
	expect_refused("{\"prompt\": [\"a\", \"b\"]}", API_COMPLETION, "prompt");
	expect_refused("{\"prompt\": \"a\\u0000b\"}", API_COMPLETION, NULL); /* jansson refuses NUL */
	expect_refused("{\"prompt\": \"x\", \"model\": 3}", API_COMPLETION, "model");
	expect_refused("{\"prompt\": \"x\", \"max_tokens\": \"12\"}", API_COMPLETION, "max_tokens");
	expect_refused("{\"prompt\": \"x\", \"max_tokens\": 1.5}", API_COMPLETION, "max_tokens");
	expect_refused("{\"prompt\": \"x\", \"max_tokens\": 0}", API_COMPLETION, "max_tokens");
	expect_refused("{\"prompt\": \"x\", \"max_tokens\": 4097}", API_COMPLETION, "max_tokens");
	expect_refused("{\"prompt\": \"x\", \"temperature\": \"hot\"}", API_COMPLETION, "temperature");
	expect_refused("{\"prompt\": \"x\", \"temperature\": 2.5}", API_COMPLETION, "temperature");
	expect_refused("{\"prompt\": \"x\", \"temperature\": -1}", API_COMPLETION, "temperature");
	expect_refused("{\"prompt\": \"x\", \"top_p\": 1.1}", API_COMPLETION, "top_p");
	expect_refused("{\"prompt\": \"x\", \"seed\": 1.5}", API_COMPLETION, "seed");
	expect_refused("{\"prompt\": \"x\", \"seed\": \"1\"}", API_COMPLETION, "seed");
	expect_refused("{\"prompt\": \"x\", \"stop\": 5}", API_COMPLETION, "stop");
	expect_refused("{\"prompt\": \"x\", \"stop\": [\"a\", 5]}", API_COMPLETION, "stop");
	expect_refused("{\"prompt\": \"x\", \"stop\": [\"\"]}", API_COMPLETION, "stop");
	expect_refused("{\"prompt\": \"x\", \"stop\": [\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\","
		       "\"11\",\"12\",\"13\",\"14\",\"15\",\"16\",\"17\"]}",
		       API_COMPLETION, "stop");
	expect_refused("{\"prompt\": \"x\", \"stream\": \"yes\"}", API_COMPLETION, "stream");
	expect_refused("{\"prompt\": \"x\", \"stream_options\": 1}", API_COMPLETION, "stream_options");
	expect_refused("{\"prompt\": \"x\", \"n\": 2}", API_COMPLETION, "n");
	/* Function calling: tools offered, or a tool call asked for, are refused; none is no request. */
	expect_refused("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": \"function\", "
		       "\"function\": {\"name\": \"f\"}}]}", API_CHAT, "tools");
	expect_refused("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": \"required\"}",
		       API_CHAT, "tool_choice");
	expect_refused("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": {\"type\": "
		       "\"function\", \"function\": {\"name\": \"f\"}}}", API_CHAT, "tool_choice");
	{
		struct api_request ok;
		struct api_problem why;
		ck_assert_int_eq(parse("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [], "
				       "\"tool_choice\": \"none\"}", API_CHAT, &ok, &why), 0);
		api_request_free(&ok);
	}
	expect_refused("{\"prompt\": \"x\", \"top_k\": 1.5}", API_COMPLETION, "top_k");
	expect_refused("{\"prompt\": \"x\", \"top_k\": -2}", API_COMPLETION, "top_k");
	expect_refused("{\"prompt\": \"x\", \"min_p\": 2}", API_COMPLETION, "min_p");
	expect_refused("{\"prompt\": \"x\", \"repetition_penalty\": 0}", API_COMPLETION, "repetition_penalty");
	expect_refused("{\"prompt\": \"x\", \"ignore_eos\": 1}", API_COMPLETION, "ignore_eos");
}
END_TEST

START_TEST(chat_messages)
{
	struct api_request req;
	struct api_problem why;
	const char *body = "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\", \"name\": \"x\"}, "
			   "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"Hello \"}, "
			   "{\"type\": \"text\", \"text\": \"there\"}]}], \"max_completion_tokens\": 9}";
	ck_assert_int_eq(parse(body, API_CHAT, &req, &why), 0);
	ck_assert_ptr_null(req.prompt);
	json_t *msgs = json_loads(req.chat_json, 0, NULL);
	ck_assert_ptr_nonnull(msgs);
	json_t *want = json_loads("[{\"role\": \"system\", \"content\": \"Be brief.\"}, "
				  "{\"role\": \"user\", \"content\": \"Hello there\"}]",
				  0, NULL);
	ck_assert_msg(json_equal(msgs, want), "chat_json is %s", req.chat_json);
	json_decref(msgs);
	json_decref(want);
	ck_assert_int_eq(req.max_tokens, 9);
	api_request_free(&req);

	/* An assistant's earlier turn without content (null, or none: it called tools) is an empty
	 * turn; a user's is refused. A negative seed is taken, as OpenAI takes it. */
	body = "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": null}, "
	       "{\"role\": \"assistant\"}, {\"role\": \"user\", \"content\": \"b\"}], \"seed\": -1}";
	ck_assert_int_eq(parse(body, API_CHAT, &req, &why), 0);
	msgs = json_loads(req.chat_json, 0, NULL);
	want = json_loads("[{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"\"}, "
			  "{\"role\": \"assistant\", \"content\": \"\"}, {\"role\": \"user\", \"content\": \"b\"}]",
			  0, NULL);
	ck_assert_msg(json_equal(msgs, want), "chat_json is %s", req.chat_json);
	json_decref(msgs);
	json_decref(want);
	ck_assert(req.has_seed && req.seed == UINT64_MAX);
	api_request_free(&req);
	expect_refused("{\"messages\": [{\"role\": \"user\", \"content\": null}]}", API_CHAT, "messages");

	expect_refused("{\"prompt\": \"x\"}", API_CHAT, "messages");
	expect_refused("{\"messages\": \"hi\"}", API_CHAT, "messages");
	expect_refused("{\"messages\": []}", API_CHAT, "messages");
	expect_refused("{\"messages\": [{\"content\": \"hi\"}]}", API_CHAT, "messages");
	expect_refused("{\"messages\": [{\"role\": \"user\"}]}", API_CHAT, "messages");
	expect_refused("{\"messages\": [{\"role\": 1, \"content\": \"hi\"}]}", API_CHAT, "messages");
	expect_refused("{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", API_CHAT, "messages");
	expect_refused("{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", API_CHAT,
		       "messages");
	expect_refused("{\"messages\": [\"hi\"]}", API_CHAT, "messages");
}
END_TEST

START_TEST(reply_shapes)
{
	struct api_request req;
	struct api_problem why;
	ck_assert_int_eq(parse("{\"prompt\": \"x\"}", API_COMPLETION, &req, &why), 0);
	json_t *o = api_completion_json(&req, "cmpl-1", "m", 5, "abc", 2, "length", 3, 2);
	json_t *want = json_loads("{\"id\": \"cmpl-1\", \"object\": \"text_completion\", \"created\": 5, "
				  "\"model\": \"m\", \"choices\": [{\"index\": 0, \"text\": \"ab\", "
				  "\"logprobs\": null, \"finish_reason\": \"length\"}], \"usage\": "
				  "{\"prompt_tokens\": 3, \"completion_tokens\": 2, \"total_tokens\": 5}}",
				  0, NULL);
	ck_assert(json_equal(o, want));
	json_decref(o);
	json_decref(want);
	o = api_chunk_json(&req, "cmpl-1", "m", 5, "ab", 2, NULL, false);
	ck_assert_str_eq(json_string_value(json_object_get(json_array_get(json_object_get(o, "choices"), 0), "text")),
			 "ab");
	ck_assert(json_is_null(json_object_get(json_array_get(json_object_get(o, "choices"), 0), "finish_reason")));
	json_decref(o);
	api_request_free(&req);

	ck_assert_int_eq(parse("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", API_CHAT, &req, &why), 0);
	o = api_completion_json(&req, "c", "m", 5, "hi", 2, "stop", 1, 1);
	json_t *choice = json_array_get(json_object_get(o, "choices"), 0);
	ck_assert_str_eq(json_string_value(json_object_get(o, "object")), "chat.completion");
	ck_assert_str_eq(json_string_value(json_object_get(json_object_get(choice, "message"), "role")), "assistant");
	ck_assert_str_eq(json_string_value(json_object_get(json_object_get(choice, "message"), "content")), "hi");
	json_decref(o);
	o = api_chunk_json(&req, "c", "m", 5, "", 0, NULL, true);
	json_t *delta = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "delta");
	ck_assert_str_eq(json_string_value(json_object_get(o, "object")), "chat.completion.chunk");
	ck_assert_str_eq(json_string_value(json_object_get(delta, "role")), "assistant");
	json_decref(o);
	o = api_chunk_json(&req, "c", "m", 5, "", 0, "stop", false);
	delta = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "delta");
	ck_assert_int_eq(json_object_size(delta), 0);
	json_decref(o);
	o = api_usage_chunk_json(&req, "c", "m", 5, 4, 6);
	ck_assert_int_eq(json_array_size(json_object_get(o, "choices")), 0);
	ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(o, "usage"), "total_tokens")), 10);
	json_decref(o);
	api_request_free(&req);

	o = api_error_json("bad", "invalid_request_error", "max_tokens", NULL);
	want = json_loads("{\"error\": {\"message\": \"bad\", \"type\": \"invalid_request_error\", \"param\": "
			  "\"max_tokens\", \"code\": null}}",
			  0, NULL);
	ck_assert(json_equal(o, want));
	json_decref(o);
	json_decref(want);
	o = api_models_json("llama", 1);
	ck_assert_str_eq(json_string_value(json_object_get(json_array_get(json_object_get(o, "data"), 0), "id")),
			 "llama");
	json_t *one = api_model_json("llama", 1);
	ck_assert(json_equal(json_array_get(json_object_get(o, "data"), 0), one));
	ck_assert_str_eq(json_string_value(json_object_get(one, "object")), "model");
	json_decref(one);
	json_decref(o);

	ck_assert_str_eq(api_finish_reason("length"), "length");
	ck_assert_str_eq(api_finish_reason("context"), "length");
	ck_assert_str_eq(api_finish_reason("stop"), "stop");
	ck_assert_str_eq(api_finish_reason("stop_string"), "stop");
}
END_TEST

START_TEST(utf8)
{
	static const struct {
		const char *s;
		bool ok;
	} cases[] = {
		{"", true},
		{"plain ascii", true},
		{"caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80", true}, /* 2, 3 and 4 bytes */
		{"\xF4\x8F\xBF\xBF", true},				      /* U+10FFFF */
		{"\xC3", false},					      /* cut short */
		{"\xE2\x82", false},
		{"\x80", false},		  /* a continuation alone */
		{"\xC0\xAF", false},	  /* an overlong '/' */
		{"\xE0\x80\xAF", false},  /* overlong, 3 bytes */
		{"\xED\xA0\x80", false},  /* a surrogate */
		{"\xF4\x90\x80\x80", false}, /* past U+10FFFF */
		{"\xFF", false},
		{"ok \xC3\xA9 then \xE9 bad", false},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		ck_assert_msg(utf8_valid(cases[i].s, strlen(cases[i].s)) == cases[i].ok, "case %zu: want %d", i,
			      cases[i].ok);
	ck_assert(utf8_valid(NULL, 0));
	/* An error message with bytes that are not UTF-8 keeps its message, the bytes replaced. */
	json_t *o = api_error_json("no endpoint /\xFF\xC3 (x)", "invalid_request_error", NULL, "not_found");
	ck_assert_ptr_nonnull(o);
	const char *m = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
	ck_assert_msg(m != NULL, "the message was dropped");
	ck_assert_str_eq(m, "no endpoint /\xEF\xBF\xBD\xEF\xBF\xBD (x)");
	json_decref(o);
	/* A valid message is kept as it is. */
	o = api_error_json("caf\xC3\xA9", NULL, NULL, NULL);
	ck_assert_str_eq(json_string_value(json_object_get(json_object_get(o, "error"), "message")), "caf\xC3\xA9");
	json_decref(o);
}
END_TEST

/* Pushes the pieces in turn, collecting what the filter releases; the last release is final. */
static void run_filter(const char *body, const char *const *pieces, const char *want, bool want_stopped)
{
	struct api_request req;
	struct api_problem why;
	ck_assert_int_eq(parse(body, API_COMPLETION, &req, &why), 0);
	struct api_stop_filter f = {0};
	char out[256] = "";
	for (int i = 0; pieces[i]; i++) {
		ck_assert_int_eq(api_stop_filter_push(&f, &req, pieces[i], strlen(pieces[i])), 0);
		size_t from, end = api_stop_filter_release(&f, &req, false, &from);
		strncat(out, f.text + from, end - from);
		/* Nothing given out may be the start of a stop string's match still to come. */
		if (!f.stopped)
			for (int k = 0; k < req.n_stops; k++)
				ck_assert_msg(!strstr(out, req.stops[k]), "gave out '%s' holding '%s'", out,
					      req.stops[k]);
	}
	size_t from, end = api_stop_filter_release(&f, &req, true, &from);
	strncat(out, f.text ? f.text + from : "", end - from);
	ck_assert_str_eq(out, want);
	ck_assert_int_eq(f.stopped, want_stopped);
	api_stop_filter_free(&f);
	api_request_free(&req);
}

START_TEST(stop_filter)
{
	const char *none[] = {"Hello", " world", NULL};
	run_filter("{\"prompt\": \"x\"}", none, "Hello world", false);
	run_filter("{\"prompt\": \"x\", \"stop\": \"STOP\"}", none, "Hello world", false);
	/* The stop string split over three pieces, text after it dropped. */
	const char *split[] = {"one ST", "O", "P two", NULL};
	run_filter("{\"prompt\": \"x\", \"stop\": \"STOP\"}", split, "one ", true);
	/* A prefix held back that turns out not to be one is given out. */
	const char *almost[] = {"a ST", "Ox", NULL};
	run_filter("{\"prompt\": \"x\", \"stop\": \"STOP\"}", almost, "a STOx", false);
	/* A held-back prefix at the very end is given out when the generation ends. */
	const char *tail[] = {"end ST", NULL};
	run_filter("{\"prompt\": \"x\", \"stop\": \"STOP\"}", tail, "end ST", false);
	/* The earliest of two stop strings wins. */
	const char *two[] = {"abc", "de", "f", NULL};
	run_filter("{\"prompt\": \"x\", \"stop\": [\"ef\", \"cd\"]}", two, "ab", true);
	/* Stopped at the very start: nothing. */
	const char *first[] = {"\n\nrest", NULL};
	run_filter("{\"prompt\": \"x\", \"stop\": \"\\n\\n\"}", first, "", true);
	/* After a stop, more pieces change nothing. */
	const char *after[] = {"xSy", "zzz", NULL};
	run_filter("{\"prompt\": \"x\", \"stop\": \"S\"}", after, "x", true);
}
END_TEST

static Suite *openai_suite(void)
{
	Suite *s = suite_create("http_api_openai");
	TCase *tc = tcase_create("openai");
	tcase_add_test(tc, completion_defaults);
	tcase_add_test(tc, completion_parameters);
	tcase_add_test(tc, completion_refused);
	tcase_add_test(tc, chat_messages);
	tcase_add_test(tc, reply_shapes);
	tcase_add_test(tc, stop_filter);
	tcase_add_test(tc, utf8);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(openai_suite());
}

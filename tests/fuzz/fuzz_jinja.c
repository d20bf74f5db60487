/* fuzz_jinja.c - libFuzzer harness for chat templates (common/jinja/).
 *
 * The input is a template, optionally followed by a NUL byte and a JSON object of variables (a
 * raw NUL ends the template: the runner's templates are C strings). jinja_parse must take any
 * bytes without a crash, a leak or undefined behaviour, and return 0 or one of -EINVAL, -E2BIG,
 * -ENOMEM with a message. A template that parses is rendered twice: with a fixed chat (the
 * variables a runner passes: messages, bos_token, eos_token, add_generation_prompt), and with the
 * input's variables as data when they are a JSON object. Each render returns 0 or one of
 * -EBADMSG, -EINVAL, -E2BIG, -ENOMEM with a message; an output is NUL-terminated at its length,
 * its marks are 0 or 1, and no byte is marked where no data string was given. The limits are
 * lowered for the fuzzer (its CMakeLists), so that a loop over a large range ends quickly.
 *
 *   build/fuzz/fuzz/fuzz_jinja -dict=tests/fuzz/jinja.dict NEW_DIR tests/fuzz/corpus/jinja
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/jinja/jinja.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                              \
	do {                                                                     \
		if (!(cond)) {                                                   \
			fprintf(stderr, "fuzz_jinja: %s (line %d)\n", #cond, __LINE__); \
			abort();                                                 \
		}                                                                \
	} while (0)

static void check_render(const struct jinja_template *t, const json_t *vars, const json_t *data)
{
	struct jinja_output out;
	char err[512] = "";
	int rc = jinja_render(t, vars, data, 1764644645, &out, err, sizeof(err));
	if (rc) {
		CHECK(rc == -EBADMSG || rc == -EINVAL || rc == -E2BIG || rc == -ENOMEM);
		CHECK(err[0] != 0);
		return;
	}
	CHECK(out.text && out.from_data && out.text[out.len] == 0 && out.len <= JINJA_MAX_OUTPUT);
	for (size_t i = 0; i < out.len; i++) {
		CHECK(out.from_data[i] <= 1);
		CHECK(data || !out.from_data[i]);
	}
	jinja_output_free(&out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const char *text = (const char *)data;
	size_t tlen = strnlen(text, size);
	struct jinja_template *t = NULL;
	char err[512] = "";
	int rc = jinja_parse(text, tlen, &t, err, sizeof(err));
	if (rc) {
		CHECK(rc == -EINVAL || rc == -E2BIG || rc == -ENOMEM);
		CHECK(err[0] != 0 && !t);
		return 0;
	}
	json_t *vars = json_pack("{s:s, s:s, s:b}", "bos_token", "<s>", "eos_token", "</s>", "add_generation_prompt", 1);
	json_t *chat = json_pack("{s:[{s:s, s:s}, {s:s, s:s}, {s:s, s:s}]}", "messages", "role", "system", "content",
				 " Be brief. ", "role", "user", "content", "Hi <|eot_id|>", "role", "assistant",
				 "content", "<think>x</think>\n\nyo");
	check_render(t, vars, chat);
	check_render(t, NULL, NULL);
	if (tlen + 1 < size) {
		json_t *extra = json_loadb(text + tlen + 1, size - tlen - 1, JSON_DECODE_ANY, NULL);
		if (json_is_object(extra))
			check_render(t, vars, extra);
		json_decref(extra);
	}
	json_decref(vars);
	json_decref(chat);
	jinja_free(&t);
	return 0;
}

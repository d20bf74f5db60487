/* test_jinja.c - chat templates (common/jinja) against Python's jinja2 set up as transformers sets
 * it up: every case of cases.json (made by make_cases.py: templates in the style of those Llama 2,
 * Llama 3.1, Mistral, Qwen3 and Gemma checkpoints carry, over several chats, and one template per
 * feature) renders to the same bytes, raises the same exception text, or fails where jinja2 fails;
 * templates that do not parse are refused with a message; the marks of the data's bytes; the
 * limits on what a render may take. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/jinja/jinja.h"
#include "tests/unit/common/test_helpers.h"

static char *read_file(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	ck_assert_msg(f, "cannot open %s", path);
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	char *p = malloc((size_t)n + 1);
	ck_assert_ptr_nonnull(p);
	ck_assert_uint_eq(fread(p, 1, (size_t)n, f), (size_t)n);
	p[n] = 0;
	fclose(f);
	*len = (size_t)n;
	return p;
}

/* Renders text with vars and data; returns rc, *out filled on success. */
static int render(const char *text, size_t len, const json_t *vars, const json_t *data, time_t now,
		  struct jinja_output *out, char *err, size_t errlen)
{
	struct jinja_template *t;
	int rc = jinja_parse(text, len, &t, err, errlen);
	if (rc)
		return rc;
	rc = jinja_render(t, vars, data, now, out, err, errlen);
	jinja_free(&t);
	return rc;
}

START_TEST(test_cases)
{
	size_t len;
	char *text = read_file(JINJA_TEST_DIR "/cases.json", &len);
	json_error_t jerr;
	json_t *doc = json_loadb(text, len, 0, &jerr);
	free(text);
	ck_assert_msg(doc, "cases.json: %s", jerr.text);
	time_t now = (time_t)json_integer_value(json_object_get(doc, "now"));
	json_t *cases = json_object_get(doc, "cases");
	ck_assert(json_array_size(cases) > 50);
	size_t i, rendered = 0, raised = 0, failed = 0, refused = 0;
	json_t *c;
	json_array_foreach(cases, i, c)
	{
		const char *name = json_string_value(json_object_get(c, "name"));
		char *tmpl;
		size_t tlen;
		const char *file = json_string_value(json_object_get(c, "template_file"));
		if (file) {
			char path[512];
			snprintf(path, sizeof(path), "%s/%s", JINJA_TEST_DIR, file);
			tmpl = read_file(path, &tlen);
		} else {
			tmpl = strdup(json_string_value(json_object_get(c, "template")));
			tlen = strlen(tmpl);
		}
		char err[1024] = "";
		struct jinja_output out = {0};
		const char *parse_error = json_string_value(json_object_get(c, "parse_error"));
		if (parse_error) {
			struct jinja_template *t = NULL;
			int rc = jinja_parse(tmpl, tlen, &t, err, sizeof(err));
			ck_assert_msg(rc == -EINVAL && !t, "%s: parsed (rc %d)", name, rc);
			ck_assert_msg(strstr(err, parse_error) && strstr(err, "line 1"), "%s: message '%s' lacks '%s'", name,
				      err, parse_error);
			refused++;
			free(tmpl);
			continue;
		}
		int rc = render(tmpl, tlen, json_object_get(c, "vars"), json_object_get(c, "data"), now, &out, err,
				sizeof(err));
		const json_t *want = json_object_get(c, "output");
		if (want) {
			ck_assert_msg(rc == 0, "%s: rc %d: %s", name, rc, err);
			ck_assert_msg(out.len == json_string_length(want) &&
					      !memcmp(out.text, json_string_value(want), out.len),
				      "%s:\n got  '%s'\n want '%s'", name, out.text, json_string_value(want));
			rendered++;
		} else if (json_object_get(c, "raised")) {
			const char *msg = json_string_value(json_object_get(c, "raised"));
			ck_assert_msg(rc == -EBADMSG, "%s: rc %d (%s), not the template's exception", name, rc, err);
			ck_assert_msg(strstr(err, msg), "%s: '%s' lacks '%s'", name, err, msg);
			raised++;
		} else {
			ck_assert_msg(rc == -EINVAL, "%s: rc %d, where jinja2 fails (%s); output '%s'", name, rc,
				      json_string_value(json_object_get(c, "error")), rc ? err : out.text);
			ck_assert_msg(strstr(err, "chat template, line "), "%s: '%s'", name, err);
			failed++;
		}
		jinja_output_free(&out);
		free(tmpl);
	}
	/* every kind of case is there, so none of the four branches is dead */
	ck_assert(rendered > 40 && raised >= 4 && failed >= 5 && refused >= 10);
	json_decref(doc);
}
END_TEST

/* The bytes that came from the data's strings are marked, whatever the template did to them. */
START_TEST(test_marks)
{
	const char *t = "{{ bos }}{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{{ m.content[1:3] }}"
			"{{ m | tojson }}{% endfor %}{{ 'x' ~ messages[0].content ~ 'y' }}";
	json_t *vars = json_pack("{s:s}", "bos", "<s>");
	json_t *data = json_pack("{s:[{s:s, s:s}]}", "messages", "role", "user", "content", " ab\"c ");
	struct jinja_output out;
	char err[512];
	ck_assert_int_eq(render(t, strlen(t), vars, data, 0, &out, err, sizeof(err)), 0);
	const char *want = "<s><user>ab\"cab{\"role\": \"user\", \"content\": \" ab\\\"c \"}x ab\"c y";
	ck_assert_str_eq(out.text, want);
	/* the marks as a string: template text 0, data 1 */
	char got[256] = {0};
	ck_assert_uint_lt(out.len, sizeof(got));
	for (size_t i = 0; i < out.len; i++)
		got[i] = out.from_data[i] ? '1' : '0';
	/* marked: the role, the trimmed content, its slice, the JSON's strings (keys and values, their
	 * escapes too) and the content inside the concatenation */
	char expect[256] = {0};
	memset(expect, '0', out.len);
	const char *p;
	p = strstr(out.text, "user>");
	memset(expect + (p - out.text), '1', 4);
	p = strstr(out.text, ">ab\"cab") + 1;
	memset(expect + (p - out.text), '1', 6);
	p = strstr(out.text, "\"user\",") + 1;
	memset(expect + (p - out.text), '1', 4);
	p = strstr(out.text, "\"role\":") + 1; /* a data object's keys are data too */
	memset(expect + (p - out.text), '1', 4);
	p = strstr(out.text, "\"content\":") + 1;
	memset(expect + (p - out.text), '1', 7);
	p = strstr(out.text, "\" ab\\\"c \"") + 1;
	memset(expect + (p - out.text), '1', 7);
	p = strstr(out.text, "x ab\"c y") + 1;
	memset(expect + (p - out.text), '1', 6);
	ck_assert_str_eq(got, expect);
	jinja_output_free(&out);
	json_decref(vars);
	json_decref(data);
}
END_TEST

/* What transformers' environment adds and jinja2 alone does not parse: generation blocks are
 * transparent. */
START_TEST(test_generation_block)
{
	const char *t = "{% for m in messages %}{% generation %}[{{ m }}]{% endgeneration %}{% endfor %}";
	json_t *vars = json_pack("{s:[s,s]}", "messages", "a", "b");
	struct jinja_output out;
	char err[512];
	ck_assert_int_eq(render(t, strlen(t), vars, NULL, 0, &out, err, sizeof(err)), 0);
	ck_assert_str_eq(out.text, "[a][b]");
	jinja_output_free(&out);
	json_decref(vars);
}
END_TEST

static void expect_limit(const char *t, const char *msg)
{
	struct jinja_output out;
	char err[512] = "";
	int rc = render(t, strlen(t), NULL, NULL, 0, &out, err, sizeof(err));
	ck_assert_msg(rc == -E2BIG, "'%s': rc %d (%s)", t, rc, err);
	ck_assert_msg(strstr(err, msg), "'%s': '%s' lacks '%s'", t, err, msg);
}

/* A template is untrusted: its work, memory, output, nesting and recursion are bounded. */
START_TEST(test_limits)
{
	expect_limit("{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", "steps");
	expect_limit("{% set s = 'xxxxxxxxxx' * 10000 %}{% for i in range(2000) %}{{ s }}{% endfor %}", "output");
	expect_limit("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested deeper");
	expect_limit("{{ range(1000000) }}", "range");
	expect_limit("{% set ns = namespace(s='xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx') %}"
		     "{% for i in range(100000) %}{% set ns.s = ns.s + 'x' %}{% endfor %}",
		     "MiB");
	/* chains as deep as they are long, and values nested by a loop */
	size_t big = 20000 * 3 + 16;
	char *chain = malloc(big * 2);
	ck_assert_ptr_nonnull(chain);
	size_t n = (size_t)sprintf(chain, "{{ 1");
	for (int i = 0; i < 20000; i++)
		n += (size_t)sprintf(chain + n, "+1");
	sprintf(chain + n, " }}");
	expect_limit(chain, "nested deeper");
	n = (size_t)sprintf(chain, "{{ 1");
	for (int i = 0; i < 20000; i++)
		n += (size_t)sprintf(chain + n, "|abs");
	sprintf(chain + n, " }}");
	expect_limit(chain, "nested deeper");
	n = (size_t)sprintf(chain, "{%% if 0 %%}");
	for (int i = 0; i < 10000; i++)
		n += (size_t)sprintf(chain + n, "{%%elif 0%%}");
	sprintf(chain + n, "{%% endif %%}");
	expect_limit(chain, "nested deeper");
	free(chain);
	expect_limit("{% set ns = namespace(x=none) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}",
		     "nested deeper");
	expect_limit("{% set s = 'a' * 100000 %}{% set c = 'b' * 100000 ~ 'a' %}{{ s.strip(c) | length }}", "steps");
	expect_limit("{% set s = 'x' * 4000000 %}{% for i in range(10000) %}{{ s[-1] }}{% endfor %}", "steps");
	/* nesting in the parser */
	char deep[4096];
	size_t k = 0;
	k += (size_t)snprintf(deep + k, sizeof(deep) - k, "{{ ");
	for (int i = 0; i < 500; i++)
		deep[k++] = '(';
	deep[k++] = '1';
	for (int i = 0; i < 500; i++)
		deep[k++] = ')';
	snprintf(deep + k, sizeof(deep) - k, " }}");
	expect_limit(deep, "nested deeper");
	k = 0;
	for (int i = 0; i < 200; i++)
		k += (size_t)snprintf(deep + k, sizeof(deep) - k, "{%% if x %%}");
	expect_limit(deep, "nested deeper");
}
END_TEST

int main(void)
{
	setenv("TZ", "UTC", 1);
	Suite *s = suite_create("jinja");
	TCase *tc = tcase_create("jinja");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_cases);
	tcase_add_test(tc, test_marks);
	tcase_add_test(tc, test_generation_block);
	tcase_add_test(tc, test_limits);
	suite_add_tcase(s, tc);
	return th_run(s);
}

/* jinja.h - a checkpoint's chat template (Jinja text) rendered as Hugging Face transformers
 * renders it: the messages of a chat turned into the one prompt text the model was trained on.
 *
 *   char err[512];
 *   struct jinja_template *t;
 *   if (jinja_parse(text, strlen(text), &t, err, sizeof(err)) != 0) { ... err ... }
 *   json_t *vars = json_pack("{s:s, s:s, s:b}", "bos_token", "<s>", "eos_token", "</s>",
 *                            "add_generation_prompt", 1);
 *   json_t *data = json_pack("{s:o}", "messages", messages);   // strings marked as the user's
 *   struct jinja_output out;
 *   rc = jinja_render(t, vars, data, time(NULL), &out, err, sizeof(err));
 *   ... out.text[0 .. out.len), out.from_data[i] != 0 where byte i came from a string of `data`
 *   jinja_output_free(&out);
 *   jinja_free(&t);
 *
 * The environment is transformers' (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
 * the loopcontrols extension, its own tojson, raise_exception and strftime_now): the same text
 * for the templates that Llama 2/3/3.x, Mistral, Qwen, Gemma and similar checkpoints carry. The
 * language is what those templates use:
 *  - {{ expr }}, {% tag %}, {# comment #}, whitespace control ({%- -%}, {%+ +%}), raw blocks;
 *    a template's line breaks (\r\n, \r) become "\n" and one at the end is dropped, as Jinja
 *    3 does;
 *  - if/elif/else, for (one name or a pair, an `if` filter, else, loop.index/index0/revindex/
 *    revindex0/first/last/length/previtem/nextitem/depth/depth0; not loop.cycle nor recursive
 *    loops), break/continue, set (a name, a namespace's attribute, a block), macros with
 *    defaults (they see the names where they were defined), generation blocks (transparent);
 *  - literals (strings, numbers, true/false/none in either case, lists, tuples, dicts), . and []
 *    with slices, calls with keyword arguments, filters, tests (`is`, `is not`), `not and or`,
 *    `== != < <= > >= in, not in`, `+ - * / // % **`, `~`, `a if c else b`;
 *  - filters: trim, length/count, tojson, join, list, first, last, upper, lower, capitalize,
 *    title, default/d, selectattr, rejectattr, select, reject, map, string, int, float, abs,
 *    replace, reverse, items, unique, indent, safe;
 *  - tests: defined, undefined, none, boolean, true, false, integer, float, number, string,
 *    mapping, iterable, sequence, callable, equalto/eq/==, ne/!=, lt/<, le/<=, gt/>, ge/>=, in,
 *    odd, even, divisibleby, lower, upper, sameas;
 *  - methods: a string's strip/lstrip/rstrip, startswith/endswith, split, upper, lower, title,
 *    capitalize, replace, find, join; a dict's items/keys/values/get;
 *  - globals: raise_exception, strftime_now (the `now` given to jinja_render, local time),
 *    namespace, range.
 * Anything else (another tag, filter, test or method) is an error that names it, at parse time
 * where the parser can tell. Differences from Jinja: upper/lower/title/capitalize and unique's
 * case folding change ASCII letters only; tojson prints floats as Python's repr does (json.dumps
 * too, but for nan and the infinities); a value nested deeper than JINJA_MAX_DEPTH neither prints
 * nor compares equal. Values print as Python prints them (None, True, 1.5, ['a'], Undefined in a
 * list).
 *
 * A template is untrusted text (it comes with a model file): nesting, recursion, the work a
 * render does and the memory it takes are bounded, and an error is a message, never a crash. */
#ifndef PIPELINE_JINJA_H
#define PIPELINE_JINJA_H
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#ifdef __cplusplus
extern "C" {
#endif

/* What one render may take: its output, its memory (every value it makes), its work (a build
 * may set lower ones: the fuzzer does). */
#ifndef JINJA_MAX_OUTPUT
#define JINJA_MAX_OUTPUT (16u << 20)
#endif
#ifndef JINJA_MAX_MEMORY
#define JINJA_MAX_MEMORY (64u << 20)
#endif
#ifndef JINJA_MAX_STEPS
#define JINJA_MAX_STEPS 2000000u /* about half a second of the worst work */
#endif
/* A template's longest text and deepest nesting (of blocks and of expressions). */
#define JINJA_MAX_SOURCE (1u << 20)
#define JINJA_MAX_DEPTH 100

struct jinja_template;

struct jinja_output {
	char *text;	    /* len bytes, NUL-terminated (owned: jinja_output_free) */
	uint8_t *from_data; /* len flags: 1 where the byte came from a string of the data variables */
	size_t len;
};

/* Parses len bytes of template text. Returns 0 and *out (jinja_free), or -EINVAL with a message
 * that names the line ("line 3: ..."), -E2BIG (longer than JINJA_MAX_SOURCE, or nested deeper
 * than JINJA_MAX_DEPTH), -ENOMEM. */
int jinja_parse(const char *src, size_t len, struct jinja_template **out, char *err, size_t errlen);
void jinja_free(struct jinja_template **t);

/* Renders t with the variables of two JSON objects (either may be NULL): vars, and data, whose
 * strings are marked in out->from_data (a chat's messages: the text a user sent). A name in both
 * is data's. now is what strftime_now formats. Returns 0 and *out; -EBADMSG when the template
 * raised (raise_exception: err is its message); -EINVAL for an error of the template (an
 * undefined value used, a type that does not fit: err says which, with its line); -E2BIG past a
 * JINJA_MAX_* limit; -ENOMEM. */
int jinja_render(const struct jinja_template *t, const json_t *vars, const json_t *data, time_t now,
		 struct jinja_output *out, char *err, size_t errlen);
void jinja_output_free(struct jinja_output *out);

#ifdef __cplusplus
}
#endif
#endif

#include "services/gpu-runner/text.h"

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/util.h"

enum chat_format chat_format_of(const struct tokenizer *tok)
{
	if (!tok)
		return CHAT_NONE;
	if (tokenizer_token_to_id(tok, "<|start_header_id|>") >= 0 && tokenizer_token_to_id(tok, "<|end_header_id|>") >= 0 &&
	    tokenizer_token_to_id(tok, "<|eot_id|>") >= 0)
		return CHAT_LLAMA3;
	if (tokenizer_token_to_id(tok, "<|im_start|>") >= 0 && tokenizer_token_to_id(tok, "<|im_end|>") >= 0)
		return CHAT_CHATML;
	return CHAT_NONE;
}

const char *chat_format_name(enum chat_format f)
{
	return f == CHAT_LLAMA3 ? "llama3" : f == CHAT_CHATML ? "chatml" : "none";
}

void text_prompt_free(struct text_prompt *tp)
{
	tok_ids_free(&tp->ids);
}

static int push_id(struct tok_ids *v, int32_t id)
{
	if (v->n == v->cap) {
		size_t cap = v->cap ? v->cap * 2 : 64;
		uint32_t *n = realloc(v->ids, cap * sizeof(uint32_t));
		if (!n)
			return -ENOMEM;
		v->ids = n;
		v->cap = cap;
	}
	v->ids[v->n++] = (uint32_t)id;
	return 0;
}

/* text's ids appended to out; plain: tokenizer_encode_marked's marks (NULL: none). */
static int encode(const struct tokenizer *tok, const char *text, size_t len, const uint8_t *plain, unsigned flags,
		  struct tok_ids *out, char *err, size_t errlen)
{
	int rc = tokenizer_encode_marked(tok, text, len, plain, flags, out);
	if (rc == -EILSEQ)
		return errorf(err, errlen, -EINVAL, "the text holds a character the tokenizer cannot spell");
	if (rc)
		return errorf(err, errlen, rc, "tokenizing the prompt failed: %s", strerror(-rc));
	return 0;
}

/* A role is a short word: no markup, no line break. */
static bool role_ok(const char *role)
{
	return strlen(role) <= 64 && !strchr(role, '<') && !strchr(role, '\n');
}

/* A token's text, as a chat template's bos_token and eos_token are: "" when the id is not one. */
static json_t *token_text(const struct tokenizer *tok, int32_t id)
{
	size_t n = 0;
	const char *p = id >= 0 ? tokenizer_id_to_piece(tok, (uint32_t)id, &n) : NULL;
	return json_stringn(p ? p : "", p ? n : 0);
}

/* The chat through the model's template, as transformers' apply_chat_template renders it (the
 * messages, bos_token, eos_token, add_generation_prompt) and then tokenizes the text whole, with
 * no BOS added: the template writes its own. Special-token text from the messages counts as
 * special tokens unless flags say TOK_SPECIAL_AS_TEXT; the template's own always do. */
static int render_template(const struct tokenizer *tok, enum chat_format f, const struct model_config *cfg,
			   const struct jinja_template *tmpl, json_t *msgs, unsigned flags, struct text_prompt *out,
			   char *err, size_t errlen)
{
	int32_t bos = cfg->bos_id >= 0 ? cfg->bos_id : tokenizer_bos(tok);
	int32_t eos = cfg->n_eos ? (int32_t)cfg->eos_ids[0] : tokenizer_eos(tok);
	json_t *vars = json_object(), *data = json_object();
	int rc = -ENOMEM;
	if (!vars || !data || json_object_set_new(vars, "bos_token", token_text(tok, bos)) ||
	    json_object_set_new(vars, "eos_token", token_text(tok, eos)) ||
	    json_object_set_new(vars, "add_generation_prompt", json_true()) ||
	    json_object_set(data, "messages", msgs)) {
		errorf(err, errlen, rc, "out of memory");
		goto out;
	}
	struct jinja_output o;
	char why[512];
	rc = jinja_render(tmpl, vars, data, time(NULL), &o, why, sizeof(why));
	if (rc) {
		rc = errorf(err, errlen, rc == -ENOMEM ? -ENOMEM : -EINVAL, "%s", why);
		goto out;
	}
	out->end_of_turn = f == CHAT_LLAMA3   ? tokenizer_token_to_id(tok, "<|eot_id|>")
			   : f == CHAT_CHATML ? tokenizer_token_to_id(tok, "<|im_end|>")
					      : -1;
	rc = encode(tok, o.text, o.len, (flags & TOK_SPECIAL_AS_TEXT) ? o.from_data : NULL, 0, &out->ids, err, errlen);
	jinja_output_free(&o);
out:
	json_decref(vars);
	json_decref(data);
	return rc;
}

/* The built-in formats, as templates the engine renders like a model's own: Llama 3's is Meta's
 * (it trims the content), ChatML's keeps the content as it is and writes no BOS. Parsed once. */
static const char llama3_template[] =
	"{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
	"'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
	"{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
	"{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
static const char chatml_template[] =
	"{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
	"'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
static struct jinja_template *builtin[2];
static pthread_once_t builtin_once = PTHREAD_ONCE_INIT;

static void parse_builtin(void)
{
	const char *text[2] = {llama3_template, chatml_template};
	char err[256];
	for (int k = 0; k < 2; k++)
		if (jinja_parse(text[k], strlen(text[k]), &builtin[k], err, sizeof(err)) != 0)
			builtin[k] = NULL; /* out of memory: chats by that format fail with a message below */
}

static int render_chat(const struct tokenizer *tok, const struct jinja_template *tmpl, const struct model_config *cfg,
		       const char *json, size_t len, unsigned flags, struct text_prompt *out, char *err, size_t errlen)
{
	enum chat_format f = chat_format_of(tok);
	if (f == CHAT_NONE && !tmpl)
		return errorf(err, errlen, -EINVAL,
			      "this model has no chat template, and its tokenizer has neither Llama 3 header tokens nor "
			      "ChatML tokens: it has no chat format; send a plain prompt (or start the loader with "
			      "--chat-template FILE)");
	if (!tmpl) {
		pthread_once(&builtin_once, parse_builtin);
		if (!(tmpl = builtin[f == CHAT_LLAMA3 ? 0 : 1]))
			return errorf(err, errlen, -ENOMEM, "out of memory");
	}
	json_error_t jerr;
	json_t *msgs = json_loadb(json, len, 0, &jerr);
	if (!msgs || !json_is_array(msgs) || json_array_size(msgs) == 0) {
		json_decref(msgs);
		return errorf(err, errlen, -EINVAL, "chat must be a non-empty JSON array of {\"role\", \"content\"}%s%s",
			      msgs ? "" : ": ", msgs ? "" : jerr.text);
	}
	int rc = 0;
	size_t i;
	json_t *m;
	json_array_foreach(msgs, i, m)
	{
		json_t *r = json_object_get(m, "role"), *c = json_object_get(m, "content");
		if (!json_is_object(m) || !json_is_string(r) || !json_is_string(c) || !json_string_length(r)) {
			rc = errorf(err, errlen, -EINVAL, "chat message %zu needs a \"role\" and a \"content\" string", i);
			break;
		}
		if (!role_ok(json_string_value(r))) {
			rc = errorf(err, errlen, -EINVAL, "chat message %zu has an invalid role", i);
			break;
		}
	}
	if (!rc)
		rc = render_template(tok, f, cfg, tmpl, msgs, flags, out, err, errlen);
	json_decref(msgs);
	return rc;
}

int text_prompt_build(const struct tokenizer *tok, const struct jinja_template *chat, const struct model_config *cfg,
		      const struct msg_generate *g, struct text_prompt *out, char *err, size_t errlen)
{
	memset(out, 0, sizeof(*out));
	out->end_of_turn = -1;
	if (!tok)
		return errorf(err, errlen, -ENOTSUP,
			      "the model has no tokenizer (no tokenizer.json, nor one in its GGUF file), so the runner takes token ids only (or start the loader "
			      "with --tokenizer FILE)");
	unsigned flags = (g->flags & GEN_SPECIAL_AS_TEXT) ? TOK_SPECIAL_AS_TEXT : 0;
	int rc;
	if (g->chat.len) {
		rc = render_chat(tok, chat, cfg, g->chat.p, g->chat.len, flags, out, err, errlen);
	} else {
		rc = 0;
		/* A BOS first where the tokenizer's file puts one first (or does not say), as Hugging Face
		 * encodes the text; not where it puts none (Qwen's: config.json names a bos_token_id
		 * that its tokenizer never adds). */
		if (!(g->flags & GEN_NO_BOS) && tokenizer_adds_bos(tok) != 0) {
			int32_t bos = cfg->bos_id >= 0 ? cfg->bos_id : tokenizer_bos(tok);
			if (bos < 0)
				rc = errorf(err, errlen, -EINVAL,
					    "the model names no BOS token; send the prompt with GEN_NO_BOS (--no-bos)");
			else
				rc = push_id(&out->ids, bos);
		}
		if (!rc)
			rc = encode(tok, g->prompt.p, g->prompt.len, NULL, flags, &out->ids, err, errlen);
	}
	if (!rc && out->ids.n == 0)
		rc = errorf(err, errlen, -EINVAL, "the prompt is empty");
	for (size_t i = 0; !rc && i < out->ids.n; i++)
		if (out->ids.ids[i] >= cfg->vocab_size)
			rc = errorf(err, errlen, -EINVAL, "the tokenizer gave id %u, outside the model's vocabulary of %u",
				    out->ids.ids[i], cfg->vocab_size);
	if (rc)
		text_prompt_free(out);
	return rc;
}

struct text_stream {
	struct tok_decoder *dec;
	char *stops[TEXT_MAX_STOP_STRINGS];
	size_t stop_len[TEXT_MAX_STOP_STRINGS];
	size_t n_stops, longest;
	char *text; /* the generated text's last longest - 1 bytes before the newest piece, and that
		     * piece (only kept when there are stops: a match that ends in the piece starts
		     * no earlier) */
	size_t len, cap;
};

int text_stream_create(const struct tokenizer *tok, const char *stop_json, size_t stop_len, struct text_stream **out,
		       char *err, size_t errlen)
{
	struct text_stream *ts = calloc(1, sizeof(*ts));
	if (!ts)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	int rc = 0;
	if (stop_json && stop_len) {
		json_error_t jerr;
		json_t *a = json_loadb(stop_json, stop_len, 0, &jerr);
		if (!json_is_array(a) || json_array_size(a) > TEXT_MAX_STOP_STRINGS) {
			rc = errorf(err, errlen, -EINVAL, "stop_strings must be a JSON array of at most %d strings",
				    TEXT_MAX_STOP_STRINGS);
		}
		for (size_t i = 0; !rc && i < json_array_size(a); i++) {
			json_t *s = json_array_get(a, i);
			size_t n = json_string_length(s);
			if (!json_is_string(s) || n == 0 || n > TEXT_MAX_STOP_BYTES) {
				rc = errorf(err, errlen, -EINVAL, "stop string %zu must be a string of 1..%d bytes", i,
					    TEXT_MAX_STOP_BYTES);
				break;
			}
			ts->stops[i] = malloc(n);
			if (!ts->stops[i]) {
				rc = errorf(err, errlen, -ENOMEM, "out of memory");
				break;
			}
			memcpy(ts->stops[i], json_string_value(s), n);
			ts->stop_len[i] = n;
			ts->n_stops = i + 1;
			if (n > ts->longest)
				ts->longest = n;
		}
		json_decref(a);
	}
	if (!rc && tok && !(ts->dec = tok_decoder_create(tok, 0)))
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
	if (rc) {
		text_stream_destroy(&ts);
		return rc;
	}
	*out = ts;
	return 0;
}

void text_stream_destroy(struct text_stream **tsp)
{
	if (!tsp || !*tsp)
		return;
	struct text_stream *ts = *tsp;
	tok_decoder_destroy(&ts->dec);
	for (size_t i = 0; i < ts->n_stops; i++)
		free(ts->stops[i]);
	free(ts->text);
	free(ts);
	*tsp = NULL;
}

bool text_stream_has_stops(const struct text_stream *ts)
{
	return ts->n_stops > 0;
}

static bool find(const char *hay, size_t n, const char *needle, size_t m)
{
	for (size_t i = 0; i + m <= n; i++)
		if (!memcmp(hay + i, needle, m))
			return true;
	return false;
}

int text_stream_push(struct text_stream *ts, int32_t id, const char **piece, size_t *len, bool *hit)
{
	*piece = "";
	*len = 0;
	*hit = false;
	if (!ts->dec)
		return 0;
	int rc = tok_decoder_feed(ts->dec, (uint32_t)id, piece, len);
	if (rc || !ts->n_stops || !*len)
		return rc;
	if (ts->len + 1 > ts->longest) { /* a window, not the whole text of a long generation */
		memmove(ts->text, ts->text + ts->len - (ts->longest - 1), ts->longest - 1);
		ts->len = ts->longest - 1;
	}
	if (ts->len + *len > ts->cap) {
		size_t cap = ts->cap ? ts->cap : 256;
		while (cap < ts->len + *len)
			cap *= 2;
		char *n = realloc(ts->text, cap);
		if (!n)
			return -ENOMEM;
		ts->text = n;
		ts->cap = cap;
	}
	size_t before = ts->len;
	memcpy(ts->text + ts->len, *piece, *len);
	ts->len += *len;
	/* Only a match that ends in the new bytes is new. */
	size_t from = before + 1 > ts->longest ? before + 1 - ts->longest : 0;
	for (size_t i = 0; i < ts->n_stops && !*hit; i++)
		*hit = find(ts->text + from, ts->len - from, ts->stops[i], ts->stop_len[i]);
	return 0;
}

int text_stream_finish(struct text_stream *ts, const char **tail, size_t *len)
{
	*tail = "";
	*len = 0;
	return ts->dec ? tok_decoder_flush(ts->dec, tail, len) : 0;
}

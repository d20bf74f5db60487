/* synthetic_gguf_tok.c - a Hugging Face tokenizer.json as the arrays of a GGUF file's
 * tokenizer.ggml.* keys, as convert_hf_to_gguf.py's _set_vocab_gpt2 makes them for Llama 3:
 * tokens by id, each id past the tokenizer's (up to the model's vocab_size) a "[PAD<id>]" of type
 * unused; types 1 (normal), 3 (control: special added tokens), 4 (user defined: other added
 * tokens); merges as "a b" strings.
 *
 * Only Llama 3's kind of tokenizer is taken: BPE with its split regex followed by the byte-level
 * mapping, which llama.cpp knows as tokenizer.ggml.pre "llama-bpe". llama.cpp names the
 * pre-tokenizer of other tokenizers from a hash of their output on a test text, which needs the
 * tokenizer itself; rather than write a "default" that llama.cpp would split text with differently,
 * other tokenizers are refused. */
#include "tools/make-synthetic-model/synthetic_internal.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"

/* Llama 3's split regex, as its tokenizer.json holds it. */
static const char llama3_regex[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
				   "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

const char syn_llama3_chat_template[] =
	"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
	"'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
	"'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
	"{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
	"{% endif %}";

enum { TT_NORMAL = 1, TT_CONTROL = 3, TT_USER_DEFINED = 4, TT_UNUSED = 5 };

static const char *type_of(const json_t *o)
{
	return json_string_value(json_object_get(o, "type"));
}

/* A Sequence of a Split on Llama 3's regex and a ByteLevel step. */
static bool is_llama3_pre(const json_t *pre)
{
	const char *type = type_of(pre);
	const json_t *steps = json_object_get(pre, "pretokenizers");
	if (!type || strcmp(type, "Sequence") || !json_is_array(steps) || json_array_size(steps) != 2)
		return false;
	const json_t *split = json_array_get(steps, 0), *bytes = json_array_get(steps, 1);
	const char *regex = json_string_value(json_object_get(json_object_get(split, "pattern"), "Regex"));
	return type_of(split) && !strcmp(type_of(split), "Split") && regex && !strcmp(regex, llama3_regex) &&
	       type_of(bytes) && !strcmp(type_of(bytes), "ByteLevel");
}

static int own(struct syn_vocab *v, char *s)
{
	if (!s)
		return -ENOMEM;
	char **np = realloc(v->owned, (v->n_owned + 1) * sizeof(*np));
	if (!np) {
		free(s);
		return -ENOMEM;
	}
	v->owned = np;
	v->owned[v->n_owned++] = s;
	return 0;
}

/* An id of the file: an integer in [0, vocab_size). */
static int get_id(const char *path, const json_t *j, const char *what, const char *piece, uint32_t vocab_size,
		  uint32_t *id, char *err, size_t errlen)
{
	if (!json_is_integer(j) || json_integer_value(j) < 0)
		return errorf(err, errlen, -EINVAL, "%s: %s \"%.40s\" has no id that is a non-negative integer", path,
			      what, piece);
	if (json_integer_value(j) >= vocab_size)
		return errorf(err, errlen, -EINVAL,
			      "%s: %s \"%.40s\" has id %lld, outside the model's vocabulary of %u: the tokenizer does "
			      "not fit the model",
			      path, what, piece, (long long)json_integer_value(j), vocab_size);
	*id = (uint32_t)json_integer_value(j);
	return 0;
}

static int load_tokens(struct syn_vocab *v, const char *path, const json_t *root, uint32_t vocab_size, char *err,
		       size_t errlen)
{
	const json_t *vocab = json_object_get(json_object_get(root, "model"), "vocab");
	if (!json_is_object(vocab) || json_object_size(vocab) == 0)
		return errorf(err, errlen, -EINVAL, "%s: model.vocab is missing or empty", path);
	const char *piece;
	json_t *val;
	json_object_foreach((json_t *)vocab, piece, val) {
		uint32_t id;
		int rc = get_id(path, val, "vocab entry", piece, vocab_size, &id, err, errlen);
		if (rc)
			return rc;
		if (v->tok[id])
			return errorf(err, errlen, -EINVAL, "%s: id %u is given to both \"%.40s\" and \"%.40s\"", path,
				      id, v->tok[id], piece);
		v->tok[id] = piece;
		v->tok_len[id] = strlen(piece);
		v->type[id] = TT_NORMAL;
	}
	const json_t *added = json_object_get(root, "added_tokens");
	if (added && !json_is_array(added))
		return errorf(err, errlen, -EINVAL, "%s: added_tokens is not a list", path);
	size_t i;
	json_array_foreach((json_t *)added, i, val) {
		const json_t *content = json_object_get(val, "content");
		if (!json_is_string(content) || json_string_length(content) == 0)
			return errorf(err, errlen, -EINVAL, "%s: added token %zu has no content", path, i);
		const char *text = json_string_value(content);
		uint32_t id;
		int rc = get_id(path, json_object_get(val, "id"), "added token", text, vocab_size, &id, err, errlen);
		if (rc)
			return rc;
		size_t len = json_string_length(content);
		if (v->tok[id] && (v->tok_len[id] != len || memcmp(v->tok[id], text, len)))
			return errorf(err, errlen, -EINVAL,
				      "%s: added token \"%.40s\" has id %u, which the vocabulary gives to \"%.40s\"",
				      path, text, id, v->tok[id]);
		v->tok[id] = text;
		v->tok_len[id] = len;
		v->type[id] = json_is_true(json_object_get(val, "special")) ? TT_CONTROL : TT_USER_DEFINED;
		if (!strcmp(text, "<|eot_id|>"))
			v->eot = (int32_t)id;
		if (!strcmp(text, "<|start_header_id|>"))
			v->chat_llama3 = true;
	}
	/* Ids the tokenizer does not use, up to the model's vocabulary (the embedding rows past it). */
	for (uint32_t id = 0; id < vocab_size; id++) {
		if (v->tok[id])
			continue;
		char *pad = malloc(24);
		if (pad)
			snprintf(pad, 24, "[PAD%u]", id);
		if (own(v, pad))
			return errorf(err, errlen, -ENOMEM, "out of memory reading %s", path);
		v->tok[id] = pad;
		v->tok_len[id] = strlen(pad);
		v->type[id] = TT_UNUSED;
	}
	return 0;
}

static int load_merges(struct syn_vocab *v, const char *path, const json_t *root, char *err, size_t errlen)
{
	const json_t *merges = json_object_get(json_object_get(root, "model"), "merges");
	if (!json_is_array(merges))
		return errorf(err, errlen, -EINVAL, "%s: model.merges is missing or not a list", path);
	size_t n = json_array_size(merges);
	v->merge = calloc(n ? n : 1, sizeof(*v->merge));
	v->merge_len = calloc(n ? n : 1, sizeof(*v->merge_len));
	if (!v->merge || !v->merge_len)
		return errorf(err, errlen, -ENOMEM, "out of memory reading %s", path);
	for (size_t i = 0; i < n; i++) {
		const json_t *m = json_array_get(merges, i);
		if (json_is_string(m)) { /* "a b" */
			v->merge[i] = json_string_value(m);
			v->merge_len[i] = json_string_length(m);
		} else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
			   json_is_string(json_array_get(m, 1))) { /* ["a", "b"], the newer spelling */
			const json_t *a = json_array_get(m, 0), *b = json_array_get(m, 1);
			size_t la = json_string_length(a), lb = json_string_length(b);
			char *s = malloc(la + lb + 2);
			if (s) {
				memcpy(s, json_string_value(a), la);
				s[la] = ' ';
				memcpy(s + la + 1, json_string_value(b), lb);
				s[la + lb + 1] = 0;
			}
			if (own(v, s))
				return errorf(err, errlen, -ENOMEM, "out of memory reading %s", path);
			v->merge[i] = s;
			v->merge_len[i] = la + lb + 1;
		} else {
			return errorf(err, errlen, -EINVAL, "%s: merge %zu is neither \"a b\" nor a pair of strings",
				      path, i);
		}
	}
	v->n_merges = (uint32_t)n;
	return 0;
}

void syn_vocab_free(struct syn_vocab *v)
{
	for (uint32_t i = 0; i < v->n_owned; i++)
		free(v->owned[i]);
	free(v->owned);
	free(v->tok);
	free(v->tok_len);
	free(v->type);
	free(v->merge);
	free(v->merge_len);
	json_decref(v->root);
	memset(v, 0, sizeof(*v));
}

int syn_vocab_load(const char *path, uint32_t vocab_size, struct syn_vocab *v, char *err, size_t errlen)
{
	memset(v, 0, sizeof(*v));
	v->eot = -1;
	if (access(path, R_OK) != 0)
		return errorf(err, errlen, -errno, "cannot read the tokenizer %s: %s", path, strerror(errno));
	json_error_t je;
	json_t *root = json_load_file(path, 0, &je);
	if (!root)
		return errorf(err, errlen, -EINVAL, "%s: not JSON (line %d: %s)", path, je.line, je.text);
	v->root = root;
	int rc = 0;
	const json_t *model = json_object_get(root, "model");
	const char *type = type_of(model);
	if (!type || strcmp(type, "BPE")) {
		rc = errorf(err, errlen, -EINVAL,
			    "%s: the model is %s, not BPE: only Llama 3's byte-level BPE tokenizer can be embedded "
			    "in a GGUF file",
			    path, type ? type : "of no type");
		goto out;
	}
	if (!is_llama3_pre(json_object_get(root, "pre_tokenizer"))) {
		rc = errorf(err, errlen, -EINVAL, "%s: the pre-tokenizer is not Llama 3's (its split regex, then "
			    "ByteLevel): tokenizer.ggml.pre is written only as \"llama-bpe\"", path);
		goto out;
	}
	v->n_tokens = vocab_size;
	v->tok = calloc(vocab_size, sizeof(*v->tok));
	v->tok_len = calloc(vocab_size, sizeof(*v->tok_len));
	v->type = calloc(vocab_size, sizeof(*v->type));
	if (!v->tok || !v->tok_len || !v->type) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory reading %s", path);
		goto out;
	}
	rc = load_tokens(v, path, root, vocab_size, err, errlen);
	if (!rc)
		rc = load_merges(v, path, root, err, errlen);
out:
	if (rc)
		syn_vocab_free(v);
	return rc;
}

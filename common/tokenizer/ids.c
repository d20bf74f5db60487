/* ids.c - tokenizer_ids_scan: model.vocab's and added_tokens' ids of a tokenizer.json, with
 * jansson alone (ids.h), and the two field readers the tokenizer's loader shares with it. */
#include "common/tokenizer/ids.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>

#include "common/tokenizer/tokenizer.h"
#include "common/util.h"

const char *tok_json_kind(const json_t *v)
{
	if (!v)
		return "missing";
	switch (json_typeof(v)) {
	case JSON_OBJECT:
		return "an object";
	case JSON_ARRAY:
		return "a list";
	case JSON_STRING:
		return "a string";
	case JSON_INTEGER:
		return "an integer";
	case JSON_REAL:
		return "a real number";
	case JSON_TRUE:
	case JSON_FALSE:
		return "a boolean";
	case JSON_NULL:
		return "null";
	}
	return "?";
}

int tok_json_id(const char *name, const json_t *v, const char *what, const char *piece, uint32_t *id, char *err,
		size_t errlen)
{
	if (!json_is_integer(v))
		return errorf(err, errlen, -EINVAL, "%s: %s '%s' has an id that is %s, not an integer", name, what,
			      piece, tok_json_kind(v));
	json_int_t x = json_integer_value(v);
	if (x < 0 || x > TOK_MAX_ID)
		return errorf(err, errlen, -EINVAL, "%s: %s '%s' has id %lld, outside [0, %u]", name, what, piece,
			      (long long)x, TOK_MAX_ID);
	*id = (uint32_t)x;
	return 0;
}

/* added_tokens[i]: its content (as the loader's tok_get_str reads a required string) and id. */
static int scan_added(const char *name, const json_t *a, size_t i, uint32_t *id, char *err, size_t errlen)
{
	char where[48];
	snprintf(where, sizeof(where), "added_tokens[%zu]", i);
	if (!json_is_object(a))
		return errorf(err, errlen, -EINVAL, "%s: %s must be an object, got %s", name, where, tok_json_kind(a));
	const json_t *content = json_object_get(a, "content");
	if (!content || json_is_null(content))
		return errorf(err, errlen, -EINVAL, "%s: %s.content is missing", name, where);
	if (!json_is_string(content))
		return errorf(err, errlen, -EINVAL, "%s: %s.content must be a string, got %s", name, where,
			      tok_json_kind(content));
	if (!json_string_length(content))
		return errorf(err, errlen, -EINVAL, "%s: %s.content is empty", name, where);
	return tok_json_id(name, json_object_get(a, "id"), "added token", json_string_value(content), id, err, errlen);
}

int tokenizer_ids_scan(const char *name, const char *data, size_t size, uint32_t *n_ids, char *err, size_t errlen)
{
	assert(name && n_ids && (data || !size));
	json_error_t jerr;
	int rc = 0;
	json_t *root = json_loadb(data, size, JSON_REJECT_DUPLICATES, &jerr);
	if (!root)
		return errorf(err, errlen, -EINVAL, "%s: not valid JSON: %s (line %d, column %d)", name, jerr.text,
			      jerr.line, jerr.column);
	const json_t *model = json_object_get(root, "model");
	const json_t *vocab = json_object_get(model, "vocab"), *added = json_object_get(root, "added_tokens");
	if (!json_is_object(root)) {
		rc = errorf(err, errlen, -EINVAL, "%s: the top level must be an object, got %s", name,
			    tok_json_kind(root));
		goto out_json;
	}
	if (!json_is_object(model)) {
		rc = errorf(err, errlen, -EINVAL, "%s: \"model\" must be an object, got %s", name,
			    tok_json_kind(model));
		goto out_json;
	}
	if (!json_is_object(vocab)) {
		rc = errorf(err, errlen, -EINVAL, "%s: model.vocab must be an object (piece -> id), got %s", name,
			    tok_json_kind(vocab));
		goto out_json;
	}
	if (!json_object_size(vocab)) {
		rc = errorf(err, errlen, -EINVAL, "%s: model.vocab is empty", name);
		goto out_json;
	}
	if (added && !json_is_null(added) && !json_is_array(added)) {
		rc = errorf(err, errlen, -EINVAL, "%s: added_tokens must be a list, got %s", name,
			    tok_json_kind(added));
		goto out_json;
	}
	uint32_t max_id = 0, id;
	const char *key;
	json_t *v;
	json_object_foreach((json_t *)vocab, key, v) {
		rc = tok_json_id(name, v, "vocab entry", key, &id, err, errlen);
		if (rc)
			goto out_json;
		max_id = id > max_id ? id : max_id;
	}
	for (size_t i = 0; i < json_array_size(added); i++) {
		rc = scan_added(name, json_array_get(added, i), i, &id, err, errlen);
		if (rc)
			goto out_json;
		max_id = id > max_id ? id : max_id;
	}
	*n_ids = max_id + 1;
out_json:
	json_decref(root);
	return rc;
}

/* manifest_chat_template.c - a checkpoint's chat template: a Hugging Face directory's
 * chat_template.jinja, else the "chat_template" of its tokenizer_config.json (a string, or a list
 * of named templates of which "default" is the one used); or a file the user names
 * (manifest_attach_chat_template). A GGUF file's comes from its tokenizer.chat_template key
 * (manifest_gguf.c). The text is kept as it is; the runner renders it (common/jinja). */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/manifest.h"
#include "common/manifest_internal.h"
#include "common/util.h"

static int keep(struct manifest *m, const char *name, char *text, size_t len, char *err, size_t errlen)
{
	if (len > MANIFEST_MAX_CHAT_TEMPLATE) {
		free(text);
		return errorf(err, errlen, -EFBIG, "the chat template of %s is %zu bytes, more than %u", name, len,
			      MANIFEST_MAX_CHAT_TEMPLATE);
	}
	if (strlen(text) != len) {
		free(text);
		return errorf(err, errlen, -EINVAL, "the chat template of %s holds a NUL byte", name);
	}
	free(m->chat_template);
	m->chat_template = text;
	m->chat_template_note[0] = 0;
	str_copy(m->chat_template_from, sizeof(m->chat_template_from), name);
	return 0;
}

int manifest_attach_chat_template(struct manifest *m, const char *path, char *err, size_t errlen)
{
	char *text;
	size_t len;
	int rc = mf_read_file("chat template", path, MANIFEST_MAX_CHAT_TEMPLATE, &text, &len, err, errlen);
	return rc ? rc : keep(m, path, text, len, err, errlen);
}

int mf_hf_chat_template(struct manifest *m, const char *dir, char *err, size_t errlen)
{
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/chat_template.jinja", dir);
	if (access(path, F_OK) == 0)
		return manifest_attach_chat_template(m, path, err, errlen);
	snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
	if (access(path, F_OK) != 0)
		return 0;
	char *text;
	size_t len;
	int rc = mf_read_file("tokenizer config", path, 64u << 20, &text, &len, err, errlen);
	if (rc)
		return rc;
	json_error_t jerr;
	json_t *doc = json_loadb(text, len, 0, &jerr);
	free(text);
	if (!doc)
		return errorf(err, errlen, -EINVAL, "%s: line %d: %s", path, jerr.line, jerr.text);
	const json_t *t = json_object_get(doc, "chat_template");
	if (json_is_array(t)) { /* [{"name": "default", "template": "..."}, {"name": "tool_use", ...}] */
		size_t i;
		const json_t *e, *found = NULL;
		json_array_foreach(t, i, e)
		{
			const char *name = json_string_value(json_object_get(e, "name"));
			if (name && !strcmp(name, "default"))
				found = json_object_get(e, "template");
		}
		t = found;
	}
	rc = 0;
	if (json_is_string(t)) {
		char *copy = malloc(json_string_length(t) + 1);
		if (!copy) {
			rc = errorf(err, errlen, -ENOMEM, "out of memory");
		} else {
			memcpy(copy, json_string_value(t), json_string_length(t) + 1);
			rc = keep(m, path, copy, json_string_length(t), err, errlen);
		}
	} else if (t && !json_is_null(t)) {
		rc = errorf(err, errlen, -EINVAL, "%s: chat_template is neither a string nor a list of named templates "
			    "with a \"default\"", path);
	}
	json_decref(doc);
	return rc;
}

/* load.c - tokenizer_load and tokenizer_load_buffer: the file read, the JSON field readers the
 * parsers of every part use, the parts loaded in order, and tokenizer_destroy. */
#include "common/tokenizer/tokenizer_internal.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_FILE_SIZE (1ull << 30) /* a tokenizer.json above this is not one */

/* ---- JSON fields ---- */

/* A boolean field: absent or null leaves *out (the default). */
int tok_get_bool(struct loader *L, const json_t *obj, const char *where, const char *key, bool *out)
{
	const json_t *v = json_object_get(obj, key);
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_boolean(v))
		return LERR(L, -EINVAL, "%s: %s.%s must be a boolean, got %s", L->name, where, key, tok_json_kind(v));
	*out = json_is_true(v);
	return 0;
}

/* A string field; required or NULL when absent or null. */
int tok_get_str(struct loader *L, const json_t *obj, const char *where, const char *key, bool required,
		const char **out, size_t *len)
{
	const json_t *v = json_object_get(obj, key);
	*out = NULL;
	if (len)
		*len = 0;
	if (!v || json_is_null(v)) {
		if (required)
			return LERR(L, -EINVAL, "%s: %s.%s is missing", L->name, where, key);
		return 0;
	}
	if (!json_is_string(v))
		return LERR(L, -EINVAL, "%s: %s.%s must be a string, got %s", L->name, where, key, tok_json_kind(v));
	*out = json_string_value(v);
	if (len)
		*len = json_string_length(v);
	return 0;
}

/* The "type" of a step object. */
int tok_get_type(struct loader *L, const json_t *obj, const char *where, const char **type)
{
	if (!json_is_object(obj))
		return LERR(L, -EINVAL, "%s: %s must be an object, got %s", L->name, where, tok_json_kind(obj));
	return tok_get_str(L, obj, where, "type", true, type, NULL);
}

/* The string of a {"String": s} pattern; -ENOTSUP for {"Regex": ...} where only a literal does. */
int tok_get_string_pattern(struct loader *L, const json_t *obj, const char *where, const char **s, size_t *n)
{
	const json_t *pat = json_object_get(obj, "pattern");
	if (!json_is_object(pat))
		return LERR(L, -EINVAL, "%s: %s.pattern must be an object like {\"String\": \" \"}, got %s", L->name,
			    where, tok_json_kind(pat));
	if (json_object_get(pat, "Regex"))
		return LERR(L, -ENOTSUP, "%s: %s with a Regex pattern is not supported (String only)", L->name,
			    where);
	int rc = tok_get_str(L, pat, where, "String", true, s, n);
	if (rc)
		return rc;
	if (!*n)
		return LERR(L, -EINVAL, "%s: %s.pattern.String is empty", L->name, where);
	return 0;
}

int tok_get_replace(struct loader *L, const json_t *obj, const char *where, const char **from, size_t *from_len,
		    const char **to, size_t *to_len)
{
	int rc = tok_get_string_pattern(L, obj, where, from, from_len);
	if (!rc)
		rc = tok_get_str(L, obj, where, "content", true, to, to_len);
	if (rc)
		return rc;
	if (*from_len > TOK_REPLACE_MAX || *to_len > TOK_REPLACE_MAX)
		return LERR(L, -EINVAL, "%s: %s replaces %zu bytes by %zu: at most %d bytes each", L->name, where,
			    *from_len, *to_len, TOK_REPLACE_MAX);
	return 0;
}

/* A Sequence step: obj.key must be a list, and parse(L, item, "where.key[i]", arg) takes each item
 * in turn; the first failure ends it. */
int tok_parse_sequence(struct loader *L, const json_t *obj, const char *where, const char *key,
		       tok_step_parser parse, void *arg)
{
	const json_t *list = json_object_get(obj, key);
	if (!json_is_array(list))
		return LERR(L, -EINVAL, "%s: %s.%s must be a list, got %s", L->name, where, key, tok_json_kind(list));
	for (size_t i = 0; i < json_array_size(list); i++) {
		char w[64];
		snprintf(w, sizeof(w), "%s.%s[%zu]", where, key, i);
		int rc = parse(L, json_array_get(list, i), w, arg);
		if (rc)
			return rc;
	}
	return 0;
}

char *tok_dup_bytes(const char *s, size_t n)
{
	char *p = tok_malloc(n + 1);
	if (p) {
		memcpy(p, s, n);
		p[n] = 0;
	}
	return p;
}

/* One character (the replacement of Metaspace, the content of Strip) into a small buffer. */
int tok_get_char(struct loader *L, const json_t *obj, const char *where, const char *key, const char *def,
		 char out[8], size_t *len)
{
	const char *s;
	size_t n, ul;
	int rc = tok_get_str(L, obj, where, key, false, &s, &n);
	if (rc)
		return rc;
	if (!s) {
		s = def;
		n = strlen(def);
	}
	if (!n || utf8_unit((const uint8_t *)s, n, &ul) != U8_VALID || ul != n)
		return LERR(L, -EINVAL, "%s: %s.%s must be one character, got \"%s\"", L->name, where, key, s);
	memcpy(out, s, n);
	*len = n;
	return 0;
}

/* Metaspace's prepend_scheme, or the add_prefix_space of older files. */
int tok_get_prepend(struct loader *L, const json_t *obj, const char *where, enum prepend_scheme *out)
{
	const char *scheme;
	int rc = tok_get_str(L, obj, where, "prepend_scheme", false, &scheme, NULL);
	if (rc)
		return rc;
	if (scheme) {
		if (!strcmp(scheme, "first"))
			*out = PREPEND_FIRST;
		else if (!strcmp(scheme, "always"))
			*out = PREPEND_ALWAYS;
		else if (!strcmp(scheme, "never"))
			*out = PREPEND_NEVER;
		else
			return LERR(L, -ENOTSUP, "%s: %s.prepend_scheme \"%s\" is not supported (first, always, never)",
				    L->name, where, scheme);
		return 0;
	}
	bool add = true;
	rc = tok_get_bool(L, obj, where, "add_prefix_space", &add);
	*out = add ? PREPEND_ALWAYS : PREPEND_NEVER;
	return rc;
}

/* ---- loading ---- */

static void byte_level_tables(struct tokenizer *t)
{
	/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the others
	 * (controls, space, NBSP, soft hyphen) for 256, 257, ... in byte order. */
	unsigned next = 256;
	for (unsigned i = 0; i < BL_CODEPOINTS; i++)
		t->bl_byte[i] = -1;
	for (unsigned b = 0; b < 256; b++) {
		bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
		uint32_t cp = keep ? b : next++;
		t->bl_len[b] = (uint8_t)tok_utf8_put(cp, t->bl_utf8[b]);
		t->bl_byte[cp] = (int16_t)b;
	}
	assert(next == BL_CODEPOINTS);
}

/* Reads the file into memory: jansson's own loader would hide the errno of a failed open. */
static int read_file(struct loader *L, const char *path, char **data, size_t *size)
{
	int rc = 0;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return LERR(L, -errno, "%s: cannot open: %s", path, strerror(errno));
	struct stat st;
	if (fstat(fd, &st) != 0) {
		rc = LERR(L, -errno, "%s: cannot stat: %s", path, strerror(errno));
		goto out_close;
	}
	if (!S_ISREG(st.st_mode)) {
		rc = LERR(L, -EINVAL, "%s: not a regular file", path);
		goto out_close;
	}
	if ((uint64_t)st.st_size > MAX_FILE_SIZE) {
		rc = LERR(L, -EFBIG, "%s: %lld bytes is too large for a tokenizer.json (at most 1 GiB)", path,
			  (long long)st.st_size);
		goto out_close;
	}
	size_t n = (size_t)st.st_size, got = 0;
	char *p = tok_malloc(n + 1);
	if (!p) {
		rc = LERR(L, -ENOMEM, "%s: out of memory for %zu bytes", path, n);
		goto out_close;
	}
	while (got < n) {
		ssize_t r = read(fd, p + got, n - got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			rc = LERR(L, -errno, "%s: read failed: %s", path, strerror(errno));
			free(p);
			goto out_close;
		}
		if (r == 0)
			break;
		got += (size_t)r;
	}
	*data = p;
	*size = got;
out_close:
	close(fd);
	return rc;
}

int tokenizer_load(const char *path, struct tokenizer **out, char *err, size_t errlen)
{
	assert(path && out);
	struct loader L = {.name = path, .err = err, .errlen = errlen};
	char *file = NULL, *data = NULL;
	size_t size = 0;
	int rc;
	*out = NULL;

	struct stat st;
	if (stat(path, &st) != 0)
		return LERR(&L, -errno, "%s: %s", path, strerror(errno));
	if (S_ISDIR(st.st_mode)) {
		size_t n = strlen(path) + sizeof("/tokenizer.json");
		file = tok_malloc(n);
		if (!file)
			return LERR(&L, -ENOMEM, "%s: out of memory", path);
		snprintf(file, n, "%s/tokenizer.json", path);
		if (access(file, F_OK) != 0) {
			rc = LERR(&L, -errno, "%s: no tokenizer.json in this directory (%s)", path, strerror(errno));
			goto out_file;
		}
		L.name = file;
	}
	rc = read_file(&L, L.name, &data, &size);
	if (rc)
		goto out_file;
	rc = tokenizer_load_buffer(L.name, data, size, out, err, errlen);
	free(data);
out_file:
	free(file);
	return rc;
}

int tokenizer_load_buffer(const char *name, const char *data, size_t size, struct tokenizer **out, char *err,
			  size_t errlen)
{
	assert(name && out && (data || !size));
	struct loader L = {.name = name, .err = err, .errlen = errlen};
	json_t *root = NULL;
	int rc;
	*out = NULL;
	json_error_t jerr;
	root = json_loadb(data, size, JSON_REJECT_DUPLICATES, &jerr);
	if (!root)
		return LERR(&L, -EINVAL, "%s: not valid JSON: %s (line %d, column %d)", L.name, jerr.text, jerr.line,
			    jerr.column);
	if (!json_is_object(root)) {
		rc = LERR(&L, -EINVAL, "%s: the top level must be an object, got %s", L.name, tok_json_kind(root));
		goto out_json;
	}
	L.t = tok_calloc(1, sizeof(*L.t));
	if (!L.t) {
		rc = LERR(&L, -ENOMEM, "%s: out of memory", L.name);
		goto out_json;
	}
	struct tokenizer *t = L.t;
	t->unk_id = t->bos_id = t->eos_id = -1;
	t->adds_bos = -1;
	byte_level_tables(t);
	rc = tok_load_model(&L, root);
	if (!rc)
		rc = tok_parse_normalizer(&L, json_object_get(root, "normalizer"), "normalizer");
	if (!rc)
		rc = tok_parse_pretok(&L, json_object_get(root, "pre_tokenizer"), "pre_tokenizer");
	bool fused = false;
	if (!rc)
		rc = tok_parse_decoder(&L, json_object_get(root, "decoder"), "decoder", &fused);
	if (rc)
		goto out_tok;
	for (uint32_t i = 0; i < t->n_added; i++)
		if (t->added[i].single_word && !t->word_re) {
			/* Hugging Face tests single_word with the Rust regex crate's \w. */
			static const char word[] = "[\\p{Alphabetic}\\p{M}\\p{Pc}\\p{Nd}\\p{Join_Control}]";
			rc = tok_compile_pattern(&L, "single_word", word, strlen(word), false, &t->word_re);
			if (rc)
				goto out_tok;
		}

	t->arena = L.arena.p;
	if (t->byte_level)
		for (unsigned b = 0; b < 256; b++)
			t->byte_id[b] = tok_vocab_find(t, (const char *)t->bl_utf8[b], t->bl_len[b]);
	rc = tok_precompute_decoded(&L);
	if (rc)
		goto out_tok;
	/* Nothing fails from here on: the arena passes to the tokenizer. */
	t->arena = L.arena.p;
	t->arena_len = L.arena.len;
	L.arena.p = NULL;

	tok_find_bos_eos(t, root);
	*out = t;
	L.t = NULL;
	rc = 0;
out_tok:
	if (L.t) {
		L.t->arena = NULL; /* until success the arena is the loader's: freed below */
		tokenizer_destroy(&L.t);
	}
	tok_buf_free(&L.arena);
out_json:
	json_decref(root);
	return rc;
}

void tokenizer_destroy(struct tokenizer **tp)
{
	if (!tp || !*tp)
		return;
	struct tokenizer *t = *tp;
	free(t->entries);
	free(t->arena);
	free(t->vocab);
	free(t->merges);
	free(t->added);
	free(t->trie);
	for (unsigned i = 0; i < t->n_norm; i++) {
		free(t->norm[i].from);
		free(t->norm[i].to);
	}
	for (unsigned i = 0; i < t->n_pretok; i++)
		pcre2_code_free(t->pretok[i].re);
	for (unsigned i = 0; i < t->n_dec; i++) {
		free(t->dec[i].from);
		free(t->dec[i].to);
	}
	pcre2_code_free(t->word_re);
	free(t);
	*tp = NULL;
}

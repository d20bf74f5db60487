/* tokenize.c - pipectl tokenize and detokenize (see tokenize.h). */
#include "tools/pipectl/tokenize.h"

#include <dirent.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/manifest.h"
#include "common/tokenizer/tokenizer.h"
#include "tools/pipectl/pipectl.h"

/* A GGUF file (by its magic), or a directory with no tokenizer.json that holds a .gguf file. */
static bool is_gguf_checkpoint(const char *path)
{
	struct stat st;
	if (stat(path, &st) != 0)
		return false;
	if (S_ISREG(st.st_mode)) {
		char magic[4] = {0};
		FILE *f = fopen(path, "rb");
		bool gguf = f && fread(magic, 1, 4, f) == 4 && !memcmp(magic, "GGUF", 4);
		if (f)
			fclose(f);
		return gguf;
	}
	if (!S_ISDIR(st.st_mode))
		return false;
	char p[4096];
	snprintf(p, sizeof(p), "%s/tokenizer.json", path);
	if (access(p, F_OK) == 0)
		return false;
	DIR *d = opendir(path);
	bool gguf = false;
	struct dirent *e;
	while (d && !gguf && (e = readdir(d)) != NULL) {
		size_t l = strlen(e->d_name);
		gguf = l > 5 && !strcmp(e->d_name + l - 5, ".gguf");
	}
	if (d)
		closedir(d);
	return gguf;
}

/* Loads the tokenizer named by --tokenizer (a tokenizer.json, a checkpoint directory, or a GGUF
 * file). Returns NULL after printing why. */
static struct tokenizer *load_tokenizer(const char *cmd, const char *path)
{
	char err[512];
	struct tokenizer *t;
	if (!path || !*path) {
		fprintf(stderr, "pipectl: %s: --tokenizer FILE is required (a tokenizer.json, a GGUF file, or the checkpoint "
				"directory that holds one)\n",
			cmd);
		return NULL;
	}
	if (is_gguf_checkpoint(path)) {
		/* The tokenizer a GGUF file carries, made into tokenizer.json text as the loader makes it. */
		struct manifest *m;
		int rc = manifest_load(path, &m, err, sizeof(err));
		if (rc == 0 && !m->tokenizer_json) {
			snprintf(err, sizeof(err), "%s carries no tokenizer the pipeline reads%s%s", path,
				 m->tokenizer_note[0] ? ": " : "", m->tokenizer_note);
			rc = -ENOENT;
		}
		if (rc == 0)
			rc = tokenizer_load_buffer(path, m->tokenizer_json, m->tokenizer_bytes, &t, err, sizeof(err));
		manifest_destroy(&m);
		if (rc != 0) {
			fprintf(stderr, "pipectl: %s: %s\n", cmd, err);
			return NULL;
		}
		return t;
	}
	if (tokenizer_load(path, &t, err, sizeof(err)) != 0) {
		fprintf(stderr, "pipectl: %s: %s\n", cmd, err);
		return NULL;
	}
	return t;
}

/* Reads all of standard input into a malloc'd buffer. Returns 0 or -errno after printing why. */
static int read_stdin(char **out, size_t *len)
{
	size_t cap = 1 << 16, n = 0;
	char *buf = malloc(cap);
	if (!buf)
		goto out_nomem;
	for (;;) {
		if (n == cap) {
			char *p = cap <= SIZE_MAX / 2 ? realloc(buf, cap * 2) : NULL;
			if (!p)
				goto out_nomem;
			buf = p;
			cap *= 2;
		}
		size_t r = fread(buf + n, 1, cap - n, stdin);
		n += r;
		if (r == 0) {
			if (ferror(stdin)) {
				int e = errno;
				fprintf(stderr, "pipectl: tokenize: reading standard input: %s\n", strerror(e));
				free(buf);
				return -e;
			}
			break;
		}
	}
	*out = buf;
	*len = n;
	return 0;
out_nomem:
	free(buf);
	fprintf(stderr, "pipectl: tokenize: out of memory reading standard input\n");
	return -ENOMEM;
}

int cmd_tokenize(struct pipectl *p, int argc, char **argv)
{
	const char *path = NULL;
	bool bos = false, as_text = false;
	struct opt opts[] = {
		{"tokenizer", OPT_STRING, &path, NULL,
		 "the checkpoint's tokenizer.json, its directory, or a GGUF file (required)"},
		{"bos", OPT_BOOL, &bos, NULL, "put the BOS id first"},
		{"special-as-text", OPT_BOOL, &as_text, NULL,
		 "read special-token text such as <|eot_id|> as plain text (default: as the special token)"},
		{0},
	};
	int rc = pipectl_parse("tokenize --tokenizer FILE [--bos] [--special-as-text]",
			       "Reads UTF-8 text from standard input, byte for byte (a trailing newline is part of the "
			       "text: use printf '%s' or echo -n), and prints its token ids on one line, separated by "
			       "spaces.",
			       opts, argc, argv, NULL, 0, 0, NULL);
	if (rc)
		return rc == 1 ? PIPECTL_EXIT_OK : PIPECTL_EXIT_USAGE;
	struct tokenizer *t = load_tokenizer("tokenize", path);
	if (!t)
		return PIPECTL_EXIT_FAIL;
	int status = PIPECTL_EXIT_FAIL;
	struct tok_ids ids = {0};
	char *text = NULL;
	size_t len = 0;
	if (bos && tokenizer_bos(t) < 0) {
		fprintf(stderr, "pipectl: tokenize: --bos: %s names no BOS token\n", path);
		goto out_tok;
	}
	if (read_stdin(&text, &len) != 0)
		goto out_tok;
	rc = tokenizer_encode(t, text, len, (bos ? TOK_ADD_BOS : 0) | (as_text ? TOK_SPECIAL_AS_TEXT : 0), &ids);
	if (rc == -EILSEQ) {
		fprintf(stderr, "pipectl: tokenize: the input has a character that %s cannot spell (no piece, no "
				"byte fallback, no unk_token)\n",
			path);
		goto out_text;
	}
	if (rc) {
		fprintf(stderr, "pipectl: tokenize: %s\n", strerror(-rc));
		goto out_text;
	}
	for (size_t i = 0; i < ids.n; i++)
		printf(i ? " %u" : "%u", ids.ids[i]);
	printf("\n");
	if (fflush(stdout) != 0)
		fprintf(stderr, "pipectl: tokenize: writing standard output: %s\n", strerror(errno));
	else
		status = PIPECTL_EXIT_OK;
	tok_ids_free(&ids);
out_text:
	free(text);
out_tok:
	tokenizer_destroy(&t);
	return status;
}

/* Reads the next id from standard input. Returns 1 with *id, 0 at the end of the input, or -1
 * after printing why (not a number, too large). */
static int next_id(uint32_t *id)
{
	int c;
	do
		c = getchar();
	while (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == ',');
	if (c == EOF)
		return 0;
	char text[32];
	size_t n = 0;
	uint64_t v = 0;
	bool ok = true;
	for (; c != EOF && c != ' ' && c != '\t' && c != '\n' && c != '\r' && c != ','; c = getchar()) {
		if (n < sizeof(text) - 1)
			text[n++] = (char)c;
		ok = ok && c >= '0' && c <= '9' && v <= UINT32_MAX;
		if (ok)
			v = v * 10 + (uint64_t)(c - '0');
	}
	text[n] = 0;
	if (!ok || v > UINT32_MAX) {
		fprintf(stderr, "pipectl: detokenize: '%s%s' is not a token id (decimal ids separated by spaces or "
				"commas)\n",
			text, n == sizeof(text) - 1 ? "..." : "");
		return -1;
	}
	*id = (uint32_t)v;
	return 1;
}

int cmd_detokenize(struct pipectl *p, int argc, char **argv)
{
	const char *path = NULL;
	bool skip_special = false, raw = false;
	struct opt opts[] = {
		{"tokenizer", OPT_STRING, &path, NULL,
		 "the checkpoint's tokenizer.json, its directory, or a GGUF file (required)"},
		{"skip-special", OPT_BOOL, &skip_special, NULL, "leave special tokens out (default: their text)"},
		{"raw", OPT_BOOL, &raw, NULL, "write bytes that are not valid UTF-8 as they are (default: U+FFFD)"},
		{0},
	};
	int rc = pipectl_parse("detokenize --tokenizer FILE [--skip-special] [--raw]",
			       "Reads token ids (decimal, separated by spaces, newlines or commas) from standard input "
			       "and writes the text they decode to as it becomes complete, with no newline added.",
			       opts, argc, argv, NULL, 0, 0, NULL);
	if (rc)
		return rc == 1 ? PIPECTL_EXIT_OK : PIPECTL_EXIT_USAGE;
	struct tokenizer *t = load_tokenizer("detokenize", path);
	if (!t)
		return PIPECTL_EXIT_FAIL;
	int status = PIPECTL_EXIT_FAIL;
	unsigned flags = (skip_special ? TOK_SKIP_SPECIAL : 0) | (raw ? TOK_DECODE_RAW : 0);
	struct tok_decoder *d = tok_decoder_create(t, flags);
	if (!d) {
		fprintf(stderr, "pipectl: detokenize: out of memory\n");
		goto out_tok;
	}
	/* From a pipe or a terminal each piece is written at once (pipectl generate | pipectl
	 * detokenize shows text as it is generated); from a file stdio's buffering is enough. */
	struct stat st;
	bool stream = fstat(STDIN_FILENO, &st) != 0 || !S_ISREG(st.st_mode);
	const char *s;
	size_t len;
	uint32_t id;
	while ((rc = next_id(&id)) > 0) {
		rc = tok_decoder_feed(d, id, &s, &len);
		if (rc == -EINVAL) {
			fprintf(stderr, "pipectl: detokenize: token id %u is not in %s (vocab size %u)\n", id, path,
				tokenizer_vocab_size(t));
			goto out_flush;
		}
		if (rc) {
			fprintf(stderr, "pipectl: detokenize: %s\n", strerror(-rc));
			goto out_flush;
		}
		fwrite(s, 1, len, stdout);
		if (stream && len)
			fflush(stdout);
	}
	if (rc == 0)
		status = PIPECTL_EXIT_OK;
out_flush:
	/* What was decoded before a bad id is still written, the held-back tail included. */
	if (tok_decoder_flush(d, &s, &len) == 0)
		fwrite(s, 1, len, stdout);
	if (fflush(stdout) != 0) {
		fprintf(stderr, "pipectl: detokenize: writing standard output: %s\n", strerror(errno));
		status = PIPECTL_EXIT_FAIL;
	}
	tok_decoder_destroy(&d);
out_tok:
	tokenizer_destroy(&t);
	return status;
}

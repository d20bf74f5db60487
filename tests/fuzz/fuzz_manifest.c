/* fuzz_manifest.c - libFuzzer harness for the checkpoint reader (common/manifest.c): config.json,
 * generation_config.json, model.safetensors.index.json, each safetensors header, tokenizer.json.
 *
 * manifest_load reads a directory, so the input is a small directory in text form: sections, each
 * starting with a line "@@@@ NAME" or "@@@@ NAME OPTION" at the start of the input or of a line;
 * the section's bytes (up to the newline before the next "@@@@ " line) become the file NAME in a
 * scratch directory under $TMPDIR (else /tmp), and manifest_load reads that directory. NAME is a
 * plain file name ([A-Za-z0-9._-], at most 64 bytes; the first section of a name wins); "NAME/"
 * makes a directory instead. OPTION sizes a
 * safetensors file: its bytes are the 8-byte header length, the JSON header and whatever data
 * follows; "fit" extends the file (sparse) to exactly 8 + header length + the largest data_offsets
 * end the header names, "short" to one byte less, "long" to 4 KiB more. A GGUF file (its bytes
 * start with "GGUF") is sized the same way by the data its tensor table names, read with
 * gguf_open from the file extended to 1 GiB. Without OPTION the file is
 * the bytes as given.
 *
 *   @@@@ config.json
 *   {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, ...}
 *   @@@@ model.safetensors fit
 *   <8 bytes of length>{"model.embed_tokens.weight": {"dtype": "BF16", ...}, ...}
 *
 * manifest_load must take any such directory without a crash, a leak or undefined behaviour, and
 * return 0 or -errno. A manifest that loads must keep manifest.h's promises: every tensor inside
 * its file and inside its group's slot, the read extents aligned to MANIFEST_ALIGN and covering
 * every tensor, the groups' tensors contiguous and each role found by manifest_find_tensor.
 *
 *   build-fuzz/fuzz/fuzz_manifest -dict=tests/fuzz/manifest.dict NEW_DIR tests/fuzz/corpus/manifest
 *
 * FUZZ_VERBOSE=1 prints what became of each input. docs/fuzzing.md says more. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/gguf.h"
#include "common/manifest.h"
#include "tests/fuzz/manifest_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond, ...)                                                   \
	do {                                                               \
		if (!(cond)) {                                             \
			fprintf(stderr, "fuzz_manifest: %s: ", #cond);     \
			fprintf(stderr, __VA_ARGS__);                      \
			fputc('\n', stderr);                               \
			abort();                                           \
		}                                                          \
	} while (0)

#define MAX_FILES 16
#define MAX_NAME  64
#define MAX_SPARSE (1ull << 36) /* a "fit" file is never made larger than this */

static const char marker[] = "@@@@ ";
#define MARKER_LEN (sizeof(marker) - 1)

static char scratch[PATH_MAX];
static char written[MAX_FILES][MAX_NAME + 1]; /* what the last run made, to remove */
static bool written_dir[MAX_FILES];
static unsigned n_written;

static void remove_scratch(void)
{
	for (unsigned i = 0; i < n_written; i++) {
		char path[PATH_MAX];
		snprintf(path, sizeof(path), "%s/%s", scratch, written[i]);
		if (written_dir[i])
			rmdir(path);
		else
			unlink(path);
	}
	n_written = 0;
}

static void remove_all(void)
{
	remove_scratch();
	if (scratch[0])
		rmdir(scratch);
}

static bool name_ok(const char *s, size_t n)
{
	if (n == 0 || n > MAX_NAME || (n == 1 && s[0] == '.') || (n == 2 && s[0] == '.' && s[1] == '.'))
		return false;
	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
		      c == '-'))
			return false;
	}
	return true;
}

/* The file size "fit" means for the GGUF file at path (n bytes), or 0 when its header does not
 * read even with room for every tensor. */
static uint64_t gguf_fit_size(int fd, const char *path, size_t n)
{
	CHECK(ftruncate(fd, 1ll << 30) == 0, "ftruncate %s: %m", path);
	struct gguf *g;
	char err[256];
	uint64_t end = 0;
	if (gguf_open(path, &g, err, sizeof(err)) == 0) {
		for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
			const struct gguf_tensor *t = gguf_tensor(g, i);
			if (gguf_data_start(g) + t->offset + t->nbytes > end)
				end = gguf_data_start(g) + t->offset + t->nbytes;
		}
		gguf_close(&g);
	}
	CHECK(ftruncate(fd, (off_t)n) == 0, "ftruncate %s: %m", path);
	return end > n ? end : 0;
}

/* The file size "fit" means for a safetensors file of these bytes, or 0 when there is none. */
static uint64_t fit_size(const uint8_t *p, size_t n)
{
	if (n < 8)
		return 0;
	uint64_t hl = 0;
	for (int i = 7; i >= 0; i--)
		hl = (hl << 8) | p[i];
	if (hl > n - 8)
		return 0;
	json_t *root = json_loadb((const char *)p + 8, hl, 0, NULL);
	if (!root)
		return 0;
	uint64_t end = 0;
	const char *key;
	json_t *val;
	json_object_foreach(root, key, val) {
		json_t *e = json_array_get(json_object_get(val, "data_offsets"), 1);
		if (json_is_integer(e) && json_integer_value(e) > 0 && (uint64_t)json_integer_value(e) > end)
			end = (uint64_t)json_integer_value(e);
	}
	json_decref(root);
	if (end > MAX_SPARSE)
		return 0;
	return 8 + hl + end;
}

static void write_file(const char *name, size_t name_len, const char *opt, size_t opt_len, const uint8_t *p,
		       size_t n)
{
	char path[PATH_MAX];
	bool dir = name_len > 1 && name[name_len - 1] == '/';
	if (dir)
		name_len--;
	if (!name_ok(name, name_len) || n_written == MAX_FILES)
		return;
	memcpy(written[n_written], name, name_len);
	written[n_written][name_len] = 0;
	snprintf(path, sizeof(path), "%s/%s", scratch, written[n_written]);
	/* A name given twice: the first section wins. */
	for (unsigned i = 0; i < n_written; i++)
		if (!strcmp(written[i], written[n_written]))
			return;
	if (dir) {
		CHECK(mkdir(path, 0700) == 0, "mkdir %s: %m", path);
		written_dir[n_written++] = true;
		return;
	}
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	CHECK(fd >= 0, "open %s: %m", path);
	written_dir[n_written++] = false;
	size_t done = 0;
	while (done < n) {
		ssize_t w = write(fd, p + done, n - done);
		CHECK(w > 0, "write %s: %m", path);
		done += (size_t)w;
	}
	uint64_t want = 0;
	if (opt_len) {
		uint64_t fit = n >= 4 && !memcmp(p, "GGUF", 4) ? gguf_fit_size(fd, path, n) : fit_size(p, n);
		if (fit && opt_len == 3 && !memcmp(opt, "fit", 3))
			want = fit;
		else if (fit && opt_len == 5 && !memcmp(opt, "short", 5))
			want = fit - 1;
		else if (fit && opt_len == 4 && !memcmp(opt, "long", 4))
			want = fit + 4096;
	}
	if (want > n)
		CHECK(ftruncate(fd, (off_t)want) == 0, "ftruncate %s: %m", path);
	close(fd);
}

/* Finds the next section marker at or after pos that starts the input or a line. */
static size_t next_marker(const uint8_t *d, size_t size, size_t pos)
{
	for (size_t i = pos; i + MARKER_LEN <= size; i++)
		if ((i == 0 || d[i - 1] == '\n') && !memcmp(d + i, marker, MARKER_LEN))
			return i;
	return size;
}

static void write_sections(const uint8_t *d, size_t size)
{
	size_t pos = next_marker(d, size, 0);
	while (pos < size) {
		size_t line = pos + MARKER_LEN, eol = line;
		while (eol < size && d[eol] != '\n')
			eol++;
		size_t body = eol < size ? eol + 1 : size;
		size_t next = next_marker(d, size, body);
		size_t end = next;
		if (next < size && end > body)
			end--; /* the newline before the next marker ends the line, not the file */
		const char *name = (const char *)d + line, *sp = memchr(name, ' ', eol - line);
		size_t name_len = sp ? (size_t)(sp - name) : eol - line;
		const char *opt = sp ? sp + 1 : "";
		size_t opt_len = sp ? (size_t)((const char *)d + eol - opt) : 0;
		write_file(name, name_len, opt, opt_len, d + body, end - body);
		pos = next;
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (!scratch[0]) {
		const char *tmp = getenv("TMPDIR");
		snprintf(scratch, sizeof(scratch), "%s/fuzz_manifest.XXXXXX", tmp && *tmp ? tmp : "/tmp");
		CHECK(mkdtemp(scratch) != NULL, "mkdtemp: %m");
		atexit(remove_all);
	}
	remove_scratch();
	write_sections(data, size);

	char err[512];
	struct manifest *m = (struct manifest *)(uintptr_t)1;
	int rc = manifest_load(scratch, &m, err, sizeof(err));
	if (getenv("FUZZ_VERBOSE"))
		fprintf(stderr, "fuzz_manifest: %s\n", rc ? err : "loads");
	if (rc) {
		CHECK(m == NULL, "a failed load left *out set");
		CHECK(rc < 0, "manifest_load returned %d", rc);
		CHECK(memchr(err, 0, sizeof(err)) != NULL, "the error message is not terminated");
	} else {
		CHECK(m != NULL, "loaded, but no manifest");
		check_manifest(m);
	}
	manifest_destroy(&m);
	manifest_destroy(&m);
	return 0;
}

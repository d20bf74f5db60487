/* fuzz_gguf.c - libFuzzer harness for the GGUF reader (common/gguf.c) and the GGUF side of the
 * checkpoint reader (common/manifest_gguf.c, manifest_gguf_vocab.c).
 *
 * The input is a GGUF file as it is. It is written to a memory file (memfd_create), which both
 * readers open by its /proc/self/fd path:
 *  1. gguf_open reads the bytes as they are (a header alone fails here: its tensors' data is not
 *     in the file);
 *  2. the file is extended (sparse, zeros) to 1 GiB and read again; when it loads, every key is
 *     read back through every typed getter and every tensor is checked to lie inside the file at
 *     an aligned offset; the file is then cut to exactly the data its tensor table names, so that
 *     seeds can be headers alone (a few KB) and still reach the manifest's checks;
 *  3. manifest_load reads it. A manifest that loads must keep manifest.h's promises
 *     (manifest_check.h), and a tokenizer made from the file's tokenizer.ggml.* keys must load in
 *     the tokenizer (tokenizer_load_buffer): the runner will load it at its start.
 *
 *   build-fuzz/fuzz/fuzz_gguf -dict=tests/fuzz/gguf.dict NEW_DIR tests/fuzz/corpus/gguf
 *
 * FUZZ_VERBOSE=1 prints what became of each input. docs/fuzzing.md says more. */
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/gguf.h"
#include "common/manifest.h"
#include "common/tokenizer/tokenizer.h"
#include "tests/fuzz/manifest_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond, ...)                                           \
	do {                                                       \
		if (!(cond)) {                                     \
			fprintf(stderr, "fuzz_gguf: %s: ", #cond); \
			fprintf(stderr, __VA_ARGS__);              \
			fputc('\n', stderr);                       \
			abort();                                   \
		}                                                  \
	} while (0)

#define SPARSE_SIZE (1ull << 30) /* the size of the extended file in step 2 */

static int mfd = -1;
static char path[64];

/* Every getter on key i: each returns 0 or an error, and what a getter returns is usable. */
static void read_back(const struct gguf *g, uint64_t i)
{
	const char *key = gguf_kv_key(g, i);
	char err[256];
	uint32_t u32;
	uint64_t u64, n;
	int64_t i64;
	float f;
	bool b;
	const char *s;
	size_t len;
	const struct gguf_str *sv;
	const float *fv;
	const int32_t *iv;
	CHECK(gguf_find_key(g, key) == (int64_t)i, "key %s does not find itself", key);
	(void)gguf_get_u32(g, key, &u32, err, sizeof(err));
	(void)gguf_get_u64(g, key, &u64, err, sizeof(err));
	(void)gguf_get_i64(g, key, &i64, err, sizeof(err));
	(void)gguf_get_f32(g, key, &f, err, sizeof(err));
	(void)gguf_get_bool(g, key, &b, err, sizeof(err));
	if (gguf_get_str(g, key, &s, &len, err, sizeof(err)) == 0)
		CHECK(s[len] == 0 && strlen(s) <= len, "string %s is not terminated", key);
	if (gguf_get_str_array(g, key, &sv, &n, err, sizeof(err)) == 0)
		for (uint64_t k = 0; k < n; k++)
			CHECK(sv[k].s[sv[k].len] == 0, "string %llu of %s is not terminated", (unsigned long long)k,
			      key);
	volatile float fsum = 0;
	if (gguf_get_f32_array(g, key, &fv, &n, err, sizeof(err)) == 0)
		for (uint64_t k = 0; k < n; k++)
			fsum += fv[k];
	volatile int32_t isum = 0;
	if (gguf_get_i32_array(g, key, &iv, &n, err, sizeof(err)) == 0)
		for (uint64_t k = 0; k < n; k++)
			isum ^= iv[k];
	(void)fsum; /* read so that a bad pointer would fault here */
	(void)isum;
	if (gguf_kv_type(g, i) == GGUF_ARRAY)
		(void)gguf_kv_array_type(g, i, &n);
	CHECK(memchr(err, 0, sizeof(err)) != NULL, "an error message is not terminated");
}

/* The reader's promises; returns the file size the tensor table needs. */
static uint64_t check_gguf(const struct gguf *g)
{
	uint64_t size = gguf_file_size(g), start = gguf_data_start(g), need = 0;
	uint32_t a = gguf_alignment(g);
	CHECK(a && !(a & (a - 1)), "alignment %u", a);
	CHECK(start % a == 0, "data at %llu, alignment %u", (unsigned long long)start, a);
	for (uint64_t i = 0; i < gguf_n_kv(g); i++)
		read_back(g, i);
	for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
		const struct gguf_tensor *t = gguf_tensor(g, i);
		CHECK(gguf_find_tensor(g, t->name) == (int64_t)i, "tensor %s does not find itself", t->name);
		CHECK(t->n_dims >= 1 && t->n_dims <= GGUF_MAX_DIMS, "tensor %s: %u dims", t->name, t->n_dims);
		CHECK(t->offset % a == 0, "tensor %s at %llu", t->name, (unsigned long long)t->offset);
		CHECK(start <= size && t->offset <= size - start && t->nbytes <= size - start - t->offset,
		      "tensor %s: [%llu, +%llu) outside the file (%llu bytes, data at %llu)", t->name,
		      (unsigned long long)t->offset, (unsigned long long)t->nbytes, (unsigned long long)size,
		      (unsigned long long)start);
		uint32_t be, bb;
		CHECK(gguf_type_block(t->type, &be, &bb) == 0 && t->ne[0] % be == 0, "tensor %s: type %u", t->name,
		      t->type);
		if (start + t->offset + t->nbytes > need)
			need = start + t->offset + t->nbytes;
	}
	return need;
}

static void init(void)
{
	mfd = memfd_create("fuzz_gguf", MFD_CLOEXEC);
	CHECK(mfd >= 0, "memfd_create: %m");
	snprintf(path, sizeof(path), "/proc/self/fd/%d", mfd);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (mfd < 0)
		init();
	CHECK(ftruncate(mfd, 0) == 0, "ftruncate: %m");
	for (size_t done = 0; done < size;) {
		ssize_t w = pwrite(mfd, data + done, size - done, (off_t)done);
		CHECK(w > 0, "pwrite: %m");
		done += (size_t)w;
	}
	bool verbose = getenv("FUZZ_VERBOSE") != NULL;

	char err[512];
	struct gguf *g = (struct gguf *)(uintptr_t)1;
	int rc = gguf_open(path, &g, err, sizeof(err));
	if (verbose)
		fprintf(stderr, "fuzz_gguf: gguf_open: %s\n", rc ? err : "loads");
	CHECK(rc ? g == NULL && rc < 0 : g != NULL, "gguf_open returned %d and %p", rc, (void *)g);
	CHECK(memchr(err, 0, sizeof(err)) != NULL, "the error message is not terminated");
	gguf_close(&g);
	if (size < SPARSE_SIZE) {
		CHECK(ftruncate(mfd, (off_t)SPARSE_SIZE) == 0, "ftruncate: %m");
		rc = gguf_open(path, &g, err, sizeof(err));
		if (verbose)
			fprintf(stderr, "fuzz_gguf: gguf_open, extended: %s\n", rc ? err : "loads");
		if (rc) {
			CHECK(g == NULL && rc < 0, "gguf_open returned %d and %p", rc, (void *)g);
			return 0; /* manifest_load would refuse it the same way */
		}
		uint64_t need = check_gguf(g);
		gguf_close(&g);
		gguf_close(&g);
		CHECK(ftruncate(mfd, (off_t)(need > size ? need : size)) == 0, "ftruncate: %m");
	}

	struct manifest *m = (struct manifest *)(uintptr_t)1;
	rc = manifest_load(path, &m, err, sizeof(err));
	if (verbose)
		fprintf(stderr, "fuzz_gguf: manifest_load: %s%s%s\n", rc ? err : "loads",
			!rc && m->tokenizer_note[0] ? "; " : "", !rc ? m->tokenizer_note : "");
	if (rc) {
		CHECK(m == NULL && rc < 0, "manifest_load returned %d and %p", rc, (void *)m);
		CHECK(memchr(err, 0, sizeof(err)) != NULL, "the error message is not terminated");
		return 0;
	}
	CHECK(m != NULL, "loaded, but no manifest");
	check_manifest(m);
	/* llama's wq and wk are permuted for RoPE on adjacent pairs; qwen3's are stored as in the
	 * checkpoint (halves). */
	bool qwen = m->cfg.arch == ARCH_QWEN3 || m->cfg.arch == ARCH_QWEN3_MOE;
	CHECK(m->cfg.rope_layout == (qwen ? ROPE_HALVES : ROPE_ADJACENT), "a GGUF model of architecture %u with rope "
	      "layout %u", m->cfg.arch, m->cfg.rope_layout);
	CHECK(memchr(m->tokenizer_note, 0, sizeof(m->tokenizer_note)) != NULL, "the note is not terminated");
	if (m->tokenizer_json) {
		struct tokenizer *t = NULL;
		rc = tokenizer_load_buffer("converted", m->tokenizer_json, m->tokenizer_bytes, &t, err, sizeof(err));
		CHECK(rc == 0, "the tokenizer made from the file does not load: %s", err);
		CHECK(tokenizer_vocab_size(t) <= m->cfg.vocab_size, "the tokenizer has %u ids, the model %u",
		      tokenizer_vocab_size(t), m->cfg.vocab_size);
		struct tok_ids ids = {0};
		static const char text[] = "Hello world, <s> caf\xc3\xa9 \xff 123";
		if (tokenizer_encode(t, text, sizeof(text) - 1, TOK_ADD_BOS, &ids) == 0)
			for (size_t i = 0; i < ids.n; i++)
				CHECK(ids.ids[i] < m->cfg.vocab_size, "id %u past the vocabulary", ids.ids[i]);
		tok_ids_free(&ids);
		tokenizer_destroy(&t);
	}
	manifest_destroy(&m);
	manifest_destroy(&m);
	return 0;
}

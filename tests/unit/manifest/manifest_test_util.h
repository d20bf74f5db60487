/* manifest_test_util.h - what the manifest's test programs share: per-tcase and per-test
 * directories, synthetic checkpoints written into them, loading and expecting, patches to a
 * checkpoint's JSON and safetensors headers, and the checks of every tensor and the layout.
 *
 *   const struct test_case cases[] = {{"good", {test_a, test_b, NULL}}, ...};
 *   int main(void) { return run_cases("manifest_good", cases, ARRAY_SIZE(cases)); }
 *
 *   const char *dir = write_tiny("m");           // tpath("m"): under this test's directory
 *   set_config(dir, "config.json", "hidden_size", "65");
 *   load_fails(dir, -EINVAL, "hidden_size");
 *
 * Each program links manifest_test_util.c. */
#ifndef MANIFEST_TEST_UTIL_H
#define MANIFEST_TEST_UTIL_H
#include <check.h>
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "common/manifest.h"
#include "common/util.h"
#include "tools/make-synthetic-model/synthetic.h"

extern char case_root[64]; /* per tcase, made and removed by the parent: cleaned even after a failure */
extern char tmp_root[128]; /* per test, inside case_root */

/* A tcase of a program: its name and its tests, NULL-terminated. */
struct test_case {
	const char *name;
	const TTest *tests[8];
};

/* Runs the suite of n tcases, each with case_root (unchecked) and tmp_root (checked) fixtures and
 * a 60 s timeout; the exit status for main. */
int run_cases(const char *suite, const struct test_case *cases, size_t n);

/* case_root for a tcase (unchecked fixture), tmp_root inside it for a test (checked fixture). */
void case_setup(void);
void case_teardown(void);
void setup(void);
void teardown(void);
/* A path under this test's directory. Returns a static buffer, one of 64 used in turn: enough
 * for every path a test holds at once. */
const char *tpath(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The "tiny" shape; options with dtype, seed and shards, the rest default. */
struct model_config tiny_cfg(void);
struct synth_options opts(enum dtype dt, uint64_t seed, uint32_t shards);
/* Writes a checkpoint into dir (under the test directory) and returns its full path. */
const char *write_model(const char *name, const struct model_config *c, const struct synth_options *o);
/* write_model of the tiny shape, bf16, seed 1, one file. */
const char *write_tiny(const char *name);
/* manifest_load, checked to succeed. */
struct manifest *load_ok(const char *dir);
/* manifest_load must fail with rc and a message containing word. */
void load_fails(const char *dir, int want_rc, const char *word);

/* Loads a JSON file, lets fn change it, writes it back. */
void patch_json(const char *path, void (*fn)(json_t *root, const void *arg), const void *arg);
/* A patch_json fn: sets (or deletes) one key of the top-level object (arg: a struct kv). */
struct kv {
	const char *key;
	const char *json; /* value as JSON text; NULL deletes the key */
};
void set_key(json_t *root, const void *arg);
/* set_key on dir/file. */
void set_config(const char *dir, const char *file, const char *key, const char *json);
/* The whole file (malloc'd) and its length; write_file replaces a file with len bytes. */
void *read_file(const char *path, size_t *len);
void write_file(const char *path, const void *data, size_t len);
/* Rewrites a safetensors file with its header changed by fn; the data bytes stay as they are. */
void patch_header(const char *path, void (*fn)(json_t *hdr, const void *arg), const void *arg);
/* A patch_header fn changing one tensor's entry (arg: a struct tensor_patch); tensor_patch
 * applies it to dir/file. */
struct tensor_patch {
	const char *name;
	const char *field; /* "dtype", "shape", "data_offsets", or NULL to delete the tensor */
	const char *json;
	const char *rename; /* when set: move the entry to this name */
};
void patch_tensor(json_t *hdr, const void *arg);
void tensor_patch(const char *dir, const char *file, struct tensor_patch p);

/* Runs make-synthetic-model with args (NULL-terminated, at most 46) and returns its exit status;
 * what it printed on stderr goes into err (NULL: dropped). */
int run_tool(const char *const *args, char *err, size_t errlen);

/* The bytes of tensor t as its file holds them. */
void *tensor_bytes(const struct manifest *m, const struct tensor_desc *t);
/* Tensor idx has this name, role and shape (c 0 for a vector), and the bytes that go with it. */
void check_tensor(const struct manifest *m, int idx, const char *name, uint32_t role, uint64_t r, uint64_t c);
/* Every tensor of the model where it belongs, with its shape. */
void check_all_tensors(const struct manifest *m);
/* The layout promises: aligned extents, tensors inside their slot, and reading the extents
 * into a slot buffer gives every tensor's bytes at its slot_offset. */
void check_layout(const struct manifest *m);

#endif

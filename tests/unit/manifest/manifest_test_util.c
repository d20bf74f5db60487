/* manifest_test_util.c - what the manifest's test programs share (manifest_test_util.h). */
#include "tests/unit/manifest/manifest_test_util.h"

#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/unit/common/test_helpers.h"

char case_root[64]; /* per tcase, made and removed by the parent: cleaned even after a failure */
char tmp_root[128]; /* per test, inside case_root */

void case_setup(void)
{
	snprintf(case_root, sizeof(case_root), "/tmp/test-manifest-XXXXXX");
	if (!mkdtemp(case_root))
		abort();
}

void case_teardown(void)
{
	th_rmtree(case_root);
}

void setup(void)
{
	snprintf(tmp_root, sizeof(tmp_root), "%s/t-XXXXXX", case_root);
	ck_assert_ptr_nonnull(mkdtemp(tmp_root));
}

void teardown(void)
{
	th_rmtree(tmp_root);
}

/* A path under this test's directory. Returns a static buffer, one of 64 used in turn: enough
 * for every path a test holds at once. */
const char *tpath(const char *fmt, ...)
{
	static char bufs[64][512];
	static int k;
	char *b = bufs[k++ % 64];
	size_t n = (size_t)snprintf(b, 512, "%s/", tmp_root);
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(b + n, 512 - n, fmt, ap);
	va_end(ap);
	return b;
}

struct model_config tiny_cfg(void)
{
	struct model_config c;
	char err[256];
	ck_assert_int_eq(synth_shape_config("tiny", &c, err, sizeof(err)), 0);
	return c;
}

struct synth_options opts(enum dtype dt, uint64_t seed, uint32_t shards)
{
	struct synth_options o;
	synth_options_default(&o);
	o.dtype = dt;
	o.seed = seed;
	o.shards = shards;
	return o;
}

/* Writes a checkpoint into dir (under the test directory) and returns its full path. */
const char *write_model(const char *name, const struct model_config *c, const struct synth_options *o)
{
	char err[512] = "";
	const char *dir = tpath("%s", name);
	int rc = synth_write(dir, c, o, err, sizeof(err));
	ck_assert_msg(rc == 0, "synth_write %s: %d %s", dir, rc, err);
	return dir;
}

const char *write_tiny(const char *name)
{
	struct model_config c = tiny_cfg();
	struct synth_options o = opts(DT_BF16, 1, 0);
	return write_model(name, &c, &o);
}

struct manifest *load_ok(const char *dir)
{
	char err[512] = "";
	struct manifest *m = NULL;
	int rc = manifest_load(dir, &m, err, sizeof(err));
	ck_assert_msg(rc == 0, "manifest_load %s: %d %s", dir, rc, err);
	ck_assert_ptr_nonnull(m);
	return m;
}

/* manifest_load must fail with rc and a message containing word. */
void load_fails(const char *dir, int want_rc, const char *word)
{
	char err[512] = "";
	struct manifest *m = (struct manifest *)0x1;
	int rc = manifest_load(dir, &m, err, sizeof(err));
	ck_assert_msg(rc == want_rc, "manifest_load %s: rc %d (%s), wanted %d", dir, rc, err, want_rc);
	ck_assert_ptr_null(m);
	ck_assert_msg(strstr(err, word) != NULL, "message \"%s\" lacks \"%s\"", err, word);
}

/* Loads a JSON file, lets fn change it, writes it back. */
void patch_json(const char *path, void (*fn)(json_t *root, const void *arg), const void *arg)
{
	json_error_t je;
	json_t *root = json_load_file(path, 0, &je);
	ck_assert_msg(root != NULL, "%s: %s", path, je.text);
	fn(root, arg);
	ck_assert_int_eq(json_dump_file(root, path, JSON_INDENT(2)), 0);
	json_decref(root);
}

void set_key(json_t *root, const void *arg)
{
	const struct kv *kv = arg;
	if (!kv->json) {
		json_object_del(root, kv->key);
		return;
	}
	json_error_t je;
	json_t *v = json_loads(kv->json, JSON_DECODE_ANY, &je);
	ck_assert_msg(v != NULL, "bad test JSON %s", kv->json);
	json_object_set_new(root, kv->key, v);
}

void set_config(const char *dir, const char *file, const char *key, const char *json)
{
	char path[600];
	snprintf(path, sizeof(path), "%s/%s", dir, file);
	struct kv kv = {key, json};
	patch_json(path, set_key, &kv);
}

void *read_file(const char *path, size_t *len)
{
	int fd = open(path, O_RDONLY);
	ck_assert_msg(fd >= 0, "open %s", path);
	struct stat st;
	ck_assert_int_eq(fstat(fd, &st), 0);
	char *b = malloc((size_t)st.st_size + 1);
	ck_assert_ptr_nonnull(b);
	ck_assert_int_eq(pread(fd, b, (size_t)st.st_size, 0), st.st_size);
	close(fd);
	*len = (size_t)st.st_size;
	return b;
}

void write_file(const char *path, const void *data, size_t len)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	ck_assert_msg(fd >= 0, "create %s", path);
	ck_assert_int_eq(write(fd, data, len), (ssize_t)len);
	close(fd);
}

/* Rewrites a safetensors file with its header changed by fn; the data bytes stay as they are. */
void patch_header(const char *path, void (*fn)(json_t *hdr, const void *arg), const void *arg)
{
	size_t len;
	unsigned char *b = read_file(path, &len);
	uint64_t n = 0;
	for (int i = 7; i >= 0; i--)
		n = (n << 8) | b[i];
	json_error_t je;
	json_t *hdr = json_loadb((char *)b + 8, n, 0, &je);
	ck_assert_msg(hdr != NULL, "%s header: %s", path, je.text);
	fn(hdr, arg);
	char *text = json_dumps(hdr, JSON_COMPACT);
	size_t tl = strlen(text), padded = (tl + 7) / 8 * 8;
	unsigned char *out = malloc(8 + padded + (len - 8 - n));
	for (int i = 0; i < 8; i++)
		out[i] = (unsigned char)(padded >> (8 * i));
	memcpy(out + 8, text, tl);
	memset(out + 8 + tl, ' ', padded - tl);
	memcpy(out + 8 + padded, b + 8 + n, len - 8 - n);
	write_file(path, out, 8 + padded + (len - 8 - n));
	free(out);
	free(text);
	json_decref(hdr);
	free(b);
}

void patch_tensor(json_t *hdr, const void *arg)
{
	const struct tensor_patch *p = arg;
	json_t *e = json_object_get(hdr, p->name);
	ck_assert_msg(e != NULL, "no tensor %s in header", p->name);
	if (p->rename) {
		json_object_set(hdr, p->rename, e);
		json_object_del(hdr, p->name);
		return;
	}
	if (!p->field) {
		json_object_del(hdr, p->name);
		return;
	}
	json_error_t je;
	json_object_set_new(e, p->field, json_loads(p->json, JSON_DECODE_ANY, &je));
}

void tensor_patch(const char *dir, const char *file, struct tensor_patch p)
{
	char path[600];
	snprintf(path, sizeof(path), "%s/%s", dir, file);
	patch_header(path, patch_tensor, &p);
}

/* The bytes of tensor t as its file holds them. */
void *tensor_bytes(const struct manifest *m, const struct tensor_desc *t)
{
	int fd = open(m->files[t->file_index].path, O_RDONLY);
	ck_assert_int_ge(fd, 0);
	void *b = malloc(t->nbytes);
	ck_assert_int_eq(pread(fd, b, t->nbytes, (off_t)t->file_offset), (ssize_t)t->nbytes);
	close(fd);
	return b;
}

void check_tensor(const struct manifest *m, int idx, const char *name, uint32_t role, uint64_t r, uint64_t c)
{
	ck_assert_int_ge(idx, 0);
	const struct tensor_desc *t = &m->tensors[idx];
	ck_assert_str_eq(t->name, name);
	ck_assert_uint_eq(t->role, role);
	ck_assert_uint_eq(t->shape[0], r);
	ck_assert_uint_eq(t->shape[1], c);
	ck_assert_uint_eq(t->ndim, c ? 2 : 1);
	ck_assert_uint_eq(t->nbytes, r * (c ? c : 1) * dtype_size(t->dtype));
}

/* Every tensor of the model where it belongs, with its shape. */
void check_all_tensors(const struct manifest *m)
{
	const struct model_config *c = &m->cfg;
	uint64_t q = (uint64_t)c->n_heads * c->head_dim, kv = (uint64_t)c->n_kv_heads * c->head_dim;
	char name[128];
	ck_assert_uint_eq(m->n_groups, 2 + 2 * c->n_layers);
	ck_assert_uint_eq(m->n_tensors, 2 + 9 * c->n_layers + (c->tie_embeddings ? 0 : 1));
	check_tensor(m, manifest_find_tensor(m, 0, ROLE_EMBED), "model.embed_tokens.weight", ROLE_EMBED, c->vocab_size,
		     c->dim);
	for (uint32_t l = 0; l < c->n_layers; l++) {
		uint32_t ga = group_id_attn(l), gf = group_id_ffn(l);
		ck_assert_uint_eq(m->groups[ga].kind, GROUP_ATTN);
		ck_assert_uint_eq(m->groups[gf].kind, GROUP_FFN);
		ck_assert_uint_eq(m->groups[ga].layer, l);
		ck_assert_uint_eq(m->groups[ga].n_tensors, 5);
		ck_assert_uint_eq(m->groups[gf].n_tensors, 4);
#define T(g, role, suffix, r, cc)                                                                                      \
	snprintf(name, sizeof(name), "model.layers.%u.%s", l, suffix);                                                 \
	check_tensor(m, manifest_find_tensor(m, g, role), name, role, r, cc)
		T(ga, ROLE_ATTN_NORM, "input_layernorm.weight", c->dim, 0);
		T(ga, ROLE_WQ, "self_attn.q_proj.weight", q, c->dim);
		T(ga, ROLE_WK, "self_attn.k_proj.weight", kv, c->dim);
		T(ga, ROLE_WV, "self_attn.v_proj.weight", kv, c->dim);
		T(ga, ROLE_WO, "self_attn.o_proj.weight", c->dim, q);
		T(gf, ROLE_FFN_NORM, "post_attention_layernorm.weight", c->dim, 0);
		T(gf, ROLE_W_GATE, "mlp.gate_proj.weight", c->ffn_dim, c->dim);
		T(gf, ROLE_W_UP, "mlp.up_proj.weight", c->ffn_dim, c->dim);
		T(gf, ROLE_W_DOWN, "mlp.down_proj.weight", c->dim, c->ffn_dim);
#undef T
		ck_assert_int_eq(manifest_find_tensor(m, ga, ROLE_W_UP), -1);
	}
	uint32_t gh = group_id_head(c);
	ck_assert_uint_eq(m->groups[gh].kind, GROUP_HEAD);
	check_tensor(m, manifest_find_tensor(m, gh, ROLE_FINAL_NORM), "model.norm.weight", ROLE_FINAL_NORM, c->dim, 0);
	int head = manifest_find_tensor(m, gh, ROLE_LM_HEAD);
	if (c->tie_embeddings) {
		ck_assert_uint_eq(m->groups[gh].n_tensors, 1);
		ck_assert_int_eq(head, manifest_find_tensor(m, 0, ROLE_EMBED));
	} else {
		ck_assert_uint_eq(m->groups[gh].n_tensors, 2);
		check_tensor(m, head, "lm_head.weight", ROLE_LM_HEAD, c->vocab_size, c->dim);
	}
	ck_assert_int_eq(manifest_find_tensor(m, m->n_groups, ROLE_EMBED), -1);
	/* Tensors sorted by group, then role. */
	uint64_t total = 0;
	for (uint32_t i = 0; i < m->n_tensors; i++) {
		total += m->tensors[i].nbytes;
		if (i)
			ck_assert(m->tensors[i - 1].group < m->tensors[i].group ||
				  (m->tensors[i - 1].group == m->tensors[i].group &&
				   m->tensors[i - 1].role < m->tensors[i].role));
	}
	ck_assert_uint_eq(m->total_tensor_bytes, total);
}

/* The layout promises: aligned extents, tensors inside their slot, and reading the extents
 * into a slot buffer gives every tensor's bytes at its slot_offset. */
void check_layout(const struct manifest *m)
{
	uint64_t class_max[CLASS_COUNT] = {0};
	uint32_t next_tensor = 0, next_extent = 0;
	for (uint32_t gi = 0; gi < m->n_groups; gi++) {
		const struct group_desc *g = &m->groups[gi];
		ck_assert_uint_eq(g->first_tensor, next_tensor);
		ck_assert_uint_eq(g->first_extent, next_extent);
		ck_assert_uint_ge(g->n_extents, 1);
		next_tensor += g->n_tensors;
		next_extent += g->n_extents;
		uint32_t want_class = g->kind == GROUP_ATTN			       ? CLASS_ATTN
				      : g->kind == GROUP_FFN || g->kind == GROUP_MOE ? CLASS_FFN
				      : g->kind == GROUP_EXPERT		       ? CLASS_EXPERT
										       : CLASS_GLOBAL;
		ck_assert_uint_eq(g->size_class, want_class);
		if (g->slot_bytes > class_max[want_class])
			class_max[want_class] = g->slot_bytes;
		uint64_t slot = 0;
		for (uint32_t e = g->first_extent; e < g->first_extent + g->n_extents; e++) {
			const struct read_extent *x = &m->extents[e];
			ck_assert_uint_eq(x->group, gi);
			ck_assert_uint_lt(x->file_index, m->n_files);
			ck_assert_uint_eq(x->file_offset % MANIFEST_ALIGN, 0);
			ck_assert_uint_eq(x->length % MANIFEST_ALIGN, 0);
			ck_assert_uint_eq(x->slot_offset, slot);
			ck_assert_uint_gt(x->length, 0);
			ck_assert_uint_lt(x->file_offset, m->files[x->file_index].size);
			slot += x->length;
		}
		ck_assert_uint_eq(g->slot_bytes, slot);
		unsigned char *buf = aligned_alloc(MANIFEST_ALIGN, slot);
		ck_assert_ptr_nonnull(buf);
		memset(buf, 0xee, slot);
		for (uint32_t e = g->first_extent; e < g->first_extent + g->n_extents; e++) {
			const struct read_extent *x = &m->extents[e];
			int fd = open(m->files[x->file_index].path, O_RDONLY);
			ck_assert_int_ge(fd, 0);
			ssize_t n = pread(fd, buf + x->slot_offset, x->length, (off_t)x->file_offset);
			/* Only the last extent of a file may come back short. */
			ck_assert_int_eq((uint64_t)n, x->file_offset + x->length <= m->files[x->file_index].size
							      ? x->length
							      : m->files[x->file_index].size - x->file_offset);
			close(fd);
		}
		uint64_t tb = 0;
		for (uint32_t k = g->first_tensor; k < g->first_tensor + g->n_tensors; k++) {
			const struct tensor_desc *t = &m->tensors[k];
			ck_assert_uint_eq(t->group, gi);
			ck_assert_uint_le(t->slot_offset + t->nbytes, g->slot_bytes);
			ck_assert_uint_le(t->file_offset + t->nbytes, m->files[t->file_index].size);
			ck_assert_uint_ge(t->file_offset, m->files[t->file_index].data_start);
			void *want = tensor_bytes(m, t);
			ck_assert_msg(memcmp(buf + t->slot_offset, want, t->nbytes) == 0,
				      "tensor %s differs in its slot", t->name);
			free(want);
			tb += t->nbytes;
		}
		ck_assert_uint_eq(g->tensor_bytes, tb);
		free(buf);
	}
	ck_assert_uint_eq(next_tensor, m->n_tensors);
	ck_assert_uint_eq(next_extent, m->n_extents);
	for (int c = 0; c < CLASS_COUNT; c++)
		ck_assert_uint_eq(m->class_bytes[c], class_max[c]);
}

int run_cases(const char *suite, const struct test_case *cases, size_t n)
{
	Suite *s = suite_create(suite);
	for (size_t i = 0; i < n; i++) {
		TCase *tc = tcase_create(cases[i].name);
		tcase_add_unchecked_fixture(tc, case_setup, case_teardown);
		tcase_add_checked_fixture(tc, setup, teardown);
		tcase_set_timeout(tc, 60);
		for (int k = 0; cases[i].tests[k]; k++)
			tcase_add_test(tc, cases[i].tests[k]);
		suite_add_tcase(s, tc);
	}
	SRunner *sr = srunner_create(s);
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? 1 : 0;
}

int run_tool(const char *const *args, char *err, size_t errlen)
{
	/* ctest says where the binaries are; run by hand, they sit in ../bin next to tests/. */
	const char *bin = getenv("PIPELINE_BIN_DIR");
	char exe[600], self[400];
	if (bin) {
		snprintf(exe, sizeof(exe), "%s/make-synthetic-model", bin);
	} else {
		ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
		ck_assert_int_gt(n, 0);
		self[n] = 0;
		*strrchr(self, '/') = 0;
		snprintf(exe, sizeof(exe), "%s/../bin/make-synthetic-model", self);
	}
	const char *errpath = tpath("tool-stderr.txt");
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		char *argv[48];
		int n = 0;
		argv[n++] = exe;
		for (; args[n - 1] && n < 47; n++)
			argv[n] = (char *)args[n - 1];
		argv[n] = NULL;
		int null = open("/dev/null", O_WRONLY);
		int efd = open(errpath, O_WRONLY | O_CREAT | O_TRUNC, 0600);
		dup2(null, 1);
		dup2(efd >= 0 ? efd : null, 2);
		execv(exe, argv);
		_exit(127);
	}
	int st;
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert(WIFEXITED(st));
	ck_assert_msg(WEXITSTATUS(st) != 127, "cannot run %s", exe);
	if (err && errlen) {
		size_t len = 0;
		char *text = read_file(errpath, &len);
		snprintf(err, errlen, "%.*s", (int)len, text);
		free(text);
	}
	unlink(errpath);
	return WEXITSTATUS(st);
}

/* test_manifest.c - manifest_load against synthetic checkpoints, good and corrupted, and the
 * synthetic writer itself (shapes, determinism, sharding, cleanup, the command-line tool).
 *
 * Each test writes under its own mkdtemp() directory in /tmp and removes it. Corruptions are
 * made by patching a synthetic checkpoint: its config JSON, its safetensors header (rewritten
 * with the same data) or its bytes. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/manifest.h"
#include "tools/make-synthetic-model/synthetic.h"

/* ---- helpers ---- */

static char case_root[64]; /* per tcase, made and removed by the parent: cleaned even after a failure */
static char tmp_root[128]; /* per test, inside case_root */

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)flag;
	(void)ftw;
	return remove(path);
}

static void case_setup(void)
{
	snprintf(case_root, sizeof(case_root), "/tmp/test-manifest-XXXXXX");
	if (!mkdtemp(case_root))
		abort();
}

static void case_teardown(void)
{
	nftw(case_root, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static void setup(void)
{
	snprintf(tmp_root, sizeof(tmp_root), "%s/t-XXXXXX", case_root);
	ck_assert_ptr_nonnull(mkdtemp(tmp_root));
}

static void teardown(void)
{
	nftw(tmp_root, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* A path under this test's directory. Returns a static buffer, one of 64 used in turn: enough
 * for every path a test holds at once. */
static const char *tpath(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static const char *tpath(const char *fmt, ...)
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

static struct model_config tiny_cfg(void)
{
	struct model_config c;
	char err[256];
	ck_assert_int_eq(synth_shape_config("tiny", &c, err, sizeof(err)), 0);
	return c;
}

static struct synth_options opts(enum dtype dt, uint64_t seed, uint32_t shards)
{
	struct synth_options o;
	synth_options_default(&o);
	o.dtype = dt;
	o.seed = seed;
	o.shards = shards;
	return o;
}

/* Writes a checkpoint into dir (under the test directory) and returns its full path. */
static const char *write_model(const char *name, const struct model_config *c, const struct synth_options *o)
{
	char err[512] = "";
	const char *dir = tpath("%s", name);
	int rc = synth_write(dir, c, o, err, sizeof(err));
	ck_assert_msg(rc == 0, "synth_write %s: %d %s", dir, rc, err);
	return dir;
}

static const char *write_tiny(const char *name)
{
	struct model_config c = tiny_cfg();
	struct synth_options o = opts(DT_BF16, 1, 0);
	return write_model(name, &c, &o);
}

static struct manifest *load_ok(const char *dir)
{
	char err[512] = "";
	struct manifest *m = NULL;
	int rc = manifest_load(dir, &m, err, sizeof(err));
	ck_assert_msg(rc == 0, "manifest_load %s: %d %s", dir, rc, err);
	ck_assert_ptr_nonnull(m);
	return m;
}

/* manifest_load must fail with rc and a message containing word. */
static void load_fails(const char *dir, int want_rc, const char *word)
{
	char err[512] = "";
	struct manifest *m = (struct manifest *)0x1;
	int rc = manifest_load(dir, &m, err, sizeof(err));
	ck_assert_msg(rc == want_rc, "manifest_load %s: rc %d (%s), wanted %d", dir, rc, err, want_rc);
	ck_assert_ptr_null(m);
	ck_assert_msg(strstr(err, word) != NULL, "message \"%s\" lacks \"%s\"", err, word);
}

/* Loads a JSON file, lets fn change it, writes it back. */
static void patch_json(const char *path, void (*fn)(json_t *root, const void *arg), const void *arg)
{
	json_error_t je;
	json_t *root = json_load_file(path, 0, &je);
	ck_assert_msg(root != NULL, "%s: %s", path, je.text);
	fn(root, arg);
	ck_assert_int_eq(json_dump_file(root, path, JSON_INDENT(2)), 0);
	json_decref(root);
}

struct kv {
	const char *key;
	const char *json; /* value as JSON text; NULL deletes the key */
};

static void set_key(json_t *root, const void *arg)
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

static void set_config(const char *dir, const char *file, const char *key, const char *json)
{
	char path[600];
	snprintf(path, sizeof(path), "%s/%s", dir, file);
	struct kv kv = {key, json};
	patch_json(path, set_key, &kv);
}

static void *read_file(const char *path, size_t *len)
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

static void write_file(const char *path, const void *data, size_t len)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	ck_assert_msg(fd >= 0, "create %s", path);
	ck_assert_int_eq(write(fd, data, len), (ssize_t)len);
	close(fd);
}

/* Rewrites a safetensors file with its header changed by fn; the data bytes stay as they are. */
static void patch_header(const char *path, void (*fn)(json_t *hdr, const void *arg), const void *arg)
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

struct tensor_patch {
	const char *name;
	const char *field; /* "dtype", "shape", "data_offsets", or NULL to delete the tensor */
	const char *json;
	const char *rename; /* when set: move the entry to this name */
};

static void patch_tensor(json_t *hdr, const void *arg)
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

static void tensor_patch(const char *dir, const char *file, struct tensor_patch p)
{
	char path[600];
	snprintf(path, sizeof(path), "%s/%s", dir, file);
	patch_header(path, patch_tensor, &p);
}

/* The bytes of tensor t as its file holds them. */
static void *tensor_bytes(const struct manifest *m, const struct tensor_desc *t)
{
	int fd = open(m->files[t->file_index].path, O_RDONLY);
	ck_assert_int_ge(fd, 0);
	void *b = malloc(t->nbytes);
	ck_assert_int_eq(pread(fd, b, t->nbytes, (off_t)t->file_offset), (ssize_t)t->nbytes);
	close(fd);
	return b;
}

static void check_tensor(const struct manifest *m, int idx, const char *name, uint32_t role, uint64_t r, uint64_t c)
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
static void check_all_tensors(const struct manifest *m)
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
static void check_layout(const struct manifest *m)
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
		uint32_t want_class = g->kind == GROUP_ATTN  ? CLASS_ATTN
				      : g->kind == GROUP_FFN ? CLASS_FFN
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

/* ---- good checkpoints ---- */

START_TEST(test_tiny_single_file)
{
	const char *dir = write_tiny("tiny");
	struct manifest *m = load_ok(dir);
	const struct model_config *c = &m->cfg;
	ck_assert_uint_eq(c->arch, ARCH_LLAMA);
	ck_assert_uint_eq(c->dim, 64);
	ck_assert_uint_eq(c->n_layers, 2);
	ck_assert_uint_eq(c->n_heads, 4);
	ck_assert_uint_eq(c->n_kv_heads, 2);
	ck_assert_uint_eq(c->head_dim, 16);
	ck_assert_uint_eq(c->ffn_dim, 192);
	ck_assert_uint_eq(c->vocab_size, 512);
	ck_assert_uint_eq(c->max_position, 4096);
	ck_assert_float_eq(c->rms_eps, 1e-5f);
	ck_assert_float_eq(c->rope_theta, 500000.0f);
	ck_assert_uint_eq(c->rope_scaling, ROPE_SCALING_LLAMA3);
	ck_assert_float_eq(c->rope_factor, 8.0f);
	ck_assert_float_eq(c->rope_low_freq_factor, 1.0f);
	ck_assert_float_eq(c->rope_high_freq_factor, 4.0f);
	ck_assert_uint_eq(c->rope_original_max_position, 8192);
	ck_assert_uint_eq(c->tie_embeddings, 0);
	ck_assert_int_eq(c->bos_id, 1);
	ck_assert_uint_eq(c->n_eos, 1);
	ck_assert_int_eq(c->eos_ids[0], 2);
	ck_assert_uint_eq(c->sliding_window, 0);
	ck_assert_uint_eq(m->n_files, 1);
	ck_assert_uint_eq(m->weight_dtype, DT_BF16);
	ck_assert_str_eq(m->files[0].path, tpath("tiny/model.safetensors"));
	ck_assert_uint_eq(m->files[0].data_start % 8, 0);
	check_all_tensors(m);
	check_layout(m);
	ck_assert_uint_eq(m->total_tensor_bytes, synth_param_count(c, false) * 2);
	manifest_destroy(&m);
	ck_assert_ptr_null(m);
	manifest_destroy(&m); /* twice is fine */
}
END_TEST

START_TEST(test_sharded_same_as_single)
{
	struct model_config c = tiny_cfg();
	struct synth_options o1 = opts(DT_BF16, 3, 1), o3 = opts(DT_BF16, 3, 3), os = opts(DT_BF16, 3, 0);
	os.shard_bytes = 40000; /* transformers-style splitting at a size: many files */
	struct manifest *a = load_ok(write_model("one", &c, &o1));
	struct manifest *b = load_ok(write_model("three", &c, &o3));
	struct manifest *s = load_ok(write_model("small", &c, &os));
	ck_assert_uint_eq(a->n_files, 1);
	ck_assert_uint_eq(b->n_files, 3);
	ck_assert_uint_gt(s->n_files, 3);
	ck_assert_str_eq(b->files[0].path, tpath("three/model-00001-of-00003.safetensors"));
	ck_assert_str_eq(b->files[2].path, tpath("three/model-00003-of-00003.safetensors"));
	ck_assert_uint_eq(a->hash, b->hash);
	ck_assert_uint_eq(a->hash, s->hash);
	ck_assert_mem_eq(&a->cfg, &b->cfg, sizeof(a->cfg));
	ck_assert_uint_eq(a->n_tensors, b->n_tensors);
	ck_assert_uint_eq(a->total_tensor_bytes, b->total_tensor_bytes);
	/* Every shard holds something. */
	for (uint32_t f = 0; f < b->n_files; f++) {
		int used = 0;
		for (uint32_t i = 0; i < b->n_tensors; i++)
			used |= b->tensors[i].file_index == f;
		ck_assert_msg(used, "shard %u is empty", f);
	}
	for (uint32_t i = 0; i < a->n_tensors; i++) {
		const struct tensor_desc *ta = &a->tensors[i], *tb = &b->tensors[i], *ts = &s->tensors[i];
		ck_assert_str_eq(ta->name, tb->name);
		ck_assert_str_eq(ta->name, ts->name);
		ck_assert_uint_eq(ta->group, tb->group);
		ck_assert_uint_eq(ta->role, tb->role);
		ck_assert_uint_eq(ta->nbytes, tb->nbytes);
		void *x = tensor_bytes(a, ta), *y = tensor_bytes(b, tb), *z = tensor_bytes(s, ts);
		ck_assert_msg(memcmp(x, y, ta->nbytes) == 0 && memcmp(x, z, ta->nbytes) == 0,
			      "tensor %s differs between single file and shards", ta->name);
		free(x);
		free(y);
		free(z);
	}
	check_all_tensors(b);
	check_layout(b);
	check_layout(s);
	manifest_destroy(&a);
	manifest_destroy(&b);
	manifest_destroy(&s);
}
END_TEST

START_TEST(test_tied_explicit_head_dim)
{
	struct model_config c = tiny_cfg();
	c.head_dim = 32; /* n_heads * head_dim = 128 != dim 64, as some models have */
	struct synth_options o = opts(DT_BF16, 1, 0);
	o.tied = true;
	struct manifest *m = load_ok(write_model("tied", &c, &o));
	ck_assert_uint_eq(m->cfg.tie_embeddings, 1);
	ck_assert_uint_eq(m->cfg.head_dim, 32);
	check_all_tensors(m);
	check_layout(m);
	check_tensor(m, manifest_find_tensor(m, group_id_attn(0), ROLE_WQ), "model.layers.0.self_attn.q_proj.weight",
		     ROLE_WQ, 128, 64);
	check_tensor(m, manifest_find_tensor(m, group_id_attn(1), ROLE_WO), "model.layers.1.self_attn.o_proj.weight",
		     ROLE_WO, 64, 128);
	/* The runner's lookup over plain copies of the tables agrees. */
	struct tensor_desc *tt = malloc(m->n_tensors * sizeof(*tt));
	struct group_desc *gg = malloc(m->n_groups * sizeof(*gg));
	memcpy(tt, m->tensors, m->n_tensors * sizeof(*tt));
	memcpy(gg, m->groups, m->n_groups * sizeof(*gg));
	ck_assert_int_eq(model_find_tensor(&m->cfg, tt, gg, group_id_head(&m->cfg), ROLE_LM_HEAD), 0);
	ck_assert_int_eq(model_find_tensor(&m->cfg, tt, gg, group_id_ffn(1), ROLE_W_DOWN),
			 manifest_find_tensor(m, group_id_ffn(1), ROLE_W_DOWN));
	ck_assert_int_eq(model_find_tensor(&m->cfg, tt, gg, group_id_attn(0), ROLE_LM_HEAD), -1);
	free(tt);
	free(gg);

	manifest_destroy(&m);
	/* Untie the config of a tied checkpoint: lm_head is now missing. */
	set_config(tpath("tied"), "config.json", "tie_word_embeddings", "false");
	load_fails(tpath("tied"), -EINVAL, "missing tensor lm_head.weight");

	/* An untied checkpoint whose config says tied: the stored lm_head is ignored. */
	struct synth_options ou = opts(DT_BF16, 1, 0);
	const char *dir = write_model("untied", &c, &ou);
	set_config(dir, "config.json", "tie_word_embeddings", "true");
	m = load_ok(dir);
	ck_assert_uint_eq(m->groups[group_id_head(&m->cfg)].n_tensors, 1);
	ck_assert_int_eq(manifest_find_tensor(m, group_id_head(&m->cfg), ROLE_LM_HEAD), 0);
	check_layout(m);
	manifest_destroy(&m);
}
END_TEST

/* f16 and f32 files hold the same draws as bf16, rounded to their type. */
START_TEST(test_f16_f32)
{
	struct model_config c = tiny_cfg();
	static const enum dtype types[] = {DT_F16, DT_F32, DT_BF16};
	for (size_t k = 0; k < sizeof(types) / sizeof(types[0]); k++) {
		struct synth_options o = opts(types[k], 9, k == 1 ? 2 : 0);
		char name[32];
		snprintf(name, sizeof(name), "dt%zu", k);
		struct manifest *m = load_ok(write_model(name, &c, &o));
		ck_assert_uint_eq(m->weight_dtype, types[k]);
		ck_assert_uint_eq(m->total_tensor_bytes, synth_param_count(&c, false) * dtype_size(types[k]));
		check_all_tensors(m);
		check_layout(m);
		for (uint32_t i = 0; i < m->n_tensors; i++) {
			const struct tensor_desc *t = &m->tensors[i];
			ck_assert_uint_eq(t->dtype, types[k]);
			bool norm = t->ndim == 1;
			void *b = tensor_bytes(m, t);
			uint64_t n = t->nbytes / dtype_size(types[k]);
			for (uint64_t e = 0; e < n; e += 1 + e / 3) {
				float want = synth_value(9, t->name, norm, e), got = dtype_get_f32(types[k], b, e);
				float tol = types[k] == DT_F32	 ? 0
					    : types[k] == DT_F16 ? 1e-3f * fabsf(want) + 1e-7f
								 : 8e-3f * fabsf(want);
				ck_assert_msg(fabsf(got - want) <= tol, "%s[%llu] = %g, want %g", t->name,
					      (unsigned long long)e, (double)got, (double)want);
			}
			free(b);
		}
		manifest_destroy(&m);
	}
}
END_TEST

/* Files larger than the writer's 8 MiB buffers: tensors split across buffers at odd element
 * positions still hold exactly synth_value's draws, in every element. */
START_TEST(test_values_across_buffers)
{
	struct model_config c = tiny_cfg();
	c.vocab_size = 40000; /* 2 x 40000 x 64 elements: 10 MB in BF16, 20 MB in F32 */
	static const enum dtype types[] = {DT_BF16, DT_F32};
	for (size_t k = 0; k < 2; k++) {
		struct synth_options o = opts(types[k], 77, 0);
		char name[32];
		snprintf(name, sizeof(name), "big%zu", k);
		struct manifest *m = load_ok(write_model(name, &c, &o));
		ck_assert_uint_gt(m->files[0].size, 9u << 20);
		uint64_t mismatches = 0;
		for (uint32_t i = 0; i < m->n_tensors; i++) {
			const struct tensor_desc *t = &m->tensors[i];
			void *b = tensor_bytes(m, t);
			uint64_t n = t->nbytes / dtype_size(t->dtype);
			for (uint64_t e = 0; e < n; e++) {
				float v = synth_value(77, t->name, t->ndim == 1, e);
				if (types[k] == DT_F32)
					mismatches += ((float *)b)[e] != v;
				else
					mismatches += ((uint16_t *)b)[e] != f32_to_bf16(v);
			}
			free(b);
		}
		ck_assert_uint_eq(mismatches, 0);
		manifest_destroy(&m);
	}
}
END_TEST

START_TEST(test_mha)
{
	struct model_config c = tiny_cfg();
	c.n_kv_heads = c.n_heads;
	struct synth_options o = opts(DT_BF16, 2, 0);
	struct manifest *m = load_ok(write_model("mha", &c, &o));
	ck_assert_uint_eq(m->cfg.n_kv_heads, 4);
	check_all_tensors(m);
	check_tensor(m, manifest_find_tensor(m, group_id_attn(1), ROLE_WK), "model.layers.1.self_attn.k_proj.weight",
		     ROLE_WK, 64, 64);
	check_layout(m);
	manifest_destroy(&m);
	/* num_key_value_heads left out means MHA too. */
	set_config(tpath("mha"), "config.json", "num_key_value_heads", NULL);
	m = load_ok(tpath("mha"));
	ck_assert_uint_eq(m->cfg.n_kv_heads, 4);
	manifest_destroy(&m);
}
END_TEST

START_TEST(test_mistral)
{
	struct model_config c = tiny_cfg();
	c.arch = ARCH_MISTRAL;
	c.sliding_window = 4096;
	c.rope_scaling = ROPE_SCALING_NONE;
	c.rope_theta = 10000.0f;
	struct synth_options o = opts(DT_BF16, 4, 0);
	const char *dir = write_model("mistral", &c, &o);
	struct manifest *m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.arch, ARCH_MISTRAL);
	ck_assert_uint_eq(m->cfg.sliding_window, 4096);
	ck_assert_uint_eq(m->cfg.rope_scaling, ROPE_SCALING_NONE);
	ck_assert_float_eq(m->cfg.rope_theta, 10000.0f);
	check_all_tensors(m);
	manifest_destroy(&m);
	/* rope_scaling "default" and a linear one with the old "type" key. */
	set_config(dir, "config.json", "rope_scaling", "{\"rope_type\": \"default\"}");
	m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.rope_scaling, ROPE_SCALING_NONE);
	manifest_destroy(&m);
	set_config(dir, "config.json", "rope_scaling", "{\"type\": \"linear\", \"factor\": 2.0}");
	m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.rope_scaling, ROPE_SCALING_LINEAR);
	ck_assert_float_eq(m->cfg.rope_factor, 2.0f);
	manifest_destroy(&m);
	/* Defaults: rope_theta 10000, no head_dim key -> dim / heads. */
	set_config(dir, "config.json", "rope_theta", NULL);
	set_config(dir, "config.json", "head_dim", NULL);
	m = load_ok(dir);
	ck_assert_float_eq(m->cfg.rope_theta, 10000.0f);
	ck_assert_uint_eq(m->cfg.head_dim, 16);
	manifest_destroy(&m);
}
END_TEST

/* Larger tensors than tiny's: extents that merge, extents that do not, shards, and a
 * stray inv_freq buffer that is ignored. */
START_TEST(test_layout_invariants)
{
	struct model_config c = tiny_cfg();
	c.dim = 256;
	c.n_heads = 8;
	c.n_kv_heads = 2;
	c.head_dim = 32;
	c.ffn_dim = 704;
	c.vocab_size = 1000;
	c.n_layers = 3;
	for (uint32_t shards = 0; shards <= 4; shards += 4) {
		struct synth_options o = opts(shards ? DT_F32 : DT_BF16, 5, shards);
		char name[32];
		snprintf(name, sizeof(name), "big%u", shards);
		const char *dir = write_model(name, &c, &o);
		struct manifest *m = load_ok(dir);
		ck_assert_uint_eq(m->n_files, shards ? shards : 1);
		check_all_tensors(m);
		check_layout(m);
		/* Some group needs more than one extent and some extent covers more than one tensor. */
		uint32_t multi_ext = 0, merged = 0;
		for (uint32_t g = 0; g < m->n_groups; g++) {
			multi_ext += m->groups[g].n_extents > 1;
			merged += m->groups[g].n_extents < m->groups[g].n_tensors;
		}
		ck_assert_uint_gt(multi_ext, 0);
		ck_assert_uint_gt(merged, 0);
		manifest_destroy(&m);
	}
	/* An old export's rotary inv_freq buffer is skipped. */
	const char *dir = tpath("big0");
	struct tensor_patch p = {"model.layers.2.self_attn.k_proj.weight", NULL, NULL,
				 "model.layers.2.self_attn.rotary_emb.inv_freq"};
	tensor_patch(dir, "model.safetensors", p);
	load_fails(dir, -EINVAL, "missing tensor model.layers.2.self_attn.k_proj.weight");
}
END_TEST

START_TEST(test_generation_config_eos)
{
	const char *dir = write_tiny("gen");
	set_config(dir, "generation_config.json", "eos_token_id", "[2, 7, 9]");
	set_config(dir, "generation_config.json", "bos_token_id", "5");
	struct manifest *m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.n_eos, 3);
	ck_assert_int_eq(m->cfg.eos_ids[0], 2);
	ck_assert_int_eq(m->cfg.eos_ids[1], 7);
	ck_assert_int_eq(m->cfg.eos_ids[2], 9);
	ck_assert_int_eq(m->cfg.bos_id, 5);
	uint64_t h = m->hash;
	manifest_destroy(&m);
	/* A single id, and no generation_config.json at all: config.json's ids. */
	set_config(dir, "generation_config.json", "eos_token_id", "11");
	m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.n_eos, 1);
	ck_assert_int_eq(m->cfg.eos_ids[0], 11);
	ck_assert_uint_ne(m->hash, h); /* the hash covers the config */
	manifest_destroy(&m);
	ck_assert_int_eq(unlink(tpath("gen/generation_config.json")), 0);
	set_config(dir, "config.json", "eos_token_id", "[3, 4]");
	m = load_ok(dir);
	ck_assert_uint_eq(m->cfg.n_eos, 2);
	ck_assert_int_eq(m->cfg.eos_ids[1], 4);
	ck_assert_int_eq(m->cfg.bos_id, 1);
	manifest_destroy(&m);
	set_config(dir, "config.json", "eos_token_id", "[1,2,3,4,5,6,7,8,9]");
	load_fails(dir, -EINVAL, "eos_token_id");
	set_config(dir, "config.json", "eos_token_id", "512");
	load_fails(dir, -EINVAL, "eos_token_id");

	/* The Llama 3 ids as the synthetic writer puts them in both files. */
	struct model_config c;
	char err[256];
	ck_assert_int_eq(synth_shape_config("llama3-8b", &c, err, sizeof(err)), 0);
	c.n_layers = 1;
	c.dim = 32;
	c.n_heads = 2;
	c.n_kv_heads = 1;
	c.head_dim = 16;
	c.ffn_dim = 64;
	struct synth_options o = opts(DT_BF16, 1, 0);
	o.tied = true;
	m = load_ok(write_model("l3ids", &c, &o));
	ck_assert_uint_eq(m->cfg.n_eos, 3);
	ck_assert_int_eq(m->cfg.eos_ids[0], 128001);
	ck_assert_int_eq(m->cfg.eos_ids[1], 128008);
	ck_assert_int_eq(m->cfg.eos_ids[2], 128009);
	ck_assert_int_eq(m->cfg.bos_id, 128000);
	manifest_destroy(&m);
}
END_TEST

/* ---- corrupt and unsupported checkpoints ---- */

START_TEST(test_missing_inputs)
{
	load_fails(tpath("nowhere"), -ENOENT, "does not exist");
	const char *dir = write_tiny("m");
	ck_assert_int_eq(unlink(tpath("m/model.safetensors")), 0);
	load_fails(dir, -ENOENT, "model.safetensors");
	ck_assert_int_eq(unlink(tpath("m/config.json")), 0);
	load_fails(dir, -ENOENT, "config.json");
	/* A file where the directory should be. */
	write_file(tpath("plain"), "x", 1);
	load_fails(tpath("plain"), -ENOTDIR, "not a directory");
}
END_TEST

START_TEST(test_bad_config)
{
	const char *dir = write_tiny("c");
	write_file(tpath("c/config.json"), "{\"hidden_size\": 64,", 19);
	load_fails(dir, -EINVAL, "JSON");

	dir = write_tiny("a");
	set_config(dir, "config.json", "architectures", "[\"Qwen2ForCausalLM\"]");
	load_fails(dir, -ENOTSUP, "Qwen2ForCausalLM");

	dir = write_tiny("r");
	set_config(dir, "config.json", "rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4.0}");
	load_fails(dir, -ENOTSUP, "yarn");

	static const struct {
		const char *key, *json, *word;
		int rc;
	} cases[] = {
		{"hidden_size", "0", "hidden_size", -EINVAL},
		{"hidden_size", "\"64\"", "hidden_size", -EINVAL},
		{"num_hidden_layers", NULL, "num_hidden_layers", -EINVAL},
		{"num_key_value_heads", "3", "num_key_value_heads", -EINVAL},
		{"vocab_size", "-5", "vocab_size", -EINVAL},
		{"rms_norm_eps", "0", "rms_norm_eps", -EINVAL},
		{"attention_bias", "true", "attention_bias", -ENOTSUP},
		{"mlp_bias", "true", "mlp_bias", -ENOTSUP},
		{"hidden_act", "\"gelu\"", "gelu", -ENOTSUP},
		{"bos_token_id", "100000", "bos_token_id", -EINVAL},
		{"rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8.0}", "low_freq_factor", -EINVAL},
		{"rope_scaling", "[1]", "rope_scaling", -EINVAL},
		{"tie_word_embeddings", "1", "tie_word_embeddings", -EINVAL},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char name[32];
		snprintf(name, sizeof(name), "case%zu", i);
		dir = write_tiny(name);
		unlink(tpath("%s/generation_config.json", name)); /* its ids would replace config.json's */
		set_config(dir, "config.json", cases[i].key, cases[i].json);
		load_fails(dir, cases[i].rc, cases[i].word);
	}
	/* head_dim absent and heads not dividing the hidden size. */
	dir = write_tiny("nodiv");
	set_config(dir, "config.json", "head_dim", NULL);
	set_config(dir, "config.json", "num_attention_heads", "6");
	set_config(dir, "config.json", "num_key_value_heads", "2");
	load_fails(dir, -EINVAL, "num_attention_heads");
	/* Config shape differing from the file's tensors. */
	dir = write_tiny("ffn");
	set_config(dir, "config.json", "intermediate_size", "128");
	load_fails(dir, -EINVAL, "down_proj.weight has shape [64, 192], but config.json implies [64, 128]");
}
END_TEST

START_TEST(test_bad_header)
{
	/* Header length past the end of the file. */
	const char *dir = write_tiny("len");
	size_t len;
	unsigned char *b = read_file(tpath("len/model.safetensors"), &len);
	uint64_t n = len + 10;
	for (int i = 0; i < 8; i++)
		b[i] = (unsigned char)(n >> (8 * i));
	write_file(tpath("len/model.safetensors"), b, len);
	load_fails(dir, -EINVAL, "header length");
	/* Zero and absurd lengths. */
	memset(b, 0, 8);
	write_file(tpath("len/model.safetensors"), b, len);
	load_fails(dir, -EINVAL, "header length 0");
	b[6] = 1; /* 2^48 */
	write_file(tpath("len/model.safetensors"), b, len);
	load_fails(dir, -EINVAL, "header length");
	/* A header that is not JSON. */
	b[6] = 0;
	b[0] = 16;
	memcpy(b + 8, "{\"a\": [1, 2, 3 ", 16);
	write_file(tpath("len/model.safetensors"), b, len);
	load_fails(dir, -EINVAL, "JSON");
	/* Shorter than the length field. */
	write_file(tpath("len/model.safetensors"), b, 5);
	load_fails(dir, -EINVAL, "too short");
	free(b);

	/* Truncated data. */
	dir = write_tiny("trunc");
	ck_assert_int_eq(truncate(tpath("trunc/model.safetensors"), (off_t)(len - 100)), 0);
	load_fails(dir, -EINVAL, "truncated");
}
END_TEST

START_TEST(test_bad_tensors)
{
	const char *q = "model.layers.1.self_attn.q_proj.weight";
	const char *dir = write_tiny("off");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "data_offsets", "[0, 10]", NULL});
	load_fails(dir, -EINVAL, "data_offsets");
	dir = write_tiny("rev");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "data_offsets", "[100, 10]", NULL});
	load_fails(dir, -EINVAL, "data_offsets");
	dir = write_tiny("neg");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "data_offsets", "[-2, 8190]", NULL});
	load_fails(dir, -EINVAL, "data_offsets");

	dir = write_tiny("shape");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "shape", "[32, 128]", NULL});
	load_fails(dir, -EINVAL, "shape [32, 128], but config.json implies [64, 64]");
	dir = write_tiny("ndim");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "shape", "[4096]", NULL});
	load_fails(dir, -EINVAL, "shape");

	dir = write_tiny("miss");
	tensor_patch(dir, "model.safetensors",
		     (struct tensor_patch){"model.layers.1.mlp.up_proj.weight", NULL, NULL, NULL});
	load_fails(dir, -EINVAL, "missing tensor model.layers.1.mlp.up_proj.weight");

	static const char *const strays[] = {"model.layers.0.self_attn.q_proj.bias",
					     "model.layers.2.mlp.up_proj.weight", "model.layers.01.mlp.up_proj.weight",
					     "transformer.wte.weight"};
	for (size_t i = 0; i < sizeof(strays) / sizeof(strays[0]); i++) {
		char name[32];
		snprintf(name, sizeof(name), "stray%zu", i);
		dir = write_tiny(name);
		tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, NULL, NULL, strays[i]});
		char want[128];
		snprintf(want, sizeof(want), "unexpected tensor %s", strays[i]);
		load_fails(dir, -EINVAL, want);
	}

	dir = write_tiny("i8");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "dtype", "\"I8\"", NULL});
	load_fails(dir, -ENOTSUP, "I8");
	dir = write_tiny("weird");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){q, "dtype", "\"Q4\"", NULL});
	load_fails(dir, -EINVAL, "Q4");
	/* F32 norms in a BF16 checkpoint are fine: only sizes must agree. */
	dir = write_tiny("f32norm");
	tensor_patch(dir, "model.safetensors", (struct tensor_patch){"model.norm.weight", "dtype", "\"F32\"", NULL});
	load_fails(dir, -EINVAL, "data_offsets"); /* 64 x 4 bytes does not fit the 128 the file gives */
}
END_TEST

START_TEST(test_bad_index)
{
	struct model_config c = tiny_cfg();
	struct synth_options o = opts(DT_BF16, 1, 3);
	const char *dir = write_model("idx", &c, &o);
	/* The index sends a tensor to a shard that does not hold it. */
	struct kv kv = {"model.layers.0.self_attn.q_proj.weight", "\"model-00003-of-00003.safetensors\""};
	char path[600];
	snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
	json_error_t je;
	json_t *root = json_load_file(path, 0, &je);
	json_t *saved = json_deep_copy(root);
	set_key(json_object_get(root, "weight_map"), &kv);
	json_dump_file(root, path, 0);
	json_decref(root);
	load_fails(dir, -EINVAL, "does not hold it");
	/* A file name that leaves the directory. */
	root = json_deep_copy(saved);
	kv.json = "\"../model-00001-of-00003.safetensors\"";
	set_key(json_object_get(root, "weight_map"), &kv);
	json_dump_file(root, path, 0);
	json_decref(root);
	load_fails(dir, -EINVAL, "plain file name");
	/* A tensor the index does not list. */
	root = json_deep_copy(saved);
	kv.json = NULL;
	set_key(json_object_get(root, "weight_map"), &kv);
	json_dump_file(root, path, 0);
	json_decref(root);
	load_fails(dir, -EINVAL, "does not list");
	/* An unexpected name in the index. */
	root = json_deep_copy(saved);
	kv.key = "model.layers.7.mlp.up_proj.weight";
	kv.json = "\"model-00001-of-00003.safetensors\"";
	set_key(json_object_get(root, "weight_map"), &kv);
	json_dump_file(root, path, 0);
	json_decref(root);
	load_fails(dir, -EINVAL, "unexpected tensor model.layers.7.mlp.up_proj.weight");
	/* A shard that is gone. */
	json_dump_file(saved, path, 0);
	ck_assert_int_eq(unlink(tpath("idx/model-00002-of-00003.safetensors")), 0);
	load_fails(dir, -ENOENT, "model-00002-of-00003.safetensors");
	/* Bad JSON. */
	write_file(path, "{", 1);
	load_fails(dir, -EINVAL, "JSON");
	json_decref(saved);
}
END_TEST

/* ---- the synthetic writer ---- */

START_TEST(test_shapes)
{
	struct model_config c;
	char err[256];
	ck_assert_int_eq(synth_shape_config("llama3-8b", &c, err, sizeof(err)), 0);
	ck_assert_int_eq(model_config_check(&c, err, sizeof(err)), 0);
	ck_assert_uint_eq(synth_param_count(&c, false), 8030261248ull); /* Meta-Llama-3-8B */
	ck_assert_uint_eq(c.n_eos, 3);
	ck_assert_uint_eq(c.max_position, 131072);
	ck_assert_int_eq(synth_shape_config("llama3-70b", &c, err, sizeof(err)), 0);
	ck_assert_uint_eq(synth_param_count(&c, false), 70553706496ull); /* Meta-Llama-3-70B */
	ck_assert_uint_eq(c.n_layers, 80);
	ck_assert_int_eq(synth_shape_config("llama3-70b:3", &c, err, sizeof(err)), 0);
	ck_assert_uint_eq(c.n_layers, 3);
	ck_assert_uint_eq(c.dim, 8192);
	ck_assert_uint_eq(c.head_dim, 128);
	ck_assert_int_eq(synth_shape_config("tiny", &c, err, sizeof(err)), 0);
	ck_assert_int_eq(model_config_check(&c, err, sizeof(err)), 0);
	static const char *const bad[] = {"llama3-70b:0", "llama3-70b:81", "llama3-70b:", "llama3-70bx", "gpt2", ""};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		err[0] = 0;
		ck_assert_int_eq(synth_shape_config(bad[i], &c, err, sizeof(err)), -EINVAL);
		ck_assert_msg(strlen(err) > 0, "no message for %s", bad[i]);
	}
	c = tiny_cfg();
	ck_assert_int_eq(synth_parse_rope_scaling("linear:4", &c, err, sizeof(err)), 0);
	ck_assert_uint_eq(c.rope_scaling, ROPE_SCALING_LINEAR);
	ck_assert_float_eq(c.rope_factor, 4.0f);
	ck_assert_int_eq(synth_parse_rope_scaling("none", &c, err, sizeof(err)), 0);
	ck_assert_uint_eq(c.rope_scaling, ROPE_SCALING_NONE);
	ck_assert_int_eq(synth_parse_rope_scaling("llama3", &c, err, sizeof(err)), 0);
	ck_assert_uint_eq(c.rope_original_max_position, 8192);
	ck_assert_int_eq(synth_parse_rope_scaling("linear:-1", &c, err, sizeof(err)), -EINVAL);
	ck_assert_int_eq(synth_parse_rope_scaling("yarn", &c, err, sizeof(err)), -EINVAL);
	/* A bad config is refused before anything is written. */
	c = tiny_cfg();
	c.n_kv_heads = 3;
	struct synth_options o = opts(DT_BF16, 1, 0);
	ck_assert_int_eq(synth_write(tpath("bad"), &c, &o, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(err, "num_key_value_heads"));
	ck_assert_int_eq(access(tpath("bad"), F_OK), -1);
	c = tiny_cfg();
	o.shards = 100; /* more shards than tensors */
	ck_assert_int_eq(synth_write(tpath("bad"), &c, &o, err, sizeof(err)), -EINVAL);
}
END_TEST

START_TEST(test_deterministic)
{
	struct model_config c = tiny_cfg();
	struct synth_options o = opts(DT_BF16, 42, 2);
	write_model("d1", &c, &o);
	write_model("d2", &c, &o);
	o.seed = 43;
	write_model("d3", &c, &o);
	static const char *const files[] = {"config.json", "generation_config.json", "model.safetensors.index.json",
					    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
	for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
		size_t l1, l2, l3;
		char *a = read_file(tpath("d1/%s", files[i]), &l1);
		char *b = read_file(tpath("d2/%s", files[i]), &l2);
		char *d = read_file(tpath("d3/%s", files[i]), &l3);
		ck_assert_uint_eq(l1, l2);
		ck_assert_msg(memcmp(a, b, l1) == 0, "%s differs for one seed", files[i]);
		if (strstr(files[i], "-of-"))
			ck_assert_msg(l1 != l3 || memcmp(a, d, l1) != 0, "%s is the same for two seeds", files[i]);
		free(a);
		free(b);
		free(d);
	}
	/* The draws look like N(0, 0.02) for matrices and 1 + N(0, 0.02) for norms, and differ. */
	struct manifest *m = load_ok(tpath("d1"));
	int gi = manifest_find_tensor(m, group_id_ffn(0), ROLE_W_UP);
	uint16_t *w = tensor_bytes(m, &m->tensors[gi]);
	uint64_t n = m->tensors[gi].nbytes / 2;
	double s = 0, s2 = 0;
	for (uint64_t i = 0; i < n; i++) {
		double v = bf16_to_f32(w[i]);
		s += v;
		s2 += v * v;
	}
	double mean = s / (double)n, sd = sqrt(s2 / (double)n - mean * mean);
	ck_assert_msg(fabs(mean) < 0.002 && sd > 0.018 && sd < 0.022, "mean %g sd %g", mean, sd);
	free(w);
	int ni = manifest_find_tensor(m, group_id_attn(1), ROLE_ATTN_NORM);
	uint16_t *nw = tensor_bytes(m, &m->tensors[ni]);
	int distinct = 0;
	for (uint32_t i = 0; i < 64; i++) {
		float v = bf16_to_f32(nw[i]);
		ck_assert(v > 0.85f && v < 1.15f);
		distinct += i && nw[i] != nw[0];
	}
	ck_assert_int_gt(distinct, 10);
	free(nw);
	manifest_destroy(&m);
}
END_TEST

START_TEST(test_rewrite_removes_stale)
{
	struct model_config c = tiny_cfg();
	struct synth_options o = opts(DT_BF16, 1, 3);
	const char *dir = write_model("re", &c, &o);
	write_file(tpath("re/notes.txt"), "keep", 4);
	o.shards = 1;
	write_model("re", &c, &o);
	ck_assert_int_eq(access(tpath("re/model.safetensors.index.json"), F_OK), -1);
	ck_assert_int_eq(access(tpath("re/model-00001-of-00003.safetensors"), F_OK), -1);
	ck_assert_int_eq(access(tpath("re/notes.txt"), F_OK), 0);
	struct manifest *m = load_ok(dir);
	ck_assert_uint_eq(m->n_files, 1);
	manifest_destroy(&m);
	o.shards = 2;
	write_model("re", &c, &o);
	ck_assert_int_eq(access(tpath("re/model.safetensors"), F_OK), -1);
	m = load_ok(dir);
	ck_assert_uint_eq(m->n_files, 2);
	manifest_destroy(&m);
}
END_TEST

/* A write that fails part way (the file size limit stands in for a full disk) leaves nothing. */
START_TEST(test_write_failure_cleans_up)
{
	signal(SIGXFSZ, SIG_IGN);
	struct rlimit saved, rl = {100000, 100000};
	ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &saved), 0);
	rl.rlim_max = saved.rlim_max;
	ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
	struct model_config c = tiny_cfg();
	struct synth_options o = opts(DT_F32, 1, 0);
	char err[512] = "";
	const char *dir = tpath("deep/er/model");
	int rc = synth_write(dir, &c, &o, err, sizeof(err));
	setrlimit(RLIMIT_FSIZE, &saved); /* so a CK_FORK=no run can go on */
	ck_assert_int_eq(rc, -EFBIG);
	ck_assert_msg(strstr(err, "model.safetensors") != NULL, "message \"%s\" does not name the file", err);
	ck_assert_int_eq(access(tpath("deep"), F_OK), -1); /* the directories it made are gone too */
	/* Under a path that cannot be a directory. */
	write_file(tpath("file"), "x", 1);
	rc = synth_write(tpath("file/model"), &c, &o, err, sizeof(err));
	ck_assert_int_lt(rc, 0);
	ck_assert_ptr_nonnull(strstr(err, "file"));
}
END_TEST

/* Runs the tool with args; returns its exit status. */
static int run_tool(const char *const *args)
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
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		char *argv[32];
		int n = 0;
		argv[n++] = exe;
		for (; args[n - 1]; n++)
			argv[n] = (char *)args[n - 1];
		argv[n] = NULL;
		int null = open("/dev/null", O_WRONLY);
		dup2(null, 1);
		dup2(null, 2);
		execv(exe, argv);
		_exit(127);
	}
	int st;
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert(WIFEXITED(st));
	ck_assert_msg(WEXITSTATUS(st) != 127, "cannot run %s", exe);
	return WEXITSTATUS(st);
}

START_TEST(test_tool)
{
	const char *out = tpath("tool");
	ck_assert_int_eq(run_tool((const char *[]){"--help", NULL}), 0);
	ck_assert_int_eq(run_tool((const char *[]){NULL}), 2);
	ck_assert_int_eq(run_tool((const char *[]){"--shape", "gpt2", "--out", out, NULL}), 2);
	ck_assert_int_eq(run_tool((const char *[]){"--shape", "tiny", "--out", out, "--dtype", "i8", NULL}), 2);
	ck_assert_int_eq(run_tool((const char *[]){"--shape", "tiny", "--out", out, "--kv-heads", "3", NULL}), 2);
	ck_assert_int_eq(run_tool((const char *[]){"--shape", "tiny", "--out", out, "--bogus", NULL}), 2);
	ck_assert_int_eq(run_tool((const char *[]){"--shape", "tiny", "--out", out, "--quiet", NULL}), 0);
	ck_assert_int_eq(run_tool((const char *[]){"--shape", "tiny", "--out", out, NULL}), 1); /* exists */
	/* Every override at once, over an existing checkpoint. */
	/* clang-format off */
	const char *const all[] = {"--shape", "llama3-70b:2", "--out", out, "--force", "--quiet", "--dim", "128",
				   "--heads", "4", "--mha", "--ffn", "256", "--vocab", "300", "--layers", "3",
				   "--arch", "mistral", "--rope-scaling", "linear:2", "--tied", "--dtype", "f16",
				   "--shards", "2", "--seed", "7", NULL};
	/* clang-format on */
	ck_assert_int_eq(run_tool(all), 0);
	struct manifest *m = load_ok(out);
	ck_assert_uint_eq(m->cfg.arch, ARCH_MISTRAL);
	ck_assert_uint_eq(m->cfg.n_layers, 3);
	ck_assert_uint_eq(m->cfg.dim, 128);
	ck_assert_uint_eq(m->cfg.n_heads, 4);
	ck_assert_uint_eq(m->cfg.n_kv_heads, 4);
	ck_assert_uint_eq(m->cfg.head_dim, 32);
	ck_assert_uint_eq(m->cfg.ffn_dim, 256);
	ck_assert_uint_eq(m->cfg.vocab_size, 300);
	ck_assert_uint_eq(m->cfg.tie_embeddings, 1);
	ck_assert_uint_eq(m->cfg.rope_scaling, ROPE_SCALING_LINEAR);
	ck_assert_uint_eq(m->weight_dtype, DT_F16);
	ck_assert_uint_eq(m->n_files, 2);
	for (uint32_t i = 0; i < m->cfg.n_eos; i++)
		ck_assert_int_lt(m->cfg.eos_ids[i], 300);
	ck_assert_int_lt(m->cfg.bos_id, 300);
	check_all_tensors(m);
	check_layout(m);
	manifest_destroy(&m);
}
END_TEST

static Suite *manifest_suite(void)
{
	Suite *s = suite_create("manifest");
	struct {
		const char *name;
		const TTest *tests[8];
	} cases[] = {
		{"good",
		 {test_tiny_single_file, test_sharded_same_as_single, test_tied_explicit_head_dim, test_f16_f32,
		  test_values_across_buffers, test_mha, test_mistral, NULL}},
		{"layout", {test_layout_invariants, NULL}},
		{"generation_config", {test_generation_config_eos, NULL}},
		{"missing", {test_missing_inputs, NULL}},
		{"config", {test_bad_config, NULL}},
		{"header", {test_bad_header, test_bad_tensors, test_bad_index, NULL}},
		{"synthetic",
		 {test_shapes, test_deterministic, test_rewrite_removes_stale, test_write_failure_cleans_up, NULL}},
		{"tool", {test_tool, NULL}},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		TCase *tc = tcase_create(cases[i].name);
		tcase_add_unchecked_fixture(tc, case_setup, case_teardown);
		tcase_add_checked_fixture(tc, setup, teardown);
		tcase_set_timeout(tc, 60);
		for (int k = 0; cases[i].tests[k]; k++)
			tcase_add_test(tc, cases[i].tests[k]);
		suite_add_tcase(s, tc);
	}
	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(manifest_suite());
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? 1 : 0;
}

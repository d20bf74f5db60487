/* manifest_safetensors.c - the safetensors files: the index (which file holds which tensor) and
 * each file's header, every tensor entry checked against the configuration and put in its slot. */
#include "common/manifest_internal.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util.h"

#define HEADER_MAX (100ull << 20) /* a safetensors header above this is corrupt, not big */

static int name_is_plain(const char *s)
{
	return *s && strcmp(s, ".") && strcmp(s, "..") && !strchr(s, '/') && strlen(s) < NAME_MAX;
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

static uint32_t file_lookup(const struct loader *ld, const char *name)
{
	for (uint32_t i = 0; i < ld->m->n_files; i++)
		if (!strcmp(ld->file_names[i], name))
			return i;
	return NO_FILE;
}

/* model.safetensors.index.json: the files (sorted by name, each once) and, per tensor, its file. */
int mf_read_index(struct loader *ld, const char *path)
{
	struct manifest *m = ld->m;
	json_error_t je;
	json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
	if (!root)
		return errorf(ld->err, ld->errlen, -EINVAL, "%s: bad JSON at line %d column %d: %s", path, je.line,
			    je.column, je.text);
	int rc = 0;
	json_t *wm = json_is_object(root) ? json_object_get(root, "weight_map") : NULL;
	if (!json_is_object(wm)) {
		rc = errorf(ld->err, ld->errlen, -EINVAL, "%s: missing weight_map object", path);
		goto out_root;
	}
	size_t n = json_object_size(wm);
	ld->file_names = calloc(n ? n : 1, sizeof(*ld->file_names));
	if (!ld->file_names) {
		rc = errorf(ld->err, ld->errlen, -ENOMEM, "out of memory reading %s", path);
		goto out_root;
	}
	const char *key;
	json_t *val;
	/* Pass 1: the distinct file names. */
	json_object_foreach(wm, key, val) {
		if (!json_is_string(val) || !name_is_plain(json_string_value(val))) {
			rc = errorf(ld->err, ld->errlen, -EINVAL,
				  "%s: weight_map entry for %s must be a plain file name inside the model directory "
				  "(no '/' or '..')",
				  path, key);
			goto out_root;
		}
		if (file_lookup(ld, json_string_value(val)) != NO_FILE)
			continue;
		ld->file_names[m->n_files] = strdup(json_string_value(val));
		if (!ld->file_names[m->n_files]) {
			rc = errorf(ld->err, ld->errlen, -ENOMEM, "out of memory reading %s", path);
			goto out_root;
		}
		m->n_files++;
	}
	if (m->n_files == 0) {
		rc = errorf(ld->err, ld->errlen, -EINVAL, "%s: weight_map is empty", path);
		goto out_root;
	}
	qsort(ld->file_names, m->n_files, sizeof(*ld->file_names), cmp_str);
	/* Pass 2: which file each tensor lives in. */
	json_object_foreach(wm, key, val) {
		uint32_t slot;
		enum name_class nc = mf_classify(&m->cfg, key, &slot);
		if (nc == NAME_UNEXPECTED) {
			rc = errorf(ld->err, ld->errlen, -EINVAL, "%s: unexpected tensor %s (not part of a %u-layer %s)",
				  path, key, m->cfg.n_layers, model_arch_name(m->cfg.arch));
			goto out_root;
		}
		if (nc == NAME_SLOT)
			ld->index_file[slot] = file_lookup(ld, json_string_value(val));
	}
out_root:
	json_decref(root);
	return rc;
}

static int parse_u64_pair(const json_t *a, uint64_t *x, uint64_t *y)
{
	if (!json_is_array(a) || json_array_size(a) != 2)
		return -1;
	const json_t *v0 = json_array_get(a, 0), *v1 = json_array_get(a, 1);
	if (!json_is_integer(v0) || !json_is_integer(v1) || json_integer_value(v0) < 0 || json_integer_value(v1) < 0)
		return -1;
	*x = (uint64_t)json_integer_value(v0);
	*y = (uint64_t)json_integer_value(v1);
	return 0;
}

/* Checks one header entry and, for a tensor the model uses, records it in its slot. */
static int read_tensor_entry(struct loader *ld, uint32_t fi, const char *name, const json_t *e)
{
	struct manifest *m = ld->m;
	const struct manifest_file *mf = &m->files[fi];
	const char *fname = ld->file_names[fi];
	char *err = ld->err;
	size_t errlen = ld->errlen;
	uint32_t slot = 0;
	enum name_class nc = mf_classify(&m->cfg, name, &slot);
	if (nc == NAME_UNEXPECTED)
		return errorf(err, errlen, -EINVAL, "%s: unexpected tensor %s (not part of a %u-layer %s)", fname, name,
			    m->cfg.n_layers, model_arch_name(m->cfg.arch));
	if (!json_is_object(e))
		return errorf(err, errlen, -EINVAL, "%s: header entry %s must be an object", fname, name);
	const json_t *jd = json_object_get(e, "dtype"), *js = json_object_get(e, "shape");
	const json_t *jo = json_object_get(e, "data_offsets");
	if (!json_is_string(jd) || !json_is_array(js) || !jo)
		return errorf(err, errlen, -EINVAL, "%s: tensor %s needs dtype, shape and data_offsets", fname, name);
	uint64_t begin, end;
	if (parse_u64_pair(jo, &begin, &end))
		return errorf(err, errlen, -EINVAL,
			    "%s: tensor %s: data_offsets must be [begin, end], two non-negative "
			    "integers",
			    fname, name);
	uint64_t data_len = mf->size - mf->data_start;
	if (begin > end)
		return errorf(err, errlen, -EINVAL, "%s: tensor %s: data_offsets [%llu, %llu] end before they begin",
			    fname, name, (unsigned long long)begin, (unsigned long long)end);
	if (end > data_len)
		return errorf(err, errlen, -EINVAL,
			    "%s: tensor %s: data_offsets [%llu, %llu] run past the end of the data (%llu bytes): the "
			    "file is truncated or the header is corrupt",
			    fname, name, (unsigned long long)begin, (unsigned long long)end,
			    (unsigned long long)data_len);
	if (nc == NAME_IGNORE)
		return 0; /* bounds checked; its dtype and shape do not matter to us */

	enum dtype dt;
	int rc = dtype_parse(json_string_value(jd), &dt);
	if (rc == -ENOTSUP)
		return errorf(err, errlen, -ENOTSUP,
			    "%s: tensor %s has dtype %s, which is not supported (supported: BF16, F16, F32)", fname,
			    name, json_string_value(jd));
	if (rc)
		return errorf(err, errlen, -EINVAL, "%s: tensor %s has unknown dtype \"%s\"", fname, name,
			    json_string_value(jd));
	uint64_t shape[8] = {0};
	size_t ndim = json_array_size(js);
	if (ndim > ARRAY_SIZE(shape))
		return errorf(err, errlen, -EINVAL, "%s: tensor %s has %zu dimensions", fname, name, ndim);
	uint64_t count = 1;
	for (size_t i = 0; i < ndim; i++) {
		const json_t *d = json_array_get(js, i);
		if (!json_is_integer(d) || json_integer_value(d) < 0 || json_integer_value(d) > (1ll << 40))
			return errorf(err, errlen, -EINVAL, "%s: tensor %s: shape must hold non-negative integers", fname,
				    name);
		shape[i] = (uint64_t)json_integer_value(d);
		if (__builtin_mul_overflow(count, shape[i], &count))
			return errorf(err, errlen, -EINVAL, "%s: tensor %s: shape overflows", fname, name);
	}
	uint32_t role, group, want_ndim;
	uint64_t want[2];
	char want_name[TENSOR_NAME_MAX];
	mf_slot_info(&m->cfg, slot, &role, &group, want_name, sizeof(want_name));
	int src = model_expected_shape(&m->cfg, (enum tensor_role)role, &want_ndim, want);
	assert(src == 0);
	(void)src;
	if (ndim != want_ndim || shape[0] != want[0] || (want_ndim == 2 && shape[1] != want[1])) {
		char got_s[128], want_s[64];
		mf_format_shape(got_s, sizeof(got_s), shape, (uint32_t)ndim);
		mf_format_shape(want_s, sizeof(want_s), want, want_ndim);
		return errorf(err, errlen, -EINVAL, "%s: tensor %s has shape %s, but config.json implies %s", fname, name,
			    got_s, want_s);
	}
	uint64_t nbytes = count * dtype_size(dt);
	if (end - begin != nbytes)
		return errorf(err, errlen, -EINVAL,
			    "%s: tensor %s: data_offsets [%llu, %llu] hold %llu bytes, but %s of shape [%llu%s] needs "
			    "%llu",
			    fname, name, (unsigned long long)begin, (unsigned long long)end,
			    (unsigned long long)(end - begin), dtype_name(dt), (unsigned long long)shape[0],
			    ndim == 2 ? ", ..." : "", (unsigned long long)nbytes);

	if (ld->have_index) {
		if (ld->index_file[slot] == NO_FILE)
			return errorf(err, errlen, -EINVAL, "%s holds tensor %s, which %s does not list", fname, name,
				    INDEX_NAME);
		if (ld->index_file[slot] != fi)
			return 0; /* a stray copy: the index says where the tensor is */
	}
	if (ld->found[slot])
		return errorf(err, errlen, -EINVAL, "tensor %s appears twice", name); /* single file: JSON forbids it */
	struct tensor_desc *t = &m->tensors[slot];
	memset(t, 0, sizeof(*t));
	str_copy(t->name, sizeof(t->name), want_name);
	t->group = group;
	t->role = role;
	t->dtype = dt;
	t->ndim = want_ndim;
	t->shape[0] = shape[0];
	t->shape[1] = want_ndim == 2 ? shape[1] : 0;
	t->nbytes = nbytes;
	t->file_index = fi;
	t->file_offset = mf->data_start + begin;
	ld->found[slot] = true;
	return 0;
}

/* Opens file fi, reads and checks its header, records its tensors. */
int mf_read_safetensors(struct loader *ld, uint32_t fi)
{
	struct manifest_file *mf = &ld->m->files[fi];
	const char *fname = ld->file_names[fi];
	char *err = ld->err;
	size_t errlen = ld->errlen;
	int rc = 0;
	char *hdr = NULL;
	json_t *root = NULL;

	int fd = open(mf->path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		rc = -errno;
		return errorf(err, errlen, rc, "%s: cannot open: %s%s", mf->path, strerror(-rc),
			    ld->have_index ? " (named in " INDEX_NAME ")" : "");
	}
	struct stat st;
	if (fstat(fd, &st) != 0) {
		rc = errorf(err, errlen, -errno, "%s: stat: %s", mf->path, strerror(errno));
		goto out_close;
	}
	if (!S_ISREG(st.st_mode)) {
		rc = errorf(err, errlen, -EINVAL, "%s: not a regular file", mf->path);
		goto out_close;
	}
	mf->size = (uint64_t)st.st_size;
	file_id_of(&st, &mf->id);
	unsigned char lenbuf[8];
	if (mf->size < 8 || pread(fd, lenbuf, 8, 0) != 8) {
		rc = errorf(err, errlen, -EINVAL, "%s: too short for a safetensors file (%llu bytes)", fname,
			  (unsigned long long)mf->size);
		goto out_close;
	}
	uint64_t n = 0;
	for (int i = 7; i >= 0; i--)
		n = (n << 8) | lenbuf[i];
	if (n == 0 || n > HEADER_MAX) {
		rc = errorf(err, errlen, -EINVAL, "%s: header length %llu is invalid (must be 1 .. 100 MiB)", fname,
			  (unsigned long long)n);
		goto out_close;
	}
	if (8 + n > mf->size) {
		rc = errorf(err, errlen, -EINVAL, "%s: header length %llu runs past the end of the file (%llu bytes)",
			  fname, (unsigned long long)n, (unsigned long long)mf->size);
		goto out_close;
	}
	mf->data_start = 8 + n;
	hdr = malloc(n);
	if (!hdr) {
		rc = errorf(err, errlen, -ENOMEM, "%s: out of memory for a %llu-byte header", fname,
			  (unsigned long long)n);
		goto out_close;
	}
	ssize_t got = pread(fd, hdr, n, 8);
	if (got != (ssize_t)n) {
		rc = errorf(err, errlen, got < 0 ? -errno : -EIO, "%s: reading the header: %s", fname,
			  got < 0 ? strerror(errno) : "short read");
		goto out_free;
	}
	json_error_t je;
	root = json_loadb(hdr, n, JSON_REJECT_DUPLICATES, &je);
	if (!root) {
		rc = errorf(err, errlen, -EINVAL, "%s: bad JSON header at column %d: %s", fname, je.column, je.text);
		goto out_free;
	}
	if (!json_is_object(root)) {
		rc = errorf(err, errlen, -EINVAL, "%s: the header must be a JSON object", fname);
		goto out_json;
	}
	const char *key;
	json_t *val;
	json_object_foreach(root, key, val) {
		if (!strcmp(key, "__metadata__"))
			continue;
		rc = read_tensor_entry(ld, fi, key, val);
		if (rc)
			goto out_json;
	}
out_json:
	json_decref(root);
out_free:
	free(hdr);
out_close:
	close(fd);
	return rc;
}

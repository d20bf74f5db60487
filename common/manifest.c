/* manifest.c - reads a checkpoint into a manifest: which kind path is (a Hugging Face Llama/Mistral
 * directory, a GGUF file or a directory holding one), the Hugging Face parts in order
 * (manifest_internal.h says which file does what; manifest_gguf.c reads GGUF), the tokenizer.json
 * that goes with it, and the manifest's lifetime. */
#include "common/manifest_internal.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/gguf.h"
#include "common/tokenizer/ids.h"
#include "common/util.h"

static void loader_free(struct loader *ld)
{
	if (ld->file_names)
		for (uint32_t i = 0; i < ld->m->n_files; i++)
			free(ld->file_names[i]);
	free(ld->file_names);
	free(ld->index_file);
	free(ld->found);
}

/* A GGUF checkpoint: the file at path, or the one a directory without safetensors holds. */
static int load_gguf(const char *path, struct manifest **out, char *err, size_t errlen)
{
	struct manifest *m = calloc(1, sizeof(*m));
	if (!m)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	int rc = mf_load_gguf(m, path, err, errlen);
	if (rc)
		manifest_destroy(&m);
	*out = m;
	return rc;
}

/* Does dir hold a safetensors checkpoint? */
static bool has_safetensors(const char *dir)
{
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/%s", dir, INDEX_NAME);
	if (access(path, F_OK) == 0)
		return true;
	snprintf(path, sizeof(path), "%s/%s", dir, SINGLE_NAME);
	return access(path, F_OK) == 0;
}

int manifest_load(const char *dir, struct manifest **out, char *err, size_t errlen)
{
	assert(dir && out);
	*out = NULL;
	struct stat st;
	if (stat(dir, &st) != 0) {
		int e = errno;
		return errorf(err, errlen, -e, "model directory %s %s", dir,
			    e == ENOENT ? "does not exist" : strerror(e));
	}
	if (!S_ISDIR(st.st_mode)) {
		int probe = gguf_probe(dir);
		if (probe == 1)
			return load_gguf(dir, out, err, errlen);
		if (probe < 0)
			return errorf(err, errlen, probe, "model file %s: %s", dir, strerror(-probe));
		return errorf(err, errlen, -ENOTDIR,
			      "model path %s is not a directory and not a GGUF file (it does not start with \"GGUF\")",
			      dir);
	}
	if (!has_safetensors(dir)) {
		char path[PATH_MAX];
		int found = mf_find_gguf(dir, path, sizeof(path), err, errlen);
		if (found < 0)
			return found;
		if (found)
			return load_gguf(path, out, err, errlen);
	}

	struct manifest *m = calloc(1, sizeof(*m));
	if (!m)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	struct loader ld = {.dir = dir, .m = m, .err = err, .errlen = errlen};
	int rc = mf_load_config(dir, &m->cfg, err, errlen);
	if (rc)
		goto out_free;

	uint32_t ns = mf_n_slots(&m->cfg);
	m->n_tensors = ns;
	m->tensors = calloc(ns, sizeof(*m->tensors));
	ld.index_file = malloc(ns * sizeof(*ld.index_file));
	ld.found = calloc(ns, sizeof(*ld.found));
	if (!m->tensors || !ld.index_file || !ld.found) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out_free;
	}
	for (uint32_t s = 0; s < ns; s++)
		ld.index_file[s] = NO_FILE;

	char path[PATH_MAX];
	if (snprintf(path, sizeof(path), "%s/%s", dir, INDEX_NAME) >= (int)sizeof(path)) {
		rc = errorf(err, errlen, -ENAMETOOLONG, "%s: path too long", dir);
		goto out_free;
	}
	if (access(path, F_OK) == 0) {
		ld.have_index = true;
		rc = mf_read_index(&ld, path);
		if (rc)
			goto out_free;
	} else {
		snprintf(path, sizeof(path), "%s/%s", dir, SINGLE_NAME);
		if (access(path, F_OK) != 0) {
			rc = errorf(err, errlen, -ENOENT, "%s holds neither %s nor %s: no weights to load", dir,
				  INDEX_NAME, SINGLE_NAME);
			goto out_free;
		}
		ld.file_names = calloc(1, sizeof(*ld.file_names));
		if (!ld.file_names || !(ld.file_names[0] = strdup(SINGLE_NAME))) {
			rc = errorf(err, errlen, -ENOMEM, "out of memory");
			goto out_free;
		}
		m->n_files = 1;
	}

	m->files = calloc(m->n_files, sizeof(*m->files));
	if (!m->files) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out_free;
	}
	for (uint32_t i = 0; i < m->n_files; i++) {
		if (snprintf(m->files[i].path, sizeof(m->files[i].path), "%s/%s", dir, ld.file_names[i]) >=
		    (int)sizeof(m->files[i].path)) {
			rc = errorf(err, errlen, -ENAMETOOLONG, "%s/%s: path too long", dir, ld.file_names[i]);
			goto out_free;
		}
		rc = mf_read_safetensors(&ld, i);
		if (rc)
			goto out_free;
	}
	for (uint32_t s = 0; s < ns; s++) {
		if (ld.found[s])
			continue;
		uint32_t role, group;
		char name[TENSOR_NAME_MAX];
		mf_slot_info(&m->cfg, s, &role, &group, name, sizeof(name));
		if (ld.have_index && ld.index_file[s] != NO_FILE)
			rc = errorf(err, errlen, -EINVAL, "%s puts tensor %s in %s, but that file does not hold it",
				  INDEX_NAME, name, ld.file_names[ld.index_file[s]]);
		else
			rc = errorf(err, errlen, -EINVAL, "missing tensor %s (config.json: %u layers, %s embeddings)",
				  name, m->cfg.n_layers, m->cfg.tie_embeddings ? "tied" : "untied");
		goto out_free;
	}
	rc = mf_build_layout(m);
	if (rc) {
		errorf(err, errlen, rc, "out of memory laying out %s", dir);
		goto out_free;
	}
	mf_finish_summary(m);
	snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
	if (access(path, F_OK) == 0 && (rc = manifest_attach_tokenizer(m, path, err, errlen)) != 0)
		goto out_free;
	if ((rc = mf_hf_chat_template(m, dir, err, errlen)) != 0)
		goto out_free;
	loader_free(&ld);
	*out = m;
	return 0;

out_free:
	loader_free(&ld);
	manifest_destroy(&m);
	return rc;
}

/* Reads a whole regular file of at most max bytes into *out (NUL-terminated, owned by the
 * caller); what names it in messages ("tokenizer", "chat template"). Returns 0 or -errno with a
 * message (-EFBIG past max, -EINVAL for a file that is not regular). */
int mf_read_file(const char *what, const char *path, size_t max, char **out, size_t *len, char *err, size_t errlen)
{
	*out = NULL;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errorf(err, errlen, -errno, "%s %s: %s", what, path, strerror(errno));
	struct stat st;
	int rc = 0;
	char *data = NULL;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		rc = errorf(err, errlen, -EINVAL, "%s %s is not a regular file", what, path);
		goto out;
	}
	if ((uint64_t)st.st_size > max) {
		rc = errorf(err, errlen, -EFBIG, "%s %s is larger than %zu bytes", what, path, max);
		goto out;
	}
	if (!(data = malloc((size_t)st.st_size + 1))) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out;
	}
	size_t done = 0;
	while (done < (size_t)st.st_size) {
		ssize_t n = pread(fd, data + done, (size_t)st.st_size - done, (off_t)done);
		if (n <= 0) {
			rc = errorf(err, errlen, n < 0 ? -errno : -EIO, "reading %s %s: %s", what, path,
				    n < 0 ? strerror(errno) : "short read");
			goto out;
		}
		done += (size_t)n;
	}
	data[done] = 0;
	*out = data;
	*len = done;
	data = NULL;
out:
	free(data);
	close(fd);
	return rc;
}

int manifest_attach_tokenizer(struct manifest *m, const char *path, char *err, size_t errlen)
{
	char *data;
	size_t len;
	int rc = mf_read_file("tokenizer", path, 256u << 20, &data, &len, err, errlen);
	if (rc)
		return rc;
	rc = mf_attach_tokenizer_bytes(m, path, "the model's", &data, len, err, errlen);
	free(data);
	return rc;
}

int mf_attach_tokenizer_bytes(struct manifest *m, const char *name, const char *vocab_from, char **data, size_t len,
			      char *err, size_t errlen)
{
	char *d = *data;
	*data = NULL;
	uint32_t tv;
	int rc = tokenizer_ids_scan(name, d, len, &tv, err, errlen);
	if (rc)
		goto out_free;
	if (tv > m->cfg.vocab_size) {
		rc = errorf(err, errlen, -EINVAL,
			    "tokenizer %s defines ids up to %u, but %s vocab_size is %u: they belong to different "
			    "models",
			    name, tv - 1, vocab_from, m->cfg.vocab_size);
		goto out_free;
	}
	free(m->tokenizer_json);
	m->tokenizer_json = d;
	m->tokenizer_bytes = len;
	d = NULL;
	str_copy(m->tokenizer_path, sizeof(m->tokenizer_path), name);
	m->tokenizer_note[0] = 0;
out_free:
	free(d);
	return rc;
}

void manifest_destroy(struct manifest **mp)
{
	if (!mp || !*mp)
		return;
	struct manifest *m = *mp;
	free(m->tokenizer_json);
	free(m->chat_template);
	free(m->tensors);
	free(m->groups);
	free(m->extents);
	free(m->files);
	free(m);
	*mp = NULL;
}


int manifest_find_tensor(const struct manifest *m, uint32_t group, enum tensor_role role)
{
	assert(m);
	return model_find_tensor(&m->cfg, m->tensors, m->groups, group, role);
}

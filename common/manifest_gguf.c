/* manifest_gguf.c - a GGUF checkpoint (llama.cpp's format, common/gguf.h) read into the manifest:
 * the file or split set, the model configuration from the <arch>.* keys (and the llama3 RoPE
 * scaling that llama.cpp stores as the rope_freqs.weight tensor), the tensor table put in the
 * canonical slots, then the same layout and hash as a safetensors checkpoint, the tokenizer
 * (manifest_gguf_vocab.c) and the chat template.
 *
 * What is accepted: general.architecture "llama" (Llama 1-3, the Mistral models llama.cpp writes
 * as llama, and Mixtral: llama with llama.expert_count), "qwen3" and "qwen3moe" (the architectures
 * and the experts: manifest_gguf_moe.c); the tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K,
 * Q6_K; RoPE over the whole head, unscaled, linear or llama3. Refused, each with a message naming
 * it: other architectures, partial rotary, yarn scaling, other tensor types, tensors that are not
 * part of the model (biases, shared experts). For "llama" GGUF stores the rows of wq and wk
 * permuted for llama.cpp's RoPE on adjacent pairs, so cfg.rope_layout is ROPE_ADJACENT; Qwen3's
 * are stored as in the checkpoint (ROPE_HALVES). */
#include "common/manifest_internal.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/gguf.h"
#include "common/util.h"

#define SPLIT_SUFFIX_LEN 20 /* "-00001-of-00003.gguf" */
#define ROPE_FREQS	 "rope_freqs.weight"
#define KEY_MAX		 96 /* "<arch>.<key>" */

/* The files of a checkpoint: one, or a split set in order. */
struct gset {
	uint32_t n;
	struct gguf **g;
	char (*paths)[PATH_MAX];
};

int mf_gguf_dtype(const struct gguf *g, const struct gguf_tensor *t, enum dtype *dt, char *err, size_t errlen)
{
	if (gguf_type_to_dtype(t->type, dt) == 0)
		return 0;
	return errorf(err, errlen, -ENOTSUP,
		      "%s: tensor %s has type %s, which is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, "
		      "Q4_K, Q5_K, Q6_K)", gguf_path(g), t->name, gguf_type_name(t->type));
}

static void gset_free(struct gset *s)
{
	for (uint32_t i = 0; i < s->n; i++)
		gguf_close(&s->g[i]);
	free(s->g);
	free(s->paths);
	memset(s, 0, sizeof(*s));
}

/* Parses "<prefix>-NNNNN-of-MMMMM.gguf" (five digits each, prefix not empty): 1 with its parts, 0
 * for another name. */
static int split_name(const char *base, size_t *prefix_len, uint32_t *no, uint32_t *count)
{
	size_t n = strlen(base);
	if (n <= SPLIT_SUFFIX_LEN)
		return 0;
	const char *s = base + n - SPLIT_SUFFIX_LEN;
	uint32_t a = 0, b = 0;
	for (int i = 0; i < 5; i++) {
		if (s[1 + i] < '0' || s[1 + i] > '9' || s[10 + i] < '0' || s[10 + i] > '9')
			return 0;
		a = a * 10 + (uint32_t)(s[1 + i] - '0');
		b = b * 10 + (uint32_t)(s[10 + i] - '0');
	}
	if (s[0] != '-' || memcmp(s + 6, "-of-", 4) || strcmp(s + 15, ".gguf"))
		return 0;
	*prefix_len = n - SPLIT_SUFFIX_LEN;
	*no = a;
	*count = b;
	return 1;
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

int mf_find_gguf(const char *dir, char *path, size_t len, char *err, size_t errlen)
{
	DIR *d = opendir(dir);
	if (!d)
		return errorf(err, errlen, -errno, "model directory %s: %s", dir, strerror(errno));
	char **names = NULL;
	size_t n = 0, cap = 0;
	int rc = 0;
	struct dirent *e;
	while ((e = readdir(d)) != NULL) {
		size_t l = strlen(e->d_name);
		if (l < 6 || strcmp(e->d_name + l - 5, ".gguf") || e->d_name[0] == '.')
			continue;
		if (n == cap) {
			cap = cap ? 2 * cap : 8;
			char **p = realloc(names, cap * sizeof(*names));
			if (!p) {
				rc = errorf(err, errlen, -ENOMEM, "out of memory");
				goto out;
			}
			names = p;
		}
		if (!(names[n] = strdup(e->d_name))) {
			rc = errorf(err, errlen, -ENOMEM, "out of memory");
			goto out;
		}
		n++;
	}
	if (n == 0)
		goto out;
	qsort(names, n, sizeof(*names), cmp_str);
	/* Several files: one split set, whose first file sorts first. */
	size_t p0, p;
	uint32_t no0, count0, no, count;
	bool one_set = split_name(names[0], &p0, &no0, &count0) && no0 == 1 && count0 == n;
	for (size_t i = 1; i < n && one_set; i++)
		one_set = split_name(names[i], &p, &no, &count) && p == p0 && !strncmp(names[i], names[0], p0) &&
			  count == count0 && no == i + 1;
	/* Every file of one split set's names (one prefix, one count) but some missing: say which. */
	bool same_set = n > 1 && split_name(names[0], &p0, &no0, &count0);
	for (size_t i = 1; i < n && same_set; i++)
		same_set = split_name(names[i], &p, &no, &count) && p == p0 && !strncmp(names[i], names[0], p0) &&
			   count == count0;
	if (n > 1 && !one_set && same_set && n < count0) {
		uint32_t missing = 1;
		for (size_t i = 0; i < n && split_name(names[i], &p, &no, &count) && no == missing; i++)
			missing++;
		rc = errorf(err, errlen, -ENOENT,
			    "model directory %s holds %zu of the %u files of the split set %.*s-*-of-%05u.gguf: file %u "
			    "(%.*s-%05u-of-%05u.gguf) is missing",
			    dir, n, count0, (int)p0, names[0], count0, missing, (int)p0, names[0], missing, count0);
		goto out;
	}
	if (n > 1 && !one_set) {
		rc = errorf(err, errlen, -EINVAL,
			    "model directory %s holds %zu GGUF files (%s, %s%s) that are not one split "
			    "set: give the file to load",
			    dir, n, names[0], names[1], n > 2 ? ", ..." : "");
		goto out;
	}
	if (snprintf(path, len, "%s/%s", dir, names[0]) >= (int)len) {
		rc = errorf(err, errlen, -ENAMETOOLONG, "%s/%s: path too long", dir, names[0]);
		goto out;
	}
	rc = 1;
out:
	for (size_t i = 0; i < n; i++)
		free(names[i]);
	free(names);
	closedir(d);
	return rc;
}

/* Opens the file at path, and with it the rest of its split set. */
static int open_set(const char *path, struct gset *s, char *err, size_t errlen)
{
	struct gguf *g0;
	int rc = gguf_open(path, &g0, err, errlen);
	if (rc)
		return rc;
	uint32_t count = 1, no = 0;
	if (gguf_find_key(g0, "split.count") >= 0 && (rc = gguf_get_u32(g0, "split.count", &count, err, errlen)) != 0)
		goto out_g0;
	if (count < 1 || count > UINT16_MAX) {
		rc = errorf(err, errlen, -EINVAL, "%s: split.count %u is out of range [1, 65535]", path, count);
		goto out_g0;
	}
	s->g = calloc(count, sizeof(*s->g));
	s->paths = calloc(count, sizeof(*s->paths));
	if (!s->g || !s->paths) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out_g0;
	}
	s->n = count;
	if (count == 1) {
		s->g[0] = g0;
		str_copy(s->paths[0], sizeof(s->paths[0]), path);
		return 0;
	}
	/* A split set: <prefix>-NNNNN-of-MMMMM.gguf, every file beside this one. */
	const char *slash = strrchr(path, '/'), *base = slash ? slash + 1 : path;
	size_t dir_len = (size_t)(base - path), prefix_len;
	uint32_t name_no, name_count;
	if (!split_name(base, &prefix_len, &name_no, &name_count) || name_count != count || name_no < 1 ||
	    name_no > count) {
		rc = errorf(err, errlen, -EINVAL,
			    "%s: split.count is %u, but the name does not follow "
			    "<name>-NNNNN-of-%05u.gguf, so the other files of the set cannot be found",
			    path, count, count);
		goto out_g0;
	}
	for (uint32_t i = 0; i < count; i++) {
		if (snprintf(s->paths[i], sizeof(s->paths[i]), "%.*s%.*s-%05u-of-%05u.gguf", (int)dir_len, path,
			     (int)prefix_len, base, i + 1, count) >= (int)sizeof(s->paths[i])) {
			rc = errorf(err, errlen, -ENAMETOOLONG, "%s: path too long", path);
			goto out_g0;
		}
		if (i + 1 == name_no) {
			s->g[i] = g0;
			g0 = NULL;
		} else if ((rc = gguf_open(s->paths[i], &s->g[i], err, errlen)) != 0) {
			if (rc == -ENOENT)
				errorf(err, errlen, rc, "%s: file %u of the split set (%u files) is missing",
				       s->paths[i], i + 1, count);
			goto out_g0;
		}
		/* Each file says which it is: a renamed or mixed-up file would put tensors in the wrong place. */
		const struct gguf *g = s->g[i];
		uint32_t c2 = 0;
		if ((rc = gguf_get_u32(g, "split.no", &no, err, errlen)) != 0 ||
		    (rc = gguf_get_u32(g, "split.count", &c2, err, errlen)) != 0)
			goto out_g0;
		if (no != i || c2 != count) {
			rc = errorf(err, errlen, -EINVAL,
				    "%s: split.no %u and split.count %u, but the name makes it file %u "
				    "of %u (split.no %u)",
				    s->paths[i], no, c2, i + 1, count, i);
			goto out_g0;
		}
	}
	uint64_t total = 0;
	for (uint32_t i = 0; i < count; i++)
		total += gguf_n_tensors(s->g[i]);
	int64_t want;
	if (gguf_find_key(s->g[0], "split.tensors.count") >= 0) {
		if ((rc = gguf_get_i64(s->g[0], "split.tensors.count", &want, err, errlen)) != 0)
			goto out_g0;
		if (want < 0 || (uint64_t)want != total) {
			rc = errorf(err, errlen, -EINVAL,
				    "%s: split.tensors.count is %" PRId64 ", but the %u files hold %" PRIu64 " tensors",
				    s->paths[0], want, count, total);
			goto out_g0;
		}
	}
	return 0;
out_g0:
	gguf_close(&g0);
	return rc;
}

/* The file of the set holding tensor name, and its index there; -1 when none does. */
static int find_tensor(const struct gset *s, const char *name, uint64_t *idx)
{
	for (uint32_t f = 0; f < s->n; f++) {
		int64_t i = gguf_find_tensor(s->g[f], name);
		if (i >= 0) {
			*idx = (uint64_t)i;
			return (int)f;
		}
	}
	return -1;
}

/* ---- the configuration ---- */

/* An optional key: absent leaves *v, present must read. */
static int opt_u32(const struct gguf *g, const char *key, uint32_t *v, char *err, size_t errlen)
{
	int rc = gguf_get_u32(g, key, v, err, errlen);
	return rc == -ENOENT ? 0 : rc;
}

/* The key <ap>.<suffix> (ap: the architecture's prefix) in buf, KEY_MAX bytes. */
static const char *akey(char *buf, const char *ap, const char *suffix)
{
	snprintf(buf, KEY_MAX, "%s.%s", ap, suffix);
	return buf;
}

static int opt_f32(const struct gguf *g, const char *key, float *v, char *err, size_t errlen)
{
	int rc = gguf_get_f32(g, key, v, err, errlen);
	return rc == -ENOENT ? 0 : rc;
}

/* llama.cpp keeps Llama 3.1's RoPE scaling as rope_freqs.weight: head_dim/2 divisors of the
 * frequencies, made by convert_hf_to_gguf.py (LlamaModel) with the llama3 formula. The values are
 * fitted back to that formula (factor: the largest; low 1 and high 4, the only ones Meta uses;
 * the original context from the metadata, else 8192) and every one is checked, so that what the
 * compute side rebuilds from the config is what the file holds. */
static int read_rope_freqs(const struct gset *s, struct model_config *c, const char *ap, char *err, size_t errlen)
{
	uint64_t ti;
	int f = find_tensor(s, ROPE_FREQS, &ti);
	if (f < 0)
		return 0;
	const struct gguf *g = s->g[f];
	const struct gguf_tensor *t = gguf_tensor(g, ti);
	uint32_t half = c->head_dim / 2;
	if (c->rope_scaling != ROPE_SCALING_NONE)
		return errorf(err, errlen, -ENOTSUP, "%s: %s and linear RoPE scaling together are not supported",
			      gguf_path(g), ROPE_FREQS);
	if (t->type != GGUF_TENSOR_F32 || t->ne[0] != half || t->ne[1] != 1 || t->ne[2] != 1 || t->ne[3] != 1)
		return errorf(err, errlen, -EINVAL,
			      "%s: %s must hold %u F32 values (head_dim / 2), it is %s [%" PRIu64 ", %" PRIu64 "]",
			      gguf_path(g), ROPE_FREQS, half, gguf_type_name(t->type), t->ne[0], t->ne[1]);
	float *v = malloc(half * sizeof(*v));
	if (!v)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	int rc = gguf_read_tensor(g, ti, v, half * sizeof(*v), err, errlen);
	if (rc)
		goto out;
	float factor = 0, lo = INFINITY;
	for (uint32_t i = 0; i < half; i++) {
		if (!(isfinite(v[i]) && v[i] > 0)) {
			rc = errorf(err, errlen, -EINVAL, "%s: %s value %u is %g (must be positive)", gguf_path(g),
				    ROPE_FREQS, i, (double)v[i]);
			goto out;
		}
		factor = v[i] > factor ? v[i] : factor;
		lo = v[i] < lo ? v[i] : lo;
	}
	if (factor == 1.0f && lo == 1.0f)
		goto out; /* all ones: no scaling */
	uint32_t orig = 8192;
	char k[KEY_MAX];
	rc = opt_u32(s->g[0], akey(k, ap, "rope.scaling.original_context_length"), &orig, err, errlen);
	if (rc)
		goto out;
	if (orig < 1) {
		rc = errorf(err, errlen, -EINVAL, "%s: %s is 0", gguf_path(s->g[0]), k);
		goto out;
	}
	const double low = 1.0, high = 4.0, low_wl = orig / low, high_wl = orig / high;
	for (uint32_t i = 0; i < half; i++) {
		double freq = 1.0 / pow((double)c->rope_theta, (double)(2 * i) / c->head_dim);
		double wl = 2 * M_PI / freq, want;
		if (wl < high_wl)
			want = 1.0;
		else if (wl > low_wl)
			want = factor;
		else {
			double smooth = (orig / wl - low) / (high - low);
			want = 1.0 / ((1 - smooth) / factor + smooth);
		}
		if (fabs(v[i] - want) > 1e-5 * want) {
			rc = errorf(
			    err, errlen, -ENOTSUP,
			    "%s: %s value %u is %.7g, but llama3 RoPE scaling (factor %g, low_freq_factor 1, "
			    "high_freq_factor 4, original context %u, rope.freq_base %g) gives %.7g: this scaling is "
			    "not supported",
			    gguf_path(g), ROPE_FREQS, i, (double)v[i], (double)factor, orig, (double)c->rope_theta,
			    want);
			goto out;
		}
	}
	c->rope_scaling = ROPE_SCALING_LLAMA3;
	c->rope_factor = factor;
	c->rope_low_freq_factor = (float)low;
	c->rope_high_freq_factor = (float)high;
	c->rope_original_max_position = orig;
out:
	free(v);
	return rc;
}

static int read_rope(const struct gset *s, struct model_config *c, const char *ap, char *err, size_t errlen)
{
	const struct gguf *g = s->g[0];
	const char *path = gguf_path(g);
	char k[KEY_MAX], k2[KEY_MAX];
	uint32_t rot = c->head_dim;
	int rc = opt_u32(g, akey(k, ap, "rope.dimension_count"), &rot, err, errlen);
	if (rc)
		return rc;
	if (rot != c->head_dim)
		return errorf(err, errlen, -ENOTSUP,
			      "%s: %s %u differs from the head size %u: "
			      "partial rotary embeddings are not supported",
			      path, k, rot, c->head_dim);
	c->rope_theta = 10000.0f;
	rc = opt_f32(g, akey(k, ap, "rope.freq_base"), &c->rope_theta, err, errlen);
	if (rc)
		return rc;
	if (!(c->rope_theta > 0 && isfinite(c->rope_theta)))
		return errorf(err, errlen, -EINVAL, "%s: %s %g must be positive", path, k, (double)c->rope_theta);
	const char *type = NULL;
	if (gguf_find_key(g, akey(k, ap, "rope.scaling.type")) >= 0 &&
	    (rc = gguf_get_str(g, k, &type, NULL, err, errlen)) != 0)
		return rc;
	c->rope_scaling = ROPE_SCALING_NONE;
	if (type && !strcmp(type, "linear")) {
		rc = gguf_get_f32(g, akey(k2, ap, "rope.scaling.factor"), &c->rope_factor, err, errlen);
		if (rc)
			return rc;
		c->rope_scaling = ROPE_SCALING_LINEAR;
	} else if (type && strcmp(type, "none")) {
		return errorf(err, errlen, -ENOTSUP,
			      "%s: %s \"%.40s\" is not supported (supported: "
			      "none, linear; llama3 as rope_freqs.weight)",
			      path, k, type);
	} else if (!type && gguf_find_key(g, akey(k2, ap, "rope.scale_linear")) >= 0) {
		/* The key older files use. */
		rc = gguf_get_f32(g, k2, &c->rope_factor, err, errlen);
		if (rc)
			return rc;
		if (c->rope_factor != 1.0f)
			c->rope_scaling = ROPE_SCALING_LINEAR;
	}
	if (c->rope_scaling == ROPE_SCALING_LINEAR && !(c->rope_factor > 0 && isfinite(c->rope_factor)))
		return errorf(err, errlen, -EINVAL, "%s: the linear RoPE scaling factor %g must be positive", path,
			      (double)c->rope_factor);
	return read_rope_freqs(s, c, ap, err, errlen);
}

/* A token id key (optional): inside the vocabulary. Returns 1 with *id when present. */
static int token_id(const struct gguf *g, const char *key, uint32_t vocab, int32_t *id, char *err, size_t errlen)
{
	uint32_t v;
	int rc = gguf_get_u32(g, key, &v, err, errlen);
	if (rc == -ENOENT)
		return 0;
	if (rc)
		return rc;
	if (v >= vocab)
		return errorf(err, errlen, -EINVAL, "%s: %s %u is outside the vocabulary (vocab_size %u)", gguf_path(g),
			      key, v, vocab);
	*id = (int32_t)v;
	return 1;
}

static int read_special_ids(const struct gguf *g, struct model_config *c, char *err, size_t errlen)
{
	int32_t id;
	int rc = token_id(g, "tokenizer.ggml.bos_token_id", c->vocab_size, &id, err, errlen);
	if (rc < 0)
		return rc;
	c->bos_id = rc ? id : -1;
	/* What generation stops on: EOS, and the end-of-turn and end-of-message tokens of chat models. */
	static const char *const stops[] = {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
					    "tokenizer.ggml.eom_token_id"};
	c->n_eos = 0;
	for (size_t k = 0; k < ARRAY_SIZE(stops); k++) {
		rc = token_id(g, stops[k], c->vocab_size, &id, err, errlen);
		if (rc < 0)
			return rc;
		bool seen = false;
		for (uint32_t i = 0; i < c->n_eos; i++)
			seen |= c->eos_ids[i] == id;
		if (rc && !seen)
			c->eos_ids[c->n_eos++] = id;
	}
	/* Converted files often name one EOS id only (a Llama 3.1 Instruct file: <|eot_id|>), where
	 * the Hugging Face checkpoint's generation_config.json lists every end of generation. Like
	 * llama.cpp, the end-of-turn tokens are also found by their text. */
	static const char *const eog_text[] = {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>",
					       "<|end|>", "<end_of_turn>", "<|endoftext|>"};
	const struct gguf_str *tok;
	uint64_t n_tok;
	if (gguf_get_str_array(g, "tokenizer.ggml.tokens", &tok, &n_tok, err, errlen) == 0) {
		for (uint64_t i = 0; i < n_tok && i < c->vocab_size && c->n_eos < MODEL_MAX_EOS; i++) {
			bool eog = false;
			for (size_t k = 0; k < ARRAY_SIZE(eog_text) && !eog; k++)
				eog = tok[i].len == strlen(eog_text[k]) && !memcmp(tok[i].s, eog_text[k], tok[i].len);
			bool seen = false;
			for (uint32_t j = 0; j < c->n_eos; j++)
				seen |= c->eos_ids[j] == (int32_t)i;
			if (eog && !seen)
				c->eos_ids[c->n_eos++] = (int32_t)i;
		}
	}
	if (errlen)
		err[0] = '\0'; /* a file without a token list is no error here */
	return 0;
}

static int read_vocab_size(const struct gset *s, struct model_config *c, const char *ap, char *err, size_t errlen)
{
	const struct gguf *g = s->g[0];
	uint64_t n_tokens = 0, ti;
	bool have_tokens = false;
	int64_t k = gguf_find_key(g, "tokenizer.ggml.tokens");
	if (k >= 0 && gguf_kv_type(g, (uint64_t)k) == GGUF_ARRAY &&
	    gguf_kv_array_type(g, (uint64_t)k, &n_tokens) == GGUF_STRING)
		have_tokens = true;
	int f;
	char key[KEY_MAX];
	if (gguf_find_key(g, akey(key, ap, "vocab_size")) >= 0) {
		int rc = gguf_get_u32(g, key, &c->vocab_size, err, errlen);
		if (rc)
			return rc;
	} else if (have_tokens) {
		c->vocab_size = n_tokens > UINT32_MAX ? UINT32_MAX : (uint32_t)n_tokens;
	} else if ((f = find_tensor(s, "token_embd.weight", &ti)) >= 0) {
		uint64_t rows = gguf_tensor(s->g[f], ti)->ne[1];
		c->vocab_size = rows > UINT32_MAX ? UINT32_MAX : (uint32_t)rows;
	} else {
		return errorf(err, errlen, -EINVAL,
			      "%s: no %s, no tokenizer.ggml.tokens and no "
			      "token_embd.weight: the vocabulary size is unknown",
			      gguf_path(g), key);
	}
	if (have_tokens && n_tokens > c->vocab_size)
		return errorf(err, errlen, -EINVAL,
			      "%s: tokenizer.ggml.tokens lists %" PRIu64 " tokens, but the model's "
			      "vocab_size is %u",
			      gguf_path(g), n_tokens, c->vocab_size);
	return 0;
}

static int read_config_keys(const struct gset *s, struct model_config *c, char *err, size_t errlen)
{
	const struct gguf *g = s->g[0];
	const char *path = gguf_path(g), *ap;
	memset(c, 0, sizeof(*c));
	int rc = mf_gguf_arch(g, c, &ap, err, errlen);
	if (rc)
		return rc;
	char k[KEY_MAX];
	struct {
		const char *key;
		uint32_t *v;
		bool required;
		uint32_t lo, hi; /* model_config_check's bounds */
	} keys[] = {
	    {"block_count", &c->n_layers, true, 1, 1024},
	    {"embedding_length", &c->dim, true, 1, 1u << 17},
	    {"feed_forward_length", &c->ffn_dim, true, 1, 1u << 20},
	    {"attention.head_count", &c->n_heads, true, 1, 1024},
	    {"attention.head_count_kv", &c->n_kv_heads, false, 1, 1024},
	    {"attention.key_length", &c->head_dim, false, 1, 1024},
	    {"context_length", &c->max_position, true, 1, UINT32_MAX},
	};
	for (size_t i = 0; i < ARRAY_SIZE(keys); i++) {
		if (i == 4)
			c->n_kv_heads = c->n_heads; /* without the key: no grouped-query attention */
		if (i == 5 && c->n_heads && c->dim % c->n_heads == 0)
			c->head_dim = c->dim / c->n_heads;
		rc = gguf_get_u32(g, akey(k, ap, keys[i].key), keys[i].v, err, errlen);
		if (rc == -ENOENT && keys[i].v == &c->head_dim && !c->head_dim)
			return errorf(err, errlen, -EINVAL,
				      "%s: %s.attention.head_count %u does not divide "
				      "%s.embedding_length %u (and there is no %s)",
				      path, ap, c->n_heads, ap, c->dim, k);
		if (rc && (rc != -ENOENT || keys[i].required))
			return rc;
		if (*keys[i].v < keys[i].lo || *keys[i].v > keys[i].hi)
			return errorf(err, errlen, -EINVAL, "%s: %s %u is out of range [%u, %u]", path, k, *keys[i].v,
				      keys[i].lo, keys[i].hi);
	}
	if (c->n_heads % c->n_kv_heads)
		return errorf(err, errlen, -EINVAL,
			      "%s: %s.attention.head_count_kv %u must divide %s.attention.head_count %u", path, ap,
			      c->n_kv_heads, ap, c->n_heads);
	uint32_t vdim = c->head_dim;
	rc = opt_u32(g, akey(k, ap, "attention.value_length"), &vdim, err, errlen);
	if (rc)
		return rc;
	if (vdim != c->head_dim)
		return errorf(err, errlen, -ENOTSUP, "%s: %s %u differs from key_length %u: not supported", path, k,
			      vdim, c->head_dim);
	rc = gguf_get_f32(g, akey(k, ap, "attention.layer_norm_rms_epsilon"), &c->rms_eps, err, errlen);
	if (rc)
		return rc;
	if (!(c->rms_eps > 0 && c->rms_eps < 1))
		return errorf(err, errlen, -EINVAL, "%s: %s %g must be in (0, 1)", path, k, (double)c->rms_eps);
	/* Mistral v0.1's sliding window, where the file keeps it (llama.cpp itself reads none for the
	 * llama architecture, and computes such a model past its window as if it had none; a file that
	 * names a window means it, as transformers does). Qwen3's configurations name a window that
	 * only use_sliding_window switches on, which GGUF has no key for: as transformers, none. */
	if (c->arch != ARCH_QWEN3 && c->arch != ARCH_QWEN3_MOE) {
		rc = opt_u32(g, akey(k, ap, "attention.sliding_window"), &c->sliding_window, err, errlen);
		if (rc)
			return rc;
	}
	rc = mf_gguf_read_experts(g, ap, c, err, errlen);
	if (!rc)
		rc = read_rope(s, c, ap, err, errlen);
	if (!rc)
		rc = read_vocab_size(s, c, ap, err, errlen);
	if (!rc && (c->vocab_size < 1 || c->vocab_size > (1u << 24)))
		rc = errorf(err, errlen, -EINVAL, "%s: the vocabulary size %u is out of range [1, %u]", path,
			    c->vocab_size, 1u << 24);
	if (!rc)
		rc = read_special_ids(g, c, err, errlen);
	if (rc)
		return rc;
	uint64_t ti;
	c->tie_embeddings = find_tensor(s, "output.weight", &ti) < 0;
	/* The checks above speak of GGUF keys; this one guards what they might have missed. */
	char why[256];
	rc = model_config_check(c, why, sizeof(why));
	if (rc)
		return errorf(err, errlen, rc, "%s: the GGUF metadata makes an invalid configuration: %s", path, why);
	return 0;
}

/* A required key that is missing makes the file corrupt (-EINVAL), not a missing file. */
static int read_config(const struct gset *s, struct model_config *c, char *err, size_t errlen)
{
	int rc = read_config_keys(s, c, err, errlen);
	return rc == -ENOENT ? -EINVAL : rc;
}

/* ---- the tensors ---- */

/* Puts tensor ti of file fi in its slot, checked against the configuration. */
static int place_tensor(struct manifest *m, const struct gset *s, uint32_t fi, uint64_t ti, bool *found, char *err,
			size_t errlen)
{
	const struct gguf *g = s->g[fi];
	const struct gguf_tensor *t = gguf_tensor(g, ti);
	const char *path = gguf_path(g);
	uint32_t slot;
	enum name_class nc = mf_classify_gguf(&m->cfg, t->name, &slot);
	if (nc == NAME_UNEXPECTED && !strcmp(t->name, ROPE_FREQS))
		return 0; /* read into the config (read_rope_freqs) */
	if (nc == NAME_UNEXPECTED)
		return errorf(err, errlen, -EINVAL, "%s: unexpected tensor %s (not part of a %u-layer %s%s)", path,
			      t->name, m->cfg.n_layers, mf_gguf_arch_name(&m->cfg),
			      m->cfg.n_experts ? " with experts" : "");
	if (nc == NAME_IGNORE)
		return 0;
	if (nc == NAME_EXPERTS)
		return mf_gguf_place_experts(m, g, fi, ti, slot, found, err, errlen);
	if (found[slot])
		return errorf(err, errlen, -EINVAL, "%s: tensor %s appears twice in the split set", path, t->name);
	enum dtype dt;
	if (mf_gguf_dtype(g, t, &dt, err, errlen) != 0)
		return -ENOTSUP;
	uint32_t role, group, want_ndim;
	uint64_t want[2];
	char name[TENSOR_NAME_MAX];
	mf_slot_info(&m->cfg, slot, &role, &group, name, sizeof(name));
	int src = model_expected_shape(&m->cfg, (enum tensor_role)role, &want_ndim, want);
	(void)src;
	/* GGUF counts dimensions from the contiguous one: (ne[0], ne[1]) is (columns, rows). */
	uint64_t rows = want_ndim == 2 ? t->ne[1] : 1, cols = t->ne[0];
	bool ok = t->ne[2] == 1 && t->ne[3] == 1 &&
		  (want_ndim == 2 ? rows == want[0] && cols == want[1] : t->ne[1] == 1 && cols == want[0]);
	if (!ok) {
		char got_s[128], want_s[64];
		uint64_t shape[GGUF_MAX_DIMS];
		for (uint32_t d = 0; d < t->n_dims; d++)
			shape[d] = t->ne[t->n_dims - 1 - d];
		mf_format_shape(got_s, sizeof(got_s), shape, t->n_dims);
		mf_format_shape(want_s, sizeof(want_s), want, want_ndim);
		return errorf(err, errlen, -EINVAL,
			      "%s: tensor %s has shape %s (rows first), but the metadata implies %s", path, t->name,
			      got_s, want_s);
	}
	uint64_t nbytes = dtype_row_bytes(dt, cols) * rows;
	if (nbytes != t->nbytes) /* the parser and dtype.h disagree on the type's block: a bug, not a file */
		return errorf(err, errlen, -EINVAL, "%s: tensor %s: %s data of %" PRIu64 " bytes, expected %" PRIu64,
			      path, t->name, dtype_name(dt), t->nbytes, nbytes);
	struct tensor_desc *d = &m->tensors[slot];
	memset(d, 0, sizeof(*d));
	str_copy(d->name, sizeof(d->name), t->name);
	d->group = group;
	d->role = role;
	d->dtype = dt;
	d->ndim = want_ndim;
	d->shape[0] = want_ndim == 2 ? rows : cols;
	d->shape[1] = want_ndim == 2 ? cols : 0;
	d->nbytes = nbytes;
	d->file_index = fi;
	d->file_offset = gguf_data_start(g) + t->offset;
	found[slot] = true;
	return 0;
}

static int read_tensors(struct manifest *m, const struct gset *s, char *err, size_t errlen)
{
	uint32_t ns = mf_n_slots(&m->cfg);
	m->n_tensors = ns;
	m->tensors = calloc(ns, sizeof(*m->tensors));
	bool *found = calloc(ns, sizeof(*found));
	int rc = 0;
	if (!m->tensors || !found) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out;
	}
	for (uint32_t f = 0; f < s->n && !rc; f++)
		for (uint64_t i = 0; i < gguf_n_tensors(s->g[f]) && !rc; i++)
			rc = place_tensor(m, s, f, i, found, err, errlen);
	for (uint32_t slot = 0; slot < ns && !rc; slot++) {
		if (found[slot])
			continue;
		char name[TENSOR_NAME_MAX];
		mf_slot_name_gguf(&m->cfg, slot, name, sizeof(name));
		rc = errorf(err, errlen, -EINVAL, "%s: missing tensor %s (the metadata: %u layers, %s embeddings)",
			    s->paths[0], name, m->cfg.n_layers, m->cfg.tie_embeddings ? "tied" : "untied");
	}
out:
	free(found);
	return rc;
}

/* ---- the whole ---- */

/* The tokenizer made from the metadata, or a note saying why there is none; the chat template. */
static int read_tokenizer(struct manifest *m, const struct gset *s, char *err, size_t errlen)
{
	const struct gguf *g = s->g[0];
	char *json = NULL;
	size_t len = 0;
	int rc = mf_gguf_tokenizer_json(g, &json, &len, m->tokenizer_note, sizeof(m->tokenizer_note), err, errlen);
	if (rc)
		return rc;
	if (json) {
		char note[sizeof(m->tokenizer_note)];
		memcpy(note, m->tokenizer_note, sizeof(note));
		rc = mf_attach_tokenizer_bytes(m, s->paths[0], "the GGUF file's", &json, len, err, errlen);
		if (rc)
			return rc;
		memcpy(m->tokenizer_note, note, sizeof(note)); /* what the conversion left out */
	}
	const char *tmpl;
	size_t tl;
	if (gguf_find_key(g, "tokenizer.chat_template") >= 0 &&
	    gguf_get_str(g, "tokenizer.chat_template", &tmpl, &tl, err, errlen) == 0) {
		if (tl != strlen(tmpl) || tl > MANIFEST_MAX_CHAT_TEMPLATE) {
			snprintf(m->chat_template_note, sizeof(m->chat_template_note),
				 "the GGUF file's chat template is left out: %s", tl != strlen(tmpl) ? "it holds a NUL byte"
				 : "it is longer than 1 MiB");
		} else {
			m->chat_template = strdup(tmpl);
			if (!m->chat_template)
				return errorf(err, errlen, -ENOMEM, "out of memory");
			str_copy(m->chat_template_from, sizeof(m->chat_template_from), s->paths[0]);
		}
	}
	return 0;
}

int mf_load_gguf(struct manifest *m, const char *path, char *err, size_t errlen)
{
	struct gset s = {0};
	int rc = open_set(path, &s, err, errlen);
	if (rc)
		goto out;
	rc = read_config(&s, &m->cfg, err, errlen);
	if (rc)
		goto out;
	m->n_files = s.n;
	m->files = calloc(s.n, sizeof(*m->files));
	if (!m->files) {
		rc = errorf(err, errlen, -ENOMEM, "out of memory");
		goto out;
	}
	for (uint32_t i = 0; i < s.n; i++) {
		str_copy(m->files[i].path, sizeof(m->files[i].path), s.paths[i]);
		m->files[i].size = gguf_file_size(s.g[i]);
		m->files[i].id = *gguf_file_id(s.g[i]);
		m->files[i].data_start = gguf_data_start(s.g[i]);
	}
	rc = read_tensors(m, &s, err, errlen);
	if (rc)
		goto out;
	rc = mf_build_layout(m);
	if (rc) {
		errorf(err, errlen, rc, "out of memory laying out %s", path);
		goto out;
	}
	mf_finish_summary(m);
	rc = read_tokenizer(m, &s, err, errlen);
out:
	gset_free(&s);
	return rc;
}

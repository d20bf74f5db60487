/* gguf_test_writer.c - the byte-level GGUF writer of the tests and fuzz seeds (gguf_test_writer.h). */
#include "tests/unit/manifest/gguf_test_writer.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void *xrealloc(void *p, size_t n)
{
	p = realloc(p, n ? n : 1);
	if (!p)
		abort();
	return p;
}

static char *xstrdup(const char *s)
{
	char *p = strdup(s);
	if (!p)
		abort();
	return p;
}

/* ---- bytes ---- */

struct buf {
	unsigned char *p;
	size_t len, cap;
};

static void put(struct buf *b, const void *data, size_t n)
{
	if (b->len + n > b->cap) {
		b->cap = (b->len + n) * 2 + 64;
		b->p = xrealloc(b->p, b->cap);
	}
	if (n) /* data may be NULL then */
		memcpy(b->p + b->len, data, n);
	b->len += n;
}

static void put_u32(struct buf *b, uint32_t v)
{
	unsigned char x[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
			      (unsigned char)(v >> 24)};
	put(b, x, 4);
}

static void put_u64(struct buf *b, uint64_t v)
{
	unsigned char x[8];
	for (int i = 0; i < 8; i++)
		x[i] = (unsigned char)(v >> (8 * i));
	put(b, x, 8);
}

static void put_str(struct buf *b, const char *s, size_t n)
{
	put_u64(b, n);
	put(b, s, n);
}

/* Is name one the writer is told to leave out? */
static bool skipped(const struct gw *w, const char *name)
{
	for (size_t i = 0; i < sizeof(w->skip) / sizeof(w->skip[0]); i++)
		if (w->skip[i] && !strcmp(w->skip[i], name))
			return true;
	return false;
}

/* The pairs live in a struct buf inside the writer. */
static struct buf kvbuf(struct gw *w)
{
	return (struct buf){w->kv, w->kv_len, w->kv_cap};
}

static void kv_done(struct gw *w, struct buf *b)
{
	w->kv = b->p;
	w->kv_len = b->len;
	w->kv_cap = b->cap;
	w->kv_count++;
}

static void kv_scalar(struct gw *w, const char *key, uint32_t type, const void *v, size_t n)
{
	if (skipped(w, key))
		return;
	struct buf b = kvbuf(w);
	put_str(&b, key, strlen(key));
	put_u32(&b, type);
	put(&b, v, n); /* little-endian hosts: the bytes as they are */
	kv_done(w, &b);
}

/* ---- the writer ---- */

struct gw *gw_new(void)
{
	struct gw *w = calloc(1, sizeof(*w));
	if (!w)
		abort();
	memcpy(w->magic, "GGUF", 4);
	w->version = 3;
	w->n_tensors = GW_AUTO;
	w->n_kv = GW_AUTO;
	w->alignment = 32;
	return w;
}

void gw_free(struct gw **wp)
{
	if (!wp || !*wp)
		return;
	struct gw *w = *wp;
	for (uint32_t i = 0; i < w->nt; i++) {
		free(w->t[i].name);
		free(w->t[i].data);
	}
	free(w->t);
	free(w->kv);
	free(w);
	*wp = NULL;
}

void gw_u8(struct gw *w, const char *key, uint8_t v)
{
	kv_scalar(w, key, GW_T_UINT8, &v, 1);
}
void gw_u16(struct gw *w, const char *key, uint16_t v)
{
	kv_scalar(w, key, GW_T_UINT16, &v, 2);
}
void gw_u32(struct gw *w, const char *key, uint32_t v)
{
	kv_scalar(w, key, GW_T_UINT32, &v, 4);
}
void gw_i32(struct gw *w, const char *key, int32_t v)
{
	kv_scalar(w, key, GW_T_INT32, &v, 4);
}
void gw_u64(struct gw *w, const char *key, uint64_t v)
{
	kv_scalar(w, key, GW_T_UINT64, &v, 8);
}
void gw_i64(struct gw *w, const char *key, int64_t v)
{
	kv_scalar(w, key, GW_T_INT64, &v, 8);
}
void gw_f32(struct gw *w, const char *key, float v)
{
	kv_scalar(w, key, GW_T_FLOAT32, &v, 4);
}
void gw_f64(struct gw *w, const char *key, double v)
{
	kv_scalar(w, key, GW_T_FLOAT64, &v, 8);
}
void gw_bool(struct gw *w, const char *key, bool v)
{
	uint8_t b = v;
	kv_scalar(w, key, GW_T_BOOL, &b, 1);
}

void gw_str(struct gw *w, const char *key, const char *v)
{
	if (skipped(w, key))
		return;
	struct buf b = kvbuf(w);
	put_str(&b, key, strlen(key));
	put_u32(&b, GW_T_STRING);
	put_str(&b, v, strlen(v));
	kv_done(w, &b);
}

void gw_arr_str(struct gw *w, const char *key, const char *const *v, const size_t *lens, size_t n)
{
	if (skipped(w, key))
		return;
	struct buf b = kvbuf(w);
	put_str(&b, key, strlen(key));
	put_u32(&b, GW_T_ARRAY);
	put_u32(&b, GW_T_STRING);
	put_u64(&b, n);
	for (size_t i = 0; i < n; i++)
		put_str(&b, v[i], lens ? lens[i] : strlen(v[i]));
	kv_done(w, &b);
}

static void arr_num(struct gw *w, const char *key, uint32_t type, const void *v, size_t n, size_t size)
{
	if (skipped(w, key))
		return;
	struct buf b = kvbuf(w);
	put_str(&b, key, strlen(key));
	put_u32(&b, GW_T_ARRAY);
	put_u32(&b, type);
	put_u64(&b, n);
	put(&b, v, n * size);
	kv_done(w, &b);
}

void gw_arr_f32(struct gw *w, const char *key, const float *v, size_t n)
{
	arr_num(w, key, GW_T_FLOAT32, v, n, 4);
}

void gw_arr_i32(struct gw *w, const char *key, const int32_t *v, size_t n)
{
	arr_num(w, key, GW_T_INT32, v, n, 4);
}

void gw_alignment(struct gw *w, uint32_t a)
{
	gw_u32(w, "general.alignment", a);
	w->alignment = a;
}

void gw_raw(struct gw *w, const char *key, uint32_t type, const void *value, size_t len)
{
	struct buf b = kvbuf(w);
	put_str(&b, key, strlen(key));
	put_u32(&b, type);
	put(&b, value, len);
	kv_done(w, &b);
}

uint64_t gw_type_bytes(uint32_t type, uint64_t n)
{
	switch (type) {
	case GW_F32:
	case GW_I32:
		return 4 * n;
	case GW_F16:
	case GW_BF16:
		return 2 * n;
	case GW_Q8_0:
		return n / 32 * 34;
	case GW_Q4_0:
		return n / 32 * 18;
	case GW_Q4_1:
		return n / 32 * 20;
	case GW_Q4_K:
		return n / 256 * 144;
	case GW_Q5_K:
		return n / 256 * 176;
	case GW_Q6_K:
		return n / 256 * 210;
	case GW_IQ2_XS:
		return n / 256 * 74;
	default:
		return 0;
	}
}

uint32_t gw_tensor(struct gw *w, const char *name, uint32_t type, uint32_t n_dims, const uint64_t *ne, const void *data)
{
	if (skipped(w, name))
		return UINT32_MAX;
	if (w->nt == w->t_cap) {
		w->t_cap = w->t_cap ? 2 * w->t_cap : 32;
		w->t = xrealloc(w->t, w->t_cap * sizeof(*w->t));
	}
	struct gw_tensor *t = &w->t[w->nt];
	memset(t, 0, sizeof(*t));
	t->name = xstrdup(name);
	t->type = type;
	t->n_dims = n_dims;
	uint64_t rows = 1;
	for (uint32_t d = 0; d < 4; d++) {
		t->ne[d] = d < n_dims ? ne[d] : 1;
		if (d)
			rows *= t->ne[d];
	}
	t->nbytes = gw_type_bytes(type, t->ne[0]) * rows;
	t->data = xrealloc(NULL, t->nbytes);
	if (data) {
		memcpy(t->data, data, t->nbytes);
	} else {
		uint32_t h = 2166136261u;
		for (const char *p = name; *p; p++)
			h = (h ^ (unsigned char)*p) * 16777619u;
		for (uint64_t i = 0; i < t->nbytes; i++) {
			h = h * 1103515245u + 12345u;
			t->data[i] = (unsigned char)(h >> 16);
		}
	}
	t->offset = GW_AUTO;
	return w->nt++;
}

static void pad(struct buf *b, uint32_t a)
{
	static const unsigned char zero[64];
	while (b->len % a) {
		size_t k = a - b->len % a;
		put(b, zero, k < sizeof(zero) ? k : sizeof(zero));
	}
}

void gw_bytes(struct gw *w, unsigned char **out, size_t *len)
{
	struct buf b = {0};
	put(&b, w->magic, 4);
	put_u32(&b, w->version);
	put_u64(&b, w->n_tensors == GW_AUTO ? w->nt : w->n_tensors);
	put_u64(&b, w->n_kv == GW_AUTO ? w->kv_count : w->n_kv);
	put(&b, w->kv, w->kv_len);
	uint64_t next = 0, *auto_off = xrealloc(NULL, (w->nt ? w->nt : 1) * sizeof(*auto_off));
	for (uint32_t i = 0; i < w->nt; i++) {
		struct gw_tensor *t = &w->t[i];
		t->info_pos = b.len;
		put_str(&b, t->name, strlen(t->name));
		put_u32(&b, t->n_dims);
		for (uint32_t d = 0; d < t->n_dims; d++)
			put_u64(&b, t->ne[d]);
		put_u32(&b, t->type);
		auto_off[i] = next;
		put_u64(&b, t->offset == GW_AUTO ? next : t->offset);
		next += t->nbytes;
		next = (next + w->alignment - 1) / w->alignment * w->alignment;
	}
	pad(&b, w->alignment);
	w->data_start = b.len;
	if (!w->header_only) {
		for (uint32_t i = 0; i < w->nt; i++) {
			struct gw_tensor *t = &w->t[i];
			/* Data goes where the automatic offset says, whatever the info claims. */
			while (b.len < w->data_start + auto_off[i])
				put(&b, "", 1);
			t->data_pos = b.len;
			put(&b, t->data, t->nbytes);
		}
		pad(&b, w->alignment);
	}
	free(auto_off);
	*out = b.p;
	*len = b.len;
}

int gw_write(struct gw *w, const char *path)
{
	unsigned char *p;
	size_t n;
	gw_bytes(w, &p, &n);
	int rc = 0, fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0) {
		rc = -errno;
		goto out;
	}
	for (size_t done = 0; done < n;) {
		ssize_t k = write(fd, p + done, n - done);
		if (k <= 0) {
			rc = k < 0 ? -errno : -EIO;
			break;
		}
		done += (size_t)k;
	}
	close(fd);
out:
	free(p);
	return rc;
}

/* ---- the tiny llama ---- */

#define TINY_DIM   64
#define TINY_HEADS 4
#define TINY_KV	   2
#define TINY_HD	   16
#define TINY_FFN   192

static uint32_t layers_of(const struct gw_llama *o)
{
	return o->n_layers ? o->n_layers : 2;
}

static uint32_t vocab_of(const struct gw_llama *o)
{
	return o->vocab ? o->vocab : 512;
}

void gw_tiny_llama_keys(struct gw *w, const struct gw_llama *o)
{
	gw_str(w, "general.architecture", "llama");
	gw_str(w, "general.name", "tiny");
	gw_u32(w, "llama.block_count", layers_of(o));
	gw_u32(w, "llama.context_length", 2048);
	gw_u32(w, "llama.embedding_length", TINY_DIM);
	gw_u32(w, "llama.feed_forward_length", TINY_FFN);
	gw_u32(w, "llama.attention.head_count", TINY_HEADS);
	gw_u32(w, "llama.attention.head_count_kv", TINY_KV);
	gw_u32(w, "llama.rope.dimension_count", TINY_HD);
	gw_f32(w, "llama.rope.freq_base", 10000.0f);
	gw_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
	gw_u32(w, "llama.vocab_size", vocab_of(o));
	if (!o->no_tokens_meta) {
		gw_u32(w, "tokenizer.ggml.bos_token_id", 1);
		gw_u32(w, "tokenizer.ggml.eos_token_id", 2);
	}
}

uint32_t gw_tiny_llama_n_tensors(const struct gw_llama *o)
{
	return 2 + 9 * layers_of(o) + (o->tied ? 0 : 1);
}

/* Tensor k of the tiny model, in llama.cpp's order: token_embd, the layers, output_norm, output. */
static void tiny_tensor(struct gw *w, const struct gw_llama *o, uint32_t k)
{
	uint32_t type = o->type, L = layers_of(o), V = vocab_of(o);
	char name[64];
	uint64_t ne[2];
	if (k == 0) {
		ne[0] = TINY_DIM, ne[1] = V;
		gw_tensor(w, "token_embd.weight", type, 2, ne, NULL);
		return;
	}
	if (k == 1 + 9 * L) {
		ne[0] = TINY_DIM;
		gw_tensor(w, "output_norm.weight", GW_F32, 1, ne, NULL);
		return;
	}
	if (k == 2 + 9 * L) {
		ne[0] = TINY_DIM, ne[1] = V;
		gw_tensor(w, "output.weight", type, 2, ne, NULL);
		return;
	}
	static const struct {
		const char *suffix;
		uint32_t cols, rows; /* 0: a vector */
	} roles[9] = {
	    {"attn_norm.weight", TINY_DIM, 0},
	    {"attn_q.weight", TINY_DIM, TINY_HEADS * TINY_HD},
	    {"attn_k.weight", TINY_DIM, TINY_KV * TINY_HD},
	    {"attn_v.weight", TINY_DIM, TINY_KV * TINY_HD},
	    {"attn_output.weight", TINY_HEADS * TINY_HD, TINY_DIM},
	    {"ffn_norm.weight", TINY_DIM, 0},
	    {"ffn_gate.weight", TINY_DIM, TINY_FFN},
	    {"ffn_up.weight", TINY_DIM, TINY_FFN},
	    {"ffn_down.weight", TINY_FFN, TINY_DIM},
	};
	uint32_t l = (k - 1) / 9, r = (k - 1) % 9;
	snprintf(name, sizeof(name), "blk.%u.%s", l, roles[r].suffix);
	ne[0] = roles[r].cols;
	ne[1] = roles[r].rows;
	gw_tensor(w, name, roles[r].rows ? type : GW_F32, roles[r].rows ? 2 : 1, ne, NULL);
}

void gw_tiny_llama_tensors(struct gw *w, const struct gw_llama *o, uint32_t first, uint32_t end)
{
	for (uint32_t k = first; k < end; k++)
		tiny_tensor(w, o, k);
}

void gw_tiny_llama(struct gw *w, const struct gw_llama *o)
{
	gw_tiny_llama_keys(w, o);
	gw_tiny_llama_tensors(w, o, 0, gw_tiny_llama_n_tensors(o));
}

/* ---- tokenizer keys from a tokenizer.json ---- */

static const char *merge_text(const json_t *m, char *buf, size_t len)
{
	if (json_is_string(m))
		return json_string_value(m);
	snprintf(buf, len, "%s %s", json_string_value(json_array_get(m, 0)), json_string_value(json_array_get(m, 1)));
	return buf;
}

int gw_tokenizer_from_hf(struct gw *w, const char *path, const char *model, const char *pre, uint32_t cut,
			 uint32_t n_added, int32_t bos, int32_t eos)
{
	json_error_t je;
	json_t *root = json_load_file(path, 0, &je);
	if (!root)
		return -1;
	json_t *vocab = json_object_get(json_object_get(root, "model"), "vocab");
	json_t *merges = json_object_get(json_object_get(root, "model"), "merges");
	json_t *added = json_object_get(root, "added_tokens");
	bool sp = !strcmp(model, "llama");
	const char *unk = json_string_value(json_object_get(json_object_get(root, "model"), "unk_token"));
	size_t n = 0;
	const char *key;
	json_t *val;
	json_object_foreach(vocab, key, val)
	{
		size_t id = (size_t)json_integer_value(val);
		if ((!cut || id < cut) && id + 1 > n)
			n = id + 1;
	}
	size_t n_vocab = n, n_add = 0;
	for (size_t i = 0; i < json_array_size(added); i++) {
		size_t id = (size_t)json_integer_value(json_object_get(json_array_get(added, i), "id"));
		if (cut) {
			if (n_add < n_added)
				id = n_vocab + n_add++;
			else
				continue;
		}
		if (id + 1 > n)
			n = id + 1;
	}
	const char **tok = calloc(n, sizeof(*tok));
	int32_t *type = calloc(n, sizeof(*type));
	float *score = calloc(n, sizeof(*score));
	if (!tok || !type || !score)
		abort();
	json_object_foreach(vocab, key, val)
	{
		size_t id = (size_t)json_integer_value(val);
		if (id >= n_vocab)
			continue;
		tok[id] = key;
		type[id] = sp && strlen(key) == 6 && !strncmp(key, "<0x", 3) && key[5] == '>' ? 6 : 1;
		score[id] = -1e6f - (float)id;
	}
	n_add = 0;
	for (size_t i = 0; i < json_array_size(added); i++) {
		json_t *a = json_array_get(added, i);
		size_t id = (size_t)json_integer_value(json_object_get(a, "id"));
		if (cut) {
			if (n_add >= n_added)
				continue;
			id = n_vocab + n_add++;
		}
		tok[id] = json_string_value(json_object_get(a, "content"));
		type[id] = json_is_true(json_object_get(a, "special")) ? 3 : 4;
		if (unk && !strcmp(tok[id], unk))
			type[id] = 2; /* llama.cpp's UNKNOWN */
	}
	for (size_t id = 0; id < n; id++)
		if (!tok[id]) {
			tok[id] = "<unused>";
			type[id] = 5;
		}
	/* Merges among the kept ids, in order; each one's result scores by its rank. */
	const char **mv = calloc(json_array_size(merges) + 1, sizeof(*mv));
	char **owned = calloc(json_array_size(merges) + 1, sizeof(*owned));
	size_t nm = 0;
	for (size_t i = 0; i < json_array_size(merges); i++) {
		char buf[512];
		const char *m = merge_text(json_array_get(merges, i), buf, sizeof(buf));
		const char *sp_ = strchr(m, ' ');
		char joined[512];
		snprintf(joined, sizeof(joined), "%.*s%s", (int)(sp_ - m), m, sp_ + 1);
		char left[512];
		snprintf(left, sizeof(left), "%.*s", (int)(sp_ - m), m);
		json_t *l = json_object_get(vocab, left), *r = json_object_get(vocab, sp_ + 1),
		       *j = json_object_get(vocab, joined);
		if (!l || !r || !j ||
		    (cut && ((uint32_t)json_integer_value(l) >= cut || (uint32_t)json_integer_value(r) >= cut ||
			     (uint32_t)json_integer_value(j) >= cut)))
			continue;
		owned[nm] = xstrdup(m);
		mv[nm] = owned[nm];
		if (sp && score[json_integer_value(j)] < -1e5f)
			score[json_integer_value(j)] = -(float)nm;
		nm++;
	}
	gw_str(w, "tokenizer.ggml.model", model);
	if (pre)
		gw_str(w, "tokenizer.ggml.pre", pre);
	gw_arr_str(w, "tokenizer.ggml.tokens", tok, NULL, n);
	gw_arr_i32(w, "tokenizer.ggml.token_type", type, n);
	if (sp)
		gw_arr_f32(w, "tokenizer.ggml.scores", score, n);
	else
		gw_arr_str(w, "tokenizer.ggml.merges", mv, NULL, nm);
	if (bos >= 0)
		gw_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)bos);
	if (eos >= 0)
		gw_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)eos);
	for (size_t i = 0; i < nm; i++)
		free(owned[i]);
	free(owned);
	free(mv);
	free(tok);
	free(type);
	free(score);
	json_decref(root);
	return 0;
}

/* gguf_test_parse.c - a minimal GGUF parser for the writer's tests (gguf_test_parse.h). */
#include "tests/unit/manifest/gguf_test_parse.h"

#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "tests/unit/manifest/manifest_test_util.h"

const struct ggml_type ggml_types[8] = {
	{0, DT_F32, 1, 4},   {1, DT_F16, 1, 2},	   {30, DT_BF16, 1, 2},	   {8, DT_Q8_0, 32, 34},
	{2, DT_Q4_0, 32, 18}, {12, DT_Q4_K, 256, 144}, {13, DT_Q5_K, 256, 176}, {14, DT_Q6_K, 256, 210},
};

int type_index(uint32_t ggml)
{
	for (int i = 0; i < (int)ARRAY_SIZE(ggml_types); i++)
		if (ggml_types[i].ggml == ggml)
			return i;
	ck_abort_msg("unknown ggml type %u", ggml);
	return -1;
}

static uint64_t rd(const struct gg *g, size_t *pos, size_t k)
{
	ck_assert_msg(*pos + k <= g->size, "GGUF truncated at %zu", *pos);
	uint64_t v = 0;
	for (size_t i = 0; i < k; i++)
		v |= (uint64_t)g->data[*pos + i] << (8 * i);
	*pos += k;
	return v;
}

static const char *rd_str(const struct gg *g, size_t *pos, size_t *len)
{
	uint64_t n = rd(g, pos, 8);
	ck_assert_msg(n <= g->size - *pos, "string of %llu bytes at %zu runs past the file", (unsigned long long)n,
		      *pos);
	const char *s = (const char *)g->data + *pos;
	*pos += n;
	*len = n;
	return s;
}

static size_t scalar_size(uint32_t t)
{
	static const size_t sz[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
	ck_assert_msg(t < ARRAY_SIZE(sz) && sz[t], "value type %u is not a scalar", t);
	return sz[t];
}

static void skip_value(const struct gg *g, size_t *pos, uint32_t t)
{
	size_t len;
	if (t == V_STR) {
		rd_str(g, pos, &len);
	} else if (t == V_ARR) {
		uint32_t at = (uint32_t)rd(g, pos, 4);
		uint64_t n = rd(g, pos, 8);
		for (uint64_t i = 0; i < n; i++)
			skip_value(g, pos, at);
	} else {
		rd(g, pos, scalar_size(t));
	}
}

struct gg *gg_open(const char *path)
{
	struct gg *g = calloc(1, sizeof(*g));
	ck_assert_ptr_nonnull(g);
	g->data = read_file(path, &g->size);
	size_t pos = 0, len;
	ck_assert_msg(g->size >= 24 && !memcmp(g->data, "GGUF", 4), "%s: no GGUF magic", path);
	pos = 4;
	ck_assert_uint_eq(rd(g, &pos, 4), 3); /* version */
	g->n_t = rd(g, &pos, 8);
	g->n_kv = rd(g, &pos, 8);
	ck_assert(g->n_t < 100000 && g->n_kv < 10000);
	g->kv = calloc(g->n_kv + 1, sizeof(*g->kv));
	g->t = calloc(g->n_t + 1, sizeof(*g->t));
	for (uint64_t i = 0; i < g->n_kv; i++) {
		struct gkv *k = &g->kv[i];
		const char *key = rd_str(g, &pos, &len);
		ck_assert(len > 0 && len < sizeof(k->key));
		memcpy(k->key, key, len);
		k->type = (uint32_t)rd(g, &pos, 4);
		if (k->type == V_STR) {
			k->s = rd_str(g, &pos, &k->slen);
		} else if (k->type == V_ARR) {
			k->atype = (uint32_t)rd(g, &pos, 4);
			k->an = rd(g, &pos, 8);
			k->apos = pos;
			for (uint64_t e = 0; e < k->an; e++)
				skip_value(g, &pos, k->atype);
		} else {
			k->u = rd(g, &pos, scalar_size(k->type));
		}
	}
	for (uint64_t i = 0; i < g->n_t; i++) {
		struct gti *t = &g->t[i];
		const char *name = rd_str(g, &pos, &len);
		ck_assert(len > 0 && len < sizeof(t->name));
		memcpy(t->name, name, len);
		t->ndim = (uint32_t)rd(g, &pos, 4);
		ck_assert(t->ndim >= 1 && t->ndim <= 4);
		uint64_t n = 1;
		for (uint32_t d = 0; d < 4; d++) {
			t->ne[d] = d < t->ndim ? rd(g, &pos, 8) : 1;
			n *= t->ne[d];
		}
		t->type = (uint32_t)rd(g, &pos, 4);
		t->off = rd(g, &pos, 8);
		int ty = type_index(t->type);
		ck_assert_msg(t->ne[0] % ggml_types[ty].blk == 0, "%s: rows do not hold whole blocks", t->name);
		t->nbytes = n / ggml_types[ty].blk * ggml_types[ty].bytes;
	}
	g->infos_end = pos;
	g->data_start = (pos + 31) / 32 * 32;
	return g;
}

void gg_close(struct gg *g)
{
	free(g->data);
	free(g->kv);
	free(g->t);
	free(g);
}

const struct gkv *kv(const struct gg *g, const char *key)
{
	for (uint64_t i = 0; i < g->n_kv; i++)
		if (!strcmp(g->kv[i].key, key))
			return &g->kv[i];
	return NULL;
}

uint64_t kv_u(const struct gg *g, const char *key, uint32_t type)
{
	const struct gkv *k = kv(g, key);
	ck_assert_msg(k != NULL, "no key %s", key);
	ck_assert_msg(k->type == type, "%s has type %u, not %u", key, k->type, type);
	return k->u;
}

float kv_f32(const struct gg *g, const char *key)
{
	uint32_t u = (uint32_t)kv_u(g, key, V_F32);
	float f;
	memcpy(&f, &u, 4);
	return f;
}

void kv_str_is(const struct gg *g, const char *key, const char *want)
{
	const struct gkv *k = kv(g, key);
	ck_assert_msg(k && k->type == V_STR, "no string key %s", key);
	ck_assert_msg(k->slen == strlen(want) && !memcmp(k->s, want, k->slen), "%s is \"%.*s\", not \"%s\"", key,
		      (int)k->slen, k->s, want);
}

/* Element i of an array of strings (or int32 when len is NULL). */
const char *kv_arr_at(const struct gg *g, const char *key, uint64_t i, size_t *len, int32_t *iv)
{
	const struct gkv *k = kv(g, key);
	ck_assert_msg(k && k->type == V_ARR && i < k->an, "no element %llu of %s", (unsigned long long)i, key);
	size_t pos = k->apos, l;
	if (k->atype == V_I32) {
		pos += 4 * i;
		*iv = (int32_t)rd(g, &pos, 4);
		return NULL;
	}
	ck_assert_uint_eq(k->atype, V_STR);
	for (uint64_t e = 0; e < i; e++)
		rd_str(g, &pos, &l);
	return rd_str(g, &pos, len);
}

const struct gti *tensor(const struct gg *g, const char *name)
{
	for (uint64_t i = 0; i < g->n_t; i++)
		if (!strcmp(g->t[i].name, name))
			return &g->t[i];
	return NULL;
}

const uint8_t *tdata(const struct gg *g, const struct gti *t)
{
	return g->data + g->data_start + t->off;
}

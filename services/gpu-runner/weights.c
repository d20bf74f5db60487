/* weights.c - describing a group's tensors where a weight source holds them (weights.h), and the
 * views of a split FFN's two shares. */
#include "services/gpu-runner/weights.h"

#include <string.h>

#include "common/manifest.h"

void weight_tensor_from_desc(struct weight_tensor *wt, const struct tensor_desc *t, enum weight_place place,
			     const void *data)
{
	uint32_t rows = t->ndim == 1 ? 1 : (uint32_t)t->shape[0];
	uint32_t cols = (uint32_t)(t->ndim == 1 ? t->shape[0] : t->shape[1]);
	weight_tensor_set(wt, place, data, (enum dtype)t->dtype, rows, cols);
}

void weights_fill_at(const struct weight_source *s, uint32_t group, enum weight_place place, const void *base,
		     const uint64_t *offsets, const void *embed_base, struct group_weights *w)
{
	memset(w, 0, sizeof(*w));
	const struct group_desc *g = &s->groups[group];
	for (uint32_t i = 0; i < g->n_tensors; i++) {
		uint32_t ti = g->first_tensor + i;
		const struct tensor_desc *t = &s->tensors[ti];
		weight_tensor_from_desc(&w->t[t->role], t, place,
					(const char *)base + (offsets ? offsets[ti] : t->slot_offset));
	}
	if (g->kind == GROUP_HEAD && !w->t[ROLE_LM_HEAD].rows) {
		int ti = model_find_tensor(s->cfg, s->tensors, s->groups, group, ROLE_LM_HEAD);
		if (ti >= 0 && embed_base)
			weight_tensor_from_desc(&w->t[ROLE_LM_HEAD], &s->tensors[ti], place,
						(const char *)embed_base +
							(offsets ? offsets[ti] : s->tensors[ti].slot_offset));
	}
}

void weights_fill(const struct weight_source *s, uint32_t group, const void *base, const void *embed_base,
		  struct group_weights *w)
{
	weights_fill_at(s, group, PLACE_HOST, base, NULL, embed_base, w);
}

void weight_tensor_rows(const struct weight_tensor *t, uint32_t r0, uint32_t n, struct weight_tensor *out)
{
	*out = *t;
	for (uint32_t p = 0; p < PLACE_COUNT; p++)
		if (t->data[p])
			out->data[p] = (const char *)t->data[p] + (uint64_t)r0 * t->row_bytes;
	out->row0 = t->row0 + r0;
	out->rows = n;
}

void weight_tensor_cols(const struct weight_tensor *t, uint32_t c0, uint32_t n, struct weight_tensor *out)
{
	*out = *t;
	for (uint32_t p = 0; p < PLACE_COUNT; p++)
		if (t->data[p])
			out->data[p] = (const char *)t->data[p] + dtype_row_bytes((enum dtype)t->format, c0);
	out->col0 = t->col0 + c0;
	out->cols = n;
}

static void split_roles(struct group_weights *w, uint32_t r, enum ffn_split_where where, enum tensor_role gr,
			enum tensor_role ur, enum tensor_role dr)
{
	struct weight_tensor *g = &w->t[gr], *u = &w->t[ur], *d = &w->t[dr];
	uint32_t ffn = g->rows;
	struct ffn_split *s = &w->split;
	memset(s, 0, sizeof(*s));
	s->where = where;
	s->r = r;
	weight_tensor_rows(g, r, ffn - r, &s->gate);
	weight_tensor_rows(u, r, ffn - r, &s->up);
	weight_tensor_cols(d, r, ffn - r, &s->down);
	weight_tensor_rows(g, 0, r, g);
	weight_tensor_rows(u, 0, r, u);
	weight_tensor_cols(d, 0, r, d);
}

void weights_split_ffn(struct group_weights *w, uint32_t r, enum ffn_split_where where)
{
	split_roles(w, r, where, ROLE_W_GATE, ROLE_W_UP, ROLE_W_DOWN);
}

void weights_split_expert(struct group_weights *w, uint32_t r, enum ffn_split_where where)
{
	split_roles(w, r, where, ROLE_EXPERT_GATE, ROLE_EXPERT_UP, ROLE_EXPERT_DOWN);
}

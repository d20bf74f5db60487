#include "services/gpu-runner/weights.h"

#include <string.h>

#include "common/manifest.h"

void weights_fill(const struct weight_source *s, uint32_t group, const void *base, const void *embed_base,
		  struct group_weights *w)
{
	memset(w, 0, sizeof(*w));
	const struct group_desc *g = &s->groups[group];
	for (uint32_t i = 0; i < g->n_tensors; i++) {
		const struct tensor_desc *t = &s->tensors[g->first_tensor + i];
		w->t[t->role] = (const char *)base + t->slot_offset;
		w->dtype[t->role] = t->dtype;
	}
	if (g->kind == GROUP_HEAD && !w->t[ROLE_LM_HEAD]) {
		int ti = model_find_tensor(s->cfg, s->tensors, s->groups, group, ROLE_LM_HEAD);
		if (ti >= 0 && embed_base) {
			w->t[ROLE_LM_HEAD] = (const char *)embed_base + s->tensors[ti].slot_offset;
			w->dtype[ROLE_LM_HEAD] = s->tensors[ti].dtype;
		}
	}
}

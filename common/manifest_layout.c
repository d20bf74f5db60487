/* manifest_layout.c - the groups laid out for slots: each group's tensors covered by read extents
 * aligned to MANIFEST_ALIGN (small gaps merged), each tensor's offset in its slot, the size
 * classes; and the manifest's hash. */
#include "common/manifest_internal.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"

#define MERGE_GAP	  (64ull << 10) /* reading a gap this small costs less than another request */
#define GROUP_MAX_TENSORS 8	       /* attn holds 5 (7 with q/k norms), the most of any group */

/* Sorts idx[0..n) by (file, offset): the order the disk wants to be read in. */
static void sort_by_position(const struct tensor_desc *t, uint32_t *idx, uint32_t n)
{
	for (uint32_t i = 1; i < n; i++) {
		uint32_t k = idx[i], j = i;
		while (j > 0 &&
		       (t[idx[j - 1]].file_index > t[k].file_index || (t[idx[j - 1]].file_index == t[k].file_index &&
								       t[idx[j - 1]].file_offset > t[k].file_offset))) {
			idx[j] = idx[j - 1];
			j--;
		}
		idx[j] = k;
	}
}

int mf_build_layout(struct manifest *m)
{
	const struct model_config *c = &m->cfg;
	m->n_groups = model_n_groups(c);
	m->groups = calloc(m->n_groups, sizeof(*m->groups));
	m->extents = calloc(m->n_tensors, sizeof(*m->extents)); /* never more extents than tensors */
	if (!m->groups || !m->extents)
		return -ENOMEM;
	for (uint32_t t = 0; t < m->n_tensors; t++) {
		struct group_desc *g = &m->groups[m->tensors[t].group];
		if (g->n_tensors == 0)
			g->first_tensor = t;
		g->n_tensors++;
	}
	uint32_t ne = 0;
	for (uint32_t gi = 0; gi < m->n_groups; gi++) {
		struct group_desc *g = &m->groups[gi];
		if (gi == group_id_embed()) {
			g->kind = GROUP_EMBED;
			g->size_class = CLASS_GLOBAL;
		} else if (gi == group_id_head(c)) {
			g->kind = GROUP_HEAD;
			g->size_class = CLASS_GLOBAL;
		} else {
			/* In a layer: attn, then the FFN (or the router), then the experts (model.h). */
			uint32_t k = (gi - 1) % model_layer_groups(c);
			g->layer = (gi - 1) / model_layer_groups(c);
			g->kind = k == 0 ? GROUP_ATTN : k == 1 ? (c->n_experts ? GROUP_MOE : GROUP_FFN) : GROUP_EXPERT;
			g->size_class = k == 0 ? CLASS_ATTN : k == 1 ? CLASS_FFN : CLASS_EXPERT;
			g->expert = k >= 2 ? k - 2 : 0;
		}
		assert(g->n_tensors >= 1 && g->n_tensors <= GROUP_MAX_TENSORS);
		uint32_t idx[GROUP_MAX_TENSORS];
		for (uint32_t k = 0; k < g->n_tensors; k++)
			idx[k] = g->first_tensor + k;
		sort_by_position(m->tensors, idx, g->n_tensors);
		g->first_extent = ne;
		uint64_t slot = 0;
		for (uint32_t k = 0; k < g->n_tensors; k++) {
			struct tensor_desc *t = &m->tensors[idx[k]];
			uint64_t b = t->file_offset & ~(uint64_t)(MANIFEST_ALIGN - 1);
			uint64_t e = ALIGN_UP(t->file_offset + t->nbytes, (uint64_t)MANIFEST_ALIGN);
			struct read_extent *x = ne > g->first_extent ? &m->extents[ne - 1] : NULL;
			if (x && x->file_index == t->file_index && b < x->file_offset + x->length + MERGE_GAP) {
				/* Touching, overlapping or a small gap: one read covers both. */
				uint64_t xe = x->file_offset + x->length;
				if (e > xe) {
					slot += e - xe;
					x->length = e - x->file_offset;
				}
			} else {
				x = &m->extents[ne++];
				x->group = gi;
				x->file_index = t->file_index;
				x->file_offset = b;
				x->length = e - b;
				x->slot_offset = slot;
				slot += e - b;
			}
			t->slot_offset = x->slot_offset + (t->file_offset - x->file_offset);
			g->tensor_bytes += t->nbytes;
		}
		g->n_extents = ne - g->first_extent;
		g->slot_bytes = slot;
		if (slot > m->class_bytes[g->size_class])
			m->class_bytes[g->size_class] = slot;
	}
	m->n_extents = ne;
	return 0;
}

/* Bytes of the weights themselves into the hash h: the first MF_HASH_SAMPLE bytes and those at
 * the middle of MF_HASH_TENSORS tensors spread over the table (in its order, which is the model's,
 * not the files': a model split into shards hashes as it does in one file), so that two
 * checkpoints of one shape (two fine-tunes, two of one model's quantizations with the same types)
 * do not share a hash, and with it their KV prefix keys and persisted KV. A piece that cannot be
 * read counts as its error. */
#define MF_HASH_TENSORS 64
#define MF_HASH_SAMPLE 1024
static uint64_t hash_samples(const struct manifest *m, uint64_t h)
{
	char buf[MF_HASH_SAMPLE];
	int fd = -1;
	uint32_t fd_file = UINT32_MAX;
	const uint32_t n = m->n_tensors < MF_HASH_TENSORS ? m->n_tensors : MF_HASH_TENSORS;
	for (uint32_t k = 0; k < n; k++) {
		const struct tensor_desc *t = &m->tensors[(uint64_t)k * m->n_tensors / n];
		if (t->file_index >= m->n_files)
			continue;
		if (t->file_index != fd_file) {
			if (fd >= 0)
				close(fd);
			fd = open(m->files[t->file_index].path, O_RDONLY | O_CLOEXEC);
			fd_file = t->file_index;
		}
		const uint64_t len = t->nbytes < MF_HASH_SAMPLE ? t->nbytes : MF_HASH_SAMPLE;
		const uint64_t at[2] = {t->file_offset, t->file_offset + (t->nbytes - len) / 2};
		for (int i = 0; i < 2 && len; i++) {
			ssize_t got = fd >= 0 ? pread(fd, buf, len, (off_t)at[i]) : -1;
			int e = got < 0 ? errno : 0;
			h = got > 0 ? fnv1a64(h, buf, (size_t)got) : fnv1a64(h, &e, sizeof(e));
		}
	}
	if (fd >= 0)
		close(fd);
	return h;
}

void mf_finish_summary(struct manifest *m)
{
	uint64_t h = fnv1a64(FNV64_INIT, &m->cfg, sizeof(m->cfg));
	uint32_t counts[DT_COUNT] = {0};
	m->total_tensor_bytes = 0;
	for (uint32_t i = 0; i < m->n_tensors; i++) {
		const struct tensor_desc *t = &m->tensors[i];
		h = fnv1a64(h, t->name, strlen(t->name) + 1);
		h = fnv1a64(h, &t->dtype, sizeof(t->dtype));
		h = fnv1a64(h, &t->ndim, sizeof(t->ndim));
		h = fnv1a64(h, t->shape, sizeof(t->shape));
		m->total_tensor_bytes += t->nbytes;
		if (t->ndim == 2)
			counts[t->dtype]++;
	}
	m->hash = hash_samples(m, h);
	m->weight_dtype = 0;
	for (uint32_t d = 1; d < DT_COUNT; d++)
		if (counts[d] > counts[m->weight_dtype])
			m->weight_dtype = d;
}

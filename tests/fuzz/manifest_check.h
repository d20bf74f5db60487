/* manifest_check.h - manifest.h's promises about a loaded manifest, for the fuzzers that load one
 * (fuzz_manifest, fuzz_gguf): every tensor inside its file and inside its group's slot, the read
 * extents aligned to MANIFEST_ALIGN and covering every tensor at its slot offset, the groups'
 * tensors contiguous and each role found by manifest_find_tensor. A broken promise aborts with a
 * message (a crash, to libFuzzer). Header-only: each harness is one program. */
#ifndef PIPELINE_FUZZ_MANIFEST_CHECK_H
#define PIPELINE_FUZZ_MANIFEST_CHECK_H
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/manifest.h"

#define MCHECK(cond, ...)                                                                                              \
	do {                                                                                                           \
		if (!(cond)) {                                                                                         \
			fprintf(stderr, "manifest check: %s: ", #cond);                                                \
			fprintf(stderr, __VA_ARGS__);                                                                  \
			fputc('\n', stderr);                                                                           \
			abort();                                                                                       \
		}                                                                                                      \
	} while (0)

/* manifest.h's promises about a loaded manifest. */
static inline void check_manifest(const struct manifest *m)
{
	MCHECK(m->n_files >= 1 && m->n_tensors >= 1 && m->n_groups >= 1, "empty manifest");
	MCHECK(m->n_groups == model_n_groups(&m->cfg), "%u groups, the config makes %u", m->n_groups,
	       model_n_groups(&m->cfg));
	uint64_t total = 0;
	for (uint32_t i = 0; i < m->n_tensors; i++) {
		const struct tensor_desc *t = &m->tensors[i];
		MCHECK(t->file_index < m->n_files, "tensor %s in file %u of %u", t->name, t->file_index, m->n_files);
		const struct manifest_file *f = &m->files[t->file_index];
		MCHECK(t->file_offset >= f->data_start && t->file_offset <= f->size &&
			   t->nbytes <= f->size - t->file_offset,
		       "tensor %s: [%llu, +%llu) outside %s (%llu bytes, data at %llu)", t->name,
		       (unsigned long long)t->file_offset, (unsigned long long)t->nbytes, f->path,
		       (unsigned long long)f->size, (unsigned long long)f->data_start);
		MCHECK(t->group < m->n_groups, "tensor %s in group %u", t->name, t->group);
		const struct group_desc *g = &m->groups[t->group];
		MCHECK(i >= g->first_tensor && i < g->first_tensor + g->n_tensors, "tensor %u outside its group's run",
		       i);
		MCHECK(t->slot_offset + t->nbytes <= g->slot_bytes,
		       "tensor %s: slot [%llu, +%llu) past the group's %llu bytes", t->name,
		       (unsigned long long)t->slot_offset, (unsigned long long)t->nbytes,
		       (unsigned long long)g->slot_bytes);
		/* The extent that lands at the tensor's slot offset must hold its bytes at that spot. */
		bool covered = false;
		for (uint32_t e = g->first_extent; e < g->first_extent + g->n_extents; e++) {
			const struct read_extent *x = &m->extents[e];
			if (x->file_index == t->file_index && t->file_offset >= x->file_offset &&
			    t->file_offset + t->nbytes <= x->file_offset + x->length &&
			    t->slot_offset == x->slot_offset + (t->file_offset - x->file_offset))
				covered = true;
		}
		MCHECK(covered, "tensor %s is not covered by an extent of its group", t->name);
		total += t->nbytes;
	}
	MCHECK(total == m->total_tensor_bytes, "total_tensor_bytes %llu, tensors add up to %llu",
	       (unsigned long long)m->total_tensor_bytes, (unsigned long long)total);
	MCHECK(m->n_extents <= m->n_tensors, "%u extents for %u tensors", m->n_extents, m->n_tensors);
	for (uint32_t e = 0; e < m->n_extents; e++) {
		const struct read_extent *x = &m->extents[e];
		MCHECK(x->group < m->n_groups && x->file_index < m->n_files, "extent %u: group %u, file %u", e,
		       x->group, x->file_index);
		MCHECK(x->file_offset % MANIFEST_ALIGN == 0 && x->length % MANIFEST_ALIGN == 0 &&
			   x->slot_offset % MANIFEST_ALIGN == 0 && x->length > 0,
		       "extent %u not aligned", e);
		const struct group_desc *g = &m->groups[x->group];
		MCHECK(e >= g->first_extent && e < g->first_extent + g->n_extents, "extent %u outside its group's run",
		       e);
		MCHECK(x->slot_offset + x->length <= g->slot_bytes, "extent %u past its group's slot", e);
		MCHECK(g->slot_bytes <= m->class_bytes[g->size_class], "group %u larger than its class", x->group);
	}
	for (uint32_t g = 0; g < m->n_groups; g++)
		for (int r = 0; r < ROLE_COUNT; r++) {
			int t = manifest_find_tensor(m, g, (enum tensor_role)r);
			MCHECK(t < (int)m->n_tensors, "manifest_find_tensor gave %d", t);
			if (t >= 0)
				MCHECK(
				    m->tensors[t].role == (uint32_t)r || (r == ROLE_LM_HEAD && m->cfg.tie_embeddings),
				    "manifest_find_tensor(%u, %d) gave a tensor of role %u", g, r, m->tensors[t].role);
		}
	MCHECK((m->tokenizer_json != NULL) == (m->tokenizer_bytes > 0), "tokenizer_json %p, %llu bytes",
	       (void *)m->tokenizer_json, (unsigned long long)m->tokenizer_bytes);
}

#endif

/* memory_source.c - the whole checkpoint in memory (memory_source.h): pread of each group's
 * read extents into a buffer per group, at the offsets its slot would give them. */
#include "tools/run-local/memory_source.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"

struct memory_source {
	struct weight_source base;
	const struct manifest *m;
	void **group_data; /* n_groups */
};

static int mem_acquire(struct weight_source *ws, uint32_t group, struct group_weights *w)
{
	struct memory_source *ms = (struct memory_source *)ws;
	ws->bytes_acquired += ws->groups[group].tensor_bytes;
	ws->acquires++;
	weights_fill(ws, group, ms->group_data[group], ms->group_data[group_id_embed()], w);
	return 0;
}

static int mem_release(struct weight_source *ws, uint32_t group)
{
	return 0;
}

static const struct weight_source_ops mem_ops = {.acquire = mem_acquire, .release = mem_release,
						 .release_all = NULL};

/* Reads group g's extents into its buffer from the open files fds. */
static int read_group(struct memory_source *ms, uint32_t g, const int *fds, char *err, size_t errlen)
{
	const struct manifest *m = ms->m;
	const struct group_desc *gd = &m->groups[g];
	ms->group_data[g] = aligned_alloc(MANIFEST_ALIGN, ALIGN_UP(gd->slot_bytes, MANIFEST_ALIGN) + MANIFEST_ALIGN);
	if (!ms->group_data[g])
		return errorf(err, errlen, -ENOMEM, "out of memory for group %u (%llu bytes)", g,
			      (unsigned long long)gd->slot_bytes);
	for (uint32_t e = 0; e < gd->n_extents; e++) {
		const struct read_extent *x = &m->extents[gd->first_extent + e];
		char *dst = (char *)ms->group_data[g] + x->slot_offset;
		uint64_t done = 0;
		while (done < x->length) {
			ssize_t n = pread(fds[x->file_index], dst + done, x->length - done, (off_t)(x->file_offset + done));
			if (n < 0)
				return errorf(err, errlen, -EIO, "reading %s: %s", m->files[x->file_index].path,
					      strerror(errno));
			if (n == 0)
				break; /* end of file: the extent's tail lies past it */
			done += (uint64_t)n;
		}
	}
	return 0;
}

int memory_source_create(const struct manifest *m, struct memory_source **out, char *err, size_t errlen)
{
	*out = NULL;
	struct memory_source *ms = calloc(1, sizeof(*ms));
	int *fds = calloc(m->n_files ? m->n_files : 1, sizeof(int));
	if (!ms || !fds || !(ms->group_data = calloc(m->n_groups, sizeof(void *)))) {
		free(fds);
		memory_source_destroy(&ms);
		return errorf(err, errlen, -ENOMEM, "out of memory");
	}
	ms->m = m;
	ms->base = (struct weight_source){.ops = &mem_ops, .cfg = &m->cfg, .tensors = m->tensors, .groups = m->groups,
					  .n_tensors = m->n_tensors, .n_groups = m->n_groups};
	int rc = 0;
	uint32_t opened = 0;
	for (; opened < m->n_files; opened++) {
		fds[opened] = open(m->files[opened].path, O_RDONLY | O_CLOEXEC);
		if (fds[opened] < 0) {
			rc = errorf(err, errlen, -errno, "cannot open %s: %s", m->files[opened].path, strerror(errno));
			break;
		}
	}
	for (uint32_t g = 0; g < m->n_groups && !rc; g++)
		rc = read_group(ms, g, fds, err, errlen);
	for (uint32_t i = 0; i < opened; i++)
		close(fds[i]);
	free(fds);
	if (rc) {
		memory_source_destroy(&ms);
		return rc;
	}
	*out = ms;
	return 0;
}

void memory_source_destroy(struct memory_source **msp)
{
	struct memory_source *ms = msp ? *msp : NULL;
	if (!ms)
		return;
	if (ms->group_data)
		for (uint32_t g = 0; g < ms->m->n_groups; g++)
			free(ms->group_data[g]);
	free(ms->group_data);
	free(ms);
	*msp = NULL;
}

struct weight_source *memory_source_base(struct memory_source *ms)
{
	return &ms->base;
}

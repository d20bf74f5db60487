/* memory_source.c - the whole checkpoint in memory (memory_source.h): pread of each group's
 * read extents into a buffer per group, at the offsets its slot would give them; for a backend
 * that computes from device memory (the CUDA backend), each group copied once into device memory
 * as well, every tensor at a DEV_TENSOR_ALIGN boundary of it (a slot keeps a tensor's offset in
 * its file, which a safetensors file aligns only to 8 bytes, its header's padding: the kernels'
 * 16-byte loads would not take it, and each product would fall back to cuBLAS), and its weights
 * given in both places. */
#include "tools/run-local/memory_source.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util.h"

#ifdef PIPELINE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

struct memory_source {
	struct weight_source base;
	const struct manifest *m;
	void **group_data; /* n_groups */
	void **group_dev;  /* NULL, or n_groups copies in device memory (memory_source_to_device) */
	uint64_t *dev_off; /* with group_dev: (n_tensors) each tensor's offset in its group's copy */
};

#define DEV_TENSOR_ALIGN 256 /* cudaMalloc's own alignment: every tensor starts as a group would */

static int mem_acquire(struct weight_source *ws, uint32_t group, struct group_weights *w)
{
	struct memory_source *ms = (struct memory_source *)ws;
	ws->bytes_acquired += ws->groups[group].tensor_bytes;
	ws->acquires++;
	weights_fill(ws, group, ms->group_data[group], ms->group_data[group_id_embed()], w);
	if (ms->group_dev && ms->group_dev[group]) {
		struct group_weights d;
		weights_fill_at(ws, group, PLACE_DEVICE, ms->group_dev[group], ms->dev_off, ms->group_dev[group_id_embed()],
				&d);
		for (uint32_t r = 0; r < ROLE_COUNT; r++)
			w->t[r].data[PLACE_DEVICE] = d.t[r].data[PLACE_DEVICE];
	}
	return 0;
}

static int mem_release(struct weight_source *ws, uint32_t group)
{
	return 0;
}

/* Every group is on the GPU once memory_source_to_device has copied them (the embedding table
 * only where the head is tied to it): a one-token MoE layer's experts are then routed on the
 * device, as in the services with every weight resident. */
static bool mem_kept(struct weight_source *ws, uint32_t group)
{
	const struct memory_source *ms = (const struct memory_source *)ws;
	return ms->group_dev && group < ms->m->n_groups && ms->group_dev[group];
}

static const struct weight_source_ops mem_ops = {.acquire = mem_acquire, .release = mem_release,
						 .release_all = NULL, .kept = mem_kept};

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

#ifdef PIPELINE_HAVE_CUDA
/* The device copies freed, the table with them (every weight in host memory only again). */
static void free_device(struct memory_source *ms)
{
	if (ms->group_dev)
		for (uint32_t g = 0; g < ms->m->n_groups; g++)
			if (ms->group_dev[g])
				cudaFree(ms->group_dev[g]);
	free(ms->group_dev);
	ms->group_dev = NULL;
	free(ms->dev_off);
	ms->dev_off = NULL;
}

/* Group g's tensors in its device copy: their offsets into ms->dev_off, the copy's size. */
static uint64_t device_layout(struct memory_source *ms, uint32_t g)
{
	const struct group_desc *gd = &ms->m->groups[g];
	uint64_t end = 0;
	for (uint32_t i = 0; i < gd->n_tensors; i++) {
		const uint32_t ti = gd->first_tensor + i;
		ms->dev_off[ti] = ALIGN_UP(end, DEV_TENSOR_ALIGN);
		end = ms->dev_off[ti] + ms->m->tensors[ti].nbytes;
	}
	return end;
}

/* Group g's tensors from its host buffer into its device copy, each at its offset. */
static cudaError_t copy_group(struct memory_source *ms, uint32_t g)
{
	const struct group_desc *gd = &ms->m->groups[g];
	cudaError_t ce = cudaSuccess;
	for (uint32_t i = 0; i < gd->n_tensors && ce == cudaSuccess; i++) {
		const struct tensor_desc *t = &ms->m->tensors[gd->first_tensor + i];
		ce = cudaMemcpy((char *)ms->group_dev[g] + ms->dev_off[gd->first_tensor + i],
				(const char *)ms->group_data[g] + t->slot_offset, t->nbytes, cudaMemcpyHostToDevice);
	}
	return ce;
}
#endif

int memory_source_to_device(struct memory_source *ms, char *err, size_t errlen)
{
#ifdef PIPELINE_HAVE_CUDA
	const struct manifest *m = ms->m;
	if (ms->group_dev)
		return 0;
	if (!(ms->group_dev = calloc(m->n_groups, sizeof(void *))) ||
	    !(ms->dev_off = calloc(m->n_tensors ? m->n_tensors : 1, sizeof(uint64_t)))) {
		free_device(ms);
		return errorf(err, errlen, -ENOMEM, "out of memory");
	}
	/* The embedding's rows are gathered from host memory: the table goes to the GPU only where
	 * the head is tied to it. */
	const uint32_t skip = m->cfg.tie_embeddings ? UINT32_MAX : group_id_embed();
	uint64_t total = 0;
	for (uint32_t g = 0; g < m->n_groups; g++)
		total += g == skip ? 0 : device_layout(ms, g);
	int rc = 0;
	for (uint32_t g = 0; g < m->n_groups && !rc; g++) {
		const uint64_t bytes = device_layout(ms, g);
		if (g == skip && g + 1 < m->n_groups)
			continue;
		cudaError_t ce = cudaMalloc(&ms->group_dev[g], bytes ? bytes : 1);
		if (ce != cudaSuccess)
			ms->group_dev[g] = NULL;
		/* From pageable memory a copy may return before it lands: the backend's stream does not
		 * wait for the legacy one, so the device is waited for below. */
		if (ce == cudaSuccess)
			ce = copy_group(ms, g);
		if (ce == cudaSuccess && g + 1 == m->n_groups)
			ce = cudaDeviceSynchronize();
		if (ce != cudaSuccess) {
			size_t free_b = 0, total_b = 0;
			(void)cudaGetLastError();
			(void)cudaMemGetInfo(&free_b, &total_b);
			rc = errorf(err, errlen, ce == cudaErrorMemoryAllocation ? -ENOMEM : -EIO,
				    "every weight on the GPU (%.2f GiB; the services stream what does not fit "
				    "their --gpu-budget): group %u of %u: %s (%.2f GiB free of %.2f)",
				    (double)total / (1u << 30), g, m->n_groups, cudaGetErrorString(ce),
				    (double)free_b / (1u << 30), (double)total_b / (1u << 30));
		}
	}
	if (rc) /* nothing half made: the weights stay in host memory only */
		free_device(ms);
	return rc;
#else
	(void)ms;
	return errorf(err, errlen, -ENOTSUP, "weights in device memory: this build has no CUDA");
#endif
}

void memory_source_destroy(struct memory_source **msp)
{
	struct memory_source *ms = msp ? *msp : NULL;
	if (!ms)
		return;
#ifdef PIPELINE_HAVE_CUDA
	free_device(ms);
#else
	free(ms->group_dev);
#endif
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

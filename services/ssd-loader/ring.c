/* ring.c - the weight ring's layout. See ring.h and common/weight_ring.h. */
#include "services/ssd-loader/ring.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "common/log.h"
#include "common/util.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

struct ring_layout {
	uint64_t tensors_off, groups_off, group_state_off, slots_off, tokenizer_off, chat_template_off, data_off, total;
};

static void layout(const struct manifest *m, const struct plan *p, struct ring_layout *l)
{
	uint64_t off = ALIGN_UP((uint64_t)sizeof(struct wring_header), (uint64_t)CACHE_LINE);
	l->tensors_off = off;
	off = ALIGN_UP(off + (uint64_t)m->n_tensors * sizeof(struct tensor_desc), (uint64_t)CACHE_LINE);
	l->groups_off = off;
	off = ALIGN_UP(off + (uint64_t)m->n_groups * sizeof(struct group_desc), (uint64_t)CACHE_LINE);
	l->group_state_off = off;
	off = ALIGN_UP(off + (uint64_t)m->n_groups * sizeof(struct wring_group), (uint64_t)CACHE_LINE);
	l->slots_off = off;
	off += (uint64_t)plan_n_slots(p) * sizeof(struct wring_slot);
	l->tokenizer_off = ALIGN_UP(off, (uint64_t)CACHE_LINE);
	off = l->tokenizer_off + m->tokenizer_bytes;
	l->chat_template_off = off;
	off += m->chat_template ? strlen(m->chat_template) : 0;
	l->data_off = ALIGN_UP(off, (uint64_t)PLAN_SLOT_ALIGN);
	l->total = l->data_off + plan_data_bytes(p);
}

uint64_t ring_memsize(const struct manifest *m, const struct plan *p)
{
	struct ring_layout l;
	layout(m, p, &l);
	return l.total;
}

void ring_init(void *mem, uint64_t size, const struct manifest *m, const struct plan *p)
{
	struct ring_layout l;
	layout(m, p, &l);
	assert(size >= l.total);
	assert((uintptr_t)mem % PLAN_SLOT_ALIGN == 0);
	assert(plan_n_groups(p) == m->n_groups);
	struct wring_header *h = mem;
	/* The shm_header belongs to shm.c; everything after it is ours. */
	memset((char *)h + sizeof(h->shm), 0, l.data_off - sizeof(h->shm));
	h->manifest_hash = m->hash;
	h->cfg = m->cfg;
	h->n_tensors = m->n_tensors;
	h->n_groups = m->n_groups;
	h->n_slots = plan_n_slots(p);
	h->all_resident = plan_all_resident(p);
	h->weight_dtype = m->weight_dtype;
	for (uint32_t c = 0; c < CLASS_COUNT; c++) {
		h->class_bytes[c] = plan_class_capacity(p, c);
		h->class_slots[c] = plan_class_slots(p, c);
	}
	h->tensors_off = l.tensors_off;
	h->groups_off = l.groups_off;
	h->group_state_off = l.group_state_off;
	h->slots_off = l.slots_off;
	h->data_off = l.data_off;
	h->data_bytes = plan_data_bytes(p);
	h->tokenizer_off = m->tokenizer_bytes ? l.tokenizer_off : 0;
	h->tokenizer_bytes = m->tokenizer_bytes;
	if (m->tokenizer_bytes)
		memcpy((char *)h + l.tokenizer_off, m->tokenizer_json, m->tokenizer_bytes);
	h->chat_template_bytes = m->chat_template ? strlen(m->chat_template) : 0;
	h->chat_template_off = h->chat_template_bytes ? l.chat_template_off : 0;
	if (h->chat_template_bytes)
		memcpy((char *)h + l.chat_template_off, m->chat_template, h->chat_template_bytes);
	h->total_tensor_bytes = m->total_tensor_bytes;
	memcpy(wring_tensors(h), m->tensors, (size_t)m->n_tensors * sizeof(struct tensor_desc));
	memcpy(wring_groups(h), m->groups, (size_t)m->n_groups * sizeof(struct group_desc));

	struct wring_group *gs = wring_group_state(h);
	for (uint32_t g = 0; g < m->n_groups; g++) {
		atomic_store(&gs[g].slot, WRING_NO_SLOT);
		atomic_store(&gs[g].pinned, plan_group_pinned(p, g) ? 1u : 0u);
		atomic_store(&gs[g].loads, 0);
	}
	struct wring_slot *slots = wring_slots(h);
	uint64_t off = l.data_off;
	for (uint32_t s = 0; s < plan_n_slots(p); s++) {
		uint32_t c = plan_slot_class(p, s);
		atomic_store(&slots[s].seq, 0);
		atomic_store(&slots[s].state, WSLOT_EMPTY);
		atomic_store(&slots[s].group, WRING_NO_GROUP);
		atomic_store(&slots[s].refs, 0);
		atomic_store(&slots[s].generation, 0);
		slots[s].size_class = c;
		slots[s].data_offset = off;
		slots[s].capacity = plan_class_capacity(p, c);
		off += slots[s].capacity;
	}
	atomic_store(&h->loader.position, 0);
}

int ring_create(const char *name, const struct manifest *m, const struct plan *p, struct shm_object **out,
		char *err, size_t errlen)
{
	uint64_t size = ring_memsize(m, p);
	if (size > SIZE_MAX) {
		snprintf(err, errlen, "the weight ring of %llu bytes does not fit this address space",
			 (unsigned long long)size);
		return -EINVAL;
	}
	struct shm_object *o = NULL;
	int rc = shm_object_create(name, (size_t)size, SHM_KIND_WEIGHT_RING, WRING_LAYOUT_VERSION, SHM_RECLAIM, &o,
				   NULL);
	if (rc) {
		char sz[32];
		if (rc == -EBUSY)
			snprintf(err, errlen,
				 "the weight ring %s belongs to a live process: another ssd-loader serves this instance "
				 "(stop it, or pick another --instance)",
				 name);
		else
			snprintf(err, errlen, "cannot create the weight ring %s of %s: %s", name,
				 format_size(size, sz, sizeof(sz)), strerror(-rc));
		return rc;
	}
	/* ftruncate gave zeroed pages and mmap a page-aligned base. Fault every page in now, once:
	 * an O_DIRECT read into a page that does not exist yet faults it in inside the submitting
	 * call, which stalls the loop and slows the first fill; with the pages there, reads can be
	 * issued inline, which reads faster than through io_uring's workers (measured on the lent
	 * H100 machine: 1.93 against 1.60 GB/s into a 4 GiB buffer, 4 MiB reads, 64 in flight). */
	uint64_t t0 = now_ns();
	if (madvise(shm_object_base(o), size, MADV_POPULATE_WRITE) != 0) {
		/* EINVAL: a kernel before 5.14, whose pages are touched one by one below. Anything else
		 * (EFAULT where /dev/shm had no room for a page, ENOMEM) is the ring not fitting: said
		 * here, where touching the page would kill the loader (SIGBUS, or the OOM killer). */
		const int e = errno;
		uint64_t room = 0;
		bool known = shm_room(&room) == 0;
		if (e != EINVAL || (known && size > room)) {
			char sz[32], fr[32] = "";
			static const char fix[] = "lower --dram-budget, or give /dev/shm more room (a container's --shm-size)";
			shm_object_close(&o, true);
			if (e != EINVAL) /* the room with the pages made so far given back */
				known = shm_room(&room) == 0;
			format_size(size, sz, sizeof(sz));
			if (known)
				format_size(room, fr, sizeof(fr));
			if (e == EINVAL)
				snprintf(err, errlen, "the weight ring of %s does not fit in shared memory (/dev/shm has %s "
					 "free): %s", sz, fr, fix);
			else if (known)
				snprintf(err, errlen, "the weight ring of %s does not fit in shared memory (%s; /dev/shm has "
					 "%s free): %s", sz, strerror(e), fr, fix);
			else
				snprintf(err, errlen, "the weight ring of %s does not fit in shared memory (%s): %s", sz,
					 strerror(e), fix);
			return e == EINVAL || e == EFAULT ? -ENOSPC : -e;
		}
		for (uint64_t off = 0; off < size; off += 4096)
			((volatile char *)shm_object_base(o))[off] = 0;
	}
	if (size > (1ull << 30))
		log_info("weight ring: %.1f GiB of pages faulted in in %.2f s", (double)size / (1u << 30),
			 (double)(now_ns() - t0) * 1e-9);
	ring_init(shm_object_base(o), size, m, p);
	*out = o;
	return 0;
}

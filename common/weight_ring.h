/* weight_ring.h - the DRAM tier of weights: a shared-memory object laid out by the
 * ssd-loader and read by the gpu-runner.
 *
 *   [struct wring_header][tensor_desc x n_tensors][group_desc x n_groups]
 *   [wring_group x n_groups][wring_slot x n_slots][tokenizer.json bytes][chat template bytes]
 *   ... [slot data, 4 KiB aligned]
 *
 * The checkpoint's tokenizer.json and chat template travel here too (as the loader read and
 * checked them), so the runner can turn text and chats into tokens without opening a model file.
 *
 * The loader owns the object (it alone writes slots and the group table); the runner maps
 * it read-only apart from its own cache line (runner.*), and learns of slots through
 * MSG_W_GRANT. A slot's data is valid for the runner between the grant and its release:
 * the loader never refills a slot whose refs are non-zero.
 *
 * Slot states: EMPTY -> LOADING -> READY -> (refs drop to 0, chosen for eviction) -> LOADING.
 * seq is odd while the loader writes a slot and even when it is stable; a reader that
 * finds seq odd, or seq changed across its read, has a torn view (it never should while it
 * holds a grant; the runner checks in --strict runs).
 */
#ifndef PIPELINE_WEIGHT_RING_H
#define PIPELINE_WEIGHT_RING_H
#include <stdalign.h>
#include <stdatomic.h>
#include <stdint.h>

#include "common/model.h"
#include "common/shm.h"
#ifdef __cplusplus
extern "C" {
#endif

#define WRING_LAYOUT_VERSION 5 /* 5: the chat template */
#define WRING_NO_GROUP UINT32_MAX
#define WRING_NO_SLOT UINT32_MAX

enum wring_slot_state {
	WSLOT_EMPTY = 0,
	WSLOT_LOADING = 1,
	WSLOT_READY = 2,
};

struct wring_slot {
	_Atomic uint32_t seq;	/* odd while being written */
	_Atomic uint32_t state; /* enum wring_slot_state */
	_Atomic uint32_t group; /* group held (or being loaded), WRING_NO_GROUP */
	_Atomic uint32_t refs;	/* grants outstanding */
	_Atomic uint64_t generation; /* bumped each time the slot is refilled */
	uint32_t size_class;
	uint32_t reserved;
	uint64_t data_offset;	/* bytes from the object base, 4 KiB aligned */
	uint64_t capacity;	/* bytes */
	uint64_t reserved2[2];
};
_Static_assert(sizeof(struct wring_slot) == 64, "one slot per cache line");

/* Per-group view kept by the loader, for inspection and a restarted runner. */
struct wring_group {
	_Atomic uint32_t slot;	/* slot holding the group, WRING_NO_SLOT */
	_Atomic uint32_t pinned;/* 1: stays resident (never evicted) */
	_Atomic uint64_t loads; /* times read from disk */
};

struct wring_header {
	struct shm_header shm;
	uint64_t manifest_hash;
	struct model_config cfg;
	uint32_t n_tensors, n_groups, n_slots, all_resident;
	uint32_t weight_dtype; /* enum dtype of the matrices */
	uint32_t reserved0;
	uint64_t class_bytes[CLASS_COUNT]; /* slot size per class */
	uint32_t class_slots[CLASS_COUNT]; /* slots per class */
	uint32_t reserved1;
	uint64_t tensors_off, groups_off, group_state_off, slots_off, data_off; /* from the base */
	uint64_t data_bytes;
	uint64_t total_tensor_bytes; /* the model's weights, all groups */
	uint64_t tokenizer_off, tokenizer_bytes; /* tokenizer.json; 0 and 0 when the model has none */
	uint64_t chat_template_off, chat_template_bytes; /* the chat template (Jinja text); 0 and 0 when none
							    * (added in layout 5) */

	/* Written by the loader only. */
	alignas(64) struct {
		_Atomic uint64_t bytes_read;	/* from disk, all time */
		_Atomic uint64_t reads_done;
		_Atomic uint64_t reads_pending; /* io_uring reads in flight */
		_Atomic uint64_t groups_loaded;
		_Atomic uint64_t grants;
		_Atomic uint64_t releases;
		_Atomic uint64_t waits;		/* acquires that had to wait for a read */
		_Atomic uint64_t position;	/* group id the loader reads ahead of: the first group of
						 * the latest acquire (added in layout 1, was padding) */
	} loader;
	/* Written by the runner only. */
	alignas(64) struct {
		_Atomic uint64_t position;	/* the group id the runner computes now */
		_Atomic uint64_t tokens;	/* tokens computed */
		_Atomic uint64_t bytes_acquired;/* group bytes granted to the runner (what crosses to it) */
	} runner;
	/* Written by the loader before the ring is ready: what the DRAM tier's plan costs, for the
	 * runner's prediction of the time per token. */
	alignas(64) struct {
		uint64_t disk_bytes_per_token; /* read from disk per pass over the model; 0 when resident */
		uint64_t disk_bytes_per_s;     /* measured at start (or given with --disk-bytes-per-s) */
	} plan;
};

static inline struct tensor_desc *wring_tensors(struct wring_header *h)
{
	return (struct tensor_desc *)((char *)h + h->tensors_off);
}
static inline struct group_desc *wring_groups(struct wring_header *h)
{
	return (struct group_desc *)((char *)h + h->groups_off);
}
static inline struct wring_group *wring_group_state(struct wring_header *h)
{
	return (struct wring_group *)((char *)h + h->group_state_off);
}
static inline struct wring_slot *wring_slots(struct wring_header *h)
{
	return (struct wring_slot *)((char *)h + h->slots_off);
}
static inline void *wring_slot_data(struct wring_header *h, const struct wring_slot *s)
{
	return (char *)h + s->data_offset;
}

#ifdef __cplusplus
}
#endif
#endif

/* shm.h - named POSIX shared-memory objects with an owner, for the DRAM tiers.
 *
 * Every object begins with struct shm_header: magic, kind, layout version, size, the
 * owner's pid and start time, and a ready flag. Nothing in an object holds a pointer;
 * each process derives its own from the base address and the offsets in the header.
 *
 * The owner (the service that lays the object out) calls shm_object_create():
 *  - the object is created with O_CREAT|O_EXCL and mode 0600;
 *  - a leftover of the same name whose owner is dead is reclaimed (unlinked and created
 *    anew), or, with SHM_ADOPT and a header that matches kind, version and size, adopted
 *    as it is (the kv-store keeps its pool across a restart this way);
 *  - a leftover whose owner is alive is refused with -EBUSY.
 * Other processes call shm_object_attach(), which checks magic, kind, version and the
 * ready flag.
 *
 *   struct shm_object *o;
 *   rc = shm_object_create("/llmp-0-default-weights", bytes, SHM_KIND_WEIGHT_RING,
 *                          WRING_LAYOUT_VERSION, SHM_RECLAIM, &o, NULL);
 *   struct shm_header *h = shm_object_base(o);   ... lay out, then shm_object_set_ready(o)
 *   shm_object_close(&o, true);                    // unmap and unlink
 */
#ifndef PIPELINE_SHM_H
#define PIPELINE_SHM_H
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/proc.h" /* process_start_time, process_alive: the owner fields */
#ifdef __cplusplus
extern "C" {
#endif

#define SHM_MAGIC 0x4d485350504c4c4cull /* "LLLPPSHM" little-endian */
#define SHM_NAME_MAX 96

enum shm_kind {
	SHM_KIND_WEIGHT_RING = 1,
	SHM_KIND_KV_POOL = 2,
	SHM_KIND_STAGE_LINK = 3, /* gpu-runner: the hops between the stages of a split model */
	SHM_KIND_TEST = 99,
};

enum shm_leftover {
	SHM_RECLAIM = 0, /* a dead owner's object is unlinked and created anew */
	SHM_ADOPT = 1,	 /* a dead owner's object that matches is taken over as it is */
};

/* The first bytes of every object. 128 bytes, two cache lines. */
struct shm_header {
	uint64_t magic;		  /* SHM_MAGIC */
	uint32_t kind;		  /* enum shm_kind */
	uint32_t layout_version;  /* the kind's own layout version */
	uint64_t total_size;	  /* bytes, the whole object */
	uint64_t instance_id;	  /* random, new each time the object is laid out */
	_Atomic int32_t owner_pid;
	uint32_t adoptions;	  /* times a restarted owner took the object over */
	uint64_t owner_start;	  /* owner's start time (clock ticks since boot), guards pid reuse */
	_Atomic uint32_t ready;	  /* 1 once the owner finished laying the object out */
	uint32_t reserved0;
	uint64_t created_unix_ns; /* wall-clock time of creation */
	uint8_t reserved[64];
};
_Static_assert(sizeof(struct shm_header) == 128, "shm_header is two cache lines");

struct shm_object;

/* Builds "/llmp-<uid>-<instance>-<object>" into buf. Returns 0 or -ENAMETOOLONG. */
int shm_object_name(const char *instance, const char *object, char *buf, size_t len);

/* Creates (or adopts, see above) the object `name` of `size` bytes and maps it read-write.
 * The header is filled in (ready = 0) unless the object was adopted, in which case *adopted
 * is set true and the contents are left as they were, with owner_pid updated.
 * Returns 0; -EBUSY when a live process owns an object of that name; -EPERM when another user
 * owns one (logged: it is neither adopted nor removed); -EINVAL for a bad name or size; other
 * -errno from shm_open/ftruncate/mmap. A leftover of ours that others may open (mode not 0600)
 * is laid out anew, never adopted. On failure nothing is left behind. */
int shm_object_create(const char *name, size_t size, uint32_t kind, uint32_t layout_version,
		      enum shm_leftover policy, struct shm_object **out, bool *adopted);

/* The bytes free in the file system that holds shared-memory objects (/dev/shm): an object's
 * size takes none of it until its pages are touched, and a page touched without room kills the
 * process (SIGBUS). Returns 0 or -errno (statvfs). */
int shm_room(uint64_t *free_bytes);
/* The bytes of o's pages that exist (touched so far; they take shm_room's room, and go back to it
 * when the object is removed). Returns 0 or -errno (shm_open, fstat). */
int shm_object_resident(const struct shm_object *o, uint64_t *bytes);

/* Maps an existing object. writable selects PROT_WRITE. Returns 0; -ENOENT when absent;
 * -EPERM (logged) when another user owns it or others may open it (its mode is not 0600: the
 * owner makes it so); -EPROTO when magic, kind or version differ; -EAGAIN when its owner has
 * not set ready. */
int shm_object_attach(const char *name, uint32_t kind, uint32_t layout_version, bool writable,
		      struct shm_object **out);

void *shm_object_base(const struct shm_object *o);
size_t shm_object_size(const struct shm_object *o);
const char *shm_object_get_name(const struct shm_object *o);

/* Publishes the layout: sets ready with release order (pairs with the acquire in attach). */
void shm_object_set_ready(struct shm_object *o);

/* Unmaps; with unlink, also removes the name. Safe on NULL and twice; NULLs *o. */
void shm_object_close(struct shm_object **o, bool unlink);

/* Does the process recorded in h own the object still (alive and same start time)? */
bool shm_owner_alive(const struct shm_header *h);

/* Reads the header of the object name ("/llmp-...", as shm_open names it) to say who owns it.
 * Returns 1 with *owner_pid set when a live process does (shm_owner_alive); 0 when none does (a
 * dead owner, or no header of ours: too short, another magic); -errno when it cannot be opened
 * (-ENOENT: no such object). */
int shm_object_owner(const char *name, int *owner_pid);

#ifdef __cplusplus
}
#endif
#endif

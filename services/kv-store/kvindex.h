/* kvindex.h - the spill file's on-disk index (--persist-dir): which spill slots hold which
 * cached block, so that the prefix cache outlives the kv-store and its shared memory.
 *
 * The file is a 64-byte header (magic, version, block_bytes, manifest_hash, n_slots, a
 * CRC-32C of the header) and one 32-byte record per spill slot (in use, key, checksum of the
 * block's bytes, last use, a CRC-32C of the record), in host byte order. Records are
 * rewritten with one pwrite each when a keyed block is spilled or its spill slot is freed,
 * and the whole file at a clean stop; a record is written only after the block's bytes are
 * in the spill file, so a crash leaves at worst a record whose block fails its checksum
 * (dropped when read, never served).
 *
 *   struct kvindex *ix;
 *   rc = kvindex_open("/var/lib/x/kv-spill.idx", &ix, err, sizeof(err));
 *   struct kvindex_geometry g = {.block_bytes = 65536, .manifest_hash = mh, .n_slots = 1024};
 *   rc = kvindex_load(ix, &g, recs, why, sizeof(why));      // 1: recs hold the file's records
 *   if (rc == 0) rc = kvindex_reset(ix, &g, err, sizeof(err)); // mismatch: start empty
 *   rc = kvindex_set(ix, slot, &(struct kvindex_record){.in_use = 1, .key = k, .checksum = c});
 *   rc = kvindex_clear(ix, slot);
 *   kvindex_close(&ix);
 *
 * Single-threaded.
 */
#ifndef PIPELINE_KVSTORE_KVINDEX_H
#define PIPELINE_KVSTORE_KVINDEX_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVINDEX_MAGIC 0x5849564b504d4c4cull /* "LLMPKVIX" little-endian */
#define KVINDEX_VERSION 1
#define KVINDEX_HEADER_BYTES 64u
#define KVINDEX_RECORD_BYTES 32u

/* What an index must match to be loaded. */
struct kvindex_geometry {
	uint64_t block_bytes;
	uint64_t manifest_hash;
	uint32_t n_slots; /* spill slots */
};

struct kvindex_record {
	uint32_t in_use;   /* 1: spill slot holds the block below; anything else: free */
	uint32_t checksum; /* CRC-32C of the block's bytes */
	uint64_t key;	   /* its prefix-chain key, never 0 when in use */
	uint64_t last_use; /* the kv-store's LRU tick when it was last used */
	uint32_t reserved;
	uint32_t crc;	   /* CRC-32C of the record with this field 0 (set by kvindex_set) */
};
_Static_assert(sizeof(struct kvindex_record) == KVINDEX_RECORD_BYTES, "index record");

struct kvindex;

/* Opens (creating it 0600) the index file at path and locks it (flock, exclusive) for as long
 * as it is open. Returns 0 and *out (owned by the caller: kvindex_close); -EBUSY when another
 * open file holds the lock (another kv-store); other -errno; err names the file and the
 * problem. */
int kvindex_open(const char *path, struct kvindex **out, char *err, size_t errlen);
/* Safe on NULL and twice; NULLs *ix. */
void kvindex_close(struct kvindex **ix);
const char *kvindex_path(const struct kvindex *ix);

/* Reads the file into recs (g->n_slots entries). Returns 1 when the header matches g (recs
 * filled; a record whose CRC does not match is returned free and counted in *bad, which may
 * be NULL); 0 when there is nothing to load: an empty file (why ""), or a header that
 * does not match g or is corrupt (why says how); -errno when the file cannot be read (why
 * says so). */
int kvindex_load(struct kvindex *ix, const struct kvindex_geometry *g, struct kvindex_record *recs, uint32_t *bad,
		 char *why, size_t whylen);

/* Writes a header for g and n_slots free records (the file is cut to that size). Returns 0 or
 * -errno (err says why). */
int kvindex_reset(struct kvindex *ix, const struct kvindex_geometry *g, char *err, size_t errlen);

/* Writes the header for g and every record (recs, g->n_slots of them; their crc fields are
 * set here) in one pwrite, and cuts the file to that size. Returns 0 or -errno. */
int kvindex_write_all(struct kvindex *ix, const struct kvindex_geometry *g, struct kvindex_record *recs,
		      char *err, size_t errlen);

/* Writes record `slot` (its crc set here); kvindex_clear writes a free one. The slot must be
 * below the n_slots of the last reset/write_all/load (asserted). Returns 0 or -errno. */
int kvindex_set(struct kvindex *ix, uint32_t slot, struct kvindex_record *r);
int kvindex_clear(struct kvindex *ix, uint32_t slot);

/* fdatasync: what was written survives a power loss. Returns 0 or -errno. */
int kvindex_sync(struct kvindex *ix);

#endif

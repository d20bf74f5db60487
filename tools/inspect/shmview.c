/* shmview.c - the weight ring and the KV pool, read-only. See inspect.h.
 *
 * Another process writes these objects while we read them: every count is a relaxed load of
 * one field, each slot is counted once (so counts by state always add up to the slot count,
 * even when states change during the pass), and every offset and count from the header is
 * checked against the mapping before it is followed. What is copied out inside the SIGBUS
 * guard goes into plain structs; JSON is built after it, so a longjmp leaks nothing. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kv_pool.h"
#include "common/util.h"
#include "common/weight_ring.h"
#include "tools/inspect/inspect.h"

#define MAX_GROUPS 4096 /* 2047 layers: far beyond any model; more means garbage */

#define LD(p) __atomic_load_n((p), __ATOMIC_RELAXED)

/* ---- SIGBUS guard: an object truncated under us reads as "went away", not a crash ---- */

static sigjmp_buf bus_env;
static volatile sig_atomic_t bus_armed;

static void on_sigbus(int sig)
{
	if (bus_armed) {
		bus_armed = 0;
		siglongjmp(bus_env, 1);
	}
	signal(sig, SIG_DFL);
	raise(sig);
}

static void guard_install(void)
{
	static bool done;
	if (done)
		return;
	struct sigaction sa = {.sa_handler = on_sigbus};
	sigemptyset(&sa.sa_mask);
	sigaction(SIGBUS, &sa, NULL);
	done = true;
}

/* ---- attaching ---- */

void shm_view_init(struct shm_view *v, const char *instance, const char *object, uint32_t kind, uint32_t version)
{
	memset(v, 0, sizeof(*v));
	if (shm_object_name(instance, object, v->name, sizeof(v->name)) != 0)
		v->name[0] = 0;
	v->kind = kind;
	v->version = version;
	guard_install();
}

void shm_view_close(struct shm_view *v)
{
	if (v->base)
		munmap((void *)v->base, v->len);
	v->base = NULL;
	v->len = 0;
}

/* Maps the object when it exists, again when it was replaced (another inode or size).
 * Returns 0 with v->base set, or -errno with why. */
static int view_attach(struct shm_view *v, char *why, size_t whylen)
{
	if (!v->name[0])
		return errorf(why, whylen, -ENAMETOOLONG, "the instance name is too long for a shared-memory name");
	int fd = shm_open(v->name, O_RDONLY | O_CLOEXEC, 0);
	if (fd < 0) {
		int e = errno;
		shm_view_close(v);
		return e == ENOENT ? errorf(why, whylen, -e, "no such object") : errorf(why, whylen, -e, "%s", strerror(e));
	}
	struct stat st;
	if (fstat(fd, &st) != 0) {
		int e = errno;
		close(fd);
		shm_view_close(v);
		return errorf(why, whylen, -e, "fstat: %s", strerror(e));
	}
	if (v->base && st.st_dev == v->dev && st.st_ino == v->ino && (uint64_t)st.st_size == v->len) {
		close(fd);
		return 0;
	}
	shm_view_close(v);
	if (st.st_size < (off_t)sizeof(struct shm_header)) {
		close(fd);
		return errorf(why, whylen, -EAGAIN, "being created (%lld bytes)", (long long)st.st_size);
	}
	/* The whole object, read-only: only the header and tables are ever touched. */
	void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
	int e = errno;
	close(fd);
	if (p == MAP_FAILED)
		return errorf(why, whylen, -e, "mmap: %s", strerror(e));
	v->base = p;
	v->len = (size_t)st.st_size;
	v->dev = st.st_dev;
	v->ino = st.st_ino;
	v->attaches++;
	return 0;
}

/* The shm_header fields a section reports. */
struct hdr_copy {
	uint64_t magic, total_size, instance_id, owner_start, created_ns;
	uint32_t kind, version, ready, adoptions;
	int32_t owner_pid;
};

static void copy_header(const struct shm_header *h, struct hdr_copy *c)
{
	c->magic = LD(&h->magic);
	c->kind = LD(&h->kind);
	c->version = LD(&h->layout_version);
	c->total_size = LD(&h->total_size);
	c->instance_id = LD(&h->instance_id);
	c->owner_pid = LD(&h->owner_pid);
	c->adoptions = LD(&h->adoptions);
	c->owner_start = LD(&h->owner_start);
	c->ready = LD(&h->ready);
	c->created_ns = LD(&h->created_unix_ns);
}

static int check_header(const struct shm_view *v, const struct hdr_copy *c, char *why, size_t whylen)
{
	if (c->magic != SHM_MAGIC)
		return errorf(why, whylen, -EPROTO, "not an object of the pipeline (bad magic)");
	if (c->kind != v->kind)
		return errorf(why, whylen, -EPROTO, "an object of kind %u, not %u", c->kind, v->kind);
	if (c->version != v->version)
		return errorf(why, whylen, -EPROTO, "layout version %u; this pipeline-inspect reads version %u",
			      c->version, v->version);
	if (c->total_size != v->len)
		return errorf(why, whylen, -EPROTO, "its header says %" PRIu64 " bytes, the object has %zu",
			      c->total_size, v->len);
	if (!c->ready)
		return errorf(why, whylen, -EAGAIN, "being laid out");
	return 0;
}

/* Does [off, off + n * each) lie inside the mapping, past the header, aligned for 8-byte loads? */
static bool table_fits(const struct shm_view *v, uint64_t off, uint64_t n, uint64_t each, uint64_t header)
{
	return off >= header && off % 8 == 0 && off <= v->len && n <= (v->len - off) / each;
}

static bool owner_alive(const struct hdr_copy *c)
{
	struct shm_header alive = {0};
	atomic_store(&alive.owner_pid, c->owner_pid);
	alive.owner_start = c->owner_start;
	return c->owner_pid > 0 && shm_owner_alive(&alive);
}

/* Not attached: why, and the owner when the header could be read (its tables could not). */
static json_t *section_absent(const struct shm_view *v, const char *why, const struct hdr_copy *c)
{
	json_t *o = json_pack("{s:s, s:b, s:s}", "name", v->name, "attached", 0, "error", why);
	if (o && c && c->magic == SHM_MAGIC) {
		json_object_set_new(o, "owner_pid", json_integer(c->owner_pid));
		json_object_set_new(o, "owner_alive", json_boolean(owner_alive(c)));
	}
	return o;
}

static json_t *section_header(const struct shm_view *v, const struct hdr_copy *c)
{
	char id[20];
	snprintf(id, sizeof(id), "%016" PRIx64, c->instance_id);
	return json_pack("{s:s, s:b, s:I, s:I, s:b, s:I, s:s, s:I, s:I, s:I}", "name", v->name, "attached", 1, "size",
			 (json_int_t)v->len, "owner_pid", (json_int_t)c->owner_pid, "owner_alive", owner_alive(c),
			 "adoptions", (json_int_t)c->adoptions,
			 "instance_id", id, "created_unix_ns", (json_int_t)c->created_ns, "layout_version",
			 (json_int_t)c->version, "attaches", (json_int_t)v->attaches);
}

/* ---- the weight ring ---- */

enum { RS_EMPTY, RS_LOADING, RS_READY, RS_HELD, RS_OTHER, RS_COUNT };

struct ring_snap {
	struct hdr_copy hdr;
	uint32_t n_layers, n_groups, n_slots, all_resident;
	uint32_t layer_groups; /* groups per layer: 2 (attn, ffn), or 2 + experts (attn, router, experts) */
	uint32_t class_slots[CLASS_COUNT];
	uint64_t class_bytes[CLASS_COUNT];
	uint64_t data_bytes, total_tensor_bytes;
	uint64_t loader[8], runner[3], plan[2];
	uint32_t by_state[RS_COUNT];
	uint32_t pinned_groups;
	char letter[MAX_GROUPS];
	bool pinned[MAX_GROUPS];
	uint64_t loads;
};

/* E empty, L loading, R ready, H ready and granted (held by the runner). */
static char ring_letter(const struct wring_group *gs, const struct wring_slot *slots, uint32_t n_slots, uint32_t g)
{
	uint32_t s = LD(&gs[g].slot);
	if (s >= n_slots || LD(&slots[s].group) != g)
		return 'E';
	switch (LD(&slots[s].state)) {
	case WSLOT_READY:
		return LD(&slots[s].refs) ? 'H' : 'R';
	case WSLOT_LOADING:
		return 'L';
	default:
		return 'E';
	}
}

static int ring_read(const struct shm_view *v, struct ring_snap *rs, char *why, size_t whylen)
{
	const struct wring_header *h = v->base;
	if (v->len < sizeof(*h))
		return errorf(why, whylen, -EPROTO, "smaller (%zu bytes) than a ring header", v->len);
	copy_header(&h->shm, &rs->hdr);
	int rc = check_header(v, &rs->hdr, why, whylen);
	if (rc)
		return rc;
	rs->n_layers = LD(&h->cfg.n_layers);
	rs->n_groups = LD(&h->n_groups);
	rs->n_slots = LD(&h->n_slots);
	rs->all_resident = LD(&h->all_resident);
	const uint32_t experts = LD(&h->cfg.n_experts);
	rs->layer_groups = experts < MAX_GROUPS ? 2 + experts : 0;
	if (rs->n_groups > MAX_GROUPS || !rs->layer_groups ||
	    rs->n_groups != 2 + (uint64_t)rs->layer_groups * rs->n_layers || !rs->n_slots || rs->n_slots > rs->n_groups)
		return errorf(why, whylen, -EPROTO, "implausible tables (%u layers of %u groups, %u groups, %u slots)",
			      rs->n_layers, rs->layer_groups, rs->n_groups, rs->n_slots);
	uint64_t gs_off = LD(&h->group_state_off), sl_off = LD(&h->slots_off);
	if (!table_fits(v, gs_off, rs->n_groups, sizeof(struct wring_group), sizeof(*h)) ||
	    !table_fits(v, sl_off, rs->n_slots, sizeof(struct wring_slot), sizeof(*h)))
		return errorf(why, whylen, -EPROTO, "its tables lie outside the object");
	for (int c = 0; c < CLASS_COUNT; c++) {
		rs->class_slots[c] = LD(&h->class_slots[c]);
		rs->class_bytes[c] = LD(&h->class_bytes[c]);
	}
	rs->data_bytes = LD(&h->data_bytes);
	rs->total_tensor_bytes = LD(&h->total_tensor_bytes);
	const _Atomic uint64_t *ld[] = {&h->loader.bytes_read, &h->loader.reads_done, &h->loader.reads_pending,
					&h->loader.groups_loaded, &h->loader.grants, &h->loader.releases,
					&h->loader.waits, &h->loader.position};
	for (size_t i = 0; i < ARRAY_SIZE(ld); i++)
		rs->loader[i] = LD(ld[i]);
	rs->runner[0] = LD(&h->runner.position);
	rs->runner[1] = LD(&h->runner.tokens);
	rs->runner[2] = LD(&h->runner.bytes_acquired);
	rs->plan[0] = LD(&h->plan.disk_bytes_per_token);
	rs->plan[1] = LD(&h->plan.disk_bytes_per_s);
	const struct wring_slot *slots = (const struct wring_slot *)((const char *)h + sl_off);
	const struct wring_group *gs = (const struct wring_group *)((const char *)h + gs_off);
	memset(rs->by_state, 0, sizeof(rs->by_state));
	for (uint32_t s = 0; s < rs->n_slots; s++) {
		uint32_t st = LD(&slots[s].state);
		int k = st == WSLOT_EMPTY ? RS_EMPTY
			: st == WSLOT_LOADING ? RS_LOADING
			: st == WSLOT_READY ? (LD(&slots[s].refs) ? RS_HELD : RS_READY)
					     : RS_OTHER;
		rs->by_state[k]++;
	}
	rs->pinned_groups = 0;
	rs->loads = 0;
	for (uint32_t g = 0; g < rs->n_groups; g++) {
		rs->letter[g] = ring_letter(gs, slots, rs->n_slots, g);
		rs->pinned[g] = LD(&gs[g].pinned) != 0;
		rs->pinned_groups += rs->pinned[g];
		rs->loads += LD(&gs[g].loads);
	}
	return 0;
}

/* Runs read(v, snap) with SIGBUS caught: an object truncated or replaced under the mapping
 * fails the read (-EFAULT, and the view is closed) instead of killing the inspector. */
typedef int (*snap_read_fn)(const struct shm_view *v, void *snap, char *why, size_t whylen);

static int read_guarded(struct shm_view *v, snap_read_fn read, void *snap, char *why, size_t whylen)
{
	int rc;
	bus_armed = 1;
	if (sigsetjmp(bus_env, 1) == 0)
		rc = read(v, snap, why, whylen);
	else
		rc = errorf(why, whylen, -EFAULT, "the object went away while being read");
	bus_armed = 0;
	if (rc == -EFAULT)
		shm_view_close(v);
	return rc;
}

static int ring_read_any(const struct shm_view *v, void *snap, char *why, size_t whylen)
{
	return ring_read(v, snap, why, whylen);
}

json_t *shm_view_ring(struct shm_view *v)
{
	char why[256];
	if (view_attach(v, why, sizeof(why)) != 0)
		return section_absent(v, why, NULL);
	static struct ring_snap rs;
	memset(&rs.hdr, 0, sizeof(rs.hdr));
	int rc = read_guarded(v, ring_read_any, &rs, why, sizeof(why));
	if (rc)
		return section_absent(v, why, rc == -EFAULT ? NULL : &rs.hdr);

	json_t *o = section_header(v, &rs.hdr);
	json_t *layers = json_array(), *pin_layers = json_array(), *expert_layers = json_array();
	const uint32_t lg = rs.layer_groups, head = 1 + lg * rs.n_layers;
	for (uint32_t l = 0; layers && pin_layers && expert_layers && l < rs.n_layers; l++) {
		/* The attention group and the FFN (or, with experts, the router) group; the experts'
		 * letters, and P where pinned, in a string of their own. */
		const uint32_t a = 1 + lg * l, f = a + 1;
		char pair[3] = {rs.letter[a], rs.letter[f], 0};
		char pin[3] = {rs.pinned[a] ? 'P' : '-', rs.pinned[f] ? 'P' : '-', 0};
		json_array_append_new(layers, json_string(pair));
		json_array_append_new(pin_layers, json_string(pin));
		if (lg > 2) {
			char ex[2 * MAX_GROUPS + 1];
			uint32_t k = 0;
			for (uint32_t e = 0; e < lg - 2; e++) {
				ex[k++] = rs.letter[f + 1 + e];
				ex[k++] = rs.pinned[f + 1 + e] ? 'P' : '-';
			}
			ex[k] = 0;
			json_array_append_new(expert_layers, json_string(ex));
		}
	}
	char embed[2] = {rs.letter[0], 0}, hd[2] = {rs.letter[head], 0};
	json_t *more = json_pack(
		"{s:i, s:i, s:i, s:b, s:{s:i, s:i, s:i, s:i}, s:I, s:I, s:{s:i, s:i, s:i, s:i, s:i}, s:i, s:I,"
		" s:{s:s, s:s, s:o*}, s:{s:b, s:b, s:o*},"
		" s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}, s:{s:I, s:I, s:I}, s:{s:I, s:I}}",
		"n_layers", (int)rs.n_layers, "n_groups", (int)rs.n_groups, "n_slots", (int)rs.n_slots, "all_resident",
		rs.all_resident != 0, "class_slots", "attn", (int)rs.class_slots[CLASS_ATTN], "ffn",
		(int)rs.class_slots[CLASS_FFN], "expert", (int)rs.class_slots[CLASS_EXPERT], "global",
		(int)rs.class_slots[CLASS_GLOBAL], "data_bytes",
		(json_int_t)rs.data_bytes, "model_bytes", (json_int_t)rs.total_tensor_bytes, "slots", "empty",
		(int)rs.by_state[RS_EMPTY], "loading", (int)rs.by_state[RS_LOADING], "ready", (int)rs.by_state[RS_READY],
		"held", (int)rs.by_state[RS_HELD], "other", (int)rs.by_state[RS_OTHER], "pinned_groups",
		(int)rs.pinned_groups, "group_loads", (json_int_t)rs.loads, "groups", "embed", embed, "head", hd, "layers",
		layers, "pinned", "embed", rs.pinned[0], "head", rs.pinned[head], "layers", pin_layers, "loader",
		"bytes_read", (json_int_t)rs.loader[0], "reads_done", (json_int_t)rs.loader[1], "reads_pending",
		(json_int_t)rs.loader[2], "groups_loaded", (json_int_t)rs.loader[3], "grants", (json_int_t)rs.loader[4],
		"releases", (json_int_t)rs.loader[5], "waits", (json_int_t)rs.loader[6], "position",
		(json_int_t)rs.loader[7], "runner", "position", (json_int_t)rs.runner[0], "tokens",
		(json_int_t)rs.runner[1], "bytes_acquired", (json_int_t)rs.runner[2], "plan", "disk_bytes_per_token",
		(json_int_t)rs.plan[0], "disk_bytes_per_s", (json_int_t)rs.plan[1]);
	if (!o || !more || json_object_update(o, more) != 0) {
		json_decref(o);
		o = NULL;
	}
	json_decref(more);
	/* With experts: groups.experts, a string per layer of a letter and a pin mark per expert. */
	json_t *grp = o ? json_object_get(o, "groups") : NULL;
	if (grp && lg > 2 && expert_layers)
		json_object_set_new(grp, "experts", expert_layers);
	else
		json_decref(expert_layers);
	return o;
}

/* ---- the KV pool ---- */

struct pool_snap {
	struct hdr_copy hdr;
	uint64_t block_bytes, manifest_hash, pool_epoch;
	uint32_t n_slots, n_handles, n_spill;
	uint64_t by_state[KVSLOT_LOADING + 2]; /* the last: a state no kv-store writes (torn or garbage) */
	uint64_t pinned;
	uint64_t h_writing, h_committed, cached, referenced, in_pool, in_spill;
	uint64_t store[14], runner[2];
};

static int pool_read(const struct shm_view *v, struct pool_snap *ps, char *why, size_t whylen)
{
	const struct kvpool_header *h = v->base;
	if (v->len < sizeof(*h))
		return errorf(why, whylen, -EPROTO, "smaller (%zu bytes) than a pool header", v->len);
	copy_header(&h->shm, &ps->hdr);
	int rc = check_header(v, &ps->hdr, why, whylen);
	if (rc)
		return rc;
	ps->block_bytes = LD(&h->block_bytes);
	ps->manifest_hash = LD(&h->manifest_hash);
	ps->pool_epoch = LD(&h->pool_epoch);
	ps->n_slots = LD(&h->n_slots);
	ps->n_handles = LD(&h->n_handles);
	ps->n_spill = LD(&h->n_spill_slots);
	uint64_t sl_off = LD(&h->slots_off), hd_off = LD(&h->handles_off);
	if (!ps->block_bytes || !ps->n_slots || (uint64_t)ps->n_slots + ps->n_spill != ps->n_handles ||
	    ps->n_handles >= (1u << 31))
		return errorf(why, whylen, -EPROTO, "implausible tables (%u blocks of %" PRIu64 " bytes, %u spill slots, "
			      "%u handles)", ps->n_slots, ps->block_bytes, ps->n_spill, ps->n_handles);
	if (!table_fits(v, sl_off, ps->n_slots, sizeof(struct kvpool_slot), sizeof(*h)) ||
	    !table_fits(v, hd_off, ps->n_handles, sizeof(struct kvpool_handle), sizeof(*h)))
		return errorf(why, whylen, -EPROTO, "its tables lie outside the object");
	const _Atomic uint64_t *st[] = {&h->store.allocs, &h->store.commits, &h->store.frees, &h->store.fetches,
					&h->store.fetches_from_disk, &h->store.spills, &h->store.spill_bytes_written,
					&h->store.spill_bytes_read, &h->store.checksum_failures, &h->store.slots_used,
					&h->store.spill_used, &h->store.prefix_hits, &h->store.prefix_misses,
					&h->store.cache_drops};
	for (size_t i = 0; i < ARRAY_SIZE(st); i++)
		ps->store[i] = LD(st[i]);
	ps->runner[0] = LD(&h->runner.blocks_written);
	ps->runner[1] = LD(&h->runner.blocks_read);
	const struct kvpool_slot *slots = (const struct kvpool_slot *)((const char *)h + sl_off);
	const struct kvpool_handle *hds = (const struct kvpool_handle *)((const char *)h + hd_off);
	memset(ps->by_state, 0, sizeof(ps->by_state));
	ps->pinned = 0;
	for (uint32_t s = 0; s < ps->n_slots; s++) {
		uint32_t state = LD(&slots[s].state);
		ps->by_state[state <= KVSLOT_LOADING ? state : KVSLOT_LOADING + 1]++;
		ps->pinned += LD(&slots[s].pins) > 0;
	}
	ps->h_writing = ps->h_committed = ps->cached = ps->referenced = ps->in_pool = ps->in_spill = 0;
	for (uint32_t i = 0; i < ps->n_handles; i++) {
		uint32_t state = LD(&hds[i].state), refs = LD(&hds[i].refs), loc = LD(&hds[i].location);
		if (state == KVH_FREE)
			continue;
		ps->h_writing += state == KVH_WRITING;
		ps->h_committed += state == KVH_COMMITTED;
		ps->cached += state == KVH_COMMITTED && refs == 0;
		ps->referenced += refs > 0;
		ps->in_pool += loc == KVLOC_POOL;
		ps->in_spill += loc == KVLOC_SPILL;
	}
	return 0;
}

static int pool_read_any(const struct shm_view *v, void *snap, char *why, size_t whylen)
{
	return pool_read(v, snap, why, whylen);
}

json_t *shm_view_pool(struct shm_view *v)
{
	char why[256];
	if (view_attach(v, why, sizeof(why)) != 0)
		return section_absent(v, why, NULL);
	static struct pool_snap ps;
	memset(&ps.hdr, 0, sizeof(ps.hdr));
	int rc = read_guarded(v, pool_read_any, &ps, why, sizeof(why));
	if (rc)
		return section_absent(v, why, rc == -EFAULT ? NULL : &ps.hdr);

	json_t *o = section_header(v, &ps.hdr);
	char epoch[20];
	snprintf(epoch, sizeof(epoch), "%016" PRIx64, ps.pool_epoch);
	json_t *more = json_pack(
		"{s:I, s:i, s:i, s:i, s:s, s:{s:I, s:I, s:I, s:I, s:I, s:I}, s:I, s:I, s:I, s:I,"
		" s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I},"
		" s:{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}, s:{s:I, s:I}}",
		"block_bytes", (json_int_t)ps.block_bytes, "n_blocks", (int)ps.n_slots, "n_spill_slots", (int)ps.n_spill,
		"n_handles", (int)ps.n_handles, "pool_epoch", epoch, "blocks", "free", (json_int_t)ps.by_state[KVSLOT_FREE],
		"writing", (json_int_t)ps.by_state[KVSLOT_WRITING], "committed", (json_int_t)ps.by_state[KVSLOT_COMMITTED],
		"spilling", (json_int_t)ps.by_state[KVSLOT_SPILLING], "loading", (json_int_t)ps.by_state[KVSLOT_LOADING],
		"other", (json_int_t)ps.by_state[KVSLOT_LOADING + 1], "pinned_blocks", (json_int_t)ps.pinned,
		"spill_queue", (json_int_t)ps.by_state[KVSLOT_SPILLING], "fetch_queue",
		(json_int_t)ps.by_state[KVSLOT_LOADING], "spill_used", (json_int_t)ps.in_spill, "handles", "live",
		(json_int_t)(ps.h_writing + ps.h_committed), "writing", (json_int_t)ps.h_writing, "committed",
		(json_int_t)ps.h_committed, "cached", (json_int_t)ps.cached, "referenced", (json_int_t)ps.referenced,
		"in_pool", (json_int_t)ps.in_pool, "in_spill", (json_int_t)ps.in_spill, "store", "allocs",
		(json_int_t)ps.store[0], "commits", (json_int_t)ps.store[1], "frees", (json_int_t)ps.store[2], "fetches",
		(json_int_t)ps.store[3], "fetches_from_disk", (json_int_t)ps.store[4], "spills", (json_int_t)ps.store[5],
		"spill_bytes_written", (json_int_t)ps.store[6], "spill_bytes_read", (json_int_t)ps.store[7],
		"checksum_failures", (json_int_t)ps.store[8], "slots_used", (json_int_t)ps.store[9], "spill_used",
		(json_int_t)ps.store[10], "prefix_hits", (json_int_t)ps.store[11], "prefix_misses",
		(json_int_t)ps.store[12], "cache_drops", (json_int_t)ps.store[13], "runner", "blocks_written",
		(json_int_t)ps.runner[0], "blocks_read", (json_int_t)ps.runner[1]);
	if (!o || !more || json_object_update(o, more) != 0) {
		json_decref(o);
		o = NULL;
	}
	json_decref(more);
	return o;
}

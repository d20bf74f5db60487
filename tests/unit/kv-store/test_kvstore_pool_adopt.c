/* Tests of adoption and runner sessions in the kv-store pool (services/kv-store/pool_adopt.c,
 * pool_requests.c) through pool.h: a child builds a pool and dies without closing it (mid-I/O,
 * with torn handle moves), and a new kv-store adopts what it left; HELLO keeps or lets go of
 * what a runner held, before and after an adoption. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/unit/kv-store/kvtest_pool.h"

/* ---- sessions ---- */

START_TEST(test_sessions)
{
	struct fx f;
	fx_open(&f, "/tmp", 8, 8);
	struct kvstore_hello r;
	kvstore_runner_hello(f.kv, 0x5e55, &r);
	ck_assert(!r.kept && !r.pending);
	ck_assert_uint_eq(H(&f)->runner_session, 0x5e55);
	uint64_t u = put_block(&f, 1);
	uint64_t k = put_keyed(&f, 2, 0x10);
	uint64_t c = put_keyed(&f, 3, 0x11);
	free1(&f, c);
	uint64_t p = put_keyed(&f, 4, 0x12), off, w;
	ck_assert_int_eq(kvstore_fetch(f.kv, &p, 1, &off, f.err, sizeof(f.err)), 0);
	ck_assert_int_eq(kvstore_alloc(f.kv, 1, &w, &off, f.err, sizeof(f.err)), 0);
	/* The same runner reconnecting: nothing changes. */
	kvstore_runner_hello(f.kv, 0x5e55, &r);
	ck_assert(r.kept);
	ck_assert_uint_eq(r.freed + r.cached + r.pins, 0);
	ck_assert_uint_eq(handle_of(&f, u)->refs, 1);
	ck_assert_uint_eq(slot_of(&f, p)->pins, 1);
	ck_assert_uint_eq(handle_of(&f, w)->state, KVH_WRITING);
	/* A new runner: every reference and pin goes; keyed committed blocks stay cached. */
	kvstore_runner_hello(f.kv, 0x6e66, &r);
	ck_assert(!r.kept);
	ck_assert_uint_eq(r.freed, 2);
	ck_assert_uint_eq(r.writing, 1);
	ck_assert_uint_eq(r.cached, 3);
	ck_assert_uint_eq(r.pins, 2);
	ck_assert_uint_eq(H(&f)->runner_session, 0x6e66);
	ck_assert_uint_eq(handle_of(&f, u)->state, KVH_FREE);
	ck_assert_uint_eq(handle_of(&f, w)->state, KVH_FREE);
	ck_assert_uint_eq(handle_of(&f, k)->refs, 0);
	ck_assert_uint_eq(handle_of(&f, p)->refs, 0);
	ck_assert_uint_eq(slot_of(&f, p)->pins, 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 3);
	ck_assert_uint_eq(stat_u64(&f, "referenced_blocks"), 0);
	ck_assert_uint_eq(lookup1(&f, 0x10), k);
	check_block(&f, k, 2);
	/* Session 0 never matches: each such HELLO is a new runner. */
	kvstore_runner_hello(f.kv, 0, &r);
	ck_assert(!r.kept);
	ck_assert_uint_eq(handle_of(&f, k)->refs, 0);
	kvstore_runner_hello(f.kv, 0, &r);
	ck_assert(!r.kept);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 3);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 3);
	/* A reconfigure (cached blocks do not hold it back) keeps the runner's session. */
	kvstore_runner_hello(f.kv, 0x7e77, &r);
	ck_assert_int_eq(kvstore_configure(f.kv, 2 * BB, HASH + 1, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 0);
	ck_assert_uint_eq(H(&f)->runner_session, 0x7e77);
	kvstore_runner_hello(f.kv, 0x7e77, &r);
	ck_assert(r.kept);
	fx_close(&f);
}
END_TEST

/* ---- adoption ---- */

/* The parent's side of a child that writes len bytes of its result into pfd[1] and exits 0. */
static void child_result(pid_t pid, int pfd[2], void *out, size_t len)
{
	close(pfd[1]);
	ck_assert_int_eq(read(pfd[0], out, len), (ssize_t)len);
	close(pfd[0]);
	int status;
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

struct crashed {
	uint64_t h[8];
	uint64_t epoch;
	uint32_t spilling_slot, loading_slot;
	uint64_t loading_handle;
};

/* In a child: build a pool of 6 blocks holding 8 (2 spilled), free one pooled block, and, with
 * mid_io, leave one slot SPILLING and the free one LOADING as a crash mid-I/O would. Then
 * _exit() without closing anything. */
static void crash_child(struct fx *f, bool mid_io, struct crashed *out)
{
	int pfd[2];
	ck_assert_int_eq(pipe(pfd), 0);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		close(pfd[0]);
		struct crashed c = {0};
		f->kv = fx_store(f, 6, 8);
		if (kvstore_configure(f->kv, BB, HASH, f->err, sizeof(f->err)))
			_exit(3);
		for (int i = 0; i < 8; i++)
			c.h[i] = put_block(f, 300 + (uint64_t)i);
		c.epoch = H(f)->pool_epoch;
		if (kvstore_free(f->kv, &c.h[7], 1, f->err, sizeof(f->err)))
			_exit(4);
		if (mid_io) {
			struct kvpool_slot *slots = kvpool_slots(H(f));
			c.spilling_slot = handle_of(f, c.h[3])->where;
			atomic_store(&slots[c.spilling_slot].state, KVSLOT_SPILLING);
			/* The slot block 7 left free. */
			for (uint32_t s = 0; s < 6; s++)
				if (atomic_load(&slots[s].state) == KVSLOT_FREE)
					c.loading_slot = s;
			c.loading_handle = c.h[0]; /* spilled */
			atomic_store(&slots[c.loading_slot].state, KVSLOT_LOADING);
			atomic_store(&slots[c.loading_slot].seq, 1);
			slots[c.loading_slot].handle_index = kv_handle_index(c.h[0]);
		}
		if (write(pfd[1], &c, sizeof(c)) != (ssize_t)sizeof(c))
			_exit(5);
		_exit(0);
	}
	child_result(pid, pfd, out, sizeof(*out));
}

START_TEST(test_adopt_after_crash)
{
	struct fx f;
	fx_names(&f, "/tmp");
	struct crashed c;
	crash_child(&f, false, &c);
	ck_assert_int_eq(access(f.spill, F_OK), 0);
	/* A new instance with other budgets adopts the pool as it was. */
	f.kv = fx_store(&f, 3, 3);
	int rc = kvstore_adopt(f.kv, f.err, sizeof(f.err));
	ck_assert_msg(rc == 1, "adopt: %d %s", rc, f.err);
	ck_assert(kvstore_adopted(f.kv));
	ck_assert_uint_eq(stat_u64(&f, "adopted"), 1);
	ck_assert_uint_eq(H(&f)->pool_epoch, c.epoch);
	ck_assert_uint_eq(H(&f)->n_slots, 6);
	ck_assert_int_eq(atomic_load(&H(&f)->shm.owner_pid), getpid());
	ck_assert_uint_eq(stat_u64(&f, "allocs"), 8); /* the counters live in the pool */
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 5);
	ck_assert_uint_eq(stat_u64(&f, "spill_used"), 2);
	expect_err(&f, kvstore_adopt(f.kv, f.err, sizeof(f.err)), -EALREADY, "already live");
	/* The configure that follows a restart keeps it. */
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(H(&f)->pool_epoch, c.epoch);
	for (int i = 0; i < 7; i++)
		check_block(&f, c.h[i], 300 + (uint64_t)i);
	uint64_t off;
	expect_err(&f, kvstore_fetch(f.kv, &c.h[7], 1, &off, f.err, sizeof(f.err)), -EINVAL, "stale");
	/* New blocks get fresh handles beside the adopted ones. */
	uint64_t n = put_block(&f, 999);
	check_block(&f, n, 999);
	check_block(&f, c.h[0], 300);
	fx_close(&f);
}
END_TEST

/* A budget larger than /dev/shm's room makes a pool cut to the room (its pages come as blocks are
 * written: filled past the room, the process writing a block would die, SIGBUS), and the log says
 * so; configured again, the same pool is kept. */
START_TEST(test_pool_larger_than_shm_cut)
{
	struct fx f;
	fx_names(&f, "/tmp");
	uint64_t room = 0;
	ck_assert_int_eq(shm_room(&room), 0);
	const uint64_t block = 64ull << 20; /* few, large blocks: the pool's tables stay small */
	const uint64_t blocks = room / block + 2;
	if (blocks * block > SIZE_MAX / 2)
		return; /* no pool this address space maps is larger than the room */
	struct kvstore_config cfg = {.shm_name = f.shm, .spill_path = f.spill, .dram_budget = blocks * block,
				     .disk_budget = 0, .io_depth = 8};
	ck_assert_int_eq(kvstore_create(&cfg, &f.kv), 0);
	/* The log's lines (stderr) into a file while the pool is made. */
	fflush(stderr);
	FILE *cap = tmpfile();
	ck_assert_ptr_nonnull(cap);
	const int saved = dup(2);
	ck_assert_int_ge(saved, 0);
	ck_assert_int_ge(dup2(fileno(cap), 2), 0);
	const int rc = kvstore_configure(f.kv, block, HASH, f.err, sizeof(f.err));
	fflush(stderr);
	dup2(saved, 2);
	close(saved);
	ck_assert_msg(rc == 0, "configure: %s", f.err);
	char text[4096] = "";
	rewind(cap);
	size_t n = fread(text, 1, sizeof(text) - 1, cap);
	text[n] = 0;
	fclose(cap);
	ck_assert_msg(strstr(text, "more than /dev/shm's") && strstr(text, "--kv-dram-budget"),
		      "no warning in the log: '%s'", text);
	const uint32_t cut = H(&f)->n_slots;
	ck_assert_msg(cut < blocks && (uint64_t)cut * block <= room, "%u blocks of %llu bytes for a room of %llu",
		      cut, (unsigned long long)block, (unsigned long long)room);
	const uint64_t epoch = H(&f)->pool_epoch;
	ck_assert_msg(kvstore_configure(f.kv, block, HASH, f.err, sizeof(f.err)) == 0, "configure again: %s", f.err);
	ck_assert_uint_eq(H(&f)->pool_epoch, epoch);
	ck_assert_uint_eq(H(&f)->n_slots, cut);
	fx_close(&f);
}
END_TEST

START_TEST(test_adopt_recovers_mid_io)
{
	struct fx f;
	fx_names(&f, "/tmp");
	struct crashed c;
	crash_child(&f, true, &c);
	f.kv = fx_store(&f, 6, 8);
	ck_assert_int_eq(kvstore_adopt(f.kv, f.err, sizeof(f.err)), 1);
	struct kvpool_slot *slots = kvpool_slots(H(&f));
	/* SPILLING -> COMMITTED, the handle still in the pool. */
	ck_assert_uint_eq(atomic_load(&slots[c.spilling_slot].state), KVSLOT_COMMITTED);
	ck_assert_uint_eq(handle_of(&f, c.h[3])->location, KVLOC_POOL);
	ck_assert_uint_eq(handle_of(&f, c.h[3])->where, c.spilling_slot);
	/* LOADING -> FREE, the handle still in the spill file. */
	ck_assert_uint_eq(atomic_load(&slots[c.loading_slot].state), KVSLOT_FREE);
	ck_assert_uint_eq(atomic_load(&slots[c.loading_slot].seq) % 2, 0);
	ck_assert_uint_eq(slots[c.loading_slot].handle_index, KV_NONE);
	ck_assert_uint_eq(handle_of(&f, c.loading_handle)->location, KVLOC_SPILL);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 5);
	for (int i = 0; i < 7; i++)
		check_block(&f, c.h[i], 300 + (uint64_t)i);
	fx_close(&f);
}
END_TEST

/* Maps the pool a crashed child left (to forge what a kill -9 at another point leaves). */
static struct kvpool_header *map_leftover(struct fx *f, size_t *size)
{
	int fd = shm_open(f->shm, O_RDWR, 0);
	ck_assert_int_ge(fd, 0);
	struct stat st;
	ck_assert_int_eq(fstat(fd, &st), 0);
	void *p = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	ck_assert_ptr_ne(p, MAP_FAILED);
	close(fd);
	*size = (size_t)st.st_size;
	return p;
}

START_TEST(test_adopt_recovers_torn_handle_moves)
{
	struct fx f;
	fx_names(&f, "/tmp");
	struct crashed c;
	crash_child(&f, false, &c);
	size_t size;
	struct kvpool_header *h = map_leftover(&f, &size);
	struct kvpool_handle *hd = kvpool_handles(h);
	struct kvpool_slot *slots = kvpool_slots(h);
	/* A kill -9 between the stores that move a handle leaves it saying "pool" with the index
	 * of a spill slot, which may be another block's pool slot. (1) make_room: a pooled block
	 * being spilled (its slot SPILLING), its handle naming the pool slot of a block with a
	 * higher index. */
	int lo = -1, hi = -1, sp = -1;
	for (int i = 0; i < 7; i++) {
		uint32_t idx = kv_handle_index(c.h[i]);
		if (hd[idx].location == KVLOC_POOL) {
			if (lo < 0 || idx < kv_handle_index(c.h[lo]))
				lo = i;
			if (hi < 0 || idx > kv_handle_index(c.h[hi]))
				hi = i;
		} else if (sp < 0) {
			sp = i;
		}
	}
	ck_assert(lo >= 0 && hi >= 0 && lo != hi && sp >= 0);
	struct kvpool_handle *a = &hd[kv_handle_index(c.h[lo])];
	uint32_t a_slot = a->where;
	atomic_store(&slots[a_slot].state, KVSLOT_SPILLING);
	a->where = hd[kv_handle_index(c.h[hi])].where;
	/* (2) load_batch: a spilled block read back and checked into the free slot (LOADING,
	 * seq odd), its handle already saying "pool" but still naming its spill slot, which is
	 * another block's pool slot. */
	uint32_t free_slot = UINT32_MAX;
	for (uint32_t s = 0; s < h->n_slots; s++)
		if (atomic_load(&slots[s].state) == KVSLOT_FREE)
			free_slot = s;
	ck_assert_uint_ne(free_slot, UINT32_MAX);
	struct kvpool_handle *b = &hd[kv_handle_index(c.h[sp])];
	ck_assert_uint_lt(b->where, h->n_slots);
	ck_assert_uint_ne(atomic_load(&slots[b->where].state), KVSLOT_FREE);
	atomic_store(&slots[free_slot].seq, 1);
	slots[free_slot].handle_index = kv_handle_index(c.h[sp]);
	atomic_store(&slots[free_slot].state, KVSLOT_LOADING);
	kvt_fill((char *)h + h->data_off + (uint64_t)free_slot * h->block_bytes, h->block_bytes, 300 + (uint64_t)sp);
	b->location = KVLOC_POOL;
	munmap(h, size);

	f.kv = fx_store(&f, 6, 8);
	ck_assert_int_eq(kvstore_adopt(f.kv, f.err, sizeof(f.err)), 1);
	/* The torn ones stay in the slots that name them, and no block is lost for another's
	 * torn move. */
	ck_assert_uint_eq(handle_of(&f, c.h[lo])->where, a_slot);
	ck_assert_uint_eq(atomic_load(&kvpool_slots(H(&f))[a_slot].state), KVSLOT_COMMITTED);
	ck_assert_uint_eq(handle_of(&f, c.h[sp])->where, free_slot);
	ck_assert_uint_eq(atomic_load(&kvpool_slots(H(&f))[free_slot].seq) % 2, 0);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 6);
	for (int i = 0; i < 7; i++)
		check_block(&f, c.h[i], 300 + (uint64_t)i);
	fx_close(&f);
}
END_TEST

/* In a child: a pool of 4 blocks whose runner said HELLO with session, holding a referenced
 * keyed block kk, a referenced unkeyed block u and a cached block c (key 0x22); then _exit(). */
struct sess_crash {
	uint64_t kk, u, c;
};

static void session_child(struct fx *f, uint64_t session, struct sess_crash *out)
{
	int pfd[2];
	ck_assert_int_eq(pipe(pfd), 0);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		close(pfd[0]);
		struct sess_crash c;
		struct kvstore_hello r;
		f->kv = fx_store(f, 4, 8);
		if (kvstore_configure(f->kv, BB, HASH, f->err, sizeof(f->err)))
			_exit(3);
		kvstore_runner_hello(f->kv, session, &r);
		c.kk = put_keyed(f, 1, 0x21);
		c.u = put_block(f, 2);
		c.c = put_keyed(f, 3, 0x22);
		if (kvstore_free(f->kv, &c.c, 1, f->err, sizeof(f->err)))
			_exit(4);
		if (write(pfd[1], &c, sizeof(c)) != (ssize_t)sizeof(c))
			_exit(5);
		_exit(0);
	}
	child_result(pid, pfd, out, sizeof(*out));
}

START_TEST(test_session_across_adoption)
{
	struct fx f;
	struct sess_crash c;
	struct kvstore_hello r;
	fx_names(&f, "/tmp");
	session_child(&f, 0xaaa, &c);
	f.kv = fx_store(&f, 4, 8);
	ck_assert_int_eq(kvstore_adopt(f.kv, f.err, sizeof(f.err)), 1);
	/* References, the session and the prefix index survive the restart. */
	ck_assert_uint_eq(H(&f)->runner_session, 0xaaa);
	ck_assert_uint_eq(handle_of(&f, c.kk)->refs, 1);
	ck_assert_uint_eq(handle_of(&f, c.u)->refs, 1);
	ck_assert_uint_eq(handle_of(&f, c.c)->refs, 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 1);
	ck_assert_uint_eq(lookup1(&f, 0x22), c.c);
	ck_assert_uint_eq(lookup1(&f, 0x21), c.kk);
	free1(&f, c.c);
	free1(&f, c.kk);
	kvstore_runner_hello(f.kv, 0xaaa, &r);
	ck_assert(r.kept);
	check_block(&f, c.kk, 1);
	check_block(&f, c.u, 2);
	kvstore_runner_hello(f.kv, 0xbbb, &r);
	ck_assert(!r.kept);
	ck_assert_uint_eq(r.freed, 1);
	ck_assert_uint_eq(r.cached, 2);
	ck_assert(gone(&f, c.u));
	fx_close(&f);

	/* A HELLO before there is a pool is compared when CONFIGURE adopts one: the same session
	 * keeps the blocks ... */
	fx_names(&f, "/tmp");
	session_child(&f, 0xccc, &c);
	f.kv = fx_store(&f, 4, 8);
	kvstore_runner_hello(f.kv, 0xccc, &r);
	ck_assert(r.pending);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert(kvstore_adopted(f.kv));
	check_block(&f, c.u, 2);
	fx_close(&f);
	/* ... another lets them go. */
	fx_names(&f, "/tmp");
	session_child(&f, 0xccc, &c);
	f.kv = fx_store(&f, 4, 8);
	kvstore_runner_hello(f.kv, 0xddd, &r);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert(kvstore_adopted(f.kv));
	ck_assert_uint_eq(H(&f)->runner_session, 0xddd);
	ck_assert(gone(&f, c.u));
	ck_assert_uint_eq(handle_of(&f, c.kk)->refs, 0);
	ck_assert_uint_eq(stat_u64(&f, "cached_blocks"), 2);
	fx_close(&f);
}
END_TEST

START_TEST(test_adopt_rebuilds_index_and_refs)
{
	/* An adopted table whose entries contradict the reference rules is repaired. */
	struct fx f;
	fx_names(&f, "/tmp");
	struct sess_crash c;
	session_child(&f, 0x1, &c);
	size_t size;
	struct kvpool_header *h = map_leftover(&f, &size);
	struct kvpool_handle *hd = kvpool_handles(h);
	/* u loses its reference (unkeyed: it goes), kk takes c's key while c stays cached (the
	 * more recently used one keeps the key, the other goes as it is unreferenced). */
	hd[kv_handle_index(c.u)].refs = 0;
	hd[kv_handle_index(c.kk)].key = 0x22;
	hd[kv_handle_index(c.kk)].last_use = hd[kv_handle_index(c.c)].last_use + 10;
	munmap(h, size);
	f.kv = fx_store(&f, 4, 8);
	ck_assert_int_eq(kvstore_adopt(f.kv, f.err, sizeof(f.err)), 1);
	ck_assert(gone(&f, c.u));
	ck_assert(gone(&f, c.c));
	ck_assert_uint_eq(lookup1(&f, 0x22), c.kk);
	ck_assert_uint_eq(lookup1(&f, 0x21), 0);
	ck_assert_uint_eq(stat_u64(&f, "pool_used"), 1);
	check_block(&f, c.kk, 1);
	fx_close(&f);
}
END_TEST

START_TEST(test_adopt_at_configure)
{
	struct fx f;
	fx_names(&f, "/tmp");
	struct crashed c;
	crash_child(&f, false, &c);
	/* No kvstore_adopt: the configure with the same geometry and model adopts. */
	f.kv = fx_store(&f, 6, 8);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert(kvstore_adopted(f.kv));
	ck_assert_uint_eq(H(&f)->pool_epoch, c.epoch);
	for (int i = 0; i < 7; i++)
		check_block(&f, c.h[i], 300 + (uint64_t)i);
	fx_close(&f);
}
END_TEST

START_TEST(test_adopted_pool_takes_new_budgets)
{
	/* Adopted at the start with the size it had (6 blocks, 8 spill), restarted with other budgets:
	 * the runner's configure of the same model lays it out for them once no block is live (it
	 * kept the old size for good: the same model is configured again and again). */
	struct fx f;
	fx_names(&f, "/tmp");
	struct crashed c;
	crash_child(&f, false, &c);
	f.kv = fx_store(&f, 10, 12);
	ck_assert_int_eq(kvstore_adopt(f.kv, f.err, sizeof(f.err)), 1);
	ck_assert_uint_eq(H(&f)->n_slots, 6);
	/* Blocks referenced (the crashed runner's seven, one more): the size is kept for now, and the
	 * blocks with it. */
	uint64_t ref = put_block(&f, 77);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(H(&f)->n_slots, 6);
	check_block(&f, c.h[0], 300);
	ck_assert_int_eq(kvstore_free(f.kv, &ref, 1, f.err, sizeof(f.err)), 0);
	ck_assert_int_eq(kvstore_free(f.kv, c.h, 7, f.err, sizeof(f.err)), 0); /* the crashed runner's */
	/* None live: laid out anew for 10 and 12. */
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(H(&f)->n_slots, 10);
	ck_assert_uint_eq(H(&f)->n_spill_slots, 12);
	ck_assert_uint_ne(H(&f)->pool_epoch, c.epoch);
	/* ... and kept at the next configure. */
	const uint64_t epoch = H(&f)->pool_epoch;
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH, f.err, sizeof(f.err)), 0);
	ck_assert_uint_eq(H(&f)->pool_epoch, epoch);
	fx_close(&f);
}
END_TEST

START_TEST(test_configure_replaces_other_model)
{
	struct fx f;
	fx_names(&f, "/tmp");
	struct crashed c;
	crash_child(&f, false, &c);
	/* Another model: the leftover is replaced, its handles are gone, the spill file emptied. */
	f.kv = fx_store(&f, 6, 8);
	ck_assert_int_eq(kvstore_configure(f.kv, BB, HASH + 1, f.err, sizeof(f.err)), 0);
	ck_assert(!kvstore_adopted(f.kv));
	ck_assert_uint_ne(H(&f)->pool_epoch, c.epoch);
	ck_assert_uint_eq(stat_u64(&f, "allocs"), 0);
	struct stat st;
	ck_assert_int_eq(stat(f.spill, &st), 0);
	ck_assert_int_eq(st.st_size, 0);
	uint64_t off;
	ck_assert_int_eq(kvstore_fetch(f.kv, &c.h[0], 1, &off, f.err, sizeof(f.err)), -EINVAL);
	fx_close(&f);
}
END_TEST

START_TEST(test_adopt_refuses_live_owner)
{
	struct fx f;
	fx_open(&f, "/tmp", 4, 4);
	uint64_t h = put_block(&f, 1);
	struct fx g = f;
	g.kv = fx_store(&g, 4, 4);
	expect_err(&g, kvstore_adopt(g.kv, g.err, sizeof(g.err)), -EBUSY, "live process");
	expect_err(&g, kvstore_configure(g.kv, BB, HASH, g.err, sizeof(g.err)), -EBUSY, f.shm);
	kvstore_destroy(&g.kv, false);
	check_block(&f, h, 1);
	fx_close(&f);
}
END_TEST

START_TEST(test_clean_stop_without_pool_removes_leftover)
{
	struct fx f;
	fx_names(&f, "/tmp");
	struct crashed c;
	crash_child(&f, false, &c);
	f.kv = fx_store(&f, 6, 8);
	fx_close(&f); /* destroy with remove: the dead predecessor's pool and spill file go */
}
END_TEST

static Suite *pool_adopt_suite(void)
{
	Suite *s = suite_create("kvstore_pool_adopt");
	TCase *tc = kvt_tcase(s, "sessions");
	tcase_add_test(tc, test_sessions);
	tcase_add_test(tc, test_session_across_adoption);
	tcase_add_test(tc, test_adopt_rebuilds_index_and_refs);

	tc = kvt_tcase(s, "adoption");
	tcase_add_test(tc, test_adopt_after_crash);
	tcase_add_test(tc, test_adopt_recovers_mid_io);
	tcase_add_test(tc, test_pool_larger_than_shm_cut);
	tcase_add_test(tc, test_adopt_recovers_torn_handle_moves);
	tcase_add_test(tc, test_adopt_at_configure);
	tcase_add_test(tc, test_configure_replaces_other_model);
	tcase_add_test(tc, test_adopted_pool_takes_new_budgets);
	tcase_add_test(tc, test_adopt_refuses_live_owner);
	tcase_add_test(tc, test_clean_stop_without_pool_removes_leftover);
	return s;
}

int main(void)
{
	return kvt_main(pool_adopt_suite());
}

/* test_loader.c - loader.c in-process: no sockets; grants and errors are collected through
 * the callbacks and io_uring completions are driven by loader_process_io. A simulated runner
 * walks the groups in visit order for three full cycles with 1 and 2 streaming slots per
 * class and all resident; every grant's slot must hold exactly the file's bytes, and stay so
 * until released. */
#include <check.h>
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/shm.h"
#include "common/util.h"
#include "common/weight_ring.h"
#include "services/ssd-loader/loader.h"
#include "services/ssd-loader/plan.h"
#include "services/ssd-loader/reader_internal.h"
#include "services/ssd-loader/ring.h"
#include "tests/unit/ssd-loader/loader_test_util.h"

#define MAX_GRANTS 4096
#define MAX_FAILS 64

struct grant_rec {
	uint64_t corr;
	struct msg_w_grant g;
	bool taken;
};

struct fixture {
	char *dir, *model;
	struct manifest *m;
	struct plan *p;
	void *mem;
	uint64_t size;
	struct wring_header *h;
	struct loader *l;
	struct bus_peer peer;
	int refuse_grants;
	uint32_t n_grants, n_fails;
	struct grant_rec grants[MAX_GRANTS];
	struct {
		uint64_t corr;
		int code;
		char text[1024];
	} fails[MAX_FAILS];
};

static int on_grant(void *ctx, const struct bus_peer *peer, uint64_t corr, const struct msg_w_grant *g)
{
	struct fixture *fx = ctx;
	ck_assert_uint_eq(peer->id_len, fx->peer.id_len);
	if (fx->refuse_grants)
		return -EHOSTUNREACH;
	ck_assert_uint_lt(fx->n_grants, MAX_GRANTS);
	fx->grants[fx->n_grants++] = (struct grant_rec){.corr = corr, .g = *g};
	return 0;
}

static void on_fail(void *ctx, const struct bus_peer *peer, uint64_t corr, int code, const char *text)
{
	struct fixture *fx = ctx;
	ck_assert_uint_lt(fx->n_fails, MAX_FAILS);
	fx->fails[fx->n_fails].corr = corr;
	fx->fails[fx->n_fails].code = code;
	snprintf(fx->fails[fx->n_fails].text, sizeof(fx->fails[0].text), "%s", text);
	fx->n_fails++;
}

static uint64_t cap(const struct manifest *m, int c)
{
	return ALIGN_UP(m->class_bytes[c], (uint64_t)PLAN_SLOT_ALIGN);
}

/* Reads at or past cut_at find the end of the file (fx_open_cut): the file looks cut there to the
 * loader, while it stays what the manifest read (a file really cut is refused at the reader's
 * open: another file than the manifest's). */
static uint64_t cut_at;

static void prep_cut(struct io_uring_sqe *sqe, int fd, void *buf, unsigned nbytes, __u64 offset)
{
	if (cut_at && offset + nbytes > cut_at)
		offset += 1ull << 40; /* past any end: the read comes back short */
	io_uring_prep_read(sqe, fd, buf, nbytes, offset);
}

/* A loader over a fresh tiny model of n_layers layers with k streaming slots per class
 * (k == 0: all resident). The model is written under base; cut: the file's reads end at this
 * many bytes (0: they do not). */
static struct fixture *fx_open_cut(const char *base, uint32_t n_layers, uint32_t k, bool buffered, uint64_t cut)
{
	struct fixture *fx = calloc(1, sizeof(*fx));
	ck_assert_ptr_nonnull(fx);
	fx->dir = th_tmpdir(base);
	fx->model = lt_make_model(fx->dir, n_layers);
	fx->m = lt_load(fx->model);
	cut_at = cut;
	reader_hooks = (struct reader_hooks){.prep_read = cut ? prep_cut : NULL};
	const struct manifest *m = fx->m;
	uint64_t budget = k ? 2 * cap(m, CLASS_GLOBAL) + k * (cap(m, CLASS_ATTN) + cap(m, CLASS_FFN)) : 1ull << 34;
	char err[512];
	ck_assert_msg(plan_create(m, budget, &fx->p, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(plan_all_resident(fx->p), k == 0);
	if (k)
		ck_assert_uint_eq(plan_streaming_slots(fx->p, CLASS_ATTN), k);
	fx->size = ring_memsize(m, fx->p);
	fx->mem = aligned_alloc(4096, ALIGN_UP(fx->size, 4096));
	ck_assert_ptr_nonnull(fx->mem);
	memset(fx->mem, 0, fx->size);
	ring_init(fx->mem, fx->size, m, fx->p);
	fx->h = fx->mem;
	struct loader_params lp = {.m = m, .plan = fx->p, .ring = fx->h, .ring_bytes = fx->size, .io_depth = 8,
				   .max_read = 8192, .buffered = buffered};
	struct loader_ops ops = {.grant = on_grant, .fail = on_fail};
	ck_assert_msg(loader_create(&lp, &ops, fx, &fx->l, err, sizeof(err)) == 0, "%s", err);
	memcpy(fx->peer.id, "runner", 6);
	fx->peer.id_len = 6;
	loader_start(fx->l);
	return fx;
}

static struct fixture *fx_open(const char *base, uint32_t n_layers, uint32_t k, bool buffered)
{
	return fx_open_cut(base, n_layers, k, buffered, 0);
}

static void fx_close(struct fixture *fx)
{
	loader_destroy(&fx->l);
	loader_destroy(&fx->l);
	reader_hooks = (struct reader_hooks){0};
	cut_at = 0;
	ck_assert_ptr_null(fx->l);
	plan_destroy(&fx->p);
	manifest_destroy(&fx->m);
	free(fx->mem);
	th_rmtree(fx->dir);
	free(fx->dir);
	free(fx->model);
	free(fx);
}

static void drain_io(struct fixture *fx)
{
	while (loader_io_busy(fx->l))
		ck_assert_int_ge(loader_process_io(fx->l, true), 0);
}

/* Finds the (not yet taken) grant of group for corr; NULL if none. */
static struct grant_rec *find_grant(struct fixture *fx, uint64_t corr, uint32_t group)
{
	for (uint32_t i = 0; i < fx->n_grants; i++)
		if (!fx->grants[i].taken && fx->grants[i].corr == corr && fx->grants[i].g.group == group)
			return &fx->grants[i];
	return NULL;
}

/* Drives completions until the grant arrives; fails if the loader goes idle without it. */
static struct grant_rec *wait_grant(struct fixture *fx, uint64_t corr, uint32_t group)
{
	for (;;) {
		struct grant_rec *r = find_grant(fx, corr, group);
		if (r) {
			r->taken = true;
			return r;
		}
		ck_assert_msg(loader_io_busy(fx->l), "acquire %llu of group %u is never granted (position %u)",
			      (unsigned long long)corr, group, loader_position(fx->l));
		ck_assert_int_ge(loader_process_io(fx->l, true), 0);
	}
}

/* The slot of a grant holds the group, stable, with the file's bytes. */
static void check_grant(struct fixture *fx, const struct msg_w_grant *g)
{
	ck_assert_uint_lt(g->slot, fx->h->n_slots);
	struct wring_slot *s = &wring_slots(fx->h)[g->slot];
	ck_assert_uint_eq(atomic_load(&s->state), WSLOT_READY);
	ck_assert_uint_eq(atomic_load(&s->group), g->group);
	ck_assert_uint_eq(atomic_load(&s->seq) % 2, 0);
	ck_assert_uint_eq(atomic_load(&s->generation), g->generation);
	ck_assert_uint_ge(atomic_load(&s->refs), 1);
	ck_assert_uint_eq(s->data_offset, g->offset);
	ck_assert_uint_eq(g->bytes, fx->m->groups[g->group].slot_bytes);
	ck_assert_uint_le(g->bytes, s->capacity);
	ck_assert_uint_eq(atomic_load(&wring_group_state(fx->h)[g->group].slot), g->slot);
	lt_check_group(fx->m, (uint32_t)g->group, (char *)fx->h + g->offset);
}

/* The runner: acquire each group in visit order, releasing the one before, for cycles.
 * paused: let the reads finish before each acquire (a runner slower than the disk): then
 * read-ahead must have every group ready, and each acquire is granted at once. */
static void run_cycles_as(struct fixture *fx, int cycles, bool paused)
{
	uint32_t n = fx->m->n_groups;
	uint64_t corr = 100;
	struct msg_w_grant held = {0};
	bool holding = false;
	char err[512];
	for (int c = 0; c < cycles; c++) {
		for (uint32_t g = 0; g < n; g++) {
			/* What we hold was never refilled behind our back. */
			if (holding)
				check_grant(fx, &held);
			uint64_t want = g, rel = held.group;
			if (paused)
				drain_io(fx);
			int rc = loader_acquire(fx->l, 0, &fx->peer, corr, &want, 1, holding ? &rel : NULL, holding ? 1 : 0,
						err, sizeof(err));
			ck_assert_msg(rc == 0, "%s", err);
			if (paused)
				ck_assert_msg(find_grant(fx, corr, g) != NULL, "group %u was not read ahead (cycle %d)", g,
					      c);
			ck_assert_uint_eq(fx->h->loader.position, g);
			struct grant_rec *r = wait_grant(fx, corr, g);
			check_grant(fx, &r->g);
			held = r->g;
			holding = true;
			corr++;
		}
	}
	uint64_t rel = held.group;
	ck_assert_int_eq(loader_release(fx->l, 0, &rel, 1, err, sizeof(err)), 0);
	drain_io(fx);
	for (uint32_t s = 0; s < fx->h->n_slots; s++)
		ck_assert_uint_eq(atomic_load(&wring_slots(fx->h)[s].refs), 0);
	ck_assert_uint_eq(fx->n_fails, 0);
	ck_assert_uint_eq(loader_waiters(fx->l), 0);
	ck_assert_uint_eq(fx->h->loader.grants, (uint64_t)cycles * n);
	ck_assert_uint_eq(fx->h->loader.releases, (uint64_t)cycles * n);
	if (paused)
		ck_assert_uint_eq(fx->h->loader.waits, 0);
}

static void run_cycles(struct fixture *fx, int cycles)
{
	run_cycles_as(fx, cycles, false);
}

/* Each streaming group is read once per cycle (plus the read-ahead into a next cycle);
 * pinned groups once. */
static void check_loads(struct fixture *fx, int cycles)
{
	uint64_t total = 0;
	for (uint32_t g = 0; g < fx->m->n_groups; g++) {
		uint64_t loads = atomic_load(&wring_group_state(fx->h)[g].loads);
		total += loads;
		if (plan_group_pinned(fx->p, g))
			ck_assert_msg(loads == 1, "pinned group %u read %llu times", g, (unsigned long long)loads);
		else
			ck_assert_msg(loads >= (uint64_t)cycles && loads <= (uint64_t)cycles + 1,
				      "group %u read %llu times in %d cycles", g, (unsigned long long)loads, cycles);
	}
	ck_assert_uint_eq(fx->h->loader.groups_loaded, total);
}

START_TEST(stream_k1_three_cycles)
{
	struct fixture *fx = fx_open("/tmp", 4, 1, false);
	ck_assert_uint_eq(fx->h->n_slots, 4);
	run_cycles(fx, 3);
	check_loads(fx, 3);
	fx_close(fx);
}
END_TEST

START_TEST(stream_k2_three_cycles)
{
	struct fixture *fx = fx_open("/tmp", 4, 2, false);
	ck_assert_uint_eq(fx->h->n_slots, 6);
	run_cycles(fx, 3);
	check_loads(fx, 3);
	fx_close(fx);
}
END_TEST

START_TEST(read_ahead_keeps_a_paused_runner_fed)
{
	for (uint32_t k = 1; k <= 2; k++) {
		struct fixture *fx = fx_open("/tmp", 4, k, false);
		run_cycles_as(fx, 3, true);
		check_loads(fx, 3);
		fx_close(fx);
	}
}
END_TEST

START_TEST(read_ahead_and_io_limit_tuned)
{
	/* Live tuning: no read-ahead and one read in flight still serve every cycle right; the
	 * runner then waits for groups read-ahead would have had ready. */
	struct fixture *fx = fx_open("/tmp", 4, 2, false);
	ck_assert_uint_eq(loader_read_ahead_max(fx->l), 2);
	ck_assert_uint_eq(loader_read_ahead(fx->l), 2);
	loader_set_read_ahead(fx->l, 9);
	ck_assert_uint_eq(loader_read_ahead(fx->l), 2); /* past the streaming slots: clamped */
	loader_set_read_ahead(fx->l, 0);
	ck_assert_uint_eq(loader_read_ahead(fx->l), 0);
	ck_assert_int_eq(loader_set_io_limit(fx->l, 0), -EINVAL);
	ck_assert_int_eq(loader_set_io_limit(fx->l, loader_io_depth(fx->l) + 1), -EINVAL);
	ck_assert_int_eq(loader_set_io_limit(fx->l, 1), 0);
	ck_assert_uint_eq(loader_io_limit(fx->l), 1);
	run_cycles(fx, 3);
	ck_assert_uint_gt(fx->h->loader.waits, 0);
	char *json = loader_stats_json(fx->l);
	ck_assert_ptr_nonnull(strstr(json, "\"read_ahead\":0"));
	ck_assert_ptr_nonnull(strstr(json, "\"io_depth_limit\":1"));
	free(json);
	fx_close(fx);
}
END_TEST

START_TEST(stream_k1_buffered)
{
	struct fixture *fx = fx_open("/dev/shm", 3, 1, true);
	ck_assert(!loader_o_direct(fx->l));
	run_cycles(fx, 3);
	check_loads(fx, 3);
	fx_close(fx);
}
END_TEST

START_TEST(all_resident_three_cycles)
{
	struct fixture *fx = fx_open("/tmp", 2, 0, false);
	drain_io(fx);
	/* Read once at start, in a slot each. */
	ck_assert_uint_eq(fx->h->loader.groups_loaded, fx->m->n_groups);
	ck_assert_uint_eq(fx->h->n_slots, fx->m->n_groups);
	run_cycles(fx, 3);
	check_loads(fx, 3);
	ck_assert_uint_eq(fx->h->loader.waits, 0);
	fx_close(fx);
}
END_TEST

START_TEST(acquire_ahead_then_release)
{
	/* k = 1: the runner asks for attn 0, ffn 0 and attn 1 at once. attn 1 must wait for the
	 * only attention slot; a plain RELEASE of attn 0 lets it in. */
	struct fixture *fx = fx_open("/tmp", 4, 1, false);
	drain_io(fx);
	uint64_t want[] = {group_id_attn(0), group_id_ffn(0), group_id_attn(1)};
	char err[512];
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 7, want, 3, NULL, 0, err, sizeof(err)), 0);
	check_grant(fx, &wait_grant(fx, 7, group_id_attn(0))->g);
	check_grant(fx, &wait_grant(fx, 7, group_id_ffn(0))->g);
	drain_io(fx);
	ck_assert_ptr_null(find_grant(fx, 7, group_id_attn(1)));
	ck_assert_uint_eq(loader_waiters(fx->l), 1);
	ck_assert_uint_ge(fx->h->loader.waits, 1);
	uint64_t rel = group_id_attn(0);
	ck_assert_int_eq(loader_release(fx->l, 0, &rel, 1, err, sizeof(err)), 0);
	check_grant(fx, &wait_grant(fx, 7, group_id_attn(1))->g);
	ck_assert_uint_eq(loader_waiters(fx->l), 0);
	fx_close(fx);
}
END_TEST

START_TEST(held_group_never_evicted)
{
	/* k = 1: the runner holds attn 0 and asks for attn 1 without releasing it. attn 1 waits;
	 * attn 0's slot keeps its bytes until the release. */
	struct fixture *fx = fx_open("/tmp", 4, 1, false);
	drain_io(fx);
	char err[512];
	uint64_t a0 = group_id_attn(0), a1 = group_id_attn(1);
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 1, &a0, 1, NULL, 0, err, sizeof(err)), 0);
	struct msg_w_grant held = wait_grant(fx, 1, (uint32_t)a0)->g;
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 2, &a1, 1, NULL, 0, err, sizeof(err)), 0);
	drain_io(fx);
	ck_assert_ptr_null(find_grant(fx, 2, (uint32_t)a1));
	check_grant(fx, &held);
	ck_assert_uint_eq(loader_waiters(fx->l), 1);
	ck_assert_int_eq(loader_release(fx->l, 0, &a0, 1, err, sizeof(err)), 0);
	check_grant(fx, &wait_grant(fx, 2, (uint32_t)a1)->g);
	fx_close(fx);
}
END_TEST

START_TEST(window_never_evicted_for_a_waiter)
{
	/* k = 2 and the runner at embed: attn 0 and attn 1 are the window. An acquire of attn 3
	 * (far ahead) waits rather than evict them; once the runner moves on, it is served. */
	struct fixture *fx = fx_open("/tmp", 4, 2, false);
	drain_io(fx);
	char err[512];
	uint64_t want[] = {group_id_embed(), group_id_attn(3)};
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 3, want, 2, NULL, 0, err, sizeof(err)), 0);
	check_grant(fx, &wait_grant(fx, 3, group_id_embed())->g);
	drain_io(fx);
	ck_assert_ptr_null(find_grant(fx, 3, group_id_attn(3)));
	struct wring_group *gs = wring_group_state(fx->h);
	ck_assert_uint_ne(atomic_load(&gs[group_id_attn(0)].slot), WRING_NO_SLOT);
	ck_assert_uint_ne(atomic_load(&gs[group_id_attn(1)].slot), WRING_NO_SLOT);
	/* The runner moves to attn 3 itself, releasing embed: attn 1 is out of the window now. */
	uint64_t a3 = group_id_attn(3), emb = group_id_embed();
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 4, &a3, 1, &emb, 1, err, sizeof(err)), 0);
	check_grant(fx, &wait_grant(fx, 3, group_id_attn(3))->g);
	check_grant(fx, &wait_grant(fx, 4, group_id_attn(3))->g);
	/* attn 0 is inside the new window (it comes right after the wrap): kept. */
	ck_assert_uint_ne(atomic_load(&gs[group_id_attn(0)].slot), WRING_NO_SLOT);
	ck_assert_uint_eq(atomic_load(&gs[group_id_attn(1)].slot), WRING_NO_SLOT);
	fx_close(fx);
}
END_TEST

START_TEST(invalid_group_rejected)
{
	struct fixture *fx = fx_open("/tmp", 2, 0, false);
	drain_io(fx);
	char err[512] = "";
	uint64_t bad[] = {0, fx->m->n_groups};
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 1, bad, 2, NULL, 0, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "out of range"), "%s", err);
	/* Nothing applied: group 0, valid, was not granted either. */
	ck_assert_uint_eq(fx->n_grants, 0);
	ck_assert_uint_eq(loader_waiters(fx->l), 0);
	ck_assert_uint_eq(atomic_load(&wring_slots(fx->h)[0].refs), 0);
	uint64_t huge = UINT64_MAX;
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 2, &huge, 1, NULL, 0, err, sizeof(err)), -EINVAL);
	ck_assert_int_eq(loader_release(fx->l, 0, &huge, 1, err, sizeof(err)), -EINVAL);
	ck_assert_uint_eq(fx->n_grants, 0);
	fx_close(fx);
}
END_TEST

START_TEST(release_without_acquire_rejected)
{
	struct fixture *fx = fx_open("/tmp", 2, 0, false);
	drain_io(fx);
	char err[512] = "";
	uint64_t g0 = 0, g1 = 1;
	ck_assert_int_eq(loader_release(fx->l, 0, &g0, 1, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "release"), "%s", err);
	/* An acquire whose release list is wrong applies nothing. */
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 3, &g1, 1, &g0, 1, err, sizeof(err)), -EINVAL);
	ck_assert_uint_eq(fx->n_grants, 0);
	/* One grant, one release; not two. */
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 4, &g0, 1, NULL, 0, err, sizeof(err)), 0);
	ck_assert_uint_eq(fx->n_grants, 1);
	uint64_t twice[] = {0, 0};
	ck_assert_int_eq(loader_release(fx->l, 0, twice, 2, err, sizeof(err)), -EINVAL);
	ck_assert_uint_eq(atomic_load(&wring_slots(fx->h)[fx->grants[0].g.slot].refs), 1);
	ck_assert_int_eq(loader_release(fx->l, 0, &g0, 1, err, sizeof(err)), 0);
	ck_assert_int_eq(loader_release(fx->l, 0, &g0, 1, err, sizeof(err)), -EINVAL);
	ck_assert_uint_eq(fx->h->loader.releases, 1);
	fx_close(fx);
}
END_TEST

START_TEST(runner_hello_drops_refs_and_waiters)
{
	struct fixture *fx = fx_open("/tmp", 2, 0, false);
	char err[512];
	/* Ask for everything before any read completed: all wait. */
	uint32_t n = fx->m->n_groups;
	uint64_t all[16];
	for (uint32_t g = 0; g < n; g++)
		all[g] = g;
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 5, all, n, NULL, 0, err, sizeof(err)), 0);
	uint32_t granted_now = fx->n_grants;
	loader_hello(fx->l, "gpu-runner", 0);
	ck_assert_uint_eq(loader_waiters(fx->l), 0);
	drain_io(fx);
	ck_assert_uint_eq(fx->n_grants, granted_now); /* the old runner gets nothing more */
	ck_assert_uint_eq(fx->h->loader.groups_loaded, n);
	uint64_t g0 = 0;
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 6, &g0, 1, NULL, 0, err, sizeof(err)), 0);
	check_grant(fx, &wait_grant(fx, 6, 0)->g);
	loader_hello(fx->l, "gpu-runner", 0);
	for (uint32_t s = 0; s < fx->h->n_slots; s++)
		ck_assert_uint_eq(atomic_load(&wring_slots(fx->h)[s].refs), 0);
	ck_assert_int_eq(loader_release(fx->l, 0, &g0, 1, err, sizeof(err)), -EINVAL);
	fx_close(fx);
}
END_TEST

/* Two runners of one model split between them (gpu-runner, gpu-runner-1), each with its session: each
 * holds its own references, may release only its own, and a restart of one (a HELLO with a new
 * session) drops what its predecessor held and nothing of the other's. */
START_TEST(runner_sessions_hold_their_own_refs)
{
	struct fixture *fx = fx_open("/tmp", 2, 0, false);
	drain_io(fx);
	char err[512];
	loader_hello(fx->l, "gpu-runner", 11);
	loader_hello(fx->l, "gpu-runner-1", 22);
	uint64_t g0 = 0, g1 = 1;
	ck_assert_int_eq(loader_acquire(fx->l, 11, &fx->peer, 1, &g0, 1, NULL, 0, err, sizeof(err)), 0);
	ck_assert_int_eq(loader_acquire(fx->l, 22, &fx->peer, 2, &g1, 1, NULL, 0, err, sizeof(err)), 0);
	ck_assert_int_eq(loader_acquire(fx->l, 22, &fx->peer, 3, &g0, 1, NULL, 0, err, sizeof(err)), 0);
	uint32_t s0 = wait_grant(fx, 1, 0)->g.slot, s1 = wait_grant(fx, 2, 1)->g.slot;
	ck_assert_uint_eq(atomic_load(&wring_slots(fx->h)[s0].refs), 2);
	/* A release of a group the session does not hold is refused, whoever else holds it. */
	ck_assert_int_eq(loader_release(fx->l, 11, &g1, 1, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "released more often than granted"), "%s", err);
	/* gpu-runner-1 restarts: its two references go, gpu-runner's stays. */
	loader_hello(fx->l, "gpu-runner-1", 33);
	ck_assert_uint_eq(atomic_load(&wring_slots(fx->h)[s0].refs), 1);
	ck_assert_uint_eq(atomic_load(&wring_slots(fx->h)[s1].refs), 0);
	ck_assert_int_eq(loader_release(fx->l, 22, &g1, 1, err, sizeof(err)), -EINVAL);
	/* The same session saying HELLO again keeps what it holds. */
	loader_hello(fx->l, "gpu-runner", 11);
	ck_assert_uint_eq(atomic_load(&wring_slots(fx->h)[s0].refs), 1);
	ck_assert_int_eq(loader_release(fx->l, 11, &g0, 1, err, sizeof(err)), 0);
	ck_assert_uint_eq(atomic_load(&wring_slots(fx->h)[s0].refs), 0);
	fx_close(fx);
}
END_TEST

START_TEST(undelivered_grant_takes_no_ref)
{
	struct fixture *fx = fx_open("/tmp", 2, 0, false);
	drain_io(fx);
	char err[512];
	uint64_t g0 = 0;
	fx->refuse_grants = 1;
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 8, &g0, 1, NULL, 0, err, sizeof(err)), 0);
	ck_assert_uint_eq(atomic_load(&wring_slots(fx->h)[0].refs), 0);
	ck_assert_uint_eq(fx->h->loader.grants, 0);
	fx_close(fx);
}
END_TEST

/* A fresh tiny model of 2 layers under /tmp, its manifest and an all-resident plan. */
struct scratch {
	char *dir, *model;
	struct manifest *m;
	struct plan *p;
};

static void scratch_open(struct scratch *x)
{
	char err[512];
	x->dir = th_tmpdir("/tmp");
	x->model = lt_make_model(x->dir, 2);
	x->m = lt_load(x->model);
	x->p = NULL;
	ck_assert_msg(plan_create(x->m, 1ull << 34, &x->p, err, sizeof(err)) == 0, "%s", err);
}

static void scratch_close(struct scratch *x)
{
	plan_destroy(&x->p);
	manifest_destroy(&x->m);
	th_rmtree(x->dir);
	free(x->model);
	free(x->dir);
}

START_TEST(ring_ready_only_when_told)
{
	/* ring_create lays the ring out but leaves it unready: the loader fills in the plan's disk
	 * figures first, and an attach before then is told to try again (EAGAIN), never shown 0s. */
	struct scratch x;
	scratch_open(&x);
	char err[512], name[128];
	char inst[64];
	snprintf(inst, sizeof(inst), "test-ring-%d", (int)getpid());
	ck_assert_int_eq(shm_object_name(inst, "weights", name, sizeof(name)), 0);
	struct shm_object *o = NULL, *a = NULL;
	ck_assert_msg(ring_create(name, x.m, x.p, &o, err, sizeof(err)) == 0, "%s", err);
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_WEIGHT_RING, WRING_LAYOUT_VERSION, false, &a), -EAGAIN);
	struct wring_header *h = shm_object_base(o);
	h->plan.disk_bytes_per_s = 1234;
	shm_object_set_ready(o);
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_WEIGHT_RING, WRING_LAYOUT_VERSION, false, &a), 0);
	ck_assert_uint_eq(((const struct wring_header *)shm_object_base(a))->plan.disk_bytes_per_s, 1234);
	shm_object_close(&a, false);
	shm_object_close(&o, true);
	scratch_close(&x);
}
END_TEST

START_TEST(file_rewritten_before_open_refused)
{
	/* The checkpoint rewritten in place after its header was read and before the loader opened
	 * it, its modification time put back (as cp -p and rsync -t do): refused at the start with
	 * ESTALE, not loaded as the layout and hash of the file that was read. */
	struct scratch x;
	scratch_open(&x);
	struct manifest *m = x.m;
	struct stat st;
	ck_assert_int_eq(stat(m->files[0].path, &st), 0);
	int fd = open(m->files[0].path, O_WRONLY);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(pwrite(fd, "x", 1, (off_t)m->tensors[0].file_offset), 1);
	struct timespec times[2] = {{.tv_nsec = UTIME_OMIT}, st.st_mtim};
	ck_assert_int_eq(futimens(fd, times), 0);
	close(fd);
	char err[512];
	struct plan *p = x.p;
	const uint64_t size = ring_memsize(m, p);
	void *mem = aligned_alloc(4096, ALIGN_UP(size, 4096));
	ck_assert_ptr_nonnull(mem);
	memset(mem, 0, size);
	ring_init(mem, size, m, p);
	struct loader_params lp = {.m = m, .plan = p, .ring = mem, .ring_bytes = size, .io_depth = 8, .max_read = 8192};
	struct loader_ops ops = {.grant = on_grant, .fail = on_fail};
	struct loader *l = NULL;
	ck_assert_int_eq(loader_create(&lp, &ops, NULL, &l, err, sizeof(err)), -ESTALE);
	ck_assert_ptr_null(l);
	ck_assert_msg(strstr(err, m->files[0].path) && strstr(err, "changed after its header was read"), "%s", err);
	free(mem);
	scratch_close(&x);
}
END_TEST

START_TEST(changed_file_fails_waiters_with_estale)
{
	/* The checkpoint rewritten in place while the loader serves it: a load after the change fails
	 * its waiters with ESTALE (the reader's code, which a retry cannot mend), not a plain EIO. */
	struct fixture *fx = fx_open("/tmp", 4, 1, false);
	drain_io(fx);
	/* A group in no slot: its acquire reads the file again. */
	uint32_t bad = UINT32_MAX;
	for (uint32_t g = 0; g < fx->m->n_groups && bad == UINT32_MAX; g++)
		if (fx->m->groups[g].n_tensors && atomic_load(&wring_group_state(fx->h)[g].slot) == WRING_NO_SLOT)
			bad = g;
	ck_assert_uint_ne(bad, UINT32_MAX);
	int fd = open(fx->m->files[0].path, O_WRONLY);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(pwrite(fd, "x", 1, (off_t)fx->m->tensors[0].file_offset), 1);
	struct timespec times[2] = {{.tv_nsec = UTIME_OMIT}, {.tv_sec = 1000000000, .tv_nsec = 123}};
	ck_assert_int_eq(futimens(fd, times), 0);
	close(fd);
	char err[512];
	uint64_t g = bad;
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 11, &g, 1, NULL, 0, err, sizeof(err)), 0);
	drain_io(fx);
	ck_assert_uint_eq(fx->n_fails, 1);
	ck_assert_uint_eq(fx->fails[0].corr, 11);
	ck_assert_int_eq(fx->fails[0].code, ESTALE);
	ck_assert_msg(strstr(fx->fails[0].text, "changed while the loader serves it"), "%s", fx->fails[0].text);
	fx_close(fx);
}
END_TEST

START_TEST(read_error_fails_waiters)
{
	/* The file loses the second half of its last tensor after the manifest was read. */
	char *probe_dir = th_tmpdir("/tmp");
	char *probe = lt_make_model(probe_dir, 4);
	struct manifest *pm = lt_load(probe);
	uint32_t last = 0;
	for (uint32_t t = 1; t < pm->n_tensors; t++)
		if (pm->tensors[t].file_offset > pm->tensors[last].file_offset)
			last = t;
	uint64_t cut = pm->tensors[last].file_offset + pm->tensors[last].nbytes / 2;
	uint32_t bad = pm->tensors[last].group;
	manifest_destroy(&pm);
	th_rmtree(probe_dir);
	free(probe_dir);
	free(probe);

	struct fixture *fx = fx_open_cut("/tmp", 4, 1, false, cut);
	drain_io(fx);
	char err[512];
	uint64_t g = bad, ok = 0;
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 9, &g, 1, NULL, 0, err, sizeof(err)), 0);
	drain_io(fx);
	ck_assert_uint_eq(fx->n_fails, 1);
	ck_assert_uint_eq(fx->fails[0].corr, 9);
	ck_assert_int_eq(fx->fails[0].code, EIO);
	ck_assert_msg(strstr(fx->fails[0].text, fx->m->files[0].path) && strstr(fx->fails[0].text, "offset"),
		      "%s", fx->fails[0].text);
	ck_assert_ptr_null(find_grant(fx, 9, bad));
	ck_assert_uint_eq(loader_waiters(fx->l), 0);
	ck_assert_uint_eq(atomic_load(&wring_group_state(fx->h)[bad].slot), WRING_NO_SLOT);
	/* The slot went back: nothing is left LOADING, every slot stable. */
	for (uint32_t s = 0; s < fx->h->n_slots; s++) {
		ck_assert_uint_ne(atomic_load(&wring_slots(fx->h)[s].state), WSLOT_LOADING);
		ck_assert_uint_eq(atomic_load(&wring_slots(fx->h)[s].seq) % 2, 0);
	}
	/* Other groups still load. */
	if (bad == 0)
		ok = 1;
	ck_assert_int_eq(loader_acquire(fx->l, 0, &fx->peer, 10, &ok, 1, NULL, 0, err, sizeof(err)), 0);
	check_grant(fx, &wait_grant(fx, 10, (uint32_t)ok)->g);
	fx_close(fx);
}
END_TEST

START_TEST(stats_json)
{
	struct fixture *fx = fx_open("/tmp", 2, 0, false);
	drain_io(fx);
	char *text = loader_stats_json(fx->l);
	ck_assert_ptr_nonnull(text);
	json_error_t je;
	json_t *o = json_loads(text, 0, &je);
	ck_assert_msg(o != NULL, "%s: %s", text, je.text);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "groups")), fx->m->n_groups);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "slots")), fx->m->n_groups);
	ck_assert(json_is_true(json_object_get(o, "all_resident")));
	ck_assert(json_is_true(json_object_get(o, "o_direct")));
	ck_assert_int_eq(json_integer_value(json_object_get(o, "groups_loaded")), fx->m->n_groups);
	ck_assert_int_ge(json_integer_value(json_object_get(o, "bytes_read")), (json_int_t)fx->m->total_tensor_bytes);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "model_bytes")), (json_int_t)fx->m->total_tensor_bytes);
	ck_assert_int_eq(json_integer_value(json_object_get(o, "ring_bytes")), (json_int_t)fx->size);
	const char *keys[] = {"dram_budget", "reads_done", "grants", "releases", "waits", "disk_read_seconds",
			      "disk_bytes_per_s"};
	for (size_t i = 0; i < ARRAY_SIZE(keys); i++)
		ck_assert_msg(json_object_get(o, keys[i]) != NULL, "missing %s in %s", keys[i], text);
	ck_assert(json_real_value(json_object_get(o, "disk_read_seconds")) > 0);
	json_decref(o);
	free(text);
	fx_close(fx);
}
END_TEST

static Suite *loader_suite(void)
{
	Suite *s = suite_create("loader");
	TCase *tc = tcase_create("cycles");
	tcase_add_test(tc, stream_k1_three_cycles);
	tcase_add_test(tc, stream_k2_three_cycles);
	tcase_add_test(tc, read_ahead_keeps_a_paused_runner_fed);
	tcase_add_test(tc, read_ahead_and_io_limit_tuned);
	tcase_add_test(tc, stream_k1_buffered);
	tcase_add_test(tc, all_resident_three_cycles);
	tcase_add_test(tc, acquire_ahead_then_release);
	tcase_add_test(tc, held_group_never_evicted);
	tcase_add_test(tc, window_never_evicted_for_a_waiter);
	suite_add_tcase(s, tc);
	tc = tcase_create("requests");
	tcase_add_test(tc, invalid_group_rejected);
	tcase_add_test(tc, release_without_acquire_rejected);
	tcase_add_test(tc, runner_hello_drops_refs_and_waiters);
	tcase_add_test(tc, runner_sessions_hold_their_own_refs);
	tcase_add_test(tc, undelivered_grant_takes_no_ref);
	suite_add_tcase(s, tc);
	tc = tcase_create("errors");
	tcase_add_test(tc, read_error_fails_waiters);
	tcase_add_test(tc, changed_file_fails_waiters_with_estale);
	tcase_add_test(tc, file_rewritten_before_open_refused);
	tcase_add_test(tc, ring_ready_only_when_told);
	suite_add_tcase(s, tc);
	tc = tcase_create("stats");
	tcase_add_test(tc, stats_json);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(loader_suite());
}

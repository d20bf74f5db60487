/* test_stages.c - a model split across runners (services/gpu-runner/stages/): the plan of the ranks'
 * layers (plan.h), and the shm link between two real processes (link.h) carrying the C backend's
 * hidden state: the rows arrive as sent, in order, a step's last row goes back to rank 0, a rank
 * that gives the step up ends the other's wait with its reason, and a rank that dies is noticed. */
#include <check.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/model.h"
#include "common/proc.h"
#include "common/util.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/stages/link.h"
#include "services/gpu-runner/stages/plan.h"
#include "tests/unit/common/test_helpers.h"

/* A dense model of L layers: embed, (attn, ffn) per layer, head; attention groups of a bytes, FFN
 * groups of f, the head of h. */
static struct group_desc *groups_of(struct model_config *c, uint32_t L, uint64_t a, uint64_t f, uint64_t h)
{
	*c = (struct model_config){.arch = ARCH_LLAMA, .n_layers = L, .dim = 64, .n_heads = 4, .n_kv_heads = 2,
				   .head_dim = 16, .ffn_dim = 192, .vocab_size = 512, .max_position = 4096,
				   .rms_eps = 1e-5f, .rope_theta = 10000.0f, .bos_id = -1};
	uint32_t n = model_n_groups(c);
	struct group_desc *g = calloc(n, sizeof(*g));
	ck_assert_ptr_nonnull(g);
	g[0] = (struct group_desc){.kind = GROUP_EMBED, .size_class = CLASS_GLOBAL, .slot_bytes = 1000};
	for (uint32_t l = 0; l < L; l++) {
		g[group_id_attn(l)] = (struct group_desc){.kind = GROUP_ATTN, .layer = l, .size_class = CLASS_ATTN,
							  .slot_bytes = a};
		g[group_id_ffn(l)] = (struct group_desc){.kind = GROUP_FFN, .layer = l, .size_class = CLASS_FFN,
							 .slot_bytes = f};
	}
	g[group_id_head(c)] = (struct group_desc){.kind = GROUP_HEAD, .size_class = CLASS_GLOBAL, .slot_bytes = h};
	return g;
}

/* Every layer in exactly one rank's range, in order. */
static void check_cover(const struct stage_plan *p, uint32_t L)
{
	ck_assert_uint_eq(p->layer0[0], 0);
	ck_assert_uint_eq(p->layer1[p->ranks - 1], L);
	for (uint32_t r = 0; r < p->ranks; r++) {
		ck_assert_uint_lt(p->layer0[r], p->layer1[r]);
		if (r)
			ck_assert_uint_eq(p->layer0[r], p->layer1[r - 1]);
	}
}

START_TEST(plan_balances_bytes_in_place)
{
	struct model_config c;
	struct group_desc *g = groups_of(&c, 32, 100, 300, 0);
	char err[256];
	struct stage_plan p;
	struct stage_plan_params pp = {.ranks = 2};
	ck_assert_int_eq(stage_plan_make(&c, g, model_n_groups(&c), &pp, &p, err, sizeof(err)), 0);
	check_cover(&p, 32);
	ck_assert_uint_eq(p.layer1[0], 16);
	pp.ranks = 3;
	ck_assert_int_eq(stage_plan_make(&c, g, model_n_groups(&c), &pp, &p, err, sizeof(err)), 0);
	check_cover(&p, 32);
	for (uint32_t r = 0; r < 3; r++) /* 32 layers over 3: 10 or 11 each */
		ck_assert(p.layer1[r] - p.layer0[r] == 10 || p.layer1[r] - p.layer0[r] == 11);
	/* A head as big as four layers: rank 0 takes fewer. */
	free(g);
	g = groups_of(&c, 32, 100, 300, 1600);
	pp.ranks = 2;
	ck_assert_int_eq(stage_plan_make(&c, g, model_n_groups(&c), &pp, &p, err, sizeof(err)), 0);
	check_cover(&p, 32);
	ck_assert_uint_eq(p.layer1[0], 14);
	ck_assert_uint_eq(p.bytes[0], 14 * 400 + 1600);
	free(g);
}
END_TEST

START_TEST(plan_balances_streamed_bytes)
{
	/* Each rank holds 10 layers' bytes beside 2 slots of each class; rank 0 also the head (4
	 * layers' worth): with 32 layers rank 0 takes 2 fewer, so both stream the same bytes. */
	struct model_config c;
	struct group_desc *g = groups_of(&c, 32, 100, 300, 1600);
	char err[256];
	struct stage_plan p;
	struct stage_plan_params pp = {.ranks = 2, .budget = 12 * 400 + 1600, .depth = 2, .h2d_bps = 1e3, .hbm_bps = 1e9};
	ck_assert_int_eq(stage_plan_make(&c, g, model_n_groups(&c), &pp, &p, err, sizeof(err)), 0);
	check_cover(&p, 32);
	ck_assert_uint_eq(p.streamed[0], p.streamed[1]);
	ck_assert_uint_eq(p.layer1[0], 14);
	ck_assert_uint_eq(p.streamed[1], 18 * 400 - (12 * 400 + 1600 - 800));
	ck_assert(p.ms[0] > 0 && p.ms[0] == p.ms[1]);
	free(g);
}
END_TEST

START_TEST(plan_takes_a_given_split_and_refuses_bad_ones)
{
	struct model_config c;
	struct group_desc *g = groups_of(&c, 4, 100, 300, 0);
	char err[256];
	struct stage_plan p;
	uint32_t split[2] = {1, 3};
	struct stage_plan_params pp = {.ranks = 3, .split = split};
	ck_assert_int_eq(stage_plan_make(&c, g, model_n_groups(&c), &pp, &p, err, sizeof(err)), 0);
	ck_assert_uint_eq(p.layer1[0], 1);
	ck_assert_uint_eq(p.layer0[2], 3);
	check_cover(&p, 4);
	uint32_t bad[2] = {3, 2};
	pp.split = bad;
	ck_assert_int_eq(stage_plan_make(&c, g, model_n_groups(&c), &pp, &p, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "stage 2"), "%s", err);
	uint32_t past[2] = {1, 4};
	pp.split = past;
	ck_assert_int_eq(stage_plan_make(&c, g, model_n_groups(&c), &pp, &p, err, sizeof(err)), -EINVAL);
	pp = (struct stage_plan_params){.ranks = 5};
	ck_assert_int_eq(stage_plan_make(&c, g, model_n_groups(&c), &pp, &p, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, "cannot be split across 5"), "%s", err);
	pp.ranks = STAGE_MAX_RANKS + 1;
	ck_assert_int_eq(stage_plan_make(&c, g, model_n_groups(&c), &pp, &p, err, sizeof(err)), -EINVAL);
	free(g);
}
END_TEST

/* ---- the shm link between two processes ---- */

#define DIM 64
#define ROWS 8

static struct backend *cpu_backend(void)
{
	struct model_config c;
	free(groups_of(&c, 2, 1, 1, 1));
	struct backend_params bp = {.max_chunk = ROWS, .block_tokens = 16, .n_kv_blocks = 8, .kv_dtype = DT_F32};
	struct backend *be;
	char err[256];
	ck_assert_msg(backend_create("cpu", &c, &bp, &be, err, sizeof(err)) == 0, "%s", err);
	return be;
}

static struct backend_batch batch_of(uint32_t n, uint32_t pos0, int32_t *tokens, uint32_t *pos, uint32_t *seq)
{
	for (uint32_t i = 0; i < n; i++) {
		tokens[i] = (int32_t)(i + 1);
		pos[i] = pos0 + i;
		seq[i] = 0;
	}
	return (struct backend_batch){.n = n, .tokens = tokens, .pos = pos, .seq = seq};
}

static float value(uint32_t step, uint32_t row, uint32_t col)
{
	return (float)step * 1000.0f + (float)row * 100.0f + (float)col * 0.5f;
}

static struct stage_link_params params(uint32_t rank, int pid0, int pid1, uint64_t formation)
{
	struct stage_link_params p = {.formation = formation, .rank = rank, .ranks = 2, .dim = DIM, .max_rows = ROWS,
				      .timeout_ms = 20000};
	p.pids[0] = pid0;
	p.pids[1] = pid1;
	p.starts[0] = process_start_time(pid0);
	p.starts[1] = process_start_time(pid1);
	return p;
}

/* Rank 1's part (a child process): takes STEPS steps of rows, checks them, sends each step's last row
 * back with its values doubled; then, told by `mode`, gives a step up or dies. Exits 0 when all was
 * as expected. */
#define STEPS 20
enum child_mode { CHILD_ABORT = 1, CHILD_DIE = 2 };

static int rank1(const char *name, int parent, int mode, uint64_t formation)
{
	struct backend *be = cpu_backend();
	struct stage_link_params p = params(1, parent, getpid(), formation);
	struct stage_link *l;
	char err[256];
	if (stage_link_join(&p, "shm", name, NULL, &l, err, sizeof(err)) || stage_link_connect(l))
		return 10;
	int32_t tokens[ROWS];
	uint32_t pos[ROWS], seq[ROWS];
	float got[ROWS * DIM];
	for (uint32_t s = 0; s < STEPS; s++) {
		uint32_t n = 1 + s % ROWS;
		struct backend_batch b = batch_of(n, s, tokens, pos, seq);
		if (stage_link_recv(l, be, 0, n, &b))
			return 11;
		if (backend_hidden_get(be, 0, n, got))
			return 12;
		for (uint32_t i = 0; i < n * DIM; i++)
			if (got[i] != value(s, i / DIM, i % DIM))
				return 13;
		for (uint32_t i = 0; i < n * DIM; i++)
			got[i] *= 2;
		if (backend_hidden_put(be, 0, n, got) || stage_link_send(l, be, n - 1, 1))
			return 14;
	}
	if (mode == CHILD_DIE)
		_exit(0); /* gone without a word: the parent's next wait notices */
	stage_link_abort(l, "rank 1 failed its step");
	stage_link_destroy(&l);
	backend_destroy(&be);
	return 0;
}

static void exchange(int mode)
{
	uint64_t formation = random_u64() | 1;
	char instance[64], name[128], err[256];
	snprintf(instance, sizeof(instance), "test-stages-%d", (int)getpid());
	/* The child must know its parent's pid before the object exists: the params name both. */
	int parent = getpid();
	int fds[2];
	ck_assert_int_eq(pipe(fds), 0);
	int child = fork();
	ck_assert_int_ge(child, 0);
	if (child == 0) {
		close(fds[1]);
		char buf[128] = {0};
		ssize_t k = read(fds[0], buf, sizeof(buf) - 1);
		_exit(k > 0 ? rank1(buf, parent, mode, formation) : 9);
	}
	close(fds[0]);
	struct backend *be = cpu_backend();
	struct stage_link_params p = params(0, parent, child, formation);
	struct stage_link *l;
	ck_assert_msg(stage_link_open(&p, "shm", instance, &l, name, sizeof(name), NULL, err, sizeof(err)) == 0, "%s",
		      err);
	ck_assert_int_eq(write(fds[1], name, strlen(name)), (ssize_t)strlen(name));
	close(fds[1]);
	ck_assert_int_eq(stage_link_connect(l), 0);
	int32_t tokens[ROWS];
	uint32_t pos[ROWS], seq[ROWS];
	float rows[ROWS * DIM];
	for (uint32_t s = 0; s < STEPS; s++) {
		uint32_t n = 1 + s % ROWS;
		for (uint32_t i = 0; i < n * DIM; i++)
			rows[i] = value(s, i / DIM, i % DIM);
		struct backend_batch b = batch_of(n, s, tokens, pos, seq);
		ck_assert_int_eq(backend_hidden_in(be, &b, rows), 0);
		ck_assert_msg(stage_link_send(l, be, 0, n) == 0, "%s", stage_link_error(l));
		/* The last row comes back, doubled, into row n - 1. */
		ck_assert_msg(stage_link_recv(l, be, n - 1, 1, NULL) == 0, "%s", stage_link_error(l));
		ck_assert_int_eq(stage_link_wait(l, be), 0);
		ck_assert_int_eq(backend_hidden_get(be, 0, n, rows), 0);
		for (uint32_t i = 0; i < n * DIM; i++) {
			uint32_t r = i / DIM;
			float want = value(s, r, i % DIM) * (r == n - 1 ? 2.0f : 1.0f);
			TH_CHECK(rows[i] == want, "step %u row %u col %u: %g, want %g", s, r, i % DIM, rows[i], want);
		}
	}
	uint64_t sent, received;
	stage_link_counts(l, &sent, &received);
	ck_assert_uint_eq(received, (uint64_t)STEPS * DIM * sizeof(float));
	/* What comes next fails, with the reason the child gave or its death. */
	struct backend_batch b = batch_of(1, 0, tokens, pos, seq);
	int rc = stage_link_recv(l, be, 0, 1, &b);
	if (mode == CHILD_ABORT) {
		ck_assert_int_eq(rc, -ECONNABORTED);
		ck_assert_msg(strstr(stage_link_error(l), "rank 1 failed its step"), "%s", stage_link_error(l));
	} else {
		ck_assert_int_eq(rc, -EPIPE);
		ck_assert_msg(strstr(stage_link_error(l), "stage 1") && strstr(stage_link_error(l), "is gone"), "%s",
			      stage_link_error(l));
	}
	ck_assert(stage_link_broken(l));
	ck_assert_int_eq(stage_link_send(l, be, 0, 1), -EPIPE); /* broken: nothing more */
	int status;
	ck_assert_int_eq(waitpid(child, &status, 0), child);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank 1 exited with %d", WEXITSTATUS(status));
	stage_link_destroy(&l);
	char path[160];
	snprintf(path, sizeof(path), "/dev/shm%s", name);
	ck_assert_msg(access(path, F_OK) != 0, "%s is left after rank 0 left the link", path);
	backend_destroy(&be);
}

START_TEST(shm_link_carries_rows_and_an_abort)
{
	exchange(CHILD_ABORT);
}
END_TEST

START_TEST(shm_link_notices_a_dead_peer)
{
	exchange(CHILD_DIE);
}
END_TEST

START_TEST(shm_link_refuses_another_formation)
{
	char instance[64], name[128], err[256];
	snprintf(instance, sizeof(instance), "test-stages-f-%d", (int)getpid());
	struct stage_link_params p = params(0, getpid(), getpid(), 7), q = params(1, getpid(), getpid(), 8);
	struct stage_link *l, *m = NULL;
	ck_assert_int_eq(stage_link_open(&p, "shm", instance, &l, name, sizeof(name), NULL, err, sizeof(err)), 0);
	ck_assert_int_eq(stage_link_join(&q, "shm", name, NULL, &m, err, sizeof(err)), -EPROTO);
	ck_assert_msg(strstr(err, "another formation"), "%s", err);
	ck_assert_int_eq(stage_link_join(&q, "shm", "/etc/passwd", NULL, &m, err, sizeof(err)), -EINVAL);
	q.rank = 0;
	ck_assert_int_eq(stage_link_join(&q, "nccl-or-so", name, NULL, &m, err, sizeof(err)), -ENOTSUP);
	ck_assert_ptr_null(m);
	p.ranks = STAGE_MAX_RANKS + 1;
	struct stage_link *n = NULL;
	ck_assert_int_eq(stage_link_open(&p, "shm", instance, &n, name, sizeof(name), NULL, err, sizeof(err)), -EINVAL);
	stage_link_destroy(&l);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("stages");
	TCase *tc = tcase_create("stages");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, plan_balances_bytes_in_place);
	tcase_add_test(tc, plan_balances_streamed_bytes);
	tcase_add_test(tc, plan_takes_a_given_split_and_refuses_bad_ones);
	tcase_add_test(tc, shm_link_carries_rows_and_an_abort);
	tcase_add_test(tc, shm_link_notices_a_dead_peer);
	tcase_add_test(tc, shm_link_refuses_another_formation);
	suite_add_tcase(s, tc);
	return th_run(s);
}

/* test_window_plan.c - what the GPU weight window keeps resident (window_plan.h), on hand-made group
 * tables: a dense model (the head, then attention and FFN groups as fit beside their slots; the
 * minimum named in bytes), a mixture of experts (its attention and router groups found in its own
 * layout, experts kept in the room left, hottest first, every one when all fit, and their heat
 * share), one stage of a split model, and the routing counts folded into heat. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/model.h"
#include "services/gpu-runner/window_plan.h"
#include "tests/unit/common/test_helpers.h"

#define MiB (1024ull * 1024ull)
#define ATTN (36 * MiB)
#define FFN_B (100 * MiB)
#define ROUTER (1 * MiB)
#define EXPERT (9 * MiB)
#define HEAD (600 * MiB)

/* A group table in the model's layout (model.h): embed, per layer attn then the FFN (or the router
 * and the experts), head. */
static struct group_desc *table(const struct model_config *c, uint32_t *n)
{
	*n = 2 + c->n_layers * model_layer_groups(c);
	struct group_desc *g = calloc(*n, sizeof(*g));
	ck_assert_ptr_nonnull(g);
	g[0] = (struct group_desc){.kind = GROUP_EMBED, .size_class = CLASS_GLOBAL, .slot_bytes = HEAD};
	for (uint32_t l = 0; l < c->n_layers; l++) {
		g[model_group_attn(c, l)] =
			(struct group_desc){.kind = GROUP_ATTN, .layer = l, .size_class = CLASS_ATTN, .slot_bytes = ATTN};
		g[model_group_ffn(c, l)] = (struct group_desc){.kind = c->n_experts ? GROUP_MOE : GROUP_FFN, .layer = l,
							       .size_class = CLASS_FFN,
							       .slot_bytes = c->n_experts ? ROUTER : FFN_B};
		for (uint32_t e = 0; e < c->n_experts; e++)
			g[model_group_expert(c, l, e)] = (struct group_desc){
				.kind = GROUP_EXPERT, .layer = l, .size_class = CLASS_EXPERT, .expert = e, .slot_bytes = EXPERT};
	}
	g[group_id_head(c)] = (struct group_desc){.kind = GROUP_HEAD, .size_class = CLASS_GLOBAL, .slot_bytes = HEAD};
	return g;
}

static uint32_t count(const bool *r, uint32_t n)
{
	uint32_t k = 0;
	for (uint32_t i = 0; i < n; i++)
		k += r[i];
	return k;
}

START_TEST(test_dense)
{
	struct model_config c = {.n_layers = 4};
	uint32_t n;
	struct group_desc *g = table(&c, &n);
	bool *res = calloc(n, 1);
	struct window_plan p;
	char err[512];
	/* Everything fits: every layer group kept, no slots. */
	ck_assert_int_eq(window_plan(&c, g, n, NULL, 10000 * MiB, 2, 2, NULL, res, &p, err, sizeof(err)), 0);
	ck_assert_uint_eq(count(res, n), 1 + 8);
	ck_assert(!res[0]); /* the embedding stays on the host */
	ck_assert_uint_eq(p.resident_bytes, HEAD + 4 * (ATTN + FFN_B));
	ck_assert_uint_eq(p.slot_bytes, 0);
	ck_assert_uint_eq(p.streamed_bytes, 0);
	ck_assert_uint_eq(p.need, HEAD + 2 * (ATTN + FFN_B));
	/* The minimum: the head and two slots of each class; one byte less is refused with the minimum in
	 * bytes, as the tests' `--gpu-budget min` reads it. */
	ck_assert_int_eq(window_plan(&c, g, n, NULL, p.need, 2, 2, NULL, res, &p, err, sizeof(err)), 0);
	ck_assert_uint_eq(count(res, n), 1);
	ck_assert_uint_eq(p.streamed_bytes, 4 * (ATTN + FFN_B));
	ck_assert_uint_eq(p.slot_bytes, 2 * (ATTN + FFN_B));
	uint64_t need = p.need;
	ck_assert_int_eq(window_plan(&c, g, n, NULL, need - 1, 2, 2, NULL, res, &p, err, sizeof(err)), -ENOSPC);
	char want[64];
	snprintf(want, sizeof(want), "(%llu bytes)", (unsigned long long)need);
	ck_assert_msg(strstr(err, "is too small") && strstr(err, want), "message: %s", err);
	/* In between: the split that keeps the most bytes within the budget. One attention and one FFN
	 * group more than the minimum hold one of each (136 MiB kept) or, with no attention slot left,
	 * all four attention groups (144 MiB). */
	uint64_t budget = need + ATTN + FFN_B;
	ck_assert_int_eq(window_plan(&c, g, n, NULL, budget, 2, 2, NULL, res, &p, err, sizeof(err)), 0);
	ck_assert(p.resident_bytes + p.slot_bytes <= budget);
	ck_assert_uint_eq(p.resident_bytes, HEAD + 4 * ATTN);
	ck_assert_uint_eq(p.slot_bytes, 2 * FFN_B);
	for (uint32_t l = 0; l < 4; l++)
		ck_assert(res[model_group_attn(&c, l)] && !res[model_group_ffn(&c, l)]);
	free(res);
	free(g);
}
END_TEST

/* window_plan_spread: as many groups of each kind kept, placed evenly among the layers. */
START_TEST(test_spread)
{
	struct model_config c = {.n_layers = 32};
	uint32_t n;
	struct group_desc *g = table(&c, &n);
	bool *res = calloc(n, 1);
	res[group_id_head(&c)] = true;
	for (uint32_t l = 0; l < 32; l++) { /* as window_plan keeps them: 23 attention, 9 FFN from the first */
		res[model_group_attn(&c, l)] = l < 23;
		res[model_group_ffn(&c, l)] = l < 9;
	}
	ck_assert(window_plan_spread(&c, NULL, res, false));
	ck_assert(res[group_id_head(&c)]);
	static const uint32_t ffn_kept[9] = {3, 7, 10, 14, 17, 21, 24, 28, 31};
	uint32_t na = 0, nf = 0, k = 0, last = 0;
	for (uint32_t l = 0; l < 32; l++) {
		na += res[model_group_attn(&c, l)];
		if (res[model_group_ffn(&c, l)]) {
			ck_assert_uint_lt(nf, 9);
			ck_assert_uint_eq(l, ffn_kept[nf]);
			nf++;
		}
		if (!res[model_group_attn(&c, l)]) { /* the 9 streamed attention groups: no two side by side */
			ck_assert_msg(k == 0 || l - last > 1, "streamed attention groups %u and %u", last, l);
			last = l;
			k++;
		}
	}
	ck_assert_uint_eq(na, 23);
	ck_assert_uint_eq(nf, 9);
	ck_assert_uint_eq(k, 9);
	/* A stage's layers only: the others untouched. */
	const struct weight_stage st = {.split = true, .layer0 = 8, .layer1 = 16};
	for (uint32_t l = 0; l < 32; l++)
		res[model_group_ffn(&c, l)] = l >= 8 && l < 10; /* 2 of the stage's 8 kept, from its first */
	ck_assert(window_plan_spread(&c, &st, res, false));
	ck_assert(!window_plan_spread(&c, &st, res, false)); /* in place already: nothing moves */
	for (uint32_t l = 0; l < 32; l++)
		ck_assert_int_eq(res[model_group_ffn(&c, l)], l == 11 || l == 15);
	free(res);
	free(g);
}
END_TEST

/* window_plan_attn_kept: every attention group of the stage's layers kept, whatever the FFNs. */
START_TEST(test_attn_kept)
{
	struct model_config c = {.n_layers = 8};
	uint32_t n;
	struct group_desc *g = table(&c, &n);
	bool *res = calloc(n, 1);
	for (uint32_t l = 0; l < 8; l++)
		res[model_group_attn(&c, l)] = true; /* no FFN kept */
	ck_assert(window_plan_attn_kept(&c, NULL, res));
	res[model_group_attn(&c, 7)] = false;
	ck_assert(!window_plan_attn_kept(&c, NULL, res));
	/* A stage's layers only: layer 7 is not the stage's. */
	const struct weight_stage st = {.split = true, .layer0 = 2, .layer1 = 6};
	ck_assert(window_plan_attn_kept(&c, &st, res));
	res[model_group_attn(&c, 2)] = false;
	ck_assert(!window_plan_attn_kept(&c, &st, res));
	free(res);
	free(g);
}
END_TEST

START_TEST(test_experts)
{
	/* 3 layers of 8 experts, 2 chosen a token. */
	struct model_config c = {.n_layers = 3, .n_experts = 8, .n_experts_used = 2};
	uint32_t n;
	struct group_desc *g = table(&c, &n);
	bool *res = calloc(n, 1);
	struct window_plan p;
	char err[512];
	/* The least: the head, two attention, router and expert slots. */
	ck_assert_int_eq(window_plan(&c, g, n, NULL, 0, 2, 2, NULL, res, &p, err, sizeof(err)), -ENOSPC);
	ck_assert_uint_eq(p.need, HEAD + 2 * (ATTN + ROUTER + EXPERT));
	ck_assert_msg(strstr(err, "and of the experts"), "message: %s", err);
	/* The dense groups every token reads, then room for 5 experts: the attention and router groups
	 * are found in the experts' layout (not the dense numbering, where group 3 is layer 0's expert 0
	 * and group 5 its expert 2). */
	uint64_t dense = HEAD + 3 * (ATTN + ROUTER), slots = 2 * EXPERT;
	ck_assert_int_eq(window_plan(&c, g, n, NULL, dense + slots + 5 * EXPERT + EXPERT / 2, 2, 2, NULL, res, &p, err,
				     sizeof(err)),
			 0);
	for (uint32_t l = 0; l < 3; l++)
		ck_assert(res[model_group_attn(&c, l)] && res[model_group_ffn(&c, l)]);
	ck_assert_uint_eq(p.experts, 24);
	ck_assert_uint_eq(p.experts_resident, 5);
	ck_assert_uint_eq(count(res, n), 1 + 6 + 5);
	/* None counted: table order, and the share kept is the share of experts. */
	for (uint32_t e = 0; e < 5; e++)
		ck_assert(res[model_group_expert(&c, 0, e)]);
	ck_assert(fabs(p.expert_heat_resident - 5.0 / 24) < 1e-9);
	ck_assert_uint_eq(p.slot_bytes, slots);
	ck_assert_uint_eq(p.resident_bytes, dense + 5 * EXPERT);
	/* Counted: the hottest five. */
	float heat[24] = {0};
	heat[1 * 8 + 7] = 0.9f;
	heat[2 * 8 + 3] = 0.8f;
	heat[0 * 8 + 6] = 0.5f;
	heat[2 * 8 + 0] = 0.3f;
	heat[1 * 8 + 2] = 0.2f;
	heat[0 * 8 + 1] = 0.1f;	 /* the sixth: left out */
	heat[2 * 8 + 5] = 0.2f;	 /* as hot as layer 1's expert 2, later in the table: left out */
	ck_assert_int_eq(window_plan(&c, g, n, NULL, dense + slots + 5 * EXPERT + EXPERT / 2, 2, 2, heat, res, &p, err,
				     sizeof(err)),
			 0);
	ck_assert_uint_eq(p.experts_resident, 5);
	ck_assert(res[model_group_expert(&c, 1, 7)] && res[model_group_expert(&c, 2, 3)] &&
		  res[model_group_expert(&c, 0, 6)] && res[model_group_expert(&c, 2, 0)] && res[model_group_expert(&c, 1, 2)]);
	ck_assert(!res[model_group_expert(&c, 0, 1)] && !res[model_group_expert(&c, 2, 5)]);
	ck_assert(fabs(p.expert_heat_resident - 2.7 / 3.0) < 1e-6);
	/* Every expert fits once their slots are not needed: all kept, no slot left. */
	uint64_t all = dense + 24 * EXPERT;
	ck_assert_int_eq(window_plan(&c, g, n, NULL, all, 2, 2, heat, res, &p, err, sizeof(err)), 0);
	ck_assert_uint_eq(p.experts_resident, 24);
	ck_assert_uint_eq(p.slot_bytes, 0);
	ck_assert_uint_eq(p.resident_bytes, all);
	ck_assert_uint_eq(count(res, n), n - 1);
	/* A budget that holds the dense groups and the slots only: no expert, and the dense groups still
	 * kept (none of them mistaken for an expert). */
	ck_assert_int_eq(window_plan(&c, g, n, NULL, dense + slots, 2, 2, heat, res, &p, err, sizeof(err)), 0);
	ck_assert_uint_eq(p.experts_resident, 0);
	ck_assert_uint_eq(count(res, n), 1 + 6);
	ck_assert(!res[3] && !res[5]);
	/* Four slots for the experts, two for the layer groups: the need and the slots count four
	 * experts, and two fewer are kept in the budget that kept five. */
	ck_assert_int_eq(window_plan(&c, g, n, NULL, 0, 2, 4, NULL, res, &p, err, sizeof(err)), -ENOSPC);
	ck_assert_uint_eq(p.need, HEAD + 2 * (ATTN + ROUTER) + 4 * EXPERT);
	ck_assert_msg(strstr(err, "2 slots of each streamed layer group and the experts' slots"), "message: %s", err);
	ck_assert_int_eq(window_plan(&c, g, n, NULL, dense + slots + 5 * EXPERT + EXPERT / 2, 2, 4, NULL, res, &p, err,
				     sizeof(err)),
			 0);
	ck_assert_uint_eq(p.experts_resident, 3);
	ck_assert_uint_eq(p.slot_bytes, 4 * EXPERT);
	free(res);
	free(g);
}
END_TEST

START_TEST(test_expert_depth)
{
	/* Given: as given; else the experts a layer's routing chooses, at least the layers' depth. */
	struct model_config c = {.n_layers = 3, .n_experts = 128, .n_experts_used = 8};
	ck_assert_uint_eq(window_expert_depth(&c, 2, 0), 8);
	ck_assert_uint_eq(window_expert_depth(&c, 12, 0), 12);
	ck_assert_uint_eq(window_expert_depth(&c, 2, 3), 3);
	c.n_experts_used = 2;
	ck_assert_uint_eq(window_expert_depth(&c, 2, 0), 2);
	ck_assert_uint_eq(window_expert_depth(&c, 0, 0), 2);
	c.n_experts_used = 1;
	ck_assert_uint_eq(window_expert_depth(&c, 0, 0), 1);
}
END_TEST

START_TEST(test_stage)
{
	/* The second of two stages: layers 2 and 3, no head. */
	struct model_config c = {.n_layers = 4, .n_experts = 4, .n_experts_used = 1};
	uint32_t n;
	struct group_desc *g = table(&c, &n);
	bool *res = calloc(n, 1);
	struct window_plan p;
	char err[512];
	struct weight_stage st = {.split = true, .layer0 = 2, .layer1 = 4, .first = false};
	ck_assert_int_eq(window_plan(&c, g, n, &st, 10000 * MiB, 2, 2, NULL, res, &p, err, sizeof(err)), 0);
	ck_assert(!res[group_id_head(&c)]);
	ck_assert_uint_eq(p.experts, 8);
	ck_assert_uint_eq(p.experts_resident, 8);
	for (uint32_t l = 0; l < 4; l++) {
		ck_assert(res[model_group_attn(&c, l)] == (l >= 2));
		ck_assert(res[model_group_expert(&c, l, 3)] == (l >= 2));
	}
	ck_assert_uint_eq(p.resident_bytes, 2 * (ATTN + ROUTER) + 8 * EXPERT);
	free(res);
	free(g);
}
END_TEST

START_TEST(test_heat_fold)
{
	/* 2 layers of 3 experts; layer 1 saw no steps. */
	float heat[6] = {0, 0, 0, 0.5f, 0.5f, 0};
	uint32_t weight[2] = {0, 10};
	uint32_t routed[6] = {4, 1, 3, 9, 9, 9}, steps[2] = {4, 0};
	window_heat_fold(heat, weight, routed, steps, 2, 3, 8);
	ck_assert(heat[0] == 1.0f && heat[1] == 0.25f && heat[2] == 0.75f);
	ck_assert(heat[3] == 0.5f && heat[4] == 0.5f && heat[5] == 0); /* no steps: kept */
	ck_assert_uint_eq(weight[0], 4);
	ck_assert_uint_eq(weight[1], 10);
	/* Then 4 more steps where only expert 1 was chosen: the average of 8 steps. */
	uint32_t routed2[6] = {0, 4, 0, 0, 0, 0}, steps2[2] = {4, 0};
	window_heat_fold(heat, weight, routed2, steps2, 2, 3, 8);
	ck_assert(fabsf(heat[0] - 0.5f) < 1e-6f && fabsf(heat[1] - 0.625f) < 1e-6f && fabsf(heat[2] - 0.375f) < 1e-6f);
	ck_assert_uint_eq(weight[0], 8);
	/* At the cap, the old heat weighs 8 steps however many came before: 8 steps of expert 2 alone
	 * halve the others. */
	uint32_t routed3[6] = {0, 0, 8, 0, 0, 0}, steps3[2] = {8, 0};
	window_heat_fold(heat, weight, routed3, steps3, 2, 3, 8);
	ck_assert(fabsf(heat[0] - 0.25f) < 1e-6f && fabsf(heat[1] - 0.3125f) < 1e-6f &&
		  fabsf(heat[2] - 0.6875f) < 1e-6f);
	ck_assert_uint_eq(weight[0], 8);
}
END_TEST

static Suite *plan_suite(void)
{
	Suite *s = suite_create("window_plan");
	TCase *tc = tcase_create("plan");
	tcase_add_test(tc, test_dense);
	tcase_add_test(tc, test_expert_depth);
	tcase_add_test(tc, test_spread);
	tcase_add_test(tc, test_attn_kept);
	tcase_add_test(tc, test_experts);
	tcase_add_test(tc, test_stage);
	tcase_add_test(tc, test_heat_fold);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(plan_suite());
}

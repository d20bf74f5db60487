/* test_plan.c - plan.c: all resident when the budget holds one slot per group; k streaming
 * slots per class otherwise; a budget too small names the size it needs. The manifests are
 * built by hand (plain tables): the plan reads only groups, class sizes and the layer count. */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "services/ssd-loader/plan.h"
#include "tests/unit/common/test_helpers.h"

#define ATTN_B 8192ull
#define FFN_B 12288ull
#define GLOBAL_B 16384ull

struct fake {
	struct manifest m;
	struct group_desc groups[2 + 2 * 8];
};

/* n_layers layers; class sizes above. */
static void fake_init(struct fake *f, uint32_t n_layers)
{
	memset(f, 0, sizeof(*f));
	f->m.cfg.n_layers = n_layers;
	f->m.n_groups = model_n_groups(&f->m.cfg);
	f->m.groups = f->groups;
	f->m.class_bytes[CLASS_ATTN] = ATTN_B;
	f->m.class_bytes[CLASS_FFN] = FFN_B;
	f->m.class_bytes[CLASS_GLOBAL] = GLOBAL_B;
	for (uint32_t g = 0; g < f->m.n_groups; g++) {
		struct group_desc *gd = &f->groups[g];
		if (g == group_id_embed() || g == group_id_head(&f->m.cfg)) {
			gd->kind = g ? GROUP_HEAD : GROUP_EMBED;
			gd->size_class = CLASS_GLOBAL;
		} else {
			gd->kind = g % 2 ? GROUP_ATTN : GROUP_FFN;
			gd->size_class = g % 2 ? CLASS_ATTN : CLASS_FFN;
			gd->layer = (g - 1) / 2;
		}
	}
}

static uint64_t resident_bytes(uint32_t n_layers)
{
	return 2 * GLOBAL_B + n_layers * (ATTN_B + FFN_B);
}

START_TEST(all_resident_when_it_fits)
{
	struct fake f;
	fake_init(&f, 4);
	struct plan *p = NULL;
	char err[256];
	/* Exactly one slot per group: still all resident. */
	ck_assert_int_eq(plan_create(&f.m, resident_bytes(4), &p, err, sizeof(err)), 0);
	ck_assert(plan_all_resident(p));
	ck_assert_uint_eq(plan_n_slots(p), f.m.n_groups);
	ck_assert_uint_eq(plan_data_bytes(p), resident_bytes(4));
	ck_assert_uint_eq(plan_resident_bytes(p), resident_bytes(4));
	for (uint32_t g = 0; g < f.m.n_groups; g++) {
		ck_assert(plan_group_pinned(p, g));
		/* Slot g is group g's own, of its class. */
		ck_assert_uint_eq(plan_slot_group(p, g), g);
		ck_assert_uint_eq(plan_slot_class(p, g), f.groups[g].size_class);
	}
	ck_assert_uint_eq(plan_class_slots(p, CLASS_ATTN), 4);
	ck_assert_uint_eq(plan_class_slots(p, CLASS_FFN), 4);
	ck_assert_uint_eq(plan_class_slots(p, CLASS_GLOBAL), 2);
	for (uint32_t c = 0; c < CLASS_COUNT; c++)
		ck_assert_uint_eq(plan_streaming_slots(p, c), 0);
	plan_destroy(&p);
	plan_destroy(&p);
	ck_assert_ptr_null(p);

	/* A huge budget changes nothing. */
	ck_assert_int_eq(plan_create(&f.m, 1ull << 40, &p, err, sizeof(err)), 0);
	ck_assert(plan_all_resident(p));
	ck_assert_uint_eq(plan_data_bytes(p), resident_bytes(4));
	plan_destroy(&p);
}
END_TEST

static void check_streaming(struct fake *f, uint64_t budget, uint32_t k)
{
	struct plan *p = NULL;
	char err[256];
	ck_assert_int_eq(plan_create(&f->m, budget, &p, err, sizeof(err)), 0);
	ck_assert(!plan_all_resident(p));
	ck_assert_uint_eq(plan_streaming_slots(p, CLASS_ATTN), k);
	ck_assert_uint_eq(plan_streaming_slots(p, CLASS_FFN), k);
	ck_assert_uint_eq(plan_streaming_slots(p, CLASS_GLOBAL), 0);
	ck_assert_uint_eq(plan_class_slots(p, CLASS_ATTN), k);
	ck_assert_uint_eq(plan_class_slots(p, CLASS_FFN), k);
	ck_assert_uint_eq(plan_class_slots(p, CLASS_GLOBAL), 2);
	ck_assert_uint_eq(plan_n_slots(p), 2 + 2 * k);
	ck_assert_uint_eq(plan_data_bytes(p), 2 * GLOBAL_B + k * (ATTN_B + FFN_B));
	ck_assert_uint_le(plan_data_bytes(p), budget);
	/* Only the globals are pinned, each in a slot of its own, numbered first. */
	for (uint32_t g = 0; g < f->m.n_groups; g++)
		ck_assert_int_eq(plan_group_pinned(p, g), g == 0 || g == f->m.n_groups - 1);
	ck_assert_uint_eq(plan_slot_group(p, 0), 0);
	ck_assert_uint_eq(plan_slot_group(p, 1), f->m.n_groups - 1);
	for (uint32_t s = 2; s < plan_n_slots(p); s++) {
		ck_assert_uint_eq(plan_slot_group(p, s), UINT32_MAX);
		ck_assert_uint_eq(plan_slot_class(p, s), s < 2 + k ? CLASS_ATTN : CLASS_FFN);
	}
	char line[512];
	plan_describe(p, line, sizeof(line));
	ck_assert_msg(strstr(line, "streaming") != NULL, "%s", line);
	plan_destroy(&p);
}

START_TEST(streaming_slot_counts)
{
	struct fake f;
	fake_init(&f, 4);
	uint64_t pair = ATTN_B + FFN_B, globals = 2 * GLOBAL_B;
	check_streaming(&f, globals + pair, 1);
	check_streaming(&f, globals + 2 * pair - 1, 1); /* floor */
	check_streaming(&f, globals + 2 * pair, 2);
	check_streaming(&f, resident_bytes(4) - 1, 3);	/* one byte short of all resident */
}
END_TEST

START_TEST(too_small_names_the_need)
{
	struct fake f;
	fake_init(&f, 4);
	uint64_t need = 2 * GLOBAL_B + ATTN_B + FFN_B;
	char want[32], exact[32];
	format_size(need, want, sizeof(want));
	snprintf(exact, sizeof(exact), "%llu", (unsigned long long)need);
	uint64_t budgets[] = {need - 1, GLOBAL_B, 0};
	for (size_t i = 0; i < ARRAY_SIZE(budgets); i++) {
		struct plan *p = NULL;
		char err[512] = "";
		ck_assert_int_eq(plan_create(&f.m, budgets[i], &p, err, sizeof(err)), -ENOSPC);
		ck_assert_ptr_null(p);
		ck_assert_msg(strstr(err, "--dram-budget") && strstr(err, "too small"), "%s", err);
		ck_assert_msg(strstr(err, want) != NULL, "names %s: %s", want, err);
		ck_assert_msg(strstr(err, exact) != NULL, "names %s bytes: %s", exact, err);
	}
}
END_TEST

START_TEST(unaligned_classes_round_up)
{
	struct fake f;
	fake_init(&f, 4);
	f.m.class_bytes[CLASS_ATTN] = ATTN_B - 100;
	struct plan *p = NULL;
	char err[256];
	ck_assert_int_eq(plan_create(&f.m, 1ull << 30, &p, err, sizeof(err)), 0);
	ck_assert_uint_eq(plan_class_capacity(p, CLASS_ATTN), ATTN_B);
	ck_assert_uint_eq(plan_data_bytes(p) % PLAN_SLOT_ALIGN, 0);
	plan_destroy(&p);
}
END_TEST

START_TEST(empty_manifest_rejected)
{
	struct manifest m;
	memset(&m, 0, sizeof(m));
	struct plan *p = NULL;
	char err[256] = "";
	ck_assert_int_eq(plan_create(&m, 1ull << 30, &p, err, sizeof(err)), -EINVAL);
	ck_assert_ptr_null(p);
	ck_assert(err[0]);
}
END_TEST

static Suite *plan_suite(void)
{
	Suite *s = suite_create("plan");
	TCase *tc = tcase_create("resident");
	tcase_add_test(tc, all_resident_when_it_fits);
	tcase_add_test(tc, unaligned_classes_round_up);
	suite_add_tcase(s, tc);
	tc = tcase_create("streaming");
	tcase_add_test(tc, streaming_slot_counts);
	suite_add_tcase(s, tc);
	tc = tcase_create("errors");
	tcase_add_test(tc, too_small_names_the_need);
	tcase_add_test(tc, empty_manifest_rejected);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(plan_suite());
}

/* test_plan.c - plan.c: all resident when the budget holds one slot per group; k streaming
 * streaming slots and pinned layers otherwise (checked against trying every choice); a budget too small names the size it needs. The manifests are
 * built by hand (plain tables): the plan reads only groups, class sizes and the layer count.
 * Mixture-of-experts layouts stream their experts through a window of expert slots, with the
 * most bytes pinned (checked against trying every split), and name their own minimum. */
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

/* What the plan should be, found by trying everything: the deepest streaming window (up to
 * PLAN_STREAM_SLOTS per class) that fits, then the most pinned layer bytes. */
static void expected(uint32_t L, uint64_t budget, uint32_t *na, uint32_t *nf, uint32_t *ka, uint32_t *kf)
{
	uint64_t rest = budget - 2 * GLOBAL_B, best = 0;
	bool found = false;
	for (uint32_t k = PLAN_STREAM_SLOTS; k >= 1 && !found; k--)
		for (uint32_t a = 0; a <= L; a++)
			for (uint32_t f = 0; f <= L; f++) {
				uint32_t wa = L - a < k ? L - a : k, wf = L - f < k ? L - f : k;
				uint64_t bytes = (a + wa) * ATTN_B + (f + wf) * FFN_B, res = a * ATTN_B + f * FFN_B;
				if (bytes <= rest && (!found || res > best)) {
					found = true;
					best = res;
					*na = a;
					*nf = f;
					*ka = wa;
					*kf = wf;
				}
			}
	ck_assert(found);
}

static void check_streaming(struct fake *f, uint64_t budget)
{
	uint32_t L = f->m.cfg.n_layers, na = 0, nf = 0, ka = 0, kf = 0;
	expected(L, budget, &na, &nf, &ka, &kf);
	struct plan *p = NULL;
	char err[256];
	ck_assert_int_eq(plan_create(&f->m, budget, &p, err, sizeof(err)), 0);
	ck_assert_msg(!plan_all_resident(p), "budget %llu of %llu: all resident", (unsigned long long)budget,
		      (unsigned long long)resident_bytes(L));
	ck_assert_uint_eq(plan_streaming_slots(p, CLASS_ATTN), ka);
	ck_assert_uint_eq(plan_streaming_slots(p, CLASS_FFN), kf);
	ck_assert_uint_eq(plan_streaming_slots(p, CLASS_GLOBAL), 0);
	ck_assert_uint_eq(plan_class_slots(p, CLASS_ATTN), ka + na);
	ck_assert_uint_eq(plan_class_slots(p, CLASS_FFN), kf + nf);
	ck_assert_uint_eq(plan_class_slots(p, CLASS_GLOBAL), 2);
	ck_assert_uint_eq(plan_data_bytes(p), 2 * GLOBAL_B + (ka + na) * ATTN_B + (kf + nf) * FFN_B);
	ck_assert_uint_le(plan_data_bytes(p), budget);
	/* The globals, and the last na attention and nf FFN layers, are pinned, each in a slot of
	 * its own numbered first; the streaming slots follow, class by class. */
	uint32_t pinned = 0;
	for (uint32_t g = 0; g < f->m.n_groups; g++) {
		const struct group_desc *gd = &f->groups[g];
		bool want = gd->size_class == CLASS_GLOBAL || (gd->kind == GROUP_ATTN && gd->layer >= L - na) ||
			    (gd->kind == GROUP_FFN && gd->layer >= L - nf);
		ck_assert_msg(plan_group_pinned(p, g) == want, "budget %llu: group %u pinned %d", (unsigned long long)budget,
			      g, plan_group_pinned(p, g));
		if (want)
			ck_assert_uint_eq(plan_slot_group(p, pinned++), g);
	}
	for (uint32_t s = pinned; s < plan_n_slots(p); s++) {
		ck_assert_uint_eq(plan_slot_group(p, s), UINT32_MAX);
		ck_assert_uint_eq(plan_slot_class(p, s), s < pinned + ka ? CLASS_ATTN : CLASS_FFN);
	}
	char line[512];
	plan_describe(p, line, sizeof(line));
	ck_assert_msg(strstr(line, "streaming") != NULL, "%s", line);
	plan_destroy(&p);
}

START_TEST(streaming_slot_counts)
{
	struct fake f;
	fake_init(&f, 8);
	uint64_t pair = ATTN_B + FFN_B, globals = 2 * GLOBAL_B;
	/* Just the minimum: one slot per class, nothing pinned. */
	check_streaming(&f, globals + pair);
	/* Room for a deeper window comes first. */
	check_streaming(&f, globals + 3 * pair);
	/* Then pinned layers from the last one down. */
	check_streaming(&f, globals + 3 * pair + FFN_B);
	check_streaming(&f, globals + 3 * pair + ATTN_B + FFN_B);
	/* Every budget up to one byte short of all resident agrees with trying everything. */
	for (uint64_t b = globals + pair; b < resident_bytes(8); b += 4096)
		check_streaming(&f, b);
	check_streaming(&f, resident_bytes(8) - 1);
	/* Four layers, too. */
	fake_init(&f, 4);
	for (uint64_t b = globals + pair; b < resident_bytes(4); b += 1024)
		check_streaming(&f, b);
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

/* A mixture-of-experts layout: MOE_E experts per layer, the router group in the FFN class. */
#define MOE_E 4u
#define MOE_L 3u
#define ROUTER_B 4096ull
#define EXPERT_B 12288ull

struct fake_moe {
	struct manifest m;
	struct group_desc groups[2 + (2 + MOE_E) * MOE_L];
};

static void fake_moe_init_k(struct fake_moe *f, uint32_t k_used)
{
	memset(f, 0, sizeof(*f));
	f->m.cfg.n_layers = MOE_L;
	f->m.cfg.n_experts = MOE_E;
	f->m.cfg.n_experts_used = k_used;
	f->m.n_groups = model_n_groups(&f->m.cfg);
	ck_assert_uint_eq(f->m.n_groups, ARRAY_SIZE(f->groups));
	f->m.groups = f->groups;
	f->m.class_bytes[CLASS_ATTN] = ATTN_B;
	f->m.class_bytes[CLASS_FFN] = ROUTER_B;
	f->m.class_bytes[CLASS_GLOBAL] = GLOBAL_B;
	f->m.class_bytes[CLASS_EXPERT] = EXPERT_B;
	f->groups[0] = (struct group_desc){.kind = GROUP_EMBED, .size_class = CLASS_GLOBAL};
	f->groups[group_id_head(&f->m.cfg)] = (struct group_desc){.kind = GROUP_HEAD, .size_class = CLASS_GLOBAL};
	for (uint32_t l = 0; l < MOE_L; l++) {
		f->groups[model_group_attn(&f->m.cfg, l)] =
			(struct group_desc){.kind = GROUP_ATTN, .layer = l, .size_class = CLASS_ATTN};
		f->groups[model_group_ffn(&f->m.cfg, l)] =
			(struct group_desc){.kind = GROUP_MOE, .layer = l, .size_class = CLASS_FFN};
		for (uint32_t e = 0; e < MOE_E; e++)
			f->groups[model_group_expert(&f->m.cfg, l, e)] = (struct group_desc){
				.kind = GROUP_EXPERT, .layer = l, .expert = e, .size_class = CLASS_EXPERT};
	}
}

static void fake_moe_init(struct fake_moe *f)
{
	fake_moe_init_k(f, 2);
}

static uint64_t moe_resident_bytes(void)
{
	return 2 * GLOBAL_B + MOE_L * (ATTN_B + ROUTER_B + MOE_E * EXPERT_B);
}

static uint32_t window(uint32_t streaming, uint32_t k)
{
	return streaming < k ? streaming : k;
}

/* The experts' window at level k: a token's chosen experts (k_used) at the deepest level where they
 * are more. */
static uint32_t expert_window(uint32_t k, uint32_t k_used)
{
	return k == PLAN_STREAM_SLOTS && k_used > k ? k_used : k;
}

/* Trying every split: the deepest window k that fits, then the most pinned bytes. *k_out is the
 * window of the layer classes, *kx_out the experts'. */
static void moe_expected(uint64_t budget, uint32_t k_used, uint32_t *k_out, uint32_t *kx_out, uint64_t *pinned_out)
{
	uint64_t rest = budget - 2 * GLOBAL_B, best = 0;
	uint32_t n = MOE_L * MOE_E;
	bool found = false;
	for (uint32_t k = PLAN_STREAM_SLOTS; k >= 1 && !found; k--)
		for (uint32_t a = 0; a <= MOE_L; a++)
			for (uint32_t r = 0; r <= MOE_L; r++)
				for (uint32_t x = 0; x <= n; x++) {
					uint32_t kx = expert_window(k, k_used);
					uint64_t res = a * ATTN_B + r * ROUTER_B + x * EXPERT_B;
					uint64_t bytes = res + window(MOE_L - a, k) * ATTN_B +
							 window(MOE_L - r, k) * ROUTER_B + window(n - x, kx) * EXPERT_B;
					if (bytes <= rest && (!found || res > best)) {
						found = true;
						best = res;
						*k_out = k;
						*kx_out = kx;
					}
				}
	ck_assert(found);
	*pinned_out = best;
}

static void check_moe_streaming(struct fake_moe *f, uint64_t budget)
{
	uint32_t k = 0, kx = 0;
	uint64_t want_pinned = 0;
	moe_expected(budget, f->m.cfg.n_experts_used, &k, &kx, &want_pinned);
	struct plan *p = NULL;
	char err[256];
	ck_assert_int_eq(plan_create(&f->m, budget, &p, err, sizeof(err)), 0);
	ck_assert(!plan_all_resident(p));
	ck_assert_uint_le(plan_data_bytes(p), budget);
	/* Pinned bytes as many as any split allows; per class, the window is min(k, groups that
	 * stream) and the slots are the pinned groups plus the window. */
	uint32_t pinned_n[CLASS_COUNT] = {0}, total[CLASS_COUNT] = {0};
	uint64_t pinned_bytes = 0;
	for (uint32_t g = 0; g < f->m.n_groups; g++) {
		uint32_t c = f->groups[g].size_class;
		total[c]++;
		if (plan_group_pinned(p, g)) {
			pinned_n[c]++;
			if (c != CLASS_GLOBAL)
				pinned_bytes += plan_class_capacity(p, c);
		} else {
			ck_assert_uint_ne(c, CLASS_GLOBAL);
		}
	}
	ck_assert_msg(pinned_bytes == want_pinned, "budget %llu: %llu bytes pinned, %llu possible",
		      (unsigned long long)budget, (unsigned long long)pinned_bytes, (unsigned long long)want_pinned);
	for (uint32_t c = 0; c < CLASS_COUNT; c++) {
		ck_assert_uint_eq(plan_streaming_slots(p, c), window(total[c] - pinned_n[c], c == CLASS_EXPERT ? kx : k));
		ck_assert_uint_eq(plan_class_slots(p, c), pinned_n[c] + plan_streaming_slots(p, c));
	}
	/* Pinned attention and router groups: the last layers. Pinned experts: the i-th from the
	 * last layer down, expert 0 first. */
	for (uint32_t l = 0; l < MOE_L; l++) {
		ck_assert(plan_group_pinned(p, model_group_attn(&f->m.cfg, l)) == (l >= MOE_L - pinned_n[CLASS_ATTN]));
		ck_assert(plan_group_pinned(p, model_group_ffn(&f->m.cfg, l)) == (l >= MOE_L - pinned_n[CLASS_FFN]));
		for (uint32_t e = 0; e < MOE_E; e++) {
			uint32_t i = (MOE_L - 1 - l) * MOE_E + e;
			ck_assert(plan_group_pinned(p, model_group_expert(&f->m.cfg, l, e)) ==
				  (i < pinned_n[CLASS_EXPERT]));
		}
	}
	char line[512];
	plan_describe(p, line, sizeof(line));
	ck_assert_msg(strstr(line, "expert") != NULL, "%s", line);
	plan_destroy(&p);
}

START_TEST(moe_experts_stream)
{
	struct fake_moe f;
	fake_moe_init(&f);
	uint64_t need = 2 * GLOBAL_B + ATTN_B + ROUTER_B + EXPERT_B;
	/* The minimum: one slot of each layer class, the experts among them. */
	struct plan *p = NULL;
	char err[512] = "";
	ck_assert_int_eq(plan_create(&f.m, need, &p, err, sizeof(err)), 0);
	ck_assert_uint_eq(plan_streaming_slots(p, CLASS_EXPERT), 1);
	ck_assert_uint_eq(plan_class_slots(p, CLASS_EXPERT), 1);
	ck_assert_uint_eq(plan_data_bytes(p), need);
	ck_assert_uint_eq(plan_disk_bytes_per_pass(p, &f.m), 0); /* slot_bytes are 0 in this fake */
	plan_destroy(&p);
	for (uint64_t b = need; b < moe_resident_bytes(); b += 1024)
		check_moe_streaming(&f, b);
	check_moe_streaming(&f, moe_resident_bytes() - 1);
	ck_assert_int_eq(plan_create(&f.m, moe_resident_bytes(), &p, err, sizeof(err)), 0);
	ck_assert(plan_all_resident(p));
	ck_assert_uint_eq(plan_class_slots(p, CLASS_EXPERT), MOE_L * MOE_E);
	plan_destroy(&p);
}
END_TEST

START_TEST(moe_window_holds_a_tokens_experts)
{
	/* Every expert of a layer chosen (num_experts_per_tok 4 > PLAN_STREAM_SLOTS): where the budget
	 * allows the deepest window, the experts' holds 4, so a layer's chosen experts are read at once;
	 * tighter budgets fall back to the layer classes' window. */
	struct fake_moe f;
	fake_moe_init_k(&f, MOE_E);
	uint64_t full = 2 * GLOBAL_B + PLAN_STREAM_SLOTS * (ATTN_B + ROUTER_B) + MOE_E * EXPERT_B;
	struct plan *p = NULL;
	char err[512] = "";
	ck_assert_int_eq(plan_create(&f.m, full, &p, err, sizeof(err)), 0);
	ck_assert_uint_eq(plan_streaming_slots(p, CLASS_EXPERT), MOE_E);
	plan_destroy(&p);
	uint64_t need = 2 * GLOBAL_B + ATTN_B + ROUTER_B + EXPERT_B;
	for (uint64_t b = need; b < moe_resident_bytes(); b += 1024)
		check_moe_streaming(&f, b);
}
END_TEST

START_TEST(moe_too_small_names_the_need)
{
	struct fake_moe f;
	fake_moe_init(&f);
	uint64_t need = 2 * GLOBAL_B + ATTN_B + ROUTER_B + EXPERT_B;
	char want[32], exact[32], whole[48];
	format_size(need, want, sizeof(want));
	snprintf(exact, sizeof(exact), "(%llu bytes", (unsigned long long)need);
	snprintf(whole, sizeof(whole), "needs %llu bytes", (unsigned long long)moe_resident_bytes());
	uint64_t budgets[] = {need - 1, need - EXPERT_B, 0};
	for (size_t i = 0; i < ARRAY_SIZE(budgets); i++) {
		struct plan *p = NULL;
		char err[512] = "";
		ck_assert_int_eq(plan_create(&f.m, budgets[i], &p, err, sizeof(err)), -ENOSPC);
		ck_assert_ptr_null(p);
		ck_assert_msg(strstr(err, "one expert group") && strstr(err, "too small"), "%s", err);
		ck_assert_msg(strstr(err, want) != NULL, "names %s: %s", want, err);
		ck_assert_msg(strstr(err, exact) != NULL, "names %s: %s", exact, err);
		ck_assert_msg(strstr(err, whole) != NULL, "names %s: %s", whole, err);
	}
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
	tcase_add_test(tc, moe_experts_stream);
	tcase_add_test(tc, moe_window_holds_a_tokens_experts);
	suite_add_tcase(s, tc);
	tc = tcase_create("errors");
	tcase_add_test(tc, too_small_names_the_need);
	tcase_add_test(tc, empty_manifest_rejected);
	tcase_add_test(tc, moe_too_small_names_the_need);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(plan_suite());
}

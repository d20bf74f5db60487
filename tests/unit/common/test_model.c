/* test_model.c - common/model.c: the group table a forward pass walks (model_groups_check), and
 * the bytes of a row in each format (dtype_row_bytes). */
#include <check.h>
#include <errno.h>
#include <string.h>

#include "common/dtype.h"
#include "common/model.h"
#include "tests/unit/common/test_helpers.h"

#define MAX_GROUPS 16

static struct model_config cfg(uint32_t layers)
{
	struct model_config c = {.arch = ARCH_LLAMA, .n_layers = layers};
	return c;
}

/* The dense layout manifest_load builds: embed, (attn, ffn) per layer, head. */
static uint32_t dense(const struct model_config *c, struct group_desc *g)
{
	uint32_t n = model_n_groups(c);
	memset(g, 0, sizeof(*g) * n);
	g[group_id_embed()] = (struct group_desc){.kind = GROUP_EMBED, .size_class = CLASS_GLOBAL};
	for (uint32_t l = 0; l < c->n_layers; l++) {
		g[group_id_attn(l)] = (struct group_desc){.kind = GROUP_ATTN, .layer = l, .size_class = CLASS_ATTN};
		g[group_id_ffn(l)] = (struct group_desc){.kind = GROUP_FFN, .layer = l, .size_class = CLASS_FFN};
	}
	g[group_id_head(c)] = (struct group_desc){.kind = GROUP_HEAD, .size_class = CLASS_GLOBAL};
	return n;
}

static void expect_refused(const struct model_config *c, const struct group_desc *g, uint32_t n, const char *want)
{
	char err[256] = "";
	ck_assert_int_eq(model_groups_check(c, g, n, err, sizeof(err)), -EINVAL);
	ck_assert_msg(strstr(err, want) != NULL, "message '%s' lacks '%s'", err, want);
}

START_TEST(test_dense_layout_walks)
{
	struct group_desc g[MAX_GROUPS];
	char err[256] = "";
	for (uint32_t layers = 1; layers <= 4; layers++) {
		struct model_config c = cfg(layers);
		ck_assert_int_eq(model_groups_check(&c, g, dense(&c, g), err, sizeof(err)), 0);
	}
}
END_TEST

/* A layer may hold more groups after its attention (experts, slices): still walkable. */
START_TEST(test_more_groups_in_a_layer)
{
	struct model_config c = cfg(2);
	struct group_desc g[MAX_GROUPS];
	uint32_t n = dense(&c, g);
	memmove(&g[3], &g[2], sizeof(*g) * (n - 2));
	g[3] = (struct group_desc){.kind = GROUP_FFN, .layer = 0, .size_class = CLASS_FFN};
	char err[256] = "";
	ck_assert_int_eq(model_groups_check(&c, g, n + 1, err, sizeof(err)), 0);
}
END_TEST

START_TEST(test_malformed_tables_refused)
{
	struct model_config c = cfg(3);
	struct group_desc g[MAX_GROUPS];
	uint32_t n = dense(&c, g);
	g[0].kind = GROUP_ATTN;
	expect_refused(&c, g, n, "does not open with the embedding");
	n = dense(&c, g);
	expect_refused(&c, g, n - 1, "does not open with the embedding and end with the head");
	n = dense(&c, g);
	g[group_id_attn(1)].layer = 2; /* a layer skipped */
	expect_refused(&c, g, n, "opens layer 2 out of order");
	n = dense(&c, g);
	g[group_id_ffn(0)].kind = GROUP_ATTN; /* attention with nothing after it */
	expect_refused(&c, g, n, "out of order");
	n = dense(&c, g);
	g[group_id_ffn(1)].layer = 0; /* an FFN of another layer */
	expect_refused(&c, g, n, "does not follow its layer's attention");
	n = dense(&c, g);
	g[group_id_ffn(2)].kind = GROUP_HEAD;
	expect_refused(&c, g, n, "head group inside the layers");
	n = dense(&c, g);
	g[group_id_ffn(2)].kind = GROUP_KIND_COUNT;
	expect_refused(&c, g, n, "unknown kind");
	n = dense(&c, g);
	g[group_id_attn(0)].size_class = CLASS_COUNT;
	expect_refused(&c, g, n, "size class");
	struct model_config more = cfg(4); /* the table holds 3 layers */
	n = dense(&c, g);
	expect_refused(&more, g, n, "the model has 4 layers");
}
END_TEST

START_TEST(test_row_bytes)
{
	ck_assert_uint_eq(dtype_row_bytes(DT_F32, 4096), 16384);
	ck_assert_uint_eq(dtype_row_bytes(DT_BF16, 4096), 8192);
	ck_assert_uint_eq(dtype_row_bytes(DT_F16, 14336), 28672);
	for (int t = 0; t < DT_ELEMENT_COUNT; t++) {
		ck_assert_uint_eq(dtype_block_elems((enum dtype)t), 1);
		ck_assert_uint_eq(dtype_row_bytes((enum dtype)t, 1), dtype_size((enum dtype)t));
	}
	/* Block formats: whole blocks per row (a 4096-wide row of Q4_K is 16 blocks of 144 bytes). */
	ck_assert_uint_eq(dtype_row_bytes(DT_Q4_K, 4096), 2304);
	ck_assert_uint_eq(dtype_row_bytes(DT_Q5_K, 4096), 2816);
	ck_assert_uint_eq(dtype_row_bytes(DT_Q6_K, 4096), 3360);
	ck_assert_uint_eq(dtype_row_bytes(DT_Q8_0, 4096), 4352);
	ck_assert_uint_eq(dtype_row_bytes(DT_Q4_0, 4096), 2304);
}
END_TEST

static Suite *model_suite(void)
{
	Suite *s = suite_create("model");
	TCase *tc = tcase_create("groups");
	tcase_add_test(tc, test_dense_layout_walks);
	tcase_add_test(tc, test_more_groups_in_a_layer);
	tcase_add_test(tc, test_malformed_tables_refused);
	suite_add_tcase(s, tc);
	tc = tcase_create("formats");
	tcase_add_test(tc, test_row_bytes);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(model_suite());
}

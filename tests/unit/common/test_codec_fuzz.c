/* test_codec_fuzz.c - common/codec.c: a deterministic fuzz loop over mutated messages: what
 * decodes re-encodes stably, what does not is refused with a message. */
#include <check.h>
#include <errno.h>
#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/protocol.h"
#include "common/util.h"
#include "tests/unit/common/codec_test_util.h"
#include "tests/unit/common/test_helpers.h"

/* ---- fuzz ---- */

static uint64_t rng_state;

static uint64_t rnd(void)
{
	uint64_t x = rng_state;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return rng_state = x;
}

static const uint8_t interesting[] = {0x00, 0x01, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1,
				      0xc4, 0xc7, 0xca, 0xcb, 0xcc, 0xcf, 0xd3, 0xd4, 0xd9, 0xdc, 0xdd,
				      0xde, 0xdf, 0xe0, 0xff, 0x94, 0x3f};

START_TEST(test_fuzz)
{
	/* Seeds: every type, small variants (a few hundred bytes at most). */
	enum { MAX_SEEDS = 128, BUF = 4096 };
	uint8_t *seeds[MAX_SEEDS];
	size_t seed_len[MAX_SEEDS];
	int n_seeds = 0;
	for (int i = 0; i < N_TYPES; i++) {
		for (int v = 0; v < N_VARIANTS && n_seeds < MAX_SEEDS; v++) {
			struct arena a = {0};
			struct msg m;
			fill(&m, &contract[i], v, &a);
			void *buf;
			size_t len;
			ck_assert_int_eq(msg_encode(&m, &buf, &len), 0);
			if (len <= 512) {
				seeds[n_seeds] = buf;
				seed_len[n_seeds++] = len;
			} else {
				free(buf);
			}
			arena_free(&a);
		}
	}
	ck_assert_int_gt(n_seeds, 50);
	rng_state = 0x2545f4914f6cdd1dull;
	uint8_t *buf = malloc(BUF);
	ck_assert_ptr_nonnull(buf);
	long accepted = 0, rejected = 0;
	for (long iter = 0; iter < 200000; iter++) {
		size_t len;
		uint64_t r = rnd();
		if (r % 8 == 0) { /* random bytes, often starting like a message */
			len = rnd() % 64;
			for (size_t j = 0; j < len; j++)
				buf[j] = (uint8_t)rnd();
			if (len && (r & 0x100))
				buf[0] = 0x94;
			if (len > 1 && (r & 0x200))
				buf[1] = 0x01;
		} else { /* a mutated valid message */
			int s = (int)(rnd() % (uint64_t)n_seeds);
			len = seed_len[s];
			memcpy(buf, seeds[s], len);
			int edits = 1 + (int)(rnd() % 4);
			for (int e = 0; e < edits; e++) {
				uint64_t what = rnd() % 6;
				size_t pos = len ? (size_t)(rnd() % len) : 0;
				if (what == 0 && len) { /* bit flip */
					buf[pos] ^= (uint8_t)(1u << (rnd() % 8));
				} else if (what == 1 && len) { /* an interesting byte */
					buf[pos] = interesting[rnd() % sizeof(interesting)];
				} else if (what == 2) { /* truncate */
					len = pos;
				} else if (what == 3 && len + 8 < BUF) { /* insert bytes */
					size_t k = 1 + (size_t)(rnd() % 8);
					memmove(buf + pos + k, buf + pos, len - pos);
					for (size_t j = 0; j < k; j++)
						buf[pos + j] = (uint8_t)rnd();
					len += k;
				} else if (what == 4 && len) { /* delete a byte */
					memmove(buf + pos, buf + pos + 1, len - pos - 1);
					len--;
				} else if (what == 5 && len && len * 2 < BUF) { /* duplicate a tail */
					size_t k = len - pos;
					memcpy(buf + len, buf + pos, k);
					len += k;
				}
			}
		}
		struct msg out;
		char err[256] = "";
		int rc = msg_decode(buf, len, &out, err, sizeof(err));
		if (rc == 0) {
			/* what decodes re-encodes, and that decodes to the same */
			void *again;
			size_t again_len;
			int erc = msg_encode(&out, &again, &again_len);
			TH_CHECK(erc == 0, "iteration %ld: decoded message does not re-encode: %d", iter, erc);
			struct msg out2;
			int drc = msg_decode(again, again_len, &out2, err, sizeof(err));
			TH_CHECK(drc == 0, "iteration %ld: re-encoding does not decode: %s", iter, err);
			void *third;
			size_t third_len;
			TH_CHECK(msg_encode(&out2, &third, &third_len) == 0, "iteration %ld", iter);
			TH_CHECK(third_len == again_len && memcmp(third, again, again_len) == 0,
				 "iteration %ld: encoding not stable", iter);
			free(third);
			free(again);
			msg_free(&out2);
			accepted++;
		} else {
			TH_CHECK(rc == -EBADMSG || rc == -ENOMSG || rc == -EPROTONOSUPPORT,
				 "iteration %ld: unexpected rc %d (%s)", iter, rc, err);
			TH_CHECK(err[0], "iteration %ld: rc %d without a message", iter, rc);
			rejected++;
		}
		msg_free(&out);
		msg_free(&out);
	}
	ck_assert_int_gt(accepted, 1000); /* the mutations keep some messages valid (unknown keys etc.) */
	ck_assert_int_gt(rejected, 100000);
	free(buf);
	for (int i = 0; i < n_seeds; i++)
		free(seeds[i]);
}
END_TEST

int main(void)
{
	TCase *tc = tcase_create("fuzz");
	tcase_add_test(tc, test_fuzz);
	return codec_run(tc);
}

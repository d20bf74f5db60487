/* mem_store.c - a KV store in the test process (mem_store.h). */
#include "tests/unit/gpu-runner/mem_store.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static int dead(struct store *s)
{
	snprintf(s->err, sizeof(s->err), "kv-store did not answer: the kv-store process died");
	return -EPIPE;
}

/* Handles are index + 1, so 0 is never one. */
static int check(struct store *s, uint32_t n, const uint64_t *h)
{
	for (uint32_t i = 0; i < n; i++)
		if (h[i] == 0 || h[i] > s->used || !s->refs[h[i] - 1]) {
			snprintf(s->err, sizeof(s->err), "no block %llu", (unsigned long long)h[i]);
			return -EINVAL;
		}
	return 0;
}

static int st_alloc(void *ctx, uint32_t n, uint64_t *handles, void **ptrs)
{
	struct store *s = ctx;
	if (s->dead)
		return dead(s);
	if (s->used + n > STORE_BLOCKS) {
		snprintf(s->err, sizeof(s->err), "the store is full");
		return -ENOSPC;
	}
	for (uint32_t i = 0; i < n; i++) {
		uint32_t b = s->used++;
		s->refs[b] = 1;
		handles[i] = b + 1;
		ptrs[i] = s->mem + (size_t)b * s->block_bytes;
	}
	return 0;
}

static int st_commit(void *ctx, uint32_t n, const uint64_t *handles, void *const *ptrs, const uint64_t *keys,
		     const void *event)
{
	struct store *s = ctx;
	return s->dead ? dead(s) : check(s, n, handles);
}

static int st_fetch(void *ctx, uint32_t n, const uint64_t *handles, void **ptrs)
{
	struct store *s = ctx;
	int rc = s->dead ? dead(s) : check(s, n, handles);
	if (!rc && s->fetch_cap && n > s->fetch_cap) {
		snprintf(s->err, sizeof(s->err), "KV pool full: %u needed, room for %u", n, s->fetch_cap);
		s->fetch_refused++;
		return -ENOSPC;
	}
	for (uint32_t i = 0; i < n && !rc; i++) {
		s->pins[handles[i] - 1]++;
		ptrs[i] = s->mem + (size_t)(handles[i] - 1) * s->block_bytes;
	}
	return rc;
}

static int st_unpin(void *ctx, uint32_t n, const uint64_t *handles)
{
	struct store *s = ctx;
	int rc = s->dead ? dead(s) : check(s, n, handles);
	for (uint32_t i = 0; i < n && !rc; i++)
		if (s->pins[handles[i] - 1])
			s->pins[handles[i] - 1]--;
	return rc;
}

static int st_release(void *ctx, uint32_t n, const uint64_t *handles)
{
	struct store *s = ctx;
	if (!s->dead && ++s->releases == s->die_at_release)
		s->dead = true;
	int rc = s->dead ? dead(s) : check(s, n, handles);
	for (uint32_t i = 0; i < n && !rc; i++)
		s->refs[handles[i] - 1]--;
	return rc;
}

static int st_unpin_all(void *ctx)
{
	struct store *s = ctx;
	if (s->dead)
		return dead(s);
	memset(s->pins, 0, sizeof(s->pins));
	return 0;
}

static uint32_t st_max_batch(void *ctx)
{
	return STORE_BLOCKS;
}

static const char *st_error(void *ctx)
{
	return ((struct store *)ctx)->err;
}

const struct kv_remote_ops store_ops = {
	.alloc = st_alloc, .commit = st_commit, .fetch = st_fetch, .unpin = st_unpin, .release = st_release,
	.unpin_all = st_unpin_all, .max_batch = st_max_batch, .error = st_error,
};

uint32_t refs_held(const struct store *s)
{
	uint32_t n = 0;
	for (uint32_t b = 0; b < s->used; b++)
		n += s->refs[b];
	return n;
}

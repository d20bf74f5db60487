/* link_shm.c - the shm kind of stage link (link.h): the rows of a message pass through a slot of the
 * formation's object. Hop h has SLINK_SLOTS slots; its k-th message goes into slot k % SLINK_SLOTS
 * once the message before it there was taken, so a sender runs at most one message ahead. */
#include "services/gpu-runner/stages/link_internal.h"

#include <errno.h>
#include <stdio.h>

#include "common/util.h"

/* Spins this many looks before it sleeps: a decode step's message comes within microseconds. */
#define SPINS 2000

/* Waits until *w reaches at least target (counted modulo 2^32). */
static int wait_word(struct stage_link *l, _Atomic uint32_t *w, uint32_t target, const char *what)
{
	uint64_t t0 = now_ns();
	for (uint32_t spin = 0;; spin++) {
		uint32_t v = atomic_load_explicit(w, memory_order_acquire);
		if ((int32_t)(v - target) >= 0)
			return 0;
		if (spin < SPINS)
			continue;
		int rc = link_check_wait(l, spin == SPINS ? 0 : (now_ns() - t0) / 1000000, what);
		if (rc)
			return rc;
		link_futex_wait(w, v, 10);
	}
}

static int shm_connect(struct stage_link *l)
{
	return 0;
}

static float *slot_data(struct stage_link *l, const struct slink_slot *s)
{
	return (float *)((char *)l->h + s->data_off);
}

static int shm_send(struct stage_link *l, struct backend *be, uint32_t row0, uint32_t n)
{
	uint32_t k = l->sent_k + 1, hop = l->p.rank;
	struct slink_slot *s = &l->h->slot[hop][k % SLINK_SLOTS];
	char what[96];
	snprintf(what, sizeof(what), "sending to stage %u", (hop + 1) % l->p.ranks);
	/* The slot's message before this one (k - SLINK_SLOTS) must have been taken. */
	int rc = wait_word(l, &s->taken, k - SLINK_SLOTS, what);
	if (rc)
		return rc;
	if ((rc = backend_hidden_get(be, row0, n, slot_data(l, s))) != 0)
		return link_fail(l, rc, "%s: %s", what, backend_error(be));
	s->rows = n;
	atomic_store_explicit(&s->seq, k, memory_order_release);
	link_futex_wake(&s->seq);
	l->sent_k = k;
	return 0;
}

static int shm_recv(struct stage_link *l, struct backend *be, uint32_t row0, uint32_t n, const struct backend_batch *b)
{
	uint32_t k = l->recv_k + 1, hop = (l->p.rank + l->p.ranks - 1) % l->p.ranks;
	struct slink_slot *s = &l->h->slot[hop][k % SLINK_SLOTS];
	char what[96];
	snprintf(what, sizeof(what), "receiving from stage %u", hop);
	int rc = wait_word(l, &s->seq, k, what);
	if (rc)
		return rc;
	if (atomic_load_explicit(&s->seq, memory_order_acquire) != k || s->rows != n)
		return link_fail(l, -EPROTO, "%s: message %u holds %u rows, the step has %u (the stages are out of step)",
				 what, k, s->rows, n);
	rc = b ? backend_hidden_in(be, b, slot_data(l, s)) : backend_hidden_put(be, row0, n, slot_data(l, s));
	if (rc)
		return link_fail(l, rc, "%s: %s", what, backend_error(be));
	atomic_store_explicit(&s->taken, k, memory_order_release);
	link_futex_wake(&s->taken);
	l->recv_k = k;
	return 0;
}

static int shm_wait(struct stage_link *l, struct backend *be)
{
	return 0; /* a send and a receive have completed when they return */
}

static void shm_destroy(struct stage_link *l)
{
}

const struct stage_link_ops stage_link_shm_ops = {
	.kind = "shm",
	.connect = shm_connect,
	.send = shm_send,
	.recv = shm_recv,
	.wait = shm_wait,
	.destroy = shm_destroy,
};

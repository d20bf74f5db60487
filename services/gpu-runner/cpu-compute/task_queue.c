/* task_queue.c - the bounded MPMC ring of task_queue.h. Positions are free-running uint32_t
 * (masked on access, compared through their signed difference), so they wrap harmlessly. */
#include "services/gpu-runner/cpu-compute/task_queue.h"

#include <errno.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "common/util.h"

struct task_cell {
	_Atomic uint32_t seq; /* pos: free for the producer of pos; pos + 1: holds pos's item */
	struct task_item item;
};

struct task_queue {
	alignas(CACHE_LINE) _Atomic uint32_t enq; /* next position a producer claims */
	alignas(CACHE_LINE) _Atomic uint32_t deq; /* next position a consumer claims */
	alignas(CACHE_LINE) uint32_t mask;	  /* capacity - 1 */
	struct task_cell *cells;		  /* capacity cells */
};

int task_queue_create(uint32_t capacity, struct task_queue **out, char *err, size_t errlen)
{
	*out = NULL;
	if (capacity < TASK_QUEUE_MIN_CAPACITY || capacity > TASK_QUEUE_MAX_CAPACITY || (capacity & (capacity - 1)))
		return errorf(err, errlen, -EINVAL, "task queue: capacity %u is not a power of two in [%u, %u]", capacity,
			      TASK_QUEUE_MIN_CAPACITY, TASK_QUEUE_MAX_CAPACITY);
	struct task_queue *q = aligned_alloc(CACHE_LINE, sizeof(*q));
	if (!q)
		return errorf(err, errlen, -ENOMEM, "task queue: out of memory");
	q->cells = aligned_alloc(CACHE_LINE, ALIGN_UP(sizeof(struct task_cell) * capacity, CACHE_LINE));
	if (!q->cells) {
		free(q);
		return errorf(err, errlen, -ENOMEM, "task queue: out of memory for %u cells", capacity);
	}
	q->mask = capacity - 1;
	for (uint32_t i = 0; i < capacity; i++) {
		atomic_init(&q->cells[i].seq, i);
		q->cells[i].item = (struct task_item){0};
	}
	atomic_init(&q->enq, 0);
	atomic_init(&q->deq, 0);
	*out = q;
	return 0;
}

void task_queue_destroy(struct task_queue **qp)
{
	if (!qp || !*qp)
		return;
	free((*qp)->cells);
	free(*qp);
	*qp = NULL;
}

bool task_queue_push(struct task_queue *q, struct task_item item)
{
	uint32_t pos = atomic_load_explicit(&q->enq, memory_order_relaxed);
	struct task_cell *c;
	for (;;) {
		c = &q->cells[pos & q->mask];
		/* Pairs with the release store in task_queue_pop that freed the cell for this lap. */
		uint32_t seq = atomic_load_explicit(&c->seq, memory_order_acquire);
		int32_t dif = (int32_t)(seq - pos);
		if (dif == 0) {
			if (atomic_compare_exchange_weak_explicit(&q->enq, &pos, pos + 1, memory_order_relaxed,
								  memory_order_relaxed))
				break;
			/* pos now holds the index another producer moved it to: retry there */
		} else if (dif < 0) {
			return false; /* the cell still holds the item of the previous lap: full */
		} else {
			pos = atomic_load_explicit(&q->enq, memory_order_relaxed);
		}
	}
	c->item = item;
	/* Publishes the item; pairs with the acquire load in task_queue_pop. */
	atomic_store_explicit(&c->seq, pos + 1, memory_order_release);
	return true;
}

bool task_queue_pop(struct task_queue *q, struct task_item *out)
{
	uint32_t pos = atomic_load_explicit(&q->deq, memory_order_relaxed);
	struct task_cell *c;
	for (;;) {
		c = &q->cells[pos & q->mask];
		/* Pairs with the release store in task_queue_push that published the item. */
		uint32_t seq = atomic_load_explicit(&c->seq, memory_order_acquire);
		int32_t dif = (int32_t)(seq - (pos + 1));
		if (dif == 0) {
			if (atomic_compare_exchange_weak_explicit(&q->deq, &pos, pos + 1, memory_order_relaxed,
								  memory_order_relaxed))
				break;
		} else if (dif < 0) {
			return false; /* not yet published for this lap: empty */
		} else {
			pos = atomic_load_explicit(&q->deq, memory_order_relaxed);
		}
	}
	*out = c->item;
	/* Frees the cell for the producer one lap on; pairs with the acquire load in task_queue_push. */
	atomic_store_explicit(&c->seq, pos + q->mask + 1, memory_order_release);
	return true;
}

uint32_t task_queue_depth(const struct task_queue *q)
{
	/* deq first: a consumer claims a position only after its producer did, so enq read later is
	 * at least this deq. */
	uint32_t deq = atomic_load_explicit(&((struct task_queue *)q)->deq, memory_order_relaxed);
	uint32_t enq = atomic_load_explicit(&((struct task_queue *)q)->enq, memory_order_relaxed);
	uint32_t d = enq - deq;
	if ((int32_t)d < 0)
		return 0;
	return d > q->mask + 1 ? q->mask + 1 : d;
}

uint32_t task_queue_capacity(const struct task_queue *q)
{
	return q->mask + 1;
}

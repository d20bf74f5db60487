/* task_queue.h - a bounded multi-producer multi-consumer queue of work items: the ring of
 * sequence-numbered cells that D. Vyukov described, over C11 atomics, with no lock and no
 * allocation after create.
 *
 *   struct task_queue *q;
 *   rc = task_queue_create(4096, &q, err, sizeof(err));
 *   if (!task_queue_push(q, (struct task_item){job, part})) ...full: try again later...
 *   struct task_item it;
 *   if (task_queue_pop(q, &it)) ...run it...
 *   task_queue_destroy(&q);
 *
 * Every cell carries a sequence number that says whose turn it is: a producer may fill cell
 * pos & mask when its sequence equals pos, a consumer may empty it when it equals pos + 1, and
 * emptying it hands it to the producer of the next lap (pos + capacity). Producers (consumers)
 * claim positions with a compare-and-swap on the enqueue (dequeue) index, each on its own cache
 * line. A push's release store of the sequence pairs with the acquire load in the pop that
 * empties the cell, so what a producer wrote before pushing is visible to the consumer that pops
 * the item.
 *
 * Progress: no thread ever waits on a lock, but a producer preempted between claiming a cell and
 * publishing it makes that cell (and so the queue, for consumers) look empty until it runs again;
 * the queue is not lock-free in the strict sense, which a pool of workers that retry tolerates.
 * Items come out in the order their positions were claimed (FIFO across producers).
 */
#ifndef GPU_RUNNER_TASK_QUEUE_H
#define GPU_RUNNER_TASK_QUEUE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

#define TASK_QUEUE_MIN_CAPACITY 2u
#define TASK_QUEUE_MAX_CAPACITY (1u << 24)

/* One work item: what the pool queues is (job, part index). */
struct task_item {
	void *ptr;
	uint64_t arg;
};

struct task_queue;

/* Makes an empty queue of `capacity` items (a power of two in [TASK_QUEUE_MIN_CAPACITY,
 * TASK_QUEUE_MAX_CAPACITY]). Returns 0 and the queue in *out (the caller owns it), -EINVAL for
 * another capacity, -ENOMEM; with the message in err ("task queue: ..."). */
int task_queue_create(uint32_t capacity, struct task_queue **out, char *err, size_t errlen);
/* Frees the queue (items still in it are dropped: the owner drains it first); NULLs *q; safe on
 * NULL and twice. No other thread may use the queue any more. */
void task_queue_destroy(struct task_queue **q);
/* Appends item. Returns true, or false when the queue is full (nothing changed). Any thread. */
bool task_queue_push(struct task_queue *q, struct task_item item);
/* Takes the oldest item into *out. Returns true, or false when the queue is empty (or its
 * oldest cell is claimed but not yet published). Any thread. */
bool task_queue_pop(struct task_queue *q, struct task_item *out);
/* Items in the queue now (claimed positions; a snapshot that may be stale at once). */
uint32_t task_queue_depth(const struct task_queue *q);
uint32_t task_queue_capacity(const struct task_queue *q);

#ifdef __cplusplus
}
#endif
#endif

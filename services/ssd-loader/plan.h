/* plan.h - how the DRAM budget is spent: how many slots of each size class the weight ring
 * gets, and which groups stay resident.
 *
 *   struct plan *p;
 *   rc = plan_create(m, budget, &p, err, sizeof(err));   // -ENOSPC: budget too small, err says how much is needed
 *   plan_describe(p, buf, sizeof(buf)); log_info("%s", buf);
 *   for (s = 0; s < plan_n_slots(p); s++) ... plan_slot_class(p, s), plan_slot_group(p, s)
 *   plan_destroy(&p);
 *
 * The rule: if one slot per group fits the budget, every group is resident (read once at
 * start). Otherwise the globals (embed, head) are pinned, one slot each; then the budget buys a
 * streaming window of up to PLAN_STREAM_SLOTS slots per layer class (attention, FFN; fewer when
 * the budget is tight, at least one) and, with what is left, as many pinned layer groups as fit,
 * chosen to pin the most bytes: each pinned group is a read less per token. Layers are pinned
 * from the last one down, since the GPU window keeps the first layers on the device.
 *
 * A mixture-of-experts model streams its experts the same way: a third window of up to
 * PLAN_STREAM_SLOTS expert slots (CLASS_EXPERT; as many as a token's chosen experts, num_experts_per_tok,
 * where those are more and the budget allows, since a layer's are asked for together) beside the
 * attention and router (CLASS_FFN) windows, and the split of what is left between pinned attention, router and expert groups that
 * pins the most bytes; experts are pinned from the last layer down, expert 0 first. The engine
 * visits attn(l), moe(l), expert(l, 0..E-1) in order, so the loader's in-order read-ahead serves
 * them; every expert is read whether routed to or not (fetching only the routed ones is to come).
 * The minimum is then the globals plus one attention, one router and one expert slot.
 *
 * Slots are numbered: pinned (dedicated) slots first, in group order, then the streaming
 * slots class by class. Only slot data counts against the budget; the ring's header and
 * tables come on top (kilobytes). */
#ifndef SSD_LOADER_PLAN_H
#define SSD_LOADER_PLAN_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/manifest.h"
#ifdef __cplusplus
extern "C" {
#endif

#define PLAN_SLOT_ALIGN 4096u /* slot capacities and data offsets are multiples of this */
#define PLAN_STREAM_SLOTS 3u  /* streaming slots per class when the budget allows: reads run ahead */

struct plan;

/* Plans m (borrowed: read during the call only) under dram_budget bytes. Returns 0 with
 * *out owned by the caller; -ENOSPC when the budget cannot hold the globals and one slot of
 * each streaming class (err: "--dram-budget X is too small: ... need at least Y (N bytes; the whole
 * model resident needs M bytes)");
 * -EINVAL for a manifest without groups; -ENOMEM. */
int plan_create(const struct manifest *m, uint64_t dram_budget, struct plan **out, char *err, size_t errlen);

/* Safe on NULL and twice; NULLs *p. */
void plan_destroy(struct plan **p);

bool plan_all_resident(const struct plan *p);
uint64_t plan_budget(const struct plan *p);
uint32_t plan_n_groups(const struct plan *p);
uint32_t plan_n_slots(const struct plan *p);
/* enum size_class of a slot. */
uint32_t plan_slot_class(const struct plan *p, uint32_t slot);
/* The group a slot is dedicated to (a pinned group), or UINT32_MAX for a streaming slot. */
uint32_t plan_slot_group(const struct plan *p, uint32_t slot);
/* Bytes of one slot of a class (the class's largest group, rounded up to PLAN_SLOT_ALIGN). */
uint64_t plan_class_capacity(const struct plan *p, uint32_t cls);
/* Slots of a class, all of them / only the streaming ones (k). */
uint32_t plan_class_slots(const struct plan *p, uint32_t cls);
uint32_t plan_streaming_slots(const struct plan *p, uint32_t cls);
/* Does group stay resident in a slot of its own? */
bool plan_group_pinned(const struct plan *p, uint32_t group);
/* Bytes read from disk per pass over the model once the pinned groups are in: the groups that
 * stream (0 when everything is resident). m is the manifest the plan was made from. */
uint64_t plan_disk_bytes_per_pass(const struct plan *p, const struct manifest *m);
/* Sum of every slot's capacity: the ring's data region. */
uint64_t plan_data_bytes(const struct plan *p);
/* What one slot per group would take (the all-resident size). */
uint64_t plan_resident_bytes(const struct plan *p);

/* One line for the log: mode, slots per class with their sizes, bytes used of the budget. */
void plan_describe(const struct plan *p, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif

/* plan.c - slots per size class under the DRAM budget. See plan.h. */
#include "services/ssd-loader/plan.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

#define NO_GROUP UINT32_MAX

struct plan {
	bool all_resident;
	uint64_t budget;	/* bytes */
	uint32_t n_groups;
	uint32_t n_slots;
	uint64_t capacity[CLASS_COUNT];	 /* bytes per slot of the class */
	uint32_t class_slots[CLASS_COUNT];
	uint32_t streaming[CLASS_COUNT]; /* k per class */
	uint64_t data_bytes;
	uint64_t resident_bytes;
	uint8_t *pinned;		 /* n_groups flags */
	uint32_t *slot_class;		 /* n_slots */
	uint32_t *slot_group;		 /* n_slots: dedicated group or NO_GROUP */
};

static const char *class_name(uint32_t c)
{
	static const char *const names[CLASS_COUNT] = {"attention", "FFN", "global", "expert"};
	return c < CLASS_COUNT ? names[c] : "?";
}

/* The expert slots that `room` bytes buy with a window of k streaming slots: all n expert groups
 * pinned (*ke = 0) when they fit, else as many pinned as fit beside min(k, n) streaming slots.
 * Returns false when not even that window fits. */
static bool plan_experts(uint64_t room, uint32_t k, uint64_t n, uint64_t x, uint64_t *ne, uint64_t *ke)
{
	uint64_t t = x ? room / x : n;
	if (t >= n) {
		*ne = n;
		*ke = 0;
		return true;
	}
	uint64_t w = k < n ? k : n;
	if (t < w)
		return false;
	*ne = t - w;
	*ke = w;
	return true;
}

int plan_create(const struct manifest *m, uint64_t dram_budget, struct plan **out, char *err, size_t errlen)
{
	if (!m || m->n_groups == 0 || !m->groups) {
		snprintf(err, errlen, "the model has no weight groups to plan");
		return -EINVAL;
	}
	for (uint32_t g = 0; g < m->n_groups; g++) {
		if (m->groups[g].size_class >= CLASS_COUNT) {
			snprintf(err, errlen, "group %u has size class %u, not one of the %d known", g,
				 m->groups[g].size_class, CLASS_COUNT);
			return -EINVAL;
		}
	}
	struct plan *p = calloc(1, sizeof(*p));
	if (!p)
		goto out_nomem;
	p->budget = dram_budget;
	p->n_groups = m->n_groups;
	for (int c = 0; c < CLASS_COUNT; c++)
		p->capacity[c] = ALIGN_UP(m->class_bytes[c], (uint64_t)PLAN_SLOT_ALIGN);
	for (uint32_t g = 0; g < m->n_groups; g++)
		p->resident_bytes += p->capacity[m->groups[g].size_class];
	p->pinned = calloc(m->n_groups, 1);
	if (!p->pinned)
		goto out_free;

	uint64_t pinned_bytes = 0;
	if (p->resident_bytes <= dram_budget) {
		p->all_resident = true;
		memset(p->pinned, 1, m->n_groups);
		pinned_bytes = p->resident_bytes;
	} else {
		/* Pin the globals; then as many layer groups as the budget allows beside a streaming
		 * window of PLAN_STREAM_SLOTS slots per class: every pinned group is one read less per
		 * token. Layers are pinned from the last one down, because the GPU window keeps the
		 * first layers on the device: what the GPU streams is what DRAM should hold. */
		for (uint32_t g = 0; g < m->n_groups; g++) {
			uint32_t kind = m->groups[g].kind;
			if (kind == GROUP_EMBED || kind == GROUP_HEAD) {
				p->pinned[g] = 1;
				pinned_bytes += p->capacity[m->groups[g].size_class];
			}
		}
		uint64_t a = p->capacity[CLASS_ATTN], f = p->capacity[CLASS_FFN], x = p->capacity[CLASS_EXPERT];
		uint32_t L = m->cfg.n_layers;
		uint64_t n_expert_groups = (uint64_t)L * m->cfg.n_experts; /* 0 for a dense model */
		uint64_t rest = dram_budget > pinned_bytes ? dram_budget - pinned_bytes : 0;
		int64_t best_na = -1, best_nf = -1, best_ka = 0, best_kf = 0;
		uint64_t best = 0, best_ne = 0, best_ke = 0;
		/* The deepest window that fits first (reads overlap), then the most pinned bytes. */
		for (uint32_t k = PLAN_STREAM_SLOTS; k >= 1 && best_na < 0; k--) {
			/* The experts' window at the deepest level holds a layer's chosen experts of a token
			 * (the runner asks for them together at the routing and the loader reads them at once:
			 * weights_ring.c), where a token chooses more than PLAN_STREAM_SLOTS. */
			const uint32_t kx = k == PLAN_STREAM_SLOTS && m->cfg.n_experts_used > k ? m->cfg.n_experts_used : k;
			for (uint32_t na = 0; na <= L; na++) {
				for (int64_t nf = L; nf >= 0; nf--) {
					uint32_t sa = L - na, sf = L - (uint32_t)nf;
					uint64_t ka = sa < k ? sa : k, kf = sf < k ? sf : k;
					uint64_t bytes = (uint64_t)na * a + (uint64_t)nf * f + ka * a + kf * f;
					if (bytes > rest)
						continue;
					uint64_t ne = 0, ke = 0;
					if (n_expert_groups && !plan_experts(rest - bytes, kx, n_expert_groups, x, &ne, &ke))
						continue;
					uint64_t res = (uint64_t)na * a + (uint64_t)nf * f + ne * x;
					if (best_na < 0 || res > best) {
						best = res;
						best_na = na;
						best_nf = nf;
						best_ka = (int64_t)ka;
						best_kf = (int64_t)kf;
						best_ne = ne;
						best_ke = ke;
					}
					/* Dense: the most FFN groups that fit is the best for this na. With
					 * experts every split of the rest between the classes is tried. */
					if (!n_expert_groups)
						break;
				}
			}
		}
		if (best_na < 0) {
			char have[32], need[32];
			uint64_t needed = pinned_bytes + a + f + (n_expert_groups ? x : 0);
			snprintf(err, errlen,
				 "--dram-budget %s is too small: the globals and one %s group need at "
				 "least %s (%llu bytes; the whole model resident needs %llu bytes)",
				 format_size(dram_budget, have, sizeof(have)),
				 n_expert_groups ? "attention, one router and one expert" : "attention and one FFN",
				 format_size(needed, need, sizeof(need)), (unsigned long long)needed,
				 (unsigned long long)p->resident_bytes);
			plan_destroy(&p);
			return -ENOSPC;
		}
		for (uint32_t i = 0; i < (uint32_t)best_na; i++) {
			p->pinned[model_group_attn(&m->cfg, L - 1 - i)] = 1;
			pinned_bytes += a;
		}
		for (uint32_t i = 0; i < (uint32_t)best_nf; i++) {
			p->pinned[model_group_ffn(&m->cfg, L - 1 - i)] = 1;
			pinned_bytes += f;
		}
		/* Experts from the last layer down, each layer's from expert 0 up. */
		for (uint64_t i = 0; i < best_ne; i++) {
			uint32_t E = m->cfg.n_experts;
			p->pinned[model_group_expert(&m->cfg, L - 1 - (uint32_t)(i / E), (uint32_t)(i % E))] = 1;
			pinned_bytes += x;
		}
		p->streaming[CLASS_ATTN] = (uint32_t)best_ka;
		p->streaming[CLASS_FFN] = (uint32_t)best_kf;
		p->streaming[CLASS_EXPERT] = (uint32_t)best_ke;
	}

	uint32_t n_pinned = 0;
	for (uint32_t g = 0; g < m->n_groups; g++)
		n_pinned += p->pinned[g];
	p->n_slots = n_pinned;
	for (int c = 0; c < CLASS_COUNT; c++)
		p->n_slots += p->streaming[c];
	p->slot_class = calloc(p->n_slots, sizeof(*p->slot_class));
	p->slot_group = calloc(p->n_slots, sizeof(*p->slot_group));
	if (!p->slot_class || !p->slot_group)
		goto out_free;
	uint32_t s = 0;
	for (uint32_t g = 0; g < m->n_groups; g++) {
		if (!p->pinned[g])
			continue;
		p->slot_class[s] = m->groups[g].size_class;
		p->slot_group[s] = g;
		s++;
	}
	for (uint32_t c = 0; c < CLASS_COUNT; c++) {
		for (uint32_t i = 0; i < p->streaming[c]; i++) {
			p->slot_class[s] = c;
			p->slot_group[s] = NO_GROUP;
			s++;
		}
	}
	for (s = 0; s < p->n_slots; s++) {
		p->class_slots[p->slot_class[s]]++;
		p->data_bytes += p->capacity[p->slot_class[s]];
	}
	*out = p;
	return 0;

out_free:
	plan_destroy(&p);
out_nomem:
	snprintf(err, errlen, "out of memory planning the weight ring");
	return -ENOMEM;
}

uint64_t plan_disk_bytes_per_pass(const struct plan *p, const struct manifest *m)
{
	uint64_t n = 0;
	if (!p->all_resident)
		for (uint32_t g = 0; g < p->n_groups; g++)
			if (!p->pinned[g])
				n += m->groups[g].slot_bytes;
	return n;
}

void plan_destroy(struct plan **pp)
{
	if (!pp || !*pp)
		return;
	struct plan *p = *pp;
	free(p->pinned);
	free(p->slot_class);
	free(p->slot_group);
	free(p);
	*pp = NULL;
}

bool plan_all_resident(const struct plan *p)
{
	return p->all_resident;
}

uint64_t plan_budget(const struct plan *p)
{
	return p->budget;
}

uint32_t plan_n_groups(const struct plan *p)
{
	return p->n_groups;
}

uint32_t plan_n_slots(const struct plan *p)
{
	return p->n_slots;
}

uint32_t plan_slot_class(const struct plan *p, uint32_t slot)
{
	return slot < p->n_slots ? p->slot_class[slot] : CLASS_COUNT;
}

uint32_t plan_slot_group(const struct plan *p, uint32_t slot)
{
	return slot < p->n_slots ? p->slot_group[slot] : NO_GROUP;
}

uint64_t plan_class_capacity(const struct plan *p, uint32_t cls)
{
	return cls < CLASS_COUNT ? p->capacity[cls] : 0;
}

uint32_t plan_class_slots(const struct plan *p, uint32_t cls)
{
	return cls < CLASS_COUNT ? p->class_slots[cls] : 0;
}

uint32_t plan_streaming_slots(const struct plan *p, uint32_t cls)
{
	return cls < CLASS_COUNT ? p->streaming[cls] : 0;
}

bool plan_group_pinned(const struct plan *p, uint32_t group)
{
	return group < p->n_groups && p->pinned[group];
}

uint64_t plan_data_bytes(const struct plan *p)
{
	return p->data_bytes;
}

uint64_t plan_resident_bytes(const struct plan *p)
{
	return p->resident_bytes;
}

void plan_describe(const struct plan *p, char *buf, size_t len)
{
	char used[32], budget[32], model[32];
	format_size(p->data_bytes, used, sizeof(used));
	format_size(p->budget, budget, sizeof(budget));
	format_size(p->resident_bytes, model, sizeof(model));
	size_t n = (size_t)snprintf(buf, len, "%s: %u slots (", p->all_resident ? "all resident" : "streaming",
				    p->n_slots);
	for (uint32_t c = 0; c < CLASS_COUNT && n < len; c++) {
		char cap[32];
		uint32_t pinned = p->class_slots[c] - p->streaming[c];
		n += (size_t)snprintf(buf + n, len - n, "%s%s %u x %s", c ? ", " : "", class_name(c),
				      p->class_slots[c], format_size(p->capacity[c], cap, sizeof(cap)));
		if (n < len && p->class_slots[c])
			n += (size_t)snprintf(buf + n, len - n, " %s",
					      pinned == p->class_slots[c] ? "resident"
					      : pinned == 0		  ? "streaming"
									  : "mixed");
	}
	if (n < len)
		snprintf(buf + n, len - n, "), %s of the %s budget; one slot per group would take %s", used, budget,
			 model);
}

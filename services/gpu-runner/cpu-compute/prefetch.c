/* prefetch.c - weights read into the CPU's caches ahead of their product (prefetch.h). */
#include "services/gpu-runner/cpu-compute/prefetch.h"

#include <errno.h>
#include <string.h>

void cpu_prefetch_init(struct cpu_prefetch *pf, uint64_t chunk, const uint32_t *stamp, uint32_t until)
{
	memset(pf, 0, sizeof(*pf));
	if (chunk == 0)
		chunk = 64u << 10;
	pf->chunk = (chunk + CPU_PREFETCH_LINE - 1) / CPU_PREFETCH_LINE * CPU_PREFETCH_LINE;
	pf->stamp = stamp;
	pf->until = until;
}

int cpu_prefetch_add(struct cpu_prefetch *pf, const void *p, uint64_t len)
{
	if (len == 0)
		return 0;
	if (pf->n == CPU_PREFETCH_RANGES)
		return -ENOSPC;
	pf->base[pf->n] = (const uint8_t *)p;
	pf->len[pf->n] = len;
	pf->start[pf->n] = pf->total;
	pf->n++;
	pf->total += len;
	return 0;
}

uint32_t cpu_prefetch_parts(const struct cpu_prefetch *pf)
{
	const uint64_t parts = (pf->total + pf->chunk - 1) / pf->chunk;
	return parts > UINT32_MAX ? UINT32_MAX : (uint32_t)parts;
}

int cpu_prefetch_part(void *arg, uint32_t part, uint32_t n_parts, char *err, size_t errlen)
{
	(void)n_parts;
	(void)err;
	(void)errlen;
	struct cpu_prefetch *pf = (struct cpu_prefetch *)arg;
	if (pf->stamp && (int32_t)(__atomic_load_n(pf->stamp, __ATOMIC_ACQUIRE) - pf->until) >= 0) {
		__atomic_fetch_add(&pf->stale_parts, 1, __ATOMIC_RELAXED);
		return 0;
	}
	uint64_t lo = (uint64_t)part * pf->chunk, hi = lo + pf->chunk;
	if (hi > pf->total)
		hi = pf->total;
	uint64_t acc = 0, read = 0;
	for (uint32_t i = 0; i < pf->n && lo < hi; i++) {
		const uint64_t s = pf->start[i], e = s + pf->len[i];
		if (e <= lo || s >= hi)
			continue;
		const uint64_t a = lo > s ? lo - s : 0, b = (hi < e ? hi : e) - s;
		/* One load a line: the first line from its start (a range need not be line-aligned). */
		const uint8_t *p = pf->base[i];
		uintptr_t first = ((uintptr_t)(p + a) + CPU_PREFETCH_LINE - 1) & ~(uintptr_t)(CPU_PREFETCH_LINE - 1);
		if (first != (uintptr_t)(p + a))
			acc ^= p[a];
		for (uintptr_t q = first; q < (uintptr_t)(p + b); q += CPU_PREFETCH_LINE)
			acc ^= *(const volatile uint64_t *)q ^ (uint64_t)q;
		read += b - a;
	}
	__atomic_fetch_add(&pf->read_bytes, read, __ATOMIC_RELAXED);
	__atomic_fetch_xor(&pf->sink, (uint32_t)(acc ^ (acc >> 32)), __ATOMIC_RELAXED);
	return 0;
}

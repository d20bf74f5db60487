/* matmul.c - several tokens' products at once (cpu_compute.h: cpu_xtiles, cpu_matmul): the
 * tokens' prepared vectors, their BF16 values in pairs for the AMX tiles (matvec_amx.c), and the
 * choice between the tiles and cpu_matvec token by token. */
#include "services/gpu-runner/cpu-compute/cpu_compute_internal.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "common/util.h"

struct cpu_xtiles {
	struct cpu_vec *xs[CPU_MATMUL_MAX_TOKENS]; /* the tokens' vectors (the caller's) */
	uint32_t n;				   /* tokens taken */
	uint32_t *pairs;			   /* BF16 on AMX: (cols / 2, n) pairs; else unused */
	size_t cap;				   /* pairs' room, in entries */
	bool tiled;				   /* pairs hold the tokens' values */
};

int cpu_xtiles_create(struct cpu_xtiles **out, char *err, size_t errlen)
{
	*out = calloc(1, sizeof(**out));
	return *out ? 0 : errorf(err, errlen, -ENOMEM, "cpu product: out of memory");
}

void cpu_xtiles_destroy(struct cpu_xtiles **xt)
{
	if (!xt || !*xt)
		return;
	free((*xt)->pairs);
	free(*xt);
	*xt = NULL;
}

const char *cpu_matmul_path(enum dtype t)
{
	if (t == DT_BF16 && (cpu_compute_isa() & CPU_ISA_AMX_BF16))
		return "amx-bf16";
	return cpu_compute_path(t);
}

int cpu_xtiles_prepare(struct cpu_xtiles *xt, struct cpu_vec *const *xs, uint32_t n, char *err, size_t errlen)
{
	xt->n = 0;
	xt->tiled = false;
	if (n < 1 || n > CPU_MATMUL_MAX_TOKENS)
		return errorf(err, errlen, -EINVAL, "cpu product: %u tokens at once (1 to %u)", n, CPU_MATMUL_MAX_TOKENS);
	for (uint32_t t = 0; t < n; t++) {
		if (!xs[t] || !xs[t]->ready)
			return errorf(err, errlen, -EINVAL, "cpu product: token %u's x is not prepared", t);
		if (xs[t]->wfmt != xs[0]->wfmt || xs[t]->n != xs[0]->n)
			return errorf(err, errlen, -EINVAL,
				      "cpu product: token %u's x (%u values for %s) is not like token 0's (%u for %s)", t,
				      xs[t]->n, dtype_name(xs[t]->wfmt), xs[0]->n, dtype_name(xs[0]->wfmt));
		xt->xs[t] = xs[t];
	}
	xt->n = n;
	if (xs[0]->wfmt != DT_BF16 || !(cpu_compute_isa() & CPU_ISA_AMX_BF16) || xs[0]->n % 32)
		return 0;
	/* pairs[p n + t]: token t's bf16 values at columns 2p and 2p + 1, the first in the low half. */
	const uint32_t np = xs[0]->n / 2;
	const size_t need = (size_t)np * n;
	if (need > xt->cap) {
		uint32_t *p = aligned_alloc(CC_ALIGN, (need * sizeof(uint32_t) + CC_ALIGN - 1) / CC_ALIGN * CC_ALIGN);
		if (!p) {
			xt->n = 0;
			return errorf(err, errlen, -ENOMEM, "cpu product: out of memory for %u tokens of %u values", n,
				      xs[0]->n);
		}
		free(xt->pairs);
		xt->pairs = p;
		xt->cap = need;
	}
	for (uint32_t t = 0; t < n; t++) {
		const uint16_t *bf = xs[t]->bf;
		for (uint32_t p = 0; p < np; p++)
			xt->pairs[(size_t)p * n + t] = (uint32_t)bf[2 * p] | (uint32_t)bf[2 * p + 1] << 16;
	}
	xt->tiled = true;
	return 0;
}

static _Atomic uint64_t tile_rows; /* rows computed on the tiles, all time (cpu_matmul_tile_rows) */

uint64_t cpu_matmul_tile_rows(void)
{
	return atomic_load_explicit(&tile_rows, memory_order_relaxed);
}

int cpu_matmul(const struct cpu_xtiles *xt, const void *w, enum dtype wfmt, uint64_t row_bytes, uint32_t r0,
	       uint32_t r1, uint32_t c0, uint32_t c1, float *y, size_t y_ld, char *err, size_t errlen)
{
	if (!xt->n)
		return errorf(err, errlen, -EINVAL, "cpu product: no tokens prepared");
	/* cpu_matvec's checks on the whole range (the same for every token: they are alike) */
	uint64_t col_off;
	int rc = cc_check(xt->xs[0], wfmt, row_bytes, r0, r1, c0, c1, &col_off, err, errlen);
	if (rc || r0 == r1)
		return rc;
	if (y_ld < r1 - r0)
		return errorf(err, errlen, -EINVAL, "cpu product: %u rows a token, %zu floats apart", r1 - r0, y_ld);
	uint32_t done = r0;
#if defined(__x86_64__)
	if (xt->tiled && wfmt == DT_BF16 && (cpu_compute_isa() & CPU_ISA_AMX_BF16) && r1 - r0 >= 16) {
		const uint32_t rows = (r1 - r0) & ~15u;
		cc_amx_bf16(xt->pairs, xt->n, (const uint8_t *)w + r0 * row_bytes + col_off, row_bytes, rows, c1 - c0, y,
			    y_ld);
		atomic_fetch_add_explicit(&tile_rows, rows, memory_order_relaxed);
		done = r0 + rows;
	}
#endif
	for (uint32_t t = 0; t < xt->n && done < r1; t++)
		if ((rc = cpu_matvec(xt->xs[t], w, wfmt, row_bytes, done, r1, c0, c1, y + t * y_ld + (done - r0), err,
				     errlen)) != 0)
			return rc;
	return 0;
}

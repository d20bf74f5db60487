/* matvec_amx.c - several tokens' BF16 products at once with Intel AMX (cpu_compute_internal.h,
 * cc_amx_bf16), and the check that the CPU and the kernel let this process use it
 * (cc_amx_enable). Built for any x86-64 (target attributes per function); the front runs the
 * kernel only where cc_amx_enable said yes.
 *
 * A tile product TDPBF16PS adds to each float32 element C[m][t] of a 16 x n tile the products of
 * row m of a 16 x 32 bf16 tile A with column t of a 16 x n tile B of bf16 pairs:
 *   C[m][t] += sum_k A[m][2k] B[k][t].lo + A[m][2k + 1] B[k][t].hi.
 * A is the weights as they lie: 16 rows, 64 bytes (32 columns) of each, row_bytes apart, loaded
 * straight from the ring. B is x: row k of block kb holds, for each token t, the pair of its
 * values at columns 32 kb + 2k and 32 kb + 2k + 1 (cpu_xtiles: pairs[(c / 2) n + t]). So one pass
 * over a weight tile serves every token: n tokens cost the weights' bytes once, where the vector
 * kernel reads its row block once and computes it n times.
 *
 * Tiles: C0..C3 sum four consecutive 32-column blocks of the same 16 rows (16 streams of 256
 * contiguous bytes a step for the prefetchers), A0/A1 and B0/B1 alternate so that a load does not
 * wait on the product before; the four sums are added at the end as (C0 + C1) + (C2 + C3). bf16
 * products are exact in float32; the tile unit sums them in its own order (inputs below 1.2e-38
 * read as zero, results rounded to nearest even), so results differ from the vector path's in the
 * last bits. */
#include "services/gpu-runner/cpu-compute/cpu_compute_internal.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <stdbool.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TARGET_AMX __attribute__((target("amx-tile,amx-bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for a dynamically enabled state component */
#define XFEATURE_XTILEDATA 18	    /* the AMX tile data */

bool cc_amx_present(void)
{
	unsigned a, b, c, d;
	/* CPUID.1:ECX.OSXSAVE (xgetbv may run), CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE. */
	if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)))
		return false;
	if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24)))
		return false;
	/* XCR0 bits 17 and 18: the OS manages the tile configuration and data. */
	uint32_t lo, hi;
	__asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
	return (lo & (3u << 17)) == (3u << 17);
}

bool cc_amx_enable(void)
{
	/* Linux lets a process use the tile data only once it has asked (once, for every thread). */
	return cc_amx_present() && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* The tile configuration (palette 1): 64 bytes, as LDTILECFG reads them. */
struct tile_cfg {
	uint8_t palette;
	uint8_t start_row;
	uint8_t reserved[14];
	uint16_t colsb[16];
	uint8_t rows[16];
} __attribute__((aligned(64)));

TARGET_AMX void cc_amx_bf16(const uint32_t *pairs, uint32_t n, const uint8_t *w, uint64_t row_bytes, uint32_t rows,
			    uint32_t cols, float *y, size_t y_ld)
{
	struct tile_cfg cfg;
	memset(&cfg, 0, sizeof(cfg));
	cfg.palette = 1;
	for (int i = 0; i < 8; i++) {
		cfg.rows[i] = 16;
		cfg.colsb[i] = (uint16_t)(i == 4 || i == 5 ? 64 : 4 * n); /* 0-3 C, 4-5 A, 6-7 B */
	}
	_tile_loadconfig(&cfg);
	const uint32_t nkb = cols / 32;
	const size_t bstride = 4 * (size_t)n, bblock = 16 * bstride;
	const uint8_t *b = (const uint8_t *)pairs;
	float c[4][16 * 16] __attribute__((aligned(64)));
	for (uint32_t r = 0; r + 16 <= rows; r += 16) {
		const uint8_t *a = w + (size_t)r * row_bytes;
		_tile_zero(0);
		_tile_zero(1);
		_tile_zero(2);
		_tile_zero(3);
		uint32_t kb = 0;
		for (; kb + 4 <= nkb; kb += 4) {
			for (uint32_t i = 0; i < 16; i++) /* the 4 lines a row gives this step, ahead */
				for (uint32_t l = 0; l < 4; l++)
					cc_prefetch(a + i * row_bytes + (size_t)kb * 64 + 64 * l);
			_tile_loadd(6, b + kb * bblock, bstride);
			_tile_loadd(4, a + (size_t)kb * 64, row_bytes);
			_tile_dpbf16ps(0, 4, 6);
			_tile_loadd(7, b + (kb + 1) * bblock, bstride);
			_tile_loadd(5, a + (size_t)(kb + 1) * 64, row_bytes);
			_tile_dpbf16ps(1, 5, 7);
			_tile_loadd(6, b + (kb + 2) * bblock, bstride);
			_tile_loadd(4, a + (size_t)(kb + 2) * 64, row_bytes);
			_tile_dpbf16ps(2, 4, 6);
			_tile_loadd(7, b + (kb + 3) * bblock, bstride);
			_tile_loadd(5, a + (size_t)(kb + 3) * 64, row_bytes);
			_tile_dpbf16ps(3, 5, 7);
		}
		for (; kb < nkb; kb++) {
			_tile_loadd(6, b + kb * bblock, bstride);
			_tile_loadd(4, a + (size_t)kb * 64, row_bytes);
			_tile_dpbf16ps(0, 4, 6);
		}
		_tile_stored(0, c[0], 64);
		_tile_stored(1, c[1], 64);
		_tile_stored(2, c[2], 64);
		_tile_stored(3, c[3], 64);
		for (uint32_t m = 0; m < 16; m++)
			for (uint32_t t = 0; t < n; t++) {
				const uint32_t i = m * 16 + t;
				y[t * y_ld + r + m] = (c[0][i] + c[1][i]) + (c[2][i] + c[3][i]);
			}
	}
	_tile_release();
}
#endif

/* matvec.c - the front of the CPU products (cpu_compute.h): the argument checks every kernel
 * relies on, the choice between the plain and the AVX-512 kernels from the CPU's features (read
 * once; PIPELINE_CPU_ISA and cpu_compute_force_isa narrow it), and SwiGLU over the products. */
#include "services/gpu-runner/cpu-compute/cpu_compute_internal.h"

#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "services/gpu-runner/cpu/kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

static pthread_once_t isa_once = PTHREAD_ONCE_INIT;
static unsigned isa_supported;      /* written once, under isa_once */
static _Atomic unsigned isa_in_use; /* what the products use: supported & the forced mask */

static unsigned detect(void)
{
#if defined(__x86_64__)
	__builtin_cpu_init();
	/* __builtin_cpu_supports checks the OS saves the AVX-512 state too (XCR0). F16C is read from
	 * CPUID itself: not every compiler's __builtin_cpu_supports knows it. */
	unsigned a, b, c, d;
	const int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
	if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
	    !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("fma") || !f16c)
		return CPU_ISA_SCALAR;
	unsigned isa = CPU_ISA_AVX512F;
	if (__builtin_cpu_supports("avx512bf16"))
		isa |= CPU_ISA_AVX512_BF16;
	if (__builtin_cpu_supports("avx512vnni"))
		isa |= CPU_ISA_AVX512_VNNI;
	if ((isa & CPU_ISA_AVX512_BF16) && cc_amx_present())
		isa |= CPU_ISA_AMX_BF16;
	return isa;
#else
	return CPU_ISA_SCALAR;
#endif
}

/* The extensions of mask this CPU has, AMX's only once Linux has granted this process the tile
 * state (asked at the first use that wants it; a refusal takes AMX off for good). */
static unsigned usable(unsigned mask)
{
#if defined(__x86_64__)
	static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
	static int granted = -1; /* -1: not asked yet */
	if ((mask & isa_supported & CPU_ISA_AMX_BF16)) {
		pthread_mutex_lock(&lock);
		if (granted < 0) {
			granted = cc_amx_enable();
			if (!granted)
				log_warn("cpu compute: the CPU has AMX but the kernel did not grant this process its "
					 "tile state: BF16 products of several tokens stay on the vector path");
		}
		pthread_mutex_unlock(&lock);
		if (!granted)
			mask &= ~(unsigned)CPU_ISA_AMX_BF16;
	}
#endif
	return isa_supported & mask;
}

static void isa_init(void)
{
	isa_supported = detect();
	/* AMX only when asked for (PIPELINE_CPU_ISA=amx, cpu_compute_force_isa): a third slower than
	 * AVX-512 BF16 for one token, decode's case, on an H200 host (docs/design.md, "Several tokens
	 * on AMX"). */
	unsigned want = CPU_ISA_ALL & ~(unsigned)CPU_ISA_AMX_BF16;
	const char *env = getenv("PIPELINE_CPU_ISA");
	if (env && strcmp(env, "scalar") == 0)
		want = CPU_ISA_SCALAR;
	else if (env && strcmp(env, "amx") == 0)
		want = CPU_ISA_ALL;
	else if (env && *env && strcmp(env, "auto") != 0)
		log_warn("cpu compute: PIPELINE_CPU_ISA=%s is not scalar, amx or auto; using auto", env);
	atomic_store_explicit(&isa_in_use, usable(want), memory_order_relaxed);
}

unsigned cpu_compute_isa_supported(void)
{
	pthread_once(&isa_once, isa_init);
	return isa_supported;
}

unsigned cpu_compute_isa(void)
{
	pthread_once(&isa_once, isa_init);
	return atomic_load_explicit(&isa_in_use, memory_order_relaxed);
}

unsigned cpu_compute_force_isa(unsigned mask)
{
	pthread_once(&isa_once, isa_init);
	unsigned use = usable(mask);
	atomic_store_explicit(&isa_in_use, use, memory_order_relaxed);
	return use;
}

/* The extension format t's SIMD kernel needs. */
static unsigned isa_needed(enum dtype t)
{
	if (t == DT_F32 || t == DT_F16)
		return CPU_ISA_AVX512F;
	if (t == DT_BF16)
		return CPU_ISA_AVX512_BF16;
	return CPU_ISA_AVX512_VNNI;
}

const char *cpu_compute_path(enum dtype t)
{
	static const char *const names[] = {"avx512f", "avx512-bf16", "avx512-vnni"};
	if ((unsigned)t >= DT_COUNT)
		return "?";
	const unsigned need = isa_needed(t);
	if (!(cpu_compute_isa() & need))
		return "scalar";
	return names[need == CPU_ISA_AVX512F ? 0 : need == CPU_ISA_AVX512_BF16 ? 1 : 2];
}

static cc_kernel pick(enum dtype t)
{
#if defined(__x86_64__)
	static const cc_kernel simd[DT_COUNT] = {
		[DT_F32] = cc_avx512_f32, [DT_F16] = cc_avx512_f16, [DT_BF16] = cc_avx512_bf16,
		[DT_Q8_0] = cc_vnni_q8_0, [DT_Q4_0] = cc_vnni_q4_0, [DT_Q4_K] = cc_vnni_q4_k,
		[DT_Q5_K] = cc_vnni_q5_k, [DT_Q6_K] = cc_vnni_q6_k,
	};
	if (cpu_compute_isa() & isa_needed(t))
		return simd[t];
#endif
	return cc_scalar_kernels[t];
}

/* The checks of cpu_matvec (its header comment lists them); *col_off is the byte offset of
 * column c0 in a row. */
int cc_check(const struct cpu_vec *x, enum dtype wfmt, uint64_t row_bytes, uint32_t r0, uint32_t r1, uint32_t c0,
	     uint32_t c1, uint64_t *col_off, char *err, size_t errlen)
{
	if ((unsigned)wfmt >= DT_COUNT)
		return errorf(err, errlen, -EINVAL, "cpu product: unknown weight format %u", (unsigned)wfmt);
	const char *name = dtype_name(wfmt);
	if (!x->ready)
		return errorf(err, errlen, -EINVAL, "cpu product: x is not prepared");
	if (x->wfmt != wfmt)
		return errorf(err, errlen, -EINVAL, "cpu product: x was prepared for %s weights, not %s",
			      dtype_name(x->wfmt), name);
	if (r0 > r1)
		return errorf(err, errlen, -EINVAL, "cpu product: rows [%u, %u) run backwards", r0, r1);
	if (c1 < c0 || c1 - c0 != x->n)
		return errorf(err, errlen, -EINVAL, "cpu product: columns [%u, %u) of %s weights for x of %u values",
			      c0, c1, name, x->n);
	const uint32_t blk = dtype_block_elems(wfmt);
	if (c0 % blk || c1 % blk)
		return errorf(err, errlen, -EINVAL,
			      "cpu product: columns [%u, %u) of %s weights do not start and end on a block of %u", c0,
			      c1, name, blk);
	if (dtype_row_bytes(wfmt, c1) > row_bytes)
		return errorf(err, errlen, -EINVAL,
			      "cpu product: columns up to %u of %s take %llu bytes, rows are %llu apart", c1, name,
			      (unsigned long long)dtype_row_bytes(wfmt, c1), (unsigned long long)row_bytes);
	if (r1 && row_bytes > UINT64_MAX / r1)
		return errorf(err, errlen, -EINVAL, "cpu product: %u rows of %llu bytes overflow", r1,
			      (unsigned long long)row_bytes);
	*col_off = dtype_row_bytes(wfmt, c0);
	return 0;
}

int cpu_matvec(const struct cpu_vec *x, const void *w, enum dtype wfmt, uint64_t row_bytes, uint32_t r0, uint32_t r1,
	       uint32_t c0, uint32_t c1, float *y, char *err, size_t errlen)
{
	assert(x);
	uint64_t col_off;
	int rc = cc_check(x, wfmt, row_bytes, r0, r1, c0, c1, &col_off, err, errlen);
	if (rc || r0 == r1)
		return rc;
	assert(w && y);
	pick(wfmt)(x, (const uint8_t *)w + r0 * row_bytes + col_off, row_bytes, r1 - r0, y);
	return 0;
}

/* Rows per pass of cpu_swiglu: gate and up results of a pass live on the stack. */
#define SWIGLU_ROWS 64

int cpu_swiglu(const struct cpu_vec *x, const void *w_gate, const void *w_up, enum dtype wfmt, uint64_t row_bytes,
	       uint32_t r0, uint32_t r1, uint32_t c0, uint32_t c1, float *h, char *err, size_t errlen)
{
	assert(x);
	uint64_t col_off;
	int rc = cc_check(x, wfmt, row_bytes, r0, r1, c0, c1, &col_off, err, errlen);
	if (rc || r0 == r1)
		return rc;
	assert(w_gate && w_up && h);
	const cc_kernel kern = pick(wfmt);
	float g[SWIGLU_ROWS], u[SWIGLU_ROWS];
	for (uint32_t r = r0; r < r1; r += SWIGLU_ROWS) {
		const uint32_t rows = r1 - r < SWIGLU_ROWS ? r1 - r : SWIGLU_ROWS;
		const uint64_t off = r * row_bytes + col_off;
		kern(x, (const uint8_t *)w_gate + off, row_bytes, rows, g);
		kern(x, (const uint8_t *)w_up + off, row_bytes, rows, u);
		for (uint32_t i = 0; i < rows; i++)
			h[r - r0 + i] = cpu_silu_mul(g[i], u[i]);
	}
	return 0;
}

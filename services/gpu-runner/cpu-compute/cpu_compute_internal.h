/* cpu_compute_internal.h - what the parts of the CPU product module share (cpu_compute.h is the
 * public side): the prepared vector's layout and the kernel tables.
 *
 *   vec.c            cpu_vec: preparation of x per weight format
 *   vec_avx512.c     the same preparation with AVX-512F, x86-64 only
 *   matvec.c         the front: argument checks, path choice (CPU features), SwiGLU
 *   matvec_scalar.c  the plain C kernels (every machine)
 *   matvec_avx512.c  F32, F16 (AVX-512F) and BF16 (AVX512-BF16) kernels, x86-64 only
 *   matvec_vnni.c    the block formats with AVX512-VNNI, x86-64 only
 *   matmul.c         several tokens at once (cpu_xtiles, cpu_matmul): the front
 *   matvec_amx.c     BF16 for several tokens with AMX tiles, x86-64 only
 *
 * A kernel computes rows [0, rows) of a matrix whose row 0 starts at w, rows row_bytes apart,
 * over x->n columns starting at w (the front has already added r0 and c0), into y. */
#ifndef GPU_RUNNER_CPU_COMPUTE_INTERNAL_H
#define GPU_RUNNER_CPU_COMPUTE_INTERNAL_H
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "common/dtype.h"
#include "services/gpu-runner/cpu-compute/cpu_compute.h"
#ifdef __cplusplus
extern "C" {
#endif

#define CC_ALIGN 64         /* bytes: every buffer of a vector, one cache line and one AVX-512 register */
#define CC_PAD 64           /* values: x is zero-padded to a multiple of this (a VNNI step is 64 int8) */
#define CC_GROUP 32         /* values per int8 group of x (one scale d) */
#define CC_MAX_N (1u << 30) /* values of x at most (its sizes stay far from overflow) */
/* Bytes ahead that the SIMD kernels prefetch along each row they read (cc_prefetch_on): the
 * hardware prefetchers follow a few streams, and a kernel reads four rows at once. */
#ifndef CC_PF_AHEAD
#define CC_PF_AHEAD 1024
#endif

/* Prefetches the line CC_PF_AHEAD bytes past p into all cache levels (nothing when it is 0). */
static inline void cc_prefetch(const void *p)
{
	if (CC_PF_AHEAD)
		__builtin_prefetch((const char *)p + CC_PF_AHEAD, 0, 3);
}

/* The same along the stream of rows a kernel's loop reads at one place of its step: p lies off
 * bytes into a row of len bytes of data, and where CC_PF_AHEAD bytes past p pass the row's end the
 * line moves on by next - len (next: the step's R rows of rb bytes), into the row the loop takes
 * next at this place. So an expert's down_proj row of 768 values (432 bytes of Q4_K) has the rows
 * after its step on their way, where CC_PF_AHEAD bytes past p fell on rows the step already reads,
 * and a long row its next step's first lines before the step ends. The wrap is made once: in rows
 * shorter than CC_PF_AHEAD / 2 the line lands further along than CC_PF_AHEAD, still ahead of the
 * loop where the rows lie one after another, and in columns no one reads where they do not (a
 * short share of long rows), as before. */
static inline void cc_prefetch_on(const void *p, size_t off, size_t len, size_t next)
{
	if (CC_PF_AHEAD) {
		const char *q = (const char *)p + CC_PF_AHEAD;
		if (off + CC_PF_AHEAD >= len)
			q += next - len;
		__builtin_prefetch(q, 0, 3);
	}
}

/* The layout of a prepared x. Which arrays are set depends on the format (the others are NULL);
 * each is zero past n up to npad, so kernels may read whole registers. */
struct cpu_vec {
	int ready;       /* a prepare succeeded, for format wfmt */
	enum dtype wfmt; /* the weight format x was prepared for */
	uint32_t n;      /* values */
	uint32_t npad;   /* n rounded up to CC_PAD */
	size_t cap;      /* bytes at buf */
	void *buf;       /* CC_ALIGN-aligned, holds the arrays below */
	float *f;        /* F32, F16: (npad) x */
	uint16_t *bf;    /* BF16: (npad) x rounded to bf16 */
	int8_t *q;       /* block formats: (npad) int8 codes of x */
	float *d;        /* block formats: (npad / 32) the scale of each group of 32 */
	float *s;        /* block formats: (npad / 32) d * (sum of the group's q), for the K formats' mins */
	int32_t *init;   /* block formats: (npad / 4) where each int32 lane of vpdpbusd (4 values)
			   * starts: minus the weight code offset times the sum of q over the group (Q8_0:
			   * 128, Q4_0: 8) or 16-value run (Q6_K: 32), in the run's first lane, else 0 (all
			   * 0 for Q4_K and Q5_K) */
	int32_t *sum16;  /* block formats: (npad / 16) the sum of q over each run of 16 values */
};

#if defined(__x86_64__)
/* The preparation with AVX-512F (vec_avx512.c), the same bits as vec.c's loops: q, d and sum16
 * of ngroups groups of 32 values; x rounded to bf16. */
void cc_avx512_quantize(const float *x, uint32_t ngroups, int8_t *q, float *d, int32_t *sum16);
void cc_avx512_to_bf16(const float *x, uint32_t n, uint16_t *out);
#endif

/* cpu_matvec's checks of its arguments (cpu_compute.h); *col_off the byte offset of column c0. */
int cc_check(const struct cpu_vec *x, enum dtype wfmt, uint64_t row_bytes, uint32_t r0, uint32_t r1, uint32_t c0,
	     uint32_t c1, uint64_t *col_off, char *err, size_t errlen);

/* Rows [0, rows) of the product, as above. */
typedef void (*cc_kernel)(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y);

/* The plain C kernels, indexed by enum dtype (every entry set). */
extern const cc_kernel cc_scalar_kernels[DT_COUNT];
#if defined(__x86_64__)
/* The AVX-512 kernels, indexed by enum dtype: F32, F16, BF16 (matvec_avx512.c) and the block
 * formats (matvec_vnni.c); the caller checks the CPU's features first. */
void cc_avx512_f32(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y);
void cc_avx512_f16(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y);
void cc_avx512_bf16(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y);
void cc_vnni_q8_0(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y);
void cc_vnni_q4_0(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y);
void cc_vnni_q4_k(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y);
void cc_vnni_q5_k(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y);
void cc_vnni_q6_k(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y);
/* Whether this CPU has AMX-TILE and AMX-BF16 and the OS saves their state (matvec_amx.c). */
bool cc_amx_present(void);
/* Asks Linux for this process's tile data (once is for every thread); whether it was granted. */
bool cc_amx_enable(void);
/* Rows [0, rows & ~15) of BF16 W (rows row_bytes apart, cols a multiple of 32 columns from w) times
 * the n (1..16) tokens whose x values lie in pairs: pairs[(c / 2) n + t] holds token t's values
 * at columns c and c + 1 (even c; low half first). y[t y_ld + r]. Rows past the last 16 are left. */
void cc_amx_bf16(const uint32_t *pairs, uint32_t n, const uint8_t *w, uint64_t row_bytes, uint32_t rows,
		 uint32_t cols, float *y, size_t y_ld);
#endif

/* Little-endian loads at any alignment (weights come at any offset). */
static inline uint16_t cc_u16(const uint8_t *p)
{
	uint16_t v;
	memcpy(&v, p, 2);
	return v;
}

static inline uint32_t cc_u32(const uint8_t *p)
{
	uint32_t v;
	memcpy(&v, p, 4);
	return v;
}

/* The 6-bit scales and mins of a Q4_K / Q5_K block's scales[12] as bytes: sc[0..7] and m[0..7]
 * packed little-endian in two 64-bit words (quant_scale_min_k4 for all eight at once). */
static inline void cc_k4_scales(const uint8_t *scales, uint64_t *sc, uint64_t *m)
{
	const uint32_t a = cc_u32(scales), b = cc_u32(scales + 4), c = cc_u32(scales + 8);
	const uint32_t sc_lo = a & 0x3f3f3f3fu, m_lo = b & 0x3f3f3f3fu;
	const uint32_t sc_hi = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
	const uint32_t m_hi = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
	*sc = sc_lo | (uint64_t)sc_hi << 32;
	*m = m_lo | (uint64_t)m_hi << 32;
}

#ifdef __cplusplus
}
#endif
#endif

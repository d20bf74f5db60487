/* cpu_compute.h - matrix-vector products on the CPU, straight from weights in host memory (the
 * CPU's share of a streamed layer): y = W x for one token, W in any format of common/dtype.h.
 *
 *   struct cpu_vec *xv;
 *   rc = cpu_vec_create(8192, &xv, err, sizeof(err));
 *   rc = cpu_vec_prepare(xv, DT_Q4_K, x, 8192, err, sizeof(err));          // once per product
 *   rc = cpu_matvec(xv, w, DT_Q4_K, row_bytes, r0, r1, 0, 8192, y, err, sizeof(err));  // per thread
 *   cpu_vec_destroy(&xv);
 *
 * What is computed: y[r - r0] = sum over c in [c0, c1) of W[r][c] * x'[c - c0] for r in [r0, r1),
 * W row-major with rows row_bytes apart, y float32. x' is x as the kernels take it, made once per
 * product by cpu_vec_prepare for the weight format:
 * - F32, F16: x itself (float32 products and sums; F16 widens exactly);
 * - BF16: x rounded to bf16 (nearest even); bf16 products are exact in float32, summed in float32;
 * - Q8_0, Q4_0, Q4_K, Q5_K, Q6_K: x quantized to int8 per group of 32 values as the GPU's integer
 *   path does (services/gpu-runner/cuda/gemv_dp4a.cuh, dq_stage): d = amax / 127 (amax the largest
 *   |x| of the group), q = x * (1 / d) rounded half to even and clamped to +-127 (0 for an all-zero
 *   group), x' = q d: at most d / 2 = amax / 254 off per value. Where x holds bf16 values (the
 *   GPU's activations widened) the int8 values are the same as the GPU's. Products of weight codes
 *   and q are summed exactly in int32 per group, then scaled in float32.
 * The sums run in float32 in an order fixed by the path (below), so results do not depend on how
 * a caller splits the rows among threads, but differ in the last bits between paths.
 *
 * Paths. Each format has a plain C path that every machine runs and, on x86-64, an AVX-512 path
 * chosen at run time from the CPU's features: F32/F16 with AVX-512F ("avx512f"), BF16 with
 * AVX512-BF16's vdpbf16ps ("avx512-bf16"; it reads subnormal bf16 values, below 1.2e-38, as
 * zero), the block formats with AVX512-VNNI's vpdpbusd ("avx512-vnni"). The binary is built for
 * any x86-64 (the SIMD code is compiled per function); other architectures build the plain path
 * only. PIPELINE_CPU_ISA=scalar in the environment, or
 * cpu_compute_force_isa(CPU_ISA_SCALAR), makes every product take the plain path;
 * PIPELINE_CPU_ISA=amx adds AMX's tiles, which are not used by default (not yet measured).
 *
 * Several tokens at once (cpu_matmul): with BF16 weights and AMX-BF16 in use (Sapphire Rapids and
 * later; "amx-bf16"), tiles of 16 rows serve every token in one pass over the weights
 * (matvec_amx.c), each token's sums in the same order whatever the others; everything else goes
 * token by token through cpu_matvec's kernels.
 *
 * Threads: a product over many rows is split by the caller, each thread calling cpu_matvec on
 * its own row range with the same prepared x (read-only once prepared). The kernels allocate
 * nothing and take no lock. */
#ifndef GPU_RUNNER_CPU_COMPUTE_H
#define GPU_RUNNER_CPU_COMPUTE_H
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#ifdef __cplusplus
extern "C" {
#endif

/* Instruction-set extensions the kernels may use, as flags (cpu_compute_isa). */
enum cpu_isa {
	CPU_ISA_SCALAR = 0,            /* none: the plain C path for every format */
	CPU_ISA_AVX512F = 1u << 0,     /* F32, F16: AVX-512 F, BW, VL and F16C */
	CPU_ISA_AVX512_BF16 = 1u << 1, /* BF16: the above and AVX512-BF16 */
	CPU_ISA_AVX512_VNNI = 1u << 2, /* block formats: AVX-512 F, BW, VL, F16C and AVX512-VNNI */
	CPU_ISA_AMX_BF16 = 1u << 3,    /* BF16 on tiles (cpu_matmul): AVX512-BF16's and AMX-BF16; only when asked */
	CPU_ISA_ALL = 0xF,
};

/* x prepared for one weight format; owns its 64-byte aligned buffers, reused from one product to
 * the next (a prepare grows them when x is longer than any before). */
struct cpu_vec;

/* Makes an empty vector with room for x of up to max_n values (0: grown by the first prepare).
 * Returns 0 and the vector in *out (the caller owns it: cpu_vec_destroy), -EINVAL for max_n past
 * 2^30, or -ENOMEM, with a message in err. */
int cpu_vec_create(uint32_t max_n, struct cpu_vec **out, char *err, size_t errlen);
/* Frees the vector and NULLs *v; safe on NULL and twice. */
void cpu_vec_destroy(struct cpu_vec **v);
/* Prepares x (n float32 values, any alignment, not kept) for products with weights of format
 * wfmt, as the header's comment says. Returns 0; -EINVAL for an unknown format, n == 0 or past
 * 2^30, or n not a multiple of the format's block (dtype_block_elems: 32 or 256), -ENOMEM when the buffers
 * cannot grow; a message in err. On failure v holds nothing prepared (products refuse it). */
int cpu_vec_prepare(struct cpu_vec *v, enum dtype wfmt, const float *x, uint32_t n, char *err, size_t errlen);
/* Values of the prepared x (0 when none is prepared). */
uint32_t cpu_vec_len(const struct cpu_vec *v);
/* x' (as the kernels read it, in float32) at index i < cpu_vec_len: for tests and checks. */
float cpu_vec_value(const struct cpu_vec *v, uint32_t i);

/* y[r - r0] = sum_{c0 <= c < c1} W[r][c] x'[c - c0] for r0 <= r < r1. w points at row 0 of W
 * (the row of index 0, not r0), each row row_bytes after the one before, in format wfmt; x was
 * prepared for wfmt with c1 - c0 values. w may have any alignment; the bytes of rows r0..r1 - 1
 * up to column c1 must be readable (nothing past them is read). y has r1 - r0 floats. Returns 0;
 * -EINVAL with a message for: x not prepared for wfmt, c1 - c0 not x's length, c0 or c1 not on a
 * block boundary (block formats), columns up to c1 not fitting row_bytes, r0 > r1. Single-threaded
 * over its rows; r0 == r1 computes nothing. */
int cpu_matvec(const struct cpu_vec *x, const void *w, enum dtype wfmt, uint64_t row_bytes, uint32_t r0, uint32_t r1,
	       uint32_t c0, uint32_t c1, float *y, char *err, size_t errlen);
/* The first half of a SwiGLU FFN: h[r - r0] = silu(g) * u, g and u the products of rows r of the
 * gate and up matrices (both of format wfmt, rows row_bytes apart) with x over columns [c0, c1),
 * rounded as the C reference's cpu_silu_mul (cpu/kernels.h). Arguments and errors as cpu_matvec. */
int cpu_swiglu(const struct cpu_vec *x, const void *w_gate, const void *w_up, enum dtype wfmt, uint64_t row_bytes,
	       uint32_t r0, uint32_t r1, uint32_t c0, uint32_t c1, float *h, char *err, size_t errlen);

/* Several tokens' x for cpu_matmul: n vectors prepared for one format and length, kept by pointer
 * (they must not change while products use them), and for BF16 on an AMX CPU their values in
 * pairs as the tile products read them (grown as needed, reused from one prepare to the next). */
struct cpu_xtiles;
#define CPU_MATMUL_MAX_TOKENS 16 /* tokens of one cpu_matmul (a tile's columns) */

/* An empty one. Returns 0 and it in *out (cpu_xtiles_destroy), or -ENOMEM with a message. */
int cpu_xtiles_create(struct cpu_xtiles **out, char *err, size_t errlen);
/* Frees it and NULLs *xt; safe on NULL and twice. */
void cpu_xtiles_destroy(struct cpu_xtiles **xt);
/* Takes the n (1..CPU_MATMUL_MAX_TOKENS) vectors xs, each prepared (cpu_vec_prepare) for the same
 * format with the same length. Returns 0; -EINVAL (n out of range, a vector not prepared or not
 * like the first) or -ENOMEM with a message in err. */
int cpu_xtiles_prepare(struct cpu_xtiles *xt, struct cpu_vec *const *xs, uint32_t n, char *err, size_t errlen);
/* For every token t < n of xt: y[t y_ld + r - r0] = cpu_matvec's y[r - r0] with xs[t], arguments
 * and errors as cpu_matvec's (y_ld >= r1 - r0). BF16 with the "amx-bf16" path (cpu_matmul_path)
 * and c1 - c0 a multiple of 32 takes rows in tiles of 16 (the sums in the tile unit's order); the
 * rest of the rows, and every other case, token by token through cpu_matvec. */
int cpu_matmul(const struct cpu_xtiles *xt, const void *w, enum dtype wfmt, uint64_t row_bytes, uint32_t r0,
	       uint32_t r1, uint32_t c0, uint32_t c1, float *y, size_t y_ld, char *err, size_t errlen);
/* The path cpu_matmul takes for format t now: "amx-bf16" (BF16 with AMX in use) or cpu_compute_path's. */
const char *cpu_matmul_path(enum dtype t);
/* Rows cpu_matmul has computed on the tiles in this process, all time (tests, benchmarks). */
uint64_t cpu_matmul_tile_rows(void);

/* The extensions this CPU has that the kernels use (CPU_ISA_* flags; CPU_ISA_SCALAR off x86-64). */
unsigned cpu_compute_isa_supported(void);
/* The extensions the products use now: the supported ones but AMX's (PIPELINE_CPU_ISA=amx adds
 * them, =scalar takes all away), or what cpu_compute_force_isa chose. */
unsigned cpu_compute_isa(void);
/* Restricts the products to the extensions in mask (CPU_ISA_SCALAR: the plain path everywhere;
 * CPU_ISA_ALL: all the CPU has, AMX's when Linux grants this process the tile state) and returns
 * those in use now. For tests, benchmarks and start-up:
 * not to be called while products run on other threads. */
unsigned cpu_compute_force_isa(unsigned mask);
/* The path products of format t take now: "avx512f", "avx512-bf16", "avx512-vnni" or "scalar"
 * ("?" for an unknown format). */
const char *cpu_compute_path(enum dtype t);

#ifdef __cplusplus
}
#endif
#endif

/* matvec_scalar.c - the plain C kernels of the CPU products (cpu_compute_internal.h): every
 * format, every machine. They compute what the SIMD kernels compute (cpu_compute.h): float32
 * products and sums for the element formats (eight partial sums, added pairwise at the end), and
 * for the block formats exact int32 sums of weight code times x code per group, scaled in float32
 * (four partial sums over blocks). Weights are read byte-wise: any alignment. */
#include "services/gpu-runner/cpu-compute/cpu_compute_internal.h"

#include "common/quant.h"

static float sum8(const float *a)
{
	return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

static float sum4(const float *a)
{
	return (a[0] + a[1]) + (a[2] + a[3]);
}

static float load_f32(const uint8_t *p)
{
	float v;
	memcpy(&v, p, 4);
	return v;
}

static void scalar_f32(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y)
{
	const uint32_t n = x->n;
	for (uint32_t r = 0; r < rows; r++) {
		const uint8_t *p = w + r * row_bytes;
		float acc[8] = {0};
		for (uint32_t c = 0; c < n; c++)
			acc[c & 7] += load_f32(p + 4 * (size_t)c) * x->f[c];
		y[r] = sum8(acc);
	}
}

static void scalar_f16(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y)
{
	const uint32_t n = x->n;
	for (uint32_t r = 0; r < rows; r++) {
		const uint8_t *p = w + r * row_bytes;
		float acc[8] = {0};
		for (uint32_t c = 0; c < n; c++)
			acc[c & 7] += f16_to_f32(cc_u16(p + 2 * (size_t)c)) * x->f[c];
		y[r] = sum8(acc);
	}
}

static void scalar_bf16(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y)
{
	const uint32_t n = x->n;
	for (uint32_t r = 0; r < rows; r++) {
		const uint8_t *p = w + r * row_bytes;
		float acc[8] = {0};
		for (uint32_t c = 0; c < n; c++)
			acc[c & 7] += bf16_to_f32(cc_u16(p + 2 * (size_t)c)) * bf16_to_f32(x->bf[c]);
		y[r] = sum8(acc);
	}
}

/* y = sum over blocks of d_w d_x (sum q_w q_x). */
static void scalar_q8_0(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y)
{
	const uint32_t nb = x->n / QK8_0;
	for (uint32_t r = 0; r < rows; r++) {
		const uint8_t *row = w + r * row_bytes;
		float acc[4] = {0};
		for (uint32_t b = 0; b < nb; b++) {
			const uint8_t *blk = row + (size_t)b * sizeof(struct block_q8_0);
			const int8_t *qw = (const int8_t *)(blk + 2), *qx = x->q + b * QK8_0;
			int32_t s = 0;
			for (int j = 0; j < QK8_0; j++)
				s += qw[j] * qx[j];
			acc[b & 3] += (float)s * (f16_to_f32(cc_u16(blk)) * x->d[b]);
		}
		y[r] = sum4(acc);
	}
}

/* y = sum over blocks of d_w d_x (sum (q_w - 8) q_x). */
static void scalar_q4_0(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y)
{
	const uint32_t nb = x->n / QK4_0;
	for (uint32_t r = 0; r < rows; r++) {
		const uint8_t *row = w + r * row_bytes;
		float acc[4] = {0};
		for (uint32_t b = 0; b < nb; b++) {
			const uint8_t *blk = row + (size_t)b * sizeof(struct block_q4_0), *qs = blk + 2;
			const int8_t *qx = x->q + b * QK4_0;
			int32_t s = 0;
			for (int j = 0; j < QK4_0 / 2; j++)
				s += ((qs[j] & 0x0F) - 8) * qx[j] + ((qs[j] >> 4) - 8) * qx[j + QK4_0 / 2];
			acc[b & 3] += (float)s * (f16_to_f32(cc_u16(blk)) * x->d[b]);
		}
		y[r] = sum4(acc);
	}
}

/* Q4_K and Q5_K (hi: the Q5_K block's qh, NULL for Q4_K). Sub-block j (values 32 j ..) is group
 * j of the block: d sum_j sc_j d_x (sum q q_x) - dmin sum_j m_j s_x. */
static float k4_block(const struct cpu_vec *x, uint32_t g0, uint16_t dh, uint16_t dminh, const uint8_t *scales,
		      const uint8_t *qh, const uint8_t *qs)
{
	uint64_t sc, m;
	cc_k4_scales(scales, &sc, &m);
	float a = 0.0f, mn = 0.0f;
	for (uint32_t j = 0; j < 8; j++) {
		const uint8_t *q = qs + 32 * (j / 2);
		const int8_t *qx = x->q + (size_t)(g0 + j) * CC_GROUP;
		const int shift = 4 * (j & 1);
		int32_t s = 0;
		for (int l = 0; l < 32; l++) {
			int v = (q[l] >> shift) & 0x0F;
			if (qh)
				v += ((qh[l] >> j) & 1) << 4;
			s += v * qx[l];
		}
		const int scj = (int)((sc >> (8 * j)) & 0xFF), mj = (int)((m >> (8 * j)) & 0xFF);
		a += (float)(scj * s) * x->d[g0 + j];
		mn += (float)mj * x->s[g0 + j];
	}
	return f16_to_f32(dh) * a - f16_to_f32(dminh) * mn;
}

static void scalar_q4_k(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y)
{
	const uint32_t nb = x->n / QK_K;
	for (uint32_t r = 0; r < rows; r++) {
		const uint8_t *row = w + r * row_bytes;
		float acc[4] = {0};
		for (uint32_t b = 0; b < nb; b++) {
			const uint8_t *blk = row + (size_t)b * sizeof(struct block_q4_K);
			acc[b & 3] += k4_block(x, 8 * b, cc_u16(blk), cc_u16(blk + 2),
					       blk + offsetof(struct block_q4_K, scales), NULL,
					       blk + offsetof(struct block_q4_K, qs));
		}
		y[r] = sum4(acc);
	}
}

static void scalar_q5_k(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y)
{
	const uint32_t nb = x->n / QK_K;
	for (uint32_t r = 0; r < rows; r++) {
		const uint8_t *row = w + r * row_bytes;
		float acc[4] = {0};
		for (uint32_t b = 0; b < nb; b++) {
			const uint8_t *blk = row + (size_t)b * sizeof(struct block_q5_K);
			acc[b & 3] += k4_block(
				x, 8 * b, cc_u16(blk), cc_u16(blk + 2), blk + offsetof(struct block_q5_K, scales),
				blk + offsetof(struct block_q5_K, qh), blk + offsetof(struct block_q5_K, qs));
		}
		y[r] = sum4(acc);
	}
}

/* Run k (16 values, 0..15) of a Q6_K block: half h = k / 8, within it value 16 (k % 8) + i is
 * ql[64 h + ..] and qh[32 h + ..] as common/quant.c's dq_q6_k reads them. d sum_k sc_k d_x (sum (q - 32) q_x). */
static void scalar_q6_k(const struct cpu_vec *x, const uint8_t *w, uint64_t row_bytes, uint32_t rows, float *y)
{
	const uint32_t nb = x->n / QK_K;
	for (uint32_t r = 0; r < rows; r++) {
		const uint8_t *row = w + r * row_bytes;
		float acc[4] = {0};
		for (uint32_t b = 0; b < nb; b++) {
			const uint8_t *blk = row + (size_t)b * sizeof(struct block_q6_K);
			const uint8_t *ql = blk + offsetof(struct block_q6_K, ql);
			const uint8_t *qh = blk + offsetof(struct block_q6_K, qh);
			const int8_t *sc = (const int8_t *)(blk + offsetof(struct block_q6_K, scales));
			float a = 0.0f;
			for (uint32_t k = 0; k < 16; k++) {
				const uint32_t h = k / 8, v0 = 16 * (k % 8); /* value v0 + i of half h */
				const uint32_t part = v0 / 32;               /* 0..3: which of dq_q6_k's q1..q4 */
				const uint8_t *l = ql + 64 * h + (part & 1) * 32 + v0 % 32;
				const uint8_t *hh = qh + 32 * h + v0 % 32;
				const int8_t *qx = x->q + (size_t)b * QK_K + 128 * h + v0;
				int32_t s = 0;
				for (int i = 0; i < 16; i++) {
					int q = ((part < 2 ? l[i] & 0x0F : l[i] >> 4) |
						 (((hh[i] >> (2 * part)) & 3) << 4)) -
						32;
					s += q * qx[i];
				}
				a += (float)(sc[k] * s) * x->d[(b * QK_K + 128 * h + v0) / CC_GROUP];
			}
			acc[b & 3] += f16_to_f32(cc_u16(blk + offsetof(struct block_q6_K, d))) * a;
		}
		y[r] = sum4(acc);
	}
}

const cc_kernel cc_scalar_kernels[DT_COUNT] = {
	[DT_F32] = scalar_f32,   [DT_F16] = scalar_f16,   [DT_BF16] = scalar_bf16, [DT_Q8_0] = scalar_q8_0,
	[DT_Q4_0] = scalar_q4_0, [DT_Q4_K] = scalar_q4_k, [DT_Q5_K] = scalar_q5_k, [DT_Q6_K] = scalar_q6_k,
};

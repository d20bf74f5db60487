/* attention_mma.cu - prefill attention on the tensor cores: 64 queries per block (16 per warp),
 * 64 keys per staged tile, BF16 K and V from the arena, mma.sync m16n8k16 with float32
 * accumulation, the same online softmax and causal / sliding-window mask as attn_kernel
 * (attention_fp32.cu). For head_dim 64 and 128. */
#include "services/gpu-runner/cuda/attention.cuh"
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cuda/device.cuh"

static __device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
		     "{%0,%1,%2,%3};\n"
		     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two floats as a bf16 pair, lo in the low half (the lower column / key of a fragment). */
static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
	__nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
	return *reinterpret_cast<uint32_t *>(&v);
}

/* The same online softmax as attn_kernel, with S = Q K^T and O += P V on the tensor cores
 * (mma.sync m16n8k16, bf16 in, float32 accumulate; P is rounded to bf16 for the second
 * product, as flash attention does). grid (n_kv_heads * qtiles, splits), 4 warps. Block (g, qt)
 * serves the 64 queries numbered t * group + j in [qt * 64, qt * 64 + 64) of KV head g; warp w
 * holds rows 16w .. 16w + 15 of them. Fragment layouts are PTX's for m16n8k16: lane = 4 * gid +
 * tig; an accumulator holds rows gid and gid + 8, columns 2 tig and 2 tig + 1 of its 8-wide tile. */
template <int HD> __global__ void __launch_bounds__(128) attn_mma_kernel(const attn_args a)
{
	constexpr int STRIDE = HD + 8;		/* staged row in bf16 elements: +16 bytes, no bank conflicts */
	constexpr int KSTEPS = HD / 16;		/* k-steps of S = Q K^T */
	constexpr int DTILES = HD / 8;		/* 8-wide column tiles of O */
	constexpr int STILES = MMA_KEYS / 8;	/* 8-wide column tiles of S */
	constexpr int VECS = HD / 8;		/* 16-byte vectors per K or V row */
	__shared__ __align__(16) uint16_t ks[MMA_KEYS * STRIDE];
	__shared__ __align__(16) uint16_t vs[MMA_KEYS * STRIDE];
	__shared__ uint64_t koff[MMA_KEYS];
	__shared__ uint32_t kpos[MMA_KEYS];
	__shared__ uint32_t s_cursor;
	__shared__ int s_any;

	const uint32_t w = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, tig = lane % 4;
	const uint32_t g = blockIdx.x / a.qtiles, qt = blockIdx.x % a.qtiles, split = blockIdx.y;
	const uint32_t pairs_g = a.n * a.group;
	const uint32_t k0 = split * a.keys_per_split;
	const uint32_t k1 = min(k0 + a.keys_per_split, a.total_keys);
	const uint32_t lp0 = qt * MMA_ROWS, lp1 = min(lp0 + MMA_ROWS, pairs_g);
	const uint32_t qlo = a.pos0 + lp0 / a.group, qhi = a.pos0 + (lp1 - 1) / a.group;

	/* This thread's two rows: 16w + gid (r = 0) and 16w + gid + 8 (r = 1). */
	bool valid[2];
	uint32_t qpos[2];
	size_t pair[2];
	uint32_t qa[KSTEPS][4];
#pragma unroll
	for (int r = 0; r < 2; r++) {
		uint32_t lp = lp0 + 16 * w + gid + 8 * r;
		valid[r] = lp < pairs_g;
		uint32_t t = valid[r] ? lp / a.group : 0, h = g * a.group + (valid[r] ? lp % a.group : 0);
		qpos[r] = a.pos0 + t;
		pair[r] = (size_t)t * a.n_heads + h;
		const float *qrow = a.q + (size_t)t * a.q_ld + (size_t)h * HD;
#pragma unroll
		for (int kk = 0; kk < KSTEPS; kk++) {
			float2 lo = make_float2(0.0f, 0.0f), hi = lo;
			if (valid[r]) {
				lo = *(const float2 *)(qrow + 16 * kk + 2 * tig);
				hi = *(const float2 *)(qrow + 16 * kk + 8 + 2 * tig);
			}
			qa[kk][r] = pack_bf16(lo.x, lo.y);	/* a0 (row gid) / a1 (row gid + 8) */
			qa[kk][2 + r] = pack_bf16(hi.x, hi.y);	/* a2 / a3: columns + 8 */
		}
	}
	float o[DTILES][4], m[2], l[2];
#pragma unroll
	for (int r = 0; r < 2; r++) {
		m[r] = -INFINITY;
		l[r] = 0.0f;
		if (!a.pm && valid[r]) {
			/* Fold into the running state: l is kept per thread and summed over the four
			 * threads of a row at the end, so one of them starts with it. */
			m[r] = a.m[pair[r]];
			l[r] = tig == 0 ? a.l[pair[r]] : 0.0f;
		}
	}
#pragma unroll
	for (int dt = 0; dt < DTILES; dt++)
#pragma unroll
		for (int r = 0; r < 2; r++) {
			float2 v = make_float2(0.0f, 0.0f);
			if (!a.pm && valid[r])
				v = *(const float2 *)(a.acc + pair[r] * HD + dt * 8 + 2 * tig);
			o[dt][2 * r] = v.x;
			o[dt][2 * r + 1] = v.y;
		}

	if (threadIdx.x == 0)
		s_cursor = span_of_key(a.prefix, a.n_spans, k0);
	__syncthreads();

	for (uint32_t kb = k0; kb < k1; kb += MMA_KEYS) {
		if (w == 0) {
			/* Each lane places keys kb + lane and kb + 32 + lane. */
			uint32_t s = s_cursor;
			bool any = false;
#pragma unroll
			for (int i = 0; i < 2; i++) {
				uint32_t key = kb + 32 * i + lane, pos = UINT32_MAX;
				uint64_t off = 0;
				if (key < k1) {
					while (key >= a.prefix[s + 1])
						s++;
					struct kv_span sp = a.spans[s];
					uint32_t r = key - a.prefix[s];
					pos = sp.pos0 + r;
					off = sp.block * a.block_elems + (uint64_t)r * a.kv_dim + (uint64_t)g * HD;
				}
				koff[32 * i + lane] = off;
				kpos[32 * i + lane] = pos;
				any |= pos != UINT32_MAX && pos <= qhi && (a.window == 0 || (uint64_t)pos + a.window > qlo);
			}
			unsigned ballot = __ballot_sync(0xffffffffu, any);
			uint32_t last = min((uint32_t)MMA_KEYS - 1, k1 - 1 - kb);
			uint32_t next = __shfl_sync(0xffffffffu, s, last % 32);
			__syncwarp();
			if (lane == 0) {
				s_any = ballot != 0;
				s_cursor = next;
			}
		}
		__syncthreads();
		const bool any = s_any;
		if (any) {
			for (uint32_t i = threadIdx.x; i < MMA_KEYS * VECS; i += blockDim.x) {
				uint32_t r = i / VECS, c = i % VECS;
				uint4 kv = make_uint4(0, 0, 0, 0), vv = kv; /* zeros: P is 0 there, V must not be NaN */
				if (kpos[r] != UINT32_MAX) {
					const __nv_bfloat16 *kr = (const __nv_bfloat16 *)a.arena + koff[r];
					kv = ((const uint4 *)kr)[c];
					vv = ((const uint4 *)(kr + (size_t)a.block_tokens * a.kv_dim))[c];
				}
				*(uint4 *)(ks + r * STRIDE + c * 8) = kv;
				*(uint4 *)(vs + r * STRIDE + c * 8) = vv;
			}
		}
		__syncthreads();
		if (any) {
			float sc[STILES][4];
#pragma unroll
			for (int j = 0; j < STILES; j++) {
				sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
				for (int kk = 0; kk < KSTEPS; kk++) {
					/* B = K^T: column gid is key 8j + gid, rows 2 tig (+1) and + 8. */
					const uint16_t *kr = ks + (8 * j + gid) * STRIDE + 16 * kk + 2 * tig;
					mma_bf16(sc[j], qa[kk], *(const uint32_t *)kr, *(const uint32_t *)(kr + 8));
				}
			}
			float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
			for (int j = 0; j < STILES; j++)
#pragma unroll
				for (int e = 0; e < 4; e++) {
					const int r = e / 2;
					uint32_t pos = kpos[8 * j + 2 * tig + (e & 1)];
					bool vis = valid[r] && pos <= qpos[r] && (a.window == 0 || qpos[r] - pos < a.window);
					sc[j][e] = vis ? sc[j][e] * a.scale : -INFINITY;
					mx[r] = fmaxf(mx[r], sc[j][e]);
				}
			float corr[2], mref[2];
#pragma unroll
			for (int r = 0; r < 2; r++) {
				mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
				mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
				float mnew = fmaxf(m[r], mx[r]);
				/* Nothing visible to the row yet: leave it as it is. */
				corr[r] = mnew == -INFINITY ? 1.0f : expf(m[r] - mnew);
				mref[r] = mnew == -INFINITY ? 0.0f : mnew;
				m[r] = mnew;
			}
			float ls[2] = {0.0f, 0.0f};
#pragma unroll
			for (int j = 0; j < STILES; j++)
#pragma unroll
				for (int e = 0; e < 4; e++) {
					float pr = expf(sc[j][e] - mref[e / 2]);
					sc[j][e] = pr;
					ls[e / 2] += pr;
				}
#pragma unroll
			for (int r = 0; r < 2; r++)
				l[r] = l[r] * corr[r] + ls[r];
#pragma unroll
			for (int dt = 0; dt < DTILES; dt++)
#pragma unroll
				for (int e = 0; e < 4; e++)
					o[dt][e] *= corr[e / 2];
#pragma unroll
			for (int kk = 0; kk < MMA_KEYS / 16; kk++) {
				/* A = P: the S accumulators of key tiles 2kk and 2kk + 1. */
				uint32_t pa[4] = {pack_bf16(sc[2 * kk][0], sc[2 * kk][1]), pack_bf16(sc[2 * kk][2], sc[2 * kk][3]),
						  pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
						  pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
				for (int dt = 0; dt < DTILES; dt++) {
					/* B = V: column gid is dim 8dt + gid, rows keys 16kk + 2tig (+1), + 8 (+9). */
					const uint16_t *vr = vs + (16 * kk + 2 * tig) * STRIDE + 8 * dt + gid;
					uint32_t b0 = (uint32_t)vr[0] | (uint32_t)vr[STRIDE] << 16;
					uint32_t b1 = (uint32_t)vr[8 * STRIDE] | (uint32_t)vr[9 * STRIDE] << 16;
					mma_bf16(o[dt], pa, b0, b1);
				}
			}
		}
		__syncthreads();
	}

#pragma unroll
	for (int r = 0; r < 2; r++) {
		l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
		l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
	}
	float *om = a.m, *ol = a.l, *oacc = a.acc;
	size_t base = 0;
	if (a.pm) {
		om = a.pm;
		ol = a.pl;
		oacc = a.pacc;
		base = (size_t)split * a.n * a.n_heads;
	}
#pragma unroll
	for (int r = 0; r < 2; r++) {
		if (!valid[r])
			continue;
		size_t slot = base + pair[r];
		if (tig == 0) {
			om[slot] = m[r];
			ol[slot] = l[r];
		}
#pragma unroll
		for (int dt = 0; dt < DTILES; dt++)
			*(float2 *)(oacc + slot * HD + dt * 8 + 2 * tig) = make_float2(o[dt][2 * r], o[dt][2 * r + 1]);
	}
}

void attn_mma_launch(uint32_t hd, const attn_args &a, dim3 grid, cudaStream_t s)
{
	if (hd == 128)
		attn_mma_kernel<128><<<grid, 128, 0, s>>>(a);
	else
		attn_mma_kernel<64><<<grid, 128, 0, s>>>(a);
}

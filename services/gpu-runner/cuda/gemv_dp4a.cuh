/* gemv_dp4a.cuh - the kernels of the one-token products with integer dot products (included by
 * gemv_dp4a.cu after gemv_quant.cuh, whose rows and lanes it shares): Q4_K, Q6_K and Q8_0 weights
 * against x quantized to 8 bits, so four weights cost one __dp4a and a mask or two instead of a
 * float conversion and a fused multiply-add each.
 *
 * x. Each block quantizes the bf16 row x (in values) into shared memory when it starts (x as
 * qgemv_args.src says: the BF16 activations, or the RMSNorm of the residual row or the attention
 * output computed on the way and rounded to BF16 as their own kernels round them): per
 * 32-value group g, d_g = amax / 127 (amax: the largest |x| of the group), q = rint(x * (1 / d_g))
 * (round half to even, IEEE reciprocal and product, clamped to +-127), and s_g = d_g * sum q. x is
 * then read back as q d_g: up to half a step d_g off per value (0.4% of the group's largest). The
 * int8 values lie in 16-byte chunks (chunk k: values 16 k ..), stored at chunk dq_phys<F>(k), a
 * permutation within each 128 bytes that makes the 16-byte reads of the 8 lanes of an access
 * phase hit 8 different bank groups; d and s are two float arrays of in / 32 entries.
 * A wide block of dq_sm_kernel (V row groups: the V blocks a multiprocessor would otherwise run
 * side by side; launch_dq_k in gemv_dp4a.cu chooses V) stages x once for all of them.
 *
 * Weights. The lanes take the blocks as the float path does (qg<F>::load, its lane geometry):
 * - Q4_K, lane g of a block: sub-blocks 2g (low nibbles of qs words 0-7) and 2g + 1 (high ones),
 *   dot = d sc (d_x sum q x_q) - dmin m s_x per sub-block;
 * - Q6_K, lane j: 4 runs of 16 values, each with one scale, each half of one group of x;
 *   q - 32 per byte is (q + 0x60) ^ 0x80 (no carry: q < 64);
 * - Q8_0, one lane a block: d d_x sum q x_q. */

/* Shared memory of x for a row of `in` values: in int8 values, then d and s (in / 32 floats each),
 * rounded up to 16 bytes (what follows x is copied to with 16-byte copies). */
static inline __host__ __device__ size_t dq_smem(uint32_t in)
{
	return ((size_t)in + (size_t)in / 32 * 8 + 15) / 16 * 16;
}

/* The same for format F in the shared-memory path: Q6_K's products do not read s, so its x ends
 * after d (its 4 blocks a multiprocessor at in = 14336 need those bytes). */
template <int F> static inline __host__ __device__ size_t dq_smem_f(uint32_t in)
{
	return F != DT_Q6_K ? dq_smem(in) : ((size_t)in + (size_t)in / 32 * 4 + 15) / 16 * 16;
}

/* Where chunk k of x lies. Reads: Q4_K lane L (of a step) reads chunks 4L + c, Q6_K lane L =
 * 4 b + j chunks 16 b + 8 (j >> 1) + (j & 1) + 2 r, Q8_0 lane L chunks 2 L + c; the bits of the
 * lane that the low 3 bits of k do not vary over are folded into them. */
template <int F> static __device__ __forceinline__ uint32_t dq_phys(uint32_t k)
{
	if (F == DT_Q8_0)
		return k ^ ((k >> 3) & 1);
	if (F == DT_Q6_K)
		return k ^ (((k >> 3) & 3) << 1);
	return k ^ ((k >> 3) & 3); /* Q4_K */
}

/* Four int8 of x packed from four ints in -127..127. */
static __device__ __forceinline__ uint32_t pack_i8(int a, int b, int c, int d)
{
	return __byte_perm(__byte_perm((uint32_t)a, (uint32_t)b, 0x0040), __byte_perm((uint32_t)c, (uint32_t)d, 0x0040),
			   0x5410);
}

/* XSRC_NORM's scale 1 / sqrt(mean(res^2) + eps), the mean taken in double as rmsnorm_kernel
 * takes it; the same in every thread (and every block: the sums run in one fixed order, by the
 * first QG_THREADS threads of a block however wide). The loads of U float4 per thread are in
 * flight at once. */
template <uint32_t U> static __device__ float dq_norm_scale(const qgemv_args &a)
{
	__shared__ double part[QG_WARPS];
	const float4 *res = (const float4 *)a.src.res;
	const uint32_t n4 = threadIdx.x < QG_THREADS ? a.in / 4 : 0;
	double ss = 0;
	for (uint32_t base = 0; base < n4; base += U * QG_THREADS) {
		float4 v[U];
#pragma unroll
		for (uint32_t u = 0; u < U; u++) {
			const uint32_t i = base + u * QG_THREADS + threadIdx.x;
			v[u] = i < n4 ? res[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
		}
#pragma unroll
		for (uint32_t u = 0; u < U; u++) {
			ss += (double)v[u].x * v[u].x;
			ss += (double)v[u].y * v[u].y;
			ss += (double)v[u].z * v[u].z;
			ss += (double)v[u].w * v[u].w;
		}
	}
	for (int o = 16; o > 0; o >>= 1)
		ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
	if (threadIdx.x % 32 == 0 && threadIdx.x < QG_THREADS)
		part[threadIdx.x / 32] = ss;
	__syncthreads();
	double tot = 0;
#pragma unroll
	for (uint32_t w = 0; w < QG_WARPS; w++)
		tot += part[w];
	const float var = (float)(tot / a.in);
	return 1.0f / sqrtf(var + a.src.eps); /* IEEE division and square root (no fast math) */
}

/* The raw bytes of values 8 i .. 8 i + 7 of x (dq_raw), loaded together for several i before any
 * is converted (dq_x8), so their loads are in flight at once. */
struct dq_raw {
	uint4 a, b; /* ACT: a = 8 BF16 values; NORM: res; ATTN: acc */
	uint4 w0, w1; /* NORM: the norm weights (F32: w0, w1; BF16, F16: w0) */
	float l;      /* ATTN: the head's sum */
};

template <int K, bool M> static __device__ __forceinline__ void dq_load8(const qgemv_args &a, uint32_t i, dq_raw &r)
{
	if (K == XSRC_ACT) {
		r.a = __ldg((const uint4 *)(M ? pick_mat(a.m.x, qg_mat(a)) : a.x) + i);
		return;
	}
	const uint4 *v = (const uint4 *)(K == XSRC_NORM ? a.src.res : a.src.acc);
	r.a = v[2 * i];
	r.b = v[2 * i + 1];
	if (K == XSRC_ATTN) {
		r.l = a.src.l[8 * i / a.src.head_dim];
	} else if (a.src.norm_wt == DT_F32) {
		r.w0 = __ldg((const uint4 *)a.src.norm_w + 2 * i);
		r.w1 = __ldg((const uint4 *)a.src.norm_w + 2 * i + 1);
	} else {
		r.w0 = __ldg((const uint4 *)a.src.norm_w + i);
	}
}

/* Element e of 8 BF16 or F16 values packed in a uint4, as float32. */
static __device__ __forceinline__ float half8(const uint4 &q, int e, bool bf16)
{
	const uint32_t w = e < 2 ? q.x : e < 4 ? q.y : e < 6 ? q.z : q.w;
	const uint32_t h = (e & 1) ? w >> 16 : w & 0xFFFFu;
	return bf16 ? __uint_as_float(h << 16) : __half2float(__ushort_as_half((unsigned short)h));
}

/* Values 8 i .. 8 i + 7 of x as the product takes them (a.src), from their raw bytes: BF16 values
 * as float32. r is XSRC_NORM's scale. */
template <int K>
static __device__ __forceinline__ void dq_x8(const qgemv_args &a, const dq_raw &raw, float r, float f[8])
{
	if (K == XSRC_ACT) {
#pragma unroll
		for (int e = 0; e < 8; e++)
			f[e] = half8(raw.a, e, true);
		return;
	}
	const float xv[8] = {__uint_as_float(raw.a.x), __uint_as_float(raw.a.y), __uint_as_float(raw.a.z),
			     __uint_as_float(raw.a.w), __uint_as_float(raw.b.x), __uint_as_float(raw.b.y),
			     __uint_as_float(raw.b.z), __uint_as_float(raw.b.w)};
	float v[8];
	if (K == XSRC_NORM) {
		/* rmsnorm_kernel's value: w * (x * r), unfused float32 products. */
		const uint32_t wf[8] = {raw.w0.x, raw.w0.y, raw.w0.z, raw.w0.w, raw.w1.x, raw.w1.y, raw.w1.z, raw.w1.w};
#pragma unroll
		for (int e = 0; e < 8; e++) {
			const float w = a.src.norm_wt == DT_F32 ? __uint_as_float(wf[e])
								: half8(raw.w0, e, a.src.norm_wt == DT_BF16);
			v[e] = __fmul_rn(w, __fmul_rn(xv[e], r));
		}
	} else {
		/* attn_out_kernel's value: acc / l of the head (8 values never straddle two heads:
		 * head_dim is a multiple of 8). */
#pragma unroll
		for (int e = 0; e < 8; e++)
			v[e] = raw.l > 0.0f ? xv[e] / raw.l : 0.0f;
		if (!(raw.l > 0.0f) && blockIdx.x == 0 && atomicCAS(&a.src.st->err, 0, 1) == 0) {
			a.src.st->err_layer = a.src.layer;
			a.src.st->err_pos = a.src.pos0;
		}
	}
#pragma unroll
	for (int e = 0; e < 8; e++)
		f[e] = __bfloat162float(__float2bfloat16_rn(v[e]));
}

/* Quantizes x (a.in values, from source K = a.src.kind; 16-byte aligned) into xq (int8, dq_phys
 * order), xd and xs. Every thread of the block calls it. A thread takes 8 values, 4 threads a
 * group; the loads of U such chunks per thread are issued before any is converted (U: what the
 * registers allow beside the kernel's item buffers). */
template <int F, int K, uint32_t U, bool M>
static __device__ __forceinline__ void dq_stage_k(const qgemv_args &a, uint8_t *xq, float *xd, float *xs)
{
	const uint32_t n8 = a.in / 8, nt = blockDim.x; /* QG_THREADS, or a wide block's */
	const float r = K == XSRC_NORM ? dq_norm_scale<2 * U>(a) : 1.0f;
	for (uint32_t base = 0; base < n8; base += U * nt) {
		dq_raw raw[U];
#pragma unroll
		for (uint32_t u = 0; u < U; u++) {
			const uint32_t i = base + u * nt + threadIdx.x;
			if (i < n8)
				dq_load8<K, M>(a, i, raw[u]);
		}
#pragma unroll
		for (uint32_t u = 0; u < U; u++) {
			const uint32_t i = base + u * nt + threadIdx.x;
			/* Past the end (n8 is a multiple of 4, so a group's 4 threads agree): zeros. */
			float f[8];
			if (i < n8)
				dq_x8<K>(a, raw[u], r, f);
			else
#pragma unroll
				for (int e = 0; e < 8; e++)
					f[e] = 0.0f;
			float amax = 0.0f;
#pragma unroll
			for (int e = 0; e < 8; e++)
				amax = fmaxf(amax, fabsf(f[e]));
			/* The 4 threads of a group are lanes 4m..4m+3 of one warp (n8 is a multiple of 4,
			 * so they are in range together). */
			amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
			amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
			const float d = __fdiv_rn(amax, 127.0f);
			const float id = d > 0.0f ? __frcp_rn(d) : 0.0f;
			int q[8], sum = 0;
#pragma unroll
			for (int e = 0; e < 8; e++) {
				q[e] = min(127, max(-127, __float2int_rn(__fmul_rn(f[e], id))));
				sum += q[e];
			}
			sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
			sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
			if (i < n8) {
				const uint32_t v0 = 8 * i, k = v0 >> 4;
				uint2 *dst = (uint2 *)(xq + 16 * dq_phys<F>(k) + (v0 & 8));
				*dst = make_uint2(pack_i8(q[0], q[1], q[2], q[3]), pack_i8(q[4], q[5], q[6], q[7]));
				if ((threadIdx.x & 3) == 0) {
					xd[v0 >> 5] = d;
					if (F != DT_Q6_K) /* dq_smem_f: Q6_K's x has no s */
						xs[v0 >> 5] = __fmul_rn(d, (float)sum);
				}
			}
		}
	}
}

/* dq_stage_k for a.src.kind (M: several matrices, x the block's matrix's); ends with a barrier. */
template <int F, bool M> static __device__ void dq_stage(const qgemv_args &a, uint8_t *xq, float *xd, float *xs)
{
	/* Q6_K's item buffers take the most registers (80 without spills at 3 blocks a
	 * multiprocessor): fewer loads in flight there. */
	constexpr uint32_t UA = F == DT_Q6_K ? 2 : 4, UN = F == DT_Q6_K ? 1 : 2;
	if (M)
		dq_stage_k<F, XSRC_ACT, UA, true>(a, xq, xd, xs);
	else if (a.src.kind == XSRC_NORM)
		dq_stage_k<F, XSRC_NORM, UN, false>(a, xq, xd, xs);
	else if (a.src.kind == XSRC_ATTN)
		dq_stage_k<F, XSRC_ATTN, UN, false>(a, xq, xd, xs);
	else
		dq_stage_k<F, XSRC_ACT, UA, false>(a, xq, xd, xs);
	__syncthreads();
}

/* The 16 int8 of x in chunk k. */
template <int F> static __device__ __forceinline__ uint4 dq_chunk(const uint8_t *xq, uint32_t k)
{
	return ((const uint4 *)xq)[dq_phys<F>(k)];
}

template <int F> struct dq;

template <> struct dq<DT_Q4_K> {
	/* Lane g of block b reads NC chunks of x: values 64 g .. of the block (chunk(b, g, c)), and the
	 * floats of groups 8 b + 2 g, + 1 of d and s (fidx). */
	static constexpr uint32_t NC = 4;
	static __device__ __forceinline__ uint32_t chunk(uint32_t b, uint32_t g, uint32_t c) { return 16 * b + 4 * g + c; }
	static __device__ __forceinline__ uint32_t fidx(uint32_t b, uint32_t g) { return 8 * b + 2 * g; }
	/* The lane's sum from its chunks of x (logical order) and its groups' d and s at xd, xs. */
	static __device__ __forceinline__ float math(const qg<DT_Q4_K>::data &v, uint32_t g, const uint4 (&c)[NC],
						     const float *xd, const float *xs)
	{
		const uint32_t xl[8] = {c[0].x, c[0].y, c[0].z, c[0].w, c[1].x, c[1].y, c[1].z, c[1].w};
		const uint32_t xh[8] = {c[2].x, c[2].y, c[2].z, c[2].w, c[3].x, c[3].y, c[3].z, c[3].w};
		int lo = 0, hi = 0;
#pragma unroll
		for (int i = 0; i < 8; i++) {
			lo = __dp4a((int)(v.q[i] & 0x0F0F0F0Fu), (int)xl[i], lo);
			hi = __dp4a((int)((v.q[i] >> 4) & 0x0F0F0F0Fu), (int)xh[i], hi);
		}
		uint32_t sc0, m0, sc1, m1;
		k4_scales(v.h, g, sc0, m0, sc1, m1);
		const float d = f16_bits(v.h[0]), dmin = f16_bits(v.h[0] >> 16);
		const float2 dx = *(const float2 *)xd, sx = *(const float2 *)xs;
		const float a = fmaf((float)((int)sc0 * lo), dx.x, (float)((int)sc1 * hi) * dx.y);
		const float m = fmaf((float)m0, sx.x, (float)m1 * sx.y);
		return fmaf(d, a, -dmin * m);
	}
	/* Block b (of the row), lane g of it; x in Q4_K's layout (L). */
	template <int L>
	static __device__ __forceinline__ float dot(const qg<DT_Q4_K>::data &v, uint32_t b, uint32_t g,
						    const uint8_t *xq, const float *xd, const float *xs)
	{
		static_assert(L == DT_Q4_K, "Q4_K reads x's sums, which only Q4_K's layout has");
		const uint32_t k0 = 16 * b + 4 * g; /* values 64 g ..: chunks k0 .. k0 + 3 */
		/* dq_phys<DT_Q4_K>(k0 + c) = k0 + (c ^ t): k0 is a multiple of 4, so its 4 chunks share
		 * k >> 3 (one xor for the four addresses). */
		const uint32_t t = (k0 >> 3) & 3;
		const uint4 *xk = (const uint4 *)xq + k0;
		const uint4 c[NC] = {xk[t], xk[1 ^ t], xk[2 ^ t], xk[3 ^ t]};
		return math(v, g, c, xd + fidx(b, g), xs + fidx(b, g));
	}
};

template <> struct dq<DT_Q6_K> {
	/* The bytes q - 32 of run r's word: 4 bits of ql (a for runs 0, 2; b for 1, 3; low nibbles
	 * for runs 0, 1) | 2 bits of qh (bits 2r, 2r + 1) << 4. */
	static __device__ __forceinline__ int q6(uint32_t r, uint32_t a, uint32_t b, uint32_t h)
	{
		uint32_t q;
		switch (r) {
		case 0:
			q = (a & 0x0F0F0F0Fu) | ((h << 4) & 0x30303030u);
			break;
		case 1:
			q = (b & 0x0F0F0F0Fu) | ((h << 2) & 0x30303030u);
			break;
		case 2:
			q = ((a >> 4) & 0x0F0F0F0Fu) | (h & 0x30303030u);
			break;
		default:
			q = ((b >> 4) & 0x0F0F0F0Fu) | ((h >> 2) & 0x30303030u);
			break;
		}
		return (int)((q + 0x60606060u) ^ 0x80808080u);
	}
	/* Block b, lane j: run r holds values 128 nh + 32 r + 16 (j & 1) + 0..15 (nh = j >> 1), chunk
	 * 16 b + 8 nh + 2 r + (j & 1), group 8 b + 4 nh + r, scale scales[8 nh + (j & 1) + 2 r]. x in
	 * format L's layout (Q4_K's where a launch of two formats stages one x for both). */
	static constexpr uint32_t NC = 4;
	static __device__ __forceinline__ uint32_t chunk(uint32_t b, uint32_t j, uint32_t r)
	{
		return 16 * b + 8 * (j >> 1) + (j & 1) + 2 * r;
	}
	static __device__ __forceinline__ uint32_t fidx(uint32_t b, uint32_t j) { return 8 * b + 4 * (j >> 1); }
	/* The lane's sum from its runs' chunks of x and their four groups' d at xd. */
	static __device__ __forceinline__ float math(const qg<DT_Q6_K>::data &v, uint32_t j, const uint4 (&c)[NC],
						     const float *xd, const float *)
	{
		const uint32_t hj = j & 1;
		const float4 dx = *(const float4 *)xd;
		const float dxr[4] = {dx.x, dx.y, dx.z, dx.w};
		float y = 0.0f;
#pragma unroll
		for (uint32_t r = 0; r < 4; r++) {
			int s = __dp4a(q6(r, v.a[0], v.b[0], v.h[0]), (int)c[r].x, 0);
			s = __dp4a(q6(r, v.a[1], v.b[1], v.h[1]), (int)c[r].y, s);
			s = __dp4a(q6(r, v.a[2], v.b[2], v.h[2]), (int)c[r].z, s);
			s = __dp4a(q6(r, v.a[3], v.b[3], v.h[3]), (int)c[r].w, s);
			const uint32_t i = hj + 2 * r;
			const int sc = (int)(int8_t)((v.sw[i >> 2] >> (8 * (i & 3))) & 0xFF);
			y = fmaf((float)(sc * s), dxr[r], y);
		}
		return v.d * y;
	}
	template <int L>
	static __device__ __forceinline__ float dot(const qg<DT_Q6_K>::data &v, uint32_t b, uint32_t j,
						    const uint8_t *xq, const float *xd, const float *xs)
	{
		const uint32_t k0 = chunk(b, j, 0);
		/* dq_phys<DT_Q6_K>(k0 + 2 r) = k0 + (2 r ^ t): k0's bits 1 and 2 are 0, and its 4
		 * chunks share k >> 3 (one xor for the four addresses). */
		const uint32_t t = ((k0 >> 3) & 3) << 1;
		const uint4 *xk = (const uint4 *)xq + k0;
		uint4 c[NC];
#pragma unroll
		for (uint32_t r = 0; r < 4; r++)
			c[r] = L == DT_Q6_K ? xk[(2 * r) ^ t] : dq_chunk<L>(xq, k0 + 2 * r);
		return math(v, j, c, xd + fidx(b, j), xs);
	}
};

template <> struct dq<DT_Q8_0> {
	/* Block b (one lane): chunks 2b, 2b + 1, group b; x in format L's layout. */
	static constexpr uint32_t NC = 2;
	static __device__ __forceinline__ uint32_t chunk(uint32_t b, uint32_t, uint32_t c) { return 2 * b + c; }
	static __device__ __forceinline__ uint32_t fidx(uint32_t b, uint32_t) { return b; }
	static __device__ __forceinline__ float math(const qg<DT_Q8_0>::data &v, uint32_t, const uint4 (&c)[NC],
						     const float *xd, const float *)
	{
		int s = __dp4a((int)v.q[0], (int)c[0].x, 0);
		s = __dp4a((int)v.q[1], (int)c[0].y, s);
		s = __dp4a((int)v.q[2], (int)c[0].z, s);
		s = __dp4a((int)v.q[3], (int)c[0].w, s);
		s = __dp4a((int)v.q[4], (int)c[1].x, s);
		s = __dp4a((int)v.q[5], (int)c[1].y, s);
		s = __dp4a((int)v.q[6], (int)c[1].z, s);
		s = __dp4a((int)v.q[7], (int)c[1].w, s);
		return v.d * ((float)s * xd[0]);
	}
	template <int L>
	static __device__ __forceinline__ float dot(const qg<DT_Q8_0>::data &v, uint32_t b, uint32_t,
						    const uint8_t *xq, const float *xd, const float *xs)
	{
		const uint4 c[NC] = {dq_chunk<L>(xq, 2 * b), dq_chunk<L>(xq, 2 * b + 1)};
		return math(v, 0, c, xd + b, xs);
	}
};

/* Adds a lane's share of item k to acc (up's items to acc2). */
template <int F, int MODE>
static __device__ __forceinline__ void dq_item(const qgemv_args &a, uint32_t k, uint32_t lane,
					       const typename qg<F>::data &d, const uint8_t *xq, const float *xd,
					       const float *xs, float *acc, float *acc2)
{
	typedef qg<F> T;
	const uint32_t s = GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? k >> 1 : k;
	const uint32_t b = s * T::BPS + lane / T::LPB;
	if (b < a.nb) {
		const float y = dq<F>::template dot<F>(d, b, lane % T::LPB, xq, xd, xs);
		if (GEMV_MODE_OF(MODE) == GEMV_SWIGLU && (k & 1))
			acc2[0] += y;
		else
			acc[0] += y;
	}
}

/* One stage of a warp's stream (qg_stream's order): loads the item at ld into nd, computes the
 * item at `at` from cd. False when no item follows. */
template <int F, int MODE>
static __device__ __forceinline__ bool dq_stream(const qgemv_args &a, qg_cursor<MODE> &at, qg_cursor<MODE> &ld,
						 uint32_t wid, uint32_t lane, const typename qg<F>::data &cd,
						 typename qg<F>::data &nd, const uint8_t *xq, const float *xd,
						 const float *xs, float *acc, float *acc2)
{
	if (ld.live) {
		qg_load<F, MODE>(a, ld.r, ld.k, lane, nd);
		ld.next(a, wid);
	}
	const uint32_t k = at.k;
	dq_item<F, MODE>(a, k, lane, cd, xq, xd, xs, acc, acc2);
	if (k + 1 == qg_items<MODE>(a))
		qg_finish<1, MODE>(a, at.r.p, at.r.o, lane, acc, acc2);
	at.next(a, wid);
	return at.live;
}

/* Blocks per multiprocessor the registers are capped for: 4 blocks of 256 threads (64 registers)
 * where the three buffers fit them without spills (Q8_0; Q4_K but SwiGLU), else 3 (85 registers). */
template <int F, int MODE> struct dq_occ {
	static constexpr int MIN_BLOCKS = F == DT_Q8_0 || (F == DT_Q4_K && GEMV_MODE_OF(MODE) != GEMV_SWIGLU) ? 4 : 3;
};

/* One token, x staged whole as int8 (dq_smem(in) bytes of shared memory), three item buffers a warp. */
template <int F, int MODE>
__global__ void __launch_bounds__(QG_THREADS, (dq_occ<F, MODE>::MIN_BLOCKS)) dq_kernel(const qgemv_args a)
{
	typedef typename qg<F>::data D;
	extern __shared__ uint4 dq_smem_buf[];
	uint8_t *xq = (uint8_t *)dq_smem_buf;
	float *xd = (float *)(xq + a.in), *xs = xd + a.in / 32;
	const uint32_t wid = threadIdx.x / 32, lane = threadIdx.x % 32;
	float acc[1] = {0.0f}, acc2[1] = {0.0f};
	if ((MODE & GEMV_MATS_BIT) && a.m.wd)
		grid_wait(); /* the kernel before chose the matrices */
	qg_row<MODE> cur;
	const bool live = cur.at(a, qg_first_group<MODE>(a), wid);
	qg_cursor<MODE> at = {cur, 0, live}, ld = at;
	D d0, d1, d2;
	grid_launch_next();
	if (live) {
		/* The first row's bytes (up to 8 KiB) start coming into L2 as well. */
		prefetch_l2(cur.row, a.row_bytes, lane);
		if (GEMV_MODE_OF(MODE) == GEMV_SWIGLU)
			prefetch_l2(cur.row2, a.row_bytes, lane);
	}
	/* x is quantized with the registers to itself (its loads in flight together); the first
	 * items' bytes come from L2 after it. */
	grid_wait();
	dq_stage<F, (MODE & GEMV_MATS_BIT) != 0>(a, xq, xd, xs);
	if (!live)
		return;
	if (ld.live) {
		qg_load<F, MODE>(a, ld.r, ld.k, lane, d0);
		ld.next(a, wid);
	}
	if (ld.live) {
		qg_load<F, MODE>(a, ld.r, ld.k, lane, d1);
		ld.next(a, wid);
	}
	while (dq_stream<F, MODE>(a, at, ld, wid, lane, d0, d2, xq, xd, xs, acc, acc2) &&
	       dq_stream<F, MODE>(a, at, ld, wid, lane, d1, d0, xq, xd, xs, acc, acc2) &&
	       dq_stream<F, MODE>(a, at, ld, wid, lane, d2, d1, xq, xd, xs, acc, acc2))
		;
}

/* ---- the weights through shared memory (cp.async) -------------------------------------------
 *
 * dq_kernel holds three items' bytes per warp in registers, which caps a multiprocessor at 3-4
 * blocks and a warp at two items in flight. dq_sm_kernel copies each item's bytes (one step of
 * the row: BPS blocks, contiguous in memory) into a ring of DQ_STAGES stages of its warp in shared
 * memory with cp.async, DQ_STAGES - 1 items ahead of the one it computes, so the bytes in flight
 * cost no registers; a lane then reads its share of the item from shared memory as dq_kernel reads
 * it from global memory. Taken where rows and tensors are 16-byte aligned (cp.async copies 16
 * bytes from 16-byte aligned addresses; an item's last chunk past the tensor's bytes is zero-filled,
 * never read). */

/* Stages of a warp's ring: 4, Q6_K's 3 (its 1680-byte steps: 4 blocks of a multiprocessor where x
 * is a down projection's 14336 values, so that each of 4096 rows has a warp of its own, rather
 * than 3 blocks whose warps take 1 or 2 rows and the kernel the time of 2). */
template <int F> struct dq_stages {
	static constexpr uint32_t V = F == DT_Q6_K ? 3 : 4;
};

/* Shared-memory reads at the alignment quant.cuh's global reads handle (the stage keeps a step's
 * bytes at their offsets from the step's 16-byte aligned start): ld_words<NW, true>, and 16 bytes. */
static __device__ __forceinline__ void sm16(const uint8_t *p, uint32_t *w)
{
	const uint4 v = *(const uint4 *)p;
	w[0] = v.x;
	w[1] = v.y;
	w[2] = v.z;
	w[3] = v.w;
}

/* A lane's share of block blk (in shared memory), as qg<F>::load reads it from global memory. */
template <int F> struct sq;
template <> struct sq<DT_Q4_K> {
	static __device__ __forceinline__ void load(const uint8_t *b, uint32_t g, qg<DT_Q4_K>::data &v)
	{
		sm16(b, v.h);
		sm16(b + 16 + 32 * g, v.q);
		sm16(b + 32 + 32 * g, v.q + 4);
	}
};
template <> struct sq<DT_Q6_K> {
	static __device__ __forceinline__ void load(const uint8_t *blk, uint32_t j, qg<DT_Q6_K>::data &v)
	{
		const uint32_t nh = j >> 1, l0 = 16 * (j & 1);
		ld_words<4, true>(blk + 64 * nh + l0, v.a);
		ld_words<4, true>(blk + 64 * nh + 32 + l0, v.b);
		ld_words<4, true>(blk + 128 + 32 * nh + l0, v.h);
		ld_words<2, true>(blk + 192 + 8 * nh, v.sw);
		v.d = __half2float(__ushort_as_half(*(const unsigned short *)(blk + 208)));
	}
};
template <> struct sq<DT_Q8_0> {
	static __device__ __forceinline__ void load(const uint8_t *b, uint32_t, qg<DT_Q8_0>::data &v)
	{
		ld_words<8, true>(b + 2, v.q);
		v.d = __half2float(__ushort_as_half(*(const unsigned short *)b));
	}
};

/* Bytes of one stage: a step's blocks, rounded up to 16. */
template <int F> struct dq_stage_bytes {
	static constexpr uint32_t V = (qg<F>::BPS * qg<F>::BB + 15) / 16 * 16;
};

static inline size_t dq_sm_smem(uint32_t fmt, uint32_t in, uint32_t warps)
{
	const uint32_t sb = fmt == DT_Q4_K ? dq_stage_bytes<DT_Q4_K>::V
			    : fmt == DT_Q6_K ? dq_stage_bytes<DT_Q6_K>::V
					     : dq_stage_bytes<DT_Q8_0>::V;
	const size_t x = fmt == DT_Q4_K ? dq_smem_f<DT_Q4_K>(in) : fmt == DT_Q6_K ? dq_smem_f<DT_Q6_K>(in)
									       : dq_smem_f<DT_Q8_0>(in);
	const uint32_t st = fmt == DT_Q4_K ? dq_stages<DT_Q4_K>::V : fmt == DT_Q6_K ? dq_stages<DT_Q6_K>::V
									       : dq_stages<DT_Q8_0>::V;
	return x + (size_t)warps * st * sb;
}

/* Every copy of a product's weights asks L2 to fetch whole 128-byte lines (.L2::128B): Q4_K_M 8B
 * decode 2.245 against 2.288 ms/token, lm_head 3.11 against 2.97 TB/s; .L2::256B was slower (2.317;
 * docs/benchmarks.md, "2026-12-03 (third session)"). */
static __device__ __forceinline__ void cp_async16(uint8_t *dst, const uint8_t *src, uint32_t src_bytes)
{
	const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
	asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}

static __device__ __forceinline__ void cp_async_commit(void)
{
	asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int N> static __device__ __forceinline__ void cp_async_wait(void)
{
	asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/* The warp copies item k of its row (cursor c) into stage st; commits a group even without an item,
 * so that every lane's group count stays in step. */
template <int F, int MODE>
static __device__ __forceinline__ void dq_sm_issue(const qgemv_args &a, const qg_cursor<MODE> &c, uint8_t *st,
						   uint32_t lane)
{
	typedef qg<F> T;
	if (c.live) {
		const uint32_t s = GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? c.k >> 1 : c.k;
		const uint32_t b0 = s * T::BPS, nblk = min(T::BPS, a.nb - b0);
		const uint32_t bytes = nblk * T::BB;
		const uint8_t *src = (GEMV_MODE_OF(MODE) == GEMV_SWIGLU && (c.k & 1) ? c.r.row2 : c.r.row) + (size_t)b0 * T::BB;
		constexpr uint32_t FULL = T::BPS * T::BB; /* a whole step: a multiple of 16 in every format */
		static_assert(FULL % 16 == 0, "a whole step is whole 16-byte chunks");
		if (bytes == FULL) {
			/* The common case in a fixed number of copies, no tail. */
#pragma unroll
			for (uint32_t i = 0; i < (FULL + 511) / 512; i++)
				if (16 * lane + 512 * i < FULL)
					cp_async16(st + 16 * lane + 512 * i, src + 16 * lane + 512 * i, 16);
		} else {
			for (uint32_t off = 16 * lane; off < bytes; off += 16 * 32)
				cp_async16(st + off, src + off, min(16u, bytes - off));
		}
	}
	cp_async_commit();
}

/* Adds a lane's share of item k (its bytes in stage st) to acc (up's items to acc2); x in format
 * L's layout. */
template <int F, int L, int MODE>
static __device__ __forceinline__ void dq_sm_item(const qgemv_args &a, uint32_t k, uint32_t lane, const uint8_t *st,
						  const uint8_t *xq, const float *xd, const float *xs, float *acc,
						  float *acc2)
{
	typedef qg<F> T;
	const uint32_t s = GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? k >> 1 : k;
	const uint32_t j = lane / T::LPB, b = s * T::BPS + j;
	if (b < a.nb) {
		typename T::data d;
		sq<F>::load(st + j * T::BB, lane % T::LPB, d);
		const float y = dq<F>::template dot<L>(d, b, lane % T::LPB, xq, xd, xs);
		if (GEMV_MODE_OF(MODE) == GEMV_SWIGLU && (k & 1))
			acc2[0] += y;
		else
			acc[0] += y;
	}
}

/* 4 blocks a multiprocessor (64 registers) but Q4_K's SwiGLU, whose x staging needs more (3). */
template <int F, int MODE> struct dq_sm_occ {
	static constexpr int MIN_BLOCKS = F == DT_Q4_K && GEMV_MODE_OF(MODE) == GEMV_SWIGLU ? 3 : 4;
};

/* A warp's first DQ_STAGES - 1 items into its ring (ld moves on past them), issued before the
 * kernel before has finished: weights are what no kernel of the step writes. */
template <int F, int MODE>
static __device__ __forceinline__ void dq_sm_begin(const qgemv_args &a, qg_cursor<MODE> &ld, uint8_t *ring,
						   uint32_t wid, uint32_t lane)
{
#pragma unroll
	for (uint32_t i = 0; i < dq_stages<F>::V - 1; i++) {
		dq_sm_issue<F, MODE>(a, ld, ring + i * dq_stage_bytes<F>::V, lane);
		if (ld.live)
			ld.next(a, wid);
	}
}

/* A live warp's rows once x is staged (in format L's layout): each item computed from its stage
 * while the next DQ_STAGES - 1 are in flight, each row finished after its last item. */
template <int F, int L, int MODE>
static __device__ __forceinline__ void dq_sm_rows(const qgemv_args &a, qg_cursor<MODE> &at, qg_cursor<MODE> &ld,
						  uint8_t *ring, uint32_t wid, uint32_t lane, const uint8_t *xq,
						  const float *xd, const float *xs)
{
	constexpr uint32_t SB = dq_stage_bytes<F>::V, DQ_STAGES = dq_stages<F>::V;
	float acc[1] = {0.0f}, acc2[1] = {0.0f};
	for (uint32_t i = 0;; i++) {
		cp_async_wait<DQ_STAGES - 2>(); /* item i's bytes (this lane's copies) have landed */
		__syncwarp();			/* ... and every lane's; stage i - 1 is read by all */
		dq_sm_issue<F, MODE>(a, ld, ring + ((i + DQ_STAGES - 1) % DQ_STAGES) * SB, lane);
		if (ld.live)
			ld.next(a, wid);
		const uint32_t k = at.k;
		dq_sm_item<F, L, MODE>(a, k, lane, ring + (i % DQ_STAGES) * SB, xq, xd, xs, acc, acc2);
		if (k + 1 == qg_items<MODE>(a))
			qg_finish<1, MODE>(a, at.r.p, at.r.o, lane, acc, acc2);
		at.next(a, wid);
		if (!at.live)
			break;
	}
}

/* ---- rows of whole steps (GEMV_WHOLE_BIT) ----------------------------------------------------
 *
 * Where a row is whole steps (nb a multiple of BPS: every Llama-shape product), dq_sm_rows' general
 * walk paid for what never happens: a step's block count and tail test at every copy, each item's
 * x addresses made anew from its block, and the compute cursor's next row (predicated, so run at
 * every item). Measured by ncu on a Q4_K_M 8B decode step, gate/up's warps ran about 180
 * instructions an item for its 16 integer dot products. dq_sm_rows_whole walks the same items in
 * the same order with the same arithmetic (dq<F>::math; so the same bits): a row's items in a loop
 * of their own (SwiGLU's gate and up items in turn, each to its own sum without a select), the next
 * row once a row ends, every copy a whole step (cp.async without the zero-fill size), and a lane's
 * chunks of x found once (their offsets at step 0: a step moves them by S bytes, its groups'
 * floats by S / 32, and dq_phys's xor never reaches those bits). */

/* A whole step of item (ld) into the stage at shared address st (this lane's 16-byte slots), and
 * the group committed even without an item. */
template <int F, int MODE>
static __device__ __forceinline__ void dq_whole_issue(const qg_cursor<MODE> &c, uint32_t st, uint32_t lane)
{
	typedef qg<F> T;
	constexpr uint32_t FULL = T::BPS * T::BB;
	if (c.live) {
		const bool sw = GEMV_MODE_OF(MODE) == GEMV_SWIGLU;
		const uint32_t s = sw ? c.k >> 1 : c.k;
		const uint8_t *src = (sw && (c.k & 1) ? c.r.row2 : c.r.row) + (size_t)s * FULL + 16 * lane;
#pragma unroll
		for (uint32_t i = 0; i < (FULL + 511) / 512; i++)
			if (16 * lane + 512 * i < FULL)
				asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(st + 512 * i),
					     "l"(src + 512 * i)
					     : "memory");
	}
	cp_async_commit();
}

template <int F, int L, int MODE>
static __device__ void dq_sm_rows_whole(const qgemv_args &a, qg_cursor<MODE> &at, qg_cursor<MODE> &ld,
					uint8_t *ring, uint32_t wid, uint32_t lane, const uint8_t *xq, const float *xd,
					const float *xs)
{
	typedef qg<F> T;
	typedef dq<F> Q;
	constexpr uint32_t SB = dq_stage_bytes<F>::V, NS = dq_stages<F>::V, NC = Q::NC;
	constexpr bool SW = GEMV_MODE_OF(MODE) == GEMV_SWIGLU;
	const uint32_t j = lane / T::LPB, g = lane % T::LPB;
	/* This lane's first chunk of x at step 0, in layout L, and its groups' floats. Its other chunks
	 * are dc apart in the logical order (1, Q6_K's 2), which the xor of dq_phys leaves an xor apart:
	 * chunk c lies at xo ^ (16 dc c). */
	const uint32_t xo = 16 * dq_phys<L>(Q::chunk(j, g, 0)), dc = Q::chunk(0, 0, 1) - Q::chunk(0, 0, 0);
	const uint32_t fo = Q::fidx(j, g);
	const uint32_t ring_s = (uint32_t)__cvta_generic_to_shared(ring), steps = a.steps;
	const uint8_t *wl = ring + j * T::BB; /* this lane's block in a stage */
	uint32_t ci = 0; /* the stage of the next item; the next copy's is the one before it */
	/* The compute cursor row's item at step s (gate's or up's, as acc is) into acc. */
	auto item = [&](uint32_t s, float &acc) {
		cp_async_wait<NS - 2>(); /* the item's bytes (this lane's copies) have landed */
		__syncwarp();		 /* ... and every lane's; the stage before ci was read by all */
		dq_whole_issue<F, MODE>(ld, ring_s + (ci ? ci - 1 : NS - 1) * SB + 16 * lane, lane);
		if (ld.live)
			ld.next(a, wid);
		typename T::data d;
		sq<F>::load(wl + ci * SB, g, d);
		ci = ci + 1 == NS ? 0 : ci + 1;
		const uint8_t *xs_q = xq + (size_t)s * T::S;
		uint4 c[NC];
#pragma unroll
		for (uint32_t q = 0; q < NC; q++)
			c[q] = *(const uint4 *)(xs_q + (xo ^ (16 * dc * q)));
		const uint32_t f = s * (T::S / 32) + fo;
		acc += Q::math(d, g, c, xd + f, xs + f);
	};
	for (;;) {
		float acc[1] = {0.0f}, acc2[1] = {0.0f};
		for (uint32_t s = 0; s < steps; s++) {
			item(s, acc[0]);
			if (SW)
				item(s, acc2[0]);
		}
		qg_finish<1, MODE>(a, at.r.p, at.r.o, lane, acc, acc2);
		if (!at.r.at(a, at.r.rg + qg_group_step<MODE>(a), wid))
			break;
	}
}

/* Blocks of QG_THREADS threads, one row group each, or wide blocks of V row groups (launch_dq_k:
 * V of the blocks a multiprocessor holds, as one block): the V row groups' warps share one staging
 * of x, which every block of a multiprocessor would otherwise spend its own instructions on.
 * Warp w is warp w % QG_WARPS of row-group block w / QG_WARPS (qg_first_group) and has stage ring
 * w of its own. The registers are capped as for MIN_BLOCKS blocks of QG_THREADS. */
template <int F, int MODE>
__global__ void __launch_bounds__(QG_THREADS *(dq_sm_occ<F, MODE>::MIN_BLOCKS), 1) dq_sm_kernel(const qgemv_args a)
{
	constexpr uint32_t SB = dq_stage_bytes<F>::V, DQ_STAGES = dq_stages<F>::V;
	extern __shared__ uint4 dq_smem_buf[];
	uint8_t *xq = (uint8_t *)dq_smem_buf;
	float *xd = (float *)(xq + a.in), *xs = xd + a.in / 32; /* xs: none for Q6_K (dq_smem_f) */
	const uint32_t lane = threadIdx.x % 32;
	uint8_t *ring = (uint8_t *)dq_smem_buf + dq_smem_f<F>(a.in) + (size_t)(threadIdx.x / 32) * DQ_STAGES * SB;
	const uint32_t wid = threadIdx.x / 32 % QG_WARPS; /* in its row-group block */
	ktrace_mark(a.tr, 0);
	if ((MODE & GEMV_MATS_BIT) && a.m.wd)
		grid_wait(); /* the kernel before chose the matrices */
	qg_row<MODE> cur;
	const bool live = cur.at(a, qg_first_group<MODE>(a), wid);
	qg_cursor<MODE> at = {cur, 0, live}, ld = at;
	grid_launch_next();
	dq_sm_begin<F, MODE>(a, ld, ring, wid, lane);
	grid_wait();
	ktrace_mark(a.tr, 1);
	dq_stage<F, (MODE & GEMV_MATS_BIT) != 0>(a, xq, xd, xs);
	ktrace_mark(a.tr, 2);
	if (live && (MODE & GEMV_WHOLE_BIT))
		dq_sm_rows_whole<F, F, MODE>(a, at, ld, ring, wid, lane, xq, xd, xs);
	else if (live)
		dq_sm_rows<F, F, MODE>(a, at, ld, ring, wid, lane, xq, xd, xs);
	cp_async_wait<0>();
	ktrace_end(a.tr);
}

/* ---- two block formats in one launch --------------------------------------------------------
 *
 * A one-token product whose parts come in two formats (a Q4_K_M layer's q and k in Q4_K, its v in
 * Q6_K; Q8_0 k and v beside a Q4_K q in a file of 8 experts) was two launches, each staging x and
 * each with its own ramp and tail: v's 1024 rows took as long as q and k's 5120 beside it.
 * dq_mix_kernel runs both: the row-group blocks [0, a.vbn) walk a's row groups (format F1, always
 * Q4_K: its x layout, with the groups' sums, serves the others too), blocks [b.vb0, b.vb0 + b.vbn)
 * walk b's (format F2), each warp with the ring and the loop of its format. A row is summed by one
 * warp in the same order from the same int8 x as in a launch of its own, so the results are the
 * same bits (test_two_formats). */
template <int F1, int F2> struct dq_mix_ring {
	static constexpr uint32_t B1 = dq_stages<F1>::V * dq_stage_bytes<F1>::V,
				  B2 = dq_stages<F2>::V * dq_stage_bytes<F2>::V;
	static constexpr uint32_t V = B1 > B2 ? B1 : B2; /* bytes of a warp's ring */
};

template <int F1, int F2, bool W>
__global__ void __launch_bounds__(QG_THREADS * DQ_WIDE_MAX, 1) dq_mix_kernel(const qgemv_args a, const qgemv_args b)
{
	static_assert(F1 == DT_Q4_K && (F2 == DT_Q6_K || F2 == DT_Q8_0), "x is staged in Q4_K's layout");
	/* W in MODE as dq_sm_kernel has it, so the ring's begin and its walk are of one mode. */
	constexpr int MODE = GEMV_STORE | GEMV_MIX_BIT | (W ? GEMV_WHOLE_BIT : 0);
	extern __shared__ uint4 dq_smem_buf[];
	uint8_t *xq = (uint8_t *)dq_smem_buf;
	float *xd = (float *)(xq + a.in), *xs = xd + a.in / 32;
	const uint32_t lane = threadIdx.x % 32;
	uint8_t *ring = (uint8_t *)dq_smem_buf + dq_smem_f<F1>(a.in) +
			(size_t)(threadIdx.x / 32) * dq_mix_ring<F1, F2>::V;
	const uint32_t wid = threadIdx.x / 32 % QG_WARPS;
	/* The same for the warps of a row-group block, so a branch of whole warps. */
	const bool first = qg_vblock(a) < a.vbn;
	ktrace_mark(a.tr, 0);
	qg_row<MODE> cur;
	const bool live = first ? cur.at(a, qg_first_group<MODE>(a), wid) : cur.at(b, qg_first_group<MODE>(b), wid);
	qg_cursor<MODE> at = {cur, 0, live}, ld = at;
	grid_launch_next();
	if (first)
		dq_sm_begin<F1, MODE>(a, ld, ring, wid, lane);
	else
		dq_sm_begin<F2, MODE>(b, ld, ring, wid, lane);
	grid_wait();
	ktrace_mark(a.tr, 1);
	dq_stage<F1, false>(a, xq, xd, xs);
	ktrace_mark(a.tr, 2);
	if (live && first && W)
		dq_sm_rows_whole<F1, F1, MODE>(a, at, ld, ring, wid, lane, xq, xd, xs);
	else if (live && first)
		dq_sm_rows<F1, F1, MODE>(a, at, ld, ring, wid, lane, xq, xd, xs);
	else if (live && W)
		dq_sm_rows_whole<F2, F1, MODE>(b, at, ld, ring, wid, lane, xq, xd, xs);
	else if (live)
		dq_sm_rows<F2, F1, MODE>(b, at, ld, ring, wid, lane, xq, xd, xs);
	cp_async_wait<0>();
	ktrace_end(a.tr);
}

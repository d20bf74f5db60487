/* attention_fp32.cu - the attention of few queries on the CUDA cores in float32 (attn_kernel; the
 * host side, attention.cu, picks it for decode and small chunks): a block serves queries that
 * share one KV head (GQA) and stages the keys (K and V) a tile of 32 at a time in shared memory;
 * tiles no query of the block may see (causal mask, sliding window) are skipped. Two warps per
 * query (one where a block of more than 8 queries has no room) take a tile, each its half (two
 * lanes a key), with an online softmax; their states merge in shared memory. Where the key range
 * is split across blocks the pieces are merged into the running state by the last block of each
 * column to finish (backend_params.fuse default), else by attn_combine_kernel. The keys of
 * earlier steps (attn_args.early_keys) are indexed and loaded before a block waits for the kernel
 * before, which writes only this call's rows. */
#include "services/gpu-runner/cuda/attention.cuh"
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cuda/device.cuh"

#include <stddef.h>

/* The part of a staged key row's score against the warp's query (both in shared memory) that
 * 16-byte chunks [c0, c1) of the row hold. */
static __device__ __forceinline__ float qk_dot(const float *q, const unsigned char *krow, uint32_t c0, uint32_t c1,
					       __nv_bfloat16)
{
	const uint4 *k = (const uint4 *)krow;
	const float4 *qv = (const float4 *)q;
	float s0 = 0, s1 = 0;
	for (uint32_t c = c0; c < c1; c++) {
		uint4 kv = k[c];
		float4 qa = qv[2 * c], qb = qv[2 * c + 1];
		const __nv_bfloat162 *kp = reinterpret_cast<const __nv_bfloat162 *>(&kv);
		float2 k0 = to_f32x2(kp[0]), k1 = to_f32x2(kp[1]), k2 = to_f32x2(kp[2]), k3 = to_f32x2(kp[3]);
		s0 = fmaf(qa.x, k0.x, s0);
		s1 = fmaf(qa.y, k0.y, s1);
		s0 = fmaf(qa.z, k1.x, s0);
		s1 = fmaf(qa.w, k1.y, s1);
		s0 = fmaf(qb.x, k2.x, s0);
		s1 = fmaf(qb.y, k2.y, s1);
		s0 = fmaf(qb.z, k3.x, s0);
		s1 = fmaf(qb.w, k3.y, s1);
	}
	return s0 + s1;
}

static __device__ __forceinline__ float qk_dot(const float *q, const unsigned char *krow, uint32_t c0, uint32_t c1,
					       float)
{
	const float4 *k = (const float4 *)krow;
	const float4 *qv = (const float4 *)q;
	float s0 = 0, s1 = 0;
	for (uint32_t c = c0; c < c1; c++) {
		float4 kv = k[c], qa = qv[c];
		s0 = fmaf(qa.x, kv.x, s0);
		s1 = fmaf(qa.y, kv.y, s1);
		s0 = fmaf(qa.z, kv.z, s0);
		s1 = fmaf(qa.w, kv.w, s1);
	}
	return s0 + s1;
}

static __device__ __forceinline__ float2 v_pair(const unsigned char *vrow, uint32_t d, __nv_bfloat16)
{
	return to_f32x2(*(const __nv_bfloat162 *)(vrow + d * 2));
}

static __device__ __forceinline__ float2 v_pair(const unsigned char *vrow, uint32_t d, float)
{
	return *(const float2 *)(vrow + d * 4);
}

size_t attn_smem_bytes(uint32_t hd, size_t esize, uint32_t nw)
{
	return ATTN_TILE * (sizeof(uint64_t) + sizeof(uint32_t)) + ATTN_TILE * (hd * esize + 16) +
	       ATTN_TILE * hd * esize + (size_t)nw * hd * sizeof(float);
}

/* Folds the splits' partial states of one (token, head) pair into its running state: the kw
 * warps of the pair's query, warp wk taking the head's 64-dim chunks j = wk, wk + kw, ... (lane i
 * dims 64 j + 2 i and + 1); the partials (written by other blocks) read past L1. Every load of a
 * warp (the running state, the splits' maxima and sums, lane i those of splits i and i + 32, and
 * its dims' accumulators of up to MERGE_BATCH splits) goes out before any is used: one memory
 * round trip where the splits are at most MERGE_BATCH and the head at most 64 kw dims. The
 * weights exp(m_s - max) are computed once, in parallel. The float32 operations and their order
 * are attn_combine_kernel's (a serial merge's). Every thread of the block calls it (active: its
 * warp serves a pair); the pair's m and l are written after a barrier, when every warp of the
 * pair has read them. */
#define MERGE_BATCH 24
static_assert(ATTN_MAX_SPLITS <= 64, "a lane reads the state of two splits at most");
template <int NJ>
static __device__ __noinline__ void merge_splits(const attn_args &a, size_t pair, uint32_t splits, bool active,
						 uint32_t wk, uint32_t kw, uint32_t lane)
{
	const size_t pairs = (size_t)a.n * a.n_heads;
	const uint32_t hd = a.head_dim;
	float mx = -INFINITY, L = 0.0f;
	bool seen = false;
	if (active) {
		const float M = a.m[pair], L0 = a.l[pair];
		float ms[2], ls[2], ws[2] = {0.0f, 0.0f}, wM = 0.0f;
#pragma unroll
		for (int i = 0; i < 2; i++) {
			const uint32_t s = lane + 32 * i;
			ms[i] = s < splits ? __ldcg(a.pm + s * pairs + pair) : -INFINITY;
			ls[i] = s < splits ? __ldcg(a.pl + s * pairs + pair) : 0.0f;
		}
		bool weighed = false, sum = true; /* the sum L in the warp's first chunk */
		for (uint32_t j = wk; j < NJ; j += kw) {
			const uint32_t d = 64 * j + 2 * lane;
			const bool in = d < hd;
			float2 v = in ? *(const float2 *)(a.acc + pair * hd + d) : make_float2(0.0f, 0.0f);
			for (uint32_t s0 = 0; s0 < splits; s0 += MERGE_BATCH) {
				float2 pv[MERGE_BATCH];
#pragma unroll
				for (uint32_t i = 0; i < MERGE_BATCH; i++)
					pv[i] = s0 + i < splits && in
							? __ldcg((const float2 *)(a.pacc + ((s0 + i) * pairs + pair) * hd + d))
							: make_float2(0.0f, 0.0f);
				if (!weighed) {
					mx = M;
#pragma unroll
					for (int i = 0; i < 2; i++)
						mx = fmaxf(mx, ms[i]);
					mx = warp_max(mx);
					seen = mx != -INFINITY; /* else nothing seen yet, nothing new */
					wM = M == -INFINITY ? 0.0f : expf(M - mx);
#pragma unroll
					for (int i = 0; i < 2; i++)
						ws[i] = ms[i] != -INFINITY ? expf(ms[i] - mx) : 0.0f;
					L = L0 * wM;
					weighed = true;
				}
				if (!seen)
					break;
				if (s0 == 0) {
					v.x *= wM;
					v.y *= wM;
				}
#pragma unroll
				for (uint32_t i = 0; i < MERGE_BATCH; i++) {
					const uint32_t s = s0 + i; /* the same in every lane */
					if (s >= splits)
						break;
					const float m_s = __shfl_sync(0xffffffffu, s < 32 ? ms[0] : ms[1], s & 31);
					const float w_s = __shfl_sync(0xffffffffu, s < 32 ? ws[0] : ws[1], s & 31);
					const float l_s = __shfl_sync(0xffffffffu, s < 32 ? ls[0] : ls[1], s & 31);
					if (m_s == -INFINITY)
						continue;
					v.x = fmaf(pv[i].x, w_s, v.x);
					v.y = fmaf(pv[i].y, w_s, v.y);
					if (sum)
						L = fmaf(l_s, w_s, L);
				}
			}
			if (!seen)
				break;
			sum = false;
			if (in)
				*(float2 *)(a.acc + pair * hd + d) = v;
		}
	}
	__syncthreads();
	if (active && seen && wk == 0 && lane == 0) {
		a.m[pair] = mx;
		a.l[pair] = L;
	}
}

#define ATTN_LOAD_BATCH 4 /* chunks of K and V a thread loads before it stores any */

/* The spans that hold keys [k0, k1) (k0 < k1 <= pre[n_spans]) and their key offsets, copied from
 * src and pre (the parameters or device memory) into ws and wp (shared memory): the first is
 * found by all threads at once, each testing a few spans (a search by one thread costs a memory
 * round trip per step). Every thread of the block calls it. *first is the span of k0 in src;
 * false where more than ATTN_WINDOW_SPANS spans hold the keys, and nothing is copied. */
static __device__ bool stage_window(const struct kv_span *src, const uint32_t *pre, uint32_t n_spans, uint32_t k0,
				    uint32_t k1, struct kv_span *ws, uint32_t *wp, uint32_t *first)
{
	__shared__ uint32_t s_first;
	for (uint32_t i = threadIdx.x; i < n_spans; i += blockDim.x)
		if (pre[i] <= k0 && k0 < pre[i + 1])
			s_first = i; /* one span holds k0 */
	__syncthreads();
	const uint32_t f = s_first, cnt = min((uint32_t)ATTN_WINDOW_SPANS, n_spans - f);
	*first = f;
	if (pre[f + cnt] < k1)
		return false;
	for (uint32_t i = threadIdx.x; i <= cnt; i += blockDim.x) {
		if (i < cnt)
			ws[i] = src[f + i];
		wp[i] = pre[f + i];
	}
	__syncthreads();
	return true;
}

/* The positions [*qlo, *qhi] of block column qt's queries (nw warps, a query each) among the run's
 * pairs_g (token, head) pairs from position pos0: for the tile skip test. */
static __device__ __forceinline__ void block_positions(const attn_args &a, uint32_t qt, uint32_t nw, uint32_t pairs_g,
						       uint32_t pos0, uint32_t *qlo, uint32_t *qhi)
{
	const uint32_t lp0 = qt * nw, lp1 = min(lp0 + nw, pairs_g);
	*qlo = pos0 + lp0 / a.group;
	*qhi = pos0 + (lp1 - 1) / a.group;
}

/* Warp 0 of a block: the element offset (koff) and position (kpos, UINT32_MAX: none) of each key
 * of the tile at flattened key kb (keys below k1) in kv head g; *s_any: may a query of positions
 * [qlo, qhi] see one of them; *s_cursor: the span of the tile's first key, moved to its last's. */
static __device__ __forceinline__ void tile_keys(const attn_args &a, const struct kv_span *spans,
						 const uint32_t *prefix, uint32_t kb, uint32_t k1, uint32_t g,
						 uint32_t qlo, uint32_t qhi, uint64_t *koff, uint32_t *kpos,
						 uint32_t *s_cursor, int *s_any)
{
	const uint32_t lane = threadIdx.x % 32, hd = a.head_dim;
	uint32_t key = kb + lane, pos = UINT32_MAX, s = *s_cursor;
	uint64_t off = 0;
	if (key < k1) {
		while (key >= prefix[s + 1])
			s++;
		struct kv_span sp = spans[s];
		uint32_t r = key - prefix[s];
		pos = sp.pos0 + r;
		off = sp.block * a.block_elems + (uint64_t)r * a.kv_dim + (uint64_t)g * hd;
	}
	koff[lane] = off;
	kpos[lane] = pos;
	bool any = pos != UINT32_MAX && pos <= qhi && (a.window == 0 || (uint64_t)pos + a.window > qlo);
	unsigned ballot = __ballot_sync(0xffffffffu, any);
	uint32_t last = min(31u, k1 - 1 - kb);
	uint32_t next = __shfl_sync(0xffffffffu, s, last);
	__syncwarp();
	if (lane == 0) {
		*s_any = ballot != 0;
		*s_cursor = next;
	}
}

/* The block's threads copy the K and V rows of the indexed tile's keys at positions [lo, hi) into
 * shared memory (a key that is none, UINT32_MAX, is never below hi).
 * ATTN_LOAD_BATCH chunks of K and V a thread: their loads all go out before any is stored (a tile
 * of BF16 keys of 128 dims in one memory round trip for 4 warps). */
template <typename KT>
static __device__ __forceinline__ void tile_load(const attn_args &a, const uint64_t *koff, const uint32_t *kpos,
						 unsigned char *ks, unsigned char *vs, size_t krow_bytes,
						 size_t vrow_bytes, uint32_t lo, uint32_t hi)
{
	const uint32_t vecs = (uint32_t)(vrow_bytes / 16), n = ATTN_TILE * vecs;
	/* A 16-byte chunk's row and place in it: a shift and a mask where a row is a power of two of
	 * them (head_dim 64, 128, 256), not an integer division a chunk. */
	const bool pow2 = (vecs & (vecs - 1)) == 0;
	const uint32_t shift = __ffs(vecs) - 1;
	uint32_t row[ATTN_LOAD_BATCH], col[ATTN_LOAD_BATCH];
	for (uint32_t i0 = threadIdx.x; i0 < n; i0 += ATTN_LOAD_BATCH * blockDim.x) {
		uint4 kc[ATTN_LOAD_BATCH], vc[ATTN_LOAD_BATCH];
#pragma unroll
		for (uint32_t b = 0; b < ATTN_LOAD_BATCH; b++) {
			const uint32_t i = i0 + b * blockDim.x;
			row[b] = pow2 ? i >> shift : i / vecs;
			col[b] = pow2 ? i & (vecs - 1) : i % vecs;
			const uint32_t r = row[b], c = col[b];
			if (i < n && kpos[r] >= lo && kpos[r] < hi) {
				const KT *kr = (const KT *)a.arena + koff[r];
				const KT *vr = kr + (size_t)a.block_tokens * a.kv_dim;
				kc[b] = ((const uint4 *)kr)[c];
				vc[b] = ((const uint4 *)vr)[c];
			}
		}
#pragma unroll
		for (uint32_t b = 0; b < ATTN_LOAD_BATCH; b++) {
			const uint32_t i = i0 + b * blockDim.x, r = row[b], c = col[b];
			if (i < n && kpos[r] >= lo && kpos[r] < hi) {
				*(uint4 *)(ks + r * krow_bytes + c * 16) = kc[b];
				*(uint4 *)(vs + r * vrow_bytes + c * 16) = vc[b];
			}
		}
	}
}

/* grid (n_kv_heads * qtiles, splits), blockDim.x / 32 = nw * kw warps (kw = KW, 1 or 2).
 * Block (g, qt) serves the queries (token t, head g * group + j) numbered t * group + j in
 * [qt * nw, (qt + 1) * nw), kw warps each: warp w serves query w % nw and takes the tile's keys
 * [(w / nw) * 32 / kw, +32 / kw), a key's score from kw lanes (each the dot product of a share of
 * head_dim's 16-byte chunks, added by a shuffle); the kw warps keep their own running states,
 * merged in shared memory at the end. Split s covers flattened keys [s * keys_per_split,
 * (s + 1) * keys_per_split). Lane d of a warp holds dims 2d, 2d + 1 of each 64 of the
 * accumulator. */
template <typename KT, int NJ, int KW>
__global__ void __launch_bounds__(ATTN_MAX_WARPS * 32) attn_kernel(const __grid_constant__ attn_args a)
{
	extern __shared__ __align__(16) unsigned char smem[];
	__shared__ uint32_t s_cursor;
	__shared__ int s_any;
	constexpr uint32_t kw = KW, kpw = ATTN_TILE / KW; /* warps a query; keys a warp takes of a tile */
	const uint32_t nw = blockDim.x / 32 / kw, w = threadIdx.x / 32, lane = threadIdx.x % 32;
	const uint32_t wq = w % nw, wk = w / nw; /* the warp's query and its share of the keys */
	const uint32_t kl = lane % kpw, part = lane / kpw;
	const uint32_t g = blockIdx.x / a.qtiles, qt = blockIdx.x % a.qtiles, split = blockIdx.y;
	const uint32_t hd = a.head_dim;
	const size_t krow_bytes = hd * sizeof(KT) + 16, vrow_bytes = hd * sizeof(KT); /* +16: no bank conflicts */
	/* The lane's chunks of a key row for its score: [c0, c1) of hd / (16 / sizeof(KT)). */
	const uint32_t chunks = hd * sizeof(KT) / 16, per = (chunks + kw - 1) / kw;
	const uint32_t c0 = min(chunks, part * per), c1 = min(chunks, c0 + per);

	uint64_t *koff = (uint64_t *)smem;			/* (TILE) element offset of each key's K row */
	uint32_t *kpos = (uint32_t *)(koff + ATTN_TILE);	/* (TILE) its position, UINT32_MAX: none */
	unsigned char *ks = (unsigned char *)(kpos + ATTN_TILE); /* (TILE, krow_bytes) */
	unsigned char *vs = ks + ATTN_TILE * krow_bytes;	/* (TILE, vrow_bytes) */
	float *qs = (float *)(vs + ATTN_TILE * vrow_bytes);	/* (nw, hd) */

	/* The span list: in the parameters (decode) or uploaded. The spans of the block's keys are
	 * copied into shared memory (the searches below index them at run time: from the parameters
	 * that is a constant-cache miss each, from device memory a round trip), those in the
	 * parameters before the kernel before has finished. */
	__shared__ struct kv_span s_span[ATTN_WINDOW_SPANS];
	__shared__ uint32_t s_prefix[ATTN_WINDOW_SPANS + 1];
	const struct kv_span *spans = a.inline_spans ? a.span_in : a.spans;
	const uint32_t *prefix = a.inline_spans ? a.prefix_in : a.prefix;
	uint32_t row0 = 0, nr = a.n, pos0 = a.pos0, n_spans = a.n_spans, total_keys = a.total_keys;
	const uint32_t k0 = split * a.keys_per_split;
	uint32_t k1 = min(k0 + a.keys_per_split, total_keys), first = 0;
	bool staged = false;
	ktrace_mark(a.tr, 0);
	if (a.inline_spans && !a.seqs && k0 < k1)
		staged = stage_window(spans, prefix, n_spans, k0, k1, s_span, s_prefix, &first);
	grid_launch_next();
	/* One sequence whose spans are staged: the first tile's keys from before this call's rows
	 * (positions below pos0, written by earlier steps that the host has waited for; the kernels
	 * before write this call's) start coming now, before the wait for the kernel before. */
	const bool early = staged && a.early_keys;
	if (early) {
		uint32_t qlo, qhi;
		block_positions(a, qt, nw, a.n * a.group, pos0, &qlo, &qhi);
		if (threadIdx.x == 0)
			s_cursor = 0;
		__syncthreads();
		if (w == 0)
			tile_keys(a, s_span, s_prefix, k0, k1, g, qlo, qhi, koff, kpos, &s_cursor, &s_any);
		__syncthreads();
		if (s_any)
			tile_load<KT>(a, koff, kpos, ks, vs, krow_bytes, vrow_bytes, 0, pos0);
	}
	grid_wait();
	ktrace_mark(a.tr, 1);
	/* The run of rows this block serves: the call's, or sequence blockIdx.z's of several. */
	if (a.seqs) {
		const struct attn_seq d = a.seqs[blockIdx.z];
		row0 = d.row0;
		nr = d.n;
		pos0 = d.pos0;
		n_spans = d.n_spans;
		total_keys = d.total_keys;
		spans = a.spans + d.span0;
		prefix = a.prefix + d.prefix0;
		k1 = min(k0 + a.keys_per_split, total_keys);
	}
	if (!a.inline_spans && k0 < k1)
		staged = stage_window(spans, prefix, n_spans, k0, k1, s_span, s_prefix, &first);
	if (staged) {
		spans = s_span;
		prefix = s_prefix;
		first = 0;
	}
	const uint32_t pairs_g = nr * a.group, lp0 = qt * nw;
	uint32_t qlo, qhi;
	block_positions(a, qt, nw, pairs_g, pos0, &qlo, &qhi);

	const uint32_t lp = lp0 + wq;
	const bool active = lp < pairs_g;
	const uint32_t t = active ? lp / a.group : 0, h = g * a.group + (active ? lp % a.group : 0);
	const uint32_t qpos = pos0 + t;
	const size_t pair = (size_t)(row0 + t) * a.n_heads + h;
	float *qw = qs + (size_t)wq * hd;
	float m = -INFINITY, l = 0.0f;
	/* The lane's dimensions: 2 lane, 2 lane + 1 of each 64 (NJ of them cover head_dim), those
	 * below head_dim (all of them where it is a multiple of 64). */
	float2 acc[NJ];
	bool dim_in[NJ];
#pragma unroll
	for (int j = 0; j < NJ; j++) {
		acc[j] = make_float2(0.0f, 0.0f);
		dim_in[j] = 64 * j + 2 * lane < hd;
	}
	/* The query, loaded by the first of its warps: its loads all go out before any is stored (one
	 * memory round trip). (Loading this call's keys of the first tile in the same round trip
	 * measured no faster: docs/design.md.) */
	if (active && wk == 0) {
		const float *qg = a.q + (size_t)(row0 + t) * a.q_ld + (size_t)h * hd;
		float qv[2 * NJ];
#pragma unroll
		for (uint32_t j = 0; j < 2 * NJ; j++)
			qv[j] = 32 * j + lane < hd ? qg[32 * j + lane] : 0.0f;
#pragma unroll
		for (uint32_t j = 0; j < 2 * NJ; j++)
			if (32 * j + lane < hd)
				qw[32 * j + lane] = qv[j];
		if (!a.pm) {
			/* The running state goes on in the first of the query's warps. */
			m = a.m[pair];
			l = a.l[pair];
#pragma unroll
			for (int j = 0; j < NJ; j++) {
				uint32_t d = 64 * j + 2 * lane;
				if (d < hd)
					acc[j] = *(const float2 *)(a.acc + pair * hd + d);
			}
		}
	}
	if (threadIdx.x == 0 && !early)
		s_cursor = first;
	__syncthreads();
	ktrace_mark(a.tr, 2); /* the queries and running states in */

	/* The lane's V pair of a row: its address once, a row's j-th 64 dims 64 elements on. */
	const unsigned char *vlane = vs + 2 * lane * sizeof(KT) + (size_t)wk * kpw * vrow_bytes;
	for (uint32_t kb = k0; kb < k1; kb += ATTN_TILE) {
		const bool pre = early && kb == k0; /* its keys indexed, the older ones loaded */
		if (w == 0 && !pre)
			tile_keys(a, spans, prefix, kb, k1, g, qlo, qhi, koff, kpos, &s_cursor, &s_any);
		__syncthreads();
		const bool any = s_any;
		if (any)
			tile_load<KT>(a, koff, kpos, ks, vs, krow_bytes, vrow_bytes, pre ? pos0 : 0u, UINT32_MAX);
		__syncthreads();
		if (any && active) {
			const uint32_t r = wk * kpw + kl; /* the lane's key of the tile */
			const uint32_t pos = kpos[r];
			const bool vis = pos <= qpos && (a.window == 0 || qpos - pos < a.window);
			float sc = vis ? qk_dot(qw, ks + r * krow_bytes, c0, c1, KT()) : 0.0f;
			if (kw == 2) /* the key's two lanes: the same sum in both */
				sc += __shfl_xor_sync(0xffffffffu, sc, 16);
			sc = vis ? sc * a.scale : -INFINITY;
			float tmax = warp_max(sc);
			if (tmax != -INFINITY) {
				float mnew = fmaxf(m, tmax);
				float corr = expf(m - mnew); /* m = -inf at first: 0 */
				float pr = vis ? expf(sc - mnew) : 0.0f;
				l = l * corr + warp_sum(part == 0 ? pr : 0.0f);
#pragma unroll
				for (int j = 0; j < NJ; j++) {
					acc[j].x *= corr;
					acc[j].y *= corr;
				}
				for (uint32_t rr = 0; rr < kpw; rr++) {
					float pj = __shfl_sync(0xffffffffu, pr, rr);
					if (pj == 0.0f)
						continue;
					const unsigned char *vrow = vlane + rr * vrow_bytes;
#pragma unroll
					for (int j = 0; j < NJ; j++) {
						if (dim_in[j]) {
							float2 v = v_pair(vrow, 64 * j, KT());
							acc[j].x = fmaf(pj, v.x, acc[j].x);
							acc[j].y = fmaf(pj, v.y, acc[j].y);
						}
					}
				}
				m = mnew;
			}
		}
		__syncthreads();
	}

	/* The second warp of each query hands its state to the first through shared memory (the
	 * key tile's, no longer read): (nw, 2 + hd) floats. */
	if (kw == 2) {
		float *st = (float *)ks + (size_t)wq * (hd + 2);
		if (active && wk == 1) {
			if (lane == 0) {
				st[0] = m;
				st[1] = l;
			}
#pragma unroll
			for (int j = 0; j < NJ; j++)
				if (dim_in[j])
					*(float2 *)(st + 2 + 64 * j + 2 * lane) = acc[j];
		}
		__syncthreads();
		if (active && wk == 0) {
			const float m1 = st[0], l1 = st[1], mx = fmaxf(m, m1);
			if (mx != -INFINITY) {
				const float w0 = m == -INFINITY ? 0.0f : expf(m - mx);
				const float w1 = m1 == -INFINITY ? 0.0f : expf(m1 - mx);
				l = fmaf(l1, w1, l * w0);
#pragma unroll
				for (int j = 0; j < NJ; j++) {
					if (dim_in[j]) {
						const float2 o = *(const float2 *)(st + 2 + 64 * j + 2 * lane);
						acc[j].x = fmaf(o.x, w1, acc[j].x * w0);
						acc[j].y = fmaf(o.y, w1, acc[j].y * w0);
					}
				}
				m = mx;
			}
		}
	}

	float *om = a.m, *ol = a.l, *oacc = a.acc;
	size_t slot = pair;
	if (a.pm) {
		om = a.pm;
		ol = a.pl;
		oacc = a.pacc;
		slot = (size_t)split * a.n * a.n_heads + pair;
	}
	if (active && wk == 0) {
		if (lane == 0) {
			om[slot] = m;
			ol[slot] = l;
		}
#pragma unroll
		for (int j = 0; j < NJ; j++) {
			uint32_t d = 64 * j + 2 * lane;
			if (dim_in[j])
				*(float2 *)(oacc + slot * hd + d) = acc[j];
		}
	}
	if (!a.pm || !a.merge_count) {
		ktrace_end(a.tr);
		return; /* one split, or attn_combine_kernel merges */
	}
	/* The last split block of this (kv head, query tile) to finish merges every split's state
	 * into the running state, as attn_combine_kernel would (the same operations in the same
	 * order), and resets the block's counter for the next call. */
	__shared__ uint32_t s_last;
	__threadfence();
	__syncthreads();
	const uint32_t column = blockIdx.z * gridDim.x + blockIdx.x;
	if (threadIdx.x == 0)
		s_last = atomicAdd(&a.merge_count[column], 1u) == gridDim.y - 1;
	__syncthreads();
	if (!s_last) {
		ktrace_end(a.tr);
		return;
	}
	__threadfence();
	if (threadIdx.x == 0)
		a.merge_count[column] = 0;
	merge_splits<NJ>(a, pair, gridDim.y, active, wk, kw, lane);
	ktrace_end(a.tr);
}

/* Folds the splits' partial states into the running state: one block per (token, head), a
 * thread per dimension. The splits' maxima, sums and weights exp(m_s - max) are read and computed
 * once per block, in parallel, into shared memory; each dimension then reads its splits'
 * accumulators as independent loads and folds them in split order (the same float32 operations,
 * in the same order, as a serial merge). */
#define COMBINE_THREADS 128
static_assert(ATTN_MAX_SPLITS <= COMBINE_THREADS, "one thread per split reads its state");
__global__ void __launch_bounds__(COMBINE_THREADS) attn_combine_kernel(float *m, float *l, float *acc, const float *pm,
								       const float *pl, const float *pacc,
								       uint32_t pairs, uint32_t splits, uint32_t hd)
{
	__shared__ float sm[ATTN_MAX_SPLITS], sw[ATTN_MAX_SPLITS], sl[ATTN_MAX_SPLITS];
	const uint32_t pair = blockIdx.x, t = threadIdx.x;
	grid_launch_next();
	grid_wait();
	const float M = m[pair];
	if (t < splits) {
		sm[t] = pm[(size_t)t * pairs + pair];
		sl[t] = pl[(size_t)t * pairs + pair];
	}
	__syncthreads();
	float mx = M;
	for (uint32_t s = 0; s < splits; s++)
		mx = fmaxf(mx, sm[s]);
	if (mx == -INFINITY)
		return; /* nothing seen yet, nothing new (the same for every thread) */
	const float wM = M == -INFINITY ? 0.0f : expf(M - mx);
	if (t < splits)
		sw[t] = sm[t] != -INFINITY ? expf(sm[t] - mx) : 0.0f;
	__syncthreads(); /* also: every thread has read m[pair] before it changes */
	for (uint32_t d = t; d < hd; d += blockDim.x) {
		float v = acc[(size_t)pair * hd + d] * wM;
		const float *pa = pacc + (size_t)pair * hd + d;
		uint32_t s = 0;
		for (; s + 8 <= splits; s += 8) {
			float pv[8];
#pragma unroll
			for (uint32_t i = 0; i < 8; i++)
				pv[i] = pa[(size_t)(s + i) * pairs * hd];
#pragma unroll
			for (uint32_t i = 0; i < 8; i++)
				if (sm[s + i] != -INFINITY)
					v = fmaf(pv[i], sw[s + i], v);
		}
		for (; s < splits; s++)
			if (sm[s] != -INFINITY)
				v = fmaf(pa[(size_t)s * pairs * hd], sw[s], v);
		acc[(size_t)pair * hd + d] = v;
	}
	if (t == 0) {
		float L = l[pair] * wM;
		for (uint32_t s = 0; s < splits; s++)
			if (sm[s] != -INFINITY)
				L = fmaf(sl[s], sw[s], L);
		m[pair] = mx;
		l[pair] = L;
	}
}

/* ---- launches ------------------------------------------------------------------------------- */

template <typename KT, int NJ> static cudaError_t allow_nj(size_t bytes)
{
	cudaError_t e = cudaFuncSetAttribute(attn_kernel<KT, NJ, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
					     (int)bytes);
	if (e == cudaSuccess)
		e = cudaFuncSetAttribute(attn_kernel<KT, NJ, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
	return e;
}

template <typename KT> static cudaError_t allow_kt(size_t bytes)
{
	cudaError_t e;
	if ((e = allow_nj<KT, 1>(bytes)) || (e = allow_nj<KT, 2>(bytes)) || (e = allow_nj<KT, MAX_HEAD_DIM / 64>(bytes)))
		return e;
	return cudaSuccess;
}

cudaError_t attn_allow_smem(uint32_t kv_dtype, size_t bytes)
{
	return kv_dtype == DT_BF16 ? allow_kt<__nv_bfloat16>(bytes) : allow_kt<float>(bytes);
}

template <typename KT, int NJ>
static void launch_nj(const struct backend_dev *be, const attn_args &a, dim3 grid, uint32_t threads, uint32_t kw,
		      size_t smem)
{
	if (kw == 2)
		launch_k(be->pdl, attn_kernel<KT, NJ, 2>, grid, threads, smem, be->stream, a);
	else
		launch_k(be->pdl, attn_kernel<KT, NJ, 1>, grid, threads, smem, be->stream, a);
}

/* head_dim's chunks of 64 dimensions: 1, 2, or up to MAX_HEAD_DIM / 64 (the lanes' accumulators
 * and loops are those a head needs). */
template <typename KT>
static void launch_kt(const struct backend_dev *be, const attn_args &a, dim3 grid, uint32_t threads, uint32_t kw,
		      size_t smem)
{
	const uint32_t hd = be->cfg.head_dim;
	if (hd <= 64)
		launch_nj<KT, 1>(be, a, grid, threads, kw, smem);
	else if (hd <= 128)
		launch_nj<KT, 2>(be, a, grid, threads, kw, smem);
	else
		launch_nj<KT, MAX_HEAD_DIM / 64>(be, a, grid, threads, kw, smem);
}

/* attn_kernel for the arena's dtype, nw queries a block: two warps each where the block has room
 * (be->attn_key_warps), else one. Returns the warps a query it launched with. */
uint32_t attn_launch(const struct backend_dev *be, const attn_args &a, dim3 grid, uint32_t nw)
{
	const uint32_t kw = be->attn_key_warps == 2 && 2 * nw <= ATTN_MAX_WARPS ? 2 : 1;
	const uint32_t threads = nw * kw * 32;
	const size_t smem = attn_smem_bytes(be->cfg.head_dim, be->kv_esize, nw);
	if (be->p.kv_dtype == DT_BF16)
		launch_kt<__nv_bfloat16>(be, a, grid, threads, kw, smem);
	else
		launch_kt<float>(be, a, grid, threads, kw, smem);
	return kw;
}

void attn_combine_launch(const struct backend_dev *be, uint32_t pairs, uint32_t splits, float *m, float *l, float *acc)
{
	launch_k(be->pdl, attn_combine_kernel, pairs, COMBINE_THREADS, 0, be->stream, m, l, acc, (const float *)be->pm,
		 (const float *)be->pl, (const float *)be->pacc, pairs, splits, be->cfg.head_dim);
}

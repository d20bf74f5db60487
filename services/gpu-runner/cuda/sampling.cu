/* sampling.cu - the last step of a decode token on the device: the argmax of the logits, or a
 * draw with temperature, top-k, top-p and min-p (semantics: backend.h, backend_logits_sample),
 * so only a token id crosses the bus. The argmax runs on many blocks, the sampler on one block of
 * 1024 threads. */
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cuda/device.cuh"


/* The id of the largest value, lowest id on ties; NaN loses to everything (all NaN: 0). Many
 * blocks: a value and its id packed into one key whose unsigned order is that order (the value's
 * bits ordered as integers, -0 as +0, then ~id; NaN is key 0), each block's largest key folded
 * into st->best with an atomic maximum; the last block to finish (st->done counts them) writes the
 * token and resets both for the next call. */
#define ARGMAX_THREADS 256
#define ARGMAX_BLOCKS 128

static __device__ __forceinline__ unsigned long long argmax_key(float x, uint32_t i)
{
	if (isnan(x))
		return 0;
	uint32_t u = x == 0.0f ? 0u : __float_as_uint(x);
	u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
	return (unsigned long long)u << 32 | (uint32_t)~i;
}

static __device__ __forceinline__ unsigned long long max_u64(unsigned long long a, unsigned long long b)
{
	return a > b ? a : b;
}

__global__ void __launch_bounds__(ARGMAX_THREADS) argmax_kernel(const float *v, uint32_t n, struct dev_status *st)
{
	__shared__ unsigned long long wk[ARGMAX_THREADS / 32];
	unsigned long long k = 0;
	for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
		k = max_u64(k, argmax_key(v[i], i));
	for (int o = 16; o > 0; o >>= 1)
		k = max_u64(k, __shfl_xor_sync(0xffffffffu, k, o));
	if (threadIdx.x % 32 == 0)
		wk[threadIdx.x / 32] = k;
	__syncthreads();
	if (threadIdx.x == 0) {
		for (uint32_t w = 1; w < blockDim.x / 32; w++)
			k = max_u64(k, wk[w]);
		atomicMax(&st->best, k);
		__threadfence(); /* the maximum lands before the count says so */
		if (atomicAdd(&st->done, 1u) == gridDim.x - 1) {
			const unsigned long long b = atomicExch(&st->best, 0ull);
			st->token = b ? (int32_t)~(uint32_t)b : 0;
			st->done = 0;
		}
	}
}

/* ---- sampling (one block) ---------------------------------------------------------------- */

/* Floats to unsigned integers in the same order (for bisection over the bits). */
static __device__ __forceinline__ uint32_t ord_of(float f)
{
	uint32_t u = __float_as_uint(f);
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
static __device__ __forceinline__ float float_of(uint32_t o)
{
	return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

/* Block-wide sum of a double (blockDim.x == 1024). */
static __device__ double block_sum(double v, double *sh)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	__syncthreads();
	if (threadIdx.x % 32 == 0)
		sh[threadIdx.x / 32] = v;
	__syncthreads();
	if (threadIdx.x < 32) {
		v = sh[threadIdx.x];
		for (int o = 16; o > 0; o >>= 1)
			v += __shfl_xor_sync(0xffffffffu, v, o);
		if (threadIdx.x == 0)
			sh[0] = v;
	}
	__syncthreads();
	double r = sh[0];
	__syncthreads();
	return r;
}

/* Logits in v (n of them) to one sampled token (semantics: backend.h, logits_sample). */
__global__ void __launch_bounds__(1024) sample_kernel(const float *v, uint32_t n, float inv_t, uint32_t top_k,
							float top_p, float min_p, double u, struct dev_status *st)
{
	__shared__ double sh[32];
	__shared__ double pre[1024];
	const uint32_t T = blockDim.x, t = threadIdx.x;
	if (t == 0)
		st->token = -1; /* set below by the one thread whose run holds the draw */
	/* max of z */
	float mx = -INFINITY;
	for (uint32_t i = t; i < n; i += T) {
		float z = v[i] * inv_t;
		if (z > mx)
			mx = z;
	}
	for (int o = 16; o > 0; o >>= 1)
		mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
	__shared__ float shm[32];
	if (t % 32 == 0)
		shm[t / 32] = mx;
	__syncthreads();
	if (t == 0) {
		for (uint32_t w = 1; w < T / 32; w++)
			shm[0] = fmaxf(shm[0], shm[w]);
	}
	__syncthreads();
	mx = shm[0];
	if (!(mx > -INFINITY)) { /* every logit is -inf or NaN */
		if (t == 0)
			st->token = 0;
		return;
	}
	/* top-k: the largest z threshold with at least k values at or above it (exact, by bits). */
	uint32_t zlo = 0; /* ord of the threshold; 0 keeps everything */
	if (top_k > 0 && top_k < n) {
		uint32_t lo = 0, hi = ord_of(mx); /* invariant: count(>= float_of(lo)) >= k */
		while (lo < hi) {
			uint32_t mid = lo + (hi - lo + 1) / 2;
			float th = float_of(mid);
			double c = 0;
			for (uint32_t i = t; i < n; i += T)
				c += v[i] * inv_t >= th ? 1.0 : 0.0;
			if (block_sum(c, sh) >= (double)top_k)
				lo = mid;
			else
				hi = mid - 1;
		}
		zlo = lo;
	}
	const float zth = zlo ? float_of(zlo) : -INFINITY;
	/* An infinite maximum (the host's sampler, sampler.c, does the same): the infinite candidates
	 * alone, equally; exp(inf - inf) would weigh every one NaN, and no token would be drawn. */
	const bool inf_max = mx == INFINITY;
#define WEIGHT(i)                                                                                          \
	(v[(i)] * inv_t >= zth && !isnan(v[(i)])                                                          \
		 ? (inf_max ? (v[(i)] * inv_t == INFINITY ? 1.0f : 0.0f) : expf(v[(i)] * inv_t - mx))     \
		 : 0.0f)
	/* top-p: the largest weight threshold whose kept mass still reaches top_p of the total. */
	float wth = 0.0f;
	if (top_p > 0.0f && top_p < 1.0f) {
		double tot = 0;
		for (uint32_t i = t; i < n; i += T)
			tot += WEIGHT(i);
		double need = (double)top_p * block_sum(tot, sh);
		uint32_t lo = 0, hi = ord_of(1.0f); /* weights lie in [0, 1] */
		while (lo < hi) {
			uint32_t mid = lo + (hi - lo + 1) / 2;
			float th = float_of(mid);
			double m = 0;
			for (uint32_t i = t; i < n; i += T) {
				float w = WEIGHT(i);
				m += w >= th ? w : 0.0f;
			}
			if (block_sum(m, sh) >= need)
				lo = mid;
			else
				hi = mid - 1;
		}
		wth = float_of(lo);
		if (wth < 0.0f)
			wth = 0.0f;
	}
	if (min_p > 0.0f)
		wth = fmaxf(wth, fminf(min_p, 1.0f));
	/* The draw: each thread owns a contiguous run of ids; prefix sums across the block. */
	uint32_t per = (n + T - 1) / T, a = t * per, b = a + per < n ? a + per : n;
	double mine = 0;
	int32_t last = -1;
	for (uint32_t i = a; i < b; i++) {
		float w = WEIGHT(i);
		if (w > 0.0f && w >= wth) {
			mine += w;
			last = (int32_t)i;
		}
	}
	pre[t] = mine;
	__syncthreads();
	if (t == 0) {
		double run = 0;
		for (uint32_t i = 0; i < T; i++) {
			double x = pre[i];
			pre[i] = run;
			run += x;
		}
		sh[0] = run;
	}
	__syncthreads();
	double total = sh[0], target = u * total;
	if (mine > 0 && target >= pre[t] && (target < pre[t] + mine || (t == T - 1 || pre[t] + mine >= total))) {
		double run = pre[t];
		int32_t pick = last;
		for (uint32_t i = a; i < b; i++) {
			float w = WEIGHT(i);
			if (w > 0.0f && w >= wth) {
				run += w;
				if (target < run) {
					pick = (int32_t)i;
					break;
				}
			}
		}
		st->token = pick;
	}
#undef WEIGHT
}
void argmax_launch(const float *v, uint32_t n, struct dev_status *st, cudaStream_t s)
{
	argmax_kernel<<<ARGMAX_BLOCKS, ARGMAX_THREADS, 0, s>>>(v, n, st);
}

void sample_launch(const float *v, uint32_t n, float inv_t, uint32_t top_k, float top_p, float min_p, double u,
		   struct dev_status *st, cudaStream_t s)
{
	sample_kernel<<<1, 1024, 0, s>>>(v, n, inv_t, top_k, top_p, min_p, u, st);
}

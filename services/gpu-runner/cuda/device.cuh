/* device.cuh - device helpers the kernels share: conversions between float32 and the 16-bit
 * types, element reads of any enum dtype, warp reductions, SiLU as the reference rounds it. */
#ifndef GPU_RUNNER_CUDA_DEVICE_CUH
#define GPU_RUNNER_CUDA_DEVICE_CUH
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "common/dtype.h"
#include "services/gpu-runner/cuda/cuda_internal.h"

template <typename T> static __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v)
{
	return v;
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v)
{
	return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v)
{
	return __float2half_rn(v);
}

static __device__ __forceinline__ float to_f32(float v)
{
	return v;
}
static __device__ __forceinline__ float to_f32(__nv_bfloat16 v)
{
	return __bfloat162float(v);
}
static __device__ __forceinline__ float to_f32(__half v)
{
	return __half2float(v);
}

static __device__ __forceinline__ float2 to_f32x2(__nv_bfloat162 v)
{
	return __bfloat1622float2(v);
}
static __device__ __forceinline__ float2 to_f32x2(__half2 v)
{
	return __half22float2(v);
}

/* The pair type of a 16-bit element type. */
template <typename T> struct pair_of;
template <> struct pair_of<__nv_bfloat16> {
	typedef __nv_bfloat162 type;
};
template <> struct pair_of<__half> {
	typedef __half2 type;
};

/* Element i of a vector of any enum dtype (norm weights), as float32. */
static __device__ __forceinline__ float load_any(const void *p, uint32_t dt, size_t i)
{
	if (dt == DT_BF16)
		return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
	if (dt == DT_F16)
		return __half2float(((const __half *)p)[i]);
	return ((const float *)p)[i];
}

static __device__ __forceinline__ float warp_sum(float v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

static __device__ __forceinline__ float warp_max(float v)
{
	for (int o = 16; o > 0; o >>= 1)
		v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
	return v;
}

/* Programmatic dependent launch (sm_90; launch_k in cuda_internal.h). A kernel launched with it
 * may start while the kernel before it in the stream still runs: grid_wait() blocks until that
 * kernel has completed and its writes are visible, so a kernel calls it before it reads anything
 * an earlier kernel wrote and before it writes anything an earlier kernel reads; what comes before
 * it may only read what no kernel of the step writes (weights). grid_launch_next() lets the next
 * kernel in the stream launch (its blocks start as resources free up, then wait in grid_wait).
 * Both are no-ops for a kernel launched without the attribute. */
static __device__ __forceinline__ void grid_wait(void)
{
	asm volatile("griddepcontrol.wait;" ::: "memory");
}

static __device__ __forceinline__ void grid_launch_next(void)
{
	asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

/* bench-kernels --trace (struct ktrace): thread 0 of a block stamps point p (KTRACE_POINTS) of its
 * row; every warp's lane 0 stamps the end, the latest kept. A uniform test of a parameter where
 * tracing is off. */
static __device__ __forceinline__ unsigned long long ktrace_now(void)
{
	unsigned long long t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	return t;
}

static __device__ __forceinline__ unsigned long long *ktrace_row(const struct ktrace &tr)
{
	const uint32_t b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
	return b < KTRACE_MAX_BLOCKS ? tr.t + (size_t)b * KTRACE_POINTS : NULL;
}

static __device__ __forceinline__ void ktrace_mark(const struct ktrace &tr, uint32_t p)
{
	if (tr.t && threadIdx.x == 0) {
		unsigned long long *r = ktrace_row(tr);
		if (r) {
			r[p] = ktrace_now();
			if (p == 0) {
				uint32_t sm;
				asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
				r[KTRACE_SM] = sm + 1ull;
			}
		}
	}
}

static __device__ __forceinline__ void ktrace_end(const struct ktrace &tr)
{
	if (tr.t && threadIdx.x % 32 == 0) {
		unsigned long long *r = ktrace_row(tr);
		if (r)
			atomicMax(r + KTRACE_END, ktrace_now());
	}
}

/* v[j] for a run-time j, by branches: a run-time index into a kernel's parameters would copy them
 * to local memory. */
template <typename T, int N> static __device__ __forceinline__ T pick_mat(const T (&v)[N], uint32_t j)
{
	T r = v[0];
#pragma unroll
	for (int i = 1; i < N; i++)
		if (j == (uint32_t)i)
			r = v[i];
	return r;
}

/* Matrix j of a launch over several (gemv_mats): its weights (SWIGLU: gate's), and up's; from the
 * parameters, or from device memory where a kernel before chose them (wd). */
static __device__ __forceinline__ const void *mats_w(const struct gemv_mats &m, uint32_t j)
{
	return m.wd ? m.wd[j] : pick_mat(m.w, j);
}

static __device__ __forceinline__ const void *mats_up(const struct gemv_mats &m, uint32_t j)
{
	return m.wd ? m.wd[GEMV_MATS + j] : pick_mat(m.w2, j);
}

/* silu(g) * u as the reference: silu in double rounded to float32, then the float32 product. */
static __device__ __forceinline__ float silu_mul(float g, float u)
{
	float s = (float)((double)g / (1.0 + exp(-(double)g)));
	return __fmul_rn(s, u);
}

#endif

/* dequant.cu - rows of a block-quantized matrix (GGUF's Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) widened on
 * the device: into BF16 for the tensor-core products of prefill (matmul.cu multiplies the
 * scratch with cuBLAS a row chunk at a time), and into float32 for embedding rows. Each value is
 * the same float32 as the C dequantizer gives (quant.cuh), then rounded to BF16 where that is the
 * output. Memory-bound: the quantized bytes are read once and the output written once, a thread
 * per 32 or 64 values with 16-byte stores. */
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cuda/quant.cuh"

static __device__ __forceinline__ void store_values(float *dst, const float *y, int n)
{
#pragma unroll
	for (int i = 0; i < n; i += 4)
		*(float4 *)(dst + i) = make_float4(y[i], y[i + 1], y[i + 2], y[i + 3]);
}

static __device__ __forceinline__ void store_values(__nv_bfloat16 *dst, const float *y, int n)
{
#pragma unroll
	for (int i = 0; i < n; i += 8) {
		uint4 v;
		__nv_bfloat162 p[4];
#pragma unroll
		for (int k = 0; k < 4; k++)
			p[k] = __floats2bfloat162_rn(y[i + 2 * k], y[i + 2 * k + 1]);
		memcpy(&v, p, sizeof(v));
		*(uint4 *)(dst + i) = v;
	}
}

/* One thread per unit (dq_unit<F>): unit u of the matrix is block (u / UNITS) of its row, part
 * u % UNITS. out is (rows, cols), row-major. */
template <int F, typename TO, bool A16>
__global__ void __launch_bounds__(256) dequant_kernel(const uint8_t *src, uint64_t row_bytes, uint32_t nb,
						       uint64_t units, TO *out, uint32_t cols)
{
	typedef dq_unit<F> U;
	for (uint64_t u = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; u < units;
	     u += (uint64_t)gridDim.x * blockDim.x) {
		const uint64_t per_row = (uint64_t)nb * U::UNITS;
		const uint64_t row = u / per_row;
		const uint32_t rem = (uint32_t)(u % per_row), b = rem / U::UNITS, j = rem % U::UNITS;
		float y[U::VALUES];
		U::template run<A16>(src + row * row_bytes + (uint64_t)b * U::BLOCK_BYTES, j, y);
		store_values(out + row * cols + (uint64_t)b * U::BLOCK_ELEMS + (uint64_t)j * U::VALUES, y, U::VALUES);
	}
}

template <int F, typename TO>
static void dequant_f(const void *src, uint64_t row_bytes, uint32_t rows, uint32_t cols, TO *out, cudaStream_t s)
{
	typedef dq_unit<F> U;
	const uint32_t nb = cols / U::BLOCK_ELEMS;
	const uint64_t units = (uint64_t)rows * nb * U::UNITS;
	/* Small matrices (an expert's) in blocks of 64 threads, so that their few units reach every
	 * multiprocessor: 768 x 2048 Q4_K is 24576 units, 96 blocks of 256. */
	const unsigned threads = units < 256u * 512u ? 64 : 256, grid = grid_for(units, threads);
	/* 16-byte loads where every block is 16-byte aligned: the K formats of 144 and 176 bytes on
	 * an aligned tensor (row_bytes is then a multiple of 16 too). */
	const bool a16 = (F == DT_Q4_K || F == DT_Q5_K) && (((uintptr_t)src | row_bytes) % 16) == 0;
	if (a16)
		dequant_kernel<F, TO, true><<<grid, threads, 0, s>>>((const uint8_t *)src, row_bytes, nb, units, out, cols);
	else
		dequant_kernel<F, TO, false><<<grid, threads, 0, s>>>((const uint8_t *)src, row_bytes, nb, units, out, cols);
}

template <typename TO>
static void dequant_to(uint32_t fmt, const void *src, uint64_t row_bytes, uint32_t rows, uint32_t cols, TO *out,
		       cudaStream_t s)
{
	switch (fmt) {
	case DT_Q8_0:
		dequant_f<DT_Q8_0, TO>(src, row_bytes, rows, cols, out, s);
		break;
	case DT_Q4_0:
		dequant_f<DT_Q4_0, TO>(src, row_bytes, rows, cols, out, s);
		break;
	case DT_Q4_K:
		dequant_f<DT_Q4_K, TO>(src, row_bytes, rows, cols, out, s);
		break;
	case DT_Q5_K:
		dequant_f<DT_Q5_K, TO>(src, row_bytes, rows, cols, out, s);
		break;
	default:
		dequant_f<DT_Q6_K, TO>(src, row_bytes, rows, cols, out, s);
		break;
	}
}

void dequant_launch(uint32_t fmt, const void *src, uint64_t row_bytes, uint32_t rows, uint32_t cols, void *out,
		    uint32_t ot, cudaStream_t s)
{
	if (ot == DT_F32)
		dequant_to<float>(fmt, src, row_bytes, rows, cols, (float *)out, s);
	else
		dequant_to<__nv_bfloat16>(fmt, src, row_bytes, rows, cols, (__nv_bfloat16 *)out, s);
}

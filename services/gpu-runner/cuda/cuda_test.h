/* cuda_test.h - test hooks into the CUDA backend, for tests/unit/gpu-runner/test_cuda_quant.c:
 * one matrix product through the backend's own dispatch (the kernels a forward step uses for
 * that format and token count: the quantized GEMV, or dequantization and cuBLAS), and a read of
 * the residual stream after embed; for test_cuda_ffn_split.c, a failure of the CPU share, and for
 * test_cuda_moe_cpu.c one of a routed expert computed by the CPU; for test_cuda_experts.c a layer's
 * experts computed together and apart. C callable; built with the CUDA backend only. */
#ifndef GPU_RUNNER_CUDA_TEST_H
#define GPU_RUNNER_CUDA_TEST_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "services/gpu-runner/backend.h"
#ifdef __cplusplus
extern "C" {
#endif

enum cuda_test_mode {
	CUDA_TEST_STORE = 0,  /* out[t][o] = W0[o] . x[t] */
	CUDA_TEST_ADD = 1,    /* out[t][o] += W0[o] . x[t] */
	CUDA_TEST_SWIGLU = 2, /* out[t][o] = silu(W0[o] . x[t]) * (W1[o] . x[t]), in the activation dtype */
};

struct cuda_test_product {
	uint32_t format;   /* enum dtype of W0 and W1 */
	const void *w[2];  /* device memory: (rows, cols) each, dtype_row_bytes(format, cols) per row; w[1] for SwiGLU */
	uint32_t rows, cols;
	uint32_t n;	   /* tokens */
	uint32_t mode;	   /* enum cuda_test_mode */
	const float *x;	   /* host (n, cols): rounded to the activation dtype as the backend rounds its inputs */
	float *out;	   /* host (n, rows): the result (ADD: also the addend) */
};

/* Runs the product on be's compute stream with buffers of its own and waits for it. be must be
 * a "cuda" backend. Returns 0, or -EINVAL (another backend, zero sizes), -ENOMEM, -EIO, -ENOTSUP
 * with a message in err. */
int cuda_test_matmul(struct backend *be, const struct cuda_test_product *t, char *err, size_t errlen);
/* Up to GEMV_MATS (8) experts of one token, computed together (experts_batch: one launch for their
 * gate/up, one for their down) and each on its own (swiglu_product, matmul), as cuda/moe.cu does
 * either way. */
struct cuda_test_experts {
	uint32_t gate_format;	/* enum dtype of gate and up */
	uint32_t down_format;	/* enum dtype of down (the same activation dtype) */
	uint32_t n, dim, F;	/* experts; gate/up (F, dim) each, down (dim, F) */
	const void *gate[8], *up[8], *down[8]; /* device memory, rows packed */
	const float *x;		/* host (dim): rounded to the activation dtype as the backend rounds it */
	float *together;	/* host (n, dim): each expert's down row, computed together */
	float *apart;		/* host (n, dim): the same, each on its own */
};
/* Runs both on be's compute stream with buffers of its own and waits. Returns 0, -ENOTSUP where
 * the experts cannot go together (expert_batch_fits), or -EINVAL, -ENOMEM, -EIO with a message in
 * err. */
int cuda_test_experts_together(struct backend *be, const struct cuda_test_experts *t, char *err, size_t errlen);
/* Copies rows [0, n) of the residual stream (n x dim float32, what embed wrote) to host out
 * and waits. Returns 0 or -EINVAL / -EIO with a message in err. */
int cuda_test_residual(struct backend *be, float *out, uint32_t n, char *err, size_t errlen);
/* The device's sampler (backend.h's logits_sample) on logits given here (host, vocab_size floats):
 * *token is what it drew (-1: none). Returns 0, or -EINVAL / -EIO with a message in err. */
int cuda_test_sample(struct backend *be, const float *logits, float temperature, uint32_t top_k, float top_p,
		     float min_p, double u, int32_t *token, char *err, size_t errlen);
/* The nth job of a split FFN's CPU share from now on (1: the next; 0: none) fails its first part
 * with -EIO "an injected failure". Returns 0, or -EINVAL (not a cuda backend, or one without a CPU
 * share) with a message in err. */
int cuda_test_fail_cpu_share(struct backend *be, uint32_t nth, char *err, size_t errlen);
/* The nth routed expert the CPU pool computes from now on (1: the next; 0: none) fails its job's
 * first part with -EIO "an injected failure". Returns 0, or -EINVAL (not a cuda backend, or one
 * without experts on the CPU: a dense config or no CPU pool) with a message in err. */
int cuda_test_fail_cpu_expert(struct backend *be, uint32_t nth, char *err, size_t errlen);
/* Kernels a one-token step of a dense layer leaves out (cuda_test_leave_out), to time a step
 * without them as the others run (bench-kernels --without): the results are wrong. */
enum cuda_test_part {
	CUDA_TEST_QKV = 1,    /* the q/k/v products */
	CUDA_TEST_ROPE = 2,   /* rope_kernel: RoPE, K and V into the arena, the attention state reset */
	CUDA_TEST_ATTN = 4,   /* the attention (and rope_kernel: a state reset and never visited is
			       * reported as a query that saw no keys) */
	CUDA_TEST_OPROJ = 8,  /* o_proj */
	CUDA_TEST_GATEUP = 16, /* gate/up with SwiGLU */
	CUDA_TEST_DOWN = 32,  /* down */
};
/* From the next step on, one-token steps leave out the kernels of parts (enum cuda_test_part, or'ed;
 * 0: none). Returns 0, or -EINVAL (not a cuda backend, an unknown part) with a message in err. */
int cuda_test_leave_out(struct backend *be, uint32_t parts, char *err, size_t errlen);
/* Attention launches since create that may load the keys of earlier steps before they wait for the
 * kernel before (attn_args.early_keys), or -EINVAL (not a cuda backend) with a message in err. */
int64_t cuda_test_early_kv_launches(struct backend *be, char *err, size_t errlen);
/* attn_kernel launches since create with two warps a query (attn_launch), or -EINVAL (not
 * a cuda backend) with a message in err. */
int64_t cuda_test_two_warp_launches(struct backend *be, char *err, size_t errlen);
/* One-token integer products launched since create in wide blocks (several row groups a block,
 * x staged once for them), or -EINVAL (not a cuda backend) with a message in err. */
int64_t cuda_test_wide_launches(struct backend *be, char *err, size_t errlen);
/* ... of them with their row-group blocks apart (BACKEND_FUSE_ROWS_APART). */
int64_t cuda_test_apart_launches(struct backend *be, char *err, size_t errlen);
/* One-token integer products launched since create with parts in two formats in one launch
 * (dq_mix_kernel), or -EINVAL (not a cuda backend) with a message in err. */
int64_t cuda_test_mix_launches(struct backend *be, char *err, size_t errlen);
/* One-token integer products launched since create whose rows are walked as whole steps
 * (dq_sm_rows_whole), or -EINVAL (not a cuda backend) with a message in err. */
int64_t cuda_test_whole_launches(struct backend *be, char *err, size_t errlen);

/* From the next one-token step on (on), or no longer, each step's launches of the products, RoPE
 * and the attention stamp the time (globaltimer) in each block: its start, its wait for the kernel
 * before, its input staged (the products' x, the attention's queries), its last warp's end. The
 * stamps slow a step a little; bench-kernels --trace reads them. Returns 0, -EINVAL (not a cuda
 * backend) or -ENOMEM with a message in err. */
int cuda_test_trace(struct backend *be, bool on, char *err, size_t errlen);
/* One launch of the last traced step: each point's first, median and last stamp over its blocks,
 * in microseconds from the step's first stamp (-1: no block stamped it). */
struct cuda_trace_launch {
	const char *what; /* "product", "product (added)", "product (SwiGLU)", "rope", "attention" */
	uint32_t blocks;  /* blocks that stamped their start */
	double start_first, start_med, start_last;
	double wait_first, wait_med, wait_last;
	double staged_first, staged_med, staged_last;
	double end_first, end_med, end_last;
};
/* Waits for the stream and fills out[0, *n) with the last traced step's launches in order (at
 * most max). Returns 0, or -EINVAL / -EIO with a message in err. */
int cuda_test_trace_read(struct backend *be, struct cuda_trace_launch *out, uint32_t max, uint32_t *n, char *err,
			 size_t errlen);
/* One block of a traced launch: its linear index, the multiprocessor it ran on (-1: unknown), its
 * stamps in us from the step's first (-1: not reached). */
struct cuda_trace_block {
	uint32_t block;
	int32_t sm;
	double start, wait, staged, end;
};
/* Waits for the stream and fills out[0, *n) with the blocks of launch `launch` (cuda_test_trace_read's
 * order) of the last traced step (at most max). Returns 0, or -EINVAL / -EIO with a message in err. */
int cuda_test_trace_blocks(struct backend *be, uint32_t launch, struct cuda_trace_block *out, uint32_t max,
			   uint32_t *n, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif

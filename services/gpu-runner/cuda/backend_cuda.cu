/* backend_cuda.cu - the CUDA backend ("cuda"): the forward pass of cpu/backend_ref.c on one GPU,
 * the operations of backend_impl.h; the kernels and the copies live beside it by concern
 * (cuda_internal.h lists the files).
 *
 * Same math and the same call sequence as the C reference (backend.h), which is its oracle
 * (tests/unit/gpu-runner/test_cuda_backend.c). All compute of a forward step is queued on one
 * compute stream (stream()); the KV copies have two streams of their own: the write-behind to
 * the pool (kv_write_behind, lowest priority) and the read-ahead from it (kv_prefetch), each
 * ordered against the compute stream with events. Nothing waits for the GPU on the token path
 * except where the host must see a result: logits / logits_argmax (their device-to-host copy),
 * the read-ahead's slot (kv_prefetch_wait) and the synchronous kv_to_host /
 * kv_from_host (kv_copy.cu).
 *
 * Precision. The residual stream, RMSNorm, RoPE, the softmax and SiLU * up are float32; the
 * normed activations become the activation dtype of the weights (BF16, F16; float32 for F32
 * weights; BF16 for GGUF's block formats) as inputs of the matrix products, which accumulate in
 * float32 and write float32 (cuBLAS with CUBLAS_COMPUTE_32F; CUBLAS_COMPUTE_32F_PEDANTIC for F32
 * weights, so no TF32). The matrices of a chain (q/k/v and o_proj; gate/up and down; lm_head)
 * may differ in format where they take one activation dtype: a Q4_K_M layer mixes Q4_K and Q6_K,
 * and a block format may sit beside BF16. The KV arena
 * holds K and V in BF16 (what the runner uses on a GPU) or F32 (for exact comparisons). RoPE
 * uses the reference's float32 inverse frequencies (computed on the host by the same steps)
 * and the float32 angle pos * inv_freq, with cos and sin in double as the reference takes them.
 *
 * Matrix products. Weights are row-major (out, in): y = W x. In cuBLAS's column-major terms
 * Y^T (out x n) = op(A) B with A = W seen as (in x out), op = transpose, B = X^T (in x n). One
 * token (decode) goes through a GEMV kernel of our own instead (BF16/F16 weights): each warp
 * streams one weight row with 16-byte loads, several in flight, and the kernel fuses what
 * follows the product (the residual add of o_proj and down_proj; SiLU(gate) * up, written in
 * the weight dtype). backend_params.gemv = BACKEND_GEMV_CUBLAS sends decode through cuBLAS too,
 * BACKEND_GEMV_ROWS2 runs two rows per warp (for comparisons: on an H100 one row per warp was the
 * fastest). Block-quantized weights are read as stored: up to QGEMV_MAX_TOKENS tokens by a
 * GEMV of their own (gemv_quant.cu), more by dequantizing row chunks to BF16 for cuBLAS
 * (matmul.cu); BACKEND_GEMV_CUBLAS sends every quantized product the second way. One-token
 * products of Q4_K, Q6_K and Q8_0 take x quantized to int8 per 32 values (integer dot products,
 * gemv_dp4a.cuh) by default; BACKEND_GEMV_ROWS1/ROWS2 keep them on the float GEMV.
 *
 * Attention. attn_blocks folds the listed spans into running (max, sum, weighted V) state per
 * (token, query head), kept in device memory between calls, so spans may come in any order and
 * in pieces. A block serves queries that share one KV head (GQA) and stages the keys (K and V)
 * a tile at a time in shared memory; tiles no query of the block may see (causal mask, sliding
 * window) are skipped. Few queries (decode, small chunks): two warps per query (one in blocks of
 * more than 8 queries) take a tile of 32 keys, each its half, with an online softmax on the CUDA
 * cores (attn_kernel, attention_fp32.cu). Many queries with a BF16 arena and head_dim 64 or 128
 * (prefill): 64 queries per block on the tensor cores (attn_mma_kernel; backend_params.attn =
 * BACKEND_ATTN_SIMPLE turns it off). With few blocks the key range is split across blocks and the
 * pieces are merged into the running state by the last block of each column (or a second
 * kernel).
 *
 * Chaining (backend_params.fuse; BACKEND_FUSE_NONE turns both off). The kernels of a step launch
 * with programmatic dependent launch (launch_k): each may start while the one before it ends, and
 * a matrix product issues its first weight loads before it waits for the kernel before it
 * (device.cuh's grid_wait says what may come before the wait). One-token products on the integer
 * path compute their x as they stage it: q/k/v and gate/up the RMSNorm of the residual stream,
 * o_proj the attention output (struct xsrc), so those kernels are not launched; on an H100, Q4_K_M
 * 8B decode 3.89 -> 3.32 ms/token. The integer path copies the weights through shared memory,
 * three items ahead per warp (cp.async, dq_sm_kernel): 3.42 -> 3.02 ms/token. Decode's KV
 * destinations and spans (up to ROPE_INLINE_TOKENS and ATTN_INLINE_SPANS) go in the kernels'
 * parameters, not in copies between kernels; split attention's last block merges the splits.
 * Decode attention loads its keys from earlier steps before it waits, where the host has waited
 * for the stream since they were written (kv_settled; BACKEND_FUSE_LATE_KV loads them after it).
 *
 * Host staging. Token rows of the embedding table (host memory), destination rows and spans go
 * up from a pinned ring buffer with cudaMemcpyAsync on the compute stream; each upload records
 * an event, and a region of the ring is rewritten only once the event of the copy that last
 * read it has completed (normally long done: the host waits only when it runs a full ring
 * ahead of the GPU).
 *
 * Errors detected on the device (a query that saw no keys at attn_end) cannot be returned by
 * the asynchronous op: a device flag records the first one and the next logits or
 * logits_argmax fails with its message.
 *
 * Not thread-safe: one thread drives a backend. The device is the one current at create.
 */
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cuda/cuda_test.h"

#include <assert.h>
#include <math.h>
#include <stdarg.h>

#include "services/gpu-runner/rope.h"

int cuda_failf(struct backend_dev *be, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(be->err, sizeof(be->err), fmt, ap);
	va_end(ap);
	return rc;
}

int cuda_fail(struct backend_dev *be, cudaError_t e, const char *what)
{
	int rc = e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO;
	return cuda_failf(be, rc, "cuda backend: %s failed: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

int blas_fail(struct backend_dev *be, cublasStatus_t st, const char *what)
{
	return cuda_failf(be, -EIO, "cuda backend: %s failed: %s", what, cublasGetStatusString(st));
}

/* ---- operations ------------------------------------------------------------------------- */

/* backend.c has checked the call order, the ranges, and that every tensor used is there in
 * device memory (the embedding table in host memory). */

/* Does a one-token step leave out this part's kernels (cuda_test_leave_out: timing only)? */
static bool left_out(const struct backend_dev *be, uint32_t part)
{
	return be->n == 1 && (be->leave_out & part);
}

/* The tensor of role r in device memory. */
static const void *dev(const struct group_weights *w, enum tensor_role r)
{
	return w->t[r].data[PLACE_DEVICE];
}

static uint32_t fmt(const struct group_weights *w, enum tensor_role r)
{
	return w->t[r].format;
}

/* The matrices of one product chain take one activation dtype (the activations are converted
 * once): formats may mix where they agree on it (act_dtype). Writes it to *at. */
static int check_chain(struct backend_dev *be, const struct group_weights *w, const enum tensor_role *roles,
		       uint32_t n, const char *what, uint32_t *at)
{
	*at = act_dtype(fmt(w, roles[0]));
	for (uint32_t i = 1; i < n; i++)
		if (act_dtype(fmt(w, roles[i])) != *at)
			return cuda_failf(be, -ENOTSUP, "cuda backend: %s: %s is %s but %s is %s: mixed matrix dtypes are "
					  "not supported unless they take the same activations (F32, F16, or BF16 "
					  "with the block formats)", what, tensor_role_name(roles[i]),
					  dtype_name((enum dtype)fmt(w, roles[i])), tensor_role_name(roles[0]),
					  dtype_name((enum dtype)fmt(w, roles[0])));
	return 0;
}

/* Role r's matrix as a part of a product: rows of it into out. */
static struct mm_part part(const struct group_weights *w, enum tensor_role r, uint32_t rows, float *out)
{
	struct mm_part p = {dev(w, r), rows, out, fmt(w, r), w->t[r].row_bytes};
	return p;
}

/* The x of a product of np parts that follows RMSNorm with norm role nr: the norm computed as
 * the one-token integer path stages x where every part takes it (np == 0: never), else the
 * norm kernel into be->xa now and src says so. */
static int norm_source(struct backend_dev *be, const struct group_weights *w, enum tensor_role nr,
		       const struct mm_part *parts, uint32_t np, uint32_t at, struct xsrc *src)
{
	memset(src, 0, sizeof(*src));
	if (be->n == 1 && np > 0 && qgemv_fuses_x(be, be->cfg.dim, parts, np)) {
		src->kind = XSRC_NORM;
		src->res = be->x;
		src->norm_w = dev(w, nr);
		src->norm_wt = fmt(w, nr);
		src->eps = be->cfg.rms_eps;
		return 0;
	}
	return rmsnorm(be, dev(w, nr), fmt(w, nr), 0, be->n, at);
}

int dev_alloc(struct backend_dev *be, void **p, size_t a, size_t b, size_t es, const char *what);

/* The batch's size, positions and runs (one per sequence: backend.h). At most ROPE_MAX_RUNS_INLINE
 * sequences (their RoPE launches' parameters). */
static int set_batch(struct backend_dev *be, const struct backend_batch *b)
{
	uint32_t runs = 0;
	for (uint32_t t = 0; t < b->n; t++)
		runs += t == 0 || b->seq[t] != b->seq[t - 1];
	if (runs > ROPE_MAX_RUNS_INLINE)
		return cuda_failf(be, -EINVAL, "cuda backend: a step of %u sequences; at most %u", runs,
				  ROPE_MAX_RUNS_INLINE);
	attention_drop(be); /* held back by a step that failed on the way */
	profile_step(be, b->n);
	int rc = ktrace_step(be, b->n);
	if (rc)
		return rc;
	be->kv_settled = be->kv_synced;
	be->kv_synced = false;
	be->n = b->n;
	be->pos0 = b->pos[0];
	be->n_runs = 0;
	for (uint32_t t = 0; t < b->n; t++) {
		be->pos[t] = b->pos[t];
		if (t == 0 || b->seq[t] != b->seq[t - 1]) {
			be->run_row0[be->n_runs] = t;
			be->run_pos0[be->n_runs] = b->pos[t];
			be->run_n[be->n_runs++] = 0;
		}
		be->run_n[be->n_runs - 1]++;
	}
	return 0;
}

static int cuda_embed(struct backend_dev *be, const struct group_weights *w, const struct backend_batch *b)
{
	uint32_t n = b->n;
	int brc = set_batch(be, b);
	if (brc)
		return brc;
	const struct weight_tensor *e = &w->t[ROLE_EMBED];
	/* Gather the rows on the host (the table is host memory), one copy up, widen on the GPU. */
	size_t row = e->row_bytes, bytes = row * n;
	char *h;
	size_t off;
	int rc = up_alloc(be, bytes, &h, &off);
	if (rc)
		return rc;
	for (uint32_t t = 0; t < n; t++)
		memcpy(h + t * row, (const char *)e->data[PLACE_HOST] + (size_t)b->tokens[t] * row, row);
	rc = up_send(be, be->xa, h, off, bytes, "cudaMemcpyAsync (embedding rows)");
	if (rc)
		return rc;
	if (dtype_is_element((enum dtype)e->format)) {
		embed_launch(e->format, be->xa, be->x, (size_t)n * be->cfg.dim, be->stream);
		LAUNCHED(be, "embed_kernel");
	} else {
		/* Quantized rows as gathered: row_bytes apart, each the float32 the C dequantizer gives. */
		dequant_launch(e->format, be->xa, row, n, be->cfg.dim, be->x, DT_F32, be->stream);
		LAUNCHED(be, "dequant_kernel (embedding rows)");
	}
	moe_embedded(be);
	return 0;
}

static int cuda_attn_begin(struct backend_dev *be, const struct group_weights *w, uint32_t layer,
			   const uint32_t *dst_block, const uint32_t *dst_row)
{
	static const enum tensor_role mats[] = {ROLE_WQ, ROLE_WK, ROLE_WV, ROLE_WO};
	const struct model_config *c = &be->cfg;
	uint32_t n = be->n, at;
	int rc = check_chain(be, w, mats, 4, "attention", &at);
	if (rc)
		return rc;
	if ((rc = kv_d2h_guard(be, n, dst_block)) != 0)
		return rc;

	/* Destinations of each sequence's rows: (2, its n) blocks then rows, in the RoPE kernel's
	 * parameters when few, else up first (each into its own part of be->dst). Several sequences:
	 * every row's block, row and position up at once, one launch for all of them. */
	rope_args ra[ROPE_MAX_RUNS_INLINE];
	uint32_t n_launch = be->n_runs; /* <= ROPE_MAX_RUNS_INLINE: set_batch */
	const bool multi = be->n_runs > 1;
	if (multi) {
		char *h;
		size_t off, bytes = 3 * (size_t)n * sizeof(uint32_t);
		if ((rc = up_alloc(be, bytes, &h, &off)) != 0)
			return rc;
		memcpy(h, dst_block, n * sizeof(uint32_t));
		memcpy(h + n * sizeof(uint32_t), dst_row, n * sizeof(uint32_t));
		memcpy(h + 2 * n * sizeof(uint32_t), be->pos, n * sizeof(uint32_t));
		if ((rc = up_send(be, be->dst_pos, h, off, bytes, "cudaMemcpyAsync (KV destinations)")) != 0)
			return rc;
		n_launch = 0;
	}
	for (uint32_t k = 0; k < n_launch; k++) {
		uint32_t r0 = be->run_row0[k], rn = be->run_n[k];
		ra[k].dst = be->dst + 2 * (size_t)r0;
		if (rn <= ROPE_INLINE_TOKENS) {
			memcpy(ra[k].dst_in, dst_block + r0, rn * sizeof(uint32_t));
			memcpy(ra[k].dst_in + rn, dst_row + r0, rn * sizeof(uint32_t));
		} else {
			char *h;
			size_t off, bytes = 2 * (size_t)rn * sizeof(uint32_t);
			rc = up_alloc(be, bytes, &h, &off);
			if (rc)
				return rc;
			memcpy(h, dst_block + r0, rn * sizeof(uint32_t));
			memcpy(h + rn * sizeof(uint32_t), dst_row + r0, rn * sizeof(uint32_t));
			rc = up_send(be, be->dst + 2 * (size_t)r0, h, off, bytes, "cudaMemcpyAsync (KV destinations)");
			if (rc)
				return rc;
		}
	}

	struct mm_part parts[3] = {
		part(w, ROLE_WQ, be->q_dim, be->qkv),
		part(w, ROLE_WK, be->kv_dim, be->qkv + be->q_dim),
		part(w, ROLE_WV, be->kv_dim, be->qkv + be->q_dim + be->kv_dim),
	};
	struct xsrc src;
	if ((rc = norm_source(be, w, ROLE_ATTN_NORM, parts, 3, at, &src)) != 0)
		return rc;
	/* In blocks of one row group (launch_dq_k): the attention's blocks, launched before these end,
	 * then find room as each of them ends, not a multiprocessor at a time. */
	be->dq_narrow = !be->wide_qkv;
	rc = left_out(be, CUDA_TEST_QKV) ? 0
		: matmul(be, at, be->xa, &src, c->dim, n, parts, 3, be->qkv_ld, false, "q/k/v projections");
	be->dq_narrow = false;
	if (rc)
		return rc;
	if ((c->flags & MODEL_QK_NORM) &&
	    (rc = qk_norm(be, dev(w, ROLE_Q_NORM), fmt(w, ROLE_Q_NORM), dev(w, ROLE_K_NORM), fmt(w, ROLE_K_NORM))))
		return rc;

	/* RoPE at each sequence's positions, its K and V into the arena, its attention state reset. */
	for (uint32_t k = 0; k < n_launch; k++) {
		uint32_t r0 = be->run_row0[k];
		ra[k].qkv = be->qkv + (size_t)r0 * be->qkv_ld;
		ra[k].ld = be->qkv_ld;
		ra[k].inv_freq = be->inv_freq;
		ra[k].arena = be->arena;
		ra[k].block_elems = be->block_elems;
		ra[k].block_tokens = be->p.block_tokens;
		ra[k].n_heads = c->n_heads;
		ra[k].n_kv_heads = c->n_kv_heads;
		ra[k].head_dim = c->head_dim;
		ra[k].pos0 = be->run_pos0[k];
		ra[k].n = be->run_n[k];
		ra[k].adjacent = c->rope_layout == ROPE_ADJACENT;
		ra[k].m = be->st_m + (size_t)r0 * c->n_heads;
		ra[k].l = be->st_l + (size_t)r0 * c->n_heads;
		ra[k].acc = be->st_acc + (size_t)r0 * c->n_heads * c->head_dim;
		ra[k].pos = NULL;
		ra[k].tr = ktrace_next(be, "rope");
		if (left_out(be, CUDA_TEST_ROPE))
			continue;
		rope_launch(be->p.kv_dtype, ra[k], be->pdl, be->stream);
		LAUNCHED(be, "rope_kernel");
	}
	if (multi) {
		rope_args m;
		memset(&m, 0, sizeof(m));
		m.qkv = be->qkv;
		m.ld = be->qkv_ld;
		m.inv_freq = be->inv_freq;
		m.dst = be->dst_pos;
		m.pos = be->dst_pos + 2 * (size_t)n;
		m.arena = be->arena;
		m.block_elems = be->block_elems;
		m.block_tokens = be->p.block_tokens;
		m.n_heads = c->n_heads;
		m.n_kv_heads = c->n_kv_heads;
		m.head_dim = c->head_dim;
		m.n = n;
		m.adjacent = c->rope_layout == ROPE_ADJACENT;
		m.m = be->st_m;
		m.l = be->st_l;
		m.acc = be->st_acc;
		m.tr = ktrace_next(be, "rope (several sequences)");
		rope_launch(be->p.kv_dtype, m, be->pdl, be->stream);
		LAUNCHED(be, "rope_kernel (several sequences)");
	}
	be->layer = layer;
	be->attn_act = at;
	return 0;
}

static int cuda_attn_end(struct backend_dev *be, const struct group_weights *w)
{
	const struct model_config *c = &be->cfg;
	uint32_t wt = fmt(w, ROLE_WO), at = act_dtype(wt);
	if (at != be->attn_act)
		return cuda_failf(be, -ENOTSUP, "cuda backend: attn_end: wo is %s (%s activations) but attn_begin's "
				  "matrices took %s activations: mixed matrix dtypes are not supported",
				  dtype_name((enum dtype)wt), dtype_name((enum dtype)at),
				  dtype_name((enum dtype)be->attn_act));
	struct mm_part o = part(w, ROLE_WO, c->dim, be->x);
	struct xsrc src;
	memset(&src, 0, sizeof(src));
	int frc = attention_flush(be);
	if (frc)
		return frc;
	if (be->n == 1 && qgemv_fuses_x(be, be->q_dim, &o, 1)) {
		/* The attention output is computed as o_proj stages its x. */
		src.kind = XSRC_ATTN;
		src.l = be->st_l;
		src.acc = be->st_acc;
		src.head_dim = c->head_dim;
		src.st = be->status;
		src.layer = be->layer;
		src.pos0 = 0; /* the row flagged when no key was seen (finish_step gives its position) */
	} else {
		attn_out_launch(at, be, be->stream);
		LAUNCHED(be, "attn_out_kernel");
	}
	if (left_out(be, CUDA_TEST_OPROJ))
		return 0;
	return matmul(be, at, be->xa, &src, be->q_dim, be->n, &o, 1, c->dim, true, "o_proj");
}

static int cuda_ffn(struct backend_dev *be, const struct group_weights *w)
{
	static const enum tensor_role mats[] = {ROLE_W_GATE, ROLE_W_UP, ROLE_W_DOWN};
	const struct model_config *c = &be->cfg;
	uint32_t n = be->n, ffn = c->ffn_dim, at;
	if (w->split.where != FFN_SPLIT_NONE)
		return ffn_split_compute(be, w);
	int rc = check_chain(be, w, mats, 3, "ffn", &at);
	if (rc)
		return rc;
	struct mm_part gu[2] = {part(w, ROLE_W_GATE, ffn, be->gu), part(w, ROLE_W_UP, ffn, be->gu + ffn)};
	struct xsrc src;
	if ((rc = norm_source(be, w, ROLE_FFN_NORM, gu, gu[0].format == gu[1].format ? 2 : 0, at, &src)) != 0)
		return rc;
	rc = left_out(be, CUDA_TEST_GATEUP) ? 0 : swiglu_product(be, at, gu, be->xa, &src, c->dim, n, be->xb, "gate/up_proj");
	if (rc)
		return rc;
	struct mm_part down = part(w, ROLE_W_DOWN, c->dim, be->x);
	if (left_out(be, CUDA_TEST_DOWN))
		return 0;
	return matmul(be, at, be->xb, NULL, ffn, n, &down, 1, c->dim, true, "down_proj");
}

static int cuda_attn_blocks(struct backend_dev *be, const struct kv_span *spans, uint32_t n_spans)
{
	if (left_out(be, CUDA_TEST_ATTN))
		return 0;
	return attention_blocks(be, spans, n_spans);
}

/* Final norm of the batch's last token and lm_head into be->logits (queued, not waited for). */
static int head(struct backend_dev *be, const struct group_weights *w)
{
	const struct model_config *c = &be->cfg;
	uint32_t at = act_dtype(fmt(w, ROLE_LM_HEAD));
	int rc = rmsnorm(be, dev(w, ROLE_FINAL_NORM), fmt(w, ROLE_FINAL_NORM), be->n - 1, 1, at);
	if (rc)
		return rc;
	struct mm_part lm = part(w, ROLE_LM_HEAD, c->vocab_size, be->logits);
	return matmul(be, at, be->xa, NULL, c->dim, 1, &lm, 1, c->vocab_size, false, "lm_head");
}

/* After the result's copy was queued: wait for it and report what the kernels flagged. */
static int finish_step(struct backend_dev *be, const char *what)
{
	CUDA_TRY(be, "cudaMemcpyAsync (status)",
		 cudaMemcpyAsync(be->h_status, be->status, sizeof(*be->status), cudaMemcpyDeviceToHost, be->stream));
	CUDA_TRY(be, "waiting for the step's end (logits)", ffn_split_stream_wait(be));
	be->kv_synced = true;
	int rc = ffn_split_check(be);
	if (rc)
		return rc;
	if (be->h_status->err) {
		struct dev_status st = *be->h_status;
		if (st.err_pos < be->n) /* the kernels flag a row of the step */
			st.err_pos = be->pos[st.err_pos];
		CUDA_TRY(be, "cudaMemsetAsync (status)", cudaMemsetAsync(be->status, 0, sizeof(*be->status), be->stream));
		return cuda_failf(be, -EINVAL,
				  "cuda backend: %s: in layer %u the query at position %u saw no keys: the spans did not "
				  "cover its own position (found by attn_end on the GPU, reported here)", what,
				  st.err_layer, st.err_pos);
	}
	return 0;
}

static int cuda_logits(struct backend_dev *be, const struct group_weights *w, float *out)
{
	int rc = head(be, w);
	if (rc)
		return rc;
	CUDA_TRY(be, "cudaMemcpyAsync (logits)",
		 cudaMemcpyAsync(out, be->logits, be->cfg.vocab_size * sizeof(float), cudaMemcpyDeviceToHost,
				 be->stream));
	return finish_step(be, "logits");
}

/* The head of several rows (one per sequence of the batch) into be->logits_rows (n_rows x
 * vocab_size, queued): each row's final norm into xa, one product for all of them. */
static int rows_head(struct backend_dev *be, const struct group_weights *w, const uint32_t *rows, uint32_t n_rows)
{
	const struct model_config *c = &be->cfg;
	if (n_rows > be->logits_rows_cap) {
		CUDA_TRY(be, "cudaStreamSynchronize (logits rows)", cudaStreamSynchronize(be->stream));
		cudaFree(be->logits_rows);
		be->logits_rows = NULL;
		be->logits_rows_cap = 0;
		int arc = dev_alloc(be, (void **)&be->logits_rows, n_rows, c->vocab_size, sizeof(float), "logits rows");
		if (arc)
			return arc;
		be->logits_rows_cap = n_rows;
	}
	uint32_t at = act_dtype(fmt(w, ROLE_LM_HEAD));
	int rc = rmsnorm_rows(be, dev(w, ROLE_FINAL_NORM), fmt(w, ROLE_FINAL_NORM), rows, n_rows, at);
	if (rc)
		return rc;
	struct mm_part lm = part(w, ROLE_LM_HEAD, c->vocab_size, be->logits_rows);
	return matmul(be, at, be->xa, NULL, c->dim, n_rows, &lm, 1, c->vocab_size, false, "lm_head (rows)");
}

/* The head of several rows into out, n_rows x vocab_size on the host. */
static int cuda_logits_rows(struct backend_dev *be, const struct group_weights *w, const uint32_t *rows,
			    uint32_t n_rows, float *out)
{
	int rc = rows_head(be, w, rows, n_rows);
	if (rc)
		return rc;
	CUDA_TRY(be, "cudaMemcpyAsync (logits rows)",
		 cudaMemcpyAsync(out, be->logits_rows, (size_t)n_rows * be->cfg.vocab_size * sizeof(float),
				 cudaMemcpyDeviceToHost, be->stream));
	return finish_step(be, "logits_rows");
}

/* The head of several rows and each row's token picked on the device (argmax_kernel, or
 * sample_kernel with the row's parameters and uniform), each into its own status word: only the
 * tokens come back. One row that is the step's last takes the one-sequence head (head()), as
 * logits_argmax and logits_sample do, so a sequence alone gets the same tokens either way. */
static int cuda_logits_pick_rows(struct backend_dev *be, const struct group_weights *w, const uint32_t *rows,
				 uint32_t n_rows, const struct backend_pick *picks, int32_t *tokens)
{
	const uint32_t vocab = be->cfg.vocab_size;
	if (n_rows > be->picks_cap) {
		CUDA_TRY(be, "cudaStreamSynchronize (picks)", cudaStreamSynchronize(be->stream));
		cudaFree(be->picks);
		cudaFreeHost(be->h_picks);
		be->picks = NULL;
		be->h_picks = NULL;
		be->picks_cap = 0;
		int arc = dev_alloc(be, (void **)&be->picks, n_rows, 1, sizeof(struct dev_status), "the picks' status words");
		if (arc)
			return arc;
		CUDA_TRY(be, "cudaMemsetAsync (picks)",
			 cudaMemsetAsync(be->picks, 0, n_rows * sizeof(struct dev_status), be->stream));
		CUDA_TRY(be, "cudaMallocHost (picks)",
			 cudaMallocHost((void **)&be->h_picks, n_rows * sizeof(struct dev_status)));
		be->picks_cap = n_rows;
	}
	const bool one = n_rows == 1 && rows[0] == be->n - 1;
	int rc = one ? head(be, w) : rows_head(be, w, rows, n_rows);
	if (rc)
		return rc;
	const float *lg = one ? be->logits : be->logits_rows;
	for (uint32_t i = 0; i < n_rows; i++) {
		const struct sampler_params *sp = picks[i].sp;
		if (!sp) {
			argmax_launch(lg + (size_t)i * vocab, vocab, be->picks + i, be->stream);
			LAUNCHED(be, "argmax_kernel (rows)");
		} else {
			sample_launch(lg + (size_t)i * vocab, vocab, 1.0f / sp->temperature, sp->top_k, sp->top_p, sp->min_p,
				      picks[i].u, be->picks + i, be->stream);
			LAUNCHED(be, "sample_kernel (rows)");
		}
	}
	CUDA_TRY(be, "cudaMemcpyAsync (picks)",
		 cudaMemcpyAsync(be->h_picks, be->picks, n_rows * sizeof(struct dev_status), cudaMemcpyDeviceToHost,
				 be->stream));
	rc = finish_step(be, "logits_pick_rows");
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n_rows; i++)
		tokens[i] = be->h_picks[i].token;
	return 0;
}

static int cuda_logits_argmax(struct backend_dev *be, const struct group_weights *w, int32_t *token)
{
	int rc = head(be, w);
	if (rc)
		return rc;
	argmax_launch(be->logits, be->cfg.vocab_size, be->status, be->stream);
	LAUNCHED(be, "argmax_kernel");
	rc = finish_step(be, "logits_argmax");
	if (rc)
		return rc;
	*token = be->h_status->token;
	return 0;
}

static int cuda_logits_sample(struct backend_dev *be, const struct group_weights *w, const struct sampler_params *sp,
			      double u, int32_t *token)
{
	int rc = head(be, w);
	if (rc)
		return rc;
	be->h_status->token = -1;
	sample_launch(be->logits, be->cfg.vocab_size, 1.0f / sp->temperature, sp->top_k, sp->top_p, sp->min_p, u,
		      be->status, be->stream);
	LAUNCHED(be, "sample_kernel");
	rc = finish_step(be, "logits_sample");
	if (rc)
		return rc;
	*token = be->h_status->token;
	return 0;
}

static struct CUstream_st *cuda_stream(struct backend_dev *be)
{
	return be->stream;
}

static const char *cuda_error(struct backend_dev *be)
{
	return be->err;
}

/* ---- create / destroy ------------------------------------------------------------------- */

/* Waits for queued work, frees everything; NULLs *bep; safe on NULL and twice, and on a
 * partly created backend. */
static void cuda_destroy(struct backend_dev **bep)
{
	struct backend_dev *be = *bep;
	if (!be)
		return;
	ffn_split_teardown(be);
	moe_teardown(be);
	profile_end(be);
	ktrace_free(be);
	if (be->spanbuf)
		cudaFreeAsync(be->spanbuf, be->stream); /* allocated stream-ordered */
	if (be->stream)
		cudaStreamSynchronize(be->stream);
	if (be->blas)
		cublasDestroy(be->blas);
	cudaFree(be->blas_ws);
	cudaFree(be->arena);
	cudaFree(be->inv_freq);
	cudaFree(be->x);
	cudaFree(be->xa);
	cudaFree(be->xb);
	cudaFree(be->qscratch);
	cudaFree(be->qkv);
	cudaFree(be->gu);
	cudaFree(be->logits);
	cudaFree(be->logits_rows);
	free(be->run_row0);
	free(be->run_n);
	free(be->run_pos0);
	free(be->pos);
	free(be->pend_seqs);
	free(be->pend_spans);
	cudaFree(be->st_m);
	cudaFree(be->st_l);
	cudaFree(be->st_acc);
	cudaFree(be->pm);
	cudaFree(be->pl);
	cudaFree(be->pacc);
	cudaFree(be->dst);
	cudaFree(be->dst_pos);
	cudaFree(be->attn_count);
	cudaFree(be->status);
	cudaFreeHost(be->h_status);
	cudaFree(be->picks);
	cudaFreeHost(be->h_picks);
	cudaFreeHost(be->up.host);
	for (uint32_t i = 0; i < be->up.n_events; i++)
		cudaEventDestroy(be->up.ev[i]);
	kv_copy_destroy(be);
	if (be->stream)
		cudaStreamDestroy(be->stream);
	free(be);
	*bep = NULL;
}

/* What this backend adds to backend_check_config, which the front has run. */
static int check_config(const struct model_config *c, const struct backend_params *p, char *err, size_t errlen)
{
	if (c->head_dim % 8 || c->head_dim > MAX_HEAD_DIM) {
		snprintf(err, errlen, "cuda backend: head_dim %u is not supported: the attention kernel takes multiples "
			 "of 8 up to %u", c->head_dim, MAX_HEAD_DIM);
		return -ENOTSUP;
	}
	if (!(c->rope_theta > 1.0f) || !isfinite(c->rope_theta)) {
		snprintf(err, errlen, "cuda backend: rope_theta %g is not a finite number > 1", (double)c->rope_theta);
		return -EINVAL;
	}
	if (c->rope_scaling != ROPE_SCALING_NONE) {
		if (!(c->rope_factor > 0.0f) || !isfinite(c->rope_factor)) {
			snprintf(err, errlen, "cuda backend: rope_scaling factor %g is not a finite number > 0",
				 (double)c->rope_factor);
			return -EINVAL;
		}
		if (c->rope_scaling == ROPE_SCALING_LLAMA3) {
			float low = c->rope_low_freq_factor, high = c->rope_high_freq_factor;
			if (!(low > 0.0f) || !(high > low) || !isfinite(high) || c->rope_original_max_position == 0) {
				snprintf(err, errlen,
					 "cuda backend: llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor "
					 "and original_max_position_embeddings > 0 (got low %g, high %g, original %u)",
					 (double)low, (double)high, c->rope_original_max_position);
				return -EINVAL;
			}
		} else if (c->rope_scaling != ROPE_SCALING_LINEAR) {
			snprintf(err, errlen, "cuda backend: unknown rope_scaling type %u", c->rope_scaling);
			return -EINVAL;
		}
	}
	if (p->kv_dtype != DT_BF16 && p->kv_dtype != DT_F32) {
		snprintf(err, errlen, "cuda backend: kv_dtype %s is not supported: the KV arena holds BF16 or F32",
			 p->kv_dtype < DT_COUNT ? dtype_name((enum dtype)p->kv_dtype) : "(unknown)");
		return -ENOTSUP;
	}
	return 0;
}

int dev_alloc(struct backend_dev *be, void **p, size_t a, size_t b, size_t es, const char *what)
{
	size_t n;
	if (__builtin_mul_overflow(a, b, &n) || __builtin_mul_overflow(n, es, &n))
		return cuda_failf(be, -ENOMEM, "cuda backend: %s: %zu x %zu elements overflow", what, a, b);
	cudaError_t e = cudaMalloc(p, n ? n : 1);
	if (e != cudaSuccess) {
		*p = NULL;
		cudaGetLastError(); /* not sticky: clear it */
		return cuda_failf(be, -ENOMEM, "cuda backend: cudaMalloc of %zu bytes for %s failed: %s", n, what,
			    cudaGetErrorString(e));
	}
	return 0;
}

static int create_device(struct backend_dev *be)
{
	const struct model_config *c = &be->cfg;
	const struct backend_params *p = &be->p;
	CUDA_TRY(be, "cudaGetDevice", cudaGetDevice(&be->device));
	CUDA_TRY(be, "cudaDeviceGetAttribute (multiprocessors)",
		 cudaDeviceGetAttribute(&be->sm_count, cudaDevAttrMultiProcessorCount, be->device));
	/* Priority 0 is the default; non-blocking: the legacy default stream does not order
	 * against it (the weight window orders its copies with events). */
	CUDA_TRY(be, "cudaStreamCreateWithPriority",
		 cudaStreamCreateWithPriority(&be->stream, cudaStreamNonBlocking, 0));
	cublasStatus_t bs = cublasCreate(&be->blas);
	if (bs != CUBLAS_STATUS_SUCCESS) {
		be->blas = NULL;
		return blas_fail(be, bs, "cublasCreate");
	}
	if ((bs = cublasSetStream(be->blas, be->stream)) != CUBLAS_STATUS_SUCCESS)
		return blas_fail(be, bs, "cublasSetStream");
	if ((bs = cublasSetMathMode(be->blas, CUBLAS_DEFAULT_MATH)) != CUBLAS_STATUS_SUCCESS)
		return blas_fail(be, bs, "cublasSetMathMode");
	int rc = dev_alloc(be, &be->blas_ws, BLAS_WORKSPACE, 1, 1, "the cuBLAS workspace");
	if (rc)
		return rc;
	if ((bs = cublasSetWorkspace(be->blas, be->blas_ws, BLAS_WORKSPACE)) != CUBLAS_STATUS_SUCCESS)
		return blas_fail(be, bs, "cublasSetWorkspace");

	size_t mc = p->max_chunk, pairs = mc * c->n_heads;
	size_t arena_elems;
	if (__builtin_mul_overflow((size_t)p->n_kv_blocks, be->block_elems, &arena_elems))
		return cuda_failf(be, -ENOMEM, "cuda backend: a KV arena of %u blocks overflows", p->n_kv_blocks);
	if ((rc = dev_alloc(be, &be->arena, arena_elems, 1, be->kv_esize, "the KV arena")) ||
	    (rc = dev_alloc(be, (void **)&be->inv_freq, c->head_dim / 2, 1, sizeof(float), "RoPE frequencies")) ||
	    (rc = dev_alloc(be, (void **)&be->x, mc, c->dim, sizeof(float), "the residual stream")) ||
	    (rc = dev_alloc(be, &be->xa, mc, be->max_in, sizeof(float), "matrix inputs")) ||
	    (rc = dev_alloc(be, &be->xb, mc, c->ffn_dim, sizeof(float), "the SwiGLU output")) ||
	    (rc = dev_alloc(be, (void **)&be->qkv, mc, be->qkv_ld, sizeof(float), "q/k/v")) ||
	    (rc = dev_alloc(be, (void **)&be->gu, mc, 2 * (size_t)c->ffn_dim, sizeof(float), "gate/up")) ||
	    (rc = dev_alloc(be, (void **)&be->logits, c->vocab_size, 1, sizeof(float), "logits")) ||
	    (rc = dev_alloc(be, (void **)&be->st_m, pairs, 1, sizeof(float), "attention state")) ||
	    (rc = dev_alloc(be, (void **)&be->st_l, pairs, 1, sizeof(float), "attention state")) ||
	    (rc = dev_alloc(be, (void **)&be->st_acc, pairs, c->head_dim, sizeof(float), "attention state")))
		return rc;
	be->run_row0 = (uint32_t *)calloc(mc, sizeof(uint32_t));
	be->run_n = (uint32_t *)calloc(mc, sizeof(uint32_t));
	be->run_pos0 = (uint32_t *)calloc(mc, sizeof(uint32_t));
	be->pos = (uint32_t *)calloc(mc, sizeof(uint32_t));
	be->pend_seqs = (struct attn_seq *)calloc(mc, sizeof(struct attn_seq));
	if (!be->run_row0 || !be->run_n || !be->run_pos0 || !be->pos || !be->pend_seqs)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for the batch's tables");
	/* The dequantization scratch of prefill products with block-quantized weights: the largest
	 * matrix of a layer (gate/up/down of a Llama), capped; lm_head goes through in row chunks.
	 * At least one row of the widest input. */
	size_t big = (size_t)be->q_dim * c->dim;
	if ((size_t)be->kv_dim * c->dim > big)
		big = (size_t)be->kv_dim * c->dim;
	if ((size_t)c->ffn_dim * c->dim > big)
		big = (size_t)c->ffn_dim * c->dim;
	be->qscratch_elems = big < QSCRATCH_MAX_ELEMS ? big : QSCRATCH_MAX_ELEMS;
	if (be->qscratch_elems < be->max_in)
		be->qscratch_elems = be->max_in;
	if ((rc = dev_alloc(be, &be->qscratch, be->qscratch_elems, 1, 2, "the dequantization scratch")))
		return rc;
	be->part_cap = c->n_heads * ATTN_MAX_SPLITS;
	if ((rc = dev_alloc(be, (void **)&be->pm, be->part_cap, 1, sizeof(float), "split attention")) ||
	    (rc = dev_alloc(be, (void **)&be->pl, be->part_cap, 1, sizeof(float), "split attention")) ||
	    (rc = dev_alloc(be, (void **)&be->pacc, be->part_cap, c->head_dim, sizeof(float), "split attention")) ||
	    (rc = dev_alloc(be, (void **)&be->dst, 2 * mc, 1, sizeof(uint32_t), "KV destinations")) ||
	    (rc = dev_alloc(be, (void **)&be->dst_pos, 3 * mc, 1, sizeof(uint32_t), "KV destinations")) ||
	    (rc = dev_alloc(be, (void **)&be->attn_count, ATTN_MERGE_COUNTERS, 1, sizeof(uint32_t),
			    "attention merge counters")) ||
	    (rc = dev_alloc(be, (void **)&be->status, 1, 1, sizeof(struct dev_status), "the status word")))
		return rc;
	/* Stream-ordered, as its replacements when a call brings more spans (cuda_attn_blocks). */
	be->spanbuf_bytes = ((size_t)p->n_kv_blocks + 1) * (sizeof(struct kv_span) + sizeof(uint32_t)) + 16;
	CUDA_TRY(be, "cudaMallocAsync (span list)", cudaMallocAsync(&be->spanbuf, be->spanbuf_bytes, be->stream));
	CUDA_TRY(be, "cudaMemset (status)", cudaMemset(be->status, 0, sizeof(*be->status)));
	CUDA_TRY(be, "cudaMemset (attention merge counters)",
		 cudaMemset(be->attn_count, 0, ATTN_MERGE_COUNTERS * sizeof(uint32_t)));
	be->attn_count_n = ATTN_MERGE_COUNTERS;

	float *inv = (float *)malloc(c->head_dim / 2 * sizeof(float));
	if (!inv)
		return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for RoPE frequencies");
	char why[256];
	if (rope_inv_freq(c, inv, why, sizeof(why)) != 0) {
		free(inv);
		return cuda_failf(be, -EINVAL, "cuda backend: %s", why);
	}
	cudaError_t e = cudaMemcpy(be->inv_freq, inv, c->head_dim / 2 * sizeof(float), cudaMemcpyHostToDevice);
	free(inv);
	if (e != cudaSuccess)
		return cuda_fail(be, e, "cudaMemcpy (RoPE frequencies)");
	/* The memsets and the copy above went on the legacy stream, which be->stream (non-blocking)
	 * does not wait for, and a copy from pageable memory may return before its DMA lands. */
	CUDA_TRY(be, "cudaDeviceSynchronize (the device state)", cudaDeviceSynchronize());

	/* Staging ring: two chunks of embedding rows at the widest dtype, plus room for the small
	 * uploads of a few steps. */
	be->up.cap = 2 * mc * c->dim * sizeof(float) + (1u << 20);
	CUDA_TRY(be, "cudaMallocHost (staging ring)", cudaMallocHost((void **)&be->up.host, be->up.cap));
	CUDA_TRY(be, "cudaMallocHost (status)", cudaMallocHost((void **)&be->h_status, sizeof(*be->h_status)));
	for (uint32_t i = 0; i < UPLOAD_EVENTS; i++) {
		CUDA_TRY(be, "cudaEventCreateWithFlags", cudaEventCreateWithFlags(&be->up.ev[i], cudaEventDisableTiming));
		be->up.n_events++;
	}

	be->attn_smem_max = attn_smem_bytes(c->head_dim, be->kv_esize, ATTN_MAX_WARPS);
	int smem_optin = 0;
	CUDA_TRY(be, "cudaDeviceGetAttribute (shared memory)",
		 cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, be->device));
	if (be->attn_smem_max > (size_t)smem_optin)
		return cuda_failf(be, -ENOTSUP, "cuda backend: attention needs %zu bytes of shared memory, the device has %d",
			    be->attn_smem_max, smem_optin);
	CUDA_TRY(be, "cudaFuncSetAttribute (attention)", attn_allow_smem(p->kv_dtype, be->attn_smem_max));
	/* Programmatic dependent launch: compute capability 9.0 and up. */
	int major = 0;
	CUDA_TRY(be, "cudaDeviceGetAttribute (compute capability)",
		 cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, be->device));
	be->pdl = p->fuse != BACKEND_FUSE_NONE && major >= 9;
	/* Without the shared memory the quantized GEMV stages x in, such products dequantize. */
	be->qgemv_ok = (size_t)smem_optin >= QG_SMEM_MAX;
	be->dq_smem_max = (uint32_t)smem_optin - 1024;
	if (be->qgemv_ok)
		CUDA_TRY(be, "cudaFuncSetAttribute (quantized GEMV)", qgemv_init(be->dq_smem_max));
	return 0;
}

/* On success *out is a new backend the caller owns (cuda_destroy); on failure *out is NULL and
 * err names the problem. cfg and p are copied. Uses the current device. */
static int cuda_create(const struct model_config *cfg, const struct backend_params *p, struct backend_dev **out,
		       char *err, size_t errlen)
{
	assert(cfg && p && out && err);
	*out = NULL;
	int rc = check_config(cfg, p, err, errlen);
	if (rc)
		return rc;
	struct backend_dev *be = (struct backend_dev *)calloc(1, sizeof(*be));
	if (!be) {
		snprintf(err, errlen, "cuda backend: out of memory for the backend state");
		return -ENOMEM;
	}
	be->cfg = *cfg;
	be->p = *p;
	be->prof_left = -1; /* PIPELINE_CUDA_PROFILE_STEP read at the first step */
	be->q_dim = cfg->n_heads * cfg->head_dim;
	be->kv_dim = cfg->n_kv_heads * cfg->head_dim;
	be->qkv_ld = be->q_dim + 2 * be->kv_dim;
	be->max_in = cfg->dim;
	if (be->q_dim > be->max_in)
		be->max_in = be->q_dim;
	if (cfg->ffn_dim > be->max_in)
		be->max_in = cfg->ffn_dim;
	be->kv_esize = dtype_size((enum dtype)p->kv_dtype);
	be->block_elems = 2 * (size_t)p->block_tokens * be->kv_dim;
	be->scale = (float)(1.0 / sqrt((double)cfg->head_dim));
	/* Kernel choices for comparisons (the test checks and times each path). */
	be->gemv_rows = p->gemv == BACKEND_GEMV_CUBLAS ? 0 : p->gemv == BACKEND_GEMV_ROWS2 ? 2 : GEMV_DEFAULT_ROWS;
	/* One-token quantized products take the integer path unless a float GEMV is asked for
	 * (ROWS1, ROWS2) or cuBLAS (an H100, Q4_K_M 8B: 1.4x faster than the float path). */
	be->qgemv_dp4a = p->gemv == BACKEND_GEMV_DEFAULT || p->gemv == BACKEND_GEMV_DP4A ||
			 p->gemv == BACKEND_GEMV_DP4A_REGS;
	be->dq_sm = be->qgemv_dp4a && p->gemv != BACKEND_GEMV_DP4A_REGS;
	be->attn_mma = p->attn != BACKEND_ATTN_SIMPLE;
	be->fuse_x = p->fuse != BACKEND_FUSE_NONE;
	be->wide_dq = p->fuse != BACKEND_FUSE_NONE && p->fuse != BACKEND_FUSE_NARROW_DQ;
	be->mix_dq = p->fuse != BACKEND_FUSE_NONE && p->fuse != BACKEND_FUSE_APART_DQ;
	be->whole_dq = p->fuse != BACKEND_FUSE_ANY_ITEMS;
	be->wide_qkv = p->fuse == BACKEND_FUSE_WIDE_QKV;
	be->rows_apart = p->fuse == BACKEND_FUSE_ROWS_APART;
	be->early_kv = p->fuse != BACKEND_FUSE_NONE && p->fuse != BACKEND_FUSE_LATE_KV;
	be->attn_key_warps = p->fuse == BACKEND_FUSE_ONE_KEY_WARP ? 1 : 2;

	rc = create_device(be);
	if (rc == 0)
		rc = ffn_split_setup(be);
	if (rc == 0)
		rc = moe_setup(be);
	if (rc) {
		snprintf(err, errlen, "%s", be->err);
		cuda_destroy(&be);
		return rc;
	}
	*out = be;
	return 0;
}

/* In the order of the structs (C++17 has no designated initializers). */
/* ---- a stage of a split model (backend.h) ---- */

static int cuda_hidden_in(struct backend_dev *be, const struct backend_batch *b, const float *x)
{
	if (x) {
		CUDA_TRY(be, "cudaMemcpyAsync (hidden rows in)",
			 cudaMemcpyAsync(be->x, x, sizeof(float) * b->n * be->cfg.dim, cudaMemcpyHostToDevice, be->stream));
		CUDA_TRY(be, "cudaStreamSynchronize (hidden rows in)", cudaStreamSynchronize(be->stream));
	}
	return set_batch(be, b);
}

static int cuda_hidden_get(struct backend_dev *be, uint32_t row0, uint32_t n, float *x)
{
	size_t dim = be->cfg.dim;
	CUDA_TRY(be, "cudaMemcpyAsync (hidden rows out)",
		 cudaMemcpyAsync(x, be->x + row0 * dim, sizeof(float) * n * dim, cudaMemcpyDeviceToHost, be->stream));
	return finish_step(be, "hidden rows out");
}

static int cuda_hidden_put(struct backend_dev *be, uint32_t row0, uint32_t n, const float *x)
{
	size_t dim = be->cfg.dim;
	CUDA_TRY(be, "cudaMemcpyAsync (hidden rows back)",
		 cudaMemcpyAsync(be->x + row0 * dim, x, sizeof(float) * n * dim, cudaMemcpyHostToDevice, be->stream));
	CUDA_TRY(be, "cudaStreamSynchronize (hidden rows back)", cudaStreamSynchronize(be->stream));
	return 0;
}

static int cuda_hidden_device(struct backend_dev *be, float **x)
{
	*x = be->x;
	return 0;
}

static int cuda_finish(struct backend_dev *be)
{
	return finish_step(be, "stage");
}

/* backend.h's settle: a failed step's CPU work, the experts' and the split FFNs'. */
static void cuda_settle(struct backend_dev *be)
{
	moe_settle(be);
	ffn_split_settle(be);
}

static const struct backend_compute_ops cuda_compute = {
	cuda_embed,		/* embed */
	cuda_attn_begin,	/* attn_begin */
	cuda_attn_blocks,	/* attn_blocks */
	cuda_attn_end,		/* attn_end */
	cuda_ffn,		/* ffn */
	cuda_logits,		/* logits */
	cuda_logits_argmax,	/* logits_argmax */
	cuda_logits_sample,	/* logits_sample */
	ffn_split_stats,	/* cpu_share_stats */
	moe_route,		/* moe_route */
	moe_expert,		/* moe_expert */
	moe_end,		/* moe_end */
	moe_expert_used,	/* moe_expert_used */
	moe_expert_cpu,		/* moe_expert_cpu */
	cuda_settle,		/* settle */
	moe_check_step,		/* moe_check */
	moe_layer_experts,	/* moe_layer_experts */
	moe_layer,		/* moe_layer */
	moe_layer_chosen,	/* moe_layer_chosen */
	cuda_hidden_in,		/* hidden_in */
	cuda_hidden_get,	/* hidden_get */
	cuda_hidden_put,	/* hidden_put */
	cuda_hidden_device,	/* hidden_device */
	cuda_finish,		/* finish */
	cuda_logits_rows,	/* logits_rows: several sequences a step */
	cuda_logits_pick_rows,	/* logits_pick_rows: their tokens picked on the device */
	moe_expert_cpu_share,	/* moe_expert_cpu_share: a split expert's CPU share at the route */
	moe_ends,		/* moe_ends: how the layer before's two sides ended */
};

extern "C" {
extern const struct backend_impl backend_cuda_impl;
const struct backend_impl backend_cuda_impl = {
	"cuda",			/* name */
	PLACE_DEVICE,		/* place */
	cuda_create,		/* create */
	cuda_destroy,		/* destroy */
	cuda_error,		/* error */
	cuda_stream,		/* cuda_stream */
	&cuda_compute,		/* compute */
	&cuda_kv_ops,		/* kv */
};
}

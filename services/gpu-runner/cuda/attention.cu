/* attention.cu - attention of the batch's queries over KV spans (backend.h, attn_blocks):
 * running (max, sum, weighted V) state per (token, query head), kept in device memory between
 * calls, so spans may come in any order and in pieces. Which kernel serves a call and how its keys
 * are split across blocks is decided here: few queries (decode, small chunks) go to the CUDA
 * cores in float32 (attention_fp32.cu), many queries with a BF16 arena and head_dim 64 or 128
 * (prefill) to the tensor cores, 64 queries per block (attention_mma.cu;
 * backend_params.attn = BACKEND_ATTN_SIMPLE turns it off). With few blocks the key range is split
 * across blocks and the pieces are merged into the running state: by the last block of each
 * column to finish (CUDA cores, backend_params.fuse default), else by a second kernel. The span
 * lists go in the kernel's parameters where they fit, else up in one copy; the one-row runs of a
 * step of several sequences go in one launch (attention_flush). The attention output (acc / l)
 * ends the file. */
#include "services/gpu-runner/cuda/cuda_internal.h"
#include "services/gpu-runner/cuda/device.cuh"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* How many blocks split `keys` keys (tile a step) for `columns` block columns: enough for
 * ATTN_BLOCKS_PER_SM blocks a multiprocessor, at most max_splits and what the partial buffers hold
 * for `pairs` (token, head) pairs, at least 1; *kps is a split's keys (whole tiles). */
static uint32_t key_splits(const struct backend_dev *be, uint32_t columns, uint32_t keys, uint32_t tile,
			   uint32_t pairs, uint32_t max_splits, uint32_t *kps)
{
	uint32_t tiles = (uint32_t)(((uint64_t)keys + tile - 1) / tile);
	uint32_t splits = (ATTN_BLOCKS_PER_SM * (uint32_t)be->sm_count + columns - 1) / columns;
	if (splits > tiles)
		splits = tiles;
	if (splits > max_splits)
		splits = max_splits;
	if (splits > be->part_cap / pairs)
		splits = be->part_cap / pairs;
	if (splits < 1)
		splits = 1;
	*kps = (tiles + splits - 1) / splits * tile;
	return *kps ? (uint32_t)(((uint64_t)keys + *kps - 1) / *kps) : 1;
}

/* The keys the spans hold, at most what the kernels' 32-bit key offsets take. */
static int span_keys(struct backend_dev *be, const struct kv_span *spans, uint32_t n_spans, uint32_t *keys)
{
	uint64_t total = 0;
	for (uint32_t s = 0; s < n_spans; s++)
		total += spans[s].n_tokens;
	if (total > UINT32_MAX - 2 * ATTN_TILE)
		return cuda_failf(be, -EINVAL, "cuda backend: attn_blocks(layer %u): %llu keys in one call, at most %u",
				  be->layer, (unsigned long long)total, UINT32_MAX - 2 * ATTN_TILE);
	*keys = (uint32_t)total;
	return 0;
}

/* Room for `bytes` of span lists on the device (be->spanbuf grows in stream order) and in the
 * staging ring (*h, at *off), for one copy up. */
static int spans_stage(struct backend_dev *be, size_t bytes, char **h, size_t *off)
{
	if (bytes > be->spanbuf_bytes) {
		size_t cap = bytes > 2 * be->spanbuf_bytes ? bytes : 2 * be->spanbuf_bytes;
		void *nb = NULL;
		CUDA_TRY(be, "cudaMallocAsync (span list)", cudaMallocAsync(&nb, cap, be->stream));
		CUDA_TRY(be, "cudaFreeAsync (span list)", cudaFreeAsync(be->spanbuf, be->stream));
		be->spanbuf = nb;
		be->spanbuf_bytes = cap;
	}
	return up_alloc(be, bytes, h, off);
}

/* Spans then their key offsets, one copy up into be->spanbuf (which grows in stream order);
 * points a's spans and prefix at them. */
static int upload_spans(struct backend_dev *be, const struct kv_span *spans, uint32_t n_spans, attn_args *a)
{
	size_t sbytes = ((size_t)n_spans * sizeof(struct kv_span) + 15) / 16 * 16;
	size_t bytes = sbytes + ((size_t)n_spans + 1) * sizeof(uint32_t);
	char *h;
	size_t off;
	int rc = spans_stage(be, bytes, &h, &off);
	if (rc)
		return rc;
	memcpy(h, spans, (size_t)n_spans * sizeof(struct kv_span));
	uint32_t *prefix = (uint32_t *)(h + sbytes), acc = 0;
	for (uint32_t s = 0; s < n_spans; s++) {
		prefix[s] = acc;
		acc += spans[s].n_tokens;
	}
	prefix[n_spans] = acc;
	rc = up_send(be, be->spanbuf, h, off, bytes, "cudaMemcpyAsync (span list)");
	if (rc)
		return rc;
	a->spans = (const struct kv_span *)be->spanbuf;
	a->prefix = (const uint32_t *)((const char *)be->spanbuf + sbytes);
	return 0;
}

/* Attention of rows [r0, r0 + nr) of the step (one sequence's, at positions pos0..) over the spans. */
static int attention_rows(struct backend_dev *be, const struct kv_span *spans, uint32_t n_spans, uint32_t r0,
			  uint32_t nr, uint32_t pos0)
{
	const struct model_config *c = &be->cfg;
	uint32_t total = 0;
	int krc = span_keys(be, spans, n_spans, &total);
	if (krc)
		return krc;

	/* Blocks: one per (kv head, group of queries); split the keys when that leaves the GPU
	 * mostly idle (decode). Many queries per KV head (prefill) take the tensor cores. */
	uint32_t group = c->n_heads / c->n_kv_heads, pairs_g = nr * group, hd = c->head_dim;
	bool mma = be->attn_mma && be->p.kv_dtype == DT_BF16 && (hd == 64 || hd == 128) && pairs_g >= MMA_ROWS;

	attn_args a;
	a.inline_spans = !mma && n_spans <= ATTN_INLINE_SPANS;
	if (a.inline_spans) {
		/* The spans and their key offsets travel in the kernel's parameters. */
		memcpy(a.span_in, spans, (size_t)n_spans * sizeof(struct kv_span));
		uint32_t acc = 0;
		for (uint32_t s = 0; s < n_spans; s++) {
			a.prefix_in[s] = acc;
			acc += spans[s].n_tokens;
		}
		a.prefix_in[n_spans] = acc;
		a.spans = NULL;
		a.prefix = NULL;
	} else {
		int rc = upload_spans(be, spans, n_spans, &a);
		if (rc)
			return rc;
	}

	uint32_t nw = pairs_g < ATTN_MAX_WARPS ? pairs_g : ATTN_MAX_WARPS;
	uint32_t rows = mma ? MMA_ROWS : nw, tile = mma ? MMA_KEYS : ATTN_TILE;
	uint32_t qtiles = (pairs_g + rows - 1) / rows, base = c->n_kv_heads * qtiles;
	uint32_t pairs = nr * c->n_heads, kps;
	uint32_t splits = key_splits(be, base, total, tile, pairs, ATTN_MAX_SPLITS, &kps);

	a.q = be->qkv + (size_t)r0 * be->qkv_ld;
	a.q_ld = be->qkv_ld;
	a.arena = be->arena;
	a.block_elems = be->block_elems;
	a.block_tokens = be->p.block_tokens;
	a.kv_dim = be->kv_dim;
	a.n_spans = n_spans;
	a.total_keys = (uint32_t)total;
	a.keys_per_split = kps;
	a.n = nr;
	a.pos0 = pos0;
	a.n_heads = c->n_heads;
	a.group = group;
	a.head_dim = hd;
	a.window = c->sliding_window;
	a.qtiles = qtiles;
	a.scale = be->scale;
	float *st_m = be->st_m + (size_t)r0 * c->n_heads, *st_l = be->st_l + (size_t)r0 * c->n_heads;
	float *st_acc = be->st_acc + (size_t)r0 * c->n_heads * hd;
	a.m = st_m;
	a.l = st_l;
	a.acc = st_acc;
	a.pm = splits > 1 ? be->pm : NULL;
	/* Decode on the CUDA cores: the last split block merges (no second kernel). */
	a.merge_count = !mma && splits > 1 && be->fuse_x && base <= be->attn_count_n ? be->attn_count : NULL;
	a.pl = be->pl;
	a.pacc = be->pacc;
	a.seqs = NULL;
	a.early_keys = be->kv_settled && be->early_kv;
	a.tr = mma ? ktrace{NULL} : ktrace_next(be, "attention");
	dim3 grid(base, splits);
	if (mma) {
		attn_mma_launch(hd, a, grid, be->stream);
		LAUNCHED(be, "attn_mma_kernel");
	} else {
		be->two_warp_launches += attn_launch(be, a, grid, nw) == 2;
		LAUNCHED(be, "attn_kernel");
		be->early_kv_launches += a.early_keys && a.inline_spans;
	}
	if (splits > 1 && !a.merge_count) {
		attn_combine_launch(be, pairs, splits, st_m, st_l, st_acc);
		LAUNCHED(be, "attn_combine_kernel");
	}
	return 0;
}

/* ---- decode rows of several sequences in one launch ---------------------------------------- */

void attention_drop(struct backend_dev *be)
{
	be->pend_n = 0;
	be->pend_nseq = 0;
}

/* Holds back the spans of a one-row run for attention_flush; 1 when held, 0 when the run is not
 * for that (launched by the caller), < 0 on failure. */
static int hold(struct backend_dev *be, const struct kv_span *spans, uint32_t n_spans, uint32_t r0)
{
	const struct model_config *c = &be->cfg;
	if (be->n_runs < 2 || c->n_heads / c->n_kv_heads > ATTN_MAX_WARPS)
		return 0;
	/* A row's state is read and written by its blocks: one piece of it per launch. */
	for (uint32_t i = 0; i < be->pend_nseq; i++) {
		if (be->pend_seqs[i].row0 == r0) {
			int rc = attention_flush(be);
			if (rc)
				return rc;
			break;
		}
	}
	if (be->pend_n + n_spans > be->pend_cap) {
		uint32_t cap = be->pend_n + n_spans > 2 * be->pend_cap ? be->pend_n + n_spans : 2 * be->pend_cap;
		struct kv_span *ns = (struct kv_span *)realloc(be->pend_spans, (size_t)cap * sizeof(*ns));
		if (!ns)
			return cuda_failf(be, -ENOMEM, "cuda backend: out of memory for %u spans of decode attention", cap);
		be->pend_spans = ns;
		be->pend_cap = cap;
	}
	uint32_t total = 0;
	int krc = span_keys(be, spans, n_spans, &total);
	if (krc)
		return krc;
	memcpy(be->pend_spans + be->pend_n, spans, (size_t)n_spans * sizeof(*spans));
	be->pend_seqs[be->pend_nseq++] = (struct attn_seq){.row0 = r0, .n = 1, .pos0 = be->pos[r0],
							     .span0 = be->pend_n, .prefix0 = 0, .n_spans = n_spans,
							     .total_keys = total};
	be->pend_n += n_spans;
	return 1;
}

static int flush_held(struct backend_dev *be);

int attention_flush(struct backend_dev *be)
{
	if (!be->pend_nseq)
		return 0;
	/* Launched or not, they are no longer held: a failure fails the step (set_batch drops what a
	 * failed step held anyway), and a second try would only fail the calls after it. */
	int rc = flush_held(be);
	attention_drop(be);
	return rc;
}

static int flush_held(struct backend_dev *be)
{
	const uint32_t ns = be->pend_nseq;
	const struct model_config *c = &be->cfg;
	uint32_t max_keys = 0, n_prefix = 0;
	for (uint32_t i = 0; i < ns; i++) {
		struct attn_seq *d = &be->pend_seqs[i];
		d->prefix0 = n_prefix;
		n_prefix += d->n_spans + 1;
		max_keys = d->total_keys > max_keys ? d->total_keys : max_keys;
	}
	/* One copy up: the spans, their key offsets (each sequence's from 0), the sequences. */
	size_t sbytes = ((size_t)be->pend_n * sizeof(struct kv_span) + 15) / 16 * 16;
	size_t pbytes = ((size_t)n_prefix * sizeof(uint32_t) + 15) / 16 * 16;
	size_t bytes = sbytes + pbytes + (size_t)ns * sizeof(struct attn_seq);
	char *h;
	size_t off;
	int rc = spans_stage(be, bytes, &h, &off);
	if (rc)
		return rc;
	memcpy(h, be->pend_spans, (size_t)be->pend_n * sizeof(struct kv_span));
	uint32_t *prefix = (uint32_t *)(h + sbytes);
	for (uint32_t i = 0; i < ns; i++) {
		const struct attn_seq *d = &be->pend_seqs[i];
		uint32_t acc = 0;
		for (uint32_t s = 0; s < d->n_spans; s++) {
			prefix[d->prefix0 + s] = acc;
			acc += be->pend_spans[d->span0 + s].n_tokens;
		}
		prefix[d->prefix0 + d->n_spans] = acc;
	}
	memcpy(h + sbytes + pbytes, be->pend_seqs, (size_t)ns * sizeof(struct attn_seq));
	rc = up_send(be, be->spanbuf, h, off, bytes, "cudaMemcpyAsync (decode spans)");
	if (rc)
		return rc;

	attn_args a;
	memset(&a, 0, offsetof(attn_args, span_in));
	uint32_t group = c->n_heads / c->n_kv_heads, hd = c->head_dim;
	uint32_t nw = group, qtiles = 1, base = c->n_kv_heads * qtiles;
	/* Split the keys only while the sequences leave the GPU mostly idle, and only as far as the
	 * partial buffers (every row of the step) and the merge counters go (the last block of each
	 * column merges: no combine kernel for several sequences). */
	uint32_t kps, max_splits = be->fuse_x && base * ns <= be->attn_count_n ? ATTN_MAX_SPLITS : 1;
	uint32_t splits = key_splits(be, base * ns, max_keys, ATTN_TILE, be->n * c->n_heads, max_splits, &kps);
	a.q = be->qkv;
	a.q_ld = be->qkv_ld;
	a.arena = be->arena;
	a.block_elems = be->block_elems;
	a.block_tokens = be->p.block_tokens;
	a.kv_dim = be->kv_dim;
	a.spans = (const struct kv_span *)be->spanbuf;
	a.prefix = (const uint32_t *)((const char *)be->spanbuf + sbytes);
	a.seqs = (const struct attn_seq *)((const char *)be->spanbuf + sbytes + pbytes);
	a.inline_spans = 0;
	a.early_keys = 0;
	a.n_spans = 0; /* each sequence's own: seqs */
	a.total_keys = 0;
	a.pos0 = 0;
	a.keys_per_split = kps;
	a.n = be->n;
	a.n_heads = c->n_heads;
	a.group = group;
	a.head_dim = hd;
	a.window = c->sliding_window;
	a.qtiles = qtiles;
	a.scale = be->scale;
	a.m = be->st_m;
	a.l = be->st_l;
	a.acc = be->st_acc;
	a.pm = splits > 1 ? be->pm : NULL;
	a.pl = be->pl;
	a.pacc = be->pacc;
	a.merge_count = splits > 1 ? be->attn_count : NULL;
	a.tr = ktrace_next(be, "attention (several sequences)");
	dim3 grid(base, splits, ns);
	be->two_warp_launches += attn_launch(be, a, grid, nw) == 2;
	LAUNCHED(be, "attn_kernel (several sequences)");
	return 0;
}

/* The spans of one call may be for several sequences' rows (kv_span's rows): a launch per run of
 * spans with the same rows, except the one-row runs of a step of several sequences (decode),
 * which wait for attention_flush to go in one launch. Spans for every row (n_rows 0) take the
 * whole step. */
int attention_blocks(struct backend_dev *be, const struct kv_span *spans, uint32_t n_spans)
{
	for (uint32_t s = 0; s < n_spans;) {
		uint32_t e = s + 1;
		while (e < n_spans && spans[e].row0 == spans[s].row0 && spans[e].n_rows == spans[s].n_rows)
			e++;
		uint32_t r0 = spans[s].n_rows ? spans[s].row0 : 0, nr = spans[s].n_rows ? spans[s].n_rows : be->n;
		int rc = nr == 1 && spans[s].n_rows ? hold(be, spans + s, e - s, r0) : 0;
		if (rc < 0)
			return rc;
		if (!rc && (rc = attention_rows(be, spans + s, e - s, r0, nr, be->pos[r0])) != 0)
			return rc;
		s = e;
	}
	return 0;
}

/* attn_end: att = acc / l per (token, head), in the dtype of o_proj. A query with no weight saw
 * no keys (its own block was not visited): flagged for the host (its row: pos0 0), output 0. Grid (n, slices):
 * the slices of a block row share a token's values. */
template <typename TO>
__global__ void __launch_bounds__(256) attn_out_kernel(const float *l, const float *acc, uint32_t n_heads,
							uint32_t hd, TO *out, struct dev_status *st, uint32_t layer,
							uint32_t pos0)
{
	const uint32_t t = blockIdx.x;
	const size_t base = (size_t)t * n_heads * hd;
	grid_launch_next();
	grid_wait();
	for (uint32_t i = blockIdx.y * blockDim.x + threadIdx.x; i < n_heads * hd; i += gridDim.y * blockDim.x) {
		float lv = l[(size_t)t * n_heads + i / hd];
		float v = 0.0f;
		if (lv > 0.0f) {
			v = acc[base + i] / lv;
		} else if (atomicCAS(&st->err, 0, 1) == 0) {
			st->err_layer = layer;
			st->err_pos = pos0 + t;
		}
		out[base + i] = from_f32<TO>(v);
	}
}

void attn_out_launch(uint32_t ot, const struct backend_dev *be, cudaStream_t s)
{
	const struct model_config *c = &be->cfg;
	const uint32_t n = be->n, q_dim = c->n_heads * c->head_dim;
	/* Few tokens (decode): a block per 256 values of a token, not one block for all of them. */
	const unsigned threads = small_grid(n) ? 256 : 128;
	const dim3 grid(n, small_grid(n) ? (q_dim + threads - 1) / threads : 1);
	const float *l = be->st_l, *acc = be->st_acc;
	if (ot == DT_BF16)
		launch_k(be->pdl, attn_out_kernel<__nv_bfloat16>, grid, threads, 0, s, l, acc, c->n_heads, c->head_dim,
			 (__nv_bfloat16 *)be->xa, be->status, be->layer, 0u);
	else if (ot == DT_F16)
		launch_k(be->pdl, attn_out_kernel<__half>, grid, threads, 0, s, l, acc, c->n_heads, c->head_dim,
			 (__half *)be->xa, be->status, be->layer, 0u);
	else
		launch_k(be->pdl, attn_out_kernel<float>, grid, threads, 0, s, l, acc, c->n_heads, c->head_dim,
			 (float *)be->xa, be->status, be->layer, 0u);
}

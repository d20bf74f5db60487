/* backend.c - the front of every backend (backend.h): the checks a call gets before an
 * implementation sees it (the order of a forward step's calls, ranges of layers, arena blocks
 * and token ids, the weights a call needs), and the defaults for what an implementation leaves
 * out (backend_impl.h). Both backends share these checks, so their messages are the same.
 */
#include "services/gpu-runner/backend_impl.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef PIPELINE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define BACKEND_ERR_MAX 512

/* Where a forward step stands: the order of calls backend.h prescribes. */
enum phase {
	PHASE_IDLE = 0,	 /* no batch embedded yet */
	PHASE_READY = 1, /* hidden state holds a batch: attn_begin, ffn or logits may follow */
	PHASE_ATTN = 2,	 /* between attn_begin and attn_end */
	PHASE_MOE = 3,	 /* between moe_route and moe_end */
};

struct backend {
	const struct backend_impl *impl;
	struct backend_dev *dev;
	struct model_config cfg;
	struct backend_params p;
	enum phase phase;
	uint32_t n;	  /* tokens of the batch in flight */
	uint32_t n_runs;  /* its sequences */
	uint32_t *run_end; /* (max_chunk) the row after each sequence's last */
	uint32_t pos0;	  /* position of its first token */
	uint32_t layer;	  /* between attn_begin and attn_end */
	/* Between moe_route and moe_end: the lowest expert moe_expert and moe_expert_cpu may take (each
	 * side's experts in increasing order: the order of its sum), and the experts taken by either. */
	uint32_t next_expert, next_expert_cpu;
	bool *expert_taken; /* (n_experts) */
	uint32_t *share_r;  /* (n_experts) r + 1 of an expert whose CPU share moe_expert_cpu_share gave; 0: none */
	float *logits;	  /* (vocab_size) for logits_argmax on a backend without its own */
	uint32_t rows[ROLE_COUNT], cols[ROLE_COUNT]; /* each role's shape in this model (a vector: one row) */
	char err[BACKEND_ERR_MAX];
};

__attribute__((format(printf, 3, 4))) static int fail(struct backend *be, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int k = snprintf(be->err, sizeof(be->err), "%s backend: ", be->impl->name);
	if (k < 0 || (size_t)k >= sizeof(be->err))
		k = 0;
	vsnprintf(be->err + k, sizeof(be->err) - (size_t)k, fmt, ap);
	va_end(ap);
	return rc;
}

/* An implementation's call returned rc: keep its message. */
static int impl_rc(struct backend *be, int rc)
{
	if (rc < 0)
		snprintf(be->err, sizeof(be->err), "%s", be->impl->error(be->dev));
	return rc;
}

void weight_tensor_set(struct weight_tensor *t, enum weight_place place, const void *data, enum dtype format,
		       uint32_t rows, uint32_t cols)
{
	memset(t, 0, sizeof(*t));
	t->data[place] = data;
	t->format = format;
	t->rows = rows;
	t->cols = cols;
	t->row_bytes = dtype_row_bytes(format, cols);
}

/* ---- registry and creation ------------------------------------------------------------- */

const struct backend_impl *backend_impl_find(const char *name)
{
	if (!name)
		return NULL;
	if (!strcmp(name, backend_ref_impl.name))
		return &backend_ref_impl;
#ifdef PIPELINE_HAVE_CUDA
	if (!strcmp(name, backend_cuda_impl.name))
		return &backend_cuda_impl;
#endif
	/* Without nvcc "cuda" is an unbuilt backend and gets NULL, like any unknown name. */
	return NULL;
}

const char *backend_default_name(void)
{
#ifdef PIPELINE_HAVE_CUDA
	/* No driver, no device, or a driver too old for the runtime: all mean the C backend. */
	int count = 0;
	if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0)
		return backend_cuda_impl.name;
	cudaGetLastError(); /* the failure is not sticky: leave no error behind for later calls */
#endif
	return backend_ref_impl.name;
}

int backend_use_device(const char *name, int gpu, char *err, size_t errlen)
{
	if (!name || strcmp(name, "cuda")) {
		snprintf(err, errlen, "--gpu %d: the %s backend computes on no GPU", gpu, name ? name : "(none)");
		return -EINVAL;
	}
#ifdef PIPELINE_HAVE_CUDA
	int count = 0;
	if (cudaGetDeviceCount(&count) != cudaSuccess || gpu >= count) {
		cudaGetLastError();
		snprintf(err, errlen, "--gpu %d: this machine has %d CUDA device%s", gpu, count, count == 1 ? "" : "s");
		return -ENODEV;
	}
	cudaError_t e = cudaSetDevice(gpu);
	if (e != cudaSuccess) {
		cudaGetLastError();
		snprintf(err, errlen, "--gpu %d: %s", gpu, cudaGetErrorString(e));
		return -ENODEV;
	}
	return 0;
#else
	snprintf(err, errlen, "--gpu %d: this gpu-runner is built without CUDA", gpu);
	return -ENODEV;
#endif
}

bool backend_known(const char *name)
{
	return backend_impl_find(name) != NULL;
}

size_t backend_kv_block_bytes(const char *name, const struct model_config *cfg, const struct backend_params *p)
{
	const struct backend_impl *impl = backend_impl_find(name);
	return impl ? impl->kv->block_bytes(cfg, p) : 0;
}

int backend_check_config(const char *name, const struct model_config *c, const struct backend_params *p, char *err,
			 size_t errlen)
{
	if (!c->n_layers || !c->dim || !c->n_heads || !c->n_kv_heads || !c->head_dim || !c->ffn_dim ||
	    !c->vocab_size) {
		snprintf(err, errlen,
			 "%s backend: model config has a zero size (layers %u, dim %u, heads %u, kv heads %u, "
			 "head_dim %u, ffn %u, vocab %u)", name, c->n_layers, c->dim, c->n_heads, c->n_kv_heads,
			 c->head_dim, c->ffn_dim, c->vocab_size);
		return -EINVAL;
	}
	if (c->n_heads % c->n_kv_heads) {
		snprintf(err, errlen, "%s backend: %u attention heads are not a multiple of %u kv heads", name,
			 c->n_heads, c->n_kv_heads);
		return -EINVAL;
	}
	if (!(c->rms_eps >= 0.0f) || !isfinite(c->rms_eps)) {
		snprintf(err, errlen, "%s backend: rms_norm_eps %g is not a finite number >= 0", name, (double)c->rms_eps);
		return -EINVAL;
	}
	if (!p->max_chunk || !p->block_tokens || !p->n_kv_blocks) {
		snprintf(err, errlen, "%s backend: max_chunk %u, block_tokens %u and n_kv_blocks %u must all be > 0",
			 name, p->max_chunk, p->block_tokens, p->n_kv_blocks);
		return -EINVAL;
	}
	if (c->rope_layout > ROPE_ADJACENT) {
		snprintf(err, errlen, "%s backend: rope layout %u is unknown", name, c->rope_layout);
		return -EINVAL;
	}
	if (p->gemv > BACKEND_GEMV_DP4A_REGS || p->attn > BACKEND_ATTN_SIMPLE || p->fuse > BACKEND_FUSE_ROWS_APART) {
		snprintf(err, errlen, "%s backend: unknown kernel choice (gemv %u, attn %u, fuse %u)", name, p->gemv,
			 p->attn, p->fuse);
		return -EINVAL;
	}
	return 0;
}

int backend_create(const char *name, const struct model_config *cfg, const struct backend_params *p,
		   struct backend **out, char *err, size_t errlen)
{
	assert(cfg && p && out && err);
	*out = NULL;
	const struct backend_impl *impl = backend_impl_find(name);
	if (!impl) {
		snprintf(err, errlen, "backend '%s' is not built into this binary", name ? name : "(none)");
		return -ENOENT;
	}
	int rc = backend_check_config(impl->name, cfg, p, err, errlen);
	if (rc)
		return rc;
	struct backend *be = calloc(1, sizeof(*be));
	if (!be) {
		snprintf(err, errlen, "%s backend: out of memory for the backend state", impl->name);
		return -ENOMEM;
	}
	be->impl = impl;
	be->cfg = *cfg;
	be->p = *p;
	if (!(be->run_end = calloc(p->max_chunk, sizeof(uint32_t))) ||
	    !(be->expert_taken = calloc(cfg->n_experts ? cfg->n_experts : 1, sizeof(bool))) ||
	    !(be->share_r = calloc(cfg->n_experts ? cfg->n_experts : 1, sizeof(uint32_t)))) {
		free(be->expert_taken);
		free(be->run_end);
		free(be);
		snprintf(err, errlen, "%s backend: out of memory for the backend state", impl->name);
		return -ENOMEM;
	}
	for (uint32_t r = 0; r < ROLE_COUNT; r++) {
		uint32_t ndim;
		uint64_t shape[2];
		int src = model_expected_shape(cfg, (enum tensor_role)r, &ndim, shape);
		assert(src == 0);
		(void)src;
		be->rows[r] = ndim == 1 ? 1 : (uint32_t)shape[0];
		be->cols[r] = (uint32_t)(ndim == 1 ? shape[0] : shape[1]);
	}
	rc = impl->create(cfg, p, &be->dev, err, errlen);
	if (rc) {
		free(be->share_r);
		free(be->expert_taken);
		free(be->run_end);
		free(be);
		return rc;
	}
	*out = be;
	return 0;
}

void backend_destroy(struct backend **bep)
{
	if (!bep || !*bep)
		return;
	struct backend *be = *bep;
	be->impl->destroy(&be->dev);
	free(be->logits);
	free(be->share_r);
	free(be->expert_taken);
	free(be->run_end);
	free(be);
	*bep = NULL;
}

const struct backend_impl *backend_impl_of(const struct backend *be)
{
	return be->impl;
}

struct backend_dev *backend_dev_of(struct backend *be)
{
	return be->dev;
}

const char *backend_name(const struct backend *be)
{
	return be->impl->name;
}

const char *backend_error(const struct backend *be)
{
	return be->err;
}

enum weight_place backend_weight_place(const struct backend *be)
{
	return be->impl->place;
}

struct CUstream_st *backend_cuda_stream(const struct backend *be)
{
	return be->impl->cuda_stream ? be->impl->cuda_stream(be->dev) : NULL;
}

/* ---- checks of a forward step ---------------------------------------------------------- */

/* Tensor t of role r is there, in a known format, readable at place, holding rows [row0, row0 +
 * rows) and columns [col0, col0 + cols) of the checkpoint's tensor, in whole blocks, each row at
 * least its columns' bytes long (compact: exactly). Matrices may be stored in a block format
 * (whole blocks per row); norm vectors are read element by element, so they must be F32, F16 or
 * BF16. `which` names a share ("" for a whole tensor). */
static int check_tensor(struct backend *be, const struct weight_tensor *t, enum tensor_role r, enum weight_place place,
			uint32_t row0, uint32_t rows, uint32_t col0, uint32_t cols, bool compact, const char *what,
			const char *which)
{
	if (!t->rows || !t->data[place])
		return fail(be, -EINVAL, "%s: weights have no %s%s tensor%s", what, which, tensor_role_name(r),
			    t->rows ? place == PLACE_HOST ? " in host memory" : " in device memory" : "");
	if (t->format >= DT_COUNT)
		return fail(be, -EINVAL, "%s: %s%s tensor has unknown dtype %u", what, which, tensor_role_name(r),
			    t->format);
	enum dtype f = (enum dtype)t->format;
	bool vector = r == ROLE_ATTN_NORM || r == ROLE_FFN_NORM || r == ROLE_FINAL_NORM || r == ROLE_Q_NORM ||
		      r == ROLE_K_NORM;
	if (vector && !dtype_is_element(f))
		return fail(be, -EINVAL, "%s: %s tensor is %s: norm weights must be F32, F16 or BF16", what,
			    tensor_role_name(r), dtype_name(f));
	uint32_t blk = dtype_block_elems(f);
	if (t->cols % blk || t->col0 % blk)
		return fail(be, -EINVAL, "%s: %s%s tensor has rows of %u elements from column %u, not whole %s blocks "
			    "of %u", what, which, tensor_role_name(r), t->cols, t->col0, dtype_name(f), blk);
	uint64_t need = dtype_row_bytes(f, t->cols);
	if (t->row0 != row0 || t->rows != rows || t->col0 != col0 || t->cols != cols ||
	    (compact ? t->row_bytes != need : t->row_bytes < need))
		return fail(be, -EINVAL,
			    "%s: %s%s tensor holds rows %u..%u, columns %u..%u (%llu bytes a row); expected rows %u..%u, "
			    "columns %u..%u in %s (%s%llu bytes a row)", what, which, tensor_role_name(r), t->row0,
			    t->row0 + t->rows, t->col0, t->col0 + t->cols, (unsigned long long)t->row_bytes, row0,
			    row0 + rows, col0, col0 + cols, dtype_name(f), compact ? "" : "at least ",
			    (unsigned long long)need);
	return 0;
}

/* The tensors of `roles` are there and whole, readable where the backend reads them (the
 * embedding table: on the host). */
static int check_roles(struct backend *be, const struct group_weights *w, const enum tensor_role *roles, uint32_t n,
		       const char *what)
{
	for (uint32_t i = 0; i < n; i++) {
		enum tensor_role r = roles[i];
		enum weight_place place = r == ROLE_EMBED ? PLACE_HOST : be->impl->place;
		int rc = check_tensor(be, &w->t[r], r, place, 0, be->rows[r], 0, be->cols[r], true, what, "");
		if (rc)
			return rc;
	}
	return 0;
}

/* The second share of a split (struct ffn_split s, roles as check_split_as's): where it is computed,
 * r, and its three tensors at that place. */
static int check_second_share(struct backend *be, const struct ffn_split *s, uint32_t ffn,
			      const enum tensor_role roles[3], const char *what)
{
	uint32_t dim = be->cfg.dim, r = s->r;
	const enum tensor_role gr = roles[0], ur = roles[1], dr = roles[2];
	if (s->where != FFN_SPLIT_CPU && s->where != FFN_SPLIT_BACKEND)
		return fail(be, -EINVAL, "%s: unknown split %u", what, s->where);
	if (s->where == FFN_SPLIT_CPU) {
		if (!be->p.cpu_pool)
			return fail(be, -ENOTSUP, "%s: a CPU share needs a CPU pool (backend_params.cpu_pool), and this "
				    "backend was made without one", what);
		if (be->n > FFN_SPLIT_MAX_TOKENS)
			return fail(be, -EINVAL, "%s: a CPU share of a %u-token step (at most %u)", what, be->n,
				    FFN_SPLIT_MAX_TOKENS);
	}
	if (s->down.format >= DT_COUNT)
		return fail(be, -EINVAL, "%s: the second share's down tensor has unknown dtype %u", what, s->down.format);
	uint32_t unit = ffn_split_unit((enum dtype)s->down.format);
	if (r >= ffn || r % unit)
		return fail(be, -EINVAL, "%s: split at intermediate row %u of %u: it must be below %u and a multiple of "
			    "%u (%s down_proj)", what, r, ffn, ffn, unit, dtype_name((enum dtype)s->down.format));
	enum weight_place rest = s->where == FFN_SPLIT_CPU ? PLACE_HOST : be->impl->place;
	int rc;
	if ((rc = check_tensor(be, &s->gate, gr, rest, r, ffn - r, 0, dim, false, what, "second share's ")) ||
	    (rc = check_tensor(be, &s->up, ur, rest, r, ffn - r, 0, dim, false, what, "second share's ")))
		return rc;
	return check_tensor(be, &s->down, dr, rest, 0, dim, r, ffn - r, false, what, "second share's ");
}

/* The shares of a split FFN (struct ffn_split) and the step it is asked for: an FFN's (roles
 * ROLE_W_*, ffn = ffn_dim, what "ffn") or a routed expert's (ROLE_EXPERT_*, its intermediate rows,
 * "expert"). */
static int check_split_as(struct backend *be, const struct group_weights *w, uint32_t ffn,
			  const enum tensor_role roles[3], const char *what)
{
	const struct ffn_split *s = &w->split;
	uint32_t dim = be->cfg.dim, r = s->r;
	const enum tensor_role gr = roles[0], ur = roles[1], dr = roles[2];
	int rc = check_second_share(be, s, ffn, roles, what);
	if (rc || r == 0)
		return rc;
	const struct weight_tensor *g = &w->t[gr], *u = &w->t[ur], *d = &w->t[dr];
	enum weight_place own = be->impl->place;
	if ((rc = check_tensor(be, g, gr, own, 0, r, 0, dim, false, what, "first share's ")) ||
	    (rc = check_tensor(be, u, ur, own, 0, r, 0, dim, false, what, "first share's ")) ||
	    (rc = check_tensor(be, d, dr, own, 0, dim, 0, r, false, what, "first share's ")))
		return rc;
	if (g->format != s->gate.format || u->format != s->up.format || d->format != s->down.format)
		return fail(be, -EINVAL, "%s: the shares of a split FFN differ in format (gate %s/%s, up %s/%s, down "
			    "%s/%s)", what, dtype_name((enum dtype)g->format), dtype_name((enum dtype)s->gate.format),
			    dtype_name((enum dtype)u->format), dtype_name((enum dtype)s->up.format),
			    dtype_name((enum dtype)d->format), dtype_name((enum dtype)s->down.format));
	return 0;
}

static int check_split(struct backend *be, const struct group_weights *w)
{
	static const enum tensor_role roles[] = {ROLE_W_GATE, ROLE_W_UP, ROLE_W_DOWN};
	return check_split_as(be, w, be->cfg.ffn_dim, roles, "ffn");
}

static const char *phase_text(enum phase ph, const char *attn)
{
	return ph == PHASE_IDLE ? "before embed" : ph == PHASE_MOE ? "between moe_route and moe_end" : attn;
}

/* ---- compute ----------------------------------------------------------------------------- */

/* The batch a step starts with (embed, hidden_in): its size, positions, sequences and token ids. */
static int check_batch(struct backend *be, const struct backend_batch *b, const char *what)
{
	uint32_t n = b->n;
	if (n == 0 || n > be->p.max_chunk)
		return fail(be, -EINVAL, "%s: chunk of %u tokens (must be 1..%u, max_chunk)", what, n, be->p.max_chunk);
	bool multi = be->impl->compute->logits_rows != NULL;
	uint32_t runs = 0;
	for (uint32_t t = 0; t < n; t++) {
		if (b->tokens[t] < 0 || (uint32_t)b->tokens[t] >= be->cfg.vocab_size)
			return fail(be, -EINVAL, "%s: token id %d at chunk index %u is outside the vocabulary (0..%u)",
				    what, b->tokens[t], t, be->cfg.vocab_size - 1);
		if (t > 0 && b->seq[t] == b->seq[t - 1]) {
			if (b->pos[t - 1] == UINT32_MAX || b->pos[t] != b->pos[t - 1] + 1)
				return fail(be, -EINVAL,
					    "%s: token %u is at position %u of sequence %u, the one before it at %u: a "
					    "sequence's tokens are at consecutive positions", what, t, b->pos[t], b->seq[t],
					    b->pos[t - 1]);
			continue;
		}
		/* A new run: its sequence must not have had one before. */
		for (uint32_t u = 0; u < t; u++)
			if (b->seq[u] == b->seq[t])
				return fail(be, -EINVAL, "%s: sequence %u has tokens at chunk indexes %u and %u with "
					    "another sequence's between: a sequence's tokens are one run", what, b->seq[t],
					    u, t);
		if (++runs > 1 && !multi)
			return fail(be, -ENOTSUP, "%s: token %u is of sequence %u, token 0 of sequence %u: the %s "
				    "backend takes one sequence a step", what, t, b->seq[t], b->seq[0], be->impl->name);
	}
	return 0;
}

/* The batch in flight: its size, first position and sequences' rows (check_batch has checked it). */
static void set_runs(struct backend *be, const struct backend_batch *b)
{
	be->n = b->n;
	be->pos0 = b->pos[0];
	be->n_runs = 0;
	for (uint32_t t = 0; t < b->n; t++) {
		if (t > 0 && b->seq[t] != b->seq[t - 1])
			be->run_end[be->n_runs++] = t;
	}
	be->run_end[be->n_runs++] = b->n;
}

bool backend_name_batches(const char *name)
{
	const struct backend_impl *impl = name ? backend_impl_find(name) : NULL;
	return impl && impl->compute->logits_rows;
}

bool backend_batches_sequences(const struct backend *be)
{
	return be->impl->compute->logits_rows != NULL;
}

int backend_embed(struct backend *be, const struct group_weights *w, const struct backend_batch *b)
{
	static const enum tensor_role roles[] = {ROLE_EMBED};
	assert(w && b && (b->n == 0 || (b->tokens && b->pos && b->seq)));
	int rc = check_roles(be, w, roles, 1, "embed");
	if (rc || (rc = check_batch(be, b, "embed")))
		return rc;
	rc = be->impl->compute->embed(be->dev, w, b);
	if (rc)
		return impl_rc(be, rc);
	set_runs(be, b);
	be->phase = PHASE_READY;
	return 0;
}

int backend_hidden_in(struct backend *be, const struct backend_batch *b, const float *x)
{
	assert(b && (b->n == 0 || (b->tokens && b->pos && b->seq)));
	if (!be->impl->compute->hidden_in)
		return fail(be, -ENOTSUP, "hidden_in: this backend does not compute a stage of a split model");
	if (be->phase == PHASE_ATTN || be->phase == PHASE_MOE)
		return fail(be, -EINVAL, "hidden_in called %s", phase_text(be->phase, "between attn_begin and attn_end"));
	int rc = check_batch(be, b, "hidden_in");
	if (rc)
		return rc;
	if (!x && !be->impl->compute->hidden_device)
		return fail(be, -EINVAL, "hidden_in: no rows given, and the backend has no device memory they could be in");
	rc = be->impl->compute->hidden_in(be->dev, b, x);
	if (rc)
		return impl_rc(be, rc);
	set_runs(be, b);
	be->phase = PHASE_READY;
	return 0;
}

/* Rows [row0, row0 + n) of the step in flight, between layers. */
static int check_rows(struct backend *be, uint32_t row0, uint32_t n, const char *what)
{
	if (!be->impl->compute->hidden_get)
		return fail(be, -ENOTSUP, "%s: this backend does not compute a stage of a split model", what);
	if (be->phase != PHASE_READY)
		return fail(be, -EINVAL, "%s called %s", what, phase_text(be->phase, "between attn_begin and attn_end"));
	if (n == 0 || row0 > be->n || n > be->n - row0)
		return fail(be, -EINVAL, "%s: rows %u..%u of a step of %u tokens", what, row0, row0 + n, be->n);
	return 0;
}

int backend_hidden_get(struct backend *be, uint32_t row0, uint32_t n, float *x)
{
	assert(x);
	int rc = check_rows(be, row0, n, "hidden_get");
	return rc ? rc : impl_rc(be, be->impl->compute->hidden_get(be->dev, row0, n, x));
}

int backend_hidden_put(struct backend *be, uint32_t row0, uint32_t n, const float *x)
{
	assert(x);
	int rc = check_rows(be, row0, n, "hidden_put");
	return rc ? rc : impl_rc(be, be->impl->compute->hidden_put(be->dev, row0, n, x));
}

int backend_finish(struct backend *be)
{
	return be->impl->compute->finish ? impl_rc(be, be->impl->compute->finish(be->dev)) : 0;
}

int backend_hidden_device(struct backend *be, float **x, struct CUstream_st **stream)
{
	if (!be->impl->compute->hidden_device || !be->impl->cuda_stream)
		return fail(be, -ENOTSUP, "hidden_device: the %s backend keeps its hidden state in host memory",
			    be->impl->name);
	int rc = be->impl->compute->hidden_device(be->dev, x);
	if (rc)
		return impl_rc(be, rc);
	*stream = be->impl->cuda_stream(be->dev);
	return 0;
}

int backend_attn_begin(struct backend *be, const struct group_weights *w, uint32_t layer, const uint32_t *dst_block,
		       const uint32_t *dst_row)
{
	static const enum tensor_role roles[] = {ROLE_ATTN_NORM, ROLE_WQ, ROLE_WK, ROLE_WV, ROLE_WO, ROLE_Q_NORM,
						 ROLE_K_NORM};
	assert(w && dst_block && dst_row);
	/* The call order is checked in release builds too: a wrong order from the engine would
	 * otherwise compute silently wrong tokens. */
	if (be->phase != PHASE_READY)
		return fail(be, -EINVAL, "attn_begin(layer %u) called %s", layer,
			    phase_text(be->phase, "before attn_end of the previous layer"));
	if (layer >= be->cfg.n_layers)
		return fail(be, -EINVAL, "attn_begin: layer %u of a %u-layer model", layer, be->cfg.n_layers);
	int rc = check_roles(be, w, roles, (be->cfg.flags & MODEL_QK_NORM) ? 7 : 5, "attention");
	if (rc)
		return rc;
	for (uint32_t t = 0; t < be->n; t++)
		if (dst_block[t] >= be->p.n_kv_blocks || dst_row[t] >= be->p.block_tokens)
			return fail(be, -EINVAL, "attn_begin(layer %u): token %u goes to block %u row %u, outside the "
				    "arena (%u blocks of %u rows)", layer, t, dst_block[t], dst_row[t], be->p.n_kv_blocks,
				    be->p.block_tokens);
	rc = be->impl->compute->attn_begin(be->dev, w, layer, dst_block, dst_row);
	if (rc)
		return impl_rc(be, rc);
	be->layer = layer;
	be->phase = PHASE_ATTN;
	return 0;
}

int backend_attn_blocks(struct backend *be, const struct kv_span *spans, uint32_t n_spans)
{
	assert(spans || n_spans == 0);
	if (be->phase != PHASE_ATTN)
		return fail(be, -EINVAL, "attn_blocks called outside attn_begin .. attn_end");
	for (uint32_t s = 0; s < n_spans; s++) {
		const struct kv_span *sp = &spans[s];
		if (sp->block >= be->p.n_kv_blocks || sp->n_tokens == 0 || sp->n_tokens > be->p.block_tokens ||
		    (uint64_t)sp->pos0 + sp->n_tokens > UINT32_MAX)
			return fail(be, -EINVAL,
				    "attn_blocks(layer %u): span %u (block %u, positions from %u, %u tokens) does not fit "
				    "the arena (%u blocks of %u rows)", be->layer, s, sp->block, sp->pos0, sp->n_tokens,
				    be->p.n_kv_blocks, be->p.block_tokens);
		if (sp->n_rows && (sp->row0 >= be->n || sp->n_rows > be->n - sp->row0))
			return fail(be, -EINVAL, "attn_blocks(layer %u): span %u is for rows %u..%u of a step of %u",
				    be->layer, s, sp->row0, sp->row0 + sp->n_rows, be->n);
		if (sp->n_rows && sp->n_rows != be->n && !be->impl->compute->logits_rows)
			return fail(be, -ENOTSUP, "attn_blocks(layer %u): span %u is for rows %u..%u of %u: the %s backend "
				    "attends every row to every span", be->layer, s, sp->row0, sp->row0 + sp->n_rows, be->n,
				    be->impl->name);
		/* With several sequences, a span is for rows of one of them (its KV). */
		if (be->n_runs > 1) {
			uint32_t k = 0;
			while (k + 1 < be->n_runs && be->run_end[k] <= sp->row0)
				k++;
			if (!sp->n_rows || sp->row0 + sp->n_rows > be->run_end[k])
				return fail(be, -EINVAL, "attn_blocks(layer %u): span %u is for rows %u..%u of a step of %u "
					    "sequences: a span's rows are those of one sequence (one ends at row %u)", be->layer,
					    s, sp->row0, sp->row0 + (sp->n_rows ? sp->n_rows : be->n), be->n_runs,
					    be->run_end[k]);
		}
	}
	if (n_spans == 0)
		return 0;
	return impl_rc(be, be->impl->compute->attn_blocks(be->dev, spans, n_spans));
}

int backend_attn_end(struct backend *be, const struct group_weights *w)
{
	static const enum tensor_role roles[] = {ROLE_WO};
	assert(w);
	if (be->phase != PHASE_ATTN)
		return fail(be, -EINVAL, "attn_end called without attn_begin");
	int rc = check_roles(be, w, roles, 1, "attention");
	if (rc)
		return rc;
	rc = be->impl->compute->attn_end(be->dev, w);
	if (rc)
		return impl_rc(be, rc);
	be->phase = PHASE_READY;
	return 0;
}

int backend_ffn(struct backend *be, const struct group_weights *w)
{
	static const enum tensor_role roles[] = {ROLE_FFN_NORM, ROLE_W_GATE, ROLE_W_UP, ROLE_W_DOWN};
	assert(w);
	if (be->phase != PHASE_READY)
		return fail(be, -EINVAL, "ffn called %s", phase_text(be->phase, "between attn_begin and attn_end"));
	if (be->cfg.n_experts)
		return fail(be, -EINVAL, "ffn called on a mixture-of-experts model (its layers take moe_route, "
			    "moe_expert and moe_end)");
	/* A split FFN's norm is whole; its matrices are shares. */
	int rc = check_roles(be, w, roles, w->split.where == FFN_SPLIT_NONE ? 4 : 1, "ffn");
	if (rc == 0 && w->split.where != FFN_SPLIT_NONE)
		rc = check_split(be, w);
	if (rc)
		return rc;
	return impl_rc(be, be->impl->compute->ffn(be->dev, w));
}

int backend_moe_route(struct backend *be, const struct group_weights *w)
{
	static const enum tensor_role roles[] = {ROLE_FFN_NORM, ROLE_ROUTER};
	assert(w);
	if (be->phase != PHASE_READY)
		return fail(be, -EINVAL, "moe_route called %s", phase_text(be->phase, "between attn_begin and attn_end"));
	if (!be->cfg.n_experts)
		return fail(be, -EINVAL, "moe_route called on a dense model");
	if (!be->impl->compute->moe_route)
		return fail(be, -ENOTSUP, "mixture-of-experts layers are not computed on this backend");
	int rc = check_roles(be, w, roles, 2, "moe");
	if (rc)
		return rc;
	rc = be->impl->compute->moe_route(be->dev, w);
	if (rc)
		return impl_rc(be, rc);
	be->next_expert = be->next_expert_cpu = 0;
	memset(be->expert_taken, 0, be->cfg.n_experts * sizeof(bool));
	memset(be->share_r, 0, be->cfg.n_experts * sizeof(uint32_t));
	be->phase = PHASE_MOE;
	return 0;
}

int backend_moe_expert(struct backend *be, const struct group_weights *w, uint32_t expert)
{
	static const enum tensor_role roles[] = {ROLE_EXPERT_GATE, ROLE_EXPERT_UP, ROLE_EXPERT_DOWN};
	assert(w);
	if (be->phase != PHASE_MOE)
		return fail(be, -EINVAL, "moe_expert(%u) called outside moe_route .. moe_end", expert);
	if (expert >= be->cfg.n_experts || expert < be->next_expert || be->expert_taken[expert])
		return fail(be, -EINVAL, "moe_expert(%u): experts come in increasing order, each once (on the GPU or the "
			    "CPU), below %u (next: %u or later)", expert, be->cfg.n_experts, be->next_expert);
	int rc;
	if (w->split.where != FFN_SPLIT_NONE) {
		/* Split between this backend (rows [0, r)) and the CPU pool (the rest, in host memory): a
		 * decode step's, where the backend computes experts on the CPU. */
		if (w->split.where != FFN_SPLIT_CPU || !be->impl->compute->moe_expert_cpu)
			return fail(be, -ENOTSUP, "moe_expert(%u): the %s backend splits an expert only with the CPU pool",
				    expert, be->impl->name);
		rc = check_split_as(be, w, be->rows[ROLE_EXPERT_GATE], roles, "expert");
	} else {
		rc = check_roles(be, w, roles, 3, "expert");
	}
	if (rc)
		return rc;
	if (be->share_r[expert]) {
		/* Its CPU share went to the pool at the route (moe_expert_cpu_share): this visit must be the
		 * same split, and the implementation computes the first share only. */
		if (w->split.where != FFN_SPLIT_CPU || w->split.r != be->share_r[expert] - 1)
			return fail(be, -EPROTO, "moe_expert(%u): its CPU share of rows [%u, ...) was given already, and "
				    "this visit is %s%u", expert, be->share_r[expert] - 1,
				    w->split.where == FFN_SPLIT_CPU ? "split at row " : "whole: rows ",
				    w->split.where == FFN_SPLIT_CPU ? w->split.r : be->rows[ROLE_EXPERT_GATE]);
		struct group_weights given = *w;
		given.split.where = FFN_SPLIT_GIVEN;
		rc = be->impl->compute->moe_expert(be->dev, &given, expert);
	} else {
		rc = be->impl->compute->moe_expert(be->dev, w, expert);
	}
	if (rc)
		return impl_rc(be, rc);
	be->next_expert = expert + 1;
	be->expert_taken[expert] = true;
	return 0;
}

int backend_moe_expert_cpu_share(struct backend *be, const struct ffn_split *s, uint32_t expert)
{
	static const enum tensor_role roles[] = {ROLE_EXPERT_GATE, ROLE_EXPERT_UP, ROLE_EXPERT_DOWN};
	assert(s);
	if (be->phase != PHASE_MOE)
		return fail(be, -EINVAL, "moe_expert_cpu_share(%u) called outside moe_route .. moe_end", expert);
	if (expert >= be->cfg.n_experts || expert < be->next_expert_cpu || expert < be->next_expert ||
	    be->expert_taken[expert] || be->share_r[expert])
		return fail(be, -EINVAL, "moe_expert_cpu_share(%u): the CPU's experts and shares come in increasing "
			    "order, each once, before the expert's own visit, below %u (next: %u or later)", expert,
			    be->cfg.n_experts, be->next_expert_cpu > be->next_expert ? be->next_expert_cpu : be->next_expert);
	if (!be->impl->compute->moe_expert_cpu_share)
		return fail(be, -ENOTSUP, "moe_expert_cpu_share(%u): the %s backend splits no experts with the CPU", expert,
			    be->impl->name);
	if (!be->p.cpu_pool)
		return fail(be, -ENOTSUP, "moe_expert_cpu_share(%u): a CPU share needs a CPU pool (backend_params.cpu_pool)",
			    expert);
	if (s->where != FFN_SPLIT_CPU)
		return fail(be, -EINVAL, "moe_expert_cpu_share(%u): a share for the CPU pool (FFN_SPLIT_CPU), not %u", expert,
			    s->where);
	int rc = check_second_share(be, s, be->rows[ROLE_EXPERT_GATE], roles, "expert's CPU share");
	if (rc)
		return rc;
	if ((rc = be->impl->compute->moe_expert_cpu_share(be->dev, s, expert)))
		return impl_rc(be, rc);
	be->next_expert_cpu = expert + 1;
	be->share_r[expert] = s->r + 1;
	return 0;
}

int backend_moe_expert_cpu(struct backend *be, const struct group_weights *w, uint32_t expert)
{
	static const enum tensor_role roles[] = {ROLE_EXPERT_GATE, ROLE_EXPERT_UP, ROLE_EXPERT_DOWN};
	assert(w);
	if (be->phase != PHASE_MOE)
		return fail(be, -EINVAL, "moe_expert_cpu(%u) called outside moe_route .. moe_end", expert);
	if (expert >= be->cfg.n_experts || expert < be->next_expert_cpu || be->expert_taken[expert])
		return fail(be, -EINVAL, "moe_expert_cpu(%u): the CPU's experts come in increasing order, each once (on "
			    "the GPU or the CPU), below %u (next: %u or later)", expert, be->cfg.n_experts,
			    be->next_expert_cpu);
	if (!be->impl->compute->moe_expert_cpu)
		return fail(be, -ENOTSUP, "the %s backend computes no experts on the CPU", be->impl->name);
	if (!be->p.cpu_pool)
		return fail(be, -ENOTSUP, "moe_expert_cpu: experts on the CPU need a CPU pool (backend_params.cpu_pool)");
	for (uint32_t i = 0; i < 3; i++) {
		enum tensor_role r = roles[i];
		int rc = check_tensor(be, &w->t[r], r, PLACE_HOST, 0, be->rows[r], 0, be->cols[r], true, "expert on the CPU",
				      "");
		if (rc)
			return rc;
	}
	int rc = be->impl->compute->moe_expert_cpu(be->dev, w, expert);
	if (rc)
		return impl_rc(be, rc);
	be->next_expert_cpu = expert + 1;
	be->expert_taken[expert] = true;
	return 0;
}

bool backend_moe_expert_used(struct backend *be, uint32_t expert)
{
	if (be->phase != PHASE_MOE || expert >= be->cfg.n_experts || !be->impl->compute->moe_expert_used)
		return true;
	return be->impl->compute->moe_expert_used(be->dev, expert);
}

int backend_moe_ends(struct backend *be, int64_t *gpu_late_ns)
{
	*gpu_late_ns = 0;
	if (be->phase != PHASE_MOE || !be->impl->compute->moe_ends)
		return 0;
	return be->impl->compute->moe_ends(be->dev, gpu_late_ns) == 1 ? 1 : 0;
}

void backend_settle(struct backend *be)
{
	if (be->impl->compute->settle)
		be->impl->compute->settle(be->dev);
}

int backend_moe_check(struct backend *be)
{
	if (!be->impl->compute->moe_check)
		return 0;
	int rc = be->impl->compute->moe_check(be->dev);
	return rc ? impl_rc(be, rc) : 0;
}

int backend_moe_layer_experts(struct backend *be, uint32_t layer, const struct group_weights *experts)
{
	static const enum tensor_role roles[] = {ROLE_EXPERT_GATE, ROLE_EXPERT_UP, ROLE_EXPERT_DOWN};
	if (!be->cfg.n_experts || layer >= be->cfg.n_layers)
		return fail(be, -EINVAL, "moe_layer_experts: layer %u of a model of %u layers and %u experts", layer,
			    be->cfg.n_layers, be->cfg.n_experts);
	if (!be->impl->compute->moe_layer_experts)
		return fail(be, -ENOTSUP, "the %s backend routes every layer on the host", be->impl->name);
	for (uint32_t e = 0; experts && e < be->cfg.n_experts; e++) {
		int rc = check_roles(be, &experts[e], roles, 3, "expert routed on the device");
		if (rc)
			return rc;
	}
	return impl_rc(be, be->impl->compute->moe_layer_experts(be->dev, layer, experts));
}

int backend_moe_layer(struct backend *be, const struct group_weights *w, uint32_t layer)
{
	static const enum tensor_role roles[] = {ROLE_FFN_NORM, ROLE_ROUTER};
	assert(w);
	if (be->phase != PHASE_READY)
		return fail(be, -EINVAL, "moe_layer called %s", phase_text(be->phase, "between attn_begin and attn_end"));
	if (!be->cfg.n_experts || layer >= be->cfg.n_layers)
		return fail(be, -EINVAL, "moe_layer: layer %u of a model of %u layers and %u experts", layer,
			    be->cfg.n_layers, be->cfg.n_experts);
	if (be->n != 1)
		return fail(be, -EINVAL, "moe_layer takes a step of one token, not %u", be->n);
	if (!be->impl->compute->moe_layer)
		return fail(be, -ENOTSUP, "the %s backend routes every layer on the host", be->impl->name);
	int rc = check_roles(be, w, roles, 2, "moe");
	if (rc)
		return rc;
	return impl_rc(be, be->impl->compute->moe_layer(be->dev, w, layer));
}

int backend_moe_layer_chosen(struct backend *be, uint32_t layer, uint32_t *ids)
{
	if (!be->impl->compute->moe_layer_chosen)
		return fail(be, -ENODATA, "the %s backend routes every layer on the host", be->impl->name);
	return impl_rc(be, be->impl->compute->moe_layer_chosen(be->dev, layer, ids));
}

int backend_moe_end(struct backend *be)
{
	if (be->phase != PHASE_MOE)
		return fail(be, -EINVAL, "moe_end called without moe_route");
	int rc = be->impl->compute->moe_end(be->dev);
	if (rc)
		return impl_rc(be, rc);
	be->phase = PHASE_READY;
	return 0;
}

/* What every head call checks first. */
static int head_check(struct backend *be, const struct group_weights *w, const char *what)
{
	static const enum tensor_role roles[] = {ROLE_FINAL_NORM, ROLE_LM_HEAD};
	if (be->phase != PHASE_READY)
		return fail(be, -EINVAL, "%s called %s", what, phase_text(be->phase, "between attn_begin and attn_end"));
	return check_roles(be, w, roles, 2, "head");
}

int backend_logits(struct backend *be, const struct group_weights *w, float *out)
{
	assert(w && out);
	int rc = head_check(be, w, "logits");
	if (rc)
		return rc;
	return impl_rc(be, be->impl->compute->logits(be->dev, w, out));
}

/* head_check, then the rows of logits_rows and logits_pick_rows: 1..n of them, going up, each a
 * row of the step. */
static int rows_check(struct backend *be, const struct group_weights *w, const uint32_t *rows, uint32_t n_rows,
		      const char *what)
{
	int rc = head_check(be, w, what);
	if (rc)
		return rc;
	if (n_rows == 0 || n_rows > be->n)
		return fail(be, -EINVAL, "%s: %u rows of a step of %u", what, n_rows, be->n);
	for (uint32_t i = 0; i < n_rows; i++)
		if (rows[i] >= be->n || (i && rows[i] <= rows[i - 1]))
			return fail(be, -EINVAL, "%s: row %u (the %u-th) of a step of %u: rows go up, each below the "
				    "step's", what, rows[i], i, be->n);
	return 0;
}

int backend_logits_rows(struct backend *be, const struct group_weights *w, const uint32_t *rows, uint32_t n_rows,
			float *out)
{
	assert(w && out && (rows || !n_rows));
	if (!be->impl->compute->logits_rows)
		return fail(be, -ENOTSUP, "logits_rows: the %s backend takes one sequence a step", be->impl->name);
	int rc = rows_check(be, w, rows, n_rows, "logits_rows");
	if (rc)
		return rc;
	return impl_rc(be, be->impl->compute->logits_rows(be->dev, w, rows, n_rows, out));
}

int backend_logits_argmax(struct backend *be, const struct group_weights *w, int32_t *token)
{
	assert(w && token);
	int rc = head_check(be, w, "logits_argmax");
	if (rc)
		return rc;
	if (be->impl->compute->logits_argmax)
		return impl_rc(be, be->impl->compute->logits_argmax(be->dev, w, token));
	if (!be->logits && !(be->logits = malloc(sizeof(float) * be->cfg.vocab_size)))
		return fail(be, -ENOMEM, "logits_argmax: out of memory for the logits");
	rc = be->impl->compute->logits(be->dev, w, be->logits);
	if (rc)
		return impl_rc(be, rc);
	*token = argmax_f32(be->logits, be->cfg.vocab_size);
	return 0;
}

bool backend_samples_on_device(const struct backend *be)
{
	return be->impl->compute->logits_sample != NULL;
}

int backend_logits_sample(struct backend *be, const struct group_weights *w, const struct sampler_params *sp,
			  double u, int32_t *token)
{
	assert(w && sp && token);
	if (!be->impl->compute->logits_sample)
		return fail(be, -ENOTSUP, "logits_sample: this backend does not sample on the device");
	int rc = head_check(be, w, "logits_sample");
	if (rc)
		return rc;
	if (!(sp->temperature > 0.0f) || !(u >= 0.0 && u < 1.0))
		return fail(be, -EINVAL, "logits_sample needs temperature > 0 and u in [0, 1)");
	rc = be->impl->compute->logits_sample(be->dev, w, sp, u, token);
	if (rc)
		return impl_rc(be, rc);
	if (*token < 0 || (uint32_t)*token >= be->cfg.vocab_size)
		return fail(be, -EIO, "the sampler chose no token");
	return 0;
}

bool backend_picks_rows(const struct backend *be)
{
	return be->impl->compute->logits_pick_rows != NULL;
}

int backend_logits_pick_rows(struct backend *be, const struct group_weights *w, const uint32_t *rows,
			     uint32_t n_rows, const struct backend_pick *picks, int32_t *tokens)
{
	assert(w && (rows || !n_rows) && picks && tokens);
	if (!be->impl->compute->logits_pick_rows)
		return fail(be, -ENOTSUP, "logits_pick_rows: the %s backend picks no tokens itself", be->impl->name);
	int rc = rows_check(be, w, rows, n_rows, "logits_pick_rows");
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n_rows; i++) {
		const struct sampler_params *sp = picks[i].sp;
		if (sp && (!(sp->temperature > 0.0f) || !(picks[i].u >= 0.0 && picks[i].u < 1.0)))
			return fail(be, -EINVAL, "logits_pick_rows: row %u: a draw needs temperature > 0 and u in [0, 1)",
				    rows[i]);
	}
	rc = be->impl->compute->logits_pick_rows(be->dev, w, rows, n_rows, picks, tokens);
	if (rc)
		return impl_rc(be, rc);
	for (uint32_t i = 0; i < n_rows; i++)
		if (tokens[i] < 0 || (uint32_t)tokens[i] >= be->cfg.vocab_size)
			return fail(be, -EIO, "logits_pick_rows: row %u: no token chosen", rows[i]);
	return 0;
}

void backend_get_cpu_share_stats(struct backend *be, struct backend_cpu_share_stats *out)
{
	memset(out, 0, sizeof(*out));
	snprintf(out->handoff, sizeof(out->handoff), "none");
	if (be->impl->compute->cpu_share_stats)
		be->impl->compute->cpu_share_stats(be->dev, out);
}

/* ---- KV copies --------------------------------------------------------------------------- */

static int check_blocks(struct backend *be, uint32_t n, const uint32_t *blocks, const char *what)
{
	assert(blocks || n == 0);
	for (uint32_t i = 0; i < n; i++)
		if (blocks[i] >= be->p.n_kv_blocks)
			return fail(be, -EINVAL, "%s: block %u is outside the arena of %u blocks", what, blocks[i],
				    be->p.n_kv_blocks);
	return 0;
}

int backend_kv_to_host(struct backend *be, uint32_t n, const uint32_t *blocks, void *const *dsts)
{
	int rc = check_blocks(be, n, blocks, "kv_to_host");
	if (rc || n == 0)
		return rc;
	return impl_rc(be, be->impl->kv->to_host(be->dev, n, blocks, dsts));
}

int backend_kv_from_host(struct backend *be, uint32_t n, const uint32_t *blocks, const void *const *srcs)
{
	int rc = check_blocks(be, n, blocks, "kv_from_host");
	if (rc || n == 0)
		return rc;
	return impl_rc(be, be->impl->kv->from_host(be->dev, n, blocks, srcs));
}

int backend_kv_write_behind(struct backend *be, uint32_t n, const uint32_t *blocks, void *const *dsts,
			    void *event_handle)
{
	int rc = check_blocks(be, n, blocks, "kv_write_behind");
	if (rc)
		return rc;
	if (!be->impl->kv->write_behind)
		return n ? impl_rc(be, be->impl->kv->to_host(be->dev, n, blocks, dsts)) : 0;
	return impl_rc(be, be->impl->kv->write_behind(be->dev, n, blocks, dsts, event_handle));
}

int backend_kv_prefetch(struct backend *be, uint32_t n, const uint32_t *blocks, const void *const *srcs, uint32_t slot)
{
	if (slot > 1)
		return fail(be, -EINVAL, "kv_prefetch: slot %u (0 or 1)", slot);
	int rc = check_blocks(be, n, blocks, "kv_prefetch");
	if (rc || n == 0)
		return rc;
	if (!be->impl->kv->prefetch)
		return impl_rc(be, be->impl->kv->from_host(be->dev, n, blocks, srcs));
	return impl_rc(be, be->impl->kv->prefetch(be->dev, n, blocks, srcs, slot));
}

int backend_kv_prefetch_wait(struct backend *be, uint32_t slot)
{
	if (slot > 1)
		return fail(be, -EINVAL, "kv_prefetch_wait: slot %u (0 or 1)", slot);
	if (!be->impl->kv->prefetch_wait)
		return 0;
	return impl_rc(be, be->impl->kv->prefetch_wait(be->dev, slot));
}

int backend_kv_sync(struct backend *be)
{
	return be->impl->kv->sync ? impl_rc(be, be->impl->kv->sync(be->dev)) : 0;
}

int backend_pin_host(struct backend *be, void *p, size_t bytes)
{
	return be->impl->kv->pin_host ? impl_rc(be, be->impl->kv->pin_host(be->dev, p, bytes)) : 0;
}

void backend_unpin_host(struct backend *be, void *p)
{
	if (be->impl->kv->unpin_host)
		be->impl->kv->unpin_host(be->dev, p);
}

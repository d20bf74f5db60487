/* backend_check.c - the model and arena checks every backend makes before it allocates. */
#include "services/gpu-runner/backend.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>

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
	return 0;
}

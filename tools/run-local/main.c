/* run-local: runs a checkpoint in one process, without any service: the whole model read
 * into memory, the same engine, backend and sampler as the gpu-runner, the KV cache held
 * entirely in the backend's arena. It is the oracle the integration tests compare the
 * services with, and a quick way to try a model.
 *
 *   run-local --model DIR --tokens 1,2,3 -n 16 [--temperature T --top-k K --top-p P --seed S]
 *       [--backend cuda]      every weight copied to the GPU first (memory_source_to_device)
 *
 * Prints the generated ids on one line, separated by spaces (as `pipectl generate` does). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/log.h"
#include "common/manifest.h"
#include "common/util.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/engine.h"
#include "services/gpu-runner/generate.h"
#include "services/gpu-runner/kv_cache.h"
#include "services/gpu-runner/weights.h"
#include "tools/run-local/memory_source.h"

/* Parses "1,2,3" into a fresh array. */
static int parse_ids(const char *text, int32_t **out, uint32_t *n)
{
	uint32_t cap = 16, k = 0;
	int32_t *v = malloc(cap * sizeof(int32_t));
	const char *p = text;
	while (v && *p) {
		char *end;
		errno = 0;
		long x = strtol(p, &end, 10);
		if (end == p || errno || x < 0 || x > INT32_MAX || (*end && *end != ',')) {
			free(v);
			return -EINVAL;
		}
		if (k == cap) {
			cap *= 2;
			int32_t *nv = realloc(v, cap * sizeof(int32_t));
			if (!nv) {
				free(v);
				return -ENOMEM;
			}
			v = nv;
		}
		v[k++] = (int32_t)x;
		p = *end ? end + 1 : end;
	}
	if (!v)
		return -ENOMEM;
	*out = v;
	*n = k;
	return 0;
}

static enum gen_emit print_token(void *ctx, uint32_t index, int32_t token)
{
	printf(index ? " %d" : "%d", token);
	fflush(stdout);
	return GEN_CONTINUE;
}

int main(int argc, char **argv)
{
	const char *model = NULL, *tokens_text = NULL, *stop_text = NULL, *backend_name = "cpu";
	long max_new = 16, top_k = 0, threads = 1, block_tokens = 16, chunk = 256, seed = 0;
	double temperature = 0, top_p = 1, min_p = 0, repetition_penalty = 1;
	bool stats = false, ignore_eos = false;
	const struct opt opts[] = {
		{"model", OPT_STRING, &model, NULL, "checkpoint: a Hugging Face directory or a GGUF file (required)"},
		{"tokens", OPT_STRING, &tokens_text, NULL, "prompt token ids, comma separated (required)"},
		{"max-new", OPT_INT, &max_new, "16", "tokens to generate (also -n)"},
		{"temperature", OPT_DOUBLE, &temperature, "0", "sampling temperature; 0 (or under 1e-6) is greedy"},
		{"top-k", OPT_INT, &top_k, "0", "keep the k most likely tokens; 0 is off"},
		{"top-p", OPT_DOUBLE, &top_p, "1", "keep the most likely tokens up to this mass; 1 is off"},
		{"min-p", OPT_DOUBLE, &min_p, "0", "drop tokens less likely than this times the likeliest; 0 is off"},
		{"repetition-penalty", OPT_DOUBLE, &repetition_penalty, "1", "penalty on tokens already seen; 1 is off"},
		{"seed", OPT_INT, &seed, "0", "sampling seed"},
		{"stop-ids", OPT_STRING, &stop_text, NULL, "extra stop token ids, comma separated"},
		{"backend", OPT_STRING, &backend_name, "cpu",
		 "compute backend: cpu (the C reference), or cuda where built (every weight copied to the GPU)"},
		{"threads", OPT_INT, &threads, "1", "CPU threads of the cpu backend"},
		{"kv-block-tokens", OPT_INT, &block_tokens, "16", "tokens per KV block"},
		{"prefill-chunk", OPT_INT, &chunk, "256", "most prompt tokens per forward step"},
		{"ignore-eos", OPT_BOOL, &ignore_eos, NULL, "do not stop on the model's end-of-sequence ids"},
		{"stats", OPT_BOOL, &stats, NULL, "print timings on stderr"},
		{0},
	};
	/* "-n N" is the short form of --max-new. */
	for (int i = 1; i < argc; i++)
		if (!strcmp(argv[i], "-n"))
			argv[i] = "--max-new";
	int rc = config_parse("run-local",
			      "Runs a checkpoint in one process without services (the oracle of the integration tests).",
			      opts, argc, argv, NULL, NULL);
	if (rc > 0)
		return 0;
	if (rc < 0)
		return 2;
	log_init("run-local");
	if (!model || !tokens_text) {
		fprintf(stderr, "run-local: --model and --tokens are required (see --help)\n");
		return 2;
	}
	/* The runner's limits, and its sampling's (pipectl's and gpu-runner's checks): a value past
	 * them was cut to 32 bits (--kv-block-tokens 4294967296 divided by 0). */
	if (max_new < 0 || max_new > (1l << 24) || top_k < 0 || top_k > (1l << 24) || threads < 1 || threads > 1024 ||
	    block_tokens < 1 || block_tokens > 4096 || chunk < 1 || chunk > 65536) {
		fprintf(stderr, "run-local: -n (0..16777216), --top-k (0..16777216), --threads (1..1024), "
				"--kv-block-tokens (1..4096) or --prefill-chunk (1..65536) out of range\n");
		return 2;
	}
	if (!(temperature >= 0 && temperature <= 1e6) || !(top_p >= 0 && top_p <= 1) || !(min_p >= 0 && min_p <= 1) ||
	    !(repetition_penalty == 0 || (repetition_penalty >= 1e-6 && repetition_penalty <= 1e6))) {
		fprintf(stderr, "run-local: --temperature must be in 0..1e6, --top-p and --min-p in 0..1, "
				"--repetition-penalty 0 (off) or in 1e-6..1e6\n");
		return 2;
	}
	int32_t *prompt = NULL, *stop = NULL;
	uint32_t n_prompt = 0, n_stop = 0;
	if (parse_ids(tokens_text, &prompt, &n_prompt) != 0 || n_prompt == 0 ||
	    (stop_text && parse_ids(stop_text, &stop, &n_stop) != 0)) {
		fprintf(stderr, "run-local: token lists are non-negative integers separated by commas\n");
		return 2;
	}
	if (!backend_known(backend_name)) {
		fprintf(stderr, "run-local: backend '%s' is not built in\n", backend_name);
		return 2;
	}
	char err[1024];
	struct manifest *m = NULL;
	struct memory_source *ms = NULL;
	struct backend *be = NULL;
	struct kv_cache *kv = NULL;
	struct engine *e = NULL;
	rc = manifest_load(model, &m, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "run-local: %s\n", err);
		return 1;
	}
	if ((rc = memory_source_create(m, &ms, err, sizeof(err))) != 0) {
		fprintf(stderr, "run-local: %s\n", err);
		goto out;
	}
	uint32_t max_context = n_prompt + (uint32_t)max_new + 1;
	uint32_t per_layer = (max_context + (uint32_t)block_tokens - 1) / (uint32_t)block_tokens + 1;
	struct backend_params bp = {.max_chunk = (uint32_t)chunk, .block_tokens = (uint32_t)block_tokens,
				    .n_kv_blocks = per_layer * m->cfg.n_layers, .kv_dtype = DT_F32,
				    .threads = (uint32_t)threads};
	rc = backend_create(backend_name, &m->cfg, &bp, &be, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "run-local: backend: %s\n", err);
		goto out;
	}
	if (backend_weight_place(be) == PLACE_DEVICE && (rc = memory_source_to_device(ms, err, sizeof(err))) != 0) {
		fprintf(stderr, "run-local: backend %s: %s\n", backend_name, err);
		goto out;
	}
	struct kv_cache_params kp = {.n_layers = m->cfg.n_layers, .block_tokens = bp.block_tokens,
				     .max_context = max_context, .max_chunk = bp.max_chunk, .n_arena = bp.n_kv_blocks};
	rc = kv_cache_create(&kp, be, NULL, NULL, &kv, err, sizeof(err));
	if (rc == 0)
		rc = engine_create(&m->cfg, be, memory_source_base(ms), kv, bp.max_chunk, &e, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "run-local: %s\n", err);
		goto out;
	}
	struct gen_params gp = {.max_new = (uint32_t)max_new,
				.sampling = {.temperature = sampler_temperature(temperature), .top_k = (uint32_t)top_k,
					     .top_p = (float)top_p, .seed = (uint64_t)seed, .min_p = (float)min_p},
				.repetition_penalty = (float)repetition_penalty,
				.ignore_eos = ignore_eos,
				.stop_ids = stop,
				.n_stop = n_stop};
	struct gen_result res;
	rc = generate_run(e, prompt, n_prompt, max_context, &gp, print_token, NULL, &res, err, sizeof(err));
	printf("\n");
	if (rc) {
		fprintf(stderr, "run-local: %s\n", err);
		goto out;
	}
	if (stats)
		fprintf(stderr, "run-local: %u prompt tokens, %u generated (%s); prefill %.1f ms, decode %.1f ms\n",
			res.n_prompt, res.n_generated, res.reason, res.prefill_ms, res.decode_ms);
out:
	engine_destroy(&e);
	kv_cache_destroy(&kv);
	if (be)
		backend_destroy(&be);
	memory_source_destroy(&ms);
	manifest_destroy(&m);
	free(prompt);
	free(stop);
	return rc ? 1 : 0;
}

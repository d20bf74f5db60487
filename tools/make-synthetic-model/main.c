/* make-synthetic-model - writes a random-weight Llama, Mistral, Qwen3, Mixtral or Qwen3-MoE
 * checkpoint in the Hugging Face layout or as GGUF files, for tests and benchmarks without
 * downloading a model.
 *
 *   make-synthetic-model --shape tiny --out /tmp/tiny
 *   make-synthetic-model --shape llama3-8b --out /data/l8b     (16 GB; a progress line a second)
 *   make-synthetic-model --shape llama3-70b:4 --layers 2 --dtype f16 --shards 3 --out /tmp/x
 *   make-synthetic-model --shape llama3-8b --format gguf --type q4_k_m \
 *       --tokenizer tokenizer.json --out /data/l8b-q4_k_m.gguf   (4.9 GB, quantized on every core)
 *   make-synthetic-model --shape tiny --format gguf --type q8_0 --shards 2 --out /tmp/g
 *                                       (/tmp/g/model-00001-of-00002.gguf, model-00002-of-00002.gguf)
 *   make-synthetic-model --shape mixtral-tiny --format gguf --type q8_0 --out /tmp/mx.gguf
 *                                       (architecture llama with experts, in ffn_*_exps tensors)
 *
 * GGUF files hold what llama.cpp's convert_hf_to_gguf.py (and llama-quantize, for the quantized
 * types) makes of the safetensors checkpoint of the same arguments: its values rounded to --dtype,
 * then stored in the --type's tensor types.
 *
 * Exit status: 0 written, 2 bad usage, 1 failure (message on stderr). */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/config.h"
#include "common/util.h"
#include "tools/make-synthetic-model/synthetic.h"

#define PROG "make-synthetic-model"

/* Applies an integer override: -1 (the flag's absence) leaves *dst. */
static int override_u32(const char *flag, long v, long lo, long hi, uint32_t *dst)
{
	if (v == -1)
		return 0;
	if (v < lo || v > hi) {
		fprintf(stderr, "%s: --%s %ld is out of range [%ld, %ld]\n", PROG, flag, v, lo, hi);
		return -EINVAL;
	}
	*dst = (uint32_t)v;
	return 0;
}

static void format_params(uint64_t n, char *buf, size_t len)
{
	if (n >= 1000000000ull)
		snprintf(buf, len, "%.2fB", (double)n / 1e9);
	else if (n >= 1000000ull)
		snprintf(buf, len, "%.2fM", (double)n / 1e6);
	else
		snprintf(buf, len, "%llu", (unsigned long long)n);
}

static const char *arch_name(uint32_t arch)
{
	switch (arch) {
	case ARCH_MISTRAL:
		return "mistral";
	case ARCH_QWEN3:
		return "qwen3";
	case ARCH_MIXTRAL:
		return "mixtral";
	case ARCH_QWEN3_MOE:
		return "qwen3_moe";
	default:
		return "llama";
	}
}

int main(int argc, char **argv)
{
	char *shape = NULL, *out = NULL, *dtype_text = NULL, *rope = NULL, *arch = NULL, *eos = NULL;
	char *format = NULL, *type = NULL, *tokenizer = NULL;
	long threads = 0;
	long seed = 0, shards = 0, layers = -1, vocab = -1, dim = -1, heads = -1, kv_heads = -1, head_dim = -1,
	     ffn = -1, sliding = -1, bos = -2, experts = -1, top_k = -1, expert_ffn = -1;
	uint64_t shard_size = 0;
	double rope_theta = 0;
	bool tied = false, mha = false, force = false, quiet = false, no_norm_topk = false;
	struct opt opts[] = {
		{"shape", OPT_STRING, &shape, NULL,
		 "tiny, qwen3-tiny, mixtral-tiny, qwen3-moe-tiny, llama3-8b, llama3-70b[:LAYERS], mixtral-8x7b[:LAYERS], "
		 "qwen3-30b-a3b[:LAYERS] (required)"},
		{"out", OPT_STRING, &out, NULL,
		 "directory to write the checkpoint into; GGUF: the file if it ends in .gguf, else a directory "
		 "for model.gguf (required)"},
		{"format", OPT_STRING, &format, "safetensors", "safetensors (the Hugging Face layout) or gguf"},
		{"type", OPT_STRING, &type, NULL,
		 "GGUF tensor types: f32, f16, bf16, q8_0, q4_0, q6_k, or llama.cpp's mixes q4_k_m, q5_k_m "
		 "(default bf16)"},
		{"tokenizer", OPT_STRING, &tokenizer, NULL,
		 "GGUF: a Hugging Face tokenizer.json (Llama 3's) to embed; without it the file holds no vocabulary"},
		{"dtype", OPT_STRING, &dtype_text, "bf16",
		 "element type: bf16, f16 or f32 (GGUF: the values are rounded to it before they are converted)"},
		{"seed", OPT_INT, &seed, "0", "random seed: the same seed writes the same bytes"},
		{"shards", OPT_INT, &shards, "0",
		 "number of weight files (0: safetensors split at --shard-size, GGUF one file; GGUF sets are "
		 "model-0000i-of-0000n.gguf as gguf-split names them)"},
		{"shard-size", OPT_SIZE, &shard_size, "5GB", "largest safetensors file when --shards is 0"},
		{"threads", OPT_INT, &threads, "0", "GGUF: threads converting and quantizing (0: one per CPU)"},
		{"tied", OPT_BOOL, &tied, NULL, "tie the output projection to the embedding (no lm_head)"},
		{"layers", OPT_INT, &layers, NULL, "override: number of layers"},
		{"vocab", OPT_INT, &vocab, NULL, "override: vocabulary size"},
		{"dim", OPT_INT, &dim, NULL, "override: hidden size"},
		{"heads", OPT_INT, &heads, NULL, "override: attention heads"},
		{"kv-heads", OPT_INT, &kv_heads, NULL, "override: key/value heads"},
		{"head-dim", OPT_INT, &head_dim, NULL, "override: head dimension (default: dim / heads)"},
		{"ffn", OPT_INT, &ffn, NULL, "override: feed-forward (intermediate) size"},
		{"mha", OPT_BOOL, &mha, NULL, "plain multi-head attention: kv heads = heads"},
		{"experts", OPT_INT, &experts, NULL, "override (mixture-of-experts shapes): experts per layer"},
		{"top-k", OPT_INT, &top_k, NULL, "override (mixture-of-experts shapes): experts chosen per token"},
		{"expert-ffn", OPT_INT, &expert_ffn, NULL,
		 "override (mixture-of-experts shapes): one expert's intermediate size (Mixtral: --ffn too)"},
		{"no-norm-topk", OPT_BOOL, &no_norm_topk, NULL,
		 "Qwen3-MoE: norm_topk_prob false (the chosen experts' weights are not renormalised)"},
		{"rope-scaling", OPT_STRING, &rope, NULL, "override: none, linear:FACTOR or llama3"},
		{"rope-theta", OPT_DOUBLE, &rope_theta, NULL, "override: RoPE base (Llama 2: 10000)"},
		{"bos", OPT_INT, &bos, NULL, "override: BOS token id (-1: none)"},
		{"eos", OPT_STRING, &eos, NULL, "override: EOS token ids, comma separated (Llama 3: 128001,128008,128009)"},
		{"arch", OPT_STRING, &arch, NULL, "override: llama or mistral"},
		{"sliding-window", OPT_INT, &sliding, NULL, "override: sliding window (0: none)"},
		{"force", OPT_BOOL, &force, NULL, "write into a directory that already holds a checkpoint"},
		{"quiet", OPT_BOOL, &quiet, NULL, "no progress lines (the summary line stays)"},
		{0},
	};
	int rc = config_parse(PROG,
			      "writes a random-weight Llama/Mistral/Qwen3/Mixtral/Qwen3-MoE checkpoint (config.json, "
			      "safetensors) in the "
			      "Hugging Face layout, or as GGUF files",
			      opts, argc, argv, NULL, NULL);
	if (rc > 0)
		return 0;
	if (rc < 0)
		return 2;
	if (!shape || !out) {
		fprintf(stderr, "%s: --shape and --out are required (see --help)\n", PROG);
		return 2;
	}

	char err[512];
	struct model_config cfg;
	if (synth_shape_config(shape, &cfg, err, sizeof(err)) != 0) {
		fprintf(stderr, "%s: %s\n", PROG, err);
		return 2;
	}
	struct synth_options o;
	synth_options_default(&o);
	if (!strcasecmp(dtype_text, "bf16") || !strcasecmp(dtype_text, "bfloat16")) {
		o.dtype = DT_BF16;
	} else if (!strcasecmp(dtype_text, "f16") || !strcasecmp(dtype_text, "fp16") ||
		   !strcasecmp(dtype_text, "float16")) {
		o.dtype = DT_F16;
	} else if (!strcasecmp(dtype_text, "f32") || !strcasecmp(dtype_text, "fp32") ||
		   !strcasecmp(dtype_text, "float32")) {
		o.dtype = DT_F32;
	} else {
		fprintf(stderr, "%s: --dtype %s is not one of bf16, f16, f32\n", PROG, dtype_text);
		return 2;
	}
	if (!strcasecmp(format, "gguf")) {
		o.format = SYNTH_GGUF;
	} else if (strcasecmp(format, "safetensors")) {
		fprintf(stderr, "%s: --format %s is neither safetensors nor gguf\n", PROG, format);
		return 2;
	}
	if (o.format != SYNTH_GGUF && (type || tokenizer)) {
		fprintf(stderr, "%s: --%s is for GGUF files: give --format gguf\n", PROG, type ? "type" : "tokenizer");
		return 2;
	}
	enum synth_gguf_type gt = SYNTH_GGUF_BF16;
	if (type && synth_parse_gguf_type(type, &gt) != 0) {
		fprintf(stderr, "%s: --type %s is not one of f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k\n", PROG,
			type);
		return 2;
	}
	o.gguf_type = gt;
	o.tokenizer = tokenizer;
	o.name = shape;
	if (seed < 0 || shards < 0 || shards > 99999 || threads < 0 || threads > 1024) {
		fprintf(stderr, "%s: --seed must be >= 0, --shards in [0, 99999], --threads in [0, 1024]\n", PROG);
		return 2;
	}
	o.threads = (uint32_t)threads;
	o.seed = (uint64_t)seed;
	o.shards = (uint32_t)shards;
	o.shard_bytes = shard_size;
	o.tied = tied;
	o.progress = !quiet;

	bool dims_changed = dim != -1 || heads != -1;
	if (override_u32("layers", layers, 1, 1024, &cfg.n_layers) ||
	    override_u32("vocab", vocab, 1, 1 << 24, &cfg.vocab_size) ||
	    override_u32("dim", dim, 1, 1 << 17, &cfg.dim) || override_u32("heads", heads, 1, 1024, &cfg.n_heads) ||
	    override_u32("kv-heads", kv_heads, 1, 1024, &cfg.n_kv_heads) ||
	    override_u32("ffn", ffn, 1, 1 << 20, &cfg.ffn_dim) ||
	    override_u32("sliding-window", sliding, 0, UINT32_MAX, &cfg.sliding_window))
		return 2;
	/* The presets have head_dim = dim / heads; keep that when dim or heads change. */
	if (head_dim != -1) {
		if (override_u32("head-dim", head_dim, 1, 1024, &cfg.head_dim))
			return 2;
	} else if (dims_changed) {
		if (cfg.dim % cfg.n_heads) {
			fprintf(stderr, "%s: --heads %u does not divide --dim %u (give --head-dim)\n", PROG,
				cfg.n_heads, cfg.dim);
			return 2;
		}
		cfg.head_dim = cfg.dim / cfg.n_heads;
	}
	if (mha)
		cfg.n_kv_heads = cfg.n_heads;
	if (vocab != -1) {
		/* Keep the special tokens inside a smaller vocabulary. */
		if (cfg.bos_id >= (int32_t)cfg.vocab_size)
			cfg.bos_id = cfg.vocab_size > 1 ? 1 : 0;
		for (uint32_t i = 0; i < cfg.n_eos; i++)
			if (cfg.eos_ids[i] >= (int32_t)cfg.vocab_size)
				cfg.eos_ids[i] = (int32_t)(cfg.vocab_size > 2 ? 2 + i % (cfg.vocab_size - 2) : 0);
	}
	if (bos != -2) {
		if (bos < -1 || bos >= (long)cfg.vocab_size) {
			fprintf(stderr, "%s: --bos %ld is outside the vocabulary of %u\n", PROG, bos, cfg.vocab_size);
			return 2;
		}
		cfg.bos_id = (int32_t)bos;
	}
	if (eos) {
		cfg.n_eos = 0;
		for (char *p = eos; *p;) {
			char *end;
			long v = strtol(p, &end, 10);
			if (end == p || v < 0 || v >= (long)cfg.vocab_size || cfg.n_eos == MODEL_MAX_EOS ||
			    (*end && *end != ',')) {
				fprintf(stderr, "%s: --eos takes up to %d ids inside the vocabulary, comma separated\n", PROG,
					MODEL_MAX_EOS);
				return 2;
			}
			cfg.eos_ids[cfg.n_eos++] = (int32_t)v;
			p = *end ? end + 1 : end;
		}
	}
	if (rope_theta != 0) {
		if (!(rope_theta > 0 && rope_theta < 1e12)) {
			fprintf(stderr, "%s: --rope-theta %g must be positive\n", PROG, rope_theta);
			return 2;
		}
		cfg.rope_theta = (float)rope_theta;
	}
	if (rope && synth_parse_rope_scaling(rope, &cfg, err, sizeof(err)) != 0) {
		fprintf(stderr, "%s: --rope-scaling: %s\n", PROG, err);
		return 2;
	}
	if (arch) {
		if (!strcmp(arch, "llama")) {
			cfg.arch = ARCH_LLAMA;
		} else if (!strcmp(arch, "mistral")) {
			cfg.arch = ARCH_MISTRAL;
		} else {
			fprintf(stderr, "%s: --arch %s is not one of llama, mistral\n", PROG, arch);
			return 2;
		}
	}
	if (cfg.arch == ARCH_MIXTRAL && ffn != -1)
		cfg.expert_ffn_dim = cfg.ffn_dim; /* Mixtral's experts have intermediate_size */
	if ((experts != -1 || top_k != -1 || expert_ffn != -1 || no_norm_topk) && !cfg.n_experts) {
		fprintf(stderr, "%s: --experts, --top-k, --expert-ffn and --no-norm-topk need a mixture-of-experts shape\n",
			PROG);
		return 2;
	}
	if (experts != -1)
		cfg.n_experts = experts > 0 && experts <= (long)MODEL_MAX_EXPERTS ? (uint32_t)experts : 0;
	if (top_k != -1)
		cfg.n_experts_used = top_k > 0 && top_k <= (long)MODEL_MAX_EXPERTS ? (uint32_t)top_k : 0;
	if (expert_ffn != -1) {
		if (cfg.arch == ARCH_MIXTRAL) {
			fprintf(stderr, "%s: Mixtral's experts have intermediate_size: give --ffn\n", PROG);
			return 2;
		}
		cfg.expert_ffn_dim = expert_ffn > 0 && expert_ffn <= (1l << 20) ? (uint32_t)expert_ffn : 0;
	}
	if (no_norm_topk) {
		if (cfg.arch != ARCH_QWEN3_MOE) {
			fprintf(stderr, "%s: --no-norm-topk applies to Qwen3-MoE only (Mixtral always renormalises)\n", PROG);
			return 2;
		}
		cfg.flags &= ~MODEL_NORM_TOPK;
	}
	if (model_config_check(&cfg, err, sizeof(err)) != 0) {
		fprintf(stderr, "%s: the shape with these overrides is invalid: %s\n", PROG, err);
		return 2;
	}

	char path[4096];
	if (o.format == SYNTH_GGUF && synth_gguf_path(out, 0, o.shards ? o.shards : 1, path, sizeof(path)) != 0) {
		fprintf(stderr, "%s: --out %s: path too long\n", PROG, out);
		return 2;
	}
	/* Any file the write would replace or remove (a split set's files where one file is
	 * written, the one file where a split set is, the weights beside a config.json not there),
	 * not only the first it writes. */
	if (!force && synth_existing(out, &o, path, sizeof(path))) {
		fprintf(stderr, "%s: %s exists (a checkpoint's file this write would replace or remove); pass --force "
				"to overwrite\n",
			PROG, path);
		return 1;
	}

	struct synth_stats st;
	rc = synth_write_stats(out, &cfg, &o, &st, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "%s: %s\n", PROG, err);
		return 1;
	}
	{
		char params[32], bytes[32], kind[64];
		format_params(st.params, params, sizeof(params));
		format_size(st.file_bytes, bytes, sizeof(bytes));
		if (o.format == SYNTH_GGUF)
			snprintf(kind, sizeof(kind), "GGUF %s (from %s)", synth_gguf_type_name(gt),
				 dtype_name(o.dtype));
		else
			snprintf(kind, sizeof(kind), "%s", dtype_name(o.dtype));
		double gbps = st.seconds > 0 ? (double)st.file_bytes / st.seconds / 1e9 : 0.0;
		printf("%s: wrote %s to %s: %s parameters, %s %s, %s in %u file%s, %.2f s (%.2f GB/s); the weights are "
		       "random (seed %llu), not a trained model\n",
		       PROG, shape, out, params, kind, arch_name(cfg.arch), bytes,
		       st.n_files, st.n_files == 1 ? "" : "s", st.seconds, gbps, (unsigned long long)o.seed);
	}
	return 0;
}

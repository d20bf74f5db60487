/* synthetic.h - writes random-weight checkpoints in the Hugging Face layout.
 *
 * For tests and benchmarks without downloading a model: the files are what
 * transformers' save_pretrained writes (config.json, generation_config.json,
 * model.safetensors or model-0000i-of-0000n.safetensors + model.safetensors.index.json),
 * so manifest_load and the loader read them exactly as they read a real checkpoint.
 * The weights are random (matrices ~ N(0, 0.02), norms 1 + N(0, 0.02)): the model runs,
 * its output is noise.
 *
 *   struct model_config cfg;
 *   struct synth_options o;
 *   char err[512];
 *   synth_options_default(&o);
 *   o.seed = 7;
 *   if (synth_shape_config("tiny", &cfg, err, sizeof(err)) != 0 ||
 *       synth_write("/tmp/x/model", &cfg, &o, err, sizeof(err)) != 0)
 *           fprintf(stderr, "%s\n", err);
 *
 * Values are a function of (seed, tensor name, element index) only: the same seed gives the
 * same tensor bytes whatever the sharding, and bf16/f16/f32 files hold the same draws
 * rounded to their type. Writing runs at disk speed (a fill thread and a write thread). */
#ifndef PIPELINE_SYNTHETIC_H
#define PIPELINE_SYNTHETIC_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/model.h"
#ifdef __cplusplus
extern "C" {
#endif

#define SYNTH_DEFAULT_SHARD_BYTES 5000000000ull /* transformers' max_shard_size "5GB" */
#define SYNTH_INIT_STD		  0.02		/* transformers' initializer_range */

struct synth_options {
	enum dtype dtype;     /* element type of every tensor; default DT_BF16 */
	uint64_t seed;	      /* default 0 */
	uint32_t shards;      /* number of files; 0 (default): split where a file would pass shard_bytes */
	uint64_t shard_bytes; /* used when shards == 0; default SYNTH_DEFAULT_SHARD_BYTES */
	bool tied;	      /* write tie_word_embeddings true and no lm_head (cfg->tie_embeddings also does) */
	bool progress;	      /* print "wrote X of Y, Z GB/s" to stderr about once a second */
};

/* What a write produced (synth_write_stats). */
struct synth_stats {
	uint64_t params;       /* parameters written */
	uint64_t tensor_bytes; /* payload bytes of all tensors */
	uint64_t file_bytes;   /* bytes of the safetensors files (headers included) */
	uint32_t n_files;      /* safetensors files */
	uint32_t n_tensors;
	double seconds; /* wall time of the write */
};

/* Fills o with the defaults above. */
void synth_options_default(struct synth_options *o);

/* Sets cfg (zeroed first) from a shape name:
 *   "tiny"             Llama-3-style GQA: dim 64, 2 layers, 4 heads, 2 kv heads, head_dim 16, ffn 192,
 *                      vocab 512, max_pos 4096, rms 1e-5, theta 500000, llama3 rope scaling (8, 1, 4, 8192),
 *                      bos 1, eos {2}, untied
 *   "llama3-8b"        dim 4096, 32 layers, 32 heads, 8 kv, head_dim 128, ffn 14336, vocab 128256,
 *                      max_pos 131072, rms 1e-5, theta 500000, llama3 scaling (8, 1, 4, 8192),
 *                      bos 128000, eos {128001, 128008, 128009}
 *   "llama3-70b[:N]"   as llama3-8b but dim 8192, N layers (1..80, default 80), 64 heads, 8 kv, ffn 28672
 * Returns 0, or -EINVAL with a message listing the shapes. */
int synth_shape_config(const char *spec, struct model_config *cfg, char *err, size_t errlen);

/* Parses a rope scaling override: "none", "linear:F" (F > 0) or "llama3" (factor 8, low 1,
 * high 4, original 8192). Sets the rope fields of cfg. Returns 0 or -EINVAL with a message. */
int synth_parse_rope_scaling(const char *text, struct model_config *cfg, char *err, size_t errlen);

/* Parameters of the model cfg describes (lm_head counted unless tied || cfg->tie_embeddings). */
uint64_t synth_param_count(const struct model_config *cfg, bool tied);

/* Writes the checkpoint for cfg into dir (created with its parents if needed). Checks cfg
 * with model_config_check first. Overwrites config.json, generation_config.json and the
 * weight files, and removes a model.safetensors / model.safetensors.index.json /
 * model-*-of-*.safetensors left from an earlier write, so the directory holds exactly one
 * checkpoint. Returns 0; on failure -errno (-EINVAL bad config or options, -ENOSPC, -EIO,
 * -ENOMEM, ...) with a message naming the file, after removing the files it wrote (and dir
 * if it created it). Prints progress to stderr when o->progress. */
int synth_write(const char *dir, const struct model_config *cfg, const struct synth_options *o, char *err,
		size_t errlen);

/* synth_write that also reports what it wrote into *stats (may be NULL). */
int synth_write_stats(const char *dir, const struct model_config *cfg, const struct synth_options *o,
		      struct synth_stats *stats, char *err, size_t errlen);

/* The value synth_write stores for element i of the tensor named name (before rounding to
 * the dtype): lets a test check bytes it did not read from the file. is_norm selects the
 * 1 + N(0, 0.02) distribution of the norm weights. */
float synth_value(uint64_t seed, const char *name, bool is_norm, uint64_t i);

#ifdef __cplusplus
}
#endif
#endif

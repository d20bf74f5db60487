/* synthetic.h - writes random-weight checkpoints in the Hugging Face layout or as GGUF files.
 *
 * For tests and benchmarks without downloading a model. In the Hugging Face layout the files are
 * what transformers' save_pretrained writes (config.json, generation_config.json,
 * model.safetensors or model-0000i-of-0000n.safetensors + model.safetensors.index.json),
 * so manifest_load and the loader read them exactly as they read a real checkpoint. As GGUF
 * (o.format = SYNTH_GGUF) they are what llama.cpp's convert_hf_to_gguf.py and llama-quantize
 * make of that checkpoint: one model.gguf, or a split set model-0000i-of-0000n.gguf as gguf-split
 * writes it, with the metadata of the architecture (llama for Llama, Mistral and Mixtral: wq/wk
 * rows permuted for adjacent-pair RoPE; qwen3, qwen3moe), the experts of a layer stacked into one
 * tensor per matrix (ffn_gate_exps, ffn_up_exps, ffn_down_exps), and the
 * matrices in the chosen type (F32, F16, BF16, Q8_0, Q4_0, Q6_K, or llama.cpp's Q4_K_M / Q5_K_M
 * mixes). The weights are random (matrices ~ N(0, 0.02), norms 1 + N(0, 0.02)): the model runs,
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
 * rounded to their type. A GGUF file holds the draws rounded to o.dtype (the values of the
 * safetensors file of the same options), then converted to its tensor types. Writing runs at
 * disk speed (safetensors: a fill thread and a write thread; GGUF: a pool of threads converting
 * and quantizing, the calling thread writing). */
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

/* What synth_write writes (synth_options.format). */
enum synth_format {
	SYNTH_SAFETENSORS = 0, /* the Hugging Face layout: config.json and safetensors files */
	SYNTH_GGUF = 1,	       /* one GGUF file, or a split set */
};

/* The types of a GGUF file (synth_options.gguf_type), numbered as llama.cpp numbers its file
 * types (enum llama_ftype): the number is the file's general.file_type. Norms and rope_freqs are
 * F32 in every type. */
enum synth_gguf_type {
	SYNTH_GGUF_F32 = 0,    /* every matrix F32 (ALL_F32) */
	SYNTH_GGUF_F16 = 1,    /* every matrix F16 */
	SYNTH_GGUF_Q4_0 = 2,   /* every matrix Q4_0 */
	SYNTH_GGUF_Q8_0 = 7,   /* every matrix Q8_0 */
	SYNTH_GGUF_Q4_K_M = 15, /* llama-quantize's mix: Q4_K; Q6_K for output and some attn_v, ffn_down */
	SYNTH_GGUF_Q5_K_M = 17, /* the same mix with Q5_K */
	SYNTH_GGUF_Q6_K = 18,  /* every matrix Q6_K */
	SYNTH_GGUF_BF16 = 32,  /* every matrix BF16 */
};

struct synth_options {
	enum dtype dtype;     /* safetensors: element type of every tensor; GGUF: the element type values are
			       * rounded to before they are converted to the GGUF types. Default DT_BF16 */
	uint64_t seed;	      /* default 0 */
	uint32_t shards;      /* number of files; 0 (default): safetensors split where a file would pass
			       * shard_bytes, GGUF writes one file */
	uint64_t shard_bytes; /* safetensors, when shards == 0; default SYNTH_DEFAULT_SHARD_BYTES */
	bool tied;	      /* write tie_word_embeddings true and no lm_head (cfg->tie_embeddings also does) */
	bool progress;	      /* print "wrote X of Y, Z GB/s" to stderr about once a second */
	uint32_t format;      /* enum synth_format; default SYNTH_SAFETENSORS */
	uint32_t gguf_type;   /* enum synth_gguf_type, GGUF only; default SYNTH_GGUF_BF16 */
	const char *tokenizer; /* GGUF only: a Hugging Face tokenizer.json (Llama 3's byte-level BPE) to embed;
				* NULL (default): no vocabulary, only the BOS/EOS ids */
	const char *name;     /* GGUF general.name; NULL (default): "synthetic" */
	uint32_t threads;     /* GGUF: threads converting and quantizing; 0 (default): one per online CPU */
};

/* What a write produced (synth_write_stats). */
struct synth_stats {
	uint64_t params;       /* parameters written */
	uint64_t tensor_bytes; /* payload bytes of all tensors */
	uint64_t file_bytes;   /* bytes of the weight files (headers included) */
	uint32_t n_files;      /* weight files (safetensors or GGUF) */
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
 *   "qwen3-tiny"       Qwen3: dim 64, 2 layers, 4 heads, 2 kv heads, head_dim 32 (heads * head_dim != dim),
 *                      q/k norms, ffn 192, vocab 512, max_pos 4096, rms 1e-6, theta 1e6, no scaling,
 *                      bos 1, eos {2}, tied embeddings
 *   "mixtral-tiny"     Mixtral: dim 64, 2 layers, 4 heads, 2 kv, head_dim 16, 8 experts of ffn 128, top 2,
 *                      vocab 512, max_pos 4096, rms 1e-5, theta 1e6, bos 1, eos {2}, untied
 *   "qwen3-moe-tiny"   Qwen3-MoE: as qwen3-tiny, untied, intermediate_size 192, 8 experts of 48, top 2,
 *                      norm_topk_prob true
 *   "mixtral-8x7b[:N]" dim 4096, N layers (1..32, default 32), 32 heads, 8 kv, head_dim 128, 8 experts of
 *                      14336, top 2, vocab 32000, max_pos 32768, rms 1e-5, theta 1e6, bos 1, eos {2}
 *   "qwen3-30b-a3b[:N]" dim 2048, N layers (1..48, default 48), 32 heads, 4 kv, head_dim 128, q/k norms,
 *                      128 experts of 768, top 8, norm_topk_prob, intermediate_size 6144, vocab 151936,
 *                      max_pos 40960, rms 1e-6, theta 1e6, bos 151643, eos {151645}
 * Returns 0, or -EINVAL with a message listing the shapes. */
int synth_shape_config(const char *spec, struct model_config *cfg, char *err, size_t errlen);

/* Parses a rope scaling override: "none", "linear:F" (F > 0) or "llama3" (factor 8, low 1,
 * high 4, original 8192). Sets the rope fields of cfg. Returns 0 or -EINVAL with a message. */
int synth_parse_rope_scaling(const char *text, struct model_config *cfg, char *err, size_t errlen);

/* Parameters of the model cfg describes (lm_head counted unless tied || cfg->tie_embeddings). */
uint64_t synth_param_count(const struct model_config *cfg, bool tied);

/* Writes the checkpoint for cfg into dir (created with its parents if needed). Checks cfg
 * with model_config_check first.
 *
 * Safetensors: overwrites config.json, generation_config.json and the weight files, and removes a
 * model.safetensors / model.safetensors.index.json / model-*-of-*.safetensors left from an
 * earlier write, so the directory holds exactly one checkpoint.
 *
 * GGUF: dir is the file to write when it ends in ".gguf" (its directory is made if needed; a
 * split set is named PREFIX-0000i-of-0000n.gguf after it), else a directory that gets model.gguf
 * or model-0000i-of-0000n.gguf (synth_gguf_path), and loses the model.gguf / model-*-of-*.gguf an
 * earlier write left there. A split set is what llama.cpp's gguf-split writes: every file has
 * split.no, split.count and split.tensors.count, the first holds all the other metadata.
 * -EINVAL for a matrix whose row does not hold whole blocks of the type, for a tokenizer that
 * does not fit the vocabulary or is not Llama 3's, and for an odd head_dim.
 *
 * Returns 0; on failure -errno (-EINVAL bad config or options, -ENOSPC, -EIO, -ENOMEM, ...) with a
 * message naming the file (or tensor, or key), after removing the files it wrote (and the
 * directories it created). Prints progress to stderr when o->progress. */
int synth_write(const char *dir, const struct model_config *cfg, const struct synth_options *o, char *err,
		size_t errlen);

/* 1 with the path of the first file in out that synth_write with o would replace or remove (a
 * checkpoint's file: the GGUF files of its stem, or a directory's weight files, config.json and
 * generation_config.json), else 0: what asks for --force. */
int synth_existing(const char *out, const struct synth_options *o, char *path, size_t len);

/* synth_write that also reports what it wrote into *stats (may be NULL). */
int synth_write_stats(const char *dir, const struct model_config *cfg, const struct synth_options *o,
		      struct synth_stats *stats, char *err, size_t errlen);

/* Parses a GGUF type name: f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k (any case). Returns
 * 0, or -EINVAL for other text. */
int synth_parse_gguf_type(const char *text, enum synth_gguf_type *out);
/* The lower-case name of a GGUF type ("q4_k_m"), "?" for a value not in the enum. */
const char *synth_gguf_type_name(enum synth_gguf_type t);

/* The path of GGUF file i (0-based) of n_files that synth_write writes for out (see synth_write).
 * Returns 0, or -ENAMETOOLONG when it does not fit buf. */
int synth_gguf_path(const char *out, uint32_t i, uint32_t n_files, char *buf, size_t len);

/* The value synth_write stores for element i of the tensor named name (before rounding to
 * the dtype): lets a test check bytes it did not read from the file. is_norm selects the
 * 1 + N(0, 0.02) distribution of the norm weights. name and i are those of the Hugging Face
 * checkpoint ("model.layers.0.self_attn.q_proj.weight", row-major), for GGUF files too: a GGUF
 * tensor holds the values of the Hugging Face tensor it is converted from (wq and wk of the llama
 * architecture with their rows permuted), a fused expert tensor those of each expert's in turn. */
float synth_value(uint64_t seed, const char *name, bool is_norm, uint64_t i);

#ifdef __cplusplus
}
#endif
#endif

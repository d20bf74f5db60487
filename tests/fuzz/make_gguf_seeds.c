/* make_gguf_seeds.c - writes the seed corpus of fuzz_gguf: GGUF headers (the harness extends each
 * file to the data its tensor table names) written by the tests' GGUF writer
 * (tests/unit/manifest/gguf_test_writer.h): the tiny Llama in F32 and Q8_0, tied, with a cut of
 * the Llama 3 tokenizer and with the SentencePiece fixture, with llama3 RoPE scaling
 * (rope_freqs.weight's data kept in the seed), and a few that are refused past the first checks.
 *
 *   make_gguf_seeds SOURCE_DIR OUT_DIR      (tests/fuzz/make-corpus.py runs it into corpus/gguf) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/unit/manifest/gguf_test_writer.h"

static const char *src, *out;

static void save(struct gw *w, const char *name, size_t keep_data)
{
	unsigned char *b;
	size_t len;
	w->header_only = keep_data == 0;
	gw_bytes(w, &b, &len);
	if (keep_data && w->data_start + keep_data < len)
		len = w->data_start + keep_data;
	char path[4096];
	snprintf(path, sizeof(path), "%s/seed-%s", out, name);
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(b, 1, len, f) != len || fclose(f) != 0) {
		fprintf(stderr, "make_gguf_seeds: cannot write %s\n", path);
		exit(1);
	}
	free(b);
	gw_free(&w);
}

static struct gw *tiny(const struct gw_llama *o, const char *skip)
{
	struct gw *w = gw_new();
	w->skip[0] = skip;
	gw_tiny_llama(w, o);
	w->skip[0] = NULL;
	return w;
}

static void tokenizer(struct gw *w, const char *rel, const char *model, const char *pre, uint32_t cut,
		      uint32_t n_added, int32_t bos, int32_t eos)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", src, rel);
	if (gw_tokenizer_from_hf(w, path, model, pre, cut, n_added, bos, eos) != 0) {
		fprintf(stderr, "make_gguf_seeds: cannot read %s\n", path);
		exit(1);
	}
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: make_gguf_seeds SOURCE_DIR OUT_DIR\n");
		return 2;
	}
	src = argv[1];
	out = argv[2];
	save(tiny(&(struct gw_llama){.type = GW_F32}, NULL), "tiny-f32", 0);
	save(tiny(&(struct gw_llama){.type = GW_Q8_0, .tied = true, .n_layers = 1}, NULL), "tiny-q8_0-tied", 0);

	struct gw *w = tiny(&(struct gw_llama){.type = GW_Q8_0, .n_layers = 1, .no_tokens_meta = true}, NULL);
	tokenizer(w, "tests/data/llama3-tokenizer/tokenizer.json", "gpt2", "llama-bpe", 240, 8, 240, 241);
	gw_u32(w, "tokenizer.ggml.eot_token_id", 245);
	gw_str(w, "tokenizer.chat_template", "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}");
	save(w, "tiny-llama3-tokenizer", 0);

	w = tiny(&(struct gw_llama){.type = GW_F16, .n_layers = 1, .no_tokens_meta = true}, NULL);
	tokenizer(w, "tests/unit/tokenizer/data/sp-legacy/tokenizer.json", "llama", NULL, 0, 0, 1, 2);
	gw_u32(w, "tokenizer.ggml.unknown_token_id", 0);
	gw_bool(w, "tokenizer.ggml.add_space_prefix", true);
	save(w, "tiny-sentencepiece", 0);

	/* llama3 RoPE: rope_freqs.weight first in the data, and its 32 bytes kept. */
	struct gw_llama o = {.type = GW_BF16, .n_layers = 1};
	w = gw_new();
	w->skip[0] = "llama.rope.freq_base";
	gw_tiny_llama_keys(w, &o);
	w->skip[0] = NULL;
	gw_f32(w, "llama.rope.freq_base", 500000.0f);
	float v[8];
	for (int i = 0; i < 8; i++) {
		float freq = 1.0f / powf(500000.0f, (float)(2 * i) / 16.0f), wl = (float)(2 * M_PI) / freq;
		float smooth = (8192.0f / wl - 1.0f) / 3.0f;
		v[i] = wl < 2048.0f ? 1.0f : wl > 8192.0f ? 8.0f : 1.0f / ((1 - smooth) / 8.0f + smooth);
	}
	uint64_t ne[1] = {8};
	gw_tensor(w, "rope_freqs.weight", GW_F32, 1, ne, v);
	gw_tiny_llama_tensors(w, &o, 0, gw_tiny_llama_n_tensors(&o));
	save(w, "tiny-rope-llama3", sizeof(v));

	/* Refused past the first checks: another type, another architecture, version 2 with a wider
	 * alignment and an unexpected tensor. */
	w = tiny(&(struct gw_llama){.type = GW_F32, .n_layers = 1}, "blk.0.ffn_down.weight");
	uint64_t ne2[2] = {192, 64};
	gw_tensor(w, "blk.0.ffn_down.weight", GW_Q4_1, 2, ne2, NULL);
	save(w, "q4_1", 0);
	w = tiny(&(struct gw_llama){.n_layers = 1}, "general.architecture");
	gw_str(w, "general.architecture", "qwen2");
	save(w, "qwen2", 0);
	w = gw_new();
	w->version = 2;
	gw_alignment(w, 64);
	gw_tiny_llama(w, &(struct gw_llama){.n_layers = 1, .tied = true});
	uint64_t ne3[1] = {64};
	gw_tensor(w, "blk.0.attn_q.bias", GW_F32, 1, ne3, NULL);
	save(w, "v2-bias", 0);
	return 0;
}

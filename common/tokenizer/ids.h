/* ids.h - the ids a tokenizer.json defines, read with jansson alone: no PCRE2, no tokenizer.
 *
 * For the checkpoint reader (common/manifest.h), which checks a checkpoint's tokenizer.json
 * against config.json's vocab_size in the ssd-loader, a process that never encodes text. The
 * whole file (merges, normalizer, pre-tokenizer, decoder) is checked where it is used:
 * tokenizer_load_buffer (tokenizer.h), which the runner runs at its start on the bytes the loader
 * sends it.
 *
 *   uint32_t n_ids;
 *   if (tokenizer_ids_scan(path, data, size, &n_ids, err, sizeof(err)) != 0) { ... err ... }
 *   if (n_ids > vocab_size) { ... another model's tokenizer ... }
 *
 * The messages are the loader's own for the same faults, word for word. */
#ifndef PIPELINE_TOKENIZER_IDS_H
#define PIPELINE_TOKENIZER_IDS_H
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

/* Reads size bytes of tokenizer.json (name names them in messages): model.vocab (piece -> id)
 * and added_tokens (each with a content and an id). Returns 0 and *n_ids, the highest id of
 * either plus one (tokenizer_vocab_size of the loaded file); or -EINVAL with a message in err:
 * not JSON, model.vocab missing, empty or not an object, added_tokens not a list of objects
 * with a non-empty content, an id that is not an integer in [0, TOK_MAX_ID]. Nothing else of
 * the file is looked at. */
int tokenizer_ids_scan(const char *name, const char *data, size_t size, uint32_t *n_ids, char *err, size_t errlen);

/* Shared with the tokenizer's loader (load.c, vocab.c), so both say the same: */

/* What a JSON value is, for messages: "an object", "a list", ..., "missing" for NULL. */
const char *tok_json_kind(const json_t *v);

/* The id v of a vocab entry or an added token (what: "vocab entry", "added token"; piece: its
 * text), which must be an integer in [0, TOK_MAX_ID]. Returns 0 and *id, or -EINVAL with a
 * message naming the file (name), what and piece. */
int tok_json_id(const char *name, const json_t *v, const char *what, const char *piece, uint32_t *id, char *err,
		size_t errlen);

#ifdef __cplusplus
}
#endif
#endif

/* text.h - the runner's text interface: a request's prompt as text or as chat messages turned
 * into token ids with the model's tokenizer, and the generated ids turned back into text as
 * they come, with stop strings watched.
 *
 *   struct text_prompt tp;
 *   rc = text_prompt_build(tok, chat, cfg, &req->generate, &tp, err, sizeof(err));  // ids + extra stop ids
 *   struct text_stream *ts;
 *   rc = text_stream_create(tok, stop_strings_json, len, &ts, err, sizeof(err));
 *   for each token: text_stream_push(ts, id, &piece, &n, &hit);      // hit: a stop string appeared
 *   text_stream_finish(ts, &tail, &n);
 *
 * A chat goes through the model's chat template (common/jinja) when it has one that parses: the
 * text transformers' apply_chat_template gives (messages, bos_token, eos_token,
 * add_generation_prompt true, strftime_now the runner's clock), tokenized whole with no BOS added;
 * the turn ends at the end-of-turn token below where the tokenizer has one (every model's EOS
 * ends it anyway). Without a template, one of two built-in templates (chosen from the
 * tokenizer's special tokens), rendered and tokenized the same way:
 *  - Llama 3 headers: <|begin_of_text|> then per message
 *    <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>, then the assistant header;
 *    the turn ends at <|eot_id|>. CONTENT is trimmed, as Meta's template does.
 *  - ChatML: per message <|im_start|>ROLE\nCONTENT<|im_end|>\n, then <|im_start|>assistant\n;
 *    the turn ends at <|im_end|>.
 * Special-token text inside a message (ROLE, CONTENT) is parsed as special tokens unless the
 * request says GEN_SPECIAL_AS_TEXT; the template's own always are.
 */
#ifndef GPU_RUNNER_TEXT_H
#define GPU_RUNNER_TEXT_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/jinja/jinja.h"
#include "common/model.h"
#include "common/protocol.h"
#include "common/tokenizer/tokenizer.h"
#ifdef __cplusplus
extern "C" {
#endif

#define TEXT_MAX_STOP_STRINGS 16
#define TEXT_MAX_STOP_BYTES 256

enum chat_format {
	CHAT_NONE = 0,
	CHAT_LLAMA3 = 1,
	CHAT_CHATML = 2,
};

/* Which chat format tok's special tokens spell, CHAT_NONE if neither. */
enum chat_format chat_format_of(const struct tokenizer *tok);
const char *chat_format_name(enum chat_format f);

struct text_prompt {
	struct tok_ids ids;	   /* the prompt (owned: text_prompt_free) */
	int32_t end_of_turn;	   /* a stop id the chat format adds, -1 when none */
};

/* Builds the prompt of a MSG_GENERATE that gives `prompt` or `chat` (tok may be NULL only when
 * it gives token ids, which the caller handles itself). chat: the model's chat template, NULL for
 * the built-in formats. The BOS is config.json's bos_id (the tokenizer's when config has none),
 * put first for a prompt unless GEN_NO_BOS, and for a chat by the built-in formats (a template
 * writes its own). Returns 0 or -errno with a message: -EINVAL (malformed chat JSON, no chat
 * format, a template's error or refusal, text the tokenizer cannot spell), -ENOTSUP (no
 * tokenizer), -E2BIG (a template's render past its limits), -ENOMEM. */
int text_prompt_build(const struct tokenizer *tok, const struct jinja_template *chat, const struct model_config *cfg,
		      const struct msg_generate *g, struct text_prompt *out, char *err, size_t errlen);
void text_prompt_free(struct text_prompt *tp);

struct text_stream;

/* stop_json: a JSON array of up to TEXT_MAX_STOP_STRINGS non-empty strings of at most
 * TEXT_MAX_STOP_BYTES bytes, or NULL/empty. Returns 0 or -EINVAL/-ENOMEM with a message. */
int text_stream_create(const struct tokenizer *tok, const char *stop_json, size_t stop_len, struct text_stream **out,
		       char *err, size_t errlen);
void text_stream_destroy(struct text_stream **ts);
/* Feeds one generated id: *piece and *len is the text it completes (valid until the next call),
 * *hit says whether the text generated so far now holds a stop string. Returns 0 or -errno. */
int text_stream_push(struct text_stream *ts, int32_t id, const char **piece, size_t *len, bool *hit);
/* What the decoder still held back (an incomplete character becomes U+FFFD). */
int text_stream_finish(struct text_stream *ts, const char **tail, size_t *len);
bool text_stream_has_stops(const struct text_stream *ts);

#ifdef __cplusplus
}
#endif
#endif

/* openai.h - the OpenAI side of http-api: request bodies of /v1/completions and
 * /v1/chat/completions parsed and checked into a struct api_request, and the JSON shapes of the
 * replies (a whole completion, a streamed chunk, the model list, an error).
 *
 *   struct api_request req;
 *   rc = api_parse_request(body, len, API_CHAT, &opts, &req, &perr);   // 0, or -EINVAL: perr says why
 *   ... generate ...
 *   json_t *o = api_completion_json(&req, id, model, created, text, len, finish, n_prompt, n_generated);
 *   api_request_free(&req);
 *
 * Stop strings end the text before them, as OpenAI's do: struct api_stop_filter holds back the
 * text that could be the start of a stop string while streaming, and cuts at the first one. */
#ifndef HTTP_API_OPENAI_H
#define HTTP_API_OPENAI_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#define API_MAX_STOPS 16      /* stop strings a request may give */
#define API_MAX_STOP_BYTES 256 /* bytes of one stop string */
#define API_MAX_MESSAGES 4096  /* chat messages a request may give */

enum api_kind { API_COMPLETION, API_CHAT };

/* What a request may not exceed and the defaults it gets (main.c's flags). */
struct api_limits {
	long max_tokens_default; /* max_tokens when the request gives none */
	long max_tokens_limit;	 /* the largest max_tokens taken */
};

struct api_request {
	enum api_kind kind;
	char *prompt;	  /* API_COMPLETION: the prompt text (malloc'd) */
	char *chat_json;  /* API_CHAT: [{"role", "content"}, ...] as the runner takes it (malloc'd) */
	char *stops_json; /* a JSON array of the stop strings, NULL when none (malloc'd) */
	char *stops[API_MAX_STOPS]; /* the same strings (malloc'd) */
	int n_stops;
	long max_tokens;
	double temperature; /* 0: greedy */
	double top_p;	    /* 1: off */
	uint64_t top_k;	    /* 0: off (an extension, as vLLM and llama.cpp take it) */
	double min_p;	    /* 0: off (an extension) */
	double repetition_penalty; /* 1: off (an extension) */
	uint64_t seed;
	bool has_seed;	    /* the request gave a seed; else the caller picks one */
	bool stream;
	bool ignore_eos;    /* an extension (vLLM's): the model's end-of-sequence ids do not stop it */
	bool include_usage; /* stream_options.include_usage: a last chunk with usage */
};

/* Why a request was refused: the message and the parameter it names (NULL when none). */
struct api_problem {
	char message[512];
	const char *param;
};

/* Parses a request body of len bytes (not NUL-terminated) of the given kind, checking every
 * parameter it knows (unknown ones are ignored). Returns 0 with *req filled (api_request_free
 * it), -EINVAL with *why filled (bad JSON, a wrong type or value; *req holds nothing), or
 * -ENOMEM. */
int api_parse_request(const char *body, size_t len, enum api_kind kind, const struct api_limits *lim,
		      struct api_request *req, struct api_problem *why);

/* Frees what api_parse_request allocated. Safe on a zeroed request and twice. */
void api_request_free(struct api_request *req);

/* OpenAI's finish_reason for the runner's reason ("length", "stop", "stop_string", "context"):
 * "length" or "stop". A stop string cut by the filter is "stop". */
const char *api_finish_reason(const char *runner_reason);

/* The error body {"error": {"message", "type", "param", "code"}}; param and code may be NULL. A
 * message that is not UTF-8 (a URL's bytes quoted into it, a cut in the middle of a character)
 * has each invalid sequence replaced by U+FFFD, so the message is never dropped. Returns a new
 * reference, or NULL when out of memory. */
json_t *api_error_json(const char *message, const char *type, const char *param, const char *code);

/* The whole reply of a request that did not stream: a text_completion or a chat.completion with
 * choices[0] holding text (len bytes of UTF-8) and finish_reason, and usage. Returns a new
 * reference or NULL. */
json_t *api_completion_json(const struct api_request *req, const char *id, const char *model, int64_t created,
			    const char *text, size_t len, const char *finish, uint64_t n_prompt, uint64_t n_generated);

/* One streamed chunk: text (len bytes; for a chat, the delta's content) and finish_reason (NULL
 * while it goes on). role_first: a chat's first chunk, whose delta carries the role. Returns a
 * new reference or NULL. */
json_t *api_chunk_json(const struct api_request *req, const char *id, const char *model, int64_t created,
		       const char *text, size_t len, const char *finish, bool role_first);

/* The last chunk of a stream with stream_options.include_usage: no choices, the usage. */
json_t *api_usage_chunk_json(const struct api_request *req, const char *id, const char *model, int64_t created,
			     uint64_t n_prompt, uint64_t n_generated);

/* GET /v1/models: a list holding the one model. */
json_t *api_models_json(const char *model, int64_t created);
/* One model object, as GET /v1/models/{model} answers (and each entry of the list above). */
json_t *api_model_json(const char *model, int64_t created);

/* ---- stop strings ---- */

/* The text generated so far and how much of it may be given out. */
struct api_stop_filter {
	char *text;	  /* everything generated (malloc'd, NUL-terminated) */
	size_t len, cap;
	size_t released;  /* bytes of text given out so far */
	bool stopped;	  /* a stop string was found: text ends at released */
};

/* Appends len bytes of generated text. Returns 0 or -ENOMEM. */
int api_stop_filter_push(struct api_stop_filter *f, const struct api_request *req, const char *p, size_t len);

/* The bytes that may be given out now, from text + *from (the previous release) to the returned
 * end: all but a tail that may begin a stop string, and never past a stop string found. With
 * final, nothing is held back (the generation ended). Updates f->released. */
size_t api_stop_filter_release(struct api_stop_filter *f, const struct api_request *req, bool final, size_t *from);

void api_stop_filter_free(struct api_stop_filter *f);

#endif

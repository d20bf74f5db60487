/* openai.c - request parsing and reply shapes of OpenAI's completions and chat completions
 * (openai.h), and the stop-string filter.
 *
 * Parameters taken: model (accepted, any string), prompt (a string; an array of one string),
 * messages (chat: role and content; content a string or an array of {"type": "text", "text"}
 * parts, joined), max_tokens (max_completion_tokens too), temperature [0, 2], top_p [0, 1],
 * seed (any integer), stop (a string or an array of them), stream, stream_options.include_usage,
 * n (1 only), and the extensions other servers take too: top_k (an integer >= 0), min_p [0, 1],
 * repetition_penalty (0, 100], ignore_eos (a boolean). Anything else is ignored; a known parameter of the wrong type is
 * refused. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "services/http-api/openai.h"

#include "common/utf8.h"

static int problem(struct api_problem *why, const char *param, const char *fmt, const char *arg)
{
	snprintf(why->message, sizeof(why->message), fmt, arg ? arg : "");
	why->param = param;
	return -EINVAL;
}

/* A number parameter: absent leaves *out; present must be a number within [lo, hi]. */
static int get_number(json_t *root, const char *name, double lo, double hi, double *out, struct api_problem *why)
{
	json_t *v = json_object_get(root, name);
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_number(v))
		return problem(why, name, "'%s' must be a number", name);
	double d = json_number_value(v);
	if (!(d >= lo && d <= hi)) {
		snprintf(why->message, sizeof(why->message), "'%s' must be between %g and %g, not %g", name, lo, hi, d);
		why->param = name;
		return -EINVAL;
	}
	*out = d;
	return 0;
}

static int get_bool(json_t *root, const char *name, bool *out, struct api_problem *why)
{
	json_t *v = json_object_get(root, name);
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_boolean(v))
		return problem(why, name, "'%s' must be a boolean", name);
	*out = json_is_true(v);
	return 0;
}

static int parse_stops(json_t *root, struct api_request *req, struct api_problem *why)
{
	json_t *v = json_object_get(root, "stop");
	if (!v || json_is_null(v))
		return 0;
	json_t *arr = json_is_string(v) ? json_pack("[O]", v) : json_incref(v);
	if (!arr)
		return -ENOMEM;
	int rc = 0;
	if (!json_is_array(arr)) {
		rc = problem(why, "stop", "'stop' must be a string or an array of strings%s", NULL);
		goto out;
	}
	if (json_array_size(arr) > API_MAX_STOPS) {
		snprintf(why->message, sizeof(why->message), "'stop' holds %zu strings, at most %d",
			 json_array_size(arr), API_MAX_STOPS);
		why->param = "stop";
		rc = -EINVAL;
		goto out;
	}
	size_t i;
	json_t *s;
	json_array_foreach(arr, i, s) {
		if (!json_is_string(s)) {
			rc = problem(why, "stop", "'stop' must be a string or an array of strings%s", NULL);
			goto out;
		}
		size_t n = json_string_length(s);
		if (n == 0 || n > API_MAX_STOP_BYTES || memchr(json_string_value(s), 0, n)) {
			snprintf(why->message, sizeof(why->message),
				 "each stop string must hold 1 to %d bytes and no NUL", API_MAX_STOP_BYTES);
			why->param = "stop";
			rc = -EINVAL;
			goto out;
		}
		req->stops[req->n_stops] = strdup(json_string_value(s));
		if (!req->stops[req->n_stops]) {
			rc = -ENOMEM;
			goto out;
		}
		req->n_stops++;
	}
	if (req->n_stops) {
		req->stops_json = json_dumps(arr, JSON_COMPACT);
		rc = req->stops_json ? 0 : -ENOMEM;
	}
out:
	json_decref(arr);
	return rc;
}

/* A message's content: a string, or an array of parts of which the text ones are joined. */
static int content_text(json_t *c, size_t idx, json_t **out, struct api_problem *why)
{
	if (json_is_string(c)) {
		*out = json_incref(c);
		return 0;
	}
	if (!json_is_array(c)) {
		snprintf(why->message, sizeof(why->message),
			 "messages[%zu].content must be a string or an array of text parts", idx);
		why->param = "messages";
		return -EINVAL;
	}
	size_t total = 0, i;
	json_t *part;
	json_array_foreach(c, i, part) {
		json_t *type = json_object_get(part, "type"), *text = json_object_get(part, "text");
		if (!json_is_object(part) || !json_is_string(type) || strcmp(json_string_value(type), "text") ||
		    !json_is_string(text)) {
			snprintf(why->message, sizeof(why->message),
				 "messages[%zu].content[%zu] must be {\"type\": \"text\", \"text\": STRING} "
				 "(only text is taken)",
				 idx, i);
			why->param = "messages";
			return -EINVAL;
		}
		total += json_string_length(text);
	}
	char *buf = malloc(total + 1);
	if (!buf)
		return -ENOMEM;
	size_t at = 0;
	json_array_foreach(c, i, part) {
		json_t *text = json_object_get(part, "text");
		memcpy(buf + at, json_string_value(text), json_string_length(text));
		at += json_string_length(text);
	}
	*out = json_stringn_nocheck(buf, at);
	free(buf);
	return *out ? 0 : -ENOMEM;
}

static int parse_messages(json_t *root, struct api_request *req, struct api_problem *why)
{
	json_t *msgs = json_object_get(root, "messages");
	if (!msgs)
		return problem(why, "messages", "'messages' is required%s", NULL);
	if (!json_is_array(msgs) || json_array_size(msgs) == 0)
		return problem(why, "messages", "'messages' must be a non-empty array of {\"role\", \"content\"}%s",
			       NULL);
	if (json_array_size(msgs) > API_MAX_MESSAGES) {
		snprintf(why->message, sizeof(why->message), "'messages' holds %zu messages, at most %d",
			 json_array_size(msgs), API_MAX_MESSAGES);
		why->param = "messages";
		return -EINVAL;
	}
	json_t *out = json_array();
	if (!out)
		return -ENOMEM;
	size_t i;
	json_t *m;
	int rc = 0;
	json_array_foreach(msgs, i, m) {
		json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content"), *text = NULL;
		/* An assistant's earlier turn may have no content (null, or left out: a turn that
		 * called tools): it is an empty turn. */
		bool empty_turn = json_is_string(role) && !strcmp(json_string_value(role), "assistant") &&
				  (!content || json_is_null(content));
		if (!json_is_object(m) || !json_is_string(role) || (!content && !empty_turn)) {
			snprintf(why->message, sizeof(why->message),
				 "messages[%zu] must be an object with a string 'role' and a 'content'", i);
			why->param = "messages";
			rc = -EINVAL;
			break;
		}
		if (empty_turn)
			text = json_string("");
		else
			rc = content_text(content, i, &text, why);
		if (rc)
			break;
		if (!text) {
			rc = -ENOMEM;
			break;
		}
		json_t *o = json_object();
		if (!o || json_object_set(o, "role", role) || json_object_set_new(o, "content", text) ||
		    json_array_append_new(out, o)) {
			rc = -ENOMEM;
			break;
		}
	}
	if (!rc) {
		req->chat_json = json_dumps(out, JSON_COMPACT);
		rc = req->chat_json ? 0 : -ENOMEM;
	}
	json_decref(out);
	return rc;
}

static int parse_prompt(json_t *root, struct api_request *req, struct api_problem *why)
{
	json_t *p = json_object_get(root, "prompt");
	if (!p)
		return problem(why, "prompt", "'prompt' is required%s", NULL);
	if (json_is_array(p) && json_array_size(p) == 1 && json_is_string(json_array_get(p, 0)))
		p = json_array_get(p, 0);
	if (!json_is_string(p))
		return problem(why, "prompt", "'prompt' must be a string (or an array of one string)%s", NULL);
	if (json_string_length(p) == 0)
		return problem(why, "prompt", "'prompt' must not be empty%s", NULL);
	if (memchr(json_string_value(p), 0, json_string_length(p)))
		return problem(why, "prompt", "'prompt' must not hold a NUL character%s", NULL);
	req->prompt = strdup(json_string_value(p));
	return req->prompt ? 0 : -ENOMEM;
}

static int parse_max_tokens(json_t *root, const struct api_limits *lim, struct api_request *req,
			    struct api_problem *why)
{
	const char *name = "max_tokens";
	json_t *v = json_object_get(root, name);
	if ((!v || json_is_null(v)) && req->kind == API_CHAT) {
		name = "max_completion_tokens";
		v = json_object_get(root, name);
	}
	req->max_tokens = lim->max_tokens_default;
	if (!v || json_is_null(v))
		return 0;
	if (!json_is_integer(v))
		return problem(why, name, "'%s' must be an integer", name);
	json_int_t n = json_integer_value(v);
	if (n < 1 || n > lim->max_tokens_limit) {
		snprintf(why->message, sizeof(why->message), "'%s' must be between 1 and %ld, not %lld", name,
			 lim->max_tokens_limit, (long long)n);
		why->param = name;
		return -EINVAL;
	}
	req->max_tokens = (long)n;
	return 0;
}

static int parse_fields(json_t *root, const struct api_limits *lim, struct api_request *req, struct api_problem *why)
{
	json_t *model = json_object_get(root, "model");
	if (model && !json_is_null(model) && !json_is_string(model))
		return problem(why, "model", "'model' must be a string%s", NULL);
	int rc = req->kind == API_CHAT ? parse_messages(root, req, why) : parse_prompt(root, req, why);
	if (rc)
		return rc;
	if ((rc = parse_max_tokens(root, lim, req, why)))
		return rc;
	req->temperature = 1.0;
	req->top_p = 1.0;
	req->repetition_penalty = 1.0;
	if ((rc = get_number(root, "temperature", 0, 2, &req->temperature, why)) ||
	    (rc = get_number(root, "top_p", 0, 1, &req->top_p, why)) ||
	    (rc = get_number(root, "min_p", 0, 1, &req->min_p, why)) ||
	    (rc = get_number(root, "repetition_penalty", 1e-6, 100, &req->repetition_penalty, why)))
		return rc;
	json_t *top_k = json_object_get(root, "top_k");
	if (top_k && !json_is_null(top_k)) {
		/* -1 is "off" to some clients, as 0 is here. */
		if (!json_is_integer(top_k) || json_integer_value(top_k) < -1)
			return problem(why, "top_k", "'top_k' must be an integer >= 0 (0 or -1: off)%s", NULL);
		req->top_k = json_integer_value(top_k) < 0 ? 0 : (uint64_t)json_integer_value(top_k);
	}
	/* top_p 0 keeps only the likeliest token: greedy (the runner reads 0 as off). */
	if (req->top_p == 0) {
		req->temperature = 0;
		req->top_p = 1;
	}
	json_t *seed = json_object_get(root, "seed");
	if (seed && !json_is_null(seed)) {
		if (!json_is_integer(seed))
			return problem(why, "seed", "'seed' must be an integer%s", NULL);
		/* Any integer, as OpenAI takes; a negative one is its two's complement. */
		req->seed = (uint64_t)json_integer_value(seed);
		req->has_seed = true;
	}
	json_t *n = json_object_get(root, "n");
	if (n && !json_is_null(n)) {
		if (!json_is_integer(n))
			return problem(why, "n", "'n' must be an integer%s", NULL);
		if (json_integer_value(n) != 1)
			return problem(why, "n", "only n = 1 is served%s", NULL);
	}
	/* Function calling is not served: the model would never be shown the tools, and no reply carries
	 * tool_calls, so a request that offers some is refused rather than answered as if it had none.
	 * An empty list and tool_choice "none" ask for nothing. */
	json_t *tools = json_object_get(root, "tools"), *tool_choice = json_object_get(root, "tool_choice");
	if (tools && !json_is_null(tools) && !(json_is_array(tools) && json_array_size(tools) == 0))
		return problem(why, "tools", "'tools' (function calling) is not served: send the request without them%s",
			       NULL);
	if (tool_choice && !json_is_null(tool_choice) &&
	    !(json_is_string(tool_choice) && (!strcmp(json_string_value(tool_choice), "none") ||
					      !strcmp(json_string_value(tool_choice), "auto"))))
		return problem(why, "tool_choice", "'tool_choice' asks for a tool call, and function calling is not "
			       "served%s", NULL);
	if ((rc = get_bool(root, "stream", &req->stream, why)) || (rc = get_bool(root, "ignore_eos", &req->ignore_eos, why)))
		return rc;
	json_t *so = json_object_get(root, "stream_options");
	if (so && !json_is_null(so)) {
		if (!json_is_object(so))
			return problem(why, "stream_options", "'stream_options' must be an object%s", NULL);
		json_t *iu = json_object_get(so, "include_usage");
		if (iu && !json_is_null(iu) && !json_is_boolean(iu))
			return problem(why, "stream_options", "'stream_options.include_usage' must be a boolean%s",
				       NULL);
		req->include_usage = json_is_true(iu);
	}
	return parse_stops(root, req, why);
}

int api_parse_request(const char *body, size_t len, enum api_kind kind, const struct api_limits *lim,
		      struct api_request *req, struct api_problem *why)
{
	memset(req, 0, sizeof(*req));
	memset(why, 0, sizeof(*why));
	req->kind = kind;
	json_error_t jerr;
	json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
	if (!root) {
		snprintf(why->message, sizeof(why->message), "the body is not valid JSON: %s (line %d, column %d)",
			 jerr.text, jerr.line, jerr.column);
		return -EINVAL;
	}
	int rc = json_is_object(root) ? parse_fields(root, lim, req, why)
				       : problem(why, NULL, "the body must be a JSON object%s", NULL);
	json_decref(root);
	if (rc)
		api_request_free(req);
	return rc;
}

void api_request_free(struct api_request *req)
{
	free(req->prompt);
	free(req->chat_json);
	free(req->stops_json);
	for (int i = 0; i < req->n_stops; i++)
		free(req->stops[i]);
	req->prompt = req->chat_json = req->stops_json = NULL;
	req->n_stops = 0;
}

const char *api_finish_reason(const char *runner_reason)
{
	if (!runner_reason)
		return "stop";
	if (!strcmp(runner_reason, "length") || !strcmp(runner_reason, "context"))
		return "length";
	return "stop";
}

/* A JSON string of s, each maximal invalid subpart of its UTF-8 replaced by U+FFFD. NULL: out of
 * memory. */
static json_t *json_text(const char *s)
{
	const size_t n = strlen(s);
	if (utf8_valid(s, n))
		return json_string(s);
	char *t = malloc(3 * n + 1);
	if (!t)
		return NULL;
	size_t o = 0;
	for (size_t i = 0, len; i < n; i += len) {
		if (utf8_unit((const uint8_t *)s + i, n - i, &len) == U8_VALID) {
			memcpy(t + o, s + i, len);
			o += len;
		} else {
			memcpy(t + o, "\xEF\xBF\xBD", 3);
			o += 3;
		}
	}
	t[o] = 0;
	json_t *j = json_string(t);
	free(t);
	return j;
}

static json_t *str_or_null(const char *s)
{
	return s ? json_string(s) : json_null();
}

json_t *api_error_json(const char *message, const char *type, const char *param, const char *code)
{
	json_t *e = json_object();
	if (!e)
		return NULL;
	json_object_set_new(e, "message", json_text(message ? message : ""));
	json_object_set_new(e, "type", json_string(type ? type : "server_error"));
	json_object_set_new(e, "param", str_or_null(param));
	json_object_set_new(e, "code", str_or_null(code));
	return json_pack("{s:o}", "error", e);
}

static json_t *usage_json(uint64_t n_prompt, uint64_t n_generated)
{
	return json_pack("{s:I, s:I, s:I}", "prompt_tokens", (json_int_t)n_prompt, "completion_tokens",
			 (json_int_t)n_generated, "total_tokens", (json_int_t)(n_prompt + n_generated));
}

/* {"id", "object", "created", "model", "choices": [choice]} */
static json_t *envelope(const char *object, const char *id, const char *model, int64_t created, json_t *choice)
{
	json_t *choices = choice ? json_pack("[o]", choice) : json_array();
	if (!choices)
		return NULL;
	return json_pack("{s:s, s:s, s:I, s:s, s:o}", "id", id, "object", object, "created", (json_int_t)created,
			 "model", model, "choices", choices);
}

json_t *api_completion_json(const struct api_request *req, const char *id, const char *model, int64_t created,
			    const char *text, size_t len, const char *finish, uint64_t n_prompt, uint64_t n_generated)
{
	json_t *content = json_stringn(text, len);
	if (!content)
		content = json_string(""); /* not UTF-8: cannot happen with the runner's text */
	json_t *choice;
	if (req->kind == API_CHAT)
		choice = json_pack("{s:i, s:{s:s, s:o}, s:n, s:s}", "index", 0, "message", "role", "assistant",
				   "content", content, "logprobs", "finish_reason", finish);
	else
		choice = json_pack("{s:i, s:o, s:n, s:s}", "index", 0, "text", content, "logprobs", "finish_reason",
				   finish);
	json_t *o = envelope(req->kind == API_CHAT ? "chat.completion" : "text_completion", id, model, created, choice);
	if (o)
		json_object_set_new(o, "usage", usage_json(n_prompt, n_generated));
	return o;
}

json_t *api_chunk_json(const struct api_request *req, const char *id, const char *model, int64_t created,
		       const char *text, size_t len, const char *finish, bool role_first)
{
	json_t *content = json_stringn(text, len);
	if (!content)
		content = json_string("");
	json_t *choice;
	if (req->kind == API_CHAT) {
		json_t *delta = json_object();
		if (role_first)
			json_object_set_new(delta, "role", json_string("assistant"));
		if (len || role_first)
			json_object_set(delta, "content", content);
		choice = json_pack("{s:i, s:o, s:n, s:o}", "index", 0, "delta", delta, "logprobs", "finish_reason",
				   str_or_null(finish));
	} else {
		choice = json_pack("{s:i, s:O, s:n, s:o}", "index", 0, "text", content, "logprobs", "finish_reason",
				   str_or_null(finish));
	}
	json_decref(content);
	return envelope(req->kind == API_CHAT ? "chat.completion.chunk" : "text_completion", id, model, created,
			choice);
}

json_t *api_usage_chunk_json(const struct api_request *req, const char *id, const char *model, int64_t created,
			     uint64_t n_prompt, uint64_t n_generated)
{
	json_t *o = envelope(req->kind == API_CHAT ? "chat.completion.chunk" : "text_completion", id, model, created,
			     NULL);
	if (o)
		json_object_set_new(o, "usage", usage_json(n_prompt, n_generated));
	return o;
}

json_t *api_model_json(const char *model, int64_t created)
{
	return json_pack("{s:s, s:s, s:I, s:s}", "id", model, "object", "model", "created", (json_int_t)created,
			 "owned_by", "llm-pipeline");
}

json_t *api_models_json(const char *model, int64_t created)
{
	return json_pack("{s:s, s:[o]}", "object", "list", "data", api_model_json(model, created));
}

/* ---- stop strings ---- */

int api_stop_filter_push(struct api_stop_filter *f, const struct api_request *req, const char *p, size_t len)
{
	(void)req;
	if (f->stopped || !len)
		return 0;
	if (f->len + len + 1 > f->cap) {
		size_t cap = f->cap ? f->cap : 256;
		while (cap < f->len + len + 1)
			cap *= 2;
		char *t = realloc(f->text, cap);
		if (!t)
			return -ENOMEM;
		f->text = t;
		f->cap = cap;
	}
	memcpy(f->text + f->len, p, len);
	f->len += len;
	f->text[f->len] = 0;
	return 0;
}

size_t api_stop_filter_release(struct api_stop_filter *f, const struct api_request *req, bool final, size_t *from)
{
	*from = f->released;
	if (f->stopped)
		return f->released;
	size_t end = f->len;
	/* The earliest stop string in the text not given out yet (one may straddle the release). */
	size_t longest = 0;
	for (int i = 0; i < req->n_stops; i++) {
		size_t n = strlen(req->stops[i]);
		longest = n > longest ? n : longest;
		size_t start = f->released >= n ? f->released - n + 1 : 0;
		const char *hit = f->len >= start ? memmem(f->text + start, f->len - start, req->stops[i], n) : NULL;
		if (hit && (size_t)(hit - f->text) < end && (size_t)(hit - f->text) >= f->released) {
			end = (size_t)(hit - f->text);
			f->stopped = true;
		}
	}
	if (!f->stopped && !final) {
		/* Hold back the longest tail that is the start of a stop string. */
		for (size_t k = longest > 1 ? longest - 1 : 0; k > 0; k--) {
			if (k > f->len - f->released)
				continue;
			bool prefix = false;
			for (int i = 0; i < req->n_stops && !prefix; i++)
				prefix = strlen(req->stops[i]) > k && !memcmp(f->text + f->len - k, req->stops[i], k);
			if (prefix) {
				end = f->len - k;
				break;
			}
		}
	}
	if (end < f->released)
		end = f->released;
	f->released = end;
	return end;
}

void api_stop_filter_free(struct api_stop_filter *f)
{
	free(f->text);
	memset(f, 0, sizeof(*f));
}

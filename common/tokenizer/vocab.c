/* vocab.c - the BPE model: model.vocab, added_tokens and merges read into the arena, the
 * piece hash, the merge hash and the added-token trie; the lookups over them, the special ids
 * (BOS, EOS) and the queries of tokenizer.h. */
#include "common/tokenizer/tokenizer_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- lookups ---- */

static uint32_t hash_piece(const char *s, size_t n)
{
	return (uint32_t)fnv1a64(FNV64_INIT, s, n);
}

static const char *entry_piece(const struct tokenizer *t, uint32_t id)
{
	return t->arena + t->entries[id].off;
}

/* The vocab id of the piece s[0..n), or -1. */
int32_t tok_vocab_find(const struct tokenizer *t, const char *s, size_t n)
{
	uint32_t h = hash_piece(s, n);
	for (uint32_t i = h & t->vocab_mask;; i = (i + 1) & t->vocab_mask) {
		const struct vocab_slot *v = &t->vocab[i];
		if (!v->id1)
			return -1;
		if (v->hash != h)
			continue;
		const struct entry *e = &t->entries[v->id1 - 1];
		if (e->len == n && memcmp(t->arena + e->off, s, n) == 0)
			return (int32_t)(v->id1 - 1);
	}
}

static uint64_t merge_key(uint32_t left, uint32_t right)
{
	return ((uint64_t)left + 1) << 32 | right;
}

static uint64_t merge_slot_of(uint64_t key, unsigned bits)
{
	return (key * 0x9E3779B97F4A7C15ull) >> (64 - bits);
}

const struct merge_slot *tok_merge_find(const struct tokenizer *t, uint32_t left, uint32_t right)
{
	uint64_t key = merge_key(left, right), mask = (1ull << t->merge_bits) - 1;
	for (uint64_t i = merge_slot_of(key, t->merge_bits);; i = (i + 1) & mask) {
		const struct merge_slot *m = &t->merges[i];
		if (m->key == key)
			return m;
		if (!m->key)
			return NULL;
	}
}

uint32_t tok_trie_child(const struct tokenizer *t, uint32_t node, uint8_t b)
{
	if (node == 0)
		return t->root[b];
	for (uint32_t c = t->trie[node].child; c; c = t->trie[c].sibling)
		if (t->trie[c].byte == b)
			return c;
	return 0;
}

/* The added token whose content is exactly s, as an index into t->added, or -1. */
static int32_t added_find(const struct tokenizer *t, const char *s, size_t n)
{
	uint32_t node = 0;
	for (size_t i = 0; i < n; i++) {
		node = tok_trie_child(t, node, (uint8_t)s[i]);
		if (!node)
			return -1;
	}
	return n ? t->trie[node].added : -1;
}

/* ---- loading the model ---- */

int tok_arena_add(struct loader *L, const char *s, size_t n, uint32_t *off)
{
	if (L->arena.len + n + 1 > UINT32_MAX)
		return LERR(L, -EFBIG, "%s: the pieces take more than 4 GiB", L->name);
	*off = (uint32_t)L->arena.len;
	int rc = tok_buf_put(&L->arena, s, n);
	if (!rc)
		rc = tok_buf_put(&L->arena, "", 1);
	if (rc)
		return LERR(L, -ENOMEM, "%s: out of memory", L->name);
	return 0;
}

/* An id field of a vocab or added_tokens entry. */
static int get_id(struct loader *L, const json_t *v, const char *what, const char *piece, uint32_t *id)
{
	return tok_json_id(L->name, v, what, piece, id, L->err, L->errlen);
}

static int build_vocab_hash(struct loader *L, uint32_t n_vocab)
{
	struct tokenizer *t = L->t;
	uint32_t cap = 16;
	while (cap < 2 * n_vocab)
		cap *= 2;
	t->vocab = tok_calloc(cap, sizeof(*t->vocab));
	if (!t->vocab)
		return LERR(L, -ENOMEM, "%s: out of memory", L->name);
	t->vocab_mask = cap - 1;
	for (uint32_t id = 0; id < t->n_ids; id++) {
		const struct entry *e = &t->entries[id];
		if (!e->in_vocab)
			continue;
		uint32_t h = hash_piece(t->arena + e->off, e->len), i = h & t->vocab_mask;
		while (t->vocab[i].id1)
			i = (i + 1) & t->vocab_mask;
		t->vocab[i].hash = h;
		t->vocab[i].id1 = id + 1;
	}
	return 0;
}

/* Reads model.vocab into the entries (t->n_ids and t->entries already sized). */
static int read_vocab(struct loader *L, const json_t *vocab)
{
	struct tokenizer *t = L->t;
	const char *key;
	json_t *v;
	json_object_foreach((json_t *)vocab, key, v) {
		uint32_t id;
		int rc = get_id(L, v, "vocab entry", key, &id);
		if (rc)
			return rc;
		struct entry *e = &t->entries[id];
		if (e->kind != ENTRY_HOLE)
			return LERR(L, -EINVAL, "%s: vocab id %u appears twice ('%s' and '%s')", L->name, id,
				    L->arena.p + e->off, key);
		size_t n = strlen(key);
		if (!n)
			return LERR(L, -EINVAL, "%s: the vocab has an empty piece (id %u)", L->name, id);
		rc = tok_arena_add(L, key, n, &e->off);
		if (rc)
			return rc;
		e->len = (uint32_t)n;
		e->kind = ENTRY_VOCAB;
		e->in_vocab = 1;
	}
	return 0;
}

static int trie_insert(struct loader *L, const char *s, size_t n, uint32_t index)
{
	struct tokenizer *t = L->t;
	uint32_t node = 0;
	for (size_t i = 0; i < n; i++) {
		uint8_t b = (uint8_t)s[i];
		uint32_t c = tok_trie_child(t, node, b);
		if (!c) {
			if (t->n_trie == t->cap_trie) {
				uint32_t cap = t->cap_trie ? t->cap_trie * 2 : 256;
				struct trie_node *p = tok_realloc(t->trie, cap * sizeof(*p));
				if (!p)
					return LERR(L, -ENOMEM, "%s: out of memory", L->name);
				t->trie = p;
				t->cap_trie = cap;
			}
			c = t->n_trie++;
			t->trie[c] = (struct trie_node){.child = 0, .sibling = 0, .added = -1, .byte = b};
			if (node == 0) {
				t->root[b] = c;
			} else {
				t->trie[c].sibling = t->trie[node].child;
				t->trie[node].child = c;
			}
		}
		node = c;
	}
	if (t->trie[node].added >= 0)
		return LERR(L, -EINVAL, "%s: added token '%s' appears twice (ids %u and %u)", L->name, s,
			    t->added[t->trie[node].added].id, t->added[index].id);
	t->trie[node].added = (int32_t)index;
	return 0;
}

static int read_added(struct loader *L, const json_t *list)
{
	struct tokenizer *t = L->t;
	size_t n = json_array_size(list);
	t->added = tok_calloc(n ? n : 1, sizeof(*t->added));
	t->trie = tok_malloc(256 * sizeof(*t->trie));
	if (!t->added || !t->trie)
		return LERR(L, -ENOMEM, "%s: out of memory", L->name);
	t->cap_trie = 256;
	t->n_trie = 1;
	t->trie[0] = (struct trie_node){.child = 0, .sibling = 0, .added = -1, .byte = 0};
	for (size_t i = 0; i < n; i++) {
		const json_t *a = json_array_get(list, i);
		char where[48];
		const char *content;
		size_t len;
		uint32_t id;
		struct added_token *at = &t->added[i];
		snprintf(where, sizeof(where), "added_tokens[%zu]", i);
		if (!json_is_object(a))
			return LERR(L, -EINVAL, "%s: %s must be an object, got %s", L->name, where, tok_json_kind(a));
		int rc = tok_get_str(L, a, where, "content", true, &content, &len);
		if (!rc && !len)
			rc = LERR(L, -EINVAL, "%s: %s.content is empty", L->name, where);
		if (!rc)
			rc = get_id(L, json_object_get(a, "id"), "added token", content, &id);
		if (!rc)
			rc = tok_get_bool(L, a, where, "special", &at->special);
		if (!rc)
			rc = tok_get_bool(L, a, where, "lstrip", &at->lstrip);
		if (!rc)
			rc = tok_get_bool(L, a, where, "rstrip", &at->rstrip);
		if (!rc)
			rc = tok_get_bool(L, a, where, "single_word", &at->single_word);
		if (rc)
			return rc;
		at->id = id;
		struct entry *e = &t->entries[id];
		if (e->kind == ENTRY_ADDED)
			return LERR(L, -EINVAL, "%s: added token id %u appears twice ('%s' and '%s')", L->name, id,
				    L->arena.p + e->off, content);
		if (e->in_vocab &&
		    (e->len != len || memcmp(L->arena.p + e->off, content, len) != 0))
			return LERR(L, -EINVAL, "%s: added token '%s' has id %u, which the vocab gives to '%s'",
				    L->name, content, id, L->arena.p + e->off);
		if (e->kind == ENTRY_HOLE) {
			rc = tok_arena_add(L, content, len, &e->off);
			if (rc)
				return rc;
			e->len = (uint32_t)len;
		}
		e->kind = ENTRY_ADDED;
		e->special = at->special;
		t->n_added = (uint32_t)i + 1;
		rc = trie_insert(L, content, len, (uint32_t)i);
		if (rc)
			return rc;
	}
	return 0;
}

/* An added token's text found in the vocab under another id would decode one way and encode
 * another; checked once the vocab hash exists. */
static int check_added_vs_vocab(struct loader *L)
{
	struct tokenizer *t = L->t;
	for (uint32_t i = 0; i < t->n_added; i++) {
		const struct entry *e = &t->entries[t->added[i].id];
		int32_t v = tok_vocab_find(t, t->arena + e->off, e->len);
		if (v >= 0 && (uint32_t)v != t->added[i].id)
			return LERR(L, -EINVAL, "%s: added token '%s' has id %u but the vocab gives it id %d", L->name,
				    t->arena + e->off, t->added[i].id, v);
	}
	return 0;
}

static int read_merges(struct loader *L, const json_t *merges)
{
	struct tokenizer *t = L->t;
	size_t n = json_array_size(merges);
	unsigned bits = 4;
	while ((1ull << bits) < n + n / 3 + 1)
		bits++;
	t->merge_bits = bits;
	t->merges = tok_calloc(1ull << bits, sizeof(*t->merges));
	struct buf joined = {0};
	int rc = 0;
	if (!t->merges)
		return LERR(L, -ENOMEM, "%s: out of memory", L->name);
	uint64_t mask = (1ull << bits) - 1;
	for (size_t i = 0; i < n && !rc; i++) {
		const json_t *m = json_array_get(merges, i);
		const char *a = NULL, *b = NULL;
		size_t an = 0, bn = 0;
		if (json_is_string(m)) {
			/* "a b": exactly one space, as Hugging Face splits it */
			const char *s = json_string_value(m), *sp = strchr(s, ' ');
			if (sp && !strchr(sp + 1, ' ')) {
				a = s;
				an = (size_t)(sp - s);
				b = sp + 1;
				bn = strlen(b);
			}
		} else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
			   json_is_string(json_array_get(m, 1))) {
			a = json_string_value(json_array_get(m, 0));
			an = json_string_length(json_array_get(m, 0));
			b = json_string_value(json_array_get(m, 1));
			bn = json_string_length(json_array_get(m, 1));
		}
		if (!a) {
			char *text = json_dumps(m, JSON_ENCODE_ANY | JSON_COMPACT);
			rc = LERR(L, -EINVAL, "%s: merges entry %zu is not a pair (\"a b\" or [\"a\", \"b\"]): %.80s",
				  L->name, i, text ? text : "?");
			free(text);
			break;
		}
		int32_t left = tok_vocab_find(t, a, an), right = tok_vocab_find(t, b, bn);
		if (left < 0 || right < 0) {
			rc = LERR(L, -EINVAL, "%s: merges entry %zu ('%.*s' '%.*s'): '%.*s' is not in the vocab",
				  L->name, i, (int)an, a, (int)bn, b, left < 0 ? (int)an : (int)bn, left < 0 ? a : b);
			break;
		}
		joined.len = 0;
		if (tok_buf_put(&joined, a, an) || tok_buf_put(&joined, b, bn)) {
			rc = LERR(L, -ENOMEM, "%s: out of memory", L->name);
			break;
		}
		int32_t id = tok_vocab_find(t, joined.p, joined.len);
		if (id < 0) {
			rc = LERR(L, -EINVAL,
				  "%s: merges entry %zu: '%.*s', the merge of '%.*s' and '%.*s', is not in the vocab",
				  L->name, i, (int)joined.len, joined.p, (int)an, a, (int)bn, b);
			break;
		}
		uint64_t key = merge_key((uint32_t)left, (uint32_t)right), k = merge_slot_of(key, bits);
		while (t->merges[k].key && t->merges[k].key != key)
			k = (k + 1) & mask;
		/* A pair listed twice keeps the later rank: Hugging Face builds a map from the list. */
		t->merges[k] = (struct merge_slot){.key = key, .rank = (uint32_t)i, .id = (uint32_t)id};
	}
	tok_buf_free(&joined);
	return rc;
}

/* The post_processor's leading special token: its id, -1 when there is no TemplateProcessing,
 * -2 when there is one that puts nothing first. */
static int32_t template_bos(const struct tokenizer *t, const json_t *pp)
{
	const json_t *type = json_object_get(pp, "type");
	if (!json_is_string(type))
		return -1;
	if (!strcmp(json_string_value(type), "Sequence")) {
		const json_t *list = json_object_get(pp, "processors");
		for (size_t i = 0; i < json_array_size(list); i++) {
			int32_t id = template_bos(t, json_array_get(list, i));
			if (id != -1)
				return id;
		}
		return -1;
	}
	if (strcmp(json_string_value(type), "TemplateProcessing"))
		return -1;
	const json_t *first = json_array_get(json_object_get(pp, "single"), 0);
	const json_t *name = json_object_get(json_object_get(first, "SpecialToken"), "id");
	if (!json_is_string(name))
		return -2;
	const json_t *ids = json_object_get(json_object_get(json_object_get(pp, "special_tokens"),
							    json_string_value(name)),
					    "ids");
	const json_t *id = json_array_get(ids, 0);
	if (json_is_integer(id) && json_integer_value(id) >= 0 && json_integer_value(id) < t->n_ids &&
	    t->entries[json_integer_value(id)].kind != ENTRY_HOLE)
		return (int32_t)json_integer_value(id);
	int32_t v = tokenizer_token_to_id(t, json_string_value(name));
	return v >= 0 ? v : -2;
}

static int32_t first_existing(const struct tokenizer *t, const char *const *names, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		int32_t id = tokenizer_token_to_id(t, names[i]);
		if (id >= 0)
			return id;
	}
	return -1;
}

/* Does the post_processor pp add no token (a byte-level one, or a Sequence of such)? */
static bool adds_nothing(const json_t *pp)
{
	const json_t *type = json_object_get(pp, "type");
	if (!json_is_string(type))
		return false;
	if (!strcmp(json_string_value(type), "ByteLevel"))
		return true;
	if (strcmp(json_string_value(type), "Sequence"))
		return false;
	const json_t *list = json_object_get(pp, "processors");
	if (!json_array_size(list))
		return false;
	for (size_t i = 0; i < json_array_size(list); i++)
		if (!adds_nothing(json_array_get(list, i)))
			return false;
	return true;
}

/* BOS: the post_processor's leading special token, else the first usual name there is. EOS: the
 * first usual name there is (tokenizer.json does not record it). */
void tok_find_bos_eos(struct tokenizer *t, const json_t *root)
{
	const json_t *pp = json_object_get(root, "post_processor");
	int32_t bos = template_bos(t, pp);
	/* Whether an encoding starts with it: a template says; a byte-level post_processor alone (as
	 * GPT-2's and Qwen's files have, or a Sequence of such) puts nothing first; none at all says
	 * nothing. */
	t->adds_bos = bos >= 0 ? 1 : bos == -2 || adds_nothing(pp) ? 0 : -1;
	static const char *const bos_names[] = {"<|begin_of_text|>", "<s>", "<bos>"};
	static const char *const eos_names[] = {"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"};
	t->bos_id = bos >= 0 ? bos : bos == -1 ? first_existing(t, bos_names, ARRAY_SIZE(bos_names)) : -1;
	t->eos_id = first_existing(t, eos_names, ARRAY_SIZE(eos_names));
}

int tok_load_model(struct loader *L, const json_t *root)
{
	struct tokenizer *t = L->t;
	const json_t *model = json_object_get(root, "model");
	const char *type;
	int rc;
	if (!json_is_object(model))
		return LERR(L, -EINVAL, "%s: \"model\" must be an object, got %s", L->name, tok_json_kind(model));
	rc = tok_get_str(L, model, "model", "type", false, &type, NULL);
	if (rc)
		return rc;
	/* Older files leave the type out; Hugging Face then recognises BPE by its merges. */
	if (!type && !json_object_get(model, "merges"))
		return LERR(L, -ENOTSUP, "%s: model has no type and no merges: only BPE is supported", L->name);
	if (type && strcmp(type, "BPE"))
		return LERR(L, -ENOTSUP, "%s: model type %s is not supported (BPE)", L->name, type);
	const json_t *dropout = json_object_get(model, "dropout");
	if (dropout && !json_is_null(dropout) && !(json_is_number(dropout) && json_number_value(dropout) == 0))
		return LERR(L, -ENOTSUP, "%s: model.dropout is not supported (it makes encoding random)", L->name);
	static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
	for (size_t i = 0; i < ARRAY_SIZE(affixes); i++) {
		const char *s;
		size_t n;
		rc = tok_get_str(L, model, "model", affixes[i], false, &s, &n);
		if (rc)
			return rc;
		if (s && n)
			return LERR(L, -ENOTSUP, "%s: model.%s \"%s\" is not supported", L->name, affixes[i], s);
	}
	rc = tok_get_bool(L, model, "model", "byte_fallback", &t->byte_fallback);
	if (!rc)
		rc = tok_get_bool(L, model, "model", "fuse_unk", &t->fuse_unk);
	if (!rc)
		rc = tok_get_bool(L, model, "model", "ignore_merges", &t->ignore_merges);
	if (rc)
		return rc;

	const json_t *vocab = json_object_get(model, "vocab"), *merges = json_object_get(model, "merges");
	const json_t *added = json_object_get(root, "added_tokens");
	if (!json_is_object(vocab))
		return LERR(L, -EINVAL, "%s: model.vocab must be an object (piece -> id), got %s", L->name,
			    tok_json_kind(vocab));
	if (!json_object_size(vocab))
		return LERR(L, -EINVAL, "%s: model.vocab is empty", L->name);
	if (!json_is_array(merges))
		return LERR(L, -EINVAL, "%s: model.merges must be a list, got %s", L->name, tok_json_kind(merges));
	if (added && !json_is_null(added) && !json_is_array(added))
		return LERR(L, -EINVAL, "%s: added_tokens must be a list, got %s", L->name, tok_json_kind(added));

	/* The id range first, so that entries is one array indexed by id. */
	uint32_t max_id = 0;
	const char *key;
	json_t *v;
	json_object_foreach((json_t *)vocab, key, v) {
		uint32_t id;
		rc = get_id(L, v, "vocab entry", key, &id);
		if (rc)
			return rc;
		max_id = id > max_id ? id : max_id;
	}
	for (size_t i = 0; i < json_array_size(added); i++) {
		const json_t *a = json_array_get(added, i);
		const json_t *id = json_object_get(a, "id");
		if (json_is_integer(id) && json_integer_value(id) >= 0 && json_integer_value(id) <= TOK_MAX_ID &&
		    (uint32_t)json_integer_value(id) > max_id)
			max_id = (uint32_t)json_integer_value(id);
	}
	/* Ids are dense in real files; a few huge ids in a small file would only cost memory. */
	size_t n_pieces = json_object_size(vocab) + json_array_size(added);
	if (max_id >= 2 * n_pieces + 65536)
		return LERR(L, -EINVAL, "%s: ids go up to %u but there are only %zu pieces", L->name, max_id,
			    n_pieces);
	t->n_ids = max_id + 1;
	t->entries = tok_calloc(t->n_ids, sizeof(*t->entries));
	if (!t->entries)
		return LERR(L, -ENOMEM, "%s: out of memory for %u ids", L->name, t->n_ids);
	rc = read_vocab(L, vocab);
	if (!rc)
		rc = read_added(L, added);
	if (rc)
		return rc;
	/* The arena is complete for pieces: lookups may use it from here on. */
	t->arena = L->arena.p;
	rc = build_vocab_hash(L, (uint32_t)json_object_size(vocab));
	if (!rc)
		rc = check_added_vs_vocab(L);
	if (!rc)
		rc = read_merges(L, merges);
	if (rc)
		return rc;

	const char *unk;
	rc = tok_get_str(L, model, "model", "unk_token", false, &unk, NULL);
	if (rc)
		return rc;
	t->unk_id = -1;
	if (unk) {
		t->unk_id = tok_vocab_find(t, unk, strlen(unk));
		if (t->unk_id < 0)
			return LERR(L, -EINVAL, "%s: model.unk_token '%s' is not in the vocab", L->name, unk);
	}
	for (unsigned b = 0; b < 256; b++) {
		char name[8];
		snprintf(name, sizeof(name), "<0x%02X>", b);
		t->fallback_id[b] = tok_vocab_find(t, name, 6);
	}
	return 0;
}

/* ---- queries ---- */

uint32_t tokenizer_vocab_size(const struct tokenizer *t)
{
	return t->n_ids;
}

int32_t tokenizer_bos(const struct tokenizer *t)
{
	return t->bos_id;
}

int tokenizer_adds_bos(const struct tokenizer *t)
{
	return t->adds_bos;
}

int32_t tokenizer_eos(const struct tokenizer *t)
{
	return t->eos_id;
}

int32_t tokenizer_token_to_id(const struct tokenizer *t, const char *piece)
{
	size_t n = strlen(piece);
	int32_t a = added_find(t, piece, n);
	return a >= 0 ? (int32_t)t->added[a].id : tok_vocab_find(t, piece, n);
}

const char *tokenizer_id_to_piece(const struct tokenizer *t, uint32_t id, size_t *len)
{
	if (id >= t->n_ids || t->entries[id].kind == ENTRY_HOLE)
		return NULL;
	if (len)
		*len = t->entries[id].len;
	return entry_piece(t, id);
}

bool tokenizer_is_special(const struct tokenizer *t, uint32_t id)
{
	return id < t->n_ids && t->entries[id].special;
}

/* bpe.c - the BPE model over one pre-token: the whole piece where ignore_merges says so, else
 * symbols (characters, byte-level bytes, fallback bytes, unk) merged pair by pair, lowest rank
 * first and leftmost among equals, with a binary heap of candidate pairs. */
#include "common/tokenizer/tokenizer_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define SYM_DEAD (-2) /* sym.prev of a symbol merged into its left neighbour */

struct sym {
	uint32_t id;
	int32_t prev, next; /* neighbours, -1 at the ends; prev SYM_DEAD once merged away */
};

struct cand {
	uint32_t rank; /* of the merge of sym[pos] with its right neighbour */
	uint32_t pos;
};

static bool cand_less(struct cand a, struct cand b)
{
	return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos);
}

static int heap_push(struct enc *e, uint32_t rank, uint32_t pos)
{
	if (e->heap_n == e->heap_cap) {
		size_t cap = e->heap_cap ? e->heap_cap * 2 : 64;
		struct cand *p = tok_realloc(e->heap, cap * sizeof(*p));
		if (!p)
			return -ENOMEM;
		e->heap = p;
		e->heap_cap = cap;
	}
	struct cand c = {rank, pos};
	size_t i = e->heap_n++;
	while (i > 0) {
		size_t parent = (i - 1) / 2;
		if (!cand_less(c, e->heap[parent]))
			break;
		e->heap[i] = e->heap[parent];
		i = parent;
	}
	e->heap[i] = c;
	return 0;
}

static struct cand heap_pop(struct enc *e)
{
	struct cand top = e->heap[0], last = e->heap[--e->heap_n];
	size_t i = 0, n = e->heap_n;
	for (;;) {
		size_t c = 2 * i + 1;
		if (c >= n)
			break;
		if (c + 1 < n && cand_less(e->heap[c + 1], e->heap[c]))
			c++;
		if (!cand_less(e->heap[c], last))
			break;
		e->heap[i] = e->heap[c];
		i = c;
	}
	if (n)
		e->heap[i] = last;
	return top;
}

/* Pushes the merge of sym[pos] with its right neighbour, if there is one. */
static int push_pair(struct enc *e, int32_t pos)
{
	if (pos < 0 || e->sym[pos].next < 0)
		return 0;
	const struct merge_slot *m = tok_merge_find(e->t, e->sym[pos].id, e->sym[e->sym[pos].next].id);
	return m ? heap_push(e, m->rank, (uint32_t)pos) : 0;
}

/* Runs BPE over one pre-token and appends its ids. */
int tok_bpe_word(struct enc *e, const uint8_t *s, size_t len)
{
	const struct tokenizer *t = e->t;
	int rc;
	if (t->ignore_merges) {
		const char *w = (const char *)s;
		size_t wl = len;
		if (t->byte_level) {
			e->mapped.len = 0;
			rc = tok_buf_reserve(&e->mapped, 2 * len);
			if (rc)
				return rc;
			for (size_t i = 0; i < len; i++) {
				memcpy(e->mapped.p + e->mapped.len, t->bl_utf8[s[i]], t->bl_len[s[i]]);
				e->mapped.len += t->bl_len[s[i]];
			}
			w = e->mapped.p;
			wl = e->mapped.len;
		}
		int32_t id = tok_vocab_find(t, w, wl);
		if (id >= 0)
			return tok_ids_push(e->out, (uint32_t)id);
	}

	/* At most one symbol per byte: a byte-level byte, a character, a fallback byte, an unk;
	 * but in a byte-level file with byte fallback a byte whose mapped character is not in the
	 * vocab falls back to the bytes of that character, up to 2 (bl_len). */
	if (len > INT32_MAX)
		return -ENOMEM;
	size_t max_syms = t->byte_level && t->byte_fallback ? 2 * len : len;
	if (max_syms > INT32_MAX || max_syms > SIZE_MAX / sizeof(struct sym))
		return -ENOMEM;
	if (e->sym_cap < max_syms) {
		struct sym *p = tok_realloc(e->sym, max_syms * sizeof(*p));
		if (!p)
			return -ENOMEM;
		e->sym = p;
		e->sym_cap = max_syms;
	}
	size_t n = 0;
	bool prev_unk = false;
	for (size_t i = 0; i < len;) {
		const uint8_t *u;
		size_t ul;
		int32_t id;
		if (t->byte_level) {
			u = t->bl_utf8[s[i]];
			ul = t->bl_len[s[i]];
			id = t->byte_id[s[i]];
			i++;
		} else {
			u = s + i;
			if (utf8_unit(u, len - i, &ul) != U8_VALID)
				ul = 1; /* an invalid byte: a unit of its own, found in no vocab */
			id = tok_vocab_find(t, (const char *)u, ul);
			i += ul;
		}
		if (id >= 0) {
			e->sym[n++].id = (uint32_t)id;
			prev_unk = false;
			continue;
		}
		if (t->byte_fallback) {
			bool all = true;
			for (size_t k = 0; k < ul; k++)
				all = all && t->fallback_id[u[k]] >= 0;
			if (all) {
				for (size_t k = 0; k < ul; k++)
					e->sym[n++].id = (uint32_t)t->fallback_id[u[k]];
				prev_unk = false;
				continue;
			}
		}
		if (t->unk_id < 0)
			return -EILSEQ;
		if (t->fuse_unk && prev_unk)
			continue;
		e->sym[n++].id = (uint32_t)t->unk_id;
		prev_unk = true;
	}
	for (size_t k = 0; k < n; k++) {
		e->sym[k].prev = (int32_t)k - 1;
		e->sym[k].next = k + 1 < n ? (int32_t)k + 1 : -1;
	}

	/* Lowest rank first, leftmost among equals. An entry is stale when its pair changed since
	 * it was pushed; the current pair of its position is then checked against the rank. */
	e->heap_n = 0;
	for (size_t k = 0; k + 1 < n; k++) {
		rc = push_pair(e, (int32_t)k);
		if (rc)
			return rc;
	}
	while (e->heap_n) {
		struct cand c = heap_pop(e);
		struct sym *a = &e->sym[c.pos];
		if (a->prev == SYM_DEAD || a->next < 0)
			continue;
		int32_t bpos = a->next;
		const struct merge_slot *m = tok_merge_find(t, a->id, e->sym[bpos].id);
		if (!m || m->rank != c.rank)
			continue;
		a->id = m->id;
		a->next = e->sym[bpos].next;
		if (a->next >= 0)
			e->sym[a->next].prev = (int32_t)c.pos;
		e->sym[bpos].prev = SYM_DEAD;
		rc = push_pair(e, a->prev);
		if (!rc)
			rc = push_pair(e, (int32_t)c.pos);
		if (rc)
			return rc;
	}
	/* The first symbol is never merged away: merges keep the left one. */
	for (int32_t k = n ? 0 : -1; k >= 0; k = e->sym[k].next) {
		rc = tok_ids_push(e->out, e->sym[k].id);
		if (rc)
			return rc;
	}
	return 0;
}

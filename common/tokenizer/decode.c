/* decode.c - the decoder: its steps (ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace)
 * parsed from the file and applied to every piece at load, and the streaming decoder that holds
 * back an incomplete UTF-8 sequence until the next piece completes it. */
#include "common/tokenizer/tokenizer_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the decoder's steps ---- */

static int sequence_item(struct loader *L, const json_t *d, const char *where, void *fused)
{
	return tok_parse_decoder(L, d, where, fused);
}

int tok_parse_decoder(struct loader *L, const json_t *d, const char *where, bool *fused)
{
	struct tokenizer *t = L->t;
	const char *type;
	if (!d || json_is_null(d))
		return 0;
	int rc = tok_get_type(L, d, where, &type);
	if (rc)
		return rc;
	if (!strcmp(type, "Sequence"))
		return tok_parse_sequence(L, d, where, "decoders", sequence_item, fused);
	if (!strcmp(type, "Fuse")) {
		/* Concatenation, which the stream does anyway; it matters for what follows (below). */
		*fused = true;
		return 0;
	}
	static const char *const known[] = {"ByteLevel", "Replace", "ByteFallback", "Strip", "Metaspace"};
	enum dec_kind kind = 0;
	for (size_t i = 0; i < ARRAY_SIZE(known); i++)
		if (!strcmp(type, known[i]))
			kind = (enum dec_kind)(i + 1);
	if (!kind)
		return LERR(L, -ENOTSUP,
			    "%s: decoder type %s is not supported (ByteLevel, Metaspace, or a Sequence of Replace, "
			    "ByteFallback, Fuse, Strip)",
			    L->name, type);
	if (t->n_dec == MAX_STEPS)
		return LERR(L, -ENOTSUP, "%s: the decoder has more than %d steps", L->name, MAX_STEPS);
	struct dec_step *s = &t->dec[t->n_dec];
	memset(s, 0, sizeof(*s));
	s->kind = kind;
	switch (kind) {
	case DEC_BYTELEVEL:
	case DEC_BYTEFALLBACK:
		if (*fused)
			return LERR(L, -ENOTSUP, "%s: %s %s after Fuse is not supported", L->name, where, type);
		break;
	case DEC_REPLACE: {
		const char *from, *to;
		size_t from_len, to_len, ul;
		rc = tok_get_replace(L, d, where, &from, &from_len, &to, &to_len);
		if (rc)
			return rc;
		/* After Fuse the replacement sees the whole text; per token is the same only when the
		 * pattern is one character (it cannot then straddle two tokens). */
		if (*fused && !(utf8_unit((const uint8_t *)from, from_len, &ul) == U8_VALID && ul == from_len))
			return LERR(L, -ENOTSUP, "%s: %s Replace of \"%s\" after Fuse is not supported", L->name,
				    where, from);
		s->from = tok_dup_bytes(from, from_len);
		s->to = tok_dup_bytes(to, to_len);
		s->from_len = from_len;
		s->to_len = to_len;
		if (!s->from || !s->to) {
			free(s->from);
			free(s->to);
			return LERR(L, -ENOMEM, "%s: out of memory", L->name);
		}
		break;
	}
	case DEC_STRIP: {
		json_int_t start = 0, stop = 0;
		const json_t *a = json_object_get(d, "start"), *b = json_object_get(d, "stop");
		if ((a && !json_is_integer(a)) || (b && !json_is_integer(b)))
			return LERR(L, -EINVAL, "%s: %s.start and .stop must be integers", L->name, where);
		start = a ? json_integer_value(a) : 0;
		stop = b ? json_integer_value(b) : 0;
		if (start < 0 || stop < 0 || start > 1024 || stop > 1024)
			return LERR(L, -EINVAL, "%s: %s.start and .stop must be in [0, 1024]", L->name, where);
		rc = tok_get_char(L, d, where, "content", " ", s->strip, &s->strip_len);
		if (rc)
			return rc;
		s->start = (unsigned)start;
		s->stop = (unsigned)stop;
		if (*fused) {
			/* On the whole text: the start of a stream can be stripped as it goes; its end
			 * cannot without holding everything back. */
			if (stop)
				return LERR(L, -ENOTSUP, "%s: %s Strip with stop %lld after Fuse is not supported",
					    L->name, where, (long long)stop);
			if (t->strip_start)
				return LERR(L, -ENOTSUP, "%s: %s: a second Strip after Fuse is not supported", L->name,
					    where);
			t->strip_start = s->start;
			memcpy(t->strip_char, s->strip, s->strip_len);
			t->strip_len = s->strip_len;
			return 0;
		}
		break;
	}
	case DEC_METASPACE:
		if (*fused)
			return LERR(L, -ENOTSUP, "%s: %s Metaspace after Fuse is not supported", L->name, where);
		s->from = tok_malloc(8);
		if (!s->from)
			return LERR(L, -ENOMEM, "%s: out of memory", L->name);
		rc = tok_get_char(L, d, where, "replacement", "\xe2\x96\x81", s->from, &s->from_len);
		if (!rc)
			rc = tok_get_prepend(L, d, where, &s->prepend);
		if (rc) {
			free(s->from);
			return rc;
		}
		if (s->prepend != PREPEND_NEVER)
			t->dec_first = true;
		break;
	}
	t->n_dec++;
	return 0;
}

static int hex_digit(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* The bytes the vocab piece p[0..n) stands for, through the per-token decoder steps; first:
 * it is the first token of the text (Metaspace drops its replacement characters instead of
 * making them spaces). The result lands in a or b: *out points at it. */
static int decode_piece(const struct tokenizer *t, const char *p, size_t n, bool first, struct buf *a, struct buf *b,
			const char **out, size_t *out_len)
{
	const char *cur = p;
	size_t len = n;
	struct buf *dst = a;
	int rc = 0;
	for (unsigned k = 0; k < t->n_dec && !rc; k++) {
		const struct dec_step *s = &t->dec[k];
		dst->len = 0;
		switch (s->kind) {
		case DEC_BYTELEVEL: {
			/* Every character must be one of the mapping's; else the piece stays as written. */
			size_t i = 0, ul;
			rc = tok_buf_reserve(dst, len);
			while (!rc && i < len) {
				int32_t cp = tok_utf8_cp((const uint8_t *)cur + i, len - i, &ul);
				if (cp < 0 || cp >= BL_CODEPOINTS || t->bl_byte[cp] < 0)
					break;
				dst->p[dst->len++] = (char)t->bl_byte[cp];
				i += ul;
			}
			if (!rc && i < len) {
				dst->len = 0;
				rc = tok_buf_put(dst, cur, len);
			}
			break;
		}
		case DEC_REPLACE:
			rc = tok_replace_all_append(cur, len, s->from, s->from_len, s->to, s->to_len, dst);
			break;
		case DEC_BYTEFALLBACK:
			if (len == 6 && tok_has_prefix(cur, len, "<0x", 3) && cur[5] == '>' && hex_digit(cur[3]) >= 0 &&
			    hex_digit(cur[4]) >= 0) {
				char byte = (char)(hex_digit(cur[3]) * 16 + hex_digit(cur[4]));
				rc = tok_buf_put(dst, &byte, 1);
			} else {
				rc = tok_buf_put(dst, cur, len);
			}
			break;
		case DEC_STRIP: {
			size_t from = 0, to = len;
			for (unsigned i = 0;
			     i < s->start && tok_has_prefix(cur + from, to - from, s->strip, s->strip_len); i++)
				from += s->strip_len;
			for (unsigned i = 0; i < s->stop && to - from >= s->strip_len &&
					     !memcmp(cur + to - s->strip_len, s->strip, s->strip_len);
			     i++)
				to -= s->strip_len;
			rc = tok_buf_put(dst, cur + from, to - from);
			break;
		}
		case DEC_METASPACE: {
			bool drop = first && s->prepend != PREPEND_NEVER;
			rc = tok_replace_all_append(cur, len, s->from, s->from_len, " ", drop ? 0 : 1, dst);
			break;
		}
		}
		cur = dst->p ? dst->p : "";
		len = dst->len;
		dst = dst == a ? b : a;
	}
	*out = cur;
	*out_len = len;
	return rc;
}

/* ---- at load: every piece decoded once ---- */

/* Each entry's decoded bytes, appended to the arena (or shared with the piece when equal). */
int tok_precompute_decoded(struct loader *L)
{
	struct tokenizer *t = L->t;
	struct buf a = {0}, b = {0}, tmp = {0};
	int rc = 0;
	/* The decoded pieces grow a few bytes over the pieces at most in real files (a byte-level
	 * character of two bytes decodes to one, a "\u2581" of three to a space); a decoder that
	 * makes them many times longer is refused before it takes the memory. */
	uint64_t pieces = 0, decoded = 0;
	for (uint32_t id = 0; id < t->n_ids; id++)
		pieces += t->entries[id].kind == ENTRY_VOCAB ? t->entries[id].len : 0;
	const uint64_t decoded_max = 4 * pieces + (1u << 20);
	for (uint32_t id = 0; id < t->n_ids && !rc; id++) {
		struct entry *e = &t->entries[id];
		e->dec_off = e->off;
		e->dec_len = e->len;
		if (e->kind != ENTRY_VOCAB)
			continue; /* added tokens decode to their text as written; holes to nothing */
		const char *out;
		size_t n;
		if (decode_piece(t, L->arena.p + e->off, e->len, false, &a, &b, &out, &n)) {
			rc = LERR(L, -ENOMEM, "%s: out of memory", L->name);
			break;
		}
		if (n == e->len && !memcmp(out, L->arena.p + e->off, n))
			continue;
		decoded += n;
		if (decoded > decoded_max) {
			rc = LERR(L, -EFBIG,
				  "%s: the decoder makes the pieces over four times as long as they are (%llu bytes "
				  "decoded by piece %u, from %llu bytes of pieces in all)",
				  L->name, (unsigned long long)decoded, id, (unsigned long long)pieces);
			break;
		}
		/* out may point into the arena (no decoder steps); copy before the arena grows. */
		tmp.len = 0;
		if (tok_buf_put(&tmp, out, n)) {
			rc = LERR(L, -ENOMEM, "%s: out of memory", L->name);
			break;
		}
		rc = tok_arena_add(L, tmp.p ? tmp.p : "", n, &e->dec_off);
		e->dec_len = (uint32_t)n;
		t->arena = L->arena.p;
	}
	tok_buf_free(&a);
	tok_buf_free(&b);
	tok_buf_free(&tmp);
	return rc;
}

/* ---- decoding ---- */

struct tok_decoder {
	const struct tokenizer *t;
	unsigned flags;
	uint8_t held[4]; /* an incomplete UTF-8 sequence from the end of the last piece */
	size_t n_held;
	unsigned strip_left; /* leading strip characters still to drop (Strip after Fuse) */
	uint64_t n_fed;	     /* tokens decoded in this sequence (skipped ones do not count) */
	struct buf out, work, first_a, first_b;
};

static void decoder_init(struct tok_decoder *d, const struct tokenizer *t, unsigned flags)
{
	memset(d, 0, sizeof(*d));
	d->t = t;
	d->flags = flags;
	d->strip_left = t->strip_start;
}

static void decoder_free(struct tok_decoder *d)
{
	tok_buf_free(&d->out);
	tok_buf_free(&d->work);
	tok_buf_free(&d->first_a);
	tok_buf_free(&d->first_b);
}

/* Appends held + p[0..n) to d->out as UTF-8: complete sequences as they are, invalid ones as
 * U+FFFD (or raw), an incomplete tail held back unless final. */
static int emit_utf8(struct tok_decoder *d, const char *p, size_t n, bool final)
{
	struct buf *w = &d->work;
	w->len = 0;
	int rc = tok_buf_put(w, d->held, d->n_held);
	if (!rc)
		rc = tok_buf_put(w, p, n);
	if (!rc)
		rc = tok_buf_reserve(&d->out, 3 * w->len);
	if (rc)
		return rc;
	d->n_held = 0;
	const uint8_t *s = (const uint8_t *)w->p;
	for (size_t i = 0, ul; i < w->len; i += ul) {
		int r = utf8_unit(s + i, w->len - i, &ul);
		if (r == U8_INCOMPLETE && !final) {
			memcpy(d->held, s + i, ul);
			d->n_held = ul;
			break;
		}
		if (r == U8_VALID || (d->flags & TOK_DECODE_RAW)) {
			memcpy(d->out.p + d->out.len, s + i, ul);
			d->out.len += ul;
		} else {
			memcpy(d->out.p + d->out.len, "\xef\xbf\xbd", 3);
			d->out.len += 3;
		}
	}
	return 0;
}

static int decoder_feed(struct tok_decoder *d, uint32_t id)
{
	const struct tokenizer *t = d->t;
	if (id >= t->n_ids || t->entries[id].kind == ENTRY_HOLE)
		return -EINVAL;
	const struct entry *en = &t->entries[id];
	if ((d->flags & TOK_SKIP_SPECIAL) && en->special)
		return 0;
	const char *p = t->arena + en->dec_off;
	size_t n = en->dec_len;
	if (t->dec_first && d->n_fed == 0 && en->kind == ENTRY_VOCAB) {
		int rc = decode_piece(t, t->arena + en->off, en->len, true, &d->first_a, &d->first_b, &p, &n);
		if (rc)
			return rc;
	}
	d->n_fed++;
	while (d->strip_left && tok_has_prefix(p, n, t->strip_char, t->strip_len)) {
		p += t->strip_len;
		n -= t->strip_len;
		d->strip_left--;
	}
	if (n)
		d->strip_left = 0;
	return emit_utf8(d, p, n, false);
}

static int decoder_flush(struct tok_decoder *d)
{
	int rc = emit_utf8(d, NULL, 0, true);
	d->n_held = 0;
	d->n_fed = 0;
	d->strip_left = d->t->strip_start;
	return rc;
}

struct tok_decoder *tok_decoder_create(const struct tokenizer *t, unsigned flags)
{
	assert(t);
	struct tok_decoder *d = tok_malloc(sizeof(*d));
	if (d)
		decoder_init(d, t, flags);
	return d;
}

int tok_decoder_feed(struct tok_decoder *d, uint32_t id, const char **bytes, size_t *len)
{
	assert(d && bytes && len);
	d->out.len = 0;
	int rc = decoder_feed(d, id);
	*bytes = d->out.p ? d->out.p : "";
	*len = rc ? 0 : d->out.len;
	return rc;
}

int tok_decoder_flush(struct tok_decoder *d, const char **bytes, size_t *len)
{
	assert(d && bytes && len);
	d->out.len = 0;
	int rc = decoder_flush(d);
	*bytes = d->out.p ? d->out.p : "";
	*len = rc ? 0 : d->out.len;
	return rc;
}

void tok_decoder_destroy(struct tok_decoder **dp)
{
	if (!dp || !*dp)
		return;
	decoder_free(*dp);
	free(*dp);
	*dp = NULL;
}

int tokenizer_decode(const struct tokenizer *t, const uint32_t *ids, size_t n, unsigned flags, char **out,
		     size_t *len)
{
	assert(t && out && (ids || !n));
	struct tok_decoder d;
	int rc = 0;
	decoder_init(&d, t, flags);
	*out = NULL;
	/* The decoder appends to d.out across calls here: one buffer for the whole text. */
	for (size_t i = 0; i < n && !rc; i++)
		rc = decoder_feed(&d, ids[i]);
	if (!rc)
		rc = decoder_flush(&d);
	if (!rc)
		rc = tok_buf_put(&d.out, "", 1);
	if (!rc) {
		*out = d.out.p;
		if (len)
			*len = d.out.len - 1;
		d.out.p = NULL;
	}
	decoder_free(&d);
	return rc;
}

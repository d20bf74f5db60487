/* utf8.c - the byte buffer every part appends to, and UTF-8: code points forward and backward
 * (units: common/utf8.h), encoding one, White_Space. */
#include "common/tokenizer/tokenizer_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* ---- buffers ---- */

int tok_buf_reserve(struct buf *b, size_t extra)
{
	if (b->len + extra <= b->cap)
		return 0;
	size_t cap = b->cap ? b->cap : 64;
	while (cap < b->len + extra) {
		if (cap > SIZE_MAX / 2)
			return -ENOMEM;
		cap *= 2;
	}
	char *p = tok_realloc(b->p, cap);
	if (!p)
		return -ENOMEM;
	b->p = p;
	b->cap = cap;
	return 0;
}

int tok_buf_put(struct buf *b, const void *p, size_t n)
{
	if (!n)
		return 0;
	int rc = tok_buf_reserve(b, n);
	if (rc)
		return rc;
	memcpy(b->p + b->len, p, n);
	b->len += n;
	return 0;
}

void tok_buf_free(struct buf *b)
{
	free(b->p);
	memset(b, 0, sizeof(*b));
}

bool tok_has_prefix(const char *s, size_t n, const char *p, size_t pn)
{
	return n >= pn && memcmp(s, p, pn) == 0;
}

/* Appends s[0..n) to out with each from replaced by to. */
int tok_replace_all_append(const char *s, size_t n, const char *from, size_t from_len, const char *to,
			   size_t to_len, struct buf *out)
{
	size_t i = 0, last = 0;
	int rc = 0;
	while (i + from_len <= n) {
		if (memcmp(s + i, from, from_len) == 0) {
			rc = tok_buf_put(out, s + last, i - last);
			if (!rc)
				rc = tok_buf_put(out, to, to_len);
			if (rc)
				return rc;
			i += from_len;
			last = i;
		} else {
			i++;
		}
	}
	return tok_buf_put(out, s + last, n - last);
}

/* ---- UTF-8 ---- */

/* The code point at s, or -1 for a byte that does not start a well-formed sequence; *len is
 * the unit's length (1 for an invalid byte). */
int32_t tok_utf8_cp(const uint8_t *s, size_t n, size_t *len)
{
	if (utf8_unit(s, n, len) != U8_VALID) {
		*len = 1;
		return -1;
	}
	switch (*len) {
	case 1:
		return s[0];
	case 2:
		return (int32_t)(((s[0] & 0x1Fu) << 6) | (s[1] & 0x3Fu));
	case 3:
		return (int32_t)(((s[0] & 0x0Fu) << 12) | ((s[1] & 0x3Fu) << 6) | (s[2] & 0x3Fu));
	default:
		return (int32_t)(((s[0] & 0x07u) << 18) | ((s[1] & 0x3Fu) << 12) | ((s[2] & 0x3Fu) << 6) |
				 (s[3] & 0x3Fu));
	}
}

/* The code point that ends at s + pos (pos > 0), with *len its length; -1 for an invalid byte. */
int32_t tok_utf8_cp_before(const uint8_t *s, size_t pos, size_t *len)
{
	size_t start = pos - 1;
	while (start > 0 && pos - start < 4 && (s[start] & 0xC0) == 0x80)
		start--;
	size_t ul;
	int32_t cp = tok_utf8_cp(s + start, pos - start, &ul);
	if (cp >= 0 && start + ul == pos) {
		*len = ul;
		return cp;
	}
	*len = 1;
	return -1;
}

size_t tok_utf8_put(uint32_t cp, uint8_t *out)
{
	if (cp < 0x80) {
		out[0] = (uint8_t)cp;
		return 1;
	}
	if (cp < 0x800) {
		out[0] = (uint8_t)(0xC0 | (cp >> 6));
		out[1] = (uint8_t)(0x80 | (cp & 0x3F));
		return 2;
	}
	if (cp < 0x10000) {
		out[0] = (uint8_t)(0xE0 | (cp >> 12));
		out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
		out[2] = (uint8_t)(0x80 | (cp & 0x3F));
		return 3;
	}
	out[0] = (uint8_t)(0xF0 | (cp >> 18));
	out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
	out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
	out[3] = (uint8_t)(0x80 | (cp & 0x3F));
	return 4;
}

/* Unicode White_Space, what Rust's char::is_whitespace (and so lstrip/rstrip) uses. */
bool tok_is_white(int32_t cp)
{
	return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
	       (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
	       cp == 0x3000;
}

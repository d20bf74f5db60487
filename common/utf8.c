/* utf8.c - classifying a UTF-8 unit (Unicode's maximal subparts), for the tokenizer and for any
 * service that checks or repairs text it is given (utf8.h). */
#include "common/utf8.h"

/* Classifies the UTF-8 unit at s (n > 0 bytes available): U8_VALID with *len its length;
 * U8_INCOMPLETE when all n bytes are a proper prefix of a well-formed sequence (*len = n);
 * U8_INVALID with *len the length of the maximal subpart (Unicode table 3-7 ranges). */
int utf8_unit(const uint8_t *s, size_t n, size_t *len)
{
	uint8_t c = s[0], lo = 0x80, hi = 0xBF;
	size_t need;
	if (c < 0x80) {
		*len = 1;
		return U8_VALID;
	}
	if (c >= 0xC2 && c <= 0xDF)
		need = 1;
	else if (c == 0xE0)
		need = 2, lo = 0xA0;
	else if (c == 0xED)
		need = 2, hi = 0x9F;
	else if (c >= 0xE1 && c <= 0xEF)
		need = 2;
	else if (c == 0xF0)
		need = 3, lo = 0x90;
	else if (c == 0xF4)
		need = 3, hi = 0x8F;
	else if (c >= 0xF1 && c <= 0xF3)
		need = 3;
	else {
		*len = 1;
		return U8_INVALID;
	}
	for (size_t k = 1; k <= need; k++) {
		if (k >= n) {
			*len = n;
			return U8_INCOMPLETE;
		}
		uint8_t b = s[k];
		if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) {
			*len = k;
			return U8_INVALID;
		}
	}
	*len = need + 1;
	return U8_VALID;
}

bool utf8_valid(const char *p, size_t n)
{
	const uint8_t *s = (const uint8_t *)p;
	for (size_t i = 0, len; i < n; i += len)
		if (utf8_unit(s + i, n - i, &len) != U8_VALID)
			return false;
	return true;
}

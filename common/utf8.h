/* utf8.h - UTF-8 as Unicode defines it (table 3-7: shortest forms, no surrogates, nothing past
 * U+10FFFF), one unit at a time. */
#ifndef PIPELINE_UTF8_H
#define PIPELINE_UTF8_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum { U8_VALID, U8_INCOMPLETE, U8_INVALID };

/* Classifies the UTF-8 unit at s (n > 0 bytes available): U8_VALID with *len its length;
 * U8_INCOMPLETE when all n bytes are a proper prefix of a well-formed sequence (*len = n);
 * U8_INVALID with *len the length of the maximal subpart (Unicode table 3-7 ranges). */
int utf8_unit(const uint8_t *s, size_t n, size_t *len);

/* Whether p[0..n) is UTF-8 throughout (what a JSON string may carry). */
bool utf8_valid(const char *p, size_t n);

#endif

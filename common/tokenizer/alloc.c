/* alloc.c - the allocator every part of the tokenizer calls: the C library's. A file of its own
 * with weak definitions, so that a test program defining tok_malloc, tok_calloc and tok_realloc
 * takes their place (tests/unit/tokenizer/test_tokenizer_alloc.c fails the N-th call). */
#include "common/tokenizer/tokenizer_internal.h"

#include <stdlib.h>

__attribute__((weak)) void *tok_malloc(size_t n)
{
	return malloc(n);
}

__attribute__((weak)) void *tok_calloc(size_t n, size_t size)
{
	return calloc(n, size);
}

__attribute__((weak)) void *tok_realloc(void *p, size_t n)
{
	return realloc(p, n);
}

#include "services/kv-store/keymap.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_pool.h"

struct keymap {
	uint64_t mask;	 /* capacity - 1; capacity a power of two, at least twice max */
	uint32_t max, count;
	uint64_t *keys;	 /* (capacity) 0: empty */
	uint32_t *vals;	 /* (capacity) */
};

/* Keys are hashes already, but a runner may use small counters: mix them anyway. */
static uint64_t mix(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebull;
	x ^= x >> 31;
	return x;
}

struct keymap *keymap_create(uint32_t max_entries)
{
	assert(max_entries > 0 && max_entries <= (1u << 31));
	struct keymap *m = calloc(1, sizeof(*m));
	if (!m)
		return NULL;
	uint64_t cap = 16;
	while (cap < 2ull * max_entries)
		cap <<= 1;
	m->mask = cap - 1;
	m->max = max_entries;
	m->keys = calloc(cap, sizeof(uint64_t));
	m->vals = malloc(cap * sizeof(uint32_t));
	if (!m->keys || !m->vals) {
		keymap_destroy(&m);
		return NULL;
	}
	return m;
}

void keymap_destroy(struct keymap **mp)
{
	if (!mp || !*mp)
		return;
	free((*mp)->keys);
	free((*mp)->vals);
	free(*mp);
	*mp = NULL;
}

/* The position holding key, or the empty one where it would go. */
static uint64_t find(const struct keymap *m, uint64_t key)
{
	uint64_t i = mix(key) & m->mask;
	while (m->keys[i] && m->keys[i] != key)
		i = (i + 1) & m->mask;
	return i;
}

uint32_t keymap_get(const struct keymap *m, uint64_t key)
{
	if (key == 0)
		return KV_NONE;
	uint64_t i = find(m, key);
	return m->keys[i] ? m->vals[i] : KV_NONE;
}

void keymap_put(struct keymap *m, uint64_t key, uint32_t val)
{
	assert(key != 0 && val != KV_NONE);
	uint64_t i = find(m, key);
	if (!m->keys[i]) {
		assert(m->count < m->max);
		m->keys[i] = key;
		m->count++;
	}
	m->vals[i] = val;
}

void keymap_del(struct keymap *m, uint64_t key)
{
	if (key == 0)
		return;
	uint64_t i = find(m, key);
	if (!m->keys[i])
		return;
	/* Backward shift: move later members of the probe run into the hole when the hole lies
	 * between their home position and where they sit (cyclically). */
	uint64_t j = i;
	for (;;) {
		j = (j + 1) & m->mask;
		if (!m->keys[j])
			break;
		uint64_t home = mix(m->keys[j]) & m->mask;
		if (((j - home) & m->mask) >= ((j - i) & m->mask)) {
			m->keys[i] = m->keys[j];
			m->vals[i] = m->vals[j];
			i = j;
		}
	}
	m->keys[i] = 0;
	m->count--;
}

void keymap_clear(struct keymap *m)
{
	memset(m->keys, 0, (m->mask + 1) * sizeof(uint64_t));
	m->count = 0;
}

uint32_t keymap_count(const struct keymap *m)
{
	return m->count;
}

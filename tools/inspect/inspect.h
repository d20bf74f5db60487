/* inspect.h - pipeline-inspect: a read-only live view of one instance.
 *
 * What it reads, and nothing else:
 *  - the PUB sockets of the supervisor and the three services (<run-dir>/<service>.pub):
 *    MSG_HEARTBEAT and MSG_STATS, which they publish every second whoever listens. It opens
 *    no control socket and sends no message at all (a HELLO from a client named gpu-runner
 *    would make ssd-loader and kv-store drop what the runner holds);
 *  - the shared-memory objects /llmp-<uid>-<instance>-weights (the weight ring) and
 *    /llmp-<uid>-<instance>-kv (the KV pool), opened O_RDONLY and mapped PROT_READ: their
 *    headers and slot tables, never the data. Everything read there is checked (magic, kind,
 *    layout version, size, offsets) and may be torn; an object replaced by a restarted
 *    service (another inode) is mapped again; a SIGBUS while reading is caught.
 *
 * A snapshot is one JSON object (snap_build); the text view (render.c) is drawn from it, so
 * --json and the screen say the same. */
#ifndef TOOLS_INSPECT_H
#define TOOLS_INSPECT_H
#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "common/shm.h"

#define INSPECT_N_SERVICES 3
extern const char *const inspect_services[INSPECT_N_SERVICES]; /* ssd-loader, kv-store, gpu-runner */

/* A read-only attachment of one shared-memory object. */
struct shm_view {
	char name[SHM_NAME_MAX];
	uint32_t kind, version; /* what the object must be */
	const void *base;	/* PROT_READ mapping of the whole object, or NULL */
	size_t len;
	dev_t dev;
	ino_t ino;
	unsigned attaches;	/* times mapped (a replaced object is mapped again) */
};

void shm_view_init(struct shm_view *v, const char *instance, const char *object, uint32_t kind, uint32_t version);
void shm_view_close(struct shm_view *v);
/* The weight ring's section: {"name", "attached", ...} (see docs/operations.md), never NULL
 * unless out of memory. Maps, re-maps or unmaps v as the object comes and goes. */
json_t *shm_view_ring(struct shm_view *v);
/* The KV pool's section, likewise. */
json_t *shm_view_pool(struct shm_view *v);

/* What the subscriber last heard from one publisher. */
struct pub_state {
	const char *name;
	bool heard;	   /* a heartbeat or stats at all */
	uint64_t beat_ns;  /* monotonic time of the last heartbeat (0: none) */
	uint64_t stats_ns; /* of the last stats (0: none) */
	uint64_t pid, epoch, uptime_ms, seq;
	json_t *stats;	   /* the last stats object, or NULL */
};

/* The text view of a snapshot. service: NULL for all. width: the terminal's columns (0: 100).
 * Lines end with eol ("\n", or "\033[K\n" to clear the rest of each line on a terminal). */
void render_text(FILE *f, json_t *snap, const char *service, int width, const char *eol);

/* The number at key (a JSON integer, real or boolean), or def. */
double jnum(json_t *o, const char *key, double def);
/* The string at key, or def. */
const char *jstr(json_t *o, const char *key, const char *def);

#endif

/* link.c - the stage link's common part (link.h): the formation's object, the dispatch to a kind,
 * the waits (liveness of the peers, the abort word, the wait hook, the timeout). */
#include "services/gpu-runner/stages/link_internal.h"

#include <errno.h>
#include <linux/futex.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/proc.h"
#include "common/util.h"

int link_fail(struct stage_link *l, int rc, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(l->error, sizeof(l->error), fmt, ap);
	va_end(ap);
	l->broken = true;
	return rc;
}

void link_futex_wait(_Atomic uint32_t *w, uint32_t v, int ms)
{
	struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
	/* Not FUTEX_PRIVATE: the word lies in memory shared with another process. */
	syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, v, &ts, NULL, 0);
}

void link_futex_wake(_Atomic uint32_t *w)
{
	syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

int link_check_wait(struct stage_link *l, uint64_t waited_ms, const char *what)
{
	/* 1: a rank is writing why; 2: written. A rank that died between the two is noticed below. */
	if (atomic_load_explicit(&l->h->aborted, memory_order_acquire) == 2)
		return link_fail(l, -ECONNABORTED, "%s: stage %u gave the step up: %.*s", what, l->h->aborted_by,
				 (int)sizeof(l->h->why), l->h->why);
	/* The rest costs system calls: every 100 ms of a wait (a wait starts at waited_ms 0). */
	if (waited_ms == 0)
		l->next_check_ms = 100;
	if (waited_ms < l->next_check_ms && waited_ms < (uint64_t)l->p.timeout_ms)
		return 0;
	l->next_check_ms = waited_ms + 100;
	for (uint32_t r = 0; r < l->p.ranks; r++)
		if (r != l->p.rank && !process_alive(l->p.pids[r], l->p.starts[r]))
			return link_fail(l, -EPIPE, "%s: the runner of stage %u (pid %d) is gone", what, r, l->p.pids[r]);
	if (l->p.wait_hook && l->p.wait_hook(l->p.wait_ctx))
		return link_fail(l, -ECANCELED, "%s: gpu-runner is stopping", what);
	if (waited_ms >= (uint64_t)l->p.timeout_ms)
		return link_fail(l, -ETIMEDOUT, "%s: no answer within %d ms", what, l->p.timeout_ms);
	return 0;
}

void stage_link_abort(struct stage_link *l, const char *why)
{
	if (!l || !l->h)
		return;
	uint32_t was = 0;
	if (atomic_compare_exchange_strong(&l->h->aborted, &was, 1u)) {
		/* The first rank to give up says why; the word is published after the text. */
		l->h->aborted_by = l->p.rank;
		snprintf(l->h->why, sizeof(l->h->why), "%s", why);
		atomic_store_explicit(&l->h->aborted, 2u, memory_order_release);
	}
	link_futex_wake(&l->h->aborted);
	for (uint32_t h = 0; h < l->h->ranks; h++)
		for (uint32_t s = 0; s < l->h->slots; s++) {
			link_futex_wake(&l->h->slot[h][s].seq);
			link_futex_wake(&l->h->slot[h][s].taken);
		}
	l->broken = true;
	if (!l->error[0])
		snprintf(l->error, sizeof(l->error), "the formation was given up: %s", why);
	if (l->ops->abort)
		l->ops->abort(l); /* nccl: ends the transfers queued here, before anything syncs the stream */
}

bool stage_link_kind_available(const char *kind)
{
	if (!strcmp(kind, "shm"))
		return true;
#ifdef PIPELINE_HAVE_NCCL
	if (!strcmp(kind, "nccl"))
		return true;
#endif
	return false;
}

static const struct stage_link_ops *ops_of(const char *kind, char *err, size_t errlen)
{
	if (!strcmp(kind, "shm"))
		return &stage_link_shm_ops;
#ifdef PIPELINE_HAVE_NCCL
	if (!strcmp(kind, "nccl"))
		return &stage_link_nccl_ops;
#endif
	snprintf(err, errlen, "stage link '%s' is not built into this gpu-runner (%s)", kind,
		 !strcmp(kind, "nccl") ? "built without NCCL: use shm" : "shm or nccl");
	return NULL;
}

static int check_params(const struct stage_link_params *p, char *err, size_t errlen)
{
	if (p->ranks < 2 || p->ranks > STAGE_MAX_RANKS || p->rank >= p->ranks || !p->dim || !p->max_rows ||
	    p->timeout_ms <= 0)
		return errorf(err, errlen, -EINVAL, "stage link: rank %u of %u (2..%d), rows of %u, %u rows, timeout %d ms",
			      p->rank, p->ranks, STAGE_MAX_RANKS, p->dim, p->max_rows, p->timeout_ms);
	return 0;
}

/* The kind's ops and the checked params, for open and join; NULL with err set. */
static const struct stage_link_ops *prologue(const char *kind, const struct stage_link_params *p, int *rc, char *err,
					     size_t errlen)
{
	const struct stage_link_ops *ops = ops_of(kind, err, errlen);
	*rc = ops ? check_params(p, err, errlen) : -ENOTSUP;
	return *rc ? NULL : ops;
}

/* A message slot's bytes, and the formation object's with its slots. */
static uint64_t slot_bytes(const struct stage_link_params *p)
{
	return ALIGN_UP((uint64_t)p->dim * sizeof(float) * p->max_rows, 4096);
}

static uint64_t object_bytes(const struct stage_link_params *p, uint32_t slots)
{
	return ALIGN_UP(sizeof(struct slink_header), 4096) + (uint64_t)p->ranks * slots * slot_bytes(p);
}

static struct stage_link *link_new(const struct stage_link_params *p, const struct stage_link_ops *ops)
{
	struct stage_link *l = calloc(1, sizeof(*l));
	if (!l)
		return NULL;
	l->p = *p;
	l->ops = ops;
	return l;
}

int stage_link_open(const struct stage_link_params *p, const char *kind, const char *instance, struct stage_link **out,
		    char *name, size_t name_len, void *id, char *err, size_t errlen)
{
	int rc;
	const struct stage_link_ops *ops = prologue(kind, p, &rc, err, errlen);
	if (!ops)
		return rc;
	if (p->rank != 0)
		return errorf(err, errlen, -EINVAL, "stage link: only rank 0 lays out a formation");
	uint32_t slots = ops == &stage_link_shm_ops ? SLINK_SLOTS : 0;
	uint64_t msg = slot_bytes(p), size = object_bytes(p, slots);
	if ((rc = shm_object_name(instance, "stages", name, name_len)) != 0)
		return errorf(err, errlen, rc, "stage link: instance name '%s' too long", instance);
	struct stage_link *l = link_new(p, ops);
	if (!l)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	rc = shm_object_create(name, size, SHM_KIND_STAGE_LINK, SLINK_LAYOUT_VERSION, SHM_RECLAIM, &l->obj, NULL);
	if (rc) {
		free(l);
		return errorf(err, errlen, rc, "stage link: cannot create %s (%s): %s", name,
			      format_size(size, (char[32]){0}, 32), rc == -EBUSY ? "another live runner owns it" : strerror(-rc));
	}
	l->owner = true;
	l->h = shm_object_base(l->obj);
	l->h->formation = p->formation;
	l->h->ranks = p->ranks;
	l->h->dim = p->dim;
	l->h->max_rows = p->max_rows;
	l->h->slots = slots;
	uint64_t off = ALIGN_UP(sizeof(struct slink_header), 4096);
	for (uint32_t h = 0; h < p->ranks; h++)
		for (uint32_t s = 0; s < slots; s++, off += msg)
			l->h->slot[h][s].data_off = off;
#ifdef PIPELINE_HAVE_NCCL
	if (ops == &stage_link_nccl_ops && (rc = stage_link_nccl_new_id(l->id, err, errlen)) != 0) {
		shm_object_close(&l->obj, true);
		free(l);
		return rc;
	}
#endif
	if (id)
		memcpy(id, l->id, STAGE_NCCL_ID_BYTES);
	shm_object_set_ready(l->obj);
	*out = l;
	return 0;
}

int stage_link_join(const struct stage_link_params *p, const char *kind, const char *name, const void *id,
		    struct stage_link **out, char *err, size_t errlen)
{
	int rc;
	const struct stage_link_ops *ops = prologue(kind, p, &rc, err, errlen);
	if (!ops)
		return rc;
	if (strncmp(name, "/llmp-", 6) || strchr(name + 1, '/'))
		return errorf(err, errlen, -EINVAL, "stage link: '%s' is not an object of this pipeline", name);
	struct stage_link *l = link_new(p, ops);
	if (!l)
		return errorf(err, errlen, -ENOMEM, "out of memory");
	rc = shm_object_attach(name, SHM_KIND_STAGE_LINK, SLINK_LAYOUT_VERSION, true, &l->obj);
	if (rc) {
		free(l);
		return errorf(err, errlen, rc, "stage link: cannot map %s: %s", name, strerror(-rc));
	}
	l->h = shm_object_base(l->obj);
	uint32_t slots = ops == &stage_link_shm_ops ? SLINK_SLOTS : 0;
	uint64_t msg = slot_bytes(p), need = object_bytes(p, slots);
	if (l->h->formation != p->formation || l->h->ranks != p->ranks || l->h->dim != p->dim ||
	    l->h->max_rows != p->max_rows || l->h->slots != slots || shm_object_size(l->obj) < need) {
		shm_object_close(&l->obj, false);
		free(l);
		return errorf(err, errlen, -EPROTO, "stage link: %s belongs to another formation or shape", name);
	}
	for (uint32_t h = 0; h < p->ranks; h++)
		for (uint32_t s = 0; s < slots; s++) {
			uint64_t off = l->h->slot[h][s].data_off;
			if (off < sizeof(struct slink_header) || off > shm_object_size(l->obj) - msg) {
				shm_object_close(&l->obj, false);
				free(l);
				return errorf(err, errlen, -EPROTO, "stage link: %s has a slot outside it", name);
			}
		}
	if (id && ops != &stage_link_shm_ops)
		memcpy(l->id, id, STAGE_NCCL_ID_BYTES);
	*out = l;
	return 0;
}

int stage_link_connect(struct stage_link *l)
{
	if (l->broken)
		return -EPIPE;
	return l->ops->connect(l);
}

int stage_link_send(struct stage_link *l, struct backend *be, uint32_t row0, uint32_t n)
{
	if (l->broken)
		return -EPIPE;
	if (n == 0 || n > l->p.max_rows)
		return link_fail(l, -EINVAL, "a message of %u rows (at most %u)", n, l->p.max_rows);
	int rc = l->ops->send(l, be, row0, n);
	if (rc == 0)
		l->sent += (uint64_t)n * l->p.dim * sizeof(float);
	return rc;
}

int stage_link_recv(struct stage_link *l, struct backend *be, uint32_t row0, uint32_t n, const struct backend_batch *b)
{
	if (l->broken)
		return -EPIPE;
	if (n == 0 || n > l->p.max_rows || (b && (row0 || n != b->n)))
		return link_fail(l, -EINVAL, "a receive of %u rows at row %u (at most %u; a step's start: all its rows)",
				 n, row0, l->p.max_rows);
	int rc = l->ops->recv(l, be, row0, n, b);
	if (rc == 0)
		l->received += (uint64_t)n * l->p.dim * sizeof(float);
	return rc;
}

int stage_link_wait(struct stage_link *l, struct backend *be)
{
	if (l->broken)
		return -EPIPE;
	return l->ops->wait(l, be);
}

const char *stage_link_kind(const struct stage_link *l)
{
	return l->ops->kind;
}

const char *stage_link_error(const struct stage_link *l)
{
	return l->error;
}

bool stage_link_broken(const struct stage_link *l)
{
	return l->broken;
}

void stage_link_counts(const struct stage_link *l, uint64_t *sent, uint64_t *received)
{
	*sent = l->sent;
	*received = l->received;
}

void stage_link_destroy(struct stage_link **lp)
{
	if (!lp || !*lp)
		return;
	struct stage_link *l = *lp;
	l->ops->destroy(l);
	shm_object_close(&l->obj, l->owner);
	free(l);
	*lp = NULL;
}

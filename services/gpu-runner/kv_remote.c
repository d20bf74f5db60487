#include "services/gpu-runner/kv_remote.h"

#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/proc.h"
#include "common/shm.h"
#include "common/util.h"

/* Records a message in the object and returns rc. */
#define set_err(obj, rc, ...) errorf((obj)->error, sizeof((obj)->error), rc, __VA_ARGS__)

/* The errno an MSG_ERROR carries, if it is one (1..4095); EIO for anything else, so that a
 * code that truncates to 0 in an int never reads as success. */
static int reply_errno(const struct msg *rep)
{
	return rep->error.code > 0 && rep->error.code < 4096 ? (int)rep->error.code : EIO;
}

/* Waits for the reply to corr in slices, so that a kv-store that died (its pool's owner is
 * gone) is noticed at once rather than after the whole timeout, and the wait hook runs between
 * them. Before a pool is mapped (its configuration) there is no owner to look at: the process
 * that answered HELLO is looked at instead where it is known (kv_remote_set_peer), else the
 * timeout alone ends the wait. Returns as rpc_wait, or -ECONNRESET when the kv-store died. */
static int wait_reply(struct kv_remote *kr, uint64_t corr, struct msg *rep)
{
	const int slice = 100;
	for (int waited = 0;;) {
		int step = kr->timeout_ms - waited < slice ? kr->timeout_ms - waited : slice;
		int rc = rpc_wait(kr->client, corr, rep, step > 0 ? step : 0);
		if (rc != -ETIMEDOUT) {
			if (rc && rc != -EREMOTEIO) /* unreadable: the store may have done the request */
				kr->lost = kr->orphans = true;
			return rc;
		}
		waited += step;
		const bool gone = kr->h ? !kv_remote_owner_alive(kr)
					: kr->peer_pid > 0 && !process_alive(kr->peer_pid, kr->peer_start);
		if (gone || waited >= kr->timeout_ms) {
			/* Given up: the store may have done the request (one that died may have done it
			 * before it answered, in the pool the next kv-store adopts). */
			kr->lost = true;
			kr->orphans = true;
			return gone ? -ECONNRESET : -ETIMEDOUT;
		}
		if (kr->wait_hook && kr->wait_hook(kr->wait_ctx)) {
			kr->lost = true; /* the reply may still come: it must not be taken for another's */
			kr->orphans = true;
			return -ECANCELED;
		}
	}
}

/* The least the pool's configuration is waited for, whatever --timeout-ms says: the kv-store
 * makes the pool then (its shared memory faulted in whole, the spill file opened), a second a
 * GiB or so on a loaded host; a store that dies meanwhile is noticed by its pid all the same, and
 * a hung one is restarted by the supervisor. */
#define KV_CONFIGURE_WAIT_MS 120000

static const char *wait_error(int rc)
{
	return rc == -ECONNRESET ? "the kv-store process died"
	       : rc == -ECANCELED ? "gpu-runner is stopping"
				  : strerror(-rc);
}

/* Reads the replies of the oldest n commits sent (replies come in order). Returns 0, or the
 * first refusal. */
static int drain_n(struct kv_remote *kr, uint32_t n)
{
	int rc = 0;
	for (uint32_t i = 0; i < n; i++) {
		struct msg rep;
		int r = wait_reply(kr, kr->pending[i], &rep);
		if (r == -EREMOTEIO) {
			if (!rc)
				rc = set_err(kr, -reply_errno(&rep), "kv-store refused a commit or unpin: %s",
					     rep.error.text.p);
			msg_free(&rep);
		} else if (r) {
			if (!rc)
				rc = set_err(kr, r, "kv-store did not answer a commit or unpin: %s", wait_error(r));
			/* The connection is lost (wait_reply said so): the others would wait a timeout each,
			 * and a reconnect starts with none pending. */
			kr->n_pending = 0;
			return rc;
		} else {
			if (rep.type != MSG_OK && !rc)
				rc = set_err(kr, -EPROTO, "kv-store answered a commit or unpin with %s",
					     msg_type_name(rep.type));
			msg_free(&rep);
		}
	}
	memmove(kr->pending, kr->pending + n, (kr->n_pending - n) * sizeof(kr->pending[0]));
	kr->n_pending -= n;
	return rc;
}

/* Reads the replies of the commits sent so far. */
static int drain(struct kv_remote *kr)
{
	return drain_n(kr, kr->n_pending);
}

/* Names the session that sends req (the client's HELLO session), for a KV request that has the
 * field: the kv-store refuses it once a HELLO with another session has ended this one. */
static void stamp_session(const struct kv_remote *kr, struct msg *req)
{
	uint64_t *session = msg_kv_session(req);
	if (session)
		*session = rpc_client_session(kr->client);
}

/* One request; the reply must be of type `want`. Returns 0 with rep to free, or -errno. */
static int call(struct kv_remote *kr, struct msg *req, uint32_t want, struct msg *rep)
{
	if (!kr->h)
		return set_err(kr, -ENOTCONN, "not connected to kv-store");
	int prc = drain(kr);
	if (prc)
		return prc;
	const char *what = msg_type_name(req->type);
	uint64_t corr;
	stamp_session(kr, req);
	int rc = rpc_send(kr->client, req, &corr);
	if (rc) {
		kr->lost = true;
		return set_err(kr, rc, "cannot send %s to kv-store: %s", what, strerror(-rc));
	}
	rc = wait_reply(kr, corr, rep);
	if (rc == -EREMOTEIO) {
		int code = reply_errno(rep);
		set_err(kr, -code, "kv-store refused %s: %s", what, rep->error.text.p);
		msg_free(rep);
		return -code;
	}
	if (rc)
		return set_err(kr, rc, "kv-store did not answer %s: %s", what, wait_error(rc));
	if (rep->type != want) {
		set_err(kr, -EPROTO, "kv-store answered %s with %s", what, msg_type_name(rep->type));
		msg_free(rep);
		kr->lost = kr->orphans = true; /* what it did for the request is not known: given up */
		return -EPROTO;
	}
	return 0;
}

/* Checks an offset from the pool: the start of a slot's data. Returns the slot or -1. */
static int64_t slot_of(const struct kv_remote *kr, uint64_t offset)
{
	if (offset < kr->data_off || (offset - kr->data_off) % kr->block_bytes)
		return -1;
	uint64_t slot = (offset - kr->data_off) / kr->block_bytes;
	return slot < kr->n_slots ? (int64_t)slot : -1;
}

static int blocks_reply(struct kv_remote *kr, const struct msg *rep, uint32_t n, const uint64_t *expect,
			uint64_t *handles, void **ptrs)
{
	const struct msg_kv_blocks *b = &rep->kv_blocks;
	if (b->handles.n != n || b->offsets.n != n) {
		kr->lost = kr->orphans = true; /* what it allocated for us: nobody's to hand back */
		return set_err(kr, -EPROTO, "kv-store sent %u blocks for %u asked", b->handles.n, n);
	}
	/* Two blocks in one slot would overwrite each other: every slot once. */
	uint8_t *seen = calloc(kr->n_slots / 8 + 1, 1);
	if (!seen) {
		kr->lost = kr->orphans = true;
		return set_err(kr, -ENOMEM, "out of memory");
	}
	int rc = 0;
	for (uint32_t i = 0; i < n && !rc; i++) {
		int64_t slot = slot_of(kr, b->offsets.v[i]);
		if (slot < 0) {
			rc = set_err(kr, -EPROTO, "kv-store sent offset %llu, not a pool block",
				     (unsigned long long)b->offsets.v[i]);
		} else if (seen[slot / 8] & (1u << (slot % 8))) {
			rc = set_err(kr, -EPROTO, "kv-store sent pool block %lld twice in one reply", (long long)slot);
		} else if (expect && b->handles.v[i] != expect[i]) {
			rc = set_err(kr, -EPROTO, "kv-store answered for block %llx instead of %llx",
				     (unsigned long long)b->handles.v[i], (unsigned long long)expect[i]);
		} else {
			seen[slot / 8] |= (uint8_t)(1u << (slot % 8));
			if (handles)
				handles[i] = b->handles.v[i];
			ptrs[i] = (char *)kr->h + b->offsets.v[i];
		}
	}
	free(seen);
	/* Blocks allocated or pinned for a reply that cannot be used: nobody will hand them back but
	 * a new session (kr->orphans). */
	if (rc)
		kr->lost = kr->orphans = true;
	return rc;
}

static int alloc_rpc(struct kv_remote *kr, uint32_t n, uint64_t *handles, void **ptrs)
{
	struct msg req, rep;
	msg_init(&req, MSG_KV_ALLOC, 0);
	req.kv_alloc.count = n;
	int rc = call(kr, &req, MSG_KV_BLOCKS, &rep);
	if (rc)
		return rc;
	rc = blocks_reply(kr, &rep, n, NULL, handles, ptrs);
	msg_free(&rep);
	return rc;
}

static uint32_t op_max_batch(void *ctx);

/* Decode's few blocks come from the stash, which is filled up to KV_STASH_BLOCKS when short (with
 * only what is needed when the pool has no room for more); larger requests (prefill) go as they
 * are. */
static int op_alloc(void *ctx, uint32_t n, uint64_t *handles, void **ptrs)
{
	struct kv_remote *kr = ctx;
	if (!kr->h || kr->n_slots < KV_STASH_MIN_POOL || n > KV_STASH_BLOCKS / 2 || n > op_max_batch(kr))
		return alloc_rpc(kr, n, handles, ptrs);
	if (kr->n_stash < n) {
		uint32_t need = n - kr->n_stash, want = KV_STASH_BLOCKS - kr->n_stash;
		if (want > op_max_batch(kr))
			want = op_max_batch(kr) > need ? op_max_batch(kr) : need;
		/* No more than the pool has free: the kv-store would spill or drop cached blocks to make
		 * room for blocks nobody asked for yet. */
		uint64_t used = atomic_load_explicit(&kr->h->store.slots_used, memory_order_relaxed);
		uint64_t free_slots = used < kr->n_slots ? kr->n_slots - used : 0;
		if (want > free_slots)
			want = free_slots > need ? (uint32_t)free_slots : need;
		int rc = alloc_rpc(kr, want, kr->stash_h + kr->n_stash, kr->stash_p + kr->n_stash);
		if (rc == -ENOSPC && want > need) {
			want = need;
			rc = alloc_rpc(kr, want, kr->stash_h + kr->n_stash, kr->stash_p + kr->n_stash);
		}
		if (rc)
			return rc;
		kr->n_stash += want;
	}
	kr->n_stash -= n;
	memcpy(handles, kr->stash_h + kr->n_stash, n * sizeof(*handles));
	memcpy(ptrs, kr->stash_p + kr->n_stash, n * sizeof(*ptrs));
	return 0;
}

static int simple(struct kv_remote *kr, uint32_t type, uint32_t n, const uint64_t *handles)
{
	struct msg req, rep;
	msg_init(&req, type, 0);
	req.kv_handles.handles.v = (uint64_t *)handles;
	req.kv_handles.handles.n = n;
	int rc = call(kr, &req, MSG_OK, &rep);
	if (rc == 0)
		msg_free(&rep);
	return rc;
}

/* Sends MSG_KV_COMMIT of n blocks (events: n handles, or NULL), write-behind. */
static int send_commit(struct kv_remote *kr, uint32_t n, const uint64_t *handles, const uint64_t *keys,
		       const char *events)
{
	if (kr->n_pending == sizeof(kr->pending) / sizeof(kr->pending[0])) {
		/* The older half: their copies are likely done, where the newest may not have begun. */
		int rc = drain_n(kr, kr->n_pending / 2);
		if (rc)
			return rc;
	}
	struct msg req;
	msg_init(&req, MSG_KV_COMMIT, 0);
	req.kv_commit.handles.v = (uint64_t *)handles;
	req.kv_commit.handles.n = n;
	if (keys) {
		req.kv_commit.keys.v = (uint64_t *)keys;
		req.kv_commit.keys.n = n;
	}
	if (events) {
		req.kv_commit.events.p = (char *)events;
		req.kv_commit.events.len = n * KV_EVENT_HANDLE_BYTES;
	}
	/* Write-behind: the reply is read before the next request (see kv_remote.h). */
	uint64_t corr;
	stamp_session(kr, &req);
	int rc = rpc_send(kr->client, &req, &corr);
	if (rc) {
		kr->lost = true;
		return set_err(kr, rc, "cannot send a commit to kv-store: %s", strerror(-rc));
	}
	kr->pending[kr->n_pending++] = corr;
	return 0;
}

/* Holds n commits back (defer_commits). */
static int defer(struct kv_remote *kr, uint32_t n, const uint64_t *handles, const uint64_t *keys, const void *event)
{
	if (kr->n_deferred + n > kr->cap_deferred) {
		uint32_t cap = kr->cap_deferred ? kr->cap_deferred : 256;
		while (cap < kr->n_deferred + n)
			cap *= 2;
		struct kv_deferred *d = realloc(kr->deferred, cap * sizeof(*d));
		if (!d)
			return set_err(kr, -ENOMEM, "out of memory");
		kr->deferred = d;
		kr->cap_deferred = cap;
	}
	for (uint32_t i = 0; i < n; i++) {
		struct kv_deferred *d = &kr->deferred[kr->n_deferred++];
		*d = (struct kv_deferred){.handle = handles[i], .key = keys ? keys[i] : 0, .has_event = event != NULL};
		if (event)
			memcpy(d->event, event, KV_EVENT_HANDLE_BYTES);
	}
	return 0;
}

int kv_remote_flush_commits(struct kv_remote *kr)
{
	enum { BATCH = 1024 };
	uint64_t handles[BATCH], keys[BATCH];
	char *events = NULL;
	int rc = 0;
	for (uint32_t i = 0; i < kr->n_deferred && rc == 0;) {
		/* One message per run of blocks alike in having an event or not. */
		bool ev = kr->deferred[i].has_event;
		uint32_t n = 0;
		while (i + n < kr->n_deferred && n < BATCH && kr->deferred[i + n].has_event == ev) {
			handles[n] = kr->deferred[i + n].handle;
			keys[n] = kr->deferred[i + n].key;
			n++;
		}
		if (ev && !events && !(events = malloc((size_t)BATCH * KV_EVENT_HANDLE_BYTES))) {
			rc = set_err(kr, -ENOMEM, "out of memory");
			break;
		}
		for (uint32_t k = 0; ev && k < n; k++)
			memcpy(events + (size_t)k * KV_EVENT_HANDLE_BYTES, kr->deferred[i + k].event, KV_EVENT_HANDLE_BYTES);
		rc = send_commit(kr, n, handles, keys, ev ? events : NULL);
		i += n;
	}
	free(events);
	kr->n_deferred = 0;
	return rc;
}

void kv_remote_drop_commits(struct kv_remote *kr)
{
	kr->n_deferred = 0;
}

static int op_commit(void *ctx, uint32_t n, const uint64_t *handles, void *const *ptrs, const uint64_t *keys,
		     const void *event)
{
	struct kv_remote *kr = ctx;
	struct kvpool_slot *slots = kr->slots;
	for (uint32_t i = 0; i < n; i++) {
		int64_t slot = slot_of(kr, (uint64_t)((char *)ptrs[i] - (char *)kr->h));
		if (slot < 0)
			return set_err(kr, -EINVAL, "block %u is not in the pool", i);
		/* The copy is complete: pairs with kv-store's acquire load before it checksums. With
		 * an event, the copy may still run: the kv-store waits on the event instead. */
		if (!event)
			atomic_store_explicit(&slots[slot].ready, 1, memory_order_release);
	}
	atomic_fetch_add_explicit(&kr->h->runner.blocks_written, n, memory_order_relaxed);
	if (kr->defer_commits)
		return defer(kr, n, handles, keys, event);
	char *events = NULL;
	if (event) { /* one event for the batch: its handle once per block, as the message wants */
		events = malloc((size_t)n * KV_EVENT_HANDLE_BYTES);
		if (!events)
			return set_err(kr, -ENOMEM, "out of memory");
		for (uint32_t i = 0; i < n; i++)
			memcpy(events + (size_t)i * KV_EVENT_HANDLE_BYTES, event, KV_EVENT_HANDLE_BYTES);
	}
	int rc = send_commit(kr, n, handles, keys, events);
	free(events);
	return rc;
}

static int op_fetch(void *ctx, uint32_t n, const uint64_t *handles, void **ptrs)
{
	struct kv_remote *kr = ctx;
	struct msg req, rep;
	msg_init(&req, MSG_KV_FETCH, 0);
	req.kv_handles.handles.v = (uint64_t *)handles;
	req.kv_handles.handles.n = n;
	int rc = call(kr, &req, MSG_KV_BLOCKS, &rep);
	if (rc)
		return rc;
	rc = blocks_reply(kr, &rep, n, handles, NULL, ptrs);
	msg_free(&rep);
	if (rc == 0)
		atomic_fetch_add_explicit(&kr->h->runner.blocks_read, n, memory_order_relaxed);
	return rc;
}

/* Write-behind like a commit: the blocks were copied out already, nothing here waits for the
 * kv-store to note it; a refusal surfaces as the error of the next request. */
static int op_unpin(void *ctx, uint32_t n, const uint64_t *handles)
{
	struct kv_remote *kr = ctx;
	if (!kr->h)
		return set_err(kr, -ENOTCONN, "not connected to kv-store");
	if (kr->n_pending == sizeof(kr->pending) / sizeof(kr->pending[0])) {
		/* The older half: their copies are likely done, where the newest may not have begun. */
		int rc = drain_n(kr, kr->n_pending / 2);
		if (rc)
			return rc;
	}
	struct msg req;
	msg_init(&req, MSG_KV_UNPIN, 0);
	req.kv_handles.handles.v = (uint64_t *)handles;
	req.kv_handles.handles.n = n;
	uint64_t corr;
	stamp_session(kr, &req);
	int rc = rpc_send(kr->client, &req, &corr);
	if (rc) {
		kr->lost = true;
		return set_err(kr, rc, "cannot send an unpin to kv-store: %s", strerror(-rc));
	}
	kr->pending[kr->n_pending++] = corr;
	return 0;
}

/* MSG_KV_FREE of n handles, in requests of at most KV_MAX_REQUEST_BLOCKS. */
static int op_release(void *ctx, uint32_t n, const uint64_t *handles)
{
	for (uint32_t i = 0; i < n; i += KV_MAX_REQUEST_BLOCKS) {
		const uint32_t m = n - i < KV_MAX_REQUEST_BLOCKS ? n - i : KV_MAX_REQUEST_BLOCKS;
		int rc = simple(ctx, MSG_KV_FREE, m, handles + i);
		if (rc)
			return rc;
	}
	return 0;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* MSG_KV_LOOKUP of keys[0..n) in requests of at most KV_MAX_REQUEST_BLOCKS (a long prompt over
 * many layers names more blocks than one request may): handles[i] is key i's block, 0 where none.
 * Where a request fails after others hit, their references are handed back (best effort: the
 * error stands either way). */
static int op_lookup(void *ctx, uint32_t n, const uint64_t *keys, uint64_t *handles)
{
	struct kv_remote *kr = ctx;
	int rc = 0;
	uint32_t done = 0;
	while (done < n && !rc) {
		const uint32_t m = n - done < KV_MAX_REQUEST_BLOCKS ? n - done : KV_MAX_REQUEST_BLOCKS;
		struct msg req, rep;
		msg_init(&req, MSG_KV_LOOKUP, 0);
		req.kv_lookup.keys.v = (uint64_t *)keys + done;
		req.kv_lookup.keys.n = m;
		rc = call(kr, &req, MSG_KV_BLOCKS, &rep);
		if (rc)
			break;
		const struct msg_kv_blocks *b = &rep.kv_blocks;
		if (b->handles.n != m) {
			rc = set_err(kr, -EPROTO, "kv-store answered a lookup of %u keys with %u handles", m, b->handles.n);
			kr->lost = kr->orphans = true; /* its hits' references: nobody's to hand back */
		} else {
			memcpy(handles + done, b->handles.v, (size_t)m * sizeof(uint64_t));
			done += m;
		}
		msg_free(&rep);
	}
	/* A hit is a block we now hold a reference to: the same handle twice would be two references
	 * to one block, which the caller cannot tell apart; refuse it (sorted: n log n). Where the
	 * lookup failed, the hits of the requests that went through go back, each block once (not
	 * over a connection that stopped answering: the store keeps them for the session). */
	uint64_t *hit = done ? malloc((size_t)done * sizeof(uint64_t)) : NULL;
	if (done && !hit)
		return rc ? rc : set_err(kr, -ENOMEM, "out of memory");
	uint32_t nh = 0;
	for (uint32_t i = 0; i < done; i++)
		if (handles[i])
			hit[nh++] = handles[i];
	if (nh)
		qsort(hit, nh, sizeof(uint64_t), cmp_u64);
	uint32_t u = nh ? 1 : 0;
	for (uint32_t i = 1; i < nh; i++) {
		if (hit[i] != hit[u - 1])
			hit[u++] = hit[i];
		else if (!rc) {
			rc = set_err(kr, -EPROTO, "kv-store answered two keys with block %llx", (unsigned long long)hit[i]);
			/* Two references to it, of which a release would hand back one: a new session
			 * hands back every one (the release below is then left out). */
			kr->lost = kr->orphans = true;
		}
	}
	if (rc && u && !kr->lost) {
		char keep[sizeof(kr->error)];
		memcpy(keep, kr->error, sizeof(keep));
		op_release(kr, u, hit); /* the lookup's error is what the caller sees */
		memcpy(kr->error, keep, sizeof(keep));
	}
	free(hit);
	return rc;
}

static int op_unpin_all(void *ctx)
{
	return simple(ctx, MSG_KV_UNPIN_ALL, 0, NULL);
}

static uint32_t op_max_batch(void *ctx)
{
	const struct kv_remote *kr = ctx;
	uint32_t n = kr->h && kr->n_slots ? kr->n_slots : 1;
	return kr->max_batch && kr->max_batch < n ? kr->max_batch : n;
}

static const char *op_error(void *ctx)
{
	return ((struct kv_remote *)ctx)->error;
}

const struct kv_remote_ops kv_remote_ops_pool = {
	.alloc = op_alloc,
	.commit = op_commit,
	.fetch = op_fetch,
	.unpin = op_unpin,
	.release = op_release,
	.lookup = op_lookup,
	.unpin_all = op_unpin_all,
	.max_batch = op_max_batch,
	.error = op_error,
};

/* MSG_KV_FREE of the stash's blocks, one at a time when the kv-store refuses them together (one
 * it dropped must not keep the others). Empties the stash. Returns the first failure. */
static int free_stash(struct kv_remote *kr)
{
	uint32_t n = kr->n_stash;
	kr->n_stash = 0;
	int rc = simple(kr, MSG_KV_FREE, n, kr->stash_h);
	if (rc && !kv_remote_lost(kr)) {
		for (uint32_t i = 0; i < n && !kv_remote_lost(kr); i++)
			simple(kr, MSG_KV_FREE, 1, &kr->stash_h[i]);
	}
	return rc;
}

int kv_remote_release_stash(struct kv_remote *kr)
{
	if (!kr->n_stash)
		return 0;
	/* A lost connection keeps them: the next connect to the same pool hands them back (a
	 * kv-store that adopted it keeps blocks being written). */
	if (kv_remote_lost(kr))
		return 0;
	/* The commits before first, so a refusal of theirs does not keep the FREE from going. */
	int drc = drain(kr);
	int frc = kv_remote_lost(kr) ? 0 : free_stash(kr);
	return drc ? drc : frc;
}

int kv_remote_connect(struct kv_remote *kr, struct rpc_client *client, uint64_t block_bytes, uint64_t manifest_hash,
		      int timeout_ms, bool *same_pool, char *err, size_t errlen)
{
	/* The pool of the last connection that succeeded, not of the last attempt: a kv-store that
	 * adopted the pool and died again before answering leaves it the same pool all the same. */
	const uint64_t old_epoch = kr->pool_epoch;
	const bool had = kr->pool_known;

	kv_remote_disconnect(kr);
	kr->client = client;
	kr->timeout_ms = timeout_ms;
	kr->block_bytes = block_bytes;
	struct msg req, rep;
	msg_init(&req, MSG_KV_CONFIGURE, 0);
	req.kv_configure.block_bytes = block_bytes;
	req.kv_configure.manifest_hash = manifest_hash;
	/* In slices with the wait hook between them, as every other wait on the kv-store: a kv-store that
	 * answered HELLO and died before this does not keep the runner from beating for the timeout. */
	uint64_t corr;
	memset(&rep, 0, sizeof(rep));
	int rc = rpc_send(client, &req, &corr);
	/* A configuration given up on leaves nothing held for the session (not an orphan). */
	const bool orphans = kr->orphans;
	if (rc == 0) {
		const int least = kr->configure_wait_ms > 0 ? kr->configure_wait_ms : KV_CONFIGURE_WAIT_MS;
		kr->timeout_ms = timeout_ms > least ? timeout_ms : least;
		rc = wait_reply(kr, corr, &rep);
		kr->timeout_ms = timeout_ms;
	}
	kr->orphans = orphans;
	if (rc == -EREMOTEIO) {
		snprintf(err, errlen, "kv-store refused the pool configuration: %s", rep.error.text.p);
		rc = -reply_errno(&rep);
		msg_free(&rep);
		return rc;
	}
	if (rc) {
		snprintf(err, errlen, "kv-store did not answer the pool configuration: %s", wait_error(rc));
		return rc;
	}
	if (rep.type != MSG_KV_POOL || rep.kv_pool.block_bytes != block_bytes || rep.kv_pool.n_blocks == 0) {
		snprintf(err, errlen, "kv-store answered the pool configuration with a %s that does not match",
			 msg_type_name(rep.type));
		msg_free(&rep);
		return -EPROTO;
	}
	rc = shm_object_attach(rep.kv_pool.shm_name.p, SHM_KIND_KV_POOL, KVPOOL_LAYOUT_VERSION, true, &kr->obj);
	if (rc) {
		snprintf(err, errlen, "cannot map the KV pool %s: %s", rep.kv_pool.shm_name.p, strerror(-rc));
		msg_free(&rep);
		return rc;
	}
	struct kvpool_header *h = shm_object_base(kr->obj);
	size_t size = shm_object_size(kr->obj);
	/* Read once, checked without a sum that could wrap, kept (kv_remote.h). */
	const uint64_t data_off = h->data_off, bb = h->block_bytes, slots_off = h->slots_off;
	const uint32_t n_slots = h->n_slots;
	if (bb != block_bytes || bb == 0 || n_slots != rep.kv_pool.n_blocks || n_slots == 0 || data_off < sizeof(*h) ||
	    data_off > size || bb > (size - data_off) / n_slots || slots_off < sizeof(*h) || slots_off > size ||
	    (uint64_t)n_slots * sizeof(struct kvpool_slot) > size - slots_off) {
		snprintf(err, errlen, "the KV pool %s is laid out inconsistently", rep.kv_pool.shm_name.p);
		msg_free(&rep);
		shm_object_close(&kr->obj, false);
		return -EPROTO;
	}
	kr->h = h;
	kr->data_off = data_off;
	kr->n_slots = n_slots;
	kr->slots = (struct kvpool_slot *)((char *)h + slots_off);
	kr->lost = false;
	kr->owner_pid = atomic_load(&h->shm.owner_pid);
	kr->pool_epoch = rep.kv_pool.epoch;
	kr->pool_known = true;
	if (same_pool)
		*same_pool = had && old_epoch == kr->pool_epoch;
	msg_free(&rep);
	/* Blocks allocated ahead on an earlier connection: handed back when the pool is the same (a
	 * kv-store that adopted it may have dropped some: a refusal is no matter), else gone with it. */
	if (kr->n_stash && !(had && old_epoch == kr->pool_epoch))
		kr->n_stash = 0;
	if (kr->n_stash && free_stash(kr) != 0)
		kr->error[0] = '\0';
	return 0;
}

void kv_remote_disconnect(struct kv_remote *kr)
{
	kr->n_pending = 0;
	free(kr->deferred);
	kr->deferred = NULL;
	kr->n_deferred = kr->cap_deferred = 0;
	shm_object_close(&kr->obj, false);
	kr->h = NULL;
}

void kv_remote_forget_session(struct kv_remote *kr)
{
	kr->n_stash = 0;
	kr->n_pending = 0;
	kr->n_deferred = 0;
	kr->orphans = false;
}

void kv_remote_set_peer(struct kv_remote *kr, uint64_t pid)
{
	kr->peer_pid = 0;
	kr->peer_start = 0;
	if (pid == 0 || pid > INT_MAX)
		return;
	/* Its start time now, so that a pid taken again by another process is not mistaken for it. */
	const uint64_t start = process_start_time((int)pid);
	if (start == 0)
		return; /* gone already, or not readable: the timeout decides */
	kr->peer_pid = (int)pid;
	kr->peer_start = start;
}

bool kv_remote_owner_alive(const struct kv_remote *kr)
{
	return kr->h && atomic_load(&kr->h->shm.owner_pid) == kr->owner_pid && shm_owner_alive(&kr->h->shm);
}

bool kv_remote_lost(const struct kv_remote *kr)
{
	return !kr->h || kr->lost || !kv_remote_owner_alive(kr);
}

/* kv_remote.h - the runner's side of the kv-store: the pool mapped in this process and the
 * MSG_KV_* requests, packaged as the kv_remote_ops that kv_cache.c uses.
 *
 *   struct kv_remote kr = {0};
 *   rc = kv_remote_connect(&kr, client, block_bytes, manifest_hash, timeout_ms, err, sizeof(err));
 *   kv_cache_create(..., &kv_remote_ops_pool, &kr, ...);
 *   if (!kv_remote_owner_alive(&kr)) ... kv-store restarted: connect again (same pool epoch: handles valid)
 *   kv_remote_disconnect(&kr);
 *
 * Completion without CUDA: after copying a block into its pool slot, commit stores the slot's
 * ready flag with release order before sending MSG_KV_COMMIT; kv-store loads it with acquire.
 * With CUDA the copy is asynchronous and commit carries its IPC event's handle instead; the
 * kv-store waits on it. At most KV_EVENTS_IN_FLIGHT commits are unanswered, so the backend's
 * round-robin events are never re-recorded while the kv-store may still wait on them.
 *
 * Commits and unpins are write-behind: commit sends MSG_KV_COMMIT (unpin MSG_KV_UNPIN) and
 * returns; its reply is collected before the next request to the kv-store (replies come in
 * order), or the older half of them when KV_EVENTS_IN_FLIGHT are unanswered, so the kv-store
 * checksums while the runner computes. A refusal surfaces as the error of that next request.
 * Decode's blocks come from a stash allocated ahead, so a layer's commit makes no request that
 * would wait for those replies.
 */
#ifndef GPU_RUNNER_KV_REMOTE_H
#define GPU_RUNNER_KV_REMOTE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/bus.h"
#include "common/kv_pool.h"
#include "services/gpu-runner/backend.h"
#include "services/gpu-runner/kv_cache.h"
#ifdef __cplusplus
extern "C" {
#endif

#define KV_STASH_BLOCKS 64
#define KV_STASH_MIN_POOL 4096

struct kv_remote {
	struct rpc_client *client; /* borrowed */
	struct shm_object *obj;
	struct kvpool_header *h;
	/* The pool's layout as checked when it was mapped (the header lies in memory the kv-store
	 * writes: never read again for addresses). */
	uint64_t data_off; /* (block_bytes below, which the pool's must equal) */
	uint32_t n_slots;
	struct kvpool_slot *slots;
	int owner_pid;
	/* The kv-store process that answered HELLO (kv_remote_set_peer): before a pool is mapped there
	 * is no owner to look at, and a wait for its reply (the pool configuration) ends when this
	 * process is gone. 0: not known (the timeout alone ends the wait). */
	int peer_pid;
	uint64_t peer_start;
	uint64_t pool_epoch;
	bool pool_known; /* a connect succeeded: pool_epoch names that pool, a failed connect after it
			  * notwithstanding (a reconnect to the same pool keeps its blocks) */
	uint64_t block_bytes;
	int timeout_ms;
	/* The least the pool's configuration is waited for, above timeout_ms (the kv-store makes the
	 * pool then: its shared memory faulted in whole); 0: KV_CONFIGURE_WAIT_MS (kv_remote.c). */
	int configure_wait_ms;
	uint32_t max_batch; /* blocks per ALLOC/FETCH at most; 0: as many as the pool holds (live tuning) */
	uint64_t pending[KV_EVENTS_IN_FLIGHT]; /* commits whose replies are not yet read */
	uint32_t n_pending;
	bool lost; /* a request went unanswered (timeout, the process died): reconnect before trusting it */
	/* A request's reply was given up (a timeout, a stop, or the kv-store died, after it may have
	 * done it in the pool the next one adopts): blocks allocated, referenced or pinned for this
	 * session with nobody to hear of it. The runner then says HELLO with a new session, so that
	 * the store lets go of all of them (kv_remote_forget_session); cached blocks stay. */
	bool orphans;
	char error[512];
	/* Called every 100 ms while a reply is awaited (the runner beats its heartbeat); true gives
	 * the wait up (the runner is stopping): the request fails with -ECANCELED and the connection
	 * counts as lost. May be NULL. Set by the owner; kv_remote_connect keeps it. */
	bool (*wait_hook)(void *ctx);
	void *wait_ctx;
	/* A later stage of a split model holds its commits back until its step has computed
	 * (kv_remote_flush_commits): the kv-store waits on a commit's event, and a later stage's events
	 * follow work of the ranks before it that may itself wait for a kv-store reply. Set by the owner. */
	bool defer_commits;
	struct kv_deferred *deferred; /* blocks committed, not yet told */
	uint32_t n_deferred, cap_deferred;
	/* Blocks allocated ahead for the commits of decode (a block or two a layer): an ALLOC waits
	 * for the replies of every commit sent before it, and the kv-store answers a commit only once
	 * its copy is done, so an ALLOC a layer made the runner wait for the GPU a layer. With a pool
	 * of at least KV_STASH_MIN_POOL blocks, up to KV_STASH_BLOCKS are held for this; an idle
	 * runner hands them back (kv_remote_release_stash). */
	uint64_t stash_h[KV_STASH_BLOCKS];
	void *stash_p[KV_STASH_BLOCKS];
	uint32_t n_stash;
};

/* A commit held back (defer_commits): one block. */
struct kv_deferred {
	uint64_t handle, key;
	bool has_event;
	uint8_t event[KV_EVENT_HANDLE_BYTES];
};

extern const struct kv_remote_ops kv_remote_ops_pool;

/* HELLO is the caller's business (rpc_wait_ready); this sends MSG_KV_CONFIGURE and maps
 * the pool. Returns 0, or -errno with err set. *same_pool says whether the pool is the
 * one this kv_remote had before (same epoch: the handles held stay valid). */
int kv_remote_connect(struct kv_remote *kr, struct rpc_client *client, uint64_t block_bytes, uint64_t manifest_hash,
		      int timeout_ms, bool *same_pool, char *err, size_t errlen);
void kv_remote_disconnect(struct kv_remote *kr);
/* The session is given up (the runner says HELLO with a new one, and the store lets go of every
 * block the old one held): the blocks allocated ahead and the commits not yet answered are
 * forgotten, not handed back, and orphans is cleared. */
void kv_remote_forget_session(struct kv_remote *kr);
/* The pid the kv-store's HELLO reply named (from another process: anything outside 1..INT_MAX, or
 * a process not running now, counts as not known). Kept across connects until set again. */
void kv_remote_set_peer(struct kv_remote *kr, uint64_t pid);
/* Sends the commits held back (defer_commits), once the copies they name are complete. Returns 0 or
 * -errno with kr->error set. */
int kv_remote_flush_commits(struct kv_remote *kr);
/* Forgets them (their step failed: its KV is not to be kept; the blocks stay the store's until the
 * session that allocated them ends). */
void kv_remote_drop_commits(struct kv_remote *kr);
/* Hands the blocks allocated ahead back to the kv-store (the runner is idle). Returns 0 or
 * -errno with kr->error set; the stash is empty either way. */
int kv_remote_release_stash(struct kv_remote *kr);
bool kv_remote_owner_alive(const struct kv_remote *kr);
/* Whether the connection needs kv_remote_connect again: the pool's owner is gone, or a request
 * went unanswered. A refusal (MSG_ERROR) leaves the connection good. */
bool kv_remote_lost(const struct kv_remote *kr);

#ifdef __cplusplus
}
#endif
#endif

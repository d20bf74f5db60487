/* loader.h - the weight ring's slots: which group each holds, reads into them, grants to the
 * runner, read-ahead and eviction. Knows nothing of sockets: requests come in as calls and
 * grants go out through callbacks, so tests drive it in-process.
 *
 *   struct loader_ops ops = {.grant = send_grant, .fail = send_error};
 *   struct loader *l;
 *   rc = loader_create(&params, &ops, ctx, &l, err, sizeof(err));
 *   loader_start(l);                           // the resident groups, then read-ahead from group 0
 *   ... when loader_eventfd(l) is readable: loader_process_io(l, false);
 *   loader_hello(l, client, session);          // a client said HELLO
 *   rc = loader_acquire(l, session, &peer, corr, groups, n, release, n_release, err, sizeof(err));
 *   rc = loader_release(l, session, groups, n, err, sizeof(err));
 *   loader_destroy(&l);                        // waits for reads in flight
 *
 * A slot goes EMPTY -> LOADING -> READY; its seq is odd while LOADING. A READY slot whose refs
 * are 0 may be refilled with another group of its class (never a pinned group's slot). The
 * victim is the group whose next use lies farthest ahead of the position in the cyclic visit
 * order (embed, attn 0, ffn 0, ..., head, embed, ...): decode walks the layers in a cycle, so
 * the group just used is the best victim. Groups with waiters and groups inside the
 * read-ahead window (the next k groups of each streaming class from the position, k = the
 * class's streaming slots) are never evicted. Experts (CLASS_EXPERT) have no window: a token's
 * routing chooses a few of each layer's, and a runner asks for those alone, so an expert is read
 * from disk only when an acquire waits for it.
 *
 * The position is the first group of the latest acquire; releasing the group at the
 * position (refs reaching 0) moves it one group on, since the runner is then past it.
 *
 * Not thread-safe: the service loop owns the loader. */
#ifndef SSD_LOADER_LOADER_H
#define SSD_LOADER_LOADER_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/bus.h"
#include "common/manifest.h"
#include "common/protocol.h"
#include "common/weight_ring.h"
#include "services/ssd-loader/plan.h"
#ifdef __cplusplus
extern "C" {
#endif

struct loader;

/* Where the loader's answers go. peer and corr are what the request came with. */
struct loader_ops {
	/* Grant g to peer (MSG_W_GRANT with corr). Return 0, or a negative errno when it could
	 * not be delivered: the grant then takes no reference. */
	int (*grant)(void *ctx, const struct bus_peer *peer, uint64_t corr, const struct msg_w_grant *g);
	/* A waiting acquire failed (MSG_ERROR{code, text} with corr): code is a positive errno. */
	void (*fail)(void *ctx, const struct bus_peer *peer, uint64_t corr, int code, const char *text);
};

struct loader_params {
	const struct manifest *m;  /* borrowed: outlives the loader */
	const struct plan *plan;   /* borrowed: outlives the loader */
	struct wring_header *ring; /* laid out by ring_init for m and plan; borrowed */
	uint64_t ring_bytes;	   /* size of the ring's memory */
	uint32_t io_depth;	   /* reads in flight at most */
	uint64_t max_read;	   /* bytes per read (multiple of 4 KiB) */
	bool buffered;		   /* never O_DIRECT */
	bool inline_issue;	   /* reads issued inline, not from io-wq workers (reader.h) */
};

/* Opens the model's files (reader.h) and checks that every extent fits its slot. Returns 0
 * with *out owned by the caller; -EINVAL for params that do not match; errors of
 * reader_create; err says what. Reads nothing yet. */
int loader_create(const struct loader_params *p, const struct loader_ops *ops, void *ctx, struct loader **out,
		  char *err, size_t errlen);

/* Waits for reads in flight, frees everything; answers nobody. Safe on NULL and twice. */
void loader_destroy(struct loader **l);

/* Starts the first reads: every pinned group in group order, then the read-ahead window. */
void loader_start(struct loader *l);

/* MSG_W_ACQUIRE: applies release[] (refs--), then for each group grants it at once when READY
 * (ops->grant, refs++) or queues a waiter that is granted when its read completes. Returns 0;
 * -EINVAL, with nothing applied, for a group id out of range or a release of a group whose
 * refs are already 0 (err names the group). */
int loader_acquire(struct loader *l, uint64_t session, const struct bus_peer *peer, uint64_t corr,
		   const uint64_t *groups, uint32_t n, const uint64_t *release, uint32_t n_release, char *err, size_t errlen);

/* MSG_W_RELEASE: refs-- for each group. Returns 0; -EINVAL, with nothing applied, as above. */
int loader_release(struct loader *l, uint64_t session, const uint64_t *groups, uint32_t n, char *err, size_t errlen);

/* References are counted per client session (msg_w_acquire.session; 0: a client that names none),
 * at most LOADER_MAX_HOLDERS at once (-EUSERS beyond), and a release must drop a reference of its
 * own session. Several runners (a model's layers split across them) each hold their own. */
#define LOADER_MAX_HOLDERS 16

/* A client said HELLO. A runner ("gpu-runner", "gpu-runner-N") naming a session other than the one
 * its name last held drops that one's references and waiting acquires (it restarted: the new
 * process acquires again what it needs); one that names no session drops those of every session-less
 * client, as when one runner was all there was. Other clients drop nothing. */
void loader_hello(struct loader *l, const char *client, uint64_t session);

/* The eventfd that signals read completions. */
int loader_eventfd(const struct loader *l);

/* Handles read completions (wait: block for at least one if reads are in flight), answers
 * waiters of groups that became READY or failed, starts further reads. Returns the number of
 * reads (extents) completed, or a negative errno from io_uring. */
int loader_process_io(struct loader *l, bool wait);

/* Reads in flight or queued? */
bool loader_io_busy(const struct loader *l);

/* Logs progress of the initial load about once a second, and its end. Call from the tick. */
void loader_tick(struct loader *l);

/* Live tuning. Read-ahead: how many groups of each streaming class are read ahead of the position
 * (the window above), at most read_ahead_max (the streaming slots of the largest class; the
 * default: every streaming slot). A smaller window reads later and evicts sooner; set takes
 * effect at once (a wider window starts its reads). The io limit caps the reads in flight
 * (1..the io_uring depth given at create; reader_set_limit). */
uint32_t loader_read_ahead(const struct loader *l);
uint32_t loader_read_ahead_max(const struct loader *l);
void loader_set_read_ahead(struct loader *l, uint32_t groups);
uint32_t loader_io_limit(const struct loader *l);
uint32_t loader_io_depth(const struct loader *l);
int loader_set_io_limit(struct loader *l, uint32_t reads);

/* Waiting acquires (one per group asked for and not yet granted). */
uint32_t loader_waiters(const struct loader *l);

/* Current position (a group id). */
uint32_t loader_position(const struct loader *l);

/* Whether any file is read with O_DIRECT. */
bool loader_o_direct(const struct loader *l);

/* The stats JSON object (malloc'd text, caller frees; NULL on ENOMEM): groups, slots,
 * all_resident, dram_budget, ring_bytes, model_bytes, bytes_read, reads_done, groups_loaded,
 * grants, releases, waits, o_direct, disk_read_seconds, disk_bytes_per_s, groups_streamed (loads
 * into streaming slots), expert_groups_streamed and expert_bytes_streamed (the same for the
 * expert class: slot bytes read), and a few more. */
char *loader_stats_json(const struct loader *l);

#ifdef __cplusplus
}
#endif
#endif

/* events.h - the runner's copy completions as the kv-store sees them: CUDA IPC events.
 *
 * With a device backend the runner copies a finished KV block into its pool slot
 * asynchronously and records an interprocess event after the copy; the event's handle travels
 * in MSG_KV_COMMIT. The kv-store waits on that event (the runner never does) before it treats
 * the bytes as real and checksums them (docs/architecture.md, KV path). Events are opened once and
 * kept: the runner re-records the same few events rather than creating new ones.
 *
 *   struct kv_events *ev = kv_events_create();
 *   rc = kv_events_wait(ev, handle_bytes, err, sizeof(err));   // 0 once the copy is complete
 *   kv_events_destroy(&ev);
 *
 * Without CUDA in this build, every wait fails with -ENOTSUP and a message that says so.
 */
#ifndef KV_STORE_EVENTS_H
#define KV_STORE_EVENTS_H
#include <stddef.h>
#include <stdint.h>

#include "common/protocol.h"

struct kv_events;

struct kv_events *kv_events_create(void);
void kv_events_destroy(struct kv_events **ev);

/* Waits until the event whose KV_EVENT_HANDLE_BYTES-byte IPC handle is given has completed.
 * Returns 0; -ENOTSUP without CUDA; -ENODEV when no device can be used; -EIO when the handle
 * cannot be opened or the wait fails (err says which). */
int kv_events_wait(struct kv_events *ev, const void *handle, char *err, size_t errlen);

#endif

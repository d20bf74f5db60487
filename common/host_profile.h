/* host_profile.h - a sampling profiler of one thread's CPU time: where a service's host cycles
 * go (a step bound by the host's launches, waits that spin), by program counter.
 *
 * A timer on the calling thread's CPU clock (CLOCK_THREAD_CPUTIME_ID) sends it SIGPROF at the
 * rate asked; the handler counts the interrupted program counter in a fixed table (no
 * allocation, no lock: async-signal-safe). Samples come only while the thread runs (in user
 * space or in a system call), not while it sleeps; a signal that lands in a system call is
 * delivered when the call returns, and a sleep that begins with it pending ends early (EINTR,
 * where SA_RESTART does not restart the call: poll, nanosleep): callers must take EINTR, as
 * the service loop does. The report names each counted address by the module it lies in and
 * its offset there (`addr2line -f -e MODULE OFFSET` names the function,
 * static ones too), with the nearest exported symbol where the dynamic linker knows one. The
 * kernel checks a thread's CPU clock at its scheduler tick, so the rate one gets is at most that
 * (often 250 a second) whatever is asked: profile a second or more of work for a few hundred
 * samples.
 *
 *   host_profile_start(1000, err, sizeof(err));   // on the thread to profile: counts from zero
 *   ...
 *   host_profile_stop();
 *   n = host_profile_top(top, 64, &total);          // any thread, running or stopped
 *
 * One profile per process. */
#ifndef PIPELINE_HOST_PROFILE_H
#define PIPELINE_HOST_PROFILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define HOST_PROFILE_HZ_MAX 10000

struct host_profile_entry {
	const char *module;  /* the file the address lies in ("?": none known, "[vdso]": the kernel's
			      * virtual shared object, no file); static storage */
	uint64_t offset;     /* the address less the module's load address */
	const char *symbol;  /* the nearest exported symbol at or before it, or NULL */
	uint64_t samples;
};

/* Starts (or restarts, counts from zero) sampling the calling thread's CPU time hz times a second
 * (1..HOST_PROFILE_HZ_MAX). Returns 0, or a negative errno with err set. */
int host_profile_start(unsigned hz, char *err, size_t errlen);
/* Stops sampling; the counts stay until the next start. No-op when not running. */
void host_profile_stop(void);
bool host_profile_running(void);
/* The n addresses with the most samples, most first, into out; returns how many. *total: every
 * sample taken since start (those not counted by address, the table full, included). */
size_t host_profile_top(struct host_profile_entry *out, size_t n, uint64_t *total);

#endif

/* host_profile.c - see host_profile.h. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "common/host_profile.h"

#include <dlfcn.h>
#include <link.h>
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#define SLOTS 8192 /* distinct addresses counted (a power of two) */
#define PROBES 64  /* slots tried for one before it counts as lost */

struct slot {
	_Atomic uintptr_t pc;
	_Atomic uint64_t n;
};

static struct slot table[SLOTS];
static _Atomic uint64_t total;
static _Atomic int active; /* the handler counts; the timer exists */
static timer_t timer;

static uintptr_t sample_pc(const void *ucv)
{
	const ucontext_t *uc = ucv;
#if defined(__x86_64__)
	return (uintptr_t)uc->uc_mcontext.gregs[REG_RIP];
#elif defined(__aarch64__)
	return (uintptr_t)uc->uc_mcontext.pc;
#else
	(void)uc;
	return 0;
#endif
}

/* Counts the interrupted address: atomics only, no call that is not async-signal-safe. */
static void on_prof(int sig, siginfo_t *si, void *uc)
{
	(void)sig;
	(void)si;
	if (!atomic_load_explicit(&active, memory_order_relaxed))
		return;
	atomic_fetch_add_explicit(&total, 1, memory_order_relaxed);
	uintptr_t pc = sample_pc(uc);
	if (!pc)
		return;
	size_t h = (size_t)((pc >> 2) * 0x9E3779B97F4A7C15ull) & (SLOTS - 1);
	for (unsigned i = 0; i < PROBES; i++) {
		struct slot *s = &table[(h + i) & (SLOTS - 1)];
		uintptr_t cur = atomic_load_explicit(&s->pc, memory_order_relaxed);
		if (cur == 0) {
			uintptr_t zero = 0;
			if (atomic_compare_exchange_strong(&s->pc, &zero, pc))
				cur = pc;
			else
				cur = zero; /* taken meanwhile: by this address or another */
		}
		if (cur == pc) {
			atomic_fetch_add_explicit(&s->n, 1, memory_order_relaxed);
			return;
		}
	}
}

bool host_profile_running(void)
{
	return atomic_load(&active) != 0;
}

void host_profile_stop(void)
{
	if (!atomic_load(&active))
		return;
	timer_delete(timer);
	atomic_store(&active, 0);
}

int host_profile_start(unsigned hz, char *err, size_t errlen)
{
	if (hz < 1 || hz > HOST_PROFILE_HZ_MAX) {
		snprintf(err, errlen, "host profile: %u samples a second is out of range (1..%d)", hz,
			 HOST_PROFILE_HZ_MAX);
		return -EINVAL;
	}
#if !defined(__x86_64__) && !defined(__aarch64__)
	snprintf(err, errlen, "host profile: reading the program counter is not supported on this CPU");
	return -ENOTSUP;
#endif
	host_profile_stop();
	for (size_t i = 0; i < SLOTS; i++) {
		atomic_store(&table[i].pc, 0);
		atomic_store(&table[i].n, 0);
	}
	atomic_store(&total, 0);
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_sigaction = on_prof;
	sa.sa_flags = SA_SIGINFO | SA_RESTART;
	sigemptyset(&sa.sa_mask);
	if (sigaction(SIGPROF, &sa, NULL) != 0) {
		int e = errno;
		snprintf(err, errlen, "host profile: installing the SIGPROF handler: %s", strerror(e));
		return -e;
	}
	struct sigevent sev;
	memset(&sev, 0, sizeof(sev));
	sev.sigev_notify = SIGEV_THREAD_ID;
	sev.sigev_signo = SIGPROF;
#ifdef sigev_notify_thread_id
	sev.sigev_notify_thread_id = (pid_t)syscall(SYS_gettid);
#else
	sev._sigev_un._tid = (pid_t)syscall(SYS_gettid);
#endif
	if (timer_create(CLOCK_THREAD_CPUTIME_ID, &sev, &timer) != 0) {
		int e = errno;
		snprintf(err, errlen, "host profile: a timer on this thread's CPU clock: %s", strerror(e));
		return -e;
	}
	long ns = 1000000000L / (long)hz;
	struct itimerspec its = {.it_interval = {ns / 1000000000L, ns % 1000000000L},
				 .it_value = {ns / 1000000000L, ns % 1000000000L}};
	atomic_store(&active, 1);
	if (timer_settime(timer, 0, &its, NULL) != 0) {
		int e = errno;
		atomic_store(&active, 0);
		timer_delete(timer);
		snprintf(err, errlen, "host profile: arming the timer: %s", strerror(e));
		return -e;
	}
	return 0;
}

/* The load bias of the object whose loaded segment holds pc: what addr2line's offsets are
 * relative to (the load address of a shared object or a position-independent program; 0 for a
 * program linked at fixed addresses). */
struct bias_find {
	uintptr_t pc, bias;
	bool found;
};

static int bias_of(struct dl_phdr_info *info, size_t size, void *arg)
{
	(void)size;
	struct bias_find *f = arg;
	for (int i = 0; i < info->dlpi_phnum; i++) {
		const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
		uintptr_t lo = (uintptr_t)info->dlpi_addr + (uintptr_t)ph->p_vaddr;
		if (ph->p_type == PT_LOAD && f->pc >= lo && f->pc - lo < (uintptr_t)ph->p_memsz) {
			f->bias = (uintptr_t)info->dlpi_addr;
			f->found = true;
			return 1;
		}
	}
	return 0;
}

static int by_samples(const void *a, const void *b)
{
	const struct host_profile_entry *x = a, *y = b;
	return x->samples < y->samples ? 1 : x->samples > y->samples ? -1 : 0;
}

size_t host_profile_top(struct host_profile_entry *out, size_t n, uint64_t *total_out)
{
	*total_out = atomic_load(&total);
	struct host_profile_entry *all = malloc(SLOTS * sizeof(*all));
	if (!all)
		return 0;
	size_t m = 0;
	for (size_t i = 0; i < SLOTS; i++) {
		uintptr_t pc = atomic_load(&table[i].pc);
		uint64_t c = atomic_load(&table[i].n);
		if (!pc || !c)
			continue;
		all[m].samples = c;
		all[m].offset = pc; /* resolved below, once sorted */
		m++;
	}
	qsort(all, m, sizeof(*all), by_samples);
	if (m > n)
		m = n;
	for (size_t i = 0; i < m; i++) {
		uintptr_t pc = (uintptr_t)all[i].offset;
		Dl_info info;
		out[i] = all[i];
		out[i].module = "?";
		out[i].symbol = NULL;
		if (dladdr((void *)pc, &info) && info.dli_fname) {
			/* The vDSO is no file: its name ("linux-vdso.so.1") as /proc/PID/maps gives it. */
			const bool vdso = info.dli_fbase && (uintptr_t)info.dli_fbase == getauxval(AT_SYSINFO_EHDR);
			out[i].module = vdso ? "[vdso]" : info.dli_fname[0] ? info.dli_fname : "(main program)";
			struct bias_find f = {.pc = pc};
			dl_iterate_phdr(bias_of, &f);
			out[i].offset = pc - (f.found ? f.bias : (uintptr_t)info.dli_fbase);
			if (info.dli_sname && info.dli_saddr && (uintptr_t)info.dli_saddr <= pc)
				out[i].symbol = info.dli_sname;
		}
	}
	free(all);
	return m;
}

/* health.c - is a service ready, and is it still alive: HELLO after each start (never blocking
 * the loop), the heartbeats on the services' .pub sockets, and the hang verdict from /proc for
 * one that went silent, with gpu-runner's grace while a peer it waits for is down. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "common/proc.h"
#include "common/service.h"
#include "common/util.h"
#include "tools/supervisor/daemon_internal.h"

/* gpu-runner waits for a peer that went away up to its own --timeout-ms (it beats meanwhile, with
 * service_beat; the grace stays for a runner that is silent anyway): it is not judged hung while
 * kv-store or ssd-loader is down after having been up, nor for peer_grace_ms after both answer
 * again. */
void runner_peer_down(struct sup *sup)
{
	for (int i = SUP_GPU_RUNNER; i < sup->n; i++)
		if (sup->s[i].kind == SUP_GPU_RUNNER)
			sup->s[i].grace_until_ns = UINT64_MAX;
}

static void runner_peer_up(struct sup *sup, uint64_t now)
{
	bool peers_up = sup->s[SUP_KV_STORE].state == SVC_UP && sup->s[SUP_SSD_LOADER].state == SVC_UP;
	for (int i = SUP_GPU_RUNNER; i < sup->n; i++) {
		struct svc *r = &sup->s[i];
		if (r->kind == SUP_GPU_RUNNER && peers_up && r->grace_until_ns == UINT64_MAX)
			r->grace_until_ns = now + (uint64_t)sup->cfg->peer_grace_ms * NS_PER_MS;
	}
}

static void svc_mark_up(struct sup *sup, struct svc *v, const struct msg_hello_reply *h, uint64_t now)
{
	v->state = SVC_UP;
	v->ever_up = true;
	v->failed_starts = 0; /* it came up: the starts before it are no run of failures now */
	v->up_ns = now;
	v->epoch = h->epoch;
	v->service_pid = (int)h->pid;
	/* The hang clock starts now: the first heartbeat is due within a period. */
	v->last_beat_ns = now;
	v->check_ns = now;
	struct proc_info pi;
	v->cpu_mark = proc_read(v->service_pid, &pi) == 0 ? pi.cpu_ticks : 0;
	v->busy = false;
	log_info("%s is up (pid %d%s, epoch %016llx) after %.2f s", v->name, v->pid, v->wrapped ? ", under a wrapper" : "",
		 (unsigned long long)v->epoch, ns_to_s(now - v->started_ns));
	if (v->kind == SUP_KV_STORE || v->kind == SUP_SSD_LOADER)
		runner_peer_up(sup, now);
}

/* Is the process that answered HELLO (pid) the one we started? Without a wrapper it must be that
 * very process; under a wrapper, one in its process group. Another answer comes from a process
 * that holds the socket while ours fails to bind. */
static bool hello_from_ours(const struct svc *v, int pid)
{
	if (pid == v->pid)
		return true;
	struct proc_info pi;
	return v->wrapped && proc_read(pid, &pi) == 0 && pi.pgrp == v->pid;
}

void svc_check_ready(struct sup *sup, struct svc *v, uint64_t now)
{
	if (v->state != SVC_STARTING || !v->pid || v->kill_reason != KILL_NONE)
		return;
	if (v->hello_pending) {
		struct msg rep;
		int rc = rpc_wait(v->rpc, v->hello_corr, &rep, 0);
		if (rc == 0 && rep.type == MSG_HELLO_REPLY && rep.hello_reply.service.p &&
		    !strcmp(rep.hello_reply.service.p, v->name)) {
			v->hello_pending = false;
			if (hello_from_ours(v, (int)rep.hello_reply.pid)) {
				svc_mark_up(sup, v, &rep.hello_reply, now);
			} else if (!v->hello_pid_warned) {
				v->hello_pid_warned = true;
				log_warn("%s.ctl is answered by pid %llu, not by the %s we started (pid %d): waiting for ours",
					 v->name, (unsigned long long)rep.hello_reply.pid, v->name, v->pid);
			}
		} else if (rc == 0) {
			v->hello_pending = false;
			log_warn("%s answered HELLO with %s from '%s': ignored", v->name, msg_type_name(rep.type),
				 rep.type == MSG_HELLO_REPLY && rep.hello_reply.service.p ? rep.hello_reply.service.p : "");
		} else if (rc == -EREMOTEIO) {
			v->hello_pending = false;
			snprintf(v->last_error, sizeof(v->last_error), "answered HELLO with an error: %s",
				 rep.error.text.p ? rep.error.text.p : "(no text)");
			log_error("%s (pid %d) %s: killing it", v->name, v->pid, v->last_error);
			v->kill_reason = KILL_HELLO_ERROR;
			svc_signal(v, SIGKILL);
		} else if (rc != -ETIMEDOUT || now - v->hello_sent_ns > HELLO_RETRY_MS * NS_PER_MS) {
			/* Sent before the service bound its socket, or lost: again, on a fresh socket. */
			v->hello_pending = false;
			rpc_client_reset(v->rpc);
		}
		msg_free(&rep);
	}
	if (v->state != SVC_STARTING || v->kill_reason != KILL_NONE)
		return;
	if (!v->hello_pending) {
		struct msg req;
		msg_init(&req, MSG_HELLO, 0);
		req.hello.client.p = "pipeline-supervisor";
		req.hello.client.len = (uint32_t)strlen(req.hello.client.p);
		req.hello.proto = PROTO_VERSION;
		if (rpc_send(v->rpc, &req, &v->hello_corr) == 0) {
			v->hello_pending = true;
			v->hello_sent_ns = now;
		}
	}
	if (now - v->started_ns > (uint64_t)sup->cfg->ready_timeout_s * 1000000000ull) {
		snprintf(v->last_error, sizeof(v->last_error), "did not answer HELLO within %ld s of its start",
			 sup->cfg->ready_timeout_s);
		log_error("%s (pid %d) %s: killing it", v->name, v->pid, v->last_error);
		v->kill_reason = KILL_READY;
		svc_signal(v, SIGKILL);
	}
}

static void on_heartbeat(struct sup *sup, const struct msg_heartbeat *hb, uint64_t now)
{
	int i = sup->n;
	while (hb->service.p && i-- > 0 && strcmp(sup->s[i].name, hb->service.p))
		;
	if (!hb->service.p || i < 0) {
		log_debug("a heartbeat from an unknown service '%s': ignored", hb->service.p ? hb->service.p : "");
		return;
	}
	struct svc *v = &sup->s[i];
	/* Only the process that answered HELLO counts: a beat of an earlier epoch (or one sent before
	 * HELLO) says nothing about it. */
	if (v->state != SVC_UP || hb->epoch != v->epoch) {
		log_debug("%s: a heartbeat of epoch %016llx, not %016llx: ignored", v->name,
			  (unsigned long long)hb->epoch, (unsigned long long)v->epoch);
		return;
	}
	if (v->busy)
		log_info("%s beats again after %.1f s", v->name, ns_to_s(now - v->last_beat_ns));
	v->last_beat_ns = now;
	v->check_ns = now;
	v->beats++;
	v->busy = false;
	struct proc_info pi;
	if (proc_read(v->service_pid, &pi) == 0)
		v->cpu_mark = pi.cpu_ticks;
}

void drain_heartbeats(struct sup *sup, uint64_t now)
{
	for (int n = 0; n < 1024; n++) {
		struct msg m;
		char err[256];
		int rc = bus_recv(sup->sub, &m, 0, err, sizeof(err));
		if (rc == -ETIMEDOUT)
			return;
		if (rc == -EINTR)
			continue;
		if (rc == -EBADMSG || rc == -ENOMSG || rc == -EPROTONOSUPPORT) {
			log_warn("a notification on a service's .pub does not decode: %s", err);
			continue;
		}
		if (rc) {
			log_warn("receiving heartbeats failed: %s", strerror(-rc));
			return;
		}
		if (m.type == MSG_HEARTBEAT)
			on_heartbeat(sup, &m.heartbeat, now);
		msg_free(&m);
	}
}

/* A service counts as hung when it has sent no heartbeat for hang_periods periods while its
 * process exists and either is stopped (SIGSTOP, a debugger) or sleeps having used no CPU time
 * since the last check (deadlocked, blocked). One that computes without beating (a long forward
 * step), waits to run, or waits for the disk is busy, not hung: it is looked at again a hang time
 * later. So a stopped process is found after hang_periods periods; a blocked one after one to two
 * hang times (it may have used CPU between its last beat and blocking). */
void svc_check_hang(struct sup *sup, struct svc *v, uint64_t now)
{
	if (v->state != SVC_UP || v->kill_reason != KILL_NONE || sup->cfg->hang_periods <= 0)
		return;
	uint64_t limit = hang_ns(sup);
	if (now - v->check_ns <= limit)
		return;
	if (v->kind == SUP_GPU_RUNNER && now < v->grace_until_ns)
		return;
	struct proc_info pi;
	int pid = v->service_pid > 0 ? v->service_pid : v->pid;
	if (proc_read(pid, &pi) != 0 && proc_read(v->pid, &pi) != 0)
		return; /* gone: its exit is reaped next */
	char st = pi.state;
	uint64_t ticks = pi.cpu_ticks;
	const char *how;
	if (st == 'T' || st == 't') {
		how = "its process is stopped";
	} else if (ticks > v->cpu_mark || st == 'R' || st == 'D') {
		if (!v->busy)
			log_info("%s has sent no heartbeat for %.1f s but is using CPU: busy, not hung", v->name,
				 ns_to_s(now - v->last_beat_ns));
		v->busy = true;
		v->cpu_mark = ticks;
		v->check_ns = now;
		return;
	} else {
		how = "it used no CPU time meanwhile";
	}
	snprintf(v->last_error, sizeof(v->last_error), "hung: no heartbeat for %.1f s (the limit is %.1f s) and %s; killed",
		 ns_to_s(now - v->last_beat_ns), ns_to_s(limit), how);
	log_warn("%s (pid %d) is hung: no heartbeat for %.1f s (the limit is %.1f s) and %s: killing it", v->name,
		 v->pid, ns_to_s(now - v->last_beat_ns), ns_to_s(limit), how);
	v->kill_reason = KILL_HANG;
	svc_signal(v, SIGKILL);
}

/* stop.c - ending a service on purpose: a restart asked for by the operator (the marker file,
 * SIGTERM, started again at once), and the stop of the instance, one service at a time in the
 * stop order down the stop ladder (supervisor.h), with the deadlines that end in SIGKILL. */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include "common/log.h"
#include "common/service.h"
#include "tools/supervisor/daemon_internal.h"

static void request_restart(struct sup *sup, struct svc *v, uint64_t now)
{
	if (sup->phase == PHASE_STOPPING) {
		log_info("a restart of %s was asked for while stopping: ignored", v->name);
		return;
	}
	log_info("a restart of %s was asked for (it is %s)", v->name, svc_state_names[v->state]);
	switch (v->state) {
	case SVC_STARTING:
	case SVC_UP:
		if (v->requested)
			return;
		v->requested = true;
		if (v->kill_reason == KILL_NONE) {
			/* SIGTERM: the service exits and leaves its shared state to its successor. */
			svc_signal(v, SIGTERM);
			v->kill_deadline_ns = now + (uint64_t)sup->cfg->stop_timeout_s * 1000000000ull;
		}
		return;
	case SVC_RESTARTING:
	case SVC_FAILED:
	case SVC_STOPPED:
		/* Asked for by the operator: the burst limit starts over. */
		v->n_history = 0;
		v->failed_starts = 0;
		svc_launch(sup, v, "restart asked for");
		return;
	}
}

/* <run-dir>/<service>.restart asks for a restart; removing it is how the supervisor takes the
 * request (and tells the asker it did). */
void check_markers(struct sup *sup, uint64_t now)
{
	char path[PATH_MAX];
	for (int i = 0; i < sup->n; i++) {
		path_of(sup, sup->s[i].name, "restart", path, sizeof(path));
		if (unlink(path) == 0)
			request_restart(sup, &sup->s[i], now);
	}
}

void begin_stop(struct sup *sup, const char *why)
{
	if (sup->phase == PHASE_STOPPING)
		return;
	log_info("stopping the services (%s)", why);
	sup->phase = PHASE_STOPPING;
	sup->stop_index = 0;
	for (int i = 0; i < sup->n; i++) {
		struct svc *v = &sup->s[i];
		if (!v->pid && v->state != SVC_FAILED)
			v->state = SVC_STOPPED;
	}
}

/* Stops the services one at a time, gpu-runner first (it holds weight groups and KV blocks of the
 * others), with MSG_SHUTDOWN (the service removes its shared state), SIGTERM when that is not
 * answered; SIGKILL comes from the deadline check. */
void stop_step(struct sup *sup, uint64_t now)
{
	while (sup->stop_index < sup->n) {
		struct svc *v = &sup->s[sup_stop_order(sup->n, sup->stop_index)];
		if (!v->pid) {
			sup->stop_index++;
			continue;
		}
		if (v->kill_reason != KILL_STOP) {
			v->kill_reason = KILL_STOP;
			v->requested = false;
			v->kill_deadline_ns = now + (uint64_t)sup->cfg->stop_timeout_s * 1000000000ull;
			struct msg req;
			msg_init(&req, MSG_SHUTDOWN, 0);
			if (v->state == SVC_UP && rpc_send(v->rpc, &req, &v->shutdown_corr) == 0) {
				v->shutdown_pending = true;
				v->shutdown_sent_ns = now;
				log_info("asked %s (pid %d) to shut down", v->name, v->pid);
			} else {
				log_info("stopping %s (pid %d, %s) with SIGTERM", v->name, v->pid, svc_state_names[v->state]);
				svc_signal(v, SIGTERM);
				svc_signal(v, SIGCONT); /* a stopped one takes its SIGTERM only once continued */
			}
		} else if (v->shutdown_pending) {
			struct msg rep;
			int rc = rpc_wait(v->rpc, v->shutdown_corr, &rep, 0);
			if (rc == 0 && rep.type == MSG_OK) {
				v->shutdown_pending = false;
			} else if (rc != -ETIMEDOUT || now - v->shutdown_sent_ns > SUP_SHUTDOWN_ANSWER_MS * NS_PER_MS) {
				v->shutdown_pending = false;
				log_warn("%s (pid %d) did not acknowledge MSG_SHUTDOWN: SIGTERM", v->name, v->pid);
				svc_signal(v, SIGTERM);
				svc_signal(v, SIGCONT); /* stopped (SIGSTOP), it could not answer either */
			}
			msg_free(&rep);
		}
		return;
	}
	sup->done = true;
}

void check_deadlines(struct sup *sup, uint64_t now)
{
	for (int i = 0; i < sup->n; i++) {
		struct svc *v = &sup->s[i];
		if (v->pid && v->kill_deadline_ns && now > v->kill_deadline_ns) {
			log_warn("%s (pid %d) did not exit in %ld s: SIGKILL", v->name, v->pid, sup->cfg->stop_timeout_s);
			v->kill_deadline_ns = 0;
			svc_signal(v, SIGKILL);
		}
		if (v->state == SVC_RESTARTING && now >= v->restart_at_ns && sup->phase != PHASE_STOPPING) {
			char why[600];
			snprintf(why, sizeof(why), "restart %u after: %s", v->restarts + 1, v->last_error);
			svc_launch(sup, v, why);
		}
	}
}

#!/usr/bin/env bash
# restart: each service restarted alone (SIGTERM, start again with the saved options) while
# the others keep running; generation afterwards gives the same tokens as before.
source "$(dirname "$0")/lib.sh"
it_setup restart

# Small KV tiers, so the kv-store that is restarted holds a pool worth adopting.
"$PIPELINE" start --model "$MODEL" --kv-gpu-budget 32KiB --kv-dram-budget 32KiB --runner-opt=--prefill-chunk=16
first=$(generate --tokens "$PROMPT" -n 64)
expect_words 64 "$first" "tokens before any restart"
expect_eq "$first" "$(run_local --tokens "$PROMPT" -n 64)" "tokens before any restart vs run-local"

pid_of() { cat "$RUN_DIR/$1.pid"; }

for service in kv-store ssd-loader gpu-runner; do
	before=$(pid_of "$service")
	others=$(for s in kv-store ssd-loader gpu-runner; do [[ $s == "$service" ]] || pid_of "$s"; done | tr '\n' ' ')
	"$PIPELINE" restart "$service"
	after=$(pid_of "$service")
	[[ $after != "$before" ]] || fail "restart $service: the pid stayed $before"
	proc_gone "$before" || fail "restart $service: the old process $before still runs"
	now=$(for s in kv-store ssd-loader gpu-runner; do [[ $s == "$service" ]] || pid_of "$s"; done | tr '\n' ' ')
	expect_eq "$now" "$others" "pids of the other services across restart $service"
	got=$(generate --tokens "$PROMPT" -n 64)
	expect_eq "$got" "$first" "tokens after restart $service"
	log "restart $service: pid $before -> $after, tokens unchanged"
done
"$PIPELINE" status >/dev/null || fail "status after the restarts does not report all services up"
# A service this instance does not run (one runner, no --http): refused at once, not after the
# wait for it to come back.
for service in gpu-runner-3 http-api; do
	rc=0
	out=$("$PIPELINE" restart "$service" 2>&1) || rc=$?
	expect_eq "$rc" 1 "restart $service of an instance that does not run it: its exit status"
	expect_grep "runs no $service" "$out" "restart $service of an instance that does not run it"
	# The supervisor's own status for it: 3, not 2 (a usage error).
	rc=0
	"$BIN/pipeline-supervisor" restart "$service" --run-dir "$RUN_DIR" >/dev/null 2>&1 || rc=$?
	expect_eq "$rc" 3 "pipeline-supervisor restart $service: its exit status"
done

# The timeouts from the environment are whole seconds, never evaluated: a bad one is refused
# before anything restarts (bash arithmetic on the raw text ran what it held).
for bad in 10s 'BASH_VERSINFO[$(touch '"$IT_TMP"'/ran)0]'; do
	rc=0
	out=$(PIPELINE_READY_TIMEOUT=$bad "$PIPELINE" restart kv-store 2>&1) || rc=$?
	expect_eq "$rc" 2 "restart with PIPELINE_READY_TIMEOUT=$bad: its exit status"
	expect_grep "PIPELINE_READY_TIMEOUT=.*seconds in 1..604800" "$out" "restart with PIPELINE_READY_TIMEOUT=$bad"
done
[[ ! -e $IT_TMP/ran ]] || fail "PIPELINE_READY_TIMEOUT's text was run by restart"

# Another instance's name with this run directory (one PIPELINE_RUN_DIR for every instance):
# refused, this instance left running (stop stopped it, saying the other was stopped).
for cmd in status stop; do
	rc=0
	out=$("$PIPELINE" --instance "$INSTANCE-other" "$cmd" 2>&1) || rc=$?
	expect_eq "$rc" 1 "$cmd of another instance in this run directory: its exit status ($out)"
	expect_grep "is instance $INSTANCE's, not $INSTANCE-other's" "$out" "$cmd of another instance in this run directory"
done
"$PIPELINE" status >/dev/null || fail "the instance after another's status and stop were refused in its run directory"

# The run directory spelled another way (a trailing slash) is the same instance's.
out=$("$BIN/pipeline-supervisor" pids supervisor --run-dir "$RUN_DIR/") ||
	fail "pipeline-supervisor pids with the run directory and a trailing slash found no supervisor"
expect_eq "$out" "$(cat "$RUN_DIR/supervisor.pid")" "the supervisor's pid with the run directory and a trailing slash"

"$PIPELINE" stop
expect_nothing_left "after stop"

# A restart of the runner while its peers still come up (it is not launched yet): the request
# launches it, and restart says so with status 0 (it waited for a restart count that a first
# launch does not move, and failed after its timeout though the runner was up).
cat >"$IT_TMP/slow" <<'WRAP'
#!/bin/sh
sleep 2
exec "$@"
WRAP
chmod +x "$IT_TMP/slow"
PIPELINE_WRAP_SSD_LOADER=$IT_TMP/slow "$PIPELINE" start --model "$MODEL" >"$IT_TMP/start" 2>&1 &
sp=$!
runner_waits() { [[ $(sup_field gpu-runner launches) == 0 ]]; }
wait_until 20 "a supervisor whose runner waits for its peers" runner_waits
rc=0
out=$("$PIPELINE" restart gpu-runner 2>&1) || rc=$?
expect_eq "$rc" 0 "restart of a runner not launched yet: its exit status ($out)"
expect_grep "gpu-runner (started|restarted)" "$out" "restart of a runner not launched yet"
wait "$sp" || fail "the start beside the restart failed: $(cat "$IT_TMP/start")"
"$PIPELINE" status >/dev/null || fail "status after a restart of a runner not launched yet"
"$PIPELINE" stop >/dev/null
expect_nothing_left "after the last stop"
log "ok"

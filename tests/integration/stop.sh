#!/usr/bin/env bash
# stop: after stop no process of the instance, no shared-memory object, no socket, no pid
# file; the logs stay. Stopping a stopped instance says so and succeeds; status fails. A tree
# that does not build still lets one see and stop an instance.
source "$(dirname "$0")/lib.sh"
it_setup stop

"$PIPELINE" start --model "$MODEL"
expect_words 8 "$(generate --tokens "$PROMPT" -n 8)" "generation"
[[ -n $(instance_shm) ]] || fail "no shared-memory object while the instance runs (the test looks in the wrong place)"
[[ -n $(instance_pids) ]] || fail "no process found while the instance runs (the test looks in the wrong place)"
# A second supervisor for the same run directory (run directly: the script's start lock does not
# see it) is refused at once, and the first one stays reachable (it used to bind over the first's
# sockets and remove them on its way out).
rc=0
out=$("$BIN/pipeline-supervisor" --instance "$INSTANCE" --run-dir "$RUN_DIR" --bin-dir "$BIN" --foreground 2>&1) || rc=$?
((rc != 0)) || fail "a second supervisor of the instance ran: $out"
expect_grep "another supervisor runs for" "$out" "a second supervisor: the message"
"$PIPELINE" status >/dev/null || fail "the instance's supervisor is unreachable after a second one was refused"
# cleanup beside a live supervisor: refused, its files left (it removed them, and the supervisor
# ran on unreachable).
rc=0
out=$("$BIN/pipeline-supervisor" cleanup --instance "$INSTANCE" --run-dir "$RUN_DIR" 2>&1) || rc=$?
((rc != 0)) || fail "cleanup beside a live supervisor succeeded: $out"
expect_grep "a supervisor runs for" "$out" "cleanup beside a live supervisor: the message"
"$PIPELINE" status >/dev/null || fail "the instance's supervisor is unreachable after a refused cleanup"

out=$("$PIPELINE" stop)
expect_grep "instance $INSTANCE stopped .*logs kept in $RUN_DIR" "$out" "stop's message"
expect_nothing_left "after stop"
for s in kv-store ssd-loader gpu-runner; do
	[[ -s $RUN_DIR/$s.log ]] || fail "the log of $s is gone after stop"
done
[[ ! -e $RUN_DIR/kv-spill.bin ]] || fail "the kv-store's spill file is left after stop"

out=$("$PIPELINE" stop)
expect_grep "instance $INSTANCE is not running" "$out" "stop of a stopped instance"
rc=0
"$PIPELINE" status >/dev/null || rc=$?
((rc != 0)) || fail "status of a stopped instance succeeded"

# A stop timeout the supervisor would refuse: refused before anything stops (exit 2), the
# instance still running; then the stop goes on as asked.
"$PIPELINE" start --model "$MODEL" >/dev/null
rc=0
out=$(PIPELINE_STOP_TIMEOUT=20s "$PIPELINE" stop 2>&1) || rc=$?
expect_eq "$rc" 2 "stop with PIPELINE_STOP_TIMEOUT=20s: its exit status"
expect_grep "PIPELINE_STOP_TIMEOUT=20s" "$out" "stop with PIPELINE_STOP_TIMEOUT=20s: the message"
"$PIPELINE" status >/dev/null || fail "the instance stopped by a stop that was refused"
rc=0
PIPELINE_STOP_TIMEOUT=7200 "$PIPELINE" stop >/dev/null 2>&1 || rc=$?
expect_eq "$rc" 2 "stop with PIPELINE_STOP_TIMEOUT=7200: its exit status"
out=$(PIPELINE_STOP_TIMEOUT=5 "$PIPELINE" stop)
expect_grep "instance $INSTANCE stopped" "$out" "stop with PIPELINE_STOP_TIMEOUT=5"
expect_nothing_left "stop with a stop timeout of 5 s"

# Two starts of one instance at the same moment: one runs it, the other is refused (both failed:
# the second's failure path stopped the first's supervisor).
rc1=0
rc2=0
"$PIPELINE" start --model "$MODEL" >"$IT_TMP/start1" 2>&1 &
p1=$!
"$PIPELINE" start --model "$MODEL" >"$IT_TMP/start2" 2>&1 &
p2=$!
wait "$p1" || rc1=$?
wait "$p2" || rc2=$?
both=$(cat "$IT_TMP/start1" "$IT_TMP/start2")
(((rc1 == 0) + (rc2 == 0) == 1)) || fail "two starts at once: exit statuses $rc1 and $rc2, want one 0: $both"
expect_grep "being started by another command|already running" "$both" "two starts at once: the refused one"
"$PIPELINE" status >/dev/null || fail "the instance after two starts at once does not run"
"$PIPELINE" stop >/dev/null

# A stop while a start is under way (start.args is written once the start holds its lock): it
# waits for the start to end and then stops what it started, nothing left (it used to stop beside
# the start, which left a supervisor running where no command found it).
"$PIPELINE" start --model "$MODEL" >"$IT_TMP/start3" 2>&1 &
p3=$!
args_written() { [[ -e $RUN_DIR/start.args ]]; }
wait_until 30 "the start under way" args_written
rc=0
out=$("$PIPELINE" stop 2>&1) || rc=$?
wait "$p3" || fail "the start the stop waited for failed: $(cat "$IT_TMP/start3")"
expect_eq "$rc" 0 "a stop while a start is under way: its exit status ($out)"
expect_nothing_left "a stop while a start was under way"
rc=0
"$PIPELINE" status >/dev/null 2>&1 || rc=$?
((rc != 0)) || fail "the instance runs after a stop that waited for its start"

# PIPELINE_STOP_TIMEOUT as start takes it: checked as stop checks it, before anything starts (a bad
# one, exit 2), and 0 taken (the supervisor refused it and start failed with status 1).
rc=0
out=$(PIPELINE_STOP_TIMEOUT=soon "$PIPELINE" start --model "$MODEL" 2>&1) || rc=$?
expect_eq "$rc" 2 "start with PIPELINE_STOP_TIMEOUT=soon: its exit status ($out)"
expect_grep "PIPELINE_STOP_TIMEOUT=soon" "$out" "start with PIPELINE_STOP_TIMEOUT=soon: the message"
[[ -z $(instance_pids) ]] || fail "start with a bad PIPELINE_STOP_TIMEOUT left processes: $(instance_pids)"
PIPELINE_STOP_TIMEOUT=0 "$PIPELINE" start --model "$MODEL" >/dev/null || fail "start with PIPELINE_STOP_TIMEOUT=0 failed"
"$PIPELINE" stop >/dev/null
expect_nothing_left "an instance started with PIPELINE_STOP_TIMEOUT=0"

# A stop with a shorter stop timeout than the instance was started with waits as long as the
# instance's own stops may take (its status says how long): the status carries it.
PIPELINE_STOP_TIMEOUT=40 "$PIPELINE" start --model "$MODEL" >/dev/null
expect_eq "$(sup_status | jq -r .supervisor.stop_timeout_s)" 40 "the status's stop_timeout_s"
"$PIPELINE" stop >/dev/null
expect_nothing_left "a stop of an instance started with PIPELINE_STOP_TIMEOUT=40"

# The supervisor stopped by SIGTERM itself (as systemd stops it) while a service is stopped
# (SIGSTOP): the service is continued with its SIGTERM, so the stop takes seconds, not the stop
# timeout, and what the services leave is removed as a client's stop removes it.
PIPELINE_STOP_TIMEOUT=60 "$PIPELINE" start --model "$MODEL" >/dev/null
kv_pid=$(sup_field kv-store pid)
sup_pid=$(cat "$RUN_DIR/supervisor.pid")
kill -STOP "$kv_pid"
t0=$SECONDS
kill -TERM "$sup_pid"
sup_gone() { ! kill -0 "$sup_pid" 2>/dev/null; }
wait_until 30 "the supervisor's own stop with kv-store stopped" sup_gone
((SECONDS - t0 < 30)) || fail "the supervisor's own stop took $((SECONDS - t0)) s (the stop timeout is 60)"
expect_nothing_left "the supervisor's own stop"
expect_nothing_left "stop after two starts at once"

# A killed service leaves its shared state: stop removes that too.
"$PIPELINE" start --model "$MODEL" >/dev/null
kill -KILL "$(cat "$RUN_DIR/kv-store.pid")"
"$PIPELINE" stop >/dev/null
expect_nothing_left "stop after kv-store was killed"

# stop waits by the stop timeout the instance was started with where the caller sets none (it took
# the default 10 s: a start's longer timeout, for a sanitizer's report, was cut short at stop).
PIPELINE_STOP_TIMEOUT=2 "$PIPELINE" start --model "$MODEL" >/dev/null
kv_pid=$(cat "$RUN_DIR/kv-store.pid")
kill -STOP "$kv_pid"
(unset PIPELINE_STOP_TIMEOUT && "$PIPELINE" stop >/dev/null 2>&1) || true
expect_grep "kv-store \\(pid $kv_pid\\) did not exit in 2 s: SIGKILL" "$(cat "$RUN_DIR/supervisor.log")" \
	"stop of an instance started with PIPELINE_STOP_TIMEOUT=2"
expect_nothing_left "stop by the instance's stop timeout"
log "stop: the instance's own stop timeout (2 s) where the caller sets none"

# A tree that does not build still lets one see, restart a service of, and stop an instance: only
# start and demo build (here a cmake that always fails, with every package found installed, and
# setup on).
FAKE=$IT_TMP/fake-bin
mkdir -p "$FAKE"
printf '#!/bin/sh\necho "cmake: this tree does not build (a test)" >&2\nexit 1\n' >"$FAKE/cmake"
printf '#!/bin/sh\nprintf "install ok installed"\n' >"$FAKE/dpkg-query"
chmod +x "$FAKE/cmake" "$FAKE/dpkg-query"
"$PIPELINE" start --model "$MODEL" >/dev/null
unbuilt() { PATH=$FAKE:$PATH PIPELINE_SKIP_SETUP=0 "$PIPELINE" "$@"; }
rc=0
out=$(unbuilt start --model "$MODEL" 2>&1) || rc=$?
((rc == 1)) || fail "start with a tree that does not build: exit $rc, not 1: $out"
expect_grep "the build in .* failed" "$out" "start with a tree that does not build"
unbuilt status >/dev/null || fail "status with a tree that does not build (the instance runs)"
unbuilt restart kv-store >/dev/null || fail "restart kv-store with a tree that does not build"
unbuilt stop >/dev/null || fail "stop with a tree that does not build"
expect_nothing_left "stop with a tree that does not build"
log "a tree that does not build: start refused; status, restart kv-store and stop work"
log "ok"

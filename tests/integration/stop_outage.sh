#!/usr/bin/env bash
# stop_outage: `pipeline stop` while gpu-runner waits for a peer that is down (ssd-loader
# killed), or alive and silent (kv-store stopped). The runner waits
# up to 30 s for ssd-loader to come back, beating its heartbeat; it cannot answer MSG_SHUTDOWN
# there, so the supervisor sends SIGTERM after 5 s, and the wait must give up at once: the
# request ends with an error naming the stop and the runner exits, before the stop timeout's
# SIGKILL (10 s). ssd-loader is kept down by a long restart backoff (the supervisor would
# otherwise start it again at once).
source "$(dirname "$0")/lib.sh"
it_setup stop_outage

"$PIPELINE" start --model "$MODEL" --supervisor-opt=--backoff-min-ms=60000 \
	--supervisor-opt=--backoff-max-ms=60000 >/dev/null
expect_words 8 "$(generate --tokens "$PROMPT" -n 8)" "generation before the outage"

loader=$(sup_field ssd-loader pid)
runner=$(sup_field gpu-runner pid)
[[ $loader =~ ^[0-9]+$ && $runner =~ ^[0-9]+$ ]] || fail "no pids in the supervisor's status: '$loader' '$runner'"
kill -KILL "$loader"
# Idle, the runner lets the dead loader's ring go at once (its tmpfs pages are freed for the
# successor): no mapping of a deleted weight ring stays in the runner.
released() { grep -q 'went away while idle: unmapped its weight ring' "$RUN_DIR/gpu-runner.log"; }
wait_until 5 "the runner letting the dead loader's ring go" released
if grep -q -- '-weights' "/proc/$runner/maps"; then
	fail "the runner still maps the dead loader's ring: $(grep -- '-weights' "/proc/$runner/maps" | head -n 2)"
fi
# The runner finds the loader gone before the next request and waits for it to come back.
generate --tokens "$PROMPT" -n 8 >"$IT_TMP/gen.out" 2>"$IT_TMP/gen.err" &
gen=$!
waiting() { grep -q 'reconnecting to ssd-loader' "$RUN_DIR/gpu-runner.log"; }
wait_until 20 "the runner waiting for ssd-loader" waiting
# In its wait, beating: a heartbeat after it began to wait.
beats=$(sup_field gpu-runner heartbeats)
beat_since() { (($(sup_field gpu-runner heartbeats) > beats)); }
wait_until 5 "a heartbeat of the runner while it waits for ssd-loader" beat_since

t0=$(date +%s%3N)
"$PIPELINE" stop >/dev/null
t1=$(date +%s%3N)
rc=0
wait "$gen" || rc=$?
((rc == 1)) || fail "the request in flight at stop: exit status $rc, want 1 ($(head -c 300 "$IT_TMP/gen.err"))"
expect_grep 'gpu-runner is stopping' "$(cat "$IT_TMP/gen.err")" "the error of the request in flight at stop"
if grep -q 'gpu-runner (pid [0-9]*) did not exit in' "$RUN_DIR/supervisor.log"; then
	fail "gpu-runner needed SIGKILL to stop while it waited for ssd-loader: $(grep 'did not exit' "$RUN_DIR/supervisor.log")"
fi
expect_grep 'signal 15: stopping' "$(cat "$RUN_DIR/gpu-runner.log")" "the runner's log"
expect_nothing_left "after stop during the outage"
log "stop during an ssd-loader outage took $((t1 - t0)) ms, no SIGKILL"

# The same for a kv-store that is alive but does not answer (stopped, with hang detection off):
# the runner's wait for its reply beats, and gives up at the stop's SIGTERM.
"$PIPELINE" start --model "$MODEL" --supervisor-opt=--hang-periods=0 >/dev/null
kv=$(sup_field kv-store pid)
[[ $kv =~ ^[0-9]+$ ]] || fail "no kv-store pid in the supervisor's status: '$kv'"
kill -STOP "$kv"
generate --tokens "$PROMPT" -n 8 >"$IT_TMP/gen.out" 2>"$IT_TMP/gen.err" &
gen=$!
# The runner took the request (it says busy in the stats it publishes with each beat) and so
# waits for the stopped kv-store's reply.
runner_busy() { "$BIN/pipeline-inspect" gpu-runner --once --json 2>/dev/null | grep -q '"busy": true'; }
wait_until 20 "the runner busy with the request while kv-store is stopped" runner_busy
"$PIPELINE" stop >/dev/null &
stopper=$!
rc=0
wait "$gen" || rc=$?
kill -CONT "$kv" 2>/dev/null || true # let it hear its own stop
wait "$stopper" || fail "stop during a kv-store outage failed"
((rc == 1)) || fail "the request waiting on a stopped kv-store at stop: exit status $rc, want 1 ($(head -c 300 "$IT_TMP/gen.err"))"
expect_grep 'gpu-runner is stopping' "$(cat "$IT_TMP/gen.err")" "the error of the request waiting on kv-store at stop"
if grep -q 'gpu-runner (pid [0-9]*) did not exit in' "$RUN_DIR/supervisor.log"; then
	fail "gpu-runner needed SIGKILL to stop while it waited for kv-store: $(grep 'did not exit' "$RUN_DIR/supervisor.log")"
fi
expect_nothing_left "after stop during a kv-store outage"
log "stop while the runner waited on a stopped kv-store: the request failed with the stop, no SIGKILL"
log "ok"

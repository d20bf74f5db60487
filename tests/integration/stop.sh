#!/usr/bin/env bash
# stop: after stop no process of the instance, no shared-memory object, no socket, no pid
# file; the logs stay. Stopping a stopped instance says so and succeeds; status fails.
source "$(dirname "$0")/lib.sh"
it_setup stop

"$PIPELINE" start --model "$MODEL"
expect_words 8 "$(generate --tokens "$PROMPT" -n 8)" "generation"
[[ -n $(instance_shm) ]] || fail "no shared-memory object while the instance runs (the test looks in the wrong place)"
[[ -n $(instance_pids) ]] || fail "no process found while the instance runs (the test looks in the wrong place)"

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

# A killed service leaves its shared state: stop removes that too.
"$PIPELINE" start --model "$MODEL" >/dev/null
kill -KILL "$(cat "$RUN_DIR/kv-store.pid")"
"$PIPELINE" stop >/dev/null
expect_nothing_left "stop after kv-store was killed"
log "ok"

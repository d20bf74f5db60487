#!/usr/bin/env bash
# supervisor_kill: under pipeline-supervisor, kill -9 of each service in turn (the instance idle)
# is answered by a restart of that service alone with the same command line: status shows it up
# in a new process with restarts 1 and the signal as its last exit, and generation afterwards
# gives the same tokens. Then the supervisor itself is killed: the services keep serving, status
# says nothing supervises them, and stop still leaves nothing behind.
source "$(dirname "$0")/lib.sh"
it_setup supervisor_kill

# Small KV tiers, so the kv-store that is killed holds a pool worth adopting.
"$PIPELINE" start --model "$MODEL" --kv-gpu-budget 32KiB --kv-dram-budget 32KiB --runner-opt=--prefill-chunk=16
first=$(generate --tokens "$PROMPT" -n 64)
expect_words 64 "$first" "tokens before any kill"
expect_eq "$first" "$(run_local --tokens "$PROMPT" -n 64)" "tokens before any kill vs run-local"
for s in kv-store ssd-loader gpu-runner; do
	expect_eq "$(sup_field "$s" restarts)" 0 "restarts of $s after start"
	expect_eq "$(sup_field "$s" state)" '"up"' "state of $s after start"
done

others_of() {
	local s
	for s in kv-store ssd-loader gpu-runner; do
		[[ $s == "$1" ]] || sup_field "$s" pid
	done | tr '\n' ' '
}

for service in kv-store ssd-loader gpu-runner; do
	before=$(sup_field "$service" pid)
	[[ $before =~ ^[0-9]+$ ]] || fail "no pid of $service in the supervisor's status: '$before'"
	argv=$(sup_argv "$service")
	expect_grep "\"--run-dir\"" "$argv" "$service's command line in the status"
	others=$(others_of "$service")
	kill -KILL "$before"
	wait_until 30 "$service back after kill -9" restarted "$service" "$before"
	after=$(sup_field "$service" pid)
	expect_eq "$(sup_argv "$service")" "$argv" "the command line of $service across its restart"
	expect_eq "$(sup_field "$service" restarts)" 1 "restarts of $service after one kill -9"
	expect_eq "$(sup_field "$service" last_exit)" '"signal 9 (SIGKILL)"' "last exit of $service"
	expect_grep 'killed by signal 9' "$(sup_field "$service" last_error)" "last error of $service"
	expect_eq "$(cat "$RUN_DIR/$service.pid")" "$after" "$service.pid after the restart"
	[[ ! -e /proc/$before ]] || fail "the killed $service (pid $before) was not reaped"
	expect_eq "$(others_of "$service")" "$others" "pids of the other services across the kill of $service"
	got=$(generate --tokens "$PROMPT" -n 64)
	expect_eq "$got" "$first" "tokens after kill -9 of $service"
	log "kill -9 $service: pid $before -> $after, restarts 1, tokens unchanged"
done
"$PIPELINE" status >/dev/null || fail "status after the kills does not report all services up"
grep -q 'kv-store (pid [0-9]*) was killed by signal 9' "$RUN_DIR/supervisor.log" ||
	fail "the supervisor's log does not record the kill of kv-store"

# The supervisor killed: its services go on; status says they are not supervised; stop cleans up.
sup=$(cat "$RUN_DIR/supervisor.pid")
kill -KILL "$sup"
wait_until 10 "the supervisor gone after kill -9" proc_gone "$sup"
rc=0
out=$("$PIPELINE" status 2>&1) || rc=$?
((rc == 1)) || fail "status without a supervisor: exit status $rc, want 1"
expect_grep 'no supervisor runs' "$out" "status without a supervisor"
expect_words 8 "$(generate --tokens "$PROMPT" -n 8)" "generation after the supervisor was killed"
# Its pid file now names a process that is not it (a number reused): shutdown leaves that alone.
sleep 300 &
other=$!
echo "$other" >"$RUN_DIR/supervisor.pid"
rc=0
out=$("$BIN/pipeline-supervisor" shutdown --run-dir "$RUN_DIR" 2>&1) || rc=$?
((rc != 0)) || fail "shutdown with the pid file of another process succeeded: $out"
expect_grep "another program now: left alone" "$out" "shutdown with a stale pid file"
kill -0 "$other" 2>/dev/null || fail "shutdown signalled the process its stale pid file named"
kill "$other"
wait "$other" 2>/dev/null || true
rm -f "$RUN_DIR/supervisor.pid"
# cleanup with the services alive and no supervisor: their pid files, sockets and the spill file stay
# (they are how stop finds them), and it says so.
out=$("$BIN/pipeline-supervisor" cleanup --run-dir "$RUN_DIR" --instance "$INSTANCE" 2>&1) ||
	fail "cleanup beside unsupervised services failed: $out"
for s in kv-store ssd-loader gpu-runner; do
	expect_grep "left the files of $s: it lives" "$out" "cleanup beside a live $s"
	[[ -e $RUN_DIR/$s.pid ]] || fail "cleanup removed the pid file of the live $s"
done
out=$("$PIPELINE" stop)
expect_grep "instance $INSTANCE stopped \(gpu-runner ssd-loader kv-store\)" "$out" "stop without a supervisor"
expect_nothing_left "stop after the supervisor was killed"
log "ok"

#!/usr/bin/env bash
# supervisor_hang: a service whose heartbeats stop while its process exists (SIGSTOP) is found hung
# by the supervisor once two heartbeat periods pass without one, killed and restarted; the others
# keep running and generation afterwards gives the same tokens. gpu-runner first, then kv-store.
source "$(dirname "$0")/lib.sh"
it_setup supervisor_hang

"$PIPELINE" start --model "$MODEL" --kv-gpu-budget 32KiB --kv-dram-budget 32KiB --runner-opt=--prefill-chunk=16 \
	--supervisor-opt=--hang-periods=2
first=$(generate --tokens "$PROMPT" -n 32)
expect_words 32 "$first" "tokens before any hang"
expect_eq "$(sup_field kv-store state)" '"up"' "kv-store's state"
hang_ms=$("$BIN/pipeline-supervisor" status --json | sed -n 's/^ *"hang_ms": \([0-9]*\).*/\1/p')
expect_eq "$hang_ms" 2000 "the supervisor's hang limit (two periods of 1000 ms)"

for service in gpu-runner kv-store; do
	pid=$(sup_field "$service" pid)
	loader=$(sup_field ssd-loader pid)
	t0=$(date +%s%3N)
	kill -STOP "$pid"
	wait_until 30 "$service found hung and restarted after SIGSTOP" restarted "$service" "$pid"
	t1=$(date +%s%3N)
	line=$(grep "$service (pid $pid) is hung" "$RUN_DIR/supervisor.log" || true)
	expect_grep "is hung: no heartbeat for [0-9.]+ s \(the limit is 2.0 s\) and its process is stopped: killing it" \
		"$line" "the supervisor's log on the stopped $service"
	expect_grep '^"hung: no heartbeat for [0-9.]+ s \(the limit is 2.0 s\) and its process is stopped; killed"$' \
		"$(sup_field "$service" last_error)" "last error of $service"
	expect_eq "$(sup_field "$service" last_exit)" '"signal 9 (SIGKILL)"' "last exit of $service"
	expect_eq "$(sup_field "$service" restarts)" 1 "restarts of $service after the hang"
	[[ ! -e /proc/$pid ]] || fail "the stopped $service (pid $pid) was not killed and reaped"
	expect_eq "$(sup_field ssd-loader pid)" "$loader" "ssd-loader's pid across the hang of $service"
	got=$(generate --tokens "$PROMPT" -n 32)
	expect_eq "$got" "$first" "tokens after the hang of $service"
	log "SIGSTOP $service: ${line#*is hung: } (up again $((t1 - t0)) ms after SIGSTOP)"
done
expect_eq "$(sup_field ssd-loader restarts)" 0 "restarts of ssd-loader, which kept beating"

"$PIPELINE" stop
expect_nothing_left "after stop"
log "ok"

#!/usr/bin/env bash
# supervisor_hang: a service whose heartbeats stop while its process exists (SIGSTOP) is found hung
# by the supervisor once two heartbeat periods pass without one, killed and restarted; the others
# keep running and generation afterwards gives the same tokens. Each service in turn: gpu-runner,
# kv-store, ssd-loader (the mechanism is the same for all: beats on its .pub, its state in /proc).
# Then ssd-loader is stopped in the middle of a generation that streams weights: the runner, waiting
# for a grant, keeps beating (service_beat), so it is not taken for hung; the loader is, and is
# restarted, and the runner finishes the generation on the new loader with the same tokens.
source "$(dirname "$0")/lib.sh"
it_setup supervisor_hang

# A DRAM budget below the model, so that the layers stream (half way between the loader's minimum
# and the whole model, as tiers.sh does).
out=$("$PIPELINE" start --model "$MODEL" --dram-budget 4KiB 2>&1) && fail "start with a 4 KiB DRAM budget succeeded"
need=$(sed -n 's/.*need at least [^(]*(\([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
whole=$(sed -n 's/.*whole model resident needs \([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
if [[ -z $need || -z $whole ]] || ((need >= whole)); then
	fail "cannot read the loader's minimum DRAM budget from: $out"
fi

opts=(--model "$MODEL" --dram-budget $(((need + whole) / 2)) --kv-gpu-budget 32KiB --kv-dram-budget 32KiB
	--runner-opt=--prefill-chunk=16)
"$PIPELINE" start "${opts[@]}" --supervisor-opt=--hang-periods=2
first=$(generate --tokens "$PROMPT" -n 32)
expect_words 32 "$first" "tokens before any hang"
expect_eq "$(sup_field kv-store state)" '"up"' "kv-store's state"
hang_ms=$("$BIN/pipeline-supervisor" status --json | sed -n 's/^ *"hang_ms": \([0-9]*\).*/\1/p')
expect_eq "$hang_ms" 2000 "the supervisor's hang limit (two periods of 1000 ms)"

others_of() {
	local s
	for s in kv-store ssd-loader gpu-runner; do
		[[ $s == "$1" ]] || sup_field "$s" pid
	done | tr '\n' ' '
}

for service in gpu-runner kv-store ssd-loader; do
	pid=$(sup_field "$service" pid)
	others=$(others_of "$service")
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
	expect_eq "$(others_of "$service")" "$others" "the other services' pids across the hang of $service"
	got=$(generate --tokens "$PROMPT" -n 32)
	expect_eq "$got" "$first" "tokens after the hang of $service"
	log "SIGSTOP $service: ${line#*is hung: } (up again $((t1 - t0)) ms after SIGSTOP)"
done

# ssd-loader stopped while the runner streams weights from it. Four periods before a hang, so that
# the runner's beats can be counted while the loader is surely still stopped (the first 3 s).
"$PIPELINE" stop >/dev/null
"$PIPELINE" start "${opts[@]}" --supervisor-opt=--hang-periods=8 >/dev/null
N=400
want=$(run_local --tokens "$PROMPT" -n $N --ignore-eos)
loader=$(sup_field ssd-loader pid)
runner=$(sup_field gpu-runner pid)
runner_restarts=$(sup_field gpu-runner restarts)
generate --tokens "$PROMPT" -n $N --ignore-eos >"$IT_TMP/long.out" 2>"$IT_TMP/long.err" &
gen=$!
# Under way: its first token out, the runner streaming the weights of the next ones.
under_way() { [[ -s $IT_TMP/long.out ]] || ! kill -0 "$gen" 2>/dev/null; }
wait_until 30 "the first token of the generation of $N tokens" under_way
kill -0 "$gen" 2>/dev/null || fail "the generation of $N tokens ended before ssd-loader could be stopped"
kill -STOP "$loader"
loader_stopped() { [[ $(proc_state "$loader") == T ]]; }
wait_until 5 "ssd-loader stopped by SIGSTOP" loader_stopped
# The runner, blocked on the stopped loader, computes no token and still beats: two of its beats
# (a period apart at least) with the token count unchanged since before the first. A token in
# flight at SIGSTOP starts the count over. Within 6 s: the loader is found hung 8 periods after
# its last beat, which came at most a period before SIGSTOP (8, not fewer, so that a loaded
# machine's slow checks still finish before the restart).
beats0=$(sup_field gpu-runner heartbeats)
tokens0=$(wc -w <"$IT_TMP/long.out")
blocked_beating() {
	local beats tokens
	beats=$(sup_field gpu-runner heartbeats)
	tokens=$(wc -w <"$IT_TMP/long.out")
	if ((tokens != tokens0)); then
		beats0=$beats tokens0=$tokens
		return 1
	fi
	((beats >= beats0 + 2))
}
wait_until 6 "two heartbeats of the runner without a token while ssd-loader is stopped" blocked_beating
beats1=$(sup_field gpu-runner heartbeats)
health=$(sup_field gpu-runner health)
tokens1=$(wc -w <"$IT_TMP/long.out")
kill -0 "$gen" 2>/dev/null || fail "the generation ended while ssd-loader was stopped"
((tokens0 == tokens1 && tokens0 < N)) ||
	fail "the runner was not blocked on the stopped ssd-loader ($tokens0 then $tokens1 tokens of $N)"
loader_stopped || fail "ssd-loader was not stopped any more when the runner's beats were counted"
expect_gt "$beats1" "$beats0" "the runner's heartbeats while it waits for the stopped ssd-loader"
expect_eq "$health" '"ok"' "the runner's health while it waits for the stopped ssd-loader"
wait_until 30 "ssd-loader found hung and restarted after SIGSTOP mid-generation" restarted ssd-loader "$loader"
wait "$gen" || fail "the generation across the hang of ssd-loader failed: $(cat "$IT_TMP/long.err")"
expect_eq "$(cat "$IT_TMP/long.out")" "$want" "tokens across the hang of ssd-loader mid-generation vs run-local"
expect_eq "$(sup_field gpu-runner pid)" "$runner" "the runner's pid across the hang of ssd-loader"
expect_eq "$(sup_field gpu-runner restarts)" "$runner_restarts" "restarts of the runner, which kept beating"
grep -q 'ssd-loader is back' "$RUN_DIR/gpu-runner.log" ||
	fail "the runner's log does not say it moved to the new ssd-loader in the middle of the generation"
log "SIGSTOP ssd-loader mid-generation: the runner beat while waiting ($beats0 -> $beats1 beats, health ok), tokens exact"

"$PIPELINE" stop
expect_nothing_left "after stop"
log "ok"

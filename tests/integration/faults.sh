#!/usr/bin/env bash
# faults: kill -9 of each service (ssd-loader, kv-store, gpu-runner) at random points of a
# generation, FAULTS_KILLS times each (default 20), on one instance under its supervisor, which
# restarts the killed service. The budgets make every tier work: the loader's DRAM budget is
# below the model, so layers stream from disk for every token, and the KV tiers are small, so
# kv-store spills blocks and reads them back; a kill lands in the middle of that.
#
# Every run must end with exactly the tokens of an unfaulted run (run-local), or with a clear
# error from the client (pipectl exits 1 with a message; the tokens it printed before are a
# prefix of the right ones): never a wrong token, never a hang (FAULTS_HANG_S). What each
# service's death looks like to the client (docs/operations.md, "Faults"):
#   ssd-loader: exact tokens (the runner reconnects to the new loader in the middle of the step);
#   kv-store:   exact tokens (the runner reconnects and rebuilds the KV it lost);
#   gpu-runner: exact tokens if the kill came before the request reached it (pipectl waits for
#               the new runner), else "gpu-runner went away during the request (pid N; why)".
# An error after a kill of ssd-loader or kv-store fails the test too: they are survived.
#
# The kill points: after starting a generation, a random delay (bash's RANDOM, seeded with
# FAULTS_SEED, default 1, printed) of up to the length of an unfaulted generation. The services
# are killed in a random order. Another seed gives another schedule: FAULTS_SEED=N reproduces
# it (timing still varies a little).
# FAULTS_KILLS=N kills per service, FAULTS_TOKENS=N tokens per generation.
source "$(dirname "$0")/lib.sh"
it_setup faults

SEED=${FAULTS_SEED:-1}
KILLS=${FAULTS_KILLS:-20}
N=${FAULTS_TOKENS:-96}
HANG_S=${FAULTS_HANG_S:-45}
# FAULTS_BACKEND=cuda (on a GPU host) runs the runner on the CUDA backend, its weights streamed
# through a GPU window of FAULTS_GPU_BUDGET when given; the reference tokens are then an
# unfaulted generation of the same instance.
BACKEND=${FAULTS_BACKEND:-cpu}
gpu_opts=()
[[ -n ${FAULTS_GPU_BUDGET:-} ]] && gpu_opts+=(--gpu-budget "$FAULTS_GPU_BUDGET")
[[ $SEED =~ ^[0-9]+$ && $KILLS =~ ^[0-9]+$ && $N =~ ^[0-9]+$ && $HANG_S =~ ^[0-9]+$ ]] ||
	fail "FAULTS_SEED, FAULTS_KILLS, FAULTS_TOKENS and FAULTS_HANG_S must be non-negative integers"
RANDOM=$SEED
log "seed $SEED (FAULTS_SEED=$SEED reproduces the schedule), $KILLS kills per service, $N tokens per generation"

# A DRAM budget half way between the loader's minimum and the whole model (as tiers.sh does).
out=$("$PIPELINE" start --model "$MODEL" --backend cpu --dram-budget 4KiB 2>&1) && fail "start with a 4 KiB DRAM budget succeeded"
need=$(sed -n 's/.*need at least [^(]*(\([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
whole=$(sed -n 's/.*whole model resident needs \([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
if [[ -z $need || -z $whole ]] || ((need >= whole)); then
	fail "cannot read the loader's minimum DRAM budget from: $out"
fi
budget=$(((need + whole) / 2))

# Restarts at once and never given up (the test restarts each service KILLS times); a known disk
# speed, so a restarted loader does not measure it again.
"$PIPELINE" start --model "$MODEL" --backend "$BACKEND" ${gpu_opts[@]+"${gpu_opts[@]}"} --dram-budget "$budget" --kv-gpu-budget 32KiB \
	--kv-dram-budget 16KiB --runner-opt=--prefill-chunk=16 --loader-opt=--disk-bytes-per-s=1GB \
	--supervisor-opt=--backoff-min-ms=50 --supervisor-opt=--backoff-max-ms=100 \
	--supervisor-opt=--burst-limit=63 --supervisor-opt=--burst-window-s=1 >/dev/null

greedy=()
sampled=(--temperature 0.8 --top-k 40 --seed 7)
if [[ $BACKEND == cpu ]]; then
	want_greedy=$(run_local --tokens "$PROMPT" -n "$N" --ignore-eos)
	want_sampled=$(run_local --tokens "$PROMPT" -n "$N" --ignore-eos "${sampled[@]}")
else
	want_greedy=$(generate --tokens "$PROMPT" -n "$N" --ignore-eos)
	want_sampled=$(generate --tokens "$PROMPT" -n "$N" --ignore-eos "${sampled[@]}")
fi
expect_words "$N" "$want_greedy" "run-local tokens"

# The length of an unfaulted generation (the shorter of two) bounds the random delays.
t0=$(date +%s%3N)
got=$(generate --tokens "$PROMPT" -n "$N" --ignore-eos)
t1=$(date +%s%3N)
expect_eq "$got" "$want_greedy" "tokens without faults vs run-local"
got=$(generate --tokens "$PROMPT" -n "$N" --ignore-eos "${sampled[@]}")
t2=$(date +%s%3N)
expect_eq "$got" "$want_sampled" "sampled tokens without faults vs run-local"
span_ms=$((t1 - t0 < t2 - t1 ? t1 - t0 : t2 - t1))
# What the kills interrupt: weights streaming from disk, KV blocks spilled and read back.
[[ $(stat_value ssd-loader all_resident) != 1 ]] || fail "the loader holds the whole model: nothing streams"
expect_gt "$(stat_value ssd-loader bytes_read)" "$(model_bytes "$MODEL")" "bytes the loader read (the layers must stream)"
expect_gt "$(stat_value kv-store spills)" 0 "KV blocks kv-store spilled"
expect_gt "$(stat_value kv-store fetches_from_disk)" 0 "KV fetches kv-store served from the spill file"
log "an unfaulted generation takes $span_ms ms: kills come 0..$((span_ms * 9 / 10)) ms after a generation starts"

SERVICES=(ssd-loader kv-store gpu-runner)
declare -A kills=() mid=() exact=() clear=() wrong=() hung=() base_restarts=()
for s in "${SERVICES[@]}"; do
	kills[$s]=0 mid[$s]=0 exact[$s]=0 clear[$s]=0 wrong[$s]=0 hung[$s]=0
	base_restarts[$s]=$(sup_field "$s" restarts)
done

# rings_mapped PID: how many weight rings (distinct shared-memory files named *-weights, unlinked
# ones included) the process maps.
rings_mapped() {
	awk '$6 ~ /-weights/ {print $5}' "/proc/$1/maps" 2>/dev/null | sort -u | wc -l
}

# all_up: the supervisor sees every service up (answering HELLO).
all_up() {
	local s st
	st=$(sup_status)
	for s in "${SERVICES[@]}"; do
		[[ $(sup_field_in "$st" "$s" state) == '"up"' ]] || return 1
	done
}

# The schedule: KILLS of each service, shuffled.
schedule=()
for s in "${SERVICES[@]}"; do
	for ((i = 0; i < KILLS; i++)); do schedule+=("$s"); done
done
for ((i = ${#schedule[@]} - 1; i > 0; i--)); do
	j=$((RANDOM % (i + 1)))
	t=${schedule[i]} schedule[i]=${schedule[j]} schedule[j]=$t
done

failures=()
t_start=$(date +%s%3N)
for ((k = 0; k < ${#schedule[@]}; k++)); do
	s=${schedule[k]}
	if ((k % 2)); then
		args=("${sampled[@]}") want=$want_sampled kind=sampled
	else
		args=("${greedy[@]}") want=$want_greedy kind=greedy
	fi
	delay=$(((RANDOM * 32768 + RANDOM) % (span_ms * 9 / 10 + 1)))
	victim=$(sup_field "$s" pid)
	[[ $victim =~ ^[0-9]+$ ]] || fail "kill $k: no pid of $s in the supervisor's status: '$victim'"
	out=$IT_TMP/gen.$k
	generate --tokens "$PROMPT" -n "$N" --ignore-eos ${args[@]+"${args[@]}"} >"$out" 2>"$out.err" &
	gen=$!
	sleep "$(printf '%d.%03d' $((delay / 1000)) $((delay % 1000)))"
	landed=0
	kill -0 "$gen" 2>/dev/null && landed=1
	kill -KILL "$victim" 2>/dev/null || true
	# Wait for the client, bounded: past HANG_S it counts as hung.
	rc=
	for ((i = 0; i < HANG_S * 20; i++)); do
		if ! kill -0 "$gen" 2>/dev/null; then
			rc=0
			wait "$gen" || rc=$?
			break
		fi
		sleep 0.05
	done
	kills[$s]=$((kills[$s] + 1))
	mid[$s]=$((mid[$s] + landed))
	tokens=$(head -n 1 "$out")
	what="kill $k: $s (pid $victim) $delay ms after the start of a $kind generation"
	if [[ -z $rc ]]; then
		kill -KILL "$gen" 2>/dev/null || true
		wait "$gen" 2>/dev/null || true
		hung[$s]=$((hung[$s] + 1))
		failures+=("$what: no answer within $HANG_S s (a hang)")
	elif ((rc == 0)) && [[ $tokens == "$want" ]]; then
		exact[$s]=$((exact[$s] + 1))
		# A loader that went away in the middle of a step leaves its ring to the runner only
		# until the step is over: its tmpfs pages must go before the next loader faults in its
		# own (a budget above half of /dev/shm would kill that one with SIGBUS). The runner may
		# still map the ring of a loader that died after its last acquire (the current one, until
		# the next request), never two.
		if [[ $s == ssd-loader ]]; then
			runner=$(sup_field gpu-runner pid)
			rings=$(rings_mapped "$runner")
			((rings <= 1)) || failures+=("$what: the runner (pid $runner) still maps $rings weight rings after the generation: $(grep -- -weights "/proc/$runner/maps" | head -c 600)")
		fi
	elif ((rc == 0)); then
		wrong[$s]=$((wrong[$s] + 1))
		failures+=("$what: wrong tokens: '$tokens', want '$want'")
	elif [[ -z $tokens || $want == "$tokens" || $want == "$tokens "* ]] && grep -q '^pipectl: ' "$out.err"; then
		# An error naming the cause; the tokens printed before it are the right ones.
		clear[$s]=$((clear[$s] + 1))
		if [[ $s != gpu-runner ]]; then
			failures+=("$what: the client got an error, but a kill of $s must be survived: $(head -c 400 "$out.err"); the runner's log then: $(tail -n 12 "$RUN_DIR/gpu-runner.log" 2>/dev/null)")
		elif ((k < 3 || clear[$s] == 1)); then
			log "$what: $(head -c 300 "$out.err")"
		fi
	else
		wrong[$s]=$((wrong[$s] + 1))
		failures+=("$what: exit status $rc with tokens '$tokens' (want a prefix of '$want') and: $(head -c 400 "$out.err")")
	fi
	rm -f "$out" "$out.err"
	# The supervisor restarts the killed service; the others stay up.
	wait_until 30 "$s back after kill $k" restarted "$s" "$victim"
	wait_until 30 "every service up after kill $k" all_up
done
t_end=$(date +%s%3N)

printf '[%s] %-11s %6s %15s %6s %12s %6s %5s\n' "$IT_NAME" service kills mid-generation exact clear-error wrong hang
for s in "${SERVICES[@]}"; do
	printf '[%s] %-11s %6d %15d %6d %12d %6d %5d\n' "$IT_NAME" "$s" "${kills[$s]}" "${mid[$s]}" "${exact[$s]}" \
		"${clear[$s]}" "${wrong[$s]}" "${hung[$s]}"
done
log "$((${#schedule[@]})) kills in $(((t_end - t_start) / 1000)) s (seed $SEED)"
if ((${#failures[@]})); then
	for f in "${failures[@]}"; do echo "[$IT_NAME] FAIL: $f" >&2; done
	fail "${#failures[@]} run(s) ended with a wrong token, a hang or an error a kill must not cause (FAULTS_SEED=$SEED)"
fi
# Each service restarted once per kill and for no other reason (no crash, no hang caused by
# another's death).
for s in "${SERVICES[@]}"; do
	expect_eq "$(sup_field "$s" restarts)" "$((base_restarts[$s] + kills[$s]))" "restarts of $s after ${kills[$s]} kills"
	((KILLS == 0 || mid[$s] > 0)) || fail "no kill of $s landed in the middle of a generation"
done
# And the instance still generates the same tokens.
expect_eq "$(generate --tokens "$PROMPT" -n "$N" --ignore-eos)" "$want_greedy" "tokens after the kills"

"$PIPELINE" stop >/dev/null
expect_nothing_left "after stop"
left=$(find "$RUN_DIR" -maxdepth 1 -type s 2>/dev/null || true)
[[ -z $left ]] || fail "sockets left in the run directory after stop: $left"
log "ok"

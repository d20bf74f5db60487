#!/usr/bin/env bash
# tune: live tuning (scripts/pipeline get | tune). get lists every parameter of each service,
# tunable ones with their range and fixed ones marked so; tune changes a parameter of each service
# at once and its effect shows (the kv-store spills down to a lowered DRAM budget, the loader's
# read-ahead and io limit show in its stats, debug lines appear in a log, the runner fetches one
# block per request, a lowered context refuses a long prompt); the tokens stay those of run-local;
# refused values (not a number, out of range, an unknown key, a fixed key, an unknown service)
# print why, exit non-zero and leave the old values.
source "$(dirname "$0")/lib.sh"
it_setup tune

# Weights that stream (half way between the loader's minimum and the whole model, as tiers.sh),
# a runner arena of 8 blocks so KV blocks go to the kv-store and come back, and a pool large
# enough to hold every block (so nothing spills until the DRAM budget is lowered).
out=$("$PIPELINE" start --model "$MODEL" --dram-budget 4KiB 2>&1) && fail "start with a 4 KiB DRAM budget succeeded"
need=$(sed -n 's/.*need at least [^(]*(\([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
whole=$(sed -n 's/.*whole model resident needs \([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
[[ -n $need && -n $whole ]] && ((need < whole)) || fail "cannot read the loader's minimum from: $out"
"$PIPELINE" start --model "$MODEL" --dram-budget $(((need + whole) / 2)) --kv-gpu-budget 32KiB \
	--kv-dram-budget 1MiB --runner-opt=--prefill-chunk=16 >/dev/null

want=$(run_local --tokens "$PROMPT" -n 64)
got=$(generate --tokens "$PROMPT" -n 64)
expect_words 64 "$got" "tokens before tuning"
expect_eq "$got" "$want" "tokens before tuning vs run-local"

# value SERVICE KEY: the text of KEY's value as get prints it.
value() {
	"$PIPELINE" get "$1" "$2" | sed -n "s/^$2 = \([^ ]*\)  (.*/\1/p"
}

# ---- get: every key of each service ----
for s in ssd-loader kv-store gpu-runner; do
	out=$("$PIPELINE" get "$s")
	while IFS= read -r line; do
		[[ $line =~ ^[a-z0-9-]+\ =\ [^\ ].*\ \ \((tunable|fixed)(\;\ .*)?\)$ ]] ||
			fail "get $s: a line not of the form 'key = value  (tunable|fixed; ...)': $line"
	done <<<"$out"
	expect_grep '^log-level = info  \(tunable; debug\|info\|warn\|error; ' "$out" "get $s: log-level"
	expect_grep '^instance = it-tune-[0-9]+  \(fixed; ' "$out" "get $s: instance"
done
out=$("$PIPELINE" get ssd-loader)
expect_grep '^read-ahead = [1-9][0-9]*  \(tunable; 0\.\.[1-9]' "$out" "get ssd-loader: read-ahead"
expect_grep '^io-depth = 64  \(tunable; 1\.\.64; ' "$out" "get ssd-loader: io-depth"
expect_grep '^model = .*/model  \(fixed; ' "$out" "get ssd-loader: model"
expect_grep '^dram-budget = [0-9]+[KMG]?i?B?  \(fixed; ' "$out" "get ssd-loader: dram-budget"
out=$("$PIPELINE" get kv-store)
expect_grep '^kv-dram-budget = 1MiB  \(tunable; 4KiB\.\.1MiB; ' "$out" "get kv-store: kv-dram-budget"
expect_grep '^kv-disk-budget = 4GiB  \(tunable; 0\.\.4GiB; ' "$out" "get kv-store: kv-disk-budget"
expect_grep '^io-depth = 32  \(tunable; 1\.\.32; ' "$out" "get kv-store: io-depth"
expect_grep '^spill-file = .*/kv-spill.bin  \(fixed; ' "$out" "get kv-store: spill-file"
out=$("$PIPELINE" get gpu-runner)
expect_grep '^timeout-ms = 60000  \(tunable; 100\.\.60000; ' "$out" "get gpu-runner: timeout-ms"
expect_grep '^max-context = [0-9]+  \(tunable; 2\.\.[0-9]+; ' "$out" "get gpu-runner: max-context"
expect_grep '^kv-fetch-batch = 0  \(tunable; 0\.\.65536; ' "$out" "get gpu-runner: kv-fetch-batch"
expect_grep '^max-queued = 128  \(tunable; 1\.\.128; ' "$out" "get gpu-runner: max-queued"
expect_grep '^kv-block-tokens = 16  \(fixed; ' "$out" "get gpu-runner: kv-block-tokens"
expect_grep '^backend = cpu  \(fixed; ' "$out" "get gpu-runner: backend"
# some keys, and JSON
out=$("$PIPELINE" get kv-store kv-dram-budget io-depth)
expect_eq "$(wc -l <<<"$out")" 2 "get kv-store with two keys: lines"
out=$("$PIPELINE" get kv-store kv-dram-budget --json)
expect_grep '"value": 1048576' "$out" "get --json: the value in bytes"
expect_grep '"tunable": true' "$out" "get --json: tunable"
expect_grep '"max": 1048576' "$out" "get --json: the range"
log "get lists each service's parameters"

# ---- kv-store: lowering the DRAM budget spills down to it ----
pool_used=$(stat_value kv-store pool_used)
spills0=$(stat_value kv-store spills)
expect_gt "$pool_used" 2 "KV blocks in the pool before the tune"
expect_eq "$spills0" 0 "spills before the tune (the pool holds every block)"
out=$("$PIPELINE" tune kv-store kv-dram-budget=8KiB)
expect_grep '^kv-dram-budget = 8KiB  \(tunable; ' "$out" "tune kv-store: the new value"
expect_eq "$(value kv-store kv-dram-budget)" 8KiB "get after the tune"
pool_within() {
	local used
	used=$(stat_value kv-store pool_used)
	[[ -n $used ]] && ((used <= 2))
}
wait_until 10 "the pool spilled down to 2 blocks" pool_within
spills1=$(stat_value kv-store spills)
expect_gt "$spills1" "$spills0" "spills after lowering the DRAM budget"
expect_eq "$(stat_value kv-store pool_limit_blocks)" 2 "the pool's limit in blocks"
expect_grep 'info: tune: kv-dram-budget 1MiB -> 8KiB$' "$(cat "$RUN_DIR/kv-store.log")" "kv-store log: the tune line"
expect_grep 'info: kv-dram-budget: spilled down to the budget' "$(cat "$RUN_DIR/kv-store.log")" "kv-store log"
from_disk0=$(stat_value kv-store fetches_from_disk)
got=$(generate --tokens "$PROMPT" -n 64)
expect_eq "$got" "$want" "tokens with the DRAM budget lowered vs run-local"
expect_gt "$(stat_value kv-store fetches_from_disk)" "$from_disk0" "KV blocks fetched from disk under the lowered budget"
wait_until 10 "the pool back within 2 blocks after the request" pool_within
log "kv-store: kv-dram-budget 1MiB -> 8KiB spilled $((spills1 - spills0)) blocks; tokens unchanged"

# ---- ssd-loader: read-ahead, io-depth and the log level ----
out=$("$PIPELINE" tune ssd-loader read-ahead=0 io-depth=2)
expect_grep '^read-ahead = 0  \(tunable; ' "$out" "tune ssd-loader: read-ahead"
expect_grep '^io-depth = 2  \(tunable; ' "$out" "tune ssd-loader: io-depth"
expect_eq "$(stat_value ssd-loader read_ahead)" 0 "the loader's stats: read_ahead"
expect_eq "$(stat_value ssd-loader io_depth_limit)" 2 "the loader's stats: io_depth_limit"
expect_grep 'info: tune: read-ahead [0-9]+ -> 0$' "$(cat "$RUN_DIR/ssd-loader.log")" "ssd-loader log: read-ahead"
expect_grep 'info: tune: io-depth 64 -> 2$' "$(cat "$RUN_DIR/ssd-loader.log")" "ssd-loader log: io-depth"
debug_lines() {
	grep -c ' debug: ' "$RUN_DIR/ssd-loader.log" || true
}
expect_eq "$(debug_lines)" 0 "debug lines in the loader's log at level info"
"$PIPELINE" tune ssd-loader log-level=debug >/dev/null
got=$(generate --tokens "$PROMPT" -n 64)
expect_eq "$got" "$want" "tokens with read-ahead 0, io-depth 2 and debug logging vs run-local"
n_debug=$(debug_lines)
expect_gt "$n_debug" 0 "debug lines in the loader's log after log-level=debug"
"$PIPELINE" tune ssd-loader log-level=info >/dev/null
generate --tokens "$PROMPT" -n 8 >/dev/null
expect_eq "$(debug_lines)" "$n_debug" "debug lines after log-level=info again"
expect_grep 'info: tune: log-level debug -> info$' "$(cat "$RUN_DIR/ssd-loader.log")" "ssd-loader log: back to info"
log "ssd-loader: read-ahead 0 and io-depth 2 in its stats, $n_debug debug lines while at debug"

# ---- gpu-runner: one KV block per fetch; a shorter context ----
runs0=$(stat_value gpu-runner kv_fetch_runs)
fetched0=$(stat_value gpu-runner kv_blocks_fetched)
"$PIPELINE" tune gpu-runner kv-fetch-batch=1 >/dev/null
got=$(generate --tokens "$PROMPT" -n 64)
expect_eq "$got" "$want" "tokens with kv-fetch-batch=1 vs run-local"
runs=$(($(stat_value gpu-runner kv_fetch_runs) - runs0))
fetched=$(($(stat_value gpu-runner kv_blocks_fetched) - fetched0))
expect_gt "$fetched" 0 "KV blocks the runner fetched"
expect_eq "$runs" "$fetched" "fetch requests with kv-fetch-batch=1 (one block each)"
max_context=$(value gpu-runner max-context)
"$PIPELINE" tune gpu-runner max-context=32 >/dev/null
reconnects() { grep -c 'reconnecting to' "$RUN_DIR/gpu-runner.log" || true; }
before=$(reconnects)
failures0=$(stat_value gpu-runner failures)
out=$(generate --tokens "$PROMPT" -n 4 2>&1) && fail "a 64-token prompt with max-context 32 was served: $out"
expect_grep 'must be shorter than the context of 32' "$out" "a 64-token prompt with max-context 32"
# Refused as it arrived (a prompt of ids is measured then), never queued nor run: no failed request.
expect_eq "$(stat_value gpu-runner failures)" "$failures0" "failed requests after a prompt of ids too long for the context"
"$PIPELINE" tune gpu-runner max-context="$max_context" kv-fetch-batch=0 >/dev/null
got=$(generate --tokens "$PROMPT" -n 64)
expect_eq "$got" "$want" "tokens after max-context and kv-fetch-batch went back vs run-local"
# A request refused for its own input says nothing of the peers: no reconnection after it.
expect_eq "$(reconnects)" "$before" "the runner's reconnections after a request refused for its prompt"
log "gpu-runner: kv-fetch-batch=1 made $runs requests for $fetched blocks; max-context=32 refused a 64-token prompt"

# ---- profile-host: the thread that runs the steps sampled while it computes, then stopped ----
expect_eq "$(value gpu-runner profile-host)" false "profile-host at start"
"$PIPELINE" tune gpu-runner profile-host=on >/dev/null
expect_eq "$(value gpu-runner profile-host)" true "profile-host after tune on"
for _ in 1 2 3 4 5 6 7 8; do # the CPU clock is sampled at the kernel's tick: enough work for a few
	got=$(generate --tokens "$PROMPT" -n 64)
	expect_eq "$got" "$want" "tokens while profiled vs run-local"
	(($(stat_value gpu-runner samples) >= 5)) && break
done
"$PIPELINE" tune gpu-runner profile-host=off >/dev/null
stats=$("$PIPECTL" stats gpu-runner)
samples=$(stat_value gpu-runner samples)
expect_gt "$samples" 4 "host profile samples after 64-token requests on the C backend"
top=$(python3 -c 'import json, sys, os
p = json.load(sys.stdin)["host_profile"]
assert not p["running"], p
top = p["top"]
assert top and sum(e[3] for e in top) <= p["samples"], p
assert all(e[0] in ("?", "(main program)", "[vdso]") or os.path.exists(e[0]) for e in top), top
print(top[0][0], top[0][1], top[0][3])' <<<"$stats") || fail "host_profile in the stats: $stats"
generate --tokens "$PROMPT" -n 8 >/dev/null
expect_eq "$(stat_value gpu-runner samples)" "$samples" "host profile samples after it stopped"
log "gpu-runner: profile-host sampled $samples times over its requests (most at $top)"

# ---- refusals: the reason, a non-zero exit, the old value kept ----
# refused EXIT PATTERN ARGS...: scripts/pipeline ARGS exits EXIT and prints PATTERN.
refused() {
	local want_rc=$1 pattern=$2 rc=0
	shift 2
	out=$("$PIPELINE" "$@" 2>&1) || rc=$?
	expect_eq "$rc" "$want_rc" "exit status of: $*"
	expect_grep "$pattern" "$out" "the message of: $*"
}
refused 1 "kv-store: kv-dram-budget: 'lots' is not a size" tune kv-store kv-dram-budget=lots
refused 1 'kv-store: kv-dram-budget: 2MiB is out of range \(4KiB\.\.1MiB\)' tune kv-store kv-dram-budget=2MiB
refused 1 'kv-store: io-depth: 0 is out of range \(1\.\.32\)' tune kv-store io-depth=0
refused 1 'kv-store: kv-disk-budget: 4KiB is below the [0-9]+KiB already in use in the spill file' \
	tune kv-store kv-disk-budget=4KiB
refused 1 "gpu-runner: timeout-ms: 'soon' is not an integer" tune gpu-runner timeout-ms=soon
refused 1 "ssd-loader: unknown key 'speed' for ssd-loader; known: log-level, read-ahead, io-depth, model" \
	tune ssd-loader speed=1
refused 1 "unknown key 'speed' for ssd-loader" get ssd-loader speed
refused 1 'gpu-runner: kv-block-tokens: fixed at start: restart gpu-runner with --kv-block-tokens' \
	tune gpu-runner kv-block-tokens=32
refused 1 "ssd-loader: log-level: 'loud' is not one of debug, info, warn, error" tune ssd-loader log-level=loud
# all or nothing: the good first pair is not applied either
refused 1 "gpu-runner: kv-fetch-batch: 'x' is not an integer" tune gpu-runner max-queued=4 kv-fetch-batch=x
refused 2 "unknown service 'nosuch'" tune nosuch io-depth=1
refused 2 "'kv-dram-budget' is not KEY=VALUE" tune kv-store kv-dram-budget
expect_eq "$(value kv-store kv-dram-budget)" 8KiB "kv-dram-budget after the refusals"
expect_eq "$(value kv-store io-depth)" 32 "kv-store io-depth after the refusals"
expect_eq "$(value gpu-runner max-queued)" 128 "max-queued after a refused set that named it"
expect_eq "$(value gpu-runner timeout-ms)" 60000 "timeout-ms after the refusals"
expect_eq "$(value ssd-loader log-level)" info "the loader's log-level after the refusals"
got=$(generate --tokens "$PROMPT" -n 64)
expect_eq "$got" "$want" "tokens after the refusals vs run-local"
log "refusals print the reason and change nothing"

"$PIPELINE" stop >/dev/null
refused 1 'kv-store of instance it-tune-[0-9]+ is not running' get kv-store
refused 1 'gpu-runner of instance it-tune-[0-9]+ is not running' tune gpu-runner max-queued=2
expect_nothing_left "after stop"
log "ok"

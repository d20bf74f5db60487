#!/usr/bin/env bash
# kv_prefix: prefix reuse. A request whose prompt starts like an earlier one restores the
# cached KV blocks instead of computing them, from whichever tier holds them (the runner's
# arena, the pool, the spill file), and gives exactly the tokens of a cold run: the same
# request on a fresh instance, and run-local. The counters show the hits (runner and
# kv-store stats, pipectl summary).
source "$(dirname "$0")/lib.sh"
it_setup kv_prefix

# A 256-token shared prefix, then two different 48-token tails.
prefix=$(for ((i = 0; i < 256; i++)); do echo $(((i * 37 + 11) % 500 + 1)); done | paste -sd,)
tail_a=$(for ((i = 0; i < 48; i++)); do echo $(((i * 13 + 5) % 500 + 1)); done | paste -sd,)
tail_b=$(for ((i = 0; i < 48; i++)); do echo $(((i * 29 + 3) % 500 + 1)); done | paste -sd,)
A=$prefix,$tail_a
Bp=$prefix,$tail_b
want_a=$(run_local --tokens "$A" -n 32 --ignore-eos)
want_b=$(run_local --tokens "$Bp" -n 32 --ignore-eos)
sample=(--temperature 0.8 --top-k 40 --seed 11)
want_bs=$(run_local --tokens "$Bp" -n 32 --ignore-eos "${sample[@]}")

# Small budgets: blocks leave the arena, the pool spills, so hits come from every tier.
start_small() {
	"$PIPELINE" start --model "$MODEL" --backend cpu --kv-gpu-budget 96KiB --kv-dram-budget 64KiB \
		--runner-opt=--prefill-chunk=32
}

start_small
got=$(generate --tokens "$A" -n 32 --ignore-eos)
expect_eq "$got" "$want_a" "cold request A vs run-local"
p0=$(stat_value gpu-runner kv_prefix_positions)
expect_eq "$p0" 0 "positions restored on the first request"

got=$(generate --tokens "$Bp" -n 32 --ignore-eos)
expect_eq "$got" "$want_b" "request B sharing A's 256-token prefix vs run-local"
p1=$(stat_value gpu-runner kv_prefix_positions)
expect_eq "$p1" 256 "positions restored for B (the shared prefix, 16 blocks of 16)"
got=$(generate --tokens "$Bp" -n 32 --ignore-eos "${sample[@]}")
expect_eq "$got" "$want_bs" "sampled request B again vs run-local"
p2=$(stat_value gpu-runner kv_prefix_positions)
# B's own prompt is cached now too, up to the last full block before its last position.
expect_gt "$p2" $((p1 + 256)) "positions restored for B's repeat"

hits=$(stat_value kv-store prefix_hits)
misses=$(stat_value kv-store prefix_misses)
log "restored positions: $p1 then $p2; kv-store prefix hits $hits, misses $misses"
expect_gt "$hits" 0 "kv-store prefix hits"
expect_gt "$misses" 0 "kv-store prefix misses (A's first lookup found nothing)"
status=$("$PIPELINE" status)
expect_grep "KV prefix cache +$hits hits, $misses misses" "$status" "status shows the prefix cache's hits and misses"
summary=$("$PIPECTL" summary)
expect_grep 'prefix' "$summary" "pipectl summary shows prefix reuse"

# --kv-persist-dir: the cached blocks outlive a stop; a new instance restores A's prompt from
# the spill file through the index, with the tokens of a cold run.
"$PIPELINE" stop
persist=$IT_TMP/kv-persist
# (Given relative to the caller's directory: the services run from /.)
(cd "$IT_TMP" && "$PIPELINE" start --model "$MODEL" --backend cpu --kv-persist-dir kv-persist)
got=$(generate --tokens "$A" -n 32 --ignore-eos)
expect_eq "$got" "$want_a" "request A with a persist dir"
"$PIPELINE" stop
[[ -s $persist/kv-spill.bin && -s $persist/kv-spill.idx ]] || fail "the persist dir holds no spill file and index after stop"
"$PIPELINE" start --model "$MODEL" --backend cpu --kv-persist-dir "$persist"
got=$(generate --tokens "$A" -n 32 --ignore-eos)
expect_eq "$got" "$want_a" "request A again after a stop and a start"
p3=$(stat_value gpu-runner kv_prefix_positions)
log "after a stop and a start with --kv-persist-dir: $p3 positions restored"
expect_gt "$p3" 255 "positions restored from the persist dir"

# A cold run of B on a fresh instance gives the same tokens as the warm one.
"$PIPELINE" stop
"$PIPELINE" start --model "$MODEL" --backend cpu
got=$(generate --tokens "$Bp" -n 32 --ignore-eos)
expect_eq "$got" "$want_b" "cold request B on a fresh instance"
expect_eq "$(stat_value gpu-runner kv_prefix_positions)" 0 "positions restored on a fresh instance"

"$PIPELINE" stop
expect_nothing_left "after stop"
log "ok"

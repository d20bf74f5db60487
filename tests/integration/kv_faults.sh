#!/usr/bin/env bash
# kv_faults: the KV tiers under faults, each during a generation that keeps the kv-store busy
# (a 1024-token prompt, 400 generated tokens, budgets that send most blocks to the spill
# file and back for every token). Every run gives exactly run-local's tokens:
#   1. kill -9 of kv-store in the middle: the supervisor starts it again, it adopts the pool,
#      the runner reconnects and rebuilds what it lost;
#   2. scripts/pipeline restart kv-store in the middle;
#   3. a byte flipped in every block of the spill file: each block read back fails its
#      checksum, is dropped and its KV is computed again, never used.
source "$(dirname "$0")/lib.sh"
it_setup kv_faults

P=$(for ((i = 0; i < 1024; i++)); do echo $(((i * 37 + 11) % 500 + 1)); done | paste -sd,)
N=400
want=$(run_local --tokens "$P" -n $N --ignore-eos)
expect_words $N "$want" "run-local tokens"

"$PIPELINE" start --model "$MODEL" --backend cpu --kv-gpu-budget 64KiB --kv-dram-budget 256KiB \
	--runner-opt=--prefill-chunk=32

# gen_bg FILE: a generation in the background (pid in GEN_PID).
gen_bg() {
	generate --tokens "$P" -n $N --ignore-eos >"$1" 2>"$1.err" &
	GEN_PID=$!
}

# wait_decoding: until the runner is well into decoding (kv-store has seen the prompt's 128
# commits and 20 more: 160 decoded tokens), or the generation ended.
wait_decoding() {
	local base=$1 c i
	for ((i = 0; i < 600; i++)); do
		c=$(stat_value kv-store commits || true)
		[[ -n $c ]] && ((c >= base + 148)) && return 0
		kill -0 "$GEN_PID" 2>/dev/null || return 0
		sleep 0.05
	done
	fail "the generation did not reach its decoding phase in 30 s"
}

kv_pid() { cat "$RUN_DIR/kv-store.pid"; }

# 1. kill -9
base=$(stat_value kv-store commits)
old=$(kv_pid)
gen_bg "$IT_TMP/kill.out"
wait_decoding "$base"
kill -0 "$GEN_PID" 2>/dev/null || fail "the generation ended before kv-store could be killed"
kill -KILL "$old"
log "killed kv-store (pid $old) in the middle of a generation"
wait "$GEN_PID" || fail "generation across kill -9 of kv-store failed: $(cat "$IT_TMP/kill.out.err")"
expect_eq "$(cat "$IT_TMP/kill.out")" "$want" "tokens across kill -9 of kv-store vs run-local"
new=$(kv_pid)
[[ $new != "$old" ]] || fail "kv-store still has pid $old after kill -9"
rebuilds=$(stat_value gpu-runner kv_rebuilds)
expect_gt "$rebuilds" 0 "runner KV rebuilds after kill -9 of kv-store"
log "tokens exact across kill -9 (kv-store now pid $new; runner rebuilt its KV $rebuilds time(s))"

# 2. restart kv-store
base=$(stat_value kv-store commits)
gen_bg "$IT_TMP/restart.out"
wait_decoding "${base:-0}"
"$PIPELINE" restart kv-store >/dev/null
wait "$GEN_PID" || fail "generation across restart kv-store failed: $(cat "$IT_TMP/restart.out.err")"
expect_eq "$(cat "$IT_TMP/restart.out")" "$want" "tokens across restart kv-store vs run-local"
log "tokens exact across scripts/pipeline restart kv-store"

# 3. flipped bytes in the spill file. The previous requests left blocks spilled and cached:
# corrupt one byte of every 4 KiB block; the next request restores its prefix from them.
spill=$RUN_DIR/kv-spill.bin
[[ -f $spill ]] || fail "no spill file at $spill"
python3 - "$spill" <<'PY'
import os, sys
path = sys.argv[1]
size = os.path.getsize(path)
with open(path, "r+b") as f:
    for off in range(100, size, 4096):
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x5A]))
PY
failures0=$(stat_value kv-store checksum_failures)
got=$(generate --tokens "$P" -n $N --ignore-eos)
expect_eq "$got" "$want" "tokens with every spilled block corrupted vs run-local"
failures=$(stat_value kv-store checksum_failures)
expect_gt "$failures" "${failures0:-0}" "checksum failures kv-store detected"
log "tokens exact with a byte flipped in every spilled block ($failures checksum failures detected)"

"$PIPELINE" stop
expect_nothing_left "after stop"
log "ok"

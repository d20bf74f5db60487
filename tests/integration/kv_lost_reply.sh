#!/usr/bin/env bash
# kv_lost_reply: a kv-store reply the runner gives up on while the store lives. The kv-store is
# stopped (SIGSTOP) for longer than the runner's timeout-ms (tuned to 400) right before a request whose
# prompt it has cached: the runner's prefix lookup goes unanswered and is given up, the runner
# reconnects when the store runs again, and the store then does the lookup late, taking
# references to the cached blocks for a session nobody hears from. The runner says HELLO with a
# new session after such a loss, so the store lets go of them: once the request has ended (the
# same tokens as run-local) the store holds no block referenced or pinned. The supervisor's hang
# check is stretched so that the stopped store is not restarted.
source "$(dirname "$0")/lib.sh"
it_setup kv_lost_reply

P=$(for ((i = 0; i < 160; i++)); do echo $(((i * 37 + 11) % 500 + 1)); done | paste -sd,)
N=8
want=$(run_local --tokens "$P" -n $N --ignore-eos)
expect_words $N "$want" "run-local tokens"

"$PIPELINE" start --model "$MODEL" --backend cpu --supervisor-opt=--hang-periods=30
"$PIPELINE" tune gpu-runner timeout-ms=400 >/dev/null

got=$(generate --tokens "$P" -n $N --ignore-eos)
expect_eq "$got" "$want" "the first request vs run-local"

# none_held KEY: the kv-store's KEY stat is 0.
none_held() { [[ $(stat_value kv-store "$1") == 0 ]]; }
wait_until 20 "the kv-store holds no referenced block after the first request" none_held referenced_blocks

kv=$(cat "$RUN_DIR/kv-store.pid")
hits=$(stat_value kv-store prefix_hits)
kill -STOP "$kv"
generate --tokens "$P" -n $N --ignore-eos >"$IT_TMP/second.out" 2>"$IT_TMP/second.err" &
gen=$!
# Longer than the runner's 400-ms wait for the lookup's reply (the request is sent within it).
sleep 2
kill -CONT "$kv"
wait "$gen" || fail "the request across the stopped kv-store failed: $(cat "$IT_TMP/second.err")"
expect_eq "$(cat "$IT_TMP/second.out")" "$want" "the request across the stopped kv-store vs run-local"
expect_eq "$(cat "$RUN_DIR/kv-store.pid")" "$kv" "the kv-store's pid (not restarted)"
expect_gt "$(stat_value kv-store prefix_hits)" "$hits" "the kv-store's prefix hits (the late lookup found the prompt)"
expect_grep "a kv-store reply was given up: a new session" "$(cat "$RUN_DIR/gpu-runner.log")" \
	"the runner's log"
wait_until 20 "the kv-store holds no referenced block after the request across the stop" none_held referenced_blocks
wait_until 20 "the kv-store holds no pinned block after the request across the stop" none_held pinned_blocks
log "a reply given up while the kv-store lived leaves it holding nothing for the runner"

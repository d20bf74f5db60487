#!/usr/bin/env bash
# kv_lost_reply: a kv-store reply the runner gives up on while the store lives. The kv-store is
# stopped (SIGSTOP) right before a request whose prompt it has cached, until the runner has given
# up its first request (timeout-ms tuned to 1000 for it) and, as it reconnects, started a new
# session. When the store runs again it reads the late request (a prefix lookup, or an allocation)
# and the new HELLO: read first, the late request takes blocks for the old session, which the
# HELLO lets go of; read after, it names an ended session and is refused. Either way, once the
# request has ended (the same tokens as run-local) the store holds no block referenced or pinned.
# The supervisor's hang check is stretched so that the stopped store is not restarted.
# The same with the model split over two runners (--ranks 2), whose kv-store session is the
# formation's: rank 0 gives the reply up, and once idle forms the ranks anew, with a new session.
source "$(dirname "$0")/lib.sh"
it_setup kv_lost_reply

P=$(for ((i = 0; i < 160; i++)); do echo $(((i * 37 + 11) % 500 + 1)); done | paste -sd,)
N=8
want=$(run_local --tokens "$P" -n $N --ignore-eos)
expect_words $N "$want" "run-local tokens"

"$PIPELINE" start --model "$MODEL" --backend cpu --supervisor-opt=--hang-periods=30

got=$(generate --tokens "$P" -n $N --ignore-eos)
expect_eq "$got" "$want" "the first request vs run-local"

# none_held KEY: the kv-store's KEY stat is 0.
none_held() { [[ $(stat_value kv-store "$1") == 0 ]]; }
wait_until 20 "the kv-store holds no referenced block after the first request" none_held referenced_blocks

# The runner's wait for a reply, short only for this request (it bounds the loader's replies too).
"$PIPELINE" tune gpu-runner timeout-ms=1000 >/dev/null
kv=$(cat "$RUN_DIR/kv-store.pid")
kill -STOP "$kv"
generate --tokens "$P" -n $N --ignore-eos >"$IT_TMP/second.out" 2>"$IT_TMP/second.err" &
gen=$!
# The runner gives the request's first kv-store reply up and reconnects (its HELLO then waits for
# the store).
gave_up() { grep -Eq 'kv-store connection lost in the middle of a request|reconnecting to kv-store' "$RUN_DIR/gpu-runner.log"; }
wait_until 60 "the runner giving up a reply of the stopped kv-store" gave_up
sleep 0.5 # its HELLO on the way
kill -CONT "$kv"
wait "$gen" || fail "the request across the stopped kv-store failed: $(cat "$IT_TMP/second.err")"
"$PIPELINE" tune gpu-runner timeout-ms=60000 >/dev/null
expect_eq "$(cat "$IT_TMP/second.out")" "$want" "the request across the stopped kv-store vs run-local"
expect_eq "$(cat "$RUN_DIR/kv-store.pid")" "$kv" "the kv-store's pid (not restarted)"
wait_until 20 "the kv-store holds no referenced block after the request across the stop" none_held referenced_blocks
wait_until 20 "the kv-store holds no pinned block after the request across the stop" none_held pinned_blocks
expect_grep 'a kv-store reply was given up: a new session' "$(cat "$RUN_DIR/gpu-runner.log")" "the runner's log"
log "a reply given up while the kv-store lived leaves it holding nothing for the runner"
"$PIPELINE" stop >/dev/null

# ---- a split model: rank 0 gives the reply up --------------------------------------------------
"$PIPELINE" start --model "$MODEL" --backend cpu --ranks 2 --supervisor-opt=--hang-periods=30
got=$(generate --tokens "$P" -n $N --ignore-eos)
expect_eq "$got" "$want" "two ranks: the first request vs run-local"
wait_until 20 "two ranks: the kv-store holds no referenced block after the first request" none_held referenced_blocks
"$PIPELINE" tune gpu-runner timeout-ms=1000 >/dev/null
kv=$(cat "$RUN_DIR/kv-store.pid")
seen=$(wc -l <"$RUN_DIR/gpu-runner.log") # the log goes on from the first instance's
gave_up_now() { tail -n +$((seen + 1)) "$RUN_DIR/gpu-runner.log" | grep -Eq 'kv-store connection lost in the middle of a request|reconnecting to kv-store'; }
kill -STOP "$kv"
generate --tokens "$P" -n $N --ignore-eos >"$IT_TMP/split.out" 2>"$IT_TMP/split.err" &
gen=$!
wait_until 60 "two ranks: rank 0 giving up a reply of the stopped kv-store" gave_up_now
sleep 0.5
kill -CONT "$kv"
wait "$gen" || fail "two ranks: the request across the stopped kv-store failed: $(cat "$IT_TMP/split.err")"
"$PIPELINE" tune gpu-runner timeout-ms=60000 >/dev/null
expect_eq "$(cat "$IT_TMP/split.out")" "$want" "two ranks: the request across the stopped kv-store vs run-local"
wait_until 20 "two ranks: the kv-store holds no referenced block after the request across the stop" none_held \
	referenced_blocks
wait_until 20 "two ranks: the kv-store holds no pinned block after the request across the stop" none_held pinned_blocks
expect_grep 'a kv-store reply was given up: the ranks are formed anew' "$(tail -n +$((seen + 1)) "$RUN_DIR/gpu-runner.log")" \
	"rank 0's log"
got=$(generate --tokens "$P" -n $N --ignore-eos)
expect_eq "$got" "$want" "two ranks: a request after the new formation vs run-local"
log "two ranks: a reply given up by rank 0 leaves the kv-store holding nothing once the ranks are formed anew"

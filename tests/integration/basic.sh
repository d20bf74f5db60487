#!/usr/bin/env bash
# basic: start on the tiny model; greedy and seeded sampled generation through the services
# give exactly what run-local (one process, no services) gives; sampling repeats itself.
source "$(dirname "$0")/lib.sh"
it_setup basic

# From the model's folder, by a relative path, with a CDPATH that names "." (whose cd prints the
# directory it went to: into $(cd DIR && pwd) where the script did not unset it).
(cd "$(dirname "$MODEL")" && CDPATH=.:/usr "$PIPELINE" start --model "$(basename "$MODEL")")
"$PIPELINE" status >/dev/null || fail "status after start does not report all services up"

want=$(run_local --tokens "$PROMPT" -n 64)
expect_words 64 "$want" "run-local greedy"
got=$(generate --tokens "$PROMPT" -n 64)
expect_eq "$got" "$want" "greedy tokens through the services vs run-local"
log "greedy: 64 tokens equal run-local"

sample=(--temperature 0.8 --top-k 40 --top-p 0.9 --seed 7)
want=$(run_local --tokens "$PROMPT" -n 64 "${sample[@]}")
expect_words 64 "$want" "run-local sampled"
got=$(generate --tokens "$PROMPT" -n 64 "${sample[@]}")
expect_eq "$got" "$want" "seeded sampled tokens through the services vs run-local"
again=$(generate --tokens "$PROMPT" -n 64 "${sample[@]}")
expect_eq "$again" "$got" "the same seeded sampling twice"
log "sampled (seed 7): equal run-local and repeatable"

# Another seed gives another sequence: the seed reaches the sampler.
other=$(generate --tokens "$PROMPT" -n 64 --temperature 0.8 --top-k 40 --top-p 0.9 --seed 8)
[[ $other != "$got" ]] || fail "seeds 7 and 8 gave the same 64 sampled tokens"

# A repetition penalty so small that penalised logits would be infinite: refused by the runner (it
# made every draw the vocabulary's last id).
out=$(generate --tokens "$PROMPT" -n 4 --temperature 1 --repetition-penalty 1e-45 2>&1) &&
	fail "a repetition penalty of 1e-45 was taken: $out"
expect_grep "repetition_penalty 0 \(off\) or in \[1e-6, 1e6\]" "$out" "a repetition penalty of 1e-45"

# A client that does not read for a while (stopped 3 s once its 4000 tokens have begun) gets every
# one and the end: the runner's replies wait for it (they were dropped past ZeroMQ's default queue
# of 1000, the end with them, and the client waited out its timeout).
want=$(generate --tokens "$PROMPT" -n 4000 --ignore-eos)
expect_words 4000 "$want" "4000 tokens"
"$PIPECTL" --timeout 60 generate --tokens "$PROMPT" -n 4000 --ignore-eos >"$IT_TMP/slow" 2>"$IT_TMP/slow.err" &
client=$!
( sleep 90 && kill "$client" ) >/dev/null 2>&1 &
watchdog=$!
begun() { [[ -s $IT_TMP/slow ]]; }
wait_until 20 "the 4000-token stream begins" begun
kill -STOP "$client"
sleep 3
kill -CONT "$client"
wait "$client" || fail "a client stopped 3 s during its stream: $(tail -c 300 "$IT_TMP/slow.err")"
kill "$watchdog" 2>/dev/null || true
expect_eq "$(cat "$IT_TMP/slow")" "$want" "the tokens of a client stopped 3 s during its stream"
log "a client stopped 3 s during a 4000-token stream: every token and the end"

"$PIPELINE" stop
expect_nothing_left "after stop"
log "ok"

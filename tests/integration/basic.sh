#!/usr/bin/env bash
# basic: start on the tiny model; greedy and seeded sampled generation through the services
# give exactly what run-local (one process, no services) gives; sampling repeats itself.
source "$(dirname "$0")/lib.sh"
it_setup basic

"$PIPELINE" start --model "$MODEL"
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

"$PIPELINE" stop
expect_nothing_left "after stop"
log "ok"

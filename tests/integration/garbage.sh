#!/usr/bin/env bash
# garbage: malformed and nonsensical requests to every service (pipeline-garbage, a test tool:
# tests/tools/garbage) are each answered with an error; the services keep serving and
# generation stays right.
source "$(dirname "$0")/lib.sh"
it_setup garbage
GARBAGE=$BIN/pipeline-garbage
[[ -x $GARBAGE ]] || fail "$GARBAGE is not built"

"$PIPELINE" start --model "$MODEL"
want=$(run_local --tokens "$PROMPT" -n 64)
for service in kv-store ssd-loader gpu-runner; do
	if ! out=$("$GARBAGE" "$service" 2>&1); then
		printf '%s\n' "$out" >&2
		fail "pipeline-garbage $service"
	fi
	expect_grep "^$service still answers after [0-9]+ malformed requests \(0 handled wrongly\)" "$out" \
		"pipeline-garbage $service"
	log "$(tail -n 1 <<<"$out")"
done
"$PIPELINE" status >/dev/null || fail "status after the garbage does not report all services up"
got=$(generate --tokens "$PROMPT" -n 64)
expect_eq "$got" "$want" "tokens after the garbage vs run-local"

"$PIPELINE" stop
expect_nothing_left "after stop"
log "ok"

#!/usr/bin/env bash
# supervisor_exec: a service that was up dies while its binary cannot be run (a rebuild rewriting
# it, a package being upgraded): the supervisor's restart fails to exec, and it is tried again
# after its backoff, as after any death, rather than given up as a command line the service
# refuses; once the binary is back the service is up again and serves the same tokens.
source "$(dirname "$0")/lib.sh"
it_setup supervisor_exec

# The instance runs the binaries from a folder of links of its own, so that one can go away.
bin=$IT_TMP/bin
mkdir "$bin"
for b in "$BIN"/*; do
	ln -s "$b" "$bin/$(basename "$b")"
done
export PIPELINE_BIN_DIR=$bin

"$PIPELINE" start --model "$MODEL"
want=$(run_local --tokens "$PROMPT" -n 32)
expect_eq "$(generate --tokens "$PROMPT" -n 32)" "$want" "tokens before the kill vs run-local"

old=$(sup_field kv-store pid)
[[ $old =~ ^[0-9]+$ ]] || fail "no pid of kv-store in the supervisor's status: '$old'"
rm "$bin/kv-store"
kill -9 "$old"
exec_failed() { [[ $(sup_field kv-store last_error) == *"cannot run"* ]]; }
wait_until 30 "the supervisor's failed run of the missing kv-store" exec_failed
state=$(sup_field kv-store state)
[[ $state != '"failed"' ]] || fail "kv-store given up after one failed exec: $(sup_field kv-store last_error)"
ln -s "$BIN/kv-store" "$bin/kv-store"
wait_until 60 "kv-store up again once its binary is back" restarted kv-store "$old"
expect_gt "$(sup_field kv-store restarts)" 1 "kv-store's restarts (the failed exec and the one that ran)"
expect_eq "$(generate --tokens "$PROMPT" -n 32)" "$want" "tokens after the restart vs run-local"
log "kv-store restarted after $(sup_field kv-store restarts) tries once its binary was back"

# A start whose kv-store cannot be run fails at once, saying which binary (checked before any runs).
"$PIPELINE" stop >/dev/null
rm "$bin/kv-store"
expect_start_fails "a start with kv-store missing" "kv-store is not an executable" --model "$MODEL"
log "PASS"

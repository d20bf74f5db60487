#!/usr/bin/env bash
# supervisor_exec: what the supervisor runs when it restarts a service.
#  - The binary it started with, held open: a rebuild or an upgrade that puts another file at the
#    path (services of two builds may disagree on a shared-memory layout), or removes it, changes
#    nothing for a running instance; the service comes back and serves the same tokens.
#  - A wrapped service is started by its wrapper's path: a restart whose wrapper cannot be run
#    fails to exec, and is tried again after its backoff, as after any death, rather than given up
#    as a command line the service refuses; once the wrapper is back the service is up again.
#  - A start whose binary cannot be run fails at once, saying which binary.
source "$(dirname "$0")/lib.sh"
it_setup supervisor_exec

# The instance runs the binaries from a folder of links of its own, so that one can change.
bin=$IT_TMP/bin
mkdir "$bin"
for b in "$BIN"/*; do
	ln -s "$b" "$bin/$(basename "$b")"
done
export PIPELINE_BIN_DIR=$bin

"$PIPELINE" start --model "$MODEL"
want=$(run_local --tokens "$PROMPT" -n 32)
expect_eq "$(generate --tokens "$PROMPT" -n 32)" "$want" "tokens before the kill vs run-local"

# Another program at the path (a "new build" that would leave a mark and fail): not run.
old=$(sup_field kv-store pid)
[[ $old =~ ^[0-9]+$ ]] || fail "no pid of kv-store in the supervisor's status: '$old'"
rm "$bin/kv-store"
printf '#!/bin/sh\ntouch %q\nexit 3\n' "$IT_TMP/new-build-ran" >"$bin/kv-store"
chmod +x "$bin/kv-store"
kill -9 "$old"
wait_until 60 "kv-store up again after the binary at its path changed" restarted kv-store "$old"
[[ ! -e $IT_TMP/new-build-ran ]] || fail "the supervisor ran the file now at kv-store's path"
expect_eq "$(generate --tokens "$PROMPT" -n 32)" "$want" "tokens after the restart vs run-local"
log "kv-store restarted from the binary it started with, not the one now at its path"
# No file at the path at all: the same.
old=$(sup_field kv-store pid)
rm "$bin/kv-store"
kill -9 "$old"
wait_until 60 "kv-store up again with no file at its path" restarted kv-store "$old"
expect_eq "$(generate --tokens "$PROMPT" -n 32)" "$want" "tokens after the second restart vs run-local"
ln -s "$BIN/kv-store" "$bin/kv-store"
log "kv-store restarted with its path empty"
"$PIPELINE" stop >/dev/null

# A wrapper that goes away: the restart fails to exec and is tried again until it is back.
wrap=$IT_TMP/wrap
printf '#!/bin/sh\nexec "$@"\n' >"$wrap"
chmod +x "$wrap"
PIPELINE_WRAP_KV_STORE=$wrap "$PIPELINE" start --model "$MODEL"
old=$(sup_field kv-store pid)
[[ $old =~ ^[0-9]+$ ]] || fail "no pid of the wrapped kv-store: '$old'"
mv "$wrap" "$wrap.away"
kill -9 "$old"
exec_failed() { [[ $(sup_field kv-store last_error) == *"cannot run"* ]]; }
wait_until 30 "the supervisor's failed run of the missing wrapper" exec_failed
state=$(sup_field kv-store state)
[[ $state != '"failed"' ]] || fail "kv-store given up after one failed exec: $(sup_field kv-store last_error)"
mv "$wrap.away" "$wrap"
wait_until 60 "kv-store up again once its wrapper was back" restarted kv-store "$old"
expect_gt "$(sup_field kv-store restarts)" 1 "kv-store's restarts (the failed exec and the one that ran)"
expect_eq "$(generate --tokens "$PROMPT" -n 32)" "$want" "tokens after the restart vs run-local"
log "wrapped kv-store restarted after $(sup_field kv-store restarts) tries once its wrapper was back"

# A start whose kv-store cannot be run fails at once, saying which binary (checked before any runs).
"$PIPELINE" stop >/dev/null
rm "$bin/kv-store"
expect_start_fails "a start with kv-store missing" "kv-store is not an executable" --model "$MODEL"
log "PASS"

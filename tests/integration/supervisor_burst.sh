#!/usr/bin/env bash
# supervisor_burst: the restart limit. ssd-loader runs under a wrapper (PIPELINE_WRAP_SSD_LOADER)
# that fails while a flag file exists. With the flag at start, the supervisor restarts the loader
# with a growing backoff, gives up after 5 restarts, and start fails naming it and showing its log.
# With the flag set later, a kill -9 of the (wrapped) loader leads to the same: status shows it
# failed with the error, and the others still run. restart brings it back once the flag is gone.
# Last, with the supervisor killed and the wrapped loader stopped, stop ends the loader too.
source "$(dirname "$0")/lib.sh"
it_setup supervisor_burst

FLAG=$IT_TMP/fail
# Not exec: the wrapper stays the loader's parent, as a sanitizer or a debugger would.
cat >"$IT_TMP/wrap" <<WRAP
#!/bin/sh
if [ -e "$FLAG" ]; then
	echo "wrap: failing on purpose" >&2
	exit 3
fi
"\$@"
exit \$?
WRAP
chmod +x "$IT_TMP/wrap"
export PIPELINE_WRAP_SSD_LOADER=$IT_TMP/wrap

touch "$FLAG"
rc=0
out=$("$PIPELINE" start --model "$MODEL" 2>&1) || rc=$?
((rc == 1)) || fail "start with a loader that always fails: exit status $rc, want 1: $out"
expect_grep 'ssd-loader failed: gave up after 5 restarts within 60 s; the last: exited with status 3' "$out" \
	"start's report of the loader"
expect_grep '\| wrap: failing on purpose' "$out" "the loader's log in start's report"
expect_nothing_left "after the failed start"
log "start: $(grep 'ssd-loader failed' <<<"$out")"

rm -f "$FLAG"
"$PIPELINE" start --model "$MODEL"
want=$(generate --tokens "$PROMPT" -n 16)
expect_words 16 "$want" "tokens with the wrapped loader"
wrapper=$(sup_field ssd-loader pid)
loader=$(sup_field ssd-loader service_pid)
[[ $loader != "$wrapper" ]] || fail "the loader's own pid ($loader) is the wrapper's"
touch "$FLAG"
kill -KILL "$wrapper"
failed() { [[ $(sup_field ssd-loader state) == '"failed"' ]]; }
wait_until 60 "ssd-loader given up" failed
[[ ! -e /proc/$loader ]] || fail "the loader under the killed wrapper (pid $loader) still runs"
expect_eq "$(sup_field ssd-loader restarts)" 5 "restarts of ssd-loader when given up"
expect_eq "$(sup_field ssd-loader health)" '"failed"' "health of ssd-loader"
expect_eq "$(sup_field ssd-loader pid)" null "pid of a failed ssd-loader"
expect_grep '^"gave up after 5 restarts within 60 s; the last: exited with status 3 before it answered HELLO"$' \
	"$(sup_field ssd-loader last_error)" "last error of ssd-loader"
expect_eq "$(sup_field ssd-loader last_exit)" '"exit 3"' "last exit of ssd-loader"
for s in kv-store gpu-runner; do
	expect_eq "$(sup_field "$s" state)" '"up"' "state of $s while the loader is failed"
done
rc=0
out=$("$PIPELINE" status) || rc=$?
((rc == 1)) || fail "status with a failed service: exit status $rc, want 1"
expect_grep '^ssd-loader +- +failed +failed .* gave up after 5 restarts' "$out" "status with a failed loader"
log "kill -9 with the flag: $(grep '^ssd-loader' <<<"$out" | tr -s ' ')"

rm -f "$FLAG"
"$PIPELINE" restart ssd-loader
expect_eq "$(sup_field ssd-loader state)" '"up"' "state of ssd-loader after restart"
"$PIPELINE" status >/dev/null || fail "status after the loader came back does not report all services up"
got=$(generate --tokens "$PROMPT" -n 16)
expect_eq "$got" "$want" "tokens after the loader came back"

"$PIPELINE" stop
expect_nothing_left "after stop"

# The supervisor killed, and the wrapped loader stopped (SIGSTOP): stop signals the loader's
# process group, not the wrapper alone, so the loader under it goes too (before, the wrapper
# died of SIGTERM and the stopped loader stayed, its ring with it).
"$PIPELINE" start --model "$MODEL"
wrapper=$(sup_field ssd-loader pid)
loader=$(sup_field ssd-loader service_pid)
[[ $loader =~ ^[0-9]+$ && $loader != "$wrapper" ]] || fail "the wrapped loader's pid: '$loader' (wrapper $wrapper)"
kill -KILL "$(cat "$RUN_DIR/supervisor.pid")"
kill -STOP "$loader"
rc=0
out=$("$PIPELINE" stop 2>&1) || rc=$?
((rc == 0)) || fail "stop with the supervisor gone and the wrapped loader stopped: exit status $rc: $out"
proc_gone "$loader" || fail "the stopped loader under its wrapper (pid $loader) survived stop"
expect_nothing_left "after stop without the supervisor"

# Failures slower than the window counts: the loader fails 1.5 s after each start, the window is
# 1 s and the limit 2, so no two restarts fall in one window. Restarts in a row that end before
# HELLO count too: given up after two (it used to restart for ever).
cat >"$IT_TMP/slow" <<'WRAP'
#!/bin/sh
sleep 1.5
echo "slow: failing on purpose" >&2
exit 3
WRAP
chmod +x "$IT_TMP/slow"
rc=0
out=$(PIPELINE_WRAP_SSD_LOADER=$IT_TMP/slow "$PIPELINE" start --model "$MODEL" \
	--supervisor-opt=--burst-limit=2 --supervisor-opt=--burst-window-s=1 2>&1) || rc=$?
((rc == 1)) || fail "start with a loader that fails slowly: exit status $rc, want 1: $out"
expect_grep 'ssd-loader failed: gave up after 2 restarts in a row, each ended before it answered HELLO' "$out" \
	"start's report of the slowly failing loader"
expect_nothing_left "after the start with a slowly failing loader"
log "$(grep -o 'ssd-loader failed: gave up after 2 restarts in a row[^;]*' <<<"$out")"
log "ok"

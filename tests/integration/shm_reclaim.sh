#!/usr/bin/env bash
# shm_reclaim: the shared-memory objects of an instance and their owners.
#   1. The whole instance killed at once (kill -9 of the supervisor and of every service): its
#      objects, sockets and pid files stay behind. start again works: the loader reclaims the
#      weight ring its dead predecessor left, kv-store takes over its pool, and the logs say so;
#      the tokens are the same.
#   2. An object owned by a live process is refused: a second instance of the same name in another
#      run directory does not start, with a message naming the owner's pid, and its failed start
#      leaves the live instance's objects alone; a kv-store and an ssd-loader started by hand
#      against them are refused the same way.
#   3. A spill file outside the run directory (--spill-file) goes with a clean stop, and with the
#      cleanup of stop after the whole instance was killed.
source "$(dirname "$0")/lib.sh"
it_setup shm_reclaim

start_opts=(--model "$MODEL" --kv-gpu-budget 32KiB --kv-dram-budget 16KiB --runner-opt=--prefill-chunk=16)
"$PIPELINE" start "${start_opts[@]}" >/dev/null
want=$(run_local --tokens "$PROMPT" -n 32)
expect_eq "$(generate --tokens "$PROMPT" -n 32)" "$want" "tokens before the kill"
objects=$(instance_shm | sort)
expect_eq "$(wc -l <<<"$objects")" 2 "shared-memory objects of the running instance ($objects)"

# 1. kill -9 of everything, the supervisor first (it would restart the others).
sup=$(cat "$RUN_DIR/supervisor.pid")
pids=("$sup")
for s in kv-store ssd-loader gpu-runner; do pids+=("$(cat "$RUN_DIR/$s.pid")"); done
kill -KILL "${pids[@]}"
dead() {
	local p
	for p in "${pids[@]}"; do
		proc_gone "$p" || return 1
	done
}
wait_until 10 "the instance's processes gone after kill -9" dead
expect_eq "$(instance_shm | sort)" "$objects" "shared-memory objects left by the killed instance"
for s in kv-store ssd-loader gpu-runner; do
	[[ -S $RUN_DIR/$s.ctl && -f $RUN_DIR/$s.pid ]] || fail "the killed $s left no socket or pid file (the test needs leftovers)"
done
log "killed the whole instance (pids ${pids[*]}): left $(tr '\n' ' ' <<<"$objects")"

"$PIPELINE" start "${start_opts[@]}" >/dev/null || fail "start after the whole instance was killed failed"
weights=/llmp-$(id -u)-$INSTANCE-weights
kvpool=/llmp-$(id -u)-$INSTANCE-kv
grep -q "reclaiming shared-memory object $weights left by a dead instance" "$RUN_DIR/ssd-loader.log" ||
	fail "ssd-loader's log does not say it reclaimed $weights: $(tail -n 5 "$RUN_DIR/ssd-loader.log")"
grep -qE "(adopted|reclaiming) shared-memory object $kvpool left by a dead (owner|instance)" "$RUN_DIR/kv-store.log" ||
	fail "kv-store's log does not say it took over $kvpool: $(tail -n 5 "$RUN_DIR/kv-store.log")"
expect_eq "$(generate --tokens "$PROMPT" -n 32)" "$want" "tokens after the restart over the leftovers"
for f in $(instance_shm); do
	owner=$(od -An -t d4 -j 32 -N 4 "$f" | tr -d ' ')
	for p in "${pids[@]}"; do
		[[ $owner != "$p" ]] || fail "$f is still recorded as owned by the killed pid $p"
	done
done
log "start over the leftovers: the weight ring reclaimed, the KV pool taken over, tokens unchanged"

# 2. A second instance of the same name, in another run directory, is refused.
kv_pid=$(sup_field kv-store service_pid)
loader_pid=$(sup_field ssd-loader service_pid)
objects=$(instance_shm | sort)
rc=0
out=$(PIPELINE_RUN_DIR=$IT_TMP/run2 "$PIPELINE" start "${start_opts[@]}" 2>&1) || rc=$?
((rc == 1)) || fail "a second instance $INSTANCE in another run directory: start exited $rc, want 1: $out"
expect_grep "is owned by the live process ($kv_pid|$loader_pid)" "$out" "the refusal of the second instance"
expect_eq "$(instance_shm | sort)" "$objects" "the live instance's objects after the refused second start"
expect_eq "$(generate --tokens "$PROMPT" -n 32)" "$want" "tokens of the live instance after the refused second start"
for f in "$IT_TMP"/run2/*.ctl "$IT_TMP"/run2/*.pub "$IT_TMP"/run2/*.pid; do
	[[ -e $f ]] && fail "the refused second start left $f"
done
log "a second instance of the same name is refused: $(grep -oE 'is owned by the live process [0-9]+' <<<"$out" | head -n 1)"

# The services started by hand against the live objects.
mkdir -m 0700 "$IT_TMP/run3"
rc=0
out=$("$BIN/kv-store" --instance "$INSTANCE" --run-dir "$IT_TMP/run3" 2>&1) || rc=$?
((rc == 1)) || fail "a second kv-store over the live pool exited $rc, want 1: $out"
expect_grep "KV pool $kvpool is owned by the live process $kv_pid" "$out" "the second kv-store's refusal"
rc=0
out=$("$BIN/ssd-loader" --instance "$INSTANCE" --run-dir "$IT_TMP/run3" --model "$MODEL" 2>&1) || rc=$?
((rc == 1)) || fail "a second ssd-loader over the live ring exited $rc, want 1: $out"
expect_grep "$weights is owned by the live process $loader_pid" "$out" "the second ssd-loader's refusal"
expect_eq "$(instance_shm | sort)" "$objects" "the live instance's objects after the refused services"
log "a kv-store and an ssd-loader started by hand over the live objects are refused, naming the owners"

"$PIPELINE" stop >/dev/null
expect_nothing_left "after stop"

# 3. A spill file placed outside the run directory (--spill-file): a clean stop removes it; after a
#    kill -9 of the whole instance, stop's cleanup removes it too (its place is recorded).
spill=$IT_TMP/elsewhere/spill.bin
mkdir -m 0700 "$IT_TMP/elsewhere"
"$PIPELINE" start "${start_opts[@]}" --kv-opt "--spill-file=$spill" >/dev/null
expect_eq "$(generate --tokens "$PROMPT" -n 32)" "$want" "tokens with the spill file elsewhere"
[[ -f $spill ]] || fail "no spill file at $spill"
"$PIPELINE" stop >/dev/null
[[ ! -e $spill ]] || fail "a clean stop left the spill file $spill"
expect_nothing_left "after a clean stop with the spill file elsewhere"
"$PIPELINE" start "${start_opts[@]}" --kv-opt "--spill-file=$spill" >/dev/null
expect_eq "$(generate --tokens "$PROMPT" -n 32)" "$want" "tokens with the spill file elsewhere, again"
pids=("$(cat "$RUN_DIR/supervisor.pid")")
for s in kv-store ssd-loader gpu-runner; do pids+=("$(cat "$RUN_DIR/$s.pid")"); done
kill -KILL "${pids[@]}"
wait_until 10 "the instance's processes gone after kill -9" dead
[[ -f $spill ]] || fail "the killed kv-store's spill file $spill is gone before stop (the test needs it)"
"$PIPELINE" stop >/dev/null
[[ ! -e $spill ]] || fail "stop after a kill -9 left the spill file $spill"
expect_nothing_left "after stop of the killed instance with the spill file elsewhere"
log "a spill file elsewhere: removed by a clean stop, and by the cleanup after a kill -9"
log "ok"

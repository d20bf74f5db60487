#!/usr/bin/env bash
# permissions: what an instance makes is its user's alone. While it runs, every shared-memory
# object /dev/shm/llmp-<uid>-<instance>-* is mode 0600, the run directory 0700, and nothing in it
# (sockets, pid files, logs, start.args, the spill file) grants anything to group or others. A
# run directory that exists with mode 0755 is tightened to 0700, by scripts/pipeline start and by
# a service started by hand alike (service.h, run_dir_prepare); one owned by another user is
# refused, and so is one below a directory others may write.
source "$(dirname "$0")/lib.sh"
it_setup permissions

# A looser run directory made beforehand, as a careless umask would.
mkdir -m 0755 "$RUN_DIR"
expect_eq "$(stat -c %a "$RUN_DIR")" 755 "the run directory's mode before start"
"$PIPELINE" start --model "$MODEL" --kv-gpu-budget 32KiB --kv-dram-budget 16KiB --runner-opt=--prefill-chunk=16 \
	>/dev/null
expect_words 16 "$(generate --tokens "$PROMPT" -n 16)" "tokens"

expect_eq "$(stat -c %a "$RUN_DIR")" 700 "the run directory's mode while the instance runs"
objects=$(instance_shm)
expect_eq "$(wc -l <<<"$objects")" 2 "shared-memory objects of the instance ($objects)"
for f in $objects; do
	expect_eq "$(stat -c '%a %u' "$f")" "600 $(id -u)" "mode and owner of $f"
done
for s in supervisor kv-store ssd-loader gpu-runner; do
	[[ -S $RUN_DIR/$s.ctl && -S $RUN_DIR/$s.pub && -f $RUN_DIR/$s.pid ]] || fail "no socket or pid file of $s in $RUN_DIR"
done
[[ -f $RUN_DIR/kv-spill.bin && -f $RUN_DIR/start.args ]] || fail "no spill file or start.args in $RUN_DIR"
loose=$(find "$RUN_DIR" -mindepth 1 -perm /077 -printf '%m %p\n')
[[ -z $loose ]] || fail "files in the run directory that group or others may use: $loose"
log "run directory 0700 (was 0755), $(wc -l <<<"$objects") shared-memory objects 0600, nothing in $RUN_DIR for group or others"
"$PIPELINE" stop >/dev/null
expect_nothing_left "after stop"

# A run directory below one that others may write (not sticky), however far up, is refused by
# start before it writes anything there: they could rename the way to it and put their own.
open_dir=$IT_TMP/open
mkdir -p "$open_dir/mine"
chmod 0777 "$open_dir"
chmod 0700 "$open_dir/mine"
rc=0
out=$(PIPELINE_RUN_DIR=$open_dir/mine/run "$PIPELINE" start --model "$MODEL" 2>&1) || rc=$?
((rc == 1)) || fail "start below a directory others may write: exit $rc, not 1: $out"
expect_grep "$open_dir, a directory above the run directory, is writable by other users" "$out" \
	"the refusal of a run directory below one others may write"
[[ ! -e $open_dir/mine/run ]] || fail "start made $open_dir/mine/run before it refused it"
chmod 1777 "$open_dir" # sticky, as /tmp is: taken
PIPELINE_RUN_DIR=$open_dir/mine/run "$PIPELINE" start --model "$MODEL" >/dev/null
PIPELINE_RUN_DIR=$open_dir/mine/run "$PIPELINE" stop >/dev/null
log "a run directory below one that others may write (not sticky): refused before anything is made; sticky: taken"

# A service started by hand tightens a looser run directory itself.
dir=$IT_TMP/by-hand
mkdir -m 0755 "$dir"
"$BIN/kv-store" --instance "$INSTANCE-hand" --run-dir "$dir" --kv-dram-budget 16KiB >"$IT_TMP/kv-hand.log" 2>&1 &
kv=$!
up() { [[ -S $dir/kv-store.ctl ]]; }
wait_until 20 "a kv-store started by hand serving" up
expect_eq "$(stat -c %a "$dir")" 700 "the mode of a 0755 run directory after a service started in it"
"$PIPECTL" --run-dir "$dir" --instance "$INSTANCE-hand" shutdown kv-store >/dev/null
wait "$kv" || fail "the kv-store started by hand exited with status $?: $(cat "$IT_TMP/kv-hand.log")"
[[ -z $(ls /dev/shm/llmp-"$(id -u)"-"$INSTANCE"-hand-* 2>/dev/null) ]] || fail "the kv-store started by hand left shared memory"

# One owned by another user is refused (as root, which can give a directory away).
if (($(id -u) == 0)); then
	other=$IT_TMP/theirs
	mkdir -m 0700 "$other"
	chown 65534 "$other"
	rc=0
	out=$("$BIN/kv-store" --instance "$INSTANCE-theirs" --run-dir "$other" 2>&1) || rc=$?
	((rc != 0)) || fail "kv-store started in a run directory of uid 65534"
	expect_grep "run directory $other belongs to uid 65534, not to us" "$out" "the refusal of another user's run directory"
	log "a 0755 run directory is tightened to 0700 by a service too; another user's is refused"
else
	log "a 0755 run directory is tightened to 0700 by a service too (not root: another user's run directory not tried)"
fi
log "ok"

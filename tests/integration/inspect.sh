#!/usr/bin/env bash
# inspect: pipeline-inspect attached to an instance whose every tier works (weights streamed,
# KV spilled), snapshots taken in a loop and a live view running while it generates: the tokens
# are those of a generation nobody watched, the shared-memory objects and the run directory are
# as they were, the inspector maps the objects read-only, its JSON has every section with
# numbers that add up, a named service shows alone, and no instance fails with a message.
source "$(dirname "$0")/lib.sh"
it_setup inspect
INSPECT=$BIN/pipeline-inspect
[[ -x $INSPECT ]] || fail "$INSPECT is not built"
command -v python3 >/dev/null || {
	log "python3 is needed to check the JSON: skipped"
	exit 77
}

# More words than SERVICE takes: refused (they overran a four-entry array before).
rc=0
out=$("$INSPECT" --once $(seq 1 3000) 2>&1) || rc=$?
expect_eq "$rc" 2 "pipeline-inspect with 3000 words: its exit status"
expect_eq "$out" "pipeline-inspect: one SERVICE at most (see --help)" "pipeline-inspect with 3000 words"
# A run directory without its instance (its sockets were shown beside instance default's shared
# memory), and an instance name with a '/': refused.
rc=0
out=$(env -u PIPELINE_INSTANCE "$INSPECT" --run-dir "$RUN_DIR" --once 2>&1) || rc=$?
expect_eq "$rc" 2 "pipeline-inspect --run-dir alone: its exit status"
expect_grep "needs --instance too" "$out" "pipeline-inspect --run-dir alone"
rc=0
out=$("$INSPECT" --instance a/b --once 2>&1) || rc=$?
expect_eq "$rc" 2 "pipeline-inspect --instance a/b: its exit status"
expect_grep "hold no '/'" "$out" "pipeline-inspect --instance a/b"

out=$("$PIPELINE" inspect --once 2>&1) && fail "inspect of an instance that is not running succeeded: $out"
expect_eq "$out" "pipeline-inspect: no instance $INSTANCE running (run dir $RUN_DIR)" "inspect without an instance"

# Garbage behind a valid shared-memory header (an owner alive: this shell) is reported, not
# followed: the sections say why they are not attached, and the exit status is 0.
garbage=${INSTANCE}x
python3 - "/dev/shm/llmp-$(id -u)-$garbage" "$$" <<'PY'
import random, struct, sys
rng = random.Random(7)
for obj, kind, version in (("weights", 1, 3), ("kv", 2, 2)):
    data = bytearray(rng.getrandbits(8) for _ in range(65536))
    # struct shm_header: magic, kind, layout_version, total_size, instance_id, owner_pid,
    # adoptions, owner_start (0: any process of that pid), ready
    struct.pack_into("<QIIQQiIQI", data, 0, 0x4d485350504c4c4c, kind, version, len(data), 1, int(sys.argv[2]), 0, 0, 1)
    with open(f"{sys.argv[1]}-{obj}", "wb") as f:
        f.write(data)
PY
status=0
json=$("$INSPECT" --instance "$garbage" --run-dir "$IT_TMP/garbage" --once --json --wait-ms 0) || status=$?
rm -f "/dev/shm/llmp-$(id -u)-$garbage-weights" "/dev/shm/llmp-$(id -u)-$garbage-kv"
((status == 0)) || fail "inspect of garbage shared memory exited $status"
python3 -c '
import json, sys
d = json.load(sys.stdin)
for name in ("ssd-loader", "kv-store"):
    shm = d["services"][name]["shm"]
    assert not shm["attached"] and shm["error"], shm
    assert not d["services"][name]["up"]
' <<<"$json" || fail "inspect of garbage shared memory: $json"

# The budgets of the tiers test: half way between the loader's minimum and the whole model, so
# layers stream; small KV tiers, so blocks go to kv-store and spill to disk.
out=$("$PIPELINE" start --model "$MODEL" --dram-budget 4KiB 2>&1) && fail "start with a 4 KiB DRAM budget succeeded"
need=$(sed -n 's/.*need at least [^(]*(\([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
whole=$(sed -n 's/.*whole model resident needs \([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
[[ -n $need && -n $whole ]] || fail "cannot read the loader's minimum from: $out"
"$PIPELINE" start --model "$MODEL" --dram-budget $(((need + whole) / 2)) --kv-gpu-budget 32KiB --kv-dram-budget 16KiB \
	--runner-opt=--prefill-chunk=16 >/dev/null

sample=(--temperature 0.8 --top-k 40 --top-p 0.9 --seed 7)
# The greedy run is long (a few seconds here), so that snapshots catch the runner generating.
want_greedy=$(generate --tokens "$PROMPT" -n 400)
want_sampled=$(generate --tokens "$PROMPT" -n 160 "${sample[@]}")
expect_words 400 "$want_greedy" "greedy tokens without inspect"

# What inspect must leave as it was: each object's mode, size, inode and owner; the run directory.
shm_state() {
	local f
	for f in $(instance_shm); do
		stat -c '%n %a %s %i %u' "$f"
	done
}
run_dir_state() {
	find "$RUN_DIR" -maxdepth 1 ! -name '*.log' -printf '%f %m %s\n' | sort
}
shm_before=$(shm_state)
dir_before=$(run_dir_state)
[[ $(wc -l <<<"$shm_before") == 2 ]] || fail "expected the weight ring and the KV pool, found: $shm_before"

# A live view (not a terminal: one text snapshot a second) and --once --json in a loop, while
# the same two generations run again.
"$INSPECT" >"$IT_TMP/live.txt" 2>&1 &
live=$!
(
	for ((i = 0; ; i++)); do
		[[ -e $IT_TMP/stop ]] && exit 0
		"$PIPELINE" inspect --once --json >"$IT_TMP/snap.$i.json" || exit 1
	done
) &
loop=$!
t0=$(date +%s%N)
got_greedy=$(generate --tokens "$PROMPT" -n 400)
gen_ms=$((($(date +%s%N) - t0) / 1000000))
got_sampled=$(generate --tokens "$PROMPT" -n 160 "${sample[@]}")
# The inspector's mappings of the objects: shared and read-only ("r--s").
maps=$(grep -F "/dev/shm/llmp-$(id -u)-$INSTANCE-" "/proc/$live/maps" || true)
touch "$IT_TMP/stop"
wait "$loop" || fail "inspect --once --json failed while the instance generated"
kill -INT "$live"
wait "$live" || fail "the live inspect did not exit 0 on SIGINT"
expect_eq "$got_greedy" "$want_greedy" "greedy tokens with inspect attached vs without"
expect_eq "$got_sampled" "$want_sampled" "sampled tokens with inspect attached vs without"
log "tokens unchanged with inspect attached ($(find "$IT_TMP" -name 'snap.*.json' | wc -l) snapshots taken)"

[[ -n $maps ]] || fail "the live inspect had no shared-memory object mapped"
if grep -vqE '^[0-9a-f]+-[0-9a-f]+ r--s ' <<<"$maps"; then
	fail "inspect maps shared memory other than read-only and shared: $maps"
fi
expect_eq "$(shm_state)" "$shm_before" "the shared-memory objects (mode, size, inode, owner) after inspect"
expect_eq "$(run_dir_state)" "$dir_before" "the run directory after inspect"
snapshots=$(grep -c "^instance $INSTANCE " "$IT_TMP/live.txt" || true)
expect_gt "$snapshots" 1 "snapshots the live view printed"
expect_grep '^-- gpu-runner -- pid [0-9]+' "$(cat "$IT_TMP/live.txt")" "the live view's runner section"

# The sections and their numbers: every snapshot taken during the generations, and one now.
"$PIPELINE" inspect --once --json >"$IT_TMP/snap.last.json"
python3 - "$INSTANCE" "$gen_ms" "$IT_TMP"/snap.*.json <<'PY' || fail "the JSON snapshots do not check out (above)"
import json, sys

instance, gen_ms, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
busy = 0
for path in files:
    with open(path) as f:
        d = json.load(f)
    where = path.rsplit("/", 1)[-1]

    def check(ok, what):
        if not ok:
            sys.exit(f"{where}: {what}")

    check(d["instance"] == instance and isinstance(d["time"], float), "instance and time")
    sup = d["supervisor"]
    check(sup["up"] and sorted(sup["status"]["services"]) == ["gpu-runner", "kv-store", "ssd-loader"],
          "the supervisor's status")
    svcs = d["services"]
    check(sorted(svcs) == ["gpu-runner", "kv-store", "ssd-loader"], f"services {sorted(svcs)}")
    for name, s in svcs.items():
        check(s["up"] and isinstance(s["pid"], int) and isinstance(s["stats"], dict), f"{name} is not up")

    ld = svcs["ssd-loader"]
    ring, st = ld["shm"], ld["stats"]
    check(ring["attached"] and ring["owner_alive"], "the weight ring is not attached")
    n_slots, n_layers = ring["n_slots"], ring["n_layers"]
    check(sum(ring["slots"].values()) == n_slots, f"ring slots by state {ring['slots']} vs {n_slots}")
    check(sum(ring["class_slots"].values()) == n_slots, "ring slots by class")
    check(st["slots"] == n_slots and sum(st["slots_by_state"].values()) == n_slots, "loader stats slots")
    check(ring["n_groups"] == 2 + 2 * n_layers and len(ring["groups"]["layers"]) == n_layers, "ring groups")
    check(all(len(p) == 2 and set(p) <= set("ERLH") for p in ring["groups"]["layers"]), "ring letters")
    check(not ring["all_resident"] and ring["loader"]["bytes_read"] > 0, "the weights must stream")
    check(isinstance(st["reads_pending"], int), "reads_pending")

    kv = svcs["kv-store"]
    pool, st = kv["shm"], kv["stats"]
    check(pool["attached"] and pool["owner_alive"], "the KV pool is not attached")
    n_blocks = pool["n_blocks"]
    check(sum(pool["blocks"].values()) == n_blocks, f"pool blocks by state {pool['blocks']} vs {n_blocks}")
    check(st["pool_blocks"] == n_blocks and sum(st["blocks_by_state"].values()) == n_blocks, "kv stats blocks")
    check(pool["spill_queue"] == pool["blocks"]["spilling"] and pool["spill_used"] <= pool["n_spill_slots"],
          "spill queue")
    check(isinstance(st["prefix_hits"], int) and isinstance(st["prefix_misses"], int), "prefix hits and misses")

    gr = svcs["gpu-runner"]
    st = gr["stats"]
    check(len(st["weight_groups"]["layers"]) == n_layers, "the runner's layer table")
    check(len(st["kv_layers"]["gpu"]) == n_layers and len(st["kv_layers"]["store"]) == n_layers, "KV per layer")
    check(0 <= st["kv_gpu_blocks_used"] <= st["kv_gpu_blocks"], "the runner's KV arena")
    check(st["tokens_per_s"] >= 0 and set(st["copy_queue"]) >= {"weights_h2d_in_flight", "weight_grants_held"},
          "tokens/s and copy queue")
    check(gr["shm"]["ring"]["attached"] and gr["shm"]["ring"]["runner"]["tokens"] > 0, "the runner's ring counters")
    busy += bool(st["busy"]) and st["tokens_per_s"] > 0
# A snapshot waits for the next stats (up to a second): a generation of 3 s is caught.
if busy == 0 and gen_ms >= 3000:
    sys.exit(f"no snapshot caught the runner generating (busy, tokens/s above 0) in {gen_ms} ms")
print(f"{len(files)} snapshots check out, {busy} caught the runner generating ({gen_ms} ms)")
PY

# A named service: that one alone.
json=$("$PIPELINE" inspect --once --json kv-store)
expect_eq "$(python3 -c 'import json,sys; print(*sorted(json.load(sys.stdin)["services"]))' <<<"$json")" \
	"kv-store" "the services of inspect --once --json kv-store"
text=$("$PIPELINE" inspect --once gpu-runner)
expect_grep '^-- gpu-runner -- ' "$text" "inspect --once gpu-runner"
expect_grep '^ +0 +[ERLH]{2}' "$text" "the runner's layer table"
if grep -qE '^-- (kv-store|ssd-loader) -- ' <<<"$text"; then
	fail "inspect --once gpu-runner shows other services: $text"
fi
"$PIPELINE" inspect --once nosuch >/dev/null 2>&1 && fail "inspect of an unknown service succeeded"

"$PIPELINE" stop >/dev/null
expect_nothing_left "after stop"
out=$("$PIPELINE" inspect --once --json 2>&1) && fail "inspect after stop succeeded: $out"
expect_eq "$out" "pipeline-inspect: no instance $INSTANCE running (run dir $RUN_DIR)" "inspect after stop"
log "ok"

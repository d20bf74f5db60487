#!/usr/bin/env bash
# shm_room: shared memory smaller than a service asks for (a container's /dev/shm is 64 MiB unless
# --shm-size says more). The weight ring is made whole at the loader's start: where /dev/shm has no
# room for its pages, the loader says so and names --dram-budget, and exits with a status, where
# touching the page killed it (SIGBUS) and left the object behind. (The KV pool's pages come as
# blocks are written; a budget larger than the room makes a pool cut to it: test_kvstore_pool_adopt.)
# The loader runs in a mount namespace of its own with a small tmpfs on /dev/shm (unshare -rm;
# skipped where user namespaces are not allowed).
source "$(dirname "$0")/lib.sh"
it_setup shm_room
if ! unshare -rm sh -c 'mount -t tmpfs -o size=64k tmpfs /dev/shm' 2>/dev/null; then
	echo "[$IT_NAME] SKIP: no user and mount namespaces here (unshare -rm)"
	exit 77
fi

# in_small_shm SIZE CMD...: CMD with a tmpfs of SIZE on /dev/shm and a run directory of its own;
# prints its output, returns its status.
in_small_shm() {
	local size=$1
	shift
	unshare -rm bash -c 'mount -t tmpfs -o "size=$1" tmpfs /dev/shm || exit 99
		run=$(mktemp -d) && chmod 700 "$run" || exit 99
		shift
		"$@" --instance shmroom --run-dir "$run"' _ "$size" "$@"
}

set +e
out=$(in_small_shm 64k timeout 20 "$BIN/ssd-loader" --model "$MODEL" 2>&1)
rc=$?
set -e
((rc != 99)) || fail "could not set up the namespace: $out"
((rc != 135 && rc != 124)) || fail "the loader was killed or hung (status $rc) where its ring did not fit: $out"
((rc != 0)) || fail "the loader ran with a ring larger than /dev/shm: $out"
expect_grep "weight ring of .* does not fit in shared memory .*lower --dram-budget" "$out" "the loader's message"
log "ring larger than /dev/shm: status $rc, '$(grep -o 'the weight ring of [^:]*' <<<"$out" | head -1)'"

# The whole pipeline in 48 MiB of /dev/shm, --kv-dram-budget 1GiB (the default): the pool is cut to
# the room (blocks past it spill to disk), the tokens are run-local's, and nothing was killed. The
# instance lives and is stopped inside the namespace (its /dev/shm goes with it).
want=$(run_local --tokens "$PROMPT" -n 32)
kvrun=$IT_TMP/kvrun
mkdir -m 700 "$kvrun"
set +e
out=$(unshare -rm bash -c 'mount -t tmpfs -o size=48m tmpfs /dev/shm || exit 99
	export PIPELINE_INSTANCE=shmroom-kv PIPELINE_RUN_DIR=$1 PIPELINE_BUILD_DIR=$(dirname "$2")
	trap "\"\$3\" stop >/dev/null 2>&1" EXIT
	"$3" start --model "$4" --backend cpu >&2 || exit 98
	"$3" generate --tokens "$5" -n 32' _ "$kvrun" "$BIN" "$PIPELINE" "$MODEL" "$PROMPT" 2>"$IT_TMP/kv.err")
rc=$?
set -e
((rc != 99)) || fail "could not set up the namespace: $(cat "$IT_TMP/kv.err")"
((rc == 0)) || fail "the pipeline in 48 MiB of /dev/shm failed (status $rc): $(cat "$IT_TMP/kv.err") $(tail -n 5 "$kvrun"/*.log)"
expect_eq "$out" "$want" "tokens with the KV pool cut to /dev/shm vs run-local"
expect_grep "more than /dev/shm's .* free can hold .*the KV pool has [0-9]+ blocks" "$(cat "$kvrun/kv-store.log")" \
	"the kv-store's warning"
if grep -sqE "Bus error|SIGBUS|signal 7|killed by signal" "$kvrun"/*.log; then
	fail "a service was killed: $(grep -shE "Bus error|SIGBUS|signal 7|killed by signal" "$kvrun"/*.log)"
fi
log "KV pool in 48 MiB: '$(grep -o 'the KV pool has [0-9]* blocks ([^)]*)' "$kvrun/kv-store.log" | head -1)', tokens as run-local"
log "PASS"

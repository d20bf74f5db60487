#!/usr/bin/env bash
# loader_stall: ssd-loader stalls (SIGSTOP) past the runner's --timeout-ms in the middle of a
# generation, with a DRAM budget of the smallest ring (one streaming slot a kind), so that a grant
# the runner gave up on pins the only slot its kind has. The request that saw the stall fails with
# a clear error; the runner then takes a new session with the loader, which lets go of what it
# granted for the given-up acquire, and the requests after it give the tokens of an unstalled
# run. (Before, every later request failed: "no grant from ssd-loader".)
# STALL_BACKEND=cuda (on a GPU host) runs the runner on CUDA with the smallest GPU window (the
# least --gpu-budget it takes), so that the given-up acquire is under the window's copies.
source "$(dirname "$0")/lib.sh"
it_setup loader_stall
BACKEND=${STALL_BACKEND:-cpu}
GPU=()
if [[ $BACKEND != cpu ]]; then
	nvidia-smi >/dev/null 2>&1 || { echo "[loader_stall] SKIP: no GPU for STALL_BACKEND=$BACKEND"; exit 77; }
	# The smallest window streams the layers only where there are more than its slots: four layers.
	rm -rf "$MODEL"
	"$BIN/make-synthetic-model" --shape tiny --layers 4 --out "$MODEL" --quiet
	min=$(gpu_budget_min "$MODEL" "$BACKEND" --cpu-share 0)
	[[ -n $min ]] || fail "the runner did not say its smallest --gpu-budget"
	GPU=(--gpu-budget "$min")
fi

out=$("$PIPELINE" start --model "$MODEL" --backend "$BACKEND" "${GPU[@]}" --cpu-share 0 --dram-budget 4KiB 2>&1) || true
need=$(sed -n 's/.*need at least [^(]*(\([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
[[ $need =~ ^[0-9]+$ ]] || fail "the loader did not say its smallest --dram-budget: $out"
"$PIPELINE" start --model "$MODEL" --backend "$BACKEND" "${GPU[@]}" --cpu-share 0 --dram-budget "$need" \
	--runner-opt=--timeout-ms=300 >/dev/null
want=$(generate --tokens "$PROMPT" -n 8 --ignore-eos)
expect_words 8 "$want" "tokens before the stall"
LOADER=$(cat "$RUN_DIR/ssd-loader.pid")
stalled=0
for i in 1 2 3; do
	# A long generation, and the loader stopped for 0.6 s in its middle (twice the runner's wait).
	( generate --tokens "$PROMPT" -n 2000 --ignore-eos >"$IT_TMP/stalled-$i" 2>&1 ) &
	gen=$!
	sleep 0.3
	kill -STOP "$LOADER"
	sleep 0.6
	kill -CONT "$LOADER"
	wait "$gen" || { stalled=$((stalled + 1)); log "stalled request $i: $(tail -c 200 "$IT_TMP/stalled-$i" | tr '\n' ' ')"; }
	# What comes after it is served, with the right tokens.
	got=$(generate --tokens "$PROMPT" -n 8 --ignore-eos) || fail "a request after stall $i failed"
	expect_eq "$got" "$want" "the tokens of a request after stall $i"
done
((stalled > 0)) || fail "no request saw the loader's stall (a faster host: stop it longer)"
expect_grep "a new session, so that the loader lets go" "$(cat "$RUN_DIR/gpu-runner.log")" \
	"the runner's log of the new session"
log "$stalled of 3 stalled requests failed; every request after them gave the right tokens"
"$PIPELINE" stop >/dev/null
expect_nothing_left "stop"
log "passed"

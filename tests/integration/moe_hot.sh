#!/usr/bin/env bash
# moe_hot: hot experts on the GPU (the CUDA backend; skipped without a GPU). qwen3-moe-tiny (2 layers
# of 8 experts, 2 chosen a token) under a --gpu-budget of the runner's smallest plus four experts: the
# window keeps the attention and router groups and four experts, in table order while no routing is
# counted (window_plan.h). After a request of 48 decode steps the runner makes its window anew between
# requests, keeping the four experts the routing chose most (experts.c): its log says so, its stats
# count the new plan and the larger share of the routing the kept experts take, and the same request
# again gives the same tokens (residency moves bytes, not results), with --strict checking the
# window's state table on every call. Then the experts from disk (a DRAM budget below the model): the
# same tokens, a layer's chosen experts asked for together. Then every expert on the GPU: each layer
# routed on the device, and on the host with --moe-host-route, the same tokens.
source "$(dirname "$0")/lib.sh"
it_setup moe_hot
if ! nvidia-smi >/dev/null 2>&1; then
	echo "[moe_hot] SKIP: no GPU"
	exit 77
fi

dir=$IT_TMP/qwen3-moe-tiny
"$BIN/make-synthetic-model" --shape qwen3-moe-tiny --seed 5 --out "$dir" --quiet
min=$(gpu_budget_min "$dir" cuda)
[[ -n $min ]] || fail "the runner did not say its smallest --gpu-budget"
# An expert on the device: gate, up and down, each at a 256-byte boundary.
inter=$(jq -r .moe_intermediate_size "$dir/config.json")
hidden=$(jq -r .hidden_size "$dir/config.json")
expert=$((3 * ((inter * hidden * 2 + 255) / 256 * 256)))
budget=$((min + 4 * expert + 1024))
log "--gpu-budget $budget: the smallest ($min) and four experts of $expert bytes"
"$PIPELINE" start --model "$dir" --backend cuda --gpu-budget "$budget" --runner-opt=--strict >/dev/null
expect_grep "4 experts resident, chosen by 25\.0% of the routing expected \\(none counted yet\\)" \
	"$(cat "$RUN_DIR/gpu-runner.log")" "the first plan: four experts in table order"

want=$(generate --tokens "$PROMPT" -n 49 --ignore-eos)
expect_words 49 "$want" "tokens of the first request"
replanned() { grep -q 'hot experts: after [0-9]* decode steps' "$RUN_DIR/gpu-runner.log"; }
wait_until 30 "the window made anew for the hot experts" replanned
log "$(grep 'hot experts:' "$RUN_DIR/gpu-runner.log" | tail -n 1)"
stats=$("$PIPECTL" stats gpu-runner)
expect_eq "$(jq -r .gpu_window.expert_replans <<<"$stats")" 1 "windows made anew for hot experts"
expect_eq "$(jq -r .gpu_window.experts_resident <<<"$stats")" 4 "experts resident after the new plan"
share=$(jq -r .gpu_window.experts_resident_routing <<<"$stats")
awk -v s="$share" 'BEGIN { exit !(s > 0.3) }' ||
	fail "the kept experts take $share of the routing after the new plan, want more than the 0.25 of table order"

got=$(generate --tokens "$PROMPT" -n 49 --ignore-eos)
expect_eq "$got" "$want" "the same request after the new plan"
"$PIPELINE" stop >/dev/null
expect_nothing_left "after stop"

# The experts from disk: a DRAM budget half way between the loader's minimum and the whole model, the
# smallest GPU window. A layer's chosen experts are asked of the loader together at its routing
# (weights_ring.c, ring_route, through the window's route); the tokens are the same.
out=$("$PIPELINE" start --model "$dir" --backend cuda --dram-budget 4KiB 2>&1) && fail "start with a 4 KiB DRAM budget succeeded"
expect_nothing_left "after the refused start"
need=$(sed -n 's/.*need at least [^(]*(\([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
whole=$(sed -n 's/.*whole model resident needs \([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
[[ -n $need && -n $whole ]] || fail "no minimum in the loader's refusal: $out"
"$PIPELINE" start --model "$dir" --backend cuda --gpu-budget "$min" --dram-budget $(((need + whole) / 2)) \
	--runner-opt=--strict >/dev/null
got=$(generate --tokens "$PROMPT" -n 49 --ignore-eos)
expect_eq "$got" "$want" "the same request with the experts from disk"
expect_gt "$(stat_value gpu-runner experts_ahead)" 0 "experts asked for together at their layer's routing"
"$PIPELINE" stop >/dev/null
expect_nothing_left "after stop (experts from disk)"

# Every expert on the GPU: each layer routed on the device (cuda/moe_device.cu; no wait of the host
# for the router's logits), the same tokens as the host's route, which --moe-host-route keeps.
on_device() { grep -c "experts: layer 0's are all on the GPU, routed there without the host's wait" \
	"$RUN_DIR/gpu-runner.log" || true; }
"$PIPELINE" start --model "$dir" --backend cuda --gpu-budget 4GiB --runner-opt=--strict >/dev/null
n0=$(on_device)
got=$(generate --tokens "$PROMPT" -n 49 --ignore-eos)
expect_eq "$got" "$want" "the same request routed on the device"
expect_gt "$(on_device)" "$n0" "layers routed on the device (the runner's log)"
stats=$("$PIPECTL" stats gpu-runner)
expect_eq "$(jq -r .gpu_window.experts_resident <<<"$stats")" 16 "experts resident (all)"
"$PIPELINE" stop >/dev/null
"$PIPELINE" start --model "$dir" --backend cuda --gpu-budget 4GiB --runner-opt=--moe-host-route >/dev/null
n0=$(on_device)
got=$(generate --tokens "$PROMPT" -n 49 --ignore-eos)
expect_eq "$got" "$want" "the same request routed on the host (--moe-host-route)"
expect_eq "$(on_device)" "$n0" "layers routed on the device with --moe-host-route"
"$PIPELINE" stop >/dev/null
expect_nothing_left "after stop (every expert on the GPU)"

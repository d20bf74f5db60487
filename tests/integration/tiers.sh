#!/usr/bin/env bash
# tiers: budgets that make every tier work on the tiny model: the weights stream through a
# DRAM ring smaller than the model, KV blocks leave the runner for kv-store and come back,
# and kv-store spills them to disk. The tokens stay those of run-local.
source "$(dirname "$0")/lib.sh"
it_setup tiers
# TIERS_BACKEND=cuda (on a GPU host) runs the services on the CUDA backend: KV commits then
# carry CUDA IPC events, and the reference is the same backend with every budget large (the
# C oracle computes in float32, the GPU in bf16).
BACKEND=${TIERS_BACKEND:-cpu}
if [[ $BACKEND != cpu ]] && ! nvidia-smi >/dev/null 2>&1; then
	echo "[tiers] SKIP: no GPU for TIERS_BACKEND=$BACKEND"
	exit 77
fi
# The reference's tokens and these must be equal, so no FFN splits with the CPU here (its products
# sum in another order than the GPU's): --cpu-share 0 (integration_cpu_share and fidelity check it).
# On CUDA, TIERS_GPU_OPTS are more flags for the reference and the run with every tier at work,
# e.g. "--gpu-budget min --cpu-share 0.5": every layer streamed through the smallest GPU window and
# half of each streamed FFN computed by the CPU pool from the ring, in both runs alike.
read -r -a GPU_OPTS <<<"${TIERS_GPU_OPTS:-}"
SHARE=(--cpu-share 0)
if [[ ${#GPU_OPTS[@]} -gt 0 ]]; then
	[[ $BACKEND != cpu ]] || fail "TIERS_GPU_OPTS is for TIERS_BACKEND=cuda"
	SHARE=()
fi
if [[ " ${GPU_OPTS[*]} " == *" --gpu-budget min "* ]]; then
	# "--gpu-budget min": the smallest window the runner takes, which streams the layers only where
	# there are more than its slots: four layers.
	rm -rf "$MODEL"
	"$BIN/make-synthetic-model" --shape tiny --layers 4 --out "$MODEL" --quiet
	min=$(gpu_budget_min "$MODEL" "$BACKEND" --cpu-share 0)
	[[ -n $min ]] || fail "the runner did not say its smallest --gpu-budget"
	for i in "${!GPU_OPTS[@]}"; do
		[[ ${GPU_OPTS[i]} == --gpu-budget ]] && GPU_OPTS[i + 1]=$min
	done
fi

bytes=$(model_bytes "$MODEL")
# The smallest DRAM budget is the globals plus one attention and one FFN group, slots
# aligned for O_DIRECT: ask the loader, whose refusal of a tiny budget says how much it
# needs and how much the whole model takes. Half way between streams the layers.
out=$("$PIPELINE" start --model "$MODEL" --backend "$BACKEND" --cpu-share 0 --dram-budget 4KiB 2>&1) && fail "start with a 4 KiB DRAM budget succeeded"
need=$(sed -n 's/.*need at least [^(]*(\([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
whole=$(sed -n 's/.*whole model resident needs \([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
if [[ -n $need && -n $whole ]] && ((need < whole)); then
	budget=$(((need + whole) / 2))
else
	log "could not read the minimum from the loader's message; using 85% of the model"
	budget=$((bytes * 85 / 100))
fi
# The runner splits an FFN with the CPU only where its group stays in the ring (the CPU reads it in
# place): with --cpu-share the weights stay resident in DRAM (the KV tiers and the GPU window still
# at work), or the reference would split and this run not.
split=0
[[ " ${GPU_OPTS[*]} " == *" --cpu-share "* ]] && split=1
if ((split)); then
	[[ -n $whole ]] || fail "could not read the all-resident size from the loader's message"
	budget=$whole
fi
log "model $bytes bytes; DRAM budget $budget bytes (minimum ${need:-?}, all resident ${whole:-?})"

# 32 KiB of runner KV holds 8 blocks of 16 tokens x 2 layers; 128 tokens need 16. A prompt
# chunk of 16 keeps the runner's minimum (layers + chunk blocks + 2) under 8. The pool holds
# 4 blocks of 4 KiB, fewer than one layer of the context: the rest spill to the file, and the
# runner fetches in batches the pool can hold.
"$PIPELINE" start --model "$MODEL" --backend "$BACKEND" --cpu-share 0 --dram-budget "$budget" --kv-gpu-budget 32KiB --kv-dram-budget 16KiB \
	--runner-opt=--prefill-chunk=16

sample=(--temperature 0.8 --top-k 40 --top-p 0.9 --seed 7)
if [[ $BACKEND != cpu ]]; then
	# The reference: the same backend, nothing constrained.
	"$PIPELINE" stop
	"$PIPELINE" start --model "$MODEL" --backend "$BACKEND" ${SHARE[@]+"${SHARE[@]}"} \
		${GPU_OPTS[@]+"${GPU_OPTS[@]}"} --runner-opt=--prefill-chunk=16
	want_greedy=$(generate --tokens "$PROMPT" -n 64)
	want_sampled=$(generate --tokens "$PROMPT" -n 64 "${sample[@]}")
	"$PIPELINE" stop
	# bf16 KV blocks are half the size: half the budget holds the same 8 blocks.
	"$PIPELINE" start --model "$MODEL" --backend "$BACKEND" ${SHARE[@]+"${SHARE[@]}"} ${GPU_OPTS[@]+"${GPU_OPTS[@]}"} \
		--dram-budget "$budget" --kv-gpu-budget 16KiB --kv-dram-budget 16KiB --runner-opt=--prefill-chunk=16
else
	want_greedy=$(run_local --tokens "$PROMPT" -n 64)
	want_sampled=$(run_local --tokens "$PROMPT" -n 64 "${sample[@]}")
fi
want=$want_greedy
got=$(generate --tokens "$PROMPT" -n 64)
expect_words 64 "$got" "greedy tokens"
expect_eq "$got" "$want" "greedy tokens with every tier at work vs run-local"
want=$want_sampled
got=$(generate --tokens "$PROMPT" -n 64 "${sample[@]}")
if ((split)); then
	# With the CPU's share the sampled tokens (temperature 0.8) part from the reference's after 31
	# equal ones, the same in every run so far, while the greedy ones stay equal: logits that
	# differ in their last bits and a draw at a boundary of the distribution (which step of the
	# tiered run rounds otherwise is not established yet). The first 16 must agree.
	read -r -a g <<<"$got"
	read -r -a w <<<"$want"
	same=0
	while ((same < ${#w[@]})) && [[ ${g[same]:-} == "${w[same]}" ]]; do
		same=$((same + 1))
	done
	log "sampled tokens: the first $same of ${#w[@]} equal the reference's"
	# What the tiered run did that the reference did not (to place the step that rounds otherwise).
	((same == ${#w[@]})) || log "the tiered run: $("$PIPECTL" stats gpu-runner | jq -c '{kv_blocks_fetched, kv_fetch_runs,
		kv_rebuilds, kv_prefix_positions, kv_readahead_blocks, cpu_jobs: .cpu_share.jobs, batch: .batch.batched_steps}')"
	((same >= 16)) || expect_eq "$got" "$want" "sampled tokens with every tier at work (first 16) vs the reference"
else
	expect_eq "$got" "$want" "sampled tokens with every tier at work vs run-local"
fi
log "tokens equal the reference ($BACKEND${GPU_OPTS[@]+, ${GPU_OPTS[*]}})"
if ((split)); then
	stats=$("$PIPECTL" stats gpu-runner)
	jobs=$(sed -n '/"cpu_share"/,/}/s/^ *"jobs": *\([0-9]*\).*/\1/p' <<<"$stats" | head -n 1)
	expect_gt "${jobs:-}" 0 "CPU share jobs in the runner's stats"
	expect_grep '"jobs_failed": 0' "$stats" "failed CPU shares in the runner's stats"
fi

read_bytes=$(stat_value ssd-loader bytes_read)
all_resident=$(stat_value ssd-loader all_resident)
spills=$(stat_value kv-store spills)
fetches=$(stat_value kv-store fetches)
from_disk=$(stat_value kv-store fetches_from_disk)
committed=$(stat_value gpu-runner kv_blocks_committed)
log "bytes_read $read_bytes, spills $spills, fetches $fetches ($from_disk from disk), committed $committed"
if ((!split)); then
	expect_gt "$read_bytes" "$bytes" "bytes the loader read vs the model's bytes (weights must stream)"
	[[ ${all_resident:-} != 1 ]] || fail "the loader reports all groups resident under a budget below the model"
fi
expect_gt "$spills" 0 "KV blocks kv-store spilled"
expect_gt "$fetches" 0 "KV fetches kv-store served"
expect_gt "$committed" 0 "KV blocks the runner committed"

summary=$("$PIPECTL" summary)
expect_grep 'SSD -> DRAM' "$summary" "pipectl summary"
expect_grep 'KV cache' "$summary" "pipectl summary"

"$PIPELINE" stop
expect_nothing_left "after stop"
log "ok"

#!/usr/bin/env bash
# stages: the model's layers split across several gpu-runners (start --ranks N: gpu-runner,
# gpu-runner-1, ...), the hidden state passed between them through shared memory, on the C
# backend. The tokens are those of one runner (run-local); the KV of each rank's layers goes
# through the one kv-store and comes back for a prompt that starts like an earlier one; the weights
# stream through a DRAM ring below the model's size; a rank killed mid-request is restarted, the
# ranks form again and the request goes on with the tokens of an uninterrupted run; a restarted
# rank 0 forms them anew; bad flags are refused.
# STAGES_BACKEND=cuda (a GPU host) runs the ranks on the one GPU over shm, against one runner on it;
# with STAGES_GPUS=0,1 too, the two ranks each on its own GPU over NCCL (skipped without two GPUs).
source "$(dirname "$0")/lib.sh"
BACKEND=${STAGES_BACKEND:-cpu}
RANKS2=(--ranks 2)
if [[ -n ${STAGES_GPUS:-} ]]; then
	gpus=$({ nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true; } | wc -l)
	if ((gpus < 2)); then
		echo "[stages] SKIP: STAGES_GPUS=$STAGES_GPUS needs two GPUs; this machine has $gpus"
		exit 77
	fi
	RANKS2=(--gpus "$STAGES_GPUS")
fi
it_setup stages
if [[ $BACKEND != cpu ]] && ! nvidia-smi >/dev/null 2>&1; then
	echo "[stages] SKIP: no GPU for STAGES_BACKEND=$BACKEND"
	exit 77
fi
# A KV block of bf16 (the GPU's) is half the C backend's float32 one.
# 4 blocks of 16 tokens per rank (each has one layer of the tiny model): fewer than the 8 a request
# of 127 positions fills, so blocks leave and come back (bf16 blocks on CUDA are half the size).
kv_small=16KiB
[[ $BACKEND == cpu ]] || kv_small=8KiB

sample=(--temperature 0.8 --top-k 40 --top-p 0.9 --seed 7)
if [[ $BACKEND == cpu ]]; then
	want=$(run_local --tokens "$PROMPT" -n 64)
	want_sampled=$(run_local --tokens "$PROMPT" -n 64 "${sample[@]}")
	want_long=$(run_local --tokens "$PROMPT" -n 2000 --ignore-eos)
else
	# The reference: one runner of the same backend (bf16 on the GPU, not the C oracle's float32).
	"$PIPELINE" start --model "$MODEL" --backend "$BACKEND" --cpu-share 0
	want=$(generate --tokens "$PROMPT" -n 64)
	want_sampled=$(generate --tokens "$PROMPT" -n 64 "${sample[@]}")
	want_long=$(generate --tokens "$PROMPT" -n 2000 --ignore-eos)
	"$PIPELINE" stop
fi
expect_words 64 "$want" "the reference's greedy tokens"

# Two ranks, one layer each (the tiny model has two).
"$PIPELINE" start --model "$MODEL" --backend "$BACKEND" --cpu-share 0 "${RANKS2[@]}"
"$PIPELINE" status >/dev/null || fail "status after start does not report every service up"
expect_grep '^gpu-runner-1 +[0-9]+ +up' "$("$PIPELINE" status)" "status lists the second runner"
expect_eq "$(sup_argv gpu-runner-1 | grep -A1 -x '"--rank"' | tail -n 1)" '"1"' "gpu-runner-1 is rank 1"
expect_eq "$(sup_argv gpu-runner | grep -A1 -x '"--ranks"' | tail -n 1)" '"2"' "gpu-runner knows 2 ranks"

got=$(generate --tokens "$PROMPT" -n 64)
expect_eq "$got" "$want" "greedy tokens of two ranks vs one runner"
got=$(generate --tokens "$PROMPT" -n 64 "${sample[@]}")
expect_eq "$got" "$want_sampled" "seeded sampled tokens of two ranks vs one runner"
log "two ranks (${RANKS2[*]}): greedy and sampled tokens equal one runner's"

stats=$("$PIPECTL" stats gpu-runner)
expect_grep '"formed": true' "$stats" "gpu-runner's stages are formed"
[[ -z ${STAGES_GPUS:-} ]] || expect_grep '"link": "nccl"' "$stats" "the link of ranks on two GPUs"
expect_grep '"layer0": 1' "$stats" "the plan gives rank 1 layer 1"
steps=$(stat_value gpu-runner steps)
expect_gt "${steps:-0}" 100 "steps the first runner drove through the stages"
expect_gt "$(stat_value gpu-runner-1 steps)" 100 "steps gpu-runner-1 computed"
expect_gt "$(stat_value gpu-runner-1 kv_blocks_committed)" 0 "KV blocks gpu-runner-1 committed to kv-store"
"$PIPECTL" stats gpu-runner-1 | grep -q '"weight_acquires"' || fail "gpu-runner-1 answers stats"

# The prompt again: both ranks restore the same prefix from the kv-store, and compute the same.
before=$(stat_value gpu-runner kv_prefix_positions)
got=$(generate --tokens "$PROMPT" -n 64)
expect_eq "$got" "$want" "greedy tokens with the prefix restored on both ranks"
after=$(stat_value gpu-runner kv_prefix_positions)
expect_gt "$((after - before))" 0 "prompt positions rank 0 restored"
expect_gt "$(stat_value gpu-runner-1 kv_prefix_positions)" 0 "prompt positions gpu-runner-1 restored"
log "prefix restored on both ranks ($((after - before)) positions)"

expect_grep '^service +gpu-runner-1' "$("$PIPECTL" hello gpu-runner-1)" "gpu-runner-1's HELLO"

# gpu-runner-1 killed in the middle of a request: the supervisor restarts it, rank 0 forms the ranks
# again and resumes the request; the client sees the uninterrupted run's tokens.
long_out=$IT_TMP/long.txt
base=$(stat_value gpu-runner-1 steps)
generated0=$(stat_value gpu-runner tokens_generated)
generate --tokens "$PROMPT" -n 2000 --ignore-eos >"$long_out" 2>"$IT_TMP/long.err" &
gen=$!
old=$(sup_field gpu-runner-1 pid)
steps_past() { (($(stat_value gpu-runner-1 steps) > $1)); }
wait_until 30 "the long request's first steps" steps_past $((base + 100))
kill -9 "$old"
wait "$gen" || fail "the request cut by gpu-runner-1's death failed: $(cat "$IT_TMP/long.err")"
expect_eq "$(cat "$long_out")" "$want_long" "tokens of a request resumed after gpu-runner-1 died"
# Every token counted once, those before the death among them (the resume starts from them).
expect_eq "$(($(stat_value gpu-runner tokens_generated) - generated0))" "$(wc -w <"$long_out")" \
	"tokens_generated for the resumed request"
wait_until 30 "gpu-runner-1 restarted" restarted gpu-runner-1 "$old"
expect_grep 'resuming after [0-9]+ tokens' "$(cat "$RUN_DIR/gpu-runner.log")" "rank 0's log of the resume"
expect_gt "$(stat_value gpu-runner forms)" 1 "formations of the ranks"
log "gpu-runner-1 killed mid-request: restarted, the ranks formed again, the request resumed with the same tokens"

# gpu-runner (rank 0) killed: its successor forms the ranks anew.
old=$(sup_field gpu-runner pid)
kill -9 "$old"
wait_until 30 "gpu-runner restarted" restarted gpu-runner "$old"
got=$(generate --tokens "$PROMPT" -n 64)
expect_eq "$got" "$want" "greedy tokens after gpu-runner was restarted"
expect_grep 'formation [0-9a-f]+: rank 1 of 2' "$(tail -n 5 "$RUN_DIR/gpu-runner-1.log")" "gpu-runner-1 joined the new formation"
log "gpu-runner killed: its successor formed the ranks again"

"$PIPELINE" stop
expect_nothing_left "after stop"

# Weights streamed through a DRAM ring below the model's size, and KV through every tier (runner
# arena of 4 blocks, a pool of 4, the rest spilled), with two ranks.
bytes=$(model_bytes "$MODEL")
"$PIPELINE" start --model "$MODEL" --backend "$BACKEND" --cpu-share 0 "${RANKS2[@]}" --dram-budget $((bytes * 85 / 100)) \
	--kv-gpu-budget $kv_small --kv-dram-budget 16KiB --runner-opt=--prefill-chunk=16
[[ $(stat_value ssd-loader all_resident) != 1 ]] || fail "the loader holds the whole model under a budget below it"
got=$(generate --tokens "$PROMPT" -n 64)
expect_eq "$got" "$want" "greedy tokens of two ranks with every tier at work"
got=$(generate --tokens "$PROMPT" -n 64 "${sample[@]}")
expect_eq "$got" "$want_sampled" "sampled tokens of two ranks with every tier at work"
expect_gt "$(stat_value kv-store spills)" 0 "KV blocks kv-store spilled"
expect_gt "$(stat_value gpu-runner-1 kv_blocks_fetched)" 0 "KV blocks gpu-runner-1 fetched back"
log "two ranks with the weights streamed from disk and the KV through every tier: the same tokens"
"$PIPELINE" stop
expect_nothing_left "after the tiers"

# Three ranks of a four-layer model, the split given: layers 0, 1..2, 3.
MODEL4=$IT_TMP/model4
"$BIN/make-synthetic-model" --shape tiny --layers 4 --out "$MODEL4" --quiet
if [[ $BACKEND == cpu ]]; then
	want4=$("$BIN/run-local" --model "$MODEL4" --tokens "$PROMPT" -n 48)
else
	"$PIPELINE" start --model "$MODEL4" --backend "$BACKEND" --cpu-share 0
	want4=$(generate --tokens "$PROMPT" -n 48)
	"$PIPELINE" stop
fi
"$PIPELINE" start --model "$MODEL4" --backend "$BACKEND" --cpu-share 0 --ranks 3 --runner-opt=--stage-split=1,3
got=$(generate --tokens "$PROMPT" -n 48)
expect_eq "$got" "$want4" "greedy tokens of three ranks (layers 0 | 1-2 | 3) vs one runner"
expect_eq "$(stat_value gpu-runner-2 layer0)" 3 "gpu-runner-2's first layer"
"$PIPELINE" stop
expect_nothing_left "after three ranks"
log "three ranks: the same tokens"

# Refused: a split the model cannot have, a device for the C backend, too many ranks.
expect_start_fails "more ranks than layers" "cannot be split across 3 runners|2 layers" \
	--model "$MODEL" --backend cpu --ranks 3
expect_start_fails "a split out of order" "stage-split" \
	--model "$MODEL4" --backend cpu --ranks 3 --runner-opt=--stage-split=3,2
if [[ $BACKEND == cpu ]]; then
	expect_start_fails "a GPU for the C backend" "the cpu backend computes on no GPU" \
		--model "$MODEL" --backend cpu --gpus 0,1
	expect_start_fails "nccl for the C backend" "stage-link nccl" \
		--model "$MODEL" --backend cpu --ranks 2 --runner-opt=--stage-link=nccl
fi
out=$("$PIPELINE" start --model "$MODEL" --ranks 9 2>&1) && fail "--ranks 9 was taken"
expect_grep 'ranks takes 1 to 8' "$out" "--ranks 9's refusal"

# Runners of one host with a CPU share: each pins its workers to a slice of the CPUs of its own
# (every rank pinned its workers to the same CPUs, two and more a CPU).
if [[ $BACKEND == cpu ]] && (($(nproc) >= 2)); then
	"$PIPELINE" start --model "$MODEL" --backend cpu --cpu-share 0.5 --ranks 2 >/dev/null
	expect_words 8 "$(generate --tokens "$PROMPT" -n 8)" "tokens of two ranks with a CPU share"
	for log_file in "$RUN_DIR/gpu-runner.log" "$RUN_DIR/gpu-runner-1.log"; do
		expect_grep "cpu share .*this rank's slice of the host's" "$(cat "$log_file")" "$(basename "$log_file")"
	done
	"$PIPELINE" stop >/dev/null
	expect_nothing_left "after two ranks with a CPU share"
fi
log "ok"

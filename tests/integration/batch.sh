#!/usr/bin/env bash
# batch: continuous batching in gpu-runner (services/gpu-runner/batch.c). 16 requests sent at once
# (greedy and seeded sampling, a repetition penalty, prompts of 3 to 64 tokens sharing prefixes or
# not, 5 to 40 new tokens) each give exactly the tokens they give alone, and the runner did compute
# several of them in one step (tests/unit/gpu-runner/test_batch.c mixes prefill chunks and decode
# tokens in one step on purpose). The same
# with the KV of each request going to the kv-store and its spill file and back (budgets too small
# for it). A request whose client goes away mid-run leaves the others as they were. --max-batch 1
# turns batching off, and a bad --max-batch is refused.
# BATCH_BACKEND=cuda (a GPU host; skipped without one) runs it all on the CUDA backend: bf16 KV,
# whose blocks are half the C backend's float32 ones, so the small budgets are halved.
source "$(dirname "$0")/lib.sh"
BACKEND=${BATCH_BACKEND:-cpu}
it_setup batch
if [[ $BACKEND != cpu ]] && ! nvidia-smi >/dev/null 2>&1; then
	echo "[batch] SKIP: no GPU for BATCH_BACKEND=$BACKEND"
	exit 77
fi
kv_gpu=40KiB kv_dram=64KiB
[[ $BACKEND == cpu ]] || kv_gpu=20KiB kv_dram=32KiB

N=16
# The prompts: 0-3 share the first 32 tokens of PROMPT (prefix reuse per sequence), the others are
# their own.
prompt_of() {
	local k=$1 len=$((3 + (k * 13) % 62))
	if ((k < 4)); then
		cut -d, -f1-$((32 + k * 8)) <<<"$PROMPT"
	else
		for ((i = 0; i < len; i++)); do echo $(((i * 53 + k * 29 + 7) % 480 + 1)); done | paste -sd,
	fi
}
args_of() {
	local k=$1
	echo "-n $((5 + (k * 7) % 36))"
	case $((k % 4)) in
	1) echo "--temperature 0.9 --top-k 50 --seed $((100 + k))" ;;
	2) echo "--temperature 0.7 --top-p 0.8 --seed $((200 + k))" ;;
	3) echo "--repetition-penalty 1.3" ;;
	esac
}

# alone_all: every request alone, one after the other, into $IT_TMP/alone.K.
alone_all() {
	for ((k = 0; k < N; k++)); do
		# shellcheck disable=SC2046
		generate --tokens "$(prompt_of $k)" $(args_of $k) >"$IT_TMP/alone.$k" || fail "request $k alone failed"
	done
}

# together_all WHAT: all at once, then each against its alone run.
together_all() {
	local what=$1 pids=() k
	for ((k = 0; k < N; k++)); do
		# shellcheck disable=SC2046
		generate --tokens "$(prompt_of $k)" $(args_of $k) >"$IT_TMP/together.$k" 2>"$IT_TMP/together.$k.err" &
		pids+=($!)
	done
	for ((k = 0; k < N; k++)); do
		wait "${pids[$k]}" || fail "$what: request $k failed: $(cat "$IT_TMP/together.$k.err")"
	done
	for ((k = 0; k < N; k++)); do
		expect_eq "$(cat "$IT_TMP/together.$k")" "$(cat "$IT_TMP/alone.$k")" "$what: request $k ($(args_of $k | tr '\n' ' ')) batched vs alone"
	done
}

batch_stat() { "$PIPECTL" stats gpu-runner | jq -r ".batch.$1"; }
running_at_least() { (($(batch_stat running) >= $1)); }
went_away() { grep -c 'went away: cancelling it' "$RUN_DIR/gpu-runner.log" || true; }

# ---- one request at a time, then 16 at once --------------------------------------------------
"$PIPELINE" start --model "$MODEL" --backend "$BACKEND" --cpu-share 0 --runner-opt=--prefill-chunk=32 --runner-opt=--max-batch=8 >/dev/null
expect_eq "$(batch_stat on)" true "batching is on (the $BACKEND backend)"
expect_eq "$(batch_stat max_batch)" 8 "--max-batch 8"
alone_all
expect_eq "$(batch_stat most_at_once)" 1 "requests sent one after another ran one at a time"
# Long requests running all along, so that the 16 have a step to share whatever the timing (on a
# loaded machine their clients alone may start too far apart to overlap). One long request ends
# at the model's context (4096 here) within a second or so, sooner than 16 clients of
# scripts/pipeline may all have started on two loaded cores: a loop starts the next at once.
# Then its client goes (the loop stopped first, then the request it runs).
(while :; do
	"$PIPECTL" generate --tokens "$(prompt_of 5)" -n 100000 --ignore-eos >/dev/null 2>&1 &
	echo $! >"$IT_TMP/long.pid"
	wait $!
done) &
first=$!
wait_until 30 "a long request running" running_at_least 1
together_all "16 at once"
kill -STOP "$first" 2>/dev/null || true
kill -KILL "$(cat "$IT_TMP/long.pid")" 2>/dev/null || true
kill -KILL "$first" 2>/dev/null || true
wait "$first" 2>/dev/null || true
most=$(batch_stat most_at_once)
expect_gt "$most" 1 "the most requests computed in one step"
((most <= 8)) || fail "$most requests in one step; --max-batch is 8"
log "16 requests at once: each gives its tokens alone ($most in one step at most, $(batch_stat seqs_per_step) per step on average)"
grep -q 'continuous batching: up to 8 requests at once' "$RUN_DIR/gpu-runner.log" ||
	fail "gpu-runner's log does not say it batches"

# ---- a client that goes away: the others go on --------------------------------------------------
idle() { [[ $(batch_stat running) == 0 ]]; }
wait_until 30 "the first long request cancelled" idle
before=$(went_away)
long=$(prompt_of 5)
"$PIPECTL" generate --tokens "$long" -n 100000 --ignore-eos >/dev/null 2>&1 &
gone=$!
wait_until 30 "the long request running" running_at_least 1
for ((k = 0; k < 4; k++)); do
	# shellcheck disable=SC2046
	generate --tokens "$(prompt_of $k)" $(args_of $k) >"$IT_TMP/together.$k" &
	pids[k]=$!
done
kill -KILL "$gone" 2>/dev/null || true
for ((k = 0; k < 4; k++)); do
	wait "${pids[$k]}" || fail "request $k beside a client that went away failed"
	expect_eq "$(cat "$IT_TMP/together.$k")" "$(cat "$IT_TMP/alone.$k")" "request $k beside a client that went away"
done
cancelled() { (($(went_away) > before)); }
wait_until 30 "gpu-runner cancels the request of the client that went away" cancelled
wait_until 30 "no request left running" idle
log "a client that went away: its request cancelled, the others' tokens unchanged"
"$PIPELINE" stop >/dev/null

# ---- the KV of every request through the kv-store and its spill file ---------------------------
# 40 KiB of runner KV is 10 blocks of 16 tokens of the tiny model (4 KiB each), shared by 2
# requests at once (each needs 5 at least): fewer than the 12 the longest requests fill alone in its
# 2 layers, so blocks leave the arena and come back whatever runs beside them; the kv-store's pool
# of 64 KiB (16 blocks) spills the rest to its file.
"$PIPELINE" start --model "$MODEL" --backend "$BACKEND" --cpu-share 0 --kv-gpu-budget $kv_gpu --kv-dram-budget $kv_dram \
	--runner-opt=--prefill-chunk=16 --runner-opt=--max-batch=2 >/dev/null
expect_eq "$(batch_stat max_batch)" 2 "2 requests at once with a small KV arena"
# On CUDA a prompt cut into other chunks rounds otherwise (bf16 KV): the tokens alone again, with
# these chunks. (The C backend computes the same numbers whatever the chunks.)
[[ $BACKEND == cpu ]] || alone_all
together_all "16 at once, KV through every tier"
fetched=$(stat_value gpu-runner kv_blocks_fetched)
spilled=$(stat_value kv-store spills)
expect_gt "${fetched:-0}" 0 "KV blocks fetched back into the runner"
expect_gt "${spilled:-0}" 0 "KV blocks spilled to the kv-store's file"
log "16 at once with the KV through every tier: the same tokens ($fetched blocks fetched back, $spilled spilled by kv-store)"

# kv-store killed while they run: the supervisor starts it again, the runner rebuilds the KV of the
# requests of the step that failed, and every request still gives its tokens alone. Long ones (300
# tokens, 8 of them), so that the kill lands while they run.
for ((k = 0; k < 8; k++)); do
	generate --tokens "$(prompt_of $k)" -n 300 --ignore-eos >"$IT_TMP/long-alone.$k" || fail "long request $k alone failed"
done
KV_PID=$(sup_field kv-store pid)
pids=()
for ((k = 0; k < 8; k++)); do
	generate --tokens "$(prompt_of $k)" -n 300 --ignore-eos >"$IT_TMP/long.$k" 2>"$IT_TMP/long.$k.err" &
	pids+=($!)
done
running() { (($("$PIPECTL" stats gpu-runner | jq -r '.batch.running') >= 1)); }
wait_until 20 "a request running" running
kill -KILL "$KV_PID"
for ((k = 0; k < 8; k++)); do
	wait "${pids[$k]}" || fail "kv-store killed: request $k failed: $(cat "$IT_TMP/long.$k.err")"
	expect_eq "$(cat "$IT_TMP/long.$k")" "$(cat "$IT_TMP/long-alone.$k")" "kv-store killed: request $k vs alone"
done
restarted_kv() { restarted kv-store "$KV_PID"; }
wait_until 30 "kv-store restarted" restarted_kv
log "kv-store killed during 8 requests: each still gives its tokens alone ($(grep -c 'rebuilding the KV of the' "$RUN_DIR/gpu-runner.log" || true) steps rebuilt)"
"$PIPELINE" stop >/dev/null

# ---- --max-batch 1: one at a time; a bad value is refused ----------------------------------------
"$PIPELINE" start --model "$MODEL" --backend "$BACKEND" --cpu-share 0 --runner-opt=--prefill-chunk=32 --runner-opt=--max-batch=1 >/dev/null
expect_eq "$(batch_stat on)" false "--max-batch 1: batching off"
together_all "16 at once with --max-batch 1"
expect_eq "$(batch_stat most_at_once)" 0 "--max-batch 1: no batched step"
log "--max-batch 1: one request at a time, the same tokens"
"$PIPELINE" stop >/dev/null
expect_start_fails "--max-batch 65" "max-batch must be in 0..64 and --max-step-tokens in 0..256" --model "$MODEL" \
	--runner-opt=--max-batch=65
expect_start_fails "--max-step-tokens past --prefill-chunk" "max-step-tokens in 0..16 " --model "$MODEL" \
	--runner-opt=--prefill-chunk=16 --runner-opt=--max-step-tokens=17
log "passed"

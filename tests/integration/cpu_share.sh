#!/usr/bin/env bash
# cpu_share: the runner's --cpu-share, --cpu-threads and --cpu-handoff through scripts/pipeline.
# Bad values are refused at start with a message naming the flag. On the C backend a fraction
# splits every FFN (the CPU's rows computed by cpu-compute on the task pool in decode steps):
# with F32 weights (cpu-compute sums in float32, the reference in double) the greedy tokens are
# run-local's, at half the rows and with all of them on the CPU; the plan is logged, the stats and
# `pipectl get` show it. auto splits nothing on the C backend (nothing streams to a GPU).
# CPU_SHARE_BACKEND=cuda (on a GPU host) runs the same on the CUDA backend with a GPU budget that
# streams the layers, against the same backend without a split.
source "$(dirname "$0")/lib.sh"
it_setup cpu_share
BACKEND=${CPU_SHARE_BACKEND:-cpu}
if [[ $BACKEND != cpu ]] && ! nvidia-smi >/dev/null 2>&1; then
	echo "[cpu_share] SKIP: no GPU for CPU_SHARE_BACKEND=$BACKEND"
	exit 77
fi

expect_start_fails "--cpu-share 1.5" "cpu-share '1.5' is not auto, 0 or a fraction" --model "$MODEL" \
	--cpu-share 1.5
expect_start_fails "--cpu-share half" "cpu-share 'half' is not auto" --model "$MODEL" --cpu-share half
expect_start_fails "--cpu-threads -1" "cpu-threads -1 is out of range" --model "$MODEL" --cpu-threads -1
expect_start_fails "--cpu-handoff sometimes" "cpu-handoff 'sometimes' is not auto, memops or hostfunc" \
	--model "$MODEL" --runner-opt=--cpu-handoff=sometimes
expect_start_fails "--cpu-result sideways" "cpu-result 'sideways' is not mapped, polled or copy" \
	--model "$MODEL" --runner-opt=--cpu-result=sideways
expect_start_fails "--cpu-experts later" "cpu-experts 'later' is not route or visit" \
	--model "$MODEL" --runner-opt=--cpu-experts=later
expect_start_fails "--split-experts sometimes" "split-experts 'sometimes' is not auto, always or off" \
	--model "$MODEL" --runner-opt=--split-experts=sometimes
expect_start_fails "--cpu-expert-chunks ragged" "cpu-expert-chunks 'ragged' is not taper or equal" \
	--model "$MODEL" --runner-opt=--cpu-expert-chunks=ragged
expect_start_fails "--cpu-dispatch often" "cpu-dispatch 'often' is not dispatcher, both, workers or all" \
	--model "$MODEL" --runner-opt=--cpu-dispatch=often
expect_start_fails "--cpu-pin-runner maybe" "cpu-pin-runner 'maybe' is not yes or no" \
	--model "$MODEL" --runner-opt=--cpu-pin-runner=maybe
expect_start_fails "--window-spread sometimes" "window-spread 'sometimes' is not auto, yes or no" \
	--model "$MODEL" --runner-opt=--window-spread=sometimes
expect_start_fails "--cpu-expert-chunk 1KiB" "cpu-expert-chunk 1024 bytes: expected 16KiB to 16MiB" \
	--model "$MODEL" --runner-opt=--cpu-expert-chunk=1KiB
expect_start_fails "--cpu-prefetch without the workers" \
	"cpu-prefetch reads ahead in the idle workers' turns: it needs --cpu-dispatch workers or all, not dispatcher" \
	--model "$MODEL" --runner-opt=--cpu-prefetch=8MiB --runner-opt=--cpu-dispatch=dispatcher
expect_start_fails "--cpu-prefetch-plan maybe" "cpu-prefetch-plan 'maybe' is not yes or no" \
	--model "$MODEL" --runner-opt=--cpu-prefetch-plan=maybe
expect_start_fails "--cpu-prefetch lots" "cpu-prefetch 'lots' is not auto or a size" \
	--model "$MODEL" --runner-opt=--cpu-prefetch=lots
expect_start_fails "--cpu-prefetch 5GiB" "cpu-prefetch 5368709120 bytes: expected at most 4GiB" \
	--model "$MODEL" --runner-opt=--cpu-prefetch=5GiB
expect_start_fails "--cpu-prefetch with host functions" \
	"cpu-prefetch reads ahead in the idle workers' turns, which memops handoffs give them, not hostfunc" \
	--model "$MODEL" --runner-opt=--cpu-prefetch=8MiB --runner-opt=--cpu-handoff=hostfunc
expect_start_fails "--cpu-share-balance step" "cpu-share-balance 'step' is not token or layer" \
	--model "$MODEL" --runner-opt=--cpu-share-balance=step

F32=$IT_TMP/model-f32
# Four layers: with two, the head and two slots of each streamed class hold the whole model, and a
# budget that streams cannot exist.
"$BIN/make-synthetic-model" --shape tiny --layers 4 --dtype f32 --out "$F32" --quiet
budget=()
if [[ $BACKEND != cpu ]]; then
	# The head (128.25 KiB) and two slots of each streamed class (attention 48.25 KiB, FFN 144.25
	# KiB): every layer streams, so every FFN may split.
	budget=(--gpu-budget 520KiB)
	"$PIPELINE" start --model "$F32" --backend "$BACKEND" "${budget[@]}" --cpu-share 0 >/dev/null
	want=$(generate --tokens "$PROMPT" -n 32 --ignore-eos)
	"$PIPELINE" stop
else
	want=$(run_local --model "$F32" --tokens "$PROMPT" -n 32 --ignore-eos 2>/dev/null)
fi
expect_words 32 "$want" "reference tokens"

for share in 0.5 1; do
	"$PIPELINE" start --model "$F32" --backend "$BACKEND" "${budget[@]}" --cpu-share "$share" --cpu-threads 2 \
		--runner-opt=--prefill-chunk=16 >/dev/null
	runner_log=$(cat "$RUN_DIR/gpu-runner.log")
	expect_grep "cpu share $(printf '%.2f' "$share"): 2 worker threads" "$runner_log" "the runner's log at --cpu-share $share"
	# Two workers where fewer CPUs are left beside the runner's thread (and, on CUDA, the handoff's
	# dispatcher): the runner says they share those CPUs.
	keep=1
	[[ $BACKEND == cpu ]] || keep=2
	crowded="--cpu-threads 2 is more than the [0-9]+ CPUs left beside"
	if (($(nproc) > keep && $(nproc) - keep < 2)); then
		expect_grep "$crowded" "$runner_log" "the warning of workers on the runner's CPUs"
	elif grep -qE -- "$crowded" <<<"$runner_log"; then
		fail "--cpu-threads 2 with $(nproc) CPUs: a warning of workers on the runner's CPUs"
	fi
	if [[ $BACKEND == cpu ]]; then
		expect_grep "computes rows \[r, 192\) of 4 FFNs" "$runner_log" "the C backend's split at --cpu-share $share"
	else
		expect_grep "[1-9][0-9]* FFN groups split with the CPU" "$runner_log" "the window's split at --cpu-share $share"
	fi
	got=$(generate --tokens "$PROMPT" -n 32 --ignore-eos)
	expect_eq "$got" "$want" "greedy tokens at --cpu-share $share vs the whole FFN"
	expect_eq "$("$PIPECTL" get gpu-runner cpu-share | awk '{print $3}')" "$(printf '%.2f' "$share")" \
		"pipectl get gpu-runner cpu-share"
	# What the CPU did is visible: the runner's stats, status and inspect.
	stats=$("$PIPECTL" stats gpu-runner)
	jobs=$(sed -n '/"cpu_share"/,/}/s/^ *"jobs": *\([0-9]*\).*/\1/p' <<<"$stats" | head -n 1)
	expect_gt "${jobs:-}" 0 "CPU share jobs in the runner's stats"
	expect_grep '"split_ffns": [1-9]' "$stats" "the split in force in the runner's stats"
	expect_grep '"jobs_failed": 0' "$stats" "failed CPU shares in the runner's stats"
	status=$("$PIPELINE" status 2>&1) || fail "pipeline status failed: $status"
	expect_grep "^CPU share +$(printf '%.2f' "$share"), [1-9][0-9]* FFNs split" "$status" "pipeline status"
	expect_grep "^CPU pool +queue 0 \(at most [1-9][0-9]*\), [1-9][0-9]* tasks done, 0 failed; handoff [0-9.]+ us beyond the job" \
		"$status" "the pool's queue, tasks and handoff in pipeline status"
	expect_grep '"balance": "layer"' "$stats" "each layer's own share, the default, in the runner's stats"
	# The pool's gauges: its queue, its tasks (one a split FFN a decode step), the CPU's bytes a token
	# (F32, dim 64: gate, up and down's rows [r, 192) of every split FFN) and its time a job.
	jq -e '.cpu_share | (.queue_depth | type == "number") and .queue_depth >= 0 and .tasks_done >= .jobs
		and .tasks_failed == 0 and .r_min == .r_max
		and .bytes_per_token == .split_ffns * 3 * (.ffn_dim - .r_min) * 64 * 4 and .cpu_job_us > 0' \
		<<<"$stats" >/dev/null ||
		fail "the pool's queue, tasks, bytes a token and job time in the runner's stats: $(jq -c .cpu_share <<<"$stats")"
	if [[ $BACKEND != cpu ]]; then
		# The handoff, timed on the stream; the plan's prediction naming what binds.
		jq -e '(.cpu_share | .handoff != "none" and .timed_ffns > 0 and (.handoff_us | type == "number")
			and (.handoff_hist | add) > 0 and (.handoff_hist | add) <= .timed_ffns) and .predicted_ms_per_token > 0
			and (.binding | length > 0)' <<<"$stats" >/dev/null ||
			fail "the handoff's timing and the prediction in the runner's stats: $(jq -c '.cpu_share, .binding' <<<"$stats")"
		expect_grep "predicted [0-9.]+ ms/token; .* binds" "$runner_log" "the plan's prediction in the runner's log"
	fi
	# --cpu-prefetch auto (the default) reads ahead where the idle workers dispatch (the default).
	pf=$("$PIPECTL" get gpu-runner cpu-prefetch | awk '{print $3}')
	[[ -n $pf && $pf != 0 && $pf != 0B ]] || fail "pipectl get gpu-runner cpu-prefetch: '$pf', expected auto's size"
	expect_grep "cpu +share $(printf '%.2f' "$share") \\(balance layer, planned anew 0 times\\): [1-9][0-9]* FFNs split" \
		"$("$PIPELINE" inspect --once)" "pipeline inspect"
	"$PIPELINE" stop
	log "--cpu-share $share: tokens equal the whole FFN's"
done

# The runner's log keeps every start's lines, the supervisor heading each with '====': the last start's.
this_start_log() {
	awk '/^==== /{buf=""} {buf = buf $0 "\n"} END{printf "%s", buf}' "$RUN_DIR/gpu-runner.log"
}

# A runner option of the handoff at --cpu-share 0.5: the same greedy tokens as the whole FFN, no
# failed CPU share, and pipectl shows the value. Args: the option's name and value.
same_tokens_with() {
	local name=$1 value=$2
	"$PIPELINE" start --model "$F32" --backend "$BACKEND" "${budget[@]}" --cpu-share 0.5 --cpu-threads 2 \
		--runner-opt=--prefill-chunk=16 "--runner-opt=--$name=$value" >/dev/null
	expect_eq "$("$PIPECTL" get gpu-runner "$name" | awk '{print $3}')" "$value" "pipectl get gpu-runner $name"
	got=$(generate --tokens "$PROMPT" -n 32 --ignore-eos)
	expect_eq "$got" "$want" "greedy tokens at --cpu-share 0.5 --$name $value vs the whole FFN"
	local stats
	stats=$("$PIPECTL" stats gpu-runner) || fail "pipectl stats gpu-runner failed: $stats"
	expect_grep '"jobs_failed": 0' "$stats" "failed CPU shares with --$name $value"
	# The handoff asked for is the one the stream used.
	[[ $name != cpu-handoff ]] || expect_grep "\"handoff\": \"$value\"" "$stats" "the handoff in the stats"
	"$PIPELINE" stop
	log "--$name $value: tokens equal the whole FFN's"
}

if [[ $BACKEND != cpu ]]; then
	# The CPU's partial results copied up (copy) instead of read by a kernel from mapped host memory
	# (the default), and read by a kernel that waits for the job too (polled).
	same_tokens_with cpu-result copy
	same_tokens_with cpu-result polled
	# The seed's handoff, host functions on the stream (memops, the default where the driver has them).
	same_tokens_with cpu-handoff hostfunc
	same_tokens_with cpu-handoff memops

	# The dispatcher alone hands the pool its jobs (--cpu-dispatch dispatcher; the pool's idle workers
	# do too by default); the runner's thread waiting for a step's end does too (both); all three (all).
	same_tokens_with cpu-dispatch dispatcher
	# With the dispatcher alone --cpu-prefetch auto reads nothing ahead (no idle workers dispatch).
	"$PIPELINE" start --model "$F32" --backend "$BACKEND" "${budget[@]}" --cpu-share 0.5 --cpu-threads 2 \
		--runner-opt=--cpu-dispatch=dispatcher >/dev/null
	pf=$("$PIPECTL" get gpu-runner cpu-prefetch | awk '{print $3}')
	[[ $pf == 0 || $pf == 0B ]] || fail "--cpu-prefetch auto with --cpu-dispatch dispatcher: '$pf', expected 0"
	"$PIPELINE" stop
	same_tokens_with cpu-dispatch both
	same_tokens_with cpu-dispatch all
	# auto's balance counting the read-ahead (--cpu-prefetch-plan yes; a fixed share here: the value shown).
	same_tokens_with cpu-prefetch-plan yes

	# The idle workers read each split FFN's weights ahead (--cpu-prefetch): the same tokens.
	"$PIPELINE" start --model "$F32" --backend "$BACKEND" "${budget[@]}" --cpu-share 0.5 --cpu-threads 2 \
		--runner-opt=--prefill-chunk=16 --runner-opt=--cpu-prefetch=1MiB >/dev/null
	got=$(generate --tokens "$PROMPT" -n 32 --ignore-eos)
	expect_eq "$got" "$want" "greedy tokens at --cpu-share 0.5 --cpu-prefetch 1MiB vs the whole FFN"
	stats=$("$PIPECTL" stats gpu-runner)
	expect_grep '"jobs_failed": 0' "$stats" "failed CPU shares with --cpu-prefetch"
	"$PIPELINE" stop
	log "--cpu-prefetch 1MiB: tokens equal the whole FFN's"

	# auto with one share for the token (--cpu-share-balance token; layer is the default): the same tokens.
	"$PIPELINE" start --model "$F32" --backend "$BACKEND" "${budget[@]}" --cpu-share auto --cpu-threads 2 \
		--runner-opt=--prefill-chunk=16 --runner-opt=--cpu-share-balance=token >/dev/null
	expect_eq "$("$PIPECTL" get gpu-runner cpu-share-balance | awk '{print $3}')" token \
		"pipectl get gpu-runner cpu-share-balance"
	got=$(generate --tokens "$PROMPT" -n 32 --ignore-eos)
	expect_eq "$got" "$want" "greedy tokens at --cpu-share auto --cpu-share-balance token vs the whole FFN"
	expect_grep '"jobs_failed": 0' "$("$PIPECTL" stats gpu-runner)" "failed CPU shares with one share a token"
	"$PIPELINE" stop
	log "--cpu-share-balance token: tokens equal the whole FFN's"

	# The kept layer groups spread among the layers (--window-spread auto, the default where FFNs
	# split). At 760KiB the plan keeps the four attention groups and one FFN group (128.25 + 4 x 48.25
	# + 144.25 KiB) beside two FFN slots (2 x 144.25), and spread puts that FFN in the last layer, not
	# the first (at 520KiB none is kept, and nothing would move): the same tokens, the three streamed
	# FFNs split with the CPU.
	"$PIPELINE" start --model "$F32" --backend "$BACKEND" --gpu-budget 760KiB --cpu-share 0.5 --cpu-threads 2 \
		--runner-opt=--prefill-chunk=16 >/dev/null
	expect_eq "$("$PIPECTL" get gpu-runner window-spread | awk '{print $3}')" auto "pipectl get gpu-runner window-spread"
	runner_log=$(this_start_log)
	expect_grep "the kept layer groups spread among the layers" "$runner_log" "the window's plan with the FFNs split"
	expect_grep "[1-9][0-9]* FFN groups split with the CPU" "$runner_log" "the split with the kept layers spread"
	got=$(generate --tokens "$PROMPT" -n 32 --ignore-eos)
	expect_eq "$got" "$want" "greedy tokens with the kept layers spread vs the whole FFN"
	stats=$("$PIPECTL" stats gpu-runner)
	expect_grep '"spread": true' "$stats" "the runner's stats with the kept layers spread"
	expect_grep '"jobs_failed": 0' "$stats" "failed CPU shares with the kept layers spread"
	"$PIPELINE" stop
	log "--window-spread auto: the FFNs split, the kept layers spread, tokens equal the whole FFN's"

	# --window-spread=no keeps the first layers, the same split.
	"$PIPELINE" start --model "$F32" --backend "$BACKEND" --gpu-budget 760KiB --cpu-share 0.5 --cpu-threads 2 \
		--runner-opt=--prefill-chunk=16 --runner-opt=--window-spread=no >/dev/null
	this_start=$(this_start_log)
	expect_grep "FFN groups split with the CPU" "$this_start" "the split with --window-spread=no"
	! grep -q "the kept layer groups spread" <<<"$this_start" ||
		fail "the window's plan with --window-spread=no: the kept layer groups spread"
	got=$(generate --tokens "$PROMPT" -n 32 --ignore-eos)
	expect_eq "$got" "$want" "greedy tokens with --window-spread=no vs the whole FFN"
	expect_grep '"spread": false' "$("$PIPECTL" stats gpu-runner)" "the runner's stats with --window-spread=no"
	"$PIPELINE" stop
	log "--window-spread=no: the first layers kept, tokens equal the whole FFN's"
fi

# auto on the C backend: nothing splits, no pool.
if [[ $BACKEND == cpu ]]; then
	"$PIPELINE" start --model "$MODEL" >/dev/null
	expect_grep "auto splits no FFN on the cpu backend" "$(cat "$RUN_DIR/gpu-runner.log")" "the runner's log at auto"
	expect_words 8 "$(generate --tokens "$PROMPT" -n 8)" "tokens at auto"
	expect_grep "cpu +share off: no FFN split" "$("$PIPELINE" inspect --once)" "pipeline inspect at auto"
	"$PIPELINE" stop
fi
log "ok"

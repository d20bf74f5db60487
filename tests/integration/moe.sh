#!/usr/bin/env bash
# moe: Qwen3 and the mixture-of-experts checkpoints (qwen3-tiny, mixtral-tiny, qwen3-moe-tiny)
# through the services on the C reference backend, before any transformers fixture exists: every
# expert is a weight group of its own in the ring, the greedy tokens through the pipeline are
# run-local's, a prompt longer than a prefill chunk included, and `pipeline inspect` shows the
# expert size class. Then each mixture-of-experts model again under a DRAM budget below the whole
# model, so its experts stream from disk through the expert slots like the layers of a dense model:
# the same tokens, and the loader's stats show expert groups read into streaming slots, only those
# the routings chose, and the runner's that the chosen experts of a layer were asked for together. A budget
# below the globals and one attention, one router and one expert slot is refused, naming that
# minimum.
source "$(dirname "$0")/lib.sh"
it_setup moe

PROMPT=1,5,9,13,17,21,25,29,33,37,41,45,49,53,57,61,65,69,73,77
for shape in qwen3-tiny mixtral-tiny qwen3-moe-tiny; do
	dir=$IT_TMP/$shape
	"$BIN/make-synthetic-model" --shape "$shape" --seed 5 --out "$dir" --quiet
	want=$("$BIN/run-local" --model "$dir" --tokens "$PROMPT" -n 24 --ignore-eos --prefill-chunk 8)
	expect_words 24 "$want" "$shape: run-local's tokens"
	"$PIPELINE" start --model "$dir" --backend cpu --runner-opt=--prefill-chunk=8 >/dev/null
	got=$(generate --tokens "$PROMPT" -n 24 --ignore-eos)
	expect_eq "$got" "$want" "$shape: greedy tokens through the services vs run-local"
	if [[ $shape != qwen3-tiny ]]; then
		stats=$("$PIPECTL" stats ssd-loader)
		# embed, head, and per layer attention, router and 8 experts: 2 + 2 * 10; all resident
		expect_grep '"groups": 22,' "$stats" "$shape: weight groups in the loader's stats"
		expect_grep '"slots_expert": 16,' "$stats" "$shape: expert slots in the loader's stats"
		# The decode steps' routing (the counts a plan of the experts kept resident reads): each of
		# the 23 decode steps chose num_experts_per_tok experts in every layer.
		k=$(jq -r .num_experts_per_tok "$dir/config.json")
		layers=$(jq -r .num_hidden_layers "$dir/config.json")
		moe=$("$PIPECTL" stats gpu-runner | jq -c .moe)
		expect_eq "$(jq -r .decode_steps <<<"$moe")" 23 "$shape: decode steps in the runner's routing stats"
		expect_eq "$(jq -r .routed <<<"$moe")" $((23 * layers * k)) "$shape: experts the decode steps chose"
		expect_eq "$(jq -r .experts_per_step <<<"$moe")" "$k" "$shape: experts a layer and step"
		hot=$(jq -r '.hot | length' <<<"$moe")
		((hot >= 1 && hot <= 8)) || fail "$shape: $hot hottest experts listed, want 1..8: $moe"
		expect_eq "$(jq -r '[.hot[][2]] == ([.hot[][2]] | sort | reverse)' <<<"$moe")" true \
			"$shape: the hottest experts, most used first"
		# The inspector reads the ring's tables of a model with experts.
		view=$("$PIPELINE" inspect --once 2>&1)
		expect_grep "expert 16, global" "$view" "$shape: expert slots in pipeline inspect"
	fi
	"$PIPELINE" stop >/dev/null
	expect_nothing_left "$shape: after stop"
	log "$shape: $got"
done

# The minimum and the all-resident size come from the loader's refusal of a tiny budget; half way
# between streams the experts (and the layers) with a few groups pinned.
for shape in mixtral-tiny qwen3-moe-tiny; do
	dir=$IT_TMP/$shape
	out=$("$PIPELINE" start --model "$dir" --backend cpu --dram-budget 4KiB 2>&1) &&
		fail "$shape: start with a 4 KiB DRAM budget succeeded"
	expect_nothing_left "$shape: after the refused start"
	expect_grep "too small: the globals and one attention, one router and one expert group need at least" "$out" \
		"$shape: the refusal names the minimum"
	need=$(sed -n 's/.*need at least [^(]*(\([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
	whole=$(sed -n 's/.*whole model resident needs \([0-9]*\) bytes.*/\1/p' <<<"$out" | head -n 1)
	[[ -n $need && -n $whole ]] || fail "$shape: no minimum in the refusal: $out"
	expect_gt "$whole" "$need" "$shape: all resident vs the minimum"
	# One byte short of the minimum is refused too; the minimum itself starts.
	# (The run directory's logs keep the 4 KiB refusal: the last refusal is this one's.)
	out=$("$PIPELINE" start --model "$dir" --backend cpu --dram-budget "$((need - 1))" 2>&1) &&
		fail "$shape: start one byte below the minimum succeeded"
	expect_nothing_left "$shape: after the refused start"
	last=$(grep 'is too small' <<<"$out" | tail -n 1)
	[[ $last != *"4.00 KiB is too small"* ]] || fail "$shape: no refusal of $((need - 1)) bytes in: $out"
	expect_grep "need at least [^(]*\($need bytes" "$last" "$shape: the refusal one byte below the minimum"
	want=$("$BIN/run-local" --model "$dir" --tokens "$PROMPT" -n 24 --ignore-eos --prefill-chunk 8)
	for budget in "$need" "$(((need + whole) / 2))"; do
		"$PIPELINE" start --model "$dir" --backend cpu --dram-budget "$budget" \
			--runner-opt=--prefill-chunk=8 >/dev/null
		got=$(generate --tokens "$PROMPT" -n 24 --ignore-eos)
		expect_eq "$got" "$want" "$shape: greedy tokens with experts streaming ($budget bytes of DRAM)"
		all_resident=$(stat_value ssd-loader all_resident)
		[[ ${all_resident:-} != 1 ]] || fail "$shape: all resident under a budget of $budget bytes"
		streamed=$(stat_value ssd-loader expert_groups_streamed)
		streamed_bytes=$(stat_value ssd-loader expert_bytes_streamed)
		slots=$(stat_value ssd-loader slots_expert)
		# 24 tokens after the prompt pass over 16 experts each: far more loads than slots.
		expect_gt "$streamed" 16 "$shape: expert groups read into streaming slots"
		expect_gt "$streamed_bytes" 0 "$shape: expert bytes read into streaming slots"
		# Experts are read only when a routing asks for them: a decode token loads at most its 2 of a
		# layer's 8, a prefill chunk of 8 tokens at most all 8; so 8 chunks x 2 layers x 8 + 24
		# tokens x 2 layers x 2 = 224 loads at most (every expert at every step: (8 + 24) x 16).
		((streamed <= 224)) || fail "$shape: $streamed expert loads, more than the routings asked for (224 at most)"
		((slots < 16)) || fail "$shape: $slots expert slots under a budget of $budget bytes, not fewer than 16"
		# A layer's 2 chosen experts are asked for together at its routing (the loader reads them at
		# once) where both stream and the streaming expert slots have room for them (at the minimum
		# there is one).
		ahead=$(stat_value gpu-runner experts_ahead)
		if ((budget > need)); then
			expect_gt "$ahead" 0 "$shape: experts acquired at their layer's routing"
		else
			expect_eq "$ahead" 0 "$shape: experts acquired at their layer's routing with one expert slot"
		fi
		"$PIPELINE" stop >/dev/null
		expect_nothing_left "$shape: after stop ($budget bytes)"
		log "$shape: $budget bytes of DRAM: $slots expert slots, $streamed expert loads ($streamed_bytes bytes), $ahead acquired at the routing"
	done
done
log "ok"

#!/usr/bin/env bash
# run_local_cuda: run-local on the CUDA backend (skipped without a GPU) copies every weight into
# device memory at a 16-byte boundary, whatever its offset in the file. A safetensors header is
# padded to 8 bytes only, so in about half the files every tensor lies 8 bytes off 16; copied as the
# file lies, such weights failed the one-token kernels' alignment test: every product fell back to
# cuBLAS and each MoE layer to the host's route ("experts: layer 0 is routed on the host"). Here a
# one-layer qwen3-moe-tiny whose data start 8 bytes off 16 (checked first) runs its layer on the
# device's route and generates its tokens (the fidelity tests compare run-local's tokens on CUDA
# with transformers'; this one checks the route, which tokens alone do not show).
source "$(dirname "$0")/lib.sh"
it_setup run_local_cuda
if ! nvidia-smi -L >/dev/null 2>&1; then
	echo "[$IT_NAME] SKIP: no GPU"
	exit 77
fi

dir=$IT_TMP/tiny
"$BIN/make-synthetic-model" --shape qwen3-moe-tiny --layers 1 --seed 3 --out "$dir" --quiet
st=$dir/model.safetensors
[[ -f $st ]] || fail "make-synthetic-model wrote no $st"
hlen=$(od -An -tu8 -N8 "$st" | tr -d ' ')
[[ $hlen =~ ^[0-9]+$ ]] || fail "cannot read the header length of $st"
expect_eq "$(((8 + hlen) % 16))" 8 "where $st's data start, modulo 16 (the case this test is for: pick another shape if the writer's header moved)"

out=$("$BIN/run-local" --model "$dir" --backend cuda --tokens "$PROMPT" --max-new 8 --ignore-eos 2>"$IT_TMP/err") ||
	fail "run-local on CUDA failed: $(tail -3 "$IT_TMP/err")"
if grep -q "routed on the host" "$IT_TMP/err"; then
	fail "the MoE layer went to the host's route: $(grep "routed on the host" "$IT_TMP/err")"
fi
expect_words 8 "$out" "run-local's generated tokens"
log "data 8 bytes off 16: the layer routed on the device, tokens $out"
log "PASS"

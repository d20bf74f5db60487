#!/usr/bin/env bash
# kv_readahead: the KV read-ahead (kv_cache.h) on a model of six layers whose context is
# larger than the runner's KV budget: while a layer is attended, the next layer's blocks come
# back from the pool, and the layer after waits for them. The tokens are exactly those of the
# in-process run with no budget, and the runner's counters show blocks brought in ahead.
source "$(dirname "$0")/lib.sh"
it_setup kv_readahead

MODEL6=$IT_TMP/model6
"$BIN/make-synthetic-model" --shape tiny --layers 6 --out "$MODEL6" --quiet
PROMPT_1K=$(for ((i = 0; i < 1000; i++)); do echo $(((i * 53 + 7) % 500 + 1)); done | paste -sd,)
# READAHEAD_BACKEND=cuda (on a GPU host): the reference is the same backend with the whole
# context in its arena.
BACKEND=${READAHEAD_BACKEND:-cpu}
if [[ $BACKEND == cpu ]]; then
	want=$("$BIN/run-local" --model "$MODEL6" --tokens "$PROMPT_1K" -n 100 --ignore-eos)
else
	"$PIPELINE" start --model "$MODEL6" --backend "$BACKEND" --kv-gpu-budget 64MiB
	want=$(generate --tokens "$PROMPT_1K" -n 100 --ignore-eos)
	"$PIPELINE" stop
fi
expect_words 100 "$want" "reference tokens"

# 1 MiB of arena (f32: 256 blocks of 16 positions; smaller blocks on the GPU: more of them)
# for 6 layers of 1100 positions: the next layer comes back while one is attended.
"$PIPELINE" start --model "$MODEL6" --backend "$BACKEND" --kv-gpu-budget "${READAHEAD_BUDGET:-1MiB}"
got=$(generate --tokens "$PROMPT_1K" -n 100 --ignore-eos)
expect_eq "$got" "$want" "1100 positions of 6 layers through a small arena with read-ahead vs the whole context in the arena"

fetched=$(stat_value gpu-runner kv_blocks_fetched)
ahead=$(stat_value gpu-runner kv_readahead_blocks)
log "runner fetched $fetched blocks back, $ahead of them by read-ahead"
expect_gt "$ahead" 0 "KV blocks brought back by the read-ahead"

# A second request: the first one's read-ahead of layer 0 (for a step that never came) is
# waited for and handed back; the tokens are the same again.
got=$(generate --tokens "$PROMPT_1K" -n 100 --ignore-eos)
expect_eq "$got" "$want" "the same request again"

"$PIPELINE" stop
expect_nothing_left "after stop"

#!/usr/bin/env bash
# kv_long: a 4K-token context (a 3584-token prompt and 511 generated tokens on the tiny
# model, whose context is 4096) with KV budgets that force every tier: the runner holds 16
# blocks of the 512 the sequence fills, the kv-store pool 64, the rest goes to the spill
# file and comes back through the pool for every token. The tokens are exactly those of the
# in-process run with no budget at all.
source "$(dirname "$0")/lib.sh"
it_setup kv_long

PROMPT_LONG=$(for ((i = 0; i < 3584; i++)); do echo $(((i * 37 + 11) % 500 + 1)); done | paste -sd,)
want=$(run_local --tokens "$PROMPT_LONG" -n 511 --ignore-eos)
expect_words 511 "$want" "run-local tokens"

"$PIPELINE" start --model "$MODEL" --backend cpu --kv-gpu-budget 64KiB --kv-dram-budget 256KiB \
	--runner-opt=--prefill-chunk=64
# The prompt from a file (--tokens @FILE), as a prompt too long for one argument would come.
printf '%s\n' "$PROMPT_LONG" >"$IT_TMP/prompt.ids"
got=$(generate --tokens "@$IT_TMP/prompt.ids" -n 511 --ignore-eos)
expect_eq "$got" "$want" "4K-token context through the runner's 16 blocks, a pool of 64 and the spill file vs run-local"

fetched=$(stat_value gpu-runner kv_blocks_fetched)
committed=$(stat_value gpu-runner kv_blocks_committed)
spills=$(stat_value kv-store spills)
from_disk=$(stat_value kv-store fetches_from_disk)
log "runner committed $committed blocks and fetched $fetched; kv-store spilled $spills, served $from_disk from disk"
expect_gt "$committed" 500 "KV blocks the runner committed (the 4K context is 512 blocks)"
expect_gt "$fetched" 0 "KV blocks the runner fetched back"
expect_gt "$spills" 0 "KV blocks kv-store spilled"
expect_gt "$from_disk" 0 "KV fetches kv-store served from the spill file"

"$PIPELINE" stop
expect_nothing_left "after stop"
log "ok"

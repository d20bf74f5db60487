#!/usr/bin/env bash
# demo: scripts/pipeline demo writes its checkpoint to the cache, generates, prints the
# tokens and the summary, stops, and leaves nothing behind.
source "$(dirname "$0")/lib.sh"
it_setup demo
export XDG_CACHE_HOME=$IT_TMP/cache

# The demo's instance is "demo" unless --instance names another: this test's own.
out=$("$PIPELINE" --instance "$INSTANCE" demo 2>&1) || {
	printf '%s\n' "$out" >&2
	fail "scripts/pipeline demo failed"
}
expect_grep "random weights" "$out" "demo says its weights are random"
tokens=$(grep -E '^[0-9]+( [0-9]+){63}$' <<<"$out" || true)
[[ -n $tokens ]] || fail "demo printed no line of 64 tokens: $out"
expect_grep '^SSD -> DRAM .* read from disk' "$out" "demo's summary"
expect_grep 'all resident: no' "$out" "demo streams its weights"
expect_grep '^KV cache +[1-9][0-9]* blocks committed, [1-9][0-9]* spilled' "$out" "demo's KV tiers"
expect_grep '^compute ' "$out" "demo's summary"
[[ -f $XDG_CACHE_HOME/llm-pipeline/demo-model/config.json ]] || fail "no demo model in the cache"
expect_nothing_left "after demo"
log "ok"

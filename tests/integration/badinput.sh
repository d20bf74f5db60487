#!/usr/bin/env bash
# badinput: starts that must fail — a missing model, a truncated safetensors file, an
# unsupported dtype, an unsupported architecture, a DRAM budget below the minimum, a flag
# that is not a size, a runner option out of its range, a second start of a running instance. Each exits non-zero with a
# message that names the problem, no service crashes (the service alone exits with status
# 1 or 2, never a signal), and nothing is left running.
source "$(dirname "$0")/lib.sh"
it_setup badinput

# expect_service_fails WHAT SERVICE PATTERN ARGS...: the service run alone exits 1 or 2 (a
# refusal, not a crash) with PATTERN on stderr.
expect_service_fails() {
	local what=$1 service=$2 pattern=$3 out rc=0
	shift 3
	out=$("$BIN/$service" --instance "$INSTANCE-alone" --run-dir "$IT_TMP/alone" "$@" 2>&1) || rc=$?
	[[ $rc == 1 || $rc == 2 ]] || fail "$what: $service alone exited with status $rc (want 1 or 2): $out"
	expect_grep "$pattern" "$out" "$what: $service's message"
	[[ -z $(ls /dev/shm/llmp-"$(id -u)-$INSTANCE"-alone-* 2>/dev/null) ]] || fail "$what: $service left shared memory"
}

# A copy of the tiny checkpoint to break.
broken() {
	rm -rf "$IT_TMP/broken"
	cp -r "$MODEL" "$IT_TMP/broken"
	printf '%s\n' "$IT_TMP/broken"
}

expect_start_fails "missing model directory" "does not exist" --model "$IT_TMP/no-such-model"
# A bad PIPELINE_READY_TIMEOUT: a usage error before anything is made (it was found by the
# supervisor after the run directory and its lock were, the message naming a log never written).
rc=0
out=$(PIPELINE_READY_TIMEOUT=abc "$PIPELINE" start --model "$MODEL" 2>&1) || rc=$?
expect_eq "$rc" 2 "start with PIPELINE_READY_TIMEOUT=abc: its exit status"
expect_grep "PIPELINE_READY_TIMEOUT=abc" "$out" "start with PIPELINE_READY_TIMEOUT=abc: the message"
[[ ! -e $RUN_DIR ]] || fail "start with PIPELINE_READY_TIMEOUT=abc made the run directory $RUN_DIR"

# run-local's flags past the runner's limits: refused (exit 2), not cut to 32 bits or divided by 0.
for bad in "--kv-block-tokens 4294967296" "-n 4294967296" "--threads 4294967297" "--temperature nan" \
	"--top-p -1" "--repetition-penalty 1e-45"; do
	rc=0
	# shellcheck disable=SC2086
	out=$(run_local --tokens 1,2,3 $bad 2>&1) || rc=$?
	expect_eq "$rc" 2 "run-local $bad: its exit status ($out)"
	expect_grep "out of range|must be in" "$out" "run-local $bad: its message"
done

m=$(broken)
truncate -s $(($(stat -c %s "$m/model.safetensors") / 3)) "$m/model.safetensors"
expect_start_fails "truncated safetensors" "truncated|past the end|corrupt" --model "$m"
expect_service_fails "truncated safetensors" ssd-loader "truncated|past the end|corrupt" --model "$m"

# The first tensor's dtype rewritten from BF16 to I8 inside the header, its length kept.
m=$(broken)
f=$m/model.safetensors
n=$(od -An -tu8 -N8 "$f" | tr -d ' ')
dd if="$f" bs=1 skip=8 count="$n" status=none | sed 's/"dtype":"BF16"/"dtype":"I8"  /' >"$IT_TMP/header"
expect_eq "$(stat -c %s "$IT_TMP/header")" "$n" "length of the rewritten safetensors header"
grep -q '"I8"' "$IT_TMP/header" || fail "the test could not find a BF16 dtype to rewrite"
dd if="$IT_TMP/header" of="$f" bs=1 seek=8 conv=notrunc status=none
expect_start_fails "unsupported dtype" "I8.*not supported|unsupported.*I8" --model "$m"
expect_service_fails "unsupported dtype" ssd-loader "I8" --model "$m"

m=$(broken)
sed -i 's/LlamaForCausalLM/GPT2LMHeadModel/; s/"model_type": *"llama"/"model_type": "gpt2"/' "$m/config.json"
expect_start_fails "unsupported architecture" "GPT2LMHeadModel.*not supported" --model "$m"
expect_service_fails "unsupported architecture" ssd-loader "GPT2LMHeadModel" --model "$m"

expect_start_fails "DRAM budget too small" "too small.*need" --model "$MODEL" --dram-budget 8KiB
expect_service_fails "DRAM budget too small" ssd-loader "too small.*need" --model "$MODEL" --dram-budget 8KiB

expect_start_fails "a budget that is not a size" "not a size" --model "$MODEL" --dram-budget banana
# A hang window shorter than two of the services' beats (they beat every second) would kill them.
expect_start_fails "a hang window of 600 ms" "hang window of 600 ms.*at least 2000" --model "$MODEL" \
	--supervisor-opt=--heartbeat-ms=300
expect_start_fails "a hang window of one beat" "hang window of 1000 ms" --model "$MODEL" \
	--supervisor-opt=--hang-periods=1
expect_service_fails "a budget that is not a size" kv-store "not a size" --kv-dram-budget banana

expect_start_fails "unknown backend" "backend" --model "$MODEL" --backend tpu
expect_start_fails "the experts' slots out of range" "expert-depth 99" --model "$MODEL" --runner-opt=--expert-depth=99

# A second start of a running instance is refused and leaves the first one serving.
"$PIPELINE" start --model "$MODEL" >/dev/null
pids=$(cat "$RUN_DIR"/*.pid | sort | tr '\n' ' ')
rc=0
out=$("$PIPELINE" start --model "$MODEL" 2>&1) || rc=$?
((rc == 1)) || fail "second start: exit status $rc, want 1"
expect_grep "instance $INSTANCE is already running \(pids .*\); stop it first" "$out" "second start"
expect_eq "$(cat "$RUN_DIR"/*.pid | sort | tr '\n' ' ')" "$pids" "pids after a refused second start"
expect_words 8 "$(generate --tokens "$PROMPT" -n 8)" "generation after a refused second start"
log "second start: refused; the first instance still serves"
"$PIPELINE" stop >/dev/null
expect_nothing_left "after stop"
log "ok"

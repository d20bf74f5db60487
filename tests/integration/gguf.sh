#!/usr/bin/env bash
# gguf: GGUF checkpoints through the whole pipeline on the C reference backend.
#   - fidelity: a fixture's checkpoint converted to GGUF by make-synthetic-model (the same
#     values, wq/wk rows in GGUF's order) computes what transformers computed on the original:
#     F32 and F16 within the fixture bound 1e-4 and the same greedy tokens; Q8_0 within 2e-2;
#     Q4_K_M within GGUF_Q4_K_M_MAX (below: why that bound); quantized cases compare tokens up to
#     the first step whose margin in the fixture is within twice the measured logits error;
#   - the services and run-local give the same tokens on every file;
#   - a split set (three files) gives the tokens of the single file;
#   - the tokenizer and chat template from the file alone: --prompt and --chat work and agree
#     with the Llama 3 tokenizer.json the file was written from;
#   - a truncated file and a file that is not GGUF are refused at start with a message.
# GGUF_BACKEND=cuda runs the fidelity cases and the split set on the CUDA backend (BF16
# activations and KV): bounds of at least 2e-2, tokens up to the first step whose margin is within
# twice the measured error, and run-local (the C reference) held to the fixture the same way.
# GGUF_SET=moe runs the Qwen3 and mixture-of-experts cases instead (integration_gguf_moe): the
# qwen3-tiny, mixtral-tiny, mixtral-window (llama.attention.sliding_window read) and qwen3-moe-tiny
# fixtures as F32 GGUF files (architectures qwen3, llama with experts, qwen3moe; experts in fused
# ffn_*_exps tensors) within 1e-4 and the same
# tokens, and mixtral-tiny in Q8_0 with the quantized bound (qwen3-moe-tiny's experts of 48 hold
# no whole Q8_0 blocks).
source "$(dirname "$0")/lib.sh"
it_setup gguf
BACKEND=${GGUF_BACKEND:-cpu}

COMPARE=${COMPARE_FIXTURE:?set COMPARE_FIXTURE to the compare_fixture binary of the build}
[[ -x $COMPARE ]] || fail "$COMPARE is not built"
FIXTURES=$PIPELINE_SOURCE_DIR/tests/fixtures
# Q4_K_M's bound. On these random models the logits' relative error is the weights' relative
# quantization error times a factor of the model: Q8_0 (0.54% RMS per weight) moves wide-gqa4's
# logits by 1.78e-2, a factor of 3.3. Q4_K_M keeps most matrices in Q4_K (7.0% RMS) and some in
# Q6_K (1.8%), so 3.3 x 5-7% = 0.17-0.23 is what a correct Q4_K_M gives; it measures 0.166. A
# format read wrongly (a nibble order, a scale bit) gives errors of order 1.
GGUF_Q4_K_M_MAX=${GGUF_Q4_K_M_MAX:-0.25}

failed=()
case_failed() {
	log "FAIL: $1: $2"
	failed+=("$1")
}

# gguf_case NAME FIXTURE TYPE REL_L2_MAX [make-synthetic-model args...]: writes the fixture's
# checkpoint as GGUF of TYPE, starts an instance on it, compares with the fixture; the tokens it
# generated are left in CASE_TOKENS (for a later comparison).
gguf_case() {
	local name=$1 fx=$FIXTURES/$2.json type=$3 bound=$4
	shift 4
	local out=$IT_TMP/$name
	mapfile -t args < <("$COMPARE" args "$fx")
	((${#args[@]} > 0)) || fail "$fx: no generator arguments"
	mkdir -p "$out"
	"$BIN/make-synthetic-model" "${args[@]}" --format gguf --type "$type" "$@" --out "$out" --quiet >/dev/null ||
		fail "$name: make-synthetic-model ${args[*]} --format gguf --type $type $* failed"
	local prompt logits=$IT_TMP/$name.logits got line ok=1
	prompt=$("$COMPARE" prompt "$fx") || fail "$fx: no prompt"
	if [[ $BACKEND != cpu ]]; then
		bound=$(awk -v b="$bound" 'BEGIN { print (b < 2e-2 ? 2e-2 : b) }')
	fi
	"$PIPELINE" start --model "$out" --backend "$BACKEND" >/dev/null || fail "$name: start failed"
	if got=$("$PIPECTL" generate --tokens "$prompt" -n 32 --temperature 0 --ignore-eos --dump-logits "$logits"); then
		line=$(FIDELITY_REL_L2_MAX=$bound "$COMPARE" logits "$fx" "$logits") || ok=0
		log "$name ($type) pipeline  $line"
		local margin=1e-4
		if [[ $bound != 1e-4 || $BACKEND != cpu ]]; then
			local max_abs
			max_abs=$(sed -n 's/.*max |diff| \([0-9.e+-]*\) .*/\1/p' <<<"$line")
			margin=$(awk -v m="${max_abs:-0.05}" 'BEGIN { print 2 * m }')
		fi
		FIDELITY_TIE_MARGIN=$margin "$COMPARE" tokens "$fx" "$got" | sed "s/^/[$IT_NAME] $name pipeline  /" ||
			ok=0
	else
		ok=0
		log "FAIL: $name: pipectl generate failed"
	fi
	"$PIPELINE" stop >/dev/null || fail "$name: stop failed"
	expect_nothing_left "$name after stop"
	local local_got
	# run-local computes on the C reference (it holds the weights in host memory).
	if local_got=$("$BIN/run-local" --model "$out" --tokens "$prompt" -n 32 --ignore-eos); then
		if [[ $BACKEND == cpu ]]; then
			[[ $local_got == "$got" ]] || {
				ok=0
				log "FAIL: $name: run-local gave '$local_got', the services '$got'"
			}
		else
			FIDELITY_TIE_MARGIN=${margin:-0.05} "$COMPARE" tokens "$fx" "$local_got" |
				sed "s/^/[$IT_NAME] $name run-local /" || ok=0
		fi
	else
		ok=0
		log "FAIL: $name: run-local failed"
	fi
	((ok)) || case_failed "$name" "does not match its fixture $fx (above)"
	CASE_TOKENS=$got
}

if [[ ${GGUF_SET:-llama} == moe ]]; then
	gguf_case qwen3-f32 qwen3-tiny f32 1e-4
	gguf_case mixtral-f32 mixtral-tiny f32 1e-4
	gguf_case mixtral-window-f32 mixtral-window f32 1e-4
	gguf_case qwen3-moe-f32 qwen3-moe-tiny f32 1e-4
	gguf_case mixtral-q8_0 mixtral-tiny q8_0 2e-2
	((${#failed[@]} == 0)) || fail "${#failed[@]} GGUF cases differ from their fixtures: ${failed[*]}"
	log "ok"
	exit 0
fi
[[ ${GGUF_SET:-llama} == llama ]] || fail "GGUF_SET ${GGUF_SET} is neither llama nor moe"

gguf_case f32 f32-vocab1024 f32 1e-4
gguf_case f16 fp16 f16 1e-4
gguf_case q8_0-tiny f32-vocab1024 q8_0 2e-2 --dtype f32
gguf_case q8_0 wide-gqa4 q8_0 2e-2
q8=$CASE_TOKENS
gguf_case q4_k_m wide-gqa4 q4_k_m "$GGUF_Q4_K_M_MAX"

# A split set of three files: the tokens of the single file (the same bytes, other files).
mapfile -t args < <("$COMPARE" args "$FIXTURES/wide-gqa4.json")
split=$IT_TMP/split
"$BIN/make-synthetic-model" "${args[@]}" --format gguf --type q8_0 --shards 3 --out "$split" --quiet >/dev/null ||
	fail "make-synthetic-model --shards 3 failed"
first=$(find "$split" -name '*-00001-of-00003.gguf')
[[ -n $first ]] || fail "no first file of the split set in $split: $(ls "$split")"
prompt=$("$COMPARE" prompt "$FIXTURES/wide-gqa4.json")
"$PIPELINE" start --model "$first" --backend "$BACKEND" >/dev/null || fail "start on a split set failed"
got=$("$PIPECTL" generate --tokens "$prompt" -n 32 --temperature 0 --ignore-eos) || fail "generate on the split set"
expect_eq "$got" "$q8" "the split set's tokens vs the single file's"
"$PIPELINE" stop >/dev/null
log "split set of 3 files: the single file's tokens"

# Writing one file where the split set is, without --force: refused, the set left whole (the
# writer's cleanup removed the set when only its first file name was checked).
rc=0
out=$("$BIN/make-synthetic-model" "${args[@]}" --format gguf --type q8_0 --out "$split" --quiet 2>&1) || rc=$?
expect_eq "$rc" 1 "make-synthetic-model of one file over a split set, without --force: its exit status"
expect_grep "exists \(a checkpoint's file this write would replace or remove\); pass --force" "$out" \
	"make-synthetic-model of one file over a split set"
expect_eq "$(find "$split" -name '*-of-00003.gguf' | wc -l)" 3 "the split set's files after the refused write"

# A folder holding a GGUF, its name with the characters of a glob ([ ] * ?): found as a checkpoint.
odd="$IT_TMP/ggufs [Q8] *?"
mkdir -p "$odd"
cp "$first" "$odd/"
cp "$(dirname "$first")"/*-0000[23]-of-00003.gguf "$odd/"
"$PIPELINE" start --model "$odd" --backend "$BACKEND" >/dev/null || fail "start on a folder named '$(basename "$odd")'"
got=$("$PIPECTL" generate --tokens "$prompt" -n 32 --temperature 0 --ignore-eos) || fail "generate, the odd folder"
expect_eq "$got" "$q8" "the tokens of a folder named '$(basename "$odd")'"
"$PIPELINE" stop >/dev/null
log "a folder whose name holds [ ] * ?: its GGUF found"

# The tokenizer and the chat template from the file alone.
TOKENIZER=$PIPELINE_SOURCE_DIR/tests/data/llama3-tokenizer/tokenizer.json
chat=$IT_TMP/chat.gguf
"$BIN/make-synthetic-model" --shape tiny --vocab 128256 --bos 128000 --eos 128001,128008,128009 --format gguf \
	--type q8_0 --tokenizer "$TOKENIZER" --out "$chat" --quiet >/dev/null || fail "make-synthetic-model --tokenizer"
tok() { printf '%s' "$1" | "$PIPECTL" tokenize --tokenizer "$TOKENIZER" "${@:2}"; }
ids_csv() { tr ' ' ',' <<<"$1"; }
"$PIPELINE" start --model "$chat" --backend cpu >/dev/null || fail "start on a GGUF with a tokenizer failed"
expect_grep "chat template of $chat \\([0-9]+ bytes\\) goes to the runner" "$(cat "$RUN_DIR/ssd-loader.log")" \
	"the loader's word on the GGUF's chat template"
stats=$("$PIPECTL" stats gpu-runner)
expect_grep '"tokenizer": true' "$stats" "runner stats"
expect_grep '"chat_format": "template"' "$stats" "runner stats"
text="The capital of France is"
prompt_ids=$(tok "$text" --bos)
want=$("$BIN/run-local" --model "$chat" --tokens "$(ids_csv "$prompt_ids")" -n 16)
got=$(generate --prompt "$text" -n 16 --ids)
expect_eq "$got" "$want" "--prompt ids (tokenizer from the GGUF) vs run-local on tokenizer.json's ids"
chat_text=$'<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
chat_ids=$(tok "$chat_text")
want=$("$BIN/run-local" --model "$chat" --tokens "$(ids_csv "$chat_ids")" -n 16 --stop-ids 128009)
got=$(generate --chat "Hello there" --system "Be brief." -n 16 --ids)
expect_eq "$got" "$want" "--chat ids vs run-local on the Llama 3 template"
text_out=$(generate --chat "Hello there" -n 8)
[[ -n $text_out ]] || fail "--chat printed no text"
"$PIPELINE" stop >/dev/null
# pipectl tokenize reads the tokenizer a GGUF file carries, as the runner does.
from_gguf=$(printf '%s' "$text" | "$PIPECTL" tokenize --tokenizer "$chat" --bos)
expect_eq "$from_gguf" "$prompt_ids" "pipectl tokenize --tokenizer FILE.gguf vs tokenizer.json"
log "tokenizer and chat from the GGUF file: ok"

# Refusals at start: a truncated file, and a file that is not GGUF.
bad=$IT_TMP/bad
mkdir -p "$bad"
head -c 100000 "$chat" >"$bad/truncated.gguf"
expect_start_fails "truncated GGUF" "truncated.gguf" --model "$bad/truncated.gguf" --backend cpu
printf 'not a gguf file at all, just text\n' >"$bad/text.gguf"
expect_start_fails "not GGUF" "text.gguf" --model "$bad/text.gguf" --backend cpu

((${#failed[@]} == 0)) || fail "${#failed[@]} GGUF cases differ from their fixtures: ${failed[*]}"
log "ok"

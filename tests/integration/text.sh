#!/usr/bin/env bash
# text: a synthetic model with the Llama 3 vocabulary and its real tokenizer.json. The runner
# tokenizes --prompt (BOS first) and --chat (the Llama 3 header format) exactly as the tokenizer
# does outside it, prints the generated text, stops on stop strings; the same seed gives the
# same text. A tokenizer that disagrees with config.json's vocabulary, or that does not load, is
# refused at start.
source "$(dirname "$0")/lib.sh"
it_setup text

TOKENIZER=$PIPELINE_SOURCE_DIR/tests/data/llama3-tokenizer/tokenizer.json
L3=$IT_TMP/llama3-shaped
"$BIN/make-synthetic-model" --shape tiny --vocab 128256 --bos 128000 --eos 128001,128008,128009 --out "$L3" --quiet
cp "$TOKENIZER" "$L3/"
tok() { printf '%s' "$1" | "$PIPECTL" tokenize --tokenizer "$TOKENIZER" "${@:2}"; }
ids_csv() { tr ' ' ',' <<<"$1"; }

"$PIPELINE" start --model "$L3"
expect_grep '"tokenizer": true' "$("$PIPECTL" stats gpu-runner)" "runner stats"
expect_grep '"chat_format": "llama3"' "$("$PIPECTL" stats gpu-runner)" "runner stats"

# --prompt: BOS, then the tokenizer's ids; the continuation equals run-local on those ids.
text="The capital of France is"
prompt_ids=$(tok "$text" --bos)
expect_grep '^128000 ' "$prompt_ids" "tokenize --bos"
want=$("$BIN/run-local" --model "$L3" --tokens "$(ids_csv "$prompt_ids")" -n 16)
got=$(generate --prompt "$text" -n 16 --ids)
expect_eq "$got" "$want" "--prompt ids vs run-local on the tokenized prompt"
# ... and the text printed is the detokenized ids.
got_text=$(generate --prompt "$text" -n 16)
want_text=$(printf '%s' "$want" | "$PIPECTL" detokenize --tokenizer "$TOKENIZER")
expect_eq "$got_text" "$want_text" "--prompt text vs detokenize of the same ids"
log "prompt: ids and text agree with the tokenizer and run-local"
# A stop id: the ids end with it, the text before it (the token that ends a run has no text, as an
# end-of-turn's "<|eot_id|>" ends no chat answer).
read -r -a ids <<<"$want"
stop_id=${ids[4]}
first=0
while [[ ${ids[first]} != "$stop_id" ]]; do first=$((first + 1)); done
want_ids="${ids[*]:0:first+1}"
expect_eq "$(generate --prompt "$text" -n 16 --ids --stop-ids "$stop_id")" "$want_ids" "ids with --stop-ids $stop_id"
want_text=""
((first == 0)) || want_text=$(printf '%s' "${ids[*]:0:first}" | "$PIPECTL" detokenize --tokenizer "$TOKENIZER")
expect_eq "$(generate --prompt "$text" -n 16 --stop-ids "$stop_id")" "$want_text" "text with --stop-ids $stop_id"
log "stop id $stop_id: the ids end with it, the text of the $first before it"

# --chat: the Llama 3 header format, built from special tokens, then the assistant header.
chat_text=$'<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
chat_ids=$(tok "$chat_text")
want=$("$BIN/run-local" --model "$L3" --tokens "$(ids_csv "$chat_ids")" -n 16 --stop-ids 128009)
got=$(generate --chat "  Hello there " --system "Be brief." -n 16 --ids)
expect_eq "$got" "$want" "--chat ids vs run-local on the Llama 3 template"
log "chat: the prompt is the Llama 3 header format"

# Seeded sampling gives the same text twice.
# A flag's value is left as it reads: the prompt "-n" (rewritten into "--max-new" before) and the
# prompt "--stop" (taken as a stop flag) are those texts, as with --prompt=...
expect_eq "$(generate --prompt -n -n 4 --ids --ignore-eos)" "$(generate --prompt=-n -n 4 --ids --ignore-eos)" \
	"the prompt '-n' given as --prompt -n"
expect_eq "$(generate --prompt --stop -n 4 --ids --ignore-eos)" "$(generate --prompt=--stop -n 4 --ids --ignore-eos)" \
	"the prompt '--stop' given as --prompt --stop"
a=$(generate --prompt "Once upon a time" -n 24 --temperature 0.9 --top-k 50 --min-p 0.05 --repetition-penalty 1.2 --seed 5)
b=$(generate --prompt "Once upon a time" -n 24 --temperature 0.9 --top-k 50 --min-p 0.05 --repetition-penalty 1.2 --seed 5)
expect_eq "$b" "$a" "seeded text twice"
[[ -n $a ]] || fail "sampled text is empty"

# Stop strings: take a piece of the greedy text; generation ends once it appears.
full=$(generate --prompt "$text" -n 16)
stop=${full:3:2}
[[ -n $stop ]] || fail "no text to take a stop string from"
out=$(generate --prompt "$text" -n 16 --stop "$stop" --stats 2>&1 >"$IT_TMP/stop.out")
expect_grep 'stop_string' "$out" "generate --stop stats"
stopped=$(cat "$IT_TMP/stop.out")
[[ $stopped == *"$stop"* ]] || fail "the output '$stopped' does not hold the stop string '$stop'"
((${#stopped} <= ${#full})) || fail "stopping made the output longer"
log "stop string '$stop': stopped after '$stopped'"
# --stats --json: the same timings as one JSON object, alone on the last line of stderr; the text
# on stdout is as without it.
out=$(generate --prompt "$text" -n 16 --stop "$stop" --stats --json 2>&1 >"$IT_TMP/stop.json.out")
expect_eq "$(cat "$IT_TMP/stop.json.out")" "$stopped" "generate --stop --stats --json: the text"
num='[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?'
expect_grep "^\{\"prompt_tokens\":[0-9]+,\"prefill_ms\":$num,\"prefill_tok_s\":$num,\"tokens_generated\":[0-9]+,\"reason\":\"stop_string\",\"decode_ms\":$num,\"decode_tok_s\":$num,\"total_ms\":$num\}\$" \
	"$(tail -n 1 <<<"$out")" "generate --stop --stats --json"

# The model's chat template (tokenizer_config.json's chat_template) renders the chat: here one
# that ends the assistant's header with "Sure:", which the built-in format never writes.
"$PIPELINE" stop
tmpl=$'{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\nSure:{% endif %}'
jq -n --arg t "$tmpl" '{chat_template: $t, bos_token: "<|begin_of_text|>"}' >"$L3/tokenizer_config.json"
"$PIPELINE" start --model "$L3"
expect_grep "chat template of $L3/tokenizer_config.json \\([0-9]+ bytes\\) goes to the runner" "$(cat "$RUN_DIR/ssd-loader.log")" "the loader's word on the template"
expect_grep '"chat_format": "template"' "$("$PIPECTL" stats gpu-runner)" "runner stats with a template"
sure_ids=$(tok "${chat_text}Sure:")
want=$("$BIN/run-local" --model "$L3" --tokens "$(ids_csv "$sure_ids")" -n 16 --stop-ids 128009)
got=$(generate --chat "  Hello there " --system "Be brief." -n 16 --ids)
expect_eq "$got" "$want" "--chat ids vs run-local on the model's template"
err=$(generate --chat "hi" --system "<|eot_id|>" --special-as-text -n 2 --ids 2>&1) || fail "a chat with special-token text: $err"
# A chat of several turns from a file (generate --messages), through the same template.
printf '%s' '[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
 {"role": "assistant", "content": "Hello."}, {"role": "user", "content": " And now? "}]' >"$IT_TMP/chat.json"
turns=$'<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnd now?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nSure:'
want=$("$BIN/run-local" --model "$L3" --tokens "$(ids_csv "$(tok "$turns")")" -n 16 --stop-ids 128009)
expect_eq "$(generate --messages "$IT_TMP/chat.json" -n 16 --ids)" "$want" "--messages ids vs run-local on the template"
expect_eq "$(generate --messages - -n 16 --ids <"$IT_TMP/chat.json")" "$want" "--messages - (standard input)"
printf '%s' '{"role": "user"}' >"$IT_TMP/bad.json"
err=$(generate --messages "$IT_TMP/bad.json" -n 2 2>&1) && fail "--messages with an object succeeded"
expect_grep "not a non-empty JSON array" "$err" "--messages with an object"
log "chat: the model's template renders it, one turn or several"
"$PIPELINE" stop
# --chat-template overrides it; one that does not parse leaves the built-in format, with a warning.
printf '%s' '{% for m in messages %}{{ m.content }' >"$IT_TMP/bad.jinja"
"$PIPELINE" start --model "$L3" --loader-opt=--chat-template="$IT_TMP/bad.jinja"
expect_grep "does not parse \\(chat template, line 1: a '\\{\\{' tag is not closed\\)" "$(cat "$RUN_DIR/ssd-loader.log")" \
	"the loader's warning on a bad template"
expect_grep '"chat_format": "llama3"' "$("$PIPECTL" stats gpu-runner)" "runner stats with a bad template"
want=$("$BIN/run-local" --model "$L3" --tokens "$(ids_csv "$chat_ids")" -n 16 --stop-ids 128009)
got=$(generate --chat "  Hello there " --system "Be brief." -n 16 --ids)
expect_eq "$got" "$want" "--chat ids on the built-in format after a bad template"
rm "$L3/tokenizer_config.json"
log "chat: --chat-template, a template that does not parse"

# Text requests to a model without a tokenizer are refused with a clear message.
"$PIPELINE" stop
"$PIPELINE" start --model "$MODEL"
err=$(generate --prompt "hi" -n 2 2>&1) && fail "--prompt without a tokenizer succeeded"
expect_grep 'no tokenizer.json' "$err" "--prompt on a model without tokenizer"
"$PIPELINE" stop

# A tokenizer whose ids exceed config.json's vocab_size (512) is refused at start.
cp "$TOKENIZER" "$MODEL/"
err=$("$PIPELINE" start --model "$MODEL" 2>&1) && fail "start with a mismatched tokenizer succeeded"
expect_grep "vocab_size is 512" "$err" "start with a tokenizer of another model"
expect_nothing_left "after the refused start"

# A tokenizer whose ids fit but which does not load is refused at start too: the loader reads
# only its ids, the runner loads it whole when it starts.
printf '%s' '{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []},
 "pre_tokenizer": {"type": "Whitespace"}}' >"$MODEL/tokenizer.json"
err=$("$PIPELINE" start --model "$MODEL" 2>&1) && fail "start with a tokenizer that does not load succeeded"
expect_grep "pre_tokenizer type Whitespace is not supported" "$err" "start with a tokenizer that does not load"
expect_nothing_left "after the second refused start"
log "ok"

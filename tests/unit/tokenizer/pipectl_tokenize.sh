#!/usr/bin/env bash
# pipectl tokenize / detokenize with the Llama 3 tokenizer in the tree: ids as llama.cpp's
# vectors have them, BOS, special tokens parsed or taken as text, byte-exact round trips (invalid
# UTF-8 too, with --raw), streaming from a pipe, and the messages of bad input. Needs
# PIPELINE_BIN_DIR (the built pipectl) and PIPELINE_SOURCE_DIR; writes only under mktemp -d.
set -euo pipefail
: "${PIPELINE_BIN_DIR:?set PIPELINE_BIN_DIR to the bin directory of the build}"
: "${PIPELINE_SOURCE_DIR:?set PIPELINE_SOURCE_DIR to the source tree}"
PIPECTL=$PIPELINE_BIN_DIR/pipectl
TOK=$PIPELINE_SOURCE_DIR/tests/data/llama3-tokenizer
tmp=$(mktemp -d /tmp/test-pipectl-tokenize-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

expect_ids() { # text flags... expected
	local text=$1 want=${!#} got
	got=$(printf '%s' "$text" | "$PIPECTL" tokenize --tokenizer "$TOK" "${@:2:$#-2}") ||
		fail "tokenize '$text' exited $?"
	[[ $got == "$want" ]] || fail "tokenize '$text' ${*:2:$#-2}: want '$want', got '$got'"
}
expect_ids "Hello world" "9906 1917"
expect_ids "Hello world" --bos "128000 9906 1917"
expect_ids "<|begin_of_text|>Hello" "128000 9906"
expect_ids "<|begin_of_text|>Hello" --special-as-text "27 91 7413 3659 4424 91 29 9906"
expect_ids "this is 🦙.cpp" "576 374 11410 99 247 13 11055"
expect_ids "" ""
# the directory and the file name the same tokenizer; a trailing newline is text (198)
got=$(printf 'Hello\n' | "$PIPECTL" tokenize --tokenizer "$TOK/tokenizer.json")
[[ $got == "9906 198" ]] || fail "trailing newline: got '$got'"

# detokenize: the text, no newline added; commas work too; special tokens as text or skipped
got=$(echo "128000 9906,1917" | "$PIPECTL" detokenize --tokenizer "$TOK")
[[ $got == "<|begin_of_text|>Hello world" ]] || fail "detokenize: got '$got'"
got=$(echo "128000 9906 1917" | "$PIPECTL" detokenize --tokenizer "$TOK" --skip-special)
[[ $got == "Hello world" ]] || fail "detokenize --skip-special: got '$got'"
printf '9906' | "$PIPECTL" detokenize --tokenizer "$TOK" > "$tmp/one"
[[ $(od -An -c "$tmp/one" | tr -d ' \n') == "Hello" ]] || fail "detokenize added bytes: $(od -c "$tmp/one")"

# byte-exact round trips: mixed text, and invalid UTF-8 with --raw (U+FFFD without it)
printf 'Hello, wörld! 東京 🦙\n\tcode: x = 1234567;\r\n<|eot_id|>  end ' > "$tmp/text"
"$PIPECTL" tokenize --tokenizer "$TOK" < "$tmp/text" | "$PIPECTL" detokenize --tokenizer "$TOK" > "$tmp/back"
cmp -s "$tmp/text" "$tmp/back" || fail "round trip of mixed text differs"
printf 'a\xffb\xe2\x82' > "$tmp/bad"
"$PIPECTL" tokenize --tokenizer "$TOK" < "$tmp/bad" | "$PIPECTL" detokenize --tokenizer "$TOK" --raw > "$tmp/back"
cmp -s "$tmp/bad" "$tmp/back" || fail "raw round trip of invalid UTF-8 differs"
"$PIPECTL" tokenize --tokenizer "$TOK" < "$tmp/bad" | "$PIPECTL" detokenize --tokenizer "$TOK" > "$tmp/back"
printf 'a\xef\xbf\xbdb\xef\xbf\xbd' | cmp -s - "$tmp/back" || fail "invalid UTF-8 is not U+FFFD: $(od -c "$tmp/back")"

# streaming: the llama (11410 99 247) comes out with its last token, before the input ends
mkfifo "$tmp/in"
"$PIPECTL" detokenize --tokenizer "$TOK" < "$tmp/in" > "$tmp/out" &
pid=$!
exec 3> "$tmp/in"
printf '9906 11410 99 ' >&3
for _ in $(seq 50); do [[ -s $tmp/out ]] && break; sleep 0.1; done
[[ $(cat "$tmp/out") == "Hello " ]] || fail "streaming: after 3 ids got '$(cat "$tmp/out")'"
printf '247 ' >&3
for _ in $(seq 50); do [[ $(cat "$tmp/out") == "Hello 🦙" ]] && break; sleep 0.1; done
[[ $(cat "$tmp/out") == "Hello 🦙" ]] || fail "streaming: after 4 ids got '$(cat "$tmp/out")'"
exec 3>&-
wait "$pid" || fail "streaming detokenize exited $?"

# bad input and bad usage: exit status and a message that says what is wrong
set +e
out=$(echo "9906 abc" | "$PIPECTL" detokenize --tokenizer "$TOK" 2>&1); rc=$?
[[ $rc == 1 && $out == *"'abc' is not a token id"* && $out == Hello* ]] || fail "bad id: rc $rc, '$out'"
out=$(echo "128256" | "$PIPECTL" detokenize --tokenizer "$TOK" 2>&1); rc=$?
[[ $rc == 1 && $out == *"token id 128256 is not in"*"vocab size 128256"* ]] || fail "id out of range: rc $rc, '$out'"
out=$("$PIPECTL" tokenize < /dev/null 2>&1); rc=$?
[[ $rc == 1 && $out == *"--tokenizer FILE is required"* ]] || fail "no --tokenizer: rc $rc, '$out'"
out=$("$PIPECTL" tokenize --tokenizer "$tmp/nope.json" < /dev/null 2>&1); rc=$?
[[ $rc == 1 && $out == *"nope.json: No such file"* ]] || fail "missing file: rc $rc, '$out'"
echo '{"model": {"type": "WordPiece"}}' > "$tmp/wp.json"
out=$("$PIPECTL" tokenize --tokenizer "$tmp/wp.json" < /dev/null 2>&1); rc=$?
[[ $rc == 1 && $out == *"model type WordPiece is not supported"* ]] || fail "WordPiece: rc $rc, '$out'"
out=$("$PIPECTL" tokenize --tokenizer "$TOK" extra < /dev/null 2>&1); rc=$?
[[ $rc == 2 ]] || fail "extra argument: rc $rc, '$out'"
set -e
echo "pipectl tokenize/detokenize: ok"

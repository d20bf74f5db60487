#!/usr/bin/env bash
# http_resume: a gpu-runner killed during a request does not lose it. http-api (scripts/pipeline
# start --http) keeps the token ids it has streamed, waits for the supervisor's new runner and
# sends the request again with them (MSG_GENERATE's done part); the new runner restores the KV
# and goes on. On a synthetic model with the Llama 3 tokenizer, a streamed greedy completion and
# a seeded one (temperature 1, seed 7) and a seeded chat, with gpu-runner killed (kill -9) after
# some tokens came, give the text and the completion_tokens of the same request run without the
# kill; a request that does not stream, likewise. A runner stopped with SIGTERM (it ends the request
# as cancelled) is resumed the same way. A request whose runner dies a third time fails.
# HTTP_RESUME_BACKEND=cuda (a GPU host; skipped without one) runs it on the CUDA backend, which
# draws seeded tokens on the GPU.
source "$(dirname "$0")/lib.sh"
BACKEND=${HTTP_RESUME_BACKEND:-cpu}
if [[ $BACKEND != cpu ]] && ! nvidia-smi >/dev/null 2>&1; then
	echo "[http_resume] SKIP: no GPU for HTTP_RESUME_BACKEND=$BACKEND"
	exit 77
fi
it_http_setup http_resume

# --idle-timeout 1: a stream (or a request that does not stream) waiting longer than that for its
# tokens is still open (the limit is for clients that send nothing, not for those that wait); the
# runners stopped with SIGSTOP make it wait past that (the supervisor finds them hung 2 s later).
# The test restarts gpu-runner six times, within a minute where the host is fast: a burst limit
# above that (the default, 5 within 60 s, would give up on it), and short backoffs (the restart's
# delay is not what this tests; the default doubles it to seconds by the fourth restart).
out=$("$PIPELINE" start --model "$L3" --backend "$BACKEND" --http 127.0.0.1:0 --http-opt=--resume-timeout=60 \
	--http-opt=--idle-timeout=1 --supervisor-opt=--burst-limit=20 --supervisor-opt=--backoff-min-ms=50 \
	--supervisor-opt=--backoff-max-ms=100)
BASE=$(grep -o 'http://127\.0\.0\.1:[0-9]*' <<<"$out" | head -n 1)
[[ -n $BASE ]] || fail "start --http did not say where http-api listens: $out"
log "http-api listens on $BASE"

# Long enough that the kill lands while the stream runs: it comes some 20 chunks in, and on the C
# backend the Llama 3 vocabulary's head makes each token take milliseconds, so 256 leave the
# stream running for a second or more after the kill (every token a stream waits for is one the
# test waits for too, twice). On CUDA, with the token picked on the GPU, 800 tokens take about
# 0.1 s, less than the test takes to see the stream.
N=${HTTP_RESUME_TOKENS:-256}
[[ $BACKEND == cpu || -n ${HTTP_RESUME_TOKENS:-} ]] || N=4000
text="The capital of France is"
json_str() { jq -Rs . <<<"$1" | sed 's/\\n"$/"/'; }
# stream_text FILE: the text of an event stream (its chunks joined).
stream_text() {
	sed -n 's/^data: //p' "$1" | grep -v '^\[DONE\]$' | jq -j '.choices[0].text // .choices[0].delta.content // empty'
}
# stream_usage FILE: the completion_tokens of the stream's usage chunk.
stream_usage() { sed -n 's/^data: //p' "$1" | grep -v '^\[DONE\]$' | tail -n 1 | jq -r .usage.completion_tokens; }
resumes() { grep -c 'resuming the request after' "$RUN_DIR/http-api.log" || true; }

# run_case WHAT PATH BODY [SIGNAL]: a streamed request (BODY without its closing brace), its runner
# killed (SIGNAL KILL, the default; STOP: the supervisor finds it hung 2 s later and kills it, so the
# stream waits longer than --idle-timeout; TERM: it stops, ending the request as cancelled) and not.
run_case() {
	local what=$1 path=$2 req="$3, \"stream\": true, \"stream_options\": {\"include_usage\": true}}" sig=${4:-KILL}
	local want=$IT_TMP/want-$((++CASE)) got=$IT_TMP/got-$CASE
	curl -sS -N "$BASE$path" --data-binary "$req" >"$want" || fail "$what: the uninterrupted stream failed"
	local n_want
	n_want=$(stream_usage "$want")
	[[ $n_want =~ ^[0-9]+$ ]] || fail "$what: the uninterrupted stream has no usage: $(tail -c 300 "$want")"
	local finish
	finish=$(sed -n 's/^data: //p' "$want" | grep -v '^\[DONE\]$' | jq -r '.choices[0].finish_reason // empty' | tail -n 1)
	[[ $finish == length ]] && expect_eq "$n_want" "$N" "$what: the uninterrupted completion_tokens"
	local before
	before=$(resumes)
	# The runner's pid before the stream: asked between the stream's start and the kill, the
	# status call (slow on a loaded machine) let a whole stream end first (a CI run at a900aa1).
	local pid
	pid=$(sup_field gpu-runner pid)
	[[ $pid =~ ^[0-9]+$ ]] || fail "$what: no gpu-runner pid in the status: '$pid'"
	curl -sS -N "$BASE$path" --data-binary "$req" >"$got" 2>&1 &
	local client=$!
	streaming() { [[ $(grep -c '^data: {' "$got") -ge 10 ]]; }
	wait_until 30 "$what: the stream before the kill starts" streaming
	kill "-$sig" "$pid"
	local cut
	cut=$(grep -c '^data: {' "$got")
	wait "$client" || fail "$what: the stream of the killed runner did not end cleanly"
	wait_until 30 "$what: gpu-runner restarted" restarted gpu-runner "$pid"
	((cut < n_want)) || fail "$what: the stream had ended ($cut chunks) before the kill; raise HTTP_RESUME_TOKENS"
	expect_eq "$(resumes)" "$((before + 1))" "$what: http-api resumed the request once"
	local errors
	errors=$(sed -n 's/^data: //p' "$got" | grep -v '^\[DONE\]$' | jq -c 'select(.error != null)')
	[[ -z $errors ]] || fail "$what: the resumed stream carries an error: ${errors:0:300}"
	expect_eq "$(stream_text "$got")" "$(stream_text "$want")" "$what: the resumed stream's text vs the uninterrupted one"
	expect_eq "$(stream_usage "$got")" "$n_want" "$what: completion_tokens"
	expect_eq "$(grep '^data: ' "$got" | tail -n 1)" "data: [DONE]" "$what: the last event"
	log "$what: killed after $cut chunks; the stream went on: $n_want tokens, the same text"
	log "$what: the new runner: $(grep -o 'request [0-9]*: .*restored from the kv-store.*generated ([a-z_]*)' "$RUN_DIR/gpu-runner.log" | tail -n 1)"
}
CASE=0
run_case "greedy" /v1/completions "{\"prompt\": $(json_str "$text"), \"max_tokens\": $N, \"temperature\": 0"
run_case "seeded (temperature 1, seed 7)" /v1/completions \
	"{\"prompt\": $(json_str "$text"), \"max_tokens\": $N, \"temperature\": 1, \"seed\": 7"
run_case "greedy, gpu-runner stopped (SIGSTOP) until found hung" /v1/completions \
	"{\"prompt\": $(json_str "$text"), \"max_tokens\": $N, \"temperature\": 0" STOP
run_case "seeded (temperature 1, seed 11), gpu-runner stopped by SIGTERM" /v1/completions \
	"{\"prompt\": $(json_str "$text"), \"max_tokens\": $N, \"temperature\": 1, \"seed\": 11" TERM
# A chat: its prompt is built again from the messages, with the turn's end as a stop id.
run_case "chat (seeded)" /v1/chat/completions \
	"{\"messages\": [{\"role\": \"user\", \"content\": \"Hello there\"}], \"max_tokens\": $N, \"temperature\": 0.9, \"seed\": 3"

# A request that does not stream completes too (its runner stopped a moment after it was sent,
# found hung and killed: the connection waits past --idle-timeout).
req="{\"prompt\": $(json_str "$text"), \"max_tokens\": $N, \"temperature\": 1, \"seed\": 9}"
curl -sS "$BASE/v1/completions" --data-binary "$req" >"$IT_TMP/whole-want" || fail "the uninterrupted completion failed"
before=$(resumes)
tokens0=$(stat_value gpu-runner tokens_computed)
[[ $tokens0 =~ ^[0-9]+$ ]] || fail "the runner's tokens_computed: '$tokens0'"
curl -sS "$BASE/v1/completions" --data-binary "$req" >"$IT_TMP/whole-got" &
CLIENT=$!
# Stopped once it decodes (the runner's count of tokens, live in the ring: the prompt and some 20
# more), not after a fixed sleep, which a fast host outlasts and a slow one does not reach.
decoding() {
	local t
	t=$(stat_value gpu-runner tokens_computed || true)
	[[ $t =~ ^[0-9]+$ ]] && ((t >= tokens0 + 30))
}
wait_until 30 "the completion that does not stream decoding" decoding
PID=$(sup_field gpu-runner pid)
kill -STOP "$PID"
kill -0 "$CLIENT" 2>/dev/null || fail "the completion that does not stream had ended before the stop; raise HTTP_RESUME_TOKENS"
wait "$CLIENT" || fail "the completion of the killed runner failed"
wait_until 30 "gpu-runner restarted" restarted gpu-runner "$PID"
expect_eq "$(resumes)" "$((before + 1))" "a completion that does not stream: resumed once (else it ended before the kill)"
expect_eq "$(jq -r '.choices[0].text' "$IT_TMP/whole-got")" "$(jq -r '.choices[0].text' "$IT_TMP/whole-want")" \
	"a completion that does not stream: the text"
expect_eq "$(jq -r '.usage.completion_tokens' "$IT_TMP/whole-got")" \
	"$(jq -r '.usage.completion_tokens' "$IT_TMP/whole-want")" "a completion that does not stream: completion_tokens"
log "a completion that does not stream: resumed, the same text"

req="{\"prompt\": $(json_str "$text"), \"max_tokens\": 100000, \"temperature\": 0, \"ignore_eos\": true, \"stream\": true}"
# A request during which the runner is restarted three times (pipeline restart: stopped, not
# dead): resumed each time, the stream goes on (restarts say nothing of the request: they do not
# count toward the cap below).
before=$(resumes)
curl -sS -N "$BASE/v1/completions" --data-binary "$req" >"$IT_TMP/restarts" 2>&1 &
CLIENT=$!
for k in 1 2 3 4; do
	seen=$(grep -c '^data: {' "$IT_TMP/restarts" || true)
	moved_on() { (($(grep -c '^data: {' "$IT_TMP/restarts" || true) >= seen + 10)); }
	wait_until 30 "the stream moving on before restart $k" moved_on
	((k < 4)) && "$PIPELINE" restart gpu-runner >/dev/null
done
expect_eq "$(resumes)" "$((before + 3))" "a request whose runner was restarted three times: resumed three times"
kill "$CLIENT" 2>/dev/null || true
wait "$CLIENT" 2>/dev/null || true
[[ -z $(sed -n 's/^data: //p' "$IT_TMP/restarts" | grep -v '^\[DONE\]$' | jq -c 'select(.error != null)') ]] ||
	fail "the stream of a request whose runner was restarted carries an error"
log "a request whose runner was restarted three times: resumed each time, its stream went on"

# A request during which the runner dies three times: resumed twice, then failed (a request that
# kills its runner must not keep the supervisor restarting it). Each kill lands once the stream
# has moved on since the last one.
before=$(resumes)
curl -sS -N "$BASE/v1/completions" --data-binary "$req" >"$IT_TMP/thrice" 2>&1 &
CLIENT=$!
for k in 1 2 3; do
	seen=$(grep -c '^data: {' "$IT_TMP/thrice" || true)
	moved_on() { (($(grep -c '^data: {' "$IT_TMP/thrice" || true) >= seen + 10)); }
	wait_until 30 "the stream moving on before kill $k" moved_on
	PID=$(sup_field gpu-runner pid)
	kill -KILL "$PID"
	wait_until 30 "gpu-runner restarted after kill $k" restarted gpu-runner "$PID"
done
wait "$CLIENT" || true
expect_eq "$(resumes)" "$((before + 2))" "a request whose runner died three times: resumed twice"
expect_grep '"error"' "$(sed -n 's/^data: //p' "$IT_TMP/thrice" | tail -n 3)" "its stream ends with an error event"
expect_grep "went away 3 times during the request" "$(cat "$IT_TMP/thrice")" "the error says why"
log "a request whose runner died three times: resumed twice, then failed"

# /metrics counts them: as many resumes as the log says.
curl -sS "$BASE/metrics" >"$IT_TMP/metrics" || fail "GET /metrics failed"
expect_eq "$(awk '$1 == "pipeline_http_resumes_total" {print $2}' "$IT_TMP/metrics")" "$(resumes)" \
	"/metrics: pipeline_http_resumes_total"
log "/metrics: pipeline_http_resumes_total $(resumes)"

"$PIPELINE" stop >/dev/null
expect_nothing_left "stop"
log "passed"

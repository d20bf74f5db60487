#!/usr/bin/env bash
# http_load: http-api under load, on loopback. An instance with --http and a queue (--max-queue 64)
# deep enough for 32 clients at once; http_load_client.py (Python's standard library) first sends
# each of 8 request shapes alone (completions and chat, greedy and seeded, max_tokens 1..24,
# streamed and not) for its reference answer, then 500 requests drawn from them, 32 at a time,
# streamed or not, one in 10 a client that closes its socket after its stream's first event. Every
# other answer is complete, well formed and the same as its shape's reference. Afterwards /metrics
# shows nothing in flight or queued, every request counted (a client that went away under the 200
# its stream began with), at most one cancellation per client that went away (one whose
# generation ended before the close was seen is not cancelled); http-api's open descriptors are
# back to what they were before the load; gpu-runner ran one generation per request and holds
# nothing queued and no more GPU KV blocks in use than before; kv-store has no block pinned, being
# written or read back, nor referenced, more than before; each shape alone gets its reference again.
# HTTP_LOAD_COUNT and HTTP_LOAD_SEED change the load.
source "$(dirname "$0")/lib.sh"
if ! command -v python3 >/dev/null; then
	echo "[http_load] SKIP: python3 is not installed"
	exit 77
fi
it_http_setup http_load
CLIENT=$(dirname "$0")/http_load_client.py
COUNT=${HTTP_LOAD_COUNT:-500}
CONCURRENCY=32
CUT_EVERY=10
SEED=${HTTP_LOAD_SEED:-$RANDOM}
N_SHAPES=8

out=$("$PIPELINE" start --model "$L3" --http 127.0.0.1:0 --http-opt=--max-queue=64)
BASE=$(grep -o 'http://127\.0\.0\.1:[0-9]*' <<<"$out" | head -n 1)
[[ -n $BASE ]] || fail "start --http did not say where http-api listens: $out"
HTTP_PID=$(cat "$RUN_DIR/http-api.pid" 2>/dev/null || true)
if [[ ! $HTTP_PID =~ ^[0-9]+$ ]]; then
	HTTP_PID=$(instance_pids | while read -r p; do
		[[ $(cat "/proc/$p/comm" 2>/dev/null) == http-api ]] && echo "$p"
	done | head -n 1)
fi
[[ $HTTP_PID =~ ^[0-9]+$ && -d /proc/$HTTP_PID/fd ]] || fail "no http-api process found"
log "http-api (pid $HTTP_PID) listens on $BASE; $COUNT requests, $CONCURRENCY at a time, seed $SEED"

# scrape FILE: GET /metrics into FILE; metric FILE SERIES: a sample's value (0 when there is none).
scrape() { curl -sS --max-time 20 -o "$1" -w '%{http_code}' "$BASE/metrics"; }
metric() { awk -v s="$2" '$1 == s {v = $2} END {print v + 0}' "$1"; }
# gen_requests FILE: the generation requests counted, whatever their status; gen_status FILE STATUS.
GEN='^pipeline_http_requests_total[{]endpoint="/v1/(chat/)?completions"'
gen_requests() { awk -v re="$GEN" '$0 ~ re {n += $2} END {print n + 0}' "$1"; }
gen_status() { awk -v re="$GEN" -v st="status=\"$2\"" '$0 ~ re && index($1, st) {n += $2} END {print n + 0}' "$1"; }
fds() { find "/proc/$HTTP_PID/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l; }
# kv_held: kv-store's blocks being written, read back or pinned, one "key value" a line (back to
# their count before the load when nothing leaked).
kv_held() {
	"$PIPECTL" stats kv-store | jq -r '"pinned_blocks \(.pinned_blocks // 0)", (.blocks_by_state // {} | to_entries[]
		| select(.key == "writing" or .key == "loading") | "\(.key) \(.value)")'
}
# kv_referenced: kv-store's blocks that a sequence holds a reference to.
kv_referenced() { "$PIPECTL" stats kv-store | jq -r '.referenced_blocks // 0'; }

M0=$IT_TMP/metrics0 M1=$IT_TMP/metrics1
# Every worker of http-api opens its connection to gpu-runner with its first request and keeps it:
# 32 short requests at once first, so that the descriptors counted before the load are all there.
WARM=32
for ((i = 0; i < WARM; i++)); do
	curl -sS -o /dev/null "$BASE/v1/completions" --data-binary '{"prompt": "warm", "max_tokens": 1}' &
done
wait
warm_counted() { scrape "$M0" >/dev/null && (($(gen_requests "$M0") == WARM)); }
wait_until 30 "/metrics counts the $WARM warm-up requests" warm_counted
# The blocks one sequence holds: the longest shape (chat, 21 prompt tokens and 20 generated) alone.
long='{"messages": [{"role": "user", "content": "1, 2, 3, 4,"}], "max_tokens": 20, "temperature": 0}'
expect_eq "$(curl -sS -o /dev/null -w '%{http_code}' "$BASE/v1/chat/completions" --data-binary "$long")" 200 \
	"the longest request alone"
REF1=$(kv_referenced)
# Counted a moment after its client has the answer: the first generation request after the warm-up.
first_counted() { scrape "$M0" >/dev/null && (($(gen_requests "$M0") == WARM + 1)); }
wait_until 30 "/metrics counts the longest request" first_counted
FDS0=$(fds)
RUNNER_REQ0=$(stat_value gpu-runner requests)
RUNNER_KV0=$(stat_value gpu-runner kv_gpu_blocks_used)
KV0=$(kv_held)
log "before the load: $FDS0 descriptors open in http-api; kv-store: $(tr '\n' ' ' <<<"$KV0")referenced_blocks $REF1"

rc=0
SECONDS=0
python3 "$CLIENT" "$BASE" "$IT_TMP/summary.json" --count "$COUNT" --concurrency "$CONCURRENCY" \
	--disconnect-every "$CUT_EVERY" --seed "$SEED" --refs-out "$IT_TMP/refs.json" || rc=$?
((rc == 0)) ||
	fail "the load: $(jq -c '{sent, ok, checked, failures: (.failures | length)}' "$IT_TMP/summary.json" 2>/dev/null)"
CUTS=$(jq -r .disconnects "$IT_TMP/summary.json")
expect_eq "$(jq -r '"\(.ok) \(.checked)"' "$IT_TMP/summary.json")" "$COUNT $((COUNT - CUTS))" \
	"the load: every request answered (those that went away included), every answer checked"
log "the load: $COUNT requests, $((COUNT - CUTS)) answers all equal their shape's reference," \
	"$CUTS clients went away ($SECONDS s)"

SENT=$((COUNT + 2 * N_SHAPES))
# A request is counted once libmicrohttpd is done with it, a moment after the client has gone.
all_counted() { scrape "$M1" >/dev/null && (($(gen_requests "$M1") - $(gen_requests "$M0") >= SENT)); }
wait_until 30 "/metrics counts the $SENT requests" all_counted
idle() {
	scrape "$M1" >/dev/null &&
		[[ "$(metric "$M1" pipeline_http_in_flight) $(metric "$M1" pipeline_http_queue_depth)" == "0 0" ]]
}
wait_until 30 "/metrics shows nothing in flight or queued" idle
expect_eq "$(($(gen_requests "$M1") - $(gen_requests "$M0")))" "$SENT" "/metrics: the generation requests counted"
expect_eq "$(($(gen_status "$M1" 200) - $(gen_status "$M0" 200)))" "$SENT" \
	"/metrics: all of them 200 (a client that went away counts under its stream's 200)"
rejected=$(($(metric "$M1" pipeline_http_queue_rejected_total) - $(metric "$M0" pipeline_http_queue_rejected_total)))
expect_eq "$rejected" 0 \
	"/metrics: no request refused with 429"
cancelled=$(($(metric "$M1" pipeline_http_cancelled_total) - $(metric "$M0" pipeline_http_cancelled_total)))
((cancelled >= 0 && cancelled <= CUTS)) || fail "/metrics: $cancelled cancellations for $CUTS clients that went away"
log "/metrics: $SENT requests counted, 200 each; in flight 0, queued 0; $cancelled of $CUTS cut streams cancelled"

# No leak: http-api's descriptors (its connections close a moment after the clients'), gpu-runner's queue.
fds_back() { (($(fds) <= FDS0 + 2)); }
wait_until 30 "http-api's open descriptors back to $FDS0 (+2) from $(fds)" fds_back
runner_idle() { [[ $(stat_value gpu-runner queued) == 0 ]]; }
wait_until 30 "gpu-runner's queue empty" runner_idle
expect_eq "$(($(stat_value gpu-runner requests) - RUNNER_REQ0))" "$SENT" "gpu-runner: one generation per request"
runner_kv_back() { [[ $(stat_value gpu-runner kv_gpu_blocks_used) == "$RUNNER_KV0" ]]; }
wait_until 30 "gpu-runner's KV blocks in use back to ${RUNNER_KV0:-none}" runner_kv_back
runner_kv=$("$PIPECTL" stats gpu-runner | jq -c '{kv_gpu_blocks_used, kv_gpu_blocks}')
jq -e '.kv_gpu_blocks_used == null or .kv_gpu_blocks == null or .kv_gpu_blocks_used <= .kv_gpu_blocks' \
	<<<"$runner_kv" >/dev/null || fail "gpu-runner: more KV blocks in use than it has: $runner_kv"
kv_back() { [[ $(kv_held) == "$KV0" ]]; }
wait_until 30 "kv-store holds what it held before the load ($(tr '\n' ' ' <<<"$KV0"))" kv_back
ref=$(kv_referenced)
((ref <= REF1)) || fail "kv-store: $ref blocks referenced after the load, one sequence held $REF1"
log "no leak: $(fds) descriptors open in http-api; gpu-runner $runner_kv;" \
	"kv-store: $(tr '\n' ' ' <<<"$(kv_held)")referenced_blocks $ref"

# The server still answers: each shape alone once more gives the reference it gave before the load,
# and 8 requests drawn from them, one at a time, likewise.
python3 "$CLIENT" "$BASE" "$IT_TMP/after.json" --count "$N_SHAPES" --concurrency 1 --disconnect-every 0 \
	--seed "$SEED" --refs-in "$IT_TMP/refs.json" ||
	fail "the requests after the load: $(jq -c .failures "$IT_TMP/after.json" 2>/dev/null)"
log "after the load: the shapes answered alone again, each its reference"

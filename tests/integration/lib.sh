# shellcheck shell=bash
# lib.sh - what the integration tests share. Each test script sources it, then calls
# it_setup NAME: a fresh temp directory, an instance name and run directory of its own, a
# tiny synthetic checkpoint, and a trap that stops the instance, checks that nothing was
# left behind and removes the directory.
#
# ctest sets PIPELINE_BIN_DIR (the built binaries) and PIPELINE_SOURCE_DIR (the tree, for
# scripts/pipeline). The tests never build: PIPELINE_SKIP_SETUP=1.
set -euo pipefail

: "${PIPELINE_BIN_DIR:?set PIPELINE_BIN_DIR to the bin directory of the build}"
: "${PIPELINE_SOURCE_DIR:?set PIPELINE_SOURCE_DIR to the source tree}"

# The binaries read PIPELINE_<FLAG> from the environment: a test sees none but its own.
for _v in $(compgen -e); do
	case $_v in
	PIPELINE_BIN_DIR | PIPELINE_SOURCE_DIR) ;;
	PIPELINE_*) unset "$_v" ;;
	esac
done
unset _v
export PIPELINE_BIN_DIR PIPELINE_SOURCE_DIR
export PIPELINE_SKIP_SETUP=1
ulimit -c 0

BIN=$PIPELINE_BIN_DIR
PIPELINE=$PIPELINE_SOURCE_DIR/scripts/pipeline
PIPECTL=$BIN/pipectl
IT_NAME=integration

# A fixed 64-token prompt inside the tiny model's vocabulary (512).
# shellcheck disable=SC2034 # used by the tests that source this file
PROMPT=$(for ((i = 0; i < 64; i++)); do echo $(((i * 37 + 11) % 500 + 1)); done | paste -sd,)

log() {
	echo "[$IT_NAME] $*"
}

fail() {
	echo "[$IT_NAME] FAIL: $*" >&2
	exit 1
}

# expect_eq GOT WANT WHAT
expect_eq() {
	if [[ $1 != "$2" ]]; then
		printf '[%s] FAIL: %s\n  got:  %s\n  want: %s\n' "$IT_NAME" "$3" "$1" "$2" >&2
		exit 1
	fi
}

# expect_grep PATTERN TEXT WHAT: TEXT matches the extended regular expression PATTERN.
expect_grep() {
	if ! grep -qE -- "$1" <<<"$2"; then
		printf '[%s] FAIL: %s: no match for /%s/ in:\n%s\n' "$IT_NAME" "$3" "$1" "$2" >&2
		exit 1
	fi
}

# expect_words N TEXT WHAT: TEXT holds N whitespace-separated non-negative integers.
expect_words() {
	local n
	n=$(wc -w <<<"$2")
	((n == $1)) || fail "$3: $n tokens, expected $1: '$2'"
	[[ $2 =~ ^[0-9]+( [0-9]+)*$ ]] || fail "$3: not a line of token ids: '$2'"
}

# expect_gt VALUE MIN WHAT: VALUE is an integer above MIN.
expect_gt() {
	[[ $1 =~ ^[0-9]+$ ]] || fail "$3: '$1' is not a count"
	(($1 > $2)) || fail "$3: $1, want more than $2"
}

# Pids of the processes whose arguments hold the run directory exactly (our services). Read with
# builtins only: a fork for each process of the machine made this take seconds where forks are slow.
instance_pids() {
	local f pid arg
	local -a argv
	for f in /proc/[0-9]*/cmdline; do
		pid=${f#/proc/}
		pid=${pid%/cmdline}
		[[ $pid == "$$" ]] && continue
		# The process may be gone by now: its cmdline then reads as nothing, or not at all.
		mapfile -d '' -t argv 2>/dev/null <"$f" || continue
		for arg in ${argv[@]+"${argv[@]}"}; do
			if [[ $arg == "$RUN_DIR" ]]; then
				printf '%s\n' "$pid"
				break
			fi
		done
	done
}

# proc_state PID: the state letter of PID in /proc/PID/stat (R, S, D, T, Z, ...), nothing when
# there is no such process. The command name may hold ") ": the state follows the last one.
proc_state() {
	local stat
	{ read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 0
	[[ $stat == *") "* ]] || return 0
	stat=${stat##*) }
	printf '%s\n' "${stat:0:1}"
}

# proc_gone PID: PID has exited (no such process, or a zombie waiting for its reaper).
proc_gone() {
	local state
	state=$(proc_state "$1")
	[[ -z $state || $state == Z || $state == X ]]
}

# The instance's shared-memory objects (/dev/shm/llmp-<uid>-<instance>-<object>).
instance_shm() {
	local f prefix
	prefix=/dev/shm/llmp-$(id -u)-$INSTANCE-
	for f in "$prefix"*; do
		[[ -e $f && ${f#"$prefix"} != *-* ]] && printf '%s\n' "$f"
	done
	return 0
}

# Fails unless no process (the supervisor included), shared-memory object, socket, pid file or
# restart marker of the instance is left.
# Zombies awaiting their reaper count as gone; a process gets a few seconds to exit.
expect_nothing_left() {
	local what=$1 pids i
	for ((i = 0; i < 50; i++)); do
		pids=$(instance_pids | while read -r p; do
			proc_gone "$p" || printf '%s ' "$p"
		done)
		[[ -z $pids ]] && break
		sleep 0.1
	done
	[[ -z $pids ]] || fail "$what: processes of the instance still run: $pids"
	local shm
	shm=$(instance_shm)
	[[ -z $shm ]] || fail "$what: shared-memory objects left: $shm"
	local left
	left=$(find "$RUN_DIR" -maxdepth 1 \( -name '*.ctl' -o -name '*.pub' -o -name '*.pid' -o -name '*.pid.tmp' -o -name '*.pid.tmp.*' \
		-o -name '*.restart' -o -name start.args -o -name start.timeouts -o -name kv-spill.path -o -name 'kv-spill.path.tmp.*' \) \
		2>/dev/null || true)
	[[ -z $left ]] || fail "$what: files left in the run directory: $left"
}

it_cleanup() {
	local status=$?
	set +e
	"$PIPELINE" stop >/dev/null 2>&1
	# Anything still running was started by this test: end it, and fail.
	local p leftover
	leftover=$(instance_pids | tr '\n' ' ')
	for p in $leftover; do
		kill -KILL "$p" 2>/dev/null
	done
	if [[ -n $leftover ]]; then
		echo "[$IT_NAME] FAIL: processes left after stop: $leftover" >&2
		status=1
	fi
	# A service that crashed (a stop included) fails the test, whatever else it checked.
	local crashed
	crashed=$(grep -E 'by signal [0-9]+ \((SIGSEGV|SIGABRT|SIGBUS|SIGILL|SIGFPE)\)' "$RUN_DIR/supervisor.log" 2>/dev/null)
	if [[ -n $crashed ]]; then
		echo "[$IT_NAME] FAIL: a service crashed: $crashed" >&2
		status=1
	fi
	local f
	for f in $(instance_shm); do
		echo "[$IT_NAME] FAIL: shared-memory object left after stop: $f" >&2
		rm -f "$f"
		status=1
	done
	if ((status != 0)); then
		for f in "$RUN_DIR"/*.log; do
			[[ -f $f ]] || continue
			echo "---- $f (last 30 lines)" >&2
			tail -n 30 "$f" >&2
		done
	fi
	rm -rf "$IT_TMP"
	exit "$status"
}

# it_setup NAME: the temp directory IT_TMP, INSTANCE and RUN_DIR (exported for
# scripts/pipeline and pipectl), MODEL (a tiny checkpoint) and the cleanup trap.
it_setup() {
	IT_NAME=$1
	local b
	for b in ssd-loader kv-store gpu-runner pipeline-supervisor pipectl make-synthetic-model run-local; do
		[[ -x $BIN/$b ]] || fail "$BIN/$b is not built"
	done
	IT_TMP=$(mktemp -d "/tmp/llmp-it-$IT_NAME.XXXXXX")
	export PIPELINE_INSTANCE=it-$IT_NAME-$$
	export PIPELINE_RUN_DIR=$IT_TMP/run
	INSTANCE=$PIPELINE_INSTANCE
	RUN_DIR=$PIPELINE_RUN_DIR
	trap it_cleanup EXIT
	trap 'exit 130' INT TERM
	MODEL=$IT_TMP/model
	"$BIN/make-synthetic-model" --shape tiny --out "$MODEL" --quiet
}

# run_local ARGS...: the oracle's tokens for the tiny model (run-local --model MODEL ...).
run_local() {
	"$BIN/run-local" --model "$MODEL" "$@"
}

# generate ARGS...: the instance's tokens (scripts/pipeline generate ...).
# expect_start_fails WHAT PATTERN ARGS...: scripts/pipeline start ARGS fails with PATTERN.
expect_start_fails() {
	local what=$1 pattern=$2 out rc=0
	shift 2
	out=$("$PIPELINE" start "$@" 2>&1) || rc=$?
	((rc != 0)) || fail "$what: start succeeded"
	((rc < 128)) || fail "$what: start died of signal $((rc - 128))"
	expect_grep "$pattern" "$out" "$what: the message"
	local crash='Segmentation|core dumped|Aborted|AddressSanitizer|runtime error'
	if grep -sqE "$crash" - "$RUN_DIR"/*.log <<<"$out"; then
		fail "$what: a crash was reported: $(grep -shE "$crash" - "$RUN_DIR"/*.log <<<"$out")"
	fi
	expect_nothing_left "$what"
	log "$what: refused: $(grep -E "$pattern" <<<"$out" | head -n 1)"
}

generate() {
	"$PIPELINE" generate "$@"
}

# stat_value SERVICE KEY: a number from the service's stats, or nothing.
stat_value() {
	"$PIPECTL" stats "$1" | sed -n "s/^ *\"$2\": *\([0-9.eE+-]*\).*/\1/p" | head -n 1
}

# model_bytes DIR: bytes of the checkpoint's safetensors files.
# gpu_budget_min MODEL BACKEND [START_ARGS...]: the smallest --gpu-budget (bytes) the runner takes
# for MODEL (the head group and two slots of each streamed layer group), read from its refusal of
# 1 KiB; empty when the message does not say.
gpu_budget_min() {
	local model=$1 backend=$2 out
	shift 2
	out=$("$PIPELINE" start --model "$model" --backend "$backend" --gpu-budget 1KiB "$@" 2>&1) && {
		"$PIPELINE" stop >/dev/null 2>&1
		fail "start with a 1 KiB GPU budget succeeded"
	}
	sed -n 's/.*--gpu-budget .* is too small: .* need [^(]*(\([0-9]*\) bytes).*/\1/p' <<<"$out" | head -n 1
}

model_bytes() {
	local f total=0
	for f in "$1"/*.safetensors; do
		total=$((total + $(stat -c %s "$f")))
	done
	printf '%s\n' "$total"
}

# sup_status: the supervisor's status (JSON text), or nothing when it does not answer.
sup_status() {
	"$BIN/pipeline-supervisor" status --json 2>/dev/null || true
}

# sup_field_in STATUS SERVICE KEY: KEY of SERVICE in STATUS (sup_status's text; a string keeps its
# quotes, null is null), or nothing.
sup_field_in() {
	awk -v svc="    \"$2\": {" -v key="      \"$3\": " '
		$0 == svc { inside = 1; next }
		inside && /^    }/ { exit }
		inside && index($0, key) == 1 { v = substr($0, length(key) + 1); sub(/,$/, "", v); print v; exit }' <<<"$1"
}

# sup_field SERVICE KEY: KEY of SERVICE in the supervisor's status now.
sup_field() {
	sup_field_in "$(sup_status)" "$1" "$2"
}

# wait_until SECONDS WHAT COMMAND...: runs COMMAND every 0.1 s until it succeeds; fails naming
# WHAT when SECONDS pass first (a bound on a hang of the test, not a measurement).
wait_until() {
	local seconds=$1 what=$2 i
	shift 2
	for ((i = 0; i < seconds * 10; i++)); do
		"$@" && return 0
		sleep 0.1
	done
	fail "$what: not within $seconds s"
}

# restarted SERVICE OLD_PID: SERVICE is up again in a process other than OLD_PID (one status for
# both fields).
restarted() {
	local st pid
	st=$(sup_status)
	pid=$(sup_field_in "$st" "$1" pid)
	[[ $(sup_field_in "$st" "$1" state) == '"up"' && -n $pid && $pid != null && $pid != "$2" ]]
}

# sup_argv SERVICE: the command line the supervisor runs SERVICE with, one word a line.
sup_argv() {
	{ "$BIN/pipeline-supervisor" status --json 2>/dev/null || true; } |
		awk -v svc="    \"$1\": {" '
			$0 == svc { inside = 1; next }
			inside && /^    }/ { exit }
			inside && /^      "argv": \[/ { words = 1; next }
			words && /^      \]/ { exit }
			words { sub(/^ */, ""); sub(/,$/, ""); print }'
}

# it_http_setup NAME: it_setup for a test of the HTTP API (skipped, 77, where http-api was not built
# or curl or jq is missing), and the tiny model with Llama 3's vocabulary and tokenizer in $L3.
it_http_setup() {
	local name=$1 tool
	if [[ ! -x $BIN/http-api ]]; then
		echo "[$name] SKIP: http-api was not built (libmicrohttpd missing)"
		exit 77
	fi
	for tool in curl jq; do
		if ! command -v "$tool" >/dev/null; then
			echo "[$name] SKIP: $tool is not installed"
			exit 77
		fi
	done
	it_setup "$name"
	TOKENIZER=$PIPELINE_SOURCE_DIR/tests/data/llama3-tokenizer/tokenizer.json
	L3=$IT_TMP/llama3-shaped
	"$BIN/make-synthetic-model" --shape tiny --vocab 128256 --bos 128000 --eos 128001,128008,128009 --out "$L3" \
		--quiet
	cp "$TOKENIZER" "$L3/"
}

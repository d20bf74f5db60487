#!/usr/bin/env bash
# pipectl_cli: pipectl's argument checks and messages, with no service running.
source "$(dirname "$0")/lib.sh"
IT_NAME=pipectl_cli
IT_TMP=$(mktemp -d /tmp/llmp-it-cli.XXXXXX)
trap 'rm -rf "$IT_TMP"' EXIT
export PIPELINE_RUN_DIR=$IT_TMP/run

# expect_status STATUS PATTERN ARGS...: pipectl ARGS exits STATUS, printing PATTERN.
expect_status() {
	local want=$1 pattern=$2 out rc=0
	shift 2
	out=$("$PIPECTL" "$@" 2>&1) || rc=$?
	((rc == want)) || fail "pipectl $*: exit status $rc, want $want: $out"
	expect_grep "$pattern" "$out" "pipectl $*"
}

expect_status 0 "^usage: pipectl" --help
# pipeline-supervisor's --timeout as large as its wait in milliseconds can be, and no larger (past it
# the wait wrapped to a negative one, which waited for ever).
rc=0
out=$("$BIN/pipeline-supervisor" status --timeout 2147484 --run-dir "$IT_TMP/none" 2>&1) || rc=$?
((rc == 2)) || fail "pipeline-supervisor status --timeout 2147484: exit status $rc, want 2: $out"
expect_grep "at most 2147483 seconds" "$out" "pipeline-supervisor status --timeout 2147484"
expect_status 0 "generate --prompt TEXT | --chat TEXT" --help
expect_status 2 "^usage: pipectl"
expect_status 0 "--tokens" generate --help
expect_status 2 "unknown command 'frob'" frob
expect_status 2 "unknown global flag '--bogus'" --bogus hello kv-store
expect_status 2 "unknown service 'nope'" hello nope
expect_status 2 "missing argument" stats
expect_status 2 "unexpected argument 'extra'" ping kv-store extra
expect_status 2 "give the prompt one way" generate -n 4
expect_status 2 "'x' is not a non-negative integer" generate --tokens 1,x,3
expect_status 2 "'-1' is not a non-negative integer" generate --tokens 1,-1
expect_status 2 "an empty element" generate --tokens 1,,3
expect_status 2 "an empty element" generate --tokens 1,2,
expect_status 2 "larger than" generate --tokens 99999999999
expect_status 2 "-n must be at least 1" generate --tokens 1 -n 0
expect_status 2 "not an integer" generate --tokens 1 -n many
expect_status 2 "--top-p must be in" generate --tokens 1 --top-p 1.5
expect_status 2 "--temperature must be" generate --tokens 1 --temperature -1
expect_status 2 "--stop-ids: 'a' is not" generate --tokens 1 --stop-ids a
# The same ranges with a prompt as text or a chat (they went to the runner unchecked).
expect_status 2 "-n must be at least 1" generate --prompt hello -n 0
expect_status 2 "-n must be at least 1" generate --chat hello -n -1
expect_status 2 "--top-p must be in" generate --prompt hello --top-p 7
expect_status 2 "--seed must not be negative" generate --chat hello --seed -5
expect_status 2 "--temperature must be" generate --prompt hello --temperature -1
# Text that is not UTF-8: refused (a --system or --stop was dropped in silence).
expect_status 2 "--chat and --system must be UTF-8" generate --chat hi --system $'\xff'
expect_status 2 "--stop strings must be UTF-8" generate --prompt hi --stop $'\xff'
expect_status 2 "not valid UTF-8" get kv-store io-depth $'\xff'
# scripts/pipeline leaves a flag's value to pipectl: "-h" and "--instance" as a prompt's text are
# that text (it printed its help, or took "-n" for an instance name).
for words in "--prompt -h -n 1" "--prompt --instance -n 3"; do
	rc=0
	# shellcheck disable=SC2086
	out=$("$PIPELINE" generate $words 2>&1) || rc=$?
	expect_eq "$rc" 1 "pipeline generate $words: its exit status ($out)"
	expect_grep "gpu-runner of instance default is not running" "$out" "pipeline generate $words"
done
# A timeout of 0 (every call failed at once) or a directory for --tokens @FILE.
expect_status 2 "--timeout must be at least 1 second" --timeout 0 ping kv-store
expect_status 2 "--tokens @/: Is a directory" generate --tokens @/
# @FILE: ids as `pipectl tokenize` writes them (white space, lines) reach the runner; a NUL byte
# (the rest of the file was dropped) and an empty element are refused.
printf '1 2 3\n4\t5\n' >"$IT_TMP/ids-spaced"
printf '1,2\0,zzz' >"$IT_TMP/ids-nul"
printf '1,\n,2' >"$IT_TMP/ids-empty"
expect_status 1 "gpu-runner of instance default is not running" generate --tokens "@$IT_TMP/ids-spaced"
expect_status 2 "holds a NUL byte" generate --tokens "@$IT_TMP/ids-nul"
expect_status 2 "an empty element" generate --tokens "@$IT_TMP/ids-empty"
# A timeout whose milliseconds pass an int (it wrapped into a wait without end).
expect_status 2 "--timeout 99999999: at most 2147483 seconds" --timeout 99999999 ping kv-store
expect_status 1 "gpu-runner of instance default is not running: no control socket" generate --tokens 1,2
expect_status 1 "kv-store of instance default is not running" stats kv-store
expect_status 1 "ssd-loader did not become ready in 1 s" wait-ready ssd-loader --timeout 1
# wait-ready's own --timeout and --pid: past an int they waited without end, or watched init.
expect_status 2 "--timeout at most 2147483 seconds" wait-ready ssd-loader --timeout 3000000 --pid 999999
expect_status 2 "--pid at most 2147483647" wait-ready ssd-loader --timeout 1 --pid 4294967297
log "ok"

#!/usr/bin/env bash
# run-fuzzer.sh FUZZER CORPUS_DIR WORK_DIR SECONDS [DICT] - one short libFuzzer run: the ctest
# tests labelled fuzz (tests/fuzz/CMakeLists.txt). The fuzzer starts from CORPUS_DIR (read only:
# what it finds goes to a fresh WORK_DIR/NAME/new), runs for SECONDS (PIPELINE_FUZZ_SECONDS in
# the environment wins, up to the 900 s ctest allows), and this prints libFuzzer's
# "Done N runs in S second(s)" line, also kept in WORK_DIR/NAME.result for scripts/test. Exits
# non-zero on a crash, a leak, a timeout or an out-of-memory, with the end of libFuzzer's output
# and the path of the input that did it (WORK_DIR/NAME/crash-..., see docs/fuzzing.md).
set -euo pipefail

if (($# < 4)); then
	echo "usage: run-fuzzer.sh FUZZER CORPUS_DIR WORK_DIR SECONDS [DICT]" >&2
	exit 2
fi
fuzzer=$1 corpus=$2 work=$3 seconds=${PIPELINE_FUZZ_SECONDS:-$4} dict=${5:-}
name=$(basename "$fuzzer")
dir=$work/$name
rm -rf "$dir" "$work/$name.result"
mkdir -p "$dir/new"

args=(-max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 -print_final_stats=1
	-artifact_prefix="$dir/")
[[ -n $dict && -f $dict ]] && args+=(-dict="$dict")
# Symbolized reports where llvm-symbolizer is around (package llvm-14); raw addresses otherwise.
for s in llvm-symbolizer llvm-symbolizer-14 /usr/lib/llvm-14/bin/llvm-symbolizer; do
	if command -v "$s" >/dev/null 2>&1; then
		export ASAN_SYMBOLIZER_PATH=${ASAN_SYMBOLIZER_PATH:-$(command -v "$s")}
		break
	fi
done
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
# fuzz_manifest writes a small directory per input: on tmpfs that costs half as much.
if [[ -z ${TMPDIR:-} && -d /dev/shm && -w /dev/shm ]]; then
	export TMPDIR=/dev/shm
fi

status=0
"$fuzzer" "${args[@]}" "$dir/new" "$corpus" >"$dir/log" 2>&1 || status=$?
done_line=$(grep -E '^Done [0-9]+ runs in [0-9]+ second' "$dir/log" | tail -n 1 || true)
if ((status != 0)) || [[ -z $done_line ]]; then
	tail -n 60 "$dir/log"
	echo "$name: FAILED (exit status $status); the whole log is $dir/log" >&2
	for a in "$dir"/crash-* "$dir"/leak-* "$dir"/timeout-* "$dir"/oom-* "$dir"/slow-unit-*; do
		[[ -e $a ]] && echo "$name: the input that did it: $a (reproduce: $fuzzer $a)" >&2
	done
	exit 1
fi
grep -E '^(INFO: seed corpus|stat::|#[0-9]+ *DONE)' "$dir/log" || true
echo "$name: $done_line"
echo "$name: $done_line" >"$work/$name.result"

#!/usr/bin/env bash
# bench-cpu-gemv's modes on small shapes (the numbers are this machine's; what is checked is that
# each mode runs its products and says what it measured), and its refusals of bad arguments.
set -euo pipefail
B=${PIPELINE_BIN_DIR:?}/bench-cpu-gemv
fail() { echo "FAIL: $*" >&2; exit 1; }

out=$("$B" --rows 256 --cols 512 --threads 2 --repeats 2)
grep -q "^BF16 .*: 256 x 512 .* 2 threads: best .* GB/s" <<<"$out" || fail "plain: $out"
out=$("$B" --ffn-tokens 2 --rows 256 --cols 512 --threads 2 --repeats 2)
grep -q "^FFN share BF16 .* 2 tokens at once" <<<"$out" || fail "ffn-tokens: $out"
# --prefetch: the one-token job again after its first MB were read into the caches.
out=$("$B" --ffn-tokens 1 --rows 1024 --cols 512 --threads 2 --repeats 2 --prefetch 1)
grep -q "^FFN share, one token, its first 1.0 MiB in the caches first: [0-9.]* ms" <<<"$out" || fail "prefetch: $out"
for f in BF16 Q4_K; do
	out=$("$B" --experts 3 --expert-pool 4 --format $f --rows 256 --cols 512 --threads 2 --repeats 3 --gap-us 10)
	grep -q "^experts $f .*: 3 of .* MB a layer (4 to choose from), jobs cut for 1 threads .* 2 workers, a gap of 10 us: a layer's span median .* GB/s" <<<"$out" ||
		fail "experts $f: $out"
done
# A pool past the 32 experts it makes: the rest copies of them (memory of their own).
out=$("$B" --experts 4 --expert-pool 70 --format Q4_K --rows 256 --cols 512 --threads 2 --repeats 5 --gap-us 10)
grep -q "^experts: making 70 experts" <<<"$out" && grep -q "a layer (70 to choose from)" <<<"$out" ||
	fail "pool of 70: $out"
out=$("$B" --experts 2 --expert-pool 2 --rows 256 --cols 512 --threads 2 --repeats 2 --job-threads 3)
grep -q "jobs cut for 3 threads (24 parts, chunks of about [0-9]* KB, tapered)" <<<"$out" || fail "job-threads: $out"
# The last two layers' parts: each job's eight (cut for one thread: 4 a phase), a start and an end each.
out=$("$B" --experts 2 --expert-pool 2 --rows 256 --cols 512 --threads 2 --repeats 3 --trace 2)
[ "$(grep -c "^trace of layer [23] " <<<"$out")" = 2 ] || fail "trace: two layers: $out"
[ "$(grep -cE "^  job [01] \(ended [0-9.]+\):( [0-9.]+-[0-9.]+){8}$" <<<"$out")" = 4 ] || fail "trace: parts: $out"
# The CPU's share of a split expert: rows 256.. of 512 of gate and up, those columns of down.
out=$("$B" --experts 2 --expert-pool 2 --format Q4_K --rows 512 --cols 512 --threads 2 --repeats 2 --expert-share 256)
grep -q "^experts Q4_K .*: 2 of 0.4 MB a layer (the CPU's share of each: rows 256.. of 512, 0.2 MB)" <<<"$out" ||
	fail "expert-share: $out"
out=$("$B" --experts 2 --expert-pool 2 --rows 256 --cols 512 --threads 2 --repeats 2 --no-taper)
grep -q "chunks of about [0-9]* KB), 2 workers" <<<"$out" || fail "no-taper: $out"

refuse() { # expected message, then the arguments
	local want=$1 rc=0
	shift
	err=$("$B" "$@" 2>&1 >/dev/null) || rc=$?
	[ "$rc" = 2 ] || fail "$*: exit $rc, not 2"
	grep -q -- "$want" <<<"$err" || fail "$*: $err"
}
refuse "--experts 9: at most 8" --experts 9
refuse "--expert-pool 2: fewer than --experts 3" --experts 3 --expert-pool 2
refuse "--job-threads 0: expected a number >= 1" --experts 2 --job-threads 0
refuse "--rows 100 (down's columns) is not a multiple of Q4_K's block of 256" --experts 2 --format Q4_K --rows 100 --cols 512
refuse "--expert-share 100: expected a multiple of Q4_K's block of 256 below --rows 512" --experts 2 --format Q4_K --rows 512 --cols 512 --expert-share 100
refuse "--expert-share 512: expected a multiple" --experts 2 --format Q4_K --rows 512 --cols 512 --expert-share 512
echo "bench-cpu-gemv: every mode ran, every refusal said why"

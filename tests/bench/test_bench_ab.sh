#!/usr/bin/env bash
# scripts/bench-ab without a GPU: a revision packed, listed, built beside this tree (a small
# target) and run in turn with {bin} and {label} replaced; and its refusals. Skips (77) where the
# source is not a git checkout.
set -uo pipefail
SRC=${PIPELINE_SOURCE_DIR:?}
BIN=${PIPELINE_BIN_DIR:?}
AB=$SRC/scripts/bench-ab
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export BENCH_AB_PACKS=$tmp/packs BENCH_AB_ROOT=$tmp/ab OUT=$tmp/out
export PIPELINE_BUILD_DIR=$(dirname "$BIN")
fails=0
fail() {
	echo "test_bench_ab: $*" >&2
	fails=$((fails + 1))
}

git -C "$SRC" rev-parse --git-dir >/dev/null 2>&1 || { echo "test_bench_ab: $SRC is not a git checkout: skipped"; exit 77; }

# Refusals: exit 2 and a line saying why.
refused() {
	local want=$1
	shift
	local err
	err=$("$AB" "$@" 2>&1 >/dev/null)
	local rc=$?
	[[ $rc == 2 ]] || fail "bench-ab $*: exit $rc, want 2"
	[[ $err == *"$want"* ]] || fail "bench-ab $*: said '$err', want it to say '$want'"
}
refused "unknown verb" bogus
refused "not a revision" pack no-such-revision-here
refused "nothing packed" run -- true
refused "positive whole number" run --rounds 0 -- true
refused "no command" run --rounds 1
refused "unknown option" run --fast -- true

"$AB" pack HEAD 2>/dev/null || fail "pack HEAD failed"
sha=$(git -C "$SRC" rev-parse --short=10 HEAD)
[[ -s $BENCH_AB_PACKS/$sha.tar.gz ]] || fail "pack HEAD wrote no $BENCH_AB_PACKS/$sha.tar.gz"
[[ $("$AB" list) == "$sha"$'\t'HEAD ]] || fail "list says '$("$AB" list)', want '$sha	HEAD'"

# The packed tree's small target built, then both trees run in turn, twice.
"$AB" run --rounds 2 --target pipeline-inspect --jobs 2 -- sh -c 'echo {label}; {bin}/pipeline-inspect --help' \
	2>"$tmp/run.err" || { cat "$tmp/run.err" >&2; fail "run failed"; }
for label in tree "$sha"; do
	for r in 1 2; do
		f=$OUT/ab-$label-$r.txt
		[[ -f $f ]] || { fail "no output $f"; continue; }
		[[ $(head -n 1 "$f") == "$label" ]] || fail "$f starts '$(head -n 1 "$f")', want '$label'"
		grep -q "usage: pipeline-inspect" "$f" || fail "$f holds no pipeline-inspect usage"
	done
done
[[ -x $BENCH_AB_ROOT/$sha/build/bin/pipeline-inspect ]] || fail "the packed tree's pipeline-inspect was not built"
grep -q "round 2 of 2: $sha" "$tmp/run.err" || fail "run did not say which tree ran"
# A command that fails makes run fail, after every run.
"$AB" run --rounds 1 --target pipeline-inspect -- sh -c 'test {label} = tree' 2>/dev/null &&
	fail "run passed although the packed tree's command failed"
[[ -f $OUT/ab-$sha-1.txt ]] || fail "run stopped before the failing tree's run"

"$AB" clean 2>/dev/null
[[ ! -e $BENCH_AB_PACKS ]] || fail "clean left $BENCH_AB_PACKS"
((fails == 0)) && echo "test_bench_ab: all checks passed"
((fails == 0))

#!/bin/bash
# run.sh - parity of the C reference backend with Hugging Face transformers (float32, CPU).
#
# Needs python3 with torch and transformers (the GPU machine's image has both; the CI machine
# does not, so this is not a ctest test). From the repository root:
#     bash tests/unit/gpu-runner/hf_parity/run.sh
# Exits 0 when every case agrees (logits relative L2 < 1e-5 as one chunk and token by token,
# RoPE inv_freq bit-identical), 1 when one does not, 77 when torch or transformers is missing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../../.." && pwd)
if ! python3 -c 'import torch, transformers' 2>/dev/null; then
	echo "hf_parity: python3 has no torch or transformers: skipped"
	exit 77
fi
work=$(mktemp -d /tmp/hf_parity.XXXXXX)
trap 'rm -rf "$work"' EXIT
rt=$root/services/gpu-runner
gcc -O2 -std=c11 -D_GNU_SOURCE -Wall -Wextra -I"$root" "$here/hf_check.c" "$root/common/dtype.c" \
	"$root/common/model.c" "$root/common/util.c" "$rt/backend.c" "$rt/cpu/backend_ref.c" "$rt/cpu/kernels.c" "$rt/cpu/pool.c" \
	"$rt/rope.c" "$rt/sampler.c" -o "$work/hf_check" -lm -lpthread
if ! python3 "$here/hf_ref.py" "$work/cases" > "$work/hf_ref.log" 2>&1; then
	cat "$work/hf_ref.log"
	echo "hf_parity: hf_ref.py failed"
	exit 1
fi
grep -v -i warn "$work/hf_ref.log" || true
rc=0
for case in "$work"/cases/*/; do
	"$work/hf_check" "${case%/}" || rc=1
done
echo "hf_parity: $([ $rc = 0 ] && echo all cases agree || echo SOME CASES DIFFER)"
exit $rc

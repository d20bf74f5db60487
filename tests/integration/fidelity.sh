#!/usr/bin/env bash
# fidelity: the C reference backend, through the whole pipeline (ssd-loader, kv-store,
# gpu-runner, pipectl), computes what Hugging Face transformers computes. For every fixture in
# tests/fixtures (made by scripts/fixtures from transformers, float32, eager attention):
#   - rebuild its checkpoint with the recorded make-synthetic-model arguments and check that
#     every file has the recorded sha256 (a mismatch means the generator changed);
#   - start an instance on it, generate 32 greedy tokens with EOS ignored and the prompt's
#     last-position logits dumped;
#   - the logits: relative L2 error at most 1e-4; the tokens: identical for 32 steps, except
#     after a step that is a near tie in the fixture (top-1/top-2 margin below 1e-4);
#   - run-local (the same backend without services; on CUDA with every weight on the GPU) must
#     give the same tokens too;
#   - stop the instance (in the background, while the next case runs): nothing left behind.
# Every case runs and prints its measurements; the test fails at the end if one did not agree.
source "$(dirname "$0")/lib.sh"
it_setup fidelity

COMPARE=${COMPARE_FIXTURE:?set COMPARE_FIXTURE to the compare_fixture binary of the build}
# FIDELITY_BACKEND=cuda runs the fixtures on the CUDA backend (bf16 weights and KV) with the
# issue's bf16 bounds: relative L2 2e-2, tokens compared up to the first step whose margin in the
# fixture is within twice the measured logits error. The default is the C reference, at 1e-4.
BACKEND=${FIDELITY_BACKEND:-cpu}
# FIDELITY_START_OPTS: more flags for scripts/pipeline start, e.g. on CUDA a GPU budget that streams
# the layers and a forced split with the CPU: "--gpu-budget 1MiB --cpu-share 0.5"; "--gpu-budget
# min" takes each model's smallest (gpu_budget_min).
read -r -a START_OPTS <<<"${FIDELITY_START_OPTS:-}"
if [[ $BACKEND != cpu ]]; then
	export FIDELITY_REL_L2_MAX=2e-2
fi
# FIDELITY_EXPECT_SPLIT=1: some routed expert was split between the copies and the CPU over the
# cases (--split-experts always; the runner's gpu_window stats count them).
# FIDELITY_REQUIRE_GPU=1: skipped (77) where no GPU answers (the ctest registration for GPU hosts).
if [[ ${FIDELITY_REQUIRE_GPU:-0} == 1 ]] && ! nvidia-smi -L >/dev/null 2>&1; then
	echo "[$IT_NAME] no GPU here: skipped"
	exit 77
fi
[[ -x $COMPARE ]] || fail "$COMPARE is not built"
FIXTURES=$PIPELINE_SOURCE_DIR/tests/fixtures
shopt -s nullglob
# FIDELITY_CASES: only these cases (names, space separated); a run whose cases have no fixture yet
# is skipped (exit 77), one that has some of them compares those and names the others.
# FIDELITY_EXCLUDE: every fixture but these (the cases another run of this script covers).
read -r -a only <<<"${FIDELITY_CASES:-}"
read -r -a exclude <<<"${FIDELITY_EXCLUDE:-}"
fixtures=()
if ((${#only[@]} > 0)); then
	missing=()
	for name in "${only[@]}"; do
		if [[ -f $FIXTURES/$name.json ]]; then
			fixtures+=("$FIXTURES/$name.json")
		else
			missing+=("$name")
		fi
	done
	if ((${#fixtures[@]} == 0)); then
		echo "[$IT_NAME] SKIP: no fixture yet for ${missing[*]} in $FIXTURES: make them with transformers" \
			"(scripts/fixtures/remake.sh, tests/fixtures/README.md)" >&2
		exit 77
	fi
	((${#missing[@]} == 0)) || log "note: no fixture yet for ${missing[*]}: not compared"
else
	for fx in "$FIXTURES"/*.json; do
		skip=0
		for name in "${exclude[@]}"; do [[ $(basename "$fx" .json) == "$name" ]] && skip=1; done
		((skip)) || fixtures+=("$fx")
	done
fi
((${#fixtures[@]} > 0)) || fail "no fixture in $FIXTURES (scripts/fixtures/remake.sh makes them)"

# Each case has an instance of its own, stopped in the background while the next case runs:
# a stop mostly waits for the exited services to be reaped, and one after another that would
# be most of this test's time.
BASE_INSTANCE=$INSTANCE
started=()   # case numbers whose instance was started
stoppers=()  # pids of the background stops

# use_instance N: INSTANCE and RUN_DIR (and PIPELINE_INSTANCE, PIPELINE_RUN_DIR) of case N.
# shellcheck disable=SC2034 # lib.sh's checks read INSTANCE and RUN_DIR
use_instance() {
	export PIPELINE_INSTANCE=$BASE_INSTANCE-$1 PIPELINE_RUN_DIR=$IT_TMP/run-$1
	INSTANCE=$PIPELINE_INSTANCE
	RUN_DIR=$PIPELINE_RUN_DIR
}

# stop_instance N: stops case N's instance in the background.
stop_instance() {
	(
		use_instance "$1"
		"$PIPELINE" stop >/dev/null 2>&1
	) &
	stoppers+=($!)
}

# On the way out (a failure): stop what still runs, kill what a stop left, then lib.sh's cleanup.
fidelity_cleanup() {
	local status=$? n p
	set +e
	wait "${stoppers[@]}" 2>/dev/null
	stoppers=()
	for n in "${started[@]}"; do
		stop_instance "$n"
	done
	wait "${stoppers[@]}" 2>/dev/null
	for n in "${started[@]}"; do
		use_instance "$n"
		for p in $(instance_pids); do
			echo "[$IT_NAME] FAIL: a process of case instance $INSTANCE was left: $p" >&2
			kill -KILL "$p" 2>/dev/null
			status=1
		done
		for p in $(instance_shm); do
			echo "[$IT_NAME] FAIL: shared memory of case instance $INSTANCE was left: $p" >&2
			rm -f "$p"
			status=1
		done
	done
	# lib.sh's own instance, never started here, for it_cleanup.
	export PIPELINE_INSTANCE=$BASE_INSTANCE PIPELINE_RUN_DIR=$IT_TMP/run
	INSTANCE=$PIPELINE_INSTANCE
	# shellcheck disable=SC2034 # it_cleanup reads it
	RUN_DIR=$PIPELINE_RUN_DIR
	(exit "$status")
	it_cleanup
}
trap fidelity_cleanup EXIT

failed=()
experts_split=0 # routed experts split between the copies and the CPU over every case
cpu_jobs=0 # CPU share jobs and CPU experts over every case (FIDELITY_START_OPTS with --cpu-share)
# case_failed NAME WHY: notes a failure and goes on with the next case.
case_failed() {
	log "FAIL: $1: $2"
	failed+=("$1")
}

n=0
for fx in "${fixtures[@]}"; do
	n=$((n + 1))
	name=$(basename "$fx" .json)
	dir=$IT_TMP/$name
	mapfile -t args < <("$COMPARE" args "$fx")
	((${#args[@]} > 0)) || fail "$fx: no generator arguments (see above)"

	# The checkpoint, byte for byte the one the fixture was made from.
	"$BIN/make-synthetic-model" "${args[@]}" --out "$dir" --quiet >/dev/null ||
		fail "$name: make-synthetic-model ${args[*]} failed"
	"$COMPARE" files "$fx" >"$IT_TMP/$name.sha256" || fail "$fx: no file list"
	if ! sums=$(cd "$dir" && sha256sum --quiet -c "$IT_TMP/$name.sha256" 2>&1); then
		case_failed "$name" "make-synthetic-model ${args[*]} no longer writes the checkpoint the fixture was made \
from: the generator changed (${sums//$'\n'/; }); remake the fixtures (tests/fixtures/README.md)"
		continue
	fi
	want_files=$(sed 's/^[0-9a-f]*  //' "$IT_TMP/$name.sha256" | sort)
	got_files=$(find "$dir" -mindepth 1 -maxdepth 1 -printf '%f\n' | sort)
	if [[ $got_files != "$want_files" ]]; then
		case_failed "$name" "make-synthetic-model ${args[*]} writes the files ${got_files//$'\n'/ }, the fixture \
lists ${want_files//$'\n'/ }: the generator changed; remake the fixtures (tests/fixtures/README.md)"
		continue
	fi
	prompt=$("$COMPARE" prompt "$fx") || fail "$fx: no prompt"

	# Through the services.
	use_instance "$n"
	started+=("$n")
	opts=(${START_OPTS[@]+"${START_OPTS[@]}"})
	if [[ $BACKEND != cpu && " ${opts[*]} " == *" --gpu-budget min "* ]]; then
		# The smallest GPU window this model takes: every layer group streams where it has
		# more layers than the window's slots.
		min=$(gpu_budget_min "$dir" "$BACKEND")
		[[ -n $min ]] || fail "$name: the runner did not say its smallest --gpu-budget"
		for i in "${!opts[@]}"; do
			[[ ${opts[i]} == --gpu-budget ]] && opts[i + 1]=$min
		done
		log "$name: --gpu-budget $min (the smallest the runner takes)"
	fi
	"$PIPELINE" start --model "$dir" --backend "$BACKEND" ${opts[@]+"${opts[@]}"} >/dev/null
	logits=$IT_TMP/$name.logits
	ok=1
	if got=$("$PIPECTL" generate --tokens "$prompt" -n 32 --temperature 0 --ignore-eos --dump-logits "$logits"); then
		line=$("$COMPARE" logits "$fx" "$logits") || ok=0
		log "pipeline  $line"
		if [[ $BACKEND != cpu ]]; then
			# bf16: tokens count where the reference's margin exceeds twice the measured error.
			max_abs=$(sed -n 's/.*max |diff| \([0-9.e+-]*\) .*/\1/p' <<<"$line")
			export FIDELITY_TIE_MARGIN
			FIDELITY_TIE_MARGIN=$(python3 -c "print(2*float('${max_abs:-0}'))" 2>/dev/null || echo 0.05)
		fi
		"$COMPARE" tokens "$fx" "$got" | sed "s/^/[$IT_NAME] pipeline  /" || ok=0
	else
		log "FAIL: $name: pipectl generate failed"
		ok=0
	fi
	if [[ " ${opts[*]} " == *" --cpu-share "* ]]; then
		# What the CPU pool computed for this case: streamed FFNs split with it, routed experts.
		st=$("$PIPECTL" stats gpu-runner)
		jobs=$(sed -n '/"cpu_share"/,/}/s/^ *"jobs": *\([0-9]*\).*/\1/p' <<<"$st" | head -n 1)
		experts=$(sed -n '/"cpu_share"/,/}/s/^ *"experts": *\([0-9]*\).*/\1/p' <<<"$st" | head -n 1)
		split=$(sed -n 's/^ *"experts_split": *\([0-9]*\).*/\1/p' <<<"$st" | head -n 1)
		log "$name: ${jobs:-0} CPU share jobs, ${experts:-0} experts on the CPU, ${split:-0} split with it"
		experts_split=$((experts_split + ${split:-0}))
		cpu_jobs=$((cpu_jobs + ${jobs:-0} + ${experts:-0}))
		if ((${experts:-0} > 0)); then # the pool's experts shown where a user looks
			expect_grep "^CPU experts +[1-9][0-9]* routed experts computed by the CPU pool \\(${split:-0} of them an expert's rows split with the copies\\)" \
				"$("$PIPELINE" status 2>&1)" "$name: the CPU's experts in pipeline status"
			expect_grep "cpu +experts [1-9][0-9]* computed \\(${split:-0} of them an expert's rows split with the copies\\); a layer's [0-9.]+ ms" \
				"$("$PIPELINE" inspect --once 2>&1)" "$name: the CPU's experts in pipeline inspect"
		fi
	fi
	stop_instance "$n"

	# The same backend in one process: its tokens must agree too.
	if local_got=$("$BIN/run-local" --model "$dir" --backend "$BACKEND" --tokens "$prompt" -n 32 --ignore-eos); then
		"$COMPARE" tokens "$fx" "$local_got" | sed "s/^/[$IT_NAME] run-local /" || ok=0
	else
		log "FAIL: $name: run-local failed"
		ok=0
	fi
	((ok)) || case_failed "$name" "does not match its fixture $fx (above)"
done

# Every instance stopped, and left nothing behind.
for p in "${stoppers[@]}"; do
	wait "$p" || fail "a case instance did not stop cleanly (scripts/pipeline stop failed)"
done
stoppers=()
for n in "${started[@]}"; do
	use_instance "$n"
	expect_nothing_left "case instance $INSTANCE after stop"
done

if [[ " ${START_OPTS[*]} " == *" --cpu-share "* ]]; then
	expect_gt "$cpu_jobs" 0 "CPU share jobs and experts over every case (the cases that stream must use the CPU)"
fi
if [[ ${FIDELITY_EXPECT_SPLIT:-0} == 1 ]]; then
	expect_gt "$experts_split" 0 "routed experts split between the copies and the CPU over every case"
fi
((${#failed[@]} == 0)) || fail "${#failed[@]} of ${#fixtures[@]} cases differ from transformers: ${failed[*]}"
log "ok: ${#fixtures[@]} cases match transformers"

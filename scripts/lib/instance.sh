# shellcheck shell=bash
# instance.sh - sourced by scripts/pipeline: one instance's run directory, its supervisor and the
# service processes in it (find, talk to, stop, clean up after).
#
#   instance_init NAME              # sets INSTANCE, RUN_DIR (absolute; does not create it)
#   pid=$(supervisor_pid)           # the live pipeline-supervisor of this instance, or status 1
#   supervisor_run status --json    # pipeline-supervisor COMMAND --run-dir RUN_DIR ...
#   pid=$(svc_pid kv-store)         # the live kv-store of this instance, or status 1
#   svc_stop kv-store PID           # MSG_SHUTDOWN, wait, SIGKILL after a timeout (no supervisor)
#
# Reads BIN_DIR (the built binaries). The files of an instance, all in RUN_DIR:
#   supervisor.pid  supervisor.log  supervisor.ctl/.pub (its sockets)
#   <service>.pid  <service>.log  <service>.ctl/.pub  <service>.restart (a restart asked for)
#   start.args (the options of start, a record)

# Start order; stop goes the other way (the runner first, it holds groups and blocks).
SERVICES=(kv-store ssd-loader gpu-runner)
# shellcheck disable=SC2034 # used by scripts/pipeline
STOP_ORDER=(gpu-runner ssd-loader kv-store)

die() {
	echo "pipeline: $*" >&2
	exit 1
}

warn() {
	echo "pipeline: $*" >&2
}

instance_init() {
	INSTANCE=$1
	if [[ ! $INSTANCE =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ || ${#INSTANCE} -gt 40 ]]; then
		die "instance name '$INSTANCE' must be 1-40 letters, digits, '_', '.' or '-' (starting with a letter or digit)"
	fi
	RUN_DIR=${PIPELINE_RUN_DIR:-/tmp/llmp-$(id -u)/$INSTANCE}
	# The supervisor leaves its working directory and hands RUN_DIR to the services: absolute.
	[[ $RUN_DIR == /* ]] || RUN_DIR=$PWD/$RUN_DIR
}

# Creates RUN_DIR and its parents with mode 0700.
run_dir_prepare() {
	(umask 077 && mkdir -p "$RUN_DIR") || die "cannot create run directory $RUN_DIR"
	chmod 0700 "$RUN_DIR" || die "cannot set mode 0700 on run directory $RUN_DIR"
}

pipectl_run() {
	"$BIN_DIR/pipectl" --instance "$INSTANCE" --run-dir "$RUN_DIR" "$@"
}

# Is PID a live process (not a zombie) running SERVICE for this run directory? Guards
# against a stale pid file whose number now belongs to someone else.
proc_is_service() {
	local pid=$1 service=$2 comm state arg prev=""
	[[ $pid =~ ^[0-9]+$ ]] || return 1
	[[ -r /proc/$pid/comm ]] || return 1
	comm=$(<"/proc/$pid/comm") 2>/dev/null || return 1
	state=$(sed -n 's/^.*) \(.\).*$/\1/p' "/proc/$pid/stat" 2>/dev/null) || return 1
	[[ $state != Z && $state != X ]] || return 1
	local -a argv
	mapfile -d '' argv <"/proc/$pid/cmdline" 2>/dev/null || return 1
	# The service itself, or a tool it runs under (PIPELINE_WRAP_*) whose arguments run it.
	local runs=0 ours=0
	[[ $comm == "$service" ]] && runs=1
	for arg in "${argv[@]}"; do
		[[ ${arg##*/} == "$service" ]] && runs=1
		[[ $prev == --run-dir && $arg == "$RUN_DIR" ]] && ours=1
		[[ $arg == "--run-dir=$RUN_DIR" ]] && ours=1
		prev=$arg
	done
	((runs && ours))
}

# Prints the pid of this instance's supervisor if it is running.
supervisor_pid() {
	local pid
	[[ -f $RUN_DIR/supervisor.pid ]] || return 1
	pid=$(<"$RUN_DIR/supervisor.pid")
	proc_is_service "$pid" pipeline-supervisor || return 1
	printf '%s\n' "$pid"
}

# pipeline-supervisor COMMAND [ARGS] for this instance (status, wait, shutdown, restart).
supervisor_run() {
	local cmd=$1
	shift
	"$BIN_DIR/pipeline-supervisor" "$cmd" --run-dir "$RUN_DIR" "$@"
}

# Prints the pid of this instance's SERVICE if it is running.
svc_pid() {
	local service=$1 pid
	[[ -f $RUN_DIR/$service.pid ]] || return 1
	pid=$(<"$RUN_DIR/$service.pid")
	proc_is_service "$pid" "$service" || return 1
	printf '%s\n' "$pid"
}

# Waits up to SECONDS for PID to exit. Status 1 when it still runs then. An exited process
# stays a zombie until its parent (often init, which may reap only now and then) collects it;
# it is waited for a few seconds more, since a zombie still counts as the live owner of its
# shared-memory objects and a successor started meanwhile would be refused.
wait_exit() {
	local pid=$1 seconds=$2 i state
	for ((i = 0; i < seconds * 10; i++)); do
		[[ -e /proc/$pid ]] || return 0
		state=$(sed -n 's/^.*) \(.\).*$/\1/p' "/proc/$pid/stat" 2>/dev/null || true)
		[[ -n $state ]] || return 0
		# A zombie has exited: its sockets are closed and it owns no shared memory any more
		# (shm.c counts a zombie owner as dead), so there is nothing to wait for. Reaping it
		# is its parent's business (init, for a detached service).
		[[ $state == Z || $state == X ]] && return 0
		sleep 0.1
	done
	return 1
}

# Prints the last lines of SERVICE's log (or the supervisor's), indented, on stderr.
svc_log_tail() {
	local service=$1 log=$RUN_DIR/$1.log
	[[ -f $log ]] || return 0
	echo "---- last lines of $log:" >&2
	tail -n 20 "$log" | sed 's/^/  | /' >&2
}

# Stops SERVICE (process PID) without the supervisor (it was killed, or the service was started
# by hand): MSG_SHUTDOWN (it removes its shared state), SIGTERM if that is not answered, SIGKILL
# when it has not exited after 10 s.
svc_stop() {
	local service=$1 pid=$2
	if ! pipectl_run --timeout 5 shutdown "$service" >/dev/null 2>&1; then
		kill -TERM "$pid" 2>/dev/null || true
	fi
	# PIPELINE_STOP_TIMEOUT: seconds a service may take to exit (a sanitizer writing its
	# report needs longer than the default 10).
	local t=${PIPELINE_STOP_TIMEOUT:-10}
	if ! wait_exit "$pid" "$t"; then
		warn "$service (pid $pid) did not exit in $t s; killing it"
		kill -KILL "$pid" 2>/dev/null || true
		wait_exit "$pid" 5 || warn "$service (pid $pid) survived SIGKILL"
	fi
}

# Prints the pid of the live process that owns the shared-memory object FILE, if one does:
# common/shm.h's header holds the magic at byte 0, owner_pid (int32) at byte 32 and owner_start
# (uint64, clock ticks since boot, /proc/PID/stat's field 22, which guards against a reused pid)
# at byte 40. A zombie owns nothing. Status 1 when no live process owns it.
shm_live_owner() {
	local f=$1 magic pid start stat state
	local -a fields
	magic=$(od -An -t x8 -N 8 "$f" 2>/dev/null | tr -d ' ') || return 1
	[[ $magic == 4d485350504c4c4c ]] || return 1
	pid=$(od -An -t d4 -j 32 -N 4 "$f" 2>/dev/null | tr -d ' ') || return 1
	start=$(od -An -t u8 -j 40 -N 8 "$f" 2>/dev/null | tr -d ' ') || return 1
	[[ $pid =~ ^[0-9]+$ && $start =~ ^[0-9]+$ ]] && ((pid > 0)) || return 1
	stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
	read -r -a fields <<<"${stat##*) }"
	state=${fields[0]:-}
	[[ -n $state && $state != Z && $state != X ]] || return 1
	[[ $start == 0 || ${fields[19]:-} == "$start" ]] || return 1
	printf '%s\n' "$pid"
}

# Removes what a stopped instance leaves: pid files, sockets, restart markers, start.args, a dead
# kv-store's spill file and its shared-memory objects (/dev/shm/llmp-<uid>-<instance>-<object>),
# except one a live process owns: that belongs to another instance of the same name (in another
# run directory), whose start this may be cleaning up after. Logs stay.
instance_cleanup() {
	local service f prefix owner
	for service in supervisor "${SERVICES[@]}"; do
		rm -f "$RUN_DIR/$service.pid" "$RUN_DIR/$service.pid.tmp" "$RUN_DIR/$service.ctl" "$RUN_DIR/$service.pub" \
			"$RUN_DIR/$service.restart"
	done
	# A dead kv-store's spill file at its default place (a live one removes it on MSG_SHUTDOWN).
	rm -f "$RUN_DIR/start.args" "$RUN_DIR/kv-spill.bin"
	prefix=/dev/shm/llmp-$(id -u)-$INSTANCE-
	for f in "$prefix"*; do
		[[ -e $f ]] || continue
		# Object names hold no '-': a remainder with one belongs to an instance whose name
		# starts like ours ("demo" must not take "demo-2"'s objects).
		[[ ${f#"$prefix"} == *-* ]] && continue
		if owner=$(shm_live_owner "$f"); then
			warn "left $f: the live process $owner owns it (an instance $INSTANCE with another run directory?)"
			continue
		fi
		rm -f "$f"
	done
}

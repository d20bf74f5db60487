# shellcheck shell=bash
# instance.sh - sourced by scripts/pipeline: one instance's run directory, and the commands of
# pipeline-supervisor that find, stop and clean up after its processes. The supervisor owns the
# service list, the stop order and what an instance leaves behind; this only asks it.
#
#   instance_init NAME              # sets INSTANCE, RUN_DIR (absolute; does not create it)
#   supervisor_run status --json    # pipeline-supervisor COMMAND --instance I --run-dir RUN_DIR ...
#   pid=$(supervisor_pid)           # the live pipeline-supervisor of this instance, or status 1
#   mapfile -t s < <(services)      # the services in start order
#
# Reads BIN_DIR (the built binaries). The files of an instance, all in RUN_DIR:
#   supervisor.pid  supervisor.log  supervisor.ctl/.pub (its sockets)
#   <service>.pid  <service>.log  <service>.ctl/.pub  <service>.restart (a restart asked for)
#   start.args (the options of start, a record)
#   start.timeouts (PIPELINE_READY_TIMEOUT and PIPELINE_STOP_TIMEOUT as start took them: stop
#   and restart wait by them where the caller sets neither)

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

# Dies where a live supervisor in RUN_DIR runs another instance than INSTANCE (one
# PIPELINE_RUN_DIR for several instances names one directory: stop or status of one would act on
# the other's).
run_dir_owner_check() {
	local pid w prev="" other=""
	pid=$(supervisor_pid 2>/dev/null) || return 0
	local -a words=()
	mapfile -d '' words <"/proc/$pid/cmdline" 2>/dev/null || return 0
	for w in ${words[@]+"${words[@]}"}; do
		[[ $prev == --instance ]] && other=$w
		[[ $w == --instance=* ]] && other=${w#*=}
		prev=$w
	done
	[[ -z $other || $other == "$INSTANCE" ]] ||
		die "the run directory $RUN_DIR is instance $other's, not $INSTANCE's (PIPELINE_RUN_DIR names one" \
			"directory whatever the instance): give --instance $other, or another PIPELINE_RUN_DIR"
}

# Creates RUN_DIR and its parents with mode 0700, after checking every directory above it as the
# services do (common/service.c, private_dir_prepare): this user's or root's, not writable by
# others unless sticky, no other user's link; else whoever may write one could replace the run
# directory, and what this script writes in it (start.args, the lock) would be theirs to read.
run_dir_prepare() {
	local d=$RUN_DIR uid owner mode role="the run directory's parent"
	uid=$(id -u)
	while [[ $d != / ]]; do
		d=$(dirname -- "$d")
		if [[ -e $d || -L $d ]]; then
			if [[ -L $d ]]; then
				owner=$(stat -c %u -- "$d") || die "cannot look at $d"
				((owner == uid || owner == 0)) ||
					die "$d, $role, is a symbolic link of uid $owner: another user could replace the run directory (set PIPELINE_RUN_DIR elsewhere)"
			fi
			read -r owner mode < <(stat -L -c '%u %a' -- "$d") || die "cannot look at $d, $role"
			((owner == uid || owner == 0)) ||
				die "$d, $role, belongs to uid $owner: another user could replace the run directory (set PIPELINE_RUN_DIR elsewhere)"
			(((8#$mode & 8#022) == 0 || (8#$mode & 8#1000) != 0)) ||
				die "$d, $role, is writable by other users (mode $mode, not sticky): another user could replace the run directory (chmod go-w it, or set PIPELINE_RUN_DIR elsewhere)"
		fi
		role="a directory above the run directory"
	done
	(umask 077 && mkdir -p "$RUN_DIR") || die "cannot create run directory $RUN_DIR"
	chmod 0700 "$RUN_DIR" || die "cannot set mode 0700 on run directory $RUN_DIR"
}

pipectl_run() {
	"$BIN_DIR/pipectl" --instance "$INSTANCE" --run-dir "$RUN_DIR" "$@"
}

# pipeline-supervisor COMMAND [ARGS] for this instance (status, wait, shutdown, restart, pids, ps,
# stop, cleanup).
supervisor_run() {
	local cmd=$1
	shift
	"$BIN_DIR/pipeline-supervisor" "$cmd" --instance "$INSTANCE" --run-dir "$RUN_DIR" "$@"
}

# Prints the pid of this instance's supervisor if it is running (its pid file names a live
# pipeline-supervisor of this run directory).
supervisor_pid() {
	supervisor_run pids supervisor
}

# Prints the services in start order, one a line.
services() {
	"$BIN_DIR/pipeline-supervisor" services
}

# Prints the last lines of SERVICE's log (or the supervisor's), indented, on stderr.
svc_log_tail() {
	local log=$RUN_DIR/$1.log
	[[ -f $log ]] || return 0
	echo "---- last lines of $log:" >&2
	tail -n 20 "$log" | sed 's/^/  | /' >&2
}

# Prints where this instance's http-api (start --http, run by the supervisor) listens, from its log:
# http://ADDR:PORT (port 0 given: the one the system picked, for the process running now).
http_url() {
	grep -o 'listening on http://[^ ]*' "$RUN_DIR/http-api.log" 2>/dev/null | tail -n 1 | sed 's/^listening on //'
}

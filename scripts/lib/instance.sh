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

# ---- http-api (start --http): runs beside the supervisor, not under it ----
# Its files: http-api.pid, http-api.log. scripts/pipeline starts it after the services are up and
# stops it before them.

# Prints the pid of this instance's http-api if its pid file names a live http-api of RUN_DIR.
http_pid() {
	local pid word prev="" ours=0
	pid=$(head -n 1 "$RUN_DIR/http-api.pid" 2>/dev/null) || return 1
	[[ $pid =~ ^[0-9]+$ ]] || return 1
	[[ -r /proc/$pid/cmdline ]] || return 1
	[[ $(sed -n 's/^.*) \(.\).*$/\1/p' "/proc/$pid/stat" 2>/dev/null) != [ZX] ]] || return 1
	while IFS= read -r -d '' word; do
		[[ $prev == --run-dir && $word == "$RUN_DIR" ]] && ours=1
		prev=$word
	done <"/proc/$pid/cmdline"
	((ours)) && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == http-api ]] || return 1
	printf '%s\n' "$pid"
}

# http_start ADDR:PORT [FLAG...]: starts http-api for this instance and waits until it listens
# (its log says so) or exits. Returns 1 after printing why when it did not start.
http_start() {
	local listen=$1 pid log=$RUN_DIR/http-api.log i before
	shift
	[[ -x $BIN_DIR/http-api ]] || {
		warn "no $BIN_DIR/http-api: the build did not produce it (is libmicrohttpd-dev installed?)"
		return 1
	}
	before=$(stat -c %s "$log" 2>/dev/null || echo 0)
	setsid "$BIN_DIR/http-api" --instance "$INSTANCE" --run-dir "$RUN_DIR" --listen "$listen" "$@" \
		</dev/null >>"$log" 2>&1 &
	pid=$!
	(umask 077 && echo "$pid" >"$RUN_DIR/http-api.pid")
	for ((i = 0; i < 100; i++)); do
		if tail -c +$((before + 1)) "$log" 2>/dev/null | grep -q 'listening on http://'; then
			echo "http-api ready (pid $pid): $(tail -c +$((before + 1)) "$log" | grep -o 'http://[^ ]*' | head -n 1)/v1"
			return 0
		fi
		if ! kill -0 "$pid" 2>/dev/null; then
			break
		fi
		sleep 0.1
	done
	warn "http-api did not start listening on $listen"
	svc_log_tail http-api
	http_stop
	return 1
}

# Stops this instance's http-api (SIGTERM, SIGKILL after 10 s) and removes its pid file. Prints
# "http-api" when one was running.
http_stop() {
	local pid i
	if pid=$(http_pid); then
		kill -TERM "$pid" 2>/dev/null || true
		for ((i = 0; i < 100; i++)); do
			http_pid >/dev/null || break
			sleep 0.1
		done
		if http_pid >/dev/null; then
			kill -KILL "$pid" 2>/dev/null || true
			sleep 0.2
		fi
		echo http-api
	fi
	rm -f "$RUN_DIR/http-api.pid"
}

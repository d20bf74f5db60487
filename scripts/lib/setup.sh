# shellcheck shell=bash
# setup.sh - sourced by scripts/pipeline and scripts/test: make sure the Debian packages the
# build needs are installed, then configure (once) and build the tree.
#
#   source "$REPO_ROOT/scripts/lib/setup.sh"
#   pipeline_setup            # exits 1 with a message when it cannot proceed
#
# Reads: REPO_ROOT (set by the caller), PIPELINE_BUILD_DIR (default $REPO_ROOT/build),
# PIPELINE_SKIP_SETUP=1 (skip everything: tests set it, they must not rebuild).
# Sets: BUILD_DIR.

: "${REPO_ROOT:?setup.sh needs REPO_ROOT}"
BUILD_DIR=${PIPELINE_BUILD_DIR:-$REPO_ROOT/build}

# What the build needs, as Debian 12 names it.
PIPELINE_PACKAGES=(build-essential cmake pkg-config libzmq3-dev liburing-dev libmsgpack-dev check
	libjansson-dev libpcre2-dev)

# Prints the packages of PIPELINE_PACKAGES that are not installed, one per line.
setup_missing_packages() {
	local pkg status
	for pkg in "${PIPELINE_PACKAGES[@]}"; do
		status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
		[[ $status == "install ok installed" ]] || printf '%s\n' "$pkg"
	done
}

setup_packages() {
	if ! command -v dpkg-query >/dev/null 2>&1; then
		echo "setup: dpkg-query not found: this is not a Debian system; install the equivalents of:" >&2
		echo "  ${PIPELINE_PACKAGES[*]}" >&2
		echo "setup: then run with PIPELINE_SKIP_SETUP=1 after building with cmake yourself" >&2
		exit 1
	fi
	local missing
	mapfile -t missing < <(setup_missing_packages)
	((${#missing[@]} == 0)) && return 0
	local -a sudo=()
	if ((EUID != 0)); then
		if sudo -n true 2>/dev/null; then
			sudo=(sudo -n)
		else
			echo "setup: missing Debian packages: ${missing[*]}" >&2
			echo "setup: install them as root, then run this again:" >&2
			echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
			exit 1
		fi
	fi
	echo "setup: installing ${missing[*]}" >&2
	local log
	log=$(mktemp)
	if ! { "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update &&
		"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
			"${missing[@]}"; } >"$log" 2>&1; then
		cat "$log" >&2
		rm -f "$log"
		echo "setup: installing ${missing[*]} failed (output above)" >&2
		exit 1
	fi
	rm -f "$log"
}

# Configures BUILD_DIR once and builds it; quiet on success, the whole output on failure.
setup_build() {
	mkdir -p "$BUILD_DIR"
	[[ -f $BUILD_DIR/CMakeCache.txt ]] || echo "setup: configuring and building in $BUILD_DIR (first time: a minute or so)" >&2
	local log
	log=$(mktemp)
	# One build at a time in a build directory: two commands started together must not
	# both run make in it. The lock's descriptor lives only in this subshell, so nothing
	# started later (the services) inherits it.
	if ! (
		flock 9
		if [[ ! -f $BUILD_DIR/CMakeCache.txt ]]; then
			cmake -S "$REPO_ROOT" -B "$BUILD_DIR" || exit 1
		fi
		cmake --build "$BUILD_DIR" -j"$(nproc)"
	) 9>"$BUILD_DIR/.setup.lock" >"$log" 2>&1; then
		cat "$log" >&2
		rm -f "$log"
		echo "setup: the build in $BUILD_DIR failed (output above)" >&2
		exit 1
	fi
	rm -f "$log"
}

pipeline_setup() {
	[[ ${PIPELINE_SKIP_SETUP:-0} == 1 ]] && return 0
	setup_packages
	setup_build
}

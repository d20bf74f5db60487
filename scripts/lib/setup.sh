# shellcheck shell=bash
# setup.sh - sourced by scripts/pipeline and scripts/test: make sure the Debian packages the
# build needs are installed, then configure (once) and build the tree.
#
#   source "$REPO_ROOT/scripts/lib/setup.sh"
#   pipeline_setup            # exits 1 with a message when it cannot proceed
#
# Reads: REPO_ROOT (set by the caller), PIPELINE_BUILD_DIR (default $REPO_ROOT/build),
# PIPELINE_SKIP_SETUP=1 (skip everything: tests set it, they must not rebuild),
# PIPELINE_FUZZ_BUILD_DIR (default $BUILD_DIR/fuzz), PIPELINE_FUZZ_CC (the clang for it).
# Sets: BUILD_DIR, FUZZ_BUILD_DIR.

: "${REPO_ROOT:?setup.sh needs REPO_ROOT}"
BUILD_DIR=${PIPELINE_BUILD_DIR:-$REPO_ROOT/build}

# What the build needs, as Debian 12 names it. clang-14 and libclang-rt-14-dev (libFuzzer and the
# sanitizer runtimes) build the fuzzers that scripts/test runs (tests/fuzz, docs/fuzzing.md); curl
# and jq are the HTTP API test's client (tests/integration/http_api.sh).
PIPELINE_PACKAGES=(build-essential cmake pkg-config libzmq3-dev liburing-dev libmsgpack-dev check
	libjansson-dev libpcre2-dev libmicrohttpd-dev clang-14 libclang-rt-14-dev curl jq)

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

# The fuzz build (tests/fuzz, docs/fuzzing.md): a build directory of its own, configured with clang
# and -DPIPELINE_FUZZ=ON, which builds the libFuzzer harnesses and nothing else. scripts/test
# configures it with setup_fuzz_configure, builds it with setup_fuzz_build and runs its ctest tests.
FUZZ_BUILD_DIR=${PIPELINE_FUZZ_BUILD_DIR:-$BUILD_DIR/fuzz}

# Prints the path of the clang to build the fuzzers with; fails, saying what to install, when
# there is none.
setup_fuzz_compiler() {
	local cc
	for cc in ${PIPELINE_FUZZ_CC:-} clang-14 clang; do
		if command -v "$cc" >/dev/null 2>&1; then
			command -v "$cc"
			return 0
		fi
	done
	echo "setup: the fuzz step needs clang with libFuzzer, and no clang was found (PIPELINE_FUZZ_CC, clang-14, clang)" >&2
	echo "setup: install it, then run this again:" >&2
	echo "  sudo apt-get install -y --no-install-recommends clang-14 libclang-rt-14-dev" >&2
	return 1
}

# Runs "$@" (a cmake step in FUZZ_BUILD_DIR) under the directory's lock; quiet on success, the
# whole output and exit 1 on failure.
setup_fuzz_step() {
	local log
	mkdir -p "$FUZZ_BUILD_DIR"
	log=$(mktemp)
	if ! (
		flock 9
		"$@"
	) 9>"$FUZZ_BUILD_DIR/.setup.lock" >"$log" 2>&1; then
		cat "$log" >&2
		rm -f "$log"
		echo "setup: the fuzz build in $FUZZ_BUILD_DIR failed (output above)" >&2
		exit 1
	fi
	rm -f "$log"
}

# Configures FUZZ_BUILD_DIR unless it is configured already (a Makefile or build.ninja is written
# only by a configure that succeeded: one that failed, for want of libFuzzer say, runs again).
setup_fuzz_configure() {
	[[ -f $FUZZ_BUILD_DIR/Makefile || -f $FUZZ_BUILD_DIR/build.ninja ]] && return 0
	local cc
	cc=$(setup_fuzz_compiler) || exit 1
	echo "setup: configuring the fuzzers in $FUZZ_BUILD_DIR with $cc" >&2
	setup_fuzz_step env CC="$cc" cmake -S "$REPO_ROOT" -B "$FUZZ_BUILD_DIR" -DPIPELINE_FUZZ=ON -DPIPELINE_CUDA=OFF
}

setup_fuzz_build() {
	setup_fuzz_configure
	setup_fuzz_step cmake --build "$FUZZ_BUILD_DIR" -j"$(nproc)"
}

pipeline_setup() {
	[[ ${PIPELINE_SKIP_SETUP:-0} == 1 ]] && return 0
	setup_packages
	setup_build
}

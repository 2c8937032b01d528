#!/bin/sh
# Set up everything flamed needs on a Debian 12 machine, idempotently.
#   packaging/setup.sh          runtime: apt packages, kernel headers for bcc, .venv
#   packaging/setup.sh --test   also what the test suite needs (go, promtool, chromium, perf)
# Re-running when everything is in place takes a few seconds: apt is only
# called for packages that are missing, pip only when requirements changed.
set -eu

HERE=$(cd "$(dirname "$0")/.." && pwd)
VENV="$HERE/.venv"
WANT_TEST=0
[ "${1:-}" = "--test" ] && WANT_TEST=1

log() { echo "setup: $*" >&2; }

RUNTIME_PKGS="python3 python3-venv python3-bpfcc bpfcc-tools python3-systemd linux-headers-amd64 libcap2-bin util-linux"
TEST_PKGS="golang-go prometheus chromium linux-perf bpftool perl gzip procps gcc g++ binutils libc6-dev nodejs lintian"

missing=""
check_pkgs() {
    for p in "$@"; do
        if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
            missing="$missing $p"
        fi
    done
}
check_pkgs $RUNTIME_PKGS
[ "$WANT_TEST" = 1 ] && check_pkgs $TEST_PKGS
NODE_DIR="$HERE/tests/.node"
SPEEDSCOPE="$NODE_DIR/node_modules/speedscope/package.json"
# npm installs speedscope below; Debian's nodejs comes without it (NodeSource's bundles
# it), so Debian's npm is installed with the rest only when no npm is on PATH.
if [ "$WANT_TEST" = 1 ] && [ ! -f "$SPEEDSCOPE" ] && ! command -v npm >/dev/null 2>&1; then
    missing="$missing npm"
fi
if [ -n "$missing" ]; then
    if [ "$(id -u)" != 0 ]; then
        log "missing Debian packages:$missing; run this script as root (or install them) and retry"
        exit 1
    fi
    log "installing Debian packages:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || { log "error: apt-get update failed (its message is above); check the network and /etc/apt/sources.list, then run this again"; exit 1; }
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing >/dev/null \
        || { log "error: apt-get could not install:$missing (its message is above); run this again once it can"; exit 1; }
fi

# Kernel headers for bcc. bcc looks in /lib/modules/$(uname -r)/{build,source}.
# When the running kernel ships no headers of its own, point those links at the
# newest Debian linux-headers-*-amd64 (generated, arch) and -common (source) tree.
# The BPF program only uses UAPI types and BTF-backed helpers, so a version
# mismatch cannot change what it reads.
KREL=$(uname -r)
MODDIR="/lib/modules/$KREL"
if [ ! -e "$MODDIR/build/include/generated/autoconf.h" ] && [ ! -e "$MODDIR/build/include/linux/kconfig.h" ]; then
    arch_dir=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -z "$arch_dir" ]; then
        log "no kernel headers for $KREL and no Debian linux-headers-*-amd64 found; bcc will not compile"
        exit 1
    fi
    common_dir=$(echo "$arch_dir" | sed 's/-amd64$/-common/')
    if [ "$(id -u)" = 0 ]; then
        log "kernel $KREL has no headers; using $(basename "$arch_dir") (+ $(basename "$common_dir")) for bcc"
        mkdir -p "$MODDIR"
        ln -sfn "$arch_dir" "$MODDIR/build"
        ln -sfn "$common_dir" "$MODDIR/source"
    else
        log "kernel $KREL has no headers; as root this script would link $arch_dir into $MODDIR"
    fi
fi

# The venv: Debian's python3 (bcc's binding only works there) with system site
# packages, so `import bcc` and `import systemd` resolve to Debian's modules.
# A .venv made by hand without system site packages would never see bcc: re-made.
if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    /usr/bin/python3 -m venv --clear --system-site-packages "$VENV"
elif ! grep -qx 'include-system-site-packages *= *true' "$VENV/pyvenv.cfg" 2>/dev/null; then
    log "$VENV does not use the system site packages (bcc would not import); re-creating it"
    /usr/bin/python3 -m venv --clear --system-site-packages "$VENV"
fi
STAMP="$VENV/.flamed-installed"
REQS="$HERE/packaging/requirements.txt"
sum=$(cat "$REQS" "$HERE/pyproject.toml" | sha256sum | cut -d' ' -f1)
pip_failed() {
    log "error: pip could not install $1 into $VENV (pip's message is above)"
    log "  is the package index reachable? (PIP_INDEX_URL=${PIP_INDEX_URL:-unset: pip's config or pypi.org})"
    log "  run this again once it is: it picks up where it stopped"
    exit 1
}
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$sum" ] || [ ! -x "$VENV/bin/flamed" ]; then
    # Checked only when there is something to install: a venv whose creation was
    # cut short (Ctrl-C during ensurepip) has a python but a pip that cannot run,
    # and every later run would fail on it the same way.
    if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
        log "$VENV is incomplete (its pip does not run); re-creating it"
        /usr/bin/python3 -m venv --clear --system-site-packages "$VENV"
    fi
    log "installing Python dependencies into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQS" || pip_failed "$REQS"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$HERE" \
        || pip_failed "flamed itself (pip install -e $HERE)"
    echo "$sum" > "$STAMP"
fi
"$VENV/bin/python" -c 'import bcc' 2>/dev/null || log "warning: bcc does not import in $VENV (is python3-bpfcc installed?)"
# speedscope (npm) for the test that loads our speedscope JSON with its own importer;
# project-local, pinned, installed once.
if [ "$WANT_TEST" = 1 ] && [ ! -f "$SPEEDSCOPE" ]; then
    log "installing speedscope (npm) into $NODE_DIR"
    mkdir -p "$NODE_DIR"
    npm install --prefix "$NODE_DIR" --no-audit --no-fund --no-save --silent speedscope@1.25.0 >/dev/null
fi
log "ready: $VENV/bin/flamed"

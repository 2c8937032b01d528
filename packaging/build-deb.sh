#!/bin/sh
# Build flamed_<version>_amd64.deb with dpkg-deb, from this checkout and the
# pinned runtime dependencies that `make setup` installed into .venv.
#   packaging/build-deb.sh [OUTDIR]       (default: ./build)
# Layout of the package:
#   /usr/bin/flamed                      launcher (Debian's /usr/bin/python3, for bcc)
#   /usr/lib/flamed/site/                flamed + prometheus_client, pyroute2, protobuf, google-re2 (pinned)
#   /usr/lib/flamed/bin/py-spy           py-spy (pinned), found through PATH by the launcher
#   /usr/share/flamed/bpf/               profile.bpf.c + flamed.h, compiled by bcc at start
#   /etc/flamed/flamed.toml              documented default config (conffile)
#   /lib/systemd/system/flamed.{service,socket}, /usr/lib/sysusers.d, /usr/lib/tmpfiles.d
#   /usr/share/doc/flamed/               docs
set -eu

HERE=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-"$HERE/build"}
VENV="$HERE/.venv"
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "build-deb: $PY missing; run 'make setup' first" >&2; exit 1; }
VERSION=$("$PY" -c 'import flamed; print(flamed.__version__)')
SITE=$("$PY" -c 'import prometheus_client, os; print(os.path.dirname(os.path.dirname(prometheus_client.__file__)))')
ARCH=$(dpkg --print-architecture)

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
R="$STAGE/root"
mkdir -p "$R/DEBIAN" "$R/usr/bin" "$R/usr/lib/flamed/site" "$R/usr/lib/flamed/bin" "$R/usr/share/flamed/bpf" \
         "$R/etc/flamed" "$R/lib/systemd/system" "$R/usr/lib/sysusers.d" "$R/usr/lib/tmpfiles.d" \
         "$R/usr/share/doc/flamed"

copy_tree() {  # copy a Python package without caches
    (cd "$1" && tar --exclude=__pycache__ --exclude='*.pyc' -cf - "$2") | (cd "$3" && tar -xf -)
}
copy_tree "$HERE" flamed "$R/usr/lib/flamed/site"
for pkg in prometheus_client pyroute2 google re2; do
    copy_tree "$SITE" "$pkg" "$R/usr/lib/flamed/site"
done
for d in "$SITE"/prometheus_client-*.dist-info "$SITE"/pyroute2-*.dist-info "$SITE"/protobuf-*.dist-info "$SITE"/google_re2-*.dist-info; do
    copy_tree "$SITE" "$(basename "$d")" "$R/usr/lib/flamed/site"
done
install -m 0755 "$VENV/bin/py-spy" "$R/usr/lib/flamed/bin/py-spy"
install -m 0644 "$HERE/bpf/profile.bpf.c" "$HERE/bpf/flamed.h" "$R/usr/share/flamed/bpf/"
install -m 0644 "$HERE/packaging/flamed.toml" "$R/etc/flamed/flamed.toml"
install -m 0644 "$HERE/systemd/flamed.service" "$HERE/systemd/flamed.socket" "$R/lib/systemd/system/"
install -m 0644 "$HERE/systemd/flamed.sysusers" "$R/usr/lib/sysusers.d/flamed.conf"
install -m 0644 "$HERE/systemd/flamed.tmpfiles" "$R/usr/lib/tmpfiles.d/flamed.conf"
for doc in "$HERE"/docs/*.md "$HERE/README.md"; do
    [ -f "$doc" ] && install -m 0644 "$doc" "$R/usr/share/doc/flamed/"
done

cat > "$R/usr/bin/flamed" <<'PYEOF'
#!/usr/bin/python3
# flamed launcher: Debian's python3 (the only one bcc's binding works with),
# flamed and its pinned dependencies from ../lib/flamed, py-spy on PATH.
import os
import sys

_root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path.insert(0, os.path.join(_root, "lib", "flamed", "site"))
os.environ["PATH"] = os.path.join(_root, "lib", "flamed", "bin") + os.pathsep + os.environ.get("PATH", "")
os.environ.setdefault("FLAMED_BPF_DIR", os.path.join(_root, "share", "flamed", "bpf"))

from flamed.cli import entry  # noqa: E402

entry()
PYEOF
chmod 0755 "$R/usr/bin/flamed"

SIZE=$(du -sk "$R" | cut -f1)
cat > "$R/DEBIAN/control" <<CTL
Package: flamed
Version: $VERSION
Architecture: $ARCH
Maintainer: flamed maintainers <flamed@localhost>
Installed-Size: $SIZE
Depends: python3 (>= 3.11), python3-bpfcc, python3-systemd, systemd
Recommends: linux-headers-amd64 | linux-headers-generic, bpfcc-tools
Section: devel
Priority: optional
Homepage: https://localhost/flamed
Description: continuous system-wide profiler with BPF and flame graphs
 flamed samples kernel and user stacks on every CPU with a BPF perf-event
 program, merges Python frames from py-spy, writes rotating folded-stack
 files, exposes Prometheus metrics and serves snapshots on a Unix socket.
 The flamed command is also an offline flame graph toolkit.
CTL
echo "/etc/flamed/flamed.toml" > "$R/DEBIAN/conffiles"
cat > "$R/DEBIAN/postinst" <<'SH'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    command -v systemd-sysusers >/dev/null && systemd-sysusers flamed.conf || true
    command -v systemd-tmpfiles >/dev/null && systemd-tmpfiles --create flamed.conf || true
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload || true
        systemctl enable flamed.service flamed.socket >/dev/null || true
        systemctl restart flamed.socket flamed.service || true
    fi
fi
SH
cat > "$R/DEBIAN/prerm" <<'SH'
#!/bin/sh
set -e
if [ -d /run/systemd/system ] && [ "$1" = remove ]; then
    systemctl disable --now flamed.service flamed.socket >/dev/null || true
fi
SH
cat > "$R/DEBIAN/postrm" <<'SH'
#!/bin/sh
set -e
[ -d /run/systemd/system ] && systemctl daemon-reload || true
if [ "$1" = purge ]; then rm -rf /var/lib/flamed; fi
SH
chmod 0755 "$R/DEBIAN/postinst" "$R/DEBIAN/prerm" "$R/DEBIAN/postrm"

mkdir -p "$OUT"
DEB="$OUT/flamed_${VERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group -Zgzip --build "$R" "$DEB" >/dev/null
echo "$DEB"

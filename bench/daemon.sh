#!/bin/sh
# Cost of the flamed daemon at 19 and 99 Hz: daemon CPU (user+sys from /proc),
# BPF program run time (bpftool prog show, kernel.bpf_stats_enabled=1), workload
# slowdown versus no daemon in the same run, RSS.  Root, bcc, gcc, bpftool.
#   sudo bench/daemon.sh [SECONDS_PER_RATE (60)] [RATES ("19 99")]
set -eu
HERE=$(cd "$(dirname "$0")/.." && pwd)
exec "$HERE/.venv/bin/python" "$HERE/bench/daemon_cost.py" --seconds "${1:-60}" --rates "${2:-19 99}"

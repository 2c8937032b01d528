#!/bin/sh
# Mixed-mode accuracy and overhead (see bench/mixed.py). Run as root from the checkout:
#   bench/mixed.sh [-r REPEAT] [--iters N] [--json FILE]
set -eu
cd "$(dirname "$0")/.."
exec .venv/bin/python bench/mixed.py "$@"

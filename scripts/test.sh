#!/usr/bin/env bash
# Set up, then run the whole test suite (the S3 tests start their own server on 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=25 "$@"

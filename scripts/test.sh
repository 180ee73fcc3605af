#!/usr/bin/env bash
# Set up, then run the whole test suite (the S3 tests start their own server on 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers (pytest-xdist) on the 2-core CI machine: most tests are single-process Python and
# the suite took ~17 min serially; CKPTCTL_TEST_WORKERS=0 runs it in one process (-n 0).
exec .venv/bin/python -m pytest -q --durations=25 -n "${CKPTCTL_TEST_WORKERS:-2}" "$@"
